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

use serde::Serialize;

use super::fleet::{self, WorkerPlan, MAX_WORKERS};
use super::fleet_report::PdReport;
use super::percentiles::Latency;
use super::report::ReplayReport;
use super::router::{Router, WorkerLoad};
use super::sim::{Handoff, Role, Sim, Tally};
use super::step_log::StepLog;
use super::trace::Trace;
use super::{ReplayError, ReplayOptions, ReplaySetup};
use crate::config::{FleetSection, ReplaySection};
use crate::manifest::Manifest;
use crate::ChunkingManagement;

/// The fastest KV link, Gbit/s.
pub const MAX_LINK_GBPS: f64 = 1e6;
/// The slowest KV link, Gbit/s (1 Mbit/s): at it a 1,000-token prompt of Llama-2-7B's KV
/// takes about 70 simulated minutes. Slower rates (down to subnormal numbers) would put a
/// transfer's end where the clock cannot add a step's milliseconds.
pub const MIN_LINK_GBPS: f64 = 1e-3;
/// The longest fixed latency of a KV transfer, ms.
pub const MAX_LINK_LATENCY_MS: f64 = 1e6;

/// A disaggregated fleet, checked: its two pools and the KV link between them.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PdSetup {
    /// Workers that prefill only.
    pub prefill_workers: u32,
    /// Workers that decode only.
    pub decode_workers: u32,
    /// A prefill worker's link, Gbit/s.
    pub kv_link_gbps: f64,
    /// A transfer's fixed latency, ms.
    pub kv_link_latency_ms: f64,
    /// Bytes of KV one prompt token moves.
    pub kv_bytes_per_token: f64,
    /// Where `kv_bytes_per_token` came from.
    pub kv_bytes_source: String,
}

impl PdSetup {
    /// Milliseconds `tokens` tokens of KV occupy the link (the latency left out).
    pub fn wire_ms(&self, tokens: u64) -> f64 {
        let bits = tokens as f64 * self.kv_bytes_per_token * 8.0;
        bits / (self.kv_link_gbps * 1e9) * 1000.0
    }

    /// Workers in both pools.
    pub fn workers(&self) -> u32 {
        self.prefill_workers + self.decode_workers
    }
}

