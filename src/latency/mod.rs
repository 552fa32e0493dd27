//! The latency model of cost-aware chunking (`docs/cost-model.md`): what one step of a node is
//! predicted to take, and the largest chunk end that keeps a step inside a time budget.
//!
//! ```text
//! predicted_ms = base_ms + per_token_ms·T + per_kv_token_ms·K + per_attention_pair_ms·A
//!              + per_row_ms·R
//! ```
//!
//! over the step's [`StepFeatures`]: `T` tokens run, `K` context tokens its continuing rows
//! read, `A` causal attention pairs of its prefill chunks, `R` rows (each continuing row and
//! each chunk). Every coefficient is finite and
//! `>= 0`, so the prediction never decreases when a row or a token is added: the planner can
//! take rows greedily and [`LatencyModel::max_chunk_end`] can search for an end by bisection
//! without ever missing a better one.
//!
//! Everything here is plain data and pure functions: the planner, the online fit
//! ([`fit`]), the time margin ([`margin`]) and the replay share them, so a prediction is computed the same
//! way (the same `f64` operations in the same order) wherever it is made.

use serde::{Deserialize, Serialize};

pub mod fit;
pub mod margin;
pub mod presets;

/// The configuration keys of the four original coefficients, in the order of
/// [`LatencyModel::coefficients`] (`chunking.cost.<node>` and the replay report use them).
pub const COEFFICIENT_KEYS: [&str; 4] = [
    "base_ms",
    "per_token_ms",
    "per_kv_token_ms",
    "per_attention_pair_ms",
];

/// How many terms the model has: the four of [`COEFFICIENT_KEYS`] and `per_row_ms`.
pub const TERMS: usize = 5;

/// The configuration keys of every coefficient, in the order of [`LatencyModel::terms`]:
/// [`COEFFICIENT_KEYS`], then `per_row_ms` (optional in a table: 0 when absent, so a
/// four-coefficient table reads as before).
pub const TERM_KEYS: [&str; TERMS] = [
    "base_ms",
    "per_token_ms",
    "per_kv_token_ms",
    "per_attention_pair_ms",
    "per_row_ms",
];

/// The most milliseconds a configured latency model's coefficient may be
/// (`chunking.cost`, and the `replay.cost` the replay simulates): with token counts and
/// attention pairs bounded by the inputs' limits, every prediction and sum of them stays
/// finite.
pub const MAX_COEFFICIENT_MS: f64 = 1e6;

/// A refused latency model or time budget. Each names the configuration key at fault.
#[derive(Debug, Clone, Copy, PartialEq, thiserror::Error)]
pub enum LatencyError {
    /// A coefficient is negative, NaN or infinite.
    #[error("`{key}` must be a finite number of milliseconds >= 0, got {value}")]
    BadCoefficient {
        /// The coefficient's key, one of [`COEFFICIENT_KEYS`].
        key: &'static str,
        /// The refused value.
        value: f64,
    },
    /// A time budget is zero, negative, NaN or infinite.
    #[error("`max_step_ms` must be a finite number of milliseconds > 0, got {value}")]
    BadMaxStepMs {
        /// The refused value.
        value: f64,
    },
}

/// Checks a time budget (`chunking.max_step_ms`): finite and `> 0`, since a budget of zero or
/// less could never be met and infinity would do nothing.
///
/// # Errors
/// [`LatencyError::BadMaxStepMs`] for any other value.
pub fn check_max_step_ms(value: f64) -> Result<f64, LatencyError> {
    if value.is_finite() && value > 0.0 {
        Ok(value)
    } else {
        Err(LatencyError::BadMaxStepMs { value })
    }
}

/// A step time the engine measured, in milliseconds, if it is one: finite and `>= 0`. The one
/// check of a measured time: the completion refuses the others (`BadMeasurement`), and the
/// online fit, the time margin and the time-overrun check read only times that passed it.
pub fn measured_ms(ms: f64) -> Option<f64> {
    (ms.is_finite() && ms >= 0.0).then_some(ms)
}

// === where a model comes from ===

/// Where the latency model in use came from. Bounded: used as a metric label and in the
/// replay report.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ModelSource {
    /// The online fit, trusted ([`crate::latency::fit::OnlineFit::trusted_model`]).
    Online,
    /// `chunking.cost.<node>` (or a preset named there).
    Config,
    /// No model: time budgets cannot apply.
    None,
}

impl ModelSource {
    /// Every source, in label order.
    pub const ALL: [ModelSource; 3] = [Self::Online, Self::Config, Self::None];

    /// The metric label and report value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Online => "online",
            Self::Config => "config",
            Self::None => "none",
        }
    }
}

/// Picks the model a node plans with, in order (`docs/fitting.md#sources`): the online fit
/// when it is trusted, else the configured model, else none.
pub fn select_model(
    trusted_online: Option<LatencyModel>,
    configured: Option<LatencyModel>,
) -> (Option<LatencyModel>, ModelSource) {
    match (trusted_online, configured) {
        (Some(m), _) => (Some(m), ModelSource::Online),
        (None, Some(m)) => (Some(m), ModelSource::Config),
        (None, None) => (None, ModelSource::None),
    }
}

// === impl StepFeatures ===

/// What a step's predicted time depends on, accumulated row by row as the planner takes rows.
///
/// Every field only grows (saturating, never wrapping), which keeps predictions monotone.
/// `attention_pairs` is a `u128`: one chunk of a `2^32`-token prompt has almost `2^63` pairs,
/// and a step holds many chunks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct StepFeatures {
    /// `T`: tokens the step runs (continuing rows' estimates + chunk tokens).
    pub tokens: u64,
    /// `K`: context tokens the step's continuing rows read (each row's whole context).
    pub kv_tokens: u64,
    /// `A`: causal attention pairs of the step's chunks: Σ over chunks `[s, e)` of
    /// `(e·(e+1) − s·(s+1)) / 2`.
    pub attention_pairs: u128,
    /// `R`: rows the step runs, each continuing row and each chunk (what a step pays per row
    /// whatever its tokens: its attention set up head by head, its logits and sampling).
    pub rows: u64,
}

