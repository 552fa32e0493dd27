//! The KV-memory axis of a sweep (`docs/kv-memory.md#in-a-sweep`): `--kv-blocks` runs the
//! whole grid once per KV pool size, each into `OUT/kv-<blocks>/`. This module parses the list
//! and compares the runs: `kv.csv`, `kv.json` and the plot `kv.svg`/`kv.png`, with each
//! budget's capacity and TTFT p90 per pool size.

use std::fmt;

use plotters::coord::Shift;
use plotters::prelude::*;
use serde::{Serialize, Serializer};

use super::axis::{
    budget_rows, budget_table, comparison, csv_table, parse_list, Align, Axis, AxisRun,
    BudgetCapacity, Comparison, Tail,
};
use super::grid::{Budget, GridError};
use super::plots::{
    distinct, legend, marked_line, render_figure, series_color, text_style, Drawn, Figure,
};
use super::SweepError;
use crate::config::{KvSection, LoadedConfig, Settings};
use crate::replay::{ReplaySetup, Trace};
use crate::text::fmt_rate;

/// The most blocks `--kv-blocks` takes (as `replay.kv.blocks`).
pub const MAX_KV_BLOCKS: u64 = 1 << 40;

/// One pool size of the axis.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvBlocks {
    /// A pool of this many blocks (`replay.kv.blocks`).
    Blocks(u64),
    /// Unlimited memory (`[replay.kv]` unset).
    Unlimited,
}

impl fmt::Display for KvBlocks {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Blocks(n) => write!(f, "{n}"),
            Self::Unlimited => f.write_str("unlimited"),
        }
    }
}

/// Serialised as its number, or the string `"unlimited"`.
impl Serialize for KvBlocks {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::Blocks(n) => s.serialize_u64(*n),
            Self::Unlimited => s.serialize_str("unlimited"),
        }
    }
}

/// Parses `--kv-blocks`: block counts from 1 to [`MAX_KV_BLOCKS`] and `unlimited` (or `off`),
/// each at most once, returned in ascending order with `unlimited` last.
///
/// # Errors
/// An empty entry, a bad or repeated value, or more than [`super::grid::MAX_AXIS_VALUES`].
pub fn parse_kv_blocks(list: &str) -> Result<Vec<KvBlocks>, GridError> {
    let mut out = parse_list("--kv-blocks", list, |item| {
        if item.eq_ignore_ascii_case("unlimited") || item.eq_ignore_ascii_case("off") {
            return Ok(KvBlocks::Unlimited);
        }
        item.parse::<u64>()
            .ok()
            .filter(|n| (1..=MAX_KV_BLOCKS).contains(n))
            .map(KvBlocks::Blocks)
            .ok_or_else(|| {
                format!(
                    "takes whole numbers of KV blocks from 1 to {MAX_KV_BLOCKS}, or `unlimited`; got {item:?}"
                )
            })
    })?;
    out.sort_by_key(|v| match v {
        KvBlocks::Blocks(n) => *n,
        KvBlocks::Unlimited => u64::MAX,
    });
    Ok(out)
}

/// `settings` with the replay's KV pool of `kv` blocks (the configured block size and
/// watermark kept), and how the sweep's settings label it.
pub fn with_kv(settings: &Settings, kv: KvBlocks) -> (Settings, String) {
    let mut out = settings.clone();
    let given = &settings.replay.kv;
    out.replay.kv = KvSection {
        blocks: match kv {
            KvBlocks::Blocks(n) => Some(n),
            KvBlocks::Unlimited => None,
        },
        block_tokens: given.block_tokens,
        watermark: given.watermark,
        ..Default::default()
    };
    let label = match kv {
        KvBlocks::Blocks(n) => format!(
            "{n} blocks of {} tokens (--kv-blocks)",
            given
                .block_tokens
                .unwrap_or(crate::replay::settings::DEFAULT_KV_BLOCK_TOKENS)
        ),
        KvBlocks::Unlimited => "unlimited (--kv-blocks)".into(),
    };
    (out, label)
}

/// `--kv-blocks`: the grid once per KV pool size, each into `OUT/kv-<blocks>/` (`kv-7609`,
/// `kv-unlimited`), then their comparison (`OUT/kv.*`); no combined `sweep.csv`.
pub struct KvAxis;

