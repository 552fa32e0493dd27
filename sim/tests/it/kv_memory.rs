//! KV memory in the replay (`docs/kv-memory.md`): a limited pool checked over the step log
//! (never over the limit, every request done, recomputes of exactly prompt + generated
//! tokens, `check_step_log.py --complete`), unlimited memory unchanged, the settings refused
//! naming key and layer, and a property test over random traces and pools.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use mstar_chunking::manifest::Manifest;
use mstar_chunking_sim::config::Settings;
use mstar_chunking_sim::replay::{self, ReplayError, ReplayOptions, ReplayReport};
use proptest::prelude::*;
use proptest::test_runner::{Config, RngSeed, TestRunner};
use serde_json::Value;

use crate::helpers::{check_step_log, run, shared};

/// The trace rid of a component rid (`rid + attempt << 32`).
const RID_MASK: u64 = (1 << 32) - 1;

fn model() -> Manifest {
    crate::helpers::model_fixture("mixed_override")
}

fn settings(budget: u32, replay: &str) -> Settings {
    toml::from_str(&format!(
        "[chunking]\nmax_batch_tokens = {{ llm = {{ mixed = {budget} }} }}\n{replay}"
    ))
    .unwrap()
}

fn replay(s: &Settings, o: &ReplayOptions) -> Result<ReplayReport, ReplayError> {
    actix::System::new().block_on(replay::run(&model(), s, o))
}

