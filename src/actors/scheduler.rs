//! Scheduler: the row queues per node. Assembles each step's batch from the budget snapshot;
//! on completion sends overruns to OverrunAccounting and releases finished rows' inputs to
//! PreparedInputs.

use std::sync::Arc;
use std::time::Instant;

use actix::prelude::*;
use rustc_hash::FxHashMap;

use super::budget_config::UseSnapshot;
use super::overrun_accounting::{OverrunAccounting, RecordOverrun};
use super::prepared_inputs::{
    Cut, CutBatch, ForgetInputs, Insert, InsertAndCut, InsertedAndCut, PreparedInputs, Release,
    ReleaseAll,
};
use super::spans::Spans;
use super::Guarded;
use crate::error::ChunkingError;
use crate::latency::{LatencyModel, ModelSource};
use crate::metrics::{Instance, ModelGauges, QueueGauges, StepMetrics};
use crate::planner::RowWork;
use crate::policy::Name;
use crate::prepared::PreparedInput;
use crate::scheduler::{
    Assembled, Batch, Completed, NextStep, RowChange, SchedulerState, StepOutcome,
};

/// Wraps [`SchedulerState`].
pub(crate) struct Scheduler {
    state: SchedulerState,
    prepared: Addr<PreparedInputs>,
    overruns: Addr<OverrunAccounting>,
    instance: Instance,
    /// Metric handles per `(node, walk)`, resolved on a pair's first step.
    metrics: FxHashMap<(Name, Name), StepMetrics>,
    /// Queue-depth gauges per node, resolved on the node's first change.
    queue_gauges: FxHashMap<Name, QueueGauges>,
    /// Latency-model gauges per node.
    model_gauges: FxHashMap<Name, ModelGauges>,
    /// Per node, the last step completed by [`CompleteAndAssemble`], to answer a repeat of it.
    completed: FxHashMap<Name, LastCompleted>,
    /// The tracing spans of the steps in flight and of the requests admitted.
    spans: Spans,
    /// Set by [`BeginDrain`] or [`Drain`], for good: no admission, no new step.
    draining: bool,
}

/// A step completed by [`CompleteAndAssemble`], as reported and as it came out.
struct LastCompleted {
    step: u64,
    ran: Vec<u32>,
    measured_ms: Option<f64>,
    outcome: StepOutcome,
    /// The row change refused after the completion, if one was.
    refused: Option<ChunkingError>,
}

impl Scheduler {
    pub(crate) fn new(
        instance: Instance,
        prepared: Addr<PreparedInputs>,
        overruns: Addr<OverrunAccounting>,
    ) -> Self {
        Self {
            state: SchedulerState::default(),
            prepared,
            overruns,
            metrics: FxHashMap::default(),
            queue_gauges: FxHashMap::default(),
            model_gauges: FxHashMap::default(),
            completed: FxHashMap::default(),
            spans: Spans::new(instance.model_name().clone()),
            instance,
            draining: false,
        }
    }

    fn step_metrics(&mut self, node: &Name, walk: &Name) -> &StepMetrics {
        let instance = &self.instance;
        self.metrics
            .entry((node.clone(), walk.clone()))
            .or_insert_with(|| instance.step(node, walk))
    }

    /// Sets the queue-depth gauges of `node` from its queues (0 when it has none yet).
    fn publish_queue(&mut self, node: &Name) {
        let counts = self
            .state
            .node(node)
            .map(|q| q.counts())
            .unwrap_or_default();
        let instance = &self.instance;
        self.queue_gauges
            .entry(node.clone())
            .or_insert_with(|| instance.queue(node))
            .set(counts);
    }

    /// Sets the latency-model gauges of `node`: its coefficients and their source.
    fn publish_model(&mut self, node: &Name, model: (Option<LatencyModel>, ModelSource)) {
        let instance = &self.instance;
        self.model_gauges
            .entry(node.clone())
            .or_insert_with(|| instance.model(node))
            .set(model.0, model.1);
    }

    fn publish_all_queues(&mut self) {
        let nodes: Vec<Name> = self.queue_gauges.keys().cloned().collect();
        for n in nodes {
            self.publish_queue(&n);
        }
    }
}

