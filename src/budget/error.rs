//! Why budget settings were refused ([`BudgetError`]), each saying what it is about
//! ([`Subject`]: a [`SettingKey`], node and walk) and which rule it breaks ([`Rule`]).

use std::fmt;

use crate::policy::Name;

/// Why a setting was refused. Each names the node, the walk and the rule it breaks
/// (`docs/budgets.md#refusals`).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum BudgetError {
    /// `set_budgets` before `set_policies`.
    #[error("no model policies are bound yet: `set_budgets` runs after `set_policies`")]
    PoliciesNotSet,
    /// A node the model does not have (`docs/budgets.md#an-unknown-node`).
    #[error("`{setting}` names node `{node}`, which the model does not have")]
    UnknownNode {
        /// The setting that names it.
        setting: SettingKey,
        /// The node.
        node: Name,
    },
    /// A walk not in `walks` (`docs/budgets.md#a-walk-not-served`).
    #[error("budget for `{node}`/`{walk}`: walk `{walk}` is not served by this deployment")]
    WalkNotServed {
        /// The per-node setting (`max_batch_tokens` or `max_step_ms`) that names the walk.
        setting: SettingKey,
        /// The node.
        node: Name,
        /// The walk.
        walk: Name,
    },
    /// `combined_walk_of` names a walk not in `walks` (`docs/budgets.md#a-walk-not-served`).
    #[error("`combined_walk_of` names walk `{walk}`, which is not served by this deployment")]
    CombinedWalkNotServed {
        /// The walk.
        walk: Name,
    },
    /// A per-walk override of a walk the model does not budget on the node
    /// (`docs/budgets.md#a-walk-the-model-does-not-budget`).
    #[error("budget for `{node}`/`{walk}` would do nothing: the model does not budget `{walk}` on `{node}`")]
    WalkNotBudgeted {
        /// The node.
        node: Name,
        /// The walk.
        walk: Name,
    },
    /// A node-wide budget on a node that budgets no walk
    /// (`docs/budgets.md#a-node-that-budgets-nothing`).
    #[error("budget for `{node}` would do nothing: the model budgets no walk on `{node}`")]
    NodeBudgetsNothing {
        /// The per-node setting (`max_batch_tokens` or `max_step_ms`) set on the node.
        setting: SettingKey,
        /// The node.
        node: Name,
    },
    /// A member walk's budget on a node that cannot cap member walks
    /// (`docs/budgets.md#a-member-walks-budget`).
    #[error("budget for `{node}`/`{walk}` would do nothing: `{walk}` runs inside `{combined}` and `{node}` cannot cap member walks; set `{combined}` instead")]
    MemberWalk {
        /// The node.
        node: Name,
        /// The walk.
        walk: Name,
        /// The combined walk it runs inside.
        combined: Name,
    },
    /// `min_chunk_tokens`, `max_row_tokens`, `max_partial_prefills` or `max_wait_steps` of 0
    /// (`docs/budgets.md#not-a-positive-whole-number` for the floor, `docs/budgets.md#a-limit-of-0`
    /// for the per-row and partial-prefill limits, `docs/scheduling.md#the-order-of-waiting-prompts`
    /// for the wait).
    #[error("`{setting}` must be at least 1, got 0")]
    ZeroSetting {
        /// The setting.
        setting: SettingKey,
    },
    /// A budget below the policy's `align`: no aligned chunk could be cut.
    #[error("budget for `{node}`/`{walk}` is {budget}, below the policy's `align` of {align} tokens: no aligned chunk would fit")]
    BelowAlign {
        /// The node.
        node: Name,
        /// The walk.
        walk: Name,
        /// The budget.
        budget: u32,
        /// The policy's `align`.
        align: u32,
    },
    /// `max_row_tokens` below an `align`: rows there could never be cut.
    #[error("`max_row_tokens` {max_row} is below the `align` of {align} tokens of `{node}`/`{walk}`: rows there could never be cut")]
    RowCapBelowAlign {
        /// The `max_row_tokens` given.
        max_row: u32,
        /// The node.
        node: Name,
        /// The walk.
        walk: Name,
        /// The policy's `align`.
        align: u32,
    },
    /// `slots_per_row` at or above a step's budget: no row of that step could run a token.
    #[error("`slots_per_row` {slots} fills the budget of {budget} tokens of `{node}`/`{walk}`: no row there could run a token")]
    SlotsFillBudget {
        /// The `slots_per_row` given.
        slots: u32,
        /// The node.
        node: Name,
        /// The walk.
        walk: Name,
        /// The step's budget.
        budget: u32,
    },
    /// A time budget that is not a finite number of milliseconds above 0.
    #[error("time budget for `{node}`{} must be a finite number of milliseconds above 0, got {value}", walk.as_ref().map(|w| format!("/`{w}`")).unwrap_or_default())]
    BadTimeBudget {
        /// The node.
        node: Name,
        /// The walk, for a per-walk budget.
        walk: Option<Name>,
        /// The value given.
        value: f64,
    },
    /// A time budget where steps are not chunked (no token budget): it would do nothing.
    #[error("time budget for `{node}`/`{walk}` would do nothing: steps of `{walk}` on `{node}` have no token budget, so nothing is cut")]
    TimeBudgetDoesNothing {
        /// The node.
        node: Name,
        /// The walk.
        walk: Name,
    },
    /// A node-wide time budget on a node whose step walks all have their token budget off:
    /// it would bound no step (a time budget bounds a step through the chunks it cuts).
    #[error("`chunking.max_step_ms.{node}` would do nothing: `chunking.max_batch_tokens.{node}.{walk}` is off, so no step is cut; set a token budget there or the time budget off")]
    TimeBudgetWithoutTokenBudget {
        /// The node.
        node: Name,
        /// Its step walk whose token budget is off (the first, when there are several).
        walk: Name,
    },
    /// A time budget on a member walk: steps run under their combined walk's time budget.
    #[error("time budget for `{node}`/`{walk}` would do nothing: `{walk}` runs inside `{combined}`, whose time budget applies; set `{combined}` instead")]
    TimeMemberWalk {
        /// The node.
        node: Name,
        /// The walk.
        walk: Name,
        /// The combined walk it runs inside.
        combined: Name,
    },
    /// A time budget on a node with no latency model and no online fit.
    #[error("time budget for `{node}` needs a latency model: set `chunking.cost.{node}` or turn on `chunking.learn_cost`")]
    NoLatencyModel {
        /// The node.
        node: Name,
    },
    /// A served walk the node's submodule can cut, with no budget there and in no combined walk,
    /// on a node where another served walk with a budget runs standalone: that walk's steps
    /// would never run its rows, which would only run uncut in steps of their own
    /// (`docs/budgets.md#a-walk-no-step-would-take`). The usual cause is a forgotten
    /// `combined_walk_of`.
    #[error("walk `{walk}` on `{node}` runs inside no combined walk: `{combined}` steps would never run its rows, and `{walk}` steps would run them uncut (the model gives `{walk}` no budget on `{node}`); combine it (`combined_walk_of`: `{walk}` -> `{combined}`) or name `{node}` in `no_chunking`")]
    WalkNeverChunked {
        /// The node.
        node: Name,
        /// The walk.
        walk: Name,
        /// The served walk with a budget on the node that could take its rows as their
        /// combined walk.
        combined: Name,
    },
    /// A configured latency model whose four coefficients are all 0: it would predict every
    /// step at 0 ms, so a time budget would never cut anything (`fit` on steps that all took
    /// 0 ms gives one).
    #[error("latency model for `{node}` is all zero: it predicts every step at 0 ms; give measured coefficients or a preset")]
    ZeroLatencyModel {
        /// The node.
        node: Name,
    },
    /// A configured latency model with a coefficient above
    /// [`MAX_COEFFICIENT_MS`](crate::latency::MAX_COEFFICIENT_MS): its predictions could
    /// overflow to infinity, and no step is that slow.
    #[error("latency model for `{node}`: `{key}` is {value:e} ms, above the {max:e} ms a coefficient may be (its predictions would overflow)", max = crate::latency::MAX_COEFFICIENT_MS)]
    LatencyModelTooLarge {
        /// The node.
        node: Name,
        /// The coefficient's key.
        key: &'static str,
        /// Its value.
        value: f64,
    },
    /// A time budget below the `base_ms` of the node's configured latency model: every step is
    /// predicted over it, so no step can meet it.
    #[error("time budget for `{node}`/`{walk}` of {max_step_ms} ms is below the latency model's `base_ms` of {base_ms} ms: every step is predicted over it, so no step can meet it")]
    TimeBudgetBelowBase {
        /// The node.
        node: Name,
        /// The walk.
        walk: Name,
        /// The time budget, ms.
        max_step_ms: f64,
        /// The model's `base_ms`.
        base_ms: f64,
    },
    /// A time margin quantile outside `(0, 1]`, or not a number.
    #[error("time margin quantile must be a number in (0, 1], got {value}")]
    BadTimeMargin {
        /// The refused value.
        value: f64,
    },
    /// A time margin with no time budget on any node: it would do nothing.
    #[error("a time margin does nothing without a time budget: set `max_step_ms` on a node")]
    TimeMarginWithoutBudget,
    /// A starvation bound in ms that is not a finite number above 0.
    #[error("`max_wait_ms` must be a finite number of milliseconds above 0, got {value}")]
    BadMaxWait {
        /// The refused value.
        value: f64,
    },
    /// A walk in two combined walks (`docs/budgets.md#a-walk-in-two-combined-walks`).
    #[error("walk `{walk}` is a member of two combined walks, `{first}` and `{second}`")]
    WalkInTwoCombined {
        /// The walk.
        walk: Name,
        /// The first combined walk.
        first: Name,
        /// The second combined walk.
        second: Name,
    },
}

