//! `replay` and `sweep` settings as flags (`docs/config.md#flags`): each flag is its config
//! key, set in a layer over every other, so it runs as the key runs and is refused as the key
//! is, naming the flag where the key names its layer; `--help` names the keys.

use serde_json::Value;

use crate::helpers::{run, run_in};

/// Each flag, and the same setting as a config layer (a file) for the demo model's `llm`.
const SAME: &[(&[&str], &str)] = &[
    (
        &["--max-step-ms", "40", "--cost", "llama2-7b-h100"],
        "[chunking]\nmax_step_ms = { llm = 40 }\ncost = { llm = \"llama2-7b-h100\" }\n",
    ),
    (
        &["--cost", "5,0.06,0.0003,3e-6", "--max-step-ms", "60"],
        "[chunking]\nmax_step_ms = { llm = 60 }\ncost = { llm = { base_ms = 5, per_token_ms = 0.06, per_kv_token_ms = 0.0003, per_attention_pair_ms = 3e-6 } }\n",
    ),
    (
        &["--cost", "llama2-7b-a100", "--max-step-ms", "60", "--time-margin", "0.9"],
        "[chunking]\nmax_step_ms = { llm = 60 }\ncost = { llm = \"llama2-7b-a100\" }\ntime_margin = 0.9\n",
    ),
    (
        &["--learn-cost", "--max-step-ms", "60"],
        "[chunking]\nlearn_cost = true\nmax_step_ms = { llm = 60 }\n",
    ),
    (
        &["--sim-cost", "llama2-7b-h100"],
        "[replay]\ncost = \"llama2-7b-h100\"\n",
    ),
    (
        &["--sim-cost", "6,0.03,0,0"],
        "[replay]\ncost = { base_ms = 6, per_token_ms = 0.03, per_kv_token_ms = 0, per_attention_pair_ms = 0 }\n",
    ),
    (&["--kv-blocks", "3000"], "[replay.kv]\nblocks = 3000\n"),
    (
        &["--kv-memory", "llama2-7b-a100"],
        "[replay.kv]\npreset = \"llama2-7b-a100\"\n",
    ),
    (
        &["--kv-memory", "24,8,131072"],
        "[replay.kv]\ngpu_memory_gb = 24\nweights_gb = 8\nkv_bytes_per_token = 131072\n",
    ),
    (
        &[
            "--prefill-workers",
            "1",
            "--decode-workers",
            "2",
            "--kv-link-gbps",
            "25",
            "--kv-link-latency-ms",
            "0.5",
        ],
        "[replay.fleet]\nprefill_workers = 1\ndecode_workers = 2\nkv_link_gbps = 25\nkv_link_latency_ms = 0.5\n",
    ),
];

/// A replay's JSON report without what differs between any two runs (wall time) or names the
/// layers (which say whether a flag or a file set the key).
fn figures(path: &std::path::Path) -> Value {
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let o = v.as_object_mut().unwrap();
    for k in ["wall_ms", "steps_per_second"] {
        o.remove(k);
    }
    v["settings"]
        .as_object_mut()
        .unwrap()
        .remove("config_layers");
    v
}

#[test]
fn each_flag_runs_as_its_config_key() {
    let dir = tempfile::tempdir().unwrap();
    for (i, (flags, toml)) in SAME.iter().enumerate() {
        let layer = dir.path().join(format!("layer{i}.toml"));
        std::fs::write(&layer, toml).unwrap();
        let (a, b) = (dir.path().join("a.json"), dir.path().join("b.json"));
        let common = [
            "replay",
            "--requests",
            "40",
            "--no-progress",
            "--report-json",
        ];
        let mut by_flag: Vec<&str> = common.to_vec();
        by_flag.push(a.to_str().unwrap());
        by_flag.extend(*flags);
        let r = run(&by_flag, &[]);
        assert_eq!(r.code, 0, "{flags:?}: {r:?}");
        assert!(
            r.stdout
                .contains("config/default.toml -> command-line flags"),
            "{}",
            r.stdout
        );
        let mut by_key: Vec<&str> = common.to_vec();
        by_key.extend([b.to_str().unwrap(), "--config", layer.to_str().unwrap()]);
        let r = run(&by_key, &[]);
        assert_eq!(r.code, 0, "{toml}: {r:?}");
        assert_eq!(figures(&a), figures(&b), "{flags:?} against\n{toml}");
    }
}

