//! PreparedInputs: `(rid, node) -> whole prepared input`, the inputs' owner of record: holds
//! each admitted prompt's input, releases it after its final chunk, forgets aborted requests,
//! answers `prepared` and the totals, and keeps the prepared-input gauges. Every change comes
//! from the Scheduler, which cuts the steps' chunk views from handles on the same inputs
//! (`docs/actors.md#prepared-inputs`).

use ::metrics::Gauge;
use actix::prelude::*;
use rustc_hash::FxHashMap;

use crate::error::ChunkingError;
use crate::metrics::Instance;
use crate::policy::Name;
use crate::prepared::{PreparedInput, PreparedStore};

/// Owns every whole prepared input; keeps the prepared-input gauges current.
pub(crate) struct PreparedInputs {
    store: PreparedStore,
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
            store: PreparedStore::default(),
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
        let (rows, tokens) = self.store.node_totals(node);
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
    [GetPrepared, PreparedTotals, ReleaseAll]
);

/// One change to the inputs held, as the Scheduler made it to its own handles.
#[derive(Debug)]
pub(crate) enum InputChange {
    /// Hold a prompt's whole input (admitted, its row queued, the input measured).
    Hold {
        rid: u64,
        node: Name,
        input: PreparedInput,
    },
    /// Drop the input of `(rid, node)`: its final chunk completed, or its row was dropped.
    Release { rid: u64, node: Name },
    /// Drop every node's input of a request (it ended).
    Forget(u64),
}

/// The changes one Scheduler message made to its handles, in order: sent once per message
/// without waiting, so PreparedInputs changes exactly as the handles did, and before it handles
/// anything the caller asks after the Scheduler's answer (mailboxes are first in, first out).
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct Apply(pub(crate) Vec<InputChange>);

impl Handler<Apply> for PreparedInputs {
    type Result = ();

    fn handle(&mut self, msg: Apply, _: &mut Self::Context) {
        let mut touched = std::mem::take(&mut self.touched);
        let mut touch = |node: &Name| {
            if !touched.contains(node) {
                touched.push(node.clone());
            }
        };
        for change in msg.0 {
            match change {
                InputChange::Hold { rid, node, input } => {
                    // The Scheduler holds no second row of `(rid, node)`: a refusal here means
                    // the two stores disagree.
                    if let Err(e) = self.store.insert(rid, &node, input) {
                        tracing::error!(error = %e, "prepared input refused");
                    }
                    touch(&node);
                }
                InputChange::Release { rid, node } => {
                    self.store.release(rid, &node);
                    touch(&node);
                }
                InputChange::Forget(rid) => {
                    for node in self.store.forget(rid) {
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

/// A row's whole input (a cheap clone of its `Arc`s).
#[derive(Message)]
#[rtype(result = "Result<Option<PreparedInput>, ChunkingError>")]
pub(crate) struct GetPrepared {
    pub(crate) rid: u64,
    pub(crate) node: Name,
}

impl Handler<GetPrepared> for PreparedInputs {
    type Result = Result<Option<PreparedInput>, ChunkingError>;

    fn handle(&mut self, msg: GetPrepared, _: &mut Self::Context) -> Self::Result {
        Ok(self.store.get(msg.rid, &msg.node).cloned())
    }
}

/// Rows and tokens held over all nodes.
#[derive(Message)]
#[rtype(result = "Result<(usize, u64), ChunkingError>")]
pub(crate) struct PreparedTotals;

impl Handler<PreparedTotals> for PreparedInputs {
    type Result = Result<(usize, u64), ChunkingError>;

    fn handle(&mut self, _: PreparedTotals, _: &mut Self::Context) -> Self::Result {
        Ok((self.store.rows(), self.store.tokens()))
    }
}

/// Drops every input held (a drain); answers the rows and tokens dropped.
#[derive(Message)]
#[rtype(result = "Result<(usize, u64), ChunkingError>")]
pub(crate) struct ReleaseAll;

impl Handler<ReleaseAll> for PreparedInputs {
    type Result = Result<(usize, u64), ChunkingError>;

    fn handle(&mut self, _: ReleaseAll, _: &mut Self::Context) -> Self::Result {
        let dropped = self.store.clear();
        let nodes: Vec<Name> = self.gauges.keys().cloned().collect();
        for node in &nodes {
            self.publish(node);
        }
        Ok(dropped)
    }
}
