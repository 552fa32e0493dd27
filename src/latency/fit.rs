//! Fitting the latency model to measured step times (`docs/fitting.md`).
//!
//! - [`OnlineFit`]: what the component learns from the step times the engine reports
//!   (`complete(step, ran, measured_ms)`). Recursive least squares with a forgetting factor, so
//!   recent steps weigh more and memory stays constant; the coefficients are solved on demand,
//!   non-negative, and the fit says when it can be trusted.
//! - [`fit_samples`]: the offline fit, all steps weighted alike, with R² and error quantiles.
//!   Reading step logs and CSVs for `mstar-chunking fit FILE` is the simulator's
//!   (`mstar-chunking-sim`, `cli::fit_file`).
//!
//! Both solve the same problem exactly: the least-squares coefficients under the constraint
//! that every coefficient is `>= 0` (see `Normal::solve`). Plain `std` and `serde`: this is
//! part of the engine core.

use serde::Serialize;

use crate::latency::{LatencyModel, StepFeatures, TERMS};

/// A refused measurement, fit setting or fit input.
#[derive(Debug, Clone, Copy, PartialEq, thiserror::Error)]
pub enum FitError {
    /// A measured step time is negative, NaN or infinite.
    #[error("a measured step time must be a finite number of milliseconds >= 0, got {value}")]
    BadMeasurement {
        /// The refused value.
        value: f64,
    },
    /// A fit setting is out of its range.
    #[error("`{key}` must be {expected}, got {value}")]
    BadSetting {
        /// The setting's key.
        key: &'static str,
        /// The range it must be in.
        expected: &'static str,
        /// The refused value.
        value: f64,
    },
    /// A step feature is negative, NaN or infinite.
    #[error("step feature `{key}` must be a finite number >= 0, got {value}")]
    BadFeature {
        /// The feature: `tokens`, `kv_tokens` or `attention_pairs`.
        key: &'static str,
        /// The refused value.
        value: f64,
    },
    /// There is nothing to fit.
    #[error("no steps to fit")]
    NoSamples,
    /// The fit's sums overflow an `f64` once this sample is added (its values, or their
    /// squares and products, are too large to fit together).
    #[error(
        "the step's values are too large to fit: the fit's sums of squares overflow at this step"
    )]
    SumsOverflow {
        /// The sample's index (from 0) in the input.
        index: usize,
    },
    /// The fit came out with a coefficient or an error that is not a finite number.
    #[error("the fit is not finite ({what}); the steps cannot be fitted")]
    NotFinite {
        /// What is not finite.
        what: &'static str,
    },
    /// Every coefficient fitted to 0: a model that predicts every step at 0 ms (every step
    /// took 0 ms), never usable as a `[chunking.cost.<node>]` table.
    #[error("every coefficient fitted to 0 (the steps' times are all 0 ms): such a model predicts every step at 0 ms, so there is no table to use")]
    AllZero,
}

fn check_measurement(ms: f64) -> Result<f64, FitError> {
    super::measured_ms(ms).ok_or(FitError::BadMeasurement { value: ms })
}

// === impl Sample ===

/// How many regressors the fit has: one per coefficient ([`TERM_KEYS`]).
const N: usize = TERMS;

/// One completed step: its features and its measured milliseconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample {
    /// `T`: tokens the step ran.
    pub tokens: f64,
    /// `K`: context tokens its continuing rows read.
    pub kv_tokens: f64,
    /// `A`: causal attention pairs of its chunks.
    pub attention_pairs: f64,
    /// `R`: rows it ran (continuing rows and chunks).
    pub rows: f64,
    /// The measured step time, milliseconds.
    pub ms: f64,
}

impl Sample {
    /// A step with these features that took `ms`.
    ///
    /// # Errors
    /// [`FitError::BadMeasurement`] when `ms` is negative, NaN or infinite.
    pub fn new(features: &StepFeatures, ms: f64) -> Result<Self, FitError> {
        let [tokens, kv_tokens, attention_pairs, rows] = features.to_f64();
        Ok(Self {
            tokens,
            kv_tokens,
            attention_pairs,
            rows,
            ms: check_measurement(ms)?,
        })
    }

    /// The regressors, once the measurement and every feature are checked finite and `>= 0`.
    fn checked(&self) -> Result<[f64; N], FitError> {
        check_measurement(self.ms)?;
        for (key, value) in ["tokens", "kv_tokens", "attention_pairs", "rows"]
            .into_iter()
            .zip([self.tokens, self.kv_tokens, self.attention_pairs, self.rows])
        {
            if !(value.is_finite() && value >= 0.0) {
                return Err(FitError::BadFeature { key, value });
            }
        }
        Ok(self.x())
    }

