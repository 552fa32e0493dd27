//! The request bodies of the OpenAI-compatible API, parsed typed, and the OpenAI error object.
//!
//! A body is read as a JSON object whose values stay raw slices of the body
//! ([`serde_json::value::RawValue`]); each field the server knows is then parsed into its own
//! type, so a refusal names its field, and a token array becomes a `Vec<u32>` without ever
//! being a tree of JSON values. What is left is judged by [`refuse_unsupported`]: a field the
//! server does not implement is a 400 naming it, unless its value is the neutral one OpenAI
//! clients send by default (`n: 1`, penalties of 0, `user`, ...). Nothing is silently ignored.
//!
//! The body's size is bounded before it is parsed ([`body_limit`], sized to the model's
//! positions), and the server reads it under a deadline.

use std::borrow::Cow;
use std::fmt;

use actix_web::http::StatusCode;
use actix_web::{HttpResponse, ResponseError};
use serde::de::{self, DeserializeOwned, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::json;
use serde_json::value::RawValue;

use crate::sampling::SamplingParams;
pub use crate::sampling::MAX_TOP_LOGPROBS;

/// Body bytes allowed per model position: a token id with its separator, or one character of a
/// text prompt written as a JSON escape (`\u00e9`), with room to spare.
pub const BODY_BYTES_PER_POSITION: usize = 32;
/// Body bytes allowed besides the prompt (the other fields, whitespace).
pub const BODY_BYTES_BESIDES_PROMPT: usize = 64 << 10;
/// The most fields a body may have (known and refused ones together).
pub const MAX_FIELDS: usize = 64;

/// The largest request body the server reads for a model of `max_positions` positions: a
/// prompt that fills the context fits, a larger body is refused (413) before it is parsed.
pub fn body_limit(max_positions: usize) -> usize {
    max_positions
        .saturating_mul(BODY_BYTES_PER_POSITION)
        .saturating_add(BODY_BYTES_BESIDES_PROMPT)
}

// === the error object ===

/// An OpenAI error answer: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    /// The HTTP status.
    pub status: StatusCode,
    /// The OpenAI error `type` (`invalid_request_error`, `server_overloaded`, ...).
    pub kind: &'static str,
    /// What was wrong, for a person.
    pub message: String,
    /// The request field at fault, if one is.
    pub param: Option<String>,
    /// OpenAI's error `code` (`model_not_found`), if one applies.
    pub code: Option<&'static str>,
}

impl ApiError {
    /// A 400 `invalid_request_error`, naming `param` when a field is at fault.
    pub fn bad(param: Option<&str>, message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            message: message.into(),
            param: param.map(str::to_owned),
            code: None,
        }
    }

    /// Another status with its OpenAI `type`.
    pub fn with_status(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            kind,
            message: message.into(),
            param: None,
            code: None,
        }
    }
}

impl fmt::Display for ApiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl ResponseError for ApiError {
    fn status_code(&self) -> StatusCode {
        self.status
    }

    fn error_response(&self) -> HttpResponse {
        let mut r = HttpResponse::build(self.status);
        // A body refused before it was read whole (too slow, too large): the connection ends
        // with the answer, so its slot is free at once.
        if matches!(
            self.status,
            StatusCode::REQUEST_TIMEOUT | StatusCode::PAYLOAD_TOO_LARGE
        ) {
            r.force_close();
        }
        r.json(json!({
            "error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}
        }))
    }
}

// === the body as raw fields ===

/// A request body's top-level fields, each value a raw slice of the body, in body order.
#[derive(Debug)]
pub struct Fields<'a> {
    fields: Vec<(Cow<'a, str>, &'a RawValue)>,
}

impl<'de: 'a, 'a> Deserialize<'de> for Fields<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = Fields<'a>;

            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON object")
            }

            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut fields: Vec<(Cow<'a, str>, &'a RawValue)> = Vec::new();
                while let Some(key) = map.next_key::<Cow<'a, str>>()? {
                    if fields.len() == MAX_FIELDS {
                        return Err(de::Error::custom(format!("more than {MAX_FIELDS} fields")));
                    }
                    if fields.iter().any(|(k, _)| *k == key) {
                        return Err(de::Error::custom(format!(
                            "the field `{}` appears twice",
                            shown(&key)
                        )));
                    }
                    let value: &'a RawValue = map.next_value()?;
                    fields.push((key, value));
                }
                Ok(Fields { fields })
            }
        }
        d.deserialize_map(V(std::marker::PhantomData))
    }
}

/// A field name as a message shows it: escaped, at most 64 characters.
fn shown(key: &str) -> String {
    let mut s: String = key
        .chars()
        .take(64)
        .flat_map(char::escape_default)
        .collect();
    if key.chars().count() > 64 {
        s.push('…');
    }
    s
}

