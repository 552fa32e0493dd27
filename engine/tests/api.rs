//! The OpenAI-compatible API on SmolLM2-135M-Instruct: chat completions rendered with the
//! GGUF's own template, stop strings, logprobs, `stream_options`, the model routes and
//! `/tokenize` / `/detokenize`. One server is shared by the file's tests (the model loads once);
//! every request is short.

use serde_json::{json, Value};

mod common;
use common::{post, post_sse, smollm2_server, SMOLLM2};

fn france() -> Value {
    json!([{"role": "user", "content": "What is the capital of France?"}])
}

/// The text of a chat's or a completion's streamed events, in order.
fn streamed_text(events: &[Value]) -> String {
    events
        .iter()
        .filter_map(|e| {
            let c = e["choices"].get(0)?;
            c["delta"]["content"].as_str().or(c["text"].as_str())
        })
        .collect()
}

/// The prompt of a chat is the GGUF's template rendered (SmolLM2's adds its default system
/// prompt), opened for the assistant: `/tokenize` and `/detokenize` show it, and a chat's
/// `usage.prompt_tokens` counts it.
#[actix_web::test]
async fn a_chat_is_rendered_with_the_models_own_template() {
    let base = smollm2_server();
    let (status, t) = post(base, "/tokenize", &json!({"messages": france()})).await;
    assert_eq!(status, 200, "{t}");
    let (_, d) = post(base, "/detokenize", &json!({"tokens": t["tokens"]})).await;
    assert_eq!(
        d["prompt"],
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
         <|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    );
    assert_eq!(t["count"], t["tokens"].as_array().unwrap().len());
    let (status, v) = post(
        base,
        "/v1/chat/completions",
        &json!({"model": SMOLLM2, "messages": france(), "max_tokens": 4, "temperature": 0}),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    let choice = &v["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant");
    assert!(!choice["message"]["content"].as_str().unwrap().is_empty());
    assert_eq!(choice["finish_reason"], "length");
    assert_eq!(v["usage"]["prompt_tokens"], t["count"]);
    assert_eq!(v["usage"]["completion_tokens"], 4);
}

/// A chat without `max_tokens` may run to the context: it ends at `<|im_end|>` with
/// `finish_reason: "stop"`, and the marker is not in the text.
#[actix_web::test]
async fn a_chat_ends_at_im_end_with_stop() {
    let base = smollm2_server();
    let (status, v) = post(
        base,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "What is 2 + 2?"}], "temperature": 0}),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    let text = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    assert!(
        text.contains('4') && !text.contains("<|im_end|>"),
        "{text:?}"
    );
    // It stops on its own, far before the context's 8,192 tokens (88 tokens here).
    assert!(
        v["usage"]["completion_tokens"].as_u64().unwrap() < 256,
        "{v}"
    );
}