    /// The regressors `[1, T, K, A, R]`, in the order of the coefficients.
    fn x(&self) -> [f64; N] {
        [
            1.0,
            self.tokens,
            self.kv_tokens,
            self.attention_pairs,
            self.rows,
        ]
    }
}

/// The model's prediction for `x = [1, T, K, A, R]`, in the same order of operations as
/// [`LatencyModel::predict_ms`].
fn predict(c: &[f64; N], x: &[f64; N]) -> f64 {
    c[0] * x[0] + c[1] * x[1] + c[2] * x[2] + c[3] * x[3] + c[4] * x[4]
}

// === impl Normal ===

/// The weighted normal equations of the fit: `G = Σ w·x·xᵀ`, `h = Σ w·x·y`, and the sums the
/// error needs. Constant size, whatever the number of samples.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Normal {
    g: [[f64; N]; N],
    h: [f64; N],
    /// `Σ w·y²`.
    yy: f64,
    /// `Σ w·y`.
    sy: f64,
    /// `Σ w`.
    sw: f64,
    /// The samples, each counted 1 and decayed like the weights: what the per-row term's
    /// test of significance counts as degrees of freedom.
    count: f64,
}

/// A pivot below this (on the unit-diagonal scaled matrix: `1 − R²` of a column regressed on
/// the others of its subset) marks the subset's columns as collinear; a smaller subset then
/// reaches the same fit.
const MIN_PIVOT: f64 = 1e-11;

/// Where columns are collinear, subsets whose objectives differ by less than this times
/// `Σ w·y²` fit the steps equally well (the difference is rounding): see `Normal::solve`.
const TIE: f64 = 1e-10;

/// The index of the rows column (`R`) among the regressors.
const ROWS: usize = 4;

/// How many times the residual variance the per-row term must take off the residual sum of
/// squares to be kept: an F statistic of one added term, above its 0.2% point for the sample
/// counts a fit sees.
const ROWS_F: f64 = 10.0;

impl Normal {
    /// Multiplies every past weight by `lambda`.
    fn decay(&mut self, lambda: f64) {
        for row in &mut self.g {
            for v in row {
                *v *= lambda;
            }
        }
        for v in &mut self.h {
            *v *= lambda;
        }
        self.yy *= lambda;
        self.sy *= lambda;
        self.sw *= lambda;
        self.count *= lambda;
    }

    /// Whether every sum is finite.
    fn is_finite(&self) -> bool {
        self.g
            .iter()
            .flatten()
            .chain(&self.h)
            .all(|v| v.is_finite())
            && self.yy.is_finite()
            && self.sy.is_finite()
            && self.sw.is_finite()
    }

    fn add(&mut self, x: &[f64; N], y: f64) {
        self.add_weighted(x, y, 1.0);
    }

    fn add_weighted(&mut self, x: &[f64; N], y: f64, w: f64) {
        for i in 0..N {
            for j in 0..N {
                self.g[i][j] += w * x[i] * x[j];
            }
            self.h[i] += w * x[i] * y;
        }
        self.yy += w * y * y;
        self.sy += w * y;
        self.sw += w;
        self.count += 1.0;
    }

    /// The columns the fit may use: those not 0 in every sample, less the rows column when it
    /// is the same in every sample (every step ran as many rows): it is then the constant
    /// column over again, which `base_ms` already carries, and `per_row_ms` is fitted as 0.
    fn usable(&self) -> [bool; N] {
        let mut usable = [false; N];
        for (j, u) in usable.iter_mut().enumerate() {
            *u = self.g[j][j].is_finite() && self.g[j][j] > 0.0;
        }
        // `Σw·R² · Σw − (Σw·R)²` is `(Σw)²` times the variance of `R`.
        let (r2, r1, w) = (self.g[ROWS][ROWS], self.g[0][ROWS], self.g[0][0]);
        if usable[ROWS] && r2 * w - r1 * r1 <= 1e-9 * r2 * w {
            usable[ROWS] = false;
        }
        usable
    }

    /// `(rank, observed)` of the design the sums hold: `observed` counts the terms the fit may
    /// use ([`Normal::usable`]), `rank` how many of those are linearly independent (pivots of
    /// the unit-diagonal scaled matrix above [`MIN_PIVOT`]). `rank < observed` means several
    /// models fit the samples equally well.
    fn rank(&self) -> (usize, usize) {
        let usable = self.usable();
        let observed: Vec<usize> = (0..N).filter(|&j| usable[j]).collect();
        let n = observed.len();
        let mut m = [[0.0f64; N]; N];
        for (a, &i) in observed.iter().enumerate() {
            for (b, &j) in observed.iter().enumerate() {
                m[a][b] = self.g[i][j] / (self.g[i][i].sqrt() * self.g[j][j].sqrt());
            }
        }
        // Gaussian elimination with full pivoting on the diagonal (the matrix is symmetric
        // positive semi-definite, so its largest entries sit on the diagonal).
        let mut rank = 0;
        let mut used = [false; N];
        for _ in 0..n {
            let Some(p) = (0..n)
                .filter(|&k| !used[k])
                .max_by(|&a, &b| m[a][a].total_cmp(&m[b][b]))
            else {
                break;
            };
            let pivot = m[p][p];
            if pivot.is_nan() || pivot <= MIN_PIVOT {
                break;
            }
            used[p] = true;
            rank += 1;
            let pivot_row = m[p];
            for r in (0..n).filter(|&r| !used[r]) {
                let f = m[r][p] / pivot;
                for (v, pv) in m[r].iter_mut().zip(pivot_row).take(n) {
                    *v -= f * pv;
                }
            }
        }
        (rank, n)
    }

