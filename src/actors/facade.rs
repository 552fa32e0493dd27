//! ChunkingManagement: the one handle an embedding engine holds, with the Python class's
//! methods plus the scheduler's admit / continue / assemble / complete.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;

use super::budget_config::{BudgetConfig, GetSnapshot, SetBudgets};
use super::host::{ask, RequestTimeout};
use super::overrun_accounting::{CheckStep, OverrunAccounting, OverrunCount};
use super::policy_registry::{GetPolicies, PolicyRegistry, SetPolicies};
use super::prepared_inputs::{PreparedInputs, PreparedTotals};
use super::scheduler::{
    Abandon, AdmitPrepared, Assemble, BeginDrain, Complete, CompleteAndAssemble, ContinueRow,
    Drain, DrainReport, ForgetRequest, ForgetRow, GetLatencyModel, GetPrepared, MeasuredLate,
    QueueStats, Scheduler, SchedulerStats,
};
#[cfg(any(test, feature = "test-hooks"))]
use super::{ActorKind, InjectPanic};
use crate::budget::BudgetSettings;
use crate::error::ChunkingError;
use crate::metrics::Instance;
use crate::order::AdmitOptions;
use crate::overrun::{Overrun, OverrunReason};
use crate::policy::Name;
use crate::policy::{ChunkingPolicy, ModelPolicies, SubmoduleCaps};
use crate::prepared::PreparedInput;
#[cfg(doc)]
use crate::scheduler::NextStep;
use crate::scheduler::{Batch, Completed, LateMeasurement, LatencyModelReport, StepOutcome, Then};
use crate::snapshot::BudgetSnapshot;

/// How long the facade waits for an actor's answer before returning
/// [`ChunkingError::Timeout`].
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// A cheap-to-clone handle to one model's chunking actors (`Send + Sync`). Several may live in
/// one process: each has its own actors, state and metric series (labelled `model`).
///
/// # Runtime
/// [`ChunkingManagement::start`] starts the actors on the current actix arbiter, so it must be
/// called inside an actix System (`actix::System::new().block_on(..)`, `#[actix::main]`,
/// `#[actix::test]`). A tokio engine without an actix System uses
/// [`ChunkingManagement::start_on_own_thread`], which hosts the actors on a thread of their own.
/// The handle's methods can then be awaited from any runtime, with or without tokio's time
/// driver: request timeouts are timed on the actors' thread.
///
/// # The step lifecycle
/// One step per node is in flight at a time (`docs/step-lifecycle.md`):
/// [`assemble`](Self::assemble) plans it and answers the same batch again until it is
/// [`complete`](Self::complete)d or [`abandon`](Self::abandon)ed, so a dropped future loses
/// nothing; `complete` takes 0 (did not run) or the planned tokens for each chunk row. An
/// engine's loop assembles its first step, then makes one call a step,
/// [`complete_and_assemble`](Self::complete_and_assemble), which completes a step and answers
/// the next one's batch; a step time learned after the completion goes to
/// [`measured_late`](Self::measured_late).
///
/// ```
/// use mstar_chunking::{ChunkingManagement, ChunkingPolicy, PreparedInput, SubmoduleCaps};
///
/// actix::System::new().block_on(async {
///     let cm = ChunkingManagement::start("demo", [("llm", SubmoduleCaps::new(["prefill"], false))])?;
///     cm.set_policies([(("llm", "prefill"), ChunkingPolicy::budget(256))]).await?;
///     cm.admit(7, "llm", "prefill", PreparedInput::tokens((0..600).collect::<Vec<u32>>()), 0).await?;
///
///     let batch = cm.assemble("llm", "prefill").await?;
///     assert_eq!(batch.rows[0].tokens(), 256);
///     // The GPU failed this step: nothing ran, and the same chunk is planned again.
///     cm.complete(batch.step, vec![0], None).await?;
///     let again = cm.assemble("llm", "prefill").await?;
///     assert_eq!(again.rows[0].input.as_ref().unwrap().token_ids()[0], 0);
///     cm.complete(again.step, vec![256], None).await?;
///     Ok::<_, mstar_chunking::ChunkingError>(())
/// })?;
/// # Ok::<_, Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct ChunkingManagement {
    pub(super) submodules: Arc<BTreeMap<Name, SubmoduleCaps>>,
    pub(super) policies: Addr<PolicyRegistry>,
    pub(super) budgets: Addr<BudgetConfig>,
    pub(super) prepared: Addr<PreparedInputs>,
    pub(super) overruns: Addr<OverrunAccounting>,
    pub(super) scheduler: Addr<Scheduler>,
    pub(super) timeout: RequestTimeout,
    pub(super) model: Name,
    pub(super) metrics: Instance,
}

