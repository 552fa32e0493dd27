//! The errors the scheduler, the prepared inputs and the facade return.

use crate::budget::BudgetErrors;
use crate::policy::PolicyError;
use crate::Name;

/// A refused request to the chunking component. Nothing changed when one is returned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChunkingError {
    #[error("rid {rid} on `{node}`: an empty prepared input cannot be prefilled")]
    EmptyInput { rid: u64, node: Name },
    #[error(
        "rid {rid} on `{node}`: prepared input of {tokens} tokens exceeds the {max} a row can hold"
    )]
    InputTooLong {
        rid: u64,
        node: Name,
        tokens: usize,
        max: u32,
    },
    #[error(
        "rid {rid} on `{node}`: per-token extras cover {extras} tokens, the input has {tokens}"
    )]
    ExtrasMismatch {
        rid: u64,
        node: Name,
        tokens: usize,
        extras: usize,
    },
    #[error(
        "rid {rid} on `{node}` is already queued; forget or finish it before admitting it again"
    )]
    AlreadyQueued { rid: u64, node: Name },
    #[error("rid {rid} on `{node}`: a continuing row must run at least 1 token")]
    ZeroEstimate { rid: u64, node: Name },
    #[error("rid {rid} on `{node}` is still prefilling; it continues after its final chunk")]
    StillPrefilling { rid: u64, node: Name },
    #[error("node `{node}` is not a node of the model")]
    UnknownNode { node: Name },
    #[error("walk `{walk}` is not a walk of the model on node `{node}`")]
    UnknownWalk { node: Name, walk: Name },
    #[error("no model policies are bound yet: call `set_policies` first")]
    PoliciesNotSet,
    #[error("step {step} of `{node}` is still in flight; complete it before assembling the next")]
    StepInFlight { node: Name, step: u64 },
    #[error("step {step} is not in flight (never assembled, or already completed)")]
    UnknownStep { step: u64 },
    #[error("step {step} has {expected} rows but {got} ran-token counts were reported")]
    RanLengthMismatch {
        step: u64,
        expected: usize,
        got: usize,
    },
    #[error("rid {rid} on `{node}` has no prepared input (forgotten while its step was assembled); the step was abandoned, assemble again")]
    MissingPreparedInput { rid: u64, node: Name },
    #[error("refused budgets: {0}")]
    Budget(#[from] BudgetErrors),
    #[error("refused policies: {}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
    Policy(Vec<PolicyError>),
    #[error("the {actor} actor panicked handling the request and was restarted: {reason}")]
    ActorPanicked { actor: &'static str, reason: String },
    #[error("the {actor} actor did not answer: {reason}")]
    ActorUnavailable { actor: &'static str, reason: String },
}
