//! Replay through the library API: exact scenarios read back from the step log, the shared
//! traces checked by `check_step_log.py`, chunking against `--budget-off`, and trace errors.

use std::path::{Path, PathBuf};

use mstar_chunking::manifest::Manifest;
use mstar_chunking_sim::config::Settings;
use mstar_chunking_sim::replay::trace::ReadOptions;
use mstar_chunking_sim::replay::{
    self, ReplayError, ReplayOptions, ReplayReport, Trace, TraceError,
};
use serde_json::Value;

use crate::helpers::shared;

fn model(toml_text: &str) -> Manifest {
    toml::from_str(toml_text).expect("test manifest parses")
}

fn settings(toml_text: &str) -> Settings {
    toml::from_str(toml_text).expect("test settings parse")
}

/// Runs a replay in a fresh actix system.
fn replay(m: &Manifest, s: &Settings, o: &ReplayOptions) -> Result<ReplayReport, ReplayError> {
    actix::System::new().block_on(replay::run(m, s, o))
}

fn read_log(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .expect("step log readable")
        .lines()
        .map(|l| serde_json::from_str(l).expect("step log line is JSON"))
        .collect()
}

use crate::helpers::check_step_log as check;

/// A compact rendering of a step's rows: `400`, `400 final`, `decode`.
fn rows(step: &Value) -> Vec<String> {
    step["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| match r["kind"].as_str().unwrap() {
            "continue" => "decode".to_owned(),
            _ if r["final"].as_bool().unwrap() => format!("{} final", r["tokens"]),
            _ => r["tokens"].to_string(),
        })
        .collect()
}

#[test]
fn three_long_prompts_share_the_budget_step_by_step() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("three.csv");
    std::fs::write(
        &trace,
        "TIMESTAMP,ContextTokens,GeneratedTokens\n\
         2023-11-16 18:17:03.9799600,800,2\n\
         2023-11-16 18:17:03.9799600,800,2\n\
         2023-11-16 18:17:03.9799600,800,2\n",
    )
    .unwrap();
    let m = model(
        r#"
        name = "scenario"
        walks = ["prefill", "decode", "mixed"]
        [combined_walks]
        mixed = ["prefill", "decode"]
        [nodes.llm]
        chunkable_walks = ["prefill", "mixed"]
        policies = { mixed = { max_batch_tokens = 1024 } }
        "#,
    );
    let s = settings("[chunking]\nmin_chunk_tokens = 1\nmax_row_tokens = 400\n");
    let log = dir.path().join("steps.jsonl");
    let report = replay(
        &m,
        &s,
        &ReplayOptions {
            trace: Some(trace),
            step_log: Some(log.clone()),
            ..ReplayOptions::default()
        },
    )
    .unwrap();
    let steps = read_log(&log);
    let got: Vec<Vec<String>> = steps.iter().map(rows).collect();
    assert_eq!(
        got,
        vec![
            vec!["400", "400", "224"],
            vec!["400 final", "400 final", "224"],
            vec!["decode", "decode", "352 final"],
            vec!["decode"],
        ]
    );
    // Rows in trace order, the walks of the rows, and the schema of the first step.
    let rids: Vec<u64> = steps[2]["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["rid"].as_u64().unwrap())
        .collect();
    assert_eq!(rids, [0, 1, 2]);
    let s0 = &steps[0];
    assert_eq!(
        (
            s0["node"].as_str(),
            s0["walk"].as_str(),
            &s0["budget"],
            &s0["floor"]
        ),
        (
            Some("llm"),
            Some("mixed"),
            &Value::from(1024),
            &Value::from(1)
        )
    );
    assert_eq!(s0["rows"][0]["cached"], 0);
    assert!(
        steps[1]["rows"][0].get("cached").is_none(),
        "cached only on first chunks"
    );
    assert_eq!(steps[2]["rows"][0]["walk"], "decode");
    assert_eq!(s0["t_ms"], 0.0);
    // 8 ms + 0.02 ms per token: the second step starts after 1024 tokens.
    assert_eq!(steps[1]["t_ms"], 28.48);
    assert_eq!(report.steps, 4);
    assert_eq!(report.chunks.prompts_cut, 3);
    assert_eq!(report.overruns.total, 0);
    assert_eq!(report.tokens.generated, 6);
    assert_eq!(report.peak_prepared_rows, 3);
    assert_eq!(report.peak_prepared_tokens, 2400);
    assert_eq!(
        (report.prepared_left_rows, report.prepared_left_tokens),
        (0, 0)
    );
    assert_eq!(report.ttft_ms.unwrap().samples, 3);
    check(&log, 1);
}

