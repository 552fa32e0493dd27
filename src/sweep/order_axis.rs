//! The order axis of a sweep (`docs/sweep.md#orders`): `--orders` runs the whole grid once per
//! order of waiting prompts (`chunking.order` for every node), each into `OUT/order-<order>/`,
//! then writes `OUT/sweep.csv`, every run's cells with an `order` column first, and
//! `OUT/orders.csv`/`orders.json`, each budget's capacity and latency per order. A sweep
//! without `--orders` writes `sweep.csv` as before, without the column.

use std::path::{Path, PathBuf};

use serde::Serialize;

use super::grid::{Budget, GridError, MAX_AXIS_VALUES};
use super::output::{to_csv, write_whole};
use super::{Sweep, SweepError};
use crate::config::spelling::OrderSetting;
use crate::config::Settings;
use crate::order::Order;
use crate::text::fmt_rate;

/// The comparison's CSV file.
pub const ORDERS_CSV: &str = "orders.csv";
/// The comparison as JSON.
pub const ORDERS_JSON: &str = "orders.json";

/// Parses `--orders`: order names, each at most once, in the order given.
///
/// # Errors
/// An empty entry, an unknown or repeated order.
pub fn parse_orders(list: &str) -> Result<Vec<Order>, GridError> {
    let bad = |problem: String| GridError {
        flag: "--orders",
        problem,
    };
    let items: Vec<&str> = list.split(',').map(str::trim).collect();
    if items.iter().any(|i| i.is_empty()) {
        return Err(bad(format!(
            "takes a comma-separated list without empty entries, got {list:?}"
        )));
    }
    if items.len() > MAX_AXIS_VALUES {
        return Err(bad(format!(
            "takes at most {MAX_AXIS_VALUES} values, got {}",
            items.len()
        )));
    }
    let mut out = Vec::new();
    for item in items {
        let o: Order = item.parse().map_err(|e| bad(format!("{e}")))?;
        if out.contains(&o) {
            return Err(bad(format!("names {o} twice")));
        }
        out.push(o);
    }
    Ok(out)
}

/// `settings` with `order` for every node (over any `chunking.order` of the config), and the
/// label the run's settings show.
pub fn with_order(settings: &Settings, order: Order) -> (Settings, String) {
    let mut out = settings.clone();
    out.chunking.order = OrderSetting::All(order);
    (out, format!("{order} (--orders)"))
}

/// The subdirectory a run of `order` is written to.
pub fn dir_name(order: Order) -> String {
    format!("order-{order}")
}

/// One budget under one order.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OrderRow {
    /// The order.
    pub order: &'static str,
    /// The budget.
    pub budget: Budget,
    /// The capacity under the SLO, as text (`1.23x`, `none`); `None` without an SLO.
    pub capacity: Option<String>,
    /// The capacity's rate scale (`None`: none, or no SLO).
    #[serde(serialize_with = "super::output::ser_opt_round")]
    pub capacity_rate: Option<f64>,
    /// TTFT p50, p90, p99 and TBT p99 at the comparison's rate scale, simulated ms.
    #[serde(serialize_with = "super::output::ser_opt_round")]
    pub ttft_p50_ms: Option<f64>,
    /// See `ttft_p50_ms`.
    #[serde(serialize_with = "super::output::ser_opt_round")]
    pub ttft_p90_ms: Option<f64>,
    /// See `ttft_p50_ms`.
    #[serde(serialize_with = "super::output::ser_opt_round")]
    pub ttft_p99_ms: Option<f64>,
    /// See `ttft_p50_ms`.
    #[serde(serialize_with = "super::output::ser_opt_round")]
    pub tbt_p99_ms: Option<f64>,
}

/// The comparison of the orders.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OrderComparison {
    /// The rate scale the latencies are taken at (the sweep's step-time rate).
    #[serde(serialize_with = "super::output::ser_round")]
    pub rate_scale: f64,
    /// The orders, in the order given.
    pub orders: Vec<&'static str>,
    /// One row per order and budget.
    pub rows: Vec<OrderRow>,
}

impl OrderComparison {
    /// Compares the sweeps run under each order (same budgets and rates in each).
    pub fn of(runs: &[(Order, Sweep)]) -> Self {
        let rate_scale = runs.first().map_or(1.0, |(_, s)| s.step_time_rate);
        let mut rows = Vec::new();
        for (order, sweep) in runs {
            for b in &sweep.budgets {
                let cap = sweep.capacity.iter().find(|c| c.budget == *b);
                let cell = sweep.cell(*b, rate_scale).map(|c| &c.summary);
                rows.push(OrderRow {
                    order: order.as_str(),
                    budget: *b,
                    capacity: cap.map(super::Capacity::label),
                    capacity_rate: cap.and_then(|c| c.search.rate_scale),
                    ttft_p50_ms: cell.and_then(|s| s.ttft_p50_ms),
                    ttft_p90_ms: cell.and_then(|s| s.ttft_p90_ms),
                    ttft_p99_ms: cell.and_then(|s| s.ttft_p99_ms),
                    tbt_p99_ms: cell.and_then(|s| s.tbt_p99_ms),
                });
            }
        }
        Self {
            rate_scale,
            orders: runs.iter().map(|(o, _)| o.as_str()).collect(),
            rows,
        }
    }

