//! Sweeps (see `docs/sweep.md`): replays over a grid of token budgets × rate scales, the
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
//! - [`verdict`]: with time budgets among the settings (`--budgets 512,95ms`), the best token budget
//!   against the best time budget per trace, and each setting's worst fraction of the best
//!   across traces (`--traces`).

use std::path::PathBuf;
use std::sync::atomic::AtomicI32;
use std::sync::Arc;

use serde::Serialize;

pub mod axis;
pub mod capacity;
pub(crate) mod cells;
pub mod charts;
pub mod fleet_axis;
mod forms;
pub mod grid;
pub mod html;
pub mod jobs;
pub mod kv_axis;
pub mod order_axis;
pub mod output;
pub mod pd_axis;
pub mod plots;
mod raster;
pub mod run;
mod runner;
mod summary;
pub(crate) mod tables;
pub mod verdict;

pub use capacity::{Bound, NonMonotone, Probe, Search, Slo};
pub use grid::{parse_budgets, parse_rates, Budget, GridError, StepMs};
pub use output::{write_outputs, Written};
pub use runner::run_sweep;
pub use summary::{nearest_rank, RunSummary, StepTimes, STEP_QUANTILES};

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
    /// The trace's own request rate, requests per second (arrivals at rate scale 1), so that
    /// rate scales and capacities can also be given in requests per second; `None` when the
    /// trace has no span of time (fewer than two arrival times).
    pub trace_rps: Option<f64>,
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
    #[serde(serialize_with = "crate::text::ser_round")]
    pub rate_scale: f64,
}

/// One replay of the grid.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Cell {
    /// Its budget.
    pub budget: Budget,
    /// Its rate scale.
    #[serde(serialize_with = "crate::text::ser_round")]
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
    /// The capacity in requests per second (the rate scale times the trace's own rate).
    #[serde(rename = "capacity_rps", serialize_with = "crate::text::ser_opt_round")]
    pub rps: Option<f64>,
    /// The search's answer and probes.
    #[serde(flatten)]
    pub search: Search,
}

impl Capacity {
    /// The capacity of `budget` that `search` found, in requests per second too when the
    /// trace's own rate is known.
    pub fn new(budget: Budget, search: Search, trace_rps: Option<f64>) -> Self {
        let rps = search.rate_scale.zip(trace_rps).map(|(r, t)| r * t);
        Self {
            budget,
            rps,
            search,
        }
    }

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
    #[serde(serialize_with = "crate::text::ser_vec_round")]
    pub rates: Vec<f64>,
    /// The latency objective, if any.
    pub slo: Option<Slo>,
    /// The rate scale whose step-time distributions are plotted.
    #[serde(serialize_with = "crate::text::ser_round")]
    pub step_time_rate: f64,
    /// The trace's own request rate, requests per second (see [`SweepOptions::trace_rps`]).
    #[serde(serialize_with = "crate::text::ser_opt_round")]
    pub trace_rate_rps: Option<f64>,
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

    /// `rate` in requests per second, when the trace's own rate is known.
    pub fn rps(&self, rate: f64) -> Option<f64> {
        self.trace_rate_rps.map(|t| rate * t)
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

#[cfg(test)]
pub(crate) mod tests;
