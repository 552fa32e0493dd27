//! Sweeps (see `docs/replay.md#sweeps`): replays over a grid of token budgets × rate scales, the
//! capacity of each budget under a latency objective, and their table, CSV, JSON, plots and
//! HTML report.
//!
//! The engine does not know how one replay runs: the caller passes a function from
//! `(budget, rate scale)` to a [`RunSummary`], which the engine calls from several threads.
//!
//! - [`grid`]: the budgets and rate scales, parsed from `--budgets` and `--rates`;
//! - [`run`]: the bounded pool of threads the cells run on;
//! - [`capacity`]: the SLO and the bracketing-and-bisection search for capacity;
//! - [`output`]: the terminal table, `sweep.csv`, `sweep.json`, and whole-file writes;
//! - [`plots`]: the trade-off curve, capacity bars and step-time distributions, SVG and PNG;
//! - [`html`]: the self-contained `report.html`;
//! - [`kv_axis`]: `--kv-blocks`, the grid run once per KV pool size, and their comparison.
//! - [`jobs`]: the sweep as a job directory for a cluster engine: the manifest, a cell's
//!   result, and merging the results (in rounds for the capacity searches).
//! - [`fleet_axis`]: `--workers` and `--routers`, the grid run once per fleet, and the fewest
//!   workers that meet the objective at each rate.
//! - [`order_axis`]: `--orders`, the grid run once per order of waiting prompts, and their
//!   comparison.

use std::fmt;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Arc;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::Serialize;

pub mod axis;
pub mod capacity;
pub(crate) mod cells;
mod charts;
pub mod fleet_axis;
pub mod grid;
pub mod html;
pub mod jobs;
pub mod kv_axis;
pub mod order_axis;
pub mod output;
pub mod plots;
mod raster;
pub mod run;
pub(crate) mod tables;

pub use capacity::{Bound, NonMonotone, Probe, Search, Slo};
pub use grid::{parse_budgets, parse_rates, Budget, GridError};
pub use output::{write_outputs, Written};

/// Percentiles kept of a run's step times: p0, p1, …, p100.
pub const STEP_QUANTILES: usize = 100;

/// What one replay tells a sweep.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct RunSummary {
    /// Requests replayed.
    pub requests: usize,
    /// Steps run.
    pub steps: u64,
    /// Steps that ran over their token budget.
    pub overruns: u64,
    /// Budget utilisation of the budgeted steps, in `[0, 1]`; `None` without a budgeted step.
    #[serde(serialize_with = "output::ser_opt_round")]
    pub budget_utilisation: Option<f64>,
    /// Time between tokens, simulated ms: p50 and p99 (`None` without samples).
    #[serde(serialize_with = "output::ser_opt_round")]
    pub tbt_p50_ms: Option<f64>,
    /// See `tbt_p50_ms`.
    #[serde(serialize_with = "output::ser_opt_round")]
    pub tbt_p99_ms: Option<f64>,
    /// Time to first token, simulated ms: p50, p90 and p99 (`None` without samples).
    #[serde(serialize_with = "output::ser_opt_round")]
    pub ttft_p50_ms: Option<f64>,
    /// See `ttft_p50_ms`.
    #[serde(serialize_with = "output::ser_opt_round")]
    pub ttft_p90_ms: Option<f64>,
    /// See `ttft_p50_ms`.
    #[serde(serialize_with = "output::ser_opt_round")]
    pub ttft_p99_ms: Option<f64>,
    /// The distribution of step durations.
    pub step_ms: StepTimes,
}

/// The distribution of a run's step durations, as its percentiles p0 … p100 (nearest rank), in
/// simulated ms; empty without steps.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct StepTimes {
    /// `STEP_QUANTILES + 1` values, non-decreasing, or none.
    #[serde(serialize_with = "output::ser_vec_round")]
    pub percentiles_ms: Vec<f64>,
}

impl StepTimes {
    /// The percentiles of `samples` (non-finite ones left out; reordered in place).
    pub fn from_samples(samples: &mut Vec<f64>) -> Self {
        samples.retain(|s| s.is_finite());
        samples.sort_by(f64::total_cmp);
        let percentiles_ms = if samples.is_empty() {
            Vec::new()
        } else {
            (0..=STEP_QUANTILES)
                .filter_map(|i| nearest_rank(samples, i as f64 / STEP_QUANTILES as f64))
                .collect()
        };
        Self { percentiles_ms }
    }

