//! The simulation loop (`docs/config-replay.md`).
//!
//! Simulated time, in ms, is never slept: a step that starts at `t` ends at
//! `t +` the cost model's prediction for what it ran (`docs/cost-model.md`; by default
//! `base_ms + per_token_ms * ran_tokens`), times the optional noise. Before each step every request that arrived by `t`
//! is admitted (in trace order); when nothing is queued the clock jumps to the next arrival.
//! A prompt's final chunk yields its first token at the end of its step; each further token
//! takes its continuing `decode` row one step it runs in.
//!
//! One message a step, as an engine's loop should be: a step is completed, the row changes it
//! leads to (finished requests forgotten, prompts continuing on `decode`, new arrivals
//! admitted) applied and the next step assembled in one `complete_and_assemble`, the
//! changes carried in its [`NextStep`]. Three documented fallbacks make calls of their own:
//! the first step (nothing to complete yet: its admissions, then `assemble`), the last step
//! and the one before a stop (completed alone: nothing comes next), and a step whose rows do
//! not fit the KV memory (`abandon`, the preempted requests forgotten, `assemble` again;
//! `sim/memory.rs`).

use std::collections::VecDeque;
use std::io::IsTerminal;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Arc;

use indicatif::{ProgressBar, ProgressStyle};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::prefix_cache::PrefixCache;
use super::priority::ByClass;
use super::report::{ChunkCounts, OverrunCounts, ReplayReport, StepDurations, TokenCounts};
use super::step_log::{StepLog, StepSink};
use super::trace::Trace;
use super::{ReplayError, ReplayOptions, ReplaySetup, DECODE_WALK, PREFILL_WALK};
use mstar_chunking::latency::StepFeatures;
use mstar_chunking::overrun::OverrunReason;
use mstar_chunking::planner::RowWork;
use mstar_chunking::policy::Name;
use mstar_chunking::prepared::PreparedInput;
use mstar_chunking::scheduler::{Batch, NextStep, StepOutcome};
use mstar_chunking::{AdmitOptions, ChunkingManagement};

mod memory;
mod tally;
mod worker;

pub use memory::first_chunk_walk;
pub(crate) use tally::Tally;
pub(crate) use worker::{Handoff, Role};

/// Steps between progress bar updates (drawing per step would cost more than the step).
const PROGRESS_EVERY: u64 = 256;

/// A request's life in the simulation.
#[derive(Debug, Clone, Copy, Default)]
struct ReqState {
    /// Tokens still to generate after the current one.
    remaining: u32,
    /// When its last token was generated (simulated ms).
    last_token_ms: f64,
    /// Whether its prompt ran a non-final chunk, in any admission (a recompute included).
    cut: bool,
    /// Whether it was counted in `prompts_cut`: a prompt is counted once, however often it
    /// is recomputed.
    cut_counted: bool,
    /// The KV context its next continuing row reads, as the simulated engine knows it: its
    /// prompt plus the tokens it has generated. Kept here, never read from the component,
    /// whose own contexts are estimates it may not even keep (see [`Sim::step_ms`]).
    true_context: u64,
    /// Tokens generated so far (a preempted request recomputes its prompt and these).
    generated: u32,
    /// Times it was preempted: it is admitted to the component as `rid + attempt << 32`.
    attempt: u32,
    /// Where it is, for the KV memory model.
    phase: Phase,
    /// The tokens its current admission prefills (prompt + tokens generated before it).
    input_total: u32,
    /// The end of its last completed chunk in the current admission.
    prefilled: u32,
}

/// A request's phase, as the KV memory model needs it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
enum Phase {
    /// Not admitted to the component (not arrived, or waiting for memory).
    #[default]
    Waiting,
    /// Admitted, its prompt not through its final chunk.
    Prefilling,
    /// Generating on a continuing row.
    Decoding,
    /// Its last token is out.
    Done,
}

