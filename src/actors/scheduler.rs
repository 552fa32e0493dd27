//! Scheduler: receives the engine's row and step messages and calls [`SchedulerState`], which
//! holds the row queues, the prepared inputs, the steps in flight, the last one-trip
//! completion and the drain. Around each call it keeps the tracing spans and metric handles,
//! tells OverrunAccounting about overruns and sends PreparedInputs' accounting the changes to
//! the inputs held (`docs/actors.md#prepared-inputs`).

use std::sync::Arc;

use actix::prelude::*;

use super::budget_config::UseSnapshot;
use super::overrun_accounting::OverrunAccounting;
use super::prepared_inputs::{Apply, PreparedInputs, ReleaseAll};
use super::scheduler_shell::Shell;
use super::spans::Spans;
use super::Guarded;
use crate::error::ChunkingError;
use crate::metrics::Instance;
use crate::order::AdmitOptions;
use crate::policy::Name;
use crate::prepared::PreparedInput;
use crate::scheduler::{
    Batch, Completed, LateMeasurement, LatencyModelReport, SchedulerState, StepOutcome, Then,
};
pub use crate::scheduler::{DrainReport, QueueStats};

/// Wraps [`SchedulerState`].
pub(crate) struct Scheduler {
    state: SchedulerState,
    shell: Shell,
}

impl Scheduler {
    pub(crate) fn new(
        instance: Instance,
        prepared: Addr<PreparedInputs>,
        overruns: Addr<OverrunAccounting>,
    ) -> Self {
        Self {
            state: SchedulerState::default(),
            shell: Shell::new(instance, prepared, overruns),
        }
    }

    /// Sends PreparedInputs the changes the message being handled made to the inputs held, if
    /// any: the last thing every handler that changes them does, so PreparedInputs has them
    /// before the caller can ask it anything after the answer.
    fn send_input_changes(&mut self) {
        if let Some(changes) = self.state.take_input_changes() {
            self.shell.prepared.do_send(Guarded(Apply(changes)));
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
        AdmitPrepared,
        ContinueRow,
        ForgetRequest,
        ForgetRow,
        Assemble,
        Abandon,
        Complete,
        CompleteAndAssemble,
        SchedulerStats,
        BeginDrain,
        Drain,
        GetLatencyModel,
        GetPrepared,
        MeasuredLate
    ]
);

impl Handler<UseSnapshot> for Scheduler {
    type Result = ();

    fn handle(&mut self, msg: UseSnapshot, _: &mut Self::Context) {
        // Every node's queue-depth series exists from the first snapshot on, at 0.
        let nodes: Vec<Name> = msg.0.table().model().nodes().cloned().collect();
        self.state.set_snapshot(msg.0);
        for node in &nodes {
            self.shell.publish_queue(&self.state, node);
            let model = self.state.latency_model(node);
            self.shell.publish_model(node, model);
        }
    }
}

/// Admits a prompt whole (`SchedulerState::admit`). PreparedInputs' accounting gets
/// the input's change before anything the caller asks it after this answer, as a mailbox is
/// first in, first out.
#[derive(Message)]
#[rtype(result = "Result<(), ChunkingError>")]
pub(crate) struct AdmitPrepared {
    pub(crate) rid: u64,
    pub(crate) node: Name,
    pub(crate) walk: Name,
    pub(crate) input: PreparedInput,
    pub(crate) options: AdmitOptions,
}

impl Handler<AdmitPrepared> for Scheduler {
    type Result = Result<(), ChunkingError>;

    fn handle(&mut self, m: AdmitPrepared, _: &mut Self::Context) -> Self::Result {
        let admitted =
            self.state
                .admit(m.rid, &m.node, &m.walk, m.input, m.options, &mut self.shell);
        self.send_input_changes();
        admitted
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
        self.state.continue_row(
            m.rid,
            &m.node,
            &m.walk,
            m.estimate,
            m.context,
            &mut self.shell,
        )
    }
}

/// Ends a request: drops its rows and inputs on every node.
#[derive(Message)]
#[rtype(result = "Result<(), ChunkingError>")]
pub(crate) struct ForgetRequest(pub(crate) u64);

impl Handler<ForgetRequest> for Scheduler {
    type Result = Result<(), ChunkingError>;

