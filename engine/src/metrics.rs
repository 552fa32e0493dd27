//! Every metric the engine exports itself, in one place: names, HELP texts, units, label names
//! and values, and histogram buckets, in the pattern of the component's `metrics` module. Call
//! sites use the functions here, never string literals.
//!
//! [`install`] puts the process's Prometheus recorder in place and describes every series, the
//! component's ([`mstar_chunking::metrics::describe_all`]) and the engine's ([`describe_all`]).
//! It must run before the component starts: the component takes its metric handles when it
//! starts, and handles taken before a recorder is installed record nowhere.
//! [`crate::engine::start`] calls it first.
//!
//! `engine/README.md`'s metric table lists every name in [`ALL`]; a test checks that the two
//! agree.

use std::sync::OnceLock;

use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use mstar_chunking::metrics as core;

// === names ===

/// Time from a request's arrival to its first token (histogram).
pub const TTFT_SECONDS: &str = "engine_ttft_seconds";
/// Time between consecutive tokens of a request (histogram).
pub const TBT_SECONDS: &str = "engine_tbt_seconds";
/// Time from a request's arrival to its last token (histogram).
pub const E2E_SECONDS: &str = "engine_e2e_seconds";
/// Wall time of one model step (histogram).
pub const STEP_SECONDS: &str = "engine_step_seconds";
/// Tokens the model steps ran (counter).
pub const STEP_TOKENS_TOTAL: &str = "engine_step_tokens_total";
/// Requests admitted and not finished (gauge).
pub const REQUESTS_RUNNING: &str = "engine_requests_running";
/// Requests accepted and not yet admitted (gauge).
pub const REQUESTS_WAITING: &str = "engine_requests_waiting";
/// KV tokens the caches hold now (gauge).
pub const KV_TOKENS_USED: &str = "engine_kv_tokens_used";
/// KV tokens admitted requests reserved (gauge).
pub const KV_TOKENS_RESERVED: &str = "engine_kv_tokens_reserved";
/// KV capacity in tokens (gauge).
pub const KV_TOKENS_CAPACITY: &str = "engine_kv_tokens_capacity";
/// Requests that ended, by `result` (counter).
pub const REQUESTS_TOTAL: &str = "engine_requests_total";
/// Connections shed at the connection cap (counter).
pub const CONNECTIONS_SHED_TOTAL: &str = "engine_connections_shed_total";

/// Every metric name the engine exports itself.
pub const ALL: [&str; 12] = [
    TTFT_SECONDS,
    TBT_SECONDS,
    E2E_SECONDS,
    STEP_SECONDS,
    STEP_TOKENS_TOTAL,
    REQUESTS_RUNNING,
    REQUESTS_WAITING,
    KV_TOKENS_USED,
    KV_TOKENS_RESERVED,
    KV_TOKENS_CAPACITY,
    REQUESTS_TOTAL,
    CONNECTIONS_SHED_TOTAL,
];

// === labels ===

/// On [`REQUESTS_TOTAL`]: how a request ended, one of [`Outcome::ALL`]. No other label: a
/// per-request label would make a series per request.
pub const LABEL_RESULT: &str = "result";

/// How a request ended ([`LABEL_RESULT`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// It generated `max_tokens`.
    Length,
    /// It generated EOS.
    Stop,
    /// The engine aborted it (shutdown, a failed step, a refused admission).
    Abort,
    /// Its client went away before it finished.
    Disconnected,
}

impl Outcome {
    /// Every outcome, in label order.
    pub const ALL: [Outcome; 4] = [
        Outcome::Length,
        Outcome::Stop,
        Outcome::Abort,
        Outcome::Disconnected,
    ];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Length => "length",
            Outcome::Stop => "stop",
            Outcome::Abort => "abort",
            Outcome::Disconnected => "disconnected",
        }
    }
}

// === buckets ===

/// Buckets of the engine's latency histograms, in seconds: 1 ms to 30 s.
pub const LATENCY_BUCKETS: [f64; 14] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

// === descriptions ===

/// Registers the HELP text and unit of every engine metric with the installed recorder.
pub fn describe_all() {
    describe_histogram!(
        TTFT_SECONDS,
        Unit::Seconds,
        "Time from a request's arrival to its first generated token, in seconds."
    );
    describe_histogram!(
        TBT_SECONDS,
        Unit::Seconds,
        "Time between consecutive generated tokens of a request, in seconds."
    );
    describe_histogram!(
        E2E_SECONDS,
        Unit::Seconds,
        "Time from a request's arrival to its last token, in seconds (requests that finished by length or stop)."
    );
    describe_histogram!(
        STEP_SECONDS,
        Unit::Seconds,
        "Measured wall time of one model step, in seconds."
    );
    describe_counter!(
        STEP_TOKENS_TOTAL,
        Unit::Count,
        "Tokens the model steps were scheduled to run, in tokens."
    );
    describe_gauge!(
        REQUESTS_RUNNING,
        Unit::Count,
        "Requests admitted (KV reserved) and not finished."
    );
    describe_gauge!(
        REQUESTS_WAITING,
        Unit::Count,
        "Requests accepted and not admitted yet (most wait for KV memory)."
    );
    describe_gauge!(
        KV_TOKENS_USED,
        Unit::Count,
        "KV cache tokens the running requests' caches hold now, in tokens."
    );
    describe_gauge!(
        KV_TOKENS_RESERVED,
        Unit::Count,
        "KV cache tokens reserved by admitted requests (prompt + max_tokens each), in tokens."
    );
    describe_gauge!(
        KV_TOKENS_CAPACITY,
        Unit::Count,
        "KV cache capacity over all requests (--kv-tokens), in tokens."
    );
    describe_counter!(
        REQUESTS_TOTAL,
        Unit::Count,
        "Requests that ended, by result (length, stop, abort, disconnected)."
    );
    describe_counter!(
        CONNECTIONS_SHED_TOTAL,
        Unit::Count,
        "Connections shed at the connection cap to let a new client in: the one waiting on its client longest (a request still sending its body, or an idle connection)."
    );
}

