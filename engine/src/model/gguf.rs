//! Loading a llama-architecture GGUF file (SmolLM2-135M-Instruct by default) with candle's
//! `quantized::gguf_file` reader.
//!
//! Everything is checked before a weight is read: the file is a regular file of a sane size,
//! `general.architecture` is `llama`, the hyperparameters are present and consistent, and
//! every tensor the model needs is there with the expected shape and lies wholly inside the
//! file. An error names the file and the metadata key or tensor.
//!
//! GGUF's conventions: dimensions are stored innermost first (candle reverses them, so a
//! projection reads `[out, in]`); llama.cpp's converter permutes the q and k projections so
//! that rotary pairs are adjacent dimensions, hence [`super::Config::rope_interleaved`]; a file
//! without `output.weight` ties the LM head to the token embedding.

use std::borrow::Cow;
use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::{GgmlDType, QStorage, QTensor};
use candle_core::{Device, Tensor};

use super::blocks::{Attention, AttentionKernel, Block, Linear, Mlp, RmsNorm};
use super::q4_1::Q4_1Matrix;
use super::{Config, Embedding, Model, ModelError};
use crate::tokenizer::Tokenizer;

/// The default model's file name in the cache (`make model` puts it there).
pub const SMOLLM2_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
/// The default model's size in bytes (its sha256 is checked by `engine/scripts/fetch-model.py`).
pub const SMOLLM2_SIZE: u64 = 98_362_432;
/// The largest GGUF file read.
pub const MAX_GGUF_BYTES: u64 = 64 << 30;

/// How the projection weights are kept in memory (`examples/step_cost.rs` measures each).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightFormat {
    /// Dequantized to f32 at load: candle's f32 matrix products (gemm).
    Dense,
    /// As stored in the file: Q4_1 products on the CPU by the engine's own kernel
    /// ([`super::q4_1`], llama.cpp's arithmetic), every other type by candle's.
    Native,
    /// Requantized at load to Q8_0, with candle's Q8_0 products.
    Q8_0,
}

impl WeightFormat {
    /// By name: `dense`, `native`, `q8_0`.
    pub fn by_name(s: &str) -> Option<Self> {
        match s {
            "dense" | "f32" => Some(Self::Dense),
            "native" => Some(Self::Native),
            "q8_0" => Some(Self::Q8_0),
            _ => None,
        }
    }

    /// The name [`WeightFormat::by_name`] reads.
    pub fn name(self) -> &'static str {
        match self {
            Self::Dense => "dense",
            Self::Native => "native",
            Self::Q8_0 => "q8_0",
        }
    }
}

/// The format the engine serves GGUF files with (`docs/engine-model.md#the-weight-format`).
pub const DEFAULT_FORMAT: WeightFormat = WeightFormat::Native;

/// The model cache: `$XDG_CACHE_HOME/mstar-chunking`, else `$HOME/.cache/mstar-chunking`.
///
/// # Errors
/// Neither variable is set.
pub fn cache_dir() -> Result<PathBuf, String> {
    let base = match std::env::var_os("XDG_CACHE_HOME").filter(|v| !v.is_empty()) {
        Some(x) => PathBuf::from(x),
        None => PathBuf::from(
            std::env::var_os("HOME")
                .filter(|v| !v.is_empty())
                .ok_or("neither XDG_CACHE_HOME nor HOME is set: no model cache")?,
        )
        .join(".cache"),
    };
    Ok(base.join("mstar-chunking"))
}

/// The default model's own name (the API serves it under this name unless told otherwise).
pub const SMOLLM2_NAME: &str = "SmolLM2-135M-Instruct";

