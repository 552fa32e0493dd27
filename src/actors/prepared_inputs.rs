//! PreparedInputs: `(rid, node) -> whole prepared input`; cuts each step's chunk inputs as views,
//! releases a row's input after its final chunk, and forgets aborted requests.

use ::metrics::Gauge;
use actix::prelude::*;
use rustc_hash::FxHashMap;

use crate::error::ChunkingError;
use crate::metrics;
use crate::planner::Work;
use crate::prepared::{PreparedInput, PreparedStore};
use crate::scheduler::Batch;
use crate::Name;

/// Owns every whole prepared input; keeps the prepared-input gauges current.
#[derive(Default)]
pub struct PreparedInputs {
    store: PreparedStore,
    /// The prepared-input gauges per node, resolved on the node's first change, so that holding
    /// and releasing inputs (every step) builds no metric labels.
    gauges: FxHashMap<Name, (Gauge, Gauge)>,
}

impl PreparedInputs {
    fn publish(&mut self, node: &Name) {
        let (rows, tokens) = self.store.node_totals(node);
        if !self.gauges.contains_key(node) {
            self.gauges
                .insert(node.clone(), metrics::prepared_gauge(node));
        }
        if let Some((rows_gauge, tokens_gauge)) = self.gauges.get(node) {
            rows_gauge.set(rows as f64);
            tokens_gauge.set(tokens as f64);
        }
    }

    /// The store, for tests and inspection.
    pub fn store(&self) -> &PreparedStore {
        &self.store
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
        Cut,
        ReleaseOne,
        ForgetInputs,
        GetPrepared,
        PreparedTotals,
        super::InjectPanic
    ]
);

/// Holds a row's whole input; answers its measured length.
#[derive(Message)]
#[rtype(result = "Result<u32, ChunkingError>")]
pub struct Insert {
    pub rid: u64,
    pub node: Name,
    pub input: PreparedInput,
}

impl Handler<Insert> for PreparedInputs {
    type Result = Result<u32, ChunkingError>;

    fn handle(&mut self, msg: Insert, _: &mut Self::Context) -> Self::Result {
        let total = self.store.insert(msg.rid, &msg.node, msg.input)?;
        self.publish(&msg.node);
        Ok(total)
    }
}

/// Cuts the input of every chunk row of a batch; answers the batch and the rids of chunk rows
/// that had no input (forgotten meanwhile).
#[derive(Message)]
#[rtype(result = "CutBatch")]
pub struct Cut(pub Batch);

/// A batch with its chunk inputs cut, and the rids whose input was missing.
#[derive(Debug, MessageResponse)]
pub struct CutBatch {
    pub batch: Batch,
    pub missing: Vec<u64>,
}

impl Handler<Cut> for PreparedInputs {
    type Result = CutBatch;

    fn handle(&mut self, msg: Cut, _: &mut Self::Context) -> CutBatch {
        let mut batch = msg.0;
        let inputs = self.store.node(&batch.node);
        let mut missing = Vec::new();
        for row in &mut batch.rows {
            let Work::Chunk { range, .. } = row.work else {
                continue;
            };
            match inputs.and_then(|m| m.get(row.rid)) {
                Some(whole) => {
                    row.input = Some(whole.cut(range.start as usize..range.end as usize))
                }
                None => missing.push(row.rid),
            }
        }
        CutBatch { batch, missing }
    }
}

/// Drops the inputs of rows whose final chunk completed (sent by the Scheduler).
#[derive(Message)]
#[rtype(result = "()")]
pub struct Release {
    pub node: Name,
    pub rids: Vec<u64>,
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

/// Drops one row's input; answers whether one was held (unknown rows are a no-op).
#[derive(Message)]
#[rtype(result = "bool")]
pub struct ReleaseOne {
    pub rid: u64,
    pub node: Name,
}

impl Handler<ReleaseOne> for PreparedInputs {
    type Result = bool;

    fn handle(&mut self, msg: ReleaseOne, _: &mut Self::Context) -> bool {
        let held = self.store.release(msg.rid, &msg.node);
        self.publish(&msg.node);
        held
    }
}

/// Drops every node's input of a request; answers how many were held.
#[derive(Message)]
#[rtype(result = "usize")]
pub struct ForgetInputs(pub u64);

impl Handler<ForgetInputs> for PreparedInputs {
    type Result = usize;

    fn handle(&mut self, msg: ForgetInputs, _: &mut Self::Context) -> usize {
        let nodes = self.store.forget(msg.0);
        for n in &nodes {
            self.publish(n);
        }
        nodes.len()
    }
}

/// A row's whole input (a cheap clone of its `Arc`s).
#[derive(Message)]
#[rtype(result = "Option<PreparedInput>")]
pub struct GetPrepared {
    pub rid: u64,
    pub node: Name,
}

impl Handler<GetPrepared> for PreparedInputs {
    type Result = Option<PreparedInput>;

    fn handle(&mut self, msg: GetPrepared, _: &mut Self::Context) -> Self::Result {
        self.store.get(msg.rid, &msg.node).cloned()
    }
}

/// Rows and tokens held over all nodes.
#[derive(Message)]
#[rtype(result = "HeldTotals")]
pub struct PreparedTotals;

/// Prepared inputs held: rows and their tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, MessageResponse)]
pub struct HeldTotals {
    pub rows: usize,
    pub tokens: u64,
}

impl Handler<PreparedTotals> for PreparedInputs {
    type Result = HeldTotals;

    fn handle(&mut self, _: PreparedTotals, _: &mut Self::Context) -> HeldTotals {
        HeldTotals {
            rows: self.store.rows(),
            tokens: self.store.tokens(),
        }
    }
}
