//! One node's row queues: continuing rows and prefill rows in admission order, with their
//! progress, and the walk of its prefill rows under the node's order ([`crate::order`]). Pure
//! state; the Scheduler actor holds one per node.

use rustc_hash::FxHashMap;

use crate::error::ChunkingError;
use crate::order::{self, AdmitOptions, NodeOrder, StepClock, Wait};
use crate::planner::{ContRow, PlannedRow, PrefillRow, RowWork};
use crate::policy::Name;
use crate::range::clamp_cached;

/// The rows of one node waiting for, or in the middle of, their work.
#[derive(Debug, Default)]
pub struct NodeQueues {
    node: Name,
    /// Continuing rows, sorted by `seq`. A continuing row stays queued (it runs in every step it
    /// fits) until `forget`.
    cont: Vec<ContRow>,
    /// Prefill rows, sorted by `seq`, until their final chunk completes.
    prefill: Vec<PrefillRow>,
    /// `rid -> seq`: the admission position of each request with a row here. A prompt keeps
    /// its position until its final chunk; its continuing row, registered after that, joins
    /// at the end of the order (continuing rows are FCFS by when they started decoding).
    seq_of: FxHashMap<u64, u64>,
    next_seq: u64,
    /// Prefill rows with a completed chunk (`started`), kept so the queue-depth gauges cost
    /// nothing per step.
    mid_prefill: usize,
    /// `rid -> prompt tokens` of prompts whose final chunk ran and whose continuing row has not
    /// been registered yet: that row's starting context. Dropped by `continue_row` or `forget`.
    prompt_totals: FxHashMap<u64, u32>,
    /// Steps planned on this node: the clock of `chunking.max_wait_steps`.
    steps: u64,
    /// The engine's time of the last planned step, if it gave one (the head wait gauges).
    last_now_ms: Option<f64>,
    /// The prefill rows' walk under an order other than `fcfs`, rebuilt per step (kept to
    /// reuse its allocation).
    rank: Vec<u32>,
    /// Whether a priority given under another order was warned about (once per node).
    priority_warned: bool,
}

/// A node's rows as one step is planned from them: the continuing rows, the prefill rows in
/// admission order, and under an order other than `fcfs` the prefill rows' walk
/// ([`order::rank`]).
#[derive(Debug, Clone, Copy)]
pub struct QueueView<'a> {
    /// The continuing rows, in admission order.
    pub cont: &'a [ContRow],
    /// The prefill rows, in admission order.
    pub prefill: &'a [PrefillRow],
    /// Indices into `prefill` in the order the planner walks them; `None`: admission order.
    pub rank: Option<&'a [u32]>,
}

/// How many rows a node's queues hold, by state (the queue-depth gauges).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QueueCounts {
    /// Prefill rows that have not run a chunk yet.
    pub waiting: usize,
    /// Prefill rows with a completed chunk and more to run.
    pub mid_prefill: usize,
    /// Continuing rows.
    pub continuing: usize,
}

/// What completing a step's chunk did to its row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Advance {
    /// The row moved on and waits for its next chunk.
    Progressed,
    /// The final chunk completed: the row left the queue and its prepared input can go.
    Finished,
    /// The row is gone (forgotten during the step): nothing to do.
    Gone,
}

impl NodeQueues {
    /// Empty queues for `node`.
    pub fn new(node: Name) -> Self {
        Self {
            node,
            ..Self::default()
        }
    }

    /// The node these queues belong to.
    pub fn name(&self) -> &Name {
        &self.node
    }

    /// The continuing rows, in admission order.
    pub fn cont(&self) -> &[ContRow] {
        &self.cont
    }

    /// The prefill rows, in admission order.
    pub fn prefill(&self) -> &[PrefillRow] {
        &self.prefill
    }

    /// Whether nothing is queued.
    pub fn is_empty(&self) -> bool {
        self.cont.is_empty() && self.prefill.is_empty()
    }

    fn seq(&mut self, rid: u64) -> u64 {
        let next = &mut self.next_seq;
        *self.seq_of.entry(rid).or_insert_with(|| {
            *next += 1;
            *next
        })
    }

    fn prefill_index(&self, rid: u64) -> Option<usize> {
        let seq = *self.seq_of.get(&rid)?;
        self.prefill.binary_search_by_key(&seq, |r| r.seq).ok()
    }