/// The default model's path in the cache, checked to be a regular file of its pinned size.
///
/// # Errors
/// The cache cannot be located, or the file is missing, not a regular file or of another size
/// (each says to run `make model`).
pub fn smollm2_path() -> Result<PathBuf, String> {
    let p = cache_dir()?.join(SMOLLM2_FILE);
    let m = std::fs::metadata(&p)
        .map_err(|e| format!("{}: {e} (run `make model` to install it)", p.display()))?;
    if !m.is_file() {
        return Err(format!("{}: not a regular file", p.display()));
    }
    if m.len() != SMOLLM2_SIZE {
        return Err(format!(
            "{}: {} bytes, expected {SMOLLM2_SIZE} (remove it and run `make model`)",
            p.display(),
            m.len()
        ));
    }
    Ok(p)
}

/// A GGUF file's header read and checked against the llama architecture.
pub struct GgufFile {
    path: PathBuf,
    content: Content,
    reader: BufReader<File>,
    size: u64,
    /// The model's shape from the metadata.
    pub config: Config,
}

impl GgufFile {
    /// Opens `path` and reads its header and metadata.
    ///
    /// # Errors
    /// Not a regular file, too large, an unreadable header, another architecture, a missing or
    /// inconsistent hyperparameter.
    pub fn open(path: &Path) -> Result<Self, ModelError> {
        let err = |what: String| ModelError::Gguf {
            path: path.display().to_string(),
            what,
        };
        let meta = std::fs::metadata(path).map_err(|e| err(e.to_string()))?;
        if !meta.is_file() {
            return Err(err("not a regular file".into()));
        }
        let size = meta.len();
        if size > MAX_GGUF_BYTES {
            return Err(err(format!(
                "{size} bytes, more than the {MAX_GGUF_BYTES} read"
            )));
        }
        let file = File::open(path).map_err(|e| err(e.to_string()))?;
        // The size checked above is the size of what was opened (a swap in between is refused).
        let opened = file.metadata().map_err(|e| err(e.to_string()))?;
        if !opened.is_file() || opened.len() != size {
            return Err(err("changed while opening".into()));
        }
        let mut reader = BufReader::new(file);
        let content = Content::read(&mut reader)
            .map_err(|e| err(format!("reading the header: {}", message(&e))))?;
        let arch = content
            .metadata
            .get("general.architecture")
            .and_then(|v| v.to_string().ok())
            .ok_or_else(|| err("metadata key `general.architecture` is missing".into()))?;
        if arch != "llama" {
            return Err(err(format!(
                "`general.architecture` is `{arch}`; only `llama` is served"
            )));
        }
        let config = config_of(&content).map_err(err)?;
        Ok(Self {
            path: path.to_owned(),
            content,
            reader,
            size,
            config,
        })
    }

    /// The file's metadata.
    pub fn metadata(&self) -> &std::collections::HashMap<String, Value> {
        &self.content.metadata
    }

    /// Whether the LM head is the token embedding (no `output.weight` in the file).
    pub fn tied_head(&self) -> bool {
        !self.content.tensor_infos.contains_key("output.weight")
    }

    /// The file's tokenizer alone, without reading a weight.
    ///
    /// # Errors
    /// A tokenizer that cannot be built from the metadata (named).
    pub fn tokenizer(&self) -> Result<Tokenizer, ModelError> {
        Tokenizer::from_gguf(&self.content).map_err(|e| self.err(e.to_string()))
    }

    fn err(&self, what: String) -> ModelError {
        ModelError::Gguf {
            path: self.path.display().to_string(),
            what,
        }
    }

