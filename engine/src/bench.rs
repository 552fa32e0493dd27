//! `mstar-engine bench`: replays a trace in real time against a server's
//! `POST /v1/completions` with one streaming client per request, and reports time to first
//! token, time between tokens and end-to-end latency as `replay`'s report does (nearest-rank
//! p50/p90/p99/max in ms), plus throughput.
//!
//! Traces: the generic CSV (`arrival_ms,prompt_tokens,output_tokens[,hash_ids]`) and the Azure
//! CSV (`TIMESTAMP,ContextTokens,GeneratedTokens`), told apart by their header. The trace
//! readers are the simulator's (`mstar-chunking-sim`), which an engine does not depend on, so
//! this is a small reader of its own. `--write-trace` writes the scaled
//! requests as a generic CSV, so `mstar-chunking replay` can simulate exactly what was sent.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use clap::Args;
use futures_util::StreamExt;
use serde::Serialize;
use serde_json::json;

/// `bench` arguments.
#[derive(Args, Debug, Clone)]
pub struct BenchArgs {
    /// The server's base URL.
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    pub url: String,
    /// The trace: generic CSV or Azure CSV.
    #[arg(long)]
    pub trace: PathBuf,
    /// Send only the first N requests.
    #[arg(long)]
    pub requests: Option<usize>,
    /// Multiply the arrival rate (2.0 = twice as dense).
    #[arg(long, default_value_t = 1.0)]
    pub rate_scale: f64,
    /// Multiply prompt and output lengths.
    #[arg(long, default_value_t = 1.0)]
    pub length_scale: f64,
    /// Cap prompts at this many tokens (after scaling).
    #[arg(long, default_value_t = 2000)]
    pub max_prompt: u32,
    /// Cap outputs at this many tokens (after scaling).
    #[arg(long, default_value_t = 256)]
    pub max_output: u32,
    /// Seed of the prompts' bytes.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Give up on the run after this many seconds (above 0, at most a week); every request
    /// must arrive within it.
    #[arg(long, default_value_t = 600.0, value_parser = parse_timeout, allow_negative_numbers = true)]
    pub timeout_secs: f64,
    /// Write the report as JSON here.
    #[arg(long)]
    pub report_json: Option<PathBuf>,
    /// Write the scaled requests as a generic CSV trace here (for `mstar-chunking replay`).
    #[arg(long)]
    pub write_trace: Option<PathBuf>,
}

/// The largest trace file `bench` reads.
pub const MAX_TRACE_BYTES: u64 = 1 << 30;
/// The most requests a trace may hold.
pub const MAX_TRACE_REQUESTS: usize = 1_000_000;
/// The longest `--timeout-secs`: a week.
pub const MAX_TIMEOUT_SECS: f64 = 7.0 * 86_400.0;

/// `--timeout-secs`: a finite number of seconds above 0, at most [`MAX_TIMEOUT_SECS`].
fn parse_timeout(s: &str) -> Result<f64, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("`{s}` is not a number of seconds"))?;
    if !(v.is_finite() && v > 0.0 && v <= MAX_TIMEOUT_SECS) {
        return Err(format!(
            "`{s}`: must be a number of seconds above 0 and at most {MAX_TIMEOUT_SECS}"
        ));
    }
    Ok(v)
}

/// One request of a trace.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TraceRequest {
    /// Arrival, ms from the trace's start.
    pub arrival_ms: f64,
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Output tokens.
    pub output_tokens: u32,
}

