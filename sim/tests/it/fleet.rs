//! A fleet behind a router in the replay (`docs/fleet.md`), through the binary: `--workers 1`
//! is the replay without it, each router sends requests where its rule says on what it can see
//! at the arrival, the step log and the report name the workers, and bad settings are refused
//! as their config keys are.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::Value;

use crate::helpers::run;

fn mooncake() -> String {
    crate::helpers::repo_root()
        .join("data/traces/mooncake_fast25_synthetic_trace.head2000.jsonl")
        .display()
        .to_string()
}

/// The step log's lines, parsed.
fn steps(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Each request's worker, from the step log: the worker of the step that ran its first chunk
/// (every row of a request must be on that worker).
fn worker_of_each_request(path: &Path) -> BTreeMap<u64, u64> {
    let mut seen = BTreeMap::new();
    for s in steps(path) {
        let w = s["worker"]
            .as_u64()
            .expect("a fleet's step names its worker");
        for row in s["rows"].as_array().unwrap() {
            let rid = row["rid"].as_u64().unwrap();
            let before = *seen.entry(rid).or_insert(w);
            assert_eq!(before, w, "request {rid} ran on workers {before} and {w}");
        }
    }
    seen
}

fn replay_fleet(extra: &[&str], dir: &Path) -> (Value, BTreeMap<u64, u64>) {
    let (log, json) = (dir.join("steps.jsonl"), dir.join("report.json"));
    let mut args = vec![
        "replay",
        "--no-progress",
        "--step-log",
        log.to_str().unwrap(),
        "--report-json",
        json.to_str().unwrap(),
    ];
    args.extend(extra);
    let r = run(&args, &[]);
    assert_eq!(r.code, 0, "{r:?}");
    let report: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    (report, worker_of_each_request(&log))
}

#[test]
fn one_worker_is_the_replay_without_a_fleet() {
    let dir = tempfile::tempdir().unwrap();
    let layer = dir.path().join("fleet.toml");
    std::fs::write(
        &layer,
        "[replay.fleet]\nworkers = 1\nrouter = \"prefix_affinity\"\n",
    )
    .unwrap();
    let mut outputs = Vec::new();
    for (name, extra) in [
        ("plain", vec![]),
        ("flag", vec!["--workers", "1", "--router", "least_kv"]),
        ("file", vec!["--config", layer.to_str().unwrap()]),
    ] {
        let log = dir.path().join(format!("{name}.jsonl"));
        let mut args = vec![
            "replay",
            "--no-progress",
            "--requests",
            "1500",
            "--step-log",
            log.to_str().unwrap(),
        ];
        args.extend(&extra);
        let r = run(&args, &[]);
        assert_eq!(r.code, 0, "{r:?}");
        // Wall time, the layers read and the log's name are all that may differ.
        let summary: Vec<String> = r
            .stdout
            .lines()
            .filter(|l| !l.contains("wall time") && !l.contains("config layers"))
            .map(|l| l.replace(&format!("{name}.jsonl"), "LOG"))
            .collect();
        outputs.push((summary, std::fs::read(&log).unwrap()));
    }
    let (summary, log) = &outputs[0];
    assert!(!summary.iter().any(|l| l.contains("fleet")), "{summary:?}");
    assert!(!String::from_utf8_lossy(log).contains("\"worker\""));
    for (s, l) in &outputs[1..] {
        assert_eq!(s, summary);
        assert!(l == log, "the step logs differ");
    }
}

#[test]
fn round_robin_sends_request_i_to_worker_i_mod_n_and_the_report_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let (report, workers) = replay_fleet(
        &[
            "--requests",
            "300",
            "--workers",
            "3",
            "--router",
            "round_robin",
        ],
        dir.path(),
    );
    assert_eq!(workers.len(), 300);
    for (rid, w) in &workers {
        assert_eq!(*w, rid % 3, "request {rid}");
    }
    let fleet = &report["fleet"];
    assert_eq!(fleet["workers"], 3);
    assert_eq!(fleet["router"], "round_robin");
    assert!(fleet.get("affinity_slack").is_none());
    assert_eq!(fleet["request_imbalance"], 1.0);
    let per = fleet["per_worker"].as_array().unwrap();
    assert_eq!(per.len(), 3);
    let tokens: u64 = per.iter().map(|w| w["tokens"].as_u64().unwrap()).sum();
    assert_eq!(tokens, report["tokens"]["ran"].as_u64().unwrap());
    let ttft_samples: u64 = per
        .iter()
        .map(|w| w["ttft_ms"]["samples"].as_u64().unwrap())
        .sum();
    assert_eq!(ttft_samples, 300);
    assert_eq!(report["ttft_ms"]["samples"], 300);
    let steps: u64 = per.iter().map(|w| w["steps"].as_u64().unwrap()).sum();
    assert_eq!(steps, report["steps"].as_u64().unwrap());
    for w in per {
        assert_eq!(w["requests"], 100);
        assert!((w["request_share"].as_f64().unwrap() - 1.0 / 3.0).abs() < 1e-4);
    }
    // The fleet's p99 lies within the workers' p99s (it pools their samples).
    let p99s: Vec<f64> = per
        .iter()
        .map(|w| w["ttft_ms"]["p99"].as_f64().unwrap())
        .collect();
    let fleet_p99 = report["ttft_ms"]["p99"].as_f64().unwrap();
    let max = p99s.iter().copied().fold(f64::MIN, f64::max);
    assert!(fleet_p99 <= max, "{fleet_p99} vs {p99s:?}");
}