    /// Checks that tensor `name` exists with `shape` and lies inside the file.
    fn check(&self, name: &str, shape: &[usize]) -> Result<GgmlDType, ModelError> {
        let info = self
            .content
            .tensor_infos
            .get(name)
            .ok_or_else(|| self.err(format!("tensor `{name}` is missing")))?;
        if info.shape.dims() != shape {
            return Err(self.err(format!(
                "tensor `{name}` has shape {:?}, expected {shape:?}",
                info.shape.dims()
            )));
        }
        let elems = info.shape.elem_count();
        let block = info.ggml_dtype.block_size();
        if elems % block != 0 {
            return Err(self.err(format!(
                "tensor `{name}` ({:?}) has {elems} elements, not whole blocks of {block}",
                info.ggml_dtype
            )));
        }
        let bytes = (elems / block) as u64 * info.ggml_dtype.type_size() as u64;
        let end = self
            .content
            .tensor_data_offset
            .checked_add(info.offset)
            .and_then(|s| s.checked_add(bytes));
        match end {
            Some(e) if e <= self.size => Ok(info.ggml_dtype),
            _ => Err(self.err(format!(
                "tensor `{name}` ends past the end of the file ({} bytes): truncated",
                self.size
            ))),
        }
    }

    fn read(&mut self, name: &str, device: &Device) -> Result<QTensor, ModelError> {
        let r = self.content.tensor(&mut self.reader, name, device);
        r.map_err(|e| self.err(format!("tensor `{name}`: {}", message(&e))))
    }

    /// Builds the model, its weights kept as `format` says, and its tokenizer.
    ///
    /// # Errors
    /// A missing tensor, a wrong shape, a truncated file, a tokenizer that cannot be built
    /// (each named), or a tensor error.
    pub fn load(mut self, device: &Device, format: WeightFormat) -> Result<Model, ModelError> {
        let cfg = self.config;
        let tokenizer = Tokenizer::from_gguf(&self.content).map_err(|e| self.err(e.to_string()))?;
        let (d, hd, ffn) = (cfg.hidden, cfg.head_dim(), cfg.ffn);
        let (q_out, kv_out) = (cfg.heads * hd, cfg.kv_heads * hd);
        // Every tensor is checked before any is read.
        let mut wanted: Vec<(String, Vec<usize>)> = vec![
            ("token_embd.weight".into(), vec![cfg.vocab, d]),
            ("output_norm.weight".into(), vec![d]),
        ];
        let tied = !self.content.tensor_infos.contains_key("output.weight");
        if !tied {
            wanted.push(("output.weight".into(), vec![cfg.vocab, d]));
        }
        for l in 0..cfg.layers {
            let p = format!("blk.{l}");
            wanted.extend([
                (format!("{p}.attn_norm.weight"), vec![d]),
                (format!("{p}.attn_q.weight"), vec![q_out, d]),
                (format!("{p}.attn_k.weight"), vec![kv_out, d]),
                (format!("{p}.attn_v.weight"), vec![kv_out, d]),
                (format!("{p}.attn_output.weight"), vec![d, q_out]),
                (format!("{p}.ffn_norm.weight"), vec![d]),
                (format!("{p}.ffn_gate.weight"), vec![ffn, d]),
                (format!("{p}.ffn_up.weight"), vec![ffn, d]),
                (format!("{p}.ffn_down.weight"), vec![d, ffn]),
            ]);
        }
        for (name, shape) in &wanted {
            self.check(name, shape)?;
        }
        if tokenizer.vocab_size() != cfg.vocab {
            return Err(self.err(format!(
                "the tokenizer has {} tokens, the embedding {}",
                tokenizer.vocab_size(),
                cfg.vocab
            )));
        }

        let embed_q = Arc::new(self.read("token_embd.weight", device)?);
        let (embed, lm_head) = match format {
            WeightFormat::Dense => {
                let e = embed_q.dequantize(device)?;
                let head = if tied {
                    Linear::dense(e.clone())?
                } else {
                    Linear::dense(self.read("output.weight", device)?.dequantize(device)?)?
                };
                (Embedding::Dense(e), head)
            }
            WeightFormat::Native | WeightFormat::Q8_0 => {
                let head = if tied {
                    Linear::Quantized(candle_core::quantized::QMatMul::from_arc(embed_q.clone())?)
                } else {
                    let out = self.read("output.weight", device)?;
                    linear(vec![out], format, device)?
                };
                (Embedding::Quantized(embed_q), head)
            }
        };
        let norm_of = |t: QTensor| -> Result<RmsNorm, ModelError> {
            Ok(RmsNorm::new(t.dequantize(device)?, cfg.eps))
        };
        let norm = norm_of(self.read("output_norm.weight", device)?)?;
        // Quantized products need attention whose bits do not depend on the chunking.
        let kernel = match (format, device) {
            (WeightFormat::Dense, _) | (_, Device::Cuda(_)) => AttentionKernel::Batched,
            _ => AttentionKernel::Sequential,
        };
        let mut blocks = Vec::with_capacity(cfg.layers);
        for l in 0..cfg.layers {
            let p = format!("blk.{l}");
            let mut get = |n: &str| self.read(&format!("{p}.{n}.weight"), device);
            let attn_norm = norm_of(get("attn_norm")?)?;
            let qkv = linear(
                vec![get("attn_q")?, get("attn_k")?, get("attn_v")?],
                format,
                device,
            )?;
            let o = linear(vec![get("attn_output")?], format, device)?;
            let mlp_norm = norm_of(get("ffn_norm")?)?;
            let gate_up = linear(vec![get("ffn_gate")?, get("ffn_up")?], format, device)?;
            let down = linear(vec![get("ffn_down")?], format, device)?;
            blocks.push(Block {
                attn_norm,
                attn: Attention {
                    qkv,
                    o,
                    heads: cfg.heads,
                    kv_heads: cfg.kv_heads,
                    head_dim: hd,
                    kernel,
                },
                mlp_norm,
                mlp: Mlp { gate_up, down, ffn },
            });
        }
        Model::from_parts(
            cfg,
            device,
            embed,
            blocks,
            norm,
            lm_head,
            Arc::new(tokenizer),
        )
    }
}

