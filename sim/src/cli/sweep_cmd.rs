//! `sweep` (`docs/sweep.md`): the grid of replays, the capacity search, the axes (each
//! run through [`sweep_axis`]), their outputs, and stopping on a signal. Each cell's replay is
//! `crate::sweep::cells`'; each axis is a file of `crate::sweep` ([`axes`] lists them).

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use super::replay_cmd::{is_usage, load_for_replay};
use super::*;
use crate::sweep::axis::{write_files, Axis, AxisRun};
use crate::sweep::fleet_axis::{parse_fleets, Fleet, FleetAxis};
use crate::sweep::kv_axis::{parse_kv_blocks, KvAxis};
use crate::sweep::order_axis::{parse_orders, OrderAxis};
use crate::sweep::pd_axis::{parse_layouts, PdAxis};

/// `sweep` (`docs/sweep.md`): reads the trace once, replays it for every budget x rate
/// scale of the grid (and the capacity search's probes) on `--jobs` threads, each replay in its
/// own actix system with metrics off and no progress bar of its own; prints the table and
/// writes the outputs. Exit codes: 0 done, 2 refused arguments or config, 1 a failed replay or
/// write.
pub fn sweep(args: &SweepArgs) -> ExitCode {
    use crate::sweep::{self, SweepOptions};
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
        axis,
        slo,
    } = match parse_grid(args, &setup) {
        Ok(g) => g,
        Err(e) => return usage(&e),
    };
    let traces = match trace_list(args, slo) {
        Ok(t) => t,
        Err(e) => return usage(&e),
    };
    let inputs: Vec<PathBuf> = load
        .config_files()
        .into_iter()
        .chain(load.configs.iter().cloned())
        .chain(load.model_path())
        .chain(traces.iter().filter_map(|t| t.path.clone()))
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
    let tbt = slo.as_ref().and_then(|s| s.tbt_p99_ms);
    let cells: Vec<f64> = budgets
        .iter()
        .filter_map(|b| b.time())
        .map(|t| t.ms())
        .collect();
    for w in crate::replay::time_budget_objective_warnings(&loaded.table, &setup, tbt, &cells) {
        say(&format!("warning: {w}"));
    }
    // Every trace is read, and every value of the axis checked against it as the replay
    // checks its settings, before anything is created or run: a refusal is usage (exit 2) and
    // leaves `--out` as it was.
    let mut read = Vec::with_capacity(traces.len());
    for t in &traces {
        let base = crate::replay::ReplayOptions {
            progress: false,
            inputs: inputs.clone(),
            trace: t.path.clone(),
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
        if let Some(axis) = &axis {
            if let Err(e) = axis.check(&loaded, &trace) {
                return usage(&e);
            }
        }
        read.push((base, trace));
    }
    if let Some(dir) = &args.emit_jobs {
        let (base, trace) = &read[0];
        let plan = super::sweep_jobs::Plan {
            load: &load,
            loaded: &loaded,
            setup: &setup,
            base,
            trace,
            budgets: &budgets,
            rates: &rates,
            slo,
        };
        return super::sweep_jobs::emit(args, dir, &plan);
    }
    // Created only now that every input was accepted, and removed again if a plain sweep
    // writes nothing into it.
    let created = !args.out.exists();
    if let Err(e) = std::fs::create_dir_all(&args.out) {
        say(&format!(
            "error: cannot create the output directory `{}`: {e}",
            config::problem::escape(&args.out.display().to_string())
        ));
        return ExitCode::from(EXIT_CONFIG);
    }
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicI32::new(0));
    let _signals = sweep_signals(stop.clone());
    let wall = std::time::Instant::now();
    let several = args.traces.is_some();
    let mut done: Vec<(String, Vec<AxisSweep>)> = Vec::new();
    let mut code = ExitCode::SUCCESS;
    for (t, (base, trace)) in traces.iter().zip(&read) {
        let opts = SweepOptions {
            budgets: budgets.clone(),
            rates: rates.clone(),
            slo: t.slo,
            jobs: args.jobs.map_or_else(sweep::run::default_jobs, usize::from),
            progress: !args.no_progress,
            step_time_rate: args.step_time_rate,
            settings: sweep::cells::labels(&loaded, &setup, base, trace, &budgets),
            trace_rps: sweep::cells::trace_rps(trace),
            stop: Some(stop.clone()),
        };
        let out = match &t.dir {
            Some(d) => args.out.join(d),
            None => args.out.clone(),
        };
        if several {
            let _ = print_stdout(&format!("trace: {}\n", t.label));
        }
        let cx = AxisContext {
            out: &out,
            opts: &opts,
            loaded: &loaded,
            base,
            trace,
            inputs: &inputs,
        };
        let ran = match &axis {
            Some(axis) => axis.run(&cx),
            None => grid_run(&cx, &stop, created && !several),
        };
        let Ran { code: c, runs } = ran;
        code = c;
        let stopped = runs.iter().any(|(_, s)| s.interrupted.is_some());
        // Without `--traces`, the one trace is named as its sweep's settings name it.
        let label = match runs.first() {
            Some((_, s)) if t.label.is_empty() => crate::sweep::verdict::trace_label(s),
            _ => t.label.clone(),
        };
        done.push((label, runs));
        if stopped || code != ExitCode::SUCCESS {
            break;
        }
    }
    // The verdict across traces (or across an axis's runs), beside their directories; a plain
    // sweep's is in its own outputs. None after a failure or a signal: it would compare
    // capacities some of which were never searched.
    if (several || axis.is_some()) && code == ExitCode::SUCCESS {
        let named: Vec<(String, Vec<crate::sweep::verdict::Run<'_>>)> = done
            .iter()
            .map(|(label, runs)| {
                (
                    label.clone(),
                    runs.iter().map(|(v, s)| (v.clone(), s)).collect(),
                )
            })
            .collect();
        if let Some(v) = crate::sweep::verdict::Verdict::of(&named) {
            let _ = print_stdout(&v.table());
            let written = v
                .files()
                .map_err(|e| e.to_string())
                .and_then(|files| write_files(&args.out, &files).map_err(|e| e.to_string()));
            match written {
                Ok(paths) => say(&format!(
                    "wrote the verdict to {} in {:.1} s: {}",
                    config::problem::escape(&args.out.display().to_string()),
                    wall.elapsed().as_secs_f64(),
                    file_names(&paths)
                )),
                Err(e) => {
                    say(&format!("error: {e}"));
                    return ExitCode::FAILURE;
                }
            }
        }
    }
    code
}