    /// The `p`-th percentile (`p` in 0..=100), if there were steps.
    pub fn percentile(&self, p: usize) -> Option<f64> {
        self.percentiles_ms.get(p).copied()
    }
}

/// What a sweep keeps of one replay: its latencies, and its step durations as the
/// percentiles of the report's histogram.
#[cfg(feature = "replay")]
impl From<&crate::replay::ReplayReport> for RunSummary {
    fn from(r: &crate::replay::ReplayReport) -> Self {
        let step_ms = StepTimes {
            percentiles_ms: if r.step_ms.is_empty() {
                Vec::new()
            } else {
                (0..=STEP_QUANTILES)
                    .filter_map(|i| r.step_ms.quantile(i as f64 / STEP_QUANTILES as f64))
                    .collect()
            },
        };
        Self {
            requests: r.requests,
            steps: r.steps,
            overruns: r.overruns.total,
            budget_utilisation: r.budget_utilisation,
            tbt_p50_ms: r.tbt_ms.map(|l| l.p50),
            tbt_p99_ms: r.tbt_ms.map(|l| l.p99),
            ttft_p50_ms: r.ttft_ms.map(|l| l.p50),
            ttft_p90_ms: r.ttft_ms.map(|l| l.p90),
            ttft_p99_ms: r.ttft_ms.map(|l| l.p99),
            step_ms,
        }
    }
}

/// The nearest-rank quantile `p` (in `[0, 1]`) of `sorted` (ascending): the smallest value with
/// at least `p` of the samples at or below it; the minimum for `p = 0`. `None` when empty.
pub fn nearest_rank(sorted: &[f64], p: f64) -> Option<f64> {
    let n = sorted.len();
    if n == 0 || !p.is_finite() {
        return None;
    }
    let k = ((p.clamp(0.0, 1.0) * n as f64).ceil() as usize).clamp(1, n) - 1;
    sorted.get(k).copied()
}

/// Why a sweep failed.
#[derive(Debug, thiserror::Error)]
pub enum SweepError {
    /// A grid axis was refused.
    #[error(transparent)]
    Grid(#[from] GridError),
    /// The SLO was refused.
    #[error("{0}")]
    Slo(String),
    /// The options do not make a sweep.
    #[error("{0}")]
    Options(String),
    /// One replay failed.
    #[error("the replay with budget {budget} at rate scale {rate_scale} failed: {message}")]
    Run {
        /// Its budget.
        budget: Budget,
        /// Its rate scale.
        rate_scale: f64,
        /// Its error.
        message: String,
    },
    /// A replay panicked.
    #[error("a replay panicked: {0}")]
    Panicked(String),
    /// The output directory is an existing file (or something else that is not a directory).
    #[error("the output directory `{}` exists and is not a directory", .0.display())]
    OutputNotADirectory(PathBuf),
    /// An output name in the output directory is taken by something that is not a file.
    #[error("the output `{}` exists and is not a file; remove it or choose another output directory", .0.display())]
    OutputNotAFile(PathBuf),
    /// An output would overwrite an input.
    #[error("the output `{}` is also an input; choose another output directory", .0.display())]
    OutputIsInput(PathBuf),
    /// An output could not be written.
    #[error("cannot write `{}`: {source}", path.display())]
    Write {
        /// The file.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// A plot could not be drawn.
    #[error("cannot draw the {plot} plot: {message}")]
    Plot {
        /// Which plot.
        plot: &'static str,
        /// What went wrong.
        message: String,
    },
}

/// What to sweep and how.
#[derive(Debug, Clone)]
pub struct SweepOptions {
    /// The budgets, in the order given (at least one).
    pub budgets: Vec<Budget>,
    /// The rate scales, ascending (at least one).
    pub rates: Vec<f64>,
    /// The latency objective; `None`: no capacity search.
    pub slo: Option<Slo>,
    /// Threads to run replays on (see [`run::default_jobs`]).
    pub jobs: usize,
    /// Show a progress bar (only when stderr is a terminal).
    pub progress: bool,
    /// The rate scale whose step-time distributions are plotted: one of `rates`; `None`: 1 if
    /// it is among them, else the middle one.
    pub step_time_rate: Option<f64>,
    /// The settings every replay ran under (trace, cost model, …), as label and value, shown
    /// by every output.
    pub settings: Vec<(String, String)>,
    /// Set to a signal number (2 SIGINT, 15 SIGTERM) to stop the sweep: no new replay starts,
    /// replays that `run` reports failed after it was set count as not run, and the sweep
    /// returns what finished, marked [`Sweep::interrupted`]. `None`: never stopped.
    pub stop: Option<Arc<AtomicI32>>,
}

/// A signal's name, as the outputs state an interruption.
pub fn signal_name(signal: i32) -> String {
    match signal {
        2 => "SIGINT".into(),
        15 => "SIGTERM".into(),
        n => format!("signal {n}"),
    }
}

/// A grid cell that did not finish because the sweep was interrupted.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct NotRun {
    /// Its budget.
    pub budget: Budget,
    /// Its rate scale.
    #[serde(serialize_with = "output::ser_round")]
    pub rate_scale: f64,
}

/// One replay of the grid.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Cell {
    /// Its budget.
    pub budget: Budget,
    /// Its rate scale.
    #[serde(serialize_with = "output::ser_round")]
    pub rate_scale: f64,
    /// Whether it met the SLO (`None` without one).
    pub meets_slo: Option<bool>,
    /// What it showed.
    #[serde(flatten)]
    pub summary: RunSummary,
}

