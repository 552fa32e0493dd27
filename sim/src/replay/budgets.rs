//! The budgets a replay applies: the config's, then `--budget-off` and `--budget`, checked
//! as the config would check them.

use std::collections::BTreeMap;

use super::error::ReplayError;
use super::settings::ReplaySetup;
use crate::config::Settings;
use mstar_chunking::budget::{BudgetValue, NodeBudget};
use mstar_chunking::manifest::Manifest;
use mstar_chunking::policy::Name;

/// `--budget N|off` (`docs/replay-report.md#labelled-runs`): `value` for every step walk of the
/// replayed node that its policies budget, layered over the node's `overrides` (a node-wide
/// override keeps holding for the node's other walks).
///
/// # Errors
/// [`ReplayError::Config`] when the node budgets none of its step walks.
pub fn budget_flag_overrides(
    manifest: &Manifest,
    setup: &ReplaySetup,
    mut overrides: BTreeMap<Name, NodeBudget>,
    value: BudgetValue,
) -> Result<BTreeMap<Name, NodeBudget>, ReplayError> {
    let node = manifest.nodes.get(&setup.node);
    let budgeted: Vec<&String> = node
        .map(|n| {
            n.policies
                .iter()
                .filter(|(_, p)| p.max_batch_tokens.is_some())
                .map(|(w, _)| w)
                .collect()
        })
        .unwrap_or_default();
    let step_walks: Vec<&String> = setup
        .walks
        .iter()
        .filter(|w| budgeted.contains(w))
        .collect();
    if step_walks.is_empty() {
        return Err(ReplayError::Config {
            key: "--budget",
            problem: format!(
                "= {value}: node `{}` has no token budget on its step walk{} {} to replace (its model budgets {})",
                setup.node,
                if setup.walks.len() == 1 { "" } else { "s" },
                setup.walks.join(", "),
                if budgeted.is_empty() {
                    "no walk".to_string()
                } else {
                    budgeted.iter().map(|w| w.as_str()).collect::<Vec<_>>().join(", ")
                }
            ),
        });
    }
    let key = Name::from(setup.node.as_str());
    let mut per_walk: BTreeMap<Name, BudgetValue> = match overrides.remove(&key) {
        Some(NodeBudget::PerWalk(m)) => m,
        // A node-wide value keeps applying to the walks `--budget` does not name.
        Some(NodeBudget::All(v)) => budgeted
            .iter()
            .map(|w| (Name::from(w.as_str()), v))
            .collect(),
        None => BTreeMap::new(),
    };
    for w in step_walks {
        per_walk.insert(Name::from(w.as_str()), value);
    }
    overrides.insert(key, NodeBudget::PerWalk(per_walk));
    Ok(overrides)
}

/// The budgets a replay applies: the config's, then `--budget-off` and `--budget` (`value`),
/// and without the replayed node's cost model when `replay.cost.learn` is on. Checked whole
/// against the model as the config is (`BudgetTable::build`), so that a flag the config would
/// refuse is refused before anything runs.
///
/// # Errors
/// [`ReplayError::Budget`] with every refusal; [`ReplayError::Config`] when the replayed node
/// has no token budget for `--budget` to replace.
pub fn replay_budgets(
    manifest: &Manifest,
    settings: &Settings,
    setup: &ReplaySetup,
    budget_off: bool,
    value: Option<BudgetValue>,
) -> Result<mstar_chunking::budget::BudgetSettings, ReplayError> {
    let mut budgets = settings.budgets(manifest);
    if budget_off {
        budgets.overrides = budget_off_overrides(manifest);
    }
    if let Some(value) = value {
        budgets.overrides = budget_flag_overrides(manifest, setup, budgets.overrides, value)?;
    }
    // `replay.cost.learn`: the component learns the simulated cost of the replayed node online,
    // without being given a model for it.
    if setup.learn {
        budgets.time.cost.remove(setup.node.as_str());
    }
    // Only a flag can make the config's own budgets fail here: `check` accepted those.
    if budget_off || value.is_some() {
        if let Some(refused) = refusal(manifest, &budgets) {
            if let Refused::Budgets(errors) = &refused {
                if let Some(problem) = time_budget_without_tokens(&budgets, errors) {
                    return Err(ReplayError::Config {
                        key: "--max-step-ms",
                        problem,
                    });
                }
            }
            let reason = refused.escaped();
            return Err(ReplayError::Budget {
                flag: if value.is_some() {
                    "--budget"
                } else {
                    "--budget-off"
                },
                value,
                reason,
            });
        }
    }
    Ok(budgets)
}

/// Why the component would refuse `budgets` for `manifest`: the model's own problems, or every
/// refusal of the budget table (built once).
enum Refused {
    Model(String),
    Budgets(mstar_chunking::budget::BudgetErrors),
}

