//! OverrunAccounting: overrun counts per `(node, walk)` and reason, the warning cadence, and
//! the overrun metrics.

use actix::prelude::*;

use crate::metrics;
use crate::overrun::{classify, Overrun, OverrunCounter, OverrunReason, StepTokens};
use crate::Name;

/// Owns the overrun counts.
#[derive(Default)]
pub struct OverrunAccounting {
    counter: OverrunCounter,
}

impl OverrunAccounting {
    /// Counts `o`, records its metrics, and warns on the 1st, 2nd, 4th, 8th, … of its
    /// `(node, walk)`.
    fn record(&mut self, o: &Overrun) {
        let (n, warn) = self.counter.record(o);
        metrics::record_overrun(
            &o.node,
            &o.walk,
            o.reason,
            o.tokens.saturating_sub(u64::from(o.budget)),
        );
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
    [CheckStep, OverrunCount, super::InjectPanic]
);

/// Counts an overrun the Scheduler found on completing a step.
#[derive(Message)]
#[rtype(result = "()")]
pub struct RecordOverrun(pub Overrun);

impl Handler<RecordOverrun> for OverrunAccounting {
    type Result = ();

    fn handle(&mut self, msg: RecordOverrun, _: &mut Self::Context) {
        self.record(&msg.0);
    }
}

/// Checks a step's tokens against the budget it was scheduled under (`check_budget`); counts
/// and answers the overrun, if any.
#[derive(Message)]
#[rtype(result = "Option<Overrun>")]
pub struct CheckStep {
    pub node: Name,
    pub walk: Name,
    pub tokens: StepTokens,
}

impl Handler<CheckStep> for OverrunAccounting {
    type Result = Option<Overrun>;

    fn handle(&mut self, msg: CheckStep, _: &mut Self::Context) -> Self::Result {
        let (budget, reason) = classify(&msg.tokens)?;
        let o = Overrun {
            node: msg.node,
            walk: msg.walk,
            budget,
            tokens: msg.tokens.ran,
            reason,
        };
        self.record(&o);
        Some(o)
    }
}

/// Overruns counted for `(node, walk)`: for one reason, or all when `reason` is `None`.
#[derive(Message)]
#[rtype(result = "u64")]
pub struct OverrunCount {
    pub node: Name,
    pub walk: Name,
    pub reason: Option<OverrunReason>,
}

impl Handler<OverrunCount> for OverrunAccounting {
    type Result = u64;

    fn handle(&mut self, msg: OverrunCount, _: &mut Self::Context) -> u64 {
        match msg.reason {
            Some(r) => self.counter.count(&msg.node, &msg.walk, r),
            None => self.counter.total(&msg.node, &msg.walk),
        }
    }
}
