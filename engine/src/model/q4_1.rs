//! Q4_1 weights times activations quantized to Q8_1, on the CPU, with llama.cpp's arithmetic
//! (`quantize_row_q8_1` and `ggml_vec_dot_q4_1_q8_1`).
//!
//! candle 0.11 has no SIMD kernel for a Q4_1 dot product: its scalar loop made the SmolLM2
//! file ~17x slower than the same model requantized to Q8_0. Requantizing is fast but changes
//! the weights, and the greedy continuations then part from llama.cpp's on the same file (2 of
//! 5 prompts matched instead of 4: `engine/results/greedy_vs_llama_cpp_by_format.txt`). This
//! kernel keeps the file's weights and rounds the activations as llama.cpp does, with an AVX2
//! loop picked at run time where the CPU has it and a portable loop elsewhere.
//!
//! A token's result never depends on the other tokens of its step: each token's activations
//! are quantized alone and dotted alone, so chunked prefill stays bit-exact.

use candle_core::{CpuStorage, CustomOp1, Layout, Shape};
use half::f16;
use std::sync::Mutex;

/// Weights (and activations) per block.
pub const BLOCK: usize = 32;
/// Output rows per task of a product.
const ROWS_PER_TASK: usize = 16;
/// Bytes of one stored Q4_1 block: `d` and `m` as f16, then 16 bytes of nibbles.
const STORED_BYTES: usize = 20;

/// A weight block: `w[j] = d * q[j] + m`, the first 16 weights in the low nibbles of `qs`
/// and the last 16 in the high nibbles.
#[derive(Clone, Copy, Debug, PartialEq)]
struct WeightBlock {
    d: f32,
    m: f32,
    qs: [u8; 16],
}

/// An activation block: `x[j] ≈ d * qs[j]`, and `s = d * Σ qs` (both rounded to f16, as
/// llama.cpp stores them).
#[derive(Clone, Copy, Debug, PartialEq)]
struct ActBlock {
    qs: [i8; BLOCK],
    d: f32,
    s: f32,
}

const ZERO_ACT: ActBlock = ActBlock {
    qs: [0; BLOCK],
    d: 0.0,
    s: 0.0,
};

/// A `[rows, cols]` Q4_1 matrix, applied as `x W^T`.
pub struct Q4_1Matrix {
    rows: usize,
    cols: usize,
    blocks: Vec<WeightBlock>,
}

impl Q4_1Matrix {
    /// A matrix from GGML's Q4_1 bytes, rows after rows.
    ///
    /// # Errors
    /// `cols` is not whole blocks, or the bytes are not `rows * cols / 32` blocks.
    pub fn from_ggml(bytes: &[u8], rows: usize, cols: usize) -> Result<Self, String> {
        if cols == 0 || !cols.is_multiple_of(BLOCK) {
            return Err(format!(
                "{cols} columns are not whole Q4_1 blocks of {BLOCK}"
            ));
        }
        let n = rows * (cols / BLOCK);
        if bytes.len() != n * STORED_BYTES {
            return Err(format!(
                "{} bytes for a {rows}x{cols} Q4_1 matrix, which has {} bytes",
                bytes.len(),
                n * STORED_BYTES
            ));
        }
        let blocks = bytes
            .chunks_exact(STORED_BYTES)
            .map(|b| {
                let mut qs = [0u8; 16];
                qs.copy_from_slice(&b[4..]);
                WeightBlock {
                    d: f16::from_le_bytes([b[0], b[1]]).to_f32(),
                    m: f16::from_le_bytes([b[2], b[3]]).to_f32(),
                    qs,
                }
            })
            .collect();
        Ok(Self { rows, cols, blocks })
    }