impl Refused {
    /// Every problem, escaped for a message.
    fn escaped(&self) -> String {
        let text = match self {
            Self::Model(m) => m.clone(),
            Self::Budgets(e) => e.to_string(),
        };
        crate::config::problem::escape(&text)
    }
}

/// The component's refusal of `budgets` for `manifest`, if it would refuse them.
fn refusal(
    manifest: &Manifest,
    budgets: &mstar_chunking::budget::BudgetSettings,
) -> Option<Refused> {
    let model = match mstar_chunking::policy::ModelPolicies::new(
        manifest.submodules(),
        manifest.policies(),
    ) {
        Ok(m) => m.shared(),
        Err(e) => {
            let e: Vec<String> = e.iter().map(ToString::to_string).collect();
            return Some(Refused::Model(e.join("; ")));
        }
    };
    mstar_chunking::budget::BudgetTable::build(model, budgets.clone())
        .err()
        .map(Refused::Budgets)
}

/// Why the config would refuse `budgets` for `manifest` (every refusal, escaped), if it would.
pub fn budget_refusal(
    manifest: &Manifest,
    budgets: &mstar_chunking::budget::BudgetSettings,
) -> Option<String> {
    refusal(manifest, budgets).map(|r| r.escaped())
}

/// With `--budget off` or `--budget-off`: a node's time budget (the `--max-step-ms` flag or
/// `chunking.max_step_ms.<node>`) left on step walks without a token budget, which it could not
/// bound, as a problem naming both flags and the key (`docs/replay-report.md#labelled-runs`).
fn time_budget_without_tokens(
    budgets: &mstar_chunking::budget::BudgetSettings,
    errors: &mstar_chunking::budget::BudgetErrors,
) -> Option<String> {
    let escape = crate::config::problem::escape;
    errors.0.iter().find_map(|e| match e {
        mstar_chunking::budget::BudgetError::TimeBudgetWithoutTokenBudget { node, walk } => {
            let ms = match budgets.time.max_step_ms.get(node) {
                Some(mstar_chunking::budget::NodeSetting::All(mstar_chunking::budget::TimeBudget::Ms(ms))) => {
                    format!(" = {ms}")
                }
                _ => String::new(),
            };
            let (node, walk) = (escape(node), escape(walk));
            Some(format!(
                "(`chunking.max_step_ms.{node}`){ms} is refused with the token budget off (`--budget off`, `--budget-off`): steps of `{walk}` on `{node}` are then not cut, so no time budget can bound them; give `{walk}` a token budget (`--budget N`) or turn the time budget off (`--max-step-ms off`)"
            ))
        }
        _ => None,
    })
}

/// A warning for each time budget of the replayed node's step walks (the config's, and `cells`:
/// the time budgets a sweep's grid sets on the step walk) that, stretched by the simulated
/// cost's largest noise factor, exceeds a TBT p99 objective of `tbt_p99_ms`, when the node
/// plans without a time margin: planned full to the budget, the steps the noise lengthens miss
/// the objective whatever the load (`docs/cost-model.md#a-time-budget-at-the-objective`).
pub fn time_budget_objective_warnings(
    table: &mstar_chunking::budget::BudgetTable,
    setup: &ReplaySetup,
    tbt_p99_ms: Option<f64>,
    cells: &[f64],
) -> Vec<String> {
    let Some(objective) = tbt_p99_ms else {
        return Vec::new();
    };
    if table.settings().time.margin_quantile.is_some() {
        return Vec::new();
    }
    // The largest factor the simulated cost multiplies a step's price by.
    let (stretch, noise) = match &setup.noise_bands {
        Some(bands) => (
            bands
                .iter()
                .filter_map(|b| b.ratios.last().copied())
                .fold(1.0, f64::max),
            "drawn from `noise_bands`".to_string(),
        ),
        None => (1.0 + setup.noise, format!("±{}%", setup.noise * 100.0)),
    };
    if stretch <= 1.0 {
        return Vec::new();
    }
    let configured = setup.walks.iter().filter_map(|w| {
        let ms = table.max_step_ms(&setup.node, w)?;
        Some((format!("`{}`'s", crate::config::problem::escape(w)), ms))
    });
    let cells = cells
        .iter()
        .map(|&ms| ("a time cell's (`--budgets`)".to_string(), ms));
    let mut warnings: Vec<String> = Vec::new();
    for (whose, ms) in configured.chain(cells) {
        if ms * stretch <= objective {
            continue;
        }
        let w = format!(
            "{whose} time budget ({ms} ms) is within the simulated step-time noise ({noise}) of the TBT p99 objective ({objective} ms) and no time margin is set: steps planned to the budget run past the objective at every load, so capacity collapses; set a time margin (`--time-margin 0.99`, `chunking.time_margin`) or a time budget below {} ms (docs/cost-model.md#a-time-budget-at-the-objective)",
            // Rounded down, so that the figure printed is below the bound.
            (objective / stretch * 10.0).floor() / 10.0
        );
        if !warnings.contains(&w) {
            warnings.push(w);
        }
    }
    warnings
}

