//! What a replay shows: the summary table and the `--report-json` document
//! (`docs/replay-report.md#the-summary-figure-by-figure`).
//!
//! Floats in the JSON document are rounded to what they mean: simulated and wall milliseconds
//! to 0.001 ms, ratios to 0.0001.

use std::fmt;

use serde::{Serialize, Serializer};

pub use super::percentiles::{round_ms, Latency};
use super::trace::TraceFormat;
use crate::config::problem::escape;
use crate::text::{coefficient, plural};
use crate::text::{ser_opt_round, ser_round};

/// The outcome of a replay. Serialised as is by `--report-json`; `Display` is the summary table.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReplayReport {
    /// The effective settings the replay ran under: version, budgets, cost model, speculation,
    /// prefix cache, trace, arrivals, seed (filled in by `replay::run`).
    pub settings: RunSettings,
    /// The trace file (or the bundled trace's name) and its format.
    pub trace: String,
    /// The trace's format.
    pub format: TraceFormat,
    /// The node replay drove, and the walks its steps ran on (one combined walk, or `prefill`
    /// and `decode` alternately).
    pub node: String,
    /// The step walks.
    pub walks: Vec<String>,
    /// Whether every budget was turned off (`--budget-off`).
    pub budget_off: bool,
    /// Arrivals were this many times as dense as the trace's (as given: not rounded, since
    /// it may be as small as 1e-6).
    pub rate_scale: f64,
    /// Requests replayed, and bad trace lines left out (`--skip-bad-lines`).
    pub requests: usize,
    /// Bad trace lines left out.
    pub skipped_lines: usize,
    /// The first few bad lines left out.
    pub bad_line_examples: Vec<String>,
    /// Steps run (empty steps are not counted), and how many of them ran under a budget.
    pub steps: u64,
    /// Steps that ran under a budget.
    pub budgeted_steps: u64,
    /// Tokens, by kind.
    pub tokens: TokenCounts,
    /// `sum(min(scheduled, budget)) / sum(budget)` over the steps with a budget; null if none.
    #[serde(serialize_with = "ser_opt_ratio")]
    pub budget_utilisation: Option<f64>,
    /// Steps that cut a prompt (ran a non-final chunk), and their utilisation: a cut step
    /// should be full, since a prompt is cut only to what is left of the budget.
    pub cut_steps: u64,
    /// The budget utilisation of the steps that cut a prompt.
    #[serde(serialize_with = "ser_opt_ratio")]
    pub cut_step_utilisation: Option<f64>,
    /// Chunks run.
    pub chunks: ChunkCounts,
    /// Overruns, by reason.
    pub overruns: OverrunCounts,
    /// Steps whose simulated time exceeded their time budget, by reason
    /// (`docs/cost-model.md#time-overruns`).
    pub time_overruns: TimeOverrunCounts,
    /// Whether the step walks' time budget was in force, step by step; `None` when no step
    /// walk has one (`docs/replay-report.md#the-summary-figure-by-figure`).
    pub time_budget: Option<TimeBudgetUse>,
    /// The latency model the component planned with at the end, under the config's key names.
    pub latency_model: LatencyModelReport,
    /// Step slots a decode row (already generating) waited without running: "decode stalls".
    pub decode_row_waits: u64,
    /// Time to first token and time between tokens, in simulated ms; null without samples.
    pub ttft_ms: Option<Latency>,
    /// Time between tokens, in simulated ms: one sample per token a continuing row generated,
    /// kept in a [`StepDurations`] histogram (bounded memory; within 0.1%).
    pub tbt_ms: Option<Latency>,
    /// TTFT and TBT per priority class, by priority; only with two classes or more
    /// (`docs/replay.md#priorities`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub by_priority: Vec<ClassLatency>,
    /// The simulated durations of the steps, kept in a fixed-size histogram (serialised as
    /// their percentiles, like a latency; null without steps).
    pub step_ms: StepDurations,
    /// Warnings about the run (a prefix cache without block hashes to look up).
    pub warnings: Vec<String>,
    /// The most prepared inputs held at once (rows, and their tokens).
    pub peak_prepared_rows: usize,
    /// The tokens of the prepared inputs held at the peak.
    pub peak_prepared_tokens: u64,
    /// Prepared inputs held after the replay, asserted to be none (a replay with any left fails).
    pub prepared_left_rows: usize,
    /// Their tokens.
    pub prepared_left_tokens: u64,
    /// The simulated time the replay covered, from the first arrival to the last step's end.
    #[serde(serialize_with = "ser_round")]
    pub simulated_ms: f64,
    /// Wall time of the replay (trace reading included), and steps per wall second.
    #[serde(serialize_with = "ser_round")]
    pub wall_ms: f64,
    /// Steps per wall-clock second.
    #[serde(serialize_with = "ser_round")]
    pub steps_per_second: f64,
    /// Where the step log went, if one was written.
    pub step_log: Option<String>,
    /// The signal that stopped the replay early (`SIGINT`, `SIGTERM`); `None`: it ran to the end.
    pub interrupted: Option<String>,
    /// The KV memory model's figures (`docs/kv-memory.md`); absent with unlimited memory.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv: Option<KvReport>,
    /// A fleet's settings and spread across its workers (`docs/fleet.md#the-report`); absent
    /// with one worker.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fleet: Option<super::fleet_report::FleetReport>,
}

