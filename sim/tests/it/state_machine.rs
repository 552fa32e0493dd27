//! Random message sequences through the facade (admit, continue, assemble, a dropped assemble
//! future, complete with the planned tokens or with nothing run, abandon, forget, release,
//! set_budgets), checked after every message: no row lost or duplicated, prepared inputs held
//! == rows queued for prefill, a repeated assemble answers the step in flight, chunks contiguous
//! (docs/ranges.md), and at the end every admitted row either finished its prefill or was
//! dropped, its chunks contiguous and complete.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::future::Future;
use std::sync::Arc;
use std::task::{Context, Waker};

use mstar_chunking::budget::{BudgetSettings, BudgetValue, NodeBudget};
use mstar_chunking::policy::Name;
use mstar_chunking::{
    Batch, ChunkingError, ChunkingManagement, ChunkingPolicy, PreparedInput, RowWork, SubmoduleCaps,
};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    Admit {
        rid: u64,
        len: u32,
        cached: u32,
    },
    Continue {
        rid: u64,
        estimate: u32,
    },
    Assemble,
    /// An `assemble` whose future is dropped after its message went out (a `select!`, a
    /// timeout, a client that went away).
    DropAssemble,
    Complete {
        overshoot: u32,
    },
    /// The step failed on the GPU: every chunk row reports 0.
    Fail,
    Abandon,
    Forget {
        rid: u64,
    },
    Release {
        rid: u64,
    },
    SetBudgets {
        budget: Option<u32>,
        min_chunk: u32,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let rid = 0u64..12;
    prop_oneof![
        4 => (rid.clone(), 1u32..2000, 0u32..2500).prop_map(|(rid, len, cached)| Op::Admit { rid, len, cached }),
        2 => (rid.clone(), 1u32..5).prop_map(|(rid, estimate)| Op::Continue { rid, estimate }),
        6 => Just(Op::Assemble),
        2 => Just(Op::DropAssemble),
        6 => (0u32..3).prop_map(|overshoot| Op::Complete { overshoot }),
        1 => Just(Op::Fail),
        1 => Just(Op::Abandon),
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
        slots_per_row: 0,
        time: Default::default(),
        order: Default::default(),
    }
}

