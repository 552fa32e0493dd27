//! The KV memory model of the simulation (`docs/kv-memory.md`): requests wait for memory
//! before they are admitted to the component, a planned step gets its blocks before it runs,
//! and a step that does not fit evicts prefix-cache blocks, then preempts by recompute.
//!
//! The block counts live in [`KvPool`]; this module decides when to admit, allocate, evict and
//! preempt, and talks to the component only through its public contract: admissions go with
//! the next step's message as the simulation's others do; a planned step that does not fit is
//! the simulation's one fallback to calls of their own (`abandon`, `forget_request` for each
//! preempted or withdrawn request, then `assemble` again).

use std::collections::VecDeque;

use super::{Phase, Sim};
use crate::replay::kv::KvPool;
use crate::replay::report::{KvReport, Latency};
use crate::replay::step_log::{KvStepLine, Preemption};
use crate::replay::{KvSetup, ReplayError, PREFILL_WALK};
use mstar_chunking::planner::RowWork;
use mstar_chunking::scheduler::Batch;

/// A request preempted `n` times is admitted again as `rid + n << RID_ATTEMPT_SHIFT`: every
/// admission is a row of its own in the component and the step log, which a step-log checker
/// sees as a fresh prefill. The trace's rid is the low 32 bits.
pub const RID_ATTEMPT_SHIFT: u32 = 32;
/// The trace rid's bits of a component rid.
pub const RID_MASK: u64 = (1 << RID_ATTEMPT_SHIFT) - 1;

/// The component rid of trace rid `rid` at its admission `attempt` (0: the first).
pub fn component_rid(rid: u64, attempt: u32) -> u64 {
    rid | (u64::from(attempt) << RID_ATTEMPT_SHIFT)
}

/// The simulation's side of the KV memory model.
#[derive(Debug)]
pub struct KvState {
    pub(super) pool: KvPool,
    /// The most tokens a first chunk may run (the step walk's token budget).
    pub(super) first_chunk_cap: Option<u32>,
    /// Requests waiting for memory, and since when (simulated ms); preempted ones in front.
    waiting: VecDeque<(usize, f64)>,
    /// Requests admitted to the component, in admission order (the last is the most recent).
    pub(super) running: Vec<usize>,
    source: String,
    watermark: f64,
    /// Preemptions since the last step line.
    events: Vec<Preemption>,
    preemptions: u64,
    preempted: Vec<bool>,
    recomputed_tokens: u64,
    withdrawn: u64,
    cache_evictions: u64,
    waits: Vec<f64>,
    /// Each request's priority, when the replayed node's order is `priority`
    /// (`docs/kv-memory.md#priority-preemption`): the memory queue is then ordered by
    /// priority, the lowest-priority running request is preempted first, and a waiting request
    /// may preempt a lower-priority one. `None`: arrival order, the newest preempted first.
    priorities: Option<Vec<i32>>,
}

impl KvState {
    /// The state for `requests` requests under `k`.
    pub fn new(k: &KvSetup, requests: usize) -> Self {
        Self {
            pool: KvPool::new(k.blocks, k.block_tokens, k.watermark_blocks(), requests),
            first_chunk_cap: None,
            waiting: VecDeque::new(),
            running: Vec::new(),
            source: k.source.clone(),
            watermark: k.watermark,
            events: Vec::new(),
            preemptions: 0,
            preempted: vec![false; requests],
            recomputed_tokens: 0,
            withdrawn: 0,
            cache_evictions: 0,
            waits: Vec::new(),
            priorities: None,
        }
    }

    /// Orders memory by `priorities` (request index -> priority, lower first): the node's order
    /// is `priority`.
    pub fn by_priority(&mut self, priorities: Vec<i32>) {
        self.priorities = Some(priorities);
    }

    /// Request `i` arrived at a step boundary `t_ms`: it waits for memory, behind the others
    /// (under priority, behind those of its priority or higher).
    pub fn enqueue_arrival(&mut self, i: usize, t_ms: f64) {
        match &self.priorities {
            None => self.waiting.push_back((i, t_ms)),
            Some(_) => self.insert_by_priority(i, t_ms),
        }
    }

