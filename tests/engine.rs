//! An engine's view of the step lifecycle (docs/step-lifecycle.md), through the
//! public API only and with no cargo feature, as a crate depending on
//! `mstar-chunking = { default-features = false }` (the default features are the same core) sees it: a failed step, a dropped `assemble`
//! future and an abandoned step skip no token; two facades in one process keep separate metric
//! series; misuse of the runtime is an error, not a panic.

use std::future::Future;
use std::num::NonZeroU32;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Waker};

mod common;

use common::{chunks, planned, prompt};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use mstar_chunking::{
    Batch, BudgetSettings, ChunkRange, ChunkingError, ChunkingManagement, ChunkingPolicy,
    ErrorKind, SubmoduleCaps,
};

/// The process-wide recorder of this test binary, installed once: the actors record from
/// their own arbiter, so a thread-local recorder would not see them.
fn snapshotter() -> &'static Snapshotter {
    static SNAPSHOTTER: OnceLock<Snapshotter> = OnceLock::new();
    SNAPSHOTTER.get_or_init(|| {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        recorder
            .install()
            .expect("the only recorder of this test binary");
        snapshotter
    })
}

/// A facade for model `model` with one node `llm`: `prefill` and `decode` under `mixed`, a
/// budget of 256, align 16, floor 32.
async fn engine(model: &str) -> ChunkingManagement {
    snapshotter();
    common::mixed_engine(model).await
}

#[actix::test]
async fn a_failed_step_runs_its_chunks_again_from_the_same_place() {
    let cm = engine("failed-step").await;
    cm.admit(1, "llm", "prefill", prompt(600), 0).await.unwrap();
    let b = cm.assemble("llm", "mixed").await.unwrap();
    assert_eq!(chunks(&b)[0].1, ChunkRange::new(true, 0, 256, 600));
    let out = cm.complete(b.step, vec![0], None).await.unwrap();
    assert_eq!((out.chunks, out.unrun_chunks), (0, 1));
    assert!(out.finished.is_empty());

    let again = cm.assemble("llm", "mixed").await.unwrap();
    assert_ne!(again.step, b.step, "a new step");
    assert_eq!(
        chunks(&again)[0].1,
        ChunkRange::new(true, 0, 256, 600),
        "[0, 256) never ran: it is planned again, still as the first chunk"
    );
    assert_eq!(
        again.rows[0].input.as_ref().unwrap().token_ids()[0],
        0,
        "the input view starts at token 0"
    );
    cm.complete(again.step, planned(&again), None)
        .await
        .unwrap();
    let next = cm.assemble("llm", "mixed").await.unwrap();
    assert_eq!(chunks(&next)[0].1, ChunkRange::new(false, 256, 512, 600));
}

#[actix::test]
async fn a_chunk_that_ran_part_of_its_tokens_is_refused_and_the_step_stays_in_flight() {
    let cm = engine("partial").await;
    cm.admit(1, "llm", "prefill", prompt(600), 0).await.unwrap();
    cm.admit(2, "llm", "prefill", prompt(40), 0).await.unwrap();
    let b = cm.assemble("llm", "mixed").await.unwrap();
    assert_eq!(planned(&b), vec![256]);
    let err = cm.complete(b.step, vec![100], None).await.unwrap_err();
    assert_eq!(
        err,
        ChunkingError::PartialChunk {
            step: b.step,
            rid: 1,
            planned: 256,
            ran: 100
        }
    );
    let msg = err.to_string();
    assert!(
        msg.contains("rid 1") && msg.contains("256") && msg.contains("100"),
        "{msg}"
    );
    assert_eq!(err.kind(), ErrorKind::InvalidRequest);
    assert!(!err.is_retryable());
    let stats = cm.queue_stats().await.unwrap();
    assert_eq!(
        (stats.steps_in_flight, stats.mid_prefill_rows),
        (1, 0),
        "nothing changed"
    );
    assert_eq!(cm.assemble("llm", "mixed").await.unwrap(), b);
    // Also more than planned, and a ran list of the wrong length.
    assert!(matches!(
        cm.complete(b.step, vec![257], None).await,
        Err(ChunkingError::PartialChunk { .. })
    ));
    assert!(matches!(
        cm.complete(b.step, vec![256, 0], None).await,
        Err(ChunkingError::RanLengthMismatch { .. })
    ));
    cm.complete(b.step, vec![256], None).await.unwrap();
    assert_eq!(cm.queue_stats().await.unwrap().mid_prefill_rows, 1);
}

