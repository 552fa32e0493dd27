//! The deployment's say (docs/budgets.md): `set_budgets` validation and the budget answers.
//!
//! A [`BudgetTable`] is immutable. [`BudgetTable::with_settings`] validates a whole new setting
//! against the model's policies and returns a new table, or every problem at once; the caller
//! keeps the previous table on error, so a refused setting changes nothing.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use crate::latency::{check_max_step_ms, LatencyModel};
use crate::order::NodeOrder;
use crate::policy::Name;
use crate::policy::{ChunkingPolicy, ModelPolicies};

mod error;
mod settings;
mod value;

pub use error::{BudgetError, BudgetErrors, Refusal, Rule, SettingKey, Subject};
pub use settings::{
    BudgetSettings, OrderSettings, TimeFloor, TimeSettings, DEFAULT_FLOOR_WAIT_STEPS,
};
#[cfg(feature = "config")]
pub(crate) use value::BUDGET_VALUE_EXPECTED;
pub use value::{
    BudgetValue, BudgetValueError, NodeBudget, NodeSetting, NodeTimeBudget, TimeBudget,
    DEFAULT_MIN_CHUNK_TOKENS,
};

/// The accepted budgets: a pure function of the policies, the submodules and the last accepted
/// settings.
#[derive(Debug, Clone)]
pub struct BudgetTable {
    model: Arc<ModelPolicies>,
    settings: BudgetSettings,
    /// Effective per-walk overrides after expanding node-wide budgets: `None` = off.
    overrides: BTreeMap<(Name, Name), Option<u32>>,
    /// Time budgets per `(node, walk)` after expanding node-wide ones: `None` = off.
    step_ms: BTreeMap<(Name, Name), Option<f64>>,
    /// `combined walk -> member walks`, derived from `combined_walk_of`.
    members: BTreeMap<Name, Vec<Name>>,
}

impl BudgetTable {
    /// The table before any serving config: the model's budgets as declared.
    pub fn from_policies(model: Arc<ModelPolicies>) -> Self {
        let settings = BudgetSettings::defaults_for(&model);
        Self {
            model,
            settings,
            overrides: BTreeMap::new(),
            step_ms: BTreeMap::new(),
            members: BTreeMap::new(),
        }
    }

    /// Validates `settings` whole against the model and returns the table they give.
    ///
    /// # Errors
    /// Every refusal of docs/budgets.md#refusals found, each naming node, walk and reason. Nothing is applied.
    pub fn with_settings(&self, settings: BudgetSettings) -> Result<Self, BudgetErrors> {
        Self::build(self.model.clone(), settings)
    }

