//! The cost of one step, two measurements per workload in the same run:
//! - `planner/<W>`: the pure planner ([`plan`]) on the node's queues and the `StepParams` of a
//!   `BudgetSnapshot`, no actors, no state change (the queues are a steady state reached first);
//! - `planner_timed/<W>`: the same planner under a time budget that binds (the Llama-2-7B/A100
//!   preset, a time budget of half the step's token-budget time), so every chunk end goes
//!   through the latency model's solver (`docs/cost-model.md`); target ≤ 2 × `planner/<W>`;
//! - `actors/<W>`: one whole step through the facade `ChunkingManagement`: `assemble` (plan, then
//!   PreparedInputs cuts the chunk inputs), `complete` with the tokens each row ran (overrun
//!   check, release of finished inputs), then forgetting each finished prompt and admitting a
//!   fresh one: two round trips per step (and two per finished prompt), as before
//!   `complete_and_assemble`;
//! - `actors_one_trip/<W>`: the same step with one round trip, `complete_and_assemble` (the
//!   batch it answers is the next step's; the forgets and admissions ride along with it).
//!
//! A counting global allocator then reports allocations per step of each, written to
//! `<criterion dir>/step-allocs.json` for `scripts/bench_table.py`.
//!
//! The workloads and the engine are in `benches/common` (shared with `sim/benches/instructions.rs`).

use std::alloc::{GlobalAlloc, Layout, System as SystemAlloc};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use criterion::{black_box, Criterion};
use mstar_chunking::planner::StepPlan;

mod common;
use common::{plan_once, plan_timed_once, planner_state, time_limit, Engine, Workload, WORKLOADS};

/// Counts every allocation (and reallocation) of the process.
struct Counting;

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

// SAFETY: defers every call to the system allocator unchanged; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        SystemAlloc.alloc(layout)
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        SystemAlloc.alloc_zeroed(layout)
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        SystemAlloc.realloc(ptr, layout, new_size)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        SystemAlloc.dealloc(ptr, layout)
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn allocations() -> u64 {
    ALLOCATIONS.load(Ordering::Relaxed)
}

/// Steps the allocation count is averaged over.
const COUNTED_STEPS: u64 = 2_000;

/// Allocations per step of one workload, for the table.
struct Allocs {
    workload: &'static str,
    planner: f64,
    actors: f64,
    actors_one_trip: f64,
    /// Prompts finished (and admitted anew) per step, for reading the actors count.
    finished_per_step: f64,
}

/// Benchmarks `w`; counts its allocations per step when `count` (not in criterion's test mode,
/// where `cargo test --all-targets` runs each benchmark once as a smoke test).
fn bench_workload(c: &mut Criterion, w: Workload, count: bool) -> Option<Allocs> {
    let (state, params) = planner_state(w);
    let mut out = StepPlan::default();
    plan_once(&state, &params, &mut out);
    c.benchmark_group("planner").bench_function(w.name, |b| {
        b.iter(|| plan_once(black_box(&state), black_box(&params), &mut out))
    });
    let planner = count.then(|| {
        let before = allocations();
        for _ in 0..COUNTED_STEPS {
            plan_once(&state, &params, &mut out);
        }
        (allocations() - before) as f64 / COUNTED_STEPS as f64
    });
    let time = time_limit(w);
    plan_timed_once(&state, &params, time, &mut out);
    assert!(
        out.time.is_some() && out.predicted_ms(&time.model) <= time.max_step_ms,
        "the timed plan is planned under its time limit"
    );
    c.benchmark_group("planner_timed")
        .bench_function(w.name, |b| {
            b.iter(|| plan_timed_once(black_box(&state), black_box(&params), time, &mut out))
        });

    let sys = common::system();
    let mut engine = sys.block_on(Engine::start(w));
    c.benchmark_group("actors").bench_function(w.name, |b| {
        b.iter_custom(|iters| {
            sys.block_on(async {
                let started = Instant::now();
                for _ in 0..iters {
                    engine.step().await;
                }
                started.elapsed()
            })
        })
    });
    let mut one_trip = sys.block_on(Engine::start(w));
    c.benchmark_group("actors_one_trip")
        .bench_function(w.name, |b| {
            b.iter_custom(|iters| {
                sys.block_on(async {
                    let started = Instant::now();
                    for _ in 0..iters {
                        one_trip.step_one_trip().await;
                    }
                    started.elapsed()
                })
            })
        });
    let planner = planner?;
    let before = allocations();
    sys.block_on(async {
        for _ in 0..COUNTED_STEPS {
            one_trip.step_one_trip().await;
        }
    });
    let actors_one_trip = (allocations() - before) as f64 / COUNTED_STEPS as f64;
    let (steps, finished) = (engine.steps, engine.finished);
    let before = allocations();
    sys.block_on(async {
        for _ in 0..COUNTED_STEPS {
            engine.step().await;
        }
    });
    let actors = (allocations() - before) as f64 / COUNTED_STEPS as f64;
    let finished_per_step = (engine.finished - finished) as f64 / (engine.steps - steps) as f64;
    Some(Allocs {
        workload: w.name,
        planner,
        actors,
        actors_one_trip,
        finished_per_step,
    })
}

/// Where criterion writes its results: `CRITERION_HOME`, else `<target dir>/criterion`.
fn criterion_dir() -> PathBuf {
    if let Some(home) = std::env::var_os("CRITERION_HOME") {
        return PathBuf::from(home);
    }
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target"));
    target.join("criterion")
}

fn main() {
    let mut c = Criterion::default()
        .warm_up_time(Duration::from_secs(2))
        .measurement_time(Duration::from_secs(4))
        .configure_from_args();
    // Criterion benchmarks only under `--bench` without `--test` or `--list` (as `cargo bench`
    // runs it); otherwise it runs each benchmark once, and the counts are skipped too.
    let args: Vec<String> = std::env::args().collect();
    let has = |flag: &str| args.iter().any(|a| a == flag);
    let count = has("--bench") && !has("--test") && !has("--list");
    let allocs: Vec<Allocs> = WORKLOADS
        .iter()
        .filter_map(|w| bench_workload(&mut c, *w, count))
        .collect();
    c.final_summary();
    if !count {
        return;
    }

    let rows: Vec<serde_json::Value> = allocs
        .iter()
        .map(|a| {
            println!(
                "allocations per step {}: planner {:.2}, actors {:.2}, actors_one_trip {:.2} ({:.3} prompts finished and admitted per step)",
                a.workload, a.planner, a.actors, a.actors_one_trip, a.finished_per_step
            );
            serde_json::json!({
                "workload": a.workload,
                "planner": a.planner,
                "actors": a.actors,
                "actors_one_trip": a.actors_one_trip,
                "finished_per_step": a.finished_per_step,
            })
        })
        .collect();
    // Counted for every workload even in a filtered run: the counts do not depend on timing.
    let dir = criterion_dir();
    let path = dir.join("step-allocs.json");
    let written = std::fs::create_dir_all(&dir).and_then(|()| {
        std::fs::write(
            &path,
            serde_json::to_string_pretty(&rows).expect("plain JSON values"),
        )
    });
    if let Err(e) = written {
        eprintln!("cannot write {}: {e}", path.display());
        std::process::exit(1);
    }
}
