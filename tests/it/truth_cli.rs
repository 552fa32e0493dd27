//! Refusals and warnings, as a user meets them through the binary: finite clocks,
//! `fit` on hostile input, models and time budgets that cannot work, a time budget that was
//! never in force, JSON layers with a repeated key, and misspelt `MSTAR_` variables.

use std::path::Path;

use crate::helpers::{run, Run};

fn write(dir: &Path, name: &str, text: &str) -> String {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p.display().to_string()
}

fn refused(r: &Run, needle: &str) {
    assert_eq!(r.code, 2, "{r:?}");
    assert!(
        r.stderr.contains(needle),
        "wanted {needle:?} in:\n{}",
        r.stderr
    );
}

#[test]
fn a_clock_past_microsecond_precision_is_refused_naming_the_request() {
    let dir = tempfile::tempdir().unwrap();
    let trace = write(
        dir.path(),
        "far.csv",
        "arrival_ms,prompt_tokens,output_tokens\n0,16,4\n1000000000000,16,4\n",
    );
    let r = run(&["replay", "--trace", &trace, "--rate-scale", "1e-6"], &[]);
    refused(
        &r,
        "request rid 1 arrives at 1000000000000 ms, which at rate scale 0.000001 is 1e18 simulated ms",
    );
    // At the trace's own rate the clock stays precise: it runs.
    let r = run(&["replay", "--trace", &trace], &[]);
    assert_eq!(r.code, 0, "{r:?}");
}

#[test]
fn fit_refuses_overflowing_sums_all_zero_fits_and_unknown_nodes() {
    let dir = tempfile::tempdir().unwrap();
    let huge = write(
        dir.path(),
        "huge.csv",
        "tokens,kv_tokens,attention_pairs,ms\n10,0,10,5\n20,0,1e200,6\n30,0,10,7\n",
    );
    let r = run(&["fit", &huge], &[]);
    refused(&r, "huge.csv:3: the step's values are too large to fit");
    assert!(!r.stdout.contains("[chunking.cost"), "{r:?}");

    let zero = write(
        dir.path(),
        "zero.csv",
        "tokens,kv_tokens,attention_pairs,ms\n10,0,0,0\n20,5,0,0\n40,0,9,0\n",
    );
    let r = run(&["fit", &zero], &[]);
    refused(&r, "every coefficient fitted to 0");
    assert!(!r.stdout.contains("[chunking.cost"), "{r:?}");

    let good = write(
        dir.path(),
        "good.csv",
        "tokens,kv_tokens,attention_pairs,ms\n10,0,0,6\n20,0,0,7\n40,0,0,9\n",
    );
    let r = run(&["fit", &good, "--node", "ghost"], &[]);
    refused(&r, "`--node` = \"ghost\": the model `demo`");
    assert!(
        r.stderr.contains("has no such node; its nodes: llm"),
        "{r:?}"
    );
    let r = run(&["fit", &good, "--node", "llm"], &[]);
    assert_eq!(r.code, 0, "{r:?}");
    assert!(r.stdout.contains("[chunking.cost.llm]"), "{r:?}");
}

#[test]
fn an_all_zero_model_and_a_time_budget_below_base_ms_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let zero = write(
        dir.path(),
        "zero.toml",
        "[chunking.cost]\nllm = { base_ms = 0.0, per_token_ms = 0.0, per_kv_token_ms = 0.0, per_attention_pair_ms = 0.0 }\n",
    );
    let r = run(&["check", "--config", &zero], &[]);
    refused(&r, "chunking.cost.llm");
    assert!(r.stderr.contains("is all zero"), "{r:?}");

    let base = mstar_chunking::latency::presets::preset_model("llama2-7b-a100")
        .unwrap()
        .base_ms();
    let low = write(
        dir.path(),
        "low.toml",
        "[chunking.cost]\nllm = \"llama2-7b-a100\"\n[chunking.max_step_ms]\nllm = 5.0\n",
    );
    let r = run(&["check", "--config", &low], &[]);
    refused(
        &r,
        &format!("of 5 ms is below the latency model's `base_ms` of {base} ms"),
    );
    assert!(r.stderr.contains("chunking.max_step_ms.llm.mixed"), "{r:?}");
}

