//! Request traces: the public Azure LLM inference CSV and Mooncake JSON Lines formats.
//!
//! A trace is read whole before the replay starts, so a bad line is reported before any step
//! runs. Every value is checked; a bad line is an error naming the file, the line and the field,
//! or (with `skip_bad_lines`) counted and left out. No input makes the reader panic.

use std::fmt;
use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::ops::Range;
use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::arrivals::Arrivals;
use super::formats::{self, FormatError, InputFormat, Records};

/// The bundled default trace: Azure LLM inference trace 2023, code (CC BY 4.0, Microsoft; see
/// `data/traces/AzureLLMInferenceTrace_code.csv.LICENSE.txt`). Its prompts are long enough that
/// chunking is visible under the demo budgets.
pub const BUNDLED_TRACE: &str = include_str!("../../data/traces/AzureLLMInferenceTrace_code.csv");

/// The name the bundled trace is reported under.
pub const BUNDLED_TRACE_NAME: &str = "bundled:AzureLLMInferenceTrace_code.csv";

/// Tokens one Mooncake `hash_ids` entry covers.
pub const HASH_BLOCK_TOKENS: u32 = 512;

/// The longest prompt replay materialises: its prepared input is really allocated, so a corrupt
/// count must not ask for gigabytes.
pub const MAX_INPUT_TOKENS: u64 = 1 << 24;

/// The most tokens one request may generate: each takes a simulated step, so a corrupt count must
/// not make a replay run for ever.
pub const MAX_OUTPUT_TOKENS: u64 = 1 << 20;

/// Bad lines kept verbatim (as messages) for the report when they are skipped.
const BAD_LINE_EXAMPLES: usize = 10;
/// The largest trace file read, in bytes (4 GiB): reading streams, but a bigger file is taken
/// for a mistake (`docs/config.md#limits`).
pub const MAX_TRACE_BYTES: u64 = 4 << 30;
/// The longest trace line (or CSV record), in bytes (1 MiB: a Mooncake line of the largest
/// prompt's 32,768 block hashes fits).
pub const MAX_LINE_BYTES: usize = 1 << 20;

/// `v` quoted, escaped and cut, for echoing a trace value in an error.
fn shown(v: &str) -> String {
    crate::config::problem::quote(v)
}

/// A JSON value as written, cut, for echoing it in an error.
fn shown_json(v: &Value) -> String {
    crate::config::problem::escape(&v.to_string())
}

/// A trace file format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TraceFormat {
    /// `TIMESTAMP, ContextTokens, GeneratedTokens`, wall-clock timestamps.
    AzureCsv,
    /// `{"timestamp" (ms), "input_length", "output_length", "hash_ids"}` per line.
    MooncakeJsonl,
    /// `arrival_ms,prompt_tokens,output_tokens[,hash_ids]` (read by [`super::formats`]).
    GenericCsv,
    /// `num_prefill_tokens,num_decode_tokens`, with generated arrivals (read by
    /// [`super::formats`]).
    LengthsCsv,
}

impl From<InputFormat> for TraceFormat {
    fn from(f: InputFormat) -> Self {
        match f {
            InputFormat::AzureCsv => Self::AzureCsv,
            InputFormat::MooncakeJsonl => Self::MooncakeJsonl,
            InputFormat::GenericCsv => Self::GenericCsv,
            InputFormat::LengthsCsv => Self::LengthsCsv,
        }
    }
}

impl From<TraceFormat> for InputFormat {
    fn from(f: TraceFormat) -> Self {
        match f {
            TraceFormat::AzureCsv => Self::AzureCsv,
            TraceFormat::MooncakeJsonl => Self::MooncakeJsonl,
            TraceFormat::GenericCsv => Self::GenericCsv,
            TraceFormat::LengthsCsv => Self::LengthsCsv,
        }
    }
}

impl TraceFormat {
    /// The format of `path`, by its extension: `.csv` or `.jsonl`.
    pub fn of_path(path: &Path) -> Option<Self> {
        match path.extension()?.to_str()?.to_ascii_lowercase().as_str() {
            "csv" => Some(Self::AzureCsv),
            "jsonl" => Some(Self::MooncakeJsonl),
            _ => None,
        }
    }
}

impl fmt::Display for TraceFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::AzureCsv => "Azure CSV",
            Self::MooncakeJsonl => "Mooncake JSON Lines",
            Self::GenericCsv => "generic CSV",
            Self::LengthsCsv => "length-only CSV",
        })
    }
}

