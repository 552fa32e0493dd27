//! The HTTP API end to end with the tiny model and an HTTP client crate (reqwest).

use std::time::{Duration, Instant};

use futures_util::StreamExt;
use mstar_chunking::DrainReport;
use mstar_engine::engine::{self, EngineSettings};
use mstar_engine::server::Server;
use serde_json::{json, Value};

mod common;
use common::{idle_stats, read_sse, start, url, wait_idle};

#[actix_web::test]
async fn streaming_completion_end_to_end() {
    let (srv, thread) = start(EngineSettings {
        chunking: engine::Chunking::Tokens(32),
        ..EngineSettings::default()
    });
    let c = reqwest::Client::new();
    let body = json!({"model": "tiny", "prompt": "Hello, chunked world! ".repeat(5), "max_tokens": 20,
                      "temperature": 0, "stream": true, "ignore_eos": true});
    let resp = c
        .post(url(&srv, "/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    let (events, done) = read_sse(resp).await;
    assert!(done, "the stream ends with data: [DONE]");
    assert_eq!(events.len(), 21, "20 token events and the final one");
    for e in &events[..20] {
        assert_eq!(e["object"], "text_completion");
        assert_eq!(e["choices"][0]["finish_reason"], Value::Null);
    }
    let last = &events[20];
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    let prompt_tokens = 1 + 22 * 5;
    assert_eq!(
        last["usage"],
        json!({"prompt_tokens": prompt_tokens, "completion_tokens": 20, "total_tokens": prompt_tokens + 20})
    );
    let streamed: String = events
        .iter()
        .map(|e| e["choices"][0]["text"].as_str().unwrap())
        .collect();

    // The same request unstreamed: the same greedy text and usage.
    let mut plain = body.clone();
    plain["stream"] = json!(false);
    let v: Value = c
        .post(url(&srv, "/v1/completions"))
        .json(&plain)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["choices"][0]["text"].as_str().unwrap(), streamed);
    assert_eq!(v["usage"]["completion_tokens"], 20);
    assert_eq!(v["choices"][0]["finish_reason"], "length");

    // Token ids as the prompt, and seeded sampling repeats itself.
    let sampled = json!({"prompt": [256, 72, 105], "max_tokens": 12, "temperature": 1.0, "top_p": 0.9, "seed": 42, "ignore_eos": true});
    let a: Value = c
        .post(url(&srv, "/v1/completions"))
        .json(&sampled)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let b: Value = c
        .post(url(&srv, "/v1/completions"))
        .json(&sampled)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(a["choices"][0]["text"], b["choices"][0]["text"]);
    assert_eq!(a["usage"]["prompt_tokens"], 3);

    // models, health, metrics.
    let m: Value = c
        .get(url(&srv, "/v1/models"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(m["data"][0]["id"], "tiny");
    let h = c.get(url(&srv, "/health")).send().await.unwrap();
    assert_eq!(h.status(), 200);
    let text = c
        .get(url(&srv, "/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for name in [
        "engine_ttft_seconds_bucket",
        "engine_tbt_seconds_bucket",
        "engine_e2e_seconds_bucket",
        "engine_requests_running",
        "engine_requests_waiting",
        "engine_kv_tokens_used",
        "steps_total",
        "chunks_total",
    ] {
        assert!(text.contains(name), "/metrics has {name}:\n{text}");
    }
    idle_stats(&wait_idle(&srv).await);
    srv.shutdown(Duration::from_secs(1)).await.unwrap();
    thread.join().unwrap().unwrap();
}

#[actix_web::test]
async fn bad_requests_get_the_openai_error_object() {
    let (srv, thread) = start(EngineSettings {
        kv_tokens: 1000,
        ..EngineSettings::default()
    });
    let c = reqwest::Client::new();
    let cases: Vec<(Value, &str, &str)> = vec![
        (json!({"prompt": [1, 999]}), "prompt", "prompt[1]"),
        (
            json!({"prompt": "x", "temperature": 5}),
            "temperature",
            "temperature",
        ),
        (json!({"prompt": "x", "top_p": 0}), "top_p", "top_p"),
        (
            json!({"prompt": "x", "max_tokens": 0}),
            "max_tokens",
            "at least 1",
        ),
        (json!({"prompt": 17}), "prompt", "string or an array"),
        (
            json!({"prompt": "x", "max_tokens": 2000}),
            "max_tokens",
            "KV capacity",
        ),
        (
            json!({"prompt": "x", "max_tokens": 5000}),
            "max_tokens",
            "context of 4096",
        ),
        (
            json!({"prompt": "x", "max_completion_tokens": 5000}),
            "max_completion_tokens",
            "context of 4096",
        ),
    ];
    for (body, param, says) in cases {
        let r = c
            .post(url(&srv, "/v1/completions"))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400, "{body}");
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["error"]["type"], "invalid_request_error", "{body}");
        assert_eq!(v["error"]["param"], param, "{body}");
        assert!(
            v["error"]["message"].as_str().unwrap().contains(says),
            "{body}: {v}"
        );
    }
    // Not JSON, and JSON without a prompt.
    for raw in ["{not json", "{\"max_tokens\": 3}"] {
        let r = c
            .post(url(&srv, "/v1/completions"))
            .header("content-type", "application/json")
            .body(raw)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400, "{raw}");
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["error"]["type"], "invalid_request_error");
    }
    srv.shutdown(Duration::from_secs(1)).await.unwrap();
    thread.join().unwrap().unwrap();
}

