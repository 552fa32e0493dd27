//! The command line (`docs/config.md#the-command-line`): `replay`, `sweep`, `fit`, `check` and
//! `budgets`, each taking `--model FILE` and repeatable `--config FILE` (`fit` only for
//! `--node`'s default). `check` and `replay` check the
//! `[replay]` section the same way (`replay::settings::check`), so they agree on every setting.
//!
//! Nothing here panics on output: a closed stdout or stderr (`replay | head -1`, `/dev/full`)
//! ends the command quietly with its usual exit status.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

use crate::budget::BudgetValue;
use crate::config::{
    self, BudgetRow, ConfigErrors, ConfigProblem, Listen, LoadOptions, LoadedConfig,
};
use crate::replay::arrivals::Arrivals;
use crate::replay::TraceFormat;

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

/// `replay` arguments.
#[derive(Debug, Clone, PartialEq, Args)]
pub struct ReplayArgs {
    /// Where the model and config layers come from.
    #[command(flatten)]
    pub config: ConfigArgs,
    /// Request trace: Azure LLM inference CSV, Mooncake JSON Lines, generic CSV
    /// (arrival_ms,prompt_tokens,output_tokens,hash_ids) or length-only CSV (with --arrivals)
    /// [default: the bundled trace]
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,
    /// Replay only the first N requests of the trace (N >= 1)
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub requests: Option<u64>,
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
    /// The trace's format, instead of what its header or extension says: azure, mooncake,
    /// generic or lengths
    #[arg(long, value_name = "FORMAT", value_parser = input_format)]
    pub format: Option<TraceFormat>,
    /// Generated arrivals for a length-only trace: poisson:QPS or gamma:QPS:CV (seeded with
    /// `replay.speculation.seed`)
    #[arg(long, value_name = "SPEC", value_parser = arrivals)]
    pub arrivals: Option<Arrivals>,
    /// Write one JSON object per step to FILE
    #[arg(long, value_name = "FILE")]
    pub step_log: Option<PathBuf>,
    /// Write the summary as JSON to FILE
    #[arg(long, value_name = "FILE")]
    pub report_json: Option<PathBuf>,
    /// Skip trace lines that cannot be parsed instead of stopping
    #[arg(long)]
    pub skip_bad_lines: bool,
    /// Serve metrics at this address, or "off" [default: off, unless `--hold` is given or a
    /// config layer sets `metrics.listen`]
    #[arg(long, value_name = "ADDR|off")]
    pub metrics_listen: Option<Listen>,
    /// Serve metrics (at `metrics.listen`) and keep serving them after the replay ends, until
    /// SIGINT (Ctrl-C) or SIGTERM
    #[arg(long)]
    pub hold: bool,
    /// Reload the config files when they change (or on SIGHUP) while replaying
    #[arg(long, conflicts_with_all = ["budget_off", "budget"])]
    pub watch_config: bool,
    /// No progress bar
    #[arg(long)]
    pub no_progress: bool,
}

