//! The engine's calls on [`SchedulerState`] as a whole: admissions with their prepared inputs,
//! forgets, assemblies that cut chunk views, completions, the one-trip step with its repeat
//! answer, and the drain. The Scheduler actor receives each message and calls one method here;
//! what it does around the call (spans, metric handles, reports to the other actors) it does in
//! [`StepHooks`], which the methods call at the points where the state changed.
//!
//! These methods carry the facade's verbs (`admit`, `continue_row`, `forget_request`,
//! `release`, `assemble`, `complete`, `complete_and_assemble`, `drain`) and move prepared
//! inputs and hooks; each wraps one of the plain state's methods in `scheduler.rs`, named for
//! what it does to the queues and plans alone (`queue_prompt`, `queue_continuing`,
//! `drop_rows`, `drop_row`, `plan_step`, `close_step`, `drop_all`).
//!
//! The state owns every prepared input ([`PreparedStore`]); each change to the store is also
//! recorded as an [`InputChange`], which the actor sends to PreparedInputs' accounting after
//! the call (`docs/actors.md#prepared-inputs`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{
    Assembled, Batch, Completed, InFlight, NextStep, RowChange, SchedulerState, StepOutcome, Then,
};
use crate::error::ChunkingError;
use crate::order::AdmitOptions;
use crate::policy::Name;
use crate::prepared::{InputChange, PreparedInput};

/// What the actor shell does when the state changes: spans, metrics and the reports to other
/// actors. Every method has a no-op default; `()` is the shell of a test or a benchmark.
pub(crate) trait StepHooks {
    /// A row of `rid` was queued on `node`/`walk` (a prompt admitted or a continuing row).
    fn admitted(&mut self, _rid: u64, _node: &Name, _walk: &Name) {}
    /// Request `rid` was forgotten.
    fn forgotten(&mut self, _rid: u64) {}
    /// A step was planned in `planned_in`; `in_flight(step)` says whether an older step is
    /// still in flight.
    fn assembled(
        &mut self,
        _batch: &Batch,
        _planned_in: Duration,
        _in_flight: &dyn Fn(u64) -> bool,
    ) {
    }
    /// Step `step` was abandoned while its inputs were cut, for `why`.
    fn abandoned(&mut self, _step: u64, _why: &ChunkingError) {}
    /// A step completed (its finished rows' inputs are released after this).
    fn completed(&mut self, _outcome: &StepOutcome) {}
    /// The completion of step `step` was refused; nothing changed.
    fn completion_refused(&mut self, _step: u64, _why: &ChunkingError) {}
    /// A row change sent with the completion of step `step` was refused (the ones before it
    /// stand).
    fn change_refused(&mut self, _step: u64, _why: &ChunkingError) {}
    /// The queues of `node` changed (`None`: possibly of every node).
    fn queues_changed(&mut self, _state: &SchedulerState, _node: Option<&Name>) {}
    /// A step of `node`/`assembled` came out empty while prompt rows of `node` wait on
    /// `waiting`, a walk no step of `assembled` takes: said once per
    /// `(node, waiting, assembled)`.
    fn stranded(&mut self, _node: &Name, _waiting: &Name, _assembled: &Name) {}
}

impl StepHooks for () {}

/// The warning for prompt rows of `node` that wait on `waiting`, a walk no step of
/// `node`/`assembled` takes: both walks named, and the two ways out.
pub(crate) fn stranded_message(node: &str, waiting: &str, assembled: &str) -> String {
    format!(
        "prompt rows of `{node}` wait on walk `{waiting}`, which no step of `{node}`/`{assembled}` \
         takes: run `{waiting}` inside `{assembled}` (`BudgetSettings::combined`, or the model \
         manifest's combined walks) or assemble `{node}`/`{waiting}` too"
    )
}

/// A step completed by [`SchedulerState::complete_and_assemble`], as reported and as it came
/// out, to answer a repeat of it.
#[derive(Debug)]
pub(crate) struct LastCompleted {
    step: u64,
    ran: Vec<u32>,
    measured_ms: Option<f64>,
    outcome: StepOutcome,
    /// The row change refused after the completion, if one was.
    refused: Option<ChunkingError>,
    /// The walk of the step assembled after it, for a repeat that names no next step.
    next_walk: Name,
}

/// What a drain dropped (`ChunkingManagement::drain`); all zero when the engine completed or
/// forgot everything first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DrainReport {
    /// Steps still in flight, abandoned (their rows did not advance).
    pub steps_abandoned: usize,
    /// Requests that still had a row queued, dropped.
    pub requests: usize,
    /// Rows still queued, prefill and continuing, over all nodes, dropped.
    pub rows: usize,
    /// Whole prepared inputs still held, released.
    pub prepared_inputs: usize,
    /// Their tokens.
    pub prepared_tokens: u64,
}

/// Rows queued over all nodes, and steps in flight ([`crate::ChunkingManagement::queue_stats`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct QueueStats {
    /// Prefill rows queued (each holds a prepared input), waiting or mid-prefill.
    pub prefill_rows: usize,
    /// Of those, rows with at least one completed chunk.
    pub mid_prefill_rows: usize,
    /// Continuing rows queued.
    pub continuing_rows: usize,
    /// Steps assembled and neither completed nor abandoned.
    pub steps_in_flight: usize,
}

impl SchedulerState {
    /// Admits a prompt whole: measures its input, queues its row (with its cached prefix,
    /// priority and arrival time) and holds the input. A refused admission (draining, a bad
    /// input, a second row of `(rid, node)`) queues and holds nothing.
    ///
    /// # Errors
    /// Draining, or as [`PreparedInput::measure`] and [`SchedulerState::queue_prompt`].
    pub(crate) fn admit(
        &mut self,
        rid: u64,
        node: &Name,
        walk: &Name,
        input: PreparedInput,
        options: AdmitOptions,
        hooks: &mut impl StepHooks,
    ) -> Result<(), ChunkingError> {
        if self.draining {
            return Err(ChunkingError::Draining);
        }
        self.admit_input(rid, node, walk, input, options, hooks)?;
        hooks.queues_changed(self, Some(node));
        Ok(())
    }

