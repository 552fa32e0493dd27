//! The OpenAI-compatible HTTP API on actix-web: `POST /v1/completions` (plain or streamed as
//! server-sent events), `GET /v1/models`, `GET /health`, `GET /metrics`.
//!
//! A request's event receiver lives in its response: when the client goes away, actix drops
//! the response (or the handler's future), the receiver is dropped, and the engine aborts the
//! request at its next step and releases everything it held.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use actix_web::http::StatusCode;
use actix_web::web::Bytes;
use actix_web::{web, App, HttpResponse, HttpServer, ResponseError};
use futures_util::stream;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::engine::{EngineHandle, Event, GenRequest, SubmitError};
use crate::tokenizer::{Tokenizer, Utf8Decoder};

/// The process's Prometheus recorder, installed once; the component's and the engine's metrics
/// are recorded into it through the `metrics` facade.
pub fn prometheus() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let buckets = [
                0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
            ];
            let builder = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Prefix("engine_".into()), &buckets)
                .expect("non-empty buckets");
            let recorder = builder.build_recorder();
            let handle = recorder.handle();
            // A recorder installed by someone else wins; then this one renders only what it
            // records (nothing), which the metrics test would catch.
            let _ = metrics::set_global_recorder(recorder);
            handle
        })
        .clone()
}

/// Shared state of the HTTP handlers.
pub struct AppState {
    /// The engine.
    pub engine: EngineHandle,
    /// The served model's name.
    pub model_name: String,
    /// The metrics recorder's handle.
    pub metrics: PrometheusHandle,
    /// Set once shutdown began: `/health` answers 503 and completions are refused.
    pub draining: AtomicBool,
}

/// An OpenAI error answer.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    kind: &'static str,
    message: String,
    param: Option<&'static str>,
}

impl ApiError {
    fn bad(param: Option<&'static str>, message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            message: message.into(),
            param,
        }
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl ResponseError for ApiError {
    fn status_code(&self) -> StatusCode {
        self.status
    }
    fn error_response(&self) -> HttpResponse {
        HttpResponse::build(self.status).json(json!({
            "error": {"message": self.message, "type": self.kind, "param": self.param, "code": null}
        }))
    }
}

impl From<SubmitError> for ApiError {
    fn from(e: SubmitError) -> Self {
        match e {
            SubmitError::TooLarge(m) => ApiError::bad(Some("max_tokens"), m),
            SubmitError::QueueFull(_) | SubmitError::Draining | SubmitError::Stopped => ApiError {
                status: StatusCode::SERVICE_UNAVAILABLE,
                kind: "server_overloaded",
                message: e.to_string(),
                param: None,
            },
        }
    }
}

/// The body of `POST /v1/completions`. Unknown fields are ignored, as OpenAI clients send
/// fields this engine has no use for (`n`, `logprobs`, `user`...).
#[derive(Debug, Deserialize)]
pub struct CompletionBody {
    /// The model's name (optional; any other than the served one is refused).
    pub model: Option<String>,
    /// A string, or an array of token ids.
    pub prompt: Value,
    /// Tokens to generate (default 16).
    pub max_tokens: Option<u32>,
    /// Sampling temperature, 0 to 2 (default 1).
    pub temperature: Option<f32>,
    /// Nucleus mass, (0, 1] (default 1).
    pub top_p: Option<f32>,
    /// Sampling seed (default 0).
    pub seed: Option<u64>,
    /// Stream server-sent events.
    #[serde(default)]
    pub stream: bool,
    /// Keep generating past EOS.
    #[serde(default)]
    pub ignore_eos: bool,
}

/// The tokens of a `prompt` value, text encoded with `tok`.
///
/// # Errors
/// A value that is neither a string nor an array of token ids below the vocabulary size.
pub fn prompt_tokens(v: &Value, tok: &Tokenizer) -> Result<Vec<u32>, ApiError> {
    let vocab = tok.vocab_size();
    match v {
        Value::String(s) => tok
            .encode(s)
            .map_err(|e| ApiError::bad(Some("prompt"), e.to_string())),
        Value::Array(items) if items.len() == 1 && items[0].is_string() => {
            prompt_tokens(&items[0], tok)
        }
        Value::Array(items) => {
            if items.is_empty() {
                return Err(ApiError::bad(Some("prompt"), "`prompt` is an empty array"));
            }
            items
                .iter()
                .enumerate()
                .map(|(i, t)| match t.as_u64() {
                    Some(t) if t < vocab as u64 => Ok(t as u32),
                    _ => Err(ApiError::bad(
                        Some("prompt"),
                        format!("`prompt[{i}]` is {t}: token ids are whole numbers below {vocab}"),
                    )),
                })
                .collect()
        }
        other => Err(ApiError::bad(
            Some("prompt"),
            format!("`prompt` must be a string or an array of token ids, not {other}"),
        )),
    }
}

fn request_of(
    body: &CompletionBody,
    served: &str,
    tok: &Tokenizer,
) -> Result<GenRequest, ApiError> {
    if let Some(m) = &body.model {
        if m != served {
            return Err(ApiError {
                status: StatusCode::NOT_FOUND,
                kind: "invalid_request_error",
                message: format!("the model `{m}` does not exist; this server serves `{served}`"),
                param: Some("model"),
            });
        }
    }
    let prompt = prompt_tokens(&body.prompt, tok)?;
    let max_tokens = body.max_tokens.unwrap_or(16);
    if max_tokens == 0 {
        return Err(ApiError::bad(
            Some("max_tokens"),
            "`max_tokens` must be at least 1",
        ));
    }
    let temperature = body.temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::bad(
            Some("temperature"),
            format!("`temperature` is {temperature}: it must be between 0 and 2"),
        ));
    }
    let top_p = body.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::bad(
            Some("top_p"),
            format!("`top_p` is {top_p}: it must be in (0, 1]"),
        ));
    }
    Ok(GenRequest {
        prompt,
        max_tokens,
        temperature,
        top_p,
        seed: body.seed.unwrap_or(0),
        ignore_eos: body.ignore_eos,
    })
}

