//! ChunkingManagement: the one handle an embedding engine holds, with the original class's
//! methods plus the scheduler's admit / continue / assemble / complete.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use actix::dev::ToEnvelope;
use actix::prelude::*;

use super::*;
use crate::budget::BudgetSettings;
use crate::error::ChunkingError;
use crate::overrun::{Overrun, OverrunReason, StepTokens};
use crate::policy::{ChunkingPolicy, ModelPolicies, SubmoduleCaps};
use crate::prepared::PreparedInput;
use crate::scheduler::{Batch, StepOutcome};
use crate::snapshot::BudgetSnapshot;
use crate::Name;

/// How long the facade waits for an actor's answer before returning an error.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// A cheap-to-clone handle to the chunking actors. Every method is async and must be called from
/// inside an actix system (the actors run on the arbiter [`ChunkingManagement::start`] ran on).
#[derive(Clone)]
pub struct ChunkingManagement {
    submodules: Arc<BTreeMap<Name, SubmoduleCaps>>,
    policies: Addr<PolicyRegistry>,
    budgets: Addr<BudgetConfig>,
    prepared: Addr<PreparedInputs>,
    overruns: Addr<OverrunAccounting>,
    scheduler: Addr<Scheduler>,
    timeout: Duration,
}

/// Sends `msg` to `actor` and waits at most `timeout` for the answer. A panic while handling it
/// (the actor restarts), a stopped actor or a timeout are errors, never a hang.
async fn ask<A, M>(
    addr: &Addr<A>,
    actor: &'static str,
    timeout: Duration,
    msg: M,
) -> Result<M::Result, ChunkingError>
where
    A: Actor + Handler<Guarded<M>>,
    A::Context: ToEnvelope<A, Guarded<M>>,
    M: Message + Send + 'static,
    M::Result: Send + 'static,
{
    addr.send(Guarded(msg))
        .timeout(timeout)
        .await
        .map_err(|e| ChunkingError::ActorUnavailable {
            actor,
            reason: e.to_string(),
        })?
}

impl ChunkingManagement {
    /// `node` as the model names it: the submodule's `Arc` when it has one (no allocation per
    /// request), else a new name (the Scheduler refuses it as unknown).
    fn node_name(&self, node: &str) -> Name {
        self.submodules
            .get_key_value(node)
            .map_or_else(|| Name::from(node), |(name, _)| name.clone())
    }

    /// Starts the actors on the current arbiter for a model with these node submodules.
    pub fn start<I, S>(submodules: I) -> Self
    where
        I: IntoIterator<Item = (S, SubmoduleCaps)>,
        S: AsRef<str>,
    {
        let submodules: BTreeMap<Name, SubmoduleCaps> = submodules
            .into_iter()
            .map(|(n, c)| (Name::from(n.as_ref()), c))
            .collect();
        // Supervised: an actor that panics is restarted with its state, on this arbiter.
        let budgets = Supervisor::start(|_| BudgetConfig::default());
        let policies = {
            let budgets = budgets.clone();
            Supervisor::start(move |_| PolicyRegistry::new(budgets))
        };
        let prepared = Supervisor::start(|_| PreparedInputs::default());
        let overruns = Supervisor::start(|_| OverrunAccounting::default());
        let scheduler = {
            let (prepared, overruns) = (prepared.clone(), overruns.clone());
            Supervisor::start(move |_| Scheduler::new(prepared, overruns))
        };
        budgets.do_send(Subscribe(scheduler.clone().recipient()));
        Self {
            submodules: Arc::new(submodules),
            policies,
            budgets,
            prepared,
            overruns,
            scheduler,
            timeout: DEFAULT_REQUEST_TIMEOUT,
        }
    }

