//! The prefill/decode axis of a sweep (`docs/disaggregated.md#chunked-or-disaggregated-in-a-sweep`):
//! `--pd 1:3,1:1,3:1 --workers 4,8` runs the whole grid once per fleet size on the colocated
//! fleet (`replay.fleet.workers`) and on each split of it into a prefill and a decode pool
//! (`replay.fleet.prefill_workers`, `decode_workers`), each into `OUT/pd-<layout>-<n>/`; then
//! `OUT/sweep.csv` holds every run's cells with `layout`, `workers`, `prefill_workers` and
//! `decode_workers` columns first, and `OUT/fleet.csv`/`fleet.json`/`fleet.svg` give, per
//! layout, budget and rate scale, the fewest workers that meet the objective.

use serde::Serialize;

use super::axis::{comparison, parse_list, Axis, AxisRun, Comparison};
use super::fleet_axis::{
    compare_groups, fewest_csv, fewest_table, parse_workers, CapacityGroup, FewestCells, FewestRow,
    FleetComparison, GroupCapacity, FLEET,
};
use super::grid::{Budget, GridError};
use super::plots::render_figure;
use super::SweepError;
use crate::config::Settings;
use crate::replay::topology::MAX_WORKERS;

/// A split of a fleet: prefill workers to decode workers, as `--pd` names it (`1:3`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ratio {
    /// The prefill share.
    pub prefill: u32,
    /// The decode share.
    pub decode: u32,
}

impl std::fmt::Display for Ratio {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.prefill, self.decode)
    }
}

impl Ratio {
    /// The pools of a fleet of `workers` (at least 2) split at this ratio: the prefill workers
    /// `workers × prefill / (prefill + decode)` rounded to the nearest (halves up), kept from 1
    /// to `workers − 1`; the decode workers the rest.
    pub fn split(self, workers: u32) -> (u32, u32) {
        let (a, total) = (
            u64::from(self.prefill),
            u64::from(self.prefill) + u64::from(self.decode),
        );
        let p = (2 * u64::from(workers) * a + total) / (2 * total);
        let p = (p as u32).clamp(1, workers.saturating_sub(1).max(1));
        (p, workers - p)
    }
}

/// Parses `--pd`: splits `P:D`, each share a whole number from 1 to [`MAX_WORKERS`], each once.
///
/// # Errors
/// An empty entry, one that is not such a split, or a repeated one.
pub fn parse_ratios(list: &str) -> Result<Vec<Ratio>, GridError> {
    parse_list("--pd", list, |item| {
        let share = |s: &str| {
            s.trim()
                .parse::<u32>()
                .ok()
                .filter(|n| (1..=MAX_WORKERS).contains(n))
        };
        item.split_once(':')
            .and_then(|(p, d)| Some(Ratio { prefill: share(p)?, decode: share(d)? }))
            .ok_or_else(|| {
                format!("takes prefill:decode splits of whole numbers from 1 to {MAX_WORKERS} (1:3), got {item:?}")
            })
    })
}

/// One fleet of the axis: `workers` colocated (`split` `None`) or split into two pools.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// The split; `None`: every worker prefills and decodes.
    pub split: Option<Ratio>,
    /// The workers, both pools together.
    pub workers: u32,
}

impl Layout {
    /// The layout's name in the tables and files: `colocated`, or the split (`1:3`).
    pub fn name(self) -> String {
        self.split
            .map_or_else(|| "colocated".into(), |r| r.to_string())
    }

    /// Its prefill and decode workers (`None` colocated).
    pub fn pools(self) -> Option<(u32, u32)> {
        self.split.map(|r| r.split(self.workers))
    }
}

impl std::fmt::Display for Layout {
    /// `4 workers, colocated` or `4 workers split 1:3 (1 prefill + 3 decode)`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = crate::text::plural(u64::from(self.workers), "worker");
        match (self.split, self.pools()) {
            (Some(r), Some((p, d))) => write!(f, "{n} split {r} ({p} prefill + {d} decode)"),
            _ => write!(f, "{n}, colocated"),
        }
    }
}