    /// Queues the prompt row of `rid` at `node` and holds its input; on error nothing is
    /// queued or held.
    fn admit_input(
        &mut self,
        rid: u64,
        node: &Name,
        walk: &Name,
        input: PreparedInput,
        options: AdmitOptions,
        hooks: &mut impl StepHooks,
    ) -> Result<(), ChunkingError> {
        let total = input.measure(rid, node)?;
        self.queue_prompt(rid, node, walk, total, options)?;
        // The queue refuses a second row of `(rid, node)`, and a row's input is dropped with
        // its row: an input is never held here already.
        if let Err(e) = self.inputs.insert(rid, node, input) {
            self.drop_row(rid, node);
            return Err(e);
        }
        self.input_changes.push(InputChange::Hold {
            rid,
            node: node.clone(),
            tokens: total,
        });
        hooks.admitted(rid, node, walk);
        Ok(())
    }

    /// Queues a continuing row of `rid` at `node` (or updates its estimate and context).
    ///
    /// # Errors
    /// Draining, or as [`SchedulerState::queue_continuing`].
    pub(crate) fn continue_row(
        &mut self,
        rid: u64,
        node: &Name,
        walk: &Name,
        estimate: u32,
        context: Option<u64>,
        hooks: &mut impl StepHooks,
    ) -> Result<(), ChunkingError> {
        if self.draining {
            return Err(ChunkingError::Draining);
        }
        self.queue_continuing(rid, node, walk, estimate, context)?;
        hooks.admitted(rid, node, walk);
        hooks.queues_changed(self, Some(node));
        Ok(())
    }

    /// Ends request `rid`: drops its rows and inputs on every node.
    pub(crate) fn forget_request(&mut self, rid: u64, hooks: &mut impl StepHooks) {
        self.forget_everywhere(rid, hooks);
        hooks.queues_changed(self, None);
    }

    fn forget_everywhere(&mut self, rid: u64, hooks: &mut impl StepHooks) {
        hooks.forgotten(rid);
        self.drop_rows(rid);
        self.inputs.forget(rid);
        self.input_changes.push(InputChange::Forget(rid));
    }

    /// Drops the row of `rid` at `node` and its input there (the request leaves the node);
    /// answers whether a prefill row was dropped.
    pub(crate) fn release(&mut self, rid: u64, node: &Name, hooks: &mut impl StepHooks) -> bool {
        let had_prefill = self.drop_row(rid, node);
        self.release_inputs(node, &[rid]);
        hooks.queues_changed(self, Some(node));
        had_prefill
    }

    /// Drops the inputs of `rids` at `node`.
    fn release_inputs(&mut self, node: &Name, rids: &[u64]) {
        for &rid in rids {
            self.inputs.release(rid, node);
            self.input_changes.push(InputChange::Release {
                rid,
                node: node.clone(),
            });
        }
    }

    /// The whole input held for `(rid, node)` (a cheap clone of its `Arc`s).
    pub(crate) fn prepared(&self, rid: u64, node: &str) -> Option<PreparedInput> {
        self.inputs.get(rid, node).cloned()
    }

    /// The changes made to the inputs held since the last call, in order, for PreparedInputs'
    /// accounting; `None` when there were none.
    pub(crate) fn take_input_changes(&mut self) -> Option<Vec<InputChange>> {
        if self.input_changes.is_empty() {
            return None;
        }
        // The next message's changes start with room for as many.
        let room = Vec::with_capacity(self.input_changes.len());
        Some(std::mem::replace(&mut self.input_changes, room))
    }

    /// Plans the next step of `node`/`walk` (or finds it in flight) at `now_ms` on the
    /// engine's clock if given, as [`SchedulerState::plan_step`] does, and cuts its chunks'
    /// views from the inputs held. A chunk row without an input (a guard: the store and the
    /// queues never disagree through the API) abandons the step and drops that row.
    ///
    /// # Errors
    /// Draining, as [`SchedulerState::plan_step`], or `MissingPreparedInput`.
    pub(crate) fn assemble(
        &mut self,
        node: &str,
        walk: &str,
        now_ms: Option<f64>,
        hooks: &mut impl StepHooks,
    ) -> Result<Arc<Batch>, ChunkingError> {
        if self.draining {
            return Err(ChunkingError::Draining);
        }
        let started = Instant::now();
        let mut batch = match self.plan_step(node, walk, now_ms)? {
            Assembled::InFlight(batch) => return Ok(batch),
            Assembled::Planned(batch) => batch,
        };
        let took = started.elapsed();
        if batch.rows.is_empty() {
            self.check_stranded(&batch)?;
        } else if !self.stranded_last.is_empty() {
            self.stranded_last.remove(&batch.node);
        }
        hooks.assembled(&batch, took, &|step| self.node_of_step(step).is_some());
        if batch.rows.is_empty() {
            self.say_stranded(&batch, hooks);
        }
        let missing = batch.cut_inputs(self.inputs.node(&batch.node));
        if let Some(&rid) = missing.first() {
            let (step, node) = (batch.step, batch.node.clone());
            self.abandon(step, &missing)?;
            self.release_inputs(&node, &missing);
            hooks.queues_changed(self, Some(&node));
            let e = ChunkingError::MissingPreparedInput { rid, node };
            hooks.abandoned(step, &e);
            return Err(e);
        }
        let batch = self.share(batch);
        self.hold(batch.clone());
        Ok(batch)
    }

    /// On an empty step: refuses it when the node's previous step was an empty one of the same
    /// walk with rows waiting on walks it does not take, and rows still wait so
    /// (`StrandedRows`, naming those walks; the empty step is dropped). An engine that
    /// assembles the rows' walks between, or changes the settings, is never refused.
    fn check_stranded(&mut self, batch: &Batch) -> Result<(), ChunkingError> {
        let waiting = self.stranded_walks(batch);
        if waiting.is_empty() {
            self.stranded_last.remove(&batch.node);
            return Ok(());
        }
        if self.stranded_last.get(&batch.node) == Some(&batch.walk) {
            self.empty.remove(&batch.node);
            return Err(ChunkingError::StrandedRows {
                node: batch.node.clone(),
                walk: batch.walk.clone(),
                waiting,
            });
        }
        self.stranded_last
            .insert(batch.node.clone(), batch.walk.clone());
        Ok(())
    }

    /// The walks rows of the node wait on that `batch`'s step does not take, each once:
    /// prompt rows' in queue order, then continuing rows'.
    fn stranded_walks(&self, batch: &Batch) -> Vec<Name> {
        let Some(queues) = self.nodes.get(&batch.node) else {
            return Vec::new();
        };
        let rows = queues.prefill().iter().map(|r| &r.walk);
        let mut waiting: Vec<Name> = Vec::new();
        for walk in rows.chain(queues.cont().iter().map(|r| &r.walk)) {
            if !batch.walks.contains(walk) && !waiting.contains(walk) {
                waiting.push(walk.clone());
            }
        }
        waiting
    }

