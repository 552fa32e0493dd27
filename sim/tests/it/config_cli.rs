//! `check` and `budgets` on good and bad layered configs (docs/config.md).

use serde_json::json;

use crate::helpers::{budgets_json, fixture, repo_root, row, run, run_in};

const OMNI: &str = "config/models/omni.toml";
const DEMO: &str = "config/models/demo.toml";

// === good configs ===

#[test]
fn check_prints_the_effective_table_of_the_defaults() {
    let r = run(&["check"], &[]);
    assert_eq!(r.code, 0, "{r:?}");
    assert!(
        r.stdout
            .contains("model `demo` from config/models/demo.toml"),
        "{}",
        r.stdout
    );
    assert!(
        r.stdout.contains("layers: config/default.toml\n"),
        "{}",
        r.stdout
    );
    let table: Vec<&str> = r
        .stdout
        .lines()
        .skip_while(|l| !l.starts_with("node"))
        .collect();
    assert_eq!(
        table[0],
        "node  walk     policy  budget  chunkable  floor  caps  step ms  model  order"
    );
    assert_eq!(
        table[1],
        "llm   prefill  2048    2048    yes        64     -     -        -      fcfs"
    );
    assert_eq!(
        table[2],
        "llm   decode   -       -       no         -      -     -        -      fcfs"
    );
    assert_eq!(
        table[3],
        "llm   mixed    2048    2048    yes        64     -     -        -      fcfs"
    );
    assert!(r.stderr.is_empty(), "{}", r.stderr);
}

#[test]
fn the_built_in_copies_work_from_any_directory() {
    let dir = tempfile::tempdir().unwrap();
    let r = run_in(dir.path(), &["check"], &[]);
    assert_eq!(r.code, 0, "{r:?}");
    assert!(
        r.stdout.contains("built-in config/models/demo.toml"),
        "{}",
        r.stdout
    );
    assert!(
        r.stdout.contains("layers: built-in config/default.toml"),
        "{}",
        r.stdout
    );
}

#[test]
fn the_mstar_env_layer_applies_after_the_default() {
    let r = run(&["check"], &[("MSTAR_ENV", "production")]);
    assert_eq!(r.code, 0, "{r:?}");
    assert!(
        r.stdout
            .contains("layers: config/default.toml -> config/production.toml"),
        "{}",
        r.stdout
    );
    assert!(r.stdout.contains("min_chunk_tokens 128"), "{}", r.stdout);
}

#[test]
fn config_files_apply_in_order_and_the_environment_last() {
    let a = fixture("layers/a.toml");
    let b = fixture("layers/b.yaml");
    let c = fixture("layers/c.json");
    let (a, b, c) = (
        a.to_str().unwrap(),
        b.to_str().unwrap(),
        c.to_str().unwrap(),
    );
    let rows = budgets_json(&["--config", a, "--config", b], &[]);
    // a.toml: floor 32, mixed 1024; b.yaml: floor 48, mixed off.
    assert_eq!(row(&rows, "llm", "mixed")["max_batch_tokens"], json!(null));
    assert_eq!(row(&rows, "llm", "mixed")["chunkable"], false);
    assert_eq!(row(&rows, "llm", "prefill")["max_batch_tokens"], 2048);
    assert_eq!(row(&rows, "llm", "prefill")["min_chunk_tokens"], 48);
    let rows = budgets_json(&["--config", a, "--config", b, "--config", c], &[]);
    assert_eq!(row(&rows, "llm", "mixed")["max_batch_tokens"], 1536);
    let rows = budgets_json(
        &["--config", a, "--config", c],
        &[
            ("MSTAR__CHUNKING__MAX_BATCH_TOKENS__LLM__MIXED", "768"),
            ("MSTAR__CHUNKING__MIN_CHUNK_TOKENS", "16"),
        ],
    );
    assert_eq!(row(&rows, "llm", "mixed")["max_batch_tokens"], 768);
    assert_eq!(row(&rows, "llm", "mixed")["min_chunk_tokens"], 16);
    // The order matters: c then a leaves a's 1024.
    let rows = budgets_json(&["--config", c, "--config", a], &[]);
    assert_eq!(row(&rows, "llm", "mixed")["max_batch_tokens"], 1024);
}