impl StepFeatures {
    /// An empty step: the prediction is `base_ms`.
    pub const EMPTY: Self = Self {
        tokens: 0,
        kv_tokens: 0,
        attention_pairs: 0,
        rows: 0,
    };

    /// Counts a continuing row (decode, speculative verify) that runs `estimate` tokens over a
    /// context of `context` tokens (its prompt total plus the tokens it ran in completed steps).
    pub fn add_continuing(&mut self, estimate: u32, context: u64) {
        self.add_continuing_work(estimate, context);
        self.rows = self.rows.saturating_add(1);
    }

    /// [`Self::add_continuing`] without counting the row: for a caller that counts its rows
    /// itself (the planner sets `rows` once its continuing rows are in).
    pub(crate) fn add_continuing_work(&mut self, estimate: u32, context: u64) {
        self.tokens = self.tokens.saturating_add(u64::from(estimate));
        self.kv_tokens = self.kv_tokens.saturating_add(context);
    }

    /// Counts a chunk `[start, end)` of a prompt. An empty or reversed range counts nothing.
    pub fn add_chunk(&mut self, start: u32, end: u32) {
        if end <= start {
            return;
        }
        self.tokens = self.tokens.saturating_add(u64::from(end - start));
        self.attention_pairs = self
            .attention_pairs
            .saturating_add(chunk_attention_pairs(start, end));
        self.rows = self.rows.saturating_add(1);
    }

    /// These features with one more row that runs nothing yet: the least any chunk adds.
    #[must_use]
    pub fn with_row(mut self) -> Self {
        self.rows = self.rows.saturating_add(1);
        self
    }

    /// These features with a chunk `[start, end)` added.
    #[must_use]
    pub fn with_chunk(mut self, start: u32, end: u32) -> Self {
        self.add_chunk(start, end);
        self
    }

    /// The features as `f64`s `[T, K, A, R]`, as the prediction and the fits use them.
    pub fn to_f64(&self) -> [f64; 4] {
        // `as` rounds to the nearest `f64`; exact below 2^53, monotone everywhere. A `u128`
        // below 2^64 converts through `u64`: the same value, so the same nearest `f64`, without
        // the software conversion of a `u128`.
        let pairs = match u64::try_from(self.attention_pairs) {
            Ok(small) => small as f64,
            Err(_) => u128_to_f64(self.attention_pairs),
        };
        [
            self.tokens as f64,
            self.kv_tokens as f64,
            pairs,
            self.rows as f64,
        ]
    }
}

/// `x as f64`, out of line: kept apart so that the compiler does not fold the `u64` fast path of
/// [`StepFeatures::to_f64`] back into this software conversion.
#[inline(never)]
fn u128_to_f64(x: u128) -> f64 {
    x as f64
}

/// The causal attention pairs of a chunk `[start, end)`: each of its tokens attends to itself and
/// every token before it, `(end·(end+1) − start·(start+1)) / 2`. Zero when `end <= start`.
///
/// Exact: `(e−s)·(e+s+1)` is a product of one even and one odd factor (their sum `2e+1` is
/// odd), so halving it loses nothing. It fits a `u64` for any `u32` ends: it is at most
/// `e·(e+1) ≤ (2^32−1)·2^32 < 2^64`. A step's sum over its chunks can pass `2^64`, which is why
/// the features keep it as a `u128`.
pub fn chunk_attention_pairs(start: u32, end: u32) -> u128 {
    if end <= start {
        return 0;
    }
    let (s, e) = (u64::from(start), u64::from(end));
    u128::from((e - s) * (e + s + 1) / 2)
}

// === impl LatencyModel ===

/// A node's latency model: five coefficients, each finite and `>= 0` (checked by
/// [`LatencyModel::try_new`] and [`LatencyModel::from_terms`], the only ways to build one,
/// and by deserialisation).
///
/// Serialises as, and deserialises from, the table `chunking.cost.<node>` uses:
/// `{ base_ms, per_token_ms, per_kv_token_ms, per_attention_pair_ms, per_row_ms }` (the first
/// four required, `per_row_ms` 0 when absent and left out when 0, unknown keys refused).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "LatencyModelTable")]
pub struct LatencyModel {
    base_ms: f64,
    per_token_ms: f64,
    per_kv_token_ms: f64,
    per_attention_pair_ms: f64,
    #[serde(skip_serializing_if = "is_zero")]
    per_row_ms: f64,
}

fn is_zero(v: &f64) -> bool {
    *v == 0.0
}

/// The serialised form, checked on the way in.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LatencyModelTable {
    base_ms: f64,
    per_token_ms: f64,
    per_kv_token_ms: f64,
    per_attention_pair_ms: f64,
    #[serde(default)]
    per_row_ms: f64,
}

impl TryFrom<LatencyModelTable> for LatencyModel {
    type Error = LatencyError;

    fn try_from(t: LatencyModelTable) -> Result<Self, Self::Error> {
        Self::from_terms([
            t.base_ms,
            t.per_token_ms,
            t.per_kv_token_ms,
            t.per_attention_pair_ms,
            t.per_row_ms,
        ])
    }
}

impl LatencyModel {
    /// A model that predicts 0 ms for every step (every coefficient 0).
    pub const ZERO: Self = Self {
        base_ms: 0.0,
        per_token_ms: 0.0,
        per_kv_token_ms: 0.0,
        per_attention_pair_ms: 0.0,
        per_row_ms: 0.0,
    };

    /// Builds a model from its four original coefficients (milliseconds per step, per token,
    /// per context token, per attention pair); `per_row_ms` is 0.
    ///
    /// # Errors
    /// [`LatencyError::BadCoefficient`] naming the first coefficient that is negative, NaN or
    /// infinite.
    pub fn try_new(
        base_ms: f64,
        per_token_ms: f64,
        per_kv_token_ms: f64,
        per_attention_pair_ms: f64,
    ) -> Result<Self, LatencyError> {
        Self::from_coefficients([
            base_ms,
            per_token_ms,
            per_kv_token_ms,
            per_attention_pair_ms,
        ])
    }