    /// Request `i`, preempted or withdrawn at `t_ms`, waits again: at the front of the queue
    /// (under priority, in its priority's place by arrival, as vLLM's priority queue keeps it).
    fn requeue(&mut self, i: usize, t_ms: f64) {
        match &self.priorities {
            None => self.waiting.push_front((i, t_ms)),
            Some(_) => self.insert_by_priority(i, t_ms),
        }
    }

    /// The priority of request `i` (0 without priority ordering).
    fn priority(&self, i: usize) -> i32 {
        self.priorities
            .as_ref()
            .and_then(|p| p.get(i).copied())
            .unwrap_or(0)
    }

    /// Inserts `i` into the memory queue ordered by (priority, arrival): trace order is arrival
    /// order, so the index breaks ties.
    fn insert_by_priority(&mut self, i: usize, t_ms: f64) {
        let key = (self.priority(i), i);
        let at = self
            .waiting
            .iter()
            .position(|&(w, _)| (self.priority(w), w) > key)
            .unwrap_or(self.waiting.len());
        self.waiting.insert(at, (i, t_ms));
    }

    /// The position in `running` of the request to preempt when memory runs out: the most
    /// recently admitted that holds blocks; under priority, the lowest priority first, then the
    /// latest arrival (trace order; vLLM's `max(running, key=(priority, arrival_time))`).
    fn victim(&self) -> Option<usize> {
        let holds = |&(_, &r): &(usize, &usize)| self.pool.held(r) > 0;
        match &self.priorities {
            None => self.running.iter().rposition(|&r| self.pool.held(r) > 0),
            Some(_) => self
                .running
                .iter()
                .enumerate()
                .filter(holds)
                .max_by_key(|&(_, &r)| (self.priority(r), r))
                .map(|(pos, _)| pos),
        }
    }

    /// Under priority, the position in `running` of a request a waiting `head` that does not
    /// fit may preempt: of strictly lower priority (a higher value) and holding blocks, the
    /// lowest priority first, then the latest arrival. `None` otherwise.
    fn arrival_victim(&self, head: usize) -> Option<usize> {
        self.priorities.as_ref()?;
        let mine = self.priority(head);
        self.running
            .iter()
            .enumerate()
            .filter(|&(_, &r)| self.pool.held(r) > 0 && self.priority(r) > mine)
            .max_by_key(|&(_, &r)| (self.priority(r), r))
            .map(|(pos, _)| pos)
    }

    /// What the step log shows of the step just planned: blocks in use and the preemptions
    /// that made room. Samples the utilisation.
    pub fn step_line(&mut self) -> KvStepLine {
        self.pool.sample();
        KvStepLine {
            blocks: self.pool.used(),
            cache_blocks: self.pool.cache_used(),
            limit: self.pool.limit(),
            waiting: self.waiting.len(),
            preempted: std::mem::take(&mut self.events),
        }
    }

    /// Pools another worker's counts (its pool the same size as this one) into these, for a
    /// fleet's report: sums, every wait, the larger peak, the mean over every worker's steps.
    pub fn absorb(&mut self, other: KvState) {
        self.pool.absorb_figures(&other.pool);
        self.preemptions += other.preemptions;
        for (mine, theirs) in self.preempted.iter_mut().zip(other.preempted) {
            *mine |= theirs;
        }
        self.recomputed_tokens += other.recomputed_tokens;
        self.withdrawn += other.withdrawn;
        self.cache_evictions += other.cache_evictions;
        self.waits.extend(other.waits);
    }

