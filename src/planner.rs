//! The step planner (docs/scheduling.md#planner-rules): which rows run in the next step of one `(node, walk)`, and how
//! many tokens each. A pure function over the node's queues and the step's [`StepParams`].

use std::sync::Arc;

use crate::latency::{ChunkBounds, LatencyModel, StepFeatures};
use crate::order::{NodeOrder, StepClock, Wait, WaitBound};
use crate::overrun::TimeOverrunReason;
use crate::policy::Name;
use crate::range::ChunkRange;
pub use crate::rows::{ContRow, PrefillRow};

/// Everything one step of `(node, walk)` is planned under, precomputed from a budget snapshot so
/// a step's assembly does no map lookups per row.
#[derive(Debug, Clone, PartialEq)]
pub struct StepParams {
    /// The node.
    pub node: Name,
    /// The step walk.
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
    /// Input slots each row takes beyond its tokens, charged to the step's budget (not to walk
    /// caps): a row fits when its tokens and these slots fit in what is left.
    pub slots_per_row: u32,
    /// The step's time budget in ms (`docs/cost-model.md#time-budgets`); `None` without one.
    pub max_step_ms: Option<f64>,
    /// The node's configured latency model (`chunking.cost.<node>`), if any.
    pub cost: Option<LatencyModel>,
    /// Whether the node's latency model is fitted online (`chunking.learn_cost`).
    pub learn_cost: bool,
    /// The time margin's quantile, if steps are planned with one
    /// (`docs/cost-model.md#the-time-margin`).
    pub margin_quantile: Option<f64>,
    /// The node's order of waiting prompts and its starvation bound (`chunking.order`,
    /// `chunking.max_wait_*`): [`plan_ranked`]'s walk when it is not `fcfs`.
    pub order: NodeOrder,
    /// Under a time limit, whether the first prefill row's floor chunk yields to the time
    /// budget (`chunking.time_floor`, `docs/cost-model.md#time-budgets`): `Some(bound)` when
    /// it waits beside continuing rows it does not fit with, until its wait for a chunk
    /// reaches `bound`; `None` when it always runs (`time_floor = "run"`).
    pub floor_yield: Option<WaitBound>,
}

/// A step's time limit: the latency model it is planned with, its time budget, and when the
/// step is planned (for the wait the floor yields by).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TimeLimit {
    /// The model predicting the step's time.
    pub model: LatencyModel,
    /// The time budget, in ms.
    pub max_step_ms: f64,
    /// The node's planned steps before this one and the step's time, if the engine gave one.
    pub clock: StepClock,
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
    pub fn cap(&self, walk: &Name) -> u64 {
        self.cap_index(walk)
            .map_or(u64::MAX, |i| u64::from(self.caps[i].1))
    }

    fn cap_index(&self, walk: &Name) -> Option<usize> {
        self.caps
            .iter()
            .position(|(w, _)| Arc::ptr_eq(w, walk) || w == walk)
    }
}

/// What one planned row runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowWork {
    /// A continuing row, at its estimate.
    Continue {
        /// Tokens it is expected to run.
        estimate: u32,
    },
    /// A chunk of a prefill row.
    Chunk {
        /// The tokens it runs.
        range: ChunkRange,
        /// The cached prefix on a first chunk, else 0.
        cached: u32,
    },
}

impl RowWork {
    /// The tokens this work is scheduled to run.
    pub fn tokens(&self) -> u32 {
        match self {
            RowWork::Continue { estimate } => *estimate,
            RowWork::Chunk { range, .. } => range.tokens(),
        }
    }

    /// A continuing row's estimate; `None` for a chunk.
    pub(crate) fn continue_estimate(&self) -> Option<u32> {
        match self {
            RowWork::Continue { estimate } => Some(*estimate),
            RowWork::Chunk { .. } => None,
        }
    }
}

/// One row of a planned step. Plain data (no reference counts), so planning and clearing a
/// plan touch no shared counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlannedRow {
    /// The row's admission order within the node.
    pub seq: u64,
    /// The request.
    pub rid: u64,
    /// The row's walk, as an index into the step's [`StepParams::eligible`].
    pub walk: usize,
    /// What it runs.
    pub work: RowWork,
    /// A continuing row's context ([`ContRow::context`]); 0 for a chunk.
    pub context: u64,
}

/// The plan of one step. Reused across steps by the caller to avoid reallocating.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepPlan {
    /// The rows, continuing rows first.
    pub rows: Vec<PlannedRow>,
    /// How many of `rows` are continuing rows: they come first, the chunks after them.
    pub continuing: usize,
    /// Sum of the rows' tokens.
    pub scheduled_tokens: u64,
    /// Sum of the continuing rows' estimates.
    pub continue_estimate: u64,
    /// Eligible rows left waiting for a later step.
    pub waiting: u32,
    /// A row that cannot be cut ran whole over the budget (the step overruns by plan).
    pub uncut_over_budget: bool,
    /// What the step's time depends on (`docs/cost-model.md`), accumulated row by row.
    pub features: StepFeatures,
    /// The step's time limit, if it was planned under one.
    pub time: Option<TimeLimit>,
    /// Why the plan knowingly goes over its time budget (its liveness cases), if it does.
    pub time_over: Option<TimeOverrunReason>,
    /// The first prefill row in order waits because even its floor chunk does not fit in time
    /// beside the step's other rows, and it has not waited out the starvation bound
    /// ([`StepParams::floor_yield`]).
    pub floor_yielded: bool,
}

impl StepPlan {
    /// The step's predicted time in ms under `model`.
    pub fn predicted_ms(&self, model: &LatencyModel) -> f64 {
        model.predict_ms(&self.features)
    }
}

impl StepPlan {
    /// Empties the plan, keeping its capacity.
    pub fn clear(&mut self) {
        self.rows.clear();
        self.continuing = 0;
        self.scheduled_tokens = 0;
        self.continue_estimate = 0;
        self.waiting = 0;
        self.uncut_over_budget = false;
        self.features = StepFeatures::EMPTY;
        self.time = None;
        self.time_over = None;
        self.floor_yielded = false;
    }

    /// A prefill row runs over the time budget by a liveness rule (`floor`, `uncut_row`): that
    /// names the step's time overrun, over `continuing` (continuing rows already over time,
    /// which the prefill row ran on top of); the first such reason stays.
    fn prefill_over_time(&mut self, reason: TimeOverrunReason) {
        match self.time_over {
            None | Some(TimeOverrunReason::Continuing) => self.time_over = Some(reason),
            Some(_) => {}
        }
    }

    fn push(&mut self, seq: u64, rid: u64, walk: usize, work: RowWork, context: u64) {
        let tokens = u64::from(work.tokens());
        self.scheduled_tokens += tokens;
        match work {
            RowWork::Continue { estimate } => {
                // Every planner pushes the continuing rows before any chunk.
                debug_assert_eq!(
                    self.continuing,
                    self.rows.len(),
                    "a continuing row after a chunk"
                );
                self.continuing += 1;
                self.continue_estimate += tokens;
                // Rows are counted once the continuing rows are in ([`Self::count_continuing`]):
                // one store for the step instead of one sum a row.
                self.features.add_continuing_work(estimate, context);
            }
            RowWork::Chunk { range, .. } => self.features.add_chunk(range.start, range.end),
        }
        self.rows.push(PlannedRow {
            seq,
            rid,
            walk,
            work,
            context,
        });
    }

    /// Counts the continuing rows pushed so far in the step's features (`R`): called once their
    /// loop ends, before any chunk is pushed or any prediction made.
    fn count_continuing(&mut self) {
        self.features.rows = self.continuing as u64;
    }

    fn push_continuing(&mut self, r: &ContRow, walk: usize) {
        let work = RowWork::Continue {
            estimate: r.estimate,
        };
        self.push(r.seq, r.rid, walk, work, r.context);
    }

    fn push_chunk(&mut self, r: &PrefillRow, walk: usize, end: u32) {
        let range = ChunkRange::new(!r.started, r.progress, end, r.total);
        let cached = if r.started { 0 } else { r.cached };
        self.push(r.seq, r.rid, walk, RowWork::Chunk { range, cached }, 0);
    }

    /// Whether the step as planned so far is predicted over its time budget.
    fn over_time(&self) -> bool {
        self.time
            .is_some_and(|t| t.model.predict_ms(&self.features) > t.max_step_ms)
    }
}

/// Plans one step into `out` (cleared first), under `params` alone: the time limit, if any, is
/// the configured model's ([`StepParams::cost`]). See [`plan_timed`] for the rules.
pub fn plan(params: &StepParams, cont: &[ContRow], prefill: &[PrefillRow], out: &mut StepPlan) {
    let time = params
        .max_step_ms
        .zip(params.cost)
        .map(|(max_step_ms, model)| TimeLimit {
            model,
            max_step_ms,
            clock: StepClock::default(),
        });
    plan_timed(params, time, cont, prefill, out);
}

/// Plans one step into `out` (cleared first), with `time` the step's time limit (the latency
/// model in use, online or configured, and the time budget), if it has one.
///
/// `cont` and `prefill` are the node's queues in admission order. The rules
/// (`docs/scheduling.md#planner-rules`, `docs/cost-model.md#time-budgets`):
/// 1. no budget: every eligible row runs whole (`plan_unbudgeted`);
/// 2. continuing rows first, in order, while each fits the room left in the budget and in its
///    walk's cap; from the first that does not fit the rest wait; a first row larger than the
///    room runs alone (`plan_continuing`). The time limit never holds them back;
/// 3. prefill rows next, mid-prefill ones first, each group FCFS (`plan_prefill`): the rest
///    runs whole when it fits; else it is cut to the room left (and to `max_row_tokens`),
///    rounded down to `align`, if that is at least the floor (`chunk_end`); a row that
///    cannot be cut and is larger than the budget runs whole when no other prefill row is in
///    the step, and waits otherwise (`uncut_end`);
/// 4. with a time limit, each chunk also ends at the largest aligned end whose step is
///    predicted within the time budget; the first prefill row in order still runs a chunk of
///    the floor when less fits in time, and a first row that cannot be cut still runs whole
///    (both counted in [`StepPlan::time_over`]); other rows that do not fit in time wait
///    (`timed_end`).
pub fn plan_timed(
    params: &StepParams,
    time: Option<TimeLimit>,
    cont: &[ContRow],
    prefill: &[PrefillRow],
    out: &mut StepPlan,
) {
    plan_timed_with(params, time, cont, prefill, out, true);
}