impl Actor for Scheduler {
    type Context = Context<Self>;
}

super::supervised!(
    Scheduler,
    "Scheduler",
    [
        ContinueRow,
        ForgetRequest,
        ForgetRow,
        Abandon,
        Complete,
        SchedulerStats,
        BeginDrain
    ]
);

/// The supervised form of a handler that answers later (it waits for PreparedInputs): a panic
/// while handling is an error to the caller and restarts the actor, as for the other messages.
fn guard_later<T: 'static>(
    act: &mut Scheduler,
    ctx: &mut Context<Scheduler>,
    handle: impl FnOnce(
        &mut Scheduler,
        &mut Context<Scheduler>,
    ) -> ResponseActFuture<Scheduler, Result<T, ChunkingError>>,
) -> ResponseActFuture<Scheduler, Result<T, ChunkingError>> {
    match super::guard(act, ctx, "Scheduler", handle) {
        Ok(later) => later,
        Err(e) => Box::pin(fut::ready(Err(e))),
    }
}

impl Handler<Guarded<Assemble>> for Scheduler {
    /// Not atomic: other messages are handled while PreparedInputs cuts the inputs. A repeated
    /// `assemble` meanwhile finds the step in flight without its batch held yet, plans the same
    /// batch from the step's plan and has it cut again (the same views); the batch held is the
    /// first to be cut, and a cut answered after the step completed is not held.
    type Result = ResponseActFuture<Self, Result<Arc<Batch>, ChunkingError>>;

    fn handle(&mut self, msg: Guarded<Assemble>, ctx: &mut Self::Context) -> Self::Result {
        guard_later(self, ctx, |act, ctx| {
            <Self as Handler<Assemble>>::handle(act, msg.0, ctx)
        })
    }
}

impl Handler<Guarded<CompleteAndAssemble>> for Scheduler {
    type Result = ResponseActFuture<Self, Result<Completed, ChunkingError>>;

    fn handle(
        &mut self,
        msg: Guarded<CompleteAndAssemble>,
        ctx: &mut Self::Context,
    ) -> Self::Result {
        guard_later(self, ctx, |act, ctx| {
            <Self as Handler<CompleteAndAssemble>>::handle(act, msg.0, ctx)
        })
    }
}

impl Handler<Guarded<Drain>> for Scheduler {
    type Result = ResponseActFuture<Self, Result<DrainReport, ChunkingError>>;

    fn handle(&mut self, msg: Guarded<Drain>, ctx: &mut Self::Context) -> Self::Result {
        guard_later(self, ctx, |act, ctx| {
            <Self as Handler<Drain>>::handle(act, msg.0, ctx)
        })
    }
}

impl Handler<Guarded<AdmitPrepared>> for Scheduler {
    type Result = ResponseActFuture<Self, Result<(), ChunkingError>>;

    fn handle(&mut self, msg: Guarded<AdmitPrepared>, ctx: &mut Self::Context) -> Self::Result {
        guard_later(self, ctx, |act, ctx| {
            <Self as Handler<AdmitPrepared>>::handle(act, msg.0, ctx)
        })
    }
}

impl Handler<UseSnapshot> for Scheduler {
    type Result = ();

    fn handle(&mut self, msg: UseSnapshot, _: &mut Self::Context) {
        // Every node's queue-depth series exists from the first snapshot on, at 0.
        let nodes: Vec<Name> = msg.0.table().model().nodes().cloned().collect();
        self.state.set_snapshot(msg.0);
        for node in &nodes {
            self.publish_queue(node);
            let model = self.state.latency_model(node);
            self.publish_model(node, model);
        }
    }
}

/// Admits a prompt whole: queues its row, then has PreparedInputs hold its input (the engine
/// waits for one answer). If PreparedInputs refuses the input, the row is dropped again, so no
/// row is ever queued without its input. PreparedInputs gets the input before any later `Cut`
/// of this Scheduler, as an actor's mailbox is first in, first out.
#[derive(Message)]
#[rtype(result = "Result<(), ChunkingError>")]
pub(crate) struct AdmitPrepared {
    pub(crate) rid: u64,
    pub(crate) node: Name,
    pub(crate) walk: Name,
    pub(crate) input: PreparedInput,
    pub(crate) cached: u32,
}

