//! The command line (`docs/config.md#the-command-line`): `replay`, `sweep`, `fit`, `check` and
//! `budgets`, each taking `--model FILE` and repeatable `--config FILE` (`fit` only for
//! `--node`'s default). `check` and `replay` check the
//! `[replay]` section the same way (`replay::settings::check`), so they agree on every setting.
//!
//! This module parses the arguments and holds what every command shares (loading the config
//! or reporting its problems, writing to stdout and stderr); each command is a file of its own:
//! `replay_cmd`, `sweep_cmd`, `fit_cmd`, `config_cmd` (`check`, `budgets`).
//!
//! Nothing here panics on output: a closed stdout or stderr (`replay | head -1`, `/dev/full`)
//! ends the command quietly with its usual exit status.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

use crate::config::flags::ReplayFlags;
use crate::config::{
    self, BudgetRow, ConfigErrors, ConfigProblem, Listen, LoadOptions, LoadedConfig,
};
use crate::replay::arrivals::Arrivals;
use crate::replay::TraceFormat;
use mstar_chunking::budget::BudgetValue;

mod config_cmd;
mod fit_cmd;
mod fit_file;
mod replay_cmd;
mod sweep_cmd;
mod sweep_jobs;

pub use config_cmd::{budgets, check, render_table, rows_json};
pub use fit_cmd::fit;
pub use replay_cmd::{load_for_replay, replay};
pub use sweep_cmd::sweep;
pub use sweep_jobs::sweep_cell;

/// The exit code of a refused configuration (and of clap's usage errors).
pub const EXIT_CONFIG: u8 = 2;

/// mstar-chunking: chunked prefill for an LLM serving engine.
#[derive(Debug, Parser)]
#[command(name = "mstar-chunking", version, about, propagate_version = true)]
pub struct Cli {
    /// The subcommand.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Replay a request trace through the chunking actors on a simulated clock.
    Replay(ReplayArgs),
    /// Load, layer and validate the config against a model; print the effective budget table.
    /// Exits 2 and lists every problem when anything is wrong.
    Check(ConfigArgs),
    /// Print the effective budget table only (`--json`: one object per node and walk).
    Budgets(BudgetsArgs),
    /// Replay the trace over a grid of token budgets x rate scales, find each budget's capacity
    /// under a latency objective, and write a table, CSV, JSON, SVG/PNG plots and report.html.
    Sweep(SweepArgs),
    /// Run one cell of a job directory written by `sweep --emit-jobs`, and write its result
    /// into the directory (atomically; a cell already done is left as it is).
    SweepCell(SweepCellArgs),
    /// Fit the step latency model from a replay step log (with `ms`) or a CSV of step features
    /// (`tokens,kv_tokens,attention_pairs,ms`); print the coefficients, R², error quantiles and
    /// a `[chunking.cost.<node>]` table.
    Fit(FitArgs),
}

/// Where the model and the config layers come from.
#[derive(Debug, Clone, Default, PartialEq, Eq, Args)]
pub struct ConfigArgs {
    /// Model manifest [default: config/models/demo.toml, else the built-in demo model]
    #[arg(long, value_name = "FILE")]
    pub model: Option<PathBuf>,
    /// A config layer on top of config/default.toml and config/$MSTAR_ENV.toml; repeatable,
    /// applied in order, then MSTAR__SECTION__KEY environment variables
    #[arg(long = "config", value_name = "FILE")]
    pub configs: Vec<PathBuf>,
}

impl ConfigArgs {
    /// Load options for these arguments, `./config`, `$MSTAR_ENV` and the process environment.
    pub fn load_options(&self) -> LoadOptions {
        LoadOptions::from_process(self.model.clone(), self.configs.clone())
    }
}

/// `budgets` arguments.
#[derive(Debug, Clone, PartialEq, Eq, Args)]
pub struct BudgetsArgs {
    /// Where the model and config layers come from.
    #[command(flatten)]
    pub config: ConfigArgs,
    /// Print a JSON array instead of a table
    #[arg(long)]
    pub json: bool,
}

