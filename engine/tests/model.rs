//! The model's loader, sizes and sampling.

use candle_core::{Device, Tensor};
use mstar_engine::model::{
    argmax, decode, encode, relative_diff, save_safetensors, Config, Model, ModelError, Sampler,
    BOS, VOCAB,
};

#[test]
fn sizes_have_the_documented_shapes() {
    let tiny = Config::tiny();
    assert_eq!((tiny.layers, tiny.hidden), (2, 64));
    let small = Config::small();
    assert_eq!(
        (small.layers, small.hidden, small.heads, small.kv_heads),
        (6, 512, 8, 2)
    );
    let p = small.parameters();
    assert!(
        (23_000_000..27_000_000).contains(&p),
        "small has {p} parameters"
    );
    assert!(matches!(Config::by_name("huge"), Err(ModelError::UnknownSize(s)) if s == "huge"));
}

#[test]
fn byte_vocabulary_round_trips_text() {
    let t = encode("héllo");
    assert_eq!(t[0], BOS);
    assert_eq!(t.len(), 1 + "héllo".len());
    assert_eq!(decode(&t), "héllo");
    assert_eq!(VOCAB, 258);
}

#[test]
fn random_weights_depend_on_the_seed_only() {
    let p = encode("the same prompt");
    let a = Model::random(Config::tiny(), 1, &Device::Cpu)
        .unwrap()
        .prefill(&p)
        .unwrap()
        .1;
    let b = Model::random(Config::tiny(), 1, &Device::Cpu)
        .unwrap()
        .prefill(&p)
        .unwrap()
        .1;
    let c = Model::random(Config::tiny(), 2, &Device::Cpu)
        .unwrap()
        .prefill(&p)
        .unwrap()
        .1;
    assert_eq!(a, b);
    assert_ne!(a, c);
    assert_eq!(a.len(), VOCAB);
}

#[test]
fn safetensors_with_llama_names_load_to_the_same_model() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.safetensors");
    let cfg = Config::tiny();
    let w = cfg.random_weights(11, &Device::Cpu).unwrap();
    assert!(w.contains_key("model.layers.1.self_attn.k_proj.weight"));
    assert!(w.contains_key("lm_head.weight"));
    save_safetensors(&w, &path).unwrap();
    let loaded = Model::load(cfg, &path, &Device::Cpu).unwrap();
    let direct = Model::from_weights(cfg, &w, &Device::Cpu, "memory").unwrap();
    let p = encode("load me");
    let a = loaded.prefill(&p).unwrap().1;
    let b = direct.prefill(&p).unwrap().1;
    assert_eq!(relative_diff(&a, &b), 0.0);

    // A missing tensor is named.
    let mut missing = w.clone();
    missing.remove("model.layers.0.mlp.up_proj.weight");
    let bad = dir.path().join("missing.safetensors");
    save_safetensors(&missing, &bad).unwrap();
    let err = Model::load(cfg, &bad, &Device::Cpu)
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("missing.safetensors") && err.contains("model.layers.0.mlp.up_proj.weight"),
        "{err}"
    );

    // A tensor of the wrong shape is named with both shapes.
    let mut wrong = w.clone();
    wrong.insert(
        "model.norm.weight".into(),
        Tensor::ones(3, candle_core::DType::F32, &Device::Cpu).unwrap(),
    );
    let err = Model::from_weights(cfg, &wrong, &Device::Cpu, "mem")
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("model.norm.weight") && err.contains("[3]") && err.contains("[64]"),
        "{err}"
    );

    // A file that is not safetensors.
    let junk = dir.path().join("junk.safetensors");
    std::fs::write(&junk, b"not a safetensors file").unwrap();
    let err = Model::load(cfg, &junk, &Device::Cpu)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("junk.safetensors"), "{err}");
}

#[test]
fn bad_rows_are_refused_without_touching_caches() {
    let m = Model::random(Config::tiny(), 3, &Device::Cpu).unwrap();
    let mut cache = mstar_engine::model::KvCache::new(&m);
    let err = m
        .step(&mut [mstar_engine::model::StepRow {
            tokens: &[1, 999],
            cache: &mut cache,
            logits: true,
        }])
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("999") && err.contains("row 0"), "{err}");
    assert!(cache.is_empty());
}

#[test]
fn sampling_is_seeded_and_top_p_narrows_it() {
    let logits: Vec<f32> = (0..VOCAB).map(|i| ((i * 37) % 11) as f32 * 0.3).collect();
    let draw = |seed, t, p| {
        let mut s = Sampler::new(seed, t, p);
        (0..50).map(|_| s.sample(&logits)).collect::<Vec<_>>()
    };
    assert_eq!(draw(5, 1.0, 1.0), draw(5, 1.0, 1.0));
    assert_ne!(draw(5, 1.0, 1.0), draw(6, 1.0, 1.0));
    // Temperature 0 and a tiny top_p are greedy.
    let best = argmax(&logits);
    assert!(draw(5, 0.0, 1.0).iter().all(|&t| t == best));
    assert!(draw(5, 1.0, 1e-6).iter().all(|&t| t == best));
    // Sampling spreads over several tokens at temperature 1.
    let mut d = draw(9, 1.0, 1.0);
    d.sort();
    d.dedup();
    assert!(d.len() > 5);
}