/// What KV memory did to a replay (`docs/kv-memory.md#what-the-replay-reports`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct KvReport {
    /// Blocks in the pool.
    pub blocks: u64,
    /// Tokens per block.
    pub block_tokens: u32,
    /// The watermark, as a fraction of the blocks.
    pub watermark: f64,
    /// The watermark, in blocks: admission keeps them free.
    pub watermark_blocks: u64,
    /// Where the blocks came from (`7609 blocks`, `preset llama2-7b-a100`, a memory budget).
    pub source: String,
    /// The most blocks in use at once (requests' and prefix cache's).
    pub peak_blocks: u64,
    /// `peak_blocks / blocks`.
    #[serde(serialize_with = "ser_ratio")]
    pub peak_utilisation: f64,
    /// The mean over the steps of the blocks in use, over `blocks`.
    #[serde(serialize_with = "ser_opt_ratio")]
    pub mean_utilisation: Option<f64>,
    /// Preemptions by recompute.
    pub preemptions: u64,
    /// Requests preempted at least once.
    pub preempted_requests: usize,
    /// The tokens preemptions threw away from KV caches (run again by the recomputes).
    pub recomputed_tokens: u64,
    /// Admitted prompts whose first chunk did not fit when planned, sent back to wait.
    pub withdrawn_admissions: u64,
    /// Prefix-cache blocks evicted to make room.
    pub cache_evictions: u64,
    /// The time requests spent waiting for memory, summed over admissions, simulated ms.
    #[serde(serialize_with = "ser_round")]
    pub memory_wait_total_ms: f64,
    /// Admissions that waited for memory at all.
    pub admissions_waited: usize,
    /// The wait of each admission (from arrival, or preemption, to admission), simulated ms.
    pub memory_wait_ms: Option<Latency>,
}

fn ser_ratio<S: Serializer>(x: &f64, s: S) -> Result<S::Ok, S::Error> {
    ser_opt_ratio(&Some(*x), s)
}

/// Tokens, by kind.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct TokenCounts {
    /// Scheduled by the planner, and actually run (more with speculation overshoots).
    pub scheduled: u64,
    /// Tokens actually run.
    pub ran: u64,
    /// Prompt tokens run in chunks, and prompt tokens served from the prefix cache instead.
    pub prefill: u64,
    /// Prompt tokens served from the prefix cache.
    pub cached: u64,
    /// Tokens run by continuing (decode) rows, and the tokens they generated.
    pub decode: u64,
    /// Tokens generated.
    pub generated: u64,
}

/// Chunks run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct ChunkCounts {
    /// Chunks, of which final.
    pub total: u64,
    /// Final chunks: one per prompt that finished its prefill.
    pub final_chunks: u64,
    /// Prompts that ran in more than one chunk.
    pub prompts_cut: u64,
    /// Prompts that started with a prefix-cache hit.
    pub prefix_cache_hits: u64,
}

/// Overruns by reason.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct OverrunCounts {
    /// Every overrun.
    pub total: u64,
    /// A row that could not be cut ran whole.
    pub uncut_row: u64,
    /// Speculative rows ran more than their estimate.
    pub speculation_estimate: u64,
    /// Any other reason.
    pub other: u64,
}

/// Time overruns, by reason (`docs/cost-model.md#time-overruns`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct TimeOverrunCounts {
    /// Every time overrun.
    pub total: u64,
    /// The first prefill row ran a chunk of the floor over the time budget.
    pub floor: u64,
    /// A row that cannot be cut ran whole over the time budget.
    pub uncut_row: u64,
    /// The continuing rows alone were predicted over the time budget.
    pub continuing: u64,
    /// The step was predicted to fit and took longer.
    pub misprediction: u64,
}

impl TimeOverrunCounts {
    /// Counts one time overrun.
    pub fn count(&mut self, reason: mstar_chunking::overrun::TimeOverrunReason) {
        use mstar_chunking::overrun::TimeOverrunReason as R;
        self.total += 1;
        match reason {
            R::Floor => self.floor += 1,
            R::UncutRow => self.uncut_row += 1,
            R::Continuing => self.continuing += 1,
            R::Misprediction => self.misprediction += 1,
        }
    }
}

/// How many steps of a walk with a time budget ran under it: a step is planned under its time
/// budget only while the component has a latency model (configured, or learned and trusted).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct TimeBudgetUse {
    /// Steps on a walk with a time budget.
    pub steps: u64,
    /// Those planned without it: no trusted latency model yet.
    pub inactive_steps: u64,
    /// Why it was inactive, when it was for any step.
    pub inactive_reason: Option<String>,
}

impl fmt::Display for TimeBudgetUse {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.inactive_reason {
            Some(why) if self.inactive_steps > 0 => write!(
                f,
                "inactive for {} of {}: {why}",
                self.inactive_steps,
                plural(self.steps, "step")
            ),
            _ => write!(f, "in force for every step ({})", self.steps),
        }
    }
}

/// The latency model in use: its source and coefficients, named as in `chunking.cost.<node>`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct LatencyModelReport {
    /// `online`, `config` or `none`.
    pub source: mstar_chunking::latency::ModelSource,
    /// Milliseconds every step costs (null without a model).
    pub base_ms: Option<f64>,
    /// Milliseconds a token adds.
    pub per_token_ms: Option<f64>,
    /// Milliseconds a continuing row's context token adds.
    pub per_kv_token_ms: Option<f64>,
    /// Milliseconds a causal attention pair adds.
    pub per_attention_pair_ms: Option<f64>,
    /// Milliseconds a row adds; left out when 0 or without a model.
    #[serde(skip_serializing_if = "no_per_row")]
    pub per_row_ms: Option<f64>,
}

