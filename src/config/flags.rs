//! Command-line flags as a config layer (`docs/config.md#flags`): `replay --max-step-ms 45` is
//! `chunking.max_step_ms.<node> = 45` set in a layer above every other, so a flag goes through
//! the same parser and the same validation as its key, and a refusal names the flag as the
//! layer that set the key.
//!
//! A flag value is typed as an environment variable's is (a number or a boolean when it reads
//! as one, else a string); the settings' own deserializers then accept or refuse it. A flag
//! replaces what lower layers said for its setting: `--cost` replaces the node's whole
//! `chunking.cost.<node>`. A program builds flags of its own sections with
//! [`FlagSetting::new`] and its edits.

use std::collections::BTreeMap;

use serde_json::Value;

/// The label of the flags' layer, as `check` and the replay's summary list the layers.
pub const FLAGS_LAYER: &str = "command-line flags";

/// Where `{node}` appears in a flag's key: the node the program's sections name
/// (`ExtraSections::NODE_KEY`), else the manifest's first node.
pub const NODE: &str = "{node}";

/// The coefficients of a latency model, in the order `a,b,c,d[,e]` gives them (the fifth,
/// `per_row_ms`, optional).
pub const COEFFICIENTS: [&str; 5] = [
    "base_ms",
    "per_token_ms",
    "per_kv_token_ms",
    "per_attention_pair_ms",
    "per_row_ms",
];

/// A latency model's coefficients as a flag gives them: `Ok(None)` for a preset's name, else
/// four numbers, or five with `per_row_ms`.
///
/// # Errors
/// A list of another length, saying what is expected.
pub fn split_cost(value: &str) -> Result<Option<Vec<&str>>, String> {
    match split_list(value, &COEFFICIENTS[..4]) {
        Err(_) if value.split(',').count() == COEFFICIENTS.len() => {
            split_list(value, &COEFFICIENTS)
        }
        Err(e) => Err(format!("{e} (or 5, the fifth per_row_ms)")),
        other => other,
    }
}

/// One command-line flag as the config edits it makes.
#[derive(Debug, Clone, PartialEq)]
pub struct FlagSetting {
    /// The flag as typed (`--max-step-ms`), named as the layer of the keys it sets.
    pub flag: &'static str,
    edits: Vec<Edit>,
}

#[derive(Debug, Clone, PartialEq)]
enum Edit {
    /// Sets the key (dotted; `{node}` for the replayed node) to the value, replacing what is
    /// there (a table included).
    Set(String, Value),
    /// Removes the key, if a lower layer set it.
    Remove(String),
}

/// A flag's value typed as an environment variable's: a boolean, an integer or a float when it
/// reads as one, else the string as given (which the setting then accepts or refuses).
pub fn typed(s: &str) -> Value {
    let t = s.trim();
    if let Ok(b) = t.parse::<bool>() {
        return Value::Bool(b);
    }
    if let Ok(n) = t.parse::<i64>() {
        return Value::from(n);
    }
    if let Ok(n) = t.parse::<u64>() {
        return Value::from(n);
    }
    match t.parse::<f64>() {
        Ok(x) => {
            serde_json::Number::from_f64(x).map_or_else(|| Value::String(t.into()), Value::Number)
        }
        Err(_) => Value::String(s.to_owned()),
    }
}

/// `a,b,c` as a table of `keys` (as many parts as keys), each part typed.
pub fn table(keys: &[&str], parts: &[&str]) -> serde_json::Map<String, Value> {
    keys.iter()
        .zip(parts)
        .map(|(k, v)| ((*k).to_owned(), typed(v)))
        .collect()
}