    /// `x W^T` for `x` `[t, cols]` (row-major): `[t, rows]`, row-major.
    ///
    /// # Panics
    /// `x` is not `t * cols` values.
    pub fn matmul(&self, x: &[f32], t: usize) -> Vec<f32> {
        assert_eq!(x.len(), t * self.cols, "activations of the wrong size");
        if t == 0 {
            return Vec::new();
        }
        let nb = self.cols / BLOCK;
        let mut acts = vec![ZERO_ACT; t * nb];
        for (x, a) in x.chunks_exact(self.cols).zip(acts.chunks_exact_mut(nb)) {
            quantize_q8_1(x, a);
        }
        let dot = dot_fn();
        // Tasks of ROWS_PER_TASK rows, each writing its rows' outputs for every token, run on
        // candle's own worker pool (its workers spin briefly between products, so a decode
        // step's many small products do not pay a thread wake-up each).
        let mut by_row = vec![0f32; self.rows * t];
        let tasks: Vec<Mutex<&mut [f32]>> = by_row
            .chunks_mut(ROWS_PER_TASK * t)
            .map(Mutex::new)
            .collect();
        candle_core::utils::barrier_pool().execute_chunked(tasks.len(), |range| {
            for task in range {
                let mut out = tasks[task].lock().unwrap_or_else(|e| e.into_inner());
                let first = task * ROWS_PER_TASK;
                for (i, out) in out.chunks_exact_mut(t).enumerate() {
                    let w = &self.blocks[(first + i) * nb..(first + i + 1) * nb];
                    for (o, a) in out.iter_mut().zip(acts.chunks_exact(nb)) {
                        *o = dot(w, a);
                    }
                }
            }
        });
        drop(tasks);
        if t == 1 {
            return by_row;
        }
        let mut out = vec![0f32; t * self.rows];
        for (r, row) in by_row.chunks_exact(t).enumerate() {
            for (tok, v) in row.iter().enumerate() {
                out[tok * self.rows + r] = *v;
            }
        }
        out
    }
}

impl CustomOp1 for Q4_1Matrix {
    fn name(&self) -> &'static str {
        "q4_1-matmul"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (t, cols) = layout.shape().dims2()?;
        if cols != self.cols {
            candle_core::bail!(
                "q4_1-matmul: {cols} input features for a {}-column matrix",
                self.cols
            );
        }
        let CpuStorage::F32(x) = storage else {
            candle_core::bail!("q4_1-matmul: activations must be f32");
        };
        let Some((start, end)) = layout.contiguous_offsets() else {
            candle_core::bail!("q4_1-matmul: activations must be contiguous");
        };
        let out = self.matmul(&x[start..end], t);
        Ok((CpuStorage::F32(out), Shape::from((t, self.rows))))
    }
}

/// Quantizes `x` (whole blocks) as llama.cpp's x86 `quantize_row_q8_1` does: the scale from
/// the block's largest magnitude, values rounded half to even.
fn quantize_q8_1(x: &[f32], out: &mut [ActBlock]) {
    for (x, a) in x.chunks_exact(BLOCK).zip(out.iter_mut()) {
        let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        let mut sum = 0i32;
        for (q, v) in a.qs.iter_mut().zip(x) {
            let r = (v * id).round_ties_even() as i32;
            *q = r as i8;
            sum += r;
        }
        a.d = f16::from_f32(d).to_f32();
        a.s = f16::from_f32(d * sum as f32).to_f32();
    }
}

type DotFn = fn(&[WeightBlock], &[ActBlock]) -> f32;

/// The fastest dot product this CPU runs.
fn dot_fn() -> DotFn {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        return |w, a| {
            // SAFETY: the CPU has AVX2 and FMA (checked above).
            unsafe { avx2::dot(w, a) }
        };
    }
    dot_portable
}

