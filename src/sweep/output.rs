//! A sweep's outputs: the terminal table, `sweep.csv`, `sweep.json`, and writing every output
//! file whole into the output directory.

use std::fmt::Write as _;
use std::fs;
use std::io::Write as _;
use std::path::{Path, PathBuf};

use serde::ser::SerializeMap;
use serde::Serializer;

use super::capacity::slo_text;
use super::tables::{capacity_table, cell_table, notes};
use super::{capacity, html, plots, Sweep, SweepError};
use crate::text::{fmt_rate, round3};

/// The cells' CSV file.
pub const CSV_FILE: &str = "sweep.csv";
/// The whole sweep as JSON.
pub const JSON_FILE: &str = "sweep.json";
/// The self-contained HTML report.
pub const HTML_FILE: &str = "report.html";

/// Serialises a float rounded to 0.001 (a non-finite one as null).
pub(crate) fn ser_round<S: Serializer>(x: &f64, s: S) -> Result<S::Ok, S::Error> {
    if x.is_finite() {
        s.serialize_f64(round3(*x))
    } else {
        s.serialize_none()
    }
}

/// [`ser_round`] for an optional float.
pub(crate) fn ser_opt_round<S: Serializer>(x: &Option<f64>, s: S) -> Result<S::Ok, S::Error> {
    match x {
        Some(x) => ser_round(x, s),
        None => s.serialize_none(),
    }
}

/// [`ser_round`] for every float of a list.
pub(crate) fn ser_vec_round<S: Serializer>(v: &[f64], s: S) -> Result<S::Ok, S::Error> {
    s.collect_seq(v.iter().map(|x| x.is_finite().then(|| round3(*x))))
}

/// Label/value pairs as a JSON object, in order.
pub(crate) fn ser_pairs<S: Serializer>(v: &[(String, String)], s: S) -> Result<S::Ok, S::Error> {
    let mut m = s.serialize_map(Some(v.len()))?;
    for (k, val) in v {
        m.serialize_entry(k, val)?;
    }
    m.end()
}

fn render(out: &mut String, (header, rows): (Vec<&str>, Vec<Vec<String>>)) {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for r in &rows {
        for (w, v) in widths.iter_mut().zip(r) {
            *w = (*w).max(v.chars().count());
        }
    }
    let line = |out: &mut String, cells: Vec<&str>| {
        let text: Vec<String> = cells
            .iter()
            .zip(&widths)
            .map(|(v, w)| format!("{v:>w$}"))
            .collect();
        let _ = writeln!(out, "  {}", text.join("  ").trim_end());
    };
    line(out, header.clone());
    for r in &rows {
        line(out, r.iter().map(String::as_str).collect());
    }
}

/// The terminal table: the settings, the cells, and the capacities under the SLO.
pub fn table(sweep: &Sweep) -> String {
    let mut out = String::new();
    let budgets: Vec<String> = sweep.budgets.iter().map(ToString::to_string).collect();
    let rates: Vec<String> = sweep.rates.iter().map(|r| fmt_rate(*r)).collect();
    let _ = writeln!(
        out,
        "sweep of {}: budgets {} x rate scales {}",
        if sweep.cells.len() == 1 {
            "1 replay".to_string()
        } else {
            format!("{} replays", sweep.cells.len())
        },
        budgets.join(", "),
        rates.join(", ")
    );
    for (k, v) in &sweep.settings {
        let _ = writeln!(out, "  {k:<16} {v}");
    }
    for n in notes(sweep) {
        let _ = writeln!(out, "warning: {n}");
    }
    render(&mut out, cell_table(sweep));
    if let Some(slo) = &sweep.slo {
        let _ = writeln!(
            out,
            "capacity under the SLO ({}): the highest rate scale that meets it, to {}%",
            slo_text(slo),
            capacity::TOLERANCE * 100.0
        );
        render(&mut out, capacity_table(sweep));
    }
    out
}

fn opt(v: Option<f64>) -> String {
    v.filter(|v| v.is_finite())
        .map_or_else(String::new, |v| round3(v).to_string())
}

