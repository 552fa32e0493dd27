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
//! clients wait in the kernel's listen queue, and a connection that fills the last slot sheds
//! the one waiting on its client longest: [`crate::conns`]), request headers within
//! `header_timeout`, the body within `body_timeout` and [`crate::api::body_limit`] bytes.
//!
//! The server is actix-web's `HttpServer` assembled from its parts (actix-server's acceptor,
//! actix-http's HTTP/1 service, the actix-web app), so that each accepted stream is wrapped in
//! a [`Tracked`] one.

use std::net::{SocketAddr, ToSocketAddrs};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use actix_http::HttpService;
use actix_service::{map_config, IntoServiceFactory, ServiceFactoryExt};
use actix_web::body::{BodySize, BoxBody, MessageBody};
use actix_web::dev::{fn_service, AppConfig, Extensions, Service};
use actix_web::http::{header, ConnectionType, StatusCode};
use actix_web::rt::net::TcpStream;
use actix_web::web::{Bytes, BytesMut};
use actix_web::{web, App, HttpRequest, HttpResponse};
use futures_util::{stream, StreamExt};
use metrics_exporter_prometheus::PrometheusHandle;
use serde::ser::{SerializeMap, Serializer};
use serde::Serialize;
use serde_json::{json, Value};
use tokio::sync::{mpsc, Semaphore};

use crate::api::{
    body_limit, check_model, model_not_found, ApiError, ChatBody, CompletionBody, DetokenizeBody,
    ModelLimits, Prompt, Settings, TokenizeBody, TokenizeInput,
};
use crate::chat::{ChatTemplate, Message, CHATML};
use crate::conns::{Conn, Connections, RequestGuard, Tracked};
use crate::engine::{EngineHandle, Event, Finish, GenRequest, SubmitError};
use crate::tokenizer::{Tokenizer, Utf8Decoder};

/// How the server bounds its clients.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ServerLimits {
    /// Connections open at once, over all workers (idle ones included); further clients wait
    /// in the kernel's listen queue. The default is what the descriptor limit allows
    /// ([`default_max_connections`]): an idle connection costs a socket and a few kilobytes,
    /// and is closed after `header_timeout`. A connection that fills the last slot sheds the
    /// one that has waited on its client longest ([`crate::conns`]).
    pub max_connections: usize,
    /// Requests whose bodies are read at once (the memory of bodies in flight: each at most
    /// [`crate::api::body_limit`] bytes); a request beyond waits for a slot within its body
    /// deadline. `GET` routes (`/health`, `/metrics`, ...) never wait for one.
    pub max_active_requests: usize,
    /// How long a client may take to send a request's headers, and how long a connection may
    /// stay idle between requests.
    pub header_timeout: Duration,
    /// How long a client may take to send a request's body, counted from its headers however
    /// slowly it trickles.
    pub body_timeout: Duration,
}

impl Default for ServerLimits {
    fn default() -> Self {
        ServerLimits {
            max_connections: default_max_connections(),
            max_active_requests: 256,
            header_timeout: Duration::from_secs(5),
            body_timeout: Duration::from_secs(10),
        }
    }
}

/// Descriptors kept free of connections: the listening socket, the model's and the step log's
/// files, the runtime's own, the standard streams, with room to spare.
pub const RESERVED_DESCRIPTORS: u64 = 64;

/// The process's soft limit on open descriptors (`RLIMIT_NOFILE`), if it can be read.
pub fn descriptor_limit() -> Option<u64> {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the struct it is given and nothing else.
    let ok = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } == 0;
    // rlim_t is u32 on some 32-bit targets.
    #[allow(clippy::unnecessary_cast)]
    ok.then_some(r.rlim_cur as u64)
}

/// Raises the soft descriptor limit to the hard one (as servers do at start: service managers
/// often set a soft limit of 1,024, or less, below a hard limit many times that). Answers
/// the soft limit now in force.
pub fn raise_descriptor_limit() -> Option<u64> {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit read or write only the struct they are given.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) != 0 {
            return None;
        }
        if r.rlim_cur < r.rlim_max {
            let raised = libc::rlimit {
                rlim_cur: r.rlim_max,
                rlim_max: r.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                r.rlim_cur = r.rlim_max;
            }
        }
    }
    #[allow(clippy::unnecessary_cast)] // rlim_t is u32 on some 32-bit targets
    Some(r.rlim_cur as u64)
}

