//! Prefill and decode speed of a GGUF model in this engine, as one JSON line: the engine's half
//! of `engine/scripts/speed_vs_llama_cpp.py`, which runs llama.cpp on the same workload.
//!
//! ```sh
//! RAYON_NUM_THREADS=1 cargo run --release -p mstar-engine --example speed -- FILE.gguf [FORMAT]
//! ```
//!
//! Prefill: a 256-token prompt in one step, logits at its last token (best of 3). Decode: 64
//! one-token steps after a 16-token prompt, greedy (the best of 3 runs' mean per token). The
//! thread count is candle's, from `RAYON_NUM_THREADS`.

use std::time::Instant;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use candle_core::Device;
use mstar_engine::model::gguf::{self, WeightFormat, DEFAULT_FORMAT};
use mstar_engine::model::{argmax, KvCache, StepRow};

/// Tokens of the prefill prompt.
const PREFILL: usize = 256;
/// Tokens before decoding, and tokens decoded.
const DECODE_AFTER: usize = 16;
const DECODED: usize = 64;
const RUNS: usize = 3;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let path = args
        .first()
        .ok_or("usage: speed FILE.gguf [dense|native|q8_0]")?;
    let format = match args.get(1) {
        Some(f) => WeightFormat::by_name(f).ok_or(format!("unknown format `{f}`"))?,
        None => DEFAULT_FORMAT,
    };
    let model =
        gguf::load(std::path::Path::new(path), &Device::Cpu, format).map_err(|e| e.to_string())?;
    // The prompt llama.cpp's side uses too: ids 300..555, away from the special tokens.
    let prompt: Vec<u32> = (0..PREFILL as u32)
        .map(|i| (i * 7 + 3) % 256 + 300)
        .collect();

    let mut prefill = f64::MAX;
    for _ in 0..RUNS {
        let mut cache = KvCache::new(&model);
        let t0 = Instant::now();
        model.step(&mut [StepRow {
            tokens: &prompt,
            cache: &mut cache,
            logits: true,
        }])?;
        prefill = prefill.min(t0.elapsed().as_secs_f64());
    }

    let mut decode = f64::MAX;
    for _ in 0..RUNS {
        let mut cache = KvCache::new(&model);
        let mut logits = model.step(&mut [StepRow {
            tokens: &prompt[..DECODE_AFTER],
            cache: &mut cache,
            logits: true,
        }])?;
        let t0 = Instant::now();
        for _ in 0..DECODED {
            let next = argmax(logits[0].as_deref().ok_or("no logits")?);
            logits = model.step(&mut [StepRow {
                tokens: &[next],
                cache: &mut cache,
                logits: true,
            }])?;
        }
        decode = decode.min(t0.elapsed().as_secs_f64() / DECODED as f64);
    }
    println!(
        "{{\"format\": \"{}\", \"prefill_tokens\": {PREFILL}, \"prefill_ms\": {:.2}, \
         \"prefill_tok_s\": {:.1}, \"decode_ms_per_token\": {:.3}, \"decode_tok_s\": {:.1}}}",
        format.name(),
        prefill * 1e3,
        PREFILL as f64 / prefill,
        decode * 1e3,
        1.0 / decode
    );
    Ok(())
}