    fn handle(&mut self, m: ForgetRequest, _: &mut Self::Context) -> Self::Result {
        self.state.forget_request(m.0, &mut self.shell);
        self.send_input_changes();
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
        let had_prefill = self.state.release(m.rid, &m.node, &mut self.shell);
        self.send_input_changes();
        Ok(had_prefill)
    }
}

/// Assembles the next step of `node`/`walk` with its chunks' views cut, or answers the node's
/// step in flight again (`SchedulerState::assemble`): one message, no other actor waited
/// on.
#[derive(Message)]
#[rtype(result = "Result<Arc<Batch>, ChunkingError>")]
pub(crate) struct Assemble {
    pub(crate) node: Name,
    pub(crate) walk: Name,
    /// The step's time on the engine's clock, if given (`assemble_at`).
    pub(crate) now_ms: Option<f64>,
}

impl Handler<Assemble> for Scheduler {
    type Result = Result<Arc<Batch>, ChunkingError>;

    fn handle(&mut self, m: Assemble, _: &mut Self::Context) -> Self::Result {
        let batch = self
            .state
            .assemble(&m.node, &m.walk, m.now_ms, &mut self.shell);
        self.send_input_changes();
        batch
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
        let span = self.shell.spans.step(m.step);
        let _step = span.enter();
        match self.state.abandon(m.step, &[]) {
            Ok(()) => {
                tracing::debug!("step abandoned");
                self.shell.spans.ended(m.step);
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
        let outcome = self
            .state
            .complete(m.step, &m.ran, m.measured_ms, &mut self.shell);
        self.send_input_changes();
        outcome
    }
}

/// Completes step `step` and assembles the step `then` names, with its row changes applied
/// between (`SchedulerState::complete_and_assemble`): one round trip per step for the engine,
/// with a lost answer's repeat answered again.
#[derive(Message)]
#[rtype(result = "Result<Box<Completed>, ChunkingError>")]
pub(crate) struct CompleteAndAssemble {
    pub(crate) step: u64,
    pub(crate) ran: Vec<u32>,
    pub(crate) measured_ms: Option<f64>,
    pub(crate) then: Then,
}

impl Handler<CompleteAndAssemble> for Scheduler {
    type Result = Result<Box<Completed>, ChunkingError>;

    fn handle(&mut self, m: CompleteAndAssemble, _: &mut Self::Context) -> Self::Result {
        let done =
            self.state
                .complete_and_assemble(m.step, m.ran, m.measured_ms, m.then, &mut self.shell);
        self.send_input_changes();
        done.map(Box::new)
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
        let steps_in_flight = self.state.begin_drain();
        tracing::info!(steps_in_flight, "draining: no more admissions or steps");
        Ok(steps_in_flight)
    }
}

/// Ends a drain (`ChunkingManagement::drain`): abandons the steps still in flight, drops every
/// row and every input, and has PreparedInputs' accounting cleared; answers what was dropped.
#[derive(Message)]
#[rtype(result = "Result<DrainReport, ChunkingError>")]
pub(crate) struct Drain;

impl Handler<Drain> for Scheduler {
    type Result = Result<DrainReport, ChunkingError>;

    fn handle(&mut self, _: Drain, _: &mut Self::Context) -> Self::Result {
        let report = self.state.drain(&mut self.shell);
        self.shell.spans = Spans::new(self.shell.instance.model_name().clone());
        self.shell.prepared.do_send(Guarded(ReleaseAll));
        tracing::info!(?report, "drained");
        Ok(report)
    }
}

/// Rows queued over all nodes, and steps in flight.
#[derive(Message)]
#[rtype(result = "Result<QueueStats, ChunkingError>")]
pub(crate) struct SchedulerStats;

impl Handler<SchedulerStats> for Scheduler {
    type Result = Result<QueueStats, ChunkingError>;

    fn handle(&mut self, _: SchedulerStats, _: &mut Self::Context) -> Self::Result {
        Ok(self.state.stats())
    }
}

/// The latency model a node plans with (`ChunkingManagement::latency_model`).
#[derive(Message)]
#[rtype(result = "Result<LatencyModelReport, ChunkingError>")]
pub(crate) struct GetLatencyModel(pub(crate) Name);

impl Handler<GetLatencyModel> for Scheduler {
    type Result = Result<LatencyModelReport, ChunkingError>;

    fn handle(&mut self, m: GetLatencyModel, _: &mut Self::Context) -> Self::Result {
        self.state.latency_report(&m.0)
    }
}

/// A row's whole input (a cheap clone of its `Arc`s), `ChunkingManagement::prepared`.
#[derive(Message)]
#[rtype(result = "Result<Option<PreparedInput>, ChunkingError>")]
pub(crate) struct GetPrepared {
    pub(crate) rid: u64,
    pub(crate) node: Name,
}

impl Handler<GetPrepared> for Scheduler {
    type Result = Result<Option<PreparedInput>, ChunkingError>;

    fn handle(&mut self, m: GetPrepared, _: &mut Self::Context) -> Self::Result {
        Ok(self.state.prepared(m.rid, &m.node))
    }
}

/// A step's time measured after its completion (`ChunkingManagement::measured_late`).
#[derive(Message)]
#[rtype(result = "Result<LateMeasurement, ChunkingError>")]
pub(crate) struct MeasuredLate {
    pub(crate) step: u64,
    pub(crate) ms: f64,
}

impl Handler<MeasuredLate> for Scheduler {
    type Result = Result<LateMeasurement, ChunkingError>;

    fn handle(&mut self, m: MeasuredLate, _: &mut Self::Context) -> Self::Result {
        let late = self.state.take_late_measurement(m.step, m.ms)?;
        self.shell
            .step_metrics(&late.node, &late.walk)
            .measured_late(&late);
        self.shell.publish_model(&late.node, late.model);
        if let (Some(margin), Some(gauges)) =
            (late.time_margin, self.shell.model_gauges.get(&late.node))
        {
            gauges.set_margin(margin);
        }
        Ok(late)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::sync::Arc;

    use super::*;
    use crate::actors::prepared_inputs::PreparedTotals;
    use crate::budget::BudgetTable;
    use crate::planner::RowWork;
    use crate::policy::{ChunkingPolicy, ModelPolicies, SubmoduleCaps};
    use crate::prepared::PreparedInput;
    use crate::scheduler::NextStep;
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
            options: AdmitOptions::default(),
        })
    }