/// One trace a sweep runs its grid on: where it is (`None`: the bundled trace), its label and
/// subdirectory (with `--traces`), and its objective.
struct TraceRun {
    path: Option<PathBuf>,
    label: String,
    dir: Option<String>,
    slo: Option<crate::sweep::Slo>,
}

/// The traces of `--traces` (or the one of `--trace`), each with its objective: `slo`, with
/// `--trace-slo-ttft-p90`'s bound for it over the TTFT bound.
fn trace_list(args: &SweepArgs, slo: Option<crate::sweep::Slo>) -> Result<Vec<TraceRun>, String> {
    let Some(list) = &args.traces else {
        return Ok(vec![TraceRun {
            path: args.source.trace.clone(),
            label: String::new(),
            dir: None,
            slo,
        }]);
    };
    let paths = crate::sweep::grid::split("--traces", list).map_err(|e| e.to_string())?;
    let ttft: Vec<Option<f64>> = match &args.trace_slo_ttft_p90 {
        None => vec![None; paths.len()],
        Some(l) => {
            let items =
                crate::sweep::grid::split("--trace-slo-ttft-p90", l).map_err(|e| e.to_string())?;
            if items.len() != paths.len() {
                return Err(format!(
                    "`--trace-slo-ttft-p90` takes one bound per trace of `--traces` ({}), got {}",
                    paths.len(),
                    items.len()
                ));
            }
            items
                .iter()
                .map(|i| {
                    super::slo_ms(i)
                        .map(Some)
                        .map_err(|e| format!("`--trace-slo-ttft-p90`: {e}"))
                })
                .collect::<Result<_, _>>()?
        }
    };
    let mut out: Vec<TraceRun> = Vec::with_capacity(paths.len());
    for (path, ttft) in paths.iter().zip(ttft) {
        let path = PathBuf::from(path);
        let label = path.file_name().map_or_else(
            || path.display().to_string(),
            |f| f.to_string_lossy().into_owned(),
        );
        // The same file however it is spelt (`./a.csv`, `a.csv`, a link to it).
        let same = |p: &Path| match (std::fs::canonicalize(p), std::fs::canonicalize(&path)) {
            (Ok(a), Ok(b)) => a == b,
            _ => p == path.as_path(),
        };
        if out.iter().any(|t| t.path.as_deref().is_some_and(same)) {
            return Err(format!(
                "`--traces` names `{}` twice",
                config::problem::escape(&path.display().to_string())
            ));
        }
        // A directory per trace, named by the file, told apart by its position when two
        // files share a name.
        let stem: String = label
            .split('.')
            .next()
            .unwrap_or("trace")
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        let mut dir = format!("trace-{stem}");
        if out.iter().any(|t| t.dir.as_deref() == Some(dir.as_str())) {
            dir = format!("trace-{}-{stem}", out.len() + 1);
        }
        let slo = match (ttft, slo) {
            (None, s) => s,
            (Some(t), s) => Some(
                crate::sweep::Slo::new(s.and_then(|s| s.tbt_p99_ms), Some(t))
                    .map_err(|e| format!("`--trace-slo-ttft-p90`: {e}"))?,
            ),
        };
        out.push(TraceRun {
            path: Some(path),
            label,
            dir: Some(dir),
            slo,
        });
    }
    Ok(out)
}