/// A request waits for KV memory instead of failing; past `max_waiting` the queue answers 503.
#[actix_web::test]
async fn memory_waits_and_a_full_queue_is_503() {
    let (srv, thread) = start(EngineSettings {
        kv_tokens: 3000,
        max_waiting: 1,
        ..EngineSettings::default()
    });
    let c = reqwest::Client::new();
    // A holds 1000 + 2000 of the 3000 tokens while it streams.
    let a = c
        .post(url(&srv, "/v1/completions"))
        .json(&json!({"prompt": vec![65; 1000], "max_tokens": 2000, "stream": true, "ignore_eos": true, "temperature": 0}))
        .send()
        .await
        .unwrap();
    let mut a_stream = a.bytes_stream();
    a_stream.next().await.unwrap().unwrap(); // A runs.
                                             // B needs 500: it waits for memory.
    let c2 = c.clone();
    let b_url = url(&srv, "/v1/completions");
    let b = tokio::spawn(async move {
        c2.post(b_url)
            .json(&json!({"prompt": vec![66; 400], "max_tokens": 100, "ignore_eos": true}))
            .send()
            .await
            .unwrap()
    });
    let t0 = Instant::now();
    while srv.state.engine.stats().await.unwrap().waiting != 1 {
        assert!(t0.elapsed() < Duration::from_secs(30), "B never queued");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let s = srv.state.engine.stats().await.unwrap();
    assert!(s.kv_reserved == 3000 && s.kv_used <= 3000, "{s:?}");
    // C: the queue is full.
    let r = c
        .post(url(&srv, "/v1/completions"))
        .json(&json!({"prompt": "c", "max_tokens": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 503);
    let v: Value = r.json().await.unwrap();
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("queue is full"),
        "{v}"
    );
    // A's client goes away: A is aborted, its memory released, and B runs to the end.
    drop(a_stream);
    let b = b.await.unwrap();
    assert_eq!(b.status(), 200);
    let v: Value = b.json().await.unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 100);
    idle_stats(&wait_idle(&srv).await);
    srv.shutdown(Duration::from_secs(1)).await.unwrap();
    thread.join().unwrap().unwrap();
}

/// 64 concurrent streaming clients, every fourth disconnecting mid-stream: everything is
/// released (prepared inputs 0, KV use 0, no row queued), and the others complete.
#[actix_web::test]
async fn sixty_four_streaming_clients_some_disconnecting() {
    let (srv, thread) = start(EngineSettings {
        chunking: engine::Chunking::Tokens(64),
        kv_tokens: 20_000,
        ..EngineSettings::default()
    });
    let c = reqwest::Client::new();
    let mut tasks = Vec::new();
    for i in 0..64u32 {
        let c = c.clone();
        let u = url(&srv, "/v1/completions");
        tasks.push(tokio::spawn(async move {
            let prompt_len = 20 + (i * 37) % 300;
            let body = json!({"prompt": vec![97 + (i % 26); prompt_len as usize], "max_tokens": 24,
                              "stream": true, "ignore_eos": true, "seed": i});
            let resp = c.post(u).json(&body).send().await.unwrap();
            assert_eq!(resp.status(), 200);
            let mut s = resp.bytes_stream();
            let mut seen = Vec::new();
            while let Some(chunk) = s.next().await {
                seen.extend_from_slice(&chunk.unwrap());
                let events = seen.windows(2).filter(|w| w == b"\n\n").count();
                if i % 4 == 0 && events >= 3 {
                    return false; // disconnect mid-stream
                }
            }
            let text = String::from_utf8(seen).unwrap();
            assert!(text.ends_with("data: [DONE]\n\n"));
            assert!(text.contains("\"completion_tokens\":24"));
            true
        }));
    }
    let t0 = Instant::now();
    let results = tokio::time::timeout(
        Duration::from_secs(120),
        futures_util::future::join_all(tasks),
    )
    .await
    .expect("the 64 clients finish in bounded time");
    let completed = results
        .into_iter()
        .map(|r| r.unwrap())
        .filter(|&c| c)
        .count();
    assert_eq!(completed, 48);
    let s = wait_idle(&srv).await;
    idle_stats(&s);
    assert_eq!(s.steps_in_flight, 0);
    assert!(t0.elapsed() < Duration::from_secs(120));
    srv.shutdown(Duration::from_secs(1)).await.unwrap();
    thread.join().unwrap().unwrap();
}

/// Starts a streaming request of 4,000 tokens and gives it 100 ms to start running; answers
/// the task reading its stream whole.
async fn long_stream(
    c: &reqwest::Client,
    srv: &Server,
) -> tokio::task::JoinHandle<(Vec<Value>, bool)> {
    let resp = c
        .post(url(srv, "/v1/completions"))
        .json(&json!({"prompt": "long", "max_tokens": 4000, "stream": true, "ignore_eos": true}))
        .send()
        .await
        .unwrap();
    let reader = tokio::spawn(read_sse(resp));
    tokio::time::sleep(Duration::from_millis(100)).await;
    reader
}

/// Shutdown: admission stops (503), a running request gets the grace period and is then
/// aborted, its stream ending with `finish_reason: "abort"` and `[DONE]`.
#[actix_web::test]
async fn shutdown_aborts_after_the_grace_period() {
    let (srv, thread) = start(EngineSettings::default());
    let c = reqwest::Client::new();
    let reader = long_stream(&c, &srv).await;
    let state = srv.state.clone();
    let addr = srv.addr;
    let stop = tokio::spawn(srv.shutdown(Duration::from_millis(300)));
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(state.draining.load(std::sync::atomic::Ordering::Relaxed));
    let r = c
        .post(format!("http://{addr}/v1/completions"))
        .json(&json!({"prompt": "late"}))
        .send()
        .await;
    if let Ok(r) = r {
        assert_eq!(r.status(), 503);
    }
    let (events, done) = reader.await.unwrap();
    assert!(done);
    let last = events.last().unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "abort");
    let n = last["usage"]["completion_tokens"].as_u64().unwrap();
    assert!(n > 0 && n < 4000, "{n}");
    stop.await.unwrap().unwrap();
    thread.join().unwrap().unwrap();
}

