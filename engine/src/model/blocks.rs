//! The decoder's blocks, candle-style: [`Linear`], [`Attention`], [`Mlp`] and [`Block`], each
//! with a `forward`; each row's keys and values are lent to a block, which grows them by the
//! row's new tokens, so one step can run rows of different contexts side by side.

use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{Module, Tensor};

/// A linear layer `x W^T`, its weight `[out, in]` kept either dense (f32) or quantized.
pub enum Linear {
    /// An f32 weight in both layouts: `w` `[out, in]` (as stored) and `t`, its transposed copy
    /// `[in, out]`.
    ///
    /// CPU matrix products are not linear in the step's tokens `T` at small `T`. `x t` is the
    /// fastest for one token (a matrix-vector product that streams the weight once) and for
    /// many (compute-bound), but for a few tokens it repacks or strides through the whole
    /// weight: on the small model a 2-token step cost three times a 1-token step and a
    /// 16-token step four times, a cliff no latency model of a few linear terms can follow.
    /// For `2..=SMALL_T` tokens [`Linear::forward`] computes `(w x^T)^T` instead, with the
    /// weight as the left operand, which keeps a step's cost nearly flat while the weight's
    /// memory traffic dominates. Both orders compute the same product; the price is the
    /// weights' memory twice.
    Dense {
        /// `[out, in]`.
        w: Tensor,
        /// `[in, out]`.
        t: Tensor,
    },
    /// A GGML-quantized weight (candle's quantized matrix product: the activations are
    /// quantized per row, so a token's result does not depend on the other rows of its step).
    Quantized(QMatMul),
    /// A Q4_1 weight on the CPU, with the engine's own kernel (llama.cpp's arithmetic; see
    /// [`super::q4_1`]), the activations quantized per row as well.
    Q4_1(std::sync::Arc<super::q4_1::Q4_1Matrix>),
}

/// The most tokens in a step for which a dense [`Linear`] puts the weight on the left.
const SMALL_T: usize = 64;

impl Linear {
    /// A dense layer from an f32 weight `[out, in]`.
    ///
    /// # Errors
    /// A tensor error.
    pub fn dense(w: Tensor) -> candle_core::Result<Self> {
        Ok(Self::Dense {
            t: w.t()?.contiguous()?,
            w: w.contiguous()?,
        })
    }

    /// A quantized layer.
    ///
    /// # Errors
    /// A tensor error.
    pub fn quantized(w: QTensor) -> candle_core::Result<Self> {
        Ok(Self::Quantized(QMatMul::from_qtensor(w)?))
    }

    /// `x W^T` for activations `x` `[T, in]`.
    ///
    /// # Errors
    /// A tensor error.
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Self::Dense { w, t } => {
                if (2..=SMALL_T).contains(&x.dim(0)?) {
                    w.matmul(&x.t()?)?.t()?.contiguous()
                } else {
                    x.matmul(t)
                }
            }
            Self::Quantized(q) => q.forward(x),
            Self::Q4_1(m) => x.contiguous()?.apply_op1_no_bwd(m.as_ref()),
        }
    }
}

/// RMSNorm with a learned scale.
pub struct RmsNorm {
    weight: Tensor,
    eps: f32,
}

impl RmsNorm {
    /// A norm with scale `weight` `[d]`.
    pub fn new(weight: Tensor, eps: f64) -> Self {
        Self {
            weight,
            eps: eps as f32,
        }
    }

    /// Normalises each row of `x` `[T, d]`.
    ///
    /// # Errors
    /// A tensor error.
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        candle_nn::ops::rms_norm(x, &self.weight, self.eps)
    }
}

/// Rotary position tables and the rotation's pairing.
pub struct Rope {
    cos: Tensor,
    sin: Tensor,
    /// Rotate adjacent pairs `(2i, 2i+1)` (GGUF's layout: llama.cpp's converter permutes the
    /// q and k projections for it) instead of the two halves `(i, i + hd/2)` (Hugging Face's).
    interleaved: bool,
}

impl Rope {
    /// Tables for `positions` positions of heads of `head_dim`, base `theta`.
    ///
    /// # Errors
    /// A tensor error.
    pub fn new(
        head_dim: usize,
        positions: usize,
        theta: f32,
        interleaved: bool,
        device: &candle_core::Device,
    ) -> candle_core::Result<Self> {
        let inv: Vec<f32> = (0..head_dim / 2)
            .map(|i| 1.0 / theta.powf(2.0 * i as f32 / head_dim as f32))
            .collect();
        let mut angles = Vec::with_capacity(positions * head_dim / 2);
        for p in 0..positions {
            angles.extend(inv.iter().map(|f| p as f32 * f));
        }
        let angles = Tensor::from_vec(angles, (positions, head_dim / 2), device)?;
        Ok(Self {
            cos: angles.cos()?,
            sin: angles.sin()?,
            interleaved,
        })
    }

