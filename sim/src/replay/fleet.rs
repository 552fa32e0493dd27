//! A fleet in the replay (`docs/fleet.md`): `replay.fleet.workers` instances of the component,
//! each with its own actors, queues, prefix cache and KV memory, on one simulated clock, behind
//! a router that sends each request to one of them once, at its arrival (no global queue).
//!
//! The loop is a discrete-event simulation over the workers' own loops (`Sim::turn`): the
//! next event is either the next arrival, routed on what the router sees of every worker at
//! that moment ([`super::router`]), or the step of the worker whose next step starts first. An
//! arrival at the very time a step starts is routed first, so it can join that step, as it does
//! with one worker. Each worker's steps are those a single replay of its requests would run,
//! so a fleet of N workers costs about N times the steps of one.

use std::cell::RefCell;
use std::io::IsTerminal;
use std::rc::Rc;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Arc;

use indicatif::{ProgressBar, ProgressStyle};

use super::fleet_report::{share, FleetReport, WorkerFigures};
use super::report::ReplayReport;
use super::router::{Router, RouterKind, WorkerLoad};
use super::sim::{Sim, Tally, Turn};
use super::step_log::StepLog;
use super::trace::Trace;
use super::{ReplayError, ReplayOptions, ReplaySetup};
use mstar_chunking::budget::BudgetSettings;
use mstar_chunking::manifest::Manifest;
use mstar_chunking::ChunkingManagement;

/// Steps between progress bar updates.
pub(super) const PROGRESS_EVERY: u64 = 256;

/// What a fleet's workers are set up with, as a single replay's simulation is (`run.rs`).
pub(super) struct WorkerPlan<'a> {
    /// The budgets every worker applies.
    pub budgets: &'a BudgetSettings,
    /// The walks with a budget, for counting steps planned without a time budget.
    pub walk_budgets: &'a [super::report::WalkBudget],
    /// The most tokens a first chunk may run (for KV admission).
    pub first_chunk_cap: Option<u32>,
    /// Whether KV memory follows priorities.
    pub priority_preemption: bool,
    /// Set to a signal number to stop at the next step.
    pub stop: Option<Arc<AtomicI32>>,
}

/// Replays `trace` on a fleet of `setup.fleet.workers` workers, `first` being worker 0 (the
/// caller's actors, policies and budgets already set) and the others started here with the
/// same model, policies and budgets. Writes the step log when given one (its lines naming
/// their worker). The report's prepared inputs left count the workers other than `first`.
///
/// # Errors
/// As a single replay's simulation, for any worker; a worker's actors that do not start.
pub(super) async fn run(
    first: &ChunkingManagement,
    manifest: &Manifest,
    setup: &ReplaySetup,
    trace: &Trace,
    opts: &ReplayOptions,
    step_log: Option<StepLog>,
    plan: WorkerPlan<'_>,
) -> Result<ReplayReport, ReplayError> {
    let n = setup.fleet.workers;
    let others = start_workers(manifest, 1..n, plan.budgets).await?;
    let log = step_log.map(|l| Rc::new(RefCell::new(l)));
    let cms: Vec<&ChunkingManagement> = std::iter::once(first).chain(&others).collect();
    let mut sims: Vec<Sim<'_>> = cms
        .iter()
        .enumerate()
        .map(|(w, cm)| {
            Sim::new(cm, setup, trace, opts, None)
                .time_budgets(plan.walk_budgets)
                .first_chunk_cap(plan.first_chunk_cap)
                .priority_preemption(plan.priority_preemption)
                .into_worker(w as u32, n, log.clone())
        })
        .collect();
    sims[0].check_fits()?;
    let router = Router::new(setup.fleet.router, setup.fleet.affinity_slack);
    let interrupted = drive(&mut sims, router, trace, opts, plan.stop.as_deref()).await?;

    let routed: Vec<usize> = sims.iter().map(Sim::routed).collect();
    let tallies: Vec<Tally> = sims.into_iter().map(Sim::into_tally).collect();
    if let Some(log) = log {
        finish_log(log)?;
    }
    let mut report = pool(tallies, &routed, setup);
    report.interrupted = interrupted;
    count_left(&mut report, &others).await?;
    Ok(report)
}

