//! Scheduler: the row queues per node. Assembles each step's batch from the budget snapshot;
//! on completion sends overruns to OverrunAccounting and releases finished rows' inputs to
//! PreparedInputs.

use std::time::Instant;

use actix::prelude::*;
use rustc_hash::FxHashMap;

use super::budget_config::UseSnapshot;
use super::overrun_accounting::{OverrunAccounting, RecordOverrun};
use super::prepared_inputs::{Cut, CutBatch, Insert, PreparedInputs, Release};
use super::Guarded;
use crate::error::ChunkingError;
use crate::metrics::StepMetrics;
use crate::planner::Work;
use crate::prepared::PreparedInput;
use crate::scheduler::{Batch, SchedulerState, StepOutcome};
use crate::Name;

/// Wraps [`SchedulerState`].
pub struct Scheduler {
    state: SchedulerState,
    prepared: Addr<PreparedInputs>,
    overruns: Addr<OverrunAccounting>,
    /// Metric handles per `(node, walk)`, resolved on a pair's first step.
    metrics: FxHashMap<(Name, Name), StepMetrics>,
}

impl Scheduler {
    pub fn new(prepared: Addr<PreparedInputs>, overruns: Addr<OverrunAccounting>) -> Self {
        Self {
            state: SchedulerState::default(),
            prepared,
            overruns,
            metrics: FxHashMap::default(),
        }
    }

    fn step_metrics(&mut self, node: &Name, walk: &Name) -> &StepMetrics {
        self.metrics
            .entry((node.clone(), walk.clone()))
            .or_insert_with(|| StepMetrics::new(node, walk))
    }
}

impl Actor for Scheduler {
    type Context = Context<Self>;
}

super::supervised!(
    Scheduler,
    "Scheduler",
    [
        Admit,
        ContinueRow,
        Finish,
        ForgetRequest,
        ForgetRow,
        Abandon,
        Complete,
        SchedulerStats,
        super::InjectPanic
    ]
);

/// The supervised form of a handler that answers later (it waits for PreparedInputs): a panic
/// while handling is an error to the caller and restarts the actor, as for the other messages.
fn guard_later<R: 'static>(
    act: &mut Scheduler,
    ctx: &mut Context<Scheduler>,
    handle: impl FnOnce(&mut Scheduler, &mut Context<Scheduler>) -> ResponseActFuture<Scheduler, R>,
) -> ResponseActFuture<Scheduler, Result<R, ChunkingError>> {
    match super::guard(act, ctx, "Scheduler", handle) {
        Ok(later) => Box::pin(later.map(|r, _, _| Ok(r))),
        Err(e) => Box::pin(fut::ready(Err(e))),
    }
}

impl Handler<Guarded<Assemble>> for Scheduler {
    type Result = ResponseActFuture<Self, Result<Result<Batch, ChunkingError>, ChunkingError>>;

    fn handle(&mut self, msg: Guarded<Assemble>, ctx: &mut Self::Context) -> Self::Result {
        guard_later(self, ctx, |act, ctx| {
            <Self as Handler<Assemble>>::handle(act, msg.0, ctx)
        })
    }
}

impl Handler<Guarded<AdmitPrepared>> for Scheduler {
    type Result = ResponseActFuture<Self, Result<Result<(), ChunkingError>, ChunkingError>>;

    fn handle(&mut self, msg: Guarded<AdmitPrepared>, ctx: &mut Self::Context) -> Self::Result {
        guard_later(self, ctx, |act, ctx| {
            <Self as Handler<AdmitPrepared>>::handle(act, msg.0, ctx)
        })
    }
}

impl Handler<UseSnapshot> for Scheduler {
    type Result = ();

    fn handle(&mut self, msg: UseSnapshot, _: &mut Self::Context) {
        self.state.set_snapshot(msg.0);
    }
}

/// Queues a prompt of `total` tokens (`cached` of them a cached prefix) for `rid` at `node`.
#[derive(Message)]
#[rtype(result = "Result<(), ChunkingError>")]
pub struct Admit {
    pub rid: u64,
    pub node: Name,
    pub walk: Name,
    pub total: u32,
    pub cached: u32,
}

impl Handler<Admit> for Scheduler {
    type Result = Result<(), ChunkingError>;

    fn handle(&mut self, m: Admit, _: &mut Self::Context) -> Self::Result {
        self.state.admit(m.rid, &m.node, &m.walk, m.total, m.cached)
    }
}

/// Admits a prompt whole: queues its row, then has PreparedInputs hold its input (the engine
/// waits for one answer). If PreparedInputs refuses the input, the row is dropped again, so no
/// row is ever queued without its input. PreparedInputs gets the input before any later `Cut`
/// of this Scheduler, as an actor's mailbox is first in, first out.
#[derive(Message)]
#[rtype(result = "Result<(), ChunkingError>")]
pub struct AdmitPrepared {
    pub rid: u64,
    pub node: Name,
    pub walk: Name,
    pub input: PreparedInput,
    pub cached: u32,
}