/// A flag over a file's setting replaces it: `--kv-blocks` over a preset sizes the pool by
/// blocks alone, `--sim-cost` keeps the file's noise, `--max-step-ms` replaces a per-walk table.
#[test]
fn a_flag_replaces_what_lower_layers_said_for_its_setting() {
    let dir = tempfile::tempdir().unwrap();
    let layer = dir.path().join("layer.toml");
    std::fs::write(
        &layer,
        "[chunking.max_step_ms]\nllm = { mixed = 30 }\n[replay]\ncost = { preset = \"llama2-7b-a100\", noise = 0.05 }\nkv = { preset = \"llama2-7b-a100\", block_tokens = 32 }\n",
    )
    .unwrap();
    let json = dir.path().join("r.json");
    let r = run(
        &[
            "replay",
            "--requests",
            "20",
            "--no-progress",
            "--config",
            layer.to_str().unwrap(),
            "--kv-blocks",
            "2000",
            "--sim-cost",
            "8,0.02,0,0",
            "--max-step-ms",
            "off",
            "--report-json",
            json.to_str().unwrap(),
        ],
        &[],
    );
    assert_eq!(r.code, 0, "{r:?}");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(v["kv"]["blocks"], 2000);
    assert_eq!(v["kv"]["block_tokens"], 32);
    assert_eq!(v["settings"]["cost"]["preset"], Value::Null);
    assert_eq!(v["settings"]["cost"]["base_ms"], 8.0);
    assert_eq!(v["settings"]["cost"]["noise"], 0.05);
    let budgets = v["settings"]["budgets"].as_array().unwrap();
    assert!(budgets.iter().all(|b| b["max_step_ms"].is_null()), "{v}");
}