impl Handler<AdmitPrepared> for Scheduler {
    type Result = ResponseActFuture<Self, Result<(), ChunkingError>>;

    fn handle(&mut self, m: AdmitPrepared, _: &mut Self::Context) -> Self::Result {
        if self.draining {
            return Box::pin(fut::ready(Err(ChunkingError::Draining)));
        }
        let queued = m
            .input
            .measure(m.rid, &m.node)
            .and_then(|total| self.state.admit(m.rid, &m.node, &m.walk, total, m.cached));
        if let Err(e) = queued {
            return Box::pin(fut::ready(Err(e)));
        }
        self.spans.admitted(m.rid, &m.node, &m.walk);
        self.publish_queue(&m.node);
        let (rid, node) = (m.rid, m.node);
        let insert = self.prepared.send(Guarded(Insert {
            rid,
            node: node.clone(),
            input: m.input,
        }));
        Box::pin(insert.into_actor(self).map(move |answer, act, _| {
            let refused = match answer {
                Ok(Ok(_)) => return Ok(()),
                Ok(Err(e)) => e,
                Err(_) => ChunkingError::ActorStopped {
                    actor: "PreparedInputs",
                },
            };
            act.state.forget_at(rid, &node);
            act.spans.forgotten(rid);
            act.publish_queue(&node);
            Err(refused)
        }))
    }
}

/// Keeps a continuing row of `rid` at `node` queued, running `estimate` tokens a step, until
/// [`ForgetRequest`] or [`ForgetRow`].
#[derive(Message)]
#[rtype(result = "Result<(), ChunkingError>")]
pub(crate) struct ContinueRow {
    pub(crate) rid: u64,
    pub(crate) node: Name,
    pub(crate) walk: Name,
    pub(crate) estimate: u32,
    pub(crate) context: Option<u64>,
}

impl Handler<ContinueRow> for Scheduler {
    type Result = Result<(), ChunkingError>;

    fn handle(&mut self, m: ContinueRow, _: &mut Self::Context) -> Self::Result {
        if self.draining {
            return Err(ChunkingError::Draining);
        }
        self.state
            .continue_row(m.rid, &m.node, &m.walk, m.estimate, m.context)?;
        self.spans.admitted(m.rid, &m.node, &m.walk);
        self.publish_queue(&m.node);
        Ok(())
    }
}

/// Ends a request: drops its rows on every node here, and its prepared inputs (PreparedInputs
/// gets the message before any later `Cut` of this Scheduler).
#[derive(Message)]
#[rtype(result = "Result<(), ChunkingError>")]
pub(crate) struct ForgetRequest(pub(crate) u64);

impl Handler<ForgetRequest> for Scheduler {
    type Result = Result<(), ChunkingError>;

    fn handle(&mut self, m: ForgetRequest, _: &mut Self::Context) -> Self::Result {
        self.spans.forgotten(m.0);
        self.state.forget(m.0);
        self.prepared.do_send(ForgetInputs(m.0));
        self.publish_all_queues();
        Ok(())
    }
}

/// Drops the row of `rid` at `node` and its input there; answers whether an input was held.
#[derive(Message)]
#[rtype(result = "Result<bool, ChunkingError>")]
pub(crate) struct ForgetRow {
    pub(crate) rid: u64,
    pub(crate) node: Name,
}

impl Handler<ForgetRow> for Scheduler {
    type Result = Result<bool, ChunkingError>;

    fn handle(&mut self, m: ForgetRow, _: &mut Self::Context) -> Self::Result {
        let had_prefill = self.state.forget_at(m.rid, &m.node);
        self.prepared.do_send(Release {
            node: m.node.clone(),
            rids: vec![m.rid],
        });
        self.publish_queue(&m.node);
        Ok(had_prefill)
    }
}

