//! One worker run through the fleet's loop (routing at arrivals, the worker's inbox, the shared
//! step log, the pooled report) gives the single replay's results exactly: the step log byte
//! for byte, the summary and the JSON report but for the wall time.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use super::{load_trace, run_trace, ReplayOptions, ReplayReport};
use crate::config::flags::ReplayFlags;
use crate::config::{self, FlagSetting, LoadOptions};
use mstar_chunking::ChunkingManagement;

/// Replays `opts` under the repository's config (and `flags`), through the fleet's loop or
/// the single replay's; answers the report, its summary and the step log's bytes.
fn replay(
    opts: &ReplayOptions,
    layers: &[PathBuf],
    flags: &[FlagSetting],
    fleet_loop: bool,
    step_log: &Path,
) -> (ReplayReport, String, Vec<u8>) {
    let load = LoadOptions {
        config_dir: Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/..")).join("config"),
        configs: layers.to_vec(),
        env: Some(HashMap::new()),
        ..LoadOptions::default()
    };
    let loaded = config::load_with_flags(&load, flags).expect("the repository's config loads");
    let opts = ReplayOptions {
        step_log: Some(step_log.to_path_buf()),
        ..opts.clone()
    };
    let report = actix::System::new().block_on(async {
        let m = &loaded.manifest;
        let cm = ChunkingManagement::start(&m.name, m.submodules()).unwrap();
        let trace = load_trace(&opts, 42).unwrap();
        if fleet_loop {
            super::run::run_trace_on(
                &cm,
                m,
                &loaded.settings,
                &opts,
                &trace,
                Instant::now(),
                true,
            )
            .await
        } else {
            run_trace(&cm, m, &loaded.settings, &opts, &trace, Instant::now()).await
        }
        .unwrap()
    });
    let summary = report.to_string();
    (report, summary, std::fs::read(step_log).unwrap())
}

/// The summary without its wall-time line; the JSON without wall time and steps per second.
fn without_wall_time(summary: &str, report: &ReplayReport) -> (String, serde_json::Value) {
    let lines: Vec<&str> = summary
        .lines()
        .filter(|l| !l.trim_start().starts_with("wall time"))
        .collect();
    let mut json = serde_json::to_value(report).unwrap();
    let o = json.as_object_mut().unwrap();
    o.remove("wall_ms");
    o.remove("steps_per_second");
    o.remove("step_log");
    (lines.join("\n"), json)
}

fn assert_same(opts: &ReplayOptions, layers: &[PathBuf], flags: &[FlagSetting]) -> ReplayReport {
    let dir = tempfile::tempdir().unwrap();
    let (a_log, b_log): (PathBuf, PathBuf) =
        (dir.path().join("a.jsonl"), dir.path().join("b.jsonl"));
    let (single, single_text, single_steps) = replay(opts, layers, flags, false, &a_log);
    let (fleet, fleet_text, fleet_steps) = replay(opts, layers, flags, true, &b_log);
    assert!(single.steps > 1000, "{}", single.steps);
    assert!(
        single_steps == fleet_steps,
        "the step logs differ ({} and {} bytes)",
        single_steps.len(),
        fleet_steps.len()
    );
    assert!(!String::from_utf8_lossy(&fleet_steps).contains("\"worker\""));
    let (a, a_json) = without_wall_time(&single_text, &single);
    let (b, b_json) = without_wall_time(&fleet_text, &fleet);
    assert_eq!(a.replace("a.jsonl", "LOG"), b.replace("b.jsonl", "LOG"));
    assert_eq!(a_json, b_json);
    assert!(fleet.fleet.is_none());
    single
}

#[test]
fn one_worker_in_the_fleet_loop_replays_the_bundled_trace_exactly_as_today() {
    let _ = assert_same(&ReplayOptions::default(), &[], &[]);
}

