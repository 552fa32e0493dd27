//! The connections the server holds, and which to shed when they reach the cap.
//!
//! Every accepted connection is wrapped in a [`Tracked`] stream and registered in
//! [`Connections`]. A connection is *waiting on its client* while no request on it is past its
//! body: it waits for a request's headers (new, or idle between requests) or for the rest of a
//! body. When an accepted connection fills the last of the cap's slots, one of those is shed:
//! the request that has waited longest for its body, else the keep-alive connection idle
//! longest, else the connection that has waited longest for its first request (each counted
//! from its accept or its last answer). So a client in the kernel's listen queue is accepted at
//! once instead of after the header or body deadlines of those ahead of it. A request still
//! sending its body is answered 503 and its connection closed without reading the rest; an idle
//! connection is closed.
//! A connection whose request is being answered is never shed.

use std::collections::HashMap;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Instant;

use futures_util::task::AtomicWaker;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::Notify;

/// The open connections, against a cap.
#[derive(Debug)]
pub struct Connections {
    cap: usize,
    epoch: Instant,
    next_id: AtomicU64,
    open: Mutex<HashMap<u64, Arc<Conn>>>,
}

/// One open connection's state (in its connection data, for the handlers).
#[derive(Debug)]
pub struct Conn {
    id: u64,
    epoch: Instant,
    /// Nanoseconds from `epoch` to when it last began waiting on its client: accepted, or
    /// its last answer sent.
    since: AtomicU64,
    /// Requests on it from their headers to the end of their answer.
    requests: AtomicU32,
    /// Of those, requests still reading their bodies.
    reading: AtomicU32,
    /// A request on it was answered: it is a keep-alive connection.
    answered: AtomicBool,
    /// Chosen to be shed (never chosen twice).
    shed: AtomicBool,
    /// The task reading the stream, woken when it is shed or its last answer is out.
    waker: AtomicWaker,
    /// Tells a request reading its body that it was shed.
    body_shed: Notify,
}

impl Connections {
    /// No connections yet; shedding begins when `cap` are open.
    pub fn new(cap: usize) -> Arc<Self> {
        Arc::new(Connections {
            cap: cap.max(1),
            epoch: Instant::now(),
            next_id: AtomicU64::new(0),
            open: Mutex::new(HashMap::new()),
        })
    }

