//! The deployment's say (docs/budgets.md): `set_budgets` validation and the budget answers.
//!
//! A [`BudgetTable`] is immutable. [`BudgetTable::with_settings`] validates a whole new setting
//! against the model's policies and returns a new table, or every problem at once; the caller
//! keeps the previous table on error, so a refused setting changes nothing.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::num::NonZeroU32;
use std::str::FromStr;
use std::sync::Arc;

use crate::latency::{check_max_step_ms, LatencyModel};
use crate::policy::Name;
use crate::policy::{ChunkingPolicy, ModelPolicies};

/// `min_chunk_tokens` when the serving config sets none.
pub const DEFAULT_MIN_CHUNK_TOKENS: u32 = 64;

/// One budget as a serving config sets it: a positive token count or off. The config wing
/// parses its spellings (`docs/config.md#budget-spellings`); 0, negatives and counts beyond
/// `u32` cannot be represented, so they never reach the core.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BudgetValue {
    /// A token count, at least 1.
    Tokens(NonZeroU32),
    /// Chunking off for the walk (the config's null / `"off"`).
    Off,
}

impl BudgetValue {
    /// `Tokens(n)`, or `None` for 0 (which is not a budget).
    pub fn tokens(n: u32) -> Option<Self> {
        NonZeroU32::new(n).map(Self::Tokens)
    }

    /// The budget in tokens; `None` when off.
    pub fn get(self) -> Option<u32> {
        match self {
            Self::Tokens(t) => Some(t.get()),
            Self::Off => None,
        }
    }
}

/// What a refused budget value is told it should have been.
pub(crate) const BUDGET_VALUE_EXPECTED: &str =
    "a positive whole number of tokens (at most 4294967295) or \"off\"";

/// Why a count or a text is not a [`BudgetValue`]; quotes what was written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("expected {BUDGET_VALUE_EXPECTED}, got {written}")]
pub struct BudgetValueError {
    /// What was written: a count as a number, other text quoted and cut.
    pub written: String,
}

impl BudgetValue {
    /// The budget of `n` tokens, as written (any integer, so that a refusal quotes it).
    ///
    /// # Errors
    /// `n` is 0, negative or beyond `u32::MAX`.
    pub(crate) fn from_count(n: i128) -> Result<Self, BudgetValueError> {
        u32::try_from(n)
            .ok()
            .and_then(Self::tokens)
            .ok_or_else(|| BudgetValueError {
                written: n.to_string(),
            })
    }
}

/// The one text form of a budget, for the config's strings, `--budget` and the sweep's
/// `--budgets`: `off` (any case) or decimal digits with an optional sign, spaces around
/// ignored. `1.5`, `1e3`, `0x10`, `none` and `false` are refused rather than guessed at.
impl FromStr for BudgetValue {
    type Err = BudgetValueError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim();
        if t.eq_ignore_ascii_case("off") {
            return Ok(Self::Off);
        }
        // The length cap keeps i128 parsing exact.
        let digits = t.strip_prefix(['-', '+']).unwrap_or(t);
        if digits.is_empty() || digits.len() > 30 || !digits.bytes().all(|b| b.is_ascii_digit()) {
            // Quoted and cut, as the config quotes values: the text may be anything.
            let cut: String = s.chars().take(200).collect();
            let more = if cut.len() < s.len() { "…" } else { "" };
            return Err(BudgetValueError {
                written: format!("{cut:?}{more}"),
            });
        }
        Self::from_count(t.parse::<i128>().unwrap_or(i128::MAX))
    }
}

/// Serialised as its number of tokens, or the string `"off"`.
impl serde::Serialize for BudgetValue {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::Tokens(n) => s.serialize_u32(n.get()),
            Self::Off => s.serialize_str("off"),
        }
    }
}

impl From<NonZeroU32> for BudgetValue {
    /// A token count. There is deliberately no conversion from `Option<NonZeroU32>`: a failed
    /// `NonZeroU32::new(n)` must never mean "off" (write [`BudgetValue::Off`]).
    fn from(budget: NonZeroU32) -> Self {
        BudgetValue::Tokens(budget)
    }
}

impl fmt::Display for BudgetValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BudgetValue::Tokens(t) => write!(f, "{t}"),
            BudgetValue::Off => f.write_str("off"),
        }
    }
}

/// A node's setting: one value for every walk the model budgets there, or one per walk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeSetting<V> {
    /// One value for every walk the model budgets on the node.
    All(V),
    /// A value per walk.
    PerWalk(BTreeMap<Name, V>),
}

/// A node's token budget override (`chunking.max_batch_tokens.<node>`).
pub type NodeBudget = NodeSetting<BudgetValue>;

/// One time budget as a serving config writes it (`chunking.max_step_ms`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum TimeBudget {
    /// The most milliseconds a step may be predicted to take; refused unless finite and > 0.
    Ms(f64),
    /// No time budget for the walk.
    Off,
}

impl fmt::Display for TimeBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TimeBudget::Ms(ms) => write!(f, "{ms}"),
            TimeBudget::Off => f.write_str("off"),
        }
    }
}

impl From<f64> for TimeBudget {
    /// A budget in ms (checked when the settings are applied).
    fn from(ms: f64) -> Self {
        TimeBudget::Ms(ms)
    }
}

/// A node's time budgets (`chunking.max_step_ms.<node>`).
pub type NodeTimeBudget = NodeSetting<TimeBudget>;

/// Cost-aware chunking's settings (`docs/cost-model.md`): time budgets and where the latency
/// model comes from.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TimeSettings {
    /// Per node, one time budget or `walk -> ms` (`chunking.max_step_ms`).
    pub max_step_ms: BTreeMap<Name, NodeTimeBudget>,
    /// Per node, the latency model from config (`chunking.cost.<node>`).
    pub cost: BTreeMap<Name, LatencyModel>,
    /// Whether to fit each node's model online from the step times `complete_measured`
    /// reports, and plan with it once it is trusted (`chunking.learn_cost`).
    pub learn: bool,
    /// The time margin's quantile (`docs/cost-model.md#the-time-margin`): with measured step
    /// times, each node's timed steps are planned against their time budget divided by this
    /// quantile of its recent measured ÷ predicted ratios. `None`: planned against the budget.
    pub margin_quantile: Option<f64>,
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
    /// Time budgets and latency models.
    pub time: TimeSettings,
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
            time: TimeSettings::default(),
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

    /// Chunks nothing on `node` (sequence parallelism).
    pub fn no_chunking(mut self, node: &str) -> Self {
        self.no_chunking.insert(node.into());
        self
    }

    /// No overrides, the default floor; serves every walk the model names and combines none.
    pub fn defaults_for(model: &ModelPolicies) -> Self {
        Self {
            overrides: BTreeMap::new(),
            walks: model.walks(),
            combined_walk_of: BTreeMap::new(),
            override_mixed: BTreeSet::new(),
            no_chunking: BTreeSet::new(),
            min_chunk_tokens: DEFAULT_MIN_CHUNK_TOKENS,
            max_row_tokens: None,
            max_partial_prefills: None,
            time: TimeSettings::default(),
        }
    }
}