    fn cont_index(&self, rid: u64) -> Option<usize> {
        let seq = *self.seq_of.get(&rid)?;
        self.cont.binary_search_by_key(&seq, |r| r.seq).ok()
    }

    /// Queues a prompt of `total` tokens, of which `cached` are a cached prefix (clamped to
    /// `total - 1`).
    ///
    /// # Errors
    /// An empty prompt, or a row of `rid` already prefilling or continuing on this node.
    pub fn admit(
        &mut self,
        rid: u64,
        walk: Name,
        total: u32,
        cached: u32,
    ) -> Result<(), ChunkingError> {
        self.admit_with(rid, walk, total, AdmitOptions::cached(cached))
    }

    /// [`NodeQueues::admit`] with the prompt's priority and arrival time, for the node's
    /// order and starvation bound.
    ///
    /// # Errors
    /// As `admit`.
    pub fn admit_with(
        &mut self,
        rid: u64,
        walk: Name,
        total: u32,
        options: AdmitOptions,
    ) -> Result<(), ChunkingError> {
        if total == 0 {
            return Err(ChunkingError::EmptyInput {
                rid,
                node: self.node.clone(),
            });
        }
        if self.prefill_index(rid).is_some() || self.cont_index(rid).is_some() {
            return Err(ChunkingError::AlreadyQueued {
                rid,
                node: self.node.clone(),
            });
        }
        let seq = self.seq(rid);
        let cached = clamp_cached(options.cached, total);
        let row = PrefillRow {
            seq,
            rid,
            walk,
            total,
            cached,
            progress: cached,
            started: false,
            priority: options.priority,
            arrival_ms: options.arrival_ms,
            admitted_step: self.steps,
            wait_from_step: self.steps,
            wait_from_ms: options.arrival_ms,
        };
        let at = self.prefill.partition_point(|r| r.seq < seq);
        self.prefill.insert(at, row);
        Ok(())
    }

    /// Keeps a continuing row of `rid` queued: it runs `estimate` tokens in every step it fits,
    /// until [`NodeQueues::forget`]. Calling it again updates the walk and estimate. Its
    /// context is `context` when given, else its prompt's tokens (when its prompt was prefilled
    /// here), and grows by what it runs in each completed step.
    ///
    /// # Errors
    /// A zero estimate, or `rid` still prefilling on this node.
    pub fn continue_row(
        &mut self,
        rid: u64,
        walk: Name,
        estimate: u32,
        context: Option<u64>,
    ) -> Result<(), ChunkingError> {
        if estimate == 0 {
            return Err(ChunkingError::ZeroEstimate {
                rid,
                node: self.node.clone(),
            });
        }
        if self.prefill_index(rid).is_some() {
            return Err(ChunkingError::StillPrefilling {
                rid,
                node: self.node.clone(),
            });
        }
        if let Some(i) = self.cont_index(rid) {
            let row = &mut self.cont[i];
            row.walk = walk;
            row.estimate = estimate;
            if let Some(context) = context {
                row.context = context;
            }
            return Ok(());
        }
        let prompt = self.prompt_totals.remove(&rid).map_or(0, u64::from);
        let context = context.unwrap_or(prompt);
        let seq = self.seq(rid);
        let at = self.cont.partition_point(|r| r.seq < seq);
        self.cont.insert(
            at,
            ContRow {
                seq,
                rid,
                walk,
                estimate,
                context,
            },
        );
        Ok(())
    }

    /// Drops every row of `rid`. Returns whether a prefill row (with a prepared input) was
    /// dropped.
    pub fn forget(&mut self, rid: u64) -> bool {
        let removed = self.prefill_index(rid).map(|i| self.prefill.remove(i));
        if removed.as_ref().is_some_and(|r| r.started) {
            self.mid_prefill -= 1;
        }
        let had_prefill = removed.is_some();
        if let Some(i) = self.cont_index(rid) {
            self.cont.remove(i);
        }
        self.seq_of.remove(&rid);
        self.prompt_totals.remove(&rid);
        had_prefill
    }

    fn drop_seq_if_idle(&mut self, rid: u64) {
        if self.prefill_index(rid).is_none() && self.cont_index(rid).is_none() {
            self.seq_of.remove(&rid);
        }
    }