/// `sweep` arguments (`docs/replay.md#sweeps`).
#[derive(Debug, Clone, PartialEq, Args)]
pub struct SweepArgs {
    /// Where the model and config layers come from.
    #[command(flatten)]
    pub config: ConfigArgs,
    /// Token budgets of the replayed node's step walk, comma-separated; "off" for none
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
    /// Request trace (any format of `replay --trace`) [default: the bundled trace]
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,
    /// The trace's format, instead of what its header or extension says
    #[arg(long, value_name = "FORMAT", value_parser = input_format)]
    pub format: Option<TraceFormat>,
    /// Generated arrivals for a length-only trace: poisson:QPS or gamma:QPS:CV
    #[arg(long, value_name = "SPEC", value_parser = arrivals)]
    pub arrivals: Option<Arrivals>,
    /// Replay only the first N requests of the trace (N >= 1)
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub requests: Option<u64>,
    /// Skip trace lines that cannot be parsed instead of stopping
    #[arg(long)]
    pub skip_bad_lines: bool,
    /// No progress bar
    #[arg(long)]
    pub no_progress: bool,
    /// KV pool sizes in blocks (`replay.kv.blocks`), comma-separated, "unlimited" for none: the
    /// grid runs once per size, each into OUT/kv-N/ (N the pool size), and OUT/kv.* compares them
    #[arg(long, value_name = "LIST")]
    pub kv_blocks: Option<String>,
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
    /// Where the model (for `--node`'s default) and config layers come from.
    #[command(flatten)]
    pub config: ConfigArgs,
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

/// The configuration checked for a replay: the load, and `[replay]` resolved against the model.
/// `check` runs the same check (see [`check`]), so that both agree on every setting.
///
/// # Errors
/// Every problem, each naming its key and layer (or the manifest, for a model replay cannot
/// drive).
pub fn load_for_replay(
    opts: &LoadOptions,
) -> Result<(LoadedConfig, crate::replay::ReplaySetup), ConfigErrors> {
    let loaded = config::load(opts)?;
    match crate::replay::settings::check(&loaded.manifest, &loaded.settings.replay) {
        Ok(setup) => Ok((loaded, setup)),
        Err(problems) => {
            let (settings, model) = replay_problems(&loaded, problems);
            let mut errors = ConfigErrors::default();
            errors.extend(settings.into_iter().chain(model));
            Err(errors)
        }
    }
}

/// `[replay]` problems as config problems: those of a setting (naming its key and layer), and
/// those of the model itself (a model without `prefill` or `decode`, which replay cannot drive
/// whatever the settings say).
fn replay_problems(
    loaded: &LoadedConfig,
    problems: Vec<crate::replay::settings::SettingProblem>,
) -> (Vec<ConfigProblem>, Vec<ConfigProblem>) {
    let (model, settings): (Vec<_>, Vec<_>) = problems
        .into_iter()
        .partition(|p| matches!(p.key, "walks" | "nodes"));
    (
        settings
            .into_iter()
            .map(|p| loaded.origins.problem(p.key, p.value, p.reason))
            .collect(),
        model
            .into_iter()
            .map(|p| ConfigProblem::Manifest {
                path: loaded.model_origin.clone(),
                reason: format!("`{}` {}", p.key, p.reason),
            })
            .collect(),
    )
}

/// Warns when the metrics endpoint listens beyond this machine.
fn warn_if_exposed(addr: std::net::SocketAddr) {
    if !addr.ip().is_loopback() {
        tracing::warn!(
            %addr,
            "the metrics endpoint listens on a non-loopback address: anyone who can reach it can read every metric (node and walk names, budgets, queue depths, overrun counts); bind 127.0.0.1 or put it behind a firewall"
        );
    }
}

/// `replay`: loads the config, starts the metrics endpoint and the actors, replays the trace
/// and prints the summary. Exit codes: 0 done, 2 refused config, 1 any other failure.
pub fn replay(args: &ReplayArgs) -> ExitCode {
    let load = args.config.load_options();
    let loaded = match load_for_replay(&load) {
        Ok((l, _)) => {
            init_logging(&l);
            l
        }
        Err(errors) => {
            report(&errors);
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let listen = metrics_listen(args, &loaded);
    if let Listen::Addr(addr) = listen {
        warn_if_exposed(addr);
        if let Err(e) = crate::metrics::install_prometheus(addr) {
            say(&format!("error: {e}"));
            return ExitCode::FAILURE;
        }
    }
    let opts = crate::replay::ReplayOptions {
        trace: args.trace.clone(),
        requests: args
            .requests
            .map(|n| usize::try_from(n).unwrap_or(usize::MAX)),
        rate_scale: args.rate_scale,
        budget_off: args.budget_off,
        budget: args.budget,
        format: args.format,
        arrivals: args.arrivals,
        step_log: args.step_log.clone(),
        report_json: args.report_json.clone(),
        skip_bad_lines: args.skip_bad_lines,
        progress: !args.no_progress,
        inputs: load
            .config_files()
            .into_iter()
            .chain(load.configs.iter().cloned())
            .chain(load.model_path())
            .collect(),
        handle_signals: true,
        on_step: None,
        stop: None,
    };
    actix::System::new().block_on(async {
        let cm = match crate::ChunkingManagement::start(
            &loaded.manifest.name,
            loaded.manifest.submodules(),
        ) {
            Ok(cm) => cm,
            Err(e) => {
                say(&format!("error: {e}"));
                return ExitCode::FAILURE;
            }
        };
        // Bound before the watcher starts, so that a reload always has policies to layer on.
        if let Err(e) = cm.set_policies(loaded.manifest.policies()).await {
            say(&format!("error: {e}"));
            return ExitCode::FAILURE;
        }
        let _watcher = if args.watch_config {
            let reloader =
                crate::reload::Reloader::new(cm.clone(), load.clone(), loaded.manifest.clone())
                    .running(loaded.settings.clone());
            match crate::reload::watch(reloader) {
                Ok(w) => Some(w),
                Err(e) => {
                    say(&format!("error: {e}"));
                    return ExitCode::FAILURE;
                }
            }
        } else {
            None
        };
        match crate::replay::run_on(&cm, &loaded.manifest, &loaded.settings, &opts).await {
            Ok(report) => {
                for w in &report.warnings {
                    say(&format!("warning: {w}"));
                }
                let code = print_stdout(&format!("{report}\n"));
                if let Some(signal) = report.interrupted {
                    say(&format!(
                        "interrupted by {signal}: the report covers the steps that ran"
                    ));
                    return ExitCode::from(crate::replay::signal_exit_code(&signal));
                }
                if args.hold {
                    say(match listen {
                        Listen::Addr(_) => {
                            "holding: metrics stay served until SIGINT (Ctrl-C) or SIGTERM"
                        }
                        Listen::Off => "holding until SIGINT (Ctrl-C) or SIGTERM; metrics are off",
                    });
                    let signal = hold_until_signal().await;
                    say(&format!("{signal}: stopped holding"));
                }
                code
            }
            Err(e) => {
                say(&format!("error: {e}"));
                match e {
                    // Refused before anything ran: usage, as a refused config.
                    e if is_usage(&e) => ExitCode::from(EXIT_CONFIG),
                    _ => ExitCode::FAILURE,
                }
            }
        }
    })
}

/// Waits for SIGINT or SIGTERM (a service manager's stop) and names it. The replay is done by
/// then, so either ends the hold with the replay's own exit status.
async fn hold_until_signal() -> &'static str {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        if let (Ok(mut int), Ok(mut term)) = (
            signal(SignalKind::interrupt()),
            signal(SignalKind::terminate()),
        ) {
            return tokio::select! {
                _ = int.recv() => "SIGINT",
                _ = term.recv() => "SIGTERM",
            };
        }
    }
    let _ = tokio::signal::ctrl_c().await;
    "SIGINT"
}

