//! `[chunking]` against the model: the `set_budgets` arguments it gives, the effective budget
//! table `check` prints, and each budget refusal reported at the `[chunking]` key it names.

use std::collections::BTreeMap;

use super::layers::KeyOrigins;
use super::problem::{ConfigProblem, MAX_SHOWN_CHARS};
use super::sections::ChunkingSection;
use super::spelling::{NodeBudgetSetting, NodeTimeSetting, OrderSetting};
use crate::budget::{
    BudgetError, BudgetSettings, BudgetTable, NodeBudget, NodeTimeBudget, OrderSettings, Rule,
    SettingKey, Subject, TimeSettings,
};
use crate::manifest::Manifest;
use crate::order::{Order, WaitBound};
use crate::policy::Name;

/// Defined here rather than in `manifest.rs` so that the model's file imports nothing from the
/// config module (the config module reads manifests; the reverse would be an import circle).
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
            slots_per_row: chunking.slots_per_row,
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
                margin_quantile: chunking.time_margin,
                floor: chunking.time_floor,
            },
            order: OrderSettings {
                all: match &chunking.order {
                    OrderSetting::All(o) => *o,
                    OrderSetting::PerNode(_) => Order::Fcfs,
                },
                per_node: match &chunking.order {
                    OrderSetting::All(_) => BTreeMap::new(),
                    OrderSetting::PerNode(m) => m.iter().map(|(n, o)| (name(n), *o)).collect(),
                },
                bound: WaitBound {
                    max_wait_ms: chunking.max_wait_ms,
                    max_wait_steps: chunking.max_wait_steps.map(u64::from),
                },
            },
        }
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
    /// The order of the node's waiting prompts (`chunking.order`).
    pub order: &'static str,
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
                    crate::latency::TERM_KEYS
                        .into_iter()
                        .zip(m.terms())
                        // `per_row_ms` only when set, so a four-term model prints as before.
                        .filter(|&(k, v)| k != "per_row_ms" || v > 0.0)
                        .collect()
                }),
                learn_cost: table.settings().time.learn,
                order: table.order(node).order.as_str(),
            });
        }
    }
    rows
}

/// `message (rule)`, the message cut (with `…`) so that the whole fits in what a problem shows
/// ([`MAX_SHOWN_CHARS`]): a long message never cuts the pointer to its rule's heading.
pub(super) fn with_rule(message: &str, rule: Rule) -> String {
    let rule = format!(" ({rule})");
    let (len, rule_len) = (message.chars().count(), rule.chars().count());
    if len + rule_len <= MAX_SHOWN_CHARS {
        return format!("{message}{rule}");
    }
    let cut: String = message
        .chars()
        .take(MAX_SHOWN_CHARS.saturating_sub(rule_len + 1))
        .collect();
    format!("{cut}…{rule}")
}

/// A budget refusal as a problem naming its key, value and layer; a refusal of the model
/// itself names the manifest.
pub(super) fn budget_problem(
    e: &BudgetError,
    chunking: &ChunkingSection,
    model_origin: &str,
    origins: &KeyOrigins,
) -> ConfigProblem {
    let reason = with_rule(&e.to_string(), e.rule());
    let from_model = |s: &Subject| {
        matches!(
            s.setting,
            SettingKey::OverrideMixed | SettingKey::CombinedWalkOf
        )
    };
    let Some(subject) = e.subject().filter(|s| !from_model(s)) else {
        return ConfigProblem::Manifest {
            path: model_origin.to_string(),
            reason: e.to_string(),
        };
    };
    let (node, walk) = (subject.node.map(|n| &**n), subject.walk.map(|w| &**w));
    let setting = subject.setting;
    // Per-node settings are keyed by node and walk, and quote the value as written.
    let per_node = |n: &str| match walk {
        Some(w) => format!("chunking.{setting}.{n}.{w}"),
        None => format!("chunking.{setting}.{n}"),
    };
    let (key, value) = match (setting, node) {
        (SettingKey::MaxBatchTokens, Some(n)) => (
            per_node(n),
            chunking.max_batch_tokens.get(n).and_then(|b| b.shown(walk)),
        ),
        (SettingKey::MaxStepMs, Some(n)) => (
            per_node(n),
            chunking.max_step_ms.get(n).and_then(|b| b.shown(walk)),
        ),
        (SettingKey::Cost, Some(n)) => (per_node(n), None),
        (SettingKey::Order, Some(n)) => {
            (format!("chunking.{setting}.{n}"), chunking.order.shown(n))
        }
        (SettingKey::NoChunking, Some(n)) => (
            format!("chunking.{setting}"),
            Some(super::problem::quote(n)),
        ),
        _ => (format!("chunking.{setting}"), e.value()),
    };
    origins.problem(&key, value, reason)
}
