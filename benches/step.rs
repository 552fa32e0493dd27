//! The cost of one step (issue 7), two measurements per workload in the same run:
//! - `planner/<W>`: the pure planner ([`plan`]) on the node's queues and the `StepParams` of a
//!   `BudgetSnapshot`, no actors, no state change (the queues are a steady state reached first);
//! - `planner_timed/<W>`: the same planner under a time budget that binds (the Llama-2-7B/A100
//!   preset, a time budget of half the step's token-budget time), so every chunk end goes
//!   through the latency model's solver (`docs/cost-model.md`); target ≤ 2 × `planner/<W>`;
//! - `actors/<W>`: one whole step through the facade `ChunkingManagement`: `assemble` (plan, then
//!   PreparedInputs cuts the chunk inputs), `complete` with the tokens each row ran (overrun
//!   check, release of finished inputs), and re-admitting a fresh prompt for each finished one.
//!
//! A counting global allocator then reports allocations per step of each, written to
//! `<criterion dir>/step-allocs.json` for `scripts/bench_table.py`.
//!
//! The model: one node `llm` whose submodule cuts `prefill` rows inside the combined walk
//! `mixed` (`prefill` and `decode` are its members), budget `B` on `llm`/`mixed`, align 16.
//! Decode rows are persistent continuing rows, estimate 1.

use std::alloc::{GlobalAlloc, Layout, System as SystemAlloc};
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{black_box, Criterion};
use mstar_chunking::budget::BudgetTable;
use mstar_chunking::planner::{plan, plan_timed, StepParams, StepPlan, TimeLimit};
use mstar_chunking::policy::ModelPolicies;
use mstar_chunking::scheduler::SchedulerState;
use mstar_chunking::snapshot::BudgetSnapshot;
use mstar_chunking::{
    BudgetSettings, ChunkingManagement, ChunkingPolicy, Name, PreparedInput, SubmoduleCaps,
};

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

const NODE: &str = "llm";
const STEP_WALK: &str = "mixed";
const ALIGN: u32 = 16;
/// Steps run before measuring, so the prompts are spread over their progress.
const WARM_STEPS: u64 = 200;
/// Steps the allocation count is averaged over.
const COUNTED_STEPS: u64 = 2_000;

/// One steady-state workload of the issue.
#[derive(Clone, Copy)]
struct Workload {
    name: &'static str,
    decode_rows: u64,
    prompts: u64,
    prompt_tokens: u32,
    budget: u32,
}

const WORKLOADS: [Workload; 3] = [
    Workload {
        name: "W1",
        decode_rows: 256,
        prompts: 64,
        prompt_tokens: 2_048,
        budget: 2_048,
    },
    Workload {
        name: "W2",
        decode_rows: 1_024,
        prompts: 64,
        prompt_tokens: 8_192,
        budget: 8_192,
    },
    Workload {
        name: "W3",
        decode_rows: 32,
        prompts: 16,
        prompt_tokens: 512,
        budget: 512,
    },
];

/// Prompt rids start here, above every decode row's rid.
const FIRST_PROMPT_RID: u64 = 1 << 32;

fn n(s: &str) -> Name {
    Name::from(s)
}

fn submodules() -> BTreeMap<Name, SubmoduleCaps> {
    BTreeMap::from([(n(NODE), SubmoduleCaps::new(["prefill", STEP_WALK], false))])
}

fn policies(w: Workload) -> BTreeMap<(Name, Name), ChunkingPolicy> {
    BTreeMap::from([(
        (n(NODE), n(STEP_WALK)),
        ChunkingPolicy::budget(w.budget).aligned(ALIGN),
    )])
}

fn settings(model: &ModelPolicies) -> BudgetSettings {
    BudgetSettings {
        walks: [n("prefill"), n("decode"), n(STEP_WALK)].into(),
        combined_walk_of: BTreeMap::from([
            (n("prefill"), n(STEP_WALK)),
            (n("decode"), n(STEP_WALK)),
        ]),
        override_mixed: BTreeSet::new(),
        ..BudgetSettings::defaults_for(model)
    }
}

