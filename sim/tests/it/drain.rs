//! The explicit shutdown (`docs/actors.md#shutdown`): `begin_drain` stops admissions and new
//! steps while the step in flight can still complete; `drain` drops what is left and reports
//! it, leaving nothing held.

use mstar_chunking::{
    BudgetSettings, ChunkingError, ChunkingManagement, ChunkingPolicy, DrainReport, ErrorKind,
    NextStep, PreparedInput, SubmoduleCaps,
};

fn tokens(n: u32) -> PreparedInput {
    PreparedInput::tokens((0..n).collect::<Vec<u32>>())
}

async fn started() -> ChunkingManagement {
    let cm = ChunkingManagement::start("drain", [("llm", SubmoduleCaps::new(["prefill"], false))])
        .unwrap();
    cm.set_policies([
        (("llm", "prefill"), ChunkingPolicy::budget(64)),
        (("llm", "decode"), ChunkingPolicy::budget(8)),
    ])
    .await
    .unwrap();
    cm.set_budgets(BudgetSettings::new(["prefill", "decode"]))
        .await
        .unwrap();
    cm
}

#[actix::test]
async fn a_drain_refuses_new_work_lets_the_step_finish_and_leaves_nothing_held() {
    let cm = started().await;
    let other = cm.clone();
    cm.admit(1, "llm", "prefill", tokens(100), 0).await.unwrap();
    cm.admit(2, "llm", "prefill", tokens(30), 0).await.unwrap();
    cm.continue_row(3, "llm", "decode", 1).await.unwrap();
    let step = cm.assemble("llm", "prefill").await.unwrap();
    assert_eq!(step.rows.len(), 1, "a budget of 64 runs one chunk of rid 1");

    assert_eq!(cm.begin_drain().await.unwrap(), 1, "one step in flight");
    // Every handle of the instance refuses new work, clearly.
    let refused = other.admit(4, "llm", "prefill", tokens(10), 0).await;
    assert_eq!(refused, Err(ChunkingError::Draining));
    assert_eq!(refused.unwrap_err().kind(), ErrorKind::Fatal);
    assert_eq!(
        cm.continue_row(5, "llm", "decode", 1).await,
        Err(ChunkingError::Draining)
    );
    assert_eq!(
        cm.assemble("llm", "decode").await.unwrap_err(),
        ChunkingError::Draining
    );
    // The step in flight completes; the next step it asks for is refused.
    let ran: Vec<u32> = step.rows.iter().map(|r| r.tokens()).collect();
    let done = cm
        .complete_and_assemble(step.step, ran, None, NextStep::new("llm", "prefill"))
        .await
        .unwrap();
    assert!(done.outcome.finished.is_empty(), "rid 1 has 36 tokens left");
    assert_eq!(done.next.unwrap_err(), ChunkingError::Draining);
    // What is held before the drain: rid 1 mid-prefill, rid 2 waiting, rid 3 decoding.
    let held = cm.queue_stats().await.unwrap();
    assert_eq!(
        (
            held.prefill_rows,
            held.mid_prefill_rows,
            held.continuing_rows,
            held.steps_in_flight
        ),
        (2, 1, 1, 0)
    );
    assert_eq!(cm.prepared_totals().await.unwrap(), (2, 130));

    let report = cm.drain().await.unwrap();
    assert_eq!(
        report,
        DrainReport {
            steps_abandoned: 0,
            requests: 3,
            rows: 3,
            prepared_inputs: 2,
            prepared_tokens: 130,
        }
    );
    // Nothing is held, and the instance stays shut.
    assert_eq!(cm.prepared_totals().await.unwrap(), (0, 0));
    let stats = cm.queue_stats().await.unwrap();
    assert_eq!(
        (
            stats.prefill_rows,
            stats.continuing_rows,
            stats.steps_in_flight
        ),
        (0, 0, 0)
    );
    assert_eq!(
        cm.admit(1, "llm", "prefill", tokens(10), 0).await,
        Err(ChunkingError::Draining)
    );
    assert_eq!(cm.drain().await.unwrap(), DrainReport::default());
}

#[actix::test]
async fn a_drain_abandons_the_step_still_in_flight() {
    let cm = started().await;
    cm.admit(1, "llm", "prefill", tokens(100), 0).await.unwrap();
    let step = cm.assemble("llm", "prefill").await.unwrap();
    assert_eq!(cm.queue_stats().await.unwrap().steps_in_flight, 1);
    let report = cm.drain().await.unwrap();
    assert_eq!(
        (
            report.steps_abandoned,
            report.requests,
            report.prepared_inputs
        ),
        (1, 1, 1)
    );
    // The abandoned step is gone: completing it now is refused.
    assert_eq!(
        cm.complete(step.step, vec![64], None).await.unwrap_err(),
        ChunkingError::UnknownStep { step: step.step }
    );
    assert_eq!(cm.prepared_totals().await.unwrap(), (0, 0));
    assert_eq!(cm.queue_stats().await.unwrap().steps_in_flight, 0);
}