/// One linear layer from weights `[out_i, in]` stacked along their outputs.
fn linear(
    parts: Vec<QTensor>,
    format: WeightFormat,
    device: &Device,
) -> Result<Linear, ModelError> {
    let dense = |parts: &[QTensor]| -> Result<Tensor, ModelError> {
        let ts = parts
            .iter()
            .map(|q| q.dequantize(device))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Tensor::cat(&ts, 0)?)
    };
    let quantized = parts
        .iter()
        .all(|q| !matches!(q.dtype(), GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16));
    match format {
        WeightFormat::Dense => Ok(Linear::dense(dense(&parts)?)?),
        // A float weight in a quantized file is kept as floats.
        _ if !quantized => Ok(Linear::dense(dense(&parts)?)?),
        WeightFormat::Q8_0 => Ok(Linear::quantized(QTensor::quantize(
            &dense(&parts)?,
            GgmlDType::Q8_0,
        )?)?),
        WeightFormat::Native => {
            let dtype = parts[0].dtype();
            let q4_1_here = dtype == GgmlDType::Q4_1 && device.is_cpu();
            if parts.len() == 1 && !q4_1_here {
                let q = parts.into_iter().next().expect("one part");
                return Ok(Linear::quantized(q)?);
            }
            if parts.iter().any(|q| q.dtype() != dtype) {
                // Mixed types cannot be stacked as stored: requantize them together.
                return Ok(Linear::quantized(QTensor::quantize(
                    &dense(&parts)?,
                    GgmlDType::Q8_0,
                )?)?);
            }
            // Quantized rows are whole blocks, so stacking along the outputs is concatenating
            // the stored bytes.
            let cols = parts[0].shape().dims()[1];
            let rows: usize = parts.iter().map(|q| q.shape().dims()[0]).sum();
            let mut bytes = Vec::new();
            for q in &parts {
                bytes.extend_from_slice(&q.data()?);
            }
            if q4_1_here {
                let m =
                    Q4_1Matrix::from_ggml(&bytes, rows, cols).map_err(candle_core::Error::Msg)?;
                return Ok(Linear::Q4_1(Arc::new(m)));
            }
            let storage = QStorage::from_data(Cow::Owned(bytes), device, dtype)?;
            Ok(Linear::quantized(QTensor::new(storage, (rows, cols))?)?)
        }
    }
}

