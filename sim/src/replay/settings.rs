//! The `[replay]` settings, checked once, here (`docs/config-replay.md`): `check` and `replay`
//! both call [`check`], so any config `check` accepts, `replay` runs. Every number is bounded so
//! that every simulated time stays finite.

use crate::config::ReplaySection;
use mstar_chunking::latency::presets;
use mstar_chunking::latency::{LatencyModel, TERMS};
use mstar_chunking::manifest::Manifest;

use super::{trace, DECODE_WALK, PREFILL_WALK};
use crate::text::float;

/// The most milliseconds any `replay.cost` coefficient may be: with token counts bounded by the
/// trace limits (and so attention pairs below 2^47 a chunk), every step time and sum of them
/// stays finite.
pub const MAX_COST_MS: f64 = mstar_chunking::latency::MAX_COEFFICIENT_MS;
/// `replay.cost.noise` lies in `[0, MAX_NOISE]`: a step always takes some time.
pub const MAX_NOISE: f64 = 0.9;
/// Each ratio of `replay.cost.noise_bands` lies in this range: a step takes some time, and at
/// most a hundred times its price.
pub const NOISE_RATIO_RANGE: std::ops::RangeInclusive<f64> = 0.01..=100.0;
/// A band of `replay.cost.noise_bands` holds from 2 to this many ratios (`fit --for replay`
/// writes 101, one a percentile).
pub const MAX_NOISE_RATIOS: usize = 1001;
/// `replay.cost.noise_bands` holds from 1 to this many bands.
pub const MAX_NOISE_BANDS: usize = 64;
/// The built-in step cost: 8 ms a step, 0.02 ms a token, no KV or attention term.
pub const DEFAULT_COST: [f64; 4] = [8.0, 0.02, 0.0, 0.0];
/// The most speculative tokens per decode row.
pub const MAX_SPEC_TOKENS: u32 = 1024;
/// `--rate-scale` lies in `[1 / MAX_RATE_SCALE, MAX_RATE_SCALE]`, so scaled arrivals stay finite.
pub const MAX_RATE_SCALE: f64 = 1e6;

/// Where and how replay steps: the node, the step walks, and the simulation knobs, checked.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplaySetup {
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
    /// Or by a factor drawn from the measured ÷ predicted ratios of the band a step's price
    /// falls in (checked by [`check`]).
    pub noise_bands: Option<std::sync::Arc<[crate::config::NoiseBand]>>,
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
    /// The KV-cache memory (`[replay.kv]`); `None`: unlimited.
    pub kv: Option<KvSetup>,
    /// The workers and their router (`[replay.fleet]`); one worker by default.
    pub fleet: super::topology::FleetSetup,
}

/// The KV pool a replay simulates (`docs/kv-memory.md`), resolved from `[replay.kv]`.
#[derive(Debug, Clone, PartialEq)]
pub struct KvSetup {
    /// Blocks in the pool.
    pub blocks: u64,
    /// Tokens per block.
    pub block_tokens: u32,
    /// The fraction of the blocks admission keeps free.
    pub watermark: f64,
    /// Where the blocks came from: `blocks`, a preset's name, or the memory budget, as text.
    pub source: String,
}

impl KvSetup {
    /// The watermark in blocks: `floor(watermark × blocks)`.
    pub fn watermark_blocks(&self) -> u64 {
        (self.watermark * self.blocks as f64).floor() as u64
    }
}

/// The default tokens per KV block (vLLM's default block size).
pub const DEFAULT_KV_BLOCK_TOKENS: u32 = 16;
/// The most tokens per KV block.
pub const MAX_KV_BLOCK_TOKENS: u32 = 1 << 16;
/// The most KV blocks a pool may have (2^40: far beyond any GPU, and the sums stay exact).
pub const MAX_KV_BLOCKS: u64 = 1 << 40;
/// The default watermark (vLLM V0's and Vidur's 1% of the blocks).
pub const DEFAULT_KV_WATERMARK: f64 = 0.01;
/// The highest watermark: admission keeps at most half the pool free.
pub const MAX_KV_WATERMARK: f64 = 0.5;
/// The default `memory_utilization` (vLLM's `gpu_memory_utilization`).
pub const DEFAULT_MEMORY_UTILIZATION: f64 = 0.9;
/// The most GiB a memory size (`gpu_memory_gb`, `weights_gb`) may be.
pub const MAX_MEMORY_GB: f64 = 1e6;
/// The most bytes of KV one token may hold.
pub const MAX_KV_BYTES_PER_TOKEN: f64 = 1e12;

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