/// One replay in progress.
pub struct Sim<'a> {
    cm: &'a ChunkingManagement,
    setup: &'a ReplaySetup,
    trace: &'a Trace,
    opts: &'a ReplayOptions,
    step_log: Option<StepSink>,
    /// Arrivals in simulated ms (trace times scaled by `1 / rate_scale`).
    arrivals: Vec<f64>,
    /// `rid -> index` into the trace's requests (rids skip bad lines).
    index_of_rid: Vec<u32>,
    state: Vec<ReqState>,
    cache: Option<PrefixCache>,
    rng: SmallRng,
    /// Draws the cost noise; its own stream, so the speculation draws stay as they were.
    noise_rng: SmallRng,
    /// The estimate a decode row is registered with: 1, or `k + 1` with `k` speculative tokens.
    estimate: u32,

    t_ms: f64,
    /// Prompts admitted and not yet through their final chunk; decode rows registered.
    prefilling: usize,
    decoding: usize,
    /// Prepared inputs held, mirrored from admissions and final chunks, for the peak.
    held_rows: usize,
    held_tokens: u64,
    /// Requests whose last token was generated.
    done: usize,
    /// Reused per step: the tokens each row ran.
    ran: Vec<u32>,
    /// Reused per step: each row's true context (a continuing row's
    /// [`ReqState::true_context`]; 0 for a chunk), what the step is priced and logged with.
    true_contexts: Vec<u64>,

    report: ReplayReport,
    budget_sum: u64,
    budget_used: u64,
    /// The same sums over the steps that cut a prompt.
    cut_budget_sum: u64,
    cut_budget_used: u64,
    ttft: Vec<f64>,
    /// Time between tokens: one sample per generated token, so kept in the bounded
    /// histogram step times use (its error is documented there), never in a `Vec`.
    tbt: StepDurations,
    /// TTFT and TBT per priority class (reported with two classes or more).
    by_class: ByClass,
    /// The KV memory model (`[replay.kv]`); `None`: unlimited memory, as without it.
    kv: Option<memory::KvState>,
    /// Set to a signal number when the replay is to stop at the next step boundary.
    stop: Option<Arc<AtomicI32>>,
    /// The step walks that have a time budget (`chunking.max_step_ms`), to count the steps
    /// planned without it ([`super::report::TimeBudgetUse`]).
    timed_walks: Vec<String>,
    /// The row changes for the next step, in the order they are applied.
    changes: Vec<Change>,
    /// The node and its step walks as names, for each step's `NextStep` (cloned, never
    /// allocated again).
    node_name: Name,
    walk_names: Vec<Name>,
    decode_walk: Name,
    /// The requests this simulation admits, in arrival order.
    inbox: Inbox,
    /// The step simulated last, completed by the message that assembles the next one.
    pending: Option<Pending>,
    /// Turns taken: the step walk of the next is `turns % walks`.
    turns: usize,
    /// Turns in a row whose step scheduled no row (a stall, once every walk had one).
    empty_streak: usize,
    /// What a fleet's router sees of this worker: requests and prompt tokens sent to it, and
    /// the figures it had while its last step ran (`sim/worker.rs`).
    routed: usize,
    routed_tokens: u64,
    /// Prompt and generated tokens of the requests whose last token is out.
    done_tokens: u64,
    in_step: worker::Load,
    /// What this worker does in a fleet: everything, or one pool's part of a disaggregated one.
    role: Role,
    /// A prefill worker's prompts done since the fleet last took them, their KV to move.
    handoffs: Vec<Handoff>,
}

/// The requests a simulation admits, in arrival order.
enum Inbox {
    /// Every request of the trace (one worker): the next to arrive.
    Trace { next: usize },
    /// Those a fleet's router sent to this worker, not yet arrived at a step.
    Routed(VecDeque<usize>),
}

/// What one turn of the loop did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Turn {
    /// A step was assembled (it may have had no row).
    Stepped,
    /// Nothing to run and nothing left to arrive: the simulation is done (for a fleet's
    /// worker, until its router sends it more).
    Idle,
}

/// What one step did.
enum Stepped {
    Ran,
    /// The step had no row: nothing eligible for its walk.
    Empty,
}

/// A row change for the component, applied before the next step is planned: carried by the
/// message that completes the step before it (`NextStep`), or sent alone before the first.
enum Change {
    /// `forget_request`: the request generated its last token.
    Forget(u64),
    /// `continue_row_with_context` on `decode`: the prompt ran its final chunk and generates
    /// more; the context is the simulated engine's (its prompt and first token), so that the
    /// planner predicts with what the step is priced with.
    Continue { rid: u64, context: u64 },
    /// `admit_with` on `prefill` (its cached prefix, priority and arrival time).
    Admit {
        rid: u64,
        input: PreparedInput,
        options: AdmitOptions,
    },
}

/// A step assembled and simulated, whose completion the next message carries.
enum Pending {
    /// A step without rows: completed with nothing run and no time.
    Empty(u64),
    /// A step that ran: what its completion reports and what its step-log line needs.
    Ran(Box<RanStep>),
}

/// What a step that ran reports on completion, and what is written of it once its outcome is
/// back.
struct RanStep {
    batch: Arc<Batch>,
    /// The tokens each row ran.
    ran: Vec<u32>,
    /// Its simulated duration, reported as measured.
    ms: f64,
    /// When it started (simulated ms).
    t_start: f64,
    /// Each row's true context (see [`Sim::true_contexts`]).
    contexts: Vec<u64>,
    /// Its step walk's index in the setup's walks.
    walk: usize,
    kv_line: Option<super::step_log::KvStepLine>,
}