impl<'a> Fields<'a> {
    /// Reads `body` as a JSON object.
    ///
    /// # Errors
    /// Not JSON, not an object, a field twice, or more than [`MAX_FIELDS`] fields.
    pub fn parse(body: &'a [u8], what: &str) -> Result<Self, ApiError> {
        serde_json::from_slice(body).map_err(|e| {
            ApiError::bad(
                None,
                format!("the request body is not a valid {what} request: {e}"),
            )
        })
    }

    /// Takes field `key`, parsed as `T` (a `null` is as if absent).
    ///
    /// # Errors
    /// The value is not a `T`: a 400 naming the field and what it must be.
    pub fn take<T: DeserializeOwned>(
        &mut self,
        key: &str,
        must: &str,
    ) -> Result<Option<T>, ApiError> {
        let Some(i) = self.fields.iter().position(|(k, _)| k == key) else {
            return Ok(None);
        };
        let (_, raw) = self.fields.remove(i);
        if raw.get() == "null" {
            return Ok(None);
        }
        serde_json::from_str(raw.get()).map(Some).map_err(|_| {
            ApiError::bad(
                Some(key),
                format!("`{key}` must be {must}, not {}", excerpt(raw)),
            )
        })
    }

    /// Takes field `key` with a parser of its own (a `null` is as if absent).
    ///
    /// # Errors
    /// Whatever `parse` answers.
    pub fn take_with<T>(
        &mut self,
        key: &str,
        parse: impl FnOnce(&'a RawValue) -> Result<T, ApiError>,
    ) -> Result<Option<T>, ApiError> {
        let Some(i) = self.fields.iter().position(|(k, _)| k == key) else {
            return Ok(None);
        };
        let (_, raw) = self.fields.remove(i);
        if raw.get() == "null" {
            return Ok(None);
        }
        parse(raw).map(Some)
    }

    /// Ends the parse: every field left must pass [`refuse_unsupported`].
    ///
    /// # Errors
    /// The first field left that the server does not implement, named.
    pub fn finish(self) -> Result<(), ApiError> {
        for (key, raw) in &self.fields {
            refuse_unsupported(key, raw)?;
        }
        Ok(())
    }
}

/// At most 80 characters of a raw value, for a message.
fn excerpt(raw: &RawValue) -> String {
    let s = raw.get();
    let mut out: String = s.chars().take(80).collect();
    if s.chars().count() > 80 {
        out.push('…');
    }
    out
}

// === the refused-field rule ===

/// What a field the server does not implement may hold to be accepted: the value an OpenAI
/// client sends by default, which asks for nothing the server would ignore.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Neutral {
    /// This number (`n: 1`, `presence_penalty: 0`, ...).
    Number(f64),
    /// This boolean (`echo: false`).
    Bool(bool),
    /// An empty object (`logit_bias: {}`).
    EmptyObject,
    /// Any string (`user`: an end user's id, which only OpenAI's abuse monitoring reads).
    AnyString,
}

/// The OpenAI request fields this server does not implement, and the value of each it accepts.
/// Any other field, and any other value of these, is refused with a 400 naming it.
pub const NEUTRAL_FIELDS: &[(&str, Neutral)] = &[
    ("echo", Neutral::Bool(false)),
    ("skip_special_tokens", Neutral::Bool(true)),
    ("spaces_between_special_tokens", Neutral::Bool(true)),
    ("include_stop_str_in_output", Neutral::Bool(false)),
    ("continue_final_message", Neutral::Bool(false)),
    ("logit_bias", Neutral::EmptyObject),
    ("user", Neutral::AnyString),
];

/// Accepts a field the server does not implement only with its neutral value
/// ([`NEUTRAL_FIELDS`]; `null` is always neutral).
///
/// # Errors
/// A 400 naming the field: unknown to the server, or asking for what it does not do.
pub fn refuse_unsupported(key: &str, raw: &RawValue) -> Result<(), ApiError> {
    let v = raw.get();
    if v == "null" {
        return Ok(());
    }
    let Some((_, neutral)) = NEUTRAL_FIELDS.iter().find(|(k, _)| *k == key) else {
        return Err(ApiError::bad(
            Some(key),
            format!("`{}` is not supported by this server", shown(key)),
        ));
    };
    let ok = match neutral {
        Neutral::Number(n) => serde_json::from_str::<f64>(v).is_ok_and(|x| x == *n),
        Neutral::Bool(b) => serde_json::from_str::<bool>(v).is_ok_and(|x| x == *b),
        Neutral::EmptyObject => {
            serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(v)
                .is_ok_and(|m| m.is_empty())
        }
        Neutral::AnyString => serde_json::from_str::<String>(v).is_ok(),
    };
    if ok {
        return Ok(());
    }
    let want = match neutral {
        Neutral::Number(n) => format!("only {n} is supported"),
        Neutral::Bool(b) => format!("only {b} is supported"),
        Neutral::EmptyObject => "only {} is supported".to_owned(),
        Neutral::AnyString => "it must be a string".to_owned(),
    };
    Err(ApiError::bad(
        Some(key),
        format!("`{key}` is {}: {want} by this server", excerpt(raw)),
    ))
}