/// Streamed, a chat sends the role first, then content deltas that add up to the plain
/// answer, then `finish_reason`, then `[DONE]`; with `include_usage`, every chunk has
/// `usage: null` and the usage comes in a last chunk of its own with no choice.
#[actix_web::test]
async fn a_streamed_chat_sends_the_role_then_content_then_usage_on_its_own() {
    let base = smollm2_server();
    let body = json!({"messages": france(), "max_tokens": 6, "temperature": 0});
    let (_, plain) = post(base, "/v1/chat/completions", &body).await;
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let (status, events, done) = post_sse(base, "/v1/chat/completions", &streamed).await;
    assert_eq!(status, 200);
    assert!(done, "the stream ends with [DONE]");
    for e in &events {
        assert_eq!(e["object"], "chat.completion.chunk", "{e}");
        assert!(
            e.get("usage").is_some(),
            "every chunk has a usage field: {e}"
        );
    }
    assert_eq!(events[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(events[1..].iter().all(|e| e["choices"]
        .get(0)
        .is_none_or(|c| c["delta"].get("role").is_none())));
    let last = events.last().unwrap();
    assert_eq!(last["choices"], json!([]));
    assert_eq!(last["usage"], plain["usage"]);
    let finish = &events[events.len() - 2];
    assert_eq!(finish["choices"][0]["finish_reason"], "length");
    assert_eq!(finish["usage"], Value::Null);
    assert_eq!(
        streamed_text(&events),
        plain["choices"][0]["message"]["content"].as_str().unwrap()
    );
}

/// `stop`: the text ends before the first stop string found, which is not returned; streamed,
/// no event shows any of it; the finish reason is `stop`.
#[actix_web::test]
async fn stop_strings_end_the_text_before_them() {
    let base = smollm2_server();
    // Greedy: " Paris.\n\nThe ..." (llama.cpp's fixture agrees).
    let body = json!({"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0,
                      "stop": ["\n\n", "s."]});
    let (status, v) = post(base, "/v1/completions", &body).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["text"], " Pari", "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let mut s = body.clone();
    s["stream"] = json!(true);
    let (_, events, done) = post_sse(base, "/v1/completions", &s).await;
    assert!(done);
    assert_eq!(streamed_text(&events), " Pari");
    assert!(events
        .iter()
        .all(|e| !e["choices"][0]["text"].as_str().unwrap().contains('s')));
    assert_eq!(
        events.last().unwrap()["choices"][0]["finish_reason"],
        "stop"
    );
    // A single string; and a stop string never seen leaves the text whole.
    let (_, v) = post(
        base,
        "/v1/completions",
        &json!({"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0, "stop": "."}),
    )
    .await;
    assert_eq!(v["choices"][0]["text"], " Paris");
    let (_, v) = post(
        base,
        "/v1/completions",
        &json!({"prompt": "The capital of France is", "max_tokens": 2, "temperature": 0, "stop": ["Paris!"]}),
    )
    .await;
    assert_eq!(v["choices"][0]["text"], " Paris.");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
}

/// `logprobs` on completions: `tokens`, `token_logprobs` and `top_logprobs` (that many
/// alternatives), greedy's token the most likely, in streamed chunks too.
#[actix_web::test]
async fn completion_logprobs_list_each_token_with_its_alternatives() {
    let base = smollm2_server();
    let body = json!({"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0, "logprobs": 2});
    let (status, v) = post(base, "/v1/completions", &body).await;
    assert_eq!(status, 200, "{v}");
    let lp = &v["choices"][0]["logprobs"];
    let tokens: Vec<&str> = lp["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    assert_eq!(tokens.concat(), v["choices"][0]["text"].as_str().unwrap());
    assert_eq!(tokens[0], " Paris");
    for i in 0..3 {
        let p = lp["token_logprobs"][i].as_f64().unwrap();
        let top = lp["top_logprobs"][i].as_object().unwrap();
        assert_eq!(top.len(), 2, "{lp}");
        let best = top
            .values()
            .map(|x| x.as_f64().unwrap())
            .fold(f64::MIN, f64::max);
        assert!(
            p <= 0.0 && (p - best).abs() < 1e-6,
            "greedy takes the top token: {lp}"
        );
        assert!(top.contains_key(tokens[i]));
    }
    let mut s = body.clone();
    s["stream"] = json!(true);
    let (_, events, _) = post_sse(base, "/v1/completions", &s).await;
    let streamed: Vec<Value> = events
        .iter()
        .filter_map(|e| {
            let l = &e["choices"][0]["logprobs"];
            (!l.is_null()).then(|| l["token_logprobs"].as_array().unwrap().clone())
        })
        .flatten()
        .collect();
    assert_eq!(&streamed, lp["token_logprobs"].as_array().unwrap());
}

/// Chat logprobs in OpenAI's chat form: `logprobs.content[]` with `token`, `logprob`, `bytes`
/// and `top_logprobs`; in streamed chunks too.
#[actix_web::test]
async fn chat_logprobs_are_in_the_chat_form() {
    let base = smollm2_server();
    let body = json!({"messages": france(), "max_tokens": 3, "temperature": 0,
                      "logprobs": true, "top_logprobs": 3});
    let (status, v) = post(base, "/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{v}");
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 3);
    let mut text = String::new();
    for c in content {
        let bytes: Vec<u8> = c["bytes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b.as_u64().unwrap() as u8)
            .collect();
        assert_eq!(
            String::from_utf8_lossy(&bytes),
            c["token"].as_str().unwrap()
        );
        text.push_str(c["token"].as_str().unwrap());
        assert!(c["logprob"].as_f64().unwrap() <= 0.0);
        let top = c["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        assert_eq!(top[0]["token"], c["token"], "greedy takes the top token");
    }
    assert_eq!(
        text,
        v["choices"][0]["message"]["content"].as_str().unwrap()
    );
    let mut s = body.clone();
    s["stream"] = json!(true);
    let (_, events, _) = post_sse(base, "/v1/chat/completions", &s).await;
    let n: usize = events
        .iter()
        .filter_map(|e| e["choices"][0]["logprobs"]["content"].as_array())
        .map(Vec::len)
        .sum();
    assert_eq!(n, 3);
    // Without `logprobs: true`, `top_logprobs` is refused.
    let (status, v) = post(
        base,
        "/v1/chat/completions",
        &json!({"messages": france(), "max_tokens": 1, "top_logprobs": 2}),
    )
    .await;
    assert_eq!(
        (status, &v["error"]["param"]),
        (400, &json!("top_logprobs"))
    );
}

/// Bad chats are 400s in OpenAI's error form naming the field: an unknown role, no messages,
/// a message without content, prompt + `max_tokens` past the 8,192-token context.
#[actix_web::test]
async fn bad_chats_are_400s_naming_the_field() {
    let base = smollm2_server();
    let cases = [
        (
            json!({"messages": [{"role": "wizard", "content": "hi"}]}),
            "messages[0].role",
        ),
        (json!({"messages": []}), "messages"),
        (json!({"messages": "hi"}), "messages"),
        (json!({"max_tokens": 3}), "messages"),
        (
            json!({"messages": [{"role": "user"}]}),
            "messages[0].content",
        ),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}),
            "messages[0].content[0]",
        ),
        (
            json!({"messages": [{"role": "user", "content": "hi", "tool_calls": []}]}),
            "messages[0].tool_calls",
        ),
        (
            json!({"messages": france(), "max_tokens": 8192}),
            "max_tokens",
        ),
        (
            json!({"messages": france(), "max_completion_tokens": 9000}),
            "max_completion_tokens",
        ),
        (json!({"messages": france(), "n": 9}), "n"),
        (json!({"messages": france(), "tools": []}), "tools"),
        (json!({"messages": france(), "model": "gpt-4"}), "model"),
    ];
    for (body, param) in cases {
        let (status, v) = post(base, "/v1/chat/completions", &body).await;
        let want = if param == "model" { 404 } else { 400 };
        assert_eq!(status, want, "{body}: {v}");
        assert_eq!(v["error"]["param"], param, "{body}: {v}");
        assert_eq!(v["error"]["type"], "invalid_request_error");
    }
    // Up to the context is accepted: prompt + max_tokens = 8,192 (it stops at "." at once).
    let (_, t) = post(
        base,
        "/tokenize",
        &json!({"prompt": "The capital of France is"}),
    )
    .await;
    let room = 8192 - t["count"].as_u64().unwrap();
    let body = json!({"prompt": "The capital of France is", "max_tokens": room, "temperature": 0, "stop": "."});
    let (status, v) = post(base, "/v1/completions", &body).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let mut over = body.clone();
    over["max_tokens"] = json!(room + 1);
    let (status, v) = post(base, "/v1/completions", &over).await;
    assert_eq!((status, &v["error"]["param"]), (400, &json!("max_tokens")));
}

/// `GET /v1/models/{id}` answers the served model and 404 in OpenAI's form for another id;
/// `/tokenize` answers vLLM's `{"tokens", "count"}` (llama.cpp's ids), `/detokenize` gives the
/// text back; bad input to either is a 400 naming the field.
#[actix_web::test]
async fn model_routes_and_tokenize_detokenize() {
    let base = smollm2_server();
    let c = reqwest::Client::new();
    let r = c
        .get(format!("{base}/v1/models/{SMOLLM2}"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!((&v["id"], &v["object"]), (&json!(SMOLLM2), &json!("model")));
    let r = c
        .get(format!("{base}/v1/models/gpt-4"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "model_not_found");
    assert_eq!(v["error"]["type"], "invalid_request_error");

    let (status, v) = post(base, "/tokenize", &json!({"prompt": "Hello, world!"})).await;
    assert_eq!(status, 200);
    assert_eq!(v["tokens"], json!([19556, 28, 905, 17]));
    assert_eq!(v["count"], 4);
    let (status, v) = post(
        base,
        "/detokenize",
        &json!({"tokens": [19556, 28, 905, 17]}),
    )
    .await;
    assert_eq!((status, &v["prompt"]), (200, &json!("Hello, world!")));
    for (path, body, param) in [
        ("/tokenize", json!({}), "prompt"),
        ("/tokenize", json!({"prompt": 5}), "prompt"),
        (
            "/tokenize",
            json!({"prompt": "a", "messages": france()}),
            "messages",
        ),
        ("/tokenize", json!({"messages": []}), "messages"),
        ("/tokenize", json!({"prompt": "a", "echo": true}), "echo"),
        ("/detokenize", json!({}), "tokens"),
        ("/detokenize", json!({"tokens": [1, 49152]}), "tokens"),
        ("/detokenize", json!({"tokens": "abc"}), "tokens"),
    ] {
        let (status, v) = post(base, path, &body).await;
        assert_eq!(status, 400, "{path} {body}: {v}");
        assert_eq!(v["error"]["param"], param, "{path} {body}: {v}");
    }
}

/// A streamed response never splits a UTF-8 character across events: SmolLM2 writes these
/// Japanese characters a byte token at a time, and every event holds whole characters.
#[actix_web::test]
async fn streamed_text_never_splits_a_character() {
    let base = smollm2_server();
    let body = json!({"prompt": "日本語のテキストです。日本", "max_tokens": 8, "temperature": 0, "stream": true});
    let (_, events, done) = post_sse(base, "/v1/completions", &body).await;
    assert!(done);
    for e in &events {
        let t = e["choices"][0]["text"].as_str().unwrap();
        assert!(!t.contains('\u{FFFD}'), "{events:?}");
    }
    let text = streamed_text(&events);
    assert!(text.chars().count() >= 2 && !text.is_ascii(), "{text:?}");
    assert!(
        events.len() > text.chars().count() + 1,
        "some tokens are parts of a character: {events:?}"
    );
}
