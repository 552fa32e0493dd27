//! Chunked prefill is exact. Prompts are cut by the real component
//! (`ChunkingManagement`, budgets 16/64/256 with an alignment, a floor and a prefix-cache start),
//! and the last token's logits and 32 greedy tokens are compared with a whole-prompt prefill.

use std::num::NonZeroU32;

use candle_core::Device;
use mstar_chunking::{
    BudgetSettings, ChunkingManagement, ChunkingPolicy, PreparedInput, RowWork, SubmoduleCaps,
};
use mstar_engine::model::{relative_diff, Config, KvCache, Model, StepRow};

/// The exactness bound: 1e-4 of the largest |logit|.
const TOLERANCE: f32 = 1e-4;

/// Prompt lengths from 1 to 2,000 tokens, around the budgets' and alignments' edges.
const LENGTHS: [usize; 8] = [1, 2, 15, 16, 17, 100, 511, 2000];

fn model() -> Model {
    Model::random(Config::tiny(), 7, &Device::Cpu).unwrap()
}

/// A deterministic prompt of `n` byte tokens (an LCG, so every run sees the same bytes).
fn prompt(n: usize, salt: u64) -> Vec<u32> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ salt;
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((x >> 33) % 256) as u32
        })
        .collect()
}

struct Case {
    budget: u32,
    align: u32,
    floor: u32,
    /// Tokens of each prompt served from a prefix cache: `len * cached_num / cached_den`.
    cached_fraction: (usize, usize),
}

const CASES: [Case; 3] = [
    Case {
        budget: 16,
        align: 1,
        floor: 4,
        cached_fraction: (0, 1),
    },
    Case {
        budget: 64,
        align: 8,
        floor: 16,
        cached_fraction: (1, 3),
    },
    Case {
        budget: 256,
        align: 16,
        floor: 64,
        cached_fraction: (1, 2),
    },
];

/// Runs `tokens` through the model as the component cuts them; returns the cache and the
/// final chunk's logits, and the chunk sizes it ran.
async fn chunked_prefill(
    cm: &ChunkingManagement,
    model: &Model,
    rid: u64,
    tokens: &[u32],
    cached: usize,
) -> (KvCache, Vec<f32>, Vec<u32>) {
    let mut cache = KvCache::new(model);
    if cached > 0 {
        // The prefix cache's part: the first `cached` tokens' keys and values, computed whole.
        model
            .step(&mut [StepRow {
                tokens: &tokens[..cached],
                cache: &mut cache,
                logits: false,
            }])
            .unwrap();
    }
    cm.admit(
        rid,
        "llm",
        "prefill",
        PreparedInput::tokens(tokens.to_vec()),
        cached as u32,
    )
    .await
    .unwrap();
    let mut sizes = Vec::new();
    loop {
        let batch = cm.assemble("llm", "prefill").await.unwrap();
        assert_eq!(batch.rows.len(), 1, "one prompt in flight");
        let row = &batch.rows[0];
        let RowWork::Chunk { range, .. } = row.work else {
            panic!("a prefill row is a chunk")
        };
        let input = row.input.as_ref().expect("a chunk carries its input");
        assert_eq!(input.range(), range.start as usize..range.end as usize);
        assert_eq!(cache.len(), range.start as usize, "chunks run in order");
        let out = model
            .step(&mut [StepRow {
                tokens: input.token_ids(),
                cache: &mut cache,
                logits: range.is_final(),
            }])
            .unwrap();
        sizes.push(range.tokens());
        cm.complete(batch.step, vec![range.tokens()], None)
            .await
            .unwrap();
        if range.is_final() {
            return (cache, out[0].clone().unwrap(), sizes);
        }
    }
}