// === the prompt ===

/// A completion's `prompt`, parsed typed: text, or token ids (never a tree of JSON values).
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    /// A string (or an array holding one string).
    Text(String),
    /// An array of token ids.
    Tokens(Vec<u32>),
}

impl Prompt {
    /// Parses a raw `prompt`: a string, an array of one string, or an array of at most
    /// `max_tokens` token ids each below `vocab`.
    ///
    /// # Errors
    /// Anything else, naming the element at fault.
    pub fn parse(raw: &RawValue, vocab: u32, max_tokens: usize) -> Result<Self, ApiError> {
        Self::parse_field(raw, "prompt", vocab, max_tokens)
    }

    /// As [`parse`](Self::parse), for a field named `field`.
    ///
    /// # Errors
    /// Anything else, naming the element at fault.
    pub fn parse_field(
        raw: &RawValue,
        field: &'static str,
        vocab: u32,
        max_tokens: usize,
    ) -> Result<Self, ApiError> {
        let mut de = serde_json::Deserializer::from_str(raw.get());
        let seed = PromptSeed {
            field,
            vocab,
            max_tokens,
        };
        let parsed = de::DeserializeSeed::deserialize(seed, &mut de).map_err(|e| {
            ApiError::bad(
                Some(field),
                format!("`{field}` must be a string or an array of token ids: {e}"),
            )
        })?;
        match parsed {
            Parsed::Ok(p) => Ok(p),
            Parsed::Refused(m) => Err(ApiError::bad(Some(field), m)),
        }
    }
}

/// Parses a raw array of at most `max_tokens` token ids below `vocab` (`/detokenize`'s
/// `tokens`), typed as a prompt's.
///
/// # Errors
/// Not such an array, naming `field` or its element at fault.
pub fn token_ids(
    raw: &RawValue,
    field: &'static str,
    vocab: u32,
    max_tokens: usize,
) -> Result<Vec<u32>, ApiError> {
    if raw.get().trim() == "[]" {
        return Ok(Vec::new());
    }
    match Prompt::parse_field(raw, field, vocab, max_tokens)? {
        Prompt::Tokens(t) => Ok(t),
        Prompt::Text(_) => Err(ApiError::bad(
            Some(field),
            format!("`{field}` must be an array of token ids, not text"),
        )),
    }
}

enum Parsed {
    Ok(Prompt),
    Refused(String),
}

struct PromptSeed {
    field: &'static str,
    vocab: u32,
    max_tokens: usize,
}

impl<'de> de::DeserializeSeed<'de> for PromptSeed {
    type Value = Parsed;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Parsed, D::Error> {
        d.deserialize_any(self)
    }
}

/// One element of a prompt array.
enum Item {
    Id(u64),
    Text(String),
    Other(String),
}

