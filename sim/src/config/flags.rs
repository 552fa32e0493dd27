//! The replay's command-line flags as config layers (`docs/config.md#flags`), built on the
//! component's flag layer: `--kv-blocks` drops a `replay.kv.preset` or memory budget from a
//! lower layer, `--sim-cost` replaces the coefficients or preset of `replay.cost` and keeps
//! its `noise` and `learn`.

use crate::config::FlagSetting;
use mstar_chunking::config::flags::{split_cost, split_list, table, typed, COEFFICIENTS};
use serde_json::Value;

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

/// The flags of the `[replay]` section, as [`FlagSetting`]s (`FlagSetting::workers("3")` with
/// this trait in scope).
pub trait ReplayFlags {
    /// `--sim-cost PRESET|a,b,c,d[,e]`: `replay.cost`'s preset or its coefficients (its
    /// `noise` and `learn` kept; `per_row_ms` 0 unless given).
    ///
    /// # Errors
    /// A list of other than four or five numbers.
    fn sim_cost(value: &str) -> Result<FlagSetting, String> {
        let mut flag = FlagSetting::new("--sim-cost");
        match split_cost(value)? {
            None => {
                for k in COEFFICIENTS {
                    flag = flag.remove(format!("replay.cost.{k}"));
                }
                flag = flag.set("replay.cost.preset", Value::String(value.to_owned()));
            }
            Some(parts) => {
                flag = flag.remove("replay.cost.preset");
                if parts.len() < COEFFICIENTS.len() {
                    flag = flag.remove("replay.cost.per_row_ms");
                }
                for (k, v) in table(&COEFFICIENTS, &parts) {
                    flag = flag.set(format!("replay.cost.{k}"), v);
                }
            }
        }
        Ok(flag)
    }

    /// `--kv-blocks N`: `replay.kv.blocks`, instead of any other sizing of the pool.
    fn kv_blocks(value: &str) -> FlagSetting {
        kv_unsized(FlagSetting::new("--kv-blocks"))
            .remove("replay.kv.memory_utilization")
            .set("replay.kv.blocks", typed(value))
    }

    /// `--kv-memory PRESET|GPU_GB,WEIGHTS_GB,KV_BYTES_PER_TOKEN`: `replay.kv.preset`, or the
    /// memory budget's three keys, instead of any other sizing of the pool
    /// (`replay.kv.memory_utilization` kept).
    ///
    /// # Errors
    /// A list of other than three numbers.
    fn kv_memory(value: &str) -> Result<FlagSetting, String> {
        let mut flag = kv_unsized(FlagSetting::new("--kv-memory"));
        match split_list(value, &KV_MEMORY)? {
            None => flag = flag.set("replay.kv.preset", Value::String(value.to_owned())),
            Some(parts) => {
                for (k, v) in table(&KV_MEMORY, &parts) {
                    flag = flag.set(format!("replay.kv.{k}"), v);
                }
            }
        }
        Ok(flag)
    }

    /// `--workers N`: `replay.fleet.workers`, the component instances replayed side by side.
    fn workers(value: &str) -> FlagSetting {
        FlagSetting::new("--workers").set("replay.fleet.workers", typed(value))
    }

    /// `--prefill-workers N`: `replay.fleet.prefill_workers`, the workers that only prefill.
    fn prefill_workers(value: &str) -> FlagSetting {
        FlagSetting::new("--prefill-workers").set("replay.fleet.prefill_workers", typed(value))
    }

    /// `--decode-workers N`: `replay.fleet.decode_workers`, the workers that only decode.
    fn decode_workers(value: &str) -> FlagSetting {
        FlagSetting::new("--decode-workers").set("replay.fleet.decode_workers", typed(value))
    }

    /// `--kv-link-gbps X`: `replay.fleet.kv_link_gbps`, a prefill worker's KV link.
    fn kv_link_gbps(value: &str) -> FlagSetting {
        FlagSetting::new("--kv-link-gbps").set("replay.fleet.kv_link_gbps", typed(value))
    }

    /// `--kv-link-latency-ms MS`: `replay.fleet.kv_link_latency_ms`, a KV transfer's fixed
    /// latency.
    fn kv_link_latency_ms(value: &str) -> FlagSetting {
        FlagSetting::new("--kv-link-latency-ms")
            .set("replay.fleet.kv_link_latency_ms", typed(value))
    }

