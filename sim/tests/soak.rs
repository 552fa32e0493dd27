//! Soak: a long replay-like run of the bundled trace through the facade, with periodic config
//! reloads (valid and refused) and request aborts. At the end: nothing held, resident memory
//! flat, no panic. `MSTAR_SOAK_STEPS` sets the length (CI: 20,000; `make soak`: 1,000,000).

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use mstar_chunking::budget::{BudgetSettings, BudgetValue};
use mstar_chunking::manifest::Manifest;
use mstar_chunking::{ChunkingManagement, PreparedInput, RowWork};
use mstar_chunking_sim::config::{
    BudgetSetting, ChunkingSection, NodeBudgetSetting, DEMO_MANIFEST_TOML,
};
use mstar_chunking_sim::replay::trace::{ReadOptions, Trace};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// Prompts admitted but not finished are kept below this, so the run is a steady state.
const MAX_QUEUED_PROMPTS: usize = 48;
/// The soak stops after this long even if its steps are not done.
const TIME_LIMIT: Duration = Duration::from_secs(600);

/// The demo model's `set_budgets` arguments with `llm`'s budgets set to `budget`, as a config
/// layer would give them.
fn settings(demo: &Manifest, budget: u32, min_chunk: u32) -> BudgetSettings {
    let value = NodeBudgetSetting::All(BudgetSetting(
        BudgetValue::tokens(budget).unwrap_or(BudgetValue::Off),
    ));
    let chunking = ChunkingSection {
        min_chunk_tokens: min_chunk,
        max_batch_tokens: BTreeMap::from([("llm".to_owned(), value)]),
        ..ChunkingSection::default()
    };
    demo.budget_settings(&chunking)
}

/// Resident set size in bytes, from `/proc/self/statm`.
fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

#[test]
fn soak_with_reloads_and_aborts_holds_nothing_at_the_end() {
    let steps: u64 = std::env::var("MSTAR_SOAK_STEPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20_000);
    let trace = Trace::bundled(ReadOptions::default()).expect("bundled trace");
    actix::System::new().block_on(async move {
        let demo = Manifest::from_toml(DEMO_MANIFEST_TOML, "demo").expect("the demo manifest");
        let cm = ChunkingManagement::start("test", demo.submodules()).unwrap();
        cm.set_policies(demo.policies()).await.unwrap();
        cm.set_budgets(settings(&demo, 2048, 64)).await.unwrap();
        let mut rng = SmallRng::seed_from_u64(7);
        let mut next = 0usize;
        let mut next_rid = 0u64;
        // rid -> generated tokens still to come, for rows past their prefill.
        let mut decoding: HashMap<u64, u32> = HashMap::new();
        // rid -> generated tokens, for prompts still prefilling.
        let mut prefilling: HashMap<u64, u32> = HashMap::new();
        let mut budget = 2048;
        let (mut aborted, mut reloads, mut refused) = (0u64, 0u64, 0u64);
        let mut rss_early = 0;
        let started = Instant::now();
        let mut step = 0u64;
        while step < steps && started.elapsed() < TIME_LIMIT {
            while prefilling.len() < MAX_QUEUED_PROMPTS {
                let r = &trace.requests[next % trace.requests.len()];
                next += 1;
                let len = r.input_tokens.min(16_384);
                let ids: Vec<u32> = (0..len).collect();
                cm.admit(next_rid, "llm", "prefill", PreparedInput::tokens(ids), 0).await.unwrap();
                prefilling.insert(next_rid, r.output_tokens.max(1));
                next_rid += 1;
            }
            let b = cm.assemble("llm", "mixed").await.unwrap();
            let ran: Vec<u32> = b.rows.iter().map(|r| r.tokens()).collect();
            let out = cm.complete(b.step, ran, None).await.unwrap();
            for row in &b.rows {
                if let RowWork::Continue { .. } = row.work {
                    if let Some(left) = decoding.get_mut(&row.rid) {
                        *left -= 1;
                        if *left == 0 {
                            decoding.remove(&row.rid);
                            cm.forget_request(row.rid).await.unwrap();
                        }
                    }
                }
            }
            for rid in out.finished {
                if let Some(out_tokens) = prefilling.remove(&rid) {
                    if out_tokens > 1 {
                        cm.continue_row(rid, "llm", "decode", 1).await.unwrap();
                        decoding.insert(rid, out_tokens - 1);
                    }
                }
            }
            step += 1;
            if step.is_multiple_of(97) {
                // Abort an active request: prefilling or decoding, alternately.
                let pool: Vec<u64> = if step.is_multiple_of(2) { prefilling.keys().copied().collect() } else { decoding.keys().copied().collect() };
                if !pool.is_empty() {
                    let pick = pool[rng.gen_range(0..pool.len())];
                    prefilling.remove(&pick);
                    decoding.remove(&pick);
                    cm.forget_request(pick).await.unwrap();
                    aborted += 1;
                }
            }
            if step.is_multiple_of(500) {
                budget = if budget == 2048 { 1024 } else { 2048 };
                cm.set_budgets(settings(&demo, budget, 64)).await.unwrap();
                reloads += 1;
            }
            if step.is_multiple_of(1000) {
                assert!(cm.set_budgets(settings(&demo, 0, 0)).await.is_err());
                refused += 1;
                assert_eq!(cm.max_batch_tokens("llm", "mixed").await.unwrap(), Some(budget));
            }
            if step == steps / 10 {
                rss_early = rss_bytes();
            }
        }
        let rss_end = rss_bytes();
        // Drain: no new prompts, every decode finished, run to the end.
        for rid in decoding.keys() {
            cm.forget_request(*rid).await.unwrap();
        }
        for _ in 0..100_000 {
            let b = cm.assemble("llm", "mixed").await.unwrap();
            let ran: Vec<u32> = b.rows.iter().map(|r| r.tokens()).collect();
            cm.complete(b.step, ran, None).await.unwrap();
            if b.rows.is_empty() {
                break;
            }
        }
        let held = cm.prepared_totals().await.unwrap();
        let stats = cm.queue_stats().await.unwrap();
        let (queued, in_flight) = (stats.prefill_rows, stats.steps_in_flight);
        eprintln!(
            "soak: {step} steps in {:.1?}, {next_rid} requests, {aborted} aborted, {reloads} reloads, {refused} refused; \
             RSS {:.1} MiB after 10%, {:.1} MiB at the end",
            started.elapsed(),
            rss_early as f64 / 1048576.0,
            rss_end as f64 / 1048576.0
        );
        assert_eq!(held, (0, 0), "prepared inputs left");
        assert_eq!((queued, in_flight), (0, 0));
        assert!(step >= steps.min(20_000), "the soak ran {step} steps");
        assert!(rss_early > 0 && rss_end as f64 <= rss_early as f64 * 1.10, "RSS grew from {rss_early} to {rss_end}");
    });
}