/// Turns tokens into text as they arrive, holding back an incomplete UTF-8 sequence; control
/// tokens (BOS, EOS, `<|im_end|>`) have no text. The default is for the byte vocabulary.
#[derive(Default)]
pub struct Utf8Stream {
    tokenizer: Option<Arc<Tokenizer>>,
    text: Utf8Decoder,
}

impl Utf8Stream {
    /// A stream decoding with `tokenizer`.
    pub fn new(tokenizer: Arc<Tokenizer>) -> Self {
        Self {
            tokenizer: Some(tokenizer),
            text: Utf8Decoder::new(),
        }
    }

    /// Adds a token; returns the text it completes (maybe empty).
    pub fn push(&mut self, token: u32) -> String {
        let bytes = self
            .tokenizer
            .as_deref()
            .unwrap_or(&Tokenizer::Bytes)
            .token_bytes(token)
            .unwrap_or_default();
        self.text.push(bytes)
    }

    /// The text left at the end (an incomplete sequence as U+FFFD).
    pub fn finish(&mut self) -> String {
        self.text.finish()
    }
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn usage(prompt: u32, completion: u32) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
}

async fn completions(
    state: web::Data<AppState>,
    body: web::Json<CompletionBody>,
) -> Result<HttpResponse, ApiError> {
    if state.draining.load(Ordering::Relaxed) {
        return Err(SubmitError::Draining.into());
    }
    let req = request_of(&body, &state.model_name, &state.engine.tokenizer)?;
    let (rid, rx) = state.engine.submit(req).await?;
    let id = format!("cmpl-{rid}");
    let created = now_secs();
    let model = state.model_name.clone();
    if body.stream {
        let st = SseState {
            rx,
            text: Utf8Stream::new(state.engine.tokenizer.clone()),
            id,
            created,
            model,
            done: false,
        };
        let s = stream::unfold(st, |mut st| async move {
            if st.done {
                return None;
            }
            let chunk = match st.rx.recv().await {
                Some(Event::Token(t)) => {
                    let text = st.text.push(t);
                    sse(&st.chunk(&text, None, None))
                }
                Some(Event::Done {
                    finish,
                    prompt_tokens,
                    completion_tokens,
                }) => {
                    st.done = true;
                    let text = st.text.finish();
                    let last = st.chunk(
                        &text,
                        Some(finish.as_str()),
                        Some(usage(prompt_tokens, completion_tokens)),
                    );
                    format!("{}data: [DONE]\n\n", sse(&last))
                }
                None => return None,
            };
            Some((Ok::<_, actix_web::Error>(Bytes::from(chunk)), st))
        });
        return Ok(HttpResponse::Ok()
            .content_type("text/event-stream")
            .insert_header(("Cache-Control", "no-cache"))
            .streaming(s));
    }
    let mut rx = rx;
    let mut text = Utf8Stream::new(state.engine.tokenizer.clone());
    let mut out = String::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Token(t) => out.push_str(&text.push(t)),
            Event::Done {
                finish,
                prompt_tokens,
                completion_tokens,
            } => {
                out.push_str(&text.finish());
                return Ok(HttpResponse::Ok().json(json!({
                    "id": id, "object": "text_completion", "created": created, "model": model,
                    "choices": [{"text": out, "index": 0, "logprobs": null, "finish_reason": finish.as_str()}],
                    "usage": usage(prompt_tokens, completion_tokens),
                })));
            }
        }
    }
    Err(SubmitError::Stopped.into())
}