/// Why a setting was refused. Each names the node, the walk and the rule it breaks
/// (`docs/budgets.md#refusals`).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum BudgetError {
    /// `set_budgets` before `set_policies`.
    #[error("no model policies are bound yet: `set_budgets` runs after `set_policies`")]
    PoliciesNotSet,
    /// A node the model does not have (rule 1; rule 7 for `override_mixed`/`no_chunking`).
    #[error("`{setting}` names node `{node}`, which the model does not have")]
    UnknownNode {
        /// The setting that names it.
        setting: SettingKey,
        /// The node.
        node: Name,
    },
    /// A walk not in `walks` (rule 2).
    #[error("budget for `{node}`/`{walk}`: walk `{walk}` is not served by this deployment")]
    WalkNotServed {
        /// The per-node setting (`max_batch_tokens` or `max_step_ms`) that names the walk.
        setting: SettingKey,
        /// The node.
        node: Name,
        /// The walk.
        walk: Name,
    },
    /// `combined_walk_of` names a walk not in `walks` (rule 2).
    #[error("`combined_walk_of` names walk `{walk}`, which is not served by this deployment")]
    CombinedWalkNotServed {
        /// The walk.
        walk: Name,
    },
    /// A per-walk override of a walk the model does not budget on the node (rule 3).
    #[error("budget for `{node}`/`{walk}` would do nothing: the model does not budget `{walk}` on `{node}`")]
    WalkNotBudgeted {
        /// The node.
        node: Name,
        /// The walk.
        walk: Name,
    },
    /// A node-wide budget on a node that budgets no walk (rule 4).
    #[error("budget for `{node}` would do nothing: the model budgets no walk on `{node}`")]
    NodeBudgetsNothing {
        /// The per-node setting (`max_batch_tokens` or `max_step_ms`) set on the node.
        setting: SettingKey,
        /// The node.
        node: Name,
    },
    /// A member walk's budget on a node that cannot cap member walks (rule 5).
    #[error("budget for `{node}`/`{walk}` would do nothing: `{walk}` runs inside `{combined}` and `{node}` cannot cap member walks; set `{combined}` instead")]
    MemberWalk {
        /// The node.
        node: Name,
        /// The walk.
        walk: Name,
        /// The combined walk it runs inside.
        combined: Name,
    },
    /// `min_chunk_tokens`, `max_row_tokens` or `max_partial_prefills` of 0 (rule 6).
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
    /// would never run its rows, which would only run uncut in steps of their own (rule 11). The
    /// usual cause is a forgotten `combined_walk_of`.
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
    /// A walk in two combined walks (rule 7).
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

/// A setting of [`BudgetSettings`] a refusal is about; it displays as its key under a serving
/// config's `[chunking]` section, so a config loader names the key a refusal is about without
/// reading its message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SettingKey {
    /// [`BudgetSettings::overrides`]: `max_batch_tokens`, per node.
    MaxBatchTokens,
    /// [`TimeSettings::max_step_ms`]: `max_step_ms`, per node.
    MaxStepMs,
    /// [`TimeSettings::cost`]: `cost`, per node.
    Cost,
    /// [`BudgetSettings::no_chunking`]: a list of nodes.
    NoChunking,
    /// [`BudgetSettings::override_mixed`]: a list of nodes (the model's say).
    OverrideMixed,
    /// [`BudgetSettings::combined_walk_of`] (the model's say).
    CombinedWalkOf,
    /// [`BudgetSettings::min_chunk_tokens`].
    MinChunkTokens,
    /// [`BudgetSettings::max_row_tokens`].
    MaxRowTokens,
    /// [`BudgetSettings::max_partial_prefills`].
    MaxPartialPrefills,
    /// [`TimeSettings::margin_quantile`]: `time_margin`.
    TimeMargin,
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
            Self::TimeMargin => "time_margin",
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

/// The documented rule a refusal breaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rule {
    /// `docs/budgets.md#refusals`, with the rule's number where it has one.
    Budgets(Option<u8>),
    /// `docs/cost-model.md#time-budgets`.
    TimeBudgets,
    /// `docs/cost-model.md#the-time-margin`.
    TimeMargin,
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Budgets(Some(n)) => write!(f, "docs/budgets.md#refusals, rule {n}"),
            Self::Budgets(None) => f.write_str("docs/budgets.md#refusals"),
            Self::TimeBudgets => f.write_str("docs/cost-model.md#time-budgets"),
            Self::TimeMargin => f.write_str("docs/cost-model.md#the-time-margin"),
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
            Self::BadTimeBudget { node, walk, .. } => at(K::MaxStepMs, node, walk.as_ref()),
            Self::TimeBudgetDoesNothing { node, walk }
            | Self::TimeMemberWalk { node, walk, .. }
            | Self::TimeBudgetBelowBase { node, walk, .. } => at(K::MaxStepMs, node, Some(walk)),
            Self::NoLatencyModel { node } => at(K::MaxStepMs, node, None),
            Self::ZeroLatencyModel { node } => at(K::Cost, node, None),
            Self::BadTimeMargin { .. } | Self::TimeMarginWithoutBudget => whole(K::TimeMargin),
        }
    }

    /// The documented rule the refusal breaks.
    pub fn rule(&self) -> Rule {
        use SettingKey as K;
        let n = |n| Rule::Budgets(Some(n));
        match self {
            Self::UnknownNode {
                setting: K::MaxBatchTokens,
                ..
            } => n(1),
            Self::UnknownNode { .. } | Self::WalkInTwoCombined { .. } => n(7),
            Self::WalkNotServed { .. } | Self::CombinedWalkNotServed { .. } => n(2),
            Self::WalkNotBudgeted { .. } => n(3),
            Self::NodeBudgetsNothing { .. } => n(4),
            Self::MemberWalk { .. } => n(5),
            Self::ZeroSetting {
                setting: K::MinChunkTokens,
            } => n(6),
            Self::ZeroSetting { .. } => n(10),
            Self::BelowAlign { .. } => n(8),
            Self::RowCapBelowAlign { .. } => n(9),
            Self::WalkNeverChunked { .. } => n(11),
            Self::BadTimeBudget { .. }
            | Self::TimeBudgetDoesNothing { .. }
            | Self::TimeMemberWalk { .. }
            | Self::NoLatencyModel { .. }
            | Self::TimeBudgetBelowBase { .. }
            | Self::ZeroLatencyModel { .. } => Rule::TimeBudgets,
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
            Self::BadTimeMargin { value } => Some(value.to_string()),
            _ => None,
        }
    }
}

/// Every problem with a refused setting, in the order found.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{}", self.0.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
pub struct BudgetErrors(pub Vec<BudgetError>);

/// The accepted budgets: a pure function of the policies, the submodules and the last accepted
/// settings.
#[derive(Debug, Clone)]
pub struct BudgetTable {
    model: Arc<ModelPolicies>,
    settings: BudgetSettings,
    /// Effective per-walk overrides after expanding node-wide budgets: `None` = off.
    overrides: BTreeMap<(Name, Name), Option<u32>>,
    /// Time budgets per `(node, walk)` after expanding node-wide ones: `None` = off.
    step_ms: BTreeMap<(Name, Name), Option<f64>>,
    /// `combined walk -> member walks`, derived from `combined_walk_of`.
    members: BTreeMap<Name, Vec<Name>>,
}

