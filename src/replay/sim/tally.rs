//! What a finished simulation counted, before the figures that need every sample (percentiles,
//! ratios of sums): one worker's report is computed from its tally; a fleet pools its workers'
//! tallies first ([`Tally::absorb`]), so that the fleet's percentiles are those of every
//! sample, not an average of the workers' percentiles.

use super::memory::KvState;
use crate::replay::priority::ByClass;
use crate::replay::report::{Latency, ReplayReport, StepDurations};

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
        a.steps += b.steps;
        a.budgeted_steps += b.budgeted_steps;
        let (t, u) = (&mut a.tokens, b.tokens);
        t.scheduled += u.scheduled;
        t.ran += u.ran;
        t.prefill += u.prefill;
        t.cached += u.cached;
        t.decode += u.decode;
        t.generated += u.generated;
        a.cut_steps += b.cut_steps;
        let (c, d) = (&mut a.chunks, b.chunks);
        c.total += d.total;
        c.final_chunks += d.final_chunks;
        c.prompts_cut += d.prompts_cut;
        c.prefix_cache_hits += d.prefix_cache_hits;
        let (o, p) = (&mut a.overruns, b.overruns);
        o.total += p.total;
        o.uncut_row += p.uncut_row;
        o.speculation_estimate += p.speculation_estimate;
        o.other += p.other;
        let (o, p) = (&mut a.time_overruns, b.time_overruns);
        o.total += p.total;
        o.floor += p.floor;
        o.uncut_row += p.uncut_row;
        o.continuing += p.continuing;
        o.misprediction += p.misprediction;
        if let Some(u) = b.time_budget {
            let t = a.time_budget.get_or_insert_with(Default::default);
            t.steps += u.steps;
            t.inactive_steps += u.inactive_steps;
            if t.inactive_reason.is_none() {
                t.inactive_reason = u.inactive_reason;
            }
        }
        a.decode_row_waits += b.decode_row_waits;
        a.step_ms.absorb(&b.step_ms);
        for w in b.warnings {
            if !a.warnings.contains(&w) {
                a.warnings.push(w);
            }
        }
        a.peak_prepared_rows = a.peak_prepared_rows.max(b.peak_prepared_rows);
        a.peak_prepared_tokens = a.peak_prepared_tokens.max(b.peak_prepared_tokens);
        self.budget_sum += other.budget_sum;
        self.budget_used += other.budget_used;
        self.cut_budget_sum += other.cut_budget_sum;
        self.cut_budget_used += other.cut_budget_used;
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
