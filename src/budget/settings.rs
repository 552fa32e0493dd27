//! The arguments of `set_budgets` ([`BudgetSettings`], [`TimeSettings`]) and their builder.

use std::collections::{BTreeMap, BTreeSet};
use std::num::NonZeroU32;

use super::value::{BudgetValue, NodeBudget, NodeTimeBudget, TimeBudget, DEFAULT_MIN_CHUNK_TOKENS};
use crate::latency::LatencyModel;
use crate::order::{NodeOrder, Order, WaitBound};
use crate::policy::{ModelPolicies, Name};

/// The order of each node's waiting prompts and their starvation bound
/// (`docs/scheduling.md#the-order-of-waiting-prompts`).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct OrderSettings {
    /// The order of every node not in `per_node` (`chunking.order = "…"`).
    pub all: Order,
    /// Per node, its own order (`chunking.order = { llm = "…" }`).
    pub per_node: BTreeMap<Name, Order>,
    /// The starvation bound, for every node (`chunking.max_wait_ms`, `chunking.max_wait_steps`).
    pub bound: WaitBound,
}

impl OrderSettings {
    /// The order and bound steps of `node` are planned under.
    pub fn of(&self, node: &str) -> NodeOrder {
        NodeOrder {
            order: self.per_node.get(node).copied().unwrap_or(self.all),
            bound: self.bound,
        }
    }
}

/// Cost-aware chunking's settings (`docs/cost-model.md`): time budgets and where the latency
/// model comes from.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TimeSettings {
    /// Per node, one time budget or `walk -> ms` (`chunking.max_step_ms`).
    pub max_step_ms: BTreeMap<Name, NodeTimeBudget>,
    /// Per node, the latency model from config (`chunking.cost.<node>`).
    pub cost: BTreeMap<Name, LatencyModel>,
    /// Whether to fit each node's model online from the step times `complete` or `complete_and_assemble`
    /// reports, and plan with it once it is trusted (`chunking.learn_cost`).
    pub learn: bool,
    /// The time margin's quantile (`docs/cost-model.md#the-time-margin`): with measured step
    /// times, each node's timed steps are planned against their time budget divided by this
    /// quantile of its recent measured ÷ predicted ratios. `None`: planned against the budget.
    pub margin_quantile: Option<f64>,
    /// What the first prefill row's floor chunk does when it does not fit in time beside the
    /// step's continuing rows (`chunking.time_floor`).
    pub floor: TimeFloor,
}

/// What the first prefill row in order does when even a chunk of the floor does not fit in
/// time beside the step's other rows (`chunking.time_floor`, `docs/cost-model.md#time-budgets`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TimeFloor {
    /// It waits, and the step runs its other rows inside the time budget, until the row has
    /// waited for a chunk as long as the starvation bound (`chunking.max_wait_ms` /
    /// `chunking.max_wait_steps`, else [`DEFAULT_FLOOR_WAIT_STEPS`] steps); then it runs a
    /// chunk of the floor, counted as a `floor` time overrun. The default.
    #[default]
    Yield,
    /// It runs a chunk of the floor at once, counted as a `floor` time overrun.
    Run,
}

impl TimeFloor {
    /// The value as written in `chunking.time_floor`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Yield => "yield",
            Self::Run => "run",
        }
    }
}

/// The starvation bound of a floor that yields when `chunking.max_wait_ms` and
/// `chunking.max_wait_steps` are both unset: a prompt waits through at most this many of its
/// node's steps, so a node that is never free runs at most one step in 101 over its time budget
/// by the floor.
pub const DEFAULT_FLOOR_WAIT_STEPS: u64 = 100;

impl TimeSettings {
    /// The bound a yielding floor waits for, or `None` when the floor always runs.
    pub fn floor_yield(&self, order: &OrderSettings) -> Option<WaitBound> {
        match self.floor {
            TimeFloor::Run => None,
            TimeFloor::Yield if order.bound.is_off() => Some(WaitBound {
                max_wait_ms: None,
                max_wait_steps: Some(DEFAULT_FLOOR_WAIT_STEPS),
            }),
            TimeFloor::Yield => Some(order.bound),
        }
    }
}

