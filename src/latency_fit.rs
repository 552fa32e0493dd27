//! Fitting the latency model to measured step times (`docs/cost-model.md#fitting`).
//!
//! - [`OnlineFit`]: what the component learns from the step times the engine reports
//!   (`complete(step, ran, measured_ms)`). Recursive least squares with a forgetting factor, so
//!   recent steps weigh more and memory stays constant; the coefficients are solved on demand,
//!   non-negative, and the fit says when it can be trusted.
//! - [`fit_file`] / [`fit_samples`]: the offline fit behind `mstar-chunking fit FILE`, over a
//!   replay step log or a CSV of step features, with R² and error quantiles;
//!   [`render_toml`] prints the result as a `[chunking.cost.<node>]` table.
//!
//! Both solve the same problem exactly: the least-squares coefficients under the constraint
//! that every coefficient is `>= 0` (see `Normal::solve`).

use std::fmt::Write as _;
use std::fs::File;
use std::io::{self, BufRead, BufReader, Read};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::latency::{chunk_attention_pairs, LatencyModel, StepFeatures, COEFFICIENT_KEYS};

/// The most bytes [`fit_file`] reads from one file: a step log of several million steps.
pub const MAX_FIT_FILE_BYTES: u64 = 512 << 20;
/// The longest line [`fit_file`] reads: a step of several thousand rows.
pub const MAX_FIT_LINE_BYTES: u64 = 1 << 20;
/// The most steps [`fit_file`] keeps (each is kept for the error quantiles: 32 bytes a step).
pub const MAX_FIT_SAMPLES: usize = 4_000_000;

/// A refused measurement, fit setting or fit input. File errors name the file and the line.
#[derive(Debug, thiserror::Error)]
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
    /// The file could not be opened or read.
    #[error("{}: {source}", .path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        source: io::Error,
    },
    /// The path is a directory, a FIFO, a device...
    #[error("{}: not a regular file; `fit` reads a step log or a CSV file", .path.display())]
    NotAFile {
        /// The path.
        path: PathBuf,
    },
    /// The file is larger than [`MAX_FIT_FILE_BYTES`].
    #[error("{}: larger than the {limit} bytes `fit` reads", .path.display())]
    FileTooLarge {
        /// The file.
        path: PathBuf,
        /// The limit, bytes.
        limit: u64,
    },
    /// A line is longer than [`MAX_FIT_LINE_BYTES`].
    #[error("{}:{line}: line longer than the {limit} bytes `fit` reads", .path.display())]
    LineTooLong {
        /// The file.
        path: PathBuf,
        /// The line, from 1.
        line: u64,
        /// The limit, bytes.
        limit: u64,
    },
    /// The file holds more than [`MAX_FIT_SAMPLES`] steps.
    #[error("{}: more than {limit} steps; fit a part of the file", .path.display())]
    TooManySamples {
        /// The file.
        path: PathBuf,
        /// The limit, steps.
        limit: usize,
    },
    /// A line is not a step.
    #[error("{}:{line}: {message}", .path.display())]
    BadLine {
        /// The file.
        path: PathBuf,
        /// The line, from 1.
        line: u64,
        /// What is wrong with it.
        message: String,
    },
    /// The file holds no step.
    #[error("{}: no steps to fit", .path.display())]
    EmptyFile {
        /// The file.
        path: PathBuf,
    },
}

fn check_measurement(ms: f64) -> Result<f64, FitError> {
    if ms.is_finite() && ms >= 0.0 {
        Ok(ms)
    } else {
        Err(FitError::BadMeasurement { value: ms })
    }
}

// === impl Sample ===

/// One completed step: its features and its measured milliseconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample {
    /// `T`: tokens the step ran.
    pub tokens: f64,
    /// `K`: context tokens its continuing rows read.
    pub kv_tokens: f64,
    /// `A`: causal attention pairs of its chunks.
    pub attention_pairs: f64,
    /// The measured step time, milliseconds.
    pub ms: f64,
}

