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

/// The cells as a table: its header and one row of text per cell.
pub fn cell_table(sweep: &Sweep) -> (Vec<&'static str>, Vec<Vec<String>>) {
    let header = vec![
        "budget",
        "rate",
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
    ];
    let rows = sweep
        .cells
        .iter()
        .map(|c| {
            let s = &c.summary;
            let mut row = vec![
                c.budget.to_string(),
                fmt_rate(c.rate_scale),
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
            row
        })
        .collect();
    (header, rows)
}

/// The capacities as a table: its header and one row per budget (empty without an SLO).
pub fn capacity_table(sweep: &Sweep) -> (Vec<&'static str>, Vec<Vec<String>>) {
    let header = vec!["budget", "capacity", "misses at", "replays searched"];
    let rows = sweep
        .capacity
        .iter()
        .map(|c| {
            vec![
                c.budget.to_string(),
                c.label(),
                match (c.search.bound, c.search.misses_at) {
                    (Bound::AtLeastMax, _) | (_, None) => "-".into(),
                    (_, Some(r)) => format!("{}x", fmt_rate(r)),
                },
                c.search.probes.len().to_string(),
            ]
        })
        .collect();
    (header, rows)
}