/// The trace a `replay` or `sweep` reads, and how.
#[derive(Debug, Clone, PartialEq, Args)]
pub struct TraceArgs {
    /// Request trace: Azure LLM inference CSV, Mooncake JSON Lines, generic CSV
    /// (arrival_ms,prompt_tokens,output_tokens,hash_ids) or length-only CSV (with --arrivals)
    /// [default: the bundled trace]
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,
    /// Replay only the first N requests of the trace (N >= 1)
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub requests: Option<u64>,
    /// The trace's format, instead of what its header or extension says: azure, mooncake,
    /// generic or lengths
    #[arg(long, value_name = "FORMAT", value_parser = input_format)]
    pub format: Option<TraceFormat>,
    /// Generated arrivals for a length-only trace: poisson:QPS or gamma:QPS:CV (seeded with
    /// `replay.speculation.seed`)
    #[arg(long, value_name = "SPEC", value_parser = arrivals)]
    pub arrivals: Option<Arrivals>,
    /// Skip trace lines that cannot be parsed instead of stopping
    #[arg(long)]
    pub skip_bad_lines: bool,
    /// Each request's priority by a rule, over the trace's `priority` column:
    /// prompt-length:N (prompts up to N tokens get priority 0, longer ones 1)
    #[arg(long, value_name = "RULE", value_parser = priority_by)]
    pub priority_by: Option<crate::replay::PriorityBy>,
}

fn priority_by(s: &str) -> Result<crate::replay::PriorityBy, String> {
    s.parse()
}

impl TraceArgs {
    /// Replay options that read this trace so; everything else is the default.
    pub(crate) fn options(&self) -> crate::replay::ReplayOptions {
        crate::replay::ReplayOptions {
            trace: self.trace.clone(),
            requests: self
                .requests
                .map(|n| usize::try_from(n).unwrap_or(usize::MAX)),
            format: self.format,
            arrivals: self.arrivals,
            skip_bad_lines: self.skip_bad_lines,
            priority_by: self.priority_by,
            ..Default::default()
        }
    }
}

/// Settings as flags, for `replay` and `sweep` (`docs/config.md#flags`): each is the config key
/// it names, set in a layer over every other (`config::flags`), refused as the key is.
#[derive(Debug, Clone, Default, PartialEq, Args)]
pub struct SettingArgs {
    /// The replayed node's time budget in ms, or "off": `chunking.max_step_ms.<node>`
    #[arg(long, value_name = "MS|off", help_heading = SETTINGS)]
    pub max_step_ms: Option<String>,
    /// The planner's latency model for the replayed node, a preset (llama2-7b-a100,
    /// llama2-7b-h100) or base_ms,per_token_ms,per_kv_token_ms,per_attention_pair_ms:
    /// `chunking.cost.<node>`
    #[arg(long, value_name = "PRESET|a,b,c,d", value_parser = cost_flag, help_heading = SETTINGS)]
    pub cost: Option<String>,
    /// Fit the planner's latency model online: `chunking.learn_cost = true`
    #[arg(long, help_heading = SETTINGS)]
    pub learn_cost: bool,
    /// The simulated engine's step cost, a preset or base_ms,per_token_ms,per_kv_token_ms,
    /// per_attention_pair_ms: `replay.cost` (its noise and learn kept)
    #[arg(long, value_name = "PRESET|a,b,c,d", value_parser = cost_flag, help_heading = SETTINGS)]
    pub sim_cost: Option<String>,
    /// Plan timed steps with this quantile in (0, 1] of measured / predicted step times:
    /// `chunking.time_margin`
    #[arg(long, value_name = "Q", help_heading = SETTINGS)]
    pub time_margin: Option<String>,
}