/// One request of a trace.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    /// The request's 0-based position among the trace's records (bad ones included), so a step
    /// log reads against the trace record by record.
    pub rid: u64,
    /// Arrival, in ms since the trace's first request.
    pub arrival_ms: f64,
    /// Prompt tokens (at least 1).
    pub input_tokens: u32,
    /// Generated tokens, as the trace says (0 is replayed as 1: a prompt's final chunk always
    /// yields a token).
    pub output_tokens: u32,
    /// The request's block hashes in [`Trace::hashes`]' pool (empty for Azure traces).
    hashes: Range<usize>,
}

/// A line of a trace that was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{file}:{line}: `{field}` {problem}")]
pub struct BadLine {
    /// The trace file.
    pub file: String,
    /// 1-based line number.
    pub line: u64,
    /// The field that was wrong, or `line` for the whole line.
    pub field: String,
    /// What was wrong.
    pub problem: String,
}

/// Why a trace could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// The file cannot be opened or read (or is not a regular file, or is too large).
    #[error("cannot read trace `{file}`: {source}")]
    Io {
        /// The trace file.
        file: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Neither `.csv` nor `.jsonl`.
    #[error(
        "trace `{file}`: unknown format; expected a `.csv` (Azure) or `.jsonl` (Mooncake) file"
    )]
    UnknownFormat {
        /// The trace file.
        file: String,
    },
    /// A bad line (without `--skip-bad-lines`).
    #[error("bad trace line: {0}")]
    BadLine(#[from] BadLine),
    /// A trace of the generic or length-only format could not be read, or `--format` and
    /// `--arrivals` do not fit the trace.
    #[error(transparent)]
    Format(#[from] FormatError),
    /// `--format` or `--arrivals` was given without `--trace`: the bundled trace is an Azure
    /// CSV with its own arrival times.
    #[error("{flag} applies to a trace given with `--trace`; the bundled trace is an Azure CSV with its own arrival times")]
    Bundled {
        /// The flag given.
        flag: &'static str,
    },
    /// No request was read.
    #[error("trace `{file}` has no requests{}", if *.skipped > 0 { format!(" ({} skipped)", super::report::plural(*.skipped as u64, "bad line")) } else { String::new() })]
    Empty {
        /// The trace file.
        file: String,
        /// Bad lines skipped.
        skipped: usize,
    },
}

/// How to read a trace.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReadOptions {
    /// Read only the first `limit` requests.
    pub limit: Option<usize>,
    /// Count and leave out bad lines instead of failing on the first.
    pub skip_bad_lines: bool,
}

/// A whole trace, in arrival order.
#[derive(Debug, Clone, PartialEq)]
pub struct Trace {
    /// The file it was read from (or the bundled trace's name).
    pub file: String,
    /// Its format.
    pub format: TraceFormat,
    /// The requests, in arrival order.
    pub requests: Vec<Request>,
    /// Bad lines left out (with `skip_bad_lines`).
    pub skipped_lines: usize,
    /// The first few bad lines left out, as messages.
    pub bad_line_examples: Vec<String>,
    /// Every request's block hashes, back to back (one allocation for the whole trace).
    hash_pool: Vec<u64>,
}

impl Trace {
    /// The Mooncake block hashes of `request`, one per 512 prompt tokens (empty for Azure).
    pub fn hashes(&self, request: &Request) -> &[u64] {
        self.hash_pool.get(request.hashes.clone()).unwrap_or(&[])
    }

    /// Whether the trace carries block hashes (Mooncake) at all.
    pub fn has_hashes(&self) -> bool {
        !self.hash_pool.is_empty()
    }

    /// Reads the trace at `path`; its format comes from the extension.
    ///
    /// # Errors
    /// The file cannot be read, has an unknown extension, a bad line (unless skipped), or no
    /// requests.
    pub fn read_path(path: &Path, opts: ReadOptions) -> Result<Self, TraceError> {
        let file = crate::config::problem::escape(&path.display().to_string());
        let format = TraceFormat::of_path(path)
            .ok_or_else(|| TraceError::UnknownFormat { file: file.clone() })?;
        let f = open_trace(path).map_err(|source| TraceError::Io {
            file: file.clone(),
            source,
        })?;
        Self::read(file, format, BufReader::new(f), opts)
    }

