//! An embedder's first day (docs/embedding.md): a tokio engine with two models in one
//! process, built from the README and docs/embedding.md alone, with no cargo feature. Every
//! configuration that would stall it or leave it unchunked is an error, never a silent state:
//! - "off" is written, never the result of a failed conversion (a compile-time property: see
//!   the `compile_fail` example on `BudgetSettings`);
//! - settings that leave a chunkable walk unchunked (a forgotten combined walk) are refused,
//!   naming the walk;
//! - an empty batch does not hold the node: a prompt admitted after it is picked up;
//! - a tokio runtime without timers works (requests are timed on the actors' thread);
//! - `complete(step, ran)` and `abandon(step)` name the step the same way.

use std::num::NonZeroU32;

use mstar_chunking::budget::BudgetError;
use mstar_chunking::{
    BudgetSettings, BudgetValue, ChunkingError, ChunkingManagement, ChunkingPolicy, LatencyModel,
    PreparedInput, RowWork, SubmoduleCaps,
};

fn tokens(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).expect("a budget is at least 1 token")
}

/// A runtime with no time driver: the caller's timers are never needed.
fn runtime_without_timers() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("a current-thread runtime")
}

/// The README's model: node `llm`, whose submodule cuts `prefill` and `mixed`, and a policy on
/// `mixed` only.
fn start(model: &str) -> (ChunkingManagement, mstar_chunking::ActorThread) {
    ChunkingManagement::start_on_own_thread(
        model,
        [("llm", SubmoduleCaps::new(["prefill", "mixed"], false))],
    )
    .expect("the actors start")
}

fn readme_settings() -> BudgetSettings {
    BudgetSettings::new(["prefill", "decode", "mixed"])
        .combined("mixed", ["prefill", "decode"])
        .budget("llm", tokens(1024))
}

#[test]
fn a_forgotten_combined_walk_is_refused_naming_the_walk() {
    let (cm, _actors) = start("forgot-combined");
    runtime_without_timers().block_on(async {
        cm.set_policies([(("llm", "mixed"), ChunkingPolicy::budget(2048).aligned(16))])
            .await
            .unwrap();
        // The README's settings without `.combined("mixed", ...)`: `prefill` rows would run
        // uncut in `prefill` steps and an engine assembling `mixed` would wait forever.
        let forgot =
            BudgetSettings::new(["prefill", "decode", "mixed"]).budget("llm", tokens(1024));
        let err = cm.set_budgets(forgot).await.unwrap_err();
        let problems = err.budget_errors().expect("a budget refusal");
        assert_eq!(
            problems.0,
            vec![BudgetError::WalkNeverChunked {
                node: "llm".into(),
                walk: "prefill".into(),
                combined: "mixed".into(),
            }]
        );
        let text = err.to_string();
        assert!(
            text.contains("`prefill`")
                && text.contains("`mixed`")
                && text.contains("would never run its rows"),
            "{text}"
        );
        // Nothing was applied: the model's budgets still answer.
        assert_eq!(
            cm.max_batch_tokens("llm", "mixed").await.unwrap(),
            Some(2048)
        );
        // `prefill` has no policy of its own, so a per-walk `off` for it is refused too (rule
        // 3): the ways to run it are combining it, or a `no_chunking` node.
        let off = BudgetSettings::new(["prefill", "decode", "mixed"])
            .budget("llm", tokens(1024))
            .walk_budget("llm", "prefill", BudgetValue::Off);
        assert!(cm.set_budgets(off).await.is_err());
        cm.set_budgets(BudgetSettings::new(["prefill", "decode", "mixed"]).no_chunking("llm"))
            .await
            .expect("a no_chunking node chunks nothing by decision");
        cm.set_budgets(readme_settings()).await.unwrap();
    });
}