    /// Drops the input of `(rid, llm)` from the state's store behind the queue's back: the
    /// store and the queues disagree, which nothing but this test does.
    struct LoseHandle(u64);

    impl Message for LoseHandle {
        type Result = ();
    }

    impl Handler<LoseHandle> for Scheduler {
        type Result = ();

        fn handle(&mut self, m: LoseHandle, _: &mut Self::Context) {
            assert!(self.state.inputs.release(m.0, "llm"));
        }
    }

    async fn totals(prepared: &Addr<PreparedInputs>) -> (usize, u64) {
        prepared
            .send(Guarded(PreparedTotals))
            .await
            .unwrap()
            .unwrap()
    }

    #[actix::test]
    async fn a_chunk_without_input_abandons_its_step_and_the_next_one_runs() {
        let (scheduler, prepared) = start().await;
        for rid in [1, 2] {
            let input = PreparedInput::tokens((0..10).collect::<Vec<u32>>());
            scheduler.send(admit(rid, input)).await.unwrap().unwrap();
        }
        assert_eq!(totals(&prepared).await, (2, 20));
        scheduler.send(LoseHandle(1)).await.unwrap();
        let assemble = || {
            Guarded(Assemble {
                node: "llm".into(),
                walk: "prefill".into(),
                now_ms: None,
            })
        };

        let err = scheduler.send(assemble()).await.unwrap().unwrap_err();
        assert!(
            matches!(err, ChunkingError::MissingPreparedInput { rid: 1, .. }),
            "{err}"
        );
        // The row is dropped, and PreparedInputs releases its input.
        assert_eq!(totals(&prepared).await, (1, 10));
        let batch = scheduler.send(assemble()).await.unwrap().unwrap();
        assert_eq!(batch.rows.len(), 1);
        assert_eq!(batch.rows[0].rid, 2);
        let input = batch.rows[0].input.as_ref().expect("the chunk is cut");
        assert_eq!(input.token_ids(), &[0, 1, 2, 3, 4, 5, 6, 7]);
        let stats = scheduler
            .send(Guarded(SchedulerStats))
            .await
            .unwrap()
            .unwrap();
        assert_eq!((stats.prefill_rows, stats.steps_in_flight), (1, 1));
    }