#[test]
fn chunked_prefill_matches_whole_prefill_and_greedy_decode() {
    let model = model();
    let refs: Vec<_> = LENGTHS
        .iter()
        .map(|&n| {
            let p = prompt(n, n as u64);
            let (mut cache, logits) = model.prefill(&p).unwrap();
            let greedy = model.greedy(&mut cache, &logits, 32).unwrap();
            (p, logits, greedy)
        })
        .collect();
    actix::System::new().block_on(async {
        for case in &CASES {
            let cm = ChunkingManagement::start("exact", [("llm", SubmoduleCaps::new(["prefill"], false))])
                .unwrap();
            cm.set_policies([(
                ("llm", "prefill"),
                ChunkingPolicy::budget(case.budget).aligned(case.align),
            )])
            .await
            .unwrap();
            cm.set_budgets(
                BudgetSettings::new(["prefill"])
                    .min_chunk_tokens(NonZeroU32::new(case.floor).unwrap()),
            )
            .await
            .unwrap();
            for (rid, (p, want, want_greedy)) in refs.iter().enumerate() {
                let cached = p.len() * case.cached_fraction.0 / case.cached_fraction.1;
                let (mut cache, got, sizes) =
                    chunked_prefill(&cm, &model, rid as u64, p, cached).await;
                let what = format!(
                    "prompt of {} tokens, budget {}, align {}, floor {}, cached {cached}, chunks {sizes:?}",
                    p.len(),
                    case.budget,
                    case.align,
                    case.floor
                );
                assert!(
                    sizes.iter().all(|&s| s <= case.budget),
                    "{what}: a chunk over the budget"
                );
                if p.len() - cached > case.budget as usize {
                    assert!(sizes.len() > 1, "{what}: the prompt was cut");
                }
                let d = relative_diff(want, &got);
                assert!(d <= TOLERANCE, "{what}: logits differ by {d} of max |logit|");
                let greedy = model.greedy(&mut cache, &got, 32).unwrap();
                assert_eq!(&greedy, want_greedy, "{what}: greedy tokens differ");
                cm.forget_request(rid as u64).await.unwrap();
            }
            assert_eq!(cm.prepared_totals().await.unwrap(), (0, 0));
        }
    });
}

/// A step mixing chunk rows (first, middle and final chunks) and decode rows at different
/// contexts: every row's logits equal that row run alone, and so do the caches it leaves.
#[test]
fn mixed_step_rows_equal_each_row_alone() {
    let model = model();
    // Two decode rows (contexts 37 and 300) and three chunk rows (a first chunk, a middle chunk
    // at 128, a final chunk at 500).
    let mut specs: Vec<(KvCache, Vec<u32>)> = Vec::new();
    for (ctx, salt) in [(37usize, 1u64), (300, 2)] {
        let p = prompt(ctx, salt);
        let (cache, _) = model.prefill(&p).unwrap();
        specs.push((cache, vec![(salt * 31 % 256) as u32]));
    }
    for (start, n, salt) in [(0usize, 48usize, 3u64), (128, 64, 4), (500, 20, 5)] {
        let p = prompt(start + n, salt);
        let mut cache = KvCache::new(&model);
        if start > 0 {
            model
                .step(&mut [StepRow {
                    tokens: &p[..start],
                    cache: &mut cache,
                    logits: false,
                }])
                .unwrap();
        }
        specs.push((cache, p[start..].to_vec()));
    }
    let alone: Vec<(Vec<f32>, KvCache)> = specs
        .iter()
        .map(|(cache, toks)| {
            let mut c = cache.clone();
            let out = model
                .step(&mut [StepRow {
                    tokens: toks,
                    cache: &mut c,
                    logits: true,
                }])
                .unwrap();
            (out[0].clone().unwrap(), c)
        })
        .collect();
    let mut caches: Vec<KvCache> = specs.iter().map(|(c, _)| c.clone()).collect();
    let mut rows: Vec<StepRow<'_>> = caches
        .iter_mut()
        .zip(&specs)
        .map(|(cache, (_, toks))| StepRow {
            tokens: toks,
            cache,
            logits: true,
        })
        .collect();
    let mixed = model.step(&mut rows).unwrap();
    drop(rows);
    for (i, ((want, want_cache), got)) in alone.iter().zip(&mixed).enumerate() {
        let got = got.as_ref().expect("every row asked for logits");
        let d = relative_diff(want, got);
        assert!(
            d <= TOLERANCE,
            "row {i}: logits differ by {d} of max |logit|"
        );
        assert_eq!(caches[i].len(), want_cache.len(), "row {i}: cache length");
        // The caches they leave are equivalent: the next token gives the same logits.
        let next = [65u32];
        let a = model
            .step(&mut [StepRow {
                tokens: &next,
                cache: &mut want_cache.clone(),
                logits: true,
            }])
            .unwrap();
        let b = model
            .step(&mut [StepRow {
                tokens: &next,
                cache: &mut caches[i].clone(),
                logits: true,
            }])
            .unwrap();
        let d = relative_diff(a[0].as_ref().unwrap(), b[0].as_ref().unwrap());
        assert!(d <= TOLERANCE, "row {i}: the next step differs by {d}");
    }
    // Only rows that ask for logits get them.
    let mut c = specs[0].0.clone();
    let mut d = specs[2].0.clone();
    let out = model
        .step(&mut [
            StepRow {
                tokens: &specs[0].1,
                cache: &mut c,
                logits: true,
            },
            StepRow {
                tokens: &specs[2].1,
                cache: &mut d,
                logits: false,
            },
        ])
        .unwrap();
    assert!(out[0].is_some() && out[1].is_none());
}