impl Sample {
    /// A step with these features that took `ms`.
    ///
    /// # Errors
    /// [`FitError::BadMeasurement`] when `ms` is negative, NaN or infinite.
    pub fn new(features: &StepFeatures, ms: f64) -> Result<Self, FitError> {
        let [tokens, kv_tokens, attention_pairs] = features.to_f64();
        Ok(Self {
            tokens,
            kv_tokens,
            attention_pairs,
            ms: check_measurement(ms)?,
        })
    }

    /// The regressors, once the measurement and every feature are checked finite and `>= 0`.
    fn checked(&self) -> Result<[f64; 4], FitError> {
        check_measurement(self.ms)?;
        for (key, value) in ["tokens", "kv_tokens", "attention_pairs"].into_iter().zip([
            self.tokens,
            self.kv_tokens,
            self.attention_pairs,
        ]) {
            if !(value.is_finite() && value >= 0.0) {
                return Err(FitError::BadFeature { key, value });
            }
        }
        Ok(self.x())
    }

    /// The regressors `[1, T, K, A]`, in the order of the coefficients.
    fn x(&self) -> [f64; 4] {
        [1.0, self.tokens, self.kv_tokens, self.attention_pairs]
    }
}

/// The model's prediction for `x = [1, T, K, A]`, in the same order of operations as
/// [`LatencyModel::predict_ms`].
fn predict(c: &[f64; 4], x: &[f64; 4]) -> f64 {
    c[0] * x[0] + c[1] * x[1] + c[2] * x[2] + c[3] * x[3]
}

// === impl Normal ===

/// The weighted normal equations of the fit: `G = Σ w·x·xᵀ`, `h = Σ w·x·y`, and the sums the
/// error needs. Constant size, whatever the number of samples.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Normal {
    g: [[f64; 4]; 4],
    h: [f64; 4],
    /// `Σ w·y²`.
    yy: f64,
    /// `Σ w·y`.
    sy: f64,
    /// `Σ w`.
    sw: f64,
}