/// A candle error's message without the backtrace candle appends under `RUST_BACKTRACE`: an
/// operator reads which file and tensor, not candle's call stack.
fn message(e: &candle_core::Error) -> String {
    match e {
        candle_core::Error::WithBacktrace { inner, .. } => message(inner),
        e => e.to_string(),
    }
}

/// The hyperparameters under `llama.*`, checked for consistency.
fn config_of(ct: &Content) -> Result<Config, String> {
    let md = &ct.metadata;
    let num = |k: &str| -> Result<usize, String> {
        let v = md
            .get(k)
            .ok_or_else(|| format!("metadata key `{k}` is missing"))?;
        let n = match v {
            Value::U8(x) => *x as u64,
            Value::U16(x) => *x as u64,
            Value::U32(x) => *x as u64,
            Value::U64(x) => *x,
            Value::I32(x) if *x >= 0 => *x as u64,
            Value::I64(x) if *x >= 0 => *x as u64,
            _ => return Err(format!("`{k}` is not a non-negative integer: {v:?}")),
        };
        usize::try_from(n)
            .ok()
            .filter(|&n| n > 0 && n <= 1 << 24)
            .ok_or_else(|| format!("`{k}` is {n}, outside 1..=2^24"))
    };
    let float = |k: &str, default: Option<f64>| -> Result<f64, String> {
        match md.get(k) {
            None => default.ok_or_else(|| format!("metadata key `{k}` is missing")),
            Some(Value::F32(x)) => Ok(*x as f64),
            Some(Value::F64(x)) => Ok(*x),
            Some(v) => Err(format!("`{k}` is not a float: {v:?}")),
        }
        .and_then(|x| {
            if x.is_finite() && x > 0.0 {
                Ok(x)
            } else {
                Err(format!("`{k}` is {x}, not a positive finite number"))
            }
        })
    };
    let hidden = num("llama.embedding_length")?;
    let heads = num("llama.attention.head_count")?;
    let kv_heads = match md.get("llama.attention.head_count_kv") {
        None => heads,
        Some(_) => num("llama.attention.head_count_kv")?,
    };
    if hidden % heads != 0 || heads % kv_heads != 0 || (hidden / heads) % 2 != 0 {
        return Err(format!(
            "embedding {hidden}, {heads} heads, {kv_heads} KV heads: the heads must divide the \
             embedding into even widths and the KV heads the heads"
        ));
    }
    if md.contains_key("llama.rope.dimension_count") {
        let rd = num("llama.rope.dimension_count")?;
        if rd != hidden / heads {
            return Err(format!(
                "`llama.rope.dimension_count` is {rd}; only rotary over the whole head ({}) is \
                 implemented",
                hidden / heads
            ));
        }
    }
    let vocab = match ct.tensor_infos.get("token_embd.weight") {
        Some(t) => t.shape.dims().first().copied().unwrap_or(0),
        None => return Err("tensor `token_embd.weight` is missing".into()),
    };
    Ok(Config {
        hidden,
        layers: num("llama.block_count")?,
        heads,
        kv_heads,
        ffn: num("llama.feed_forward_length")?,
        rope_theta: float("llama.rope.freq_base", Some(10_000.0))? as f32,
        eps: float("llama.attention.layer_norm_rms_epsilon", None)?,
        max_positions: num("llama.context_length")?,
        vocab,
        rope_interleaved: true,
    })
}

/// Opens and loads a GGUF model.
///
/// # Errors
/// As [`GgufFile::open`] and [`GgufFile::load`].
pub fn load(path: &Path, device: &Device, format: WeightFormat) -> Result<Model, ModelError> {
    GgufFile::open(path)?.load(device, format)
}