    #[actix::test]
    async fn a_refused_admission_queues_and_holds_nothing() {
        let (scheduler, prepared) = start().await;
        let input = PreparedInput::tokens(vec![1, 2, 3]);
        scheduler
            .send(admit(3, input.clone()))
            .await
            .unwrap()
            .unwrap();
        let err = scheduler
            .send(admit(3, PreparedInput::tokens(vec![9; 5])))
            .await
            .unwrap()
            .unwrap_err();
        assert!(
            matches!(err, ChunkingError::AlreadyQueued { rid: 3, .. }),
            "{err}"
        );
        let err = scheduler
            .send(admit(4, PreparedInput::tokens(Vec::new())))
            .await
            .unwrap()
            .unwrap_err();
        assert!(
            matches!(err, ChunkingError::EmptyInput { rid: 4, .. }),
            "{err}"
        );
        let stats = scheduler
            .send(Guarded(SchedulerStats))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(stats.prefill_rows, 1);
        assert_eq!(
            totals(&prepared).await,
            (1, 3),
            "only the first input is held"
        );
        // The first input is the one cut.
        let batch = scheduler
            .send(Guarded(Assemble {
                node: "llm".into(),
                walk: "prefill".into(),
                now_ms: None,
            }))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            batch.rows[0].input.as_ref().unwrap().token_ids(),
            &[1, 2, 3]
        );
    }

    fn assemble_llm() -> Guarded<Assemble> {
        Guarded(Assemble {
            node: "llm".into(),
            walk: "prefill".into(),
            now_ms: None,
        })
    }

    fn one_trip(
        step: u64,
        ran: Vec<u32>,
        ms: Option<f64>,
        next: NextStep,
    ) -> Guarded<CompleteAndAssemble> {
        Guarded(CompleteAndAssemble {
            step,
            ran,
            measured_ms: ms,
            then: Then::Next(next),
        })
    }

    #[actix::test]
    async fn forgetting_a_request_or_a_row_drops_its_handle_and_its_held_input() {
        let (scheduler, prepared) = start().await;
        for rid in [1, 2, 3] {
            let input = PreparedInput::tokens(vec![rid as u32; 10]);
            scheduler.send(admit(rid, input)).await.unwrap().unwrap();
        }
        scheduler
            .send(Guarded(ForgetRequest(1)))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(totals(&prepared).await, (2, 20));
        let forget_row = |rid| {
            Guarded(ForgetRow {
                rid,
                node: "llm".into(),
            })
        };
        assert!(scheduler.send(forget_row(2)).await.unwrap().unwrap());
        assert!(!scheduler.send(forget_row(2)).await.unwrap().unwrap());
        assert_eq!(totals(&prepared).await, (1, 10));
        let batch = scheduler.send(assemble_llm()).await.unwrap().unwrap();
        let rids: Vec<u64> = batch.rows.iter().map(|r| r.rid).collect();
        assert_eq!(rids, [3]);
        assert_eq!(batch.rows[0].input.as_ref().unwrap().token_ids(), &[3; 8]);
    }

    #[actix::test]
    async fn a_one_trip_step_releases_what_finished_and_cuts_what_it_admitted() {
        let (scheduler, prepared) = start().await;
        let input = PreparedInput::tokens(vec![1; 8]);
        scheduler.send(admit(1, input)).await.unwrap().unwrap();
        let step = scheduler.send(assemble_llm()).await.unwrap().unwrap().step;
        let next = NextStep::new("llm", "prefill").admit(
            2,
            "prefill",
            PreparedInput::tokens(vec![2; 5]),
            0,
        );
        let done = scheduler
            .send(one_trip(step, vec![8], Some(3.0), next.clone()))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(done.outcome.finished, [1]);
        let batch = done.next.clone().unwrap();
        assert_eq!(batch.rows.len(), 1);
        assert_eq!(batch.rows[0].rid, 2);
        assert_eq!(batch.rows[0].input.as_ref().unwrap().token_ids(), &[2; 5]);
        assert_eq!(totals(&prepared).await, (1, 5), "1 released, 2 held");

        // A repeat (the answer was lost) is answered again, changing nothing.
        let again = scheduler
            .send(one_trip(step, vec![8], Some(3.0), next.clone()))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(again.outcome, done.outcome);
        assert_eq!(again.next.unwrap().step, batch.step);
        assert_eq!(totals(&prepared).await, (1, 5));
        // A repeat with other counts, or another time, is refused.
        for (ran, ms) in [(vec![0], Some(3.0)), (vec![8], Some(4.0)), (vec![8], None)] {
            let err = scheduler
                .send(one_trip(step, ran, ms, next.clone()))
                .await
                .unwrap()
                .unwrap_err();
            assert!(
                matches!(err, ChunkingError::CompletedDifferently { .. }),
                "{err}"
            );
        }
        // A step that is not in flight is unknown.
        let err = scheduler
            .send(one_trip(
                batch.step + 5,
                vec![5],
                None,
                NextStep::new("llm", "prefill"),
            ))
            .await
            .unwrap()
            .unwrap_err();
        assert!(matches!(err, ChunkingError::UnknownStep { .. }), "{err}");
    }

