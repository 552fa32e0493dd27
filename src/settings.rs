//! The serving config (SPEC §7): typed sections, deserialized from the layered config files.
//!
//! Every key is optional; defaults match `config/default.toml`. Unknown keys are refused.
//!
//! [`load`] layers the config files and environment variables of SPEC §7 with the `config`
//! crate, deserializes them strictly and validates them against the model manifest, reporting
//! every problem at once, each with its key, the layer that set it and its value.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use config::{Config, Environment, File, FileFormat, Source, ValueKind};
use serde::de::{self, Deserializer, Visitor};
use serde::Deserialize;

use crate::budget::{BudgetError, BudgetTable, BudgetValue, DEFAULT_MIN_CHUNK_TOKENS};
use crate::manifest::{Manifest, ManifestErrors};
use crate::policy::ModelPolicies;

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
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeBudgetSetting {
    All(BudgetSetting),
    PerWalk(BTreeMap<String, BudgetSetting>),
}

/// One budget as written: a positive integer (or numeric string, as environment variables
/// arrive), or `"off"` / null for chunking off. `false`, `"none"`, fractions and other strings
/// are refused; 0 and negatives are refused by budget validation, which names the node and walk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BudgetSetting(pub BudgetValue);

/// Accepts exactly the spellings of a budget. Deliberately not serde's integer path: config
/// layers coerce `false`, `"off"` and `"no"` into 0 for integer targets, which would turn a
/// typo into a refused-as-zero budget or worse, a silently different one.
struct BudgetVisitor;

impl<'de> Visitor<'de> for BudgetVisitor {
    type Value = BudgetSetting;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a positive whole number of tokens or \"off\"")
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
        Ok(BudgetSetting(BudgetValue::Tokens(v)))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
        // Beyond i64 is beyond u32 too: budget validation refuses it by value.
        Ok(BudgetSetting(BudgetValue::Tokens(
            i64::try_from(v).unwrap_or(i64::MAX),
        )))
    }

    fn visit_i128<E: de::Error>(self, v: i128) -> Result<Self::Value, E> {
        let clamped = i64::try_from(v).unwrap_or(if v < 0 { i64::MIN } else { i64::MAX });
        Ok(BudgetSetting(BudgetValue::Tokens(clamped)))
    }

    fn visit_u128<E: de::Error>(self, v: u128) -> Result<Self::Value, E> {
        Ok(BudgetSetting(BudgetValue::Tokens(
            i64::try_from(v).unwrap_or(i64::MAX),
        )))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Self::Value, E> {
        // 2048.0 is refused as well: a budget is written as a whole number.
        Err(E::invalid_type(de::Unexpected::Float(v), &self))
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Self::Value, E> {
        Err(E::invalid_type(de::Unexpected::Bool(v), &self))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        let t = v.trim();
        if t.eq_ignore_ascii_case("off") {
            return Ok(BudgetSetting(BudgetValue::Off));
        }
        // Only plain decimal digits with an optional sign: "1.5", "1e3", "0x10", "none" and
        // "false" are refused here rather than guessed at.
        let digits = t.strip_prefix(['-', '+']).unwrap_or(t);
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return Err(E::invalid_value(de::Unexpected::Str(v), &self));
        }
        let n = t.parse::<i64>().unwrap_or(if t.starts_with('-') {
            i64::MIN
        } else {
            i64::MAX
        });
        Ok(BudgetSetting(BudgetValue::Tokens(n)))
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(BudgetSetting(BudgetValue::Off))
    }

    fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(BudgetSetting(BudgetValue::Off))
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Deserialize<'de> for BudgetSetting {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(BudgetVisitor)
    }
}

/// A scalar is one budget for the node, a table is per walk. Hand-written rather than
/// `#[serde(untagged)]`, whose "did not match any variant" would hide what was wrong.
impl<'de> Deserialize<'de> for NodeBudgetSetting {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = NodeBudgetSetting;

            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a positive whole number of tokens, \"off\", or a table walk -> budget")
            }

            fn visit_map<A: de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut walks = BTreeMap::new();
                while let Some((walk, budget)) = map.next_entry::<String, BudgetSetting>()? {
                    walks.insert(walk, budget);
                }
                Ok(NodeBudgetSetting::PerWalk(walks))
            }

            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
                BudgetVisitor.visit_i64(v).map(NodeBudgetSetting::All)
            }

            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
                BudgetVisitor.visit_u64(v).map(NodeBudgetSetting::All)
            }

            fn visit_i128<E: de::Error>(self, v: i128) -> Result<Self::Value, E> {
                BudgetVisitor.visit_i128(v).map(NodeBudgetSetting::All)
            }

            fn visit_u128<E: de::Error>(self, v: u128) -> Result<Self::Value, E> {
                BudgetVisitor.visit_u128(v).map(NodeBudgetSetting::All)
            }

            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Self::Value, E> {
                Err(E::invalid_type(de::Unexpected::Float(v), &self))
            }

            fn visit_bool<E: de::Error>(self, v: bool) -> Result<Self::Value, E> {
                Err(E::invalid_type(de::Unexpected::Bool(v), &self))
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                BudgetVisitor
                    .visit_str::<E>(v)
                    .map(NodeBudgetSetting::All)
                    .map_err(|_| E::invalid_value(de::Unexpected::Str(v), &self))
            }

            fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(NodeBudgetSetting::All(BudgetSetting(BudgetValue::Off)))
            }

            fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
                self.visit_unit()
            }

            fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
                d.deserialize_any(self)
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

