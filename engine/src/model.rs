//! A Llama-architecture decoder (RMSNorm, rotary positions, grouped-query attention, SwiGLU)
//! over a byte vocabulary, run one engine step at a time.
//!
//! A step is a list of [`StepRow`]s. All rows' new tokens are flattened into one `[T, d]`
//! activation; every linear layer (the q/k/v/o projections, the MLP, the LM head) runs once for
//! the whole step. Attention runs per row against that row's [`KvCache`]: a row of `n` new
//! tokens at positions `[start, start + n)` attends causally to the `start` tokens it has cached
//! and to itself, so a prompt chunk and a decode row (`n = 1`) are the same computation. Logits
//! are computed only for rows that ask for them, at their last token.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

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
    /// A size name that is not `tiny` or `small`.
    #[error("unknown model size `{0}` (expected `tiny` or `small`)")]
    UnknownSize(String),
}

/// The byte vocabulary: token `b` (0..=255) is the byte `b`, then BOS and EOS.
pub const VOCAB: usize = 258;
/// Beginning of sequence.
pub const BOS: u32 = 256;
/// End of sequence.
pub const EOS: u32 = 257;

/// Encodes text as BOS followed by its UTF-8 bytes.
pub fn encode(text: &str) -> Vec<u32> {
    std::iter::once(BOS)
        .chain(text.bytes().map(u32::from))
        .collect()
}