    /// Reads the trace at `path` in any format (`docs/replay.md#trace-formats`): `forced`
    /// (`--format`) or the format its header or extension says; a length-only trace's arrivals
    /// are generated from `arrivals` and `seed`, which any other format refuses.
    ///
    /// # Errors
    /// The format cannot be told; arrivals missing for a length-only trace or given for one
    /// with its own times; the file cannot be read, has a bad line (unless skipped), or no
    /// requests.
    pub fn load(
        path: &Path,
        forced: Option<InputFormat>,
        arrivals: Option<&Arrivals>,
        seed: u64,
        opts: ReadOptions,
    ) -> Result<Self, TraceError> {
        let format = formats::choose_format(path, forced)?;
        let file = crate::config::problem::escape(&path.display().to_string());
        match (format, arrivals) {
            (InputFormat::AzureCsv | InputFormat::MooncakeJsonl, Some(_)) => {
                Err(FormatError::HasArrivals { file, format }.into())
            }
            (InputFormat::AzureCsv | InputFormat::MooncakeJsonl, None) => {
                let f = open_trace(path).map_err(|source| TraceError::Io {
                    file: file.clone(),
                    source,
                })?;
                Self::read(file, format.into(), BufReader::new(f), opts)
            }
            (InputFormat::GenericCsv | InputFormat::LengthsCsv, _) => {
                let read = formats::ReadOptions {
                    limit: opts.limit,
                    skip_bad_lines: opts.skip_bad_lines,
                };
                let records = formats::read_path(path, format, arrivals, seed, read)?;
                Ok(Self::from_records(records))
            }
        }
    }

    /// The trace of records read by [`super::formats`]: requests numbered from 0 in the
    /// records' order, arrivals counted from the first, block hashes kept.
    pub fn from_records(records: Records) -> Self {
        let first = records.records.first().map_or(0.0, |r| r.arrival_ms);
        let mut hash_pool = Vec::new();
        let requests = records
            .records
            .into_iter()
            .enumerate()
            .map(|(i, r)| {
                let start = hash_pool.len();
                hash_pool.extend_from_slice(&r.hash_ids);
                Request {
                    rid: i as u64,
                    arrival_ms: (r.arrival_ms - first).max(0.0),
                    input_tokens: r.prompt_tokens,
                    output_tokens: r.output_tokens,
                    hashes: start..hash_pool.len(),
                }
            })
            .collect();
        Self {
            file: records.file,
            format: records.format.into(),
            requests,
            skipped_lines: records.skipped_lines,
            bad_line_examples: records.bad_line_examples,
            hash_pool,
        }
    }

    /// Reads the bundled trace.
    ///
    /// # Errors
    /// None in practice (the bundled trace is valid); the signature is the reader's.
    pub fn bundled(opts: ReadOptions) -> Result<Self, TraceError> {
        Self::read(
            BUNDLED_TRACE_NAME.to_owned(),
            TraceFormat::AzureCsv,
            BUNDLED_TRACE.as_bytes(),
            opts,
        )
    }

    /// Reads a trace of `format` from `reader`; `file` names it in errors.
    ///
    /// # Errors
    /// An I/O error, a bad line (unless skipped), or no requests.
    pub fn read<R: BufRead>(
        file: String,
        format: TraceFormat,
        reader: R,
        opts: ReadOptions,
    ) -> Result<Self, TraceError> {
        let mut b = Builder {
            trace: Trace {
                file,
                format,
                requests: Vec::new(),
                skipped_lines: 0,
                bad_line_examples: Vec::new(),
                hash_pool: Vec::new(),
            },
            opts,
            first_ns: None,
            first_ms: None,
            last_ms: 0.0,
        };
        match format {
            TraceFormat::AzureCsv => read_azure(&mut b, reader)?,
            TraceFormat::MooncakeJsonl => read_mooncake(&mut b, reader)?,
            TraceFormat::GenericCsv => {
                let read = formats::ReadOptions {
                    limit: opts.limit,
                    skip_bad_lines: opts.skip_bad_lines,
                };
                let records = formats::read_generic_csv(b.trace.file, reader, read)?;
                return Ok(Self::from_records(records));
            }
            TraceFormat::LengthsCsv => {
                return Err(FormatError::NeedsArrivals { file: b.trace.file }.into());
            }
        }
        if b.trace.requests.is_empty() {
            return Err(TraceError::Empty {
                file: b.trace.file,
                skipped: b.trace.skipped_lines,
            });
        }
        Ok(b.trace)
    }
}

/// Opens a trace: a regular file (a FIFO would block, a device never ends) of at most
/// [`MAX_TRACE_BYTES`].
fn open_trace(path: &Path) -> std::io::Result<File> {
    use crate::config::InputError;
    let f = crate::config::input::open_regular(path).map_err(|e| match e {
        InputError::Io(e) => e,
        other => std::io::Error::other(other.to_string()),
    })?;
    if f.metadata()?.len() > MAX_TRACE_BYTES {
        return Err(std::io::Error::other(format!(
            "is larger than the limit of {MAX_TRACE_BYTES} bytes (docs/config.md#limits)"
        )));
    }
    Ok(f)
}

/// A line's values, checked field by field, before they become a [`Request`].
struct Line<'a> {
    rid: u64,
    line: u64,
    /// Azure: ns since the epoch; Mooncake: ms.
    time: Time,
    input: u64,
    output: u64,
    hashes: &'a [u64],
}

