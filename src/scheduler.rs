//! The scheduler's state without a runtime: row queues per node, the budget snapshot, the
//! step in flight per node, every queued prompt's prepared input, the last one-trip completion
//! and the drain. Assembles each step's batch (docs/scheduling.md) and applies its completion;
//! `serving` holds the engine's calls on the whole state, which the Scheduler actor makes.
//!
//! One step per node is in flight at a time: a node runs its steps one after another, and the
//! next step's plan depends on how far the previous one moved its rows.

use std::sync::Arc;

use rustc_hash::FxHashMap;

use crate::error::ChunkingError;
use crate::latency::fit::{OnlineFit, OnlineFitConfig};
use crate::latency::margin::TimeMargin;
use crate::latency::{select_model, LatencyModel, ModelSource, StepFeatures};
use crate::order::{AdmitOptions, StepClock};
use crate::overrun::{
    classify, classify_time_overrun, Overrun, StepTokens, TimeInactiveReason, TimeOverrunReason,
};
use crate::planner::{plan_ranked, plan_timed, RowWork, StepParams, StepPlan, TimeLimit};
use crate::policy::Name;
use crate::prepared::{ChunkInput, InputChange, NodeInputs, PreparedInput, PreparedStore};
use crate::queues::{Advance, NodeQueues};
use crate::range::ChunkRange;
use crate::snapshot::BudgetSnapshot;

pub(crate) mod serving;
pub use serving::{DrainReport, QueueStats};

/// One row of an assembled step.
#[derive(Debug, Clone, PartialEq)]
pub struct BatchRow {
    /// The request the row belongs to.
    pub rid: u64,
    /// The row's walk, as an index into [`Batch::walks`] (read it with [`Batch::walk_of`]): a
    /// plain number, so building and dropping a batch of a thousand rows touches no reference
    /// count, and no name is interned for the life of the process.
    pub walk: usize,
    /// What the row runs: a continuing row's estimate, or a chunk's range.
    pub work: RowWork,
    /// A continuing row's context, in tokens (the latency model's `K`); 0 for a chunk.
    pub context: u64,
    /// The chunk's input, cut from the prepared input (chunks only; filled by the Scheduler).
    pub input: Option<ChunkInput>,
}

/// What kind of work a [`BatchRow`] is ([`BatchRow::kind`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RowKind {
    /// A chunk of a prompt ([`RowWork::Chunk`]).
    Chunk,
    /// A continuing row: decode, or a speculative verification ([`RowWork::Continue`]).
    Continue,
}

impl RowKind {
    /// `"chunk"` or `"continue"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Chunk => "chunk",
            Self::Continue => "continue",
        }
    }
}

impl BatchRow {
    /// Tokens the row is scheduled to run.
    pub fn tokens(&self) -> u32 {
        self.work.tokens()
    }

    /// Whether the row is a chunk of a prompt or a continuing row.
    pub fn kind(&self) -> RowKind {
        match self.work {
            RowWork::Chunk { .. } => RowKind::Chunk,
            RowWork::Continue { .. } => RowKind::Continue,
        }
    }

    /// Whether the row is a chunk of a prompt.
    pub fn is_chunk(&self) -> bool {
        self.kind() == RowKind::Chunk
    }

    /// A chunk's range of its prompt; `None` for a continuing row.
    pub fn range(&self) -> Option<ChunkRange> {
        match self.work {
            RowWork::Chunk { range, .. } => Some(range),
            RowWork::Continue { .. } => None,
        }
    }

    /// Whether the row is its prompt's final chunk (the request starts generating after it);
    /// `false` for a continuing row.
    pub fn is_final(&self) -> bool {
        self.range().is_some_and(|r| r.is_final())
    }

    /// A first chunk's cached prefix in tokens (the engine reuses it, it is not run); 0 for a
    /// later chunk or a continuing row.
    pub fn cached(&self) -> u32 {
        match self.work {
            RowWork::Chunk { cached, .. } => cached,
            RowWork::Continue { .. } => 0,
        }
    }

    /// A continuing row's estimate in tokens; `None` for a chunk.
    pub fn estimate(&self) -> Option<u32> {
        self.work.continue_estimate()
    }
}

impl Batch {
    /// Cuts the input of every chunk row from `inputs`, the handles held on the batch's node;
    /// answers the rids of chunk rows with none held (their rows get no input).
    pub(crate) fn cut_inputs(&mut self, inputs: Option<&NodeInputs>) -> Vec<u64> {
        let mut missing = Vec::new();
        for row in &mut self.rows {
            let RowWork::Chunk { range, .. } = row.work else {
                continue;
            };
            match inputs.and_then(|m| m.get(row.rid)) {
                Some(whole) => {
                    row.input = Some(whole.cut(range.start as usize..range.end as usize));
                }
                None => missing.push(row.rid),
            }
        }
        missing
    }
}

/// The batch of one step, as handed to the engine.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    /// The step's number, unique per facade; `complete` and `abandon` name it.
    pub step: u64,
    /// The node the step runs.
    pub node: Name,
    /// The step walk (a combined walk takes its member walks' rows too).
    pub walk: Name,
    /// The walks the step's rows may belong to: the step walk, then its member walks.
    pub walks: Arc<[Name]>,
    /// `B`, the budget the step is scheduled under (`None`: no budget).
    pub budget: Option<u32>,
    /// `F`, the floor (`None` without a budget).
    pub floor: Option<u32>,
    /// Member walk caps under a combined walk on an `override_mixed` node.
    pub caps: Option<Arc<[(Name, u32)]>>,
    /// The rows, continuing rows first, then chunks in planning order.
    pub rows: Vec<BatchRow>,
    /// Sum of the rows' scheduled tokens.
    pub scheduled_tokens: u64,
    /// A row that cannot be cut runs whole over the budget: the step overruns by plan.
    pub uncut_over_budget: bool,
    /// Eligible rows that wait for a later step.
    pub waiting: u32,
    /// The step's time budget in ms, if it was planned under one.
    pub max_step_ms: Option<f64>,
    /// The step's predicted time in ms under the node's latency model, if it has one.
    pub predicted_ms: Option<f64>,
}

impl Batch {
    /// The walk of `row`, a row of this batch.
    pub fn walk_of(&self, row: &BatchRow) -> &Name {
        &self.walks[row.walk]
    }

    /// The step's tokens as the overrun check counts them: as the scheduler planned them, with
    /// what each row ran (`ran`: one entry per row, checked by the caller).
    pub(crate) fn step_tokens(&self, ran: &[u32]) -> StepTokens {
        StepTokens::of_step(
            self.budget,
            self.scheduled_tokens,
            self.uncut_over_budget,
            self.rows
                .iter()
                .map(|row| row.work.continue_estimate())
                .zip(ran.iter().copied()),
        )
    }
}

/// What the engine changes between two steps of a node, sent with the completion of the first
/// (`ChunkingManagement::complete_and_assemble`, [`Then::Next`]): the node and walk of the next step, and
/// row changes applied in order after the completion and before the next step is planned, so
/// the next batch sees them (a request that ended is not in it; a prompt that finished its
/// prefill runs its first decode in it; a prompt that arrived may run its first chunk in it).
/// Build it once and clone it per step: the names are shared, and a clone without changes
/// allocates nothing.
#[derive(Debug, Clone, PartialEq)]
pub struct NextStep {
    pub(crate) node: Name,
    pub(crate) walk: Name,
    pub(crate) changes: Vec<RowChange>,
    /// The step's time on the engine's clock, for the starvation bound (`at_ms`).
    pub(crate) now_ms: Option<f64>,
}

/// The step a one-trip completion assembles after it (`ChunkingManagement::complete_and_assemble`).
/// A [`NextStep`] converts into one (`Then::Next`).
///
/// ```
/// use mstar_chunking::{NextStep, Then};
///
/// let same = Then::Same; // the completed step's node and walk, no row changes
/// let simulated = Then::SameAt(1_250.0); // the same, planned at 1,250 ms on the engine's clock
/// let other: Then = NextStep::new("llm", "mixed").forget_request(7).into();
/// assert!(matches!(other, Then::Next(_)));
/// # let _ = (same, simulated);
/// ```
#[derive(Debug, Clone, PartialEq)]
pub enum Then {
    /// The completed step's node and walk, with no row changes: the engine's loop when nothing
    /// joined or left the batch.
    Same,
    /// As `Same`, the next step planned at this time in ms on the engine's clock (that of
    /// [`AdmitOptions::arrival_ms`]; `chunking.max_wait_ms` measures prompts' waits to it).
    SameAt(f64),
    /// The step this names, after its row changes (and at its time, [`NextStep::at_ms`]).
    Next(NextStep),
}

impl From<NextStep> for Then {
    fn from(next: NextStep) -> Self {
        Self::Next(next)
    }
}

/// One row change of a [`NextStep`].
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum RowChange {
    /// `forget_request(rid)`: the request's rows and inputs on every node.
    Forget(u64),
    /// `continue_row(rid, node, walk, estimate)`, or `continue_row_with_context` with
    /// `Some(context)`.
    Continue {
        rid: u64,
        walk: Name,
        estimate: u32,
        context: Option<u64>,
    },
    /// `admit(rid, node, walk, input, cached)`, or `admit_with` and its options.
    Admit {
        rid: u64,
        walk: Name,
        input: PreparedInput,
        options: AdmitOptions,
    },
}

impl NextStep {
    /// The next step is of `node`/`walk`, with no row changes.
    ///
    /// Every name here is taken as a [`Name`] or anything that converts into one (`&str`
    /// allocates a new one per call; an engine that keeps its names as `Name`s passes clones,
    /// which allocate nothing).
    pub fn new(node: impl Into<Name>, walk: impl Into<Name>) -> Self {
        Self {
            node: node.into(),
            walk: walk.into(),
            changes: Vec::new(),
            now_ms: None,
        }
    }

    /// Plans the next step at `now_ms` on the engine's clock (the clock of
    /// [`AdmitOptions::arrival_ms`]): the time `chunking.max_wait_ms` measures prompts' waits
    /// to.
    #[must_use]
    pub fn at_ms(mut self, now_ms: f64) -> Self {
        self.now_ms = Some(now_ms);
        self
    }

    /// The step's time given with [`at_ms`](Self::at_ms), if any.
    pub fn now_ms(&self) -> Option<f64> {
        self.now_ms
    }

    /// The node of the next step.
    pub fn node(&self) -> &Name {
        &self.node
    }

    /// The walk of the next step.
    pub fn walk(&self) -> &Name {
        &self.walk
    }

    /// Ends request `rid` before the next step, as `forget_request` does.
    #[must_use]
    pub fn forget_request(mut self, rid: u64) -> Self {
        self.changes.push(RowChange::Forget(rid));
        self
    }

    /// Queues a continuing row of `rid` on the next step's node before it is planned, as
    /// `continue_row(rid, node, walk, estimate)` does.
    #[must_use]
    pub fn continue_row(mut self, rid: u64, walk: impl Into<Name>, estimate: u32) -> Self {
        self.changes.push(RowChange::Continue {
            rid,
            walk: walk.into(),
            estimate,
            context: None,
        });
        self
    }

