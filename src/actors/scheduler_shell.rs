//! What the Scheduler actor does around each call on [`SchedulerState`]: the
//! [`StepHooks`] that keep the tracing spans and metric handles, tell OverrunAccounting about
//! overruns and log what the engine should hear of. It holds nothing the scheduling rules read.

use std::time::Duration;

use actix::prelude::*;
use rustc_hash::FxHashMap;

use super::overrun_accounting::{OverrunAccounting, RecordOverrun};
use super::prepared_inputs::PreparedInputs;
use super::spans::Spans;
use crate::error::ChunkingError;
use crate::latency::{LatencyModel, ModelSource};
use crate::metrics::{Instance, ModelGauges, QueueGauges, StepMetrics};
use crate::policy::Name;
use crate::scheduler::serving::StepHooks;
use crate::scheduler::{Batch, SchedulerState, StepOutcome};

/// What the Scheduler does around the state's calls ([`StepHooks`]): metric handles, spans and
/// the other actors' addresses. It holds nothing the scheduling rules read.
pub(super) struct Shell {
    pub(super) prepared: Addr<PreparedInputs>,
    pub(super) overruns: Addr<OverrunAccounting>,
    pub(super) instance: Instance,
    /// Metric handles per `(node, walk)`, resolved on a pair's first step: a short list (the
    /// model's pairs that ran), searched from the pair used last ([`Shell::step_metrics`]).
    pub(super) metrics: Vec<(Name, Name, StepMetrics)>,
    /// The index in `metrics` of the pair used last.
    pub(super) last_metrics: usize,
    /// Queue-depth gauges per node, resolved on the node's first change.
    pub(super) queue_gauges: FxHashMap<Name, QueueGauges>,
    /// Latency-model gauges per node.
    pub(super) model_gauges: FxHashMap<Name, ModelGauges>,
    /// The tracing spans of the steps in flight and of the requests admitted.
    pub(super) spans: Spans,
    /// Per `(node, walk)`, steps planned without their time budget, for the warning's cadence
    /// (touched only by such steps).
    pub(super) time_inactive: Vec<(Name, Name, u64)>,
    /// Time overruns per reason (indexed as [`TimeOverrunReason::ALL`]), counted per
    /// `(node, walk)` for the warning cadence.
    pub(super) time_overruns: [Vec<(Name, Name, u64)>; 4],
}

impl Shell {
    pub(super) fn new(
        instance: Instance,
        prepared: Addr<PreparedInputs>,
        overruns: Addr<OverrunAccounting>,
    ) -> Self {
        Self {
            prepared,
            overruns,
            metrics: Vec::new(),
            last_metrics: 0,
            queue_gauges: FxHashMap::default(),
            model_gauges: FxHashMap::default(),
            spans: Spans::new(instance.model_name().clone()),
            instance,
            time_inactive: Vec::new(),
            time_overruns: Default::default(),
        }
    }
}

/// Counts a step of `node`/`walk` planned without its time budget in `seen`; answers the pair's
/// count and whether to warn: on the 1st, 2nd, 4th, 8th, … (the overrun warnings' cadence).
pub(super) fn count_time_inactive(
    seen: &mut Vec<(Name, Name, u64)>,
    node: &Name,
    walk: &Name,
) -> (u64, bool) {
    let n = match seen.iter_mut().find(|(n, w, _)| n == node && w == walk) {
        Some((_, _, n)) => {
            *n += 1;
            *n
        }
        None => {
            seen.push((node.clone(), walk.clone(), 1));
            1
        }
    };
    (n, n.is_power_of_two())
}

impl Shell {
    /// The metric handles of `(node, walk)`, resolved on the pair's first step. A step is
    /// nearly always of the pair the last one was (both hooks of a step, and an engine that
    /// steps one node): that pair is compared first (pointers, then the names), so the lookup
    /// hashes nothing and clones no name; another pair is searched for among the few that ran.
    pub(super) fn step_metrics(&mut self, node: &Name, walk: &Name) -> &StepMetrics {
        let is = |(n, w, _): &(Name, Name, StepMetrics)| n == node && w == walk;
        let at = match self.metrics.get(self.last_metrics) {
            Some(last) if is(last) => self.last_metrics,
            _ => match self.metrics.iter().position(is) {
                Some(at) => at,
                None => {
                    let handles = self.instance.step(node, walk);
                    self.metrics.push((node.clone(), walk.clone(), handles));
                    self.metrics.len() - 1
                }
            },
        };
        self.last_metrics = at;
        &self.metrics[at].2
    }

