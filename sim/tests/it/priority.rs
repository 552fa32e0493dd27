//! Priorities in the replay (`docs/replay.md#priorities`, `docs/kv-memory.md#priority-preemption`):
//! the trace's `priority` field and `--priority-by`, TTFT/TBT per class, and priority
//! preemption in the KV memory model under the `priority` order.

use std::path::{Path, PathBuf};

use mstar_chunking::manifest::Manifest;
use mstar_chunking_sim::config::Settings;
use mstar_chunking_sim::replay::{
    self, PriorityBy, ReplayError, ReplayOptions, ReplayReport, Trace,
};
use serde_json::Value;

use crate::helpers::model_fixture;

fn replay(settings: &str, o: &ReplayOptions) -> Result<ReplayReport, ReplayError> {
    let model: Manifest = model_fixture("mixed_override");
    let s: Settings = toml::from_str(settings).unwrap();
    actix::System::new().block_on(replay::run(&model, &s, o))
}

/// Three long low-priority requests fill the pool; a short high-priority one arrives after
/// them.
fn crowded_trace(dir: &Path) -> PathBuf {
    let path = dir.join("crowded.csv");
    std::fs::write(
        &path,
        "arrival_ms,prompt_tokens,output_tokens,priority\n\
         0,1000,100,1\n0,1000,100,1\n0,1000,100,1\n50,500,10,0\n",
    )
    .unwrap();
    path
}

const POOL: &str = "[replay.kv]\nblocks = 220\n";

fn preempted_rids(log: &Path) -> Vec<u64> {
    std::fs::read_to_string(log)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .flat_map(|l| l["kv"]["preempted"].as_array().cloned().unwrap_or_default())
        .map(|p| p["rid"].as_u64().unwrap())
        .collect()
}

#[test]
fn a_high_priority_arrival_preempts_a_low_priority_request_only_under_the_priority_order() {
    let dir = tempfile::tempdir().unwrap();
    let trace = crowded_trace(dir.path());
    let run = |order: &str| {
        let log = dir.path().join(format!("{order}.jsonl"));
        let r = replay(
            &format!("[chunking]\norder = \"{order}\"\n{POOL}"),
            &ReplayOptions {
                trace: Some(trace.clone()),
                step_log: Some(log.clone()),
                ..ReplayOptions::default()
            },
        )
        .unwrap();
        (r, preempted_rids(&log))
    };
    let (fcfs, fcfs_preempted) = run("fcfs");
    let (prio, prio_preempted) = run("priority");
    let class = |r: &ReplayReport, p: i32| {
        r.by_priority
            .iter()
            .find(|c| c.priority == p)
            .unwrap_or_else(|| panic!("no class {p}\n{r}"))
            .clone()
    };
    let (high_fcfs, high_prio) = (class(&fcfs, 0), class(&prio, 0));
    assert_eq!((high_fcfs.requests, class(&fcfs, 1).requests), (1, 3));
    // Under fcfs the short request waits for memory until a long one ends; under priority it
    // preempts the newest low-priority request and starts at once.
    assert!(fcfs_preempted.is_empty(), "{fcfs_preempted:?}\n{fcfs}");
    assert_eq!(prio_preempted, [2], "the newest of the low class\n{prio}");
    let (slow, fast) = (
        high_fcfs.ttft_ms.unwrap().p50,
        high_prio.ttft_ms.unwrap().p50,
    );
    assert!(
        fast * 10.0 < slow,
        "priority TTFT {fast} ms against fcfs {slow} ms"
    );
    // Every request completes either way, the preempted one recomputed.
    for r in [&fcfs, &prio] {
        assert_eq!(r.ttft_ms.unwrap().samples, 4, "{r}");
    }
    assert_eq!(prio.kv.as_ref().unwrap().preemptions, 1);
    assert!(prio.to_string().contains("priority 0 TTFT/TBT"), "{prio}");
}

#[test]
fn the_newest_lowest_priority_running_request_is_preempted_when_a_step_does_not_fit() {
    // Four requests of two priorities fill a pool that cannot hold all their decodes: the
    // lowest-priority ones go first, the newest of them first.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("mixed.csv");
    std::fs::write(
        &path,
        "arrival_ms,prompt_tokens,output_tokens,priority\n\
         0,600,400,0\n0,600,400,5\n0,600,400,5\n0,600,400,0\n",
    )
    .unwrap();
    let log = dir.path().join("steps.jsonl");
    replay(
        "[chunking]\norder = \"priority\"\n[replay.kv]\nblocks = 200\n",
        &ReplayOptions {
            trace: Some(path),
            step_log: Some(log.clone()),
            ..ReplayOptions::default()
        },
    )
    .unwrap();
    let preempted = preempted_rids(&log);
    assert!(!preempted.is_empty(), "no preemption");
    assert_eq!(
        preempted[0], 2,
        "the newest of priority 5 first: {preempted:?}"
    );
    assert!(
        preempted.iter().all(|&rid| rid == 1 || rid == 2),
        "only the low class is preempted: {preempted:?}"
    );
}