/// A pivot below this (on the unit-diagonal scaled matrix: `1 − R²` of a column regressed on
/// the others of its subset) marks the subset's columns as collinear; a smaller subset then
/// reaches the same fit.
const MIN_PIVOT: f64 = 1e-11;

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
    }

    fn add(&mut self, x: &[f64; 4], y: f64) {
        for i in 0..4 {
            for j in 0..4 {
                self.g[i][j] += x[i] * x[j];
            }
            self.h[i] += x[i] * y;
        }
        self.yy += y * y;
        self.sy += y;
        self.sw += 1.0;
    }

    /// The non-negative least-squares coefficients: `argmin Σ w·(xᵀc − y)²` over `c >= 0`.
    ///
    /// Exact, by enumeration: an optimum has a support whose columns are independent, and on
    /// its support it solves the normal equations restricted to it. So the best feasible
    /// restricted solution over the 16 subsets of the 4 columns is the optimum. Columns are
    /// scaled to unit diagonal first: `A` runs to 1e9 and more where the intercept is 1, and
    /// unscaled pivots would be meaningless.
    fn solve(&self) -> [f64; 4] {
        let mut scale = [0.0; 4];
        for (j, s) in scale.iter_mut().enumerate() {
            let d = self.g[j][j].sqrt();
            // A column that is zero in every sample (no decode rows, say) gets coefficient 0.
            *s = if d.is_finite() && d > 0.0 { d } else { 0.0 };
        }
        let mut gs = [[0.0; 4]; 4];
        let mut hs = [0.0; 4];
        for i in 0..4 {
            if scale[i] == 0.0 {
                continue;
            }
            for j in 0..4 {
                if scale[j] != 0.0 {
                    gs[i][j] = self.g[i][j] / (scale[i] * scale[j]);
                }
            }
            hs[i] = self.h[i] / scale[i];
        }
        let mut best = [0.0; 4];
        let mut best_obj = 0.0; // the objective of c = 0, less the constant Σ w·y²
        for mask in 1u8..16 {
            if (0..4).any(|j| mask & (1 << j) != 0 && scale[j] == 0.0) {
                continue;
            }
            let Some(c) = solve_subset(&gs, &hs, mask) else {
                continue;
            };
            if c.iter().any(|&v| !(v >= 0.0 && v.is_finite())) {
                continue;
            }
            let obj = quadratic(&gs, &c) - 2.0 * dot(&hs, &c);
            if obj < best_obj {
                best_obj = obj;
                best = c;
            }
        }
        let mut out = [0.0; 4];
        for j in 0..4 {
            if scale[j] != 0.0 {
                out[j] = best[j] / scale[j];
            }
        }
        out
    }

    /// `Σ w·(xᵀc − y)²` from the sums, never negative.
    fn residual_ss(&self, c: &[f64; 4]) -> f64 {
        (self.yy - 2.0 * dot(&self.h, c) + quadratic(&self.g, c)).max(0.0)
    }

    /// The root mean square error over the mean measurement.
    fn relative_rms(&self, c: &[f64; 4]) -> f64 {
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

fn dot(a: &[f64; 4], b: &[f64; 4]) -> f64 {
    a[0] * b[0] + a[1] * b[1] + a[2] * b[2] + a[3] * b[3]
}

/// `Σ_{p < n} a[p]·b[p]`.
fn dot_prefix(a: &[f64; 4], b: &[f64; 4], n: usize) -> f64 {
    a[..n].iter().zip(&b[..n]).map(|(x, y)| x * y).sum()
}

fn quadratic(g: &[[f64; 4]; 4], c: &[f64; 4]) -> f64 {
    let mut s = 0.0;
    for i in 0..4 {
        for j in 0..4 {
            s += c[i] * g[i][j] * c[j];
        }
    }
    s
}

/// Solves `G_SS·c_S = h_S` for the columns in `mask` by Cholesky; the other coefficients are 0.
/// `None` when the subset's columns are (numerically) collinear.
fn solve_subset(g: &[[f64; 4]; 4], h: &[f64; 4], mask: u8) -> Option<[f64; 4]> {
    let mut idx = [0usize; 4];
    let mut n = 0;
    for j in 0..4 {
        if mask & (1 << j) != 0 {
            idx[n] = j;
            n += 1;
        }
    }
    // Lower-triangular factor L with L·Lᵀ = G_SS.
    let mut l = [[0.0f64; 4]; 4];
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
    let mut z = [0.0f64; 4];
    for a in 0..n {
        let mut s = h[idx[a]];
        for p in 0..a {
            s -= l[a][p] * z[p];
        }
        z[a] = s / l[a][a];
    }
    let mut sol = [0.0f64; 4];
    for a in (0..n).rev() {
        let mut s = z[a];
        for p in a + 1..n {
            s -= l[p][a] * sol[p];
        }
        sol[a] = s / l[a][a];
    }
    let mut c = [0.0f64; 4];
    for a in 0..n {
        c[idx[a]] = sol[a];
    }
    Some(c)
}

/// Coefficients from the solver as a model: finite and `>= 0` by construction; a tiny negative
/// from rounding is clamped to 0.
fn to_model(c: [f64; 4]) -> LatencyModel {
    let c = c.map(|v| if v.is_finite() { v.max(0.0) } else { 0.0 });
    LatencyModel::from_coefficients(c).unwrap_or(LatencyModel::ZERO)
}

// === impl OnlineFit ===

/// The online fit's settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OnlineFitConfig {
    /// `λ` in `(0, 1]`: each step multiplies the weight of every earlier one by `λ`, so a
    /// sample `n` steps old weighs `λⁿ` and the fit remembers about `1 / (1 − λ)` steps.
    /// 1 forgets nothing.
    pub forgetting: f64,
    /// Samples (steps observed since the start) needed before the fit is trusted.
    pub min_samples: u64,
    /// The largest relative RMS error (RMS of the weighted residuals over the weighted mean
    /// measurement) at which the fit is trusted.
    pub max_relative_rms: f64,
}

