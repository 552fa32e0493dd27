//! Text to token ids and back: the random models' byte vocabulary, or a GGUF file's GPT-2
//! byte-level BPE built with the `tokenizers` crate from the file's own vocabulary and merges.
//!
//! The BPE follows llama.cpp's reading of the metadata: no normaliser, no prefix space, no BOS
//! added (`add_bos_token` false, as SmolLM2 ships it; a file that asks for one gets it), the
//! control tokens (`<|im_start|>`, `<|im_end|>`, ...) matched whole in the text as single
//! tokens. Decoding maps each token back to its bytes, so a decode is byte-exact and a stream
//! can hold back an incomplete UTF-8 character ([`Utf8Decoder`]).

use std::collections::HashMap;

use candle_core::quantized::gguf_file::{Content, Value};
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::AddedToken;

/// A tokenizer that cannot be built from a file's metadata, or text it cannot encode.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("tokenizer: {0}")]
pub struct TokenizerError(pub String);

/// The byte vocabulary of the random models: token `b` (0..=255) is the byte `b`, then BOS and
/// EOS.
pub const VOCAB: usize = 258;
/// Beginning of sequence (byte vocabulary).
pub const BOS: u32 = 256;
/// End of sequence (byte vocabulary).
pub const EOS: u32 = 257;

/// Encodes text in the byte vocabulary: BOS followed by its UTF-8 bytes.
pub fn encode(text: &str) -> Vec<u32> {
    std::iter::once(BOS)
        .chain(text.bytes().map(u32::from))
        .collect()
}

