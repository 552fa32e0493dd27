//! Disaggregated prefill in the replay (`docs/disaggregated.md`): a prefill pool
//! and a decode pool on one simulated clock, and the KV transfer between them.
//!
//! - A request arrives at a prefill worker (the fleet's router over the prefill pool), which
//!   runs its prompt only, chunked under the worker's budget (whole with the budget off). The
//!   prompt's final chunk yields its first token there: its TTFT ends at that step's end.
//! - Its prompt's KV then moves over the prefill worker's link: `kv_link_latency_ms` plus the
//!   prompt's bytes (its tokens × the KV bytes a token holds) at `kv_link_gbps`. A prefill
//!   worker's link carries one transfer at a time, in the order the prompts finished; the
//!   network and the receiving side are not contended. The KV stays held on the prefill worker
//!   until its transfer is done, then is freed there.
//! - When the transfer is done, the router over the decode pool (the same rule) picks a decode
//!   worker, as it sees the pool then. The request waits there for KV memory as an arrival
//!   does, then generates its other tokens on `decode` rows; its times between tokens are the
//!   decode worker's, the first of them counted from the first token (so it includes the
//!   transfer). A decode worker that runs out of memory preempts by recompute as a colocated
//!   one does, and recomputes the prompt itself. The KV is freed there at the last token.
//!
//! Every step, on either pool, is priced by the replay's own step cost (`replay.cost`) from
//! what it ran, as a colocated worker's is.

use std::cell::RefCell;
use std::cmp::{Ordering as CmpOrdering, Reverse};
use std::collections::BinaryHeap;
use std::rc::Rc;
use std::sync::atomic::{AtomicI32, Ordering};

use super::fleet::{self, WorkerPlan};
use super::fleet_report::PdReport;
use super::percentiles::Latency;
use super::report::ReplayReport;
use super::router::{Router, WorkerLoad};
use super::sim::{Handoff, Role, Sim, Tally};
use super::step_log::StepLog;
use super::trace::Trace;
use super::{ReplayError, ReplayOptions, ReplaySetup};
use mstar_chunking::manifest::Manifest;
use mstar_chunking::ChunkingManagement;

/// A KV transfer under way: when it is done, the request, the prefill worker it leaves, when
/// its first token came out, and its order of sending (ties broken by it).
#[derive(Debug, Clone, Copy)]
struct Transfer {
    done_ms: f64,
    seq: u64,
    i: usize,
    from: usize,
    first_token_ms: f64,
}

impl PartialEq for Transfer {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == CmpOrdering::Equal
    }
}

impl Eq for Transfer {}

impl PartialOrd for Transfer {
    fn partial_cmp(&self, other: &Self) -> Option<CmpOrdering> {
        Some(self.cmp(other))
    }
}

impl Ord for Transfer {
    fn cmp(&self, other: &Self) -> CmpOrdering {
        self.done_ms
            .total_cmp(&other.done_ms)
            .then(self.seq.cmp(&other.seq))
    }
}

/// What the transfers came to.
#[derive(Debug, Default)]
struct Transfers {
    /// From each first token to its KV's arrival, ms (the link's queue included).
    ms: Vec<f64>,
    /// Bytes moved.
    bytes: f64,
}