// === Loading: layers, provenance, validation ===

/// `config/default.toml`, built in so the binary works from any directory.
pub const DEFAULT_CONFIG_TOML: &str = include_str!("../config/default.toml");
/// `config/models/demo.toml`, built in as the default model manifest.
pub const DEMO_MANIFEST_TOML: &str = include_str!("../config/models/demo.toml");
/// Environment variables `MSTAR__SECTION__KEY` override the config files.
pub const ENV_PREFIX: &str = "MSTAR__";
/// More problems than this in one load are not worth listing one by one.
const MAX_PROBLEMS: usize = 64;

/// Where the layers of the serving config and the model manifest come from (SPEC §7).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadOptions {
    /// The model manifest; `None`: `config_dir/models/demo.toml`, else the built-in demo.
    pub model: Option<PathBuf>,
    /// `--config FILE` layers, applied in order after the `$MSTAR_ENV` layer.
    pub configs: Vec<PathBuf>,
    /// Where `default.toml` and `$MSTAR_ENV.toml` are looked up. Default `config`.
    pub config_dir: PathBuf,
    /// `$MSTAR_ENV`: adds the layer `config_dir/$MSTAR_ENV.toml`, which must exist.
    pub mstar_env: Option<String>,
    /// The environment `MSTAR__…` overrides are read from; `None`: the process environment.
    pub env: Option<HashMap<String, String>>,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            model: None,
            configs: Vec::new(),
            config_dir: PathBuf::from("config"),
            mstar_env: None,
            env: None,
        }
    }
}

impl LoadOptions {
    /// Options for the binary: `./config`, `$MSTAR_ENV` and the process environment.
    pub fn from_process(model: Option<PathBuf>, configs: Vec<PathBuf>) -> Self {
        Self {
            model,
            configs,
            mstar_env: std::env::var("MSTAR_ENV").ok().filter(|v| !v.is_empty()),
            ..Self::default()
        }
    }

    /// The config files the layers read, in layer order (what a config watcher watches). The
    /// built-in default and the environment are not files and are not listed.
    pub fn config_files(&self) -> Vec<PathBuf> {
        let default = self.config_dir.join("default.toml");
        let mut files: Vec<PathBuf> = Vec::new();
        if default.is_file() {
            files.push(default);
        }
        files.extend(self.env_layer_path());
        files.extend(self.configs.iter().cloned());
        files
    }

    fn env_layer_path(&self) -> Option<PathBuf> {
        self.mstar_env
            .as_ref()
            .map(|env| self.config_dir.join(format!("{env}.toml")))
    }

    /// The manifest file to read, or `None` for the built-in demo.
    pub fn model_path(&self) -> Option<PathBuf> {
        if let Some(model) = &self.model {
            return Some(model.clone());
        }
        let demo = self.config_dir.join("models").join("demo.toml");
        demo.is_file().then_some(demo)
    }
}

/// A loaded, validated configuration: the model, the layered settings and the budget table
/// they give. Every refusal of SPEC §4 has been reported by the time one exists.
#[derive(Debug, Clone)]
pub struct Loaded {
    pub manifest: Manifest,
    pub settings: Settings,
    pub table: BudgetTable,
    /// Where the manifest came from (a path, or the built-in demo).
    pub model_origin: String,
    /// The config layers applied, in order.
    pub layers: Vec<String>,
}

/// One `(node, walk)` of the effective budget table, as `check` prints it and `budgets --json`
/// emits it (SPEC §7).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct BudgetRow {
    pub node: String,
    pub walk: String,
    /// The model's declared budget.
    pub policy_budget: Option<u32>,
    /// The effective budget after the serving config.
    pub max_batch_tokens: Option<u32>,
    pub chunkable: bool,
    /// The floor under the effective budget; `None` where there is no budget.
    pub min_chunk_tokens: Option<u32>,
    pub walk_caps: Option<BTreeMap<String, u32>>,
}

impl Loaded {
    /// Every node × every walk of the manifest, nodes in file order, walks in `walks` order.
    pub fn rows(&self) -> Vec<BudgetRow> {
        budget_rows(&self.manifest, &self.table)
    }
}

/// The effective table of `table` over every node × walk of `manifest`.
pub fn budget_rows(manifest: &Manifest, table: &BudgetTable) -> Vec<BudgetRow> {
    let mut rows = Vec::new();
    for node in manifest.nodes.keys() {
        for walk in &manifest.walks {
            let budget = table.max_batch_tokens(node, walk);
            rows.push(BudgetRow {
                node: node.clone(),
                walk: walk.clone(),
                policy_budget: table.policy(node, walk).max_batch_tokens,
                max_batch_tokens: budget,
                chunkable: table.chunkable(node, walk),
                min_chunk_tokens: budget.map(|b| table.min_chunk_tokens(b)),
                walk_caps: table
                    .walk_caps(node, walk)
                    .map(|caps| caps.into_iter().map(|(w, c)| (w.to_string(), c)).collect()),
            });
        }
    }
    rows
}

