//! The order axis of a sweep (`docs/sweep.md#orders`): `--orders` runs the whole grid once per
//! order of waiting prompts (`chunking.order` for every node), each into `OUT/order-<order>/`,
//! then writes `OUT/sweep.csv`, every run's cells with an `order` column first, and
//! `OUT/orders.csv`/`orders.json`, each budget's capacity and latency per order. A sweep
//! without `--orders` writes `sweep.csv` as before, without the column.

use serde::Serialize;

use super::axis::{
    budget_rows, budget_table, comparison, csv_table, parse_list, Align, Axis, AxisRun,
    BudgetCapacity, Comparison, Tail,
};
use super::grid::GridError;
use super::SweepError;
use crate::config::spelling::OrderSetting;
use crate::config::Settings;
use crate::text::round3;
use mstar_chunking::order::Order;

/// The stem of the comparison's files: `orders.csv`, `orders.json`.
pub const ORDERS: &str = "orders";

/// Parses `--orders`: order names, each at most once, in the order given.
///
/// # Errors
/// An empty entry, an unknown or repeated order.
pub fn parse_orders(list: &str) -> Result<Vec<Order>, GridError> {
    parse_list("--orders", list, |item| {
        item.parse::<Order>().map_err(|e| e.to_string())
    })
}

/// `settings` with `order` for every node (over any `chunking.order` of the config), and the
/// label the run's settings show.
pub fn with_order(settings: &Settings, order: Order) -> (Settings, String) {
    let mut out = settings.clone();
    out.chunking.order = OrderSetting::All(order);
    (out, format!("{order} (--orders)"))
}

/// `--orders`: the grid once per order, each into `OUT/order-<order>/`, then the cells together
/// (`OUT/sweep.csv`, with an `order` column) and their comparison (`OUT/orders.*`).
pub struct OrderAxis;

impl Axis for OrderAxis {
    type Value = Order;
    const SETTING: &'static str = "order";
    const DIR_PREFIX: &'static str = "order";
    const COLUMNS: Option<&'static [&'static str]> = Some(&["order"]);

    fn apply(settings: &Settings, order: Order) -> (Settings, String) {
        with_order(settings, order)
    }
    fn failure(order: Order) -> String {
        format!("under order {order}")
    }
    fn cells(order: Order) -> Vec<String> {
        vec![order.as_str().to_owned()]
    }
    fn compare(runs: &[AxisRun<Order>]) -> Result<Comparison, SweepError> {
        let cmp = OrderComparison::of(runs);
        comparison::<Self>(runs, ORDERS, cmp.table(), cmp.to_csv(), &cmp, None)
    }
}

/// One budget under one order.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OrderRow {
    /// The order.
    pub order: &'static str,
    /// The budget and its capacity.
    #[serde(flatten)]
    pub at: BudgetCapacity,
    /// TTFT p50, p90, p99 and TBT p99 at the comparison's rate scale, simulated ms.
    #[serde(serialize_with = "crate::text::ser_opt_round")]
    pub ttft_p50_ms: Option<f64>,
    /// Its cell's tail latencies at the comparison's rate scale.
    #[serde(flatten)]
    pub tail: Tail,
}

/// The comparison of the orders.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OrderComparison {
    /// The rate scale the latencies are taken at (the sweep's step-time rate).
    #[serde(serialize_with = "crate::text::ser_round")]
    pub rate_scale: f64,
    /// The orders, in the order given.
    pub orders: Vec<&'static str>,
    /// One row per order and budget.
    pub rows: Vec<OrderRow>,
}

impl OrderComparison {
    /// Compares the sweeps run under each order (same budgets and rates in each).
    pub fn of(runs: &[AxisRun<Order>]) -> Self {
        let (rate_scale, rows) = budget_rows(runs, |order, p| OrderRow {
            order: order.as_str(),
            at: p.at,
            ttft_p50_ms: p.cell.and_then(|s| s.ttft_p50_ms),
            tail: Tail::of(p.cell),
        });
        Self {
            rate_scale,
            orders: runs.iter().map(|r| r.value.as_str()).collect(),
            rows,
        }
    }

    /// The table on the terminal.
    pub fn table(&self) -> String {
        let rows = self.rows.iter();
        let rows = rows.map(|r| (r.order.to_owned(), &r.at, vec![r.ttft_p50_ms], &r.tail));
        let (value, p50) = (
            ("order", Align::Left, 16),
            ("TTFT p50 ms", Align::Right, 14),
        );
        budget_table("orders", self.rate_scale, value, &[p50], rows)
    }

    fn to_csv(&self) -> Result<Vec<u8>, csv::Error> {
        let mut header = vec![
            "order",
            "budget",
            "capacity",
            "capacity_rate",
            "ttft_p50_ms",
        ];
        header.extend(Tail::CSV_COLUMNS);
        let opt = |v: Option<f64>| v.map_or_else(String::new, |v| round3(v).to_string());
        let rows = self.rows.iter().map(|r| {
            let capacity = r.at.capacity.clone().unwrap_or_default();
            let mut row = vec![r.order.to_owned(), r.at.budget.to_string(), capacity];
            row.extend([r.at.capacity_rate, r.ttft_p50_ms].map(opt));
            row.extend(r.tail.cells(opt));
            row
        });
        csv_table(&header, rows)
    }
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
        assert_eq!(
            OrderAxis::dir_name(Order::LongestPrefix),
            "order-longest_prefix"
        );
    }
}