#[test]
fn environment_overrides_reach_nested_keys_and_lists() {
    let rows = budgets_json(
        &["--model", OMNI],
        &[
            ("MSTAR__CHUNKING__MAX_BATCH_TOKENS__THINKER__MIXED", "4096"),
            ("MSTAR__CHUNKING__MAX_BATCH_TOKENS__VISION", "off"),
            ("MSTAR__CHUNKING__NO_CHUNKING", "talker"),
        ],
    );
    assert_eq!(row(&rows, "thinker", "mixed")["max_batch_tokens"], 4096);
    assert_eq!(
        row(&rows, "vision", "prefill")["max_batch_tokens"],
        json!(null)
    );
    assert_eq!(
        row(&rows, "talker", "prefill")["max_batch_tokens"],
        json!(null)
    );
}

#[test]
fn budgets_json_of_the_demo_model() {
    let rows = budgets_json(&["--model", DEMO], &[]);
    assert_eq!(
        rows,
        json!([
            {"node": "llm", "walk": "prefill", "policy_budget": 2048, "max_batch_tokens": 2048,
             "chunkable": true, "min_chunk_tokens": 64, "walk_caps": null, "max_step_ms": null, "cost": null, "learn_cost": false, "order": "fcfs"},
            {"node": "llm", "walk": "decode", "policy_budget": null, "max_batch_tokens": null,
             "chunkable": false, "min_chunk_tokens": null, "walk_caps": null, "max_step_ms": null, "cost": null, "learn_cost": false, "order": "fcfs"},
            {"node": "llm", "walk": "mixed", "policy_budget": 2048, "max_batch_tokens": 2048,
             "chunkable": true, "min_chunk_tokens": 64, "walk_caps": null, "max_step_ms": null, "cost": null, "learn_cost": false, "order": "fcfs"},
        ])
    );
}

#[test]
fn budgets_json_of_the_omni_model_has_caps_and_every_node_and_walk() {
    let rows = budgets_json(&["--model", OMNI], &[]);
    let nodes_walks: Vec<(String, String)> = rows
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["node"].as_str().unwrap().into(),
                r["walk"].as_str().unwrap().into(),
            )
        })
        .collect();
    let want: Vec<(String, String)> = ["thinker", "vision", "talker"]
        .iter()
        .flat_map(|n| ["prefill", "decode", "mixed"].map(|w| (n.to_string(), w.to_string())))
        .collect();
    assert_eq!(nodes_walks, want, "manifest order, every node x walk");
    assert_eq!(
        row(&rows, "thinker", "mixed"),
        &json!({"node": "thinker", "walk": "mixed", "policy_budget": 8192,
                "max_batch_tokens": 8192, "chunkable": true, "min_chunk_tokens": 64,
                "walk_caps": {"decode": 256, "prefill": 4096},
                "max_step_ms": null, "cost": null, "learn_cost": false, "order": "fcfs"})
    );
    assert_eq!(row(&rows, "thinker", "decode")["chunkable"], false);
    assert_eq!(
        row(&rows, "vision", "prefill"),
        &json!({"node": "vision", "walk": "prefill", "policy_budget": 8192,
                "max_batch_tokens": 8192, "chunkable": false, "min_chunk_tokens": 64,
                "walk_caps": null, "max_step_ms": null, "cost": null, "learn_cost": false, "order": "fcfs"})
    );
    assert_eq!(row(&rows, "talker", "prefill")["max_batch_tokens"], 2048);
    assert_eq!(row(&rows, "talker", "prefill")["chunkable"], true);
}