/// Every refusal of a flag's value is the refusal of its key, word for word after the layer:
/// the flag is named where the key's layer would be.
#[test]
fn a_flag_is_refused_as_its_key_is_naming_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let cases: &[(&[&str], &str, &str)] = &[
        (
            &["--time-margin", "1.5", "--max-step-ms", "50", "--cost", "llama2-7b-a100"],
            "[chunking]\ntime_margin = 1.5\nmax_step_ms = { llm = 50 }\ncost = { llm = \"llama2-7b-a100\" }\n",
            "--time-margin",
        ),
        (
            &["--time-margin", "0.9"],
            "[chunking]\ntime_margin = 0.9\n",
            "--time-margin",
        ),
        (
            &["--max-step-ms", "0"],
            "[chunking.max_step_ms]\nllm = 0\n",
            "--max-step-ms",
        ),
        (
            &["--max-step-ms", "nan"],
            "[chunking.max_step_ms]\nllm = \"nan\"\n",
            "--max-step-ms",
        ),
        (
            &["--max-step-ms", "50"],
            "[chunking.max_step_ms]\nllm = 50\n",
            "--max-step-ms",
        ),
        (
            &["--cost", "gpt-9"],
            "[chunking.cost]\nllm = \"gpt-9\"\n",
            "--cost",
        ),
        (
            // `=` takes a value that starts with `-` as the value, not a flag.
            &["--cost=-1,0,0,0"],
            "[chunking.cost]\nllm = { base_ms = -1, per_token_ms = 0, per_kv_token_ms = 0, per_attention_pair_ms = 0 }\n",
            "--cost",
        ),
        (
            &["--sim-cost", "0,0,0,0"],
            "[replay.cost]\nbase_ms = 0\nper_token_ms = 0\nper_kv_token_ms = 0\nper_attention_pair_ms = 0\n",
            "--sim-cost",
        ),
        (
            &["--sim-cost", "1e7,0,0,0"],
            "[replay.cost]\nbase_ms = 1e7\nper_token_ms = 0\nper_kv_token_ms = 0\nper_attention_pair_ms = 0\n",
            "--sim-cost",
        ),
        (
            &["--sim-cost", "gpt-9"],
            "[replay]\ncost = \"gpt-9\"\n",
            "--sim-cost",
        ),
        (&["--kv-blocks", "0"], "[replay.kv]\nblocks = 0\n", "--kv-blocks"),
        (&["--kv-blocks", "many"], "[replay.kv]\nblocks = \"many\"\n", "--kv-blocks"),
        (
            &["--kv-memory", "16,15,524288"],
            "[replay.kv]\ngpu_memory_gb = 16\nweights_gb = 15\nkv_bytes_per_token = 524288\n",
            "--kv-memory",
        ),
        (
            &["--kv-memory", "h200"],
            "[replay.kv]\npreset = \"h200\"\n",
            "--kv-memory",
        ),
    ];
    for (i, (flags, toml, flag)) in cases.iter().enumerate() {
        let layer = dir.path().join(format!("bad{i}.toml"));
        std::fs::write(&layer, toml).unwrap();
        let mut by_flag = vec!["replay", "--requests", "5", "--no-progress"];
        by_flag.extend(*flags);
        let by_flag = run(&by_flag, &[]);
        let by_key = run(
            &[
                "replay",
                "--requests",
                "5",
                "--no-progress",
                "--config",
                layer.to_str().unwrap(),
            ],
            &[],
        );
        assert_eq!(by_flag.code, 2, "{flags:?}: {by_flag:?}");
        assert_eq!(by_key.code, 2, "{toml}: {by_key:?}");
        // The problems, with the layer that set the key taken out.
        let reasons = |r: &crate::helpers::Run, layer: &str| -> Vec<String> {
            r.stderr
                .lines()
                .filter(|l| l.starts_with("  ") || l.starts_with("error: "))
                .map(|l| l.replace(layer, "LAYER"))
                .collect()
        };
        let flagged = reasons(&by_flag, &format!("command-line flag {flag}"));
        assert!(
            flagged.iter().any(|l| l.contains("LAYER")),
            "{flags:?} not named: {}",
            by_flag.stderr
        );
        assert_eq!(
            flagged,
            reasons(&by_key, layer.to_str().unwrap()),
            "{flags:?} against\n{toml}"
        );
    }
    // The flag's own syntax (a preset or a list of four or five, of three) is the flag's to refuse.
    for bad in [
        &["--cost", "1,2,3"][..],
        &["--sim-cost", "1,2,3,4,5,6"],
        &["--kv-memory", "80,1"],
        &["--kv-blocks", "10", "--kv-memory", "llama2-7b-a100"],
        &["--max-step-ms", "50", "--watch-config"],
    ] {
        let mut args = vec!["replay"];
        args.extend(bad);
        let r = run(&args, &[]);
        assert_eq!(r.code, 2, "{bad:?}: {r:?}");
    }
}

#[test]
fn help_names_the_config_keys_and_the_default_file() {
    for cmd in ["replay", "sweep"] {
        let r = run(&[cmd, "--help"], &[]);
        assert_eq!(r.code, 0, "{r:?}");
        for key in [
            "chunking.max_step_ms.<node>",
            "chunking.cost.<node>",
            "chunking.learn_cost",
            "replay.cost",
            "chunking.time_margin",
            "config/default.toml",
            "docs/config.md",
        ] {
            assert!(
                r.stdout.contains(key),
                "{cmd}: {key} missing:\n{}",
                r.stdout
            );
        }
    }
    let r = run(&["replay", "--help"], &[]);
    assert!(r.stdout.contains("replay.kv.blocks") && r.stdout.contains("replay.kv.preset"));
}

