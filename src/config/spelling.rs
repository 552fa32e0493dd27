//! Strict spellings of the `[chunking]` per-node settings (`docs/config.md#budget-spellings`,
//! `docs/cost-model.md#time-budgets`), one deserializer for all of them: a value is a number,
//! such a number as a string (as environment variables arrive), or `"off"` / null; a node takes
//! one value for every walk or a table `walk -> value`. What each value accepts is its
//! [`Spelling`]: a token budget ([`BudgetSetting`]) or a time budget ([`TimeSetting`]).
//!
//! Deliberately not serde's integer or float paths: config layers coerce `false`, `"off"` and
//! `"no"` into 0 for integer targets, which would turn a typo into a different budget; and not
//! `#[serde(untagged)]`, whose "did not match any variant" would hide what was wrong.

use std::collections::BTreeMap;
use std::fmt;
use std::marker::PhantomData;

use serde::de::{self, Deserializer, Expected, Visitor};
use serde::Deserialize;

use crate::budget::{BudgetValue, Refusal, Rule, TimeBudget};
use crate::latency::check_max_step_ms;
use crate::order::Order;

/// What a value of one setting accepts, beyond `"off"` and null.
pub trait Spelling: Sized + fmt::Display {
    /// What a refused spelling is told it should have been.
    const EXPECTED: &'static str;
    /// The value `"off"` and null stand for.
    const OFF: Self;
    /// An integer as written (wide, so that a refusal quotes it exactly).
    ///
    /// # Errors
    /// The integer is not such a value.
    fn from_int<E: de::Error>(n: i128) -> Result<Self, E>;
    /// A floating-point number as written; `expected` describes the whole setting.
    ///
    /// # Errors
    /// The number is not such a value.
    fn from_float<E: de::Error>(v: f64, expected: &dyn Expected) -> Result<Self, E>;
    /// A string other than `"off"`, as written.
    ///
    /// # Errors
    /// The string is not such a value.
    fn from_text<E: de::Error>(raw: &str) -> Result<Self, E>;
}

/// Accepts exactly the spellings of one `T`.
struct ValueVisitor<T>(PhantomData<T>);

impl<'de, T: Spelling> Visitor<'de> for ValueVisitor<T> {
    type Value = T;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(T::EXPECTED)
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<T, E> {
        T::from_int(i128::from(v))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<T, E> {
        T::from_int(i128::from(v))
    }

    fn visit_i128<E: de::Error>(self, v: i128) -> Result<T, E> {
        T::from_int(v)
    }

    fn visit_u128<E: de::Error>(self, v: u128) -> Result<T, E> {
        T::from_int(i128::try_from(v).unwrap_or(i128::MAX))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<T, E> {
        T::from_float(v, &self)
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<T, E> {
        Err(E::invalid_type(de::Unexpected::Bool(v), &self))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<T, E> {
        if v.trim().eq_ignore_ascii_case("off") {
            return Ok(T::OFF);
        }
        T::from_text(v)
    }

    fn visit_unit<E: de::Error>(self) -> Result<T, E> {
        Ok(T::OFF)
    }

    fn visit_none<E: de::Error>(self) -> Result<T, E> {
        Ok(T::OFF)
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<T, D::Error> {
        d.deserialize_any(self)
    }
}

/// A node's setting as written: one value for every walk the model budgets there, or one per
/// walk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PerNode<T> {
    /// One value for every walk the model budgets on the node.
    All(T),
    /// `walk -> value`.
    PerWalk(BTreeMap<String, T>),
}

impl<T: Spelling> PerNode<T> {
    /// The value set for `walk` (`None`: the node-wide one) as written, for messages.
    pub fn shown(&self, walk: Option<&str>) -> Option<String> {
        match (self, walk) {
            (Self::All(v), _) => Some(v.to_string()),
            (Self::PerWalk(m), Some(w)) => m.get(w).map(ToString::to_string),
            (Self::PerWalk(_), None) => None,
        }
    }
}

/// A scalar is one value for the node, a table is per walk.
impl<'de, T: Spelling + Deserialize<'de>> Deserialize<'de> for PerNode<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct NodeVisitor<T>(PhantomData<T>);
        impl<'de, T: Spelling + Deserialize<'de>> Visitor<'de> for NodeVisitor<T> {
            type Value = PerNode<T>;

            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                write!(f, "{}, or a table walk -> value", T::EXPECTED)
            }

            fn visit_map<A: de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut walks = BTreeMap::new();
                while let Some((walk, value)) = map.next_entry::<String, T>()? {
                    walks.insert(walk, value);
                }
                Ok(PerNode::PerWalk(walks))
            }

            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
                T::from_int(i128::from(v)).map(PerNode::All)
            }

            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
                T::from_int(i128::from(v)).map(PerNode::All)
            }

            fn visit_i128<E: de::Error>(self, v: i128) -> Result<Self::Value, E> {
                T::from_int(v).map(PerNode::All)
            }

            fn visit_u128<E: de::Error>(self, v: u128) -> Result<Self::Value, E> {
                T::from_int(i128::try_from(v).unwrap_or(i128::MAX)).map(PerNode::All)
            }

            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Self::Value, E> {
                T::from_float(v, &self).map(PerNode::All)
            }

            fn visit_bool<E: de::Error>(self, v: bool) -> Result<Self::Value, E> {
                Err(E::invalid_type(de::Unexpected::Bool(v), &self))
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                ValueVisitor::<T>(PhantomData)
                    .visit_str(v)
                    .map(PerNode::All)
            }

            fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(PerNode::All(T::OFF))
            }

            fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
                self.visit_unit()
            }

            fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
                d.deserialize_any(self)
            }
        }
        d.deserialize_any(NodeVisitor(PhantomData))
    }
}

