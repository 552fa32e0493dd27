//! Every metric the component exports (docs/metrics.md), in one place: names, HELP texts, units, label
//! names and values, and histogram buckets. Call sites use the handles and functions here, never
//! string literals.
//!
//! The library records through the `metrics` facade and never installs a recorder: the `mstar-chunking` command
//! installs the Prometheus exporter (`install_prometheus`, `prometheus` feature); an embedding engine may install its
//! own recorder instead and then call [`describe_all`].
//!
//! The dashboards and alert rules in `dashboards/` query these names; a test checks that every
//! metric they use is in [`ALL`]. Renaming one means changing them too.

use std::time::Duration;

use metrics::{
    describe_counter, describe_gauge, describe_histogram, Counter, Gauge, Histogram, Label,
    SharedString, Unit,
};

use crate::latency::{LatencyModel, ModelSource, TERMS, TERM_KEYS};
use crate::order::Wait;
use crate::overrun::OverrunReason;
use crate::overrun::{TimeInactiveReason, TimeOverrunReason};
use crate::policy::Name;
use crate::queues::QueueCounts;
use crate::scheduler::{Batch, StepOutcome};

// === names ===

/// Steps completed.
pub const STEPS_TOTAL: &str = "mstar_chunking_steps_total";
/// Tokens a completed step ran (histogram).
pub const STEP_TOKENS: &str = "mstar_chunking_step_tokens";
/// The token budget in force (gauge; 0 without one).
pub const STEP_BUDGET_TOKENS: &str = "mstar_chunking_step_budget_tokens";
/// Steps that ran over their token budget, by reason.
pub const BUDGET_OVERRUNS_TOTAL: &str = "mstar_chunking_budget_overruns_total";
/// Tokens by which an overrunning step exceeded its budget (histogram).
pub const OVERRUN_TOKENS: &str = "mstar_chunking_overrun_tokens";
/// Prefill chunks run, by `final`.
pub const CHUNKS_TOTAL: &str = "mstar_chunking_chunks_total";
/// Eligible rows an assembled step left waiting.
pub const DEFERRED_ROWS_TOTAL: &str = "mstar_chunking_deferred_rows_total";
/// Rows whose whole prepared input is held (gauge).
pub const PREPARED_INPUTS: &str = "mstar_chunking_prepared_inputs";
/// Tokens of the prepared inputs held (gauge).
pub const PREPARED_INPUT_TOKENS: &str = "mstar_chunking_prepared_input_tokens";
/// Time planning one step took (histogram).
pub const STEP_ASSEMBLY_SECONDS: &str = "mstar_chunking_step_assembly_seconds";
/// Config changes after the first, by result.
pub const CONFIG_RELOADS_TOTAL: &str = "mstar_chunking_config_reloads_total";
/// Prefill rows that have not run a chunk yet (gauge).
pub const ROWS_WAITING: &str = "mstar_chunking_rows_waiting";
/// Prefill rows with a completed chunk and more to run (gauge).
pub const ROWS_MID_PREFILL: &str = "mstar_chunking_rows_mid_prefill";
/// Continuing rows queued (gauge).
pub const ROWS_CONTINUING: &str = "mstar_chunking_rows_continuing";
/// How long the head waiting prompt has waited, in s, where the engine gives times (gauge).
pub const HEAD_WAIT_SECONDS: &str = "mstar_chunking_head_wait_seconds";
/// How many planned steps the head waiting prompt has waited through (gauge).
pub const HEAD_WAIT_STEPS: &str = "mstar_chunking_head_wait_steps";

/// Measured step time (histogram), from a completion with a time or `measured_late`.
pub const STEP_SECONDS: &str = "mstar_chunking_step_seconds";
/// How far the latency model's prediction was from the measured step time (histogram).
pub const STEP_PREDICTION_ERROR_SECONDS: &str = "mstar_chunking_step_prediction_error_seconds";
/// Steps whose measured time exceeded their time budget, by reason.
pub const TIME_OVERRUNS_TOTAL: &str = "mstar_chunking_time_overruns_total";
/// Steps on a walk with a time budget planned without it, by reason (no model yet).
// On one line, as every name here: the Python tests read the names from this file.
#[rustfmt::skip]
pub const TIME_BUDGET_INACTIVE_STEPS_TOTAL: &str = "mstar_chunking_time_budget_inactive_steps_total";
/// The time budget in force (gauge; 0 without one).
pub const STEP_BUDGET_SECONDS: &str = "mstar_chunking_step_budget_seconds";
/// The latency model's coefficients in use, by `coefficient` (gauge).
pub const LATENCY_MODEL_COEFFICIENT: &str = "mstar_chunking_latency_model_coefficient";
/// Where the latency model in use came from: 1 for its `source`, 0 for the others (gauge).
pub const LATENCY_MODEL_SOURCE: &str = "mstar_chunking_latency_model_source";
/// The time margin a node's timed steps are planned with (gauge; 1 without one).
pub const TIME_MARGIN: &str = "mstar_chunking_time_margin";

/// Every metric name, for tests and dashboards checks.
pub const ALL: [&str; 24] = [
    STEPS_TOTAL,
    STEP_TOKENS,
    STEP_BUDGET_TOKENS,
    BUDGET_OVERRUNS_TOTAL,
    OVERRUN_TOKENS,
    CHUNKS_TOTAL,
    DEFERRED_ROWS_TOTAL,
    PREPARED_INPUTS,
    PREPARED_INPUT_TOKENS,
    STEP_ASSEMBLY_SECONDS,
    CONFIG_RELOADS_TOTAL,
    ROWS_WAITING,
    ROWS_MID_PREFILL,
    ROWS_CONTINUING,
    HEAD_WAIT_SECONDS,
    HEAD_WAIT_STEPS,
    STEP_SECONDS,
    STEP_PREDICTION_ERROR_SECONDS,
    TIME_OVERRUNS_TOTAL,
    TIME_BUDGET_INACTIVE_STEPS_TOTAL,
    STEP_BUDGET_SECONDS,
    LATENCY_MODEL_COEFFICIENT,
    LATENCY_MODEL_SOURCE,
    TIME_MARGIN,
];

// === labels ===
// Bounded on purpose: node and walk names come from the model manifest, the rest are fixed
// sets. No per-request label ever: it would create a series per request.

/// On every series: the facade instance (one per model or engine in a process).
pub const LABEL_MODEL: &str = "model";
/// On every series of a replayed fleet's workers, when there are two or more: the worker's
/// index (`0`, `1`, …; bounded by `replay.fleet.workers`). Absent otherwise.
pub const LABEL_WORKER: &str = "worker";
/// On every series but the reloads: the node.
pub const LABEL_NODE: &str = "node";
/// On step and overrun series: the step walk.
pub const LABEL_WALK: &str = "walk";
/// On [`BUDGET_OVERRUNS_TOTAL`]: an [`OverrunReason::as_str`].
pub const LABEL_REASON: &str = "reason";
/// On [`CHUNKS_TOTAL`]: [`FINAL_TRUE`] or [`FINAL_FALSE`].
pub const LABEL_FINAL: &str = "final";
/// On [`CONFIG_RELOADS_TOTAL`]: [`RESULT_OK`] or [`RESULT_ERROR`].
pub const LABEL_RESULT: &str = "result";
/// On [`LATENCY_MODEL_COEFFICIENT`]: one of [`crate::latency::TERM_KEYS`].
pub const LABEL_COEFFICIENT: &str = "coefficient";
/// On [`LATENCY_MODEL_SOURCE`]: a [`ModelSource::as_str`].
pub const LABEL_SOURCE: &str = "source";