/// Reads a generic or Azure CSV trace.
///
/// # Errors
/// The file does not read, or a line is malformed (named by file and line).
pub fn read_trace(path: &Path) -> Result<Vec<TraceRequest>, String> {
    let shown = path.display();
    crate::files::check_input(path, "--trace", MAX_TRACE_BYTES)?;
    let file = std::fs::File::open(path).map_err(|e| format!("{shown}: {e}"))?;
    // Counted as it is read too: a file that grows past the limit is refused as well.
    let mut rdr = csv::ReaderBuilder::new()
        .trim(csv::Trim::All)
        .from_reader(std::io::Read::take(file, MAX_TRACE_BYTES + 1));
    let headers: Vec<String> = rdr
        .headers()
        .map_err(|e| format!("{shown}: {e}"))?
        .iter()
        .map(|h| h.trim_start_matches('\u{feff}').to_ascii_lowercase())
        .collect();
    let col = |name: &str| headers.iter().position(|h| h == name);
    let (generic, a, p, o) = if let (Some(a), Some(p), Some(o)) = (
        col("arrival_ms"),
        col("prompt_tokens"),
        col("output_tokens"),
    ) {
        (true, a, p, o)
    } else if let (Some(a), Some(p), Some(o)) = (
        col("timestamp"),
        col("contexttokens"),
        col("generatedtokens"),
    ) {
        (false, a, p, o)
    } else {
        return Err(format!(
            "{shown}:1: expected a generic header (arrival_ms,prompt_tokens,output_tokens) or an Azure header (TIMESTAMP,ContextTokens,GeneratedTokens)"
        ));
    };
    let mut out = Vec::new();
    let mut first_ts: Option<f64> = None;
    for (i, rec) in rdr.records().enumerate() {
        let line = i + 2;
        let rec = rec.map_err(|e| format!("{shown}:{line}: {e}"))?;
        if out.len() == MAX_TRACE_REQUESTS {
            return Err(format!(
                "{shown}:{line}: more than {MAX_TRACE_REQUESTS} requests, the most a trace may hold"
            ));
        }
        let field = |c: usize, what: &str| -> Result<&str, String> {
            rec.get(c)
                .ok_or_else(|| format!("{shown}:{line}: no `{what}` column"))
        };
        let num = |c: usize, what: &str| -> Result<u32, String> {
            let f = field(c, what)?;
            f.parse::<u32>()
                .map_err(|_| format!("{shown}:{line}: `{what}` is `{f}`, not a whole number"))
        };
        let arrival = if generic {
            let f = field(a, "arrival_ms")?;
            f.parse::<f64>()
                .ok()
                .filter(|x| x.is_finite() && *x >= 0.0)
                .ok_or_else(|| {
                    format!("{shown}:{line}: `arrival_ms` is `{f}`, not a number of ms ≥ 0")
                })?
        } else {
            let f = field(a, "TIMESTAMP")?;
            let t = azure_ms(f).ok_or_else(|| {
                format!("{shown}:{line}: `TIMESTAMP` is `{f}`, not YYYY-MM-DD HH:MM:SS[.f]")
            })?;
            t - *first_ts.get_or_insert(t)
        };
        if let Some(prev) = out.last().map(|r: &TraceRequest| r.arrival_ms) {
            if arrival < prev {
                return Err(format!(
                    "{shown}:{line}: arrival {arrival} ms goes back (previous {prev} ms)"
                ));
            }
        }
        let prompt = num(
            p,
            if generic {
                "prompt_tokens"
            } else {
                "ContextTokens"
            },
        )?;
        if prompt == 0 {
            return Err(format!("{shown}:{line}: a prompt of 0 tokens"));
        }
        out.push(TraceRequest {
            arrival_ms: arrival,
            prompt_tokens: prompt,
            output_tokens: num(
                o,
                if generic {
                    "output_tokens"
                } else {
                    "GeneratedTokens"
                },
            )?,
        });
    }
    if rdr.position().byte() > MAX_TRACE_BYTES {
        return Err(format!(
            "{shown}: more than {MAX_TRACE_BYTES} bytes, the most a trace may have"
        ));
    }
    Ok(out)
}

