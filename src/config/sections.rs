//! The typed sections of the serving config, as `config/default.toml` states them. Every key
//! is optional and defaults to the built-in value; unknown keys are refused. What a value means
//! and which values are refused is documented in `docs/config.md`. A program adds sections of
//! its own beside these through `ExtraSections` (in this module's parent).

use std::collections::BTreeMap;
use std::net::SocketAddr;

use serde::de::{self, Deserializer};
use serde::Deserialize;

use super::cost::CostSetting;
use super::spelling::{NodeBudgetSetting, NodeTimeSetting, OrderSetting};
use crate::budget::{TimeFloor, DEFAULT_MIN_CHUNK_TOKENS};

/// The whole serving config.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Settings {
    /// `[chunking]`: budgets and row limits.
    pub chunking: ChunkingSection,
    /// `[metrics]`: the Prometheus endpoint.
    pub metrics: MetricsSection,
    /// `[log]`: filter and line format.
    pub log: LogSection,
}

/// `[chunking]`: the deployment's budgets.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ChunkingSection {
    /// The floor a row is cut to (capped by the budget).
    pub min_chunk_tokens: u32,
    /// Nodes this worker never chunks.
    pub no_chunking: Vec<String>,
    /// The most tokens one row may run in a step; unset: no cap.
    pub max_row_tokens: Option<u32>,
    /// The most partially prefilled rows at once; unset: no cap.
    pub max_partial_prefills: Option<u32>,
    /// Input slots the engine adds to every row it schedules (a speculative drafter's),
    /// charged to the token budget beside the row's tokens; 0 by default.
    pub slots_per_row: u32,
    /// Per node: one budget, or `walk -> budget`.
    pub max_batch_tokens: BTreeMap<String, NodeBudgetSetting>,
    /// Per node: one time budget in ms, or `walk -> ms` (`docs/cost-model.md#time-budgets`).
    pub max_step_ms: BTreeMap<String, NodeTimeSetting>,
    /// Per node: the latency model, as its coefficients or a preset's name.
    pub cost: BTreeMap<String, CostSetting>,
    /// Fit each node's latency model online from the step times the engine measures.
    pub learn_cost: bool,
    /// Plan timed steps with a margin at this quantile of the recent measured ÷ predicted
    /// step times (`docs/cost-model.md#the-time-margin`); unset: no margin.
    pub time_margin: Option<f64>,
    /// What the first prompt's floor chunk does when it does not fit in time beside the
    /// step's continuing rows: `"yield"` (wait, up to the starvation bound; the default) or
    /// `"run"` (`docs/cost-model.md#time-budgets`).
    pub time_floor: TimeFloor,
    /// The order of waiting prompts, for every node or per node
    /// (`docs/scheduling.md#the-order-of-waiting-prompts`); default `fcfs`.
    pub order: OrderSetting,
    /// The starvation bound in ms: a prompt that waited this long goes first; unset: none.
    pub max_wait_ms: Option<f64>,
    /// The starvation bound in planned steps of the prompt's node; unset: none.
    pub max_wait_steps: Option<u32>,
}

impl Default for ChunkingSection {
    fn default() -> Self {
        Self {
            min_chunk_tokens: DEFAULT_MIN_CHUNK_TOKENS,
            no_chunking: Vec::new(),
            max_row_tokens: None,
            max_partial_prefills: None,
            slots_per_row: 0,
            max_batch_tokens: BTreeMap::new(),
            max_step_ms: BTreeMap::new(),
            cost: BTreeMap::new(),
            learn_cost: false,
            time_margin: None,
            time_floor: TimeFloor::default(),
            order: OrderSetting::default(),
            max_wait_ms: None,
            max_wait_steps: None,
        }
    }
}

/// `[metrics]`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MetricsSection {
    /// The Prometheus endpoint, or off.
    pub listen: Listen,
}

impl Default for MetricsSection {
    fn default() -> Self {
        Self {
            listen: Listen::Addr(SocketAddr::from(([127, 0, 0, 1], 9464))),
        }
    }
}

/// A listen address, or `"off"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Listen {
    /// No endpoint.
    Off,
    /// Serve on this address.
    Addr(SocketAddr),
}

impl std::str::FromStr for Listen {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        if s.trim().eq_ignore_ascii_case("off") {
            return Ok(Listen::Off);
        }
        s.trim().parse().map(Listen::Addr).map_err(|_| {
            format!(
                "expected an address such as 127.0.0.1:9464 or \"off\", got {}",
                super::problem::quote(s)
            )
        })
    }
}

impl<'de> Deserialize<'de> for Listen {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(de::Error::custom)
    }
}

/// `[log]`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LogSection {
    /// A tracing filter (`info`, `mstar_chunking=debug`); `RUST_LOG` wins when set.
    pub level: String,
    /// Text or JSON lines.
    pub format: LogFormat,
}

impl Default for LogSection {
    fn default() -> Self {
        Self {
            level: "info".into(),
            format: LogFormat::Text,
        }
    }
}

/// Log line format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}