/// Four requests on two workers with the default step cost (8 ms + 0.02 ms a token): the
/// router sees a step in flight as not finished.
const TIMING_TRACE: &str = "arrival_ms,prompt_tokens,output_tokens\n\
0,100,1\n\
5,100,1\n\
10,100,1\n\
12,100,1\n";

#[test]
fn a_router_sees_the_workers_as_they_are_at_the_arrival() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("t.csv");
    std::fs::write(&trace, TIMING_TRACE).unwrap();
    let (_, workers) = replay_fleet(
        &[
            "--trace",
            trace.to_str().unwrap(),
            "--workers",
            "2",
            "--router",
            "least_outstanding",
        ],
        dir.path(),
    );
    // 0: both idle, worker 0. 5: worker 0's step [0, 10) still runs request 0, so worker 1.
    // 10: worker 0's step just ended (request 0 done), worker 1's [5, 15) runs: worker 0.
    // 12: one outstanding on each: the lower index.
    let got: Vec<u64> = workers.values().copied().collect();
    assert_eq!(got, [0, 1, 0, 0]);
}

/// Long and short prompts: `least_kv` weighs the tokens in flight where `least_outstanding`
/// counts requests.
const KV_TRACE: &str = "arrival_ms,prompt_tokens,output_tokens\n\
0,4000,200\n\
1,100,200\n\
2,100,200\n\
3,100,200\n";

#[test]
fn least_kv_weighs_tokens_in_flight_where_least_outstanding_counts_requests() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("t.csv");
    std::fs::write(&trace, KV_TRACE).unwrap();
    let by = |router: &str| -> Vec<u64> {
        let d = dir.path().join(router);
        std::fs::create_dir(&d).unwrap();
        let (_, w) = replay_fleet(
            &[
                "--trace",
                trace.to_str().unwrap(),
                "--workers",
                "2",
                "--router",
                router,
            ],
            &d,
        );
        w.values().copied().collect()
    };
    // Worker 0 holds 4000 tokens: every short prompt goes to worker 1 by KV ...
    assert_eq!(by("least_kv"), [0, 1, 1, 1]);
    // ... and alternates by requests (ties to the lower index).
    assert_eq!(by("least_outstanding"), [0, 1, 0, 1]);
}

#[test]
fn prefix_affinity_serves_more_prompt_tokens_from_the_cache_than_round_robin() {
    let dir = tempfile::tempdir().unwrap();
    let layer = dir.path().join("cache.toml");
    std::fs::write(
        &layer,
        "[replay]\nprefix_cache = { blocks = 2000, block_tokens = 512 }\n",
    )
    .unwrap();
    let trace = mooncake();
    let cached = |router: &str| -> (u64, Value) {
        let d = dir.path().join(router);
        std::fs::create_dir(&d).unwrap();
        let (report, _) = replay_fleet(
            &[
                "--trace",
                &trace,
                "--requests",
                "400",
                "--config",
                layer.to_str().unwrap(),
                "--workers",
                "4",
                "--router",
                router,
            ],
            &d,
        );
        (report["tokens"]["cached"].as_u64().unwrap(), report)
    };
    let (rr, _) = cached("round_robin");
    let (affinity, report) = cached("prefix_affinity");
    assert!(affinity > 2 * rr, "{affinity} vs {rr}");
    assert_eq!(report["fleet"]["affinity_slack"], 8);
    let per_worker_cached: u64 = report["fleet"]["per_worker"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["cached_tokens"].as_u64().unwrap())
        .sum();
    assert_eq!(per_worker_cached, affinity);
}

#[test]
fn the_summary_names_the_fleet_and_lists_each_worker() {
    let r = run(
        &[
            "replay",
            "--no-progress",
            "--requests",
            "200",
            "--workers",
            "2",
            "--router",
            "least_outstanding",
        ],
        &[],
    );
    assert_eq!(r.code, 0, "{r:?}");
    assert!(
        r.stdout
            .contains("fleet                    2 workers behind least_outstanding"),
        "{}",
        r.stdout
    );
    for w in ["worker 0 ", "worker 1 "] {
        assert!(r.stdout.contains(w), "{}", r.stdout);
    }
    assert!(r.stdout.contains("most requests on one worker"));
}