/// A setting of [`BudgetSettings`](super::BudgetSettings) a refusal is about; it displays as its key under a serving
/// config's `[chunking]` section, so a config loader names the key a refusal is about without
/// reading its message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SettingKey {
    /// [`BudgetSettings::overrides`](super::BudgetSettings::overrides): `max_batch_tokens`, per node.
    MaxBatchTokens,
    /// [`TimeSettings::max_step_ms`](super::TimeSettings::max_step_ms): `max_step_ms`, per node.
    MaxStepMs,
    /// [`TimeSettings::cost`](super::TimeSettings::cost): `cost`, per node.
    Cost,
    /// [`BudgetSettings::no_chunking`](super::BudgetSettings::no_chunking): a list of nodes.
    NoChunking,
    /// [`BudgetSettings::override_mixed`](super::BudgetSettings::override_mixed): a list of nodes (the model's say).
    OverrideMixed,
    /// [`BudgetSettings::combined_walk_of`](super::BudgetSettings::combined_walk_of) (the model's say).
    CombinedWalkOf,
    /// [`BudgetSettings::min_chunk_tokens`](super::BudgetSettings::min_chunk_tokens).
    MinChunkTokens,
    /// [`BudgetSettings::max_row_tokens`](super::BudgetSettings::max_row_tokens).
    MaxRowTokens,
    /// [`BudgetSettings::max_partial_prefills`](super::BudgetSettings::max_partial_prefills).
    MaxPartialPrefills,
    /// [`BudgetSettings::slots_per_row`](super::BudgetSettings::slots_per_row).
    SlotsPerRow,
    /// [`TimeSettings::margin_quantile`](super::TimeSettings::margin_quantile): `time_margin`.
    TimeMargin,
    /// [`OrderSettings`](super::OrderSettings): `order`, for every node or per node.
    Order,
    /// [`WaitBound::max_wait_ms`](crate::order::WaitBound::max_wait_ms).
    MaxWaitMs,
    /// [`WaitBound::max_wait_steps`](crate::order::WaitBound::max_wait_steps).
    MaxWaitSteps,
}

