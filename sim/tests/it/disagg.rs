//! Disaggregated prefill in the replay (`docs/disaggregated.md`), through the
//! binary: a case worked out by hand to the microsecond, conservation of requests and KV
//! across the pools, the pools' settings refused as their keys, and each worker's step log
//! passing the step-log checker.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::helpers::{check_step_log, run, shared};

/// The step log's lines, parsed.
fn steps(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Replays with `extra`, writing the step log and the JSON report into `dir`; answers the
/// report and the step log's lines.
fn replay_pd(extra: &[&str], dir: &Path) -> (Value, Vec<Value>) {
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
    let report = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    (report, steps(&log))
}

/// The step log's lines in order of their start (a line is written when its step completes,
/// which for a worker's last step is at the end of the replay).
fn by_start(mut log: Vec<Value>) -> Vec<Value> {
    log.sort_by(|a, b| {
        a["t_ms"]
            .as_f64()
            .unwrap()
            .total_cmp(&b["t_ms"].as_f64().unwrap())
    });
    log
}

fn close(got: &Value, want: f64) {
    let g = got
        .as_f64()
        .unwrap_or_else(|| panic!("not a number: {got}"));
    assert!((g - want).abs() < 1e-3, "got {g}, want {want}");
}

/// One 1,000-token prompt generating 3 tokens, and two prompts of 1,000 tokens arriving
/// together; each replayed on one prefill and one decode worker behind a 100 Gbit/s link with
/// 2 ms of latency, at the built-in step cost (8 ms + 0.02 ms a token) and Llama-2-7B's
/// 524,288 bytes of KV a token.
#[test]
fn one_prompt_on_one_decode_worker_takes_the_times_worked_out_by_hand() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("one.csv");
    std::fs::write(&trace, "arrival_ms,prompt_tokens,output_tokens\n0,1000,3\n").unwrap();
    let link = [
        "--prefill-workers",
        "1",
        "--decode-workers",
        "1",
        "--kv-link-gbps",
        "100",
        "--kv-link-latency-ms",
        "2",
    ];
    let mut args = vec!["--trace", trace.to_str().unwrap()];
    args.extend(link);
    let (report, log) = replay_pd(&args, dir.path());
    let log = by_start(log);
    // The prompt runs whole on the prefill worker in [0, 28): 8 + 0.02 × 1000. Its first
    // token is out at 28 ms: the TTFT.
    assert_eq!(log.len(), 3, "{log:?}");
    let (pre, d1, d2) = (&log[0], &log[1], &log[2]);
    assert_eq!(
        (pre["worker"].as_u64(), pre["pool"].as_str()),
        (Some(0), Some("prefill"))
    );
    close(&pre["t_ms"], 0.0);
    close(&pre["ms"], 28.0);
    assert_eq!(pre["rows"][0]["kind"], "chunk");
    assert_eq!(pre["rows"][0]["final"], true);
    close(&report["ttft_ms"]["max"], 28.0);
    // 1,000 tokens × 524,288 B × 8 bits at 100 Gbit/s: 41.943 04 ms, plus 2 ms: the KV is on
    // the decode worker at 71.943 04 ms, where the next two tokens take a step of 8.02 ms each.
    for (s, t) in [(d1, 71.943_04), (d2, 79.963_04)] {
        assert_eq!(
            (s["worker"].as_u64(), s["pool"].as_str()),
            (Some(1), Some("decode"))
        );
        close(&s["t_ms"], t);
        close(&s["ms"], 8.02);
        assert_eq!(s["rows"][0]["kind"], "continue");
    }
    // The decode row reads the prompt and the first token.
    assert_eq!(d1["rows"][0]["context"], 1001);
    let pd = &report["fleet"]["disaggregated"];
    assert_eq!(pd["transfers"], 1);
    close(&pd["transfer_ms"]["max"], 43.943_04);
    close(&pd["transfer_bytes"], 524_288_000.0);
    assert_eq!(pd["kv_bytes_per_token"], 524_288.0);
    // Its times between tokens: 79.963 04 − 28 (the transfer in it), then 8.02.
    close(&report["tbt_ms"]["samples"], 2.0);
    close(&report["simulated_ms"], 87.983_04);
    assert_eq!(report["tokens"]["generated"], 3);
    let per = report["fleet"]["per_worker"].as_array().unwrap();
    assert_eq!(per[0]["pool"], "prefill");
    assert_eq!(per[1]["pool"], "decode");
    assert_eq!(
        (per[0]["requests"].as_u64(), per[1]["requests"].as_u64()),
        (Some(1), Some(1))
    );

    // Two prompts finishing in one step share the prefill worker's link, one after the other:
    // the step runs 2,000 tokens in [0, 48); the first transfer ends at 48 + 41.943 + 2, the
    // second a wire time later.
    let two = dir.path().join("two.csv");
    std::fs::write(
        &two,
        "arrival_ms,prompt_tokens,output_tokens\n0,1000,2\n0,1000,2\n",
    )
    .unwrap();
    let mut args = vec!["--trace", two.to_str().unwrap()];
    args.extend(link);
    let (report, log) = replay_pd(&args, dir.path());
    let log = by_start(log);
    assert_eq!(log[0]["pool"], "prefill");
    close(&log[0]["ms"], 48.0);
    let pd = &report["fleet"]["disaggregated"];
    close(&pd["transfer_ms"]["p50"], 43.943_04);
    close(&pd["transfer_ms"]["max"], 85.886_08);
    let decode_starts: Vec<f64> = log[1..]
        .iter()
        .map(|s| s["t_ms"].as_f64().unwrap())
        .collect();
    // The first request's KV arrives at 91.943: it decodes in [91.943, 99.963); the second's at
    // 133.886.
    assert_eq!(decode_starts.len(), 2, "{log:?}");
    assert!(
        (decode_starts[0] - 91.943_04).abs() < 1e-3,
        "{decode_starts:?}"
    );
    assert!(
        (decode_starts[1] - 133.886_08).abs() < 1e-3,
        "{decode_starts:?}"
    );
}

