//! The fake replays the sweep's unit tests share; `tests/<module>.rs` holds the tests of the larger modules.

use super::*;

/// A fake replay: latency grows with rate, more for larger budgets' TBT and smaller
/// budgets' TTFT, like the real trade-off.
pub(crate) fn fake(budget: Budget, rate: f64) -> Result<RunSummary, String> {
    let b = f64::from(budget.get().unwrap_or(8192));
    let tbt = 8.0 + b * 0.02 * rate;
    let ttft = 200.0 * rate * rate * 4096.0 / b.min(4096.0);
    let mut steps: Vec<f64> = (0..200)
        .map(|i| 8.0 + b * 0.02 * f64::from(i % 10) / 10.0)
        .collect();
    Ok(RunSummary {
        requests: 100,
        steps: 200,
        overruns: u64::from(budget == Budget::Off),
        budget_utilisation: budget.get().map(|_| 0.75),
        tbt_p50_ms: Some(tbt / 2.0),
        tbt_p99_ms: Some(tbt),
        ttft_p50_ms: Some(ttft / 3.0),
        ttft_p90_ms: Some(ttft / 1.5),
        ttft_p99_ms: Some(ttft),
        step_ms: StepTimes::from_samples(&mut steps),
    })
}

pub(crate) fn options(slo: Option<Slo>) -> SweepOptions {
    SweepOptions {
        budgets: parse_budgets("512,2048,off").unwrap(),
        rates: parse_rates("0.5,1,2").unwrap(),
        slo,
        jobs: 2,
        progress: false,
        step_time_rate: None,
        settings: vec![
            ("trace".into(), "bundled <test> & co".into()),
            ("cost".into(), "8 ms + 0.02 ms/token".into()),
        ],
        trace_rps: None,
        stop: None,
    }
}

pub(crate) fn sample_sweep() -> Sweep {
    let slo = Slo::new(Some(60.0), Some(5000.0)).unwrap();
    run_sweep(&options(Some(slo)), fake).unwrap()
}

/// The file names of `paths`, in order.
pub(crate) fn names(paths: &[std::path::PathBuf]) -> Vec<String> {
    paths
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect()
}
