//! The serving config (SPEC §7): typed sections, deserialized from the layered config files.
//!
//! Every key is optional; defaults match `config/default.toml`. Unknown keys are refused.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;

use serde::de::{self, Deserializer, Visitor};
use serde::Deserialize;

use crate::budget::{BudgetValue, DEFAULT_MIN_CHUNK_TOKENS};

/// The whole serving config.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Settings {
    pub chunking: ChunkingSection,
    pub metrics: MetricsSection,
    pub log: LogSection,
    pub replay: ReplaySection,
}

/// `[chunking]`: the deployment's budgets.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ChunkingSection {
    pub min_chunk_tokens: u32,
    /// Nodes this worker never chunks.
    pub no_chunking: Vec<String>,
    pub max_row_tokens: Option<u32>,
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

/// A node's budget setting: one budget for every walk the model budgets there, or per walk.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum NodeBudgetSetting {
    All(BudgetSetting),
    PerWalk(BTreeMap<String, BudgetSetting>),
}

/// One budget as written: a positive integer (or numeric string, as environment variables
/// arrive), or `"off"` / null for chunking off. `false`, `"none"`, fractions and other strings
/// are refused; 0 and negatives are refused by budget validation, which names the node and walk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BudgetSetting(pub BudgetValue);

impl<'de> Deserialize<'de> for BudgetSetting {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = BudgetSetting;

            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a positive whole number of tokens or \"off\"")
            }

            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
                Ok(BudgetSetting(BudgetValue::Tokens(v)))
            }

            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
                Ok(BudgetSetting(BudgetValue::Tokens(
                    i64::try_from(v).unwrap_or(i64::MAX),
                )))
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                let t = v.trim();
                if t.eq_ignore_ascii_case("off") {
                    return Ok(BudgetSetting(BudgetValue::Off));
                }
                t.parse::<i64>()
                    .map(|n| BudgetSetting(BudgetValue::Tokens(n)))
                    .map_err(|_| E::invalid_value(de::Unexpected::Str(v), &self))
            }

            fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(BudgetSetting(BudgetValue::Off))
            }

            fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(BudgetSetting(BudgetValue::Off))
            }
        }
        d.deserialize_any(V)
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
    Off,
    Addr(SocketAddr),
}

impl std::str::FromStr for Listen {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        if s.trim().eq_ignore_ascii_case("off") {
            return Ok(Listen::Off);
        }
        s.trim().parse().map(Listen::Addr).map_err(|_| {
            format!("expected an address such as 127.0.0.1:9464 or \"off\", got {s:?}")
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
    #[default]
    Text,
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
    pub cost: CostSection,
    pub speculation: SpeculationSection,
    pub prefix_cache: PrefixCacheSection,
}

/// A step's simulated duration: `base_ms + per_token_ms * tokens`.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CostSection {
    pub base_ms: f64,
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
    pub tokens: u32,
    pub overshoot_rate: f64,
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
    pub blocks: u32,
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