impl SettingArgs {
    /// The flags given, as config edits, in a fixed order.
    pub fn flags(&self) -> Vec<config::FlagSetting> {
        use config::FlagSetting as F;
        // `--cost` and `--sim-cost` are checked by clap's parser already (`cost_flag`).
        [
            self.max_step_ms.as_deref().map(F::max_step_ms),
            self.cost.as_deref().and_then(|c| F::cost(c).ok()),
            self.learn_cost.then(F::learn_cost),
            self.sim_cost.as_deref().and_then(|c| F::sim_cost(c).ok()),
            self.time_margin.as_deref().map(F::time_margin),
        ]
        .into_iter()
        .flatten()
        .collect()
    }
}

/// `replay`'s KV memory as flags: `replay.kv.blocks`, or `replay.kv.preset` / a memory budget.
#[derive(Debug, Clone, Default, PartialEq, Args)]
pub struct KvArgs {
    /// The KV pool in blocks: `replay.kv.blocks` (instead of any other sizing of the pool)
    #[arg(
        long,
        value_name = "N",
        conflicts_with = "kv_memory",
        help_heading = SETTINGS
    )]
    pub kv_blocks: Option<String>,
    /// The KV pool from memory, a preset (llama2-7b-a100, llama2-7b-h100) or
    /// gpu_memory_gb,weights_gb,kv_bytes_per_token: `replay.kv.preset` or those keys
    #[arg(long, value_name = "PRESET|GIB,GIB,BYTES", value_parser = kv_memory_flag, help_heading = SETTINGS)]
    pub kv_memory: Option<String>,
}

impl KvArgs {
    /// The flags given, as config edits.
    pub fn flags(&self) -> Vec<config::FlagSetting> {
        use config::FlagSetting as F;
        let blocks = self.kv_blocks.as_deref().map(F::kv_blocks);
        // Checked by clap's parser already (`kv_memory_flag`).
        let memory = self.kv_memory.as_deref().and_then(|m| F::kv_memory(m).ok());
        blocks.into_iter().chain(memory).collect()
    }
}

/// The help heading of the flags that each set one config key.
const SETTINGS: &str = "Settings (each a config key)";

/// `replay`'s fleet as flags: `replay.fleet.workers`, `router`, and a disaggregated fleet's
/// pools and KV link.
#[derive(Debug, Clone, Default, PartialEq, Args)]
pub struct FleetArgs {
    /// Component instances replayed side by side behind the router, 1 to 256:
    /// `replay.fleet.workers`
    #[arg(long, value_name = "N", help_heading = SETTINGS)]
    pub workers: Option<String>,
    /// How each request is sent to a worker at its arrival: round_robin, least_outstanding,
    /// least_kv or prefix_affinity: `replay.fleet.router`
    #[arg(long, value_name = "NAME", help_heading = SETTINGS)]
    pub router: Option<String>,
    /// Workers that only prefill, 1 to 256, with --decode-workers instead of --workers
    /// (docs/disaggregated.md): `replay.fleet.prefill_workers`
    #[arg(long, value_name = "N", help_heading = SETTINGS)]
    pub prefill_workers: Option<String>,
    /// Workers that only decode, each request's KV moved to one once its prompt is done:
    /// `replay.fleet.decode_workers`
    #[arg(long, value_name = "N", help_heading = SETTINGS)]
    pub decode_workers: Option<String>,
    /// A prefill worker's KV link, Gbit/s: `replay.fleet.kv_link_gbps`
    #[arg(long, value_name = "GBPS", help_heading = SETTINGS)]
    pub kv_link_gbps: Option<String>,
    /// A KV transfer's fixed latency, ms: `replay.fleet.kv_link_latency_ms`
    #[arg(long, value_name = "MS", help_heading = SETTINGS)]
    pub kv_link_latency_ms: Option<String>,
}

impl FleetArgs {
    /// The flags given, as config edits.
    pub fn flags(&self) -> Vec<config::FlagSetting> {
        use config::FlagSetting as F;
        let mut v = Vec::new();
        v.extend(self.workers.as_deref().map(F::workers));
        v.extend(self.router.as_deref().map(F::router));
        v.extend(self.prefill_workers.as_deref().map(F::prefill_workers));
        v.extend(self.decode_workers.as_deref().map(F::decode_workers));
        v.extend(self.kv_link_gbps.as_deref().map(F::kv_link_gbps));
        v.extend(
            self.kv_link_latency_ms
                .as_deref()
                .map(F::kv_link_latency_ms),
        );
        v
    }
}

