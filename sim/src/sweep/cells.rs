//! How a sweep runs its cells: each one a replay (`crate::replay`) of the shared trace at one
//! budget and rate; the grid's budgets checked as the config would refuse them, and the
//! settings every cell shares as labels.

use std::sync::atomic::AtomicI32;
use std::sync::Arc;

use super::{Budget, RunSummary, StepMs};
use crate::config::problem::{escape, escape_join};
use crate::config::spelling::{PerNode, TimeSetting};
use crate::config::{LoadedConfig, Settings};
use crate::replay::{ReplayError, ReplayOptions, ReplaySetup, StopFlag, Trace};
use mstar_chunking::budget::TimeBudget;
use mstar_chunking::manifest::Manifest;

/// Refuses, before any replay runs, a setting of the grid the config would refuse as the
/// budget of the replayed walks (as `replay --budget` or `replay --max-step-ms` does).
///
/// # Errors
/// The first refused setting, and why.
pub fn check_budgets(
    manifest: &Manifest,
    settings: &Settings,
    setup: &ReplaySetup,
    budgets: &[Budget],
) -> Result<(), String> {
    for b in budgets {
        let refused = match b.time() {
            None => match crate::replay::replay_budgets(
                manifest,
                settings,
                setup,
                false,
                b.token_value(),
            ) {
                Ok(_) => continue,
                Err(ReplayError::Budget { reason, .. }) => format!(
                    "`--budgets` names {b}, which the config would refuse as the budget of the replayed walks: {reason}"
                ),
                Err(e) => format!("`--budgets` names {b}: {e}"),
            },
            Some(ms) => match time_refusal(manifest, &with_time(settings, setup, ms), setup) {
                None => continue,
                Some(reason) => format!("`--budgets` names {b}: {reason}"),
            },
        };
        return Err(format!("{refused} (no replay ran)"));
    }
    Ok(())
}

/// `settings` with time budget `ms` on the replayed node (`chunking.max_step_ms.<node>`, as
/// `replay --max-step-ms` sets it), over any of the config's.
pub fn with_time(settings: &Settings, setup: &ReplaySetup, ms: StepMs) -> Settings {
    let mut out = settings.clone();
    out.chunking.max_step_ms.insert(
        setup.node.clone(),
        PerNode::All(TimeSetting(TimeBudget::Ms(ms.ms()))),
    );
    out
}

/// Why the config would refuse `timed` (a time budget set by [`with_time`]) for the replayed
/// node: a time budget the planner has no latency model for among others.
fn time_refusal(manifest: &Manifest, timed: &Settings, setup: &ReplaySetup) -> Option<String> {
    match crate::replay::replay_budgets(manifest, timed, setup, false, None) {
        Ok(budgets) => crate::replay::budget_refusal(manifest, &budgets)
            .map(|reason| format!("the config would refuse it: {reason}")),
        Err(e) => Some(e.to_string()),
    }
}

/// One replay of a sweep's grid: `base` at `rate` under `budget` (a token budget over the
/// config's, or a time budget under the config's token budget), in its own actix system,
/// stopped at a step by `stop` (a signal): half a replay is no cell, so an interrupted one is
/// an error the sweep lists as not run.
pub fn run_cell(
    manifest: &Manifest,
    settings: &Settings,
    base: &ReplayOptions,
    trace: &Trace,
    budget: Budget,
    rate: f64,
    stop: &Arc<AtomicI32>,
) -> Result<RunSummary, String> {
    let mut o = base.clone();
    o.rate_scale = rate;
    o.budget = budget.token_value();
    o.stop = Some(StopFlag(stop.clone()));
    let timed;
    let settings = match budget.time() {
        Some(ms) => {
            let setup = ReplaySetup::resolve(manifest, settings).map_err(|e| e.to_string())?;
            timed = with_time(settings, &setup, ms);
            &timed
        }
        None => settings,
    };
    actix::System::new().block_on(async {
        let cm = mstar_chunking::ChunkingManagement::start(&manifest.name, manifest.submodules())
            .map_err(|e| e.to_string())?;
        let started = std::time::Instant::now();
        let r = crate::replay::run_trace(&cm, manifest, settings, &o, trace, started)
            .await
            .map_err(|e| e.to_string())?;
        match &r.interrupted {
            Some(signal) => Err(format!("interrupted by {signal}")),
            None => Ok(RunSummary::from(&r)),
        }
    })
}

