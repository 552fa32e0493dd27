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
    // vLLM's model card: its load generator reads `root`.
    assert_eq!(m["data"][0]["root"], "tiny");
    assert_eq!(m["data"][0]["parent"], Value::Null);
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

/// Without `seed`, each request samples differently (a fresh seed each); with the same seed,
/// the same text.
#[actix_web::test]
async fn without_a_seed_each_request_samples_differently() {
    let (srv, thread) = start(EngineSettings::default());
    let base = format!("http://{}", srv.addr);
    let body = json!({"prompt": "Once", "max_tokens": 12, "temperature": 1.0, "ignore_eos": true});
    let mut texts = Vec::new();
    for _ in 0..3 {
        let (status, v) = common::post(&base, "/v1/completions", &body).await;
        assert_eq!(status, 200, "{v}");
        texts.push(v["choices"][0]["text"].as_str().unwrap().to_owned());
    }
    assert!(
        texts[0] != texts[1] && texts[1] != texts[2] && texts[0] != texts[2],
        "{texts:?}"
    );
    let mut seeded = body.clone();
    seeded["seed"] = json!(7);
    let (_, a) = common::post(&base, "/v1/completions", &seeded).await;
    let (_, b) = common::post(&base, "/v1/completions", &seeded).await;
    assert_eq!(a["choices"][0]["text"], b["choices"][0]["text"]);
    srv.shutdown(Duration::from_secs(1)).await.unwrap();
    thread.join().unwrap().unwrap();
}

/// `seed` is any int64 on both endpoints; a whole number outside (2^63, 2^64 - 1, 2^64) is a
/// 400 naming `seed`, never wrapped onto another seed (2^63 drew as -2^63 did).
#[actix_web::test]
async fn seeds_outside_int64_are_refused_naming_seed() {
    let (srv, thread) = start(EngineSettings::default());
    let base = format!("http://{}", srv.addr);
    let c = reqwest::Client::new();
    for path in ["/v1/completions", "/v1/chat/completions"] {
        let body = |seed: &str| {
            let head = if path == "/v1/completions" {
                r#""prompt": "Once""#
            } else {
                r#""messages": [{"role": "user", "content": "Once"}]"#
            };
            format!(r#"{{{head}, "max_tokens": 4, "temperature": 1.0, "seed": {seed}}}"#)
        };
        for seed in [
            "9223372036854775808",
            "18446744073709551615",
            "18446744073709551616",
            "-9223372036854775809",
        ] {
            let r = c
                .post(format!("{base}{path}"))
                .header("content-type", "application/json")
                .body(body(seed))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 400, "{path} seed {seed}");
            let v: Value = r.json().await.unwrap();
            assert_eq!(v["error"]["param"], "seed", "{path} seed {seed}: {v}");
            assert!(
                v["error"]["message"].as_str().unwrap().contains("int64"),
                "{path} seed {seed}: {v}"
            );
        }
        for seed in ["9223372036854775807", "-9223372036854775808", "0", "-1"] {
            let r = c
                .post(format!("{base}{path}"))
                .header("content-type", "application/json")
                .body(body(seed))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200, "{path} seed {seed}");
        }
    }
    srv.shutdown(Duration::from_secs(1)).await.unwrap();
    thread.join().unwrap().unwrap();
}

/// Completions' `logprobs` and chats' `top_logprobs` go up to 20 alternatives (vLLM's default
/// `--max-logprobs`), each given; 21 is a 400 naming the field.
#[actix_web::test]
async fn logprobs_go_up_to_20_alternatives() {
    let (srv, thread) = start(EngineSettings::default());
    let base = format!("http://{}", srv.addr);
    let prompt = json!({"prompt": "Once", "max_tokens": 3, "temperature": 0, "ignore_eos": true});
    let chat = json!({"messages": [{"role": "user", "content": "Once"}], "max_tokens": 3,
                      "temperature": 0, "ignore_eos": true, "logprobs": true});
    for n in [6, 20] {
        let mut body = prompt.clone();
        body["logprobs"] = json!(n);
        let (status, v) = common::post(&base, "/v1/completions", &body).await;
        assert_eq!(status, 200, "logprobs {n}: {v}");
        let lp = &v["choices"][0]["logprobs"];
        assert_eq!(lp["token_logprobs"].as_array().unwrap().len(), 3, "{v}");
        for top in lp["top_logprobs"].as_array().unwrap() {
            // Keyed by text: alternatives whose text is the same share a key.
            let k = top.as_object().unwrap().len();
            assert!((1..=n).contains(&k), "logprobs {n}: {k} alternatives: {v}");
        }
        let mut body = chat.clone();
        body["top_logprobs"] = json!(n);
        let (status, v) = common::post(&base, "/v1/chat/completions", &body).await;
        assert_eq!(status, 200, "top_logprobs {n}: {v}");
        let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
        assert!(!content.is_empty(), "{v}");
        for c in content {
            assert_eq!(c["top_logprobs"].as_array().unwrap().len(), n, "{v}");
        }
    }
    let mut body = prompt.clone();
    body["logprobs"] = json!(21);
    let (status, v) = common::post(&base, "/v1/completions", &body).await;
    assert_eq!(
        (status, &v["error"]["param"]),
        (400, &json!("logprobs")),
        "{v}"
    );
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("at most 20"),
        "{v}"
    );
    let mut body = chat.clone();
    body["top_logprobs"] = json!(21);
    let (status, v) = common::post(&base, "/v1/chat/completions", &body).await;
    assert_eq!(
        (status, &v["error"]["param"]),
        (400, &json!("top_logprobs")),
        "{v}"
    );
    srv.shutdown(Duration::from_secs(1)).await.unwrap();
    thread.join().unwrap().unwrap();
}