/// The demo model under a `mixed` budget of 2048 (so prompts are cut), plus `extra` settings.
fn demo_settings(extra: &str) -> Settings {
    settings(&format!(
        "[chunking]\nmax_batch_tokens = {{ llm = {{ mixed = 2048 }} }}\n{extra}"
    ))
}

fn replay_checked(trace: PathBuf, requests: usize, s: &Settings) -> (ReplayReport, String) {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("steps.jsonl");
    let json = dir.path().join("report.json");
    let report = replay(
        &crate::helpers::model_fixture("mixed_override"),
        s,
        &ReplayOptions {
            trace: Some(trace),
            requests: Some(requests),
            step_log: Some(log.clone()),
            report_json: Some(json.clone()),
            ..ReplayOptions::default()
        },
    )
    .unwrap();
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(doc["requests"], requests);
    assert_eq!(doc["steps"], report.steps);
    assert_eq!(doc["prepared_left_rows"], 0);
    let checked = check(&log, 16);
    println!("{report}{checked}");
    (report, checked)
}

#[test]
fn shared_azure_traces_replay_without_violations() {
    for name in [
        "AzureLLMInferenceTrace_code.csv",
        "AzureLLMInferenceTrace_conv.csv",
    ] {
        let (r, checked) =
            replay_checked(shared(&format!("traces/{name}")), 200, &demo_settings(""));
        assert_eq!(r.requests, 200);
        assert!(r.chunks.prompts_cut > 0, "{name}: no prompt was cut\n{r}");
        assert!(r.budget_utilisation.is_some());
        assert_eq!(r.overruns.total, 0, "{name}\n{r}");
        assert!(
            checked.contains(" 200 prefill rows, 200 finished"),
            "{checked}"
        );
    }
}

#[test]
fn mooncake_trace_replays_with_speculation_and_prefix_cache() {
    let trace = shared("traces/mooncake_fast25_synthetic_trace.head2000.jsonl");
    let (plain, _) = replay_checked(trace.clone(), 150, &demo_settings(""));
    assert_eq!(plain.chunks.prefix_cache_hits, 0);

    let spec =
        demo_settings("[replay]\nspeculation = { tokens = 3, overshoot_rate = 0.2, seed = 7 }\n");
    let (r, _) = replay_checked(trace.clone(), 150, &spec);
    assert!(
        r.overruns.speculation_estimate > 0,
        "no estimate overrun\n{r}"
    );
    assert_eq!(r.overruns.total, r.overruns.speculation_estimate);
    assert!(r.tokens.ran > r.tokens.scheduled);

    let cached = demo_settings("[replay]\nprefix_cache = { blocks = 4096, block_tokens = 512 }\n");
    let (r, _) = replay_checked(trace, 150, &cached);
    assert!(r.chunks.prefix_cache_hits > 0, "no prefix cache hit\n{r}");
    assert!(r.tokens.cached > 0);
    assert_eq!(r.tokens.prefill + r.tokens.cached, plain.tokens.prefill);
}

#[test]
fn azure_trace_with_speculation_has_no_violations() {
    let spec = demo_settings("[replay]\nspeculation = { tokens = 3, overshoot_rate = 0.2 }\n");
    let (r, _) = replay_checked(shared("traces/AzureLLMInferenceTrace_code.csv"), 200, &spec);
    assert!(r.overruns.speculation_estimate > 0, "{r}");
}

#[test]
fn chunking_lowers_p99_time_between_tokens() {
    let m = crate::helpers::model_fixture("mixed_override");
    let s = demo_settings("");
    let opts = ReplayOptions {
        requests: Some(300),
        ..ReplayOptions::default()
    };
    let on = replay(&m, &s, &opts).unwrap();
    let off = replay(
        &m,
        &s,
        &ReplayOptions {
            budget_off: true,
            ..opts.clone()
        },
    )
    .unwrap();
    println!("{on}\n{off}");
    assert!(off.budget_off && off.budgeted_steps == 0 && off.chunks.prompts_cut == 0);
    let (p_on, p_off) = (on.tbt_ms.unwrap().p99, off.tbt_ms.unwrap().p99);
    assert!(
        p_on < p_off,
        "p99 TBT with chunking {p_on} ms, without {p_off} ms\n{on}\n{off}"
    );
    assert_eq!(on.tokens.generated, off.tokens.generated);
    // The summary states it all.
    let table = on.to_string();
    for needle in [
        "budget utilisation",
        "TBT p50/p90/p99",
        "prepared inputs left",
        "none",
    ] {
        assert!(table.contains(needle), "{needle} missing from\n{table}");
    }
}

