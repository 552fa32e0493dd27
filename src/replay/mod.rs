//! Replay (`docs/config.md#replay`): drives the real chunking actors through a request trace as
//! an engine would, on a simulated clock, and reports what the chunking config does to budgets,
//! overruns and latency.
//!
//! - [`trace`]: the Azure CSV and Mooncake JSON Lines readers, and the bundled trace;
//! - [`sim`]: the simulation loop: arrivals, steps, decode rows, speculation, prefix cache;
//! - [`prefix_cache`]: the LRU of prompt blocks keyed by a trace's block hashes;
//! - [`settings`]: the `[replay]` section, checked once for `check` and `replay`;
//! - [`step_log`]: the `--step-log` JSON Lines writer, and outputs written by rename;
//! - [`report`]: the summary table and the `--report-json` document.
//!
//! [`run`] must be awaited inside an actix system: it starts its own [`ChunkingManagement`] on
//! the current arbiter.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Arc;
use std::time::Instant;

use crate::budget::{BudgetValue, NodeBudget};
use crate::config::Settings;
use crate::error::ChunkingError;
use crate::manifest::Manifest;
use crate::{ChunkingManagement, Name};

pub mod arrivals;
pub mod kv;
pub mod prefix_cache;
pub mod report;
pub mod settings;
pub mod sim;
pub mod step_log;
pub mod trace;

pub use report::ReplayReport;
pub use report::{RunSettings, StepDurations};
pub use settings::{KvSetup, Setup};
pub use trace::{BadLine, Trace, TraceError, TraceFormat};

/// The walk prompts are admitted on.
pub const PREFILL_WALK: &str = "prefill";
/// The walk generated tokens run on, as continuing rows.
pub const DECODE_WALK: &str = "decode";

/// What to replay and what to write; the CLI's `replay` flags.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplayOptions {
    /// The trace (`.csv` Azure, `.jsonl` Mooncake); `None`: the bundled trace.
    pub trace: Option<PathBuf>,
    /// Replay only the first N requests.
    pub requests: Option<usize>,
    /// Arrivals `rate_scale` times as dense as the trace's (2.0: "what if traffic doubled?").
    pub rate_scale: f64,
    /// Turn every budget off, to compare with chunking.
    pub budget_off: bool,
    /// `--budget N|off`: the token budget of the replayed node's step walks, over the config's
    /// (after `budget_off`).
    pub budget: Option<BudgetValue>,
    /// `--format`: the trace's format, instead of what its header or extension says.
    pub format: Option<TraceFormat>,
    /// `--arrivals`: generated arrival times for a length-only trace (seeded from
    /// `[replay] speculation.seed`).
    pub arrivals: Option<arrivals::Arrivals>,
    /// Write the step log here.
    pub step_log: Option<PathBuf>,
    /// Write the report as JSON here.
    pub report_json: Option<PathBuf>,
    /// Count and leave out bad trace lines instead of failing.
    pub skip_bad_lines: bool,
    /// Show a progress bar (only when stderr is a terminal).
    pub progress: bool,
    /// Input files besides the trace (config layers, the model) that the outputs must not
    /// overwrite.
    pub inputs: Vec<PathBuf>,
    /// Stop at a step boundary on SIGINT or SIGTERM and report what ran, marked interrupted.
    pub handle_signals: bool,
    /// Called after every step with the number of steps run so far.
    pub on_step: Option<StepHook>,
    /// Stop at a step boundary once this holds a signal number (a sweep's workers share one
    /// that its own signal watch sets); with `handle_signals`, the signals set it too.
    pub stop: Option<StopFlag>,
}

/// A flag shared by replays that are to stop together: 0 while running, else the number of the
/// signal that stopped them (see [`signal_name`]).
#[derive(Debug, Clone, Default)]
pub struct StopFlag(pub Arc<AtomicI32>);

impl StopFlag {
    /// The signal that set the flag, if any.
    pub fn signal(&self) -> Option<i32> {
        match self.0.load(Ordering::SeqCst) {
            0 => None,
            n => Some(n),
        }
    }
}

