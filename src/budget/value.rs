//! Budget values as a deployment writes them: a token budget or off ([`BudgetValue`], with the
//! one text form the config, `--budget` and the sweep grid parse), a time budget
//! ([`TimeBudget`]), and a node's setting of either ([`NodeSetting`]).

use std::fmt;
use std::num::NonZeroU32;
use std::str::FromStr;

use crate::policy::Name;
use std::collections::BTreeMap;

/// `min_chunk_tokens` when the serving config sets none.
pub const DEFAULT_MIN_CHUNK_TOKENS: u32 = 64;

/// One budget as a serving config sets it: a positive token count or off. The config module
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
