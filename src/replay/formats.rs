//! More trace formats (see `docs/replay.md#trace-formats`): a generic CSV with arrival times and
//! lengths, and length-only CSV files whose arrivals are generated; and the choice of a trace's
//! format, from `--format` or from the file's name and header.
//!
//! Both readers produce plain [`TraceRecord`]s. A trace is read whole before a replay starts, so
//! a bad line is reported, by line number and column, before any step runs. The reader refuses a
//! file larger than [`MAX_FILE_BYTES`] or a line longer than [`MAX_LINE_BYTES`] as it reads, so a
//! corrupt or endless input (a FIFO, `/dev/zero`) cannot exhaust memory. No input makes it panic.

use std::fmt;
use std::fs::File;
use std::io::{self, BufReader, Read};
use std::path::Path;
use std::str::FromStr;

use serde::Serialize;

use super::arrivals::{Arrivals, ArrivalsError, MAX_ARRIVAL_MS};

/// The longest prompt a request may have, in tokens: replay allocates each prompt, so a corrupt
/// count must not ask for gigabytes. The same limit as the Azure and Mooncake readers.
pub const MAX_PROMPT_TOKENS: u64 = 1 << 24;
/// The most tokens a request may generate: each takes a simulated step. The same limit as the
/// Azure and Mooncake readers.
pub const MAX_OUTPUT_TOKENS: u64 = 1 << 20;
/// Tokens one block hash covers (as in the Mooncake traces; the prefix cache's block size).
pub const HASH_BLOCK_TOKENS: u64 = 512;
/// The largest trace file read, in bytes (1 GiB).
pub const MAX_FILE_BYTES: u64 = 1 << 30;
/// The longest line read, in bytes (1 MiB): room for the hashes of the longest prompt
/// (2^24 / 512 = 32768 ids of up to 20 digits, space-separated).
pub const MAX_LINE_BYTES: u64 = 1 << 20;
/// Bytes read to detect a format from a header.
const SNIFF_BYTES: u64 = 64 * 1024;
/// Bad lines kept verbatim (as messages) when they are skipped.
const BAD_LINE_EXAMPLES: usize = 10;

/// A trace file format, as `--format` names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum InputFormat {
    /// `TIMESTAMP, ContextTokens, GeneratedTokens` (the Azure LLM inference traces); `azure`.
    AzureCsv,
    /// `{"timestamp", "input_length", "output_length", "hash_ids"}` per line (Mooncake);
    /// `mooncake`.
    MooncakeJsonl,
    /// `arrival_ms,prompt_tokens,output_tokens[,hash_ids]`; `generic`.
    GenericCsv,
    /// `num_prefill_tokens,num_decode_tokens`, arrivals generated; `lengths`.
    LengthsCsv,
}

impl InputFormat {
    /// Every format, in the order `--format` lists them.
    pub const ALL: [Self; 4] = [
        Self::AzureCsv,
        Self::MooncakeJsonl,
        Self::GenericCsv,
        Self::LengthsCsv,
    ];

    /// The name `--format` takes.
    pub fn name(self) -> &'static str {
        match self {
            Self::AzureCsv => "azure",
            Self::MooncakeJsonl => "mooncake",
            Self::GenericCsv => "generic",
            Self::LengthsCsv => "lengths",
        }
    }

    /// Whether the trace carries no arrival times, so `--arrivals` must generate them.
    pub fn needs_arrivals(self) -> bool {
        self == Self::LengthsCsv
    }

    /// The format a file's header says, or `None`. The first line (a UTF-8 byte order mark
    /// ignored) decides: a JSON object is Mooncake; otherwise the comma-separated column names,
    /// in any order and case: `TIMESTAMP` and `ContextTokens` (Azure); `arrival_ms` and
    /// `prompt_tokens` (generic); `num_prefill_tokens` and `num_decode_tokens` (lengths).
    pub fn from_header(head: &[u8]) -> Option<Self> {
        let head = head.strip_prefix(b"\xef\xbb\xbf").unwrap_or(head);
        let line = head.split(|b| *b == b'\n').next()?;
        let line = String::from_utf8_lossy(line);
        let line = line.trim();
        if line.starts_with('{') {
            return Some(Self::MooncakeJsonl);
        }
        let cols: Vec<String> = line
            .split(',')
            .map(|c| c.trim().trim_matches('"').to_ascii_lowercase())
            .collect();
        let has = |name: &str| cols.iter().any(|c| c == name);
        if has("timestamp") && has("contexttokens") {
            Some(Self::AzureCsv)
        } else if has("arrival_ms") && has("prompt_tokens") {
            Some(Self::GenericCsv)
        } else if has("num_prefill_tokens") && has("num_decode_tokens") {
            Some(Self::LengthsCsv)
        } else {
            None
        }
    }
}

impl fmt::Display for InputFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for InputFormat {
    type Err = FormatError;

    /// Parses a `--format` name: `azure`, `mooncake`, `generic` or `lengths`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        Self::ALL
            .into_iter()
            .find(|f| f.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| FormatError::UnknownName(s.to_owned()))
    }
}

