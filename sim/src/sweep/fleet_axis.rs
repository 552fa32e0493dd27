//! The fleet axes of a sweep (`docs/fleet.md#in-a-sweep`): `--workers 1,2,4,8` and
//! `--routers round_robin,prefix_affinity` run the whole grid once per router and fleet size
//! (`replay.fleet.router` and `replay.fleet.workers`), each into `OUT/fleet-<router>-<n>/`
//! with the usual files; then `OUT/sweep.csv` holds every run's cells with `router` and
//! `workers` columns first, and `OUT/fleet.csv`/`fleet.json` give, per router, budget and rate
//! scale, the fewest workers whose fleet meets the objective. A sweep without either flag writes
//! `sweep.csv` as before, without the columns.

use plotters::coord::Shift;
use plotters::prelude::*;
use serde::Serialize;

use super::axis::{
    comparison, csv_table, parse_list, text_table, Align, Axis, AxisRun, Comparison,
};
use super::grid::{split, Budget, GridError};
use super::plots::{
    distinct, legend, marked_line, render_figure, series_color, text_style, Drawn, Figure,
};
use super::tables::ms;
use super::SweepError;
use crate::config::Settings;
use crate::replay::topology::MAX_WORKERS;
use crate::replay::RouterKind;
use crate::text::{fmt_rate, round3};

/// The stem of the comparison's files: `fleet.csv`, `fleet.json`, `fleet.svg`, `fleet.png`.
pub const FLEET: &str = "fleet";
/// The plot of the fewest workers, SVG and PNG.
pub const FLEET_SVG: &str = "fleet.svg";
/// See [`FLEET_SVG`].
pub const FLEET_PNG: &str = "fleet.png";

/// Parses `--workers`: fleet sizes from 1 to [`MAX_WORKERS`], ascending, each once.
///
/// # Errors
/// An empty entry, a value that is not such a size, a repeated value or one out of order.
pub fn parse_workers(list: &str) -> Result<Vec<u32>, GridError> {
    let bad = |problem: String| GridError {
        flag: "--workers",
        problem,
    };
    let mut out: Vec<u32> = Vec::new();
    for item in split("--workers", list)? {
        let n = item
            .parse::<u32>()
            .ok()
            .filter(|n| (1..=MAX_WORKERS).contains(n))
            .ok_or_else(|| {
                bad(format!(
                    "takes whole numbers of workers from 1 to {MAX_WORKERS}, got {item:?}"
                ))
            })?;
        if let Some(&last) = out.last() {
            if n <= last {
                return Err(bad(format!(
                    "takes fleet sizes ascending, each once, got {n} after {last}"
                )));
            }
        }
        out.push(n);
    }
    Ok(out)
}

/// Parses `--routers`: routers, each once, in the order given.
///
/// # Errors
/// An empty entry, an unknown or repeated router.
pub fn parse_routers(list: &str) -> Result<Vec<RouterKind>, GridError> {
    parse_list("--routers", list, |item| {
        item.parse::<RouterKind>().map_err(|e| e.to_string())
    })
}

/// `settings` with a fleet of `workers` behind `router` (over the config's `replay.fleet`),
/// and the label the run's settings show.
pub fn with_fleet(settings: &Settings, router: RouterKind, workers: u32) -> (Settings, String) {
    let mut out = settings.clone();
    out.replay.fleet.router = router.as_str().to_owned();
    out.replay.fleet.workers = workers;
    (
        out,
        format!("{} (--workers, --routers)", Fleet { router, workers }),
    )
}

/// The subdirectory a run of `workers` behind `router` is written to.
pub fn dir_name(router: RouterKind, workers: u32) -> String {
    format!("fleet-{router}-{workers}")
}

/// One fleet of the axes: a number of workers behind a router.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fleet {
    /// The router.
    pub router: RouterKind,
    /// The workers.
    pub workers: u32,
}

impl std::fmt::Display for Fleet {
    /// `2 workers behind least_kv`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = crate::text::plural(u64::from(self.workers), "worker");
        write!(f, "{n} behind {}", self.router)
    }
}

/// One fleet's sweep.
pub type FleetRun = AxisRun<Fleet>;