impl<'a> Sim<'a> {
    /// Prepares a replay of `trace` on `cm` (policies and budgets already set).
    pub fn new(
        cm: &'a ChunkingManagement,
        setup: &'a ReplaySetup,
        trace: &'a Trace,
        opts: &'a ReplayOptions,
        step_log: Option<StepLog>,
    ) -> Self {
        let reqs = &trace.requests;
        let last_rid = reqs.last().map_or(0, |r| r.rid);
        let mut index_of_rid = vec![u32::MAX; usize::try_from(last_rid).unwrap_or(0) + 1];
        for (i, r) in reqs.iter().enumerate() {
            index_of_rid[r.rid as usize] = i as u32;
        }
        let report = ReplayReport {
            // Filled in by `replay::run`, which knows the budgets and the trace's reading.
            settings: Default::default(),
            step_ms: Default::default(),
            warnings: Vec::new(),
            trace: trace.file.clone(),
            format: trace.format,
            node: setup.node.clone(),
            walks: setup.walks.clone(),
            budget_off: opts.budget_off,
            rate_scale: opts.rate_scale,
            requests: reqs.len(),
            skipped_lines: trace.skipped_lines,
            bad_line_examples: trace.bad_line_examples.clone(),
            steps: 0,
            budgeted_steps: 0,
            tokens: TokenCounts::default(),
            budget_utilisation: None,
            cut_steps: 0,
            cut_step_utilisation: None,
            chunks: ChunkCounts::default(),
            overruns: OverrunCounts::default(),
            time_overruns: Default::default(),
            time_budget: None,
            latency_model: Default::default(),
            decode_row_waits: 0,
            ttft_ms: None,
            tbt_ms: None,
            by_priority: Vec::new(),
            peak_prepared_rows: 0,
            peak_prepared_tokens: 0,
            prepared_left_rows: 0,
            prepared_left_tokens: 0,
            simulated_ms: 0.0,
            wall_ms: 0.0,
            steps_per_second: 0.0,
            step_log: step_log.as_ref().map(|l| l.path().display().to_string()),
            fleet: None,
            interrupted: None,
            kv: None,
        };
        Self {
            cm,
            setup,
            trace,
            opts,
            step_log: step_log.map(StepSink::Own),
            arrivals: reqs
                .iter()
                .map(|r| r.arrival_ms / opts.rate_scale)
                .collect(),
            index_of_rid,
            state: vec![ReqState::default(); reqs.len()],
            cache: (setup.cache_blocks > 0).then(|| {
                let c = PrefixCache::new(setup.cache_blocks, setup.cache_block_tokens);
                // The KV memory model evicts block by block (`sim/memory.rs`).
                if setup.kv.is_some() {
                    c.tail_first()
                } else {
                    c
                }
            }),
            rng: SmallRng::seed_from_u64(setup.seed),
            noise_rng: SmallRng::seed_from_u64(setup.seed ^ 0x9e37_79b9_7f4a_7c15),
            estimate: setup.spec_tokens + 1,
            t_ms: 0.0,
            prefilling: 0,
            decoding: 0,
            held_rows: 0,
            held_tokens: 0,
            done: 0,
            ran: Vec::new(),
            true_contexts: Vec::new(),
            report,
            budget_sum: 0,
            budget_used: 0,
            cut_budget_sum: 0,
            cut_budget_used: 0,
            // TTFT samples grow with the requests that got a first token, never reserved from
            // the trace's declared sizes.
            ttft: Vec::new(),
            tbt: StepDurations::default(),
            by_class: ByClass::of(trace),
            kv: setup
                .kv
                .as_ref()
                .map(|k| memory::KvState::new(k, reqs.len())),
            stop: None,
            timed_walks: Vec::new(),
            changes: Vec::new(),
            node_name: Name::from(setup.node.as_str()),
            walk_names: setup.walks.iter().map(|w| Name::from(w.as_str())).collect(),
            decode_walk: Name::from(DECODE_WALK),
            inbox: Inbox::Trace { next: 0 },
            pending: None,
            turns: 0,
            empty_streak: 0,
            routed: 0,
            routed_tokens: 0,
            done_tokens: 0,
            in_step: worker::Load::default(),
            role: Role::Colocated,
            handoffs: Vec::new(),
        }
    }

    /// Counts, for the walks in `budgets` with a time budget, the steps planned without it.
    #[must_use]
    pub fn time_budgets(mut self, budgets: &[super::report::WalkBudget]) -> Self {
        self.timed_walks = budgets
            .iter()
            .filter(|b| b.max_step_ms.is_some())
            .map(|b| b.walk.clone())
            .collect();
        self
    }

