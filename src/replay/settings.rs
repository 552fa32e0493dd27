//! The `[replay]` settings, checked once, here (`docs/config.md#replay`): `check` and `replay`
//! both call [`check`], so any config `check` accepts, `replay` runs. Every number is bounded so
//! that every simulated time stays finite.

use crate::config::ReplaySection;
use crate::latency::LatencyModel;
use crate::latency_presets;
use crate::manifest::Manifest;

use super::{trace, DECODE_WALK, PREFILL_WALK};

/// The most milliseconds any `replay.cost` coefficient may be: with token counts bounded by the
/// trace limits (and so attention pairs below 2^47 a chunk), every step time and sum of them
/// stays finite.
pub const MAX_COST_MS: f64 = 1e6;
/// `replay.cost.noise` lies in `[0, MAX_NOISE]`: a step always takes some time.
pub const MAX_NOISE: f64 = 0.9;
/// The built-in step cost: 8 ms a step, 0.02 ms a token, no KV or attention term.
pub const DEFAULT_COST: [f64; 4] = [8.0, 0.02, 0.0, 0.0];
/// The most speculative tokens per decode row.
pub const MAX_SPEC_TOKENS: u32 = 1024;
/// `--rate-scale` lies in `[1 / MAX_RATE_SCALE, MAX_RATE_SCALE]`, so scaled arrivals stay finite.
pub const MAX_RATE_SCALE: f64 = 1e6;

/// Where and how replay steps: the node, the step walks, and the simulation knobs, checked.
#[derive(Debug, Clone, PartialEq)]
pub struct Setup {
    /// The node replay drives.
    pub node: String,
    /// One combined walk, or `prefill` and `decode` taken in turn.
    pub walks: Vec<String>,
    /// What a simulated step costs (`docs/cost-model.md`): the truth the component plans
    /// against, or learns.
    pub cost: LatencyModel,
    /// Where the cost came from: a preset's name, or `None` for coefficients.
    pub cost_preset: Option<String>,
    /// Simulated step times are multiplied by a factor from `[1 - noise, 1 + noise]`.
    pub noise: f64,
    /// Whether the component learns the cost online instead of being given it.
    pub learn: bool,
    /// Speculative tokens per decode row (0: plain decode).
    pub spec_tokens: u32,
    /// The probability a speculating row overshoots its estimate.
    pub overshoot_rate: f64,
    /// The seed of the overshoot draws.
    pub seed: u64,
    /// Prefix cache blocks (0: off).
    pub cache_blocks: usize,
    /// Tokens per prefix cache block.
    pub cache_block_tokens: u32,
}

/// One refused `[replay]` setting: its key (`replay.cost.base_ms`, or `walks`/`nodes` of the
/// model), the value as written, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SettingProblem {
    /// The dotted key.
    pub key: &'static str,
    /// The value as written, when there is one to show.
    pub value: Option<String>,
    /// Why it was refused.
    pub reason: String,
}

/// A number as a user would write it: exponent notation when very large or small.
fn float(v: f64) -> String {
    let a = v.abs();
    if a.is_finite() && a != 0.0 && !(1e-6..1e16).contains(&a) {
        format!("{v:e}")
    } else {
        v.to_string()
    }
}

fn names<'a>(it: impl Iterator<Item = &'a String>) -> String {
    let v: Vec<String> = it.take(16).map(|n| format!("`{n}`")).collect();
    if v.is_empty() {
        "none".into()
    } else {
        v.join(", ")
    }
}