/// One request of a trace, as read.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceRecord {
    /// The 1-based line it was read from (for messages and step logs).
    pub line: u64,
    /// Arrival, in ms from the trace's start: non-decreasing, at most [`MAX_ARRIVAL_MS`].
    pub arrival_ms: f64,
    /// Prompt tokens, between 1 and [`MAX_PROMPT_TOKENS`].
    pub prompt_tokens: u32,
    /// Generated tokens, at most [`MAX_OUTPUT_TOKENS`] (0 as given; replay runs it as 1).
    pub output_tokens: u32,
    /// Block hashes, one per [`HASH_BLOCK_TOKENS`] prompt tokens, or empty.
    pub hash_ids: Vec<u64>,
}

/// A whole trace read by this module.
#[derive(Debug, Clone, PartialEq)]
pub struct Records {
    /// The file it was read from.
    pub file: String,
    /// Its format.
    pub format: InputFormat,
    /// The requests, in arrival order.
    pub records: Vec<TraceRecord>,
    /// Bad lines left out (with `skip_bad_lines`).
    pub skipped_lines: usize,
    /// The first few bad lines left out, as messages.
    pub bad_line_examples: Vec<String>,
}

impl Records {
    /// Whether any request carries block hashes (the prefix cache needs them).
    pub fn has_hashes(&self) -> bool {
        self.records.iter().any(|r| !r.hash_ids.is_empty())
    }
}

/// How to read a trace.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReadOptions {
    /// Read only the first `limit` requests.
    pub limit: Option<usize>,
    /// Count and leave out bad lines instead of failing on the first.
    pub skip_bad_lines: bool,
}

