//! The step planner (SPEC §5): which rows run in the next step of one `(node, walk)`, and how
//! many tokens each. A pure function over the node's queues and the step's [`StepParams`].

use std::sync::Arc;

use crate::range::ChunkRange;
use crate::Name;

/// Everything one step of `(node, walk)` is planned under, precomputed from a budget snapshot so
/// a step's assembly does no map lookups per row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepParams {
    pub node: Name,
    pub walk: Name,
    /// `B`: the step's budget (the combined walk's under a combined walk); `None` runs all whole.
    pub budget: Option<u32>,
    /// `F`: the fewest tokens a row is cut to, `min(min_chunk_tokens, B, max_row_tokens)`.
    pub floor: u32,
    /// Per member walk, the most tokens its rows may run in the step (`walk_caps`); empty if none.
    pub caps: Arc<[(Name, u32)]>,
    /// Whether prefill rows can be cut in this step (`chunkable(node, walk)` of the step walk).
    pub chunkable: bool,
    /// The step walk's policy `align`: non-final chunks end on a multiple of it.
    pub align: u32,
    /// The walks whose rows this step takes: the step walk and, for a combined walk, its members.
    pub eligible: Arc<[Name]>,
    /// Optional per-row cap on tokens a step.
    pub max_row_tokens: Option<u32>,
    /// Optional limit on rows left mid-prefill by starting new ones.
    pub max_partial_prefills: Option<u32>,
}

impl StepParams {
    /// The index of `walk` in `eligible`, if this step takes its rows. Row walks are interned
    /// from the same snapshot, so the pointer comparison settles it without comparing names.
    pub fn walk_index(&self, walk: &Name) -> Option<usize> {
        self.eligible
            .iter()
            .position(|w| Arc::ptr_eq(w, walk))
            .or_else(|| self.eligible.iter().position(|w| w == walk))
    }

    fn takes(&self, walk: &Name) -> bool {
        self.walk_index(walk).is_some()
    }

    /// The most tokens rows of `walk` may run in a step: its cap, or unlimited.
    fn cap(&self, walk: &Name) -> u64 {
        self.cap_index(walk)
            .map_or(u64::MAX, |i| u64::from(self.caps[i].1))
    }

    fn cap_index(&self, walk: &Name) -> Option<usize> {
        self.caps
            .iter()
            .position(|(w, _)| Arc::ptr_eq(w, walk) || w == walk)
    }
}

/// A continuing row (decode, speculative verify): it runs its estimate every step it fits and is
/// never cut.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContRow {
    /// Admission order within the node.
    pub seq: u64,
    pub rid: u64,
    pub walk: Name,
    /// Tokens the row is expected to run: 1 for plain decode, `k + 1` for `k` speculative tokens.
    pub estimate: u32,
}

/// A prompt being prefilled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefillRow {
    /// Admission order within the node.
    pub seq: u64,
    pub rid: u64,
    pub walk: Name,
    /// Tokens of the whole prepared input.
    pub total: u32,
    /// The cached prefix, at most `total - 1`.
    pub cached: u32,
    /// Tokens done: the end of the last completed chunk, or `cached` before the first.
    pub progress: u32,
    /// Whether a chunk of this row has completed (the row is mid-prefill).
    pub started: bool,
}

/// What one planned row runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Work {
    /// A continuing row, at its estimate.
    Continue { estimate: u32 },
    /// A chunk of a prefill row; `cached` is the cached prefix on a first chunk, else 0.
    Chunk { range: ChunkRange, cached: u32 },
}

impl Work {
    /// The tokens this work is scheduled to run.
    pub fn tokens(&self) -> u32 {
        match self {
            Work::Continue { estimate } => *estimate,
            Work::Chunk { range, .. } => range.tokens(),
        }
    }
}

/// One row of a planned step. Plain data (no reference counts), so planning and clearing a
/// plan touch no shared counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlannedRow {
    pub seq: u64,
    pub rid: u64,
    /// The row's walk, as an index into the step's [`StepParams::eligible`].
    pub walk: usize,
    pub work: Work,
}