    /// `--router NAME`: `replay.fleet.router`, how a request is sent to a worker.
    fn router(value: &str) -> FlagSetting {
        FlagSetting::new("--router").set("replay.fleet.router", typed(value))
    }
}

impl ReplayFlags for FlagSetting {}

/// Removes every key that sizes the KV pool, so the flag's own sizing is the only one.
fn kv_unsized(mut flag: FlagSetting) -> FlagSetting {
    for k in KV_SIZING {
        flag = flag.remove(format!("replay.kv.{k}"));
    }
    flag
}

#[cfg(test)]
mod tests {
    use super::*;
    use mstar_chunking::config::flags::apply;
    use serde_json::json;

    #[test]
    fn the_replays_flags_replace_their_setting_and_name_themselves_as_its_layer() {
        let mut tree = json!({
            "replay": {"cost": {"preset": "llama2-7b-a100", "noise": 0.1, "per_row_ms": 1},
                       "kv": {"preset": "llama2-7b-a100", "block_tokens": 32, "memory_utilization": 0.8}},
        });
        let flags = [
            FlagSetting::sim_cost("8,0.02,0,0").unwrap(),
            FlagSetting::kv_blocks("500"),
            FlagSetting::workers("3"),
            FlagSetting::router("least_kv"),
        ];
        let origins = apply(&flags, &mut tree, Some("llm"));
        assert_eq!(
            tree,
            json!({
                "replay": {"cost": {"noise": 0.1, "base_ms": 8, "per_token_ms": 0.02, "per_kv_token_ms": 0, "per_attention_pair_ms": 0},
                           "kv": {"block_tokens": 32, "blocks": 500},
                           "fleet": {"workers": 3, "router": "least_kv"}},
            })
        );
        assert_eq!(origins["replay.kv.blocks"], "command-line flag --kv-blocks");
        assert_eq!(origins["replay.fleet.router"], "command-line flag --router");
        // A preset's name over a string preset; five coefficients keep `per_row_ms`; a memory
        // budget keeps `memory_utilization`.
        let mut tree = json!({"replay": {"cost": "llama2-7b-a100",
                                         "kv": {"blocks": 9, "memory_utilization": 0.8}}});
        let o = apply(
            &[
                FlagSetting::sim_cost("llama2-7b-h100").unwrap(),
                FlagSetting::kv_memory("80,12.5,524288").unwrap(),
                FlagSetting::prefill_workers("2"),
                FlagSetting::decode_workers("4"),
                FlagSetting::kv_link_gbps("100"),
                FlagSetting::kv_link_latency_ms("2.5"),
            ],
            &mut tree,
            None,
        );
        assert_eq!(tree["replay"]["cost"], json!({"preset": "llama2-7b-h100"}));
        assert_eq!(
            tree["replay"]["kv"],
            json!({"memory_utilization": 0.8, "gpu_memory_gb": 80, "weights_gb": 12.5, "kv_bytes_per_token": 524288})
        );
        assert_eq!(
            tree["replay"]["fleet"],
            json!({"prefill_workers": 2, "decode_workers": 4, "kv_link_gbps": 100, "kv_link_latency_ms": 2.5})
        );
        assert!(o.contains_key("replay.kv.weights_gb"));
        let mut tree = json!({"replay": {"cost": {"preset": "x", "per_row_ms": 1}}});
        apply(
            &[FlagSetting::sim_cost("1,2,3,4,5").unwrap()],
            &mut tree,
            None,
        );
        assert_eq!(
            tree["replay"]["cost"],
            json!({"base_ms": 1, "per_token_ms": 2, "per_kv_token_ms": 3, "per_attention_pair_ms": 4, "per_row_ms": 5})
        );
    }

    #[test]
    fn the_replays_lists_have_as_many_parts_as_keys() {
        // Four coefficients, or five with `per_row_ms`; no other count.
        assert!(FlagSetting::sim_cost("1,2,3,4,5,6").is_err());
        assert!(FlagSetting::sim_cost("1,2,3").is_err());
        let e = FlagSetting::kv_memory("80,1").unwrap_err();
        assert!(
            e.contains("gpu_memory_gb,weights_gb,kv_bytes_per_token"),
            "{e}"
        );
    }
}
