//! The offline fit behind `mstar-chunking fit FILE` (`docs/fitting.md#offline`): reads a
//! replay step log or a CSV of step features, fits the latency model (`latency::fit::fit_samples`) and
//! renders it as a `[chunking.cost.<node>]` table ([`render_toml`]).
//!
//! Input is bounded (a regular file, [`MAX_FIT_FILE_BYTES`], [`MAX_FIT_LINE_BYTES`],
//! [`MAX_FIT_SAMPLES`]; read through the crate's one bounded input path, `src/input.rs`) and
//! every error names the file and the line.

use std::fmt::Write as _;
use std::io::{self, BufRead, BufReader, Read};
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::config::NoiseBand;
use mstar_chunking::input::{self, InputError};
use mstar_chunking::latency::fit::{fit_samples_with, FitError, FitErrors, FitReport, Sample};
use mstar_chunking::latency::{
    chunk_attention_pairs, LatencyModel, StepFeatures, COEFFICIENT_KEYS,
};

/// The most bytes [`fit_file`] reads from one file: a step log of several million steps.
pub const MAX_FIT_FILE_BYTES: u64 = 512 << 20;
/// The longest line [`fit_file`] reads: a step of several thousand rows.
pub const MAX_FIT_LINE_BYTES: u64 = 1 << 20;
/// The most steps [`fit_file`] keeps (each is kept for the error quantiles: 32 bytes a step).
pub const MAX_FIT_SAMPLES: usize = 4_000_000;

/// A file [`fit_file`] cannot fit. Each names the file, and the line where there is one.
#[derive(Debug, thiserror::Error)]
pub enum FitFileError {
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

    /// The steps are read but cannot be fitted (a bad value).
    #[error("{}: {source}", .path.display())]
    Fit {
        /// The file.
        path: PathBuf,
        /// Why.
        source: FitError,
    },
}

/// The kind of file [`read_samples_with`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FitInput {
    /// A replay step log (JSON Lines; the first non-blank byte is `{`).
    StepLog,
    /// A CSV with the header `tokens,kv_tokens,attention_pairs,ms` (any order; an optional
    /// `rows` column; other columns are ignored).
    Csv,
}

#[cfg(test)]
/// Reads and fits a step log or a CSV of step features: what `mstar-chunking fit FILE` runs.
///
/// # Errors
/// As [`read_samples_with`]; [`FitFileError::EmptyFile`] when the file holds no step.
pub fn fit_file(path: &Path) -> Result<(FitInput, FitReport), FitFileError> {
    fit_file_with(path, FitErrors::Absolute)
}

#[cfg(test)]
/// [`fit_file`], minimising `errors` (`fit --errors`).
///
/// # Errors
/// As [`fit_file`].
pub fn fit_file_with(
    path: &Path,
    errors: FitErrors,
) -> Result<(FitInput, FitReport), FitFileError> {
    fit_file_samples(path, errors).map(|(input, report, _)| (input, report))
}

/// Reads and fits a step log or a CSV of step features, minimising `errors` (`fit --errors`),
/// answering the samples fitted too (for [`noise_bands`]): what `mstar-chunking fit FILE` runs.
///
/// # Errors
/// As [`fit_file`].
pub fn fit_file_samples(
    path: &Path,
    errors: FitErrors,
) -> Result<(FitInput, FitReport, Vec<Sample>), FitFileError> {
    let (input, samples, lines) = read_samples_with(path, LIMITS)?;
    if samples.is_empty() {
        return Err(FitFileError::EmptyFile {
            path: path.to_owned(),
        });
    }
    let report = fit_samples_with(&samples, errors).map_err(|source| match source {
        // The sample that overflowed is named by its line.
        FitError::SumsOverflow { index } => bad_line(
            path,
            lines.get(index).copied().unwrap_or(0),
            source.to_string(),
        ),
        source => FitFileError::Fit {
            path: path.to_owned(),
            source,
        },
    })?;
    Ok((input, report, samples))
}

