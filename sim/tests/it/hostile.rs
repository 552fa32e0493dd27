//! Hostile and unlucky inputs against the binary, one test per class of input: unbounded and
//! irregular inputs, outputs that alias inputs, signals mid-replay, non-finite numbers,
//! timestamps out of range, exposure of values and control characters, and closed outputs.
//! Each must be refused with a clear message (or handled), never hang, panic or lose a file.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use crate::helpers::{repo_root, run_in, Run, Watchdog};

const BIN: &str = env!("CARGO_BIN_EXE_mstar-chunking");

fn command(args: &[&str], env: &[(&str, &str)]) -> Command {
    let mut c = Command::new(BIN);
    c.args(args)
        .current_dir(repo_root())
        .env_clear()
        .envs(env.iter().copied());
    c
}

/// Runs the binary like `helpers::run`, killed if it hangs.
fn run_bounded(args: &[&str], env: &[(&str, &str)]) -> Run {
    let child = command(args, env)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let _dog = Watchdog::new(child.id(), 60);
    let out = child.wait_with_output().unwrap();
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

fn mkfifo(path: &Path) {
    let ok = Command::new("mkfifo").arg(path).status().unwrap().success();
    assert!(ok, "mkfifo {}", path.display());
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn assert_no_panic(r: &Run) {
    assert_ne!(r.code, 101, "{r:?}");
    assert!(!r.stderr.contains("panicked"), "{}", r.stderr);
}

/// A Mooncake trace of `n` requests, one block each, `output` tokens to generate each.
fn mooncake(path: &Path, n: usize, output: u64) {
    let mut f = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    for i in 0..n {
        writeln!(
            f,
            "{{\"timestamp\": {i}, \"input_length\": 100, \"output_length\": {output}, \"hash_ids\": [{i}]}}"
        )
        .unwrap();
    }
    f.flush().unwrap();
}

// === unbounded and irregular inputs ===

#[test]
fn fifos_and_devices_as_inputs_are_refused_not_waited_on() {
    let dir = tempfile::tempdir().unwrap();
    let fifo_toml = dir.path().join("fifo.toml");
    let fifo_trace = dir.path().join("fifo.jsonl");
    mkfifo(&fifo_toml);
    mkfifo(&fifo_trace);
    let r = run_bounded(&["check", "--config", s(&fifo_toml)], &[]);
    assert_eq!(r.code, 2, "{r:?}");
    assert!(
        r.stderr.contains(&format!(
            "{}: is not a regular file (it is a FIFO); inputs must be regular files",
            fifo_toml.display()
        )),
        "{}",
        r.stderr
    );
    let r = run_bounded(&["check", "--model", s(&fifo_toml)], &[]);
    assert_eq!(r.code, 2, "{r:?}");
    assert!(
        r.stderr.contains("is not a regular file (it is a FIFO)"),
        "{}",
        r.stderr
    );
    let r = run_bounded(
        &[
            "replay",
            "--trace",
            s(&fifo_trace),
            "--metrics-listen",
            "off",
            "--no-progress",
        ],
        &[],
    );
    assert_eq!(r.code, 1, "{r:?}");
    assert!(
        r.stderr.contains("is not a regular file (it is a FIFO)"),
        "{}",
        r.stderr
    );
    let r = run_bounded(&["check", "--model", "/dev/zero"], &[]);
    assert_eq!(r.code, 2, "{r:?}");
    assert!(r.stderr.contains("(it is a device)"), "{}", r.stderr);
}

#[test]
fn oversized_configs_alias_bombs_and_hex_integers_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let big = dir.path().join("big.toml");
    std::fs::write(&big, "# x\n".repeat(300_000)).unwrap();
    let r = run_bounded(&["check", "--config", s(&big)], &[]);
    assert_eq!(r.code, 2, "{r:?}");
    assert!(
        r.stderr
            .contains("is larger than the limit of 1048576 bytes (docs/config.md#limits)"),
        "{}",
        r.stderr
    );
    // 399 bytes that expand to 9^9 strings.
    let bomb = dir.path().join("bomb.yaml");
    let mut text = String::from(
        "a: &a [\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\"]\n",
    );
    for (i, c) in ('b'..='i').enumerate() {
        let prev = char::from(b'a' + u8::try_from(i).unwrap());
        text.push_str(&format!(
            "{c}: &{c} [{}]\n",
            vec![format!("*{prev}"); 9].join(",")
        ));
    }
    std::fs::write(&bomb, text).unwrap();
    let r = run_bounded(&["check", "--config", s(&bomb)], &[]);
    assert_eq!(r.code, 2, "{r:?}");
    assert!(
        r.stderr
            .contains("YAML alias at line 2: aliases are refused"),
        "{}",
        r.stderr
    );
    let hex = dir.path().join("hex.toml");
    std::fs::write(&hex, "[chunking.max_batch_tokens]\nllm = 0x800\n").unwrap();
    let r = run_bounded(&["check", "--config", s(&hex)], &[]);
    assert_eq!(r.code, 2, "{r:?}");
    assert!(
        r.stderr
            .contains("`chunking.max_batch_tokens.llm` = 0x800: integers are written in decimal"),
        "{}",
        r.stderr
    );
}

#[test]
fn a_huge_bad_value_gives_a_short_error() {
    let dir = tempfile::tempdir().unwrap();
    let layer = dir.path().join("long.toml");
    std::fs::write(
        &layer,
        format!("[log]\nlevel = \"{}[[\"\n", "x".repeat(900_000)),
    )
    .unwrap();
    let r = run_bounded(&["check", "--config", s(&layer)], &[]);
    assert_eq!(r.code, 2, "{r:?}");
    assert!(r.stderr.len() < 2_000, "{} bytes of error", r.stderr.len());
    assert!(r.stderr.contains("`log.level` = \"xxxx"), "{}", r.stderr);
}

// === outputs ===

#[test]
fn outputs_that_are_an_input_or_each_other_are_refused_and_nothing_is_overwritten() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("t.jsonl");
    mooncake(&trace, 5, 3);
    let layer = dir.path().join("layer.toml");
    std::fs::write(&layer, "[chunking]\nmin_chunk_tokens = 32\n").unwrap();
    let link = dir.path().join("link.jsonl");
    std::os::unix::fs::symlink(&trace, &link).unwrap();
    let out = dir.path().join("out.json");
    let before = std::fs::read(&trace).unwrap();
    let base = [
        "replay",
        "--trace",
        s(&trace),
        "--config",
        s(&layer),
        "--metrics-listen",
        "off",
        "--no-progress",
    ];
    for (extra, want) in [
        (vec!["--step-log", s(&trace)], "the step log"),
        (vec!["--step-log", s(&link)], "the step log"),
        (vec!["--report-json", s(&layer)], "the JSON report"),
        (
            vec!["--report-json", "config/models/demo.toml"],
            "the JSON report",
        ),
        (
            vec!["--step-log", s(&out), "--report-json", s(&out)],
            "is also the JSON report",
        ),
        (vec!["--step-log", "/dev/null"], "is not a regular file"),
    ] {
        let mut args = base.to_vec();
        args.extend(extra.iter().copied());
        let r = run_bounded(&args, &[]);
        assert_eq!(r.code, 2, "{extra:?}: {r:?}");
        assert!(r.stderr.contains(want), "{extra:?}: {}", r.stderr);
        assert!(r.stdout.is_empty(), "{extra:?} replayed: {}", r.stdout);
    }
    assert_eq!(
        std::fs::read(&trace).unwrap(),
        before,
        "the trace was overwritten"
    );
    assert_eq!(
        std::fs::read_to_string(&layer).unwrap(),
        "[chunking]\nmin_chunk_tokens = 32\n"
    );
    assert!(!out.exists());
}