/// `Σ_blocks d_w d_a Σ_j q_w q_a + m_w s_a`, the scaled integer sums added up per block.
fn dot_portable(w: &[WeightBlock], a: &[ActBlock]) -> f32 {
    let mut acc = 0f32;
    let mut mins = 0f32;
    for (w, a) in w.iter().zip(a) {
        let mut sumi = 0i32;
        for j in 0..16 {
            sumi += i32::from(w.qs[j] & 0x0F) * i32::from(a.qs[j])
                + i32::from(w.qs[j] >> 4) * i32::from(a.qs[j + 16]);
        }
        mins += w.m * a.s;
        acc += w.d * a.d * sumi as f32;
    }
    acc + mins
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{ActBlock, WeightBlock};
    use std::arch::x86_64::*;

    /// [`super::dot_portable`] with llama.cpp's AVX2 loop: the 32 products of a block
    /// summed as integers, scaled, and accumulated in eight f32 lanes.
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot(w: &[WeightBlock], a: &[ActBlock]) -> f32 {
        let low = _mm256_set1_epi8(0x0F);
        let ones = _mm256_set1_epi16(1);
        // The block's integer sums as 8 f32 lanes.
        let sums = |w: &WeightBlock, a: &ActBlock| {
            // SAFETY: 16 and 32 bytes read from arrays of that size, unaligned loads.
            let packed = unsafe { _mm_loadu_si128(w.qs.as_ptr().cast()) };
            let qw = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), low);
            let qa = unsafe { _mm256_loadu_si256(a.qs.as_ptr().cast()) };
            // u8 x i8 pairs summed to i16 (at most 2 * 15 * 128: no saturation), then to i32.
            _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(qw, qa), ones))
        };
        // One accumulator, in llama.cpp's order: activations are requantized at every layer,
        // so even a different order of the same additions moves values across a rounding
        // boundary now and then, and greedy text parts from llama.cpp's at a near-tie.
        let mut acc = _mm256_setzero_ps();
        let mut mins = 0f32;
        for (w, a) in w.iter().zip(a) {
            mins += w.m * a.s;
            acc = _mm256_fmadd_ps(_mm256_set1_ps(w.d * a.d), sums(w, a), acc);
        }
        let half = _mm_add_ps(_mm256_extractf128_ps(acc, 1), _mm256_castps256_ps128(acc));
        let quarter = _mm_add_ps(half, _mm_movehl_ps(half, half));
        _mm_cvtss_f32(_mm_add_ss(quarter, _mm_movehdup_ps(quarter))) + mins
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
    use candle_core::{Device, Module, Tensor};
    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};

    fn random(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = SmallRng::seed_from_u64(seed);
        (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect()
    }

    /// A Q4_1 matrix through candle's own quantizer, and its bytes.
    fn quantized(rows: usize, cols: usize, seed: u64) -> (QTensor, Q4_1Matrix) {
        let w = Tensor::from_vec(random(rows * cols, seed), (rows, cols), &Device::Cpu).unwrap();
        let q = QTensor::quantize(&w, GgmlDType::Q4_1).unwrap();
        let m = Q4_1Matrix::from_ggml(&q.data().unwrap(), rows, cols).unwrap();
        (q, m)
    }

    #[test]
    fn the_product_is_candles_q4_1_product() {
        check_against_candle(40, 128, 5);
        // Many tasks, an odd number of blocks a row (18, as the model's 576 features).
        check_against_candle(1000, 576, 3);
    }

    fn check_against_candle(rows: usize, cols: usize, t: usize) {
        let (q, m) = quantized(rows, cols, 1);
        let x = random(t * cols, 2);
        let ours = m.matmul(&x, t);
        let xs = Tensor::from_vec(x, (t, cols), &Device::Cpu).unwrap();
        let theirs: Vec<f32> = QMatMul::from_qtensor(q)
            .unwrap()
            .forward(&xs)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        assert_eq!(ours.len(), rows * t);
        for (i, (a, b)) in ours.iter().zip(&theirs).enumerate() {
            // candle rounds Σq·d to f16 differently and its ties away from zero.
            assert!(
                (a - b).abs() <= 2e-3 * (1.0 + b.abs()),
                "output {i}: {a} vs {b}"
            );
        }
        // Through the tensor op, as the model calls it.
        let via_op: Vec<f32> = xs
            .apply_op1_no_bwd(&m)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        assert_eq!(via_op, ours);
    }

    #[test]
    fn a_tokens_result_does_not_depend_on_its_step() {
        let (rows, cols, t) = (300, 64, 7);
        let (_, m) = quantized(rows, cols, 3);
        let x = random(t * cols, 4);
        let all = m.matmul(&x, t);
        for tok in 0..t {
            let one = m.matmul(&x[tok * cols..(tok + 1) * cols], 1);
            assert_eq!(one, all[tok * rows..(tok + 1) * rows], "token {tok}");
        }
    }

    #[test]
    fn the_simd_loop_is_the_portable_loop() {
        let (_, m) = quantized(3, 256, 5);
        let mut acts = vec![ZERO_ACT; 8];
        quantize_q8_1(&random(256, 6), &mut acts);
        for r in 0..3 {
            let w = &m.blocks[r * 8..(r + 1) * 8];
            let (a, b) = (dot_fn()(w, &acts), dot_portable(w, &acts));
            assert!(
                (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
                "row {r}: {a} vs {b}"
            );
        }
    }

    #[test]
    fn activations_round_as_llama_cpp_rounds_them() {
        // amax 127 gives a scale of 1: halves round to even, and the sum is kept.
        let mut x = vec![0f32; BLOCK];
        x[0] = 127.0;
        x[1] = 2.5;
        x[2] = -3.5;
        x[3] = 0.4;
        let mut a = [ZERO_ACT];
        quantize_q8_1(&x, &mut a);
        assert_eq!(&a[0].qs[..4], &[127, 2, -4, 0]);
        assert_eq!(a[0].d, 1.0);
        assert_eq!(a[0].s, 125.0);
        // An all-zero block has a zero scale and zero values.
        quantize_q8_1(&[0.0; BLOCK], &mut a);
        assert_eq!(a[0], ZERO_ACT);
    }

    #[test]
    fn non_finite_activations_stay_in_their_own_token() {
        let (rows, cols) = (20, 64);
        let (_, m) = quantized(rows, cols, 7);
        let mut x = random(3 * cols, 8);
        x[1] = f32::NAN; // token 0: a NaN is skipped by the scale and quantized to 0
        x[cols + 1] = f32::INFINITY; // token 1: an infinite scale makes the token's outputs NaN
        let all = m.matmul(&x, 3);
        assert!(
            all[..rows].iter().all(|v| v.is_finite()),
            "{:?}",
            &all[..rows]
        );
        assert!(all[rows..2 * rows].iter().all(|v| v.is_nan()));
        assert_eq!(all[2 * rows..], m.matmul(&x[2 * cols..], 1)[..]);
        assert!(m.matmul(&[], 0).is_empty(), "no tokens, no outputs");
    }

    #[test]
    fn the_stored_bytes_are_decoded_and_checked() {
        // d = 0.5, m = -1, nibbles 0x21: w[0] = 0.5*1 - 1, w[16] = 0.5*2 - 1.
        let mut b = Vec::new();
        b.extend_from_slice(&f16::from_f32(0.5).to_le_bytes());
        b.extend_from_slice(&f16::from_f32(-1.0).to_le_bytes());
        b.extend_from_slice(&[0x21; 16]);
        let m = Q4_1Matrix::from_ggml(&b, 1, 32).unwrap();
        assert_eq!((m.blocks[0].d, m.blocks[0].m), (0.5, -1.0));
        let mut x = vec![0f32; 32];
        x[0] = 1.0;
        // x quantizes exactly (d = 1/127): the output is w[0] = -0.5 up to that scale's f16.
        let y = m.matmul(&x, 1);
        assert!((y[0] + 0.5).abs() < 1e-3, "{y:?}");
        assert!(Q4_1Matrix::from_ggml(&b, 1, 31).is_err());
        assert!(Q4_1Matrix::from_ggml(&b[..19], 1, 32).is_err());
        assert!(Q4_1Matrix::from_ggml(&b, 2, 32).is_err());
    }
}
