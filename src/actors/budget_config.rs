//! BudgetConfig: the accepted serving settings. Validates a new setting whole and publishes an
//! immutable snapshot to its subscribers (the Scheduler) on every accepted change.

use std::sync::Arc;

use actix::prelude::*;

use crate::budget::{BudgetSettings, BudgetTable};
use crate::error::ChunkingError;
use crate::metrics::Instance;
use crate::policy::ModelPolicies;
use crate::snapshot::BudgetSnapshot;

/// Owns the budget table; the last accepted snapshot is what every new step is planned under.
pub(crate) struct BudgetConfig {
    snapshot: Option<Arc<BudgetSnapshot>>,
    subscribers: Vec<Recipient<UseSnapshot>>,
    instance: Instance,
    /// Whether a `set_budgets` was accepted: later ones are reloads (counted), the first is not.
    configured: bool,
}

impl BudgetConfig {
    pub(crate) fn new(instance: Instance) -> Self {
        Self {
            snapshot: None,
            subscribers: Vec::new(),
            instance,
            configured: false,
        }
    }

    /// Counts a `set_budgets` after the first accepted one as a reload.
    fn count_reload(&self, ok: bool) {
        if self.configured {
            self.instance.record_reload(ok);
        }
    }

    fn publish(&mut self, table: BudgetTable) -> Arc<BudgetSnapshot> {
        let generation = self.snapshot.as_ref().map_or(1, |s| s.generation() + 1);
        let snapshot = Arc::new(BudgetSnapshot::new(table, generation));
        let table = snapshot.table();
        for node in table.model().nodes() {
            for walk in &table.settings().walks {
                self.instance
                    .set_budget(node, walk, table.max_batch_tokens(node, walk));
            }
        }
        for s in &self.subscribers {
            s.do_send(UseSnapshot(snapshot.clone()));
        }
        self.snapshot = Some(snapshot.clone());
        snapshot
    }
}

impl Actor for BudgetConfig {
    type Context = Context<Self>;
}

super::supervised!(BudgetConfig, "BudgetConfig", [SetBudgets, GetSnapshot]);

/// The scheduler's new snapshot, effective from its next assembled step.
#[derive(Message, Clone)]
#[rtype(result = "()")]
pub(crate) struct UseSnapshot(pub(crate) Arc<BudgetSnapshot>);

/// Binds the model's policies (from PolicyRegistry): budgets are the policies' until set.
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct BindPolicies(pub(crate) Arc<ModelPolicies>);

impl Handler<BindPolicies> for BudgetConfig {
    type Result = ();

    fn handle(&mut self, msg: BindPolicies, _: &mut Self::Context) {
        self.publish(BudgetTable::from_policies(msg.0));
    }
}

/// Applies a serving setting whole, or refuses it whole (the previous one stays in force).
#[derive(Message)]
#[rtype(result = "Result<Arc<BudgetSnapshot>, ChunkingError>")]
pub(crate) struct SetBudgets(pub(crate) BudgetSettings);

impl Handler<SetBudgets> for BudgetConfig {
    type Result = Result<Arc<BudgetSnapshot>, ChunkingError>;

    fn handle(&mut self, msg: SetBudgets, _: &mut Self::Context) -> Self::Result {
        let Some(current) = &self.snapshot else {
            return Err(ChunkingError::PoliciesNotSet);
        };
        match current.table().with_settings(msg.0) {
            Ok(table) => {
                self.count_reload(true);
                self.configured = true;
                Ok(self.publish(table))
            }
            Err(e) => {
                self.count_reload(false);
                tracing::warn!(errors = %e, "serving config refused; the previous budgets stay in force");
                Err(e.into())
            }
        }
    }
}

/// The current snapshot, if policies are bound.
#[derive(Message)]
#[rtype(result = "Result<Arc<BudgetSnapshot>, ChunkingError>")]
pub(crate) struct GetSnapshot;

impl Handler<GetSnapshot> for BudgetConfig {
    type Result = Result<Arc<BudgetSnapshot>, ChunkingError>;

    fn handle(&mut self, _: GetSnapshot, _: &mut Self::Context) -> Self::Result {
        self.snapshot.clone().ok_or(ChunkingError::PoliciesNotSet)
    }
}

/// Subscribes to snapshots; the subscriber gets the current one at once.
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct Subscribe(pub(crate) Recipient<UseSnapshot>);

impl Handler<Subscribe> for BudgetConfig {
    type Result = ();

    fn handle(&mut self, msg: Subscribe, _: &mut Self::Context) {
        if let Some(s) = &self.snapshot {
            msg.0.do_send(UseSnapshot(s.clone()));
        }
        self.subscribers.push(msg.0);
    }
}
