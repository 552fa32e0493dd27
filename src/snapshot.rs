//! The immutable budget snapshot the BudgetConfig actor publishes on every accepted change: the
//! budget table plus the [`StepParams`] of every `(node, walk)`, so that assembling a step costs
//! one lookup and no message per row.

use std::collections::BTreeSet;
use std::sync::Arc;

use rustc_hash::FxHashMap;

use crate::budget::BudgetTable;
use crate::planner::StepParams;
use crate::policy::Name;

/// Budgets as of one accepted setting. Shared read-only as `Arc<BudgetSnapshot>`.
#[derive(Debug)]
pub struct BudgetSnapshot {
    table: BudgetTable,
    /// Increases with every accepted setting; a step records the generation it was planned under.
    generation: u64,
    /// `node -> walk -> params`, for every node and every walk the model or the settings name.
    params: FxHashMap<Name, FxHashMap<Name, Arc<StepParams>>>,
}

impl BudgetSnapshot {
    /// Precomputes the step parameters of every `(node, walk)` of `table`.
    pub(crate) fn new(table: BudgetTable, generation: u64) -> Self {
        let mut walks = table.model().walks();
        walks.extend(table.settings().walks.iter().cloned());
        let mut params: FxHashMap<Name, FxHashMap<Name, Arc<StepParams>>> = FxHashMap::default();
        for node in table.model().nodes() {
            let per_walk = params.entry(node.clone()).or_default();
            for walk in &walks {
                per_walk.insert(
                    walk.clone(),
                    Arc::new(step_params(&table, node, walk, &walks)),
                );
            }
        }
        Self {
            table,
            generation,
            params,
        }
    }

    /// The budget table the snapshot was built from (the answers of docs/budgets.md#answers).
    pub fn table(&self) -> &BudgetTable {
        &self.table
    }

    /// The generation of the setting.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// The parameters of a step of `node`/`walk`, if the model has both.
    pub fn step_params(&self, node: &str, walk: &str) -> Option<&Arc<StepParams>> {
        self.params.get(node)?.get(walk)
    }

    /// The node's name as interned in the snapshot (pointer-equal across rows and steps).
    pub fn node_name(&self, node: &str) -> Option<&Name> {
        self.params.get_key_value(node).map(|(k, _)| k)
    }

    /// The walk's name as interned in the snapshot, if any node knows it.
    pub fn walk_name(&self, node: &str, walk: &str) -> Option<&Name> {
        self.params.get(node)?.get_key_value(walk).map(|(k, _)| k)
    }
}

/// `walks` interns the walk names: `eligible` holds the same `Arc`s as the snapshot's keys (which
/// queued rows carry), so the planner matches a row's walk by pointer.
fn step_params(
    table: &BudgetTable,
    node: &Name,
    walk: &Name,
    walks: &BTreeSet<Name>,
) -> StepParams {
    let budget = table.max_batch_tokens(node, walk);
    let settings = table.settings();
    let floor = budget.map_or(0, |b| {
        table
            .min_chunk_tokens(b)
            .min(settings.max_row_tokens.unwrap_or(u32::MAX))
    });
    let caps: Arc<[(Name, u32)]> = table
        .walk_caps(node, walk)
        .map(|c| c.into_iter().collect())
        .unwrap_or_else(|| Arc::from(Vec::new()));
    let mut eligible = vec![walk.clone()];
    eligible.extend(
        table
            .members(walk)
            .iter()
            .map(|m| walks.get(m).unwrap_or(m).clone()),
    );
    StepParams {
        node: node.clone(),
        walk: walk.clone(),
        budget,
        floor,
        caps,
        chunkable: table.chunkable(node, walk),
        align: table.policy(node, walk).align.max(1),
        eligible: eligible.into(),
        max_row_tokens: settings.max_row_tokens,
        max_partial_prefills: settings.max_partial_prefills,
        slots_per_row: settings.slots_per_row,
        max_step_ms: table.max_step_ms(node, walk),
        cost: table.cost(node),
        learn_cost: settings.time.learn,
        margin_quantile: settings.time.margin_quantile,
        order: table.order(node),
        floor_yield: settings.time.floor_yield(&settings.order),
    }
}
