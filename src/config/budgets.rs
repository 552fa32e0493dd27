//! `[chunking]` against the model: the `set_budgets` arguments it gives, the effective budget
//! table `check` prints, and each budget refusal mapped to the `[chunking]` key that caused it.

use std::collections::BTreeMap;

use super::layers::Origins;
use super::problem::ConfigProblem;
use super::sections::ChunkingSection;
use super::spelling::{NodeBudgetSetting, NodeTimeSetting};
use crate::budget::{
    BudgetError, BudgetSettings, BudgetTable, NodeBudget, NodeTimeBudget, TimeSettings,
};
use crate::manifest::Manifest;
use crate::Name;

/// Defined here rather than in `manifest.rs` so that the model's file imports nothing from the
/// config wing (the config wing reads manifests; the reverse would be an import circle).
impl Manifest {
    /// The arguments of `set_budgets` for this model under the `[chunking]` section: walks and
    /// combined walks from the manifest, `override_mixed` from the nodes that can cap member
    /// walks, budgets and lists from the config. Validation happens in `set_budgets`.
    pub fn budget_settings(&self, chunking: &ChunkingSection) -> BudgetSettings {
        let name = |s: &String| Name::from(s.as_str());
        BudgetSettings {
            overrides: chunking
                .max_batch_tokens
                .iter()
                .map(|(node, b)| {
                    let b = match b {
                        NodeBudgetSetting::All(v) => NodeBudget::All(v.0),
                        NodeBudgetSetting::PerWalk(m) => {
                            NodeBudget::PerWalk(m.iter().map(|(w, v)| (name(w), v.0)).collect())
                        }
                    };
                    (name(node), b)
                })
                .collect(),
            walks: self.walks.iter().map(name).collect(),
            combined_walk_of: self
                .combined_walks
                .iter()
                .flat_map(|(c, members)| members.iter().map(move |m| (name(m), name(c))))
                .collect(),
            override_mixed: self
                .nodes
                .iter()
                .filter(|(_, m)| m.can_override_mixed_max_tokens)
                .map(|(n, _)| name(n))
                .collect(),
            no_chunking: chunking.no_chunking.iter().map(name).collect(),
            min_chunk_tokens: chunking.min_chunk_tokens,
            max_row_tokens: chunking.max_row_tokens,
            max_partial_prefills: chunking.max_partial_prefills,
            time: TimeSettings {
                max_step_ms: chunking
                    .max_step_ms
                    .iter()
                    .map(|(node, t)| {
                        let t = match t {
                            NodeTimeSetting::All(v) => NodeTimeBudget::All(v.0),
                            NodeTimeSetting::PerWalk(m) => NodeTimeBudget::PerWalk(
                                m.iter().map(|(w, v)| (name(w), v.0)).collect(),
                            ),
                        };
                        (name(node), t)
                    })
                    .collect(),
                cost: chunking
                    .cost
                    .iter()
                    .map(|(node, c)| (name(node), c.0))
                    .collect(),
                learn: chunking.learn_cost,
            },
        }
    }
}

impl Manifest {
    /// The arguments of `set_budgets` for this model under the whole serving config:
    /// [`Manifest::budget_settings`] of `[chunking]`, with online learning of the latency model
    /// also on when `replay.cost.learn` asks a replay to learn it (`docs/cost-model.md`). Every
    /// path that applies a config (`check`, `replay`, reloads) goes through here, so they agree.
    pub fn settings_budgets(&self, settings: &super::Settings) -> BudgetSettings {
        let mut budgets = self.budget_settings(&settings.chunking);
        budgets.time.learn |= settings.replay.cost.learn;
        budgets
    }
}

/// One `(node, walk)` of the effective budget table, as `check` prints it and `budgets --json`
/// emits it.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct BudgetRow {
    /// The node.
    pub node: String,
    /// The walk.
    pub walk: String,
    /// The model's declared budget.
    pub policy_budget: Option<u32>,
    /// The effective budget after the serving config.
    pub max_batch_tokens: Option<u32>,
    /// Whether rows of the walk are cut on the node.
    pub chunkable: bool,
    /// The floor under the effective budget; `None` where there is no budget.
    pub min_chunk_tokens: Option<u32>,
    /// Member walk -> cap, under a combined walk on a node that caps member walks.
    pub walk_caps: Option<BTreeMap<String, u32>>,
    /// The time budget in ms (`chunking.max_step_ms`); `None` where there is none.
    pub max_step_ms: Option<f64>,
    /// The node's latency model from the config (`chunking.cost.<node>`), coefficient name ->
    /// value; `None` where the node has none.
    pub cost: Option<BTreeMap<&'static str, f64>>,
    /// Whether the node's model is fitted online from measured steps (`chunking.learn_cost`).
    pub learn_cost: bool,
}

/// The effective table of `table` over every node × walk of `manifest`, nodes in file order,
/// walks in `walks` order.
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
                max_step_ms: table.max_step_ms(node, walk),
                cost: table.settings().time.cost.get(node.as_str()).map(|m| {
                    crate::latency::COEFFICIENT_KEYS
                        .into_iter()
                        .zip(m.coefficients())
                        .collect()
                }),
                learn_cost: table.settings().time.learn,
            });
        }
    }
    rows
}

/// The `[chunking]` key a budget refusal is about, and the node and walk whose value to quote;
/// `None` for a refusal of the model itself. Budget rules: `docs/budgets.md#refusals`.
type Quoted<'a> = Option<(&'a str, Option<&'a str>)>;