/// ms since the Unix epoch of an Azure `YYYY-MM-DD HH:MM:SS[.fffffff]` timestamp.
fn azure_ms(s: &str) -> Option<f64> {
    let (date, time) = s.split_once([' ', 'T'])?;
    let mut d = date.split('-').map(|x| x.parse::<i64>().ok());
    let (y, m, day) = (d.next()??, d.next()??, d.next()??);
    let mut t = time.split(':');
    let (hh, mm) = (
        t.next()?.parse::<f64>().ok()?,
        t.next()?.parse::<f64>().ok()?,
    );
    let ss = t.next()?.parse::<f64>().ok()?;
    if !(1..=12).contains(&m) || !(1..=31).contains(&day) {
        return None;
    }
    // Days from the civil date (Howard Hinnant's algorithm).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(((days as f64 * 24.0 + hh) * 60.0 + mm) * 60_000.0 + ss * 1000.0)
}

/// The trace as sent: arrivals divided by the rate scale, lengths scaled and capped (≥ 1).
pub fn scale(trace: &[TraceRequest], a: &BenchArgs) -> Vec<TraceRequest> {
    let n = a.requests.unwrap_or(trace.len()).min(trace.len());
    trace[..n]
        .iter()
        .map(|r| TraceRequest {
            arrival_ms: r.arrival_ms / a.rate_scale,
            prompt_tokens: ((f64::from(r.prompt_tokens) * a.length_scale).round() as u32)
                .clamp(1, a.max_prompt.max(1)),
            output_tokens: ((f64::from(r.output_tokens) * a.length_scale).round() as u32)
                .clamp(1, a.max_output.max(1)),
        })
        .collect()
}

/// Nearest-rank percentiles in ms, as `replay` reports them.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Latency {
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Largest.
    pub max: f64,
    /// Samples.
    pub samples: usize,
}

impl Latency {
    /// Percentiles of `v` (sorted in place); `None` when empty.
    pub fn of(v: &mut [f64]) -> Option<Self> {
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        let n = v.len();
        let rank = |p: f64| {
            let x = v[((p * n as f64).ceil() as usize).clamp(1, n) - 1];
            (x * 1000.0).round() / 1000.0
        };
        Some(Latency {
            p50: rank(0.5),
            p90: rank(0.9),
            p99: rank(0.99),
            max: rank(1.0),
            samples: n,
        })
    }
}

/// What one streamed request measured.
#[derive(Debug, Default, Clone)]
pub struct Measured {
    /// ms from arrival to the first token.
    pub ttft_ms: Option<f64>,
    /// ms between consecutive tokens.
    pub tbt_ms: Vec<f64>,
    /// ms from arrival to `[DONE]`.
    pub e2e_ms: Option<f64>,
    /// Tokens received.
    pub tokens: u32,
    /// An error, if the request failed.
    pub error: Option<String>,
}

/// Sends one streaming completion of `prompt` token ids and measures it from `arrived`.
pub async fn stream_one(
    client: &reqwest::Client,
    url: &str,
    prompt: Vec<u32>,
    max_tokens: u32,
    arrived: Instant,
) -> Measured {
    let mut m = Measured::default();
    let body = json!({
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "stream": true, "ignore_eos": true,
    });
    let resp = match client
        .post(format!("{url}/v1/completions"))
        .json(&body)
        .send()
        .await
    {
        Ok(r) => r,
        Err(e) => {
            m.error = Some(e.to_string());
            return m;
        }
    };
    if !resp.status().is_success() {
        m.error = Some(format!("HTTP {}", resp.status()));
        return m;
    }
    let mut stream = resp.bytes_stream();
    let mut buf = Vec::new();
    let mut last: Option<Instant> = None;
    while let Some(chunk) = stream.next().await {
        let chunk = match chunk {
            Ok(c) => c,
            Err(e) => {
                m.error = Some(e.to_string());
                return m;
            }
        };
        let now = Instant::now();
        buf.extend_from_slice(&chunk);
        while let Some(pos) = buf.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = buf.drain(..pos + 2).collect();
            let text = String::from_utf8_lossy(&event);
            let Some(data) = text.trim().strip_prefix("data: ") else {
                continue;
            };
            if data == "[DONE]" {
                m.e2e_ms = Some((now - arrived).as_secs_f64() * 1000.0);
                return m;
            }
            let v: serde_json::Value = match serde_json::from_str(data) {
                Ok(v) => v,
                Err(e) => {
                    m.error = Some(format!("bad event: {e}"));
                    return m;
                }
            };
            // The last event carries usage and no new token.
            if v.get("usage").is_some_and(|u| !u.is_null()) {
                continue;
            }
            m.tokens += 1;
            match last {
                None => m.ttft_ms = Some((now - arrived).as_secs_f64() * 1000.0),
                Some(p) => m.tbt_ms.push((now - p).as_secs_f64() * 1000.0),
            }
            last = Some(now);
        }
    }
    m.error = Some("the stream ended without [DONE]".into());
    m
}