#[actix::test]
async fn an_abandoned_step_advances_and_releases_nothing_and_counts_no_overrun() {
    let cm = engine("abandon").await;
    cm.admit(1, "llm", "prefill", prompt(100), 0).await.unwrap();
    cm.continue_row(7, "llm", "decode", 300).await.unwrap(); // alone over the budget
    let b = cm.assemble("llm", "mixed").await.unwrap();
    assert_eq!(b.rows.len(), 1, "the over-budget decode row runs alone");
    assert!(matches!(
        cm.abandon(b.step + 1).await,
        Err(ChunkingError::UnknownStep { .. })
    ));
    cm.abandon(b.step).await.unwrap();
    assert!(matches!(
        cm.abandon(b.step).await,
        Err(ChunkingError::UnknownStep { .. })
    ));
    assert!(matches!(
        cm.complete(b.step, vec![300], None).await,
        Err(ChunkingError::UnknownStep { .. })
    ));
    assert_eq!(cm.overrun_count("llm", "mixed", None).await.unwrap(), 0);
    assert_eq!(cm.prepared_totals().await.unwrap(), (1, 100));

    cm.forget_request(7).await.unwrap();
    let b = cm.assemble("llm", "mixed").await.unwrap();
    assert_eq!(chunks(&b), vec![(1, ChunkRange::new(true, 0, 100, 100))]);
    let out = cm.complete(b.step, planned(&b), None).await.unwrap();
    assert_eq!(out.finished, vec![1]);
    assert_eq!(cm.prepared_totals().await.unwrap(), (0, 0));
}

#[actix::test]
async fn a_dropped_assemble_future_loses_nothing() {
    let cm = engine("dropped").await;
    cm.admit(1, "llm", "prefill", prompt(300), 0).await.unwrap();
    {
        let mut lost = std::pin::pin!(cm.assemble("llm", "mixed"));
        let polled = lost.as_mut().poll(&mut Context::from_waker(Waker::noop()));
        assert!(polled.is_pending());
        // Answered after the Scheduler handled the assemble: the step is in flight.
        assert_eq!(cm.queue_stats().await.unwrap().steps_in_flight, 1);
    } // dropped with its answer, as a `select!` or a timeout would
    let b = cm.assemble("llm", "mixed").await.unwrap();
    let again = cm.assemble("llm", "mixed").await.unwrap();
    assert_eq!(b, again);
    let (first, second) = (
        b.rows[0].input.as_ref().unwrap(),
        again.rows[0].input.as_ref().unwrap(),
    );
    assert!(
        std::ptr::eq(first.token_ids(), second.token_ids()),
        "the same input view, not a copy"
    );
    assert_eq!(chunks(&b)[0].1, ChunkRange::new(true, 0, 256, 300));
    cm.complete(b.step, planned(&b), None).await.unwrap();
    let b = cm.assemble("llm", "mixed").await.unwrap();
    assert_eq!(chunks(&b)[0].1, ChunkRange::new(false, 256, 300, 300));
}

#[actix::test]
async fn assembling_another_walk_while_a_step_is_in_flight_names_that_step() {
    let cm = engine("other-walk").await;
    cm.admit(1, "llm", "prefill", prompt(10), 0).await.unwrap();
    let b = cm.assemble("llm", "mixed").await.unwrap();
    let err = cm.assemble("llm", "prefill").await.unwrap_err();
    assert!(
        matches!(&err, ChunkingError::StepInFlight { step, walk, .. } if *step == b.step && &**walk == "mixed"),
        "{err}"
    );
    assert_eq!(err.kind(), ErrorKind::Conflict);
}

/// Every series recorded so far: name, labels, value (a histogram's sample count). One
/// snapshot per check: the debugging recorder drains what a snapshot reads.
type Series = Vec<(String, Vec<(String, String)>, f64)>;

fn series() -> Series {
    snapshotter()
        .snapshot()
        .into_vec()
        .into_iter()
        .map(|(key, _, _, v)| {
            let k = key.key();
            let labels = k
                .labels()
                .map(|l| (l.key().to_owned(), l.value().to_owned()))
                .collect();
            let v = match v {
                DebugValue::Counter(c) => c as f64,
                DebugValue::Gauge(g) => g.into_inner(),
                DebugValue::Histogram(h) => h.len() as f64,
            };
            (k.name().to_owned(), labels, v)
        })
        .collect()
}