fn no_per_row(v: &Option<f64>) -> bool {
    v.is_none_or(|v| v == 0.0)
}

fn is_zero(v: &f64) -> bool {
    *v == 0.0
}

impl Default for LatencyModelReport {
    fn default() -> Self {
        Self::from((None, mstar_chunking::latency::ModelSource::None))
    }
}

impl
    From<(
        Option<mstar_chunking::latency::LatencyModel>,
        mstar_chunking::latency::ModelSource,
    )> for LatencyModelReport
{
    fn from(
        (model, source): (
            Option<mstar_chunking::latency::LatencyModel>,
            mstar_chunking::latency::ModelSource,
        ),
    ) -> Self {
        let c = model.map(|m| m.coefficients());
        Self {
            source,
            base_ms: c.map(|c| c[0]),
            per_token_ms: c.map(|c| c[1]),
            per_kv_token_ms: c.map(|c| c[2]),
            per_attention_pair_ms: c.map(|c| c[3]),
            per_row_ms: model.map(|m| m.per_row_ms()),
        }
    }
}

fn ser_opt_ratio<S: Serializer>(x: &Option<f64>, s: S) -> Result<S::Ok, S::Error> {
    match x {
        Some(x) if x.is_finite() => s.serialize_f64((x * 10_000.0).round() / 10_000.0),
        _ => s.serialize_none(),
    }
}

/// The latency of one priority class (the summary's and report's `by_priority`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ClassLatency {
    /// The priority.
    pub priority: i32,
    /// Requests of the class.
    pub requests: usize,
    /// Their time to first token, simulated ms.
    pub ttft_ms: Option<Latency>,
    /// Their time between tokens, simulated ms.
    pub tbt_ms: Option<Latency>,
}

/// The effective settings a replay ran under, shown at the head of the summary and recorded in
/// the JSON report, so that two runs can be told apart (`docs/replay-report.md#labelled-runs`).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct RunSettings {
    /// The crate version that ran the replay.
    pub version: String,
    /// The node replayed.
    pub node: String,
    /// The walks its steps ran on.
    pub step_walks: Vec<String>,
    /// The node's effective budgets, one row per walk that has one (or whose policy has one).
    pub budgets: Vec<WalkBudget>,
    /// What `--budget` or `--budget-off` set, if either was given (`"2048"`, `"off"`).
    pub budget_flag: Option<String>,
    /// The step cost model (`[replay] cost`).
    pub cost: CostLabel,
    /// What the planner ran under besides the budgets (`[chunking]`): the floor, the row
    /// caps, its latency model, online learning and the time margin.
    pub planner: PlannerLabel,
    /// The config layers read, in order (as `check` lists them), the command-line flags last.
    pub config_layers: Vec<String>,
    /// Speculative tokens per decode row (0: off) and the overshoot probability.
    pub speculation_tokens: u32,
    /// The probability a speculating row runs more than its estimate.
    pub overshoot_rate: f64,
    /// Prefix cache blocks (0: off) and tokens per block.
    pub prefix_cache_blocks: usize,
    /// Tokens per prefix cache block.
    pub prefix_cache_block_tokens: u32,
    /// The seed of every random draw (speculation overshoots, generated arrivals).
    pub seed: u64,
    /// The trace file, or the bundled trace's name.
    pub trace: String,
    /// Its format, as `--format` names it (`azure`, `mooncake`, `generic`, `lengths`).
    pub format: String,
    /// Generated arrivals (`poisson:4`), for a length-only trace.
    pub arrivals: Option<String>,
    /// Requests replayed.
    pub requests: usize,
    /// The rate scale, as given.
    pub rate_scale: f64,
}

/// One walk's budgets on the replayed node.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WalkBudget {
    /// The walk.
    pub walk: String,
    /// The model's policy budget, if it declares one.
    pub policy_budget: Option<u32>,
    /// The effective token budget (`None`: off or none).
    pub max_batch_tokens: Option<u32>,
    /// The effective time budget, ms (`chunking.max_step_ms`; `None`: none).
    #[serde(serialize_with = "ser_opt_round")]
    pub max_step_ms: Option<f64>,
}

/// The simulated step cost a replay ran under (`docs/cost-model.md`), under the config's key
/// names.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct CostLabel {
    /// The preset it came from, if any.
    pub preset: Option<String>,
    /// Milliseconds every step costs.
    pub base_ms: f64,
    /// Milliseconds each token of a step adds.
    pub per_token_ms: f64,
    /// Milliseconds each context token a continuing row reads adds.
    pub per_kv_token_ms: f64,
    /// Milliseconds each causal attention pair adds.
    pub per_attention_pair_ms: f64,
    /// Milliseconds each row adds (left out when 0).
    #[serde(skip_serializing_if = "is_zero")]
    pub per_row_ms: f64,
    /// The noise fraction on each step's time.
    pub noise: f64,
    /// The measured ÷ predicted ratios each step's time was drawn from, by band, when given.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub noise_bands: Option<Vec<crate::config::NoiseBand>>,
    /// Whether the component learned the model online.
    pub learn: bool,
}

