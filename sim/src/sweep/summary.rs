//! What one replay tells a sweep: its latencies and its step times as percentiles.

use serde::ser::SerializeStruct;
use serde::{Serialize, Serializer};

/// Percentiles kept of a run's step times: p0, p1, …, p100.
pub const STEP_QUANTILES: usize = 100;

/// What one replay tells a sweep. Serialised with its figures rounded to 0.001 (`null` for
/// none), in the order of its fields.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RunSummary {
    /// Requests replayed.
    pub requests: usize,
    /// Steps run.
    pub steps: u64,
    /// Steps that ran over their token budget.
    pub overruns: u64,
    /// Budget utilisation of the budgeted steps, in `[0, 1]`; `None` without a budgeted step.
    pub budget_utilisation: Option<f64>,
    /// Time between tokens, simulated ms: p50 and p99 (`None` without samples).
    pub tbt_p50_ms: Option<f64>,
    /// See `tbt_p50_ms`.
    pub tbt_p99_ms: Option<f64>,
    /// Time to first token, simulated ms: p50, p90 and p99 (`None` without samples).
    pub ttft_p50_ms: Option<f64>,
    /// See `ttft_p50_ms`.
    pub ttft_p90_ms: Option<f64>,
    /// See `ttft_p50_ms`.
    pub ttft_p99_ms: Option<f64>,
    /// The distribution of step durations.
    pub step_ms: StepTimes,
}

/// The names of [`RunSummary::latencies`], as `sweep.csv` and `sweep.json` spell them.
pub const LATENCIES: [&str; 5] = [
    "tbt_p50_ms",
    "tbt_p99_ms",
    "ttft_p50_ms",
    "ttft_p90_ms",
    "ttft_p99_ms",
];

/// A figure serialised rounded to 0.001.
struct Rounded(Option<f64>);

impl Serialize for Rounded {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        crate::text::ser_opt_round(&self.0, s)
    }
}

impl Serialize for RunSummary {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_struct("RunSummary", 10)?;
        m.serialize_field("requests", &self.requests)?;
        m.serialize_field("steps", &self.steps)?;
        m.serialize_field("overruns", &self.overruns)?;
        m.serialize_field("budget_utilisation", &Rounded(self.budget_utilisation))?;
        for (name, v) in LATENCIES.into_iter().zip(self.latencies()) {
            m.serialize_field(name, &Rounded(v))?;
        }
        m.serialize_field("step_ms", &self.step_ms)?;
        m.end()
    }
}

impl RunSummary {
    /// Its latencies in the order every table shows them (`LATENCIES`): TBT p50 and p99, TTFT
    /// p50, p90 and p99.
    pub fn latencies(&self) -> [Option<f64>; 5] {
        [
            self.tbt_p50_ms,
            self.tbt_p99_ms,
            self.ttft_p50_ms,
            self.ttft_p90_ms,
            self.ttft_p99_ms,
        ]
    }
}

/// The distribution of a run's step durations, as its percentiles p0 … p100 (nearest rank), in
/// simulated ms; empty without steps.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct StepTimes {
    /// `STEP_QUANTILES + 1` values, non-decreasing, or none.
    #[serde(serialize_with = "crate::text::ser_vec_round")]
    pub percentiles_ms: Vec<f64>,
}

impl StepTimes {
    /// The percentiles of `samples` (non-finite ones left out; reordered in place).
    pub fn from_samples(samples: &mut Vec<f64>) -> Self {
        samples.retain(|s| s.is_finite());
        samples.sort_by(f64::total_cmp);
        let percentiles_ms = if samples.is_empty() {
            Vec::new()
        } else {
            (0..=STEP_QUANTILES)
                .filter_map(|i| nearest_rank(samples, i as f64 / STEP_QUANTILES as f64))
                .collect()
        };
        Self { percentiles_ms }
    }

    /// The `p`-th percentile (`p` in 0..=100), if there were steps.
    pub fn percentile(&self, p: usize) -> Option<f64> {
        self.percentiles_ms.get(p).copied()
    }

    /// The percentiles `ps`, in order.
    pub fn percentiles<const N: usize>(&self, ps: [usize; N]) -> [Option<f64>; N] {
        ps.map(|p| self.percentile(p))
    }
}

/// What a sweep keeps of one replay: its latencies, and its step durations as the
/// percentiles of the report's histogram.
impl From<&crate::replay::ReplayReport> for RunSummary {
    fn from(r: &crate::replay::ReplayReport) -> Self {
        let step_ms = StepTimes {
            percentiles_ms: if r.step_ms.is_empty() {
                Vec::new()
            } else {
                (0..=STEP_QUANTILES)
                    .filter_map(|i| r.step_ms.quantile(i as f64 / STEP_QUANTILES as f64))
                    .collect()
            },
        };
        Self {
            requests: r.requests,
            steps: r.steps,
            overruns: r.overruns.total,
            budget_utilisation: r.budget_utilisation,
            tbt_p50_ms: r.tbt_ms.map(|l| l.p50),
            tbt_p99_ms: r.tbt_ms.map(|l| l.p99),
            ttft_p50_ms: r.ttft_ms.map(|l| l.p50),
            ttft_p90_ms: r.ttft_ms.map(|l| l.p90),
            ttft_p99_ms: r.ttft_ms.map(|l| l.p99),
            step_ms,
        }
    }
}

/// The nearest-rank quantile `p` (in `[0, 1]`) of `sorted` (ascending): the smallest value with
/// at least `p` of the samples at or below it; the minimum for `p = 0`. `None` when empty.
pub fn nearest_rank(sorted: &[f64], p: f64) -> Option<f64> {
    let n = sorted.len();
    if n == 0 || !p.is_finite() {
        return None;
    }
    let k = ((p.clamp(0.0, 1.0) * n as f64).ceil() as usize).clamp(1, n) - 1;
    sorted.get(k).copied()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_times_keep_nearest_rank_percentiles() {
        let mut v: Vec<f64> = (1..=1000).rev().map(f64::from).collect();
        v.push(f64::NAN);
        let s = StepTimes::from_samples(&mut v);
        assert_eq!(s.percentiles_ms.len(), 101);
        assert_eq!(
            (
                s.percentile(0),
                s.percentile(50),
                s.percentile(99),
                s.percentile(100)
            ),
            (Some(1.0), Some(500.0), Some(990.0), Some(1000.0))
        );
        assert_eq!(
            StepTimes::from_samples(&mut Vec::new()).percentile(50),
            None
        );
        assert_eq!(nearest_rank(&[], 0.5), None);
        assert_eq!(nearest_rank(&[3.0], f64::NAN), None);
    }
}