    /// The same handle with another request timeout.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Binds the model's chunking policies, `(node, walk) -> policy`, once at load.
    ///
    /// # Errors
    /// A policy on a node without a submodule, a zero budget or align, or different policies
    /// than those already bound.
    pub async fn set_policies<I, S>(&self, policies: I) -> Result<(), ChunkingError>
    where
        I: IntoIterator<Item = ((S, S), ChunkingPolicy)>,
        S: AsRef<str>,
    {
        let policies = policies
            .into_iter()
            .map(|((n, w), p)| ((Name::from(n.as_ref()), Name::from(w.as_ref())), p))
            .collect();
        let model = ModelPolicies::new((*self.submodules).clone(), policies)
            .map_err(ChunkingError::Policy)?;
        ask(
            &self.policies,
            "PolicyRegistry",
            self.timeout,
            SetPolicies(model),
        )
        .await??;
        Ok(())
    }

    /// Applies a serving config on top of the policies, whole; on error nothing changes.
    ///
    /// # Errors
    /// Every refusal of SPEC §4, or no policies bound yet.
    pub async fn set_budgets(&self, settings: BudgetSettings) -> Result<(), ChunkingError> {
        ask(
            &self.budgets,
            "BudgetConfig",
            self.timeout,
            SetBudgets(settings),
        )
        .await??;
        Ok(())
    }

    /// Applies new serving settings while running: the same as [`ChunkingManagement::set_budgets`],
    /// named for the hot-reload path. Effective from the next assembled step; a step in flight
    /// is checked against the budget it was scheduled under. [`crate::reload::Reloader`]
    /// re-reads the layered config files and calls this.
    ///
    /// # Errors
    /// As `set_budgets`; the previous budgets stay.
    pub async fn reload(&self, settings: BudgetSettings) -> Result<(), ChunkingError> {
        self.set_budgets(settings).await
    }

    /// The current budget snapshot (all budget answers at once).
    ///
    /// # Errors
    /// No policies bound yet, or the actor did not answer.
    pub async fn snapshot(&self) -> Result<Arc<BudgetSnapshot>, ChunkingError> {
        ask(&self.budgets, "BudgetConfig", self.timeout, GetSnapshot)
            .await?
            .ok_or(ChunkingError::PoliciesNotSet)
    }

    /// The model's declared policy for `node`/`walk`, or `NO_CHUNKING`.
    ///
    /// # Errors
    /// No policies bound yet, or the actor did not answer.
    pub async fn policy(&self, node: &str, walk: &str) -> Result<ChunkingPolicy, ChunkingError> {
        let model = ask(&self.policies, "PolicyRegistry", self.timeout, GetPolicies)
            .await?
            .ok_or(ChunkingError::PoliciesNotSet)?;
        Ok(model.policy(node, walk))
    }

    /// The budget steps of `node`/`walk` run under.
    ///
    /// # Errors
    /// No policies bound yet, or the actor did not answer.
    pub async fn max_batch_tokens(
        &self,
        node: &str,
        walk: &str,
    ) -> Result<Option<u32>, ChunkingError> {
        Ok(self.snapshot().await?.table().max_batch_tokens(node, walk))
    }

    /// Whether rows of `walk` can be cut on `node`.
    ///
    /// # Errors
    /// No policies bound yet, or the actor did not answer.
    pub async fn chunkable(&self, node: &str, walk: &str) -> Result<bool, ChunkingError> {
        Ok(self.snapshot().await?.table().chunkable(node, walk))
    }

    /// The fewest tokens a row is cut to under `budget`.
    ///
    /// # Errors
    /// No policies bound yet, or the actor did not answer.
    pub async fn min_chunk_tokens(&self, budget: u32) -> Result<u32, ChunkingError> {
        Ok(self.snapshot().await?.table().min_chunk_tokens(budget))
    }

    /// Member walk caps of a combined walk on an `override_mixed` node.
    ///
    /// # Errors
    /// No policies bound yet, or the actor did not answer.
    pub async fn walk_caps(
        &self,
        node: &str,
        walk: &str,
    ) -> Result<Option<BTreeMap<Name, u32>>, ChunkingError> {
        Ok(self.snapshot().await?.table().walk_caps(node, walk))
    }

