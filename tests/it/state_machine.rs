//! Random message sequences through the facade (admit, continue, finish, assemble, complete,
//! forget, release, set_budgets), checked after every message: no row lost or duplicated,
//! prepared inputs held == rows queued for prefill, chunks contiguous per SPEC §2, and at the
//! end every admitted row either finished its prefill or was dropped.

use std::collections::{BTreeMap, HashMap, HashSet};

use mstar_chunking::budget::{BudgetSettings, BudgetValue, NodeBudget};
use mstar_chunking::{
    Batch, ChunkingError, ChunkingManagement, ChunkingPolicy, Name, PreparedInput, SubmoduleCaps,
    Work,
};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    Admit { rid: u64, len: u32, cached: u32 },
    Continue { rid: u64, estimate: u32 },
    Finish { rid: u64 },
    Assemble,
    Complete { overshoot: u32 },
    Forget { rid: u64 },
    Release { rid: u64 },
    SetBudgets { budget: Option<u32>, min_chunk: u32 },
}

fn op() -> impl Strategy<Value = Op> {
    let rid = 0u64..12;
    prop_oneof![
        4 => (rid.clone(), 1u32..2000, 0u32..2500).prop_map(|(rid, len, cached)| Op::Admit { rid, len, cached }),
        2 => (rid.clone(), 1u32..5).prop_map(|(rid, estimate)| Op::Continue { rid, estimate }),
        1 => rid.clone().prop_map(|rid| Op::Finish { rid }),
        6 => Just(Op::Assemble),
        6 => (0u32..3).prop_map(|overshoot| Op::Complete { overshoot }),
        1 => rid.clone().prop_map(|rid| Op::Forget { rid }),
        1 => rid.prop_map(|rid| Op::Release { rid }),
        1 => (proptest::option::of(16u32..1500), 0u32..100).prop_map(|(budget, min_chunk)| Op::SetBudgets { budget, min_chunk }),
    ]
}

fn n(s: &str) -> Name {
    Name::from(s)
}

fn settings(budget: Option<u32>, min_chunk: u32) -> BudgetSettings {
    let value = budget.map_or(BudgetValue::Off, |b| {
        BudgetValue::tokens(b).unwrap_or(BudgetValue::Off)
    });
    BudgetSettings {
        overrides: BTreeMap::from([(n("llm"), NodeBudget::All(value))]),
        walks: [n("prefill"), n("decode"), n("mixed")].into(),
        combined_walk_of: BTreeMap::from([(n("prefill"), n("mixed")), (n("decode"), n("mixed"))]),
        override_mixed: Default::default(),
        no_chunking: Default::default(),
        min_chunk_tokens: min_chunk,
        max_row_tokens: None,
        max_partial_prefills: None,
    }
}

/// What the test expects the component to hold.
#[derive(Default)]
struct Model {
    /// rid -> (total, progress, started) of rows queued for prefill.
    prefilling: HashMap<u64, (u32, u32, bool)>,
    continuing: HashSet<u64>,
    in_flight: Option<Batch>,
    /// Rids dropped while the step in flight holds one of their chunks: it must not advance them.
    stale: HashSet<u64>,
    admitted: HashSet<u64>,
    finished: HashSet<u64>,
    dropped: HashSet<u64>,
}

impl Model {
    /// Checks a completed batch against the rows' progress, and applies it.
    fn apply(&mut self, b: &Batch) -> Result<(), TestCaseError> {
        let mut seen = HashSet::new();
        for r in &b.rows {
            prop_assert!(seen.insert(r.rid), "rid {} twice in step {}", r.rid, b.step);
            match r.work {
                // Checked at assembly: a continuing row may finish while its step is in flight.
                Work::Continue { .. } => {}
                Work::Chunk { range, cached } => {
                    if self.stale.contains(&r.rid) {
                        continue;
                    }
                    let Some((total, progress, started)) = self.prefilling.get_mut(&r.rid) else {
                        // Forgotten or released while in flight: it runs but does not advance.
                        continue;
                    };
                    prop_assert_eq!(range.total, *total);
                    prop_assert_eq!(range.start, *progress, "rid {} does not continue", r.rid);
                    prop_assert_eq!(
                        range.stride,
                        if *started {
                            range.end - range.start
                        } else {
                            range.end
                        }
                    );
                    prop_assert_eq!(cached, if *started { 0 } else { range.start });
                    let input = r.input.as_ref().expect("chunk input");
                    prop_assert_eq!(input.token_ids().len() as u32, range.tokens());
                    prop_assert_eq!(input.token_ids()[0], range.start);
                    if range.is_final() {
                        self.prefilling.remove(&r.rid);
                        self.finished.insert(r.rid);
                    } else {
                        *progress = range.end;
                        *started = true;
                    }
                }
            }
        }
        Ok(())
    }
}

async fn check_held(cm: &ChunkingManagement, m: &Model) -> Result<(), TestCaseError> {
    let (held, _) = cm.prepared_totals().await.unwrap();
    let (queued, in_flight) = cm.scheduler_stats().await.unwrap();
    prop_assert_eq!(held, m.prefilling.len(), "prepared inputs held");
    prop_assert_eq!(queued, m.prefilling.len(), "prefill rows queued");
    prop_assert_eq!(in_flight, usize::from(m.in_flight.is_some()));
    Ok(())
}

