//! Every file a sweep writes, pinned by digest on the bundled traces: the plain grid with and
//! without an objective, each axis (`--kv-blocks`, `--orders`, `--workers` with `--routers`)
//! and the Mooncake trace. A change to the runner, the tabulation, the capacity search or the
//! plots that moves one byte of `sweep.csv`, `sweep.json`, a comparison, a plot or
//! `report.html` fails here; the message lists the digests the run gave, in this file's form.

use std::collections::BTreeMap;
use std::path::Path;

use sha2::{Digest, Sha256};

use crate::helpers::run;

/// Every file under `dir`, by its path relative to `dir` (`/`-separated), with the first 16 hex
/// digits of its SHA-256.
fn digests(dir: &Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let p = entry.unwrap().path();
            if p.is_dir() {
                todo.push(p);
                continue;
            }
            let rel = p
                .strip_prefix(dir)
                .unwrap()
                .to_string_lossy()
                .replace('\\', "/");
            let hex: String = Sha256::digest(std::fs::read(&p).unwrap())
                .iter()
                .take(8)
                .map(|b| format!("{b:02x}"))
                .collect();
            out.insert(rel, hex);
        }
    }
    out
}

/// Runs `sweep` with `flags` on a small grid into a fresh directory and compares every file's
/// digest with `pinned`: `None` when they agree, else the digests the run gave.
fn differs(name: &str, flags: &[&str], pinned: &[(&str, &str)]) -> Option<String> {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let mut args = vec!["sweep", "--no-progress", "--jobs", "2", "--out"];
    args.push(out.to_str().unwrap());
    args.extend_from_slice(flags);
    let r = run(&args, &[]);
    assert_eq!(r.code, 0, "{name}: {r:?}");
    let got = digests(&out);
    let want: BTreeMap<String, String> = pinned
        .iter()
        .map(|(p, d)| ((*p).to_owned(), (*d).to_owned()))
        .collect();
    (got != want).then(|| {
        let listed: String = got
            .iter()
            .map(|(p, d)| format!("    (\"{p}\", \"{d}\"),\n"))
            .collect();
        format!("{name}: the outputs' digests changed; this run gave\n{listed}")
    })
}

/// Files and their digests, as pinned below.
type Pinned = &'static [(&'static str, &'static str)];

/// Fails naming every case (name, flags, pinned digests) whose digests changed.
fn check(cases: &[(&str, Vec<&str>, Pinned)]) {
    let changed: Vec<String> = cases
        .iter()
        .filter_map(|(name, flags, pinned)| differs(name, flags, pinned))
        .collect();
    assert!(changed.is_empty(), "{}", changed.join("\n"));
}

const GRID: [&str; 6] = ["--requests", "80", "--budgets", "512,off", "--rates", "1,2"];
const SLO: [&str; 4] = ["--slo-tbt-p99", "60", "--slo-ttft-p90", "1500"];

fn with<'a>(extra: &[&'a str], slo: bool) -> Vec<&'a str> {
    let mut v: Vec<&str> = GRID.to_vec();
    if slo {
        v.extend_from_slice(&SLO);
    }
    v.extend_from_slice(extra);
    v
}

#[test]
fn the_plain_grid_writes_the_same_bytes() {
    // Relative to the crate's root, where the binary runs: the trace's name is in the outputs.
    let m = "data/traces/mooncake_fast25_synthetic_trace.head2000.jsonl";
    check(&[
        ("plain, objective", with(&[], true), PLAIN_SLO),
        ("plain, no objective", with(&[], false), PLAIN),
        ("mooncake", with(&["--trace", m], true), MOONCAKE),
    ]);
}

#[test]
fn the_kv_axis_writes_the_same_bytes() {
    check(&[("kv", with(&["--kv-blocks", "600,unlimited"], true), KV)]);
}

#[test]
fn the_order_axis_writes_the_same_bytes() {
    check(&[(
        "orders",
        with(&["--orders", "fcfs,shortest_first"], true),
        ORDERS,
    )]);
}

#[test]
fn the_fleet_axes_write_the_same_bytes() {
    check(&[
        (
            "fleet",
            with(
                &["--workers", "1,2", "--routers", "round_robin,least_kv"],
                true,
            ),
            FLEET_SLO,
        ),
        (
            "fleet, no objective",
            with(&["--workers", "1,3"], false),
            FLEET,
        ),
    ]);
}

