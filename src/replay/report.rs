//! What a replay shows: the summary table and the `--report-json` document.

use std::fmt;

use serde::Serialize;

use super::trace::TraceFormat;

/// The outcome of a replay. Serialised as is by `--report-json`; `Display` is the summary table.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReplayReport {
    /// The trace file (or the bundled trace's name) and its format.
    pub trace: String,
    /// The trace's format.
    pub format: TraceFormat,
    /// The node replay drove, and the walks its steps ran on (one combined walk, or `prefill`
    /// and `decode` alternately).
    pub node: String,
    /// The step walks.
    pub walks: Vec<String>,
    /// Whether every budget was turned off (`--budget-off`).
    pub budget_off: bool,
    /// Arrivals were this many times as dense as the trace's.
    pub rate_scale: f64,
    /// Requests replayed, and bad trace lines left out (`--skip-bad-lines`).
    pub requests: usize,
    /// Bad trace lines left out.
    pub skipped_lines: usize,
    /// The first few bad lines left out.
    pub bad_line_examples: Vec<String>,
    /// Steps run (empty steps are not counted), and how many of them ran under a budget.
    pub steps: u64,
    /// Steps that ran under a budget.
    pub budgeted_steps: u64,
    /// Tokens, by kind.
    pub tokens: TokenCounts,
    /// `sum(min(scheduled, budget)) / sum(budget)` over the steps with a budget; null if none.
    pub budget_utilisation: Option<f64>,
    /// Steps that cut a prompt (ran a non-final chunk), and their utilisation: a cut step
    /// should be full, since a prompt is cut only to what is left of the budget.
    pub cut_steps: u64,
    /// The budget utilisation of the steps that cut a prompt.
    pub cut_step_utilisation: Option<f64>,
    /// Chunks run.
    pub chunks: ChunkCounts,
    /// Overruns, by reason.
    pub overruns: OverrunCounts,
    /// Steps whose simulated time exceeded their time budget, by reason
    /// (`docs/cost-model.md#time-overruns`).
    pub time_overruns: TimeOverrunCounts,
    /// The latency model the component planned with at the end, under the config's key names.
    pub latency_model: LatencyModelReport,
    /// Step slots a decode row (already generating) waited without running: "decode stalls".
    pub decode_row_waits: u64,
    /// Time to first token and time between tokens, in simulated ms; null without samples.
    pub ttft_ms: Option<Latency>,
    /// Time between tokens, in simulated ms.
    pub tbt_ms: Option<Latency>,
    /// The most prepared inputs held at once (rows, and their tokens).
    pub peak_prepared_rows: usize,
    /// The tokens of the prepared inputs held at the peak.
    pub peak_prepared_tokens: u64,
    /// Prepared inputs held after the replay, asserted to be none (a replay with any left fails).
    pub prepared_left_rows: usize,
    /// Their tokens.
    pub prepared_left_tokens: u64,
    /// The simulated time the replay covered, from the first arrival to the last step's end.
    pub simulated_ms: f64,
    /// Wall time of the replay (trace reading included), and steps per wall second.
    pub wall_ms: f64,
    /// Steps per wall-clock second.
    pub steps_per_second: f64,
    /// Where the step log went, if one was written.
    pub step_log: Option<String>,
    /// The signal that stopped the replay early (`SIGINT`, `SIGTERM`); `None`: it ran to the end.
    pub interrupted: Option<String>,
}

/// Tokens, by kind.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct TokenCounts {
    /// Scheduled by the planner, and actually run (more with speculation overshoots).
    pub scheduled: u64,
    /// Tokens actually run.
    pub ran: u64,
    /// Prompt tokens run in chunks, and prompt tokens served from the prefix cache instead.
    pub prefill: u64,
    /// Prompt tokens served from the prefix cache.
    pub cached: u64,
    /// Tokens run by continuing (decode) rows, and the tokens they generated.
    pub decode: u64,
    /// Tokens generated.
    pub generated: u64,
}

/// Chunks run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct ChunkCounts {
    /// Chunks, of which final.
    pub total: u64,
    /// Final chunks: one per prompt that finished its prefill.
    pub final_chunks: u64,
    /// Prompts that ran in more than one chunk.
    pub prompts_cut: u64,
    /// Prompts that started with a prefix-cache hit.
    pub prefix_cache_hits: u64,
}