/// What the test expects the component to hold.
#[derive(Default)]
struct Model {
    /// rid -> (total, progress, started) of rows queued for prefill.
    prefilling: HashMap<u64, (u32, u32, bool)>,
    continuing: HashSet<u64>,
    in_flight: Option<Arc<Batch>>,
    /// A step was assembled by a future that was dropped: the next assemble answers it.
    unseen_in_flight: bool,
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
                RowWork::Continue { .. } => {}
                RowWork::Chunk { range, cached } => {
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
    let stats = cm.queue_stats().await.unwrap();
    prop_assert_eq!(held, m.prefilling.len(), "prepared inputs held");
    prop_assert_eq!(
        stats.prefill_rows,
        m.prefilling.len(),
        "prefill rows queued"
    );
    prop_assert_eq!(
        stats.mid_prefill_rows,
        m.prefilling.values().filter(|r| r.2).count(),
        "rows mid-prefill"
    );
    prop_assert_eq!(stats.continuing_rows, m.continuing.len(), "continuing rows");
    let in_flight = m.in_flight.is_some() || m.unseen_in_flight;
    prop_assert_eq!(stats.steps_in_flight, usize::from(in_flight));
    Ok(())
}

/// Completes the step in flight: continuing rows ran their estimate plus `overshoot`; chunk
/// rows ran their planned tokens, or nothing when `failed`.
async fn complete(
    cm: &ChunkingManagement,
    m: &mut Model,
    overshoot: u32,
    failed: bool,
) -> Result<(), TestCaseError> {
    let Some(b) = m.in_flight.take() else {
        return Ok(());
    };
    let ran: Vec<u32> = b
        .rows
        .iter()
        .map(|r| match r.work {
            RowWork::Continue { estimate } => estimate + overshoot,
            RowWork::Chunk { .. } if failed => 0,
            RowWork::Chunk { range, .. } => range.tokens(),
        })
        .collect();
    let out = cm.complete(b.step, ran, None).await.unwrap();
    if !failed {
        m.apply(&b)?;
    } else {
        prop_assert_eq!(out.chunks, 0);
        prop_assert!(out.finished.is_empty());
    }
    m.stale.clear();
    prop_assert!(out.finished.iter().all(|rid| m.finished.contains(rid)));
    Ok(())
}

async fn run(ops: Vec<Op>) -> Result<(), TestCaseError> {
    let cm = ChunkingManagement::start(
        "test",
        [("llm", SubmoduleCaps::new(["prefill", "mixed"], false))],
    )
    .unwrap();
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
            Op::DropAssemble => {
                let mut assemble = std::pin::pin!(cm.assemble("llm", "mixed"));
                // Polled once (the message goes out); the Scheduler handles it (a later message
                // is answered after it), then the future is dropped with its answer.
                let mut cx = Context::from_waker(Waker::noop());
                let polled = assemble.as_mut().poll(&mut cx);
                prop_assert!(polled.is_pending(), "answered without yielding");
                cm.queue_stats().await.unwrap();
                // An empty batch is not a step in flight; a plan is empty exactly when no row
                // is queued (a lone row always runs).
                let queued = !(m.prefilling.is_empty() && m.continuing.is_empty());
                m.unseen_in_flight |= m.in_flight.is_none() && queued;
            }
            Op::Fail => complete(&cm, &mut m, 0, true).await?,
            Op::Abandon => {
                if let Some(b) = m.in_flight.take() {
                    cm.abandon(b.step).await.unwrap();
                    let again = cm.abandon(b.step).await;
                    prop_assert!(
                        matches!(again, Err(ChunkingError::UnknownStep { .. })),
                        "abandoned twice: {:?}",
                        again
                    );
                    m.stale.clear();
                }
            }
            Op::Assemble => match cm.assemble("llm", "mixed").await {
                Ok(b) if m.in_flight.is_some() => {
                    prop_assert_eq!(Some(&b), m.in_flight.as_ref(), "not the step in flight");
                }
                Ok(b) => {
                    let queued = !(m.prefilling.is_empty() && m.continuing.is_empty());
                    prop_assert_eq!(
                        b.rows.is_empty(),
                        !queued && !m.unseen_in_flight,
                        "an empty plan exactly when nothing is queued"
                    );
                    m.unseen_in_flight = false;
                    for r in b.rows.iter().filter(|r| !m.stale.contains(&r.rid)) {
                        if matches!(r.work, RowWork::Continue { .. }) {
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
                    // An empty batch is not in flight: the next assemble plans afresh.
                    m.in_flight = (!b.rows.is_empty()).then_some(b);
                }
                Err(e) => prop_assert!(false, "assemble: {e}"),
            },
            Op::Complete { overshoot } => complete(&cm, &mut m, overshoot, false).await?,
            Op::Forget { rid } => {
                cm.forget_request(rid).await.unwrap();
                if m.in_flight.is_some() || m.unseen_in_flight {
                    m.stale.insert(rid);
                }
                if m.prefilling.remove(&rid).is_some() {
                    m.dropped.insert(rid);
                }
                m.continuing.remove(&rid);
            }
            Op::Release { rid } => {
                let held = cm.release(rid, "llm").await.unwrap();
                if m.in_flight.is_some() || m.unseen_in_flight {
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
    // Drain: finish the in-flight step and end every continuing request, then run to the end.
    if m.unseen_in_flight {
        m.in_flight = Some(cm.assemble("llm", "mixed").await.unwrap());
        m.unseen_in_flight = false;
    }
    complete(&cm, &mut m, 0, false).await?;
    for rid in m.continuing.drain() {
        cm.forget_request(rid).await.unwrap();
    }
    for _ in 0..2000 {
        if m.prefilling.is_empty() {
            break;
        }
        m.in_flight = Some(cm.assemble("llm", "mixed").await.unwrap());
        complete(&cm, &mut m, 0, false).await?;
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