impl Axis for KvAxis {
    type Value = KvBlocks;
    const SETTING: &'static str = "KV memory";
    const DIR_PREFIX: &'static str = "kv";
    const COLUMNS: Option<&'static [&'static str]> = None;

    fn apply(settings: &Settings, kv: KvBlocks) -> (Settings, String) {
        with_kv(settings, kv)
    }
    fn heading(kv: KvBlocks) -> String {
        format!("KV blocks: {kv}")
    }
    fn failure(kv: KvBlocks) -> String {
        format!("with {kv} KV blocks")
    }
    /// Refuses a pool the replay would refuse: its `[replay]` settings, or a request of the
    /// trace that could never fit in it.
    fn check(pools: &[KvBlocks], loaded: &LoadedConfig, trace: &Trace) -> Result<(), String> {
        for kv in pools {
            let (settings, _) = with_kv(&loaded.settings, *kv);
            ReplaySetup::resolve(&loaded.manifest, &settings)
                .and_then(|setup| crate::replay::check_kv_fits(&setup, trace))
                .map_err(|e| format!("`--kv-blocks` names {kv}: {e} (no replay ran)"))?;
        }
        Ok(())
    }
    fn compare(runs: &[AxisRun<KvBlocks>]) -> Result<Comparison, SweepError> {
        let cmp = KvComparison::of(runs);
        let plot = render_figure("kv", cmp.title(), &cmp)?;
        comparison::<Self>(runs, "kv", cmp.table(), cmp.to_csv(), &cmp, Some(plot))
    }
}

/// One budget under one pool size.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct KvRow {
    /// The pool size.
    pub kv_blocks: KvBlocks,
    /// The budget and its capacity.
    #[serde(flatten)]
    pub at: BudgetCapacity,
    /// Its cell's tail latencies at the comparison's rate scale.
    #[serde(flatten)]
    pub tail: Tail,
}

/// The comparison of the pool sizes.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct KvComparison {
    /// The rate scale the latencies are taken at (the sweep's step-time rate).
    #[serde(serialize_with = "crate::text::ser_round")]
    pub rate_scale: f64,
    /// Whether the runs had an SLO (and so capacities).
    pub slo: Option<super::Slo>,
    /// The pool sizes, in order.
    pub kv_blocks: Vec<KvBlocks>,
    /// One row per pool size and budget.
    pub rows: Vec<KvRow>,
}

impl KvComparison {
    /// Compares the sweeps run under each pool size (same budgets and rates in each).
    pub fn of(runs: &[AxisRun<KvBlocks>]) -> Self {
        let (rate_scale, rows) = budget_rows(runs, |kv_blocks, p| KvRow {
            kv_blocks,
            at: p.at,
            tail: Tail::of(p.cell),
        });
        Self {
            rate_scale,
            slo: runs.first().and_then(|r| r.sweep.slo),
            kv_blocks: runs.iter().map(|r| r.value).collect(),
            rows,
        }
    }

    /// The table on the terminal.
    pub fn table(&self) -> String {
        let rows = self.rows.iter();
        let rows = rows.map(|r| (r.kv_blocks.to_string(), &r.at, vec![], &r.tail));
        let value = ("kv blocks", Align::Left, 12);
        budget_table("KV memory", self.rate_scale, value, &[], rows)
    }

    /// The rows as CSV.
    ///
    /// # Errors
    /// The CSV writer failed.
    pub fn to_csv(&self) -> Result<Vec<u8>, csv::Error> {
        let mut header = vec!["kv_blocks", "budget", "capacity_rate", "capacity"];
        header.extend(Tail::CSV_COLUMNS);
        let f = |v: Option<f64>| v.map_or_else(String::new, |v| format!("{:.3}", v));
        let rows = self.rows.iter().map(|r| {
            let (kv, at) = (r.kv_blocks.to_string(), &r.at);
            let capacity = at.capacity.clone().unwrap_or_default();
            let mut row = vec![kv, at.budget.to_string(), f(at.capacity_rate), capacity];
            row.extend(r.tail.cells(f));
            row
        });
        csv_table(&header, rows)
    }

    fn title(&self) -> String {
        format!(
            "KV memory: capacity{} and TTFT p90 at rate scale {}",
            if self.slo.is_some() {
                " under the SLO"
            } else {
                ""
            },
            fmt_rate(self.rate_scale)
        )
    }

    fn budgets(&self) -> Vec<Budget> {
        distinct(self.rows.iter().map(|r| r.at.budget))
    }

    fn x(&self, kv: KvBlocks) -> i32 {
        self.kv_blocks.iter().position(|k| *k == kv).unwrap_or(0) as i32
    }

    /// `budget`'s figure `y` at each pool size that has one.
    fn points(&self, budget: Budget, y: impl Fn(&KvRow) -> Option<f64>) -> Vec<(i32, f64)> {
        self.rows
            .iter()
            .filter(|r| r.at.budget == budget)
            .filter_map(|r| Some((self.x(r.kv_blocks), y(r)?)))
            .collect()
    }
}

