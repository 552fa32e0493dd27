//! Command-line flags as a config layer (`docs/config.md#flags`): `replay --max-step-ms 45` is
//! `chunking.max_step_ms.<node> = 45` set in a layer above every other, so a flag goes through
//! the same parser and the same validation as its key, and a refusal names the flag as the
//! layer that set the key.
//!
//! A flag value is typed as an environment variable's is (a number or a boolean when it reads
//! as one, else a string); the settings' own deserializers then accept or refuse it. A flag
//! replaces what lower layers said for its setting: `--cost` replaces the node's whole
//! `chunking.cost.<node>`, `--kv-blocks` drops a `replay.kv.preset` or memory budget from a
//! lower layer, `--sim-cost` replaces the coefficients or preset of `replay.cost` and keeps its
//! `noise` and `learn`.

use std::collections::BTreeMap;

use serde_json::Value;

/// The label of the flags' layer, as `check` and the replay's summary list the layers.
pub const FLAGS_LAYER: &str = "command-line flags";

/// Where `{node}` appears in a flag's key: the replayed node (`replay.node`, else the
/// manifest's first node).
const NODE: &str = "{node}";

/// The coefficients of a latency model, in the order `a,b,c,d[,e]` gives them (the fifth,
/// `per_row_ms`, optional).
const COEFFICIENTS: [&str; 5] = [
    "base_ms",
    "per_token_ms",
    "per_kv_token_ms",
    "per_attention_pair_ms",
    "per_row_ms",
];

/// A latency model's coefficients as a flag gives them: four, or five with `per_row_ms`.
fn split_cost(value: &str) -> Result<Option<Vec<&str>>, String> {
    match split_list(value, &COEFFICIENTS[..4]) {
        Err(_) if value.split(',').count() == COEFFICIENTS.len() => {
            split_list(value, &COEFFICIENTS)
        }
        Err(e) => Err(format!("{e} (or 5, the fifth per_row_ms)")),
        other => other,
    }
}

/// The keys of `replay.kv` that size the pool (one way at a time).
const KV_SIZING: [&str; 5] = [
    "blocks",
    "preset",
    "gpu_memory_gb",
    "weights_gb",
    "kv_bytes_per_token",
];