    /// The connections open now.
    pub fn open(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<Conn>>> {
        // The map stays consistent whatever panicked while holding it.
        self.open.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Registers an accepted stream. If it fills the cap, sheds a connection (other than this
    /// one) waiting on its client, if any is, in the order the module's doc gives.
    pub fn admit<T>(self: &Arc<Self>, io: T) -> Tracked<T> {
        let conn = Arc::new(Conn {
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            epoch: self.epoch,
            since: AtomicU64::new(0),
            requests: AtomicU32::new(0),
            reading: AtomicU32::new(0),
            answered: AtomicBool::new(false),
            shed: AtomicBool::new(false),
            waker: AtomicWaker::new(),
            body_shed: Notify::new(),
        });
        conn.stamp();
        let mut open = self.lock();
        open.insert(conn.id, conn.clone());
        if open.len() >= self.cap {
            let oldest = open
                .values()
                .filter(|c| c.id != conn.id && c.waiting_on_client())
                .min_by_key(|c| (c.kind(), c.since.load(Ordering::Relaxed)));
            if let Some(c) = oldest {
                c.shed();
                crate::metrics::connection_shed();
            }
        }
        drop(open);
        Tracked {
            io,
            conn,
            conns: self.clone(),
        }
    }
}

impl Conn {
    fn stamp(&self) {
        let ns = u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.since.store(ns, Ordering::Relaxed);
    }

    fn waiting_on_client(&self) -> bool {
        !self.shed.load(Ordering::Relaxed)
            && self.requests.load(Ordering::Acquire) == self.reading.load(Ordering::Acquire)
    }

    /// What it waits on its client for, in the order connections are shed: a request's body
    /// (0), the next request after an answer (1), the first request (2: a new client whose
    /// request may be on its way).
    fn kind(&self) -> u8 {
        if self.reading.load(Ordering::Acquire) > 0 {
            0
        } else if self.answered.load(Ordering::Acquire) {
            1
        } else {
            2
        }
    }

    fn shed(&self) {
        self.shed.store(true, Ordering::Release);
        // A body reader answers 503; its connection ends once the answer is out.
        self.body_shed.notify_one();
        self.waker.wake();
    }

    /// Shed, with no request on it in progress: its stream reads as ended, so the connection
    /// closes (after flushing what it has written) without waiting on its client.
    fn closing(&self) -> bool {
        self.shed.load(Ordering::Acquire) && self.requests.load(Ordering::Acquire) == 0
    }

    /// Whether it was shed: the answer in progress is its last.
    pub fn is_shed(&self) -> bool {
        self.shed.load(Ordering::Acquire)
    }

    /// Counts a request from its headers until the guard drops (at the end of its answer).
    pub fn request(self: &Arc<Self>) -> RequestGuard {
        self.requests.fetch_add(1, Ordering::AcqRel);
        RequestGuard(self.clone())
    }

    /// Counts a request as reading its body until the guard drops.
    pub fn reading(self: &Arc<Self>) -> ReadingGuard {
        self.reading.fetch_add(1, Ordering::AcqRel);
        ReadingGuard(self.clone())
    }

    /// Resolves once the connection is shed while a request on it reads its body.
    pub async fn body_shed(&self) {
        self.body_shed.notified().await;
    }
}

/// A request on a connection, from its headers to the end of its answer.
#[derive(Debug)]
pub struct RequestGuard(Arc<Conn>);

impl Drop for RequestGuard {
    fn drop(&mut self) {
        // Answered: the connection waits on its client again, from now.
        self.0.stamp();
        self.0.answered.store(true, Ordering::Release);
        self.0.requests.fetch_sub(1, Ordering::AcqRel);
        if self.0.is_shed() {
            self.0.waker.wake();
        }
    }
}

/// A request reading its body.
#[derive(Debug)]
pub struct ReadingGuard(Arc<Conn>);

impl Drop for ReadingGuard {
    fn drop(&mut self) {
        self.0.reading.fetch_sub(1, Ordering::AcqRel);
    }
}

/// An accepted stream, registered in [`Connections`] for as long as it lives; once shed, and
/// no request on it in progress, it reads as ended, which closes the connection.
#[derive(Debug)]
pub struct Tracked<T> {
    io: T,
    conn: Arc<Conn>,
    conns: Arc<Connections>,
}

impl<T> Tracked<T> {
    /// The connection's state.
    pub fn conn(&self) -> &Arc<Conn> {
        &self.conn
    }
}

impl<T> Drop for Tracked<T> {
    fn drop(&mut self) {
        self.conns.lock().remove(&self.conn.id);
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Tracked<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.conn.waker.register(cx.waker());
        if this.conn.closing() {
            // The end of the stream: nothing read.
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut this.io).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Tracked<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn closing<T>(t: &Tracked<T>) -> bool {
        t.conn().closing()
    }

    /// At the cap: a request waiting for its body first (through its reader: its stream is
    /// left to send the 503), then the keep-alive connection idle longest, then the new
    /// connection waiting longest; never one being answered, never the one just accepted.
    #[test]
    fn the_order_connections_are_shed_in() {
        let conns = Connections::new(4);
        let fresh = conns.admit(());
        let idle = conns.admit(());
        drop(idle.conn().request()); // answered: a keep-alive connection
        let body = conns.admit(());
        let request = body.conn().request();
        let reading = body.conn().reading();
        let busy = conns.admit(());
        let _answering = busy.conn().request();
        // The fourth filled the cap: the body reader, though it is the youngest waiting.
        assert!(body.conn().is_shed() && !closing(&body));
        assert!(!fresh.conn().is_shed() && !idle.conn().is_shed() && !busy.conn().is_shed());
        // Its 503 is out: its stream reads as ended.
        drop(reading);
        drop(request);
        assert!(closing(&body));
        drop(body);
        let next = conns.admit(());
        assert!(
            idle.conn().is_shed() && closing(&idle),
            "then the idle keep-alive one"
        );
        drop(idle);
        let last = conns.admit(());
        assert!(
            fresh.conn().is_shed() && closing(&fresh),
            "then the new one waiting longest"
        );
        drop(fresh);
        assert!(!busy.conn().is_shed() && !next.conn().is_shed() && !last.conn().is_shed());
        assert_eq!(conns.open(), 3);
        // Only `busy` (being answered) and the newest are left to choose from: `next` goes.
        let more = conns.admit(());
        assert!(next.conn().is_shed() && !busy.conn().is_shed() && !more.conn().is_shed());
    }
}
