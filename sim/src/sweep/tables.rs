//! The sweep's tables and notes, as rows of text: the same figures in the terminal table
//! (`output`) and the HTML report (`html`).

use super::{Bound, Sweep};
use crate::text::fmt_rate;

/// A figure in ms as the terminal tables show it: one decimal, `-` for none.
pub(crate) fn ms(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |v| format!("{v:.1}"))
}

/// How many replays the grid ran: `1 replay`, `12 replays`.
pub fn replays(sweep: &Sweep) -> String {
    crate::text::plural(sweep.cells.len() as u64, "replay")
}

/// The budgets, as given: `512, 1024, off`.
pub fn budget_list(sweep: &Sweep) -> String {
    let budgets: Vec<String> = sweep.budgets.iter().map(ToString::to_string).collect();
    budgets.join(", ")
}

/// What a reader must know before trusting the figures, one sentence each: that the sweep was
/// interrupted (and which cells did not run), and each budget whose grid contradicts rising
/// latency. Empty for a complete sweep of monotone budgets.
pub fn notes(sweep: &Sweep) -> Vec<String> {
    let mut out = Vec::new();
    if let Some(signal) = &sweep.interrupted {
        let total = sweep.cells.len() + sweep.not_run.len();
        let not_run: Vec<String> = sweep
            .not_run
            .iter()
            .map(|c| format!("{} at {}x", c.budget, fmt_rate(c.rate_scale)))
            .collect();
        out.push(format!(
            "interrupted by {signal}: {} of {total} grid replays finished{}{}",
            sweep.cells.len(),
            if not_run.is_empty() {
                String::new()
            } else {
                format!("; not run: {}", not_run.join(", "))
            },
            if sweep.slo.is_some() {
                "; capacity searches that did not finish are left out"
            } else {
                ""
            }
        ));
    }
    if let Some(note) = all_missed(sweep) {
        out.push(note);
    }
    for c in &sweep.capacity {
        if let Some(n) = c.search.non_monotone {
            out.push(format!(
                "budget {}: latency does not rise with load on this grid ({}x misses the SLO while {}x meets it); its capacity is the highest rate below the first miss",
                c.budget,
                fmt_rate(n.misses_at),
                fmt_rate(n.meets_at)
            ));
        }
    }
    out
}

/// When every cell of the grid missed the objective, that the grid's rates are all above every
/// capacity (which only the search's own replays found), and rates that would bracket them.
fn all_missed(sweep: &Sweep) -> Option<String> {
    if sweep.slo.is_none()
        || sweep.cells.is_empty()
        || sweep.cells.iter().any(|c| c.meets_slo != Some(false))
    {
        return None;
    }
    let caps: Vec<f64> = sweep
        .capacity
        .iter()
        .filter_map(|c| c.search.rate_scale)
        .collect();
    let lowest = sweep.rates.first().copied().unwrap_or(1.0);
    let mut text = format!(
        "every cell misses the objective: each budget's capacity is below the lowest rate scale of the grid ({}x), found by the search's own replays only",
        fmt_rate(lowest)
    );
    let lo = caps.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = caps.iter().copied().fold(0.0, f64::max);
    if lo.is_finite() && hi > 0.0 {
        let clamp = |r: f64| {
            crate::text::round3(r.clamp(super::grid::MIN_RATE_SCALE, super::grid::MAX_RATE_SCALE))
                .max(0.001)
        };
        let (a, c) = (clamp(lo / 2.0), clamp(hi * 2.0));
        let b = clamp((a * c).sqrt());
        let mut rates = vec![a, b, c];
        rates.dedup();
        let listed: Vec<String> = rates.into_iter().map(fmt_rate).collect();
        text.push_str(&format!(
            "; rates that bracket the capacities: --rates {}",
            listed.join(",")
        ));
    }
    Some(text)
}

/// `rate` in requests per second (`-` for none).
fn rps(sweep: &Sweep, rate: Option<f64>) -> String {
    rate.and_then(|r| sweep.rps(r))
        .map_or_else(|| "-".into(), |r| format!("{}", crate::text::round3(r)))
}

/// `row` without its column `at` when the trace's own rate is unknown: the tables give
/// requests per second beside rate scales only where they can.
fn drop_rps<T>(sweep: &Sweep, mut row: Vec<T>, at: usize) -> Vec<T> {
    if sweep.trace_rate_rps.is_none() {
        row.remove(at);
    }
    row
}

/// The cells as a table: its header and one row of text per cell.
pub fn cell_table(sweep: &Sweep) -> (Vec<&'static str>, Vec<Vec<String>>) {
    let header = drop_rps(
        sweep,
        vec![
            "budget",
            "rate",
            "req/s",
            "requests",
            "steps",
            "TBT p50 ms",
            "TBT p99 ms",
            "TTFT p50 ms",
            "TTFT p90 ms",
            "TTFT p99 ms",
            "step p50 ms",
            "step p99 ms",
            "overruns",
            "utilisation",
            "SLO",
        ],
        2,
    );
    let rows = sweep
        .cells
        .iter()
        .map(|c| {
            let s = &c.summary;
            let mut row = vec![
                c.budget.to_string(),
                fmt_rate(c.rate_scale),
                rps(sweep, Some(c.rate_scale)),
                s.requests.to_string(),
                s.steps.to_string(),
            ];
            row.extend(s.latencies().map(ms));
            row.extend(s.step_ms.percentiles([50, 99]).map(ms));
            row.push(s.overruns.to_string());
            row.push(
                s.budget_utilisation
                    .map_or_else(|| "-".into(), |u| format!("{:.1}%", u * 100.0)),
            );
            row.push(
                match c.meets_slo {
                    None => "-",
                    Some(true) => "meets",
                    Some(false) => "misses",
                }
                .into(),
            );
            drop_rps(sweep, row, 2)
        })
        .collect();
    (header, rows)
}

/// The capacities as a table: its header and one row per budget (empty without an SLO).
pub fn capacity_table(sweep: &Sweep) -> (Vec<&'static str>, Vec<Vec<String>>) {
    let header = drop_rps(
        sweep,
        vec![
            "budget",
            "capacity",
            "req/s",
            "misses at",
            "replays searched",
        ],
        2,
    );
    let rows = sweep
        .capacity
        .iter()
        .map(|c| {
            let row = vec![
                c.budget.to_string(),
                c.label(),
                rps(sweep, c.search.rate_scale),
                match (c.search.bound, c.search.misses_at) {
                    (Bound::AtLeastMax, _) | (_, None) => "-".into(),
                    (_, Some(r)) => format!("{}x", fmt_rate(r)),
                },
                c.search.probes.len().to_string(),
            ];
            drop_rps(sweep, row, 2)
        })
        .collect();
    (header, rows)
}
