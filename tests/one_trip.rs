//! One round trip per step (`ChunkingManagement::complete_and_assemble`), through the public
//! API of the core alone: it completes step N and answers the batch of step N+1, and keeps
//! every guarantee of `complete` + `assemble` (docs/step-lifecycle.md#one-round-trip-per-step): a
//! failed step reports 0 and runs again from the same place, a refused completion changes
//! nothing, an answer lost on the way is answered again without completing twice, the next
//! step can be abandoned, and row changes land before the next step is planned.

use std::future::Future;
use std::task::{Context, Waker};

mod common;

use common::{chunks, continuing, mixed_engine as engine, planned, prompt};
use mstar_chunking::{ChunkRange, ChunkingError, ErrorKind, NextStep};

#[actix::test]
async fn one_trip_per_step_cuts_a_prompt_as_two_trips_do() {
    let (two, one) = (engine("two-trips").await, engine("one-trip").await);
    for cm in [&two, &one] {
        cm.admit(1, "llm", "prefill", prompt(600), 0).await.unwrap();
        cm.admit(2, "llm", "prefill", prompt(100), 0).await.unwrap();
        cm.continue_row(9, "llm", "decode", 1).await.unwrap();
    }
    let mut by_two = Vec::new();
    loop {
        let b = two.assemble("llm", "mixed").await.unwrap();
        if b.rows.is_empty() {
            break;
        }
        by_two.push((chunks(&b), continuing(&b)));
        two.complete(b.step, planned(&b), None).await.unwrap();
        if by_two.len() == 5 {
            break;
        }
    }
    let mut by_one = Vec::new();
    let mut b = one.assemble("llm", "mixed").await.unwrap();
    let mut finished = Vec::new();
    while !b.rows.is_empty() && by_one.len() < by_two.len() {
        by_one.push((chunks(&b), continuing(&b)));
        let done = one
            .complete_and_assemble(
                b.step,
                planned(&b),
                Some(10.0),
                NextStep::new("llm", "mixed"),
            )
            .await
            .unwrap();
        assert_eq!(done.outcome.step, b.step);
        assert_eq!(done.outcome.measured_ms, Some(10.0));
        finished.extend(done.outcome.finished.iter().copied());
        let next = done.next.unwrap();
        assert!(next.step > b.step, "a new step");
        b = next;
    }
    assert_eq!(by_one, by_two, "the same batches, step by step");
    assert_eq!(finished, vec![1, 2]);
    assert_eq!(
        one.prepared_totals().await.unwrap(),
        (0, 0),
        "inputs released"
    );
}

#[actix::test]
async fn a_failed_step_reported_as_zero_runs_again_from_the_same_place() {
    let cm = engine("one-trip-failed").await;
    cm.admit(1, "llm", "prefill", prompt(600), 0).await.unwrap();
    let b = cm.assemble("llm", "mixed").await.unwrap();
    assert_eq!(chunks(&b)[0].1, ChunkRange::new(true, 0, 256, 600));
    let done = cm
        .complete_and_assemble(b.step, vec![0], None, NextStep::new("llm", "mixed"))
        .await
        .unwrap();
    assert_eq!((done.outcome.chunks, done.outcome.unrun_chunks), (0, 1));
    let again = done.next.unwrap();
    assert_ne!(again.step, b.step);
    assert_eq!(chunks(&again)[0].1, ChunkRange::new(true, 0, 256, 600));
    assert_eq!(again.rows[0].input.as_ref().unwrap().token_ids()[0], 0);
}

