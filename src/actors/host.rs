//! Where the actors run and how a request reaches them: how long a facade request waits and
//! where that wait is timed ([`ask`]), and the actors' own thread ([`ThreadKeeper`]) with its
//! guard ([`ActorThread`]), which `ChunkingManagement::start_on_own_thread` starts.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
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
        (Some(after), None) => within(request, after).await,
        (Some(after), Some(host)) => {
            // Timed on the actors' runtime: a caller's runtime without tokio's time driver
            // would panic on a timer of its own ("timers are disabled").
            let (tx, rx) = tokio::sync::oneshot::channel();
            let spawned = host.spawn(async move {
                // The caller may have dropped its future; then nobody waits for the answer.
                let _ = tx.send(within(request, after).await);
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

/// Awaits `request` (polled where its actor runs: on the caller's arbiter, or in a task on the
/// actors' own thread) with the deadline `after`, armed only when the answer is late ([`Late`]).
async fn within<F, T>(request: F, after: Duration) -> Result<T, MailboxError>
where
    F: Future<Output = Result<T, MailboxError>>,
{
    let mut request = std::pin::pin!(request);
    let mut late = Late::default();
    std::future::poll_fn(|cx| late.poll(request.as_mut(), after, cx)).await
}

/// Where a request polled beside its actor is on the way to its deadline, which is armed
/// only when the answer is late (`docs/actors.md#supervision-and-timeouts`). The first poll
/// sends the request and finds no answer yet (the actor has not run): it asks to be polled again
/// after the tasks already woken, the actor among them. An answer there by the second poll
/// (every call of an engine that awaits its calls) costs no timer and reads no clock; only a
/// request still unanswered then arms one, for the whole timeout from that poll on, so the
/// deadline is at most one turn of the arbiter later than the send.
#[derive(Default)]
enum Late {
    /// Not polled yet.
    #[default]
    Sent,
    /// Polled once without an answer, and woken to look again.
    Looked,
    /// Unanswered at its second poll: the deadline's timer runs (boxed, so that only a late
    /// request allocates it).
    Timed(Pin<Box<actix::clock::Sleep>>),
}

impl Late {
    /// Polls `request`, then its deadline `after` as far as it has come.
    fn poll<F, T>(
        &mut self,
        request: Pin<&mut F>,
        after: Duration,
        cx: &mut Context<'_>,
    ) -> Poll<Result<T, MailboxError>>
    where
        F: Future<Output = Result<T, MailboxError>>,
    {
        if let Poll::Ready(answer) = request.poll(cx) {
            return Poll::Ready(answer);
        }
        match self {
            Late::Sent => {
                *self = Late::Looked;
                cx.waker().wake_by_ref();
                Poll::Pending
            }
            Late::Looked => {
                let mut timer = Box::pin(actix::clock::sleep(after));
                let expired = timer.as_mut().poll(cx);
                *self = Late::Timed(timer);
                expired.map(|()| Err(MailboxError::Timeout))
            }
            Late::Timed(timer) => timer.as_mut().poll(cx).map(|()| Err(MailboxError::Timeout)),
        }
    }
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

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;

    /// An actor that answers `Quick` at once, `Slow` after `ms` milliseconds and `Never` never.
    struct Answers;

    impl Actor for Answers {
        type Context = actix::Context<Self>;
    }

    macro_rules! message {
        ($name:ident) => {
            struct $name(u64);
            impl Message for $name {
                type Result = Result<u64, ChunkingError>;
            }
        };
    }
    message!(Quick);
    message!(Slow);
    message!(Never);

    impl Handler<Guarded<Quick>> for Answers {
        type Result = Result<u64, ChunkingError>;
        fn handle(&mut self, m: Guarded<Quick>, _: &mut Self::Context) -> Self::Result {
            Ok(m.0 .0)
        }
    }

    impl Handler<Guarded<Slow>> for Answers {
        type Result = ResponseFuture<Result<u64, ChunkingError>>;
        fn handle(&mut self, m: Guarded<Slow>, _: &mut Self::Context) -> Self::Result {
            let ms = m.0 .0;
            Box::pin(async move {
                actix::clock::sleep(Duration::from_millis(ms)).await;
                Ok(ms)
            })
        }
    }

    impl Handler<Guarded<Never>> for Answers {
        type Result = ResponseFuture<Result<u64, ChunkingError>>;
        fn handle(&mut self, m: Guarded<Never>, _: &mut Self::Context) -> Self::Result {
            let pending = std::future::pending::<()>();
            Box::pin(async move {
                pending.await;
                Ok(m.0 .0)
            })
        }
    }

    fn within_ms(ms: u64) -> RequestTimeout {
        RequestTimeout {
            after: Some(Duration::from_millis(ms)),
            host: None,
            keeper: None,
        }
    }

    #[test]
    fn an_answer_in_time_needs_no_timer() {
        // A runtime without tokio's time driver: any timer would panic ("timers are
        // disabled"), so the answered requests below armed none.
        let rt = || {
            tokio::runtime::Builder::new_current_thread()
                .build()
                .expect("a runtime")
        };
        let answers = actix::System::with_tokio_rt(rt).block_on(async {
            let addr = Answers.start();
            let mut answers = Vec::new();
            for i in 0..3 {
                answers.push(ask(&addr, "Answers", &within_ms(5_000), Quick(i)).await);
            }
            answers
        });
        assert_eq!(answers, [Ok(0), Ok(1), Ok(2)]);
    }

    // Built with tokio's `net` (the exporter's), which `actix::System::new()` would enable.
    #[cfg(feature = "prometheus")]
    #[test]
    fn the_actors_system_has_timers_and_no_io_driver() {
        // Registering a socket needs tokio's I/O driver: the actors' runtime refuses it (tokio
        // panics), so its `block_on` never polls the driver. Timers (the request timeouts) work.
        let socket = std::net::UdpSocket::bind("127.0.0.1:0").expect("a socket");
        socket.set_nonblocking(true).expect("non-blocking");
        let system = crate::actors::actor_system().expect("the actors' System");
        let registered = system.block_on(async move {
            tokio::time::sleep(Duration::from_millis(1)).await;
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                tokio::net::UdpSocket::from_std(socket)
            }))
            .is_ok()
        });
        assert!(!registered, "the actors' runtime has an I/O driver");
    }

    #[test]
    fn stopped_actors_answer_that_they_stopped() {
        let subs = [("llm", crate::SubmoduleCaps::new(["prefill"], false))];
        let (cm, actors) = crate::ChunkingManagement::start_on_own_thread("t", subs).unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("a runtime");
        // Answered on the actors' thread within the deadline, then refused once it stopped.
        assert!(rt.block_on(cm.queue_stats()).is_ok());
        actors.stop();
        let stopped = rt.block_on(cm.queue_stats());
        assert_eq!(
            stopped,
            Err(ChunkingError::ActorStopped { actor: "Scheduler" })
        );
    }

    /// Starts actors on their own thread and ends them with `end`; answers whether their
    /// thread had ended when `end` returned. A value left in a thread-local of that thread is
    /// dropped as it ends, slowly, so an `end` that does not wait for the thread returns first.
    fn thread_ended_by(end: impl FnOnce(crate::ChunkingManagement, ActorThread)) -> bool {
        use std::sync::atomic::{AtomicBool, Ordering};
        struct AtExit(Arc<AtomicBool>);
        impl Drop for AtExit {
            fn drop(&mut self) {
                std::thread::sleep(Duration::from_millis(100));
                self.0.store(true, Ordering::SeqCst);
            }
        }
        thread_local! {
            static AT_EXIT: std::cell::RefCell<Option<AtExit>> = const { std::cell::RefCell::new(None) };
        }
        let ended = Arc::new(AtomicBool::new(false));
        let subs = [("llm", crate::SubmoduleCaps::new(["prefill"], false))];
        let (cm, actors) = crate::ChunkingManagement::start_on_own_thread("t", subs).unwrap();
        let host = cm.timeout.host.clone().expect("the actors' own thread");
        let (tx, rx) = std::sync::mpsc::channel();
        let at_exit = AtExit(ended.clone());
        assert!(host.spawn(async move {
            AT_EXIT.with(|e| *e.borrow_mut() = Some(at_exit));
            let _ = tx.send(());
        }));
        rx.recv().expect("the task ran on the actors' thread");
        end(cm, actors);
        ended.load(Ordering::SeqCst)
    }

    #[test]
    fn stop_returns_once_the_actors_thread_has_ended() {
        let ended = thread_ended_by(|cm, actors| {
            actors.stop();
            std::mem::forget(cm);
        });
        assert!(ended, "stop returned before the actors' thread ended");
    }

    #[test]
    fn the_actors_thread_ends_with_the_last_handle_and_guard() {
        let ended = thread_ended_by(|cm, actors| {
            drop(actors);
            drop(cm.clone());
            drop(cm);
        });
        assert!(ended, "the last handle dropped, the thread still ran");
    }

    #[actix::test]
    async fn a_late_answer_in_time_is_answered_and_a_missing_one_times_out() {
        let addr = Answers.start();
        let late = ask(&addr, "Answers", &within_ms(2_000), Slow(10)).await;
        assert_eq!(
            late,
            Ok(10),
            "answered after its second poll, before the deadline"
        );

        let started = Instant::now();
        let limit = Duration::from_secs(2);
        let never = actix::clock::timeout(limit, ask(&addr, "Answers", &within_ms(30), Never(0)))
            .await
            .expect("the request's own deadline ends it");
        assert_eq!(
            never,
            Err(ChunkingError::Timeout {
                actor: "Answers",
                after: Duration::from_millis(30),
            })
        );
        assert!(
            started.elapsed() >= Duration::from_millis(30),
            "not before its deadline"
        );
        // The actor still answers after a request of it timed out.
        assert_eq!(ask(&addr, "Answers", &within_ms(30), Quick(4)).await, Ok(4));
    }
}