    /// Counts a step on `walk` under its time budget, or without it (no trusted latency model
    /// yet: the component plans with the token budget alone), warning once.
    fn count_time_budget(&mut self, walk: &str, planned_under: Option<f64>) {
        if !self.timed_walks.iter().any(|w| w == walk) {
            return;
        }
        let t = self.report.time_budget.get_or_insert_with(Default::default);
        t.steps += 1;
        if planned_under.is_some() {
            return;
        }
        t.inactive_steps += 1;
        if t.inactive_reason.is_none() {
            let why = inactive_reason(self.setup);
            tracing::warn!(
                node = %self.setup.node,
                walk = %crate::config::problem::escape(walk),
                "the time budget is not in force: {why}; steps run under the token budget alone until it is"
            );
            t.inactive_reason = Some(why);
        }
    }

    /// With a KV memory limit: the most tokens a prompt's first chunk may run (the step
    /// walk's token budget), which admission reserves blocks for; `None`: the whole prompt.
    #[must_use]
    pub fn first_chunk_cap(mut self, cap: Option<u32>) -> Self {
        if let Some(kv) = &mut self.kv {
            kv.first_chunk_cap = cap;
        }
        self
    }

    /// With a KV memory limit and `on` (the node's order is `priority`): memory is ordered by
    /// the requests' priorities (`docs/kv-memory.md#priority-preemption`).
    #[must_use]
    pub fn priority_preemption(mut self, on: bool) -> Self {
        if let (true, Some(kv)) = (on, &mut self.kv) {
            kv.by_priority(self.trace.requests.iter().map(|r| r.priority).collect());
        }
        self
    }

    /// The trace index of a component rid (`rid + attempt << 32`).
    fn index_of(&self, rid: u64) -> Option<usize> {
        self.index_of_rid
            .get((rid & memory::RID_MASK) as usize)
            .copied()
            .filter(|i| *i != u32::MAX)
            .map(|i| i as usize)
    }

    /// Stops the replay at the next step boundary once `flag` holds a signal number (not 0):
    /// the report then covers what ran and names the signal.
    #[must_use]
    pub fn stop_on(mut self, flag: Arc<AtomicI32>) -> Self {
        self.stop = Some(flag);
        self
    }

    /// Runs the replay to the end: every request admitted, prefilled and done generating.
    ///
    /// # Errors
    /// An actor refused or did not answer, the step log could not be written, or the queues
    /// stalled (rows queued that no step schedules).
    pub async fn run(mut self) -> Result<ReplayReport, ReplayError> {
        let progress = self.progress_bar();
        self.check_kv_fits()?;
        loop {
            if let Some(sig) = self.stop.as_ref().map(|f| f.load(Ordering::SeqCst)) {
                if sig != 0 {
                    self.report.interrupted = Some(super::signal_name(sig));
                    break;
                }
            }
            if self.turn().await? == Turn::Idle {
                break;
            }
            if let Some(hook) = &self.opts.on_step {
                hook.call(self.report.steps);
            }
            if let Some(pb) = &progress {
                if self.report.steps.is_multiple_of(PROGRESS_EVERY) {
                    pb.set_position(self.done as u64);
                }
            }
        }
        // The last step, or the one before a stop: nothing comes next.
        self.complete_last().await?;
        if let Some(pb) = progress {
            pb.finish_and_clear();
        }
        self.finish()
    }

    /// One turn of the loop: the requests that arrived by the next step's start admitted (the
    /// clock first jumps to the next arrival when nothing is queued), then one step assembled,
    /// in the message that completes the step before it, and simulated.
    ///
    /// # Errors
    /// As [`Sim::run`].
    pub(crate) async fn turn(&mut self) -> Result<Turn, ReplayError> {
        if self.prefilling == 0 && self.decoding == 0 && self.memory_waiting() == 0 {
            let Some(i) = self.next_arrival() else {
                return Ok(Turn::Idle);
            };
            self.t_ms = self.t_ms.max(self.arrivals[i]);
        }
        while let Some(i) = self
            .next_arrival()
            .filter(|&i| self.arrivals[i] <= self.t_ms)
        {
            self.take_arrival();
            match &mut self.kv {
                Some(kv) => kv.enqueue_arrival(i, self.t_ms),
                None => self.admit(i),
            }
        }
        if self.kv.is_some() && self.admit_waiting().await? {
            // Admitting or preempting changes what a step can schedule.
            self.empty_streak = 0;
        }
        let walk = self.turns % self.setup.walks.len();
        self.turns += 1;
        let pending = self.pending.take();
        let batch = self.next_batch(pending, walk).await?;
        let (stepped, done) = self.step(batch, walk).await?;
        self.pending = Some(done);
        match stepped {
            Stepped::Ran => self.empty_streak = 0,
            // Preemption emptied the component: the next admission runs the waiting head.
            Stepped::Empty
                if self.prefilling == 0 && self.decoding == 0 && self.memory_waiting() > 0 => {}
            Stepped::Empty => {
                self.empty_streak += 1;
                // Every step walk had its turn and none scheduled a row: nothing will change.
                if self.empty_streak >= self.setup.walks.len() {
                    self.complete_last().await?;
                    return Err(ReplayError::Stalled {
                        t_ms: self.t_ms,
                        node: self.setup.node.clone(),
                        prefilling: self.prefilling,
                        decoding: self.decoding,
                    });
                }
            }
        }
        Ok(Turn::Stepped)
    }