/// Connections the descriptor limit allows, less [`RESERVED_DESCRIPTORS`] (at least 16, at
/// most 65,536): at the cap the server stops accepting, and a new client waits in the listen
/// queue until a connection closes, instead of the accept failing for want of a descriptor.
pub fn default_max_connections() -> usize {
    let limit = descriptor_limit().unwrap_or(1024);
    limit.saturating_sub(RESERVED_DESCRIPTORS).clamp(16, 65_536) as usize
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
    /// Slots for requests whose bodies are being read ([`ServerLimits::max_active_requests`]).
    pub reading: Arc<Semaphore>,
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
    let text = chat_text(chat, messages, add_generation_prompt)?;
    tok.encode(&text)
        .map_err(|e| ApiError::bad(Some("messages"), e.to_string()))
}

/// A chat's prompt text: `messages` rendered with the template.
///
/// # Errors
/// As [`chat_tokens`].
pub fn chat_text(
    chat: &Result<ChatTemplate, String>,
    messages: &[Message],
    add_generation_prompt: bool,
) -> Result<String, ApiError> {
    let template = chat
        .as_ref()
        .map_err(|e| ApiError::bad(Some("messages"), e.clone()))?;
    template
        .render(messages, add_generation_prompt)
        .map_err(|e| ApiError::bad(Some("messages"), e))
}

/// A completion's `max_tokens` when it gives none (OpenAI's default).
pub const DEFAULT_MAX_TOKENS: u32 = 16;

/// The request for the engine: `prompt` with `settings`, its length checked against the
/// model's context. Without `max_tokens`, a chat (`prompt_field` `messages`, `to_context`)
/// may run to the context (or the KV capacity, if smaller); a completion's default is 16
/// tokens.
fn gen_request(
    state: &AppState,
    prompt: Vec<u32>,
    prompt_field: &str,
    settings: Settings,
    to_context: bool,
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
    let max_tokens = match settings.max_tokens {
        Some(m) => u64::from(m),
        None if to_context => room - n,
        None => DEFAULT_MAX_TOKENS.into(),
    };
    if n + max_tokens > context {
        let field = settings.max_tokens_field;
        return Err(ApiError::bad(
            Some(field),
            format!(
                "the prompt ({n} tokens) + `{field}` ({max_tokens}) = {} exceeds the model's context of {context} tokens",
                n + max_tokens
            ),
        ));
    }
    let min_tokens = settings.sampling.min_tokens;
    if u64::from(min_tokens) > max_tokens {
        return Err(ApiError::bad(
            Some("min_tokens"),
            format!(
                "`min_tokens` is {min_tokens}: at most the {max_tokens} tokens the request may generate"
            ),
        ));
    }
    Ok(GenRequest {
        prompt,
        max_tokens: u32::try_from(max_tokens).unwrap_or(u32::MAX),
        sampling: settings.sampling,
    })
}

/// Reads a request body of at most `limit` bytes within `timeout`.
///
/// # Errors
/// 413 past `limit`, 408 past `timeout`, 400 for a body that broke off.
pub async fn read_body(
    payload: web::Payload,
    limit: usize,
    timeout: Duration,
) -> Result<Bytes, ApiError> {
    read_body_by(
        payload,
        limit,
        tokio::time::Instant::now() + timeout,
        timeout,
    )
    .await
}

fn too_slow(timeout: Duration) -> ApiError {
    ApiError::with_status(
        StatusCode::REQUEST_TIMEOUT,
        "invalid_request_error",
        format!(
            "the request body did not arrive within {} s",
            timeout.as_secs_f64()
        ),
    )
}

fn too_large(limit: usize) -> ApiError {
    ApiError::with_status(
        StatusCode::PAYLOAD_TOO_LARGE,
        "invalid_request_error",
        format!("the request body exceeds {limit} bytes, the most a prompt that fills the model's context needs"),
    )
}

/// Reads a request body of at most `limit` bytes by `deadline` (`timeout` from the headers).
///
/// # Errors
/// 413 past `limit`, 408 past `deadline`, 400 for a body that broke off.
async fn read_body_by(
    mut payload: web::Payload,
    limit: usize,
    deadline: tokio::time::Instant,
    timeout: Duration,
) -> Result<Bytes, ApiError> {
    let mut body = BytesMut::new();
    loop {
        let chunk = match tokio::time::timeout_at(deadline, payload.next()).await {
            Err(_) => return Err(too_slow(timeout)),
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
            return Err(too_large(limit));
        }
        body.extend_from_slice(&chunk);
    }
}