    /// The non-negative least-squares coefficients: `argmin Σ w·(xᵀc − y)²` over `c >= 0`,
    /// with `per_row_ms` only where the steps call for it.
    ///
    /// Exact, by enumeration: an optimum has a support whose columns are independent, and on
    /// its support it solves the normal equations restricted to it. So the best feasible
    /// restricted solution over the subsets of the columns is the optimum. Columns are
    /// scaled to unit diagonal first: `A` runs to 1e9 and more where the intercept is 1, and
    /// unscaled pivots would be meaningless.
    ///
    /// The rows column is nearly the constant and the token columns over again in most steps,
    /// so a free per-row term trades its noise against `base_ms`. It is kept only when it
    /// explains the steps: the optimum with it must lower the residual sum of squares by
    /// more than [`ROWS_F`] times the residual variance (an F test of one added term);
    /// otherwise the four-term optimum stands, exactly as without the term.
    fn solve(&self) -> [f64; N] {
        let usable = self.usable();
        let mut scale = [0.0; N];
        for (j, s) in scale.iter_mut().enumerate() {
            let d = self.g[j][j].sqrt();
            // A column that is zero in every sample (no decode rows, say) gets coefficient 0.
            *s = if usable[j] && d.is_finite() && d > 0.0 {
                d
            } else {
                0.0
            };
        }
        let mut gs = [[0.0; N]; N];
        let mut hs = [0.0; N];
        for i in 0..N {
            if scale[i] == 0.0 {
                continue;
            }
            for j in 0..N {
                if scale[j] != 0.0 {
                    gs[i][j] = self.g[i][j] / (scale[i] * scale[j]);
                }
            }
            hs[i] = self.h[i] / scale[i];
        }
        let best_of = |with_rows: bool| {
            // Each feasible subset's solution and objective (less the constant Σ w·y²), in the
            // order of the masks: lower terms (`base_ms`, then `per_token_ms`) first.
            let mut found = [([0.0; N], 0.0); 1 << N];
            let mut n_found = 0;
            let mut collinear = false;
            for mask in 1u8..(1 << N) {
                if (0..N).any(|j| mask & (1 << j) != 0 && scale[j] == 0.0)
                    || (!with_rows && mask & (1 << ROWS) != 0)
                {
                    continue;
                }
                let Some(c) = solve_subset(&gs, &hs, mask) else {
                    collinear = true;
                    continue;
                };
                if c.iter().any(|&v| !(v >= 0.0 && v.is_finite())) {
                    continue;
                }
                found[n_found] = (c, quadratic(&gs, &c) - 2.0 * dot(&hs, &c));
                n_found += 1;
            }
            let found = &found[..n_found];
            // The objective of c = 0 is 0: a solution must do better.
            let least = found.iter().map(|f| f.1).fold(0.0, f64::min);
            // With collinear columns several subsets reach the same optimum, and which one
            // comes out lowest is down to rounding (so to the number of steps, say). Then the
            // first within [`TIE`] of the optimum is taken: the answer no longer depends on
            // rounding, and prefers the lower terms. Without, the least is taken exactly.
            let tie = if collinear { TIE * self.yy } else { 0.0 };
            found
                .iter()
                .find(|f| f.1 < 0.0 && f.1 <= least + tie)
                .map_or(([0.0; N], 0.0), |&(c, obj)| (c, obj))
        };
        let (without, obj_without) = best_of(false);
        let best = if scale[ROWS] == 0.0 {
            without
        } else {
            let (with, obj_with) = best_of(true);
            let support = with.iter().filter(|&&v| v != 0.0).count() as f64;
            let residual = (self.yy + obj_with).max(0.0);
            let variance = residual / (self.count - support).max(1.0);
            let gain = obj_without - obj_with;
            if with[ROWS] > 0.0 && gain > ROWS_F * variance {
                with
            } else {
                without
            }
        };
        let mut out = [0.0; N];
        for j in 0..N {
            if scale[j] != 0.0 {
                out[j] = best[j] / scale[j];
            }
        }
        out
    }