/// One problem with the configuration, naming where it is and what was wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigProblem {
    /// A config file that cannot be read or parsed.
    #[error("{path}: {reason}")]
    File { path: String, reason: String },
    /// A setting refused: its key, the layer that set it, its value and why.
    #[error("{layer}: `{key}`{}: {reason}", value.as_ref().map(|v| format!(" = {v}")).unwrap_or_default())]
    Setting {
        key: String,
        layer: String,
        value: Option<String>,
        reason: String,
    },
    /// A problem with the model manifest.
    #[error("model manifest {path}: {reason}")]
    Manifest { path: String, reason: String },
}

/// Every problem found in one load, in the order found. Displays one per line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigErrors(pub Vec<ConfigProblem>);

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, p) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("\n")?;
            }
            write!(f, "{p}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigErrors {}

/// Loads the model manifest and the layered serving config, and validates them together.
///
/// # Errors
/// Every problem found: unreadable or malformed files, unknown keys, values of the wrong type,
/// manifest problems, and every refusal of SPEC §4, each naming its key and layer.
pub fn load(opts: &LoadOptions) -> Result<Loaded, ConfigErrors> {
    let mut problems = Vec::new();
    let (manifest, model_origin) = match read_manifest(opts) {
        Ok(m) => (Some(m.0), m.1),
        Err(e) => {
            let origin = e.origin.clone();
            problems.extend(e.errors.iter().map(|err| ConfigProblem::Manifest {
                path: e.origin.clone(),
                reason: err.to_string(),
            }));
            (None, origin)
        }
    };
    let layers = Layers::read(opts, &mut problems);
    let settings = layers.settings(&mut problems);
    let table = manifest
        .as_ref()
        .and_then(|m| check_against(m, &model_origin, &settings, &layers, &mut problems));
    match (manifest, table) {
        (Some(manifest), Some(table)) if problems.is_empty() => Ok(Loaded {
            manifest,
            settings,
            table,
            model_origin,
            layers: layers.labels(),
        }),
        _ => Err(ConfigErrors(problems)),
    }
}

/// Loads the layered serving config again against an already-loaded manifest, as a config
/// reload does: the model's policies are fixed at load, only the deployment's say changes.
///
/// # Errors
/// As [`load`], without the manifest's own problems.
pub fn load_settings(
    opts: &LoadOptions,
    manifest: &Manifest,
) -> Result<(Settings, BudgetTable), ConfigErrors> {
    let mut problems = Vec::new();
    let layers = Layers::read(opts, &mut problems);
    let settings = layers.settings(&mut problems);
    let origin = opts
        .model_path()
        .map_or_else(builtin_demo_label, |p| p.display().to_string());
    let table = check_against(manifest, &origin, &settings, &layers, &mut problems);
    match table {
        Some(table) if problems.is_empty() => Ok((settings, table)),
        _ => Err(ConfigErrors(problems)),
    }
}

fn builtin_demo_label() -> String {
    "built-in config/models/demo.toml".to_string()
}

fn read_manifest(opts: &LoadOptions) -> Result<(Manifest, String), ManifestErrors> {
    match opts.model_path() {
        Some(path) => Manifest::load(&path).map(|m| (m, path.display().to_string())),
        None => {
            let origin = builtin_demo_label();
            Manifest::from_toml(DEMO_MANIFEST_TOML, &origin).map(|m| (m, origin))
        }
    }
}

/// One layer of the serving config and, for each key it sets, who set it.
struct Layer {
    label: String,
    config: Config,
    /// `(dotted key, who set it)` for every leaf the layer sets.
    keys: Vec<(String, String)>,
}

/// The layers in order, lowest first.
struct Layers(Vec<Layer>);

impl Layers {
    /// Reads every layer of SPEC §7; a layer that cannot be read is reported and skipped, so
    /// the problems of the others are reported in the same run.
    fn read(opts: &LoadOptions, problems: &mut Vec<ConfigProblem>) -> Self {
        let mut layers = Vec::new();
        let default = opts.config_dir.join("default.toml");
        if default.is_file() {
            layers.extend(file_layer(&default, problems));
        } else {
            let label = "built-in config/default.toml".to_string();
            layers.extend(text_layer(
                label,
                DEFAULT_CONFIG_TOML,
                FileFormat::Toml,
                problems,
            ));
        }
        if let Some(path) = opts.env_layer_path() {
            if path.is_file() {
                layers.extend(file_layer(&path, problems));
            } else {
                problems.push(ConfigProblem::File {
                    path: path.display().to_string(),
                    reason: format!(
                        "not found (MSTAR_ENV={:?} names this layer)",
                        opts.mstar_env.as_deref().unwrap_or_default()
                    ),
                });
            }
        }
        for path in &opts.configs {
            layers.extend(file_layer(path, problems));
        }
        layers.extend(env_layer(opts, problems));
        Self(layers)
    }

    fn labels(&self) -> Vec<String> {
        self.0.iter().map(|l| l.label.clone()).collect()
    }

    /// Who set `key` (or a key inside it, or the table holding it): the last layer that did.
    fn origin(&self, key: &str) -> String {
        let related = |k: &str| {
            k == key
                || k.strip_prefix(key).is_some_and(|r| r.starts_with('.'))
                || key.strip_prefix(k).is_some_and(|r| r.starts_with('.'))
        };
        self.0
            .iter()
            .rev()
            .find_map(|l| l.keys.iter().find(|(k, _)| related(k)))
            .map_or_else(|| "built-in default".to_string(), |(_, who)| who.clone())
    }

    /// Merges the layers and deserializes the result, collecting every problem: after each
    /// error the offending key is dropped and deserialization retried, so one run names them
    /// all. Values are deserialized strictly (see [`to_json`]).
    fn settings(&self, problems: &mut Vec<ConfigProblem>) -> Settings {
        let mut builder = Config::builder();
        for layer in &self.0 {
            builder = builder.add_source(layer.config.clone());
        }
        let merged = match builder.build().and_then(|c| c.collect()) {
            Ok(m) => m,
            Err(e) => {
                problems.push(ConfigProblem::File {
                    path: "merged config".into(),
                    reason: one_line(&e.to_string()),
                });
                return Settings::default();
            }
        };
        let mut tree =
            serde_json::Value::Object(merged.into_iter().map(|(k, v)| (k, to_json(v))).collect());
        for _ in 0..MAX_PROBLEMS {
            let err = match serde_path_to_error::deserialize::<_, Settings>(&tree) {
                Ok(settings) => return settings,
                Err(err) => err,
            };
            let path = segments(err.path());
            let key = path.join(".");
            problems.push(ConfigProblem::Setting {
                layer: self.origin(&key),
                value: lookup(&tree, &path).map(render),
                reason: err.inner().to_string(),
                key,
            });
            if !remove(&mut tree, &path) {
                break;
            }
        }
        Settings::default()
    }

    /// A problem with the setting at `key`: quotes its value from the layers and its layer.
    fn problem(&self, key: &str, value: Option<String>, reason: String) -> ConfigProblem {
        ConfigProblem::Setting {
            key: key.to_string(),
            layer: self.origin(key),
            value,
            reason,
        }
    }
}

fn file_layer(path: &Path, problems: &mut Vec<ConfigProblem>) -> Option<Layer> {
    let label = path.display().to_string();
    let format = match path.extension().and_then(|e| e.to_str()) {
        Some("toml") => FileFormat::Toml,
        Some("yaml" | "yml") => FileFormat::Yaml,
        Some("json") => FileFormat::Json,
        _ => {
            problems.push(ConfigProblem::File {
                path: label,
                reason: "unknown config format: name it .toml, .yaml or .json".into(),
            });
            return None;
        }
    };
    match std::fs::read_to_string(path) {
        Ok(text) => text_layer(label, &text, format, problems),
        Err(e) => {
            problems.push(ConfigProblem::File {
                path: label,
                reason: format!("cannot be read: {e}"),
            });
            None
        }
    }
}

fn text_layer(
    label: String,
    text: &str,
    format: FileFormat,
    problems: &mut Vec<ConfigProblem>,
) -> Option<Layer> {
    let built = Config::builder()
        .add_source(File::from_str(text, format))
        .build();
    let config = match built {
        Ok(c) => c,
        Err(e) => {
            // toml's own error names the line; the config crate's spans several lines.
            let reason = match (format, toml::from_str::<toml::Table>(text)) {
                (FileFormat::Toml, Err(te)) => format!(
                    "malformed TOML{}: {}",
                    te.span()
                        .map(|s| format!(" at line {}", line_of(text, s.start)))
                        .unwrap_or_default(),
                    one_line(te.message())
                ),
                _ => format!("malformed {format:?}: {}", one_line(&e.to_string())),
            };
            problems.push(ConfigProblem::File {
                path: label,
                reason,
            });
            return None;
        }
    };
    let mut keys = Vec::new();
    if let Ok(table) = config.collect() {
        for (k, v) in table {
            flatten(&k, &v, &mut |key| keys.push((key, label.clone())));
        }
    }
    Some(Layer {
        label,
        config,
        keys,
    })
}

/// `MSTAR__SECTION__KEY` variables: lowercased, `__` separates keys. Values that parse as
/// booleans or numbers are typed (the settings then refuse a number where a name belongs);
/// `chunking.no_chunking` is a comma-separated list.
fn env_layer(opts: &LoadOptions, problems: &mut Vec<ConfigProblem>) -> Option<Layer> {
    let vars: HashMap<String, String> = match &opts.env {
        Some(map) => map.clone(),
        None => std::env::vars().collect(),
    };
    let vars: HashMap<String, String> = vars
        .into_iter()
        .filter(|(k, _)| {
            k.get(..ENV_PREFIX.len())
                .is_some_and(|p| p.eq_ignore_ascii_case(ENV_PREFIX))
        })
        .collect();
    if vars.is_empty() {
        return None;
    }
    let keys: Vec<(String, String)> = vars
        .keys()
        .map(|k| {
            let key = k[ENV_PREFIX.len()..].to_lowercase().replace("__", ".");
            (key, format!("environment variable {k}"))
        })
        .collect();
    // `MSTAR__CHUNKING=3` next to `MSTAR__CHUNKING__MIN_CHUNK_TOKENS=32`: which one wins
    // would depend on the map's order, so neither is taken.
    let mut conflict = false;
    for (outer, who) in &keys {
        for (inner, inner_who) in &keys {
            if inner
                .strip_prefix(outer.as_str())
                .is_some_and(|r| r.starts_with('.'))
            {
                conflict = true;
                problems.push(ConfigProblem::Setting {
                    key: outer.clone(),
                    layer: who.clone(),
                    value: None,
                    reason: format!("sets a whole section while {inner_who} sets `{inner}` inside it; set single keys"),
                });
            }
        }
    }
    if conflict {
        return None;
    }
    let source = Environment::with_prefix(ENV_PREFIX.trim_end_matches('_'))
        .prefix_separator("__")
        .separator("__")
        .try_parsing(true)
        .list_separator(",")
        .with_list_parse_key("chunking.no_chunking")
        .source(Some(vars.into_iter().collect()));
    match Config::builder().add_source(source).build() {
        Ok(config) => Some(Layer {
            label: "environment variables MSTAR__*".into(),
            config,
            keys,
        }),
        Err(e) => {
            problems.push(ConfigProblem::File {
                path: "environment variables MSTAR__*".into(),
                reason: one_line(&e.to_string()),
            });
            None
        }
    }
}

/// Checks the settings against the model and builds the budget table, reporting every
/// refusal with the key and layer that caused it.
fn check_against(
    manifest: &Manifest,
    model_origin: &str,
    settings: &Settings,
    layers: &Layers,
    problems: &mut Vec<ConfigProblem>,
) -> Option<BudgetTable> {
    let quote = |s: &str| Some(format!("{s:?}"));
    if let Some(node) = &settings.replay.node {
        if !manifest.nodes.contains_key(node) {
            problems.push(layers.problem(
                "replay.node",
                quote(node),
                format!(
                    "node `{node}` is not a node of model `{}` ({model_origin})",
                    manifest.name
                ),
            ));
        }
    }
    if let Some(walk) = &settings.replay.walk {
        if !manifest.walks.contains(walk) {
            problems.push(layers.problem(
                "replay.walk",
                quote(walk),
                format!(
                    "walk `{walk}` is not in the walks of model `{}` ({model_origin})",
                    manifest.name
                ),
            ));
        }
    }
    check_ranges(settings, layers, problems);
    let model = match ModelPolicies::new(manifest.submodules(), manifest.policies()) {
        Ok(m) => m.shared(),
        Err(errors) => {
            problems.extend(errors.iter().map(|e| ConfigProblem::Manifest {
                path: model_origin.to_string(),
                reason: e.to_string(),
            }));
            return None;
        }
    };
    match BudgetTable::build(model, manifest.budget_settings(&settings.chunking)) {
        Ok(table) => Some(table),
        Err(errors) => {
            for e in &errors.0 {
                problems.push(budget_problem(e, settings, model_origin, layers));
            }
            None
        }
    }
}

/// Values whose type is right but whose range is not.
fn check_ranges(settings: &Settings, layers: &Layers, problems: &mut Vec<ConfigProblem>) {
    if let Err(e) = tracing_subscriber::EnvFilter::builder().parse(&settings.log.level) {
        problems.push(layers.problem(
            "log.level",
            Some(format!("{:?}", settings.log.level)),
            format!("not a tracing filter such as \"info\" or \"warn,mstar_chunking=debug\": {e}"),
        ));
    }
    let r = &settings.replay;
    for (key, v) in [
        ("replay.cost.base_ms", r.cost.base_ms),
        ("replay.cost.per_token_ms", r.cost.per_token_ms),
    ] {
        if !(v.is_finite() && v >= 0.0) {
            problems.push(layers.problem(
                key,
                Some(v.to_string()),
                "must be a finite number of milliseconds, at least 0".into(),
            ));
        }
    }
    let rate = r.speculation.overshoot_rate;
    if !(0.0..=1.0).contains(&rate) {
        problems.push(layers.problem(
            "replay.speculation.overshoot_rate",
            Some(rate.to_string()),
            "must be a probability from 0.0 to 1.0".into(),
        ));
    }
    let cache = r.prefix_cache;
    if cache.blocks > 0 && cache.block_tokens != crate::replay::trace::HASH_BLOCK_TOKENS {
        problems.push(layers.problem(
            "replay.prefix_cache.block_tokens",
            Some(cache.block_tokens.to_string()),
            format!(
                "must be {} (the tokens one trace block hash covers) while the cache is on; set `blocks = 0` to turn it off",
                crate::replay::trace::HASH_BLOCK_TOKENS
            ),
        ));
    }
}

/// Maps a refusal of SPEC §4 back to the key and layer that caused it.
fn budget_problem(
    e: &BudgetError,
    settings: &Settings,
    model_origin: &str,
    layers: &Layers,
) -> ConfigProblem {
    let budget_key = |node: &str, walk: Option<&str>| match walk {
        Some(w) => format!("chunking.max_batch_tokens.{node}.{w}"),
        None => format!("chunking.max_batch_tokens.{node}"),
    };
    let budget_value = |node: &str, walk: Option<&str>| {
        settings
            .chunking
            .max_batch_tokens
            .get(node)
            .and_then(|b| match (b, walk) {
                (NodeBudgetSetting::All(v), _) => Some(v.0.to_string()),
                (NodeBudgetSetting::PerWalk(m), Some(w)) => m.get(w).map(|v| v.0.to_string()),
                (NodeBudgetSetting::PerWalk(_), None) => None,
            })
    };
    let with_rule = |rule: u8| format!("{e} (SPEC §4 rule {rule})");
    let (key, value, rule) = match e {
        BudgetError::UnknownNode { setting, node } if *setting == "max_batch_tokens" => {
            (budget_key(node, None), budget_value(node, None), 1)
        }
        BudgetError::UnknownNode { setting, node } if *setting == "no_chunking" => (
            "chunking.no_chunking".to_string(),
            Some(format!("{:?}", &**node)),
            7,
        ),
        BudgetError::WalkNotServed { node, walk } => (
            budget_key(node, Some(walk)),
            budget_value(node, Some(walk)),
            2,
        ),
        BudgetError::WalkNotBudgeted { node, walk } => (
            budget_key(node, Some(walk)),
            budget_value(node, Some(walk)),
            3,
        ),
        BudgetError::NodeBudgetsNothing { node } => {
            (budget_key(node, None), budget_value(node, None), 4)
        }
        BudgetError::MemberWalk { node, walk, .. } => (
            budget_key(node, Some(walk)),
            budget_value(node, Some(walk)),
            5,
        ),
        BudgetError::BadBudget { node, walk, value } => (
            budget_key(node, walk.as_deref()),
            Some(value.to_string()),
            6,
        ),
        BudgetError::ZeroSetting { key } => {
            let rule = if *key == "min_chunk_tokens" {
                " (SPEC §4 rule 6)"
            } else {
                ""
            };
            return layers.problem(
                &format!("chunking.{key}"),
                Some("0".into()),
                format!("{e}{rule}"),
            );
        }
        // The rest are the model's problems, which manifest validation normally reports first.
        _ => {
            return ConfigProblem::Manifest {
                path: model_origin.to_string(),
                reason: e.to_string(),
            }
        }
    };
    layers.problem(&key, value, with_rule(rule))
}

/// Config values to JSON, so that settings are deserialized strictly: the config crate's own
/// deserializer coerces `false`, `"off"` and `1.5` into integers, which would let a typo through.
fn to_json(v: config::Value) -> serde_json::Value {
    use serde_json::Value as J;
    match v.kind {
        ValueKind::Nil => J::Null,
        ValueKind::Boolean(b) => J::Bool(b),
        ValueKind::I64(n) => J::from(n),
        ValueKind::U64(n) => J::from(n),
        ValueKind::I128(n) => i64::try_from(n).map_or_else(|_| J::String(n.to_string()), J::from),
        ValueKind::U128(n) => u64::try_from(n).map_or_else(|_| J::String(n.to_string()), J::from),
        ValueKind::Float(f) => {
            serde_json::Number::from_f64(f).map_or_else(|| J::String(f.to_string()), J::Number)
        }
        ValueKind::String(s) => J::String(s),
        ValueKind::Table(t) => J::Object(t.into_iter().map(|(k, v)| (k, to_json(v))).collect()),
        ValueKind::Array(a) => J::Array(a.into_iter().map(to_json).collect()),
    }
}

/// Calls `leaf` with the dotted key of every leaf under `key` (an empty table is a leaf).
fn flatten(key: &str, v: &config::Value, leaf: &mut impl FnMut(String)) {
    match &v.kind {
        ValueKind::Table(t) if !t.is_empty() => {
            for (k, child) in t {
                flatten(&format!("{key}.{k}"), child, leaf);
            }
        }
        _ => leaf(key.to_string()),
    }
}

/// A serde path as key segments; list indexes are their own segments.
fn segments(path: &serde_path_to_error::Path) -> Vec<String> {
    use serde_path_to_error::Segment;
    path.iter()
        .filter_map(|s| match s {
            Segment::Map { key } => Some(key.clone()),
            Segment::Seq { index } => Some(index.to_string()),
            Segment::Enum { variant } => Some(variant.clone()),
            Segment::Unknown => None,
        })
        .collect()
}

fn lookup<'a>(tree: &'a serde_json::Value, path: &[String]) -> Option<&'a serde_json::Value> {
    path.iter().try_fold(tree, |v, seg| match v {
        serde_json::Value::Object(m) => m.get(seg),
        serde_json::Value::Array(a) => a.get(seg.parse::<usize>().ok()?),
        _ => None,
    })
}

