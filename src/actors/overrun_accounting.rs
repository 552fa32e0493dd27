//! OverrunAccounting: overrun counts per `(node, walk)` and reason, the warning cadence, and
//! the overrun metrics.

use actix::prelude::*;

use rustc_hash::FxHashMap;

use crate::error::ChunkingError;
use crate::metrics::{Instance, OverrunMetrics};
use crate::overrun::{classify, Overrun, OverrunCounter, OverrunReason, StepTokens};
use crate::policy::Name;

/// Owns the overrun counts.
pub(crate) struct OverrunAccounting {
    counter: OverrunCounter,
    instance: Instance,
    /// Metric handles per `(node, walk)`, resolved on its first overrun.
    metrics: FxHashMap<(Name, Name), OverrunMetrics>,
}

impl OverrunAccounting {
    pub(crate) fn new(instance: Instance) -> Self {
        Self {
            counter: OverrunCounter::default(),
            instance,
            metrics: FxHashMap::default(),
        }
    }

    /// Counts `o`, records its metrics, and warns on the 1st, 2nd, 4th, 8th, … of its
    /// `(node, walk)`.
    fn record(&mut self, o: &Overrun) {
        let (n, warn) = self.counter.record(o);
        let instance = &self.instance;
        self.metrics
            .entry((o.node.clone(), o.walk.clone()))
            .or_insert_with(|| instance.overruns(&o.node, &o.walk))
            .record(o.reason, o.tokens.saturating_sub(u64::from(o.budget)));
        if warn {
            tracing::warn!(
                node = %o.node,
                walk = %o.walk,
                budget = o.budget,
                tokens = o.tokens,
                reason = o.reason.as_str(),
                overruns = n,
                "step ran {} tokens over its budget of {} ({}); overrun #{} of {}/{}",
                o.tokens.saturating_sub(u64::from(o.budget)),
                o.budget,
                o.reason.as_str(),
                n,
                o.node,
                o.walk
            );
        }
    }
}

impl Actor for OverrunAccounting {
    type Context = Context<Self>;
}

super::supervised!(
    OverrunAccounting,
    "OverrunAccounting",
    [CheckStep, OverrunCount]
);

/// Counts an overrun the Scheduler found on completing a step; its warning is recorded in the
/// step's span.
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct RecordOverrun(pub(crate) Overrun, pub(crate) tracing::Span);

impl Handler<RecordOverrun> for OverrunAccounting {
    type Result = ();

    fn handle(&mut self, msg: RecordOverrun, _: &mut Self::Context) {
        let _step = msg.1.enter();
        self.record(&msg.0);
    }
}

/// Checks a step's tokens against the budget it was scheduled under (`check_budget`); counts
/// and answers the overrun, if any.
#[derive(Message)]
#[rtype(result = "Result<Option<Overrun>, ChunkingError>")]
pub(crate) struct CheckStep {
    pub(crate) node: Name,
    pub(crate) walk: Name,
    pub(crate) tokens: StepTokens,
}

impl Handler<CheckStep> for OverrunAccounting {
    type Result = Result<Option<Overrun>, ChunkingError>;

    fn handle(&mut self, msg: CheckStep, _: &mut Self::Context) -> Self::Result {
        let Some((budget, reason)) = classify(&msg.tokens) else {
            return Ok(None);
        };
        let o = Overrun {
            node: msg.node,
            walk: msg.walk,
            budget,
            tokens: msg.tokens.ran,
            reason,
        };
        self.record(&o);
        Ok(Some(o))
    }
}

/// Overruns counted for `(node, walk)`: for one reason, or all when `reason` is `None`.
#[derive(Message)]
#[rtype(result = "Result<u64, ChunkingError>")]
pub(crate) struct OverrunCount {
    pub(crate) node: Name,
    pub(crate) walk: Name,
    pub(crate) reason: Option<OverrunReason>,
}

impl Handler<OverrunCount> for OverrunAccounting {
    type Result = Result<u64, ChunkingError>;

    fn handle(&mut self, msg: OverrunCount, _: &mut Self::Context) -> Self::Result {
        Ok(match msg.reason {
            Some(r) => self.counter.count(&msg.node, &msg.walk, r),
            None => self.counter.total(&msg.node, &msg.walk),
        })
    }
}