/// What `--help` of `replay` and `sweep` says of settings.
const SETTINGS_HELP: &str = "Every setting is a config key: config/default.toml lists them all, with their defaults, and docs/config.md describes them. Layers, each over the one before: config/default.toml (a built-in copy outside the repository), config/$MSTAR_ENV.toml, each --config FILE, MSTAR__SECTION__KEY environment variables, then the flags above, each the key it names, refused as the key is.";

/// `replay` arguments.
#[derive(Debug, Clone, PartialEq, Args)]
#[command(after_help = SETTINGS_HELP)]
pub struct ReplayArgs {
    /// Where the model and config layers come from.
    #[command(flatten)]
    pub config: ConfigArgs,
    /// The trace to replay.
    #[command(flatten)]
    pub source: TraceArgs,
    /// Settings as flags.
    #[command(flatten)]
    pub settings: SettingArgs,
    /// KV memory as flags.
    #[command(flatten)]
    pub kv: KvArgs,
    /// The fleet as flags.
    #[command(flatten)]
    pub fleet: FleetArgs,
    /// Multiply the arrival rate (2.0 = arrivals twice as dense), from 1e-6 to 1e6
    #[arg(long, value_name = "X", default_value_t = 1.0, value_parser = rate_scale)]
    pub rate_scale: f64,
    /// Turn every budget off (a baseline without chunking)
    #[arg(long)]
    pub budget_off: bool,
    /// The token budget of the replayed node's step walk: a number of tokens, or "off"
    /// (shorthand for its `chunking.max_batch_tokens`)
    #[arg(long, value_name = "N|off", value_parser = budget_value, conflicts_with = "budget_off")]
    pub budget: Option<BudgetValue>,
    /// Write one JSON object per step to FILE
    #[arg(long, value_name = "FILE")]
    pub step_log: Option<PathBuf>,
    /// Write the summary as JSON to FILE
    #[arg(long, value_name = "FILE")]
    pub report_json: Option<PathBuf>,
    /// Serve metrics at this address, or "off" [default: off, unless `--hold` is given or a
    /// config layer sets `metrics.listen`]
    #[arg(long, value_name = "ADDR|off")]
    pub metrics_listen: Option<Listen>,
    /// Serve metrics (at `metrics.listen`) and keep serving them after the replay ends, until
    /// SIGINT (Ctrl-C) or SIGTERM
    #[arg(long)]
    pub hold: bool,
    /// Reload the config files when they change (or on SIGHUP) while replaying (a reload
    /// reads the layers again without the flags, so none may be given)
    #[arg(long, conflicts_with_all = ["budget_off", "budget", "max_step_ms", "cost", "learn_cost", "sim_cost", "time_margin", "kv_blocks", "kv_memory", "workers", "router", "prefill_workers", "decode_workers", "kv_link_gbps", "kv_link_latency_ms"])]
    pub watch_config: bool,
    /// No progress bar
    #[arg(long)]
    pub no_progress: bool,
}

