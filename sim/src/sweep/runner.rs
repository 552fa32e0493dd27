//! The one runner of a grid: every cell on a bounded pool of threads with one progress bar,
//! then each budget's capacity search, stopped early by a signal.

use std::fmt;
use std::io::IsTerminal;
use std::sync::atomic::Ordering;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use super::{capacity, run, signal_name, Budget, Capacity, Cell, NotRun, RunSummary, Sweep};
use super::{SweepError, SweepOptions};

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
                .map(|search| Capacity::new(*b, search, opts.trace_rps))
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
        trace_rate_rps: opts.trace_rps,
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
mod tests {
    use super::super::tests::{fake, options, sample_sweep};
    use super::super::{Bound, Slo};
    use super::*;
    use std::sync::atomic::{AtomicI32, AtomicUsize};
    use std::sync::Arc;

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
}
