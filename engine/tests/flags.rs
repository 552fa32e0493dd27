//! The binary's flags and signals: bad values are refused at start naming the flag (never a
//! panic, never a silent default), files follow the input and output rules, a second signal
//! stops at once, the log goes to stderr, and `bench` refuses what it cannot run.

use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_mstar-engine");

/// Waits (bounded) for `child` to exit; kills it and fails past `limit`.
fn wait_bounded(mut child: Child, limit: Duration, what: &str) -> Output {
    let t0 = Instant::now();
    loop {
        if child.try_wait().unwrap().is_some() {
            return child.wait_with_output().unwrap();
        }
        if t0.elapsed() > limit {
            child.kill().unwrap();
            let out = child.wait_with_output().unwrap();
            panic!(
                "{what}: no exit within {limit:?}; stderr: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn run(args: &[&str]) -> Output {
    let child = Command::new(BIN)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_bounded(child, Duration::from_secs(30), &args.join(" "))
}

/// `serve` with `args` must refuse to start: a non-zero exit (not a panic's 101) with `says`
/// on stderr.
fn refused(args: &[&str], says: &str) {
    let mut all = vec!["serve", "--model", "tiny", "--listen", "127.0.0.1:0"];
    all.extend_from_slice(args);
    refused_run(&all, args, says);
}

/// The command `all` must refuse to start as [`refused`] says; `args` names the case.
fn refused_run(all: &[&str], args: &[&str], says: &str) {
    let out = run(all);
    let err = String::from_utf8_lossy(&out.stderr);
    let code = out.status.code();
    assert!(
        code.is_some_and(|c| c != 0 && c != 101),
        "{args:?}: exit {code:?}, stderr {err}"
    );
    assert!(err.contains(says), "{args:?}: stderr lacks {says:?}: {err}");
    assert!(!err.contains("panicked"), "{args:?}: {err}");
}

fn mkfifo(path: &Path) {
    let ok = Command::new("mkfifo").arg(path).status().unwrap();
    assert!(ok.success());
}

#[test]
fn bad_grace_values_are_refused_naming_the_flag() {
    for v in ["inf", "1e20", "1e19", "nan", "-5", "86401"] {
        refused(&["--grace-secs", v], "--grace-secs");
    }
}

#[test]
fn zero_memory_and_zero_queue_are_refused() {
    refused(&["--kv-tokens", "0"], "--kv-tokens");
    refused(&["--max-waiting", "0"], "--max-waiting");
}

#[test]
fn an_overflowing_cost_is_refused_as_the_config_refuses_it() {
    refused(&["--cost", "0,1e308,0,0"], "--cost");
    refused(&["--cost", "0,1e308,0,0"], "per_token_ms");
    refused(&["--cost", "1,nan,0,0"], "--cost");
}

#[test]
fn the_step_log_follows_the_output_rules() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("fifo");
    mkfifo(&fifo);
    refused(
        &["--step-log", fifo.to_str().unwrap()],
        "not a regular file",
    );
    refused(&["--step-log", "/dev/full"], "not a regular file");
    // Naming the weights: refused before anything is written.
    let weights = dir.path().join("w.safetensors");
    let model = mstar_engine::model::Config::tiny()
        .random_weights(1, &candle_core::Device::Cpu)
        .unwrap();
    mstar_engine::model::save_safetensors(&model, &weights).unwrap();
    let before = std::fs::read(&weights).unwrap();
    let w = weights.to_str().unwrap();
    refused(&["--weights", w, "--step-log", w], "would be overwritten");
    assert_eq!(
        std::fs::read(&weights).unwrap(),
        before,
        "the weights are intact"
    );
}

#[test]
fn the_weights_follow_the_input_rules() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("fifo");
    mkfifo(&fifo);
    refused(&["--weights", fifo.to_str().unwrap()], "not a regular file");
    refused(&["--weights", "/dev/zero"], "not a regular file");
    // Larger than the tiny model's tensors in f32 and a header could be (a sparse file).
    let big = dir.path().join("big.safetensors");
    let f = std::fs::File::create(&big).unwrap();
    f.set_len(1 << 30).unwrap();
    refused(&["--weights", big.to_str().unwrap()], "more than");
}

/// `--gguf` follows the same input rules as every file the engine reads, and a file that is not
/// a whole GGUF is refused at start naming it.
#[test]
fn the_gguf_follows_the_input_rules() {
    let dir = tempfile::tempdir().unwrap();
    let gguf_refused = |path: &Path, says: &str| {
        let p = path.to_str().unwrap();
        refused_run(
            &["serve", "--listen", "127.0.0.1:0", "--gguf", p],
            &[p],
            says,
        );
        // The file is named, whatever the reason.
        refused_run(&["serve", "--listen", "127.0.0.1:0", "--gguf", p], &[p], p);
    };
    let fifo = dir.path().join("fifo.gguf");
    mkfifo(&fifo);
    gguf_refused(&fifo, "not a regular file");
    gguf_refused(Path::new("/dev/zero"), "not a regular file");
    let big = dir.path().join("big.gguf");
    std::fs::File::create(&big)
        .unwrap()
        .set_len(mstar_engine::model::gguf::MAX_GGUF_BYTES + 1)
        .unwrap();
    gguf_refused(&big, "more than");
    // The real model's first 64 KiB: its header reads, its tensors do not.
    let real = mstar_engine::model::gguf::smollm2_path().unwrap_or_else(|e| panic!("{e}"));
    let mut head = vec![0u8; 64 << 10];
    std::io::Read::read_exact(&mut std::fs::File::open(real).unwrap(), &mut head).unwrap();
    let cut = dir.path().join("cut.gguf");
    std::fs::write(&cut, &head).unwrap();
    gguf_refused(&cut, "cut.gguf");
    let junk = dir.path().join("junk.gguf");
    std::fs::write(&junk, b"not a gguf at all").unwrap();
    gguf_refused(&junk, "junk.gguf");
}

/// The address a starting `serve` prints on its first line of stdout.
fn listening_address(child: &mut Child) -> String {
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    line.split("http://")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .unwrap_or_else(|| panic!("no address in {line:?}"))
        .to_owned()
}

/// Starts `serve` on the tiny model; answers the child and its address.
fn serve(extra: &[&str], env: &[(&str, &str)]) -> (Child, String) {
    let mut child = Command::new(BIN)
        .args(["serve", "--model", "tiny", "--listen", "127.0.0.1:0"])
        .args(extra)
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let addr = listening_address(&mut child);
    (child, addr)
}

fn kill(child: &Child, sig: &str) {
    let ok = Command::new("kill")
        .args([&format!("-{sig}"), &child.id().to_string()])
        .status()
        .unwrap();
    assert!(ok.success());
}

/// A long streamed request, read on a thread of its own until the server goes away.
fn long_request(addr: &str) -> std::thread::JoinHandle<()> {
    let addr = addr.to_owned();
    let body = r#"{"prompt": "long", "max_tokens": 4000, "stream": true, "ignore_eos": true}"#;
    let mut conn = std::net::TcpStream::connect(&addr).unwrap();
    std::io::Write::write_all(
        &mut conn,
        format!(
            "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
    )
    .unwrap();
    // The first bytes: the request runs.
    let mut first = [0u8; 64];
    conn.set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let _ = conn.read(&mut first).unwrap();
    std::thread::spawn(move || {
        let mut sink = Vec::new();
        let _ = conn.read_to_end(&mut sink);
    })
}

/// A second SIGTERM stops at once (status 143), without waiting out the grace; the shutdown is
/// logged on stderr.
#[test]
fn a_second_signal_stops_at_once() {
    let (child, addr) = serve(&["--grace-secs", "3600"], &[("RUST_LOG", "info")]);
    let reader = long_request(&addr);
    kill(&child, "TERM");
    // Wait (bounded) for the first signal to be taken: its line on stderr.
    let mut child = child;
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let t0 = Instant::now();
    let mut seen = String::new();
    loop {
        let mut line = String::new();
        if err.read_line(&mut line).unwrap() == 0 {
            panic!("stderr ended before the shutdown line: {seen}");
        }
        seen.push_str(&line);
        if line.contains("shutting down") {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "{seen}");
    }
    kill(&child, "TERM");
    let out = wait_bounded(child, Duration::from_secs(20), "second SIGTERM");
    assert_eq!(out.status.code(), Some(143), "{seen}");
    assert!(seen.contains("INFO"), "the log reaches stderr: {seen}");
    reader.join().unwrap();
}

/// A step log that cannot be written (the file size limit, so writes fail with EFBIG) is
/// reported, and the exit is non-zero.
#[test]
fn a_failed_step_log_write_is_reported_with_a_non_zero_exit() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("steps.jsonl");
    // SIGXFSZ ignored: a write past the limit fails instead of killing the process.
    let script = format!(
        "trap '' XFSZ; ulimit -f 1; exec {BIN} serve --model tiny --listen 127.0.0.1:0 --grace-secs 1 --step-log {}",
        log.display()
    );
    let mut child = Command::new("sh")
        .args(["-c", &script])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let addr = listening_address(&mut child);
    // Enough steps to write more than 512 bytes of log.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let r = reqwest::Client::new()
            .post(format!("http://{addr}/v1/completions"))
            .json(&serde_json::json!({"prompt": "x", "max_tokens": 64, "ignore_eos": true}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
    });
    kill(&child, "TERM");
    let out = wait_bounded(child, Duration::from_secs(30), "SIGTERM");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "exit {:?}: {err}", out.status);
    assert!(err.contains("--step-log"), "{err}");
}