#[test]
fn bundled_trace_runs_with_alternating_walks() {
    // No combined walk: steps alternate prefill and decode.
    let m = model(
        r#"
        name = "no-mixed"
        walks = ["prefill", "decode"]
        [nodes.llm]
        chunkable_walks = ["prefill"]
        policies = { prefill = { max_batch_tokens = 2048, align = 16 } }
        "#,
    );
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("steps.jsonl");
    let r = replay(
        &m,
        &Settings::default(),
        &ReplayOptions {
            requests: Some(100),
            rate_scale: 2.0,
            step_log: Some(log.clone()),
            ..ReplayOptions::default()
        },
    )
    .unwrap();
    assert_eq!(r.trace, "bundled:AzureLLMInferenceTrace_code.csv");
    assert_eq!(r.walks, ["prefill", "decode"]);
    let walks: std::collections::BTreeSet<String> = read_log(&log)
        .iter()
        .map(|s| s["walk"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(walks, ["decode", "prefill"].map(String::from).into());
    check(&log, 16);
}

#[test]
fn rate_scale_compresses_arrivals() {
    let m = crate::helpers::model_fixture("mixed_override");
    let s = demo_settings("");
    let at = |rate_scale| {
        replay(
            &m,
            &s,
            &ReplayOptions {
                requests: Some(50),
                rate_scale,
                ..ReplayOptions::default()
            },
        )
        .unwrap()
        .simulated_ms
    };
    assert!(at(4.0) < at(1.0));
    assert!(matches!(
        replay(
            &m,
            &s,
            &ReplayOptions {
                rate_scale: 0.0,
                ..ReplayOptions::default()
            }
        ),
        Err(ReplayError::RateScale(_))
    ));
}

fn read_err(name: &str, text: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join(name);
    std::fs::write(&p, text).unwrap();
    match Trace::read_path(&p, ReadOptions::default()) {
        Ok(t) => panic!("{name} read as {} requests", t.requests.len()),
        Err(e) => e
            .to_string()
            .replace(&dir.path().display().to_string(), "DIR"),
    }
}

const HEAD: &str = "TIMESTAMP,ContextTokens,GeneratedTokens\n";
const OK_LINE: &str = "2023-11-16 18:17:03.9799600,10,2\n";

#[test]
fn bad_trace_lines_name_file_line_and_field() {
    let cases: Vec<(&str, String, &str)> = vec![
        ("t.csv", format!("{HEAD}{OK_LINE}2023-11-16 18:17:04.0,-5,2\n"), "DIR/t.csv:3: `ContextTokens` must be a whole number"),
        ("t.csv", format!("{HEAD}{OK_LINE}2023-11-16 18:17:04.0,0,2\n"), "DIR/t.csv:3: `ContextTokens` must be between 1"),
        ("t.csv", format!("{HEAD}2023-11-16 18:17:04,10,x\n"), "DIR/t.csv:2: `GeneratedTokens` must be a whole number"),
        ("t.csv", format!("{HEAD}2023-11-16 25:17:04,10,1\n"), "DIR/t.csv:2: `TIMESTAMP` has a bad hour"),
        ("t.csv", format!("{HEAD}{OK_LINE}2023-11-16 18:17:02,10,1\n"), "DIR/t.csv:3: `TIMESTAMP` goes back in time"),
        ("t.csv", format!("{HEAD}{OK_LINE}2023-11-16 18:17:05,10\n"), "DIR/t.csv:3: `GeneratedTokens` is missing"),
        ("t.csv", "TIMESTAMP,Context\n1,2\n".into(), "DIR/t.csv:1: `ContextTokens` column is missing"),
        ("t.csv", HEAD.into(), "trace `DIR/t.csv` has no requests"),
        ("t.jsonl", "{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 1, \"hash_ids\": [1]}\n".into(), "DIR/t.jsonl:1: `hash_ids` has 1 ids, but input_length 600 needs ceil(600/512) = 2"),
        ("t.jsonl", "\n{\"timestamp\": -1, \"input_length\": 6, \"output_length\": 1, \"hash_ids\": [1]}\n".into(), "DIR/t.jsonl:2: `timestamp` must be a non-negative number"),
        ("t.jsonl", "{\"timestamp\": 5, \"input_length\": 6, \"output_length\": 1, \"hash_ids\": [1]}\n{\"timestamp\": 4, \"input_length\": 6, \"output_length\": 1, \"hash_ids\": [2]}\n".into(), "DIR/t.jsonl:2: `timestamp` goes back in time"),
        ("t.jsonl", "{\"timestamp\": 0, \"input_length\": 6.5, \"output_length\": 1, \"hash_ids\": [1]}\n".into(), "DIR/t.jsonl:1: `input_length` must be a whole number"),
        ("t.jsonl", "{\"timestamp\": 0, \"output_length\": 1, \"hash_ids\": [1]}\n".into(), "DIR/t.jsonl:1: `input_length` is missing"),
        ("t.jsonl", "{\"timestamp\": 0, \"input_length\": 6, \"output_length\": 1, \"hash_ids\": [\"a\"]}\n".into(), "DIR/t.jsonl:1: `hash_ids` entry 0 must be a non-negative whole number"),
        ("t.jsonl", "{\"timestamp\": 0,\n".into(), "DIR/t.jsonl:1: `line` is not a Mooncake JSON object"),
        ("t.txt", "x".into(), "trace `DIR/t.txt`: unknown format"),
    ];
    for (name, text, want) in cases {
        let got = read_err(name, &text);
        assert!(
            got.contains(want),
            "{text:?}\n  got:  {got}\n  want: {want}"
        );
    }
    let missing = Trace::read_path(Path::new("/nonexistent/t.csv"), ReadOptions::default());
    assert!(matches!(missing, Err(TraceError::Io { .. })));
    // Arbitrary bytes never panic.
    let dir = tempfile::tempdir().unwrap();
    for (i, bytes) in [
        &b"\xff\xfe,,\n\x00"[..],
        b"TIMESTAMP,ContextTokens,GeneratedTokens\n\xff,1,1\n",
        b"{{{{\n[]\n",
        b"\"\n",
    ]
    .iter()
    .enumerate()
    {
        for ext in ["csv", "jsonl"] {
            let p = dir.path().join(format!("{i}.{ext}"));
            std::fs::write(&p, bytes).unwrap();
            assert!(Trace::read_path(&p, ReadOptions::default()).is_err());
        }
    }
}

#[test]
fn skip_bad_lines_counts_and_keeps_rids() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("mixed.csv");
    std::fs::write(
        &p,
        format!(
            "{HEAD}{OK_LINE}2023-11-16 18:17:04.0,-5,2\n2023-11-16 18:17:04.5,20,3\n\
             2023-11-16 18:17:01,20,3\nnot a line\n2023-11-16 18:17:05,30,1\n"
        ),
    )
    .unwrap();
    let strict = Trace::read_path(&p, ReadOptions::default());
    assert!(
        matches!(strict, Err(TraceError::BadLine(ref b)) if b.line == 3 && b.field == "ContextTokens")
    );
    let t = Trace::read_path(
        &p,
        ReadOptions {
            skip_bad_lines: true,
            ..ReadOptions::default()
        },
    )
    .unwrap();
    assert_eq!(t.skipped_lines, 3);
    let rids: Vec<u64> = t.requests.iter().map(|r| r.rid).collect();
    assert_eq!(rids, [0, 2, 5]);
    assert_eq!(t.requests[1].arrival_ms, 520.04);
    assert_eq!(t.bad_line_examples.len(), 3);

    let dir2 = tempfile::tempdir().unwrap();
    let log = dir2.path().join("steps.jsonl");
    let r = replay(
        &crate::helpers::model_fixture("mixed_override"),
        &Settings::default(),
        &ReplayOptions {
            trace: Some(p),
            skip_bad_lines: true,
            step_log: Some(log.clone()),
            ..ReplayOptions::default()
        },
    )
    .unwrap();
    assert_eq!((r.requests, r.skipped_lines), (3, 3));
    assert!(r.to_string().contains("3 bad lines skipped"));
    let logged: std::collections::BTreeSet<u64> = read_log(&log)
        .iter()
        .flat_map(|s| s["rows"].as_array().unwrap().clone())
        .map(|r| r["rid"].as_u64().unwrap())
        .collect();
    assert_eq!(logged, [0, 2, 5].into());
}

#[test]
fn bad_replay_settings_are_refused_naming_the_key() {
    let m = crate::helpers::model_fixture("mixed_override");
    for (toml_text, key) in [
        (
            "[replay]\nnode = \"vision\"\n",
            "`replay.node` = \"vision\": is not a node of model",
        ),
        (
            "[replay]\nwalk = \"prefill\"\n",
            "`replay.walk` = \"prefill\": is not a combined walk",
        ),
        (
            "[replay]\nspeculation = { overshoot_rate = 1.5 }\n",
            "`replay.speculation.overshoot_rate`",
        ),
        (
            "[replay]\ncost = { base_ms = -1.0 }\n",
            "`replay.cost.base_ms`",
        ),
        (
            "[replay]\nprefix_cache = { blocks = 8, block_tokens = 256 }\n",
            "`replay.prefix_cache.block_tokens`",
        ),
    ] {
        let err = replay(&m, &settings(toml_text), &ReplayOptions::default()).unwrap_err();
        assert!(err.to_string().contains(key), "{toml_text}: {err}");
    }
    let err = replay(
        &m,
        &settings("[chunking]\nmax_batch_tokens = { gpu = 5 }\n"),
        &ReplayOptions::default(),
    )
    .unwrap_err();
    assert!(err.to_string().contains("`gpu`"), "{err}");
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(200))]

    /// No input makes a trace reader panic: raw bytes, and lines built from trace-like pieces.
    #[test]
    fn trace_readers_never_panic(
        bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..300),
        lines in proptest::collection::vec(
            r#"(TIMESTAMP,ContextTokens,GeneratedTokens|2023-11-1[0-9] [0-2][0-9]:[0-6][0-9]:[0-9]{2}(\.[0-9]{0,10})?,-?[0-9]{1,12},-?[0-9]{0,3}|\{"timestamp": -?[0-9e.]{1,6}, "input_length": -?[0-9]{1,12}, "output_length": [0-9a"]{0,4}, "hash_ids": \[[0-9, -]{0,12}\]\}|[ -~]{0,20})"#,
            0..8,
        ),
    ) {
        let text = lines.join("\n");
        for format in [replay::TraceFormat::AzureCsv, replay::TraceFormat::MooncakeJsonl] {
            for skip in [false, true] {
                let opts = ReadOptions { limit: None, skip_bad_lines: skip };
                let _ = Trace::read("fuzz".into(), format, bytes.as_slice(), opts);
                let _ = Trace::read("fuzz".into(), format, text.as_bytes(), opts);
            }
        }
    }
}