fn model_limits(state: &AppState) -> ModelLimits {
    state.engine.limits
}

/// Reads a body of the request's limit, refusing while shutting down. The deadline counts
/// from now (the handler runs once the headers are in): waiting for a reading slot and the
/// body's arrival both fall within it. A `Content-Length` past the limit is refused at once,
/// before a byte of the body is read (the connection then closes). Until the body is in, the
/// request's connection may be shed at the connection cap ([`crate::conns`]): 503, and the
/// connection closes.
async fn body_of(
    state: &AppState,
    req: &HttpRequest,
    payload: web::Payload,
) -> Result<Bytes, ApiError> {
    let timeout = state.limits.body_timeout;
    let deadline = tokio::time::Instant::now() + timeout;
    if state.draining.load(Ordering::Relaxed) {
        return Err(SubmitError::Draining.into());
    }
    let limit = body_limit(model_limits(state).max_positions);
    if let Some(v) = req.headers().get(header::CONTENT_LENGTH) {
        // actix has already refused a malformed Content-Length (400).
        let announced = v.to_str().ok().and_then(|v| v.trim().parse::<u64>().ok());
        if announced.is_some_and(|n| n > limit as u64) {
            return Err(too_large(limit));
        }
    }
    let read = async {
        let _slot = tokio::time::timeout_at(deadline, state.reading.acquire())
            .await
            .map_err(|_| too_slow(timeout))?
            .map_err(|_| ApiError::from(SubmitError::Draining))?;
        read_body_by(payload, limit, deadline, timeout).await
    };
    let Some(conn) = req.conn_data::<Arc<Conn>>() else {
        return read.await;
    };
    let _reading = conn.reading();
    tokio::select! {
        body = read => body,
        () = conn.body_shed() => Err(shed()),
    }
}

fn shed() -> ApiError {
    ApiError::with_status(
        StatusCode::SERVICE_UNAVAILABLE,
        "server_overloaded",
        "the server is at its connection cap: this request, whose body was still coming, was shed to let a new client in",
    )
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

    /// Adds text without looking for stop strings in it (the first `min_tokens` tokens'):
    /// returns it with whatever was held; later text is matched from after it.
    pub fn pass(&mut self, text: &str) -> String {
        if self.stopped {
            return String::new();
        }
        let mut out = std::mem::take(&mut self.held);
        out.push_str(text);
        out
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
    /// The most likely tokens, most likely first.
    top: Vec<(String, Vec<u8>, f32)>,
    /// Where the token's text begins in the choice's text, in characters (OpenAI's
    /// `text_offset`).
    offset: usize,
}

/// What a generation's events become: text decided so far, logprobs of the tokens it came from,
/// and at the end why it finished.
#[derive(Default)]
struct Piece {
    text: String,
    logprobs: Vec<TokenLp>,
    finish: Option<Finish>,
    /// Tokens the piece came from (1 for a token, 0 for the end).
    tokens: u32,
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
    /// Stop strings are not looked for in the text of the first `min_tokens` tokens (vLLM).
    min_tokens: u32,
    completion_tokens: u32,
    /// Characters of the logprobs' token texts so far (the next `text_offset`).
    offset: usize,
    done: bool,
}

impl Generation {
    async fn start(state: &AppState, req: GenRequest) -> Result<Self, ApiError> {
        let tok = state.engine.tokenizer.clone();
        let p = &req.sampling;
        let mut ends = p.stop_tokens.clone();
        ends.push(tok.eos());
        let stop = StopText::new(p.stop.clone());
        let ignore_eos = p.ignore_eos;
        let min_tokens = p.min_tokens;
        let (rid, rx) = state.engine.submit(req).await?;
        Ok(Generation {
            rid,
            rx,
            engine: state.engine.clone(),
            utf8: Utf8Stream::new(tok.clone()),
            tokenizer: tok,
            stop,
            ends,
            ignore_eos,
            min_tokens,
            completion_tokens: 0,
            offset: 0,
            done: false,
        })
    }

    /// The `n` generations of `req` (its `sampling.n`), seeded `seed`, `seed + 1`, ... when it
    /// has a seed (else each draws a fresh one). Each is a request of its own to the engine (it
    /// prefills the prompt itself); if one is refused, those started are dropped, and the
    /// engine aborts them at its next turn.
    async fn start_n(state: &AppState, req: GenRequest) -> Result<Vec<Self>, ApiError> {
        let n = req.sampling.n;
        let mut out = Vec::with_capacity(n.into());
        for i in 0..u64::from(n) {
            let mut r = req.clone();
            r.sampling.seed = req.sampling.seed.map(|s| s.wrapping_add(i));
            out.push(Self::start(state, r).await?);
        }
        Ok(out)
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
                let mut p = Piece {
                    tokens: 1,
                    ..Piece::default()
                };
                let ending = !self.ignore_eos && self.ends.contains(&id);
                if let (Some(lp), false) = (logprobs, ending) {
                    let (text, bytes) = self.shown(id);
                    let offset = self.offset;
                    self.offset += text.chars().count();
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
                        offset,
                    });
                }
                let text = self.utf8.push(id);
                let (text, stopped) = if self.completion_tokens <= self.min_tokens {
                    (self.stop.pass(&text), false)
                } else {
                    self.stop.push(&text)
                };
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
                    tokens: 0,
                })
            }
            None => {
                self.done = true;
                None
            }
        }
    }

    /// The whole generation: its text, logprobs and why it finished (`None`: the engine
    /// stopped).
    async fn collect(mut self) -> Option<(String, Vec<TokenLp>, Finish, u32)> {
        let mut text = String::new();
        let mut lps = Vec::new();
        while let Some(p) = self.next().await {
            text.push_str(&p.text);
            lps.extend(p.logprobs);
            if let Some(f) = p.finish {
                return Some((text, lps, f, self.completion_tokens));
            }
        }
        None
    }
}