    /// The trace index of the next request to arrive here, if any.
    fn next_arrival(&self) -> Option<usize> {
        match &self.inbox {
            Inbox::Trace { next } => (*next < self.arrivals.len()).then_some(*next),
            Inbox::Routed(q) => q.front().copied(),
        }
    }

    /// Takes the next request to arrive out of the inbox.
    fn take_arrival(&mut self) {
        match &mut self.inbox {
            Inbox::Trace { next } => *next += 1,
            Inbox::Routed(q) => {
                q.pop_front();
            }
        }
    }

    /// Completes the step simulated last alone (nothing comes next), if there is one.
    ///
    /// # Errors
    /// The component refused or did not answer, or the step log could not be written.
    pub(crate) async fn complete_last(&mut self) -> Result<(), ReplayError> {
        match self.pending.take() {
            Some(p) => self.complete_alone(p).await,
            None => Ok(()),
        }
    }

    /// The batch of the next step, on step walk `walk`: in one message that completes
    /// `pending` (the step before), applies the row changes gathered since and assembles it;
    /// or, before the first step, the changes (admissions) one by one and `assemble`.
    async fn next_batch(
        &mut self,
        pending: Option<Pending>,
        walk: usize,
    ) -> Result<Arc<Batch>, ReplayError> {
        let changes = std::mem::take(&mut self.changes);
        let Some(pending) = pending else {
            return self.first_batch(changes, walk).await;
        };
        let mut next =
            NextStep::new(self.node_name.clone(), self.walk_names[walk].clone()).at_ms(self.t_ms);
        for c in changes {
            next = match c {
                Change::Forget(rid) => next.forget_request(rid),
                Change::Continue { rid, context } => next.continue_row_with_context(
                    rid,
                    self.decode_walk.clone(),
                    self.estimate,
                    context,
                ),
                Change::Admit {
                    rid,
                    input,
                    options,
                } => next.admit_with(rid, PREFILL_WALK, input, options),
            };
        }
        let (step, ran, ms, ran_step) = match pending {
            Pending::Empty(step) => (step, Vec::new(), None, None),
            Pending::Ran(mut r) => {
                let ran = std::mem::take(&mut r.ran);
                (r.batch.step, ran, Some(r.ms), Some(r))
            }
        };
        let done = self
            .cm
            .complete_and_assemble(step, ran, ms, next)
            .await
            .map_err(ReplayError::chunking("completing a step"))?;
        if let Some(r) = ran_step {
            self.account(*r, &done.outcome)?;
        }
        done.next.map_err(ReplayError::chunking(
            "applying a step's row changes and assembling the next step",
        ))
    }

    /// The first step (a fallback: there is no step to complete): its admissions one by one,
    /// then `assemble`.
    async fn first_batch(
        &mut self,
        changes: Vec<Change>,
        walk: usize,
    ) -> Result<Arc<Batch>, ReplayError> {
        let node = self.setup.node.as_str();
        for c in changes {
            match c {
                Change::Forget(rid) => self.cm.forget_request(rid).await,
                Change::Continue { rid, context } => {
                    self.cm
                        .continue_row_with_context(rid, node, DECODE_WALK, self.estimate, context)
                        .await
                }
                Change::Admit {
                    rid,
                    input,
                    options,
                } => {
                    self.cm
                        .admit_with(rid, node, PREFILL_WALK, input, options)
                        .await
                }
            }
            .map_err(ReplayError::chunking("applying a row change"))?;
        }
        self.assemble(walk).await
    }

    /// Assembles a step on step walk `walk` alone: the first step, or a step planned again
    /// after its rows did not fit the KV memory.
    async fn assemble(&self, walk: usize) -> Result<Arc<Batch>, ReplayError> {
        self.cm
            .assemble_at(&self.setup.node, &self.setup.walks[walk], self.t_ms)
            .await
            .map_err(ReplayError::chunking("assembling a step"))
    }

    /// Completes `pending` alone (a fallback: no step comes after it).
    async fn complete_alone(&mut self, pending: Pending) -> Result<(), ReplayError> {
        match pending {
            Pending::Empty(step) => {
                self.cm
                    .complete(step, Vec::new(), None)
                    .await
                    .map_err(ReplayError::chunking("completing an empty step"))?;
            }
            Pending::Ran(mut r) => {
                let ran = std::mem::take(&mut r.ran);
                let outcome = self
                    .cm
                    .complete(r.batch.step, ran, Some(r.ms))
                    .await
                    .map_err(ReplayError::chunking("completing a step"))?;
                self.account(*r, &outcome)?;
            }
        }
        Ok(())
    }

