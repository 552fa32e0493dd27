//! The capacity-planning commands through the binary: `sweep` (its capacity against replays
//! run one by one), labelled replays and `--budget`, generic and length-only traces with
//! seeded arrivals, quiet batch runs, `fit`, and hostile flags.

use std::path::Path;

use serde_json::Value;

use crate::helpers::{run, Run};

fn json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{} unreadable: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{} is not JSON: {e}", path.display()))
}

fn ok(r: &Run) {
    assert_eq!(r.code, 0, "{r:?}");
}

/// `replay --report-json` of the bundled trace's first `requests` with `extra` flags.
fn replay_json(dir: &Path, name: &str, extra: &[&str]) -> Value {
    let out = dir.join(name);
    let out_s = out.to_str().unwrap();
    let mut args = vec!["replay", "--no-progress", "--report-json", out_s];
    args.extend_from_slice(extra);
    ok(&run(&args, &[]));
    json(&out)
}

#[test]
fn sweep_capacity_matches_replays_run_one_by_one() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("sweep");
    let r = run(
        &[
            "sweep",
            "--requests",
            "300",
            "--budgets",
            "1024,off",
            "--rates",
            "1,2",
            "--slo-tbt-p99",
            "60",
            "--slo-ttft-p90",
            "1000",
            "--jobs",
            "2",
            "--no-progress",
            "--out",
            out.to_str().unwrap(),
        ],
        &[],
    );
    ok(&r);
    // Every output, and nothing else.
    let mut written: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    written.sort();
    assert_eq!(
        written,
        [
            "capacity.png",
            "capacity.svg",
            "report.html",
            "step_times.png",
            "step_times.svg",
            "sweep.csv",
            "sweep.json",
            "tradeoff.png",
            "tradeoff.svg"
        ],
        "{r:?}"
    );
    let s = json(&out.join("sweep.json"));
    let cap = &s["capacity"][0];
    assert_eq!(cap["budget"], 1024);
    assert_eq!(cap["bound"], "found", "{cap}");
    let (lo, hi) = (
        cap["rate_scale"].as_f64().unwrap(),
        cap["misses_at"].as_f64().unwrap(),
    );
    assert!(lo < hi && hi <= lo * 1.02 + 1e-9, "{lo} .. {hi}");
    // The table prints the same figure.
    assert!(
        r.stdout.contains(&format!("{lo}x")),
        "{lo} not in\n{}",
        r.stdout
    );

    let meets = |v: &Value| {
        v["tbt_ms"]["p99"].as_f64().unwrap() <= 60.0
            && v["ttft_ms"]["p90"].as_f64().unwrap() <= 1000.0
    };
    let single = |rate: f64, name: &str| {
        let rate = rate.to_string();
        replay_json(
            dir.path(),
            name,
            &[
                "--requests",
                "300",
                "--budget",
                "1024",
                "--rate-scale",
                &rate,
            ],
        )
    };
    let at_lo = single(lo, "lo.json");
    let at_hi = single(hi, "hi.json");
    assert!(
        meets(&at_lo),
        "capacity {lo} does not meet the SLO alone: {at_lo}"
    );
    assert!(!meets(&at_hi), "{hi} meets the SLO alone: {at_hi}");

    // A grid cell is the replay at its budget and rate, figure for figure.
    let cell = s["cells"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["budget"] == 1024 && c["rate_scale"] == 2.0)
        .unwrap();
    let two = single(2.0, "two.json");
    assert_eq!(cell["ttft_p90_ms"], two["ttft_ms"]["p90"]);
    assert_eq!(cell["tbt_p99_ms"], two["tbt_ms"]["p99"]);
    assert_eq!(cell["steps"], two["steps"]);
    assert_eq!(cell["meets_slo"], Value::Bool(meets(&two)));
    // The sweep's settings say what every replay ran under.
    assert_eq!(s["settings"]["seed"], "42");
    assert!(s["settings"]["trace"]
        .as_str()
        .unwrap()
        .starts_with("bundled:"));
    assert_eq!(two["settings"]["budget_flag"], "1024");
}

