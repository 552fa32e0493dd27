//! The OpenAI-compatible HTTP API on actix-web: `POST /v1/completions` and
//! `POST /v1/chat/completions` (plain or streamed as server-sent events), `GET /v1/models`,
//! `GET /v1/models/{id}`, `POST /tokenize`, `POST /detokenize`, `GET /health`, `GET /metrics`.
//!
//! Request bodies are parsed by [`crate::api`]; a chat's messages are rendered by
//! [`crate::chat`] with the model's own template. Generated text is cut at stop strings
//! ([`StopText`]) after it is decoded whole characters at a time ([`Utf8Stream`]), so a stream
//! never splits a character and never shows text that may begin a stop string until the next
//! tokens decide it. A request's event receiver lives in its
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

use crate::api::{
    body_limit, check_model, model_not_found, ApiError, ChatBody, CompletionBody, DetokenizeBody,
    ModelLimits, Prompt, Sampling, TokenizeBody, TokenizeInput,
};
use crate::chat::{ChatTemplate, Message, CHATML};
use crate::engine::{EngineHandle, Event, Finish, GenRequest, SubmitError};
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
    /// The chat template, compiled; or why it does not compile (chats are then refused).
    pub chat: Result<ChatTemplate, String>,
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

/// The chat template a model is served with: its own (from its GGUF), else [`CHATML`]; its
/// BOS and EOS texts are given to the template.
///
/// # Errors
/// The template does not compile (every chat request is then a 400 saying so).
pub fn chat_template_of(tok: &Tokenizer, source: Option<&str>) -> Result<ChatTemplate, String> {
    let source = source.or(tok.chat_template()).unwrap_or(CHATML);
    let text = |t: Option<u32>| t.and_then(|t| tok.token_text(t)).unwrap_or_default();
    ChatTemplate::new(source, &text(tok.bos()), &text(Some(tok.eos())))
}

/// A chat's prompt: `messages` rendered with the template and encoded.
///
/// # Errors
/// A template that does not compile or fails to render: 400 naming `messages`.
pub fn chat_tokens(
    chat: &Result<ChatTemplate, String>,
    messages: &[Message],
    add_generation_prompt: bool,
    tok: &Tokenizer,
) -> Result<Vec<u32>, ApiError> {
    let template = chat
        .as_ref()
        .map_err(|e| ApiError::bad(Some("messages"), e.clone()))?;
    let text = template
        .render(messages, add_generation_prompt)
        .map_err(|e| ApiError::bad(Some("messages"), e))?;
    tok.encode(&text)
        .map_err(|e| ApiError::bad(Some("messages"), e.to_string()))
}

/// A completion's `max_tokens` when it gives none (OpenAI's default).
pub const DEFAULT_MAX_TOKENS: u32 = 16;

/// What a generation needs besides its prompt.
struct Plan {
    /// The request's `max_tokens`, if given.
    max_tokens: Option<u32>,
    /// Without `max_tokens`, run to the context (a chat) rather than 16 tokens (a completion).
    to_context: bool,
    stop_tokens: Vec<u32>,
    logprobs: Option<u8>,
}

