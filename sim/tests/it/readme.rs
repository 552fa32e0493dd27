//! The README's commands run as written in a fresh clone: the long-context replay on the shipped
//! Mooncake trace with the shipped example configs, `check` showing time budgets and the
//! latency model, and the binary's help naming every trace format.

use crate::helpers::{check_step_log, repo_root, run};

const MOONCAKE: &str = "data/traces/mooncake_fast25_synthetic_trace.head2000.jsonl";

#[test]
fn the_long_context_example_runs_on_what_a_clone_has() {
    let readme = std::fs::read_to_string(repo_root().join("README.md")).unwrap();
    for path in [
        MOONCAKE,
        "config/examples/llama2-7b-a100.toml",
        "config/examples/time100.toml",
    ] {
        assert!(readme.contains(path), "the README names {path}");
        assert!(repo_root().join(path).is_file(), "{path} ships");
    }
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("steps.jsonl");
    // The README's command, on the trace's first 300 requests to stay quick.
    let r = run(
        &[
            "replay",
            "--trace",
            MOONCAKE,
            "--rate-scale",
            "0.1",
            "--config",
            "config/examples/llama2-7b-a100.toml",
            "--config",
            "config/examples/time100.toml",
            "--step-log",
            log.to_str().unwrap(),
            "--requests",
            "300",
            "--no-progress",
        ],
        &[],
    );
    assert_eq!(r.code, 0, "{r:?}");
    assert!(
        r.stdout
            .contains("requests                 300, rate scale 0.1"),
        "{}",
        r.stdout
    );
    assert!(r.stdout.contains("llama2-7b-a100"), "{}", r.stdout);
    assert!(r.stdout.contains("mixed 100 ms"), "{}", r.stdout);
    check_step_log(&log, 16);
}

#[test]
fn check_shows_the_time_budget_and_the_latency_model_in_force() {
    let r = run(
        &[
            "check",
            "--config",
            "config/examples/llama2-7b-a100.toml",
            "--config",
            "config/examples/time100.toml",
        ],
        &[],
    );
    assert_eq!(r.code, 0, "{r:?}");
    let mixed = r
        .stdout
        .lines()
        .find(|l| l.starts_with("llm   mixed"))
        .unwrap_or_else(|| panic!("no llm/mixed row in {}", r.stdout));
    // The time budget (100 ms) and where it came from, whatever columns follow.
    let fields: Vec<&str> = mixed.split_whitespace().collect();
    assert!(fields.windows(2).any(|w| w == ["100", "config"]), "{mixed}");
    let rows = crate::helpers::budgets_json(
        &[
            "--config",
            "config/examples/llama2-7b-a100.toml",
            "--config",
            "config/examples/time100.toml",
        ],
        &[],
    );
    let row = crate::helpers::row(&rows, "llm", "mixed");
    assert_eq!(row["max_step_ms"], 100.0);
    assert_eq!(row["learn_cost"], false);
    let preset = mstar_chunking::preset_model("llama2-7b-a100").unwrap();
    assert_eq!(row["cost"]["base_ms"], preset.base_ms());
    assert_eq!(row["cost"]["per_kv_token_ms"], preset.per_kv_token_ms());
}

#[test]
fn fit_on_too_few_steps_says_it_is_underdetermined_and_prints_plain_decimals() {
    let dir = tempfile::tempdir().unwrap();
    let csv = dir.path().join("two.csv");
    std::fs::write(
        &csv,
        "tokens,kv_tokens,attention_pairs,ms\n100,0,5050,12\n300,0,45150,20\n",
    )
    .unwrap();
    let r = run(&["fit", csv.to_str().unwrap()], &[]);
    assert_eq!(r.code, 0, "{r:?}");
    assert!(
        r.stderr
            .contains("warning: the fit is underdetermined: 2 steps"),
        "{}",
        r.stderr
    );
    assert!(
        r.stdout.contains("n/a (the fit is underdetermined)") && !r.stdout.contains("1.0000"),
        "{}",
        r.stdout
    );
    assert!(!r.stdout.contains("e-"), "no exponents: {}", r.stdout);
}
