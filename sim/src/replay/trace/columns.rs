//! What the CSV formats (Azure, generic, length-only) share: the reader's settings, columns
//! found by name, records offered one by one with their line numbers, fields and counts checked
//! with messages that name the column.

use std::io::Read;

use super::collector::{Collector, Fields};
use super::{shown, BadLine, TraceError};
use mstar_chunking::input::InputError;

/// A CSV reader over a trace's bounded input.
pub(super) fn reader<R: Read>(reader: R) -> csv::Reader<R> {
    csv::ReaderBuilder::new()
        .has_headers(true)
        // A short line is reported by the column it lacks, not as a CSV error.
        .flexible(true)
        .trim(csv::Trim::All)
        // Lines end at `\n` only, so that record positions count CRLF files' lines right; the
        // `\r` left at a line's end is trimmed as whitespace.
        .terminator(csv::Terminator::Any(b'\n'))
        .from_reader(reader)
}

/// Maps a CSV error: a limit passed and I/O end the read; a malformed record is a bad line.
fn error(c: &Collector, e: csv::Error, fallback_line: u64) -> TraceError {
    let line = e.position().map_or(fallback_line, csv::Position::line);
    match e.into_kind() {
        csv::ErrorKind::Io(source) => TraceError::input(c.file(), InputError::from_io(source)),
        csv::ErrorKind::Utf8 { err, .. } => TraceError::BadLine(c.bad(
            line,
            "line",
            format!("is not valid UTF-8 (in column {})", err.field() + 1),
        )),
        other => TraceError::BadLine(c.bad(
            line,
            "line",
            format!("is not a valid CSV record: {other:?}"),
        )),
    }
}

/// The column of each of `names` in the header (any order and case, a byte order mark and
/// spaces ignored).
///
/// # Errors
/// The header cannot be read, or a column is missing (a bad line 1).
pub(super) fn find<R: Read, const N: usize>(
    c: &Collector,
    rdr: &mut csv::Reader<R>,
    names: &[&str; N],
) -> Result<([usize; N], csv::StringRecord), TraceError> {
    let header = rdr.headers().cloned().map_err(|e| error(c, e, 1))?;
    let mut cols = [0usize; N];
    for (col, name) in cols.iter_mut().zip(names) {
        *col = position(&header, name).ok_or_else(|| {
            c.bad(
                1,
                name,
                format!(
                    "column is missing from the header (found {}); the {} format names {}",
                    shown(&header.iter().collect::<Vec<_>>().join(",")),
                    c.format(),
                    names.join(", ")
                ),
            )
        })?;
    }
    Ok((cols, header))
}

/// The column named `name`, if the header has it.
pub(super) fn position(header: &csv::StringRecord, name: &str) -> Option<usize> {
    header.iter().position(|h| {
        h.trim_start_matches('\u{feff}')
            .trim()
            .eq_ignore_ascii_case(name)
    })
}

/// Reads records until the end or the collector is full, handing each to `offer` (with its
/// 1-based line), which parses it and offers it to the collector; a blank line is no record, a
/// malformed one is offered as a bad line.
///
/// # Errors
/// A limit passed, an I/O error, or a bad record that is not skipped.
pub(super) fn each_record<R: Read>(
    c: &mut Collector,
    rdr: &mut csv::Reader<R>,
    fields: Fields,
    mut offer: impl FnMut(&mut Collector, &csv::StringRecord, u64) -> Result<(), TraceError>,
) -> Result<(), TraceError> {
    let mut record = csv::StringRecord::new();
    let mut line: u64 = 1;
    while !c.full() {
        match rdr.read_record(&mut record) {
            Ok(false) => break,
            Ok(true) => {
                line = record.position().map_or(line + 1, csv::Position::line);
                if record.iter().all(str::is_empty) {
                    continue;
                }
                offer(c, &record, line)?;
            }
            Err(e) => match error(c, e, line + 1) {
                TraceError::BadLine(bad) => {
                    line = bad.line;
                    c.offer(Err(bad), fields)?;
                }
                fatal => return Err(fatal),
            },
        }
    }
    Ok(())
}

/// The non-empty field of column `col`, named `name`.
pub(super) fn field<'r>(
    c: &Collector,
    r: &'r csv::StringRecord,
    col: usize,
    name: &str,
    line: u64,
) -> Result<&'r str, BadLine> {
    r.get(col)
        .filter(|v| !v.is_empty())
        .ok_or_else(|| c.bad(line, name, "is missing"))
}

/// A whole number of tokens in `[min, max]`.
pub(super) fn count(
    c: &Collector,
    r: &csv::StringRecord,
    (col, name): (usize, &str),
    line: u64,
    (min, max): (u64, u64),
) -> Result<u64, BadLine> {
    let v = field(c, r, col, name, line)?;
    let range = || format!("between {min} and {max} tokens");
    let digits = v.strip_prefix('+').unwrap_or(v);
    if !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) {
        return match digits.parse::<u64>() {
            Ok(n) if (min..=max).contains(&n) => Ok(n),
            _ => Err(c.bad(line, name, format!("must be {}, got {v}", range()))),
        };
    }
    Err(c.bad(
        line,
        name,
        format!(
            "must be a whole number of tokens ({}), got {}",
            range(),
            shown(v)
        ),
    ))
}
