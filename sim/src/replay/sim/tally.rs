//! What a finished simulation counted, before the figures that need every sample (percentiles,
//! ratios of sums): one worker's report is computed from its tally; a fleet pools its workers'
//! tallies first ([`Tally::absorb`]), so that the fleet's percentiles are those of every
//! sample, not an average of the workers' percentiles.

use super::memory::KvState;
use crate::replay::priority::ByClass;
use crate::replay::report::{Latency, ReplayReport, StepDurations};

/// Adds each named count of `$from` into `$into`.
macro_rules! add_counts {
    ($into:expr, $from:expr; $($field:ident),+ $(,)?) => {
        $( $into.$field += $from.$field; )+
    };
}

/// One simulation's (or a fleet's pooled) counts and samples.
pub(crate) struct Tally {
    /// The report with every count filled in; percentiles and ratios are computed by
    /// [`Tally::finish`].
    pub report: ReplayReport,
    /// Budget utilisation's sums: over the budgeted steps, and over those that cut a prompt.
    pub budget_sum: u64,
    pub budget_used: u64,
    pub cut_budget_sum: u64,
    pub cut_budget_used: u64,
    /// Every time to first token.
    pub ttft: Vec<f64>,
    /// Every time between tokens, in the bounded histogram.
    pub tbt: StepDurations,
    /// The same per priority class.
    pub by_class: ByClass,
    /// The KV memory model's counts; `None`: unlimited memory.
    pub kv: Option<KvState>,
    /// The first arrival and the end of the last step, simulated ms.
    pub first_arrival_ms: f64,
    pub end_ms: f64,
}

impl Tally {
    /// Pools `other`'s counts and samples into these: sums of counts, every sample, the
    /// largest peaks, the latest end. The latency model kept is this tally's.
    pub fn absorb(&mut self, other: Tally) {
        let (a, b) = (&mut self.report, other.report);
        add_counts!(a, b; steps, budgeted_steps, cut_steps, decode_row_waits);
        add_counts!(a.tokens, b.tokens; scheduled, ran, prefill, cached, decode, generated);
        add_counts!(a.chunks, b.chunks; total, final_chunks, prompts_cut, prefix_cache_hits);
        add_counts!(a.overruns, b.overruns; total, uncut_row, speculation_estimate, other);
        add_counts!(
            a.time_overruns, b.time_overruns;
            total, floor, uncut_row, continuing, misprediction
        );
        if let Some(u) = b.time_budget {
            let t = a.time_budget.get_or_insert_with(Default::default);
            t.steps += u.steps;
            t.inactive_steps += u.inactive_steps;
            if t.inactive_reason.is_none() {
                t.inactive_reason = u.inactive_reason;
            }
        }
        a.step_ms.absorb(&b.step_ms);
        for w in b.warnings {
            if !a.warnings.contains(&w) {
                a.warnings.push(w);
            }
        }
        a.peak_prepared_rows = a.peak_prepared_rows.max(b.peak_prepared_rows);
        a.peak_prepared_tokens = a.peak_prepared_tokens.max(b.peak_prepared_tokens);
        add_counts!(self, other; budget_sum, budget_used, cut_budget_sum, cut_budget_used);
        self.ttft.extend(other.ttft);
        self.tbt.absorb(&other.tbt);
        self.by_class.absorb(other.by_class);
        match (&mut self.kv, other.kv) {
            (Some(k), Some(o)) => k.absorb(o),
            (None, o) => self.kv = o,
            (Some(_), None) => {}
        }
        self.first_arrival_ms = self.first_arrival_ms.min(other.first_arrival_ms);
        self.end_ms = self.end_ms.max(other.end_ms);
    }

    /// The time to first token and between tokens of these samples (the TTFT samples
    /// reordered in place).
    pub fn latencies(&mut self) -> (Option<Latency>, Option<Latency>) {
        (Latency::of(&mut self.ttft), self.tbt.latency())
    }

    /// The report: the simulated span, utilisations, percentiles, per-class figures, a warning
    /// when a time budget was inactive, and the KV figures.
    pub fn finish(mut self) -> ReplayReport {
        let (ttft, tbt) = self.latencies();
        let mut rep = self.report;
        rep.simulated_ms = self.end_ms - self.first_arrival_ms;
        rep.budget_utilisation =
            (self.budget_sum > 0).then(|| self.budget_used as f64 / self.budget_sum as f64);
        rep.cut_step_utilisation = (self.cut_budget_sum > 0)
            .then(|| self.cut_budget_used as f64 / self.cut_budget_sum as f64);
        rep.ttft_ms = ttft;
        rep.tbt_ms = tbt;
        rep.by_priority = self.by_class.finish();
        if let Some(t) = rep.time_budget.as_ref().filter(|t| t.inactive_steps > 0) {
            rep.warnings.push(format!(
                "the time budget was inactive for {} of {} steps: {}",
                t.inactive_steps,
                t.steps,
                t.inactive_reason.as_deref().unwrap_or("no latency model")
            ));
        }
        rep.kv = self.kv.map(KvState::report);
        rep
    }
}
