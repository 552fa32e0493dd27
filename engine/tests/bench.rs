//! The load generator: trace reading, scaling, and a short real-time run against the tiny model.

use std::time::Duration;

use candle_core::Device;
use mstar_engine::bench::{self, read_trace, scale, BenchArgs, Latency, TraceRequest};
use mstar_engine::engine::{self, EngineSettings};
use mstar_engine::model::{Config, Model};
use mstar_engine::server::Server;

fn args(trace: std::path::PathBuf) -> BenchArgs {
    BenchArgs {
        url: String::new(),
        trace,
        requests: None,
        rate_scale: 1.0,
        length_scale: 1.0,
        max_prompt: 2000,
        max_output: 256,
        seed: 0,
        timeout_secs: 60.0,
        report_json: None,
        write_trace: None,
    }
}

#[test]
fn reads_generic_and_azure_traces() {
    let dir = tempfile::tempdir().unwrap();
    let g = dir.path().join("g.csv");
    std::fs::write(&g, "arrival_ms,prompt_tokens,output_tokens,hash_ids\n0,1200,64,\n15.5,5000,200,1 2 3 4 5 6 7 8 9 10\n").unwrap();
    let t = read_trace(&g).unwrap();
    assert_eq!(
        t,
        vec![
            TraceRequest {
                arrival_ms: 0.0,
                prompt_tokens: 1200,
                output_tokens: 64
            },
            TraceRequest {
                arrival_ms: 15.5,
                prompt_tokens: 5000,
                output_tokens: 200
            },
        ]
    );
    let a = dir.path().join("a.csv");
    std::fs::write(&a, "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 23:59:59.9000000,4808,10\n2023-11-17 00:00:00.0500000,3180,8\n").unwrap();
    let t = read_trace(&a).unwrap();
    assert_eq!(t[0].arrival_ms, 0.0);
    assert!(
        (t[1].arrival_ms - 150.0).abs() < 1e-6,
        "across midnight: {}",
        t[1].arrival_ms
    );

    // Scaling: rate, lengths, caps, at least one token.
    let mut a2 = args(g.clone());
    a2.rate_scale = 2.0;
    a2.length_scale = 0.5;
    a2.max_prompt = 1000;
    a2.max_output = 50;
    let s = scale(&read_trace(&g).unwrap(), &a2);
    assert_eq!(
        s[1],
        TraceRequest {
            arrival_ms: 7.75,
            prompt_tokens: 1000,
            output_tokens: 50
        }
    );
    assert_eq!(s[0].prompt_tokens, 600);

    // Errors name the file and the line.
    let bad = dir.path().join("bad.csv");
    std::fs::write(
        &bad,
        "arrival_ms,prompt_tokens,output_tokens\n0,10,1\n5,ten,1\n",
    )
    .unwrap();
    let e = read_trace(&bad).unwrap_err();
    assert!(
        e.contains("bad.csv:3") && e.contains("prompt_tokens") && e.contains("ten"),
        "{e}"
    );
    std::fs::write(
        &bad,
        "arrival_ms,prompt_tokens,output_tokens\n5,10,1\n4,10,1\n",
    )
    .unwrap();
    let e = read_trace(&bad).unwrap_err();
    assert!(e.contains("bad.csv:3") && e.contains("goes back"), "{e}");
    std::fs::write(&bad, "when,what\n1,2\n").unwrap();
    let e = read_trace(&bad).unwrap_err();
    assert!(e.contains("bad.csv:1") && e.contains("header"), "{e}");
}

#[test]
fn nearest_rank_percentiles() {
    let mut v: Vec<f64> = (1..=100).map(f64::from).collect();
    let l = Latency::of(&mut v).unwrap();
    assert_eq!(
        (l.p50, l.p90, l.p99, l.max, l.samples),
        (50.0, 90.0, 99.0, 100.0, 100)
    );
    assert!(Latency::of(&mut []).is_none());
}

