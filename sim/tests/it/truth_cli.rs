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

#[test]
fn the_steps_without_their_time_budget_are_warned_at_the_first_and_then_at_powers_of_two() {
    let dir = tempfile::tempdir().unwrap();
    // As above: learning under ±90% noise, never trusted, so no step is planned in time.
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
    let steps = report["time_budget"]["inactive_steps"].as_u64().unwrap();
    // The 1st, 2nd, 4th, … step without its time budget is warned, naming the reason.
    let warned = r.stderr.matches("time budget not applied").count() as u64;
    assert_eq!(
        warned,
        u64::from(steps.ilog2()) + 1,
        "{steps} steps:\n{}",
        r.stderr
    );
    assert!(
        r.stderr.contains("reason=\"no_measurements\" steps=1"),
        "{}",
        r.stderr
    );
    assert!(
        r.stderr.contains("reason=\"untrusted_fit\" steps=2"),
        "{}",
        r.stderr
    );
    // A configured model (the prior): no step goes without its time budget, nothing is warned.
    let config = write(
        dir.path(),
        "prior.toml",
        "[chunking]\nlearn_cost = true\n[chunking.cost]\nllm = { base_ms = 8.0, per_token_ms = 0.02, per_kv_token_ms = 0.0, per_attention_pair_ms = 0.0 }\n\
         [chunking.max_step_ms]\nllm = { mixed = 60.0 }\n",
    );
    let r = run(&["replay", "--config", &config, "--requests", "40"], &[]);
    assert_eq!(r.code, 0, "{r:?}");
    assert!(
        !r.stderr.contains("time budget not applied"),
        "{}",
        r.stderr
    );
}

/// The refusal of a time budget on a node whose step walk has no token budget, as `replay` and
/// a sweep's cells name it: both flags and the key.
fn refused_naming_both_flags(r: &Run) {
    refused(r, "`--max-step-ms` (`chunking.max_step_ms.llm`) = 100 is refused with the token budget off (`--budget off`, `--budget-off`)");
    assert!(
        r.stderr.contains("steps of `mixed` on `llm`"),
        "{}",
        r.stderr
    );
}

#[test]
fn a_time_budget_with_the_step_walks_token_budget_off_is_refused_by_replay_sweep_and_config() {
    let dir = tempfile::tempdir().unwrap();
    let example = "config/examples/llama2-7b-a100.toml";
    let base = [
        "--config",
        example,
        "--requests",
        "30",
        "--max-step-ms",
        "100",
    ];
    for off in [&["--budget", "off"][..], &["--budget-off"][..]] {
        let args: Vec<&str> = ["replay"].iter().chain(&base).chain(off).copied().collect();
        refused_naming_both_flags(&run(&args, &[]));
    }
    // With a token budget the same time budget runs, on the step walk.
    let args: Vec<&str> = ["replay"]
        .iter()
        .chain(&base)
        .chain(&["--budget", "1024"])
        .copied()
        .collect();
    let r = run(&args, &[]);
    assert_eq!(r.code, 0, "{r:?}");
    assert!(r.stdout.contains("mixed 100 ms"), "{}", r.stdout);
    // A sweep's time budget on every cell (a config layer here; `--max-step-ms` is the same
    // key): its `off` cell is refused before any replay runs, naming the flags and the key,
    // and no output is created.
    let timed = write(
        dir.path(),
        "timed.toml",
        "[chunking.max_step_ms]\nllm = 100\n",
    );
    let out = dir.path().join("sweep");
    let out_arg = out.display().to_string();
    let r = run(
        &[
            "sweep",
            "--config",
            example,
            "--config",
            &timed,
            "--requests",
            "30",
            "--budgets",
            "1024,off",
            "--rates",
            "1",
            "--no-progress",
            "--out",
            &out_arg,
        ],
        &[],
    );
    refused_naming_both_flags(&r);
    assert!(r.stderr.contains("`--budgets` names off"), "{}", r.stderr);
    assert!(!out.exists());
    // A config layer that turns the step walk's budget off under a node-wide time budget is
    // refused naming the time budget's key and its file.
    let layer = write(
        dir.path(),
        "off.toml",
        "[chunking.cost]\nllm = \"llama2-7b-a100\"\n[chunking.max_batch_tokens]\nllm = { mixed = \"off\" }\n[chunking.max_step_ms]\nllm = 100\n",
    );
    for cmd in ["check", "replay"] {
        let r = run(
            &[cmd, "--config", &layer, "--requests", "5"][..if cmd == "check" { 3 } else { 5 }],
            &[],
        );
        refused(
            &r,
            "off.toml: `chunking.max_step_ms.llm` = 100: `chunking.max_step_ms.llm` would do nothing: `chunking.max_batch_tokens.llm.mixed` is off",
        );
    }
}