struct SseState {
    rx: mpsc::UnboundedReceiver<Event>,
    text: Utf8Stream,
    id: String,
    created: u64,
    model: String,
    done: bool,
}

impl SseState {
    fn chunk(&self, text: &str, finish: Option<&str>, usage: Option<Value>) -> Value {
        let mut v = json!({
            "id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
            "choices": [{"text": text, "index": 0, "logprobs": null, "finish_reason": finish}],
        });
        if let Some(u) = usage {
            v["usage"] = u;
        }
        v
    }
}

fn sse(v: &Value) -> String {
    format!("data: {v}\n\n")
}

async fn models(state: web::Data<AppState>) -> HttpResponse {
    HttpResponse::Ok().json(json!({
        "object": "list",
        "data": [{"id": state.model_name, "object": "model", "created": 0, "owned_by": "mstar-engine"}],
    }))
}

async fn health(state: web::Data<AppState>) -> HttpResponse {
    if state.draining.load(Ordering::Relaxed) {
        HttpResponse::ServiceUnavailable().json(json!({"status": "draining"}))
    } else {
        HttpResponse::Ok().json(json!({"status": "ok"}))
    }
}

async fn metrics_page(state: web::Data<AppState>) -> HttpResponse {
    // Refresh the engine's gauges from its own state before rendering.
    if let Some(s) = state.engine.stats().await {
        metrics::gauge!("engine_requests_running").set(s.running as f64);
        metrics::gauge!("engine_requests_waiting").set(s.waiting as f64);
        metrics::gauge!("engine_kv_tokens_used").set(s.kv_used as f64);
        metrics::gauge!("engine_kv_tokens_reserved").set(s.kv_reserved as f64);
        metrics::gauge!("engine_kv_tokens_capacity").set(s.kv_capacity as f64);
    }
    state.metrics.run_upkeep();
    HttpResponse::Ok()
        .content_type("text/plain; version=0.0.4")
        .body(state.metrics.render())
}

/// Configures the routes on an actix-web app.
pub fn routes(cfg: &mut web::ServiceConfig) {
    cfg.app_data(
        web::JsonConfig::default()
            .limit(16 << 20)
            .error_handler(|err, _| {
                let msg = format!("the request body is not a valid completion request: {err}");
                ApiError::bad(None, msg).into()
            }),
    )
    .route("/v1/completions", web::post().to(completions))
    .route("/v1/models", web::get().to(models))
    .route("/health", web::get().to(health))
    .route("/metrics", web::get().to(metrics_page));
}

/// A running server: its address, and how to stop it.
pub struct Server {
    /// The address it listens on.
    pub addr: SocketAddr,
    /// Its shared state.
    pub state: web::Data<AppState>,
    handle: actix_web::dev::ServerHandle,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl Server {
    /// Binds `addr` (port 0: any free port) and serves on the current actix/tokio runtime.
    ///
    /// # Errors
    /// The address cannot be bound.
    pub fn start(engine: EngineHandle, model_name: &str, addr: &str) -> std::io::Result<Server> {
        let state = web::Data::new(AppState {
            engine,
            model_name: model_name.to_owned(),
            metrics: prometheus(),
            draining: AtomicBool::new(false),
        });
        let s2 = state.clone();
        let server = HttpServer::new(move || App::new().app_data(s2.clone()).configure(routes))
            .workers(2)
            .disable_signals()
            .shutdown_timeout(5)
            .bind(addr)?;
        let addr = server.addrs()[0];
        let server = server.run();
        let handle = server.handle();
        let task = tokio::spawn(server);
        Ok(Server {
            addr,
            state,
            handle,
            task,
        })
    }

    /// Graceful shutdown: stop admitting, let running requests finish within `grace` (the rest
    /// are aborted and their streams end), then stop the HTTP server.
    pub async fn shutdown(self, grace: Duration) -> std::io::Result<()> {
        self.state.draining.store(true, Ordering::Relaxed);
        if let Some(report) = self.state.engine.drain(grace).await {
            tracing::debug!(?report, "the component's drain");
        }
        self.handle.stop(true).await;
        self.task.await.map_err(std::io::Error::other)?
    }
}