#[test]
fn bad_fleet_settings_are_refused_as_their_keys_naming_flag_or_file() {
    let dir = tempfile::tempdir().unwrap();
    let cases: &[(&[&str], &str, &str, &str)] = &[
        (
            &["--workers", "0"],
            "[replay.fleet]\nworkers = 0\n",
            "`replay.fleet.workers`",
            "from 1 to 256",
        ),
        (
            &["--workers", "257"],
            "[replay.fleet]\nworkers = 257\n",
            "`replay.fleet.workers`",
            "from 1 to 256",
        ),
        (
            &["--workers", "many"],
            "[replay.fleet]\nworkers = \"many\"\n",
            "`replay.fleet.workers`",
            "many",
        ),
        (
            &["--workers=-2"],
            "[replay.fleet]\nworkers = -2\n",
            "`replay.fleet.workers`",
            "-2",
        ),
        (
            &["--router", "random"],
            "[replay.fleet]\nrouter = \"random\"\n",
            "`replay.fleet.router`",
            "round_robin, least_outstanding, least_kv, prefix_affinity",
        ),
        (
            &["--router", "7"],
            "[replay.fleet]\nrouter = 7\n",
            "`replay.fleet.router`",
            "7",
        ),
        (&[], "[replay.fleet]\nwrokers = 4\n", "wrokers", "unknown"),
    ];
    for (i, (flags, toml, key, why)) in cases.iter().enumerate() {
        let layer = dir.path().join(format!("bad{i}.toml"));
        std::fs::write(&layer, toml).unwrap();
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
        assert_eq!(by_key.code, 2, "{toml}: {by_key:?}");
        assert!(by_key.stderr.contains(key), "{toml}: {}", by_key.stderr);
        assert!(by_key.stderr.contains(why), "{toml}: {}", by_key.stderr);
        assert!(
            by_key.stderr.contains(layer.to_str().unwrap()),
            "{toml}: {}",
            by_key.stderr
        );
        if flags.is_empty() {
            continue;
        }
        let mut args = vec!["replay", "--requests", "5", "--no-progress"];
        args.extend(*flags);
        let by_flag = run(&args, &[]);
        assert_eq!(by_flag.code, 2, "{flags:?}: {by_flag:?}");
        assert!(
            by_flag.stderr.contains(key),
            "{flags:?}: {}",
            by_flag.stderr
        );
        assert!(
            by_flag.stderr.contains(why),
            "{flags:?}: {}",
            by_flag.stderr
        );
        let flag = flags[0].split('=').next().unwrap();
        assert!(
            by_flag
                .stderr
                .contains(&format!("command-line flag {flag}")),
            "{flags:?}: {}",
            by_flag.stderr
        );
    }
    // `check` refuses what `replay` refuses.
    let layer = dir.path().join("bad4.toml");
    let r = run(&["check", "--config", layer.to_str().unwrap()], &[]);
    assert_eq!(r.code, 2, "{r:?}");
    assert!(r.stderr.contains("`replay.fleet.router`"), "{}", r.stderr);
    // A fleet's budgets cannot be reloaded on one worker.
    let r = run(
        &[
            "replay",
            "--no-progress",
            "--watch-config",
            "--requests",
            "5",
        ],
        &[("MSTAR__REPLAY__FLEET__WORKERS", "2")],
    );
    assert_eq!(r.code, 2, "{r:?}");
    assert!(r.stderr.contains("--watch-config"), "{}", r.stderr);
}