/// Assembles the next step of `node`/`walk`, with every chunk's input cut by PreparedInputs,
/// or answers the node's step in flight again.
///
/// The Scheduler asks PreparedInputs itself, so the engine waits for one answer per step: a
/// message between actors of one arbiter costs less than waking the engine's task twice. A
/// chunk whose input went missing (forgotten meanwhile) abandons the step and drops that row.
#[derive(Message)]
#[rtype(result = "Result<Arc<Batch>, ChunkingError>")]
pub(crate) struct Assemble {
    pub(crate) node: Name,
    pub(crate) walk: Name,
}

impl Handler<Assemble> for Scheduler {
    type Result = ResponseActFuture<Self, Result<Arc<Batch>, ChunkingError>>;

    fn handle(&mut self, m: Assemble, _: &mut Self::Context) -> Self::Result {
        self.assemble(&m.node, &m.walk)
    }
}

impl Scheduler {
    /// [`Assemble`]: plans the next step of `node`/`walk` (or finds it in flight) and has its
    /// chunks cut; shared with [`CompleteAndAssemble`].
    fn assemble(
        &mut self,
        node: &str,
        walk: &str,
    ) -> ResponseActFuture<Self, Result<Arc<Batch>, ChunkingError>> {
        if self.draining {
            return Box::pin(fut::ready(Err(ChunkingError::Draining)));
        }
        let started = Instant::now();
        let batch = match self.state.assemble(node, walk) {
            Ok(Assembled::InFlight(batch)) => return Box::pin(fut::ready(Ok(batch))),
            Ok(Assembled::Planned(batch)) => batch,
            Err(e) => return Box::pin(fut::ready(Err(e))),
        };
        let took = started.elapsed();
        self.step_metrics(&batch.node, &batch.walk)
            .assembled(&batch, took);
        self.open_step_span(&batch);
        if !batch
            .rows
            .iter()
            .any(|r| matches!(r.work, RowWork::Chunk { .. }))
        {
            let batch = Arc::new(batch);
            self.state.hold(batch.clone());
            return Box::pin(fut::ready(Ok(batch)));
        }
        let (step, node) = (batch.step, batch.node.clone());
        let cut = self.prepared.send(Guarded(Cut(batch)));
        Box::pin(cut.into_actor(self).map(move |answer, act, _| {
            let error = match answer {
                Ok(Ok(CutBatch { batch, missing })) if missing.is_empty() => {
                    let batch = Arc::new(batch);
                    act.state.hold(batch.clone());
                    return Ok(batch);
                }
                Ok(Ok(CutBatch { missing, .. })) => {
                    act.state.abandon(step, &missing)?;
                    act.publish_queue(&node);
                    let e = ChunkingError::MissingPreparedInput {
                        rid: missing[0],
                        node,
                    };
                    act.abandoned_by(step, &e);
                    return Err(e);
                }
                Ok(Err(e)) => e,
                Err(_) => ChunkingError::ActorStopped {
                    actor: "PreparedInputs",
                },
            };
            // Without the batch the engine cannot complete the step: do not leave it blocking
            // the node.
            act.state.abandon(step, &[])?;
            act.abandoned_by(step, &error);
            Err(error)
        }))
    }

