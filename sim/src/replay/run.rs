//! One replay, start to end: the trace read, the actors given the model and the budgets, the
//! simulation run, the outputs written and nothing left held.

use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::Instant;

use super::budgets::replay_budgets;
use super::checks::{check_clock, check_link, check_outputs};
use super::error::ReplayError;
use super::options::ReplayOptions;
use super::report::{self, ReplayReport};
use super::settings::{self, ReplaySetup};
use super::signals::{catch_signals, test_signal_at};
use super::trace::{self, Trace, TraceError, TraceFormat};
use super::{disagg, fleet, sim, step_log};
use crate::config::Settings;
use mstar_chunking::manifest::Manifest;
use mstar_chunking::order::Order;
use mstar_chunking::ChunkingManagement;

/// Reads the trace `opts` names (the bundled one by default), in the format `--format` or the
/// file says, with generated arrivals for a length-only trace, seeded with `seed`.
///
/// # Errors
/// As [`Trace::load`]; `--format` (other than `azure`) or `--arrivals` without a trace.
pub fn load_trace(opts: &ReplayOptions, seed: u64) -> Result<Trace, ReplayError> {
    let mut trace = read_trace(opts, seed)?;
    if let Some(rule) = opts.priority_by {
        rule.apply(&mut trace);
    }
    Ok(trace)
}

fn read_trace(opts: &ReplayOptions, seed: u64) -> Result<Trace, ReplayError> {
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
pub fn trace_warnings(setup: &ReplaySetup, trace: &Trace) -> Vec<String> {
    let mut out = Vec::new();
    if setup.cache_blocks > 0 && !trace.has_hashes() {
        out.push(format!(
            "the prefix cache is on (`replay.prefix_cache.blocks` = {}) but trace {} carries no block hashes (`hash_ids`), so it never hits; see docs/traces.md",
            setup.cache_blocks,
            crate::config::problem::escape(&trace.file)
        ));
    }
    out
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
    let setup = ReplaySetup::resolve(manifest, settings)?;
    check_run_outputs(opts)?;
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
    run_trace_on(cm, manifest, settings, opts, trace, wall, false).await
}

/// [`run_trace`]; `fleet_loop` runs even one worker through the fleet's loop (`fleet.rs`),
/// which a test holds to the single replay's results exactly.
pub(crate) async fn run_trace_on(
    cm: &ChunkingManagement,
    manifest: &Manifest,
    settings: &Settings,
    opts: &ReplayOptions,
    trace: &Trace,
    wall: Instant,
    fleet_loop: bool,
) -> Result<ReplayReport, ReplayError> {
    settings::check_rate_scale(opts.rate_scale).map_err(ReplayError::RateScale)?;
    let setup = ReplaySetup::resolve(manifest, settings)?;
    check_run_outputs(opts)?;
    check_clock(trace, opts.rate_scale)?;
    check_link(&setup, trace, opts.rate_scale)?;

    cm.set_policies(manifest.policies())
        .await
        .map_err(ReplayError::chunking("setting the model's policies"))?;
    let budgets = replay_budgets(manifest, settings, &setup, opts.budget_off, opts.budget)?;
    cm.set_budgets(budgets.clone())
        .await
        .map_err(ReplayError::chunking("applying the `[chunking]` budgets"))?;
    let mut labels = run_settings(cm, manifest, &setup, opts, trace).await?;
    labels.planner = report::PlannerLabel::of(&budgets, &setup.node);
    labels.planner.priority_by = opts.priority_by.map(|r| r.to_string());

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
    let priority_preemption = budgets.order.of(&setup.node).order == Order::Priority;
    let flag = opts.stop.as_ref().map(|f| f.0.clone());
    let (stop, _signals) = if opts.handle_signals {
        let flag = flag.unwrap_or_default();
        (Some(flag.clone()), catch_signals(flag))
    } else {
        (flag, None)
    };
    // The flag the run's own signals set (a sweep's shared flag is the sweep's to read).
    let own_signals = stop.clone().filter(|_| opts.handle_signals);
    tracing::debug!(
        requests = trace.requests.len(),
        node = %setup.node,
        workers = setup.fleet.size(),
        "replay started"
    );
    let plan = fleet::WorkerPlan {
        budgets: &budgets,
        walk_budgets: &labels.budgets,
        first_chunk_cap: cap,
        priority_preemption,
        stop,
    };
    let mut report = if setup.fleet.disagg.is_some() {
        disagg::run(cm, manifest, &setup, trace, opts, step_log, plan).await?
    } else if setup.fleet.workers > 1 || fleet_loop {
        fleet::run(cm, manifest, &setup, trace, opts, step_log, plan).await?
    } else {
        let mut sim = sim::Sim::new(cm, &setup, trace, opts, step_log)
            .time_budgets(plan.walk_budgets)
            .first_chunk_cap(plan.first_chunk_cap)
            .priority_preemption(plan.priority_preemption);
        if let Some(flag) = plan.stop {
            sim = sim.stop_on(flag);
        }
        sim.run().await?
    };
    if let Some(flag) = &own_signals {
        test_signal_at("ran", flag);
    }
    report.settings = labels;
    let mut warnings = trace_warnings(&setup, trace);
    warnings.append(&mut report.warnings);
    report.warnings = warnings;

    // Every prompt ran its final chunk, so every prepared input must have been released
    // (unless a signal stopped the replay midway: then the counts are reported). A fleet's
    // report holds its other workers' already.
    let (rows, tokens) = cm
        .prepared_totals()
        .await
        .map_err(ReplayError::chunking("counting prepared inputs left"))?;
    let (rows, tokens) = (
        rows + report.prepared_left_rows,
        tokens + report.prepared_left_tokens,
    );
    if report.interrupted.is_none() && (rows != 0 || tokens != 0) {
        return Err(ReplayError::PreparedLeft { rows, tokens });
    }
    // A signal received after the last step's check still stops the run: the report says so
    // (it covers every step) and the exit status is the signal's.
    if let Some(sig) = own_signals.as_ref().map(|f| f.load(Ordering::SeqCst)) {
        if sig != 0 && report.interrupted.is_none() {
            report.interrupted = Some(super::signal_name(sig));
        }
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
    setup: &ReplaySetup,
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
        planner: report::PlannerLabel::default(),
        config_layers: opts.config_layers.clone(),
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

/// Refuses the outputs `opts` asks for (the step log, the JSON report) when one would overwrite
/// an input (the trace, config layers, the model) or the other ([`check_outputs`]).
fn check_run_outputs(opts: &ReplayOptions) -> Result<(), ReplayError> {
    let outputs: Vec<(&'static str, &Path)> = [
        ("step log", opts.step_log.as_deref()),
        ("JSON report", opts.report_json.as_deref()),
    ]
    .into_iter()
    .filter_map(|(what, p)| Some((what, p?)))
    .collect();
    let mut inputs = opts.inputs.clone();
    inputs.extend(opts.trace.clone());
    check_outputs(&outputs, &inputs)
}