/// The keys a memory budget takes, in the order `--kv-memory a,b,c` gives them.
const KV_MEMORY: [&str; 3] = ["gpu_memory_gb", "weights_gb", "kv_bytes_per_token"];

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
fn typed(s: &str) -> Value {
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
fn table(keys: &[&str], parts: &[&str]) -> serde_json::Map<String, Value> {
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
    fn new(flag: &'static str, edits: Vec<Edit>) -> Self {
        Self { flag, edits }
    }

    /// `--max-step-ms MS|off`: `chunking.max_step_ms.<node>`.
    pub fn max_step_ms(value: &str) -> Self {
        Self::new(
            "--max-step-ms",
            vec![Edit::Set(
                format!("chunking.max_step_ms.{NODE}"),
                typed(value),
            )],
        )
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
        Ok(Self::new(
            "--cost",
            vec![Edit::Set(format!("chunking.cost.{NODE}"), v)],
        ))
    }

    /// `--learn-cost`: `chunking.learn_cost = true`.
    pub fn learn_cost() -> Self {
        Self::new(
            "--learn-cost",
            vec![Edit::Set("chunking.learn_cost".into(), Value::Bool(true))],
        )
    }

    /// `--time-margin Q`: `chunking.time_margin`.
    pub fn time_margin(value: &str) -> Self {
        Self::new(
            "--time-margin",
            vec![Edit::Set("chunking.time_margin".into(), typed(value))],
        )
    }

    /// `--sim-cost PRESET|a,b,c,d[,e]`: `replay.cost`'s preset or its coefficients (its
    /// `noise` and `learn` kept; `per_row_ms` 0 unless given).
    ///
    /// # Errors
    /// A list of other than four or five numbers.
    pub fn sim_cost(value: &str) -> Result<Self, String> {
        let mut edits = Vec::new();
        match split_cost(value)? {
            None => {
                edits.extend(
                    COEFFICIENTS
                        .iter()
                        .map(|k| Edit::Remove(format!("replay.cost.{k}"))),
                );
                edits.push(Edit::Set(
                    "replay.cost.preset".into(),
                    Value::String(value.to_owned()),
                ));
            }
            Some(parts) => {
                edits.push(Edit::Remove("replay.cost.preset".into()));
                if parts.len() < COEFFICIENTS.len() {
                    edits.push(Edit::Remove("replay.cost.per_row_ms".into()));
                }
                edits.extend(
                    table(&COEFFICIENTS, &parts)
                        .into_iter()
                        .map(|(k, v)| Edit::Set(format!("replay.cost.{k}"), v)),
                );
            }
        }
        Ok(Self::new("--sim-cost", edits))
    }

    /// `--kv-blocks N`: `replay.kv.blocks`, instead of any other sizing of the pool.
    pub fn kv_blocks(value: &str) -> Self {
        let mut edits = kv_unsized();
        edits.push(Edit::Remove("replay.kv.memory_utilization".into()));
        edits.push(Edit::Set("replay.kv.blocks".into(), typed(value)));
        Self::new("--kv-blocks", edits)
    }

    /// `--kv-memory PRESET|GPU_GB,WEIGHTS_GB,KV_BYTES_PER_TOKEN`: `replay.kv.preset`, or the
    /// memory budget's three keys, instead of any other sizing of the pool
    /// (`replay.kv.memory_utilization` kept).
    ///
    /// # Errors
    /// A list of other than three numbers.
    pub fn kv_memory(value: &str) -> Result<Self, String> {
        let mut edits = kv_unsized();
        match split_list(value, &KV_MEMORY)? {
            None => edits.push(Edit::Set(
                "replay.kv.preset".into(),
                Value::String(value.to_owned()),
            )),
            Some(parts) => edits.extend(
                table(&KV_MEMORY, &parts)
                    .into_iter()
                    .map(|(k, v)| Edit::Set(format!("replay.kv.{k}"), v)),
            ),
        }
        Ok(Self::new("--kv-memory", edits))
    }

    /// `--workers N`: `replay.fleet.workers`, the component instances replayed side by side.
    pub fn workers(value: &str) -> Self {
        Self::new(
            "--workers",
            vec![Edit::Set("replay.fleet.workers".into(), typed(value))],
        )
    }

    /// `--prefill-workers N`: `replay.fleet.prefill_workers`, the workers that only prefill.
    pub fn prefill_workers(value: &str) -> Self {
        Self::new(
            "--prefill-workers",
            vec![Edit::Set(
                "replay.fleet.prefill_workers".into(),
                typed(value),
            )],
        )
    }

    /// `--decode-workers N`: `replay.fleet.decode_workers`, the workers that only decode.
    pub fn decode_workers(value: &str) -> Self {
        Self::new(
            "--decode-workers",
            vec![Edit::Set(
                "replay.fleet.decode_workers".into(),
                typed(value),
            )],
        )
    }

    /// `--kv-link-gbps X`: `replay.fleet.kv_link_gbps`, a prefill worker's KV link.
    pub fn kv_link_gbps(value: &str) -> Self {
        Self::new(
            "--kv-link-gbps",
            vec![Edit::Set("replay.fleet.kv_link_gbps".into(), typed(value))],
        )
    }

    /// `--kv-link-latency-ms MS`: `replay.fleet.kv_link_latency_ms`, a KV transfer's fixed
    /// latency.
    pub fn kv_link_latency_ms(value: &str) -> Self {
        Self::new(
            "--kv-link-latency-ms",
            vec![Edit::Set(
                "replay.fleet.kv_link_latency_ms".into(),
                typed(value),
            )],
        )
    }

    /// `--router NAME`: `replay.fleet.router`, how a request is sent to a worker.
    pub fn router(value: &str) -> Self {
        Self::new(
            "--router",
            vec![Edit::Set("replay.fleet.router".into(), typed(value))],
        )
    }
}

fn kv_unsized() -> Vec<Edit> {
    KV_SIZING
        .iter()
        .map(|k| Edit::Remove(format!("replay.kv.{k}")))
        .collect()
}

/// The replayed node as the merged layers say: `replay.node` when it is a string, else the
/// manifest's first node.
fn replayed_node(tree: &Value, first_node: Option<&str>) -> Option<String> {
    match tree.get("replay").and_then(|r| r.get("node")) {
        Some(Value::String(n)) => Some(n.clone()),
        _ => first_node.map(str::to_owned),
    }
}

/// Applies `flags` to the merged layers `tree`, in order, and answers who set each key:
/// `dotted key -> "command-line flag --x"`, for the flags' layer of the key origins. A flag
/// whose key needs the replayed node is skipped when there is none (the manifest was refused,
/// which is reported).
pub fn apply(
    flags: &[FlagSetting],
    tree: &mut Value,
    first_node: Option<&str>,
) -> BTreeMap<String, String> {
    let node = replayed_node(tree, first_node);
    let mut origins = BTreeMap::new();
    for f in flags {
        for edit in &f.edits {
            let key = match edit {
                Edit::Set(k, _) | Edit::Remove(k) => k,
            };
            let key = if key.contains(NODE) {
                let Some(node) = &node else { continue };
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
            "replay": {"cost": {"preset": "llama2-7b-a100", "noise": 0.1},
                       "kv": {"preset": "llama2-7b-a100", "block_tokens": 32}},
        });
        let flags = [
            FlagSetting::max_step_ms("100"),
            FlagSetting::cost("5, 0.06,0,1e-6").unwrap(),
            FlagSetting::sim_cost("8,0.02,0,0").unwrap(),
            FlagSetting::kv_blocks("500"),
            FlagSetting::time_margin("0.98"),
            FlagSetting::learn_cost(),
        ];
        let origins = apply(&flags, &mut tree, Some("llm"));
        assert_eq!(
            tree,
            json!({
                "chunking": {"max_step_ms": {"llm": 100},
                             "cost": {"llm": {"base_ms": 5, "per_token_ms": 0.06, "per_kv_token_ms": 0, "per_attention_pair_ms": 1e-6}},
                             "time_margin": 0.98, "learn_cost": true},
                "replay": {"cost": {"noise": 0.1, "base_ms": 8, "per_token_ms": 0.02, "per_kv_token_ms": 0, "per_attention_pair_ms": 0},
                           "kv": {"block_tokens": 32, "blocks": 500}},
            })
        );
        assert_eq!(
            origins["chunking.max_step_ms.llm"],
            "command-line flag --max-step-ms"
        );
        assert_eq!(origins["replay.kv.blocks"], "command-line flag --kv-blocks");
        // A preset's name over a string preset, and `replay.node` names the node.
        let mut tree = json!({"replay": {"node": "talker", "cost": "llama2-7b-a100"}});
        let o = apply(
            &[
                FlagSetting::sim_cost("llama2-7b-h100").unwrap(),
                FlagSetting::max_step_ms("off"),
                FlagSetting::kv_memory("80,12.5,524288").unwrap(),
            ],
            &mut tree,
            Some("llm"),
        );
        assert_eq!(tree["replay"]["cost"], json!({"preset": "llama2-7b-h100"}));
        assert_eq!(tree["chunking"]["max_step_ms"], json!({"talker": "off"}));
        assert_eq!(
            tree["replay"]["kv"],
            json!({"gpu_memory_gb": 80, "weights_gb": 12.5, "kv_bytes_per_token": 524288})
        );
        assert!(o.contains_key("replay.kv.weights_gb"));
        // Without a node, the node's keys are left alone.
        let mut tree = json!({});
        assert!(apply(&[FlagSetting::max_step_ms("5")], &mut tree, None).is_empty());
    }

    #[test]
    fn lists_have_as_many_parts_as_keys_and_values_are_typed_as_environment_values() {
        assert!(FlagSetting::cost("1,2,3").is_err());
        // Four coefficients, or five with `per_row_ms`; no other count.
        assert!(FlagSetting::sim_cost("1,2,3,4,5,6").is_err());
        assert!(FlagSetting::sim_cost("1,2,3,4,5").is_ok());
        let e = FlagSetting::cost("1,2,3,4,5,6").unwrap_err();
        assert!(e.contains("4 comma-separated numbers"), "{e}");
        let e = FlagSetting::kv_memory("80,1").unwrap_err();
        assert!(
            e.contains("gpu_memory_gb,weights_gb,kv_bytes_per_token"),
            "{e}"
        );
        assert_eq!(typed("45"), json!(45));
        assert_eq!(typed("4.5"), json!(4.5));
        assert_eq!(typed("true"), json!(true));
        assert_eq!(typed("off"), json!("off"));
        // Not finite: left as text, which every numeric setting refuses.
        assert_eq!(typed("inf"), json!("inf"));
        assert_eq!(typed("NaN"), json!("NaN"));
    }
}
