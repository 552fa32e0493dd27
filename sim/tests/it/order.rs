//! The order of waiting prompts through the plain scheduler state (`docs/scheduling.md#the-order-of-waiting-prompts`):
//! each order's first step, mid-prefill rows first, and the starvation bound at its exact
//! boundary, in steps and in ms.

use std::collections::BTreeMap;
use std::num::NonZeroU32;

use mstar_chunking::order::Order;
use mstar_chunking::planner::{plan_ranked, plan_timed, PrefillRow, StepPlan};
use mstar_chunking::policy::{ModelPolicies, Name};
use mstar_chunking::queues::NodeQueues;
use mstar_chunking::scheduler::SchedulerState;
use mstar_chunking::{
    AdmitOptions, BudgetSettings, BudgetTable, ChunkingPolicy, RowWork, SubmoduleCaps,
};

const BUDGET: u32 = 100;

fn state(settings: BudgetSettings) -> SchedulerState {
    let subs = BTreeMap::from([(Name::from("llm"), SubmoduleCaps::new(["prefill"], false))]);
    let pols = BTreeMap::from([(
        (Name::from("llm"), Name::from("prefill")),
        ChunkingPolicy::budget(BUDGET),
    )]);
    let model = ModelPolicies::new(subs, pols).unwrap().shared();
    let settings = settings.min_chunk_tokens(NonZeroU32::new(8).unwrap());
    SchedulerState::with_table(BudgetTable::build(model, settings).unwrap())
}

fn ordered(order: Order) -> BudgetSettings {
    BudgetSettings::new(["prefill"]).order(order)
}

fn admit(s: &mut SchedulerState, rid: u64, total: u32, options: AdmitOptions) {
    s.queue_prompt(rid, "llm", "prefill", total, options)
        .unwrap();
}

/// Plans a step at `now_ms`, completes it as planned, and answers its rows (rid, tokens).
fn step(s: &mut SchedulerState, now_ms: Option<f64>) -> Vec<(u64, u32)> {
    let b = s.plan_batch("llm", "prefill", now_ms).unwrap();
    let ran: Vec<u32> = b.rows.iter().map(|r| r.work.tokens()).collect();
    s.close_step(b.step, &ran, None).unwrap();
    b.rows.iter().map(|r| (r.rid, r.work.tokens())).collect()
}

fn with_priority(priority: i32) -> AdmitOptions {
    AdmitOptions {
        priority,
        ..AdmitOptions::default()
    }
}

#[test]
fn each_order_starts_its_own_first_prompt() {
    // rid: tokens, cached, priority. 1: 300 / 0 / 2; 2: 40 / 0 / 0; 3: 90 / 60 / 1.
    let prompts = [(1, 300, 0, 2), (2, 40, 0, 0), (3, 90, 60, 1)];
    let first = |order| {
        let mut s = state(ordered(order));
        for (rid, total, cached, priority) in prompts {
            let o = AdmitOptions {
                cached,
                priority,
                arrival_ms: None,
            };
            admit(&mut s, rid, total, o);
        }
        step(&mut s, None)
    };
    assert_eq!(first(Order::Fcfs), [(1, 100)]);
    // Lowest priority value first: 2 (40 tokens), then 3 (its 30 uncached), then 1 cut to 30.
    assert_eq!(first(Order::Priority), [(2, 40), (3, 30), (1, 30)]);
    // Fewest tokens left: 3 has 30 to run, 2 has 40, 1 has 300.
    assert_eq!(first(Order::ShortestFirst), [(3, 30), (2, 40), (1, 30)]);
    // Most cached: 3 (60), then 2 and 1 by admission.
    assert_eq!(first(Order::LongestPrefix), [(3, 30), (1, 70)]);
}

#[test]
fn a_mid_prefill_prompt_keeps_its_place_before_a_new_higher_priority_one() {
    let mut s = state(ordered(Order::Priority));
    admit(&mut s, 1, 250, with_priority(5));
    assert_eq!(step(&mut s, None), [(1, 100)]);
    admit(&mut s, 2, 50, with_priority(0));
    // 1 is mid-prefill: it runs first, the new prompt takes what is left.
    assert_eq!(step(&mut s, None), [(1, 100),]);
    assert_eq!(step(&mut s, None), [(1, 50), (2, 50)]);
}

