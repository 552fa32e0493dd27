//! The verdict of a sweep with time budgets: per trace, the best token budget against the best
//! time budget, checked against replays run one by one; across traces, each setting's worst
//! fraction of its trace's best; and the flags refused before anything runs.

use std::path::Path;

use serde_json::Value;

use crate::helpers::{run, Run};

fn json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{} unreadable: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{} is not JSON: {e}", path.display()))
}

const TRACES: [&str; 2] = [
    "data/traces/AzureLLMInferenceTrace_code.csv",
    "data/traces/mooncake_fast25_synthetic_trace.head2000.jsonl",
];
/// Every replay of the test: the Llama-2-7B/A100 preset planning and priced, a slice of each
/// trace.
const COMMON: [&str; 8] = [
    "--requests",
    "150",
    "--cost",
    "llama2-7b-a100",
    "--sim-cost",
    "llama2-7b-a100",
    "--config",
    "config/examples/llama2-7b-a100.toml",
];
const SLO_TBT: f64 = 100.0;
const SLO_TTFT: [f64; 2] = [2000.0, 30000.0];

/// Whether a replay's report meets trace `i`'s objective.
fn meets(v: &Value, i: usize) -> bool {
    v["tbt_ms"]["p99"].as_f64().unwrap() <= SLO_TBT
        && v["ttft_ms"]["p90"].as_f64().unwrap() <= SLO_TTFT[i]
}

/// `replay --report-json` of trace `i` at `rate` under `setting` (`--budget N` or
/// `--max-step-ms MS`).
fn replay(dir: &Path, i: usize, setting: &[&str], rate: f64) -> Value {
    let out = dir.join(format!("r{i}-{}-{rate}.json", setting.join("")));
    let rate = rate.to_string();
    let mut args = vec![
        "replay",
        "--no-progress",
        "--trace",
        TRACES[i],
        "--rate-scale",
        &rate,
        "--report-json",
        out.to_str().unwrap(),
    ];
    args.extend_from_slice(&COMMON);
    args.extend_from_slice(setting);
    let r = run(&args, &[]);
    assert_eq!(r.code, 0, "{r:?}");
    json(&out)
}

fn sweep(out: &Path) -> Run {
    let traces = TRACES.join(",");
    let mut args = vec![
        "sweep",
        "--no-progress",
        "--traces",
        &traces,
        "--budgets",
        "256,1024,95ms",
        "--rates",
        "0.5,1",
        "--slo-tbt-p99",
        "100",
        "--slo-ttft-p90",
        "2000",
        "--trace-slo-ttft-p90",
        "2000,30000",
        "--jobs",
        "2",
        "--out",
        out.to_str().unwrap(),
    ];
    args.extend_from_slice(&COMMON);
    run(&args, &[])
}

#[test]
fn the_verdict_matches_replays_run_one_by_one() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("sweep");
    let r = sweep(&out);
    assert_eq!(r.code, 0, "{r:?}");
    let v = json(&out.join("verdict.json"));
    assert_eq!(v["objective"], "per trace", "{v}");
    let traces = v["traces"].as_array().unwrap();
    assert_eq!(traces.len(), 2);
    for (i, t) in traces.iter().enumerate() {
        // Each trace ran into a directory of its own, with the verdict of its grid alone.
        let stem = Path::new(TRACES[i]).file_name().unwrap().to_str().unwrap();
        assert_eq!(t["trace"], stem);
        let dir_name = format!("trace-{}", stem.split('.').next().unwrap());
        let own = json(&out.join(&dir_name).join("verdict.json"));
        assert_eq!(own["traces"][0]["best_time"], t["best_time"], "{own}");
        let s = json(&out.join(&dir_name).join("sweep.json"));
        for best in ["best_tokens", "best_time"] {
            let name = t[best]["setting"].as_str().unwrap();
            let cap = t[best]["capacity"].as_f64().unwrap();
            // The capacity is the sweep's search, bracketed to 2%.
            let c = s["capacity"]
                .as_array()
                .unwrap()
                .iter()
                .find(|c| c["budget"].to_string().trim_matches('"') == name)
                .unwrap_or_else(|| panic!("no capacity of {name} in {s}"));
            assert_eq!(c["rate_scale"].as_f64(), Some(cap));
            let miss = c["misses_at"].as_f64().unwrap();
            assert!(
                cap < miss && miss <= cap * 1.02 + 1e-9,
                "{name}: {cap} .. {miss}"
            );
            // A time cell is `replay --max-step-ms` under the config's token budget.
            let flag: Vec<&str> = match name.strip_suffix(" ms") {
                Some(ms) => vec!["--max-step-ms", ms],
                None => vec!["--budget", name],
            };
            let at = replay(dir.path(), i, &flag, cap);
            assert!(
                meets(&at, i),
                "{stem} {name}: capacity {cap} misses alone: {at}"
            );
            let above = replay(dir.path(), i, &flag, miss);
            assert!(
                !meets(&above, i),
                "{stem} {name}: {miss} meets alone: {above}"
            );
        }
        let ratio = t["best_time"]["capacity"].as_f64().unwrap()
            / t["best_tokens"]["capacity"].as_f64().unwrap();
        assert!(
            (t["time_over_tokens"].as_f64().unwrap() - ratio).abs() < 0.001,
            "{t}"
        );
    }
    // Across traces: each setting's fraction of its trace's best, and the worst of them.
    for row in v["settings"].as_array().unwrap() {
        let name = row["setting"].as_str().unwrap();
        let mut worst = f64::INFINITY;
        for (i, t) in traces.iter().enumerate() {
            let best = t["settings"]
                .as_array()
                .unwrap()
                .iter()
                .map(|p| p["capacity"].as_f64().unwrap())
                .fold(0.0, f64::max);
            let mine = t["settings"]
                .as_array()
                .unwrap()
                .iter()
                .find(|p| p["setting"] == name)
                .unwrap()["capacity"]
                .as_f64()
                .unwrap();
            let frac = row["of_best"][i].as_f64().unwrap();
            assert!((frac - mine / best).abs() < 0.001, "{name} on {i}: {row}");
            worst = worst.min(frac);
        }
        assert_eq!(row["worst"].as_f64(), Some(worst), "{row}");
    }
    let first = &v["settings"][0];
    assert_eq!(v["deploy"], first["setting"]);
    // The table says the same, and the report of each trace has the verdict.
    assert!(
        r.stdout.contains("the setting whose worst is highest: "),
        "{}",
        r.stdout
    );
    let html =
        std::fs::read_to_string(out.join("trace-AzureLLMInferenceTrace_code/report.html")).unwrap();
    assert!(html.contains("<h2>Verdict</h2>"));
    let csv = std::fs::read_to_string(out.join("verdict-settings.csv")).unwrap();
    assert!(csv.starts_with("setting,kind,AzureLLMInferenceTrace_code.csv,mooncake_fast25_synthetic_trace.head2000.jsonl,worst\n"), "{csv}");
}