/// `sweep.csv`: one row per cell, figures in ms rounded to 0.001, empty where there is none; its
/// `status` is `done`, or `interrupted` for a cell an interrupted sweep did not run (no figures).
///
/// # Errors
/// None in practice (the CSV is written to memory).
pub fn to_csv(sweep: &Sweep) -> Result<Vec<u8>, csv::Error> {
    let mut w = csv::Writer::from_writer(Vec::new());
    w.write_record([
        "budget",
        "rate_scale",
        "requests",
        "steps",
        "overruns",
        "budget_utilisation",
        "tbt_p50_ms",
        "tbt_p99_ms",
        "ttft_p50_ms",
        "ttft_p90_ms",
        "ttft_p99_ms",
        "step_p50_ms",
        "step_p90_ms",
        "step_p99_ms",
        "step_max_ms",
        "meets_slo",
        "status",
    ])?;
    for c in &sweep.cells {
        let s = &c.summary;
        w.write_record([
            c.budget.to_string(),
            opt(Some(c.rate_scale)),
            s.requests.to_string(),
            s.steps.to_string(),
            s.overruns.to_string(),
            opt(s.budget_utilisation),
            opt(s.tbt_p50_ms),
            opt(s.tbt_p99_ms),
            opt(s.ttft_p50_ms),
            opt(s.ttft_p90_ms),
            opt(s.ttft_p99_ms),
            opt(s.step_ms.percentile(50)),
            opt(s.step_ms.percentile(90)),
            opt(s.step_ms.percentile(99)),
            opt(s.step_ms.percentile(100)),
            c.meets_slo.map_or_else(String::new, |m| m.to_string()),
            "done".to_owned(),
        ])?;
    }
    // An interrupted sweep's cells that did not run: their figures empty.
    for c in &sweep.not_run {
        let mut row = vec![c.budget.to_string(), opt(Some(c.rate_scale))];
        row.resize(16, String::new());
        row.push("interrupted".to_owned());
        w.write_record(row)?;
    }
    w.into_inner().map_err(|e| csv::Error::from(e.into_error()))
}

/// `sweep.json`: the whole sweep, floats rounded to 0.001.
///
/// # Errors
/// None in practice (the JSON is written to memory).
pub fn to_json(sweep: &Sweep) -> Result<Vec<u8>, serde_json::Error> {
    let mut v = serde_json::to_vec_pretty(sweep)?;
    v.push(b'\n');
    Ok(v)
}

/// The files [`write_outputs`] wrote, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Written {
    /// Their paths.
    pub paths: Vec<PathBuf>,
}

