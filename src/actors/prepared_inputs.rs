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
}

impl PreparedInputs {
    /// Holds nothing yet; the gauges of every node in `nodes` exist from now on, at 0.
    pub(crate) fn new(instance: Instance, nodes: &[Name]) -> Self {
        let mut this = Self {
            store: PreparedStore::default(),
            instance,
            gauges: FxHashMap::default(),
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
    [
        Insert,
        ForgetInputs,
        GetPrepared,
        PreparedTotals,
        ReleaseAll
    ]
);

/// Holds a row's whole input; answers its measured length. The Scheduler sends it without
/// waiting, having queued the row and measured the input: a refusal here (an input already
/// held for `(rid, node)`, which the Scheduler's own check rules out) is logged.
#[derive(Message)]
#[rtype(result = "Result<u32, ChunkingError>")]
pub(crate) struct Insert {
    pub(crate) rid: u64,
    pub(crate) node: Name,
    pub(crate) input: PreparedInput,
}

impl Handler<Insert> for PreparedInputs {
    type Result = Result<u32, ChunkingError>;

    fn handle(&mut self, msg: Insert, _: &mut Self::Context) -> Self::Result {
        let total = self
            .store
            .insert(msg.rid, &msg.node, msg.input)
            .inspect_err(|e| tracing::error!(error = %e, "prepared input refused"))?;
        self.publish(&msg.node);
        Ok(total)
    }
}

/// Drops the inputs of rows whose final chunk completed (sent by the Scheduler).
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct Release {
    pub(crate) node: Name,
    pub(crate) rids: Vec<u64>,
}

impl Handler<Release> for PreparedInputs {
    type Result = ();

    fn handle(&mut self, msg: Release, _: &mut Self::Context) {
        for rid in msg.rids {
            self.store.release(rid, &msg.node);
        }
        self.publish(&msg.node);
    }
}

/// Drops every node's input of a request; answers how many were held.
#[derive(Message)]
#[rtype(result = "Result<usize, ChunkingError>")]
pub(crate) struct ForgetInputs(pub(crate) u64);

impl Handler<ForgetInputs> for PreparedInputs {
    type Result = Result<usize, ChunkingError>;

    fn handle(&mut self, msg: ForgetInputs, _: &mut Self::Context) -> Self::Result {
        let nodes = self.store.forget(msg.0);
        for n in &nodes {
            self.publish(n);
        }
        Ok(nodes.len())
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
