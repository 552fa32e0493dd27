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
    ("report.html", "709d82cf340e8821"),
    ("step_times.png", "c205ef723aa58e10"),
    ("step_times.svg", "53102e00f51041c4"),
    ("sweep.csv", "377fbc229165b970"),
    ("sweep.json", "b8486028d7cb0166"),
    ("tradeoff.png", "7f9e7213a99b9250"),
    ("tradeoff.svg", "b0e762fcdc3f0325"),
];
const PLAIN: &[(&str, &str)] = &[
    ("report.html", "f5d4f292451339aa"),
    ("step_times.png", "c205ef723aa58e10"),
    ("step_times.svg", "53102e00f51041c4"),
    ("sweep.csv", "9ccb0cc7edf6d2ba"),
    ("sweep.json", "37680cd7209478e7"),
    ("tradeoff.png", "ce05c6b2ca3be174"),
    ("tradeoff.svg", "a3d361f8fc7368a4"),
];
const MOONCAKE: &[(&str, &str)] = &[
    ("capacity.png", "3ad71e35ee31fc0a"),
    ("capacity.svg", "3de1c949da0b83e5"),
    ("report.html", "70295d391a676054"),
    ("step_times.png", "c48fd3fabca06dc0"),
    ("step_times.svg", "a6f94f7c260a7500"),
    ("sweep.csv", "26433991e19d42c2"),
    ("sweep.json", "b1e0f834110e53a0"),
    ("tradeoff.png", "d4120f1ec126f8b2"),
    ("tradeoff.svg", "ba2e16c014a05eeb"),
];
const KV: &[(&str, &str)] = &[
    ("kv-600/capacity.png", "7c1dca1a365b8e61"),
    ("kv-600/capacity.svg", "e1ae063f9efef12f"),
    ("kv-600/report.html", "498d2a5d51eab3cb"),
    ("kv-600/step_times.png", "2192e6ba3f0e2a07"),
    ("kv-600/step_times.svg", "5557e01f82fc3abd"),
    ("kv-600/sweep.csv", "0a80cb538ac58d68"),
    ("kv-600/sweep.json", "402c80a8e6d8e0b9"),
    ("kv-600/tradeoff.png", "3525e143dc4c5838"),
    ("kv-600/tradeoff.svg", "2917422c39a84487"),
    ("kv-unlimited/capacity.png", "57005f61032a98f5"),
    ("kv-unlimited/capacity.svg", "0fbfcfde34f6b35c"),
    ("kv-unlimited/report.html", "0dae9c8128970dac"),
    ("kv-unlimited/step_times.png", "c205ef723aa58e10"),
    ("kv-unlimited/step_times.svg", "53102e00f51041c4"),
    ("kv-unlimited/sweep.csv", "377fbc229165b970"),
    ("kv-unlimited/sweep.json", "1c7344890a2315f3"),
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
    ("order-fcfs/report.html", "c8183d1451f1ad66"),
    ("order-fcfs/step_times.png", "c205ef723aa58e10"),
    ("order-fcfs/step_times.svg", "53102e00f51041c4"),
    ("order-fcfs/sweep.csv", "377fbc229165b970"),
    ("order-fcfs/sweep.json", "4d43f7053be5665d"),
    ("order-fcfs/tradeoff.png", "7f9e7213a99b9250"),
    ("order-fcfs/tradeoff.svg", "b0e762fcdc3f0325"),
    ("order-shortest_first/capacity.png", "0f190a1d810c5b59"),
    ("order-shortest_first/capacity.svg", "7c8b83ce67819f19"),
    ("order-shortest_first/report.html", "ab8e1435e14d7809"),
    ("order-shortest_first/step_times.png", "a2af4ab201452d25"),
    ("order-shortest_first/step_times.svg", "68e41d953340d7ec"),
    ("order-shortest_first/sweep.csv", "7a43aebeffffacbd"),
    ("order-shortest_first/sweep.json", "dbe75a5006f24269"),
    ("order-shortest_first/tradeoff.png", "94bd4e4699253ef3"),
    ("order-shortest_first/tradeoff.svg", "408e76e996e7c428"),
    ("orders.csv", "2683a4798d253d15"),
    ("orders.json", "63cd54e4b1f8f2fc"),
    ("sweep.csv", "2d3e3f6655155bc2"),
];
const FLEET_SLO: &[(&str, &str)] = &[
    ("fleet-least_kv-1/capacity.png", "57005f61032a98f5"),
    ("fleet-least_kv-1/capacity.svg", "0fbfcfde34f6b35c"),
    ("fleet-least_kv-1/report.html", "8ac8ef06e7c1fe94"),
    ("fleet-least_kv-1/step_times.png", "c205ef723aa58e10"),
    ("fleet-least_kv-1/step_times.svg", "53102e00f51041c4"),
    ("fleet-least_kv-1/sweep.csv", "377fbc229165b970"),
    ("fleet-least_kv-1/sweep.json", "06071aa8036a9373"),
    ("fleet-least_kv-1/tradeoff.png", "7f9e7213a99b9250"),
    ("fleet-least_kv-1/tradeoff.svg", "b0e762fcdc3f0325"),
    ("fleet-least_kv-2/capacity.png", "e92fe8a5cdc88288"),
    ("fleet-least_kv-2/capacity.svg", "82f6ecb29b583bf9"),
    ("fleet-least_kv-2/report.html", "8a15fb08c12e9683"),
    ("fleet-least_kv-2/step_times.png", "dc537827ef293271"),
    ("fleet-least_kv-2/step_times.svg", "16657d90e4f0b2c6"),
    ("fleet-least_kv-2/sweep.csv", "5b9ee794ec74ea6a"),
    ("fleet-least_kv-2/sweep.json", "d7a4fee28fc9a533"),
    ("fleet-least_kv-2/tradeoff.png", "d78cbade1e6dbf3c"),
    ("fleet-least_kv-2/tradeoff.svg", "af2702406bfe2856"),
    ("fleet-round_robin-1/capacity.png", "57005f61032a98f5"),
    ("fleet-round_robin-1/capacity.svg", "0fbfcfde34f6b35c"),
    ("fleet-round_robin-1/report.html", "db94f85cf73c4641"),
    ("fleet-round_robin-1/step_times.png", "c205ef723aa58e10"),
    ("fleet-round_robin-1/step_times.svg", "53102e00f51041c4"),
    ("fleet-round_robin-1/sweep.csv", "377fbc229165b970"),
    ("fleet-round_robin-1/sweep.json", "db352fc1433a94d9"),
    ("fleet-round_robin-1/tradeoff.png", "7f9e7213a99b9250"),
    ("fleet-round_robin-1/tradeoff.svg", "b0e762fcdc3f0325"),
    ("fleet-round_robin-2/capacity.png", "5db40993b639852e"),
    ("fleet-round_robin-2/capacity.svg", "9b30e36479bf2f7f"),
    ("fleet-round_robin-2/report.html", "420ff5bd137d0cd6"),
    ("fleet-round_robin-2/step_times.png", "b70f556b4c608e8e"),
    ("fleet-round_robin-2/step_times.svg", "eb6af057ff225b9a"),
    ("fleet-round_robin-2/sweep.csv", "0ba3015bdef90054"),
    ("fleet-round_robin-2/sweep.json", "930dfbcca8019498"),
    ("fleet-round_robin-2/tradeoff.png", "08569e88cb762e6a"),
    ("fleet-round_robin-2/tradeoff.svg", "e32c32038a724edb"),
    ("fleet.csv", "d3d14dd97bd6e329"),
    ("fleet.json", "ef793f09d7b2e5b6"),
    ("fleet.png", "736a622560654d8d"),
    ("fleet.svg", "24b0f41b7effb9a9"),
    ("sweep.csv", "3538e7a600f70be2"),
];
const FLEET: &[(&str, &str)] = &[
    ("fleet-round_robin-1/report.html", "66ed1fbd85692d21"),
    ("fleet-round_robin-1/step_times.png", "c205ef723aa58e10"),
    ("fleet-round_robin-1/step_times.svg", "53102e00f51041c4"),
    ("fleet-round_robin-1/sweep.csv", "9ccb0cc7edf6d2ba"),
    ("fleet-round_robin-1/sweep.json", "f09999201ed007ac"),
    ("fleet-round_robin-1/tradeoff.png", "ce05c6b2ca3be174"),
    ("fleet-round_robin-1/tradeoff.svg", "a3d361f8fc7368a4"),
    ("fleet-round_robin-3/report.html", "0b87bc6eba22583d"),
    ("fleet-round_robin-3/step_times.png", "8cd565604117ecc6"),
    ("fleet-round_robin-3/step_times.svg", "a35bdb7e41237187"),
    ("fleet-round_robin-3/sweep.csv", "e1e5f4024b98a620"),
    ("fleet-round_robin-3/sweep.json", "d0964eeceac53e7c"),
    ("fleet-round_robin-3/tradeoff.png", "42233754dd236e56"),
    ("fleet-round_robin-3/tradeoff.svg", "b045b3a6e342d76c"),
    ("fleet.csv", "53ef69b6b705f666"),
    ("fleet.json", "2c0c36451342084f"),
    ("sweep.csv", "55decd41ad4f1967"),
];
