//! The errors the scheduler, the prepared inputs and the facade return, and how an engine tells
//! a retryable one from a fatal one without matching on messages.

use std::time::Duration;

use crate::budget::BudgetErrors;
use crate::policy::Name;
use crate::policy::PolicyError;

/// A refused request to the chunking component. Nothing changed when one is returned (the one
/// exception, [`ChunkingError::MissingPreparedInput`], says what it dropped).
///
/// New variants may be added: match on [`ChunkingError::kind`] or [`ChunkingError::is_retryable`]
/// to decide what to do, and on variants for the details.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ChunkingError {
    /// The component is draining or drained (`ChunkingManagement::begin_drain`, `drain`): it
    /// admits no request and assembles no step.
    #[error("the chunking component is shutting down (drain): it admits no request and assembles no step")]
    Draining,
    /// `admit` got a prepared input of no tokens.
    #[error("rid {rid} on `{node}`: an empty prepared input cannot be prefilled")]
    EmptyInput {
        /// The request.
        rid: u64,
        /// The node it was admitted at.
        node: Name,
    },
    /// `admit` got a prepared input longer than a row can hold (`u32::MAX` tokens).
    #[error(
        "rid {rid} on `{node}`: prepared input of {tokens} tokens exceeds the {max} a row can hold"
    )]
    InputTooLong {
        /// The request.
        rid: u64,
        /// The node it was admitted at.
        node: Name,
        /// The input's length.
        tokens: usize,
        /// The most tokens a row can hold.
        max: u32,
    },
    /// `admit` got per-token extras that do not cover the input's tokens one to one.
    #[error(
        "rid {rid} on `{node}`: per-token extras cover {extras} tokens, the input has {tokens}"
    )]
    ExtrasMismatch {
        /// The request.
        rid: u64,
        /// The node it was admitted at.
        node: Name,
        /// The input's tokens.
        tokens: usize,
        /// The tokens the extras cover.
        extras: usize,
    },
    /// `admit` of a `(rid, node)` that already has a row there.
    #[error(
        "rid {rid} on `{node}` is already queued; forget it (`forget_request`) before admitting it again"
    )]
    AlreadyQueued {
        /// The request.
        rid: u64,
        /// The node.
        node: Name,
    },
    /// `continue_row` with an estimate of 0 tokens.
    #[error("rid {rid} on `{node}`: a continuing row must run at least 1 token")]
    ZeroEstimate {
        /// The request.
        rid: u64,
        /// The node.
        node: Name,
    },
    /// `continue_row` for a request whose prompt has not run its final chunk at that node.
    #[error("rid {rid} on `{node}` is still prefilling; it continues after its final chunk")]
    StillPrefilling {
        /// The request.
        rid: u64,
        /// The node.
        node: Name,
    },
    /// A node the model does not have.
    #[error("node `{node}` is not a node of the model")]
    UnknownNode {
        /// The name given.
        node: Name,
    },
    /// A walk the model and the serving settings do not name.
    #[error("walk `{walk}` is not a walk of the model on node `{node}`")]
    UnknownWalk {
        /// The node.
        node: Name,
        /// The name given.
        walk: Name,
    },
    /// `assemble` of a walk that runs inside a combined walk: its rows run in the combined
    /// walk's steps, under that walk's budget (docs/step-lifecycle.md#combined-walks).
    #[error("walk `{walk}` of node `{node}` runs inside the combined walk `{combined}`: assemble `{node}`/`{combined}`, whose steps take its rows under the combined budget")]
    MemberWalk {
        /// The node.
        node: Name,
        /// The walk given.
        walk: Name,
        /// The combined walk it runs inside.
        combined: Name,
    },
    /// `assemble` of `node`/`walk` came out empty twice in a row, with no other walk of the
    /// node assembled between, while rows of the node wait on walks its steps do not take:
    /// the settings leave those rows stranded, typically a combined walk (`mixed` =
    /// `prefill` + `decode`) forgotten (docs/failures.md#stranded-rows).
    #[error("no step of `{node}`/`{walk}` takes the rows of `{node}` waiting on walk(s) {}: run them inside `{walk}` (`BudgetSettings::combined(\"{walk}\", [..])`, `combined_walk_of`, or the model manifest's `combined` table) or assemble `{node}` on those walks too", quoted(.waiting))]
    StrandedRows {
        /// The node.
        node: Name,
        /// The walk assembled.
        walk: Name,
        /// The walks rows wait on, in queue order: prompt rows', then continuing rows'.
        waiting: Vec<Name>,
    },
    /// A call that needs the model's policies before `set_policies`.
    #[error("no model policies are bound yet: call `set_policies` first")]
    PoliciesNotSet,
    /// `assemble` of one walk while the node's step of another walk is in flight: complete or
    /// abandon that step first (docs/step-lifecycle.md).
    #[error("step {step} of `{node}`/`{walk}` is still in flight; complete or abandon it before assembling another walk")]
    StepInFlight {
        /// The node.
        node: Name,
        /// The walk of the step in flight.
        walk: Name,
        /// The step in flight.
        step: u64,
    },
    /// `complete` or `abandon` of a step that is not in flight (never assembled, already
    /// completed or abandoned, or of another node).
    #[error("step {step} is not in flight (never assembled, already completed or abandoned, or of another node)")]
    UnknownStep {
        /// The step named.
        step: u64,
    },
    /// `complete_and_assemble` repeated for a step it already completed (its answer was lost)
    /// with other `ran` counts or another measured time: the completion was applied once, as
    /// first reported, and is not changed.
    #[error("step {step} was already completed with other ran-token counts or another measured time; repeat the call as first made")]
    CompletedDifferently {
        /// The step.
        step: u64,
    },
    /// `complete` with a `ran` list that does not have one entry per row of the batch.
    #[error("step {step} has {expected} rows but {got} ran-token counts were reported")]
    RanLengthMismatch {
        /// The step.
        step: u64,
        /// Rows in its batch.
        expected: usize,
        /// Entries reported.
        got: usize,
    },
    /// `complete` reporting a chunk row that ran neither nothing nor its planned tokens: a
    /// chunk cannot resume from the middle. The step stays in flight.
    #[error("step {step}: the chunk of rid {rid} was planned at {planned} tokens but {ran} were reported; report 0 (it did not run) or {planned}")]
    PartialChunk {
        /// The step.
        step: u64,
        /// The request whose chunk was misreported.
        rid: u64,
        /// The chunk's planned tokens.
        planned: u32,
        /// The tokens reported.
        ran: u32,
    },
    /// A completion (`complete`, `complete_and_assemble`) or `measured_late` with a step time that is not a finite number of ms ≥ 0.
    #[error("step {step}: a measured step time must be a finite number of ms ≥ 0, got {ms}")]
    BadMeasurement {
        /// The step.
        step: u64,
        /// The time reported.
        ms: f64,
    },
    /// A chunk's prepared input was gone when the step was cut. The Scheduler drops a row's
    /// input only with its row, so this is a guard against its stores disagreeing
    /// (`docs/actors.md#prepared-inputs`): the step was abandoned and that row dropped;
    /// assemble again.
    #[error("rid {rid} on `{node}` has no prepared input to cut its chunk from; the step was abandoned and the row dropped, assemble again")]
    MissingPreparedInput {
        /// The request whose input was gone.
        rid: u64,
        /// The node.
        node: Name,
    },
    /// `set_budgets` refused the settings whole; the previous budgets stay in force.
    #[error("refused budgets: {0}")]
    Budget(#[from] BudgetErrors),
    /// `set_policies` refused the model's policies.
    #[error("refused policies: {}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
    Policy(Vec<PolicyError>),
    /// The actor panicked handling the request; it was restarted in place with its state.
    #[error("the {actor} actor panicked handling the request and was restarted: {reason}")]
    ActorPanicked {
        /// The actor.
        actor: &'static str,
        /// The panic's message.
        reason: String,
    },
    /// The actor did not answer within the facade's timeout.
    #[error("the {actor} actor did not answer within {after:?}")]
    Timeout {
        /// The actor.
        actor: &'static str,
        /// The timeout.
        after: Duration,
    },
    /// The actor's mailbox is closed: its actix System or arbiter stopped.
    #[error("the {actor} actor is stopped: its actix System or arbiter ended (`ActorThread::stop` was called, or the System that `ChunkingManagement::start` ran in stopped)")]
    ActorStopped {
        /// The actor.
        actor: &'static str,
    },
    /// The actors were started outside an actix System.
    #[error("starting the chunking actors needs an actix System: call it inside `actix::System::new().block_on(..)` or `#[actix::main]`, or use `ChunkingManagement::start_on_own_thread` from a tokio engine")]
    NoActixSystem,
    /// The actor thread of [`crate::ChunkingManagement::start_on_own_thread`], or the actors'
    /// runtime ([`crate::actors::actor_system`]), could not start.
    #[error("cannot start the chunking actor thread: {reason}")]
    ThreadStart {
        /// What failed.
        reason: String,
    },
}

