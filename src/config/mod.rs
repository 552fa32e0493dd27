//! The config module: the layered serving config and the model manifest, loaded and checked
//! together (`docs/config.md`). One concept per module:
//!
//! - [`sections`]: the typed sections of the serving config;
//! - [`spelling`]: token and time budget spellings, parsed strictly into typed values by one
//!   deserializer; [`cost`]: latency models by coefficients or preset;
//! - [`layers`]: the layers, and which layer set each key;
//! - `decode`: strict decoding (no coercion, no other integer notations, no YAML aliases);
//! - [`problem`]: problems with their layer attached, escaped, cut and capped;
//! - [`budgets`]: `[chunking]` against the model, and budget refusals mapped to their keys.
//!
//! This module is the load pipeline: [`load`] reads every layer, merges them, deserializes
//! strictly and validates against the manifest, reporting every problem at once (up to
//! [`problem::MAX_PROBLEMS`]), each with its key, the layer that set it and its value. A
//! program adds top-level sections of its own ([`ExtraSections`], the simulator's `[replay]`),
//! decoded as strictly and reported with the rest; it checks their values itself.

pub mod budgets;
pub mod cost;
pub(crate) mod decode;
pub mod flags;
pub mod layers;
pub mod problem;
pub mod sections;
pub mod spelling;

use std::path::Path;

pub use crate::input::{InputError, MAX_CONFIG_BYTES, MAX_MANIFEST_BYTES};
pub use budgets::{budget_rows, BudgetRow};
pub use cost::CostSetting;
pub use flags::FlagSetting;
pub use layers::{KeyOrigins, LoadOptions, DEFAULT_CONFIG_TOML, ENV_PREFIX};
pub use problem::{ConfigErrors, ConfigProblem};
pub use sections::{ChunkingSection, Listen, LogFormat, LogSection, MetricsSection, Settings};
pub use spelling::{BudgetSetting, NodeBudgetSetting, NodeTimeSetting, PerNode, TimeSetting};

use crate::budget::BudgetTable;
use crate::manifest::{Manifest, ManifestError, ManifestErrors};
use crate::policy::ModelPolicies;
use decode::{lookup, remove, render, segments, to_json};
use layers::Layers;

/// `config/models/demo.toml`, built in as the default model manifest.
pub const DEMO_MANIFEST_TOML: &str = include_str!("../../config/models/demo.toml");

/// Top-level sections a program adds to the serving config beside `[chunking]`, `[metrics]`
/// and `[log]` (the simulator's `[replay]`): a struct with one field per section, decoded from
/// the same layers as strictly (unknown keys refused, each problem named with its key and
/// layer, reported with the component's). The program checks their values itself.
pub trait ExtraSections:
    serde::de::DeserializeOwned + Default + Clone + std::fmt::Debug + PartialEq + Send + 'static
{
    /// The sections' names, as the struct's fields are named.
    const NAMES: &'static [&'static str];
    /// The dotted key that names the node a flag's `{node}` stands for, when a layer sets it
    /// (else the model's first node).
    const NODE_KEY: Option<&'static str> = None;

    /// Whether these sections ask for each node's latency model to be fitted online, as
    /// `chunking.learn_cost` does (a time budget without a model is then not refused).
    fn learns_cost(&self) -> bool {
        false
    }
}

/// No sections beyond the component's own: what [`load`] decodes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NoExtraSections {}

impl ExtraSections for NoExtraSections {
    const NAMES: &'static [&'static str] = &[];
}

/// A loaded, validated configuration: the model, the layered settings and the budget table
/// they give. Every budget refusal has been reported by the time one exists; the values of
/// the `extra` sections are checked by the program that added them.
#[derive(Debug, Clone)]
pub struct LoadedConfig<X: ExtraSections = NoExtraSections> {
    /// The model.
    pub manifest: Manifest,
    /// The merged, typed settings.
    pub settings: Settings,
    /// The program's own sections ([`ExtraSections`]).
    pub extra: X,
    /// The effective budgets.
    pub table: BudgetTable,
    /// Where the manifest came from (a path, or the built-in demo).
    pub model_origin: String,
    /// The config layers applied, in order.
    pub layers: Vec<String>,
    /// Which layer set each key, to name it in problems found after the load.
    pub origins: KeyOrigins,
    /// Warnings about the load that refuse nothing: `MSTAR_…` environment variables not in the
    /// documented `MSTAR__SECTION__KEY` form ([`layers::env_warnings`]). The CLI logs them.
    pub warnings: Vec<String>,
}