fn read_log(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// What the step log says, checked against the trace's `(prompt, output)` per rid: the pool
/// never over its limit, every token generated once, every recompute of exactly prompt +
/// generated tokens. Answers the preemptions seen.
fn check_kv_log(log: &[Value], requests: &[(u32, u32)], limit: u64) -> u64 {
    let mut preemptions = 0u64;
    let mut discarded = 0u64;
    // readmit rid -> (trace rid, generated)
    let mut recomputes: HashMap<u64, (u64, u32)> = HashMap::new();
    let mut generated = vec![0u64; requests.len()];
    for line in log {
        let kv = &line["kv"];
        assert!(kv.is_object(), "a step without `kv`: {line}");
        assert_eq!(kv["limit"], limit);
        let blocks = kv["blocks"].as_u64().unwrap();
        assert!(
            blocks <= limit,
            "{blocks} blocks in use over {limit}: {line}"
        );
        for p in kv["preempted"].as_array().unwrap() {
            preemptions += 1;
            discarded += p["discarded_tokens"].as_u64().unwrap();
            let rid = p["rid"].as_u64().unwrap();
            let readmit = p["readmit_rid"].as_u64().unwrap();
            assert_eq!(readmit & RID_MASK, rid, "{p}");
            let g = p["generated"].as_u64().unwrap() as u32;
            // The tokens generated before the preemption are what the log showed.
            assert_eq!(u64::from(g), generated[rid as usize], "{p}");
            recomputes.insert(readmit, (rid, g));
        }
        for row in line["rows"].as_array().unwrap() {
            let rid = row["rid"].as_u64().unwrap();
            let i = (rid & RID_MASK) as usize;
            match row["kind"].as_str().unwrap() {
                "continue" => generated[i] += 1,
                _ => {
                    let (prompt, _) = requests[i];
                    let total = row["total"].as_u64().unwrap();
                    match recomputes.get(&rid) {
                        Some(&(_, g)) => {
                            assert_eq!(total, u64::from(prompt) + u64::from(g), "{row}")
                        }
                        None => {
                            assert_eq!(rid >> 32, 0, "an unknown readmission: {row}");
                            assert_eq!(total, u64::from(prompt), "{row}");
                        }
                    }
                    if row["final"].as_bool().unwrap() {
                        generated[i] += 1;
                    }
                }
            }
        }
    }
    // No lost or duplicated token: each request generated exactly its output (0 replays as 1).
    for (i, (_, out)) in requests.iter().enumerate() {
        assert_eq!(generated[i], u64::from((*out).max(1)), "request {i}");
    }
    let _ = discarded;
    preemptions
}

/// The step log without the rows of admissions preempted before their final chunk (and their
/// tokens taken from their steps' totals): such an admission never finishes its prefill, which
/// `check_step_log.py --complete` (that knows nothing of preemption) would flag. Every other
/// rule is checked on every other row.
fn without_abandoned_prefills(log: &Path) -> PathBuf {
    let steps = read_log(log);
    let abandoned: std::collections::HashSet<u64> = steps
        .iter()
        .flat_map(|s| s["kv"]["preempted"].as_array().unwrap().clone())
        .filter(|p| p["during_prefill"] == true)
        .map(|p| p["readmit_rid"].as_u64().unwrap() - (1 << 32))
        .collect();
    let out = log.with_extension("filtered.jsonl");
    let mut text = String::new();
    for mut s in steps {
        let (gone, rows): (Vec<Value>, Vec<Value>) = s["rows"]
            .as_array()
            .unwrap()
            .iter()
            .cloned()
            .partition(|r| abandoned.contains(&r["rid"].as_u64().unwrap()));
        let gone: u64 = gone.iter().map(|r| r["tokens"].as_u64().unwrap()).sum();
        for key in ["scheduled_tokens", "ran_tokens"] {
            s[key] = Value::from(s[key].as_u64().unwrap() - gone);
        }
        s["rows"] = Value::Array(rows);
        text.push_str(&s.to_string());
        text.push('\n');
    }
    std::fs::write(&out, text).unwrap();
    out
}

fn mooncake() -> PathBuf {
    shared("traces/mooncake_fast25_synthetic_trace.head2000.jsonl")
}

/// `(prompt, output)` of the first `n` requests of `trace`.
fn lengths(trace: &Path, n: usize) -> Vec<(u32, u32)> {
    let o = ReplayOptions {
        trace: Some(trace.to_owned()),
        requests: Some(n),
        ..ReplayOptions::default()
    };
    replay::load_trace(&o, 42)
        .unwrap()
        .requests
        .iter()
        .map(|r| (r.input_tokens, r.output_tokens))
        .collect()
}

#[test]
fn a_small_pool_preempts_and_every_request_still_completes() {
    let n = 120;
    let trace = mooncake();
    let reqs = lengths(&trace, n);
    let longest = reqs.iter().map(|(p, o)| p + o).max().unwrap();
    // A pool just large enough for the longest request, at a rate that makes them overlap.
    let blocks = u64::from(longest.div_ceil(16)) + 64;
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("steps.jsonl");
    let json = dir.path().join("report.json");
    let s = settings(2048, &format!("[replay.kv]\nblocks = {blocks}\n"));
    let r = replay(
        &s,
        &ReplayOptions {
            trace: Some(trace),
            requests: Some(n),
            rate_scale: 4.0,
            step_log: Some(log.clone()),
            report_json: Some(json.clone()),
            ..ReplayOptions::default()
        },
    )
    .unwrap();
    let kv = r.kv.clone().expect("a KV report");
    assert!(kv.preemptions > 0, "no preemption\n{r}");
    assert!(
        kv.admissions_waited > 0,
        "no request waited for memory\n{r}"
    );
    assert!(
        kv.peak_blocks <= blocks && kv.peak_blocks > blocks / 2,
        "{r}"
    );
    assert_eq!(
        r.ttft_ms.unwrap().samples,
        n,
        "every request has a first token"
    );
    let steps = read_log(&log);
    assert_eq!(steps.len() as u64, r.steps);
    let seen = check_kv_log(&steps, &reqs, blocks);
    assert_eq!(seen, kv.preemptions);
    let discarded: u64 = steps
        .iter()
        .flat_map(|s| s["kv"]["preempted"].as_array().unwrap().clone())
        .map(|p| p["discarded_tokens"].as_u64().unwrap())
        .sum();
    assert_eq!(discarded, kv.recomputed_tokens);
    // Every prompt admission (first or recompute) not preempted midway finished its prefill.
    check_step_log(&without_abandoned_prefills(&log), 16);
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(doc["kv"]["blocks"], blocks);
    assert_eq!(doc["kv"]["preemptions"], kv.preemptions);
    assert!(r.to_string().contains("preemptions"), "{r}");
}

/// Under preemption, `prompts_cut` counts each prompt that ran a non-final chunk once, however
/// often it is recomputed (a recompute's final chunk is the same prompt's), and each
/// preemption names the row it took by that row's own rid.
#[test]
fn preempted_prompts_are_counted_cut_once_and_preemptions_name_their_row() {
    let n = 100;
    // Long outputs: decode rows grow into a pool of 400 blocks and are preempted.
    let trace =
        crate::helpers::repo_root().join("data/traces/AzureLLMInferenceTrace_conv.head500.csv");
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("steps.jsonl");
    let json = dir.path().join("report.json");
    // No budget (every chunk final: a prompt runs whole) and one that cuts some.
    for budget in ["\"off\"", "512"] {
        let s: Settings = toml::from_str(&format!(
            "[chunking]\nmax_batch_tokens = {{ llm = {{ mixed = {budget} }} }}\n[replay.kv]\nblocks = 400\n"
        ))
        .unwrap();
        let r = replay(
            &s,
            &ReplayOptions {
                trace: Some(trace.clone()),
                requests: Some(n),
                rate_scale: 8.0,
                step_log: Some(log.clone()),
                report_json: Some(json.clone()),
                ..ReplayOptions::default()
            },
        )
        .unwrap();
        assert!(r.kv.as_ref().unwrap().preemptions > 0, "no preemption\n{r}");
        let steps = read_log(&log);
        let mut cut = std::collections::BTreeSet::new();
        let mut seen_rids = std::collections::HashSet::new();
        for line in &steps {
            for p in line["kv"]["preempted"].as_array().unwrap() {
                let row = p["row_rid"].as_u64().unwrap();
                let readmit = p["readmit_rid"].as_u64().unwrap();
                assert_eq!(row + (1 << 32), readmit, "{p}");
                assert_eq!(row & RID_MASK, p["rid"].as_u64().unwrap(), "{p}");
                if p["during_prefill"] == false {
                    assert!(seen_rids.contains(&row), "a decode row never seen: {p}");
                }
            }
            for row in line["rows"].as_array().unwrap() {
                let rid = row["rid"].as_u64().unwrap();
                seen_rids.insert(rid);
                if row["kind"] == "chunk" && row["final"] == false {
                    cut.insert(rid & RID_MASK);
                }
            }
        }
        assert_eq!(
            r.chunks.prompts_cut,
            cut.len() as u64,
            "budget {budget}\n{r}"
        );
        assert!(r.chunks.prompts_cut <= n as u64, "{r}");
        let doc: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        assert_eq!(doc["chunks"]["prompts_cut"], cut.len() as u64);
        if budget == "\"off\"" {
            assert_eq!(r.chunks.prompts_cut, 0, "every chunk was final\n{r}");
        }
    }
}

/// The figures that do not depend on wall time.
fn figures(r: &ReplayReport) -> ReplayReport {
    let mut r = r.clone();
    r.wall_ms = 0.0;
    r.steps_per_second = 0.0;
    r.kv = None;
    r
}

#[test]
fn unlimited_memory_and_a_pool_that_never_fills_change_nothing() {
    let o = ReplayOptions {
        trace: Some(mooncake()),
        requests: Some(150),
        ..ReplayOptions::default()
    };
    let base = replay(&settings(2048, ""), &o).unwrap();
    assert!(base.kv.is_none());
    // Block size and watermark without a limit: unlimited.
    let sized = replay(
        &settings(2048, "[replay.kv]\nblock_tokens = 32\nwatermark = 0.1\n"),
        &o,
    )
    .unwrap();
    assert_eq!(figures(&sized), figures(&base));
    assert!(sized.kv.is_none());
    // A pool far beyond the trace's needs: the same steps and latencies, nothing waited.
    let huge = replay(&settings(2048, "[replay.kv]\nblocks = 1099511627776\n"), &o).unwrap();
    assert_eq!(figures(&huge), figures(&base));
    let kv = huge.kv.unwrap();
    assert_eq!((kv.preemptions, kv.admissions_waited), (0, 0));
    // The unlimited JSON report has no `kv` key.
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("r.json");
    replay(
        &settings(2048, ""),
        &ReplayOptions {
            report_json: Some(json.clone()),
            ..o.clone()
        },
    )
    .unwrap();
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert!(doc.get("kv").is_none());
}

#[test]
fn a_request_that_could_never_fit_is_refused_before_anything_runs() {
    let e = replay(
        &settings(2048, "[replay.kv]\nblocks = 10\n"),
        &ReplayOptions {
            trace: Some(mooncake()),
            requests: Some(5),
            ..ReplayOptions::default()
        },
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.starts_with("request 0 needs ") && e.contains("holds 10 blocks"),
        "{e}"
    );
}

#[test]
fn kv_settings_are_refused_naming_key_and_layer() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("kv.toml");
    std::fs::write(
        &cfg,
        "[replay.kv]\nblocks = 100\npreset = \"llama2-7b-a100\"\n",
    )
    .unwrap();
    let r = run(&["check", "--config", cfg.to_str().unwrap()], &[]);
    assert_eq!(r.code, 2, "{r:?}");
    assert!(
        r.stderr.contains("`replay.kv.blocks` = 100")
            && r.stderr.contains("kv.toml")
            && r.stderr.contains("not both"),
        "{}",
        r.stderr
    );
    std::fs::write(&cfg, "[replay.kv]\nbloks = 100\n").unwrap();
    let r = run(&["check", "--config", cfg.to_str().unwrap()], &[]);
    assert_eq!(r.code, 2, "{r:?}");
    assert!(r.stderr.contains("bloks"), "{}", r.stderr);
    let r = run(
        &["check"],
        &[("MSTAR__REPLAY__KV__PRESET", "llama2-7b-a800")],
    );
    assert_eq!(r.code, 2, "{r:?}");
    assert!(
        r.stderr.contains("replay.kv.preset") && r.stderr.contains("MSTAR__REPLAY__KV__PRESET"),
        "{}",
        r.stderr
    );
}

