//! Sweep answers that can be trusted, against the binary: flags and grid values
//! checked before any replay, outputs checked up front and written as one set, interrupted
//! sweeps that keep what finished, and input strings escaped wherever they are printed.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::Value;

use crate::helpers::{repo_root, run, run_in, Run};

const BIN: &str = env!("CARGO_BIN_EXE_mstar-chunking");

/// Debug logging of the replays: each logs `replay started`, so a test sees whether any ran.
const REPLAY_DEBUG: (&str, &str) = ("RUST_LOG", "warn,mstar_chunking_sim::replay=debug");

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn replays_started(r: &Run) -> usize {
    r.stderr.matches("replay started").count()
}

fn sweep(args: &[&str]) -> Run {
    let mut all = vec!["sweep", "--no-progress"];
    all.extend_from_slice(args);
    run(&all, &[REPLAY_DEBUG])
}

#[test]
fn sweep_flags_and_grid_values_are_refused_before_any_replay() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let timed = dir.path().join("timed.toml");
    std::fs::write(
        &timed,
        "[chunking.cost]\nllm = \"llama2-7b-a100\"\n[chunking.max_step_ms.llm]\nmixed = 60\n",
    )
    .unwrap();
    for (args, words) in [
        // 1 and 1.0004 would both print as 1.
        (
            vec!["--rates", "1,1.0004", "--budgets", "512", "--requests", "20"],
            "`--rates` takes rate scales in steps of 0.001",
        ),
        // Below the demo model's `align` of 16: the config refuses it.
        (
            vec!["--rates", "1", "--budgets", "512,8", "--requests", "20"],
            "`--budgets` names 8, which the config would refuse",
        ),
        // Off with a time budget on the same walk: the time budget would do nothing.
        (
            vec![
                "--rates",
                "1",
                "--budgets",
                "512,off",
                "--requests",
                "20",
                "--config",
                s(&timed),
            ],
            "`--budgets` names off, which the config would refuse as the budget of the replayed walks: time budget for `llm`/`mixed` would do nothing: steps of `mixed` on `llm` have no token budget, so nothing is cut (no replay ran)",
        ),
        (
            vec!["--rates", "1,2", "--step-time-rate", "3", "--budgets", "512", "--requests", "20"],
            "`--step-time-rate`: the step-time rate 3 is not one of the rate scales",
        ),
        // A trace that cannot be read: refused, and the output directory is not left behind.
        (
            vec!["--rates", "1", "--budgets", "512", "--trace", "/nonexistent/t.jsonl"],
            "/nonexistent/t.jsonl",
        ),
    ] {
        let mut all = args.clone();
        all.extend(["--out", s(&out)]);
        let r = sweep(&all);
        // A trace that cannot be read is a failure (1), not a usage error.
        let code = if words.starts_with('/') { 1 } else { 2 };
        assert_eq!(r.code, code, "{args:?}: {r:?}");
        assert!(r.stderr.contains(words), "{args:?}: {}", r.stderr);
        assert_eq!(replays_started(&r), 0, "{args:?}: {}", r.stderr);
        assert!(!out.exists(), "{args:?} left {} behind", out.display());
    }
    // `replay --budget` goes through the same check, before the trace is read.
    let r = run(
        &["replay", "--no-progress", "--budget", "8"],
        &[REPLAY_DEBUG],
    );
    assert_eq!(r.code, 2, "{r:?}");
    assert!(
        r.stderr.contains(
            "`--budget` = 8 is refused as the config would refuse it: budget for `llm`/`mixed` is 8, below the policy's `align` of 16 tokens"
        ),
        "{}",
        r.stderr
    );
    assert_eq!(replays_started(&r), 0);
}

#[test]
fn outputs_are_checked_up_front_and_stale_ones_removed() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    // A directory where report.html goes: refused at once, not after the grid ran.
    std::fs::create_dir_all(out.join("report.html")).unwrap();
    let r = sweep(&[
        "--requests",
        "20",
        "--budgets",
        "512",
        "--rates",
        "1",
        "--out",
        s(&out),
    ]);
    assert_eq!(r.code, 2, "{r:?}");
    assert!(
        r.stderr.contains("report.html` exists and is not a file"),
        "{}",
        r.stderr
    );
    assert_eq!(replays_started(&r), 0, "{}", r.stderr);
    std::fs::remove_dir(out.join("report.html")).unwrap();

    let grid = [
        "--requests",
        "20",
        "--budgets",
        "512",
        "--rates",
        "1",
        "--out",
        s(&out),
    ];
    let mut with_slo = grid.to_vec();
    with_slo.extend(["--slo-tbt-p99", "1000"]);
    let r = sweep(&with_slo);
    assert_eq!(r.code, 0, "{r:?}");
    assert!(out.join("capacity.png").is_file());
    std::fs::write(out.join("notes.txt"), "mine").unwrap();
    // Without an objective there is no capacity plot: the earlier one is removed, so the
    // directory never mixes two runs; a file of another name stays.
    let r = sweep(&grid);
    assert_eq!(r.code, 0, "{r:?}");
    assert!(!out.join("capacity.png").exists());
    assert!(!out.join("capacity.svg").exists());
    assert!(out.join("notes.txt").is_file());
    let mut names: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(
        names,
        [
            "notes.txt",
            "report.html",
            "step_times.png",
            "step_times.svg",
            "sweep.csv",
            "sweep.json",
            "tradeoff.png",
            "tradeoff.svg"
        ]
    );
}