    /// As [`continue_row`](Self::continue_row), with the row's context in tokens (its prompt
    /// and what it generated so far), as
    /// `continue_row_with_context(rid, node, walk, estimate, context)` does: the time-budget
    /// planner predicts the row's KV and attention terms from it.
    #[must_use]
    pub fn continue_row_with_context(
        mut self,
        rid: u64,
        walk: impl Into<Name>,
        estimate: u32,
        context: u64,
    ) -> Self {
        self.changes.push(RowChange::Continue {
            rid,
            walk: walk.into(),
            estimate,
            context: Some(context),
        });
        self
    }

    /// Admits a prompt on the next step's node before it is planned, as
    /// `admit(rid, node, walk, input, cached)` does: its input is held before the next batch
    /// is cut.
    #[must_use]
    pub fn admit(self, rid: u64, walk: impl Into<Name>, input: PreparedInput, cached: u32) -> Self {
        self.admit_with(rid, walk, input, AdmitOptions::cached(cached))
    }

    /// As [`admit`](Self::admit), with the prompt's cached prefix, priority and arrival time,
    /// as `admit_with(rid, node, walk, input, options)` does.
    #[must_use]
    pub fn admit_with(
        mut self,
        rid: u64,
        walk: impl Into<Name>,
        input: PreparedInput,
        options: AdmitOptions,
    ) -> Self {
        self.changes.push(RowChange::Admit {
            rid,
            walk: walk.into(),
            input,
            options,
        });
        self
    }

    /// How many row changes it carries.
    pub fn changes(&self) -> usize {
        self.changes.len()
    }

    /// The row changes, in the order they are applied.
    pub fn row_changes(&self) -> impl Iterator<Item = RowChangeRef<'_>> {
        self.changes.iter().map(|c| match c {
            RowChange::Forget(rid) => RowChangeRef::Forget(*rid),
            RowChange::Continue {
                rid,
                walk,
                estimate,
                context,
            } => RowChangeRef::Continue {
                rid: *rid,
                walk,
                estimate: *estimate,
                context: *context,
            },
            RowChange::Admit {
                rid,
                walk,
                input,
                options,
            } => RowChangeRef::Admit {
                rid: *rid,
                walk,
                input,
                cached: options.cached,
                priority: options.priority,
                arrival_ms: options.arrival_ms,
            },
        })
    }
}

/// One row change of a [`NextStep`], as [`NextStep::row_changes`] reads it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RowChangeRef<'a> {
    /// The request ends (`forget_request`).
    Forget(u64),
    /// A continuing row is queued on the node (`continue_row`).
    Continue {
        /// The request.
        rid: u64,
        /// Its walk.
        walk: &'a str,
        /// Tokens it runs a step.
        estimate: u32,
        /// Its context in tokens, when the engine gave one (`continue_row_with_context`).
        context: Option<u64>,
    },
    /// A prompt is admitted on the node (`admit`).
    Admit {
        /// The request.
        rid: u64,
        /// Its walk.
        walk: &'a str,
        /// Its whole prepared input.
        input: &'a PreparedInput,
        /// Its cached prefix.
        cached: u32,
        /// Its priority (`admit_with`; 0 otherwise).
        priority: i32,
        /// Its arrival time in ms (`admit_with`), if given.
        arrival_ms: Option<f64>,
    },
}

/// The answer of a completion with the next step's assembly (one round trip per step).
#[derive(Debug, Clone, PartialEq)]
pub struct Completed {
    /// What completing the step did. A repeated call (its answer was lost) gets the same
    /// outcome again; the completion is applied once.
    pub outcome: StepOutcome,
    /// The next step's batch, or why there is none: a row change was refused (the changes
    /// before it stand), or the assembly failed. The completion stands either way; call
    /// `assemble` (or repeat the call) to get the next batch.
    pub next: Result<Arc<Batch>, ChunkingError>,
}

/// What completing a step did.
#[derive(Debug, Clone, PartialEq)]
pub struct StepOutcome {
    /// The completed step.
    pub step: u64,
    /// Its node.
    pub node: Name,
    /// Its step walk.
    pub walk: Name,
    /// What the step was scheduled to run and what it ran.
    pub tokens: StepTokens,
    /// The token overrun, if the step ran more than the budget it was scheduled under.
    pub overrun: Option<Overrun>,
    /// Rids whose final chunk completed: their prepared inputs on `node` are released.
    pub finished: Vec<u64>,
    /// Chunks that ran (a chunk reported with 0 tokens did not run and is not counted).
    pub chunks: u32,
    /// How many of the chunks that ran were final.
    pub final_chunks: u32,
    /// Chunks reported with 0 tokens: their rows are planned again from the same place.
    pub unrun_chunks: u32,
    /// The step time the engine measured, in ms, if it reported one.
    pub measured_ms: Option<f64>,
    /// The step's predicted time in ms, if the node had a latency model when it was planned.
    pub predicted_ms: Option<f64>,
    /// The time budget the step was scheduled under, in ms.
    pub max_step_ms: Option<f64>,
    /// The time margin the step was planned with, if the node plans with one: the plan's
    /// time limit was `max_step_ms / time_margin` (`docs/cost-model.md#the-time-margin`).
    pub time_margin: Option<f64>,
    /// The time overrun, if the measured time exceeded the time budget.
    pub time_overrun: Option<TimeOverrunReason>,
    /// Why the step's walk has a time budget that the step was not planned under (no model
    /// yet), if so (`docs/cost-model.md#when-a-time-budget-is-not-in-force`).
    pub time_inactive: Option<TimeInactiveReason>,
    /// The node's latency model after this step (its online fit may have moved), and its
    /// source.
    pub model: (Option<LatencyModel>, ModelSource),
}

/// What [`SchedulerState::assemble`] found for the node.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Assembled {
    /// A batch planned now, or a step in flight whose batch was not yet held: chunk rows carry
    /// no input yet; cut them, then [`SchedulerState::hold`] the batch.
    Planned(Batch),
    /// The node's step in flight, as handed out before: the same step, rows and input views.
    InFlight(Arc<Batch>),
}

impl Assembled {
    /// The batch, cloned out of its `Arc` when the step was already in flight.
    pub(crate) fn into_batch(self) -> Batch {
        match self {
            Self::Planned(b) => b,
            Self::InFlight(b) => Arc::unwrap_or_clone(b),
        }
    }
}

/// A step assembled and neither completed nor abandoned.
#[derive(Debug)]
struct InFlight {
    step: u64,
    params: Arc<StepParams>,
    plan: StepPlan,
    /// The model the step was predicted with, if any.
    model: Option<LatencyModel>,
    /// The time margin its time limit was divided by (1 without one).
    margin: f64,
    /// The batch as handed to the engine, once its inputs are cut: a repeated `assemble` of the
    /// node returns it again, so a dropped `assemble` future loses nothing.
    batch: Option<Arc<Batch>>,
}

impl InFlight {
    /// The batch of the step as planned, without inputs.
    fn planned_batch(&self) -> Batch {
        self.planned_batch_in(Vec::new())
    }

    /// [`InFlight::planned_batch`], its rows written into `rows` (emptied first): the room of
    /// an earlier batch's rows.
    fn planned_batch_in(&self, mut rows: Vec<BatchRow>) -> Batch {
        rows.clear();
        rows.extend(self.plan.rows.iter().map(|r| BatchRow {
            rid: r.rid,
            walk: r.walk,
            work: r.work,
            context: r.context,
            input: None,
        }));
        let params = &self.params;
        Batch {
            step: self.step,
            node: params.node.clone(),
            walk: params.walk.clone(),
            walks: params.eligible.clone(),
            budget: params.budget,
            floor: params.budget.map(|_| params.floor),
            caps: (params.budget.is_some() && !params.caps.is_empty()).then(|| params.caps.clone()),
            rows,
            scheduled_tokens: self.plan.scheduled_tokens,
            uncut_over_budget: self.plan.uncut_over_budget,
            waiting: self.plan.waiting,
            max_step_ms: self.plan.time.and(self.params.max_step_ms),
            predicted_ms: self.model.map(|m| self.plan.predicted_ms(&m)),
        }
    }
}

/// What [`SchedulerState::drain`] dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Drained {
    /// Steps in flight (with rows), abandoned.
    pub(crate) steps: usize,
    /// Requests with a row queued on some node.
    pub(crate) requests: usize,
    /// Rows queued, prefill and continuing, over all nodes.
    pub(crate) rows: usize,
}

/// How many completed steps keep what a late measured time needs ([`SchedulerState::take_late_measurement`]):
/// enough for an engine whose batches run a few steps behind their completion (async
/// scheduling, pipeline stages).
pub const LATE_STEPS: usize = 16;

/// What a completed step's measured time is read with, whether it comes with the completion
/// or later ([`SchedulerState::take_measurement`]).
#[derive(Debug, Clone, Copy)]
struct Timing {
    /// Whether the node's online fit learns from the step.
    learns: bool,
    /// The margin's quantile and the model the step was predicted with, if it plans with one.
    margin: Option<(f64, LatencyModel)>,
    /// The time budget the step was scheduled under.
    max_step_ms: Option<f64>,
    /// Why the plan already knew the step would run over its time budget, if it did.
    time_over: Option<TimeOverrunReason>,
}

impl Timing {
    /// Whether the fit or the margin reads the step's time (else only the overrun check does).
    fn reads_time(&self) -> bool {
        self.learns || self.margin.is_some()
    }
}

/// A step completed without a measured time, as a late measurement reads it.
#[derive(Debug, Clone)]
struct Unmeasured {
    step: u64,
    node: Name,
    walk: Name,
    /// What the step ran.
    features: StepFeatures,
    timing: Timing,
    predicted_ms: Option<f64>,
}

/// A step's time measured after its completion ([`SchedulerState::take_late_measurement`]): what the time
/// budget check found, with the node's latency model after the fit learned from it.
#[derive(Debug, Clone, PartialEq)]
pub struct LateMeasurement {
    /// The step.
    pub step: u64,
    /// Its node.
    pub node: Name,
    /// Its step walk.
    pub walk: Name,
    /// The time measured, in ms.
    pub measured_ms: f64,
    /// The step's predicted time in ms, if it was planned with a latency model.
    pub predicted_ms: Option<f64>,
    /// The time budget it was scheduled under, in ms.
    pub max_step_ms: Option<f64>,
    /// The time overrun, if the measured time exceeded the time budget.
    pub time_overrun: Option<TimeOverrunReason>,
    /// The node's time margin after this measurement, if it plans with one.
    pub time_margin: Option<f64>,
    /// The node's latency model after this measurement, and its source.
    pub model: (Option<LatencyModel>, ModelSource),
}

/// The latency model a node plans with ([`SchedulerState::latency_report`],
/// `ChunkingManagement::latency_model`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LatencyModelReport {
    /// The model in force: the trusted online fit, else the configured one; `None` when the
    /// node has neither (its time budgets cannot apply).
    pub model: Option<LatencyModel>,
    /// Where `model` came from.
    pub source: ModelSource,
    /// The configured model (`chunking.cost.<node>`, a preset or coefficients), if any.
    pub configured: Option<LatencyModel>,
    /// Whether the node learns its model from measured step times (`chunking.learn_cost`).
    pub learn_cost: bool,
    /// The online fit's current estimate (coefficients, samples, error, whether trusted);
    /// `None` before the first measured step or when the node does not learn.
    pub fit: Option<crate::latency::fit::OnlineEstimate>,
    /// Steps of the node, on walks with a time budget, planned without it
    /// ([`StepOutcome::time_inactive`]), since the start.
    pub time_inactive_steps: u64,
    /// Why the node's latest completed step on a walk with a time budget was planned without
    /// it; `None` when that step was planned under it (or there was none).
    pub time_inactive: Option<TimeInactiveReason>,
}

