//! The generic CSV, the format to convert one's own traces to:
//! `arrival_ms,prompt_tokens,output_tokens[,hash_ids][,priority]`.

use std::io::Read;

use super::collector::{Collector, Fields, Line, Time};
use super::{columns, BadLine, TraceError, HASH_BLOCK_TOKENS, MAX_INPUT_TOKENS, MAX_OUTPUT_TOKENS};
use crate::replay::arrivals::MAX_ARRIVAL_MS;
use mstar_chunking::input::Bounded;

const FIELDS: Fields = ["arrival_ms", "prompt_tokens", "output_tokens"];
const HASHES: &str = "hash_ids";
const PRIORITY: &str = "priority";

/// Reads a generic CSV trace into `c`: a header naming `arrival_ms`, `prompt_tokens`,
/// `output_tokens` and optionally `hash_ids` and `priority` (any order and case; other columns
/// ignored), then one request per line. `arrival_ms` is a number of ms from the trace's start
/// (fractions allowed), never decreasing; `hash_ids` is empty or one space-separated id per 512
/// prompt tokens (rounded up); `priority` is empty (0) or a whole number in `i32`, lower first.
///
/// # Errors
/// A limit passed, an I/O error, a missing column, or a bad line that is not skipped.
pub(super) fn read<R: Read>(c: &mut Collector, reader: Bounded<R>) -> Result<(), TraceError> {
    let mut rdr = columns::reader(reader);
    let (cols, header) = columns::find(c, &mut rdr, &FIELDS)?;
    let hash_col = columns::position(&header, HASHES);
    let priority_col = columns::position(&header, PRIORITY);
    // The last kept arrival as written, for the "goes back in time" message.
    let mut last_ms = 0.0_f64;
    let mut hashes = Vec::new();
    columns::each_record(c, &mut rdr, FIELDS, |c, r, line| {
        let parsed = parse(c, r, (cols, hash_col), line, last_ms, &mut hashes).and_then(|l| {
            let text = priority_col.and_then(|col| r.get(col)).unwrap_or("");
            Ok(Line {
                priority: priority(c, text, line)?,
                ..l
            })
        });
        let arrival_ms = match &parsed {
            Ok(Line {
                time: Time::Ms(ms), ..
            }) => Some(*ms),
            _ => None,
        };
        let kept = c.kept();
        c.offer(parsed, FIELDS)?;
        if let (true, Some(ms)) = (c.kept() > kept, arrival_ms) {
            last_ms = ms;
        }
        Ok(())
    })
}

fn parse<'h>(
    c: &Collector,
    r: &csv::StringRecord,
    (cols, hash_col): ([usize; 3], Option<usize>),
    line: u64,
    last_ms: f64,
    hashes: &'h mut Vec<u64>,
) -> Result<Line<'h>, BadLine> {
    let arrival_ms = arrival(c, r, cols[0], line, last_ms)?;
    let prompt = columns::count(c, r, (cols[1], FIELDS[1]), line, (1, MAX_INPUT_TOKENS))?;
    let output = columns::count(c, r, (cols[2], FIELDS[2]), line, (0, MAX_OUTPUT_TOKENS))?;
    hashes.clear();
    if let Some(text) = hash_col.and_then(|col| r.get(col)) {
        block_hashes(c, text, prompt, line, hashes)?;
    }
    Ok(Line {
        line,
        time: Time::Ms(arrival_ms),
        input: prompt,
        output,
        hashes,
        priority: 0,
    })
}

/// A `priority` cell: empty (0) or a whole number in `i32`.
fn priority(c: &Collector, text: &str, line: u64) -> Result<i32, BadLine> {
    let t = text.trim();
    if t.is_empty() {
        return Ok(0);
    }
    t.parse::<i32>().map_err(|_| {
        c.bad(
            line,
            PRIORITY,
            format!(
                "must be a whole number from {} to {}, got {:?}",
                i32::MIN,
                i32::MAX,
                t.chars().take(32).collect::<String>()
            ),
        )
    })
}

/// A time in ms, finite, in `[0, MAX_ARRIVAL_MS]`, not before `last_ms`.
fn arrival(
    c: &Collector,
    r: &csv::StringRecord,
    col: usize,
    line: u64,
    last_ms: f64,
) -> Result<f64, BadLine> {
    let name = FIELDS[0];
    let v = columns::field(c, r, col, name, line)?;
    let ms = v
        .parse::<f64>()
        .ok()
        .filter(|t| t.is_finite() && (0.0..=MAX_ARRIVAL_MS).contains(t))
        .ok_or_else(|| {
            c.bad(
                line,
                name,
                format!("must be a number of ms between 0 and {MAX_ARRIVAL_MS}, got {v:?}"),
            )
        })?;
    if c.kept() > 0 && ms < last_ms {
        return Err(c.bad(
            line,
            name,
            format!("goes back in time: {ms} ms, the request before arrived at {last_ms} ms"),
        ));
    }
    Ok(ms)
}

/// Space-separated block hashes into `ids`: none, or exactly one per 512 prompt tokens
/// (rounded up).
fn block_hashes(
    c: &Collector,
    text: &str,
    prompt: u64,
    line: u64,
    ids: &mut Vec<u64>,
) -> Result<(), BadLine> {
    for (i, word) in text.split_ascii_whitespace().enumerate() {
        let id = word.parse::<u64>().map_err(|_| {
            c.bad(
                line,
                HASHES,
                format!("entry {i} must be a whole number below 2^64, got {word:?}"),
            )
        })?;
        ids.push(id);
    }
    let blocks = prompt.div_ceil(u64::from(HASH_BLOCK_TOKENS));
    if !ids.is_empty() && ids.len() as u64 != blocks {
        return Err(c.bad(
            line,
            HASHES,
            format!(
                "has {} ids, but prompt_tokens {prompt} needs ceil({prompt}/{HASH_BLOCK_TOKENS}) = {blocks}",
                ids.len()
            ),
        ));
    }
    Ok(())
}
