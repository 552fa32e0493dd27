use super::*;
use crate::sweep::{
    parse_budgets, parse_rates, run_sweep, RunSummary, Slo, StepTimes, SweepOptions,
};

/// A replay whose TBT p99 crosses the objective (60 ms) at the rate scale `cap` gives the
/// budget, so that each budget's capacity is known in advance.
fn replay(
    cap: impl Fn(Budget) -> f64 + Sync,
) -> impl Fn(Budget, f64) -> Result<RunSummary, String> + Sync {
    move |b, rate| {
        let tbt = 60.0 * rate / cap(b);
        let mut steps = vec![8.0; 10];
        Ok(RunSummary {
            requests: 10,
            steps: 10,
            overruns: 0,
            budget_utilisation: None,
            tbt_p50_ms: Some(tbt / 2.0),
            tbt_p99_ms: Some(tbt),
            ttft_p50_ms: Some(1.0),
            ttft_p90_ms: Some(1.0),
            ttft_p99_ms: Some(1.0),
            step_ms: StepTimes::from_samples(&mut steps),
        })
    }
}

fn sweep(trace: &str, budgets: &str, times: &str, cap: impl Fn(Budget) -> f64 + Sync) -> Sweep {
    let mut b = parse_budgets(budgets).unwrap();
    if !times.is_empty() {
        b.extend(parse_budgets(&format!("{times}ms")).unwrap());
    }
    let opts = SweepOptions {
        budgets: b,
        rates: parse_rates("0.5,1,2").unwrap(),
        slo: Some(Slo::new(Some(60.0), None).unwrap()),
        jobs: 1,
        progress: false,
        step_time_rate: None,
        settings: vec![("trace".into(), format!("data/traces/{trace} (azure)"))],
        trace_rps: None,
        stop: None,
    };
    run_sweep(&opts, replay(cap)).unwrap()
}

/// Capacities per setting of three made-up workloads: the time budget is best on two of them,
/// and each token budget falls far behind on one.
fn caps(trace: &'static str) -> impl Fn(Budget) -> f64 + Sync {
    move |b| match (trace, b.to_string().as_str()) {
        ("a", "256") => 0.6,
        ("a", "512") => 0.7,
        ("a", "95 ms") => 0.75,
        ("b", "256") => 0.15,
        ("b", "512") => 0.2,
        ("b", "95 ms") => 0.2,
        ("c", "256") => 0.1,
        ("c", "512") => 0.05,
        ("c", "95 ms") => 0.12,
        _ => 1.0,
    }
}

fn near(a: f64, b: f64) -> bool {
    (a - b).abs() <= b * 0.03
}

#[test]
fn one_trace_names_its_best_token_and_time_budgets_and_their_ratio() {
    let s = sweep("a.csv", "256,512", "95", caps("a"));
    let v = Verdict::of_sweep(&s).unwrap();
    assert_eq!(v.traces.len(), 1);
    let t = &v.traces[0];
    assert_eq!(t.trace, "a.csv");
    let (k, m) = (
        t.best_tokens.as_ref().unwrap(),
        t.best_time.as_ref().unwrap(),
    );
    assert_eq!((k.setting.as_str(), k.time), ("512", false));
    assert_eq!((m.setting.as_str(), m.time), ("95 ms", true));
    // The sweep's own search, to its tolerance.
    assert!(
        near(k.capacity, 0.7) && near(m.capacity, 0.75),
        "{k:?} {m:?}"
    );
    assert!(near(t.time_over_tokens.unwrap(), 0.75 / 0.7));
    let text = v.table();
    assert!(
        text.contains("verdict under the objective (TBT p99 <= 60 ms)"),
        "{text}"
    );
    assert!(text.contains("95 ms (0.7"), "{text}");
    assert_eq!(v.deploy.as_deref(), Some("95 ms"));
}

#[test]
fn across_traces_each_setting_has_its_worst_fraction_of_the_best() {
    let (a, b, c) = (
        sweep("a.csv", "256,512", "95", caps("a")),
        sweep("b.csv", "256,512", "95", caps("b")),
        sweep("c.jsonl", "256,512", "95", caps("c")),
    );
    let runs = vec![
        ("a".to_owned(), vec![(None, &a)]),
        ("b".to_owned(), vec![(None, &b)]),
        ("c".to_owned(), vec![(None, &c)]),
    ];
    let v = Verdict::of(&runs).unwrap();
    let row = |name: &str| v.settings.iter().find(|r| r.setting == name).unwrap();
    // 512 is best on b, half the best on c; 256 is 0.75 of b's best.
    assert!(
        near(row("512").worst.unwrap(), 0.05 / 0.12),
        "{:?}",
        row("512")
    );
    assert!(
        near(row("256").worst.unwrap(), 0.15 / 0.2),
        "{:?}",
        row("256")
    );
    assert!(near(row("95 ms").worst.unwrap(), 1.0), "{:?}", row("95 ms"));
    assert_eq!(v.settings[0].setting, "95 ms");
    assert_eq!(v.deploy.as_deref(), Some("95 ms"));
    assert_eq!(row("512").of_best.len(), 3);
    assert_eq!(v.objective, "TBT p99 <= 60 ms");
    assert!(!v.table().contains("objective\n"));
    // The files: one row per trace, one per setting, and the whole as JSON.
    let files = v.files().unwrap();
    let names: Vec<&str> = files.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, FILES);
    let traces = String::from_utf8(files[0].1.clone()).unwrap();
    assert!(traces.starts_with("trace,objective,best_token_budget,best_token_capacity,best_time_budget,best_time_capacity,time_over_tokens\na,TBT p99 <= 60 ms,512,"), "{traces}");
    let settings = String::from_utf8(files[1].1.clone()).unwrap();
    assert!(
        settings.starts_with("setting,kind,a,b,c,worst\n95 ms,time,1,1,1,1\n"),
        "{settings}"
    );
    let json: serde_json::Value = serde_json::from_slice(&files[2].1).unwrap();
    assert_eq!(json["deploy"], "95 ms");
    assert_eq!(
        json["settings"][0]["of_best"],
        serde_json::json!([1.0, 1.0, 1.0])
    );
    let frac = json["settings"][1]["of_best"][0].as_f64().unwrap();
    assert_eq!(frac, (frac * 1000.0).round() / 1000.0, "rounded to 0.001");
    assert_eq!(json["traces"][2]["best_tokens"]["setting"], "256");
}

