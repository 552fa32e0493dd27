//! Replay (`docs/config-replay.md`): drives the real chunking actors through a request trace as
//! an engine would, on a simulated clock, and reports what the chunking config does to budgets,
//! overruns and latency.
//!
//! - [`trace`]: the Azure CSV and Mooncake JSON Lines readers, and the bundled trace;
//! - `sim`: the simulation loop: arrivals, steps, decode rows, speculation, prefix cache;
//! - `prefix_cache`: the LRU of prompt blocks keyed by a trace's block hashes;
//! - [`fleet`], [`router`], [`fleet_report`]: several workers behind a router on one clock
//!   (`replay.fleet`), the router's rules, and the fleet's part of the report; [`disagg`]: a
//!   prefill pool and a decode pool with the KV transfer between them;
//! - [`priority`]: `--priority-by`, and the TTFT/TBT per priority class;
//! - [`settings`]: the `[replay]` section, checked once for `check` and `replay`;
//! - `step_log`: the `--step-log` JSON Lines writer, and outputs written by rename;
//! - [`report`]: the summary table and the `--report-json` document;
//! - `options`, `error`, `checks`, `budgets`, `run`, `signals`: what one replay is asked
//!   ([`ReplayOptions`]), how it fails ([`ReplayError`]), what it refuses before running, the
//!   budgets it applies, the run itself ([`run`]), and stopping it on a signal.
//!
//! [`run`] must be awaited inside an actix system: it starts its own [`mstar_chunking::ChunkingManagement`] on
//! the current arbiter.

pub mod arrivals;
mod budgets;
mod checks;
pub mod disagg;
mod error;
pub mod fleet;
#[cfg(test)]
mod fleet_equivalence;
pub mod fleet_report;
pub(crate) mod kv;
mod options;
pub mod percentiles;
pub(crate) mod prefix_cache;
pub mod priority;
pub mod report;
pub mod router;
mod run;
pub mod settings;
mod signals;
pub(crate) mod sim;
pub(crate) mod step_log;
pub mod topology;
pub mod trace;

pub use budgets::{
    budget_flag_overrides, budget_off_overrides, budget_refusal, replay_budgets,
    time_budget_objective_warnings,
};
pub use checks::{check_clock, check_kv_fits, MAX_SIMULATED_MS};
pub use error::ReplayError;
pub use options::{ReplayOptions, StepHook, StopFlag};
pub use priority::PriorityBy;
pub use report::ReplayReport;
pub use report::{RunSettings, StepDurations};
pub use router::RouterKind;
pub use run::{load_trace, run, run_on, run_trace, trace_warnings};
pub use settings::{KvSetup, ReplaySetup};
pub use signals::signal_exit_code;
pub(crate) use signals::{catch_signals, signal_name, test_signal_at};
pub use topology::FleetSetup;
pub use trace::{BadLine, Trace, TraceError, TraceFormat};

/// The walk prompts are admitted on.
pub const PREFILL_WALK: &str = "prefill";
/// The walk generated tokens run on, as continuing rows.
pub const DECODE_WALK: &str = "decode";