    /// Admits a prompt: holds its whole prepared input and queues its row at `node` for `walk`,
    /// `cached` tokens of it a cached prefix (clamped to leave the last token to run).
    ///
    /// # Errors
    /// Unknown node or walk, an empty or oversized input, or `(rid, node)` already queued.
    pub async fn admit(
        &self,
        rid: u64,
        node: &str,
        walk: &str,
        input: PreparedInput,
        cached: u32,
    ) -> Result<(), ChunkingError> {
        let admit = AdmitPrepared {
            rid,
            node: self.node_name(node),
            walk: walk.into(),
            input,
            cached,
        };
        ask(&self.scheduler, "Scheduler", self.timeout, admit).await?
    }

    /// Keeps a continuing row of `rid` (decode, speculative verify) queued at `node`: it runs
    /// `estimate` tokens (1, or `k + 1` for `k` speculative tokens) in every step it fits, until
    /// [`ChunkingManagement::finish_row`] or [`ChunkingManagement::forget_request`]. Calling it
    /// again updates the estimate.
    ///
    /// # Errors
    /// Unknown node or walk, a zero estimate, or `rid` still prefilling there.
    pub async fn continue_row(
        &self,
        rid: u64,
        node: &str,
        walk: &str,
        estimate: u32,
    ) -> Result<(), ChunkingError> {
        let msg = ContinueRow {
            rid,
            node: self.node_name(node),
            walk: walk.into(),
            estimate,
        };
        ask(&self.scheduler, "Scheduler", self.timeout, msg).await?
    }

    /// Drops the continuing row of `rid` at `node` (its request finished). Unknown rows: no-op.
    ///
    /// # Errors
    /// The actor did not answer.
    pub async fn finish_row(&self, rid: u64, node: &str) -> Result<bool, ChunkingError> {
        ask(
            &self.scheduler,
            "Scheduler",
            self.timeout,
            Finish {
                rid,
                node: self.node_name(node),
            },
        )
        .await
    }

    /// Assembles the next step of `node`/`walk`, with every chunk's input cut from its prepared
    /// input.
    ///
    /// # Errors
    /// Unknown node or walk, no policies bound, a step of `node` still in flight, or a prepared
    /// input forgotten meanwhile (the step is abandoned; assemble again).
    pub async fn assemble(&self, node: &str, walk: &str) -> Result<Batch, ChunkingError> {
        let msg = Assemble {
            node: self.node_name(node),
            walk: walk.into(),
        };
        ask(&self.scheduler, "Scheduler", self.timeout, msg).await?
    }

    /// Completes a step: `ran[i]` is the tokens row `i` of its batch actually ran. Checks them
    /// against the budget the step was scheduled under (counting an overrun), advances each
    /// chunk's row and releases the inputs of rows whose final chunk ran.
    ///
    /// # Errors
    /// The step is not in flight, or `ran` does not have one entry per row.
    pub async fn complete(&self, step: u64, ran: Vec<u32>) -> Result<StepOutcome, ChunkingError> {
        ask(
            &self.scheduler,
            "Scheduler",
            self.timeout,
            Complete { step, ran },
        )
        .await?
    }

    /// Checks a batch against the budget it was scheduled under, with the tokens each row
    /// actually ran (`node_inputs`); counts and returns the overrun, if any. [`complete`]
    /// does this itself: call this only for steps run outside the scheduler.
    ///
    /// [`complete`]: ChunkingManagement::complete
    ///
    /// # Errors
    /// `ran` does not have one entry per row, or the actor did not answer.
    pub async fn check_budget(
        &self,
        batch: &Batch,
        ran: &[u32],
    ) -> Result<Option<Overrun>, ChunkingError> {
        if ran.len() != batch.rows.len() {
            return Err(ChunkingError::RanLengthMismatch {
                step: batch.step,
                expected: batch.rows.len(),
                got: ran.len(),
            });
        }
        let mut tokens = StepTokens::planned(
            batch.budget,
            batch.scheduled_tokens,
            batch.uncut_over_budget,
        );
        for (row, &r) in batch.rows.iter().zip(ran) {
            tokens.add_row(&row.work, r);
        }
        let msg = CheckStep {
            node: batch.node.clone(),
            walk: batch.walk.clone(),
            tokens,
        };
        ask(&self.overruns, "OverrunAccounting", self.timeout, msg).await
    }