    /// On an empty step: the first prompt row of the node waiting on a walk the step does not
    /// take is said once (an engine that alternates walks may see it once too; the message
    /// names both fixes). Only empty steps look: the check costs nothing on a step that runs.
    fn say_stranded(&mut self, batch: &Batch, hooks: &mut impl StepHooks) {
        let Some(queues) = self.nodes.get(&batch.node) else {
            return;
        };
        let waiting = queues
            .prefill()
            .iter()
            .map(|r| &r.walk)
            .find(|w| !batch.walks.contains(w));
        if let Some(waiting) = waiting {
            let key = (batch.node.clone(), waiting.clone(), batch.walk.clone());
            if self.stranded_said.insert(key) {
                hooks.stranded(&batch.node, waiting, &batch.walk);
            }
        }
    }

    /// Completes step `step` as [`SchedulerState::close_step`] does, and releases the inputs
    /// of the rows that finished.
    ///
    /// # Errors
    /// As [`SchedulerState::close_step`]; nothing changes.
    pub(crate) fn complete(
        &mut self,
        step: u64,
        ran: &[u32],
        measured_ms: Option<f64>,
        hooks: &mut impl StepHooks,
    ) -> Result<StepOutcome, ChunkingError> {
        let outcome = self
            .close_step(step, ran, measured_ms)
            .inspect_err(|e| hooks.completion_refused(step, e))?;
        self.completed_step(&outcome, hooks);
        hooks.queues_changed(self, Some(&outcome.node));
        Ok(outcome)
    }

    fn completed_step(&mut self, outcome: &StepOutcome, hooks: &mut impl StepHooks) {
        hooks.completed(outcome);
        if !outcome.finished.is_empty() {
            self.release_inputs(&outcome.node, &outcome.finished);
        }
    }

    /// Completes step `step` (as [`SchedulerState::complete`]) and assembles the step `then`
    /// names (as [`SchedulerState::assemble`]): the engine's one call per step. With
    /// [`Then::Next`], `step` must be of its node, and its row changes are applied in order
    /// between the two; with [`Then::Same`] or [`Then::SameAt`], the next step is of the
    /// completed step's node and walk, with no row changes (a repeat of a step completed last
    /// on its node assembles the walk its first call did).
    ///
    /// A repeat for the step it completed last on the node (its answer was lost) is not applied
    /// again: it gets the same outcome, and the next step as `assemble` answers it then (the
    /// same batch while that step is in flight). A repeat with other `ran` counts or another
    /// measured time is refused.
    ///
    /// # Errors
    /// The step is not in flight on the next step's node (or, with [`Then::Same`], neither in
    /// flight nor the last step completed on its node), the next walk is not one the node
    /// serves, the completion is refused (nothing changes), or a repeat differs. A refused row
    /// change or a failed assembly is not an error: it is the answer's `next`.
    pub(crate) fn complete_and_assemble(
        &mut self,
        step: u64,
        ran: Vec<u32>,
        measured_ms: Option<f64>,
        then: Then,
        hooks: &mut impl StepHooks,
    ) -> Result<Completed, ChunkingError> {
        let next = match then {
            Then::Next(next) => next,
            Then::Same => self.same_next(step, None)?,
            Then::SameAt(now_ms) => self.same_next(step, Some(now_ms))?,
        };
        let (node, walk, now_ms) = (next.node.clone(), next.walk.clone(), next.now_ms);
        let (outcome, refused) = match self.completed.get(&*node) {
            Some(last) if last.step == step => {
                let same_ms = last.measured_ms.map(f64::to_bits) == measured_ms.map(f64::to_bits);
                if last.ran != ran || !same_ms {
                    return Err(ChunkingError::CompletedDifferently { step });
                }
                (last.outcome.clone(), last.refused.clone())
            }
            _ => {
                // The step must be of the node named for the next one, and the next step's walk
                // one the node serves: checked before anything changes.
                if self.node_of_step(step) != Some(&node) {
                    return Err(ChunkingError::UnknownStep { step });
                }
                if let Some(snap) = self.snapshot() {
                    if snap.step_params(&node, &walk).is_none() {
                        return Err(ChunkingError::UnknownWalk { node, walk });
                    }
                }
                let mut outcome = self
                    .close_step(step, &ran, measured_ms)
                    .inspect_err(|e| hooks.completion_refused(step, e))?;
                self.completed_step(&outcome, hooks);
                let refused = self.apply_changes(next, hooks).err();
                if let Some(e) = &refused {
                    hooks.change_refused(step, e);
                }
                self.remember_completed(step, ran, measured_ms, &walk, &mut outcome, &refused);
                (outcome, refused)
            }
        };
        let next = match refused {
            Some(e) => Err(e),
            None => self.assemble(&node, &walk, now_ms, hooks),
        };
        Ok(Completed { outcome, next })
    }

    /// The next step of step `step`'s node and walk, with no row changes.
    fn same_next(&self, step: u64, now_ms: Option<f64>) -> Result<NextStep, ChunkingError> {
        let of_step = |f: &InFlight| (f.params.node.clone(), f.params.walk.clone());
        let (node, walk) = [&self.in_flight, &self.empty]
            .into_iter()
            .flat_map(|steps| steps.values())
            .find(|f| f.step == step)
            .map(of_step)
            .or_else(|| {
                self.completed
                    .iter()
                    .find(|(_, last)| last.step == step)
                    .map(|(node, last)| (node.clone(), last.next_walk.clone()))
            })
            .ok_or(ChunkingError::UnknownStep { step })?;
        Ok(NextStep {
            node,
            walk,
            changes: Vec::new(),
            now_ms,
        })
    }

    /// Keeps what step `step` was completed with and what came out, for a repeat of it.
    fn remember_completed(
        &mut self,
        step: u64,
        ran: Vec<u32>,
        measured_ms: Option<f64>,
        next_walk: &Name,
        outcome: &mut StepOutcome,
        refused: &Option<ChunkingError>,
    ) {
        match self.completed.get_mut(&outcome.node) {
            // Updated in place: the node's entry, and its vectors' room, are reused.
            Some(last) => {
                last.step = step;
                last.ran = ran;
                last.measured_ms = measured_ms;
                // The outcome is cloned without its `finished`, copied into the room of the
                // last one's.
                let finished = std::mem::take(&mut outcome.finished);
                let mut room = std::mem::take(&mut last.outcome.finished);
                room.clone_from(&finished);
                last.outcome = outcome.clone();
                last.outcome.finished = room;
                outcome.finished = finished;
                last.refused.clone_from(refused);
                if !Arc::ptr_eq(&last.next_walk, next_walk) {
                    last.next_walk = next_walk.clone();
                }
            }
            None => {
                let last = LastCompleted {
                    step,
                    ran,
                    measured_ms,
                    outcome: outcome.clone(),
                    refused: refused.clone(),
                    next_walk: next_walk.clone(),
                };
                self.completed.insert(outcome.node.clone(), last);
            }
        }
    }