#[test]
fn a_replay_is_labelled_with_its_settings_and_rounded() {
    let dir = tempfile::tempdir().unwrap();
    let v = replay_json(
        dir.path(),
        "r.json",
        &["--requests", "50", "--budget", "512"],
    );
    let s = &v["settings"];
    assert_eq!(s["version"], env!("CARGO_PKG_VERSION"));
    assert_eq!(s["node"], "llm");
    assert_eq!(s["step_walks"], serde_json::json!(["mixed"]));
    assert_eq!(s["format"], "azure");
    assert_eq!(s["requests"], 50);
    assert_eq!(s["seed"], 42);
    assert_eq!(
        s["cost"],
        serde_json::json!({
            "preset": null, "base_ms": 8.0, "per_token_ms": 0.02, "per_kv_token_ms": 0.0,
            "per_attention_pair_ms": 0.0, "noise": 0.0, "learn": false
        })
    );
    assert_eq!(s["prefix_cache_blocks"], 0);
    let budgets = s["budgets"].as_array().unwrap();
    let mixed = budgets.iter().find(|b| b["walk"] == "mixed").unwrap();
    assert_eq!(mixed["max_batch_tokens"], 512);
    assert_eq!(mixed["policy_budget"], 2048);
    assert_eq!(mixed["max_step_ms"], Value::Null);
    // `--budget` replaces the step walk's budget only.
    let prefill = budgets.iter().find(|b| b["walk"] == "prefill").unwrap();
    assert_eq!(prefill["max_batch_tokens"], 2048);
    // Every float is rounded to 0.001.
    for x in [
        &v["ttft_ms"]["p50"],
        &v["ttft_ms"]["p90"],
        &v["tbt_ms"]["p99"],
        &v["step_ms"]["p50"],
        &v["step_ms"]["p99"],
        &v["simulated_ms"],
        &v["wall_ms"],
    ] {
        let f = x.as_f64().unwrap();
        assert!(
            format!("{f}").split('.').nth(1).map_or(0, str::len) <= 3,
            "{f}"
        );
    }
    // Step times: 8 ms + 0.02 ms a token, at most 512 tokens under the budget.
    let max = v["step_ms"]["max"].as_f64().unwrap();
    assert!(max <= 8.0 + 0.02 * 512.0 + 1e-9, "{max}");
    assert_eq!(v["step_ms"]["samples"], v["steps"]);
    // The summary carries the same labels, in English.
    let r = run(&["replay", "--requests", "1", "--budget", "off"], &[]);
    ok(&r);
    for needle in [
        "mstar-chunking ",
        "mixed off (policy 2048) [--budget off]",
        "cost model               8 ms + 0.02 ms per token",
        "speculation              off",
        "1 sample)",
        "TTFT p50/p90/p99",
    ] {
        assert!(
            r.stdout.contains(needle),
            "{needle:?} missing:\n{}",
            r.stdout
        );
    }
    assert!(!r.stdout.contains(" 1 samples"), "{}", r.stdout);
}

