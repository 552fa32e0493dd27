//! Fuzzes both trace readers (Azure CSV, Mooncake JSON Lines), strict and skipping bad lines.
//! Any input must read or be refused with an error naming the line; never panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mstar_chunking_sim::replay::trace::{ReadOptions, Trace, TraceFormat};

fuzz_target!(|data: &[u8]| {
    for format in [TraceFormat::AzureCsv, TraceFormat::MooncakeJsonl] {
        for skip_bad_lines in [false, true] {
            let opts = ReadOptions { limit: Some(1000), skip_bad_lines };
            if let Ok(trace) = Trace::read("fuzz".into(), format, data, opts) {
                for r in &trace.requests {
                    let _ = trace.hashes(r);
                }
            }
        }
    }
});