/// The request for the engine: `prompt` with `sampling`, its length checked against the
/// model's context. A chat (`prompt_field` `messages`) without `max_tokens` may run to the
/// context (or the KV capacity, if smaller); a completion's default is 16 tokens.
fn gen_request(
    state: &AppState,
    prompt: Vec<u32>,
    prompt_field: &str,
    sampling: &Sampling,
    plan: Plan,
) -> Result<GenRequest, ApiError> {
    let context = state.engine.limits.max_positions as u64;
    let room = context.min(state.engine.kv_tokens);
    let n = prompt.len() as u64;
    if n == 0 {
        return Err(ApiError::bad(
            Some(prompt_field),
            format!("`{prompt_field}` encodes to no tokens"),
        ));
    }
    if n >= room {
        return Err(ApiError::bad(
            Some(prompt_field),
            format!(
                "`{prompt_field}` is {n} tokens: no room to generate within the model's context of {context} tokens{}",
                if room < context { format!(" and the KV capacity of {room}") } else { String::new() }
            ),
        ));
    }
    let max_tokens = match plan.max_tokens {
        Some(m) => u64::from(m),
        None if plan.to_context => room - n,
        None => DEFAULT_MAX_TOKENS.into(),
    };
    if n + max_tokens > context {
        let field = sampling.max_tokens_field;
        return Err(ApiError::bad(
            Some(field),
            format!(
                "the prompt ({n} tokens) + `{field}` ({max_tokens}) = {} exceeds the model's context of {context} tokens",
                n + max_tokens
            ),
        ));
    }
    Ok(GenRequest {
        prompt,
        max_tokens: u32::try_from(max_tokens).unwrap_or(u32::MAX),
        temperature: sampling.temperature.unwrap_or(1.0),
        top_p: sampling.top_p.unwrap_or(1.0),
        // Without a seed every request samples differently.
        seed: sampling.seed.unwrap_or_else(rand::random),
        ignore_eos: sampling.ignore_eos,
        stop_tokens: plan.stop_tokens,
        logprobs: plan.logprobs,
    })
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

/// Reads a body of the request's limit, refusing while shutting down.
async fn body_of(state: &AppState, payload: web::Payload) -> Result<Bytes, ApiError> {
    if state.draining.load(Ordering::Relaxed) {
        return Err(SubmitError::Draining.into());
    }
    let limits = model_limits(state);
    read_body(
        payload,
        body_limit(limits.max_positions),
        state.limits.body_timeout,
    )
    .await
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

/// Cuts generated text at the first stop string: text that may be the start of a stop string
/// is held back until the next text decides it; a stop string found is not returned, nor
/// anything after it. Works on whole characters (after [`Utf8Stream`]).
#[derive(Debug, Default)]
pub struct StopText {
    stops: Vec<String>,
    held: String,
    stopped: bool,
}

impl StopText {
    /// A matcher of `stops` (none empty).
    pub fn new(stops: Vec<String>) -> Self {
        StopText {
            stops,
            held: String::new(),
            stopped: false,
        }
    }

    /// Adds text; returns the text now decided (not part of a stop string), and whether a stop
    /// string was found (then nothing more is returned).
    pub fn push(&mut self, text: &str) -> (String, bool) {
        if self.stopped {
            return (String::new(), true);
        }
        self.held.push_str(text);
        if let Some(at) = self.stops.iter().filter_map(|s| self.held.find(s)).min() {
            self.stopped = true;
            let out = self.held[..at].to_owned();
            self.held.clear();
            return (out, true);
        }
        // Hold the longest end of the text that begins a stop string. A stop string's prefix
        // is valid UTF-8, so the text it ends is cut on a character boundary.
        let keep = self
            .stops
            .iter()
            .flat_map(|s| {
                s.char_indices()
                    .map(|(i, _)| i)
                    .skip(1)
                    .filter(|&k| self.held.ends_with(&s[..k]))
            })
            .max()
            .unwrap_or(0);
        let out = self.held[..self.held.len() - keep].to_owned();
        self.held.drain(..self.held.len() - keep);
        (out, false)
    }

    /// The text held at the end of the generation (it began a stop string that never came).
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
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

/// One generated token's log-probabilities, with the texts shown for it.
struct TokenLp {
    text: String,
    bytes: Vec<u8>,
    logprob: f32,
    top: Vec<(String, Vec<u8>, f32)>,
}

/// What a generation's events become: text decided so far, logprobs of the tokens it came from,
/// and at the end why it finished.
#[derive(Default)]
struct Piece {
    text: String,
    logprobs: Vec<TokenLp>,
    finish: Option<Finish>,
}

/// A running generation as the HTTP side sees it: the engine's events turned into text, cut
/// at stop strings, with the tokens counted.
struct Generation {
    rid: u64,
    rx: mpsc::UnboundedReceiver<Event>,
    engine: EngineHandle,
    tokenizer: Arc<Tokenizer>,
    utf8: Utf8Stream,
    stop: StopText,
    /// Tokens whose logprobs are not sent: the token that ends the request.
    ends: Vec<u32>,
    ignore_eos: bool,
    prompt_tokens: u32,
    completion_tokens: u32,
    done: bool,
}

impl Generation {
    async fn start(
        state: &AppState,
        req: GenRequest,
        stops: Vec<String>,
    ) -> Result<Self, ApiError> {
        let tok = state.engine.tokenizer.clone();
        let mut ends = req.stop_tokens.clone();
        ends.push(tok.eos());
        let ignore_eos = req.ignore_eos;
        let prompt_tokens = req.prompt.len() as u32;
        let (rid, rx) = state.engine.submit(req).await?;
        Ok(Generation {
            rid,
            rx,
            engine: state.engine.clone(),
            utf8: Utf8Stream::new(tok.clone()),
            tokenizer: tok,
            stop: StopText::new(stops),
            ends,
            ignore_eos,
            prompt_tokens,
            completion_tokens: 0,
            done: false,
        })
    }

    fn usage(&self) -> Value {
        usage(self.prompt_tokens, self.completion_tokens)
    }

    fn shown(&self, t: u32) -> (String, Vec<u8>) {
        let bytes = self
            .tokenizer
            .token_bytes_with_control(t)
            .unwrap_or_default()
            .to_vec();
        (String::from_utf8_lossy(&bytes).into_owned(), bytes)
    }

    /// The next event as a piece; `None` once finished (or the engine stopped).
    async fn next(&mut self) -> Option<Piece> {
        if self.done {
            return None;
        }
        match self.rx.recv().await {
            Some(Event::Token { id, logprobs }) => {
                self.completion_tokens += 1;
                let mut p = Piece::default();
                let ending = !self.ignore_eos && self.ends.contains(&id);
                if let (Some(lp), false) = (logprobs, ending) {
                    let (text, bytes) = self.shown(id);
                    p.logprobs.push(TokenLp {
                        text,
                        bytes,
                        logprob: lp.logprob,
                        top: lp
                            .top
                            .iter()
                            .map(|&(t, l)| {
                                let (s, b) = self.shown(t);
                                (s, b, l)
                            })
                            .collect(),
                    });
                }
                let (text, stopped) = self.stop.push(&self.utf8.push(id));
                p.text = text;
                if stopped {
                    // A stop string: the request ends here; the engine frees it at its next
                    // turn, and tokens it makes meanwhile are not read.
                    self.engine.stop(self.rid);
                    self.done = true;
                    p.finish = Some(Finish::Stop);
                }
                Some(p)
            }
            Some(Event::Done { finish, .. }) => {
                self.done = true;
                let (mut text, stopped) = self.stop.push(&self.utf8.finish());
                if !stopped {
                    text.push_str(&self.stop.finish());
                }
                Some(Piece {
                    text,
                    logprobs: Vec::new(),
                    finish: Some(if stopped { Finish::Stop } else { finish }),
                })
            }
            None => {
                self.done = true;
                None
            }
        }
    }
}

/// The legacy completions' `logprobs` object for `lps`.
fn completion_logprobs(lps: &[TokenLp]) -> Value {
    json!({
        "tokens": lps.iter().map(|l| l.text.as_str()).collect::<Vec<_>>(),
        "token_logprobs": lps.iter().map(|l| l.logprob).collect::<Vec<_>>(),
        "top_logprobs": lps.iter().map(|l| {
            l.top.iter().map(|(s, _, p)| (s.clone(), json!(p))).collect::<serde_json::Map<_, _>>()
        }).collect::<Vec<_>>(),
    })
}

/// The chat completions' `logprobs` object for `lps`.
fn chat_logprobs(lps: &[TokenLp]) -> Value {
    json!({
        "content": lps.iter().map(|l| json!({
            "token": l.text, "logprob": l.logprob, "bytes": l.bytes,
            "top_logprobs": l.top.iter().map(|(s, b, p)| json!({"token": s, "logprob": p, "bytes": b})).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
    })
}

/// Which API a response is shaped for.
#[derive(Clone, Copy, PartialEq)]
enum Shape {
    Completion,
    Chat,
}

/// How a response is written: the API's shape and the request's choices.
struct Writer {
    shape: Shape,
    id: String,
    created: u64,
    model: String,
    logprobs: bool,
    include_usage: bool,
}

impl Writer {
    fn new(shape: Shape, rid: u64, model: &str, logprobs: bool, include_usage: bool) -> Self {
        Writer {
            shape,
            id: match shape {
                Shape::Completion => format!("cmpl-{rid}"),
                Shape::Chat => format!("chatcmpl-{rid}"),
            },
            created: now_secs(),
            model: model.to_owned(),
            logprobs,
            include_usage,
        }
    }

    fn logprobs_of(&self, lps: &[TokenLp]) -> Value {
        match (self.logprobs, self.shape) {
            (false, _) => Value::Null,
            (true, Shape::Completion) => completion_logprobs(lps),
            (true, Shape::Chat) => chat_logprobs(lps),
        }
    }

    fn object(&self, streamed: bool) -> &'static str {
        match (self.shape, streamed) {
            (Shape::Completion, _) => "text_completion",
            (Shape::Chat, false) => "chat.completion",
            (Shape::Chat, true) => "chat.completion.chunk",
        }
    }

    /// A streamed chunk of one piece; `usage` on the last unless it goes in a chunk of its own.
    fn chunk(&self, p: &Piece, usage: Option<Value>) -> Value {
        let finish = p.finish.map(Finish::as_str);
        let choice = match self.shape {
            Shape::Completion => json!({
                "text": p.text, "index": 0, "logprobs": self.logprobs_of(&p.logprobs), "finish_reason": finish,
            }),
            Shape::Chat => {
                let delta = if p.text.is_empty() && p.finish.is_some() {
                    json!({})
                } else {
                    json!({"content": p.text})
                };
                json!({"index": 0, "delta": delta, "logprobs": self.logprobs_of(&p.logprobs), "finish_reason": finish})
            }
        };
        let mut v = json!({
            "id": self.id, "object": self.object(true), "created": self.created, "model": self.model,
            "choices": [choice],
        });
        if self.include_usage {
            v["usage"] = Value::Null;
        } else if let Some(u) = usage {
            v["usage"] = u;
        }
        v
    }

    /// The chat's first chunk: the assistant's role.
    fn role_chunk(&self) -> Value {
        let mut v = json!({
            "id": self.id, "object": self.object(true), "created": self.created, "model": self.model,
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}],
        });
        if self.include_usage {
            v["usage"] = Value::Null;
        }
        v
    }

    /// `stream_options.include_usage`'s last chunk: no choice, the usage.
    fn usage_chunk(&self, usage: Value) -> Value {
        json!({
            "id": self.id, "object": self.object(true), "created": self.created, "model": self.model,
            "choices": [], "usage": usage,
        })
    }

    /// The whole (non-streamed) answer.
    fn whole(&self, text: &str, lps: &[TokenLp], finish: Finish, usage: Value) -> Value {
        let choice = match self.shape {
            Shape::Completion => json!({
                "text": text, "index": 0, "logprobs": self.logprobs_of(lps), "finish_reason": finish.as_str(),
            }),
            Shape::Chat => json!({
                "index": 0, "message": {"role": "assistant", "content": text},
                "logprobs": self.logprobs_of(lps), "finish_reason": finish.as_str(),
            }),
        };
        json!({
            "id": self.id, "object": self.object(false), "created": self.created, "model": self.model,
            "choices": [choice], "usage": usage,
        })
    }
}

fn sse(v: &Value) -> String {
    format!("data: {v}\n\n")
}

/// Answers a generation: whole, or streamed as server-sent events (one event per token, whose
/// text may be empty while it is held back; a chat's first event carries the role; the last
/// carries `finish_reason`, then `usage` in its own event with `include_usage`, then
/// `data: [DONE]`).
async fn respond(mut g: Generation, w: Writer, streamed: bool) -> Result<HttpResponse, ApiError> {
    if streamed {
        let first = (w.shape == Shape::Chat).then(|| sse(&w.role_chunk()));
        let s = stream::unfold((g, w, first), |(mut g, w, first)| async move {
            if let Some(f) = first {
                return Some((Ok::<_, actix_web::Error>(Bytes::from(f)), (g, w, None)));
            }
            let p = g.next().await?;
            let out = if p.finish.is_some() {
                let mut out = sse(&w.chunk(&p, Some(g.usage())));
                if w.include_usage {
                    out.push_str(&sse(&w.usage_chunk(g.usage())));
                }
                out.push_str("data: [DONE]\n\n");
                out
            } else {
                sse(&w.chunk(&p, None))
            };
            Some((Ok(Bytes::from(out)), (g, w, None)))
        });
        return Ok(HttpResponse::Ok()
            .content_type("text/event-stream")
            .insert_header(("Cache-Control", "no-cache"))
            .streaming(s));
    }
    let mut text = String::new();
    let mut lps = Vec::new();
    while let Some(p) = g.next().await {
        text.push_str(&p.text);
        lps.extend(p.logprobs);
        if let Some(f) = p.finish {
            return Ok(HttpResponse::Ok().json(w.whole(&text, &lps, f, g.usage())));
        }
    }
    Err(SubmitError::Stopped.into())
}

async fn completions(
    state: web::Data<AppState>,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let raw = body_of(&state, payload).await?;
    let body = CompletionBody::parse(&raw, model_limits(&state))?;
    drop(raw);
    check_model(body.model.as_deref(), &state.model_name)?;
    let prompt = prompt_tokens(body.prompt, &state.engine.tokenizer)?;
    let s = body.sampling;
    let req = gen_request(
        &state,
        prompt,
        "prompt",
        &s,
        Plan {
            max_tokens: s.max_tokens,
            to_context: false,
            stop_tokens: Vec::new(),
            logprobs: body.logprobs,
        },
    )?;
    let g = Generation::start(&state, req, s.stop).await?;
    let w = Writer::new(
        Shape::Completion,
        g.rid,
        &state.model_name,
        body.logprobs.is_some(),
        s.include_usage,
    );
    respond(g, w, s.stream).await
}

/// The token that ends an assistant's turn in ChatML.
pub const IM_END: &str = "<|im_end|>";

async fn chat_completions(
    state: web::Data<AppState>,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let raw = body_of(&state, payload).await?;
    let body = ChatBody::parse(&raw, model_limits(&state))?;
    drop(raw);
    check_model(body.model.as_deref(), &state.model_name)?;
    let tok = &state.engine.tokenizer;
    let prompt = chat_tokens(&state.chat, &body.messages, true, tok)?;
    let s = body.sampling;
    let req = gen_request(
        &state,
        prompt,
        "messages",
        &s,
        Plan {
            max_tokens: s.max_tokens,
            to_context: true,
            stop_tokens: tok.token_id(IM_END).into_iter().collect(),
            logprobs: body.logprobs,
        },
    )?;
    let g = Generation::start(&state, req, s.stop).await?;
    let w = Writer::new(
        Shape::Chat,
        g.rid,
        &state.model_name,
        body.logprobs.is_some(),
        s.include_usage,
    );
    respond(g, w, s.stream).await
}

/// `POST /tokenize`: a prompt's (or a conversation's) token ids, as vLLM answers.
async fn tokenize(
    state: web::Data<AppState>,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let raw = body_of(&state, payload).await?;
    let limits = model_limits(&state);
    let body = TokenizeBody::parse(&raw, limits)?;
    drop(raw);
    check_model(body.model.as_deref(), &state.model_name)?;
    let tok = &state.engine.tokenizer;
    let tokens = match body.input {
        TokenizeInput::Prompt(p) => prompt_tokens(Prompt::Text(p), tok)?,
        TokenizeInput::Messages {
            messages,
            add_generation_prompt,
        } => chat_tokens(&state.chat, &messages, add_generation_prompt, tok)?,
    };
    Ok(HttpResponse::Ok().json(json!({
        "count": tokens.len(), "max_model_len": limits.max_positions, "tokens": tokens,
    })))
}

/// `POST /detokenize`: the text of token ids (control tokens written out), as vLLM answers.
async fn detokenize(
    state: web::Data<AppState>,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let raw = body_of(&state, payload).await?;
    let body = DetokenizeBody::parse(&raw, model_limits(&state))?;
    drop(raw);
    check_model(body.model.as_deref(), &state.model_name)?;
    let text = state
        .engine
        .tokenizer
        .decode(&body.tokens, true)
        .map_err(|(i, t)| {
            ApiError::bad(
                Some("tokens"),
                format!("`tokens[{i}]` is {t}: not in the vocabulary"),
            )
        })?;
    Ok(HttpResponse::Ok().json(json!({ "prompt": text })))
}

fn model_object(state: &AppState) -> Value {
    json!({
        "id": state.model_name, "object": "model", "created": 0, "owned_by": "mstar-engine",
        "max_model_len": state.engine.limits.max_positions,
    })
}

async fn models(state: web::Data<AppState>) -> HttpResponse {
    HttpResponse::Ok().json(json!({"object": "list", "data": [model_object(&state)]}))
}

/// `GET /v1/models/{id}`: the served model, or 404 in OpenAI's form for another id.
async fn model_by_id(
    state: web::Data<AppState>,
    id: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    if *id != state.model_name {
        return Err(model_not_found(&id, &state.model_name, None));
    }
    Ok(HttpResponse::Ok().json(model_object(&state)))
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
        .route("/v1/chat/completions", web::post().to(chat_completions))
        .route("/v1/models", web::get().to(models))
        .route("/v1/models/{id:.*}", web::get().to(model_by_id))
        .route("/tokenize", web::post().to(tokenize))
        .route("/detokenize", web::post().to(detokenize))
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
        Self::start_with_template(engine, model_name, addr, limits, None)
    }

    /// As [`start_with`](Self::start_with), rendering chats with `chat_template` (Jinja)
    /// instead of the model's own. A template that does not compile is reported at start
    /// (logged), and every chat request is then refused with 400 saying why.
    ///
    /// # Errors
    /// The address cannot be bound.
    pub fn start_with_template(
        engine: EngineHandle,
        model_name: &str,
        addr: &str,
        limits: ServerLimits,
        chat_template: Option<&str>,
    ) -> std::io::Result<Server> {
        let chat = chat_template_of(&engine.tokenizer, chat_template);
        if let Err(e) = &chat {
            tracing::warn!(error = %e, "chat completions will be refused");
        }
        let state = web::Data::new(AppState {
            engine,
            model_name: model_name.to_owned(),
            metrics: crate::metrics::install(),
            draining: AtomicBool::new(false),
            limits,
            chat,
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