#[test]
fn length_only_traces_replay_with_seeded_arrivals() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("lengths.csv");
    let mut text = String::from("num_prefill_tokens,num_decode_tokens\n");
    for i in 0..200u32 {
        text.push_str(&format!("{},{}\n", 100 + (i * 37) % 3000, 1 + i % 7));
    }
    std::fs::write(&trace, text).unwrap();
    let t = trace.to_str().unwrap();
    let a = replay_json(
        dir.path(),
        "a.json",
        &["--trace", t, "--arrivals", "poisson:4"],
    );
    let b = replay_json(
        dir.path(),
        "b.json",
        &["--trace", t, "--arrivals", "poisson:4"],
    );
    assert_eq!(a["settings"]["format"], "lengths");
    assert_eq!(a["settings"]["arrivals"], "poisson:4");
    assert_eq!(a["requests"], 200);
    // The same seed gives the same replay, figure for figure (wall time aside).
    for key in [
        "steps",
        "tokens",
        "ttft_ms",
        "tbt_ms",
        "step_ms",
        "simulated_ms",
        "chunks",
    ] {
        assert_eq!(a[key], b[key], "{key}");
    }
    // Another seed gives other arrivals.
    let seed = dir.path().join("seed.toml");
    std::fs::write(&seed, "[replay]\nspeculation = { seed = 7 }\n").unwrap();
    let c = replay_json(
        dir.path(),
        "c.json",
        &[
            "--trace",
            t,
            "--arrivals",
            "poisson:4",
            "--config",
            seed.to_str().unwrap(),
        ],
    );
    assert_eq!(c["settings"]["seed"], 7);
    assert_ne!(a["simulated_ms"], c["simulated_ms"]);
    // Gamma arrivals, and `--format` naming the format of a file with no header to tell it.
    let bare = dir.path().join("bare.txt");
    std::fs::write(&bare, "num_prefill_tokens,num_decode_tokens\n64,2\n").unwrap();
    let g = replay_json(
        dir.path(),
        "g.json",
        &[
            "--trace",
            bare.to_str().unwrap(),
            "--format",
            "lengths",
            "--arrivals",
            "gamma:2:3",
        ],
    );
    assert_eq!(g["requests"], 1);
    // Without arrivals a length-only trace is refused, and arrivals for a timed trace too.
    let r = run(&["replay", "--trace", t], &[]);
    assert_eq!(r.code, 2, "{r:?}");
    assert!(r.stderr.contains("--arrivals poisson:QPS"), "{}", r.stderr);
    let r = run(&["replay", "--arrivals", "poisson:4"], &[]);
    assert_eq!(r.code, 2, "{r:?}");
    assert!(r.stderr.contains("bundled trace"), "{}", r.stderr);
}

#[test]
fn generic_csv_traces_replay_and_the_cache_warns_without_hashes() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("mine.csv");
    std::fs::write(
        &trace,
        "arrival_ms,prompt_tokens,output_tokens,hash_ids\n0,600,3,1 2\n5.5,600,2,1 2\n10,100,1,\n",
    )
    .unwrap();
    let cache = dir.path().join("cache.toml");
    std::fs::write(&cache, "[replay]\nprefix_cache = { blocks = 16 }\n").unwrap();
    let (t, c) = (trace.to_str().unwrap(), cache.to_str().unwrap());
    let v = replay_json(dir.path(), "g.json", &["--trace", t, "--config", c]);
    assert_eq!(v["settings"]["format"], "generic");
    assert_eq!(v["requests"], 3);
    assert_eq!(v["chunks"]["prefix_cache_hits"], 1, "{v}");
    assert_eq!(v["tokens"]["generated"], 6);
    assert_eq!(v["warnings"], serde_json::json!([]));
    // The bundled trace has no block hashes: the cache would never hit.
    let r = run(&["replay", "--requests", "5", "--config", c], &[]);
    ok(&r);
    assert!(
        r.stderr.contains("warning: the prefix cache is on")
            && r.stderr.contains("no block hashes"),
        "{}",
        r.stderr
    );
    // Forcing the Azure reader onto a generic file names the first bad value.
    let r = run(&["replay", "--trace", t, "--format", "azure"], &[]);
    assert_eq!(r.code, 1, "{r:?}");
    assert!(r.stderr.contains("mine.csv"), "{}", r.stderr);
}