/// Parses `--workers` and `--routers` into the fleets to run: per router (in the order given),
/// each fleet size (ascending); the flag not given takes the config's fleet (`workers`,
/// `router`). `None` when neither is given.
///
/// # Errors
/// A refused list, naming its flag.
pub fn parse_fleets(
    workers: Option<&str>,
    routers: Option<&str>,
    config: Fleet,
) -> Result<Option<Vec<Fleet>>, GridError> {
    if workers.is_none() && routers.is_none() {
        return Ok(None);
    }
    let workers = workers.map_or(Ok(vec![config.workers]), parse_workers)?;
    let routers = routers.map_or(Ok(vec![config.router]), parse_routers)?;
    let fleets = routers.iter().flat_map(|&router| {
        let fleet = move |&workers: &u32| Fleet { router, workers };
        workers.iter().map(fleet)
    });
    Ok(Some(fleets.collect()))
}

/// `--workers` and `--routers`: the grid once per fleet ([`parse_fleets`]), each into
/// `OUT/fleet-<router>-<n>/`, then the cells together (`OUT/sweep.csv`, with `router` and
/// `workers` columns) and the fewest workers that meet the objective (`OUT/fleet.*`).
pub struct FleetAxis;

impl Axis for FleetAxis {
    type Value = Fleet;
    const SETTING: &'static str = "fleet";
    const DIR_PREFIX: &'static str = "fleet";
    const COLUMNS: Option<&'static [&'static str]> = Some(&["router", "workers"]);

    fn apply(settings: &Settings, f: Fleet) -> (Settings, String) {
        with_fleet(settings, f.router, f.workers)
    }
    fn dir_name(f: Fleet) -> String {
        dir_name(f.router, f.workers)
    }
    fn failure(f: Fleet) -> String {
        format!("with {f}")
    }
    fn cells(f: Fleet) -> Vec<String> {
        vec![f.router.as_str().to_owned(), f.workers.to_string()]
    }
    fn compare(runs: &[FleetRun]) -> Result<Comparison, SweepError> {
        let cmp = FleetComparison::of(runs);
        // Without an objective there is nothing to plot.
        let plot = if cmp.fewest.is_empty() {
            None
        } else {
            Some(render_figure("fleet", cmp.title(), &cmp)?)
        };
        comparison::<Self>(runs, FLEET, cmp.table(), cmp.to_csv(), &cmp, plot)
    }
}

/// Under one router, one budget and one rate scale: the fewest workers that meet the objective.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FewestRow {
    /// The router (or, in a [`super::pd_axis`] comparison's plot, the layout).
    pub router: String,
    /// The budget.
    pub budget: Budget,
    /// The rate scale.
    #[serde(serialize_with = "crate::text::ser_round")]
    pub rate_scale: f64,
    /// The fewest workers of `--workers` whose fleet met the objective at this rate; `None`:
    /// none of them did (or no objective, or the cell did not run).
    pub fewest_workers: Option<u32>,
    /// That fleet's TTFT p90 and TBT p99, simulated ms (the figures the objective bounds).
    #[serde(serialize_with = "crate::text::ser_opt_round")]
    pub ttft_p90_ms: Option<f64>,
    /// See `ttft_p90_ms`.
    #[serde(serialize_with = "crate::text::ser_opt_round")]
    pub tbt_p99_ms: Option<f64>,
}

/// Fleets compared by group (a router, a layout), as each comparison of fleets tabulates them:
/// the groups in the order first run, the fleet sizes ascending, and, only with an objective,
/// per group, budget and rate scale the row `fewest` makes of the group's runs (sizes
/// ascending), and per run and budget the capacity row `capacity` makes.
#[allow(clippy::type_complexity)]
pub(crate) fn compare_groups<V, K: Copy + PartialEq, F, G>(
    runs: &[AxisRun<V>],
    group: impl Fn(&V) -> K,
    size: impl Fn(&V) -> u32,
    mut fewest: impl FnMut(&[&AxisRun<V>], K, Budget, f64) -> F,
    name: impl Fn(K, &V) -> String,
) -> (Vec<K>, Vec<u32>, Vec<F>, Vec<GroupCapacity<G>>) {
    let groups = distinct(runs.iter().map(|r| group(&r.value)));
    let mut sizes = distinct(runs.iter().map(|r| size(&r.value)));
    sizes.sort_unstable();
    let (mut rows, mut capacities) = (Vec::new(), Vec::new());
    if runs.first().is_some_and(|r| r.sweep.slo.is_some()) {
        for &g in &groups {
            let mine: Vec<&AxisRun<V>> = runs.iter().filter(|r| group(&r.value) == g).collect();
            let Some(first) = mine.first() else { continue };
            for &budget in &first.sweep.budgets {
                for &rate in &first.sweep.rates {
                    rows.push(fewest(&mine, g, budget, rate));
                }
            }
            for run in &mine {
                for c in &run.sweep.capacity {
                    capacities.push(GroupCapacity::of(name(g, &run.value), size(&run.value), c));
                }
            }
        }
    }
    (groups, sizes, rows, capacities)
}