    /// Builds a model from its four original coefficients in the order of
    /// [`COEFFICIENT_KEYS`]; `per_row_ms` is 0.
    ///
    /// # Errors
    /// As [`LatencyModel::try_new`].
    pub fn from_coefficients(c: [f64; 4]) -> Result<Self, LatencyError> {
        Self::from_terms([c[0], c[1], c[2], c[3], 0.0])
    }

    /// Builds a model from every coefficient, in the order of [`TERM_KEYS`].
    ///
    /// # Errors
    /// [`LatencyError::BadCoefficient`] naming the first coefficient that is negative, NaN or
    /// infinite.
    pub fn from_terms(c: [f64; TERMS]) -> Result<Self, LatencyError> {
        for (key, value) in TERM_KEYS.into_iter().zip(c) {
            if !(value.is_finite() && value >= 0.0) {
                return Err(LatencyError::BadCoefficient { key, value });
            }
        }
        // `+ 0.0` turns a -0.0 into 0.0, so equal models compare and print equal.
        Ok(Self {
            base_ms: c[0] + 0.0,
            per_token_ms: c[1] + 0.0,
            per_kv_token_ms: c[2] + 0.0,
            per_attention_pair_ms: c[3] + 0.0,
            per_row_ms: c[4] + 0.0,
        })
    }

    /// This model with `per_row_ms` set.
    ///
    /// # Errors
    /// [`LatencyError::BadCoefficient`] when `per_row_ms` is negative, NaN or infinite.
    pub fn with_per_row_ms(self, per_row_ms: f64) -> Result<Self, LatencyError> {
        let mut c = self.terms();
        c[4] = per_row_ms;
        Self::from_terms(c)
    }

    /// For the presets, derived from constants: the caller guarantees every value is finite
    /// and `>= 0` (a test checks every preset through [`LatencyModel::from_coefficients`]).
    pub(crate) fn new_unchecked(c: [f64; 4]) -> Self {
        debug_assert!(Self::from_coefficients(c).is_ok(), "{c:?}");
        Self {
            base_ms: c[0],
            per_token_ms: c[1],
            per_kv_token_ms: c[2],
            per_attention_pair_ms: c[3],
            per_row_ms: 0.0,
        }
    }

    /// The four original coefficients in the order of [`COEFFICIENT_KEYS`] (see
    /// [`LatencyModel::terms`] for all five).
    pub fn coefficients(&self) -> [f64; 4] {
        [
            self.base_ms,
            self.per_token_ms,
            self.per_kv_token_ms,
            self.per_attention_pair_ms,
        ]
    }

    /// Every coefficient, in the order of [`TERM_KEYS`].
    pub fn terms(&self) -> [f64; TERMS] {
        [
            self.base_ms,
            self.per_token_ms,
            self.per_kv_token_ms,
            self.per_attention_pair_ms,
            self.per_row_ms,
        ]
    }

    /// Milliseconds per row the step runs (each continuing row and each chunk).
    pub fn per_row_ms(&self) -> f64 {
        self.per_row_ms
    }

    /// Milliseconds every step costs, whatever it runs.
    pub fn base_ms(&self) -> f64 {
        self.base_ms
    }

    /// Milliseconds per token run (weights, norms, activations).
    pub fn per_token_ms(&self) -> f64 {
        self.per_token_ms
    }

    /// Milliseconds per context token a continuing row reads (its KV cache).
    pub fn per_kv_token_ms(&self) -> f64 {
        self.per_kv_token_ms
    }

    /// Milliseconds per causal attention pair of a prefill chunk.
    pub fn per_attention_pair_ms(&self) -> f64 {
        self.per_attention_pair_ms
    }

    /// The predicted milliseconds of a step with these features. Never NaN, never below
    /// `base_ms`, and never smaller for features that are larger in every field (each term is a
    /// non-negative product, and `f64` rounding is monotone); `+∞` only for absurd inputs.
    pub fn predict_ms(&self, f: &StepFeatures) -> f64 {
        let [t, k, a, r] = f.to_f64();
        // One fixed order of operations: every caller gets the same bits for the same features.
        // A product of 0 and a finite feature is 0, so a zero coefficient never makes NaN, and
        // a `per_row_ms` of 0 adds exactly 0: four-coefficient models predict as before.
        self.base_ms
            + self.per_token_ms * t
            + self.per_kv_token_ms * k
            + self.per_attention_pair_ms * a
            + self.per_row_ms * r
    }

    /// The largest end `e` for a chunk starting at `bounds.start` such that the step, with the
    /// features `step` already in it plus the chunk `[start, e)`, is predicted to take at most
    /// `max_step_ms`; `None` when no end fits (or `max_step_ms` is NaN).
    ///
    /// The candidates are the ends the token rules allow: `start < e <= upper` with `e` a
    /// multiple of `align`, or `e == total` (a final chunk ends at `total` whatever its
    /// alignment) when `upper == total`. The answer `e` satisfies
    /// `predict_ms(&step.with_chunk(start, e)) <= max_step_ms`, and no larger candidate does:
    /// in particular `e + align` is either past `upper` or over the limit.
    ///
    /// Cost: O(1) and no allocation. The prediction is quadratic in the end, so the real root
    /// gives the answer up to rounding; a galloping check around it (two predictions in the
    /// usual case, at most ~130 however far rounding moved it) makes the answer exact for the
    /// `f64` predictions the planner makes. Monotonicity of [`LatencyModel::predict_ms`] is
    /// what makes the check sound.
    pub fn max_chunk_end(
        &self,
        step: &StepFeatures,
        bounds: ChunkBounds,
        max_step_ms: f64,
    ) -> Option<u32> {
        let ChunkBounds {
            start,
            upper,
            total,
            align,
        } = bounds;
        let upper = upper.min(total);
        if upper <= start || max_step_ms.is_nan() {
            return None;
        }
        // Any chunk adds a row: the step with that row and no tokens is the least it can be.
        let before = self.predict_ms(&step.with_row());
        if before > max_step_ms {
            // Monotone: no chunk can make the step shorter.
            return None;
        }
        let fits = |end: u64| {
            // `end <= upper <= u32::MAX` for every end probed below.
            let end = end as u32;
            self.predict_ms(&step.with_chunk(start, end)) <= max_step_ms
        };
        // A final chunk is the largest candidate there is.
        if upper == total && fits(u64::from(total)) {
            return Some(total);
        }
        let align = u64::from(align.max(1));
        let s = u64::from(start);
        // Aligned candidates are `k·align` for `k` in `lo..=hi`.
        let lo = s / align + 1;
        let mut hi = u64::from(upper) / align;
        // Skips the final end just found over the limit. Only a saving: that candidate would
        // fail again, so the answer is the same without it (cargo-mutants' survivors here are
        // equivalent).
        if upper == total && hi * align == u64::from(total) {
            hi -= 1;
        }
        if lo > hi {
            return None;
        }
        // Where the search starts. Any `k` in `lo..=hi` gives the same answer
        // (`largest_fitting` is exact from every guess); a good one only saves predictions, so
        // a mutated guess changes the cost, not the answer.
        let guess = self.real_max_tokens(start, max_step_ms - before);
        let k = match guess {
            Some(d) if d < (hi * align - s) as f64 => ((s + d as u64) / align).clamp(lo, hi),
            _ => hi,
        };
        largest_fitting(lo, hi, k, |k| fits(k * align)).map(|k| (k * align) as u32)
    }