impl BudgetTable {
    /// The table before any serving config: the model's budgets as declared.
    pub fn from_policies(model: Arc<ModelPolicies>) -> Self {
        let settings = BudgetSettings::defaults_for(&model);
        Self {
            model,
            settings,
            overrides: BTreeMap::new(),
            step_ms: BTreeMap::new(),
            members: BTreeMap::new(),
        }
    }

    /// Validates `settings` whole against the model and returns the table they give.
    ///
    /// # Errors
    /// Every refusal of docs/budgets.md#refusals found, each naming node, walk and reason. Nothing is applied.
    pub fn with_settings(&self, settings: BudgetSettings) -> Result<Self, BudgetErrors> {
        Self::build(self.model.clone(), settings)
    }

    /// Validates `settings` against `model`, as [`BudgetTable::with_settings`].
    ///
    /// # Errors
    /// Every refusal of docs/budgets.md#refusals found.
    pub fn build(
        model: Arc<ModelPolicies>,
        settings: BudgetSettings,
    ) -> Result<Self, BudgetErrors> {
        let mut errors = Vec::new();
        for (setting, value) in [
            (SettingKey::MinChunkTokens, Some(settings.min_chunk_tokens)),
            (SettingKey::MaxRowTokens, settings.max_row_tokens),
            (
                SettingKey::MaxPartialPrefills,
                settings.max_partial_prefills,
            ),
        ] {
            if value == Some(0) {
                errors.push(BudgetError::ZeroSetting { setting });
            }
        }
        for (setting, nodes) in [
            (SettingKey::OverrideMixed, &settings.override_mixed),
            (SettingKey::NoChunking, &settings.no_chunking),
        ] {
            for node in nodes.iter().filter(|n| !model.has_node(n)) {
                errors.push(BudgetError::UnknownNode {
                    setting,
                    node: node.clone(),
                });
            }
        }
        // combined_walk_of is a map, so a member cannot be listed twice there; a walk in two
        // combined walks shows up when a combined walk is itself a member of another.
        let mut members: BTreeMap<Name, Vec<Name>> = BTreeMap::new();
        for (member, combined) in &settings.combined_walk_of {
            for w in [member, combined] {
                if !settings.walks.contains(w) {
                    errors.push(BudgetError::CombinedWalkNotServed { walk: w.clone() });
                }
            }
            if let Some(outer) = settings.combined_walk_of.get(combined) {
                errors.push(BudgetError::WalkInTwoCombined {
                    walk: member.clone(),
                    first: combined.clone(),
                    second: outer.clone(),
                });
            }
            members
                .entry(combined.clone())
                .or_default()
                .push(member.clone());
        }
        let overrides = expand(
            &model,
            SettingKey::MaxBatchTokens,
            &settings.overrides,
            |_, _, value: BudgetValue, _| Some(value.get()),
            |node, walk, _| Self::walk_refusal(&model, &settings, node, walk),
            &mut errors,
        );
        for ((node, walk), budget) in &overrides {
            let align = model.policy(node, walk).align;
            if let Some(budget) = budget.filter(|b| *b < align) {
                errors.push(BudgetError::BelowAlign {
                    node: node.clone(),
                    walk: walk.clone(),
                    budget,
                    align,
                });
            }
        }
        Self::check_walks_chunked(&model, &settings, &members, &mut errors);
        let step_ms = Self::check_time_budgets(&model, &settings, &overrides, &mut errors);
        if let Some(max_row) = settings.max_row_tokens.filter(|m| *m > 0) {
            let widest = model
                .policies()
                .iter()
                .filter(|(_, p)| p.max_batch_tokens.is_some() && p.align > max_row)
                .max_by_key(|(_, p)| p.align);
            if let Some(((node, walk), p)) = widest {
                errors.push(BudgetError::RowCapBelowAlign {
                    max_row,
                    node: node.clone(),
                    walk: walk.clone(),
                    align: p.align,
                });
            }
        }
        if !errors.is_empty() {
            return Err(BudgetErrors(errors));
        }
        Ok(Self {
            model,
            settings,
            overrides,
            step_ms,
            members,
        })
    }

    /// Rule 11: a served walk a node's submodule can cut, with no budget there (overrides exist
    /// only where the model budgets, rule 3), that is neither a member of a combined walk nor
    /// one itself, is refused when the node has another served walk with a budget that is no
    /// member either: an engine assembling that walk (the `mixed` of `prefill` + `decode`) would
    /// wait forever while the row queues, and the row would run only uncut. A node the model
    /// budgets nothing on runs such rows uncut by the model's decision, as the original contract
    /// says; `no_chunking` nodes chunk nothing by the deployment's.
    fn check_walks_chunked(
        model: &ModelPolicies,
        settings: &BudgetSettings,
        members: &BTreeMap<Name, Vec<Name>>,
        errors: &mut Vec<BudgetError>,
    ) {
        let standalone = |w: &Name| {
            settings.walks.contains(w)
                && !settings.combined_walk_of.contains_key(w)
                && !members.contains_key(w)
        };
        for node in model.nodes() {
            if settings.no_chunking.contains(node) {
                continue;
            }
            let Some(caps) = model.submodule(node) else {
                continue;
            };
            for walk in caps.chunkable_walks.iter().filter(|w| standalone(w)) {
                if model.policy(node, walk).max_batch_tokens.is_some() {
                    continue;
                }
                let taker = model
                    .budgeted_walks(node)
                    .find(|w| *w != walk && standalone(w));
                if let Some(combined) = taker {
                    errors.push(BudgetError::WalkNeverChunked {
                        node: node.clone(),
                        walk: walk.clone(),
                        combined: combined.clone(),
                    });
                }
            }
        }
    }