impl<X: ExtraSections> LoadedConfig<X> {
    /// Every node × every walk of the manifest, nodes in file order, walks in `walks` order.
    pub fn rows(&self) -> Vec<BudgetRow> {
        budget_rows(&self.manifest, &self.table)
    }
}

/// Loads the model manifest and the layered serving config, and validates them together.
///
/// # Errors
/// Every problem found: unreadable, oversized or malformed files, unknown keys, values of the
/// wrong type or spelling, manifest problems and every budget refusal, each naming its key and
/// layer.
pub fn load(opts: &LoadOptions) -> Result<LoadedConfig, ConfigErrors> {
    load_with_flags(opts, &[])
}

/// [`load`] with command-line flags as a layer over every other ([`flags`]): each sets its
/// key as a config layer would, and is refused as that key is, naming the flag.
///
/// # Errors
/// As [`load`].
pub fn load_with_flags(
    opts: &LoadOptions,
    flags: &[FlagSetting],
) -> Result<LoadedConfig, ConfigErrors> {
    load_with(opts, flags)
}

/// [`load_with_flags`] with the program's own sections `X` decoded from the same layers.
///
/// # Errors
/// As [`load`], and every problem of the `X` sections' types and keys.
pub fn load_with<X: ExtraSections>(
    opts: &LoadOptions,
    flags: &[FlagSetting],
) -> Result<LoadedConfig<X>, ConfigErrors> {
    let mut problems = ConfigErrors::default();
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
    let first_node = manifest.as_ref().and_then(Manifest::first_node);
    let (settings, extra, origins) = deserialize::<X>(&layers, flags, first_node, &mut problems);
    let learn = extra.learns_cost();
    let table = manifest
        .as_ref()
        .and_then(|m| check_against(m, &model_origin, &settings, learn, &origins, &mut problems));
    match (manifest, table) {
        (Some(manifest), Some(table)) if problems.is_empty() => Ok(LoadedConfig {
            manifest,
            settings,
            extra,
            table,
            model_origin,
            layers: layers.labels(!flags.is_empty()),
            origins,
            warnings: layers::env_warnings(opts),
        }),
        _ => Err(problems),
    }
}

/// Loads the layered serving config again against an already-loaded manifest, as a config
/// reload does: the model's policies are fixed at load, only the deployment's say changes.
///
/// # Errors
/// As [`load`], without the manifest's own problems.
pub fn load_settings<X: ExtraSections>(
    opts: &LoadOptions,
    manifest: &Manifest,
) -> Result<(Settings, X, BudgetTable), ConfigErrors> {
    let mut problems = ConfigErrors::default();
    let layers = Layers::read(opts, &mut problems);
    let (settings, extra, origins) = deserialize::<X>(&layers, &[], None, &mut problems);
    let origin = opts
        .model_path()
        .map_or_else(builtin_demo_label, |p| p.display().to_string());
    let learn = extra.learns_cost();
    let table = check_against(manifest, &origin, &settings, learn, &origins, &mut problems);
    match table {
        Some(table) if problems.is_empty() => Ok((settings, extra, table)),
        _ => Err(problems),
    }
}

/// Reads, parses and validates the manifest file at `path`: a regular file of at most
/// [`MAX_MANIFEST_BYTES`].
///
/// # Errors
/// An unreadable, irregular or oversized file, or as [`Manifest::from_toml`].
pub fn load_manifest(path: &Path) -> Result<Manifest, ManifestErrors> {
    let origin = path.display().to_string();
    let text = crate::input::read_text(path, MAX_MANIFEST_BYTES).map_err(|e| ManifestErrors {
        origin: origin.clone(),
        errors: vec![ManifestError::Read {
            reason: e.to_string(),
        }],
    })?;
    if let Some(line) = decode::non_decimal_integers(&text).first() {
        return Err(ManifestErrors {
            origin,
            errors: vec![ManifestError::Parse {
                reason: format!(
                    "`{}` = {}: integers are written in decimal (docs/config.md#spellings)",
                    line.0, line.1
                ),
                line: None,
            }],
        });
    }
    Manifest::from_toml(&text, &origin)
}

fn builtin_demo_label() -> String {
    "built-in config/models/demo.toml".to_string()
}

fn read_manifest(opts: &LoadOptions) -> Result<(Manifest, String), ManifestErrors> {
    match opts.model_path() {
        Some(path) => load_manifest(&path).map(|m| (m, path.display().to_string())),
        None => {
            let origin = builtin_demo_label();
            Manifest::from_toml(DEMO_MANIFEST_TOML, &origin).map(|m| (m, origin))
        }
    }
}

