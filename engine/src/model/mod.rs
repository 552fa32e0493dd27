//! A Llama-architecture decoder (RMSNorm, rotary positions, grouped-query attention, SwiGLU),
//! run one engine step at a time: random weights over a byte vocabulary (`tiny`, `small`), or a
//! GGUF file with its own tokenizer ([`gguf`], SmolLM2-135M-Instruct by default).
//!
//! A step is a list of [`StepRow`]s. All rows' new tokens are flattened into one `[T, d]`
//! activation; every linear layer (the q/k/v/o projections, the MLP, the LM head) runs once for
//! the whole step. Attention runs per row against that row's [`KvCache`]: a row of `n` new
//! tokens at positions `[start, start + n)` attends causally to the `start` tokens it has cached
//! and to itself, so a prompt chunk and a decode row (`n = 1`) are the same computation. Logits
//! are computed only for rows that ask for them, at their last token. The layers are
//! [`blocks`]' `Block`s; each grows a row's keys and values in place (undone when the step fails).

pub mod blocks;
pub mod gguf;
pub mod q4_1;

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use candle_core::quantized::QTensor;
use candle_core::{DType, Device, Tensor};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

pub use crate::sampling::{argmax, Sampler};
use crate::tokenizer::Tokenizer;
use blocks::{Attention, AttentionKernel, Block, LayerKv, Linear, Mlp, RmsNorm, Rope, Span};

/// Errors of the model: tensor errors, a bad weights file, a bad step.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A tensor operation failed.
    #[error("tensor error: {0}")]
    Tensor(#[from] candle_core::Error),
    /// A weights file lacks a tensor, or has one of the wrong shape.
    #[error("weights file {path}: {what}")]
    Weights {
        /// The file.
        path: String,
        /// What is wrong, naming the tensor.
        what: String,
    },
    /// A step row is malformed.
    #[error("step row {row}: {what}")]
    BadRow {
        /// The row's index in the step.
        row: usize,
        /// What is wrong.
        what: String,
    },
    /// A GGUF file that cannot be served: not a regular file, truncated, another
    /// architecture, a missing tensor, an unknown tensor type or a wrong shape.
    #[error("GGUF file {path}: {what}")]
    Gguf {
        /// The file.
        path: String,
        /// What is wrong, naming the metadata key or tensor.
        what: String,
    },
    /// The tokenizer cannot be built from the file's metadata.
    #[error(transparent)]
    Tokenizer(#[from] crate::tokenizer::TokenizerError),
    /// A size name that is not `tiny` or `small`.
    #[error("unknown model size `{0}` (expected `tiny` or `small`)")]
    UnknownSize(String),
}

pub use crate::tokenizer::{decode, encode, BOS, EOS, VOCAB};

/// The model's shape.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Config {
    /// Model width `d`.
    pub hidden: usize,
    /// Decoder layers.
    pub layers: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (grouped-query attention: `heads` is a multiple).
    pub kv_heads: usize,
    /// SwiGLU inner width.
    pub ffn: usize,
    /// Rotary base.
    pub rope_theta: f32,
    /// RMSNorm epsilon.
    pub eps: f64,
    /// The longest context (prompt + generated) a row may reach.
    pub max_positions: usize,
    /// Tokens in the vocabulary (the embedding's and LM head's rows).
    pub vocab: usize,
    /// Rotary pairs are adjacent dimensions (GGUF's layout) rather than the two halves.
    pub rope_interleaved: bool,
}

impl Config {
    /// `tiny`: 2 layers, d = 64, 4 heads, 2 KV heads (tests).
    pub fn tiny() -> Self {
        Config {
            hidden: 64,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            ffn: 172,
            rope_theta: 10_000.0,
            eps: 1e-5,
            max_positions: 4096,
            vocab: VOCAB,
            rope_interleaved: false,
        }
    }

