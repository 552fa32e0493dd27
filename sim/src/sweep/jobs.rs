//! A sweep as a list of jobs for a cluster engine users already have (`docs/cluster-sweeps.md`):
//! `sweep --emit-jobs DIR` writes every cell of the grid as a job of a job directory (its
//! inputs copied in, one manifest naming each cell by index), `sweep-cell DIR INDEX` runs one
//! and writes its result next to the manifest, and `sweep --merge DIR` builds the sweep from
//! the results, exactly as the local sweep would have.
//!
//! The local sweep refines each budget's capacity by bisection between grid rates, probe by
//! probe, which no job list knows up front. A job directory runs it in waves: a merge replays
//! the same search (`capacity::search`) over the results it has, and when a search needs a rate
//! no cell has run, it adds that probe as a cell of a new wave (one per budget, all in one
//! wave) and asks for it to be run; the merge after the last wave writes the outputs. The
//! results being the local sweep's, the outputs are too.
//!
//! This module is the plain part: the manifest and its checksum, a cell's result file, and the
//! merge (what is missing, the next wave, or the finished sweep). The command line copies the
//! inputs and runs the cells (`cli/sweep_jobs.rs`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::capacity::{self, Slo};
use super::grid::Budget;
use super::{Capacity, Cell, RunSummary, StepTimes, Sweep};

/// The manifest's file name in a job directory.
pub const MANIFEST: &str = "jobs.json";
/// The directory of the cells' results.
pub const RESULTS: &str = "results";
/// The directory of the copied inputs.
pub const INPUTS: &str = "inputs";
/// What a manifest's `format` says.
pub const FORMAT: &str = "mstar-chunking sweep jobs";

/// Why a job directory, a cell or a merge was refused.
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    /// A file could not be read or written.
    #[error("`{}`: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The manifest is not one, or not this version's, or was edited.
    #[error("`{}` {problem}", path.display())]
    Manifest {
        /// The manifest.
        path: PathBuf,
        /// What is wrong.
        problem: String,
    },
    /// A cell index outside the manifest.
    #[error("cell {index} is not in `{}`: its cells are 0 to {last}", path.display())]
    NoSuchCell {
        /// The index asked for.
        index: u64,
        /// The highest index.
        last: usize,
        /// The manifest.
        path: PathBuf,
    },
    /// A result file that is not a result of this cell.
    #[error("`{}` {problem}", path.display())]
    Result {
        /// The result file.
        path: PathBuf,
        /// What is wrong.
        problem: String,
    },
    /// A merge found cells without results.
    #[error("{} of {total} cells have no result yet: {}{}", missing.len(), list(missing), running_note(*writing))]
    Missing {
        /// The cells without a result, by index.
        missing: Vec<usize>,
        /// All cells.
        total: usize,
        /// Results being written (temporary files present): cells still running.
        writing: usize,
    },
}

fn list(v: &[usize]) -> String {
    let shown: Vec<String> = v.iter().take(20).map(ToString::to_string).collect();
    if v.len() > 20 {
        format!("{} and {} more", shown.join(", "), v.len() - 20)
    } else {
        shown.join(", ")
    }
}

fn running_note(writing: usize) -> String {
    if writing == 0 {
        " (run them with `mstar-chunking sweep-cell DIR INDEX`, then merge again)".into()
    } else {
        format!(" ({writing} still being written: cells are running; merge once they are done)")
    }
}

/// How a cell reads its inputs: where the job directory's copies are, and the settings of the
/// sweep that emitted it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Inputs {
    /// The directory of `default.toml` (and the `$MSTAR_ENV` layer), under the job directory.
    pub config_dir: String,
    /// `$MSTAR_ENV` when the sweep was emitted.
    pub mstar_env: Option<String>,
    /// The `--config` layers' copies, in order, under the job directory.
    pub configs: Vec<String>,
    /// The model manifest's copy, under the job directory.
    pub model: String,
    /// The `MSTAR__…` environment variables when the sweep was emitted.
    pub env: BTreeMap<String, String>,
    /// The trace's copy under the job directory; `None`: the bundled trace.
    pub trace: Option<String>,
    /// How the trace is read.
    #[serde(flatten)]
    pub trace_flags: TraceFlags,
    /// The settings given as flags.
    #[serde(flatten)]
    pub setting_flags: SettingFlags,
}