/// `sweep` arguments (`docs/sweep.md`).
#[derive(Debug, Clone, PartialEq, Args)]
#[command(after_help = SETTINGS_HELP)]
pub struct SweepArgs {
    /// Where the model and config layers come from.
    #[command(flatten)]
    pub config: ConfigArgs,
    /// Settings as flags, the same in every cell.
    #[command(flatten)]
    pub settings: SettingArgs,
    /// The settings compared, comma-separated: token budgets of the replayed node's step walk,
    /// "off" for none, and time budgets such as 95ms (its `chunking.max_step_ms`, under the
    /// config's token budget)
    #[arg(long, value_name = "LIST", default_value = "512,1024,2048,4096,off")]
    pub budgets: String,
    /// Rate scales (1 = the trace's own rate), comma-separated
    #[arg(long, value_name = "LIST", default_value = "0.5,1,2")]
    pub rates: String,
    /// The objective's bound on p99 time between tokens, simulated ms
    #[arg(long, value_name = "MS", value_parser = slo_ms)]
    pub slo_tbt_p99: Option<f64>,
    /// The objective's bound on p90 time to first token, simulated ms
    #[arg(long, value_name = "MS", value_parser = slo_ms)]
    pub slo_ttft_p90: Option<f64>,
    /// Traces to run the whole grid on, comma-separated, each into `OUT/trace-<name>/`, then the
    /// verdict across them (with --max-step-ms and an objective) into OUT
    #[arg(long, value_name = "LIST", conflicts_with_all = ["trace", "emit_jobs", "merge"])]
    pub traces: Option<String>,
    /// The p90 time-to-first-token objective of each trace of --traces, in their order,
    /// simulated ms (over --slo-ttft-p90)
    #[arg(long, value_name = "LIST", requires = "traces")]
    pub trace_slo_ttft_p90: Option<String>,
    /// The directory to write sweep.csv, sweep.json, the plots and report.html into
    #[arg(long, value_name = "DIR", default_value = "sweep-out")]
    pub out: PathBuf,
    /// Replays run at once [default: the cores available]
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=64))]
    pub jobs: Option<u16>,
    /// The rate scale whose step-time distributions are plotted (one of `--rates`)
    /// [default: 1 if listed, else the middle one]
    #[arg(long, value_name = "X", value_parser = rate_scale)]
    pub step_time_rate: Option<f64>,
    /// The trace every cell replays.
    #[command(flatten)]
    pub source: TraceArgs,
    /// No progress bar
    #[arg(long)]
    pub no_progress: bool,
    /// KV pool sizes in blocks (`replay.kv.blocks`), comma-separated, "unlimited" for none: the
    /// grid runs once per size, each into OUT/kv-N/ (N the pool size), and OUT/kv.* compares them
    #[arg(long, value_name = "LIST")]
    pub kv_blocks: Option<String>,
    /// Orders of waiting prompts (`chunking.order` for every node), comma-separated: the grid
    /// runs once per order, each into OUT/order-NAME/; OUT/sweep.csv then has an `order` column
    /// and OUT/orders.* compares them
    #[arg(long, value_name = "LIST", conflicts_with = "kv_blocks")]
    pub orders: Option<String>,
    /// Fleet sizes (`replay.fleet.workers`), ascending, comma-separated: the grid runs once per
    /// size and router, each into OUT/fleet-ROUTER-N/; OUT/sweep.csv then has `router` and
    /// `workers` columns and OUT/fleet.* gives the fewest workers that meet the objective
    #[arg(long, value_name = "LIST", conflicts_with_all = ["kv_blocks", "orders"])]
    pub workers: Option<String>,
    /// Routers (`replay.fleet.router`) for the fleet sizes of `--workers`, comma-separated
    /// [default: the config's router]
    #[arg(long, value_name = "LIST", conflicts_with_all = ["kv_blocks", "orders"])]
    pub routers: Option<String>,
    /// Prefill:decode splits (`1:3,1:1,3:1`) of each fleet size of `--workers`: the grid runs
    /// on the colocated fleet and on each split (`replay.fleet.prefill_workers`,
    /// `decode_workers`), each into OUT/pd-LAYOUT-N/; OUT/fleet.* gives the fewest workers of
    /// each layout that meet the objective
    #[arg(long, value_name = "LIST", conflicts_with_all = ["kv_blocks", "orders", "routers"])]
    pub pd: Option<String>,
    /// Write every cell of the grid as a job into DIR (its inputs copied in, a manifest naming
    /// each cell by index) instead of running it; run the cells with `sweep-cell DIR INDEX`
    /// anywhere, then `sweep --merge DIR`
    #[arg(long, value_name = "DIR", conflicts_with_all = ["kv_blocks", "orders", "workers", "routers", "pd", "merge"])]
    pub emit_jobs: Option<PathBuf>,
    /// Build the sweep's outputs into --out from the results of a job directory's cells
    /// (everything else comes from the directory); exits 3 when the capacity searches need
    /// another wave of cells, which it adds to the directory
    #[arg(long, value_name = "DIR", conflicts_with_all = ["kv_blocks", "orders", "workers", "routers", "pd"])]
    pub merge: Option<PathBuf>,
}