#[test]
fn batch_replays_serve_no_metrics_unless_asked() {
    let r = run(&["replay", "--requests", "3"], &[]);
    ok(&r);
    assert!(!r.stderr.contains("serving metrics"), "{}", r.stderr);
    // No colour on a pipe.
    assert!(!r.stderr.contains('\u{1b}'), "{:?}", r.stderr);
    let dir = tempfile::tempdir().unwrap();
    let layer = dir.path().join("metrics.toml");
    std::fs::write(&layer, "[metrics]\nlisten = \"127.0.0.1:0\"\n").unwrap();
    let r = run(
        &[
            "replay",
            "--requests",
            "3",
            "--config",
            layer.to_str().unwrap(),
        ],
        &[],
    );
    ok(&r);
    assert!(r.stderr.contains("serving metrics"), "{}", r.stderr);
    let r = run(
        &[
            "replay",
            "--requests",
            "3",
            "--metrics-listen",
            "127.0.0.1:0",
        ],
        &[],
    );
    ok(&r);
    assert!(r.stderr.contains("serving metrics"), "{}", r.stderr);
    let r = run(&["check"], &[]);
    ok(&r);
    assert!(r.stdout.contains("ok: 1 node, 3 walks"), "{}", r.stdout);
}

#[test]
fn fit_prints_the_model_and_refuses_bad_files() {
    let dir = tempfile::tempdir().unwrap();
    let csv = dir.path().join("steps.csv");
    // ms = 5 + 0.05 T + 0.001 K + 2e-6 A exactly.
    let mut text = String::from("tokens,kv_tokens,attention_pairs,ms\n");
    for i in 0..60u64 {
        let (t, k, a) = (
            64 + i * 29 % 2000,
            (i * 977) % 40000,
            (i * i * 1301) % 900_000,
        );
        let ms = 5.0 + 0.05 * t as f64 + 0.001 * k as f64 + 2e-6 * a as f64;
        text.push_str(&format!("{t},{k},{a},{ms}\n"));
    }
    std::fs::write(&csv, text).unwrap();
    let r = run(&["fit", csv.to_str().unwrap()], &[]);
    ok(&r);
    for needle in [
        "(a CSV of step features): 60 steps",
        "R²                       1.0000",
        "[chunking.cost.llm]",
        "|error| ms",
        "base_ms = 5",
        "per_token_ms = 0.05",
    ] {
        assert!(
            r.stdout.contains(needle),
            "{needle:?} missing:\n{}",
            r.stdout
        );
    }
    // `--node` names a node of the model (`--model`): omni's `talker`.
    let r = run(
        &[
            "fit",
            csv.to_str().unwrap(),
            "--node",
            "talker",
            "--model",
            "config/models/omni.toml",
        ],
        &[],
    );
    ok(&r);
    assert!(r.stdout.contains("[chunking.cost.talker]"), "{}", r.stdout);
    let bad = dir.path().join("bad.csv");
    std::fs::write(&bad, "tokens,kv_tokens,attention_pairs,ms\n1,2,3,NaN\n").unwrap();
    for path in [
        bad.clone(),
        dir.path().join("missing.csv"),
        dir.path().to_path_buf(),
    ] {
        let r = run(&["fit", path.to_str().unwrap()], &[]);
        assert_eq!(r.code, 2, "{r:?}");
        assert!(r.stderr.starts_with("error: cannot fit"), "{}", r.stderr);
        assert!(r.stdout.is_empty());
    }
}

