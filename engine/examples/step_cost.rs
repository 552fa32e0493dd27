//! A model's step time by the step's tokens and the row's context, on this machine's CPU: the
//! curve the latency model is fitted to (docs/engine-model.md#the-cost-of-a-step).
//!
//! ```sh
//! RAYON_NUM_THREADS=1 cargo run --release -p mstar-engine --example step_cost            # small
//! RAYON_NUM_THREADS=1 cargo run --release -p mstar-engine --example step_cost -- \
//!     smollm2 native                # the GGUF model, weights kept as native, q8_0 or dense
//! ```
//!
//! Each line is the best of five runs of one step: one row of `T` new tokens after `context`
//! cached ones, logits at its last token.

use std::time::Instant;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use candle_core::Device;
use mstar_engine::model::gguf::{self, WeightFormat};
use mstar_engine::model::{Config, KvCache, Model, StepRow};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let which = args.first().map(String::as_str).unwrap_or("small");
    let model = match which {
        "tiny" | "small" => Model::random(Config::by_name(which)?, 1, &Device::Cpu)?,
        "smollm2" => {
            let f = args.get(1).map(String::as_str).unwrap_or("native");
            let format = WeightFormat::by_name(f).ok_or(format!("unknown format `{f}`"))?;
            let t0 = Instant::now();
            let m = gguf::load(&gguf::smollm2_path()?, &Device::Cpu, format)?;
            eprintln!(
                "loaded smollm2 ({f}) in {:.2} s",
                t0.elapsed().as_secs_f64()
            );
            m
        }
        other => return Err(format!("unknown model `{other}` (tiny, small, smollm2)").into()),
    };
    let vocab = model.config.vocab as u32;
    let token = |i: u32| (i * 7 + 3) % vocab.min(256);
    println!("context  tokens  best ms");
    for context in [0usize, 1000] {
        let prefix: Vec<u32> = (0..context as u32).map(token).collect();
        for t in [1usize, 2, 4, 8, 16, 32, 64, 128, 256] {
            let tokens: Vec<u32> = (0..t as u32).map(token).collect();
            let mut best = f64::MAX;
            for _ in 0..5 {
                let mut cache = KvCache::new(&model);
                if context > 0 {
                    model.step(&mut [StepRow {
                        tokens: &prefix,
                        cache: &mut cache,
                        logits: false,
                    }])?;
                }
                let t0 = Instant::now();
                model.step(&mut [StepRow {
                    tokens: &tokens,
                    cache: &mut cache,
                    logits: true,
                }])?;
                best = best.min(t0.elapsed().as_secs_f64() * 1e3);
            }
            println!("{context:7}  {t:6}  {best:7.2}");
        }
    }
    Ok(())
}