#[test]
fn outputs_replace_the_previous_file_whole_and_leave_no_temporary_file() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("steps.jsonl");
    let report = dir.path().join("report.json");
    std::fs::write(&log, "{\"half a li").unwrap();
    std::fs::write(&report, "old").unwrap();
    let r = run_bounded(
        &[
            "replay",
            "--requests",
            "20",
            "--metrics-listen",
            "off",
            "--no-progress",
            "--step-log",
            s(&log),
            "--report-json",
            s(&report),
        ],
        &[],
    );
    assert_eq!(r.code, 0, "{r:?}");
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let rep: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    assert_eq!(lines.len() as u64, rep["steps"].as_u64().unwrap());
    assert_eq!(rep["interrupted"], serde_json::Value::Null);
    let names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names.len(), 2, "{names:?}");
}

/// Starts a replay of a trace too long to finish (50,000 requests generating 2^20 tokens each,
/// within the per-request limits: reserving their latency samples up front would take 200 GB),
/// and returns it once it is replaying.
fn start_long_replay(dir: &Path) -> (Child, PathBuf, PathBuf) {
    let trace = dir.join("long.jsonl");
    mooncake(&trace, 50_000, 1 << 20);
    let (log, report) = (dir.join("steps.jsonl"), dir.join("report.json"));
    let mut child = command(
        &[
            "replay",
            "--trace",
            s(&trace),
            "--metrics-listen",
            "off",
            "--no-progress",
            "--step-log",
            s(&log),
            "--report-json",
            s(&report),
        ],
        &[("RUST_LOG", "mstar_chunking_sim::replay=debug")],
    )
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    // Blocks until the replay says it started (its signal handlers are in place by then).
    let stderr = child.stderr.take().unwrap();
    let mut lines = BufReader::new(stderr).lines();
    let started = lines
        .by_ref()
        .take(50)
        .any(|l| l.is_ok_and(|l| l.contains("replay started")));
    assert!(started, "the replay did not start");
    std::thread::spawn(move || lines.for_each(drop));
    (child, log, report)
}