/// Splits a `PRESET|a,b,…` value: `Ok(None)` for a preset's name (no comma), the parts when
/// there are `n` of them.
///
/// # Errors
/// A list of another length, saying what is expected.
pub fn split_list<'a>(value: &'a str, keys: &[&str]) -> Result<Option<Vec<&'a str>>, String> {
    if !value.contains(',') {
        return Ok(None);
    }
    let parts: Vec<&str> = value.split(',').map(str::trim).collect();
    if parts.len() == keys.len() {
        Ok(Some(parts))
    } else {
        Err(format!(
            "expected a preset's name or {} comma-separated numbers ({}); got {} part{}",
            keys.len(),
            keys.join(","),
            parts.len(),
            if parts.len() == 1 { "" } else { "s" }
        ))
    }
}

impl FlagSetting {
    /// The flag `flag` (as typed, `--workers`), editing nothing yet.
    pub fn new(flag: &'static str) -> Self {
        Self {
            flag,
            edits: Vec::new(),
        }
    }

    /// Then sets the dotted `key` (`{node}` for the node, [`NODE`]) to `value`, replacing
    /// what lower layers put there (a table included).
    #[must_use]
    pub fn set(mut self, key: impl Into<String>, value: Value) -> Self {
        self.edits.push(Edit::Set(key.into(), value));
        self
    }

    /// Then removes the dotted `key`, if a lower layer set it.
    #[must_use]
    pub fn remove(mut self, key: impl Into<String>) -> Self {
        self.edits.push(Edit::Remove(key.into()));
        self
    }

    /// `--max-step-ms MS|off`: `chunking.max_step_ms.<node>`.
    pub fn max_step_ms(value: &str) -> Self {
        Self::new("--max-step-ms").set(format!("chunking.max_step_ms.{NODE}"), typed(value))
    }

    /// `--cost PRESET|a,b,c,d`: `chunking.cost.<node>`, a preset's name or the four
    /// coefficients.
    ///
    /// # Errors
    /// A list of other than four numbers.
    pub fn cost(value: &str) -> Result<Self, String> {
        let v = match split_cost(value)? {
            None => Value::String(value.to_owned()),
            Some(parts) => Value::Object(table(&COEFFICIENTS, &parts)),
        };
        Ok(Self::new("--cost").set(format!("chunking.cost.{NODE}"), v))
    }

    /// `--learn-cost`: `chunking.learn_cost = true`.
    pub fn learn_cost() -> Self {
        Self::new("--learn-cost").set("chunking.learn_cost", Value::Bool(true))
    }

    /// `--time-margin Q`: `chunking.time_margin`.
    pub fn time_margin(value: &str) -> Self {
        Self::new("--time-margin").set("chunking.time_margin", typed(value))
    }
}

/// Applies `flags` to the merged layers `tree`, in order, and answers who set each key:
/// `dotted key -> "command-line flag --x"`, for the flags' layer of the key origins. A flag
/// whose key needs the node (`{node}`, which is `node`) is skipped when there is none (the
/// manifest was refused, which is reported).
pub fn apply(
    flags: &[FlagSetting],
    tree: &mut Value,
    node: Option<&str>,
) -> BTreeMap<String, String> {
    let mut origins = BTreeMap::new();
    for f in flags {
        for edit in &f.edits {
            let key = match edit {
                Edit::Set(k, _) | Edit::Remove(k) => k,
            };
            let key = if key.contains(NODE) {
                let Some(node) = node else { continue };
                key.replace(NODE, node)
            } else {
                key.clone()
            };
            let path: Vec<String> = key.split('.').map(str::to_owned).collect();
            match edit {
                Edit::Set(_, v) => {
                    set(tree, &path, v.clone());
                    origins.insert(key, format!("command-line flag {}", f.flag));
                }
                Edit::Remove(_) => {
                    super::decode::remove(tree, &path);
                }
            }
        }
    }
    origins
}

