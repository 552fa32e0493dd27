//! A sweep's outputs: the terminal table, `sweep.csv`, `sweep.json`, and writing every output
//! file whole into the output directory.

use std::fmt::Write as _;
use std::fs;
use std::io::Write as _;
use std::path::{Path, PathBuf};

use serde::ser::SerializeMap;
use serde::Serializer;

use super::capacity::slo_text;
use super::forms::render;
use super::summary::LATENCIES;
use super::tables::{budget_list, capacity_table, cell_table, notes, replays};
use super::{capacity, charts, html, plots, Sweep, SweepError};
use crate::text::{fmt_rate, round3};

/// The cells' CSV file.
pub const CSV_FILE: &str = "sweep.csv";
/// The whole sweep as JSON.
pub const JSON_FILE: &str = "sweep.json";
/// The self-contained HTML report.
pub const HTML_FILE: &str = "report.html";

/// Label/value pairs as a JSON object, in order.
pub(crate) fn ser_pairs<S: Serializer>(v: &[(String, String)], s: S) -> Result<S::Ok, S::Error> {
    let mut m = s.serialize_map(Some(v.len()))?;
    for (k, val) in v {
        m.serialize_entry(k, val)?;
    }
    m.end()
}

/// The terminal table: the settings, the cells, and the capacities under the SLO.
pub fn table(sweep: &Sweep) -> String {
    let mut out = String::new();
    let rates: Vec<String> = sweep.rates.iter().map(|r| fmt_rate(*r)).collect();
    let _ = writeln!(
        out,
        "sweep of {}: budgets {} x rate scales {}",
        replays(sweep),
        budget_list(sweep),
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
        if let Some(v) = super::verdict::Verdict::of_sweep(sweep) {
            out.push_str(&v.table());
        }
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
    // `rate_rps` (requests per second) only when the trace's own rate is known.
    let rps = sweep.trace_rate_rps.is_some();
    let mut header = vec!["budget", "rate_scale"];
    if rps {
        header.push("rate_rps");
    }
    header.extend(["requests", "steps", "overruns", "budget_utilisation"]);
    header.extend(LATENCIES);
    header.extend([
        "step_p50_ms",
        "step_p90_ms",
        "step_p99_ms",
        "step_max_ms",
        "meets_slo",
        "status",
    ]);
    w.write_record(&header)?;
    for c in &sweep.cells {
        let s = &c.summary;
        let mut row = vec![c.budget.to_string(), opt(Some(c.rate_scale))];
        if rps {
            row.push(opt(sweep.rps(c.rate_scale)));
        }
        row.extend([
            s.requests.to_string(),
            s.steps.to_string(),
            s.overruns.to_string(),
            opt(s.budget_utilisation),
        ]);
        row.extend(s.latencies().map(opt));
        row.extend(s.step_ms.percentiles([50, 90, 99, 100]).map(opt));
        row.push(c.meets_slo.map_or_else(String::new, |m| m.to_string()));
        row.push("done".to_owned());
        w.write_record(row)?;
    }
    // An interrupted sweep's cells that did not run: their figures empty.
    for c in &sweep.not_run {
        let mut row = vec![c.budget.to_string(), opt(Some(c.rate_scale))];
        if rps {
            row.push(opt(sweep.rps(c.rate_scale)));
        }
        row.resize(header.len() - 1, String::new());
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
    let drawn = charts::draw_all(sweep)?;
    let report = html::report(sweep, &drawn);

    let mut files: Vec<(String, Vec<u8>)> =
        vec![(CSV_FILE.to_owned(), csv), (JSON_FILE.to_owned(), json)];
    if let Some(v) = super::verdict::Verdict::of_sweep(sweep) {
        files.extend(v.files().map_err(|e| {
            write_err(&dir.join(super::verdict::SETTINGS_CSV))(std::io::Error::other(e))
        })?);
    }
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
    names.extend(super::verdict::FILES.map(str::to_owned));
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
#[path = "tests/output.rs"]
mod tests;