/// The capacity of one budget under the SLO.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Capacity {
    /// The budget.
    pub budget: Budget,
    /// The search's answer and probes.
    #[serde(flatten)]
    pub search: Search,
}

impl Capacity {
    /// The capacity as text: `1.23x`, `>= 1024x` or `none`.
    pub fn label(&self) -> String {
        match (self.search.bound, self.search.rate_scale) {
            (Bound::AtLeastMax, Some(r)) => format!(">= {}x", crate::text::fmt_rate(r)),
            (_, Some(r)) => format!("{}x", crate::text::fmt_rate(r)),
            (_, None) => "none".into(),
        }
    }
}

/// A finished sweep: every cell, and the capacities when there was an SLO.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Sweep {
    /// The crate version that ran it.
    pub version: &'static str,
    /// The settings every replay ran under.
    #[serde(serialize_with = "output::ser_pairs")]
    pub settings: Vec<(String, String)>,
    /// The budgets, in the order given.
    pub budgets: Vec<Budget>,
    /// The rate scales, ascending.
    #[serde(serialize_with = "output::ser_vec_round")]
    pub rates: Vec<f64>,
    /// The latency objective, if any.
    pub slo: Option<Slo>,
    /// The rate scale whose step-time distributions are plotted.
    #[serde(serialize_with = "output::ser_round")]
    pub step_time_rate: f64,
    /// Every cell, budget by budget, each budget's rates ascending.
    pub cells: Vec<Cell>,
    /// One per budget, in the same order, when there was an SLO (and the search of each
    /// finished: an interrupted sweep keeps only the searches that did).
    pub capacity: Vec<Capacity>,
    /// The signal that interrupted the sweep (`SIGINT`, `SIGTERM`), if one did: `cells` are
    /// then the replays that finished, and `not_run` the rest.
    pub interrupted: Option<String>,
    /// The grid cells that did not finish, in grid order (empty unless interrupted).
    pub not_run: Vec<NotRun>,
}

impl Sweep {
    /// The cells of `budget`, rates ascending.
    pub fn cells_of(&self, budget: Budget) -> impl Iterator<Item = &Cell> {
        self.cells.iter().filter(move |c| c.budget == budget)
    }

    /// The cell at (`budget`, `rate`).
    pub fn cell(&self, budget: Budget, rate: f64) -> Option<&Cell> {
        self.cells_of(budget).find(|c| c.rate_scale == rate)
    }
}

impl SweepOptions {
    /// Checks the options; answers the rate scale whose step times are plotted.
    pub(crate) fn check(&self) -> Result<f64, SweepError> {
        if self.budgets.is_empty() || self.rates.is_empty() {
            return Err(SweepError::Options(
                "a sweep needs at least one budget (`--budgets`) and one rate scale (`--rates`)"
                    .into(),
            ));
        }
        let listed = self
            .rates
            .iter()
            .map(|r| r.to_string())
            .collect::<Vec<_>>()
            .join(",");
        // Re-parsing the listed rates checks the range, duplicates and order of hand-built
        // options exactly as `--rates` does.
        if grid::parse_rates(&listed)? != self.rates {
            return Err(SweepError::Options(format!(
                "rate scales must be distinct and ascending, got {listed}"
            )));
        }
        for (i, b) in self.budgets.iter().enumerate() {
            if self.budgets[..i].contains(b) {
                return Err(SweepError::Options(format!("budget {b} is listed twice")));
            }
        }
        match self.step_time_rate {
            Some(r) if !self.rates.contains(&r) => Err(SweepError::Options(format!(
                "the step-time rate {} is not one of the rate scales ({listed})",
                crate::text::fmt_rate(r)
            ))),
            Some(r) => Ok(r),
            None if self.rates.contains(&1.0) => Ok(1.0),
            None => Ok(self.rates[self.rates.len() / 2]),
        }
    }
}