    /// Applies `next`'s row changes in order and stops at the first refused one, which it
    /// answers (while draining, every change but a forget is refused).
    fn apply_changes(
        &mut self,
        next: NextStep,
        hooks: &mut impl StepHooks,
    ) -> Result<(), ChunkingError> {
        let NextStep { node, changes, .. } = next;
        let mut forgot = false;
        let mut result = Ok(());
        for change in changes {
            if self.draining && !matches!(change, RowChange::Forget(_)) {
                result = Err(ChunkingError::Draining);
                break;
            }
            result = match change {
                RowChange::Forget(rid) => {
                    self.forget_everywhere(rid, hooks);
                    forgot = true;
                    Ok(())
                }
                RowChange::Continue {
                    rid,
                    walk,
                    estimate,
                    context,
                } => self
                    .queue_continuing(rid, &node, &walk, estimate, context)
                    .inspect(|()| hooks.admitted(rid, &node, &walk)),
                RowChange::Admit {
                    rid,
                    walk,
                    input,
                    options,
                } => self.admit_input(rid, &node, &walk, input, options, hooks),
            };
            if result.is_err() {
                break;
            }
        }
        hooks.queues_changed(self, if forgot { None } else { Some(&node) });
        result
    }

    /// Starts a drain: from now on no request is admitted and no step assembled; completions,
    /// abandons and forgets are still applied. Answers the steps in flight.
    pub(crate) fn begin_drain(&mut self) -> usize {
        self.draining = true;
        self.steps_in_flight()
    }

    /// Ends a drain: abandons the steps still in flight, drops every row and every input held;
    /// answers what was dropped.
    pub(crate) fn drain(&mut self, hooks: &mut impl StepHooks) -> DrainReport {
        self.draining = true;
        let drained = self.drop_all();
        self.completed.clear();
        let (prepared_inputs, prepared_tokens) = self.inputs.clear();
        // PreparedInputs' accounting is cleared whole (`ReleaseAll`), not change by change.
        self.input_changes.clear();
        hooks.queues_changed(self, None);
        DrainReport {
            steps_abandoned: drained.steps,
            requests: drained.requests,
            rows: drained.rows,
            prepared_inputs,
            prepared_tokens,
        }
    }