    /// `small`: 6 layers, d = 512, 8 heads, 2 KV heads, ~25M parameters (benchmarks).
    pub fn small() -> Self {
        Config {
            hidden: 512,
            layers: 6,
            heads: 8,
            kv_heads: 2,
            ffn: 2304,
            rope_theta: 10_000.0,
            eps: 1e-5,
            max_positions: 4096,
            vocab: VOCAB,
            rope_interleaved: false,
        }
    }

    /// A size by name (`tiny`, `small`).
    ///
    /// # Errors
    /// Any other name.
    pub fn by_name(name: &str) -> Result<Self, ModelError> {
        match name {
            "tiny" => Ok(Self::tiny()),
            "small" => Ok(Self::small()),
            other => Err(ModelError::UnknownSize(other.to_owned())),
        }
    }

    /// Width of one head.
    pub fn head_dim(&self) -> usize {
        self.hidden / self.heads
    }

    /// The weights' shapes under their Llama names.
    pub fn tensor_shapes(&self) -> Vec<(String, Vec<usize>)> {
        let (d, hd, kv) = (self.hidden, self.head_dim(), self.kv_heads);
        let mut v = vec![
            ("model.embed_tokens.weight".to_owned(), vec![self.vocab, d]),
            ("model.norm.weight".to_owned(), vec![d]),
            ("lm_head.weight".to_owned(), vec![self.vocab, d]),
        ];
        for l in 0..self.layers {
            let p = format!("model.layers.{l}");
            v.push((format!("{p}.input_layernorm.weight"), vec![d]));
            v.push((format!("{p}.post_attention_layernorm.weight"), vec![d]));
            v.push((format!("{p}.self_attn.q_proj.weight"), vec![d, d]));
            v.push((format!("{p}.self_attn.k_proj.weight"), vec![kv * hd, d]));
            v.push((format!("{p}.self_attn.v_proj.weight"), vec![kv * hd, d]));
            v.push((format!("{p}.self_attn.o_proj.weight"), vec![d, d]));
            v.push((format!("{p}.mlp.gate_proj.weight"), vec![self.ffn, d]));
            v.push((format!("{p}.mlp.up_proj.weight"), vec![self.ffn, d]));
            v.push((format!("{p}.mlp.down_proj.weight"), vec![d, self.ffn]));
        }
        v
    }

    /// The number of parameters.
    pub fn parameters(&self) -> usize {
        self.tensor_shapes()
            .iter()
            .map(|(_, s)| s.iter().product::<usize>())
            .sum()
    }

    /// Random weights from `seed`: norms 1, embeddings N(0, 1), linear layers
    /// N(0, 1/fan_in), so activations and logits keep an O(1) spread at any width.
    pub fn random_weights(&self, seed: u64, device: &Device) -> Result<Weights, ModelError> {
        let mut rng = SmallRng::seed_from_u64(seed);
        let mut out = HashMap::new();
        for (name, shape) in self.tensor_shapes() {
            let n: usize = shape.iter().product();
            let t = if name.ends_with("norm.weight") {
                Tensor::ones(shape.as_slice(), DType::F32, device)?
            } else {
                let std = if name.contains("embed_tokens") {
                    1.0
                } else {
                    1.0 / (shape[1] as f32).sqrt()
                };
                let data: Vec<f32> = (0..n).map(|_| gaussian(&mut rng) * std).collect();
                Tensor::from_vec(data, shape.as_slice(), device)?
            };
            out.insert(name, t);
        }
        Ok(out)
    }
}

fn gaussian(rng: &mut SmallRng) -> f32 {
    // Box-Muller: two uniforms in (0, 1] to one standard normal.
    let u1: f32 = 1.0 - rng.gen::<f32>();
    let u2: f32 = rng.gen::<f32>();
    (-2.0 * u1.ln()).sqrt() * (2.0 * std::f32::consts::PI * u2).cos()
}

/// Weights by Llama tensor name.
pub type Weights = HashMap<String, Tensor>;