/// Outside the repository the built-in copies stand in, and the replay says so once.
#[test]
fn outside_the_repository_the_built_in_copies_are_said_once() {
    let dir = tempfile::tempdir().unwrap();
    let r = run_in(
        dir.path(),
        &["replay", "--requests", "5", "--no-progress"],
        &[],
    );
    assert_eq!(r.code, 0, "{r:?}");
    assert_eq!(
        r.stderr.matches("built into this binary").count(),
        1,
        "{}",
        r.stderr
    );
    assert!(
        r.stderr
            .contains("config/default.toml and config/models/demo.toml not found"),
        "{}",
        r.stderr
    );
    assert!(
        r.stdout
            .contains("config layers            built-in config/default.toml\n"),
        "{}",
        r.stdout
    );
    // In the repository: nothing said.
    let r = run(&["replay", "--requests", "5", "--no-progress"], &[]);
    assert!(!r.stderr.contains("built into"), "{}", r.stderr);
}

/// Every setting that changes results is in the run's label: two time margins give two
/// labels, in the summary, the JSON `settings` and a sweep's settings.
#[test]
fn the_time_margin_and_the_planner_settings_are_in_the_label() {
    let dir = tempfile::tempdir().unwrap();
    let mut labels = Vec::new();
    for margin in ["0.000001", "1"] {
        let json = dir.path().join(format!("r{margin}.json"));
        let r = run(
            &[
                "replay",
                "--requests",
                "60",
                "--no-progress",
                "--max-step-ms",
                "50",
                "--cost",
                "llama2-7b-a100",
                "--sim-cost",
                "llama2-7b-a100",
                "--time-margin",
                margin,
                "--report-json",
                json.to_str().unwrap(),
            ],
            &[],
        );
        assert_eq!(r.code, 0, "{r:?}");
        let planner = r
            .stdout
            .lines()
            .find(|l| l.trim_start().starts_with("planner "))
            .unwrap_or_else(|| panic!("no planner line:\n{}", r.stdout))
            .to_owned();
        assert!(
            planner.contains(&format!("time margin q{}", margin.parse::<f64>().unwrap())),
            "{planner}"
        );
        let v: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        assert_eq!(
            v["settings"]["planner"]["time_margin"].as_f64(),
            Some(margin.parse().unwrap())
        );
        assert_eq!(v["settings"]["planner"]["min_chunk_tokens"], 64);
        assert_eq!(v["settings"]["planner"]["learn_cost"], false);
        assert!(v["settings"]["planner"]["cost"].is_array(), "{v}");
        labels.push((planner, v["settings"].clone()));
    }
    assert_ne!(labels[0], labels[1]);
    let out = dir.path().join("sweep");
    let r = run(
        &[
            "sweep",
            "--requests",
            "30",
            "--budgets",
            "1024",
            "--rates",
            "1",
            "--no-progress",
            "--max-step-ms",
            "50",
            "--cost",
            "llama2-7b-a100",
            "--time-margin",
            "0.5",
            "--out",
            out.to_str().unwrap(),
        ],
        &[],
    );
    assert_eq!(r.code, 0, "{r:?}");
    let sweep = std::fs::read_to_string(out.join("sweep.json")).unwrap();
    assert!(sweep.contains("time margin q0.5"), "{sweep}");
    assert!(sweep.contains("command-line flags"), "{sweep}");
}