impl CostLabel {
    /// The cost of a replay's setup.
    pub fn of(setup: &super::ReplaySetup) -> Self {
        let [base_ms, per_token_ms, per_kv_token_ms, per_attention_pair_ms] =
            setup.cost.coefficients();
        Self {
            preset: setup.cost_preset.clone(),
            base_ms,
            per_token_ms,
            per_kv_token_ms,
            per_attention_pair_ms,
            per_row_ms: setup.cost.per_row_ms(),
            noise: setup.noise,
            noise_bands: setup.noise_bands.as_deref().map(<[_]>::to_vec),
            learn: setup.learn,
        }
    }
}

impl CostLabel {
    /// Whether this is the built-in demo cost (`DEFAULT_COST`, no preset, no per-row term),
    /// whatever its noise and learning.
    pub fn is_demo(&self) -> bool {
        self.preset.is_none()
            && [
                self.base_ms,
                self.per_token_ms,
                self.per_kv_token_ms,
                self.per_attention_pair_ms,
            ] == super::settings::DEFAULT_COST
            && self.per_row_ms == 0.0
    }

    /// The label, with a note beside the demo cost that it was measured on no GPU and where
    /// real ones come from: the summary's `cost model` row.
    pub fn with_demo_note(&self) -> String {
        if self.is_demo() {
            format!("{self} ({DEMO_COST_NOTE})")
        } else {
            self.to_string()
        }
    }
}

/// What the summary says beside the demo cost.
pub const DEMO_COST_NOTE: &str = "a demo cost, not measured on any GPU: `--sim-cost llama2-7b-a100` or `llama2-7b-h100` for a preset, `mstar-chunking fit` for your engine's; docs/cost-model.md";

impl fmt::Display for CostLabel {
    /// `8 ms + 0.02 ms per token`, with the KV and attention terms, the preset, the noise and
    /// online learning when they apply; coefficients as `text::coefficient` prints them.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} ms + {} ms per token",
            coefficient(self.base_ms),
            coefficient(self.per_token_ms)
        )?;
        if self.per_kv_token_ms > 0.0 {
            write!(
                f,
                " + {} ms per context token",
                coefficient(self.per_kv_token_ms)
            )?;
        }
        if self.per_attention_pair_ms > 0.0 {
            write!(
                f,
                " + {} ms per attention pair",
                coefficient(self.per_attention_pair_ms)
            )?;
        }
        if self.per_row_ms > 0.0 {
            write!(f, " + {} ms per row", coefficient(self.per_row_ms))?;
        }
        if let Some(p) = &self.preset {
            write!(f, " ({p})")?;
        }
        if self.noise > 0.0 {
            write!(f, ", noise ±{}%", self.noise * 100.0)?;
        }
        if let Some(bands) = &self.noise_bands {
            write!(
                f,
                ", noise drawn from measured ratios ({})",
                crate::text::plural(bands.len() as u64, "band")
            )?;
        }
        if self.learn {
            f.write_str(", learned online")?;
        }
        Ok(())
    }
}

/// The planner's settings besides the budgets, for the replayed node (`[chunking]`): each
/// changes what the steps hold, so each is in a run's label.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct PlannerLabel {
    /// `chunking.min_chunk_tokens`: the floor a prompt is cut to.
    pub min_chunk_tokens: u32,
    /// `chunking.max_row_tokens` (`None`: no cap).
    pub max_row_tokens: Option<u32>,
    /// `chunking.max_partial_prefills` (`None`: no limit).
    pub max_partial_prefills: Option<u32>,
    /// `chunking.cost.<node>`: the latency model given to the planner (`None`: none given).
    pub cost: Option<[f64; 4]>,
    /// Its `per_row_ms`, left out when 0 or without a model.
    #[serde(skip_serializing_if = "no_per_row")]
    pub cost_per_row_ms: Option<f64>,
    /// `chunking.learn_cost`: the planner fits its latency model online.
    pub learn_cost: bool,
    /// `chunking.time_margin`: the quantile of measured ÷ predicted step times timed steps are
    /// planned with (`None`: no margin).
    pub time_margin: Option<f64>,
    /// `chunking.time_floor`, only when it is not the default `yield` (so labels and reports
    /// of default runs read as before).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub time_floor: Option<String>,
    /// `chunking.order` for the node (`fcfs`, `priority`, `shortest_first`, `longest_prefix`).
    pub order: String,
    /// `chunking.max_wait_ms`: the starvation bound in ms (`None`: none).
    pub max_wait_ms: Option<f64>,
    /// `chunking.max_wait_steps`: the starvation bound in planned steps (`None`: none).
    pub max_wait_steps: Option<u64>,
    /// `--priority-by`: the rule that gave requests their priority (`None`: the trace's own, or
    /// none).
    pub priority_by: Option<String>,
}

impl PlannerLabel {
    /// The label of the settings `set_budgets` was given, for `node`.
    pub fn of(budgets: &mstar_chunking::budget::BudgetSettings, node: &str) -> Self {
        Self {
            min_chunk_tokens: budgets.min_chunk_tokens,
            max_row_tokens: budgets.max_row_tokens,
            max_partial_prefills: budgets.max_partial_prefills,
            cost: budgets.time.cost.get(node).map(|m| m.coefficients()),
            cost_per_row_ms: budgets.time.cost.get(node).map(|m| m.per_row_ms()),
            learn_cost: budgets.time.learn,
            time_margin: budgets.time.margin_quantile,
            time_floor: (budgets.time.floor != mstar_chunking::budget::TimeFloor::default())
                .then(|| budgets.time.floor.as_str().to_owned()),
            order: budgets.order.of(node).order.as_str().to_owned(),
            max_wait_ms: budgets.order.bound.max_wait_ms,
            max_wait_steps: budgets.order.bound.max_wait_steps,
            priority_by: None,
        }
    }
}