/// Every label name a metric may carry.
pub const LABELS: [&str; 9] = [
    LABEL_COEFFICIENT,
    LABEL_SOURCE,
    LABEL_MODEL,
    LABEL_WORKER,
    LABEL_NODE,
    LABEL_WALK,
    LABEL_REASON,
    LABEL_FINAL,
    LABEL_RESULT,
];

/// [`LABEL_FINAL`] of a row's last chunk.
pub const FINAL_TRUE: &str = "true";
/// [`LABEL_FINAL`] of a partial chunk.
pub const FINAL_FALSE: &str = "false";
/// [`LABEL_RESULT`] of an applied change.
pub const RESULT_OK: &str = "ok";
/// [`LABEL_RESULT`] of a refused change.
pub const RESULT_ERROR: &str = "error";

// === buckets ===

/// Token histogram buckets: powers of two from 1 to 2^20 (1M).
pub fn token_buckets() -> Vec<f64> {
    (0..=20).map(|p| f64::from(1u32 << p)).collect()
}

/// Buckets of [`STEP_ASSEMBLY_SECONDS`]: 0.1 µs to 100 µs at 1-2-5 per decade, where a step's
/// planning falls (a few µs for hundreds of rows), then coarser up to 1 s. Public so that an
/// engine with a recorder of its own can use the same buckets. Written out rather than
/// multiplied up so that the `le` labels read `2e-7`, not `1.9999999999999999e-7`.
pub const STEP_ASSEMBLY_BUCKETS: [f64; 15] = [
    1e-7, 2e-7, 5e-7, 1e-6, 2e-6, 5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2.5e-4, 1e-3, 1e-2, 0.1, 1.0,
];

/// Buckets of [`STEP_SECONDS`] and [`STEP_PREDICTION_ERROR_SECONDS`]: 0.1 ms to 10 s, a step's
/// time on a GPU (1-2-5 per decade).
pub const STEP_TIME_BUCKETS: [f64; 16] = [
    1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0,
];

/// Seconds histogram buckets ([`STEP_ASSEMBLY_BUCKETS`]).
pub fn seconds_buckets() -> Vec<f64> {
    STEP_ASSEMBLY_BUCKETS.to_vec()
}

// === descriptions ===

/// Registers the HELP text and unit of every metric with the installed recorder. HELP texts
/// name the unit and list each label's allowed values.
pub fn describe_all() {
    describe_counter!(
        STEPS_TOTAL,
        Unit::Count,
        "Steps completed, by node and walk."
    );
    describe_histogram!(
        STEP_TOKENS,
        Unit::Count,
        "Tokens a completed step actually ran, in tokens, by node and walk."
    );
    describe_gauge!(
        STEP_BUDGET_TOKENS,
        Unit::Count,
        "Token budget of each node and walk in the accepted config, in tokens; 0 where chunking is off (no budget)."
    );
    describe_counter!(
        BUDGET_OVERRUNS_TOTAL,
        Unit::Count,
        "Steps that ran more tokens than the budget they were scheduled under, by node, walk and reason (uncut_row, speculation_estimate, other)."
    );
    describe_histogram!(
        OVERRUN_TOKENS,
        Unit::Count,
        "Tokens by which an overrunning step exceeded its budget, in tokens, by node and walk."
    );
    describe_counter!(
        CHUNKS_TOTAL,
        Unit::Count,
        "Prefill chunks run, by node, walk and final (true: a row's last chunk, false: a partial chunk)."
    );
    describe_counter!(
        DEFERRED_ROWS_TOTAL,
        Unit::Count,
        "Eligible rows an assembled step left waiting for a later step, by node and walk."
    );
    describe_gauge!(
        PREPARED_INPUTS,
        Unit::Count,
        "Rows whose whole prepared input is held until their final chunk, by node."
    );
    describe_gauge!(
        PREPARED_INPUT_TOKENS,
        Unit::Count,
        "Tokens of the whole prepared inputs held, in tokens, by node."
    );
    describe_histogram!(
        STEP_ASSEMBLY_SECONDS,
        Unit::Seconds,
        "Time the scheduler took to plan one step's batch, in seconds, by node and walk."
    );
    describe_counter!(
        CONFIG_RELOADS_TOTAL,
        Unit::Count,
        "Serving config changes after the first applied (result ok) or refused whole (result error)."
    );
    describe_histogram!(
        STEP_SECONDS,
        Unit::Seconds,
        "Measured duration of completed steps, in seconds, by node and walk (steps completed with a measured time)."
    );
    describe_histogram!(
        STEP_PREDICTION_ERROR_SECONDS,
        Unit::Seconds,
        "Absolute difference between a step's measured and predicted duration, in seconds, by node and walk."
    );
    describe_counter!(
        TIME_OVERRUNS_TOTAL,
        Unit::Count,
        "Steps whose measured time exceeded the time budget they were scheduled under, by node, walk and reason (floor, uncut_row, continuing, misprediction)."
    );
    describe_counter!(
        TIME_BUDGET_INACTIVE_STEPS_TOTAL,
        Unit::Count,
        "Steps on a walk with a time budget that were planned without it (the node learns its latency model, has no configured one, and the fit is not trusted yet), by node, walk and reason (no_measurements, untrusted_fit)."
    );
    describe_gauge!(
        STEP_BUDGET_SECONDS,
        Unit::Seconds,
        "Time budget of each node and walk in the accepted config, in seconds; 0 where there is none."
    );
    describe_gauge!(
        LATENCY_MODEL_COEFFICIENT,
        Unit::Count,
        "Coefficients of the latency model a node plans with, by coefficient (base_ms, per_token_ms, per_kv_token_ms, per_attention_pair_ms; milliseconds per unit); 0 without a model."
    );
    describe_gauge!(
        LATENCY_MODEL_SOURCE,
        Unit::Count,
        "Where a node's latency model comes from: 1 for its source (online, config, none), 0 for the others."
    );
    describe_gauge!(
        TIME_MARGIN,
        Unit::Count,
        "The time margin a node's last timed step was planned with: its time budget divided by this (chunking.time_margin; 1 without a margin)."
    );
    describe_gauge!(
        ROWS_WAITING,
        Unit::Count,
        "Prefill rows admitted that have not run a chunk yet, by node."
    );
    describe_gauge!(
        ROWS_MID_PREFILL,
        Unit::Count,
        "Prefill rows with at least one completed chunk and more to run, by node."
    );
    describe_gauge!(
        ROWS_CONTINUING,
        Unit::Count,
        "Continuing rows (decode, speculative verify) queued, by node."
    );
    describe_gauge!(
        HEAD_WAIT_SECONDS,
        Unit::Seconds,
        "How long the earliest admitted prompt that has not run a chunk has waited at the node's last planned step, from its arrival to that step's time (both given by the engine: admit_with, assemble_at); 0 when none waits or the engine gives no times, by node."
    );
    describe_gauge!(
        HEAD_WAIT_STEPS,
        Unit::Count,
        "How many planned steps of its node the earliest admitted prompt that has not run a chunk has waited through (the clock of chunking.max_wait_steps); 0 when none waits, by node."
    );
}