#[test]
fn a_starved_prompt_goes_first_from_exactly_max_wait_steps() {
    // Shortest first, with a short prompt arriving every step: the long one waits until it
    // has waited through 3 planned steps, then goes first.
    let bound = |steps| {
        let mut s =
            state(ordered(Order::ShortestFirst).max_wait_steps(NonZeroU32::new(steps).unwrap()));
        admit(&mut s, 1, 400, AdmitOptions::default());
        let mut firsts = Vec::new();
        for k in 0..5 {
            admit(&mut s, 10 + k, BUDGET, AdmitOptions::default());
            firsts.push(step(&mut s, None)[0].0);
        }
        firsts
    };
    assert_eq!(
        bound(3),
        [10, 11, 12, 1, 1],
        "starved at its 4th step, waited 3"
    );
    assert_eq!(bound(4), [10, 11, 12, 13, 1]);
    assert_eq!(bound(1), [10, 1, 1, 1, 1]);
    // Without a bound it waits behind every short prompt.
    let mut s = state(ordered(Order::ShortestFirst));
    admit(&mut s, 1, 400, AdmitOptions::default());
    for k in 0..5 {
        admit(&mut s, 10 + k, BUDGET, AdmitOptions::default());
        assert_eq!(step(&mut s, None)[0].0, 10 + k);
    }
    assert_eq!(s.node("llm").unwrap().head_wait().unwrap().steps, 5);
}

#[test]
fn a_starved_prompt_goes_first_from_exactly_max_wait_ms_on_the_engines_clock() {
    let mut s = state(ordered(Order::ShortestFirst).max_wait_ms(250.0));
    let at = |ms| AdmitOptions {
        arrival_ms: Some(ms),
        ..AdmitOptions::default()
    };
    admit(&mut s, 1, 400, at(0.0));
    admit(&mut s, 2, BUDGET, at(10.0));
    assert_eq!(step(&mut s, Some(249.999))[0].0, 2, "waited 249.999 ms");
    admit(&mut s, 3, BUDGET, at(200.0));
    assert_eq!(step(&mut s, Some(250.0))[0].0, 1, "waited 250 ms exactly");
    let head = s.node("llm").unwrap().head_wait().unwrap();
    assert_eq!(
        head.ms,
        Some(50.0),
        "1 is mid-prefill now: the head is 3, admitted at 200"
    );
    // No step time: the ms bound cannot apply, the order decides.
    let mut s = state(ordered(Order::ShortestFirst).max_wait_ms(1.0));
    admit(&mut s, 1, 400, at(0.0));
    admit(&mut s, 2, BUDGET, at(10.0));
    assert_eq!(step(&mut s, None)[0].0, 2);
}

#[test]
fn a_priority_under_another_order_changes_nothing_and_is_warned_about_once_per_node() {
    let mut s = state(ordered(Order::Fcfs));
    admit(&mut s, 1, 300, with_priority(9));
    admit(&mut s, 2, 40, with_priority(0));
    assert_eq!(
        step(&mut s, None),
        [(1, 100)],
        "fcfs: the priority does not reorder"
    );
    let mut q = NodeQueues::new(Name::from("llm"));
    assert!(!q.warn_priority(Order::Priority, 3), "the order uses it");
    assert!(!q.warn_priority(Order::Fcfs, 0), "no priority given");
    assert!(q.warn_priority(Order::ShortestFirst, -1));
    assert!(!q.warn_priority(Order::Fcfs, 7), "once per node");
}

#[test]
fn a_ranked_plan_in_admission_order_is_the_fcfs_plan() {
    let s = {
        let mut s = state(ordered(Order::Fcfs));
        for (rid, total) in [(1, 70), (2, 20), (3, 300), (4, 5)] {
            admit(&mut s, rid, total, AdmitOptions::default());
        }
        s
    };
    let params = s
        .snapshot()
        .unwrap()
        .step_params("llm", "prefill")
        .unwrap()
        .clone();
    let q = s.node("llm").unwrap();
    let prefill: &[PrefillRow] = q.prefill();
    let mut fcfs = StepPlan::default();
    plan_timed(&params, None, q.cont(), prefill, &mut fcfs);
    let mut ranked = StepPlan::default();
    let rank: Vec<u32> = (0..prefill.len() as u32).collect();
    plan_ranked(&params, None, q.cont(), prefill, &rank, &mut ranked);
    assert_eq!(fcfs, ranked);
    // Reversed, the last admitted goes first.
    let rank: Vec<u32> = (0..prefill.len() as u32).rev().collect();
    plan_ranked(&params, None, q.cont(), prefill, &rank, &mut ranked);
    let rids: Vec<u64> = ranked.rows.iter().map(|r| r.rid).collect();
    assert_eq!(rids, [4u64, 3, 2, 1][..rids.len()].to_vec());
    assert!(ranked
        .rows
        .iter()
        .all(|r| matches!(r.work, RowWork::Chunk { .. })));
}