impl fmt::Display for PlannerLabel {
    /// `floor 64, row cap none, partial prefills no limit; latency model none; time margin
    /// none`, with the coefficients as `text::coefficient` prints them.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "floor {}, row cap ", self.min_chunk_tokens)?;
        match self.max_row_tokens {
            Some(n) => write!(f, "{n}")?,
            None => f.write_str("none")?,
        }
        f.write_str(", partial prefills ")?;
        match self.max_partial_prefills {
            Some(n) => write!(f, "at most {n}")?,
            None => f.write_str("no limit")?,
        }
        f.write_str("; latency model ")?;
        match (self.cost, self.learn_cost) {
            (Some(c), learn) => write!(
                f,
                "{} ms + {} ms per token + {} ms per context token + {} ms per attention pair{}{}",
                coefficient(c[0]),
                coefficient(c[1]),
                coefficient(c[2]),
                coefficient(c[3]),
                match self.cost_per_row_ms {
                    Some(r) if r > 0.0 => format!(" + {} ms per row", coefficient(r)),
                    _ => String::new(),
                },
                if learn { ", then learned online" } else { "" }
            )?,
            (None, true) => f.write_str("learned online")?,
            (None, false) => f.write_str("none")?,
        }
        match self.time_margin {
            Some(q) => write!(f, "; time margin q{q}")?,
            None => f.write_str("; time margin none")?,
        }
        if let Some(floor) = &self.time_floor {
            write!(f, "; time floor {floor}")?;
        }
        // The order and what feeds it only where they are not the default (first come, first
        // served, no bound), so a default run's label reads as it always has.
        if !self.order.is_empty() && self.order != mstar_chunking::order::Order::Fcfs.as_str() {
            write!(f, "; order {}", self.order)?;
        }
        if let Some(ms) = self.max_wait_ms {
            write!(f, "; max wait {} ms", coefficient(ms))?;
        }
        if let Some(n) = self.max_wait_steps {
            write!(f, "; max wait {n} steps")?;
        }
        if let Some(rule) = &self.priority_by {
            write!(f, "; priority by {rule}")?;
        }
        Ok(())
    }
}

impl RunSettings {
    /// The budget table as text: `mixed 2048 (policy 2048), prefill off (policy 2048)`, time
    /// budgets after a `;`.
    pub fn budget_text(&self) -> String {
        let opt = |v: Option<u32>| v.map_or_else(|| "off".to_string(), |v| v.to_string());
        let tokens: Vec<String> = self
            .budgets
            .iter()
            .map(|b| {
                let policy = b
                    .policy_budget
                    .map_or_else(|| "none".to_string(), |p| p.to_string());
                format!(
                    "{} {} (policy {policy})",
                    escape(&b.walk),
                    opt(b.max_batch_tokens)
                )
            })
            .collect();
        let times: Vec<String> = self
            .budgets
            .iter()
            .filter_map(|b| Some(format!("{} {} ms", escape(&b.walk), b.max_step_ms?)))
            .collect();
        let tokens = if tokens.is_empty() {
            "none".to_string()
        } else {
            tokens.join(", ")
        };
        let times = if times.is_empty() {
            "none".to_string()
        } else {
            times.join(", ")
        };
        let flag = self
            .budget_flag
            .as_ref()
            .map_or_else(String::new, |f| format!(" [--budget {f}]"));
        format!("{tokens}{flag}; time budgets {times}")
    }
}

/// The lowest exact bucket count: durations below 2.048 ms are kept to the microsecond.
const EXACT_US: u64 = 2048;
/// Buckets per doubling above [`EXACT_US`]: a relative error below 0.1%.
const SUB_BUCKETS: u64 = 1024;
/// Durations are clamped to 2^42 µs (about 51 days), so the histogram has at most
/// 2048 + 31 × 1024 buckets (279 KB).
const MAX_US: u64 = (1 << 42) - 1;

/// Durations (step times, and times between tokens) in a fixed-size log-linear histogram:
/// memory stays bounded whatever the number of samples, percentiles are exact to the µs below
/// 2.048 ms and within 0.1% above (a bucket's middle), and the minimum and maximum are exact.
/// Serialised as a [`Latency`] (null without samples).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepDurations {
    counts: Vec<u64>,
    n: u64,
    min: f64,
    max: f64,
}

impl StepDurations {
    fn index(us: u64) -> usize {
        if us < EXACT_US {
            return us as usize;
        }
        let e = 63 - u64::from(us.leading_zeros());
        let shift = e - 10;
        let sub = (us >> shift) - SUB_BUCKETS;
        (EXACT_US + (e - 11) * SUB_BUCKETS + sub) as usize
    }

    /// The middle of bucket `i`, in µs.
    fn value(i: usize) -> f64 {
        let i = i as u64;
        if i < EXACT_US {
            return i as f64;
        }
        let e = (i - EXACT_US) / SUB_BUCKETS + 11;
        let sub = (i - EXACT_US) % SUB_BUCKETS;
        let shift = e - 10;
        let lo = (SUB_BUCKETS + sub) << shift;
        lo as f64 + ((1u64 << shift) as f64 - 1.0) / 2.0
    }