// === the Prometheus exporter ===

#[cfg(feature = "prometheus")]
pub use exporter::{
    install_prometheus, install_prometheus_recorder, serve_prometheus, MetricsError,
};
/// The handle that renders the Prometheus recorder's text ([`install_prometheus_recorder`]).
#[cfg(feature = "prometheus")]
pub use metrics_exporter_prometheus::PrometheusHandle;

#[cfg(feature = "prometheus")]
mod exporter {
    use std::net::SocketAddr;

    use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

    use super::*;

    /// The exporter could not be started.
    #[derive(Debug, thiserror::Error)]
    pub enum MetricsError {
        /// The address cannot be bound (in use, not local, no permission).
        #[error("cannot listen for metrics on `{addr}` (`metrics.listen`): {reason}; choose a free address, or set `metrics.listen = \"off\"`")]
        Bind {
            /// The address.
            addr: SocketAddr,
            /// Why.
            reason: String,
        },
        #[error("cannot install the Prometheus exporter: a metrics recorder is already installed in this process")]
        /// Another recorder is installed in the process.
        AlreadyInstalled,
        #[error("cannot start the metrics endpoint on `{addr}`: {reason}")]
        /// The exporter failed otherwise.
        Exporter {
            /// The address.
            addr: SocketAddr,
            /// Why.
            reason: String,
        },
    }

    /// The exporter's settings: histograms get explicit buckets (without them the exporter renders
    /// summaries, which cannot be aggregated across nodes or over time windows).
    pub(super) fn prometheus_builder() -> PrometheusBuilder {
        let tokens = token_buckets();
        let seconds = seconds_buckets();
        let step_time = STEP_TIME_BUCKETS.to_vec();
        [
            (STEP_TOKENS, &tokens),
            (OVERRUN_TOKENS, &tokens),
            (STEP_ASSEMBLY_SECONDS, &seconds),
            (STEP_SECONDS, &step_time),
            (STEP_PREDICTION_ERROR_SECONDS, &step_time),
        ]
        .into_iter()
        .fold(PrometheusBuilder::new(), |b, (name, buckets)| {
            b.set_buckets_for_metric(Matcher::Full(name.into()), buckets)
                .expect("bucket lists are non-empty constants")
        })
    }

    /// Installs the Prometheus exporter as the global recorder, serving `/metrics` on `listen` from
    /// a thread of its own (so that scrapes are answered even while the actors are busy; see
    /// [`crate::metrics_server`] for the limits it holds clients to), and describes every metric.
    /// Port 0 binds a free port the system picks; the address logged is the real one.
    ///
    /// # Errors
    /// [`MetricsError::Bind`] when `listen` cannot be bound (in use, not a local address, no
    /// permission), [`MetricsError::AlreadyInstalled`] when a recorder is already installed.
    pub fn install_prometheus(listen: SocketAddr) -> Result<(), MetricsError> {
        // Bound first, so that a bad address fails here, at startup, before a recorder is set.
        let (runtime, listener, listen) = bind(listen)?;
        let handle = install_prometheus_recorder()?;
        spawn_server(runtime, listener, listen, handle)
    }

    /// Installs the Prometheus recorder (the exporter's settings, as [`install_prometheus`]) as
    /// the global recorder without serving it, and describes every metric. Answers the handle
    /// that renders the process's series: an embedder with its own `/metrics` appends
    /// `handle.render()`, or serves it with [`serve_prometheus`]. Install it before any facade
    /// starts: series registered at start under no recorder are never exported.
    ///
    /// # Errors
    /// [`MetricsError::AlreadyInstalled`] when a recorder is already installed.
    pub fn install_prometheus_recorder() -> Result<PrometheusHandle, MetricsError> {
        let recorder = prometheus_builder().build_recorder();
        let handle = recorder.handle();
        metrics::set_global_recorder(recorder).map_err(|_| MetricsError::AlreadyInstalled)?;
        describe_all();
        Ok(handle)
    }

    /// Serves `handle`'s text on `listen` (`GET /metrics`) from a thread of its own, with the
    /// bounds of [`crate::metrics_server`]; answers the address bound (port 0 picks a free one).
    ///
    /// # Errors
    /// [`MetricsError::Bind`] when `listen` cannot be bound, [`MetricsError::Exporter`] when
    /// the server's thread or runtime cannot start.
    pub fn serve_prometheus(
        listen: SocketAddr,
        handle: PrometheusHandle,
    ) -> Result<SocketAddr, MetricsError> {
        let (runtime, listener, listen) = bind(listen)?;
        spawn_server(runtime, listener, listen, handle)?;
        Ok(listen)
    }

    /// The endpoint's runtime and its bound listener, with the address bound.
    fn bind(
        listen: SocketAddr,
    ) -> Result<(tokio::runtime::Runtime, tokio::net::TcpListener, SocketAddr), MetricsError> {
        let exporter_error = |reason: String| MetricsError::Exporter {
            addr: listen,
            reason,
        };
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| exporter_error(e.to_string()))?;
        // The listen queue is long enough for clients waiting while
        // `metrics_server::MAX_CONNECTIONS` are served.
        let listener = {
            let _entered = runtime.enter();
            let socket = if listen.is_ipv4() {
                tokio::net::TcpSocket::new_v4()
            } else {
                tokio::net::TcpSocket::new_v6()
            };
            socket
                .and_then(|s| {
                    s.set_reuseaddr(true)?;
                    s.bind(listen)?;
                    s.listen(crate::metrics_server::LISTEN_BACKLOG)
                })
                .map_err(|e| MetricsError::Bind {
                    addr: listen,
                    reason: e.to_string(),
                })?
        };
        let bound = listener
            .local_addr()
            .map_err(|e| exporter_error(e.to_string()))?;
        Ok((runtime, listener, bound))
    }

    fn spawn_server(
        runtime: tokio::runtime::Runtime,
        listener: tokio::net::TcpListener,
        listen: SocketAddr,
        handle: PrometheusHandle,
    ) -> Result<(), MetricsError> {
        std::thread::Builder::new()
            .name("mstar-metrics".into())
            .spawn(move || runtime.block_on(crate::metrics_server::serve(listener, handle)))
            .map_err(|e| MetricsError::Exporter {
                addr: listen,
                reason: e.to_string(),
            })?;
        tracing::info!(addr = %listen, "serving metrics at http://{listen}/metrics");
        Ok(())
    }
}

// === recording ===

