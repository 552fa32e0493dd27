//! The facade's requests and its own-thread start: how long a request waits and where that
//! wait is timed ([`ask`]), and the thread [`ChunkingManagement::start_on_own_thread`] hosts
//! the actors on, with its guard ([`ActorThread`]).

use std::sync::Arc;
use std::time::Duration;

use actix::dev::ToEnvelope;
use actix::prelude::*;

use super::facade::ChunkingManagement;
use super::Guarded;
use crate::error::ChunkingError;
use crate::policy::SubmoduleCaps;

/// How long the facade waits for an answer, and where that wait is timed.
#[derive(Clone)]
pub(super) struct RequestTimeout {
    pub(super) after: Option<Duration>,
    /// The arbiter of the actors' own thread ([`ChunkingManagement::start_on_own_thread`]):
    /// requests are timed there, so the caller's runtime needs no timer. `None` on the
    /// caller's arbiter ([`ChunkingManagement::start`]), whose actix runtime has one.
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

/// The guard of the thread [`ChunkingManagement::start_on_own_thread`] hosts the actors on.
///
/// The thread runs while the guard or any handle to its actors lives: dropping the guard (even
/// at once, as `let (cm, _) = ..` does) stops nothing while handles remain, and the thread
/// stops when the last of them is dropped. [`ActorThread::stop`] stops the actors at once;
/// handles then answer [`ChunkingError::ActorStopped`].
#[must_use = "the guard stops the actors explicitly with `stop`; keep it (e.g. `let (cm, _actors) = ..`)"]
pub struct ActorThread {
    keeper: Arc<ThreadKeeper>,
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
    system: actix::System,
    thread: std::sync::Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl ThreadKeeper {
    fn shutdown(&self) {
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

impl ChunkingManagement {
    /// Starts the actors on a thread of their own, in an actix System of their own, for an
    /// engine that runs on tokio (or any runtime) without one. Returns the handle (`Send`,
    /// usable from any thread) and the thread's guard. The thread runs while the guard or any
    /// clone of the handle lives, so dropping the guard early stops nothing; call
    /// [`ActorThread::stop`] (after [`drain`](Self::drain)) to stop the actors at shutdown.
    ///
    /// ```
    /// use mstar_chunking::{ChunkingManagement, ChunkingPolicy, SubmoduleCaps};
    ///
    /// let (cm, _actors) = ChunkingManagement::start_on_own_thread(
    ///     "demo",
    ///     [("llm", SubmoduleCaps::new(["prefill"], false))],
    /// )?;
    /// let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    /// rt.block_on(async {
    ///     cm.set_policies([(("llm", "prefill"), ChunkingPolicy::budget(256))]).await?;
    ///     assert_eq!(cm.max_batch_tokens("llm", "prefill").await?, Some(256));
    ///     Ok::<_, mstar_chunking::ChunkingError>(())
    /// })?;
    /// # Ok::<_, Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    /// [`ChunkingError::ThreadStart`] when the thread or its System cannot start.
    pub fn start_on_own_thread<I, S>(
        model: &str,
        submodules: I,
    ) -> Result<(Self, ActorThread), ChunkingError>
    where
        I: IntoIterator<Item = (S, SubmoduleCaps)>,
        S: AsRef<str>,
    {
        let submodules: Vec<(String, SubmoduleCaps)> = submodules
            .into_iter()
            .map(|(n, c)| (n.as_ref().to_owned(), c))
            .collect();
        let model = model.to_owned();
        let (tx, rx) = std::sync::mpsc::channel();
        let thread = std::thread::Builder::new()
            .name(format!("mstar-chunking-{model}"))
            .spawn(move || {
                let system = actix::System::new();
                system.block_on(async {
                    let started = ChunkingManagement::start(&model, submodules).map(|mut cm| {
                        cm.timeout.host = Some(actix::Arbiter::current());
                        cm
                    });
                    // The receiver waits for this answer; if it went away there is no one to tell.
                    let _ = tx.send(started.map(|cm| (cm, actix::System::current())));
                });
                if let Err(e) = system.run() {
                    tracing::error!(error = %e, "the chunking actor System ended with an error");
                }
            })
            .map_err(|e| ChunkingError::ThreadStart {
                reason: e.to_string(),
            })?;
        let (mut cm, system) = rx.recv().map_err(|_| ChunkingError::ThreadStart {
            reason: "the actor thread ended before starting the actors".into(),
        })??;
        let keeper = Arc::new(ThreadKeeper {
            system,
            thread: std::sync::Mutex::new(Some(thread)),
        });
        cm.timeout.keeper = Some(keeper.clone());
        Ok((cm, ActorThread { keeper }))
    }
}
