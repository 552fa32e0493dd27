//! Instruction counts of the step path under Callgrind (the `gungraun` harness): the benchmark
//! of record, since a count does not move with the load of the machine as wall time does.
//! `scripts/bench_check.py` compares every figure with `benches/baseline/instructions.json`
//! (`make bench-check`, `make bench-baseline`); docs/benchmarks.md says how.
//!
//! Per workload W1–W3 (`benches/common`), each benchmark counts a fixed number of repetitions
//! after an uncounted setup that reaches the steady state:
//! - `planner::token`: [`PLANS`] plans of the token planner;
//! - `planner::timed`: [`PLANS`] plans under a binding time budget (the A100 preset);
//! - `planner::ranked`: [`PLANS`] token plans under the `shortest_first` order, each with its
//!   ranking of the waiting prompts (what a step of a node with another order than `fcfs`
//!   pays);
//! - `facade::two_trips`: [`STEPS`] whole steps through the facade with `assemble` + `complete`;
//! - `facade::one_trip`: [`STEPS`] whole steps with `complete_and_assemble`;
//! - `replay::bundled`: one replay of the bundled trace's first [`REPLAY_REQUESTS`] requests
//!   with the default config and the demo model, actors started inside the count.
//!
//! Runs only under `gungraun-runner` (`cargo bench --bench instructions`), which must be the
//! version of the `gungraun` crate; `scripts/install-test-deps.sh` installs both it and
//! valgrind.

use std::hint::black_box;
use std::sync::Arc;

use gungraun::{library_benchmark, library_benchmark_group};
use mstar_chunking::manifest::Manifest;
use mstar_chunking::order::{rank as rank_rows, NodeOrder, Order, WaitBound};
use mstar_chunking::planner::{plan_ranked, StepParams, StepPlan, TimeLimit};
use mstar_chunking::scheduler::SchedulerState;
use mstar_chunking_sim::config::Settings;
use mstar_chunking_sim::replay::{self, ReplayOptions, Trace};

#[path = "../../benches/common/mod.rs"]
mod common;
use common::{plan_once, plan_timed_once, planner_state, time_limit, Engine, WORKLOADS};

/// Plans per planner benchmark.
const PLANS: usize = 100;
/// Steps per facade benchmark.
const STEPS: u64 = 100;
/// Requests of the bundled trace the replay benchmark runs.
const REPLAY_REQUESTS: usize = 300;

type PlannerInput = (SchedulerState, Arc<StepParams>, TimeLimit, StepPlan);

/// The workload's steady queues, its step parameters, its time limit and a plan buffer used
/// once (so the counted plans reuse its capacity, as the Scheduler's do).
fn planner_setup(w: usize) -> PlannerInput {
    let w = WORKLOADS[w];
    let (state, params) = planner_state(w);
    let time = time_limit(w);
    let mut out = StepPlan::default();
    plan_once(&state, &params, &mut out);
    plan_timed_once(&state, &params, time, &mut out);
    (state, params, time, out)
}

#[library_benchmark]
#[bench::w1(args = (0), setup = planner_setup)]
#[bench::w2(args = (1), setup = planner_setup)]
#[bench::w3(args = (2), setup = planner_setup)]
fn token(input: PlannerInput) -> PlannerInput {
    let (state, params, time, mut out) = input;
    for _ in 0..PLANS {
        plan_once(black_box(&state), black_box(&params), &mut out);
    }
    (state, params, time, out)
}

#[library_benchmark]
#[bench::w1(args = (0), setup = planner_setup)]
#[bench::w2(args = (1), setup = planner_setup)]
#[bench::w3(args = (2), setup = planner_setup)]
fn timed(input: PlannerInput) -> PlannerInput {
    let (state, params, time, mut out) = input;
    for _ in 0..PLANS {
        plan_timed_once(black_box(&state), black_box(&params), time, &mut out);
    }
    (state, params, time, out)
}

/// The planner input with the node's queues under `shortest_first`, and the rank buffer (used
/// once, so the counted steps reuse its capacity).
type RankedInput = (PlannerInput, Vec<u32>);

fn ranked_setup(w: usize) -> RankedInput {
    let input = planner_setup(w);
    let mut rank = Vec::new();
    ranked_once(&input.0, &input.1, &mut input.3.clone(), &mut rank);
    (input, rank)
}

/// One step of a node ordered `shortest_first`: the ranking, then the plan that walks it.
fn ranked_once(
    state: &SchedulerState,
    params: &StepParams,
    out: &mut StepPlan,
    rank: &mut Vec<u32>,
) {
    let q = state.node(common::NODE).expect("the node has queues");
    let order = NodeOrder {
        order: Order::ShortestFirst,
        bound: WaitBound::default(),
    };
    rank_rows(order, q.clock(None), q.prefill(), rank);
    plan_ranked(params, None, q.cont(), q.prefill(), rank, out);
}