/// Splits a fleet's step log into one file per worker (in `dir`), each checked on its own.
fn per_worker_logs(log: &[Value], dir: &Path) -> BTreeMap<u64, PathBuf> {
    let mut text: BTreeMap<u64, String> = BTreeMap::new();
    for s in log {
        let w = s["worker"]
            .as_u64()
            .expect("a fleet's step names its worker");
        let t = text.entry(w).or_default();
        t.push_str(&s.to_string());
        t.push('\n');
    }
    text.into_iter()
        .map(|(w, t)| {
            let p = dir.join(format!("worker-{w}.jsonl"));
            std::fs::write(&p, t).unwrap();
            (w, p)
        })
        .collect()
}

#[test]
fn every_request_is_prefilled_once_decoded_on_one_worker_and_its_kv_freed_on_both_sides() {
    let dir = tempfile::tempdir().unwrap();
    let n = 400usize;
    let (report, log) = replay_pd(
        &[
            "--requests",
            "400",
            "--rate-scale",
            "4",
            "--prefill-workers",
            "2",
            "--decode-workers",
            "2",
            "--router",
            "least_kv",
            "--kv-blocks",
            "900",
        ],
        dir.path(),
    );
    let pd = &report["fleet"]["disaggregated"];
    let trace_rid = |rid: u64| rid & ((1 << 32) - 1);
    // Which workers ran each request's final chunk of its first admission, and its decode rows.
    let mut prefilled: BTreeMap<u64, Vec<u64>> = BTreeMap::new();
    let mut decoded_on: BTreeMap<u64, BTreeSet<u64>> = BTreeMap::new();
    let mut preempted_on_decode = 0;
    for s in &log {
        let (w, pool) = (s["worker"].as_u64().unwrap(), s["pool"].as_str().unwrap());
        assert_eq!(pool, if w < 2 { "prefill" } else { "decode" }, "{s}");
        if pool == "decode" {
            preempted_on_decode += s["kv"]["preempted"].as_array().unwrap().len();
        }
        for row in s["rows"].as_array().unwrap() {
            let rid = row["rid"].as_u64().unwrap();
            match (row["kind"].as_str().unwrap(), pool) {
                ("chunk", "prefill") => {
                    if row["final"] == true {
                        prefilled.entry(trace_rid(rid)).or_default().push(w);
                    }
                }
                ("continue", "decode") => {
                    decoded_on.entry(trace_rid(rid)).or_default().insert(w);
                }
                // A decode worker prefills only a request it preempted, under a readmission rid.
                ("chunk", "decode") => assert!(rid >> 32 > 0, "{row}"),
                (kind, pool) => panic!("a {kind} row on a {pool} worker: {s}"),
            }
        }
    }
    // Every request's prompt finished on the prefill pool once (a prompt preempted there
    // restarts its prefill under a new rid, on the same worker).
    assert_eq!(prefilled.len(), n);
    for (rid, ws) in &prefilled {
        assert_eq!(ws.len(), 1, "request {rid} finished its prompt on {ws:?}");
    }
    // Every request decoded on exactly one decode worker (the bundled trace's requests all
    // generate more than one token), and its KV moved there once.
    assert_eq!(decoded_on.len(), n);
    for (rid, ws) in &decoded_on {
        assert_eq!(ws.len(), 1, "request {rid} decoded on {ws:?}");
    }
    assert_eq!(pd["transfers"], n);
    let per = report["fleet"]["per_worker"].as_array().unwrap();
    let requests = |range: std::ops::Range<usize>| -> u64 {
        per[range]
            .iter()
            .map(|w| w["requests"].as_u64().unwrap())
            .sum()
    };
    assert_eq!((requests(0..2), requests(2..4)), (n as u64, n as u64));
    // The pools were short of memory (the test is about something), and every block came back.
    assert!(
        report["kv"]["preemptions"].as_u64().unwrap() > 0,
        "{}",
        report["kv"]
    );
    assert!(
        preempted_on_decode > 0 || report["kv"]["memory_wait_total_ms"].as_f64().unwrap() > 0.0
    );
    assert_eq!(pd["kv_blocks_left"], 0);
    // Every generated token was counted once: the first on the prefill pool, the others on
    // the decode pool.
    let generated: u64 = report["tokens"]["generated"].as_u64().unwrap();
    let ttft = report["ttft_ms"]["samples"].as_u64().unwrap();
    assert_eq!(ttft, n as u64);
    assert_eq!(
        generated,
        ttft + report["tbt_ms"]["samples"].as_u64().unwrap(),
        "{}",
        report["tokens"]
    );
}

