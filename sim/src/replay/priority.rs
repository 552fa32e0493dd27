//! Priority classes in a replay (`docs/replay.md#priorities`): a rule that gives each request
//! its priority (`--priority-by`), and the TTFT/TBT of each class the summary reports.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use super::report::{ClassLatency, Latency, StepDurations};
use super::trace::Trace;

/// A rule that gives every request of a trace its priority, over the trace's own `priority`
/// field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PriorityBy {
    /// `prompt-length:N`: two classes, prompts of at most `N` tokens at priority 0 (first under
    /// the `priority` order), longer ones at 1.
    PromptLength {
        /// The longest prompt of the high class, in tokens (at least 1).
        max_tokens: u32,
    },
}

/// What `--priority-by` accepts, for its refusal.
pub const PRIORITY_BY_EXPECTED: &str =
    "prompt-length:N, N a whole number of tokens from 1 to 4294967295 (prompts up to N tokens get priority 0, longer ones 1)";

impl FromStr for PriorityBy {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || format!("expected {PRIORITY_BY_EXPECTED}, got {s:?}");
        let (rule, n) = s.trim().split_once(':').ok_or_else(bad)?;
        if rule != "prompt-length" || !n.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad());
        }
        match n.parse::<u32>() {
            Ok(max_tokens) if max_tokens >= 1 => Ok(PriorityBy::PromptLength { max_tokens }),
            _ => Err(bad()),
        }
    }
}

impl fmt::Display for PriorityBy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PriorityBy::PromptLength { max_tokens } => write!(f, "prompt-length:{max_tokens}"),
        }
    }
}

impl PriorityBy {
    /// The priority of a request with a prompt of `input_tokens`.
    pub fn priority(self, input_tokens: u32) -> i32 {
        match self {
            PriorityBy::PromptLength { max_tokens } => i32::from(input_tokens > max_tokens),
        }
    }

    /// Gives every request of `trace` its priority by this rule.
    pub fn apply(self, trace: &mut Trace) {
        for r in &mut trace.requests {
            r.priority = self.priority(r.input_tokens);
        }
    }
}

/// TTFT and TBT samples per priority class, as a replay collects them.
#[derive(Debug, Default)]
pub(crate) struct ByClass {
    classes: BTreeMap<i32, (usize, Vec<f64>, StepDurations)>,
}

impl ByClass {
    /// Classes for the priorities of `trace`'s requests (none when they all share one).
    pub(crate) fn of(trace: &Trace) -> Self {
        let mut classes = BTreeMap::new();
        for r in &trace.requests {
            classes
                .entry(r.priority)
                .or_insert_with(|| (0, Vec::new(), StepDurations::default()))
                .0 += 1;
        }
        // One class: nothing to split, and no lookup per token.
        if classes.len() < 2 {
            classes.clear();
        }
        Self { classes }
    }

    /// A first token of a request of class `priority`, `ms` after its arrival.
    pub(crate) fn ttft(&mut self, priority: i32, ms: f64) {
        if let Some(c) = self.classes.get_mut(&priority) {
            c.1.push(ms);
        }
    }

    /// A time between tokens of a request of class `priority`.
    pub(crate) fn tbt(&mut self, priority: i32, ms: f64) {
        if let Some(c) = self.classes.get_mut(&priority) {
            c.2.record(ms);
        }
    }

    /// Pools another worker's samples of the same trace into these (its request counts are the
    /// trace's, as these are).
    pub(crate) fn absorb(&mut self, other: ByClass) {
        for (priority, (_, ttft, tbt)) in other.classes {
            if let Some(c) = self.classes.get_mut(&priority) {
                c.1.extend(ttft);
                c.2.absorb(&tbt);
            }
        }
    }

    /// Each class's figures, by priority; empty with a single class (the totals say it all).
    pub(crate) fn finish(self) -> Vec<ClassLatency> {
        if self.classes.len() < 2 {
            return Vec::new();
        }
        self.classes
            .into_iter()
            .map(|(priority, (requests, mut ttft, tbt))| ClassLatency {
                priority,
                requests,
                ttft_ms: Latency::of(&mut ttft),
                tbt_ms: tbt.latency(),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_length_splits_two_classes_at_its_bound_inclusive() {
        let rule: PriorityBy = "prompt-length:2048".parse().unwrap();
        assert_eq!(rule, PriorityBy::PromptLength { max_tokens: 2048 });
        assert_eq!(rule.to_string(), "prompt-length:2048");
        assert_eq!(rule.priority(1), 0);
        assert_eq!(rule.priority(2048), 0);
        assert_eq!(rule.priority(2049), 1);
        for bad in [
            "prompt-length:0",
            "prompt-length:",
            "prompt-length:-1",
            "length:5",
            "prompt-length:1e3",
            "prompt-length:99999999999",
            "",
        ] {
            let e = bad.parse::<PriorityBy>().unwrap_err();
            assert!(e.starts_with("expected prompt-length:N"), "{bad}: {e}");
        }
    }

    #[test]
    fn classes_report_only_when_there_are_two_or_more() {
        let mut one = ByClass::default();
        one.classes
            .insert(0, (3, vec![1.0], StepDurations::default()));
        assert!(one.finish().is_empty());
        let mut two = ByClass::default();
        two.classes
            .insert(1, (1, Vec::new(), StepDurations::default()));
        two.classes
            .insert(0, (2, Vec::new(), StepDurations::default()));
        two.ttft(0, 10.0);
        two.ttft(0, 30.0);
        two.tbt(1, 5.0);
        two.ttft(7, 1.0); // no such class: ignored
        let got = two.finish();
        assert_eq!(
            got.iter()
                .map(|c| (c.priority, c.requests))
                .collect::<Vec<_>>(),
            [(0, 2), (1, 1)]
        );
        assert_eq!(got[0].ttft_ms.map(|l| l.samples), Some(2));
        assert_eq!(got[1].ttft_ms, None);
        assert!(got[1].tbt_ms.is_some());
    }
}
