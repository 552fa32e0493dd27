//! Tests of `output.rs`: the table, `sweep.csv`, `sweep.json` and whole-file writes.

use super::super::tests::{options, sample_sweep};
use super::super::{run_sweep, tests::fake};
use super::*;

#[test]
fn rates_print_short() {
    assert_eq!(
        [0.5, 1.0, 2.1534, 1024.0, 0.0009765625].map(fmt_rate),
        ["0.5", "1", "2.153", "1024", "0.001"]
    );
    assert_eq!(round3(1.23456), 1.235);
}

#[test]
fn the_table_shows_settings_cells_and_capacity() {
    let s = sample_sweep();
    let t = table(&s);
    let lines: Vec<&str> = t.lines().collect();
    assert_eq!(
        lines[0],
        "sweep of 9 replays: budgets 512, 2048, off x rate scales 0.5, 1, 2"
    );
    assert_eq!(lines[1], "  trace            bundled <test> & co");
    assert!(
        lines[3].trim_start().starts_with("budget  rate  requests"),
        "{}",
        lines[3]
    );
    // Budget 512 at rate 1: TBT p99 8 + 10.24 = 18.24, TTFT p99 1600.
    let row = lines[5].split_whitespace().collect::<Vec<_>>();
    assert_eq!(
        row,
        [
            "512", "1", "100", "200", "9.1", "18.2", "533.3", "1066.7", "1600.0", "12.1", "17.2",
            "0", "75.0%", "meets"
        ]
    );
    let cap = lines
        .iter()
        .position(|l| l.starts_with("capacity under the SLO"))
        .unwrap();
    assert_eq!(
        lines[cap],
        "capacity under the SLO (TBT p99 <= 60 ms and TTFT p90 <= 5000 ms): the highest rate scale that meets it, to 2%"
    );
    assert_eq!(lines.len(), cap + 5);
    let label = s.capacity[0].label();
    assert_eq!(
        lines[cap + 2]
            .split_whitespace()
            .take(2)
            .collect::<Vec<_>>(),
        ["512", label.as_str()]
    );
    let no_slo = table(&run_sweep(&options(None), fake).unwrap());
    assert!(!no_slo.contains("capacity"));
}

#[test]
fn csv_has_one_row_per_cell_with_rounded_figures() {
    let s = sample_sweep();
    let text = String::from_utf8(to_csv(&s).unwrap()).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 10);
    assert_eq!(
        lines[0],
        "budget,rate_scale,requests,steps,overruns,budget_utilisation,tbt_p50_ms,tbt_p99_ms,ttft_p50_ms,ttft_p90_ms,ttft_p99_ms,step_p50_ms,step_p90_ms,step_p99_ms,step_max_ms,meets_slo,status"
    );
    assert_eq!(
        lines[2],
        "512,1,100,200,0,0.75,9.12,18.24,533.333,1066.667,1600,12.096,16.192,17.216,17.216,true,done"
    );
    assert_eq!(
        lines[9],
        "off,2,100,200,1,,167.84,335.68,266.667,533.333,800,73.536,139.072,155.456,155.456,false,done"
    );
}

#[test]
fn json_holds_settings_cells_and_capacity() {
    let s = sample_sweep();
    let v: serde_json::Value = serde_json::from_slice(&to_json(&s).unwrap()).unwrap();
    assert_eq!(v["settings"]["trace"], "bundled <test> & co");
    assert_eq!(v["budgets"], serde_json::json!([512, 2048, "off"]));
    assert_eq!(v["rates"], serde_json::json!([0.5, 1.0, 2.0]));
    assert_eq!(v["slo"]["tbt_p99_ms"], 60.0);
    assert_eq!(v["cells"].as_array().unwrap().len(), 9);
    let c = &v["cells"][1];
    assert_eq!(
        (c["budget"].clone(), c["rate_scale"].clone()),
        (512.into(), 1.0.into())
    );
    assert_eq!(c["ttft_p90_ms"], 1066.667);
    assert_eq!(c["meets_slo"], true);
    assert_eq!(
        c["step_ms"]["percentiles_ms"].as_array().unwrap().len(),
        101
    );
    assert_eq!(v["cells"][6]["budget_utilisation"], serde_json::Value::Null);
    let cap = &v["capacity"][0];
    assert_eq!(cap["budget"], 512);
    assert_eq!(cap["bound"], "found");
    assert_eq!(
        cap["rate_scale"],
        round3(s.capacity[0].search.rate_scale.unwrap())
    );
    assert!(!cap["probes"].as_array().unwrap().is_empty());
}