/// Decodes byte tokens to text (BOS/EOS dropped; invalid UTF-8 replaced).
pub fn decode(tokens: &[u32]) -> String {
    let bytes: Vec<u8> = tokens
        .iter()
        .filter(|&&t| t < 256)
        .map(|&t| t as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

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
            ("model.embed_tokens.weight".to_owned(), vec![VOCAB, d]),
            ("model.norm.weight".to_owned(), vec![d]),
            ("lm_head.weight".to_owned(), vec![VOCAB, d]),
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

struct Layer {
    in_norm: Tensor,
    post_norm: Tensor,
    /// q, k and v projections fused into one `[d + 2 kv hd, d]` weight (as stored: output
    /// features by input features), so a step runs them as one product ([`linear`]).
    qkv: Linear,
    o: Linear,
    /// gate and up fused: `[2 ffn, d]`.
    gate_up: Linear,
    down: Linear,
}

/// A linear layer's weight, kept in both layouts: `w` `[out, in]` (as stored) and `t`, its
/// transposed copy `[in, out]`.
///
/// CPU matrix products are not linear in the step's tokens `T` at small `T`. `x t` is the
/// fastest for one token (a matrix-vector product that streams the weight once) and for many
/// (compute-bound), but for a few tokens it repacks or strides through the whole weight: on
/// the small model a 2-token step cost three times a 1-token step and a 16-token step four
/// times, a cliff no latency model of a few linear terms can follow. For `2..=SMALL_T` tokens
/// [`Linear::apply`] computes `(w x^T)^T` instead, with the weight as the left operand, which
/// keeps a step's cost nearly flat while the weight's memory traffic dominates. Both orders
/// compute the same product; the price is the weights' memory twice.
struct Linear {
    w: Tensor,
    t: Tensor,
}

/// The most tokens in a step for which [`Linear::apply`] puts the weight on the left.
const SMALL_T: usize = 64;

impl Linear {
    fn new(w: Tensor) -> Result<Self, candle_core::Error> {
        Ok(Self {
            t: w.t()?.contiguous()?,
            w: w.contiguous()?,
        })
    }

    /// `x W^T` for activations `x` `[T, in]`.
    fn apply(&self, x: &Tensor) -> Result<Tensor, candle_core::Error> {
        if (2..=SMALL_T).contains(&x.dim(0)?) {
            self.w.matmul(&x.t()?)?.t()?.contiguous()
        } else {
            x.matmul(&self.t)
        }
    }
}

#[derive(Clone)]
/// One row's KV cache: per layer, keys and values `[kv_heads, len, head_dim]`, grown by each
/// step the row runs. Its length is the row's context.
pub struct KvCache {
    layers: Vec<Option<(Tensor, Tensor)>>,
    len: usize,
}

impl KvCache {
    /// An empty cache for `model`.
    pub fn new(model: &Model) -> Self {
        KvCache {
            layers: (0..model.config.layers).map(|_| None).collect(),
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

/// The decoder.
pub struct Model {
    /// Its shape.
    pub config: Config,
    device: Device,
    embed: Tensor,
    norm: Tensor,
    lm_head: Linear,
    layers: Vec<Layer>,
    cos: Tensor,
    sin: Tensor,
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

    /// Builds the model from named weights.
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
        let mut layers = Vec::with_capacity(config.layers);
        for l in 0..config.layers {
            let p = format!("model.layers.{l}");
            let q = get(&format!("{p}.self_attn.q_proj.weight"))?;
            let k = get(&format!("{p}.self_attn.k_proj.weight"))?;
            let v = get(&format!("{p}.self_attn.v_proj.weight"))?;
            let gate = get(&format!("{p}.mlp.gate_proj.weight"))?;
            let up = get(&format!("{p}.mlp.up_proj.weight"))?;
            layers.push(Layer {
                in_norm: get(&format!("{p}.input_layernorm.weight"))?,
                post_norm: get(&format!("{p}.post_attention_layernorm.weight"))?,
                qkv: Linear::new(Tensor::cat(&[q, k, v], 0)?)?,
                o: Linear::new(get(&format!("{p}.self_attn.o_proj.weight"))?)?,
                gate_up: Linear::new(Tensor::cat(&[gate, up], 0)?)?,
                down: Linear::new(get(&format!("{p}.mlp.down_proj.weight"))?)?,
            });
        }
        let hd = config.head_dim();
        let inv: Vec<f32> = (0..hd / 2)
            .map(|i| 1.0 / config.rope_theta.powf(2.0 * i as f32 / hd as f32))
            .collect();
        let mut angles = Vec::with_capacity(config.max_positions * hd / 2);
        for p in 0..config.max_positions {
            angles.extend(inv.iter().map(|f| p as f32 * f));
        }
        let angles = Tensor::from_vec(angles, (config.max_positions, hd / 2), device)?;
        Ok(Model {
            config,
            device: device.clone(),
            embed: get("model.embed_tokens.weight")?,
            norm: get("model.norm.weight")?,
            lm_head: Linear::new(get("lm_head.weight")?)?,
            layers,
            cos: angles.cos()?,
            sin: angles.sin()?,
        })
    }

    /// The device the model runs on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Runs one step: every row's tokens through every layer, appending their keys and values
    /// to the rows' caches. Returns, per row in order, its logits at its last token when it
    /// asked for them (`VOCAB` values), else `None`.
    ///
    /// # Errors
    /// A row with no tokens, a token outside the vocabulary, a row past `max_positions`, or a
    /// tensor error. On error no cache has been changed.
    pub fn step(&self, rows: &mut [StepRow<'_>]) -> Result<Vec<Option<Vec<f32>>>, ModelError> {
        let cfg = &self.config;
        let (h, kvh, hd) = (cfg.heads, cfg.kv_heads, cfg.head_dim());
        let mut ids = Vec::new();
        for (i, r) in rows.iter().enumerate() {
            if r.tokens.is_empty() {
                return Err(ModelError::BadRow {
                    row: i,
                    what: "no tokens".into(),
                });
            }
            if let Some(t) = r.tokens.iter().find(|&&t| t as usize >= VOCAB) {
                return Err(ModelError::BadRow {
                    row: i,
                    what: format!("token {t} is outside the vocabulary of {VOCAB}"),
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
        let mut x = self.embed.index_select(&ids, 0)?; // [T, d]
                                                       // New caches are built aside and swapped in only when the whole step succeeded.
        let mut new_kv: Vec<Vec<(Tensor, Tensor)>> = rows.iter().map(|_| Vec::new()).collect();
        let scale = 1.0 / (hd as f64).sqrt();
        for (li, layer) in self.layers.iter().enumerate() {
            let hn = candle_nn::ops::rms_norm(&x, &layer.in_norm, cfg.eps as f32)?;
            let qkv = layer.qkv.apply(&hn)?; // [T, d + 2 kv hd]
            let mut outs = Vec::with_capacity(rows.len());
            let mut off = 0;
            for (ri, r) in rows.iter().enumerate() {
                let n = r.tokens.len();
                let start = r.cache.len;
                let part = qkv.narrow(0, off, n)?;
                off += n;
                let heads = |col: usize, nh: usize| -> Result<Tensor, candle_core::Error> {
                    part.narrow(1, col, nh * hd)?
                        .reshape((n, nh, hd))?
                        .transpose(0, 1)?
                        .contiguous()
                };
                let cos = self.cos.narrow(0, start, n)?;
                let sin = self.sin.narrow(0, start, n)?;
                let q = heads(0, h)?.unsqueeze(0)?;
                let q = candle_nn::rotary_emb::rope(&q, &cos, &sin)?.squeeze(0)?; // [H, n, hd]
                let k = heads(h * hd, kvh)?.unsqueeze(0)?;
                let k = candle_nn::rotary_emb::rope(&k, &cos, &sin)?.squeeze(0)?; // [KV, n, hd]
                let v = heads((h + kvh) * hd, kvh)?; // [KV, n, hd]
                let (k_all, v_all) = match &r.cache.layers[li] {
                    Some((ck, cv)) => (Tensor::cat(&[ck, &k], 1)?, Tensor::cat(&[cv, &v], 1)?),
                    None => (k, v),
                };
                let ctx = start + n;
                // Grouped-query attention without copying keys: the `rep` query heads that
                // share a KV head are stacked along the query axis.
                let rep = h / kvh;
                let qg = q.reshape((kvh, rep * n, hd))?;
                let scores = (qg.matmul(&k_all.t()?)? * scale)?; // [KV, rep n, ctx]
                let scores = if n > 1 {
                    // Query i (position start + i) sees keys 0..=start + i.
                    let mut mask = vec![0f32; n * ctx];
                    for (i, line) in mask.chunks_exact_mut(ctx).enumerate() {
                        line[start + i + 1..].fill(f32::NEG_INFINITY);
                    }
                    let mask = Tensor::from_vec(mask, (1, 1, n, ctx), &self.device)?;
                    scores
                        .reshape((kvh, rep, n, ctx))?
                        .broadcast_add(&mask)?
                        .reshape((kvh, rep * n, ctx))?
                } else {
                    scores
                };
                let probs = candle_nn::ops::softmax_last_dim(&scores)?;
                let o = probs.matmul(&v_all)?; // [KV, rep n, hd]
                let o = o
                    .reshape((h, n, hd))?
                    .transpose(0, 1)?
                    .reshape((n, h * hd))?;
                outs.push(o);
                new_kv[ri].push((k_all, v_all));
            }
            let attn = layer.o.apply(&Tensor::cat(&outs, 0)?)?;
            x = (x + attn)?;
            let hn = candle_nn::ops::rms_norm(&x, &layer.post_norm, cfg.eps as f32)?;
            let gu = layer.gate_up.apply(&hn)?; // [T, 2 ffn]
            let gate = gu.narrow(1, 0, cfg.ffn)?;
            let up = gu.narrow(1, cfg.ffn, cfg.ffn)?;
            let act = (candle_nn::ops::silu(&gate)? * up)?;
            x = (x + layer.down.apply(&act)?)?;
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
            let xl = x.index_select(&idx, 0)?;
            let xl = candle_nn::ops::rms_norm(&xl, &self.norm, cfg.eps as f32)?;
            self.lm_head.apply(&xl)?.to_vec2::<f32>()?
        }
        .into_iter();
        let mut out = Vec::with_capacity(rows.len());
        for (r, kv) in rows.iter_mut().zip(new_kv) {
            r.cache.len += r.tokens.len();
            for (slot, pair) in r.cache.layers.iter_mut().zip(kv) {
                *slot = Some(pair);
            }
            out.push(if r.logits { logits.next() } else { None });
        }
        Ok(out)
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

/// The index of the largest logit (the first on ties).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// Seeded sampling: greedy at temperature 0, else softmax at `temperature` restricted to the
/// smallest set of tokens whose probability reaches `top_p`.
pub struct Sampler {
    rng: SmallRng,
    temperature: f32,
    top_p: f32,
}

impl Sampler {
    /// A sampler; `seed` makes its draws repeatable.
    pub fn new(seed: u64, temperature: f32, top_p: f32) -> Self {
        Sampler {
            rng: SmallRng::seed_from_u64(seed),
            temperature,
            top_p,
        }
    }

    /// The next token from `logits`.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.temperature <= 0.0 || logits.is_empty() {
            return argmax(logits);
        }
        let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let mut p: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, ((l - max) / self.temperature).exp()))
            .collect();
        let sum: f32 = p.iter().map(|x| x.1).sum();
        p.iter_mut().for_each(|x| x.1 /= sum);
        p.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        let mut keep = 0;
        let mut acc = 0.0;
        for x in &p {
            keep += 1;
            acc += x.1;
            if acc >= self.top_p {
                break;
            }
        }
        let p = &p[..keep];
        let mut u = self.rng.gen::<f32>() * acc;
        for x in p {
            if u < x.1 {
                return x.0;
            }
            u -= x.1;
        }
        p[p.len() - 1].0
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