/// Runs the sweep: every `(budget, rate)` cell of the grid through `run`, on up to
/// `opts.jobs` threads with one progress bar, then, with an SLO, each budget's capacity search
/// (budgets in parallel, each search's probes in turn). `run` must be deterministic for the
/// capacity to agree with the grid.
///
/// With `opts.stop`, a signal ends the sweep early but successfully: the result holds the cells
/// (and capacity searches) that finished, and names the rest.
///
/// # Errors
/// Bad options, or the first replay (in grid order) that failed or panicked.
pub fn run_sweep<F, E>(opts: &SweepOptions, run: F) -> Result<Sweep, SweepError>
where
    F: Fn(Budget, f64) -> Result<RunSummary, E> + Sync,
    E: fmt::Display + Send,
{
    let step_time_rate = opts.check()?;
    let grid: Vec<(Budget, f64)> = opts
        .budgets
        .iter()
        .flat_map(|b| opts.rates.iter().map(move |r| (*b, *r)))
        .collect();
    let progress = progress_bar(opts.progress, grid.len() as u64);
    let signal = || {
        opts.stop
            .as_ref()
            .map(|f| f.load(Ordering::SeqCst))
            .filter(|s| *s != 0)
    };
    let stopped = || signal().is_some();
    let failed = |budget: Budget, rate_scale: f64, e: E| SweepError::Run {
        budget,
        rate_scale,
        message: e.to_string(),
    };
    let slots = run::parallel_slots(&grid, opts.jobs, &progress, &stopped, |(b, r)| run(*b, *r))
        .map_err(|f| match f {
            run::JobFailure::Failed { index, error } => {
                let (b, r) = grid[index];
                failed(b, r, error)
            }
            run::JobFailure::Panicked { message } => SweepError::Panicked(message),
        })?;
    let mut cells = Vec::with_capacity(grid.len());
    let mut not_run = Vec::new();
    for ((budget, rate_scale), slot) in grid.iter().copied().zip(slots) {
        match slot {
            Some(Ok(summary)) => cells.push(Cell {
                budget,
                rate_scale,
                meets_slo: opts.slo.map(|s| s.meets(&summary)),
                summary,
            }),
            // A replay stopped by the signal reports itself failed (or never started).
            _ if stopped() => not_run.push(NotRun { budget, rate_scale }),
            Some(Err(e)) => return Err(failed(budget, rate_scale, e)),
            None => {
                return Err(SweepError::Panicked(
                    "a replay of the grid ended without a result".into(),
                ))
            }
        }
    }

    let mut capacity = Vec::new();
    if let (Some(slo), false) = (opts.slo, stopped()) {
        progress.set_message("capacity search");
        let searched = run::parallel_slots(
            &opts.budgets,
            opts.jobs,
            &ProgressBar::hidden(),
            &stopped,
            |b| {
                let known: Vec<(f64, bool)> = cells
                    .iter()
                    .filter(|c| c.budget == *b)
                    .map(|c| (c.rate_scale, c.meets_slo == Some(true)))
                    .collect();
                capacity::search(&known, |r| {
                    progress.inc_length(1);
                    let s = run(*b, r).map_err(|e| failed(*b, r, e))?;
                    progress.inc(1);
                    Ok::<_, SweepError>(slo.meets(&s))
                })
                .map(|search| Capacity { budget: *b, search })
            },
        )
        .map_err(|f| match f {
            run::JobFailure::Failed { error, .. } => error,
            run::JobFailure::Panicked { message } => SweepError::Panicked(message),
        })?;
        for slot in searched {
            match slot {
                Some(Ok(c)) => capacity.push(c),
                // A search the signal stopped is left out; the sweep says it was interrupted.
                _ if stopped() => {}
                Some(Err(e)) => return Err(e),
                None => {
                    return Err(SweepError::Panicked(
                        "a capacity search ended without a result".into(),
                    ))
                }
            }
        }
    }
    progress.finish_and_clear();
    Ok(Sweep {
        version: env!("CARGO_PKG_VERSION"),
        settings: opts.settings.clone(),
        budgets: opts.budgets.clone(),
        rates: opts.rates.clone(),
        slo: opts.slo,
        step_time_rate,
        cells,
        capacity,
        interrupted: signal().map(signal_name),
        not_run,
    })
}