/// How many measured ÷ predicted ratios a band of `fit --for replay` holds: one a permille,
/// from the least (0) to the largest (1000). A replay draws between neighbouring quantiles, so
/// the top percent of its draws, which set a p99, must come from the top percent of the steps,
/// not from a straight line between the 99th percentile and the largest step.
pub const NOISE_RATIO_POINTS: usize = 1001;
/// The fewest steps a band of [`noise_bands`] holds: fewer would say little of a tail.
pub const MIN_BAND_STEPS: usize = 50;
/// The most bands [`noise_bands`] makes.
pub const MAX_FIT_BANDS: usize = 16;

/// Each step's price under `model` and its measured time over that price, ordered by price.
/// Steps measured or priced at 0 ms say nothing of a ratio and are left out.
fn priced_ratios(model: &LatencyModel, samples: &[Sample]) -> Vec<(f64, f64)> {
    let c = model.terms();
    let mut out: Vec<(f64, f64)> = samples
        .iter()
        .filter_map(|s| {
            let predicted = c[0]
                + c[1] * s.tokens
                + c[2] * s.kv_tokens
                + c[3] * s.attention_pairs
                + c[4] * s.rows;
            let r = s.ms / predicted;
            (s.ms > 0.0 && predicted > 0.0 && r.is_finite()).then_some((predicted, r))
        })
        .collect();
    out.sort_by(|a, b| a.0.total_cmp(&b.0));
    out
}

/// `points` (at least 2) evenly spaced quantiles (nearest rank) of `ratios` (at least one, in
/// any order), each rounded to 4 significant digits and held in the range the replay takes.
fn ratio_quantiles(mut ratios: Vec<f64>, points: usize) -> Vec<f64> {
    ratios.sort_by(f64::total_cmp);
    let n = ratios.len();
    let range = crate::replay::settings::NOISE_RATIO_RANGE;
    (0..points)
        .map(|i| {
            // The nearest rank ⌈n·i/(points − 1)⌉, in integers so that no rounding of the
            // quantile moves it.
            let rank = (i * n).div_ceil(points - 1).clamp(1, n);
            round_significant(ratios[rank - 1], 4).clamp(*range.start(), *range.end())
        })
        .collect()
}

/// Each step's measured time over the time `model` predicts for it, at `points` (at least 2)
/// evenly spaced quantiles from the least to the largest (nearest rank, 4 significant digits):
/// the engine's spread around the fitted line over every step. `None` when fewer than two steps
/// have a ratio (a step measured or priced at 0 ms has none).
pub fn noise_ratios(model: &LatencyModel, samples: &[Sample], points: usize) -> Option<Vec<f64>> {
    let priced = priced_ratios(model, samples);
    if priced.len() < 2 || points < 2 {
        return None;
    }
    Some(ratio_quantiles(
        priced.into_iter().map(|(_, r)| r).collect(),
        points,
    ))
}

/// The engine's spread around the fitted line by the price of a step, for a replay to draw
/// each step's noise from the steps priced like it (`replay.cost.noise_bands`): an engine's
/// short steps scatter by their hiccups (a page fault doubles a 10 ms step), its long ones by a
/// few percent, so one spread for all would stretch the long steps by the short ones' tail.
///
/// The steps, ordered by price, are cut into bands each priced from its first step up to twice
/// that (doubled again until the band holds [`MIN_BAND_STEPS`]); steps left over too few for a
/// band of their own, or past [`MAX_FIT_BANDS`], join the last band, which names no `up_to_ms`.
/// Each band holds [`NOISE_RATIO_POINTS`] quantiles of its steps' ratios. `None` when fewer
/// than two steps have a ratio.
pub fn noise_bands(model: &LatencyModel, samples: &[Sample]) -> Option<Vec<NoiseBand>> {
    let priced = priced_ratios(model, samples);
    let n = priced.len();
    if n < 2 {
        return None;
    }
    let mut bands = Vec::new();
    let mut start = 0;
    while start < n {
        let mut up_to = 2.0 * priced[start].0;
        let mut end = start + priced[start..].partition_point(|p| p.0 < up_to);
        while end - start < MIN_BAND_STEPS && end < n {
            up_to *= 2.0;
            end = start + priced[start..].partition_point(|p| p.0 < up_to);
        }
        // A bound rounded to 4 digits, then the band cut where the replay will cut it.
        let rounded = round_significant(up_to, 4);
        end = start + priced[start..].partition_point(|p| p.0 < rounded);
        let last = n - end < MIN_BAND_STEPS || bands.len() + 1 == MAX_FIT_BANDS || end == start;
        let end = if last { n } else { end };
        let ratios = priced[start..end].iter().map(|p| p.1).collect();
        bands.push(NoiseBand {
            up_to_ms: (!last).then_some(rounded),
            ratios: ratio_quantiles(ratios, NOISE_RATIO_POINTS),
        });
        start = end;
    }
    Some(bands)
}