/// The plan of one step. Reused across steps by the caller to avoid reallocating.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepPlan {
    pub rows: Vec<PlannedRow>,
    /// Sum of the rows' tokens.
    pub scheduled_tokens: u64,
    /// Sum of the continuing rows' estimates.
    pub continue_estimate: u64,
    /// Eligible rows left waiting for a later step.
    pub waiting: u32,
    /// A row that cannot be cut ran whole over the budget (the step overruns by plan).
    pub uncut_over_budget: bool,
}

impl StepPlan {
    /// Empties the plan, keeping its capacity.
    pub fn clear(&mut self) {
        self.rows.clear();
        self.scheduled_tokens = 0;
        self.continue_estimate = 0;
        self.waiting = 0;
        self.uncut_over_budget = false;
    }

    fn push(&mut self, seq: u64, rid: u64, walk: usize, work: Work) {
        let tokens = u64::from(work.tokens());
        self.scheduled_tokens += tokens;
        if matches!(work, Work::Continue { .. }) {
            self.continue_estimate += tokens;
        }
        self.rows.push(PlannedRow {
            seq,
            rid,
            walk,
            work,
        });
    }
}

/// Plans one step into `out` (cleared first).
///
/// `cont` and `prefill` are the node's queues in admission order. Rules (SPEC §5):
/// 1. no budget: every eligible row runs whole;
/// 2. continuing rows first, in order, while each fits what is left of the budget and of its
///    walk's cap; from the first that does not fit the rest wait; a first row larger than the
///    budget (or its cap) runs alone;
/// 3. prefill rows next, mid-prefill ones first, each group FCFS: the rest runs whole when it
///    fits; else it is cut to what is left (and to `max_row_tokens`), rounded down to `align`,
///    if that is at least the floor; a row that cannot be cut and is larger than the budget
///    runs whole when no other prefill row is in the step, and waits otherwise.
pub fn plan(params: &StepParams, cont: &[ContRow], prefill: &[PrefillRow], out: &mut StepPlan) {
    out.clear();
    let Some(budget) = params.budget else {
        plan_unbudgeted(params, cont, prefill, out);
        return;
    };
    let budget = u64::from(budget);
    let mut used: u64 = 0;
    // Tokens taken per cap, indexed like `params.caps`: on the stack for the few member walks a
    // combined walk has, so a step allocates nothing.
    let mut cap_used_inline = [0u64; 8];
    let mut cap_used_heap;
    let cap_used: &mut [u64] = match params.caps.len() {
        n if n <= cap_used_inline.len() => &mut cap_used_inline[..n],
        n => {
            cap_used_heap = vec![0u64; n];
            &mut cap_used_heap
        }
    };
    // The cap index of an eligible walk (by its index in `params.eligible`).
    let cap_of = |walk: usize| -> Option<usize> {
        if params.caps.is_empty() {
            return None;
        }
        params.cap_index(&params.eligible[walk])
    };
    let cap_left = |cap_used: &[u64], walk: usize| -> u64 {
        cap_of(walk).map_or(u64::MAX, |i| {
            u64::from(params.caps[i].1).saturating_sub(cap_used[i])
        })
    };
    let take = |cap_used: &mut [u64], walk: usize, tokens: u64| {
        if let Some(i) = cap_of(walk) {
            cap_used[i] += tokens;
        }
    };

    // Rule 2: continuing rows, never cut, no overtaking.
    let mut eligible_cont = cont
        .iter()
        .filter_map(|r| Some((r, params.walk_index(&r.walk)?)));
    for (r, walk) in eligible_cont.by_ref() {
        let est = u64::from(r.estimate);
        let fits = est <= budget.saturating_sub(used) && est <= cap_left(cap_used, walk);
        if fits {
            used += est;
            take(cap_used, walk, est);
            out.push(
                r.seq,
                r.rid,
                walk,
                Work::Continue {
                    estimate: r.estimate,
                },
            );
            continue;
        }
        out.waiting += 1;
        if out.rows.is_empty() {
            // The very first row alone is larger than the budget (or its cap): it runs alone,
            // or it would never run.
            out.waiting -= 1;
            out.uncut_over_budget = true;
            out.push(
                r.seq,
                r.rid,
                walk,
                Work::Continue {
                    estimate: r.estimate,
                },
            );
            out.waiting += count_u32(eligible_cont.by_ref());
            out.waiting += count_u32(prefill.iter().filter(|p| params.takes(&p.walk)));
            return;
        }
        break;
    }
    out.waiting += count_u32(eligible_cont);

    // Rule 3: prefill rows, mid-prefill first, then new ones, each group FCFS.
    let row_cap = u64::from(params.max_row_tokens.unwrap_or(u32::MAX));
    let align = u64::from(params.align.max(1));
    let floor = u64::from(params.floor);
    // Rows that would stay mid-prefill after this step, for `max_partial_prefills`: every started
    // row, less those that finish in this step, plus new rows started with a non-final chunk.
    let mut staying_partial = count_u32(prefill.iter().filter(|p| p.started));
    let mut prefill_in_step = false;
    for mid in [true, false] {
        let group = prefill
            .iter()
            .filter(|p| p.started == mid)
            .filter_map(|r| Some((r, params.walk_index(&r.walk)?)));
        for (r, walk) in group {
            let left = budget.saturating_sub(used).min(cap_left(cap_used, walk));
            let progress = u64::from(r.progress);
            let need = u64::from(r.total) - progress;
            let work = if need <= left.min(row_cap) {
                Some(progress + need)
            } else if params.chunkable {
                let partial_full = !mid
                    && params
                        .max_partial_prefills
                        .is_some_and(|p| staying_partial >= p);
                let end = (progress + left.min(row_cap)) / align * align;
                (!partial_full && end > progress && end - progress >= floor).then_some(end)
            } else if need <= left || (need > budget.min(params.cap(&r.walk)) && !prefill_in_step) {
                // An uncut row: whole when it fits, or whole over the budget when first, since
                // it would never run otherwise.
                out.uncut_over_budget |= need > left;
                Some(progress + need)
            } else {
                None
            };
            let Some(end) = work else {
                out.waiting += 1;
                continue;
            };
            // `end <= total <= u32::MAX`, so these conversions cannot truncate.
            let end = end as u32;
            let range = ChunkRange::new(!r.started, r.progress, end, r.total);
            let cached = if r.started { 0 } else { r.cached };
            match (range.is_final(), mid) {
                (true, true) => staying_partial -= 1,
                (false, false) => staying_partial += 1,
                _ => {}
            }
            used += u64::from(range.tokens());
            take(cap_used, walk, u64::from(range.tokens()));
            prefill_in_step = true;
            out.push(r.seq, r.rid, walk, Work::Chunk { range, cached });
        }
    }
}

/// Rule 1: a step without a budget runs every eligible row whole.
fn plan_unbudgeted(
    params: &StepParams,
    cont: &[ContRow],
    prefill: &[PrefillRow],
    out: &mut StepPlan,
) {
    for r in cont {
        let Some(walk) = params.walk_index(&r.walk) else {
            continue;
        };
        out.push(
            r.seq,
            r.rid,
            walk,
            Work::Continue {
                estimate: r.estimate,
            },
        );
    }
    for mid in [true, false] {
        for r in prefill.iter().filter(|p| p.started == mid) {
            let Some(walk) = params.walk_index(&r.walk) else {
                continue;
            };
            let range = ChunkRange::new(!r.started, r.progress, r.total, r.total);
            let cached = if r.started { 0 } else { r.cached };
            out.push(r.seq, r.rid, walk, Work::Chunk { range, cached });
        }
    }
}

fn count_u32<I: Iterator>(it: I) -> u32 {
    u32::try_from(it.count()).unwrap_or(u32::MAX)
}