/// Why a trace could not be read, or its format not chosen.
#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    /// `--format` named no known format.
    #[error("`--format` {0:?} is not a trace format; expected one of `azure`, `mooncake`, `generic`, `lengths`")]
    UnknownName(String),
    /// Neither `--format` nor the file's header said what the file is.
    #[error("trace `{file}`: unknown format; its first line is not a header of a known format (`TIMESTAMP,ContextTokens,GeneratedTokens`, `arrival_ms,prompt_tokens,output_tokens`, `num_prefill_tokens,num_decode_tokens`) nor a Mooncake JSON object; name one with `--format`")]
    Unknown {
        /// The file.
        file: String,
    },
    /// The path is not a regular file (a directory, a FIFO, a device).
    #[error("trace `{file}` is not a regular file (it is a {kind}); inputs must be regular files")]
    NotAFile {
        /// The file.
        file: String,
        /// What it is instead: `directory`, `FIFO`, `device`, ...
        kind: &'static str,
    },
    /// The file is larger than [`MAX_FILE_BYTES`].
    #[error("trace `{file}` is larger than {MAX_FILE_BYTES} bytes")]
    TooLarge {
        /// The file.
        file: String,
    },
    /// A line is longer than [`MAX_LINE_BYTES`].
    #[error("trace `{file}`:{line}: the line is longer than {MAX_LINE_BYTES} bytes")]
    LineTooLong {
        /// The file.
        file: String,
        /// The 1-based line.
        line: u64,
    },
    /// The file could not be read.
    #[error("cannot read trace `{file}`: {source}")]
    Io {
        /// The file.
        file: String,
        /// The error.
        #[source]
        source: io::Error,
    },
    /// A line was refused.
    #[error("bad trace line: {0}")]
    BadLine(#[from] BadLine),
    /// The trace has no usable request.
    #[error("trace `{file}` has no requests{}", if *.skipped > 0 { format!(" ({} skipped)", super::report::plural(*skipped as u64, "bad line")) } else { String::new() })]
    Empty {
        /// The file.
        file: String,
        /// Bad lines left out.
        skipped: usize,
    },
    /// A length-only trace was given no `--arrivals`.
    #[error("trace `{file}` has lengths only (`num_prefill_tokens,num_decode_tokens`): generate its arrivals with `--arrivals poisson:QPS` or `--arrivals gamma:QPS:CV`")]
    NeedsArrivals {
        /// The file.
        file: String,
    },
    /// `--arrivals` was given for a trace that has its own times.
    #[error("trace `{file}` ({format}) has its own arrival times; `--arrivals` applies only to length-only traces")]
    HasArrivals {
        /// The file.
        file: String,
        /// Its format.
        format: InputFormat,
    },
    /// The format is one the replay's Azure / Mooncake trace reader reads, not this module.
    #[error("trace `{file}` is in the {format} format, which this reader does not read")]
    OtherReader {
        /// The file.
        file: String,
        /// Its format.
        format: InputFormat,
    },
    /// The arrivals could not be generated.
    #[error(transparent)]
    Arrivals(#[from] ArrivalsError),
}

/// A line of a trace that was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{file}:{line}: `{field}` {problem}")]
pub struct BadLine {
    /// The file.
    pub file: String,
    /// 1-based line number.
    pub line: u64,
    /// The column that was wrong, or `line` for the whole line.
    pub field: String,
    /// What was wrong.
    pub problem: String,
}

/// Chooses the format of the trace at `path`: `forced` when given (`--format`), else what its
/// header says ([`InputFormat::from_header`]), else its extension (`.jsonl`: Mooncake).
///
/// # Errors
/// The file cannot be opened or is not a regular file, or nothing tells its format.
pub fn choose_format(path: &Path, forced: Option<InputFormat>) -> Result<InputFormat, FormatError> {
    if let Some(f) = forced {
        return Ok(f);
    }
    // Escaped: a file name with control characters must not garble the message.
    let file = crate::config::problem::escape(&path.display().to_string());
    let mut head = Vec::new();
    open(path)?
        .take(SNIFF_BYTES)
        .read_to_end(&mut head)
        .map_err(|source| io_error(&file, source))?;
    if let Some(f) = InputFormat::from_header(&head) {
        return Ok(f);
    }
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    if ext.eq_ignore_ascii_case("jsonl") {
        return Ok(InputFormat::MooncakeJsonl);
    }
    Err(FormatError::Unknown { file })
}

/// Opens the trace at `path` for reading, refusing anything but a regular file no larger than
/// [`MAX_FILE_BYTES`]; the readers of this module also enforce both caps as they read.
///
/// # Errors
/// The file cannot be opened, is not a regular file, or is too large.
pub fn open(path: &Path) -> Result<BufReader<File>, FormatError> {
    // Escaped: a file name with control characters must not garble the message.
    let file = crate::config::problem::escape(&path.display().to_string());
    // The config's opener checks before opening (opening a FIFO for reading would block until
    // a writer came) and says what the path is instead: the trace reader's message too.
    let f = crate::config::input::open_regular(path).map_err(|e| match e {
        crate::config::InputError::Io(source) => io_error(&file, source),
        crate::config::InputError::NotRegular(kind) => FormatError::NotAFile {
            file: file.clone(),
            kind,
        },
        other => io_error(&file, io::Error::other(other.to_string())),
    })?;
    // `open_regular` checked the opened file is regular too.
    let meta = f.metadata().map_err(|source| io_error(&file, source))?;
    if meta.len() > MAX_FILE_BYTES {
        return Err(FormatError::TooLarge { file });
    }
    Ok(BufReader::new(f))
}

/// Reads the generic or length-only trace at `path` (`format` from [`choose_format`]);
/// `arrivals` and `seed` generate a length-only trace's arrival times.
///
/// # Errors
/// As [`read_generic_csv`] and [`read_lengths_csv`]; [`FormatError::OtherReader`] for the Azure
/// and Mooncake formats, which the replay's trace reader reads; arrivals given for a trace with
/// its own times.
pub fn read_path(
    path: &Path,
    format: InputFormat,
    arrivals: Option<&Arrivals>,
    seed: u64,
    opts: ReadOptions,
) -> Result<Records, FormatError> {
    // Escaped: a file name with control characters must not garble the message.
    let file = crate::config::problem::escape(&path.display().to_string());
    match (format, arrivals) {
        (InputFormat::LengthsCsv, Some(a)) => read_lengths_csv(file, open(path)?, a, seed, opts),
        (InputFormat::LengthsCsv, None) => Err(FormatError::NeedsArrivals { file }),
        (f, Some(_)) => Err(FormatError::HasArrivals { file, format: f }),
        (InputFormat::GenericCsv, None) => read_generic_csv(file, open(path)?, opts),
        (f @ (InputFormat::AzureCsv | InputFormat::MooncakeJsonl), None) => {
            Err(FormatError::OtherReader { file, format: f })
        }
    }
}

const GENERIC_REQUIRED: [&str; 3] = ["arrival_ms", "prompt_tokens", "output_tokens"];
const GENERIC_HASHES: &str = "hash_ids";
const LENGTH_COLUMNS: [&str; 2] = ["num_prefill_tokens", "num_decode_tokens"];

/// Reads a generic CSV trace: a header naming `arrival_ms`, `prompt_tokens`, `output_tokens`
/// and optionally `hash_ids` (any order and case; other columns ignored), then one request per
/// line. `arrival_ms` is a number of ms from the trace's start (fractions allowed), never
/// decreasing; `hash_ids` is empty or one space-separated id per 512 prompt tokens (rounded up).
///
/// # Errors
/// An I/O error, a cap passed, a missing column, a bad line (unless skipped), or no requests.
pub fn read_generic_csv<R: Read>(
    file: String,
    reader: R,
    opts: ReadOptions,
) -> Result<Records, FormatError> {
    read_generic_capped(file, reader, opts, CAPS)
}

fn read_generic_capped<R: Read>(
    file: String,
    reader: R,
    opts: ReadOptions,
    caps: Caps,
) -> Result<Records, FormatError> {
    let mut b = Builder::new(file, InputFormat::GenericCsv, opts);
    let mut rdr = csv_reader(reader, caps);
    let header = b.header(&mut rdr)?;
    let cols = b.columns(&header, &GENERIC_REQUIRED)?;
    let hash_col = position(&header, GENERIC_HASHES);
    let mut last_ms = 0.0_f64;
    b.each_record(&mut rdr, |b, r, line| {
        let arrival_ms = b.arrival(r, cols[0], line, last_ms)?;
        let prompt = b.count(r, cols[1], GENERIC_REQUIRED[1], line, 1, MAX_PROMPT_TOKENS)?;
        let output = b.count(r, cols[2], GENERIC_REQUIRED[2], line, 0, MAX_OUTPUT_TOKENS)?;
        let hash_ids = match hash_col.and_then(|c| r.get(c)) {
            Some(text) => b.hashes(text, prompt, line)?,
            None => Vec::new(),
        };
        last_ms = arrival_ms;
        Ok(record(line, arrival_ms, prompt, output, hash_ids))
    })?;
    b.finish()
}

/// Reads a length-only CSV trace: a header naming `num_prefill_tokens` and `num_decode_tokens`
/// (as in the Sarathi-Serve / Vidur ShareGPT and arXiv length files; other columns ignored),
/// then one request per line; the arrival times are generated by `arrivals` from `seed`, one per
/// request kept (bad lines left out draw none).
///
/// # Errors
/// As [`read_generic_csv`]; the arrival times pass [`MAX_ARRIVAL_MS`].
pub fn read_lengths_csv<R: Read>(
    file: String,
    reader: R,
    arrivals: &Arrivals,
    seed: u64,
    opts: ReadOptions,
) -> Result<Records, FormatError> {
    let mut b = Builder::new(file, InputFormat::LengthsCsv, opts);
    let mut rdr = csv_reader(reader, CAPS);
    let header = b.header(&mut rdr)?;
    let cols = b.columns(&header, &LENGTH_COLUMNS)?;
    b.each_record(&mut rdr, |b, r, line| {
        let prompt = b.count(r, cols[0], LENGTH_COLUMNS[0], line, 1, MAX_PROMPT_TOKENS)?;
        let output = b.count(r, cols[1], LENGTH_COLUMNS[1], line, 0, MAX_OUTPUT_TOKENS)?;
        Ok(record(line, 0.0, prompt, output, Vec::new()))
    })?;
    let times = arrivals.times_ms(b.records.len(), seed)?;
    for (r, t) in b.records.iter_mut().zip(times) {
        r.arrival_ms = t;
    }
    b.finish()
}

fn record(line: u64, arrival_ms: f64, prompt: u64, output: u64, hash_ids: Vec<u64>) -> TraceRecord {
    // Both counts were checked against limits far below u32::MAX.
    TraceRecord {
        line,
        arrival_ms,
        prompt_tokens: u32::try_from(prompt).unwrap_or(u32::MAX),
        output_tokens: u32::try_from(output).unwrap_or(u32::MAX),
        hash_ids,
    }
}

fn io_error(file: &str, source: io::Error) -> FormatError {
    FormatError::Io {
        file: file.to_owned(),
        source,
    }
}

fn csv_reader<R: Read>(reader: R, caps: Caps) -> csv::Reader<CappedReader<R>> {
    csv::ReaderBuilder::new()
        .has_headers(true)
        // A short line is reported by the column it lacks, not as a CSV error.
        .flexible(true)
        .trim(csv::Trim::All)
        // Lines end at `\n` only, so that record positions count CRLF files' lines right; the
        // `\r` left at a line's end is trimmed as whitespace.
        .terminator(csv::Terminator::Any(b'\n'))
        .from_reader(CappedReader::new(reader, caps))
}

fn position(header: &csv::StringRecord, name: &str) -> Option<usize> {
    header.iter().position(|h| {
        h.trim_start_matches('\u{feff}')
            .trim()
            .eq_ignore_ascii_case(name)
    })
}

/// A cap passed while reading, carried through `csv` as an I/O error.
#[derive(Debug)]
enum Cap {
    File,
    Line(u64),
}

impl fmt::Display for Cap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::File => write!(f, "more than {MAX_FILE_BYTES} bytes"),
            Self::Line(l) => write!(f, "line {l} is longer than {MAX_LINE_BYTES} bytes"),
        }
    }
}

