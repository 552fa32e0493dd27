//! `set_budgets`' arguments as the crate's `BudgetSettings` (token and time budgets, latency
//! models, the margin), and latency models to and from Python.

use std::collections::BTreeMap;
use std::num::NonZeroU32;

use mstar_chunking::budget::{BudgetValue, NodeBudget, NodeTimeBudget, TimeBudget};
use mstar_chunking::latency::presets::preset_names;
use mstar_chunking::order::WaitBound;
use mstar_chunking::{preset_model, BudgetSettings, LatencyModel, Order};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::boundary::error;

/// Per node, `walk -> value` (`None`: off), as the package passes per-walk settings.
pub(crate) type PerWalk<V> = Vec<(String, Vec<(String, Option<V>)>)>;

/// A latency model as `set_budgets` takes it: a preset's name, the four coefficients
/// `(base_ms, per_token_ms, per_kv_token_ms, per_attention_pair_ms)` or those and
/// `per_row_ms`.
#[derive(FromPyObject)]
pub(crate) enum CostArg {
    Preset(String),
    Coefficients(f64, f64, f64, f64),
    Terms(f64, f64, f64, f64, f64),
}

/// A `TimeSettingsError` (a refused time budget, latency model or margin) naming `argument`
/// and `node`.
fn time_error(
    py: Python<'_>,
    argument: &'static str,
    node: Option<&str>,
    message: String,
) -> PyErr {
    settings_error(py, "TimeSettingsError", argument, node, message)
}

/// A refused setting of class `class` (a `RefusedSettingsError`) naming `argument` and `node`.
fn settings_error(
    py: Python<'_>,
    class: &str,
    argument: &'static str,
    node: Option<&str>,
    message: String,
) -> PyErr {
    let e = error(py, class, &format!("refused budgets: {message}"));
    let v = e.value(py);
    // Attributes of a fresh exception: setting them cannot fail but for memory.
    let _ = v.setattr("kind", "refused_settings");
    let _ = v.setattr("problems", vec![message]);
    let _ = v.setattr("argument", argument);
    let _ = v.setattr("node", node);
    let _ = v.setattr("walk", None::<&str>);
    let _ = v.setattr("refusals", vec![(argument, node, None::<&str>)]);
    e
}

impl CostArg {
    /// The model, or a `TimeSettingsError` naming `cost[node]` and what is accepted.
    pub(crate) fn model(&self, py: Python<'_>, node: &str) -> PyResult<LatencyModel> {
        match self {
            CostArg::Preset(name) => preset_model(name).ok_or_else(|| {
                time_error(
                    py,
                    "cost",
                    Some(node),
                    format!(
                        "cost[{node:?}]: unknown latency model preset {name:?}; known: {}",
                        preset_names().collect::<Vec<_>>().join(", ")
                    ),
                )
            }),
            CostArg::Coefficients(a, b, c, d) => LatencyModel::try_new(*a, *b, *c, *d)
                .map_err(|e| time_error(py, "cost", Some(node), format!("cost[{node:?}]: {e}"))),
            CostArg::Terms(a, b, c, d, r) => LatencyModel::from_terms([*a, *b, *c, *d, *r])
                .map_err(|e| time_error(py, "cost", Some(node), format!("cost[{node:?}]: {e}"))),
        }
    }
}

/// The package's normalised `set_budgets` arguments.
pub(crate) struct BudgetArgs {
    pub(crate) node_wide: Vec<(String, Option<u32>)>,
    pub(crate) per_walk: PerWalk<u32>,
    pub(crate) walks: Vec<String>,
    pub(crate) combined_walk_of: Vec<(String, String)>,
    pub(crate) override_mixed: Vec<String>,
    pub(crate) no_chunking: Vec<String>,
    pub(crate) min_chunk_tokens: u32,
    pub(crate) max_row_tokens: Option<u32>,
    pub(crate) max_partial_prefills: Option<u32>,
    pub(crate) slots_per_row: u32,
    pub(crate) time_node_wide: Vec<(String, Option<f64>)>,
    pub(crate) time_per_walk: PerWalk<f64>,
    pub(crate) cost: Vec<(String, CostArg)>,
    pub(crate) learn_cost: bool,
    pub(crate) time_margin: Option<f64>,
    /// `time_floor=`: `"yield"` (the default) or `"run"`.
    pub(crate) time_floor: Option<String>,
    /// `order=` for every node, or `None` for `fcfs`.
    pub(crate) order: Option<String>,
    /// `order=` per node.
    pub(crate) order_per_node: Vec<(String, String)>,
    pub(crate) max_wait_ms: Option<f64>,
    pub(crate) max_wait_steps: Option<u64>,
}

/// An order's name as the crate's `Order`, or a `RefusedSettingsError` naming `key` (`order`
/// or `order["llm"]`), `node` and the names accepted.
fn order_of(py: Python<'_>, key: &str, node: Option<&str>, name: &str) -> PyResult<Order> {
    name.parse::<Order>().map_err(|e| {
        settings_error(
            py,
            "RefusedSettingsError",
            "order",
            node,
            format!("{key}: {e}"),
        )
    })
}