// === recording ===

/// Records how a request ended.
pub fn request_ended(outcome: Outcome, n: u64) {
    metrics::counter!(REQUESTS_TOTAL, LABEL_RESULT => outcome.as_str()).increment(n);
}

/// Records a connection shed at the connection cap.
pub fn connection_shed() {
    metrics::counter!(CONNECTIONS_SHED_TOTAL).increment(1);
}

/// Records a model step: its wall time and the tokens it was scheduled to run.
pub fn step(ms: f64, tokens: u64) {
    metrics::histogram!(STEP_SECONDS).record(ms / 1000.0);
    metrics::counter!(STEP_TOKENS_TOTAL).increment(tokens);
}

/// Records a request's first token (`first`) or the time since its previous one.
pub fn token(first: bool, seconds: f64) {
    if first {
        metrics::histogram!(TTFT_SECONDS).record(seconds);
    } else {
        metrics::histogram!(TBT_SECONDS).record(seconds);
    }
}

/// Records a finished request's end-to-end time.
pub fn e2e(seconds: f64) {
    metrics::histogram!(E2E_SECONDS).record(seconds);
}

/// The engine's state the gauges publish.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Gauges {
    /// [`REQUESTS_RUNNING`].
    pub running: usize,
    /// [`REQUESTS_WAITING`].
    pub waiting: usize,
    /// [`KV_TOKENS_USED`].
    pub kv_used: u64,
    /// [`KV_TOKENS_RESERVED`].
    pub kv_reserved: u64,
    /// [`KV_TOKENS_CAPACITY`].
    pub kv_capacity: u64,
}

/// Publishes the engine's gauges; `/metrics` renders the last values published and never asks
/// the engine.
pub fn publish(g: Gauges) {
    metrics::gauge!(REQUESTS_RUNNING).set(g.running as f64);
    metrics::gauge!(REQUESTS_WAITING).set(g.waiting as f64);
    metrics::gauge!(KV_TOKENS_USED).set(g.kv_used as f64);
    metrics::gauge!(KV_TOKENS_RESERVED).set(g.kv_reserved as f64);
    metrics::gauge!(KV_TOKENS_CAPACITY).set(g.kv_capacity as f64);
}

/// Registers every series (counters at 0, empty histograms, gauges at 0), so each is on
/// `/metrics` from the first scrape.
fn register_all() {
    for o in Outcome::ALL {
        request_ended(o, 0);
    }
    metrics::counter!(STEP_TOKENS_TOTAL).increment(0);
    metrics::counter!(CONNECTIONS_SHED_TOTAL).increment(0);
    for h in [TTFT_SECONDS, TBT_SECONDS, E2E_SECONDS, STEP_SECONDS] {
        let _ = metrics::histogram!(h);
    }
    publish(Gauges::default());
}

// === the recorder ===

/// The exporter's settings: explicit buckets for every histogram, the engine's and the
/// component's (without them the exporter renders summaries, which cannot be aggregated).
fn builder() -> PrometheusBuilder {
    let tokens = core::token_buckets();
    let seconds = core::seconds_buckets();
    let step_time = core::STEP_TIME_BUCKETS.to_vec();
    let latency = LATENCY_BUCKETS.to_vec();
    [
        (core::STEP_TOKENS, &tokens),
        (core::OVERRUN_TOKENS, &tokens),
        (core::STEP_ASSEMBLY_SECONDS, &seconds),
        (core::STEP_SECONDS, &step_time),
        (core::STEP_PREDICTION_ERROR_SECONDS, &step_time),
        (TTFT_SECONDS, &latency),
        (TBT_SECONDS, &latency),
        (E2E_SECONDS, &latency),
        (STEP_SECONDS, &latency),
    ]
    .into_iter()
    .fold(PrometheusBuilder::new(), |b, (name, buckets)| {
        b.set_buckets_for_metric(Matcher::Full(name.into()), buckets)
            .expect("bucket lists are non-empty constants")
    })
}

/// Installs the process's Prometheus recorder (once) and describes every series; answers its
/// handle. Call it before the component starts ([`crate::engine::start`] does).
///
/// A recorder installed by someone else first wins: this one then renders nothing, which the
/// metrics tests would catch.
pub fn install() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let recorder = builder().build_recorder();
            let handle = recorder.handle();
            if metrics::set_global_recorder(recorder).is_err() {
                tracing::warn!("a metrics recorder was installed already; /metrics renders only what this one records");
            }
            core::describe_all();
            describe_all();
            register_all();
            handle
        })
        .clone()
}