    /// Validates `chunking.max_step_ms` and `chunking.cost` (`docs/cost-model.md#time-budgets`):
    /// the same refusals as token budgets where a value would do nothing, plus non-finite or
    /// non-positive values and a time budget without a latency model. Returns the accepted
    /// `(node, walk) -> ms` (`None`: off).
    fn check_time_budgets(
        model: &ModelPolicies,
        settings: &BudgetSettings,
        overrides: &BTreeMap<(Name, Name), Option<u32>>,
        errors: &mut Vec<BudgetError>,
    ) -> BTreeMap<(Name, Name), Option<f64>> {
        let time = &settings.time;
        for node in time.cost.keys().filter(|n| !model.has_node(n)) {
            errors.push(BudgetError::UnknownNode {
                setting: SettingKey::Cost,
                node: node.clone(),
            });
        }
        let token_budget =
            |node: &Name, walk: &Name| match overrides.get(&(node.clone(), walk.clone())) {
                Some(over) => *over,
                None => model.policy(node, walk).max_batch_tokens,
            };
        let check =
            |node: &Name, walk: Option<&Name>, value, errors: &mut Vec<BudgetError>| match value {
                TimeBudget::Off => Some(None),
                TimeBudget::Ms(value) => match check_max_step_ms(value) {
                    Ok(ms) => Some(Some(ms)),
                    Err(_) => {
                        errors.push(BudgetError::BadTimeBudget {
                            node: node.clone(),
                            walk: walk.cloned(),
                            value,
                        });
                        None
                    }
                },
            };
        let refusal = |node: &Name, walk: &Name, ms: Option<&Option<f64>>| {
            let (node, walk) = (node.clone(), walk.clone());
            if !settings.walks.contains(&walk) {
                return Some(BudgetError::WalkNotServed {
                    setting: SettingKey::MaxStepMs,
                    node,
                    walk,
                });
            }
            if let Some(combined) = settings.combined_walk_of.get(&walk) {
                let combined = combined.clone();
                return Some(BudgetError::TimeMemberWalk {
                    node,
                    walk,
                    combined,
                });
            }
            let on = ms.is_some_and(Option::is_some);
            (on && token_budget(&node, &walk).is_none())
                .then_some(BudgetError::TimeBudgetDoesNothing { node, walk })
        };
        let accepted = expand(
            model,
            SettingKey::MaxStepMs,
            &time.max_step_ms,
            check,
            refusal,
            errors,
        );
        let needs_model: BTreeSet<&Name> = accepted
            .iter()
            .filter(|(_, ms)| ms.is_some())
            .map(|((node, _), _)| node)
            .collect();
        for node in needs_model {
            if !time.learn && !time.cost.contains_key(node) {
                errors.push(BudgetError::NoLatencyModel { node: node.clone() });
            }
        }
        for (node, m) in &time.cost {
            if m.coefficients() == [0.0; 4] {
                errors.push(BudgetError::ZeroLatencyModel { node: node.clone() });
            }
        }
        if let Some(q) = time.margin_quantile {
            if !(q > 0.0 && q <= 1.0) {
                errors.push(BudgetError::BadTimeMargin { value: q });
            } else if !accepted.values().any(Option::is_some) {
                errors.push(BudgetError::TimeMarginWithoutBudget);
            }
        }
        // Against the configured model only: a learned one is not known at load (the replay
        // reports a time budget that was not in force, docs/replay.md).
        for ((node, walk), ms) in &accepted {
            let (Some(ms), Some(m)) = (ms, time.cost.get(node)) else {
                continue;
            };
            if *ms < m.base_ms() {
                errors.push(BudgetError::TimeBudgetBelowBase {
                    node: node.clone(),
                    walk: walk.clone(),
                    max_step_ms: *ms,
                    base_ms: m.base_ms(),
                });
            }
        }
        accepted
    }

    /// Why a per-walk override of `node`/`walk` is refused (rules 2, 5 and 3), if it is.
    fn walk_refusal(
        model: &ModelPolicies,
        settings: &BudgetSettings,
        node: &Name,
        walk: &Name,
    ) -> Option<BudgetError> {
        let (node, walk) = (node.clone(), walk.clone());
        if !settings.walks.contains(&walk) {
            return Some(BudgetError::WalkNotServed {
                setting: SettingKey::MaxBatchTokens,
                node,
                walk,
            });
        }
        if let Some(combined) = settings.combined_walk_of.get(&walk) {
            if !settings.override_mixed.contains(&node) {
                let combined = combined.clone();
                return Some(BudgetError::MemberWalk {
                    node,
                    walk,
                    combined,
                });
            }
        }
        if model.policy(&node, &walk).max_batch_tokens.is_none() {
            return Some(BudgetError::WalkNotBudgeted { node, walk });
        }
        None
    }

    /// The model's policies this table is layered on.
    pub fn model(&self) -> &Arc<ModelPolicies> {
        &self.model
    }

    /// The accepted settings.
    pub fn settings(&self) -> &BudgetSettings {
        &self.settings
    }

    /// The model's declared policy, or `NO_CHUNKING`.
    pub fn policy(&self, node: &str, walk: &str) -> ChunkingPolicy {
        self.model.policy(node, walk)
    }

    /// The budget a step of `node`/`walk` runs under: `None` on a `no_chunking` node; else the
    /// override for that walk (off gives `None`); else the policy's budget.
    pub fn max_batch_tokens(&self, node: &str, walk: &str) -> Option<u32> {
        if self.settings.no_chunking.contains(node) {
            return None;
        }
        match self.overrides.get(&(Name::from(node), Name::from(walk))) {
            Some(over) => *over,
            None => self.model.policy(node, walk).max_batch_tokens,
        }
    }

    /// The time budget a step of `node`/`walk` is planned under, in ms: `None` without one,
    /// on a `no_chunking` node, or where the step has no token budget (nothing is cut).
    pub fn max_step_ms(&self, node: &str, walk: &str) -> Option<f64> {
        self.max_batch_tokens(node, walk)?;
        self.step_ms
            .get(&(Name::from(node), Name::from(walk)))
            .copied()
            .flatten()
    }

    /// The latency model configured for `node` (`chunking.cost.<node>`), if any.
    pub fn cost(&self, node: &str) -> Option<LatencyModel> {
        self.settings.time.cost.get(node).copied()
    }

    /// Whether rows of `walk` can be cut on `node`: the submodule's say, unless the budget is
    /// off or none, or the node is `no_chunking`.
    pub fn chunkable(&self, node: &str, walk: &str) -> bool {
        self.max_batch_tokens(node, walk).is_some()
            && self
                .model
                .submodule(node)
                .is_some_and(|s| s.chunkable_walks.contains(walk))
    }

    /// The fewest tokens a row is cut to under `budget`: the floor, or the budget when smaller.
    pub fn min_chunk_tokens(&self, budget: u32) -> u32 {
        self.settings.min_chunk_tokens.min(budget)
    }

    /// The member walks of a combined walk (empty for a plain walk).
    pub fn members(&self, walk: &str) -> &[Name] {
        self.members
            .get(walk)
            .map(Vec::as_slice)
            .unwrap_or_default()
    }

    /// The combined walk `walk` runs inside, if any.
    pub fn combined_walk_of(&self, walk: &str) -> Option<&Name> {
        self.settings.combined_walk_of.get(walk)
    }

    /// Under a combined walk on an `override_mixed` node (not `no_chunking`, with a budget):
    /// member walk -> the most tokens its rows may run in one step, for each member walk with a
    /// budget of its own. `None` otherwise.
    pub fn walk_caps(&self, node: &str, walk: &str) -> Option<BTreeMap<Name, u32>> {
        let members = self.members.get(walk)?;
        if !self.settings.override_mixed.contains(node)
            || self.max_batch_tokens(node, walk).is_none()
        {
            return None;
        }
        Some(
            members
                .iter()
                .filter_map(|m| Some((m.clone(), self.max_batch_tokens(node, m)?)))
                .collect(),
        )
    }
}