enum Time {
    WallNs(i64),
    Ms(f64),
    /// A Mooncake timestamp written as a whole number of ms.
    MsWhole(u64),
}

struct Builder {
    trace: Trace,
    opts: ReadOptions,
    /// The first Azure timestamp, ns since the epoch: arrivals count from it.
    first_ns: Option<i64>,
    /// The first Mooncake timestamp, ms, whole and as written: arrivals count from it.
    first_ms: Option<(i128, f64)>,
    last_ms: f64,
}

impl Builder {
    /// The first Mooncake timestamp, set by the first line to ask.
    fn first_mooncake_ms(&mut self, whole: i128, ms: f64) -> (i128, f64) {
        *self.first_ms.get_or_insert((whole, ms))
    }

    fn full(&self) -> bool {
        self.opts
            .limit
            .is_some_and(|n| self.trace.requests.len() >= n)
    }

    fn bad(&self, line: u64, field: &str, problem: impl Into<String>) -> BadLine {
        BadLine {
            file: self.trace.file.clone(),
            line,
            field: field.to_owned(),
            problem: problem.into(),
        }
    }

    /// Skips `bad` when bad lines are skipped, else fails with it.
    fn refuse(&mut self, bad: BadLine) -> Result<(), TraceError> {
        if !self.opts.skip_bad_lines {
            return Err(bad.into());
        }
        self.trace.skipped_lines += 1;
        if self.trace.bad_line_examples.len() < BAD_LINE_EXAMPLES {
            self.trace.bad_line_examples.push(bad.to_string());
        }
        Ok(())
    }

    /// Checks a parsed line against the rules every format shares and keeps it.
    fn push(&mut self, l: Line<'_>, fields: [&str; 3]) -> Result<(), BadLine> {
        let [time_field, input_field, output_field] = fields;
        if l.input == 0 || l.input > MAX_INPUT_TOKENS {
            return Err(self.bad(
                l.line,
                input_field,
                format!(
                    "must be between 1 and {MAX_INPUT_TOKENS} tokens, got {}",
                    l.input
                ),
            ));
        }
        if l.output > MAX_OUTPUT_TOKENS {
            return Err(self.bad(
                l.line,
                output_field,
                format!(
                    "must be at most {MAX_OUTPUT_TOKENS} tokens, got {}",
                    l.output
                ),
            ));
        }
        let arrival_ms = match l.time {
            // Relative to the first request, as Azure's: epoch timestamps start at 0 too.
            Time::Ms(ms) => ms - self.first_mooncake_ms(i128::from(ms as u64), ms).1,
            Time::MsWhole(n) => {
                let (first, _) = self.first_mooncake_ms(i128::from(n), n as f64);
                (i128::from(n) - first) as f64
            }
            Time::WallNs(ns) => {
                let first = *self.first_ns.get_or_insert(ns);
                // i128: two far-apart valid dates cannot overflow the difference.
                (i128::from(ns) - i128::from(first)) as f64 / 1e6
            }
        };
        if !self.trace.requests.is_empty() && arrival_ms < self.last_ms {
            return Err(self.bad(
                l.line,
                time_field,
                format!(
                    "goes back in time: {arrival_ms} ms after the first request, the line before was at {} ms",
                    self.last_ms
                ),
            ));
        }
        let blocks = l.input.div_ceil(u64::from(HASH_BLOCK_TOKENS));
        if !l.hashes.is_empty() && l.hashes.len() as u64 != blocks {
            return Err(self.bad(
                l.line,
                "hash_ids",
                format!(
                    "has {} ids, but input_length {} needs ceil({}/{HASH_BLOCK_TOKENS}) = {blocks}",
                    l.hashes.len(),
                    l.input,
                    l.input
                ),
            ));
        }
        self.last_ms = arrival_ms;
        let start = self.trace.hash_pool.len();
        self.trace.hash_pool.extend_from_slice(l.hashes);
        // Both counts were checked against limits far below u32::MAX.
        self.trace.requests.push(Request {
            rid: l.rid,
            arrival_ms,
            input_tokens: l.input as u32,
            output_tokens: l.output as u32,
            hashes: start..self.trace.hash_pool.len(),
        });
        Ok(())
    }
}

const AZURE_FIELDS: [&str; 3] = ["TIMESTAMP", "ContextTokens", "GeneratedTokens"];

/// A reader that fails once a line grows beyond `max` bytes, so that a CSV record without line
/// breaks cannot grow the CSV reader's buffer without bound.
struct LineLimited<R> {
    inner: R,
    max: usize,
    /// Bytes since the last newline, and lines started so far (1-based).
    run: usize,
    line: u64,
}