    /// The real `d >= 0` with `per_token_ms·d + per_attention_pair_ms·d·(d + 2s + 1)/2 = slack`:
    /// the most tokens a chunk starting at `s` may add to a step with `slack` ms to spare,
    /// before rounding. `None` when unbounded (both coefficients 0) or not a number.
    fn real_max_tokens(&self, start: u32, slack: f64) -> Option<f64> {
        // cost(d) = a·d² + b·d with a = pa/2, b = pt + pa·(s + ½).
        let a = self.per_attention_pair_ms / 2.0;
        let b = self.per_token_ms + self.per_attention_pair_ms * (f64::from(start) + 0.5);
        let d = if a == 0.0 {
            if b == 0.0 {
                return None;
            }
            slack / b
        } else {
            // The larger root of a·d² + b·d − slack, in the form without cancellation.
            2.0 * slack / (b + (b * b + 4.0 * a * slack).sqrt())
        };
        (d >= 0.0).then_some(d)
    }
}

/// Where a chunk may end, by the token rules, before the time limit is applied: the input of
/// [`LatencyModel::max_chunk_end`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkBounds {
    /// The chunk's start: the row's progress.
    pub start: u32,
    /// The largest end the token rules allow before alignment: `min(total, start + left,
    /// start + max_row_tokens)` with `left` what the step's budget and walk cap leave.
    pub upper: u32,
    /// The row's total tokens: an end of `total` is final and need not be aligned.
    pub total: u32,
    /// Non-final ends are multiples of `align` (0 is taken as 1).
    pub align: u32,
}