/// Overruns by reason.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct OverrunCounts {
    /// Every overrun.
    pub total: u64,
    /// A row that could not be cut ran whole.
    pub uncut_row: u64,
    /// Speculative rows ran more than their estimate.
    pub speculation_estimate: u64,
    /// Any other reason.
    pub other: u64,
}

/// Time overruns, by reason (`docs/cost-model.md#time-overruns`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct TimeOverrunCounts {
    /// Every time overrun.
    pub total: u64,
    /// The first prefill row ran a chunk of the floor over the time budget.
    pub floor: u64,
    /// A row that cannot be cut ran whole over the time budget.
    pub uncut_row: u64,
    /// The continuing rows alone were predicted over the time budget.
    pub continuing: u64,
    /// The step was predicted to fit and took longer.
    pub misprediction: u64,
}

impl TimeOverrunCounts {
    /// Counts one time overrun.
    pub fn count(&mut self, reason: crate::latency::TimeOverrunReason) {
        use crate::latency::TimeOverrunReason as R;
        self.total += 1;
        match reason {
            R::Floor => self.floor += 1,
            R::UncutRow => self.uncut_row += 1,
            R::Continuing => self.continuing += 1,
            R::Misprediction => self.misprediction += 1,
        }
    }
}

/// The latency model in use: its source and coefficients, named as in `chunking.cost.<node>`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct LatencyModelReport {
    /// `online`, `config` or `none`.
    pub source: crate::latency::ModelSource,
    /// Milliseconds every step costs (null without a model).
    pub base_ms: Option<f64>,
    /// Milliseconds a token adds.
    pub per_token_ms: Option<f64>,
    /// Milliseconds a continuing row's context token adds.
    pub per_kv_token_ms: Option<f64>,
    /// Milliseconds a causal attention pair adds.
    pub per_attention_pair_ms: Option<f64>,
}

impl Default for LatencyModelReport {
    fn default() -> Self {
        Self::from((None, crate::latency::ModelSource::None))
    }
}

impl
    From<(
        Option<crate::latency::LatencyModel>,
        crate::latency::ModelSource,
    )> for LatencyModelReport
{
    fn from(
        (model, source): (
            Option<crate::latency::LatencyModel>,
            crate::latency::ModelSource,
        ),
    ) -> Self {
        let c = model.map(|m| m.coefficients());
        Self {
            source,
            base_ms: c.map(|c| c[0]),
            per_token_ms: c.map(|c| c[1]),
            per_kv_token_ms: c.map(|c| c[2]),
            per_attention_pair_ms: c.map(|c| c[3]),
        }
    }
}

/// Two percentiles of a latency, in simulated ms.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Latency {
    /// The median.
    pub p50: f64,
    /// The 99th percentile (nearest rank).
    pub p99: f64,
    /// The largest sample.
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
            p99: rank(0.99),
            max: rank(1.0),
            samples: n,
        })
    }
}

fn latency(l: &Option<Latency>) -> String {
    match l {
        Some(l) => format!(
            "{:.1} / {:.1} ms (max {:.1}, {} samples)",
            l.p50, l.p99, l.max, l.samples
        ),
        None => "none".into(),
    }
}

fn pct(part: u64, whole: u64) -> String {
    if whole == 0 {
        return "0%".into();
    }
    format!("{:.1}%", part as f64 * 100.0 / whole as f64)
}