/// The arguments of `set_budgets`: a serving config applied on top of the model's policies.
#[derive(Debug, Clone, PartialEq)]
pub struct BudgetSettings {
    /// Per node, one budget or `walk -> budget`.
    pub overrides: BTreeMap<Name, NodeBudget>,
    /// The walks this deployment serves.
    pub walks: BTreeSet<Name>,
    /// `member walk -> combined walk` (`prefill -> mixed`, `decode -> mixed`).
    pub combined_walk_of: BTreeMap<Name, Name>,
    /// Nodes whose submodule can cap member walks inside a combined step.
    pub override_mixed: BTreeSet<Name>,
    /// Nodes this worker chunks nowhere.
    pub no_chunking: BTreeSet<Name>,
    /// The floor a row is cut to; refused when 0.
    pub min_chunk_tokens: u32,
    /// Optional per-row cap: a row runs at most this many tokens a step. Refused when 0.
    pub max_row_tokens: Option<u32>,
    /// Optional: a new row is not started with a non-final chunk while this many rows would
    /// stay mid-prefill after the step. Refused when 0.
    pub max_partial_prefills: Option<u32>,
    /// Input slots each row of a budgeted step takes beyond its tokens (a speculative drafter's
    /// slots, which the engine adds to every row it schedules), charged to the token budget and
    /// not to walk caps. 0 (the default) charges a row its tokens alone.
    pub slots_per_row: u32,
    /// Time budgets and latency models.
    pub time: TimeSettings,
    /// The order of waiting prompts per node, and the starvation bound.
    pub order: OrderSettings,
}

/// A builder over the fields: every method takes and returns the settings. A budget is a
/// [`BudgetValue`]: a [`NonZeroU32`] token count (which converts into one) or an explicit
/// [`BudgetValue::Off`], so neither a zero budget nor an accidental "off" can be written: a
/// computed `NonZeroU32::new(n)` is an `Option` and does not convert.
///
/// ```
/// use std::num::NonZeroU32;
/// use mstar_chunking::{BudgetSettings, BudgetValue};
///
/// let settings = BudgetSettings::new(["prefill", "decode", "mixed"])
///     .combined("mixed", ["prefill", "decode"])
///     .budget("llm", NonZeroU32::new(2048).expect("a budget is at least 1 token"))
///     .walk_budget("thinker", "prefill", BudgetValue::Off) // chunking off for this walk
///     .max_step_ms("llm", 50.0) // a time budget (needs a latency model: `cost`)
///     .min_chunk_tokens(NonZeroU32::new(32).unwrap());
/// assert_eq!(settings.combined_walk_of["decode"].as_ref(), "mixed");
/// assert_eq!(settings.min_chunk_tokens, 32);
/// ```
///
/// A computed budget that is 0 cannot turn chunking off by accident: `NonZeroU32::new(n)` is an
/// `Option`, which is not a budget, so this does not compile:
///
/// ```compile_fail,E0277
/// use std::num::NonZeroU32;
/// use mstar_chunking::BudgetSettings;
///
/// let n: u32 = 0;
/// let _ = BudgetSettings::new(["prefill"]).budget("llm", NonZeroU32::new(n));
/// ```
impl BudgetSettings {
    /// Settings serving `walks`, with no overrides (every budget the model's), no combined
    /// walk and the default floor ([`DEFAULT_MIN_CHUNK_TOKENS`]).
    pub fn new<I, S>(walks: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        Self {
            overrides: BTreeMap::new(),
            walks: walks.into_iter().map(|w| Name::from(w.as_ref())).collect(),
            combined_walk_of: BTreeMap::new(),
            override_mixed: BTreeSet::new(),
            no_chunking: BTreeSet::new(),
            min_chunk_tokens: DEFAULT_MIN_CHUNK_TOKENS,
            max_row_tokens: None,
            max_partial_prefills: None,
            slots_per_row: 0,
            time: TimeSettings::default(),
            order: OrderSettings::default(),
        }
    }

    /// Makes `combined` a combined walk whose steps run the rows of `members` (and serves all
    /// of them).
    pub fn combined<I, S>(mut self, combined: &str, members: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let combined = Name::from(combined);
        self.walks.insert(combined.clone());
        for m in members {
            let m = Name::from(m.as_ref());
            self.walks.insert(m.clone());
            self.combined_walk_of.insert(m, combined.clone());
        }
        self
    }

    /// One budget for every walk the model budgets on `node`; [`BudgetValue::Off`] turns
    /// chunking off there.
    pub fn budget(mut self, node: &str, budget: impl Into<BudgetValue>) -> Self {
        self.overrides
            .insert(node.into(), NodeBudget::All(budget.into()));
        self
    }