async fn complete(
    cm: &ChunkingManagement,
    m: &mut Model,
    overshoot: u32,
) -> Result<(), TestCaseError> {
    let Some(b) = m.in_flight.take() else {
        return Ok(());
    };
    let ran: Vec<u32> = b
        .rows
        .iter()
        .map(|r| {
            r.tokens()
                + if matches!(r.work, Work::Continue { .. }) {
                    overshoot
                } else {
                    0
                }
        })
        .collect();
    let out = cm.complete(b.step, ran).await.unwrap();
    m.apply(&b)?;
    m.stale.clear();
    prop_assert!(out.finished.iter().all(|rid| m.finished.contains(rid)));
    Ok(())
}

async fn run(ops: Vec<Op>) -> Result<(), TestCaseError> {
    let cm = ChunkingManagement::start([("llm", SubmoduleCaps::new(["prefill", "mixed"], false))]);
    cm.set_policies([(("llm", "mixed"), ChunkingPolicy::budget(512).aligned(16))])
        .await
        .unwrap();
    cm.set_budgets(settings(Some(512), 64)).await.unwrap();
    let mut m = Model::default();
    for op in ops {
        match op {
            Op::Admit { rid, len, cached } => {
                let input = PreparedInput::tokens((0..len).collect::<Vec<u32>>());
                let busy = m.prefilling.contains_key(&rid) || m.continuing.contains(&rid);
                match cm.admit(rid, "llm", "prefill", input, cached).await {
                    Ok(()) => {
                        prop_assert!(!busy, "rid {rid} admitted twice");
                        m.prefilling.insert(rid, (len, cached.min(len - 1), false));
                        m.admitted.insert(rid);
                        m.dropped.remove(&rid);
                        m.finished.remove(&rid);
                    }
                    Err(ChunkingError::AlreadyQueued { .. }) => prop_assert!(busy),
                    Err(e) => prop_assert!(false, "admit: {e}"),
                }
            }
            Op::Continue { rid, estimate } => {
                match cm.continue_row(rid, "llm", "decode", estimate).await {
                    Ok(()) => {
                        prop_assert!(!m.prefilling.contains_key(&rid));
                        m.continuing.insert(rid);
                    }
                    Err(ChunkingError::StillPrefilling { .. }) => {
                        prop_assert!(m.prefilling.contains_key(&rid))
                    }
                    Err(e) => prop_assert!(false, "continue: {e}"),
                }
            }
            Op::Finish { rid } => {
                let had = cm.finish_row(rid, "llm").await.unwrap();
                prop_assert_eq!(had, m.continuing.remove(&rid));
            }
            Op::Assemble => match cm.assemble("llm", "mixed").await {
                Ok(b) => {
                    prop_assert!(m.in_flight.is_none());
                    for r in &b.rows {
                        if matches!(r.work, Work::Continue { .. }) {
                            prop_assert!(
                                m.continuing.contains(&r.rid),
                                "rid {} is not continuing",
                                r.rid
                            );
                        } else {
                            prop_assert!(
                                m.prefilling.contains_key(&r.rid),
                                "rid {} is not prefilling",
                                r.rid
                            );
                        }
                    }
                    m.in_flight = Some(b);
                }
                Err(ChunkingError::StepInFlight { .. }) => prop_assert!(m.in_flight.is_some()),
                Err(e) => prop_assert!(false, "assemble: {e}"),
            },
            Op::Complete { overshoot } => complete(&cm, &mut m, overshoot).await?,
            Op::Forget { rid } => {
                cm.forget_request(rid).await.unwrap();
                if m.in_flight.is_some() {
                    m.stale.insert(rid);
                }
                if m.prefilling.remove(&rid).is_some() {
                    m.dropped.insert(rid);
                }
                m.continuing.remove(&rid);
            }
            Op::Release { rid } => {
                let held = cm.release(rid, "llm").await.unwrap();
                if m.in_flight.is_some() {
                    m.stale.insert(rid);
                }
                let had = m.prefilling.remove(&rid).is_some();
                prop_assert_eq!(held, had);
                if had {
                    m.dropped.insert(rid);
                }
                m.continuing.remove(&rid);
            }
            Op::SetBudgets { budget, min_chunk } => {
                let r = cm.set_budgets(settings(budget, min_chunk)).await;
                prop_assert_eq!(r.is_ok(), min_chunk > 0, "{:?}", r);
            }
        }
        check_held(&cm, &m).await?;
    }
    // Drain: finish the in-flight step and every continuing row, then run to the end.
    complete(&cm, &mut m, 0).await?;
    for rid in m.continuing.drain() {
        cm.finish_row(rid, "llm").await.unwrap();
    }
    for _ in 0..2000 {
        if m.prefilling.is_empty() {
            break;
        }
        m.in_flight = Some(cm.assemble("llm", "mixed").await.unwrap());
        complete(&cm, &mut m, 0).await?;
    }
    prop_assert!(
        m.prefilling.is_empty(),
        "rows never finished: {:?}",
        m.prefilling
    );
    for rid in &m.admitted {
        prop_assert!(
            m.finished.contains(rid) || m.dropped.contains(rid),
            "rid {rid} lost"
        );
    }
    check_held(&cm, &m).await?;
    prop_assert_eq!(cm.prepared_totals().await.unwrap(), (0, 0));
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 150, ..ProptestConfig::default() })]

    #[test]
    fn random_message_orders_lose_nothing(ops in proptest::collection::vec(op(), 1..120)) {
        actix::System::new().block_on(run(ops))?;
    }
}