/// Decodes byte-vocabulary tokens to text (BOS/EOS dropped; invalid UTF-8 replaced).
pub fn decode(tokens: &[u32]) -> String {
    let bytes: Vec<u8> = tokens
        .iter()
        .filter(|&&t| t < 256)
        .map(|&t| t as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// The tokens of a model.
pub enum Tokenizer {
    /// The random models' vocabulary: bytes 0-255, then BOS 256 and EOS 257; text is encoded
    /// as BOS and its UTF-8 bytes.
    Bytes,
    /// A byte-level BPE from a GGUF file.
    Bpe(Box<Bpe>),
}

/// A GGUF file's byte-level BPE.
pub struct Bpe {
    inner: tokenizers::Tokenizer,
    /// Each token's bytes (a control token's are its text).
    bytes: Vec<Vec<u8>>,
    /// Control tokens (GGUF token type 3): never shown in generated text.
    control: Vec<bool>,
    by_text: HashMap<String, u32>,
    bos: Option<u32>,
    eos: u32,
    add_bos: bool,
    /// The file's chat template (`tokenizer.chat_template`, Jinja), if it has one.
    chat_template: Option<String>,
}

/// GGUF's token type of a control token.
const CONTROL: i32 = 3;
/// The longest vocabulary accepted.
const MAX_VOCAB: usize = 1 << 20;

impl Tokenizer {
    /// The BPE described by a GGUF file's `tokenizer.ggml.*` metadata.
    ///
    /// # Errors
    /// A missing or malformed key (named), a tokenizer model other than `gpt2`, or a
    /// pre-tokenizer this reader does not implement.
    pub fn from_gguf(ct: &Content) -> Result<Self, TokenizerError> {
        let bad = |what: String| TokenizerError(what);
        let get = |k: &str| {
            ct.metadata
                .get(k)
                .ok_or_else(|| bad(format!("metadata key `{k}` is missing")))
        };
        let string = |k: &str| -> Result<String, TokenizerError> {
            get(k)?
                .to_string()
                .cloned()
                .map_err(|_| bad(format!("`{k}` is not a string")))
        };
        let id = |k: &str| -> Result<Option<u32>, TokenizerError> {
            match ct.metadata.get(k) {
                None => Ok(None),
                Some(v) => v
                    .to_u32()
                    .map(Some)
                    .map_err(|_| bad(format!("`{k}` is not a u32"))),
            }
        };
        let kind = string("tokenizer.ggml.model")?;
        if kind != "gpt2" {
            return Err(bad(format!(
                "`tokenizer.ggml.model` is `{kind}`; only `gpt2` (byte-level BPE) is read"
            )));
        }
        let pre = match ct.metadata.get("tokenizer.ggml.pre") {
            None => "default".to_owned(),
            Some(_) => string("tokenizer.ggml.pre")?,
        };
        // llama.cpp's pre-tokenizers: digits one by one for these, then GPT-2's split.
        let digits = match pre.as_str() {
            "default" | "gpt2" => false,
            "smollm" | "starcoder" | "refact" | "codeshell" => true,
            other => {
                return Err(bad(format!(
                    "`tokenizer.ggml.pre` is `{other}`; read are gpt2, smollm, starcoder, \
                     refact, codeshell"
                )))
            }
        };
        let strings = |k: &str| -> Result<Vec<String>, TokenizerError> {
            let v = get(k)?
                .to_vec()
                .map_err(|_| bad(format!("`{k}` is not an array")))?;
            if v.len() > MAX_VOCAB * 4 {
                return Err(bad(format!("`{k}` has {} entries", v.len())));
            }
            v.iter()
                .enumerate()
                .map(|(i, s)| {
                    s.to_string()
                        .cloned()
                        .map_err(|_| bad(format!("`{k}[{i}]` is not a string")))
                })
                .collect()
        };
        let tokens = strings("tokenizer.ggml.tokens")?;
        if tokens.is_empty() || tokens.len() > MAX_VOCAB {
            return Err(bad(format!(
                "`tokenizer.ggml.tokens` has {} entries (1 to {MAX_VOCAB})",
                tokens.len()
            )));
        }
        let merges = strings("tokenizer.ggml.merges")?
            .into_iter()
            .enumerate()
            .map(|(i, m)| {
                m.split_once(' ')
                    .map(|(a, b)| (a.to_owned(), b.to_owned()))
                    .ok_or_else(|| bad(format!("`tokenizer.ggml.merges[{i}]` is `{m}`")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let types: Vec<i32> = match ct.metadata.get("tokenizer.ggml.token_type") {
            None => vec![1; tokens.len()],
            Some(v) => {
                let v = v
                    .to_vec()
                    .map_err(|_| bad("`tokenizer.ggml.token_type` is not an array".into()))?;
                if v.len() != tokens.len() {
                    return Err(bad(format!(
                        "`tokenizer.ggml.token_type` has {} entries for {} tokens",
                        v.len(),
                        tokens.len()
                    )));
                }
                v.iter()
                    .map(|t| match t {
                        Value::I32(x) => Ok(*x),
                        Value::U32(x) => Ok(*x as i32),
                        _ => Err(bad("`tokenizer.ggml.token_type` holds a non-integer".into())),
                    })
                    .collect::<Result<_, _>>()?
            }
        };
        let n = tokens.len() as u32;
        let in_vocab = |k: &str, v: Option<u32>| -> Result<Option<u32>, TokenizerError> {
            match v {
                Some(t) if t >= n => Err(bad(format!("`{k}` is {t}, past the {n} tokens"))),
                v => Ok(v),
            }
        };
        let bos = in_vocab(
            "tokenizer.ggml.bos_token_id",
            id("tokenizer.ggml.bos_token_id")?,
        )?;
        let eos = in_vocab(
            "tokenizer.ggml.eos_token_id",
            id("tokenizer.ggml.eos_token_id")?,
        )?
        .ok_or_else(|| bad("metadata key `tokenizer.ggml.eos_token_id` is missing".into()))?;
        let add_bos = match ct.metadata.get("tokenizer.ggml.add_bos_token") {
            None => false,
            Some(v) => v
                .to_bool()
                .map_err(|_| bad("`tokenizer.ggml.add_bos_token` is not a bool".into()))?,
        };

        let chat_template = match ct.metadata.get("tokenizer.chat_template") {
            None => None,
            Some(_) => Some(string("tokenizer.chat_template")?),
        };

        let by_text: HashMap<String, u32> = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        let bpe = BPE::builder()
            .vocab_and_merges(
                by_text
                    .iter()
                    .map(|(k, v)| (k.clone(), *v))
                    .collect::<tokenizers::models::bpe::Vocab>(),
                merges,
            )
            .build()
            .map_err(|e| bad(format!("BPE: {e}")))?;
        let mut inner = tokenizers::Tokenizer::new(bpe);
        let byte_level = ByteLevel::new(false, true, true);
        if digits {
            inner.with_pre_tokenizer(Some(Sequence::new(vec![
                Digits::new(true).into(),
                byte_level.into(),
            ])));
        } else {
            inner.with_pre_tokenizer(Some(byte_level));
        }
        inner.with_decoder(Some(ByteLevelDecoder::default()));
        let control: Vec<bool> = types.iter().map(|&t| t == CONTROL).collect();
        let specials: Vec<AddedToken> = tokens
            .iter()
            .zip(&control)
            .filter(|(_, &c)| c)
            .map(|(t, _)| AddedToken::from(t.clone(), true))
            .collect();
        inner
            .add_special_tokens(specials)
            .map_err(|e| bad(format!("control tokens: {e}")))?;

        let unbyte = unicode_to_byte();
        let bytes = tokens
            .iter()
            .zip(&control)
            .map(|(t, &c)| {
                if c {
                    t.as_bytes().to_vec()
                } else {
                    // A byte-level token's characters each stand for one byte; a character
                    // outside that alphabet (none in a well-formed file) stands for itself.
                    let mut out = Vec::with_capacity(t.len());
                    for ch in t.chars() {
                        match unbyte.get(&ch) {
                            Some(&b) => out.push(b),
                            None => out.extend_from_slice(ch.to_string().as_bytes()),
                        }
                    }
                    out
                }
            })
            .collect();
        Ok(Tokenizer::Bpe(Box::new(Bpe {
            inner,
            bytes,
            control,
            by_text,
            bos,
            eos,
            add_bos,
            chat_template,
        })))
    }

    /// Tokens in the vocabulary.
    pub fn vocab_size(&self) -> usize {
        match self {
            Tokenizer::Bytes => VOCAB,
            Tokenizer::Bpe(b) => b.bytes.len(),
        }
    }

    /// The token that ends a generation (EOS; `<|im_end|>` in SmolLM2).
    pub fn eos(&self) -> u32 {
        match self {
            Tokenizer::Bytes => EOS,
            Tokenizer::Bpe(b) => b.eos,
        }
    }

    /// BOS, when the vocabulary has one.
    pub fn bos(&self) -> Option<u32> {
        match self {
            Tokenizer::Bytes => Some(BOS),
            Tokenizer::Bpe(b) => b.bos,
        }
    }

    /// The model's chat template (Jinja), as its file ships it; the byte vocabulary has none.
    pub fn chat_template(&self) -> Option<&str> {
        match self {
            Tokenizer::Bytes => None,
            Tokenizer::Bpe(b) => b.chat_template.as_deref(),
        }
    }

    /// A token's text with control tokens written out (`<|im_end|>`), invalid UTF-8 replaced:
    /// how logprobs and `/detokenize` show a token. `None` outside the vocabulary.
    pub fn token_text(&self, token: u32) -> Option<String> {
        self.token_bytes_with_control(token)
            .map(|b| String::from_utf8_lossy(b).into_owned())
    }

    /// Whether `token` is a control token (BOS, EOS, `<|im_start|>`, ...): no text of its own.
    pub fn is_control(&self, token: u32) -> bool {
        match self {
            Tokenizer::Bytes => token as usize >= 256,
            Tokenizer::Bpe(b) => b.control.get(token as usize).copied().unwrap_or(false),
        }
    }

    /// The id of a token by its text (`<|im_end|>`), if there is one.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        match self {
            Tokenizer::Bytes => None,
            Tokenizer::Bpe(b) => b.by_text.get(text).copied(),
        }
    }

    /// Encodes `text`: control tokens written in it are single tokens; BOS first only where
    /// the vocabulary asks for it (the byte vocabulary always does).
    ///
    /// # Errors
    /// The BPE fails (it does not on valid UTF-8, but the crate's error is passed on).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        self.encode_with(text, true)
    }

    /// As [`encode`](Self::encode); without `add_special_tokens` no BOS is added whatever the
    /// vocabulary asks (vLLM's `/tokenize` option).
    ///
    /// # Errors
    /// As [`encode`](Self::encode).
    pub fn encode_with(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, TokenizerError> {
        match self {
            Tokenizer::Bytes if add_special_tokens => Ok(encode(text)),
            Tokenizer::Bytes => Ok(text.bytes().map(u32::from).collect()),
            Tokenizer::Bpe(b) => {
                let enc = b
                    .inner
                    .encode_fast(text, false)
                    .map_err(|e| TokenizerError(e.to_string()))?;
                let mut out = Vec::with_capacity(enc.len() + 1);
                if b.add_bos && add_special_tokens {
                    out.extend(b.bos);
                }
                out.extend_from_slice(enc.get_ids());
                Ok(out)
            }
        }
    }

    /// The bytes a token stands for in generated text: none for BOS/EOS and control tokens.
    /// `None` for an id outside the vocabulary.
    pub fn token_bytes(&self, token: u32) -> Option<&[u8]> {
        match self {
            Tokenizer::Bytes => match token {
                0..=255 => Some(&BYTES[token as usize..token as usize + 1]),
                t if (t as usize) < VOCAB => Some(&[]),
                _ => None,
            },
            Tokenizer::Bpe(b) => {
                let i = token as usize;
                if *b.control.get(i)? {
                    Some(&[])
                } else {
                    b.bytes.get(i).map(Vec::as_slice)
                }
            }
        }
    }

    /// A token's bytes with control tokens written out (`<|im_start|>`), for showing prompts.
    pub fn token_bytes_with_control(&self, token: u32) -> Option<&[u8]> {
        match self {
            Tokenizer::Bpe(b) => b.bytes.get(token as usize).map(Vec::as_slice),
            Tokenizer::Bytes => self.token_bytes(token),
        }
    }

    /// Decodes `tokens` byte-exactly (invalid UTF-8 replaced); control tokens are written
    /// out when `control` is set, else dropped.
    ///
    /// # Errors
    /// A token outside the vocabulary (its index in `tokens` and its id).
    pub fn decode(&self, tokens: &[u32], control: bool) -> Result<String, (usize, u32)> {
        let mut bytes = Vec::new();
        for (i, &t) in tokens.iter().enumerate() {
            let b = if control {
                self.token_bytes_with_control(t)
            } else {
                self.token_bytes(t)
            };
            bytes.extend_from_slice(b.ok_or((i, t))?);
        }
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }
}

/// A Hugging Face tokenizer directory's files, as `transformers`' `AutoTokenizer` loads them
/// (a fast tokenizer: `tokenizer.json`, with `tokenizer_config.json` for the chat template and
/// the special tokens).
#[derive(Debug, Clone, PartialEq)]
pub struct HfTokenizer {
    /// `tokenizer.json`: the BPE, its pre-tokenizer, decoder and control tokens, and BOS as a
    /// post-processor where the vocabulary adds one.
    pub tokenizer_json: String,
    /// `tokenizer_config.json`.
    pub tokenizer_config_json: String,
}

impl Tokenizer {
    /// The tokenizer in Hugging Face's form, encoding every text to the ids [`encode`]
    /// gives (`add_special_tokens` as [`encode_with`]), for clients that tokenize on their side
    /// (load generators measuring prompt lengths). `model_max_length` is the context.
    ///
    /// [`encode`]: Self::encode
    /// [`encode_with`]: Self::encode_with
    ///
    /// # Errors
    /// The byte vocabulary of the random models, which has no such form.
    pub fn hugging_face(&self, model_max_length: usize) -> Result<HfTokenizer, TokenizerError> {
        let Tokenizer::Bpe(b) = self else {
            return Err(TokenizerError(
                "the random models' byte vocabulary has no Hugging Face tokenizer".into(),
            ));
        };
        let text = |t: u32| String::from_utf8_lossy(&b.bytes[t as usize]).into_owned();
        let mut inner = b.inner.clone();
        if let (true, Some(bos)) = (b.add_bos, b.bos) {
            let processor = TemplateProcessing::builder()
                .try_single(format!("{} $A", text(bos)))
                .and_then(|t| t.try_pair(format!("{} $A {} $B", text(bos), text(bos))))
                .map_err(|e| TokenizerError(format!("BOS post-processor: {e}")))?
                .special_tokens(vec![(text(bos), bos)])
                .build()
                .map_err(|e| TokenizerError(format!("BOS post-processor: {e}")))?;
            inner.with_post_processor(Some(processor));
        }
        let tokenizer_json = inner
            .to_string(true)
            .map_err(|e| TokenizerError(format!("tokenizer.json: {e}")))?;
        let config = serde_json::json!({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": model_max_length,
            "clean_up_tokenization_spaces": false,
            "bos_token": b.bos.map(text),
            "eos_token": text(b.eos),
            "add_bos_token": b.add_bos,
            "chat_template": b.chat_template,
        });
        let tokenizer_config_json = serde_json::to_string_pretty(&config)
            .map_err(|e| TokenizerError(format!("tokenizer_config.json: {e}")))?;
        Ok(HfTokenizer {
            tokenizer_json,
            tokenizer_config_json,
        })
    }
}

/// Byte `b` at index `b`, for byte tokens' one-byte slices.
static BYTES: [u8; 256] = {
    let mut a = [0u8; 256];
    let mut i = 0;
    while i < 256 {
        a[i] = i as u8;
        i += 1;
    }
    a
};

/// GPT-2's byte-level alphabet, reversed: the printable bytes stand for themselves, the other
/// 68 bytes for the characters from U+0100 on, in byte order.
fn unicode_to_byte() -> HashMap<char, u8> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut next = 256u32;
    let mut m = HashMap::with_capacity(256);
    for b in 0..=255u8 {
        let c = if printable(b) {
            char::from(b)
        } else {
            let c = char::from_u32(next).expect("U+0100..U+0143 are characters");
            next += 1;
            c
        };
        m.insert(c, b);
    }
    m
}

/// Turns a stream of tokens into text without ever splitting a UTF-8 character: bytes of an
/// incomplete character wait for the next token; invalid bytes become U+FFFD.
#[derive(Default)]
pub struct Utf8Decoder {
    pending: Vec<u8>,
}

impl Utf8Decoder {
    /// A decoder with nothing pending.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends a token's bytes and returns the text now complete.
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        self.take(false)
    }

    /// The rest at the end of the stream (an incomplete character becomes U+FFFD).
    pub fn finish(&mut self) -> String {
        self.take(true)
    }

    fn take(&mut self, end: bool) -> String {
        let mut out = String::new();
        let mut rest: &[u8] = &self.pending;
        loop {
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    out.push_str(s);
                    rest = &[];
                    break;
                }
                Err(e) => {
                    let good = e.valid_up_to();
                    out.push_str(std::str::from_utf8(&rest[..good]).unwrap_or_default());
                    match e.error_len() {
                        Some(bad) => {
                            out.push('\u{FFFD}');
                            rest = &rest[good + bad..];
                        }
                        None if end => {
                            out.push('\u{FFFD}');
                            rest = &[];
                            break;
                        }
                        None => {
                            rest = &rest[good..];
                            break;
                        }
                    }
                }
            }
        }
        self.pending = rest.to_vec();
        out
    }
}