    /// Rows queued over all nodes, and steps in flight.
    pub(crate) fn stats(&self) -> QueueStats {
        let mut stats = QueueStats {
            steps_in_flight: self.steps_in_flight(),
            ..QueueStats::default()
        };
        for n in self.node_names() {
            let c = self.node(n).map(|q| q.counts()).unwrap_or_default();
            stats.prefill_rows += c.waiting + c.mid_prefill;
            stats.mid_prefill_rows += c.mid_prefill;
            stats.continuing_rows += c.continuing;
        }
        stats
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::budget::BudgetTable;
    use crate::policy::{ChunkingPolicy, ModelPolicies, SubmoduleCaps};
    use crate::snapshot::BudgetSnapshot;

    /// Admits `input` as `rid`'s prompt with nothing cached and no priority or arrival time.
    fn admit_uncached(
        s: &mut SchedulerState,
        rid: u64,
        node: &Name,
        walk: &Name,
        input: PreparedInput,
        hooks: &mut impl StepHooks,
    ) -> Result<(), ChunkingError> {
        s.admit(rid, node, walk, input, AdmitOptions::cached(0), hooks)
    }

    /// One node `llm` serving `prefill` with a budget of 8.
    fn state() -> SchedulerState {
        let subs = BTreeMap::from([(Name::from("llm"), SubmoduleCaps::new(["prefill"], false))]);
        let pols = BTreeMap::from([(
            (Name::from("llm"), Name::from("prefill")),
            ChunkingPolicy::budget(8),
        )]);
        let model = ModelPolicies::new(subs, pols).unwrap().shared();
        let mut s = SchedulerState::default();
        s.set_snapshot(Arc::new(BudgetSnapshot::new(
            BudgetTable::from_policies(model),
            1,
        )));
        s
    }

    /// A state for these nodes and `(node, walk, budget)` policies under `settings`.
    fn state_of(
        subs: &[(&str, SubmoduleCaps)],
        pols: &[(&str, &str, u32)],
        settings: crate::budget::BudgetSettings,
    ) -> SchedulerState {
        let subs = subs
            .iter()
            .map(|(n, c)| (Name::from(*n), c.clone()))
            .collect();
        let pols = pols
            .iter()
            .map(|&(n, w, b)| ((Name::from(n), Name::from(w)), ChunkingPolicy::budget(b)))
            .collect();
        let model = ModelPolicies::new(subs, pols).unwrap().shared();
        SchedulerState::with_table(
            BudgetTable::from_policies(model)
                .with_settings(settings)
                .unwrap(),
        )
    }

    /// Every hook call, in order, as text.
    #[derive(Default)]
    struct Recorded(Vec<String>);

    impl StepHooks for Recorded {
        fn admitted(&mut self, rid: u64, node: &Name, walk: &Name) {
            self.0.push(format!("admitted {rid} {node}/{walk}"));
        }
        fn forgotten(&mut self, rid: u64) {
            self.0.push(format!("forgotten {rid}"));
        }
        fn assembled(&mut self, batch: &Batch, _: Duration, in_flight: &dyn Fn(u64) -> bool) {
            let older = in_flight(batch.step.saturating_sub(1));
            self.0
                .push(format!("assembled {} older {older}", batch.step));
        }
        fn abandoned(&mut self, step: u64, why: &ChunkingError) {
            self.0.push(format!("abandoned {step}: {why}"));
        }
        fn completed(&mut self, outcome: &StepOutcome) {
            self.0
                .push(format!("completed {} {:?}", outcome.step, outcome.finished));
        }
        fn completion_refused(&mut self, step: u64, _: &ChunkingError) {
            self.0.push(format!("completion refused {step}"));
        }
        fn change_refused(&mut self, step: u64, _: &ChunkingError) {
            self.0.push(format!("change refused {step}"));
        }
        fn queues_changed(&mut self, state: &SchedulerState, node: Option<&Name>) {
            let rows = state.prefill_rows();
            self.0.push(format!("queues {node:?} {rows}"));
        }
        fn stranded(&mut self, node: &Name, waiting: &Name, assembled: &Name) {
            self.0
                .push(format!("stranded {node} {waiting} {assembled}"));
        }
    }

    fn tokens(n: usize, v: u32) -> PreparedInput {
        PreparedInput::tokens(vec![v; n])
    }

    fn llm() -> (Name, Name) {
        (Name::from("llm"), Name::from("prefill"))
    }

    #[test]
    fn a_refused_admission_queues_and_holds_nothing_and_changes_nothing() {
        let mut s = state();
        let (node, walk) = llm();
        let mut h = Recorded::default();
        admit_uncached(&mut s, 3, &node, &walk, tokens(3, 1), &mut h).unwrap();
        let again = admit_uncached(&mut s, 3, &node, &walk, tokens(5, 9), &mut h);
        assert!(matches!(
            again,
            Err(ChunkingError::AlreadyQueued { rid: 3, .. })
        ));
        let empty = admit_uncached(&mut s, 4, &node, &walk, tokens(0, 0), &mut h);
        assert!(matches!(
            empty,
            Err(ChunkingError::EmptyInput { rid: 4, .. })
        ));
        let ghost = admit_uncached(&mut s, 5, &node, &Name::from("ghost"), tokens(2, 0), &mut h);
        assert!(ghost.is_err());
        assert!(
            s.prepared(5, "llm").is_none(),
            "a refused walk holds nothing"
        );
        assert_eq!(h.0, ["admitted 3 llm/prefill", "queues Some(\"llm\") 1"]);
        assert_eq!(s.prepared(3, "llm"), Some(tokens(3, 1)));
        assert_eq!((s.inputs.rows(), s.inputs.tokens()), (1, 3));
        assert_eq!(
            s.take_input_changes().unwrap(),
            [InputChange::Hold {
                rid: 3,
                node: node.clone(),
                tokens: 3
            }]
        );
        assert_eq!(s.take_input_changes(), None, "taken once");
        assert_eq!(s.stats().prefill_rows, 1);
    }

    #[test]
    fn forgets_and_releases_are_recorded_in_order_and_drop_the_inputs() {
        let mut s = state();
        let (node, walk) = llm();
        for rid in [1, 2, 3] {
            s.admit(
                rid,
                &node,
                &walk,
                tokens(10, 0),
                AdmitOptions::cached(0),
                &mut (),
            )
            .unwrap();
        }
        s.take_input_changes();
        let mut h = Recorded::default();
        s.forget_request(1, &mut h);
        assert!(s.release(2, &node, &mut h));
        assert!(!s.release(2, &node, &mut h));
        assert_eq!(
            h.0,
            [
                "forgotten 1",
                "queues None 2",
                "queues Some(\"llm\") 1",
                "queues Some(\"llm\") 1"
            ]
        );
        let release = InputChange::Release {
            rid: 2,
            node: node.clone(),
        };
        assert_eq!(
            s.take_input_changes().unwrap(),
            [InputChange::Forget(1), release.clone(), release]
        );
        assert_eq!((s.inputs.rows(), s.inputs.tokens()), (1, 10));
        assert!(s.prepared(1, "llm").is_none() && s.prepared(2, "llm").is_none());
    }

    #[test]
    fn a_chunk_without_input_abandons_its_step_drops_the_row_and_the_next_one_runs() {
        let mut s = state();
        let (node, walk) = llm();
        for rid in [1, 2] {
            let input = PreparedInput::tokens((0..10).collect::<Vec<u32>>());
            s.admit(rid, &node, &walk, input, AdmitOptions::cached(0), &mut ())
                .unwrap();
        }
        s.take_input_changes();
        assert!(s.inputs.release(1, "llm"));
        let mut h = Recorded::default();
        let err = s.assemble("llm", "prefill", None, &mut h).unwrap_err();
        assert!(
            matches!(err, ChunkingError::MissingPreparedInput { rid: 1, .. }),
            "{err}"
        );
        assert_eq!(h.0.len(), 3, "{:?}", h.0);
        assert!(h.0[2].starts_with("abandoned 1: "), "{:?}", h.0);
        assert_eq!(
            s.take_input_changes().unwrap(),
            [InputChange::Release { rid: 1, node }]
        );
        let batch = s.assemble("llm", "prefill", None, &mut ()).unwrap();
        assert_eq!(batch.rows.len(), 1);
        assert_eq!(batch.rows[0].rid, 2);
        let input = batch.rows[0].input.as_ref().expect("the chunk is cut");
        assert_eq!(input.token_ids(), &[0, 1, 2, 3, 4, 5, 6, 7]);
        let again = s.assemble("llm", "prefill", None, &mut h).unwrap();
        assert!(Arc::ptr_eq(&batch, &again), "the step in flight, again");
        assert_eq!((s.stats().prefill_rows, s.stats().steps_in_flight), (1, 1));
    }

    #[test]
    fn a_completion_releases_what_finished_and_a_refused_one_changes_nothing() {
        let mut s = state();
        let (node, walk) = llm();
        s.admit(
            1,
            &node,
            &walk,
            tokens(8, 1),
            AdmitOptions::cached(0),
            &mut (),
        )
        .unwrap();
        let step = s.assemble("llm", "prefill", None, &mut ()).unwrap().step;
        s.take_input_changes();
        let mut h = Recorded::default();
        assert!(s.complete(step, &[8, 8], None, &mut h).is_err());
        assert_eq!(h.0, [format!("completion refused {step}")]);
        assert_eq!(s.take_input_changes(), None);
        let out = s.complete(step, &[8], Some(1.0), &mut h).unwrap();
        assert_eq!(out.finished, [1]);
        assert_eq!(
            h.0[1..],
            [
                format!("completed {step} [1]"),
                "queues Some(\"llm\") 0".into()
            ]
        );
        assert_eq!(
            s.take_input_changes().unwrap(),
            [InputChange::Release { rid: 1, node }]
        );
        assert!(s.prepared(1, "llm").is_none());
    }

    #[test]
    fn a_one_trip_step_is_answered_again_on_a_repeat_and_refused_when_it_differs() {
        let mut s = state();
        let (node, walk) = llm();
        s.admit(
            1,
            &node,
            &walk,
            tokens(8, 1),
            AdmitOptions::cached(0),
            &mut (),
        )
        .unwrap();
        let step = s.assemble("llm", "prefill", None, &mut ()).unwrap().step;
        let next = NextStep::new("llm", "prefill")
            .admit(2, "prefill", tokens(5, 2), 0)
            .continue_row_with_context(9, "prefill", 1, 40);
        let mut h = Recorded::default();
        let done = s
            .complete_and_assemble(step, vec![8], Some(3.0), Then::Next(next.clone()), &mut h)
            .unwrap();
        assert_eq!(done.outcome.finished, [1]);
        let batch = done.next.clone().unwrap();
        let rows: Vec<u64> = batch.rows.iter().map(|r| r.rid).collect();
        assert_eq!(rows, [9, 2], "continuing rows first");
        assert_eq!(batch.rows[1].input.as_ref().unwrap().token_ids(), &[2; 5]);
        assert_eq!(batch.rows[0].context, 40);
        assert_eq!(
            (s.inputs.rows(), s.inputs.tokens()),
            (1, 5),
            "1 released, 2 held"
        );
        let calls = h.0.len();

        // A repeat (the answer was lost) is answered again, changing nothing.
        let again = s
            .complete_and_assemble(step, vec![8], Some(3.0), Then::Next(next.clone()), &mut h)
            .unwrap();
        assert_eq!(again.outcome, done.outcome);
        assert!(Arc::ptr_eq(&again.next.unwrap(), &batch));
        assert_eq!(h.0.len(), calls, "no hook runs for a repeat");
        assert_eq!((s.inputs.rows(), s.inputs.tokens()), (1, 5));
        for (ran, ms) in [(vec![0], Some(3.0)), (vec![8], Some(4.0)), (vec![8], None)] {
            let err = s
                .complete_and_assemble(step, ran, ms, Then::Next(next.clone()), &mut h)
                .unwrap_err();
            assert!(
                matches!(err, ChunkingError::CompletedDifferently { .. }),
                "{err}"
            );
        }
        // A step that is not in flight on the node is unknown; a walk the node does not serve
        // is refused before anything changes.
        let plain = NextStep::new("llm", "prefill");
        let err = s
            .complete_and_assemble(batch.step + 5, vec![1, 5], None, Then::Next(plain), &mut h)
            .unwrap_err();
        assert!(matches!(err, ChunkingError::UnknownStep { .. }), "{err}");
        let ghost = NextStep::new("llm", "ghost");
        let err = s
            .complete_and_assemble(batch.step, vec![1, 5], None, Then::Next(ghost), &mut h)
            .unwrap_err();
        assert!(matches!(err, ChunkingError::UnknownWalk { .. }), "{err}");
        assert_eq!(s.stats().steps_in_flight, 1, "still in flight");
        // The second step's completion is remembered in place of the first.
        let next = NextStep::new("llm", "prefill").forget_request(9);
        let done = s
            .complete_and_assemble(
                batch.step,
                vec![1, 5],
                None,
                Then::Next(next.clone()),
                &mut h,
            )
            .unwrap();
        assert_eq!(done.outcome.finished, [2]);
        assert_eq!(
            s.complete_and_assemble(batch.step, vec![1, 5], None, Then::Next(next), &mut h)
                .unwrap()
                .outcome,
            done.outcome
        );
        let stale = s.complete_and_assemble(
            step,
            vec![8],
            Some(3.0),
            Then::Next(NextStep::new("llm", "prefill")),
            &mut h,
        );
        assert!(
            matches!(stale, Err(ChunkingError::UnknownStep { .. })),
            "{stale:?}"
        );
    }

    #[test]
    fn a_batch_the_engine_let_go_of_is_the_room_of_the_next_one() {
        let mut s = state();
        let (node, walk) = llm();
        for rid in [1, 2] {
            s.admit(
                rid,
                &node,
                &walk,
                tokens(24, rid as u32),
                AdmitOptions::cached(0),
                &mut (),
            )
            .unwrap();
        }
        let first = s.assemble("llm", "prefill", None, &mut ()).unwrap();
        let (room, rows_room) = (Arc::as_ptr(&first), first.rows.as_ptr());
        let step = first.step;
        drop(first);
        let done = s
            .complete_and_assemble(step, vec![8], None, Then::Same, &mut ())
            .unwrap();
        let second = done.next.unwrap();
        assert_eq!(Arc::as_ptr(&second), room, "the same Arc");
        assert_eq!(second.rows.as_ptr(), rows_room, "the same rows' vector");
        assert_eq!(second.step, step + 1);
        assert_eq!(second.rows[0].input.as_ref().unwrap().token_ids(), &[1; 8]);
        // Kept by the engine, a batch is never written over: the next one has its own room.
        let kept = (*second).clone();
        let done = s
            .complete_and_assemble(second.step, vec![8], None, Then::Same, &mut ())
            .unwrap();
        let third = done.next.unwrap();
        assert!(!Arc::ptr_eq(&third, &second));
        assert_eq!(*second, kept);
        assert_eq!(third.step, second.step + 1);
        // An abandoned step's batch is a room too.
        let (room, step) = (Arc::as_ptr(&third), third.step);
        drop((second, third));
        s.abandon(step, &[]).unwrap();
        let fourth = s.assemble("llm", "prefill", None, &mut ()).unwrap();
        assert_eq!(Arc::as_ptr(&fourth), room);
        assert_eq!(fourth.rows[0].input.as_ref().unwrap().token_ids(), &[1; 8]);
    }

    #[test]
    fn a_one_trip_step_without_a_next_step_assembles_the_same_node_and_walk() {
        let mut s = state();
        let (node, walk) = llm();
        s.admit(
            1,
            &node,
            &walk,
            tokens(20, 1),
            AdmitOptions::cached(0),
            &mut (),
        )
        .unwrap();
        let first = s.assemble("llm", "prefill", None, &mut ()).unwrap();
        let mut h = Recorded::default();
        let done = s
            .complete_and_assemble(first.step, vec![8], None, Then::SameAt(5.0), &mut h)
            .unwrap();
        let second = done.next.unwrap();
        assert_eq!((&*second.node, &*second.walk), ("llm", "prefill"));
        assert_eq!(second.rows[0].work.tokens(), 8, "the chunk after the first");
        assert_eq!(s.stats().prefill_rows, 1, "no row changed");
        // A repeat is answered with the batch in flight.
        let again = s
            .complete_and_assemble(first.step, vec![8], None, Then::Same, &mut h)
            .unwrap();
        assert!(Arc::ptr_eq(&again.next.unwrap(), &second));
        // A step neither in flight nor last completed is unknown, and changes nothing.
        let err = s
            .complete_and_assemble(second.step + 7, vec![8], None, Then::Same, &mut h)
            .unwrap_err();
        assert!(matches!(err, ChunkingError::UnknownStep { .. }), "{err}");
        assert_eq!(s.stats().steps_in_flight, 1);
        let done = s
            .complete_and_assemble(second.step, vec![8], None, Then::Same, &mut h)
            .unwrap();
        let third = done.next.unwrap();
        assert_eq!(third.rows[0].work.tokens(), 4, "the last 4 tokens");
        assert_eq!(third.walk, second.walk);
    }

    #[test]
    fn a_repeat_without_a_next_step_assembles_the_walk_its_first_call_did() {
        let mut s = state_of(
            &[("llm", SubmoduleCaps::new(["prefill"], false))],
            &[("llm", "prefill", 8), ("llm", "decode", 4)],
            crate::budget::BudgetSettings::new(["prefill", "decode"]),
        );
        let (node, walk) = llm();
        s.admit(
            1,
            &node,
            &walk,
            tokens(20, 1),
            AdmitOptions::cached(0),
            &mut (),
        )
        .unwrap();
        let s1 = s.assemble("llm", "prefill", None, &mut ()).unwrap();
        let prefill = NextStep::new("llm", "prefill");
        let s2 = s
            .complete_and_assemble(s1.step, vec![8], None, Then::Next(prefill), &mut ())
            .unwrap()
            .next
            .unwrap();
        let decode = NextStep::new("llm", "decode").continue_row(9, "decode", 1);
        let s3 = s
            .complete_and_assemble(s2.step, vec![8], None, Then::Next(decode), &mut ())
            .unwrap()
            .next
            .unwrap();
        assert_eq!(&*s3.walk, "decode");
        // The repeat of the second completion answers the `decode` step in flight, not a
        // `prefill` one (the walk the node's first completion named).
        let again = s
            .complete_and_assemble(s2.step, vec![8], None, Then::Same, &mut ())
            .unwrap();
        assert!(Arc::ptr_eq(&again.next.unwrap(), &s3));
    }

    #[test]
    fn a_refused_row_change_keeps_the_ones_before_it_and_is_the_next_steps_answer() {
        let mut s = state();
        let (node, walk) = llm();
        s.admit(
            1,
            &node,
            &walk,
            tokens(8, 1),
            AdmitOptions::cached(0),
            &mut (),
        )
        .unwrap();
        let step = s.assemble("llm", "prefill", None, &mut ()).unwrap().step;
        let next = NextStep::new("llm", "prefill")
            .admit(2, "prefill", tokens(4, 2), 0)
            .admit(3, "prefill", tokens(0, 0), 0)
            .admit(4, "prefill", tokens(4, 4), 0);
        let mut h = Recorded::default();
        let done = s
            .complete_and_assemble(step, vec![8], None, Then::Next(next.clone()), &mut h)
            .unwrap();
        assert!(
            matches!(done.next, Err(ChunkingError::EmptyInput { rid: 3, .. })),
            "{:?}",
            done.next
        );
        assert!(h.0.contains(&format!("change refused {step}")), "{:?}", h.0);
        assert!(s.prepared(2, "llm").is_some() && s.prepared(4, "llm").is_none());
        // Its repeat gets the same refusal, and changes nothing.
        let again = s
            .complete_and_assemble(step, vec![8], None, Then::Next(next), &mut h)
            .unwrap();
        assert_eq!(again.next, done.next);
        assert_eq!(s.stats().prefill_rows, 1);
    }

    #[test]
    fn a_begun_drain_refuses_admissions_and_steps_but_applies_forgets_and_completions() {
        let mut s = state();
        let (node, walk) = llm();
        for rid in [1, 2] {
            s.admit(
                rid,
                &node,
                &walk,
                tokens(10, 0),
                AdmitOptions::cached(0),
                &mut (),
            )
            .unwrap();
        }
        let step = s.assemble("llm", "prefill", None, &mut ()).unwrap().step;
        assert_eq!(s.begin_drain(), 1);
        let refused = s.admit(
            3,
            &node,
            &walk,
            tokens(4, 0),
            AdmitOptions::cached(0),
            &mut (),
        );
        assert!(matches!(refused, Err(ChunkingError::Draining)));
        let refused = s.continue_row(5, &node, &walk, 1, None, &mut ());
        assert!(matches!(refused, Err(ChunkingError::Draining)));
        assert!(matches!(
            s.assemble("llm", "prefill", None, &mut ()),
            Err(ChunkingError::Draining)
        ));
        let next =
            NextStep::new("llm", "prefill")
                .forget_request(2)
                .admit(4, "prefill", tokens(4, 0), 0);
        let done = s
            .complete_and_assemble(step, vec![8], None, Then::Next(next), &mut ())
            .unwrap();
        assert!(
            matches!(done.next, Err(ChunkingError::Draining)),
            "{:?}",
            done.next
        );
        assert!(s.prepared(2, "llm").is_none() && s.prepared(4, "llm").is_none());
        assert_eq!((s.stats().prefill_rows, s.stats().steps_in_flight), (1, 0));
    }

    #[test]
    fn a_drain_reports_and_drops_every_row_and_input() {
        let mut s = state();
        let (node, walk) = llm();
        for rid in [1, 2] {
            s.admit(
                rid,
                &node,
                &walk,
                tokens(10, 0),
                AdmitOptions::cached(0),
                &mut (),
            )
            .unwrap();
        }
        s.continue_row(7, &node, &walk, 1, None, &mut ()).unwrap();
        s.assemble("llm", "prefill", None, &mut ()).unwrap();
        let mut h = Recorded::default();
        let report = s.drain(&mut h);
        let want = DrainReport {
            steps_abandoned: 1,
            requests: 3,
            rows: 3,
            prepared_inputs: 2,
            prepared_tokens: 20,
        };
        assert_eq!(report, want);
        assert_eq!(h.0, ["queues None 0"]);
        assert_eq!(
            s.take_input_changes(),
            None,
            "the accounting is cleared whole"
        );
        assert_eq!(s.stats(), QueueStats::default());
        assert_eq!(s.drain(&mut ()), DrainReport::default());
        let refused = s.admit(
            3,
            &node,
            &walk,
            tokens(4, 0),
            AdmitOptions::cached(0),
            &mut (),
        );
        assert!(matches!(refused, Err(ChunkingError::Draining)));
    }

    #[test]
    fn an_empty_step_says_once_that_prompts_wait_on_a_walk_it_does_not_take() {
        // `prefill` and `decode` both budgeted, not combined: a prompt on `prefill` never runs
        // in a `decode` step.
        let mut s = state_of(
            &[("llm", SubmoduleCaps::new(["prefill"], false))],
            &[("llm", "prefill", 8), ("llm", "decode", 4)],
            crate::budget::BudgetSettings::new(["prefill", "decode"]),
        );
        let (node, walk) = llm();
        let mut h = Recorded::default();
        let empty = s.assemble("llm", "decode", None, &mut h).unwrap();
        assert!(empty.rows.is_empty());
        assert_eq!(h.0.len(), 1, "nothing waits: nothing said: {:?}", h.0);
        s.admit(
            1,
            &node,
            &walk,
            tokens(10, 0),
            AdmitOptions::cached(0),
            &mut (),
        )
        .unwrap();
        h.0.clear();
        // Alternating with the prompt's walk, the empty `decode` steps are answered; the
        // prompt is said stranded once.
        for _ in 0..3 {
            assert!(s
                .assemble("llm", "decode", None, &mut h)
                .unwrap()
                .rows
                .is_empty());
            let p = s.assemble("llm", "prefill", None, &mut ()).unwrap();
            s.abandon(p.step, &[]).unwrap();
        }
        let said: Vec<&String> = h.0.iter().filter(|c| c.starts_with("stranded")).collect();
        assert_eq!(said, ["stranded llm prefill decode"], "once: {:?}", h.0);
        // Twice in a row with nothing else assembled between, it is refused, naming the walks
        // (each once: two prompts wait on `prefill`).
        s.admit(
            2,
            &node,
            &walk,
            tokens(10, 0),
            AdmitOptions::cached(0),
            &mut (),
        )
        .unwrap();
        assert!(s
            .assemble("llm", "decode", None, &mut h)
            .unwrap()
            .rows
            .is_empty());
        let err = s.assemble("llm", "decode", None, &mut h).unwrap_err();
        assert_eq!(err.kind(), crate::error::ErrorKind::RefusedSettings);
        assert!(
            matches!(&err, ChunkingError::StrandedRows { waiting, .. } if waiting.len() == 1),
            "{err}"
        );
        assert_eq!(
            err.to_string(),
            "no step of `llm`/`decode` takes the rows of `llm` waiting on walk(s) `prefill`: run \
             them inside `decode` (`BudgetSettings::combined(\"decode\", [..])`, \
             `combined_walk_of`, or the model manifest's `combined` table) or assemble `llm` on \
             those walks too"
        );
        assert_eq!(
            s.stats().steps_in_flight,
            0,
            "no step stays behind the refusal"
        );
        assert!(
            s.assemble("llm", "decode", None, &mut h).is_err(),
            "while it holds"
        );
        assert_eq!(
            stranded_message("llm", "prefill", "decode"),
            "prompt rows of `llm` wait on walk `prefill`, which no step of `llm`/`decode` takes: \
             run `prefill` inside `decode` (`BudgetSettings::combined`, or the model manifest's \
             combined walks) or assemble `llm`/`prefill` too"
        );
        // A step that runs something says nothing (a decode row beside the waiting prompt).
        s.continue_row(9, &node, &Name::from("decode"), 1, None, &mut ())
            .unwrap();
        h.0.clear();
        let b = s.assemble("llm", "decode", None, &mut h).unwrap();
        assert_eq!(b.rows.len(), 1);
        assert!(!h.0.iter().any(|c| c.starts_with("stranded")), "{:?}", h.0);
    }

    #[test]
    fn assembling_a_walk_that_runs_inside_a_combined_walk_is_refused_naming_it() {
        let settings = crate::budget::BudgetSettings::new(["prefill", "decode", "mixed"])
            .combined("mixed", ["prefill", "decode"]);
        let mut s = state_of(
            &[("llm", SubmoduleCaps::new(["prefill", "mixed"], false))],
            &[("llm", "mixed", 64)],
            settings.clone(),
        );
        let (node, walk) = llm();
        s.admit(
            1,
            &node,
            &walk,
            tokens(3000, 0),
            AdmitOptions::cached(0),
            &mut (),
        )
        .unwrap();
        for member in ["prefill", "decode"] {
            let err = s.assemble("llm", member, None, &mut ()).unwrap_err();
            assert_eq!(
                err,
                ChunkingError::MemberWalk {
                    node: "llm".into(),
                    walk: member.into(),
                    combined: "mixed".into()
                }
            );
            assert!(err.to_string().contains("assemble `llm`/`mixed`"), "{err}");
            assert_eq!(err.kind(), crate::error::ErrorKind::InvalidRequest);
        }
        let b = s.assemble("llm", "mixed", None, &mut ()).unwrap();
        assert_eq!((b.rows.len(), b.budget), (1, Some(64)));

        // A member walk with a budget of its own plans its own steps; so does one on a node
        // whose combined walk has no budget (an encoder that steps on `prefill` alone).
        let mut s = state_of(
            &[
                ("llm", SubmoduleCaps::new(["prefill", "mixed"], false)),
                ("vision", SubmoduleCaps::new::<_, &str>([], false)),
            ],
            &[
                ("llm", "mixed", 64),
                ("llm", "prefill", 32),
                ("vision", "prefill", 100),
            ],
            settings,
        );
        let err = s.assemble("llm", "decode", None, &mut ()).unwrap_err();
        assert!(matches!(err, ChunkingError::MemberWalk { .. }), "{err}");
        for node in ["llm", "vision"] {
            let node = Name::from(node);
            s.admit(
                1,
                &node,
                &walk,
                tokens(300, 0),
                AdmitOptions::cached(0),
                &mut (),
            )
            .unwrap();
            let b = s.assemble(&node, "prefill", None, &mut ()).unwrap();
            assert_eq!(b.rows.len(), 1, "{node}");
            assert!(b.budget.is_some(), "{node}");
        }
    }

    #[test]
    fn the_stats_count_prefill_mid_prefill_and_continuing_rows() {
        let mut s = state();
        let (node, walk) = llm();
        s.admit(
            1,
            &node,
            &walk,
            tokens(10, 0),
            AdmitOptions::cached(0),
            &mut (),
        )
        .unwrap();
        let step = s.assemble("llm", "prefill", None, &mut ()).unwrap().step;
        s.complete(step, &[8], None, &mut ()).unwrap();
        s.continue_row(5, &node, &walk, 1, None, &mut ()).unwrap();
        s.admit(
            2,
            &node,
            &walk,
            tokens(3, 0),
            AdmitOptions::cached(0),
            &mut (),
        )
        .unwrap();
        let want = QueueStats {
            prefill_rows: 2,
            mid_prefill_rows: 1,
            continuing_rows: 1,
            steps_in_flight: 0,
        };
        assert_eq!(s.stats(), want);
    }
}