/// One random replay: requests `(gap ms, prompt, output)`, a pool, a budget, a block size.
#[derive(Debug, Clone)]
struct Case {
    requests: Vec<(u32, u32, u32)>,
    extra_blocks: u64,
    budget: u32,
    block_tokens: u32,
    watermark: f64,
}

fn case() -> impl Strategy<Value = Case> {
    (
        proptest::collection::vec((0u32..400, 1u32..3000, 0u32..60), 1..14),
        0u64..200,
        prop_oneof![Just(64u32), Just(512), Just(2048)],
        prop_oneof![Just(1u32), Just(16), Just(64)],
        prop_oneof![Just(0.0), Just(0.01), Just(0.2)],
    )
        .prop_map(
            |(requests, extra_blocks, budget, block_tokens, watermark)| Case {
                requests,
                extra_blocks,
                budget,
                block_tokens,
                watermark,
            },
        )
}

/// Runs one case and checks it; answers its preemptions.
fn run_case(c: &Case) -> Result<u64, TestCaseError> {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("t.csv");
    let mut text = String::from("arrival_ms,prompt_tokens,output_tokens\n");
    let mut t = 0u64;
    for (gap, p, o) in &c.requests {
        t += u64::from(*gap);
        text.push_str(&format!("{t},{p},{o}\n"));
    }
    std::fs::write(&trace, text).unwrap();
    // The smallest pool the longest request fits in alone, plus a random margin.
    let need = c
        .requests
        .iter()
        .map(|(_, p, o)| u64::from(p + o.max(&1)).div_ceil(u64::from(c.block_tokens)))
        .max()
        .unwrap();
    let blocks = need + c.extra_blocks;
    let log = dir.path().join("steps.jsonl");
    let s = settings(
        c.budget,
        &format!(
            "[replay.kv]\nblocks = {blocks}\nblock_tokens = {}\nwatermark = {}\n",
            c.block_tokens, c.watermark
        ),
    );
    let r = replay(
        &s,
        &ReplayOptions {
            trace: Some(trace),
            step_log: Some(log.clone()),
            ..ReplayOptions::default()
        },
    )
    .map_err(|e| TestCaseError::fail(e.to_string()))?;
    let kv = r.kv.clone().unwrap();
    prop_assert!(kv.peak_blocks <= blocks);
    prop_assert_eq!(r.ttft_ms.map(|l| l.samples), Some(c.requests.len()));
    let reqs: Vec<(u32, u32)> = c.requests.iter().map(|(_, p, o)| (*p, *o)).collect();
    let steps = read_log(&log);
    let seen = check_kv_log(&steps, &reqs, blocks);
    prop_assert_eq!(seen, kv.preemptions);
    // Preempted work is counted: every admission ran its whole input (prompt + tokens
    // generated before it), but those preempted before their final chunk, which ran the tokens
    // they discarded.
    let events: Vec<Value> = steps
        .iter()
        .flat_map(|s| s["kv"]["preempted"].as_array().unwrap().clone())
        .collect();
    let input = |p: &Value| {
        u64::from(reqs[p["rid"].as_u64().unwrap() as usize].0) + p["generated"].as_u64().unwrap()
    };
    let prompts: u64 = reqs.iter().map(|(p, _)| u64::from(*p)).sum();
    let readmitted: u64 = events.iter().map(input).sum();
    let unfinished: u64 = events
        .iter()
        .filter(|p| p["during_prefill"] == true)
        .map(|p| input(p) - p["discarded_tokens"].as_u64().unwrap())
        .sum();
    prop_assert_eq!(r.tokens.prefill, prompts + readmitted - unfinished);
    prop_assert_eq!(
        kv.recomputed_tokens,
        events
            .iter()
            .map(|p| p["discarded_tokens"].as_u64().unwrap())
            .sum::<u64>()
    );
    prop_assert_eq!(
        r.chunks.final_chunks,
        (reqs.len()
            + events
                .iter()
                .filter(|p| p["during_prefill"] == false)
                .count()) as u64
    );
    check_step_log(&without_abandoned_prefills(&log), 0);
    Ok(kv.preemptions)
}