    /// Sets the queue-depth gauges of `node` from its queues (0 when it has none yet).
    pub(super) fn publish_queue(&mut self, state: &SchedulerState, node: &Name) {
        let queues = state.node(node);
        let counts = queues.map(|q| q.counts()).unwrap_or_default();
        let wait = queues.and_then(|q| q.head_wait());
        let publish = |gauges: &QueueGauges| {
            gauges.set(counts);
            gauges.set_head_wait(wait);
        };
        // Looked up by the name: the key is cloned only on the node's first change.
        match self.queue_gauges.get(&**node) {
            Some(gauges) => publish(gauges),
            None => {
                let gauges = self.instance.queue(node);
                publish(&gauges);
                self.queue_gauges.insert(node.clone(), gauges);
            }
        }
    }

    /// Sets the latency-model gauges of `node`: its coefficients and their source.
    pub(super) fn publish_model(
        &mut self,
        node: &Name,
        model: (Option<LatencyModel>, ModelSource),
    ) {
        match self.model_gauges.get_mut(&**node) {
            Some(gauges) => gauges.set(model.0, model.1),
            None => {
                let mut gauges = self.instance.model(node);
                gauges.set(model.0, model.1);
                self.model_gauges.insert(node.clone(), gauges);
            }
        }
    }

    fn publish_all_queues(&mut self, state: &SchedulerState) {
        let nodes: Vec<Name> = self.queue_gauges.keys().cloned().collect();
        for n in nodes {
            self.publish_queue(state, &n);
        }
    }
}

impl StepHooks for Shell {
    fn admitted(&mut self, rid: u64, node: &Name, walk: &Name) {
        self.spans.admitted(rid, node, walk);
    }

    fn forgotten(&mut self, rid: u64) {
        self.spans.forgotten(rid);
    }

    fn assembled(&mut self, batch: &Batch, planned_in: Duration, in_flight: &dyn Fn(u64) -> bool) {
        self.step_metrics(&batch.node, &batch.walk)
            .assembled(batch, planned_in);
        self.spans.assembled(batch, in_flight);
    }

    /// Records in its span why the step was abandoned, and closes the span (tracing only).
    fn abandoned(&mut self, step: u64, why: &ChunkingError) {
        self.spans
            .step(step)
            .in_scope(|| tracing::debug!(error = %why, "step abandoned"));
        self.spans.ended(step);
    }

    /// Overruns recorded (in the step's span), the span closed, metrics.
    fn completed(&mut self, outcome: &StepOutcome) {
        let span = self.spans.step(outcome.step);
        span.in_scope(|| {
            tracing::debug!(
                ran_tokens = outcome.tokens.ran,
                finished = outcome.finished.len(),
                "step completed"
            );
            if let Some(reason) = outcome.time_overrun {
                tracing::debug!(reason = reason.as_str(), "step ran over its time budget");
            }
        });
        if let Some(reason) = outcome.time_overrun {
            let seen = &mut self.time_overruns[reason as usize];
            let (n, warn) = count_time_inactive(seen, &outcome.node, &outcome.walk);
            if warn {
                tracing::warn!(
                    node = %outcome.node,
                    walk = %outcome.walk,
                    reason = reason.as_str(),
                    measured_ms = outcome.measured_ms,
                    overruns = n,
                    "a step of {}/{} ran over its time budget ({}), {} such so far: {}",
                    outcome.node,
                    outcome.walk,
                    reason.as_str(),
                    n,
                    reason.describe()
                );
            }
        }
        if let Some(o) = &outcome.overrun {
            self.overruns
                .do_send(RecordOverrun(o.clone(), span.clone()));
        }
        if let Some(reason) = outcome.time_inactive {
            let (n, warn) =
                count_time_inactive(&mut self.time_inactive, &outcome.node, &outcome.walk);
            if warn {
                tracing::warn!(
                    node = %outcome.node,
                    walk = %outcome.walk,
                    reason = reason.as_str(),
                    steps = n,
                    "time budget not applied: a step of {}/{} planned under its token budget alone ({}), {} so far; give the node a latency model (chunking.cost, an engine's --cost) to plan against from the first step (docs/cost-model.md#when-a-time-budget-is-not-in-force)",
                    outcome.node,
                    outcome.walk,
                    reason.describe(),
                    n
                );
            }
        }
        self.spans.ended(outcome.step);
        self.step_metrics(&outcome.node, &outcome.walk)
            .completed(outcome);
        self.publish_model(&outcome.node, outcome.model);
        if let (Some(margin), Some(gauges)) =
            (outcome.time_margin, self.model_gauges.get(&outcome.node))
        {
            gauges.set_margin(margin);
        }
    }