/// How the emitting sweep read its trace: `--format`, `--arrivals`, `--requests`,
/// `--skip-bad-lines` and `--priority-by`, as given (the manifest holds them among the inputs).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceFlags {
    /// `--format`.
    pub format: Option<String>,
    /// `--arrivals`.
    pub arrivals: Option<String>,
    /// `--requests`.
    pub requests: Option<u64>,
    /// `--skip-bad-lines`.
    pub skip_bad_lines: bool,
    /// `--priority-by`.
    pub priority_by: Option<String>,
}

/// The emitting sweep's setting flags: `--max-step-ms`, `--cost`, `--learn-cost`, `--sim-cost`
/// and `--time-margin`, as given (the manifest holds them among the inputs).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SettingFlags {
    /// `--max-step-ms`.
    pub max_step_ms: Option<String>,
    /// `--cost`.
    pub cost: Option<String>,
    /// `--learn-cost`.
    pub learn_cost: bool,
    /// `--sim-cost`.
    pub sim_cost: Option<String>,
    /// `--time-margin`.
    pub time_margin: Option<String>,
}

/// One cell of a job directory: a replay at one budget and rate scale.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobCell {
    /// Its index, its position in the manifest.
    pub index: usize,
    /// The budget, as `--budgets` spells it.
    pub budget: String,
    /// The rate scale.
    pub rate_scale: f64,
    /// The wave that added it: 0 for the grid, then one per step of the capacity searches.
    pub wave: u32,
}

/// What a job directory runs, checksummed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Body {
    /// The inputs every cell reads.
    pub inputs: Inputs,
    /// The settings every output shows, as the emitting sweep labelled them.
    pub settings: Vec<(String, String)>,
    /// The budgets, in the order given.
    pub budgets: Vec<String>,
    /// The rate scales, ascending.
    pub rates: Vec<f64>,
    /// The objective's bounds, if any.
    pub slo_tbt_p99_ms: Option<f64>,
    /// See `slo_tbt_p99_ms`.
    pub slo_ttft_p90_ms: Option<f64>,
    /// The rate scale whose step times are plotted.
    pub step_time_rate: f64,
    /// The trace's own request rate, requests per second (absent: unknown).
    #[serde(default)]
    pub trace_rps: Option<f64>,
    /// Every cell, by index: the grid's, budget by budget, then each wave's probes.
    pub cells: Vec<JobCell>,
}

/// The manifest file: the body, the version that wrote it, and a checksum of the body.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// [`FORMAT`].
    pub format: String,
    /// The crate version that wrote it; only the same version runs or merges it.
    pub version: String,
    /// FNV-1a (64 bits) of the body's JSON, in hex: a manifest edited by hand is refused.
    pub checksum: String,
    /// What the jobs run.
    pub body: Body,
}

/// FNV-1a, 64 bits: stable across builds and platforms (a hand edit detector, not security).
fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

fn checksum(body: &Body) -> String {
    let bytes = serde_json::to_vec(body).unwrap_or_default();
    format!("fnv1a64:{:016x}", fnv1a(&bytes))
}

impl Manifest {
    /// A manifest of `body`, by this version.
    pub fn new(body: Body) -> Self {
        Self {
            format: FORMAT.into(),
            version: env!("CARGO_PKG_VERSION").into(),
            checksum: checksum(&body),
            body,
        }
    }

    /// Reads and checks the manifest of job directory `dir`.
    ///
    /// # Errors
    /// Unreadable, not a manifest, another version's, or edited (the checksum does not match).
    pub fn read(dir: &Path) -> Result<Self, JobError> {
        let path = dir.join(MANIFEST);
        let bad = |problem: String| JobError::Manifest {
            path: path.clone(),
            problem,
        };
        let text = mstar_chunking::input::read_text(&path, 64 << 20).map_err(|e| {
            bad(format!(
                "cannot be read ({e}): is `{}` a job directory written by `sweep --emit-jobs`?",
                dir.display()
            ))
        })?;
        let m: Manifest =
            serde_json::from_str(&text).map_err(|e| bad(format!("is not a job manifest: {e}")))?;
        if m.format != FORMAT {
            return Err(bad(format!(
                "is not a job manifest (format {:?})",
                m.format
            )));
        }
        let mine = env!("CARGO_PKG_VERSION");
        if m.version != mine {
            return Err(bad(format!(
                "was written by mstar-chunking {} and this is {mine}: emit the jobs again with this version (or run that one)",
                m.version
            )));
        }
        let sum = checksum(&m.body);
        if m.checksum != sum {
            return Err(bad(format!(
                "was changed after it was written (checksum {} expected, {sum} found): emit the jobs again rather than edit them",
                m.checksum
            )));
        }
        for (i, c) in m.body.cells.iter().enumerate() {
            if c.index != i {
                return Err(bad(format!("lists cell {} at position {i}", c.index)));
            }
        }
        Ok(m)
    }

