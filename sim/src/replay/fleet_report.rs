//! What a fleet replay adds to the report (`docs/fleet.md#the-report`): the fleet's settings,
//! and how the work spread across the workers. The fleet's own latencies are the report's
//! `ttft_ms` and `tbt_ms`, over every worker's samples.

use std::fmt;

use serde::{Serialize, Serializer};

use super::percentiles::Latency;
use super::router::RouterKind;
use crate::text::plural;

/// A fleet's part of the report; absent with one worker.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FleetReport {
    /// Workers replayed.
    pub workers: u32,
    /// The router's rule.
    #[serde(serialize_with = "ser_router")]
    pub router: RouterKind,
    /// `prefix_affinity`'s load guard, in outstanding requests (only under that router).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub affinity_slack: Option<u32>,
    /// The most requests one worker got, over the mean (1: an even spread).
    #[serde(serialize_with = "ser_ratio")]
    pub request_imbalance: f64,
    /// Each worker's share of the work and its latencies, by worker.
    pub per_worker: Vec<WorkerFigures>,
    /// A disaggregated fleet's pools, link and transfers (`docs/disaggregated.md`);
    /// absent from a colocated fleet's report.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub disaggregated: Option<PdReport>,
}

/// What a disaggregated fleet adds to the report: its pools and link, and the KV transfers.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PdReport {
    /// The pools and the link, as checked.
    #[serde(flatten)]
    pub setup: super::topology::PdSetup,
    /// KV transfers made: one per request that generated more than its first token.
    pub transfers: usize,
    /// Bytes they moved.
    pub transfer_bytes: f64,
    /// From a request's first token to its KV's arrival at a decode worker, simulated ms (its
    /// wait for the prefill worker's link included).
    pub transfer_ms: Option<Latency>,
    /// KV blocks requests still held on any worker when the replay ended (0 once every
    /// request is done; without a KV pool, always 0).
    pub kv_blocks_left: u64,
}

/// One worker's share of a fleet's work.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WorkerFigures {
    /// The worker's index.
    pub worker: u32,
    /// Its pool in a disaggregated fleet: `prefill` or `decode`; absent in a colocated one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pool: Option<&'static str>,
    /// Requests the router sent it, and their share of all.
    pub requests: usize,
    /// `requests` over the fleet's.
    #[serde(serialize_with = "ser_ratio")]
    pub request_share: f64,
    /// Tokens its steps ran, and their share of all.
    pub tokens: u64,
    /// `tokens` over the fleet's.
    #[serde(serialize_with = "ser_ratio")]
    pub token_share: f64,
    /// Prompt tokens its prefix cache served.
    pub cached_tokens: u64,
    /// Steps it ran.
    pub steps: u64,
    /// Its requests' time to first token, simulated ms.
    pub ttft_ms: Option<Latency>,
    /// Its requests' time between tokens, simulated ms.
    pub tbt_ms: Option<Latency>,
}

fn ser_router<S: Serializer>(r: &RouterKind, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(r.as_str())
}

fn ser_ratio<S: Serializer>(x: &f64, s: S) -> Result<S::Ok, S::Error> {
    if x.is_finite() {
        s.serialize_f64((x * 10_000.0).round() / 10_000.0)
    } else {
        s.serialize_none()
    }
}

/// `part / whole`, 0 when there is no whole.
pub(crate) fn share(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        part as f64 / whole as f64
    }
}

impl FleetReport {
    /// The report's `fleet` settings line: `4 workers behind least_outstanding`.
    pub fn label(&self) -> String {
        let workers = match &self.disaggregated {
            None => plural(u64::from(self.workers), "worker"),
            Some(pd) => super::topology::label(&pd.setup),
        };
        let mut s = format!("{workers} behind {}", self.router);
        if let Some(slack) = self.affinity_slack {
            s.push_str(&format!(
                " (load guard: {} over the least loaded)",
                plural(u64::from(slack), "outstanding request")
            ));
        }
        if let Some(pd) = &self.disaggregated {
            let l = &pd.setup;
            s.push_str(&format!(
                "; KV link {} Gbit/s + {} ms, {} B a token ({})",
                l.kv_link_gbps, l.kv_link_latency_ms, l.kv_bytes_per_token, l.kv_bytes_source
            ));
        }
        s
    }
}

fn p99(l: &Option<Latency>) -> String {
    l.map_or_else(|| "-".into(), |l| format!("{:.1}", l.p99))
}

impl fmt::Display for FleetReport {
    /// The spread: one line per worker, after a line with the imbalance.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "  {:<24} most requests on one worker {:.2}x the mean",
            "spread", self.request_imbalance
        )?;
        if let Some(pd) = &self.disaggregated {
            let ms = |q: fn(&Latency) -> f64| {
                pd.transfer_ms
                    .as_ref()
                    .map_or_else(|| "-".into(), |l| format!("{:.1}", q(l)))
            };
            writeln!(
                f,
                "  {:<24} {} of {:.3} GB; first token to KV arrival p50 {} ms, p99 {} ms",
                "kv transfers",
                pd.transfers,
                pd.transfer_bytes / 1e9,
                ms(|l| l.p50),
                ms(|l| l.p99)
            )?;
        }
        for w in &self.per_worker {
            if let Some(pool) = w.pool {
                write!(f, "    {pool:<7}")?;
            }
            writeln!(
                f,
                "    worker {:<3} {:>6} requests ({:>5.1}%), {:>10} tokens ({:>5.1}%), {} cached, {} steps; TTFT p99 {} ms, TBT p99 {} ms",
                w.worker,
                w.requests,
                w.request_share * 100.0,
                w.tokens,
                w.token_share * 100.0,
                w.cached_tokens,
                w.steps,
                p99(&w.ttft_ms),
                p99(&w.tbt_ms)
            )?;
        }
        Ok(())
    }
}