/// The value of `name` with labels including all of `labels`, summed over the rest.
fn value(seen: &Series, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let mut found = None;
    for (n, ls, v) in seen {
        let matches = n == name
            && labels
                .iter()
                .all(|(l, want)| ls.iter().any(|(k, x)| k == l && x == want));
        if matches {
            *found.get_or_insert(0.0) += v;
        }
    }
    found
}

#[actix::test]
async fn two_facades_in_one_process_export_separate_series() {
    let a = engine("model-a").await;
    let b = engine("model-b").await;
    let idle = engine("model-idle").await;
    idle.prepared_totals().await.unwrap();
    a.admit(1, "llm", "prefill", prompt(1000), 0).await.unwrap();
    a.admit(2, "llm", "prefill", prompt(1000), 0).await.unwrap();
    b.admit(1, "llm", "prefill", prompt(50), 0).await.unwrap();
    // The gauges are set by PreparedInputs; a later answer from it comes after them.
    a.prepared_totals().await.unwrap();
    b.prepared_totals().await.unwrap();
    let seen = series();
    let held = |model| {
        value(
            &seen,
            "mstar_chunking_prepared_inputs",
            &[("model", model), ("node", "llm")],
        )
    };
    assert_eq!(held("model-a"), Some(2.0));
    assert_eq!(held("model-b"), Some(1.0));
    assert_eq!(
        value(
            &seen,
            "mstar_chunking_rows_waiting",
            &[("model", "model-a"), ("node", "llm")]
        ),
        Some(2.0)
    );
    // A facade that holds nothing exports its queue and prepared-input series at 0.
    for name in [
        "mstar_chunking_rows_waiting",
        "mstar_chunking_rows_mid_prefill",
        "mstar_chunking_rows_continuing",
        "mstar_chunking_prepared_inputs",
        "mstar_chunking_prepared_input_tokens",
    ] {
        let labels = [("model", "model-idle"), ("node", "llm")];
        assert_eq!(value(&seen, name, &labels), Some(0.0), "{name}");
    }
    // The first set_budgets of each is not a reload; both results exist at 0.
    for model in ["model-a", "model-b"] {
        for result in ["ok", "error"] {
            assert_eq!(
                value(
                    &seen,
                    "mstar_chunking_config_reloads_total",
                    &[("model", model), ("result", result)]
                ),
                Some(0.0),
                "{model} {result}"
            );
        }
        for reason in ["uncut_row", "speculation_estimate", "other"] {
            let labels = [
                ("model", model),
                ("node", "llm"),
                ("walk", "mixed"),
                ("reason", reason),
            ];
            assert_eq!(
                value(&seen, "mstar_chunking_budget_overruns_total", &labels),
                Some(0.0),
                "{model} {reason} exists at 0"
            );
        }
    }
    // A reload of one counts for that one only.
    let settings = BudgetSettings::new(["prefill", "decode", "mixed"])
        .combined("mixed", ["prefill", "decode"])
        .budget("llm", NonZeroU32::new(128).unwrap());
    b.reload(settings).await.unwrap();
    let seen = series();
    let reloads = |model| {
        value(
            &seen,
            "mstar_chunking_config_reloads_total",
            &[("model", model), ("result", "ok")],
        )
    };
    assert_eq!(
        (reloads("model-a"), reloads("model-b")),
        (Some(0.0), Some(1.0))
    );
}

#[test]
fn starting_outside_an_actix_system_is_an_error_that_says_so() {
    let err = ChunkingManagement::start("x", [("llm", SubmoduleCaps::new(["prefill"], false))])
        .err()
        .expect("no actix System here");
    assert_eq!(err, ChunkingError::NoActixSystem);
    assert!(err.to_string().contains("needs an actix System"), "{err}");
    assert_eq!(err.kind(), ErrorKind::Fatal);
}