/// Checks `[replay]` against the model and resolves it into a [`Setup`].
///
/// # Errors
/// Every problem: a node or walk the model does not have, a model without `prefill` and
/// `decode`, a walk that is not a combined walk of both, a cost that is negative, not finite,
/// above [`MAX_COST_MS`] or zero in total, an overshoot rate outside `[0, 1]`, more than
/// [`MAX_SPEC_TOKENS`] speculative tokens, or a prefix cache block size other than the trace's.
pub fn check(manifest: &Manifest, r: &ReplaySection) -> Result<Setup, Vec<SettingProblem>> {
    let mut problems = Vec::new();
    let mut refuse = |key, value: Option<String>, reason: String| {
        problems.push(SettingProblem { key, value, reason });
    };
    let quote = |s: &str| Some(crate::config::problem::quote(s));
    let node = match &r.node {
        Some(n) if manifest.nodes.contains_key(n) => Some(n.clone()),
        Some(n) => {
            refuse(
                "replay.node",
                quote(n),
                format!(
                    "is not a node of model `{}` (it has {})",
                    manifest.name,
                    names(manifest.nodes.keys())
                ),
            );
            None
        }
        None => manifest.first_node().map(str::to_owned),
    };
    for w in [PREFILL_WALK, DECODE_WALK] {
        if !manifest.walks.iter().any(|m| m == w) {
            refuse(
                "walks",
                None,
                format!(
                    "of model `{}` must include `{w}`: replay admits prompts on `prefill` and generates on `decode` (the model has {})",
                    manifest.name,
                    names(manifest.walks.iter())
                ),
            );
        }
    }
    let walk = r.walk.as_deref().or_else(|| manifest.combined_walk());
    let walks = match walk {
        None => vec![PREFILL_WALK.to_owned(), DECODE_WALK.to_owned()],
        Some(w) => match manifest.combined_walks.get(w) {
            None => {
                refuse(
                    "replay.walk",
                    quote(w),
                    format!(
                        "is not a combined walk of model `{}` (it has {}); unset it to alternate `prefill` and `decode`",
                        manifest.name,
                        names(manifest.combined_walks.keys())
                    ),
                );
                Vec::new()
            }
            Some(members) => {
                for m in [PREFILL_WALK, DECODE_WALK] {
                    if !members.iter().any(|x| x == m) {
                        refuse(
                            "replay.walk",
                            quote(w),
                            format!(
                                "has member walks {}, which do not include `{m}`",
                                names(members.iter())
                            ),
                        );
                    }
                }
                vec![w.to_owned()]
            }
        },
    };
    let cost = check_cost(&r.cost, &mut refuse);
    let s = r.speculation;
    if !(0.0..=1.0).contains(&s.overshoot_rate) {
        refuse(
            "replay.speculation.overshoot_rate",
            Some(float(s.overshoot_rate)),
            "must be a probability from 0 to 1".into(),
        );
    }
    if s.tokens > MAX_SPEC_TOKENS {
        refuse(
            "replay.speculation.tokens",
            Some(s.tokens.to_string()),
            format!("must be at most {MAX_SPEC_TOKENS}"),
        );
    }
    let p = r.prefix_cache;
    if p.blocks > 0 && p.block_tokens != trace::HASH_BLOCK_TOKENS {
        refuse(
            "replay.prefix_cache.block_tokens",
            Some(p.block_tokens.to_string()),
            format!(
                "must be {} (the tokens one trace block hash covers) while the cache is on; set `blocks = 0` to turn it off",
                trace::HASH_BLOCK_TOKENS
            ),
        );
    }
    match node {
        Some(node) if problems.is_empty() => Ok(Setup {
            node,
            walks,
            cost: cost.expect("checked: no problem"),
            cost_preset: r.cost.preset.clone(),
            noise: r.cost.noise,
            learn: r.cost.learn,
            spec_tokens: s.tokens,
            overshoot_rate: s.overshoot_rate,
            seed: s.seed,
            cache_blocks: p.blocks as usize,
            cache_block_tokens: p.block_tokens,
        }),
        _ => Err(problems),
    }
}