/// Random arrivals, lengths, pools, budgets and block sizes, with a recorded seed: no block
/// over-use, no lost or duplicated token, every prompt completes, preempted work counted.
#[test]
fn random_traces_under_random_pools_keep_every_rule() {
    let config = Config {
        cases: 40,
        rng_seed: RngSeed::Fixed(0x6b76_6d65_6d6f_7279),
        failure_persistence: None,
        ..Config::default()
    };
    let preempting = std::cell::Cell::new(0usize);
    TestRunner::new(config)
        .run(&case(), |c| {
            if run_case(&c)? > 0 {
                preempting.set(preempting.get() + 1);
            }
            Ok(())
        })
        .unwrap();
    // The seed gives cases that preempt: the property is not vacuous.
    assert!(
        preempting.get() >= 5,
        "only {} of 40 cases preempted",
        preempting.get()
    );
}

#[test]
fn a_sweep_over_kv_blocks_writes_one_run_per_pool_and_their_comparison() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("sweep");
    let trace = mooncake();
    let r = run(
        &[
            "sweep",
            "--trace",
            trace.to_str().unwrap(),
            "--requests",
            "60",
            "--budgets",
            "2048",
            "--rates",
            "1,4",
            "--slo-ttft-p90",
            "20000",
            "--kv-blocks",
            "unlimited,6000",
            "--jobs",
            "2",
            "--no-progress",
            "--out",
            out.to_str().unwrap(),
        ],
        &[],
    );
    assert_eq!(r.code, 0, "{r:?}");
    for name in [
        "kv-6000/sweep.json",
        "kv-unlimited/sweep.json",
        "kv-6000/report.html",
        "kv.csv",
        "kv.json",
        "kv.svg",
        "kv.png",
    ] {
        assert!(out.join(name).is_file(), "{name} missing: {r:?}");
    }
    let text = std::fs::read_to_string(out.join("kv.json")).unwrap();
    let doc: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(doc["kv_blocks"], serde_json::json!([6000, "unlimited"]));
    let rows = doc["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 2);
    // Less memory never raises the capacity or lowers the TTFT (at the same rate).
    let cap = |i: usize| rows[i]["capacity_rate"].as_f64().unwrap_or(0.0);
    let ttft = |i: usize| rows[i]["ttft_p90_ms"].as_f64().unwrap();
    assert!(cap(0) <= cap(1), "{text}");
    assert!(ttft(0) >= ttft(1), "{text}");
    // Each run is labelled with its pool.
    let limited = std::fs::read_to_string(out.join("kv-6000/sweep.json")).unwrap();
    assert!(
        limited.contains("6000 blocks of 16 tokens (--kv-blocks)"),
        "{limited}"
    );
    assert!(
        r.stdout.contains("KV memory: capacity and latency"),
        "{}",
        r.stdout
    );
    // A bad list is refused before anything runs.
    let r = run(
        &[
            "sweep",
            "--kv-blocks",
            "0,10",
            "--out",
            out.to_str().unwrap(),
        ],
        &[],
    );
    assert_eq!(r.code, 2, "{r:?}");
    assert!(r.stderr.contains("`--kv-blocks`"), "{}", r.stderr);
}

