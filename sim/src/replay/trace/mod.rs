//! Request traces (`docs/traces.md`): one reader per format, in a file of its own
//! (`azure`, `mooncake`, `generic`, `lengths`), each producing the same [`Request`]s
//! into one [`Trace`].
//!
//! Every reader has one interface: it reads its format from a `Bounded` reader (the crate's
//! one bounded input path: [`MAX_TRACE_BYTES`], [`MAX_LINE_BYTES`]) and offers each record to a
//! `Collector`, which applies the rules every format shares (token limits, arrivals that
//! never go back, block hashes per 512 tokens), numbers the requests, and refuses or skips bad
//! lines. A trace is read whole before the replay starts, so a bad line is reported, naming the
//! file, the line and the field, before any step runs. No input makes a reader panic.

use std::fmt;
use std::io::{BufRead, Read};
use std::ops::Range;
use std::path::Path;
use std::str::FromStr;

use serde::Serialize;

use super::arrivals::{Arrivals, ArrivalsError};
use mstar_chunking::input::{self, Bounded, InputError, Limits};

mod azure;
mod collector;
mod columns;
mod generic;
mod lengths;
mod mooncake;

pub use azure::parse_wall_clock;
use collector::Collector;

/// The bundled default trace: Azure LLM inference trace 2023, code (CC BY 4.0, Microsoft; see
/// `data/traces/AzureLLMInferenceTrace_code.csv.LICENSE.txt`). Its prompts are long enough that
/// chunking is visible under the demo budgets.
pub const BUNDLED_TRACE: &str =
    include_str!("../../../../data/traces/AzureLLMInferenceTrace_code.csv");

/// The name the bundled trace is reported under.
pub const BUNDLED_TRACE_NAME: &str = "bundled:AzureLLMInferenceTrace_code.csv";

/// Tokens one block hash covers (as in the Mooncake traces; the prefix cache's block size).
pub const HASH_BLOCK_TOKENS: u32 = 512;

/// The longest prompt replay materialises: its prepared input is really allocated, so a corrupt
/// count must not ask for gigabytes.
pub const MAX_INPUT_TOKENS: u64 = 1 << 24;

/// The most tokens one request may generate: each takes a simulated step, so a corrupt count must
/// not make a replay run for ever.
pub const MAX_OUTPUT_TOKENS: u64 = 1 << 20;

/// Bad lines kept verbatim (as messages) for the report when they are skipped.
const BAD_LINE_EXAMPLES: usize = 10;
/// The largest trace read, in bytes (4 GiB, `docs/config.md#limits`): reading streams, but a
/// bigger file is taken for a mistake. Counted as the bytes arrive, so a pipe or a growing
/// file is held to it too.
pub const MAX_TRACE_BYTES: u64 = 4 << 30;
/// The longest trace line (or CSV record), in bytes (1 MiB: a Mooncake line of the largest
/// prompt's 32,768 block hashes fits).
pub const MAX_LINE_BYTES: usize = 1 << 20;
/// Bytes read to detect a format from a header.
const SNIFF_BYTES: u64 = 64 * 1024;

/// What a trace read lets through.
const LIMITS: Limits = Limits {
    file_bytes: MAX_TRACE_BYTES,
    line_bytes: MAX_LINE_BYTES as u64,
};

/// `v` quoted, escaped and cut, for echoing a trace value in an error.
fn shown(v: &str) -> String {
    crate::config::problem::quote(v)
}

/// A trace file format: its `--format` name is [`TraceFormat::name`], its display a phrase.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TraceFormat {
    /// `TIMESTAMP, ContextTokens, GeneratedTokens`, wall-clock timestamps; `azure`.
    AzureCsv,
    /// `{"timestamp" (ms), "input_length", "output_length", "hash_ids"}` per line; `mooncake`.
    MooncakeJsonl,
    /// `arrival_ms,prompt_tokens,output_tokens[,hash_ids]`; `generic`.
    GenericCsv,
    /// `num_prefill_tokens,num_decode_tokens`, with generated arrivals; `lengths`.
    LengthsCsv,
}