/// A finished sweep, with the axis value it ran under (`None` without an axis).
type AxisSweep = (Option<String>, crate::sweep::Sweep);

/// What a run of the grid (plain, or along an axis) ended with: its exit code, and each
/// sweep that finished, with the axis value it ran under.
struct Ran {
    code: ExitCode,
    runs: Vec<AxisSweep>,
}

/// The grid without an axis, written into `cx.out` (removed again when `remove_if_empty` and
/// nothing was written).
fn grid_run(
    cx: &AxisContext<'_>,
    stop: &std::sync::Arc<std::sync::atomic::AtomicI32>,
    remove_if_empty: bool,
) -> Ran {
    use crate::sweep;
    let failed = |code: ExitCode| Ran {
        code,
        runs: Vec::new(),
    };
    let remove = || {
        if remove_if_empty {
            let _ = std::fs::remove_dir(cx.out);
        }
    };
    let usage = |e: &dyn std::fmt::Display| {
        say(&format!("error: {e}"));
        failed(ExitCode::from(EXIT_CONFIG))
    };
    if let Err(e) = std::fs::create_dir_all(cx.out) {
        return usage(&format!(
            "cannot create the output directory `{}`: {e}",
            config::problem::escape(&cx.out.display().to_string())
        ));
    }
    let manifest = &cx.loaded.manifest;
    let settings = &cx.loaded.settings;
    let run = |budget: sweep::Budget, rate: f64| -> Result<sweep::RunSummary, String> {
        sweep::cells::run_cell(manifest, settings, cx.base, cx.trace, budget, rate, stop)
    };
    let wall = std::time::Instant::now();
    let result = match sweep::run_sweep(cx.opts, run) {
        Ok(r) => r,
        Err(e @ (sweep::SweepError::Options(_) | sweep::SweepError::Slo(_))) => {
            remove();
            return usage(&e);
        }
        Err(e) => {
            remove();
            say(&format!("error: {e}"));
            return failed(ExitCode::FAILURE);
        }
    };
    let mut code = print_stdout(&sweep::output::table(&result));
    if let Some(signal) = &result.interrupted {
        say(&format!(
            "interrupted by {signal}: the outputs cover the replays that finished"
        ));
        code = ExitCode::from(crate::replay::signal_exit_code(signal));
    }
    match sweep::write_outputs(&result, cx.out, cx.inputs) {
        Ok(written) => {
            say(&format!(
                "wrote {} to {} in {:.1} s: {}",
                crate::text::plural(written.paths.len() as u64, "file"),
                config::problem::escape(&cx.out.display().to_string()),
                wall.elapsed().as_secs_f64(),
                file_names(&written.paths)
            ));
            Ran {
                code,
                runs: vec![(None, result)],
            }
        }
        Err(
            e @ (sweep::SweepError::OutputIsInput(_)
            | sweep::SweepError::OutputNotADirectory(_)
            | sweep::SweepError::OutputNotAFile(_)),
        ) => {
            remove();
            usage(&e)
        }
        Err(e) => {
            remove();
            say(&format!("error: {e}"));
            failed(ExitCode::FAILURE)
        }
    }
}