impl std::error::Error for Cap {}

/// The byte limits a read enforces: [`MAX_FILE_BYTES`] and [`MAX_LINE_BYTES`] (smaller in tests).
#[derive(Debug, Clone, Copy)]
struct Caps {
    file: u64,
    line: u64,
}

const CAPS: Caps = Caps {
    file: MAX_FILE_BYTES,
    line: MAX_LINE_BYTES,
};

/// A reader that fails once more than its file cap of bytes, or a line longer than its line
/// cap, went through it: the caps hold for pipes and endless devices too, where a file's size
/// says nothing.
#[derive(Debug)]
struct CappedReader<R> {
    inner: R,
    caps: Caps,
    total: u64,
    line_len: u64,
    /// 1-based number of the line being read.
    line: u64,
}

impl<R> CappedReader<R> {
    fn new(inner: R, caps: Caps) -> Self {
        Self {
            inner,
            caps,
            total: 0,
            line_len: 0,
            line: 1,
        }
    }
}

impl<R: Read> Read for CappedReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        let got = buf.get(..n).unwrap_or(&[]);
        self.total = self.total.saturating_add(n as u64);
        if self.total > self.caps.file {
            return Err(io::Error::new(io::ErrorKind::InvalidData, Cap::File));
        }
        for &byte in got {
            if byte == b'\n' {
                self.line += 1;
                self.line_len = 0;
            } else {
                self.line_len += 1;
                if self.line_len > self.caps.line {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        Cap::Line(self.line),
                    ));
                }
            }
        }
        Ok(n)
    }
}

/// Collects records and bad lines for one trace.
struct Builder {
    file: String,
    format: InputFormat,
    opts: ReadOptions,
    records: Vec<TraceRecord>,
    skipped: usize,
    examples: Vec<String>,
}