impl TraceFormat {
    /// Every format, in the order `--format` lists them.
    pub const ALL: [Self; 4] = [
        Self::AzureCsv,
        Self::MooncakeJsonl,
        Self::GenericCsv,
        Self::LengthsCsv,
    ];

    /// The name `--format` takes, and the report prints.
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

    /// The format of `path`, by its extension alone: `.csv` (Azure) or `.jsonl` (Mooncake).
    pub fn of_path(path: &Path) -> Option<Self> {
        match path.extension()?.to_str()?.to_ascii_lowercase().as_str() {
            "csv" => Some(Self::AzureCsv),
            "jsonl" => Some(Self::MooncakeJsonl),
            _ => None,
        }
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

impl FromStr for TraceFormat {
    type Err = TraceError;

    /// Parses a `--format` name: `azure`, `mooncake`, `generic` or `lengths` (any case).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        Self::ALL
            .into_iter()
            .find(|f| f.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| TraceError::UnknownName(s.to_owned()))
    }
}

/// One request of a trace, whatever its format.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    /// The request's 0-based position among the trace's records (bad ones included), so a step
    /// log reads against the trace record by record.
    pub rid: u64,
    /// The 1-based line it was read from (its first line, for a CSV record over several).
    pub line: u64,
    /// Arrival, in ms since the trace's first request.
    pub arrival_ms: f64,
    /// Prompt tokens (at least 1).
    pub input_tokens: u32,
    /// Generated tokens, as the trace says (0 is replayed as 1: a prompt's final chunk always
    /// yields a token).
    pub output_tokens: u32,
    /// The request's block hashes in [`Trace::hashes`]' pool (empty for Azure traces).
    hashes: Range<usize>,
    /// Its priority under the `priority` order, lower first: the trace's `priority` field (the
    /// generic CSV, Mooncake), or `--priority-by`'s class; 0 otherwise.
    pub priority: i32,
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

/// Why a trace could not be read, or its format not chosen.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// The file cannot be opened or read.
    #[error("cannot read trace `{file}`: {source}")]
    Io {
        /// The trace file.
        file: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The path is not a regular file (a directory, a FIFO, a device).
    #[error("trace `{file}` is not a regular file (it is a {kind}); inputs must be regular files")]
    NotAFile {
        /// The trace file.
        file: String,
        /// What it is instead: `directory`, `FIFO`, `device`, ...
        kind: &'static str,
    },
    /// The file is larger than [`MAX_TRACE_BYTES`].
    #[error("trace `{file}` is larger than {MAX_TRACE_BYTES} bytes")]
    TooLarge {
        /// The trace file.
        file: String,
    },
    /// A line is longer than [`MAX_LINE_BYTES`] (in a CSV trace, which cannot skip it).
    #[error("trace `{file}`:{line}: the line is longer than {MAX_LINE_BYTES} bytes")]
    LineTooLong {
        /// The trace file.
        file: String,
        /// The 1-based line.
        line: u64,
    },
    /// `--format` named no known format.
    #[error("`--format` {0:?} is not a trace format; expected one of `azure`, `mooncake`, `generic`, `lengths`")]
    UnknownName(String),
    /// Neither `--format` nor the file's header or extension said what the file is.
    #[error("trace `{file}`: unknown format; its first line is not a header of a known format (`TIMESTAMP,ContextTokens,GeneratedTokens`, `arrival_ms,prompt_tokens,output_tokens`, `num_prefill_tokens,num_decode_tokens`) nor a Mooncake JSON object; name one with `--format`")]
    Unknown {
        /// The trace file.
        file: String,
    },
    /// [`Trace::read_path`] was given a file neither `.csv` nor `.jsonl`.
    #[error(
        "trace `{file}`: unknown format; expected a `.csv` (Azure) or `.jsonl` (Mooncake) file"
    )]
    UnknownExtension {
        /// The trace file.
        file: String,
    },
    /// A bad line (without `--skip-bad-lines`).
    #[error("bad trace line: {0}")]
    BadLine(#[from] BadLine),
    /// `--format` or `--arrivals` was given without `--trace`: the bundled trace is an Azure
    /// CSV with its own arrival times.
    #[error("{flag} applies to a trace given with `--trace`; the bundled trace is an Azure CSV with its own arrival times")]
    Bundled {
        /// The flag given.
        flag: &'static str,
    },
    /// No request was read.
    #[error("trace `{file}` has no requests{}", if *.skipped > 0 { format!(" ({} skipped)", crate::text::plural(*.skipped as u64, "bad line")) } else { String::new() })]
    Empty {
        /// The trace file.
        file: String,
        /// Bad lines skipped.
        skipped: usize,
    },
    /// A length-only trace was given no `--arrivals`.
    #[error("trace `{file}` has lengths only (`num_prefill_tokens,num_decode_tokens`): generate its arrivals with `--arrivals poisson:QPS` or `--arrivals gamma:QPS:CV`")]
    NeedsArrivals {
        /// The trace file.
        file: String,
    },
    /// `--arrivals` was given for a trace that has its own times.
    #[error("trace `{file}` ({}) has its own arrival times; `--arrivals` applies only to length-only traces", .format.name())]
    HasArrivals {
        /// The trace file.
        file: String,
        /// Its format.
        format: TraceFormat,
    },
    /// The arrivals could not be generated.
    #[error(transparent)]
    Arrivals(#[from] ArrivalsError),
}

impl TraceError {
    /// The error of a bounded read of `file`: the limit it hit, or why it could not be read.
    fn input(file: &str, e: InputError) -> Self {
        let file = file.to_owned();
        match e {
            InputError::Io(source) => Self::Io { file, source },
            InputError::NotRegular(kind) => Self::NotAFile { file, kind },
            InputError::TooLarge { .. } => Self::TooLarge { file },
            InputError::LineTooLong { line, .. } => Self::LineTooLong { file, line },
            other @ InputError::NotUtf8(_) => Self::Io {
                file,
                source: std::io::Error::other(other.to_string()),
            },
        }
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

/// A path as trace errors name it: escaped, so a file name with control characters cannot
/// garble the message.
fn file_name(path: &Path) -> String {
    crate::config::problem::escape(&path.display().to_string())
}

/// Chooses the format of the trace at `path`: `forced` when given (`--format`), else what its
/// header says ([`TraceFormat::from_header`]), else its extension (`.jsonl`: Mooncake).
///
/// # Errors
/// The file cannot be opened or is not a regular file, or nothing tells its format.
pub fn choose_format(path: &Path, forced: Option<TraceFormat>) -> Result<TraceFormat, TraceError> {
    if let Some(f) = forced {
        return Ok(f);
    }
    let file = file_name(path);
    let mut head = Vec::new();
    input::open_regular(path)
        .map_err(|e| TraceError::input(&file, e))?
        .take(SNIFF_BYTES)
        .read_to_end(&mut head)
        .map_err(|source| TraceError::Io {
            file: file.clone(),
            source,
        })?;
    if let Some(f) = TraceFormat::from_header(&head) {
        return Ok(f);
    }
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    if ext.eq_ignore_ascii_case("jsonl") {
        return Ok(TraceFormat::MooncakeJsonl);
    }
    Err(TraceError::Unknown { file })
}

impl Trace {
    /// The block hashes of `request`, one per 512 prompt tokens (empty when its trace has none).
    pub fn hashes(&self, request: &Request) -> &[u64] {
        self.hash_pool.get(request.hashes.clone()).unwrap_or(&[])
    }

    /// Whether the trace carries block hashes at all.
    pub fn has_hashes(&self) -> bool {
        !self.hash_pool.is_empty()
    }

    /// Reads the trace at `path`; its format comes from the extension alone (`.csv` Azure,
    /// `.jsonl` Mooncake).
    ///
    /// # Errors
    /// The file cannot be read, has an unknown extension, a bad line (unless skipped), or no
    /// requests.
    pub fn read_path(path: &Path, opts: ReadOptions) -> Result<Self, TraceError> {
        let file = file_name(path);
        let format = TraceFormat::of_path(path)
            .ok_or_else(|| TraceError::UnknownExtension { file: file.clone() })?;
        let reader = input::open_bounded(path, LIMITS).map_err(|e| TraceError::input(&file, e))?;
        read_bounded(file, format, reader, None, 0, opts)
    }

    /// Reads the trace at `path` in any format (`docs/traces.md`): `forced`
    /// (`--format`) or the format its header or extension says; a length-only trace's arrivals
    /// are generated from `arrivals` and `seed`, which any other format refuses.
    ///
    /// # Errors
    /// The format cannot be told; arrivals missing for a length-only trace or given for one
    /// with its own times; the file cannot be read, has a bad line (unless skipped), or no
    /// requests.
    pub fn load(
        path: &Path,
        forced: Option<TraceFormat>,
        arrivals: Option<&Arrivals>,
        seed: u64,
        opts: ReadOptions,
    ) -> Result<Self, TraceError> {
        let format = choose_format(path, forced)?;
        let file = file_name(path);
        check_arrivals(&file, format, arrivals)?;
        let reader = input::open_bounded(path, LIMITS).map_err(|e| TraceError::input(&file, e))?;
        read_bounded(file, format, reader, arrivals, seed, opts)
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

    /// Reads a trace of `format` from `reader`; `file` names it in errors. A length-only trace
    /// needs generated arrivals: read it with [`Trace::load`].
    ///
    /// # Errors
    /// An I/O error, a limit passed, a bad line (unless skipped), no requests, or a length-only
    /// trace.
    pub fn read<R: BufRead>(
        file: String,
        format: TraceFormat,
        reader: R,
        opts: ReadOptions,
    ) -> Result<Self, TraceError> {
        check_arrivals(&file, format, None)?;
        read_bounded(file, format, Bounded::new(reader, LIMITS), None, 0, opts)
    }
}

/// Refuses arrivals a format does not take, and their absence where it needs them.
fn check_arrivals(
    file: &str,
    format: TraceFormat,
    arrivals: Option<&Arrivals>,
) -> Result<(), TraceError> {
    let file = file.to_owned();
    match (format.needs_arrivals(), arrivals) {
        (true, None) => Err(TraceError::NeedsArrivals { file }),
        (false, Some(_)) => Err(TraceError::HasArrivals { file, format }),
        _ => Ok(()),
    }
}

/// The one path every trace takes: its format's reader offers each record to a [`Collector`].
fn read_bounded<R: BufRead>(
    file: String,
    format: TraceFormat,
    reader: Bounded<R>,
    arrivals: Option<&Arrivals>,
    seed: u64,
    opts: ReadOptions,
) -> Result<Trace, TraceError> {
    let mut c = Collector::new(file, format, opts);
    match (format, arrivals) {
        (TraceFormat::AzureCsv, _) => azure::read(&mut c, reader)?,
        (TraceFormat::MooncakeJsonl, _) => mooncake::read(&mut c, reader)?,
        (TraceFormat::GenericCsv, _) => generic::read(&mut c, reader)?,
        (TraceFormat::LengthsCsv, Some(a)) => lengths::read(&mut c, reader, a, seed)?,
        (TraceFormat::LengthsCsv, None) => {
            return Err(TraceError::NeedsArrivals {
                file: c.file().to_owned(),
            })
        }
    }
    c.finish()
}

#[cfg(test)]
mod tests;