// === token budgets ===

/// The rule a refused token budget spelling breaks.
const BUDGET_RULE: Rule = Rule::Budgets(Some(Refusal::NotPositive));

/// One token budget as written in a config layer (`chunking.max_batch_tokens`): a positive
/// whole number of tokens up to `u32::MAX`, as a number or a string of decimal digits, or
/// `"off"` / null; `false`, `"none"`, fractions, other notations, 0, negatives and counts beyond
/// `u32` are refused here, so no raw integer reaches the core. The text rules are
/// [`BudgetValue`]'s own `FromStr`, which `--budget` and the sweep grid use too.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BudgetSetting(pub BudgetValue);

/// A node's token budget setting (`chunking.max_batch_tokens.<node>`).
pub type NodeBudgetSetting = PerNode<BudgetSetting>;

impl fmt::Display for BudgetSetting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl Spelling for BudgetSetting {
    const EXPECTED: &'static str = crate::budget::BUDGET_VALUE_EXPECTED;
    const OFF: Self = BudgetSetting(BudgetValue::Off);

    fn from_int<E: de::Error>(n: i128) -> Result<Self, E> {
        BudgetValue::from_count(n)
            .map(BudgetSetting)
            .map_err(|e| E::custom(format!("{e} ({BUDGET_RULE})")))
    }

    fn from_float<E: de::Error>(v: f64, expected: &dyn Expected) -> Result<Self, E> {
        // 2048.0 is refused as well: a budget is written as a whole number.
        Err(E::invalid_type(de::Unexpected::Float(v), expected))
    }

    fn from_text<E: de::Error>(raw: &str) -> Result<Self, E> {
        raw.parse::<BudgetValue>()
            .map(BudgetSetting)
            .map_err(|e| E::custom(format!("{e} ({BUDGET_RULE})")))
    }
}

impl<'de> Deserialize<'de> for BudgetSetting {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ValueVisitor(PhantomData))
    }
}

// === time budgets ===

/// One time budget as written in a config layer (`chunking.max_step_ms`): a finite number of
/// milliseconds above 0 ([`check_max_step_ms`], the one statement of that rule), as a number or
/// a string in plain decimal notation, or `"off"` / null.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TimeSetting(pub TimeBudget);

/// A node's time budget setting (`chunking.max_step_ms.<node>`).
pub type NodeTimeSetting = PerNode<TimeSetting>;

impl fmt::Display for TimeSetting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl TimeSetting {
    fn ms<E: de::Error>(v: f64) -> Result<Self, E> {
        check_max_step_ms(v)
            .map(|ms| TimeSetting(TimeBudget::Ms(ms)))
            .map_err(|_| E::custom(format!("expected {}, got {v}", Self::EXPECTED)))
    }
}

impl Spelling for TimeSetting {
    const EXPECTED: &'static str = "a finite number of milliseconds above 0, or \"off\"";
    const OFF: Self = TimeSetting(TimeBudget::Off);