    /// Rotates `x` `[heads, n, hd]` whose tokens sit at positions `start..start + n`.
    fn apply(&self, x: &Tensor, start: usize) -> candle_core::Result<Tensor> {
        let n = x.dim(1)?;
        let cos = self.cos.narrow(0, start, n)?;
        let sin = self.sin.narrow(0, start, n)?;
        let x = x.unsqueeze(0)?;
        let r = if self.interleaved {
            candle_nn::rotary_emb::rope_i(&x, &cos, &sin)?
        } else {
            candle_nn::rotary_emb::rope(&x, &cos, &sin)?
        };
        r.squeeze(0)
    }
}

/// One row's place in a step: `n` new tokens after `start` cached ones.
#[derive(Debug, Clone, Copy)]
pub struct Span {
    /// The position of the row's first new token (its cached context).
    pub start: usize,
    /// Its new tokens.
    pub n: usize,
}

/// One layer's keys and values for one row, grown in place by each step the row runs.
#[derive(Clone, Default)]
pub enum LayerKv {
    /// Nothing cached yet.
    #[default]
    Empty,
    /// `[kv_heads, len, head_dim]` tensors (the batched kernel), replaced each step by the
    /// past joined with the step's new tokens.
    Tensors(Tensor, Tensor),
    /// Host buffers, one per KV head, each `[len, head_dim]` (the sequential kernel): a step
    /// appends its new tokens' keys and values and copies nothing of the past, so a decode
    /// row's cost follows the keys its attention reads, not a copy of its whole cache. A head's
    /// keys stay contiguous, so the query heads that share it read one compact run.
    Host {
        /// Keys, per KV head.
        k: Vec<Vec<f32>>,
        /// Values, per KV head.
        v: Vec<Vec<f32>>,
    },
}

impl LayerKv {
    /// Back to the first `len` tokens, each `head_dim` values a KV head: undoes a step that
    /// failed after this layer grew.
    pub fn truncate(&mut self, len: usize, head_dim: usize) {
        match self {
            LayerKv::Empty => {}
            LayerKv::Host { k, v } => {
                for head in k.iter_mut().chain(v.iter_mut()) {
                    head.truncate(len * head_dim);
                }
            }
            LayerKv::Tensors(k, v) => {
                if len == 0 {
                    *self = LayerKv::Empty;
                } else if let (Ok(nk), Ok(nv)) = (k.narrow(1, 0, len), v.narrow(1, 0, len)) {
                    *k = nk;
                    *v = nv;
                }
            }
        }
    }
}

/// How attention's products are computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionKernel {
    /// candle's batched matrix products over the row's queries: fast, but the order of each
    /// sum depends on how many queries and keys the step holds, so a token's result differs
    /// in its last bits between a whole prompt and its chunks. Enough for f32 weights, whose
    /// models keep such differences near 1e-6.
    Batched,
    /// One query at a time, its keys in position order, with a fixed summation order
    /// ([`exact_attention`]): a token's result is bit-for-bit the same however its prompt was
    /// cut. Quantized weights need it, since they quantize each row's activations to 8 bits
    /// before every product, and a last-bit difference that moves one activation across a
    /// rounding boundary grows through 30 layers into logits differing by more than 1.
    Sequential,
}

/// Grouped-query self-attention.
pub struct Attention {
    /// q, k and v projections fused into one `[(heads + 2 kv_heads) hd, d]` weight, so a step
    /// runs them as one product.
    pub qkv: Linear,
    /// The output projection.
    pub o: Linear,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Width of a head.
    pub head_dim: usize,
    /// How the products are computed.
    pub kernel: AttentionKernel,
}