    /// [`Scheduler::assemble`] after queueing the rows of `inserts` (admitted with a
    /// completion): PreparedInputs holds their inputs and cuts the batch in one message. An
    /// admission it refuses drops its row and abandons the step (its error is the answer).
    fn assemble_admitting(
        &mut self,
        node: &str,
        walk: &str,
        inserts: Vec<Insert>,
    ) -> ResponseActFuture<Self, Result<Arc<Batch>, ChunkingError>> {
        if inserts.is_empty() || self.draining {
            return self.assemble(node, walk);
        }
        let started = Instant::now();
        let batch = match self.state.assemble(node, walk) {
            Ok(Assembled::Planned(batch)) => batch,
            // Not after a completion of the node's step (the walk was checked before), but the
            // rows queued must still get their inputs.
            other => {
                for insert in inserts {
                    self.prepared.do_send(insert);
                }
                return Box::pin(fut::ready(other.map(Assembled::into_batch).map(Arc::new)));
            }
        };
        self.step_metrics(&batch.node, &batch.walk)
            .assembled(&batch, started.elapsed());
        self.open_step_span(&batch);
        let (step, node) = (batch.step, batch.node.clone());
        let cut = self.prepared.send(Guarded(InsertAndCut { inserts, batch }));
        Box::pin(cut.into_actor(self).map(move |answer, act, _| {
            let (CutBatch { batch, missing }, refused) = match answer {
                Ok(Ok(InsertedAndCut { cut, refused })) => (cut, refused),
                Ok(Err(e)) => {
                    act.state.abandon(step, &[])?;
                    act.abandoned_by(step, &e);
                    return Err(e);
                }
                Err(_) => {
                    act.state.abandon(step, &[])?;
                    let e = ChunkingError::ActorStopped {
                        actor: "PreparedInputs",
                    };
                    act.abandoned_by(step, &e);
                    return Err(e);
                }
            };
            if missing.is_empty() && refused.is_empty() {
                let batch = Arc::new(batch);
                act.state.hold(batch.clone());
                return Ok(batch);
            }
            let mut drop = missing.clone();
            drop.extend(refused.iter().map(|(rid, _)| *rid));
            act.state.abandon(step, &drop)?;
            act.publish_queue(&node);
            let e = match refused.into_iter().next() {
                Some((_, e)) => e,
                None => ChunkingError::MissingPreparedInput {
                    rid: missing[0],
                    node,
                },
            };
            act.abandoned_by(step, &e);
            Err(e)
        }))
    }
}

/// Abandons the step in flight `step` without advancing it.
#[derive(Message)]
#[rtype(result = "Result<(), ChunkingError>")]
pub(crate) struct Abandon {
    pub(crate) step: u64,
}

impl Handler<Abandon> for Scheduler {
    type Result = Result<(), ChunkingError>;

    fn handle(&mut self, m: Abandon, _: &mut Self::Context) -> Self::Result {
        let span = self.spans.step(m.step);
        let _step = span.enter();
        match self.state.abandon(m.step, &[]) {
            Ok(()) => {
                tracing::debug!("step abandoned");
                self.spans.ended(m.step);
                Ok(())
            }
            Err(e) => {
                tracing::debug!(error = %e, "abandon refused");
                Err(e)
            }
        }
    }
}

/// Completes a step: `ran[i]` is what row `i` of its batch actually ran.
#[derive(Message)]
#[rtype(result = "Result<StepOutcome, ChunkingError>")]
pub(crate) struct Complete {
    pub(crate) step: u64,
    pub(crate) ran: Vec<u32>,
    pub(crate) measured_ms: Option<f64>,
}

impl Handler<Complete> for Scheduler {
    type Result = Result<StepOutcome, ChunkingError>;

    fn handle(&mut self, m: Complete, _: &mut Self::Context) -> Self::Result {
        let span = self.spans.step(m.step);
        let _step = span.enter();
        let outcome = self
            .state
            .complete(m.step, &m.ran, m.measured_ms)
            .inspect_err(completion_refused)?;
        self.completed_step(&outcome, &span);
        Ok(outcome)
    }
}

/// Records a refused completion in the step's span (entered by the caller).
fn completion_refused(e: &ChunkingError) {
    tracing::debug!(error = %e, "step completion refused");
}

impl Scheduler {
    /// Opens the span of a step just planned.
    fn open_step_span(&mut self, batch: &Batch) {
        let state = &self.state;
        self.spans
            .assembled(batch, |step| state.node_of_step(step).is_some());
    }

    /// Records in its span why step `step` was abandoned while its inputs were cut, and closes
    /// the span.
    fn abandoned_by(&mut self, step: u64, e: &ChunkingError) {
        self.spans
            .step(step)
            .in_scope(|| tracing::debug!(error = %e, "step abandoned"));
        self.spans.ended(step);
    }