    fn from_int<E: de::Error>(n: i128) -> Result<Self, E> {
        Self::ms(n as f64)
    }

    fn from_float<E: de::Error>(v: f64, _: &dyn Expected) -> Result<Self, E> {
        Self::ms(v)
    }

    fn from_text<E: de::Error>(raw: &str) -> Result<Self, E> {
        let t = raw.trim();
        // Plain decimal notation only ("45", "45.5"): no "inf", "nan", hex or exponents.
        let plain = !t.is_empty()
            && t.len() <= 32
            && t.bytes().all(|b| b.is_ascii_digit() || b == b'.')
            && t.bytes().filter(|&b| b == b'.').count() <= 1;
        match t.parse::<f64>() {
            Ok(v) if plain => Self::ms(v),
            _ => Err(E::custom(format!(
                "expected {}, got {}",
                Self::EXPECTED,
                super::problem::quote(raw)
            ))),
        }
    }
}

impl<'de> Deserialize<'de> for TimeSetting {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ValueVisitor(PhantomData))
    }
}

// === orders ===

/// The rule a refused order breaks.
const ORDER_RULE: &str = "docs/scheduling.md#the-order-of-waiting-prompts";

/// `chunking.order` as written: one order for every node (`"shortest_first"`), or a table
/// `node -> order` (`{ llm = "priority" }`); nodes not in the table keep `fcfs`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OrderSetting {
    /// One order for every node.
    All(Order),
    /// `node -> order`.
    PerNode(BTreeMap<String, Order>),
}

impl Default for OrderSetting {
    fn default() -> Self {
        Self::All(Order::Fcfs)
    }
}

impl OrderSetting {
    /// The order written for `node`, for messages.
    pub fn shown(&self, node: &str) -> Option<String> {
        match self {
            Self::All(o) => Some(o.to_string()),
            Self::PerNode(m) => m.get(node).map(ToString::to_string),
        }
    }
}

/// One order's name.
struct OrderName(Order);

impl<'de> Deserialize<'de> for OrderName {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let raw = String::deserialize(d)?;
        raw.parse::<Order>()
            .map(OrderName)
            .map_err(|e| de::Error::custom(format!("{e} ({ORDER_RULE})")))
    }
}

impl<'de> Deserialize<'de> for OrderSetting {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct OrderVisitor;
        impl<'de> Visitor<'de> for OrderVisitor {
            type Value = OrderSetting;

            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an order (fcfs, priority, shortest_first, longest_prefix), or a table node -> order")
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                v.parse::<Order>()
                    .map(OrderSetting::All)
                    .map_err(|e| E::custom(format!("{e} ({ORDER_RULE})")))
            }

