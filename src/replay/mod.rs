//! Replay (SPEC §8): drives the real chunking actors through a request trace as an engine would,
//! on a simulated clock, and reports what the chunking config does to budgets, overruns and
//! latency.
//!
//! - [`trace`]: the Azure CSV and Mooncake JSON Lines readers, and the bundled trace;
//! - [`sim`]: the simulation loop: arrivals, steps, decode rows, speculation, prefix cache;
//! - [`prefix_cache`]: the LRU of prompt blocks keyed by a trace's block hashes;
//! - [`step_log`]: the `--step-log` JSON Lines writer (SPEC §7);
//! - [`report`]: the summary table and the `--report-json` document.
//!
//! [`run`] must be awaited inside an actix system: it starts its own [`ChunkingManagement`] on
//! the current arbiter.

use std::path::PathBuf;
use std::time::Instant;

use crate::budget::{BudgetValue, NodeBudget};
use crate::error::ChunkingError;
use crate::manifest::Manifest;
use crate::settings::Settings;
use crate::{ChunkingManagement, Name};

pub mod arrivals;
pub mod formats;
pub mod prefix_cache;
pub mod report;
pub mod sim;
pub mod step_log;
pub mod trace;

pub use report::ReplayReport;
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
    /// Write the step log (SPEC §7) here.
    pub step_log: Option<PathBuf>,
    /// Write the report as JSON here.
    pub report_json: Option<PathBuf>,
    /// Count and leave out bad trace lines instead of failing.
    pub skip_bad_lines: bool,
    /// Show a progress bar (only when stderr is a terminal).
    pub progress: bool,
}

impl Default for ReplayOptions {
    fn default() -> Self {
        Self {
            trace: None,
            requests: None,
            rate_scale: 1.0,
            budget_off: false,
            step_log: None,
            report_json: None,
            skip_bad_lines: false,
            progress: false,
        }
    }
}

/// Why a replay failed.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error(transparent)]
    Trace(#[from] TraceError),
    #[error("{during}: {source}")]
    Chunking {
        during: &'static str,
        #[source]
        source: ChunkingError,
    },
    #[error("`{key}` {problem}")]
    Config { key: &'static str, problem: String },
    #[error("`--rate-scale` must be a positive finite number, got {0}")]
    RateScale(f64),
    #[error("cannot write the {what} `{path}`: {source}", path = .path.display())]
    Write {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("replay stalled at {t_ms:.3} ms: {prefilling} prompts and {decoding} decode rows are queued on `{node}` but no step schedules any of them")]
    Stalled {
        t_ms: f64,
        node: String,
        prefilling: usize,
        decoding: usize,
    },
    #[error("{rows} prepared inputs ({tokens} tokens) were still held after the replay; every one must be released after its final chunk")]
    PreparedLeft { rows: usize, tokens: u64 },
}

impl ReplayError {
    fn chunking(during: &'static str) -> impl FnOnce(ChunkingError) -> Self {
        move |source| Self::Chunking { during, source }
    }
}

/// Where and how replay steps: the node, the step walks, and the simulation knobs, checked.
#[derive(Debug, Clone, PartialEq)]
pub struct Setup {
    pub node: String,
    /// One combined walk, or `prefill` and `decode` taken in turn.
    pub walks: Vec<String>,
    pub base_ms: f64,
    pub per_token_ms: f64,
    /// Speculative tokens per decode row (0: plain decode), the overshoot probability and seed.
    pub spec_tokens: u32,
    pub overshoot_rate: f64,
    pub seed: u64,
    /// Prefix cache blocks (0: off) and tokens per block.
    pub cache_blocks: usize,
    pub cache_block_tokens: u32,
}

impl Setup {
    /// Resolves `[replay]` against the model.
    ///
    /// # Errors
    /// A node or walk the model does not have, a combined walk without `prefill` and `decode`
    /// among its members, or a cost, speculation or cache value out of range.
    pub fn resolve(manifest: &Manifest, settings: &Settings) -> Result<Self, ReplayError> {
        let r = &settings.replay;
        let cfg = |key, problem: String| ReplayError::Config { key, problem };
        // The manifest's first node (its nodes are keyed by name).
        let node =
            match &r.node {
                Some(n) => n.clone(),
                None => manifest.nodes.keys().next().cloned().ok_or_else(|| {
                    cfg("nodes", "the model manifest has no node to replay".into())
                })?,
            };
        if !manifest.nodes.contains_key(&node) {
            return Err(cfg(
                "replay.node",
                format!(
                    "names node `{node}`, which the model does not have (it has {})",
                    names(manifest.nodes.keys())
                ),
            ));
        }
        for w in [PREFILL_WALK, DECODE_WALK] {
            if !manifest.walks.iter().any(|m| m == w) {
                return Err(cfg(
                    "walks",
                    format!(
                        "of the model must include `{w}`: replay admits prompts on `prefill` and generates on `decode` (the model has {})",
                        names(manifest.walks.iter())
                    ),
                ));
            }
        }
        let walk = r.walk.as_deref().or_else(|| manifest.combined_walk());
        let walks = match walk {
            None => vec![PREFILL_WALK.to_owned(), DECODE_WALK.to_owned()],
            Some(w) => {
                let Some(members) = manifest.combined_walks.get(w) else {
                    return Err(cfg(
                        "replay.walk",
                        format!(
                            "names `{w}`, which is not a combined walk of the model (it has {}); unset it to alternate `prefill` and `decode`",
                            names(manifest.combined_walks.keys())
                        ),
                    ));
                };
                for m in [PREFILL_WALK, DECODE_WALK] {
                    if !members.iter().any(|x| x == m) {
                        return Err(cfg(
                            "replay.walk",
                            format!(
                                "names `{w}`, whose member walks ({}) do not include `{m}`",
                                names(members.iter())
                            ),
                        ));
                    }
                }
                vec![w.to_owned()]
            }
        };
        let c = r.cost;
        for (key, v) in [
            ("replay.cost.base_ms", c.base_ms),
            ("replay.cost.per_token_ms", c.per_token_ms),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(cfg(key, format!("must be a finite number >= 0, got {v}")));
            }
        }
        if c.base_ms == 0.0 && c.per_token_ms == 0.0 {
            return Err(cfg(
                "replay.cost",
                "must make a step take some time: `base_ms` and `per_token_ms` are both 0".into(),
            ));
        }
        let s = r.speculation;
        if !(0.0..=1.0).contains(&s.overshoot_rate) {
            return Err(cfg(
                "replay.speculation.overshoot_rate",
                format!("must be a probability in [0, 1], got {}", s.overshoot_rate),
            ));
        }
        if s.tokens >= u32::MAX / 2 {
            return Err(cfg(
                "replay.speculation.tokens",
                format!("must be below {}, got {}", u32::MAX / 2, s.tokens),
            ));
        }
        let p = r.prefix_cache;
        if p.blocks > 0 && p.block_tokens != trace::HASH_BLOCK_TOKENS {
            return Err(cfg(
                "replay.prefix_cache.block_tokens",
                format!(
                    "must be {} (the tokens one trace block hash covers), got {}",
                    trace::HASH_BLOCK_TOKENS,
                    p.block_tokens
                ),
            ));
        }
        Ok(Self {
            node,
            walks,
            base_ms: c.base_ms,
            per_token_ms: c.per_token_ms,
            spec_tokens: s.tokens,
            overshoot_rate: s.overshoot_rate,
            seed: s.seed,
            cache_blocks: p.blocks as usize,
            cache_block_tokens: p.block_tokens,
        })
    }
}