    /// What follows a completed step: overruns recorded (in the step's `span`), finished
    /// inputs released, metrics.
    fn completed_step(&mut self, outcome: &StepOutcome, span: &tracing::Span) {
        tracing::debug!(
            ran_tokens = outcome.tokens.ran,
            finished = outcome.finished.len(),
            "step completed"
        );
        if let Some(reason) = outcome.time_overrun {
            tracing::debug!(reason = reason.as_str(), "step ran over its time budget");
        }
        if let Some(o) = &outcome.overrun {
            self.overruns
                .do_send(RecordOverrun(o.clone(), span.clone()));
        }
        self.spans.ended(outcome.step);
        if !outcome.finished.is_empty() {
            self.prepared.do_send(Release {
                node: outcome.node.clone(),
                rids: outcome.finished.clone(),
            });
        }
        self.step_metrics(&outcome.node, &outcome.walk)
            .completed(outcome);
        self.publish_model(&outcome.node, outcome.model);
        if let (Some(margin), Some(gauges)) =
            (outcome.time_margin, self.model_gauges.get(&outcome.node))
        {
            gauges.set_margin(margin);
        }
        self.publish_queue(&outcome.node);
    }

    /// Applies `next`'s row changes in order and stops at the first refused one; answers the
    /// inputs of the prompts admitted (their rows are queued; PreparedInputs is to hold them
    /// before the next cut) and the refusal, if any.
    fn apply_changes(&mut self, next: NextStep) -> (Vec<Insert>, Result<(), ChunkingError>) {
        let NextStep { node, changes, .. } = next;
        let mut forgot = false;
        let mut inserts = Vec::new();
        let mut result = Ok(());
        let any = !changes.is_empty();
        for change in changes {
            if self.draining && !matches!(change, RowChange::Forget(_)) {
                result = Err(ChunkingError::Draining);
                break;
            }
            result = match change {
                RowChange::Forget(rid) => {
                    self.spans.forgotten(rid);
                    self.state.forget(rid);
                    self.prepared.do_send(ForgetInputs(rid));
                    forgot = true;
                    Ok(())
                }
                RowChange::Continue {
                    rid,
                    walk,
                    estimate,
                } => self
                    .state
                    .continue_row(rid, &node, &walk, estimate, None)
                    .inspect(|()| self.spans.admitted(rid, &node, &walk)),
                RowChange::Admit {
                    rid,
                    walk,
                    input,
                    cached,
                } => input
                    .measure(rid, &node)
                    .and_then(|total| self.state.admit(rid, &node, &walk, total, cached))
                    .map(|()| {
                        self.spans.admitted(rid, &node, &walk);
                        inserts.push(Insert {
                            rid,
                            node: node.clone(),
                            input,
                        })
                    }),
            };
            if result.is_err() {
                break;
            }
        }
        if forgot {
            self.publish_all_queues();
        } else if any {
            self.publish_queue(&node);
        }
        (inserts, result)
    }
}

/// Completes step `step` of `next.node` (as [`Complete`]), applies `next`'s row changes, and
/// assembles the next step of `next.node`/`next.walk` (as [`Assemble`]): one round trip per
/// step for the engine.
///
/// A repeat of the message for the step it completed last on the node (its answer was lost: a
/// dropped or timed-out future) is not applied again: it gets the same outcome, and the next
/// step as `assemble` answers it then (the same batch while that step is in flight). A repeat
/// with other `ran` counts or another measured time is refused.
#[derive(Message)]
#[rtype(result = "Result<Completed, ChunkingError>")]
pub(crate) struct CompleteAndAssemble {
    pub(crate) step: u64,
    pub(crate) ran: Vec<u32>,
    pub(crate) measured_ms: Option<f64>,
    pub(crate) next: NextStep,
}

impl Handler<CompleteAndAssemble> for Scheduler {
    type Result = ResponseActFuture<Self, Result<Completed, ChunkingError>>;