/// Removes the value at `path`; false when there is none (then retrying would loop).
fn remove(tree: &mut serde_json::Value, path: &[String]) -> bool {
    let Some((last, parent)) = path.split_last() else {
        return false;
    };
    let parent = parent.iter().try_fold(tree, |v, seg| match v {
        serde_json::Value::Object(m) => m.get_mut(seg),
        serde_json::Value::Array(a) => a.get_mut(seg.parse::<usize>().ok()?),
        _ => None,
    });
    match parent {
        Some(serde_json::Value::Object(m)) => m.remove(last).is_some(),
        Some(serde_json::Value::Array(a)) => match last.parse::<usize>() {
            Ok(i) if i < a.len() => {
                a.remove(i);
                true
            }
            _ => false,
        },
        _ => false,
    }
}

/// A value as the user would write it, shortened.
fn render(v: &serde_json::Value) -> String {
    let s = v.to_string();
    if s.chars().count() > 80 {
        format!("{}…", s.chars().take(80).collect::<String>())
    } else {
        s
    }
}

fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

fn line_of(text: &str, at: usize) -> usize {
    text.get(..at).map_or(0, |t| t.matches('\n').count()) + 1
}

#[cfg(test)]
mod tests {
    use super::*;

    fn repo_config() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("config")
    }

    fn opts(model: &str, env: &[(&str, &str)]) -> LoadOptions {
        LoadOptions {
            model: Some(repo_config().join("models").join(model)),
            config_dir: repo_config(),
            env: Some(
                env.iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            ),
            ..LoadOptions::default()
        }
    }

    fn problems(o: &LoadOptions) -> Vec<String> {
        load(o)
            .unwrap_err()
            .0
            .iter()
            .map(ToString::to_string)
            .collect()
    }

    #[test]
    fn default_toml_states_exactly_the_built_in_defaults() {
        let loaded = load(&opts("demo.toml", &[])).unwrap();
        assert_eq!(loaded.settings, Settings::default());
        let parsed: Settings = toml::from_str(DEFAULT_CONFIG_TOML).unwrap();
        assert_eq!(parsed, Settings::default());
        assert_eq!(loaded.manifest.name, "demo");
        assert_eq!(loaded.table.max_batch_tokens("llm", "mixed"), Some(2048));
    }

    #[test]
    fn the_built_in_copies_load_from_an_empty_directory() {
        let dir = tempfile::tempdir().unwrap();
        let o = LoadOptions {
            config_dir: dir.path().to_path_buf(),
            env: Some(HashMap::new()),
            ..LoadOptions::default()
        };
        let loaded = load(&o).unwrap();
        assert_eq!(loaded.model_origin, "built-in config/models/demo.toml");
        assert_eq!(loaded.layers, ["built-in config/default.toml"]);
        assert!(o.config_files().is_empty());
    }

    #[test]
    fn environment_overrides_are_typed_and_lowercased() {
        let o = opts(
            "omni.toml",
            &[
                ("MSTAR__CHUNKING__MIN_CHUNK_TOKENS", "32"),
                ("MSTAR__CHUNKING__MAX_BATCH_TOKENS__THINKER__MIXED", "4096"),
                ("MSTAR__CHUNKING__MAX_BATCH_TOKENS__VISION", "off"),
                ("MSTAR__CHUNKING__NO_CHUNKING", "talker"),
                ("MSTAR_ENV", "ignored: not an override"),
                ("OTHER", "x"),
            ],
        );
        let l = load(&o).unwrap();
        assert_eq!(l.settings.chunking.min_chunk_tokens, 32);
        assert_eq!(l.table.max_batch_tokens("thinker", "mixed"), Some(4096));
        assert_eq!(l.table.max_batch_tokens("vision", "prefill"), None);
        assert_eq!(l.table.max_batch_tokens("talker", "prefill"), None);
        assert_eq!(l.settings.chunking.no_chunking, ["talker"]);
    }

    #[test]
    fn later_layers_win_and_errors_name_the_layer_that_set_the_key() {
        let dir = tempfile::tempdir().unwrap();
        let a = dir.path().join("a.toml");
        let b = dir.path().join("b.toml");
        std::fs::write(
            &a,
            "[chunking]\nmin_chunk_tokens = 0\nmax_row_tokens = 512\n",
        )
        .unwrap();
        std::fs::write(&b, "[chunking]\nmin_chunk_tokens = 16\n").unwrap();
        let mut o = opts("demo.toml", &[]);
        o.configs = vec![a.clone(), b.clone()];
        let l = load(&o).unwrap();
        assert_eq!(l.settings.chunking.min_chunk_tokens, 16);
        assert_eq!(l.settings.chunking.max_row_tokens, Some(512));
        o.configs = vec![b, a.clone()];
        let p = problems(&o);
        assert_eq!(
            p,
            [format!(
                "{}: `chunking.min_chunk_tokens` = 0: `min_chunk_tokens` must be at least 1, got 0 (SPEC §4 rule 6)",
                a.display()
            )]
        );
        o.env = Some(HashMap::from([(
            "MSTAR__CHUNKING__MIN_CHUNK_TOKENS".into(),
            "8".into(),
        )]));
        assert!(load(&o).is_ok(), "the environment is the last layer");
    }

    #[test]
    fn budgets_refuse_false_none_negative_and_fractions() {
        let parse = |v: serde_json::Value| serde_json::from_value::<BudgetSetting>(v).map(|b| b.0);
        assert_eq!(
            parse(serde_json::json!(4096)).unwrap(),
            BudgetValue::Tokens(4096)
        );
        assert_eq!(
            parse(serde_json::json!(" 4096 ")).unwrap(),
            BudgetValue::Tokens(4096)
        );
        assert_eq!(parse(serde_json::json!("OFF")).unwrap(), BudgetValue::Off);
        assert_eq!(parse(serde_json::json!(null)).unwrap(), BudgetValue::Off);
        // -1 parses (so that validation can name node and walk) and is refused there.
        assert_eq!(
            parse(serde_json::json!(-1)).unwrap(),
            BudgetValue::Tokens(-1)
        );
        for bad in [
            serde_json::json!(false),
            serde_json::json!("false"),
            serde_json::json!("none"),
            serde_json::json!("no"),
            serde_json::json!(1.5),
            serde_json::json!(2048.0),
            serde_json::json!("1.5"),
            serde_json::json!("1e3"),
            serde_json::json!("0x10"),
            serde_json::json!(""),
            serde_json::json!([1]),
        ] {
            assert!(parse(bad.clone()).is_err(), "{bad} was accepted");
        }
        let node = |v: serde_json::Value| serde_json::from_value::<NodeBudgetSetting>(v);
        assert_eq!(
            node(serde_json::json!({"mixed": "off", "prefill": 8})).unwrap(),
            NodeBudgetSetting::PerWalk(BTreeMap::from([
                ("mixed".into(), BudgetSetting(BudgetValue::Off)),
                ("prefill".into(), BudgetSetting(BudgetValue::Tokens(8))),
            ]))
        );
        let e = node(serde_json::json!({"mixed": false}))
            .unwrap_err()
            .to_string();
        assert!(e.contains("invalid type: boolean `false`"), "{e}");
        let o = opts(
            "demo.toml",
            &[("MSTAR__CHUNKING__MAX_BATCH_TOKENS__LLM__MIXED", "-1")],
        );
        assert_eq!(
            problems(&o),
            ["environment variable MSTAR__CHUNKING__MAX_BATCH_TOKENS__LLM__MIXED: `chunking.max_batch_tokens.llm.mixed` = -1: budget for `llm`/`mixed` must be a positive whole number of tokens or off, got -1 (SPEC §4 rule 6)"]
        );
    }

    #[test]
    fn every_problem_of_one_load_is_reported() {
        let o = opts(
            "omni.toml",
            &[
                ("MSTAR__CHUNKING__MIN_CHUNK_TOKEN", "3"),
                ("MSTAR__CHUNKING__MAX_BATCH_TOKENS__TALKER__DECODE", "5"),
                ("MSTAR__LOG__LEVEL", "info,[[bad"),
                ("MSTAR__REPLAY__WALK", "spec_verify"),
                ("MSTAR__METRICS__LISTEN", "everywhere"),
            ],
        );
        let p = problems(&o);
        for want in [
            "`chunking.min_chunk_token` = 3: unknown field `min_chunk_token`",
            "`metrics.listen` = \"everywhere\": expected an address",
            "`log.level` = \"info,[[bad\": not a tracing filter",
            "`replay.walk` = \"spec_verify\": walk `spec_verify` is not in the walks",
            "`chunking.max_batch_tokens.talker.decode` = 5: budget for `talker`/`decode` would do nothing",
        ] {
            assert!(p.iter().any(|l| l.contains(want)), "{want} not in {p:#?}");
        }
        assert_eq!(p.len(), 5, "{p:#?}");
        assert!(
            p.iter()
                .all(|l| l.starts_with("environment variable MSTAR__")),
            "{p:#?}"
        );
    }

    #[test]
    fn load_settings_reloads_against_a_loaded_manifest() {
        let o = opts("omni.toml", &[]);
        let l = load(&o).unwrap();
        let mut o2 = o.clone();
        o2.configs = vec![repo_config().join("omni-worker.toml")];
        let (settings, table) = load_settings(&o2, &l.manifest).unwrap();
        assert_eq!(settings.chunking.no_chunking, ["talker"]);
        assert_eq!(table.max_batch_tokens("thinker", "mixed"), Some(6144));
        o2.env = Some(HashMap::from([(
            "MSTAR__CHUNKING__MAX_BATCH_TOKENS__GHOST".into(),
            "1".into(),
        )]));
        assert!(load_settings(&o2, &l.manifest).is_err());
    }
}