fn names<'a>(it: impl Iterator<Item = &'a String>) -> String {
    let v: Vec<String> = it.map(|n| format!("`{n}`")).collect();
    if v.is_empty() {
        "none".into()
    } else {
        v.join(", ")
    }
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
    if !(opts.rate_scale.is_finite() && opts.rate_scale > 0.0) {
        return Err(ReplayError::RateScale(opts.rate_scale));
    }
    let setup = Setup::resolve(manifest, settings)?;
    let read = trace::ReadOptions {
        limit: opts.requests,
        skip_bad_lines: opts.skip_bad_lines,
    };
    let trace = match &opts.trace {
        Some(path) => Trace::read_path(path, read)?,
        None => Trace::bundled(read)?,
    };

    cm.set_policies(manifest.policies())
        .await
        .map_err(ReplayError::chunking("setting the model's policies"))?;
    let mut budgets = manifest.budget_settings(&settings.chunking);
    if opts.budget_off {
        budgets.overrides = budget_off_overrides(manifest);
    }
    cm.set_budgets(budgets)
        .await
        .map_err(ReplayError::chunking("applying the `[chunking]` budgets"))?;

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
    let mut report = sim::Sim::new(cm, &setup, &trace, opts, step_log)
        .run()
        .await?;

    // Every prompt ran its final chunk, so every prepared input must have been released.
    let (rows, tokens) = cm
        .prepared_totals()
        .await
        .map_err(ReplayError::chunking("counting prepared inputs left"))?;
    if rows != 0 || tokens != 0 {
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
            let mut f = std::io::BufWriter::new(std::fs::File::create(p)?);
            serde_json::to_writer_pretty(&mut f, &report)?;
            std::io::Write::write_all(&mut f, b"\n")?;
            std::io::Write::flush(&mut f)
        };
        write().map_err(|source| ReplayError::Write {
            what: "JSON report",
            path: p.clone(),
            source,
        })?;
    }
    Ok(report)
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

    #[test]
    fn setup_defaults_to_the_first_node_in_the_file_and_the_combined_walk() {
        let m: Manifest = toml::from_str(
            r#"
            name = "m"
            walks = ["prefill", "decode", "mixed"]
            [combined_walks]
            mixed = ["prefill", "decode"]
            [nodes.b]
            [nodes.a]
            "#,
        )
        .unwrap();
        let s = Setup::resolve(&m, &Settings::default()).unwrap();
        assert_eq!(
            (s.node.as_str(), s.walks.as_slice()),
            ("b", &["mixed".to_owned()][..])
        );
        assert_eq!((s.base_ms, s.per_token_ms, s.spec_tokens), (8.0, 0.02, 0));
    }
}