impl<R: Read> Read for LineLimited<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        for &c in &buf[..n] {
            if c == b'\n' {
                self.run = 0;
                self.line += 1;
            } else {
                self.run += 1;
                if self.run > self.max {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        format!("line {} is longer than {} bytes", self.line, self.max),
                    ));
                }
            }
        }
        Ok(n)
    }
}

fn read_azure<R: Read>(b: &mut Builder, reader: R) -> Result<(), TraceError> {
    let reader = LineLimited {
        inner: reader,
        max: MAX_LINE_BYTES,
        run: 0,
        line: 1,
    };
    let mut rdr = csv::ReaderBuilder::new()
        .has_headers(true)
        .flexible(true)
        .trim(csv::Trim::All)
        .from_reader(reader);
    let headers = match rdr.headers() {
        Ok(h) => h.clone(),
        Err(e) => return Err(csv_error(b, e, 1)),
    };
    let mut cols = [0usize; 3];
    for (col, name) in cols.iter_mut().zip(AZURE_FIELDS) {
        *col = headers
            .iter()
            .position(|h| h.trim_start_matches('\u{feff}').eq_ignore_ascii_case(name))
            .ok_or_else(|| {
                b.bad(
                    1,
                    name,
                    format!(
                        "column is missing from the header (found {}); an Azure trace has TIMESTAMP, ContextTokens, GeneratedTokens",
                        shown(&headers.iter().collect::<Vec<_>>().join(","))
                    ),
                )
            })?;
    }
    let mut record = csv::StringRecord::new();
    let mut rid: u64 = 0;
    let mut line: u64 = 1;
    while !b.full() {
        match rdr.read_record(&mut record) {
            Ok(false) => break,
            Ok(true) => {
                line = record.position().map_or(line + 1, csv::Position::line);
                let parsed = if record.as_slice().len() > MAX_LINE_BYTES {
                    Err(b.bad(
                        line,
                        "line",
                        format!("is longer than {MAX_LINE_BYTES} bytes"),
                    ))
                } else {
                    parse_azure(b, &record, cols, rid, line)
                };
                rid += 1;
                if let Err(bad) = parsed.and_then(|l| b.push(l, AZURE_FIELDS)) {
                    b.refuse(bad)?;
                }
            }
            Err(e) => {
                let fatal = matches!(e.kind(), csv::ErrorKind::Io(_));
                let err = csv_error(b, e, line + 1);
                rid += 1;
                match err {
                    TraceError::BadLine(bad) if !fatal => {
                        line = bad.line;
                        b.refuse(bad)?;
                    }
                    other => return Err(other),
                }
            }
        }
    }
    Ok(())
}

fn csv_error(b: &Builder, e: csv::Error, fallback_line: u64) -> TraceError {
    let line = e.position().map_or(fallback_line, csv::Position::line);
    let problem = match e.into_kind() {
        csv::ErrorKind::Io(source) => {
            return TraceError::Io {
                file: b.trace.file.clone(),
                source,
            }
        }
        csv::ErrorKind::Utf8 { err, .. } => format!(
            "is not a valid CSV record: invalid UTF-8 in field {}",
            err.field() + 1
        ),
        other => format!("is not a valid CSV record: {other:?}"),
    };
    TraceError::BadLine(b.bad(line, "line", problem))
}

fn parse_azure<'a>(
    b: &Builder,
    r: &csv::StringRecord,
    cols: [usize; 3],
    rid: u64,
    line: u64,
) -> Result<Line<'a>, BadLine> {
    let field = |i: usize| -> Result<&str, BadLine> {
        r.get(cols[i])
            .filter(|v| !v.is_empty())
            .ok_or_else(|| b.bad(line, AZURE_FIELDS[i], "is missing"))
    };
    let ts = field(0)?;
    let ns = parse_wall_clock(ts).map_err(|why| {
        b.bad(
            line,
            AZURE_FIELDS[0],
            format!(
                "{why}, got {} (expected e.g. \"2023-11-16 18:17:03.9799600\")",
                shown(ts)
            ),
        )
    })?;
    let count = |i: usize| -> Result<u64, BadLine> {
        let v = field(i)?;
        v.parse::<u64>().map_err(|_| {
            b.bad(
                line,
                AZURE_FIELDS[i],
                format!("must be a whole number of tokens, got {}", shown(v)),
            )
        })
    };
    Ok(Line {
        rid,
        line,
        time: Time::WallNs(ns),
        input: count(1)?,
        output: count(2)?,
        hashes: &[],
    })
}

