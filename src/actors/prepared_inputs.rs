//! PreparedInputs: `(rid, node) -> whole prepared input`; cuts each step's chunk inputs as views,
//! releases a row's input after its final chunk, and forgets aborted requests.

use ::metrics::Gauge;
use actix::prelude::*;
use rustc_hash::FxHashMap;

use crate::error::ChunkingError;
use crate::metrics::Instance;
use crate::planner::RowWork;
use crate::policy::Name;
use crate::prepared::{PreparedInput, PreparedStore};
use crate::scheduler::Batch;

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
        Cut,
        InsertAndCut,
        ForgetInputs,
        GetPrepared,
        PreparedTotals,
        ReleaseAll
    ]
);

/// Holds a row's whole input; answers its measured length.
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
        let total = self.store.insert(msg.rid, &msg.node, msg.input)?;
        self.publish(&msg.node);
        Ok(total)
    }
}

/// Cuts the input of every chunk row of a batch; answers the batch and the rids of chunk rows
/// that had no input (forgotten meanwhile).
#[derive(Message)]
#[rtype(result = "Result<CutBatch, ChunkingError>")]
pub(crate) struct Cut(pub(crate) Batch);

/// A batch with its chunk inputs cut, and the rids whose input was missing.
#[derive(Debug)]
pub(crate) struct CutBatch {
    pub(crate) batch: Batch,
    pub(crate) missing: Vec<u64>,
}

impl Handler<Cut> for PreparedInputs {
    type Result = Result<CutBatch, ChunkingError>;

    fn handle(&mut self, msg: Cut, _: &mut Self::Context) -> Self::Result {
        let mut batch = msg.0;
        let inputs = self.store.node(&batch.node);
        let mut missing = Vec::new();
        for row in &mut batch.rows {
            let RowWork::Chunk { range, .. } = row.work else {
                continue;
            };
            match inputs.and_then(|m| m.get(row.rid)) {
                Some(whole) => {
                    row.input = Some(whole.cut(range.start as usize..range.end as usize))
                }
                None => missing.push(row.rid),
            }
        }
        Ok(CutBatch { batch, missing })
    }
}

/// Holds the inputs of prompts admitted with a step's completion, then cuts the next step's
/// batch (`CompleteAndAssemble`): one message, so the inputs are held before the cut. Answers
/// the cut batch and the admissions refused, each with its error (their rows are dropped by
/// the Scheduler, as for [`Insert`]).
#[derive(Message)]
#[rtype(result = "Result<InsertedAndCut, ChunkingError>")]
pub(crate) struct InsertAndCut {
    pub(crate) inserts: Vec<Insert>,
    pub(crate) batch: Batch,
}

/// The answer to [`InsertAndCut`].
#[derive(Debug)]
pub(crate) struct InsertedAndCut {
    pub(crate) cut: CutBatch,
    pub(crate) refused: Vec<(u64, ChunkingError)>,
}

impl Handler<InsertAndCut> for PreparedInputs {
    type Result = Result<InsertedAndCut, ChunkingError>;

    fn handle(&mut self, msg: InsertAndCut, ctx: &mut Self::Context) -> Self::Result {
        let mut refused = Vec::new();
        let mut nodes: Vec<Name> = Vec::new();
        for i in msg.inserts {
            if let Err(e) = self.store.insert(i.rid, &i.node, i.input) {
                refused.push((i.rid, e));
            }
            if !nodes.contains(&i.node) {
                nodes.push(i.node);
            }
        }
        for node in &nodes {
            self.publish(node);
        }
        let cut = <Self as Handler<Cut>>::handle(self, Cut(msg.batch), ctx)?;
        Ok(InsertedAndCut { cut, refused })
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