#[test]
fn bundled_trace_under_the_demo_model_and_default_config_shows_chunking() {
    // What `make run` replays: the demo model and the layered default config.
    let root = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."));
    let loaded = mstar_chunking_sim::config::load(&mstar_chunking_sim::config::LoadOptions {
        config_dir: root.join("config"),
        env: Some(Default::default()),
        ..Default::default()
    })
    .expect("the default config loads against the demo model");
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("steps.jsonl");
    let r = replay(
        &loaded.manifest,
        &loaded.settings,
        &ReplayOptions {
            requests: Some(400),
            step_log: Some(log.clone()),
            ..ReplayOptions::default()
        },
    )
    .unwrap();
    println!("{r}");
    // The demo cost is said to be one, beside it, with where real ones come from.
    let text = r.to_string();
    assert!(
        text.contains("cost model               8 ms + 0.02 ms per token (a demo cost, not measured on any GPU: `--sim-cost llama2-7b-a100`"),
        "{text}"
    );
    assert!(
        text.contains("`mstar-chunking fit` for your engine's; docs/cost-model.md)"),
        "{text}"
    );
    assert!(r.chunks.prompts_cut > 0, "no prompt was cut\n{r}");
    assert!(
        r.cut_step_utilisation.unwrap() > 0.9,
        "cut steps not full\n{r}"
    );
    assert_eq!(r.decode_row_waits, 0, "decode rows stalled\n{r}");
    assert_eq!(r.overruns.total, 0);
    check(&log, 16);
}