/// Stop text is cut on whole characters and held back while it may begin a stop string.
#[test]
fn stop_text_holds_back_what_may_begin_a_stop_string() {
    use mstar_engine::server::StopText;
    let mut s = StopText::new(vec!["END".into(), "éé!".into()]);
    assert_eq!(s.push("abc E"), ("abc ".into(), false), "`E` may begin END");
    assert_eq!(s.push("N"), (String::new(), false));
    assert_eq!(s.push("x"), ("ENx".into(), false), "`ENx` does not");
    assert_eq!(s.push("ééé"), ("é".into(), false), "`éé` may begin `éé!`");
    assert_eq!(
        s.push("!tail"),
        (String::new(), true),
        "found: nothing after it"
    );
    assert_eq!(s.push("more"), (String::new(), true));
    // The earliest of several stop strings wins; text held at the end is returned.
    let mut s = StopText::new(vec!["bc".into(), "ab".into()]);
    assert_eq!(s.push("xabc"), ("x".into(), true));
    let mut s = StopText::new(vec!["END".into()]);
    assert_eq!(s.push("the EN"), ("the ".into(), false));
    assert_eq!(s.finish(), "EN");
}

/// A stop string ends the request in the engine too: its memory is freed, it is counted
/// `result="stop"`, and the text before the stop string (whole characters only) is returned.
#[actix_web::test]
async fn a_stop_string_ends_the_request_in_the_engine() {
    let (srv, thread) = start(EngineSettings::default());
    let base = format!("http://{}", srv.addr);
    // Greedy text of the tiny model, then the same request stopped inside it.
    let body =
        json!({"prompt": "stop here", "max_tokens": 40, "temperature": 0, "ignore_eos": true});
    let (_, v) = common::post(&base, "/v1/completions", &body).await;
    let text = v["choices"][0]["text"].as_str().unwrap().to_owned();
    let chars: Vec<char> = text.chars().collect();
    assert!(chars.len() >= 6, "{text:?}");
    let stop: String = chars[3..5].iter().collect();
    let want: String = text[..text.find(&stop).unwrap()].to_owned();
    let mut stopped = body.clone();
    stopped["stop"] = json!([stop]);
    stopped["max_tokens"] = json!(4000);
    for stream in [false, true] {
        stopped["stream"] = json!(stream);
        let got = if stream {
            let (_, events, done) = common::post_sse(&base, "/v1/completions", &stopped).await;
            assert!(done);
            assert_eq!(
                events.last().unwrap()["choices"][0]["finish_reason"],
                "stop"
            );
            events
                .iter()
                .map(|e| e["choices"][0]["text"].as_str().unwrap())
                .collect::<String>()
        } else {
            let (_, v) = common::post(&base, "/v1/completions", &stopped).await;
            assert_eq!(v["choices"][0]["finish_reason"], "stop");
            assert!(v["usage"]["completion_tokens"].as_u64().unwrap() < 40);
            v["choices"][0]["text"].as_str().unwrap().to_owned()
        };
        assert_eq!(got, want, "stream: {stream}");
    }
    idle_stats(&wait_idle(&srv).await);
    let metrics = reqwest::get(url(&srv, "/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let line = metrics
        .lines()
        .find(|l| l.starts_with("engine_requests_total{result=\"stop\"}"))
        .unwrap_or_else(|| panic!("no stop count:\n{metrics}"));
    assert!(line.ends_with(" 2"), "{line}");
    srv.shutdown(Duration::from_secs(1)).await.unwrap();
    thread.join().unwrap().unwrap();
}

/// A model without a chat template is served ChatML; a template that raises, or that does
/// not compile, makes a chat a 400 naming `messages`, never a 500.
#[actix_web::test]
async fn chat_templates_that_fail_are_400s() {
    use mstar_engine::model::{Config, Model};
    let (srv, thread) = start(EngineSettings::default());
    let base = format!("http://{}", srv.addr);
    let (_, t) = common::post(
        &base,
        "/tokenize",
        &json!({"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": false}),
    )
    .await;
    let bytes: Vec<u8> = t["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b.as_u64().unwrap() as u8)
        .skip(1) // BOS
        .collect();
    assert_eq!(
        String::from_utf8(bytes).unwrap(),
        "<|im_start|>user\nhi<|im_end|>\n"
    );
    let (status, v) = common::post(
        &base,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 2);
    srv.shutdown(Duration::from_secs(1)).await.unwrap();
    thread.join().unwrap().unwrap();

    for (template, says) in [
        (
            "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}{{ messages[0]['content'] }}",
            "System role not supported",
        ),
        ("{% for m in messages %}{{ m.content }", "does not compile"),
        ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "render"),
    ] {
        let model = Model::random(Config::tiny(), 5, &candle_core::Device::Cpu).unwrap();
        let (handle, thread) = engine::start(model, EngineSettings::default()).unwrap();
        let srv = Server::start_with_template(
            handle,
            "tiny",
            "127.0.0.1:0",
            mstar_engine::server::ServerLimits::default(),
            Some(template),
        )
        .unwrap();
        let base = format!("http://{}", srv.addr);
        let body = json!({"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}], "max_tokens": 1});
        for path in ["/v1/chat/completions", "/tokenize"] {
            let mut body = body.clone();
            if path == "/tokenize" {
                body.as_object_mut().unwrap().remove("max_tokens");
            }
            let (status, v) = common::post(&base, path, &body).await;
            assert_eq!(status, 400, "{template}: {v}");
            assert_eq!(v["error"]["param"], "messages", "{template}: {v}");
            assert!(
                v["error"]["message"].as_str().unwrap().contains(says),
                "{template}: {v}"
            );
        }
        srv.shutdown(Duration::from_secs(1)).await.unwrap();
        thread.join().unwrap().unwrap();
    }
}