/// Parses `YYYY-MM-DD HH:MM:SS[.fffffffff]` (a `T` may separate date and time) into ns since the
/// Unix epoch. The Azure traces carry 7 fractional digits; any 0 to 9 are accepted.
pub fn parse_wall_clock(s: &str) -> Result<i64, &'static str> {
    let (date, time) = s
        .split_once([' ', 'T'])
        .ok_or("has no space between date and time")?;
    let mut d = date.split('-');
    let (Some(y), Some(mo), Some(day), None) = (d.next(), d.next(), d.next(), d.next()) else {
        return Err("has no YYYY-MM-DD date");
    };
    let (hms, frac) = time.split_once('.').unwrap_or((time, ""));
    let mut t = hms.split(':');
    let (Some(h), Some(mi), Some(sec), None) = (t.next(), t.next(), t.next(), t.next()) else {
        return Err("has no HH:MM:SS time");
    };
    let num = |v: &str, max: u32, what: &'static str| -> Result<u32, &'static str> {
        if v.is_empty() || v.len() > 4 || !v.bytes().all(|c| c.is_ascii_digit()) {
            return Err(what);
        }
        v.parse::<u32>().ok().filter(|n| *n <= max).ok_or(what)
    };
    let y = num(y, 9999, "has a bad year")?;
    let mo = num(mo, 12, "has a bad month")?;
    let day = num(day, 31, "has a bad day")?;
    let h = num(h, 23, "has a bad hour")?;
    let mi = num(mi, 59, "has a bad minute")?;
    let sec = num(sec, 59, "has bad seconds")?;
    if mo == 0 || day == 0 || day > days_in_month(y, mo) {
        return Err("is not a calendar date");
    }
    if frac.len() > 9 || !frac.bytes().all(|c| c.is_ascii_digit()) {
        return Err("has a bad fraction of a second (at most 9 digits)");
    }
    let mut frac_ns: i64 = 0;
    for (i, c) in frac.bytes().enumerate() {
        frac_ns += i64::from(c - b'0') * 10i64.pow(8 - i as u32);
    }
    let days = days_from_civil(i64::from(y), mo, day);
    // Checked: i64 nanoseconds reach from 1677-09-21 to 2262-04-11.
    days.checked_mul(86_400)
        .and_then(|s| s.checked_add(i64::from(h * 3600 + mi * 60 + sec)))
        .and_then(|s| s.checked_mul(1_000_000_000))
        .and_then(|ns| ns.checked_add(frac_ns))
        .ok_or("is outside the supported range 1677-09-22 to 2262-04-11 (docs/config.md#traces)")
}