/// The grid `sweep`'s flags ask for, checked.
struct Grid {
    budgets: Vec<crate::sweep::Budget>,
    rates: Vec<f64>,
    axis: Option<Box<dyn AnyAxis>>,
    slo: Option<crate::sweep::Slo>,
}

/// The axes of a sweep, each parsed from its flags (the arguments let at most one be given):
/// adding an axis is its file in `sim/src/sweep/`, its flag in [`SweepArgs`] and one line here.
fn axes(
    args: &SweepArgs,
    setup: &crate::replay::ReplaySetup,
) -> Result<Vec<Option<Box<dyn AnyAxis>>>, crate::sweep::GridError> {
    let config = Fleet {
        router: setup.fleet.router,
        workers: setup.fleet.workers,
    };
    let (workers, routers) = (args.workers.as_deref(), args.routers.as_deref());
    Ok(vec![
        along::<KvAxis>(args.kv_blocks.as_deref().map(parse_kv_blocks).transpose()?),
        along::<OrderAxis>(args.orders.as_deref().map(parse_orders).transpose()?),
        along::<PdAxis>(parse_layouts(args.pd.as_deref(), workers, config.workers)?),
        along::<FleetAxis>(parse_fleets(workers, routers, config)?),
    ])
}

/// `--budgets`, `--rates`, the axes' flags, the SLO flags and `--step-time-rate`, or the first
/// refused one.
fn parse_grid(args: &SweepArgs, setup: &crate::replay::ReplaySetup) -> Result<Grid, String> {
    use crate::sweep;
    let budgets = sweep::parse_budgets(&args.budgets).map_err(|e| e.to_string())?;
    let rates = sweep::parse_rates(&args.rates).map_err(|e| e.to_string())?;
    let axis = axes(args, setup)
        .map_err(|e| e.to_string())?
        .into_iter()
        .flatten()
        .next();
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
        axis,
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

/// What every run of an axis shares: the base options, config, trace and where they go.
struct AxisContext<'a> {
    out: &'a Path,
    opts: &'a crate::sweep::SweepOptions,
    loaded: &'a LoadedConfig,
    base: &'a crate::replay::ReplayOptions,
    trace: &'a crate::replay::Trace,
    inputs: &'a [PathBuf],
}