/// `--budget-off`: every node that budgets a walk gets one node-wide budget of "off".
pub fn budget_off_overrides(manifest: &Manifest) -> BTreeMap<Name, NodeBudget> {
    manifest
        .nodes
        .iter()
        .filter(|(_, n)| n.policies.values().any(|p| p.max_batch_tokens.is_some()))
        .map(|(name, _)| (Name::from(name.as_str()), NodeBudget::All(BudgetValue::Off)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budget_off_names_only_nodes_that_budget_a_walk() {
        let m: Manifest = toml::from_str(
            r#"
            name = "two"
            walks = ["prefill", "decode"]
            [nodes.llm]
            chunkable_walks = ["prefill"]
            policies = { prefill = { max_batch_tokens = 512 } }
            [nodes.talker]
            policies = { prefill = { max_batch_tokens = 512, align = 4 }, decode = {} }
            [nodes.vision]
            "#,
        )
        .unwrap();
        let off = budget_off_overrides(&m);
        assert_eq!(
            off.keys().map(|k| &**k).collect::<Vec<_>>(),
            ["llm", "talker"]
        );
        assert!(off
            .values()
            .all(|b| *b == NodeBudget::All(BudgetValue::Off)));
    }

    fn setup(node: &str, walks: &[&str]) -> ReplaySetup {
        ReplaySetup {
            node: node.into(),
            walks: walks.iter().map(|w| (*w).to_string()).collect(),
            cost: mstar_chunking::latency::LatencyModel::from_coefficients(
                crate::replay::settings::DEFAULT_COST,
            )
            .unwrap(),
            cost_preset: None,
            noise: 0.0,
            noise_bands: None,
            learn: false,
            spec_tokens: 0,
            overshoot_rate: 0.0,
            seed: 42,
            cache_blocks: 0,
            cache_block_tokens: 512,
            kv: None,
            fleet: Default::default(),
        }
    }

    #[test]
    fn the_budget_flag_replaces_the_step_walks_budget_only() {
        let m: Manifest = toml::from_str(
            r#"
            name = "m"
            walks = ["prefill", "decode", "mixed"]
            [combined_walks]
            mixed = ["prefill", "decode"]
            [nodes.llm]
            chunkable_walks = ["prefill", "mixed"]
            policies = { prefill = { max_batch_tokens = 2048 }, mixed = { max_batch_tokens = 4096 } }
            [nodes.vision]
            policies = { prefill = { max_batch_tokens = 512 } }
            "#,
        )
        .unwrap();
        let n512 = BudgetValue::tokens(512).unwrap();
        let s = setup("llm", &["mixed"]);
        let o = budget_flag_overrides(&m, &s, Default::default(), n512).unwrap();
        assert_eq!(
            o.get("llm"),
            Some(&NodeBudget::PerWalk([(Name::from("mixed"), n512)].into()))
        );
        // A node-wide override keeps applying to the walk `--budget` leaves alone; other
        // nodes' overrides stay as they were.
        let base = [
            (Name::from("llm"), NodeBudget::All(BudgetValue::Off)),
            (Name::from("vision"), NodeBudget::All(BudgetValue::Off)),
        ]
        .into();
        let o = budget_flag_overrides(&m, &s, base, n512).unwrap();
        assert_eq!(
            o.get("llm"),
            Some(&NodeBudget::PerWalk(
                [
                    (Name::from("mixed"), n512),
                    (Name::from("prefill"), BudgetValue::Off)
                ]
                .into()
            ))
        );
        assert_eq!(o.get("vision"), Some(&NodeBudget::All(BudgetValue::Off)));
        // Stepping prefill and decode in turn: the budgeted one is set.
        let o = budget_flag_overrides(
            &m,
            &setup("llm", &["prefill", "decode"]),
            Default::default(),
            BudgetValue::Off,
        )
        .unwrap();
        assert_eq!(
            o.get("llm"),
            Some(&NodeBudget::PerWalk(
                [(Name::from("prefill"), BudgetValue::Off)].into()
            ))
        );
        // A node that budgets none of its step walks is refused, naming what it budgets.
        let e = budget_flag_overrides(&m, &setup("vision", &["decode"]), Default::default(), n512)
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "`--budget` = 512: node `vision` has no token budget on its step walk decode to replace (its model budgets prefill)"
        );
    }
}
