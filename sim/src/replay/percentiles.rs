//! Latency percentiles as the reports give them ([`Latency`], nearest rank, in simulated ms)
//! and [`round_ms`], a simulated ms rounded as the JSON reports give it (their serialisers are
//! `crate::text`'s, shared with the sweep).

use serde::Serialize;

use crate::text::ser_round;

/// Percentiles of a latency, in simulated ms (nearest rank).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Latency {
    /// The median.
    #[serde(serialize_with = "ser_round")]
    pub p50: f64,
    /// The 90th percentile (the sweep's TTFT objective uses it).
    #[serde(serialize_with = "ser_round")]
    pub p90: f64,
    /// The 99th percentile.
    #[serde(serialize_with = "ser_round")]
    pub p99: f64,
    /// The largest sample.
    #[serde(serialize_with = "ser_round")]
    pub max: f64,
    /// How many samples.
    pub samples: usize,
}

impl Latency {
    /// Nearest-rank percentiles of `samples` (reordered in place); `None` when empty.
    pub fn of<T: Copy + Into<f64>>(samples: &mut [T]) -> Option<Self> {
        let n = samples.len();
        if n == 0 {
            return None;
        }
        let mut rank = |p: f64| -> f64 {
            // Nearest rank: the smallest value with at least p of the samples at or below it.
            let k = ((p * n as f64).ceil() as usize).clamp(1, n) - 1;
            let (_, v, _) = samples.select_nth_unstable_by(k, |a, b| {
                let (a, b): (f64, f64) = ((*a).into(), (*b).into());
                a.total_cmp(&b)
            });
            (*v).into()
        };
        Some(Self {
            p50: rank(0.50),
            p90: rank(0.90),
            p99: rank(0.99),
            max: rank(1.0),
            samples: n,
        })
    }
}

/// Rounds to 0.001, the precision a simulated ms means.
pub fn round_ms(x: f64) -> f64 {
    crate::text::round3(x)
}