impl Default for OnlineFitConfig {
    /// `λ = 0.995` (about 200 steps of memory, 1% weight left after ~920 steps), 50 samples,
    /// 10% relative RMS error.
    fn default() -> Self {
        Self {
            forgetting: DEFAULT_FORGETTING,
            min_samples: DEFAULT_MIN_SAMPLES,
            max_relative_rms: DEFAULT_MAX_RELATIVE_RMS,
        }
    }
}

/// The default forgetting factor `λ`.
pub const DEFAULT_FORGETTING: f64 = 0.995;
/// The default number of samples before the online fit is trusted.
pub const DEFAULT_MIN_SAMPLES: u64 = 50;
/// The default largest relative RMS error of a trusted fit.
pub const DEFAULT_MAX_RELATIVE_RMS: f64 = 0.10;

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

/// A node's online latency fit: recursive non-negative least squares with a forgetting factor.
/// Constant memory (the 4×4 normal equations), O(1) per observed step; the 4-variable NNLS is
/// solved when [`OnlineFit::estimate`] is asked (16 Cholesky solves of at most 4×4).
#[derive(Debug, Clone, PartialEq)]
pub struct OnlineFit {
    config: OnlineFitConfig,
    normal: Normal,
    samples: u64,
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
        self.normal.decay(self.config.forgetting);
        self.normal.add(&x, s.ms);
        self.samples = self.samples.saturating_add(1);
        Ok(())
    }

    /// The fitted coefficients, their error and whether they are trusted; `None` before the
    /// first sample.
    pub fn estimate(&self) -> Option<OnlineEstimate> {
        if self.samples == 0 {
            return None;
        }
        let c = self.normal.solve();
        let relative_rms = self.normal.relative_rms(&c);
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
    }
}

// === offline fit ===

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
}

/// Fits the model to `samples`, all weighted alike.
///
/// # Errors
/// [`FitError::NoSamples`] when `samples` is empty; [`FitError::BadMeasurement`] or
/// [`FitError::BadFeature`] for a negative or non-finite value.
pub fn fit_samples(samples: &[Sample]) -> Result<FitReport, FitError> {
    if samples.is_empty() {
        return Err(FitError::NoSamples);
    }
    let mut normal = Normal::default();
    for s in samples {
        let x = s.checked()?;
        normal.add(&x, s.ms);
    }
    let model = to_model(normal.solve());
    let c = model.coefficients();
    // Residuals straight from the samples: exact, unlike the sums' cancellation.
    let n = samples.len() as f64;
    let mean = samples.iter().map(|s| s.ms).sum::<f64>() / n;
    let mut errors: Vec<f64> = Vec::with_capacity(samples.len());
    let (mut ss_res, mut ss_tot) = (0.0, 0.0);
    for s in samples {
        let r = predict(&c, &s.x()) - s.ms;
        ss_res += r * r;
        ss_tot += (s.ms - mean) * (s.ms - mean);
        errors.push(r.abs());
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
    })
}

/// The kind of file [`read_samples`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FitInput {
    /// A replay step log (JSON Lines; the first non-blank byte is `{`).
    StepLog,
    /// A CSV with the header `tokens,kv_tokens,attention_pairs,ms` (any order; other columns
    /// are ignored).
    Csv,
}

/// Reads and fits a step log or a CSV of step features: what `mstar-chunking fit FILE` runs.
///
/// # Errors
/// As [`read_samples`]; [`FitError::EmptyFile`] when the file holds no step.
pub fn fit_file(path: &Path) -> Result<(FitInput, FitReport), FitError> {
    let (input, samples) = read_samples(path)?;
    if samples.is_empty() {
        return Err(FitError::EmptyFile {
            path: path.to_owned(),
        });
    }
    Ok((input, fit_samples(&samples)?))
}

/// The limits a read runs under; the public functions use the documented constants.
#[derive(Debug, Clone, Copy)]
struct Limits {
    file_bytes: u64,
    line_bytes: u64,
    samples: usize,
}

const LIMITS: Limits = Limits {
    file_bytes: MAX_FIT_FILE_BYTES,
    line_bytes: MAX_FIT_LINE_BYTES,
    samples: MAX_FIT_SAMPLES,
};