#[test]
fn priority_by_prompt_length_gives_two_classes_and_each_its_latency() {
    let o = ReplayOptions {
        requests: Some(300),
        priority_by: Some("prompt-length:1024".parse::<PriorityBy>().unwrap()),
        ..ReplayOptions::default()
    };
    let r = replay("[chunking]\norder = \"priority\"\n", &o).unwrap();
    assert_eq!(r.by_priority.len(), 2, "{r}");
    let total: usize = r.by_priority.iter().map(|c| c.requests).sum();
    assert_eq!(total, 300);
    let samples: usize = r
        .by_priority
        .iter()
        .map(|c| c.ttft_ms.unwrap().samples)
        .sum();
    assert_eq!(
        samples, 300,
        "every request of every class has a first token"
    );
    let json = serde_json::to_value(&r).unwrap();
    assert_eq!(json["by_priority"][0]["priority"], 0);
    // One class: no per-class figures, nothing in the report.
    let plain = replay(
        "",
        &ReplayOptions {
            requests: Some(50),
            ..ReplayOptions::default()
        },
    )
    .unwrap();
    assert!(plain.by_priority.is_empty());
    assert!(serde_json::to_value(&plain)
        .unwrap()
        .get("by_priority")
        .is_none());
}

#[test]
fn a_trace_priority_is_read_from_the_generic_csv_and_mooncake_and_a_bad_one_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let load = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        Trace::load(&path, None, None, 0, Default::default())
    };
    let csv = load(
        "t.csv",
        "arrival_ms,prompt_tokens,output_tokens,priority\n0,10,1,-3\n5,10,1,\n",
    )
    .unwrap();
    assert_eq!(
        csv.requests.iter().map(|r| r.priority).collect::<Vec<_>>(),
        [-3, 0]
    );
    let e = load(
        "bad.csv",
        "arrival_ms,prompt_tokens,output_tokens,priority\n0,10,1,high\n",
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains(":2: `priority` must be a whole number"), "{e}");
    let jsonl = load(
        "t.jsonl",
        "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [1], \"priority\": 2}\n\
         {\"timestamp\": 1, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [2]}\n",
    )
    .unwrap();
    assert_eq!(
        jsonl
            .requests
            .iter()
            .map(|r| r.priority)
            .collect::<Vec<_>>(),
        [2, 0]
    );
    let e = load(
        "bad.jsonl",
        "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [1], \"priority\": 1.5}\n",
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains(":1: `priority` must be a whole number"), "{e}");
}

#[test]
fn a_sweep_over_orders_runs_the_grid_per_order_and_adds_the_order_column_only_then() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("sweep");
    let out_s = out.to_str().unwrap();
    let args = |orders: Option<&str>, out: &str| {
        let mut a = vec![
            "sweep",
            "--requests",
            "60",
            "--budgets",
            "2048",
            "--rates",
            "1,4",
            "--no-progress",
            "--out",
            out,
        ];
        if let Some(o) = orders {
            a.extend(["--orders", o]);
        }
        a.into_iter().map(String::from).collect::<Vec<_>>()
    };
    let run = |a: Vec<String>| {
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        crate::helpers::run(&a, &[])
    };
    let r = run(args(Some("fcfs,shortest_first"), out_s));
    assert_eq!(r.code, 0, "{r:?}");
    let combined = std::fs::read_to_string(out.join("sweep.csv")).unwrap();
    let lines: Vec<&str> = combined.lines().collect();
    assert!(
        lines[0].starts_with("order,budget,rate_scale,"),
        "{}",
        lines[0]
    );
    assert_eq!(lines.len(), 1 + 2 * 2, "{combined}");
    assert!(
        lines[1].starts_with("fcfs,2048,1,") && lines[3].starts_with("shortest_first,2048,1,"),
        "{combined}"
    );
    // Each order's own run is a plain sweep: no `order` column.
    let fcfs = std::fs::read_to_string(out.join("order-fcfs").join("sweep.csv")).unwrap();
    assert!(fcfs.starts_with("budget,rate_scale,"), "{fcfs}");
    // The same rows as the combined file's, less the column.
    for (a, b) in fcfs.lines().skip(1).zip(lines[1..3].iter()) {
        assert_eq!(format!("fcfs,{a}"), *b);
    }
    let cmp = std::fs::read_to_string(out.join("orders.csv")).unwrap();
    assert_eq!(cmp.lines().count(), 3, "{cmp}");
    assert!(
        r.stdout.contains("orders: capacity and latency"),
        "{}",
        r.stdout
    );
    // Without the axis, sweep.csv has no `order` column.
    let plain = dir.path().join("plain");
    let r = run(args(None, plain.to_str().unwrap()));
    assert_eq!(r.code, 0, "{r:?}");
    let csv = std::fs::read_to_string(plain.join("sweep.csv")).unwrap();
    assert!(csv.starts_with("budget,rate_scale,"), "{csv}");
    assert_eq!(csv, fcfs, "a plain sweep is the fcfs run");
    // A bad list is usage, naming the flag.
    let r = run(args(
        Some("fcfs,lpm"),
        dir.path().join("bad").to_str().unwrap(),
    ));
    assert_eq!(r.code, 2, "{r:?}");
    assert!(
        r.stderr.contains("`--orders` unknown order \"lpm\""),
        "{}",
        r.stderr
    );
}