    #[actix::test]
    async fn a_begun_drain_refuses_admissions_and_steps_but_applies_forgets() {
        let (scheduler, prepared) = start().await;
        for rid in [1, 2] {
            let input = PreparedInput::tokens(vec![0; 10]);
            scheduler.send(admit(rid, input)).await.unwrap().unwrap();
        }
        let step = scheduler.send(assemble_llm()).await.unwrap().unwrap().step;
        let in_flight = scheduler.send(Guarded(BeginDrain)).await.unwrap().unwrap();
        assert_eq!(in_flight, 1);
        let err = scheduler
            .send(admit(3, PreparedInput::tokens(vec![0; 4])))
            .await
            .unwrap()
            .unwrap_err();
        assert!(matches!(err, ChunkingError::Draining), "{err}");
        // The step in flight completes; the forget is applied, the admission after it refused,
        // and no next step is planned.
        let next = NextStep::new("llm", "prefill").forget_request(2).admit(
            4,
            "prefill",
            PreparedInput::tokens(vec![0; 4]),
            0,
        );
        let done = scheduler
            .send(one_trip(step, vec![8], None, next))
            .await
            .unwrap()
            .unwrap();
        assert!(
            matches!(done.next, Err(ChunkingError::Draining)),
            "{:?}",
            done.next
        );
        assert_eq!(
            totals(&prepared).await,
            (1, 10),
            "rid 2 forgotten, rid 4 not held"
        );
        let stats = scheduler
            .send(Guarded(SchedulerStats))
            .await
            .unwrap()
            .unwrap();
        assert_eq!((stats.prefill_rows, stats.steps_in_flight), (1, 0));
    }

    /// The gauges of a debugging recorder's snapshot (which resets them to 0): `(name, node,
    /// source label, value)`.
    fn gauges(
        snapshotter: &metrics_util::debugging::Snapshotter,
    ) -> Vec<(String, String, String, f64)> {
        let label = |key: &metrics::Key, name: &str| {
            key.labels()
                .find(|l| l.key() == name)
                .map_or(String::new(), |l| l.value().to_string())
        };
        snapshotter
            .snapshot()
            .into_vec()
            .into_iter()
            .filter_map(|(key, _, _, value)| match value {
                metrics_util::debugging::DebugValue::Gauge(v) => Some((
                    key.key().name().to_string(),
                    label(key.key(), "node"),
                    label(key.key(), "source"),
                    v.into_inner(),
                )),
                _ => None,
            })
            .collect()
    }

    fn gauge(seen: &[(String, String, String, f64)], name: &str, source: &str) -> Option<f64> {
        seen.iter()
            .find(|(n, node, s, _)| n == name && node == "llm" && s == source)
            .map(|g| g.3)
    }

    #[actix::test]
    async fn the_queue_and_model_gauges_follow_admissions_and_forgets() {
        use crate::metrics::{LATENCY_MODEL_SOURCE, ROWS_WAITING};
        let recorder = metrics_util::debugging::DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        // The actors run on this thread: their gauges register with this recorder.
        let _recorder = metrics::set_default_local_recorder(&recorder);
        let (scheduler, _prepared) = start().await;
        for rid in [1, 2] {
            let input = PreparedInput::tokens(vec![0; 10]);
            scheduler.send(admit(rid, input)).await.unwrap().unwrap();
        }
        let seen = gauges(&snapshotter);
        assert_eq!(gauge(&seen, ROWS_WAITING, ""), Some(2.0));
        // No latency model: its source gauge says so.
        assert_eq!(gauge(&seen, LATENCY_MODEL_SOURCE, "none"), Some(1.0));
        scheduler
            .send(Guarded(ForgetRequest(1)))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(gauge(&gauges(&snapshotter), ROWS_WAITING, ""), Some(1.0));
    }