#[test]
fn outputs_are_written_whole_and_never_over_a_file_or_an_input() {
    let s = sample_sweep();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let w = write_outputs(&s, &out, &[]).unwrap();
    let names = crate::sweep::tests::names(&w.paths);
    assert_eq!(
        names,
        [
            "sweep.csv",
            "sweep.json",
            "tradeoff.svg",
            "tradeoff.png",
            "capacity.svg",
            "capacity.png",
            "step_times.svg",
            "step_times.png",
            "report.html"
        ]
    );
    for p in &w.paths {
        assert!(fs::metadata(p).unwrap().len() > 0, "{}", p.display());
    }
    // No temporary file is left behind.
    assert_eq!(fs::read_dir(&out).unwrap().count(), names.len());
    assert_eq!(fs::read(out.join(CSV_FILE)).unwrap(), to_csv(&s).unwrap());

    let file = dir.path().join("file");
    fs::write(&file, "x").unwrap();
    assert!(matches!(
        write_outputs(&s, &file, &[]),
        Err(SweepError::OutputNotADirectory(_))
    ));
    let input = out.join("sweep.json");
    assert!(matches!(
        write_outputs(&s, &out, &[input]),
        Err(SweepError::OutputIsInput(p)) if p.ends_with("sweep.json")
    ));
    let no_slo = run_sweep(&options(None), fake).unwrap();
    let out2 = dir.path().join("out2");
    let w = write_outputs(&no_slo, &out2, &[]).unwrap();
    assert!(!w.paths.iter().any(|p| p.ends_with("capacity.svg")));
}

/// `sample_sweep` as interrupted by SIGINT after its first four cells.
fn interrupted() -> Sweep {
    let mut s = sample_sweep();
    let rest = s.cells.split_off(4);
    s.not_run = rest
        .iter()
        .map(|c| super::super::NotRun {
            budget: c.budget,
            rate_scale: c.rate_scale,
        })
        .collect();
    s.capacity.clear();
    s.interrupted = Some("SIGINT".into());
    s
}

#[test]
fn an_interrupted_sweep_says_so_in_every_output() {
    let s = interrupted();
    let note = "interrupted by SIGINT: 4 of 9 grid replays finished; not run: 2048 at 1x, 2048 at 2x, off at 0.5x, off at 1x, off at 2x; capacity searches that did not finish are left out";
    assert_eq!(notes(&s), [note]);
    assert!(
        table(&s).contains(&format!("warning: {note}")),
        "{}",
        table(&s)
    );
    let csv = String::from_utf8(to_csv(&s).unwrap()).unwrap();
    let lines: Vec<&str> = csv.lines().collect();
    assert_eq!(lines.len(), 10);
    assert!(lines[4].ends_with(",done"), "{}", lines[4]);
    assert_eq!(lines[5], "2048,1,,,,,,,,,,,,,,,interrupted");
    let v: serde_json::Value = serde_json::from_slice(&to_json(&s).unwrap()).unwrap();
    assert_eq!(v["interrupted"], "SIGINT");
    assert_eq!(
        v["not_run"][0],
        serde_json::json!({"budget": 2048, "rate_scale": 1.0})
    );
    let drawn = charts::draw_all(&s).unwrap();
    assert!(html::report(&s, &drawn).contains(&html::escape(note)));
    let done: serde_json::Value =
        serde_json::from_slice(&to_json(&sample_sweep()).unwrap()).unwrap();
    assert_eq!(done["interrupted"], serde_json::Value::Null);
    assert!(notes(&sample_sweep()).is_empty());
}

