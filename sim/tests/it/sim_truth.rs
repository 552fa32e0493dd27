//! The simulated engine is independent of the scheduler it tests (docs/replay.md#the-step-cost-model):
//! whatever the component is configured to do (no latency model, a configured one, learning
//! one online), every step's simulated `ms` is the replay's four-term cost of the rows it ran,
//! each continuing row at its true context: its prompt plus the tokens it has generated.

use std::collections::HashMap;
use std::path::Path;

use mstar_chunking::manifest::Manifest;
use mstar_chunking_sim::config::Settings;
use mstar_chunking_sim::replay::{self, ReplayOptions};
use serde_json::Value;

/// The replay cost: a large KV term, so a stale context shows in every decode step's time.
const COST: [f64; 4] = [5.0, 0.05, 0.002, 1e-6];

/// 24 requests with prompts of 300 to 2,600 tokens and long outputs (400 to 900 tokens),
/// arriving 40 ms apart: `rid -> (prompt, output)`.
fn write_trace(path: &Path) -> HashMap<u64, (u64, u64)> {
    let mut text = String::from("arrival_ms,prompt_tokens,output_tokens\n");
    let mut reqs = HashMap::new();
    for i in 0..24u64 {
        let (prompt, output) = (300 + (i * 997) % 2300, 400 + (i * 331) % 500);
        text += &format!("{},{prompt},{output}\n", i * 40);
        reqs.insert(i, (prompt, output));
    }
    std::fs::write(path, text).unwrap();
    reqs
}

/// Replays the trace under `config` and checks every step of its log against the truth;
/// returns the steps, and the largest context a continuing row ran at.
fn replay_and_check(what: &str, config: &str, dir: &Path) -> (usize, u64) {
    let trace = dir.join(format!("{what}.csv"));
    let log = dir.join(format!("{what}.jsonl"));
    let reqs = write_trace(&trace);
    let m: Manifest = crate::helpers::model_fixture("mixed_1024");
    let s: Settings = toml::from_str(config).unwrap();
    let opts = ReplayOptions {
        trace: Some(trace),
        step_log: Some(log.clone()),
        ..ReplayOptions::default()
    };
    let report = actix::System::new()
        .block_on(replay::run(&m, &s, &opts))
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    assert_eq!(report.chunks.final_chunks, 24, "{what}");
    let [base, per_token, per_kv, per_pair] = COST;
    // Tokens each request has generated so far: the first comes with its final chunk.
    let mut generated: HashMap<u64, u64> = HashMap::new();
    let (mut steps, mut deepest, mut decode_rows) = (0usize, 0u64, 0u64);
    for line in std::fs::read_to_string(&log).unwrap().lines() {
        let step: Value = serde_json::from_str(line).unwrap();
        let (mut kv, mut pairs) = (0u64, 0u128);
        for row in step["rows"].as_array().unwrap() {
            let rid = row["rid"].as_u64().unwrap();
            if row["kind"] == "continue" {
                let truth = reqs[&rid].0 + generated[&rid];
                assert_eq!(
                    row["context"].as_u64(),
                    Some(truth),
                    "{what}: step {} logs rid {rid}'s context as the simulated engine knows it",
                    step["step"]
                );
                kv += truth;
                deepest = deepest.max(truth);
                decode_rows += 1;
            } else {
                let (s, e) = (
                    u128::from(row["start"].as_u64().unwrap()),
                    u128::from(row["end"].as_u64().unwrap()),
                );
                pairs += (e * (e + 1) - s * (s + 1)) / 2;
            }
        }
        let ran = step["ran_tokens"].as_u64().unwrap() as f64;
        let want = base + per_token * ran + per_kv * kv as f64 + per_pair * pairs as f64;
        let got = step["ms"].as_f64().unwrap();
        assert!(
            (got - want).abs() <= 0.0006 + want * 1e-12,
            "{what}: step {} took {got} ms; its rows at their true contexts cost {want} ms",
            step["step"]
        );
        for row in step["rows"].as_array().unwrap() {
            let rid = row["rid"].as_u64().unwrap();
            if row["kind"] == "continue" {
                *generated.get_mut(&rid).unwrap() += 1;
            } else if row["final"] == true {
                generated.insert(rid, 1);
            }
        }
        steps += 1;
    }
    let outputs: u64 = reqs.values().map(|r| r.1 - 1).sum();
    assert_eq!(decode_rows, outputs, "{what}: every generated token ran");
    (steps, deepest)
}

#[test]
fn every_step_is_priced_at_true_contexts_whatever_the_component_is_configured_to_do() {
    let dir = tempfile::tempdir().unwrap();
    let [b, t, k, a] = COST;
    let cost = format!(
        "{{ base_ms = {b}, per_token_ms = {t}, per_kv_token_ms = {k}, per_attention_pair_ms = {a} }}"
    );
    let learn = format!(
        "{{ base_ms = {b}, per_token_ms = {t}, per_kv_token_ms = {k}, per_attention_pair_ms = {a}, learn = true }}"
    );
    for (what, config) in [
        // The component has no latency model: it keeps no contexts of its own.
        ("no-model", format!("[replay]\ncost = {cost}\n")),
        // It plans with the replay's own model, under a time budget.
        (
            "configured",
            format!(
                "[chunking.cost]\nllm = {cost}\n[chunking.max_step_ms]\nllm = 60.0\n[replay]\ncost = {cost}\n"
            ),
        ),
        // It learns the model online, with speculation: rows run more tokens than they
        // generate, and the truth counts what they generate.
        (
            "learning",
            format!(
                "[chunking]\nlearn_cost = true\n[replay]\ncost = {learn}\n\
                 speculation = {{ tokens = 2, overshoot_rate = 0.3, seed = 7 }}\n"
            ),
        ),
    ] {
        let (steps, deepest) = replay_and_check(what, &config, dir.path());
        assert!(steps > 400, "{what}: {steps} steps");
        assert!(deepest > 2500, "{what}: contexts grew to {deepest} tokens");
    }
}