fn tokens(py: Python<'_>, key: String, b: Option<u32>) -> PyResult<BudgetValue> {
    match b {
        None => Ok(BudgetValue::Off),
        Some(n) => NonZeroU32::new(n).map(BudgetValue::Tokens).ok_or_else(|| {
            error(
                py,
                "RefusedSettingsError",
                &format!("refused budgets: {key} must be at least 1, got 0"),
            )
        }),
    }
}

fn ms(b: Option<f64>) -> TimeBudget {
    b.map_or(TimeBudget::Off, TimeBudget::Ms)
}

impl BudgetArgs {
    /// The crate's settings; values the core checks (a time budget's range, a margin's) are
    /// passed on as given, so that its refusal names node and walk.
    pub(crate) fn settings(self, py: Python<'_>) -> PyResult<BudgetSettings> {
        let mut s = BudgetSettings::new(self.walks);
        for (node, b) in self.node_wide {
            let v = tokens(py, format!("overrides[{node:?}]"), b)?;
            s.overrides.insert(node.as_str().into(), NodeBudget::All(v));
        }
        for (node, per) in self.per_walk {
            let mut m = BTreeMap::new();
            for (walk, b) in per {
                let v = tokens(py, format!("overrides[{node:?}][{walk:?}]"), b)?;
                m.insert(walk.as_str().into(), v);
            }
            s.overrides
                .insert(node.as_str().into(), NodeBudget::PerWalk(m));
        }
        // Set as given (not with `combined`, which would also serve the walks): a combined walk
        // the deployment does not serve is refused, as the original's rule says.
        s.combined_walk_of = self
            .combined_walk_of
            .into_iter()
            .map(|(m, c)| (m.as_str().into(), c.as_str().into()))
            .collect();
        s.override_mixed = self
            .override_mixed
            .iter()
            .map(|n| n.as_str().into())
            .collect();
        s.no_chunking = self.no_chunking.iter().map(|n| n.as_str().into()).collect();
        s.min_chunk_tokens = self.min_chunk_tokens;
        s.max_row_tokens = self.max_row_tokens;
        s.max_partial_prefills = self.max_partial_prefills;
        s.slots_per_row = self.slots_per_row;
        for (node, b) in self.time_node_wide {
            s.time
                .max_step_ms
                .insert(node.as_str().into(), NodeTimeBudget::All(ms(b)));
        }
        for (node, per) in self.time_per_walk {
            let m = per
                .into_iter()
                .map(|(w, b)| (w.as_str().into(), ms(b)))
                .collect();
            s.time
                .max_step_ms
                .insert(node.as_str().into(), NodeTimeBudget::PerWalk(m));
        }
        for (node, c) in &self.cost {
            let model = c.model(py, node)?;
            s.time.cost.insert(node.as_str().into(), model);
        }
        s.time.learn = self.learn_cost;
        s.time.margin_quantile = self.time_margin;
        match self.time_floor.as_deref() {
            None | Some("yield") => s.time.floor = mstar_chunking::TimeFloor::Yield,
            Some("run") => s.time.floor = mstar_chunking::TimeFloor::Run,
            Some(other) => {
                return Err(time_error(
                    py,
                    "time_floor",
                    None,
                    format!("time_floor must be \"yield\" or \"run\", got {other:?}"),
                ))
            }
        }
        if let Some(name) = &self.order {
            s.order.all = order_of(py, "order", None, name)?;
        }
        for (node, name) in &self.order_per_node {
            let order = order_of(py, &format!("order[{node:?}]"), Some(node), name)?;
            s.order.per_node.insert(node.as_str().into(), order);
        }
        // Checked by the core (finite and above 0; at least 1), which names the setting.
        s.order.bound = WaitBound {
            max_wait_ms: self.max_wait_ms,
            max_wait_steps: self.max_wait_steps,
        };
        Ok(s)
    }
}

/// A latency model as the package's `LatencyModel` (a `NamedTuple` of the four coefficients).
pub(crate) fn model_to_py<'py>(py: Python<'py>, m: &LatencyModel) -> PyResult<Bound<'py, PyAny>> {
    crate::boundary::py_attr(py, "mstar_chunking._types", "LatencyModel")?.call1((
        m.base_ms(),
        m.per_token_ms(),
        m.per_kv_token_ms(),
        m.per_attention_pair_ms(),
        m.per_row_ms(),
    ))
}

/// `preset_cost(name)`: the coefficients of the latency model preset `name`, as
/// `set_budgets(cost=name)` and the replay's `replay.cost = name` use them.
#[pyfunction]
pub(crate) fn preset_cost<'py>(py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyAny>> {
    let m = CostArg::Preset(name.to_owned()).model(py, "*")?;
    model_to_py(py, &m)
}

/// `preset_names()`: the names `cost=` and `preset_cost` take.
#[pyfunction(name = "preset_names")]
pub(crate) fn preset_names_py() -> Vec<&'static str> {
    preset_names().collect()
}

/// A dict of what a drain dropped.
pub(crate) fn drain_to_py<'py>(
    py: Python<'py>,
    r: &mstar_chunking::DrainReport,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("steps_abandoned", r.steps_abandoned)?;
    d.set_item("requests", r.requests)?;
    d.set_item("rows", r.rows)?;
    d.set_item("prepared_inputs", r.prepared_inputs)?;
    d.set_item("prepared_tokens", r.prepared_tokens)?;
    Ok(d)
}