    /// Drops a row's whole input and its queue entry at `node` (after its last chunk landed, or
    /// to drop it early). Unknown rows are a no-op; answers whether an input was held.
    ///
    /// # Errors
    /// An actor did not answer.
    pub async fn release(&self, rid: u64, node: &str) -> Result<bool, ChunkingError> {
        let node = Name::from(node);
        ask(
            &self.scheduler,
            "Scheduler",
            self.timeout,
            ForgetRow {
                rid,
                node: node.clone(),
            },
        )
        .await?;
        ask(
            &self.prepared,
            "PreparedInputs",
            self.timeout,
            ReleaseOne { rid, node },
        )
        .await
    }

    /// Drops every node's prepared input and queue entries of `rid` (an aborted request), at any
    /// time. Rows of `rid` in a step in flight run but do not advance. Unknown rids: no-op.
    ///
    /// # Errors
    /// An actor did not answer.
    pub async fn forget_request(&self, rid: u64) -> Result<(), ChunkingError> {
        ask(
            &self.scheduler,
            "Scheduler",
            self.timeout,
            ForgetRequest(rid),
        )
        .await?;
        ask(
            &self.prepared,
            "PreparedInputs",
            self.timeout,
            ForgetInputs(rid),
        )
        .await?;
        Ok(())
    }

    /// The whole prepared input held for `(rid, node)`.
    ///
    /// # Errors
    /// The actor did not answer.
    pub async fn prepared(
        &self,
        rid: u64,
        node: &str,
    ) -> Result<Option<PreparedInput>, ChunkingError> {
        ask(
            &self.prepared,
            "PreparedInputs",
            self.timeout,
            GetPrepared {
                rid,
                node: node.into(),
            },
        )
        .await
    }

    /// Rows and tokens of prepared inputs held over all nodes.
    ///
    /// # Errors
    /// The actor did not answer.
    pub async fn prepared_totals(&self) -> Result<(usize, u64), ChunkingError> {
        let t = ask(
            &self.prepared,
            "PreparedInputs",
            self.timeout,
            PreparedTotals,
        )
        .await?;
        Ok((t.rows, t.tokens))
    }

    /// Prefill rows queued over all nodes, and steps in flight.
    ///
    /// # Errors
    /// The actor did not answer.
    pub async fn scheduler_stats(&self) -> Result<(usize, usize), ChunkingError> {
        let s = ask(&self.scheduler, "Scheduler", self.timeout, SchedulerStats).await?;
        Ok((s.prefill_rows, s.steps_in_flight))
    }

    /// Makes one actor panic inside a handler, to exercise supervision: the call returns
    /// [`ChunkingError::ActorPanicked`] and the actor is restarted with its state.
    ///
    /// # Errors
    /// Always the panic's error (or the actor's unavailability).
    pub async fn inject_panic(&self, actor: ActorKind) -> Result<(), ChunkingError> {
        let t = self.timeout;
        match actor {
            ActorKind::PolicyRegistry => {
                ask(&self.policies, "PolicyRegistry", t, InjectPanic).await
            }
            ActorKind::BudgetConfig => ask(&self.budgets, "BudgetConfig", t, InjectPanic).await,
            ActorKind::PreparedInputs => {
                ask(&self.prepared, "PreparedInputs", t, InjectPanic).await
            }
            ActorKind::OverrunAccounting => {
                ask(&self.overruns, "OverrunAccounting", t, InjectPanic).await
            }
            ActorKind::Scheduler => ask(&self.scheduler, "Scheduler", t, InjectPanic).await,
        }
    }

    /// Overruns counted for `node`/`walk`, for one reason or (`None`) all.
    ///
    /// # Errors
    /// The actor did not answer.
    pub async fn overrun_count(
        &self,
        node: &str,
        walk: &str,
        reason: Option<OverrunReason>,
    ) -> Result<u64, ChunkingError> {
        let msg = OverrunCount {
            node: node.into(),
            walk: walk.into(),
            reason,
        };
        ask(&self.overruns, "OverrunAccounting", self.timeout, msg).await
    }
}