    /// Records one step of `ms` simulated milliseconds (a non-finite or negative one as 0).
    pub fn record(&mut self, ms: f64) {
        let ms = if ms.is_finite() && ms > 0.0 { ms } else { 0.0 };
        let us = ((ms * 1000.0).round() as u64).min(MAX_US);
        let i = Self::index(us);
        if self.counts.len() <= i {
            self.counts.resize(i + 1, 0);
        }
        self.counts[i] += 1;
        if self.n == 0 {
            self.min = ms;
            self.max = ms;
        } else {
            self.min = self.min.min(ms);
            self.max = self.max.max(ms);
        }
        self.n += 1;
    }

    /// Adds every duration `other` recorded, as if recorded here.
    pub fn absorb(&mut self, other: &StepDurations) {
        if other.n == 0 {
            return;
        }
        if self.counts.len() < other.counts.len() {
            self.counts.resize(other.counts.len(), 0);
        }
        for (c, o) in self.counts.iter_mut().zip(&other.counts) {
            *c += o;
        }
        if self.n == 0 {
            self.min = other.min;
            self.max = other.max;
        } else {
            self.min = self.min.min(other.min);
            self.max = self.max.max(other.max);
        }
        self.n += other.n;
    }

    /// Steps recorded.
    pub fn len(&self) -> u64 {
        self.n
    }

    /// Whether no step was recorded.
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// The nearest-rank quantile `p` (in `[0, 1]`) in ms; `None` without steps. `p = 0` is the
    /// minimum and `p = 1` the maximum, both exact.
    pub fn quantile(&self, p: f64) -> Option<f64> {
        if self.n == 0 || !p.is_finite() {
            return None;
        }
        let k = ((p.clamp(0.0, 1.0) * self.n as f64).ceil() as u64).clamp(1, self.n);
        // The first and last ranks are the exact minimum and maximum.
        if k == self.n {
            return Some(self.max);
        }
        if k == 1 {
            return Some(self.min);
        }
        let mut seen = 0u64;
        for (i, c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= k {
                return Some((Self::value(i) / 1000.0).clamp(self.min, self.max));
            }
        }
        Some(self.max)
    }

    /// p50, p90, p99 and the maximum, as a latency; `None` without steps.
    pub fn latency(&self) -> Option<Latency> {
        Some(Latency {
            p50: self.quantile(0.50)?,
            p90: self.quantile(0.90)?,
            p99: self.quantile(0.99)?,
            max: self.max,
            samples: usize::try_from(self.n).unwrap_or(usize::MAX),
        })
    }
}

impl Serialize for StepDurations {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.latency().serialize(s)
    }
}

fn latency(l: &Option<Latency>) -> String {
    match l {
        Some(l) => format!(
            "{:.1} / {:.1} / {:.1} ms (max {:.1}, {})",
            l.p50,
            l.p90,
            l.p99,
            l.max,
            plural(l.samples as u64, "sample")
        ),
        None => "none".into(),
    }
}

fn pct(part: u64, whole: u64) -> String {
    if whole == 0 {
        return "0%".into();
    }
    format!("{:.1}%", part as f64 * 100.0 / whole as f64)
}