#[test]
fn time_budgets_and_traces_the_sweep_cannot_run_are_refused_before_anything_runs() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("never");
    let o = out.to_str().unwrap();
    // An unreadable trace is exit 1, as for `replay`; the rest are usage (2).
    let cases: [(&[&str], &str); 6] = [
        // The demo config has no latency model for the planner.
        (&["--budgets", "512,95ms"], "`--budgets` names 95 ms: the config would refuse it: time budget for `llm` needs a latency model"),
        (&["--budgets", "95ms,0ms", "--cost", "llama2-7b-a100"], "takes time budgets in ms between 0.001"),
        (&["--budgets", "95ms,95.000ms", "--cost", "llama2-7b-a100"], "names 95 ms twice"),
        (&["--traces", "data/traces/AzureLLMInferenceTrace_code.csv,./data/traces/AzureLLMInferenceTrace_code.csv"], "names `./data/traces/AzureLLMInferenceTrace_code.csv` twice"),
        (&["--traces", "data/traces/AzureLLMInferenceTrace_code.csv", "--trace-slo-ttft-p90", "1,2"], "one bound per trace of `--traces` (1), got 2"),
        (&["--traces", "data/traces/AzureLLMInferenceTrace_code.csv,/nonexistent/x.csv"], "/nonexistent/x.csv"),
    ];
    for (flags, words) in cases {
        let mut args = vec!["sweep", "--no-progress", "--requests", "20", "--out", o];
        args.extend_from_slice(flags);
        let r = run(&args, &[]);
        let code = if words.starts_with('/') { 1 } else { 2 };
        assert_eq!(r.code, code, "{flags:?}: {r:?}");
        assert!(r.stderr.contains(words), "{flags:?}: {}", r.stderr);
        assert!(!out.exists(), "{flags:?} created the output directory");
    }
}

/// With an axis, each value × budget is a setting: the verdict of the one trace compares them
/// all, and is written beside the axis's runs.
#[test]
fn an_axis_makes_each_value_and_budget_a_setting_of_the_verdict() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("sweep");
    let mut args = vec![
        "sweep",
        "--no-progress",
        "--orders",
        "fcfs,shortest_first",
        "--budgets",
        "512,95ms",
        "--rates",
        "0.5,1",
        "--slo-tbt-p99",
        "100",
        "--slo-ttft-p90",
        "2000",
        "--out",
        out.to_str().unwrap(),
    ];
    args.extend_from_slice(&COMMON);
    let r = run(&args, &[]);
    assert_eq!(r.code, 0, "{r:?}");
    let v = json(&out.join("verdict.json"));
    let t = &v["traces"][0];
    assert_eq!(t["trace"], "bundled:AzureLLMInferenceTrace_code.csv", "{v}");
    let names: Vec<&str> = t["settings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["setting"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "fcfs 512",
            "fcfs 95 ms",
            "shortest_first 512",
            "shortest_first 95 ms"
        ]
    );
    // Each run's own verdict is in its directory.
    for order in ["fcfs", "shortest_first"] {
        assert!(out.join(format!("order-{order}/verdict.json")).is_file());
    }
}