impl Attention {
    /// Attends every row of `x` (`[T, d]`, normalised; rows in `spans` order) to its cached
    /// keys and values (`past`, one entry per row) and to itself, causally, growing each row's
    /// cache by its new tokens. Returns the output `[T, d]`.
    ///
    /// # Errors
    /// A tensor error; the caches may then have grown (the caller truncates them back).
    pub fn forward(
        &self,
        x: &Tensor,
        spans: &[Span],
        past: &mut [&mut LayerKv],
        rope: &Rope,
    ) -> candle_core::Result<Tensor> {
        let (h, kvh, hd) = (self.heads, self.kv_heads, self.head_dim);
        let qkv = self.qkv.forward(x)?; // [T, (h + 2 kvh) hd]
        let scale = 1.0 / (hd as f64).sqrt();
        let mut outs = Vec::with_capacity(spans.len());
        let mut off = 0;
        for (span, past) in spans.iter().zip(past.iter_mut()) {
            let Span { start, n } = *span;
            let part = qkv.narrow(0, off, n)?;
            off += n;
            let heads = |col: usize, nh: usize| -> candle_core::Result<Tensor> {
                part.narrow(1, col, nh * hd)?
                    .reshape((n, nh, hd))?
                    .transpose(0, 1)?
                    .contiguous()
            };
            let q = rope.apply(&heads(0, h)?, start)?; // [H, n, hd]
            let k = rope.apply(&heads(h * hd, kvh)?, start)?; // [KV, n, hd]
            let v = heads((h + kvh) * hd, kvh)?; // [KV, n, hd]
            let ctx = start + n;
            if self.kernel == AttentionKernel::Sequential {
                // The new tokens' keys and values, `[KV, n, hd]`, appended head by head.
                let k_new = k.flatten_all()?.to_vec1::<f32>()?;
                let v_new = v.flatten_all()?.to_vec1::<f32>()?;
                if !matches!(past, LayerKv::Host { .. }) {
                    **past = LayerKv::Host {
                        k: vec![Vec::new(); kvh],
                        v: vec![Vec::new(); kvh],
                    };
                }
                let LayerKv::Host { k: kc, v: vc } = &mut **past else {
                    unreachable!("made a host cache just above")
                };
                if kc.len() != kvh
                    || kc
                        .iter()
                        .chain(vc.iter())
                        .any(|head| head.len() != start * hd)
                {
                    return Err(candle_core::Error::Msg(format!(
                        "a cache not of {kvh} heads of {start} positions for a row at position {start}"
                    )));
                }
                for (head, (kh, vh)) in kc.iter_mut().zip(vc.iter_mut()).enumerate() {
                    kh.extend_from_slice(&k_new[head * n * hd..][..n * hd]);
                    vh.extend_from_slice(&v_new[head * n * hd..][..n * hd]);
                }
                let o = exact_attention(
                    &q.flatten_all()?.to_vec1::<f32>()?,
                    kc,
                    vc,
                    Shape {
                        heads: h,
                        kv_heads: kvh,
                        head_dim: hd,
                        n,
                        start,
                    },
                );
                outs.push(Tensor::from_vec(o, (n, h * hd), x.device())?);
                continue;
            }
            let (k_all, v_all) = match &**past {
                LayerKv::Tensors(ck, cv) => {
                    (Tensor::cat(&[ck, &k], 1)?, Tensor::cat(&[cv, &v], 1)?)
                }
                LayerKv::Empty => (k, v),
                LayerKv::Host { .. } => {
                    return Err(candle_core::Error::Msg(
                        "a host cache under the batched kernel".into(),
                    ))
                }
            };
            // Grouped-query attention without copying keys: the `rep` query heads that share a
            // KV head are stacked along the query axis.
            let rep = h / kvh;
            let qg = q.reshape((kvh, rep * n, hd))?;
            let scores = (qg.matmul(&k_all.t()?)? * scale)?; // [KV, rep n, ctx]
            let scores = if n > 1 {
                // Query i (position start + i) sees keys 0..=start + i.
                let mut mask = vec![0f32; n * ctx];
                for (i, line) in mask.chunks_exact_mut(ctx).enumerate() {
                    line[start + i + 1..].fill(f32::NEG_INFINITY);
                }
                let mask = Tensor::from_vec(mask, (1, 1, n, ctx), x.device())?;
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
            **past = LayerKv::Tensors(k_all, v_all);
        }
        self.o.forward(&Tensor::cat(&outs, 0)?)
    }
}

/// The sizes of one row's attention.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Width of a head.
    pub head_dim: usize,
    /// The row's new tokens (queries).
    pub n: usize,
    /// The position of the first query (keys before it are cached).
    pub start: usize,
}

