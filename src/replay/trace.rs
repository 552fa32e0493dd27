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

/// A trace file format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TraceFormat {
    /// `TIMESTAMP, ContextTokens, GeneratedTokens`, wall-clock timestamps.
    AzureCsv,
    /// `{"timestamp" (ms), "input_length", "output_length", "hash_ids"}` per line.
    MooncakeJsonl,
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
    pub file: String,
    /// 1-based line number.
    pub line: u64,
    /// The field that was wrong, or `line` for the whole line.
    pub field: String,
    pub problem: String,
}

/// Why a trace could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("cannot read trace `{file}`: {source}")]
    Io {
        file: String,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "trace `{file}`: unknown format; expected a `.csv` (Azure) or `.jsonl` (Mooncake) file"
    )]
    UnknownFormat { file: String },
    #[error("bad trace line: {0}")]
    BadLine(#[from] BadLine),
    #[error("trace `{file}` has no requests{}", if *.skipped > 0 { format!(" ({} bad lines skipped)", .skipped) } else { String::new() })]
    Empty { file: String, skipped: usize },
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
    pub format: TraceFormat,
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
        let file = path.display().to_string();
        let format = TraceFormat::of_path(path)
            .ok_or_else(|| TraceError::UnknownFormat { file: file.clone() })?;
        let f = File::open(path).map_err(|source| TraceError::Io {
            file: file.clone(),
            source,
        })?;
        Self::read(file, format, BufReader::new(f), opts)
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
            last_ms: 0.0,
        };
        match format {
            TraceFormat::AzureCsv => read_azure(&mut b, reader)?,
            TraceFormat::MooncakeJsonl => read_mooncake(&mut b, reader)?,
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
}

struct Builder {
    trace: Trace,
    opts: ReadOptions,
    /// The first Azure timestamp, ns since the epoch: arrivals count from it.
    first_ns: Option<i64>,
    last_ms: f64,
}

impl Builder {
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
            Time::Ms(ms) => ms,
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

fn read_azure<R: Read>(b: &mut Builder, reader: R) -> Result<(), TraceError> {
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
                        "column is missing from the header (found {:?}); an Azure trace has TIMESTAMP, ContextTokens, GeneratedTokens",
                        headers.iter().collect::<Vec<_>>()
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
                let parsed = parse_azure(b, &record, cols, rid, line);
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
            format!("{why}, got {ts:?} (expected e.g. \"2023-11-16 18:17:03.9799600\")"),
        )
    })?;
    let count = |i: usize| -> Result<u64, BadLine> {
        let v = field(i)?;
        v.parse::<u64>().map_err(|_| {
            b.bad(
                line,
                AZURE_FIELDS[i],
                format!("must be a whole number of tokens, got {v:?}"),
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
    let secs = days * 86_400 + i64::from(h * 3600 + mi * 60 + sec);
    Ok(secs * 1_000_000_000 + frac_ns)
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

fn read_mooncake<R: BufRead>(b: &mut Builder, mut reader: R) -> Result<(), TraceError> {
    let mut text = String::new();
    let mut hashes: Vec<u64> = Vec::new();
    let mut line: u64 = 0;
    let mut rid: u64 = 0;
    while !b.full() {
        text.clear();
        let n = reader
            .read_line(&mut text)
            .map_err(|source| TraceError::Io {
                file: b.trace.file.clone(),
                source,
            })?;
        if n == 0 {
            break;
        }
        line += 1;
        if text.trim().is_empty() {
            continue;
        }
        let parsed = parse_mooncake(b, &text, line, &mut hashes);
        rid += 1;
        let result = parsed.and_then(|(time, input, output)| {
            b.push(
                Line {
                    rid: rid - 1,
                    line,
                    time: Time::Ms(time),
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
) -> Result<(f64, u64, u64), BadLine> {
    let v: MooncakeLine = serde_json::from_str(text)
        .map_err(|e| b.bad(line, "line", format!("is not a Mooncake JSON object: {e}")))?;
    let missing = |f: &str| b.bad(line, f, "is missing");
    let time = v.timestamp.ok_or_else(|| missing("timestamp"))?;
    let time = time
        .as_f64()
        .filter(|t| t.is_finite() && *t >= 0.0)
        .ok_or_else(|| {
            b.bad(
                line,
                "timestamp",
                format!("must be a non-negative number of ms, got {time}"),
            )
        })?;
    let count = |f: &str, n: Option<Value>| -> Result<u64, BadLine> {
        let n = n.ok_or_else(|| missing(f))?;
        n.as_u64().ok_or_else(|| {
            b.bad(
                line,
                f,
                format!("must be a whole number of tokens, got {n}"),
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
            format!("must be a list of block hashes, got {ids}"),
        )
    })?;
    for (i, h) in ids.iter().enumerate() {
        let h = h.as_u64().ok_or_else(|| {
            b.bad(
                line,
                "hash_ids",
                format!("entry {i} must be a non-negative whole number, got {h}"),
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
        assert_eq!(t.requests[1].arrival_ms, 9.0);
    }
}
