//! Time budget and latency model spellings, parsed strictly at the config boundary
//! (`docs/cost-model.md#time-budgets`, `docs/config.md`): `chunking.max_step_ms.<node>` is a
//! finite number of milliseconds above 0 (or such a number as a string, as environment
//! variables arrive), `"off"` / null, or a table `walk -> ms`; `chunking.cost.<node>` is a table
//! of the four coefficients, or the name of a preset (`docs/cost-model.md#presets`).

use std::collections::BTreeMap;
use std::fmt;

use serde::de::{self, Deserializer, Visitor};
use serde::Deserialize;

use crate::budget::TimeBudget;
use crate::latency::LatencyModel;
use crate::latency_presets;

/// What a refused time budget is told it should have been.
const EXPECTED: &str = "a finite number of milliseconds above 0, or \"off\"";

/// One time budget as written in a config layer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TimeSetting(pub TimeBudget);

/// A node's time budget setting: one for every budgeted walk there, or per walk.
#[derive(Debug, Clone, PartialEq)]
pub enum NodeTimeSetting {
    /// One time budget for every walk the model budgets on the node.
    All(TimeSetting),
    /// `walk -> ms`.
    PerWalk(BTreeMap<String, TimeSetting>),
}

impl NodeTimeSetting {
    /// The time budget set for `walk` (`None`: the node-wide one) as written, for messages.
    pub fn shown(&self, walk: Option<&str>) -> Option<String> {
        match (self, walk) {
            (Self::All(v), _) => Some(v.0.to_string()),
            (Self::PerWalk(m), Some(w)) => m.get(w).map(|v| v.0.to_string()),
            (Self::PerWalk(_), None) => None,
        }
    }
}

fn ms<E: de::Error>(v: f64) -> Result<TimeSetting, E> {
    if v.is_finite() && v > 0.0 {
        Ok(TimeSetting(TimeBudget::Ms(v)))
    } else {
        Err(E::custom(format!("expected {EXPECTED}, got {v}")))
    }
}

/// Accepts exactly the spellings of a time budget.
struct TimeVisitor;

impl<'de> Visitor<'de> for TimeVisitor {
    type Value = TimeSetting;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(EXPECTED)
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
        ms(v as f64)
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
        ms(v as f64)
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Self::Value, E> {
        ms(v)
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Self::Value, E> {
        Err(E::invalid_type(de::Unexpected::Bool(v), &self))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        let t = v.trim();
        if t.eq_ignore_ascii_case("off") {
            return Ok(TimeSetting(TimeBudget::Off));
        }
        // Plain decimal notation only ("45", "45.5"): no "inf", "nan", hex or exponents.
        let plain = !t.is_empty()
            && t.len() <= 32
            && t.bytes().all(|b| b.is_ascii_digit() || b == b'.')
            && t.bytes().filter(|&b| b == b'.').count() <= 1;
        match t.parse::<f64>() {
            Ok(v) if plain => ms(v),
            _ => Err(E::custom(format!(
                "expected {EXPECTED}, got {}",
                super::problem::quote(v)
            ))),
        }
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(TimeSetting(TimeBudget::Off))
    }

    fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
        self.visit_unit()
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Deserialize<'de> for TimeSetting {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(TimeVisitor)
    }
}

impl<'de> Deserialize<'de> for NodeTimeSetting {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = NodeTimeSetting;

            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                write!(f, "{EXPECTED}, or a table walk -> ms")
            }

            fn visit_map<A: de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut walks = BTreeMap::new();
                while let Some((walk, ms)) = map.next_entry::<String, TimeSetting>()? {
                    walks.insert(walk, ms);
                }
                Ok(NodeTimeSetting::PerWalk(walks))
            }

            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
                TimeVisitor.visit_i64(v).map(NodeTimeSetting::All)
            }

            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
                TimeVisitor.visit_u64(v).map(NodeTimeSetting::All)
            }

            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Self::Value, E> {
                TimeVisitor.visit_f64(v).map(NodeTimeSetting::All)
            }

            fn visit_bool<E: de::Error>(self, v: bool) -> Result<Self::Value, E> {
                TimeVisitor.visit_bool(v).map(NodeTimeSetting::All)
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                TimeVisitor.visit_str(v).map(NodeTimeSetting::All)
            }

            fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
                TimeVisitor.visit_unit().map(NodeTimeSetting::All)
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

/// `chunking.cost.<node>`: a latency model, as a table of its coefficients or a preset's name.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CostSetting(pub LatencyModel);

impl<'de> Deserialize<'de> for CostSetting {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = CostSetting;

            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                write!(
                    f,
                    "a table of base_ms, per_token_ms, per_kv_token_ms and per_attention_pair_ms, or a preset ({})",
                    latency_presets::preset_names().collect::<Vec<_>>().join(", ")
                )
            }

            fn visit_map<A: de::MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
                LatencyModel::deserialize(de::value::MapAccessDeserializer::new(map))
                    .map(CostSetting)
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                latency_presets::preset_model(v.trim())
                    .map(CostSetting)
                    .ok_or_else(|| {
                        E::custom(format!(
                            "no latency model preset {}; presets: {}",
                            super::problem::quote(v),
                            latency_presets::preset_names()
                                .collect::<Vec<_>>()
                                .join(", ")
                        ))
                    })
            }
        }
        d.deserialize_any(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

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

    #[test]
    fn a_cost_is_a_table_of_coefficients_or_a_preset() {
        let cost = |v| serde_json::from_value::<CostSetting>(v).map(|c| c.0);
        let m = cost(json!({"base_ms": 5.0, "per_token_ms": 0.06, "per_kv_token_ms": 0.0002, "per_attention_pair_ms": 3e-6})).unwrap();
        assert_eq!(m.coefficients(), [5.0, 0.06, 0.0002, 3e-6]);
        assert_eq!(
            cost(json!("llama2-7b-a100")).unwrap(),
            latency_presets::preset_model("llama2-7b-a100").unwrap()
        );
        let e = cost(json!("gpt-9")).unwrap_err().to_string();
        assert!(e.contains("llama2-7b-a100"), "{e}");
        assert!(cost(json!({"base_ms": -1.0})).is_err());
        assert!(cost(json!({"base_ms": 1.0, "bogus": 2.0})).is_err());
    }
}