impl Figure for KvComparison {
    /// Left: each budget's capacity against the pool size; right: its TTFT p90 (log axis).
    /// Pool sizes are spread evenly, in order, `unlimited` last.
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Drawn
    where
        DB::ErrorType: 'static,
    {
        let root = root.titled(&self.title(), text_style(20))?;
        let (left, right) = root.split_horizontally(root.dim_in_pixel().0 / 2);
        let n = self.kv_blocks.len().max(1) as i32;
        let names: Vec<String> = self.kv_blocks.iter().map(ToString::to_string).collect();
        let label = |v: &i32| {
            usize::try_from(*v)
                .ok()
                .and_then(|i| names.get(i).cloned())
                .unwrap_or_default()
        };
        let budgets = self.budgets();
        // Capacity.
        let top = self
            .rows
            .iter()
            .filter_map(|r| r.at.capacity_rate)
            .fold(0.0_f64, f64::max)
            .max(0.001)
            * 1.2;
        let mut chart = ChartBuilder::on(&left)
            .margin(12)
            .x_label_area_size(45)
            .y_label_area_size(60)
            .build_cartesian_2d(-1..n, 0.0..top)?;
        chart
            .configure_mesh()
            .x_labels(n as usize + 2)
            .x_label_formatter(&label)
            .x_desc("KV blocks")
            .y_desc(if self.slo.is_some() {
                "capacity (rate scale meeting the SLO)"
            } else {
                "capacity (no SLO given)"
            })
            .label_style(text_style(13))
            .axis_desc_style(text_style(14))
            .draw()?;
        for (k, b) in budgets.iter().enumerate() {
            let pts = self.points(*b, |r| r.at.capacity_rate);
            marked_line(
                &mut chart,
                pts,
                series_color(k),
                Some(format!("budget {b}")),
            )?;
        }
        if !budgets.is_empty() {
            legend(&mut chart, 13, SeriesLabelPosition::LowerRight)?;
        }
        // TTFT p90, log axis.
        let (lo, hi) = self
            .rows
            .iter()
            .filter_map(|r| r.tail.ttft_p90_ms)
            .filter(|v| v.is_finite() && *v > 0.0)
            .fold((f64::INFINITY, 0.0_f64), |(lo, hi), v| {
                (lo.min(v), hi.max(v))
            });
        let (lo, hi) = if hi > 0.0 {
            (10f64.powf((lo / 1.3).log10().floor()), hi * 2.0)
        } else {
            (1.0, 10.0)
        };
        let mut chart = ChartBuilder::on(&right)
            .margin(12)
            .x_label_area_size(45)
            .y_label_area_size(70)
            .build_cartesian_2d(-1..n, (lo..hi).log_scale())?;
        chart
            .configure_mesh()
            .x_labels(n as usize + 2)
            .x_label_formatter(&label)
            .x_desc("KV blocks")
            .y_desc(format!(
                "TTFT p90 at rate scale {}, ms",
                fmt_rate(self.rate_scale)
            ))
            .y_label_formatter(&|v: &f64| format!("{v:.0}"))
            .label_style(text_style(13))
            .axis_desc_style(text_style(14))
            .draw()?;
        for (k, b) in budgets.iter().enumerate() {
            let pts = self.points(*b, |r| r.tail.ttft_p90_ms);
            marked_line(&mut chart, pts, series_color(k), None)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_blocks_parse_sorted_with_unlimited_last() {
        assert_eq!(
            parse_kv_blocks("unlimited, 8000,2000 ,4000").unwrap(),
            [
                KvBlocks::Blocks(2000),
                KvBlocks::Blocks(4000),
                KvBlocks::Blocks(8000),
                KvBlocks::Unlimited
            ]
        );
        assert_eq!(parse_kv_blocks("OFF").unwrap(), [KvBlocks::Unlimited]);
        assert_eq!(KvAxis::dir_name(KvBlocks::Blocks(7609)), "kv-7609");
        assert_eq!(KvAxis::dir_name(KvBlocks::Unlimited), "kv-unlimited");
        assert_eq!(
            serde_json::to_string(&[KvBlocks::Blocks(3), KvBlocks::Unlimited]).unwrap(),
            r#"[3,"unlimited"]"#
        );
        let cases = [
            ("0", "from 1 to"),
            ("-3", "got \"-3\""),
            ("1099511627777", "from 1 to"),
            ("10,,20", "without empty entries"),
            ("10,10", "names 10 twice"),
            ("off,unlimited", "names unlimited twice"),
            ("1.5", "got \"1.5\""),
        ];
        crate::sweep::grid::assert_refused("--kv-blocks", parse_kv_blocks, &cases);
    }
}