/// What a comparison of fleets groups its capacities by, and the key the group is written
/// under.
pub trait CapacityGroup {
    /// The key of the group's name in the JSON and CSV.
    const KEY: &'static str;
}

/// Fleets grouped by router.
#[derive(Debug, Clone, PartialEq)]
pub struct ByRouter;

impl CapacityGroup for ByRouter {
    const KEY: &'static str = "router";
}

/// One fleet's capacity under the objective, for one budget: the highest rate scale it takes.
#[derive(Debug, Clone, PartialEq)]
pub struct GroupCapacity<G> {
    /// The group's name (a router, a layout), written under `G::KEY`.
    pub group: String,
    /// The workers.
    pub workers: u32,
    /// The budget.
    pub budget: Budget,
    /// The capacity as text (`1.23x`, `>= 1024x`, `none`).
    pub capacity: String,
    /// Its rate scale (`None`: none).
    pub capacity_rate: Option<f64>,
    /// What the group is.
    pub by: std::marker::PhantomData<G>,
}

impl<G> GroupCapacity<G> {
    /// The capacity `c` of a fleet of `workers` in group `group`.
    fn of(group: String, workers: u32, c: &super::Capacity) -> Self {
        Self {
            group,
            workers,
            budget: c.budget,
            capacity: c.label(),
            capacity_rate: c.search.rate_scale,
            by: std::marker::PhantomData,
        }
    }
}

impl<G: CapacityGroup> Serialize for GroupCapacity<G> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        /// The rate, rounded as every figure of the outputs is.
        struct Rounded(Option<f64>);
        impl Serialize for Rounded {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                crate::text::ser_opt_round(&self.0, s)
            }
        }
        let mut st = s.serialize_struct("GroupCapacity", 5)?;
        st.serialize_field(G::KEY, &self.group)?;
        st.serialize_field("workers", &self.workers)?;
        st.serialize_field("budget", &self.budget)?;
        st.serialize_field("capacity", &self.capacity)?;
        st.serialize_field("capacity_rate", &Rounded(self.capacity_rate))?;
        st.end()
    }
}

/// A fleet's capacity in the comparison of routers.
pub type FleetCapacity = GroupCapacity<ByRouter>;

/// The comparison of the fleets.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FleetComparison {
    /// The routers, in the order given.
    pub routers: Vec<String>,
    /// The fleet sizes, ascending.
    pub workers: Vec<u32>,
    /// Per router, budget and rate scale, the fewest workers that meet the objective (only with
    /// an objective).
    pub fewest: Vec<FewestRow>,
    /// Per router, fleet size and budget, the capacity (only with an objective).
    pub capacity: Vec<FleetCapacity>,
}

impl FleetComparison {
    /// Compares the sweeps of each fleet (same budgets and rates in each), runs ordered by
    /// router, then workers ascending.
    pub fn of(runs: &[FleetRun]) -> Self {
        let (routers, workers, fewest, capacity) = compare_groups(
            runs,
            |f| f.router,
            |f| f.workers,
            fewest_row,
            |router, _| router.as_str().to_owned(),
        );
        Self {
            routers: routers.iter().map(|r| r.as_str().to_owned()).collect(),
            workers,
            fewest,
            capacity,
        }
    }

    /// The table on the terminal.
    pub fn table(&self) -> String {
        fewest_table("", ("router", 18), &self.workers, self.cells())
    }

    fn to_csv(&self) -> Result<Vec<u8>, csv::Error> {
        fewest_csv("router", self.cells())
    }

    /// The rows of fewest workers as the table and the CSV print them.
    fn cells(&self) -> Vec<FewestCells<'_>> {
        self.fewest
            .iter()
            .map(|r| FewestCells {
                group: &r.router,
                budget: r.budget,
                rate_scale: r.rate_scale,
                fewest_workers: r.fewest_workers,
                pools: None,
                ttft_p90_ms: r.ttft_p90_ms,
                tbt_p99_ms: r.tbt_p99_ms,
            })
            .collect()
    }
}