/// Parses `--pd` with the fleet sizes of `--workers` (the config's `workers` without it) into
/// the fleets to run: the colocated fleet of each size, then each split of each size, sizes
/// ascending. `None` without `--pd`.
///
/// # Errors
/// A refused list, naming its flag; a size below 2 (a split needs a worker in each pool).
pub fn parse_layouts(
    pd: Option<&str>,
    workers: Option<&str>,
    config_workers: u32,
) -> Result<Option<Vec<Layout>>, GridError> {
    let Some(pd) = pd else { return Ok(None) };
    let ratios = parse_ratios(pd)?;
    let sizes = workers.map_or(Ok(vec![config_workers]), parse_workers)?;
    if let Some(n) = sizes.iter().find(|n| **n < 2) {
        return Err(GridError {
            flag: "--workers",
            problem: format!(
                "with --pd takes fleet sizes of at least 2 (a prefill and a decode worker), got {n}"
            ),
        });
    }
    let splits = std::iter::once(None).chain(ratios.into_iter().map(Some));
    Ok(Some(
        splits
            .flat_map(|split| sizes.iter().map(move |&workers| Layout { split, workers }))
            .collect(),
    ))
}

/// `--pd` with `--workers`: the grid once per fleet ([`parse_layouts`]), each into
/// `OUT/pd-<layout>-<n>/`, then the cells together (`OUT/sweep.csv`) and the fewest workers of
/// each layout that meet the objective (`OUT/fleet.*`).
pub struct PdAxis;

impl Axis for PdAxis {
    type Value = Layout;
    const SETTING: &'static str = "fleet";
    const DIR_PREFIX: &'static str = "pd";
    const COLUMNS: Option<&'static [&'static str]> =
        Some(&["layout", "workers", "prefill_workers", "decode_workers"]);

    fn apply(settings: &Settings, l: Layout) -> (Settings, String) {
        let mut out = settings.clone();
        let f = &mut out.replay.fleet;
        match l.pools() {
            None => {
                f.workers = l.workers;
                f.prefill_workers = None;
                f.decode_workers = None;
            }
            Some((p, d)) => {
                f.workers = 1;
                f.prefill_workers = Some(p);
                f.decode_workers = Some(d);
            }
        }
        let label = format!("{l} behind {} (--pd, --workers)", f.router);
        (out, label)
    }
    fn dir_name(l: Layout) -> String {
        let layout = l.split.map_or_else(
            || "colocated".into(),
            |r| format!("{}x{}", r.prefill, r.decode),
        );
        format!("pd-{layout}-{}", l.workers)
    }
    fn failure(l: Layout) -> String {
        format!("with {l}")
    }
    fn cells(l: Layout) -> Vec<String> {
        let (p, d) = l.pools().map_or((String::new(), String::new()), |(p, d)| {
            (p.to_string(), d.to_string())
        });
        vec![l.name(), l.workers.to_string(), p, d]
    }
    fn compare(runs: &[AxisRun<Layout>]) -> Result<Comparison, SweepError> {
        let cmp = PdComparison::of(runs);
        let plot = if cmp.fewest.is_empty() {
            None
        } else {
            let fig = cmp.figure();
            Some(render_figure("fleet", fig.title(), &fig)?)
        };
        comparison::<Self>(runs, FLEET, cmp.table(), cmp.to_csv(), &cmp, plot)
    }
}

/// Under one layout, budget and rate scale: the fewest workers that meet the objective.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PdFewestRow {
    /// `colocated` or the split (`1:3`).
    pub layout: String,
    /// The budget.
    pub budget: Budget,
    /// The rate scale.
    #[serde(serialize_with = "crate::text::ser_round")]
    pub rate_scale: f64,
    /// The fewest workers of `--workers` whose fleet of this layout met the objective at this
    /// rate; `None`: none did.
    pub fewest_workers: Option<u32>,
    /// That fleet's prefill and decode workers (`None` colocated, or none met it).
    pub prefill_workers: Option<u32>,
    /// See `prefill_workers`.
    pub decode_workers: Option<u32>,
    /// That fleet's TTFT p90 and TBT p99, simulated ms.
    #[serde(serialize_with = "crate::text::ser_opt_round")]
    pub ttft_p90_ms: Option<f64>,
    /// See `ttft_p90_ms`.
    #[serde(serialize_with = "crate::text::ser_opt_round")]
    pub tbt_p99_ms: Option<f64>,
}