#[library_benchmark]
#[bench::w1(args = (0), setup = ranked_setup)]
#[bench::w2(args = (1), setup = ranked_setup)]
#[bench::w3(args = (2), setup = ranked_setup)]
fn ranked(input: RankedInput) -> RankedInput {
    let ((state, params, time, mut out), mut rank) = input;
    for _ in 0..PLANS {
        ranked_once(black_box(&state), black_box(&params), &mut out, &mut rank);
    }
    ((state, params, time, out), rank)
}

library_benchmark_group!(name = planner; benchmarks = token, timed, ranked);

/// A facade on its own actix System, warmed up to the workload's steady state.
fn facade_setup(w: usize) -> (actix::SystemRunner, Engine) {
    let sys = common::system();
    let engine = sys.block_on(Engine::start(WORKLOADS[w]));
    (sys, engine)
}

/// As [`facade_setup`], with one one-trip step run, so the counted steps each start with the
/// batch the previous completion answered.
fn facade_one_trip_setup(w: usize) -> (actix::SystemRunner, Engine) {
    let (sys, mut engine) = facade_setup(w);
    sys.block_on(engine.step_one_trip());
    (sys, engine)
}

#[library_benchmark]
#[bench::w1(args = (0), setup = facade_setup)]
#[bench::w2(args = (1), setup = facade_setup)]
#[bench::w3(args = (2), setup = facade_setup)]
fn two_trips(input: (actix::SystemRunner, Engine)) -> (actix::SystemRunner, Engine) {
    let (sys, mut engine) = input;
    sys.block_on(async {
        for _ in 0..STEPS {
            engine.step().await;
        }
    });
    (sys, engine)
}

#[library_benchmark]
#[bench::w1(args = (0), setup = facade_one_trip_setup)]
#[bench::w2(args = (1), setup = facade_one_trip_setup)]
#[bench::w3(args = (2), setup = facade_one_trip_setup)]
fn one_trip(input: (actix::SystemRunner, Engine)) -> (actix::SystemRunner, Engine) {
    let (sys, mut engine) = input;
    sys.block_on(async {
        for _ in 0..STEPS {
            engine.step_one_trip().await;
        }
    });
    (sys, engine)
}

library_benchmark_group!(name = facade; benchmarks = two_trips, one_trip);

type ReplayInput = (Manifest, Settings, ReplayOptions, Trace);

/// The demo model, the default config and the bundled trace's first requests, read before the
/// count.
fn replay_setup() -> ReplayInput {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
    let read = |p: &str| {
        std::fs::read_to_string(format!("{root}/{p}")).unwrap_or_else(|e| panic!("{p}: {e}"))
    };
    let manifest: Manifest = toml::from_str(&read("config/models/demo.toml")).expect("demo model");
    let settings: Settings = toml::from_str(&read("config/default.toml")).expect("default config");
    let opts = ReplayOptions {
        requests: Some(REPLAY_REQUESTS),
        progress: false,
        ..ReplayOptions::default()
    };
    let trace = replay::load_trace(&opts, 42).expect("the bundled trace");
    (manifest, settings, opts, trace)
}

#[library_benchmark]
#[bench::bundled(setup = replay_setup)]
fn bundled(input: ReplayInput) -> ReplayInput {
    let (manifest, settings, opts, trace) = input;
    let sys = actix::System::new();
    let report = sys.block_on(async {
        let cm = mstar_chunking::ChunkingManagement::start(&manifest.name, manifest.submodules())
            .expect("actors");
        replay::run_trace(
            &cm,
            &manifest,
            &settings,
            &opts,
            &trace,
            std::time::Instant::now(),
        )
        .await
        .expect("the replay runs")
    });
    assert!(report.steps > 0);
    black_box(report);
    (manifest, settings, opts, trace)
}

library_benchmark_group!(name = replay_group; benchmarks = bundled);

/// The harness `gungraun::main!` generates, kept apart so that [`main`] can decide whether to
/// run it.
mod harness {
    use super::{facade, planner, replay_group};

    gungraun::main!(library_benchmark_groups = planner, facade, replay_group);

    pub(super) fn run() {
        main();
    }
}

/// Counts only under `cargo bench` (which passes `--bench`) and when `gungraun-runner` runs
/// this binary under Callgrind (`--gungraun-run`). `cargo test --benches` (and so `cargo test
/// --all-targets`) passes neither: the counts belong to `make bench-check`, with a release
/// build, valgrind and the runner, so there is nothing to do.
fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().is_some_and(|a| a == "--gungraun-run") || args.iter().any(|a| a == "--bench") {
        harness::run();
    } else {
        println!("instructions: counted by `make bench-check` (cargo bench), not in test mode");
    }
}