    /// Validates `settings` against `model`, as [`BudgetTable::with_settings`].
    ///
    /// # Errors
    /// Every refusal of docs/budgets.md#refusals found.
    pub fn build(
        model: Arc<ModelPolicies>,
        settings: BudgetSettings,
    ) -> Result<Self, BudgetErrors> {
        let mut errors = Vec::new();
        for (setting, value) in [
            (SettingKey::MinChunkTokens, Some(settings.min_chunk_tokens)),
            (SettingKey::MaxRowTokens, settings.max_row_tokens),
            (
                SettingKey::MaxPartialPrefills,
                settings.max_partial_prefills,
            ),
        ] {
            if value == Some(0) {
                errors.push(BudgetError::ZeroSetting { setting });
            }
        }
        Self::check_order(&model, &settings, &mut errors);
        for (setting, nodes) in [
            (SettingKey::OverrideMixed, &settings.override_mixed),
            (SettingKey::NoChunking, &settings.no_chunking),
        ] {
            for node in nodes.iter().filter(|n| !model.has_node(n)) {
                errors.push(BudgetError::UnknownNode {
                    setting,
                    node: node.clone(),
                });
            }
        }
        // combined_walk_of is a map, so a member cannot be listed twice there; a walk in two
        // combined walks shows up when a combined walk is itself a member of another.
        let mut members: BTreeMap<Name, Vec<Name>> = BTreeMap::new();
        for (member, combined) in &settings.combined_walk_of {
            for w in [member, combined] {
                if !settings.walks.contains(w) {
                    errors.push(BudgetError::CombinedWalkNotServed { walk: w.clone() });
                }
            }
            if let Some(outer) = settings.combined_walk_of.get(combined) {
                errors.push(BudgetError::WalkInTwoCombined {
                    walk: member.clone(),
                    first: combined.clone(),
                    second: outer.clone(),
                });
            }
            members
                .entry(combined.clone())
                .or_default()
                .push(member.clone());
        }
        let overrides = expand(
            &model,
            SettingKey::MaxBatchTokens,
            &settings.overrides,
            |_, _, value: BudgetValue, _| Some(value.get()),
            |node, walk, _| Self::walk_refusal(&model, &settings, node, walk),
            &mut errors,
        );
        for ((node, walk), budget) in &overrides {
            let align = model.policy(node, walk).align;
            if let Some(budget) = budget.filter(|b| *b < align) {
                errors.push(BudgetError::BelowAlign {
                    node: node.clone(),
                    walk: walk.clone(),
                    budget,
                    align,
                });
            }
        }
        Self::check_walks_chunked(&model, &settings, &members, &mut errors);
        let step_ms = Self::check_time_budgets(&model, &settings, &overrides, &mut errors);
        if let Some(max_row) = settings.max_row_tokens.filter(|m| *m > 0) {
            let widest = model
                .policies()
                .iter()
                .filter(|(_, p)| p.max_batch_tokens.is_some() && p.align > max_row)
                .max_by_key(|(_, p)| p.align);
            if let Some(((node, walk), p)) = widest {
                errors.push(BudgetError::RowCapBelowAlign {
                    max_row,
                    node: node.clone(),
                    walk: walk.clone(),
                    align: p.align,
                });
            }
        }
        let table = Self {
            model,
            settings,
            overrides,
            step_ms,
            members,
        };
        table.check_slots(&mut errors);
        if !errors.is_empty() {
            return Err(BudgetErrors(errors));
        }
        Ok(table)
    }

    /// `slots_per_row` at or above the budget of a step some node takes (`SlotsFillBudget`).
    fn check_slots(&self, errors: &mut Vec<BudgetError>) {
        let slots = self.settings.slots_per_row;
        if slots == 0 {
            return;
        }
        for (node, walk) in self.model.policies().keys() {
            if let Some(budget) = self.max_batch_tokens(node, walk).filter(|b| *b <= slots) {
                errors.push(BudgetError::SlotsFillBudget {
                    slots,
                    node: node.clone(),
                    walk: walk.clone(),
                    budget,
                });
            }
        }
    }

    /// The order settings (`docs/scheduling.md#the-order-of-waiting-prompts`): a per-node order
    /// of a node the model does not have, a `max_wait_ms` that is not finite and above 0, a
    /// `max_wait_steps` of 0.
    fn check_order(
        model: &ModelPolicies,
        settings: &BudgetSettings,
        errors: &mut Vec<BudgetError>,
    ) {
        let order = &settings.order;
        for node in order.per_node.keys().filter(|n| !model.has_node(n)) {
            errors.push(BudgetError::UnknownNode {
                setting: SettingKey::Order,
                node: node.clone(),
            });
        }
        if let Some(ms) = order.bound.max_wait_ms {
            if !(ms.is_finite() && ms > 0.0) {
                errors.push(BudgetError::BadMaxWait { value: ms });
            }
        }
        if order.bound.max_wait_steps == Some(0) {
            errors.push(BudgetError::ZeroSetting {
                setting: SettingKey::MaxWaitSteps,
            });
        }
    }