impl<'de> Deserialize<'de> for Item {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Item;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a token id or a string")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Item, E> {
                Ok(Item::Id(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Item, E> {
                Ok(u64::try_from(v).map_or_else(|_| Item::Other(v.to_string()), Item::Id))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Item, E> {
                Ok(Item::Other(v.to_string()))
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<Item, E> {
                Ok(Item::Other(v.to_string()))
            }
            fn visit_unit<E: de::Error>(self) -> Result<Item, E> {
                Ok(Item::Other("null".into()))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Item, E> {
                Ok(Item::Text(v.to_owned()))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Item, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(Item::Other("an array".into()))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Item, A::Error> {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(Item::Other("an object".into()))
            }
        }
        d.deserialize_any(V)
    }
}

impl<'de> Visitor<'de> for PromptSeed {
    type Value = Parsed;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a string or an array of token ids")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Parsed, E> {
        Ok(Parsed::Ok(Prompt::Text(v.to_owned())))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Parsed, A::Error> {
        let mut ids: Vec<u32> = Vec::new();
        let mut i = 0usize;
        let mut refused = None;
        let mut text = None;
        let f = self.field;
        while let Some(item) = seq.next_element::<Item>()? {
            if refused.is_none() {
                refused = match item {
                    Item::Text(s) if i == 0 => {
                        text = Some(s);
                        None
                    }
                    Item::Text(_) => Some(format!(
                        "`{f}[{i}]` is a string: this server takes one prompt per request (a string, an array of one string, or an array of token ids)"
                    )),
                    _ if text.is_some() => Some(format!(
                        "`{f}` holds more than one string or a string beside token ids: this server takes one prompt per request"
                    )),
                    Item::Id(t) if t < u64::from(self.vocab) && ids.len() < self.max_tokens => {
                        ids.push(t as u32);
                        None
                    }
                    Item::Id(_) if ids.len() >= self.max_tokens => Some(format!(
                        "`{f}` has more than {} token ids, the model's context",
                        self.max_tokens
                    )),
                    Item::Id(t) => Some(format!(
                        "`{f}[{i}]` is {t}: token ids are whole numbers below {}",
                        self.vocab
                    )),
                    Item::Other(s) => Some(format!(
                        "`{f}[{i}]` is {s}: token ids are whole numbers below {}",
                        self.vocab
                    )),
                };
            }
            i += 1;
        }
        Ok(match (refused, text) {
            (Some(m), _) => Parsed::Refused(m),
            (None, Some(s)) => Parsed::Ok(Prompt::Text(s)),
            (None, None) if i == 0 => Parsed::Refused(format!("`{f}` is an empty array")),
            (None, None) => Parsed::Ok(Prompt::Tokens(ids)),
        })
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Parsed, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(Parsed::Refused(format!(
            "`{}` must be a string or an array of token ids, not an object",
            self.field
        )))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Parsed, E> {
        Ok(refused_scalar(self.field, &v.to_string()))
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Parsed, E> {
        Ok(refused_scalar(self.field, &v.to_string()))
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Parsed, E> {
        Ok(refused_scalar(self.field, &v.to_string()))
    }
    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Parsed, E> {
        Ok(refused_scalar(self.field, &v.to_string()))
    }
}

fn refused_scalar(field: &str, shown: &str) -> Parsed {
    Parsed::Refused(format!(
        "`{field}` must be a string or an array of token ids, not {shown}"
    ))
}

// === what both endpoints take ===

/// What the model bounds a request by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelLimits {
    /// Token ids are below this.
    pub vocab: u32,
    /// Positions of the model's context: a prompt has at most this many tokens.
    pub max_positions: usize,
}

/// The most stop strings a request may give (as OpenAI).
pub const MAX_STOPS: usize = 4;
/// The longest stop string, in bytes.
pub const MAX_STOP_BYTES: usize = 1024;
/// The most alternatives a completion's `logprobs` may ask for: 20, as vLLM's default
/// `--max-logprobs` allows (OpenAI's legacy API allowed 5), and as many as the engine gives.
pub const MAX_LOGPROBS: u8 = MAX_TOP_LOGPROBS;
/// The most choices (`n`) a request may ask for.
pub const MAX_N: u8 = 8;

/// A number field within `range` (both ends included unless said), or a 400 naming it.
fn number_in(
    f: &mut Fields<'_>,
    key: &str,
    lo: f64,
    hi: f64,
    lo_open: bool,
) -> Result<Option<f32>, ApiError> {
    let must = if lo_open {
        format!("a number above {lo}, at most {hi}")
    } else {
        format!("a number from {lo} to {hi}")
    };
    let Some(v) = f.take::<f64>(key, &must)? else {
        return Ok(None);
    };
    let above = if lo_open { v > lo } else { v >= lo };
    if !(above && v <= hi) {
        return Err(ApiError::bad(
            Some(key),
            format!("`{key}` is {v}: it must be {must}"),
        ));
    }
    Ok(Some(v as f32))
}

/// `seed`: any int64 (OpenAI's and vLLM's range), taken as its two's-complement bits. A whole
/// number outside it is refused rather than wrapped: 2^63 would otherwise seed the same draw as
/// -2^63.
fn seed(raw: &RawValue) -> Result<u64, ApiError> {
    let v = raw.get();
    if let Ok(i) = v.parse::<i64>() {
        return Ok(i as u64);
    }
    let whole = v.strip_prefix('-').unwrap_or(v);
    let message = if !whole.is_empty() && whole.bytes().all(|b| b.is_ascii_digit()) {
        format!(
            "`seed` is {}: it must be an int64, from {} to {}",
            excerpt(raw),
            i64::MIN,
            i64::MAX
        )
    } else {
        format!(
            "`seed` must be a whole number (an int64), not {}",
            excerpt(raw)
        )
    };
    Err(ApiError::bad(Some("seed"), message))
}

/// The settings both endpoints share, parsed and checked: how much to generate, how to answer,
/// and the sampling ([`SamplingParams`], each field's range checked here).
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    /// Tokens to generate at most (`max_tokens`, or its newer name `max_completion_tokens`).
    pub max_tokens: Option<u32>,
    /// Which of the two names set `max_tokens` (for a refusal naming it).
    pub max_tokens_field: &'static str,
    /// Stream server-sent events.
    pub stream: bool,
    /// `stream_options.include_usage`: usage in a final chunk of its own.
    pub include_usage: bool,
    /// The sampling fields (`logprobs` is each endpoint's own: set by its body's parse).
    pub sampling: SamplingParams,
}

impl Settings {
    /// Takes the shared fields out of `f`.
    ///
    /// # Errors
    /// A 400 naming the field at fault.
    pub fn take(f: &mut Fields<'_>) -> Result<Self, ApiError> {
        let mut max_tokens_field = "max_tokens";
        let mut max_tokens: Option<u32> = f.take("max_tokens", "a whole number of tokens ≥ 1")?;
        let newer: Option<u32> = f.take("max_completion_tokens", "a whole number of tokens ≥ 1")?;
        if let Some(n) = newer {
            if max_tokens.is_some_and(|m| m != n) {
                return Err(ApiError::bad(
                    Some("max_completion_tokens"),
                    "`max_completion_tokens` and `max_tokens` are the same setting: give one, or both equal",
                ));
            }
            max_tokens = Some(n);
            max_tokens_field = "max_completion_tokens";
        }
        if max_tokens == Some(0) {
            return Err(ApiError::bad(
                Some(max_tokens_field),
                format!("`{max_tokens_field}` must be at least 1"),
            ));
        }
        let temperature: Option<f64> = f.take("temperature", "a number from 0 to 2")?;
        if let Some(t) = temperature {
            if !(0.0..=2.0).contains(&t) {
                return Err(ApiError::bad(
                    Some("temperature"),
                    format!("`temperature` is {t}: it must be between 0 and 2"),
                ));
            }
        }
        let top_p: Option<f64> = f.take("top_p", "a number in (0, 1]")?;
        if let Some(p) = top_p {
            if !(p > 0.0 && p <= 1.0) {
                return Err(ApiError::bad(
                    Some("top_p"),
                    format!("`top_p` is {p}: it must be in (0, 1]"),
                ));
            }
        }
        let stream = f.take("stream", "a boolean")?.unwrap_or(false);
        let include_usage = match f.take_with("stream_options", stream_options)? {
            None => false,
            Some(_) if !stream => {
                return Err(ApiError::bad(
                    Some("stream_options"),
                    "`stream_options` is only allowed with `stream: true`",
                ))
            }
            Some(u) => u,
        };
        let top_k = match f.take::<i64>("top_k", "a whole number: -1 or 0 (off), or at least 1")? {
            None | Some(-1 | 0) => 0,
            Some(k) if k >= 1 => u32::try_from(k).unwrap_or(u32::MAX),
            Some(k) => {
                return Err(ApiError::bad(
                    Some("top_k"),
                    format!("`top_k` is {k}: it must be -1 or 0 (off), or at least 1"),
                ))
            }
        };
        let min_p = number_in(f, "min_p", 0.0, 1.0, false)?.unwrap_or(0.0);
        let repetition_penalty =
            number_in(f, "repetition_penalty", 0.0, f64::from(f32::MAX), true)?.unwrap_or(1.0);
        let presence_penalty = number_in(f, "presence_penalty", -2.0, 2.0, false)?.unwrap_or(0.0);
        let frequency_penalty = number_in(f, "frequency_penalty", -2.0, 2.0, false)?.unwrap_or(0.0);
        let min_tokens: u32 = f
            .take("min_tokens", "a whole number of tokens ≥ 0")?
            .unwrap_or(0);
        if let Some(m) = max_tokens.filter(|&m| min_tokens > m) {
            return Err(ApiError::bad(
                Some("min_tokens"),
                format!("`min_tokens` is {min_tokens}: at most `{max_tokens_field}` ({m})"),
            ));
        }
        let n: u8 = match f.take::<u64>("n", "a whole number from 1 to 8")? {
            None => 1,
            Some(n) if (1..=u64::from(MAX_N)).contains(&n) => n as u8,
            Some(n) => {
                return Err(ApiError::bad(
                    Some("n"),
                    format!("`n` is {n}: this server generates 1 to {MAX_N} choices"),
                ))
            }
        };
        // `best_of` n returns every one of n choices: the same as `n` alone.
        if let Some(b) = f.take::<f64>("best_of", "a whole number")? {
            if b != f64::from(n) {
                return Err(ApiError::bad(
                    Some("best_of"),
                    format!("`best_of` is {b}: only `n` ({n}) is supported by this server, which returns every choice it generates"),
                ));
            }
        }
        Ok(Settings {
            max_tokens,
            max_tokens_field,
            stream,
            include_usage,
            sampling: SamplingParams {
                temperature: temperature.map_or(1.0, |t| t as f32),
                top_p: top_p.map_or(1.0, |p| p as f32),
                top_k,
                min_p,
                repetition_penalty,
                presence_penalty,
                frequency_penalty,
                min_tokens,
                n,
                seed: f.take_with("seed", seed)?,
                stop: f.take_with("stop", stops)?.unwrap_or_default(),
                ignore_eos: f.take("ignore_eos", "a boolean")?.unwrap_or(false),
                stop_tokens: Vec::new(),
                logprobs: None,
            },
        })
    }
}

/// `stop`: a string, or an array of at most [`MAX_STOPS`] strings; none empty or longer than
/// [`MAX_STOP_BYTES`].
fn stops(raw: &RawValue) -> Result<Vec<String>, ApiError> {
    let must = format!("a string or an array of at most {MAX_STOPS} strings");
    let bad = |m: String| ApiError::bad(Some("stop"), m);
    let list: Vec<String> = match serde_json::from_str::<String>(raw.get()) {
        Ok(s) => vec![s],
        Err(_) => {
            let items: Vec<&RawValue> = serde_json::from_str(raw.get())
                .map_err(|_| bad(format!("`stop` must be {must}, not {}", excerpt(raw))))?;
            if items.len() > MAX_STOPS {
                return Err(bad(format!(
                    "`stop` has {} strings: at most {MAX_STOPS}",
                    items.len()
                )));
            }
            items
                .iter()
                .enumerate()
                .map(|(i, r)| {
                    serde_json::from_str::<String>(r.get()).map_err(|_| {
                        bad(format!("`stop[{i}]` must be a string, not {}", excerpt(r)))
                    })
                })
                .collect::<Result<_, _>>()?
        }
    };
    for s in &list {
        if s.is_empty() {
            return Err(bad("`stop` holds an empty string".into()));
        }
        if s.len() > MAX_STOP_BYTES {
            return Err(bad(format!(
                "a `stop` string has {} bytes: at most {MAX_STOP_BYTES}",
                s.len()
            )));
        }
    }
    Ok(list)
}

/// `stream_options`: an object whose only field is `include_usage` (a boolean).
fn stream_options(raw: &RawValue) -> Result<bool, ApiError> {
    let mut f = Fields::parse(raw.get().as_bytes(), "stream_options").map_err(|_| {
        ApiError::bad(
            Some("stream_options"),
            format!(
                "`stream_options` must be an object such as {{\"include_usage\": true}}, not {}",
                excerpt(raw)
            ),
        )
    })?;
    let include = f
        .take::<bool>("include_usage", "a boolean")
        .map_err(|e| ApiError::bad(Some("stream_options.include_usage"), e.message))?
        .unwrap_or(false);
    if let Some((key, _)) = f.fields.first() {
        let name = format!("stream_options.{}", shown(key));
        return Err(ApiError::bad(
            Some(&name),
            format!("`{name}` is not supported by this server"),
        ));
    }
    Ok(include)
}

/// The model's name, when given, must be the served one.
///
/// # Errors
/// Another name: 404 naming `model` (`model_not_found`), as OpenAI answers.
pub fn check_model(model: Option<&str>, served: &str) -> Result<(), ApiError> {
    match model {
        Some(m) if m != served => Err(model_not_found(m, served, Some("model"))),
        _ => Ok(()),
    }
}

/// The 404 for a model this server does not serve.
pub fn model_not_found(m: &str, served: &str, param: Option<&str>) -> ApiError {
    let mut e = ApiError::with_status(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        format!(
            "the model `{}` does not exist; this server serves `{served}`",
            shown(m)
        ),
    );
    e.param = param.map(str::to_owned);
    e.code = Some("model_not_found");
    e
}

// === POST /v1/completions ===

/// The body of `POST /v1/completions`, parsed and checked field by field.
#[derive(Debug, Clone, PartialEq)]
pub struct CompletionBody {
    /// The model's name (optional; any other than the served one is refused).
    pub model: Option<String>,
    /// The prompt.
    pub prompt: Prompt,
    /// The generation settings; its `logprobs` is the body's `logprobs`, each token's
    /// log-probability with this many alternatives (0 to [`MAX_LOGPROBS`]).
    pub settings: Settings,
}

impl CompletionBody {
    /// Parses a completion request's body.
    ///
    /// # Errors
    /// A 400 naming the field at fault: a malformed body, a field of the wrong type or range,
    /// or a field the server does not implement ([`refuse_unsupported`]).
    pub fn parse(body: &[u8], limits: ModelLimits) -> Result<Self, ApiError> {
        let mut f = Fields::parse(body, "completion")?;
        let prompt = f
            .take_with("prompt", |raw| {
                Prompt::parse(raw, limits.vocab, limits.max_positions)
            })?
            .ok_or_else(|| ApiError::bad(Some("prompt"), "`prompt` is required"))?;
        let mut settings = Settings::take(&mut f)?;
        // `false` is no logprobs, as a chat's `logprobs: false`.
        let logprobs: Option<u8> = f
            .take_with("logprobs", |raw| match raw.get() {
                "false" => Ok(None),
                v => v.parse::<u8>().map(Some).map_err(|_| {
                    ApiError::bad(
                        Some("logprobs"),
                        format!(
                            "`logprobs` must be a whole number from 0 to {MAX_LOGPROBS}, not {}",
                            excerpt(raw)
                        ),
                    )
                }),
            })?
            .flatten()
            .map(|n| {
                if n > MAX_LOGPROBS {
                    Err(ApiError::bad(
                        Some("logprobs"),
                        format!("`logprobs` is {n}: at most {MAX_LOGPROBS}"),
                    ))
                } else {
                    Ok(n)
                }
            })
            .transpose()?;
        settings.sampling.logprobs = logprobs;
        let body = CompletionBody {
            model: f.take("model", "a string")?,
            prompt,
            settings,
        };
        f.finish()?;
        Ok(body)
    }
}

// === POST /v1/chat/completions ===

/// The body of `POST /v1/chat/completions`, parsed and checked field by field.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatBody {
    /// The model's name (optional; any other than the served one is refused).
    pub model: Option<String>,
    /// The conversation.
    pub messages: Vec<crate::chat::Message>,
    /// The generation settings; its `logprobs` is the body's `logprobs: true` with
    /// `top_logprobs` alternatives (0 to 20), `None` without logprobs.
    pub settings: Settings,
}

impl ChatBody {
    /// Parses a chat completion request's body.
    ///
    /// # Errors
    /// A 400 naming the field at fault, as [`CompletionBody::parse`]; each message's fault is
    /// named by its index (`messages[1].role`).
    pub fn parse(body: &[u8], limits: ModelLimits) -> Result<Self, ApiError> {
        let mut f = Fields::parse(body, "chat completion")?;
        let messages = f
            .take_with("messages", |raw| messages(raw, limits.max_positions))?
            .ok_or_else(|| ApiError::bad(Some("messages"), "`messages` is required"))?;
        let mut settings = Settings::take(&mut f)?;
        let logprobs: bool = f.take("logprobs", "a boolean")?.unwrap_or(false);
        let top: Option<u8> = f.take("top_logprobs", "a whole number from 0 to 20")?;
        if let Some(n) = top {
            if n > MAX_TOP_LOGPROBS {
                return Err(ApiError::bad(
                    Some("top_logprobs"),
                    format!("`top_logprobs` is {n}: at most {MAX_TOP_LOGPROBS}"),
                ));
            }
            if !logprobs {
                return Err(ApiError::bad(
                    Some("top_logprobs"),
                    "`top_logprobs` needs `logprobs: true`",
                ));
            }
        }
        settings.sampling.logprobs = logprobs.then(|| top.unwrap_or(0));
        let body = ChatBody {
            model: f.take("model", "a string")?,
            messages,
            settings,
        };
        f.finish()?;
        Ok(body)
    }
}

/// `messages`: a non-empty array (at most `max` messages) of `{"role", "content"}` objects;
/// a content is a string or an array of `{"type": "text", "text"}` parts.
///
/// # Errors
/// A 400 naming `messages` or the message's field at fault.
pub fn messages(raw: &RawValue, max: usize) -> Result<Vec<crate::chat::Message>, ApiError> {
    let items: Vec<&RawValue> = serde_json::from_str(raw.get()).map_err(|_| {
        ApiError::bad(
            Some("messages"),
            format!(
                "`messages` must be an array of messages, not {}",
                excerpt(raw)
            ),
        )
    })?;
    if items.is_empty() {
        return Err(ApiError::bad(
            Some("messages"),
            "`messages` is empty: a chat needs at least one message",
        ));
    }
    if items.len() > max {
        return Err(ApiError::bad(
            Some("messages"),
            format!(
                "`messages` has {} messages, more than the model's context",
                items.len()
            ),
        ));
    }
    items
        .iter()
        .enumerate()
        .map(|(i, raw)| message(i, raw))
        .collect()
}

fn message(i: usize, raw: &RawValue) -> Result<crate::chat::Message, ApiError> {
    let at = |field: &str| format!("messages[{i}].{field}");
    let mut f = Fields::parse(raw.get().as_bytes(), "message").map_err(|_| {
        ApiError::bad(
            Some(&format!("messages[{i}]")),
            format!(
                "`messages[{i}]` must be an object with `role` and `content`, not {}",
                excerpt(raw)
            ),
        )
    })?;
    let renamed = |e: ApiError, field: &str| ApiError::bad(Some(&at(field)), e.message);
    let role: String = f
        .take("role", "a string")
        .map_err(|e| renamed(e, "role"))?
        .ok_or_else(|| {
            ApiError::bad(
                Some(&at("role")),
                format!("`messages[{i}].role` is required"),
            )
        })?;
    if !crate::chat::ROLES.contains(&role.as_str()) {
        return Err(ApiError::bad(
            Some(&at("role")),
            format!(
                "`messages[{i}].role` is `{}`: the roles are {}",
                shown(&role),
                crate::chat::ROLES.join(", ")
            ),
        ));
    }
    let content = f
        .take_with("content", |raw| content(i, raw))?
        .ok_or_else(|| {
            ApiError::bad(
                Some(&at("content")),
                format!("`messages[{i}].content` is required"),
            )
        })?;
    // The participant's name: given to the template, as vLLM does.
    let name: Option<String> = f.take("name", "a string").map_err(|e| renamed(e, "name"))?;
    if let Some((key, _)) = f.fields.first() {
        let name = at(&shown(key));
        return Err(ApiError::bad(
            Some(&name),
            format!("`{name}` is not supported by this server"),
        ));
    }
    Ok(crate::chat::Message {
        role,
        content,
        name,
    })
}

fn content(i: usize, raw: &RawValue) -> Result<String, ApiError> {
    if let Ok(s) = serde_json::from_str::<String>(raw.get()) {
        return Ok(s);
    }
    let field = format!("messages[{i}].content");
    let parts: Vec<&RawValue> = serde_json::from_str(raw.get()).map_err(|_| {
        ApiError::bad(
            Some(&field),
            format!(
                "`{field}` must be a string or an array of text parts, not {}",
                excerpt(raw)
            ),
        )
    })?;
    let mut text = String::new();
    for (j, part) in parts.iter().enumerate() {
        let at = format!("{field}[{j}]");
        let bad = || {
            ApiError::bad(
                Some(&at),
                format!(
                    "`{at}` must be {{\"type\": \"text\", \"text\": ...}}: this server reads text only, not {}",
                    excerpt(part)
                ),
            )
        };
        let mut f = Fields::parse(part.get().as_bytes(), "content part").map_err(|_| bad())?;
        let kind: Option<String> = f.take("type", "a string").map_err(|_| bad())?;
        let t: Option<String> = f.take("text", "a string").map_err(|_| bad())?;
        match (kind.as_deref(), t) {
            (Some("text"), Some(t)) if f.fields.is_empty() => text.push_str(&t),
            _ => return Err(bad()),
        }
    }
    Ok(text)
}

// === POST /tokenize, POST /detokenize ===

/// What `/tokenize` encodes.
#[derive(Debug, Clone, PartialEq)]
pub enum TokenizeInput {
    /// Text, encoded as a completion's prompt is.
    Prompt(String),
    /// A conversation, rendered with the chat template as a chat's prompt is.
    Messages {
        /// The messages.
        messages: Vec<crate::chat::Message>,
        /// Open the assistant's turn (default true, as a chat completion renders it).
        add_generation_prompt: bool,
    },
}

/// The body of `POST /tokenize`: `prompt` or `messages` (vLLM's API), with vLLM's options.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenizeBody {
    /// The model's name (optional).
    pub model: Option<String>,
    /// What to encode.
    pub input: TokenizeInput,
    /// `add_special_tokens`: the BOS the vocabulary asks for (absent: as a completion's prompt
    /// or a chat's rendered text is encoded, so the count is what a request would use).
    pub add_special_tokens: Option<bool>,
    /// `return_token_strs`: each token's text besides its id.
    pub return_token_strs: bool,
}

impl TokenizeBody {
    /// Parses a `/tokenize` body.
    ///
    /// # Errors
    /// A 400 naming the field at fault; neither or both of `prompt` and `messages`.
    pub fn parse(body: &[u8], limits: ModelLimits) -> Result<Self, ApiError> {
        let mut f = Fields::parse(body, "tokenize")?;
        let prompt: Option<String> = f.take("prompt", "a string")?;
        let msgs = f.take_with("messages", |raw| messages(raw, limits.max_positions))?;
        let agp: Option<bool> = f.take("add_generation_prompt", "a boolean")?;
        let input = match (prompt, msgs) {
            (Some(p), None) => {
                if agp.is_some() {
                    return Err(ApiError::bad(
                        Some("add_generation_prompt"),
                        "`add_generation_prompt` goes with `messages`, not `prompt`",
                    ));
                }
                TokenizeInput::Prompt(p)
            }
            (None, Some(messages)) => TokenizeInput::Messages {
                messages,
                add_generation_prompt: agp.unwrap_or(true),
            },
            (Some(_), Some(_)) => {
                return Err(ApiError::bad(
                    Some("messages"),
                    "give `prompt` or `messages`, not both",
                ))
            }
            (None, None) => {
                return Err(ApiError::bad(
                    Some("prompt"),
                    "`prompt` (a string) or `messages` is required",
                ))
            }
        };
        let body = TokenizeBody {
            model: f.take("model", "a string")?,
            input,
            add_special_tokens: f.take("add_special_tokens", "a boolean")?,
            return_token_strs: f.take("return_token_strs", "a boolean")?.unwrap_or(false),
        };
        f.finish()?;
        Ok(body)
    }
}

/// The body of `POST /detokenize`: `tokens`, an array of token ids.
#[derive(Debug, Clone, PartialEq)]
pub struct DetokenizeBody {
    /// The model's name (optional).
    pub model: Option<String>,
    /// The tokens.
    pub tokens: Vec<u32>,
}

impl DetokenizeBody {
    /// Parses a `/detokenize` body.
    ///
    /// # Errors
    /// A 400 naming the field (or token) at fault.
    pub fn parse(body: &[u8], limits: ModelLimits) -> Result<Self, ApiError> {
        let mut f = Fields::parse(body, "detokenize")?;
        let tokens = f
            .take_with("tokens", |raw| {
                token_ids(raw, "tokens", limits.vocab, limits.max_positions)
            })?
            .ok_or_else(|| ApiError::bad(Some("tokens"), "`tokens` is required"))?;
        let body = DetokenizeBody {
            model: f.take("model", "a string")?,
            tokens,
        };
        f.finish()?;
        Ok(body)
    }
}