impl Handler<AdmitPrepared> for Scheduler {
    type Result = ResponseActFuture<Self, Result<(), ChunkingError>>;

    fn handle(&mut self, m: AdmitPrepared, _: &mut Self::Context) -> Self::Result {
        let queued = m
            .input
            .measure(m.rid, &m.node)
            .and_then(|total| self.state.admit(m.rid, &m.node, &m.walk, total, m.cached));
        if let Err(e) = queued {
            return Box::pin(fut::ready(Err(e)));
        }
        let (rid, node) = (m.rid, m.node);
        let insert = self.prepared.send(Guarded(Insert {
            rid,
            node: node.clone(),
            input: m.input,
        }));
        Box::pin(insert.into_actor(self).map(move |answer, act, _| {
            let refused = match answer {
                Ok(Ok(Ok(_))) => return Ok(()),
                Ok(Ok(Err(e)) | Err(e)) => e,
                Err(e) => ChunkingError::ActorUnavailable {
                    actor: "PreparedInputs",
                    reason: e.to_string(),
                },
            };
            act.state.forget_at(rid, &node);
            Err(refused)
        }))
    }
}

/// Keeps a continuing row of `rid` at `node` queued, running `estimate` tokens a step, until
/// [`Finish`] or [`ForgetRequest`].
#[derive(Message)]
#[rtype(result = "Result<(), ChunkingError>")]
pub struct ContinueRow {
    pub rid: u64,
    pub node: Name,
    pub walk: Name,
    pub estimate: u32,
}

impl Handler<ContinueRow> for Scheduler {
    type Result = Result<(), ChunkingError>;

    fn handle(&mut self, m: ContinueRow, _: &mut Self::Context) -> Self::Result {
        self.state.continue_row(m.rid, &m.node, &m.walk, m.estimate)
    }
}

/// Drops the continuing row of `rid` at `node`; answers whether there was one.
#[derive(Message)]
#[rtype(result = "bool")]
pub struct Finish {
    pub rid: u64,
    pub node: Name,
}

impl Handler<Finish> for Scheduler {
    type Result = bool;

    fn handle(&mut self, m: Finish, _: &mut Self::Context) -> bool {
        self.state.finish(m.rid, &m.node)
    }
}

/// Drops every row of a request on every node.
#[derive(Message)]
#[rtype(result = "()")]
pub struct ForgetRequest(pub u64);

impl Handler<ForgetRequest> for Scheduler {
    type Result = ();

    fn handle(&mut self, m: ForgetRequest, _: &mut Self::Context) {
        self.state.forget(m.0);
    }
}

/// Drops the rows of `rid` at `node` only.
#[derive(Message)]
#[rtype(result = "bool")]
pub struct ForgetRow {
    pub rid: u64,
    pub node: Name,
}

impl Handler<ForgetRow> for Scheduler {
    type Result = bool;

    fn handle(&mut self, m: ForgetRow, _: &mut Self::Context) -> bool {
        self.state.forget_at(m.rid, &m.node)
    }
}

/// Assembles the next step of `node`/`walk`, with every chunk's input cut by PreparedInputs.
///
/// The Scheduler asks PreparedInputs itself, so the engine waits for one answer per step: a
/// message between actors of one arbiter costs less than waking the engine's task twice. A
/// chunk whose input went missing (forgotten meanwhile) abandons the step and drops that row.
#[derive(Message)]
#[rtype(result = "Result<Batch, ChunkingError>")]
pub struct Assemble {
    pub node: Name,
    pub walk: Name,
}

impl Handler<Assemble> for Scheduler {
    type Result = ResponseActFuture<Self, Result<Batch, ChunkingError>>;

    fn handle(&mut self, m: Assemble, _: &mut Self::Context) -> Self::Result {
        let started = Instant::now();
        let batch = match self.state.assemble(&m.node, &m.walk) {
            Ok(batch) => batch,
            Err(e) => return Box::pin(fut::ready(Err(e))),
        };
        let took = started.elapsed();
        self.step_metrics(&batch.node, &batch.walk)
            .assembled(&batch, took);
        if !batch
            .rows
            .iter()
            .any(|r| matches!(r.work, Work::Chunk { .. }))
        {
            return Box::pin(fut::ready(Ok(batch)));
        }
        let (step, node) = (batch.step, batch.node.clone());
        let cut = self.prepared.send(Guarded(Cut(batch)));
        Box::pin(
            cut.into_actor(self)
                .map(move |answer, act, _| match answer {
                    Ok(Ok(CutBatch { batch, missing })) if missing.is_empty() => Ok(batch),
                    Ok(Ok(CutBatch { missing, .. })) => {
                        act.state.abandon(step, &missing)?;
                        Err(ChunkingError::MissingPreparedInput {
                            rid: missing[0],
                            node,
                        })
                    }
                    // Without the batch the engine cannot complete the step: do not leave it
                    // blocking the node.
                    Ok(Err(e)) => {
                        act.state.abandon(step, &[])?;
                        Err(e)
                    }
                    Err(e) => {
                        act.state.abandon(step, &[])?;
                        Err(ChunkingError::ActorUnavailable {
                            actor: "PreparedInputs",
                            reason: e.to_string(),
                        })
                    }
                }),
        )
    }
}

