//! Property tests over the scheduler's pure state: random prompts, decode rows, budgets,
//! floors and aligns, run to completion, checked against the invariants of docs/ranges.md#invariants and docs/scheduling.md#planner-rules.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use mstar_chunking::budget::{BudgetSettings, BudgetTable, BudgetValue, NodeBudget};
use mstar_chunking::policy::ModelPolicies;
use mstar_chunking::scheduler::SchedulerState;
use mstar_chunking::snapshot::BudgetSnapshot;
use mstar_chunking::{ChunkRange, ChunkingPolicy, Name, SubmoduleCaps, Work};
use proptest::prelude::*;

fn n(s: &str) -> Name {
    Name::from(s)
}

#[derive(Debug, Clone)]
struct Case {
    budget: u32,
    align: u32,
    min_chunk: u32,
    max_row: Option<u32>,
    max_partial: Option<u32>,
    prefill_cap: Option<u32>,
    /// `(total, cached, arrival step)`
    prompts: Vec<(u32, u32, u32)>,
    /// `(estimate, steps)` of continuing rows
    decodes: Vec<(u32, u32)>,
}

fn case() -> impl Strategy<Value = Case> {
    (
        prop_oneof![Just(1u32), Just(2), Just(16), Just(64)],
        1u32..3000,
        1u32..300,
        proptest::option::of(1u32..1500),
        proptest::option::of(1u32..4),
        any::<bool>(),
        proptest::collection::vec((1u32..6000, 0u32..7000, 0u32..20), 1..12),
        proptest::collection::vec((1u32..6, 1u32..30), 0..12),
    )
        .prop_map(
            |(align, budget, min_chunk, max_row, max_partial, cap, prompts, decodes)| {
                let budget = budget.max(align);
                Case {
                    budget,
                    align,
                    min_chunk,
                    max_row: max_row.map(|m| m.max(align)),
                    max_partial,
                    prefill_cap: cap.then_some((budget / 2).max(align)),
                    prompts,
                    decodes,
                }
            },
        )
}

