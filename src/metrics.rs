//! Every metric the component exports (SPEC §7), in one place: names, HELP texts, units, label
//! values and histogram buckets. Call sites use the handles and functions here, never string
//! literals. The library records through the `metrics` facade and never installs a recorder;
//! the binary installs the Prometheus exporter ([`install_prometheus`]), an embedding engine may
//! install its own.

use std::net::SocketAddr;

use metrics::{
    describe_counter, describe_gauge, describe_histogram, Counter, Gauge, Histogram, Unit,
};

use crate::overrun::OverrunReason;
use crate::Name;

pub const STEPS_TOTAL: &str = "mstar_chunking_steps_total";
pub const STEP_TOKENS: &str = "mstar_chunking_step_tokens";
pub const STEP_BUDGET_TOKENS: &str = "mstar_chunking_step_budget_tokens";
pub const BUDGET_OVERRUNS_TOTAL: &str = "mstar_chunking_budget_overruns_total";
pub const OVERRUN_TOKENS: &str = "mstar_chunking_overrun_tokens";
pub const CHUNKS_TOTAL: &str = "mstar_chunking_chunks_total";
pub const DEFERRED_ROWS_TOTAL: &str = "mstar_chunking_deferred_rows_total";
pub const PREPARED_INPUTS: &str = "mstar_chunking_prepared_inputs";
pub const PREPARED_INPUT_TOKENS: &str = "mstar_chunking_prepared_input_tokens";
pub const STEP_ASSEMBLY_SECONDS: &str = "mstar_chunking_step_assembly_seconds";
pub const CONFIG_RELOADS_TOTAL: &str = "mstar_chunking_config_reloads_total";

/// Every metric name, for tests and dashboards checks.
pub const ALL: [&str; 11] = [
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
];

/// Token histogram buckets: powers of two from 1 to 2^20 (1M).
pub fn token_buckets() -> Vec<f64> {
    (0..=20).map(|p| f64::from(1u32 << p)).collect()
}

/// Seconds histogram buckets: 1 µs to 1 s, 1-2.5-5 per decade.
pub fn seconds_buckets() -> Vec<f64> {
    let mut b = Vec::new();
    let mut decade = 1e-6;
    while decade < 1.0 {
        b.extend([decade, decade * 2.5, decade * 5.0]);
        decade *= 10.0;
    }
    b.push(1.0);
    b
}

/// Registers the HELP text and unit of every metric with the installed recorder.
pub fn describe_all() {
    describe_counter!(
        STEPS_TOTAL,
        Unit::Count,
        "Steps assembled and completed, by node and walk."
    );
    describe_histogram!(
        STEP_TOKENS,
        Unit::Count,
        "Tokens a completed step actually ran (unit: tokens)."
    );
    describe_gauge!(
        STEP_BUDGET_TOKENS,
        Unit::Count,
        "The accepted token budget of each (node, walk); 0 where there is none (chunking off)."
    );
    describe_counter!(
        BUDGET_OVERRUNS_TOTAL,
        Unit::Count,
        "Steps that ran more tokens than the budget they were scheduled under; reason: uncut_row, speculation_estimate, other."
    );
    describe_histogram!(
        OVERRUN_TOKENS,
        Unit::Count,
        "Tokens by which an overrunning step exceeded its budget (unit: tokens)."
    );
    describe_counter!(
        CHUNKS_TOTAL,
        Unit::Count,
        "Prefill chunks run; final: true for a row's last chunk, false otherwise."
    );
    describe_counter!(
        DEFERRED_ROWS_TOTAL,
        Unit::Count,
        "Eligible rows left waiting by an assembled step."
    );
    describe_gauge!(
        PREPARED_INPUTS,
        Unit::Count,
        "Rows whose whole prepared input is held, by node."
    );
    describe_gauge!(
        PREPARED_INPUT_TOKENS,
        Unit::Count,
        "Tokens of the whole prepared inputs held, by node (unit: tokens)."
    );
    describe_histogram!(
        STEP_ASSEMBLY_SECONDS,
        Unit::Seconds,
        "Time to plan one step's batch in the scheduler."
    );
    describe_counter!(
        CONFIG_RELOADS_TOTAL,
        Unit::Count,
        "Serving config reloads; result: ok or error."
    );
}