    /// `Σ w·(xᵀc − y)²` from the sums, never negative.
    fn residual_ss(&self, c: &[f64; N]) -> f64 {
        (self.yy - 2.0 * dot(&self.h, c) + quadratic(&self.g, c)).max(0.0)
    }

    /// The root mean square error over the mean measurement.
    fn relative_rms(&self, c: &[f64; N]) -> f64 {
        relative_rms(self.residual_ss(c), self.sy, self.sw)
    }
}

fn relative_rms(residual_ss: f64, sum_y: f64, sum_w: f64) -> f64 {
    if residual_ss == 0.0 {
        return 0.0;
    }
    if sum_w <= 0.0 || sum_y <= 0.0 {
        return f64::INFINITY;
    }
    (residual_ss / sum_w).sqrt() / (sum_y / sum_w)
}

fn dot(a: &[f64; N], b: &[f64; N]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// `Σ_{p < n} a[p]·b[p]`.
fn dot_prefix(a: &[f64; N], b: &[f64; N], n: usize) -> f64 {
    a[..n].iter().zip(&b[..n]).map(|(x, y)| x * y).sum()
}

fn quadratic(g: &[[f64; N]; N], c: &[f64; N]) -> f64 {
    let mut s = 0.0;
    for i in 0..N {
        for j in 0..N {
            s += c[i] * g[i][j] * c[j];
        }
    }
    s
}

/// Solves `G_SS·c_S = h_S` for the columns in `mask` by Cholesky; the other coefficients are 0.
/// `None` when the subset's columns are (numerically) collinear.
fn solve_subset(g: &[[f64; N]; N], h: &[f64; N], mask: u8) -> Option<[f64; N]> {
    let mut idx = [0usize; N];
    let mut n = 0;
    for j in 0..N {
        if mask & (1 << j) != 0 {
            idx[n] = j;
            n += 1;
        }
    }
    // Lower-triangular factor L with L·Lᵀ = G_SS.
    let mut l = [[0.0f64; N]; N];
    for a in 0..n {
        for b in 0..=a {
            let s = g[idx[a]][idx[b]] - dot_prefix(&l[a], &l[b], b);
            if a == b {
                // NaN fails too.
                if s.is_nan() || s <= MIN_PIVOT {
                    return None;
                }
                l[a][a] = s.sqrt();
            } else {
                l[a][b] = s / l[b][b];
            }
        }
    }
    // Forward then back substitution.
    let mut z = [0.0f64; N];
    for a in 0..n {
        let mut s = h[idx[a]];
        for p in 0..a {
            s -= l[a][p] * z[p];
        }
        z[a] = s / l[a][a];
    }
    let mut sol = [0.0f64; N];
    for a in (0..n).rev() {
        let mut s = z[a];
        for p in a + 1..n {
            s -= l[p][a] * sol[p];
        }
        sol[a] = s / l[a][a];
    }
    let mut c = [0.0f64; N];
    for a in 0..n {
        c[idx[a]] = sol[a];
    }
    Some(c)
}

/// Coefficients from the solver as a model: finite and `>= 0` by construction; a tiny negative
/// from rounding is clamped to 0.
fn to_model(c: [f64; N]) -> LatencyModel {
    let c = c.map(|v| if v.is_finite() { v.max(0.0) } else { 0.0 });
    LatencyModel::from_terms(c).unwrap_or(LatencyModel::ZERO)
}

// === impl OnlineFit ===

/// How the online fit weighs the steps it learns from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Estimator {
    /// Robust (the default): relative errors, Huber-weighted (`docs/fitting.md#online`). A
    /// step far off the fit (a pause, a page fault) counts for little; each step's error is
    /// taken relative to its predicted time, as an engine's noise is; the scale of the errors
    /// is learned, so a lasting change (a slower engine) is followed within a bounded number
    /// of steps.
    #[default]
    Huber,
    /// Plain recursive least squares on milliseconds: every step counts alike, however far off.
    /// Kept for comparison.
    LeastSquares,
}

/// The online fit's settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OnlineFitConfig {
    /// `λ` in `(0, 1]`: each step multiplies the weight of every earlier one by `λ`, so a
    /// sample `n` steps old weighs `λⁿ` and the fit remembers about `1 / (1 − λ)` steps.
    /// 1 forgets nothing.
    pub forgetting: f64,
    /// Samples (steps observed since the start) needed before the fit is trusted. The robust
    /// fit's warm-up is as long (at most [`MAX_WARMUP`] steps).
    pub min_samples: u64,
    /// The largest relative RMS error at which the fit is trusted (robust: the smaller of the
    /// RMS of the Huber-weighted relative errors and the learned scale of new steps' relative
    /// errors; least squares: the RMS of the residuals over the mean measurement).
    pub max_relative_rms: f64,
    /// How steps are weighed.
    pub estimator: Estimator,
}