#[test]
fn an_empty_batch_does_not_hold_the_node() {
    let (cm, _actors) = start("empty-batch");
    runtime_without_timers().block_on(async {
        cm.set_policies([(("llm", "mixed"), ChunkingPolicy::budget(2048).aligned(16))])
            .await
            .unwrap();
        cm.set_budgets(readme_settings()).await.unwrap();
        let empty = cm.assemble("llm", "mixed").await.unwrap();
        assert!(empty.rows.is_empty());
        assert_eq!(cm.queue_stats().await.unwrap().steps_in_flight, 0);
        // A prompt admitted while the engine holds the empty batch is planned at once.
        cm.admit(1, "llm", "prefill", PreparedInput::tokens(vec![7; 3000]), 0)
            .await
            .unwrap();
        let step = cm.assemble("llm", "mixed").await.unwrap();
        assert_ne!(step.step, empty.step);
        assert_eq!(step.rows.len(), 1);
        assert_eq!(step.rows[0].tokens(), 1024);
        // The empty batch can still be completed with no rows (once), or abandoned; it changes
        // nothing and the real step stays in flight.
        let out = cm.complete(empty.step, Vec::new(), None).await.unwrap();
        assert_eq!((out.step, out.chunks, out.tokens.ran), (empty.step, 0, 0));
        assert!(matches!(
            cm.complete(empty.step, Vec::new(), None).await,
            Err(ChunkingError::UnknownStep { .. })
        ));
        assert_eq!(cm.assemble("llm", "mixed").await.unwrap(), step);
        // A row reported for an empty batch is refused like any other mismatch.
        let empty2 = {
            cm.complete(step.step, vec![1024], None).await.unwrap();
            let next = cm.assemble("llm", "mixed").await.unwrap();
            cm.complete(next.step, vec![next.rows[0].tokens()], None)
                .await
                .unwrap();
            let last = cm.assemble("llm", "mixed").await.unwrap();
            cm.complete(last.step, vec![last.rows[0].tokens()], None)
                .await
                .unwrap();
            cm.forget_request(1).await.unwrap();
            cm.assemble("llm", "mixed").await.unwrap()
        };
        assert!(empty2.rows.is_empty());
        assert!(matches!(
            cm.complete(empty2.step, vec![1], None).await,
            Err(ChunkingError::RanLengthMismatch { .. })
        ));
        cm.abandon(empty2.step).await.unwrap();
        assert!(matches!(
            cm.abandon(empty2.step).await,
            Err(ChunkingError::UnknownStep { .. })
        ));
    });
}

/// Two models in one tokio process without timers, each with its own actors, budgets and (for
/// the second) a time budget from a latency model: both chunk as configured, and the engine
/// loop reports measured step times.
#[test]
fn two_models_in_one_tokio_process_chunk_as_configured() {
    let (a, _a) = start("model-a");
    let (b, _b) = start("model-b");
    runtime_without_timers().block_on(async {
        for cm in [&a, &b] {
            cm.set_policies([(("llm", "mixed"), ChunkingPolicy::budget(2048).aligned(16))])
                .await
                .unwrap();
        }
        a.set_budgets(readme_settings()).await.unwrap();
        let model = LatencyModel::try_new(5.0, 0.01, 0.0, 0.0).unwrap();
        b.set_budgets(readme_settings().cost("llm", model).max_step_ms("llm", 9.0))
            .await
            .unwrap();
        a.admit(1, "llm", "prefill", PreparedInput::tokens(vec![1; 5000]), 0)
            .await
            .unwrap();
        b.admit(1, "llm", "prefill", PreparedInput::tokens(vec![2; 5000]), 0)
            .await
            .unwrap();
        // 5 ms + 0.01 ms a token within 9 ms: 400 tokens, aligned to 16.
        for (cm, want) in [(&a, 1024), (&b, 400)] {
            let batch = cm.assemble("llm", "mixed").await.unwrap();
            let RowWork::Chunk { range, .. } = batch.rows[0].work else {
                panic!("a chunk row");
            };
            assert_eq!(range.tokens(), want, "{}", cm.model());
            let out = cm
                .complete(batch.step, vec![range.tokens()], Some(8.5))
                .await
                .unwrap();
            assert_eq!(out.time_overrun, None);
        }
    });
}

#[test]
fn requests_time_out_on_the_actors_thread_not_the_callers() {
    let (cm, actors) = start("no-timers");
    let rt = runtime_without_timers();
    rt.block_on(async {
        // Each of these is timed (the default 5 s); none needs the caller's timer.
        cm.set_policies([(("llm", "mixed"), ChunkingPolicy::budget(64))])
            .await
            .unwrap();
        assert_eq!(cm.max_batch_tokens("llm", "mixed").await.unwrap(), Some(64));
    });
    actors.stop();
    let stopped = rt.block_on(cm.max_batch_tokens("llm", "mixed"));
    assert!(
        matches!(stopped, Err(ChunkingError::ActorStopped { .. })),
        "{stopped:?}"
    );
}