impl fmt::Display for ReplayReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let row = |f: &mut fmt::Formatter<'_>, k: &str, v: String| writeln!(f, "  {k:<24} {v}");
        writeln!(
            f,
            "replay of {} ({}) on node `{}`, walk{} {}{}",
            escape(&self.trace),
            self.format,
            escape(&self.node),
            if self.walks.len() > 1 { "s" } else { "" },
            self.walks
                .iter()
                .map(|w| format!("`{}`", escape(w)))
                .collect::<Vec<_>>()
                .join(" / "),
            if self.budget_off { ", budgets off" } else { "" },
        )?;
        let st = &self.settings;
        if !st.version.is_empty() {
            row(
                f,
                "settings",
                format!(
                    "mstar-chunking {}, format {}{}, seed {}",
                    st.version,
                    st.format,
                    st.arrivals
                        .as_ref()
                        .map_or_else(String::new, |a| format!(", arrivals {a}")),
                    st.seed
                ),
            )?;
            if !st.config_layers.is_empty() {
                row(
                    f,
                    "config layers",
                    crate::config::problem::escape_join(&st.config_layers, " -> "),
                )?;
            }
            row(f, "budgets", st.budget_text())?;
            row(f, "planner", st.planner.to_string())?;
            row(f, "cost model", st.cost.with_demo_note())?;
            row(
                f,
                "speculation",
                if st.speculation_tokens == 0 {
                    "off".into()
                } else {
                    format!(
                        "{}, overshoot rate {}",
                        plural(u64::from(st.speculation_tokens), "token"),
                        st.overshoot_rate
                    )
                },
            )?;
            row(
                f,
                "prefix cache",
                if st.prefix_cache_blocks == 0 {
                    "off".into()
                } else {
                    format!(
                        "{} of {}",
                        plural(st.prefix_cache_blocks as u64, "block"),
                        plural(u64::from(st.prefix_cache_block_tokens), "token")
                    )
                },
            )?;
        }
        if let Some(fleet) = &self.fleet {
            row(f, "fleet", fleet.label())?;
        }
        let skipped = if self.skipped_lines > 0 {
            format!(
                " ({} skipped)",
                plural(self.skipped_lines as u64, "bad line")
            )
        } else {
            String::new()
        };
        row(
            f,
            "requests",
            format!("{}{skipped}, rate scale {}", self.requests, self.rate_scale),
        )?;
        row(
            f,
            "steps",
            format!("{} ({} under a budget)", self.steps, self.budgeted_steps),
        )?;
        row(f, "step time p50/p90/p99", latency(&self.step_ms.latency()))?;
        let t = &self.tokens;
        row(
            f,
            "tokens",
            format!(
                "{} ran ({} scheduled): {} prefill, {} decode; {} generated; {} cached",
                t.ran,
                t.scheduled,
                t.prefill,
                t.decode,
                t.generated,
                plural(t.cached, "prompt token")
            ),
        )?;
        row(
            f,
            "budget utilisation",
            match (self.budget_utilisation, self.cut_step_utilisation) {
                (None, _) => "no budgeted step".into(),
                (Some(u), None) => format!("{:.1}% (no step cut a prompt)", u * 100.0),
                (Some(u), Some(c)) => format!(
                    "{:.1}% of all budgeted steps; {:.1}% of the {} that cut a prompt",
                    u * 100.0,
                    c * 100.0,
                    plural(self.cut_steps, "step")
                ),
            },
        )?;
        let c = &self.chunks;
        row(
            f,
            "chunks",
            format!(
                "{} ({} final); {} cut ({}); {}",
                c.total,
                c.final_chunks,
                plural(c.prompts_cut, "prompt"),
                pct(c.prompts_cut, self.requests as u64),
                plural(c.prefix_cache_hits, "prefix-cache hit")
            ),
        )?;
        let o = &self.overruns;
        row(
            f,
            "overruns",
            format!(
                "{} (uncut_row {}, speculation_estimate {}, other {})",
                o.total, o.uncut_row, o.speculation_estimate, o.other
            ),
        )?;
        let t = &self.time_overruns;
        row(
            f,
            "time overruns",
            format!(
                "{} (floor {}, uncut_row {}, continuing {}, misprediction {})",
                t.total, t.floor, t.uncut_row, t.continuing, t.misprediction
            ),
        )?;
        if let Some(t) = &self.time_budget {
            row(f, "time budget", t.to_string())?;
        }
        let m = &self.latency_model;
        row(
            f,
            "latency model",
            match m.base_ms {
                Some(base) => {
                    format!(
                    "{}: base_ms {}, per_token_ms {}, per_kv_token_ms {}, per_attention_pair_ms {}",
                    m.source.as_str(),
                    coefficient(base),
                    coefficient(m.per_token_ms.unwrap_or(0.0)),
                    coefficient(m.per_kv_token_ms.unwrap_or(0.0)),
                    coefficient(m.per_attention_pair_ms.unwrap_or(0.0))
                ) + &match m.per_row_ms {
                        Some(r) if r > 0.0 => format!(", per_row_ms {}", coefficient(r)),
                        _ => String::new(),
                    }
                }
                None => "none".into(),
            },
        )?;
        row(
            f,
            "decode row waits",
            plural(self.decode_row_waits, "row-step"),
        )?;
        if let Some(kv) = &self.kv {
            row(
                f,
                "KV memory",
                format!(
                    "{} of {} ({}), watermark {}",
                    plural(kv.blocks, "block"),
                    plural(u64::from(kv.block_tokens), "token"),
                    kv.source,
                    plural(kv.watermark_blocks, "block")
                ),
            )?;
            row(
                f,
                "KV utilisation",
                format!(
                    "peak {:.1}% ({}), mean {}",
                    kv.peak_utilisation * 100.0,
                    plural(kv.peak_blocks, "block"),
                    kv.mean_utilisation
                        .map_or_else(|| "-".into(), |m| format!("{:.1}%", m * 100.0))
                ),
            )?;
            row(
                f,
                "preemptions",
                format!(
                    "{} ({}), {} recomputed; {} withdrawn, {} evicted",
                    kv.preemptions,
                    plural(kv.preempted_requests as u64, "request"),
                    plural(kv.recomputed_tokens, "token"),
                    plural(kv.withdrawn_admissions, "admission"),
                    plural(kv.cache_evictions, "prefix-cache block")
                ),
            )?;
            row(
                f,
                "memory wait",
                format!(
                    "{:.1} s in total, {} of {} admissions waited; p50/p90/p99 {}",
                    kv.memory_wait_total_ms / 1000.0,
                    kv.admissions_waited,
                    kv.memory_wait_ms.map_or(0, |l| l.samples),
                    latency(&kv.memory_wait_ms)
                ),
            )?;
        }
        row(f, "TTFT p50/p90/p99", latency(&self.ttft_ms))?;
        row(f, "TBT p50/p90/p99", latency(&self.tbt_ms))?;
        if let Some(fleet) = &self.fleet {
            write!(f, "{fleet}")?;
        }
        for c in &self.by_priority {
            row(
                f,
                &format!("priority {} TTFT/TBT p50/p90/p99", c.priority),
                format!(
                    "{}; {} ({})",
                    latency(&c.ttft_ms),
                    latency(&c.tbt_ms),
                    plural(c.requests as u64, "request")
                ),
            )?;
        }
        row(
            f,
            "peak prepared inputs",
            format!(
                "{}, {}",
                plural(self.peak_prepared_rows as u64, "row"),
                plural(self.peak_prepared_tokens, "token")
            ),
        )?;
        row(
            f,
            "prepared inputs left",
            if self.prepared_left_rows == 0 {
                "none (every prepared input was released)".into()
            } else {
                format!(
                    "{}, {}",
                    plural(self.prepared_left_rows as u64, "row"),
                    plural(self.prepared_left_tokens, "token")
                )
            },
        )?;
        row(
            f,
            "simulated time",
            format!("{:.1} s", self.simulated_ms / 1000.0),
        )?;
        row(
            f,
            "wall time",
            format!(
                "{:.0} ms, {:.0} steps/s",
                self.wall_ms, self.steps_per_second
            ),
        )?;
        if let Some(p) = &self.step_log {
            row(f, "step log", p.clone())?;
        }
        if let Some(sig) = &self.interrupted {
            row(
                f,
                "interrupted",
                format!("by {sig}: the figures cover the steps that ran"),
            )?;
        }
        for e in &self.bad_line_examples {
            writeln!(f, "  skipped: {e}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn coefficients_print_to_four_significant_digits() {
        let cases = [
            (8.0, "8"),
            (0.02, "0.02"),
            (12.5, "12.5"),
            (1234.5678, "1235"),
            (0.0123456, "0.01235"),
            (0.001, "0.001"),
            (0.000_999_9, "9.999e-4"),
            (6.103_515_625e-5, "6.104e-5"),
            (1.5e-9, "1.5e-9"),
            (2.5e7, "2.5e7"),
            (0.0, "0"),
            (-0.5, "-0.5"),
        ];
        for (x, want) in cases {
            assert_eq!(coefficient(x), want, "{x}");
        }
    }

    #[test]
    fn the_cost_line_rounds_like_the_latency_model_line() {
        let preset = mstar_chunking::latency::presets::preset_model("llama2-7b-a100").unwrap();
        let [base_ms, per_token_ms, per_kv_token_ms, per_attention_pair_ms] = preset.coefficients();
        let label = CostLabel {
            preset: Some("llama2-7b-a100".into()),
            base_ms,
            per_token_ms,
            per_kv_token_ms,
            per_attention_pair_ms,
            per_row_ms: 0.0,
            noise: 0.0,
            noise_bands: None,
            learn: false,
        };
        let line = label.to_string();
        for c in preset.coefficients().into_iter().filter(|c| *c > 0.0) {
            assert!(line.contains(&coefficient(c)), "{c} in {line}");
        }
        // No coefficient prints more than 4 significant digits.
        let digits = |word: &str| {
            let mantissa = word.split('e').next().unwrap_or(word);
            mantissa
                .chars()
                .filter(char::is_ascii_digit)
                .collect::<String>()
                .trim_start_matches('0')
                .len()
        };
        assert!(
            line.split_whitespace()
                .filter(|w| w.parse::<f64>().is_ok())
                .all(|w| digits(w) <= 4),
            "{line}"
        );
    }

    #[test]
    fn nearest_rank_percentiles() {
        let mut v: Vec<f64> = (1..=100).map(f64::from).rev().collect();
        let l = Latency::of(&mut v).unwrap();
        assert_eq!((l.p50, l.p99, l.max, l.samples), (50.0, 99.0, 100.0, 100));
        let mut one = [7.5f32];
        assert_eq!(Latency::of(&mut one).unwrap().p99, 7.5);
        assert!(Latency::of::<f64>(&mut []).is_none());
        let mut v: Vec<f64> = (1..=10).map(f64::from).collect();
        assert_eq!(Latency::of(&mut v).unwrap().p90, 9.0);
    }

    #[test]
    fn step_durations_are_exact_below_2ms_and_within_a_thousandth_above() {
        let mut d = StepDurations::default();
        assert!(d.is_empty() && d.latency().is_none() && d.quantile(0.5).is_none());
        for us in 1..=1000u32 {
            d.record(f64::from(us) / 1000.0);
        }
        assert_eq!(d.len(), 1000);
        assert_eq!(d.quantile(0.0), Some(0.001));
        assert_eq!(d.quantile(0.5), Some(0.5));
        assert_eq!(d.quantile(0.99), Some(0.99));
        assert_eq!(d.quantile(1.0), Some(1.0));
        let mut big = StepDurations::default();
        let samples: Vec<f64> = (0..10_000).map(|i| 8.0 + f64::from(i) * 0.37).collect();
        for s in &samples {
            big.record(*s);
        }
        for p in [0.01, 0.25, 0.5, 0.9, 0.99] {
            let exact = samples[((p * 10_000.0_f64).ceil() as usize).max(1) - 1];
            let got = big.quantile(p).unwrap();
            assert!(
                (got - exact).abs() <= exact * 0.001,
                "p{p}: {got} vs {exact}"
            );
        }
        assert_eq!(big.quantile(1.0), Some(*samples.last().unwrap()));
        assert_eq!(big.quantile(0.0), Some(8.0));
        // Hostile values are bounded, never a panic or a huge allocation.
        for v in [f64::NAN, f64::INFINITY, -3.0, 1e300] {
            big.record(v);
        }
        assert!(big.counts.len() <= 2048 + 31 * 1024);
        assert_eq!(big.len(), 10_004);
        let json = serde_json::to_value(&big).unwrap();
        assert_eq!(json["samples"], 10_004);
        assert_eq!(json["max"], 1e300);
        assert_eq!(
            serde_json::to_value(StepDurations::default()).unwrap(),
            serde_json::Value::Null
        );
    }
}
