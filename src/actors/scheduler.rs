//! Scheduler: the row queues per node. Assembles each step's batch from the budget snapshot;
//! on completion sends overruns to OverrunAccounting and releases finished rows' inputs to
//! PreparedInputs.

use std::time::Instant;

use actix::prelude::*;
use rustc_hash::FxHashMap;

use super::budget_config::UseSnapshot;
use super::overrun_accounting::{OverrunAccounting, RecordOverrun};
use super::prepared_inputs::{PreparedInputs, Release};
use crate::error::ChunkingError;
use crate::metrics::StepMetrics;
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
        Assemble,
        Abandon,
        Complete,
        SchedulerStats,
        super::InjectPanic
    ]
);

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

/// Assembles the next step of `node`/`walk` (chunk inputs not cut yet).
#[derive(Message)]
#[rtype(result = "Result<Batch, ChunkingError>")]
pub struct Assemble {
    pub node: Name,
    pub walk: Name,
}

impl Handler<Assemble> for Scheduler {
    type Result = Result<Batch, ChunkingError>;

    fn handle(&mut self, m: Assemble, _: &mut Self::Context) -> Self::Result {
        let started = Instant::now();
        let batch = self.state.assemble(&m.node, &m.walk)?;
        let took = started.elapsed();
        self.step_metrics(&batch.node, &batch.walk)
            .assembled(&batch, took);
        Ok(batch)
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