/// Reads the steps of a step log or a CSV file, whichever it is (by its first non-blank
/// byte: `{` is a step log).
///
/// A step log line is one step of `replay --step-log`: `T` is its `ran_tokens` when present
/// (what the rows really ran) or else the sum of its rows' `tokens`; `K` the sum of its
/// continuing rows' `context`; `A` the pairs of its chunk rows' `[start, end)`; the time its
/// `ms`. Blank lines are skipped.
///
/// # Errors
/// The path is not a regular file, cannot be read, is larger than [`MAX_FIT_FILE_BYTES`], has
/// a line longer than [`MAX_FIT_LINE_BYTES`] or more than [`MAX_FIT_SAMPLES`] steps, or a line
/// is not a step (each error names the file and the line).
pub fn read_samples(path: &Path) -> Result<(FitInput, Vec<Sample>), FitError> {
    read_samples_with(path, LIMITS)
}

fn read_samples_with(path: &Path, limits: Limits) -> Result<(FitInput, Vec<Sample>), FitError> {
    let io_err = |source| FitError::Io {
        path: path.to_owned(),
        source,
    };
    // Checked before opening: opening a FIFO for reading would block until a writer came.
    let meta = std::fs::metadata(path).map_err(io_err)?;
    if !meta.is_file() {
        return Err(FitError::NotAFile {
            path: path.to_owned(),
        });
    }
    if meta.len() > limits.file_bytes {
        return Err(FitError::FileTooLarge {
            path: path.to_owned(),
            limit: limits.file_bytes,
        });
    }
    let file = File::open(path).map_err(io_err)?;
    let mut reader = BufReader::new(Capped::new(file, limits));
    let first = loop {
        let buf = reader.fill_buf().map_err(|e| limit_error(path, e))?;
        match buf.iter().position(|b| !b.is_ascii_whitespace()) {
            Some(i) => break Some(buf[i]),
            None if buf.is_empty() => break None,
            None => {
                let n = buf.len();
                reader.consume(n);
            }
        }
    };
    match first {
        None => Ok((FitInput::StepLog, Vec::new())),
        Some(b'{') => Ok((FitInput::StepLog, read_step_log(path, reader, limits)?)),
        Some(_) => Ok((FitInput::Csv, read_csv(path, reader, limits)?)),
    }
}

/// Maps an I/O error of the capped reader to the limit it hit, or to a plain I/O error.
fn limit_error(path: &Path, e: io::Error) -> FitError {
    match e
        .get_ref()
        .and_then(|inner| inner.downcast_ref::<LimitHit>())
    {
        Some(&LimitHit::File { limit }) => FitError::FileTooLarge {
            path: path.to_owned(),
            limit,
        },
        Some(&LimitHit::Line { line, limit }) => FitError::LineTooLong {
            path: path.to_owned(),
            line,
            limit,
        },
        None => FitError::Io {
            path: path.to_owned(),
            source: e,
        },
    }
}

fn bad_line(path: &Path, line: u64, message: impl Into<String>) -> FitError {
    FitError::BadLine {
        path: path.to_owned(),
        line,
        message: message.into(),
    }
}

fn too_many(path: &Path, limits: Limits) -> FitError {
    FitError::TooManySamples {
        path: path.to_owned(),
        limit: limits.samples,
    }
}

/// One line of a step log, as far as the fit reads it (other keys are ignored).
#[derive(Deserialize)]
struct LogStep {
    rows: Vec<LogRow>,
    ms: Option<f64>,
    ran_tokens: Option<u64>,
}

#[derive(Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
enum LogRow {
    Continue { tokens: u64, context: Option<u64> },
    Chunk { tokens: u64, start: u32, end: u32 },
}