    /// A walk whose rows no step would take
    /// (`docs/budgets.md#a-walk-no-step-would-take`): a served walk a node's submodule
    /// can cut, with no budget there (overrides exist only where the model budgets), that is
    /// neither a member of a combined walk nor one itself, is refused when the node has another
    /// served walk with a budget that is no member either: an engine assembling that walk (the
    /// `mixed` of `prefill` + `decode`) would wait forever while the row queues, and the row would
    /// run only uncut. A node the model budgets nothing on runs such rows uncut by the model's
    /// decision, as the Python class documents; `no_chunking` nodes chunk nothing by the
    /// deployment's.
    fn check_walks_chunked(
        model: &ModelPolicies,
        settings: &BudgetSettings,
        members: &BTreeMap<Name, Vec<Name>>,
        errors: &mut Vec<BudgetError>,
    ) {
        let standalone = |w: &Name| {
            settings.walks.contains(w)
                && !settings.combined_walk_of.contains_key(w)
                && !members.contains_key(w)
        };
        for node in model.nodes() {
            if settings.no_chunking.contains(node) {
                continue;
            }
            let Some(caps) = model.submodule(node) else {
                continue;
            };
            for walk in caps.chunkable_walks.iter().filter(|w| standalone(w)) {
                if model.policy(node, walk).max_batch_tokens.is_some() {
                    continue;
                }
                let taker = model
                    .budgeted_walks(node)
                    .find(|w| *w != walk && standalone(w));
                if let Some(combined) = taker {
                    errors.push(BudgetError::WalkNeverChunked {
                        node: node.clone(),
                        walk: walk.clone(),
                        combined: combined.clone(),
                    });
                }
            }
        }
    }

    /// Validates `chunking.max_step_ms` and `chunking.cost` (`docs/cost-model.md#time-budgets`):
    /// the same refusals as token budgets where a value would do nothing, plus non-finite or
    /// non-positive values and a time budget without a latency model. Returns the accepted
    /// `(node, walk) -> ms` (`None`: off).
    fn check_time_budgets(
        model: &ModelPolicies,
        settings: &BudgetSettings,
        overrides: &BTreeMap<(Name, Name), Option<u32>>,
        errors: &mut Vec<BudgetError>,
    ) -> BTreeMap<(Name, Name), Option<f64>> {
        let time = &settings.time;
        for node in time.cost.keys().filter(|n| !model.has_node(n)) {
            errors.push(BudgetError::UnknownNode {
                setting: SettingKey::Cost,
                node: node.clone(),
            });
        }
        let token_budget =
            |node: &Name, walk: &Name| match overrides.get(&(node.clone(), walk.clone())) {
                Some(over) => *over,
                None => model.policy(node, walk).max_batch_tokens,
            };
        let check =
            |node: &Name, walk: Option<&Name>, value, errors: &mut Vec<BudgetError>| match value {
                TimeBudget::Off => Some(None),
                TimeBudget::Ms(value) => match check_max_step_ms(value) {
                    Ok(ms) => Some(Some(ms)),
                    Err(_) => {
                        errors.push(BudgetError::BadTimeBudget {
                            node: node.clone(),
                            walk: walk.cloned(),
                            value,
                        });
                        None
                    }
                },
            };
        let refusal = |node: &Name, walk: &Name, ms: Option<&Option<f64>>| {
            let (node, walk) = (node.clone(), walk.clone());
            if !settings.walks.contains(&walk) {
                return Some(BudgetError::WalkNotServed {
                    setting: SettingKey::MaxStepMs,
                    node,
                    walk,
                });
            }
            if let Some(combined) = settings.combined_walk_of.get(&walk) {
                let combined = combined.clone();
                return Some(BudgetError::TimeMemberWalk {
                    node,
                    walk,
                    combined,
                });
            }
            let on = ms.is_some_and(Option::is_some);
            (on && token_budget(&node, &walk).is_none())
                .then_some(BudgetError::TimeBudgetDoesNothing { node, walk })
        };
        let accepted = expand(
            model,
            SettingKey::MaxStepMs,
            &time.max_step_ms,
            check,
            refusal,
            errors,
        );
        // A node-wide time budget applies to the walks the node budgets; when every step walk
        // among them is served with its token budget off, it would bound no step.
        for (node, value) in &time.max_step_ms {
            if !matches!(value, NodeSetting::All(TimeBudget::Ms(_)))
                || !model.has_node(node)
                || settings.no_chunking.contains(node)
            {
                continue;
            }
            let mut steps = model.budgeted_walks(node).filter(|w| {
                settings.walks.contains(*w) && !settings.combined_walk_of.contains_key(*w)
            });
            if let Some(first) = steps.next() {
                let all_off = token_budget(node, first).is_none()
                    && steps.all(|w| token_budget(node, w).is_none());
                if all_off {
                    errors.push(BudgetError::TimeBudgetWithoutTokenBudget {
                        node: node.clone(),
                        walk: first.clone(),
                    });
                }
            }
        }
        let needs_model: BTreeSet<&Name> = accepted
            .iter()
            .filter(|(_, ms)| ms.is_some())
            .map(|((node, _), _)| node)
            .collect();
        for node in needs_model {
            if !time.learn && !time.cost.contains_key(node) {
                errors.push(BudgetError::NoLatencyModel { node: node.clone() });
            }
        }
        for (node, m) in &time.cost {
            if m.terms() == [0.0; crate::latency::TERMS] {
                errors.push(BudgetError::ZeroLatencyModel { node: node.clone() });
            }
            let keys = crate::latency::TERM_KEYS;
            if let Some((key, value)) = keys
                .into_iter()
                .zip(m.terms())
                .find(|&(_, v)| v > crate::latency::MAX_COEFFICIENT_MS)
            {
                errors.push(BudgetError::LatencyModelTooLarge {
                    node: node.clone(),
                    key,
                    value,
                });
            }
        }
        if let Some(q) = time.margin_quantile {
            if !(q > 0.0 && q <= 1.0) {
                errors.push(BudgetError::BadTimeMargin { value: q });
            } else if !accepted.values().any(Option::is_some) {
                errors.push(BudgetError::TimeMarginWithoutBudget);
            }
        }
        // Against the configured model only: a learned one is not known at load (the replay
        // reports a time budget that was not in force, docs/replay.md).
        for ((node, walk), ms) in &accepted {
            let (Some(ms), Some(m)) = (ms, time.cost.get(node)) else {
                continue;
            };
            if *ms < m.base_ms() {
                errors.push(BudgetError::TimeBudgetBelowBase {
                    node: node.clone(),
                    walk: walk.clone(),
                    max_step_ms: *ms,
                    base_ms: m.base_ms(),
                });
            }
        }
        accepted
    }