/// The order of waiting prompts, its starvation bound and the priority rule change which prompt
/// starts first, so each is in the run's label; the default order (`fcfs`, no bound) adds nothing
/// to the summary's planner line.
#[test]
fn the_order_its_bound_and_the_priority_rule_are_in_the_label() {
    let dir = tempfile::tempdir().unwrap();
    let planner_line = |stdout: &str| {
        stdout
            .lines()
            .find(|l| l.trim_start().starts_with("planner "))
            .unwrap_or_else(|| panic!("no planner line:\n{stdout}"))
            .to_owned()
    };
    let json = dir.path().join("default.json");
    let r = run(
        &[
            "replay",
            "--requests",
            "30",
            "--no-progress",
            "--report-json",
            json.to_str().unwrap(),
        ],
        &[],
    );
    assert_eq!(r.code, 0, "{r:?}");
    let default_line = planner_line(&r.stdout);
    assert!(!default_line.contains("order"), "{default_line}");
    assert!(!default_line.contains("max wait"), "{default_line}");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(v["settings"]["planner"]["order"], "fcfs");
    assert!(v["settings"]["planner"]["max_wait_ms"].is_null(), "{v}");

    let json = dir.path().join("priority.json");
    let r = run(
        &[
            "replay",
            "--requests",
            "30",
            "--no-progress",
            "--priority-by",
            "prompt-length:2048",
            "--report-json",
            json.to_str().unwrap(),
        ],
        &[
            ("MSTAR__CHUNKING__ORDER", "priority"),
            ("MSTAR__CHUNKING__MAX_WAIT_MS", "750"),
            ("MSTAR__CHUNKING__MAX_WAIT_STEPS", "40"),
        ],
    );
    assert_eq!(r.code, 0, "{r:?}");
    let line = planner_line(&r.stdout);
    for part in [
        "; order priority",
        "; max wait 750 ms",
        "; max wait 40 steps",
        "; priority by prompt-length:2048",
    ] {
        assert!(line.contains(part), "`{part}` missing from {line}");
    }
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let planner = &v["settings"]["planner"];
    assert_eq!(planner["order"], "priority");
    assert_eq!(planner["max_wait_ms"].as_f64(), Some(750.0));
    assert_eq!(planner["max_wait_steps"], 40);
    assert_eq!(planner["priority_by"], "prompt-length:2048");
}

/// `sweep` takes the same setting flags through the same parser: each runs as its config key
/// (the same `sweep.csv`) and is refused as the key is, naming the flag.
#[test]
fn sweep_flags_run_and_are_refused_as_their_config_keys() {
    let dir = tempfile::tempdir().unwrap();
    let sweep = |out: &std::path::Path, extra: &[&str]| {
        let mut args = vec![
            "sweep",
            "--requests",
            "20",
            "--budgets",
            "1024",
            "--rates",
            "1",
            "--no-progress",
            "--out",
            out.to_str().unwrap(),
        ];
        args.extend(extra);
        run(&args, &[])
    };
    for (i, (flags, toml)) in SAME
        .iter()
        .enumerate()
        // KV memory is the sweep's own list axis (`--kv-blocks`), not a setting flag.
        .filter(|(_, (flags, _))| !flags.iter().any(|f| f.starts_with("--kv-")))
    {
        let layer = dir.path().join(format!("layer{i}.toml"));
        std::fs::write(&layer, toml).unwrap();
        let (a, b) = (
            dir.path().join(format!("a{i}")),
            dir.path().join(format!("b{i}")),
        );
        let r = sweep(&a, flags);
        assert_eq!(r.code, 0, "{flags:?}: {r:?}");
        let r = sweep(&b, &["--config", layer.to_str().unwrap()]);
        assert_eq!(r.code, 0, "{toml}: {r:?}");
        assert_eq!(
            std::fs::read_to_string(a.join("sweep.csv")).unwrap(),
            std::fs::read_to_string(b.join("sweep.csv")).unwrap(),
            "{flags:?} against\n{toml}"
        );
    }
    for (flags, flag) in [
        (&["--time-margin", "1.5"][..], "--time-margin"),
        (&["--max-step-ms", "nan"], "--max-step-ms"),
        (&["--cost", "gpt-9"], "--cost"),
        (&["--sim-cost", "0,0,0,0"], "--sim-cost"),
    ] {
        let out = dir.path().join("refused");
        let r = sweep(&out, flags);
        assert_eq!(r.code, 2, "{flags:?}: {r:?}");
        assert!(
            r.stderr.contains(&format!("command-line flag {flag}")),
            "{flags:?} not named: {}",
            r.stderr
        );
        assert!(!out.exists(), "{flags:?}: a refused sweep wrote {out:?}");
    }
}
