//! The Azure LLM inference trace CSV: `TIMESTAMP, ContextTokens, GeneratedTokens`, wall-clock
//! timestamps (the bundled trace is one).

use std::io::Read;

use super::collector::{Collector, Fields, Line, Time};
use super::{
    columns, shown, BadLine, TraceError, MAX_INPUT_TOKENS, MAX_LINE_BYTES, MAX_OUTPUT_TOKENS,
};
use mstar_chunking::input::Bounded;

const FIELDS: Fields = ["TIMESTAMP", "ContextTokens", "GeneratedTokens"];

/// Reads an Azure trace into `c`.
///
/// # Errors
/// A limit passed, an I/O error, a missing column, or a bad line that is not skipped.
pub(super) fn read<R: Read>(c: &mut Collector, reader: Bounded<R>) -> Result<(), TraceError> {
    let mut rdr = columns::reader(reader);
    let (cols, _) = columns::find(c, &mut rdr, &FIELDS)?;
    columns::each_record(c, &mut rdr, FIELDS, |c, r, line| {
        let parsed = if r.as_slice().len() > MAX_LINE_BYTES {
            // A quoted field may carry a record over several lines.
            Err(c.bad(
                line,
                "line",
                format!("is longer than {MAX_LINE_BYTES} bytes"),
            ))
        } else {
            parse(c, r, cols, line)
        };
        c.offer(parsed, FIELDS)
    })
}

fn parse(
    c: &Collector,
    r: &csv::StringRecord,
    cols: [usize; 3],
    line: u64,
) -> Result<Line<'static>, BadLine> {
    let ts = columns::field(c, r, cols[0], FIELDS[0], line)?;
    let ns = parse_wall_clock(ts).map_err(|why| {
        c.bad(
            line,
            FIELDS[0],
            format!(
                "{why}, got {} (expected e.g. \"2023-11-16 18:17:03.9799600\")",
                shown(ts)
            ),
        )
    })?;
    let input = columns::count(c, r, (cols[1], FIELDS[1]), line, (1, MAX_INPUT_TOKENS))?;
    let output = columns::count(c, r, (cols[2], FIELDS[2]), line, (0, MAX_OUTPUT_TOKENS))?;
    Ok(Line {
        line,
        time: Time::WallNs(ns),
        input,
        output,
        hashes: &[],
        priority: 0,
    })
}

/// Parses `YYYY-MM-DD HH:MM:SS[.fffffffff]` (a `T` may separate date and time) into ns since the
/// Unix epoch. The Azure traces carry 7 fractional digits; any 0 to 9 are accepted.
///
/// # Errors
/// What is wrong with `s`, as a phrase (`"has a bad hour"`).
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
        .ok_or("is outside the supported range 1677-09-22 to 2262-04-11 (docs/config-replay.md#traces)")
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