/// One bar for the whole grid; hidden unless asked for and stderr is a terminal.
fn progress_bar(wanted: bool, len: u64) -> ProgressBar {
    let target = if wanted && std::io::stderr().is_terminal() {
        ProgressDrawTarget::stderr()
    } else {
        ProgressDrawTarget::hidden()
    };
    let pb = ProgressBar::with_draw_target(Some(len), target);
    if let Ok(style) = ProgressStyle::with_template(
        "{spinner} sweep [{elapsed_precise}] {wide_bar} {pos}/{len} replays {msg} ({eta})",
    ) {
        pb.set_style(style);
    }
    pb
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A fake replay: latency grows with rate, more for larger budgets' TBT and smaller
    /// budgets' TTFT, like the real trade-off.
    pub(crate) fn fake(budget: Budget, rate: f64) -> Result<RunSummary, String> {
        let b = f64::from(budget.get().unwrap_or(8192));
        let tbt = 8.0 + b * 0.02 * rate;
        let ttft = 200.0 * rate * rate * 4096.0 / b.min(4096.0);
        let mut steps: Vec<f64> = (0..200)
            .map(|i| 8.0 + b * 0.02 * f64::from(i % 10) / 10.0)
            .collect();
        Ok(RunSummary {
            requests: 100,
            steps: 200,
            overruns: u64::from(budget == Budget::Off),
            budget_utilisation: budget.get().map(|_| 0.75),
            tbt_p50_ms: Some(tbt / 2.0),
            tbt_p99_ms: Some(tbt),
            ttft_p50_ms: Some(ttft / 3.0),
            ttft_p90_ms: Some(ttft / 1.5),
            ttft_p99_ms: Some(ttft),
            step_ms: StepTimes::from_samples(&mut steps),
        })
    }

    pub(crate) fn options(slo: Option<Slo>) -> SweepOptions {
        SweepOptions {
            budgets: parse_budgets("512,2048,off").unwrap(),
            rates: parse_rates("0.5,1,2").unwrap(),
            slo,
            jobs: 2,
            progress: false,
            step_time_rate: None,
            settings: vec![
                ("trace".into(), "bundled <test> & co".into()),
                ("cost".into(), "8 ms + 0.02 ms/token".into()),
            ],
            stop: None,
        }
    }

    pub(crate) fn sample_sweep() -> Sweep {
        let slo = Slo::new(Some(60.0), Some(5000.0)).unwrap();
        run_sweep(&options(Some(slo)), fake).unwrap()
    }

    #[test]
    fn every_cell_runs_once_in_grid_order() {
        let calls = AtomicUsize::new(0);
        let s = run_sweep(&options(None), |b, r| {
            calls.fetch_add(1, Ordering::Relaxed);
            fake(b, r)
        })
        .unwrap();
        assert_eq!(calls.load(Ordering::Relaxed), 9);
        let order: Vec<(String, f64)> = s
            .cells
            .iter()
            .map(|c| (c.budget.to_string(), c.rate_scale))
            .collect();
        assert_eq!(
            order,
            [
                ("512".into(), 0.5),
                ("512".into(), 1.0),
                ("512".into(), 2.0),
                ("2048".into(), 0.5),
                ("2048".into(), 1.0),
                ("2048".into(), 2.0),
                ("off".into(), 0.5),
                ("off".into(), 1.0),
                ("off".into(), 2.0),
            ]
        );
        assert!(s.capacity.is_empty());
        assert!(s.cells.iter().all(|c| c.meets_slo.is_none()));
        assert_eq!(s.step_time_rate, 1.0);
        assert_eq!(s.cell(Budget::Off, 2.0).unwrap().summary.overruns, 1);
    }

    #[test]
    fn capacity_matches_the_fake_replays_one_by_one() {
        let s = sample_sweep();
        assert_eq!(s.capacity.len(), 3);
        let slo = s.slo.unwrap();
        for c in &s.capacity {
            let r = c.search.rate_scale.unwrap();
            assert_eq!(c.search.bound, Bound::Found);
            // The answer meets the SLO when run again, and 2% more does not.
            assert!(slo.meets(&fake(c.budget, r).unwrap()), "{}", c.budget);
            assert!(
                !slo.meets(&fake(c.budget, r * 1.02).unwrap()),
                "{}",
                c.budget
            );
        }
        // Budget 512: TBT 8 + 10.24 r <= 60 gives r <= 5.05; TTFT p90 = 200 r² · 8 / 1.5 <= 5000
        // gives r <= 2.165: TTFT binds.
        let r512 = s.capacity[0].search.rate_scale.unwrap();
        assert!((2.165 / 1.02..=2.1651).contains(&r512), "{r512}");
        assert_eq!(s.cells[2].meets_slo, Some(true));
        assert_eq!(
            s.capacity[0].label(),
            format!("{}x", crate::text::fmt_rate(r512))
        );
    }

    #[test]
    fn a_failed_replay_names_its_cell_and_bad_options_are_refused() {
        let e = run_sweep(&options(None), |b, r| {
            if b == Budget::Off && r == 1.0 {
                Err("trace gone".to_owned())
            } else {
                fake(b, r)
            }
        })
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "the replay with budget off at rate scale 1 failed: trace gone"
        );
        let mut o = options(None);
        o.step_time_rate = Some(3.0);
        assert!(run_sweep(&o, fake)
            .unwrap_err()
            .to_string()
            .contains("step-time rate 3 is not one of the rate scales (0.5,1,2)"));
        let mut o = options(None);
        o.rates = vec![2.0, 1.0];
        assert!(matches!(run_sweep(&o, fake), Err(SweepError::Options(_))));
        o.rates = vec![f64::NAN];
        assert!(matches!(run_sweep(&o, fake), Err(SweepError::Grid(_))));
        o.rates = vec![];
        assert!(matches!(run_sweep(&o, fake), Err(SweepError::Options(_))));
        let mut o = options(None);
        o.rates = vec![0.5, 2.0, 4.0];
        assert_eq!(run_sweep(&o, fake).unwrap().step_time_rate, 2.0);
    }

    #[test]
    fn a_stopped_sweep_keeps_the_finished_cells_and_names_the_rest() {
        let stop = Arc::new(AtomicI32::new(0));
        let mut o = options(Some(Slo::new(Some(60.0), None).unwrap()));
        o.jobs = 1;
        o.stop = Some(stop.clone());
        let calls = AtomicUsize::new(0);
        // The fourth replay is stopped midway by SIGTERM and reports itself failed.
        let s = run_sweep(&o, |b, r| {
            if calls.fetch_add(1, Ordering::SeqCst) == 3 {
                stop.store(15, Ordering::SeqCst);
                return Err("interrupted".to_owned());
            }
            fake(b, r)
        })
        .unwrap();
        assert_eq!(s.interrupted.as_deref(), Some("SIGTERM"));
        assert_eq!(s.cells.len(), 3);
        assert!(s.cells.iter().all(|c| c.budget.get() == Some(512)));
        assert_eq!(s.not_run.len(), 6);
        assert_eq!(
            (s.not_run[0].budget.get(), s.not_run[0].rate_scale),
            (Some(2048), 0.5)
        );
        // No capacity search starts after the signal.
        assert!(s.capacity.is_empty());
        assert_eq!(calls.load(Ordering::SeqCst), 4);
        // A failure without a signal is still a failure.
        o.stop = Some(Arc::new(AtomicI32::new(0)));
        assert!(matches!(
            run_sweep(&o, |_, _| Err::<RunSummary, _>("broken".to_owned())),
            Err(SweepError::Run { .. })
        ));
    }

    #[test]
    fn step_times_keep_nearest_rank_percentiles() {
        let mut v: Vec<f64> = (1..=1000).rev().map(f64::from).collect();
        v.push(f64::NAN);
        let s = StepTimes::from_samples(&mut v);
        assert_eq!(s.percentiles_ms.len(), 101);
        assert_eq!(
            (
                s.percentile(0),
                s.percentile(50),
                s.percentile(99),
                s.percentile(100)
            ),
            (Some(1.0), Some(500.0), Some(990.0), Some(1000.0))
        );
        assert_eq!(
            StepTimes::from_samples(&mut Vec::new()).percentile(50),
            None
        );
        assert_eq!(nearest_rank(&[], 0.5), None);
        assert_eq!(nearest_rank(&[3.0], f64::NAN), None);
    }
}