/// Row queues per node, the snapshot the next step is planned under, and the steps in flight.
#[derive(Debug, Default)]
pub struct SchedulerState {
    snapshot: Option<Arc<BudgetSnapshot>>,
    nodes: FxHashMap<Name, NodeQueues>,
    in_flight: FxHashMap<Name, InFlight>,
    /// Per node, the last batch handed out with no rows. It is not in flight (the node's next
    /// `assemble` plans afresh, so rows admitted meanwhile are picked up), but completing it
    /// with no rows or abandoning it is still accepted, once.
    empty: FxHashMap<Name, InFlight>,
    /// Per node, the online fit of its latency model (when `chunking.learn_cost` is on).
    fits: FxHashMap<Name, OnlineFit>,
    /// Per node, its recent measured ÷ predicted step times (when `chunking.time_margin` is
    /// set): timed steps are planned against their budget divided by the margin.
    margins: FxHashMap<Name, TimeMargin>,
    /// The latest steps completed without a measured time whose time the fit or the margin
    /// would read, oldest first (at most [`LATE_STEPS`]): an engine that learns a step's time
    /// after completing it (one step or more behind) reports it with
    /// [`SchedulerState::take_late_measurement`].
    unmeasured: std::collections::VecDeque<Unmeasured>,
    next_step: u64,
    /// Per node, the steps on walks with a time budget planned without it, and the reason of
    /// its latest such step (`None` once a timed step is planned under its budget again).
    time_inactive: FxHashMap<Name, (u64, Option<TimeInactiveReason>)>,
    /// A plan buffer handed back by the last completed step, reused to avoid reallocating.
    spare: StepPlan,
    /// The batch of the last step completed or abandoned: once the engine holds it no more,
    /// the next batch is written into its room (its `Arc` and its rows' vector), so a step
    /// allocates no batch ([`SchedulerState::share`]).
    spare_batch: Option<Arc<Batch>>,
    /// The whole prepared input of every queued prompt row: the one store of them, which each
    /// step's chunk views are cut from (PreparedInputs only counts them).
    pub(crate) inputs: PreparedStore,
    /// The changes made to `inputs` since the actor last sent them to PreparedInputs.
    input_changes: Vec<InputChange>,
    /// Per node, the last step completed by `complete_and_assemble`, to answer a repeat of it.
    completed: FxHashMap<Name, serving::LastCompleted>,
    /// Set by a drain, for good: no admission, no new step.
    draining: bool,
    /// Every `(node, waiting walk, assembled walk)` said once as stranded
    /// (`serving::StepHooks::stranded`).
    stranded_said: rustc_hash::FxHashSet<(Name, Name, Name)>,
    /// Per node, the walk whose last step came out empty while rows waited on walks it does
    /// not take (`serving::SchedulerState::assemble`): a second such step of the same
    /// walk in a row is refused.
    stranded_last: FxHashMap<Name, Name>,
}

impl SchedulerState {
    /// A state that plans every step under `table` (as its first snapshot): the plain state an
    /// engine-free test or benchmark drives directly.
    pub fn with_table(table: crate::budget::BudgetTable) -> Self {
        let mut state = Self::default();
        state.set_snapshot(Arc::new(BudgetSnapshot::new(table, 1)));
        state
    }

    /// Uses `snapshot` from the next assembled step on. Steps in flight keep their budgets.
    pub(crate) fn set_snapshot(&mut self, snapshot: Arc<BudgetSnapshot>) {
        self.snapshot = Some(snapshot);
    }

    /// The snapshot the next step is planned under.
    pub fn snapshot(&self) -> Option<&Arc<BudgetSnapshot>> {
        self.snapshot.as_ref()
    }

    fn resolve(&self, node: &str, walk: &str) -> Result<(Name, Name), ChunkingError> {
        let snap = self
            .snapshot
            .as_ref()
            .ok_or(ChunkingError::PoliciesNotSet)?;
        let n = snap
            .node_name(node)
            .ok_or_else(|| ChunkingError::UnknownNode { node: node.into() })?;
        let w = snap
            .walk_name(node, walk)
            .ok_or_else(|| ChunkingError::UnknownWalk {
                node: n.clone(),
                walk: walk.into(),
            })?;
        Ok((n.clone(), w.clone()))
    }

    fn queues(&mut self, node: &Name) -> &mut NodeQueues {
        self.nodes
            .entry(node.clone())
            .or_insert_with(|| NodeQueues::new(node.clone()))
    }

    /// Queues a prompt row of `total` tokens for `rid` at `node`, with what `options` says of
    /// it (its cached prefix, priority and arrival time): the row alone, no input is held (the
    /// serving layer's `SchedulerState::admit` also holds the prompt's prepared input). A
    /// priority given where the node's order is not `priority` is kept (a later setting may
    /// order by it) and warned about once per node: it does not change this node's order.
    ///
    /// # Errors
    /// Unknown node or walk, an empty prompt, or `(rid, node)` already queued.
    pub fn queue_prompt(
        &mut self,
        rid: u64,
        node: &str,
        walk: &str,
        total: u32,
        options: AdmitOptions,
    ) -> Result<(), ChunkingError> {
        let (node, walk) = self.resolve(node, walk)?;
        let order = self
            .snapshot
            .as_ref()
            .map(|s| s.table().order(&node).order)
            .unwrap_or_default();
        let queues = self.queues(&node);
        queues.admit_with(rid, walk, total, options)?;
        if queues.warn_priority(order, options.priority) {
            tracing::warn!(
                node = %node,
                rid,
                priority = options.priority,
                order = %order,
                "a priority was given to a node whose order is not `priority`: it does not change the order there (warned once per node)"
            );
        }
        Ok(())
    }

    /// Queues a continuing row of `rid` at `node` with an `estimate` of tokens a step and its
    /// `context`, if given (or updates them): the row alone (the serving layer's
    /// `SchedulerState::continue_row` also tells the hooks).
    ///
    /// # Errors
    /// Unknown node or walk, a zero estimate, or `rid` still prefilling there.
    pub fn queue_continuing(
        &mut self,
        rid: u64,
        node: &str,
        walk: &str,
        estimate: u32,
        context: Option<u64>,
    ) -> Result<(), ChunkingError> {
        let (node, walk) = self.resolve(node, walk)?;
        self.queues(&node)
            .continue_row(rid, walk, estimate, context)
    }

    /// The latency model `node` plans with now, and where it came from
    /// (`docs/fitting.md#sources`): its online fit once trusted (with learning on), else
    /// its configured model, else none.
    pub fn latency_model(&self, node: &str) -> (Option<LatencyModel>, ModelSource) {
        match self.snapshot.as_ref().map(|s| s.table()) {
            Some(table) => self.select(node, table.settings().time.learn, table.cost(node)),
            None => (None, ModelSource::None),
        }
    }

    /// The latency model `node` plans with and where it came from, with its online fit's
    /// state ([`LatencyModelReport`]).
    ///
    /// # Errors
    /// `node` is not a node of the model (or no snapshot was published yet).
    pub fn latency_report(&self, node: &str) -> Result<LatencyModelReport, ChunkingError> {
        let table = match self.snapshot.as_ref() {
            Some(s) if s.node_name(node).is_some() => s.table(),
            _ => return Err(ChunkingError::UnknownNode { node: node.into() }),
        };
        let learn_cost = table.settings().time.learn;
        let configured = table.cost(node);
        let (model, source) = self.select(node, learn_cost, configured);
        let (time_inactive_steps, time_inactive) =
            self.time_inactive.get(node).copied().unwrap_or_default();
        Ok(LatencyModelReport {
            model,
            source,
            configured,
            learn_cost,
            fit: self.fits.get(node).and_then(OnlineFit::estimate),
            time_inactive_steps,
            time_inactive,
        })
    }

    /// [`SchedulerState::latency_model`] for a step planned under `params`: no lookup of the
    /// configured model, and none of the fits unless the node learns (the step's hot path).
    fn model_for(&self, params: &StepParams) -> (Option<LatencyModel>, ModelSource) {
        self.select(&params.node, params.learn_cost, params.cost)
    }

    fn select(
        &self,
        node: &str,
        learn: bool,
        configured: Option<LatencyModel>,
    ) -> (Option<LatencyModel>, ModelSource) {
        let online = learn
            .then(|| self.fits.get(node).and_then(OnlineFit::trusted_model))
            .flatten();
        select_model(online, configured)
    }

    /// Drops every row of `rid` on every node (an aborted or finished request), its inputs
    /// left alone (the serving layer's `SchedulerState::forget_request` drops them too). Rows
    /// of `rid` in a step in flight run, but do not advance. Returns how many prefill rows
    /// were dropped.
    pub fn drop_rows(&mut self, rid: u64) -> usize {
        self.nodes
            .values_mut()
            .map(|q| q.forget(rid))
            .filter(|&dropped| dropped)
            .count()
    }

    /// Drops the rows of `rid` on `node` only, its input there left alone (the serving layer's
    /// [`SchedulerState::release`] releases it too); answers whether a prefill row was dropped.
    pub(crate) fn drop_row(&mut self, rid: u64, node: &str) -> bool {
        self.nodes.get_mut(node).is_some_and(|q| q.forget(rid))
    }

    /// `SchedulerState::plan_step`'s batch as a plain [`Batch`], its chunk rows without
    /// input: cutting inputs is the serving layer's part (`SchedulerState::assemble`). The
    /// plain state's step, which an engine-free test or benchmark drives.
    ///
    /// # Errors
    /// As `plan_step`.
    pub fn plan_batch(
        &mut self,
        node: &str,
        walk: &str,
        now_ms: Option<f64>,
    ) -> Result<Batch, ChunkingError> {
        self.plan_step(node, walk, now_ms)
            .map(Assembled::into_batch)
    }

