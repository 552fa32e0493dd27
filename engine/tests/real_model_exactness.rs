//! Chunked prefill is exact on SmolLM2-135M-Instruct (weights as the engine serves them):
//! prompts of 300 and 1,000 tokens cut by the real component with budgets 16, 64 and 256 give
//! the last position's logits of a whole-prompt prefill within 1e-4 absolute and the same 64
//! greedy tokens; a step mixing decode rows beside chunks equals each row run alone.
//! The model comes from `make model`; a missing file fails, it is never skipped.
//! `ENGINE_EXACTNESS_PROMPTS=300,1000,2000` sets the prompt lengths: `make engine-bench` runs
//! the 2,000-token case too (in release; it is too long for `make test`).

use std::num::NonZeroU32;
use std::sync::OnceLock;

use candle_core::Device;
use mstar_chunking::{
    BudgetSettings, ChunkingManagement, ChunkingPolicy, PreparedInput, RowWork, SubmoduleCaps,
};
use mstar_engine::model::gguf::{self, DEFAULT_FORMAT};
use mstar_engine::model::{KvCache, Model, StepRow};

/// Absolute bound on any logit's difference.
const TOLERANCE: f32 = 1e-4;
const GREEDY: usize = 64;

fn model() -> &'static Model {
    static M: OnceLock<Model> = OnceLock::new();
    M.get_or_init(|| {
        let path = gguf::smollm2_path().unwrap_or_else(|e| panic!("{e}"));
        gguf::load(&path, &Device::Cpu, DEFAULT_FORMAT).unwrap_or_else(|e| panic!("{e}"))
    })
}

const TEXT: &str = "The harbour town wakes early. Fishing boats leave before dawn, and by seven \
the market along the quay is full of crates of mackerel, crab and mussels. Mrs. Alder, who has \
sold bread here for 31 years, says the season of 2023 was the best she remembers: \"We sold \
out every morning by ten.\" Visitors come for the cliffs, the lighthouse and the old chapel, \
whose bell was cast in 1714. ";

/// The prompt lengths: `ENGINE_EXACTNESS_PROMPTS` (comma-separated), else 300 and 1,000.
fn prompt_lengths() -> Vec<usize> {
    match std::env::var("ENGINE_EXACTNESS_PROMPTS") {
        Ok(v) => v
            .split(',')
            .map(|n| {
                let n: usize = n.trim().parse().unwrap_or_else(|e| {
                    panic!("ENGINE_EXACTNESS_PROMPTS=`{v}`: `{n}` is not a length ({e})")
                });
                assert!(
                    (17..=8000).contains(&n),
                    "ENGINE_EXACTNESS_PROMPTS: {n} is outside 17..=8000 (more than one chunk, \
                     room for the greedy tokens in the context)"
                );
                n
            })
            .collect(),
        Err(_) => vec![300, 1000],
    }
}

/// `n` tokens of English prose (the paragraph above, numbered and repeated).
fn prompt(n: usize) -> Vec<u32> {
    let tok = model().tokenizer();
    let mut out = Vec::new();
    let mut i = 0;
    while out.len() < n {
        out.extend(tok.encode(&format!("{i}. {TEXT}")).unwrap());
        i += 1;
    }
    out.truncate(n);
    out
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()))
}

/// Runs `tokens` as the component cuts them with `budget`; returns the cache, the final
/// chunk's logits and the chunk sizes.
async fn chunked_prefill(
    cm: &ChunkingManagement,
    rid: u64,
    tokens: &[u32],
) -> (KvCache, Vec<f32>, Vec<u32>) {
    let model = model();
    let mut cache = KvCache::new(model);
    cm.admit(
        rid,
        "llm",
        "prefill",
        PreparedInput::tokens(tokens.to_vec()),
        0,
    )
    .await
    .unwrap();
    let mut sizes = Vec::new();
    loop {
        let batch = cm.assemble("llm", "prefill").await.unwrap();
        let row = &batch.rows[0];
        let RowWork::Chunk { range, .. } = row.work else {
            panic!("a prefill row is a chunk")
        };
        let input = row.input.as_ref().expect("a chunk carries its input");
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
fn chunked_prefill_matches_whole_prefill_on_smollm2() {
    let model = model();
    let refs: Vec<_> = prompt_lengths()
        .into_iter()
        .map(|n| {
            let p = prompt(n);
            let (mut cache, logits) = model.prefill(&p).unwrap();
            let greedy = model.greedy(&mut cache, &logits, GREEDY).unwrap();
            (p, logits, greedy)
        })
        .collect();
    actix::System::new().block_on(async {
        for budget in [16u32, 64, 256] {
            let cm = ChunkingManagement::start(
                "exact",
                [("llm", SubmoduleCaps::new(["prefill"], false))],
            )
            .unwrap();
            cm.set_policies([(
                ("llm", "prefill"),
                ChunkingPolicy::budget(budget).aligned(16),
            )])
            .await
            .unwrap();
            cm.set_budgets(
                BudgetSettings::new(["prefill"]).min_chunk_tokens(NonZeroU32::new(16).unwrap()),
            )
            .await
            .unwrap();
            for (rid, (p, want, want_greedy)) in refs.iter().enumerate() {
                let (mut cache, got, sizes) = chunked_prefill(&cm, rid as u64, p).await;
                let what = format!("{} tokens, budget {budget}", p.len());
                assert!(sizes.iter().all(|&s| s <= budget), "{what}: {sizes:?}");
                assert!(sizes.len() > 1, "{what}: the prompt was cut");
                let d = max_abs_diff(want, &got);
                assert!(d <= TOLERANCE, "{what}: a logit differs by {d}");
                let greedy = model.greedy(&mut cache, &got, GREEDY).unwrap();
                assert_eq!(&greedy, want_greedy, "{what}: greedy tokens differ");
                cm.forget_request(rid as u64).await.unwrap();
            }
        }
    });
}

/// Two decode rows beside a middle chunk and a final chunk in one step: each row's logits
/// equal that row run alone.
#[test]
fn mixed_step_equals_each_row_alone_on_smollm2() {
    let model = model();
    let p = prompt(700);
    let mut specs: Vec<(KvCache, Vec<u32>)> = Vec::new();
    for ctx in [40usize, 300] {
        let (cache, _) = model.prefill(&p[..ctx]).unwrap();
        specs.push((cache, vec![p[ctx]]));
    }
    for (start, n) in [(128usize, 64usize), (500, 200)] {
        let mut cache = KvCache::new(model);
        model
            .step(&mut [StepRow {
                tokens: &p[..start],
                cache: &mut cache,
                logits: false,
            }])
            .unwrap();
        specs.push((cache, p[start..start + n].to_vec()));
    }
    let alone: Vec<Vec<f32>> = specs
        .iter()
        .map(|(cache, toks)| {
            let out = model
                .step(&mut [StepRow {
                    tokens: toks,
                    cache: &mut cache.clone(),
                    logits: true,
                }])
                .unwrap();
            out[0].clone().unwrap()
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
    for (i, (want, got)) in alone.iter().zip(&mixed).enumerate() {
        let d = max_abs_diff(want, got.as_ref().unwrap());
        assert!(d <= TOLERANCE, "row {i}: a logit differs by {d}");
    }
}
