//! The actors driven through the `ChunkingManagement` facade, as an engine would.

use std::collections::BTreeMap;
use std::io::Write;
use std::sync::{Arc, Mutex};

use crate::common::{chunks, prompt as tokens};
use mstar_chunking::budget::{BudgetSettings, BudgetValue, NodeBudget};
use mstar_chunking::policy::Name;
use mstar_chunking::{
    Batch, ChunkRange, ChunkingError, ChunkingManagement, ChunkingPolicy, OverrunReason, RowWork,
    SubmoduleCaps,
};

fn n(s: &str) -> Name {
    Name::from(s)
}

/// The omni-style model: `thinker` chunks and caps member walks of `mixed`, `vision` cuts
/// nothing, `llm` chunks without caps.
async fn omni(min_chunk_tokens: u32) -> ChunkingManagement {
    let cm = ChunkingManagement::start(
        "test",
        [
            ("thinker", SubmoduleCaps::new(["prefill", "mixed"], true)),
            ("vision", SubmoduleCaps::new::<_, &str>([], false)),
            ("llm", SubmoduleCaps::new(["prefill", "mixed"], false)),
        ],
    )
    .unwrap();
    cm.set_policies([
        (("thinker", "prefill"), ChunkingPolicy::budget(64)),
        (("thinker", "decode"), ChunkingPolicy::budget(2)),
        (("thinker", "mixed"), ChunkingPolicy::budget(100)),
        (("vision", "prefill"), ChunkingPolicy::budget(100)),
        (("llm", "prefill"), ChunkingPolicy::budget(256).aligned(16)),
        (("llm", "mixed"), ChunkingPolicy::budget(256).aligned(16)),
    ])
    .await
    .unwrap();
    cm.set_budgets(settings(min_chunk_tokens, BTreeMap::new()))
        .await
        .unwrap();
    cm
}

fn settings(min_chunk_tokens: u32, overrides: BTreeMap<Name, NodeBudget>) -> BudgetSettings {
    BudgetSettings {
        overrides,
        walks: [n("prefill"), n("decode"), n("mixed")].into(),
        combined_walk_of: BTreeMap::from([(n("prefill"), n("mixed")), (n("decode"), n("mixed"))]),
        override_mixed: [n("thinker")].into(),
        no_chunking: Default::default(),
        min_chunk_tokens,
        max_row_tokens: None,
        max_partial_prefills: None,
        slots_per_row: 0,
        time: Default::default(),
        order: Default::default(),
    }
}

/// Runs `b` as scheduled.
/// Prefill rows queued and steps in flight.
async fn stats(cm: &ChunkingManagement) -> (usize, usize) {
    let s = cm.queue_stats().await.unwrap();
    (s.prefill_rows, s.steps_in_flight)
}

fn as_scheduled(b: &Batch) -> Vec<u32> {
    b.rows.iter().map(|r| r.tokens()).collect()
}

#[actix::test]
async fn multi_step_prefill_with_a_cached_prefix() {
    let cm = omni(16).await;
    cm.admit(7, "llm", "prefill", tokens(1000), 300)
        .await
        .unwrap();
    let mut seen = Vec::new();
    for _ in 0..10 {
        let b = cm.assemble("llm", "mixed").await.unwrap();
        if b.rows.is_empty() {
            cm.complete(b.step, vec![], None).await.unwrap();
            break;
        }
        for row in &b.rows {
            let RowWork::Chunk { range, cached } = row.work else {
                panic!("only prefill rows")
            };
            let input = row.input.as_ref().expect("chunk input cut");
            assert_eq!(
                input.token_ids(),
                &(range.start..range.end).collect::<Vec<u32>>()[..]
            );
            assert_eq!(cached, if seen.is_empty() { 300 } else { 0 });
            seen.push(range);
        }
        let out = cm.complete(b.step, as_scheduled(&b), None).await.unwrap();
        assert!(out.overrun.is_none());
    }
    assert_eq!(
        seen[0].start, 300,
        "the first chunk starts after the cached prefix"
    );
    assert_eq!(
        seen[0].stride, seen[0].end,
        "the first stride counts from 0"
    );
    assert!(
        seen.windows(2).all(|w| w[1].start == w[0].end),
        "contiguous: {seen:?}"
    );
    assert_eq!(seen.iter().map(|c| c.stride).sum::<u32>(), 1000);
    assert_eq!(seen.iter().filter(|c| c.is_final()).count(), 1);
    assert!(seen.last().unwrap().is_final());
    assert!(
        seen[..seen.len() - 1].iter().all(|c| c.end % 16 == 0),
        "aligned: {seen:?}"
    );
    assert_eq!(
        cm.prepared(7, "llm").await.unwrap(),
        None,
        "released after the final chunk"
    );
    assert_eq!(cm.prepared_totals().await.unwrap(), (0, 0));
}