/// A row of fewest workers as a comparison of fleets prints it.
pub(crate) struct FewestCells<'a> {
    /// The group: a router, a layout.
    pub group: &'a str,
    /// The budget.
    pub budget: Budget,
    /// The rate scale.
    pub rate_scale: f64,
    /// The fewest workers that met the objective; `None`: none did.
    pub fewest_workers: Option<u32>,
    /// That fleet's prefill and decode workers in a comparison with pools (`None` in one
    /// without: no such column).
    pub pools: Option<(Option<u32>, Option<u32>)>,
    /// That fleet's TTFT p90, simulated ms.
    pub ttft_p90_ms: Option<f64>,
    /// That fleet's TBT p99, simulated ms.
    pub tbt_p99_ms: Option<f64>,
}

/// The terminal table of a comparison's fewest workers over the fleet `sizes`: the title (with
/// `more` after it), the group column `(name, width)`, and a `prefill+decode` column when the
/// rows have pools.
pub(crate) fn fewest_table(
    more: &str,
    group: (&'static str, usize),
    sizes: &[u32],
    rows: Vec<FewestCells<'_>>,
) -> String {
    if rows.is_empty() {
        return "fleets: no objective (`--slo-tbt-p99`, `--slo-ttft-p90`), so no fewest workers to find\n".into();
    }
    let most = sizes.last().copied().unwrap_or(0);
    let listed: Vec<String> = sizes.iter().map(ToString::to_string).collect();
    let title = format!(
        "fleets: the fewest workers (of {}) that meet the objective{more}",
        listed.join(", ")
    );
    let pools = rows.iter().any(|r| r.pools.is_some());
    let mut columns = vec![
        (group.0, Align::Left, group.1),
        ("budget", Align::Left, 8),
        ("rate", Align::Right, 10),
        ("fewest workers", Align::Right, 14),
    ];
    if pools {
        columns.push(("prefill+decode", Align::Right, 14));
    }
    columns.extend([
        ("TTFT p90 ms", Align::Right, 14),
        ("TBT p99 ms", Align::Right, 12),
    ]);
    let rows = rows.into_iter().map(|r| {
        let mut cells = vec![
            r.group.to_owned(),
            r.budget.to_string(),
            format!("{}x", fmt_rate(r.rate_scale)),
            r.fewest_workers
                .map_or_else(|| format!("> {most}"), |n| n.to_string()),
        ];
        if let Some(p) = r.pools {
            cells.push(match p {
                (Some(p), Some(d)) => format!("{p}+{d}"),
                _ => "-".into(),
            });
        }
        cells.extend([ms(r.ttft_p90_ms), ms(r.tbt_p99_ms)]);
        cells
    });
    text_table(&title, &columns, rows)
}

/// The CSV of a comparison's fewest workers: the group column `group`, and the prefill and
/// decode workers when the rows have pools.
pub(crate) fn fewest_csv(group: &str, rows: Vec<FewestCells<'_>>) -> Result<Vec<u8>, csv::Error> {
    let pools = rows.iter().any(|r| r.pools.is_some());
    let mut header = vec![group, "budget", "rate_scale", "fewest_workers"];
    if pools {
        header.extend(["prefill_workers", "decode_workers"]);
    }
    header.extend(["ttft_p90_ms", "tbt_p99_ms"]);
    let opt = |v: Option<f64>| v.map_or_else(String::new, |v| round3(v).to_string());
    let n = |v: Option<u32>| v.map_or_else(String::new, |n| n.to_string());
    let rows = rows.into_iter().map(|r| {
        let mut cells = vec![
            r.group.to_owned(),
            r.budget.to_string(),
            fmt_rate(r.rate_scale),
            n(r.fewest_workers),
        ];
        if let Some((p, d)) = r.pools {
            cells.extend([n(p), n(d)]);
        }
        cells.extend([opt(r.ttft_p90_ms), opt(r.tbt_p99_ms)]);
        cells
    });
    csv_table(&header, rows)
}

impl FleetComparison {
    /// A comparison for its plot alone: `fewest` by series (named as routers are), over the
    /// fleet sizes `workers`, without capacities.
    pub(super) fn of_series(
        routers: Vec<String>,
        workers: Vec<u32>,
        fewest: Vec<FewestRow>,
    ) -> Self {
        Self {
            routers,
            workers,
            fewest,
            capacity: Vec::new(),
        }
    }

    /// The plot's title.
    pub(super) fn title(&self) -> String {
        "The fewest workers that meet the objective, by rate scale".into()
    }

    /// The series of the plot: one per router and budget, in the rows' order.
    fn series(&self) -> Vec<(&str, Budget)> {
        distinct(self.fewest.iter().map(|r| (r.router.as_str(), r.budget)))
    }
}

impl Figure for FleetComparison {
    /// The rate scales across (spread evenly, in order), the fewest workers up (a log axis),
    /// one line per router (and budget, with several), each moved a little sideways so that
    /// equal answers stay visible; a rate no listed fleet met is a hollow mark above the largest
    /// fleet.
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Drawn
    where
        DB::ErrorType: 'static,
    {
        let root = root.titled(&self.title(), text_style(20))?;
        let mut rates = distinct(self.fewest.iter().map(|r| r.rate_scale));
        rates.sort_by(f64::total_cmp);
        let x = |rate: f64| rates.iter().position(|r| *r == rate).unwrap_or(0) as f64;
        let n = rates.len().max(1) as f64;
        let most = f64::from(self.workers.last().copied().unwrap_or(1));
        let over = most * 1.5;
        let names: Vec<String> = rates.iter().map(|r| format!("{}x", fmt_rate(*r))).collect();
        let label = |v: &f64| {
            let i = v.round();
            if (v - i).abs() > 0.01 || i < 0.0 {
                return String::new();
            }
            names.get(i as usize).cloned().unwrap_or_default()
        };
        let mut chart = ChartBuilder::on(&root)
            .margin(16)
            .x_label_area_size(45)
            .y_label_area_size(60)
            .build_cartesian_2d(-1.0..n, (0.8..most * 2.0).log_scale())?;
        chart
            .configure_mesh()
            .x_labels(2 * (n as usize + 1) + 1)
            .disable_x_mesh()
            .x_label_formatter(&label)
            .x_desc("rate scale")
            .y_desc("fewest workers meeting the objective")
            .y_label_formatter(&|v: &f64| format!("{v:.0}"))
            .label_style(text_style(13))
            .axis_desc_style(text_style(14))
            .draw()?;
        let series = self.series();
        let several_budgets = series.iter().any(|(_, b)| *b != series[0].1);
        let spread = 0.2 / series.len().max(1) as f64;
        for (k, (router, budget)) in series.iter().enumerate() {
            let shift = (k as f64 - (series.len() as f64 - 1.0) / 2.0) * spread;
            let rows: Vec<&FewestRow> = self
                .fewest
                .iter()
                .filter(|r| r.router == *router && r.budget == *budget)
                .collect();
            let met: Vec<(f64, f64)> = rows
                .iter()
                .filter_map(|r| Some((x(r.rate_scale) + shift, f64::from(r.fewest_workers?))))
                .collect();
            let c = series_color(k);
            let name = if several_budgets {
                format!("{router}, budget {budget}")
            } else {
                (*router).to_string()
            };
            marked_line(&mut chart, met, c, Some(name))?;
            chart.draw_series(
                rows.iter()
                    .filter(|r| r.fewest_workers.is_none())
                    .map(|r| Circle::new((x(r.rate_scale) + shift, over), 5, c.stroke_width(2))),
            )?;
        }
        legend(&mut chart, 13, SeriesLabelPosition::UpperLeft)?;
        Ok(())
    }
}

/// The fewest workers among `runs` (one router's, workers ascending) whose cell at (`budget`,
/// `rate`) met the objective.
fn fewest_row(runs: &[&FleetRun], router: RouterKind, budget: Budget, rate: f64) -> FewestRow {
    let met = runs.iter().find_map(|r| {
        let c = r.sweep.cell(budget, rate)?;
        (c.meets_slo == Some(true)).then_some((r.value.workers, c))
    });
    FewestRow {
        router: router.as_str().to_owned(),
        budget,
        rate_scale: rate,
        fewest_workers: met.map(|(n, _)| n),
        ttft_p90_ms: met.and_then(|(_, c)| c.summary.ttft_p90_ms),
        tbt_p99_ms: met.and_then(|(_, c)| c.summary.tbt_p99_ms),
    }
}

#[cfg(test)]
#[path = "tests/fleet_axis.rs"]
mod tests;