/// Writes every output of `sweep` into `dir` (created if missing): `sweep.csv`, `sweep.json`,
/// the plots as SVG and PNG (the capacity plot only with an SLO), and `report.html`, as one
/// set: everything is drawn, then every file is written to a temporary file in `dir`, and only
/// when all are written are they renamed into place, so a failure replaces no output. Outputs
/// of an earlier sweep that this one does not write (`capacity.png` without an SLO) are then
/// removed, so the directory never mixes two runs; files with other names are left alone.
///
/// # Errors
/// As [`check_output_dir`]; a plot cannot be drawn; a file cannot be written.
pub fn write_outputs(sweep: &Sweep, dir: &Path, inputs: &[PathBuf]) -> Result<Written, SweepError> {
    check_output_dir(dir, inputs)?;
    fs::create_dir_all(dir).map_err(|source| SweepError::Write {
        path: dir.to_owned(),
        source,
    })?;
    let write_err = |path: &Path| {
        let path = path.to_owned();
        move |source: std::io::Error| SweepError::Write { path, source }
    };
    let csv = to_csv(sweep)
        .map_err(|e| write_err(&dir.join(CSV_FILE))(std::io::Error::other(e.to_string())))?;
    let json = to_json(sweep).map_err(|e| write_err(&dir.join(JSON_FILE))(e.into()))?;
    let drawn = plots::draw_all(sweep)?;
    let report = html::report(sweep, &drawn);

    let mut files: Vec<(String, Vec<u8>)> =
        vec![(CSV_FILE.to_owned(), csv), (JSON_FILE.to_owned(), json)];
    for p in drawn {
        files.push((format!("{}.svg", p.name), p.svg.into_bytes()));
        files.push((format!("{}.png", p.name), p.png));
    }
    files.push((HTML_FILE.to_owned(), report.into_bytes()));

    let canon_dir = fs::canonicalize(dir).map_err(write_err(dir))?;
    let canon_inputs: Vec<PathBuf> = inputs
        .iter()
        .filter_map(|i| fs::canonicalize(i).ok())
        .collect();
    for (name, _) in &files {
        if canon_inputs.contains(&canon_dir.join(name)) {
            return Err(SweepError::OutputIsInput(dir.join(name)));
        }
    }
    // Every temporary file first; on any failure, all of them are removed.
    let mut staged: Vec<(PathBuf, PathBuf)> = Vec::with_capacity(files.len());
    for (name, bytes) in &files {
        let path = dir.join(name);
        match stage(&path, bytes) {
            Ok(tmp) => staged.push((tmp, path)),
            Err(e) => {
                for (tmp, _) in &staged {
                    let _ = fs::remove_file(tmp);
                }
                return Err(write_err(&path)(e));
            }
        }
    }
    let mut paths = Vec::with_capacity(staged.len());
    let mut failure = None;
    for (tmp, path) in staged {
        if failure.is_some() {
            let _ = fs::remove_file(&tmp);
            continue;
        }
        match fs::rename(&tmp, &path) {
            Ok(()) => paths.push(path),
            Err(e) => {
                let _ = fs::remove_file(&tmp);
                failure = Some(write_err(&path)(e));
            }
        }
    }
    if let Some(e) = failure {
        return Err(e);
    }
    for name in output_names() {
        if !files.iter().any(|(n, _)| *n == name) {
            let stale = dir.join(&name);
            match fs::remove_file(&stale) {
                Ok(()) => {
                    tracing::debug!(file = %stale.display(), "removed an output of an earlier sweep")
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(write_err(&stale)(e)),
            }
        }
    }
    Ok(Written { paths })
}

/// The names of every file [`write_outputs`] may write into its directory.
pub fn output_names() -> Vec<String> {
    let mut names = vec![
        CSV_FILE.to_owned(),
        JSON_FILE.to_owned(),
        HTML_FILE.to_owned(),
    ];
    for stem in plots::NAMES {
        names.push(format!("{stem}.svg"));
        names.push(format!("{stem}.png"));
    }
    names
}

/// Checks, before a sweep runs, that its outputs can go into `dir`: `dir` is a directory or
/// does not exist yet, is none of `inputs`, none of `inputs` is a file the sweep would write
/// there, and every output name there is free or a file to replace (a directory named
/// `report.html` is refused now, not after the grid ran).
///
/// # Errors
/// [`SweepError::OutputNotADirectory`], [`SweepError::OutputNotAFile`] or
/// [`SweepError::OutputIsInput`].
pub fn check_output_dir(dir: &Path, inputs: &[PathBuf]) -> Result<(), SweepError> {
    // `metadata` follows links and never opens: a FIFO is refused without blocking.
    if let Ok(meta) = fs::metadata(dir) {
        if !meta.is_dir() {
            return Err(SweepError::OutputNotADirectory(dir.to_owned()));
        }
    } else {
        return Ok(());
    }
    for name in output_names() {
        let path = dir.join(&name);
        // A link is replaced by the rename, not followed; anything else but a file is refused.
        if let Ok(meta) = fs::symlink_metadata(&path) {
            if !(meta.is_file() || meta.file_type().is_symlink()) {
                return Err(SweepError::OutputNotAFile(path));
            }
        }
    }
    let Ok(canon_dir) = fs::canonicalize(dir) else {
        return Ok(());
    };
    let names = output_names();
    for input in inputs {
        let Ok(canon) = fs::canonicalize(input) else {
            continue;
        };
        let inside = canon.parent() == Some(canon_dir.as_path())
            && canon
                .file_name()
                .is_some_and(|n| names.iter().any(|o| n == o.as_str()));
        if inside {
            return Err(SweepError::OutputIsInput(input.clone()));
        }
    }
    Ok(())
}

/// Writes `bytes` to a temporary file next to `path`, flushed to disk, and returns its path
/// (for [`write_outputs`] to rename once every output is staged).
fn stage(path: &Path, bytes: &[u8]) -> std::io::Result<PathBuf> {
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let name = path
        .file_name()
        .ok_or_else(|| std::io::Error::other("the output path has no file name"))?;
    let tmp = dir.join(format!(
        ".{}.{}.tmp",
        name.to_string_lossy(),
        std::process::id()
    ));
    let write = || -> std::io::Result<()> {
        // A leftover from a crashed run of this same process id is ours to replace.
        let _ = fs::remove_file(&tmp);
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()
    };
    write().inspect_err(|_| {
        let _ = fs::remove_file(&tmp);
    })?;
    Ok(tmp)
}

/// Writes `bytes` to `path` whole: into a temporary file next to it, flushed to disk, then
/// renamed over `path`, so a reader never sees half a file.
///
/// # Errors
/// The temporary file cannot be created, written or renamed (it is removed on failure).
pub fn write_whole(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = stage(path, bytes)?;
    fs::rename(&tmp, path).inspect_err(|_| {
        let _ = fs::remove_file(&tmp);
    })
}

#[cfg(test)]
mod tests {
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
                "512", "1", "100", "200", "9.1", "18.2", "533.3", "1066.7", "1600.0", "12.1",
                "17.2", "0", "75.0%", "meets"
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
        let names: Vec<String> = w
            .paths
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
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
        let drawn = plots::draw_all(&s).unwrap();
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
}