#[actix::test]
async fn a_refused_completion_changes_nothing_and_assembles_nothing() {
    let cm = engine("one-trip-refused").await;
    cm.admit(1, "llm", "prefill", prompt(600), 0).await.unwrap();
    let b = cm.assemble("llm", "mixed").await.unwrap();
    let err = cm
        .complete_and_assemble(b.step, vec![100], None, NextStep::new("llm", "mixed"))
        .await
        .unwrap_err();
    assert!(
        matches!(err, ChunkingError::PartialChunk { rid: 1, .. }),
        "{err}"
    );
    let err = cm
        .complete_and_assemble(
            b.step,
            vec![256],
            Some(f64::NAN),
            NextStep::new("llm", "mixed"),
        )
        .await
        .unwrap_err();
    assert!(matches!(err, ChunkingError::BadMeasurement { .. }), "{err}");
    // A step of `llm` named with another node's next step.
    let err = cm
        .complete_and_assemble(b.step, vec![256], None, NextStep::new("vision", "mixed"))
        .await
        .unwrap_err();
    assert_eq!(err, ChunkingError::UnknownStep { step: b.step });
    let err = cm
        .complete_and_assemble(b.step + 100, vec![256], None, NextStep::new("llm", "mixed"))
        .await
        .unwrap_err();
    assert_eq!(err, ChunkingError::UnknownStep { step: b.step + 100 });
    let stats = cm.queue_stats().await.unwrap();
    assert_eq!((stats.steps_in_flight, stats.mid_prefill_rows), (1, 0));
    assert_eq!(
        cm.assemble("llm", "mixed").await.unwrap(),
        b,
        "still in flight"
    );
}

#[actix::test]
async fn a_lost_answer_is_answered_again_and_the_step_completes_once() {
    let cm = engine("one-trip-lost").await;
    cm.admit(1, "llm", "prefill", prompt(600), 0).await.unwrap();
    let b = cm.assemble("llm", "mixed").await.unwrap();
    {
        let mut lost = std::pin::pin!(cm.complete_and_assemble(
            b.step,
            vec![256],
            Some(3.0),
            NextStep::new("llm", "mixed")
        ));
        let polled = lost.as_mut().poll(&mut Context::from_waker(Waker::noop()));
        assert!(polled.is_pending());
        // The Scheduler handled it: step N completed, step N+1 in flight.
        let stats = cm.queue_stats().await.unwrap();
        assert_eq!((stats.steps_in_flight, stats.mid_prefill_rows), (1, 1));
    } // dropped with its answer
    let first = cm
        .complete_and_assemble(b.step, vec![256], Some(3.0), NextStep::new("llm", "mixed"))
        .await
        .unwrap();
    let again = cm
        .complete_and_assemble(b.step, vec![256], Some(3.0), NextStep::new("llm", "mixed"))
        .await
        .unwrap();
    assert_eq!(first, again, "the same outcome and the same next batch");
    assert_eq!(first.outcome.chunks, 1);
    let next = first.next.unwrap();
    assert_eq!(
        chunks(&next)[0].1,
        ChunkRange::new(false, 256, 512, 600),
        "the first chunk advanced the row once"
    );
    assert_eq!(cm.assemble("llm", "mixed").await.unwrap(), next);

    // A repeat that reports differently is refused, and changes nothing.
    for (ran, ms) in [
        (vec![0], Some(3.0)),
        (vec![256], None),
        (vec![256], Some(4.0)),
    ] {
        let err = cm
            .complete_and_assemble(b.step, ran, ms, NextStep::new("llm", "mixed"))
            .await
            .unwrap_err();
        assert_eq!(err, ChunkingError::CompletedDifferently { step: b.step });
        assert_eq!(err.kind(), ErrorKind::Conflict);
    }

    // The next step's answer lost too, then repeated.
    {
        let mut lost = std::pin::pin!(cm.complete_and_assemble(
            next.step,
            planned(&next),
            None,
            NextStep::new("llm", "mixed")
        ));
        let polled = lost.as_mut().poll(&mut Context::from_waker(Waker::noop()));
        assert!(polled.is_pending());
    }
    let done = cm
        .complete_and_assemble(
            next.step,
            planned(&next),
            None,
            NextStep::new("llm", "mixed"),
        )
        .await
        .unwrap();
    let last = done.next.unwrap();
    assert_eq!(chunks(&last)[0].1, ChunkRange::new(false, 512, 600, 600));
    let done = cm
        .complete_and_assemble(
            last.step,
            planned(&last),
            None,
            NextStep::new("llm", "mixed"),
        )
        .await
        .unwrap();
    assert_eq!(done.outcome.finished, vec![1]);
    assert_eq!(cm.prepared_totals().await.unwrap(), (0, 0));
    // The completion of an earlier step is no longer the node's last: not answered again.
    assert_eq!(
        cm.complete_and_assemble(b.step, vec![256], Some(3.0), NextStep::new("llm", "mixed"))
            .await
            .unwrap_err(),
        ChunkingError::UnknownStep { step: b.step }
    );
}