#[test]
fn sigint_and_sigterm_stop_at_a_step_and_write_the_report_marked_interrupted() {
    for (signal, name, code) in [("-INT", "SIGINT", 130), ("-TERM", "SIGTERM", 143)] {
        let dir = tempfile::tempdir().unwrap();
        let (child, log, report) = start_long_replay(dir.path());
        let _dog = Watchdog::new(child.id(), 60);
        let ok = Command::new("kill")
            .args([signal, &child.id().to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok);
        let out = child.wait_with_output().unwrap();
        assert_eq!(out.status.code(), Some(code), "{name}");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            stdout.contains(&format!("interrupted              by {name}")),
            "{stdout}"
        );
        let rep: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
        assert_eq!(rep["interrupted"], name);
        let text = std::fs::read_to_string(&log).unwrap();
        assert!(text.ends_with('\n') || text.is_empty(), "half a line");
        let mut steps = 0u64;
        for l in text.lines() {
            serde_json::from_str::<serde_json::Value>(l)
                .expect("every step log line is whole JSON");
            steps += 1;
        }
        assert_eq!(steps, rep["steps"].as_u64().unwrap(), "{name}");
    }
}

/// A signal that lands where no step boundary checks for it still gives the signal's exit
/// status: before the replay starts (0 steps run), after its last step but before the report is
/// written (the JSON report and the text say interrupted), after the JSON report, and after
/// the text report. The `test-hooks` door sends the signal at that point and waits for its
/// handler, so each case is exact, not a race.
#[test]
fn a_signal_before_the_report_is_out_always_gives_the_signals_exit_status() {
    for (point, sig, name, code) in [
        ("start", "INT", "SIGINT", 130),
        ("ran", "INT", "SIGINT", 130),
        ("ran", "TERM", "SIGTERM", 143),
        ("written", "TERM", "SIGTERM", 143),
        ("printed", "INT", "SIGINT", 130),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let (log, report) = (dir.path().join("steps.jsonl"), dir.path().join("r.json"));
        let at = format!("{point}:{sig}");
        let r = run_bounded(
            &[
                "replay",
                "--requests",
                "5",
                "--metrics-listen",
                "off",
                "--no-progress",
                "--step-log",
                s(&log),
                "--report-json",
                s(&report),
            ],
            &[("MSTAR_TEST_SIGNAL_AT", &at)],
        );
        assert_eq!(r.code, code, "{at}: {r:?}");
        assert!(
            r.stderr.contains(&format!("interrupted by {name}")),
            "{at}: {}",
            r.stderr
        );
        let rep: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
        let text = std::fs::read_to_string(&log).unwrap();
        assert_eq!(
            text.lines().count() as u64,
            rep["steps"].as_u64().unwrap(),
            "{at}"
        );
        let marked = format!("interrupted              by {name}");
        match point {
            "start" | "ran" => {
                assert_eq!(rep["interrupted"], name, "{at}");
                assert!(r.stdout.contains(&marked), "{at}: {}", r.stdout);
                if point == "start" {
                    assert_eq!(rep["steps"], 0, "{at}");
                } else {
                    // Every request ran to its last token.
                    assert_eq!(rep["ttft_ms"]["samples"], 5, "{at}: {rep}");
                    assert_eq!(rep["prepared_left_rows"], 0, "{at}: {rep}");
                }
            }
            // The JSON report was out before the signal; the text still says so.
            "written" => assert!(r.stdout.contains(&marked), "{at}: {}", r.stdout),
            _ => assert!(r.stdout.contains("requests"), "{at}: {}", r.stdout),
        }
    }
    // Without a signal the same run exits 0.
    let r = run_bounded(
        &[
            "replay",
            "--requests",
            "5",
            "--metrics-listen",
            "off",
            "--no-progress",
        ],
        &[("MSTAR_TEST_SIGNAL_AT", "nowhere:INT")],
    );
    assert_eq!(r.code, 0, "{r:?}");
}