#[test]
fn a_non_monotone_budget_is_noted() {
    let mut s = sample_sweep();
    s.capacity[1].search.non_monotone = Some(super::super::NonMonotone {
        misses_at: 1.0,
        meets_at: 2.0,
    });
    let note = "budget 2048: latency does not rise with load on this grid (1x misses the SLO while 2x meets it); its capacity is the highest rate below the first miss";
    assert_eq!(notes(&s), [note]);
    assert!(table(&s).contains(note));
    let v: serde_json::Value = serde_json::from_slice(&to_json(&s).unwrap()).unwrap();
    assert_eq!(
        v["capacity"][1]["non_monotone"],
        serde_json::json!({"misses_at": 1.0, "meets_at": 2.0})
    );
    assert_eq!(v["capacity"][0]["non_monotone"], serde_json::Value::Null);
}

#[test]
fn outputs_are_written_as_one_set_and_stale_ones_are_removed() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    write_outputs(&sample_sweep(), &out, &[]).unwrap();
    assert!(out.join("capacity.png").is_file());
    fs::write(out.join("notes.txt"), "mine").unwrap();
    // A run without an SLO draws no capacity plot: the earlier one goes, other files stay.
    let no_slo = run_sweep(&options(None), fake).unwrap();
    write_outputs(&no_slo, &out, &[]).unwrap();
    assert!(!out.join("capacity.png").exists());
    assert!(!out.join("capacity.svg").exists());
    assert!(out.join("notes.txt").is_file());
    assert_eq!(
        fs::read(out.join(CSV_FILE)).unwrap(),
        to_csv(&no_slo).unwrap()
    );

    // A directory where an output goes is refused before anything is written.
    let out2 = dir.path().join("out2");
    fs::create_dir_all(out2.join(HTML_FILE)).unwrap();
    let e = check_output_dir(&out2, &[]).unwrap_err();
    assert!(
        matches!(&e, SweepError::OutputNotAFile(p) if p.ends_with(HTML_FILE)),
        "{e}"
    );
    assert!(matches!(
        write_outputs(&no_slo, &out2, &[]),
        Err(SweepError::OutputNotAFile(_))
    ));
    assert_eq!(fs::read_dir(&out2).unwrap().count(), 1);
}

#[test]
fn write_whole_replaces_a_file_and_fails_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("a.txt");
    write_whole(&p, b"one").unwrap();
    write_whole(&p, b"two").unwrap();
    assert_eq!(fs::read(&p).unwrap(), b"two");
    let sub = dir.path().join("sub");
    fs::create_dir(&sub).unwrap();
    // Renaming a file over a non-empty directory fails; the temporary file is removed.
    fs::write(sub.join("x"), "x").unwrap();
    assert!(write_whole(&sub, b"three").is_err());
    assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 2);
}