    fn progress_bar(&self) -> Option<ProgressBar> {
        if !self.opts.progress || !std::io::stderr().is_terminal() {
            return None;
        }
        let pb = ProgressBar::new(self.arrivals.len() as u64);
        if let Ok(style) = ProgressStyle::with_template(
            "{spinner} replay [{elapsed_precise}] {wide_bar} {pos}/{len} requests done ({eta})",
        ) {
            pb.set_style(style);
        }
        Some(pb)
    }

    /// Admits request `i` before the next step: its prompt (after a preemption, its prompt and
    /// the tokens it had generated) as a real prepared input, its cached prefix looked up.
    fn admit(&mut self, i: usize) {
        if self.role == Role::Decode && self.state[i].attempt == 0 {
            self.admit_transferred(i);
            return;
        }
        let r = &self.trace.requests[i];
        let s = &mut self.state[i];
        let n = r.input_tokens + s.generated;
        let rid = memory::component_rid(r.rid, s.attempt);
        s.phase = Phase::Prefilling;
        s.input_total = n;
        s.prefilled = 0;
        // Synthetic token ids, but a real allocation of the prompt's length.
        let base = (r.rid as u32).wrapping_mul(31);
        let ids: Arc<[u32]> = (0..n).map(|t| base.wrapping_add(t)).collect();
        let cached = match &mut self.cache {
            Some(c) => c.lookup(self.trace.hashes(r), n),
            None => 0,
        };
        // The arrival on the simulated clock, which every step's time is given on too: the
        // starvation bound's `max_wait_ms` measures waits in simulated ms.
        let options = AdmitOptions {
            cached,
            priority: r.priority,
            arrival_ms: Some(self.arrivals[i]),
        };
        self.changes.push(Change::Admit {
            rid,
            input: PreparedInput::tokens(ids),
            options,
        });
        if cached > 0 {
            self.report.chunks.prefix_cache_hits += 1;
            self.report.tokens.cached += u64::from(cached);
        }
        self.prefilling += 1;
        self.held_rows += 1;
        self.held_tokens += u64::from(n);
        self.report.peak_prepared_rows = self.report.peak_prepared_rows.max(self.held_rows);
        self.report.peak_prepared_tokens = self.report.peak_prepared_tokens.max(self.held_tokens);
    }

    /// Tokens a continuing row actually runs: its estimate, or with speculation and probability
    /// `overshoot_rate`, 1 to `k` more (the merge sized it before its input existed).
    fn continue_ran(&mut self, estimate: u32) -> u32 {
        let k = self.setup.spec_tokens;
        if k == 0 || self.setup.overshoot_rate <= 0.0 {
            return estimate;
        }
        if self.rng.gen_bool(self.setup.overshoot_rate) {
            estimate + self.rng.gen_range(1..=k)
        } else {
            estimate
        }
    }

    /// The simulated duration of `batch` as it ran (`self.ran`): the replay cost over what it
    /// ran (`docs/cost-model.md`), times a noise factor from `[1 - noise, 1 + noise]` or drawn
    /// from the `noise_bands` band of its price.
    ///
    /// Priced from the simulated engine's own truth only: continuing rows at the contexts in
    /// `self.true_contexts`, never at `row.context`, the component's estimate, which it keeps
    /// growing only when its own latency model reads it (`docs/replay.md#the-step-cost-model`).
    fn step_ms(&mut self, batch: &mstar_chunking::scheduler::Batch) -> f64 {
        let mut features = StepFeatures::EMPTY;
        for ((row, &r), &context) in batch.rows.iter().zip(&self.ran).zip(&self.true_contexts) {
            match row.work {
                RowWork::Continue { .. } => features.add_continuing(r, context),
                RowWork::Chunk { range, .. } => features.add_chunk(range.start, range.end),
            }
        }
        let ms = self.setup.cost.predict_ms(&features);
        if let Some(bands) = &self.setup.noise_bands {
            ms * super::settings::noise_factor(bands, ms, self.noise_rng.gen::<f64>())
        } else if self.setup.noise > 0.0 {
            let r = self.setup.noise;
            ms * self.noise_rng.gen_range(1.0 - r..=1.0 + r)
        } else {
            ms
        }
    }