            fn visit_map<A: de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut nodes = BTreeMap::new();
                while let Some((node, OrderName(order))) = map.next_entry::<String, OrderName>()? {
                    nodes.insert(node, order);
                }
                Ok(OrderSetting::PerNode(nodes))
            }
        }
        d.deserialize_any(OrderVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn an_order_is_one_name_for_every_node_or_a_table_per_node() {
        let parse = |v| serde_json::from_value::<OrderSetting>(v).map_err(|e| e.to_string());
        assert_eq!(
            parse(json!("shortest_first")),
            Ok(OrderSetting::All(Order::ShortestFirst))
        );
        assert_eq!(
            parse(json!({"llm": "priority"})),
            Ok(OrderSetting::PerNode(BTreeMap::from([(
                "llm".to_string(),
                Order::Priority
            )])))
        );
        let e = parse(json!("lpm")).unwrap_err();
        assert!(e.starts_with("unknown order \"lpm\""), "{e}");
        assert!(e.contains(ORDER_RULE), "{e}");
        assert!(parse(json!({"llm": "sjf"}))
            .unwrap_err()
            .contains("unknown order \"sjf\""));
        assert!(parse(json!(3)).is_err());
        assert_eq!(
            OrderSetting::default().shown("any").as_deref(),
            Some("fcfs")
        );
    }

    fn parse(v: serde_json::Value) -> Result<BudgetValue, String> {
        serde_json::from_value::<BudgetSetting>(v)
            .map(|b| b.0)
            .map_err(|e| e.to_string())
    }

    fn tok(n: u32) -> BudgetValue {
        BudgetValue::tokens(n).unwrap()
    }

    #[test]
    fn the_spellings_of_a_budget() {
        assert_eq!(parse(json!(4096)).unwrap(), tok(4096));
        assert_eq!(parse(json!(" 4096 ")).unwrap(), tok(4096));
        assert_eq!(parse(json!(u32::MAX)).unwrap(), tok(u32::MAX));
        assert_eq!(parse(json!("OFF")).unwrap(), BudgetValue::Off);
        assert_eq!(parse(json!(null)).unwrap(), BudgetValue::Off);
    }

    #[test]
    fn zero_negatives_and_counts_beyond_u32_are_refused_at_the_boundary() {
        for (bad, shown) in [
            (json!(0), "0"),
            (json!(-1), "-1"),
            (json!("-1"), "-1"),
            (json!(u64::from(u32::MAX) + 1), "4294967296"),
            (json!("99999999999999999999"), "99999999999999999999"),
        ] {
            let e = parse(bad.clone()).unwrap_err();
            assert_eq!(
                e,
                format!("expected a positive whole number of tokens (at most 4294967295) or \"off\", got {shown} (docs/budgets.md#not-a-positive-whole-number)"),
                "{bad}"
            );
        }
    }

    #[test]
    fn false_none_fractions_and_other_notations_are_refused() {
        for bad in [
            json!(false),
            json!("false"),
            json!("none"),
            json!("no"),
            json!(1.5),
            json!(2048.0),
            json!("1.5"),
            json!("1e3"),
            json!("0x10"),
            json!("0o10"),
            json!("1_000"),
            json!(""),
            json!([1]),
            json!("9".repeat(40)),
        ] {
            assert!(parse(bad.clone()).is_err(), "{bad} was accepted");
        }
    }

    #[test]
    fn a_node_takes_one_budget_or_a_table_of_walks() {
        let node = |v: serde_json::Value| serde_json::from_value::<NodeBudgetSetting>(v);
        assert_eq!(
            node(json!({"mixed": "off", "prefill": 8})).unwrap(),
            NodeBudgetSetting::PerWalk(BTreeMap::from([
                ("mixed".into(), BudgetSetting(BudgetValue::Off)),
                ("prefill".into(), BudgetSetting(tok(8))),
            ]))
        );
        assert_eq!(
            node(json!("512")).unwrap(),
            NodeBudgetSetting::All(BudgetSetting(tok(512)))
        );
        let e = node(json!({"mixed": false})).unwrap_err().to_string();
        assert!(e.contains("invalid type: boolean `false`"), "{e}");
        let e = node(json!(0)).unwrap_err().to_string();
        assert!(
            e.ends_with("got 0 (docs/budgets.md#not-a-positive-whole-number)"),
            "{e}"
        );
    }

    #[test]
    fn the_spellings_of_a_time_budget() {
        let parse = |v| serde_json::from_value::<TimeSetting>(v).map(|t| t.0);
        assert_eq!(parse(json!(45)).unwrap(), TimeBudget::Ms(45.0));
        assert_eq!(parse(json!(45.5)).unwrap(), TimeBudget::Ms(45.5));
        assert_eq!(parse(json!(" 45.5 ")).unwrap(), TimeBudget::Ms(45.5));
        assert_eq!(parse(json!("off")).unwrap(), TimeBudget::Off);
        assert_eq!(parse(json!(null)).unwrap(), TimeBudget::Off);
        for bad in [
            json!(0),
            json!(-1.0),
            json!(false),
            json!("inf"),
            json!("nan"),
            json!("1e3"),
            json!("0x10"),
            json!(""),
            json!([1]),
        ] {
            assert!(parse(bad.clone()).is_err(), "{bad} was accepted");
        }
        let e = parse(json!(f64::MAX)).map(|_| ()).err();
        assert!(e.is_none(), "a finite value is a value");
    }

    #[test]
    fn a_node_takes_one_time_budget_or_a_table_of_walks() {
        let node = |v| serde_json::from_value::<NodeTimeSetting>(v);
        assert_eq!(
            node(json!({"mixed": 45, "prefill": "off"})).unwrap(),
            NodeTimeSetting::PerWalk(BTreeMap::from([
                ("mixed".into(), TimeSetting(TimeBudget::Ms(45.0))),
                ("prefill".into(), TimeSetting(TimeBudget::Off)),
            ]))
        );
        assert!(node(json!({"mixed": 0})).is_err());
    }
}
