//! Where the actors run and how a request reaches them: how long a facade request waits and
//! where that wait is timed ([`ask`]), and the actors' own thread ([`ThreadKeeper`]) with its
//! guard ([`ActorThread`]), which `ChunkingManagement::start_on_own_thread` starts.

use std::sync::Arc;
use std::time::Duration;

use actix::dev::ToEnvelope;
use actix::prelude::*;

use super::Guarded;
use crate::error::ChunkingError;

/// How long the facade waits for an answer, and where that wait is timed.
#[derive(Clone)]
pub(super) struct RequestTimeout {
    pub(super) after: Option<Duration>,
    /// The arbiter of the actors' own thread (`ChunkingManagement::start_on_own_thread`):
    /// requests are timed there, so the caller's runtime needs no timer. `None` on the
    /// caller's arbiter (`ChunkingManagement::start`), whose actix runtime has one.
    pub(super) host: Option<actix::ArbiterHandle>,
    /// The actors' own thread, kept running while any handle or the guard lives
    /// ([`ActorThread`]); `None` on the caller's arbiter.
    pub(super) keeper: Option<Arc<ThreadKeeper>>,
}

/// Sends `msg` to `actor` and waits at most `timeout` for the answer. A panic while handling it
/// (the actor restarts), a stopped actor or a timeout are errors, never a hang.
pub(super) async fn ask<A, M, T>(
    addr: &Addr<A>,
    actor: &'static str,
    timeout: &RequestTimeout,
    msg: M,
) -> Result<T, ChunkingError>
where
    A: Actor + Handler<Guarded<M>>,
    A::Context: ToEnvelope<A, Guarded<M>>,
    M: Message<Result = Result<T, ChunkingError>> + Send + 'static,
    T: Send + 'static,
{
    let request = addr.send(Guarded(msg));
    let answer = match (timeout.after, &timeout.host) {
        (None, _) => request.await,
        (Some(after), None) => request.timeout(after).await,
        (Some(after), Some(host)) => {
            // Timed on the actors' runtime: a caller's runtime without tokio's time driver
            // would panic on a timer of its own ("timers are disabled").
            let (tx, rx) = tokio::sync::oneshot::channel();
            let spawned = host.spawn(async move {
                // The caller may have dropped its future; then nobody waits for the answer.
                let _ = tx.send(request.timeout(after).await);
            });
            match spawned {
                true => rx.await.unwrap_or(Err(MailboxError::Closed)),
                false => Err(MailboxError::Closed),
            }
        }
    };
    answer.map_err(|e| match (e, timeout.after) {
        (MailboxError::Timeout, Some(after)) => ChunkingError::Timeout { actor, after },
        _ => ChunkingError::ActorStopped { actor },
    })?
}

/// The guard of the thread `ChunkingManagement::start_on_own_thread` hosts the actors on.
///
/// The thread runs while the guard or any handle to its actors lives: dropping the guard (even
/// at once, as `let (cm, _) = ..` does) stops nothing while handles remain, and the thread
/// stops when the last of them is dropped. [`ActorThread::stop`] stops the actors at once;
/// handles then answer [`ChunkingError::ActorStopped`].
#[must_use = "the guard stops the actors explicitly with `stop`; keep it (e.g. `let (cm, _actors) = ..`)"]
pub struct ActorThread {
    pub(super) keeper: Arc<ThreadKeeper>,
}

impl ActorThread {
    /// Stops the actors and waits for their thread to end (unless called on that thread).
    pub fn stop(self) {
        self.keeper.shutdown();
    }
}

/// The actors' thread and its actix System, shared by the guard and every handle: the last
/// one dropped stops the System and joins the thread.
pub(super) struct ThreadKeeper {
    pub(super) system: actix::System,
    pub(super) thread: std::sync::Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl ThreadKeeper {
    pub(super) fn shutdown(&self) {
        self.system.stop();
        let thread = self
            .thread
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        // Never joined from the actors' own thread (a handle dropped inside one of its tasks):
        // the System stops once that task returns.
        if let Some(t) = thread.filter(|t| t.thread().id() != std::thread::current().id()) {
            // The thread only runs the System; a panic there has been logged by the actors.
            let _ = t.join();
        }
    }
}

impl Drop for ThreadKeeper {
    fn drop(&mut self) {
        self.shutdown();
    }
}
