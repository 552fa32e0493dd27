//! The verdict of a sweep with time budgets (`docs/capacity.md#the-verdict`): which setting gives
//! the most capacity under the objective. Per trace, the best token budget, the best time budget
//! and the ratio of their capacities; across traces, each setting's capacity as a fraction of
//! its trace's best, and its worst such fraction: the setting to deploy when the workload is
//! not known in advance is the one whose worst fraction is highest.
//!
//! A setting is a grid budget (`512`, `off`, `95 ms`), prefixed by the axis value it ran under
//! when the sweep had an axis (`shortest_first 95 ms`). Capacities are the sweep's own
//! searches: a budget with no capacity counts as 0, one at the top of the range as that rate.

use serde::Serialize;

use super::forms::{csv_table, escape, render};
use super::{Budget, Sweep};
use crate::text::{fmt_rate, round3};

/// One row per trace.
pub const TRACES_CSV: &str = "verdict.csv";
/// One row per setting: its fraction of each trace's best.
pub const SETTINGS_CSV: &str = "verdict-settings.csv";
/// The whole verdict.
pub const JSON: &str = "verdict.json";
/// The verdict's files, in the order written.
pub const FILES: [&str; 3] = [TRACES_CSV, SETTINGS_CSV, JSON];

/// One setting's capacity on one trace.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Pick {
    /// The setting: the axis value it ran under, if any, and its budget.
    pub setting: String,
    /// Whether its budget is a time budget.
    pub time: bool,
    /// Its capacity (a rate scale; 0 when no rate met the objective).
    #[serde(serialize_with = "crate::text::ser_round")]
    pub capacity: f64,
    /// Whether the capacity is only a lower bound (the highest rate searched met it).
    pub at_least: bool,
}

impl Pick {
    /// `0.746x`, `>= 1024x` or `none`.
    fn label(&self) -> String {
        if self.capacity == 0.0 {
            "none".into()
        } else if self.at_least {
            format!(">= {}x", fmt_rate(self.capacity))
        } else {
            format!("{}x", fmt_rate(self.capacity))
        }
    }
}

/// The verdict on one trace.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TraceVerdict {
    /// The trace, as its run is labelled.
    pub trace: String,
    /// The objective its capacities are under.
    pub objective: String,
    /// Every setting's capacity, in the order run.
    pub settings: Vec<Pick>,
    /// The token budget with the most capacity (the first of equals).
    pub best_tokens: Option<Pick>,
    /// The time budget with the most capacity (the first of equals).
    pub best_time: Option<Pick>,
    /// The best time budget's capacity ÷ the best token budget's (`None` without both, or when
    /// the best token budget has none).
    #[serde(serialize_with = "crate::text::ser_opt_round")]
    pub time_over_tokens: Option<f64>,
}

/// One setting across the traces.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SettingRow {
    /// The setting.
    pub setting: String,
    /// Whether its budget is a time budget.
    pub time: bool,
    /// Per trace, in the traces' order, its capacity ÷ the trace's best setting's (`None` where
    /// it did not run, or the trace's best has none).
    #[serde(serialize_with = "ser_fractions")]
    pub of_best: Vec<Option<f64>>,
    /// The lowest of `of_best` (`None` when it missed a trace).
    #[serde(serialize_with = "crate::text::ser_opt_round")]
    pub worst: Option<f64>,
}

/// The verdict of one or more traces' sweeps.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Verdict {
    /// The objective the capacities are under: one, or `per trace` when the traces' differ.
    pub objective: String,
    /// Per trace.
    pub traces: Vec<TraceVerdict>,
    /// Every setting, the highest worst fraction first (ties in the order run).
    pub settings: Vec<SettingRow>,
    /// The setting whose worst fraction is highest: the one to deploy when the workload is not
    /// known in advance.
    pub deploy: Option<String>,
}

/// One run of a trace's grid: the axis value it ran under (if any) and the sweep.
pub type Run<'a> = (Option<String>, &'a Sweep);