    fn handle(&mut self, m: CompleteAndAssemble, _: &mut Self::Context) -> Self::Result {
        let ready = |r| -> Self::Result { Box::pin(fut::ready(r)) };
        let CompleteAndAssemble {
            step,
            ran,
            measured_ms,
            next,
        } = m;
        let (node, walk) = (next.node.clone(), next.walk.clone());
        let (outcome, inserts, refused) = match self.completed.get(&*node) {
            Some(last) if last.step == step => {
                let same_ms = last.measured_ms.map(f64::to_bits) == measured_ms.map(f64::to_bits);
                if last.ran != ran || !same_ms {
                    return ready(Err(ChunkingError::CompletedDifferently { step }));
                }
                (last.outcome.clone(), Vec::new(), last.refused.clone())
            }
            _ => {
                // The step must be of the node named for the next one, and the next step's walk
                // one the node serves: checked before anything changes.
                if self.state.node_of_step(step) != Some(&node) {
                    return ready(Err(ChunkingError::UnknownStep { step }));
                }
                if let Some(snap) = self.state.snapshot() {
                    if snap.step_params(&node, &walk).is_none() {
                        return ready(Err(ChunkingError::UnknownWalk { node, walk }));
                    }
                }
                let span = self.spans.step(step);
                let _step = span.enter();
                let outcome = match self.state.complete(step, &ran, measured_ms) {
                    Ok(o) => o,
                    Err(e) => {
                        completion_refused(&e);
                        return ready(Err(e));
                    }
                };
                self.completed_step(&outcome, &span);
                let (inserts, changed) = self.apply_changes(next);
                let refused = changed.err();
                if let Some(e) = &refused {
                    tracing::debug!(error = %e, "row change refused after the step");
                }
                let last = LastCompleted {
                    step,
                    ran,
                    measured_ms,
                    outcome: outcome.clone(),
                    refused: refused.clone(),
                };
                self.completed.insert(outcome.node.clone(), last);
                (outcome, inserts, refused)
            }
        };
        if let Some(e) = refused {
            // The rows admitted before the refused change are queued: their inputs are held.
            for insert in inserts {
                self.prepared.do_send(insert);
            }
            return ready(Ok(Completed {
                outcome,
                next: Err(e),
            }));
        }
        Box::pin(
            self.assemble_admitting(&node, &walk, inserts)
                .map(move |next, _, _| Ok(Completed { outcome, next })),
        )
    }
}

/// Starts a drain (`ChunkingManagement::begin_drain`): from now on no request is admitted
/// and no step assembled; completions, abandons and forgets are still handled. Answers the
/// steps in flight.
#[derive(Message)]
#[rtype(result = "Result<usize, ChunkingError>")]
pub(crate) struct BeginDrain;

impl Handler<BeginDrain> for Scheduler {
    type Result = Result<usize, ChunkingError>;

    fn handle(&mut self, _: BeginDrain, _: &mut Self::Context) -> Self::Result {
        self.draining = true;
        tracing::info!(
            steps_in_flight = self.state.steps_in_flight(),
            "draining: no more admissions or steps"
        );
        Ok(self.state.steps_in_flight())
    }
}

/// Ends a drain (`ChunkingManagement::drain`): abandons the steps still in flight, drops every
/// row and has PreparedInputs drop every input; answers what was dropped.
#[derive(Message)]
#[rtype(result = "Result<DrainReport, ChunkingError>")]
pub(crate) struct Drain;

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

impl Handler<Drain> for Scheduler {
    type Result = ResponseActFuture<Self, Result<DrainReport, ChunkingError>>;

    fn handle(&mut self, _: Drain, _: &mut Self::Context) -> Self::Result {
        self.draining = true;
        let drained = self.state.drain();
        self.spans = Spans::new(self.instance.model_name().clone());
        self.completed.clear();
        self.publish_all_queues();
        let release = self.prepared.send(Guarded(ReleaseAll));
        Box::pin(release.into_actor(self).map(move |answer, _, _| {
            let (prepared_inputs, prepared_tokens) =
                answer.map_err(|_| ChunkingError::ActorStopped {
                    actor: "PreparedInputs",
                })??;
            let report = DrainReport {
                steps_abandoned: drained.steps,
                requests: drained.requests,
                rows: drained.rows,
                prepared_inputs,
                prepared_tokens,
            };
            tracing::info!(?report, "drained");
            Ok(report)
        }))
    }
}

/// Rows queued over all nodes, and steps in flight.
#[derive(Message)]
#[rtype(result = "Result<QueueStats, ChunkingError>")]
pub(crate) struct SchedulerStats;

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

impl Handler<SchedulerStats> for Scheduler {
    type Result = Result<QueueStats, ChunkingError>;