/// What an engine can do about a [`ChunkingError`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The call was wrong for the model or the request (an unknown node, an empty input, a
    /// misreported step): fix the caller; retrying the same call fails the same way.
    InvalidRequest,
    /// The call conflicts with the component's state (a row already queued, a step in flight,
    /// policies not bound yet): it can succeed after the state changes.
    Conflict,
    /// Settings or policies refused whole (the previous ones stay in force), or settings in
    /// force that leave rows no step takes ([`ChunkingError::StrandedRows`]).
    RefusedSettings,
    /// A transient failure (a timeout, an actor restarted after a panic, an input forgotten
    /// while a step was cut): retrying the call may succeed.
    Transient,
    /// The component cannot serve (its actors are stopped, or were never started).
    Fatal,
}

impl ChunkingError {
    /// What kind of failure this is.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::EmptyInput { .. }
            | Self::InputTooLong { .. }
            | Self::ExtrasMismatch { .. }
            | Self::ZeroEstimate { .. }
            | Self::UnknownNode { .. }
            | Self::UnknownWalk { .. }
            | Self::MemberWalk { .. }
            | Self::UnknownStep { .. }
            | Self::RanLengthMismatch { .. }
            | Self::BadMeasurement { .. }
            | Self::PartialChunk { .. } => ErrorKind::InvalidRequest,
            Self::AlreadyQueued { .. }
            | Self::StillPrefilling { .. }
            | Self::PoliciesNotSet
            | Self::StepInFlight { .. }
            | Self::CompletedDifferently { .. } => ErrorKind::Conflict,
            Self::Budget(_) | Self::Policy(_) | Self::StrandedRows { .. } => {
                ErrorKind::RefusedSettings
            }
            Self::MissingPreparedInput { .. }
            | Self::ActorPanicked { .. }
            | Self::Timeout { .. } => ErrorKind::Transient,
            Self::ActorStopped { .. }
            | Self::NoActixSystem
            | Self::ThreadStart { .. }
            | Self::Draining => ErrorKind::Fatal,
        }
    }

    /// Whether retrying the same call may succeed ([`ErrorKind::Transient`]).
    ///
    /// ```
    /// use mstar_chunking::ChunkingError;
    ///
    /// let timeout = ChunkingError::Timeout { actor: "Scheduler", after: std::time::Duration::from_secs(5) };
    /// assert!(timeout.is_retryable());
    /// assert!(!ChunkingError::PoliciesNotSet.is_retryable());
    /// ```
    pub fn is_retryable(&self) -> bool {
        self.kind() == ErrorKind::Transient
    }

    /// The refused budget settings, when this is a `set_budgets` refusal: every problem, each
    /// naming its node, walk and rule.
    pub fn budget_errors(&self) -> Option<&BudgetErrors> {
        match self {
            Self::Budget(e) => Some(e),
            _ => None,
        }
    }
}

/// Walk names as `` `a`, `b` `` for a message.
fn quoted(walks: &[Name]) -> String {
    walks
        .iter()
        .map(|w| format!("`{w}`"))
        .collect::<Vec<_>>()
        .join(", ")
}