/// A pool of the KV axis that a request could never fit in is refused as the replay refuses
/// it (exit 2), before any replay runs, and nothing is left in `--out`.
#[test]
fn a_sweep_pool_too_small_for_a_request_is_refused_before_anything_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("sweep");
    let out_arg = out.to_str().unwrap();
    let kv = dir.path().join("kv.toml");
    std::fs::write(&kv, "[replay.kv]\nblocks = 1\n").unwrap();
    let common = ["--requests", "20", "--no-progress"];
    let mut replay = vec!["replay", "--config", kv.to_str().unwrap()];
    replay.extend(common);
    let r = run(&replay, &[]);
    assert_eq!(r.code, 2, "{r:?}");
    assert!(r.stderr.contains("could never run"), "{}", r.stderr);
    for (blocks, existing) in [("1", false), ("unlimited,1", false), ("1", true)] {
        if existing {
            std::fs::create_dir_all(&out).unwrap();
        }
        let mut sweep = vec!["sweep", "--kv-blocks", blocks, "--out", out_arg];
        sweep.extend(common);
        let r = run(&sweep, &[]);
        assert_eq!(r.code, 2, "{blocks}: {r:?}");
        assert!(
            r.stderr.contains("`--kv-blocks` names 1") && r.stderr.contains("could never run"),
            "{}",
            r.stderr
        );
        assert!(r.stderr.contains("no replay ran"), "{}", r.stderr);
        // Nothing created, or an existing directory left empty.
        match std::fs::read_dir(&out) {
            Ok(entries) => assert_eq!(entries.count(), 0, "{blocks}: left in --out"),
            Err(_) => assert!(!existing),
        }
    }
}

