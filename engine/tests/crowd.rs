//! The server beside crowds of idle, slow and lying clients: a live client is answered at once
//! however many idle connections are open and however slowly others send their bodies; a body
//! must arrive within its deadline however it trickles; an idle connection is closed after the
//! header timeout; a `Content-Length` past the body limit is answered 413 before any body.
//!
//! The server runs on the test's runtime, so every client here runs in a blocking task.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use candle_core::Device;
use mstar_engine::engine::{self, EngineSettings};
use mstar_engine::model::{Config, Model};
use mstar_engine::server::{raise_descriptor_limit, Server, ServerLimits};

mod common;
use common::status_within;

fn start_with(limits: ServerLimits) -> (Server, std::thread::JoinHandle<Result<(), String>>) {
    let model = Model::random(Config::tiny(), 5, &Device::Cpu).unwrap();
    let (handle, thread) = engine::start(model, EngineSettings::default()).unwrap();
    let srv = Server::start_with(handle, "tiny", "127.0.0.1:0", limits).unwrap();
    (srv, thread)
}

/// A POST whose headers announce `len` body bytes, with none of them sent.
fn announce(addr: SocketAddr, len: u64) -> TcpStream {
    let mut c = TcpStream::connect(addr).unwrap();
    write!(
        c,
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {len}\r\n\r\n"
    )
    .unwrap();
    c
}