// === closed outputs ===

#[test]
fn a_closed_stdout_ends_quietly_and_a_full_one_is_an_error_not_a_panic() {
    // A socket whose other end is closed: every write gets EPIPE, as `| head -1` does.
    let (ours, theirs) = std::os::unix::net::UnixStream::pair().unwrap();
    drop(ours);
    let out = command(
        &[
            "replay",
            "--requests",
            "5",
            "--metrics-listen",
            "off",
            "--no-progress",
        ],
        &[],
    )
    .stdout(Stdio::from(std::os::fd::OwnedFd::from(theirs)))
    .stderr(Stdio::piped())
    .output()
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(stderr.is_empty(), "{stderr}");

    let full = || {
        std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/full")
            .unwrap()
    };
    let out = command(&["check"], &[])
        .stdout(Stdio::from(full()))
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.starts_with("error: cannot write to stdout"),
        "{stderr}"
    );
    // A refused config with stderr on /dev/full: the usual 2, not a panic's 101.
    let out = command(&["check", "--model", "nope.toml"], &[])
        .stdout(Stdio::null())
        .stderr(Stdio::from(full()))
        .status()
        .unwrap();
    assert_eq!(out.code(), Some(2));
}

// === numbers and timestamps ===

#[test]
fn check_and_replay_agree_on_every_replay_setting() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("t.jsonl");
    mooncake(&trace, 3, 2);
    for (text, key) in [
        (
            "[replay]\nwalk = \"decode\"\n",
            "`replay.walk` = \"decode\"",
        ),
        (
            "[replay.cost]\nbase_ms = 0.0\nper_token_ms = 0.0\n",
            "`replay.cost`",
        ),
        (
            "[replay.cost]\nbase_ms = 1.7e308\n",
            "`replay.cost.base_ms` = 1.7e308",
        ),
        (
            "[replay.speculation]\ntokens = 2000000000\n",
            "`replay.speculation.tokens` = 2000000000",
        ),
        (
            "[replay.speculation]\novershoot_rate = nan\n",
            "`replay.speculation.overshoot_rate` = \"NaN\"",
        ),
        ("[replay]\nnode = \"ghost\"\n", "`replay.node` = \"ghost\""),
    ] {
        let layer = dir.path().join("layer.toml");
        std::fs::write(&layer, text).unwrap();
        let want = format!("{}: {key}", layer.display());
        let r = run_bounded(&["check", "--config", s(&layer)], &[]);
        assert_eq!(r.code, 2, "check {text}: {r:?}");
        assert!(r.stderr.contains(&want), "check {text}: {}", r.stderr);
        let r = run_bounded(
            &[
                "replay",
                "--config",
                s(&layer),
                "--trace",
                s(&trace),
                "--metrics-listen",
                "off",
                "--no-progress",
            ],
            &[],
        );
        assert_eq!(r.code, 2, "replay {text}: {r:?}");
        assert!(r.stderr.contains(&want), "replay {text}: {}", r.stderr);
    }
    // What check accepts, replay runs: the largest cost.
    let layer = dir.path().join("layer.toml");
    std::fs::write(&layer, "[replay.cost]\nbase_ms = 1e6\nper_token_ms = 1e6\n").unwrap();
    assert_eq!(run_bounded(&["check", "--config", s(&layer)], &[]).code, 0);
    let report = dir.path().join("r.json");
    let r = run_bounded(
        &[
            "replay",
            "--config",
            s(&layer),
            "--trace",
            s(&trace),
            "--metrics-listen",
            "off",
            "--no-progress",
            "--rate-scale",
            "0.000001",
            "--report-json",
            s(&report),
        ],
        &[],
    );
    assert_eq!(r.code, 0, "{r:?}");
    let rep: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    assert!(rep["simulated_ms"].as_f64().unwrap().is_finite());
    assert!(rep["ttft_ms"]["max"].as_f64().unwrap().is_finite());
}