    /// Plans the next step of `node`/`walk`, at `now_ms` on the engine's clock if given (for
    /// the starvation bound, `chunking.max_wait_ms`); while a step of `node`/`walk` is in
    /// flight, answers that step again, as it was (see `docs/step-lifecycle.md`). Its chunk
    /// rows carry no input yet.
    ///
    /// # Errors
    /// Unknown node or walk, no policies bound, or a step of `node` in flight under another
    /// walk.
    pub(crate) fn plan_step(
        &mut self,
        node: &str,
        walk: &str,
        now_ms: Option<f64>,
    ) -> Result<Assembled, ChunkingError> {
        let snap = self
            .snapshot
            .as_ref()
            .ok_or(ChunkingError::PoliciesNotSet)?;
        let params = snap
            .step_params(node, walk)
            .ok_or_else(|| match snap.node_name(node) {
                None => ChunkingError::UnknownNode { node: node.into() },
                Some(n) => ChunkingError::UnknownWalk {
                    node: n.clone(),
                    walk: walk.into(),
                },
            })?;
        if let Some(f) = self.in_flight.get(node) {
            if *f.params.walk != *walk {
                return Err(ChunkingError::StepInFlight {
                    node: f.params.node.clone(),
                    walk: f.params.walk.clone(),
                    step: f.step,
                });
            }
            return Ok(match &f.batch {
                Some(batch) => Assembled::InFlight(batch.clone()),
                None => Assembled::Planned(f.planned_batch()),
            });
        }
        // A member walk with no budget of its own on a node that budgets its combined walk:
        // planned alone its rows would run uncut, with no budget, outside the combined steps
        // that take them (docs/step-lifecycle.md#combined-walks). A member walk with its own
        // budget, or on a node the combined walk budgets nothing on, plans its own steps.
        let table = snap.table();
        let member_of = params
            .budget
            .is_none()
            .then(|| table.combined_walk_of(walk))
            .flatten()
            .filter(|combined| table.max_batch_tokens(node, combined).is_some());
        if let Some(combined) = member_of {
            return Err(ChunkingError::MemberWalk {
                node: params.node.clone(),
                walk: params.walk.clone(),
                combined: combined.clone(),
            });
        }
        let params = params.clone();
        let (model, _) = self.model_for(&params);
        let margin = self.time_margin(&params);
        let time = params
            .max_step_ms
            .zip(model)
            .map(|(max_step_ms, model)| TimeLimit {
                model,
                max_step_ms: max_step_ms / margin,
                clock: StepClock::default(),
            });
        let mut step_plan = std::mem::take(&mut self.spare);
        match self.nodes.get_mut(node) {
            Some(q) => {
                let time = time.map(|t| TimeLimit {
                    clock: q.clock(now_ms),
                    ..t
                });
                let view = q.view(params.order, now_ms);
                match view.rank {
                    None => plan_timed(&params, time, view.cont, view.prefill, &mut step_plan),
                    Some(rank) => {
                        plan_ranked(&params, time, view.cont, view.prefill, rank, &mut step_plan);
                    }
                }
                q.planned();
            }
            None => step_plan.clear(),
        }
        self.next_step += 1;
        let f = InFlight {
            step: self.next_step,
            params,
            plan: step_plan,
            model,
            margin,
            batch: None,
        };
        let batch = f.planned_batch_in(self.spare_rows());
        // An empty batch is not a step in flight: nothing waits on its completion, and holding
        // the node for it would hide rows admitted before the engine completes it.
        if f.plan.rows.is_empty() {
            self.empty.insert(f.params.node.clone(), f);
        } else {
            self.in_flight.insert(f.params.node.clone(), f);
        }
        Ok(Assembled::Planned(batch))
    }

    /// The rows' vector of the spare batch, when nobody else holds that batch (else a new one).
    fn spare_rows(&mut self) -> Vec<BatchRow> {
        self.spare_batch
            .as_mut()
            .and_then(Arc::get_mut)
            .map(|b| std::mem::take(&mut b.rows))
            .unwrap_or_default()
    }

    /// `batch` shared, in the `Arc` of the spare batch when nobody else holds that one.
    pub(crate) fn share(&mut self, batch: Batch) -> Arc<Batch> {
        if let Some(mut room) = self.spare_batch.take() {
            if let Some(slot) = Arc::get_mut(&mut room) {
                *slot = batch;
                return room;
            }
        }
        Arc::new(batch)
    }

    /// Keeps the batch of a step in flight as handed to the engine (its inputs cut), so that a
    /// repeated `assemble` returns it again. Ignored when the step is no longer in flight.
    pub(crate) fn hold(&mut self, batch: Arc<Batch>) {
        if let Some(f) = self.in_flight.get_mut(&*batch.node) {
            if f.step == batch.step && f.batch.is_none() {
                f.batch = Some(batch);
            }
        }
    }

    /// Drops everything for a shutdown: abandons every step in flight (and forgets each node's
    /// last empty one) and drops every row on every node; answers what was dropped. The
    /// inputs are left alone (the serving layer's [`SchedulerState::drain`] clears them), and
    /// the snapshot, the fits and the step numbering are kept.
    pub(crate) fn drop_all(&mut self) -> Drained {
        let steps = self.in_flight.len();
        self.in_flight.clear();
        self.empty.clear();
        let mut rids = rustc_hash::FxHashSet::default();
        let mut rows = 0;
        for queues in self.nodes.values_mut() {
            rows += queues.cont().len() + queues.prefill().len();
            rids.extend(queues.cont().iter().map(|r| r.rid));
            rids.extend(queues.prefill().iter().map(|r| r.rid));
            *queues = NodeQueues::new(queues.name().clone());
        }
        Drained {
            steps,
            requests: rids.len(),
            rows,
        }
    }

    /// The node of step `step`, if it is in flight or the node's last empty batch.
    pub fn node_of_step(&self, step: u64) -> Option<&Name> {
        [&self.in_flight, &self.empty]
            .into_iter()
            .flat_map(|steps| steps.iter())
            .find(|(_, f)| f.step == step)
            .map(|(n, _)| n)
    }

    /// The node of step `step`, and whether it is in flight (`true`) or the node's last empty
    /// batch (`false`).
    fn find_step(&self, step: u64) -> Result<(Name, bool), ChunkingError> {
        let find = |steps: &FxHashMap<Name, InFlight>| {
            steps
                .iter()
                .find(|(_, f)| f.step == step)
                .map(|(n, _)| n.clone())
        };
        find(&self.in_flight)
            .map(|n| (n, true))
            .or_else(|| find(&self.empty).map(|n| (n, false)))
            .ok_or(ChunkingError::UnknownStep { step })
    }

    /// Takes step `step` out of the steps in flight or the empty batches.
    fn take_step(&mut self, node: &Name, in_flight: bool) -> InFlight {
        let steps = if in_flight {
            &mut self.in_flight
        } else {
            &mut self.empty
        };
        steps.remove(node).expect("found by find_step")
    }

    /// Abandons a step in flight without advancing its rows, and drops the rows of `drop_rids`
    /// on its node (rows whose prepared input went missing). Nothing is released and no overrun
    /// is checked; the node can assemble again.
    ///
    /// # Errors
    /// The step is not in flight.
    pub fn abandon(&mut self, step: u64, drop_rids: &[u64]) -> Result<(), ChunkingError> {
        let (node, in_flight) = self.find_step(step)?;
        let f = self.take_step(&node, in_flight);
        for rid in drop_rids {
            self.drop_row(*rid, &node);
        }
        self.spare = f.plan;
        if let Some(batch) = f.batch {
            self.spare_batch = Some(batch);
        }
        Ok(())
    }

    /// Closes a step in flight with what it ran (the serving layer's
    /// `SchedulerState::complete` also releases the finished rows' inputs): `ran[i]` is the
    /// tokens row `i` of its batch actually ran,
    /// and `measured_ms` the step's measured time, if the engine has one. A chunk row ran
    /// either nothing (0: it is planned again from the same place) or its planned tokens (it
    /// advances); continuing rows report what they ran. Checks the tokens against the budget
    /// the step was scheduled under, and the measured time against its time budget; feeds the
    /// node's online fit; drops finished rows from the queue.
    ///
    /// # Errors
    /// The step is not in flight, `ran` does not have one entry per row, a chunk row reports
    /// neither 0 nor its planned tokens, or `measured_ms` is not a finite time ≥ 0; on error
    /// nothing changes and the step stays in flight.
    pub fn close_step(
        &mut self,
        step: u64,
        ran: &[u32],
        measured_ms: Option<f64>,
    ) -> Result<StepOutcome, ChunkingError> {
        let (node, in_flight) = self.find_step(step)?;
        let plan = if in_flight {
            &self.in_flight[&node].plan
        } else {
            &self.empty[&node].plan
        };
        check_ran(step, plan, ran)?;
        if let Some(ms) = measured_ms.filter(|&ms| crate::latency::measured_ms(ms).is_none()) {
            return Err(ChunkingError::BadMeasurement { step, ms });
        }
        let f = self.take_step(&node, in_flight);
        // The continuing rows come first (`StepPlan::continuing`): they are counted in one sum
        // and only the chunks are visited one by one.
        let (cont_rows, chunk_rows) = f.plan.rows.split_at(f.plan.continuing);
        let (cont_ran, chunk_ran) = ran.split_at(f.plan.continuing);
        let mut tokens = StepTokens::planned(
            f.params.budget,
            f.plan.scheduled_tokens,
            f.plan.uncut_over_budget,
        );
        tokens.add_continuing(
            f.plan.continue_estimate,
            cont_ran.iter().map(|&r| u64::from(r)).sum(),
        );
        let finals = chunk_rows
            .iter()
            .filter(|row| matches!(row.work, RowWork::Chunk { range, .. } if range.is_final()))
            .count();
        let mut finished = Vec::with_capacity(finals);
        let (mut chunks, mut final_chunks, mut unrun_chunks) = (0, 0, 0);
        let mut queues = self.nodes.get_mut(&node);
        for (row, &r) in chunk_rows.iter().zip(chunk_ran) {
            tokens.add_row(None, r);
            match row.work {
                RowWork::Continue { .. } => continue,
                RowWork::Chunk { .. } if r == 0 => {
                    unrun_chunks += 1;
                    continue;
                }
                RowWork::Chunk { range, .. } => {
                    chunks += 1;
                    final_chunks += u32::from(range.is_final());
                }
            }
            let Some(q) = queues.as_deref_mut() else {
                continue;
            };
            if q.advance(row) == Advance::Finished {
                finished.push(row.rid);
            }
        }
        // Contexts are what the latency model's KV term reads: kept growing while the node
        // learns its model or plans with one that has a KV term, and left alone otherwise,
        // which saves a pass over every continuing row per step (docs/cost-model.md#the-model).
        let reads_contexts =
            f.params.learn_cost || f.params.cost.is_some_and(|m| m.per_kv_token_ms() > 0.0);
        if let Some(q) = queues.filter(|_| reads_contexts) {
            q.grow_contexts(cont_rows, cont_ran);
        }
        let overrun = classify(&tokens).map(|(budget, reason)| Overrun {
            node: f.params.node.clone(),
            walk: f.params.walk.clone(),
            budget,
            tokens: tokens.ran,
            reason,
        });
        let time_inactive = self.time_in_force(&node, &f);
        let timing = Timing {
            learns: f.params.learn_cost,
            margin: f
                .params
                .margin_quantile
                .zip(f.plan.time)
                .map(|(q, time)| (q, time.model)),
            // The step's own time budget: the plan's limit is divided by the time margin.
            max_step_ms: f.plan.time.and(f.params.max_step_ms),
            time_over: f.plan.time_over,
        };
        let predicted_ms = f.model.map(|m| f.plan.predicted_ms(&m));
        // What the step ran (a chunk reported at 0 did not run): the online fit learns from it,
        // and the time margin compares it with its prediction.
        let features = || ran_features(&f.plan, ran);
        let time_overrun = match measured_ms {
            Some(ms) => self.take_measurement(&node, ms, &timing, features),
            None => {
                if timing.reads_time() {
                    if self.unmeasured.len() == LATE_STEPS {
                        self.unmeasured.pop_front();
                    }
                    self.unmeasured.push_back(Unmeasured {
                        step,
                        node: node.clone(),
                        walk: f.params.walk.clone(),
                        features: features(),
                        timing,
                        predicted_ms,
                    });
                }
                None
            }
        };
        let max_step_ms = timing.max_step_ms;
        let time_margin = timing.margin.map(|_| f.margin);
        self.spare = f.plan;
        if let Some(batch) = f.batch {
            self.spare_batch = Some(batch);
        }
        Ok(StepOutcome {
            step,
            node: f.params.node.clone(),
            walk: f.params.walk.clone(),
            tokens,
            overrun,
            finished,
            chunks,
            final_chunks,
            unrun_chunks,
            measured_ms,
            predicted_ms,
            max_step_ms,
            time_margin,
            time_overrun,
            time_inactive,
            model: self.model_for(&f.params),
        })
    }