fn state(c: &Case) -> SchedulerState {
    let subs = BTreeMap::from([(n("llm"), SubmoduleCaps::new(["prefill", "mixed"], true))]);
    let mut pols = BTreeMap::from([(
        (n("llm"), n("mixed")),
        ChunkingPolicy::budget(c.budget).aligned(c.align),
    )]);
    if let Some(cap) = c.prefill_cap {
        pols.insert((n("llm"), n("prefill")), ChunkingPolicy::budget(cap));
    }
    let model = ModelPolicies::new(subs, pols).unwrap().shared();
    let settings = BudgetSettings {
        overrides: BTreeMap::from([(
            n("llm"),
            NodeBudget::PerWalk(BTreeMap::from([(
                n("mixed"),
                BudgetValue::Tokens(i64::from(c.budget)),
            )])),
        )]),
        walks: [n("prefill"), n("decode"), n("mixed")].into(),
        combined_walk_of: BTreeMap::from([(n("prefill"), n("mixed")), (n("decode"), n("mixed"))]),
        override_mixed: [n("llm")].into(),
        no_chunking: Default::default(),
        min_chunk_tokens: c.min_chunk,
        max_row_tokens: c.max_row,
        max_partial_prefills: c.max_partial,
    };
    let table = BudgetTable::build(model, settings).unwrap();
    let mut s = SchedulerState::default();
    s.set_snapshot(Arc::new(BudgetSnapshot::new(table, 1)));
    s
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn every_prompt_completes_with_contiguous_aligned_chunks_within_the_budget(c in case()) {
        let mut s = state(&c);
        let decode_base = 1_000u64;
        let mut decode_left: HashMap<u64, u32> = HashMap::new();
        for (i, (est, steps)) in c.decodes.iter().enumerate() {
            let rid = decode_base + i as u64;
            s.continue_row(rid, "llm", "decode", *est).unwrap();
            decode_left.insert(rid, *steps);
        }
        let mut chunks: HashMap<u64, Vec<(ChunkRange, u32)>> = HashMap::new();
        let mut done = 0usize;
        let bound = 20 + c.prompts.iter().map(|p| p.0 as usize).sum::<usize>() + 40 * c.decodes.len();
        let mut step = 0u32;
        while done < c.prompts.len() {
            prop_assert!((step as usize) < bound, "no progress after {step} steps");
            for (rid, (total, cached, arrival)) in c.prompts.iter().enumerate() {
                if *arrival == step {
                    s.admit(rid as u64, "llm", "prefill", *total, *cached).unwrap();
                }
            }
            let b = s.assemble("llm", "mixed").unwrap().into_batch();
            let budget = u64::from(c.budget);
            let floor = c.min_chunk.min(c.budget).min(c.max_row.unwrap_or(u32::MAX));
            prop_assert_eq!(b.floor, Some(floor));
            let prefill_tokens: u64 = b.rows.iter().filter(|r| matches!(r.work, Work::Chunk { .. })).map(|r| u64::from(r.tokens())).sum();
            if let Some(cap) = c.prefill_cap {
                prop_assert!(prefill_tokens <= u64::from(cap), "prefill cap {cap} exceeded: {prefill_tokens}");
            }
            let lone_over = b.rows.len() == 1 && b.scheduled_tokens > budget;
            prop_assert!(b.scheduled_tokens <= budget || lone_over, "{} > {budget}", b.scheduled_tokens);
            for (i, r) in b.rows.iter().enumerate() {
                if let Work::Chunk { range, cached } = r.work {
                    prop_assert!(range.start < range.end && range.end <= range.total);
                    if !range.is_final() {
                        // The floor does not hold back a row alone in its step (the first row).
                        let alone = i == 0;
                        let cap_floor = c.prefill_cap.map_or(floor, |cap| floor.min(cap));
                        prop_assert!(alone || range.tokens() >= cap_floor, "chunk {range:?} below floor {cap_floor}");
                        prop_assert_eq!(range.end % c.align, 0, "unaligned {:?}", range);
                        if let Some(m) = c.max_row { prop_assert!(range.tokens() <= m); }
                    }
                    chunks.entry(r.rid).or_default().push((range, cached));
                }
            }
            let ran: Vec<u32> = b.rows.iter().map(|r| r.tokens()).collect();
            let out = s.complete(b.step, &ran).unwrap();
            prop_assert!(out.overrun.is_none() || lone_over, "{:?}", out.overrun);
            done += out.finished.len();
            for r in &b.rows {
                if let Some(left) = decode_left.get_mut(&r.rid) {
                    *left -= 1;
                    if *left == 0 {
                        prop_assert!(s.node("llm").unwrap().cont().iter().any(|c| c.rid == r.rid));
                        s.forget(r.rid);
                    }
                }
            }
            step += 1;
        }
        for (rid, (total, cached, _)) in c.prompts.iter().enumerate() {
            let cs = &chunks[&(rid as u64)];
            let cached = (*cached).min(total - 1);
            prop_assert_eq!(cs[0].0.start, cached, "first start is the cached prefix");
            prop_assert_eq!(cs[0].1, cached);
            prop_assert_eq!(cs[0].0.stride, cs[0].0.end);
            for w in cs.windows(2) {
                prop_assert_eq!(w[1].0.start, w[0].0.end);
                prop_assert_eq!(w[1].0.stride, w[1].0.end - w[1].0.start);
                prop_assert_eq!(w[1].1, 0);
            }
            prop_assert_eq!(cs.iter().map(|c| u64::from(c.0.stride)).sum::<u64>(), u64::from(*total));
            prop_assert_eq!(cs.iter().filter(|c| c.0.is_final()).count(), 1);
            prop_assert!(cs.last().unwrap().0.is_final());
        }
        prop_assert_eq!(s.prefill_rows(), 0);
    }
}