#[test]
fn rate_scales_that_would_make_times_infinite_are_refused() {
    for bad in ["1e-308", "1e308", "inf", "NaN", "0"] {
        let r = run_bounded(
            &["replay", "--rate-scale", bad, "--metrics-listen", "off"],
            &[],
        );
        assert_eq!(r.code, 2, "{bad}: {r:?}");
        assert!(r.stderr.contains("--rate-scale"), "{bad}: {}", r.stderr);
    }
}

#[test]
fn azure_timestamps_outside_the_range_are_bad_lines_not_overflows() {
    let dir = tempfile::tempdir().unwrap();
    for year in ["2263", "1600", "9999"] {
        let trace = dir.path().join("t.csv");
        std::fs::write(
            &trace,
            format!("TIMESTAMP,ContextTokens,GeneratedTokens\n{year}-01-01 00:00:00.0,10,2\n"),
        )
        .unwrap();
        let r = run_bounded(
            &[
                "replay",
                "--trace",
                s(&trace),
                "--metrics-listen",
                "off",
                "--no-progress",
            ],
            &[],
        );
        assert_no_panic(&r);
        assert_eq!(r.code, 1, "{year}: {r:?}");
        assert!(
            r.stderr
                .contains("is outside the supported range 1677-09-22 to 2262-04-11"),
            "{year}: {}",
            r.stderr
        );
    }
}

#[test]
fn mooncake_timestamps_count_from_the_first_request() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("epoch.jsonl");
    // Epoch nanoseconds, 1 s apart: beyond what an f64 holds exactly.
    std::fs::write(
        &trace,
        "{\"timestamp\": 1700000000000000000, \"input_length\": 600, \"output_length\": 3, \"hash_ids\": [1, 2]}\n\
         {\"timestamp\": 1700000000000001000, \"input_length\": 600, \"output_length\": 3, \"hash_ids\": [3, 4]}\n",
    )
    .unwrap();
    let report = dir.path().join("r.json");
    let r = run_bounded(
        &[
            "replay",
            "--trace",
            s(&trace),
            "--metrics-listen",
            "off",
            "--no-progress",
            "--report-json",
            s(&report),
        ],
        &[],
    );
    assert_eq!(r.code, 0, "{r:?}");
    let rep: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    // Each prompt takes at least one 8 ms step: a TTFT of 0 means the arrivals were lost.
    assert!(rep["ttft_ms"]["p50"].as_f64().unwrap() >= 8.0, "{rep}");
    assert!(rep["simulated_ms"].as_f64().unwrap() >= 1000.0, "{rep}");
}

#[test]
fn invalid_utf8_in_a_mooncake_line_is_a_bad_line_with_its_number() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("t.jsonl");
    let mut bytes =
        b"{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 2, \"hash_ids\": [1]}\n"
            .to_vec();
    bytes.extend_from_slice(b"{\"timestamp\": 1, \"input_length\": \xff}\n");
    bytes.extend_from_slice(
        b"{\"timestamp\": 2, \"input_length\": 10, \"output_length\": 2, \"hash_ids\": [2]}\n",
    );
    std::fs::write(&trace, bytes).unwrap();
    let args = [
        "replay",
        "--trace",
        s(&trace),
        "--metrics-listen",
        "off",
        "--no-progress",
    ];
    let r = run_bounded(&args, &[]);
    assert_eq!(r.code, 1, "{r:?}");
    assert!(
        r.stderr.contains("t.jsonl:2: `line` is not UTF-8 text"),
        "{}",
        r.stderr
    );
    let mut skip = args.to_vec();
    skip.push("--skip-bad-lines");
    let r = run_bounded(&skip, &[]);
    assert_eq!(r.code, 0, "{r:?}");
    assert!(r.stdout.contains("2 (1 bad line skipped)"), "{}", r.stdout);
}