fn read_step_log<R: BufRead>(
    path: &Path,
    mut reader: R,
    limits: Limits,
) -> Result<Vec<Sample>, FitError> {
    let mut samples = Vec::new();
    let mut buf = Vec::new();
    let mut line = 0u64;
    loop {
        buf.clear();
        let n = reader
            .read_until(b'\n', &mut buf)
            .map_err(|e| limit_error(path, e))?;
        if n == 0 {
            return Ok(samples);
        }
        line += 1;
        if buf.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let step: LogStep = serde_json::from_slice(&buf)
            .map_err(|e| bad_line(path, line, format!("not a step-log step: {e}")))?;
        let sample = step_sample(&step).map_err(|m| bad_line(path, line, m))?;
        if samples.len() >= limits.samples {
            return Err(too_many(path, limits));
        }
        samples.push(sample);
    }
}

fn step_sample(step: &LogStep) -> Result<Sample, String> {
    let mut f = StepFeatures::EMPTY;
    for (i, row) in step.rows.iter().enumerate() {
        match *row {
            LogRow::Continue { tokens, context } => {
                let context = context.ok_or_else(|| {
                    format!(
                        "row {i}: a continuing row needs its `context` to fit `per_kv_token_ms`"
                    )
                })?;
                f.tokens = f.tokens.saturating_add(tokens);
                f.kv_tokens = f.kv_tokens.saturating_add(context);
            }
            LogRow::Chunk { tokens, start, end } => {
                if end <= start || u64::from(end - start) != tokens {
                    return Err(format!(
                        "row {i}: a chunk of {tokens} tokens cannot run [{start}, {end})"
                    ));
                }
                f.tokens = f.tokens.saturating_add(tokens);
                f.attention_pairs = f
                    .attention_pairs
                    .saturating_add(chunk_attention_pairs(start, end));
            }
        }
    }
    if let Some(ran) = step.ran_tokens {
        f.tokens = ran;
    }
    let ms = step
        .ms
        .ok_or("the step has no `ms` (its measured or simulated duration)")?;
    Sample::new(&f, ms).map_err(|e| e.to_string())
}

/// The columns a CSV must have, named in its header.
const CSV_COLUMNS: [&str; 4] = ["tokens", "kv_tokens", "attention_pairs", "ms"];

#[derive(Deserialize)]
struct CsvStep {
    tokens: f64,
    kv_tokens: f64,
    attention_pairs: f64,
    ms: f64,
}

fn read_csv<R: Read>(path: &Path, reader: R, limits: Limits) -> Result<Vec<Sample>, FitError> {
    let mut csv = csv::ReaderBuilder::new()
        .has_headers(true)
        .trim(csv::Trim::All)
        .from_reader(reader);
    let csv_err = |e: csv::Error| -> FitError {
        let line = e.position().map_or(0, csv::Position::line);
        match e.into_kind() {
            csv::ErrorKind::Io(io) => limit_error(path, io),
            csv::ErrorKind::Deserialize { err, .. } => bad_line(path, line, err.to_string()),
            other => bad_line(path, line, format!("{:?}", other)),
        }
    };
    let header = csv.headers().map_err(csv_err)?;
    let missing: Vec<&str> = CSV_COLUMNS
        .into_iter()
        .filter(|c| !header.iter().any(|h| h == *c))
        .collect();
    if !missing.is_empty() {
        return Err(bad_line(
            path,
            1,
            format!(
                "the header must name the columns {}; missing: {}",
                CSV_COLUMNS.join(","),
                missing.join(",")
            ),
        ));
    }
    let mut samples = Vec::new();
    let mut record = csv::StringRecord::new();
    let header = header.clone();
    while csv.read_record(&mut record).map_err(csv_err)? {
        let line = record.position().map_or(0, csv::Position::line);
        let step: CsvStep = record
            .deserialize(Some(&header))
            .map_err(|e| bad_line(path, line, e.to_string()))?;
        for (key, value) in CSV_COLUMNS.into_iter().zip([
            step.tokens,
            step.kv_tokens,
            step.attention_pairs,
            step.ms,
        ]) {
            if !(value.is_finite() && value >= 0.0) {
                return Err(bad_line(
                    path,
                    line,
                    format!("`{key}` must be a finite number >= 0, got {value}"),
                ));
            }
        }
        if samples.len() >= limits.samples {
            return Err(too_many(path, limits));
        }
        samples.push(Sample {
            tokens: step.tokens,
            kv_tokens: step.kv_tokens,
            attention_pairs: step.attention_pairs,
            ms: step.ms,
        });
    }
    Ok(samples)
}