impl Default for OnlineFitConfig {
    /// `λ = 0.995` (about 200 steps of memory, 1% weight left after ~920 steps), 50 samples,
    /// 10% relative RMS error, robust.
    fn default() -> Self {
        Self {
            forgetting: DEFAULT_FORGETTING,
            min_samples: DEFAULT_MIN_SAMPLES,
            max_relative_rms: DEFAULT_MAX_RELATIVE_RMS,
            estimator: Estimator::default(),
        }
    }
}

/// The default forgetting factor `λ`.
pub const DEFAULT_FORGETTING: f64 = 0.995;
/// The default number of samples before the online fit is trusted.
pub const DEFAULT_MIN_SAMPLES: u64 = 50;
/// The default largest relative RMS error of a trusted fit.
pub const DEFAULT_MAX_RELATIVE_RMS: f64 = 0.10;
/// The robust fit's longest warm-up: the steps it keeps and fits as a batch before it goes on
/// step by step.
pub const MAX_WARMUP: usize = 256;

/// Huber's constant, in units of the error scale: errors up to it weigh fully, larger ones
/// weigh `HUBER_K · scale / |error|` (their pull on the fit stays bounded).
const HUBER_K: f64 = 2.0;
/// The least error scale (relative): noiseless steps would otherwise drive it to 0 and make
/// every later step an outlier.
const MIN_SCALE: f64 = 0.005;
/// How fast the error scale follows the errors per step: `scale ← (1 − r)·scale + r·1.25·|e|`,
/// with `|e|` clipped to `SCALE_CLIP · scale`. A lasting change of the engine grows the scale
/// by `1 + r·(1.25·SCALE_CLIP − 1)` (8%) a step until the new errors weigh fully again; a
/// lone outlier raises it by that much once.
const SCALE_RATE: f64 = 0.02;
const SCALE_CLIP: f64 = 4.0;
/// Iterations of the warm-up's batch fit (reweighted least squares).
const WARMUP_ITERATIONS: usize = 8;

/// What the online fit says now.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct OnlineEstimate {
    /// The fitted coefficients.
    pub model: LatencyModel,
    /// Steps observed since the start (or the last reset).
    pub samples: u64,
    /// The weighted relative RMS error of the fit over the steps it remembers.
    pub relative_rms: f64,
    /// Whether the planner may use `model`: `samples >= min_samples` and
    /// `relative_rms <= max_relative_rms`.
    pub trusted: bool,
}

/// A node's online latency fit: recursive non-negative least squares with a forgetting factor,
/// robust by default ([`Estimator`]). Constant memory (the 5×5 normal equations; the robust
/// fit also keeps its warm-up's steps until the warm-up ends), O(1) per observed step; the
/// coefficients are solved once per observed step (32 Cholesky solves of at most 5×5) and kept,
/// so [`OnlineFit::estimate`] costs nothing.
#[derive(Debug, Clone, PartialEq)]
pub struct OnlineFit {
    config: OnlineFitConfig,
    normal: Normal,
    samples: u64,
    /// The robust fit's warm-up steps (emptied, its allocation freed, when it ends).
    warmup: Vec<[f64; N + 1]>,
    /// The robust fit's error scale (relative).
    scale: f64,
    /// `Σ` of the decayed Huber weights (the robust error's denominator).
    huber_weight: f64,
    /// The coefficients solved after the last observed step, and their error.
    solved: Option<([f64; N], f64)>,
}

impl OnlineFit {
    /// A fit with no samples.
    ///
    /// # Errors
    /// [`FitError::BadSetting`] when `forgetting` is not in `(0, 1]`, `min_samples` is 0 or
    /// `max_relative_rms` is not a finite number `> 0`.
    pub fn try_new(config: OnlineFitConfig) -> Result<Self, FitError> {
        if !(config.forgetting > 0.0 && config.forgetting <= 1.0) {
            return Err(FitError::BadSetting {
                key: "forgetting",
                expected: "in (0, 1]",
                value: config.forgetting,
            });
        }
        if config.min_samples == 0 {
            return Err(FitError::BadSetting {
                key: "min_samples",
                expected: "at least 1",
                value: 0.0,
            });
        }
        if !(config.max_relative_rms.is_finite() && config.max_relative_rms > 0.0) {
            return Err(FitError::BadSetting {
                key: "max_relative_rms",
                expected: "a finite number > 0",
                value: config.max_relative_rms,
            });
        }
        Ok(Self {
            config,
            normal: Normal::default(),
            samples: 0,
            warmup: Vec::new(),
            scale: MIN_SCALE,
            huber_weight: 0.0,
            solved: None,
        })
    }