/// Checks `[replay] cost` and resolves its model: a known preset or coefficients (not both),
/// each coefficient a finite number of ms in `[0, MAX_COST_MS]`, not all 0, and a noise in
/// `[0, MAX_NOISE]`.
fn check_cost(
    c: &crate::config::CostSection,
    refuse: &mut impl FnMut(&'static str, Option<String>, String),
) -> Option<LatencyModel> {
    if !(c.noise.is_finite() && (0.0..=MAX_NOISE).contains(&c.noise)) {
        refuse(
            "replay.cost.noise",
            Some(float(c.noise)),
            format!("must be a fraction from 0 to {MAX_NOISE}"),
        );
    }
    let given = [
        ("replay.cost.base_ms", c.base_ms),
        ("replay.cost.per_token_ms", c.per_token_ms),
        ("replay.cost.per_kv_token_ms", c.per_kv_token_ms),
        ("replay.cost.per_attention_pair_ms", c.per_attention_pair_ms),
    ];
    if let Some(name) = &c.preset {
        if given.iter().any(|(_, v)| v.is_some()) {
            refuse(
                "replay.cost.preset",
                Some(crate::config::problem::quote(name)),
                "names the coefficients itself: set either `preset` or coefficients, not both"
                    .into(),
            );
            return None;
        }
        let model = latency_presets::preset_model(name);
        if model.is_none() {
            refuse(
                "replay.cost.preset",
                Some(crate::config::problem::quote(name)),
                format!(
                    "is not a latency model preset (presets: {})",
                    latency_presets::preset_names()
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            );
        }
        return model;
    }
    let mut coefficients = DEFAULT_COST;
    let mut ok = true;
    for (i, (key, v)) in given.into_iter().enumerate() {
        let Some(v) = v else { continue };
        if !(v.is_finite() && (0.0..=MAX_COST_MS).contains(&v)) {
            refuse(
                key,
                Some(float(v)),
                format!("must be a number of milliseconds from 0 to {MAX_COST_MS:e}"),
            );
            ok = false;
        }
        coefficients[i] = v;
    }
    if ok && coefficients[..2] == [0.0, 0.0] {
        refuse(
            "replay.cost",
            None,
            "must make a step take some time: `base_ms` and `per_token_ms` are both 0".into(),
        );
        ok = false;
    }
    ok.then(|| LatencyModel::from_coefficients(coefficients).ok())
        .flatten()
}

/// Checks `--rate-scale`: a finite number in `[1 / MAX_RATE_SCALE, MAX_RATE_SCALE]`.
///
/// # Errors
/// The reason, for any other number.
pub fn check_rate_scale(x: f64) -> Result<f64, String> {
    if x.is_finite() && (1.0 / MAX_RATE_SCALE..=MAX_RATE_SCALE).contains(&x) {
        Ok(x)
    } else {
        Err(format!(
            "`--rate-scale` must be a number from {:e} to {MAX_RATE_SCALE:e}, got {x}",
            1.0 / MAX_RATE_SCALE
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Settings;

    fn model() -> Manifest {
        Manifest::from_toml(
            r#"
            name = "m"
            walks = ["prefill", "decode", "mixed", "other"]
            [combined_walks]
            mixed = ["prefill", "decode"]
            [nodes.b]
            [nodes.a]
            "#,
            "m.toml",
        )
        .unwrap()
    }

    #[test]
    fn defaults_take_the_first_node_in_the_file_and_the_combined_walk() {
        let s = check(&model(), &Settings::default().replay).unwrap();
        assert_eq!(
            (s.node.as_str(), s.walks.as_slice()),
            ("b", &["mixed".to_owned()][..])
        );
        assert_eq!(
            (s.cost.coefficients(), s.spec_tokens, s.noise, s.learn),
            (DEFAULT_COST, 0, 0.0, false)
        );
    }

    #[test]
    fn every_problem_is_listed_with_its_key() {
        let mut r = Settings::default().replay;
        r.node = Some("ghost".into());
        r.walk = Some("decode".into());
        r.cost.base_ms = Some(1.7e308);
        r.cost.per_token_ms = Some(f64::NAN);
        r.speculation.tokens = MAX_SPEC_TOKENS + 1;
        r.speculation.overshoot_rate = f64::INFINITY;
        r.prefix_cache.blocks = 1;
        r.prefix_cache.block_tokens = 16;
        let keys: Vec<&str> = check(&model(), &r)
            .unwrap_err()
            .iter()
            .map(|p| p.key)
            .collect();
        assert_eq!(
            keys,
            [
                "replay.node",
                "replay.walk",
                "replay.cost.base_ms",
                "replay.cost.per_token_ms",
                "replay.speculation.overshoot_rate",
                "replay.speculation.tokens",
                "replay.prefix_cache.block_tokens"
            ]
        );
        let mut r = Settings::default().replay;
        r.cost.base_ms = Some(0.0);
        r.cost.per_token_ms = Some(0.0);
        assert_eq!(check(&model(), &r).unwrap_err()[0].key, "replay.cost");
        r.cost.base_ms = Some(MAX_COST_MS);
        assert!(check(&model(), &r).is_ok());
        r.cost.noise = 1.0;
        assert_eq!(check(&model(), &r).unwrap_err()[0].key, "replay.cost.noise");
    }

    #[test]
    fn a_preset_names_the_cost_and_excludes_coefficients() {
        let mut r = Settings::default().replay;
        r.cost.preset = Some("llama2-7b-h100".into());
        let s = check(&model(), &r).unwrap();
        assert_eq!(
            Some(s.cost),
            crate::latency_presets::preset_model("llama2-7b-h100")
        );
        r.cost.base_ms = Some(1.0);
        assert_eq!(
            check(&model(), &r).unwrap_err()[0].key,
            "replay.cost.preset"
        );
        r.cost.base_ms = None;
        r.cost.preset = Some("gpt-9".into());
        let p = &check(&model(), &r).unwrap_err()[0];
        assert!(p.reason.contains("llama2-7b-a100"), "{}", p.reason);
    }

    #[test]
    fn rate_scale_is_bounded() {
        assert_eq!(check_rate_scale(2.5), Ok(2.5));
        for bad in [0.0, -1.0, 1e-308, 1e308, f64::NAN, f64::INFINITY] {
            assert!(check_rate_scale(bad).is_err(), "{bad}");
        }
    }
}
