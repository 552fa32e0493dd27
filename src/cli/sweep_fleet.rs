//! `sweep --workers LIST --routers LIST` (`docs/fleet.md#in-a-sweep`): the grid once per router
//! and fleet size, each written into `OUT/fleet-<router>-<n>/`, then the cells together
//! (`OUT/sweep.csv`, with `router` and `workers` columns) and the fewest workers that meet the
//! objective (`OUT/fleet.*`).

use std::path::PathBuf;
use std::process::ExitCode;

use super::*;
use crate::replay::RouterKind;
use crate::sweep::fleet_axis::{self, FleetComparison, FleetRun};

/// The fleets a sweep runs: every router with every size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct FleetAxis {
    /// The routers, in the order given.
    pub routers: Vec<RouterKind>,
    /// The fleet sizes, ascending.
    pub workers: Vec<u32>,
}

/// `--workers` and `--routers`, the one not given taken from the config's `[replay.fleet]`;
/// `None` when neither is given.
///
/// # Errors
/// A refused list, naming its flag.
pub(super) fn parse_fleet_axis(
    args: &SweepArgs,
    setup: &crate::replay::ReplaySetup,
) -> Result<Option<FleetAxis>, String> {
    if args.workers.is_none() && args.routers.is_none() {
        return Ok(None);
    }
    let workers = match &args.workers {
        Some(list) => fleet_axis::parse_workers(list).map_err(|e| e.to_string())?,
        None => vec![setup.fleet.workers],
    };
    let routers = match &args.routers {
        Some(list) => fleet_axis::parse_routers(list).map_err(|e| e.to_string())?,
        None => vec![setup.fleet.router],
    };
    Ok(Some(FleetAxis { routers, workers }))
}

/// Runs the grid on every fleet of `axis` (routers in the order given, sizes ascending), writes
/// each run's outputs into its directory, then the combined cells and the comparison.
pub(super) fn sweep_fleet_axis(
    args: &SweepArgs,
    opts: &crate::sweep::SweepOptions,
    loaded: &LoadedConfig,
    base: &crate::replay::ReplayOptions,
    trace: &crate::replay::Trace,
    inputs: &[PathBuf],
    axis: &FleetAxis,
) -> ExitCode {
    use crate::sweep;
    let wall = std::time::Instant::now();
    let stop = opts.stop.clone().unwrap_or_default();
    let mut runs = Vec::new();
    let mut code = ExitCode::SUCCESS;
    for &router in &axis.routers {
        for &workers in &axis.workers {
            let (settings, label) = fleet_axis::with_fleet(&loaded.settings, router, workers);
            let mut o = opts.clone();
            o.settings.push(("fleet".into(), label));
            let dir = args.out.join(fleet_axis::dir_name(router, workers));
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
                    say(&format!(
                        "error: with {} behind {router}: {e}",
                        crate::text::plural(u64::from(workers), "worker")
                    ));
                    return ExitCode::FAILURE;
                }
            };
            code = print_stdout(&format!(
                "fleet: {} behind {router}\n{}",
                crate::text::plural(u64::from(workers), "worker"),
                sweep::output::table(&result)
            ));
            if let Err(e) = sweep::write_outputs(&result, &dir, inputs) {
                say(&format!("error: {e}"));
                return ExitCode::FAILURE;
            }
            let interrupted = result.interrupted.clone();
            runs.push(FleetRun {
                router,
                workers,
                sweep: result,
            });
            if let Some(signal) = interrupted {
                say(&format!(
                    "interrupted by {signal}: the outputs cover the replays that finished"
                ));
                code = ExitCode::from(crate::replay::signal_exit_code(&signal));
                return write_comparison(args, &runs, wall, code);
            }
        }
    }
    write_comparison(args, &runs, wall, code)
}

/// Prints the comparison of `runs` and writes it with the combined cells.
fn write_comparison(
    args: &SweepArgs,
    runs: &[FleetRun],
    wall: std::time::Instant,
    code: ExitCode,
) -> ExitCode {
    let cmp = FleetComparison::of(runs);
    let _ = print_stdout(&cmp.table());
    match cmp.write(runs, &args.out) {
        Ok(paths) => {
            say(&format!(
                "wrote {} runs into {}/fleet-*/ and {} in {:.1} s",
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