/// Checks the disaggregated part of `[replay.fleet]`: both pools' sizes or neither, each from 1
/// and together at most [`MAX_WORKERS`], `workers` left at 1, and the link's figures. Each
/// problem goes to `refuse` with its key. The KV bytes a token holds are filled in by
/// [`resolve_kv_bytes`].
pub(super) fn check(
    f: &FleetSection,
    refuse: &mut impl FnMut(&'static str, Option<String>, String),
) -> Option<PdSetup> {
    let mut ok = true;
    if !(f.kv_link_gbps.is_finite() && (MIN_LINK_GBPS..=MAX_LINK_GBPS).contains(&f.kv_link_gbps)) {
        refuse(
            "replay.fleet.kv_link_gbps",
            Some(super::settings::float(f.kv_link_gbps)),
            format!("must be a number of Gbit/s above 0, from {MIN_LINK_GBPS:e} (1 Mbit/s) to {MAX_LINK_GBPS:e}"),
        );
        ok = false;
    }
    let latency = f.kv_link_latency_ms;
    if !(latency.is_finite() && (0.0..=MAX_LINK_LATENCY_MS).contains(&latency)) {
        refuse(
            "replay.fleet.kv_link_latency_ms",
            Some(super::settings::float(latency)),
            format!("must be a number of milliseconds from 0 to {MAX_LINK_LATENCY_MS:e}"),
        );
        ok = false;
    }
    let pools = [
        ("replay.fleet.prefill_workers", f.prefill_workers),
        ("replay.fleet.decode_workers", f.decode_workers),
    ];
    for (key, n) in pools {
        if let Some(n) = n.filter(|n| !(1..=MAX_WORKERS).contains(n)) {
            refuse(
                key,
                Some(n.to_string()),
                format!("must be a whole number of workers from 1 to {MAX_WORKERS}: a disaggregated fleet needs both pools"),
            );
            ok = false;
        }
    }
    let (p, d) = match (f.prefill_workers, f.decode_workers) {
        (None, None) => return None,
        (Some(p), Some(d)) => (p, d),
        (given, _) => {
            let (missing, set) = if given.is_some() {
                ("replay.fleet.decode_workers", "prefill_workers")
            } else {
                ("replay.fleet.prefill_workers", "decode_workers")
            };
            refuse(
                missing,
                None,
                format!("is needed with `{set}`: a disaggregated fleet has a prefill pool and a decode pool"),
            );
            return None;
        }
    };
    if ok && p + d > MAX_WORKERS {
        refuse(
            "replay.fleet.prefill_workers",
            Some(p.to_string()),
            format!(
                "and `decode_workers` = {d} make {} workers, more than {MAX_WORKERS}",
                p + d
            ),
        );
        ok = false;
    }
    if f.workers != 1 {
        refuse(
            "replay.fleet.workers",
            Some(f.workers.to_string()),
            format!("sizes a colocated fleet, and `prefill_workers` = {p} and `decode_workers` = {d} make a disaggregated one of {} workers: set one or the other (leave `workers` at 1)", p + d),
        );
        ok = false;
    }
    ok.then(|| PdSetup {
        prefill_workers: p,
        decode_workers: d,
        kv_link_gbps: f.kv_link_gbps,
        kv_link_latency_ms: latency,
        kv_bytes_per_token: 0.0,
        kv_bytes_source: String::new(),
    })
}

/// The KV bytes one token holds, as the KV memory model reads them, and where from: the memory
/// budget's `replay.kv.kv_bytes_per_token`, else `replay.kv.preset`'s model, else
/// `replay.cost`'s preset's model, else Llama-2-7B's (the model every preset describes).
pub(super) fn resolve_kv_bytes(r: &ReplaySection) -> (f64, String) {
    use crate::latency::presets;
    if let Some(b) =
        r.kv.kv_bytes_per_token
            .filter(|b| b.is_finite() && *b > 0.0)
    {
        return (b, "replay.kv.kv_bytes_per_token".into());
    }
    if let Some(p) = r.kv.preset.as_deref().and_then(super::kv::memory_preset) {
        return (
            p.budget.kv_bytes_per_token,
            format!("replay.kv.preset {}", p.name),
        );
    }
    if let Some(p) = r.cost.preset.as_deref().and_then(presets::preset) {
        return (
            p.shape.kv_bytes_per_token(),
            format!("replay.cost preset {}", p.name),
        );
    }
    (
        presets::LLAMA2_7B.kv_bytes_per_token(),
        "Llama-2-7B: no KV or cost preset names a model".into(),
    )
}

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

/// A disaggregated fleet's workers, as the report and the sweep's settings name them.
pub fn label(pd: &PdSetup) -> String {
    format!(
        "{} prefill + {} decode workers",
        pd.prefill_workers, pd.decode_workers
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    type Problem = (&'static str, Option<String>, String);

    fn checked(f: &FleetSection) -> (Option<PdSetup>, Vec<Problem>) {
        let mut problems = Vec::new();
        let setup = check(f, &mut |k, v, r| problems.push((k, v, r)));
        (setup, problems)
    }

    fn pools(p: Option<u32>, d: Option<u32>) -> FleetSection {
        FleetSection {
            prefill_workers: p,
            decode_workers: d,
            ..FleetSection::default()
        }
    }

    #[test]
    fn without_pools_the_fleet_is_colocated() {
        let (s, p) = checked(&FleetSection::default());
        assert!(s.is_none() && p.is_empty(), "{p:?}");
    }

    #[test]
    fn both_pools_make_a_disaggregated_fleet_with_the_link() {
        let (s, p) = checked(&FleetSection {
            kv_link_gbps: 50.0,
            kv_link_latency_ms: 0.0,
            ..pools(Some(2), Some(3))
        });
        assert!(p.is_empty(), "{p:?}");
        let s = s.unwrap();
        assert_eq!(
            (s.prefill_workers, s.decode_workers, s.workers()),
            (2, 3, 5)
        );
        assert_eq!((s.kv_link_gbps, s.kv_link_latency_ms), (50.0, 0.0));
        let (s, p) = checked(&pools(Some(128), Some(128)));
        assert!(p.is_empty() && s.is_some(), "{p:?}");
    }

    #[test]
    fn bad_pools_and_links_are_refused_at_their_keys() {
        for (f, key, why) in [
            (
                pools(Some(0), Some(1)),
                "replay.fleet.prefill_workers",
                "from 1 to 256",
            ),
            (
                pools(Some(1), Some(0)),
                "replay.fleet.decode_workers",
                "from 1 to 256",
            ),
            (
                pools(Some(1), Some(257)),
                "replay.fleet.decode_workers",
                "from 1 to 256",
            ),
            (
                pools(Some(2), None),
                "replay.fleet.decode_workers",
                "is needed with `prefill_workers`",
            ),
            (
                pools(None, Some(2)),
                "replay.fleet.prefill_workers",
                "is needed with `decode_workers`",
            ),
            (
                pools(Some(200), Some(57)),
                "replay.fleet.prefill_workers",
                "make 257 workers",
            ),
            (
                FleetSection {
                    workers: 4,
                    ..pools(Some(1), Some(1))
                },
                "replay.fleet.workers",
                "set one or the other",
            ),
            (
                FleetSection {
                    kv_link_gbps: 0.0,
                    ..FleetSection::default()
                },
                "replay.fleet.kv_link_gbps",
                "above 0",
            ),
            (
                FleetSection {
                    kv_link_gbps: f64::INFINITY,
                    ..FleetSection::default()
                },
                "replay.fleet.kv_link_gbps",
                "above 0",
            ),
            (
                FleetSection {
                    kv_link_latency_ms: -1.0,
                    ..FleetSection::default()
                },
                "replay.fleet.kv_link_latency_ms",
                "from 0",
            ),
            (
                FleetSection {
                    kv_link_latency_ms: f64::NAN,
                    ..FleetSection::default()
                },
                "replay.fleet.kv_link_latency_ms",
                "from 0",
            ),
        ] {
            let (s, p) = checked(&f);
            assert!(s.is_none(), "{f:?}");
            assert_eq!(p.len(), 1, "{f:?}: {p:?}");
            assert_eq!(p[0].0, key, "{p:?}");
            assert!(p[0].2.contains(why), "{p:?}");
        }
        // The largest link and latency are accepted.
        let (s, p) = checked(&FleetSection {
            kv_link_gbps: MAX_LINK_GBPS,
            kv_link_latency_ms: MAX_LINK_LATENCY_MS,
            ..pools(Some(1), Some(1))
        });
        assert!(p.is_empty() && s.is_some(), "{p:?}");
    }

    #[test]
    fn a_link_below_the_floor_is_refused_at_its_key_shown_in_exponent_form() {
        for (gbps, shown) in [
            (1e-300, "1e-300"),
            (1e-320, "1e-320"),
            (MIN_LINK_GBPS / 2.0, "0.0005"),
            (-1.0, "-1"),
        ] {
            let (s, p) = checked(&FleetSection {
                kv_link_gbps: gbps,
                ..pools(Some(1), Some(1))
            });
            assert!(s.is_none(), "{gbps}");
            assert_eq!(p.len(), 1, "{gbps}: {p:?}");
            assert_eq!(p[0].0, "replay.fleet.kv_link_gbps");
            assert_eq!(p[0].1.as_deref(), Some(shown));
            assert!(p[0].2.contains("from 1e-3 (1 Mbit/s)"), "{p:?}");
        }
        let (s, p) = checked(&FleetSection {
            kv_link_gbps: MIN_LINK_GBPS,
            ..pools(Some(1), Some(1))
        });
        assert!(p.is_empty() && s.is_some(), "{p:?}");
    }

    #[test]
    fn a_transfer_takes_its_bytes_at_the_link_rate() {
        let pd = PdSetup {
            prefill_workers: 1,
            decode_workers: 1,
            kv_link_gbps: 100.0,
            kv_link_latency_ms: 2.0,
            kv_bytes_per_token: 524_288.0,
            kv_bytes_source: String::new(),
        };
        // 1,000 tokens × 512 KiB × 8 bits at 100 Gbit/s: 41.943 04 ms.
        assert!((pd.wire_ms(1000) - 41.943_04).abs() < 1e-9);
        assert_eq!(pd.wire_ms(0), 0.0);
    }

    #[test]
    fn kv_bytes_come_from_the_memory_model_then_the_cost_preset() {
        let mut r = ReplaySection::default();
        assert_eq!(resolve_kv_bytes(&r).0, 524_288.0);
        assert!(resolve_kv_bytes(&r).1.contains("Llama-2-7B"));
        r.cost.preset = Some("llama2-7b-h100".into());
        assert_eq!(
            resolve_kv_bytes(&r),
            (524_288.0, "replay.cost preset llama2-7b-h100".into())
        );
        r.kv.preset = Some("llama2-7b-a100".into());
        assert_eq!(
            resolve_kv_bytes(&r),
            (524_288.0, "replay.kv.preset llama2-7b-a100".into())
        );
        r.kv.kv_bytes_per_token = Some(131_072.0);
        assert_eq!(
            resolve_kv_bytes(&r),
            (131_072.0, "replay.kv.kv_bytes_per_token".into())
        );
    }
}