#[test]
fn an_interrupted_sweep_writes_the_finished_cells_marked_and_exits_128_plus_the_signal() {
    for (signal, name, code) in [("-TERM", "SIGTERM", 143), ("-INT", "SIGINT", 130)] {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("out");
        // One replay at a time: when the second starts, the first has finished.
        let mut child = Command::new(BIN)
            .args([
                "sweep",
                "--no-progress",
                "--requests",
                "1500",
                "--jobs",
                "1",
                "--budgets",
                "256,512,1024,2048,off",
                "--rates",
                "1,2,4",
                "--slo-tbt-p99",
                "100",
                "--out",
                s(&out),
            ])
            .current_dir(repo_root())
            .env_clear()
            .env(REPLAY_DEBUG.0, REPLAY_DEBUG.1)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let pid = child.id();
        let watchdog = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_secs(600));
            let _ = Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .status();
        });
        drop(watchdog);
        let mut stderr = BufReader::new(child.stderr.take().unwrap());
        let mut started = 0;
        let mut line = String::new();
        while started < 2 {
            line.clear();
            assert!(stderr.read_line(&mut line).unwrap() > 0, "the sweep ended");
            started += usize::from(line.contains("replay started"));
        }
        let ok = Command::new("kill")
            .args([signal, &pid.to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok);
        let mut rest = String::new();
        std::io::Read::read_to_string(&mut stderr, &mut rest).unwrap();
        let mut stdout = String::new();
        std::io::Read::read_to_string(&mut child.stdout.take().unwrap(), &mut stdout).unwrap();
        assert_eq!(child.wait().unwrap().code(), Some(code), "{name}: {rest}");

        let v: Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("sweep.json")).unwrap())
                .unwrap();
        assert_eq!(v["interrupted"], name);
        let cells = v["cells"].as_array().unwrap();
        let not_run = v["not_run"].as_array().unwrap();
        assert!(!cells.is_empty(), "{name}: the first replay finished");
        assert_eq!(cells[0]["budget"], 256);
        assert_eq!(cells[0]["rate_scale"], 1.0);
        assert!(!not_run.is_empty());
        assert_eq!(cells.len() + not_run.len(), 15);
        assert!(v["capacity"].as_array().unwrap().is_empty());
        let note = format!(
            "interrupted by {name}: {} of 15 grid replays finished",
            cells.len()
        );
        assert!(stdout.contains(&format!("warning: {note}")), "{stdout}");
        assert!(rest.contains(&format!("interrupted by {name}")), "{rest}");
        let csv = std::fs::read_to_string(out.join("sweep.csv")).unwrap();
        assert_eq!(
            csv.lines().filter(|l| l.ends_with(",done")).count(),
            cells.len()
        );
        assert_eq!(
            csv.lines().filter(|l| l.ends_with(",interrupted")).count(),
            not_run.len()
        );
        let html = std::fs::read_to_string(out.join("report.html")).unwrap();
        assert!(html.contains(&note), "{name}");
    }
}

#[test]
fn names_from_inputs_are_escaped_in_check_sweep_and_replay_output() {
    let dir = tempfile::tempdir().unwrap();
    let demo = std::fs::read_to_string(repo_root().join("config/models/demo.toml")).unwrap();
    let model = dir.path().join("model.toml");
    std::fs::write(
        &model,
        demo.replace(
            "name = \"demo\"",
            "name = \"demo\\nok: forged line\\u001b[2J\"",
        ),
    )
    .unwrap();
    // A trace file name with a newline and an escape.
    let trace = dir.path().join("t\nforged\u{1b}[31m.csv");
    std::fs::copy(
        repo_root().join("tests/fixtures/shared/traces/AzureLLMInferenceTrace_code.csv"),
        &trace,
    )
    .unwrap();
    let clean = |what: &str, text: &str| {
        assert!(!text.contains('\u{1b}'), "{what}: {text}");
        assert!(
            !text
                .lines()
                .any(|l| l.starts_with("ok: forged") || l.starts_with("forged")),
            "{what}: {text}"
        );
    };
    let r = run_in(dir.path(), &["check", "--model", s(&model)], &[]);
    assert_eq!(r.code, 0, "{r:?}");
    clean("check", &r.stdout);
    assert!(
        r.stdout
            .contains("model `demo\\nok: forged line\\u{1b}[2J`"),
        "{}",
        r.stdout
    );

    let out = dir.path().join("out");
    let r = run_in(
        dir.path(),
        &[
            "sweep",
            "--no-progress",
            "--model",
            s(&model),
            "--trace",
            s(&trace),
            "--requests",
            "20",
            "--budgets",
            "512",
            "--rates",
            "1",
            "--out",
            s(&out),
        ],
        &[],
    );
    assert_eq!(r.code, 0, "{r:?}");
    clean("sweep stdout", &r.stdout);
    clean("sweep stderr", &r.stderr);
    assert!(
        r.stdout.contains("t\\nforged\\u{1b}[31m.csv"),
        "{}",
        r.stdout
    );
    let html = std::fs::read_to_string(out.join("report.html")).unwrap();
    clean("report.html", &html);
    assert!(
        html.contains("demo\\nok: forged line\\u{1b}[2J"),
        "{html:.3000}"
    );

    let r = run_in(
        dir.path(),
        &[
            "replay",
            "--no-progress",
            "--model",
            s(&model),
            "--trace",
            s(&trace),
            "--requests",
            "20",
        ],
        &[],
    );
    assert_eq!(r.code, 0, "{r:?}");
    clean("replay", &r.stdout);
}
