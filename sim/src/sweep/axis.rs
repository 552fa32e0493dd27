//! What every axis of a sweep shares (`docs/layout.md#adding-a-sweep-axis`): an axis is a list
//! of values, each changing the settings every cell runs under; the grid runs once per value,
//! each run into `OUT/<dir>/` with the usual files, then the axis compares the runs.
//!
//! An axis file describes only what is particular to it by implementing [`Axis`]: how a value
//! changes the settings and is named, the columns it adds to the combined `sweep.csv` (if it
//! writes one), and its comparison's table and files; and it parses its flag into the values.
//! The runner is `cli::sweep_cmd`'s; here, once for every axis, are the combined CSV
//! ([`combined_csv`]), the pieces of a comparison ([`budget_rows`], [`budget_table`],
//! [`text_table`], [`csv_table`]), its files ([`comparison`]) and their writing
//! ([`write_files`]).

use std::path::{Path, PathBuf};

pub use super::forms::csv_table;
use super::output::{to_csv, write_whole, CSV_FILE};
use super::plots::Plot;
use super::tables::ms;
use super::{Budget, RunSummary, Sweep, SweepError};
use crate::config::{LoadedConfig, Settings};
use crate::replay::Trace;

/// One run of the grid under one value of an axis.
#[derive(Debug, Clone, PartialEq)]
pub struct AxisRun<V> {
    /// The value.
    pub value: V,
    /// The grid, run under it.
    pub sweep: Sweep,
}

/// What an axis compares across its runs: the terminal table and the files, in the order they
/// are written.
#[derive(Debug, Clone, PartialEq)]
pub struct Comparison {
    /// The table printed after the runs.
    pub table: String,
    /// Each file's name in the output directory, and its bytes.
    pub files: Vec<(String, Vec<u8>)>,
}

/// One axis of a sweep, described by a type of its own: what its values are and how each
/// changes a run. The values themselves come from its flag (the `parse_*` function of its
/// file) and run in the order given.
pub trait Axis {
    /// One value of the axis.
    type Value: Copy + Send + Sync + std::fmt::Display + 'static;
    /// The label its value is shown under among the settings (`order`, `KV memory`, `fleet`);
    /// it replaces the config's own label of that name.
    const SETTING: &'static str;
    /// The prefix of its runs' directories (`order` for `OUT/order-*/`).
    const DIR_PREFIX: &'static str;
    /// The columns each value adds before a sweep's own in the combined `sweep.csv`; `None`:
    /// the axis writes no combined `sweep.csv`.
    const COLUMNS: Option<&'static [&'static str]>;

    /// `settings` under `value`, and the label the run's settings show.
    fn apply(settings: &Settings, value: Self::Value) -> (Settings, String);
    /// The subdirectory a run under `value` is written to: `<DIR_PREFIX>-<value>` (`order-fcfs`)
    /// unless the axis says otherwise (always starting with `<DIR_PREFIX>-`).
    fn dir_name(value: Self::Value) -> String {
        format!("{}-{value}", Self::DIR_PREFIX)
    }
    /// The heading of its run's table: `<SETTING>: <value>` (`order: fcfs`) unless the axis
    /// says otherwise.
    fn heading(value: Self::Value) -> String {
        format!("{}: {value}", Self::SETTING)
    }
    /// The run's name in an error (`under order fcfs`).
    fn failure(value: Self::Value) -> String;
    /// Its cells of the [`Axis::COLUMNS`], in order.
    fn cells(value: Self::Value) -> Vec<String> {
        let _ = value;
        Vec::new()
    }
    /// Refuses, before anything runs, a value of `values` the replay would refuse.
    ///
    /// # Errors
    /// The first refused value, naming its flag.
    fn check(values: &[Self::Value], loaded: &LoadedConfig, trace: &Trace) -> Result<(), String> {
        let _ = (values, loaded, trace);
        Ok(())
    }
    /// The comparison of the runs (each under one value, in the order run).
    ///
    /// # Errors
    /// A file cannot be made (a plot drawn, a CSV or JSON written).
    fn compare(runs: &[AxisRun<Self::Value>]) -> Result<Comparison, SweepError>;
}