impl SettingKey {
    /// The setting's key: `max_batch_tokens`, `no_chunking`, ...
    pub fn key(self) -> &'static str {
        match self {
            Self::MaxBatchTokens => "max_batch_tokens",
            Self::MaxStepMs => "max_step_ms",
            Self::Cost => "cost",
            Self::NoChunking => "no_chunking",
            Self::OverrideMixed => "override_mixed",
            Self::CombinedWalkOf => "combined_walk_of",
            Self::MinChunkTokens => "min_chunk_tokens",
            Self::MaxRowTokens => "max_row_tokens",
            Self::MaxPartialPrefills => "max_partial_prefills",
            Self::SlotsPerRow => "slots_per_row",
            Self::TimeMargin => "time_margin",
            Self::Order => "order",
            Self::MaxWaitMs => "max_wait_ms",
            Self::MaxWaitSteps => "max_wait_steps",
        }
    }
}

impl fmt::Display for SettingKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.key())
    }
}

/// What a refusal is about: the setting, and for a per-node setting the node and walk whose
/// value was refused (`walk: None`: the node-wide value).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Subject<'a> {
    /// The setting.
    pub setting: SettingKey,
    /// The node, for a per-node setting or a list of nodes.
    pub node: Option<&'a Name>,
    /// The walk, for a per-walk value.
    pub walk: Option<&'a Name>,
}