    /// The figures of the report.
    pub fn report(mut self) -> KvReport {
        let limit = self.pool.limit();
        let total: f64 = self.waits.iter().sum();
        let waited = self.waits.iter().filter(|w| **w > 0.0).count();
        KvReport {
            blocks: limit,
            block_tokens: self.pool.block_tokens(),
            watermark: self.watermark,
            watermark_blocks: self.pool.watermark(),
            source: self.source,
            peak_blocks: self.pool.peak(),
            peak_utilisation: self.pool.peak() as f64 / limit as f64,
            mean_utilisation: self.pool.mean_utilisation(),
            preemptions: self.preemptions,
            preempted_requests: self.preempted.iter().filter(|p| **p).count(),
            recomputed_tokens: self.recomputed_tokens,
            withdrawn_admissions: self.withdrawn,
            cache_evictions: self.cache_evictions,
            memory_wait_total_ms: total,
            admissions_waited: waited,
            memory_wait_ms: Latency::of(&mut self.waits),
        }
    }
}

/// What a planned step needs: for each row, the request and the tokens its KV cache must hold
/// while the step runs.
struct Need {
    i: usize,
    tokens: u64,
    /// Whether the request already holds blocks (it ran a chunk, or it decodes).
    started: bool,
}

impl Sim<'_> {
    /// Requests waiting for memory (0 without a KV limit).
    pub(super) fn memory_waiting(&self) -> usize {
        self.kv.as_ref().map_or(0, |k| k.waiting.len())
    }

    /// Refuses a trace with a request that could never fit in the pool, even alone
    /// ([`crate::replay::check_kv_fits`]).
    pub(super) fn check_kv_fits(&self) -> Result<(), ReplayError> {
        crate::replay::check_kv_fits(self.setup, self.trace)
    }

    /// Admits waiting requests (before the next step), front first, while the head's first
    /// chunk fits with the watermark kept free (`KvPool::can_admit`), preempting a running
    /// request of lower priority for the head where the priority order allows it. Answers
    /// whether it admitted or preempted any.
    pub(super) async fn admit_waiting(&mut self) -> Result<bool, ReplayError> {
        let mut any = false;
        while let Some((i, since, need)) = self.head_need() {
            let Some(kv) = &self.kv else { break };
            let alone = self.prefilling == 0 && self.decoding == 0;
            if !kv.pool.can_admit(need, alone) {
                break;
            }
            let t = self.t_ms;
            if let Some(kv) = &mut self.kv {
                kv.waiting.pop_front();
                kv.waits.push(t - since);
            }
            let transferred = self.arrives_decoding(i);
            self.admit(i);
            if let Some(kv) = &mut self.kv {
                if transferred {
                    // Its prompt's KV arrived whole: held at once, not reserved.
                    if kv.pool.grow(i, self.state[i].true_context - 1).is_err() {
                        return Err(ReplayError::KvStuck {
                            rid: self.trace.requests[i].rid,
                            blocks: kv.pool.limit(),
                        });
                    }
                } else {
                    kv.pool.reserve(i, need);
                }
                kv.running.push(i);
            }
            any = true;
        }
        Ok(any)
    }

    /// The head of the memory queue, since when it waits, and the blocks its first chunk needs.
    pub(super) fn head_need(&self) -> Option<(usize, f64, u64)> {
        let kv = self.kv.as_ref()?;
        let &(i, since) = kv.waiting.front()?;
        let r = &self.trace.requests[i];
        if self.arrives_decoding(i) {
            // Its prompt's KV, moved from a prefill worker.
            let held = self.state[i].true_context - 1;
            return Some((i, since, kv.pool.blocks_for(held)));
        }
        let total = r.input_tokens + self.state[i].generated;
        let cached = self
            .cache
            .as_ref()
            .map_or(0, |c| c.peek(self.trace.hashes(r), total));
        let first = (total - cached).min(kv.first_chunk_cap.unwrap_or(u32::MAX));
        Some((
            i,
            since,
            kv.pool.blocks_for(u64::from(cached) + u64::from(first)),
        ))
    }

    /// Under priority: a memory queue head that cannot be admitted and a running request of
    /// lower priority that holds blocks: that request's position in `running`, to preempt so
    /// the head is admitted before the next step. Taken while a planned step has not run (as
    /// every preemption is), so no step in flight holds the victim's rows.
    fn arrival_victim_for_head(&self) -> Option<usize> {
        let (head, _, need) = self.head_need()?;
        let kv = self.kv.as_ref()?;
        let alone = self.prefilling == 0 && self.decoding == 0;
        if kv.pool.can_admit(need, alone) {
            return None;
        }
        kv.arrival_victim(head)
    }

    /// Gives the planned `batch` (whose rows run `self.ran`) its blocks. When they do not fit:
    /// prefix-cache blocks are evicted, least recently used first; then requests that hold
    /// blocks are preempted, most recently admitted first, until the started rows fit; a first
    /// chunk that still does not fit sends its prompt back to wait. Answers `false` when the
    /// step was abandoned to be planned again (a row's request left it).
    pub(super) async fn allocate(&mut self, batch: &Batch) -> Result<bool, ReplayError> {
        let mut needs = Vec::with_capacity(batch.rows.len());
        for (row, &ran) in batch.rows.iter().zip(&self.ran) {
            let Some(i) = self.index_of(row.rid) else {
                continue;
            };
            let s = &self.state[i];
            let tokens = match row.work {
                RowWork::Chunk { range, .. } => u64::from(range.end),
                // The KV cache holds the prompt and every generated token but the last, which
                // this step runs with its speculative tokens.
                RowWork::Continue { .. } => {
                    u64::from(self.trace.requests[i].input_tokens) + u64::from(s.generated) - 1
                        + u64::from(ran)
                }
            };
            let started = s.phase == Phase::Decoding || s.prefilled > 0;
            needs.push(Need { i, tokens, started });
        }
        let arrival_victim = self.arrival_victim_for_head();
        let Some(kv) = self.kv.as_mut() else {
            return Ok(true);
        };
        let per_cache_block = self
            .cache
            .as_ref()
            .map_or(0, |c| kv.pool.blocks_for(u64::from(c.block_tokens())));
        let mut victims: Vec<(usize, u64)> = Vec::new();
        let mut withdrawn: Vec<usize> = Vec::new();
        // A waiting request of higher priority preempts first (one per step planned).
        if let Some(pos) = arrival_victim {
            let v = kv.running.remove(pos);
            let freed = kv.pool.release(v);
            victims.push((v, freed));
            needs.retain(|n| n.i != v);
        }
        // Started rows first (running requests, which may preempt), then first chunks (new
        // prompts, which only take what is free), each in batch order.
        needs.sort_by_key(|n| !n.started);
        let mut granted = 0u64;
        let mut k = 0;
        while k < needs.len() {
            let (ni, ntokens, nstarted) = (needs[k].i, needs[k].tokens, needs[k].started);
            let extra = kv.pool.extra_for(ni, ntokens);
            if granted + extra <= kv.pool.free() {
                granted += extra;
                k += 1;
                continue;
            }
            if let Some(c) = self.cache.as_mut() {
                if c.evict_lru() {
                    let _ = kv.pool.set_cache(c.len() as u64 * per_cache_block);
                    kv.cache_evictions += 1;
                    continue;
                }
            }
            if !nstarted {
                withdrawn.push(ni);
                needs.remove(k);
                continue;
            }
            // The most recently admitted request that holds blocks (under priority, the
            // lowest priority first); preempting one that holds none frees nothing.
            let Some(pos) = kv.victim() else {
                return Err(ReplayError::KvStuck {
                    rid: self.trace.requests[ni].rid,
                    blocks: kv.pool.limit(),
                });
            };
            let v = kv.running.remove(pos);
            let freed = kv.pool.release(v);
            victims.push((v, freed));
            // Its rows leave the plan; what the rows before it were granted is counted again.
            needs.retain(|n| n.i != v);
            granted = 0;
            k = 0;
        }
        let replan = victims
            .iter()
            .map(|(v, _)| *v)
            .chain(withdrawn.iter().copied())
            .any(|v| {
                batch
                    .rows
                    .iter()
                    .any(|row| self.index_of(row.rid) == Some(v))
            });
        if replan {
            self.cm
                .abandon(batch.step)
                .await
                .map_err(ReplayError::chunking("abandoning a step that did not fit"))?;
        }
        for i in withdrawn {
            self.withdraw(i).await?;
        }
        for (v, freed) in victims {
            self.preempt(v, freed).await?;
        }
        if replan {
            return Ok(false);
        }
        if let Some(kv) = self.kv.as_mut() {
            for n in &needs {
                if kv.pool.grow(n.i, n.tokens).is_err() {
                    return Err(ReplayError::KvStuck {
                        rid: self.trace.requests[n.i].rid,
                        blocks: kv.pool.limit(),
                    });
                }
            }
        }
        Ok(true)
    }

    /// Takes request `i` out of the component (`forget_request`) and its prefill counts.
    async fn leave_component(&mut self, i: usize) -> Result<(), ReplayError> {
        let rid = component_rid(self.trace.requests[i].rid, self.state[i].attempt);
        let s = self.state[i];
        match s.phase {
            Phase::Prefilling => {
                self.prefilling -= 1;
                self.held_rows -= 1;
                self.held_tokens -= u64::from(s.input_total);
            }
            Phase::Decoding => self.decoding -= 1,
            Phase::Waiting | Phase::Done => {}
        }
        self.state[i].phase = Phase::Waiting;
        self.cm
            .forget_request(rid)
            .await
            .map_err(ReplayError::chunking("preempting a request"))
    }

    /// A prompt admitted but not started whose first chunk did not fit goes back to the front
    /// of the queue (as a waiting request vLLM cannot allocate for is not scheduled).
    async fn withdraw(&mut self, i: usize) -> Result<(), ReplayError> {
        self.leave_component(i).await?;
        let t = self.t_ms;
        if let Some(kv) = &mut self.kv {
            kv.pool.release(i);
            kv.running.retain(|&r| r != i);
            kv.requeue(i, t);
            kv.withdrawn += 1;
        }
        Ok(())
    }

    /// Preempts request `i` by recompute (its `freed` blocks already released): it leaves the
    /// component and waits at the front of the queue to prefill its prompt and the tokens it
    /// had generated, under its next component rid.
    async fn preempt(&mut self, i: usize, freed: u64) -> Result<(), ReplayError> {
        let s = self.state[i];
        let prompt = self.trace.requests[i].input_tokens;
        let discarded = match s.phase {
            Phase::Decoding => u64::from(prompt) + u64::from(s.generated) - 1,
            _ => u64::from(s.prefilled),
        };
        self.leave_component(i).await?;
        self.state[i].attempt += 1;
        let rid = self.trace.requests[i].rid;
        let t = self.t_ms;
        if let Some(kv) = &mut self.kv {
            kv.requeue(i, t);
            kv.preemptions += 1;
            kv.preempted[i] = true;
            kv.recomputed_tokens += discarded;
            kv.events.push(Preemption {
                rid,
                row_rid: component_rid(rid, s.attempt),
                readmit_rid: component_rid(rid, s.attempt + 1),
                generated: s.generated,
                during_prefill: s.phase == Phase::Prefilling,
                discarded_tokens: discarded,
                blocks: freed,
            });
        }
        Ok(())
    }

    /// Request `i` ended: its blocks are free.
    pub(super) fn release_kv(&mut self, i: usize) {
        if let Some(kv) = &mut self.kv {
            kv.pool.release(i);
            kv.running.retain(|&r| r != i);
        }
    }

    /// After the prefix cache took a prompt's blocks: evicts its least recently used blocks
    /// until it fits in the pool's free blocks.
    pub(super) fn fit_cache(&mut self) {
        let (Some(kv), Some(c)) = (&mut self.kv, &mut self.cache) else {
            return;
        };
        let per = kv.pool.blocks_for(u64::from(c.block_tokens()));
        while kv.pool.set_cache(c.len() as u64 * per).is_err() {
            if !c.evict_lru() {
                let _ = kv.pool.set_cache(0);
                break;
            }
            kv.cache_evictions += 1;
        }
    }
}

/// The walk a prompt's first chunk is planned on is the first step walk (`prefill`, or the
/// combined walk): its token budget bounds a first chunk.
pub fn first_chunk_walk(walks: &[String]) -> &str {
    walks.first().map_or(PREFILL_WALK, String::as_str)
}