    /// Records a refused completion in the step's span. Tracing only, like the step's span
    /// itself: `tests/spans.rs` asserts both, in a process of its own (a tracing subscriber's
    /// level is process-wide).
    fn completion_refused(&mut self, step: u64, why: &ChunkingError) {
        self.spans
            .step(step)
            .in_scope(|| tracing::debug!(error = %why, "step completion refused"));
    }

    fn change_refused(&mut self, step: u64, why: &ChunkingError) {
        self.spans
            .step(step)
            .in_scope(|| tracing::debug!(error = %why, "row change refused after the step"));
    }

    fn stranded(&mut self, node: &Name, waiting: &Name, assembled: &Name) {
        tracing::warn!(
            node = %node,
            waiting = %waiting,
            assembled = %assembled,
            "{}",
            crate::scheduler::serving::stranded_message(node, waiting, assembled)
        );
    }

    fn queues_changed(&mut self, state: &SchedulerState, node: Option<&Name>) {
        match node {
            Some(node) => self.publish_queue(state, node),
            None => self.publish_all_queues(state),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::fmt::{Debug, Write as _};
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::{Arc, Mutex};

    use metrics_util::debugging::{DebugValue, DebuggingRecorder};
    use tracing::field::{Field, Visit};
    use tracing::span::{Attributes, Id, Record};
    use tracing::{Event, Metadata, Subscriber};

    use super::*;
    use crate::budget::BudgetTable;
    use crate::metrics::Instance;
    use crate::order::AdmitOptions;
    use crate::policy::{ChunkingPolicy, ModelPolicies, SubmoduleCaps};
    use crate::prepared::PreparedInput;
    use crate::scheduler::{NextStep, Then};

    /// A value's fields as ` name=value` pairs (a message as written).
    #[derive(Default)]
    struct Text(String);

    impl Visit for Text {
        fn record_debug(&mut self, field: &Field, value: &dyn Debug) {
            let _ = write!(self.0, " {}={value:?}", field.name());
        }
    }

    /// Every event as `LEVEL fields`, followed by ` in NAME fields` of the span it was in.
    #[derive(Default)]
    struct Captured {
        spans: Mutex<Vec<(String, String)>>,
        entered: Mutex<Vec<u64>>,
        events: Mutex<Vec<String>>,
        ids: AtomicU64,
    }

    struct Capture(Arc<Captured>);

    impl Subscriber for Capture {
        fn enabled(&self, _: &Metadata<'_>) -> bool {
            true
        }
        fn new_span(&self, span: &Attributes<'_>) -> Id {
            let mut fields = Text::default();
            span.record(&mut fields);
            let mut spans = self.0.spans.lock().unwrap();
            spans.push((span.metadata().name().to_owned(), fields.0));
            Id::from_u64(self.0.ids.fetch_add(1, Ordering::Relaxed) + 1)
        }
        fn record(&self, _: &Id, _: &Record<'_>) {}
        fn record_follows_from(&self, _: &Id, _: &Id) {}
        fn event(&self, event: &Event<'_>) {
            let mut fields = Text::default();
            event.record(&mut fields);
            let mut line = format!("{}{}", event.metadata().level(), fields.0);
            if let Some(&id) = self.0.entered.lock().unwrap().last() {
                let (name, fields) = &self.0.spans.lock().unwrap()[id as usize - 1];
                let _ = write!(line, " in {name}{fields}");
            }
            self.0.events.lock().unwrap().push(line);
        }
        fn enter(&self, span: &Id) {
            self.0.entered.lock().unwrap().push(span.into_u64());
        }
        fn exit(&self, _: &Id) {
            self.0.entered.lock().unwrap().pop();
        }
    }

    /// A shell whose actors run on the test's system, labelled `test`.
    /// The state of a node `llm` with a `prefill` walk under `settings`.
    fn prefill_state(settings: crate::budget::BudgetSettings) -> SchedulerState {
        let (llm, prefill) = (Name::from("llm"), Name::from("prefill"));
        let table = BudgetTable::from_policies(prefill_model(&llm, &prefill))
            .with_settings(settings)
            .unwrap();
        SchedulerState::with_table(table)
    }

    /// Admits an 8-token prompt as `rid` on `llm`/`prefill` and runs it whole in one step,
    /// measured `ms`.
    fn one_prompt_step(
        state: &mut SchedulerState,
        shell: &mut Shell,
        rid: u64,
        ms: Option<f64>,
    ) -> crate::scheduler::StepOutcome {
        let (llm, prefill) = (Name::from("llm"), Name::from("prefill"));
        let input = PreparedInput::tokens(vec![1; 8]);
        state
            .admit(rid, &llm, &prefill, input, AdmitOptions::cached(0), shell)
            .unwrap();
        let b = state.assemble("llm", "prefill", None, shell).unwrap();
        state.complete(b.step, &[8], ms, shell).unwrap()
    }

    fn test_shell() -> Shell {
        let instance = Instance::new("test".into());
        let prepared = PreparedInputs::new(instance.clone(), &[]).start();
        let overruns = OverrunAccounting::new(instance.clone()).start();
        Shell::new(instance, prepared, overruns)
    }

    /// A model whose node `llm` cuts `prefill` under a budget of 8 tokens.
    fn prefill_model(llm: &Name, prefill: &Name) -> Arc<ModelPolicies> {
        ModelPolicies::new(
            [(llm.clone(), SubmoduleCaps::new(["prefill"], false))].into(),
            [((llm.clone(), prefill.clone()), ChunkingPolicy::budget(8))].into(),
        )
        .unwrap()
        .shared()
    }

    /// Each hook leaves its trace: the request and step spans with their events, the step
    /// metrics and the model gauges. (Driven through the state, as the Scheduler actor does.)
    #[actix::test]
    async fn every_hook_is_heard_in_spans_events_and_metrics() {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        let captured = Arc::new(Captured::default());
        let dispatch = tracing::Dispatch::new(Capture(captured.clone()));
        let mut shell = test_shell();
        let (llm, prefill) = (Name::from("llm"), Name::from("prefill"));
        let model = prefill_model(&llm, &prefill);
        let mut state = SchedulerState::with_table(BudgetTable::from_policies(model));
        let why = ChunkingError::UnknownStep { step: 2 };
        let second = metrics::with_local_recorder(&recorder, || {
            tracing::dispatcher::with_default(&dispatch, || {
                for (rid, tokens) in [(7, 5), (8, 20)] {
                    let input = PreparedInput::tokens(vec![1; tokens]);
                    state
                        .admit(
                            rid,
                            &llm,
                            &prefill,
                            input,
                            AdmitOptions::cached(0),
                            &mut shell,
                        )
                        .unwrap();
                }
                let first = state.assemble("llm", "prefill", None, &mut shell).unwrap();
                let ran = first
                    .rows
                    .iter()
                    .map(crate::scheduler::BatchRow::tokens)
                    .collect();
                let next = NextStep::new("llm", "prefill");
                let done = state
                    .complete_and_assemble(first.step, ran, None, Then::Next(next), &mut shell)
                    .unwrap();
                let second = done.next.unwrap().step;
                shell.completion_refused(second, &why);
                shell.change_refused(second, &why);
                assert!(shell.spans.steps.contains_key(&second));
                shell.abandoned(second, &why);
                shell.forgotten(8);
                shell.stranded(&llm, &"decode".into(), &prefill);
                second
            })
        });
        assert!(
            !shell.spans.steps.contains_key(&second),
            "an abandoned step's span is closed"
        );
        assert!(shell.spans.requests.contains_key(&7) && !shell.spans.requests.contains_key(&8));
        let events = captured.events.lock().unwrap().clone();
        let heard = |what: &str, span: &str| {
            assert!(
                events.iter().any(|e| e.contains(what) && e.contains(span)),
                "no event {what:?} in {span:?} among {events:#?}"
            );
        };
        heard("request admitted", "in request model=test rid=7");
        heard("request forgotten", "in request model=test rid=8");
        heard("step assembled", "step=1");
        heard("step completed", "step=1");
        let step = format!("step={second}");
        heard("step completion refused", &step);
        heard("row change refused after the step", &step);
        heard("step abandoned", &step);
        heard(
            "WARN message=prompt rows of `llm` wait on walk `decode`",
            "",
        );
        let mut steps = None;
        let (mut assemblies, mut sources) = (0, 0);
        for (key, _, _, value) in snapshotter.snapshot().into_vec() {
            match (key.key().name(), value) {
                (n, DebugValue::Counter(c)) if n == crate::metrics::STEPS_TOTAL => steps = Some(c),
                (n, DebugValue::Histogram(h)) if n == crate::metrics::STEP_ASSEMBLY_SECONDS => {
                    assemblies += h.len();
                }
                (n, DebugValue::Gauge(_)) if n == crate::metrics::LATENCY_MODEL_SOURCE => {
                    sources += 1;
                }
                _ => {}
            }
        }
        assert_eq!(steps, Some(1), "one step completed");
        assert_eq!(assemblies, 2, "two steps assembled");
        assert!(
            sources > 0,
            "the completion published the node's model source"
        );
    }

    /// A step planned without its time budget is counted by reason in the metric, and warned
    /// at the 1st, 2nd, 4th, … such step of its `(node, walk)`.
    #[actix::test]
    async fn a_step_without_its_time_budget_is_counted_by_reason_and_warned_at_powers_of_two() {
        use crate::metrics::TIME_BUDGET_INACTIVE_STEPS_TOTAL;
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        let captured = Arc::new(Captured::default());
        let dispatch = tracing::Dispatch::new(Capture(captured.clone()));
        let mut shell = test_shell();
        // Learning, no configured model: no step is planned in time until the fit is trusted.
        let mut state = prefill_state(
            crate::budget::BudgetSettings::new(["prefill"])
                .learn_cost(true)
                .max_step_ms("llm", 50.0),
        );
        metrics::with_local_recorder(&recorder, || {
            tracing::dispatcher::with_default(&dispatch, || {
                // Five steps not measured, then one measured step and one more.
                for (rid, ms) in [None, None, None, None, None, Some(9.0), None]
                    .into_iter()
                    .enumerate()
                {
                    let out = one_prompt_step(&mut state, &mut shell, rid as u64, ms);
                    assert!(out.time_inactive.is_some());
                }
            });
        });
        let events = captured.events.lock().unwrap().clone();
        let warned: Vec<&String> = events
            .iter()
            .filter(|e| e.starts_with("WARN") && e.contains("time budget not applied"))
            .collect();
        assert_eq!(warned.len(), 3, "{events:#?}");
        for (w, n) in warned.iter().zip([1, 2, 4]) {
            assert!(w.contains(&format!("steps={n}")), "{w}");
            assert!(w.contains("reason=\"no_measurements\""), "{w}");
        }
        let mut counts = BTreeMap::new();
        for (key, _, _, value) in snapshotter.snapshot().into_vec() {
            if let (TIME_BUDGET_INACTIVE_STEPS_TOTAL, DebugValue::Counter(c)) =
                (key.key().name(), value)
            {
                let reason = key.key().labels().find(|l| l.key() == "reason").unwrap();
                counts.insert(reason.value().to_owned(), c);
            }
        }
        // The first six were planned before any measured time; the seventh after one.
        let want = BTreeMap::from([
            ("no_measurements".to_owned(), 6),
            ("untrusted_fit".to_owned(), 1),
        ]);
        assert_eq!(counts, want);
    }

    /// A step that ran over its time budget is warned at the 1st, 2nd, 4th, … such step of its
    /// `(node, walk)` and reason, with the reason's meaning: an engine whose CPU is shared says so.
    #[actix::test]
    async fn time_overruns_are_warned_at_powers_of_two_per_reason() {
        let captured = Arc::new(Captured::default());
        let dispatch = tracing::Dispatch::new(Capture(captured.clone()));
        let mut shell = test_shell();
        let cost = LatencyModel::try_new(1.0, 1.0, 0.0, 0.0).unwrap();
        let mut state = prefill_state(
            crate::budget::BudgetSettings::new(["prefill"])
                .cost("llm", cost)
                .max_step_ms("llm", 50.0),
        );
        tracing::dispatcher::with_default(&dispatch, || {
            // 8 tokens are predicted 9 ms; six steps take 100 ms, one between them 20 ms.
            for (rid, ms) in [100.0, 100.0, 20.0, 100.0, 100.0, 100.0, 100.0]
                .into_iter()
                .enumerate()
            {
                let out = one_prompt_step(&mut state, &mut shell, rid as u64, Some(ms));
                let over = (ms > 50.0).then_some(crate::overrun::TimeOverrunReason::Misprediction);
                assert_eq!(out.time_overrun, over);
            }
        });
        let events = captured.events.lock().unwrap().clone();
        let warned: Vec<&String> = events
            .iter()
            .filter(|e| e.starts_with("WARN") && e.contains("ran over its time budget"))
            .collect();
        assert_eq!(warned.len(), 3, "{events:#?}");
        for (w, n) in warned.iter().zip([1, 2, 4]) {
            assert!(w.contains(&format!("overruns={n}")), "{w}");
            assert!(w.contains("reason=\"misprediction\""), "{w}");
            assert!(w.contains("measured_ms=100"), "{w}");
            assert!(w.contains("other work on the engine's CPU"), "{w}");
        }
    }

    #[test]
    fn each_pair_counts_its_own_steps_without_a_time_budget() {
        let (llm, a, b) = (Name::from("llm"), Name::from("a"), Name::from("b"));
        let mut seen = Vec::new();
        let mut warned = Vec::new();
        for i in 1..=9u64 {
            assert_eq!(count_time_inactive(&mut seen, &llm, &a).0, i);
            if i % 3 == 0 {
                warned.push(count_time_inactive(&mut seen, &llm, &b));
            }
        }
        assert_eq!(warned, [(1, true), (2, true), (3, false)]);
        let (n, warn) = count_time_inactive(&mut seen, &llm, &a);
        assert_eq!((n, warn), (10, false));
        assert!(count_time_inactive(&mut Vec::new(), &llm, &a).1);
        let mut at_powers = Vec::new();
        let mut one = Vec::new();
        for _ in 0..16 {
            let (n, warn) = count_time_inactive(&mut one, &llm, &a);
            if warn {
                at_powers.push(n);
            }
        }
        assert_eq!(at_powers, [1, 2, 4, 8, 16]);
    }

    /// Each `(node, walk)` gets its own handles, resolved once, whatever order the pairs come
    /// in and whether their names are the same `Arc`s or equal strings.
    #[actix::test]
    async fn step_metrics_are_one_set_per_node_and_walk() {
        let mut shell = test_shell();
        let (llm, prefill, decode): (Name, Name, Name) =
            ("llm".into(), "prefill".into(), "decode".into());
        let pairs = [
            (&llm, &prefill, 0),
            (&llm, &prefill, 0),
            (&llm, &decode, 1),
            (&llm, &prefill, 0),
            (&prefill, &decode, 2),
            (&llm, &decode, 1),
        ];
        for (node, walk, at) in pairs {
            // Equal names in other `Arc`s find the same handles.
            for (node, walk) in [
                (node.clone(), walk.clone()),
                (node[..].into(), walk[..].into()),
            ] {
                let handles: *const StepMetrics = shell.step_metrics(&node, &walk);
                let (n, w, m) = &shell.metrics[at];
                assert_eq!((n, w), (&node, &walk));
                assert!(
                    std::ptr::eq(handles, m),
                    "{node}/{walk} answered another pair's handles"
                );
            }
        }
        let names: Vec<(&str, &str)> = shell.metrics.iter().map(|(n, w, _)| (&**n, &**w)).collect();
        assert_eq!(
            names,
            [("llm", "prefill"), ("llm", "decode"), ("prefill", "decode")]
        );
    }
}
