//! Latency-model presets for public model/GPU pairs (`replay.cost = "llama2-7b-a100"`), each
//! derived from public figures as `docs/presets.md` explains:
//! - `base_ms` and `per_token_ms`: the straight line through two points of a public
//!   per-operation profile (the model's weight, norm and activation operations at 64 and at
//!   2,048 tokens);
//! - `per_kv_token_ms`: a roofline memory term, the bytes of KV cache one context token holds
//!   read at an achievable fraction of the GPU's HBM bandwidth;
//! - `per_attention_pair_ms`: a roofline compute term, the FLOPs of one causal attention pair
//!   at an achievable fraction of the GPU's dense fp16 tensor peak.
//!
//! The inputs are kept as data and the coefficients computed from them, so the derivation in
//! the docs and the numbers in use cannot drift apart (a test pins both).

use crate::latency::LatencyModel;

/// The shape of a dense transformer, as far as its attention cost goes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ModelShape {
    /// Decoder layers.
    pub layers: f64,
    /// Attention heads (query heads).
    pub heads: f64,
    /// Key/value heads (equal to `heads` without grouped-query attention).
    pub kv_heads: f64,
    /// Dimension of one head.
    pub head_dim: f64,
    /// Bytes per cached K or V element (2 for fp16).
    pub kv_bytes_per_element: f64,
}

impl ModelShape {
    /// Bytes of KV cache one token holds: K and V, per layer, per KV head, per head dimension.
    pub fn kv_bytes_per_token(&self) -> f64 {
        2.0 * self.layers * self.kv_heads * self.head_dim * self.kv_bytes_per_element
    }

    /// FLOPs of one causal attention pair (a query token against one key token): `QKᵀ` and
    /// `PV` are `2·head_dim` FLOPs each per head, for every head of every layer.
    pub fn flops_per_attention_pair(&self) -> f64 {
        2.0 * 2.0 * self.head_dim * self.heads * self.layers
    }
}

/// A GPU's roofline: peak rates and the fraction of each that the relevant kernels reach.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Gpu {
    /// Dense fp16/bf16 tensor-core peak, FLOP/s.
    pub peak_flops: f64,
    /// Fraction of `peak_flops` causal attention over a prefix reaches.
    pub attention_fraction: f64,
    /// HBM bandwidth, bytes/s.
    pub hbm_bytes_per_s: f64,
    /// Fraction of `hbm_bytes_per_s` reading the KV cache reaches.
    pub memory_fraction: f64,
}

/// Two measured points `(tokens, ms)` of a step's per-token work (weights, norms, activations)
/// without attention.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinearProfile {
    /// The smaller step: tokens and milliseconds.
    pub small: (f64, f64),
    /// The larger step: tokens and milliseconds.
    pub large: (f64, f64),
}

/// One preset: a name, what it models, and the public figures it is derived from.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Preset {
    /// The name configs use (`replay.cost = "<name>"`).
    pub name: &'static str,
    /// The model, GPU and sources, one line.
    pub about: &'static str,
    /// The linear terms' profile.
    pub profile: LinearProfile,
    /// The model's shape.
    pub shape: ModelShape,
    /// The GPU's roofline.
    pub gpu: Gpu,
}

impl Preset {
    /// The latency model derived from the preset's figures.
    pub fn model(&self) -> LatencyModel {
        let ((t0, ms0), (t1, ms1)) = (self.profile.small, self.profile.large);
        let per_token_ms = (ms1 - ms0) / (t1 - t0);
        let base_ms = ms0 - per_token_ms * t0;
        let s_to_ms = 1e3;
        let per_kv_token_ms = self.shape.kv_bytes_per_token()
            / (self.gpu.hbm_bytes_per_s * self.gpu.memory_fraction)
            * s_to_ms;
        let per_attention_pair_ms = self.shape.flops_per_attention_pair()
            / (self.gpu.peak_flops * self.gpu.attention_fraction)
            * s_to_ms;
        LatencyModel::new_unchecked([
            base_ms,
            per_token_ms,
            per_kv_token_ms,
            per_attention_pair_ms,
        ])
    }
}

/// Llama-2-7B: 32 layers, 32 heads of dimension 128 (hidden 4096), no grouped-query attention,
/// fp16 KV cache.
pub const LLAMA2_7B: ModelShape = ModelShape {
    layers: 32.0,
    heads: 32.0,
    kv_heads: 32.0,
    head_dim: 128.0,
    kv_bytes_per_element: 2.0,
};

/// A100-80GB: 312 TFLOP/s dense fp16, 2.0 TB/s HBM2e; attention at 50% of peak (the low end
/// of FlashAttention-2's 50–73% on A100), KV reads at 80% of bandwidth.
pub const A100_80GB: Gpu = Gpu {
    peak_flops: 312e12,
    attention_fraction: 0.50,
    hbm_bytes_per_s: 2.0e12,
    memory_fraction: 0.80,
};

