//! The step workloads W1–W3 shared by `benches/step.rs` (criterion, wall clock) and
//! `sim/benches/instructions.rs` (Callgrind instruction counts): their queues in a steady state,
//! the pure planner's inputs, and an engine driving one step through the facade, with two
//! round trips (`assemble`, `complete`) or one (`complete_and_assemble`).
//!
//! The model: one node `llm` whose submodule cuts `prefill` rows inside the combined walk
//! `mixed` (`prefill` and `decode` are its members), budget `B` on `llm`/`mixed`, align 16.
//! Decode rows are persistent continuing rows, estimate 1.

// Each bench target uses its own part of this module.
#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::hint::black_box;
use std::sync::Arc;

use mstar_chunking::actors::actor_system;
use mstar_chunking::budget::BudgetTable;
use mstar_chunking::planner::{plan, plan_timed, StepParams, StepPlan, TimeLimit};
use mstar_chunking::policy::ModelPolicies;
use mstar_chunking::policy::Name;
use mstar_chunking::scheduler::SchedulerState;
use mstar_chunking::{
    AdmitOptions, Batch, BudgetSettings, ChunkingManagement, ChunkingPolicy, NextStep,
    PreparedInput, RowWork, SubmoduleCaps,
};

pub const NODE: &str = "llm";
pub const STEP_WALK: &str = "mixed";
const ALIGN: u32 = 16;
/// Steps run before measuring, so the prompts are spread over their progress.
pub const WARM_STEPS: u64 = 200;

/// One steady-state workload of the step benchmarks.
#[derive(Clone, Copy, Debug)]
pub struct Workload {
    pub name: &'static str,
    pub decode_rows: u64,
    pub prompts: u64,
    pub prompt_tokens: u32,
    pub budget: u32,
}