    /// Writes the manifest into `dir` whole (a temporary file renamed over it).
    ///
    /// # Errors
    /// The file cannot be written.
    pub fn write(&self, dir: &Path) -> Result<(), JobError> {
        let path = dir.join(MANIFEST);
        let mut bytes = serde_json::to_vec_pretty(self).unwrap_or_default();
        bytes.push(b'\n');
        super::output::write_whole(&path, &bytes).map_err(|source| JobError::Io { path, source })
    }

    /// The cell at `index`.
    ///
    /// # Errors
    /// No such cell.
    pub fn cell(&self, index: u64, dir: &Path) -> Result<&JobCell, JobError> {
        usize::try_from(index)
            .ok()
            .and_then(|i| self.body.cells.get(i))
            .ok_or_else(|| JobError::NoSuchCell {
                index,
                last: self.body.cells.len().saturating_sub(1),
                path: dir.join(MANIFEST),
            })
    }

    /// The objective, if any.
    pub fn slo(&self) -> Option<Slo> {
        Slo::new(self.body.slo_tbt_p99_ms, self.body.slo_ttft_p90_ms).ok()
    }
}

/// The result file of cell `index`.
pub fn result_path(dir: &Path, index: usize) -> PathBuf {
    dir.join(RESULTS).join(format!("cell-{index:06}.json"))
}

/// A float as text that reads back to the same float (Rust's shortest round-trip form: JSON
/// numbers are not read back exactly by every reader).
fn exact(x: f64) -> String {
    format!("{x:?}")
}

fn exact_opt(x: Option<f64>) -> Option<String> {
    x.map(exact)
}

/// A cell's result: which cell, whether it met the objective, and its summary with every float
/// exact, as text (the outputs wave as they print; the result must not round before them).
pub fn result_json(cell: &JobCell, meets_slo: Option<bool>, s: &RunSummary) -> serde_json::Value {
    serde_json::json!({
        "index": cell.index,
        "budget": cell.budget,
        "rate_scale": cell.rate_scale,
        "meets_slo": meets_slo,
        "summary": {
            "requests": s.requests,
            "steps": s.steps,
            "overruns": s.overruns,
            "budget_utilisation": exact_opt(s.budget_utilisation),
            "tbt_p50_ms": exact_opt(s.tbt_p50_ms),
            "tbt_p99_ms": exact_opt(s.tbt_p99_ms),
            "ttft_p50_ms": exact_opt(s.ttft_p50_ms),
            "ttft_p90_ms": exact_opt(s.ttft_p90_ms),
            "ttft_p99_ms": exact_opt(s.ttft_p99_ms),
            "step_percentiles_ms": s.step_ms.percentiles_ms.iter().map(|x| exact(*x)).collect::<Vec<_>>(),
        },
    })
}

/// The summary and objective of a result file's JSON for `cell`.
///
/// # Errors
/// A result of another cell, or not a result.
pub fn parse_result(
    v: &serde_json::Value,
    cell: &JobCell,
) -> Result<(Option<bool>, RunSummary), String> {
    if v["index"].as_u64() != Some(cell.index as u64)
        || v["budget"].as_str() != Some(cell.budget.as_str())
        || v["rate_scale"].as_f64() != Some(cell.rate_scale)
    {
        return Err(format!(
            "is not the result of cell {} (budget {}, rate scale {})",
            cell.index, cell.budget, cell.rate_scale
        ));
    }
    let s = &v["summary"];
    let count = |k: &str| s[k].as_u64().ok_or_else(|| format!("has no `summary.{k}`"));
    let number = |x: &serde_json::Value| x.as_str().and_then(|t| t.parse::<f64>().ok());
    let ms = |k: &str| -> Result<Option<f64>, String> {
        match &s[k] {
            serde_json::Value::Null => Ok(None),
            x => number(x)
                .map(Some)
                .ok_or_else(|| format!("has a `summary.{k}` that is not a number")),
        }
    };
    let percentiles_ms = s["step_percentiles_ms"]
        .as_array()
        .ok_or("has no `summary.step_percentiles_ms`")?
        .iter()
        .map(|x| number(x).ok_or("has a step percentile that is not a number"))
        .collect::<Result<Vec<f64>, _>>()?;
    let summary = RunSummary {
        requests: usize::try_from(count("requests")?).map_err(|e| e.to_string())?,
        steps: count("steps")?,
        overruns: count("overruns")?,
        budget_utilisation: ms("budget_utilisation")?,
        tbt_p50_ms: ms("tbt_p50_ms")?,
        tbt_p99_ms: ms("tbt_p99_ms")?,
        ttft_p50_ms: ms("ttft_p50_ms")?,
        ttft_p90_ms: ms("ttft_p90_ms")?,
        ttft_p99_ms: ms("ttft_p99_ms")?,
        step_ms: StepTimes { percentiles_ms },
    };
    let meets = match &v["meets_slo"] {
        serde_json::Value::Null => None,
        m => Some(
            m.as_bool()
                .ok_or("has a `meets_slo` that is not a boolean")?,
        ),
    };
    Ok((meets, summary))
}

