//! The rows a node's queues hold and the planner plans: continuing rows ([`ContRow`]) and
//! prompts being prefilled ([`PrefillRow`]). Their own module, so that both the planner and the
//! order of waiting prompts ([`crate::order`]) read them without importing each other.

use crate::policy::Name;

/// A continuing row (decode, speculative verify): it runs its estimate every step it fits and is
/// never cut.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContRow {
    /// Admission order within the node.
    pub seq: u64,
    /// The request.
    pub rid: u64,
    /// The row's walk.
    pub walk: Name,
    /// Tokens the row is expected to run: 1 for plain decode, `k + 1` for `k` speculative tokens.
    pub estimate: u32,
    /// Tokens of context the row reads (its prompt plus the tokens it ran in completed steps,
    /// or what the engine said): the `K` of the latency model.
    pub context: u64,
}

/// A prompt being prefilled.
#[derive(Debug, Clone, PartialEq)]
pub struct PrefillRow {
    /// Admission order within the node.
    pub seq: u64,
    /// The request.
    pub rid: u64,
    /// The row's walk.
    pub walk: Name,
    /// Tokens of the whole prepared input.
    pub total: u32,
    /// The cached prefix, at most `total - 1`.
    pub cached: u32,
    /// Tokens done: the end of the last completed chunk, or `cached` before the first.
    pub progress: u32,
    /// Whether a chunk of this row has completed (the row is mid-prefill).
    pub started: bool,
    /// Its priority under the `priority` order (lower first; [`crate::order`]).
    pub priority: i32,
    /// When its request arrived, in ms on the engine's clock, if the engine said.
    pub arrival_ms: Option<f64>,
    /// How many steps its node had planned when it was admitted: the start of its wait in steps.
    pub admitted_step: u64,
    /// Where its current wait for a chunk began, in its node's planned steps: its admission,
    /// then the step after each completed chunk (the time budget's floor yields until this wait
    /// reaches the starvation bound, `docs/cost-model.md#time-budgets`).
    pub wait_from_step: u64,
    /// The same in ms on the engine's clock: its arrival, then the time of the step that ran its
    /// last completed chunk; `None` when the engine gave no time.
    pub wait_from_ms: Option<f64>,
}