/// Adds what the other workers' actors still hold to `report`'s prepared inputs left (the
/// first worker's simulation counted its own).
pub(super) async fn count_left(
    report: &mut ReplayReport,
    others: &[ChunkingManagement],
) -> Result<(), ReplayError> {
    for cm in others {
        let (rows, tokens) = cm
            .prepared_totals()
            .await
            .map_err(ReplayError::chunking("counting prepared inputs left"))?;
        report.prepared_left_rows += rows;
        report.prepared_left_tokens += tokens;
    }
    Ok(())
}

/// Starts the actors of workers `range` (worker 0 is the caller's), each with the model's
/// policies and `budgets`.
pub(super) async fn start_workers(
    manifest: &Manifest,
    range: std::ops::Range<u32>,
    budgets: &BudgetSettings,
) -> Result<Vec<ChunkingManagement>, ReplayError> {
    let mut others = Vec::with_capacity(range.len());
    for w in range {
        let cm =
            ChunkingManagement::start_worker(&manifest.name, &w.to_string(), manifest.submodules())
                .map_err(ReplayError::chunking("starting a worker's actors"))?;
        cm.set_policies(manifest.policies())
            .await
            .map_err(ReplayError::chunking("setting the model's policies"))?;
        cm.set_budgets(budgets.clone())
            .await
            .map_err(ReplayError::chunking("applying the `[chunking]` budgets"))?;
        others.push(cm);
    }
    Ok(others)
}

/// Finishes the step log the workers shared, once every worker is done with it.
pub(super) fn finish_log(log: Rc<RefCell<StepLog>>) -> Result<(), ReplayError> {
    let path = log.borrow().path().to_owned();
    let log = Rc::try_unwrap(log)
        .map_err(|_| ReplayError::Write {
            what: "step log",
            path: path.clone(),
            source: std::io::Error::other("still written to by a worker"),
        })?
        .into_inner();
    log.finish().map_err(|source| ReplayError::Write {
        what: "step log",
        path,
        source,
    })
}

/// Runs the event loop until every request is done (or `stop` holds a signal), then completes
/// each worker's last step. Answers the signal that stopped it, if one did.
async fn drive(
    sims: &mut [Sim<'_>],
    mut router: Router,
    trace: &Trace,
    opts: &ReplayOptions,
    stop: Option<&AtomicI32>,
) -> Result<Option<String>, ReplayError> {
    let arrivals: Vec<f64> = trace
        .requests
        .iter()
        .map(|r| r.arrival_ms / opts.rate_scale)
        .collect();
    let progress = progress_bar(opts, arrivals.len());
    let mut loads = vec![WorkerLoad::default(); sims.len()];
    // Each worker's next step start, kept up to date for the two workers an event changes (the
    // one that stepped, the one a request went to) rather than asked of every worker per event.
    let mut starts: Vec<Option<f64>> = sims.iter().map(Sim::next_start).collect();
    let mut next = 0usize;
    let mut steps = 0u64;
    let mut interrupted = None;
    loop {
        if let Some(sig) = stop.map(|f| f.load(Ordering::SeqCst)).filter(|&s| s != 0) {
            interrupted = Some(super::signal_name(sig));
            break;
        }
        let soonest = soonest_step(&starts);
        if next < arrivals.len() && soonest.is_none_or(|(t, _)| arrivals[next] <= t) {
            let a = arrivals[next];
            for (load, sim) in loads.iter_mut().zip(sims.iter()) {
                *load = sim.load_at(a);
                if router.kind().reads_prefixes() {
                    load.prefix_blocks = sim.prefix_blocks_at(next, a);
                }
            }
            let w = router.pick(&loads);
            sims[w].route(next);
            starts[w] = sims[w].next_start();
            next += 1;
            continue;
        }
        let Some((_, w)) = soonest else {
            break;
        };
        steps += step_worker(&mut sims[w], &mut starts[w]).await?;
        if let Some(hook) = &opts.on_step {
            hook.call(steps);
        }
        if let Some(pb) = &progress {
            if steps.is_multiple_of(PROGRESS_EVERY) {
                pb.set_position(sims.iter().map(|s| s.done() as u64).sum());
            }
        }
    }
    for sim in sims.iter_mut() {
        sim.complete_last().await?;
    }
    if let Some(pb) = progress {
        pb.finish_and_clear();
    }
    Ok(interrupted)
}

/// Runs the next step of a worker that has one, and keeps when its step after starts in
/// `start`; answers the steps it ran.
pub(super) async fn step_worker(
    sim: &mut Sim<'_>,
    start: &mut Option<f64>,
) -> Result<u64, ReplayError> {
    let before = sim.steps();
    let turn = sim.turn().await?;
    debug_assert_eq!(turn, Turn::Stepped, "a worker with a next step takes it");
    *start = sim.next_start();
    Ok(sim.steps() - before)
}

/// The worker whose next step starts first, and when (ties to the lower index), from each
/// worker's next start (`None`: nothing to run).
pub(super) fn soonest_step(starts: &[Option<f64>]) -> Option<(f64, usize)> {
    starts
        .iter()
        .enumerate()
        .filter_map(|(w, t)| t.map(|t| (t, w)))
        .min_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)))
}