impl fmt::Display for ReplayReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let row = |f: &mut fmt::Formatter<'_>, k: &str, v: String| writeln!(f, "  {k:<24} {v}");
        writeln!(
            f,
            "replay of {} ({}) on node `{}`, walk{} {}{}",
            self.trace,
            self.format,
            self.node,
            if self.walks.len() > 1 { "s" } else { "" },
            self.walks
                .iter()
                .map(|w| format!("`{w}`"))
                .collect::<Vec<_>>()
                .join(" / "),
            if self.budget_off { ", budgets off" } else { "" },
        )?;
        let skipped = if self.skipped_lines > 0 {
            format!(" ({} bad lines skipped)", self.skipped_lines)
        } else {
            String::new()
        };
        row(
            f,
            "requests",
            format!("{}{skipped}, rate scale {}", self.requests, self.rate_scale),
        )?;
        row(
            f,
            "steps",
            format!("{} ({} under a budget)", self.steps, self.budgeted_steps),
        )?;
        let t = &self.tokens;
        row(
            f,
            "tokens",
            format!(
                "{} ran ({} scheduled): {} prefill, {} decode; {} generated; {} prompt tokens cached",
                t.ran, t.scheduled, t.prefill, t.decode, t.generated, t.cached
            ),
        )?;
        row(
            f,
            "budget utilisation",
            match (self.budget_utilisation, self.cut_step_utilisation) {
                (None, _) => "no budgeted step".into(),
                (Some(u), None) => format!("{:.1}% (no step cut a prompt)", u * 100.0),
                (Some(u), Some(c)) => format!(
                    "{:.1}% of all budgeted steps; {:.1}% of the {} steps that cut a prompt",
                    u * 100.0,
                    c * 100.0,
                    self.cut_steps
                ),
            },
        )?;
        let c = &self.chunks;
        row(
            f,
            "chunks",
            format!(
                "{} ({} final); {} prompts cut ({}); {} prefix-cache hits",
                c.total,
                c.final_chunks,
                c.prompts_cut,
                pct(c.prompts_cut, self.requests as u64),
                c.prefix_cache_hits
            ),
        )?;
        let o = &self.overruns;
        row(
            f,
            "overruns",
            format!(
                "{} (uncut_row {}, speculation_estimate {}, other {})",
                o.total, o.uncut_row, o.speculation_estimate, o.other
            ),
        )?;
        let t = &self.time_overruns;
        row(
            f,
            "time overruns",
            format!(
                "{} (floor {}, uncut_row {}, continuing {}, misprediction {})",
                t.total, t.floor, t.uncut_row, t.continuing, t.misprediction
            ),
        )?;
        let m = &self.latency_model;
        row(
            f,
            "latency model",
            match m.base_ms {
                Some(base) => format!(
                    "{}: base_ms {base:.4}, per_token_ms {:.6}, per_kv_token_ms {:.3e}, per_attention_pair_ms {:.3e}",
                    m.source.as_str(),
                    m.per_token_ms.unwrap_or(0.0),
                    m.per_kv_token_ms.unwrap_or(0.0),
                    m.per_attention_pair_ms.unwrap_or(0.0)
                ),
                None => "none".into(),
            },
        )?;
        row(
            f,
            "decode row waits",
            format!("{} row-steps", self.decode_row_waits),
        )?;
        row(f, "TTFT p50 / p99", latency(&self.ttft_ms))?;
        row(f, "TBT p50 / p99", latency(&self.tbt_ms))?;
        row(
            f,
            "peak prepared inputs",
            format!(
                "{} rows, {} tokens",
                self.peak_prepared_rows, self.peak_prepared_tokens
            ),
        )?;
        row(
            f,
            "prepared inputs left",
            if self.prepared_left_rows == 0 {
                "none (every prepared input was released)".into()
            } else {
                format!(
                    "{} rows, {} tokens",
                    self.prepared_left_rows, self.prepared_left_tokens
                )
            },
        )?;
        row(
            f,
            "simulated time",
            format!("{:.1} s", self.simulated_ms / 1000.0),
        )?;
        row(
            f,
            "wall time",
            format!(
                "{:.0} ms, {:.0} steps/s",
                self.wall_ms, self.steps_per_second
            ),
        )?;
        if let Some(p) = &self.step_log {
            row(f, "step log", p.clone())?;
        }
        if let Some(sig) = &self.interrupted {
            row(
                f,
                "interrupted",
                format!("by {sig}: the figures cover the steps that ran"),
            )?;
        }
        for e in &self.bad_line_examples {
            writeln!(f, "  skipped: {e}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let mut v: Vec<f64> = (1..=100).map(f64::from).rev().collect();
        let l = Latency::of(&mut v).unwrap();
        assert_eq!((l.p50, l.p99, l.max, l.samples), (50.0, 99.0, 100.0, 100));
        let mut one = [7.5f32];
        assert_eq!(Latency::of(&mut one).unwrap().p99, 7.5);
        assert!(Latency::of::<f64>(&mut []).is_none());
    }
}