#[test]
fn fit_for_a_replay_writes_a_replay_cost_table_with_the_measured_spread() {
    let dir = tempfile::tempdir().unwrap();
    let csv = dir.path().join("steps.csv");
    // ms = (5 + 0.05 T) times 0.8, 1.0 or 1.6 in turn.
    let mut text = String::from("tokens,kv_tokens,attention_pairs,ms\n");
    for i in 0..90u64 {
        let t = 64 + i * 29 % 2000;
        let factor = [0.8, 1.0, 1.6][(i % 3) as usize];
        text.push_str(&format!("{t},0,0,{}\n", (5.0 + 0.05 * t as f64) * factor));
    }
    std::fs::write(&csv, text).unwrap();
    let r = run(
        &[
            "fit",
            csv.to_str().unwrap(),
            "--for",
            "replay",
            "--errors",
            "relative",
        ],
        &[],
    );
    ok(&r);
    assert!(r.stdout.contains("measured ÷ predicted"), "{}", r.stdout);
    let table = &r.stdout[r.stdout.find("# fitted by").expect("the table")..];
    let doc: toml::Table = toml::from_str(table).unwrap();
    let cost = doc["replay"]["cost"].as_table().unwrap();
    // Steps of every price alike: one band.
    let bands = cost["noise_bands"].as_array().unwrap();
    assert_eq!(bands.len(), 1, "{bands:?}");
    let ratios: Vec<f64> = bands[0]["ratios"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_float().unwrap())
        .collect();
    assert_eq!(ratios.len(), 1001);
    // A third of the steps at each factor, around the fitted line (which the three factors
    // bend a little, hence the tolerance).
    let (low, mid, high) = (ratios[100], ratios[500], ratios[900]);
    assert!((mid / low - 1.25).abs() < 0.05, "{ratios:?}");
    assert!((high / mid - 1.6).abs() < 0.05, "{ratios:?}");
    assert!(ratios[333] < 0.9 && ratios[334] > 0.9 && ratios[666] < 1.5 && ratios[667] > 1.5);
    // The table is a config layer a replay takes as it is.
    let layer = dir.path().join("replay-cost.toml");
    std::fs::write(&layer, table).unwrap();
    let r = run(
        &[
            "replay",
            "--no-progress",
            "--requests",
            "30",
            "--config",
            layer.to_str().unwrap(),
        ],
        &[],
    );
    ok(&r);
    assert!(
        r.stdout.contains("noise drawn from measured ratios"),
        "{}",
        r.stdout
    );
    let r = run(&["fit", csv.to_str().unwrap(), "--for", "serving"], &[]);
    assert_eq!(r.code, 2, "{r:?}");
    assert!(r.stderr.contains("--for"), "{}", r.stderr);
}

#[test]
fn fit_for_a_replay_on_identical_steps_gives_one_table_the_replay_takes_whatever_the_count() {
    let dir = tempfile::tempdir().unwrap();
    let mut tables = Vec::new();
    for n in [300, 400] {
        let csv = dir.path().join(format!("same-{n}.csv"));
        let text =
            String::from("tokens,kv_tokens,attention_pairs,ms\n") + &"16,0,136,2.0\n".repeat(n);
        std::fs::write(&csv, text).unwrap();
        let r = run(&["fit", csv.to_str().unwrap(), "--for", "replay"], &[]);
        ok(&r);
        // The steps cannot tell the terms apart: said, and the constant carries the time.
        assert!(r.stderr.contains("underdetermined"), "{}", r.stderr);
        let table = &r.stdout[r.stdout.find("[replay.cost]").expect("the table")..];
        assert!(table.contains("base_ms = 2.0\n"), "{n}: {table}");
        assert!(table.contains("per_token_ms = 0.0\n"), "{n}: {table}");
        assert!(
            table.contains("per_attention_pair_ms = 0.0\n"),
            "{n}: {table}"
        );
        let layer = dir.path().join(format!("cost-{n}.toml"));
        std::fs::write(&layer, table).unwrap();
        let r = run(
            &[
                "replay",
                "--no-progress",
                "--requests",
                "5",
                "--config",
                layer.to_str().unwrap(),
            ],
            &[],
        );
        ok(&r);
        // Every step of the replay takes the 2 ms the steps took.
        assert!(r.stdout.contains("2 ms + 0 ms per token"), "{}", r.stdout);
        tables.push(table.to_owned());
    }
    assert_eq!(tables[0], tables[1]);
    // Steps whose times their contexts alone explain fit a model with neither `base_ms` nor
    // `per_token_ms`: no replay takes that, so `--for replay` refuses it, saying why.
    let csv = dir.path().join("kv-only.csv");
    let mut text = String::from("tokens,kv_tokens,attention_pairs,ms\n");
    for i in 1..60u64 {
        let k = 1000 * i + 37 * (i % 5);
        text.push_str(&format!("{},{k},0,{}\n", i % 7 + 1, 0.001 * k as f64));
    }
    std::fs::write(&csv, text).unwrap();
    let r = run(&["fit", csv.to_str().unwrap(), "--for", "replay"], &[]);
    assert_eq!(r.code, 2, "{r:?}");
    assert!(r.stdout.is_empty(), "{}", r.stdout);
    assert!(
        r.stderr.contains("`base_ms` and `per_token_ms` both at 0"),
        "{}",
        r.stderr
    );
    assert!(r.stderr.contains("kv-only.csv"), "{}", r.stderr);
    // The serving table takes such a model.
    ok(&run(&["fit", csv.to_str().unwrap()], &[]));
}