/// Every run's `sweep.csv` rows, each with its value's [`Axis::cells`] first, under one header:
/// the axis's columns, then the columns of a sweep without the axis.
///
/// # Errors
/// None in practice (written to memory).
pub fn combined_csv<A: Axis>(runs: &[AxisRun<A::Value>]) -> Result<Vec<u8>, csv::Error> {
    let columns = A::COLUMNS.unwrap_or_default();
    let mut w = csv::Writer::from_writer(Vec::new());
    let mut header_written = false;
    for run in runs {
        let one = to_csv(&run.sweep)?;
        let mut r = csv::Reader::from_reader(one.as_slice());
        if !header_written {
            let mut h: Vec<String> = columns.iter().map(|c| (*c).to_owned()).collect();
            h.extend(r.headers()?.iter().map(str::to_owned));
            w.write_record(&h)?;
            header_written = true;
        }
        for rec in r.records() {
            let mut row = A::cells(run.value);
            row.extend(rec?.iter().map(str::to_owned));
            w.write_record(&row)?;
        }
    }
    w.into_inner().map_err(|e| csv::Error::from(e.into_error()))
}

/// An axis's comparison: its `table`, then its files: the combined `sweep.csv` of `runs` (when
/// the axis writes one), `{stem}.csv`, `{stem}.json` (`json`, pretty, with a final newline) and
/// the plot, if any, as `{stem}.svg` and `{stem}.png`.
///
/// # Errors
/// A CSV or the JSON cannot be written.
pub fn comparison<A: Axis>(
    runs: &[AxisRun<A::Value>],
    stem: &str,
    table: String,
    csv: Result<Vec<u8>, csv::Error>,
    json: &impl serde::Serialize,
    plot: Option<Plot>,
) -> Result<Comparison, SweepError> {
    let mut files = Vec::new();
    if A::COLUMNS.is_some() {
        let cells = combined_csv::<A>(runs).map_err(|e| failed(CSV_FILE, e))?;
        files.push((CSV_FILE.to_owned(), cells));
    }
    let csv_name = format!("{stem}.csv");
    let json_name = format!("{stem}.json");
    let csv = csv.map_err(|e| failed(&csv_name, e))?;
    let mut json = serde_json::to_vec_pretty(json).map_err(|e| failed(&json_name, e))?;
    json.push(b'\n');
    files.extend([(csv_name, csv), (json_name, json)]);
    if let Some(p) = plot {
        files.push((format!("{stem}.svg"), p.svg.into_bytes()));
        files.push((format!("{stem}.png"), p.png));
    }
    Ok(Comparison { table, files })
}

/// A file of a comparison that could not be made.
pub fn failed(name: &str, e: impl std::fmt::Display) -> SweepError {
    SweepError::Write {
        path: PathBuf::from(name),
        source: std::io::Error::other(e.to_string()),
    }
}

/// Writes each file whole into `dir`; answers their paths, in order.
///
/// # Errors
/// A file cannot be written.
pub fn write_files(dir: &Path, files: &[(String, Vec<u8>)]) -> Result<Vec<PathBuf>, SweepError> {
    let mut paths = Vec::with_capacity(files.len());
    for (name, bytes) in files {
        let path = dir.join(name);
        write_whole(&path, bytes).map_err(|source| SweepError::Write {
            path: path.clone(),
            source,
        })?;
        paths.push(path);
    }
    Ok(paths)
}

/// Splits an axis's comma-separated list, refusing empty entries and more than
/// [`super::grid::MAX_AXIS_VALUES`], and refuses a value named twice.
///
/// # Errors
/// An empty entry, too many, a value `parse` refuses, or a repeated one.
pub fn parse_list<T: PartialEq + std::fmt::Display>(
    flag: &'static str,
    list: &str,
    parse: impl Fn(&str) -> Result<T, String>,
) -> Result<Vec<T>, super::GridError> {
    let bad = |problem: String| super::GridError { flag, problem };
    let mut out: Vec<T> = Vec::new();
    for item in super::grid::split(flag, list)? {
        let v = parse(item).map_err(bad)?;
        if out.contains(&v) {
            return Err(bad(format!("names {v} twice")));
        }
        out.push(v);
    }
    Ok(out)
}

/// How a column of a comparison's terminal table lines up its cells.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Align {
    /// Padded on the right.
    Left,
    /// Padded on the left.
    Right,
}

