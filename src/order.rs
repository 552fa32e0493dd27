//! Which waiting prompt a node's steps start first (`docs/scheduling.md#the-order-of-waiting-prompts`):
//! the node's [`Order`], the starvation bound ([`WaitBound`]) every order but `fcfs` needs, and
//! [`rank`], the walk of a node's prefill rows the planner follows.
//!
//! Mid-prefill rows come first under every order, in admission order: each holds KV memory
//! and a prepared input until it finishes, and `max_partial_prefills` counts them, so the order
//! decides only which prompt *starts* next. Among the prompts that have not started, those that
//! waited past the bound go first, oldest (by admission) first; the rest follow by the order's
//! key, ties by admission. `fcfs` is admission order itself: the planner walks the queue as
//! stored and [`rank`] is never called.
//!
//! The core has no clock. A prompt's wait is measured from the times the engine gives (its
//! arrival at admission, [`AdmitOptions::arrival_ms`]; the step's time at assembly) or in the
//! node's planned steps since its admission, which need no clock.

use std::fmt;
use std::str::FromStr;

use crate::rows::PrefillRow;

/// How a node orders the prompts that have not started (`chunking.order`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, PartialOrd, Ord)]
pub enum Order {
    /// First come, first served: admission order (the default).
    #[default]
    Fcfs,
    /// The lowest [`AdmitOptions::priority`] first, ties by admission.
    Priority,
    /// The fewest prompt tokens left to run (`total - cached`) first, ties by admission.
    ShortestFirst,
    /// The most cached prefix tokens given at admission first, ties by admission.
    LongestPrefix,
}

impl Order {
    /// Every order, in the order `--orders` and the docs list them.
    pub const ALL: [Order; 4] = [
        Order::Fcfs,
        Order::Priority,
        Order::ShortestFirst,
        Order::LongestPrefix,
    ];

    /// The order's name, as written in `chunking.order`.
    pub fn as_str(self) -> &'static str {
        match self {
            Order::Fcfs => "fcfs",
            Order::Priority => "priority",
            Order::ShortestFirst => "shortest_first",
            Order::LongestPrefix => "longest_prefix",
        }
    }

    /// Whether the order is admission order (the planner walks the queue as stored).
    pub fn is_fcfs(self) -> bool {
        self == Order::Fcfs
    }
}

impl fmt::Display for Order {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An order name that is none of [`Order::ALL`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown order {value:?}: expected one of fcfs, priority, shortest_first, longest_prefix")]
pub struct UnknownOrder {
    /// The name given (at most 64 characters of it).
    pub value: String,
}

impl FromStr for Order {
    type Err = UnknownOrder;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim();
        Order::ALL
            .into_iter()
            .find(|o| o.as_str() == t)
            .ok_or_else(|| UnknownOrder {
                value: s.chars().take(64).collect(),
            })
    }
}

/// What an engine may say about a prompt when it admits it, beyond its input
/// (`admit_with`, [`NextStep::admit_with`](crate::NextStep::admit_with)). The default is plain
/// `admit`'s: no cached prefix, priority 0, no arrival time.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct AdmitOptions {
    /// Tokens of the prompt already cached (clamped to leave the last token to run).
    pub cached: u32,
    /// The prompt's priority under the `priority` order: lower runs first (as vLLM's).
    /// Ignored, with a warning once per node, where the node's order is another.
    pub priority: i32,
    /// When the request arrived, in ms on the engine's clock (any origin; the step times given
    /// at assembly must use the same): the start of its wait for `chunking.max_wait_ms`.
    pub arrival_ms: Option<f64>,
}

impl AdmitOptions {
    /// Options with a cached prefix of `cached` tokens and nothing else.
    pub fn cached(cached: u32) -> Self {
        Self {
            cached,
            ..Self::default()
        }
    }
}

/// The starvation bound (`chunking.max_wait_ms`, `chunking.max_wait_steps`): a prompt that has
/// waited this long goes first. Either, both or neither may be set; with both, whichever is
/// reached first counts. Without one, an order other than `fcfs` can starve a prompt.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct WaitBound {
    /// A prompt whose arrival time is known and that has waited at least this many ms at a
    /// step's time is starved. Finite and above 0 (refused otherwise).
    pub max_wait_ms: Option<f64>,
    /// A prompt that has waited through at least this many planned steps of its node is starved.
    /// At least 1 (refused otherwise).
    pub max_wait_steps: Option<u64>,
}

