//! `chunking.cost.<node>`: a latency model, as a table of its coefficients or the name of a
//! preset (`docs/presets.md`).

use std::fmt;

use serde::de::{self, Deserializer, Visitor};
use serde::Deserialize;

use crate::latency::presets;
use crate::latency::LatencyModel;

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
                    presets::preset_names().collect::<Vec<_>>().join(", ")
                )
            }

            fn visit_map<A: de::MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
                LatencyModel::deserialize(de::value::MapAccessDeserializer::new(map))
                    .map(CostSetting)
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                presets::preset_model(v.trim())
                    .map(CostSetting)
                    .ok_or_else(|| {
                        E::custom(format!(
                            "no latency model preset {}; presets: {}",
                            super::problem::quote(v),
                            presets::preset_names().collect::<Vec<_>>().join(", ")
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
    fn a_cost_is_a_table_of_coefficients_or_a_preset() {
        let cost = |v| serde_json::from_value::<CostSetting>(v).map(|c| c.0);
        let m = cost(json!({"base_ms": 5.0, "per_token_ms": 0.06, "per_kv_token_ms": 0.0002, "per_attention_pair_ms": 3e-6})).unwrap();
        assert_eq!(m.coefficients(), [5.0, 0.06, 0.0002, 3e-6]);
        assert_eq!(
            cost(json!("llama2-7b-a100")).unwrap(),
            presets::preset_model("llama2-7b-a100").unwrap()
        );
        let e = cost(json!("gpt-9")).unwrap_err().to_string();
        assert!(e.contains("llama2-7b-a100"), "{e}");
        assert!(cost(json!({"base_ms": -1.0})).is_err());
        assert!(cost(json!({"base_ms": 1.0, "bogus": 2.0})).is_err());
    }
}