/// Writes weights to a safetensors file.
///
/// # Errors
/// The file cannot be written.
pub fn save_safetensors(weights: &Weights, path: &Path) -> Result<(), ModelError> {
    candle_core::safetensors::save(weights, path)?;
    Ok(())
}

#[derive(Clone)]
/// One row's KV cache: per layer, its keys and values ([`LayerKv`]), grown by each step the row
/// runs. Its length is the row's context.
pub struct KvCache {
    layers: Vec<LayerKv>,
    len: usize,
}

impl KvCache {
    /// An empty cache for `model`.
    pub fn new(model: &Model) -> Self {
        KvCache {
            layers: (0..model.config.layers).map(|_| LayerKv::Empty).collect(),
            len: 0,
        }
    }

    /// Tokens cached (the next token's position).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// One row of a step: new tokens appended at the end of `cache`.
pub struct StepRow<'a> {
    /// The tokens the row runs this step (a chunk, or one decode token).
    pub tokens: &'a [u32],
    /// The row's cache; its length is the position of `tokens[0]`.
    pub cache: &'a mut KvCache,
    /// Whether the row wants logits at its last token (a final chunk, a decode row).
    pub logits: bool,
}

/// The token embedding: dense f32 rows, or quantized rows dequantized on lookup.
pub enum Embedding {
    /// `[vocab, d]` f32.
    Dense(Tensor),
    /// `[vocab, d]` quantized (shared with a tied LM head).
    Quantized(Arc<QTensor>),
}

impl Embedding {
    fn lookup(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Self::Dense(t) => t.index_select(ids, 0),
            Self::Quantized(q) => q.embedding(ids),
        }
    }
}

/// The decoder.
pub struct Model {
    /// Its shape.
    pub config: Config,
    device: Device,
    embed: Embedding,
    blocks: Vec<Block>,
    norm: RmsNorm,
    lm_head: Linear,
    rope: Rope,
    tokenizer: Arc<Tokenizer>,
}

impl Model {
    /// A model of `config` with random weights from `seed`.
    ///
    /// # Errors
    /// A tensor error.
    pub fn random(config: Config, seed: u64, device: &Device) -> Result<Self, ModelError> {
        let w = config.random_weights(seed, device)?;
        Self::from_weights(config, &w, device, "<random>")
    }

    /// Reads a safetensors file with Llama tensor names, checked against `config`.
    ///
    /// # Errors
    /// The file does not read, or a tensor is missing or of the wrong shape (named).
    pub fn load(config: Config, path: &Path, device: &Device) -> Result<Self, ModelError> {
        let shown = path.display().to_string();
        let w = candle_core::safetensors::load(path, device).map_err(|e| ModelError::Weights {
            path: shown.clone(),
            what: e.to_string(),
        })?;
        Self::from_weights(config, &w, device, &shown)
    }