/// Sets `path` in `tree` to `v`, making tables on the way; a value on the way that is not a
/// table (`replay.cost = "preset"` under `replay.cost.base_ms`) is replaced by one.
fn set(tree: &mut Value, path: &[String], v: Value) {
    let Some((last, parents)) = path.split_last() else {
        return;
    };
    let mut at = tree;
    for seg in parents {
        if !at.is_object() {
            *at = Value::Object(serde_json::Map::new());
        }
        let Value::Object(m) = at else { return };
        at = m
            .entry(seg.clone())
            .or_insert_with(|| Value::Object(serde_json::Map::new()));
    }
    if !at.is_object() {
        *at = Value::Object(serde_json::Map::new());
    }
    if let Value::Object(m) = at {
        m.insert(last.clone(), v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn flags_replace_their_setting_and_name_themselves_as_its_layer() {
        let mut tree = json!({
            "chunking": {"max_step_ms": {"llm": {"mixed": 45}}, "cost": {"llm": "llama2-7b-a100"}},
            "other": {"kept": 1, "gone": 2, "table": "text"},
        });
        let flags = [
            FlagSetting::max_step_ms("100"),
            FlagSetting::cost("5, 0.06,0,1e-6").unwrap(),
            FlagSetting::time_margin("0.98"),
            FlagSetting::learn_cost(),
            FlagSetting::new("--own")
                .remove("other.gone")
                .set("other.table.inner", json!(3))
                .set("other.new.deep", json!("x")),
        ];
        let origins = apply(&flags, &mut tree, Some("llm"));
        assert_eq!(
            tree,
            json!({
                "chunking": {"max_step_ms": {"llm": 100},
                             "cost": {"llm": {"base_ms": 5, "per_token_ms": 0.06, "per_kv_token_ms": 0, "per_attention_pair_ms": 1e-6}},
                             "time_margin": 0.98, "learn_cost": true},
                "other": {"kept": 1, "table": {"inner": 3}, "new": {"deep": "x"}},
            })
        );
        assert_eq!(
            origins["chunking.max_step_ms.llm"],
            "command-line flag --max-step-ms"
        );
        assert_eq!(origins["other.new.deep"], "command-line flag --own");
        assert!(!origins.contains_key("other.gone"));
        // `{node}` is the node given.
        let mut tree = json!({});
        apply(
            &[FlagSetting::max_step_ms("off")],
            &mut tree,
            Some("talker"),
        );
        assert_eq!(tree["chunking"]["max_step_ms"], json!({"talker": "off"}));
        // Without a node, the node's keys are left alone.
        let mut tree = json!({});
        assert!(apply(&[FlagSetting::max_step_ms("5")], &mut tree, None).is_empty());
        assert_eq!(tree, json!({}));
    }

    #[test]
    fn lists_have_as_many_parts_as_keys_and_values_are_typed_as_environment_values() {
        assert!(FlagSetting::cost("1,2,3").is_err());
        // Four coefficients, or five with `per_row_ms`; no other count.
        assert!(split_cost("1,2,3,4,5,6").is_err());
        assert_eq!(split_cost("1,2,3,4,5").unwrap().unwrap().len(), 5);
        assert_eq!(split_cost("a100").unwrap(), None);
        let e = FlagSetting::cost("1,2,3,4,5,6").unwrap_err();
        assert!(e.contains("4 comma-separated numbers"), "{e}");
        assert!(e.contains("(or 5, the fifth per_row_ms)"), "{e}");
        let e = split_list("80,1", &["a", "b", "c"]).unwrap_err();
        assert!(
            e.contains("3 comma-separated numbers (a,b,c); got 2 parts"),
            "{e}"
        );
        assert_eq!(typed("45"), json!(45));
        assert_eq!(typed("-45"), json!(-45));
        assert_eq!(
            typed("18446744073709551615"),
            json!(18446744073709551615u64)
        );
        assert_eq!(typed("4.5"), json!(4.5));
        assert_eq!(typed("true"), json!(true));
        assert_eq!(typed("off"), json!("off"));
        // Not finite: left as text, which every numeric setting refuses.
        assert_eq!(typed("inf"), json!("inf"));
        assert_eq!(typed("NaN"), json!("NaN"));
    }
}