#[test]
fn a_sweep_warns_when_the_time_budget_is_within_the_noise_of_the_tbt_objective() {
    let dir = tempfile::tempdir().unwrap();
    let noisy = write(
        dir.path(),
        "noisy.toml",
        "[chunking.cost]\nllm = \"llama2-7b-a100\"\n[replay]\ncost = { preset = \"llama2-7b-a100\", noise = 0.05 }\n",
    );
    let sweep = |ms: &str, extra: &[&str]| {
        let out = dir.path().join(format!("out-{ms}-{}", extra.len()));
        let out = out.display().to_string();
        let mut args = vec![
            "sweep",
            "--config",
            &noisy,
            "--requests",
            "10",
            "--budgets",
            "2048",
            "--rates",
            "1",
            "--slo-tbt-p99",
            "100",
            "--no-progress",
            "--max-step-ms",
            ms,
            "--out",
            &out,
        ];
        args.extend_from_slice(extra);
        let r = run(&args, &[]);
        assert_eq!(r.code, 0, "{r:?}");
        r.stderr.contains(
            "is within the simulated step-time noise (±5%) of the TBT p99 objective (100 ms)",
        )
    };
    // A time budget of 100 ms or 96 ms stretched by 5% passes 100 ms; 95 ms does not.
    assert!(sweep("100", &[]));
    assert!(sweep("96", &[]));
    assert!(!sweep("95", &[]));
    // A time cell of the grid is checked as a time budget on every cell is.
    let out = dir.path().join("out-cell").display().to_string();
    let r = run(
        &[
            "sweep",
            "--config",
            &noisy,
            "--requests",
            "10",
            "--budgets",
            "2048,100ms,95ms",
            "--rates",
            "1",
            "--slo-tbt-p99",
            "100",
            "--no-progress",
            "--out",
            &out,
        ],
        &[],
    );
    assert_eq!(r.code, 0, "{r:?}");
    assert!(
        r.stderr
            .contains("a time cell's (`--budgets`) time budget (100 ms) is within"),
        "{}",
        r.stderr
    );
    assert!(!r.stderr.contains("time budget (95 ms)"), "{}", r.stderr);
    // The config's time budget, on every cell, is checked too.
    let timed = write(
        dir.path(),
        "timed.toml",
        "[chunking.max_step_ms]\nllm = { mixed = 100 }\n",
    );
    let out = dir.path().join("out-config").display().to_string();
    let r = run(
        &[
            "sweep",
            "--config",
            &noisy,
            "--config",
            &timed,
            "--requests",
            "10",
            "--budgets",
            "2048",
            "--rates",
            "1",
            "--slo-tbt-p99",
            "100",
            "--no-progress",
            "--out",
            &out,
        ],
        &[],
    );
    assert_eq!(r.code, 0, "{r:?}");
    assert!(
        r.stderr.contains("warning: `mixed`'s time budget (100 ms) is within the simulated step-time noise (±5%) of the TBT p99 objective (100 ms) and no time margin is set"),
        "{}",
        r.stderr
    );
    assert!(
        r.stderr.contains("a time budget below 95.2 ms"),
        "{}",
        r.stderr
    );
    // A time margin plans below the budget: no warning.
    let out = dir.path().join("out-margin").display().to_string();
    let r = run(
        &[
            "sweep",
            "--config",
            &noisy,
            "--config",
            &timed,
            "--requests",
            "10",
            "--budgets",
            "2048",
            "--rates",
            "1",
            "--slo-tbt-p99",
            "100",
            "--no-progress",
            "--out",
            &out,
            "--time-margin",
            "0.99",
        ],
        &[],
    );
    assert_eq!(r.code, 0, "{r:?}");
    assert!(!r.stderr.contains("step-time noise"), "{}", r.stderr);
}