/// [`plan_timed`] with the prefill rows walked in `rank` order (indices into `prefill`, each
/// once, mid-prefill rows first: [`crate::order::rank`]'s answer) instead of admission order,
/// for a node whose order is not `fcfs`. The rules are the same; "first in order" is the first
/// ranked row.
pub fn plan_ranked(
    params: &StepParams,
    time: Option<TimeLimit>,
    cont: &[ContRow],
    prefill: &[PrefillRow],
    rank: &[u32],
    out: &mut StepPlan,
) {
    debug_assert_eq!(rank.len(), prefill.len());
    let ranked = rank.iter().filter_map(|&i| prefill.get(i as usize));
    plan_walk(params, time, cont, prefill, [(None, ranked)], out, true);
}

/// [`plan_timed`], with the shortcuts (`TimeFull`, the budget used up) on or (for the tests
/// that they change no plan) off.
fn plan_timed_with(
    params: &StepParams,
    time: Option<TimeLimit>,
    cont: &[ContRow],
    prefill: &[PrefillRow],
    out: &mut StepPlan,
    shortcut: bool,
) {
    plan_walk(
        params,
        time,
        cont,
        prefill,
        admission_groups(prefill),
        out,
        shortcut,
    );
}

/// The prefill rows in admission order as two groups, mid-prefill ones first: the `fcfs` walk.
/// Two plain loops over the queue, one per group, as the planner walked it before other orders
/// existed (a chained iterator costs the token planner about 40% more instructions).
fn admission_groups(
    prefill: &[PrefillRow],
) -> [(Option<bool>, impl Iterator<Item = &PrefillRow>); 2] {
    let group = |mid: bool| (Some(mid), prefill.iter().filter(move |p| p.started == mid));
    [group(true), group(false)]
}

/// Plans one step with the prefill rows walked group by group, each in order (every row of
/// `prefill` once, mid-prefill ones first); `prefill` itself is read only for order-free
/// counts. A group says whether its rows are all mid-prefill (`Some`) or mixed (`None`).
fn plan_walk<'a, I: Iterator<Item = &'a PrefillRow>>(
    params: &StepParams,
    time: Option<TimeLimit>,
    cont: &[ContRow],
    prefill: &'a [PrefillRow],
    groups: impl IntoIterator<Item = (Option<bool>, I)>,
    out: &mut StepPlan,
    shortcut: bool,
) {
    out.clear();
    #[cfg(feature = "bench-slow-planner")]
    slow_pass(cont, prefill);
    let Some(budget) = params.budget else {
        plan_unbudgeted(params, cont, groups.into_iter().flat_map(|(_, g)| g), out);
        return;
    };
    out.time = time;
    let mut room = Room::new(params, budget);
    let continuing = plan_continuing(params, cont, &mut room, out);
    if out.over_time() {
        out.time_over = Some(TimeOverrunReason::Continuing);
    }
    if continuing == Continuing::RanAlone {
        out.waiting += count_u32(prefill.iter().filter(|p| params.takes(&p.walk)));
        return;
    }
    plan_prefill(params, prefill, groups, &mut room, out, shortcut);
}

/// [`StepParams::walk_index`] that keeps its last answer: a queue's consecutive rows mostly
/// share one interned walk, so a run of them is looked up once. Only the cost changes (without
/// the cache every plan is the same; the instruction-count benchmarks watch the cost).
struct WalkIndex<'a> {
    params: &'a StepParams,
    last: Option<(&'a Name, Option<usize>)>,
}

impl<'a> WalkIndex<'a> {
    fn new(params: &'a StepParams) -> Self {
        Self { params, last: None }
    }

    fn of(&mut self, walk: &'a Name) -> Option<usize> {
        match self.last {
            Some((last, index)) if Arc::ptr_eq(last, walk) => index,
            _ => {
                let index = self.params.walk_index(walk);
                self.last = Some((walk, index));
                index
            }
        }
    }
}

/// What is left of a step's budget and of each member walk's cap. Each row placed takes its
/// tokens and `slots` from the budget, its tokens alone from its walk's cap.
struct Room<'a> {
    params: &'a StepParams,
    budget: u64,
    used: u64,
    /// [`StepParams::slots_per_row`].
    slots: u64,
    /// Tokens taken per cap, indexed like `params.caps`: inline for the few member walks a
    /// combined walk has, so a step allocates nothing (`Vec::new` does not allocate).
    cap_used_inline: [u64; 8],
    cap_used_heap: Vec<u64>,
    /// Whether the step has caps at all (most have none): read once, not per row.
    capped: bool,
}

impl<'a> Room<'a> {
    fn new(params: &'a StepParams, budget: u32) -> Self {
        let caps = params.caps.len();
        Self {
            params,
            budget: u64::from(budget),
            used: 0,
            slots: u64::from(params.slots_per_row),
            cap_used_inline: [0; 8],
            cap_used_heap: if caps > 8 { vec![0; caps] } else { Vec::new() },
            capped: caps > 0,
        }
    }

    fn cap_used(&self) -> &[u64] {
        let n = self.params.caps.len();
        if n > self.cap_used_inline.len() {
            &self.cap_used_heap
        } else {
            &self.cap_used_inline[..n]
        }
    }

    fn cap_used_mut(&mut self) -> &mut [u64] {
        let n = self.params.caps.len();
        if n > self.cap_used_inline.len() {
            &mut self.cap_used_heap
        } else {
            &mut self.cap_used_inline[..n]
        }
    }

    /// The cap index of an eligible walk (by its index in `params.eligible`).
    fn cap_of(&self, walk: usize) -> Option<usize> {
        if !self.capped {
            return None;
        }
        self.params.cap_index(&self.params.eligible[walk])
    }

    /// Tokens a row of `walk` may still take: what is left of the budget once the row's slots
    /// are charged, and of its cap.
    fn left(&self, walk: usize) -> u64 {
        let cap_left = self.cap_of(walk).map_or(u64::MAX, |i| {
            u64::from(self.params.caps[i].1).saturating_sub(self.cap_used()[i])
        });
        self.budget
            .saturating_sub(self.used + self.slots)
            .min(cap_left)
    }

    /// Whether the step's budget is used up: no walk has room left for a row's slots and a
    /// token, whatever its cap.
    fn full(&self) -> bool {
        self.used + self.slots >= self.budget
    }

    fn take(&mut self, walk: usize, tokens: u64) {
        self.used += tokens + self.slots;
        if let Some(i) = self.cap_of(walk) {
            self.cap_used_mut()[i] += tokens;
        }
    }
}

/// How the continuing rows of a step ended.
#[derive(Debug, PartialEq, Eq)]
enum Continuing {
    /// Rows ran while they fit; prefill rows may follow.
    Fitted,
    /// The first row alone was larger than the room: it runs alone, the step is full.
    RanAlone,
}

/// Rule 2: continuing rows, never cut, no overtaking.
fn plan_continuing(
    params: &StepParams,
    cont: &[ContRow],
    room: &mut Room<'_>,
    out: &mut StepPlan,
) -> Continuing {
    // Not through `WalkIndex`: on this loop (every decode row, every step) the cache measured
    // slower in wall time than the plain lookup, though it counted fewer instructions.
    let mut eligible = cont
        .iter()
        .filter_map(|r| Some((r, params.walk_index(&r.walk)?)));
    for (r, walk) in eligible.by_ref() {
        let est = u64::from(r.estimate);
        if est <= room.left(walk) {
            room.take(walk, est);
            out.push_continuing(r, walk);
            continue;
        }
        if out.rows.is_empty() {
            // The very first row alone is larger than the budget (or its cap): it runs alone,
            // or it would never run.
            out.uncut_over_budget = true;
            out.push_continuing(r, walk);
            out.count_continuing();
            out.waiting += count_u32(eligible);
            return Continuing::RanAlone;
        }
        out.waiting += 1;
        break;
    }
    out.count_continuing();
    out.waiting += count_u32(eligible);
    Continuing::Fitted
}

/// Rule 3: prefill rows in `in_order` order: mid-prefill first, then new ones (each group FCFS
/// under `fcfs`; new ones ranked by the node's order otherwise, `docs/scheduling.md`).
fn plan_prefill<'a, I: Iterator<Item = &'a PrefillRow>>(
    params: &StepParams,
    prefill: &'a [PrefillRow],
    groups: impl IntoIterator<Item = (Option<bool>, I)>,
    room: &mut Room<'_>,
    out: &mut StepPlan,
    shortcut: bool,
) {
    // Rows that would stay mid-prefill after this step, for `max_partial_prefills`: every
    // started row, less those that finish in this step, plus new rows started with a
    // non-final chunk.
    let mut staying_partial = count_u32(prefill.iter().filter(|p| p.started));
    let mut prefill_in_step = false;
    let mut first_in_order = true;
    let mut time_full = TimeFull {
        shortcut,
        full: false,
        least: None,
        not_full_at: None,
    };
    let mut walks = WalkIndex::new(params);
    // The step's token budget used up: a cut row's chunk would be empty (`chunk_end` finds no
    // end past its progress with no room), so every later row waits. Rows that cannot be cut
    // are still planned one by one (one may run whole over the budget).
    let budget_full = |room: &Room<'_>| shortcut && params.chunkable && room.full();
    let mut full = budget_full(room);
    for (group_mid, group) in groups {
        let rows = group.filter_map(|r| Some((r, walks.of(&r.walk)?)));
        for (r, walk) in rows {
            // A constant for each `fcfs` group, so each loop is compiled for its own group.
            let mid = group_mid.unwrap_or(r.started);
            if time_full.full || full {
                // No later row fits in time (`TimeFull`) or in tokens: each waits, as
                // `timed_end` or `chunk_end` would have found one by one.
                out.waiting += 1;
                continue;
            }
            let uncut_before = out.uncut_over_budget;
            let left = room.left(walk);
            let need = u64::from(r.total - r.progress);
            let partial_full = !mid
                && params
                    .max_partial_prefills
                    .is_some_and(|p| staying_partial >= p);
            let token_end = if need <= left.min(row_cap(params)) {
                Some(u64::from(r.total))
            } else if params.chunkable {
                let alone = out.rows.is_empty();
                (!partial_full)
                    .then(|| chunk_end(params, r, left, alone))
                    .flatten()
            } else {
                uncut_end(params, r, left, prefill_in_step, out)
            };
            let end = match (token_end, out.time) {
                (Some(end), Some(time)) => {
                    let end = timed_end(params, r, end, time, first_in_order, partial_full, out);
                    if end.is_none() {
                        // A refused row (the first in order only when its floor yields): no
                        // later row may fit either.
                        time_full.check(params, prefill, out);
                    }
                    end
                }
                (end, _) => end,
            };
            first_in_order = false;
            let Some(end) = end else {
                out.uncut_over_budget = uncut_before;
                out.waiting += 1;
                continue;
            };
            // `end <= total <= u32::MAX`, so this conversion cannot truncate.
            let end = end as u32;
            match (end == r.total, mid) {
                (true, true) => staying_partial -= 1,
                (false, false) => staying_partial += 1,
                _ => {}
            }
            room.take(walk, u64::from(end - r.progress));
            prefill_in_step = true;
            out.push_chunk(r, walk, end);
            full = budget_full(room);
        }
    }
}

