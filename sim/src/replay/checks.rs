//! What a replay refuses before it runs: a trace past the simulated clock's precision, a
//! request that could never fit in the KV pool, and outputs that would overwrite an input or
//! each other.

use std::path::{Path, PathBuf};

use super::error::ReplayError;
use super::settings::ReplaySetup;
use super::trace::Trace;

/// The latest simulated time, in ms, an arrival may fall at: `2^53` µs (about 285 years).
/// Below it an `f64` holds a simulated time to the microsecond, the precision the outputs
/// print; beyond it steps of a few ms would round away and latencies print as 0.
pub const MAX_SIMULATED_MS: f64 = 9_007_199_254_740.992;

/// Refuses a trace whose arrivals, at `rate_scale`, fall past [`MAX_SIMULATED_MS`] (naming
/// the first such request), where the simulated clock would lose its precision.
///
/// # Errors
/// [`ReplayError::RateScale`], naming the request, its arrival and the scaled time.
pub fn check_clock(trace: &Trace, rate_scale: f64) -> Result<(), ReplayError> {
    let late = trace.requests.iter().find(|r| {
        let t = r.arrival_ms / rate_scale;
        !(t.is_finite() && t <= MAX_SIMULATED_MS)
    });
    match late {
        None => Ok(()),
        Some(r) => Err(ReplayError::RateScale(format!(
            "request rid {} arrives at {} ms, which at rate scale {rate_scale} is {:e} simulated ms: past the {MAX_SIMULATED_MS:e} ms (about 285 years) within which the simulated clock keeps microseconds; use a larger `--rate-scale` or re-base the trace's timestamps",
            r.rid,
            r.arrival_ms,
            r.arrival_ms / rate_scale
        ))),
    }
}

/// Refuses a disaggregated fleet whose KV link could not move some request's prompt within
/// the simulated clock: its arrival (at `rate_scale`), the link's latency and the prompt's
/// time on the wire past [`MAX_SIMULATED_MS`] (naming the first such request). Nothing to
/// refuse without a disaggregated fleet.
///
/// # Errors
/// [`ReplayError::Config`] for `replay.fleet.kv_link_gbps`, naming the request.
pub fn check_link(setup: &ReplaySetup, trace: &Trace, rate_scale: f64) -> Result<(), ReplayError> {
    let Some(pd) = &setup.fleet.disagg else {
        return Ok(());
    };
    let done = |r: &super::trace::Request| {
        r.arrival_ms / rate_scale + pd.kv_link_latency_ms + pd.wire_ms(u64::from(r.input_tokens))
    };
    let late = trace.requests.iter().find(|r| {
        let t = done(r);
        !(t.is_finite() && t <= MAX_SIMULATED_MS)
    });
    match late {
        None => Ok(()),
        Some(r) => Err(ReplayError::Config {
            key: "replay.fleet.kv_link_gbps",
            problem: format!(
                "= {} Gbit/s (`--kv-link-gbps`) is too slow for request rid {}: its prompt of {} tokens ({} B of KV a token) would reach the decode pool at {:.3e} simulated ms, past the {MAX_SIMULATED_MS:.3e} ms within which the simulated clock keeps microseconds; use a faster link",
                crate::text::float(pd.kv_link_gbps),
                r.rid,
                r.input_tokens,
                pd.kv_bytes_per_token,
                done(r)
            ),
        }),
    }
}

/// Refuses a trace with a request that could never fit in `setup`'s KV pool, even alone: its
/// prompt, outputs and twice its speculative tokens (nothing to refuse with unlimited memory).
/// A sweep checks each pool of its KV axis with it before any replay runs.
///
/// # Errors
/// [`ReplayError::KvTooSmall`], naming the first such request.
pub fn check_kv_fits(setup: &ReplaySetup, trace: &Trace) -> Result<(), ReplayError> {
    let Some(kv) = &setup.kv else { return Ok(()) };
    let spec = 2 * u64::from(setup.spec_tokens);
    for r in &trace.requests {
        let tokens = u64::from(r.input_tokens) + u64::from(r.output_tokens.max(1)) + spec;
        let need = tokens.div_ceil(u64::from(kv.block_tokens));
        if need > kv.blocks {
            return Err(ReplayError::KvTooSmall {
                rid: r.rid,
                tokens,
                need,
                blocks: kv.blocks,
                block_tokens: kv.block_tokens,
            });
        }
    }
    Ok(())
}

/// Refuses outputs that would overwrite an input or each other, or that are not regular files:
/// each output is compared with each input and with the other output as the same file (device
/// and inode, through links) or the same path.
///
/// # Errors
/// The first output refused, and why.
pub(crate) fn check_outputs(
    outputs: &[(&'static str, &Path)],
    inputs: &[PathBuf],
) -> Result<(), ReplayError> {
    let same = |a: &Path, b: &Path| -> bool {
        #[cfg(unix)]
        if let (Ok(x), Ok(y)) = (std::fs::metadata(a), std::fs::metadata(b)) {
            use std::os::unix::fs::MetadataExt;
            return x.dev() == y.dev() && x.ino() == y.ino();
        }
        let abs = |p: &Path| std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf());
        abs(a) == abs(b)
    };
    let refuse = |what, path: &Path, problem: String| ReplayError::Output {
        what,
        path: path.to_path_buf(),
        problem,
    };
    for (i, (what, out)) in outputs.iter().enumerate() {
        if let Ok(meta) = std::fs::metadata(out) {
            if !meta.is_file() {
                return Err(refuse(what, out, "is not a regular file".into()));
            }
        }
        if let Some(input) = inputs.iter().find(|input| same(out, input)) {
            return Err(refuse(
                what,
                out,
                format!(
                    "is the input `{}`; it would be overwritten",
                    crate::config::problem::escape(&input.display().to_string())
                ),
            ));
        }
        if let Some((other, _)) = outputs[i + 1..].iter().find(|(_, o)| same(out, o)) {
            return Err(refuse(what, out, format!("is also the {other}")));
        }
    }
    Ok(())
}