#[actix_web::test]
async fn a_short_run_reports_latencies_and_writes_the_scaled_trace() {
    let model = Model::random(Config::tiny(), 5, &Device::Cpu).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("steps.jsonl");
    let (handle, thread) = engine::start(
        model,
        EngineSettings {
            step_log: Some(log.clone()),
            chunking: engine::Chunking::Tokens(64),
            ..EngineSettings::default()
        },
    )
    .unwrap();
    let srv = Server::start(handle, "tiny", "127.0.0.1:0").unwrap();
    let trace = dir.path().join("t.csv");
    std::fs::write(
        &trace,
        "arrival_ms,prompt_tokens,output_tokens\n0,300,8\n20,40,8\n40,500,8\n60,10,8\n",
    )
    .unwrap();
    let mut a = args(trace);
    a.url = format!("http://{}", srv.addr);
    a.report_json = Some(dir.path().join("r.json"));
    a.write_trace = Some(dir.path().join("scaled.csv"));
    let report = bench::run_async(&a).await.unwrap();
    assert_eq!(report["completed"], 4, "{report}");
    assert_eq!(report["failed"], 0);
    assert_eq!(report["ttft_ms"]["samples"], 4);
    assert_eq!(report["tbt_ms"]["samples"], 4 * 7);
    assert_eq!(report["tokens"]["generated"], 32);
    let on_disk: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("r.json")).unwrap()).unwrap();
    assert_eq!(on_disk["completed"], 4);
    let scaled = read_trace(&dir.path().join("scaled.csv")).unwrap();
    assert_eq!(scaled.len(), 4);
    assert_eq!(scaled[2].prompt_tokens, 500);
    srv.shutdown(Duration::from_secs(1)).await.unwrap();
    thread.join().unwrap().unwrap();

    // The step log has the replay step log's shape, with measured `ms`.
    let text = std::fs::read_to_string(&log).unwrap();
    let mut chunk_tokens = 0;
    // Each continuing row's `context` is the KV it read: its prompt, then one more for each
    // token generated before (the first generated token runs at prompt + 1), as the replay's
    // simulated engine logs it, whether or not the component kept its own estimate.
    let mut contexts: std::collections::BTreeMap<u64, Vec<u64>> = Default::default();
    let mut totals: std::collections::BTreeMap<u64, u64> = Default::default();
    for line in text.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        for key in [
            "step",
            "t_ms",
            "node",
            "walk",
            "budget",
            "floor",
            "caps",
            "rows",
            "scheduled_tokens",
            "ran_tokens",
            "overrun",
            "waiting",
            "ms",
            "predicted_ms",
            "max_step_ms",
            "time_overrun",
        ] {
            assert!(v.get(key).is_some(), "{key} in {line}");
        }
        assert!(v["ms"].as_f64().unwrap() >= 0.0);
        assert_eq!(v["walk"], "mixed");
        for r in v["rows"].as_array().unwrap() {
            let rid = r["rid"].as_u64().unwrap();
            if r["kind"] == "chunk" {
                chunk_tokens += r["tokens"].as_u64().unwrap();
                assert!(r["tokens"].as_u64().unwrap() <= 64);
                totals.insert(rid, r["total"].as_u64().unwrap());
            } else {
                contexts
                    .entry(rid)
                    .or_default()
                    .push(r["context"].as_u64().unwrap());
            }
        }
    }
    assert_eq!(
        chunk_tokens,
        300 + 40 + 500 + 10,
        "every prompt token ran once"
    );
    assert_eq!(contexts.len(), 4, "{contexts:?}");
    for (rid, seen) in &contexts {
        let prompt = totals[rid];
        // 8 tokens: the first from the final chunk, 7 from continuing rows.
        let want: Vec<u64> = (1..=7).map(|k| prompt + k).collect();
        assert_eq!(seen, &want, "request {rid}");
    }
}