#[actix::test]
async fn the_next_step_can_be_abandoned() {
    let cm = engine("one-trip-abandon").await;
    cm.admit(1, "llm", "prefill", prompt(600), 0).await.unwrap();
    let b = cm.assemble("llm", "mixed").await.unwrap();
    let next = cm
        .complete_and_assemble(b.step, vec![256], None, NextStep::new("llm", "mixed"))
        .await
        .unwrap()
        .next
        .unwrap();
    // Uses of `abandon`.
    cm.abandon(next.step).await.unwrap();
    assert_eq!(cm.queue_stats().await.unwrap().steps_in_flight, 0);
    let again = cm.assemble("llm", "mixed").await.unwrap();
    assert_ne!(again.step, next.step);
    assert_eq!(
        chunks(&again),
        chunks(&next),
        "the same chunk, planned again"
    );
}

#[actix::test]
async fn row_changes_land_before_the_next_step_is_planned() {
    let cm = engine("one-trip-changes").await;
    cm.admit(1, "llm", "prefill", prompt(100), 0).await.unwrap();
    cm.continue_row(7, "llm", "decode", 1).await.unwrap();
    let b = cm.assemble("llm", "mixed").await.unwrap();
    assert_eq!(continuing(&b), vec![7]);
    // Prompt 1 ran its final chunk: it decodes from the next step; request 7 is done.
    let next = NextStep::new("llm", "mixed")
        .forget_request(7)
        .continue_row(1, "decode", 1);
    assert_eq!(next.changes(), 2);
    let done = cm
        .complete_and_assemble(b.step, planned(&b), None, next.clone())
        .await
        .unwrap();
    assert_eq!(done.outcome.finished, vec![1]);
    let b2 = done.next.unwrap();
    assert_eq!(continuing(&b2), vec![1]);
    assert!(chunks(&b2).is_empty());

    // A refused change: the completion stands, the changes after it are not applied, and no
    // step is assembled.
    cm.admit(2, "llm", "prefill", prompt(40), 0).await.unwrap();
    let refused = NextStep::new("llm", "mixed")
        .continue_row(1, "decode", 0)
        .forget_request(1);
    let done = cm
        .complete_and_assemble(b2.step, planned(&b2), None, refused.clone())
        .await
        .unwrap();
    assert_eq!(done.outcome.step, b2.step);
    assert!(
        matches!(done.next, Err(ChunkingError::ZeroEstimate { .. })),
        "{:?}",
        done.next
    );
    let stats = cm.queue_stats().await.unwrap();
    assert_eq!((stats.steps_in_flight, stats.continuing_rows), (0, 1));
    // Repeated, the answer is the same, and still nothing is assembled.
    let again = cm
        .complete_and_assemble(b2.step, planned(&b2), None, refused)
        .await
        .unwrap();
    assert_eq!(again, done);
    assert_eq!(cm.queue_stats().await.unwrap().steps_in_flight, 0);
    let b3 = cm.assemble("llm", "mixed").await.unwrap();
    assert_eq!(continuing(&b3), vec![1]);
    assert_eq!(chunks(&b3), vec![(2, ChunkRange::new(true, 0, 40, 40))]);
}