/// Which limit a [`Capped`] read hit, carried inside an `io::Error`.
#[derive(Debug)]
enum LimitHit {
    File { limit: u64 },
    Line { line: u64, limit: u64 },
}

impl std::fmt::Display for LimitHit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::File { limit } => write!(f, "larger than {limit} bytes"),
            Self::Line { line, limit } => write!(f, "line {line} longer than {limit} bytes"),
        }
    }
}

impl std::error::Error for LimitHit {}

/// A reader that fails once the input passes a total size or a line passes a length: the file
/// may grow after its size was checked, and a single line must not fill memory.
struct Capped<R> {
    inner: R,
    limits: Limits,
    total: u64,
    line: u64,
    line_len: u64,
}

impl<R> Capped<R> {
    fn new(inner: R, limits: Limits) -> Self {
        Self {
            inner,
            limits,
            total: 0,
            line: 1,
            line_len: 0,
        }
    }
}

impl<R: Read> Read for Capped<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.total += n as u64;
        if self.total > self.limits.file_bytes {
            return Err(io::Error::other(LimitHit::File {
                limit: self.limits.file_bytes,
            }));
        }
        for &b in &buf[..n] {
            if b == b'\n' {
                self.line += 1;
                self.line_len = 0;
            } else {
                self.line_len += 1;
                if self.line_len > self.limits.line_bytes {
                    return Err(io::Error::other(LimitHit::Line {
                        line: self.line,
                        limit: self.limits.line_bytes,
                    }));
                }
            }
        }
        Ok(n)
    }
}

// === rendering ===

/// Renders a fit as a TOML snippet for the serving config: comment lines with its quality, then
/// `[chunking.cost.<node>]` and the four coefficients (6 significant digits). `source` names
/// what was fitted (a file name), in the comment only.
pub fn render_toml(report: &FitReport, node: &str, source: &str) -> String {
    let mut out = String::new();
    let r2 = report
        .r_squared
        .map_or_else(|| "n/a".to_owned(), |r| format!("{r:.4}"));
    let e = &report.abs_error_ms;
    // `{:?}` escapes newlines and quotes, so a strange file name cannot end the comment.
    let _ = writeln!(
        out,
        "# fitted by `mstar-chunking fit` from {source:?}: {} steps, R² {r2}, relative RMS error {:.1}%",
        report.samples,
        report.relative_rms * 100.0
    );
    let _ = writeln!(
        out,
        "# |error| ms: p50 {:.3}, p90 {:.3}, p99 {:.3}, max {:.3}",
        e.p50, e.p90, e.p99, e.max
    );
    let _ = writeln!(out, "[chunking.cost.{}]", toml_key(node));
    for (key, value) in COEFFICIENT_KEYS
        .into_iter()
        .zip(report.model.coefficients())
    {
        let _ = writeln!(out, "{key} = {}", toml_float(value));
    }
    out
}

/// A bare key when TOML allows one, else a quoted, escaped key.
fn toml_key(key: &str) -> String {
    let bare = !key.is_empty()
        && key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if bare {
        return key.to_owned();
    }
    // A basic string on one line: quotes, backslashes and control characters escaped.
    let mut out = String::with_capacity(key.len() + 2);
    out.push('"');
    for ch in key.chars() {
        match ch {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if c.is_control() => {
                let _ = write!(out, "\\u{:04X}", u32::from(c));
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// A float rounded to 6 significant digits, as a TOML float (`0.0624`, `3.5e-6`, `5.0`).
fn toml_float(v: f64) -> String {
    let rounded: f64 = format!("{v:.5e}").parse().unwrap_or(v);
    // `Debug` prints the shortest form that parses back, with a `.0` or an exponent: valid TOML.
    format!("{rounded:?}")
}

#[cfg(test)]
mod tests;