/// Replays `trace` on a disaggregated fleet: `first` (the caller's actors) is prefill worker 0;
/// the other prefill workers and the decode workers are started here with the same model,
/// policies and budgets. Prefill workers are indices `0..P` of the report and the step log,
/// decode workers `P..P + D`.
///
/// # Errors
/// As a fleet's replay; [`ReplayError::Stalled`] if a request never finished.
pub(super) async fn run(
    first: &ChunkingManagement,
    manifest: &Manifest,
    setup: &ReplaySetup,
    trace: &Trace,
    opts: &ReplayOptions,
    step_log: Option<StepLog>,
    plan: WorkerPlan<'_>,
) -> Result<ReplayReport, ReplayError> {
    let pd = setup
        .fleet
        .disagg
        .as_ref()
        .expect("a disaggregated run has its pools");
    let (p, n) = (pd.prefill_workers as usize, pd.workers());
    let others = fleet::start_workers(manifest, 1..n, plan.budgets).await?;
    let log = step_log.map(|l| Rc::new(RefCell::new(l)));
    let cms: Vec<&ChunkingManagement> = std::iter::once(first).chain(&others).collect();
    let mut sims: Vec<Sim<'_>> = cms
        .iter()
        .enumerate()
        .map(|(w, cm)| {
            let role = if w < p { Role::Prefill } else { Role::Decode };
            Sim::new(cm, setup, trace, opts, None)
                .time_budgets(plan.walk_budgets)
                .first_chunk_cap(plan.first_chunk_cap)
                .priority_preemption(plan.priority_preemption)
                .into_worker(w as u32, n, log.clone())
                .with_role(role)
        })
        .collect();
    sims[0].check_fits()?;
    let (interrupted, mut transfers) =
        drive(&mut sims, p, setup, trace, opts, plan.stop.as_deref()).await?;
    if interrupted.is_none() {
        finished_every_request(&sims, p, trace, setup)?;
    }
    let kv_left: u64 = sims.iter().map(Sim::request_blocks).sum();
    let routed: Vec<usize> = sims.iter().map(Sim::routed).collect();
    let tallies: Vec<Tally> = sims.into_iter().map(Sim::into_tally).collect();
    if let Some(log) = log {
        fleet::finish_log(log)?;
    }
    let pools: Vec<Option<&'static str>> = (0..n as usize)
        .map(|w| if w < p { Role::Prefill } else { Role::Decode }.pool())
        .collect();
    let (mut report, mut fleet_report) = fleet::pool_tallies(tallies, &routed, &pools, setup);
    fleet_report.request_imbalance =
        fleet::imbalance(&routed[..p]).max(fleet::imbalance(&routed[p..]));
    fleet_report.disaggregated = Some(PdReport {
        setup: pd.clone(),
        transfers: transfers.ms.len(),
        transfer_bytes: transfers.bytes,
        transfer_ms: Latency::of(&mut transfers.ms),
        kv_blocks_left: kv_left,
    });
    report.fleet = Some(fleet_report);
    report.interrupted = interrupted;
    fleet::count_left(&mut report, &others).await?;
    Ok(report)
}