pub const WORKLOADS: [Workload; 3] = [
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
pub fn planner_state(w: Workload) -> (SchedulerState, Arc<StepParams>) {
    let model = ModelPolicies::new(submodules(), policies(w))
        .expect("the bench model is valid")
        .shared();
    let table = BudgetTable::build(model.clone(), settings(&model)).expect("valid settings");
    let mut state = SchedulerState::with_table(table);
    let params = state
        .snapshot()
        .and_then(|s| s.step_params(NODE, STEP_WALK))
        .expect("llm/mixed is in the snapshot")
        .clone();
    for rid in 1..=w.decode_rows {
        state
            .queue_continuing(rid, NODE, "decode", 1, None)
            .expect("decode row");
    }
    let mut next_rid = FIRST_PROMPT_RID;
    for _ in 0..w.prompts {
        state
            .queue_prompt(
                next_rid,
                NODE,
                "prefill",
                w.prompt_tokens,
                AdmitOptions::cached(0),
            )
            .expect("prompt");
        next_rid += 1;
    }
    let mut ran = Vec::new();
    for _ in 0..WARM_STEPS {
        let batch = state.plan_batch(NODE, STEP_WALK, None).expect("assemble");
        ran.clear();
        ran.extend(batch.rows.iter().map(|r| r.tokens()));
        let outcome = state.close_step(batch.step, &ran, None).expect("complete");
        for &rid in &outcome.finished {
            // A finished prompt's request ends, as an engine's does (see `Engine`).
            state.drop_rows(rid);
            state
                .queue_prompt(
                    next_rid,
                    NODE,
                    "prefill",
                    w.prompt_tokens,
                    AdmitOptions::cached(0),
                )
                .expect("prompt");
            next_rid += 1;
        }
    }
    (state, params)
}

/// The token planner on the state's queues.
pub fn plan_once(state: &SchedulerState, params: &StepParams, out: &mut StepPlan) {
    let q = state.node(NODE).expect("the node has queues");
    plan(params, q.cont(), q.prefill(), out);
}

/// The time limit of the timed planner: the A100 preset, and half the time a full token
/// budget of prefill takes under it, so that the time limit, not the token budget, ends chunks.
pub fn time_limit(w: Workload) -> TimeLimit {
    let model = mstar_chunking::latency::presets::preset_model("llama2-7b-a100").expect("preset");
    let full = model.base_ms() + model.per_token_ms() * f64::from(w.budget);
    TimeLimit {
        model,
        max_step_ms: full / 2.0,
        clock: Default::default(),
    }
}

/// The timed planner on the state's queues.
pub fn plan_timed_once(
    state: &SchedulerState,
    params: &StepParams,
    time: TimeLimit,
    out: &mut StepPlan,
) {
    let q = state.node(NODE).expect("the node has queues");
    plan_timed(params, Some(time), q.cont(), q.prefill(), out);
}

/// The actix System the facade benchmarks run on: [`actor_system`], a current-thread runtime
/// without tokio's I/O driver, as an engine that awaits the actors on its own thread and
/// needs no I/O there should run (the engine's `block_on` waits once per round trip, and
/// with an I/O driver each wait is an `epoll_wait` system call).
pub fn system() -> actix::SystemRunner {
    actor_system().expect("the actors' System")
}

/// The engine's side of the facade benchmarks: the facade, one shared prompt input (each
/// admitted prompt holds a clone of its `Arc`, as a real engine hands over its own buffer),
/// and the next fresh rid. A prompt is a whole request (no decode follows it): once its final
/// chunk ran, the engine forgets the request, as a real engine forgets each finished request,
/// so the actors' per-request state stays steady over a long run.
pub struct Engine {
    pub chunking: ChunkingManagement,
    prompt: PreparedInput,
    next_rid: u64,
    pub steps: u64,
    pub finished: u64,
    /// The next step's batch, answered with the last completion (one round trip per step).
    pending: Option<Arc<Batch>>,
    /// The next step's node and walk, built once.
    next: NextStep,
    /// The prompts' walk, kept as a `Name` as an engine keeps its names.
    prefill: Name,
}

impl Engine {
    /// Starts the facade on the current actix System, queues the workload and runs
    /// [`WARM_STEPS`] steps.
    pub async fn start(w: Workload) -> Self {
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
            pending: None,
            next: NextStep::new(NODE, STEP_WALK),
            prefill: n("prefill"),
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

    /// One whole step with two round trips, as an engine drove it before
    /// `complete_and_assemble`: assemble, run (every row runs what it was scheduled),
    /// complete, and admit a new prompt for every one that finished.
    pub async fn step(&mut self) {
        // A batch answered by a one-trip step is the step in flight: `assemble` answers it.
        self.pending = None;
        let batch = self
            .chunking
            .assemble(NODE, STEP_WALK)
            .await
            .expect("assemble");
        let ran: Vec<u32> = batch.rows.iter().map(|r| r.tokens()).collect();
        let step = batch.step;
        drop(black_box(batch));
        let outcome = self
            .chunking
            .complete(step, ran, None)
            .await
            .expect("complete");
        for &rid in &outcome.finished {
            self.chunking.forget_request(rid).await.expect("forget");
            self.admit().await;
        }
        self.steps += 1;
        self.finished += outcome.finished.len() as u64;
    }

    /// One whole step with one round trip: run the batch answered by the last completion (or
    /// assemble one on the first step), then `complete_and_assemble` with a `NextStep`, which also admits a
    /// new prompt for every one that finished.
    pub async fn step_one_trip(&mut self) {
        let batch = match self.pending.take() {
            Some(b) => b,
            None => self
                .chunking
                .assemble(NODE, STEP_WALK)
                .await
                .expect("assemble"),
        };
        let ran: Vec<u32> = batch.rows.iter().map(|r| r.tokens()).collect();
        // A prompt whose final chunk runs now is forgotten and replaced by a new one, with
        // the completion (as the two-trip step forgets and admits after `complete`).
        let mut next = self.next.clone();
        for r in &batch.rows {
            if matches!(r.work, RowWork::Chunk { range, .. } if range.is_final()) {
                next = next.forget_request(r.rid).admit(
                    self.next_rid,
                    self.prefill.clone(),
                    self.prompt.clone(),
                    0,
                );
                self.next_rid += 1;
            }
        }
        let step = batch.step;
        drop(black_box(batch));
        let done = self
            .chunking
            .complete_and_assemble(step, ran, None, next)
            .await
            .expect("complete_and_assemble");
        self.steps += 1;
        self.finished += done.outcome.finished.len() as u64;
        self.pending = Some(done.next.expect("the next batch"));
    }
}