#[test]
fn a_fleet_sweep_finds_the_fewest_workers_from_cells_that_are_fleet_replays() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let grid = crate::helpers::FLEET_SWEEP_GRID;
    let mut args = vec!["sweep", "--out", out.to_str().unwrap()];
    args.extend(grid);
    args.extend([
        "--workers",
        "1,2,4",
        "--routers",
        "round_robin,least_outstanding",
    ]);
    let r = run(&args, &[]);
    assert_eq!(r.code, 0, "{r:?}");
    assert!(r.stdout.contains("fewest workers"), "{}", r.stdout);
    // The combined cells: each fleet's own sweep.csv under `router,workers`.
    let all = crate::helpers::csv_rows(&out.join("sweep.csv"));
    assert_eq!(all[0][..3], ["router", "workers", "budget"]);
    assert_eq!(all.len(), 1 + 2 * 3 * 2);
    for router in ["round_robin", "least_outstanding"] {
        for n in ["1", "2", "4"] {
            let own = crate::helpers::csv_rows(&out.join(format!("fleet-{router}-{n}/sweep.csv")));
            assert_eq!(
                own[0],
                all[0][2..],
                "a fleet's own sweep.csv has no fleet columns"
            );
            let mine: Vec<Vec<String>> = all
                .iter()
                .filter(|row| row[0] == router && row[1] == n)
                .map(|row| row[2..].to_vec())
                .collect();
            assert_eq!(mine, own[1..]);
        }
    }
    // A fleet's cells are the fleet replays the config would run.
    let plain = dir.path().join("plain");
    let mut args = vec!["sweep", "--out", plain.to_str().unwrap()];
    args.extend(grid);
    let r = run(
        &args,
        &[
            ("MSTAR__REPLAY__FLEET__WORKERS", "2"),
            ("MSTAR__REPLAY__FLEET__ROUTER", "least_outstanding"),
        ],
    );
    assert_eq!(r.code, 0, "{r:?}");
    assert!(
        r.stdout
            .contains("2 workers behind least_outstanding (replay.fleet)"),
        "{}",
        r.stdout
    );
    let by_config = std::fs::read_to_string(plain.join("sweep.csv")).unwrap();
    let by_axis = std::fs::read_to_string(out.join("fleet-least_outstanding-2/sweep.csv")).unwrap();
    assert_eq!(by_config, by_axis);
    assert!(
        by_config.starts_with("budget,"),
        "no fleet columns without the axes"
    );
    // The fewest workers: the smallest fleet whose cell met the objective.
    let fewest = crate::helpers::csv_rows(&out.join("fleet.csv"));
    assert_eq!(
        fewest[0],
        [
            "router",
            "budget",
            "rate_scale",
            "fewest_workers",
            "ttft_p90_ms",
            "tbt_p99_ms"
        ]
    );
    assert_eq!(fewest.len(), 1 + 2 * 2);
    let meets = all[0].iter().position(|h| h == "meets_slo").unwrap();
    for row in &fewest[1..] {
        let met: Vec<&str> = all
            .iter()
            .filter(|c| c[0] == row[0] && c[2] == row[1] && c[3] == row[2] && c[meets] == "true")
            .map(|c| c[1].as_str())
            .collect();
        assert_eq!(row[3], met.first().copied().unwrap_or(""), "{row:?}");
    }
    assert!(
        fewest[1..].iter().any(|r| r[3] != "1"),
        "some rate needs more than one worker: {fewest:?}"
    );
    let json: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("fleet.json")).unwrap()).unwrap();
    assert_eq!(json["workers"], serde_json::json!([1, 2, 4]));
    assert_eq!(json["capacity"].as_array().unwrap().len(), 2 * 3);
}

#[test]
fn bad_fleet_axes_are_refused_before_anything_runs() {
    let dir = tempfile::tempdir().unwrap();
    for (flags, says) in [
        (&["--workers", "0"][..], "`--workers`"),
        (&["--workers", "4,2"], "after 4"),
        (&["--workers", "1,x"], "\"x\""),
        (&["--routers", "random"], "`--routers` unknown router"),
        (&["--routers", "least_kv,least_kv"], "twice"),
        (&["--workers", "2", "--orders", "fcfs"], "--orders"),
        (
            &["--routers", "least_kv", "--kv-blocks", "500"],
            "--kv-blocks",
        ),
    ] {
        let out = dir.path().join("refused");
        let mut args = vec!["sweep", "--no-progress", "--out", out.to_str().unwrap()];
        args.extend(flags);
        let r = run(&args, &[]);
        assert_eq!(r.code, 2, "{flags:?}: {r:?}");
        assert!(r.stderr.contains(says), "{flags:?}: {}", r.stderr);
        assert!(!out.exists(), "{flags:?} created {out:?}");
    }
}

/// Without a prefix cache nothing is ever held, and `prefix_affinity` routes exactly as
/// `least_outstanding` does.
#[test]
fn without_a_prefix_cache_prefix_affinity_is_least_outstanding() {
    let dir = tempfile::tempdir().unwrap();
    let trace = mooncake();
    let logs: Vec<Vec<u8>> = ["least_outstanding", "prefix_affinity"]
        .iter()
        .map(|router| {
            let log = dir.path().join(format!("{router}.jsonl"));
            let r = run(
                &[
                    "replay",
                    "--no-progress",
                    "--trace",
                    &trace,
                    "--requests",
                    "300",
                    "--workers",
                    "3",
                    "--router",
                    router,
                    "--step-log",
                    log.to_str().unwrap(),
                ],
                &[],
            );
            assert_eq!(r.code, 0, "{r:?}");
            std::fs::read(&log).unwrap()
        })
        .collect();
    assert!(logs[0] == logs[1], "the step logs differ");
}