/// Merges the layers, applies the command-line flags over them (`flags`; `first_node` is the
/// default of the node `{node}` stands for) and deserializes the result, the component's
/// sections and then the program's (`X`), collecting every problem: after each error the
/// offending key is dropped and deserialization retried (at most [`problem::MAX_PROBLEMS`]
/// times, so the work stays linear in the input), so one run names them all. An unknown key
/// is named without its value, which may be a secret. Answers the settings, the program's
/// sections and who set each key.
fn deserialize<X: ExtraSections>(
    layers: &Layers,
    flags: &[FlagSetting],
    first_node: Option<&str>,
    problems: &mut ConfigErrors,
) -> (Settings, X, KeyOrigins) {
    let mut origins = layers.origins();
    let merged = match layers.merged() {
        Ok(m) => m,
        Err(reason) => {
            problems.push(ConfigProblem::File {
                path: "merged config".into(),
                reason,
            });
            return (Settings::default(), X::default(), origins);
        }
    };
    let mut tree =
        serde_json::Value::Object(merged.into_iter().map(|(k, v)| (k, to_json(v))).collect());
    if !flags.is_empty() {
        let node = X::NODE_KEY
            .and_then(|key| lookup(&tree, &split(key)))
            .and_then(serde_json::Value::as_str)
            .or(first_node)
            .map(str::to_owned);
        origins.push_layer(flags::apply(flags, &mut tree, node.as_deref()));
    }
    let serde_json::Value::Object(mut sections) = tree else {
        unreachable!("the merged layers and the flags' edits make a table")
    };
    let extra_sections = X::NAMES
        .iter()
        .filter_map(|name| sections.remove(*name).map(|v| ((*name).to_owned(), v)))
        .collect();
    let settings =
        deserialize_tree::<Settings>(serde_json::Value::Object(sections), &origins, problems)
            .inspect(|settings| check_log(settings, &origins, problems))
            .unwrap_or_default();
    let extra = deserialize_tree::<X>(
        serde_json::Value::Object(extra_sections),
        &origins,
        problems,
    )
    .unwrap_or_default();
    (settings, extra, origins)
}

fn split(key: &str) -> Vec<String> {
    key.split('.').map(str::to_owned).collect()
}

/// Deserializes `tree` as a `T`, dropping each offending key and trying again; `None` when it
/// gave up (the problem list is full, or a key could not be dropped).
fn deserialize_tree<T: serde::de::DeserializeOwned>(
    mut tree: serde_json::Value,
    origins: &KeyOrigins,
    problems: &mut ConfigErrors,
) -> Option<T> {
    for _ in 0..problem::MAX_PROBLEMS {
        let err = match serde_path_to_error::deserialize::<_, T>(&tree) {
            Ok(t) => return Some(t),
            Err(err) => err,
        };
        let path = segments(err.path());
        let key = path.join(".");
        let reason = err.inner().to_string();
        let value = if reason.starts_with("unknown field") {
            None
        } else {
            lookup(&tree, &path).map(render)
        };
        problems.push(origins.problem(&key, value, reason));
        if !remove(&mut tree, &path) {
            break;
        }
    }
    None
}

/// `[log]` values whose type is right but whose content is not.
fn check_log(settings: &Settings, origins: &KeyOrigins, problems: &mut ConfigErrors) {
    if let Err(e) = tracing_subscriber::EnvFilter::builder().parse(&settings.log.level) {
        problems.push(origins.problem(
            "log.level",
            Some(problem::quote(&settings.log.level)),
            format!("not a tracing filter such as \"info\" or \"warn,mstar_chunking=debug\": {e}"),
        ));
    }
}

/// Checks the settings against the model and builds the budget table, reporting every
/// refusal with the key and layer that caused it. Once the problem list is full the rest are
/// only counted, so a million unknown node names cost a million counts, not a million lines.
fn check_against(
    manifest: &Manifest,
    model_origin: &str,
    settings: &Settings,
    learn: bool,
    origins: &KeyOrigins,
    problems: &mut ConfigErrors,
) -> Option<BudgetTable> {
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
    let mut budgets = manifest.budget_settings(&settings.chunking);
    budgets.time.learn |= learn;
    match BudgetTable::build(model, budgets) {
        Ok(table) => Some(table),
        Err(errors) => {
            for e in &errors.0 {
                if problems.is_full() {
                    problems.more = problems.more.saturating_add(1);
                } else {
                    problems.push(budgets::budget_problem(
                        e,
                        &settings.chunking,
                        model_origin,
                        origins,
                    ));
                }
            }
            None
        }
    }
}

#[cfg(test)]
pub(crate) mod tests;