    /// The fit's settings.
    pub fn config(&self) -> &OnlineFitConfig {
        &self.config
    }

    /// Steps observed since the start (or the last reset).
    pub fn samples(&self) -> u64 {
        self.samples
    }

    /// The robust fit's warm-up length: `min_samples`, at most [`MAX_WARMUP`].
    fn warmup_len(&self) -> usize {
        usize::try_from(self.config.min_samples).map_or(MAX_WARMUP, |n| n.min(MAX_WARMUP))
    }

    /// Learns from one completed step: its features (as planned, with the tokens it ran) and
    /// its measured milliseconds.
    ///
    /// # Errors
    /// [`FitError::BadMeasurement`] when `measured_ms` is negative, NaN or infinite; nothing
    /// changes then.
    pub fn observe(&mut self, features: &StepFeatures, measured_ms: f64) -> Result<(), FitError> {
        let sample = Sample::new(features, measured_ms)?;
        self.observe_sample(&sample)
    }

    /// [`OnlineFit::observe`] for a sample already in `f64`s.
    ///
    /// # Errors
    /// [`FitError::BadMeasurement`] as there; [`FitError::BadFeature`] when a feature is
    /// negative or not finite.
    pub fn observe_sample(&mut self, s: &Sample) -> Result<(), FitError> {
        let x = s.checked()?;
        self.samples = self.samples.saturating_add(1);
        match self.config.estimator {
            Estimator::LeastSquares => {
                self.normal.decay(self.config.forgetting);
                self.normal.add(&x, s.ms);
                let c = self.normal.solve();
                self.solved = Some((c, self.normal.relative_rms(&c)));
            }
            Estimator::Huber
                if self.warmup.len() < self.warmup_len() && self.solved_is_warmup() =>
            {
                let mut row = [0.0; N + 1];
                row[..N].copy_from_slice(&x);
                row[N] = s.ms;
                self.warmup.push(row);
                self.fit_warmup();
            }
            Estimator::Huber => self.observe_robust(&x, s.ms),
        }
        Ok(())
    }

    /// Whether the robust fit is still in its warm-up (it has not gone on step by step).
    fn solved_is_warmup(&self) -> bool {
        self.normal.sw == 0.0
    }

    /// The warm-up's batch fit: reweighted least squares over the steps kept, Huber weights on
    /// relative errors whose scale is the median absolute error (× 1.4826, the normal
    /// distribution's factor). When the warm-up is complete, its steps become the normal
    /// equations the fit goes on from, each weighted as the last iteration weighed it and
    /// decayed by its age.
    fn fit_warmup(&mut self) {
        let rows = &self.warmup;
        let mut c = {
            let mut n = Normal::default();
            for r in rows {
                n.add_weighted(row_x(r), r[N], relative_weight(r[N]));
            }
            n.solve()
        };
        let mut weights = vec![1.0; rows.len()];
        let mut errors = vec![0.0; rows.len()];
        let mut scale = MIN_SCALE;
        for _ in 0..WARMUP_ITERATIONS {
            for (e, r) in errors.iter_mut().zip(rows) {
                *e = relative_error(&c, r);
            }
            scale = (1.4826 * median_abs(&errors)).max(MIN_SCALE);
            let mut n = Normal::default();
            for ((w, e), r) in weights.iter_mut().zip(&errors).zip(rows) {
                let (huber, by) = huber_weight(*e, scale, &c, r);
                *w = huber;
                n.add_weighted(row_x(r), r[N], huber / (by * by));
            }
            c = n.solve();
        }
        let mut normal = Normal::default();
        let mut huber_total = 0.0;
        let lambda = self.config.forgetting;
        for (w, r) in weights.iter().zip(rows) {
            normal.decay(lambda);
            huber_total *= lambda;
            let by = scale_of(&c, r);
            normal.add_weighted(row_x(r), r[N], w / (by * by));
            huber_total += w;
        }
        let rms = robust_rms(&normal, &c, huber_total).min(scale);
        self.solved = Some((c, rms));
        if self.warmup.len() >= self.warmup_len() {
            self.normal = normal;
            self.huber_weight = huber_total;
            self.scale = scale;
            self.warmup = Vec::new();
        }
    }

