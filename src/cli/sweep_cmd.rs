//! `sweep` (`docs/replay.md#sweeps`): the grid of replays, the capacity search, the KV axis,
//! their outputs, and stopping on a signal. Each cell's replay is `crate::sweep::cells`'.

use std::path::PathBuf;
use std::process::ExitCode;

use super::replay_cmd::{is_usage, load_for_replay};
use super::*;

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
    if let Some(dir) = &args.merge {
        return super::sweep_jobs::merge(args, dir);
    }
    let load = args.config.load_options();
    let (loaded, setup) = match load_for_replay(&load, &args.settings.flags()) {
        Ok((l, s)) => {
            init_logging(&l);
            super::replay_cmd::note_built_in_copies(&l);
            (l, s)
        }
        Err(errors) => {
            report(&errors);
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let Grid {
        budgets,
        rates,
        kv_axis,
        order_axis,
        fleet_axis,
        slo,
    } = match parse_grid(args, &setup) {
        Ok(g) => g,
        Err(e) => return usage(&e),
    };
    let inputs: Vec<PathBuf> = load
        .config_files()
        .into_iter()
        .chain(load.configs.iter().cloned())
        .chain(load.model_path())
        .chain(args.source.trace.clone())
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
        progress: false,
        inputs: inputs.clone(),
        ..args.source.options()
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
    // Every pool of the KV axis is checked as the replay checks its own, before anything is
    // created or run: a refusal is usage (exit 2) and leaves `--out` as it was.
    if let Some(axis) = &kv_axis {
        if let Err(e) = check_kv_axis(&loaded, &trace, axis) {
            return usage(&e);
        }
    }
    if let Some(dir) = &args.emit_jobs {
        let plan = super::sweep_jobs::Plan {
            load: &load,
            loaded: &loaded,
            setup: &setup,
            base: &base,
            trace: &trace,
            budgets: &budgets,
            rates: &rates,
            slo,
        };
        return super::sweep_jobs::emit(args, dir, &plan);
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
    if let Some(axis) = order_axis {
        return sweep_order_axis(args, &opts, &loaded, &base, &trace, &inputs, &axis);
    }
    if let Some(axis) = fleet_axis {
        return super::sweep_fleet::sweep_fleet_axis(
            args, &opts, &loaded, &base, &trace, &inputs, &axis,
        );
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

/// The grid `sweep`'s flags ask for, checked.
struct Grid {
    budgets: Vec<crate::sweep::Budget>,
    rates: Vec<f64>,
    kv_axis: Option<Vec<crate::sweep::kv_axis::KvBlocks>>,
    order_axis: Option<Vec<crate::order::Order>>,
    fleet_axis: Option<super::sweep_fleet::FleetAxis>,
    slo: Option<crate::sweep::Slo>,
}

/// `--budgets`, `--rates`, `--kv-blocks`, `--orders`, `--workers` and `--routers` (the
/// config's fleet filling in the one not given), the SLO flags and `--step-time-rate`, or the
/// first refused one.
fn parse_grid(args: &SweepArgs, setup: &crate::replay::ReplaySetup) -> Result<Grid, String> {
    use crate::sweep;
    let budgets = sweep::parse_budgets(&args.budgets).map_err(|e| e.to_string())?;
    let rates = sweep::parse_rates(&args.rates).map_err(|e| e.to_string())?;
    let kv_axis = args
        .kv_blocks
        .as_deref()
        .map(sweep::kv_axis::parse_kv_blocks)
        .transpose()
        .map_err(|e| e.to_string())?;
    let order_axis = args
        .orders
        .as_deref()
        .map(sweep::order_axis::parse_orders)
        .transpose()
        .map_err(|e| e.to_string())?;
    let fleet_axis = super::sweep_fleet::parse_fleet_axis(args, setup)?;
    let slo = if args.slo_tbt_p99.is_some() || args.slo_ttft_p90.is_some() {
        Some(sweep::Slo::new(args.slo_tbt_p99, args.slo_ttft_p90).map_err(|e| e.to_string())?)
    } else {
        None
    };
    if let Some(r) = args.step_time_rate.filter(|r| !rates.contains(r)) {
        return Err(format!(
            "`--step-time-rate`: the step-time rate {} is not one of the rate scales of `--rates`",
            crate::text::fmt_rate(r)
        ));
    }
    Ok(Grid {
        budgets,
        rates,
        kv_axis,
        order_axis,
        fleet_axis,
        slo,
    })
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

/// Refuses a pool of the KV axis that the replay would refuse: its `[replay]` settings, or a
/// request of the trace that could never fit in it.
fn check_kv_axis(
    loaded: &LoadedConfig,
    trace: &crate::replay::Trace,
    axis: &[crate::sweep::kv_axis::KvBlocks],
) -> Result<(), String> {
    for kv in axis {
        let (settings, _) = crate::sweep::cells::with_kv(&loaded.settings, *kv);
        crate::replay::ReplaySetup::resolve(&loaded.manifest, &settings)
            .and_then(|setup| crate::replay::check_kv_fits(&setup, trace))
            .map_err(|e| format!("`--kv-blocks` names {kv}: {e} (no replay ran)"))?;
    }
    Ok(())
}

/// `sweep --orders` (`docs/sweep.md#orders`): the grid once per order, each written into
/// `OUT/order-<order>/`, then the cells together (`OUT/sweep.csv`, with an `order` column) and
/// their comparison (`OUT/orders.*`).
fn sweep_order_axis(
    args: &SweepArgs,
    opts: &crate::sweep::SweepOptions,
    loaded: &LoadedConfig,
    base: &crate::replay::ReplayOptions,
    trace: &crate::replay::Trace,
    inputs: &[PathBuf],
    axis: &[crate::order::Order],
) -> ExitCode {
    use crate::sweep;
    use crate::sweep::order_axis;
    let wall = std::time::Instant::now();
    let stop = opts.stop.clone().unwrap_or_default();
    let mut runs = Vec::new();
    let mut code = ExitCode::SUCCESS;
    for &order in axis {
        let (settings, label) = order_axis::with_order(&loaded.settings, order);
        let mut o = opts.clone();
        o.settings.push(("order".into(), label));
        let dir = args.out.join(order_axis::dir_name(order));
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
                say(&format!("error: under order {order}: {e}"));
                return ExitCode::FAILURE;
            }
        };
        code = print_stdout(&format!(
            "order: {order}\n{}",
            sweep::output::table(&result)
        ));
        if let Err(e) = sweep::write_outputs(&result, &dir, inputs) {
            say(&format!("error: {e}"));
            return ExitCode::FAILURE;
        }
        runs.push((order, result));
    }
    let cmp = order_axis::OrderComparison::of(&runs);
    let _ = print_stdout(&cmp.table());
    match cmp.write(&runs, &args.out) {
        Ok(paths) => {
            say(&format!(
                "wrote {} runs into {}/order-*/ and {} in {:.1} s",
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