/// `make run`'s summary marks the demo cost as one; a preset's or given coefficients are not.
#[test]
fn only_the_demo_cost_is_marked_as_one_in_the_summary() {
    let r = crate::helpers::run(&["replay", "--requests", "3", "--no-progress"], &[]);
    assert_eq!(r.code, 0, "{r:?}");
    assert!(
        r.stdout
            .contains("8 ms + 0.02 ms per token (a demo cost, not measured on any GPU"),
        "{}",
        r.stdout
    );
    for cost in ["llama2-7b-a100", "8,0.03,0,0"] {
        let r = crate::helpers::run(
            &[
                "replay",
                "--requests",
                "3",
                "--no-progress",
                "--sim-cost",
                cost,
            ],
            &[],
        );
        assert_eq!(r.code, 0, "{r:?}");
        assert!(r.stdout.contains("cost model "), "{}", r.stdout);
        assert!(!r.stdout.contains("demo cost"), "{cost}: {}", r.stdout);
    }
}

/// Kills (panics) each actor in turn while a replay runs on the same actors: the replay
/// finishes, every prompt through its final chunk, nothing held.
#[test]
fn a_replay_survives_actors_panicking_midway() {
    use mstar_chunking::actors::ActorKind;
    use mstar_chunking::{ChunkingError, ChunkingManagement};
    let m = crate::helpers::model_fixture("mixed_override");
    let s = demo_settings("");
    // Arrivals 100 times as dense, so that prompts queue behind each other.
    let opts = ReplayOptions {
        requests: Some(300),
        rate_scale: 100.0,
        ..ReplayOptions::default()
    };
    // The kills are driven by the replay's progress, not the clock: one every 20 steps.
    let (steps_tx, mut steps_rx) = tokio::sync::mpsc::unbounded_channel::<u64>();
    let opts = ReplayOptions {
        on_step: Some(replay::StepHook(std::sync::Arc::new(move |steps| {
            if steps % 20 == 0 {
                let _ = steps_tx.send(steps);
            }
        }))),
        ..opts
    };
    let (report, kills) = actix::System::new().block_on(async {
        let cm = ChunkingManagement::start("test", m.submodules()).unwrap();
        let killer = {
            let cm = cm.clone();
            actix::spawn(async move {
                let mut kills = Vec::new();
                for actor in [
                    ActorKind::Scheduler,
                    ActorKind::PreparedInputs,
                    ActorKind::OverrunAccounting,
                    ActorKind::BudgetConfig,
                    ActorKind::PolicyRegistry,
                ] {
                    steps_rx
                        .recv()
                        .await
                        .expect("the replay runs more than 100 steps");
                    let err = cm.inject_panic(actor).await.unwrap_err();
                    assert!(matches!(err, ChunkingError::ActorPanicked { .. }), "{err}");
                    // Mid-replay: prompts are still queued when the actor dies.
                    let s = cm.queue_stats().await.unwrap();
                    kills.push((s.prefill_rows, s.steps_in_flight));
                }
                kills
            })
        };
        let report = replay::run_on(&cm, &m, &s, &opts).await.unwrap();
        (report, killer.await.unwrap())
    });
    assert_eq!(kills.len(), 5);
    assert!(
        kills.iter().any(|(queued, _)| *queued > 0),
        "no kill landed mid-replay: {kills:?}"
    );
    assert_eq!(report.requests, 300);
    assert_eq!(
        report.chunks.final_chunks, 300,
        "every prompt finished its prefill"
    );
    assert_eq!(
        (report.prepared_left_rows, report.prepared_left_tokens),
        (0, 0)
    );
}