fn days_in_month(y: u32, m: u32) -> u32 {
    match m {
        2 if (y.is_multiple_of(4) && !y.is_multiple_of(100)) || y.is_multiple_of(400) => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's `days_from_civil`).
fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let m = i64::from(m);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

const MOONCAKE_FIELDS: [&str; 3] = ["timestamp", "input_length", "output_length"];

/// One Mooncake line, every field loosely typed so that a bad value is reported by field name.
#[derive(Deserialize)]
struct MooncakeLine {
    timestamp: Option<Value>,
    input_length: Option<Value>,
    output_length: Option<Value>,
    hash_ids: Option<Value>,
}

/// Reads one line into `buf` (without its newline), keeping at most `max` bytes and skipping
/// the rest. `None` at the end; `Some(true)` when the line was longer than `max`.
fn read_line_bounded<R: BufRead>(
    reader: &mut R,
    buf: &mut Vec<u8>,
    max: usize,
) -> std::io::Result<Option<bool>> {
    buf.clear();
    let (mut read_any, mut too_long) = (false, false);
    loop {
        let chunk = match reader.fill_buf() {
            Ok(c) => c,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if chunk.is_empty() {
            return Ok(read_any.then_some(too_long));
        }
        read_any = true;
        let (part, done) = match chunk.iter().position(|&c| c == b'\n') {
            Some(i) => (&chunk[..i], Some(i + 1)),
            None => (chunk, None),
        };
        let room = max.saturating_sub(buf.len());
        if part.len() > room {
            too_long = true;
        }
        buf.extend_from_slice(&part[..part.len().min(room)]);
        let used = done.unwrap_or(chunk.len());
        reader.consume(used);
        if done.is_some() {
            return Ok(Some(too_long));
        }
    }
}

fn read_mooncake<R: BufRead>(b: &mut Builder, mut reader: R) -> Result<(), TraceError> {
    let mut bytes: Vec<u8> = Vec::new();
    let mut hashes: Vec<u64> = Vec::new();
    let mut line: u64 = 0;
    let mut rid: u64 = 0;
    while !b.full() {
        let read =
            read_line_bounded(&mut reader, &mut bytes, MAX_LINE_BYTES).map_err(|source| {
                TraceError::Io {
                    file: b.trace.file.clone(),
                    source,
                }
            })?;
        let Some(too_long) = read else { break };
        line += 1;
        let text = match std::str::from_utf8(&bytes) {
            Ok(t) if !too_long => t,
            _ => {
                let problem = if too_long {
                    format!("is longer than {MAX_LINE_BYTES} bytes")
                } else {
                    "is not UTF-8 text".to_string()
                };
                rid += 1;
                let bad = b.bad(line, "line", problem);
                b.refuse(bad)?;
                continue;
            }
        };
        if text.trim().is_empty() {
            continue;
        }
        let parsed = parse_mooncake(b, text, line, &mut hashes);
        rid += 1;
        let result = parsed.and_then(|(time, input, output)| {
            b.push(
                Line {
                    rid: rid - 1,
                    line,
                    time,
                    input,
                    output,
                    hashes: &hashes,
                },
                MOONCAKE_FIELDS,
            )
        });
        if let Err(bad) = result {
            b.refuse(bad)?;
        }
    }
    Ok(())
}

fn parse_mooncake(
    b: &Builder,
    text: &str,
    line: u64,
    hashes: &mut Vec<u64>,
) -> Result<(Time, u64, u64), BadLine> {
    let v: MooncakeLine = serde_json::from_str(text)
        .map_err(|e| b.bad(line, "line", format!("is not a Mooncake JSON object: {e}")))?;
    let missing = |f: &str| b.bad(line, f, "is missing");
    let time = v.timestamp.ok_or_else(|| missing("timestamp"))?;
    // Whole numbers stay exact (epoch nanoseconds exceed what an f64 holds exactly); arrivals
    // are taken relative to the first request before they become floating point.
    let time = match time.as_u64() {
        Some(n) => Time::MsWhole(n),
        None => Time::Ms(
            time.as_f64()
                .filter(|t| t.is_finite() && *t >= 0.0)
                .ok_or_else(|| {
                    b.bad(
                        line,
                        "timestamp",
                        format!(
                            "must be a non-negative number of ms, got {}",
                            shown_json(&time)
                        ),
                    )
                })?,
        ),
    };
    let count = |f: &str, n: Option<Value>| -> Result<u64, BadLine> {
        let n = n.ok_or_else(|| missing(f))?;
        n.as_u64().ok_or_else(|| {
            b.bad(
                line,
                f,
                format!("must be a whole number of tokens, got {}", shown_json(&n)),
            )
        })
    };
    let input = count("input_length", v.input_length)?;
    let output = count("output_length", v.output_length)?;
    hashes.clear();
    let ids = v.hash_ids.ok_or_else(|| missing("hash_ids"))?;
    let ids = ids.as_array().ok_or_else(|| {
        b.bad(
            line,
            "hash_ids",
            format!("must be a list of block hashes, got {}", shown_json(&ids)),
        )
    })?;
    for (i, h) in ids.iter().enumerate() {
        let h = h.as_u64().ok_or_else(|| {
            b.bad(
                line,
                "hash_ids",
                format!(
                    "entry {i} must be a non-negative whole number, got {}",
                    shown_json(h)
                ),
            )
        })?;
        hashes.push(h);
    }
    if hashes.is_empty() {
        // An empty list cannot match ceil(input_length / 512) >= 1.
        return Err(b.bad(
            line,
            "hash_ids",
            format!(
                "is empty, but input_length {input} needs ceil({input}/{HASH_BLOCK_TOKENS}) ids"
            ),
        ));
    }
    Ok((time, input, output))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_become_a_trace_numbered_from_zero_with_their_hashes() {
        use crate::replay::formats::TraceRecord;
        let rec = |line, arrival_ms, prompt_tokens, hash_ids: Vec<u64>| TraceRecord {
            line,
            arrival_ms,
            prompt_tokens,
            output_tokens: 3,
            hash_ids,
        };
        let t = Trace::from_records(Records {
            file: "t.csv".into(),
            format: InputFormat::GenericCsv,
            records: vec![rec(2, 100.0, 600, vec![7, 8]), rec(5, 150.5, 10, vec![])],
            skipped_lines: 2,
            bad_line_examples: vec!["bad".into()],
        });
        assert_eq!(t.format, TraceFormat::GenericCsv);
        assert_eq!(t.format.to_string(), "generic CSV");
        assert_eq!(
            t.requests
                .iter()
                .map(|r| (r.rid, r.arrival_ms))
                .collect::<Vec<_>>(),
            [(0, 0.0), (1, 50.5)]
        );
        assert_eq!(t.hashes(&t.requests[0]), [7, 8]);
        assert!(t.hashes(&t.requests[1]).is_empty());
        assert!(t.has_hashes());
        assert_eq!((t.skipped_lines, t.bad_line_examples.len()), (2, 1));
        // The Azure reader refuses a length-only file forced on it without arrivals.
        let e = Trace::read(
            "x".into(),
            TraceFormat::LengthsCsv,
            &b"num_prefill_tokens,num_decode_tokens\n5,1\n"[..],
            ReadOptions::default(),
        )
        .unwrap_err();
        assert!(
            matches!(e, TraceError::Format(FormatError::NeedsArrivals { .. })),
            "{e}"
        );
    }

    #[test]
    fn a_csv_line_beyond_the_limit_stops_the_read_naming_its_line() {
        let text = format!(
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.0,10,2\n2023-11-16 18:17:04.0,{},2\n",
            "9".repeat(MAX_LINE_BYTES)
        );
        let e = Trace::read(
            "t.csv".into(),
            TraceFormat::AzureCsv,
            text.as_bytes(),
            ReadOptions::default(),
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            format!("cannot read trace `t.csv`: line 3 is longer than {MAX_LINE_BYTES} bytes")
        );
    }

    #[test]
    fn a_mooncake_line_beyond_the_limit_is_a_bad_line() {
        let text = format!(
            "{{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 2, \"hash_ids\": [1]}}\n{}\n{{\"timestamp\": 1, \"input_length\": 10, \"output_length\": 2, \"hash_ids\": [2]}}\n",
            " ".repeat(MAX_LINE_BYTES + 1)
        );
        let opts = ReadOptions {
            limit: None,
            skip_bad_lines: true,
        };
        let t = Trace::read(
            "t.jsonl".into(),
            TraceFormat::MooncakeJsonl,
            text.as_bytes(),
            opts,
        )
        .unwrap();
        assert_eq!((t.requests.len(), t.skipped_lines), (2, 1));
        assert_eq!(
            t.bad_line_examples,
            [format!(
                "t.jsonl:2: `line` is longer than {MAX_LINE_BYTES} bytes"
            )]
        );
    }

    #[test]
    fn wall_clock_timestamps_parse_to_ns() {
        let a = parse_wall_clock("2023-11-16 18:17:03.9799600").unwrap();
        let b = parse_wall_clock("2023-11-16 18:17:04.0319600").unwrap();
        assert_eq!(b - a, 52_000_000);
        assert_eq!(parse_wall_clock("1970-01-01 00:00:00").unwrap(), 0);
        assert_eq!(
            parse_wall_clock("2023-11-17 00:00:00.5").unwrap()
                - parse_wall_clock("2023-11-16 23:59:59.5").unwrap(),
            1_000_000_000
        );
        for bad in [
            "2023-11-16",
            "2023-13-01 00:00:00",
            "2023-02-29 00:00:00",
            "2023-11-16 24:00:00",
            "2023-11-16 18:17:03.1234567890",
            "2023-11-16 18:17:-3",
            "x-y-z 1:2:3",
        ] {
            assert!(parse_wall_clock(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn csv_with_bom_crlf_and_reordered_columns_reads() {
        let text = "\u{feff}GeneratedTokens, TIMESTAMP ,ContextTokens\r\n\
                    3,2023-11-16 18:17:03.9799600,100\r\n\
                    0,2023-11-16 18:17:04.0799600,7\r\n";
        let t = Trace::read(
            "t.csv".into(),
            TraceFormat::AzureCsv,
            text.as_bytes(),
            ReadOptions::default(),
        )
        .unwrap();
        let got: Vec<(u64, f64, u32, u32)> = t
            .requests
            .iter()
            .map(|r| (r.rid, r.arrival_ms, r.input_tokens, r.output_tokens))
            .collect();
        assert_eq!(got, [(0, 0.0, 100, 3), (1, 100.0, 7, 0)]);
        assert!(!t.has_hashes());
    }

    #[test]
    fn limit_stops_reading_and_hashes_stay_with_their_request() {
        let text = "{\"timestamp\": 3, \"input_length\": 513, \"output_length\": 2, \"hash_ids\": [4, 5]}\n\
                    {\"timestamp\": 9, \"input_length\": 1, \"output_length\": 2, \"hash_ids\": [6]}\n\
                    not json\n";
        let t = Trace::read(
            "t.jsonl".into(),
            TraceFormat::MooncakeJsonl,
            text.as_bytes(),
            ReadOptions {
                limit: Some(2),
                skip_bad_lines: false,
            },
        )
        .unwrap();
        assert_eq!(t.requests.len(), 2);
        assert_eq!(t.hashes(&t.requests[0]), &[4, 5]);
        assert_eq!(t.hashes(&t.requests[1]), &[6]);
        // Relative to the first request, as Azure's.
        assert_eq!(t.requests[0].arrival_ms, 0.0);
        assert_eq!(t.requests[1].arrival_ms, 6.0);
    }
}