/// Whether a step is full in time for every row that is not first in order. `timed_end`
/// refuses such a row when even its least chunk, `l = min(total − progress, F)` tokens from its
/// progress `p`, is predicted over the time budget; that chunk has `l` tokens and
/// `l(2p + l + 1)/2 >= l(l + 1)/2` attention pairs (and one row). With `m` the least `l` of every
/// prefill row of the node, a step whose features plus `m` tokens, `m(m + 1)/2` pairs and a row
/// are predicted over
/// the budget refuses every later row (the prediction is monotone in the features): the
/// planner counts them as waiting without planning them one by one. Found once, it holds for
/// the rest of the step (features only grow); checked again only after a row was added.
struct TimeFull {
    /// Off only in the test that the shortcut changes no plan.
    shortcut: bool,
    full: bool,
    /// `m`, once computed.
    least: Option<u64>,
    /// The step's tokens when it was last found not full.
    not_full_at: Option<u64>,
}

impl TimeFull {
    fn check(&mut self, params: &StepParams, prefill: &[PrefillRow], out: &StepPlan) {
        let (features, Some(time)) = (&out.features, out.time) else {
            return;
        };
        if !self.shortcut || self.not_full_at == Some(features.tokens) {
            return;
        }
        let floor = u64::from(params.floor.max(1));
        let m = *self.least.get_or_insert_with(|| {
            prefill
                .iter()
                .map(|r| u64::from(r.total - r.progress))
                .fold(floor, u64::min)
        });
        let least = StepFeatures {
            tokens: features.tokens.saturating_add(m),
            kv_tokens: features.kv_tokens,
            attention_pairs: features
                .attention_pairs
                .saturating_add(u128::from(m) * u128::from(m + 1) / 2),
            rows: features.rows.saturating_add(1),
        };
        self.full = time.model.predict_ms(&least) > time.max_step_ms;
        if !self.full {
            self.not_full_at = Some(features.tokens);
        }
    }
}

/// Rule 4: the end of a chunk of `r` under the time limit, given `token_end`, the end the
/// token rules allow. The largest aligned end (or the whole rest) whose step is predicted
/// within the time budget; below the floor (or nothing), the first prefill row in order still
/// runs a chunk of the floor and the step is a planned time overrun (`floor`), other rows wait.
/// Under a yielding floor ([`StepParams::floor_yield`]) the first row instead waits beside
/// other rows until its bound ([`floor_yields`]); alone in its step it runs the floor chunk
/// (counted as `floor`), never less: a chunk below the floor breaks the token rules.
/// A row that cannot be cut runs whole when it fits in time, or as the first row in order (a
/// planned `uncut_row` time overrun); else it waits.
fn timed_end(
    params: &StepParams,
    r: &PrefillRow,
    token_end: u64,
    time: TimeLimit,
    first_in_order: bool,
    partial_full: bool,
    out: &mut StepPlan,
) -> Option<u64> {
    let total = u64::from(r.total);
    let floor = u64::from(params.floor.max(1));
    let progress = u64::from(r.progress);
    if !first_in_order {
        // A quick refusal before the solver: even the least this row could run (its
        // remainder, or the floor) does not fit in time. Most rows behind a full step stop here.
        let least = (total - progress).min(floor);
        let least_end = (progress + least) as u32;
        let with_least = out.features.with_chunk(r.progress, least_end);
        if time.model.predict_ms(&with_least) > time.max_step_ms {
            return None;
        }
    }
    if !params.chunkable {
        let whole = out.features.with_chunk(r.progress, r.total);
        if time.model.predict_ms(&whole) <= time.max_step_ms {
            return Some(total);
        }
        if first_in_order {
            out.prefill_over_time(TimeOverrunReason::UncutRow);
            return Some(total);
        }
        return None;
    }
    let bounds = ChunkBounds {
        start: r.progress,
        // `token_end <= total <= u32::MAX`.
        upper: token_end as u32,
        total: r.total,
        align: params.align,
    };
    let fitted = time
        .model
        .max_chunk_end(&out.features, bounds, time.max_step_ms)
        .map(u64::from)
        // A cut that leaves the rest for later starts a partial prefill: not when that is full.
        .filter(|&end| end == total || !partial_full);
    match fitted {
        Some(end) if end == total || end - progress >= floor => Some(end),
        _ if first_in_order && floor_yields(params, r, time, out) => {
            out.floor_yielded = true;
            None
        }
        _ if first_in_order => {
            // Liveness: the first row is never held below the floor by time alone.
            let align = u64::from(params.align.max(1));
            let floor_end = (progress + floor).div_ceil(align) * align;
            let end = floor_end.min(token_end);
            out.prefill_over_time(TimeOverrunReason::Floor);
            Some(end)
        }
        _ => None,
    }
}

/// Whether the first prefill row, whose floor chunk does not fit in time, waits: the floor
/// yields ([`StepParams::floor_yield`]), the step has other rows to run (a row alone in its
/// step always runs), and the row's wait for a chunk has not reached the bound.
fn floor_yields(params: &StepParams, r: &PrefillRow, time: TimeLimit, out: &StepPlan) -> bool {
    params
        .floor_yield
        .is_some_and(|bound| !out.rows.is_empty() && !bound.starved(Wait::for_chunk(r, time.clock)))
}

/// The most tokens one row may run in a step (`max_row_tokens`), or unlimited.
fn row_cap(params: &StepParams) -> u64 {
    u64::from(params.max_row_tokens.unwrap_or(u32::MAX))
}

/// The end of a cut chunk of `r` with `left` tokens of room: at most `left` (and
/// `max_row_tokens`) tokens, ending on a multiple of `align`, and at least the floor — else
/// `None`, and the row waits. The floor keeps continuing rows from leaving a prompt a token or
/// two a step. A row `alone` in the step is not held back by it (an unaligned cached prefix
/// could otherwise keep it from ever running), and a walk cap below the floor lowers it, or
/// the walk's long rows would never run.
fn chunk_end(params: &StepParams, r: &PrefillRow, left: u64, alone: bool) -> Option<u64> {
    let align = u64::from(params.align.max(1));
    let progress = u64::from(r.progress);
    let end = (progress + left.min(row_cap(params))) / align * align;
    let floor = if alone {
        1
    } else {
        u64::from(params.floor).min(params.cap(&r.walk))
    };
    // The floor is at least 1 (budgets and caps are), so `end - progress >= floor` alone would
    // decide; `end > progress` keeps the subtraction from wrapping.
    (end > progress && end - progress >= floor).then_some(end)
}

/// The end of a row that cannot be cut: whole when it fits the room `left`, or whole over the
/// budget when it (with its slots) is larger than the budget, or than its walk's cap, and no
/// other prefill row is in the step (it would never run otherwise; the step overruns by plan).
/// Else `None`: it waits.
fn uncut_end(
    params: &StepParams,
    r: &PrefillRow,
    left: u64,
    prefill_in_step: bool,
    out: &mut StepPlan,
) -> Option<u64> {
    let need = u64::from(r.total - r.progress);
    let budget = u64::from(params.budget.unwrap_or(u32::MAX));
    let over_budget = need + u64::from(params.slots_per_row) > budget || need > params.cap(&r.walk);
    if need <= left || (over_budget && !prefill_in_step) {
        out.uncut_over_budget |= need > left;
        return Some(u64::from(r.total));
    }
    None
}

/// Rule 1: a step without a budget runs every eligible row whole, prefill rows in `prefill`
/// order.
fn plan_unbudgeted<'a>(
    params: &StepParams,
    cont: &[ContRow],
    prefill: impl Iterator<Item = &'a PrefillRow>,
    out: &mut StepPlan,
) {
    let mut walks = WalkIndex::new(params);
    for r in cont {
        let Some(walk) = walks.of(&r.walk) else {
            continue;
        };
        out.push_continuing(r, walk);
    }
    out.count_continuing();
    for r in prefill {
        let Some(walk) = walks.of(&r.walk) else {
            continue;
        };
        out.push_chunk(r, walk, r.total);
    }
}

/// The `bench-slow-planner` feature's extra pass over the step's queues: work that changes no
/// plan, so that `make bench-check` can be shown to catch a slower planner. Never in
/// production builds.
#[cfg(feature = "bench-slow-planner")]
fn slow_pass(cont: &[ContRow], prefill: &[PrefillRow]) {
    let mut features = StepFeatures::EMPTY;
    for r in cont {
        features.add_continuing(r.estimate, r.context);
    }
    for r in prefill {
        features.add_chunk(r.progress, r.total);
    }
    std::hint::black_box(features);
}