    /// Builds the model from named f32 weights (the byte vocabulary's tokenizer).
    ///
    /// # Errors
    /// A tensor is missing or of the wrong shape (named, with `origin`).
    pub fn from_weights(
        config: Config,
        w: &Weights,
        device: &Device,
        origin: &str,
    ) -> Result<Self, ModelError> {
        for (name, shape) in config.tensor_shapes() {
            let t = w.get(&name).ok_or_else(|| ModelError::Weights {
                path: origin.to_owned(),
                what: format!("missing tensor `{name}`"),
            })?;
            if t.dims() != shape.as_slice() {
                return Err(ModelError::Weights {
                    path: origin.to_owned(),
                    what: format!(
                        "tensor `{name}` has shape {:?}, expected {shape:?}",
                        t.dims()
                    ),
                });
            }
        }
        let get = |n: &str| -> Result<Tensor, ModelError> {
            Ok(w[n].to_dtype(DType::F32)?.to_device(device)?)
        };
        let mut blocks = Vec::with_capacity(config.layers);
        for l in 0..config.layers {
            let p = format!("model.layers.{l}");
            let q = get(&format!("{p}.self_attn.q_proj.weight"))?;
            let k = get(&format!("{p}.self_attn.k_proj.weight"))?;
            let v = get(&format!("{p}.self_attn.v_proj.weight"))?;
            let gate = get(&format!("{p}.mlp.gate_proj.weight"))?;
            let up = get(&format!("{p}.mlp.up_proj.weight"))?;
            blocks.push(Block {
                attn_norm: RmsNorm::new(get(&format!("{p}.input_layernorm.weight"))?, config.eps),
                attn: Attention {
                    qkv: Linear::dense(Tensor::cat(&[q, k, v], 0)?)?,
                    o: Linear::dense(get(&format!("{p}.self_attn.o_proj.weight"))?)?,
                    heads: config.heads,
                    kv_heads: config.kv_heads,
                    head_dim: config.head_dim(),
                    kernel: AttentionKernel::Batched,
                },
                mlp_norm: RmsNorm::new(
                    get(&format!("{p}.post_attention_layernorm.weight"))?,
                    config.eps,
                ),
                mlp: Mlp {
                    gate_up: Linear::dense(Tensor::cat(&[gate, up], 0)?)?,
                    down: Linear::dense(get(&format!("{p}.mlp.down_proj.weight"))?)?,
                    ffn: config.ffn,
                },
            });
        }
        Self::from_parts(
            config,
            device,
            Embedding::Dense(get("model.embed_tokens.weight")?),
            blocks,
            RmsNorm::new(get("model.norm.weight")?, config.eps),
            Linear::dense(get("lm_head.weight")?)?,
            Arc::new(Tokenizer::Bytes),
        )
    }

    /// Assembles a model from its parts (the rotary tables are computed from `config`).
    ///
    /// # Errors
    /// A tensor error.
    pub fn from_parts(
        config: Config,
        device: &Device,
        embed: Embedding,
        blocks: Vec<Block>,
        norm: RmsNorm,
        lm_head: Linear,
        tokenizer: Arc<Tokenizer>,
    ) -> Result<Self, ModelError> {
        let rope = Rope::new(
            config.head_dim(),
            config.max_positions,
            config.rope_theta,
            config.rope_interleaved,
            device,
        )?;
        Ok(Model {
            config,
            device: device.clone(),
            embed,
            blocks,
            norm,
            lm_head,
            rope,
            tokenizer,
        })
    }