    /// Simulates the step `batch` (assembled on step walk `walk`): its rows are given KV
    /// memory (a step that does not fit is abandoned and planned again), priced, counted and
    /// their requests advanced, with the row changes that follow gathered for the next
    /// message. Answers what the step did and what its completion reports.
    async fn step(
        &mut self,
        mut batch: Arc<Batch>,
        walk: usize,
    ) -> Result<(Stepped, Pending), ReplayError> {
        let mut decode_rows;
        let mut cuts;
        // With a KV limit, a step whose rows do not fit is abandoned after preempting, and
        // planned again (`memory.rs`).
        loop {
            if batch.rows.is_empty() {
                return Ok((Stepped::Empty, Pending::Empty(batch.step)));
            }
            self.ran.clear();
            self.true_contexts.clear();
            decode_rows = 0usize;
            cuts = false;
            for row in &batch.rows {
                let (r, context) = match row.work {
                    RowWork::Continue { estimate } => {
                        decode_rows += 1;
                        (self.continue_ran(estimate), self.true_context_of(row.rid))
                    }
                    RowWork::Chunk { range, .. } => {
                        cuts |= !range.is_final();
                        (range.tokens(), 0)
                    }
                };
                self.ran.push(r);
                self.true_contexts.push(context);
            }
            if self.kv.is_none() || self.allocate(&batch).await? {
                break;
            }
            batch = self.assemble(walk).await?;
        }
        let t_start = self.t_ms;
        let step_ms = self.step_ms(&batch);
        let t_end = t_start + step_ms;
        self.report.step_ms.record(step_ms);
        let kv_line = self.kv.as_mut().map(memory::KvState::step_line);
        // What a fleet's router sees of this worker until the step ends.
        self.in_step = self.load_now();

        let rep = &mut self.report;
        rep.steps += 1;
        rep.tokens.scheduled += batch.scheduled_tokens;
        if let Some(b) = batch.budget {
            rep.budgeted_steps += 1;
            self.budget_sum += u64::from(b);
            let used = batch.scheduled_tokens.min(u64::from(b));
            self.budget_used += used;
            if cuts {
                rep.cut_steps += 1;
                self.cut_budget_sum += u64::from(b);
                self.cut_budget_used += used;
            }
        }
        // Decode rows registered before this step that it did not run waited a step.
        if self.setup.walks[walk] != PREFILL_WALK {
            rep.decode_row_waits += self.decoding.saturating_sub(decode_rows) as u64;
        }

        for k in 0..batch.rows.len() {
            let (row, r) = (&batch.rows[k], self.ran[k]);
            let Some(i) = self.index_of(row.rid) else {
                continue;
            };
            match row.work {
                RowWork::Continue { .. } => {
                    self.report.tokens.decode += u64::from(r);
                    self.report.tokens.generated += 1;
                    let s = &mut self.state[i];
                    self.tbt.record(t_end - s.last_token_ms);
                    let priority = self.trace.requests[i].priority;
                    self.by_class.tbt(priority, t_end - s.last_token_ms);
                    s.last_token_ms = t_end;
                    s.true_context += 1;
                    s.generated += 1;
                    s.remaining = s.remaining.saturating_sub(1);
                    if s.remaining == 0 {
                        self.done_tokens +=
                            u64::from(self.trace.requests[i].input_tokens) + u64::from(s.generated);
                        s.phase = Phase::Done;
                        self.changes.push(Change::Forget(row.rid));
                        self.decoding -= 1;
                        self.done += 1;
                        self.release_kv(i);
                    }
                }
                RowWork::Chunk { range, .. } => {
                    self.report.tokens.prefill += u64::from(r);
                    self.report.chunks.total += 1;
                    self.state[i].prefilled = range.end;
                    if !range.is_final() {
                        self.state[i].cut = true;
                        continue;
                    }
                    self.first_token(i, row.rid, range.total, t_end);
                }
            }
        }
        self.t_ms = t_end;
        let done = RanStep {
            ran: std::mem::take(&mut self.ran),
            contexts: std::mem::take(&mut self.true_contexts),
            batch,
            ms: step_ms,
            t_start,
            walk,
            kv_line,
        };
        Ok((Stepped::Ran, Pending::Ran(Box::new(done))))
    }

    /// What a step's outcome adds once its completion is back: its step-log line, the tokens
    /// it ran, its overruns and the latency model in use.
    fn account(&mut self, r: RanStep, outcome: &StepOutcome) -> Result<(), ReplayError> {
        if let Some(log) = &mut self.step_log {
            log.write_with(
                r.t_start,
                &r.batch,
                &r.contexts,
                outcome,
                r.kv_line.as_ref(),
            )
            .map_err(|source| ReplayError::Write {
                what: "step log",
                path: log.path(),
                source,
            })?;
        }
        let rep = &mut self.report;
        rep.tokens.ran += outcome.tokens.ran;
        if let Some(reason) = outcome.time_overrun {
            rep.time_overruns.count(reason);
        }
        let walk = &self.setup.walks[r.walk];
        self.count_time_budget(walk, outcome.max_step_ms);
        let rep = &mut self.report;
        rep.latency_model = outcome.model.into();
        if let Some(o) = &outcome.overrun {
            let c = &mut rep.overruns;
            c.total += 1;
            match o.reason {
                OverrunReason::UncutRow => c.uncut_row += 1,
                OverrunReason::SpeculationEstimate => c.speculation_estimate += 1,
                OverrunReason::Other => c.other += 1,
            }
        }
        // The buffers are reused by the next step.
        self.ran = r.ran;
        self.true_contexts = r.contexts;
        Ok(())
    }