// === the response bodies ===

/// A top-logprobs map of the legacy completions, serialised in rank order (most likely first)
/// rather than by token text.
struct Ranked<'a>(&'a [(String, Vec<u8>, f32)]);

impl Serialize for Ranked<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(Some(self.0.len()))?;
        for (text, _, lp) in self.0 {
            m.serialize_entry(text, lp)?;
        }
        m.end()
    }
}

/// The legacy completions' `logprobs` object.
#[derive(Serialize)]
struct CompletionLogprobs<'a> {
    tokens: Vec<&'a str>,
    token_logprobs: Vec<f32>,
    top_logprobs: Vec<Ranked<'a>>,
    text_offset: Vec<usize>,
}

impl<'a> CompletionLogprobs<'a> {
    fn of(lps: &'a [TokenLp]) -> Self {
        CompletionLogprobs {
            tokens: lps.iter().map(|l| l.text.as_str()).collect(),
            token_logprobs: lps.iter().map(|l| l.logprob).collect(),
            top_logprobs: lps.iter().map(|l| Ranked(&l.top)).collect(),
            text_offset: lps.iter().map(|l| l.offset).collect(),
        }
    }
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

/// One choice of a response or chunk.
#[derive(Serialize)]
#[serde(untagged)]
enum ChoiceOut<'a> {
    Completion {
        text: &'a str,
        index: usize,
        logprobs: Option<CompletionLogprobs<'a>>,
        finish_reason: Option<&'static str>,
    },
    /// A whole chat answer (`message`) or a chunk of one (`delta`).
    Chat {
        index: usize,
        #[serde(skip_serializing_if = "Option::is_none")]
        message: Option<Value>,
        #[serde(skip_serializing_if = "Option::is_none")]
        delta: Option<Value>,
        logprobs: Option<Value>,
        finish_reason: Option<&'static str>,
    },
}

/// A response's `usage`: absent, `null` (a chunk before `include_usage`'s last), or counts.
enum Usage {
    Absent,
    Null,
    Counts(Value),
}

impl Serialize for Usage {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Usage::Counts(v) => v.serialize(s),
            Usage::Absent | Usage::Null => s.serialize_none(),
        }
    }
}

/// A response or a streamed chunk.
#[derive(Serialize)]
struct Body<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: Vec<ChoiceOut<'a>>,
    #[serde(skip_serializing_if = "Usage::is_absent")]
    usage: Usage,
}

impl Usage {
    fn is_absent(&self) -> bool {
        matches!(self, Usage::Absent)
    }
}