#[actix::test]
async fn a_full_cache_hit_still_runs_the_last_token() {
    let cm = omni(16).await;
    cm.admit(1, "llm", "prefill", tokens(64), 64).await.unwrap();
    let b = cm.assemble("llm", "mixed").await.unwrap();
    let (_, range) = chunks(&b)[0];
    assert_eq!((range.start, range.end, range.stride), (63, 64, 64));
    cm.complete(b.step, as_scheduled(&b), None).await.unwrap();
}

#[actix::test]
async fn combined_walk_with_caps() {
    let cm = omni(1).await;
    assert_eq!(
        cm.walk_caps("thinker", "mixed").await.unwrap(),
        Some(BTreeMap::from([(n("decode"), 2), (n("prefill"), 64)]))
    );
    for rid in 1..=3 {
        cm.continue_row(rid, "thinker", "decode", 1).await.unwrap();
    }
    cm.admit(4, "thinker", "prefill", tokens(500), 0)
        .await
        .unwrap();
    let b = cm.assemble("thinker", "mixed").await.unwrap();
    assert_eq!(b.budget, Some(100), "the combined walk's budget");
    let rows: Vec<(u64, u32)> = b.rows.iter().map(|r| (r.rid, r.tokens())).collect();
    assert_eq!(
        rows,
        vec![(1, 1), (2, 1), (4, 64)],
        "decode capped at 2, prefill at 64"
    );
    assert_eq!(b.waiting, 1);
    cm.complete(b.step, as_scheduled(&b), None).await.unwrap();
    // On a node that cannot cap member walks, a member walk's budget is refused and the
    // combined budget alone applies.
    let err = cm
        .set_budgets(settings(
            1,
            BTreeMap::from([(
                n("llm"),
                NodeBudget::PerWalk(BTreeMap::from([(
                    n("prefill"),
                    BudgetValue::tokens(8).unwrap(),
                )])),
            )]),
        ))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("set `mixed` instead"), "{err}");
    assert_eq!(cm.walk_caps("llm", "mixed").await.unwrap(), None);
}

/// Captures the tracing output of the actors (they run on the test's thread).
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[actix::test]
async fn an_uncut_row_over_the_budget_runs_whole_and_warnings_follow_powers_of_two() {
    let logs = Captured::default();
    let writer = logs.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);

    let cm = omni(1).await;
    assert!(!cm.chunkable("vision", "prefill").await.unwrap());
    for i in 0..9u64 {
        cm.admit(i, "vision", "prefill", tokens(250), 0)
            .await
            .unwrap();
        cm.admit(100 + i, "vision", "prefill", tokens(10), 0)
            .await
            .unwrap();
        let b = cm.assemble("vision", "prefill").await.unwrap();
        // The big image goes first and runs whole: nothing is left for the small one.
        assert_eq!(
            chunks(&b)
                .iter()
                .map(|(rid, c)| (*rid, c.tokens()))
                .collect::<Vec<_>>(),
            vec![(i, 250)]
        );
        let out = cm.complete(b.step, as_scheduled(&b), None).await.unwrap();
        let o = out.overrun.expect("an overrun");
        assert_eq!(
            (o.budget, o.tokens, o.reason),
            (100, 250, OverrunReason::UncutRow)
        );
        // The small one runs next step on its own.
        let b = cm.assemble("vision", "prefill").await.unwrap();
        assert_eq!(
            chunks(&b).iter().map(|(rid, _)| *rid).collect::<Vec<_>>(),
            vec![100 + i]
        );
        cm.complete(b.step, as_scheduled(&b), None).await.unwrap();
    }
    assert_eq!(
        cm.overrun_count("vision", "prefill", Some(OverrunReason::UncutRow))
            .await
            .unwrap(),
        9
    );
    let text = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
    let warned: Vec<&str> = text.lines().filter(|l| l.contains("WARN")).collect();
    assert_eq!(warned.len(), 4, "1st, 2nd, 4th and 8th overrun: {text}");
    for (line, nth) in warned.iter().zip(["#1 ", "#2 ", "#4 ", "#8 "]) {
        assert!(
            line.contains(nth) && line.contains("budget of 100") && line.contains("uncut_row"),
            "{line}"
        );
    }
}