#[test]
fn budgets_json_with_the_omni_worker_layer_turns_the_talker_off() {
    let rows = budgets_json(
        &["--model", OMNI, "--config", "config/omni-worker.toml"],
        &[],
    );
    assert_eq!(
        row(&rows, "talker", "prefill"),
        &json!({"node": "talker", "walk": "prefill", "policy_budget": 2048,
                "max_batch_tokens": null, "chunkable": false, "min_chunk_tokens": null,
                "walk_caps": null, "max_step_ms": null, "cost": null, "learn_cost": false, "order": "fcfs"})
    );
    assert_eq!(
        row(&rows, "thinker", "mixed")["walk_caps"],
        json!({"decode": 192, "prefill": 4096})
    );
    assert_eq!(row(&rows, "thinker", "mixed")["max_batch_tokens"], 6144);
}

#[test]
fn budgets_without_json_prints_only_the_table() {
    let r = run(
        &[
            "budgets",
            "--model",
            OMNI,
            "--config",
            "config/omni-worker.toml",
        ],
        &[],
    );
    assert_eq!(r.code, 0, "{r:?}");
    let lines: Vec<&str> = r.stdout.lines().collect();
    assert!(lines[0].starts_with("node "), "{}", r.stdout);
    assert_eq!(lines.len(), 10, "a header and 9 rows: {}", r.stdout);
    assert!(
        lines
            .iter()
            .any(|l| l.split_whitespace().collect::<Vec<_>>()
                == [
                    "thinker",
                    "mixed",
                    "8192",
                    "6144",
                    "yes",
                    "64",
                    "decode=192,prefill=4096",
                    "-",
                    "-",
                    "fcfs"
                ]),
        "{}",
        r.stdout
    );
}

#[test]
fn logs_go_to_stderr_as_json_lines_when_asked_and_rust_log_wins() {
    let c = fixture("layers/c.json");
    let args = ["check", "--config", c.to_str().unwrap()];
    let r = run(&args, &[("RUST_LOG", "debug")]);
    assert_eq!(r.code, 0, "{r:?}");
    let line = r
        .stderr
        .lines()
        .find(|l| l.contains("configuration loaded"))
        .unwrap_or_else(|| panic!("no log line: {}", r.stderr));
    let v: serde_json::Value = serde_json::from_str(line).expect("a JSON log line");
    assert_eq!(v["level"], "DEBUG");
    assert_eq!(v["fields"]["message"], "configuration loaded");
    assert!(!r.stdout.contains("configuration loaded"));
    // Without RUST_LOG, log.level = "info" hides the debug line.
    let r = run(&args, &[]);
    assert!(r.stderr.is_empty(), "{}", r.stderr);
    // Text format.
    let r = run(&["check"], &[("MSTAR__LOG__LEVEL", "debug")]);
    assert!(r.stderr.contains("configuration loaded"), "{}", r.stderr);
    assert!(!r.stderr.trim_start().starts_with('{'), "{}", r.stderr);
}

// === bad configs: exit 2, every problem named with key and layer ===

/// One refused configuration: a layer file written to a temp dir (`{file}` in `expect` stands
/// for its path), environment variables, and what stderr must say.
struct Bad {
    name: &'static str,
    model: &'static str,
    layer: Option<(&'static str, &'static str)>,
    env: &'static [(&'static str, &'static str)],
    expect: &'static [&'static str],
}

const fn bad(name: &'static str, layer: &'static str, expect: &'static [&'static str]) -> Bad {
    Bad {
        name,
        model: OMNI,
        layer: Some(("toml", layer)),
        env: &[],
        expect,
    }
}

const fn bad_env(
    name: &'static str,
    env: &'static [(&'static str, &'static str)],
    expect: &'static [&'static str],
) -> Bad {
    Bad {
        name,
        model: OMNI,
        layer: None,
        env,
        expect,
    }
}

