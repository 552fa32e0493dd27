//! Overrun accounting (docs/scheduling.md#overruns): whether a completed step ran over the
//! budget it was scheduled under, why, and the 1st/2nd/4th/8th… warning cadence per
//! `(node, walk)`; and beside token overruns, time overruns (`docs/cost-model.md#time-overruns`):
//! whether a step took longer than its time budget, and why.

use rustc_hash::FxHashMap;
use serde::Serialize;

use crate::policy::Name;

/// Why a step ran over its budget. Bounded: used as a metric label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OverrunReason {
    /// A row too long to cut (or a lone continuing row larger than the budget) ran whole.
    UncutRow,
    /// Continuing rows ran more tokens than their estimates (speculation merges size them first).
    SpeculationEstimate,
    /// Anything else: the engine ran more than was scheduled.
    Other,
}

impl OverrunReason {
    /// Every reason, in label order.
    pub const ALL: [OverrunReason; 3] = [Self::UncutRow, Self::SpeculationEstimate, Self::Other];

    /// The metric label and step-log value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::UncutRow => "uncut_row",
            Self::SpeculationEstimate => "speculation_estimate",
            Self::Other => "other",
        }
    }

    pub(crate) fn index(self) -> usize {
        self as usize
    }
}

/// What a step was scheduled as and what it ran, for the check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StepTokens {
    /// The budget the step was scheduled under; `None`: no budget, no overrun possible.
    pub budget: Option<u32>,
    /// Tokens the plan scheduled.
    pub scheduled: u64,
    /// Tokens the rows actually ran.
    pub ran: u64,
    /// The continuing rows' estimates.
    pub continue_estimate: u64,
    /// What the continuing rows actually ran.
    pub continue_ran: u64,
    /// The plan ran a row whole over the budget because it could not be cut.
    pub uncut_over_budget: bool,
}

impl StepTokens {
    /// A step as planned, before any row's actual tokens are counted.
    pub(crate) fn planned(budget: Option<u32>, scheduled: u64, uncut_over_budget: bool) -> Self {
        Self {
            budget,
            scheduled,
            uncut_over_budget,
            ..Self::default()
        }
    }

    /// A step as planned, and as it ran: each row's estimate when it is a continuing row, with
    /// the tokens it ran. The one place a step's tokens are counted, by the scheduler as it
    /// completes a step and by the facade's `check_budget` for a step run outside it.
    pub(crate) fn of_step(
        budget: Option<u32>,
        scheduled: u64,
        uncut_over_budget: bool,
        rows: impl IntoIterator<Item = (Option<u32>, u32)>,
    ) -> Self {
        let mut tokens = Self::planned(budget, scheduled, uncut_over_budget);
        for (continue_estimate, ran) in rows {
            tokens.add_row(continue_estimate, ran);
        }
        tokens
    }

    /// Counts one row: `ran` the tokens it actually ran, `continue_estimate` its estimate when
    /// it is a continuing row.
    pub(crate) fn add_row(&mut self, continue_estimate: Option<u32>, ran: u32) {
        match continue_estimate {
            Some(estimate) => self.add_continuing(u64::from(estimate), u64::from(ran)),
            None => self.ran += u64::from(ran),
        }
    }

    /// Counts continuing rows whose estimates add up to `estimate` and which ran `ran` tokens
    /// in all: as many [`StepTokens::add_row`]s of theirs.
    pub(crate) fn add_continuing(&mut self, estimate: u64, ran: u64) {
        self.ran += ran;
        self.continue_estimate += estimate;
        self.continue_ran += ran;
    }
}

// === time overruns ===

/// Why a completed step ran over its time budget (`docs/cost-model.md#time-overruns`).
/// Bounded: used as a metric label and in the step log.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TimeOverrunReason {
    /// The first prefill row ran a chunk of the floor although it did not fit in time.
    Floor,
    /// A row that cannot be cut ran whole although it did not fit in time.
    UncutRow,
    /// The continuing rows alone were predicted over the budget (they always run).
    Continuing,
    /// The plan was predicted to fit; the step took longer than predicted.
    Misprediction,
}

impl TimeOverrunReason {
    /// Every reason, in label order.
    pub const ALL: [TimeOverrunReason; 4] = [
        Self::Floor,
        Self::UncutRow,
        Self::Continuing,
        Self::Misprediction,
    ];

    /// The metric label and step-log value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Floor => "floor",
            Self::UncutRow => "uncut_row",
            Self::Continuing => "continuing",
            Self::Misprediction => "misprediction",
        }
    }

    /// What it means and what to do about it, for a log line.
    pub fn describe(self) -> &'static str {
        match self {
            Self::Floor => "planned: the first waiting prompt's floor chunk did not fit in time and ran anyway, so that it is never held back by time alone",
            Self::UncutRow => "planned: a row that cannot be cut did not fit in time and ran whole",
            Self::Continuing => "planned: the continuing rows alone were predicted over the budget, and they always run",
            Self::Misprediction => "the step took longer than its plan predicted: other work on the engine's CPU, or a latency model that no longer fits; a time margin (chunking.time_margin) plans against the measured spread",
        }
    }
}