impl Verdict {
    /// The verdict of `traces` (each a label and its runs), if the sweeps had an objective and
    /// both a token and a time budget among their settings, and none was interrupted (its
    /// unfinished searches would count as no capacity); else `None`.
    pub fn of(traces: &[(String, Vec<Run<'_>>)]) -> Option<Self> {
        let sweeps = || traces.iter().flat_map(|(_, runs)| runs.iter().map(|r| r.1));
        sweeps().find_map(|s| s.slo.as_ref())?;
        if sweeps().any(|s| s.interrupted.is_some()) {
            return None;
        }
        let budgets = || sweeps().flat_map(|s| s.budgets.iter());
        if !budgets().any(|b| b.is_time()) || budgets().all(|b| b.is_time()) {
            return None;
        }
        let traces: Vec<TraceVerdict> = traces
            .iter()
            .map(|(label, runs)| TraceVerdict::of(label, runs))
            .collect();
        let mut names: Vec<(String, bool)> = Vec::new();
        for p in traces.iter().flat_map(|t| &t.settings) {
            if !names.iter().any(|(n, _)| *n == p.setting) {
                names.push((p.setting.clone(), p.time));
            }
        }
        let mut settings: Vec<SettingRow> = names
            .into_iter()
            .map(|(setting, time)| {
                let of_best: Vec<Option<f64>> = traces
                    .iter()
                    .map(|t| {
                        let best = t.best()?.capacity;
                        let mine = t.settings.iter().find(|p| p.setting == setting)?;
                        (best > 0.0).then(|| mine.capacity / best)
                    })
                    .collect();
                let worst = of_best
                    .iter()
                    .try_fold(f64::INFINITY, |w, r| r.map(|r| w.min(r)))
                    .filter(|w| w.is_finite());
                SettingRow {
                    setting,
                    time,
                    of_best,
                    worst,
                }
            })
            .collect();
        // Stable: equals keep the order they ran in.
        settings.sort_by(|a, b| {
            let key = |r: &SettingRow| r.worst.unwrap_or(-1.0);
            key(b).total_cmp(&key(a))
        });
        let deploy = settings
            .first()
            .filter(|r| r.worst.is_some())
            .map(|r| r.setting.clone());
        let objective = match traces.first() {
            Some(first) if traces.iter().all(|t| t.objective == first.objective) => {
                first.objective.clone()
            }
            _ => "per trace".to_owned(),
        };
        Some(Self {
            objective,
            traces,
            settings,
            deploy,
        })
    }

    /// The verdict of one sweep (one trace, no axis), labelled with its trace.
    pub fn of_sweep(sweep: &Sweep) -> Option<Self> {
        Self::of(&[(trace_label(sweep), vec![(None, sweep)])])
    }

    /// The verdict as text: the per-trace table, then (with more than one trace) each setting
    /// across them.
    pub fn table(&self) -> String {
        let mut out = format!(
            "verdict under the objective ({}): the best token budget against the best time budget\n",
            self.objective
        );
        let pick = |p: &Option<Pick>| {
            p.as_ref().map_or_else(
                || "-".to_owned(),
                |p| format!("{} ({})", p.setting, p.label()),
            )
        };
        let per_trace = self.objective == "per trace";
        let rows = self
            .traces
            .iter()
            .map(|t| {
                let mut row = vec![
                    t.trace.clone(),
                    pick(&t.best_tokens),
                    pick(&t.best_time),
                    t.time_over_tokens
                        .map_or_else(|| "-".to_owned(), |r| format!("{:.2}", round3(r))),
                ];
                if per_trace {
                    row.push(t.objective.clone());
                }
                row
            })
            .collect();
        let mut header = vec![
            "trace",
            "best token budget",
            "best time budget",
            "time ÷ tokens",
        ];
        if per_trace {
            header.push("objective");
        }
        render(&mut out, (header, rows));
        let mut header = vec!["setting".to_owned()];
        header.extend(self.traces.iter().map(|t| t.trace.clone()));
        header.push("worst".to_owned());
        let frac =
            |r: &Option<f64>| r.map_or_else(|| "-".to_owned(), |r| format!("{:.2}", round3(r)));
        let rows = self
            .settings
            .iter()
            .map(|s| {
                let mut row = vec![s.setting.clone()];
                row.extend(s.of_best.iter().map(frac));
                row.push(frac(&s.worst));
                row
            })
            .collect();
        out.push_str(
            "each setting's capacity ÷ the best setting's on that trace, and its worst:\n",
        );
        render(
            &mut out,
            (header.iter().map(String::as_str).collect(), rows),
        );
        if let Some(d) = &self.deploy {
            out.push_str(&format!(
                "the setting whose worst is highest: {d} (to deploy when the workload is not known in advance)\n"
            ));
        }
        out
    }

    /// `verdict.csv`: one row per trace.
    ///
    /// # Errors
    /// None in practice (written to memory).
    pub fn traces_csv(&self) -> Result<Vec<u8>, csv::Error> {
        let header = [
            "trace",
            "objective",
            "best_token_budget",
            "best_token_capacity",
            "best_time_budget",
            "best_time_capacity",
            "time_over_tokens",
        ];
        let opt = |v: Option<f64>| v.map_or_else(String::new, |v| round3(v).to_string());
        let rows = self.traces.iter().map(|t| {
            let name =
                |p: &Option<Pick>| p.as_ref().map_or_else(String::new, |p| p.setting.clone());
            let cap = |p: &Option<Pick>| opt(p.as_ref().map(|p| p.capacity));
            vec![
                t.trace.clone(),
                t.objective.clone(),
                name(&t.best_tokens),
                cap(&t.best_tokens),
                name(&t.best_time),
                cap(&t.best_time),
                opt(t.time_over_tokens),
            ]
        });
        csv_table(&header, rows)
    }

    /// `verdict-settings.csv`: one row per setting, a column per trace, then the worst.
    ///
    /// # Errors
    /// None in practice (written to memory).
    pub fn settings_csv(&self) -> Result<Vec<u8>, csv::Error> {
        let mut header = vec!["setting".to_owned(), "kind".to_owned()];
        header.extend(self.traces.iter().map(|t| t.trace.clone()));
        header.push("worst".to_owned());
        let opt = |v: &Option<f64>| v.map_or_else(String::new, |v| round3(v).to_string());
        let rows = self.settings.iter().map(|s| {
            let mut row = vec![
                s.setting.clone(),
                if s.time { "time" } else { "tokens" }.to_owned(),
            ];
            row.extend(s.of_best.iter().map(opt));
            row.push(opt(&s.worst));
            row
        });
        let header: Vec<&str> = header.iter().map(String::as_str).collect();
        csv_table(&header, rows)
    }

    /// The verdict's files: `verdict.csv`, `verdict-settings.csv` and `verdict.json`.
    ///
    /// # Errors
    /// A CSV or the JSON cannot be written.
    pub fn files(&self) -> Result<Vec<(String, Vec<u8>)>, String> {
        let csv = self.traces_csv().map_err(|e| e.to_string())?;
        let settings = self.settings_csv().map_err(|e| e.to_string())?;
        let mut json = serde_json::to_vec_pretty(self).map_err(|e| e.to_string())?;
        json.push(b'\n');
        Ok(vec![
            (TRACES_CSV.to_owned(), csv),
            (SETTINGS_CSV.to_owned(), settings),
            (JSON.to_owned(), json),
        ])
    }

    /// The verdict as HTML tables, for a report.
    pub fn html(&self) -> String {
        let mut out = String::new();
        out.push_str(&format!(
            "<h2>Verdict</h2>\n<p>Under the objective ({}): the best token budget against the best time budget on each trace, and each setting's capacity as a fraction of the best on that trace.</p>\n",
            escape(&self.objective)
        ));
        // The terminal's tables, as preformatted text: the same figures, one source.
        out.push_str(&format!("<pre>{}</pre>\n", escape(&self.table())));
        out
    }
}

impl TraceVerdict {
    /// The verdict on one trace from its runs.
    fn of(label: &str, runs: &[Run<'_>]) -> Self {
        let objective = runs
            .iter()
            .find_map(|(_, s)| s.slo.as_ref())
            .map_or_else(|| "none".to_owned(), super::capacity::slo_text);
        let mut settings = Vec::new();
        for (value, sweep) in runs {
            for c in &sweep.capacity {
                settings.push(Pick {
                    setting: setting_name(value.as_deref(), c.budget),
                    time: c.budget.is_time(),
                    capacity: c.search.rate_scale.unwrap_or(0.0),
                    at_least: c.search.bound == super::Bound::AtLeastMax,
                });
            }
        }
        let best = |time: bool| {
            settings
                .iter()
                .filter(|p| p.time == time)
                .fold(None::<&Pick>, |b, p| match b {
                    Some(b) if b.capacity >= p.capacity => Some(b),
                    _ => Some(p),
                })
                .cloned()
        };
        let (best_tokens, best_time) = (best(false), best(true));
        let time_over_tokens = match (&best_tokens, &best_time) {
            (Some(k), Some(t)) if k.capacity > 0.0 => Some(t.capacity / k.capacity),
            _ => None,
        };
        Self {
            trace: label.to_owned(),
            objective,
            settings,
            best_tokens,
            best_time,
            time_over_tokens,
        }
    }

    /// The setting with the most capacity on the trace (the first of equals).
    fn best(&self) -> Option<&Pick> {
        self.settings
            .iter()
            .fold(None, |b: Option<&Pick>, p| match b {
                Some(b) if b.capacity >= p.capacity => Some(b),
                _ => Some(p),
            })
    }
}

/// Each fraction rounded to 0.001, `null` for none (or a non-finite one).
fn ser_fractions<S: serde::Serializer>(v: &[Option<f64>], s: S) -> Result<S::Ok, S::Error> {
    s.collect_seq(v.iter().map(|x| x.filter(|x| x.is_finite()).map(round3)))
}

/// A sweep's trace as the verdict names it: the file's name, without its folder or format.
pub fn trace_label(sweep: &Sweep) -> String {
    let shown = sweep
        .settings
        .iter()
        .find(|(k, _)| k == "trace")
        .map_or("trace", |(_, v)| v.as_str());
    let file = shown.rsplit_once(" (").map_or(shown, |(f, _)| f);
    file.rsplit(['/', '\\']).next().unwrap_or(file).to_owned()
}

/// A setting's name: its budget, after the axis value it ran under (`shortest_first 95 ms`).
fn setting_name(value: Option<&str>, budget: Budget) -> String {
    match value {
        Some(v) => format!("{v} {budget}"),
        None => budget.to_string(),
    }
}

#[cfg(test)]
mod tests;