impl Body<'_> {
    fn text(&self) -> String {
        // Serialising plain strings, numbers and maps with string keys cannot fail.
        serde_json::to_string(self).unwrap_or_default()
    }
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

    fn object(&self, streamed: bool) -> &'static str {
        match (self.shape, streamed) {
            (Shape::Completion, _) => "text_completion",
            (Shape::Chat, false) => "chat.completion",
            (Shape::Chat, true) => "chat.completion.chunk",
        }
    }

    fn body<'a>(&'a self, streamed: bool, choices: Vec<ChoiceOut<'a>>, usage: Usage) -> Body<'a> {
        Body {
            id: &self.id,
            object: self.object(streamed),
            created: self.created,
            model: &self.model,
            choices,
            usage,
        }
    }

    /// Choice `index` holding `text` and the logprobs of its tokens; a chat's is a `message`
    /// (whole) or a `delta` (streamed).
    fn choice<'a>(
        &self,
        index: usize,
        text: &'a str,
        lps: &'a [TokenLp],
        finish: Option<Finish>,
        streamed: bool,
    ) -> ChoiceOut<'a> {
        let finish_reason = finish.map(Finish::as_str);
        match self.shape {
            Shape::Completion => ChoiceOut::Completion {
                text,
                index,
                logprobs: self.logprobs.then(|| CompletionLogprobs::of(lps)),
                finish_reason,
            },
            Shape::Chat => {
                let logprobs = self.logprobs.then(|| chat_logprobs(lps));
                let (message, delta) = if !streamed {
                    (Some(json!({"role": "assistant", "content": text})), None)
                } else if text.is_empty() && finish.is_some() {
                    (None, Some(json!({})))
                } else {
                    (None, Some(json!({"content": text})))
                };
                ChoiceOut::Chat {
                    index,
                    message,
                    delta,
                    logprobs,
                    finish_reason,
                }
            }
        }
    }

    /// A streamed chunk of choice `index`'s piece; `usage` on the last unless it goes in a
    /// chunk of its own.
    fn chunk(&self, index: usize, p: &Piece, usage: Option<Value>) -> String {
        let usage = match usage {
            _ if self.include_usage => Usage::Null,
            Some(u) => Usage::Counts(u),
            None => Usage::Absent,
        };
        let c = self.choice(index, &p.text, &p.logprobs, p.finish, true);
        self.body(true, vec![c], usage).text()
    }

    /// A chat choice's first chunk: the assistant's role.
    fn role_chunk(&self, index: usize) -> String {
        let c = ChoiceOut::Chat {
            index,
            message: None,
            delta: Some(json!({"role": "assistant", "content": ""})),
            logprobs: None,
            finish_reason: None,
        };
        let usage = if self.include_usage {
            Usage::Null
        } else {
            Usage::Absent
        };
        self.body(true, vec![c], usage).text()
    }

    /// `stream_options.include_usage`'s last chunk: no choice, the usage.
    fn usage_chunk(&self, usage: Value) -> String {
        self.body(true, Vec::new(), Usage::Counts(usage)).text()
    }
}

fn sse(body: &str) -> String {
    format!("data: {body}\n\n")
}

/// The merged stream's state: choices not finished yet, tokens generated over all.
struct Merged {
    live: usize,
    prompt_tokens: u32,
    completion_tokens: u32,
}

/// Answers a request's generations (its `n` choices): whole, or streamed as server-sent events
/// (one event per token of any choice, each naming its choice's `index`, whose text may be
/// empty while it is held back; a chat choice's first event carries the role; a choice's last
/// carries its `finish_reason`; the last choice's last carries `usage`, or with
/// `include_usage` a chunk of its own follows; then `data: [DONE]`).
async fn respond(
    gens: Vec<Generation>,
    prompt_tokens: u32,
    w: Writer,
    streamed: bool,
) -> Result<HttpResponse, ApiError> {
    if streamed {
        let n = gens.len();
        let first: String = match w.shape {
            Shape::Chat => (0..n).map(|i| sse(&w.role_chunk(i))).collect(),
            Shape::Completion => String::new(),
        };
        let pieces = stream::select_all(gens.into_iter().enumerate().map(|(i, g)| {
            Box::pin(stream::unfold(g, move |mut g| async move {
                g.next().await.map(|p| ((i, p), g))
            }))
        }));
        let state = Merged {
            live: n,
            prompt_tokens,
            completion_tokens: 0,
        };
        let events = pieces.scan(state, move |m, (i, p)| {
            m.completion_tokens += p.tokens;
            if p.finish.is_some() {
                m.live -= 1;
            }
            let out = if m.live == 0 {
                let u = usage(m.prompt_tokens, m.completion_tokens);
                let mut out = sse(&w.chunk(i, &p, Some(u.clone())));
                if w.include_usage {
                    out.push_str(&sse(&w.usage_chunk(u)));
                }
                out.push_str("data: [DONE]\n\n");
                out
            } else {
                sse(&w.chunk(i, &p, None))
            };
            std::future::ready(Some(Ok::<_, actix_web::Error>(Bytes::from(out))))
        });
        let s = stream::iter((!first.is_empty()).then(|| Ok(Bytes::from(first)))).chain(events);
        return Ok(HttpResponse::Ok()
            .content_type("text/event-stream")
            .insert_header(("Cache-Control", "no-cache"))
            .streaming(s));
    }
    let done = futures_util::future::join_all(gens.into_iter().map(Generation::collect)).await;
    let done: Vec<_> = done
        .into_iter()
        .collect::<Option<_>>()
        .ok_or(ApiError::from(SubmitError::Stopped))?;
    let completion_tokens = done.iter().map(|d| d.3).sum();
    let choices = done
        .iter()
        .enumerate()
        .map(|(i, (text, lps, f, _))| w.choice(i, text, lps, Some(*f), false))
        .collect();
    let body = w
        .body(
            false,
            choices,
            Usage::Counts(usage(prompt_tokens, completion_tokens)),
        )
        .text();
    Ok(HttpResponse::Ok()
        .content_type("application/json")
        .body(body))
}