fn budget_key<'a>(node: &'a Name, walk: Option<&'a Name>) -> Option<(String, Quoted<'a>)> {
    let key = match walk {
        Some(w) => format!("chunking.max_batch_tokens.{node}.{w}"),
        None => format!("chunking.max_batch_tokens.{node}"),
    };
    Some((key, Some((&**node, walk.map(|w| &**w)))))
}

/// The numbered rule of `docs/budgets.md#refusals` a refusal breaks.
fn rule(e: &BudgetError) -> Option<u8> {
    Some(match e {
        BudgetError::UnknownNode { setting, .. } if *setting == "max_batch_tokens" => 1,
        BudgetError::UnknownNode { .. } => 7,
        BudgetError::WalkNotServed { .. } | BudgetError::CombinedWalkNotServed { .. } => 2,
        BudgetError::WalkNotBudgeted { .. } => 3,
        BudgetError::NodeBudgetsNothing { .. } => 4,
        BudgetError::MemberWalk { .. } => 5,
        BudgetError::ZeroSetting { key } if *key == "min_chunk_tokens" => 6,
        BudgetError::ZeroSetting { .. } => 10,
        BudgetError::WalkInTwoCombined { .. } => 7,
        BudgetError::BelowAlign { .. } => 8,
        BudgetError::RowCapBelowAlign { .. } => 9,
        BudgetError::WalkNeverChunked { .. } => 11,
        _ => return None,
    })
}

/// The `chunking.max_step_ms` key of a time budget refusal.
fn time_key<'a>(node: &'a Name, walk: Option<&'a Name>) -> Option<(String, Quoted<'a>)> {
    let key = match walk {
        Some(w) => format!("chunking.max_step_ms.{node}.{w}"),
        None => format!("chunking.max_step_ms.{node}"),
    };
    Some((key, Some((&**node, walk.map(|w| &**w)))))
}

/// Whether a refusal is about `chunking.max_step_ms` (its value is quoted from there).
fn is_time(e: &BudgetError) -> bool {
    matches!(
        e,
        BudgetError::BadTimeBudget { .. }
            | BudgetError::TimeBudgetDoesNothing { .. }
            | BudgetError::TimeMemberWalk { .. }
            | BudgetError::NoLatencyModel { .. }
            | BudgetError::TimeBudgetBelowBase { .. }
    ) || matches!(e, BudgetError::UnknownNode { setting, .. } if *setting == "max_step_ms")
}

fn chunking_key(e: &BudgetError) -> Option<(String, Quoted<'_>)> {
    let budget = budget_key;
    match e {
        BudgetError::UnknownNode { setting, node } if *setting == "max_step_ms" => {
            time_key(node, None)
        }
        BudgetError::UnknownNode { setting, node } if *setting == "cost" => {
            Some((format!("chunking.cost.{node}"), None))
        }
        BudgetError::BadTimeBudget { node, walk, .. } => time_key(node, walk.as_ref()),
        BudgetError::TimeBudgetDoesNothing { node, walk }
        | BudgetError::TimeMemberWalk { node, walk, .. } => time_key(node, Some(walk)),
        BudgetError::NoLatencyModel { node } => time_key(node, None),
        BudgetError::TimeBudgetBelowBase { node, walk, .. } => time_key(node, Some(walk)),
        BudgetError::ZeroLatencyModel { node } => Some((format!("chunking.cost.{node}"), None)),
        BudgetError::UnknownNode { setting, node } if *setting == "no_chunking" => {
            Some(("chunking.no_chunking".into(), Some((&**node, None))))
        }
        BudgetError::UnknownNode { setting, node } if *setting == "max_batch_tokens" => {
            budget(node, None)
        }
        BudgetError::NodeBudgetsNothing { node } => budget(node, None),
        BudgetError::WalkNotServed { node, walk }
        | BudgetError::WalkNotBudgeted { node, walk }
        | BudgetError::MemberWalk { node, walk, .. }
        | BudgetError::BelowAlign { node, walk, .. } => budget(node, Some(walk)),
        BudgetError::ZeroSetting { key } => Some((format!("chunking.{key}"), None)),
        BudgetError::RowCapBelowAlign { .. } => Some(("chunking.max_row_tokens".into(), None)),
        _ => None,
    }
}

/// A budget refusal as a problem naming its key, value and layer; a refusal of the model
/// itself names the manifest.
pub(super) fn budget_problem(
    e: &BudgetError,
    chunking: &ChunkingSection,
    model_origin: &str,
    origins: &Origins,
) -> ConfigProblem {
    let reason = match rule(e) {
        Some(n) => format!("{e} (docs/budgets.md#refusals, rule {n})"),
        None if is_time(e) || matches!(e, BudgetError::ZeroLatencyModel { .. }) => {
            format!("{e} (docs/cost-model.md#time-budgets)")
        }
        None => format!("{e} (docs/budgets.md#refusals)"),
    };
    match chunking_key(e) {
        Some((key, quoted)) => {
            let value = match (quoted, e) {
                (Some((node, _)), BudgetError::UnknownNode { setting, .. })
                    if *setting == "no_chunking" =>
                {
                    Some(super::problem::quote(node))
                }
                (Some((node, walk)), e) if is_time(e) => {
                    chunking.max_step_ms.get(node).and_then(|b| b.shown(walk))
                }
                (Some((node, walk)), _) => chunking
                    .max_batch_tokens
                    .get(node)
                    .and_then(|b| b.shown(walk)),
                (None, BudgetError::ZeroSetting { .. }) => Some("0".into()),
                (None, BudgetError::RowCapBelowAlign { max_row, .. }) => Some(max_row.to_string()),
                (None, _) => None,
            };
            origins.problem(&key, value, reason)
        }
        None => ConfigProblem::Manifest {
            path: model_origin.to_string(),
            reason: e.to_string(),
        },
    }
}