    /// Whether a completed step (with rows) on a walk with a time budget was planned under
    /// it, counted per node; answers why not. Read before the step's time feeds the fit.
    fn time_in_force(&mut self, node: &Name, f: &InFlight) -> Option<TimeInactiveReason> {
        if f.params.max_step_ms.is_none() || f.plan.rows.is_empty() {
            return None;
        }
        if f.plan.time.is_some() {
            // In force: the node's latest step has no reason any more (its count stays).
            if !self.time_inactive.is_empty() {
                if let Some(seen) = self.time_inactive.get_mut(node) {
                    seen.1 = None;
                }
            }
            return None;
        }
        let why = match self.fits.get(node).map_or(0, OnlineFit::samples) {
            0 => TimeInactiveReason::NoMeasurements,
            _ => TimeInactiveReason::UntrustedFit,
        };
        let seen = self.time_inactive.entry(node.clone()).or_default();
        seen.0 += 1;
        seen.1 = Some(why);
        Some(why)
    }

    /// Reports the measured time of step `step`, completed before its time was known (async
    /// scheduling completes step N when it schedules N+1): the time budget check, the online
    /// fit and the time margin read it as a completion's measured time would have been read.
    /// Only the latest [`LATE_STEPS`] steps completed without a time, on nodes that learn
    /// their model or plan with a margin, are kept; each takes one measurement.
    ///
    /// # Errors
    /// `BadMeasurement` when `ms` is not a finite time ≥ 0; `UnknownStep` when the step is not
    /// one of those (never completed, completed with a time, measured already, or too old).
    pub fn take_late_measurement(
        &mut self,
        step: u64,
        ms: f64,
    ) -> Result<LateMeasurement, ChunkingError> {
        if crate::latency::measured_ms(ms).is_none() {
            return Err(ChunkingError::BadMeasurement { step, ms });
        }
        let at = self
            .unmeasured
            .iter()
            .position(|u| u.step == step)
            .ok_or(ChunkingError::UnknownStep { step })?;
        let Some(u) = self.unmeasured.remove(at) else {
            return Err(ChunkingError::UnknownStep { step });
        };
        let time_overrun = self.take_measurement(&u.node, ms, &u.timing, || u.features);
        Ok(LateMeasurement {
            step,
            time_margin: u.timing.margin.map(|_| self.margin(&u.node).unwrap_or(1.0)),
            model: self.latency_model(&u.node),
            node: u.node,
            walk: u.walk,
            measured_ms: ms,
            predicted_ms: u.predicted_ms,
            max_step_ms: u.timing.max_step_ms,
            time_overrun,
        })
    }

    /// A step's measured time `ms`, taken in whether it came with the completion or later
    /// ([`SchedulerState::take_late_measurement`]): when the fit or the margin reads it, the
    /// node's online fit learns from what the step ran (`features`, computed only then) and the
    /// time margin at its quantile compares `ms` with the step's prediction. Answers the time
    /// overrun, if `ms` exceeds the step's time budget.
    fn take_measurement(
        &mut self,
        node: &Name,
        ms: f64,
        timing: &Timing,
        features: impl FnOnce() -> StepFeatures,
    ) -> Option<TimeOverrunReason> {
        if timing.reads_time() {
            let features = features();
            if timing.learns {
                self.observe(node, &features, ms);
            }
            if let Some((q, model)) = timing.margin {
                let predicted = model.predict_ms(&features);
                self.margins
                    .entry(node.clone())
                    .or_default()
                    .observe(ms, predicted, q);
            }
        }
        timing
            .max_step_ms
            .and_then(|max| classify_time_overrun(ms, max, timing.time_over))
    }

    /// The time margin steps planned under `params` divide their time budget by
    /// (`docs/cost-model.md#the-time-margin`): 1 without a margin quantile.
    fn time_margin(&self, params: &StepParams) -> f64 {
        match params.margin_quantile {
            Some(_) => self
                .margins
                .get(&params.node)
                .map_or(1.0, TimeMargin::margin),
            None => 1.0,
        }
    }

    /// The time margin of `node` now, if it plans with one and has seen a timed step.
    pub fn margin(&self, node: &str) -> Option<f64> {
        self.margins.get(node).map(TimeMargin::margin)
    }

    /// Feeds a measured step to `node`'s online fit.
    fn observe(&mut self, node: &Name, features: &StepFeatures, ms: f64) {
        let fit = self.fits.entry(node.clone()).or_insert_with(|| {
            OnlineFit::try_new(OnlineFitConfig::default()).expect("the default config is valid")
        });
        // A measurement the fit refuses (checked finite above) changes nothing.
        let _ = fit.observe(features, ms);
    }

    /// The queues of `node`, for inspection.
    pub fn node(&self, node: &str) -> Option<&NodeQueues> {
        self.nodes.get(node)
    }

    /// The nodes that have had rows queued.
    pub fn node_names(&self) -> impl Iterator<Item = &Name> {
        self.nodes.keys()
    }

    /// Prefill rows queued over all nodes (each holds a prepared input).
    pub fn prefill_rows(&self) -> usize {
        self.nodes.values().map(NodeQueues::prefill_rows).sum()
    }

    /// Steps in flight.
    pub fn steps_in_flight(&self) -> usize {
        self.in_flight.len()
    }
}

/// What a completed step's time depends on, as it ran: continuing rows at what they ran, chunks
/// that ran (a chunk reported at 0 did not).
fn ran_features(plan: &StepPlan, ran: &[u32]) -> StepFeatures {
    let mut features = StepFeatures::EMPTY;
    for (row, &r) in plan.rows.iter().zip(ran) {
        match row.work {
            // A continuing row reported at 0 did not run: neither its tokens nor the context it
            // would have read count (an engine that hands a decode row back, as vLLM does when it
            // cannot allocate).
            RowWork::Continue { .. } if r != 0 => features.add_continuing(r, row.context),
            RowWork::Continue { .. } => {}
            RowWork::Chunk { range, .. } if r != 0 => features.add_chunk(range.start, range.end),
            RowWork::Chunk { .. } => {}
        }
    }
    features
}