async fn completions(
    state: web::Data<AppState>,
    req: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let raw = body_of(&state, &req, payload).await?;
    let body = CompletionBody::parse(&raw, model_limits(&state))?;
    drop(raw);
    check_model(body.model.as_deref(), &state.model_name)?;
    let prompt = prompt_tokens(body.prompt, &state.engine.tokenizer)?;
    let (stream, include_usage) = (body.settings.stream, body.settings.include_usage);
    let r = gen_request(&state, prompt, "prompt", body.settings, false)?;
    let (prompt_len, logprobs) = (r.prompt.len() as u32, r.sampling.logprobs.is_some());
    let gens = Generation::start_n(&state, r).await?;
    let w = Writer::new(
        Shape::Completion,
        gens[0].rid,
        &state.model_name,
        logprobs,
        include_usage,
    );
    respond(gens, prompt_len, w, stream).await
}

/// The token that ends an assistant's turn in ChatML.
pub const IM_END: &str = "<|im_end|>";

async fn chat_completions(
    state: web::Data<AppState>,
    req: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let raw = body_of(&state, &req, payload).await?;
    let body = ChatBody::parse(&raw, model_limits(&state))?;
    drop(raw);
    check_model(body.model.as_deref(), &state.model_name)?;
    let tok = &state.engine.tokenizer;
    let prompt = chat_tokens(&state.chat, &body.messages, true, tok)?;
    let mut settings = body.settings;
    let (stream, include_usage) = (settings.stream, settings.include_usage);
    settings.sampling.stop_tokens = tok.token_id(IM_END).into_iter().collect();
    let r = gen_request(&state, prompt, "messages", settings, true)?;
    let (prompt_len, logprobs) = (r.prompt.len() as u32, r.sampling.logprobs.is_some());
    let gens = Generation::start_n(&state, r).await?;
    let w = Writer::new(
        Shape::Chat,
        gens[0].rid,
        &state.model_name,
        logprobs,
        include_usage,
    );
    respond(gens, prompt_len, w, stream).await
}

/// `POST /tokenize`: a prompt's (or a conversation's) token ids, as vLLM answers.
async fn tokenize(
    state: web::Data<AppState>,
    req: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let raw = body_of(&state, &req, payload).await?;
    let limits = model_limits(&state);
    let body = TokenizeBody::parse(&raw, limits)?;
    drop(raw);
    check_model(body.model.as_deref(), &state.model_name)?;
    let tok = &state.engine.tokenizer;
    // `add_special_tokens` (absent: true, as a completion's prompt and a chat's rendered text
    // are encoded) adds the BOS the vocabulary asks for, as a Hugging Face tokenizer does.
    let add = body.add_special_tokens.unwrap_or(true);
    let (text, field) = match body.input {
        TokenizeInput::Prompt(p) => (p, "prompt"),
        TokenizeInput::Messages {
            messages,
            add_generation_prompt,
        } => (
            chat_text(&state.chat, &messages, add_generation_prompt)?,
            "messages",
        ),
    };
    let tokens = tok
        .encode_with(&text, add)
        .map_err(|e| ApiError::bad(Some(field), e.to_string()))?;
    let strs = body.return_token_strs.then(|| {
        tokens
            .iter()
            .map(|&t| tok.token_text(t).unwrap_or_default())
            .collect::<Vec<_>>()
    });
    Ok(HttpResponse::Ok().json(json!({
        "count": tokens.len(), "max_model_len": limits.max_positions, "tokens": tokens,
        "token_strs": strs,
    })))
}