    /// One step of the robust fit after its warm-up: its relative error against the current
    /// fit gives its Huber weight, and updates the error scale.
    fn observe_robust(&mut self, x: &[f64; N], ms: f64) {
        let c = self.solved.map_or([0.0; N], |(c, _)| c);
        let mut row = [0.0; N + 1];
        row[..N].copy_from_slice(x);
        row[N] = ms;
        let e = relative_error(&c, &row);
        let (huber, by) = huber_weight(e, self.scale, &c, &row);
        let clipped = e.abs().min(SCALE_CLIP * self.scale);
        self.scale = ((1.0 - SCALE_RATE) * self.scale + SCALE_RATE * 1.25 * clipped).max(MIN_SCALE);
        let lambda = self.config.forgetting;
        self.normal.decay(lambda);
        self.normal.add_weighted(x, ms, huber / (by * by));
        self.huber_weight = self.huber_weight * lambda + huber;
        let c = self.normal.solve();
        let rms = robust_rms(&self.normal, &c, self.huber_weight).min(self.scale);
        self.solved = Some((c, rms));
    }

    /// The fitted coefficients, their error and whether they are trusted; `None` before the
    /// first sample.
    pub fn estimate(&self) -> Option<OnlineEstimate> {
        let (c, relative_rms) = self.solved.filter(|_| self.samples > 0)?;
        Some(OnlineEstimate {
            model: to_model(c),
            samples: self.samples,
            relative_rms,
            trusted: self.samples >= self.config.min_samples
                && relative_rms <= self.config.max_relative_rms,
        })
    }

    /// The fitted model when it is trusted, else `None`: what the planner should use before
    /// falling back to the configured model.
    pub fn trusted_model(&self) -> Option<LatencyModel> {
        self.estimate().filter(|e| e.trusted).map(|e| e.model)
    }

    /// Forgets every sample (a new model, a restarted engine).
    pub fn reset(&mut self) {
        self.normal = Normal::default();
        self.samples = 0;
        self.warmup = Vec::new();
        self.scale = MIN_SCALE;
        self.huber_weight = 0.0;
        self.solved = None;
    }
}

/// The regressors of a kept warm-up step.
fn row_x(r: &[f64; N + 1]) -> &[f64; N] {
    r[..N].try_into().expect("N regressors")
}

/// What a step's error is relative to: its predicted time under `c`, or (with no prediction
/// yet) its measured time, or 1 ms when both are 0.
fn scale_of(c: &[f64; N], r: &[f64; N + 1]) -> f64 {
    let predicted = predict(c, row_x(r));
    if predicted > 0.0 && predicted.is_finite() {
        predicted
    } else if r[N] > 0.0 {
        r[N]
    } else {
        1.0
    }
}

/// `1 / y²` (or 1 for a step of 0 ms): the weight of a relative error on the first pass.
fn relative_weight(ms: f64) -> f64 {
    if ms > 0.0 {
        1.0 / (ms * ms)
    } else {
        1.0
    }
}

/// `(measured − predicted) / predicted` under `c`.
fn relative_error(c: &[f64; N], r: &[f64; N + 1]) -> f64 {
    (r[N] - predict(c, row_x(r))) / scale_of(c, r)
}

/// A step's Huber weight for relative error `e` at `scale`, and what its error is relative to.
fn huber_weight(e: f64, scale: f64, c: &[f64; N], r: &[f64; N + 1]) -> (f64, f64) {
    let u = e.abs() / scale;
    let w = if u <= HUBER_K { 1.0 } else { HUBER_K / u };
    (w, scale_of(c, r))
}

/// The robust fit's error: the root of the Huber-weighted mean squared relative error.
fn robust_rms(normal: &Normal, c: &[f64; N], huber_weight: f64) -> f64 {
    let ss = normal.residual_ss(c);
    if ss == 0.0 {
        return 0.0;
    }
    if huber_weight <= 0.0 {
        return f64::INFINITY;
    }
    (ss / huber_weight).sqrt()
}

/// The median of `|v|` (nearest rank from below).
fn median_abs(v: &[f64]) -> f64 {
    let mut a: Vec<f64> = v.iter().map(|x| x.abs()).collect();
    a.sort_by(f64::total_cmp);
    a.get(a.len().saturating_sub(1) / 2).copied().unwrap_or(0.0)
}

// === the offline fit ===

/// Absolute prediction errors `|predicted − measured|` in milliseconds, nearest-rank quantiles.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct ErrorQuantiles {
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Largest.
    pub max: f64,
}

/// The result of an offline fit.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct FitReport {
    /// The fitted coefficients.
    pub model: LatencyModel,
    /// Steps fitted.
    pub samples: usize,
    /// The coefficient of determination `1 − SS_res / SS_tot`; `None` when every measurement
    /// is the same (`SS_tot = 0`).
    pub r_squared: Option<f64>,
    /// RMS error over the mean measurement.
    pub relative_rms: f64,
    /// Absolute errors, milliseconds.
    pub abs_error_ms: ErrorQuantiles,
    /// How many of the model's terms the steps determine: the rank of the design (a constant,
    /// tokens, context tokens, attention pairs, rows, over the steps), counting only terms not 0
    /// in every step (and rows only where their number varies).
    pub rank: usize,
    /// The terms not 0 in every step (a term that is, e.g. context tokens in a log without
    /// decode rows, is fitted as 0 and says nothing).
    pub observed_terms: usize,
}