    /// The budget of `walk` on `node`; [`BudgetValue::Off`] turns chunking off for that walk
    /// there.
    pub fn walk_budget(mut self, node: &str, walk: &str, budget: impl Into<BudgetValue>) -> Self {
        let per_walk = match self.overrides.remove(node) {
            Some(NodeBudget::PerWalk(m)) => m,
            _ => BTreeMap::new(),
        };
        let mut per_walk = per_walk;
        per_walk.insert(walk.into(), budget.into());
        self.overrides
            .insert(node.into(), NodeBudget::PerWalk(per_walk));
        self
    }

    /// The floor a row is cut to.
    pub fn min_chunk_tokens(mut self, tokens: NonZeroU32) -> Self {
        self.min_chunk_tokens = tokens.get();
        self
    }

    /// The most tokens one row runs in a step.
    pub fn max_row_tokens(mut self, tokens: NonZeroU32) -> Self {
        self.max_row_tokens = Some(tokens.get());
        self
    }

    /// The most rows left mid-prefill by starting new ones.
    pub fn max_partial_prefills(mut self, rows: NonZeroU32) -> Self {
        self.max_partial_prefills = Some(rows.get());
        self
    }

    /// The input slots each row takes beyond its tokens, charged to the token budget
    /// ([`BudgetSettings::slots_per_row`]).
    pub fn slots_per_row(mut self, slots: u32) -> Self {
        self.slots_per_row = slots;
        self
    }

    /// Lets `node`'s submodule cap member walks inside a combined step.
    pub fn override_mixed(mut self, node: &str) -> Self {
        self.override_mixed.insert(node.into());
        self
    }

    /// `chunking.max_step_ms`: one time budget for every walk the model budgets on `node`,
    /// in ms (an `f64`) or [`TimeBudget::Off`]. Refused by `set_budgets` unless it is finite
    /// and above 0, and unless the node has a latency model ([`cost`](Self::cost) or
    /// [`learn_cost`](Self::learn_cost)).
    pub fn max_step_ms(mut self, node: &str, budget: impl Into<TimeBudget>) -> Self {
        let value = budget.into();
        self.time
            .max_step_ms
            .insert(node.into(), NodeTimeBudget::All(value));
        self
    }

    /// The latency model steps of `node` are planned with, until an online fit is trusted.
    pub fn cost(mut self, node: &str, model: LatencyModel) -> Self {
        self.time.cost.insert(node.into(), model);
        self
    }

    /// Fits each node's latency model online from measured step times.
    pub fn learn_cost(mut self, learn: bool) -> Self {
        self.time.learn = learn;
        self
    }

    /// Plans timed steps with a time margin at `quantile` of the recent measured ÷ predicted
    /// ratios (`docs/cost-model.md#the-time-margin`). Refused by `set_budgets` unless
    /// `quantile` is in `(0, 1]` and some node has a time budget.
    pub fn time_margin(mut self, quantile: f64) -> Self {
        self.time.margin_quantile = Some(quantile);
        self
    }

    /// `chunking.time_floor`: what the first prefill row's floor chunk does when it does not
    /// fit in time beside the step's continuing rows ([`TimeFloor`]).
    pub fn time_floor(mut self, floor: TimeFloor) -> Self {
        self.time.floor = floor;
        self
    }

    /// `chunking.order`: the order of waiting prompts on every node (per node:
    /// [`node_order`](Self::node_order)).
    pub fn order(mut self, order: Order) -> Self {
        self.order.all = order;
        self
    }

    /// `chunking.order.<node>`: the order of waiting prompts on `node`.
    pub fn node_order(mut self, node: &str, order: Order) -> Self {
        self.order.per_node.insert(node.into(), order);
        self
    }

    /// `chunking.max_wait_ms`: a prompt that has waited this many ms goes first. Refused by
    /// `set_budgets` unless finite and above 0.
    pub fn max_wait_ms(mut self, ms: f64) -> Self {
        self.order.bound.max_wait_ms = Some(ms);
        self
    }

    /// `chunking.max_wait_steps`: a prompt that has waited through this many planned steps of
    /// its node goes first.
    pub fn max_wait_steps(mut self, steps: NonZeroU32) -> Self {
        self.order.bound.max_wait_steps = Some(u64::from(steps.get()));
        self
    }

    /// Chunks nothing on `node` (sequence parallelism).
    pub fn no_chunking(mut self, node: &str) -> Self {
        self.no_chunking.insert(node.into());
        self
    }

    /// No overrides, the default floor; serves every walk the model names and combines none.
    pub fn defaults_for(model: &ModelPolicies) -> Self {
        Self {
            walks: model.walks(),
            ..Self::new::<[&str; 0], &str>([])
        }
    }
}