/// What a merge found.
#[derive(Debug)]
pub enum Merged {
    /// Every cell and every capacity search is done: the sweep.
    Done(Box<Sweep>),
    /// The capacity searches need more probes: the cells of the next wave, added to the
    /// manifest (its indices).
    NextWave(std::ops::Range<usize>),
}

/// Merges the results `results` (by cell index) of `manifest`'s cells into the sweep the local
/// sweep would have made; when its capacity searches need rates no cell ran, adds them to
/// `manifest` as the cells of a new wave instead.
///
/// # Errors
/// A budget that does not parse (a manifest of another build).
pub fn merge(
    manifest: &mut Manifest,
    results: &BTreeMap<usize, (Option<bool>, RunSummary)>,
) -> Result<Merged, String> {
    let body = &manifest.body;
    let budget = |b: &str| {
        b.parse::<Budget>()
            .map_err(|e| format!("budget {b:?} of the manifest: {e}"))
    };
    let budgets: Vec<Budget> = body
        .budgets
        .iter()
        .map(|b| budget(b))
        .collect::<Result<_, _>>()?;
    let ran = |b: &str, r: f64| {
        body.cells
            .iter()
            .find(|c| c.budget == b && c.rate_scale == r)
            .and_then(|c| results.get(&c.index))
    };
    let mut cells = Vec::new();
    for c in body.cells.iter().filter(|c| c.wave == 0) {
        let Some((meets_slo, summary)) = results.get(&c.index) else {
            continue;
        };
        cells.push(Cell {
            budget: budget(&c.budget)?,
            rate_scale: c.rate_scale,
            meets_slo: *meets_slo,
            summary: summary.clone(),
        });
    }
    let mut capacity = Vec::new();
    let mut wanted: Vec<(String, f64)> = Vec::new();
    if let Some(_slo) = manifest.slo() {
        for (b, name) in budgets.iter().zip(&body.budgets) {
            let known: Vec<(f64, bool)> = cells
                .iter()
                .filter(|c| c.budget == *b)
                .map(|c| (c.rate_scale, c.meets_slo == Some(true)))
                .collect();
            // The local search, answered by the cells that ran; the first rate none ran stops
            // it and becomes a probe of the next wave.
            let searched = capacity::search(&known, |r| match ran(name, r) {
                Some((meets, _)) => Ok(*meets == Some(true)),
                None => Err(r),
            });
            match searched {
                Ok(search) => capacity.push(Capacity::new(*b, search, body.trace_rps)),
                Err(r) => wanted.push((name.clone(), r)),
            }
        }
    }
    if !wanted.is_empty() {
        let wave = body.cells.iter().map(|c| c.wave).max().unwrap_or(0) + 1;
        let start = body.cells.len();
        let mut b = body.clone();
        for (i, (budget, rate_scale)) in wanted.into_iter().enumerate() {
            b.cells.push(JobCell {
                index: start + i,
                budget,
                rate_scale,
                wave,
            });
        }
        let end = b.cells.len();
        *manifest = Manifest::new(b);
        return Ok(Merged::NextWave(start..end));
    }
    Ok(Merged::Done(Box::new(Sweep {
        version: env!("CARGO_PKG_VERSION"),
        settings: body.settings.clone(),
        budgets,
        rates: body.rates.clone(),
        slo: manifest.slo(),
        step_time_rate: body.step_time_rate,
        trace_rate_rps: body.trace_rps,
        cells,
        capacity,
        interrupted: None,
        not_run: Vec::new(),
    })))
}

#[cfg(test)]
#[path = "tests/jobs.rs"]
mod tests;
