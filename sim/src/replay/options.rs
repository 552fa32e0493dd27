//! What one replay runs and writes ([`ReplayOptions`], the CLI's `replay` flags), and the
//! handles a caller steers it by: a shared [`StopFlag`] and a per-step [`StepHook`].

use std::path::PathBuf;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Arc;

use super::arrivals::Arrivals;
use super::priority::PriorityBy;
use super::trace::TraceFormat;
use mstar_chunking::budget::BudgetValue;

/// What to replay and what to write; the CLI's `replay` flags.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplayOptions {
    /// The trace (`.csv` Azure, `.jsonl` Mooncake); `None`: the bundled trace.
    pub trace: Option<PathBuf>,
    /// Replay only the first N requests.
    pub requests: Option<usize>,
    /// Arrivals `rate_scale` times as dense as the trace's (2.0: "what if traffic doubled?").
    pub rate_scale: f64,
    /// Turn every budget off, to compare with chunking.
    pub budget_off: bool,
    /// `--budget N|off`: the token budget of the replayed node's step walks, over the config's
    /// (after `budget_off`).
    pub budget: Option<BudgetValue>,
    /// `--format`: the trace's format, instead of what its header or extension says.
    pub format: Option<TraceFormat>,
    /// `--arrivals`: generated arrival times for a length-only trace (seeded from
    /// `[replay] speculation.seed`).
    pub arrivals: Option<Arrivals>,
    /// Write the step log here.
    pub step_log: Option<PathBuf>,
    /// Write the report as JSON here.
    pub report_json: Option<PathBuf>,
    /// Count and leave out bad trace lines instead of failing.
    pub skip_bad_lines: bool,
    /// `--priority-by`: each request's priority by this rule, over the trace's `priority`.
    pub priority_by: Option<PriorityBy>,
    /// Show a progress bar (only when stderr is a terminal).
    pub progress: bool,
    /// The config layers the settings were read from, in order, as the report lists them
    /// (empty: not listed).
    pub config_layers: Vec<String>,
    /// Input files besides the trace (config layers, the model) that the outputs must not
    /// overwrite.
    pub inputs: Vec<PathBuf>,
    /// Stop at a step boundary on SIGINT or SIGTERM and report what ran, marked interrupted.
    pub handle_signals: bool,
    /// Called after every step with the number of steps run so far.
    pub on_step: Option<StepHook>,
    /// Stop at a step boundary once this holds a signal number (a sweep's workers share one
    /// that its own signal watch sets); with `handle_signals`, the signals set it too.
    pub stop: Option<StopFlag>,
}

/// A flag shared by replays that are to stop together: 0 while running, else the number of the
/// signal that stopped them (see `signal_name`).
#[derive(Debug, Clone, Default)]
pub struct StopFlag(pub Arc<AtomicI32>);

impl StopFlag {
    /// The signal that set the flag, if any.
    pub fn signal(&self) -> Option<i32> {
        match self.0.load(Ordering::SeqCst) {
            0 => None,
            n => Some(n),
        }
    }
}

impl PartialEq for StopFlag {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

/// A callback after every replay step, given the steps run so far (tests drive faults from it).
#[derive(Clone)]
pub struct StepHook(pub Arc<dyn Fn(u64) + Send + Sync>);

impl StepHook {
    /// Calls the hook.
    pub fn call(&self, steps: u64) {
        (self.0)(steps);
    }
}

impl std::fmt::Debug for StepHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StepHook")
    }
}

impl PartialEq for StepHook {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Default for ReplayOptions {
    fn default() -> Self {
        Self {
            trace: None,
            requests: None,
            rate_scale: 1.0,
            budget_off: false,
            budget: None,
            format: None,
            arrivals: None,
            step_log: None,
            report_json: None,
            skip_bad_lines: false,
            priority_by: None,
            progress: false,
            config_layers: Vec::new(),
            inputs: Vec::new(),
            handle_signals: false,
            on_step: None,
            stop: None,
        }
    }
}