impl Builder {
    fn new(file: String, format: InputFormat, opts: ReadOptions) -> Self {
        Self {
            file,
            format,
            opts,
            records: Vec::new(),
            skipped: 0,
            examples: Vec::new(),
        }
    }

    fn bad(&self, line: u64, field: &str, problem: impl Into<String>) -> BadLine {
        BadLine {
            file: self.file.clone(),
            line,
            field: field.to_owned(),
            problem: problem.into(),
        }
    }

    /// Maps a CSV error: caps and I/O end the read; a malformed record is a bad line.
    fn csv_error(&self, e: csv::Error, fallback_line: u64) -> FormatError {
        let line = e.position().map_or(fallback_line, csv::Position::line);
        match e.into_kind() {
            csv::ErrorKind::Io(source) => {
                match source.get_ref().and_then(|s| s.downcast_ref::<Cap>()) {
                    Some(Cap::File) => FormatError::TooLarge {
                        file: self.file.clone(),
                    },
                    Some(Cap::Line(l)) => FormatError::LineTooLong {
                        file: self.file.clone(),
                        line: *l,
                    },
                    None => io_error(&self.file, source),
                }
            }
            csv::ErrorKind::Utf8 { err, .. } => FormatError::BadLine(self.bad(
                line,
                "line",
                format!("is not valid UTF-8 (in column {})", err.field() + 1),
            )),
            other => FormatError::BadLine(self.bad(
                line,
                "line",
                format!("is not a valid CSV record: {other:?}"),
            )),
        }
    }

    fn header<R: Read>(&self, rdr: &mut csv::Reader<R>) -> Result<csv::StringRecord, FormatError> {
        rdr.headers().cloned().map_err(|e| self.csv_error(e, 1))
    }

    fn columns<const N: usize>(
        &self,
        header: &csv::StringRecord,
        names: &[&str; N],
    ) -> Result<[usize; N], FormatError> {
        let mut cols = [0usize; N];
        for (col, name) in cols.iter_mut().zip(names) {
            *col = position(header, name).ok_or_else(|| {
                self.bad(
                    1,
                    name,
                    format!(
                        "column is missing from the header (found {:?}); a {} trace has {}",
                        header.iter().collect::<Vec<_>>(),
                        self.format,
                        names.join(", ")
                    ),
                )
            })?;
        }
        Ok(cols)
    }

    /// Reads records until the end or the limit, passing each to `parse`; keeps what it returns,
    /// and refuses or skips bad lines.
    fn each_record<R: Read>(
        &mut self,
        rdr: &mut csv::Reader<R>,
        mut parse: impl FnMut(&Self, &csv::StringRecord, u64) -> Result<TraceRecord, BadLine>,
    ) -> Result<(), FormatError> {
        let mut record = csv::StringRecord::new();
        let mut line: u64 = 1;
        while !matches!(self.opts.limit, Some(n) if self.records.len() >= n) {
            match rdr.read_record(&mut record) {
                Ok(false) => break,
                Ok(true) => {
                    line = record.position().map_or(line + 1, csv::Position::line);
                    // A blank line (all fields empty) is no request.
                    if record.iter().all(str::is_empty) {
                        continue;
                    }
                    match parse(self, &record, line) {
                        Ok(r) => self.records.push(r),
                        Err(bad) => self.refuse(bad)?,
                    }
                }
                Err(e) => match self.csv_error(e, line + 1) {
                    FormatError::BadLine(bad) => {
                        line = bad.line;
                        self.refuse(bad)?;
                    }
                    fatal => return Err(fatal),
                },
            }
        }
        Ok(())
    }

    fn refuse(&mut self, bad: BadLine) -> Result<(), FormatError> {
        if !self.opts.skip_bad_lines {
            return Err(bad.into());
        }
        self.skipped += 1;
        if self.examples.len() < BAD_LINE_EXAMPLES {
            self.examples.push(bad.to_string());
        }
        Ok(())
    }