/// Fleets grouped by layout (colocated, or a split).
#[derive(Debug, Clone, PartialEq)]
pub struct ByLayout;

impl CapacityGroup for ByLayout {
    const KEY: &'static str = "layout";
}

/// A fleet's capacity in the comparison of layouts (its workers: both pools together).
pub type PdCapacity = GroupCapacity<ByLayout>;

/// The comparison of colocated and disaggregated fleets.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PdComparison {
    /// The layouts: `colocated`, then each split in the order given.
    pub layouts: Vec<String>,
    /// The fleet sizes, ascending.
    pub workers: Vec<u32>,
    /// Per layout, budget and rate scale, the fewest workers that meet the objective (only with
    /// an objective).
    pub fewest: Vec<PdFewestRow>,
    /// Per layout, fleet size and budget, the capacity (only with an objective).
    pub capacity: Vec<PdCapacity>,
}

impl PdComparison {
    /// Compares the runs (same budgets and rates in each), ordered by layout, then workers
    /// ascending.
    pub fn of(runs: &[AxisRun<Layout>]) -> Self {
        let (layouts, workers, fewest, capacity) = compare_groups(
            runs,
            |l| l.split,
            |l| l.workers,
            |mine, _, budget, rate| fewest_row(mine, budget, rate),
            |_, l| l.name(),
        );
        Self {
            layouts: layouts
                .iter()
                .map(|s| {
                    Layout {
                        split: *s,
                        workers: 2,
                    }
                    .name()
                })
                .collect(),
            workers,
            fewest,
            capacity,
        }
    }

    /// The table on the terminal.
    pub fn table(&self) -> String {
        fewest_table(
            ", colocated or split prefill:decode",
            ("layout", 10),
            &self.workers,
            self.cells(),
        )
    }

    fn to_csv(&self) -> Result<Vec<u8>, csv::Error> {
        fewest_csv("layout", self.cells())
    }

    /// The rows of fewest workers as the table and the CSV print them.
    fn cells(&self) -> Vec<FewestCells<'_>> {
        self.fewest
            .iter()
            .map(|r| FewestCells {
                group: &r.layout,
                budget: r.budget,
                rate_scale: r.rate_scale,
                fewest_workers: r.fewest_workers,
                pools: Some((r.prefill_workers, r.decode_workers)),
                ttft_p90_ms: r.ttft_p90_ms,
                tbt_p99_ms: r.tbt_p99_ms,
            })
            .collect()
    }

    /// The plot: the fleet axes' plot of the fewest workers by rate scale, one line per layout.
    fn figure(&self) -> FleetComparison {
        FleetComparison::of_series(
            self.layouts.clone(),
            self.workers.clone(),
            self.fewest
                .iter()
                .map(|r| FewestRow {
                    router: r.layout.clone(),
                    budget: r.budget,
                    rate_scale: r.rate_scale,
                    fewest_workers: r.fewest_workers,
                    ttft_p90_ms: r.ttft_p90_ms,
                    tbt_p99_ms: r.tbt_p99_ms,
                })
                .collect(),
        )
    }
}