/// The documented rule a refusal breaks; it displays as the page and the anchor of the heading
/// that describes it (`docs/budgets.md#a-walk-in-two-combined-walks`), never a number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rule {
    /// A refusal of `docs/budgets.md#refusals`, by its heading there (`None`: the section).
    Budgets(Option<Refusal>),
    /// `docs/cost-model.md#time-budgets`.
    TimeBudgets,
    /// `docs/cost-model.md#the-time-margin`.
    TimeMargin,
    /// `docs/scheduling.md#the-order-of-waiting-prompts`.
    Order,
}

impl Rule {
    /// Every rule a refusal may cite, so a test can check each one's heading exists.
    pub const ALL: [Rule; 16] = [
        Self::Budgets(None),
        Self::Budgets(Some(Refusal::UnknownNode)),
        Self::Budgets(Some(Refusal::WalkNotServed)),
        Self::Budgets(Some(Refusal::WalkNotBudgeted)),
        Self::Budgets(Some(Refusal::NodeBudgetsNothing)),
        Self::Budgets(Some(Refusal::MemberWalk)),
        Self::Budgets(Some(Refusal::NotPositive)),
        Self::Budgets(Some(Refusal::WalkInTwoCombined)),
        Self::Budgets(Some(Refusal::BelowAlign)),
        Self::Budgets(Some(Refusal::RowCapBelowAlign)),
        Self::Budgets(Some(Refusal::ZeroLimit)),
        Self::Budgets(Some(Refusal::WalkNeverChunked)),
        Self::Budgets(Some(Refusal::SlotsFillBudget)),
        Self::TimeBudgets,
        Self::TimeMargin,
        Self::Order,
    ];

    /// The page the rule is on, from the repository's root: `docs/budgets.md`.
    pub fn page(self) -> &'static str {
        match self {
            Self::Budgets(_) => "docs/budgets.md",
            Self::TimeBudgets | Self::TimeMargin => "docs/cost-model.md",
            Self::Order => "docs/scheduling.md",
        }
    }

    /// The anchor of the rule's heading on its page: `a-walk-in-two-combined-walks`.
    pub fn anchor(self) -> &'static str {
        match self {
            Self::Budgets(Some(r)) => r.anchor(),
            Self::Budgets(None) => "refusals",
            Self::TimeBudgets => "time-budgets",
            Self::TimeMargin => "the-time-margin",
            Self::Order => "the-order-of-waiting-prompts",
        }
    }
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}#{}", self.page(), self.anchor())
    }
}