/// The metrics of one facade instance: every handle it resolves carries the instance's `model`
/// label, so two facades in one process export separate series.
#[derive(Clone, Debug)]
pub(crate) struct Instance {
    model: Name,
    /// A replayed fleet's worker, when the fleet has two or more: a `worker` label on every
    /// series.
    worker: Option<Name>,
}

impl Instance {
    pub(crate) fn new(model: Name) -> Self {
        Self {
            model,
            worker: None,
        }
    }

    /// The same instance as one worker of a fleet: every series also carries `worker`.
    pub(crate) fn with_worker(mut self, worker: Name) -> Self {
        self.worker = Some(worker);
        self
    }

    /// This instance's labels (`model`, and `worker` in a fleet) followed by `rest`.
    fn labels<const N: usize>(&self, rest: [(&'static str, SharedString); N]) -> Vec<Label> {
        let mut v = Vec::with_capacity(N + 2);
        v.push(Label::new(LABEL_MODEL, self.model_label()));
        if let Some(w) = &self.worker {
            v.push(Label::new(LABEL_WORKER, w.to_string()));
        }
        v.extend(rest.into_iter().map(|(k, value)| Label::new(k, value)));
        v
    }

    /// The model this instance is labelled with.
    pub(crate) fn model_name(&self) -> &Name {
        &self.model
    }

    fn model_label(&self) -> String {
        self.model.to_string()
    }

    /// Creates the series that exist from start-up with value 0: the reload results.
    pub(crate) fn started(&self) {
        for result in [RESULT_OK, RESULT_ERROR] {
            metrics::counter!(
                CONFIG_RELOADS_TOTAL,
                self.labels([(LABEL_RESULT, result.into())])
            )
            .increment(0);
        }
    }

    /// Counts a config reload; `ok` is its result.
    pub(crate) fn record_reload(&self, ok: bool) {
        let result = if ok { RESULT_OK } else { RESULT_ERROR };
        metrics::counter!(
            CONFIG_RELOADS_TOTAL,
            self.labels([(LABEL_RESULT, result.into())])
        )
        .increment(1);
    }

    /// Sets the time budget gauge of `node`/`walk` (0 where there is none); a pair with a
    /// time budget has its time-overrun series created at 0.
    pub(crate) fn set_time_budget(&self, node: &Name, walk: &Name, max_step_ms: Option<f64>) {
        metrics::gauge!(
            STEP_BUDGET_SECONDS,
            self.labels([
                (LABEL_NODE, node.to_string().into()),
                (LABEL_WALK, walk.to_string().into())
            ])
        )
        .set(max_step_ms.unwrap_or(0.0) / 1000.0);
        if max_step_ms.is_some() {
            for reason in TimeOverrunReason::ALL {
                metrics::counter!(
                    TIME_OVERRUNS_TOTAL,
                    self.labels([
                        (LABEL_NODE, node.to_string().into()),
                        (LABEL_WALK, walk.to_string().into()),
                        (LABEL_REASON, reason.as_str().into())
                    ])
                )
                .increment(0);
            }
            for reason in TimeInactiveReason::ALL {
                self.time_inactive(node, walk, reason).increment(0);
            }
        }
    }

    /// The counter of `node`/`walk`'s steps planned without their time budget for `reason`.
    fn time_inactive(&self, node: &Name, walk: &Name, reason: TimeInactiveReason) -> Counter {
        metrics::counter!(
            TIME_BUDGET_INACTIVE_STEPS_TOTAL,
            self.labels([
                (LABEL_NODE, node.to_string().into()),
                (LABEL_WALK, walk.to_string().into()),
                (LABEL_REASON, reason.as_str().into())
            ])
        )
    }

    /// The latency-model gauges of `node`.
    pub(crate) fn model(&self, node: &Name) -> ModelGauges {
        ModelGauges {
            coefficients: TERM_KEYS.map(|c| {
                metrics::gauge!(
                    LATENCY_MODEL_COEFFICIENT,
                    self.labels([
                        (LABEL_NODE, node.to_string().into()),
                        (LABEL_COEFFICIENT, c.into())
                    ])
                )
            }),
            sources: ModelSource::ALL.map(|s| {
                metrics::gauge!(
                    LATENCY_MODEL_SOURCE,
                    self.labels([
                        (LABEL_NODE, node.to_string().into()),
                        (LABEL_SOURCE, s.as_str().into())
                    ])
                )
            }),
            shown: None,
            margin: {
                let g = metrics::gauge!(
                    TIME_MARGIN,
                    self.labels([(LABEL_NODE, node.to_string().into())])
                );
                g.set(1.0);
                g
            },
        }
    }

    /// Sets the budget gauge of `node`/`walk` (0 where there is no budget); a budgeted pair's
    /// overrun series are created at 0.
    pub(crate) fn set_budget(&self, node: &Name, walk: &Name, budget: Option<u32>) {
        metrics::gauge!(
            STEP_BUDGET_TOKENS,
            self.labels([
                (LABEL_NODE, node.to_string().into()),
                (LABEL_WALK, walk.to_string().into())
            ])
        )
        .set(f64::from(budget.unwrap_or(0)));
        if budget.is_some() {
            // Resolving the handles registers the series: counters at 0, an empty histogram.
            let _ = self.overruns(node, walk);
            // The step series too, so that a scrape before the first step shows every series.
            self.step(node, walk).register();
        }
    }

    /// The step metrics of `node`/`walk`.
    pub(crate) fn step(&self, node: &Name, walk: &Name) -> StepMetrics {
        let labels = self.labels([
            (LABEL_NODE, node.to_string().into()),
            (LABEL_WALK, walk.to_string().into()),
        ]);
        let chunks = |fin: &'static str| {
            metrics::counter!(
                CHUNKS_TOTAL,
                self.labels([
                    (LABEL_NODE, node.to_string().into()),
                    (LABEL_WALK, walk.to_string().into()),
                    (LABEL_FINAL, fin.into())
                ])
            )
        };
        StepMetrics {
            steps: metrics::counter!(STEPS_TOTAL, labels.clone()),
            tokens: metrics::histogram!(STEP_TOKENS, labels.clone()),
            chunks_final: chunks(FINAL_TRUE),
            chunks_partial: chunks(FINAL_FALSE),
            deferred: metrics::counter!(DEFERRED_ROWS_TOTAL, labels.clone()),
            assembly_seconds: metrics::histogram!(STEP_ASSEMBLY_SECONDS, labels.clone()),
            step_seconds: metrics::histogram!(STEP_SECONDS, labels.clone()),
            prediction_error: metrics::histogram!(STEP_PREDICTION_ERROR_SECONDS, labels.clone()),
            time_overruns: TimeOverrunReason::ALL.map(|reason| {
                metrics::counter!(
                    TIME_OVERRUNS_TOTAL,
                    self.labels([
                        (LABEL_NODE, node.to_string().into()),
                        (LABEL_WALK, walk.to_string().into()),
                        (LABEL_REASON, reason.as_str().into())
                    ])
                )
            }),
            time_inactive: TimeInactiveReason::ALL.map(|r| self.time_inactive(node, walk, r)),
        }
    }

    /// The overrun metrics of `node`/`walk`, one counter per reason.
    pub(crate) fn overruns(&self, node: &Name, walk: &Name) -> OverrunMetrics {
        let by_reason = OverrunReason::ALL.map(|reason| {
            let c = metrics::counter!(
                BUDGET_OVERRUNS_TOTAL,
                self.labels([
                    (LABEL_NODE, node.to_string().into()),
                    (LABEL_WALK, walk.to_string().into()),
                    (LABEL_REASON, reason.as_str().into())
                ])
            );
            c.increment(0);
            c
        });
        OverrunMetrics {
            by_reason,
            tokens: metrics::histogram!(
                OVERRUN_TOKENS,
                self.labels([
                    (LABEL_NODE, node.to_string().into()),
                    (LABEL_WALK, walk.to_string().into())
                ])
            ),
        }
    }

    /// The prepared-input gauges of `node` (rows, tokens).
    pub(crate) fn prepared(&self, node: &Name) -> (Gauge, Gauge) {
        (
            metrics::gauge!(
                PREPARED_INPUTS,
                self.labels([(LABEL_NODE, node.to_string().into())])
            ),
            metrics::gauge!(
                PREPARED_INPUT_TOKENS,
                self.labels([(LABEL_NODE, node.to_string().into())])
            ),
        )
    }

    /// The queue-depth gauges of `node`.
    pub(crate) fn queue(&self, node: &Name) -> QueueGauges {
        let gauge = |name: &'static str| {
            metrics::gauge!(name, self.labels([(LABEL_NODE, node.to_string().into())]))
        };
        QueueGauges {
            waiting: gauge(ROWS_WAITING),
            mid_prefill: gauge(ROWS_MID_PREFILL),
            continuing: gauge(ROWS_CONTINUING),
            head_wait_seconds: gauge(HEAD_WAIT_SECONDS),
            head_wait_steps: gauge(HEAD_WAIT_STEPS),
        }
    }
}

