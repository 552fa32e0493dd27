//! Property tests over the scheduler's pure state: random prompts, decode rows, budgets,
//! floors and aligns, run to completion, checked against the invariants of docs/ranges.md#invariants and docs/scheduling.md#planner-rules.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use mstar_chunking::budget::{BudgetSettings, BudgetTable, BudgetValue, NodeBudget};
use mstar_chunking::policy::ModelPolicies;
use mstar_chunking::policy::Name;
use mstar_chunking::scheduler::SchedulerState;
use mstar_chunking::{ChunkRange, ChunkingPolicy, RowWork, SubmoduleCaps};
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
                BudgetValue::tokens(c.budget).unwrap_or(BudgetValue::Off),
            )])),
        )]),
        walks: [n("prefill"), n("decode"), n("mixed")].into(),
        combined_walk_of: BTreeMap::from([(n("prefill"), n("mixed")), (n("decode"), n("mixed"))]),
        override_mixed: [n("llm")].into(),
        no_chunking: Default::default(),
        min_chunk_tokens: c.min_chunk,
        max_row_tokens: c.max_row,
        max_partial_prefills: c.max_partial,
        slots_per_row: 0,
        time: Default::default(),
        order: Default::default(),
    };
    let table = BudgetTable::build(model, settings).unwrap();
    SchedulerState::with_table(table)
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
            s.queue_continuing(rid, "llm", "decode", *est, None).unwrap();
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
                    let options = mstar_chunking::AdmitOptions::cached(*cached);
                    s.queue_prompt(rid as u64, "llm", "prefill", *total, options).unwrap();
                }
            }
            let b = s.plan_batch("llm", "mixed", None).unwrap();
            let budget = u64::from(c.budget);
            let floor = c.min_chunk.min(c.budget).min(c.max_row.unwrap_or(u32::MAX));
            prop_assert_eq!(b.floor, Some(floor));
            let prefill_tokens: u64 = b.rows.iter().filter(|r| matches!(r.work, RowWork::Chunk { .. })).map(|r| u64::from(r.tokens())).sum();
            if let Some(cap) = c.prefill_cap {
                prop_assert!(prefill_tokens <= u64::from(cap), "prefill cap {cap} exceeded: {prefill_tokens}");
            }
            let lone_over = b.rows.len() == 1 && b.scheduled_tokens > budget;
            prop_assert!(b.scheduled_tokens <= budget || lone_over, "{} > {budget}", b.scheduled_tokens);
            for (i, r) in b.rows.iter().enumerate() {
                if let RowWork::Chunk { range, cached } = r.work {
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
            let out = s.close_step(b.step, &ran, None).unwrap();
            prop_assert!(out.overrun.is_none() || lone_over, "{:?}", out.overrun);
            done += out.finished.len();
            for r in &b.rows {
                if let Some(left) = decode_left.get_mut(&r.rid) {
                    *left -= 1;
                    if *left == 0 {
                        prop_assert!(s.node("llm").unwrap().cont().iter().any(|c| c.rid == r.rid));
                        s.drop_rows(r.rid);
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

/// One step planned under a time limit (docs/cost-model.md#time-budgets).
#[derive(Debug, Clone)]
struct TimedCase {
    budget: u32,
    align: u32,
    floor: u32,
    max_step_ms: f64,
    coefficients: [f64; 4],
    /// `(estimate, context)` of continuing rows.
    cont: Vec<(u32, u64)>,
    /// `(total, progress, started)` of prefill rows.
    prefill: Vec<(u32, u32, bool)>,
}

fn timed_case() -> impl Strategy<Value = TimedCase> {
    (
        64u32..16_384,
        prop_oneof![Just(1u32), Just(16), Just(64)],
        1u32..256,
        1.0f64..400.0,
        (0.0f64..20.0, 0.0f64..0.2, 0.0f64..0.002, 0.0f64..2e-5),
        proptest::collection::vec((1u32..5, 0u64..200_000), 0..24),
        proptest::collection::vec((1u32..300_000, 0u32..300_000, any::<bool>()), 0..6),
    )
        .prop_map(
            |(budget, align, floor, max_step_ms, (b, t, k, a), cont, prefill)| TimedCase {
                budget,
                align,
                floor: floor.min(budget),
                max_step_ms,
                coefficients: [b, t, k, a],
                cont,
                prefill: prefill
                    .into_iter()
                    .map(|(total, progress, started)| {
                        let progress = if started { progress % total } else { 0 };
                        (total, progress, started && progress > 0)
                    })
                    .collect(),
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    /// No planned step exceeds its time budget but in the liveness cases the plan names, and
    /// the token rules hold: budget, alignment, floor.
    #[test]
    fn no_step_is_planned_over_its_time_budget_but_the_liveness_cases(c in timed_case()) {
        use mstar_chunking::latency::LatencyModel;
        use mstar_chunking::overrun::TimeOverrunReason;
        use mstar_chunking::planner::{plan_timed, ContRow, PrefillRow, StepParams, StepPlan, TimeLimit};
        let [b, t, k, a] = c.coefficients;
        let model = LatencyModel::try_new(b, t, k, a).unwrap();
        let params = StepParams {
            node: n("llm"),
            walk: n("mixed"),
            budget: Some(c.budget),
            floor: c.floor,
            caps: Arc::from(Vec::new()),
            chunkable: true,
            align: c.align,
            eligible: vec![n("mixed"), n("prefill"), n("decode")].into(),
            max_row_tokens: None,
            max_partial_prefills: None,
            slots_per_row: 0,
            max_step_ms: Some(c.max_step_ms),
            cost: Some(model),
            learn_cost: false,
            margin_quantile: None,
            order: Default::default(),
            floor_yield: None,
        };
        let cont: Vec<ContRow> = c.cont.iter().enumerate().map(|(i, &(estimate, context))| ContRow {
            seq: i as u64, rid: i as u64, walk: n("decode"), estimate, context,
        }).collect();
        let prefill: Vec<PrefillRow> = c.prefill.iter().enumerate().map(|(i, &(total, progress, started))| PrefillRow {
            seq: 100 + i as u64, rid: 100 + i as u64, walk: n("prefill"), total, cached: 0, progress, started,
            priority: 0, arrival_ms: None, admitted_step: 0,
        wait_from_step: 0,
        wait_from_ms: None,
        }).collect();
        let mut out = StepPlan::default();
        let time = TimeLimit { model, max_step_ms: c.max_step_ms, clock: Default::default() };
        plan_timed(&params, Some(time), &cont, &prefill, &mut out);

        let predicted = out.predicted_ms(&model);
        match out.time_over {
            None => prop_assert!(predicted <= c.max_step_ms, "{predicted} > {} unannounced", c.max_step_ms),
            Some(TimeOverrunReason::Continuing) => {
                let mut only_cont = out.clone();
                only_cont.rows.retain(|r| matches!(r.work, RowWork::Continue { .. }));
                let mut f = mstar_chunking::latency::StepFeatures::EMPTY;
                for r in &only_cont.rows { f.add_continuing(r.work.tokens(), r.context); }
                prop_assert!(model.predict_ms(&f) > c.max_step_ms, "continuing rows fit");
            }
            Some(TimeOverrunReason::Floor) => {
                // Only the first prefill row in order may be run over time, at the floor.
                let chunks: Vec<_> = out.rows.iter().filter(|r| matches!(r.work, RowWork::Chunk { .. })).collect();
                prop_assert!(!chunks.is_empty());
                prop_assert!(chunks[0].work.tokens() <= c.floor.max(1) + c.align, "floor chunk of {} tokens", chunks[0].work.tokens());
            }
            Some(other) => prop_assert!(false, "unexpected {other:?}: every row is chunkable"),
        }
        let lone_over = out.rows.len() == 1 && out.scheduled_tokens > u64::from(c.budget);
        prop_assert!(out.scheduled_tokens <= u64::from(c.budget) || lone_over);
        for (i, r) in out.rows.iter().enumerate() {
            if let RowWork::Chunk { range, .. } = r.work {
                if !range.is_final() {
                    prop_assert_eq!(range.end % c.align, 0, "unaligned {:?}", range);
                    prop_assert!(i == 0 || range.tokens() >= c.floor, "{:?} below the floor {}", range, c.floor);
                }
            }
        }
    }
}