const PLAIN_SLO: &[(&str, &str)] = &[
    ("capacity.png", "57005f61032a98f5"),
    ("capacity.svg", "0fbfcfde34f6b35c"),
    ("report.html", "5b7ea4985a04ac67"),
    ("step_times.png", "c205ef723aa58e10"),
    ("step_times.svg", "53102e00f51041c4"),
    ("sweep.csv", "897dcf4cfd5a4551"),
    ("sweep.json", "ecd840e6df027a22"),
    ("tradeoff.png", "7f9e7213a99b9250"),
    ("tradeoff.svg", "b0e762fcdc3f0325"),
];
const PLAIN: &[(&str, &str)] = &[
    ("report.html", "d4ec40e6a1a000a2"),
    ("step_times.png", "c205ef723aa58e10"),
    ("step_times.svg", "53102e00f51041c4"),
    ("sweep.csv", "6e03bd52519acb8f"),
    ("sweep.json", "28817850785a5b4f"),
    ("tradeoff.png", "ce05c6b2ca3be174"),
    ("tradeoff.svg", "a3d361f8fc7368a4"),
];
const MOONCAKE: &[(&str, &str)] = &[
    ("capacity.png", "00a20f06a19fdc70"),
    ("capacity.svg", "8c0018447f56ae03"),
    ("report.html", "46233d01a6ef8803"),
    ("step_times.png", "c48fd3fabca06dc0"),
    ("step_times.svg", "a6f94f7c260a7500"),
    ("sweep.csv", "48a71be2e80da7e6"),
    ("sweep.json", "59093ec8779fe40f"),
    ("tradeoff.png", "d4120f1ec126f8b2"),
    ("tradeoff.svg", "ba2e16c014a05eeb"),
];
const KV: &[(&str, &str)] = &[
    ("kv-600/capacity.png", "7c1dca1a365b8e61"),
    ("kv-600/capacity.svg", "e1ae063f9efef12f"),
    ("kv-600/report.html", "cc01f0cdfd338673"),
    ("kv-600/step_times.png", "2192e6ba3f0e2a07"),
    ("kv-600/step_times.svg", "5557e01f82fc3abd"),
    ("kv-600/sweep.csv", "a5ae4202b925f965"),
    ("kv-600/sweep.json", "0652551e578fd711"),
    ("kv-600/tradeoff.png", "3525e143dc4c5838"),
    ("kv-600/tradeoff.svg", "2917422c39a84487"),
    ("kv-unlimited/capacity.png", "57005f61032a98f5"),
    ("kv-unlimited/capacity.svg", "0fbfcfde34f6b35c"),
    ("kv-unlimited/report.html", "5e6a17431a9f4b0c"),
    ("kv-unlimited/step_times.png", "c205ef723aa58e10"),
    ("kv-unlimited/step_times.svg", "53102e00f51041c4"),
    ("kv-unlimited/sweep.csv", "897dcf4cfd5a4551"),
    ("kv-unlimited/sweep.json", "645876950f65344d"),
    ("kv-unlimited/tradeoff.png", "7f9e7213a99b9250"),
    ("kv-unlimited/tradeoff.svg", "b0e762fcdc3f0325"),
    ("kv.csv", "ceab4cb9555b75e0"),
    ("kv.json", "462e60d0ffb12db5"),
    ("kv.png", "258674e2783c1ff1"),
    ("kv.svg", "36435f88dd07cf31"),
];
const ORDERS: &[(&str, &str)] = &[
    ("order-fcfs/capacity.png", "57005f61032a98f5"),
    ("order-fcfs/capacity.svg", "0fbfcfde34f6b35c"),
    ("order-fcfs/report.html", "a0a83c4ebe0fca66"),
    ("order-fcfs/step_times.png", "c205ef723aa58e10"),
    ("order-fcfs/step_times.svg", "53102e00f51041c4"),
    ("order-fcfs/sweep.csv", "897dcf4cfd5a4551"),
    ("order-fcfs/sweep.json", "303f09dc73e4d435"),
    ("order-fcfs/tradeoff.png", "7f9e7213a99b9250"),
    ("order-fcfs/tradeoff.svg", "b0e762fcdc3f0325"),
    ("order-shortest_first/capacity.png", "0f190a1d810c5b59"),
    ("order-shortest_first/capacity.svg", "7c8b83ce67819f19"),
    ("order-shortest_first/report.html", "d0f986e9398e1b3a"),
    ("order-shortest_first/step_times.png", "a2af4ab201452d25"),
    ("order-shortest_first/step_times.svg", "68e41d953340d7ec"),
    ("order-shortest_first/sweep.csv", "aacd1d73a03d7b11"),
    ("order-shortest_first/sweep.json", "1e6c791708ac116e"),
    ("order-shortest_first/tradeoff.png", "94bd4e4699253ef3"),
    ("order-shortest_first/tradeoff.svg", "408e76e996e7c428"),
    ("orders.csv", "2683a4798d253d15"),
    ("orders.json", "63cd54e4b1f8f2fc"),
    ("sweep.csv", "7910f620ceea200c"),
];
const FLEET_SLO: &[(&str, &str)] = &[
    ("fleet-least_kv-1/capacity.png", "57005f61032a98f5"),
    ("fleet-least_kv-1/capacity.svg", "0fbfcfde34f6b35c"),
    ("fleet-least_kv-1/report.html", "7af29d13b79b7a0d"),
    ("fleet-least_kv-1/step_times.png", "c205ef723aa58e10"),
    ("fleet-least_kv-1/step_times.svg", "53102e00f51041c4"),
    ("fleet-least_kv-1/sweep.csv", "897dcf4cfd5a4551"),
    ("fleet-least_kv-1/sweep.json", "cfc3613fa4903861"),
    ("fleet-least_kv-1/tradeoff.png", "7f9e7213a99b9250"),
    ("fleet-least_kv-1/tradeoff.svg", "b0e762fcdc3f0325"),
    ("fleet-least_kv-2/capacity.png", "e92fe8a5cdc88288"),
    ("fleet-least_kv-2/capacity.svg", "82f6ecb29b583bf9"),
    ("fleet-least_kv-2/report.html", "a9bce968dbbd1fb0"),
    ("fleet-least_kv-2/step_times.png", "dc537827ef293271"),
    ("fleet-least_kv-2/step_times.svg", "16657d90e4f0b2c6"),
    ("fleet-least_kv-2/sweep.csv", "61912fffdd4dbea7"),
    ("fleet-least_kv-2/sweep.json", "d2f8f762c001a18f"),
    ("fleet-least_kv-2/tradeoff.png", "d78cbade1e6dbf3c"),
    ("fleet-least_kv-2/tradeoff.svg", "af2702406bfe2856"),
    ("fleet-round_robin-1/capacity.png", "57005f61032a98f5"),
    ("fleet-round_robin-1/capacity.svg", "0fbfcfde34f6b35c"),
    ("fleet-round_robin-1/report.html", "1fb070d549c67c41"),
    ("fleet-round_robin-1/step_times.png", "c205ef723aa58e10"),
    ("fleet-round_robin-1/step_times.svg", "53102e00f51041c4"),
    ("fleet-round_robin-1/sweep.csv", "897dcf4cfd5a4551"),
    ("fleet-round_robin-1/sweep.json", "82795715f7760333"),
    ("fleet-round_robin-1/tradeoff.png", "7f9e7213a99b9250"),
    ("fleet-round_robin-1/tradeoff.svg", "b0e762fcdc3f0325"),
    ("fleet-round_robin-2/capacity.png", "5db40993b639852e"),
    ("fleet-round_robin-2/capacity.svg", "9b30e36479bf2f7f"),
    ("fleet-round_robin-2/report.html", "9a1f781cc6e62938"),
    ("fleet-round_robin-2/step_times.png", "b70f556b4c608e8e"),
    ("fleet-round_robin-2/step_times.svg", "eb6af057ff225b9a"),
    ("fleet-round_robin-2/sweep.csv", "8fc35a792d3c5bfd"),
    ("fleet-round_robin-2/sweep.json", "fc98e711d9ea94e4"),
    ("fleet-round_robin-2/tradeoff.png", "08569e88cb762e6a"),
    ("fleet-round_robin-2/tradeoff.svg", "e32c32038a724edb"),
    ("fleet.csv", "d3d14dd97bd6e329"),
    ("fleet.json", "ef793f09d7b2e5b6"),
    ("fleet.png", "736a622560654d8d"),
    ("fleet.svg", "24b0f41b7effb9a9"),
    ("sweep.csv", "b53e96f58b43b954"),
];
const FLEET: &[(&str, &str)] = &[
    ("fleet-round_robin-1/report.html", "59bdcace9fd0670f"),
    ("fleet-round_robin-1/step_times.png", "c205ef723aa58e10"),
    ("fleet-round_robin-1/step_times.svg", "53102e00f51041c4"),
    ("fleet-round_robin-1/sweep.csv", "6e03bd52519acb8f"),
    ("fleet-round_robin-1/sweep.json", "f0358a33d5996ae2"),
    ("fleet-round_robin-1/tradeoff.png", "ce05c6b2ca3be174"),
    ("fleet-round_robin-1/tradeoff.svg", "a3d361f8fc7368a4"),
    ("fleet-round_robin-3/report.html", "0ead032ae0ad97a9"),
    ("fleet-round_robin-3/step_times.png", "8cd565604117ecc6"),
    ("fleet-round_robin-3/step_times.svg", "a35bdb7e41237187"),
    ("fleet-round_robin-3/sweep.csv", "b771fb979ec32b0f"),
    ("fleet-round_robin-3/sweep.json", "bbd5c121a9657f48"),
    ("fleet-round_robin-3/tradeoff.png", "42233754dd236e56"),
    ("fleet-round_robin-3/tradeoff.svg", "b045b3a6e342d76c"),
    ("fleet.csv", "53ef69b6b705f666"),
    ("fleet.json", "2c0c36451342084f"),
    ("sweep.csv", "62e5ea548fcfcd98"),
];