    /// The device the model runs on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The model's tokenizer.
    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }

    /// Runs one step: every row's tokens through every block, appending their keys and values
    /// to the rows' caches. Returns, per row in order, its logits at its last token when it
    /// asked for them (`vocab` values), else `None`.
    ///
    /// # Errors
    /// A row with no tokens, a token outside the vocabulary, a row past `max_positions`, or a
    /// tensor error. On error no cache has been changed.
    pub fn step(&self, rows: &mut [StepRow<'_>]) -> Result<Vec<Option<Vec<f32>>>, ModelError> {
        let cfg = &self.config;
        let mut ids = Vec::new();
        for (i, r) in rows.iter().enumerate() {
            if r.tokens.is_empty() {
                return Err(ModelError::BadRow {
                    row: i,
                    what: "no tokens".into(),
                });
            }
            if let Some(t) = r.tokens.iter().find(|&&t| t as usize >= cfg.vocab) {
                return Err(ModelError::BadRow {
                    row: i,
                    what: format!("token {t} is outside the vocabulary of {}", cfg.vocab),
                });
            }
            if r.cache.len + r.tokens.len() > cfg.max_positions {
                return Err(ModelError::BadRow {
                    row: i,
                    what: format!(
                        "context {} + {} tokens exceeds the model's {} positions",
                        r.cache.len,
                        r.tokens.len(),
                        cfg.max_positions
                    ),
                });
            }
            ids.extend_from_slice(r.tokens);
        }
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        let t_all = ids.len();
        let ids = Tensor::from_vec(ids, t_all, &self.device)?;
        let x = self.embed.lookup(&ids)?; // [T, d]
        let spans: Vec<Span> = rows
            .iter()
            .map(|r| Span {
                start: r.cache.len,
                n: r.tokens.len(),
            })
            .collect();
        // The caches grow in place, layer by layer; a step that fails is undone by truncating
        // every row's layers back to the row's length, which changes only when the step ends.
        match self.run_layers(x, &spans, rows) {
            Ok(out) => {
                for r in rows.iter_mut() {
                    r.cache.len += r.tokens.len();
                }
                Ok(out)
            }
            Err(e) => {
                let head_dim = cfg.hidden / cfg.heads;
                for r in rows.iter_mut() {
                    let len = r.cache.len;
                    r.cache
                        .layers
                        .iter_mut()
                        .for_each(|l| l.truncate(len, head_dim));
                }
                Err(e)
            }
        }
    }

    /// Every block over the step's activations `x`, growing the rows' caches, then the logits
    /// of the rows that want them.
    fn run_layers(
        &self,
        mut x: Tensor,
        spans: &[Span],
        rows: &mut [StepRow<'_>],
    ) -> Result<Vec<Option<Vec<f32>>>, ModelError> {
        for (li, block) in self.blocks.iter().enumerate() {
            let mut past: Vec<&mut LayerKv> =
                rows.iter_mut().map(|r| &mut r.cache.layers[li]).collect();
            x = block.forward(&x, spans, &mut past, &self.rope)?;
        }
        // Logits only at the last token of rows that want them: one LM-head product.
        let mut last = Vec::new();
        let mut off = 0u32;
        for r in rows.iter() {
            off += r.tokens.len() as u32;
            if r.logits {
                last.push(off - 1);
            }
        }
        let mut logits = if last.is_empty() {
            Vec::new()
        } else {
            let n = last.len();
            let idx = Tensor::from_vec(last, n, &self.device)?;
            let xl = self.norm.forward(&x.index_select(&idx, 0)?)?;
            self.lm_head.forward(&xl)?.to_vec2::<f32>()?
        }
        .into_iter();
        Ok(rows
            .iter()
            .map(|r| if r.logits { logits.next() } else { None })
            .collect())
    }

    /// Prefills `tokens` whole into a fresh cache and returns the cache and the last token's
    /// logits (the reference the chunked paths are compared with).
    ///
    /// # Errors
    /// As [`Model::step`].
    pub fn prefill(&self, tokens: &[u32]) -> Result<(KvCache, Vec<f32>), ModelError> {
        let mut cache = KvCache::new(self);
        let out = self.step(&mut [StepRow {
            tokens,
            cache: &mut cache,
            logits: true,
        }])?;
        let logits = out.into_iter().next().flatten().unwrap_or_default();
        Ok((cache, logits))
    }

    /// Greedily generates `n` tokens after `logits`, continuing `cache` one token a step.
    ///
    /// # Errors
    /// As [`Model::step`].
    pub fn greedy(
        &self,
        cache: &mut KvCache,
        logits: &[f32],
        n: usize,
    ) -> Result<Vec<u32>, ModelError> {
        let mut out = Vec::with_capacity(n);
        let mut next = argmax(logits);
        for i in 0..n {
            out.push(next);
            if i + 1 == n {
                break;
            }
            let l = self.step(&mut [StepRow {
                tokens: &[next],
                cache,
                logits: true,
            }])?;
            next = argmax(l[0].as_deref().unwrap_or(&[]));
        }
        Ok(out)
    }
}

/// Largest absolute logit difference between `a` and `b`, relative to `a`'s largest |logit|.
pub fn relative_diff(a: &[f32], b: &[f32]) -> f32 {
    let scale = a
        .iter()
        .fold(0f32, |m, x| m.max(x.abs()))
        .max(f32::MIN_POSITIVE);
    let d = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    if a.len() != b.len() {
        return f32::INFINITY;
    }
    d / scale
}
