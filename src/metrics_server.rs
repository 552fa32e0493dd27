//! The metrics endpoint's HTTP server (`prometheus` feature): serves the exporter's rendered text
//! on `GET /metrics` (and `/`), and holds against any client (`docs/metrics.md#the-endpoint`).
//!
//! The exporter's own listener has no timeouts, no bound on open connections and logs every
//! failed accept, so idle clients could exhaust the process's file descriptors (and then the
//! replay could not open its report) while filling the log. This one, on hyper's HTTP/1 server:
//!
//! - accepts at most [`MAX_CONNECTIONS`] connections at a time; further clients wait in the
//!   kernel's listen queue, holding no descriptor of this process;
//! - closes a connection whose request headers are not in within [`HEADER_TIMEOUT`], and every
//!   connection [`CONNECTION_LIFETIME`] after it was accepted (a scraper opens a new one);
//! - logs a failed accept (out of descriptors, …) at most once per [`ACCEPT_ERROR_LOG_EVERY`],
//!   with the count of those not logged, and waits [`ACCEPT_RETRY`] before accepting again;
//! - answers `GET`/`HEAD` on `/metrics` and `/`, 405 for another method there, 404 elsewhere.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::header::{HeaderValue, ALLOW, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

/// The most connections served at once.
pub const MAX_CONNECTIONS: usize = 64;
/// The listen queue asked of the kernel (which may cap it at `net.core.somaxconn`).
pub const LISTEN_BACKLOG: u32 = 1024;
/// How long a client may take to send a request's headers.
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a connection stays open at most, however busy.
pub const CONNECTION_LIFETIME: Duration = Duration::from_secs(10);
/// How often a failed accept is logged at most.
pub const ACCEPT_ERROR_LOG_EVERY: Duration = Duration::from_secs(10);
/// How long to wait after a failed accept before the next one.
pub const ACCEPT_RETRY: Duration = Duration::from_millis(100);
/// How often the exporter's upkeep (draining histogram samples) runs.
pub const UPKEEP_EVERY: Duration = Duration::from_secs(5);

/// The content type of the Prometheus text format.
const TEXT_FORMAT: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Logs an event at most once per period, counting the ones it left out.
#[derive(Debug)]
pub(crate) struct RateLimit {
    every: Duration,
    last: Option<Instant>,
    suppressed: u64,
}

impl RateLimit {
    pub(crate) fn new(every: Duration) -> Self {
        Self {
            every,
            last: None,
            suppressed: 0,
        }
    }

    /// At `now`: `Some(n)` when the event is to be logged, with the `n` left out since the last
    /// one logged; `None` when it is to be left out.
    pub(crate) fn allow(&mut self, now: Instant) -> Option<u64> {
        match self.last {
            Some(last) if now.saturating_duration_since(last) < self.every => {
                self.suppressed += 1;
                None
            }
            _ => {
                self.last = Some(now);
                Some(std::mem::take(&mut self.suppressed))
            }
        }
    }
}

/// The answer to one request.
fn answer(method: &Method, path: &str, render: impl FnOnce() -> String) -> Response<Full<Bytes>> {
    let text = |status: StatusCode, body: &'static str| {
        let mut r = Response::new(Full::new(Bytes::from_static(body.as_bytes())));
        *r.status_mut() = status;
        r.headers_mut().insert(
            CONTENT_TYPE,
            HeaderValue::from_static("text/plain; charset=utf-8"),
        );
        r
    };
    if path != "/metrics" && path != "/" {
        return text(
            StatusCode::NOT_FOUND,
            "not found: metrics are served at /metrics\n",
        );
    }
    if method != Method::GET && method != Method::HEAD {
        let mut r = text(
            StatusCode::METHOD_NOT_ALLOWED,
            "method not allowed: use GET\n",
        );
        r.headers_mut()
            .insert(ALLOW, HeaderValue::from_static("GET, HEAD"));
        return r;
    }
    let mut r = Response::new(Full::new(Bytes::from(render())));
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(TEXT_FORMAT));
    r
}

/// Serves `handle` on `listener` until the runtime stops; also runs the exporter's upkeep.
pub(crate) async fn serve(listener: TcpListener, handle: PrometheusHandle) {
    let upkeep = handle.clone();
    tokio::spawn(async move {
        let mut every = tokio::time::interval(UPKEEP_EVERY);
        loop {
            every.tick().await;
            upkeep.run_upkeep();
        }
    });
    let permits = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let mut errors = RateLimit::new(ACCEPT_ERROR_LOG_EVERY);
    loop {
        // Never closed, so acquiring only waits for a connection to end.
        let Ok(permit) = permits.clone().acquire_owned().await else {
            return;
        };
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                if let Some(left_out) = errors.allow(Instant::now()) {
                    tracing::warn!(
                        error = %e,
                        not_logged_since_last = left_out,
                        "the metrics endpoint cannot accept a connection; retrying (logged at most every {} s)",
                        ACCEPT_ERROR_LOG_EVERY.as_secs()
                    );
                }
                drop(permit);
                tokio::time::sleep(ACCEPT_RETRY).await;
                continue;
            }
        };
        let handle = handle.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                let r = answer(req.method(), req.uri().path(), || handle.render());
                async move { Ok::<_, Infallible>(r) }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                .serve_connection(TokioIo::new(stream), service);
            let mut conn = std::pin::pin!(conn);
            tokio::select! {
                _ = conn.as_mut() => {}
                () = tokio::time::sleep(CONNECTION_LIFETIME) => {
                    // Lets a response being written finish, briefly.
                    conn.as_mut().graceful_shutdown();
                    let _ = tokio::time::timeout(Duration::from_secs(1), conn).await;
                }
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_get_and_head_on_metrics_and_the_root_are_answered() {
        let body = || "# metrics\n".to_string();
        for (method, path, status) in [
            (Method::GET, "/metrics", 200),
            (Method::GET, "/", 200),
            (Method::HEAD, "/metrics", 200),
            (Method::POST, "/metrics", 405),
            (Method::DELETE, "/", 405),
            (Method::GET, "/metrics/x", 404),
            (Method::GET, "/favicon.ico", 404),
            (Method::POST, "/other", 404),
        ] {
            let r = answer(&method, path, body);
            assert_eq!(r.status().as_u16(), status, "{method} {path}");
            if status == 405 {
                assert_eq!(r.headers()[ALLOW], "GET, HEAD");
            }
            if status == 200 {
                assert_eq!(r.headers()[CONTENT_TYPE], TEXT_FORMAT);
            }
        }
    }

    #[test]
    fn a_rate_limit_logs_once_per_period_with_the_count_left_out() {
        let mut l = RateLimit::new(Duration::from_secs(10));
        let t0 = Instant::now();
        assert_eq!(l.allow(t0), Some(0));
        for i in 1..=999 {
            assert_eq!(l.allow(t0 + Duration::from_millis(i)), None);
        }
        assert_eq!(l.allow(t0 + Duration::from_secs(10)), Some(999));
        assert_eq!(l.allow(t0 + Duration::from_secs(11)), None);
        assert_eq!(l.allow(t0 + Duration::from_secs(20)), Some(1));
    }
}
