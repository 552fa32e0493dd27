//! Cost-aware chunking through a replay (docs/cost-model.md): on the shared Mooncake trace,
//! with the Llama-2-7B/A100 preset's attention and KV terms, a token budget alone lets step
//! times grow well past a target; a time budget of that target keeps every step that is not a
//! counted time overrun within it, every prompt completes and the step log passes the checker;
//! and the component learns the preset's coefficients from noisy simulated times.

use std::path::{Path, PathBuf};

use mstar_chunking::manifest::Manifest;
use mstar_chunking_sim::config::Settings;
use mstar_chunking_sim::replay::{self, ReplayOptions, ReplayReport};
use serde_json::Value;

use crate::helpers::{check_step_log, shared};

/// The step-time target of these tests, in ms.
const TARGET_MS: f64 = 100.0;

fn mooncake() -> PathBuf {
    shared("traces/mooncake_fast25_synthetic_trace.head2000.jsonl")
}

/// Replays the first 400 requests of the Mooncake trace at a tenth of its rate under `config`.
fn run(config: &str, step_log: &Path) -> ReplayReport {
    let m: Manifest = crate::helpers::model_fixture("mixed_2048");
    let s: Settings = toml::from_str(config).unwrap();
    let opts = ReplayOptions {
        trace: Some(mooncake()),
        requests: Some(400),
        rate_scale: 0.1,
        step_log: Some(step_log.to_owned()),
        ..ReplayOptions::default()
    };
    actix::System::new()
        .block_on(replay::run(&m, &s, &opts))
        .expect("the replay runs")
}

fn steps(log: &Path) -> Vec<Value> {
    std::fs::read_to_string(log)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn quantile(mut v: Vec<f64>, q: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() as f64 * q) as usize).min(v.len() - 1)]
}

#[test]
fn a_time_budget_keeps_every_uncounted_step_within_its_target() {
    let dir = tempfile::tempdir().unwrap();
    let (tokens_log, timed_log) = (
        dir.path().join("tokens.jsonl"),
        dir.path().join("timed.jsonl"),
    );
    let preset = "[replay]\ncost = \"llama2-7b-a100\"\n[chunking.cost]\nllm = \"llama2-7b-a100\"\n";

    let tokens = run(preset, &tokens_log);
    let token_ms: Vec<f64> = steps(&tokens_log)
        .iter()
        .map(|s| s["ms"].as_f64().unwrap())
        .collect();
    let worst = token_ms.iter().copied().fold(0.0, f64::max);
    assert!(
        worst > 3.0 * TARGET_MS,
        "the token budget alone should let steps grow past the target: worst {worst} ms"
    );

    let timed = run(
        &format!("{preset}[chunking.max_step_ms]\nllm = {TARGET_MS}\n"),
        &timed_log,
    );
    let log = steps(&timed_log);
    let mut over_uncounted = 0;
    for s in &log {
        let ms = s["ms"].as_f64().unwrap();
        assert_eq!(s["max_step_ms"].as_f64(), Some(TARGET_MS));
        assert!(s["predicted_ms"].is_number());
        if ms > TARGET_MS && s["time_overrun"].is_null() {
            over_uncounted += 1;
        }
    }
    assert_eq!(
        over_uncounted, 0,
        "every step over the target is a counted time overrun"
    );
    assert_eq!(timed.chunks.final_chunks, 400, "every prompt completed");
    assert_eq!(tokens.chunks.final_chunks, 400);
    assert!(
        quantile(
            log.iter().map(|s| s["ms"].as_f64().unwrap()).collect(),
            0.99
        ) <= TARGET_MS
    );
    let tbt = |r: &ReplayReport| r.tbt_ms.unwrap().p99;
    assert!(
        tbt(&timed) < tbt(&tokens),
        "{} vs {}",
        tbt(&timed),
        tbt(&tokens)
    );
    check_step_log(&timed_log, 16);
}

#[test]
fn with_learning_and_noise_the_component_finds_the_preset_and_keeps_steps_near_the_target() {
    let dir = tempfile::tempdir().unwrap();
    let log_path = dir.path().join("learn.jsonl");
    let report = run(
        &format!(
            "[replay]\ncost = {{ preset = \"llama2-7b-a100\", noise = 0.05, learn = true }}\n\
             [chunking.max_step_ms]\nllm = {TARGET_MS}\n"
        ),
        &log_path,
    );
    let log = steps(&log_path);
    assert!(log.len() >= 2000, "{} steps", log.len());
    let truth = mstar_chunking::latency::presets::preset_model("llama2-7b-a100").unwrap();
    let learned = report.latency_model;
    assert_eq!(learned.source.as_str(), "online");
    // Every term carries real weight on this trace: long prefixes (attention), long decode
    // contexts (KV), tokens and the step's base.
    for (name, got, want) in [
        ("base_ms", learned.base_ms, truth.base_ms()),
        ("per_token_ms", learned.per_token_ms, truth.per_token_ms()),
        (
            "per_kv_token_ms",
            learned.per_kv_token_ms,
            truth.per_kv_token_ms(),
        ),
        (
            "per_attention_pair_ms",
            learned.per_attention_pair_ms,
            truth.per_attention_pair_ms(),
        ),
    ] {
        let got = got.unwrap();
        assert!(
            (got - want).abs() <= 0.10 * want,
            "{name}: learned {got}, preset {want}"
        );
    }
    // Once the fit plans the steps, p99 step time stays within 1.10 x the target.
    let planned: Vec<f64> = log
        .iter()
        .filter(|s| s["max_step_ms"].is_number())
        .map(|s| s["ms"].as_f64().unwrap())
        .collect();
    assert!(planned.len() > log.len() / 2, "the fit took over late");
    let p99 = quantile(planned, 0.99);
    assert!(p99 <= 1.10 * TARGET_MS, "p99 {p99} ms");
    check_step_log(&log_path, 16);
}