// === exposure ===

#[test]
fn mstar_env_is_a_name_in_the_config_folder_and_nothing_else() {
    let dir = tempfile::tempdir().unwrap();
    let outside = dir.path().join("x.toml");
    std::fs::write(&outside, "[chunking]\nmin_chunk_tokens = 8\n").unwrap();
    let abs = outside.with_extension("");
    for bad in ["../x", s(&abs), "prod\nuction"] {
        let r = run_bounded(&["check"], &[("MSTAR_ENV", bad)]);
        assert_eq!(r.code, 2, "{bad:?}: {r:?}");
        assert!(
            r.stderr
                .contains("`MSTAR_ENV`: must be a name of 1 to 64 letters, digits, `-` or `_`"),
            "{bad:?}: {}",
            r.stderr
        );
        assert_eq!(r.stderr.lines().count(), 2, "{}", r.stderr);
    }
}

#[test]
fn unknown_keys_never_print_their_values_and_control_characters_are_escaped() {
    let dir = tempfile::tempdir().unwrap();
    let layer = dir.path().join("layer.yaml");
    std::fs::write(&layer, "metrics:\n  api_token: hunter2-private\n").unwrap();
    let r = run_in(
        dir.path(),
        &["check", "--config", s(&layer)],
        &[
            ("MSTAR__LOG__PASSWORD", "pw-private"),
            ("MSTAR__CHUNKING__X\u{1b}[2J\nY", "1"),
        ],
    );
    assert_eq!(r.code, 2, "{r:?}");
    assert!(!r.stderr.contains("private"), "{}", r.stderr);
    assert!(
        r.stderr
            .contains("`metrics.api_token`: unknown field `api_token`"),
        "{}",
        r.stderr
    );
    assert!(
        r.stderr
            .contains("`log.password`: unknown field `password`"),
        "{}",
        r.stderr
    );
    assert!(!r.stderr.contains('\u{1b}'), "{}", r.stderr);
    assert!(r.stderr.contains("\\u{1b}[2j\\ny"), "{}", r.stderr);
    // The header and one line per problem: no forged lines.
    assert_eq!(r.stderr.lines().count(), 4, "{}", r.stderr);
}

#[test]
fn metrics_on_every_interface_warn_what_they_expose() {
    let r = run_bounded(
        &[
            "replay",
            "--requests",
            "2",
            "--metrics-listen",
            "0.0.0.0:0",
            "--no-progress",
        ],
        &[],
    );
    assert_eq!(r.code, 0, "{r:?}");
    assert!(
        r.stderr
            .contains("non-loopback address: anyone who can reach it can read every metric"),
        "{}",
        r.stderr
    );
    let r = run_bounded(
        &[
            "replay",
            "--requests",
            "2",
            "--metrics-listen",
            "127.0.0.1:0",
            "--no-progress",
        ],
        &[],
    );
    assert_eq!(r.code, 0, "{r:?}");
    assert!(!r.stderr.contains("non-loopback"), "{}", r.stderr);
}

#[test]
fn a_model_replay_cannot_drive_is_noted_by_check_and_refused_by_replay() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("enc.toml");
    std::fs::write(
        &model,
        "name = \"enc\"\nwalks = [\"prefill\"]\n[nodes.enc]\nchunkable_walks = [\"prefill\"]\npolicies = { prefill = { max_batch_tokens = 512 } }\n",
    )
    .unwrap();
    let want = format!(
        "model manifest {}: `walks` of model `enc` must include `decode`",
        model.display()
    );
    let r = run_bounded(&["check", "--model", s(&model)], &[]);
    assert_eq!(r.code, 0, "{r:?}");
    assert!(
        r.stderr
            .contains(&format!("note: `replay` cannot drive this model: {want}")),
        "{}",
        r.stderr
    );
    let r = run_bounded(
        &[
            "replay",
            "--model",
            s(&model),
            "--metrics-listen",
            "off",
            "--no-progress",
        ],
        &[],
    );
    assert_eq!(r.code, 2, "{r:?}");
    assert!(r.stderr.contains(&want), "{}", r.stderr);
}