/// The largest `k` in `lo..=hi` with `fits(k)`, for a `fits` that holds up to some point and
/// fails from there on, starting from a guess `k0` in `lo..=hi`. `None` when `fits(lo)` fails.
///
/// Gallops from the guess with doubling steps until the answer is bracketed, then bisects: at
/// most ~2·64 calls, 2 when the guess is right.
fn largest_fitting(lo: u64, hi: u64, k0: u64, fits: impl Fn(u64) -> bool) -> Option<u64> {
    debug_assert!(lo <= k0 && k0 <= hi);
    // Invariant once bracketed: fits(good), !fits(bad), good < bad.
    let (mut good, mut bad);
    if fits(k0) {
        good = k0;
        let mut step = 1u64;
        loop {
            if good == hi {
                return Some(hi);
            }
            let probe = good.saturating_add(step).min(hi);
            if fits(probe) {
                good = probe;
                step = step.saturating_mul(2);
            } else {
                bad = probe;
                break;
            }
        }
    } else {
        bad = k0;
        let mut step = 1u64;
        loop {
            if bad == lo {
                return None;
            }
            let probe = bad.saturating_sub(step).max(lo);
            if fits(probe) {
                good = probe;
                break;
            }
            bad = probe;
            step = step.saturating_mul(2);
        }
    }
    while bad - good > 1 {
        let mid = good + (bad - good) / 2;
        if fits(mid) {
            good = mid;
        } else {
            bad = mid;
        }
    }
    Some(good)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn model(c: [f64; 4]) -> LatencyModel {
        LatencyModel::from_coefficients(c).unwrap()
    }

    /// The answer by definition: every candidate end, largest first.
    fn brute_force(
        m: &LatencyModel,
        step: &StepFeatures,
        b: ChunkBounds,
        max_step_ms: f64,
    ) -> Option<u32> {
        let upper = b.upper.min(b.total);
        let align = b.align.max(1);
        (b.start.saturating_add(1)..=upper).rev().find(|&e| {
            (e % align == 0 || e == b.total)
                && m.predict_ms(&step.with_chunk(b.start, e)) <= max_step_ms
        })
    }

    fn bounds(start: u32, upper: u32, total: u32, align: u32) -> ChunkBounds {
        ChunkBounds {
            start,
            upper,
            total,
            align,
        }
    }

    #[test]
    fn attention_pairs_count_each_token_against_itself_and_its_prefix() {
        assert_eq!(chunk_attention_pairs(0, 1), 1);
        assert_eq!(chunk_attention_pairs(0, 4), 1 + 2 + 3 + 4);
        assert_eq!(chunk_attention_pairs(4, 6), 5 + 6);
        assert_eq!(chunk_attention_pairs(6, 6), 0);
        assert_eq!(chunk_attention_pairs(7, 6), 0);
        // Two chunks cover the same pairs as the whole prompt.
        assert_eq!(
            chunk_attention_pairs(0, 1000) + chunk_attention_pairs(1000, 4321),
            chunk_attention_pairs(0, 4321)
        );
        // The largest prompt a range can hold: no overflow, exact.
        let n = u128::from(u32::MAX);
        assert_eq!(chunk_attention_pairs(0, u32::MAX), n * (n + 1) / 2);
        assert_eq!(
            chunk_attention_pairs(u32::MAX - 1, u32::MAX),
            u128::from(u32::MAX)
        );
    }

    #[test]
    fn a_steps_pairs_past_2_to_the_64_convert_to_the_nearest_f64() {
        // Five chunks of a 2^32-token prompt: each ~2^63 pairs, ~2.5 * 2^64 in all, through
        // the `u128` conversion; one chunk stays on the `u64` path.
        let one = chunk_attention_pairs(0, u32::MAX);
        let mut f = StepFeatures::EMPTY;
        for _ in 0..5 {
            f.add_chunk(0, u32::MAX);
        }
        assert_eq!(f.attention_pairs, 5 * one);
        assert!(f.attention_pairs > u128::from(u64::MAX));
        let pairs = f.to_f64()[2];
        assert_eq!(pairs, (5 * one) as f64);
        // Within half an ulp of the exact sum.
        assert!((pairs - 5.0 * one as f64).abs() <= pairs * f64::EPSILON);
        assert!(pairs > 4.6e19 && pairs < 4.62e19, "{pairs}");
        assert_eq!(
            u128_to_f64(u128::from(u64::MAX) + 1),
            18_446_744_073_709_551_616.0
        );
        let small = StepFeatures::EMPTY.with_chunk(0, u32::MAX);
        assert_eq!(small.to_f64()[2], one as f64);
    }

    #[test]
    fn only_finite_non_negative_times_are_measurements() {
        for ok in [0.0, 1e-9, 12.5, f64::MAX] {
            assert_eq!(measured_ms(ok), Some(ok));
        }
        for bad in [-0.001, -1.0, f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
            assert_eq!(measured_ms(bad), None, "{bad}");
        }
    }

    #[test]
    fn the_per_row_term_counts_every_row_and_prices_it() {
        assert_eq!(StepFeatures::EMPTY.with_row().rows, 1);
        let f = StepFeatures {
            tokens: 7,
            ..StepFeatures::EMPTY
        };
        assert_eq!(f.with_row(), StepFeatures { rows: 1, ..f });
        let m = LatencyModel::try_new(1.0, 2.0, 0.0, 0.0)
            .unwrap()
            .with_per_row_ms(3.0)
            .unwrap();
        assert_eq!(m.per_row_ms(), 3.0);
        assert_eq!(m.terms(), [1.0, 2.0, 0.0, 0.0, 3.0]);
        assert_eq!(m.coefficients(), [1.0, 2.0, 0.0, 0.0]);
        // Two rows of one token: 1 + 2·2 + 3·2.
        let mut two = StepFeatures::EMPTY;
        two.add_continuing(1, 0);
        two.add_chunk(0, 1);
        assert_eq!(m.predict_ms(&two), 11.0);
        // A -0 per-row cost is stored as 0, as the other coefficients are.
        let neg = LatencyModel::from_terms([1.0, 0.0, 0.0, 0.0, -0.0]).unwrap();
        assert!(neg.per_row_ms().is_sign_positive());
        let err = m.with_per_row_ms(-1.0).unwrap_err();
        assert_eq!(
            err,
            LatencyError::BadCoefficient {
                key: "per_row_ms",
                value: -1.0
            }
        );
        // The chunk solver prices a chunk's row: with 1 ms base and 3 ms a row, nothing fits
        // in 3.5 ms, and 2 tokens (1 + 3 + 2·0.25) fit in 4.5 ms.
        let m = LatencyModel::from_terms([1.0, 0.25, 0.0, 0.0, 3.0]).unwrap();
        let bounds = ChunkBounds {
            start: 0,
            upper: 100,
            total: 100,
            align: 1,
        };
        assert_eq!(m.max_chunk_end(&StepFeatures::EMPTY, bounds, 3.5), None);
        assert_eq!(m.max_chunk_end(&StepFeatures::EMPTY, bounds, 4.5), Some(2));
    }

    #[test]
    fn a_model_serialises_its_per_row_term_only_when_it_has_one() {
        let four = LatencyModel::try_new(1.0, 2.0, 3.0, 4.0).unwrap();
        let v = serde_json::to_value(four).unwrap();
        assert_eq!(v.get("per_row_ms"), None, "{v}");
        let five = four.with_per_row_ms(5.0).unwrap();
        let v5 = serde_json::to_value(five).unwrap();
        assert_eq!(v5["per_row_ms"], 5.0);
        assert_eq!(serde_json::from_value::<LatencyModel>(v5).unwrap(), five);
        assert_eq!(serde_json::from_value::<LatencyModel>(v).unwrap(), four);
    }

    #[test]
    fn features_accumulate_per_row() {
        let mut f = StepFeatures::EMPTY;
        f.add_continuing(1, 5000);
        f.add_continuing(4, 100);
        f.add_chunk(2048, 4096);
        f.add_chunk(10, 10);
        assert_eq!(
            f,
            StepFeatures {
                rows: 3,
                tokens: 1 + 4 + 2048,
                kv_tokens: 5100,
                attention_pairs: (4096 * 4097 - 2048 * 2049) / 2,
            }
        );
        // Saturates instead of wrapping.
        let mut big = StepFeatures {
            rows: 0,
            tokens: u64::MAX - 1,
            kv_tokens: u64::MAX,
            attention_pairs: u128::MAX - 1,
        };
        big.add_continuing(10, 10);
        big.add_chunk(0, u32::MAX);
        assert_eq!(big.tokens, u64::MAX);
        assert_eq!(big.kv_tokens, u64::MAX);
        assert_eq!(big.attention_pairs, u128::MAX);
    }

    #[test]
    fn try_new_names_the_bad_coefficient() {
        let ok = LatencyModel::try_new(5.0, 0.06, 0.0003, 3.4e-6).unwrap();
        assert_eq!(ok.coefficients(), [5.0, 0.06, 0.0003, 3.4e-6]);
        let cases = [
            ([-1.0, 0.0, 0.0, 0.0], "base_ms"),
            ([0.0, f64::NAN, 0.0, 0.0], "per_token_ms"),
            ([0.0, 0.0, f64::INFINITY, 0.0], "per_kv_token_ms"),
            ([0.0, 0.0, 0.0, -1e-12], "per_attention_pair_ms"),
            ([f64::NEG_INFINITY, -1.0, 0.0, 0.0], "base_ms"),
        ];
        for (c, key) in cases {
            let err = LatencyModel::from_coefficients(c).unwrap_err();
            let LatencyError::BadCoefficient { key: got, .. } = err else {
                panic!("{err:?}");
            };
            assert_eq!(got, key);
            assert!(
                err.to_string().starts_with(&format!("`{key}` must be")),
                "{err}"
            );
        }
        // -0.0 is 0.
        let z = LatencyModel::try_new(-0.0, 0.0, 0.0, 0.0).unwrap();
        assert!(z.base_ms().is_sign_positive());
        assert_eq!(z, LatencyModel::ZERO);
    }

    #[test]
    fn max_step_ms_must_be_finite_and_positive() {
        assert_eq!(check_max_step_ms(45.0), Ok(45.0));
        for bad in [0.0, -0.0, -3.0, f64::NAN, f64::INFINITY] {
            let err = check_max_step_ms(bad).unwrap_err();
            assert!(err.to_string().contains("`max_step_ms`"), "{err}");
        }
    }

    #[test]
    fn sources_in_order() {
        let a = model([1.0, 0.0, 0.0, 0.0]);
        let b = model([2.0, 0.0, 0.0, 0.0]);
        assert_eq!(
            select_model(Some(a), Some(b)),
            (Some(a), ModelSource::Online)
        );
        assert_eq!(select_model(None, Some(b)), (Some(b), ModelSource::Config));
        assert_eq!(select_model(Some(a), None), (Some(a), ModelSource::Online));
        assert_eq!(select_model(None, None), (None, ModelSource::None));
        let labels: Vec<_> = ModelSource::ALL.iter().map(|s| s.as_str()).collect();
        assert_eq!(labels, ["online", "config", "none"]);
    }

    #[test]
    fn predict_sums_the_four_terms() {
        let m = model([5.0, 0.5, 0.25, 0.125]);
        let f = StepFeatures {
            rows: 0,
            tokens: 10,
            kv_tokens: 8,
            attention_pairs: 16,
        };
        assert_eq!(m.predict_ms(&f), 5.0 + 5.0 + 2.0 + 2.0);
        assert_eq!(m.predict_ms(&StepFeatures::EMPTY), 5.0);
        // Zero coefficients over huge features stay 0, never NaN.
        let huge = StepFeatures {
            rows: 0,
            tokens: u64::MAX,
            kv_tokens: u64::MAX,
            attention_pairs: u128::MAX,
        };
        assert_eq!(model([1.0, 0.0, 0.0, 0.0]).predict_ms(&huge), 1.0);
    }

    #[test]
    fn max_chunk_end_examples() {
        // 1 ms per token, 10 ms base: a 50 ms budget leaves 40 tokens, aligned down to 16.
        let m = model([10.0, 1.0, 0.0, 0.0]);
        let e = StepFeatures::EMPTY;
        assert_eq!(
            m.max_chunk_end(&e, bounds(0, 1000, 1000, 16), 50.0),
            Some(32)
        );
        assert_eq!(
            m.max_chunk_end(&e, bounds(0, 1000, 1000, 1), 50.0),
            Some(40)
        );
        // Exactly on the limit fits.
        assert_eq!(m.max_chunk_end(&e, bounds(0, 40, 1000, 1), 50.0), Some(40));
        // The token rules bound it too.
        assert_eq!(m.max_chunk_end(&e, bounds(0, 20, 1000, 1), 50.0), Some(20));
        assert_eq!(m.max_chunk_end(&e, bounds(0, 20, 1000, 16), 50.0), Some(16));
        // A final chunk need not be aligned: the remaining 37 tokens fit.
        assert_eq!(m.max_chunk_end(&e, bounds(0, 37, 37, 16), 50.0), Some(37));
        // ...but when it does not fit, aligned ends are tried.
        assert_eq!(m.max_chunk_end(&e, bounds(0, 45, 45, 16), 50.0), Some(32));
        // A budget below base_ms: nothing fits.
        assert_eq!(m.max_chunk_end(&e, bounds(0, 1000, 1000, 1), 9.0), None);
        // No aligned end between start and upper.
        assert_eq!(m.max_chunk_end(&e, bounds(17, 31, 1000, 16), 500.0), None);
        assert_eq!(
            m.max_chunk_end(&e, bounds(17, 32, 1000, 16), 500.0),
            Some(32)
        );
        // Empty bounds and NaN budgets.
        assert_eq!(m.max_chunk_end(&e, bounds(5, 5, 10, 1), 500.0), None);
        assert_eq!(m.max_chunk_end(&e, bounds(5, 10, 10, 1), f64::NAN), None);
        // Infinite budget: the whole rest.
        assert_eq!(
            m.max_chunk_end(&e, bounds(5, 100, 100, 8), f64::INFINITY),
            Some(100)
        );
        // Rows already in the step count: 30 ms taken leaves 10 tokens.
        let mut f = StepFeatures::EMPTY;
        f.add_continuing(30, 0);
        assert_eq!(
            m.max_chunk_end(&f, bounds(0, 1000, 1000, 1), 50.0),
            Some(10)
        );
        f.add_continuing(11, 0);
        assert_eq!(m.max_chunk_end(&f, bounds(0, 1000, 1000, 1), 50.0), None);
    }

    #[test]
    fn max_chunk_end_shrinks_deep_into_a_long_prompt() {
        // Attention only: a chunk at a deep prefix gets far fewer tokens than one at the start.
        let m = model([0.0, 0.0, 0.0, 1e-6]);
        let e = StepFeatures::EMPTY;
        let shallow = m
            .max_chunk_end(&e, bounds(0, u32::MAX, u32::MAX, 1), 10.0)
            .unwrap();
        // d·(d+1)/2 <= 1e7 → d = 4471.
        assert_eq!(shallow, 4471);
        // d·(d + 2^21 + 1)/2 <= 1e7 → d = 9.
        let deep = m.max_chunk_end(&e, bounds(1 << 20, u32::MAX, u32::MAX, 1), 10.0);
        assert_eq!(deep, Some((1 << 20) + 9));
        // d·(d + 2^25 + 1)/2 <= 1e7 → not even one token.
        let deeper = m.max_chunk_end(&e, bounds(1 << 24, u32::MAX, u32::MAX, 1), 10.0);
        assert_eq!(deeper, None);
    }

    #[test]
    fn huge_prefixes_do_not_overflow() {
        // 2^24-token prompts, chunks near the end.
        let m = model([4.7, 0.0174, 0.000196, 1.5e-6]);
        let mut f = StepFeatures::EMPTY;
        f.add_continuing(1, (1 << 24) + 5000);
        f.add_chunk(0, 1 << 23);
        // Aligned, so the largest candidate past the aligned ends is never an unaligned final.
        let total = 1u32 << 24;
        for max_ms in [1e3, 1e5, 1e7, 1e8] {
            for start in [0, (1 << 24) - 100_000, total - 1] {
                let b = bounds(start, total, total, 16);
                let got = m.max_chunk_end(&f, b, max_ms);
                // Brute force would scan 16M ends; check the definition at the answer instead.
                if let Some(e) = got {
                    assert!(m.predict_ms(&f.with_chunk(start, e)) <= max_ms);
                    if e != total {
                        assert_eq!(e % 16, 0);
                        let next = e + 16;
                        assert!(next > total || m.predict_ms(&f.with_chunk(start, next)) > max_ms);
                    }
                } else {
                    let first = (start / 16 + 1) * 16;
                    let first = first.min(total);
                    assert!(m.predict_ms(&f.with_chunk(start, first)) > max_ms);
                }
            }
        }
    }

    #[test]
    fn accessors_read_each_coefficient_and_every_minus_zero_is_zero() {
        let m = model([5.0, 0.25, 0.125, 0.0625]);
        assert_eq!(
            [
                m.base_ms(),
                m.per_token_ms(),
                m.per_kv_token_ms(),
                m.per_attention_pair_ms()
            ],
            [5.0, 0.25, 0.125, 0.0625]
        );
        let z = model([-0.0, -0.0, -0.0, -0.0]);
        assert!(
            z.coefficients().iter().all(|c| c.is_sign_positive()),
            "{:?}",
            z.coefficients()
        );
    }

    #[test]
    fn a_reversed_chunk_counts_nothing() {
        let mut f = StepFeatures::EMPTY;
        f.add_chunk(7, 6);
        assert_eq!(f, StepFeatures::EMPTY);
        assert_eq!(StepFeatures::EMPTY.with_chunk(3, 5).tokens, 2);
    }

    #[test]
    fn max_chunk_end_edges() {
        let m = model([10.0, 1.0, 0.0, 0.0]);
        let e = StepFeatures::EMPTY;
        // No room before the end: no chunk, even a "final" empty one.
        assert_eq!(m.max_chunk_end(&e, bounds(5, 5, 5, 1), 500.0), None);
        assert_eq!(m.max_chunk_end(&e, bounds(5, 4, 5, 1), 500.0), None);
        // The end is not past `upper` even when the whole row would fit.
        assert_eq!(
            m.max_chunk_end(&e, bounds(0, 20, 1000, 1), 5000.0),
            Some(20)
        );
        assert_eq!(
            m.max_chunk_end(&e, bounds(0, 20, 1000, 8), 5000.0),
            Some(16)
        );
        // `upper` past `total` is cut to `total`.
        assert_eq!(m.max_chunk_end(&e, bounds(0, 50, 37, 16), 5000.0), Some(37));
        // A step already at its budget still takes a chunk that costs nothing.
        let free = model([10.0, 0.0, 0.0, 0.0]);
        assert_eq!(
            free.max_chunk_end(&e, bounds(0, 100, 100, 1), 10.0),
            Some(100)
        );
        assert_eq!(
            free.max_chunk_end(&e, bounds(0, 100, 1000, 16), 10.0),
            Some(96)
        );
        assert_eq!(free.max_chunk_end(&e, bounds(0, 100, 100, 1), 9.5), None);
        // Aligned ends from a start past 0: the first candidate is the next multiple.
        assert_eq!(
            m.max_chunk_end(&e, bounds(16, 1000, 1000, 16), 10.0 + 16.0),
            Some(32)
        );
        assert_eq!(
            m.max_chunk_end(&e, bounds(16, 1000, 1000, 16), 10.0 + 15.0),
            None
        );
        assert_eq!(
            m.max_chunk_end(&e, bounds(20, 1000, 1000, 16), 10.0 + 12.0),
            Some(32)
        );
        assert_eq!(
            m.max_chunk_end(&e, bounds(20, 1000, 1000, 16), 10.0 + 27.0),
            Some(32)
        );
        assert_eq!(
            m.max_chunk_end(&e, bounds(20, 1000, 1000, 16), 10.0 + 28.0),
            Some(48)
        );
        // Align 0 is align 1.
        assert_eq!(
            m.max_chunk_end(&e, bounds(3, 1000, 1000, 0), 10.0 + 7.0),
            Some(10)
        );
        // A final end that is also aligned and does not fit: the aligned end below it.
        assert_eq!(
            m.max_chunk_end(&e, bounds(0, 48, 48, 16), 10.0 + 47.0),
            Some(32)
        );
        assert_eq!(
            m.max_chunk_end(&e, bounds(0, 32, 32, 16), 10.0 + 31.0),
            Some(16)
        );
        assert_eq!(
            m.max_chunk_end(&e, bounds(0, 16, 16, 16), 10.0 + 15.0),
            None
        );
        // A final end one past an aligned one: the aligned end is still a candidate.
        assert_eq!(
            m.max_chunk_end(&e, bounds(0, 17, 17, 16), 10.0 + 16.0),
            Some(16)
        );
        assert_eq!(
            m.max_chunk_end(&e, bounds(0, 45, 45, 16), 10.0 + 44.0),
            Some(32)
        );
        // Attention terms: the quadratic root, checked around the answer.
        let q = model([0.0, 0.5, 0.0, 0.25]);
        for (start, budget) in [(0, 100.0), (100, 1000.0), (7, 3.0), (1000, 0.6)] {
            let b = bounds(start, start + 5000, start + 6000, 1);
            assert_eq!(
                q.max_chunk_end(&e, b, budget),
                brute_force(&q, &e, b, budget),
                "{start} {budget}"
            );
        }
    }

    #[test]
    fn real_max_tokens_is_the_root_of_the_cost() {
        // Linear: slack / per_token.
        let lin = model([3.0, 0.5, 7.0, 0.0]);
        assert_eq!(lin.real_max_tokens(100, 10.0), Some(20.0));
        // Quadratic: 0.5·d + 0.25·d·(d + 2·4 + 1)/2 = 8.5 at d = 4.
        let q = model([3.0, 0.5, 7.0, 0.25]);
        let d = q.real_max_tokens(4, 8.5).unwrap();
        assert!((d - 4.0).abs() < 1e-12, "{d}");
        // No per-token cost at all: unbounded.
        assert_eq!(model([3.0, 0.0, 7.0, 0.0]).real_max_tokens(0, 10.0), None);
        // Attention only: 2·d·(d + 1)/2 = 12 at d = 3.
        let a = model([0.0, 0.0, 0.0, 2.0]);
        let d = a.real_max_tokens(0, 12.0).unwrap();
        assert!((d - 3.0).abs() < 1e-12, "{d}");
        // A negative or NaN slack has no root.
        assert_eq!(lin.real_max_tokens(0, -1.0), None);
        assert_eq!(lin.real_max_tokens(0, f64::NAN), None);
        assert_eq!(lin.real_max_tokens(0, 0.0), Some(0.0));
    }

    #[test]
    fn largest_fitting_finds_the_last_fitting_k_from_any_guess() {
        use std::cell::Cell;
        for lo in 0u64..5 {
            for hi in lo..12 {
                for k0 in lo..=hi {
                    // `fits` holds for k <= t.
                    for t in lo.saturating_sub(1)..=hi + 1 {
                        let calls = Cell::new(0u32);
                        let fits = |k: u64| {
                            assert!((lo..=hi).contains(&k), "probed {k} outside {lo}..={hi}");
                            calls.set(calls.get() + 1);
                            k <= t
                        };
                        let want = (t >= lo).then(|| t.min(hi));
                        assert_eq!(
                            largest_fitting(lo, hi, k0, fits),
                            want,
                            "{lo} {hi} {k0} {t}"
                        );
                        assert!(calls.get() <= 2 * 64, "{} calls", calls.get());
                        if want == Some(k0) {
                            // The guess right: it and the one above it (if any).
                            assert_eq!(
                                calls.get(),
                                if k0 == hi { 1 } else { 2 },
                                "{lo} {hi} {k0} {t}"
                            );
                        }
                    }
                }
            }
        }
    }

    fn features() -> impl Strategy<Value = StepFeatures> {
        (0u64..5000, 0u64..200_000, 0u128..50_000_000, 0u64..300).prop_map(|(t, k, a, r)| {
            StepFeatures {
                tokens: t,
                kv_tokens: k,
                attention_pairs: a,
                rows: r,
            }
        })
    }

    /// Coefficients with every term sometimes 0 and otherwise spread over magnitudes.
    fn coefficient(scale: f64) -> impl Strategy<Value = f64> {
        prop_oneof![
            Just(0.0),
            (0.0f64..1.0).prop_map(move |x| x * scale),
            (0.0f64..1.0)
        ]
    }

    fn models() -> impl Strategy<Value = LatencyModel> {
        (
            coefficient(10.0),
            coefficient(0.1),
            coefficient(1e-3),
            coefficient(1e-5),
        )
            .prop_map(|(b, t, k, a)| model([b, t, k, a]))
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        #[test]
        fn max_chunk_end_matches_brute_force(
            m in models(),
            f in features(),
            start in prop_oneof![0u32..5000, 1_000_000u32..1_005_000],
            len in 1u32..3000,
            extra in 0u32..3000,
            align in prop_oneof![Just(0u32), Just(1u32), 1u32..64, Just(256u32)],
            budget in prop_oneof![0.0f64..200.0, 0.0f64..5.0, Just(0.0)],
            upper_is_total in any::<bool>(),
        ) {
            let upper = start + len;
            let total = if upper_is_total { upper } else { upper + extra + 1 };
            let b = bounds(start, upper, total, align);
            let got = m.max_chunk_end(&f, b, budget);
            prop_assert_eq!(got, brute_force(&m, &f, b, budget));
        }

        /// A large base and tiny per-token terms: many ends round to the same prediction, so
        /// the real root can be far off the `f64` answer and the check must walk to it.
        #[test]
        fn max_chunk_end_survives_rounding_plateaus(
            base in 1e5f64..1e7,
            pt in 0.0f64..1e-12,
            pa in 0.0f64..1e-16,
            slack in 0.0f64..1e-8,
            start in 0u32..1000,
            len in 1u32..5000,
            align in 1u32..8,
        ) {
            let m = model([base, pt, 0.0, pa]);
            let f = StepFeatures::EMPTY;
            let b = bounds(start, start + len, start + len + 1, align);
            let budget = base + slack;
            prop_assert_eq!(m.max_chunk_end(&f, b, budget), brute_force(&m, &f, b, budget));
        }

        /// Budgets set exactly to a candidate's predicted time: the rounding edge.
        #[test]
        fn max_chunk_end_is_exact_on_the_limit(
            m in models(),
            f in features(),
            start in 0u32..100_000,
            len in 1u32..2000,
            pick in 0u32..2000,
            align in 1u32..32,
        ) {
            let upper = start + len;
            let total = upper + 7;
            let e = start + 1 + pick % len;
            let budget = m.predict_ms(&f.with_chunk(start, e));
            let b = bounds(start, upper, total, align);
            prop_assert_eq!(m.max_chunk_end(&f, b, budget), brute_force(&m, &f, b, budget));
        }
    }
}