impl ChunkingManagement {
    /// `node` as the model names it: the submodule's `Arc` when it has one (no allocation per
    /// request), else a new name (the Scheduler refuses it as unknown).
    fn node_name(&self, node: &str) -> Name {
        self.submodules
            .get_key_value(node)
            .map_or_else(|| Name::from(node), |(name, _)| name.clone())
    }

    /// The value of this instance's `model` label.
    pub fn model(&self) -> &str {
        &self.model
    }

    /// Counts a reload that was refused before it reached [`ChunkingManagement::reload`] (its
    /// files did not load or validate) in `config_reloads_total{result="error"}`; reloads that
    /// reach the facade are counted by it.
    pub fn count_refused_reload(&self) {
        self.metrics.record_reload(false);
    }

    /// The same handle with another request timeout; `None` waits for every answer however
    /// long it takes (and needs no timer in the caller's runtime).
    pub fn with_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.timeout.after = timeout;
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
            &self.timeout,
            SetPolicies(model),
        )
        .await?;
        // PolicyRegistry handed the policies to BudgetConfig before answering; once BudgetConfig
        // answers a later message, it has published them to the Scheduler, so the caller's next
        // message (from any thread) finds them there.
        self.snapshot().await?;
        Ok(())
    }

    /// Applies a serving config on top of the policies, whole; on error nothing changes.
    ///
    /// ```
    /// # use mstar_chunking::{BudgetSettings, ChunkingManagement, ChunkingPolicy, SubmoduleCaps};
    /// use std::num::NonZeroU32;
    /// # actix::System::new().block_on(async {
    /// # let cm = ChunkingManagement::start("demo", [("llm", SubmoduleCaps::new(["prefill"], false))])?;
    /// # cm.set_policies([(("llm", "prefill"), ChunkingPolicy::budget(256))]).await?;
    /// let bad = BudgetSettings::new(["prefill"]).budget("ghost", NonZeroU32::new(64).unwrap());
    /// let err = cm.set_budgets(bad).await.unwrap_err();
    /// let problems = err.budget_errors().expect("a budget refusal");
    /// assert!(problems.to_string().contains("`ghost`"));
    /// assert_eq!(cm.max_batch_tokens("llm", "prefill").await?, Some(256), "nothing changed");
    /// # Ok::<_, mstar_chunking::ChunkingError>(())
    /// # })?;
    /// # Ok::<_, Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    /// Every refusal of `docs/budgets.md#refusals`, or no policies bound yet.
    pub async fn set_budgets(&self, settings: BudgetSettings) -> Result<(), ChunkingError> {
        ask(
            &self.budgets,
            "BudgetConfig",
            &self.timeout,
            SetBudgets(settings),
        )
        .await?;
        Ok(())
    }

    /// Applies new serving settings while running: the same as [`ChunkingManagement::set_budgets`],
    /// named for the hot-reload path. Effective from the next assembled step; a step in flight
    /// is checked against the budget it was scheduled under. `reload::Reloader` (`config` feature)
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
        ask(&self.budgets, "BudgetConfig", &self.timeout, GetSnapshot).await
    }

    /// The model's declared policy for `node`/`walk`, or `NO_CHUNKING`.
    ///
    /// # Errors
    /// No policies bound yet, or the actor did not answer.
    pub async fn policy(&self, node: &str, walk: &str) -> Result<ChunkingPolicy, ChunkingError> {
        let model = ask(&self.policies, "PolicyRegistry", &self.timeout, GetPolicies).await?;
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
        self.admit_with(rid, node, walk, input, AdmitOptions::cached(cached))
            .await
    }

    /// As [`admit`](Self::admit), with what the engine knows about the prompt beyond its
    /// input: its cached prefix, its priority (the `priority` order's, lower first) and its
    /// arrival time (the start of its wait for `chunking.max_wait_ms`).
    ///
    /// ```
    /// # use mstar_chunking::{AdmitOptions, BudgetSettings, ChunkingManagement, ChunkingPolicy, Order, PreparedInput, SubmoduleCaps};
    /// # actix::System::new().block_on(async {
    /// # let cm = ChunkingManagement::start("demo", [("llm", SubmoduleCaps::new(["prefill"], false))])?;
    /// # cm.set_policies([(("llm", "prefill"), ChunkingPolicy::budget(256))]).await?;
    /// cm.set_budgets(BudgetSettings::new(["prefill"]).order(Order::Priority)).await?;
    /// let low = AdmitOptions { priority: 5, arrival_ms: Some(0.0), ..AdmitOptions::default() };
    /// let high = AdmitOptions { priority: 0, arrival_ms: Some(1.0), ..AdmitOptions::default() };
    /// cm.admit_with(1, "llm", "prefill", PreparedInput::tokens(vec![1; 300]), low).await?;
    /// cm.admit_with(2, "llm", "prefill", PreparedInput::tokens(vec![2; 300]), high).await?;
    /// let batch = cm.assemble_at("llm", "prefill", 2.0).await?;
    /// assert_eq!(batch.rows[0].rid, 2, "the lower priority value starts first");
    /// # Ok::<_, mstar_chunking::ChunkingError>(())
    /// # })?;
    /// # Ok::<_, Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    /// As `admit`.
    pub async fn admit_with(
        &self,
        rid: u64,
        node: &str,
        walk: &str,
        input: PreparedInput,
        options: AdmitOptions,
    ) -> Result<(), ChunkingError> {
        let admit = AdmitPrepared {
            rid,
            node: self.node_name(node),
            walk: walk.into(),
            input,
            options,
        };
        ask(&self.scheduler, "Scheduler", &self.timeout, admit).await
    }

    /// Keeps a continuing row of `rid` (decode, speculative verify) queued at `node`: it runs
    /// `estimate` tokens (1, or `k + 1` for `k` speculative tokens) in every step it fits, until
    /// the request ends ([`ChunkingManagement::forget_request`]) or leaves the node
    /// ([`ChunkingManagement::release`]). Calling it again updates the estimate.
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
        self.continuing(rid, node, walk, estimate, None).await
    }

    /// As [`continue_row`](Self::continue_row), with the row's context in tokens (what it
    /// reads: its prompt and the tokens generated so far), for an engine that knows it better
    /// than the component does (a prompt prefilled elsewhere, a shared prefix). The context
    /// then grows by what the row runs in each completed step; the time-budget planner
    /// predicts with it (`docs/cost-model.md`).
    ///
    /// # Errors
    /// As `continue_row`.
    pub async fn continue_row_with_context(
        &self,
        rid: u64,
        node: &str,
        walk: &str,
        estimate: u32,
        context: u64,
    ) -> Result<(), ChunkingError> {
        self.continuing(rid, node, walk, estimate, Some(context))
            .await
    }

    async fn continuing(
        &self,
        rid: u64,
        node: &str,
        walk: &str,
        estimate: u32,
        context: Option<u64>,
    ) -> Result<(), ChunkingError> {
        let msg = ContinueRow {
            rid,
            node: self.node_name(node),
            walk: walk.into(),
            estimate,
            context,
        };
        ask(&self.scheduler, "Scheduler", &self.timeout, msg).await
    }

    /// Assembles the next step of `node`/`walk`, with every chunk's input cut from its prepared
    /// input. While that step is in flight (not completed, not abandoned), answers the same
    /// batch again: the same step number, rows and input views, so a dropped or timed-out
    /// future loses nothing.
    ///
    /// ```
    /// # use mstar_chunking::{ChunkingManagement, ChunkingPolicy, PreparedInput, SubmoduleCaps};
    /// # actix::System::new().block_on(async {
    /// # let cm = ChunkingManagement::start("demo", [("llm", SubmoduleCaps::new(["prefill"], false))])?;
    /// # cm.set_policies([(("llm", "prefill"), ChunkingPolicy::budget(256))]).await?;
    /// cm.admit(1, "llm", "prefill", PreparedInput::tokens(vec![1; 1000]), 0).await?;
    /// let first = cm.assemble("llm", "prefill").await?;
    /// let again = cm.assemble("llm", "prefill").await?; // e.g. after a timeout
    /// assert_eq!(first, again);
    /// # Ok::<_, mstar_chunking::ChunkingError>(())
    /// # })?;
    /// # Ok::<_, Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    /// Unknown node or walk, no policies bound, a step of `node` in flight under another walk,
    /// or (a guard that should never fire) a chunk row without its prepared input, which is
    /// dropped with the step abandoned (`MissingPreparedInput`; assemble again).
    pub async fn assemble(&self, node: &str, walk: &str) -> Result<Arc<Batch>, ChunkingError> {
        self.assembled(node, walk, None).await
    }

    /// As [`assemble`](Self::assemble), for a step planned at `now_ms` on the engine's clock
    /// (that of [`AdmitOptions::arrival_ms`]): `chunking.max_wait_ms` measures prompts' waits to
    /// it. A simulated engine's first step; its later ones are planned on its clock by
    /// [`complete_and_assemble`](Self::complete_and_assemble) with [`Then::SameAt`] or
    /// [`NextStep::at_ms`].
    ///
    /// ```
    /// # use mstar_chunking::{AdmitOptions, BudgetSettings, ChunkingManagement, ChunkingPolicy, Order, PreparedInput, SubmoduleCaps};
    /// # actix::System::new().block_on(async {
    /// # let cm = ChunkingManagement::start("demo", [("llm", SubmoduleCaps::new(["prefill"], false))])?;
    /// # cm.set_policies([(("llm", "prefill"), ChunkingPolicy::budget(256))]).await?;
    /// cm.set_budgets(BudgetSettings::new(["prefill"]).order(Order::Priority).max_wait_ms(100.0)).await?;
    /// let old = AdmitOptions { priority: 5, arrival_ms: Some(0.0), ..AdmitOptions::default() };
    /// let new = AdmitOptions { priority: 0, arrival_ms: Some(150.0), ..AdmitOptions::default() };
    /// cm.admit_with(1, "llm", "prefill", PreparedInput::tokens(vec![1; 300]), old).await?;
    /// cm.admit_with(2, "llm", "prefill", PreparedInput::tokens(vec![2; 300]), new).await?;
    /// // At 150 ms on the engine's clock, request 1 has waited past the 100 ms bound.
    /// let batch = cm.assemble_at("llm", "prefill", 150.0).await?;
    /// assert_eq!(batch.rows[0].rid, 1);
    /// # Ok::<_, mstar_chunking::ChunkingError>(())
    /// # })?;
    /// # Ok::<_, Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    /// As `assemble`.
    pub async fn assemble_at(
        &self,
        node: &str,
        walk: &str,
        now_ms: f64,
    ) -> Result<Arc<Batch>, ChunkingError> {
        self.assembled(node, walk, Some(now_ms)).await
    }

    async fn assembled(
        &self,
        node: &str,
        walk: &str,
        now_ms: Option<f64>,
    ) -> Result<Arc<Batch>, ChunkingError> {
        let msg = Assemble {
            node: self.node_name(node),
            walk: walk.into(),
            now_ms,
        };
        ask(&self.scheduler, "Scheduler", &self.timeout, msg).await
    }

    /// Completes a step alone, with nothing assembled after it (the last step, or a step the
    /// engine completes before it knows what to run next): `ran[i]` is the tokens row `i` of
    /// its batch actually ran, `measured_ms` the step's measured wall time if the engine has
    /// it. A chunk row reports 0 (it did not run: it is planned again from the same place) or
    /// its planned tokens (it advances, and its input is released after its final chunk); a
    /// continuing row reports what it ran. Checks the step against the budget it was scheduled
    /// under and counts an overrun; with a time, also against its time budget (a time overrun,
    /// by reason), and with `chunking.learn_cost` the node's latency model is fitted from it
    /// (`docs/fitting.md`). A step run while the next one is planned is completed with
    /// [`complete_and_assemble`](Self::complete_and_assemble) instead.
    ///
    /// ```
    /// # use mstar_chunking::{ChunkingManagement, ChunkingPolicy, PreparedInput, SubmoduleCaps};
    /// # actix::System::new().block_on(async {
    /// # let cm = ChunkingManagement::start("demo", [("llm", SubmoduleCaps::new(["prefill"], false))])?;
    /// # cm.set_policies([(("llm", "prefill"), ChunkingPolicy::budget(256))]).await?;
    /// cm.admit(1, "llm", "prefill", PreparedInput::tokens(vec![1; 300]), 0).await?;
    /// let batch = cm.assemble("llm", "prefill").await?;
    /// // A chunk cannot run part of its tokens: refused, and the step stays in flight.
    /// assert!(cm.complete(batch.step, vec![100], None).await.is_err());
    /// let outcome = cm.complete(batch.step, vec![256], Some(12.5)).await?;
    /// assert_eq!((outcome.chunks, outcome.overrun, outcome.measured_ms), (1, None, Some(12.5)));
    /// # Ok::<_, mstar_chunking::ChunkingError>(())
    /// # })?;
    /// # Ok::<_, Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    /// The step is not in flight, `ran` does not have one entry per row, a chunk row reports
    /// neither 0 nor its planned tokens ([`ChunkingError::PartialChunk`]), or the time is not
    /// a finite number of ms ≥ 0 ([`ChunkingError::BadMeasurement`]); then nothing changes and
    /// the step stays in flight.
    pub async fn complete(
        &self,
        step: u64,
        ran: Vec<u32>,
        measured_ms: Option<f64>,
    ) -> Result<StepOutcome, ChunkingError> {
        let msg = Complete {
            step,
            ran,
            measured_ms,
        };
        ask(&self.scheduler, "Scheduler", &self.timeout, msg).await
    }

    /// The engine's one call a step: completes step `step` (as [`complete`](Self::complete),
    /// with what its rows ran and its measured time if known) and assembles the step `then`
    /// names (as [`assemble`](Self::assemble)), in one round trip. `then` is
    /// [`Then::Same`] (the completed step's node and walk, nothing joined or left),
    /// [`Then::SameAt`] (the same, planned at a time on the engine's clock: simulated time), or
    /// a [`NextStep`] (another node or walk, a time, and the row changes applied between the
    /// two: requests that ended, prompts that continue as decode rows, prompts admitted).
    ///
    /// Every guarantee of the separate calls holds: a failed step reports 0 for its chunk rows;
    /// on a refused completion nothing changes and no step is assembled. An answer lost on the
    /// way (a dropped or timed-out future) is answered again by the same call: the completion
    /// is applied once (the repeat gets the same outcome; with other `ran` counts or another
    /// time it is refused with [`ChunkingError::CompletedDifferently`]), and the next step is
    /// the one in flight, the same batch; with `Then::Same`, a repeat assembles the walk the
    /// first call did. The next step can be [`abandon`](Self::abandon)ed as any other.
    ///
    /// ```
    /// # use mstar_chunking::{BudgetSettings, ChunkingManagement, ChunkingPolicy, NextStep, PreparedInput, SubmoduleCaps, RowWork, Then};
    /// # actix::System::new().block_on(async {
    /// # let cm = ChunkingManagement::start("demo", [("llm", SubmoduleCaps::new(["prefill", "mixed"], false))])?;
    /// # cm.set_policies([(("llm", "mixed"), ChunkingPolicy::budget(256))]).await?;
    /// # cm.set_budgets(BudgetSettings::new(["prefill", "decode", "mixed"]).combined("mixed", ["prefill", "decode"])).await?;
    /// cm.admit(1, "llm", "prefill", PreparedInput::tokens(vec![1; 600]), 0).await?;
    /// let mut batch = cm.assemble("llm", "mixed").await?;
    /// // Nothing joins or leaves: the same node and walk, step after step.
    /// while batch.rows.len() == 1 && batch.rows[0].is_chunk() && !batch.rows[0].is_final() {
    ///     let ran = batch.rows.iter().map(|r| r.tokens()).collect();
    ///     batch = cm.complete_and_assemble(batch.step, ran, Some(12.5), Then::Same).await?.next?;
    /// }
    /// // The prompt's final chunk runs: it decodes from the very next step, beside a new prompt.
    /// let next = NextStep::new("llm", "mixed")
    ///     .continue_row(1, "decode", 1)
    ///     .admit(2, "prefill", PreparedInput::tokens(vec![2; 50]), 0);
    /// let done = cm.complete_and_assemble(batch.step, vec![88], None, next).await?;
    /// assert_eq!(done.outcome.finished, vec![1]);
    /// let next = done.next?;
    /// assert_eq!(next.rows[0].work, RowWork::Continue { estimate: 1 });
    /// assert_eq!(next.rows[1].rid, 2);
    /// # Ok::<_, mstar_chunking::ChunkingError>(())
    /// # })?;
    /// # Ok::<_, Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    /// As `complete` (then nothing changed), and [`ChunkingError::UnknownStep`] for a step of
    /// another node than the [`NextStep`]'s (with `Then::Same`, a step neither in flight nor
    /// the step last completed on its node). Once the completion is applied, the answer is
    /// `Ok`: a refused row change (the changes after it are not applied) or an assembly that
    /// failed is its [`Completed::next`].
    pub async fn complete_and_assemble(
        &self,
        step: u64,
        ran: Vec<u32>,
        measured_ms: Option<f64>,
        then: impl Into<Then>,
    ) -> Result<Completed, ChunkingError> {
        let msg = CompleteAndAssemble {
            step,
            ran,
            measured_ms,
            then: then.into(),
        };
        // The answer is boxed (a `Completed` is a few hundred bytes).
        ask(&self.scheduler, "Scheduler", &self.timeout, msg)
            .await
            .map(|done| *done)
    }

    /// Abandons the step in flight `step`: it ran nothing. Step ids are unique within the
    /// facade, so the step names its node, as in [`complete`](Self::complete). No row advances, nothing
    /// is released, no overrun is checked, and the node can assemble again (the same rows are
    /// planned again under the budgets then in force).
    ///
    /// ```
    /// # use mstar_chunking::{ChunkingManagement, ChunkingPolicy, PreparedInput, SubmoduleCaps};
    /// # actix::System::new().block_on(async {
    /// # let cm = ChunkingManagement::start("demo", [("llm", SubmoduleCaps::new(["prefill"], false))])?;
    /// # cm.set_policies([(("llm", "prefill"), ChunkingPolicy::budget(256))]).await?;
    /// cm.admit(1, "llm", "prefill", PreparedInput::tokens(vec![1; 300]), 0).await?;
    /// let batch = cm.assemble("llm", "prefill").await?;
    /// cm.abandon(batch.step).await?; // e.g. the engine is draining
    /// let again = cm.assemble("llm", "prefill").await?;
    /// assert_ne!(again.step, batch.step);
    /// assert_eq!(again.rows[0].work, batch.rows[0].work, "the same chunk, planned again");
    /// # Ok::<_, mstar_chunking::ChunkingError>(())
    /// # })?;
    /// # Ok::<_, Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    /// No step `step` is in flight (`UnknownStep`).
    pub async fn abandon(&self, step: u64) -> Result<(), ChunkingError> {
        let msg = Abandon { step };
        ask(&self.scheduler, "Scheduler", &self.timeout, msg).await
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
        let msg = CheckStep {
            node: batch.node.clone(),
            walk: batch.walk.clone(),
            tokens: batch.step_tokens(ran),
        };
        ask(&self.overruns, "OverrunAccounting", &self.timeout, msg).await
    }

    /// Drops the row of `rid` at `node` and its whole input there (the Python class's
    /// `release`: the request leaves this node; other nodes keep theirs). Answers whether an
    /// input was held; unknown rows are a no-op. To end a request, use
    /// [`forget_request`](Self::forget_request).
    ///
    /// # Errors
    /// An actor did not answer.
    pub async fn release(&self, rid: u64, node: &str) -> Result<bool, ChunkingError> {
        let msg = ForgetRow {
            rid,
            node: self.node_name(node),
        };
        ask(&self.scheduler, "Scheduler", &self.timeout, msg).await
    }

    /// Ends a request, finished or aborted, at any time: drops its rows (prefill and
    /// continuing) and its prepared inputs on every node. Rows of `rid` in a step in flight run
    /// but do not advance. Unknown rids are a no-op; the rid can be admitted again.
    ///
    /// This is the one way to end a request (`docs/scheduling.md#ending-a-request`).
    ///
    /// ```
    /// # use mstar_chunking::{ChunkingManagement, ChunkingPolicy, PreparedInput, SubmoduleCaps};
    /// # actix::System::new().block_on(async {
    /// # let cm = ChunkingManagement::start("demo", [("llm", SubmoduleCaps::new(["prefill", "decode"], false))])?;
    /// # cm.set_policies([(("llm", "prefill"), ChunkingPolicy::budget(256))]).await?;
    /// cm.admit(1, "llm", "prefill", PreparedInput::tokens(vec![1; 1000]), 0).await?;
    /// cm.forget_request(1).await?; // the client went away mid-prefill
    /// assert_eq!(cm.prepared_totals().await?, (0, 0), "its input is dropped");
    /// cm.forget_request(1).await?; // a no-op
    /// # Ok::<_, mstar_chunking::ChunkingError>(())
    /// # })?;
    /// # Ok::<_, Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    /// An actor did not answer.
    pub async fn forget_request(&self, rid: u64) -> Result<(), ChunkingError> {
        ask(
            &self.scheduler,
            "Scheduler",
            &self.timeout,
            ForgetRequest(rid),
        )
        .await
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
            &self.scheduler,
            "Scheduler",
            &self.timeout,
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
        ask(
            &self.prepared,
            "PreparedInputs",
            &self.timeout,
            PreparedTotals,
        )
        .await
    }

    /// Rows queued over all nodes and steps in flight.
    ///
    /// # Errors
    /// The actor did not answer.
    pub async fn queue_stats(&self) -> Result<QueueStats, ChunkingError> {
        ask(&self.scheduler, "Scheduler", &self.timeout, SchedulerStats).await
    }

    /// Starts the shutdown (`docs/actors.md#shutdown`): from now on, for every handle of this
    /// instance, `admit`, `continue_row`, `assemble` and the row changes of a completion
    /// answer [`ChunkingError::Draining`], and no new step is assembled; the step in flight
    /// can still be completed (its next step is refused) or abandoned, and requests forgotten.
    /// Answers the steps in flight. Then call [`drain`](Self::drain).
    ///
    /// # Errors
    /// The actor did not answer.
    pub async fn begin_drain(&self) -> Result<usize, ChunkingError> {
        ask(&self.scheduler, "Scheduler", &self.timeout, BeginDrain).await
    }

    /// Ends the shutdown (`docs/actors.md#shutdown`), starting it first if
    /// [`begin_drain`](Self::begin_drain) was not called: abandons the steps still in flight,
    /// drops every queued row and releases every prepared input, and reports what it dropped
    /// (all zero when the engine completed its step and forgot its requests first). The actors
    /// then hold nothing and refuse all work with [`ChunkingError::Draining`]; they end with
    /// their actix System ([`ActorThread::stop`](crate::ActorThread::stop) for [`start_on_own_thread`](Self::start_on_own_thread)), since a
    /// supervised actor is restarted while any handle can still reach it.
    ///
    /// ```
    /// # use mstar_chunking::{BudgetSettings, ChunkingError, ChunkingManagement, ChunkingPolicy, PreparedInput, SubmoduleCaps};
    /// # actix::System::new().block_on(async {
    /// let cm = ChunkingManagement::start("demo", [("llm", SubmoduleCaps::new(["prefill"], false))])?;
    /// cm.set_policies([(("llm", "prefill"), ChunkingPolicy::budget(256))]).await?;
    /// cm.set_budgets(BudgetSettings::new(["prefill"])).await?;
    /// cm.admit(1, "llm", "prefill", PreparedInput::tokens(vec![7; 1000]), 0).await?;
    /// let step = cm.assemble("llm", "prefill").await?;
    /// assert_eq!(cm.begin_drain().await?, 1);
    /// let refused = cm.admit(2, "llm", "prefill", PreparedInput::tokens(vec![7; 10]), 0).await;
    /// assert_eq!(refused, Err(ChunkingError::Draining));
    /// cm.complete(step.step, vec![256], None).await?;
    /// let report = cm.drain().await?;
    /// assert_eq!((report.steps_abandoned, report.requests, report.prepared_inputs), (0, 1, 1));
    /// assert_eq!(cm.prepared_totals().await?, (0, 0));
    /// # Ok::<_, ChunkingError>(())
    /// # })?;
    /// # Ok::<_, Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// [`start_on_own_thread`]: Self::start_on_own_thread
    ///
    /// # Errors
    /// An actor did not answer.
    pub async fn drain(&self) -> Result<DrainReport, ChunkingError> {
        ask(&self.scheduler, "Scheduler", &self.timeout, Drain).await
    }

    /// Makes one actor panic inside a handler, to exercise supervision: the call returns
    /// [`ChunkingError::ActorPanicked`] and the actor is restarted with its state. Only with
    /// the `test-hooks` feature.
    ///
    /// # Errors
    /// Always the panic's error (or the actor's unavailability).
    #[cfg(any(test, feature = "test-hooks"))]
    #[doc(hidden)]
    pub async fn inject_panic(&self, actor: ActorKind) -> Result<(), ChunkingError> {
        let t = &self.timeout;
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
        ask(&self.overruns, "OverrunAccounting", &self.timeout, msg).await
    }

    /// Reports the measured time of step `step`, completed before its time was known: an
    /// engine with asynchronous scheduling completes step N when it schedules step N+1, and
    /// learns N's time later. The time budget check, the online fit and the time margin read
    /// it as they read a time given with the completion; the step's time overrun is counted
    /// then. Kept for the latest `LATE_STEPS` steps completed without a time on nodes that
    /// learn their model or plan with a margin, one measurement each.
    ///
    /// ```
    /// # use mstar_chunking::{BudgetSettings, ChunkingManagement, ChunkingPolicy, PreparedInput, SubmoduleCaps};
    /// # actix::System::new().block_on(async {
    /// let cm = ChunkingManagement::start("demo", [("llm", SubmoduleCaps::new(["prefill"], false))])?;
    /// cm.set_policies([(("llm", "prefill"), ChunkingPolicy::budget(256))]).await?;
    /// cm.set_budgets(BudgetSettings::new(["prefill"]).learn_cost(true)).await?;
    /// cm.admit(1, "llm", "prefill", PreparedInput::tokens(vec![7; 100]), 0).await?;
    /// let step = cm.assemble("llm", "prefill").await?.step;
    /// cm.complete(step, vec![100], None).await?; // scheduled ahead: its time is not known yet
    /// let late = cm.measured_late(step, 12.5).await?;
    /// assert_eq!((late.step, late.measured_ms), (step, 12.5));
    /// assert!(cm.measured_late(step, 12.5).await.is_err(), "one measurement a step");
    /// # Ok::<_, mstar_chunking::ChunkingError>(())
    /// # })?;
    /// # Ok::<_, Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    /// `BadMeasurement` for a time that is not finite and ≥ 0; `UnknownStep` for a step not
    /// kept (never completed, completed with a time, measured already, or too old).
    pub async fn measured_late(
        &self,
        step: u64,
        ms: f64,
    ) -> Result<LateMeasurement, ChunkingError> {
        let msg = MeasuredLate { step, ms };
        ask(&self.scheduler, "Scheduler", &self.timeout, msg).await
    }

    /// The latency model `node` plans its time budgets with: the model in force, where it
    /// came from (the trusted online fit, or the configured coefficients or preset), and the
    /// online fit's estimate (coefficients, samples, whether trusted).
    ///
    /// # Errors
    /// `node` is not a node of the model, or the actor did not answer.
    pub async fn latency_model(&self, node: &str) -> Result<LatencyModelReport, ChunkingError> {
        let msg = GetLatencyModel(self.node_name(node));
        ask(&self.scheduler, "Scheduler", &self.timeout, msg).await
    }
}
