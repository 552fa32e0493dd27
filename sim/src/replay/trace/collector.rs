//! The rules every trace format shares, applied to each record a format's reader offers: token
//! limits, arrivals counted from the first request and never going back, one block hash per
//! 512 prompt tokens; the request numbering, the `limit`, and bad lines refused or skipped.

use super::{
    BadLine, ReadOptions, Request, Trace, TraceError, TraceFormat, BAD_LINE_EXAMPLES,
    HASH_BLOCK_TOKENS, MAX_INPUT_TOKENS, MAX_OUTPUT_TOKENS,
};

/// A record's values, parsed by a format's reader, before the shared rules make it a
/// [`Request`].
pub(super) struct Line<'a> {
    /// The 1-based line it was read from.
    pub line: u64,
    pub time: Time,
    pub input: u64,
    pub output: u64,
    pub hashes: &'a [u64],
    /// Its priority, where the format has the field (0 otherwise).
    pub priority: i32,
}

/// An arrival as a format writes it; [`Collector`] counts every one from the first request's.
pub(super) enum Time {
    /// Azure: ns since the Unix epoch.
    WallNs(i64),
    /// ms, with a fraction (Mooncake, generic CSV; generated arrivals).
    Ms(f64),
    /// A Mooncake timestamp written as a whole number of ms: kept exact (epoch nanoseconds
    /// exceed what an f64 holds exactly) until taken relative to the first.
    MsWhole(u64),
}

/// The names a format gives the time, prompt and output fields, for messages.
pub(super) type Fields = [&'static str; 3];

/// Collects one trace's requests and bad lines.
pub(super) struct Collector {
    trace: Trace,
    opts: ReadOptions,
    /// The rid the next record offered takes (bad records take one too).
    next_rid: u64,
    /// The first Azure timestamp, ns since the epoch: arrivals count from it.
    first_ns: Option<i64>,
    /// The first timestamp in ms, whole and as written: arrivals count from it.
    first_ms: Option<(i128, f64)>,
    last_ms: f64,
}

impl Collector {
    pub fn new(file: String, format: TraceFormat, opts: ReadOptions) -> Self {
        Self {
            trace: Trace {
                file,
                format,
                requests: Vec::new(),
                skipped_lines: 0,
                bad_line_examples: Vec::new(),
                hash_pool: Vec::new(),
            },
            opts,
            next_rid: 0,
            first_ns: None,
            first_ms: None,
            last_ms: 0.0,
        }
    }

    /// The trace file, as errors name it.
    pub fn file(&self) -> &str {
        &self.trace.file
    }

    /// The format being read.
    pub fn format(&self) -> TraceFormat {
        self.trace.format
    }

    /// Whether `limit` requests are kept: the reader stops.
    pub fn full(&self) -> bool {
        self.opts
            .limit
            .is_some_and(|n| self.trace.requests.len() >= n)
    }

    /// Requests kept so far.
    pub fn kept(&self) -> usize {
        self.trace.requests.len()
    }

    /// A bad line of this trace.
    pub fn bad(&self, line: u64, field: &str, problem: impl Into<String>) -> BadLine {
        BadLine {
            file: self.trace.file.clone(),
            line,
            field: field.to_owned(),
            problem: problem.into(),
        }
    }

    /// Offers one record, as parsed: it takes the next rid, kept or not; a good one is kept if
    /// it passes the shared rules, a bad one refused or skipped.
    ///
    /// # Errors
    /// The record is bad and bad lines are not skipped.
    pub fn offer(
        &mut self,
        parsed: Result<Line<'_>, BadLine>,
        fields: Fields,
    ) -> Result<(), TraceError> {
        let rid = self.next_rid;
        self.next_rid += 1;
        match parsed.and_then(|l| self.push(rid, l, fields)) {
            Ok(()) => Ok(()),
            Err(bad) => self.refuse(bad),
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

    /// The first timestamp in ms, set by the first record to ask.
    fn first_ms(&mut self, whole: i128, ms: f64) -> (i128, f64) {
        *self.first_ms.get_or_insert((whole, ms))
    }

    /// Checks a parsed record against the rules every format shares and keeps it.
    fn push(&mut self, rid: u64, l: Line<'_>, fields: Fields) -> Result<(), BadLine> {
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
            // Relative to the first request: epoch timestamps start at 0 too.
            Time::Ms(ms) => ms - self.first_ms(i128::from(ms as u64), ms).1,
            Time::MsWhole(n) => {
                let (first, _) = self.first_ms(i128::from(n), n as f64);
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
                    "has {} ids, but {input_field} {} needs ceil({}/{HASH_BLOCK_TOKENS}) = {blocks}",
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
            rid,
            line: l.line,
            arrival_ms,
            input_tokens: l.input as u32,
            output_tokens: l.output as u32,
            hashes: start..self.trace.hash_pool.len(),
            priority: l.priority,
        });
        Ok(())
    }

    /// Gives the kept requests, in order, the arrival times `times_ms` (generated for a trace
    /// without its own), counted from the first.
    pub fn set_arrivals(&mut self, times_ms: &[f64]) {
        let first = times_ms.first().copied().unwrap_or(0.0);
        for (r, t) in self.trace.requests.iter_mut().zip(times_ms) {
            r.arrival_ms = (t - first).max(0.0);
        }
    }

    /// The trace, or [`TraceError::Empty`] when no request was kept.
    pub fn finish(self) -> Result<Trace, TraceError> {
        if self.trace.requests.is_empty() {
            return Err(TraceError::Empty {
                file: self.trace.file,
                skipped: self.trace.skipped_lines,
            });
        }
        Ok(self.trace)
    }
}