    /// Why a per-walk override of `node`/`walk` is refused, if it is: a walk not served, a member
    /// walk's budget on a node that cannot use it, or a walk the model does not budget there.
    fn walk_refusal(
        model: &ModelPolicies,
        settings: &BudgetSettings,
        node: &Name,
        walk: &Name,
    ) -> Option<BudgetError> {
        let (node, walk) = (node.clone(), walk.clone());
        if !settings.walks.contains(&walk) {
            return Some(BudgetError::WalkNotServed {
                setting: SettingKey::MaxBatchTokens,
                node,
                walk,
            });
        }
        if let Some(combined) = settings.combined_walk_of.get(&walk) {
            if !settings.override_mixed.contains(&node) {
                let combined = combined.clone();
                return Some(BudgetError::MemberWalk {
                    node,
                    walk,
                    combined,
                });
            }
        }
        if model.policy(&node, &walk).max_batch_tokens.is_none() {
            return Some(BudgetError::WalkNotBudgeted { node, walk });
        }
        None
    }

    /// The model's policies this table is layered on.
    pub fn model(&self) -> &Arc<ModelPolicies> {
        &self.model
    }

    /// The accepted settings.
    pub fn settings(&self) -> &BudgetSettings {
        &self.settings
    }

    /// The model's declared policy, or `NO_CHUNKING`.
    pub fn policy(&self, node: &str, walk: &str) -> ChunkingPolicy {
        self.model.policy(node, walk)
    }

    /// The budget a step of `node`/`walk` runs under: `None` on a `no_chunking` node; else the
    /// override for that walk (off gives `None`); else the policy's budget.
    pub fn max_batch_tokens(&self, node: &str, walk: &str) -> Option<u32> {
        if self.settings.no_chunking.contains(node) {
            return None;
        }
        match self.overrides.get(&(Name::from(node), Name::from(walk))) {
            Some(over) => *over,
            None => self.model.policy(node, walk).max_batch_tokens,
        }
    }

    /// The time budget a step of `node`/`walk` is planned under, in ms: `None` without one,
    /// on a `no_chunking` node, or where the step has no token budget (nothing is cut).
    pub fn max_step_ms(&self, node: &str, walk: &str) -> Option<f64> {
        self.max_batch_tokens(node, walk)?;
        self.step_ms
            .get(&(Name::from(node), Name::from(walk)))
            .copied()
            .flatten()
    }