/// `v` rounded to `digits` significant digits.
fn round_significant(v: f64, digits: usize) -> f64 {
    format!("{v:.*e}", digits.saturating_sub(1))
        .parse()
        .unwrap_or(v)
}

/// The limits a read runs under; the public functions use the documented constants.
#[derive(Debug, Clone, Copy)]
struct Limits {
    file_bytes: u64,
    line_bytes: u64,
    samples: usize,
}

impl Limits {
    /// The bytes the input reader lets through.
    fn input(self) -> input::Limits {
        input::Limits {
            file_bytes: self.file_bytes,
            line_bytes: self.line_bytes,
        }
    }
}

const LIMITS: Limits = Limits {
    file_bytes: MAX_FIT_FILE_BYTES,
    line_bytes: MAX_FIT_LINE_BYTES,
    samples: MAX_FIT_SAMPLES,
};

/// The samples, and the line (from 1) each was read from.
type SamplesRead = (FitInput, Vec<Sample>, Vec<u64>);

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
fn read_samples_with(path: &Path, limits: Limits) -> Result<SamplesRead, FitFileError> {
    // A second buffer over the bounded reader: the first byte is peeked to tell the kind.
    let mut reader = BufReader::new(
        input::open_bounded(path, limits.input()).map_err(|e| input_error(path, e))?,
    );
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
        None => Ok((FitInput::StepLog, Vec::new(), Vec::new())),
        Some(b'{') => {
            let (samples, lines) = read_step_log(path, reader, limits)?;
            Ok((FitInput::StepLog, samples, lines))
        }
        Some(_) => {
            let (samples, lines) = read_csv(path, reader, limits)?;
            Ok((FitInput::Csv, samples, lines))
        }
    }
}

/// Maps an I/O error of the bounded reader to the limit it hit, or to a plain I/O error.
fn limit_error(path: &Path, e: io::Error) -> FitFileError {
    input_error(path, InputError::from_io(e))
}

/// The fit's error for what the bounded input path refused.
fn input_error(path: &Path, e: InputError) -> FitFileError {
    let path = path.to_owned();
    match e {
        InputError::Io(source) => FitFileError::Io { path, source },
        InputError::NotRegular(_) => FitFileError::NotAFile { path },
        InputError::TooLarge { limit } => FitFileError::FileTooLarge { path, limit },
        InputError::LineTooLong { line, limit } => FitFileError::LineTooLong { path, line, limit },
        other @ InputError::NotUtf8(_) => FitFileError::Io {
            path,
            source: io::Error::other(other.to_string()),
        },
    }
}

fn bad_line(path: &Path, line: u64, message: impl Into<String>) -> FitFileError {
    FitFileError::BadLine {
        path: path.to_owned(),
        line,
        message: message.into(),
    }
}