/// The fewest workers among `runs` (one layout's, workers ascending) whose cell at (`budget`,
/// `rate`) met the objective.
fn fewest_row(runs: &[&AxisRun<Layout>], budget: Budget, rate: f64) -> PdFewestRow {
    let met = runs.iter().find_map(|r| {
        let c = r.sweep.cell(budget, rate)?;
        (c.meets_slo == Some(true)).then_some((r.value, c))
    });
    let pools = met.and_then(|(l, _)| l.pools());
    PdFewestRow {
        layout: runs.first().map_or_else(String::new, |r| r.value.name()),
        budget,
        rate_scale: rate,
        fewest_workers: met.map(|(l, _)| l.workers),
        prefill_workers: pools.map(|p| p.0),
        decode_workers: pools.map(|p| p.1),
        ttft_p90_ms: met.and_then(|(_, c)| c.summary.ttft_p90_ms),
        tbt_p99_ms: met.and_then(|(_, c)| c.summary.tbt_p99_ms),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_split_rounds_to_the_nearest_and_keeps_a_worker_in_each_pool() {
        let r = |prefill, decode| Ratio { prefill, decode };
        assert_eq!(r(1, 3).split(4), (1, 3));
        assert_eq!(r(1, 1).split(4), (2, 2));
        assert_eq!(r(3, 1).split(4), (3, 1));
        assert_eq!(r(1, 3).split(8), (2, 6));
        // 6 × 1/4 = 1.5: halves up.
        assert_eq!(r(1, 3).split(6), (2, 4));
        // 2 × 1/8 rounds to 0: one prefill worker all the same; 2 × 7/8: one decode worker.
        assert_eq!(r(1, 7).split(2), (1, 1));
        assert_eq!(r(7, 1).split(2), (1, 1));
        assert_eq!(r(1, 2).split(3), (1, 2));
        assert_eq!(r(2, 1).split(3), (2, 1));
    }

    #[test]
    fn ratios_and_sizes_are_refused_naming_their_flag() {
        assert_eq!(
            parse_ratios("1:3, 3:1").unwrap(),
            [
                Ratio {
                    prefill: 1,
                    decode: 3
                },
                Ratio {
                    prefill: 3,
                    decode: 1
                }
            ]
        );
        for bad in ["1:0", "0:1", "1", "1:3:1", "a:b", "1:3,1:3", "", "1:257"] {
            let e = parse_ratios(bad).unwrap_err();
            assert_eq!(e.flag, "--pd", "{bad}");
        }
        let e = parse_layouts(Some("1:1"), Some("1,2"), 1).unwrap_err();
        assert_eq!(e.flag, "--workers");
        assert!(e.problem.contains("at least 2"), "{e:?}");
        // Without --workers, the config's size: 1 is refused too.
        assert!(parse_layouts(Some("1:1"), None, 1).is_err());
        assert_eq!(parse_layouts(None, Some("2,4"), 1).unwrap(), None);
    }

    #[test]
    fn the_colocated_fleet_runs_first_then_each_split_sizes_ascending() {
        let l = parse_layouts(Some("1:3,1:1"), Some("2,4"), 1)
            .unwrap()
            .unwrap();
        let names: Vec<String> = l
            .iter()
            .map(|l| format!("{}/{}", l.name(), l.workers))
            .collect();
        assert_eq!(
            names,
            [
                "colocated/2",
                "colocated/4",
                "1:3/2",
                "1:3/4",
                "1:1/2",
                "1:1/4"
            ]
        );
        assert_eq!(PdAxis::dir_name(l[3]), "pd-1x3-4");
        assert_eq!(PdAxis::dir_name(l[0]), "pd-colocated-2");
        assert_eq!(PdAxis::cells(l[3]), ["1:3", "4", "1", "3"]);
        assert_eq!(PdAxis::cells(l[1]), ["colocated", "4", "", ""]);
    }

    #[test]
    fn a_layout_sets_the_pools_or_the_workers_never_both() {
        let s = Settings::default();
        let (c, label) = PdAxis::apply(
            &s,
            Layout {
                split: None,
                workers: 4,
            },
        );
        let f = &c.replay.fleet;
        assert_eq!(
            (f.workers, f.prefill_workers, f.decode_workers),
            (4, None, None)
        );
        assert!(label.contains("4 workers, colocated"), "{label}");
        let mut s2 = s.clone();
        s2.replay.fleet.workers = 6;
        let (c, label) = PdAxis::apply(
            &s2,
            Layout {
                split: Some(Ratio {
                    prefill: 1,
                    decode: 3,
                }),
                workers: 8,
            },
        );
        let f = &c.replay.fleet;
        assert_eq!(
            (f.workers, f.prefill_workers, f.decode_workers),
            (1, Some(2), Some(6))
        );
        assert!(label.contains("2 prefill + 6 decode"), "{label}");
    }
}