#[actix::test]
async fn speculation_that_ran_over_its_estimate_is_an_estimate_overrun() {
    let cm = omni(1).await;
    for rid in 0..20 {
        cm.continue_row(rid, "llm", "decode", 4).await.unwrap();
    }
    let b = cm.assemble("llm", "mixed").await.unwrap();
    assert_eq!(b.rows.len(), 20);
    assert_eq!(b.scheduled_tokens, 80);
    // Every row ran 13 tokens instead of 4: 260 > 256.
    let out = cm.complete(b.step, vec![13; 20], None).await.unwrap();
    let o = out.overrun.expect("an overrun");
    assert_eq!(
        (o.tokens, o.reason),
        (260, OverrunReason::SpeculationEstimate)
    );
    // Continuing rows stay queued until finished.
    let b = cm.assemble("llm", "mixed").await.unwrap();
    assert_eq!(b.rows.len(), 20);
    cm.complete(b.step, as_scheduled(&b), None).await.unwrap();
    cm.forget_request(3).await.unwrap();
    cm.forget_request(3).await.unwrap(); // ending a request twice is a no-op
    let b = cm.assemble("llm", "mixed").await.unwrap();
    assert_eq!(b.rows.len(), 19);
    cm.complete(b.step, as_scheduled(&b), None).await.unwrap();
}

#[actix::test]
async fn forget_request_mid_prefill_drops_the_input_and_stops_its_chunks() {
    let cm = omni(16).await;
    cm.admit(1, "llm", "prefill", tokens(1000), 0)
        .await
        .unwrap();
    cm.admit(2, "llm", "prefill", tokens(100), 0).await.unwrap();
    let b = cm.assemble("llm", "mixed").await.unwrap();
    assert_eq!(
        chunks(&b).iter().map(|(r, _)| *r).collect::<Vec<_>>(),
        vec![1]
    );
    cm.complete(b.step, as_scheduled(&b), None).await.unwrap();
    cm.forget_request(1).await.unwrap();
    assert_eq!(cm.prepared(1, "llm").await.unwrap(), None);
    let b = cm.assemble("llm", "mixed").await.unwrap();
    assert_eq!(
        chunks(&b).iter().map(|(r, _)| *r).collect::<Vec<_>>(),
        vec![2],
        "no further chunks of 1"
    );
    cm.complete(b.step, as_scheduled(&b), None).await.unwrap();
    assert_eq!(cm.prepared_totals().await.unwrap(), (0, 0));
    cm.forget_request(1).await.unwrap();
    cm.forget_request(999).await.unwrap();
}

#[actix::test]
async fn forget_during_a_step_runs_the_step_but_does_not_advance_the_row() {
    let cm = omni(16).await;
    cm.admit(1, "llm", "prefill", tokens(1000), 0)
        .await
        .unwrap();
    let b = cm.assemble("llm", "mixed").await.unwrap();
    cm.forget_request(1).await.unwrap();
    let out = cm.complete(b.step, as_scheduled(&b), None).await.unwrap();
    assert!(out.finished.is_empty());
    assert_eq!(stats(&cm).await, (0, 0));
    assert_eq!(cm.prepared_totals().await.unwrap(), (0, 0));
    // The request can come back under the same rid and starts over.
    cm.admit(1, "llm", "prefill", tokens(10), 0).await.unwrap();
    let b = cm.assemble("llm", "mixed").await.unwrap();
    assert_eq!(
        chunks(&b)[0].1,
        ChunkRange {
            start: 0,
            end: 10,
            total: 10,
            stride: 10
        }
    );
    cm.complete(b.step, as_scheduled(&b), None).await.unwrap();
}

#[actix::test]
async fn a_budget_change_between_assemble_and_complete_is_checked_against_the_old_budget() {
    let cm = omni(1).await;
    cm.admit(1, "llm", "prefill", tokens(1000), 0)
        .await
        .unwrap();
    let b = cm.assemble("llm", "mixed").await.unwrap();
    assert_eq!((b.budget, b.scheduled_tokens), (Some(256), 256));
    let lower = BTreeMap::from([(
        n("llm"),
        NodeBudget::PerWalk(BTreeMap::from([(
            n("mixed"),
            BudgetValue::tokens(100).unwrap(),
        )])),
    )]);
    cm.set_budgets(settings(1, lower)).await.unwrap();
    assert_eq!(
        cm.max_batch_tokens("llm", "mixed").await.unwrap(),
        Some(100)
    );
    let out = cm.complete(b.step, as_scheduled(&b), None).await.unwrap();
    assert!(
        out.overrun.is_none(),
        "256 tokens ran under the 256 the step was scheduled under"
    );
    let b = cm.assemble("llm", "mixed").await.unwrap();
    assert_eq!(
        (b.budget, b.scheduled_tokens),
        (Some(100), 96),
        "the next step: 100, aligned to 16"
    );
    cm.complete(b.step, as_scheduled(&b), None).await.unwrap();
}

