//! PreparedInputs: the accounting of the prepared inputs held, `(rid, node) -> tokens`: answers
//! the totals and keeps the prepared-input gauges. The inputs themselves have one owner,
//! SchedulerState's store, which sends every change it makes here as one `Apply` per message
//! (`docs/actors.md#prepared-inputs`).

use ::metrics::Gauge;
use actix::prelude::*;
use rustc_hash::FxHashMap;

use crate::error::ChunkingError;
use crate::metrics::Instance;
use crate::policy::Name;
use crate::prepared::{InputChange, PreparedAccounts};

/// Counts every whole prepared input held; keeps the prepared-input gauges current.
pub(crate) struct PreparedInputs {
    accounts: PreparedAccounts,
    instance: Instance,
    /// The prepared-input gauges per node, resolved on the node's first change, so that holding
    /// and releasing inputs (every step) builds no metric labels.
    gauges: FxHashMap<Name, (Gauge, Gauge)>,
    /// The nodes an [`Apply`] changed, kept to reuse its allocation.
    touched: Vec<Name>,
}

impl PreparedInputs {
    /// Holds nothing yet; the gauges of every node in `nodes` exist from now on, at 0.
    pub(crate) fn new(instance: Instance, nodes: &[Name]) -> Self {
        let mut this = Self {
            accounts: PreparedAccounts::default(),
            instance,
            gauges: FxHashMap::default(),
            touched: Vec::new(),
        };
        for node in nodes {
            this.publish(node);
        }
        this
    }

    fn publish(&mut self, node: &Name) {
        let (rows, tokens) = self.accounts.node_totals(node);
        if !self.gauges.contains_key(node) {
            self.gauges
                .insert(node.clone(), self.instance.prepared(node));
        }
        if let Some((rows_gauge, tokens_gauge)) = self.gauges.get(node) {
            rows_gauge.set(rows as f64);
            tokens_gauge.set(tokens as f64);
        }
    }
}

impl Actor for PreparedInputs {
    type Context = Context<Self>;
}

super::supervised!(
    PreparedInputs,
    "PreparedInputs",
    [Apply, PreparedTotals, ReleaseAll]
);

/// The changes one Scheduler message made to the inputs held, in order: sent once per message
/// without waiting, so the accounting changes exactly as the store did, and before
/// PreparedInputs handles anything the caller asks after the Scheduler's answer (mailboxes are
/// first in, first out).
///
/// Sent guarded, as every message the facade sends is: a panic while applying is contained
/// (logged, the actor restarted in place) instead of unwinding through the arbiter.
#[derive(Message)]
#[rtype(result = "Result<(), ChunkingError>")]
pub(crate) struct Apply(pub(crate) Vec<InputChange>);

impl Handler<Apply> for PreparedInputs {
    type Result = Result<(), ChunkingError>;

    fn handle(&mut self, msg: Apply, _: &mut Self::Context) -> Self::Result {
        self.apply(msg.0);
        Ok(())
    }
}

impl PreparedInputs {
    /// [`Apply`]: makes the changes in order, then sets the gauges of every node they touched.
    fn apply(&mut self, changes: Vec<InputChange>) {
        let mut touched = std::mem::take(&mut self.touched);
        let mut touch = |node: &Name| {
            if !touched.contains(node) {
                touched.push(node.clone());
            }
        };
        for change in changes {
            match change {
                InputChange::Hold { rid, node, tokens } => {
                    // The store holds no second input of `(rid, node)`: a second hold here
                    // means the changes were not sent in order.
                    if !self.accounts.hold(rid, &node, tokens) {
                        tracing::error!(rid, node = %node, "prepared input counted twice");
                    }
                    touch(&node);
                }
                InputChange::Release { rid, node } => {
                    self.accounts.release(rid, &node);
                    touch(&node);
                }
                InputChange::Forget(rid) => {
                    for node in self.accounts.forget(rid) {
                        touch(&node);
                    }
                }
            }
        }
        for node in &touched {
            self.publish(node);
        }
        touched.clear();
        self.touched = touched;
    }
}

/// Rows and tokens held over all nodes.
#[derive(Message)]
#[rtype(result = "Result<(usize, u64), ChunkingError>")]
pub(crate) struct PreparedTotals;

impl Handler<PreparedTotals> for PreparedInputs {
    type Result = Result<(usize, u64), ChunkingError>;