fn names<'a>(it: impl Iterator<Item = &'a String>) -> String {
    let v: Vec<String> = it.take(16).map(|n| format!("`{n}`")).collect();
    if v.is_empty() {
        "none".into()
    } else {
        v.join(", ")
    }
}

/// Checks `[replay]` against the model and resolves it into a [`ReplaySetup`].
///
/// # Errors
/// Every problem: a node or walk the model does not have, a model without `prefill` and
/// `decode`, a walk that is not a combined walk of both, a cost that is negative, not finite,
/// above [`MAX_COST_MS`] or zero in total, an overshoot rate outside `[0, 1]`, more than
/// [`MAX_SPEC_TOKENS`] speculative tokens, or a prefix cache block size other than the trace's.
pub fn check(manifest: &Manifest, r: &ReplaySection) -> Result<ReplaySetup, Vec<SettingProblem>> {
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
    let kv = check_kv(&r.kv, &mut refuse);
    let mut fleet = super::topology::check_fleet(&r.fleet, &mut refuse);
    if let Some(pd) = &mut fleet.disagg {
        (pd.kv_bytes_per_token, pd.kv_bytes_source) = super::topology::resolve_kv_bytes(r);
    }
    match node {
        Some(node) if problems.is_empty() => Ok(ReplaySetup {
            node,
            walks,
            cost: cost.expect("checked: no problem"),
            cost_preset: r.cost.preset.clone(),
            noise: r.cost.noise,
            noise_bands: r.cost.noise_bands.as_deref().map(std::sync::Arc::from),
            learn: r.cost.learn,
            spec_tokens: s.tokens,
            overshoot_rate: s.overshoot_rate,
            seed: s.seed,
            cache_blocks: p.blocks as usize,
            cache_block_tokens: p.block_tokens,
            kv,
            fleet,
        }),
        _ => Err(problems),
    }
}

/// The ratio at `u` (in `[0, 1)`) of the quantiles `ratios` (at least two, evenly spaced from
/// the least to the largest): linear between the two quantiles around it, so a uniform `u`
/// draws from the distribution they describe.
pub(crate) fn ratio_at(ratios: &[f64], u: f64) -> f64 {
    let at = u.clamp(0.0, 1.0) * (ratios.len() - 1) as f64;
    let i = (at.floor() as usize).min(ratios.len() - 2);
    let frac = at - i as f64;
    ratios[i] + (ratios[i + 1] - ratios[i]) * frac
}

/// The factor a step priced at `predicted_ms` takes from `bands` for the uniform draw `u`: the
/// ratio at `u` of the first band whose `up_to_ms` is above the price (else the last band's).
pub(crate) fn noise_factor(bands: &[crate::config::NoiseBand], predicted_ms: f64, u: f64) -> f64 {
    let band = bands
        .iter()
        .find(|b| b.up_to_ms.is_some_and(|up| predicted_ms < up))
        .or(bands.last());
    band.map_or(1.0, |b| ratio_at(&b.ratios, u))
}

