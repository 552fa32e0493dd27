//! The server against hostile or unlucky clients: hang-ups, slow bodies, huge bodies, bursts,
//! fields it does not implement, and `/metrics` during a long step. A long step is a stand-in:
//! the engine's `before_step` hook blocks until the test hands it a permit.

use std::io::Write;
use std::net::TcpStream;
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use candle_core::Device;
use mstar_engine::engine::{self, EngineSettings, EngineStats, GenRequest, StepHook};
use mstar_engine::model::{Config, Model};
use mstar_engine::sampling::SamplingParams;
use mstar_engine::server::{Server, ServerLimits};
use serde_json::{json, Value};

mod common;

/// Steps wait for permits: `permit()` lets one step run; dropping the gate lets every step run.
struct Gate {
    tx: Option<mpsc::Sender<()>>,
    entered: Arc<Mutex<mpsc::Receiver<u64>>>,
}

impl Gate {
    fn new() -> (Gate, StepHook) {
        let (tx, rx) = mpsc::channel::<()>();
        let (in_tx, in_rx) = mpsc::channel::<u64>();
        let rx = Mutex::new(rx);
        let in_tx = Mutex::new(in_tx);
        let hook = StepHook(Arc::new(move |step| {
            let _ = in_tx.lock().unwrap().send(step);
            // A dropped gate (an error) lets the step run.
            let _ = rx.lock().unwrap().recv();
        }));
        (
            Gate {
                tx: Some(tx),
                entered: Arc::new(Mutex::new(in_rx)),
            },
            hook,
        )
    }

    fn permit(&self, n: usize) {
        for _ in 0..n {
            let _ = self.tx.as_ref().unwrap().send(());
        }
    }

    fn open(&mut self) {
        self.tx = None;
    }
}

fn start_with(
    settings: EngineSettings,
    limits: ServerLimits,
) -> (Server, std::thread::JoinHandle<Result<(), String>>) {
    let model = Model::random(Config::tiny(), 5, &Device::Cpu).unwrap();
    let (handle, thread) = engine::start(model, settings).unwrap();
    let srv = Server::start_with(handle, "tiny", "127.0.0.1:0", limits).unwrap();
    (srv, thread)
}

fn url(srv: &Server, path: &str) -> String {
    format!("http://{}{path}", srv.addr)
}

/// The engine's stats, or `None` when it does not answer within 2 s (held at the gate).
async fn stats(srv: &Server) -> Option<EngineStats> {
    tokio::time::timeout(Duration::from_secs(2), srv.state.engine.stats())
        .await
        .ok()
        .flatten()
}