#[test]
fn a_tokio_engine_drives_the_actors_on_their_own_thread() {
    fn assert_send_sync<T: Send + Sync>(_: &T) {}
    let (cm, actors) = ChunkingManagement::start_on_own_thread(
        "tokio-engine",
        [("llm", SubmoduleCaps::new(["prefill"], false))],
    )
    .unwrap();
    assert_send_sync(&cm);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let engine = cm.clone();
    let step = rt.block_on(async move {
        // Spawned on a tokio worker: the handle and its futures are `Send`.
        tokio::spawn(async move {
            engine
                .set_policies([(("llm", "prefill"), ChunkingPolicy::budget(64))])
                .await?;
            engine.admit(1, "llm", "prefill", prompt(100), 0).await?;
            let b = engine.assemble("llm", "prefill").await?;
            engine.complete(b.step, vec![64], None).await?;
            let b = engine.assemble("llm", "prefill").await?;
            Ok::<Arc<Batch>, ChunkingError>(b)
        })
        .await
        .unwrap()
    });
    let b = step.unwrap();
    assert_eq!(chunks(&b)[0].1, ChunkRange::new(false, 64, 100, 100));
    actors.stop();
    let after = rt.block_on(cm.queue_stats()).unwrap_err();
    assert_eq!(after, ChunkingError::ActorStopped { actor: "Scheduler" });
    assert_eq!(after.kind(), ErrorKind::Fatal);
}

#[test]
fn dropping_the_guard_at_once_leaves_the_actors_running_for_the_handles() {
    #[allow(clippy::let_underscore_must_use)]
    let (cm, _) = ChunkingManagement::start_on_own_thread(
        "guard-dropped",
        [("llm", SubmoduleCaps::new(["prefill"], false))],
    )
    .unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let engine = cm.clone();
    let b = rt
        .block_on(async move {
            engine
                .set_policies([(("llm", "prefill"), ChunkingPolicy::budget(64))])
                .await?;
            engine.admit(1, "llm", "prefill", prompt(100), 0).await?;
            engine.assemble("llm", "prefill").await
        })
        .unwrap();
    assert_eq!(chunks(&b)[0].1, ChunkRange::new(false, 0, 64, 100));
    // The last handle's drop stops the thread (and joins it: this returns).
    drop(cm);

    let (cm, actors) = ChunkingManagement::start_on_own_thread(
        "guard-stopped",
        [("llm", SubmoduleCaps::new(["prefill"], false))],
    )
    .unwrap();
    actors.stop();
    let err = rt.block_on(cm.queue_stats()).unwrap_err();
    assert_eq!(err, ChunkingError::ActorStopped { actor: "Scheduler" });
    assert!(
        err.to_string().contains("`ActorThread::stop` was called"),
        "{err}"
    );
}

/// A facade whose `llm` node has a 4,096-token budget on `prefill`, floor 64.
async fn timed_engine(
    model: &str,
    settings: BudgetSettings,
) -> Result<ChunkingManagement, ChunkingError> {
    let cm = ChunkingManagement::start(model, [("llm", SubmoduleCaps::new(["prefill"], false))])?;
    cm.set_policies([(("llm", "prefill"), ChunkingPolicy::budget(4096))])
        .await?;
    cm.set_budgets(settings).await?;
    Ok(cm)
}

#[actix::test]
async fn a_time_budget_without_a_latency_model_is_refused_naming_the_node() {
    let err = timed_engine(
        "no-model",
        BudgetSettings::new(["prefill"]).max_step_ms("llm", 40.0),
    )
    .await
    .err()
    .expect("refused");
    let problems = err.budget_errors().expect("a budget refusal").to_string();
    assert!(
        problems.contains("`llm`") && problems.contains("latency model"),
        "{problems}"
    );
    for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
        let settings = BudgetSettings::new(["prefill"])
            .max_step_ms("llm", bad)
            .learn_cost(true);
        let err = timed_engine("bad-ms", settings)
            .await
            .err()
            .expect("refused");
        assert!(
            err.to_string().contains("finite number of milliseconds"),
            "{err}"
        );
    }
}

#[actix::test]
async fn a_step_measured_over_its_time_budget_is_a_time_overrun_by_reason() {
    let model = mstar_chunking::latency::LatencyModel::try_new(5.0, 0.01, 0.0, 0.0).unwrap();
    let settings = BudgetSettings::new(["prefill"])
        .max_step_ms("llm", 15.0)
        .cost("llm", model);
    let cm = timed_engine("time-overrun", settings).await.unwrap();
    cm.admit(1, "llm", "prefill", prompt(5000), 0)
        .await
        .unwrap();
    let b = cm.assemble("llm", "prefill").await.unwrap();
    // 5 ms + 0.01 ms a token within 15 ms: 1,000 tokens.
    assert_eq!(planned(&b), vec![1000]);
    assert_eq!((b.max_step_ms, b.predicted_ms), (Some(15.0), Some(15.0)));
    assert!(matches!(
        cm.complete(b.step, vec![1000], Some(f64::NAN)).await,
        Err(ChunkingError::BadMeasurement { .. })
    ));
    let out = cm.complete(b.step, vec![1000], Some(22.0)).await.unwrap();
    assert_eq!(
        out.time_overrun,
        Some(mstar_chunking::overrun::TimeOverrunReason::Misprediction)
    );
    let b = cm.assemble("llm", "prefill").await.unwrap();
    let out = cm.complete(b.step, planned(&b), Some(14.0)).await.unwrap();
    assert_eq!(out.time_overrun, None);
}