impl PartialEq for StopFlag {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

/// A callback after every replay step, given the steps run so far (tests drive faults from it).
#[derive(Clone)]
pub struct StepHook(pub Arc<dyn Fn(u64) + Send + Sync>);

impl StepHook {
    /// Calls the hook.
    pub fn call(&self, steps: u64) {
        (self.0)(steps);
    }
}

impl std::fmt::Debug for StepHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StepHook")
    }
}

impl PartialEq for StepHook {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

/// A signal's name, as the report states it.
pub fn signal_name(signal: i32) -> String {
    match signal {
        2 => "SIGINT".into(),
        15 => "SIGTERM".into(),
        n => format!("signal {n}"),
    }
}

/// The exit status of a run stopped by `signal` (by name): 128 + its number.
pub fn signal_exit_code(signal: &str) -> u8 {
    match signal {
        "SIGINT" => 130,
        "SIGTERM" => 143,
        _ => 1,
    }
}

/// The latest simulated time, in ms, an arrival may fall at: `2^53` µs (about 285 years).
/// Below it an `f64` holds a simulated time to the microsecond, the precision the outputs
/// print; beyond it steps of a few ms would round away and latencies print as 0.
pub const MAX_SIMULATED_MS: f64 = 9_007_199_254_740.992;

/// Refuses a trace whose arrivals, at `rate_scale`, fall past [`MAX_SIMULATED_MS`] (naming
/// the first such request), where the simulated clock would lose its precision.
///
/// # Errors
/// [`ReplayError::RateScale`], naming the request, its arrival and the scaled time.
pub fn check_clock(trace: &Trace, rate_scale: f64) -> Result<(), ReplayError> {
    let late = trace.requests.iter().find(|r| {
        let t = r.arrival_ms / rate_scale;
        !(t.is_finite() && t <= MAX_SIMULATED_MS)
    });
    match late {
        None => Ok(()),
        Some(r) => Err(ReplayError::RateScale(format!(
            "request rid {} arrives at {} ms, which at rate scale {rate_scale} is {:e} simulated ms: past the {MAX_SIMULATED_MS:e} ms (about 285 years) within which the simulated clock keeps microseconds; use a larger `--rate-scale` or re-base the trace's timestamps",
            r.rid,
            r.arrival_ms,
            r.arrival_ms / rate_scale
        ))),
    }
}

/// Refuses outputs that would overwrite an input or each other, or that are not regular files:
/// each output is compared with each input and with the other output as the same file (device
/// and inode, through links) or the same path.
///
/// # Errors
/// The first output refused, and why.
pub fn check_outputs(
    outputs: &[(&'static str, &Path)],
    inputs: &[PathBuf],
) -> Result<(), ReplayError> {
    let same = |a: &Path, b: &Path| -> bool {
        #[cfg(unix)]
        if let (Ok(x), Ok(y)) = (std::fs::metadata(a), std::fs::metadata(b)) {
            use std::os::unix::fs::MetadataExt;
            return x.dev() == y.dev() && x.ino() == y.ino();
        }
        let abs = |p: &Path| std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf());
        abs(a) == abs(b)
    };
    let refuse = |what, path: &Path, problem: String| ReplayError::Output {
        what,
        path: path.to_path_buf(),
        problem,
    };
    for (i, (what, out)) in outputs.iter().enumerate() {
        if let Ok(meta) = std::fs::metadata(out) {
            if !meta.is_file() {
                return Err(refuse(what, out, "is not a regular file".into()));
            }
        }
        if let Some(input) = inputs.iter().find(|input| same(out, input)) {
            return Err(refuse(
                what,
                out,
                format!(
                    "is the input `{}`; it would be overwritten",
                    crate::config::problem::escape(&input.display().to_string())
                ),
            ));
        }
        if let Some((other, _)) = outputs[i + 1..].iter().find(|(_, o)| same(out, o)) {
            return Err(refuse(what, out, format!("is also the {other}")));
        }
    }
    Ok(())
}

impl Default for ReplayOptions {
    fn default() -> Self {
        Self {
            trace: None,
            requests: None,
            rate_scale: 1.0,
            budget_off: false,
            budget: None,
            format: None,
            arrivals: None,
            step_log: None,
            report_json: None,
            skip_bad_lines: false,
            progress: false,
            inputs: Vec::new(),
            handle_signals: false,
            on_step: None,
            stop: None,
        }
    }
}

/// Why a replay failed.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// The trace could not be read.
    #[error(transparent)]
    Trace(#[from] TraceError),
    /// An actor refused or did not answer.
    #[error("{during}: {source}")]
    Chunking {
        /// What the replay was doing.
        during: &'static str,
        /// The actors' error.
        #[source]
        source: ChunkingError,
    },
    /// A `[replay]` setting refused (see [`settings::check`]).
    #[error("`{key}` {problem}")]
    Config {
        /// The key.
        key: &'static str,
        /// Its value and why it was refused.
        problem: String,
    },
    /// `--rate-scale` out of range.
    #[error("{0}")]
    RateScale(String),
    /// `--budget` (or `--budget-off`) gives budgets the config would refuse (see
    /// [`replay_budgets`]).
    #[error("`{flag}`{} is refused as the config would refuse it: {reason}", value.map_or_else(String::new, |v| format!(" = {v}")))]
    Budget {
        /// `--budget` or `--budget-off`.
        flag: &'static str,
        /// The value of `--budget`.
        value: Option<BudgetValue>,
        /// Every refusal, escaped.
        reason: String,
    },
    /// An output refused before anything ran (see [`check_outputs`]).
    #[error("the {what} `{path}` {problem}", path = crate::config::problem::escape(&.path.display().to_string()))]
    Output {
        /// `step log` or `JSON report`.
        what: &'static str,
        /// Its path.
        path: PathBuf,
        /// Why it was refused.
        problem: String,
    },
    /// An output could not be written.
    #[error("cannot write the {what} `{path}`: {source}", path = .path.display())]
    Write {
        /// `step log` or `JSON report`.
        what: &'static str,
        /// Its path.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// Rows are queued that no step schedules.
    #[error("replay stalled at {t_ms:.3} ms: {prefilling} prompts and {decoding} decode rows are queued on `{node}` but no step schedules any of them")]
    Stalled {
        /// Simulated time.
        t_ms: f64,
        /// The node.
        node: String,
        /// Prompts queued.
        prefilling: usize,
        /// Decode rows registered.
        decoding: usize,
    },
    /// A request needs more KV blocks than the pool holds, even alone.
    #[error("request {rid} needs {tokens} tokens of KV cache ({need} blocks of {block_tokens} tokens: its prompt, outputs and speculative tokens) but `replay.kv` holds {blocks} blocks, so it could never run; give the replay more memory, or leave such requests out (`--requests`)")]
    KvTooSmall {
        /// The request (its position in the trace).
        rid: u64,
        /// The tokens it needs.
        tokens: u64,
        /// The blocks it needs.
        need: u64,
        /// The pool's blocks.
        blocks: u64,
        /// Tokens per block.
        block_tokens: u32,
    },
    /// A step's rows could not be given blocks with nothing left to preempt (a bug: reported,
    /// never a panic).
    #[error("request {rid}: no block left to give and nothing left to preempt in a pool of {blocks} blocks")]
    KvStuck {
        /// The request whose row did not fit.
        rid: u64,
        /// The pool's blocks.
        blocks: u64,
    },
    /// Prepared inputs still held after every prompt finished.
    #[error("{rows} prepared inputs ({tokens} tokens) were still held after the replay; every one must be released after its final chunk")]
    PreparedLeft {
        /// Rows held.
        rows: usize,
        /// Their tokens.
        tokens: u64,
    },
}

impl ReplayError {
    fn chunking(during: &'static str) -> impl FnOnce(ChunkingError) -> Self {
        move |source| Self::Chunking { during, source }
    }
}

impl Setup {
    /// Resolves `[replay]` against the model ([`settings::check`]).
    ///
    /// # Errors
    /// The first problem [`settings::check`] finds.
    pub fn resolve(manifest: &Manifest, settings: &Settings) -> Result<Self, ReplayError> {
        settings::check(manifest, &settings.replay).map_err(|problems| {
            let p = problems.into_iter().next();
            ReplayError::Config {
                key: p.as_ref().map_or("replay", |p| p.key),
                problem: p.map_or_else(String::new, |p| match p.value {
                    Some(v) => format!("= {v}: {}", p.reason),
                    None => p.reason,
                }),
            }
        })
    }
}

/// `--budget N|off` (`docs/replay.md#labelled-runs`): `value` for every step walk of the
/// replayed node that its policies budget, layered over the node's `overrides` (a node-wide
/// override keeps holding for the node's other walks).
///
/// # Errors
/// [`ReplayError::Config`] when the node budgets none of its step walks.
pub fn budget_flag_overrides(
    manifest: &Manifest,
    setup: &Setup,
    mut overrides: std::collections::BTreeMap<Name, NodeBudget>,
    value: BudgetValue,
) -> Result<std::collections::BTreeMap<Name, NodeBudget>, ReplayError> {
    let node = manifest.nodes.get(&setup.node);
    let budgeted: Vec<&String> = node
        .map(|n| {
            n.policies
                .iter()
                .filter(|(_, p)| p.max_batch_tokens.is_some())
                .map(|(w, _)| w)
                .collect()
        })
        .unwrap_or_default();
    let step_walks: Vec<&String> = setup
        .walks
        .iter()
        .filter(|w| budgeted.contains(w))
        .collect();
    if step_walks.is_empty() {
        return Err(ReplayError::Config {
            key: "--budget",
            problem: format!(
                "= {value}: node `{}` has no token budget on its step walk{} {} to replace (its model budgets {})",
                setup.node,
                if setup.walks.len() == 1 { "" } else { "s" },
                setup.walks.join(", "),
                if budgeted.is_empty() {
                    "no walk".to_string()
                } else {
                    budgeted.iter().map(|w| w.as_str()).collect::<Vec<_>>().join(", ")
                }
            ),
        });
    }
    let key = Name::from(setup.node.as_str());
    let mut per_walk: std::collections::BTreeMap<Name, BudgetValue> = match overrides.remove(&key) {
        Some(NodeBudget::PerWalk(m)) => m,
        // A node-wide value keeps applying to the walks `--budget` does not name.
        Some(NodeBudget::All(v)) => budgeted
            .iter()
            .map(|w| (Name::from(w.as_str()), v))
            .collect(),
        None => std::collections::BTreeMap::new(),
    };
    for w in step_walks {
        per_walk.insert(Name::from(w.as_str()), value);
    }
    overrides.insert(key, NodeBudget::PerWalk(per_walk));
    Ok(overrides)
}

/// The budgets a replay applies: the config's, then `--budget-off` and `--budget` (`value`),
/// and without the replayed node's cost model when `replay.cost.learn` is on. Checked whole
/// against the model as the config is (`BudgetTable::build`), so that a flag the config would
/// refuse is refused before anything runs.
///
/// # Errors
/// [`ReplayError::Budget`] with every refusal; [`ReplayError::Config`] when the replayed node
/// has no token budget for `--budget` to replace.
pub fn replay_budgets(
    manifest: &Manifest,
    settings: &Settings,
    setup: &Setup,
    budget_off: bool,
    value: Option<BudgetValue>,
) -> Result<crate::budget::BudgetSettings, ReplayError> {
    let mut budgets = manifest.settings_budgets(settings);
    if budget_off {
        budgets.overrides = budget_off_overrides(manifest);
    }
    if let Some(value) = value {
        budgets.overrides = budget_flag_overrides(manifest, setup, budgets.overrides, value)?;
    }
    // `replay.cost.learn`: the component learns the simulated cost of the replayed node online,
    // without being given a model for it.
    if setup.learn {
        budgets.time.cost.remove(setup.node.as_str());
    }
    // Only a flag can make the config's own budgets fail here: `check` accepted those.
    if budget_off || value.is_some() {
        if let Some(reason) = budget_refusal(manifest, &budgets) {
            return Err(ReplayError::Budget {
                flag: if value.is_some() {
                    "--budget"
                } else {
                    "--budget-off"
                },
                value,
                reason,
            });
        }
    }
    Ok(budgets)
}

/// Why the config would refuse `budgets` for `manifest` (every refusal, escaped), if it would.
pub fn budget_refusal(
    manifest: &Manifest,
    budgets: &crate::budget::BudgetSettings,
) -> Option<String> {
    let escaped = |e: String| crate::config::problem::escape(&e);
    let model = match crate::policy::ModelPolicies::new(manifest.submodules(), manifest.policies())
    {
        Ok(m) => m.shared(),
        Err(e) => {
            let e: Vec<String> = e.iter().map(ToString::to_string).collect();
            return Some(escaped(e.join("; ")));
        }
    };
    crate::budget::BudgetTable::build(model, budgets.clone())
        .err()
        .map(|e| escaped(e.to_string()))
}

/// Reads the trace `opts` names (the bundled one by default), in the format `--format` or the
/// file says, with generated arrivals for a length-only trace, seeded with `seed`.
///
/// # Errors
/// As [`Trace::load`]; `--format` (other than `azure`) or `--arrivals` without a trace.
pub fn load_trace(opts: &ReplayOptions, seed: u64) -> Result<Trace, ReplayError> {
    let read = trace::ReadOptions {
        limit: opts.requests,
        skip_bad_lines: opts.skip_bad_lines,
    };
    match &opts.trace {
        Some(path) => Ok(Trace::load(
            path,
            opts.format,
            opts.arrivals.as_ref(),
            seed,
            read,
        )?),
        None => {
            if opts.arrivals.is_some() {
                return Err(TraceError::Bundled {
                    flag: "`--arrivals`",
                }
                .into());
            }
            if opts.format.is_some_and(|f| f != TraceFormat::AzureCsv) {
                return Err(TraceError::Bundled { flag: "`--format`" }.into());
            }
            Ok(Trace::bundled(read)?)
        }
    }
}

/// The warnings a run of `trace` under `setup` deserves: a prefix cache with no block hashes
/// to look up never hits.
pub fn trace_warnings(setup: &Setup, trace: &Trace) -> Vec<String> {
    let mut out = Vec::new();
    if setup.cache_blocks > 0 && !trace.has_hashes() {
        out.push(format!(
            "the prefix cache is on (`replay.prefix_cache.blocks` = {}) but trace {} carries no block hashes (`hash_ids`), so it never hits; see docs/replay.md#trace-formats",
            setup.cache_blocks,
            crate::config::problem::escape(&trace.file)
        ));
    }
    out
}

/// `--budget-off`: every node that budgets a walk gets one node-wide budget of "off".
pub fn budget_off_overrides(manifest: &Manifest) -> std::collections::BTreeMap<Name, NodeBudget> {
    manifest
        .nodes
        .iter()
        .filter(|(_, n)| n.policies.values().any(|p| p.max_batch_tokens.is_some()))
        .map(|(name, _)| (Name::from(name.as_str()), NodeBudget::All(BudgetValue::Off)))
        .collect()
}

/// Replays a trace through a fresh [`ChunkingManagement`] with `manifest`'s policies and the
/// `[chunking]` budgets of `settings` (all off with `budget_off`), and returns the report; writes
/// the step log and the JSON report when asked. Must be awaited inside an actix system.
///
/// # Errors
/// A bad option or `[replay]` setting, a bad trace, a refused policy or budget, a failed write,
/// an actor that did not answer, or prepared inputs left at the end.
pub async fn run(
    manifest: &Manifest,
    settings: &Settings,
    opts: &ReplayOptions,
) -> Result<ReplayReport, ReplayError> {
    let cm = ChunkingManagement::start(&manifest.name, manifest.submodules())
        .map_err(ReplayError::chunking("starting the actors"))?;
    run_on(&cm, manifest, settings, opts).await
}

/// [`run`] on actors the caller started (`ChunkingManagement::start(manifest.submodules())`),
/// so that it can hold the handle too, e.g. to reload budgets while the replay runs. Binds the
/// policies and applies the budgets itself; `cm` must not have run another replay.
///
/// # Errors
/// As [`run`].
pub async fn run_on(
    cm: &ChunkingManagement,
    manifest: &Manifest,
    settings: &Settings,
    opts: &ReplayOptions,
) -> Result<ReplayReport, ReplayError> {
    let wall = Instant::now();
    settings::check_rate_scale(opts.rate_scale).map_err(ReplayError::RateScale)?;
    let setup = Setup::resolve(manifest, settings)?;
    let mut inputs = opts.inputs.clone();
    inputs.extend(opts.trace.clone());
    let outputs: Vec<(&'static str, &Path)> = [
        ("step log", opts.step_log.as_deref()),
        ("JSON report", opts.report_json.as_deref()),
    ]
    .into_iter()
    .filter_map(|(what, p)| Some((what, p?)))
    .collect();
    check_outputs(&outputs, &inputs)?;
    // Refused before the trace is read, not after.
    replay_budgets(manifest, settings, &setup, opts.budget_off, opts.budget)?;
    let trace = load_trace(opts, setup.seed)?;
    run_trace(cm, manifest, settings, opts, &trace, wall).await
}

/// [`run_on`] with the trace already read ([`load_trace`]), so that a sweep reads it once for
/// all its replays. `wall` is when the run started, for its wall time.
///
/// # Errors
/// As [`run`], but for reading the trace.
pub async fn run_trace(
    cm: &ChunkingManagement,
    manifest: &Manifest,
    settings: &Settings,
    opts: &ReplayOptions,
    trace: &Trace,
    wall: Instant,
) -> Result<ReplayReport, ReplayError> {
    settings::check_rate_scale(opts.rate_scale).map_err(ReplayError::RateScale)?;
    let setup = Setup::resolve(manifest, settings)?;
    let outputs: Vec<(&'static str, &Path)> = [
        ("step log", opts.step_log.as_deref()),
        ("JSON report", opts.report_json.as_deref()),
    ]
    .into_iter()
    .filter_map(|(what, p)| Some((what, p?)))
    .collect();
    let mut inputs = opts.inputs.clone();
    inputs.extend(opts.trace.clone());
    check_outputs(&outputs, &inputs)?;
    check_clock(trace, opts.rate_scale)?;

    cm.set_policies(manifest.policies())
        .await
        .map_err(ReplayError::chunking("setting the model's policies"))?;
    let budgets = replay_budgets(manifest, settings, &setup, opts.budget_off, opts.budget)?;
    cm.set_budgets(budgets)
        .await
        .map_err(ReplayError::chunking("applying the `[chunking]` budgets"))?;
    let labels = run_settings(cm, manifest, &setup, opts, trace).await?;

    let step_log = match &opts.step_log {
        Some(p) => Some(
            step_log::StepLog::create(p).map_err(|source| ReplayError::Write {
                what: "step log",
                path: p.clone(),
                source,
            })?,
        ),
        None => None,
    };
    // A first chunk runs at most the token budget of the walk prompts are planned on.
    let cap = cm
        .snapshot()
        .await
        .map_err(ReplayError::chunking("reading the budgets back"))?
        .table()
        .max_batch_tokens(&setup.node, sim::first_chunk_walk(&setup.walks));
    let mut sim = sim::Sim::new(cm, &setup, trace, opts, step_log)
        .time_budgets(&labels.budgets)
        .first_chunk_cap(cap);
    let flag = opts.stop.as_ref().map(|f| f.0.clone());
    let _signals = if opts.handle_signals {
        let flag = flag.unwrap_or_default();
        sim = sim.stop_on(flag.clone());
        watch_signals(flag)
    } else {
        if let Some(flag) = flag {
            sim = sim.stop_on(flag);
        }
        None
    };
    tracing::debug!(
        requests = trace.requests.len(),
        node = %setup.node,
        "replay started"
    );
    let mut report = sim.run().await?;
    report.settings = labels;
    let mut warnings = trace_warnings(&setup, trace);
    warnings.append(&mut report.warnings);
    report.warnings = warnings;

    // Every prompt ran its final chunk, so every prepared input must have been released
    // (unless a signal stopped the replay midway: then the counts are reported).
    let (rows, tokens) = cm
        .prepared_totals()
        .await
        .map_err(ReplayError::chunking("counting prepared inputs left"))?;
    if report.interrupted.is_none() && (rows != 0 || tokens != 0) {
        return Err(ReplayError::PreparedLeft { rows, tokens });
    }
    report.prepared_left_rows = rows;
    report.prepared_left_tokens = tokens;
    report.wall_ms = wall.elapsed().as_secs_f64() * 1000.0;
    report.steps_per_second = if report.wall_ms > 0.0 {
        report.steps as f64 * 1000.0 / report.wall_ms
    } else {
        0.0
    };
    if let Some(p) = &opts.report_json {
        let write = || -> std::io::Result<()> {
            let mut f = step_log::AtomicFile::create(p)?;
            serde_json::to_writer_pretty(&mut f, &report)?;
            std::io::Write::write_all(&mut f, b"\n")?;
            f.commit()
        };
        write().map_err(|source| ReplayError::Write {
            what: "JSON report",
            path: p.clone(),
            source,
        })?;
    }
    Ok(report)
}

/// The settings a run goes by, read back from the budgets the actors hold.
async fn run_settings(
    cm: &ChunkingManagement,
    manifest: &Manifest,
    setup: &Setup,
    opts: &ReplayOptions,
    trace: &Trace,
) -> Result<report::RunSettings, ReplayError> {
    let snapshot = cm
        .snapshot()
        .await
        .map_err(ReplayError::chunking("reading the budgets back"))?;
    let table = snapshot.table();
    let node = setup.node.as_str();
    let budgets = manifest
        .walks
        .iter()
        .map(|walk| report::WalkBudget {
            walk: walk.clone(),
            policy_budget: table.policy(node, walk).max_batch_tokens,
            max_batch_tokens: table.max_batch_tokens(node, walk),
            max_step_ms: table.max_step_ms(node, walk),
        })
        .filter(|b| {
            b.policy_budget.is_some() || b.max_batch_tokens.is_some() || b.max_step_ms.is_some()
        })
        .collect();
    let budget_flag = match (opts.budget, opts.budget_off) {
        (Some(v), _) => Some(v.to_string()),
        (None, true) => Some("off (every node)".to_string()),
        (None, false) => None,
    };
    Ok(report::RunSettings {
        version: env!("CARGO_PKG_VERSION").to_string(),
        node: setup.node.clone(),
        step_walks: setup.walks.clone(),
        budgets,
        budget_flag,
        cost: report::CostLabel::of(setup),
        speculation_tokens: setup.spec_tokens,
        overshoot_rate: setup.overshoot_rate,
        prefix_cache_blocks: setup.cache_blocks,
        prefix_cache_block_tokens: setup.cache_block_tokens,
        seed: setup.seed,
        trace: trace.file.clone(),
        format: trace.format.name().to_owned(),
        arrivals: opts
            .arrivals
            .filter(|_| trace.format == TraceFormat::LengthsCsv)
            .map(|a| a.to_string()),
        requests: trace.requests.len(),
        rate_scale: opts.rate_scale,
    })
}

/// Sets `flag` to the number of the first SIGINT or SIGTERM received, until dropped. Must be
/// called inside an actix system.
fn watch_signals(flag: Arc<AtomicI32>) -> Option<SignalWatch> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut int = signal(SignalKind::interrupt()).ok()?;
        let mut term = signal(SignalKind::terminate()).ok()?;
        let task = actix::spawn(async move {
            let sig = tokio::select! {
                _ = int.recv() => 2,
                _ = term.recv() => 15,
            };
            flag.store(sig, Ordering::SeqCst);
        });
        Some(SignalWatch(task))
    }
    #[cfg(not(unix))]
    {
        let _ = flag;
        None
    }
}

/// Stops watching signals when dropped.
struct SignalWatch(tokio::task::JoinHandle<()>);

impl Drop for SignalWatch {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budget_off_names_only_nodes_that_budget_a_walk() {
        let m: Manifest = toml::from_str(
            r#"
            name = "two"
            walks = ["prefill", "decode"]
            [nodes.llm]
            chunkable_walks = ["prefill"]
            policies = { prefill = { max_batch_tokens = 512 } }
            [nodes.talker]
            policies = { prefill = { max_batch_tokens = 512, align = 4 }, decode = {} }
            [nodes.vision]
            "#,
        )
        .unwrap();
        let off = budget_off_overrides(&m);
        assert_eq!(
            off.keys().map(|k| &**k).collect::<Vec<_>>(),
            ["llm", "talker"]
        );
        assert!(off
            .values()
            .all(|b| *b == NodeBudget::All(BudgetValue::Off)));
    }