    #[actix::test]
    async fn a_continuing_row_runs_and_an_abandoned_step_is_planned_again_afresh() {
        let (scheduler, prepared) = start().await;
        let continue_row = Guarded(ContinueRow {
            rid: 5,
            node: "llm".into(),
            walk: "prefill".into(),
            estimate: 2,
            context: None,
        });
        scheduler.send(continue_row).await.unwrap().unwrap();
        let batch = scheduler.send(assemble_llm()).await.unwrap().unwrap();
        let rows: Vec<(u64, RowWork)> = batch.rows.iter().map(|r| (r.rid, r.work)).collect();
        assert_eq!(rows, [(5, RowWork::Continue { estimate: 2 })]);
        let abandon = Guarded(Abandon { step: batch.step });
        scheduler.send(abandon).await.unwrap().unwrap();
        let again = scheduler.send(assemble_llm()).await.unwrap().unwrap();
        assert_ne!(
            again.step, batch.step,
            "planned afresh, not the abandoned step"
        );
        assert_eq!(again.rows.len(), 1);
        // The Scheduler answers a held input, and nothing for a row it does not hold.
        let input = PreparedInput::tokens(vec![4, 5, 6]);
        scheduler
            .send(admit(9, input.clone()))
            .await
            .unwrap()
            .unwrap();
        let get = |rid| {
            Guarded(GetPrepared {
                rid,
                node: "llm".into(),
            })
        };
        let held = scheduler.send(get(9)).await.unwrap().unwrap();
        assert_eq!(held, Some(input));
        assert_eq!(scheduler.send(get(10)).await.unwrap().unwrap(), None);
        assert_eq!(totals(&prepared).await, (1, 3));
    }

    #[actix::test]
    async fn the_stats_count_prefill_mid_prefill_and_continuing_rows() {
        let (scheduler, _prepared) = start().await;
        let input = PreparedInput::tokens(vec![0; 10]);
        scheduler.send(admit(1, input)).await.unwrap().unwrap();
        // Its first chunk (8 of 10 tokens) leaves it mid-prefill.
        let batch = scheduler.send(assemble_llm()).await.unwrap().unwrap();
        let complete = Guarded(Complete {
            step: batch.step,
            ran: vec![8],
            measured_ms: None,
        });
        scheduler.send(complete).await.unwrap().unwrap();
        let continue_row = Guarded(ContinueRow {
            rid: 5,
            node: "llm".into(),
            walk: "prefill".into(),
            estimate: 1,
            context: None,
        });
        scheduler.send(continue_row).await.unwrap().unwrap();
        let stats = scheduler
            .send(Guarded(SchedulerStats))
            .await
            .unwrap()
            .unwrap();
        let want = QueueStats {
            prefill_rows: 1,
            mid_prefill_rows: 1,
            continuing_rows: 1,
            steps_in_flight: 0,
        };
        assert_eq!(stats, want);
    }

    #[actix::test]
    async fn a_drain_reports_and_drops_the_handles_and_the_held_inputs() {
        let (scheduler, prepared) = start().await;
        for rid in [1, 2] {
            let input = PreparedInput::tokens(vec![0; 10]);
            scheduler.send(admit(rid, input)).await.unwrap().unwrap();
        }
        scheduler.send(assemble_llm()).await.unwrap().unwrap();
        let report = scheduler.send(Guarded(Drain)).await.unwrap().unwrap();
        let want = DrainReport {
            steps_abandoned: 1,
            requests: 2,
            rows: 2,
            prepared_inputs: 2,
            prepared_tokens: 20,
        };
        assert_eq!(report, want);
        assert_eq!(totals(&prepared).await, (0, 0));
        let again = scheduler.send(Guarded(Drain)).await.unwrap().unwrap();
        assert_eq!(again, DrainReport::default());
    }
}