/// A column of a comparison's terminal table: its heading, alignment and width.
pub type Column = (&'static str, Align, usize);

/// A comparison's table on the terminal: `title` on a line of its own, then the header and each
/// row, indented two spaces, each cell padded to its column's width, one space apart.
pub fn text_table(
    title: &str,
    columns: &[Column],
    rows: impl IntoIterator<Item = Vec<String>>,
) -> String {
    let line = |out: &mut String, cells: &mut dyn Iterator<Item = &str>| {
        out.push(' ');
        for ((_, align, w), cell) in columns.iter().zip(cells) {
            match align {
                Align::Left => out.push_str(&format!(" {cell:<w$}")),
                Align::Right => out.push_str(&format!(" {cell:>w$}")),
            }
        }
        out.push('\n');
    };
    let mut out = format!("{title}\n");
    line(&mut out, &mut columns.iter().map(|c| c.0));
    for row in rows {
        line(&mut out, &mut row.iter().map(String::as_str));
    }
    out
}

/// The terminal table of a comparison by value and budget (the KV and order axes): under the
/// title `<name>: capacity and latency at rate scale <rate>`, a row per value and budget with
/// the value (in column `value`), the budget and its capacity, its `figures` (in `columns`,
/// after the capacity) and the tail of its cell, each in ms.
pub fn budget_table<'r>(
    name: &str,
    rate_scale: f64,
    value: Column,
    columns: &[Column],
    rows: impl Iterator<Item = (String, &'r BudgetCapacity, Vec<Option<f64>>, &'r Tail)>,
) -> String {
    let title = format!(
        "{name}: capacity and latency at rate scale {}",
        crate::text::fmt_rate(rate_scale)
    );
    let mut all = vec![value];
    all.extend(BudgetCapacity::COLUMNS);
    all.extend_from_slice(columns);
    all.extend(Tail::COLUMNS);
    let rows = rows.map(|(value, at, figures, tail)| {
        let mut row = vec![value];
        row.extend(at.cells());
        row.extend(figures.into_iter().map(ms));
        row.extend(tail.cells(ms));
        row
    });
    text_table(&title, &all, rows)
}

/// The rate scale a comparison takes its latencies at: the sweep's step-time rate.
pub fn rate_of<V>(runs: &[AxisRun<V>]) -> f64 {
    runs.first().map_or(1.0, |r| r.sweep.step_time_rate)
}

/// A budget and its capacity under the SLO, as a comparison's row shows them.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct BudgetCapacity {
    /// The budget.
    pub budget: Budget,
    /// The capacity under the SLO, as text (`1.23x`, `none`); `None` without an SLO.
    pub capacity: Option<String>,
    /// The capacity's rate scale (`None`: none, or no SLO).
    #[serde(serialize_with = "crate::text::ser_opt_round")]
    pub capacity_rate: Option<f64>,
}

impl BudgetCapacity {
    /// Its columns in a comparison's terminal table.
    pub const COLUMNS: [Column; 2] = [("budget", Align::Left, 8), ("capacity", Align::Right, 12)];

    /// Its cells in a comparison's terminal table: the budget and the capacity (`-`: none).
    pub fn cells(&self) -> [String; 2] {
        [
            self.budget.to_string(),
            self.capacity.clone().unwrap_or_else(|| "-".into()),
        ]
    }
}

/// The tail latencies a comparison's row shows of a cell: TTFT p90 and p99 and TBT p99 at
/// the comparison's rate scale, simulated ms (`None`: no cell, or no samples).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Tail {
    /// TTFT p90.
    #[serde(serialize_with = "crate::text::ser_opt_round")]
    pub ttft_p90_ms: Option<f64>,
    /// TTFT p99.
    #[serde(serialize_with = "crate::text::ser_opt_round")]
    pub ttft_p99_ms: Option<f64>,
    /// TBT p99.
    #[serde(serialize_with = "crate::text::ser_opt_round")]
    pub tbt_p99_ms: Option<f64>,
}

