//! The serving config as the simulator reads it: the component's layered config
//! ([`mstar_chunking::config`], every item re-exported here) with the `[replay]` section
//! ([`sections`]) decoded from the same layers, as strictly, and the replay's command-line
//! flags ([`flags`]).

pub mod flags;
pub mod sections;

use std::ops::{Deref, DerefMut};

pub use mstar_chunking::config::*;
pub use sections::*;

use mstar_chunking::budget::BudgetSettings;
use mstar_chunking::manifest::Manifest;

/// The whole config the simulator runs: the component's sections (reached through `Deref`:
/// `settings.chunking`) and `[replay]`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Settings {
    /// `[chunking]`, `[metrics]` and `[log]`.
    pub component: mstar_chunking::config::Settings,
    /// `[replay]`: the simulation `replay` runs.
    pub replay: ReplaySection,
}

impl Deref for Settings {
    type Target = mstar_chunking::config::Settings;

    fn deref(&self) -> &Self::Target {
        &self.component
    }
}

impl DerefMut for Settings {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.component
    }
}

/// The whole config as one TOML or JSON document states it (`toml::from_str`), as strictly as
/// the layered loader decodes it.
impl<'de> serde::Deserialize<'de> for Settings {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(serde::Deserialize)]
        #[serde(deny_unknown_fields, default)]
        #[derive(Default)]
        struct Whole {
            chunking: ChunkingSection,
            metrics: MetricsSection,
            log: LogSection,
            replay: ReplaySection,
        }
        let w = Whole::deserialize(d)?;
        Ok(Settings {
            component: mstar_chunking::config::Settings {
                chunking: w.chunking,
                metrics: w.metrics,
                log: w.log,
            },
            replay: w.replay,
        })
    }
}

impl Settings {
    /// The arguments of `set_budgets` for `manifest` under this config:
    /// [`Manifest::budget_settings`] of `[chunking]`, with the latency model also fitted online
    /// when `replay.cost.learn` asks a replay to learn it (`docs/cost-model.md`). Every path
    /// that applies a config (`check`, `replay`, reloads) agrees with it.
    pub fn budgets(&self, manifest: &Manifest) -> BudgetSettings {
        let mut budgets = manifest.budget_settings(&self.chunking);
        budgets.time.learn |= self.replay.cost.learn;
        budgets
    }

    /// The `[replay]` section as the component's loader carries it.
    pub fn sections(&self) -> SimSections {
        SimSections {
            replay: self.replay.clone(),
        }
    }
}

/// A loaded, validated configuration: the model, the layered settings with `[replay]`, and the
/// budget table they give. `[replay]`'s values are checked by [`crate::replay::settings::check`].
#[derive(Debug, Clone)]
pub struct LoadedConfig {
    /// The model.
    pub manifest: Manifest,
    /// The merged, typed settings.
    pub settings: Settings,
    /// The effective budgets.
    pub table: mstar_chunking::BudgetTable,
    /// Where the manifest came from (a path, or the built-in demo).
    pub model_origin: String,
    /// The config layers applied, in order.
    pub layers: Vec<String>,
    /// Which layer set each key, to name it in problems found after the load.
    pub origins: KeyOrigins,
    /// Warnings about the load that refuse nothing (the CLI logs them).
    pub warnings: Vec<String>,
}

impl From<mstar_chunking::config::LoadedConfig<SimSections>> for LoadedConfig {
    fn from(l: mstar_chunking::config::LoadedConfig<SimSections>) -> Self {
        Self {
            manifest: l.manifest,
            settings: Settings {
                component: l.settings,
                replay: l.extra.replay,
            },
            table: l.table,
            model_origin: l.model_origin,
            layers: l.layers,
            origins: l.origins,
            warnings: l.warnings,
        }
    }
}

impl LoadedConfig {
    /// Every node × every walk of the manifest, nodes in file order, walks in `walks` order.
    pub fn rows(&self) -> Vec<BudgetRow> {
        budget_rows(&self.manifest, &self.table)
    }
}

/// Loads the model manifest and the layered config, `[replay]` included, and validates them
/// together ([`mstar_chunking::config::load`]).
///
/// # Errors
/// Every problem found, each naming its key and layer.
pub fn load(opts: &LoadOptions) -> Result<LoadedConfig, ConfigErrors> {
    load_with_flags(opts, &[])
}

/// [`load`] with command-line flags as a layer over every other.
///
/// # Errors
/// As [`load`].
pub fn load_with_flags(
    opts: &LoadOptions,
    flags: &[FlagSetting],
) -> Result<LoadedConfig, ConfigErrors> {
    load_with::<SimSections>(opts, flags).map(LoadedConfig::from)
}
