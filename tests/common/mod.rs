//! The facade setups and batch readers the public-API tests share (`tests/engine.rs`,
//! `tests/one_trip.rs`, `sim/tests/it/core.rs`). Each test binary uses only some of them.
#![allow(dead_code)]

use std::num::NonZeroU32;

use mstar_chunking::{
    Batch, BudgetSettings, ChunkRange, ChunkingManagement, ChunkingPolicy, PreparedInput, RowWork,
    SubmoduleCaps,
};

/// A facade for model `model` with one node `llm`: `prefill` and `decode` under `mixed`, a
/// budget of 256, align 16, floor 32.
pub async fn mixed_engine(model: &str) -> ChunkingManagement {
    let cm = ChunkingManagement::start(
        model,
        [("llm", SubmoduleCaps::new(["prefill", "mixed"], false))],
    )
    .unwrap();
    cm.set_policies([(("llm", "mixed"), ChunkingPolicy::budget(256).aligned(16))])
        .await
        .unwrap();
    let settings = BudgetSettings::new(["prefill", "decode", "mixed"])
        .combined("mixed", ["prefill", "decode"])
        .min_chunk_tokens(NonZeroU32::new(32).unwrap());
    cm.set_budgets(settings).await.unwrap();
    cm
}

/// A prompt of `len` tokens `0, 1, 2, ..`.
pub fn prompt(len: u32) -> PreparedInput {
    PreparedInput::tokens((0..len).collect::<Vec<u32>>())
}

/// `(rid, range)` of every chunk of a batch.
pub fn chunks(b: &Batch) -> Vec<(u64, ChunkRange)> {
    b.rows
        .iter()
        .filter_map(|r| match r.work {
            RowWork::Chunk { range, .. } => Some((r.rid, range)),
            RowWork::Continue { .. } => None,
        })
        .collect()
}

/// `rid` of every continuing row of a batch.
pub fn continuing(b: &Batch) -> Vec<u64> {
    b.rows
        .iter()
        .filter(|r| matches!(r.work, RowWork::Continue { .. }))
        .map(|r| r.rid)
        .collect()
}

/// The tokens each row of a batch is planned to run: what a step that ran as planned reports.
pub fn planned(b: &Batch) -> Vec<u32> {
    b.rows.iter().map(|r| r.tokens()).collect()
}