#[actix::test]
async fn prompts_admitted_with_a_completion_run_in_the_next_step() {
    let cm = engine("one-trip-admit").await;
    cm.admit(1, "llm", "prefill", prompt(100), 0).await.unwrap();
    let b = cm.assemble("llm", "mixed").await.unwrap();
    let next = NextStep::new("llm", "mixed")
        .continue_row(1, "decode", 1)
        .admit(2, "prefill", prompt(300), 0)
        .admit(3, "prefill", prompt(50), 10);
    let done = cm
        .complete_and_assemble(b.step, planned(&b), None, next)
        .await
        .unwrap();
    let b2 = done.next.unwrap();
    assert_eq!(continuing(&b2), vec![1]);
    // 255 tokens left: prompt 2 is cut to 240 (align 16), prompt 3 (40 after its cache) waits.
    assert_eq!(chunks(&b2), vec![(2, ChunkRange::new(true, 0, 240, 300))]);
    let input = b2.rows[1]
        .input
        .as_ref()
        .expect("the admitted input is cut");
    assert_eq!(input.token_ids()[..3], [0, 1, 2]);
    assert_eq!(cm.prepared_totals().await.unwrap(), (2, 350));

    // A refused admission (an empty prompt): the completion and the admissions before it
    // stand, with their inputs held; no step is assembled.
    let next = NextStep::new("llm", "mixed")
        .admit(4, "prefill", prompt(20), 0)
        .admit(5, "prefill", prompt(0), 0)
        .admit(6, "prefill", prompt(20), 0);
    let done = cm
        .complete_and_assemble(b2.step, planned(&b2), None, next)
        .await
        .unwrap();
    assert!(
        matches!(done.next, Err(ChunkingError::EmptyInput { rid: 5, .. })),
        "{:?}",
        done.next
    );
    let stats = cm.queue_stats().await.unwrap();
    assert_eq!((stats.steps_in_flight, stats.prefill_rows), (0, 3));
    assert_eq!(cm.prepared_totals().await.unwrap(), (3, 370));
    let b3 = cm.assemble("llm", "mixed").await.unwrap();
    assert_eq!(
        chunks(&b3).iter().map(|(rid, _)| *rid).collect::<Vec<_>>(),
        vec![2, 3, 4]
    );
    // The next step's walk is checked before anything changes.
    let err = cm
        .complete_and_assemble(b3.step, planned(&b3), None, NextStep::new("llm", "nowhere"))
        .await
        .unwrap_err();
    assert!(matches!(err, ChunkingError::UnknownWalk { .. }), "{err}");
    assert_eq!(cm.queue_stats().await.unwrap().steps_in_flight, 1);
}

#[actix::test]
async fn a_continuing_row_carries_its_context_on_the_one_trip_step() {
    let cm = engine("one-trip-context").await;
    cm.admit(1, "llm", "prefill", prompt(100), 0).await.unwrap();
    let b = cm.assemble("llm", "mixed").await.unwrap();
    // Prompt 1 ran whole; it decodes with its context (the prompt and the token it made),
    // through the next step's row changes, and the helpers read each row's work.
    let row = &b.rows[0];
    assert!(row.is_chunk() && row.is_final());
    assert_eq!(row.range(), Some(ChunkRange::new(true, 0, 100, 100)));
    let next = NextStep::new("llm", "mixed").continue_row_with_context(1, "decode", 1, 101);
    let done = cm
        .complete_and_assemble(b.step, planned(&b), None, next)
        .await
        .unwrap();
    let b2 = done.next.unwrap();
    assert_eq!(continuing(&b2), vec![1]);
    let row = &b2.rows[0];
    assert_eq!(
        (row.context, row.estimate(), row.range()),
        (101, Some(1), None)
    );
    assert!(!row.is_chunk() && !row.is_final());
    assert_eq!(row.kind().as_str(), "continue");
}