    /// The order of `node`'s waiting prompts and the starvation bound.
    pub fn order(&self, node: &str) -> NodeOrder {
        self.settings.order.of(node)
    }

    /// The latency model configured for `node` (`chunking.cost.<node>`), if any.
    pub fn cost(&self, node: &str) -> Option<LatencyModel> {
        self.settings.time.cost.get(node).copied()
    }

    /// Whether rows of `walk` can be cut on `node`: the submodule's say, unless the budget is
    /// off or none, or the node is `no_chunking`.
    pub fn chunkable(&self, node: &str, walk: &str) -> bool {
        self.max_batch_tokens(node, walk).is_some()
            && self
                .model
                .submodule(node)
                .is_some_and(|s| s.chunkable_walks.contains(walk))
    }

    /// The fewest tokens a row is cut to under `budget`: the floor, or the budget when smaller.
    pub fn min_chunk_tokens(&self, budget: u32) -> u32 {
        self.settings.min_chunk_tokens.min(budget)
    }

    /// The member walks of a combined walk (empty for a plain walk).
    pub fn members(&self, walk: &str) -> &[Name] {
        self.members
            .get(walk)
            .map(Vec::as_slice)
            .unwrap_or_default()
    }

    /// The combined walk `walk` runs inside, if any.
    pub fn combined_walk_of(&self, walk: &str) -> Option<&Name> {
        self.settings.combined_walk_of.get(walk)
    }

    /// Under a combined walk on an `override_mixed` node (not `no_chunking`, with a budget):
    /// member walk -> the most tokens its rows may run in one step, for each member walk with a
    /// budget of its own. `None` otherwise.
    pub fn walk_caps(&self, node: &str, walk: &str) -> Option<BTreeMap<Name, u32>> {
        let members = self.members.get(walk)?;
        if !self.settings.override_mixed.contains(node)
            || self.max_batch_tokens(node, walk).is_none()
        {
            return None;
        }
        Some(
            members
                .iter()
                .filter_map(|m| Some((m.clone(), self.max_batch_tokens(node, m)?)))
                .collect(),
        )
    }
}

/// Expands per-node settings into `(node, walk) -> accepted value`, the one walk for all of
/// `setting` (`max_batch_tokens`, `max_step_ms`): a node the model does not have is refused
/// (`UnknownNode`); a node-wide value goes to every walk the model budgets on the node (none
/// there: `NodeBudgetsNothing`); a per-walk value goes to its walk unless `refusal` says why
/// not. `accept` turns a written value into the accepted one, or refuses it (`None`, having said
/// why); `refusal` sees the accepted value, if any.
fn expand<V: Copy, T: Copy>(
    model: &ModelPolicies,
    setting: SettingKey,
    nodes: &BTreeMap<Name, NodeSetting<V>>,
    accept: impl Fn(&Name, Option<&Name>, V, &mut Vec<BudgetError>) -> Option<T>,
    refusal: impl Fn(&Name, &Name, Option<&T>) -> Option<BudgetError>,
    errors: &mut Vec<BudgetError>,
) -> BTreeMap<(Name, Name), T> {
    let mut accepted = BTreeMap::new();
    for (node, values) in nodes {
        if !model.has_node(node) {
            errors.push(BudgetError::UnknownNode {
                setting,
                node: node.clone(),
            });
            continue;
        }
        match values {
            NodeSetting::All(value) => {
                let walks: Vec<Name> = model.budgeted_walks(node).cloned().collect();
                if walks.is_empty() {
                    errors.push(BudgetError::NodeBudgetsNothing {
                        setting,
                        node: node.clone(),
                    });
                }
                if let Some(v) = accept(node, None, *value, errors) {
                    for walk in walks {
                        accepted.insert((node.clone(), walk), v);
                    }
                }
            }
            NodeSetting::PerWalk(walks) => {
                for (walk, value) in walks {
                    let v = accept(node, Some(walk), *value, errors);
                    match (refusal(node, walk, v.as_ref()), v) {
                        (Some(e), _) => errors.push(e),
                        (None, Some(v)) => {
                            accepted.insert((node.clone(), walk.clone()), v);
                        }
                        (None, None) => {}
                    }
                }
            }
        }
    }
    accepted
}

#[cfg(test)]
mod tests;