/// `POST /detokenize`: the text of token ids (control tokens written out), as vLLM answers.
async fn detokenize(
    state: web::Data<AppState>,
    req: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let raw = body_of(&state, &req, payload).await?;
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

/// The served model in vLLM's model card: `root` (the model it is, here its served name) and
/// `parent` (null: not an adapter) are read by vLLM's load generator.
fn model_object(state: &AppState) -> Value {
    json!({
        "id": state.model_name, "object": "model", "created": 0, "owned_by": "mstar-engine",
        "root": state.model_name, "parent": null,
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

/// `/health`: 200 `{"status": "ok"}` while serving, 503 while shutting down. With a time
/// budget (`--max-step-ms`), `time_budget` says whether it is in force: the component's latency
/// model source, and the steps planned without it and why the latest was (no latency model yet:
/// `--learn-cost` without `--cost`, the fit not trusted). Not in force is still 200: the engine
/// serves, and a probe that restarted it would only start the fit over.
async fn health(state: web::Data<AppState>) -> HttpResponse {
    if state.draining.load(Ordering::Relaxed) {
        return HttpResponse::ServiceUnavailable().json(json!({"status": "draining"}));
    }
    let Some(max_step_ms) = state.engine.max_step_ms else {
        return HttpResponse::Ok().json(json!({"status": "ok"}));
    };
    let time_budget = match state
        .engine
        .chunking
        .latency_model(crate::engine::NODE)
        .await
    {
        Ok(r) => json!({
            "max_step_ms": max_step_ms,
            "in_force": r.model.is_some(),
            "inactive_steps": r.time_inactive_steps,
            "inactive_reason": r.time_inactive.map(|w| w.as_str()),
            "model_source": r.source.as_str(),
        }),
        Err(e) => json!({"max_step_ms": max_step_ms, "error": e.to_string()}),
    };
    HttpResponse::Ok().json(json!({"status": "ok", "time_budget": time_budget}))
}

/// `/ping` (GET or POST, as vLLM and SageMaker probe): 200 with no body while serving, 503
/// while shutting down.
async fn ping(state: web::Data<AppState>) -> HttpResponse {
    if state.draining.load(Ordering::Relaxed) {
        HttpResponse::ServiceUnavailable().finish()
    } else {
        HttpResponse::Ok().finish()
    }
}

/// `/version`: the engine's version, in vLLM's shape.
async fn version() -> HttpResponse {
    HttpResponse::Ok().json(json!({"version": env!("CARGO_PKG_VERSION")}))
}

/// The header naming a request, echoed on its response.
pub const REQUEST_ID: &str = "x-request-id";

/// The most bytes of a client's `x-request-id` echoed; a longer one, or one with other than
/// visible ASCII, is replaced by a new id.
pub const MAX_REQUEST_ID: usize = 256;

/// The client's `x-request-id` when it is a sensible one, else a new random id (32 hex digits).
pub fn request_id(given: Option<&header::HeaderValue>) -> header::HeaderValue {
    if let Some(v) = given {
        let b = v.as_bytes();
        if !b.is_empty() && b.len() <= MAX_REQUEST_ID && b.iter().all(|c| c.is_ascii_graphic()) {
            return v.clone();
        }
    }
    let id = format!("{:032x}", rand::random::<u128>());
    header::HeaderValue::from_str(&id).expect("hex digits are a valid header value")
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
        .route("/ping", web::get().to(ping))
        .route("/ping", web::post().to(ping))
        .route("/version", web::get().to(version))
        .route("/metrics", web::get().to(metrics_page));
}

/// The listen queue's length asked of the kernel (as actix-web's).
pub const LISTEN_BACKLOG: i32 = 1024;

/// Binds the first of `addr`'s addresses that binds (as actix-web's `HttpServer::bind`), with
/// `SO_REUSEADDR` and a listen queue of [`LISTEN_BACKLOG`].
fn listener(addr: &str) -> std::io::Result<std::net::TcpListener> {
    use socket2::{Domain, Protocol, Socket, Type};
    let mut failed = None;
    for a in addr.to_socket_addrs()? {
        let bound = Socket::new(Domain::for_address(a), Type::STREAM, Some(Protocol::TCP))
            .and_then(|s| {
                s.set_reuse_address(true)?;
                s.bind(&a.into())?;
                s.listen(LISTEN_BACKLOG)?;
                Ok(s)
            });
        match bound {
            Ok(s) => return Ok(s.into()),
            Err(e) => failed = Some(e),
        }
    }
    Err(failed.unwrap_or_else(|| std::io::Error::other(format!("{addr}: no address to bind"))))
}

/// An answer's body, holding its request's count on the connection until it is sent (or
/// dropped with the connection).
struct Answer {
    body: BoxBody,
    _request: Option<RequestGuard>,
}

impl MessageBody for Answer {
    type Error = <BoxBody as MessageBody>::Error;

    fn size(&self) -> BodySize {
        self.body.size()
    }

    fn poll_next(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Bytes, Self::Error>>> {
        Pin::new(&mut self.get_mut().body).poll_next(cx)
    }
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
            reading: Arc::new(Semaphore::new(limits.max_active_requests.max(1))),
        });
        let listener = listener(addr)?;
        let addr = listener.local_addr()?;
        let conns = Connections::new(limits.max_connections);
        let per_worker = limits.max_connections.div_ceil(WORKERS).max(1);
        let builder = actix_server::Server::build();
        let graceful = builder.graceful_shutdown_signal();
        let s2 = state.clone();
        let server = builder
            .workers(WORKERS)
            .max_concurrent_connections(per_worker)
            .disable_signals()
            .shutdown_timeout(5)
            .listen("mstar-engine", listener, move || {
                let conns = conns.clone();
                let graceful = graceful.clone();
                let app = App::new()
                    .app_data(s2.clone())
                    // Every answer (errors and 404s too) names its request: the client's
                    // `x-request-id`, else a new one. The request counts on its connection
                    // until its answer is sent; a shed connection closes after the answer.
                    .wrap_fn(|req, srv| {
                        let id = request_id(req.headers().get(REQUEST_ID));
                        let conn = req.conn_data::<Arc<Conn>>().cloned();
                        let request = conn.as_ref().map(|c| c.request());
                        let fut = srv.call(req);
                        async move {
                            let mut res = fut.await?;
                            res.headers_mut()
                                .insert(header::HeaderName::from_static(REQUEST_ID), id);
                            if conn.is_some_and(|c| c.is_shed()) {
                                res.response_mut()
                                    .head_mut()
                                    .set_connection_type(ConnectionType::Close);
                            }
                            Ok(res.map_body(|_, body| {
                                BoxBody::new(Answer {
                                    body,
                                    _request: request,
                                })
                            }))
                        }
                    })
                    .configure(routes)
                    .into_factory()
                    .map_err(|e| e.error_response());
                let http = HttpService::build()
                    // Idle keep-alive connections close at once when the server stops.
                    .graceful_shutdown_signal(move || {
                        let graceful = graceful.clone();
                        async move { graceful.notified().await }
                    })
                    .client_request_timeout(limits.header_timeout)
                    .keep_alive(limits.header_timeout)
                    // After an answer that leaves a body unread (408, 413, 503), what the
                    // client still sends is read and dropped for up to 1 s before the
                    // connection closes, so that it reads the answer (actix-web's default).
                    .client_disconnect_timeout(Duration::from_secs(1))
                    // A client that closes its side has gone: end its handler (a plain request
                    // is then aborted like a dropped stream) instead of computing an answer
                    // nobody reads.
                    .h1_allow_half_closed(false)
                    .local_addr(addr)
                    // The connection's state, for the handlers that read bodies.
                    .on_connect_ext(|io: &Tracked<TcpStream>, ext: &mut Extensions| {
                        ext.insert(io.conn().clone());
                    })
                    // The app's configured host and address serve URL generation and
                    // connection info, which no route uses: the defaults do.
                    .h1(map_config(app, |()| AppConfig::default()));
                fn_service(move |io: TcpStream| {
                    let peer = io.peer_addr().ok();
                    let io = conns.admit(io);
                    std::future::ready(Ok::<_, actix_http::error::DispatchError>((io, peer)))
                })
                .and_then(http)
            })?
            .run();
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