/// Replays the first `requests` of the Mooncake head trace at a tenth of its rate on the
/// `mixed_override` model under the demo settings plus `config`; answers the report and the
/// step log's lines.
fn mooncake_at_a_tenth(config: &str, requests: usize) -> (ReplayReport, Vec<Value>) {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("steps.jsonl");
    let r = replay(
        &crate::helpers::model_fixture("mixed_override"),
        &demo_settings(config),
        &ReplayOptions {
            trace: Some(shared(
                "traces/mooncake_fast25_synthetic_trace.head2000.jsonl",
            )),
            requests: Some(requests),
            rate_scale: 0.1,
            step_log: Some(log.clone()),
            ..ReplayOptions::default()
        },
    )
    .unwrap();
    (r, read_log(&log))
}

/// With the planner's latency model equal to the simulated cost and no noise, every step is
/// priced as it was predicted (to the µs the step log keeps): the decode rows start with the
/// simulated engine's context, so the planner counts the first generated token too, and a
/// step filled to its time budget is never over it.
#[test]
fn a_planner_given_the_simulated_cost_predicts_every_step_exactly() {
    let (r, steps) = mooncake_at_a_tenth(
        "[chunking.max_step_ms]\nllm = 100.0\n[chunking.cost]\nllm = \"llama2-7b-a100\"\n[replay]\ncost = \"llama2-7b-a100\"\n",
        400,
    );
    // (ms − predicted) over the steps with decode rows: a context a token short per decode row
    // would make each 3.3e-4 ms per row over.
    let mut over = Vec::new();
    for step in &steps {
        let (ms, predicted) = (
            step["ms"].as_f64().unwrap(),
            step["predicted_ms"].as_f64().unwrap(),
        );
        // Both rounded to the µs: at most one µs apart.
        assert!((ms - predicted).abs() <= 0.0011, "{step}");
        if step["rows"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["kind"] == "continue")
        {
            over.push(ms - predicted);
        }
    }
    assert!(
        over.len() > 1000,
        "too few steps with decode rows: {}",
        over.len()
    );
    let mean = over.iter().sum::<f64>() / over.len() as f64;
    assert!(mean.abs() < 1e-5, "predicted {mean} ms short on average");
    assert_eq!(r.time_overruns.total, 0, "{r}");
}