fn too_many(path: &Path, limits: Limits) -> FitFileError {
    FitFileError::TooManySamples {
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
) -> Result<(Vec<Sample>, Vec<u64>), FitFileError> {
    let mut samples = Vec::new();
    let mut lines = Vec::new();
    let mut buf = Vec::new();
    let mut line = 0u64;
    loop {
        buf.clear();
        let n = reader
            .read_until(b'\n', &mut buf)
            .map_err(|e| limit_error(path, e))?;
        if n == 0 {
            return Ok((samples, lines));
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
        lines.push(line);
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
                f.rows = f.rows.saturating_add(1);
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
                f.rows = f.rows.saturating_add(1);
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
    /// Optional: the rows the step ran (0 when the column is absent, so `per_row_ms` is 0).
    #[serde(default)]
    rows: f64,
}

fn read_csv<R: Read>(
    path: &Path,
    reader: R,
    limits: Limits,
) -> Result<(Vec<Sample>, Vec<u64>), FitFileError> {
    let mut csv = csv::ReaderBuilder::new()
        .has_headers(true)
        .trim(csv::Trim::All)
        .from_reader(reader);
    let csv_err = |e: csv::Error| -> FitFileError {
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
    let mut lines = Vec::new();
    let mut record = csv::StringRecord::new();
    let header = header.clone();
    while csv.read_record(&mut record).map_err(csv_err)? {
        let line = record.position().map_or(0, csv::Position::line);
        let step: CsvStep = record
            .deserialize(Some(&header))
            .map_err(|e| bad_line(path, line, e.to_string()))?;
        for (key, value) in CSV_COLUMNS.into_iter().chain(["rows"]).zip([
            step.tokens,
            step.kv_tokens,
            step.attention_pairs,
            step.ms,
            step.rows,
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
            rows: step.rows,
            ms: step.ms,
        });
        lines.push(line);
    }
    Ok((samples, lines))
}

// === rendering ===

/// Renders a fit as a TOML snippet for the serving config: comment lines with its quality, then
/// `[chunking.cost.<node>]` and the four coefficients (6 significant digits), then `per_row_ms`
/// when the fit kept one. `source` names
/// what was fitted (a file name), in the comment only.
pub fn render_toml(report: &FitReport, node: &str, source: &str) -> String {
    let mut out = String::new();
    let r2 = match report.r_squared {
        _ if report.underdetermined() => "n/a (underdetermined)".to_owned(),
        None => "n/a".to_owned(),
        Some(r) => format!("{r:.4}"),
    };
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
    write_coefficients(&mut out, &report.model);
    out
}

/// The model's coefficients as TOML lines, `per_row_ms` only when the fit kept one.
fn write_coefficients(out: &mut String, model: &LatencyModel) {
    for (key, value) in COEFFICIENT_KEYS.into_iter().zip(model.coefficients()) {
        let _ = writeln!(out, "{key} = {}", toml_float(value));
    }
    if model.per_row_ms() > 0.0 {
        let _ = writeln!(out, "per_row_ms = {}", toml_float(model.per_row_ms()));
    }
}

/// Renders a fit as the `[replay.cost]` table of a replay config priced like the fitted steps:
/// the comment lines of [`render_toml`], the coefficients (`per_row_ms` when the fit kept one)
/// and the `noise_bands` of [`noise_bands`] (left out when `bands` is `None`).
pub fn render_replay_toml(report: &FitReport, bands: Option<&[NoiseBand]>, source: &str) -> String {
    let serving = render_toml(report, "", source);
    let mut out: String = serving
        .lines()
        .take_while(|l| l.starts_with('#'))
        .map(|l| format!("{l}\n"))
        .collect();
    out.push_str("[replay.cost]\n");
    write_coefficients(&mut out, &report.model);
    let Some(bands) = bands else { return out };
    let _ = writeln!(
        out,
        "# each step's time is drawn from the measured ÷ predicted ratios of the fitted steps priced like it: {}, each of {} quantiles from the least to the largest",
        if bands.len() == 1 { "one band".to_owned() } else { format!("{} bands of price", bands.len()) },
        NOISE_RATIO_POINTS
    );
    for band in bands {
        out.push_str("[[replay.cost.noise_bands]]\n");
        if let Some(up) = band.up_to_ms {
            let _ = writeln!(out, "up_to_ms = {}", toml_float(up));
        }
        let list: Vec<String> = band.ratios.iter().map(|&r| toml_float(r)).collect();
        let _ = writeln!(out, "ratios = [{}]", list.join(", "));
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