#[test]
fn the_prefix_cache_shares_the_pool_and_is_evicted_before_preempting() {
    let n = 400;
    let trace = mooncake();
    let reqs = lengths(&trace, n);
    let run_with = |blocks: u64| {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("steps.jsonl");
        let s = settings(
            2048,
            &format!(
                "[replay]\nprefix_cache = {{ blocks = 4096, block_tokens = 512 }}\n[replay.kv]\nblocks = {blocks}\n"
            ),
        );
        let r = replay(
            &s,
            &ReplayOptions {
                trace: Some(trace.clone()),
                requests: Some(n),
                rate_scale: 1.0,
                step_log: Some(log.clone()),
                ..ReplayOptions::default()
            },
        )
        .unwrap();
        let steps = read_log(&log);
        assert_eq!(
            check_kv_log(&steps, &reqs, blocks),
            r.kv.as_ref().unwrap().preemptions
        );
        assert!(steps
            .iter()
            .any(|s| s["kv"]["cache_blocks"].as_u64().unwrap() > 0));
        check_step_log(&without_abandoned_prefills(&log), 16);
        r
    };
    // A pool the cache fills: it is evicted to make room, and prefixes still hit (1 of the
    // 12 hits with unlimited memory: the cache keeps its own copy of a prefix, see
    // docs/decisions/replay.md#kv-memory).
    let r = run_with(12_000);
    let kv = r.kv.clone().unwrap();
    assert!(kv.cache_evictions > 0, "{r}");
    assert!(r.chunks.prefix_cache_hits > 0, "no hit\n{r}");
}