const BAD: &[Bad] = &[
    bad(
        "an unknown node",
        "[chunking.max_batch_tokens]\nghost = 4096\n",
        &["{file}: `chunking.max_batch_tokens.ghost` = 4096", "node `ghost`, which the model does not have (docs/budgets.md#an-unknown-node)"],
    ),
    bad(
        "a walk this deployment does not run",
        "[chunking.max_batch_tokens]\nthinker = { spec_verify = 512 }\n",
        &["{file}: `chunking.max_batch_tokens.thinker.spec_verify` = 512", "not served by this deployment (docs/budgets.md#a-walk-not-served)"],
    ),
    bad(
        "a budget the model gives no meaning",
        "[chunking.max_batch_tokens]\nvision = { mixed = 512 }\n",
        &["{file}: `chunking.max_batch_tokens.vision.mixed` = 512", "the model does not budget `mixed` on `vision` (docs/budgets.md#a-walk-the-model-does-not-budget)"],
    ),
    Bad {
        name: "a node-wide budget on a node without budgets",
        model: "tests/fixtures/config/models/encoder.toml",
        layer: Some(("toml", "[chunking.max_batch_tokens]\nenc = 1024\n")),
        env: &[],
        expect: &["{file}: `chunking.max_batch_tokens.enc` = 1024", "budgets no walk on `enc` (docs/budgets.md#a-node-that-budgets-nothing)"],
    },
    bad(
        "a member walk's budget on a node that cannot use it",
        "[chunking.max_batch_tokens]\ntalker = { prefill = 1024 }\n",
        &["{file}: `chunking.max_batch_tokens.talker.prefill` = 1024", "set `mixed` instead (docs/budgets.md#a-member-walks-budget)"],
    ),
    bad(
        "a zero budget",
        "[chunking.max_batch_tokens]\nthinker = { mixed = 0 }\n",
        &["{file}: `chunking.max_batch_tokens.thinker.mixed` = 0", "positive whole number", "got 0 (docs/budgets.md#not-a-positive-whole-number)"],
    ),
    bad(
        "a negative node-wide budget",
        "[chunking.max_batch_tokens]\nthinker = -1\n",
        &["{file}: `chunking.max_batch_tokens.thinker` = -1", "got -1 (docs/budgets.md#not-a-positive-whole-number)"],
    ),
    bad(
        "min_chunk_tokens of 0",
        "[chunking]\nmin_chunk_tokens = 0\n",
        &["{file}: `chunking.min_chunk_tokens` = 0", "at least 1, got 0 (docs/budgets.md#not-a-positive-whole-number)"],
    ),
    bad(
        "no_chunking names a node the model does not have",
        "[chunking]\nno_chunking = [\"talker\", \"ghost\"]\n",
        &["{file}: `chunking.no_chunking` = \"ghost\"", "which the model does not have (docs/budgets.md#an-unknown-node)"],
    ),
    Bad {
        name: "a walk in two combined walks",
        model: "tests/fixtures/config/models/two_combined.toml",
        layer: None,
        env: &[],
        expect: &["model manifest tests/fixtures/config/models/two_combined.toml: walk `decode` is in two combined walks, `mixed` and `verify_mixed`"],
    },
    Bad {
        name: "manifest: policy on an unknown walk, zero align, zero budget",
        model: "tests/fixtures/config/models/bad_policies.toml",
        layer: None,
        env: &[],
        expect: &[
            "bad_policies.toml: `nodes.llm.policies.verify` is a policy on walk `verify`",
            "bad_policies.toml: `nodes.llm.policies.prefill.align` is 0",
            "bad_policies.toml: `nodes.llm.policies.decode.max_batch_tokens` is 0",
        ],
    },
    bad(
        "a budget of false",
        "[chunking.max_batch_tokens]\nthinker = { mixed = false }\n",
        &["{file}: `chunking.max_batch_tokens.thinker.mixed` = false", "invalid type: boolean `false`"],
    ),
    bad(
        "a budget of \"none\"",
        "[chunking.max_batch_tokens]\nvision = \"none\"\n",
        &["{file}: `chunking.max_batch_tokens.vision` = \"none\"", "got \"none\" (docs/budgets.md#not-a-positive-whole-number)"],
    ),
    bad(
        "a budget of 1.5",
        "[chunking.max_batch_tokens]\nthinker = { prefill = 1.5 }\n",
        &["{file}: `chunking.max_batch_tokens.thinker.prefill` = 1.5", "floating point `1.5`"],
    ),
    bad(
        "a string where a count belongs",
        "[chunking]\nmin_chunk_tokens = \"off\"\n",
        &["{file}: `chunking.min_chunk_tokens` = \"off\"", "expected u32"],
    ),
    bad(
        "a boolean where a count belongs is not coerced to 0",
        "[chunking]\nmax_partial_prefills = false\n",
        &["{file}: `chunking.max_partial_prefills` = false", "invalid type: boolean"],
    ),
    bad(
        "an unknown log format",
        "[log]\nformat = \"xml\"\n",
        &["{file}: `log.format` = \"xml\"", "expected `text` or `json`"],
    ),
    bad(
        "a number where an address belongs",
        "[metrics]\nlisten = 9464\n",
        &["{file}: `metrics.listen` = 9464", "invalid type: integer"],
    ),
    bad(
        "an unknown top-level section",
        "[chunkin]\nmin_chunk_tokens = 32\n",
        &["{file}: `chunkin`: unknown field `chunkin`"],
    ),
    bad(
        "a misspelled key",
        "[chunking]\nmin_chunk_token = 32\n",
        &["{file}: `chunking.min_chunk_token`: unknown field `min_chunk_token`"],
    ),
    bad(
        "a misspelled key two tables deep",
        "[replay.cost]\nbase = 1.0\n",
        &["{file}: `replay.cost.base`: unknown field `base`"],
    ),
    bad(
        "a replay node the model does not have",
        "[replay]\nnode = \"llm\"\n",
        &["{file}: `replay.node` = \"llm\"", "not a node of model `omni`"],
    ),
    bad(
        "a prefix cache whose blocks are not the traces' 512-token hash blocks",
        "[replay.prefix_cache]\nblocks = 64\nblock_tokens = 256\n",
        &["{file}: `replay.prefix_cache.block_tokens` = 256", "must be 512"],
    ),
    bad(
        "malformed TOML",
        "[chunking\nmin_chunk_tokens = 32\n",
        &["{file}: malformed TOML at line 1"],
    ),
    Bad {
        name: "a YAML budget of yes",
        model: OMNI,
        layer: Some(("yaml", "chunking:\n  max_batch_tokens:\n    vision: yes\n")),
        env: &[],
        expect: &["{file}: `chunking.max_batch_tokens.vision` = \"yes\"", "got \"yes\""],
    },
    bad_env(
        "env: not a number",
        &[("MSTAR__CHUNKING__MIN_CHUNK_TOKENS", "lots")],
        &["environment variable MSTAR__CHUNKING__MIN_CHUNK_TOKENS: `chunking.min_chunk_tokens` = \"lots\"", "expected u32"],
    ),
    bad_env(
        "env: a budget of false",
        &[("MSTAR__CHUNKING__MAX_BATCH_TOKENS__THINKER__MIXED", "false")],
        &["environment variable MSTAR__CHUNKING__MAX_BATCH_TOKENS__THINKER__MIXED: `chunking.max_batch_tokens.thinker.mixed` = false", "boolean"],
    ),
    bad_env(
        "env: a budget of 1.5",
        &[("MSTAR__CHUNKING__MAX_BATCH_TOKENS__THINKER", "1.5")],
        &["environment variable MSTAR__CHUNKING__MAX_BATCH_TOKENS__THINKER: `chunking.max_batch_tokens.thinker` = 1.5", "floating point"],
    ),
    bad_env(
        "env: an unknown key",
        &[("MSTAR__CHUNKING__MAX_BATCH", "4096")],
        &["environment variable MSTAR__CHUNKING__MAX_BATCH: `chunking.max_batch`: unknown field `max_batch`"],
    ),
    bad_env(
        "env: a member walk's budget on a node that cannot use it",
        &[("MSTAR__CHUNKING__MAX_BATCH_TOKENS__TALKER__PREFILL", "100")],
        &["environment variable MSTAR__CHUNKING__MAX_BATCH_TOKENS__TALKER__PREFILL: `chunking.max_batch_tokens.talker.prefill` = 100", "set `mixed` instead (docs/budgets.md#a-member-walks-budget)"],
    ),
    bad_env(
        "env: MSTAR_ENV names a missing layer",
        &[("MSTAR_ENV", "staging")],
        &["config/staging.toml: not found (MSTAR_ENV=\"staging\" names this layer)"],
    ),
    Bad {
        name: "a missing manifest",
        model: "config/models/nonexistent.toml",
        layer: None,
        env: &[],
        expect: &["model manifest config/models/nonexistent.toml: cannot be read"],
    },
];

