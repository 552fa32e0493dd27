//! Helpers the HTTP tests share: servers on the tiny model and on SmolLM2, and readers of
//! their answers.

#![allow(dead_code)] // each test file uses some of them

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use candle_core::Device;
use mstar_engine::engine::{self, EngineSettings, EngineStats};
use mstar_engine::model::gguf::{self, WeightFormat};
use mstar_engine::model::{Config, Model};
use mstar_engine::server::Server;
use serde_json::Value;

/// The tiny random model served under the name `tiny`, with `settings`.
pub fn start(settings: EngineSettings) -> (Server, std::thread::JoinHandle<Result<(), String>>) {
    let model = Model::random(Config::tiny(), 5, &Device::Cpu).unwrap();
    let (handle, thread) = engine::start(model, settings).unwrap();
    let srv = Server::start(handle, "tiny", "127.0.0.1:0").unwrap();
    (srv, thread)
}

pub fn url(srv: &Server, path: &str) -> String {
    format!("http://{}{path}", srv.addr)
}

/// SmolLM2-135M-Instruct from the cache `make model` fills (a missing file fails).
pub fn smollm2(format: WeightFormat) -> Model {
    let path = gguf::smollm2_path().unwrap_or_else(|e| panic!("{e}"));
    gguf::load(&path, &Device::Cpu, format).unwrap_or_else(|e| panic!("{e}"))
}

/// The name the shared SmolLM2 server serves.
pub const SMOLLM2: &str = "SmolLM2-135M-Instruct";

/// The address of one SmolLM2 server (the default weight format, token budget 64) shared by
/// every test of a file: the model loads once. It runs on a thread of its own until the test
/// process ends.
pub fn smollm2_server() -> &'static str {
    static ADDR: OnceLock<String> = OnceLock::new();
    ADDR.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let model = smollm2(gguf::DEFAULT_FORMAT);
            let (handle, _engine) = engine::start(
                model,
                EngineSettings {
                    chunking: engine::Chunking::Tokens(64),
                    ..EngineSettings::default()
                },
            )
            .unwrap();
            actix_web::rt::System::new().block_on(async move {
                let srv = Server::start(handle, SMOLLM2, "127.0.0.1:0").unwrap();
                tx.send(format!("http://{}", srv.addr)).unwrap();
                std::future::pending::<()>().await;
            });
        });
        rx.recv()
            .expect("the SmolLM2 server started (its thread's panic is above)")
    })
}

/// Posts `body` to `path` of the server at `base`; answers the status and the JSON body.
pub async fn post(base: &str, path: &str, body: &Value) -> (u16, Value) {
    let r = reqwest::Client::new()
        .post(format!("{base}{path}"))
        .json(body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap())
}

/// Posts a streaming request; answers the status and the SSE events read whole.
pub async fn post_sse(base: &str, path: &str, body: &Value) -> (u16, Vec<Value>, bool) {
    let r = reqwest::Client::new()
        .post(format!("{base}{path}"))
        .json(body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let (events, done) = read_sse(r).await;
    (status, events, done)
}

/// Reads an SSE response whole: the JSON events and whether it ended with `data: [DONE]`.
pub async fn read_sse(resp: reqwest::Response) -> (Vec<Value>, bool) {
    let body = resp.text().await.unwrap();
    let mut events = Vec::new();
    let mut done = false;
    for block in body.split("\n\n").filter(|b| !b.is_empty()) {
        let data = block.strip_prefix("data: ").expect("an SSE data line");
        assert!(!done, "nothing after [DONE]");
        if data == "[DONE]" {
            done = true;
        } else {
            events.push(serde_json::from_str(data).unwrap());
        }
    }
    (events, done)
}

/// Waits (bounded) until the engine and the component hold nothing.
pub async fn wait_idle(srv: &Server) -> EngineStats {
    let t0 = Instant::now();
    loop {
        let s = srv.state.engine.stats().await.unwrap();
        let idle = s.running == 0
            && s.waiting == 0
            && s.kv_used == 0
            && s.kv_reserved == 0
            && s.prepared == (0, 0)
            && s.prefill_rows == 0
            && s.continuing_rows == 0;
        if idle || t0.elapsed() > Duration::from_secs(60) {
            return s;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

pub fn idle_stats(s: &EngineStats) {
    assert_eq!(
        (
            s.running,
            s.waiting,
            s.kv_used,
            s.kv_reserved,
            s.prepared,
            s.prefill_rows,
            s.continuing_rows
        ),
        (0, 0, 0, 0, (0, 0), 0, 0),
        "everything released: {s:?}"
    );
}

/// Reads a response's status line from a raw connection within `wait` ("" on EOF or timeout).
pub fn status_within(conn: &mut std::net::TcpStream, wait: Duration) -> String {
    use std::io::Read;
    conn.set_read_timeout(Some(wait)).unwrap();
    let mut buf = [0u8; 512];
    let n = conn.read(&mut buf).unwrap_or(0);
    String::from_utf8_lossy(&buf[..n])
        .lines()
        .next()
        .unwrap_or("")
        .to_owned()
}