/// Refuses a run that ended with a request not done: every request finishes on its prefill
/// worker (one token) or on a decode worker.
fn finished_every_request(
    sims: &[Sim<'_>],
    p: usize,
    trace: &Trace,
    setup: &ReplaySetup,
) -> Result<(), ReplayError> {
    let one_token = trace
        .requests
        .iter()
        .filter(|r| r.output_tokens <= 1)
        .count();
    let decoded: usize = sims[p..].iter().map(Sim::done).sum();
    if decoded + one_token == trace.requests.len() {
        return Ok(());
    }
    Err(ReplayError::Stalled {
        t_ms: sims.iter().map(Sim::now).fold(0.0, f64::max),
        node: setup.node.clone(),
        prefilling: sims[..p].iter().map(Sim::routed).sum::<usize>()
            - sims[..p].iter().map(Sim::done).sum::<usize>(),
        decoding: trace.requests.len() - one_token - decoded,
    })
}

/// The event loop: arrivals routed to the prefill pool, transfers done routed to the decode
/// pool, and the step of the worker whose next step starts first; at equal times an arrival
/// first, then a transfer, then a step (so both can join a step starting then).
async fn drive(
    sims: &mut [Sim<'_>],
    p: usize,
    setup: &ReplaySetup,
    trace: &Trace,
    opts: &ReplayOptions,
    stop: Option<&AtomicI32>,
) -> Result<(Option<String>, Transfers), ReplayError> {
    let pd = setup.fleet.disagg.as_ref().expect("checked by `run`");
    let arrivals: Vec<f64> = trace
        .requests
        .iter()
        .map(|r| r.arrival_ms / opts.rate_scale)
        .collect();
    let mut prefill_router = Router::new(setup.fleet.router, setup.fleet.affinity_slack);
    let mut decode_router = Router::new(setup.fleet.router, setup.fleet.affinity_slack);
    let mut loads = vec![WorkerLoad::default(); sims.len()];
    let mut starts: Vec<Option<f64>> = sims.iter().map(Sim::next_start).collect();
    let mut queue: BinaryHeap<Reverse<Transfer>> = BinaryHeap::new();
    let mut link_free = vec![0.0f64; p];
    let mut handoffs: Vec<Handoff> = Vec::new();
    let mut out = Transfers::default();
    let (mut next, mut steps, mut seq) = (0usize, 0u64, 0u64);
    let mut interrupted = None;
    let progress = fleet::progress_bar(opts, arrivals.len());
    loop {
        if let Some(sig) = stop.map(|f| f.load(Ordering::SeqCst)).filter(|&s| s != 0) {
            interrupted = Some(super::signal_name(sig));
            break;
        }
        let soonest = fleet::soonest_step(&starts);
        let step_at = soonest.map(|(t, _)| t);
        let transfer_at = queue.peek().map(|Reverse(t)| t.done_ms);
        if next < arrivals.len()
            && step_at.is_none_or(|s| arrivals[next] <= s)
            && transfer_at.is_none_or(|t| arrivals[next] <= t)
        {
            let a = arrivals[next];
            let w = route(&mut prefill_router, &mut loads[..p], &sims[..p], next, a);
            sims[w].route(next);
            starts[w] = sims[w].next_start();
            next += 1;
            continue;
        }
        if let Some(t) = transfer_at.filter(|&t| step_at.is_none_or(|s| t <= s)) {
            let Some(Reverse(tr)) = queue.pop() else {
                break;
            };
            sims[tr.from].transfer_done(tr.i, t);
            starts[tr.from] = sims[tr.from].next_start();
            let d = p + route(&mut decode_router, &mut loads[p..], &sims[p..], tr.i, t);
            sims[d].route_decoded(tr.i, t, tr.first_token_ms);
            starts[d] = sims[d].next_start();
            continue;
        }
        let Some((_, w)) = soonest else {
            break;
        };
        steps += fleet::step_worker(&mut sims[w], &mut starts[w]).await?;
        if w < p {
            sims[w].take_handoffs(&mut handoffs);
            for h in handoffs.drain(..) {
                let tokens = u64::from(trace.requests[h.i].input_tokens);
                let start = h.t_ms.max(link_free[w]);
                link_free[w] = start + pd.wire_ms(tokens);
                let done_ms = link_free[w] + pd.kv_link_latency_ms;
                out.ms.push(done_ms - h.t_ms);
                out.bytes += tokens as f64 * pd.kv_bytes_per_token;
                queue.push(Reverse(Transfer {
                    done_ms,
                    seq,
                    i: h.i,
                    from: w,
                    first_token_ms: h.t_ms,
                }));
                seq += 1;
            }
        }
        if let Some(hook) = &opts.on_step {
            hook.call(steps);
        }
        if let Some(pb) = &progress {
            if steps.is_multiple_of(fleet::PROGRESS_EVERY) {
                // A prefill worker counts a handed-off request as done: it is not yet.
                let done: usize = sims.iter().map(Sim::done).sum();
                pb.set_position((done as u64).saturating_sub(seq));
            }
        }
    }
    for sim in sims.iter_mut() {
        sim.complete_last().await?;
    }
    if let Some(pb) = progress {
        pb.finish_and_clear();
    }
    Ok((interrupted, out))
}

/// The worker of `pool` (one pool's simulations, `loads` their load buffer) the router sends
/// request `i` to at `t_ms`, from what it sees of each then.
fn route(
    router: &mut Router,
    loads: &mut [WorkerLoad],
    pool: &[Sim<'_>],
    i: usize,
    t_ms: f64,
) -> usize {
    for (load, sim) in loads.iter_mut().zip(pool) {
        *load = sim.load_at(t_ms);
        if router.kind().reads_prefixes() {
            load.prefix_blocks = sim.prefix_blocks_at(i, t_ms);
        }
    }
    router.pick(loads)
}