/// H100-80GB SXM: 989 TFLOP/s dense fp16, 3.35 TB/s HBM3; attention at 35% of peak
/// (FlashAttention-2 on H100), KV reads at 80% of bandwidth.
pub const H100_80GB_SXM: Gpu = Gpu {
    peak_flops: 989e12,
    attention_fraction: 0.35,
    hbm_bytes_per_s: 3.35e12,
    memory_fraction: 0.80,
};

/// Every preset, by name.
pub const PRESETS: [Preset; 2] = [
    Preset {
        name: "llama2-7b-a100",
        about: "Llama-2-7B on one A100-80GB: Vidur per-operation profile, roofline attention and KV terms",
        profile: LinearProfile {
            small: (64.0, 9.70),
            large: (2048.0, 133.46),
        },
        shape: LLAMA2_7B,
        gpu: A100_80GB,
    },
    Preset {
        name: "llama2-7b-h100",
        about: "Llama-2-7B on one H100-80GB SXM: Vidur per-operation profile, roofline attention and KV terms",
        profile: LinearProfile {
            small: (64.0, 5.86),
            large: (2048.0, 40.42),
        },
        shape: LLAMA2_7B,
        gpu: H100_80GB_SXM,
    },
];

/// The preset called `name`, if there is one.
pub fn preset(name: &str) -> Option<&'static Preset> {
    PRESETS.iter().find(|p| p.name == name)
}

/// The latency model of the preset called `name`, if there is one.
pub fn preset_model(name: &str) -> Option<LatencyModel> {
    preset(name).map(Preset::model)
}

/// The preset names, for error messages (``unknown preset `x`; known: llama2-7b-a100, …``).
pub fn preset_names() -> impl Iterator<Item = &'static str> {
    PRESETS.iter().map(|p| p.name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::latency::{ChunkBounds, StepFeatures};

    fn close(got: f64, want: f64, rel: f64) -> bool {
        (got - want).abs() <= rel * want.abs()
    }

    #[test]
    fn llama2_7b_shape() {
        // 2 × 32 layers × 4096 × 2 bytes = 512 KiB of KV cache per token.
        assert_eq!(LLAMA2_7B.kv_bytes_per_token(), 524_288.0);
        // 4 × 128 × 32 heads × 32 layers = 2^19 FLOPs per attention pair.
        assert_eq!(LLAMA2_7B.flops_per_attention_pair(), 524_288.0);
    }

    #[test]
    fn presets_match_the_derivation_in_the_docs() {
        // The numbers `docs/presets.md` prints, to their printed digits.
        let want = [
            (
                "llama2-7b-a100",
                [5.707742, 0.06237903, 3.2768e-4, 3.360821e-6],
            ),
            (
                "llama2-7b-h100",
                [4.745161, 0.01741935, 1.956299e-4, 1.514627e-6],
            ),
        ];
        for (name, c) in want {
            let m = preset_model(name).unwrap();
            // Every preset is a valid model.
            assert_eq!(LatencyModel::from_coefficients(m.coefficients()), Ok(m));
            for (got, want) in m.coefficients().into_iter().zip(c) {
                assert!(close(got, want, 1e-6), "{name}: {got} vs {want}");
            }
            // Through the two profile points exactly.
            let p = preset(name).unwrap();
            let linear = |t: f64| m.base_ms() + m.per_token_ms() * t;
            assert!(close(linear(p.profile.small.0), p.profile.small.1, 1e-12));
            assert!(close(linear(p.profile.large.0), p.profile.large.1, 1e-12));
        }
        assert_eq!(preset_model("llama2-7b-a800"), None);
        assert_eq!(
            preset_names().collect::<Vec<_>>(),
            ["llama2-7b-a100", "llama2-7b-h100"]
        );
    }

    #[test]
    fn a_deep_chunk_costs_more_than_a_shallow_one() {
        // The point of the attention term: the same 1,024 tokens at a 97k prefix cost several
        // times what they cost at a 1k prefix.
        let m = preset_model("llama2-7b-a100").unwrap();
        let at = |s: u32| m.predict_ms(&StepFeatures::EMPTY.with_chunk(s, s + 1024));
        let (shallow, deep) = (at(1024), at(97 * 1024));
        assert!(shallow > 70.0 && shallow < 80.0, "{shallow}");
        assert!(deep > 5.0 * shallow, "{shallow} {deep}");
        // And a 45 ms step budget takes far fewer tokens deep into the prompt.
        let end = |s: u32| {
            let b = ChunkBounds {
                start: s,
                upper: s + 8192,
                total: s + 100_000,
                align: 16,
            };
            m.max_chunk_end(&StepFeatures::EMPTY, b, 45.0).unwrap() - s
        };
        assert!(
            end(0) > 500 && end(97 * 1024) < 100,
            "{} {}",
            end(0),
            end(97 * 1024)
        );
    }
}