    fn handle(&mut self, _: SchedulerStats, _: &mut Self::Context) -> Self::Result {
        let mut stats = QueueStats {
            steps_in_flight: self.state.steps_in_flight(),
            ..QueueStats::default()
        };
        for n in self.state.node_names() {
            let c = self.state.node(n).map(|q| q.counts()).unwrap_or_default();
            stats.prefill_rows += c.waiting + c.mid_prefill;
            stats.mid_prefill_rows += c.mid_prefill;
            stats.continuing_rows += c.continuing;
        }
        Ok(stats)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::sync::Arc;

    use super::*;
    use crate::budget::BudgetTable;
    use crate::policy::{ChunkingPolicy, ModelPolicies, SubmoduleCaps};
    use crate::prepared::PreparedInput;
    use crate::snapshot::BudgetSnapshot;

    /// A Scheduler and its PreparedInputs for one node `llm` with a `prefill` budget of 8.
    async fn start() -> (Addr<Scheduler>, Addr<PreparedInputs>) {
        let model = ModelPolicies::new(
            BTreeMap::from([("llm".into(), SubmoduleCaps::new(["prefill"], false))]),
            BTreeMap::from([(("llm".into(), "prefill".into()), ChunkingPolicy::budget(8))]),
        )
        .unwrap()
        .shared();
        let snapshot = BudgetSnapshot::new(BudgetTable::from_policies(model), 1);
        let instance = Instance::new("test".into());
        let prepared = PreparedInputs::new(instance.clone(), &[]).start();
        let overruns = OverrunAccounting::new(instance.clone()).start();
        let scheduler = Scheduler::new(instance, prepared.clone(), overruns).start();
        scheduler
            .send(UseSnapshot(Arc::new(snapshot)))
            .await
            .unwrap();
        (scheduler, prepared)
    }

    fn admit(rid: u64, input: PreparedInput) -> Guarded<AdmitPrepared> {
        Guarded(AdmitPrepared {
            rid,
            node: "llm".into(),
            walk: "prefill".into(),
            input,
            cached: 0,
        })
    }

    #[actix::test]
    async fn a_chunk_without_input_abandons_its_step_and_the_next_one_runs() {
        let (scheduler, prepared) = start().await;
        for rid in [1, 2] {
            let input = PreparedInput::tokens((0..10).collect::<Vec<u32>>());
            scheduler.send(admit(rid, input)).await.unwrap().unwrap();
        }
        // rid 1's input goes missing behind the Scheduler's back.
        prepared
            .send(Guarded(ForgetInputs(1)))
            .await
            .unwrap()
            .unwrap();
        let assemble = || {
            Guarded(Assemble {
                node: "llm".into(),
                walk: "prefill".into(),
            })
        };

        let err = scheduler.send(assemble()).await.unwrap().unwrap_err();
        assert!(
            matches!(err, ChunkingError::MissingPreparedInput { rid: 1, .. }),
            "{err}"
        );
        let batch = scheduler.send(assemble()).await.unwrap().unwrap();
        assert_eq!(batch.rows.len(), 1);
        assert_eq!(batch.rows[0].rid, 2);
        let input = batch.rows[0].input.as_ref().expect("the chunk is cut");
        assert_eq!(input.token_ids(), &[0, 1, 2, 3, 4, 5, 6, 7]);
    }

    #[actix::test]
    async fn an_input_prepared_inputs_refuses_leaves_no_row_queued() {
        let (scheduler, prepared) = start().await;
        let input = PreparedInput::tokens(vec![1, 2, 3]);
        let insert = Insert {
            rid: 3,
            node: "llm".into(),
            input: input.clone(),
        };
        prepared.send(Guarded(insert)).await.unwrap().unwrap();
        let err = scheduler
            .send(admit(3, input.clone()))
            .await
            .unwrap()
            .unwrap_err();
        assert!(
            matches!(err, ChunkingError::AlreadyQueued { rid: 3, .. }),
            "{err}"
        );
        let stats = scheduler
            .send(Guarded(SchedulerStats))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(stats.prefill_rows, 0);
        scheduler.send(admit(4, input)).await.unwrap().unwrap();
        let stats = scheduler
            .send(Guarded(SchedulerStats))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(stats.prefill_rows, 1);
    }
}
