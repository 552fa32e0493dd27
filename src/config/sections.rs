//! The typed sections of the serving config, as `config/default.toml` states them. Every key
//! is optional and defaults to the built-in value; unknown keys are refused. What a value means
//! and which values are refused is documented in `docs/config.md`; the `[replay]` section's
//! ranges are checked by the replay (`replay::settings`), the only module that uses them.

use std::collections::BTreeMap;
use std::net::SocketAddr;

use serde::de::{self, Deserializer};
use serde::Deserialize;

use super::budget_spelling::NodeBudgetSetting;
use crate::budget::DEFAULT_MIN_CHUNK_TOKENS;

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
    /// `[replay]`: the simulation `replay` runs.
    pub replay: ReplaySection,
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
    /// Per node: one budget, or `walk -> budget`.
    pub max_batch_tokens: BTreeMap<String, NodeBudgetSetting>,
}

impl Default for ChunkingSection {
    fn default() -> Self {
        Self {
            min_chunk_tokens: DEFAULT_MIN_CHUNK_TOKENS,
            no_chunking: Vec::new(),
            max_row_tokens: None,
            max_partial_prefills: None,
            max_batch_tokens: BTreeMap::new(),
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

/// `[replay]`: the simulation `mstar-chunking replay` runs.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ReplaySection {
    /// The node replay drives; unset: the manifest's first node.
    pub node: Option<String>,
    /// The step walk; unset: the manifest's combined walk (or prefill/decode alternately).
    pub walk: Option<String>,
    /// What a simulated step costs.
    pub cost: CostSection,
    /// Speculative decoding.
    pub speculation: SpeculationSection,
    /// The simulated prefix cache.
    pub prefix_cache: PrefixCacheSection,
}

/// A step's simulated duration: `base_ms + per_token_ms * tokens`.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CostSection {
    /// Milliseconds every step costs.
    pub base_ms: f64,
    /// Milliseconds each token of a step adds.
    pub per_token_ms: f64,
}

impl Default for CostSection {
    fn default() -> Self {
        Self {
            base_ms: 8.0,
            per_token_ms: 0.02,
        }
    }
}

/// Speculative decoding: `tokens` speculative tokens per continuing row (0 = off); a row runs
/// more than its `tokens + 1` estimate with probability `overshoot_rate`.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SpeculationSection {
    /// Speculative tokens per continuing row (0: off).
    pub tokens: u32,
    /// The probability a row runs more than its estimate.
    pub overshoot_rate: f64,
    /// The seed of the overshoot draws.
    pub seed: u64,
}

impl Default for SpeculationSection {
    fn default() -> Self {
        Self {
            tokens: 0,
            overshoot_rate: 0.0,
            seed: 42,
        }
    }
}

/// An LRU prefix cache of `blocks` blocks of `block_tokens` tokens (0 blocks = off).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PrefixCacheSection {
    /// Blocks the cache holds (0: off).
    pub blocks: u32,
    /// Tokens one block covers.
    pub block_tokens: u32,
}

impl Default for PrefixCacheSection {
    fn default() -> Self {
        Self {
            blocks: 0,
            block_tokens: 512,
        }
    }
}
