//! The `[replay]` section of the serving config: what the simulation runs (`docs/config-replay.md`).
//! It joins the component's sections through [`ExtraSections`], decoded as strictly as they
//! are; [`crate::replay::settings`] checks every value.

use serde::de::{self, Deserializer};
use serde::Deserialize;

use mstar_chunking::config::ExtraSections;

/// The sections the simulator adds to the serving config: `[replay]`.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SimSections {
    /// `[replay]`: the simulation `replay` runs.
    pub replay: ReplaySection,
}

impl ExtraSections for SimSections {
    const NAMES: &'static [&'static str] = &["replay"];
    const NODE_KEY: Option<&'static str> = Some("replay.node");

    fn learns_cost(&self) -> bool {
        self.replay.cost.learn
    }
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
    /// The simulated KV-cache memory (`docs/kv-memory.md`); unset: unlimited.
    pub kv: KvSection,
    /// The workers replayed behind a router (`docs/fleet.md`); default: one worker.
    pub fleet: FleetSection,
}

/// A step's simulated duration (`docs/cost-model.md`): `base_ms + per_token_ms·T +
/// per_kv_token_ms·K + per_attention_pair_ms·A + per_row_ms·R`, from the coefficients or a preset, times a
/// noise factor. Written as a table, or as a preset's name (`cost = "llama2-7b-a100"`).
/// Unset coefficients are the built-in ones (8 ms + 0.02 ms a token, no KV or attention term);
/// [`crate::replay::settings`] checks every value.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct CostSection {
    /// A latency model preset (`docs/presets.md`); then no coefficient is set.
    pub preset: Option<String>,
    /// Milliseconds every step costs.
    pub base_ms: Option<f64>,
    /// Milliseconds each token of a step adds.
    pub per_token_ms: Option<f64>,
    /// Milliseconds each context token a continuing row reads adds.
    pub per_kv_token_ms: Option<f64>,
    /// Milliseconds each causal attention pair of a chunk adds.
    pub per_attention_pair_ms: Option<f64>,
    /// Milliseconds each row of a step (a continuing row or a chunk) adds.
    pub per_row_ms: Option<f64>,
    /// Each simulated step time is multiplied by a factor drawn from `[1 - noise, 1 + noise]`.
    pub noise: f64,
    /// Each simulated step time is multiplied by a factor drawn from the measured ÷ predicted
    /// ratios of the band its price falls in (`fit --for replay` writes them from an engine's
    /// step log); unset: no such factor.
    pub noise_bands: Option<Vec<NoiseBand>>,
    /// The component learns the coefficients online from the simulated times instead of being
    /// given them.
    pub learn: bool,
}

/// One band of `replay.cost.noise_bands`: the measured ÷ predicted ratios of an engine's steps
/// priced below `up_to_ms` (and at or above the band before it), as evenly spaced quantiles from
/// the least to the largest. The last band names no `up_to_ms` and holds the rest.
#[derive(Debug, Clone, PartialEq, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct NoiseBand {
    /// The band's steps are priced below this many milliseconds; `None` for the last band.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub up_to_ms: Option<f64>,
    /// Measured ÷ predicted ratios, quantiles from the least to the largest.
    pub ratios: Vec<f64>,
}

/// The table form of `[replay] cost`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CostTable {
    preset: Option<String>,
    base_ms: Option<f64>,
    per_token_ms: Option<f64>,
    per_kv_token_ms: Option<f64>,
    per_attention_pair_ms: Option<f64>,
    per_row_ms: Option<f64>,
    #[serde(default)]
    noise: f64,
    noise_bands: Option<Vec<NoiseBand>>,
    #[serde(default)]
    learn: bool,
}

impl<'de> Deserialize<'de> for CostSection {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> de::Visitor<'de> for V {
            type Value = CostSection;

            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a table of cost coefficients, or a latency model preset's name")
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(CostSection {
                    preset: Some(v.to_owned()),
                    ..CostSection::default()
                })
            }

            fn visit_map<A: de::MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
                let t = CostTable::deserialize(de::value::MapAccessDeserializer::new(map))?;
                Ok(CostSection {
                    preset: t.preset,
                    base_ms: t.base_ms,
                    per_token_ms: t.per_token_ms,
                    per_kv_token_ms: t.per_kv_token_ms,
                    per_attention_pair_ms: t.per_attention_pair_ms,
                    per_row_ms: t.per_row_ms,
                    noise: t.noise,
                    noise_bands: t.noise_bands,
                    learn: t.learn,
                })
            }
        }
        d.deserialize_any(V)
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

/// `[replay.fleet]`: how many instances of the component the replay runs side by side, and the
/// router that sends each request to one of them (`docs/fleet.md`). Checked by
/// [`crate::replay::settings`].
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FleetSection {
    /// Workers, each a component instance with its own queues, KV memory and prefix cache.
    pub workers: u32,
    /// How a request is sent to a worker: `round_robin`, `least_outstanding`, `least_kv` or
    /// `prefix_affinity`.
    pub router: String,
    /// `prefix_affinity` follows a prefix only to a worker with at most this many outstanding
    /// requests more than the least loaded one.
    pub affinity_slack: u32,
    /// Workers that only prefill (`docs/disaggregated.md`); set with
    /// `decode_workers`, instead of `workers`. Unset: every worker prefills and decodes.
    pub prefill_workers: Option<u32>,
    /// Workers that only decode, each request's KV moved to one of them once its prompt is done.
    pub decode_workers: Option<u32>,
    /// The bandwidth a prefill worker sends KV at, Gbit/s.
    pub kv_link_gbps: f64,
    /// The fixed latency of a KV transfer, ms.
    pub kv_link_latency_ms: f64,
}

/// `replay.fleet.kv_link_gbps` unset: one 200 Gbit/s InfiniBand link per GPU.
pub const DEFAULT_KV_LINK_GBPS: f64 = 200.0;
/// `replay.fleet.kv_link_latency_ms` unset.
pub const DEFAULT_KV_LINK_LATENCY_MS: f64 = 1.0;

impl Default for FleetSection {
    fn default() -> Self {
        Self {
            workers: 1,
            router: "round_robin".into(),
            affinity_slack: 8,
            prefill_workers: None,
            decode_workers: None,
            kv_link_gbps: DEFAULT_KV_LINK_GBPS,
            kv_link_latency_ms: DEFAULT_KV_LINK_LATENCY_MS,
        }
    }
}

/// `[replay.kv]`: the KV-cache memory the replay simulates (`docs/kv-memory.md`). No limit
/// (`blocks`, `preset` or a memory budget) means unlimited memory. Checked by
/// [`crate::replay::settings`].
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KvSection {
    /// Tokens per KV block; unset: 16.
    pub block_tokens: Option<u32>,
    /// The pool's size in blocks; excludes `preset` and the memory keys.
    pub blocks: Option<u64>,
    /// A model/GPU pair whose memory budget gives the blocks (`llama2-7b-a100`, `llama2-7b-h100`).
    pub preset: Option<String>,
    /// GPU memory, GiB.
    pub gpu_memory_gb: Option<f64>,
    /// The fraction of GPU memory the engine may use; unset: 0.9.
    pub memory_utilization: Option<f64>,
    /// Memory the model's weights take, GiB.
    pub weights_gb: Option<f64>,
    /// Bytes of KV cache one token holds.
    pub kv_bytes_per_token: Option<f64>,
    /// The fraction of the blocks admission keeps free for running requests to grow into;
    /// unset: 0.01.
    pub watermark: Option<f64>,
}