/// A refusal of `docs/budgets.md#refusals`, each with a heading of its own there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// `An unknown node`: a setting names a node the model does not have.
    UnknownNode,
    /// `A walk not served`: a walk this deployment does not run.
    WalkNotServed,
    /// `A walk the model does not budget` on the node.
    WalkNotBudgeted,
    /// `A node that budgets nothing`, given a node-wide budget.
    NodeBudgetsNothing,
    /// `A member walk's budget` on a node that cannot use it.
    MemberWalk,
    /// `Not a positive whole number`: a budget or the floor.
    NotPositive,
    /// `A walk in two combined walks`.
    WalkInTwoCombined,
    /// `A budget below its align`.
    BelowAlign,
    /// `max_row_tokens below an align`.
    RowCapBelowAlign,
    /// `A limit of 0`: `max_row_tokens` or `max_partial_prefills`.
    ZeroLimit,
    /// `A walk no step would take`.
    WalkNeverChunked,
    /// `Slots that fill a budget`.
    SlotsFillBudget,
}

impl Refusal {
    /// The anchor of the refusal's heading in `docs/budgets.md` (GitHub's, from the heading).
    pub fn anchor(self) -> &'static str {
        match self {
            Self::UnknownNode => "an-unknown-node",
            Self::WalkNotServed => "a-walk-not-served",
            Self::WalkNotBudgeted => "a-walk-the-model-does-not-budget",
            Self::NodeBudgetsNothing => "a-node-that-budgets-nothing",
            Self::MemberWalk => "a-member-walks-budget",
            Self::NotPositive => "not-a-positive-whole-number",
            Self::WalkInTwoCombined => "a-walk-in-two-combined-walks",
            Self::BelowAlign => "a-budget-below-its-align",
            Self::RowCapBelowAlign => "max_row_tokens-below-an-align",
            Self::ZeroLimit => "a-limit-of-0",
            Self::WalkNeverChunked => "a-walk-no-step-would-take",
            Self::SlotsFillBudget => "slots-that-fill-a-budget",
        }
    }
}