/// Installs the Prometheus exporter as the global recorder, listening on `listen`, with the
/// buckets above, and describes every metric.
///
/// # Errors
/// The address cannot be bound, or a global recorder is already installed.
pub fn install_prometheus(listen: SocketAddr) -> Result<(), String> {
    use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
    let std_listener = std::net::TcpListener::bind(listen)
        .map_err(|e| format!("cannot listen for metrics on {listen}: {e}"))?;
    drop(std_listener);
    let builder = PrometheusBuilder::new()
        .with_http_listener(listen)
        .set_buckets_for_metric(Matcher::Full(STEP_TOKENS.into()), &token_buckets())
        .and_then(|b| {
            b.set_buckets_for_metric(Matcher::Full(OVERRUN_TOKENS.into()), &token_buckets())
        })
        .and_then(|b| {
            b.set_buckets_for_metric(
                Matcher::Full(STEP_ASSEMBLY_SECONDS.into()),
                &seconds_buckets(),
            )
        })
        .map_err(|e| e.to_string())?;
    builder
        .install()
        .map_err(|e| format!("cannot start the metrics endpoint on {listen}: {e}"))?;
    describe_all();
    Ok(())
}

/// The handles of one `(node, walk)`'s step metrics, resolved once and reused every step.
#[derive(Clone)]
pub struct StepMetrics {
    pub steps: Counter,
    pub tokens: Histogram,
    pub chunks_final: Counter,
    pub chunks_partial: Counter,
    pub deferred: Counter,
    pub assembly_seconds: Histogram,
}

impl StepMetrics {
    /// Resolves the handles for `node`/`walk` in the current recorder.
    pub fn new(node: &Name, walk: &Name) -> Self {
        let labels = [("node", node.to_string()), ("walk", walk.to_string())];
        let chunks = |fin: &'static str| metrics::counter!(CHUNKS_TOTAL, "node" => node.to_string(), "walk" => walk.to_string(), "final" => fin);
        Self {
            steps: metrics::counter!(STEPS_TOTAL, &labels),
            tokens: metrics::histogram!(STEP_TOKENS, &labels),
            chunks_final: chunks("true"),
            chunks_partial: chunks("false"),
            deferred: metrics::counter!(DEFERRED_ROWS_TOTAL, &labels),
            assembly_seconds: metrics::histogram!(STEP_ASSEMBLY_SECONDS, &labels),
        }
    }
}

/// Records an overrun of `node`/`walk` by `over` tokens.
pub fn record_overrun(node: &Name, walk: &Name, reason: OverrunReason, over: u64) {
    metrics::counter!(BUDGET_OVERRUNS_TOTAL, "node" => node.to_string(), "walk" => walk.to_string(), "reason" => reason.as_str())
        .increment(1);
    metrics::histogram!(OVERRUN_TOKENS, "node" => node.to_string(), "walk" => walk.to_string())
        .record(over as f64);
}

/// Sets the budget gauge of `node`/`walk` (0 where there is no budget).
pub fn set_budget(node: &Name, walk: &Name, budget: Option<u32>) {
    metrics::gauge!(STEP_BUDGET_TOKENS, "node" => node.to_string(), "walk" => walk.to_string())
        .set(f64::from(budget.unwrap_or(0)));
}

/// Sets the prepared-input gauges of `node`.
pub fn set_prepared(node: &Name, rows: usize, tokens: u64) {
    metrics::gauge!(PREPARED_INPUTS, "node" => node.to_string()).set(rows as f64);
    metrics::gauge!(PREPARED_INPUT_TOKENS, "node" => node.to_string()).set(tokens as f64);
}

/// Counts a config reload; `ok` is its result.
pub fn record_reload(ok: bool) {
    metrics::counter!(CONFIG_RELOADS_TOTAL, "result" => if ok { "ok" } else { "error" })
        .increment(1);
}

/// The gauge of prepared inputs on `node`, for callers that hold it.
pub fn prepared_gauge(node: &Name) -> (Gauge, Gauge) {
    (
        metrics::gauge!(PREPARED_INPUTS, "node" => node.to_string()),
        metrics::gauge!(PREPARED_INPUT_TOKENS, "node" => node.to_string()),
    )
}