/// Whether `ran` is a valid report of `plan`: one entry per row, and every chunk row at 0 or at
/// its planned tokens (a chunk that ran part of its tokens cannot be resumed from its end).
fn check_ran(step: u64, plan: &StepPlan, ran: &[u32]) -> Result<(), ChunkingError> {
    if ran.len() != plan.rows.len() {
        return Err(ChunkingError::RanLengthMismatch {
            step,
            expected: plan.rows.len(),
            got: ran.len(),
        });
    }
    // Only chunks are checked: a continuing row may run any count (overrun accounting).
    let chunks = plan.rows[plan.continuing..].iter();
    let partial = chunks.zip(&ran[plan.continuing..]).find(
        |(row, &r)| matches!(row.work, RowWork::Chunk { range, .. } if r != 0 && r != range.tokens()),
    );
    match partial {
        Some((row, &r)) => Err(ChunkingError::PartialChunk {
            step,
            rid: row.rid,
            planned: row.work.tokens(),
            ran: r,
        }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::budget::BudgetTable;
    use crate::latency::ModelSource;
    use crate::policy::{ChunkingPolicy, ModelPolicies, SubmoduleCaps};

    #[test]
    fn only_rows_that_ran_count_in_the_features_learned_from() {
        let row = |rid: u64, work: RowWork, context: u64| crate::planner::PlannedRow {
            seq: rid,
            rid,
            walk: 0,
            work,
            context,
        };
        let plan = StepPlan {
            rows: vec![
                row(1, RowWork::Continue { estimate: 1 }, 900),
                row(2, RowWork::Continue { estimate: 1 }, 4_000),
                row(
                    3,
                    RowWork::Chunk {
                        range: ChunkRange::new(true, 0, 64, 128),
                        cached: 0,
                    },
                    0,
                ),
                row(
                    4,
                    RowWork::Chunk {
                        range: ChunkRange::new(true, 0, 32, 32),
                        cached: 0,
                    },
                    0,
                ),
            ],
            continuing: 2,
            ..StepPlan::default()
        };
        let all = ran_features(&plan, &[1, 1, 64, 32]);
        assert_eq!((all.tokens, all.kv_tokens), (98, 4_900));
        // The second decode row and the second chunk were handed back: nothing of theirs counts.
        let some = ran_features(&plan, &[1, 0, 64, 0]);
        assert_eq!((some.tokens, some.kv_tokens), (65, 900));
        assert_eq!(
            some.attention_pairs,
            StepFeatures::EMPTY.with_chunk(0, 64).attention_pairs
        );
        assert_eq!(ran_features(&plan, &[0, 0, 0, 0]), StepFeatures::EMPTY);
    }

    #[test]
    fn a_next_step_reads_back_its_node_walk_and_changes_in_order() {
        let input = PreparedInput::tokens(vec![1, 2, 3]);
        let next = NextStep::new("llm", "mixed")
            .forget_request(7)
            .continue_row(8, "decode", 2)
            .continue_row_with_context(10, "decode", 3, 4_000)
            .admit(9, Name::from("prefill"), input.clone(), 1);
        assert_eq!((&**next.node(), &**next.walk()), ("llm", "mixed"));
        assert_eq!(next.changes(), 4);
        let changes: Vec<RowChangeRef<'_>> = next.row_changes().collect();
        assert_eq!(
            changes,
            [
                RowChangeRef::Forget(7),
                RowChangeRef::Continue {
                    rid: 8,
                    walk: "decode",
                    estimate: 2,
                    context: None,
                },
                RowChangeRef::Continue {
                    rid: 10,
                    walk: "decode",
                    estimate: 3,
                    context: Some(4_000),
                },
                RowChangeRef::Admit {
                    rid: 9,
                    walk: "prefill",
                    input: &input,
                    cached: 1,
                    priority: 0,
                    arrival_ms: None,
                },
            ]
        );
        assert_eq!(NextStep::new("llm", "mixed").changes(), 0);
    }

    fn state() -> SchedulerState {
        let subs = BTreeMap::from([(Name::from("llm"), SubmoduleCaps::new(["prefill"], false))]);
        let pols = BTreeMap::from([(
            (Name::from("llm"), Name::from("prefill")),
            ChunkingPolicy::budget(100),
        )]);
        let model = ModelPolicies::new(subs, pols).unwrap().shared();
        let mut s = SchedulerState::default();
        s.set_snapshot(Arc::new(BudgetSnapshot::new(
            BudgetTable::from_policies(model),
            1,
        )));
        s
    }

    /// A state whose `llm` node learns its latency model (so contexts are tracked), serving
    /// `prefill` and `decode`.
    fn learning_state() -> SchedulerState {
        let subs = BTreeMap::from([(Name::from("llm"), SubmoduleCaps::new(["prefill"], false))]);
        let pols = BTreeMap::from([(
            (Name::from("llm"), Name::from("prefill")),
            ChunkingPolicy::budget(100),
        )]);
        let model = ModelPolicies::new(subs, pols).unwrap().shared();
        let settings = crate::budget::BudgetSettings::new(["prefill", "decode"]).learn_cost(true);
        let table = BudgetTable::from_policies(model)
            .with_settings(settings)
            .unwrap();
        let mut s = SchedulerState::default();
        s.set_snapshot(Arc::new(BudgetSnapshot::new(table, 1)));
        s
    }

    #[test]
    fn a_batch_counts_its_tokens_as_the_completion_does() {
        let mut s = learning_state();
        s.queue_prompt(1, "llm", "prefill", 60, AdmitOptions::cached(0))
            .unwrap();
        s.queue_prompt(3, "llm", "prefill", 20, AdmitOptions::cached(0))
            .unwrap();
        let b = s.plan_batch("llm", "prefill", None).unwrap();
        // The first chunk ran, the second did not run at all (0).
        let ran: Vec<u32> = vec![b.rows[0].tokens(), 0];
        assert_eq!(b.rows.len(), 2);
        let counted = b.step_tokens(&ran);
        assert_eq!(counted.ran, ran.iter().map(|&r| u64::from(r)).sum::<u64>());
        assert_eq!(counted.scheduled, b.scheduled_tokens);
        assert_eq!(s.close_step(b.step, &ran, None).unwrap().tokens, counted);
    }

    #[test]
    fn drain_abandons_the_steps_and_drops_every_row() {
        let mut s = learning_state();
        s.queue_prompt(1, "llm", "prefill", 150, AdmitOptions::cached(0))
            .unwrap();
        s.queue_prompt(2, "llm", "prefill", 30, AdmitOptions::cached(0))
            .unwrap();
        s.queue_continuing(3, "llm", "decode", 1, None).unwrap();
        let b = s.plan_batch("llm", "prefill", None).unwrap();
        let empty = s.plan_batch("llm", "decode", None);
        assert!(
            matches!(empty, Err(ChunkingError::StepInFlight { .. })),
            "{empty:?}"
        );
        assert_eq!(s.steps_in_flight(), 1);
        assert_eq!(
            s.drop_all(),
            Drained {
                steps: 1,
                requests: 3,
                rows: 3
            }
        );
        assert_eq!((s.steps_in_flight(), s.prefill_rows()), (0, 0));
        assert_eq!(s.node("llm").unwrap().counts(), Default::default());
        assert!(matches!(
            s.close_step(b.step, &[100], None),
            Err(ChunkingError::UnknownStep { .. })
        ));
        // A node's last empty step is forgotten too; step numbers go on after a drain.
        let empty = s.plan_batch("llm", "prefill", None).unwrap();
        assert!(empty.rows.is_empty() && empty.step > b.step);
        assert_eq!(s.drop_all(), Drained::default());
        assert!(matches!(
            s.close_step(empty.step, &[], None),
            Err(ChunkingError::UnknownStep { .. })
        ));
    }

    fn contexts(s: &SchedulerState) -> Vec<(u64, u64)> {
        s.node("llm")
            .unwrap()
            .cont()
            .iter()
            .map(|c| (c.rid, c.context))
            .collect()
    }

    #[test]
    fn a_continuing_row_reads_its_prompt_and_what_it_ran() {
        let mut s = learning_state();
        s.queue_prompt(1, "llm", "prefill", 80, AdmitOptions::cached(0))
            .unwrap();
        let b = s.plan_step("llm", "prefill", None).unwrap().into_batch();
        s.close_step(b.step, &[80], Some(10.0)).unwrap();
        s.queue_continuing(1, "llm", "decode", 1, None).unwrap();
        s.queue_continuing(2, "llm", "decode", 4, Some(1000))
            .unwrap();
        assert_eq!(contexts(&s), vec![(1, 80), (2, 1000)]);
        let b = s.plan_step("llm", "decode", None).unwrap().into_batch();
        assert_eq!(
            b.rows.iter().map(|r| r.context).collect::<Vec<_>>(),
            vec![80, 1000]
        );
        // Row 2 speculated and ran 3 of its 4.
        s.close_step(b.step, &[1, 3], Some(10.0)).unwrap();
        assert_eq!(contexts(&s), vec![(1, 81), (2, 1003)]);
        // A failed step (abandoned) grows nothing.
        let b = s.plan_step("llm", "decode", None).unwrap().into_batch();
        s.abandon(b.step, &[]).unwrap();
        assert_eq!(contexts(&s), vec![(1, 81), (2, 1003)]);
    }

    #[test]
    fn an_abandoned_step_advances_nothing_and_drops_the_named_rows() {
        let mut s = state();
        s.queue_prompt(1, "llm", "prefill", 150, AdmitOptions::cached(0))
            .unwrap();
        s.queue_prompt(2, "llm", "prefill", 30, AdmitOptions::cached(0))
            .unwrap();
        let b = s.plan_step("llm", "prefill", None).unwrap().into_batch();
        assert_eq!(b.rows.len(), 1, "row 1 takes the whole budget");
        s.abandon(b.step, &[2]).unwrap();
        assert_eq!(s.steps_in_flight(), 0);
        assert_eq!(s.prefill_rows(), 1, "row 2 dropped");
        let b = s.plan_step("llm", "prefill", None).unwrap().into_batch();
        let RowWork::Chunk { range, .. } = b.rows[0].work else {
            panic!("a chunk")
        };
        assert_eq!(
            (range.start, range.end),
            (0, 100),
            "row 1 starts over from where it was"
        );
        assert!(matches!(
            s.abandon(999, &[]),
            Err(ChunkingError::UnknownStep { step: 999 })
        ));
    }

    #[test]
    fn a_step_with_no_rows_can_be_completed() {
        let mut s = state();
        let b = s.plan_step("llm", "prefill", None).unwrap().into_batch();
        assert!(b.rows.is_empty());
        let out = s.close_step(b.step, &[], None).unwrap();
        assert_eq!((out.chunks, out.overrun), (0, None));
    }

    /// A state over `llm` (cuts `prefill`, budget 100) serving `prefill` and `decode`, under
    /// `settings` applied to the walks.
    fn state_with(
        settings: impl FnOnce(crate::budget::BudgetSettings) -> crate::budget::BudgetSettings,
    ) -> SchedulerState {
        let subs = BTreeMap::from([(Name::from("llm"), SubmoduleCaps::new(["prefill"], false))]);
        let pols = BTreeMap::from([(
            (Name::from("llm"), Name::from("prefill")),
            ChunkingPolicy::budget(100),
        )]);
        let model = ModelPolicies::new(subs, pols).unwrap().shared();
        let settings = settings(crate::budget::BudgetSettings::new(["prefill", "decode"]));
        let table = BudgetTable::from_policies(model)
            .with_settings(settings)
            .unwrap();
        let mut s = SchedulerState::default();
        s.set_snapshot(Arc::new(BudgetSnapshot::new(table, 1)));
        s
    }

    fn chunk(row: &BatchRow) -> (u32, u32) {
        let RowWork::Chunk { range, .. } = row.work else {
            panic!("a chunk: {row:?}")
        };
        (range.start, range.end)
    }

    #[test]
    fn a_yielding_floor_waits_its_bound_from_admission_then_from_each_chunk_it_ran() {
        // 1 ms a step and a token: five continuing rows take 6 ms of a 10 ms budget, and a
        // 64-token floor chunk never fits beside them.
        let model = LatencyModel::try_new(1.0, 1.0, 0.0, 0.0).unwrap();
        let mut s = state_with(|b| {
            b.cost("llm", model)
                .max_step_ms("llm", 10.0)
                .max_wait_steps(std::num::NonZeroU32::new(3).unwrap())
        });
        for rid in 1..=5 {
            s.queue_continuing(rid, "llm", "prefill", 1, Some(10))
                .unwrap();
        }
        s.queue_prompt(9, "llm", "prefill", 1000, AdmitOptions::cached(0))
            .unwrap();
        let mut shapes = Vec::new();
        for _ in 0..8 {
            let b = s.plan_step("llm", "prefill", None).unwrap().into_batch();
            let ran: Vec<u32> = b.rows.iter().map(|r| r.tokens()).collect();
            shapes.push(b.rows.iter().find(|r| r.rid == 9).map(chunk));
            s.close_step(b.step, &ran, None).unwrap();
        }
        assert_eq!(
            shapes,
            [
                None,
                None,
                None,
                Some((0, 64)),
                None,
                None,
                None,
                Some((64, 128))
            ],
            "three steps waited, then the floor; the wait starts again after each chunk"
        );
    }

    #[test]
    fn a_time_measured_after_the_completion_is_read_as_one_given_with_it() {
        let truth = LatencyModel::try_new(2.0, 0.5, 0.0, 0.001).unwrap();
        let model = LatencyModel::try_new(1.0, 0.5, 0.0, 0.0).unwrap();
        let settings = |s: crate::budget::BudgetSettings| {
            s.cost("llm", model)
                .learn_cost(true)
                .max_step_ms("llm", 40.0)
                .time_margin(0.9)
        };
        let (mut now, mut late) = (state_with(settings), state_with(settings));
        for i in 0..60u32 {
            let total = 10 + (i * 37) % 60;
            let mut outs = Vec::new();
            for (s, with_ms) in [(&mut now, true), (&mut late, false)] {
                s.queue_prompt(
                    u64::from(i),
                    "llm",
                    "prefill",
                    total,
                    AdmitOptions::cached(0),
                )
                .unwrap();
                let b = s.plan_step("llm", "prefill", None).unwrap().into_batch();
                let ran = b.rows[0].tokens();
                let ms = truth.predict_ms(&StepFeatures::EMPTY.with_chunk(0, ran)) * 1.3;
                let out = s.close_step(b.step, &[ran], with_ms.then_some(ms)).unwrap();
                let time_overrun = if with_ms {
                    out.time_overrun
                } else {
                    assert_eq!(out.time_overrun, None, "not known yet");
                    let m = s.take_late_measurement(b.step, ms).unwrap();
                    assert_eq!((m.step, m.measured_ms), (b.step, ms));
                    assert_eq!(
                        (m.predicted_ms, m.max_step_ms),
                        (out.predicted_ms, out.max_step_ms)
                    );
                    assert_eq!(m.model, s.latency_model("llm"));
                    assert_eq!(m.time_margin, s.margin("llm"));
                    let again = s.take_late_measurement(b.step, ms).unwrap_err();
                    assert_eq!(again, ChunkingError::UnknownStep { step: b.step });
                    m.time_overrun
                };
                outs.push((b.step, time_overrun));
                s.drop_rows(u64::from(i));
            }
            assert_eq!(outs[0].1, outs[1].1, "step {i}");
        }
        assert_eq!(late.latency_model("llm"), now.latency_model("llm"));
        assert_eq!(late.latency_model("llm").1, ModelSource::Online);
        assert_eq!(late.margin("llm"), now.margin("llm"));
        assert!(late.margin("llm").unwrap() > 1.0);
        let bad = late.take_late_measurement(1, f64::NAN).unwrap_err();
        assert!(matches!(bad, ChunkingError::BadMeasurement { step: 1, .. }));
        assert_eq!(
            late.take_late_measurement(9_999, 1.0).unwrap_err(),
            ChunkingError::UnknownStep { step: 9_999 }
        );
        // Only the latest LATE_STEPS unmeasured steps are kept; a step completed with its time
        // is not kept at all.
        let mut steps = Vec::new();
        for i in 0..=LATE_STEPS as u64 {
            late.queue_prompt(100 + i, "llm", "prefill", 10, AdmitOptions::cached(0))
                .unwrap();
            let b = late.plan_step("llm", "prefill", None).unwrap().into_batch();
            late.close_step(b.step, &[10], None).unwrap();
            steps.push(b.step);
        }
        assert!(
            late.take_late_measurement(steps[0], 1.0).is_err(),
            "evicted"
        );
        assert!(late.take_late_measurement(steps[1], 1.0).is_ok());
        assert!(late.take_late_measurement(steps[LATE_STEPS], 1.0).is_ok());
        let mut plain = state();
        plain
            .queue_prompt(1, "llm", "prefill", 10, AdmitOptions::cached(0))
            .unwrap();
        let b = plain
            .plan_step("llm", "prefill", None)
            .unwrap()
            .into_batch();
        plain.close_step(b.step, &[10], None).unwrap();
        assert!(
            plain.take_late_measurement(b.step, 1.0).is_err(),
            "nothing reads a time there"
        );
    }

    #[test]
    fn a_rows_helpers_read_its_work() {
        let row = |work| BatchRow {
            rid: 1,
            walk: 0,
            work,
            context: 0,
            input: None,
        };
        let first = row(RowWork::Chunk {
            range: ChunkRange::new(true, 0, 64, 100),
            cached: 16,
        });
        let last = row(RowWork::Chunk {
            range: ChunkRange::new(false, 64, 100, 100),
            cached: 0,
        });
        let decode = row(RowWork::Continue { estimate: 3 });
        assert_eq!(
            (first.kind(), first.kind().as_str()),
            (RowKind::Chunk, "chunk")
        );
        assert_eq!(
            (decode.kind(), decode.kind().as_str()),
            (RowKind::Continue, "continue")
        );
        assert!(first.is_chunk() && last.is_chunk() && !decode.is_chunk());
        assert_eq!(first.range(), Some(ChunkRange::new(true, 0, 64, 100)));
        assert_eq!(decode.range(), None);
        assert!(!first.is_final() && last.is_final() && !decode.is_final());
        assert_eq!((first.cached(), last.cached(), decode.cached()), (16, 0, 0));
        assert_eq!((first.estimate(), decode.estimate()), (None, Some(3)));
        assert_eq!(
            (first.tokens(), last.tokens(), decode.tokens()),
            (64, 36, 3)
        );
    }

    #[test]
    fn a_state_with_a_table_plans_under_it_as_its_first_snapshot() {
        let subs = BTreeMap::from([(Name::from("llm"), SubmoduleCaps::new(["prefill"], false))]);
        let pols = BTreeMap::from([(
            (Name::from("llm"), Name::from("prefill")),
            ChunkingPolicy::budget(100),
        )]);
        let model = ModelPolicies::new(subs, pols).unwrap().shared();
        let mut s = SchedulerState::with_table(BudgetTable::from_policies(model));
        assert_eq!(s.snapshot().unwrap().generation(), 1);
        s.queue_prompt(1, "llm", "prefill", 150, AdmitOptions::cached(0))
            .unwrap();
        let b = s.plan_batch("llm", "prefill", None).unwrap();
        assert_eq!((b.budget, chunk(&b.rows[0])), (Some(100), (0, 100)));
    }

    #[test]
    fn a_step_in_flight_is_answered_again_and_its_held_batch_returned() {
        let mut s = state_with(|s| s);
        s.queue_prompt(1, "llm", "prefill", 150, AdmitOptions::cached(0))
            .unwrap();
        let Assembled::Planned(b) = s.plan_step("llm", "prefill", None).unwrap() else {
            panic!("planned")
        };
        assert_eq!(
            (b.budget, b.floor, b.caps.clone()),
            (Some(100), Some(64), None)
        );
        assert_eq!(b.rows[0].tokens(), 100);
        assert_eq!(&**b.walk_of(&b.rows[0]), "prefill");
        assert_eq!(s.steps_in_flight(), 1);
        // Asked again before it is held: the same step, planned again.
        let Assembled::Planned(again) = s.plan_step("llm", "prefill", None).unwrap() else {
            panic!("planned")
        };
        assert_eq!(again, b);
        // Another walk of the node waits for the step.
        assert_eq!(
            s.plan_step("llm", "decode", None),
            Err(ChunkingError::StepInFlight {
                node: "llm".into(),
                walk: "prefill".into(),
                step: b.step
            })
        );
        // A batch of another step is not held; the step's own is, once.
        s.hold(Arc::new(Batch {
            step: b.step + 1,
            ..b.clone()
        }));
        assert!(matches!(
            s.plan_step("llm", "prefill", None).unwrap(),
            Assembled::Planned(_)
        ));
        let held = Arc::new(b.clone());
        s.hold(held.clone());
        s.hold(Arc::new(b.clone()));
        let Assembled::InFlight(got) = s.plan_step("llm", "prefill", None).unwrap() else {
            panic!("in flight")
        };
        assert!(Arc::ptr_eq(&got, &held));
        assert_eq!(Assembled::InFlight(got).into_batch(), b);
        // The next step gets a new number.
        s.close_step(b.step, &[100], None).unwrap();
        let next = s.plan_step("llm", "prefill", None).unwrap().into_batch();
        assert!(next.step > b.step, "{} after {}", next.step, b.step);
    }

    #[test]
    fn complete_refuses_a_bad_report_and_changes_nothing() {
        let mut s = state_with(|s| s);
        s.queue_prompt(1, "llm", "prefill", 150, AdmitOptions::cached(0))
            .unwrap();
        let b = s.plan_step("llm", "prefill", None).unwrap().into_batch();
        let step = b.step;
        assert_eq!(
            s.close_step(step, &[], None),
            Err(ChunkingError::RanLengthMismatch {
                step,
                expected: 1,
                got: 0
            })
        );
        assert_eq!(
            s.close_step(step, &[50], None),
            Err(ChunkingError::PartialChunk {
                step,
                rid: 1,
                planned: 100,
                ran: 50
            })
        );
        for ms in [-1.0, -f64::MIN_POSITIVE, f64::INFINITY, f64::NAN] {
            assert!(
                matches!(
                    s.close_step(step, &[100], Some(ms)),
                    Err(ChunkingError::BadMeasurement { .. })
                ),
                "{ms}"
            );
        }
        assert_eq!(s.steps_in_flight(), 1);
        assert_eq!(s.node("llm").unwrap().prefill()[0].progress, 0);
        // 0 ms is a measurement.
        let out = s.close_step(step, &[100], Some(0.0)).unwrap();
        assert_eq!(
            (
                out.chunks,
                out.final_chunks,
                out.unrun_chunks,
                out.measured_ms
            ),
            (1, 0, 0, Some(0.0))
        );
        assert_eq!(s.steps_in_flight(), 0);
        // A chunk reported at 0 did not run and is planned again from the same place.
        let b = s.plan_step("llm", "prefill", None).unwrap().into_batch();
        assert_eq!(chunk(&b.rows[0]), (100, 150));
        let out = s.close_step(b.step, &[0], None).unwrap();
        assert_eq!((out.chunks, out.final_chunks, out.unrun_chunks), (0, 0, 1));
        assert!(out.finished.is_empty());
        let b = s.plan_step("llm", "prefill", None).unwrap().into_batch();
        assert_eq!(chunk(&b.rows[0]), (100, 150));
        let out = s.close_step(b.step, &[50], None).unwrap();
        assert_eq!(
            (out.chunks, out.final_chunks, out.unrun_chunks, out.finished),
            (1, 1, 0, vec![1])
        );
        assert_eq!(s.prefill_rows(), 0);
    }

    #[test]
    fn an_empty_batch_is_not_in_flight_and_is_completed_or_abandoned_once() {
        let mut s = state_with(|s| s);
        let empty = s.plan_step("llm", "prefill", None).unwrap().into_batch();
        assert!(empty.rows.is_empty());
        assert_eq!(s.steps_in_flight(), 0);
        // A row admitted meanwhile is planned by the next assemble, under any walk.
        s.queue_prompt(1, "llm", "prefill", 30, AdmitOptions::cached(0))
            .unwrap();
        let b = s.plan_step("llm", "prefill", None).unwrap().into_batch();
        assert_eq!(b.rows.len(), 1);
        assert_eq!(s.steps_in_flight(), 1);
        s.close_step(empty.step, &[], None).unwrap();
        assert_eq!(
            s.close_step(empty.step, &[], None),
            Err(ChunkingError::UnknownStep { step: empty.step })
        );
        assert_eq!(s.steps_in_flight(), 1, "the step with rows stays in flight");
        s.close_step(b.step, &[30], None).unwrap();
        let empty = s.plan_step("llm", "decode", None).unwrap().into_batch();
        s.abandon(empty.step, &[]).unwrap();
        assert_eq!(
            s.abandon(empty.step, &[]),
            Err(ChunkingError::UnknownStep { step: empty.step })
        );
    }

    #[test]
    fn forget_drops_rows_and_counts_prefill_rows() {
        let mut s = state_with(|s| s);
        assert_eq!(s.node_names().count(), 0);
        assert!(s.node("llm").is_none());
        s.queue_prompt(1, "llm", "prefill", 30, AdmitOptions::cached(0))
            .unwrap();
        s.queue_prompt(2, "llm", "prefill", 30, AdmitOptions::cached(0))
            .unwrap();
        s.queue_prompt(3, "llm", "prefill", 30, AdmitOptions::cached(0))
            .unwrap();
        s.queue_continuing(4, "llm", "decode", 1, Some(10)).unwrap();
        assert_eq!(s.prefill_rows(), 3);
        assert_eq!(s.node_names().map(|n| &**n).collect::<Vec<_>>(), ["llm"]);
        assert_eq!(s.drop_rows(1), 1);
        assert_eq!(
            s.drop_rows(4),
            0,
            "a continuing row holds no prepared input"
        );
        assert!(s.node("llm").unwrap().cont().is_empty());
        assert!(s.drop_row(2, "llm"));
        assert!(!s.drop_row(2, "llm"));
        assert!(!s.drop_row(3, "ghost"));
        assert_eq!(s.prefill_rows(), 1);
    }

    #[test]
    fn contexts_grow_only_where_a_model_reads_them() {
        let kv = LatencyModel::try_new(1.0, 0.0, 0.5, 0.0).unwrap();
        let no_kv = LatencyModel::try_new(1.0, 0.5, 0.0, 0.0).unwrap();
        for (model, grows) in [(Some(kv), true), (Some(no_kv), false), (None, false)] {
            let mut s = state_with(|s| match model {
                Some(m) => s.cost("llm", m),
                None => s,
            });
            s.queue_continuing(1, "llm", "decode", 2, Some(100))
                .unwrap();
            let b = s.plan_step("llm", "decode", None).unwrap().into_batch();
            let out = s.close_step(b.step, &[2], None).unwrap();
            assert_eq!(
                contexts(&s),
                [(1, if grows { 102 } else { 100 })],
                "{model:?}"
            );
            assert_eq!(
                out.predicted_ms,
                model.map(|m| m.predict_ms(&{
                    let mut f = StepFeatures::EMPTY;
                    f.add_continuing(2, 100);
                    f
                }))
            );
        }
    }

    #[test]
    fn a_time_margin_plans_against_the_budget_over_the_recent_ratio_and_checks_the_budget() {
        use crate::latency::margin::MIN_STEPS;
        // 1 ms a token, no base: a time budget of 60 ms plans 60-token chunks.
        let model = LatencyModel::try_new(0.0, 1.0, 0.0, 0.0).unwrap();
        let floor = std::num::NonZeroU32::new(8).unwrap();
        let timed = |s: crate::budget::BudgetSettings| {
            s.cost("llm", model)
                .max_step_ms("llm", 60.0)
                .min_chunk_tokens(floor)
        };
        let mut s = state_with(|s| timed(s).time_margin(0.5));
        let mut rid = 0;
        let mut step = |s: &mut SchedulerState, slower: f64| {
            rid += 1;
            s.queue_prompt(rid, "llm", "prefill", 1_000, AdmitOptions::cached(0))
                .unwrap();
            let b = s.plan_step("llm", "prefill", None).unwrap().into_batch();
            let (start, end) = chunk(&b.rows[0]);
            let ran = end - start;
            let out = s
                .close_step(b.step, &[ran], Some(f64::from(ran) * slower))
                .unwrap();
            s.drop_rows(rid);
            (ran, out)
        };
        // Until MIN_STEPS steps are seen, no margin: 60 tokens, and each 1.5x slower step is
        // a time overrun of the budget itself.
        for i in 0..MIN_STEPS {
            let (ran, out) = step(&mut s, 1.5);
            assert_eq!(ran, 60, "step {i}");
            assert_eq!(out.max_step_ms, Some(60.0));
            assert_eq!(out.time_margin, Some(1.0));
            assert_eq!(out.time_overrun, Some(TimeOverrunReason::Misprediction));
        }
        assert_eq!(s.margin("llm"), Some(1.5));
        // Then steps are planned against 60 / 1.5 = 40 ms: 40 tokens, measured 60 ms, which is
        // the budget and no overrun; the outcome still names the budget, 60.
        let (ran, out) = step(&mut s, 1.5);
        assert_eq!(ran, 40);
        assert_eq!((out.max_step_ms, out.time_margin), (Some(60.0), Some(1.5)));
        assert_eq!((out.measured_ms, out.time_overrun), (Some(60.0), None));
        // Steps that run as predicted bring the median ratio back to 1 (33 ratios of 1.5 and
        // 33 of 1: the 0.5-quantile, rank 33, is the lower one), and the chunks back to 60.
        for _ in 0..=MIN_STEPS {
            step(&mut s, 1.0);
        }
        assert_eq!(s.margin("llm"), Some(1.0));
        assert_eq!(step(&mut s, 1.0).0, 60);
        // Without a quantile there is no margin, whatever the steps measure.
        let mut plain = state_with(timed);
        for _ in 0..MIN_STEPS + 1 {
            let (ran, out) = step(&mut plain, 2.0);
            assert_eq!((ran, out.time_margin), (60, None));
        }
        assert_eq!(plain.margin("llm"), None);
    }

    #[test]
    fn the_latency_model_comes_from_the_config_then_from_a_trusted_fit_of_what_ran() {
        assert_eq!(
            SchedulerState::default().latency_model("llm"),
            (None, ModelSource::None)
        );
        assert!(SchedulerState::default().snapshot().is_none());
        let configured = LatencyModel::try_new(9.0, 0.0, 0.0, 0.0).unwrap();
        let truth = LatencyModel::try_new(2.0, 0.5, 0.0, 0.001).unwrap();
        let mut s = state_with(|s| s.cost("llm", configured).learn_cost(true));
        assert_eq!(s.snapshot().unwrap().generation(), 1);
        assert_eq!(
            s.latency_model("llm"),
            (Some(configured), ModelSource::Config)
        );
        let before = s.latency_report("llm").unwrap();
        assert_eq!(
            (before.model, before.source, before.configured),
            (Some(configured), ModelSource::Config, Some(configured))
        );
        assert!(before.learn_cost && before.fit.is_none());
        assert!(matches!(
            SchedulerState::default().latency_report("llm"),
            Err(ChunkingError::UnknownNode { .. })
        ));
        assert!(matches!(
            s.latency_report("ghost"),
            Err(ChunkingError::UnknownNode { .. })
        ));
        // Steps of one chunk each, 10..=100 tokens, measured as `truth` predicts what ran;
        // every third is reported unrun (0 tokens), measured at the base alone.
        for i in 0..60u32 {
            let total = 10 + (i * 37) % 91;
            s.queue_prompt(
                u64::from(i),
                "llm",
                "prefill",
                total,
                AdmitOptions::cached(0),
            )
            .unwrap();
            let b = s.plan_step("llm", "prefill", None).unwrap().into_batch();
            let unrun = i % 3 == 0;
            let ran = if unrun { 0 } else { total };
            let features = StepFeatures::EMPTY.with_chunk(0, ran);
            let out = s
                .close_step(b.step, &[ran], Some(truth.predict_ms(&features)))
                .unwrap();
            if unrun {
                s.drop_rows(u64::from(i));
            }
            if i + 1 < 50 {
                assert_eq!(out.model.1, ModelSource::Config, "step {i}");
            }
        }
        let (model, source) = s.latency_model("llm");
        assert_eq!(source, ModelSource::Online);
        let report = s.latency_report("llm").unwrap();
        assert_eq!((report.model, report.source), (model, source));
        assert_eq!(report.configured, Some(configured));
        let fit = report.fit.unwrap();
        assert!(fit.trusted);
        assert_eq!((fit.samples, Some(fit.model)), (60, model));
        let got = model.unwrap().coefficients();
        for (g, w) in got.iter().zip(truth.coefficients()) {
            assert!(
                (g - w).abs() < 1e-6,
                "{got:?} vs {:?}",
                truth.coefficients()
            );
        }
    }

    #[test]
    fn with_a_prior_the_first_step_after_set_budgets_is_planned_against_the_time_budget() {
        // 1 ms a token: a 60 ms budget plans 60-token chunks from the first step, learning on.
        let prior = LatencyModel::try_new(0.0, 1.0, 0.0, 0.0).unwrap();
        let floor = std::num::NonZeroU32::new(8).unwrap();
        let mut s = state_with(|s| {
            s.cost("llm", prior)
                .learn_cost(true)
                .max_step_ms("llm", 60.0)
                .min_chunk_tokens(floor)
        });
        s.queue_prompt(1, "llm", "prefill", 1_000, AdmitOptions::cached(0))
            .unwrap();
        let b = s.plan_step("llm", "prefill", None).unwrap().into_batch();
        assert_eq!((b.max_step_ms, b.predicted_ms), (Some(60.0), Some(60.0)));
        assert_eq!(chunk(&b.rows[0]), (0, 60));
        let out = s.close_step(b.step, &[60], Some(60.0)).unwrap();
        assert_eq!(out.model.1, ModelSource::Config);
        assert_eq!((out.max_step_ms, out.time_inactive), (Some(60.0), None));
        let report = s.latency_report("llm").unwrap();
        assert_eq!(
            (report.time_inactive_steps, report.time_inactive),
            (0, None)
        );
    }

    #[test]
    fn without_a_prior_each_step_says_why_its_time_budget_is_not_in_force() {
        use crate::overrun::TimeInactiveReason::{NoMeasurements, UntrustedFit};
        let floor = std::num::NonZeroU32::new(8).unwrap();
        let mut s = state_with(|s| {
            s.learn_cost(true)
                .max_step_ms("llm", 60.0)
                .min_chunk_tokens(floor)
        });
        let mut rid = 0;
        // Prompts of 20 to 100 tokens and one of 1,000, each step measured at 1 ms a token
        // (`close_step` with a time) or not.
        let mut step = |s: &mut SchedulerState, measured: bool| {
            rid += 1;
            let total = if measured {
                20 + (rid * 37) % 81
            } else {
                1_000
            };
            s.queue_prompt(rid, "llm", "prefill", total as u32, AdmitOptions::cached(0))
                .unwrap();
            let b = s.plan_step("llm", "prefill", None).unwrap().into_batch();
            let (start, end) = chunk(&b.rows[0]);
            let ran = end - start;
            let ms = measured.then_some(f64::from(ran));
            let out = s.close_step(b.step, &[ran], ms).unwrap();
            s.drop_rows(rid);
            (b, out)
        };
        // No step measured yet: planned under the token budget alone (100 tokens of 1,000).
        for i in 0..2 {
            let (b, out) = step(&mut s, false);
            assert_eq!((b.max_step_ms, b.predicted_ms), (None, None), "step {i}");
            assert_eq!(chunk(&b.rows[0]), (0, 100));
            assert_eq!(out.time_inactive, Some(NoMeasurements), "step {i}");
        }
        // The first measured step is planned before its time is known; then the fit has
        // samples, but is not trusted before 50 steps (1 ms a token).
        let (_, out) = step(&mut s, true);
        assert_eq!(out.time_inactive, Some(NoMeasurements));
        for i in 0..48 {
            let (_, out) = step(&mut s, true);
            assert_eq!(out.time_inactive, Some(UntrustedFit), "step {i}");
            assert_eq!(out.model.1, ModelSource::None, "step {i}");
        }
        let report = s.latency_report("llm").unwrap();
        assert_eq!(
            (report.time_inactive_steps, report.time_inactive),
            (51, Some(UntrustedFit))
        );
        // The 50th measured step makes the fit trusted: the next is planned in time, and the
        // node's latest step no longer reports a reason (its count stays).
        let (_, out) = step(&mut s, true);
        assert_eq!(out.time_inactive, Some(UntrustedFit));
        assert_eq!(out.model.1, ModelSource::Online);
        let (b, out) = step(&mut s, false);
        assert_eq!(b.max_step_ms, Some(60.0));
        // The fitted 1 ms a token, give or take its rounding: a chunk of about 60 tokens.
        let (_, end) = chunk(&b.rows[0]);
        assert!((55..=60).contains(&end), "{end}");
        assert!(b.predicted_ms.is_some_and(|p| p <= 60.0), "{b:?}");
        assert_eq!(out.time_inactive, None);
        let report = s.latency_report("llm").unwrap();
        assert_eq!(
            (report.time_inactive_steps, report.time_inactive),
            (52, None)
        );
        // A node without a time budget, or a step with no rows, is never counted.
        let mut plain = state_with(|s| s.learn_cost(true));
        plain
            .queue_prompt(1, "llm", "prefill", 10, AdmitOptions::cached(0))
            .unwrap();
        let b = plain
            .plan_step("llm", "prefill", None)
            .unwrap()
            .into_batch();
        assert_eq!(
            plain.close_step(b.step, &[10], None).unwrap().time_inactive,
            None
        );
        let b = s.plan_step("llm", "prefill", None).unwrap().into_batch();
        assert!(b.rows.is_empty());
        assert_eq!(s.close_step(b.step, &[], None).unwrap().time_inactive, None);
        assert_eq!(s.latency_report("llm").unwrap().time_inactive_steps, 52);
    }
}
