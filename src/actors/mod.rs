//! The actor shell: one actix actor per piece of state, each wrapping a plain struct of the
//! functional core, plus the [`ChunkingManagement`] facade an engine holds.
//!
//! Keep the actors of one engine on one arbiter (the facade starts them on the current one): a
//! message to an actor on the same arbiter costs well under a microsecond.

use std::panic::{catch_unwind, AssertUnwindSafe};

use actix::prelude::*;

use crate::error::ChunkingError;

/// A message sent through the facade: the actor answers it, or an error if handling it
/// panicked. A panic is contained: the actor restarts in place with its state, mailbox and
/// pending work, and handles later messages as before. Every actor also runs under an actix
/// `Supervisor`, which restarts it should its context ever stop.
///
/// Every guarded message answers `Result<T, ChunkingError>`, and so does its guarded form: a
/// panic is one more error, never a nested `Result`.
pub(crate) struct Guarded<M>(pub M);

impl<M, T> Message for Guarded<M>
where
    M: Message<Result = Result<T, ChunkingError>>,
    T: 'static,
{
    type Result = Result<T, ChunkingError>;
}

/// Makes the actor panic inside a handler, to exercise supervision (tests and soak runs only:
/// behind the `test-hooks` feature).
#[cfg(any(test, feature = "test-hooks"))]
#[derive(Message)]
#[rtype(result = "Result<(), ChunkingError>")]
pub(crate) struct InjectPanic;

/// The actors a caller can name, e.g. to inject a panic (`test-hooks` feature).
#[cfg(any(test, feature = "test-hooks"))]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ActorKind {
    /// The model's policies.
    PolicyRegistry,
    /// The accepted budgets.
    BudgetConfig,
    /// The whole prepared inputs.
    PreparedInputs,
    /// The overrun counts.
    OverrunAccounting,
    /// The row queues and steps.
    Scheduler,
}

/// Runs a handler, turning a panic into an error for the caller and a restart of the actor in
/// place: its state, mailbox and the futures it waits on are kept (stopping the context would
/// drop a step's pending answer and leave the step in flight for ever).
fn guard<A, R>(
    act: &mut A,
    ctx: &mut Context<A>,
    actor: &'static str,
    f: impl FnOnce(&mut A, &mut Context<A>) -> R,
) -> Result<R, ChunkingError>
where
    A: Actor<Context = Context<A>> + Supervised,
{
    match catch_unwind(AssertUnwindSafe(|| f(act, ctx))) {
        Ok(r) => Ok(r),
        Err(panic) => {
            let reason = panic
                .downcast_ref::<&str>()
                .map(ToString::to_string)
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            tracing::error!(actor, %reason, "actor panicked handling a message");
            act.restarting(ctx);
            Err(ChunkingError::ActorPanicked { actor, reason })
        }
    }
}

/// Makes an actor supervised: answers [`Guarded`] versions of the listed messages (each
/// answering `Result<_, ChunkingError>`), and, for tests, `InjectPanic`.
macro_rules! supervised {
    ($actor:ty, $name:literal, [$($msg:ty),* $(,)?]) => {
        impl actix::Supervised for $actor {
            fn restarting(&mut self, _: &mut Self::Context) {
                tracing::warn!(actor = $name, "actor restarted in place; its state and mailbox are kept");
            }
        }

        $(
            impl actix::Handler<$crate::actors::Guarded<$msg>> for $actor {
                type Result = <$msg as actix::Message>::Result;

                fn handle(&mut self, msg: $crate::actors::Guarded<$msg>, ctx: &mut Self::Context) -> Self::Result {
                    $crate::actors::guard(self, ctx, $name, |act, ctx| <Self as actix::Handler<$msg>>::handle(act, msg.0, ctx))
                        .and_then(|answer| answer)
                }
            }
        )*

        #[cfg(any(test, feature = "test-hooks"))]
        impl actix::Handler<$crate::actors::InjectPanic> for $actor {
            type Result = Result<(), $crate::error::ChunkingError>;

            fn handle(&mut self, _: $crate::actors::InjectPanic, _: &mut Self::Context) -> Self::Result {
                panic!("injected panic in {}", $name);
            }
        }

        #[cfg(any(test, feature = "test-hooks"))]
        impl actix::Handler<$crate::actors::Guarded<$crate::actors::InjectPanic>> for $actor {
            type Result = Result<(), $crate::error::ChunkingError>;

            fn handle(&mut self, msg: $crate::actors::Guarded<$crate::actors::InjectPanic>, ctx: &mut Self::Context) -> Self::Result {
                $crate::actors::guard(self, ctx, $name, |act, ctx| <Self as actix::Handler<$crate::actors::InjectPanic>>::handle(act, msg.0, ctx))
                    .and_then(|answer| answer)
            }
        }
    };
}
use supervised;

mod budget_config;
mod facade;
mod host;
mod overrun_accounting;
mod policy_registry;
mod prepared_inputs;
mod scheduler;
mod scheduler_shell;
mod spans;
mod start;

pub use facade::{ChunkingManagement, DEFAULT_REQUEST_TIMEOUT};
pub use host::ActorThread;
pub use scheduler::{DrainReport, QueueStats};
pub use start::actor_system;