/// An axis, whichever it is, with its values.
trait AnyAxis {
    /// [`Axis::check`].
    fn check(&self, loaded: &LoadedConfig, trace: &crate::replay::Trace) -> Result<(), String>;
    /// [`sweep_axis`].
    fn run(&self, cx: &AxisContext<'_>) -> Ran;
}

/// The values of axis `A`, in the order they run.
struct Along<A: Axis>(Vec<A::Value>);

impl<A: Axis> AnyAxis for Along<A> {
    fn check(&self, loaded: &LoadedConfig, trace: &crate::replay::Trace) -> Result<(), String> {
        A::check(&self.0, loaded, trace)
    }
    fn run(&self, cx: &AxisContext<'_>) -> Ran {
        sweep_axis::<A>(&self.0, cx)
    }
}

/// The values of axis `A`, if its flag was given, as an axis to run.
fn along<A: Axis + 'static>(values: Option<Vec<A::Value>>) -> Option<Box<dyn AnyAxis>> {
    values.map(|v| Box::new(Along::<A>(v)) as Box<dyn AnyAxis>)
}

/// A sweep along axis `A`: the grid once per value of `values`, each written into `OUT/<dir>/`
/// with the usual files, then the axis's comparison into `OUT/`. A signal ends it after the run
/// it interrupted; the comparison covers the runs that finished.
fn sweep_axis<A: Axis>(values: &[A::Value], cx: &AxisContext<'_>) -> Ran {
    use crate::sweep;
    let wall = std::time::Instant::now();
    let stop = cx.opts.stop.clone().unwrap_or_default();
    let mut runs = Vec::new();
    let mut code = ExitCode::SUCCESS;
    for &value in values {
        let (settings, label) = A::apply(&cx.loaded.settings, value);
        let mut o = cx.opts.clone();
        // The axis's value, over the config's.
        o.settings.retain(|(k, _)| k != A::SETTING);
        o.settings.push((A::SETTING.into(), label));
        let dir = cx.out.join(A::dir_name(value));
        if let Err(e) = std::fs::create_dir_all(&dir) {
            say(&format!(
                "error: cannot create the output directory `{}`: {e}",
                config::problem::escape(&dir.display().to_string())
            ));
            return ran(ExitCode::from(EXIT_CONFIG), runs);
        }
        let manifest = &cx.loaded.manifest;
        let result = match sweep::run_sweep(&o, |b, r| {
            sweep::cells::run_cell(manifest, &settings, cx.base, cx.trace, b, r, &stop)
        }) {
            Ok(r) => r,
            Err(e) => {
                say(&format!("error: {}: {e}", A::failure(value)));
                return ran(ExitCode::FAILURE, runs);
            }
        };
        code = print_stdout(&format!(
            "{}\n{}",
            A::heading(value),
            sweep::output::table(&result)
        ));
        if let Err(e) = sweep::write_outputs(&result, &dir, cx.inputs) {
            say(&format!("error: {e}"));
            return ran(ExitCode::FAILURE, runs);
        }
        let interrupted = result.interrupted.clone();
        runs.push(AxisRun {
            value,
            sweep: result,
        });
        if let Some(signal) = interrupted {
            say(&format!(
                "interrupted by {signal}: the outputs cover the replays that finished"
            ));
            code = ExitCode::from(crate::replay::signal_exit_code(&signal));
            break;
        }
    }
    let written = A::compare(&runs).and_then(|cmp| {
        let _ = print_stdout(&cmp.table);
        write_files(cx.out, &cmp.files)
    });
    match written {
        Ok(paths) => {
            say(&format!(
                "wrote {} runs into {}/{}-*/ and {} in {:.1} s",
                runs.len(),
                config::problem::escape(&cx.out.display().to_string()),
                A::DIR_PREFIX,
                file_names(&paths),
                wall.elapsed().as_secs_f64()
            ));
            ran(code, runs)
        }
        Err(e) => {
            say(&format!("error: {e}"));
            ran(ExitCode::FAILURE, runs)
        }
    }
}

/// The runs of an axis as [`Ran`]: each sweep with its value's name.
fn ran<V: std::fmt::Display>(code: ExitCode, runs: Vec<AxisRun<V>>) -> Ran {
    Ran {
        code,
        runs: runs
            .into_iter()
            .map(|r| (Some(r.value.to_string()), r.sweep))
            .collect(),
    }
}
