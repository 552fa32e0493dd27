//! The server beside crowds of idle, slow and lying clients: a live client is answered at once
//! however many idle connections are open and however slowly others send their bodies; a body
//! must arrive within its deadline however it trickles; an idle connection is closed after the
//! header timeout; a `Content-Length` past the body limit is answered 413 before any body;
//! short of descriptors, the oldest slow clients are shed so that a live client is answered.
//!
//! The server runs on the test's runtime, so every client here runs in a blocking task; the
//! one with a descriptor limit of its own runs the binary.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
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

/// A child process killed when dropped (a failed assertion leaves no server behind).
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `mstar-engine serve` on the tiny model with `RLIMIT_NOFILE` at `descriptors` (soft and
/// hard, so the server cannot raise it), its body deadline `body_timeout`; answers the child
/// and its address.
fn serve_with_descriptors(descriptors: u64, body_timeout: Duration) -> (Killed, SocketAddr) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_mstar-engine"));
    cmd.args(["serve", "--model", "tiny", "--listen", "127.0.0.1:0"])
        .arg("--body-timeout-secs")
        .arg(body_timeout.as_secs_f64().to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    // SAFETY: between fork and exec the closure calls only setrlimit, which is
    // async-signal-safe, and allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            let r = libc::rlimit {
                rlim_cur: descriptors as libc::rlim_t,
                rlim_max: descriptors as libc::rlim_t,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &r) == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        });
    }
    let mut child = Killed(cmd.spawn().unwrap());
    let mut line = String::new();
    BufReader::new(child.0.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line
        .split("http://")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("no address in {line:?}"));
    (child, addr)
}

/// What a connection got within `wait`: `Some` of its status line, or of `""` when it was
/// closed without an answer; `None` when it is still open with nothing to read.
fn answer_within(conn: &mut TcpStream, wait: Duration) -> Option<String> {
    conn.set_read_timeout(Some(wait)).unwrap();
    let mut buf = [0u8; 512];
    match conn.read(&mut buf) {
        Ok(n) => Some(
            String::from_utf8_lossy(&buf[..n])
                .lines()
                .next()
                .unwrap_or("")
                .to_owned(),
        ),
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) =>
        {
            None
        }
        Err(_) => Some(String::new()),
    }
}

/// Short of descriptors (`RLIMIT_NOFILE` 128: a cap of 64 connections), 200 clients that send
/// their headers and then a body byte a second do not hold a live client in the listen queue
/// for their deadlines (it waited 32 s behind three rounds of 10 s): each connection that fills
/// the cap sheds the one waiting on its client longest, so `/health` is answered within the
/// body deadline. The oldest slow clients are the ones shed (503, or closed), the newest are
/// still connected, and the sheds are counted.
#[test]
fn short_of_descriptors_the_oldest_slow_clients_are_shed_for_a_live_one() {
    const SLOW: usize = 200;
    const BODY_TIMEOUT: Duration = Duration::from_secs(10);
    let limit = raise_descriptor_limit().expect("the descriptor limit is readable");
    assert!(
        limit >= 2 * SLOW as u64 + 256,
        "RLIMIT_NOFILE's hard limit is {limit}: too few for this test's clients"
    );
    let (_server, addr) = serve_with_descriptors(128, BODY_TIMEOUT);
    let t0 = Instant::now();
    let mut slow: Vec<TcpStream> = (0..SLOW).map(|_| announce(addr, 1_000)).collect();
    // A body byte a second on each, for at most 20 s (the test ends well before).
    let stop = Arc::new(AtomicBool::new(false));
    let mut writers: Vec<TcpStream> = slow.iter().map(|c| c.try_clone().unwrap()).collect();
    let trickle = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            for i in 0..200 {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                if i % 10 == 0 {
                    for c in &mut writers {
                        let _ = c.write_all(if i == 0 { b"{" } else { b" " });
                    }
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        })
    };
    let took = {
        let t = Instant::now();
        let mut c = TcpStream::connect(addr).unwrap();
        c.write_all(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            .unwrap();
        let status = status_within(&mut c, BODY_TIMEOUT);
        assert!(
            status.contains(" 200 "),
            "/health answered {status:?} after {:?}, behind {SLOW} slow clients",
            t.elapsed()
        );
        t.elapsed()
    };
    assert!(took < BODY_TIMEOUT, "/health answered after {took:?}");
    // The newest are still connected, unanswered (their deadline has not come).
    for (i, c) in slow.iter_mut().enumerate().skip(SLOW - 32) {
        assert_eq!(
            answer_within(c, Duration::from_millis(10)),
            None,
            "slow client {i} of {SLOW} (the newest are kept)"
        );
    }
    // The oldest were shed: 503, or closed before their headers were read.
    for (i, c) in slow.iter_mut().enumerate().take(100) {
        let got = answer_within(c, Duration::from_secs(2));
        assert!(
            got.as_deref()
                .is_some_and(|s| s.is_empty() || s.contains(" 503 ")),
            "slow client {i} of {SLOW}: {got:?}"
        );
    }
    assert!(
        t0.elapsed() < BODY_TIMEOUT,
        "the checks ran before any deadline"
    );
    let mut m = TcpStream::connect(addr).unwrap();
    m.write_all(b"GET /metrics HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        .unwrap();
    m.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut text = String::new();
    let _ = m.read_to_string(&mut text);
    let shed: f64 = text
        .lines()
        .find_map(|l| l.strip_prefix("engine_connections_shed_total "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no shed count in /metrics: {text}"));
    assert!(
        shed >= (SLOW + 1 - 64) as f64,
        "{shed} connections shed to let /health in"
    );
    stop.store(true, Ordering::Relaxed);
    trickle.join().unwrap();
}