/// Whether a replay error refuses what was asked before anything ran (exit 2): an output, a
/// setting, the rate scale, `--budget`, or `--format` / `--arrivals` against the trace.
fn is_usage(e: &crate::replay::ReplayError) -> bool {
    use crate::replay::{ReplayError, TraceError};
    match e {
        ReplayError::Output { .. }
        | ReplayError::Config { .. }
        | ReplayError::RateScale(_)
        | ReplayError::Budget { .. }
        | ReplayError::KvTooSmall { .. } => true,
        ReplayError::Trace(t) => matches!(
            t,
            TraceError::Bundled { .. }
                | TraceError::UnknownName(_)
                | TraceError::Unknown { .. }
                | TraceError::NeedsArrivals { .. }
                | TraceError::HasArrivals { .. }
                | TraceError::Arrivals(_)
        ),
        _ => false,
    }
}

/// Where a replay serves metrics (`docs/replay.md#quiet-batch-runs`): `--metrics-listen` when
/// given; else `metrics.listen` when `--hold` asks for metrics or a config layer (a file or an
/// environment variable, not the built-in default) sets it; else nowhere, so that batch runs
/// never clash over a port.
fn metrics_listen(args: &ReplayArgs, loaded: &LoadedConfig) -> Listen {
    if let Some(l) = args.metrics_listen {
        return l;
    }
    let who = loaded.origins.of("metrics.listen");
    let explicit = who != "built-in default" && loaded.layers.first() != Some(&who);
    if args.hold || explicit {
        loaded.settings.metrics.listen
    } else {
        Listen::Off
    }
}