    /// The true context of `rid`'s continuing row (0 for a rid the trace does not have).
    fn true_context_of(&self, rid: u64) -> u64 {
        self.index_of(rid).map_or(0, |i| self.state[i].true_context)
    }

    /// A prompt's final chunk ran: its prepared input is released, its first token is out, and
    /// it continues as a decode row before the next step if it generates more.
    fn first_token(&mut self, i: usize, rid: u64, total: u32, t_end: f64) {
        let req = &self.trace.requests[i];
        self.report.chunks.final_chunks += 1;
        self.report.tokens.generated += 1;
        // Counted at its first final chunk after a cut, once: a recompute's final chunk is
        // the same prompt's.
        let s = &mut self.state[i];
        if s.cut && !s.cut_counted {
            s.cut_counted = true;
            self.report.chunks.prompts_cut += 1;
        }
        self.prefilling -= 1;
        self.held_rows -= 1;
        self.held_tokens -= u64::from(total);
        let recompute = self.state[i].generated > 0;
        if recompute {
            // A preempted request's prefill of its prompt and generated tokens yields its
            // next token: a time between tokens, not a first token.
            self.tbt.record(t_end - self.state[i].last_token_ms);
            self.by_class
                .tbt(req.priority, t_end - self.state[i].last_token_ms);
        } else {
            self.ttft.push(t_end - self.arrivals[i]);
            self.by_class.ttft(req.priority, t_end - self.arrivals[i]);
        }
        if let Some(c) = &mut self.cache {
            c.insert_at(self.trace.hashes(req), t_end);
        }
        self.fit_cache();
        let s = &mut self.state[i];
        s.last_token_ms = t_end;
        // The whole prompt (a cached prefix included; for a recompute, the tokens generated
        // before it too) and the first token, just generated: prompt + tokens generated.
        s.true_context = u64::from(total) + 1;
        if recompute {
            s.remaining = s.remaining.saturating_sub(1);
        } else {
            s.remaining = req.output_tokens.saturating_sub(1);
        }
        s.generated += 1;
        if s.remaining == 0 {
            self.done_tokens += u64::from(req.input_tokens) + u64::from(s.generated);
            s.phase = Phase::Done;
            self.done += 1;
            self.release_kv(i);
            return;
        }
        if self.role == Role::Prefill {
            self.hand_off(i, rid, t_end);
            return;
        }
        s.phase = Phase::Decoding;
        let context = s.true_context;
        self.changes.push(Change::Continue { rid, context });
        self.decoding += 1;
    }

    fn finish(mut self) -> Result<ReplayReport, ReplayError> {
        if let Some(StepSink::Own(log)) = self.step_log.take() {
            let path = log.path().to_owned();
            log.finish().map_err(|source| ReplayError::Write {
                what: "step log",
                path,
                source,
            })?;
        }
        Ok(self.into_tally().finish())
    }

    /// What the simulation counted, before the figures that need every sample: for its own
    /// report, or for a fleet to pool with its other workers'.
    pub(crate) fn into_tally(self) -> Tally {
        Tally {
            first_arrival_ms: self.arrivals.first().copied().unwrap_or(0.0),
            end_ms: self.t_ms,
            report: self.report,
            budget_sum: self.budget_sum,
            budget_used: self.budget_used,
            cut_budget_sum: self.cut_budget_sum,
            cut_budget_used: self.cut_budget_used,
            ttft: self.ttft,
            tbt: self.tbt,
            by_class: self.by_class,
            kv: self.kv,
        }
    }
}

/// Why a time budget was not in force: the component had no latency model it trusted.
fn inactive_reason(setup: &super::ReplaySetup) -> String {
    use mstar_chunking::latency::fit::{DEFAULT_MAX_RELATIVE_RMS, DEFAULT_MIN_SAMPLES};
    let mut why = format!(
        "no trusted latency model: the online fit is trusted after {DEFAULT_MIN_SAMPLES} steps with a relative RMS error of at most {}% (docs/fitting.md)",
        DEFAULT_MAX_RELATIVE_RMS * 100.0
    );
    if setup.noise > 0.0 {
        why.push_str(&format!(
            " (the replay's cost noise is ±{}%)",
            setup.noise * 100.0
        ));
    } else if setup.noise_bands.is_some() {
        why.push_str(" (the replay's cost noise is drawn from `noise_bands`)");
    }
    why
}