    fn handle(&mut self, _: PreparedTotals, _: &mut Self::Context) -> Self::Result {
        Ok(self.accounts.totals())
    }
}

/// Drops every input held (a drain); answers the rows and tokens dropped.
#[derive(Message)]
#[rtype(result = "Result<(usize, u64), ChunkingError>")]
pub(crate) struct ReleaseAll;

impl Handler<ReleaseAll> for PreparedInputs {
    type Result = Result<(usize, u64), ChunkingError>;

    fn handle(&mut self, _: ReleaseAll, _: &mut Self::Context) -> Self::Result {
        let dropped = self.accounts.totals();
        self.accounts.clear();
        let nodes: Vec<Name> = self.gauges.keys().cloned().collect();
        for node in &nodes {
            self.publish(node);
        }
        Ok(dropped)
    }
}

#[cfg(test)]
mod tests {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};

    use super::*;

    /// The prepared-input gauges set since the last snapshot, per node: (rows, tokens). (A
    /// snapshot of the debugging recorder resets every gauge to 0.)
    fn gauges(snapshotter: &Snapshotter) -> Vec<(String, (f64, f64))> {
        let mut found: Vec<(String, (f64, f64))> = Vec::new();
        for (key, _, _, value) in snapshotter.snapshot().into_vec() {
            let Some(node) = key.key().labels().find(|l| l.key() == "node") else {
                continue;
            };
            let DebugValue::Gauge(v) = value else {
                continue;
            };
            let i = match found.iter().position(|(n, _)| n == node.value()) {
                Some(i) => i,
                None => {
                    found.push((node.value().to_string(), (0.0, 0.0)));
                    found.len() - 1
                }
            };
            match key.key().name() {
                n if n == crate::metrics::PREPARED_INPUTS => found[i].1 .0 = v.into_inner(),
                n if n == crate::metrics::PREPARED_INPUT_TOKENS => found[i].1 .1 = v.into_inner(),
                _ => {}
            }
        }
        found.sort_by(|a, b| a.0.cmp(&b.0));
        found
    }

    #[test]
    fn apply_makes_the_changes_in_order_and_sets_every_touched_nodes_gauges() {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        let (a, b) = (Name::from("thinker"), Name::from("talker"));
        let mut p = metrics::with_local_recorder(&recorder, || {
            PreparedInputs::new(Instance::new("m".into()), &[a.clone(), b.clone()])
        });
        let hold = |rid, node: &Name, tokens| InputChange::Hold {
            rid,
            node: node.clone(),
            tokens,
        };
        let g = |pairs: &[(&str, (f64, f64))]| -> Vec<(String, (f64, f64))> {
            pairs.iter().map(|(n, v)| (n.to_string(), *v)).collect()
        };
        p.apply(vec![hold(1, &a, 4), hold(2, &a, 3), hold(1, &b, 5)]);
        let want = g(&[("talker", (1.0, 5.0)), ("thinker", (2.0, 7.0))]);
        assert_eq!(gauges(&snapshotter), want);
        // In order: released, then held again with another input.
        p.apply(vec![
            InputChange::Release {
                rid: 2,
                node: a.clone(),
            },
            hold(2, &a, 9),
        ]);
        // Only the node touched is set again (the snapshot reset the other to 0).
        let want = g(&[("talker", (0.0, 0.0)), ("thinker", (2.0, 13.0))]);
        assert_eq!(gauges(&snapshotter), want);
        p.apply(vec![hold(3, &b, 2)]);
        let want = g(&[("talker", (2.0, 7.0)), ("thinker", (0.0, 0.0))]);
        assert_eq!(gauges(&snapshotter), want);
        assert_eq!(p.accounts.tokens_of(2, "thinker"), Some(9));
        // A forget touches every node that held the request.
        p.apply(vec![InputChange::Forget(1)]);
        let want = g(&[("talker", (1.0, 2.0)), ("thinker", (1.0, 9.0))]);
        assert_eq!(gauges(&snapshotter), want);
        assert_eq!(p.accounts.totals(), (2, 11));
        // A second hold of `(rid, node)` is refused and changes nothing.
        p.apply(vec![hold(2, &a, 1)]);
        let want = g(&[("talker", (0.0, 0.0)), ("thinker", (1.0, 9.0))]);
        assert_eq!(gauges(&snapshotter), want);
        assert_eq!(p.accounts.tokens_of(2, "thinker"), Some(9));
        assert!(p.touched.is_empty(), "kept empty between messages");
    }
}