#[test]
fn bench_refuses_what_it_cannot_run() {
    let dir = tempfile::tempdir().unwrap();
    let bench = |args: &[&str]| {
        let mut all = vec!["bench", "--url", "http://127.0.0.1:9"];
        all.extend_from_slice(args);
        run(&all)
    };
    let check = |out: Output, says: &str| {
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        let code = out.status.code();
        assert!(
            code.is_some_and(|c| c != 0 && c != 101),
            "exit {code:?}: {err}"
        );
        assert!(err.contains(says), "stderr lacks {says:?}: {err}");
    };
    check(bench(&["--trace", "/dev/zero"]), "not a regular file");
    let trace = dir.path().join("t.csv");
    std::fs::write(&trace, "arrival_ms,prompt_tokens,output_tokens\n0,10,2\n").unwrap();
    let t = trace.to_str().unwrap();
    for v in ["inf", "nan", "0", "-1"] {
        check(
            bench(&["--trace", t, "--timeout-secs", v]),
            "--timeout-secs",
        );
    }
    let late = dir.path().join("late.csv");
    std::fs::write(
        &late,
        "arrival_ms,prompt_tokens,output_tokens\n0,10,2\n1e308,10,2\n",
    )
    .unwrap();
    check(
        bench(&["--trace", late.to_str().unwrap()]),
        "request 2 arrives at 1",
    );
    // The report must not overwrite the trace.
    check(
        bench(&["--trace", t, "--report-json", t]),
        "would be overwritten",
    );
    // Nothing listens at the URL: every request fails, and the exit says so.
    let out = bench(&["--trace", t, "--timeout-secs", "20"]);
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["failed"], 1, "{report}");
    check(out, "1 of 1 requests failed");
}