    /// Grows the context of every continuing row of a completed step by the tokens it ran
    /// (`ran[i]` for `rows[i]`). The step's continuing rows are in admission order, as the queue
    /// is, so one pass with a cursor finds them all: O(rows + queue), no search per row.
    pub fn grow_contexts(&mut self, rows: &[PlannedRow], ran: &[u32]) {
        let mut j = 0;
        for (row, &r) in rows.iter().zip(ran) {
            if !matches!(row.work, RowWork::Continue { .. }) {
                continue;
            }
            while j < self.cont.len() && self.cont[j].seq < row.seq {
                j += 1;
            }
            match self.cont.get_mut(j) {
                Some(c) if c.seq == row.seq && c.rid == row.rid => {
                    c.context = c.context.saturating_add(u64::from(r));
                }
                // Forgotten during the step: nothing to grow.
                _ => {}
            }
        }
    }

    /// Applies a completed chunk of a planned step: its row moves to the chunk's end, and
    /// leaves the queue on the final chunk. Continuing rows: see [`NodeQueues::grow_contexts`].
    pub fn advance(&mut self, row: &PlannedRow) -> Advance {
        let RowWork::Chunk { range, .. } = row.work else {
            return Advance::Progressed;
        };
        let Ok(i) = self.prefill.binary_search_by_key(&row.seq, |r| r.seq) else {
            return Advance::Gone;
        };
        let r = &mut self.prefill[i];
        if r.rid != row.rid || r.progress != range.start {
            // Not the row this chunk was cut for (it was forgotten and re-admitted).
            return Advance::Gone;
        }
        if range.is_final() {
            if self.prefill.remove(i).started {
                self.mid_prefill -= 1;
            }
            self.drop_seq_if_idle(row.rid);
            self.prompt_totals.insert(row.rid, range.total);
            return Advance::Finished;
        }
        if !r.started {
            r.started = true;
            self.mid_prefill += 1;
        }
        r.progress = range.end;
        // It ran in the step last planned: its next wait starts with the step after it.
        r.wait_from_step = self.steps;
        r.wait_from_ms = self.last_now_ms;
        Advance::Progressed
    }

    /// The rows one step is planned from under `order`, at the engine's time `now_ms` if it
    /// gave one; the prefill rows' walk is ranked only when the order is not `fcfs`. Call
    /// [`NodeQueues::planned`] once the step is planned.
    pub fn view(&mut self, order: NodeOrder, now_ms: Option<f64>) -> QueueView<'_> {
        self.last_now_ms = now_ms;
        let rank = if order.order.is_fcfs() {
            None
        } else {
            let clock = self.clock(now_ms);
            order::rank(order, clock, &self.prefill, &mut self.rank);
            Some(self.rank.as_slice())
        };
        QueueView {
            cont: &self.cont,
            prefill: &self.prefill,
            rank,
        }
    }

    /// Counts a planned step: prompts still waiting have waited one step more.
    pub fn planned(&mut self) {
        self.steps += 1;
    }

    /// The node's clock at a step planned now: its planned steps so far and `now_ms`.
    pub fn clock(&self, now_ms: Option<f64>) -> StepClock {
        StepClock {
            step: self.steps,
            now_ms,
        }
    }

    /// How long the earliest admitted prompt that has not started has waited, as of the last
    /// planned step (its ms only when the engine gave that step's time and the prompt's
    /// arrival); `None` when no prompt waits.
    pub fn head_wait(&self) -> Option<Wait> {
        order::head_wait(&self.prefill, self.clock(self.last_now_ms))
    }

    /// Whether a priority given at admission under `order` should be warned about now: a
    /// priority other than 0 where the order is not `priority`, the first time on this node.
    pub fn warn_priority(&mut self, order: order::Order, priority: i32) -> bool {
        if priority == 0 || order == order::Order::Priority || self.priority_warned {
            return false;
        }
        self.priority_warned = true;
        true
    }

    /// Prefill rows held, mid-prefill or waiting to start.
    pub fn prefill_rows(&self) -> usize {
        self.prefill.len()
    }

    /// The rows queued, by state.
    pub fn counts(&self) -> QueueCounts {
        debug_assert_eq!(
            self.mid_prefill,
            self.prefill.iter().filter(|r| r.started).count()
        );
        QueueCounts {
            waiting: self.prefill.len() - self.mid_prefill,
            mid_prefill: self.mid_prefill,
            continuing: self.cont.len(),
        }
    }
}