/// Abandons a step in flight without advancing it, dropping rows whose input went missing.
#[derive(Message)]
#[rtype(result = "Result<(), ChunkingError>")]
pub struct Abandon {
    pub step: u64,
    pub drop_rids: Vec<u64>,
}

impl Handler<Abandon> for Scheduler {
    type Result = Result<(), ChunkingError>;

    fn handle(&mut self, m: Abandon, _: &mut Self::Context) -> Self::Result {
        self.state.abandon(m.step, &m.drop_rids)
    }
}

/// Completes a step: `ran[i]` is what row `i` of its batch actually ran.
#[derive(Message)]
#[rtype(result = "Result<StepOutcome, ChunkingError>")]
pub struct Complete {
    pub step: u64,
    pub ran: Vec<u32>,
}

impl Handler<Complete> for Scheduler {
    type Result = Result<StepOutcome, ChunkingError>;

    fn handle(&mut self, m: Complete, _: &mut Self::Context) -> Self::Result {
        let outcome = self.state.complete(m.step, &m.ran)?;
        if let Some(o) = &outcome.overrun {
            self.overruns.do_send(RecordOverrun(o.clone()));
        }
        if !outcome.finished.is_empty() {
            self.prepared.do_send(Release {
                node: outcome.node.clone(),
                rids: outcome.finished.clone(),
            });
        }
        self.step_metrics(&outcome.node, &outcome.walk)
            .completed(&outcome);
        Ok(outcome)
    }
}

/// Prefill rows queued over all nodes, and steps in flight.
#[derive(Message)]
#[rtype(result = "QueueStats")]
pub struct SchedulerStats;

/// Prefill rows queued over all nodes, and steps in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq, MessageResponse)]
pub struct QueueStats {
    pub prefill_rows: usize,
    pub steps_in_flight: usize,
}

impl Handler<SchedulerStats> for Scheduler {
    type Result = QueueStats;

    fn handle(&mut self, _: SchedulerStats, _: &mut Self::Context) -> QueueStats {
        QueueStats {
            prefill_rows: self.state.prefill_rows(),
            steps_in_flight: self.state.steps_in_flight(),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::sync::Arc;

    use super::*;
    use crate::actors::Insert;
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
        let prepared = PreparedInputs::default().start();
        let scheduler =
            Scheduler::new(prepared.clone(), OverrunAccounting::default().start()).start();
        scheduler
            .send(UseSnapshot(Arc::new(snapshot)))
            .await
            .unwrap();
        (scheduler, prepared)
    }

    #[actix::test]
    async fn a_chunk_without_input_abandons_its_step_and_the_next_one_runs() {
        let (scheduler, prepared) = start().await;
        let (node, walk) = (Name::from("llm"), Name::from("prefill"));
        for rid in [1, 2] {
            let admit = Admit {
                rid,
                node: node.clone(),
                walk: walk.clone(),
                total: 10,
                cached: 0,
            };
            scheduler.send(admit).await.unwrap().unwrap();
        }
        // Only rid 2's input is held: rid 1's went missing.
        let input = PreparedInput::tokens((0..10).collect::<Vec<u32>>());
        let insert = Insert {
            rid: 2,
            node: node.clone(),
            input,
        };
        prepared.send(insert).await.unwrap().unwrap();
        let assemble = || Assemble {
            node: node.clone(),
            walk: walk.clone(),
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
        let node = Name::from("llm");
        let input = PreparedInput::tokens(vec![1, 2, 3]);
        let insert = Insert {
            rid: 3,
            node: node.clone(),
            input: input.clone(),
        };
        prepared.send(insert).await.unwrap().unwrap();
        let admit = |rid| AdmitPrepared {
            rid,
            node: node.clone(),
            walk: "prefill".into(),
            input: input.clone(),
            cached: 0,
        };
        let err = scheduler.send(admit(3)).await.unwrap().unwrap_err();
        assert!(
            matches!(err, ChunkingError::AlreadyQueued { rid: 3, .. }),
            "{err}"
        );
        let stats = scheduler.send(SchedulerStats).await.unwrap();
        assert_eq!(stats.prefill_rows, 0);
        scheduler.send(admit(4)).await.unwrap().unwrap();
        let stats = scheduler.send(SchedulerStats).await.unwrap();
        assert_eq!(stats.prefill_rows, 1);
    }
}