#[actix::test]
async fn the_online_fit_takes_over_from_no_model_once_trusted() {
    use mstar_chunking::latency::{LatencyModel, ModelSource};
    let truth = LatencyModel::try_new(4.0, 0.02, 0.0, 0.0).unwrap();
    let settings = BudgetSettings::new(["prefill"])
        .max_step_ms("llm", 30.0)
        .learn_cost(true);
    let cm = timed_engine("learner", settings).await.unwrap();
    let mut source = ModelSource::None;
    for rid in 0..200u64 {
        cm.admit(
            rid,
            "llm",
            "prefill",
            prompt(100 + (rid as u32 * 37) % 3000),
            0,
        )
        .await
        .unwrap();
        let b = cm.assemble("llm", "prefill").await.unwrap();
        let ran = planned(&b);
        let tokens: u64 = ran.iter().map(|&t| u64::from(t)).sum();
        let ms = truth.base_ms() + truth.per_token_ms() * tokens as f64;
        let out = cm.complete(b.step, ran, Some(ms)).await.unwrap();
        source = out.model.1;
        if source == ModelSource::Online {
            let learned = out.model.0.unwrap();
            assert!((learned.per_token_ms() - 0.02).abs() < 1e-6, "{learned:?}");
            break;
        }
    }
    assert_eq!(source, ModelSource::Online, "never trusted");
    // Planned with the learned model from now on: at most (30 - 4) / 0.02 = 1,300 tokens.
    cm.admit(1000, "llm", "prefill", prompt(4000), 0)
        .await
        .unwrap();
    let b = cm.assemble("llm", "prefill").await.unwrap();
    let predicted = b.predicted_ms.expect("a model");
    assert!(predicted <= 30.0 + 1e-9, "{predicted}");
}

#[actix::test]
async fn a_time_margin_plans_against_the_budget_over_the_recent_ratio_and_shows_it() {
    use mstar_chunking::latency::margin::MIN_STEPS;
    use mstar_chunking::metrics::TIME_MARGIN;
    snapshotter();
    // 1 ms a token: 60-token chunks fill a 60 ms budget; every step runs 1.5 times slower.
    let model = mstar_chunking::latency::LatencyModel::try_new(0.0, 1.0, 0.0, 0.0).unwrap();
    let settings = BudgetSettings::new(["prefill"])
        .max_step_ms("llm", 60.0)
        .cost("llm", model)
        .min_chunk_tokens(std::num::NonZeroU32::new(8).unwrap())
        .time_margin(0.5);
    let cm = timed_engine("margin", settings).await.unwrap();
    cm.admit(1, "llm", "prefill", prompt(100_000), 0)
        .await
        .unwrap();
    for _ in 0..MIN_STEPS {
        let b = cm.assemble("llm", "prefill").await.unwrap();
        assert_eq!(planned(&b), vec![60]);
        let out = cm.complete(b.step, vec![60], Some(90.0)).await.unwrap();
        assert_eq!((out.max_step_ms, out.time_margin), (Some(60.0), Some(1.0)));
    }
    // 60 / 1.5 = 40 ms: 40 tokens, and the batch still names the budget.
    let b = cm.assemble("llm", "prefill").await.unwrap();
    assert_eq!(planned(&b), vec![40]);
    assert_eq!((b.max_step_ms, b.predicted_ms), (Some(60.0), Some(40.0)));
    let out = cm.complete(b.step, vec![40], Some(60.0)).await.unwrap();
    assert_eq!((out.time_margin, out.time_overrun), (Some(1.5), None));
    assert_eq!(
        value(
            &series(),
            TIME_MARGIN,
            &[("model", "margin"), ("node", "llm")]
        ),
        Some(1.5)
    );
}