/// `sweep-cell` arguments.
#[derive(Debug, Clone, PartialEq, Eq, Args)]
pub struct SweepCellArgs {
    /// A job directory written by `sweep --emit-jobs`
    #[arg(value_name = "DIR")]
    pub dir: PathBuf,
    /// The cell to run [default: $JOB_COMPLETION_INDEX (a Kubernetes Indexed Job), else
    /// $SLURM_ARRAY_TASK_ID (a Slurm job array)]
    #[arg(value_name = "INDEX")]
    pub index: Option<u64>,
}

/// `fit` arguments.
#[derive(Debug, Clone, PartialEq, Eq, Args)]
pub struct FitArgs {
    /// A replay step log (JSON Lines with `ms`) or a CSV with `tokens,kv_tokens,attention_pairs,ms`
    #[arg(value_name = "FILE")]
    pub file: PathBuf,
    /// The node the `[chunking.cost.<node>]` table is for [default: the model's first node]
    #[arg(long, value_name = "NODE")]
    pub node: Option<String>,
    /// The errors the fit minimises: `absolute` (ms: long steps weigh the most) or `relative`
    /// (each step's error over its time, as the online fit: short decode steps count as much)
    #[arg(long, value_name = "WHICH", default_value = "absolute", value_parser = fit_errors)]
    pub errors: mstar_chunking::latency::fit::FitErrors,
    /// The table printed: `serve`, `[chunking.cost.<node>]` for the serving config; `replay`,
    /// `[replay.cost]` for a replay priced like these steps, their spread around the fit by
    /// price as `noise_bands`
    #[arg(long = "for", value_name = "WHAT", default_value = "serve", value_parser = fit_for)]
    pub table: FitFor,
    /// Where the model (for `--node`'s default) and config layers come from.
    #[command(flatten)]
    pub config: ConfigArgs,
}

/// `--errors`: `absolute` or `relative`.
fn fit_errors(s: &str) -> Result<mstar_chunking::latency::fit::FitErrors, String> {
    match s {
        "absolute" => Ok(mstar_chunking::latency::fit::FitErrors::Absolute),
        "relative" => Ok(mstar_chunking::latency::fit::FitErrors::Relative),
        _ => Err(format!("expected `absolute` or `relative`, got {s:?}")),
    }
}

/// Which config table `fit` prints (`--for`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FitFor {
    /// `[chunking.cost.<node>]`, for the serving config.
    Serve,
    /// `[replay.cost]` with `noise_bands`, for a replay priced like the fitted steps.
    Replay,
}

/// `--for`: `serve` or `replay`.
fn fit_for(s: &str) -> Result<FitFor, String> {
    match s {
        "serve" => Ok(FitFor::Serve),
        "replay" => Ok(FitFor::Replay),
        _ => Err(format!("expected `serve` or `replay`, got {s:?}")),
    }
}

/// `--budget`: a budget value (its one `FromStr`) of at most the sweep grid's largest budget.
fn budget_value(s: &str) -> Result<BudgetValue, String> {
    s.parse::<BudgetValue>()
        .ok()
        .filter(|b| {
            b.get()
                .is_none_or(|n| n <= crate::sweep::grid::MAX_BUDGET_TOKENS)
        })
        .ok_or_else(|| {
            format!(
                "expected a whole number of tokens between 1 and {}, or `off`; got {}",
                crate::sweep::grid::MAX_BUDGET_TOKENS,
                config::problem::quote(s)
            )
        })
}

/// `--cost`, `--sim-cost`: a preset's name or four coefficients (the values themselves are
/// the config's to check).
fn cost_flag(s: &str) -> Result<String, String> {
    config::FlagSetting::cost(s).map(|_| s.to_owned())
}

