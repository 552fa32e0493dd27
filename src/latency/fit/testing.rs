//! Deterministic test data for the latency fit: seeded steps and samples drawn from known
//! coefficients, and a closeness check. For this crate's tests and, behind the `test-hooks`
//! feature, the simulator's (its `fit` of a step-log file).

use super::{Sample, StepFeatures};
use crate::latency::{LatencyModel, COEFFICIENT_KEYS};

/// A seeded SplitMix64: deterministic test data without `rand`, which the engine core does
/// not depend on.
pub struct TestRng(u64);

impl TestRng {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `lo..hi` (`lo < hi`; the modulo bias is irrelevant here).
    pub fn below(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next_u64() % (hi - lo)
    }

    /// Uniform in `[lo, hi)`.
    pub fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.unit()
    }

    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        self.unit() < p
    }
}

/// The latency model of the coefficients `c` (`base_ms`, `per_token_ms`, `per_kv_token_ms`,
/// `per_attention_pair_ms`; no `per_row_ms`).
pub fn model(c: [f64; 4]) -> LatencyModel {
    LatencyModel::from_coefficients(c).unwrap()
}

/// The A100 preset's coefficients: realistic magnitudes (A to 1e9 and more).
pub const TRUE: [f64; 4] = [5.7, 0.0624, 3.3e-4, 3.4e-6];

/// The shape of random steps: how many decode rows, how long their contexts, where chunks
/// start and how long they are.
#[derive(Clone, Copy)]
pub struct Workload {
    decode_rows: u64,
    context: u64,
    chunk_start: u64,
    chunk_len: u64,
}

/// Long contexts: decode rows reading up to 40k tokens, chunks up to 60k deep. Steps of
/// hundreds of ms, where `base_ms` is a few percent of a step.
pub const HEAVY: Workload = Workload {
    decode_rows: 64,
    context: 40_000,
    chunk_start: 60_000,
    chunk_len: 4096,
};

/// Short prompts and contexts: steps of ~10–30 ms, where `base_ms` carries real weight.
pub const LIGHT: Workload = Workload {
    decode_rows: 8,
    context: 2000,
    chunk_start: 2000,
    chunk_len: 256,
};

/// Between the two: every term carries a few ms to tens of ms of a step.
pub const MEDIUM: Workload = Workload {
    decode_rows: 16,
    context: 8000,
    chunk_start: 8000,
    chunk_len: 512,
};

/// A random step as the planner makes them: some decode rows, maybe a chunk somewhere in a
/// prompt.
pub fn random_step(rng: &mut TestRng) -> StepFeatures {
    random_step_of(rng, HEAVY)
}

/// A random step of the workload `w`.
pub fn random_step_of(rng: &mut TestRng, w: Workload) -> StepFeatures {
    let mut f = StepFeatures::EMPTY;
    for _ in 0..rng.below(0, w.decode_rows) {
        f.add_continuing(1, rng.below(100, w.context));
    }
    if rng.chance(0.7) {
        let start = rng.below(0, w.chunk_start) as u32;
        f.add_chunk(start, start + rng.below(1, w.chunk_len) as u32);
    }
    f
}

/// `n` random steps (seed `seed`) timed by the coefficients `c`, each time scaled by a factor
/// from `[1 - noise, 1 + noise]`.
pub fn samples(seed: u64, n: usize, c: [f64; 4], noise: f64) -> Vec<Sample> {
    samples_of(seed, n, c, noise, HEAVY)
}

/// [`samples`] of the workload `w`.
pub fn samples_of(seed: u64, n: usize, c: [f64; 4], noise: f64, w: Workload) -> Vec<Sample> {
    let mut rng = TestRng::new(seed);
    let m = model(c);
    (0..n)
        .map(|_| {
            let f = random_step_of(&mut rng, w);
            let factor = if noise > 0.0 {
                rng.uniform(1.0 - noise, 1.0 + noise)
            } else {
                1.0
            };
            Sample::new(&f, m.predict_ms(&f) * factor).unwrap()
        })
        .collect()
}

/// Asserts that each coefficient of `got` is within `rel` (relative) of `want`'s, naming it.
pub fn assert_close(got: [f64; 4], want: [f64; 4], rel: f64) {
    for (i, (g, w)) in got.into_iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= rel * w.abs(),
            "{}: got {g}, want {w} (±{rel})\n{got:?}",
            COEFFICIENT_KEYS[i]
        );
    }
}
