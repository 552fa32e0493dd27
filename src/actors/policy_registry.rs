//! PolicyRegistry: the model's policies and submodule capabilities, bound once at load.

use std::sync::Arc;

use actix::prelude::*;

use super::budget_config::{BindPolicies, BudgetConfig};
use crate::error::ChunkingError;
use crate::policy::{ModelPolicies, PolicyError};

/// Holds the model's policies and hands them to BudgetConfig, which layers budgets on them.
pub(crate) struct PolicyRegistry {
    policies: Option<Arc<ModelPolicies>>,
    budget_config: Addr<BudgetConfig>,
}

impl PolicyRegistry {
    pub(crate) fn new(budget_config: Addr<BudgetConfig>) -> Self {
        Self {
            policies: None,
            budget_config,
        }
    }
}

impl Actor for PolicyRegistry {
    type Context = Context<Self>;
}

super::supervised!(PolicyRegistry, "PolicyRegistry", [SetPolicies, GetPolicies]);

/// Binds the model's policies. Binding the same policies again is a no-op; different ones are
/// refused, since a model's policies are fixed at load.
#[derive(Message)]
#[rtype(result = "Result<Arc<ModelPolicies>, ChunkingError>")]
pub(crate) struct SetPolicies(pub(crate) ModelPolicies);

impl Handler<SetPolicies> for PolicyRegistry {
    type Result = Result<Arc<ModelPolicies>, ChunkingError>;

    fn handle(&mut self, msg: SetPolicies, _: &mut Self::Context) -> Self::Result {
        if let Some(bound) = &self.policies {
            if **bound == msg.0 {
                return Ok(bound.clone());
            }
            return Err(ChunkingError::Policy(vec![PolicyError::AlreadyBound]));
        }
        let policies = Arc::new(msg.0);
        self.policies = Some(policies.clone());
        // Mailbox order makes the binding visible before any later message from the caller.
        self.budget_config.do_send(BindPolicies(policies.clone()));
        Ok(policies)
    }
}

/// The bound policies, if any.
#[derive(Message)]
#[rtype(result = "Result<Arc<ModelPolicies>, ChunkingError>")]
pub(crate) struct GetPolicies;

impl Handler<GetPolicies> for PolicyRegistry {
    type Result = Result<Arc<ModelPolicies>, ChunkingError>;

    fn handle(&mut self, _: GetPolicies, _: &mut Self::Context) -> Self::Result {
        self.policies.clone().ok_or(ChunkingError::PoliciesNotSet)
    }
}