#[test]
fn hostile_sweep_and_replay_flags_are_refused_with_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("a-file");
    std::fs::write(&file, "x").unwrap();
    let f = file.to_str().unwrap();
    let trace_in_out = dir.path().join("sweep.csv");
    std::fs::write(
        &trace_in_out,
        "arrival_ms,prompt_tokens,output_tokens\n0,10,1\n",
    )
    .unwrap();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["sweep", "--rates", "nan"], "--rates"),
        (vec!["sweep", "--rates", "1,1"], "twice"),
        (vec!["sweep", "--budgets", "0"], "--budgets"),
        (vec!["sweep", "--budgets", ""], "--budgets"),
        (vec!["sweep", "--slo-tbt-p99", "inf"], "--slo-tbt-p99"),
        (vec!["sweep", "--slo-ttft-p90=-5"], "--slo-ttft-p90"),
        (vec!["sweep", "--jobs", "0"], "--jobs"),
        (vec!["sweep", "--jobs", "100000"], "--jobs"),
        (vec!["sweep", "--out", f], "not a directory"),
        (
            vec!["sweep", "--out", "/proc/self/no-such-dir/out"],
            "cannot create the output directory",
        ),
        (
            vec![
                "sweep",
                "--trace",
                trace_in_out.to_str().unwrap(),
                "--out",
                dir.path().to_str().unwrap(),
            ],
            "is also an input",
        ),
        (
            vec!["sweep", "--rates", "1", "--step-time-rate", "2"],
            "step-time rate",
        ),
        (vec!["replay", "--budget", "1e3"], "--budget"),
        (vec!["replay", "--budget=-1"], "--budget"),
        (vec!["replay", "--format", "parquet"], "--format"),
        (vec!["replay", "--arrivals", "poisson:inf"], "--arrivals"),
        (vec!["replay", "--arrivals", "gamma:1:1e9"], "--arrivals"),
        (vec!["replay", "--arrivals", "uniform:3"], "--arrivals"),
        (vec!["replay", "--format", "lengths"], "bundled trace"),
        (
            vec!["replay", "--trace", f, "--format", "lengths"],
            "--arrivals",
        ),
        (
            vec!["replay", "--budget", "256", "--watch-config"],
            "--watch-config",
        ),
    ];
    for (args, needle) in cases {
        let r = run(&args, &[]);
        assert_eq!(r.code, 2, "{args:?}: {r:?}");
        assert!(
            r.stderr.contains(needle),
            "{args:?}: {needle:?} not in {}",
            r.stderr
        );
    }
    #[cfg(unix)]
    {
        let fifo = dir.path().join("fifo");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        if made.is_ok_and(|s| s.success()) {
            let p = fifo.to_str().unwrap();
            // A trace that cannot be read fails the run (1), as `--trace` always has; the
            // new flags' own inputs are usage errors (2). Nothing waits on the FIFO.
            for (args, code) in [
                (vec!["replay", "--trace", p], 1),
                (vec!["replay", "--trace", p, "--format", "generic"], 1),
                (
                    vec!["sweep", "--trace", p, "--rates", "1", "--budgets", "512"],
                    1,
                ),
                (vec!["fit", p], 2),
                (vec!["sweep", "--out", p], 2),
            ] {
                let r = run(&args, &[]);
                assert_eq!(r.code, code, "{args:?}: {r:?}");
                assert!(r.stderr.contains("fifo"), "{args:?}: {}", r.stderr);
                assert!(
                    r.stderr.contains("not a regular file") || r.stderr.contains("not a directory"),
                    "{args:?}: {}",
                    r.stderr
                );
            }
        }
    }
}