/// Draining the engine drains the component after it: every request was finished or aborted and
/// forgotten first, so the component's report is all zeros.
#[tokio::test]
async fn draining_the_engine_drains_the_component_leaving_nothing_held() {
    let (srv, thread) = start(EngineSettings::default());
    let reader = long_stream(&reqwest::Client::new(), &srv).await;
    let engine = srv.state.engine.clone();
    let report = engine.drain(Duration::from_millis(100)).await;
    assert_eq!(report, Some(DrainReport::default()));
    let (_, done) = reader.await.unwrap();
    assert!(done, "the aborted stream ends with [DONE]");
    // The engine has stopped: a second drain has nothing to answer.
    assert_eq!(engine.drain(Duration::ZERO).await, None);
    srv.shutdown(Duration::ZERO).await.unwrap();
    thread.join().unwrap().unwrap();
}

/// The binary: `serve` prints its address, answers, and exits 0 on SIGTERM.
#[test]
fn binary_exits_zero_on_sigterm() {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};
    let mut child = Command::new(env!("CARGO_BIN_EXE_mstar-engine"))
        .args([
            "serve",
            "--model",
            "tiny",
            "--listen",
            "127.0.0.1:0",
            "--grace-secs",
            "1",
        ])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line
        .split("http://")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .unwrap_or_else(|| panic!("no address in {line:?}"))
        .to_owned();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let v: Value = reqwest::get(format!("http://{addr}/health"))
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(v["status"], "ok");
    });
    let killed = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let t0 = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            assert!(status.success(), "exit status {status:?}");
            break;
        }
        if t0.elapsed() > Duration::from_secs(30) {
            child.kill().unwrap();
            panic!("no exit within 30 s of SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Streamed text holds back an incomplete UTF-8 sequence until its last byte arrives.
#[test]
fn utf8_stream_holds_back_incomplete_sequences() {
    use mstar_engine::server::Utf8Stream;
    let mut u = Utf8Stream::default();
    let b = "é😀".as_bytes();
    assert_eq!(u.push(u32::from(b[0])), "");
    assert_eq!(u.push(u32::from(b[1])), "é");
    assert_eq!(u.push(u32::from(b[2])), "");
    assert_eq!(u.push(u32::from(b[3])), "");
    assert_eq!(u.push(u32::from(b[4])), "");
    assert_eq!(u.push(u32::from(b[5])), "😀");
    assert_eq!(u.push(257), "", "EOS has no text");
    assert_eq!(u.push(0xff), "\u{FFFD}", "an invalid byte");
    assert_eq!(u.push(0xe2), "");
    assert_eq!(u.finish(), "\u{FFFD}", "an incomplete sequence at the end");
}