/// One `/health` probe on a new connection: its time to the status line, which must be 200.
fn probe(addr: SocketAddr) -> Duration {
    let t0 = Instant::now();
    let mut c = TcpStream::connect(addr).unwrap();
    c.write_all(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        .unwrap();
    let status = status_within(&mut c, Duration::from_secs(10));
    let took = t0.elapsed();
    assert!(status.contains(" 200 "), "/health answered {status:?}");
    took
}

/// 50 `/health` probes answer within 100 ms at p99 while 1,000 idle connections are open and
/// 200 clients send a body one byte a second. The limits are the defaults but for longer
/// timeouts, so that the crowd stays connected through the probes.
#[actix_web::test]
async fn health_answers_within_100_ms_beside_1000_idle_and_200_trickling_clients() {
    const IDLE: usize = 1_000;
    const TRICKLING: usize = 200;
    // The test's descriptors and the server's (one process): two per connection and spare.
    let limit = raise_descriptor_limit().expect("the descriptor limit is readable");
    let need = 2 * (IDLE + TRICKLING) as u64 + 512;
    assert!(
        limit >= need,
        "RLIMIT_NOFILE's hard limit is {limit}; this test needs {need} descriptors"
    );
    let (srv, thread) = start_with(ServerLimits {
        header_timeout: Duration::from_secs(60),
        body_timeout: Duration::from_secs(60),
        ..ServerLimits::default()
    });
    assert!(srv.state.limits.max_connections >= IDLE + TRICKLING + 50);
    let addr = srv.addr;
    let times = tokio::task::spawn_blocking(move || {
        let idle: Vec<TcpStream> = (0..IDLE)
            .map(|_| TcpStream::connect(addr).unwrap())
            .collect();
        let mut trickling: Vec<TcpStream> = (0..TRICKLING).map(|_| announce(addr, 1_000)).collect();
        // Every connection is accepted (none waits in the listen queue) before the probes.
        std::thread::sleep(Duration::from_millis(500));
        let mut times = Vec::with_capacity(50);
        let mut last_byte = Instant::now() - Duration::from_secs(1);
        for i in 0..50 {
            if last_byte.elapsed() >= Duration::from_secs(1) {
                for c in &mut trickling {
                    c.write_all(if i == 0 { b"{" } else { b" " }).unwrap();
                }
                last_byte = Instant::now();
            }
            times.push(probe(addr));
            std::thread::sleep(Duration::from_millis(40));
        }
        // The crowd is still connected: no idle connection was closed under it.
        drop(idle);
        times
    })
    .await
    .unwrap();
    let mut sorted = times.clone();
    sorted.sort();
    let p99 = sorted[(sorted.len() * 99).div_ceil(100) - 1];
    assert!(
        p99 < Duration::from_millis(100),
        "/health p99 {p99:?} over 50 probes; all: {times:?}"
    );
    srv.shutdown(Duration::from_secs(1)).await.unwrap();
    thread.join().unwrap().unwrap();
}

/// A body sent one byte every 100 ms is cut at its deadline (408), counted from its headers:
/// each byte arrives well within any read timeout, and the whole body would take 100 s.
#[actix_web::test]
async fn a_trickling_body_is_cut_at_its_deadline() {
    let (srv, thread) = start_with(ServerLimits {
        body_timeout: Duration::from_millis(800),
        ..ServerLimits::default()
    });
    let addr = srv.addr;
    let (status, took) = tokio::task::spawn_blocking(move || {
        let mut c = announce(addr, 1_000);
        let t0 = Instant::now();
        c.set_read_timeout(Some(Duration::from_millis(100)))
            .unwrap();
        let mut buf = [0u8; 512];
        // Bounded: 100 bytes at most (10 s), stopping at the first answer.
        for _ in 0..100 {
            if c.write_all(b" ").is_err() {
                break;
            }
            match c.read(&mut buf) {
                Ok(n) => {
                    let head = String::from_utf8_lossy(&buf[..n])
                        .lines()
                        .next()
                        .map(str::to_owned);
                    return (head.unwrap_or_default(), t0.elapsed());
                }
                Err(_) => continue,
            }
        }
        (String::new(), t0.elapsed())
    })
    .await
    .unwrap();
    assert!(
        status.contains(" 408 "),
        "a trickling body: {status:?} after {took:?}"
    );
    assert!(took < Duration::from_secs(5), "cut after {took:?}");
    srv.shutdown(Duration::from_secs(1)).await.unwrap();
    thread.join().unwrap().unwrap();
}

/// A connection that sends nothing is closed after the header timeout.
#[actix_web::test]
async fn an_idle_connection_is_closed_after_the_header_timeout() {
    let (srv, thread) = start_with(ServerLimits {
        header_timeout: Duration::from_millis(300),
        ..ServerLimits::default()
    });
    let addr = srv.addr;
    let closed = tokio::task::spawn_blocking(move || {
        let mut c = TcpStream::connect(addr).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut buf = [0u8; 512];
        let t0 = Instant::now();
        // EOF, or actix's 408 and then EOF.
        loop {
            match c.read(&mut buf) {
                Ok(0) => return Some(t0.elapsed()),
                Ok(_) => continue,
                Err(_) => return None,
            }
        }
    })
    .await
    .unwrap();
    let took = closed.expect("the idle connection was closed within 10 s");
    assert!(took < Duration::from_secs(5), "closed after {took:?}");
    srv.shutdown(Duration::from_secs(1)).await.unwrap();
    thread.join().unwrap().unwrap();
}

/// A `Content-Length` of 10 GB is answered 413 without a byte of body sent, and a
/// `Content-Length` that is not a number is a 400: neither waits for a body.
#[actix_web::test]
async fn a_content_length_past_the_limit_is_answered_413_at_once() {
    let (srv, thread) = start_with(ServerLimits::default());
    let addr = srv.addr;
    let (huge, junk) = tokio::task::spawn_blocking(move || {
        let mut c = announce(addr, 10_000_000_000);
        let huge = status_within(&mut c, Duration::from_secs(5));
        let mut c = TcpStream::connect(addr).unwrap();
        c.write_all(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: lots\r\n\r\n")
            .unwrap();
        (huge, status_within(&mut c, Duration::from_secs(5)))
    })
    .await
    .unwrap();
    assert!(huge.contains(" 413 "), "Content-Length 10^10: {huge:?}");
    assert!(junk.contains(" 400 "), "Content-Length `lots`: {junk:?}");
    srv.shutdown(Duration::from_secs(1)).await.unwrap();
    thread.join().unwrap().unwrap();
}