#[test]
fn an_axis_value_names_the_setting_and_competes_for_the_best() {
    let fcfs = sweep("a.csv", "512", "95", caps("a"));
    let short = sweep(
        "a.csv",
        "512",
        "95",
        |b| if b.is_time() { 0.9 } else { 0.7 },
    );
    let runs = vec![(
        "a".to_owned(),
        vec![
            (Some("fcfs".to_owned()), &fcfs),
            (Some("shortest_first".to_owned()), &short),
        ],
    )];
    let v = Verdict::of(&runs).unwrap();
    let t = &v.traces[0];
    assert_eq!(
        t.best_time.as_ref().unwrap().setting,
        "shortest_first 95 ms"
    );
    // Equal capacities: the first run wins.
    assert_eq!(t.best_tokens.as_ref().unwrap().setting, "fcfs 512");
    assert_eq!(v.deploy.as_deref(), Some("shortest_first 95 ms"));
}

#[test]
fn no_verdict_without_an_objective_or_without_both_kinds_of_budget() {
    assert!(Verdict::of_sweep(&sweep("a.csv", "256,512", "", caps("a"))).is_none());
    assert!(Verdict::of_sweep(&sweep("a.csv", "256", "95", caps("a"))).is_some());
    let mut no_slo = sweep("a.csv", "256", "95", caps("a"));
    no_slo.slo = None;
    assert!(Verdict::of_sweep(&no_slo).is_none());
    let mut stopped = sweep("a.csv", "256", "95", caps("a"));
    stopped.interrupted = Some("SIGINT".into());
    assert!(Verdict::of_sweep(&stopped).is_none());
}

#[test]
fn a_setting_with_no_capacity_counts_as_none_and_a_best_of_none_has_no_ratio() {
    // 512 misses at every rate the search tries: its capacity is none.
    let s = sweep("a.csv", "256,512", "95", |b| match b.get() {
        Some(512) => 1e-9,
        _ => 0.5,
    });
    let v = Verdict::of_sweep(&s).unwrap();
    let t = &v.traces[0];
    let none = t.settings.iter().find(|p| p.setting == "512").unwrap();
    assert_eq!(none.capacity, 0.0);
    assert_eq!(none.label(), "none");
    assert_eq!(v.settings.last().unwrap().setting, "512");
    assert_eq!(v.settings.last().unwrap().worst, Some(0.0));
    let all_none = sweep("a.csv", "256", "95", |_| 1e-9);
    let v = Verdict::of_sweep(&all_none).unwrap();
    assert_eq!(v.traces[0].time_over_tokens, None);
    assert!(v.settings.iter().all(|r| r.worst.is_none()));
    assert_eq!(v.deploy, None);
}

#[test]
fn the_trace_label_is_the_files_name() {
    let mut s = sweep("x.csv", "256", "95", caps("a"));
    assert_eq!(trace_label(&s), "x.csv");
    s.settings = vec![("trace".into(), "bundled (azure)".into())];
    assert_eq!(trace_label(&s), "bundled");
    s.settings.clear();
    assert_eq!(trace_label(&s), "trace");
}

#[test]
fn traces_under_different_objectives_say_each_ones() {
    let a = sweep("a.csv", "256", "95", caps("a"));
    let mut c = sweep("c.jsonl", "256", "95", caps("c"));
    c.slo = Some(Slo::new(Some(60.0), Some(30000.0)).unwrap());
    let v = Verdict::of(&[
        ("a".to_owned(), vec![(None, &a)]),
        ("c".to_owned(), vec![(None, &c)]),
    ])
    .unwrap();
    assert_eq!(v.objective, "per trace");
    assert_eq!(
        v.traces[1].objective,
        "TBT p99 <= 60 ms and TTFT p90 <= 30000 ms"
    );
    let text = v.table();
    assert!(
        text.contains("verdict under the objective (per trace)"),
        "{text}"
    );
    assert!(text.contains("TTFT p90 <= 30000 ms\n"), "{text}");
}
