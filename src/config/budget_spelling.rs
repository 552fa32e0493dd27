//! Budget spellings, parsed strictly at the config boundary into a typed [`BudgetValue`]
//! (`docs/config.md#budget-spellings`): a positive whole number of tokens up to `u32::MAX`
//! (or such a number as a string of decimal digits, as environment variables arrive), or
//! `"off"` / null. `false`, `"none"`, fractions, other notations, 0, negatives and counts
//! beyond `u32` are refused here, so no raw integer reaches the core.

use std::collections::BTreeMap;
use std::fmt;

use serde::de::{self, Deserializer, Visitor};
use serde::Deserialize;

use crate::budget::BudgetValue;

/// What a refused budget spelling is told it should have been.
const EXPECTED: &str = "a positive whole number of tokens (at most 4294967295) or \"off\"";
/// The rule a refused spelling breaks.
const RULE: &str = "docs/budgets.md#refusals, rule 6";

/// One budget as written in a config layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BudgetSetting(pub BudgetValue);

/// A node's budget setting: one budget for every walk the model budgets there, or per walk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeBudgetSetting {
    /// One budget for every walk the model budgets on the node.
    All(BudgetSetting),
    /// `walk -> budget`.
    PerWalk(BTreeMap<String, BudgetSetting>),
}

impl NodeBudgetSetting {
    /// The budget set for `walk` (`None`: the node-wide one) as written, for error messages.
    pub fn shown(&self, walk: Option<&str>) -> Option<String> {
        match (self, walk) {
            (Self::All(v), _) => Some(v.0.to_string()),
            (Self::PerWalk(m), Some(w)) => m.get(w).map(|v| v.0.to_string()),
            (Self::PerWalk(_), None) => None,
        }
    }
}

/// A token count as a budget, or the refusal that names what was written.
fn tokens<E: de::Error>(n: i128) -> Result<BudgetSetting, E> {
    u32::try_from(n)
        .ok()
        .and_then(BudgetValue::tokens)
        .map(BudgetSetting)
        .ok_or_else(|| E::custom(format!("expected {EXPECTED}, got {n} ({RULE})")))
}

/// Accepts exactly the spellings of a budget. Deliberately not serde's integer path: config
/// layers coerce `false`, `"off"` and `"no"` into 0 for integer targets, which would turn a
/// typo into a different budget.
struct BudgetVisitor;

impl<'de> Visitor<'de> for BudgetVisitor {
    type Value = BudgetSetting;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(EXPECTED)
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
        tokens(i128::from(v))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
        tokens(i128::from(v))
    }

    fn visit_i128<E: de::Error>(self, v: i128) -> Result<Self::Value, E> {
        tokens(v)
    }

    fn visit_u128<E: de::Error>(self, v: u128) -> Result<Self::Value, E> {
        tokens(i128::try_from(v).unwrap_or(i128::MAX))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Self::Value, E> {
        // 2048.0 is refused as well: a budget is written as a whole number.
        Err(E::invalid_type(de::Unexpected::Float(v), &self))
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Self::Value, E> {
        Err(E::invalid_type(de::Unexpected::Bool(v), &self))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        let t = v.trim();
        if t.eq_ignore_ascii_case("off") {
            return Ok(BudgetSetting(BudgetValue::Off));
        }
        // Only decimal digits with an optional sign: "1.5", "1e3", "0x10", "none" and "false"
        // are refused rather than guessed at. The length cap keeps i128 parsing exact.
        let digits = t.strip_prefix(['-', '+']).unwrap_or(t);
        if digits.is_empty() || digits.len() > 30 || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return Err(E::custom(format!(
                "expected {EXPECTED}, got {} ({RULE})",
                super::problem::quote(v)
            )));
        }
        tokens(t.parse::<i128>().map_err(E::custom)?)
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(BudgetSetting(BudgetValue::Off))
    }

    fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(BudgetSetting(BudgetValue::Off))
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Deserialize<'de> for BudgetSetting {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(BudgetVisitor)
    }
}

/// A scalar is one budget for the node, a table is per walk. Hand-written rather than
/// `#[serde(untagged)]`, whose "did not match any variant" would hide what was wrong.
impl<'de> Deserialize<'de> for NodeBudgetSetting {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = NodeBudgetSetting;

            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                write!(f, "{EXPECTED}, or a table walk -> budget")
            }

            fn visit_map<A: de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut walks = BTreeMap::new();
                while let Some((walk, budget)) = map.next_entry::<String, BudgetSetting>()? {
                    walks.insert(walk, budget);
                }
                Ok(NodeBudgetSetting::PerWalk(walks))
            }

            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
                BudgetVisitor.visit_i64(v).map(NodeBudgetSetting::All)
            }

            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
                BudgetVisitor.visit_u64(v).map(NodeBudgetSetting::All)
            }

            fn visit_i128<E: de::Error>(self, v: i128) -> Result<Self::Value, E> {
                BudgetVisitor.visit_i128(v).map(NodeBudgetSetting::All)
            }

            fn visit_u128<E: de::Error>(self, v: u128) -> Result<Self::Value, E> {
                BudgetVisitor.visit_u128(v).map(NodeBudgetSetting::All)
            }

            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Self::Value, E> {
                Err(E::invalid_type(de::Unexpected::Float(v), &self))
            }

            fn visit_bool<E: de::Error>(self, v: bool) -> Result<Self::Value, E> {
                Err(E::invalid_type(de::Unexpected::Bool(v), &self))
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                BudgetVisitor.visit_str::<E>(v).map(NodeBudgetSetting::All)
            }

            fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(NodeBudgetSetting::All(BudgetSetting(BudgetValue::Off)))
            }

            fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
                self.visit_unit()
            }

            fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
                d.deserialize_any(self)
            }
        }
        d.deserialize_any(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

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
                format!("expected a positive whole number of tokens (at most 4294967295) or \"off\", got {shown} (docs/budgets.md#refusals, rule 6)"),
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
            e.ends_with("got 0 (docs/budgets.md#refusals, rule 6)"),
            "{e}"
        );
    }
}