#[test]
fn a_time_budget_that_never_took_effect_is_reported_with_one_warning() {
    let dir = tempfile::tempdir().unwrap();
    // Learning under ±90% noise: the fit's error never gets within 10%, so it is never
    // trusted and the time budget never applies.
    let config = write(
        dir.path(),
        "learn.toml",
        "[chunking.max_step_ms]\nllm = { mixed = 60.0 }\n[replay]\ncost = { noise = 0.9, learn = true }\n",
    );
    let json = dir.path().join("report.json");
    let r = run(
        &[
            "replay",
            "--config",
            &config,
            "--requests",
            "40",
            "--report-json",
            json.to_str().unwrap(),
        ],
        &[],
    );
    assert_eq!(r.code, 0, "{r:?}");
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let steps = report["steps"].as_u64().unwrap();
    assert!(steps > 20, "{steps}");
    assert_eq!(report["time_budget"]["steps"].as_u64(), Some(steps));
    assert_eq!(
        report["time_budget"]["inactive_steps"].as_u64(),
        Some(steps)
    );
    assert!(
        r.stdout.contains(&format!(
            "inactive for {steps} of {steps} steps: no trusted latency model"
        )),
        "{}",
        r.stdout
    );
    assert_eq!(
        r.stderr.matches("the time budget is not in force").count(),
        1,
        "{}",
        r.stderr
    );
    // With the model configured, the budget is in force for every step.
    let config = write(
        dir.path(),
        "configured.toml",
        "[chunking.cost]\nllm = { base_ms = 8.0, per_token_ms = 0.02, per_kv_token_ms = 0.0, per_attention_pair_ms = 0.0 }\n\
         [chunking.max_step_ms]\nllm = { mixed = 60.0 }\n",
    );
    let r = run(&["replay", "--config", &config, "--requests", "40"], &[]);
    assert_eq!(r.code, 0, "{r:?}");
    assert!(r.stdout.contains("in force for every step"), "{}", r.stdout);
    assert!(!r.stderr.contains("not in force"), "{}", r.stderr);
}

#[test]
fn a_json_layer_repeating_a_key_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let dup = write(
        dir.path(),
        "dup.json",
        "{\n  \"chunking\": {\n    \"min_chunk_tokens\": 32,\n    \"min_chunk_tokens\": 64\n  }\n}\n",
    );
    let r = run(&["check", "--config", &dup], &[]);
    refused(&r, "duplicate key `chunking.min_chunk_tokens` at line 4");
    let once = write(
        dir.path(),
        "once.json",
        "{\"chunking\": {\"min_chunk_tokens\": 32}, \"log\": {\"level\": \"info\"}}\n",
    );
    assert_eq!(run(&["check", "--config", &once], &[]).code, 0);
}

#[test]
fn misspelt_mstar_variables_are_warned_about_by_name_never_by_value() {
    let r = run(
        &["check"],
        &[
            ("MSTAR_CHUNKING__MIN_CHUNK_TOKENS", "hunter2"),
            ("mstar__chunking__min_chunk_tokens", "48"),
            ("MSTAR__CHUNKING__MAX_ROW_TOKENS", "4096"),
        ],
    );
    assert_eq!(r.code, 0, "{r:?}");
    assert!(
        r.stderr
            .contains("environment variable MSTAR_CHUNKING__MIN_CHUNK_TOKENS is ignored"),
        "{}",
        r.stderr
    );
    assert!(
        r.stderr.contains(
            "environment variable mstar__chunking__min_chunk_tokens is applied as `chunking.min_chunk_tokens`"
        ),
        "{}",
        r.stderr
    );
    assert!(!r.stderr.contains("MAX_ROW_TOKENS"), "{}", r.stderr);
    assert!(!format!("{}{}", r.stdout, r.stderr).contains("hunter2"));
}