/// The handles of one `(node, walk)`'s step metrics, resolved once and reused every step.
#[derive(Clone)]
pub(crate) struct StepMetrics {
    steps: Counter,
    tokens: Histogram,
    chunks_final: Counter,
    chunks_partial: Counter,
    deferred: Counter,
    assembly_seconds: Histogram,
    step_seconds: Histogram,
    prediction_error: Histogram,
    time_overruns: [Counter; 4],
    time_inactive: [Counter; 2],
}

impl StepMetrics {
    /// Creates the counters at 0 (the histograms exist once resolved).
    fn register(&self) {
        for c in [
            &self.steps,
            &self.chunks_final,
            &self.chunks_partial,
            &self.deferred,
        ]
        .into_iter()
        .chain(&self.time_overruns)
        {
            c.increment(0);
        }
    }

    /// Records an assembled step: the time planning took, and the rows it left waiting.
    pub(crate) fn assembled(&self, batch: &Batch, took: Duration) {
        self.assembly_seconds.record(took.as_secs_f64());
        self.deferred.increment(u64::from(batch.waiting));
    }

    /// Records a completed step: one step, the tokens it ran, its chunks final and partial.
    /// Overruns are recorded by the overrun accounting ([`OverrunMetrics`]).
    pub(crate) fn completed(&self, outcome: &StepOutcome) {
        self.steps.increment(1);
        self.tokens.record(outcome.tokens.ran as f64);
        self.chunks_final.increment(u64::from(outcome.final_chunks));
        self.chunks_partial.increment(u64::from(
            outcome.chunks.saturating_sub(outcome.final_chunks),
        ));
        if let Some(ms) = outcome.measured_ms {
            self.step_seconds.record(ms / 1000.0);
            if let Some(predicted) = outcome.predicted_ms {
                self.prediction_error
                    .record((ms - predicted).abs() / 1000.0);
            }
        }
        if let Some(reason) = outcome.time_overrun {
            self.time_overruns[reason as usize].increment(1);
        }
        if let Some(reason) = outcome.time_inactive {
            self.time_inactive[reason as usize].increment(1);
        }
    }

    /// Records a step's time measured after its completion
    /// (`ChunkingManagement::measured_late`): its time, its prediction error and its time overrun,
    /// as [`StepMetrics::completed`] records a time measured with the completion.
    pub(crate) fn measured_late(&self, m: &crate::scheduler::LateMeasurement) {
        self.step_seconds.record(m.measured_ms / 1000.0);
        if let Some(predicted) = m.predicted_ms {
            self.prediction_error
                .record((m.measured_ms - predicted).abs() / 1000.0);
        }
        if let Some(reason) = m.time_overrun {
            self.time_overruns[reason as usize].increment(1);
        }
    }
}

/// The overrun metrics of one `(node, walk)`.
#[derive(Clone)]
pub(crate) struct OverrunMetrics {
    by_reason: [Counter; 3],
    tokens: Histogram,
}

impl OverrunMetrics {
    /// Records an overrun by `over` tokens.
    pub(crate) fn record(&self, reason: OverrunReason, over: u64) {
        self.by_reason[reason.index()].increment(1);
        self.tokens.record(over as f64);
    }
}

/// The latency-model gauges of one node, and what they show (written only on a change: the
/// model changes rarely, steps come often).
#[derive(Clone)]
pub(crate) struct ModelGauges {
    coefficients: [Gauge; TERMS],
    sources: [Gauge; 3],
    shown: Option<(Option<LatencyModel>, ModelSource)>,
    margin: Gauge,
}

impl ModelGauges {
    /// Sets the coefficients in use (0 without a model) and marks their source.
    pub(crate) fn set(&mut self, model: Option<LatencyModel>, source: ModelSource) {
        if self.shown == Some((model, source)) {
            return;
        }
        self.shown = Some((model, source));
        let c = model.map_or([0.0; TERMS], |m| m.terms());
        for (gauge, value) in self.coefficients.iter().zip(c) {
            gauge.set(value);
        }
        for (gauge, s) in self.sources.iter().zip(ModelSource::ALL) {
            gauge.set(if s == source { 1.0 } else { 0.0 });
        }
    }

    /// Sets the time margin the node's last timed step was planned with.
    pub(crate) fn set_margin(&self, margin: f64) {
        self.margin.set(margin);
    }
}

/// The queue-depth gauges of one node.
#[derive(Clone)]
pub(crate) struct QueueGauges {
    waiting: Gauge,
    mid_prefill: Gauge,
    continuing: Gauge,
    head_wait_seconds: Gauge,
    head_wait_steps: Gauge,
}

impl QueueGauges {
    /// Sets the gauges from the node's queue counts.
    pub(crate) fn set(&self, counts: QueueCounts) {
        self.waiting.set(counts.waiting as f64);
        self.mid_prefill.set(counts.mid_prefill as f64);
        self.continuing.set(counts.continuing as f64);
    }