/// A plain (non-streaming) client that hangs up while its request runs: the request is
/// aborted at the engine's next turn and its reservation freed, rather than computed to the
/// end. Before, the connection stayed half-open and the 4,000-token request ran on.
#[actix_web::test]
async fn a_plain_client_that_hangs_up_is_aborted_at_the_next_turn() {
    let (mut gate, hook) = Gate::new();
    let (srv, thread) = start_with(
        EngineSettings {
            chunking: engine::Chunking::Tokens(16),
            before_step: Some(hook),
            ..EngineSettings::default()
        },
        ServerLimits::default(),
    );
    let body = json!({"prompt": vec![65; 64], "max_tokens": 4000, "ignore_eos": true}).to_string();
    let mut conn = TcpStream::connect(srv.addr).unwrap();
    write!(
        conn,
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    // Its first chunk is held mid-prefill (waited for off the runtime the server runs on).
    let entered = gate.entered.clone();
    tokio::task::spawn_blocking(move || {
        entered
            .lock()
            .unwrap()
            .recv_timeout(Duration::from_secs(30))
    })
    .await
    .unwrap()
    .expect("the step reaches the gate");
    drop(conn); // the client hangs up
                // Let up to 100 steps run: far fewer than the request's 4 prefill chunks and 4,000 tokens.
    gate.permit(100);
    let t0 = Instant::now();
    let s = loop {
        let s = stats(&srv).await;
        if let Some(s) = &s {
            if s.running == 0 && s.kv_reserved == 0 {
                break s.clone();
            }
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the hung-up request still runs: {s:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert!(s.steps < 100, "aborted within the permitted steps: {s:?}");
    assert_eq!((s.kv_used, s.prepared), (0, (0, 0)), "{s:?}");
    // Counted as a disconnect, not as a request that ran to its length.
    let text = reqwest::get(url(&srv, "/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        text.lines().any(|l| l.starts_with("engine_requests_total{")
            && l.contains("result=\"disconnected\"")
            && !l.ends_with(" 0")),
        "{text}"
    );
    gate.open();
    srv.shutdown(Duration::from_secs(1)).await.unwrap();
    thread.join().unwrap().unwrap();
}

/// `/metrics` answers during a long step (the engine held at the gate) from the values the
/// engine published; before, it waited for the engine's turn.
#[actix_web::test]
async fn metrics_answer_during_a_long_step() {
    let (mut gate, hook) = Gate::new();
    let (srv, thread) = start_with(
        EngineSettings {
            chunking: engine::Chunking::Off,
            before_step: Some(hook),
            ..EngineSettings::default()
        },
        ServerLimits::default(),
    );
    let c = reqwest::Client::new();
    let req = tokio::spawn(
        c.post(url(&srv, "/v1/completions"))
            .json(&json!({"prompt": "x".repeat(500), "max_tokens": 2, "ignore_eos": true}))
            .send(),
    );
    tokio::task::spawn_blocking({
        let entered = gate.entered.clone();
        move || {
            entered
                .lock()
                .unwrap()
                .recv_timeout(Duration::from_secs(30))
        }
    })
    .await
    .unwrap()
    .expect("the step reaches the gate");
    let r = tokio::time::timeout(Duration::from_secs(5), c.get(url(&srv, "/metrics")).send())
        .await
        .expect("/metrics answers while a step runs")
        .unwrap();
    assert_eq!(r.status(), 200);
    let text = r.text().await.unwrap();
    // The gauge is the process's, shared with the other tests' engines: its line is there, its
    // value is whatever the engines last published.
    assert!(
        text.lines()
            .any(|l| l.starts_with("engine_requests_running ")),
        "{text}"
    );
    gate.open();
    assert_eq!(req.await.unwrap().unwrap().status(), 200);
    srv.shutdown(Duration::from_secs(1)).await.unwrap();
    thread.join().unwrap().unwrap();
}

/// Reads an HTTP response's status line from a raw connection, within 10 s.
fn status_of(conn: &mut TcpStream) -> String {
    common::status_within(conn, Duration::from_secs(10))
}

/// Clients that send a body slowly are cut at the body deadline (408); with every slot of the
/// connection cap taken by them, each new client sheds the one that has waited on its client
/// longest (503, or closed before its headers were read), so `/health` is answered at once;
/// the slow clients not shed are cut at their deadline.
#[actix_web::test]
async fn slow_bodies_are_cut_at_the_deadline_and_the_oldest_are_shed_at_the_cap() {
    let (srv, thread) = start_with(
        EngineSettings::default(),
        ServerLimits {
            max_connections: 4,
            body_timeout: Duration::from_millis(500),
            ..ServerLimits::default()
        },
    );
    let addr = srv.addr;
    let t0 = Instant::now();
    // Connected and sent in order (the kernel takes them whether or not they are accepted).
    let mut conns: Vec<TcpStream> = (0..4)
        .map(|_| {
            let mut c = TcpStream::connect(addr).unwrap();
            c.write_all(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n{").unwrap();
            c
        })
        .collect();
    let slow =
        tokio::task::spawn_blocking(move || conns.iter_mut().map(status_of).collect::<Vec<_>>());
    let h = tokio::time::timeout(
        Duration::from_secs(10),
        reqwest::get(format!("http://{addr}/health")),
    )
    .await
    .expect("/health is answered")
    .unwrap();
    assert_eq!(h.status(), 200);
    let statuses = slow.await.unwrap();
    for s in &statuses {
        assert!(
            s.contains(" 408 ") || s.contains(" 503 ") || s.is_empty(),
            "a slow body is cut (408) or shed (503, or closed): {statuses:?}"
        );
    }
    // The fourth and /health each shed one (the oldest by when the two workers registered
    // them, which need not be the order of the connects: `conns.rs` tests the order); the
    // other two are cut at their deadline.
    assert_eq!(
        statuses.iter().filter(|s| s.contains(" 408 ")).count(),
        2,
        "{statuses:?}"
    );
    assert!(t0.elapsed() < Duration::from_secs(10));
    srv.shutdown(Duration::from_secs(1)).await.unwrap();
    thread.join().unwrap().unwrap();
}

/// A body past the limit sized to the model's positions is refused with 413 before it is
/// parsed; a token array longer than the context is refused naming `prompt`.
#[actix_web::test]
async fn oversized_bodies_and_prompts_are_refused() {
    let (srv, thread) = start_with(EngineSettings::default(), ServerLimits::default());
    let c = reqwest::Client::new();
    let limit = mstar_engine::api::body_limit(Config::tiny().max_positions);
    let mut huge = String::from("{\"prompt\": [");
    while huge.len() <= 16 << 20 {
        huge.push_str("65,");
    }
    huge.push_str("65]}");
    let r = c
        .post(url(&srv, "/v1/completions"))
        .header("content-type", "application/json")
        .body(huge)
        .send()
        .await;
    // The server may answer 413 and close before the client has sent everything.
    if let Ok(r) = r {
        assert_eq!(r.status(), 413);
        let v: Value = r.json().await.unwrap();
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap()
                .contains(&limit.to_string()),
            "{v}"
        );
    }
    // Deterministically: a whole body one byte past the limit, sent before the answer is read,
    // gets 413 (the client above may see its connection closed mid-send instead).
    let mut conn = TcpStream::connect(srv.addr).unwrap();
    let body = "7".repeat(limit + 1);
    write!(
        conn,
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let head = tokio::task::spawn_blocking(move || status_of(&mut conn))
        .await
        .unwrap();
    assert!(
        head.contains(" 413 "),
        "a body of {} bytes: {head}",
        limit + 1
    );
    let too_long = vec![65; Config::tiny().max_positions + 1];
    let r = c
        .post(url(&srv, "/v1/completions"))
        .json(&json!({"prompt": too_long}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["param"], "prompt", "{v}");
    // The server still serves.
    let r = c
        .post(url(&srv, "/v1/completions"))
        .json(&json!({"prompt": [65, 66], "max_tokens": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    srv.shutdown(Duration::from_secs(1)).await.unwrap();
    thread.join().unwrap().unwrap();
}

fn tiny_request(i: u64) -> GenRequest {
    GenRequest {
        prompt: vec![65; 8],
        max_tokens: 2,
        sampling: SamplingParams {
            temperature: 0.0,
            top_p: 1.0,
            seed: Some(i),
            ignore_eos: true,
            ..SamplingParams::default()
        },
    }
}

/// `--max-waiting` counts only requests blocked on memory: 16 tiny requests arriving in the
/// same turn of an idle engine with free KV all run with `max_waiting = 1`; one that would
/// wait for memory beyond the queue is refused.
#[actix_web::test]
async fn max_waiting_counts_only_requests_blocked_on_memory() {
    let (mut gate, hook) = Gate::new();
    let (srv, thread) = start_with(
        EngineSettings {
            kv_tokens: 1000,
            max_waiting: 1,
            before_step: Some(hook),
            ..EngineSettings::default()
        },
        ServerLimits::default(),
    );
    let e = srv.state.engine.clone();
    // A first request is held in its step, so the next ones reach the engine in one turn.
    let (_, first) = e.submit(tiny_request(0)).await.unwrap();
    tokio::task::spawn_blocking({
        let entered = gate.entered.clone();
        move || {
            entered
                .lock()
                .unwrap()
                .recv_timeout(Duration::from_secs(30))
        }
    })
    .await
    .unwrap()
    .expect("the first step reaches the gate");
    let burst = futures_util::future::join_all((1..=16).map(|i| {
        let e = e.clone();
        async move { e.submit(tiny_request(i)).await }
    }));
    tokio::pin!(burst);
    // Polled once: every submission is in the engine's mailbox before the step ends.
    assert!(futures_util::poll!(&mut burst).is_pending());
    gate.open();
    let answers = tokio::time::timeout(Duration::from_secs(30), burst)
        .await
        .unwrap();
    let refused: Vec<_> = answers.iter().filter_map(|a| a.as_ref().err()).collect();
    assert!(refused.is_empty(), "nothing waits for memory: {refused:?}");
    drop((first, answers));
    let t0 = Instant::now();
    while stats(&srv).await.is_none_or(|s| s.running > 0) {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the burst never ended"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    // Memory full: one request may wait, the next is refused.
    let big = |seed| GenRequest {
        prompt: vec![65; 400],
        max_tokens: 500,
        ..tiny_request(seed)
    };
    let (_, a) = e.submit(big(100)).await.unwrap(); // runs (900 of 1000)
    let (_, b) = e.submit(big(101)).await.unwrap(); // waits for memory
    let c = e.submit(big(102)).await;
    assert!(
        matches!(c, Err(engine::SubmitError::QueueFull(1))),
        "{:?}",
        c.map(|(r, _)| r)
    );
    drop((a, b));
    srv.shutdown(Duration::from_secs(1)).await.unwrap();
    thread.join().unwrap().unwrap();
}

/// `max_waiting = 0` and `kv_tokens = 0` are refused at start, naming the flag.
#[test]
fn zero_queues_and_zero_memory_are_refused_at_start() {
    for (s, flag) in [
        (
            EngineSettings {
                max_waiting: 0,
                ..EngineSettings::default()
            },
            "--max-waiting",
        ),
        (
            EngineSettings {
                kv_tokens: 0,
                ..EngineSettings::default()
            },
            "--kv-tokens",
        ),
    ] {
        let model = Model::random(Config::tiny(), 5, &Device::Cpu).unwrap();
        match engine::start(model, s) {
            Ok(_) => panic!("{flag} 0 was accepted"),
            Err(e) => assert!(e.contains(flag), "{e}"),
        }
    }
}

/// A field the server does not implement, or a value out of range, is a 400 naming it; the
/// neutral values clients send by default are accepted.
#[actix_web::test]
async fn unsupported_fields_are_refused_by_name_and_neutral_ones_accepted() {
    let (srv, thread) = start_with(EngineSettings::default(), ServerLimits::default());
    let c = reqwest::Client::new();
    let post = |body: Value| {
        let c = c.clone();
        let u = url(&srv, "/v1/completions");
        async move {
            let r = c.post(u).json(&body).send().await.unwrap();
            let status = r.status().as_u16();
            (status, r.json::<Value>().await.unwrap())
        }
    };
    for (field, value) in [
        ("n", json!(9)),
        ("stop", json!(["a", "b", "c", "d", "e"])),
        ("stop", json!("")),
        ("logprobs", json!(21)),
        ("logprobs", json!(-1)),
        ("logprobs", json!(true)),
        ("max_completion_tokens", json!(0)),
        ("tools", json!([])),
        ("response_format", json!({"type": "json_object"})),
        ("echo", json!(true)),
        ("presence_penalty", json!(2.5)),
        ("frequency_penalty", json!(-3)),
        ("best_of", json!(2)),
        ("logit_bias", json!({"65": 10})),
        ("suffix", json!("end")),
        // Only with `stream: true`.
        ("stream_options", json!({"include_usage": true})),
        ("no_such_field", json!(1)),
    ] {
        let mut body = json!({"prompt": "x", "max_tokens": 1});
        body[field] = value.clone();
        let (status, v) = post(body).await;
        assert_eq!(status, 400, "{field}: {value}: {v}");
        assert_eq!(v["error"]["param"], field, "{v}");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert!(
            v["error"]["message"].as_str().unwrap().contains(field),
            "{v}"
        );
    }
    let neutral = json!({"prompt": "x", "max_tokens": 1, "n": 1, "best_of": 1,
        "presence_penalty": 0, "frequency_penalty": 0.0, "user": "someone", "echo": false,
        "logit_bias": {}, "stop": null, "logprobs": null});
    let (status, v) = post(neutral).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 1);
    // A field twice is refused, not resolved silently.
    let r = c
        .post(url(&srv, "/v1/completions"))
        .header("content-type", "application/json")
        .body(r#"{"prompt": "x", "max_tokens": 1, "max_tokens": 9}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    srv.shutdown(Duration::from_secs(1)).await.unwrap();
    thread.join().unwrap().unwrap();
}