impl FitReport {
    /// Whether the steps leave the fit underdetermined: fewer steps than observed terms, or
    /// terms the steps cannot tell apart. Several models then fit equally well, and R² (often
    /// a perfect 1) says nothing about the model.
    pub fn underdetermined(&self) -> bool {
        self.samples < self.observed_terms || self.rank < self.observed_terms
    }
}

/// Which errors an offline fit minimises (`fit --errors`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FitErrors {
    /// The sum of squared errors in ms: long steps weigh the most.
    #[default]
    Absolute,
    /// The sum of squared errors relative to each step's measured time, as the online fit
    /// weighs them: a 20 ms decode step counts as much as a 2 s chunk step. A step under 1% of
    /// the mean measurement is weighed as one of 1% (a 0 ms step has no relative error).
    Relative,
}

/// Fits the model to `samples`, all weighted alike.
///
/// # Errors
/// [`FitError::NoSamples`] when `samples` is empty; [`FitError::BadMeasurement`] or
/// [`FitError::BadFeature`] for a negative or non-finite value; [`FitError::SumsOverflow`]
/// naming the first sample at which the sums overflow; [`FitError::NotFinite`] when the
/// coefficients or errors are not finite; [`FitError::AllZero`] when every coefficient is 0.
pub fn fit_samples(samples: &[Sample]) -> Result<FitReport, FitError> {
    fit_samples_with(samples, FitErrors::Absolute)
}

/// [`fit_samples`], minimising `errors`.
///
/// # Errors
/// As [`fit_samples`].
pub fn fit_samples_with(samples: &[Sample], errors: FitErrors) -> Result<FitReport, FitError> {
    if samples.is_empty() {
        return Err(FitError::NoSamples);
    }
    // Relative weights as `(mean / ms)²`: the same fit as `1 / ms²` (a constant factor), in
    // [0, 10⁴] whatever the scale of the times, so none underflows to 0. The mean is summed
    // over `n` term by term, so it does not overflow either.
    let n = samples.len() as f64;
    let mean_ms = match errors {
        FitErrors::Absolute => None,
        FitErrors::Relative => Some(samples.iter().map(|s| s.ms / n).sum::<f64>()),
    };
    let mut normal = Normal::default();
    for (index, s) in samples.iter().enumerate() {
        let x = s.checked()?;
        match mean_ms {
            None => normal.add(&x, s.ms),
            Some(mean) => {
                let scale = s.ms.max(0.01 * mean);
                let w = if scale > 0.0 {
                    (mean / scale).powi(2)
                } else {
                    1.0
                };
                normal.add_weighted(&x, s.ms, w);
            }
        }
        if !normal.is_finite() {
            return Err(FitError::SumsOverflow { index });
        }
    }
    let (rank, observed_terms) = normal.rank();
    let solved = normal.solve();
    if solved.iter().any(|v| !v.is_finite()) {
        return Err(FitError::NotFinite {
            what: "a coefficient",
        });
    }
    let model = to_model(solved);
    let c = model.terms();
    if c == [0.0; N] {
        return Err(FitError::AllZero);
    }
    // Residuals straight from the samples: exact, unlike the sums' cancellation.
    let mean = samples.iter().map(|s| s.ms).sum::<f64>() / n;
    let mut errors: Vec<f64> = Vec::with_capacity(samples.len());
    let (mut ss_res, mut ss_tot) = (0.0, 0.0);
    for s in samples {
        let r = predict(&c, &s.x()) - s.ms;
        ss_res += r * r;
        ss_tot += (s.ms - mean) * (s.ms - mean);
        errors.push(r.abs());
    }
    if !(ss_res.is_finite() && ss_tot.is_finite() && mean.is_finite()) {
        return Err(FitError::NotFinite {
            what: "the prediction errors",
        });
    }
    errors.sort_by(f64::total_cmp);
    let q = |p: f64| {
        // Nearest rank: the smallest error with at least p of the errors at or below it.
        let rank = (p * n).ceil().max(1.0) as usize;
        errors[rank.min(errors.len()) - 1]
    };
    Ok(FitReport {
        model,
        samples: samples.len(),
        r_squared: (ss_tot > 0.0).then(|| 1.0 - ss_res / ss_tot),
        relative_rms: relative_rms(ss_res, mean * n, n),
        abs_error_ms: ErrorQuantiles {
            p50: q(0.50),
            p90: q(0.90),
            p99: q(0.99),
            max: errors[errors.len() - 1],
        },
        rank,
        observed_terms,
    })
}

#[cfg(any(test, feature = "test-hooks"))]
pub mod testing;
#[cfg(test)]
mod tests;