impl Tail {
    /// Its columns in a comparison's terminal table.
    pub const COLUMNS: [Column; 3] = [
        ("TTFT p90 ms", Align::Right, 14),
        ("TTFT p99 ms", Align::Right, 14),
        ("TBT p99 ms", Align::Right, 12),
    ];
    /// Its columns in a comparison's CSV file.
    pub const CSV_COLUMNS: [&'static str; 3] = ["ttft_p90_ms", "ttft_p99_ms", "tbt_p99_ms"];

    /// Its figures in the order of its columns, each written by `ms`.
    pub fn cells(&self, ms: impl Fn(Option<f64>) -> String) -> [String; 3] {
        [self.ttft_p90_ms, self.ttft_p99_ms, self.tbt_p99_ms].map(ms)
    }

    /// The tail of `cell`.
    pub fn of(cell: Option<&RunSummary>) -> Self {
        Self {
            ttft_p90_ms: cell.and_then(|s| s.ttft_p90_ms),
            ttft_p99_ms: cell.and_then(|s| s.ttft_p99_ms),
            tbt_p99_ms: cell.and_then(|s| s.tbt_p99_ms),
        }
    }
}

/// One budget of one run, as a comparison shows it: its capacity and its cell at one rate.
#[derive(Debug, Clone)]
pub struct BudgetPoint<'a> {
    /// The budget and its capacity.
    pub at: BudgetCapacity,
    /// The cell at the comparison's rate, if it ran.
    pub cell: Option<&'a RunSummary>,
}

/// Every run's budgets, in order, with the run's value, at `rate`.
pub fn budget_points<V: Copy>(
    runs: &[AxisRun<V>],
    rate: f64,
) -> impl Iterator<Item = (V, BudgetPoint<'_>)> {
    runs.iter().flat_map(move |run| {
        run.sweep.budgets.iter().map(move |b| {
            let cap = run.sweep.capacity.iter().find(|c| c.budget == *b);
            let at = BudgetCapacity {
                budget: *b,
                capacity: cap.map(super::Capacity::label),
                capacity_rate: cap.and_then(|c| c.search.rate_scale),
            };
            let point = BudgetPoint {
                at,
                cell: run.sweep.cell(*b, rate).map(|c| &c.summary),
            };
            (run.value, point)
        })
    })
}

/// A comparison's rate scale (the sweep's step-time rate) and its rows: one per run and budget,
/// in order, made by `row` of the run's value and the budget's point at that rate.
pub fn budget_rows<V: Copy, R>(
    runs: &[AxisRun<V>],
    row: impl Fn(V, BudgetPoint<'_>) -> R,
) -> (f64, Vec<R>) {
    let rate_scale = rate_of(runs);
    let rows = budget_points(runs, rate_scale)
        .map(|(v, p)| row(v, p))
        .collect();
    (rate_scale, rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_comparison_table_pads_each_cell_to_its_columns_width_one_space_apart() {
        let columns = [("value", Align::Left, 8), ("ms", Align::Right, 6)];
        let rows = [
            vec!["a".to_owned(), "1.5".into()],
            vec!["long value".into(), "-".into()],
        ];
        let want = format!(
            "title\n  {:<8} {:>6}\n  {:<8} {:>6}\n  {:<8} {:>6}\n",
            "value", "ms", "a", "1.5", "long value", "-"
        );
        assert_eq!(text_table("title", &columns, rows), want);
        assert_eq!(want.lines().nth(3), Some("  long value      -"));
    }

    #[test]
    fn a_budget_row_shows_the_value_the_capacity_the_figures_then_the_tail() {
        let at = BudgetCapacity {
            budget: Budget::Off,
            capacity: None,
            capacity_rate: None,
        };
        let tail = Tail {
            ttft_p90_ms: Some(12.34),
            ttft_p99_ms: None,
            tbt_p99_ms: Some(5.0),
        };
        let rows = [("x".to_owned(), &at, vec![Some(1.06)], &tail)].into_iter();
        let t = budget_table(
            "things",
            2.0,
            ("thing", Align::Left, 5),
            &[("p50", Align::Right, 4)],
            rows,
        );
        let want = format!(
            "things: capacity and latency at rate scale 2\n  {:<5} {:<8} {:>12} {:>4} {:>14} {:>14} {:>12}\n  {:<5} {:<8} {:>12} {:>4} {:>14} {:>14} {:>12}\n",
            "thing", "budget", "capacity", "p50", "TTFT p90 ms", "TTFT p99 ms", "TBT p99 ms",
            "x", "off", "-", "1.1", "12.3", "-", "5.0"
        );
        assert_eq!(t, want);
    }
}
