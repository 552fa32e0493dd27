//! The metrics endpoint and signals against the binary: `replay --hold` stops on
//! SIGTERM, `/metrics` answers only GET (and HEAD) on `/metrics` and `/`, and idle clients can
//! neither exhaust the replay's file descriptors nor flood its log.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use crate::helpers::{repo_root, Watchdog};

const BIN: &str = env!("CARGO_BIN_EXE_mstar-chunking");

fn free_addr() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free local port")
}

fn kill(child: &Child, signal: &str) {
    let ok = Command::new("kill")
        .args([signal, &child.id().to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill {signal}");
}

/// One HTTP/1.0 request; the status and body of the answer.
fn request(addr: SocketAddr, method: &str, path: &str) -> (u16, String) {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(s, "{method} {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status in {head:?}"));
    (status, body.to_owned())
}

/// Reads `child`'s stderr until a line contains `marker` (asserting it comes), then keeps
/// draining it on a thread; returns a channel that yields everything read after the marker.
fn wait_for(child: &mut Child, marker: &str) -> mpsc::Receiver<String> {
    let mut reader = BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    let mut seen = false;
    for _ in 0..200 {
        line.clear();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            break;
        }
        if line.contains(marker) {
            seen = true;
            break;
        }
    }
    assert!(seen, "`{marker}` never came on stderr");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        // Bounded: a flood of log lines is counted but only its first 1 MB kept.
        let mut rest = String::new();
        let mut buf = [0u8; 65536];
        let mut total = 0usize;
        while let Ok(n) = reader.read(&mut buf) {
            if n == 0 {
                break;
            }
            total += n;
            if rest.len() < 1 << 20 {
                rest.push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        }
        let _ = tx.send(format!("{total} bytes\n{rest}"));
    });
    rx
}

#[test]
fn a_holding_replay_stops_on_sigterm_and_the_endpoint_answers_only_get_on_metrics() {
    let addr = free_addr();
    let addr_s = addr.to_string();
    let mut child = Command::new(BIN)
        .args([
            "replay",
            "--requests",
            "20",
            "--no-progress",
            "--hold",
            "--metrics-listen",
            &addr_s,
        ])
        .current_dir(repo_root())
        .env_clear()
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let _dog = Watchdog::new(child.id(), 120);
    let rest = wait_for(&mut child, "holding");

    let (status, body) = request(addr, "GET", "/metrics");
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("mstar_chunking_steps_total"), "{body}");
    assert_eq!(request(addr, "GET", "/").0, 200);
    assert_eq!(request(addr, "HEAD", "/metrics"), (200, String::new()));
    for (method, path, want) in [
        ("POST", "/metrics", 405),
        ("DELETE", "/", 405),
        ("GET", "/favicon.ico", 404),
        ("GET", "/metrics/../x", 404),
    ] {
        let (status, body) = request(addr, method, path);
        assert_eq!(status, want, "{method} {path}: {body}");
    }

    kill(&child, "-TERM");
    let code = child.wait().unwrap().code();
    assert_eq!(code, Some(0), "SIGTERM must end a hold");
    let rest = rest.recv_timeout(Duration::from_secs(10)).unwrap();
    assert!(rest.contains("SIGTERM: stopped holding"), "{rest}");
}

/// A Mooncake trace of `n` requests that each generate 2^20 tokens: a replay that runs until
/// stopped.
fn endless_trace(path: &Path, n: usize) {
    let mut f = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    for i in 0..n {
        writeln!(
            f,
            "{{\"timestamp\": {i}, \"input_length\": 100, \"output_length\": 1048576, \"hash_ids\": [{i}]}}"
        )
        .unwrap();
    }
    f.flush().unwrap();
}

#[test]
fn idle_clients_cannot_starve_the_replay_of_descriptors_or_flood_its_log() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("endless.jsonl");
    endless_trace(&trace, 2000);
    let report = dir.path().join("report.json");
    let addr = free_addr();
    let addr_s = addr.to_string();
    // 256 descriptors, as a tight container gives; the clients below hold 300 connections.
    let mut child = Command::new("sh")
        .args(["-c", "ulimit -n 256 && exec \"$0\" \"$@\"", BIN])
        .args([
            "replay",
            "--trace",
            trace.to_str().unwrap(),
            "--no-progress",
            "--metrics-listen",
            &addr_s,
            "--report-json",
            report.to_str().unwrap(),
        ])
        .current_dir(repo_root())
        .env_clear()
        .env("RUST_LOG", "warn,mstar_chunking_sim::replay=debug")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let _dog = Watchdog::new(child.id(), 120);
    let rest = wait_for(&mut child, "replay started");

    // 300 clients connect and send nothing (10 threads of 30; a connection the server's queue
    // cannot take yet is given up after a second).
    let clients: Vec<_> = (0..10)
        .map(|_| {
            std::thread::spawn(move || {
                (0..30)
                    .filter_map(|_| TcpStream::connect_timeout(&addr, Duration::from_secs(1)).ok())
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let idle: Vec<TcpStream> = clients
        .into_iter()
        .flat_map(|h| h.join().unwrap())
        .collect();
    assert!(idle.len() >= 256, "only {} clients connected", idle.len());
    // Lets the server accept what it will (an unbounded one runs out of descriptors now).
    std::thread::sleep(Duration::from_secs(2));

    kill(&child, "-TERM");
    let mut stdout = String::new();
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut stdout)
        .unwrap();
    let code = child.wait().unwrap().code();
    let rest = rest.recv_timeout(Duration::from_secs(30)).unwrap();
    drop(idle);
    let logged: usize = rest
        .lines()
        .next()
        .and_then(|l| l.strip_suffix(" bytes"))
        .and_then(|n| n.parse().ok())
        .unwrap();
    assert!(logged < 64 * 1024, "{logged} bytes logged:\n{rest:.2000}");
    assert_eq!(code, Some(143), "{rest:.2000}\n{stdout}");
    let rep: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    assert_eq!(rep["interrupted"], "SIGTERM");
    assert!(stdout.contains("interrupted"), "{stdout}");
}