/// Causal grouped-query attention for one row whose result for a query depends only on the
/// query, its position and the keys and values up to it: queries `q` `[heads, n, hd]`, keys
/// and values per KV head, each `[start + n, hd]`; returns `[n, heads * hd]`. Query `i` attends to
/// keys `0..=start + i`. Every sum runs in one fixed order (eight lanes, then a fixed
/// reduction), so a token's output is the same bits whether its prompt ran whole or in chunks
/// of any size; queries run in parallel.
pub fn exact_attention(q: &[f32], k: &[Vec<f32>], v: &[Vec<f32>], s: Shape) -> Vec<f32> {
    use rayon::prelude::*;
    let Shape {
        heads,
        kv_heads,
        head_dim: hd,
        n,
        start,
    } = s;
    debug_assert!(k.iter().chain(v).all(|head| head.len() >= (start + n) * hd));
    let rep = heads / kv_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    let mut out = vec![0f32; n * heads * hd];
    out.par_chunks_mut(heads * hd)
        .enumerate()
        .for_each(|(i, row)| {
            let pos = start + i;
            let mut w = vec![0f32; pos + 1];
            for (head, o) in row.chunks_exact_mut(hd).enumerate() {
                let kv = head / rep;
                let qv = &q[(head * n + i) * hd..][..hd];
                let keys = &k[kv][..(pos + 1) * hd];
                let vals = &v[kv][..(pos + 1) * hd];
                let mut max = f32::NEG_INFINITY;
                for (wj, kj) in w.iter_mut().zip(keys.chunks_exact(hd)) {
                    *wj = dot(qv, kj) * scale;
                    max = max.max(*wj);
                }
                let mut sum = 0f32;
                for wj in w.iter_mut() {
                    *wj = (*wj - max).exp();
                    sum += *wj;
                }
                o.fill(0.0);
                for (&wj, vj) in w.iter().zip(vals.chunks_exact(hd)) {
                    for (od, &vd) in o.iter_mut().zip(vj) {
                        *od += wj * vd;
                    }
                }
                let inv = 1.0 / sum;
                o.iter_mut().for_each(|x| *x *= inv);
            }
        });
    out
}

/// A dot product in a fixed order: eight lanes, then a fixed tree, then the tail.
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ac, at) = a.split_at(a.len() / 8 * 8);
    let (bc, bt) = b.split_at(ac.len());
    for (x, y) in ac.chunks_exact(8).zip(bc.chunks_exact(8)) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (x, y) in at.iter().zip(bt) {
        s += x * y;
    }
    s
}

/// The SwiGLU feed-forward layer.
pub struct Mlp {
    /// gate and up fused: `[2 ffn, d]`.
    pub gate_up: Linear,
    /// `[d, ffn]`.
    pub down: Linear,
    /// The inner width.
    pub ffn: usize,
}

impl Mlp {
    /// `down(silu(gate x) * up x)` for `x` `[T, d]`.
    ///
    /// # Errors
    /// A tensor error.
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let gu = self.gate_up.forward(x)?; // [T, 2 ffn]
        let gate = gu.narrow(1, 0, self.ffn)?;
        let up = gu.narrow(1, self.ffn, self.ffn)?;
        self.down.forward(&(candle_nn::ops::silu(&gate)? * up)?)
    }
}

/// One pre-norm decoder layer: `x + attn(norm x)`, then `x + mlp(norm x)`.
pub struct Block {
    /// The norm before attention.
    pub attn_norm: RmsNorm,
    /// Self-attention.
    pub attn: Attention,
    /// The norm before the MLP.
    pub mlp_norm: RmsNorm,
    /// The feed-forward layer.
    pub mlp: Mlp,
}

impl Block {
    /// The layer over a step's activations `x` `[T, d]`; see [`Attention::forward`].
    ///
    /// # Errors
    /// A tensor error.
    pub fn forward(
        &self,
        x: &Tensor,
        spans: &[Span],
        past: &mut [&mut LayerKv],
        rope: &Rope,
    ) -> candle_core::Result<Tensor> {
        let a = self
            .attn
            .forward(&self.attn_norm.forward(x)?, spans, past, rope)?;
        let x = (x + a)?;
        let m = self.mlp.forward(&self.mlp_norm.forward(&x)?)?;
        x + m
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn a_layer_truncates_back_to_its_first_tokens() {
        // Host buffers: two KV heads of 3 tokens of head_dim 2, back to 1 token.
        let mut host = LayerKv::Host {
            k: vec![vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0], vec![7.0; 6]],
            v: vec![vec![6.0, 5.0, 4.0, 3.0, 2.0, 1.0], vec![8.0; 6]],
        };
        host.truncate(1, 2);
        let LayerKv::Host { k, v } = &host else {
            panic!("still host buffers")
        };
        assert_eq!(k, &[vec![1.0, 2.0], vec![7.0, 7.0]]);
        assert_eq!(v, &[vec![6.0, 5.0], vec![8.0, 8.0]]);
        // Tensors `[kv_heads 1, 3 tokens, hd 2]`: back to 2 tokens, then to none.
        let t = Tensor::arange(0f32, 6.0, &Device::Cpu).unwrap();
        let t = t.reshape((1, 3, 2)).unwrap();
        let mut kv = LayerKv::Tensors(t.clone(), t);
        kv.truncate(2, 2);
        let LayerKv::Tensors(k, _) = &kv else {
            panic!("still tensors")
        };
        assert_eq!(k.dims(), &[1, 2, 2]);
        assert_eq!(
            k.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            [0.0, 1.0, 2.0, 3.0]
        );
        kv.truncate(0, 2);
        assert!(matches!(kv, LayerKv::Empty));
    }
}