#[actix::test]
async fn an_off_budget_or_no_chunking_node_runs_rows_whole() {
    let cm = omni(1).await;
    let off = BTreeMap::from([(
        n("llm"),
        NodeBudget::PerWalk(BTreeMap::from([(n("mixed"), BudgetValue::Off)])),
    )]);
    cm.set_budgets(settings(1, off)).await.unwrap();
    assert!(!cm.chunkable("llm", "mixed").await.unwrap());
    cm.admit(1, "llm", "prefill", tokens(5000), 0)
        .await
        .unwrap();
    cm.continue_row(2, "llm", "decode", 1).await.unwrap();
    let b = cm.assemble("llm", "mixed").await.unwrap();
    assert_eq!((b.budget, b.floor, b.caps.is_none()), (None, None, true));
    assert_eq!(b.scheduled_tokens, 5001);
    let out = cm.complete(b.step, vec![1, 5000], None).await.unwrap();
    assert!(out.overrun.is_none(), "no budget, no overrun");

    let mut s = settings(1, BTreeMap::new());
    s.no_chunking = [n("thinker")].into();
    cm.set_budgets(s).await.unwrap();
    assert_eq!(cm.max_batch_tokens("thinker", "mixed").await.unwrap(), None);
    assert_eq!(cm.walk_caps("thinker", "mixed").await.unwrap(), None);
    cm.admit(3, "thinker", "prefill", tokens(700), 0)
        .await
        .unwrap();
    let b = cm.assemble("thinker", "mixed").await.unwrap();
    assert_eq!(chunks(&b)[0].1.tokens(), 700);
    cm.complete(b.step, as_scheduled(&b), None).await.unwrap();
}

#[actix::test]
async fn a_refused_setting_changes_nothing() {
    let cm = omni(1).await;
    let before = cm.snapshot().await.unwrap();
    let bad = BTreeMap::from([
        (
            n("llm"),
            NodeBudget::PerWalk(BTreeMap::from([(
                n("mixed"),
                BudgetValue::tokens(10).unwrap(),
            )])),
        ),
        (
            n("ghost"),
            NodeBudget::All(BudgetValue::tokens(10).unwrap()),
        ),
    ]);
    let err = cm.set_budgets(settings(1, bad)).await.unwrap_err();
    assert!(err.to_string().contains("`ghost`"), "{err}");
    let after = cm.snapshot().await.unwrap();
    assert!(Arc::ptr_eq(&before, &after));
    assert_eq!(
        cm.max_batch_tokens("llm", "mixed").await.unwrap(),
        Some(256)
    );
}