/// When a step is planned: how many steps its node planned before it, and the step's time on
/// the engine's clock, if the engine gave one.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct StepClock {
    /// The node's planned steps before this one.
    pub step: u64,
    /// The step's time in ms, on the clock of [`AdmitOptions::arrival_ms`].
    pub now_ms: Option<f64>,
}

/// How long a prompt has waited at a step.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Wait {
    /// Planned steps of its node since its admission.
    pub steps: u64,
    /// Ms since its arrival, when both its arrival and the step's time are known (never
    /// negative: a step time before the arrival counts as no wait).
    pub ms: Option<f64>,
}

impl Wait {
    /// How long `row` has waited at `clock`.
    pub fn of(row: &PrefillRow, clock: StepClock) -> Self {
        let ms = match (row.arrival_ms, clock.now_ms) {
            (Some(arrival), Some(now)) => Some((now - arrival).max(0.0)),
            _ => None,
        };
        Self {
            steps: clock.step.saturating_sub(row.admitted_step),
            ms,
        }
    }
}

impl Wait {
    /// How long `row` has waited for a chunk at `clock`: since its admission, or since the
    /// step that ran its last completed chunk (the clock the time budget's floor yields by).
    pub fn for_chunk(row: &PrefillRow, clock: StepClock) -> Self {
        let ms = match (row.wait_from_ms, clock.now_ms) {
            (Some(from), Some(now)) => Some((now - from).max(0.0)),
            _ => None,
        };
        Self {
            steps: clock.step.saturating_sub(row.wait_from_step),
            ms,
        }
    }
}

impl WaitBound {
    /// Whether a prompt that waited `wait` is past the bound: at or over either limit.
    pub fn starved(&self, wait: Wait) -> bool {
        let by_ms = matches!((self.max_wait_ms, wait.ms), (Some(max), Some(ms)) if ms >= max);
        let by_steps = self.max_wait_steps.is_some_and(|max| wait.steps >= max);
        by_ms || by_steps
    }

    /// Whether no limit is set.
    pub fn is_off(&self) -> bool {
        self.max_wait_ms.is_none() && self.max_wait_steps.is_none()
    }
}

/// A node's order and its starvation bound, as a step is planned under them.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct NodeOrder {
    /// The order.
    pub order: Order,
    /// The starvation bound.
    pub bound: WaitBound,
}

/// The key a waiting prompt is ranked by: starved prompts first (by admission), then by the
/// order's key, then by admission. `seq` is unique, so the key is a total order and an unstable
/// sort gives one answer.
fn key(order: Order, starved: bool, r: &PrefillRow) -> (bool, i64, u64) {
    if starved {
        return (false, 0, r.seq);
    }
    let primary = match order {
        Order::Fcfs => 0,
        Order::Priority => i64::from(r.priority),
        Order::ShortestFirst => i64::from(r.total - r.progress),
        Order::LongestPrefix => -i64::from(r.cached),
    };
    (true, primary, r.seq)
}

/// Writes into `out` (cleared first) the indices of `rows` (a node's prefill rows in admission
/// order) in the order the planner walks them under `order` at `clock`: mid-prefill rows first
/// in admission order, then the prompts that have not started, starved ones first (oldest
/// first), the rest by the order's key, ties by admission.
pub fn rank(order: NodeOrder, clock: StepClock, rows: &[PrefillRow], out: &mut Vec<u32>) {
    out.clear();
    let index = |i: usize| u32::try_from(i).unwrap_or(u32::MAX);
    out.extend(
        rows.iter()
            .enumerate()
            .filter(|(_, r)| r.started)
            .map(|(i, _)| index(i)),
    );
    let mid = out.len();
    out.extend(
        rows.iter()
            .enumerate()
            .filter(|(_, r)| !r.started)
            .map(|(i, _)| index(i)),
    );
    // In place, with the key computed per comparison: a step allocates nothing.
    out[mid..].sort_unstable_by_key(|&i| {
        let r = &rows[i as usize];
        key(order.order, order.bound.starved(Wait::of(r, clock)), r)
    });
    debug_assert_eq!(out.len(), rows.len());
    debug_assert!(out[mid..].iter().all(|&i| !rows[i as usize].started));
}

/// The prompt at the head of the wait: the earliest admitted that has not started, and how long
/// it has waited at `clock` (the head wait gauges). `None` when no prompt waits.
pub fn head_wait(rows: &[PrefillRow], clock: StepClock) -> Option<Wait> {
    rows.iter().find(|r| !r.started).map(|r| Wait::of(r, clock))
}

#[cfg(test)]
mod tests;