#[test]
fn requests_per_second_stand_beside_rates_and_capacities_when_the_trace_rate_is_known() {
    let slo = crate::sweep::Slo::new(Some(60.0), Some(5000.0)).unwrap();
    let mut o = options(Some(slo));
    o.trace_rps = Some(2.5);
    let s = run_sweep(&o, fake).unwrap();
    let t = table(&s);
    let lines: Vec<&str> = t.lines().collect();
    assert!(
        lines[3]
            .trim_start()
            .starts_with("budget  rate  req/s  requests"),
        "{}",
        lines[3]
    );
    let row: Vec<&str> = lines[5].split_whitespace().collect();
    assert_eq!(&row[..4], ["512", "1", "2.5", "100"]);
    let cap = s.capacity[0].search.rate_scale.unwrap();
    assert_eq!(s.capacity[0].rps, Some(cap * 2.5));
    let at = lines
        .iter()
        .position(|l| l.starts_with("capacity under"))
        .unwrap();
    assert!(
        lines[at + 1].contains("capacity  req/s  misses at"),
        "{}",
        lines[at + 1]
    );
    let caprow: Vec<&str> = lines[at + 2].split_whitespace().collect();
    assert_eq!(caprow[2], round3(cap * 2.5).to_string(), "{t}");
    let csv = String::from_utf8(to_csv(&s).unwrap()).unwrap();
    assert!(
        csv.starts_with("budget,rate_scale,rate_rps,requests,"),
        "{csv}"
    );
    assert!(
        csv.lines().nth(2).unwrap().starts_with("512,1,2.5,100,"),
        "{csv}"
    );
    let v: serde_json::Value = serde_json::from_slice(&to_json(&s).unwrap()).unwrap();
    assert_eq!(v["trace_rate_rps"], 2.5);
    assert_eq!(v["capacity"][0]["capacity_rps"], round3(cap * 2.5));
    // Without the trace's rate: no column, and null in the JSON.
    let plain = sample_sweep();
    assert!(!table(&plain).contains("req/s"));
    let v: serde_json::Value = serde_json::from_slice(&to_json(&plain).unwrap()).unwrap();
    assert!(v["trace_rate_rps"].is_null() && v["capacity"][0]["capacity_rps"].is_null());
}

#[test]
fn a_grid_that_misses_everywhere_says_so_and_suggests_rates_that_bracket_the_capacities() {
    let mut o = options(Some(crate::sweep::Slo::new(Some(60.0), None).unwrap()));
    o.rates = crate::sweep::parse_rates("8,16").unwrap();
    o.step_time_rate = None;
    let s = run_sweep(&o, fake).unwrap();
    assert!(s.cells.iter().all(|c| c.meets_slo == Some(false)));
    let caps: Vec<f64> = s
        .capacity
        .iter()
        .filter_map(|c| c.search.rate_scale)
        .collect();
    let note = super::super::tables::notes(&s)
        .into_iter()
        .find(|n| n.starts_with("every cell misses the objective"))
        .unwrap_or_else(|| panic!("no note in\n{}", table(&s)));
    assert!(
        note.contains("below the lowest rate scale of the grid (8x)"),
        "{note}"
    );
    let listed = note.rsplit_once("--rates ").unwrap().1;
    let rates = crate::sweep::parse_rates(listed).unwrap();
    let (lo, hi) = (
        caps.iter().copied().fold(f64::MAX, f64::min),
        caps.iter().copied().fold(0.0, f64::max),
    );
    assert!(
        rates[0] <= lo && *rates.last().unwrap() >= hi,
        "{rates:?} against {caps:?}"
    );
    assert!(table(&s).contains(&format!("warning: {note}")));
    // A grid with a rate that meets has no such note.
    assert!(!super::super::tables::notes(&sample_sweep())
        .iter()
        .any(|n| n.starts_with("every cell misses")));
}

#[test]
fn the_capacity_axis_fits_small_bars_and_shows_the_trace_rate_only_when_near() {
    let mut o = options(Some(crate::sweep::Slo::new(Some(10.0), None).unwrap()));
    o.rates = crate::sweep::parse_rates("8,16").unwrap();
    let small = run_sweep(&o, fake).unwrap();
    // Capacities of 0.2x and below: the axis ends at 1.25 times the tallest.
    let tallest = small
        .capacity
        .iter()
        .filter_map(|c| c.search.rate_scale)
        .fold(0.0, f64::max);
    assert!(tallest < 0.3, "{tallest}");
    let drawn = charts::draw_all(&small).unwrap();
    let cap = drawn.iter().find(|p| p.name == "capacity").unwrap();
    assert!(
        !cap.svg.contains("1x: the trace"),
        "the 1x line is off this chart"
    );
    assert!(
        !cap.svg.contains(">1.0<") && !cap.svg.contains(">1.2<"),
        "{}",
        cap.svg
    );
    let big = sample_sweep();
    let drawn = charts::draw_all(&big).unwrap();
    let cap = drawn.iter().find(|p| p.name == "capacity").unwrap();
    assert!(cap.svg.contains("1x: the trace"));
}