    /// Sets the head wait gauges from the wait of the node's head prompt (`None`: none waits).
    pub(crate) fn set_head_wait(&self, wait: Option<Wait>) {
        let wait = wait.unwrap_or_default();
        self.head_wait_seconds
            .set(wait.ms.map_or(0.0, |ms| ms / 1000.0));
        self.head_wait_steps.set(wait.steps as f64);
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::sync::Arc;

    use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
    use metrics_util::MetricKind;

    use super::*;
    use crate::budget::BudgetTable;
    use crate::order::AdmitOptions;
    use crate::policy::{ChunkingPolicy, ModelPolicies, SubmoduleCaps};
    use crate::scheduler::SchedulerState;
    use crate::snapshot::BudgetSnapshot;

    fn n(s: &str) -> Name {
        Name::from(s)
    }

    fn inst() -> Instance {
        Instance::new(n("m"))
    }

    fn set_prepared(node: &Name, rows: usize, tokens: u64) {
        let (r, t) = inst().prepared(node);
        r.set(rows as f64);
        t.set(tokens as f64);
    }

    /// One metric as the debugging recorder saw it.
    struct Seen {
        kind: MetricKind,
        name: String,
        labels: Vec<(String, String)>,
        unit: Option<Unit>,
        help: Option<String>,
        value: DebugValue,
    }

    /// Runs `f` with a fresh thread-local recorder and returns what it recorded.
    fn recorded(f: impl FnOnce()) -> Vec<Seen> {
        let recorder = DebuggingRecorder::new();
        let snapshotter: Snapshotter = recorder.snapshotter();
        metrics::with_local_recorder(&recorder, f);
        snapshotter
            .snapshot()
            .into_vec()
            .into_iter()
            .map(|(key, unit, help, value)| {
                let mut labels: Vec<(String, String)> = key
                    .key()
                    .labels()
                    .map(|l| (l.key().to_string(), l.value().to_string()))
                    .collect();
                labels.sort();
                Seen {
                    kind: key.kind(),
                    name: key.key().name().to_string(),
                    labels,
                    unit,
                    help: help.map(|h| h.to_string()),
                    value,
                }
            })
            .collect()
    }

    /// The value of `name` with exactly `labels`.
    fn value<'a>(seen: &'a [Seen], name: &str, labels: &[(&str, &str)]) -> &'a DebugValue {
        let mut want: Vec<(String, String)> = labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        want.sort();
        let found: Vec<&Seen> = seen
            .iter()
            .filter(|s| s.name == name && s.labels == want)
            .collect();
        assert_eq!(
            found.len(),
            1,
            "{name}{want:?} recorded {} times",
            found.len()
        );
        &found[0].value
    }

    fn counter(seen: &[Seen], name: &str, labels: &[(&str, &str)]) -> u64 {
        match value(seen, name, labels) {
            DebugValue::Counter(c) => *c,
            other => panic!("{name} is not a counter: {other:?}"),
        }
    }

    fn gauge(seen: &[Seen], name: &str, labels: &[(&str, &str)]) -> f64 {
        match value(seen, name, labels) {
            DebugValue::Gauge(g) => g.into_inner(),
            other => panic!("{name} is not a gauge: {other:?}"),
        }
    }

    fn histogram(seen: &[Seen], name: &str, labels: &[(&str, &str)]) -> Vec<f64> {
        match value(seen, name, labels) {
            DebugValue::Histogram(h) => h.iter().map(|v| v.into_inner()).collect(),
            other => panic!("{name} is not a histogram: {other:?}"),
        }
    }

    /// A scheduler for node `llm` whose `prefill` walk has a budget of 100 tokens.
    fn scheduler() -> SchedulerState {
        let model = ModelPolicies::new(
            BTreeMap::from([(n("llm"), SubmoduleCaps::new(["prefill"], false))]),
            BTreeMap::from([((n("llm"), n("prefill")), ChunkingPolicy::budget(100))]),
        )
        .unwrap()
        .shared();
        let mut state = SchedulerState::default();
        state.set_snapshot(Arc::new(BudgetSnapshot::new(
            BudgetTable::from_policies(model),
            1,
        )));
        state
    }

    const LLM_PREFILL: [(&str, &str); 3] = [
        (LABEL_MODEL, "m"),
        (LABEL_NODE, "llm"),
        (LABEL_WALK, "prefill"),
    ];

    #[test]
    fn names_follow_the_prometheus_conventions() {
        for name in ALL {
            assert!(name.starts_with("mstar_chunking_"), "{name}: no prefix");
            assert!(
                name.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'),
                "{name}: not snake_case"
            );
            assert_eq!(
                ALL.iter().filter(|m| **m == name).count(),
                1,
                "{name} twice"
            );
        }
    }

    #[test]
    fn buckets_cover_tokens_to_1m_and_seconds_from_100ns_to_1s() {
        let tokens = token_buckets();
        assert_eq!(tokens.first(), Some(&1.0));
        assert_eq!(tokens.last(), Some(&1_048_576.0));
        assert!(tokens.windows(2).all(|w| w[1] == 2.0 * w[0]));

        let seconds = seconds_buckets();
        assert_eq!(seconds.first(), Some(&1e-7));
        assert_eq!(seconds.last(), Some(&1.0));
        assert!(seconds.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(
            seconds
                .iter()
                .filter(|&&b| (1e-7..=1e-4).contains(&b))
                .count(),
            10,
            "1-2-5 per decade from 0.1 µs to 100 µs, where steps are planned"
        );
    }

    #[test]
    fn the_time_margin_gauge_starts_at_one_and_shows_the_last_margin() {
        let node = [(LABEL_MODEL, "m"), (LABEL_NODE, "llm")];
        let seen = recorded(|| {
            inst().model(&n("llm"));
        });
        assert_eq!(
            value(&seen, TIME_MARGIN, &node),
            &DebugValue::Gauge(1.0.into())
        );
        let seen = recorded(|| {
            inst().model(&n("llm")).set_margin(1.25);
        });
        assert_eq!(
            value(&seen, TIME_MARGIN, &node),
            &DebugValue::Gauge(1.25.into())
        );
    }

    #[test]
    fn a_time_budget_creates_its_inactive_step_series_at_zero_and_describes_their_reasons() {
        let seen = recorded(|| {
            describe_all();
            inst().set_time_budget(&n("llm"), &n("mixed"), Some(50.0));
            inst().set_time_budget(&n("llm"), &n("prefill"), None);
        });
        for reason in TimeInactiveReason::ALL {
            let labels = [
                (LABEL_MODEL, "m"),
                (LABEL_NODE, "llm"),
                (LABEL_WALK, "mixed"),
                (LABEL_REASON, reason.as_str()),
            ];
            assert_eq!(
                value(&seen, TIME_BUDGET_INACTIVE_STEPS_TOTAL, &labels),
                &DebugValue::Counter(0)
            );
        }
        // A walk without a time budget has no such series.
        assert!(!seen
            .iter()
            .any(|s| s.name == TIME_BUDGET_INACTIVE_STEPS_TOTAL
                && s.labels
                    .iter()
                    .any(|(k, v)| k == LABEL_WALK && v == "prefill")));
        let help = seen
            .iter()
            .find(|s| s.name == TIME_BUDGET_INACTIVE_STEPS_TOTAL)
            .and_then(|s| s.help.clone())
            .unwrap();
        for reason in TimeInactiveReason::ALL {
            assert!(help.contains(reason.as_str()), "{help}");
        }
    }

    #[test]
    fn every_metric_is_described_with_its_kind_and_unit() {
        let seen = recorded(|| {
            describe_all();
            let m = inst().step(&n("llm"), &n("prefill"));
            m.steps.increment(1);
            m.tokens.record(1.0);
            m.chunks_final.increment(1);
            m.deferred.increment(1);
            m.assembly_seconds.record(1e-5);
            inst().set_budget(&n("llm"), &n("prefill"), Some(100));
            inst()
                .overruns(&n("llm"), &n("prefill"))
                .record(OverrunReason::UncutRow, 3);
            set_prepared(&n("llm"), 1, 10);
            inst().record_reload(true);
            inst().queue(&n("llm")).set(QueueCounts::default());
            m.step_seconds.record(0.05);
            m.prediction_error.record(0.001);
            m.time_overruns[0].increment(1);
            inst().set_time_budget(&n("llm"), &n("prefill"), Some(50.0));
            inst().model(&n("llm")).set(None, ModelSource::None);
        });
        for name in ALL {
            let s = seen
                .iter()
                .find(|s| s.name == name)
                .unwrap_or_else(|| panic!("{name} was not recorded"));
            let help = s.help.as_deref().unwrap_or_default();
            assert!(help.len() > 20, "{name}: HELP text missing or too short");
            let want_kind = if name.ends_with("_total") {
                MetricKind::Counter
            } else if [
                STEP_BUDGET_TOKENS,
                PREPARED_INPUTS,
                PREPARED_INPUT_TOKENS,
                ROWS_WAITING,
                ROWS_MID_PREFILL,
                ROWS_CONTINUING,
                HEAD_WAIT_SECONDS,
                HEAD_WAIT_STEPS,
                STEP_BUDGET_SECONDS,
                LATENCY_MODEL_COEFFICIENT,
                LATENCY_MODEL_SOURCE,
                TIME_MARGIN,
            ]
            .contains(&name)
            {
                MetricKind::Gauge
            } else {
                MetricKind::Histogram
            };
            assert_eq!(s.kind, want_kind, "{name}");
            let want_unit = if name.ends_with("_seconds") {
                Unit::Seconds
            } else {
                Unit::Count
            };
            assert_eq!(s.unit, Some(want_unit), "{name}");
            for (label, _) in &s.labels {
                assert!(LABELS.contains(&label.as_str()), "{name}: label {label}");
            }
        }
        let overruns = seen
            .iter()
            .find(|s| s.name == BUDGET_OVERRUNS_TOTAL)
            .unwrap();
        for reason in OverrunReason::ALL {
            assert!(
                overruns.help.as_deref().unwrap().contains(reason.as_str()),
                "HELP of {BUDGET_OVERRUNS_TOTAL} does not list reason {}",
                reason.as_str()
            );
        }
    }

    #[test]
    fn steps_chunks_tokens_and_deferred_rows_follow_the_scheduler() {
        let mut state = scheduler();
        state
            .queue_prompt(1, "llm", "prefill", 250, AdmitOptions::cached(0))
            .unwrap();
        state
            .queue_prompt(2, "llm", "prefill", 120, AdmitOptions::cached(0))
            .unwrap();
        let (mut ran_tokens, mut waiting, mut chunks, mut finals) = (Vec::new(), 0, 0, 0);
        let seen = recorded(|| {
            let m = inst().step(&n("llm"), &n("prefill"));
            // Until both prompts are through; bounded so a planner bug cannot hang the test.
            for _ in 0..20 {
                let batch = state
                    .plan_step("llm", "prefill", None)
                    .unwrap()
                    .into_batch();
                m.assembled(&batch, Duration::from_micros(30));
                if batch.rows.is_empty() {
                    state.abandon(batch.step, &[]).unwrap();
                    break;
                }
                let ran: Vec<u32> = batch.rows.iter().map(|r| r.tokens()).collect();
                let outcome = state.close_step(batch.step, &ran, None).unwrap();
                m.completed(&outcome);
                ran_tokens.push(outcome.tokens.ran as f64);
                waiting += u64::from(batch.waiting);
                chunks += u64::from(outcome.chunks);
                finals += u64::from(outcome.final_chunks);
            }
        });
        assert_eq!(finals, 2, "both prompts finished");
        assert!(
            chunks > finals,
            "the 250-token prompt was cut under a 100 budget"
        );
        assert!(waiting > 0, "two prompts under one budget: one waited");
        assert_eq!(ran_tokens.iter().sum::<f64>(), 370.0);

        assert_eq!(
            counter(&seen, STEPS_TOTAL, &LLM_PREFILL),
            ran_tokens.len() as u64
        );
        assert_eq!(histogram(&seen, STEP_TOKENS, &LLM_PREFILL), ran_tokens);
        let chunk_labels = |fin| {
            [
                LLM_PREFILL[0],
                LLM_PREFILL[1],
                LLM_PREFILL[2],
                (LABEL_FINAL, fin),
            ]
        };
        assert_eq!(counter(&seen, CHUNKS_TOTAL, &chunk_labels(FINAL_TRUE)), 2);
        assert_eq!(
            counter(&seen, CHUNKS_TOTAL, &chunk_labels(FINAL_FALSE)),
            chunks - finals
        );
        assert_eq!(counter(&seen, DEFERRED_ROWS_TOTAL, &LLM_PREFILL), waiting);
        let assembly = histogram(&seen, STEP_ASSEMBLY_SECONDS, &LLM_PREFILL);
        assert_eq!(
            assembly.len(),
            ran_tokens.len() + 1,
            "one per assembled step"
        );
        assert!(assembly.iter().all(|s| *s == 30e-6));
    }

    #[test]
    fn an_overrun_is_counted_by_reason_with_the_tokens_over_budget() {
        // A step outside the scheduler ran 37 tokens more than its budget: an `other` overrun.
        let o = crate::overrun::Overrun {
            node: n("llm"),
            walk: n("prefill"),
            budget: 100,
            tokens: 137,
            reason: OverrunReason::Other,
        };
        let seen = recorded(|| {
            inst()
                .overruns(&o.node, &o.walk)
                .record(o.reason, o.tokens - u64::from(o.budget));
            inst()
                .overruns(&o.node, &o.walk)
                .record(OverrunReason::UncutRow, 900);
        });
        let with_reason = |r: OverrunReason| {
            [
                LLM_PREFILL[0],
                LLM_PREFILL[1],
                LLM_PREFILL[2],
                (LABEL_REASON, r.as_str()),
            ]
        };
        assert_eq!(
            counter(
                &seen,
                BUDGET_OVERRUNS_TOTAL,
                &with_reason(OverrunReason::Other)
            ),
            1
        );
        assert_eq!(
            counter(
                &seen,
                BUDGET_OVERRUNS_TOTAL,
                &with_reason(OverrunReason::UncutRow)
            ),
            1
        );
        assert_eq!(
            histogram(&seen, OVERRUN_TOKENS, &LLM_PREFILL),
            vec![37.0, 900.0]
        );
    }

    #[test]
    fn gauges_hold_the_last_value_and_no_budget_reads_zero() {
        let seen = recorded(|| {
            inst().set_budget(&n("llm"), &n("prefill"), Some(4096));
            inst().set_budget(&n("llm"), &n("prefill"), Some(2048));
            inst().set_budget(&n("llm"), &n("decode"), None);
            set_prepared(&n("llm"), 3, 900);
            set_prepared(&n("llm"), 1, 250);
            set_prepared(&n("vision"), 0, 0);
        });
        assert_eq!(gauge(&seen, STEP_BUDGET_TOKENS, &LLM_PREFILL), 2048.0);
        assert_eq!(
            gauge(
                &seen,
                STEP_BUDGET_TOKENS,
                &[
                    (LABEL_MODEL, "m"),
                    (LABEL_NODE, "llm"),
                    (LABEL_WALK, "decode")
                ]
            ),
            0.0
        );
        assert_eq!(
            gauge(
                &seen,
                PREPARED_INPUTS,
                &[(LABEL_MODEL, "m"), (LABEL_NODE, "llm")]
            ),
            1.0
        );
        assert_eq!(
            gauge(
                &seen,
                PREPARED_INPUT_TOKENS,
                &[(LABEL_MODEL, "m"), (LABEL_NODE, "llm")]
            ),
            250.0
        );
        assert_eq!(
            gauge(
                &seen,
                PREPARED_INPUTS,
                &[(LABEL_MODEL, "m"), (LABEL_NODE, "vision")]
            ),
            0.0
        );
    }

    #[test]
    fn reloads_are_counted_by_result() {
        let seen = recorded(|| {
            inst().record_reload(true);
            inst().record_reload(false);
            inst().record_reload(true);
        });
        assert_eq!(
            counter(
                &seen,
                CONFIG_RELOADS_TOTAL,
                &[(LABEL_MODEL, "m"), (LABEL_RESULT, RESULT_OK)]
            ),
            2
        );
        assert_eq!(
            counter(
                &seen,
                CONFIG_RELOADS_TOTAL,
                &[(LABEL_MODEL, "m"), (LABEL_RESULT, RESULT_ERROR)]
            ),
            1
        );
    }

    #[cfg(feature = "prometheus")]
    #[test]
    fn the_exporter_renders_histograms_with_our_buckets() {
        let recorder = exporter::prometheus_builder().build_recorder();
        let handle = recorder.handle();
        metrics::with_local_recorder(&recorder, || {
            describe_all();
            let m = inst().step(&n("llm"), &n("prefill"));
            m.tokens.record(100.0);
            m.assembly_seconds.record(3e-5);
            inst()
                .overruns(&n("llm"), &n("prefill"))
                .record(OverrunReason::Other, 5);
        });
        let text = handle.render();
        for name in [STEP_TOKENS, OVERRUN_TOKENS, STEP_ASSEMBLY_SECONDS] {
            assert!(
                text.contains(&format!("# TYPE {name} histogram")),
                "{name} not rendered as a histogram:\n{text}"
            );
            assert!(text.contains(&format!("# HELP {name} ")), "{name}: no HELP");
        }
        assert!(text.contains(&format!(
            "{STEP_TOKENS}_bucket{{model=\"m\",node=\"llm\",walk=\"prefill\",le=\"1048576\"}} 1"
        )));
        assert!(text.contains(&format!(
            "{STEP_TOKENS}_bucket{{model=\"m\",node=\"llm\",walk=\"prefill\",le=\"64\"}} 0"
        )));
        assert!(text.contains(&format!(
            "{STEP_ASSEMBLY_SECONDS}_bucket{{model=\"m\",node=\"llm\",walk=\"prefill\",le=\"0.00005\"}} 1"
        )));
    }

    #[cfg(feature = "prometheus")]
    #[test]
    fn known_label_combinations_are_exported_at_zero_before_any_event() {
        let recorder = exporter::prometheus_builder().build_recorder();
        let handle = recorder.handle();
        metrics::with_local_recorder(&recorder, || {
            describe_all();
            inst().started();
            inst().set_budget(&n("llm"), &n("prefill"), Some(100));
            inst().set_budget(&n("llm"), &n("decode"), None);
        });
        let text = handle.render();
        for reason in OverrunReason::ALL {
            let series = format!(
                "{BUDGET_OVERRUNS_TOTAL}{{model=\"m\",node=\"llm\",walk=\"prefill\",reason=\"{}\"}} 0",
                reason.as_str()
            );
            assert!(text.contains(&series), "{series} missing:\n{text}");
        }
        assert!(
            text.contains(&format!(
                "{OVERRUN_TOKENS}_count{{model=\"m\",node=\"llm\",walk=\"prefill\"}} 0"
            )),
            "{text}"
        );
        for name in [STEPS_TOTAL, DEFERRED_ROWS_TOTAL] {
            let series = format!("{name}{{model=\"m\",node=\"llm\",walk=\"prefill\"}} 0");
            assert!(text.contains(&series), "{series} missing:\n{text}");
        }
        assert!(
            text.contains(&format!(
                "{STEP_SECONDS}_count{{model=\"m\",node=\"llm\",walk=\"prefill\"}} 0"
            )),
            "{text}"
        );
        for result in [RESULT_OK, RESULT_ERROR] {
            let series = format!("{CONFIG_RELOADS_TOTAL}{{model=\"m\",result=\"{result}\"}} 0");
            assert!(text.contains(&series), "{series} missing:\n{text}");
        }
        assert!(
            !text.contains("walk=\"decode\",reason"),
            "no overrun series where there is no budget:\n{text}"
        );
    }

    #[cfg(feature = "prometheus")]
    #[test]
    fn two_instances_export_separate_series() {
        let recorder = exporter::prometheus_builder().build_recorder();
        let handle = recorder.handle();
        metrics::with_local_recorder(&recorder, || {
            let (a, b) = (Instance::new(n("a")), Instance::new(n("b")));
            a.prepared(&n("llm")).0.set(3.0);
            b.prepared(&n("llm")).0.set(5.0);
        });
        let text = handle.render();
        assert!(text.contains(&format!("{PREPARED_INPUTS}{{model=\"a\",node=\"llm\"}} 3")));
        assert!(text.contains(&format!("{PREPARED_INPUTS}{{model=\"b\",node=\"llm\"}} 5")));
    }

    #[cfg(feature = "prometheus")]
    #[test]
    fn an_address_in_use_is_a_clear_startup_error() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = taken.local_addr().unwrap();
        // Fails before any recorder is installed, so the process-wide state stays untouched.
        let err = install_prometheus(addr).unwrap_err();
        assert!(matches!(err, MetricsError::Bind { .. }), "{err:?}");
        let msg = err.to_string();
        assert!(msg.contains(&addr.to_string()), "{msg}");
        assert!(msg.contains("`metrics.listen`"), "{msg}");
    }
}