    /// The table on the terminal.
    pub fn table(&self) -> String {
        let opt = |v: Option<f64>| v.map_or_else(|| "-".into(), |v| format!("{v:.1}"));
        let mut out = format!(
            "orders: capacity and latency at rate scale {}\n  {:<16} {:<8} {:>12} {:>14} {:>14} {:>14} {:>12}\n",
            fmt_rate(self.rate_scale),
            "order",
            "budget",
            "capacity",
            "TTFT p50 ms",
            "TTFT p90 ms",
            "TTFT p99 ms",
            "TBT p99 ms"
        );
        for r in &self.rows {
            out.push_str(&format!(
                "  {:<16} {:<8} {:>12} {:>14} {:>14} {:>14} {:>12}\n",
                r.order,
                r.budget.to_string(),
                r.capacity.clone().unwrap_or_else(|| "-".into()),
                opt(r.ttft_p50_ms),
                opt(r.ttft_p90_ms),
                opt(r.ttft_p99_ms),
                opt(r.tbt_p99_ms)
            ));
        }
        out
    }

    fn to_csv(&self) -> Result<Vec<u8>, csv::Error> {
        let mut w = csv::Writer::from_writer(Vec::new());
        w.write_record([
            "order",
            "budget",
            "capacity",
            "capacity_rate",
            "ttft_p50_ms",
            "ttft_p90_ms",
            "ttft_p99_ms",
            "tbt_p99_ms",
        ])?;
        let opt =
            |v: Option<f64>| v.map_or_else(String::new, |v| crate::text::round3(v).to_string());
        for r in &self.rows {
            w.write_record([
                r.order.to_string(),
                r.budget.to_string(),
                r.capacity.clone().unwrap_or_default(),
                opt(r.capacity_rate),
                opt(r.ttft_p50_ms),
                opt(r.ttft_p90_ms),
                opt(r.ttft_p99_ms),
                opt(r.tbt_p99_ms),
            ])?;
        }
        w.into_inner().map_err(|e| csv::Error::from(e.into_error()))
    }

    /// Writes `orders.csv`, `orders.json` and the combined `sweep.csv` of `runs` into `dir`.
    ///
    /// # Errors
    /// A file cannot be written.
    pub fn write(&self, runs: &[(Order, Sweep)], dir: &Path) -> Result<Vec<PathBuf>, SweepError> {
        let fail = |name: &str, e: String| SweepError::Write {
            path: dir.join(name),
            source: std::io::Error::other(e),
        };
        let csv = self.to_csv().map_err(|e| fail(ORDERS_CSV, e.to_string()))?;
        let mut json =
            serde_json::to_vec_pretty(self).map_err(|e| fail(ORDERS_JSON, e.to_string()))?;
        json.push(b'\n');
        let cells = combined_csv(runs).map_err(|e| fail(super::output::CSV_FILE, e.to_string()))?;
        let files: [(&str, &[u8]); 3] = [
            (super::output::CSV_FILE, &cells),
            (ORDERS_CSV, &csv),
            (ORDERS_JSON, &json),
        ];
        let mut paths = Vec::new();
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
}

/// Every run's `sweep.csv` rows, each with its order first, under one header: `order`, then
/// the columns of a sweep without the axis.
///
/// # Errors
/// None in practice (written to memory).
pub fn combined_csv(runs: &[(Order, Sweep)]) -> Result<Vec<u8>, csv::Error> {
    let mut w = csv::Writer::from_writer(Vec::new());
    let mut header_written = false;
    for (order, sweep) in runs {
        let one = to_csv(sweep)?;
        let mut r = csv::Reader::from_reader(one.as_slice());
        if !header_written {
            let mut h = vec!["order".to_string()];
            h.extend(r.headers()?.iter().map(str::to_owned));
            w.write_record(&h)?;
            header_written = true;
        }
        for rec in r.records() {
            let rec = rec?;
            let mut row = vec![order.as_str().to_string()];
            row.extend(rec.iter().map(str::to_owned));
            w.write_record(&row)?;
        }
    }
    w.into_inner().map_err(|e| csv::Error::from(e.into_error()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn orders_parse_in_the_order_given_and_refuse_unknown_or_repeated_names() {
        assert_eq!(
            parse_orders("fcfs, shortest_first,priority").unwrap(),
            [Order::Fcfs, Order::ShortestFirst, Order::Priority]
        );
        let e = parse_orders("fcfs,sjf").unwrap_err().to_string();
        assert!(e.starts_with("`--orders` unknown order \"sjf\""), "{e}");
        let e = parse_orders("fcfs,fcfs").unwrap_err().to_string();
        assert_eq!(e, "`--orders` names fcfs twice");
        assert!(parse_orders("fcfs,").is_err());
        assert!(parse_orders("").is_err());
    }

    #[test]
    fn an_order_overrides_the_configs_for_every_node() {
        let mut s = Settings::default();
        s.chunking.order = OrderSetting::PerNode([("llm".to_string(), Order::Priority)].into());
        let (out, label) = with_order(&s, Order::ShortestFirst);
        assert_eq!(out.chunking.order, OrderSetting::All(Order::ShortestFirst));
        assert_eq!(label, "shortest_first (--orders)");
        assert_eq!(dir_name(Order::LongestPrefix), "order-longest_prefix");
    }
}