/// The workload's queues in a [`SchedulerState`], stepped to a steady state, and the step
/// parameters from its snapshot: what the pure planner runs on.
fn planner_state(w: Workload) -> (SchedulerState, Arc<StepParams>) {
    let model = ModelPolicies::new(submodules(), policies(w))
        .expect("the bench model is valid")
        .shared();
    let table = BudgetTable::build(model.clone(), settings(&model)).expect("valid settings");
    let snapshot = Arc::new(BudgetSnapshot::new(table, 1));
    let params = snapshot
        .step_params(NODE, STEP_WALK)
        .expect("llm/mixed is in the snapshot")
        .clone();
    let mut state = SchedulerState::default();
    state.set_snapshot(snapshot);
    for rid in 1..=w.decode_rows {
        state
            .continue_row(rid, NODE, "decode", 1, None)
            .expect("decode row");
    }
    let mut next_rid = FIRST_PROMPT_RID;
    for _ in 0..w.prompts {
        state
            .admit(next_rid, NODE, "prefill", w.prompt_tokens, 0)
            .expect("prompt");
        next_rid += 1;
    }
    let mut ran = Vec::new();
    for _ in 0..WARM_STEPS {
        let batch = state
            .assemble(NODE, STEP_WALK)
            .expect("assemble")
            .into_batch();
        ran.clear();
        ran.extend(batch.rows.iter().map(|r| r.tokens()));
        let outcome = state.complete(batch.step, &ran, None).expect("complete");
        for _ in &outcome.finished {
            state
                .admit(next_rid, NODE, "prefill", w.prompt_tokens, 0)
                .expect("prompt");
            next_rid += 1;
        }
    }
    (state, params)
}

fn plan_once(state: &SchedulerState, params: &StepParams, out: &mut StepPlan) {
    let q = state.node(NODE).expect("the node has queues");
    plan(params, q.cont(), q.prefill(), out);
}

/// The time limit of `planner_timed/<W>`: the A100 preset, and half the time a full token
/// budget of prefill takes under it, so that the time limit, not the token budget, ends chunks.
fn time_limit(w: Workload) -> TimeLimit {
    let model = mstar_chunking::latency_presets::preset_model("llama2-7b-a100").expect("preset");
    let full = model.base_ms() + model.per_token_ms() * f64::from(w.budget);
    TimeLimit {
        model,
        max_step_ms: full / 2.0,
    }
}

fn plan_timed_once(
    state: &SchedulerState,
    params: &StepParams,
    time: TimeLimit,
    out: &mut StepPlan,
) {
    let q = state.node(NODE).expect("the node has queues");
    plan_timed(params, Some(time), q.cont(), q.prefill(), out);
}

/// The engine's side of the actors benchmark: the facade, one shared prompt input (each
/// admitted prompt holds a clone of its `Arc`, as a real engine hands over its own buffer),
/// and the next fresh rid.
struct Engine {
    chunking: ChunkingManagement,
    prompt: PreparedInput,
    next_rid: u64,
    steps: u64,
    finished: u64,
}

impl Engine {
    async fn start(w: Workload) -> Self {
        let chunking = ChunkingManagement::start("bench", submodules()).unwrap();
        chunking
            .set_policies(policies(w))
            .await
            .expect("set_policies");
        let model = ModelPolicies::new(submodules(), policies(w)).expect("valid model");
        chunking
            .set_budgets(settings(&model))
            .await
            .expect("set_budgets");
        for rid in 1..=w.decode_rows {
            chunking
                .continue_row(rid, NODE, "decode", 1)
                .await
                .expect("decode row");
        }
        let prompt = PreparedInput::tokens((0..w.prompt_tokens).collect::<Vec<u32>>());
        let mut engine = Self {
            chunking,
            prompt,
            next_rid: FIRST_PROMPT_RID,
            steps: 0,
            finished: 0,
        };
        for _ in 0..w.prompts {
            engine.admit().await;
        }
        for _ in 0..WARM_STEPS {
            engine.step().await;
        }
        engine
    }

    async fn admit(&mut self) {
        self.chunking
            .admit(self.next_rid, NODE, "prefill", self.prompt.clone(), 0)
            .await
            .expect("admit");
        self.next_rid += 1;
    }

    /// One whole step, as an engine drives it: assemble, run (every row runs what it was
    /// scheduled), complete, and admit a new prompt for every one that finished.
    async fn step(&mut self) {
        let batch = self
            .chunking
            .assemble(NODE, STEP_WALK)
            .await
            .expect("assemble");
        let ran: Vec<u32> = batch.rows.iter().map(|r| r.tokens()).collect();
        let step = batch.step;
        drop(black_box(batch));
        let outcome = self.chunking.complete(step, ran).await.expect("complete");
        for _ in &outcome.finished {
            self.admit().await;
        }
        self.steps += 1;
        self.finished += outcome.finished.len() as u64;
    }
}

/// Allocations per step of one workload, for the table.
struct Allocs {
    workload: &'static str,
    planner: f64,
    actors: f64,
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

    let sys = actix::System::new();
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
    let planner = planner?;
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
                "allocations per step {}: planner {:.2}, actors {:.2} ({:.3} prompts finished and admitted per step)",
                a.workload, a.planner, a.actors, a.finished_per_step
            );
            serde_json::json!({
                "workload": a.workload,
                "planner": a.planner,
                "actors": a.actors,
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