/// Expands per-node settings into `(node, walk) -> accepted value`, the one walk for all of
/// `setting` (`max_batch_tokens`, `max_step_ms`): a node the model does not have is refused
/// (rule 1); a node-wide value goes to every walk the model budgets on the node (none there:
/// rule 4); a per-walk value goes to its walk unless `refusal` says why not. `accept` turns a
/// written value into the accepted one, or refuses it (`None`, having said why); `refusal` sees
/// the accepted value, if any.
fn expand<V: Copy, T: Copy>(
    model: &ModelPolicies,
    setting: SettingKey,
    nodes: &BTreeMap<Name, NodeSetting<V>>,
    accept: impl Fn(&Name, Option<&Name>, V, &mut Vec<BudgetError>) -> Option<T>,
    refusal: impl Fn(&Name, &Name, Option<&T>) -> Option<BudgetError>,
    errors: &mut Vec<BudgetError>,
) -> BTreeMap<(Name, Name), T> {
    let mut accepted = BTreeMap::new();
    for (node, values) in nodes {
        if !model.has_node(node) {
            errors.push(BudgetError::UnknownNode {
                setting,
                node: node.clone(),
            });
            continue;
        }
        match values {
            NodeSetting::All(value) => {
                let walks: Vec<Name> = model.budgeted_walks(node).cloned().collect();
                if walks.is_empty() {
                    errors.push(BudgetError::NodeBudgetsNothing {
                        setting,
                        node: node.clone(),
                    });
                }
                if let Some(v) = accept(node, None, *value, errors) {
                    for walk in walks {
                        accepted.insert((node.clone(), walk), v);
                    }
                }
            }
            NodeSetting::PerWalk(walks) => {
                for (walk, value) in walks {
                    let v = accept(node, Some(walk), *value, errors);
                    match (refusal(node, walk, v.as_ref()), v) {
                        (Some(e), _) => errors.push(e),
                        (None, Some(v)) => {
                            accepted.insert((node.clone(), walk.clone()), v);
                        }
                        (None, None) => {}
                    }
                }
            }
        }
    }
    accepted
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::SubmoduleCaps;

    fn n(s: &str) -> Name {
        Name::from(s)
    }

    /// The omni-demo model of `config/models/omni.toml`.
    fn omni() -> Arc<ModelPolicies> {
        let subs = BTreeMap::from([
            (n("thinker"), SubmoduleCaps::new(["prefill", "mixed"], true)),
            (n("vision"), SubmoduleCaps::new::<_, &str>([], false)),
            (n("talker"), SubmoduleCaps::new(["prefill"], false)),
            (n("llm"), SubmoduleCaps::new(["prefill", "mixed"], false)),
        ]);
        let pols = BTreeMap::from([
            (
                (n("thinker"), n("prefill")),
                ChunkingPolicy::budget(4096).aligned(16),
            ),
            (
                (n("thinker"), n("mixed")),
                ChunkingPolicy::budget(8192).aligned(16),
            ),
            ((n("thinker"), n("decode")), ChunkingPolicy::budget(256)),
            ((n("vision"), n("prefill")), ChunkingPolicy::budget(8192)),
            ((n("talker"), n("prefill")), ChunkingPolicy::budget(2048)),
            ((n("llm"), n("prefill")), ChunkingPolicy::budget(2048)),
            ((n("llm"), n("mixed")), ChunkingPolicy::budget(4096)),
        ]);
        ModelPolicies::new(subs, pols).unwrap().shared()
    }

    fn settings() -> BudgetSettings {
        BudgetSettings {
            overrides: BTreeMap::new(),
            walks: [n("prefill"), n("decode"), n("mixed")].into(),
            combined_walk_of: BTreeMap::from([
                (n("prefill"), n("mixed")),
                (n("decode"), n("mixed")),
            ]),
            override_mixed: [n("thinker")].into(),
            no_chunking: BTreeSet::new(),
            min_chunk_tokens: 64,
            max_row_tokens: None,
            max_partial_prefills: None,
            time: TimeSettings::default(),
        }
    }

    fn tok(n: u32) -> BudgetValue {
        BudgetValue::tokens(n).unwrap()
    }

    fn per_walk(node: &str, walks: &[(&str, BudgetValue)]) -> BTreeMap<Name, NodeBudget> {
        BTreeMap::from([(
            n(node),
            NodeBudget::PerWalk(walks.iter().map(|(w, v)| (n(w), *v)).collect()),
        )])
    }

    fn refused(s: BudgetSettings) -> Vec<BudgetError> {
        BudgetTable::from_policies(omni())
            .with_settings(s)
            .unwrap_err()
            .0
    }

    /// One node `llm` that cuts `prefill` and `mixed`, with a policy on `mixed` only (the
    /// README's model), and a node `enc` that cuts `prefill` with no policy at all.
    fn mixed_only() -> Arc<ModelPolicies> {
        let subs = BTreeMap::from([
            (n("llm"), SubmoduleCaps::new(["prefill", "mixed"], false)),
            (n("enc"), SubmoduleCaps::new(["prefill"], false)),
        ]);
        let pols = BTreeMap::from([((n("llm"), n("mixed")), ChunkingPolicy::budget(2048))]);
        ModelPolicies::new(subs, pols).unwrap().shared()
    }

    #[test]
    fn a_chunkable_walk_no_combined_walk_takes_is_refused_where_another_walk_runs_alone() {
        let walks = BudgetSettings::new(["prefill", "decode", "mixed"]);
        let errors = BudgetTable::build(mixed_only(), walks.clone())
            .unwrap_err()
            .0;
        // `enc` has no budget at all: its rows run uncut by the model's decision.
        assert_eq!(
            errors,
            vec![BudgetError::WalkNeverChunked {
                node: n("llm"),
                walk: n("prefill"),
                combined: n("mixed"),
            }]
        );
        assert_eq!(
            errors[0].to_string(),
            "walk `prefill` on `llm` runs inside no combined walk: `mixed` steps would never run \
             its rows, and `prefill` steps would run them uncut (the model gives `prefill` no \
             budget on `llm`); combine it (`combined_walk_of`: `prefill` -> `mixed`) or name \
             `llm` in `no_chunking`"
        );
        // Combined as a member, not served, on a no_chunking node, or with the budgeted walk
        // not served: accepted.
        let combined = walks.clone().combined("mixed", ["prefill", "decode"]);
        assert!(BudgetTable::build(mixed_only(), combined).is_ok());
        let unserved = BudgetSettings::new(["decode", "mixed"]);
        assert!(BudgetTable::build(mixed_only(), unserved).is_ok());
        let llm_off = walks.clone().no_chunking("llm");
        assert!(BudgetTable::build(mixed_only(), llm_off).is_ok());
        let no_mixed = BudgetSettings::new(["prefill", "decode"]);
        assert!(BudgetTable::build(mixed_only(), no_mixed).is_ok());
        // A walk that is itself combined runs its members in its own steps: no stall.
        let prefill_combines = walks.clone().combined("prefill", ["decode"]);
        assert!(BudgetTable::build(mixed_only(), prefill_combines).is_ok());
        // The budgeted walk as a member of another combined walk takes no rows of its own.
        let mixed_member = walks.combined("decode", ["mixed"]);
        assert!(BudgetTable::build(mixed_only(), mixed_member).is_ok());
    }

    #[test]
    fn policy_budgets_apply_without_overrides() {
        let t = BudgetTable::build(omni(), settings()).unwrap();
        assert_eq!(t.max_batch_tokens("thinker", "mixed"), Some(8192));
        assert_eq!(t.max_batch_tokens("thinker", "spec_verify"), None);
        assert!(t.chunkable("thinker", "prefill"));
        assert!(
            !t.chunkable("vision", "prefill"),
            "the submodule cuts nothing"
        );
        assert!(
            !t.chunkable("thinker", "decode"),
            "not a chunkable walk of the submodule"
        );
    }

    #[test]
    fn per_walk_override_and_off() {
        let mut s = settings();
        s.overrides = per_walk(
            "thinker",
            &[("mixed", tok(6144)), ("prefill", BudgetValue::Off)],
        );
        let t = BudgetTable::build(omni(), s).unwrap();
        assert_eq!(t.max_batch_tokens("thinker", "mixed"), Some(6144));
        assert_eq!(t.max_batch_tokens("thinker", "prefill"), None);
        assert!(!t.chunkable("thinker", "prefill"), "off turns chunking off");
        assert_eq!(
            t.walk_caps("thinker", "mixed"),
            Some(BTreeMap::from([(n("decode"), 256)]))
        );
    }

    #[test]
    fn node_wide_budget_covers_every_budgeted_walk() {
        let mut s = settings();
        s.overrides = BTreeMap::from([(n("llm"), NodeBudget::All(tok(1000)))]);
        let t = BudgetTable::build(omni(), s).unwrap();
        assert_eq!(t.max_batch_tokens("llm", "prefill"), Some(1000));
        assert_eq!(t.max_batch_tokens("llm", "mixed"), Some(1000));
        assert_eq!(
            t.max_batch_tokens("llm", "decode"),
            None,
            "not budgeted by the model"
        );
    }

    #[test]
    fn no_chunking_node_has_no_budget_but_its_budget_is_still_validated() {
        let mut s = settings();
        s.no_chunking = [n("talker")].into();
        s.overrides = BTreeMap::from([(n("talker"), NodeBudget::All(tok(512)))]);
        let t = BudgetTable::build(omni(), s.clone()).unwrap();
        assert_eq!(t.max_batch_tokens("talker", "prefill"), None);
        assert!(!t.chunkable("talker", "prefill"));
        s.overrides = BTreeMap::from([(n("ghost"), NodeBudget::All(tok(512)))]);
        assert!(matches!(refused(s)[..], [BudgetError::UnknownNode { .. }]));
    }

    #[test]
    fn min_chunk_tokens_is_capped_by_the_budget() {
        let t = BudgetTable::build(omni(), settings()).unwrap();
        assert_eq!(t.min_chunk_tokens(4096), 64);
        assert_eq!(t.min_chunk_tokens(16), 16);
    }

    #[test]
    fn walk_caps_only_under_a_combined_walk_on_an_override_node() {
        let t = BudgetTable::build(omni(), settings()).unwrap();
        let caps = t.walk_caps("thinker", "mixed").unwrap();
        assert_eq!(
            caps,
            BTreeMap::from([(n("decode"), 256), (n("prefill"), 4096)])
        );
        assert_eq!(
            t.walk_caps("thinker", "prefill"),
            None,
            "not a combined walk"
        );
        assert_eq!(
            t.walk_caps("llm", "mixed"),
            None,
            "llm cannot cap member walks"
        );
        let mut s = settings();
        s.no_chunking = [n("thinker")].into();
        let t = BudgetTable::build(omni(), s).unwrap();
        assert_eq!(t.walk_caps("thinker", "mixed"), None, "no_chunking node");
    }

    #[test]
    fn rule_1_unknown_node() {
        let mut s = settings();
        s.overrides = BTreeMap::from([(n("ghost"), NodeBudget::All(tok(5)))]);
        let e = refused(s);
        assert_eq!(
            e[0].to_string(),
            "`max_batch_tokens` names node `ghost`, which the model does not have"
        );
    }

    #[test]
    fn rule_2_walk_not_served() {
        let mut s = settings();
        s.overrides = per_walk("thinker", &[("spec_verify", tok(5))]);
        assert!(
            matches!(&refused(s)[..], [BudgetError::WalkNotServed { walk, .. }] if &**walk == "spec_verify")
        );
    }

    #[test]
    fn rule_3_walk_not_budgeted_by_the_model() {
        let mut s = settings();
        s.walks.insert(n("spec_verify"));
        s.overrides = per_walk("thinker", &[("spec_verify", tok(5))]);
        assert!(matches!(
            &refused(s)[..],
            [BudgetError::WalkNotBudgeted { .. }]
        ));
    }

    #[test]
    fn rule_4_node_wide_budget_on_a_node_that_budgets_nothing() {
        let subs = BTreeMap::from([(n("enc"), SubmoduleCaps::default())]);
        let model = ModelPolicies::new(subs, BTreeMap::new()).unwrap().shared();
        let mut s = BudgetSettings::defaults_for(&model);
        s.overrides = BTreeMap::from([(n("enc"), NodeBudget::All(tok(5)))]);
        let e = BudgetTable::build(model, s).unwrap_err().0;
        assert!(matches!(&e[..], [BudgetError::NodeBudgetsNothing { .. }]));
    }

    #[test]
    fn rule_5_member_walk_on_a_node_that_cannot_cap_suggests_the_combined_walk() {
        let mut s = settings();
        s.overrides = per_walk("llm", &[("prefill", tok(512))]);
        let e = refused(s);
        assert_eq!(
            e[0].to_string(),
            "budget for `llm`/`prefill` would do nothing: `prefill` runs inside `mixed` and `llm` cannot cap member walks; set `mixed` instead"
        );
        // The same override on the override_mixed node is a cap, and accepted.
        let mut s = settings();
        s.overrides = per_walk("thinker", &[("prefill", tok(512))]);
        assert!(BudgetTable::build(omni(), s).is_ok());
    }

    #[test]
    fn rule_6_bad_values() {
        assert_eq!(BudgetValue::tokens(0), None, "0 is not a budget");
        let mut s = settings();
        s.min_chunk_tokens = 0;
        assert_eq!(
            refused(s)[0].to_string(),
            "`min_chunk_tokens` must be at least 1, got 0"
        );
        let mut s = settings();
        s.overrides = per_walk("thinker", &[("mixed", tok(u32::MAX))]);
        assert!(
            BudgetTable::build(omni(), s).is_ok(),
            "u32::MAX is a valid budget"
        );
    }

    #[test]
    fn a_budget_below_the_align_is_refused() {
        let mut s = settings();
        s.overrides = per_walk("thinker", &[("mixed", tok(8))]);
        assert_eq!(
            refused(s)[0].to_string(),
            "budget for `thinker`/`mixed` is 8, below the policy's `align` of 16 tokens: no aligned chunk would fit"
        );
    }

    #[test]
    fn a_row_cap_below_an_align_is_refused() {
        let mut s = settings();
        s.max_row_tokens = Some(8);
        assert!(matches!(
            &refused(s)[..],
            [BudgetError::RowCapBelowAlign { align: 16, .. }]
        ));
    }

    #[test]
    fn rule_7_unknown_nodes_in_lists_and_walk_in_two_combined_walks() {
        let mut s = settings();
        s.override_mixed.insert(n("ghost"));
        s.no_chunking.insert(n("phantom"));
        s.walks.insert(n("super"));
        s.combined_walk_of.insert(n("mixed"), n("super"));
        let e = refused(s);
        assert_eq!(e.len(), 4, "{e:?}");
        assert!(e
            .iter()
            .any(|e| matches!(e, BudgetError::WalkInTwoCombined { .. })));
    }

    #[test]
    fn every_problem_is_reported_and_the_previous_table_stays() {
        let first = BudgetTable::build(omni(), settings()).unwrap();
        let mut s = settings();
        s.overrides = per_walk("thinker", &[("mixed", tok(100)), ("ghost_walk", tok(1))]);
        s.min_chunk_tokens = 0;
        let e = first.with_settings(s).unwrap_err();
        assert_eq!(e.0.len(), 2);
        assert_eq!(first.max_batch_tokens("thinker", "mixed"), Some(8192));
    }

    #[test]
    fn time_budgets_are_refused_where_they_would_do_nothing_and_applied_otherwise() {
        let model = LatencyModel::try_new(5.0, 0.05, 0.0, 0.0).unwrap();
        let time_walks = |walks: &[(&str, TimeBudget)]| {
            NodeSetting::PerWalk(walks.iter().map(|(w, v)| (n(w), *v)).collect())
        };
        let mut s = settings().cost("llm", model).cost("thinker", model);
        s.time.max_step_ms = BTreeMap::from([
            (n("llm"), time_walks(&[("mixed", TimeBudget::Ms(40.0))])),
            (n("thinker"), NodeSetting::All(TimeBudget::Ms(60.0))),
        ]);
        let t = BudgetTable::build(omni(), s.clone()).unwrap();
        assert_eq!(t.max_step_ms("llm", "mixed"), Some(40.0));
        assert_eq!(t.max_step_ms("llm", "prefill"), None);
        assert_eq!(t.max_step_ms("thinker", "decode"), Some(60.0));

        // A member walk, a walk without a token budget, an unknown node, a bad value and a node
        // without a model: every one refused, each naming its node.
        let mut bad = settings();
        bad.overrides = BTreeMap::from([(
            n("llm"),
            NodeSetting::PerWalk(BTreeMap::from([(n("mixed"), BudgetValue::Off)])),
        )]);
        bad.time.max_step_ms = BTreeMap::from([
            (
                n("llm"),
                time_walks(&[
                    ("decode", TimeBudget::Ms(40.0)),
                    ("mixed", TimeBudget::Ms(40.0)),
                ]),
            ),
            (
                n("thinker"),
                time_walks(&[("mixed", TimeBudget::Ms(f64::NAN))]),
            ),
            (n("ghost"), NodeSetting::All(TimeBudget::Ms(10.0))),
            (n("talker"), NodeSetting::All(TimeBudget::Ms(10.0))),
        ]);
        bad = bad.cost("llm", model);
        let errs = BudgetTable::build(omni(), bad).unwrap_err().0;
        let has = |f: &dyn Fn(&BudgetError) -> bool| errs.iter().any(f);
        assert!(
            has(&|e| matches!(e, BudgetError::TimeMemberWalk { walk, .. } if &**walk == "decode")),
            "{errs:?}"
        );
        assert!(
            has(
                &|e| matches!(e, BudgetError::TimeBudgetDoesNothing { walk, .. } if &**walk == "mixed")
            ),
            "{errs:?}"
        );
        assert!(
            has(
                &|e| matches!(e, BudgetError::BadTimeBudget { node, walk: Some(w), .. } if &**node == "thinker" && &**w == "mixed")
            ),
            "{errs:?}"
        );
        assert!(
            has(
                &|e| matches!(e, BudgetError::UnknownNode { setting: SettingKey::MaxStepMs, node } if &**node == "ghost")
            ),
            "{errs:?}"
        );
        assert!(
            has(&|e| matches!(e, BudgetError::NoLatencyModel { node } if &**node == "talker")),
            "{errs:?}"
        );
        assert_eq!(errs.len(), 5, "{errs:?}");
        // With learning on, a node without a model is accepted.
        let learn = s.max_step_ms("talker", 10.0).learn_cost(true);
        assert!(BudgetTable::build(omni(), learn).is_ok());
    }

    #[test]
    fn an_all_zero_model_and_a_time_budget_below_base_ms_are_refused_with_the_numbers() {
        let model = LatencyModel::try_new(5.0, 0.05, 0.0, 0.0).unwrap();
        let s = settings()
            .cost("llm", model)
            .cost("thinker", LatencyModel::ZERO)
            .max_step_ms("llm", 4.5);
        let errs = BudgetTable::build(omni(), s).unwrap_err().0;
        let text: Vec<String> = errs.iter().map(ToString::to_string).collect();
        assert!(
            errs.iter().any(
                |e| matches!(e, BudgetError::ZeroLatencyModel { node } if &**node == "thinker")
            ),
            "{text:?}"
        );
        assert!(
            text.iter()
                .any(|t| t.contains("4.5 ms is below the latency model's `base_ms` of 5 ms")),
            "{text:?}"
        );
        assert!(
            errs.iter().all(|e| matches!(
                e,
                BudgetError::ZeroLatencyModel { .. } | BudgetError::TimeBudgetBelowBase { .. }
            )),
            "{text:?}"
        );
        // At `base_ms` exactly, a step of nothing else fits: accepted.
        let at_base = settings().cost("llm", model).max_step_ms("llm", 5.0);
        assert!(BudgetTable::build(omni(), at_base).is_ok());
    }

    #[test]
    fn budget_values_and_time_budgets_print_as_a_config_writes_them() {
        assert_eq!(tok(2048).to_string(), "2048");
        assert_eq!(BudgetValue::Off.to_string(), "off");
        assert_eq!(TimeBudget::Ms(42.5).to_string(), "42.5");
        assert_eq!(TimeBudget::Off.to_string(), "off");
        assert_eq!(tok(3).get(), Some(3));
        assert_eq!(BudgetValue::Off.get(), None);
        assert_eq!(BudgetValue::from(NonZeroU32::new(3).unwrap()), tok(3));
        assert_eq!(TimeBudget::from(7.5), TimeBudget::Ms(7.5));
    }

    #[test]
    fn the_builder_sets_each_field() {
        let model = LatencyModel::try_new(5.0, 0.05, 0.0, 0.0).unwrap();
        let one = NonZeroU32::MIN;
        let s = BudgetSettings::new(["prefill"])
            .combined("mixed", ["decode"])
            .budget("llm", tok(7))
            // A per-walk budget replaces a node-wide one; a second one keeps the first.
            .walk_budget("llm", "mixed", tok(100))
            .walk_budget("thinker", "mixed", tok(100))
            .walk_budget("thinker", "prefill", BudgetValue::Off)
            .min_chunk_tokens(NonZeroU32::new(32).unwrap())
            .max_row_tokens(NonZeroU32::new(512).unwrap())
            .max_partial_prefills(one)
            .override_mixed("thinker")
            .no_chunking("vision")
            .max_step_ms("llm", 50.0)
            .cost("llm", model)
            .learn_cost(true);
        assert_eq!(
            s.walks,
            BTreeSet::from([n("decode"), n("mixed"), n("prefill")])
        );
        assert_eq!(
            s.combined_walk_of,
            BTreeMap::from([(n("decode"), n("mixed"))])
        );
        assert_eq!(
            s.overrides["llm"],
            NodeBudget::PerWalk(BTreeMap::from([(n("mixed"), tok(100))]))
        );
        assert_eq!(
            s.overrides["thinker"],
            NodeBudget::PerWalk(BTreeMap::from([
                (n("mixed"), tok(100)),
                (n("prefill"), BudgetValue::Off)
            ]))
        );
        assert_eq!(s.min_chunk_tokens, 32);
        assert_eq!(s.max_row_tokens, Some(512));
        assert_eq!(s.max_partial_prefills, Some(1));
        assert_eq!(s.override_mixed, BTreeSet::from([n("thinker")]));
        assert_eq!(s.no_chunking, BTreeSet::from([n("vision")]));
        assert_eq!(
            s.time.max_step_ms["llm"],
            NodeTimeBudget::All(TimeBudget::Ms(50.0))
        );
        assert_eq!(s.time.cost["llm"], model);
        assert!(s.time.learn);
        let defaults = BudgetSettings::defaults_for(&omni());
        assert_eq!(
            defaults,
            BudgetSettings::new(["decode", "mixed", "prefill"])
        );
    }

    #[test]
    fn the_table_answers_what_it_was_built_from() {
        let model = LatencyModel::try_new(5.0, 0.05, 0.0, 0.0).unwrap();
        let s = settings().cost("llm", model);
        let t = BudgetTable::build(omni(), s.clone()).unwrap();
        assert_eq!(t.model(), &omni());
        assert_eq!(t.settings(), &s);
        assert_eq!(
            t.policy("thinker", "mixed"),
            ChunkingPolicy::budget(8192).aligned(16)
        );
        assert_eq!(
            t.policy("thinker", "spec_verify"),
            crate::policy::NO_CHUNKING
        );
        assert_eq!(t.cost("llm"), Some(model));
        assert_eq!(t.cost("thinker"), None);
        assert_eq!(t.members("mixed"), [n("decode"), n("prefill")]);
        assert!(t.members("prefill").is_empty());
        assert_eq!(t.combined_walk_of("prefill"), Some(&n("mixed")));
        assert_eq!(t.combined_walk_of("mixed"), None);
        // Before any setting, the table is the model's.
        let bare = BudgetTable::from_policies(omni());
        assert_eq!(bare.settings(), &BudgetSettings::defaults_for(&omni()));
        assert_eq!(bare.max_batch_tokens("llm", "prefill"), Some(2048));
    }

    #[test]
    fn a_budget_equal_to_the_align_is_accepted() {
        let mut s = settings();
        s.overrides = per_walk("thinker", &[("mixed", tok(16))]);
        let t = BudgetTable::build(omni(), s).unwrap();
        assert_eq!(t.max_batch_tokens("thinker", "mixed"), Some(16));
        let mut s = settings();
        s.overrides = per_walk("thinker", &[("mixed", tok(15))]);
        assert!(matches!(
            &refused(s)[..],
            [BudgetError::BelowAlign {
                budget: 15,
                align: 16,
                ..
            }]
        ));
    }

    #[test]
    fn a_row_cap_equal_to_the_widest_align_is_accepted_and_zero_is_refused_once() {
        let mut s = settings();
        s.max_row_tokens = Some(16);
        assert!(BudgetTable::build(omni(), s).is_ok());
        let mut s = settings();
        s.max_row_tokens = Some(15);
        assert_eq!(
            refused(s)[0].to_string(),
            "`max_row_tokens` 15 is below the `align` of 16 tokens of `thinker`/`prefill`: rows \
             there could never be cut"
        );
        // 0 is refused as 0, not also as below every align.
        let mut s = settings();
        s.max_row_tokens = Some(0);
        s.max_partial_prefills = Some(0);
        assert_eq!(
            refused(s),
            vec![
                BudgetError::ZeroSetting {
                    setting: SettingKey::MaxRowTokens
                },
                BudgetError::ZeroSetting {
                    setting: SettingKey::MaxPartialPrefills
                },
            ]
        );
    }

    #[test]
    fn a_time_margin_is_a_quantile_in_zero_one_and_needs_a_time_budget() {
        let model = LatencyModel::try_new(5.0, 0.05, 0.0, 0.0).unwrap();
        let timed = || settings().cost("llm", model).max_step_ms("llm", 50.0);
        for bad in [
            0.0,
            -0.0,
            -0.5,
            1.0 + f64::EPSILON,
            2.0,
            f64::INFINITY,
            f64::NAN,
        ] {
            let errs = refused(timed().time_margin(bad));
            assert!(
                matches!(errs[..], [BudgetError::BadTimeMargin { value }] if value.to_bits() == bad.to_bits()),
                "{bad}: {errs:?}"
            );
            assert!(
                errs[0]
                    .to_string()
                    .starts_with("time margin quantile must be a number in (0, 1], got "),
                "{}",
                errs[0]
            );
        }
        for good in [f64::MIN_POSITIVE, 0.5, 0.95, 1.0] {
            let table = BudgetTable::from_policies(omni())
                .with_settings(timed().time_margin(good))
                .unwrap();
            assert_eq!(table.settings().time.margin_quantile, Some(good));
        }
        // Without a time budget on any node (none, or every one off), a margin does nothing.
        assert_eq!(
            refused(settings().time_margin(0.9)),
            vec![BudgetError::TimeMarginWithoutBudget]
        );
        let off = settings()
            .cost("llm", model)
            .max_step_ms("llm", TimeBudget::Off)
            .time_margin(0.9);
        assert_eq!(refused(off), vec![BudgetError::TimeMarginWithoutBudget]);
        // A bad quantile is refused as bad, not also as doing nothing.
        assert_eq!(
            refused(settings().time_margin(2.0)),
            vec![BudgetError::BadTimeMargin { value: 2.0 }]
        );
    }

    #[test]
    fn a_time_budget_must_be_finite_and_above_zero() {
        let model = LatencyModel::try_new(5.0, 0.05, 0.0, 0.0).unwrap();
        for bad in [0.0, -0.0, -1.0, f64::INFINITY, f64::NEG_INFINITY, f64::NAN] {
            let s = settings().cost("llm", model).max_step_ms("llm", bad);
            let errs = refused(s);
            assert!(
                matches!(&errs[..], [BudgetError::BadTimeBudget { node, walk: None, .. }] if &**node == "llm"),
                "{bad}: {errs:?}"
            );
            assert!(
                errs[0].to_string().starts_with(
                    "time budget for `llm` must be a finite number of milliseconds above 0, got "
                ),
                "{}",
                errs[0]
            );
        }
        // The smallest positive time is a time budget (with a learned model, no `base_ms` is
        // known to be over it).
        let tiny = settings()
            .learn_cost(true)
            .max_step_ms("llm", f64::MIN_POSITIVE);
        let t = BudgetTable::build(omni(), tiny).unwrap();
        assert_eq!(t.max_step_ms("llm", "mixed"), Some(f64::MIN_POSITIVE));
        // Off needs no model.
        let off = settings().max_step_ms("llm", TimeBudget::Off);
        let t = BudgetTable::build(omni(), off).unwrap();
        assert_eq!(t.max_step_ms("llm", "mixed"), None);
    }

    #[test]
    fn a_walk_is_refused_only_where_a_served_standalone_walk_could_take_it() {
        // `mixed` has the budget on `llm` but is not served: nothing waits on it.
        assert!(BudgetTable::build(mixed_only(), BudgetSettings::new(["prefill"])).is_ok());
        // `mixed` is served but a member of another combined walk: its steps are not assembled.
        let member = BudgetSettings::new(["prefill", "decode"]).combined("decode", ["mixed"]);
        assert!(BudgetTable::build(mixed_only(), member).is_ok());
        // Served and standalone: refused, naming it.
        let standalone = BudgetSettings::new(["prefill", "mixed"]);
        assert_eq!(
            BudgetTable::build(mixed_only(), standalone).unwrap_err().0,
            vec![BudgetError::WalkNeverChunked {
                node: n("llm"),
                walk: n("prefill"),
                combined: n("mixed"),
            }]
        );
    }
}