#[actix::test]
async fn every_message_order_gets_an_error_or_a_documented_no_op() {
    let cm = ChunkingManagement::start("test", [("llm", SubmoduleCaps::new(["prefill"], false))])
        .unwrap();
    // Before policies.
    assert!(matches!(
        cm.assemble("llm", "prefill").await,
        Err(ChunkingError::PoliciesNotSet)
    ));
    assert!(matches!(
        cm.set_budgets(settings(1, BTreeMap::new())).await,
        Err(ChunkingError::PoliciesNotSet)
    ));
    cm.set_policies([(("llm", "prefill"), ChunkingPolicy::budget(8))])
        .await
        .unwrap();
    // The same policies again: no-op; different ones: refused.
    cm.set_policies([(("llm", "prefill"), ChunkingPolicy::budget(8))])
        .await
        .unwrap();
    assert!(cm
        .set_policies([(("llm", "prefill"), ChunkingPolicy::budget(9))])
        .await
        .is_err());
    assert!(matches!(
        cm.complete(42, vec![], None).await,
        Err(ChunkingError::UnknownStep { step: 42 })
    ));
    assert!(matches!(
        cm.assemble("nope", "prefill").await,
        Err(ChunkingError::UnknownNode { .. })
    ));
    assert!(matches!(
        cm.assemble("llm", "nope").await,
        Err(ChunkingError::UnknownWalk { .. })
    ));
    assert!(matches!(
        cm.admit(1, "llm", "prefill", tokens(0), 0).await,
        Err(ChunkingError::EmptyInput { .. })
    ));
    cm.admit(1, "llm", "prefill", tokens(20), 0).await.unwrap();
    assert!(matches!(
        cm.admit(1, "llm", "prefill", tokens(20), 0).await,
        Err(ChunkingError::AlreadyQueued { .. })
    ));
    assert!(matches!(
        cm.continue_row(1, "llm", "prefill", 1).await,
        Err(ChunkingError::StillPrefilling { .. })
    ));
    let b = cm.assemble("llm", "prefill").await.unwrap();
    assert_eq!(
        cm.assemble("llm", "prefill").await.unwrap(),
        b,
        "the step in flight, again"
    );
    assert!(matches!(
        cm.complete(b.step, vec![1, 2, 3], None).await,
        Err(ChunkingError::RanLengthMismatch { .. })
    ));
    cm.complete(b.step, as_scheduled(&b), None).await.unwrap();
    assert!(matches!(
        cm.complete(b.step, as_scheduled(&b), None).await,
        Err(ChunkingError::UnknownStep { .. })
    ));
    // Release and forget are idempotent and accept unknown rows.
    assert!(cm.release(1, "llm").await.unwrap());
    assert!(!cm.release(1, "llm").await.unwrap());
    cm.forget_request(1).await.unwrap();
    assert!(!cm.release(1, "llm").await.unwrap());
    assert!(!cm.release(1, "nope").await.unwrap());
    let b = cm.assemble("llm", "prefill").await.unwrap();
    assert!(b.rows.is_empty(), "the released row is gone");
    cm.complete(b.step, vec![], None).await.unwrap();
    assert_eq!(cm.prepared_totals().await.unwrap(), (0, 0));
}

#[actix::test]
async fn check_budget_counts_a_step_run_outside_the_scheduler() {
    let cm = omni(1).await;
    cm.continue_row(1, "llm", "decode", 2).await.unwrap();
    let b = cm.assemble("llm", "mixed").await.unwrap();
    assert_eq!(cm.check_budget(&b, &[2]).await.unwrap(), None);
    let o = cm.check_budget(&b, &[300]).await.unwrap().expect("overrun");
    assert_eq!(o.reason, OverrunReason::SpeculationEstimate);
    assert_eq!(cm.overrun_count("llm", "mixed", None).await.unwrap(), 1);
    assert!(matches!(
        cm.check_budget(&b, &[]).await,
        Err(ChunkingError::RanLengthMismatch {
            expected: 1,
            got: 0,
            ..
        })
    ));
    cm.complete(b.step, vec![2], None).await.unwrap();

    // An uncut row over the budget: the batch carries the plan's reason.
    cm.admit(9, "vision", "prefill", tokens(150), 0)
        .await
        .unwrap();
    let b = cm.assemble("vision", "prefill").await.unwrap();
    assert!(b.uncut_over_budget);
    let o = cm.check_budget(&b, &[150]).await.unwrap().expect("overrun");
    assert_eq!((o.budget, o.reason), (100, OverrunReason::UncutRow));
    cm.complete(b.step, vec![150], None).await.unwrap();
}

#[actix::test]
async fn a_panicking_actor_is_restarted_with_its_state_and_no_row_is_lost() {
    use mstar_chunking::actors::ActorKind;
    let cm = omni(16).await;
    for rid in 0..6 {
        cm.admit(rid, "llm", "prefill", tokens(700), 0)
            .await
            .unwrap();
    }
    let mut finished = Vec::new();
    for step in 0..100 {
        if step == 3 {
            for actor in [
                ActorKind::Scheduler,
                ActorKind::PreparedInputs,
                ActorKind::BudgetConfig,
                ActorKind::OverrunAccounting,
                ActorKind::PolicyRegistry,
            ] {
                let err = cm.inject_panic(actor).await.unwrap_err();
                assert!(matches!(err, ChunkingError::ActorPanicked { .. }), "{err}");
            }
        }
        let b = cm.assemble("llm", "mixed").await.unwrap();
        if b.rows.is_empty() {
            break;
        }
        let out = cm.complete(b.step, as_scheduled(&b), None).await.unwrap();
        finished.extend(out.finished);
    }
    finished.sort_unstable();
    assert_eq!(finished, (0..6).collect::<Vec<u64>>(), "every row finished");
    assert_eq!(cm.prepared_totals().await.unwrap(), (0, 0));
    assert_eq!(
        cm.max_batch_tokens("llm", "mixed").await.unwrap(),
        Some(256),
        "budgets kept"
    );
}