#[test]
fn an_unknown_weight_format_or_device_is_refused() {
    refused(&["--weight-format", "q4_k"], "--weight-format");
    refused(&["--device", "tpu"], "--device");
}

/// `export-tokenizer` writes its three files into a new or existing directory (again over them),
/// leaves no temporary file, and refuses an `--out` that is a file, a FIFO where a file goes,
/// an output that is the GGUF itself, a bad `--gguf` and a model without a tokenizer.
#[test]
fn export_tokenizer_follows_the_file_rules() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("tok");
    let o = out.to_str().unwrap();
    for _ in 0..2 {
        let r = run(&["export-tokenizer", "--out", o]);
        assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
        let mut names: Vec<String> = std::fs::read_dir(&out)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(
            names,
            ["config.json", "tokenizer.json", "tokenizer_config.json"]
        );
    }
    let file = dir.path().join("file");
    std::fs::write(&file, b"x").unwrap();
    let f = file.to_str().unwrap();
    refused_run(&["export-tokenizer", "--out", f], &[f], "not a directory");
    refused_run(
        &["export-tokenizer", "--model", "tiny", "--out", o],
        &["tiny"],
        "--model `tiny`",
    );
    refused_run(
        &["export-tokenizer", "--gguf", "/dev/zero", "--out", o],
        &["/dev/zero"],
        "not a regular file",
    );
    let fifo_dir = dir.path().join("fifo");
    std::fs::create_dir(&fifo_dir).unwrap();
    mkfifo(&fifo_dir.join("tokenizer.json"));
    let fd = fifo_dir.to_str().unwrap();
    refused_run(
        &["export-tokenizer", "--out", fd],
        &[fd],
        "not a regular file",
    );
    // tokenizer.json a link to the GGUF given: writing it would replace the model.
    let real = mstar_engine::model::gguf::smollm2_path().unwrap_or_else(|e| panic!("{e}"));
    let copy = dir.path().join("model.gguf");
    std::fs::copy(&real, &copy).unwrap();
    let alias_dir = dir.path().join("alias");
    std::fs::create_dir(&alias_dir).unwrap();
    std::os::unix::fs::symlink(&copy, alias_dir.join("tokenizer.json")).unwrap();
    let (c, a) = (copy.to_str().unwrap(), alias_dir.to_str().unwrap());
    refused_run(
        &["export-tokenizer", "--gguf", c, "--out", a],
        &[a],
        "would be overwritten",
    );
    assert_eq!(
        std::fs::metadata(&copy).unwrap().len(),
        std::fs::metadata(&real).unwrap().len()
    );
}

/// `GET path` on `addr` over a connection of its own: the whole answer (status line, headers
/// and body), read within 10 s.
fn get(addr: &str, path: &str) -> String {
    use std::io::Write;
    let mut conn = std::net::TcpStream::connect(addr).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    write!(
        conn,
        "GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
    )
    .unwrap();
    let mut answer = String::new();
    conn.read_to_string(&mut answer).unwrap();
    answer
}

/// An empty `--served-model-name` is no name given, as vLLM takes it: the model's own name is
/// served, never a model whose id is `""`; a name given is served as given.
#[test]
fn an_empty_served_model_name_serves_the_models_own_name() {
    for (given, id) in [("", "tiny"), ("mine", "mine")] {
        let (child, addr) = serve(&["--served-model-name", given], &[]);
        let answer = get(&addr, "/v1/models");
        kill(&child, "TERM");
        wait_bounded(child, Duration::from_secs(20), "SIGTERM");
        let body = answer.split("\r\n\r\n").nth(1).unwrap_or("");
        let v: serde_json::Value =
            serde_json::from_str(body).unwrap_or_else(|e| panic!("{given:?}: {e}: {answer}"));
        assert_eq!(v["data"][0]["id"], id, "{given:?}: {answer}");
        assert_eq!(v["data"].as_array().unwrap().len(), 1, "{answer}");
    }
}