/// A prompt of `n` tokens: BOS and seeded printable bytes.
pub fn prompt_of(n: u32, seed: u64) -> Vec<u32> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|i| {
            if i == 0 {
                return crate::model::BOS;
            }
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            32 + (x % 95) as u32
        })
        .collect()
}

/// Runs the load and returns the report.
///
/// # Errors
/// The trace does not read, or an output cannot be written.
pub async fn run_async(a: &BenchArgs) -> Result<serde_json::Value, String> {
    if !(a.rate_scale > 0.0 && a.rate_scale.is_finite()) {
        return Err(format!("--rate-scale {}: must be > 0", a.rate_scale));
    }
    if !(a.length_scale > 0.0 && a.length_scale.is_finite()) {
        return Err(format!("--length-scale {}: must be > 0", a.length_scale));
    }
    if !(a.timeout_secs.is_finite() && a.timeout_secs > 0.0 && a.timeout_secs <= MAX_TIMEOUT_SECS) {
        return Err(format!(
            "--timeout-secs {}: must be a number of seconds above 0 and at most {MAX_TIMEOUT_SECS}",
            a.timeout_secs
        ));
    }
    for (flag, out) in [
        ("--report-json", &a.report_json),
        ("--write-trace", &a.write_trace),
    ] {
        if let Some(p) = out {
            crate::files::check_output(p, flag, &[("--trace", &a.trace)])?;
        }
    }
    if let (Some(r), Some(w)) = (&a.report_json, &a.write_trace) {
        if same_file::is_same_file(r, w).unwrap_or(false) || r == w {
            return Err(format!(
                "--report-json {}: is also the --write-trace file",
                r.display()
            ));
        }
    }
    let trace = scale(&read_trace(&a.trace)?, a);
    // Every request must arrive within the run: a later one could never be sent.
    if let Some((i, r)) = trace
        .iter()
        .enumerate()
        .find(|(_, r)| r.arrival_ms.is_nan() || r.arrival_ms / 1000.0 > a.timeout_secs)
    {
        return Err(format!(
            "{}: request {} arrives at {} ms (at rate scale {}), after the run's --timeout-secs of {} s",
            a.trace.display(),
            i + 1,
            r.arrival_ms,
            a.rate_scale,
            a.timeout_secs
        ));
    }
    if let Some(p) = &a.write_trace {
        let mut w = csv::Writer::from_path(p).map_err(|e| format!("{}: {e}", p.display()))?;
        w.write_record(["arrival_ms", "prompt_tokens", "output_tokens"])
            .map_err(|e| e.to_string())?;
        for r in &trace {
            w.write_record([
                format!("{:.3}", r.arrival_ms),
                r.prompt_tokens.to_string(),
                r.output_tokens.to_string(),
            ])
            .map_err(|e| e.to_string())?;
        }
        w.flush().map_err(|e| format!("{}: {e}", p.display()))?;
    }
    // An idle connection is dropped well before the server's keep-alive (5 s) closes it: a
    // request sent on a connection the server is closing at that moment fails unsent
    // ("error sending request"), and a POST is not retried.
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(256)
        .pool_idle_timeout(Duration::from_secs(2))
        .build()
        .map_err(|e| e.to_string())?;
    let start = Instant::now();
    let deadline = Duration::from_secs_f64(a.timeout_secs.max(0.001));
    let mut tasks = Vec::with_capacity(trace.len());
    for (i, r) in trace.iter().enumerate() {
        let client = client.clone();
        let url = a.url.trim_end_matches('/').to_owned();
        let r = *r;
        let seed = a.seed ^ (i as u64 + 1);
        tasks.push(tokio::spawn(async move {
            let at = start + Duration::from_secs_f64(r.arrival_ms / 1000.0);
            tokio::time::sleep_until(at.into()).await;
            let prompt = prompt_of(r.prompt_tokens, seed);
            stream_one(&client, &url, prompt, r.output_tokens, at).await
        }));
    }
    let mut results = Vec::with_capacity(tasks.len());
    let all = futures_util::future::join_all(tasks);
    match tokio::time::timeout(deadline, all).await {
        Ok(done) => {
            for d in done {
                results.push(d.unwrap_or_else(|e| Measured {
                    error: Some(e.to_string()),
                    ..Measured::default()
                }));
            }
        }
        Err(_) => return Err(format!("the run took longer than {} s", a.timeout_secs)),
    }
    let wall_ms = start.elapsed().as_secs_f64() * 1000.0;
    let mut ttft: Vec<f64> = results.iter().filter_map(|m| m.ttft_ms).collect();
    let mut tbt: Vec<f64> = results.iter().flat_map(|m| m.tbt_ms.clone()).collect();
    let mut e2e: Vec<f64> = results.iter().filter_map(|m| m.e2e_ms).collect();
    let failed: Vec<&String> = results.iter().filter_map(|m| m.error.as_ref()).collect();
    let tokens: u64 = results.iter().map(|m| u64::from(m.tokens)).sum();
    let prompt_tokens: u64 = trace.iter().map(|r| u64::from(r.prompt_tokens)).sum();
    let report = json!({
        "trace": a.trace.display().to_string(),
        "url": a.url,
        "rate_scale": a.rate_scale,
        "length_scale": a.length_scale,
        "max_prompt": a.max_prompt,
        "max_output": a.max_output,
        "requests": trace.len(),
        "completed": e2e.len(),
        "failed": failed.len(),
        "failures": failed.iter().take(10).collect::<Vec<_>>(),
        "tokens": {"prefill": prompt_tokens, "generated": tokens},
        "ttft_ms": Latency::of(&mut ttft),
        "tbt_ms": Latency::of(&mut tbt),
        "e2e_ms": Latency::of(&mut e2e),
        "wall_ms": (wall_ms * 1000.0).round() / 1000.0,
        "requests_per_second": e2e.len() as f64 * 1000.0 / wall_ms,
        "output_tokens_per_second": tokens as f64 * 1000.0 / wall_ms,
    });
    if let Some(p) = &a.report_json {
        std::fs::write(
            p,
            serde_json::to_string_pretty(&report).expect("json") + "\n",
        )
        .map_err(|e| format!("{}: {e}", p.display()))?;
    }
    Ok(report)
}

/// `bench`: runs the load on a runtime of its own and prints the report.
///
/// # Errors
/// As [`run_async`], and any request that failed (after the report is printed), so a run
/// with failures exits non-zero.
pub fn run(a: BenchArgs) -> Result<(), String> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let report = rt.block_on(run_async(&a))?;
    let text = serde_json::to_string_pretty(&report).expect("a JSON value");
    let mut out = std::io::stdout().lock();
    std::io::Write::write_all(&mut out, text.as_bytes())
        .and_then(|()| std::io::Write::write_all(&mut out, b"\n"))
        .and_then(|()| std::io::Write::flush(&mut out))
        .map_err(|e| format!("writing the report: {e}"))?;
    failures(&report)
}

/// `Err` naming how many requests failed, if any did.
///
/// # Errors
/// The report counts failed requests.
pub fn failures(report: &serde_json::Value) -> Result<(), String> {
    match report["failed"].as_u64() {
        Some(0) | None => Ok(()),
        Some(n) => Err(format!(
            "{n} of {} requests failed (the report's `failures` lists the first)",
            report["requests"]
        )),
    }
}