#[test]
fn empty_pools_and_a_fleet_sized_twice_are_refused_naming_the_flag_or_key() {
    let dir = tempfile::tempdir().unwrap();
    let cases: &[(&[&str], &str, &str)] = &[
        (
            &["--prefill-workers", "0", "--decode-workers", "2"],
            "`replay.fleet.prefill_workers`",
            "command-line flag --prefill-workers",
        ),
        (
            &["--prefill-workers", "2", "--decode-workers", "0"],
            "`replay.fleet.decode_workers`",
            "command-line flag --decode-workers",
        ),
        (
            &["--prefill-workers", "2"],
            "`replay.fleet.decode_workers`",
            "is needed with `prefill_workers`",
        ),
        (
            &[
                "--workers",
                "4",
                "--prefill-workers",
                "1",
                "--decode-workers",
                "3",
            ],
            "`replay.fleet.workers`",
            "command-line flag --workers",
        ),
        (
            &[
                "--prefill-workers",
                "1",
                "--decode-workers",
                "1",
                "--kv-link-gbps",
                "0",
            ],
            "`replay.fleet.kv_link_gbps`",
            "command-line flag --kv-link-gbps",
        ),
        (
            &["--kv-link-latency-ms=-1"],
            "`replay.fleet.kv_link_latency_ms`",
            "command-line flag --kv-link-latency-ms",
        ),
    ];
    for (flags, key, why) in cases {
        let mut args = vec!["replay", "--requests", "5", "--no-progress"];
        args.extend(*flags);
        let r = run(&args, &[]);
        assert_eq!(r.code, 2, "{flags:?}: {r:?}");
        assert!(r.stderr.contains(key), "{flags:?}: {}", r.stderr);
        assert!(r.stderr.contains(why), "{flags:?}: {}", r.stderr);
    }
    // The keys in a file are refused as the flags are, naming the file.
    let layer = dir.path().join("pd.toml");
    std::fs::write(
        &layer,
        "[replay.fleet]\nprefill_workers = 1\ndecode_workers = 0\n",
    )
    .unwrap();
    let r = run(
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
    assert_eq!(r.code, 2, "{r:?}");
    assert!(
        r.stderr.contains("`replay.fleet.decode_workers`"),
        "{}",
        r.stderr
    );
    assert!(r.stderr.contains(layer.to_str().unwrap()), "{}", r.stderr);
    // A reload would reach one worker of the fleet.
    let r = run(
        &[
            "replay",
            "--no-progress",
            "--watch-config",
            "--requests",
            "5",
        ],
        &[
            ("MSTAR__REPLAY__FLEET__PREFILL_WORKERS", "1"),
            ("MSTAR__REPLAY__FLEET__DECODE_WORKERS", "1"),
        ],
    );
    assert_eq!(r.code, 2, "{r:?}");
    assert!(r.stderr.contains("--watch-config"), "{}", r.stderr);
    assert!(
        r.stderr.contains("replay.fleet.prefill_workers"),
        "{}",
        r.stderr
    );
    // `check` refuses what `replay` refuses.
    let r = run(&["check", "--config", layer.to_str().unwrap()], &[]);
    assert_eq!(r.code, 2, "{r:?}");
    assert!(
        r.stderr.contains("`replay.fleet.decode_workers`"),
        "{}",
        r.stderr
    );
}

#[test]
fn each_workers_step_log_passes_the_checker() {
    let dir = tempfile::tempdir().unwrap();
    let mooncake = shared("traces/mooncake_fast25_synthetic_trace.head2000.jsonl");
    for (name, extra) in [
        (
            "azure",
            vec![
                "--requests",
                "300",
                "--prefill-workers",
                "2",
                "--decode-workers",
                "3",
            ],
        ),
        (
            "mooncake",
            vec![
                "--trace",
                mooncake.to_str().unwrap(),
                "--requests",
                "150",
                "--rate-scale",
                "0.25",
                "--prefill-workers",
                "3",
                "--decode-workers",
                "1",
                "--router",
                "prefix_affinity",
                "--config",
                "config/examples/mooncake-fleet.toml",
            ],
        ),
    ] {
        let sub = dir.path().join(name);
        std::fs::create_dir(&sub).unwrap();
        let (report, log) = replay_pd(&extra, &sub);
        let logs = per_worker_logs(&log, &sub);
        let workers = report["fleet"]["workers"].as_u64().unwrap();
        assert_eq!(logs.len() as u64, workers, "{name}: every worker ran steps");
        for (w, path) in &logs {
            let last = check_step_log(path, 0);
            // Each prefill worker finished the prefills it started; decode workers ran none.
            let finished: u64 = last
                .split(", ")
                .find_map(|p| p.strip_suffix(" finished")?.parse().ok())
                .unwrap();
            let routed = report["fleet"]["per_worker"][*w as usize]["requests"]
                .as_u64()
                .unwrap();
            if *w
                < report["fleet"]["disaggregated"]["prefill_workers"]
                    .as_u64()
                    .unwrap()
            {
                assert_eq!(finished, routed, "{name} worker {w}: {last}");
            } else {
                assert_eq!(finished, 0, "{name} worker {w}: {last}");
            }
        }
        if name == "mooncake" {
            // The prefill pool's caches served prompt tokens.
            assert!(
                report["tokens"]["cached"].as_u64().unwrap() > 0,
                "{}",
                report["tokens"]
            );
        }
    }
}

#[test]
fn a_pd_sweep_finds_each_layouts_fewest_workers_from_cells_that_are_disaggregated_replays() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let grid = crate::helpers::FLEET_SWEEP_GRID;
    // A fast link, so that a split can meet the objective at all (each prompt's KV is about a
    // GB at Llama-2-7B's 512 KiB a token).
    let env = [("MSTAR__REPLAY__FLEET__KV_LINK_GBPS", "20000")];
    let mut args = vec!["sweep", "--out", out.to_str().unwrap()];
    args.extend(grid);
    args.extend(["--workers", "2,3,4", "--pd", "1:1,1:3"]);
    let r = run(&args, &env);
    assert_eq!(r.code, 0, "{r:?}");
    assert!(
        r.stdout.contains("colocated or split prefill:decode"),
        "{}",
        r.stdout
    );
    // The combined cells: each run's own sweep.csv under the layout's columns.
    let all = crate::helpers::csv_rows(&out.join("sweep.csv"));
    assert_eq!(
        all[0][..5],
        [
            "layout",
            "workers",
            "prefill_workers",
            "decode_workers",
            "budget"
        ]
    );
    assert_eq!(all.len(), 1 + 3 * 3 * 2);
    for (layout, dir_layout) in [("colocated", "colocated"), ("1:1", "1x1"), ("1:3", "1x3")] {
        for n in ["2", "3", "4"] {
            let own = crate::helpers::csv_rows(&out.join(format!("pd-{dir_layout}-{n}/sweep.csv")));
            let mine: Vec<Vec<String>> = all
                .iter()
                .filter(|row| row[0] == layout && row[1] == n)
                .map(|row| row[4..].to_vec())
                .collect();
            assert_eq!(mine, own[1..], "{layout} {n}");
        }
    }
    // 1:3 of 3 workers is 1 prefill + 2 decode (0.75 rounds to 1); 1:1 of 3 is 2 + 1 (halves up).
    let pools = |layout: &str| -> Vec<String> {
        all.iter()
            .find(|r| r[0] == layout && r[1] == "3")
            .map(|r| r[2..4].join("+"))
            .into_iter()
            .collect()
    };
    assert_eq!(pools("1:3"), ["1+2"]);
    assert_eq!(pools("1:1"), ["2+1"]);
    // A split's cells are the disaggregated replays the config would run.
    let plain = dir.path().join("plain");
    let mut args = vec!["sweep", "--out", plain.to_str().unwrap()];
    args.extend(grid);
    let r = run(
        &args,
        &[
            env[0],
            ("MSTAR__REPLAY__FLEET__PREFILL_WORKERS", "1"),
            ("MSTAR__REPLAY__FLEET__DECODE_WORKERS", "3"),
        ],
    );
    assert_eq!(r.code, 0, "{r:?}");
    assert!(
        r.stdout
            .contains("1 prefill + 3 decode workers behind round_robin (replay.fleet)"),
        "{}",
        r.stdout
    );
    let by_config = std::fs::read_to_string(plain.join("sweep.csv")).unwrap();
    let by_axis = std::fs::read_to_string(out.join("pd-1x3-4/sweep.csv")).unwrap();
    assert_eq!(by_config, by_axis);
    // The fewest workers of each layout: the smallest fleet whose cell met the objective.
    let fewest = crate::helpers::csv_rows(&out.join("fleet.csv"));
    assert_eq!(
        fewest[0],
        [
            "layout",
            "budget",
            "rate_scale",
            "fewest_workers",
            "prefill_workers",
            "decode_workers",
            "ttft_p90_ms",
            "tbt_p99_ms"
        ]
    );
    assert_eq!(fewest.len(), 1 + 3 * 2);
    let meets = all[0].iter().position(|h| h == "meets_slo").unwrap();
    for row in &fewest[1..] {
        let met: Vec<&Vec<String>> = all
            .iter()
            .filter(|c| c[0] == row[0] && c[4] == row[1] && c[5] == row[2] && c[meets] == "true")
            .collect();
        let first = met.first();
        assert_eq!(row[3], first.map_or("", |c| c[1].as_str()), "{row:?}");
        assert_eq!(
            row[4..6],
            first.map_or(["", ""].map(String::from).to_vec(), |c| c[2..4].to_vec()),
            "{row:?}"
        );
    }
    assert!(
        fewest[1..]
            .iter()
            .any(|r| r[0] != "colocated" && !r[3].is_empty()),
        "some split meets the objective: {fewest:?}"
    );
    let json: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("fleet.json")).unwrap()).unwrap();
    assert_eq!(
        json["layouts"],
        serde_json::json!(["colocated", "1:1", "1:3"])
    );
    assert_eq!(json["workers"], serde_json::json!([2, 3, 4]));
    assert_eq!(json["capacity"].as_array().unwrap().len(), 3 * 3);
    assert!(out.join("fleet.svg").is_file() && out.join("fleet.png").is_file());
}