fn count_u32<I: Iterator>(it: I) -> u32 {
    u32::try_from(it.count()).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn n(s: &str) -> Name {
        Name::from(s)
    }

    #[test]
    fn a_continuing_row_has_an_estimate_and_a_chunk_none() {
        assert_eq!(
            RowWork::Continue { estimate: 3 }.continue_estimate(),
            Some(3)
        );
        assert_eq!(
            RowWork::Continue { estimate: 0 }.continue_estimate(),
            Some(0)
        );
        let chunk = RowWork::Chunk {
            range: ChunkRange::new(true, 0, 4, 10),
            cached: 0,
        };
        assert_eq!((chunk.continue_estimate(), chunk.tokens()), (None, 4));
    }

    #[test]
    fn every_member_walk_keeps_its_own_cap_with_eight_caps_or_more() {
        // Up to 8 caps are counted inline, more on the heap: both hold each walk to its cap.
        for walks in [7, 8, 9, 12] {
            let names: Vec<Name> = (0..walks).map(|i| n(&format!("w{i}"))).collect();
            let p = StepParams {
                caps: names
                    .iter()
                    .map(|w| (w.clone(), 2 + (w.len() as u32 % 2)))
                    .collect(),
                eligible: std::iter::once(n("mixed"))
                    .chain(names.iter().cloned())
                    .collect(),
                ..params(Some(1000), 1)
            };
            // Two prompts of 5 tokens on each walk: the first takes its walk's cap, the second
            // waits.
            let prompts: Vec<PrefillRow> = (0..2 * walks as u64)
                .map(|seq| PrefillRow {
                    walk: names[(seq % walks as u64) as usize].clone(),
                    ..prompt(seq, 5)
                })
                .collect();
            let out = run(&p, &[], &prompts);
            let want: Vec<(u64, u32, bool)> = (0..walks as u64)
                .map(|seq| (seq, p.caps[seq as usize].1, false))
                .collect();
            assert_eq!(shape(&out), want, "{walks} walks");
            assert_eq!(out.waiting, walks as u32, "{walks} walks");
        }
    }

    #[test]
    fn a_continuing_row_alone_over_the_budget_leaves_only_eligible_prompts_waiting() {
        let p = params(Some(4), 1);
        let other = PrefillRow {
            walk: n("other"),
            ..prompt(3, 10)
        };
        let mut out = StepPlan::default();
        plan(
            &p,
            &[decode(1, 6)],
            &[prompt(2, 10), other, prompt(4, 3)],
            &mut out,
        );
        let rids: Vec<u64> = out.rows.iter().map(|r| r.rid).collect();
        assert_eq!(rids, [1]);
        assert!(out.uncut_over_budget);
        // Rows 2 and 4 wait; row 3's walk is not one this step takes.
        assert_eq!(out.waiting, 2);
    }

    #[test]
    fn each_row_gets_its_own_walks_index_whatever_the_row_before_had() {
        let p = params(Some(100), 1);
        let row = |seq, walk: &str| ContRow {
            walk: n(walk),
            ..decode(seq, 1)
        };
        // Fresh names (not the snapshot's `Arc`s), so every lookup compares by name.
        let cont = [
            row(1, "decode"),
            row(2, "mixed"),
            row(3, "decode"),
            row(4, "other"),
            row(5, "decode"),
            row(6, "prefill"),
        ];
        let mut out = StepPlan::default();
        plan(&p, &cont, &[], &mut out);
        let rows: Vec<(u64, usize)> = out.rows.iter().map(|r| (r.rid, r.walk)).collect();
        assert_eq!(rows, [(1, 2), (2, 0), (3, 2), (5, 2), (6, 1)]);
        assert_eq!((out.continuing, out.waiting), (5, 0));
        // Rows sharing one `Arc` (as queued rows do) are looked up once, to the same index.
        let shared = n("decode");
        let cont: Vec<ContRow> = (1..=3)
            .map(|seq| ContRow {
                walk: shared.clone(),
                ..decode(seq, 1)
            })
            .chain([row(4, "mixed")])
            .collect();
        plan(&p, &cont, &[], &mut out);
        let walks: Vec<usize> = out.rows.iter().map(|r| r.walk).collect();
        assert_eq!(walks, [2, 2, 2, 0]);
        // The same for prompts, budgeted or not.
        let prompt_of = |seq, walk: &str| PrefillRow {
            walk: n(walk),
            ..prompt(seq, 2)
        };
        let prompts = [
            prompt_of(1, "prefill"),
            prompt_of(2, "mixed"),
            prompt_of(3, "other"),
            prompt_of(4, "prefill"),
            prompt_of(5, "decode"),
        ];
        for budget in [Some(100), None] {
            plan(&params(budget, 1), &[], &prompts, &mut out);
            let rows: Vec<(u64, usize)> = out.rows.iter().map(|r| (r.rid, r.walk)).collect();
            assert_eq!(rows, [(1, 1), (2, 0), (4, 1), (5, 2)], "budget {budget:?}");
        }
    }

    /// A `mixed` step over `prefill` and `decode` rows, chunkable, align 1.
    fn params(budget: Option<u32>, floor: u32) -> StepParams {
        StepParams {
            node: n("llm"),
            walk: n("mixed"),
            budget,
            floor,
            caps: Arc::from(Vec::new()),
            chunkable: true,
            align: 1,
            eligible: vec![n("mixed"), n("prefill"), n("decode")].into(),
            max_row_tokens: None,
            max_partial_prefills: None,
            slots_per_row: 0,
            max_step_ms: None,
            cost: None,
            learn_cost: false,
            margin_quantile: None,
            order: NodeOrder::default(),
            floor_yield: None,
        }
    }

    fn decode(seq: u64, estimate: u32) -> ContRow {
        ContRow {
            seq,
            rid: seq,
            walk: n("decode"),
            estimate,
            context: 0,
        }
    }

    fn prompt(seq: u64, total: u32) -> PrefillRow {
        PrefillRow {
            seq,
            rid: seq,
            walk: n("prefill"),
            total,
            cached: 0,
            progress: 0,
            started: false,
            priority: 0,
            arrival_ms: None,
            admitted_step: 0,
            wait_from_step: 0,
            wait_from_ms: None,
        }
    }

    fn mid(seq: u64, total: u32, progress: u32) -> PrefillRow {
        PrefillRow {
            progress,
            started: true,
            ..prompt(seq, total)
        }
    }

    fn run(p: &StepParams, cont: &[ContRow], prefill: &[PrefillRow]) -> StepPlan {
        let mut out = StepPlan::default();
        plan(p, cont, prefill, &mut out);
        assert_eq!(
            out.scheduled_tokens,
            out.rows
                .iter()
                .map(|r| u64::from(r.work.tokens()))
                .sum::<u64>()
        );
        out
    }

    /// `(rid, tokens, final)` per row; continuing rows are never final.
    fn shape(p: &StepPlan) -> Vec<(u64, u32, bool)> {
        p.rows
            .iter()
            .map(|r| match r.work {
                RowWork::Continue { estimate } => (r.rid, estimate, false),
                RowWork::Chunk { range, .. } => (r.rid, range.tokens(), range.is_final()),
            })
            .collect()
    }

    #[test]
    fn no_budget_runs_every_eligible_row_whole() {
        let mut p = params(None, 0);
        p.chunkable = false;
        let out = run(
            &p,
            &[decode(1, 1), decode(2, 4)],
            &[prompt(3, 100_000), mid(4, 50, 10)],
        );
        assert_eq!(
            shape(&out),
            vec![
                (1, 1, false),
                (2, 4, false),
                (4, 40, true),
                (3, 100_000, true)
            ]
        );
        assert!(!out.uncut_over_budget);
        assert_eq!(out.waiting, 0);
    }

    #[test]
    fn continuing_rows_go_first_in_order_without_overtaking() {
        let p = params(Some(10), 1);
        let out = run(
            &p,
            &[decode(1, 4), decode(2, 4), decode(3, 4), decode(4, 1)],
            &[prompt(5, 100)],
        );
        // Row 3 does not fit in the 2 tokens left; row 4 (1 token) must not overtake it. The
        // prompt still gets what is left.
        assert_eq!(
            shape(&out),
            vec![(1, 4, false), (2, 4, false), (5, 2, false)]
        );
        assert_eq!(out.waiting, 2);
        assert_eq!(out.continue_estimate, 8);
    }

    #[test]
    fn a_first_continuing_row_over_the_budget_runs_alone() {
        let p = params(Some(4), 1);
        let out = run(&p, &[decode(1, 9), decode(2, 1)], &[prompt(3, 10)]);
        assert_eq!(shape(&out), vec![(1, 9, false)]);
        assert!(out.uncut_over_budget);
        assert_eq!(out.waiting, 2);
    }

    #[test]
    fn mid_prefill_rows_come_before_new_ones_each_fcfs() {
        let p = params(Some(100), 1);
        let out = run(
            &p,
            &[],
            &[
                prompt(1, 30),
                mid(2, 60, 20),
                prompt(3, 30),
                mid(4, 500, 100),
            ],
        );
        assert_eq!(shape(&out), vec![(2, 40, true), (4, 60, false)]);
        assert_eq!(out.waiting, 2);
    }

    #[test]
    fn chunks_end_on_the_align_and_never_below_the_floor() {
        let mut p = params(Some(1000), 64);
        p.align = 16;
        // 1000 - 3 decode = 997 left: rounded down to 992.
        let out = run(
            &p,
            &[decode(1, 1), decode(2, 1), decode(3, 1)],
            &[prompt(4, 5000)],
        );
        let RowWork::Chunk { range, .. } = out.rows[3].work else {
            panic!("a chunk")
        };
        assert_eq!((range.start, range.end, range.stride), (0, 992, 992));
        // A later chunk is aligned on its end, not its length.
        let out = run(&p, &[], &[mid(4, 5000, 990)]);
        let RowWork::Chunk { range, .. } = out.rows[0].work else {
            panic!("a chunk")
        };
        assert_eq!((range.start, range.end, range.stride), (990, 1984, 994));
    }

    #[test]
    fn a_tiny_chunk_waits_but_later_rows_that_fit_whole_still_run() {
        let p = params(Some(100), 64);
        let out = run(
            &p,
            &[],
            &[prompt(1, 60), prompt(2, 500), prompt(3, 30), prompt(4, 5)],
        );
        // 40 left after row 1: row 2 would get 40 < floor 64 and waits; rows 3 and 4 fit whole.
        assert_eq!(
            shape(&out),
            vec![(1, 60, true), (3, 30, true), (4, 5, true)]
        );
        assert_eq!(out.waiting, 1);
    }

    #[test]
    fn a_row_alone_in_the_step_is_not_held_back_by_the_floor() {
        // An unaligned cached prefix: the aligned cut is 28 tokens, below the floor of 64.
        let mut p = params(Some(70), 64);
        p.align = 64;
        let mut r = prompt(1, 1000);
        r.cached = 100;
        r.progress = 100;
        assert_eq!(shape(&run(&p, &[], &[r.clone()])), vec![(1, 28, false)]);
        assert_eq!(
            shape(&run(&p, &[decode(2, 1)], &[r])),
            vec![(2, 1, false)],
            "not alone: waits"
        );
    }

    #[test]
    fn a_walk_cap_below_the_floor_lowers_it() {
        let mut p = params(Some(1000), 64);
        p.caps = vec![(n("prefill"), 32)].into();
        let out = run(&p, &[decode(1, 1)], &[prompt(2, 100)]);
        assert_eq!(shape(&out), vec![(1, 1, false), (2, 32, false)]);
    }

    #[test]
    fn the_floor_is_what_the_budget_allows_when_smaller() {
        // F = min(floor, B) is computed by the snapshot; a floor equal to the budget still cuts.
        let p = params(Some(32), 32);
        let out = run(&p, &[], &[prompt(1, 100)]);
        assert_eq!(shape(&out), vec![(1, 32, false)]);
    }

    #[test]
    fn an_uncut_row_over_the_budget_runs_whole_only_as_the_first_prefill_row() {
        let mut p = params(Some(100), 1);
        p.chunkable = false;
        let out = run(&p, &[decode(1, 1)], &[prompt(2, 300), prompt(3, 10)]);
        assert_eq!(shape(&out), vec![(1, 1, false), (2, 300, true)]);
        assert!(out.uncut_over_budget);
        assert_eq!(out.waiting, 1, "nothing is left for row 3");

        let out = run(&p, &[], &[prompt(3, 10), prompt(2, 300)]);
        assert_eq!(shape(&out), vec![(3, 10, true)], "not first: waits");
        assert!(!out.uncut_over_budget);

        // An uncut row within the budget but larger than what is left waits.
        let out = run(&p, &[], &[prompt(3, 50), prompt(2, 60)]);
        assert_eq!(shape(&out), vec![(3, 50, true)]);
    }

    #[test]
    fn slots_per_row_are_charged_to_the_budget_for_every_row() {
        let mut p = params(Some(100), 1);
        p.slots_per_row = 2;
        // Two decode rows take 4 + 2 each; the prompt's chunk is what the budget leaves after
        // its own 2 slots: 100 - 12 - 2.
        let rows = [decode(1, 4), decode(2, 4)];
        let out = run(&p, &rows, &[prompt(3, 300), prompt(4, 10)]);
        assert_eq!(
            shape(&out),
            vec![(1, 4, false), (2, 4, false), (3, 86, false)]
        );
        assert_eq!(out.waiting, 1, "the budget is spent: the next prompt waits");
        p.slots_per_row = 0;
        let out = run(&p, &rows, &[prompt(3, 300)]);
        assert_eq!(
            shape(&out),
            vec![(1, 4, false), (2, 4, false), (3, 92, false)]
        );

        // Continuing rows stop where a row's slots no longer fit beside its estimate.
        let mut p = params(Some(10), 1);
        p.slots_per_row = 3;
        let rows = [decode(1, 2), decode(2, 2), decode(3, 2)];
        let out = run(&p, &rows, &[]);
        assert_eq!(shape(&out), vec![(1, 2, false), (2, 2, false)]);
        assert_eq!(out.waiting, 1);

        // A budget with less than a row's slots and a token left takes no prompt chunk.
        let mut p = params(Some(100), 1);
        p.slots_per_row = 2;
        let out = run(&p, &[decode(1, 96)], &[prompt(2, 50)]);
        assert_eq!(shape(&out), vec![(1, 96, false)]);
        assert_eq!(out.waiting, 1);
        let out = run(&p, &[decode(1, 95)], &[prompt(2, 50)]);
        assert_eq!(shape(&out), vec![(1, 95, false), (2, 1, false)]);
        // A prompt alone takes the budget less its own slots.
        let out = run(&p, &[], &[prompt(2, 300)]);
        assert_eq!(shape(&out), vec![(2, 98, false)]);
    }

    #[test]
    fn an_uncut_row_over_the_budget_counts_its_slots() {
        let mut p = params(Some(100), 1);
        p.chunkable = false;
        p.slots_per_row = 5;
        // 97 tokens and 5 slots never fit in 100: run whole as the first prefill row.
        let out = run(&p, &[], &[prompt(2, 97)]);
        assert_eq!(shape(&out), vec![(2, 97, true)]);
        assert!(out.uncut_over_budget);
        // Behind another prefill row it waits.
        let out = run(&p, &[], &[prompt(3, 10), prompt(2, 97)]);
        assert_eq!(shape(&out), vec![(3, 10, true)]);
        assert_eq!(out.waiting, 1);
        // 95 and 5 fit exactly: alone, not beside a decode row (it waits for its room).
        let out = run(&p, &[], &[prompt(2, 95)]);
        assert_eq!(shape(&out), vec![(2, 95, true)]);
        assert!(!out.uncut_over_budget);
        let out = run(&p, &[decode(1, 3)], &[prompt(2, 95)]);
        assert_eq!(shape(&out), vec![(1, 3, false)]);
        assert_eq!(out.waiting, 1);
        // Over its walk's cap alone (within the budget), an uncut row also runs whole, first.
        p.slots_per_row = 0;
        p.caps = vec![(n("prefill"), 30)].into();
        let out = run(&p, &[], &[prompt(2, 50)]);
        assert_eq!(shape(&out), vec![(2, 50, true)]);
        assert!(out.uncut_over_budget);
        // At its cap exactly it is not over it: beside a decode row that leaves less, it waits.
        let out = run(&p, &[decode(1, 80)], &[prompt(2, 30)]);
        assert_eq!(shape(&out), vec![(1, 80, false)]);
        assert_eq!(out.waiting, 1);
    }

    #[test]
    fn caps_limit_member_walks_inside_a_combined_step() {
        let mut p = params(Some(100), 1);
        p.caps = vec![(n("prefill"), 30), (n("decode"), 3)].into();
        let out = run(
            &p,
            &[decode(1, 1), decode(2, 1), decode(3, 1), decode(4, 1)],
            &[prompt(5, 80), prompt(6, 10)],
        );
        assert_eq!(
            shape(&out),
            vec![(1, 1, false), (2, 1, false), (3, 1, false), (5, 30, false)]
        );
        assert_eq!(out.waiting, 2);
    }

    #[test]
    fn rows_of_other_walks_are_not_taken() {
        let mut p = params(Some(100), 1);
        p.walk = n("prefill");
        p.eligible = vec![n("prefill")].into();
        let out = run(&p, &[decode(1, 1)], &[prompt(2, 10)]);
        assert_eq!(shape(&out), vec![(2, 10, true)]);
        assert_eq!(
            out.waiting, 0,
            "decode rows are not eligible in a prefill step"
        );
    }

    #[test]
    fn max_row_tokens_lets_long_prompts_progress_side_by_side() {
        // Long prompts side by side: budget 1024, max_row_tokens 400, floor 1, three 800-token prompts.
        let mut p = params(Some(1024), 1);
        p.max_row_tokens = Some(400);
        let out = run(&p, &[], &[prompt(1, 800), prompt(2, 800), prompt(3, 800)]);
        assert_eq!(
            shape(&out),
            vec![(1, 400, false), (2, 400, false), (3, 224, false)]
        );
        let out = run(
            &p,
            &[],
            &[mid(1, 800, 400), mid(2, 800, 400), mid(3, 800, 224)],
        );
        assert_eq!(
            shape(&out),
            vec![(1, 400, true), (2, 400, true), (3, 224, false)]
        );
        let out = run(&p, &[decode(1, 1), decode(2, 1)], &[mid(3, 800, 448)]);
        assert_eq!(
            shape(&out),
            vec![(1, 1, false), (2, 1, false), (3, 352, true)]
        );
    }

    #[test]
    fn max_partial_prefills_holds_back_new_rows_that_would_stay_partial() {
        let mut p = params(Some(1000), 1);
        p.max_partial_prefills = Some(2);
        // One row mid-prefill that will not finish, one that will: one slot for a new partial.
        let rows = [
            mid(1, 10_000, 100),
            mid(2, 150, 100),
            prompt(3, 5000),
            prompt(4, 5000),
            prompt(5, 20),
        ];
        let out = run(&p, &[], &rows);
        assert_eq!(
            shape(&out),
            vec![(1, 1000, false)],
            "row 1 takes the whole budget"
        );
        p.max_row_tokens = Some(300);
        let out = run(&p, &[], &rows);
        assert_eq!(
            shape(&out),
            vec![
                (1, 300, false),
                (2, 50, true),
                (3, 300, false),
                (5, 20, true)
            ]
        );
        assert_eq!(out.waiting, 1, "row 4 would be a third partial prefill");
    }

    #[test]
    fn a_cached_prefix_moves_the_first_chunk_start_but_not_its_stride() {
        let p = params(Some(100), 1);
        let mut r = prompt(1, 1000);
        r.cached = 512;
        r.progress = 512;
        let out = run(&p, &[], &[r]);
        let RowWork::Chunk { range, cached } = out.rows[0].work else {
            panic!("a chunk")
        };
        assert_eq!(
            (range.start, range.end, range.stride, cached),
            (512, 612, 612, 512)
        );
    }

    #[test]
    fn huge_budgets_and_prompts_do_not_overflow() {
        let p = params(Some(u32::MAX), 64);
        let out = run(
            &p,
            &[decode(1, u32::MAX)],
            &[prompt(2, u32::MAX), prompt(3, u32::MAX)],
        );
        assert_eq!(shape(&out), vec![(1, u32::MAX, false)]);
        let out = run(&p, &[decode(1, 1)], &[prompt(2, u32::MAX)]);
        assert_eq!(shape(&out), vec![(1, 1, false), (2, u32::MAX - 1, false)]);
    }

    // === time budgets (docs/cost-model.md#time-budgets) ===

    /// A model where a token costs 0.1 ms and an attention pair 1e-6 ms, on 5 ms a step.
    fn timed(budget: u32, floor: u32, max_step_ms: f64) -> StepParams {
        StepParams {
            max_step_ms: Some(max_step_ms),
            cost: Some(LatencyModel::try_new(5.0, 0.1, 0.001, 1e-6).unwrap()),
            ..params(Some(budget), floor)
        }
    }

    fn predicted(p: &StepParams, out: &StepPlan) -> f64 {
        out.predicted_ms(&p.cost.unwrap())
    }

    #[test]
    fn a_prompt_with_no_room_left_waits_whatever_the_floor() {
        // The decode rows fill the budget: the prompt gets no chunk, not an empty one, even
        // under a hand-built floor of 0 (configurations refuse it; the planner needs no floor
        // to keep a chunk from being empty).
        for floor in [0, 1, 4] {
            let out = run(
                &params(Some(2), floor),
                &[decode(1, 1), decode(2, 1)],
                &[prompt(3, 50)],
            );
            assert_eq!(
                shape(&out),
                vec![(1, 1, false), (2, 1, false)],
                "floor {floor}"
            );
            assert_eq!(out.waiting, 1, "floor {floor}");
        }
    }

    #[test]
    fn a_prompt_whose_room_aligns_down_to_nothing_waits_whatever_the_floor() {
        // 3 tokens of room under align 4 end the chunk where it starts: no chunk, not an empty
        // one, even under a hand-built floor of 0.
        for floor in [0, 1, 4] {
            let p = StepParams {
                align: 4,
                ..params(Some(8), floor)
            };
            let out = run(&p, &[decode(1, 5)], &[prompt(2, 50)]);
            assert_eq!(shape(&out), vec![(1, 5, false)], "floor {floor}");
            assert_eq!(out.waiting, 1, "floor {floor}");
        }
    }

    #[test]
    fn every_row_the_plan_runs_is_priced_by_the_per_row_term() {
        // 1 ms a row and 0.1 ms a token: five decode rows (5.5 ms) leave 4.5 ms of 10 ms, which
        // the prompt's chunk row (1 ms) and 35 tokens (3.5 ms) fill exactly.
        let p = StepParams {
            max_step_ms: Some(10.0),
            cost: Some(
                LatencyModel::try_new(0.0, 0.1, 0.0, 0.0)
                    .and_then(|m| m.with_per_row_ms(1.0))
                    .unwrap(),
            ),
            ..params(Some(4096), 4)
        };
        let cont: Vec<ContRow> = (1..=5).map(|i| decode(i, 1)).collect();
        let out = run(&p, &cont, &[prompt(9, 1000)]);
        assert_eq!(shape(&out).last(), Some(&(9, 35, false)));
        assert_eq!(out.features.rows, 6);
        assert!((predicted(&p, &out) - 10.0).abs() < 1e-9);
        // Without a budget every row runs, and each is counted.
        let all = run(&params(None, 0), &cont, &[prompt(9, 1000)]);
        assert_eq!(all.features.rows, 6);
        // A first row over the budget runs alone, counted.
        let big = [decode(1, 5000)];
        let alone = run(&params(Some(4096), 4), &big, &[]);
        assert_eq!((alone.rows.len(), alone.features.rows), (1, 1));
    }

    #[test]
    fn a_chunk_deep_into_a_prompt_is_cut_shorter_than_one_at_its_start() {
        let p = timed(8192, 64, 60.0);
        let fresh = run(&p, &[], &[prompt(1, 200_000)]);
        let deep = run(&p, &[], &[mid(1, 200_000, 150_000)]);
        let (t_fresh, t_deep) = (shape(&fresh)[0].1, shape(&deep)[0].1);
        assert!(
            t_deep < t_fresh / 2,
            "deep {t_deep} vs fresh {t_fresh} tokens"
        );
        for out in [&fresh, &deep] {
            assert!(predicted(&p, out) <= 60.0, "{}", predicted(&p, out));
            assert_eq!(out.time_over, None);
        }
        // The next aligned end would not fit: the chunk is the largest that does.
        let more = LatencyModel::predict_ms(
            &p.cost.unwrap(),
            &StepFeatures::EMPTY.with_chunk(150_000, 150_000 + t_deep + 1),
        );
        assert!(more > 60.0);
    }

    #[test]
    fn the_first_prefill_row_runs_the_floor_when_less_fits_in_time_and_later_rows_wait() {
        // 5 ms base + 0.1 ms a token: 6 ms leaves room for 10 tokens, the floor is 64.
        let p = timed(4096, 64, 6.0);
        let out = run(&p, &[], &[prompt(1, 1000), prompt(2, 30)]);
        assert_eq!(shape(&out), vec![(1, 64, false)]);
        assert_eq!(out.time_over, Some(TimeOverrunReason::Floor));
        assert_eq!(out.waiting, 1);
        // A remainder below the floor runs whole.
        let out = run(&p, &[], &[mid(1, 1000, 980)]);
        assert_eq!(shape(&out), vec![(1, 20, true)]);
    }

    #[test]
    fn continuing_rows_predicted_exactly_at_the_time_budget_are_not_over_it() {
        // 5 ms base + 0.5 ms a token (no KV or attention term): 4 decode rows are 7 ms exactly.
        let p = StepParams {
            max_step_ms: Some(7.0),
            cost: Some(LatencyModel::try_new(5.0, 0.5, 0.0, 0.0).unwrap()),
            ..params(Some(4096), 1)
        };
        let cont: Vec<ContRow> = (1..=4).map(|i| decode(i, 1)).collect();
        let out = run(&p, &cont, &[]);
        assert_eq!(predicted(&p, &out), 7.0);
        assert_eq!(out.time_over, None);
        let cont: Vec<ContRow> = (1..=5).map(|i| decode(i, 1)).collect();
        let out = run(&p, &cont, &[]);
        assert_eq!(out.time_over, Some(TimeOverrunReason::Continuing));
    }

    #[test]
    fn continuing_rows_always_run_and_are_counted_when_they_alone_exceed_the_time_budget() {
        let p = timed(4096, 64, 5.5);
        let cont: Vec<ContRow> = (1..=10).map(|i| decode(i, 1)).collect();
        let out = run(&p, &cont, &[]);
        assert_eq!(out.rows.len(), 10);
        assert_eq!(out.time_over, Some(TimeOverrunReason::Continuing));
    }

    #[test]
    fn a_floor_chunk_behind_continuing_rows_over_time_is_a_floor_overrun() {
        // Ten decode rows alone are predicted at 6 ms, over 5.5 ms; the
        // first prefill row still runs the floor: the step's reason is `floor`.
        let p = timed(4096, 64, 5.5);
        let cont: Vec<ContRow> = (1..=10).map(|i| decode(i, 1)).collect();
        let out = run(&p, &cont, &[prompt(11, 1000)]);
        assert_eq!(out.rows.len(), 11);
        assert_eq!(shape(&out).last(), Some(&(11, 64, false)));
        assert_eq!(out.time_over, Some(TimeOverrunReason::Floor));
        // So is a row that cannot be cut, run whole behind them.
        let p = StepParams {
            chunkable: false,
            ..p
        };
        let out = run(&p, &cont, &[prompt(11, 100)]);
        assert_eq!(out.time_over, Some(TimeOverrunReason::UncutRow));
    }

    /// Plans under `p`'s configured model and time budget at `clock`.
    fn run_at(
        p: &StepParams,
        clock: StepClock,
        cont: &[ContRow],
        prefill: &[PrefillRow],
    ) -> StepPlan {
        let time = p
            .max_step_ms
            .zip(p.cost)
            .map(|(max_step_ms, model)| TimeLimit {
                model,
                max_step_ms,
                clock,
            });
        let mut out = StepPlan::default();
        plan_timed(p, time, cont, prefill, &mut out);
        out
    }

    fn at(step: u64, now_ms: Option<f64>) -> StepClock {
        StepClock { step, now_ms }
    }

    #[test]
    fn a_floor_that_yields_runs_the_continuing_rows_alone_until_the_prompt_waited_out_its_bound() {
        // Nine decode rows are predicted at 5.9 ms of a 6 ms budget: a 64-token floor chunk
        // (6.4 ms more) does not fit beside them.
        let bound = WaitBound {
            max_wait_ms: None,
            max_wait_steps: Some(3),
        };
        let p = StepParams {
            floor_yield: Some(bound),
            ..timed(4096, 64, 6.0)
        };
        let cont: Vec<ContRow> = (1..=9).map(|i| decode(i, 1)).collect();
        let row = PrefillRow {
            wait_from_step: 10,
            ..prompt(20, 1000)
        };
        for step in 10..13 {
            let out = run_at(&p, at(step, None), &cont, std::slice::from_ref(&row));
            assert_eq!(out.rows.len(), 9, "step {step}: the decode rows alone");
            assert!(out.floor_yielded, "step {step}");
            assert_eq!((out.time_over, out.waiting), (None, 1), "step {step}");
            assert!(predicted(&p, &out) <= 6.0);
        }
        // Three steps waited: the bound is reached, and the floor runs as it always did.
        let out = run_at(&p, at(13, None), &cont, std::slice::from_ref(&row));
        assert_eq!(shape(&out).last(), Some(&(20, 64, false)));
        assert_eq!(out.time_over, Some(TimeOverrunReason::Floor));
        assert!(!out.floor_yielded);
        // With `time_floor = "run"` (no yield) it runs at once.
        let run_now = StepParams {
            floor_yield: None,
            ..p.clone()
        };
        let out = run_at(&run_now, at(10, None), &cont, std::slice::from_ref(&row));
        assert_eq!(out.time_over, Some(TimeOverrunReason::Floor));
        assert_eq!(out.rows.len(), 10);
    }

    #[test]
    fn a_ranked_walk_plans_the_prompts_in_its_order_with_the_same_rules() {
        // Room for 10 tokens after the decode row: the ranked walk puts the 8-token prompt
        // first, so it runs whole and the 20-token one waits (it would be cut below the floor).
        let p = params(Some(11), 4);
        let prompts = [prompt(1, 20), prompt(2, 8)];
        let mut out = StepPlan::default();
        plan_ranked(&p, None, &[decode(9, 1)], &prompts, &[1, 0], &mut out);
        assert_eq!(shape(&out), vec![(9, 1, false), (2, 8, true)]);
        assert_eq!(out.waiting, 1);
        // Admission order cuts the first prompt to the room instead.
        let fcfs = run(&p, &[decode(9, 1)], &prompts);
        assert_eq!(shape(&fcfs), vec![(9, 1, false), (1, 10, false)]);
        // The time rules follow the ranked order too: the 8-token prompt fits in 6 ms whole, and
        // the other, no longer first, waits (20 more tokens do not fit).
        let timed = StepParams {
            floor_yield: None,
            ..timed(4096, 64, 6.0)
        };
        let time = Some(TimeLimit {
            model: timed.cost.unwrap(),
            max_step_ms: 6.0,
            clock: StepClock::default(),
        });
        plan_ranked(&timed, time, &[], &prompts, &[1, 0], &mut out);
        assert_eq!(shape(&out), vec![(2, 8, true)]);
    }

    #[test]
    fn a_yielding_floor_counts_its_wait_in_ms_when_the_engine_gives_times() {
        let p = StepParams {
            floor_yield: Some(WaitBound {
                max_wait_ms: Some(50.0),
                max_wait_steps: None,
            }),
            ..timed(4096, 64, 6.0)
        };
        let cont: Vec<ContRow> = (1..=9).map(|i| decode(i, 1)).collect();
        let row = PrefillRow {
            wait_from_ms: Some(100.0),
            ..mid(20, 1000, 128)
        };
        let out = run_at(&p, at(1000, Some(149.0)), &cont, std::slice::from_ref(&row));
        assert!(out.floor_yielded, "49 ms waited, whatever the steps");
        let out = run_at(&p, at(0, Some(150.0)), &cont, std::slice::from_ref(&row));
        assert_eq!(
            out.time_over,
            Some(TimeOverrunReason::Floor),
            "50 ms waited"
        );
        // Without the engine's time, no wait in ms is known: it keeps waiting.
        let out = run_at(&p, at(1000, None), &cont, std::slice::from_ref(&row));
        assert!(out.floor_yielded);
    }

    #[test]
    fn a_yielding_floor_still_runs_a_row_alone_and_lets_later_rows_that_fit_run() {
        let p = StepParams {
            floor_yield: Some(WaitBound {
                max_wait_ms: None,
                max_wait_steps: Some(100),
            }),
            ..timed(4096, 64, 6.0)
        };
        // Alone in its step, where 9 tokens fit in time (5 ms + 0.1 ms a token and its attention
        // pairs), the prompt does not yield and runs the floor chunk over the budget, counted:
        // never a chunk below the floor, and nothing else would run.
        let out = run_at(&p, at(0, None), &[], &[prompt(1, 1000)]);
        assert_eq!(shape(&out), vec![(1, 64, false)]);
        assert_eq!(out.time_over, Some(TimeOverrunReason::Floor));
        assert!(!out.floor_yielded);
        // With not one token fitting, the same.
        let tight = StepParams {
            max_step_ms: Some(5.05),
            ..p.clone()
        };
        let out = run_at(&tight, at(0, None), &[], &[prompt(1, 1000)]);
        assert_eq!(shape(&out), vec![(1, 64, false)]);
        assert_eq!(out.time_over, Some(TimeOverrunReason::Floor));
        // Without a yielding floor, alone it runs the floor as before.
        let run_now = StepParams {
            floor_yield: None,
            ..p.clone()
        };
        let out = run_at(&run_now, at(0, None), &[], &[prompt(1, 1000)]);
        assert_eq!(shape(&out), vec![(1, 64, false)]);
        assert_eq!(out.time_over, Some(TimeOverrunReason::Floor));
        // Beside five decode rows (5.5 ms), the first prompt yields; a 4-token prompt behind
        // it (0.4 ms, 5.9 ms in all) fits and runs whole.
        let cont: Vec<ContRow> = (1..=5).map(|i| decode(i, 1)).collect();
        let out = run_at(&p, at(0, None), &cont, &[prompt(6, 1000), prompt(7, 4)]);
        assert!(out.floor_yielded);
        assert_eq!(shape(&out).last(), Some(&(7, 4, true)));
        assert_eq!((out.time_over, out.waiting), (None, 1));
        // A step that plans no time limit has nothing to yield to.
        let untimed = StepParams {
            max_step_ms: None,
            ..p.clone()
        };
        let out = run_at(&untimed, at(0, None), &cont, &[prompt(6, 1000)]);
        assert_eq!(shape(&out).last(), Some(&(6, 1000, true)));
        assert!(!out.floor_yielded);
    }

    #[test]
    fn an_uncut_row_over_the_time_budget_runs_first_and_waits_otherwise() {
        let p = StepParams {
            chunkable: false,
            ..timed(4096, 64, 20.0)
        };
        let out = run(&p, &[], &[prompt(1, 500), prompt(2, 400)]);
        assert_eq!(shape(&out), vec![(1, 500, true)]);
        assert_eq!(out.time_over, Some(TimeOverrunReason::UncutRow));
        assert_eq!(out.waiting, 1);
        let out = run(&p, &[], &[prompt(1, 100), prompt(2, 400)]);
        assert_eq!(
            shape(&out),
            vec![(1, 100, true)],
            "15 ms fits, 55 more does not"
        );
        assert_eq!(out.time_over, None);
    }

    #[test]
    fn the_token_budget_still_holds_under_a_generous_time_budget() {
        let p = timed(256, 64, 1e9);
        let out = run(&p, &[decode(1, 1)], &[prompt(2, 1000)]);
        assert_eq!(shape(&out), vec![(1, 1, false), (2, 255, false)]);
        assert_eq!(out.scheduled_tokens, 256);
    }

    #[test]
    fn without_a_model_or_a_time_budget_the_plan_is_the_token_plan() {
        let tokens_only = params(Some(512), 64);
        let rows = [mid(1, 5000, 100), prompt(2, 3000)];
        let a = run(&tokens_only, &[decode(9, 1)], &rows);
        let no_model = StepParams {
            max_step_ms: Some(1.0),
            ..tokens_only.clone()
        };
        let b = run(&no_model, &[decode(9, 1)], &rows);
        assert_eq!(shape(&a), shape(&b));
        assert_eq!(b.time_over, None);
    }

    // === the `TimeFull` shortcut changes no plan ===

    use proptest::prelude::*;

    fn arb_rows() -> impl Strategy<Value = (Vec<ContRow>, Vec<PrefillRow>)> {
        let cont = prop::collection::vec((1u32..4, 0u64..50_000), 0..40);
        let prefill = prop::collection::vec((1u32..20_000, 0u32..100, any::<bool>()), 0..40);
        (cont, prefill).prop_map(|(cont, prefill)| {
            let cont = cont
                .into_iter()
                .enumerate()
                .map(|(i, (estimate, context))| ContRow {
                    context,
                    ..decode(i as u64 + 1, estimate)
                })
                .collect();
            let prefill = prefill
                .into_iter()
                .enumerate()
                .map(|(i, (total, pct, started))| {
                    let seq = 1_000 + i as u64;
                    let progress = (u64::from(total) * u64::from(pct) / 100) as u32;
                    if started && progress > 0 && progress < total {
                        mid(seq, total, progress)
                    } else {
                        prompt(seq, total)
                    }
                })
                .collect();
            (cont, prefill)
        })
    }

    /// The `TimeFull` shortcut at its exact boundary: after A, the time left is exactly what
    /// the smallest possible chunk (C's 2 tokens from its start) costs. B (its floor of 8 is
    /// too much) does not fit and triggers the check; the step is not full, so C runs. A bound
    /// that is `>=` instead of `>`, or a larger least chunk, would make C wait.
    #[test]
    fn the_time_full_shortcut_leaves_a_row_that_fits_exactly() {
        // Powers of two: every prediction is exact. 5 ms + 0.5 ms a token + 0.25 ms a pair.
        let model = LatencyModel::try_new(5.0, 0.5, 0.0, 0.25).unwrap();
        // A: 10 tokens, 55 pairs -> 23.75 ms; C: 2 tokens, 3 pairs -> +1.75 ms = 25.5 ms.
        let p = StepParams {
            max_step_ms: Some(25.5),
            cost: Some(model),
            ..params(Some(4096), 8)
        };
        let rows = [prompt(1, 10), prompt(2, 100), prompt(3, 2)];
        let out = run(&p, &[], &rows);
        assert_eq!(shape(&out), vec![(1, 10, true), (3, 2, true)]);
        assert_eq!(predicted(&p, &out), 25.5);
        assert_eq!((out.waiting, out.time_over), (1, None));
        let mut reference = StepPlan::default();
        let time = Some(TimeLimit {
            model,
            max_step_ms: 25.5,
            clock: StepClock::default(),
        });
        plan_timed_with(&p, time, &[], &rows, &mut reference, false);
        assert_eq!(out, reference);
        // A hair less time: the step is full after A, and B and C both wait.
        let p = StepParams {
            max_step_ms: Some(25.49),
            ..p
        };
        let out = run(&p, &[], &rows);
        assert_eq!(shape(&out), vec![(1, 10, true)]);
        assert_eq!(out.waiting, 2);
    }

    /// The boundary again with the least chunk at its smallest (1 token, 1 attention pair):
    /// after A, exactly that much time is left, so C (1 token) runs. A bound that counted more
    /// pairs for the least chunk (`m + (m + 1) / 2` is 2 for `m` = 1) would make C wait.
    #[test]
    fn the_time_full_shortcut_leaves_a_one_token_row_that_fits_exactly() {
        let model = LatencyModel::try_new(5.0, 0.5, 0.0, 0.25).unwrap();
        // A: 23.75 ms; C: 1 token, 1 pair -> +0.75 ms = 24.5 ms.
        let p = StepParams {
            max_step_ms: Some(24.5),
            cost: Some(model),
            ..params(Some(4096), 8)
        };
        let rows = [prompt(1, 10), prompt(2, 100), prompt(3, 1)];
        let out = run(&p, &[], &rows);
        assert_eq!(shape(&out), vec![(1, 10, true), (3, 1, true)]);
        assert_eq!(predicted(&p, &out), 24.5);
    }

    /// A row behind the first is refused at once only when even its least chunk (its
    /// remainder, when below the floor) does not fit: a mid-prefill row with 2 tokens left
    /// runs them in exactly the time left, although its floor (8) would not fit.
    #[test]
    fn a_later_row_whose_remainder_fits_exactly_is_not_refused_for_its_floor() {
        let model = LatencyModel::try_new(5.0, 0.5, 0.0, 0.25).unwrap();
        let a_and_c = StepFeatures::EMPTY.with_chunk(10, 20).with_chunk(10, 12);
        let p = StepParams {
            max_step_ms: Some(model.predict_ms(&a_and_c)),
            cost: Some(model),
            ..params(Some(4096), 8)
        };
        // All mid-prefill, planned in order: A runs its 10 tokens, B (floor 8 at 100) does not
        // fit, C runs its last 2.
        let rows = [mid(1, 20, 10), mid(2, 200, 100), mid(3, 12, 10)];
        let out = run(&p, &[], &rows);
        assert_eq!(shape(&out), vec![(1, 10, true), (3, 2, true)]);
        assert_eq!(out.waiting, 1);
        assert_eq!(Some(predicted(&p, &out)), p.max_step_ms);
    }

    /// A new row whose whole rest fits runs whole even when no more rows may be left
    /// mid-prefill: `max_partial_prefills` holds back cuts only.
    #[test]
    fn a_whole_row_fits_in_time_when_partial_prefills_are_full() {
        let p = StepParams {
            max_row_tokens: Some(32),
            max_partial_prefills: Some(1),
            slots_per_row: 0,
            ..timed(1000, 1, 1000.0)
        };
        // A stays mid-prefill (32 of its 900 tokens left); B runs whole; C would be a cut.
        let out = run(&p, &[], &[mid(1, 1000, 100), prompt(2, 4), prompt(3, 100)]);
        assert_eq!(shape(&out), vec![(1, 32, false), (2, 4, true)]);
        assert_eq!(out.waiting, 1);
    }

    /// Only the first prefill row in order is given the floor when nothing aligned fits in
    /// time; a later one whose least chunk fits but whose first aligned end does not waits.
    #[test]
    fn a_later_row_with_no_aligned_end_in_time_waits_instead_of_running_the_floor() {
        let model = LatencyModel::try_new(5.0, 0.5, 0.0, 0.25).unwrap();
        // A: 23.75 ms. B from 0: 8 tokens (its floor) would be +13 ms, fitting 40 ms; its
        // first aligned end, 16, would be +42 ms.
        let p = StepParams {
            max_step_ms: Some(40.0),
            cost: Some(model),
            align: 16,
            ..params(Some(4096), 8)
        };
        let out = run(&p, &[], &[prompt(1, 10), prompt(2, 100)]);
        assert_eq!(shape(&out), vec![(1, 10, true)]);
        assert_eq!((out.waiting, out.time_over), (1, None));
    }

    /// A row that cannot be cut is measured from where it stands (after its cached prefix);
    /// runs whole over the budget only when larger than the budget and first; and is over the
    /// budget only when it needs more than is left.
    #[test]
    fn an_uncut_row_is_measured_from_its_progress_and_flagged_only_when_over() {
        let p = StepParams {
            chunkable: false,
            ..params(Some(10), 1)
        };
        // 14 tokens, 6 of them cached: 8 to run, within the budget.
        let cached = PrefillRow {
            cached: 6,
            progress: 6,
            ..prompt(1, 14)
        };
        let out = run(&p, &[], &[cached]);
        assert_eq!(shape(&out), vec![(1, 8, true)]);
        assert!(!out.uncut_over_budget);
        // Exactly the budget, alone: it fits, and is not over.
        let out = run(&p, &[], &[prompt(1, 10)]);
        assert_eq!(shape(&out), vec![(1, 10, true)]);
        assert!(!out.uncut_over_budget);
        // Exactly the budget behind a decode row: it is not larger than the budget, so it
        // waits for a step with room.
        let out = run(&p, &[decode(1, 1)], &[prompt(2, 10)]);
        assert_eq!(shape(&out), vec![(1, 1, false)]);
        assert_eq!((out.waiting, out.uncut_over_budget), (1, false));
        // One more than the budget behind it: it runs whole, over the budget.
        let out = run(&p, &[decode(1, 1)], &[prompt(2, 11)]);
        assert_eq!(shape(&out), vec![(1, 1, false), (2, 11, true)]);
        assert!(out.uncut_over_budget);
        // 14 tokens with 4 cached behind it: the 10 it runs are not more than the budget, so
        // it waits (its total is, but the cached prefix does not run).
        let cached = PrefillRow {
            cached: 4,
            progress: 4,
            ..prompt(2, 14)
        };
        let out = run(&p, &[decode(1, 1)], &[cached]);
        assert_eq!(shape(&out), vec![(1, 1, false)]);
        assert_eq!(out.waiting, 1);
        // Over `max_row_tokens` but exactly what is left: it runs whole, not over the budget.
        let capped = StepParams {
            max_row_tokens: Some(5),
            ..p
        };
        let out = run(&capped, &[], &[prompt(1, 10)]);
        assert_eq!(shape(&out), vec![(1, 10, true)]);
        assert!(!out.uncut_over_budget);
    }

    // The shortcut's other mutants are equivalent: turning it off (`shortcut: false`, `check`
    // doing nothing, its early return always taken or never), a smaller least chunk (any other
    // arithmetic of `m(m + 1)/2` except `m + (m + 1)/2`, killed above), the cache of the last
    // "not full" dropped or also set when full, or `check` called more often (after a row that
    // fits, or for the first row: the bound holds whenever it is computed) only plan later rows
    // one by one, to the same plan, as `the_time_full_shortcut_changes_no_plan` checks;
    // `slow_pass` exists only under the `bench-slow-planner` feature.
    proptest! {
        #![proptest_config(ProptestConfig::with_cases(3000))]
        #[test]
        fn the_time_full_shortcut_changes_no_plan(
            (cont, prefill) in arb_rows(),
            budget in 16u32..20_000,
            floor in 1u32..128,
            align in prop::sample::select(vec![1u32, 16, 64]),
            chunkable in any::<bool>(),
            partial in prop::option::of(1u32..4),
            coefficients in (0.0f64..10.0, 0.0f64..0.1, 0.0f64..1e-4, 0.0f64..1e-5),
            max_step_ms in 1.0f64..200.0,
        ) {
            let p = StepParams {
                align,
                chunkable,
                max_partial_prefills: partial,
                slots_per_row: 0,
                ..params(Some(budget), floor.min(budget))
            };
            let (b, t, k, a) = coefficients;
            let time = Some(TimeLimit {
                model: LatencyModel::try_new(b, t, k, a).unwrap(),
                max_step_ms,
                clock: StepClock::default(),
            });
            let (mut fast, mut reference) = (StepPlan::default(), StepPlan::default());
            plan_timed_with(&p, time, &cont, &prefill, &mut fast, true);
            plan_timed_with(&p, time, &cont, &prefill, &mut reference, false);
            prop_assert_eq!(fast, reference);
        }

        /// The budget-full shortcut (once a cut step's token budget is used up, every later
        /// row waits unplanned) plans what planning each row would: under the token budget
        /// alone or a time limit, in admission order or ranked (here: the queue reversed).
        #[test]
        fn the_budget_full_shortcut_changes_no_plan(
            (cont, prefill) in arb_rows(),
            budget in 1u32..20_000,
            floor in 1u32..128,
            align in prop::sample::select(vec![1u32, 16, 64]),
            chunkable in any::<bool>(),
            partial in prop::option::of(1u32..4),
            timed in prop::option::of((
                (0.0f64..10.0, 0.0f64..0.1, 0.0f64..1e-4, 0.0f64..1e-5),
                1.0f64..200.0,
            )),
            reversed in any::<bool>(),
        ) {
            let p = StepParams {
                align,
                chunkable,
                max_partial_prefills: partial,
                slots_per_row: 0,
                ..params(Some(budget), floor.min(budget))
            };
            let time = timed.map(|((b, t, k, a), max_step_ms)| TimeLimit {
                model: LatencyModel::try_new(b, t, k, a).unwrap(),
                max_step_ms,
                clock: StepClock::default(),
            });
            let rank: Vec<u32> = (0..prefill.len() as u32).rev().collect();
            let plan = |shortcut: bool| {
                let mut out = StepPlan::default();
                if reversed {
                    let ranked = rank.iter().filter_map(|&i| prefill.get(i as usize));
                    plan_walk(&p, time, &cont, &prefill, [(None, ranked)], &mut out, shortcut);
                } else {
                    plan_timed_with(&p, time, &cont, &prefill, &mut out, shortcut);
                }
                out
            };
            prop_assert_eq!(plan(true), plan(false));
        }
    }
}