/// Why a step of a walk with a time budget was planned without it
/// (`docs/cost-model.md#when-a-time-budget-is-not-in-force`). Bounded: a metric label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TimeInactiveReason {
    /// The node learns its model and has no configured prior, and no step was measured yet
    /// (an engine that never reports step times stays here).
    NoMeasurements,
    /// The node learns its model and has no configured prior, and its online fit is not
    /// trusted (fewer than its minimum steps, or its relative error above the bound).
    UntrustedFit,
}

impl TimeInactiveReason {
    /// Every reason, in label order.
    pub const ALL: [TimeInactiveReason; 2] = [Self::NoMeasurements, Self::UntrustedFit];

    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::NoMeasurements => "no_measurements",
            Self::UntrustedFit => "untrusted_fit",
        }
    }

    /// What it means, for a log line or a health detail.
    pub fn describe(self) -> &'static str {
        match self {
            Self::NoMeasurements => {
                "no configured latency model and no measured step yet to learn one from"
            }
            Self::UntrustedFit => {
                "no configured latency model, and the online fit is not trusted yet"
            }
        }
    }
}

/// Whether a completed step is a time overrun, and why: `None` when it took at most
/// `max_step_ms`; else the reason the plan knowingly went over (`planned_over`, set by the
/// planner for its liveness cases), or [`TimeOverrunReason::Misprediction`] when the plan was
/// predicted to fit. `max_step_ms` is the budget the step was scheduled under.
pub fn classify_time_overrun(
    measured_ms: f64,
    max_step_ms: f64,
    planned_over: Option<TimeOverrunReason>,
) -> Option<TimeOverrunReason> {
    // Only a comparison: the completion checks the measured time first
    // (`crate::latency::measured_ms`); a NaN compares false, no evidence of an overrun.
    if measured_ms.partial_cmp(&max_step_ms) != Some(std::cmp::Ordering::Greater) {
        return None;
    }
    Some(planned_over.unwrap_or(TimeOverrunReason::Misprediction))
}

// === token overruns ===

/// A step that ran over its budget.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Overrun {
    /// The node.
    pub node: Name,
    /// The step walk.
    pub walk: Name,
    /// The budget the step was scheduled under.
    pub budget: u32,
    /// The tokens it ran.
    pub tokens: u64,
    /// Why it ran over.
    pub reason: OverrunReason,
}

/// Whether `t` ran over its budget, and why: continuing rows that ran past their estimates come
/// first (the plan could not know), then a planned uncut row, else `other`.
pub fn classify(t: &StepTokens) -> Option<(u32, OverrunReason)> {
    let budget = t.budget?;
    if t.ran <= u64::from(budget) {
        return None;
    }
    let reason = if t.continue_ran > t.continue_estimate {
        OverrunReason::SpeculationEstimate
    } else if t.uncut_over_budget {
        OverrunReason::UncutRow
    } else {
        OverrunReason::Other
    };
    Some((budget, reason))
}

/// Overrun counts per `(node, walk)` and reason.
#[derive(Debug, Default)]
pub struct OverrunCounter {
    counts: FxHashMap<(Name, Name), [u64; 3]>,
}

impl OverrunCounter {
    /// Counts an overrun. Returns the `(node, walk)`'s overrun count so far and whether this one
    /// is logged: the 1st, 2nd, 4th, 8th, … of that `(node, walk)`.
    pub fn record(&mut self, o: &Overrun) -> (u64, bool) {
        let counts = self
            .counts
            .entry((o.node.clone(), o.walk.clone()))
            .or_default();
        counts[o.reason.index()] += 1;
        let n: u64 = counts.iter().sum();
        (n, n.is_power_of_two())
    }

    /// Overruns of `(node, walk)` for `reason`.
    pub fn count(&self, node: &str, walk: &str, reason: OverrunReason) -> u64 {
        self.counts
            .get(&(Name::from(node), Name::from(walk)))
            .map_or(0, |c| c[reason.index()])
    }