#[test]
fn one_worker_in_the_fleet_loop_is_exact_with_kv_memory_a_prefix_cache_and_noise() {
    let dir = tempfile::tempdir().unwrap();
    let layer = dir.path().join("layer.toml");
    std::fs::write(
        &layer,
        "[replay]\nprefix_cache = { blocks = 400, block_tokens = 512 }\ncost = { preset = \"llama2-7b-a100\", noise = 0.1 }\nspeculation = { tokens = 2, overshoot_rate = 0.3, seed = 7 }\n",
    )
    .unwrap();
    let trace = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
        .join("data/traces/mooncake_fast25_synthetic_trace.head2000.jsonl");
    let opts = ReplayOptions {
        trace: Some(trace),
        requests: Some(600),
        rate_scale: 0.1,
        ..ReplayOptions::default()
    };
    let r = assert_same(&opts, &[layer], &[FlagSetting::kv_blocks("12000")]);
    // Every path of the loop ran: preemptions, prefix-cache hits and evictions.
    let kv = r.kv.as_ref().expect("a KV pool");
    assert!(kv.preemptions > 0 && kv.cache_evictions > 0, "{kv:?}");
    assert!(
        r.tokens.cached > 0 && r.overruns.speculation_estimate > 0,
        "{:?}",
        r.tokens
    );
}

/// The `worker` label of every series a fleet replay records: each worker's index, on every
/// series; no series without it.
#[test]
fn every_series_of_a_fleet_carries_its_worker_label() {
    let recorder = metrics_util::debugging::DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let load = LoadOptions {
        config_dir: Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/..")).join("config"),
        env: Some(HashMap::new()),
        ..LoadOptions::default()
    };
    let loaded = config::load_with_flags(
        &load,
        &[FlagSetting::workers("3"), FlagSetting::router("least_kv")],
    )
    .unwrap();
    let opts = ReplayOptions {
        requests: Some(60),
        ..ReplayOptions::default()
    };
    let report = metrics::with_local_recorder(&recorder, || {
        actix::System::new().block_on(async {
            let m = &loaded.manifest;
            let cm = ChunkingManagement::start_worker(&m.name, "0", m.submodules()).unwrap();
            let trace = load_trace(&opts, 42).unwrap();
            run_trace(&cm, m, &loaded.settings, &opts, &trace, Instant::now())
                .await
                .unwrap()
        })
    });
    assert_eq!(report.fleet.as_ref().map(|f| f.workers), Some(3));
    let mut workers = std::collections::BTreeSet::new();
    let mut series = 0;
    for (key, _, _, _) in snapshotter.snapshot().into_vec() {
        let worker = key
            .key()
            .labels()
            .find(|l| l.key() == mstar_chunking::metrics::LABEL_WORKER)
            .map(|l| l.value().to_string());
        let name = key.key().name().to_string();
        workers.insert(worker.unwrap_or_else(|| panic!("{name} has no worker label")));
        series += 1;
    }
    assert!(series > 30, "{series}");
    assert_eq!(workers.into_iter().collect::<Vec<_>>(), ["0", "1", "2"]);
}

/// One component instance (not a fleet's worker) has no `worker` label.
#[test]
fn a_single_instance_has_no_worker_label() {
    let recorder = metrics_util::debugging::DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::with_local_recorder(&recorder, || {
        actix::System::new().block_on(async {
            let caps = mstar_chunking::SubmoduleCaps::new(["prefill"], false);
            let cm = ChunkingManagement::start("solo", [("llm", caps)]).unwrap();
            cm.set_policies([(
                ("llm", "prefill"),
                mstar_chunking::ChunkingPolicy::budget(256),
            )])
            .await
            .unwrap();
        });
    });
    let keys = snapshotter.snapshot().into_vec();
    assert!(!keys.is_empty());
    for (key, _, _, _) in keys {
        assert!(
            key.key()
                .labels()
                .all(|l| l.key() != mstar_chunking::metrics::LABEL_WORKER),
            "{key:?}"
        );
    }
}