/// Checks `replay.cost.noise_bands`: 1 to [`MAX_NOISE_BANDS`] bands, each but the last with an
/// `up_to_ms` above the one before (finite, above 0), the last with none; each band 2 to
/// [`MAX_NOISE_RATIOS`] finite ratios in [`NOISE_RATIO_RANGE`], non-decreasing (they are
/// quantiles); and no `noise` band beside them.
fn check_noise_bands(
    bands: &[crate::config::NoiseBand],
    noise: f64,
    refuse: &mut impl FnMut(&'static str, Option<String>, String),
) {
    const KEY: &str = "replay.cost.noise_bands";
    if !(1..=MAX_NOISE_BANDS).contains(&bands.len()) {
        refuse(
            KEY,
            Some(format!("{} bands", bands.len())),
            format!("must hold from 1 to {MAX_NOISE_BANDS} bands"),
        );
        return;
    }
    if noise > 0.0 {
        refuse(
            KEY,
            None,
            "cannot go with `replay.cost.noise`: a step's time has one noise factor; set one of them".into(),
        );
    }
    let mut below = 0.0;
    for (b, band) in bands.iter().enumerate() {
        let name = format!("band {} (from 1)", b + 1);
        let last = b + 1 == bands.len();
        match (band.up_to_ms, last) {
            (Some(up), false) if up.is_finite() && up > below => below = up,
            (Some(up), false) => refuse(
                KEY,
                Some(float(up)),
                format!("{name}: `up_to_ms` must be a finite number of ms above the band before it ({})", float(below)),
            ),
            (None, false) => refuse(
                KEY,
                None,
                format!("{name}: every band but the last names its `up_to_ms`"),
            ),
            (Some(up), true) => refuse(
                KEY,
                Some(float(up)),
                format!("{name}: the last band holds every step priced above the ones before it, so it names no `up_to_ms`"),
            ),
            (None, true) => {}
        }
        let ratios = &band.ratios;
        if !(2..=MAX_NOISE_RATIOS).contains(&ratios.len()) {
            refuse(
                KEY,
                Some(format!("{} ratios", ratios.len())),
                format!("{name}: must hold from 2 to {MAX_NOISE_RATIOS} ratios (quantiles from the least to the largest)"),
            );
            continue;
        }
        if let Some((i, &v)) = ratios
            .iter()
            .enumerate()
            .find(|(_, v)| !(v.is_finite() && NOISE_RATIO_RANGE.contains(v)))
        {
            refuse(
                KEY,
                Some(float(v)),
                format!(
                    "{name}: ratio {} (from 1) must be a finite ratio from {} to {}",
                    i + 1,
                    NOISE_RATIO_RANGE.start(),
                    NOISE_RATIO_RANGE.end()
                ),
            );
            continue;
        }
        if let Some(i) = ratios.windows(2).position(|w| w[1] < w[0]) {
            refuse(
                KEY,
                Some(float(ratios[i + 1])),
                format!(
                    "{name}: ratio {} (from 1) is less than the one before it ({}): the ratios are quantiles, least first",
                    i + 2,
                    float(ratios[i])
                ),
            );
        }
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
    if let Some(bands) = &c.noise_bands {
        check_noise_bands(bands, c.noise, refuse);
    }
    let given = [
        ("replay.cost.base_ms", c.base_ms),
        ("replay.cost.per_token_ms", c.per_token_ms),
        ("replay.cost.per_kv_token_ms", c.per_kv_token_ms),
        ("replay.cost.per_attention_pair_ms", c.per_attention_pair_ms),
        ("replay.cost.per_row_ms", c.per_row_ms),
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
        let model = presets::preset_model(name);
        if model.is_none() {
            refuse(
                "replay.cost.preset",
                Some(crate::config::problem::quote(name)),
                format!(
                    "is not a latency model preset (presets: {})",
                    presets::preset_names().collect::<Vec<_>>().join(", ")
                ),
            );
        }
        return model;
    }
    let mut coefficients = [0.0; TERMS];
    coefficients[..4].copy_from_slice(&DEFAULT_COST);
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
    ok.then(|| LatencyModel::from_terms(coefficients).ok())
        .flatten()
}

/// Checks `[replay.kv]` and resolves its pool: `blocks`, or a `preset`, or a memory budget
/// (`gpu_memory_gb`, `weights_gb` and `kv_bytes_per_token`, with `memory_utilization`), one of
/// the three at most; nothing: unlimited (`None`). Every value finite and in range, and at
/// least one block left for the KV cache.
fn check_kv(
    k: &crate::config::KvSection,
    refuse: &mut impl FnMut(&'static str, Option<String>, String),
) -> Option<KvSetup> {
    let mut ok = true;
    let block_tokens = k.block_tokens.unwrap_or(DEFAULT_KV_BLOCK_TOKENS);
    if !(1..=MAX_KV_BLOCK_TOKENS).contains(&block_tokens) {
        refuse(
            "replay.kv.block_tokens",
            Some(block_tokens.to_string()),
            format!("must be a whole number of tokens from 1 to {MAX_KV_BLOCK_TOKENS}"),
        );
        ok = false;
    }
    let watermark = k.watermark.unwrap_or(DEFAULT_KV_WATERMARK);
    if !(watermark.is_finite() && (0.0..=MAX_KV_WATERMARK).contains(&watermark)) {
        refuse(
            "replay.kv.watermark",
            Some(float(watermark)),
            format!("must be a fraction of the blocks from 0 to {MAX_KV_WATERMARK}"),
        );
        ok = false;
    }
    let utilization = k.memory_utilization.unwrap_or(DEFAULT_MEMORY_UTILIZATION);
    if !(utilization.is_finite() && utilization > 0.0 && utilization <= 1.0) {
        refuse(
            "replay.kv.memory_utilization",
            Some(float(utilization)),
            "must be a fraction of GPU memory above 0 and at most 1".into(),
        );
        ok = false;
    }
    let memory_keys = [
        ("replay.kv.gpu_memory_gb", k.gpu_memory_gb),
        ("replay.kv.weights_gb", k.weights_gb),
        ("replay.kv.kv_bytes_per_token", k.kv_bytes_per_token),
    ];
    let memory_given: Vec<&str> = memory_keys
        .iter()
        .filter(|(_, v)| v.is_some())
        .map(|(key, _)| *key)
        .collect();
    let memory_text = |keys: &[&str]| {
        keys.iter()
            .map(|key| format!("`{}`", key.trim_start_matches("replay.kv.")))
            .collect::<Vec<_>>()
            .join(", ")
    };
    if let Some(b) = k.blocks {
        if k.preset.is_some() || !memory_given.is_empty() || k.memory_utilization.is_some() {
            let mut others: Vec<&str> = memory_given.clone();
            if k.preset.is_some() {
                others.insert(0, "replay.kv.preset");
            }
            if k.memory_utilization.is_some() {
                others.push("replay.kv.memory_utilization");
            }
            refuse(
                "replay.kv.blocks",
                Some(b.to_string()),
                format!(
                    "sizes the pool itself: set either `blocks` or a memory budget, not both (also set: {})",
                    memory_text(&others)
                ),
            );
            return None;
        }
        if !(1..=MAX_KV_BLOCKS).contains(&b) {
            refuse(
                "replay.kv.blocks",
                Some(b.to_string()),
                format!("must be a whole number of blocks from 1 to {MAX_KV_BLOCKS}"),
            );
            return None;
        }
        return ok.then(|| KvSetup {
            blocks: b,
            block_tokens,
            watermark,
            source: format!("{b} blocks"),
        });
    }
    let (budget, source) = if let Some(name) = &k.preset {
        if !memory_given.is_empty() {
            refuse(
                "replay.kv.preset",
                Some(crate::config::problem::quote(name)),
                format!(
                    "names the memory budget itself: set either `preset` or {}, not both",
                    memory_text(&memory_given)
                ),
            );
            return None;
        }
        let Some(p) = super::kv::memory_preset(name) else {
            refuse(
                "replay.kv.preset",
                Some(crate::config::problem::quote(name)),
                format!(
                    "is not a KV memory preset (presets: {})",
                    super::kv::MEMORY_PRESETS
                        .iter()
                        .map(|p| p.name)
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            );
            return None;
        };
        let mut b = p.budget;
        b.memory_utilization = utilization;
        (b, format!("preset {name}"))
    } else if memory_given.is_empty() {
        // No limit: unlimited memory, whatever `block_tokens`, `watermark` or
        // `memory_utilization` say (they were checked all the same).
        return None;
    } else {
        let missing: Vec<&str> = memory_keys
            .iter()
            .filter(|(_, v)| v.is_none())
            .map(|(key, _)| *key)
            .collect();
        if let Some(first) = missing.first() {
            refuse(
                first,
                None,
                format!(
                    "is needed with {}: a memory budget takes `gpu_memory_gb`, `weights_gb` and `kv_bytes_per_token` (or use `blocks` or a `preset`)",
                    memory_text(&memory_given)
                ),
            );
            return None;
        }
        let (g, w, t) = (
            k.gpu_memory_gb.unwrap_or(0.0),
            k.weights_gb.unwrap_or(0.0),
            k.kv_bytes_per_token.unwrap_or(0.0),
        );
        for (key, v, lo_open, hi) in [
            ("replay.kv.gpu_memory_gb", g, true, MAX_MEMORY_GB),
            ("replay.kv.weights_gb", w, false, MAX_MEMORY_GB),
            (
                "replay.kv.kv_bytes_per_token",
                t,
                true,
                MAX_KV_BYTES_PER_TOKEN,
            ),
        ] {
            let lo_ok = if lo_open { v > 0.0 } else { v >= 0.0 };
            if !(v.is_finite() && lo_ok && v <= hi) {
                refuse(
                    key,
                    Some(float(v)),
                    format!(
                        "must be a number {} and at most {hi:e}",
                        if lo_open { "above 0" } else { "from 0" }
                    ),
                );
                ok = false;
            }
        }
        if !ok {
            return None;
        }
        (
            super::kv::MemoryBudget {
                gpu_memory_gb: g,
                memory_utilization: utilization,
                weights_gb: w,
                kv_bytes_per_token: t,
            },
            format!("{g} GiB × {utilization} − {w} GiB weights, {t} B per token"),
        )
    };
    if !ok {
        return None;
    }
    let blocks = budget.blocks(block_tokens).min(MAX_KV_BLOCKS);
    if blocks == 0 {
        refuse(
            "replay.kv",
            None,
            format!(
                "leaves no KV block: {} GiB × {} − {:.3} GiB of weights leaves {:.3} GiB, less than one block of {block_tokens} tokens × {} B",
                budget.gpu_memory_gb,
                budget.memory_utilization,
                budget.weights_gb,
                budget.kv_bytes() / super::kv::GIB,
                budget.kv_bytes_per_token
            ),
        );
        return None;
    }
    Some(KvSetup {
        blocks,
        block_tokens,
        watermark,
        source,
    })
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

impl ReplaySetup {
    /// Resolves `[replay]` against the model ([`check`]).
    ///
    /// # Errors
    /// The first problem [`check`] finds.
    pub fn resolve(
        manifest: &Manifest,
        settings: &crate::config::Settings,
    ) -> Result<Self, super::error::ReplayError> {
        check(manifest, &settings.replay).map_err(|problems| {
            let p = problems.into_iter().next();
            super::error::ReplayError::Config {
                key: p.as_ref().map_or("replay", |p| p.key),
                problem: p.map_or_else(String::new, |p| match p.value {
                    Some(v) => format!("= {v}: {}", p.reason),
                    None => p.reason,
                }),
            }
        })
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

    fn band(up_to_ms: Option<f64>, ratios: &[f64]) -> crate::config::NoiseBand {
        crate::config::NoiseBand {
            up_to_ms,
            ratios: ratios.to_vec(),
        }
    }

    #[test]
    fn noise_bands_rise_hold_quantiles_in_range_and_exclude_the_noise_band() {
        let m = model();
        let with = |bands: Vec<crate::config::NoiseBand>, noise: f64| {
            let mut r = Settings::default().replay;
            r.cost.noise_bands = Some(bands);
            r.cost.noise = noise;
            check(&m, &r)
        };
        let bands = vec![
            band(Some(40.0), &[0.5, 1.0, 1.0, 4.0]),
            band(None, &[0.9, 1.1]),
        ];
        let s = with(bands.clone(), 0.0).unwrap();
        assert_eq!(s.noise_bands.as_deref(), Some(&bands[..]));
        assert_eq!(
            check(&m, &Settings::default().replay).unwrap().noise_bands,
            None
        );
        assert!(with(vec![band(None, &[0.01, 100.0])], 0.0).is_ok());
        assert!(with(vec![band(None, &vec![1.0; MAX_NOISE_RATIOS])], 0.0).is_ok());
        let refused = |bands: Vec<crate::config::NoiseBand>, noise: f64| {
            let problems = with(bands, noise).unwrap_err();
            assert_eq!(problems.len(), 1, "{problems:?}");
            assert_eq!(problems[0].key, "replay.cost.noise_bands");
            problems[0].reason.clone()
        };
        assert!(refused(vec![], 0.0).contains("from 1 to 64 bands"));
        assert!(
            refused(vec![band(None, &[1.0, 1.0]); MAX_NOISE_BANDS + 1], 0.0)
                .contains("from 1 to 64 bands")
        );
        assert!(refused(vec![band(None, &[1.0])], 0.0)
            .contains("band 1 (from 1): must hold from 2 to 1001"));
        assert!(
            refused(vec![band(None, &vec![1.0; MAX_NOISE_RATIOS + 1])], 0.0)
                .contains("from 2 to 1001")
        );
        assert!(refused(vec![band(None, &[1.0, f64::NAN])], 0.0).contains("ratio 2 "));
        assert!(refused(vec![band(None, &[0.0, 1.0])], 0.0).contains("ratio 1 "));
        assert!(refused(vec![band(None, &[1.0, 100.5])], 0.0).contains("ratio 2 "));
        let why = refused(
            vec![band(Some(9.0), &[1.0, 2.0]), band(None, &[1.0, 2.0, 1.5])],
            0.0,
        );
        assert!(
            why.starts_with("band 2 (from 1): ratio 3 ") && why.contains("least first"),
            "{why}"
        );
        assert!(refused(vec![band(None, &[1.0, 2.0])], 0.1).contains("replay.cost.noise"));
        // Every band but the last names a rising `up_to_ms`; the last names none.
        let why = refused(vec![band(None, &[1.0, 2.0]), band(None, &[1.0, 2.0])], 0.0);
        assert!(
            why.starts_with("band 1 (from 1): every band but the last"),
            "{why}"
        );
        let why = refused(vec![band(Some(5.0), &[1.0, 2.0])], 0.0);
        assert!(why.contains("the last band"), "{why}");
        for up in [0.0, -1.0, f64::INFINITY, f64::NAN] {
            let why = refused(
                vec![band(Some(up), &[1.0, 2.0]), band(None, &[1.0, 2.0])],
                0.0,
            );
            assert!(
                why.starts_with("band 1 (from 1): `up_to_ms` must be"),
                "{up}: {why}"
            );
        }
        let why = refused(
            vec![
                band(Some(5.0), &[1.0, 2.0]),
                band(Some(5.0), &[1.0, 2.0]),
                band(None, &[1.0, 2.0]),
            ],
            0.0,
        );
        assert!(
            why.starts_with("band 2 (from 1): `up_to_ms`") && why.contains("(5)"),
            "{why}"
        );
    }

    #[test]
    fn a_step_takes_its_factor_from_the_band_its_price_falls_in() {
        let bands = [
            band(Some(10.0), &[2.0, 2.0]),
            band(Some(100.0), &[3.0, 5.0]),
            band(None, &[0.5, 0.5]),
        ];
        assert_eq!(noise_factor(&bands, 0.5, 0.3), 2.0);
        assert_eq!(noise_factor(&bands, 9.99, 0.3), 2.0);
        assert_eq!(
            noise_factor(&bands, 10.0, 0.5),
            4.0,
            "at up_to_ms: the next band"
        );
        assert_eq!(noise_factor(&bands, 99.0, 1.0), 5.0);
        assert_eq!(noise_factor(&bands, 100.0, 0.9), 0.5);
        assert_eq!(noise_factor(&bands, 1e9, 0.1), 0.5);
        assert_eq!(noise_factor(&[], 5.0, 0.5), 1.0, "no band: no factor");
    }

    #[test]
    fn a_ratio_is_drawn_between_the_quantiles_around_it() {
        let r = [0.5, 1.0, 3.0];
        assert_eq!(ratio_at(&r, 0.0), 0.5);
        assert_eq!(ratio_at(&r, 0.25), 0.75);
        assert_eq!(ratio_at(&r, 0.5), 1.0);
        assert_eq!(ratio_at(&r, 0.75), 2.0);
        assert_eq!(ratio_at(&r, 1.0), 3.0);
        assert_eq!(ratio_at(&r, 7.0), 3.0, "clamped above");
        assert_eq!(ratio_at(&r, -1.0), 0.5, "clamped below");
        assert_eq!(ratio_at(&[2.0, 4.0], 0.5), 3.0);
    }

    #[test]
    fn a_preset_names_the_cost_and_excludes_coefficients() {
        let mut r = Settings::default().replay;
        r.cost.preset = Some("llama2-7b-h100".into());
        let s = check(&model(), &r).unwrap();
        assert_eq!(
            Some(s.cost),
            mstar_chunking::latency::presets::preset_model("llama2-7b-h100")
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
    fn kv_memory_is_unlimited_unless_sized_and_every_key_is_checked() {
        let m = model();
        let mut r = Settings::default().replay;
        assert_eq!(check(&m, &r).unwrap().kv, None);
        r.kv.block_tokens = Some(32);
        assert_eq!(check(&m, &r).unwrap().kv, None, "no limit: unlimited");
        r.kv.blocks = Some(1000);
        let kv = check(&m, &r).unwrap().kv.unwrap();
        assert_eq!(
            (kv.blocks, kv.block_tokens, kv.watermark_blocks()),
            (1000, 32, 10)
        );
        r.kv = Default::default();
        r.kv.preset = Some("llama2-7b-a100".into());
        let kv = check(&m, &r).unwrap().kv.unwrap();
        assert_eq!(
            (kv.blocks, kv.block_tokens, kv.source.as_str()),
            (7609, 16, "preset llama2-7b-a100")
        );
        r.kv.memory_utilization = Some(0.5);
        // 40 GiB − 12.551 GiB = 27.449 GiB / 8 MiB = 3513 blocks.
        assert_eq!(check(&m, &r).unwrap().kv.unwrap().blocks, 3513);
        r.kv = Default::default();
        r.kv.gpu_memory_gb = Some(24.0);
        r.kv.weights_gb = Some(8.0);
        r.kv.kv_bytes_per_token = Some(131_072.0);
        // 24 × 0.9 − 8 = 13.6 GiB / (128 KiB × 16) = 6963 blocks.
        assert_eq!(check(&m, &r).unwrap().kv.unwrap().blocks, 6963);

        let refused = |f: fn(&mut crate::config::KvSection)| {
            let mut r = Settings::default().replay;
            f(&mut r.kv);
            let p = check(&m, &r).unwrap_err();
            (p[0].key, p[0].reason.clone())
        };
        type Edit = fn(&mut crate::config::KvSection);
        let cases: [(Edit, &str, &str); 12] = [
            (|k| k.blocks = Some(0), "replay.kv.blocks", "from 1 to"),
            (
                |k| {
                    k.blocks = Some(10);
                    k.preset = Some("llama2-7b-a100".into())
                },
                "replay.kv.blocks",
                "not both (also set: `preset`)",
            ),
            (
                |k| {
                    k.blocks = Some(10);
                    k.weights_gb = Some(1.0)
                },
                "replay.kv.blocks",
                "`weights_gb`",
            ),
            (
                |k| k.block_tokens = Some(0),
                "replay.kv.block_tokens",
                "from 1 to 65536",
            ),
            (
                |k| k.watermark = Some(0.6),
                "replay.kv.watermark",
                "from 0 to 0.5",
            ),
            (
                |k| k.watermark = Some(f64::NAN),
                "replay.kv.watermark",
                "fraction",
            ),
            (
                |k| k.memory_utilization = Some(1.5),
                "replay.kv.memory_utilization",
                "at most 1",
            ),
            (
                |k| k.preset = Some("gpt-9".into()),
                "replay.kv.preset",
                "llama2-7b-h100",
            ),
            (
                |k| {
                    k.preset = Some("llama2-7b-a100".into());
                    k.gpu_memory_gb = Some(40.0)
                },
                "replay.kv.preset",
                "`gpu_memory_gb`",
            ),
            (
                |k| k.gpu_memory_gb = Some(80.0),
                "replay.kv.weights_gb",
                "is needed with `gpu_memory_gb`",
            ),
            (
                |k| {
                    k.gpu_memory_gb = Some(f64::INFINITY);
                    k.weights_gb = Some(1.0);
                    k.kv_bytes_per_token = Some(1.0)
                },
                "replay.kv.gpu_memory_gb",
                "above 0",
            ),
            (
                |k| {
                    k.gpu_memory_gb = Some(16.0);
                    k.weights_gb = Some(15.0);
                    k.kv_bytes_per_token = Some(524_288.0)
                },
                "replay.kv",
                "leaves no KV block",
            ),
        ];
        for (f, key, words) in cases {
            let (k, reason) = refused(f);
            assert_eq!(k, key, "{reason}");
            assert!(reason.contains(words), "{key}: {reason}");
        }
    }

    #[test]
    fn rate_scale_is_bounded() {
        assert_eq!(check_rate_scale(2.5), Ok(2.5));
        for bad in [0.0, -1.0, 1e-308, 1e308, f64::NAN, f64::INFINITY] {
            assert!(check_rate_scale(bad).is_err(), "{bad}");
        }
    }
}