#[test]
fn bad_pd_axes_are_refused_before_anything_runs() {
    let dir = tempfile::tempdir().unwrap();
    for (flags, says) in [
        (vec!["--pd", "1:0", "--workers", "2"], "--pd"),
        (vec!["--pd", "1:1,1:1", "--workers", "2"], "--pd"),
        (vec!["--pd", "1:1", "--workers", "1,2"], "--workers"),
        (vec!["--pd", "1:1"], "--workers"),
        (
            vec!["--pd", "1:1", "--workers", "2", "--routers", "least_kv"],
            "--routers",
        ),
    ] {
        let out = dir.path().join("out");
        let mut args = vec![
            "sweep",
            "--no-progress",
            "--requests",
            "5",
            "--out",
            out.to_str().unwrap(),
        ];
        args.extend(&flags);
        let r = run(&args, &[]);
        assert_eq!(r.code, 2, "{flags:?}: {r:?}");
        assert!(r.stderr.contains(says), "{flags:?}: {}", r.stderr);
        assert!(!out.exists(), "{flags:?}: nothing runs");
    }
}

/// A link too slow for the simulated clock is refused before anything runs, never replayed
/// into latencies of 0: below the 1 Mbit/s floor as the flag or the key in its file, and at the
/// floor when some prompt's transfer would end past the clock's limit.
#[test]
fn a_link_too_slow_for_the_clock_is_refused_naming_the_flag_or_the_key_and_file() {
    let dir = tempfile::tempdir().unwrap();
    let pd = ["--prefill-workers", "1", "--decode-workers", "1"];
    for gbps in ["1e-300", "1e-320", "0.0009"] {
        let mut args = vec!["replay", "--requests", "5", "--no-progress"];
        args.extend(pd);
        args.extend(["--kv-link-gbps", gbps]);
        let r = run(&args, &[]);
        assert_eq!(r.code, 2, "{gbps}: {r:?}");
        assert!(
            r.stderr.contains("`replay.fleet.kv_link_gbps`"),
            "{}",
            r.stderr
        );
        assert!(
            r.stderr.contains("command-line flag --kv-link-gbps"),
            "{}",
            r.stderr
        );
        assert!(r.stderr.contains("from 1e-3 (1 Mbit/s)"), "{}", r.stderr);
        assert!(r.stdout.is_empty(), "{}", r.stdout);
    }
    for gbps in ["1e-320", "1e-300"] {
        let layer = dir.path().join("slow.toml");
        std::fs::write(
            &layer,
            format!(
                "[replay.fleet]\nprefill_workers = 1\ndecode_workers = 1\nkv_link_gbps = {gbps}\n"
            ),
        )
        .unwrap();
        for cmd in ["replay", "check"] {
            let mut args = vec![cmd, "--config", layer.to_str().unwrap()];
            if cmd == "replay" {
                args.extend(["--requests", "5", "--no-progress"]);
            }
            let r = run(&args, &[]);
            assert_eq!(r.code, 2, "{cmd} {gbps}: {r:?}");
            assert!(
                r.stderr.contains("`replay.fleet.kv_link_gbps`"),
                "{}",
                r.stderr
            );
            assert!(r.stderr.contains(layer.to_str().unwrap()), "{}", r.stderr);
        }
    }
    // At the floor, 1.2 million tokens of 1 GB each take 9.6e12 ms on the wire: past the
    // clock's 9.007e12 ms, so refused naming the request before the replay runs.
    let trace = dir.path().join("huge.csv");
    std::fs::write(
        &trace,
        "arrival_ms,prompt_tokens,output_tokens\n0,100,1\n0,1200000,1\n",
    )
    .unwrap();
    let layer = dir.path().join("huge.toml");
    std::fs::write(
        &layer,
        "[replay.kv]\ngpu_memory_gb = 1e6\nweights_gb = 0\nkv_bytes_per_token = 1e9\nmemory_utilization = 1.0\n",
    )
    .unwrap();
    let mut args = vec![
        "replay",
        "--no-progress",
        "--trace",
        trace.to_str().unwrap(),
        "--config",
        layer.to_str().unwrap(),
        "--kv-link-gbps",
        "1e-3",
    ];
    args.extend(pd);
    let r = run(&args, &[]);
    assert_eq!(r.code, 2, "{r:?}");
    assert!(
        r.stderr
            .contains("`replay.fleet.kv_link_gbps` = 0.001 Gbit/s"),
        "{}",
        r.stderr
    );
    assert!(r.stderr.contains("request rid 1"), "{}", r.stderr);
    assert!(r.stderr.contains("9.600e12 simulated ms"), "{}", r.stderr);
    assert!(r.stdout.is_empty(), "{}", r.stdout);
}