    fn setup(node: &str, walks: &[&str]) -> Setup {
        Setup {
            node: node.into(),
            walks: walks.iter().map(|w| (*w).to_string()).collect(),
            cost: crate::latency::LatencyModel::from_coefficients(settings::DEFAULT_COST).unwrap(),
            cost_preset: None,
            noise: 0.0,
            learn: false,
            spec_tokens: 0,
            overshoot_rate: 0.0,
            seed: 42,
            cache_blocks: 0,
            cache_block_tokens: 512,
            kv: None,
        }
    }

    #[test]
    fn the_budget_flag_replaces_the_step_walks_budget_only() {
        let m: Manifest = toml::from_str(
            r#"
            name = "m"
            walks = ["prefill", "decode", "mixed"]
            [combined_walks]
            mixed = ["prefill", "decode"]
            [nodes.llm]
            chunkable_walks = ["prefill", "mixed"]
            policies = { prefill = { max_batch_tokens = 2048 }, mixed = { max_batch_tokens = 4096 } }
            [nodes.vision]
            policies = { prefill = { max_batch_tokens = 512 } }
            "#,
        )
        .unwrap();
        let n512 = BudgetValue::tokens(512).unwrap();
        let s = setup("llm", &["mixed"]);
        let o = budget_flag_overrides(&m, &s, Default::default(), n512).unwrap();
        assert_eq!(
            o.get("llm"),
            Some(&NodeBudget::PerWalk([(Name::from("mixed"), n512)].into()))
        );
        // A node-wide override keeps applying to the walk `--budget` leaves alone; other
        // nodes' overrides stay as they were.
        let base = [
            (Name::from("llm"), NodeBudget::All(BudgetValue::Off)),
            (Name::from("vision"), NodeBudget::All(BudgetValue::Off)),
        ]
        .into();
        let o = budget_flag_overrides(&m, &s, base, n512).unwrap();
        assert_eq!(
            o.get("llm"),
            Some(&NodeBudget::PerWalk(
                [
                    (Name::from("mixed"), n512),
                    (Name::from("prefill"), BudgetValue::Off)
                ]
                .into()
            ))
        );
        assert_eq!(o.get("vision"), Some(&NodeBudget::All(BudgetValue::Off)));
        // Stepping prefill and decode in turn: the budgeted one is set.
        let o = budget_flag_overrides(
            &m,
            &setup("llm", &["prefill", "decode"]),
            Default::default(),
            BudgetValue::Off,
        )
        .unwrap();
        assert_eq!(
            o.get("llm"),
            Some(&NodeBudget::PerWalk(
                [(Name::from("prefill"), BudgetValue::Off)].into()
            ))
        );
        // A node that budgets none of its step walks is refused, naming what it budgets.
        let e = budget_flag_overrides(&m, &setup("vision", &["decode"]), Default::default(), n512)
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "`--budget` = 512: node `vision` has no token budget on its step walk decode to replace (its model budgets prefill)"
        );
    }
}
