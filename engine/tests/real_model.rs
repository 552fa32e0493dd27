//! SmolLM2-135M-Instruct from its GGUF (`make model` installs it; a missing file fails).

use candle_core::Device;
use mstar_engine::model::gguf::{self, WeightFormat, DEFAULT_FORMAT};
use mstar_engine::model::Model;

fn smollm2(format: WeightFormat) -> Model {
    let path = gguf::smollm2_path().unwrap_or_else(|e| panic!("{e}"));
    gguf::load(&path, &Device::Cpu, format).unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn the_capital_of_france_is_paris() {
    let m = smollm2(DEFAULT_FORMAT);
    let tok = m.tokenizer().clone();
    let ids = tok.encode("The capital of France is").unwrap();
    eprintln!("ids {ids:?}");
    let (mut cache, logits) = m.prefill(&ids).unwrap();
    let out = m.greedy(&mut cache, &logits, 8).unwrap();
    let text = tok.decode(&out, true).unwrap();
    eprintln!("{out:?} {text:?}");
    assert!(text.starts_with(" Paris"), "{text:?}");
}