/// `replay.cost.noise_bands` multiplies each step's price by a draw from the quantiles of the
/// band its price falls in: every step's measured ÷ predicted lies between that band's least
/// and largest ratio, and the share of steps below each quantile is that quantile's (the planner
/// prices with the same model, so `predicted_ms` is the noise-free price).
#[test]
fn a_step_time_is_its_price_times_a_ratio_drawn_from_its_noise_band() {
    let ratios_of = |bands: &str| {
        let (r, steps) = mooncake_at_a_tenth(
            &format!(
                "[chunking.max_step_ms]\nllm = 100.0\n[chunking.cost]\nllm = \"llama2-7b-a100\"\n[replay.cost]\npreset = \"llama2-7b-a100\"\n{bands}"
            ),
            200,
        );
        assert!(
            r.to_string().contains("noise drawn from measured ratios"),
            "{r}"
        );
        steps
            .iter()
            .map(|step| {
                let predicted = step["predicted_ms"].as_f64().unwrap();
                (predicted, step["ms"].as_f64().unwrap() / predicted)
            })
            .collect::<Vec<(f64, f64)>>()
    };
    let doubled = ratios_of("[[replay.cost.noise_bands]]\nratios = [2.0, 2.0]\n");
    assert!(doubled.len() > 1000, "{}", doubled.len());
    assert!(
        doubled.iter().all(|(_, r)| (r - 2.0).abs() < 1e-3),
        "{doubled:?}"
    );
    // Steps priced below 60 ms are doubled; the others drawn from [0.5, 1, 3].
    let banded = ratios_of(
        "[[replay.cost.noise_bands]]\nup_to_ms = 60.0\nratios = [2.0, 2.0]\n[[replay.cost.noise_bands]]\nratios = [0.5, 1.0, 3.0]\n",
    );
    let (short, long): (Vec<_>, Vec<_>) = banded.iter().partition(|(p, _)| *p < 60.0 - 1e-3);
    assert!(
        short.len() > 100 && long.len() > 300,
        "{} {}",
        short.len(),
        long.len()
    );
    assert!(short.iter().all(|(_, r)| (r - 2.0).abs() < 1e-3));
    let share = |f: &dyn Fn(f64) -> bool| {
        long.iter().filter(|(_, r)| f(*r)).count() as f64 / long.len() as f64
    };
    assert!(share(&|r| (0.499..=3.001).contains(&r)) == 1.0);
    // Half the draws lie below the middle quantile, a quarter above 2 (halfway from 1 to 3).
    let below_1 = share(&|r| r < 1.0);
    let above_2 = share(&|r| r > 2.0);
    assert!((below_1 - 0.5).abs() < 0.07, "{below_1}");
    assert!((above_2 - 0.25).abs() < 0.07, "{above_2}");
}