/// `--kv-memory`: a preset's name or a memory budget's three numbers.
fn kv_memory_flag(s: &str) -> Result<String, String> {
    config::FlagSetting::kv_memory(s).map(|_| s.to_owned())
}

fn input_format(s: &str) -> Result<TraceFormat, String> {
    s.parse::<TraceFormat>().map_err(|_| {
        format!(
            "expected one of `azure`, `mooncake`, `generic`, `lengths`; got {}",
            config::problem::quote(s)
        )
    })
}

fn arrivals(s: &str) -> Result<Arrivals, String> {
    s.parse::<Arrivals>().map_err(|e| e.to_string())
}

fn slo_ms(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(x) if x.is_finite() && x > 0.0 && x <= 1e9 => Ok(x),
        _ => Err(format!(
            "expected a number of milliseconds above 0 and at most 1e9, such as 60 or 5000; got {}",
            config::problem::quote(s)
        )),
    }
}

fn rate_scale(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(x) => crate::replay::settings::check_rate_scale(x),
        Err(_) => Err(format!(
            "expected a number such as 1.0 or 2.5, got {}",
            config::problem::quote(s)
        )),
    }
}

/// Writes one line to stderr; a closed or full stderr is ignored (`eprintln!` would panic).
pub(crate) fn say(line: &str) {
    let mut err = std::io::stderr().lock();
    let _ = writeln!(err, "{line}");
}

/// Loads, and on failure prints every problem to stderr and returns exit code 2.
///
/// # Errors
/// The exit code to return when the configuration was refused.
pub fn load_or_report(opts: &LoadOptions) -> Result<LoadedConfig, ExitCode> {
    match config::load(opts) {
        Ok(loaded) => {
            init_logging(&loaded);
            Ok(loaded)
        }
        Err(errors) => {
            report(&errors);
            Err(ExitCode::from(EXIT_CONFIG))
        }
    }
}

fn init_logging(loaded: &LoadedConfig) {
    crate::logging::init(&loaded.settings.log);
    for w in &loaded.warnings {
        tracing::warn!("{w}");
    }
    tracing::debug!(
        model = %config::problem::escape(&loaded.model_origin),
        layers = %config::problem::escape_join(&loaded.layers, " -> "),
        "configuration loaded"
    );
}

/// Prints every problem, one per line (escaped, capped with a count of the rest), and how many
/// there were. A closed stderr is ignored.
pub(crate) fn report(errors: &ConfigErrors) {
    let n = errors.total();
    let mut text = format!(
        "error: the configuration was refused ({n} problem{}):\n",
        if n == 1 { "" } else { "s" }
    );
    for line in errors.lines() {
        text.push_str("  ");
        text.push_str(&line);
        text.push('\n');
    }
    let mut err = std::io::stderr().lock();
    let _ = err.write_all(text.as_bytes()).and_then(|()| err.flush());
}

fn print_stdout(text: &str) -> ExitCode {
    let mut stdout = std::io::stdout().lock();
    match stdout
        .write_all(text.as_bytes())
        .and_then(|()| stdout.flush())
    {
        Ok(()) => ExitCode::SUCCESS,
        // A closed pipe (`| head`) is the reader's choice, not a failure worth a message.
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(e) => {
            say(&format!("error: cannot write to stdout: {e}"));
            ExitCode::FAILURE
        }
    }
}