    fn field<'r>(
        &self,
        r: &'r csv::StringRecord,
        col: usize,
        name: &str,
        line: u64,
    ) -> Result<&'r str, BadLine> {
        r.get(col)
            .filter(|v| !v.is_empty())
            .ok_or_else(|| self.bad(line, name, "is missing"))
    }

    /// A whole number in `[min, max]`.
    fn count(
        &self,
        r: &csv::StringRecord,
        col: usize,
        name: &str,
        line: u64,
        min: u64,
        max: u64,
    ) -> Result<u64, BadLine> {
        let v = self.field(r, col, name, line)?;
        let range = || format!("between {min} and {max} tokens");
        let digits = v.strip_prefix('+').unwrap_or(v);
        if !digits.is_empty() && digits.bytes().all(|c| c.is_ascii_digit()) {
            return match digits.parse::<u64>() {
                Ok(n) if (min..=max).contains(&n) => Ok(n),
                _ => Err(self.bad(line, name, format!("must be {}, got {v}", range()))),
            };
        }
        Err(self.bad(
            line,
            name,
            format!("must be a whole number of tokens ({}), got {v:?}", range()),
        ))
    }

    /// A time in ms, finite, in `[0, MAX_ARRIVAL_MS]`, not before `last_ms`.
    fn arrival(
        &self,
        r: &csv::StringRecord,
        col: usize,
        line: u64,
        last_ms: f64,
    ) -> Result<f64, BadLine> {
        let name = GENERIC_REQUIRED[0];
        let v = self.field(r, col, name, line)?;
        let ms = v
            .parse::<f64>()
            .ok()
            .filter(|t| t.is_finite() && (0.0..=MAX_ARRIVAL_MS).contains(t))
            .ok_or_else(|| {
                self.bad(
                    line,
                    name,
                    format!("must be a number of ms between 0 and {MAX_ARRIVAL_MS}, got {v:?}"),
                )
            })?;
        if !self.records.is_empty() && ms < last_ms {
            return Err(self.bad(
                line,
                name,
                format!("goes back in time: {ms} ms, the request before arrived at {last_ms} ms"),
            ));
        }
        Ok(ms)
    }

    /// Space-separated block hashes: none, or exactly one per 512 prompt tokens (rounded up).
    fn hashes(&self, text: &str, prompt: u64, line: u64) -> Result<Vec<u64>, BadLine> {
        let mut ids = Vec::new();
        for (i, word) in text.split_ascii_whitespace().enumerate() {
            let id = word.parse::<u64>().map_err(|_| {
                self.bad(
                    line,
                    GENERIC_HASHES,
                    format!("entry {i} must be a whole number below 2^64, got {word:?}"),
                )
            })?;
            ids.push(id);
        }
        let blocks = prompt.div_ceil(HASH_BLOCK_TOKENS);
        if !ids.is_empty() && ids.len() as u64 != blocks {
            return Err(self.bad(
                line,
                GENERIC_HASHES,
                format!(
                    "has {} ids, but prompt_tokens {prompt} needs ceil({prompt}/{HASH_BLOCK_TOKENS}) = {blocks}",
                    ids.len()
                ),
            ));
        }
        Ok(ids)
    }

    fn finish(self) -> Result<Records, FormatError> {
        if self.records.is_empty() {
            return Err(FormatError::Empty {
                file: self.file,
                skipped: self.skipped,
            });
        }
        Ok(Records {
            file: self.file,
            format: self.format,
            records: self.records,
            skipped_lines: self.skipped,
            bad_line_examples: self.examples,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn generic(text: &str) -> Result<Records, FormatError> {
        read_generic_csv("t.csv".into(), text.as_bytes(), ReadOptions::default())
    }

    fn bad_line(r: Result<Records, FormatError>) -> BadLine {
        match r {
            Err(FormatError::BadLine(b)) => b,
            other => panic!("expected a bad line, got {other:?}"),
        }
    }

    fn rows(r: &Records) -> Vec<(u64, f64, u32, u32, Vec<u64>)> {
        r.records
            .iter()
            .map(|r| {
                (
                    r.line,
                    r.arrival_ms,
                    r.prompt_tokens,
                    r.output_tokens,
                    r.hash_ids.clone(),
                )
            })
            .collect()
    }

    #[test]
    fn generic_csv_with_bom_crlf_reordered_columns_and_hashes_reads() {
        let text = "\u{feff}output_tokens, Arrival_MS ,prompt_tokens,hash_ids,extra\r\n\
                    3,0,100,7,x\r\n\
                    \r\n\
                    0,12.5,513,  8 9 ,y\r\n\
                    5,12.5,1,,z\r\n";
        let r = generic(text).unwrap();
        assert_eq!(
            rows(&r),
            [
                (2, 0.0, 100, 3, vec![7]),
                (4, 12.5, 513, 0, vec![8, 9]),
                (5, 12.5, 1, 5, vec![]),
            ]
        );
        assert!(r.has_hashes());
        assert_eq!(r.format, InputFormat::GenericCsv);
    }

    #[test]
    fn generic_csv_without_hash_column_reads_and_limit_stops() {
        let text = "arrival_ms,prompt_tokens,output_tokens\n1,2,3\n4,5,6\nnot,a,line\n";
        let r = read_generic_csv(
            "t.csv".into(),
            text.as_bytes(),
            ReadOptions {
                limit: Some(2),
                skip_bad_lines: false,
            },
        )
        .unwrap();
        assert_eq!(r.records.len(), 2);
        assert!(!r.has_hashes());
    }

    #[test]
    fn a_missing_column_in_the_header_is_named() {
        let b = bad_line(generic("arrival_ms,prompt_tokens\n1,2\n"));
        assert_eq!((b.line, b.field.as_str()), (1, "output_tokens"));
        assert!(b.problem.contains("column is missing"), "{}", b.problem);
    }

    #[test]
    fn bad_values_are_named_by_line_and_column() {
        let h = "arrival_ms,prompt_tokens,output_tokens,hash_ids\n";
        for (row, field, words) in [
            ("1,2", "output_tokens", "is missing"),
            ("1,,3", "prompt_tokens", "is missing"),
            ("1,-5,3", "prompt_tokens", "whole number"),
            ("1,5,-1", "output_tokens", "whole number"),
            ("1,0,3", "prompt_tokens", "between 1 and 16777216"),
            ("1,16777217,3", "prompt_tokens", "between 1 and 16777216"),
            (
                "1,99999999999999999999999,3",
                "prompt_tokens",
                "between 1 and",
            ),
            ("1,5,1048577", "output_tokens", "between 0 and 1048576"),
            ("1,5.5,3", "prompt_tokens", "whole number"),
            ("-1,5,3", "arrival_ms", "between 0 and"),
            ("NaN,5,3", "arrival_ms", "between 0 and"),
            ("inf,5,3", "arrival_ms", "between 0 and"),
            ("1e300,5,3", "arrival_ms", "between 0 and"),
            ("1,5,3,1 2", "hash_ids", "needs ceil(5/512) = 1"),
            ("1,5,3,x", "hash_ids", "entry 0"),
            ("1,5,3,-4", "hash_ids", "entry 0"),
        ] {
            let b = bad_line(generic(&format!("{h}0,1,1\n{row}\n")));
            assert_eq!((b.line, b.field.as_str()), (3, field), "{row}: {b}");
            assert!(b.problem.contains(words), "{row}: {}", b.problem);
        }
        let b = bad_line(generic(&format!("{h}5,1,1\n4,1,1\n")));
        assert_eq!((b.line, b.field.as_str()), (3, "arrival_ms"));
        assert_eq!(
            b.to_string(),
            "t.csv:3: `arrival_ms` goes back in time: 4 ms, the request before arrived at 5 ms"
        );
    }

    #[test]
    fn bad_lines_can_be_skipped_and_counted() {
        let text = "arrival_ms,prompt_tokens,output_tokens\n0,1,1\n1,x,1\n2,3,4\n\"open\n";
        let r = read_generic_csv(
            "t.csv".into(),
            text.as_bytes(),
            ReadOptions {
                limit: None,
                skip_bad_lines: true,
            },
        )
        .unwrap();
        assert_eq!(r.records.iter().map(|r| r.line).collect::<Vec<_>>(), [2, 4]);
        assert!(r.skipped_lines >= 1);
        assert!(r.bad_line_examples[0].starts_with("t.csv:3: `prompt_tokens`"));
        let all_bad = read_generic_csv(
            "t.csv".into(),
            "arrival_ms,prompt_tokens,output_tokens\n0,0,1\n".as_bytes(),
            ReadOptions {
                limit: None,
                skip_bad_lines: true,
            },
        );
        assert!(
            matches!(all_bad, Err(FormatError::Empty { skipped: 1, .. })),
            "{all_bad:?}"
        );
    }

    #[test]
    fn invalid_utf8_is_a_bad_line() {
        let mut text = b"arrival_ms,prompt_tokens,output_tokens\n0,1,1\n".to_vec();
        text.extend_from_slice(b"1,\xff,1\n");
        let r = read_generic_csv("t.csv".into(), &text[..], ReadOptions::default());
        let b = bad_line(r);
        assert_eq!((b.line, b.field.as_str()), (3, "line"));
    }

    #[test]
    fn lengths_csv_gets_seeded_generated_arrivals() {
        let text = "\u{feff}num_prefill_tokens,num_decode_tokens,pd_ratio\r\n\
                    100,20,5\r\n300,0,inf\r\n7,1,7\r\n";
        let a: Arrivals = "poisson:4".parse().unwrap();
        let read = |seed| {
            read_lengths_csv(
                "l.csv".into(),
                text.as_bytes(),
                &a,
                seed,
                ReadOptions::default(),
            )
            .unwrap()
        };
        let r = read(9);
        assert_eq!(
            r.records
                .iter()
                .map(|r| (r.line, r.prompt_tokens, r.output_tokens))
                .collect::<Vec<_>>(),
            [(2, 100, 20), (3, 300, 0), (4, 7, 1)]
        );
        let times: Vec<f64> = r.records.iter().map(|r| r.arrival_ms).collect();
        assert_eq!(times, a.times_ms(3, 9).unwrap());
        assert_eq!(read(9), r);
        assert_ne!(read(10), r);
        let b = bad_line(read_lengths_csv(
            "l.csv".into(),
            "num_prefill_tokens,num_decode_tokens\n5\n".as_bytes(),
            &a,
            1,
            ReadOptions::default(),
        ));
        assert_eq!((b.line, b.field.as_str()), (2, "num_decode_tokens"));
        let b = bad_line(read_lengths_csv(
            "l.csv".into(),
            "num_prefill_tokens\n5\n".as_bytes(),
            &a,
            1,
            ReadOptions::default(),
        ));
        assert_eq!((b.line, b.field.as_str()), (1, "num_decode_tokens"));
    }

    #[test]
    fn headers_tell_the_format_and_the_override_wins() {
        let cases: [(&[u8], Option<InputFormat>); 7] = [
            (
                b"\xef\xbb\xbfTIMESTAMP,ContextTokens,GeneratedTokens\r\n",
                Some(InputFormat::AzureCsv),
            ),
            (
                b"{\"timestamp\": 1, \"input_length\": 2}\n",
                Some(InputFormat::MooncakeJsonl),
            ),
            (
                b"arrival_ms,prompt_tokens,output_tokens,hash_ids\n",
                Some(InputFormat::GenericCsv),
            ),
            (
                b"\"num_prefill_tokens\",\"num_decode_tokens\"",
                Some(InputFormat::LengthsCsv),
            ),
            (b"a,b,c\n", None),
            (b"", None),
            (b"\xff\xfe", None),
        ];
        for (head, want) in cases {
            assert_eq!(InputFormat::from_header(head), want, "{head:?}");
        }
        for f in InputFormat::ALL {
            assert_eq!(f.name().to_uppercase().parse::<InputFormat>().unwrap(), f);
        }
        let e = "csv".parse::<InputFormat>().unwrap_err();
        assert!(e.to_string().contains("expected one of `azure`"), "{e}");

        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.txt");
        std::fs::write(&p, "num_prefill_tokens,num_decode_tokens\n1,1\n").unwrap();
        assert_eq!(choose_format(&p, None).unwrap(), InputFormat::LengthsCsv);
        assert_eq!(
            choose_format(&p, Some(InputFormat::GenericCsv)).unwrap(),
            InputFormat::GenericCsv
        );
        let j = dir.path().join("t.jsonl");
        std::fs::write(&j, "\n").unwrap();
        assert_eq!(choose_format(&j, None).unwrap(), InputFormat::MooncakeJsonl);
        let u = dir.path().join("u.csv");
        std::fs::write(&u, "x,y\n").unwrap();
        assert!(matches!(
            choose_format(&u, None),
            Err(FormatError::Unknown { .. })
        ));
        assert!(matches!(
            choose_format(dir.path(), None),
            Err(FormatError::NotAFile { .. })
        ));
    }

    #[test]
    fn read_path_needs_arrivals_exactly_for_length_only_traces() {
        let dir = tempfile::tempdir().unwrap();
        let l = dir.path().join("l.csv");
        std::fs::write(&l, "num_prefill_tokens,num_decode_tokens\n1,1\n2,2\n").unwrap();
        let g = dir.path().join("g.csv");
        std::fs::write(&g, "arrival_ms,prompt_tokens,output_tokens\n0,1,1\n").unwrap();
        let a: Arrivals = "gamma:2:3".parse().unwrap();
        let opts = ReadOptions::default();
        assert_eq!(
            read_path(&l, InputFormat::LengthsCsv, Some(&a), 1, opts)
                .unwrap()
                .records
                .len(),
            2
        );
        assert!(matches!(
            read_path(&l, InputFormat::LengthsCsv, None, 1, opts),
            Err(FormatError::NeedsArrivals { .. })
        ));
        assert!(matches!(
            read_path(&g, InputFormat::GenericCsv, Some(&a), 1, opts),
            Err(FormatError::HasArrivals { .. })
        ));
        assert_eq!(
            read_path(&g, InputFormat::GenericCsv, None, 1, opts)
                .unwrap()
                .records[0]
                .prompt_tokens,
            1
        );
    }

    #[test]
    fn a_line_longer_than_the_cap_stops_the_read_naming_it() {
        let mut text = b"arrival_ms,prompt_tokens,output_tokens,hash_ids\n0,1,1,\n1,1,1,".to_vec();
        text.resize(text.len() + MAX_LINE_BYTES as usize + 1, b'1');
        let r = read_generic_csv("t.csv".into(), &text[..], ReadOptions::default());
        assert!(
            matches!(r, Err(FormatError::LineTooLong { line: 3, .. })),
            "{r:?}"
        );
    }

    #[test]
    fn an_endless_input_stops_at_the_file_cap() {
        // Short lines forever: only the file cap ends it (a small one, to keep the test quick).
        let endless = std::io::repeat(b'\n');
        let head = "arrival_ms,prompt_tokens,output_tokens\n".as_bytes();
        let caps = Caps {
            file: 1 << 20,
            line: 64,
        };
        let r = read_generic_capped(
            "zero".into(),
            head.chain(endless),
            ReadOptions::default(),
            caps,
        );
        assert!(matches!(r, Err(FormatError::TooLarge { .. })), "{r:?}");
        assert_eq!(
            FormatError::TooLarge {
                file: "zero".into()
            }
            .to_string(),
            "trace `zero` is larger than 1073741824 bytes"
        );
    }

    proptest::proptest! {
        #[test]
        fn no_input_makes_the_readers_panic(
            body in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..400),
            header in 0usize..3,
        ) {
            let head: &[u8] = match header {
                0 => b"arrival_ms,prompt_tokens,output_tokens,hash_ids\n",
                1 => b"num_prefill_tokens,num_decode_tokens\n",
                _ => b"",
            };
            let text = [head, &body].concat();
            let a = Arrivals::Poisson { qps: 1.0 };
            for skip_bad_lines in [false, true] {
                let opts = ReadOptions { limit: None, skip_bad_lines };
                if let Ok(r) = read_generic_csv("p.csv".into(), &text[..], opts) {
                    proptest::prop_assert!(r.records.windows(2).all(|w| w[0].arrival_ms <= w[1].arrival_ms));
                    proptest::prop_assert!(r.records.iter().all(|r| r.prompt_tokens >= 1));
                }
                let _ = read_lengths_csv("p.csv".into(), &text[..], &a, 1, opts);
            }
            let _ = InputFormat::from_header(&text);
            let _ = String::from_utf8_lossy(&body).parse::<Arrivals>();
        }
    }
}