    /// Overruns of `(node, walk)`, all reasons.
    pub fn total(&self, node: &str, walk: &str) -> u64 {
        self.counts
            .get(&(Name::from(node), Name::from(walk)))
            .map_or(0, |c| c.iter().sum())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_step_is_counted_as_planned_and_as_its_rows_ran() {
        // Two continuing rows (estimates 2 and 1, ran 5 and 1) and a chunk that ran 60.
        let rows = [(Some(2), 5), (None, 60), (Some(1), 1)];
        assert_eq!(
            StepTokens::of_step(Some(100), 90, true, rows),
            StepTokens {
                budget: Some(100),
                scheduled: 90,
                ran: 66,
                continue_estimate: 3,
                continue_ran: 6,
                uncut_over_budget: true,
            }
        );
        assert_eq!(
            StepTokens::of_step(None, 7, false, []),
            StepTokens::planned(None, 7, false)
        );
    }

    #[test]
    fn the_reasons_a_time_budget_is_not_in_force_are_labelled_and_described() {
        use TimeInactiveReason::*;
        let labels: Vec<_> = TimeInactiveReason::ALL.iter().map(|r| r.as_str()).collect();
        assert_eq!(labels, ["no_measurements", "untrusted_fit"]);
        assert_eq!(
            NoMeasurements.describe(),
            "no configured latency model and no measured step yet to learn one from"
        );
        assert_eq!(
            UntrustedFit.describe(),
            "no configured latency model, and the online fit is not trusted yet"
        );
        assert_eq!(
            serde_json::to_value(UntrustedFit).unwrap(),
            serde_json::json!("untrusted_fit")
        );
    }

    #[test]
    fn time_overruns_by_reason() {
        use TimeOverrunReason::*;
        assert_eq!(classify_time_overrun(45.0, 45.0, None), None);
        assert_eq!(classify_time_overrun(30.0, 45.0, Some(Floor)), None);
        assert_eq!(classify_time_overrun(f64::NAN, 45.0, None), None);
        assert_eq!(classify_time_overrun(45.1, 45.0, None), Some(Misprediction));
        assert_eq!(classify_time_overrun(90.0, 45.0, Some(Floor)), Some(Floor));
        assert_eq!(
            classify_time_overrun(90.0, 45.0, Some(Continuing)),
            Some(Continuing)
        );
        assert_eq!(
            classify_time_overrun(f64::INFINITY, 45.0, Some(UncutRow)),
            Some(UncutRow)
        );
        let labels: Vec<_> = TimeOverrunReason::ALL.iter().map(|r| r.as_str()).collect();
        assert_eq!(
            labels,
            ["floor", "uncut_row", "continuing", "misprediction"]
        );
    }

    fn tokens(budget: u32, ran: u64) -> StepTokens {
        StepTokens {
            budget: Some(budget),
            scheduled: ran,
            ran,
            ..StepTokens::default()
        }
    }

    #[test]
    fn within_budget_or_without_one_is_no_overrun() {
        assert_eq!(classify(&tokens(100, 100)), None);
        assert_eq!(
            classify(&StepTokens {
                budget: None,
                ran: 1 << 40,
                ..Default::default()
            }),
            None
        );
    }

    #[test]
    fn reasons() {
        let t = StepTokens {
            continue_estimate: 10,
            continue_ran: 14,
            ..tokens(100, 104)
        };
        assert_eq!(
            classify(&t),
            Some((100, OverrunReason::SpeculationEstimate))
        );
        let t = StepTokens {
            uncut_over_budget: true,
            ..tokens(100, 500)
        };
        assert_eq!(classify(&t), Some((100, OverrunReason::UncutRow)));
        assert_eq!(
            classify(&tokens(100, 101)),
            Some((100, OverrunReason::Other))
        );
    }

    #[test]
    fn each_time_overrun_reason_says_what_it_means() {
        let said: Vec<&str> = TimeOverrunReason::ALL
            .iter()
            .map(|r| r.describe())
            .collect();
        assert!(
            said[..3].iter().all(|d| d.starts_with("planned: ")),
            "{said:?}"
        );
        assert!(
            said[3].contains("longer than its plan predicted"),
            "{}",
            said[3]
        );
        assert!(said[0].contains("floor chunk") && said[1].contains("cannot be cut"));
        assert!(said[2].contains("continuing rows"), "{}", said[2]);
    }

    #[test]
    fn warning_cadence_is_powers_of_two_per_node_and_walk() {
        let mut c = OverrunCounter::default();
        let o = |walk: &str, reason| Overrun {
            node: Name::from("llm"),
            walk: Name::from(walk),
            budget: 8,
            tokens: 9,
            reason,
        };
        let warned: Vec<u64> = (0..20)
            .map(|i| {
                let reason = if i % 2 == 0 {
                    OverrunReason::UncutRow
                } else {
                    OverrunReason::Other
                };
                c.record(&o("mixed", reason))
            })
            .filter(|(_, warn)| *warn)
            .map(|(n, _)| n)
            .collect();
        assert_eq!(warned, vec![1, 2, 4, 8, 16]);
        assert_eq!(c.count("llm", "mixed", OverrunReason::UncutRow), 10);
        assert_eq!(c.total("llm", "mixed"), 20);
        assert_eq!(
            c.record(&o("prefill", OverrunReason::Other)),
            (1, true),
            "counted per walk"
        );
    }
}