#[test]
fn bad_configs_exit_2_naming_key_and_layer() {
    assert!(BAD.len() >= 20);
    let dir = tempfile::tempdir().unwrap();
    let mut failures = Vec::new();
    for (i, case) in BAD.iter().enumerate() {
        let mut args = vec!["check".to_string(), "--model".into(), case.model.into()];
        let mut file = String::new();
        if let Some((ext, text)) = case.layer {
            let path = dir.path().join(format!("case{i}.{ext}"));
            std::fs::write(&path, text).unwrap();
            file = path.display().to_string();
            args.extend(["--config".into(), file.clone()]);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let r = run(&args, case.env);
        if r.code != 2 {
            failures.push(format!("{}: exit {} not 2\n{r:?}", case.name, r.code));
            continue;
        }
        if !r.stdout.is_empty() {
            failures.push(format!("{}: printed a table: {}", case.name, r.stdout));
        }
        for problem in crate::doc_commands::citation_problems(&r.stderr) {
            failures.push(format!("{}: {problem}:\n{}", case.name, r.stderr));
        }
        for want in case.expect {
            let want = want.replace("{file}", &file);
            if !r.stderr.contains(&want) {
                failures.push(format!(
                    "{}: stderr lacks {want:?}:\n{}",
                    case.name, r.stderr
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[test]
fn every_problem_across_layers_is_listed_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a.toml");
    let b = dir.path().join("b.toml");
    std::fs::write(
        &a,
        "[chunking]\nmin_chunk_token = 3\n[chunking.max_batch_tokens]\nghost = 1\n",
    )
    .unwrap();
    std::fs::write(
        &b,
        "[chunking.max_batch_tokens]\nthinker = { decode = \"none\" }\n",
    )
    .unwrap();
    let (a, b) = (a.display().to_string(), b.display().to_string());
    let r = run(
        &[
            "budgets", "--json", "--model", OMNI, "--config", &a, "--config", &b,
        ],
        &[("MSTAR__LOG__LEVEL", "[[")],
    );
    assert_eq!(r.code, 2, "{r:?}");
    let problems: Vec<&str> = r.stderr.lines().skip(1).collect();
    assert_eq!(problems.len(), 4, "{}", r.stderr);
    assert!(r
        .stderr
        .starts_with("error: the configuration was refused (4 problems):"));
    for want in [
        format!("{a}: `chunking.min_chunk_token`: unknown field"),
        format!("{a}: `chunking.max_batch_tokens.ghost` = 1"),
        format!("{b}: `chunking.max_batch_tokens.thinker.decode` = \"none\""),
        "environment variable MSTAR__LOG__LEVEL: `log.level` = \"[[\"".to_string(),
    ] {
        assert!(
            problems.iter().any(|p| p.contains(&want)),
            "{want} not in {}",
            r.stderr
        );
    }
}

#[test]
fn a_missing_config_file_and_a_missing_manifest_are_both_reported() {
    let r = run(
        &["check", "--model", "nope.toml", "--config", "missing.toml"],
        &[],
    );
    assert_eq!(r.code, 2, "{r:?}");
    assert!(
        r.stderr
            .contains("model manifest nope.toml: cannot be read"),
        "{}",
        r.stderr
    );
    assert!(
        r.stderr.contains("missing.toml: cannot be read"),
        "{}",
        r.stderr
    );
}

#[test]
fn replay_is_declared_and_usage_errors_exit_2() {
    let r = run(&["replay", "--rate-scale", "0"], &[]);
    assert_eq!(r.code, 2, "{r:?}");
    assert!(r.stderr.contains("--rate-scale"), "{}", r.stderr);
    let r = run(&["check", "--bogus"], &[]);
    assert_eq!(r.code, 2, "{r:?}");
    assert!(repo_root().join("config/default.toml").is_file());
}