pub(super) fn progress_bar(opts: &ReplayOptions, requests: usize) -> Option<ProgressBar> {
    if !opts.progress || !std::io::stderr().is_terminal() {
        return None;
    }
    let pb = ProgressBar::new(requests as u64);
    if let Ok(style) = ProgressStyle::with_template(
        "{spinner} replay [{elapsed_precise}] {wide_bar} {pos}/{len} requests done ({eta})",
    ) {
        pb.set_style(style);
    }
    Some(pb)
}

/// The fleet's report: every worker's counts and samples pooled, and each worker's share.
fn pool(tallies: Vec<Tally>, routed: &[usize], setup: &ReplaySetup) -> ReplayReport {
    let pools = vec![None; routed.len()];
    let (mut report, mut fleet) = pool_tallies(tallies, routed, &pools, setup);
    fleet.request_imbalance = imbalance(routed);
    // A fleet of one reports what a single replay does.
    report.fleet = (setup.fleet.workers > 1).then_some(fleet);
    report
}

/// The most requests one worker got over the mean (1 with none).
pub(super) fn imbalance(routed: &[usize]) -> f64 {
    let total: usize = routed.iter().sum();
    let most = routed.iter().copied().max().unwrap_or(0);
    let mean = total as f64 / routed.len().max(1) as f64;
    if mean > 0.0 {
        most as f64 / mean
    } else {
        1.0
    }
}

/// Every worker's counts and samples pooled into one report, and the fleet's part of it: each
/// worker's share (named by its pool, `pools[w]`, in a disaggregated fleet). The imbalance is
/// left at 1 and the disaggregated part unset, for the caller.
pub(super) fn pool_tallies(
    tallies: Vec<Tally>,
    routed: &[usize],
    pools: &[Option<&'static str>],
    setup: &ReplaySetup,
) -> (ReplayReport, FleetReport) {
    let total_requests: usize = routed.iter().sum();
    let total_tokens: u64 = tallies.iter().map(|t| t.report.tokens.ran).sum();
    let mut per_worker = Vec::with_capacity(tallies.len());
    let mut pooled: Option<Tally> = None;
    for (w, mut tally) in tallies.into_iter().enumerate() {
        let (ttft_ms, tbt_ms) = tally.latencies();
        let r = &tally.report;
        per_worker.push(WorkerFigures {
            worker: w as u32,
            pool: pools.get(w).copied().flatten(),
            requests: routed[w],
            request_share: share(routed[w] as u64, total_requests as u64),
            tokens: r.tokens.ran,
            token_share: share(r.tokens.ran, total_tokens),
            cached_tokens: r.tokens.cached,
            steps: r.steps,
            ttft_ms,
            tbt_ms,
        });
        match &mut pooled {
            None => pooled = Some(tally),
            Some(p) => p.absorb(tally),
        }
    }
    let fleet = FleetReport {
        workers: routed.len() as u32,
        router: setup.fleet.router,
        affinity_slack: (setup.fleet.router == RouterKind::PrefixAffinity)
            .then_some(setup.fleet.affinity_slack),
        request_imbalance: 1.0,
        per_worker,
        disaggregated: None,
    };
    let report = pooled
        .map(Tally::finish)
        .expect("a fleet has at least one worker");
    (report, fleet)
}