impl BudgetError {
    /// The setting the refusal is about, with its node and walk; `None` when it is about no
    /// one setting (`set_budgets` before `set_policies`, a walk no combined walk takes).
    pub fn subject(&self) -> Option<Subject<'_>> {
        use SettingKey as K;
        let at = |setting, node, walk| {
            Some(Subject {
                setting,
                node: Some(node),
                walk,
            })
        };
        let whole = |setting| {
            Some(Subject {
                setting,
                node: None,
                walk: None,
            })
        };
        match self {
            Self::PoliciesNotSet | Self::WalkNeverChunked { .. } => None,
            Self::UnknownNode { setting, node } | Self::NodeBudgetsNothing { setting, node } => {
                at(*setting, node, None)
            }
            Self::WalkNotServed {
                setting,
                node,
                walk,
            } => at(*setting, node, Some(walk)),
            Self::CombinedWalkNotServed { walk } | Self::WalkInTwoCombined { walk, .. } => {
                Some(Subject {
                    setting: K::CombinedWalkOf,
                    node: None,
                    walk: Some(walk),
                })
            }
            Self::WalkNotBudgeted { node, walk }
            | Self::MemberWalk { node, walk, .. }
            | Self::BelowAlign { node, walk, .. } => at(K::MaxBatchTokens, node, Some(walk)),
            Self::ZeroSetting { setting } => whole(*setting),
            Self::RowCapBelowAlign { .. } => whole(K::MaxRowTokens),
            Self::SlotsFillBudget { node, walk, .. } => at(K::SlotsPerRow, node, Some(walk)),
            Self::BadTimeBudget { node, walk, .. } => at(K::MaxStepMs, node, walk.as_ref()),
            Self::TimeBudgetDoesNothing { node, walk }
            | Self::TimeMemberWalk { node, walk, .. }
            | Self::TimeBudgetBelowBase { node, walk, .. } => at(K::MaxStepMs, node, Some(walk)),
            Self::NoLatencyModel { node } | Self::TimeBudgetWithoutTokenBudget { node, .. } => {
                at(K::MaxStepMs, node, None)
            }
            Self::ZeroLatencyModel { node } | Self::LatencyModelTooLarge { node, .. } => {
                at(K::Cost, node, None)
            }
            Self::BadTimeMargin { .. } | Self::TimeMarginWithoutBudget => whole(K::TimeMargin),
            Self::BadMaxWait { .. } => whole(K::MaxWaitMs),
        }
    }

    /// The documented rule the refusal breaks.
    pub fn rule(&self) -> Rule {
        use Refusal as R;
        use SettingKey as K;
        let b = |r| Rule::Budgets(Some(r));
        match self {
            Self::UnknownNode {
                setting: K::Order, ..
            }
            | Self::BadMaxWait { .. }
            | Self::ZeroSetting {
                setting: K::MaxWaitSteps,
            } => Rule::Order,
            Self::UnknownNode { .. } => b(R::UnknownNode),
            Self::WalkInTwoCombined { .. } => b(R::WalkInTwoCombined),
            Self::WalkNotServed { .. } | Self::CombinedWalkNotServed { .. } => b(R::WalkNotServed),
            Self::WalkNotBudgeted { .. } => b(R::WalkNotBudgeted),
            Self::NodeBudgetsNothing { .. } => b(R::NodeBudgetsNothing),
            Self::MemberWalk { .. } => b(R::MemberWalk),
            Self::ZeroSetting {
                setting: K::MinChunkTokens,
            } => b(R::NotPositive),
            Self::ZeroSetting { .. } => b(R::ZeroLimit),
            Self::BelowAlign { .. } => b(R::BelowAlign),
            Self::RowCapBelowAlign { .. } => b(R::RowCapBelowAlign),
            Self::SlotsFillBudget { .. } => b(R::SlotsFillBudget),
            Self::WalkNeverChunked { .. } => b(R::WalkNeverChunked),
            Self::BadTimeBudget { .. }
            | Self::TimeBudgetDoesNothing { .. }
            | Self::TimeBudgetWithoutTokenBudget { .. }
            | Self::TimeMemberWalk { .. }
            | Self::NoLatencyModel { .. }
            | Self::TimeBudgetBelowBase { .. }
            | Self::ZeroLatencyModel { .. }
            | Self::LatencyModelTooLarge { .. } => Rule::TimeBudgets,
            Self::BadTimeMargin { .. } | Self::TimeMarginWithoutBudget => Rule::TimeMargin,
            Self::PoliciesNotSet => Rule::Budgets(None),
        }
    }

    /// The refused value, where the refusal carries it (a 0, a `max_row_tokens`); a per-node
    /// value is quoted from where it was written by whoever reports the refusal.
    pub fn value(&self) -> Option<String> {
        match self {
            Self::ZeroSetting { .. } => Some("0".into()),
            Self::RowCapBelowAlign { max_row, .. } => Some(max_row.to_string()),
            Self::SlotsFillBudget { slots, .. } => Some(slots.to_string()),
            Self::BadTimeMargin { value } | Self::BadMaxWait { value } => Some(value.to_string()),
            Self::LatencyModelTooLarge { value, .. } => Some(value.to_string()),
            _ => None,
        }
    }
}

/// Every problem with a refused setting, in the order found.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{}", self.0.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
pub struct BudgetErrors(pub Vec<BudgetError>);
