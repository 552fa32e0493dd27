//! The Mooncake trace JSON Lines: `{"timestamp" (ms), "input_length", "output_length",
//! "hash_ids"}` per line, and optionally `"priority"` (a whole number in `i32`, lower first;
//! absent or null: 0), blank lines ignored.

use std::io::BufRead;

use serde::Deserialize;
use serde_json::Value;

use super::collector::{Collector, Fields, Line, Time};
use super::{BadLine, TraceError, HASH_BLOCK_TOKENS, MAX_LINE_BYTES};
use mstar_chunking::input::{self, Bounded};

const FIELDS: Fields = ["timestamp", "input_length", "output_length"];

/// A JSON value as written, cut, for echoing it in an error.
fn shown_json(v: &Value) -> String {
    crate::config::problem::escape(&v.to_string())
}

/// One Mooncake line, every field loosely typed so that a bad value is reported by field name.
#[derive(Deserialize)]
struct MooncakeLine {
    timestamp: Option<Value>,
    input_length: Option<Value>,
    output_length: Option<Value>,
    hash_ids: Option<Value>,
    priority: Option<Value>,
}

/// Reads a Mooncake trace into `c`. A line longer than [`MAX_LINE_BYTES`] or not UTF-8 is a bad
/// line: lines stand alone, so one can be skipped.
///
/// # Errors
/// The file limit passed, an I/O error, or a bad line that is not skipped.
pub(super) fn read<R: BufRead>(
    c: &mut Collector,
    mut reader: Bounded<R>,
) -> Result<(), TraceError> {
    let mut hashes: Vec<u64> = Vec::new();
    while !c.full() {
        let next = reader
            .next_line()
            .map_err(|e| TraceError::input(c.file(), input::InputError::from_io(e)))?;
        let Some((line, next)) = next else { break };
        let parsed = match next {
            input::Line::Text(text) if text.trim().is_empty() => continue,
            input::Line::Text(text) => {
                parse(c, text, line, &mut hashes).map(|(time, input, output, priority)| Line {
                    line,
                    time,
                    input,
                    output,
                    hashes: &hashes,
                    priority,
                })
            }
            input::Line::TooLong => Err(c.bad(
                line,
                "line",
                format!("is longer than {MAX_LINE_BYTES} bytes"),
            )),
            input::Line::NotUtf8 => Err(c.bad(line, "line", "is not UTF-8 text")),
        };
        c.offer(parsed, FIELDS)?;
    }
    Ok(())
}

fn parse(
    c: &Collector,
    text: &str,
    line: u64,
    hashes: &mut Vec<u64>,
) -> Result<(Time, u64, u64, i32), BadLine> {
    let v: MooncakeLine = serde_json::from_str(text)
        .map_err(|e| c.bad(line, "line", format!("is not a Mooncake JSON object: {e}")))?;
    let missing = |f: &str| c.bad(line, f, "is missing");
    let time = v.timestamp.ok_or_else(|| missing("timestamp"))?;
    // Whole numbers stay exact (epoch nanoseconds exceed what an f64 holds exactly); arrivals
    // are taken relative to the first request before they become floating point.
    let time = match time.as_u64() {
        Some(n) => Time::MsWhole(n),
        None => Time::Ms(
            time.as_f64()
                .filter(|t| t.is_finite() && *t >= 0.0)
                .ok_or_else(|| {
                    c.bad(
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
            c.bad(
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
        c.bad(
            line,
            "hash_ids",
            format!("must be a list of block hashes, got {}", shown_json(&ids)),
        )
    })?;
    for (i, h) in ids.iter().enumerate() {
        let h = h.as_u64().ok_or_else(|| {
            c.bad(
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
        return Err(c.bad(
            line,
            "hash_ids",
            format!(
                "is empty, but input_length {input} needs ceil({input}/{HASH_BLOCK_TOKENS}) ids"
            ),
        ));
    }
    let priority = match v.priority {
        None | Some(Value::Null) => 0,
        Some(p) => p
            .as_i64()
            .and_then(|p| i32::try_from(p).ok())
            .ok_or_else(|| {
                c.bad(
                    line,
                    "priority",
                    format!(
                        "must be a whole number from {} to {}, got {}",
                        i32::MIN,
                        i32::MAX,
                        shown_json(&p)
                    ),
                )
            })?,
    };
    Ok((time, input, output, priority))
}