/// `sweep` (`docs/replay.md#sweeps`): reads the trace once, replays it for every budget x rate
/// scale of the grid (and the capacity search's probes) on `--jobs` threads, each replay in its
/// own actix system with metrics off and no progress bar of its own; prints the table and
/// writes the outputs. Exit codes: 0 done, 2 refused arguments or config, 1 a failed replay or
/// write.
pub fn sweep(args: &SweepArgs) -> ExitCode {
    use crate::sweep::{self, Budget, SweepOptions};
    let usage = |e: &dyn std::fmt::Display| {
        say(&format!("error: {e}"));
        ExitCode::from(EXIT_CONFIG)
    };
    let load = args.config.load_options();
    let (loaded, setup) = match load_for_replay(&load) {
        Ok((l, s)) => {
            init_logging(&l);
            (l, s)
        }
        Err(errors) => {
            report(&errors);
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let budgets = match sweep::parse_budgets(&args.budgets) {
        Ok(b) => b,
        Err(e) => return usage(&e),
    };
    let rates = match sweep::parse_rates(&args.rates) {
        Ok(r) => r,
        Err(e) => return usage(&e),
    };
    let kv_axis = match args
        .kv_blocks
        .as_deref()
        .map(sweep::kv_axis::parse_kv_blocks)
    {
        None => None,
        Some(Ok(k)) => Some(k),
        Some(Err(e)) => return usage(&e),
    };
    let slo = if args.slo_tbt_p99.is_some() || args.slo_ttft_p90.is_some() {
        match sweep::Slo::new(args.slo_tbt_p99, args.slo_ttft_p90) {
            Ok(s) => Some(s),
            Err(e) => return usage(&e),
        }
    } else {
        None
    };
    if let Some(r) = args.step_time_rate.filter(|r| !rates.contains(r)) {
        return usage(&format!(
            "`--step-time-rate`: the step-time rate {} is not one of the rate scales of `--rates`",
            crate::text::fmt_rate(r)
        ));
    }
    let inputs: Vec<PathBuf> = load
        .config_files()
        .into_iter()
        .chain(load.configs.iter().cloned())
        .chain(load.model_path())
        .chain(args.trace.clone())
        .collect();
    // Refused before hours of replays, not after: the outputs, and every budget of the grid
    // as the config would refuse it (as `replay --budget` does).
    if let Err(e) = sweep::output::check_output_dir(&args.out, &inputs) {
        return usage(&e);
    }
    if let Err(refused) =
        sweep::cells::check_budgets(&loaded.manifest, &loaded.settings, &setup, &budgets)
    {
        return usage(&refused);
    }
    let base = crate::replay::ReplayOptions {
        trace: args.trace.clone(),
        requests: args
            .requests
            .map(|n| usize::try_from(n).unwrap_or(usize::MAX)),
        format: args.format,
        arrivals: args.arrivals,
        skip_bad_lines: args.skip_bad_lines,
        progress: false,
        inputs: inputs.clone(),
        ..Default::default()
    };
    let trace = match crate::replay::load_trace(&base, setup.seed) {
        Ok(t) => t,
        Err(e) => {
            say(&format!("error: {e}"));
            return if is_usage(&e) {
                ExitCode::from(EXIT_CONFIG)
            } else {
                ExitCode::FAILURE
            };
        }
    };
    for w in crate::replay::trace_warnings(&setup, &trace) {
        say(&format!("warning: {w}"));
    }
    // Created only now that every input was accepted, and removed again if the sweep writes
    // nothing into it.
    let created = !args.out.exists();
    if let Err(e) = std::fs::create_dir_all(&args.out) {
        say(&format!(
            "error: cannot create the output directory `{}`: {e}",
            config::problem::escape(&args.out.display().to_string())
        ));
        return ExitCode::from(EXIT_CONFIG);
    }
    let remove_if_created = || {
        if created {
            // Only an empty directory is removed.
            let _ = std::fs::remove_dir(&args.out);
        }
    };
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicI32::new(0));
    let _signals = sweep_signals(stop.clone());
    let opts = SweepOptions {
        budgets,
        rates,
        slo,
        jobs: args.jobs.map_or_else(sweep::run::default_jobs, usize::from),
        progress: !args.no_progress,
        step_time_rate: args.step_time_rate,
        settings: sweep::cells::labels(&loaded, &setup, &base, &trace),
        stop: Some(stop.clone()),
    };
    let (manifest, settings) = (&loaded.manifest, &loaded.settings);
    if let Some(axis) = kv_axis {
        return sweep_kv_axis(args, &opts, &loaded, &base, &trace, &inputs, &axis);
    }
    let run = |budget: Budget, rate: f64| -> Result<sweep::RunSummary, String> {
        sweep::cells::run_cell(manifest, settings, &base, &trace, budget, rate, &stop)
    };
    let wall = std::time::Instant::now();
    let result = match sweep::run_sweep(&opts, run) {
        Ok(r) => r,
        Err(e @ (sweep::SweepError::Options(_) | sweep::SweepError::Slo(_))) => {
            remove_if_created();
            return usage(&e);
        }
        Err(e) => {
            remove_if_created();
            say(&format!("error: {e}"));
            return ExitCode::FAILURE;
        }
    };
    let mut code = print_stdout(&sweep::output::table(&result));
    if let Some(signal) = &result.interrupted {
        say(&format!(
            "interrupted by {signal}: the outputs cover the replays that finished"
        ));
        code = ExitCode::from(crate::replay::signal_exit_code(signal));
    }
    match sweep::write_outputs(&result, &args.out, &inputs) {
        Ok(written) => {
            say(&format!(
                "wrote {} to {} in {:.1} s: {}",
                crate::text::plural(written.paths.len() as u64, "file"),
                config::problem::escape(&args.out.display().to_string()),
                wall.elapsed().as_secs_f64(),
                written
                    .paths
                    .iter()
                    .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
            code
        }
        Err(
            e @ (sweep::SweepError::OutputIsInput(_)
            | sweep::SweepError::OutputNotADirectory(_)
            | sweep::SweepError::OutputNotAFile(_)),
        ) => {
            remove_if_created();
            usage(&e)
        }
        Err(e) => {
            remove_if_created();
            say(&format!("error: {e}"));
            ExitCode::FAILURE
        }
    }
}

/// Stops a sweep on SIGINT or SIGTERM: the first sets `stop` to its number (the workers start
/// no new replay and stop theirs at the next step; the finished cells are written), a second
/// one exits at once with 128 + its number. Watched on a thread of its own until the process
/// ends; `None` where signals cannot be watched.
fn sweep_signals(stop: std::sync::Arc<std::sync::atomic::AtomicI32>) -> Option<()> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .ok()?;
        // Registered before the grid starts, so that no signal is missed.
        let (mut int, mut term) = {
            let _entered = runtime.enter();
            (
                signal(SignalKind::interrupt()).ok()?,
                signal(SignalKind::terminate()).ok()?,
            )
        };
        std::thread::Builder::new()
            .name("mstar-sweep-signals".into())
            .spawn(move || {
                runtime.block_on(async move {
                    loop {
                        let sig = tokio::select! {
                            _ = int.recv() => 2,
                            _ = term.recv() => 15,
                        };
                        let first = stop
                            .compare_exchange(
                                0,
                                sig,
                                std::sync::atomic::Ordering::SeqCst,
                                std::sync::atomic::Ordering::SeqCst,
                            )
                            .is_ok();
                        if first {
                            say(&format!(
                                "{}: stopping the sweep after the replays running now; signal again to stop at once",
                                crate::replay::signal_name(sig)
                            ));
                        } else {
                            std::process::exit(128 + sig);
                        }
                    }
                });
            })
            .ok()?;
        Some(())
    }
    #[cfg(not(unix))]
    {
        let _ = stop;
        None
    }
}

/// `sweep --kv-blocks` (`docs/kv-memory.md#in-a-sweep`): the grid once per KV pool size, each
/// written into `OUT/kv-<blocks>/`, then their comparison (`OUT/kv.*`).
fn sweep_kv_axis(
    args: &SweepArgs,
    opts: &crate::sweep::SweepOptions,
    loaded: &LoadedConfig,
    base: &crate::replay::ReplayOptions,
    trace: &crate::replay::Trace,
    inputs: &[PathBuf],
    axis: &[crate::sweep::kv_axis::KvBlocks],
) -> ExitCode {
    use crate::sweep;
    let wall = std::time::Instant::now();
    let stop = opts.stop.clone().unwrap_or_default();
    let mut runs = Vec::new();
    let mut code = ExitCode::SUCCESS;
    for kv in axis {
        let (settings, label) = sweep::cells::with_kv(&loaded.settings, *kv);
        let mut o = opts.clone();
        o.settings.push(("KV memory".into(), label));
        let dir = args.out.join(kv.dir_name());
        if let Err(e) = std::fs::create_dir_all(&dir) {
            say(&format!(
                "error: cannot create the output directory `{}`: {e}",
                config::problem::escape(&dir.display().to_string())
            ));
            return ExitCode::from(EXIT_CONFIG);
        }
        let result = match sweep::run_sweep(&o, |b, r| {
            sweep::cells::run_cell(&loaded.manifest, &settings, base, trace, b, r, &stop)
        }) {
            Ok(r) => r,
            Err(e) => {
                say(&format!("error: with {kv} KV blocks: {e}"));
                return ExitCode::FAILURE;
            }
        };
        code = print_stdout(&format!(
            "KV blocks: {kv}\n{}",
            sweep::output::table(&result)
        ));
        if let Err(e) = sweep::write_outputs(&result, &dir, inputs) {
            say(&format!("error: {e}"));
            return ExitCode::FAILURE;
        }
        runs.push((*kv, result));
    }
    let cmp = sweep::kv_axis::KvComparison::of(&runs);
    let _ = print_stdout(&cmp.table());
    match cmp.write(&args.out) {
        Ok(paths) => {
            say(&format!(
                "wrote {} runs into {}/kv-*/ and {} in {:.1} s",
                runs.len(),
                config::problem::escape(&args.out.display().to_string()),
                paths
                    .iter()
                    .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
                    .collect::<Vec<_>>()
                    .join(", "),
                wall.elapsed().as_secs_f64()
            ));
            code
        }
        Err(e) => {
            say(&format!("error: {e}"));
            ExitCode::FAILURE
        }
    }
}

/// `fit FILE`: fits the latency model and prints it with its quality, then the TOML table for
/// the serving config. Exit codes: 0 done, 2 a file that cannot be fitted, a refused config,
/// or a `--node` the model does not have.
pub fn fit(args: &FitArgs) -> ExitCode {
    let loaded = match load_or_report(&args.config.load_options()) {
        Ok(l) => l,
        Err(code) => return code,
    };
    let nodes = &loaded.manifest.nodes;
    let node = match &args.node {
        // The table must be one the config can take: `chunking.cost.<node>` of a model node.
        Some(n) if !nodes.contains_key(n) => {
            say(&format!(
                "error: `--node` = {}: the model `{}` ({}) has no such node; its nodes: {}",
                config::problem::quote(n),
                config::problem::escape(&loaded.manifest.name),
                config::problem::escape(&loaded.model_origin),
                nodes
                    .keys()
                    .map(|k| config::problem::escape(k))
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
            return ExitCode::from(EXIT_CONFIG);
        }
        Some(n) => n.clone(),
        None => match nodes.keys().next() {
            Some(n) => n.clone(),
            None => {
                say("error: the model has no node to name the cost table after; give `--node`");
                return ExitCode::from(EXIT_CONFIG);
            }
        },
    };
    let (input, fit) = match crate::latency::fit_file::fit_file(&args.file) {
        Ok(r) => r,
        Err(e) => {
            say(&format!("error: cannot fit the latency model: {e}"));
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let source = args.file.display().to_string();
    let kind = match input {
        crate::latency::fit_file::FitInput::StepLog => "a replay step log",
        crate::latency::fit_file::FitInput::Csv => "a CSV of step features",
    };
    let mut out = format!(
        "fit of {} ({kind}): {}\n",
        config::problem::escape(&source),
        crate::text::plural(fit.samples as u64, "step")
    );
    for (k, v) in crate::latency::COEFFICIENT_KEYS
        .iter()
        .zip(fit.model.coefficients())
    {
        out.push_str(&format!("  {k:<24} {}\n", crate::text::plain_decimal(v)));
    }
    let underdetermined = fit.underdetermined();
    out.push_str(&format!(
        "  {:<24} {}\n",
        "R²",
        match fit.r_squared {
            _ if underdetermined => "n/a (the fit is underdetermined)".to_string(),
            None => "n/a (every step took the same time)".to_string(),
            Some(r) => format!("{r:.4}"),
        }
    ));
    if underdetermined {
        say(&format!(
            "warning: the fit is underdetermined: {} for {} of the model's terms that vary, which the steps determine only {} of; several models fit these steps equally well, so the coefficients are one of them and R² means nothing. Fit on more steps, with varied token counts, contexts and chunk positions.",
            crate::text::plural(fit.samples as u64, "step"),
            fit.observed_terms,
            fit.rank
        ));
    }
    out.push_str(&format!(
        "  {:<24} {:.1}%\n",
        "relative RMS error",
        fit.relative_rms * 100.0
    ));
    let e = &fit.abs_error_ms;
    out.push_str(&format!(
        "  {:<24} p50 {:.3}, p90 {:.3}, p99 {:.3}, max {:.3}\n\n",
        "|error| ms", e.p50, e.p90, e.p99, e.max
    ));
    out.push_str(&crate::latency::fit_file::render_toml(&fit, &node, &source));
    print_stdout(&out)
}

/// `check`: loads and validates everything, prints the layers and the effective table.
pub fn check(args: &ConfigArgs) -> ExitCode {
    let loaded = match load_or_report(&args.load_options()) {
        Ok(l) => l,
        Err(code) => return code,
    };
    // The `[replay]` settings are refused as `replay` refuses them; a model that replay cannot
    // drive at all is only noted: serving it needs no replay.
    if let Err(problems) = crate::replay::settings::check(&loaded.manifest, &loaded.settings.replay)
    {
        let (settings, model) = replay_problems(&loaded, problems);
        if !settings.is_empty() {
            let mut errors = ConfigErrors::default();
            errors.extend(settings);
            report(&errors);
            return ExitCode::from(EXIT_CONFIG);
        }
        for p in model {
            say(&format!("note: `replay` cannot drive this model: {p}"));
        }
    }
    let rows = loaded.rows();
    let mut out = format!(
        "model `{}` from {}\nlayers: {}\n\n{}",
        config::problem::escape(&loaded.manifest.name),
        config::problem::escape(&loaded.model_origin),
        config::problem::escape_join(&loaded.layers, " -> "),
        render_table(&rows)
    );
    out.push_str(&format!(
        "\nok: {}, {}, min_chunk_tokens {}\n",
        crate::text::plural(loaded.manifest.nodes.len() as u64, "node"),
        crate::text::plural(loaded.manifest.walks.len() as u64, "walk"),
        loaded.settings.chunking.min_chunk_tokens
    ));
    print_stdout(&out)
}

/// `budgets`: the effective table only, or its JSON.
pub fn budgets(args: &BudgetsArgs) -> ExitCode {
    let loaded = match load_or_report(&args.config.load_options()) {
        Ok(l) => l,
        Err(code) => return code,
    };
    let rows = loaded.rows();
    let out = if args.json {
        rows_json(&rows)
    } else {
        render_table(&rows)
    };
    print_stdout(&out)
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

/// The effective table as aligned text columns; `-` where there is none.
pub fn render_table(rows: &[BudgetRow]) -> String {
    let opt = |v: Option<u32>| v.map_or_else(|| "-".to_string(), |v| v.to_string());
    let mut cells = vec![[
        "node",
        "walk",
        "policy",
        "budget",
        "chunkable",
        "floor",
        "caps",
        "step ms",
        "model",
    ]
    .map(String::from)];
    for r in rows {
        let caps = r.walk_caps.as_ref().map_or_else(
            || "-".to_string(),
            |caps| {
                let parts: Vec<String> = caps
                    .iter()
                    .map(|(w, c)| format!("{}={c}", config::problem::escape(w)))
                    .collect();
                if parts.is_empty() {
                    "{}".to_string()
                } else {
                    parts.join(",")
                }
            },
        );
        let budget = match (r.max_batch_tokens, r.policy_budget) {
            (Some(b), _) => b.to_string(),
            // Distinguish a budget the config turned off from one the model never declared.
            (None, Some(_)) => "off".to_string(),
            (None, None) => "-".to_string(),
        };
        cells.push([
            config::problem::escape(&r.node),
            config::problem::escape(&r.walk),
            opt(r.policy_budget),
            budget,
            if r.chunkable { "yes" } else { "no" }.to_string(),
            opt(r.min_chunk_tokens),
            caps,
            r.max_step_ms
                .map_or_else(|| "-".to_string(), |ms| ms.to_string()),
            // Where the node's latency model comes from (its coefficients: `budgets --json`).
            match (r.cost.is_some(), r.learn_cost) {
                (true, true) => "config+learned",
                (true, false) => "config",
                (false, true) => "learned",
                (false, false) => "-",
            }
            .to_string(),
        ]);
    }
    let mut widths = [0usize; 9];
    for row in &cells {
        for (w, c) in widths.iter_mut().zip(row) {
            *w = (*w).max(c.chars().count());
        }
    }
    let mut out = String::new();
    for row in &cells {
        let line: Vec<String> = row
            .iter()
            .zip(widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        out.push_str(line.join("  ").trim_end());
        out.push('\n');
    }
    out
}

/// The JSON of `budgets --json` (`docs/config.md#the-command-line`): an array, one object per row, and a newline.
pub fn rows_json(rows: &[BudgetRow]) -> String {
    // BudgetRow holds only strings, numbers, booleans and string-keyed maps: it always
    // serializes.
    let mut s = serde_json::to_string_pretty(rows).unwrap_or_else(|_| "[]".to_string());
    s.push('\n');
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn row(node: &str, walk: &str) -> BudgetRow {
        BudgetRow {
            node: node.into(),
            walk: walk.into(),
            policy_budget: Some(8192),
            max_batch_tokens: Some(6144),
            chunkable: true,
            min_chunk_tokens: Some(64),
            walk_caps: Some(BTreeMap::from([
                ("decode".into(), 192),
                ("prefill".into(), 4096),
            ])),
            max_step_ms: None,
            cost: None,
            learn_cost: false,
        }
    }

    #[test]
    fn the_table_marks_off_budgets_and_lists_caps() {
        let mut off = row("talker", "prefill");
        off.max_batch_tokens = None;
        off.min_chunk_tokens = None;
        off.chunkable = false;
        off.walk_caps = None;
        let mut timed = row("llm", "mixed");
        timed.max_step_ms = Some(50.5);
        timed.cost = Some(BTreeMap::from([("base_ms", 8.0)]));
        let mut learned = row("llm", "decode");
        learned.learn_cost = true;
        learned.walk_caps = None;
        let mut both = learned.clone();
        both.walk = "prefill".into();
        both.cost = timed.cost.clone();
        let text = render_table(&[row("thinker", "mixed"), off, timed, learned, both]);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines[0],
            "node     walk     policy  budget  chunkable  floor  caps                     step ms  model"
        );
        assert_eq!(
            lines[1],
            "thinker  mixed    8192    6144    yes        64     decode=192,prefill=4096  -        -"
        );
        assert_eq!(
            lines[2],
            "talker   prefill  8192    off     no         -      -                        -        -"
        );
        assert_eq!(
            lines[3],
            "llm      mixed    8192    6144    yes        64     decode=192,prefill=4096  50.5     config"
        );
        assert_eq!(
            lines[4],
            "llm      decode   8192    6144    yes        64     -                        -        learned"
        );
        assert!(lines[5].ends_with("config+learned"), "{}", lines[5]);
    }

    #[test]
    fn json_rows_have_the_contract_keys() {
        let v: serde_json::Value =
            serde_json::from_str(&rows_json(&[row("thinker", "mixed")])).unwrap();
        assert_eq!(
            v,
            serde_json::json!([{
                "node": "thinker", "walk": "mixed", "policy_budget": 8192,
                "max_batch_tokens": 6144, "chunkable": true, "min_chunk_tokens": 64,
                "walk_caps": {"decode": 192, "prefill": 4096},
                "max_step_ms": null, "cost": null, "learn_cost": false
            }])
        );
    }

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
        assert_eq!(r.requests, Some(10));
        assert_eq!(r.rate_scale, 2.5);
        assert_eq!(r.metrics_listen, Some(Listen::Off));
        assert!(r.budget_off && r.skip_bad_lines && r.hold && !r.watch_config && r.no_progress);
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
        assert_eq!(r.format, Some(TraceFormat::GenericCsv));
        assert_eq!(r.arrivals, Some(Arrivals::Gamma { qps: 4.0, cv: 2.0 }));
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