/// The files' names of `paths`, comma-separated.
fn file_names(paths: &[PathBuf]) -> String {
    paths
        .iter()
        .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replay_flags_parse() {
        let cli = Cli::try_parse_from([
            "mstar-chunking",
            "replay",
            "--model",
            "m.toml",
            "--config",
            "a.toml",
            "--config",
            "b.toml",
            "--trace",
            "t.csv",
            "--requests",
            "10",
            "--rate-scale",
            "2.5",
            "--budget-off",
            "--step-log",
            "s.jsonl",
            "--report-json",
            "r.json",
            "--skip-bad-lines",
            "--metrics-listen",
            "off",
            "--hold",
            "--no-progress",
        ])
        .unwrap();
        let Command::Replay(r) = cli.command else {
            panic!("not replay")
        };
        assert_eq!(
            r.config.configs,
            [PathBuf::from("a.toml"), PathBuf::from("b.toml")]
        );
        assert_eq!(r.source.requests, Some(10));
        assert_eq!(r.rate_scale, 2.5);
        assert_eq!(r.metrics_listen, Some(Listen::Off));
        assert!(
            r.budget_off && r.source.skip_bad_lines && r.hold && !r.watch_config && r.no_progress
        );
        // A reload would apply the config's budgets over --budget-off: refused together.
        assert!(Cli::try_parse_from([
            "mstar-chunking",
            "replay",
            "--budget-off",
            "--watch-config"
        ])
        .is_err());
        let cli = Cli::try_parse_from(["mstar-chunking", "replay", "--watch-config"]).unwrap();
        assert!(matches!(cli.command, Command::Replay(r) if r.watch_config));
        // `--requests 0` would replay nothing: a usage error (exit 2), for replay and sweep.
        for cmd in ["replay", "sweep"] {
            let err = Cli::try_parse_from(["mstar-chunking", cmd, "--requests", "0"])
                .expect_err("refused");
            assert_eq!(err.exit_code(), 2, "{err}");
            assert!(err.to_string().contains("--requests"), "{err}");
        }
        // `--help` names all four trace formats.
        let help = Cli::try_parse_from(["mstar-chunking", "replay", "--help"])
            .expect_err("help")
            .to_string();
        for format in ["Azure", "Mooncake", "generic", "length-only"] {
            assert!(help.contains(format), "{format} missing from:\n{help}");
        }
        let cli = Cli::try_parse_from(["mstar-chunking", "replay"]).unwrap();
        let Command::Replay(r) = cli.command else {
            panic!("not replay")
        };
        assert_eq!(r.rate_scale, 1.0);
        assert_eq!(r.metrics_listen, None);
        let cli = Cli::try_parse_from([
            "mstar-chunking",
            "replay",
            "--budget",
            "OFF",
            "--format",
            "Generic",
            "--arrivals",
            "gamma:4:2",
        ])
        .unwrap();
        let Command::Replay(r) = cli.command else {
            panic!("not replay")
        };
        assert_eq!(r.budget, Some(BudgetValue::Off));
        assert_eq!(r.source.format, Some(TraceFormat::GenericCsv));
        assert_eq!(
            r.source.arrivals,
            Some(Arrivals::Gamma { qps: 4.0, cv: 2.0 })
        );
        let cli = Cli::try_parse_from([
            "mstar-chunking",
            "sweep",
            "--jobs",
            "3",
            "--slo-tbt-p99",
            "60",
        ])
        .unwrap();
        let Command::Sweep(s) = cli.command else {
            panic!("not sweep")
        };
        assert_eq!(
            (s.jobs, s.slo_tbt_p99, s.slo_ttft_p90, s.out.as_path()),
            (Some(3), Some(60.0), None, std::path::Path::new("sweep-out"))
        );
        assert_eq!(s.budgets, "512,1024,2048,4096,off");
        for bad in [
            &["replay", "--budget", "0"][..],
            &["replay", "--budget", "16777217"],
            &["replay", "--budget", "2048", "--budget-off"],
            &["replay", "--format", "csv"],
            &["replay", "--arrivals", "poisson:0"],
            &["sweep", "--slo-tbt-p99", "NaN"],
            &["sweep", "--slo-ttft-p90", "0"],
            &["sweep", "--jobs", "65"],
            &["fit"],
            &["replay", "--rate-scale", "0"],
            &["replay", "--rate-scale", "-1"],
            &["replay", "--metrics-listen", "nowhere"],
            &["budgets", "--jsn"],
        ] {
            let args = std::iter::once("mstar-chunking").chain(bad.iter().copied());
            assert!(Cli::try_parse_from(args).is_err(), "{bad:?}");
        }
    }
}