/// The settings every replay of a sweep of `budgets` shares, as label and value.
pub fn labels(
    loaded: &LoadedConfig,
    setup: &ReplaySetup,
    opts: &ReplayOptions,
    trace: &Trace,
    budgets: &[Budget],
) -> Vec<(String, String)> {
    let mut v = vec![
        (
            "trace".to_string(),
            format!("{} ({})", escape(&trace.file), trace.format.name()),
        ),
        ("requests".to_string(), trace.requests.len().to_string()),
    ];
    if let Some(a) = &opts.arrivals {
        v.push(("arrivals".into(), a.to_string()));
    }
    v.extend([
        (
            "model".to_string(),
            format!(
                "{} ({})",
                escape(&loaded.manifest.name),
                escape(&loaded.model_origin)
            ),
        ),
        (
            "config layers".to_string(),
            escape_join(&loaded.layers, " -> "),
        ),
        (
            "node, step walk".to_string(),
            format!(
                "{} / {}",
                escape(&setup.node),
                escape_join(&setup.walks, ", ")
            ),
        ),
        (
            "cost model".to_string(),
            crate::replay::report::CostLabel::of(setup).to_string(),
        ),
        (
            "planner".to_string(),
            // The budget axis changes token budgets only: the rest is every cell's.
            crate::replay::replay_budgets(&loaded.manifest, &loaded.settings, setup, false, None)
                .map_or_else(
                    |e| e.to_string(),
                    |b| crate::replay::report::PlannerLabel::of(&b, &setup.node).to_string(),
                ),
        ),
        (
            "speculation".to_string(),
            off_or(u64::from(setup.spec_tokens), |n| {
                let tokens = crate::text::plural(n, "token");
                format!("{tokens}, overshoot rate {}", setup.overshoot_rate)
            }),
        ),
        (
            "prefix cache".to_string(),
            off_or(setup.cache_blocks as u64, |n| {
                format!("{n} blocks of {} tokens", setup.cache_block_tokens)
            }),
        ),
        ("seed".to_string(), setup.seed.to_string()),
        (
            "budget axis".to_string(),
            format!(
                "chunking.max_batch_tokens of {} / {} (as `replay --budget`)",
                escape(&setup.node),
                escape_join(&setup.walks, ", ")
            ),
        ),
    ]);
    if let Some(kv) = &setup.kv {
        v.push((
            "KV memory".to_string(),
            format!(
                "{} blocks of {} tokens ({}), watermark {}",
                kv.blocks, kv.block_tokens, kv.source, kv.watermark
            ),
        ));
    }
    // A fleet set in the config makes every cell a fleet replay (`docs/fleet.md`).
    if setup.fleet.size() > 1 {
        let workers = match &setup.fleet.disagg {
            Some(pd) => crate::replay::topology::label(pd),
            None => crate::text::plural(u64::from(setup.fleet.workers), "worker"),
        };
        v.push((
            "fleet".to_string(),
            format!("{workers} behind {} (replay.fleet)", setup.fleet.router),
        ));
    }
    // Time budgets are the config's, the same in every cell.
    let times: Vec<String> = setup
        .walks
        .iter()
        .filter_map(|w| {
            let ms = loaded.table.max_step_ms(&setup.node, w)?;
            Some(format!("{} {ms} ms", escape(w)))
        })
        .collect();
    v.push((
        "time budgets".to_string(),
        if times.is_empty() {
            "none".to_string()
        } else {
            times.join(", ")
        },
    ));
    label_time_cells(&mut v, setup, budgets);
    v
}

/// `labels` with the time budgets of `budgets` (the grid's settings) named on the budget axis,
/// if there are any: each runs the replayed node under the config's token budget.
fn label_time_cells(labels: &mut [(String, String)], setup: &ReplaySetup, budgets: &[Budget]) {
    let times: Vec<String> = budgets
        .iter()
        .filter(|b| b.is_time())
        .map(ToString::to_string)
        .collect();
    if times.is_empty() {
        return;
    }
    if let Some((_, axis)) = labels.iter_mut().find(|(k, _)| k == "budget axis") {
        axis.push_str(&format!(
            "; {}: chunking.max_step_ms of {} (as `replay --max-step-ms`), under the config's token budget",
            times.join(", "),
            escape(&setup.node)
        ));
    }
}

/// The trace's own request rate, requests per second: its arrivals after the first over the
/// time from the first to the last; `None` for fewer than two requests or no span of time.
pub fn trace_rps(trace: &Trace) -> Option<f64> {
    let (first, last) = (trace.requests.first()?, trace.requests.last()?);
    let span_s = (last.arrival_ms - first.arrival_ms) / 1000.0;
    let rps = (trace.requests.len() - 1) as f64 / span_s;
    (span_s > 0.0 && rps.is_finite()).then_some(rps)
}

/// `off` for a count of 0 (a feature turned off), else `label` of the count.
fn off_or(n: u64, label: impl FnOnce(u64) -> String) -> String {
    if n == 0 {
        "off".to_owned()
    } else {
        label(n)
    }
}
