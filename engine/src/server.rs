//! The OpenAI-compatible HTTP API on actix-web: `POST /v1/completions` (plain or streamed as
//! server-sent events), `GET /v1/models`, `GET /health`, `GET /metrics`.
//!
//! Request bodies are parsed by [`crate::api`]. A request's event receiver lives in its
//! response: when the client goes away, actix drops the response (or the handler's future),
//! the receiver is dropped, and the engine aborts the request at its next turn and releases
//! everything it held. A plain (non-streaming) client that hangs up while its request runs is
//! noticed too: connections are not kept half-closed, so the end of the client's side ends the
//! handler.
//!
//! Every connection is bounded ([`ServerLimits`]): at most `max_connections` at once (further
//! clients wait in the kernel's listen queue), request headers within `header_timeout`, the
//! body within `body_timeout` and [`crate::api::body_limit`] bytes.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use actix_web::http::StatusCode;
use actix_web::web::{Bytes, BytesMut};
use actix_web::{web, App, HttpResponse, HttpServer};
use futures_util::{stream, StreamExt};
use metrics_exporter_prometheus::PrometheusHandle;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::api::{body_limit, ApiError, CompletionBody, ModelLimits, Prompt};
use crate::engine::{EngineHandle, Event, GenRequest, SubmitError};
use crate::tokenizer::{Tokenizer, Utf8Decoder};

/// How the server bounds its clients.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ServerLimits {
    /// Connections served at once, over all workers.
    pub max_connections: usize,
    /// How long a client may take to send a request's headers.
    pub header_timeout: Duration,
    /// How long a client may take to send a request's body, from its headers.
    pub body_timeout: Duration,
}

impl Default for ServerLimits {
    fn default() -> Self {
        ServerLimits {
            max_connections: 256,
            header_timeout: Duration::from_secs(5),
            body_timeout: Duration::from_secs(10),
        }
    }
}

/// The HTTP worker threads.
pub const WORKERS: usize = 2;

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
    /// The limits in force.
    pub limits: ServerLimits,
}

impl From<SubmitError> for ApiError {
    fn from(e: SubmitError) -> Self {
        match e {
            SubmitError::TooLarge(m) => ApiError::bad(Some("max_tokens"), m),
            SubmitError::QueueFull(_) | SubmitError::Draining | SubmitError::Stopped => {
                ApiError::with_status(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "server_overloaded",
                    e.to_string(),
                )
            }
        }
    }
}

/// The tokens of a parsed prompt: a string is encoded with `tok`.
///
/// # Errors
/// The text cannot be encoded (named as `prompt`).
pub fn prompt_tokens(p: Prompt, tok: &Tokenizer) -> Result<Vec<u32>, ApiError> {
    match p {
        Prompt::Text(s) => tok
            .encode(&s)
            .map_err(|e| ApiError::bad(Some("prompt"), e.to_string())),
        Prompt::Tokens(t) => Ok(t),
    }
}

fn request_of(
    body: CompletionBody,
    served: &str,
    tok: &Tokenizer,
) -> Result<(GenRequest, bool), ApiError> {
    if let Some(m) = &body.model {
        if m != served {
            let mut e = ApiError::with_status(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                format!("the model `{m}` does not exist; this server serves `{served}`"),
            );
            e.param = Some("model".into());
            return Err(e);
        }
    }
    let req = GenRequest {
        prompt: prompt_tokens(body.prompt, tok)?,
        max_tokens: body.max_tokens.unwrap_or(16),
        temperature: body.temperature.unwrap_or(1.0),
        top_p: body.top_p.unwrap_or(1.0),
        seed: body.seed.unwrap_or(0),
        ignore_eos: body.ignore_eos,
    };
    Ok((req, body.stream))
}

/// Reads a request body of at most `limit` bytes within `timeout`.
///
/// # Errors
/// 413 past `limit`, 408 past `timeout`, 400 for a body that broke off.
pub async fn read_body(
    mut payload: web::Payload,
    limit: usize,
    timeout: Duration,
) -> Result<Bytes, ApiError> {
    let deadline = tokio::time::Instant::now() + timeout;
    let mut body = BytesMut::new();
    loop {
        let chunk = match tokio::time::timeout_at(deadline, payload.next()).await {
            Err(_) => {
                return Err(ApiError::with_status(
                    StatusCode::REQUEST_TIMEOUT,
                    "invalid_request_error",
                    format!(
                        "the request body did not arrive within {} s",
                        timeout.as_secs_f64()
                    ),
                ))
            }
            Ok(None) => return Ok(body.freeze()),
            Ok(Some(Err(e))) => {
                return Err(ApiError::bad(
                    None,
                    format!("the request body could not be read: {e}"),
                ))
            }
            Ok(Some(Ok(c))) => c,
        };
        if body.len() + chunk.len() > limit {
            return Err(ApiError::with_status(
                StatusCode::PAYLOAD_TOO_LARGE,
                "invalid_request_error",
                format!("the request body exceeds {limit} bytes, the most a prompt that fills the model's context needs"),
            ));
        }
        body.extend_from_slice(&chunk);
    }
}

fn model_limits(state: &AppState) -> ModelLimits {
    state.engine.limits
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
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    if state.draining.load(Ordering::Relaxed) {
        return Err(SubmitError::Draining.into());
    }
    let limits = model_limits(&state);
    let raw = read_body(
        payload,
        body_limit(limits.max_positions),
        state.limits.body_timeout,
    )
    .await?;
    let body = CompletionBody::parse(&raw, limits)?;
    drop(raw);
    let (req, streamed) = request_of(body, &state.model_name, &state.engine.tokenizer)?;
    let (rid, rx) = state.engine.submit(req).await?;
    let id = format!("cmpl-{rid}");
    let created = now_secs();
    let model = state.model_name.clone();
    if streamed {
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

/// `/metrics`: renders what the engine and the component last published; never asks the
/// engine, so a long step does not hold it up.
async fn metrics_page(state: web::Data<AppState>) -> HttpResponse {
    state.metrics.run_upkeep();
    HttpResponse::Ok()
        .content_type("text/plain; version=0.0.4")
        .body(state.metrics.render())
}

/// Configures the routes on an actix-web app.
pub fn routes(cfg: &mut web::ServiceConfig) {
    cfg.route("/v1/completions", web::post().to(completions))
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
    /// Binds `addr` (port 0: any free port) and serves on the current actix/tokio runtime,
    /// with the default [`ServerLimits`].
    ///
    /// # Errors
    /// The address cannot be bound.
    pub fn start(engine: EngineHandle, model_name: &str, addr: &str) -> std::io::Result<Server> {
        Self::start_with(engine, model_name, addr, ServerLimits::default())
    }

    /// As [`start`](Self::start), with these limits.
    ///
    /// # Errors
    /// The address cannot be bound.
    pub fn start_with(
        engine: EngineHandle,
        model_name: &str,
        addr: &str,
        limits: ServerLimits,
    ) -> std::io::Result<Server> {
        let state = web::Data::new(AppState {
            engine,
            model_name: model_name.to_owned(),
            metrics: crate::metrics::install(),
            draining: AtomicBool::new(false),
            limits,
        });
        let s2 = state.clone();
        let per_worker = limits.max_connections.div_ceil(WORKERS).max(1);
        let server = HttpServer::new(move || App::new().app_data(s2.clone()).configure(routes))
            .workers(WORKERS)
            .max_connections(per_worker)
            .client_request_timeout(limits.header_timeout)
            // A client that closes its side has gone: end its handler (a plain request is then
            // aborted like a dropped stream) instead of computing an answer nobody reads.
            .h1_allow_half_closed(false)
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
