//! The metrics, the Grafana dashboard and the alert rules, checked with the real tools:
//! `promtool` on a live scrape and on every PromQL expression, a real Prometheus scraping a
//! running replay and answering every dashboard query, and `tsc` against Grafana's published
//! dashboard types. `make test-deps` (scripts/install-test-deps.sh) installs the tools.
//!
//! Every process a test starts is killed when the test ends, pass or fail ([`KillOnDrop`]);
//! servers listen on free ports of 127.0.0.1.

use std::collections::BTreeSet;
use std::fs::File;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use mstar_chunking::metrics;
use serde_json::Value;
use tempfile::TempDir;

const REPO: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
const DASHBOARD: &str = "dashboards/mstar-chunking.json";
const ALERTS: &str = "dashboards/alerts.yml";
const ALERTS_TEST: &str = "dashboards/alerts.test.yml";
const TYPECHECK: &str = "dashboards/typecheck/check.mjs";

/// The model the live replay runs (the bundled demo: node `llm`, combined walk `mixed`).
const MODEL: &str = "config/models/demo.toml";

/// A replay config that forces overruns: a small budget filled by prefill chunks, and
/// continuing rows that overshoot their speculative estimates.
const OVERRUN_CONFIG: &str = "\
[chunking.max_batch_tokens]
llm = { mixed = 512 }

[chunking.max_step_ms]
llm = { mixed = 30.0 }

[chunking.cost]
llm = { base_ms = 8.0, per_token_ms = 0.02, per_kv_token_ms = 0.0, per_attention_pair_ms = 0.0 }

[replay]
speculation = { tokens = 3, overshoot_rate = 0.3, seed = 1 }
";

/// What the dashboard's template variables and Grafana's interval variables stand for.
const RATE_INTERVAL: &str = "1m";
const RANGE: &str = "5m";

/// Panels that must show data for a replay that overruns.
const KEY_PANELS: [&str; 3] = [
    "Step tokens against budget",
    "Overrun rate by reason",
    "Prepared inputs held (rows)",
];

// === helpers ===

fn repo_path(rel: &str) -> PathBuf {
    Path::new(REPO).join(rel)
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(repo_path(rel)).unwrap_or_else(|e| panic!("cannot read {rel}: {e}"))
}

/// A tool the tests need, from PATH.
fn tool(name: &str) -> PathBuf {
    std::env::var_os("PATH")
        .and_then(|paths| {
            std::env::split_paths(&paths)
                .map(|dir| dir.join(name))
                .find(|p| p.is_file())
        })
        .unwrap_or_else(|| {
            panic!("`{name}` is not on PATH; run `make test-deps` (scripts/install-test-deps.sh)")
        })
}

fn run(cmd: &mut Command) -> Output {
    cmd.output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"))
}

fn text(out: &Output) -> String {
    format!(
        "status {}\n--- stdout\n{}--- stderr\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// A child process that is killed (and reaped) when the guard drops, so that a failing test
/// leaves no server behind.
struct KillOnDrop {
    child: Child,
    name: &'static str,
    log: PathBuf,
}

impl KillOnDrop {
    /// Starts `cmd` with stdout and stderr to `log` (a file, not a pipe that could fill up).
    fn spawn(name: &'static str, mut cmd: Command, log: PathBuf) -> Self {
        let out = File::create(&log).unwrap_or_else(|e| panic!("cannot create {log:?}: {e}"));
        let err = out.try_clone().expect("log file handle");
        let child = cmd
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name} ({cmd:?}): {e}"));
        Self { child, name, log }
    }

    /// Panics with the log if the process has exited.
    fn assert_running(&mut self) {
        if let Ok(Some(status)) = self.child.try_wait() {
            panic!(
                "{} exited early ({status}); its output:\n{}",
                self.name,
                std::fs::read_to_string(&self.log).unwrap_or_default()
            );
        }
    }
}

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A free port on 127.0.0.1 (free when asked; the process that binds it follows at once).
fn free_addr() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free local port")
}

/// Calls `f` until it answers, at most for `bound`; `what` names the wait in the failure.
fn poll<T>(what: &str, bound: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(
            start.elapsed() < bound,
            "gave up after {bound:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// `GET http://addr/path` over HTTP/1.0 (the body ends with the connection); the status and
/// body, or why there is none.
fn http_get(addr: SocketAddr, path: &str) -> Result<(u16, String), String> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2))
        .map_err(|e| format!("connect {addr}: {e}"))?;
    s.set_read_timeout(Some(Duration::from_secs(20)))
        .and_then(|_| s.set_write_timeout(Some(Duration::from_secs(5))))
        .map_err(|e| e.to_string())?;
    write!(
        s,
        "GET {path} HTTP/1.0\r\nHost: {addr}\r\nAccept: */*\r\n\r\n"
    )
    .map_err(|e| format!("send to {addr}: {e}"))?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)
        .map_err(|e| format!("read from {addr}: {e}"))?;
    let raw = String::from_utf8(raw).map_err(|e| format!("non-UTF-8 answer from {addr}: {e}"))?;
    let (head, body) = raw
        .split_once("\r\n\r\n")
        .ok_or_else(|| format!("no HTTP header from {addr}: {raw:.200}"))?;
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| format!("no HTTP status from {addr}: {head}"))?;
    Ok((status, body.to_string()))
}

/// Percent-encodes a query parameter value.
fn encode(v: &str) -> String {
    v.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

// === the dashboard's expressions ===

/// One query of a dashboard panel.
struct PanelQuery {
    panel: String,
    ref_id: String,
    expr: String,
}

fn dashboard() -> Value {
    serde_json::from_str(&read(DASHBOARD)).unwrap_or_else(|e| panic!("{DASHBOARD}: {e}"))
}

/// Panels, including those nested in rows.
fn panels(d: &Value) -> Vec<&Value> {
    let mut out = Vec::new();
    for p in d["panels"].as_array().expect("`panels` is an array") {
        out.push(p);
        if let Some(nested) = p["panels"].as_array() {
            out.extend(nested);
        }
    }
    out
}

fn panel_queries(d: &Value) -> Vec<PanelQuery> {
    panels(d)
        .into_iter()
        .flat_map(|p| {
            let title = p["title"].as_str().unwrap_or("(untitled)").to_string();
            p["targets"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(move |t| {
                    Some(PanelQuery {
                        panel: title.clone(),
                        ref_id: t["refId"].as_str().unwrap_or("?").to_string(),
                        expr: t["expr"].as_str()?.to_string(),
                    })
                })
        })
        .collect()
}

/// `expr` with Grafana's variables replaced by concrete values, as Grafana would send it.
fn concrete(expr: &str, node: &str, walk: &str) -> String {
    let mut e = expr.to_string();
    for (var, value) in [
        ("__rate_interval", RATE_INTERVAL),
        ("__range", RANGE),
        ("__interval", "15s"),
        ("node", node),
        ("walk", walk),
        ("model", ".*"),
    ] {
        e = e
            .replace(&format!("${{{var}}}"), value)
            .replace(&format!("${var}"), value);
    }
    assert!(!e.contains('$'), "a variable left in `{e}`");
    e
}

/// Every `mstar_chunking_*` name in `text`, with the histogram series suffixes stripped.
fn metric_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = text;
    while let Some(i) = rest.find("mstar_chunking_") {
        let tail = &rest[i..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
            .unwrap_or(tail.len());
        let name = &tail[..end];
        let base = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| name.strip_suffix(s))
            .filter(|b| metrics::ALL.contains(b))
            .unwrap_or(name);
        names.insert(base.to_string());
        rest = &tail[end..];
    }
    names
}

/// A rules file with one recording rule per dashboard expression.
fn dashboard_rules(queries: &[PanelQuery], node: &str, walk: &str) -> String {
    let mut y = String::from("groups:\n  - name: mstar-chunking-dashboard\n    rules:\n");
    for (i, q) in queries.iter().enumerate() {
        // A JSON string is a YAML double-quoted scalar.
        let expr = serde_json::to_string(&concrete(&q.expr, node, walk)).unwrap();
        y.push_str(&format!(
            "      - record: dashboard:query_{i}:{}\n        expr: {expr}\n",
            q.ref_id.to_lowercase()
        ));
    }
    y
}

// === processes ===

/// A running `mstar-chunking replay --hold` with its metrics endpoint.
struct Replay {
    process: KillOnDrop,
    metrics: SocketAddr,
    _dir: TempDir,
}

impl Replay {
    /// Replays the first `requests` of the bundled trace, serving metrics on `metrics`.
    fn start(config: &str, requests: u32, metrics: SocketAddr) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let config_path = dir.path().join("overruns.toml");
        std::fs::write(&config_path, config).expect("write the replay config");
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_mstar-chunking"));
        cmd.args(["replay", "--model", MODEL, "--hold", "--requests"])
            .arg(requests.to_string())
            .arg("--metrics-listen")
            .arg(metrics.to_string())
            .arg("--config")
            .arg(&config_path)
            // Nothing from the developer's shell (`MSTAR_ENV`, `MSTAR__…`) changes the run.
            .env_clear()
            .current_dir(REPO);
        let process = KillOnDrop::spawn("replay", cmd, dir.path().join("replay.log"));
        Self {
            process,
            metrics,
            _dir: dir,
        }
    }

    /// A scrape of `/metrics` once every metric has a sample.
    fn scrape_when_complete(&mut self) -> String {
        let addr = self.metrics;
        let process = &mut self.process;
        poll(
            "the replay's /metrics to show every metric",
            Duration::from_secs(120),
            || {
                process.assert_running();
                let (status, body) = http_get(addr, "/metrics").ok()?;
                let seen = metric_names(&body);
                (status == 200 && metrics::ALL.iter().all(|m| seen.contains(*m))).then_some(body)
            },
        )
    }
}

/// A Prometheus server scraping `target` every second, with its storage in a temp dir.
struct Prometheus {
    process: KillOnDrop,
    addr: SocketAddr,
    _dir: TempDir,
}

impl Prometheus {
    fn start(target: SocketAddr) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let config = dir.path().join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n\
                 scrape_configs:\n  - job_name: mstar-chunking\n    static_configs:\n      \
                 - targets: ['{target}']\n"
            ),
        )
        .expect("write prometheus.yml");
        let addr = free_addr();
        let mut cmd = Command::new(tool("prometheus"));
        cmd.arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address={addr}"))
            .current_dir(dir.path());
        let process = KillOnDrop::spawn("prometheus", cmd, dir.path().join("prometheus.log"));
        Self {
            process,
            addr,
            _dir: dir,
        }
    }

    /// The result of an instant query, or Prometheus's error.
    fn query(&self, promql: &str) -> Result<Vec<Value>, String> {
        query(self.addr, promql)
    }

    /// Waits until `promql` has a result.
    fn wait_for(&mut self, promql: &str, bound: Duration) -> Vec<Value> {
        let addr = self.addr;
        let process = &mut self.process;
        poll(&format!("Prometheus to answer `{promql}`"), bound, || {
            process.assert_running();
            query(addr, promql).ok().filter(|r| !r.is_empty())
        })
    }
}

/// The result of an instant query to the Prometheus at `addr`, or its error.
fn query(addr: SocketAddr, promql: &str) -> Result<Vec<Value>, String> {
    let (status, body) = http_get(addr, &format!("/api/v1/query?query={}", encode(promql)))?;
    let v: Value = serde_json::from_str(&body)
        .map_err(|e| format!("HTTP {status}, not JSON ({e}): {body:.300}"))?;
    if v["status"] != "success" {
        return Err(format!("HTTP {status}: {} {}", v["errorType"], v["error"]));
    }
    Ok(v["data"]["result"].as_array().cloned().unwrap_or_default())
}

/// Whether an instant-vector result has a sample with a finite value (not NaN or ±Inf).
fn has_finite_sample(result: &[Value]) -> bool {
    result.iter().any(|s| {
        s["value"][1]
            .as_str()
            .and_then(|v| v.parse::<f64>().ok())
            .is_some_and(f64::is_finite)
    })
}

fn label<'a>(series: &'a Value, name: &str) -> &'a str {
    series["metric"][name].as_str().unwrap_or_default()
}

// === static checks ===

#[test]
fn dashboard_and_alerts_use_only_metrics_the_code_describes() {
    let dashboard = read(DASHBOARD);
    let alerts = read(ALERTS);
    let known: BTreeSet<String> = metrics::ALL.iter().map(|s| s.to_string()).collect();
    for (file, text) in [(DASHBOARD, &dashboard), (ALERTS, &alerts)] {
        let used = metric_names(text);
        assert!(!used.is_empty(), "{file} uses no metric");
        let unknown: Vec<_> = used.difference(&known).collect();
        assert!(
            unknown.is_empty(),
            "{file} uses unknown metrics {unknown:?}"
        );
    }
    let shown = metric_names(&dashboard);
    let missing: Vec<_> = known.difference(&shown).collect();
    assert!(
        missing.is_empty(),
        "the dashboard shows no panel for {missing:?}"
    );
}

#[test]
fn monitoring_md_lists_every_series_the_dashboard_and_alerts_use() {
    let doc = read("docs/monitoring.md");
    let mut used = metric_names(&read(DASHBOARD));
    used.extend(metric_names(&read(ALERTS)));
    used.extend(metrics::ALL.iter().map(|s| s.to_string()));
    let missing: Vec<&String> = used
        .iter()
        .filter(|name| {
            let short = name.trim_start_matches("mstar_chunking_");
            // Listed in backticks without the prefix, alone or with its label: `name{label}`.
            !doc.contains(&format!("`{short}`")) && !doc.contains(&format!("`{short}{{"))
        })
        .collect();
    assert!(
        missing.is_empty(),
        "docs/monitoring.md does not list {missing:?}"
    );
}

#[test]
fn dashboard_follows_the_dashboards_as_code_rules() {
    let d = dashboard();
    assert_eq!(
        d["uid"], "mstar-chunking",
        "the uid is stable: links depend on it"
    );
    let vars = d["templating"]["list"]
        .as_array()
        .expect("template variables");
    let var = |name: &str| {
        vars.iter()
            .find(|v| v["name"] == name)
            .unwrap_or_else(|| panic!("no `{name}` variable"))
    };
    assert_eq!(var("datasource")["type"], "datasource");
    assert_eq!(var("datasource")["query"], "prometheus");
    for name in ["node", "walk"] {
        let v = var(name);
        assert_eq!(v["type"], "query", "`{name}`");
        assert_eq!(v["datasource"]["uid"], "${datasource}", "`{name}`");
        let q = v["query"]["query"].as_str().unwrap_or_default();
        assert!(
            q.starts_with("label_values(") && q.ends_with(&format!(", {name})")),
            "`{name}` is not a label_values query: {q}"
        );
    }
    for p in panels(&d) {
        let title = p["title"].as_str().unwrap_or_default();
        if p["type"] == "row" {
            continue;
        }
        assert_eq!(p["datasource"]["uid"], "${datasource}", "panel {title}");
        assert!(
            p["fieldConfig"]["defaults"]["unit"].is_string(),
            "panel {title}: no unit set"
        );
        assert!(
            p["description"].is_string(),
            "panel {title}: no description"
        );
        for t in p["targets"].as_array().expect("targets") {
            assert_eq!(t["datasource"]["uid"], "${datasource}", "panel {title}");
        }
    }
    let queries = panel_queries(&d);
    assert!(queries.len() >= 11, "{} queries", queries.len());
    for q in &queries {
        // Windows come from Grafana, so they follow the scrape interval and the time picker.
        let windows = q.expr.matches('[').count();
        let grafana_windows =
            q.expr.matches("[$__rate_interval]").count() + q.expr.matches("[$__range]").count();
        assert_eq!(
            windows, grafana_windows,
            "{} {}: {}",
            q.panel, q.ref_id, q.expr
        );
        if q.expr.contains("{node=~") {
            assert!(
                q.expr.contains("node=~\"$node\""),
                "{}: {}",
                q.panel,
                q.expr
            );
        }
    }
    for title in KEY_PANELS {
        assert!(
            queries.iter().any(|q| q.panel == title),
            "no panel titled {title}"
        );
    }
}

// === promtool ===

#[test]
fn promtool_accepts_the_alert_rules_and_their_unit_tests_pass() {
    let promtool = tool("promtool");
    let out = run(Command::new(&promtool)
        .args(["check", "rules"])
        .arg(repo_path(ALERTS)));
    assert!(
        out.status.success(),
        "promtool check rules {ALERTS}:\n{}",
        text(&out)
    );
    let out = run(Command::new(&promtool)
        .args(["test", "rules"])
        .arg(repo_path(ALERTS_TEST)));
    assert!(
        out.status.success(),
        "promtool test rules {ALERTS_TEST}:\n{}",
        text(&out)
    );
}

#[test]
fn promtool_accepts_every_dashboard_expression_as_a_rule() {
    let queries = panel_queries(&dashboard());
    let dir = tempfile::tempdir().expect("temp dir");
    let rules = dir.path().join("dashboard-rules.yml");
    std::fs::write(&rules, dashboard_rules(&queries, "llm", "mixed")).expect("write rules");
    let out = run(Command::new(tool("promtool"))
        .args(["check", "rules"])
        .arg(&rules));
    assert!(
        out.status.success(),
        "promtool check rules:\n{}",
        text(&out)
    );
    let found = format!("SUCCESS: {} rules found", queries.len());
    assert!(
        text(&out).contains(&found),
        "expected {found}:\n{}",
        text(&out)
    );

    // The check can fail: a broken expression is refused.
    let mut broken = queries;
    broken[0].expr = "sum by (node (rate(mstar_chunking_steps_total[1m]))".into();
    std::fs::write(&rules, dashboard_rules(&broken, "llm", "mixed")).expect("write rules");
    let out = run(Command::new(tool("promtool"))
        .args(["check", "rules"])
        .arg(&rules));
    assert!(
        !out.status.success(),
        "a broken expression passed:\n{}",
        text(&out)
    );
}

// === the live replay ===

#[test]
fn a_live_replay_passes_promtool_and_prometheus_answers_every_dashboard_query() {
    let promtool = tool("promtool");
    tool("prometheus");
    let mut replay = Replay::start(OVERRUN_CONFIG, 300, free_addr());

    // (a) The exposition format of a live scrape.
    let scrape = replay.scrape_when_complete();
    let mut check = Command::new(&promtool)
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start promtool check metrics");
    check
        .stdin
        .take()
        .expect("stdin")
        .write_all(scrape.as_bytes())
        .expect("pipe the scrape to promtool");
    let out = check.wait_with_output().expect("promtool check metrics");
    assert!(
        out.status.success() && out.stdout.is_empty() && out.stderr.is_empty(),
        "promtool check metrics found problems in the scrape:\n{}\n--- scrape\n{scrape}",
        text(&out)
    );
    for m in [
        metrics::STEP_TOKENS,
        metrics::OVERRUN_TOKENS,
        metrics::STEP_ASSEMBLY_SECONDS,
    ] {
        assert!(scrape.contains(&format!("# TYPE {m} histogram")), "{m}");
    }

    // (c) A real Prometheus scraping the replay every second.
    let mut prom = Prometheus::start(replay.metrics);
    prom.wait_for(
        &format!("count_over_time({}[1m]) >= 2", metrics::STEPS_TOTAL),
        Duration::from_secs(60),
    );
    // The replay runs in well under a scrape interval, so every counter is flat and every rate
    // 0. Restart the worker with a shorter replay, as a deploy would: the counters reset, and
    // Prometheus counts the reset as an increase, so rates and quantiles have real values.
    let addr = replay.metrics;
    drop(replay);
    let mut replay = Replay::start(OVERRUN_CONFIG, 150, addr);
    replay.scrape_when_complete();
    prom.wait_for(
        &format!("resets({}[1m]) > 0", metrics::STEPS_TOTAL),
        Duration::from_secs(30),
    );
    let overrun_pairs = prom.wait_for(
        &format!(
            "sum by (node, walk) (rate({}[{RATE_INTERVAL}])) > 0",
            metrics::BUDGET_OVERRUNS_TOTAL
        ),
        Duration::from_secs(10),
    );
    let (node, walk) = (
        label(&overrun_pairs[0], "node"),
        label(&overrun_pairs[0], "walk"),
    );

    let queries = panel_queries(&dashboard());
    // With "All" selected (the variables' allValue) every query must give a number.
    let mut failures = Vec::new();
    let mut answered = 0;
    for q in &queries {
        let expr = concrete(&q.expr, ".*", ".*");
        match prom.query(&expr) {
            Ok(r) if has_finite_sample(&r) => answered += 1,
            Ok(r) => failures.push(format!(
                "{} {}: no finite value for `{expr}`: {r:?}",
                q.panel, q.ref_id
            )),
            Err(e) => failures.push(format!("{} {}: `{expr}` refused: {e}", q.panel, q.ref_id)),
        }
    }
    // With the node and walk that overran, the key panels show it: steps ran tokens, overruns
    // happened, and the prepared-input gauge is there (0 after the replay released them all).
    let mut key_answered = 0;
    for (title, positive) in [
        (KEY_PANELS[0], true),
        (KEY_PANELS[1], true),
        (KEY_PANELS[2], false),
    ] {
        let values: Vec<f64> = queries
            .iter()
            .filter(|q| q.panel == title)
            .flat_map(|q| {
                prom.query(&concrete(&q.expr, node, walk))
                    .unwrap_or_else(|e| panic!("{title} {}: {e}", q.ref_id))
            })
            .filter_map(|s| s["value"][1].as_str()?.parse::<f64>().ok())
            .filter(|v| v.is_finite())
            .collect();
        if values.is_empty() || (positive && !values.iter().any(|v| *v > 0.0)) {
            failures.push(format!("key panel {title} for {node}/{walk}: {values:?}"));
        } else {
            key_answered += 1;
        }
    }
    eprintln!(
        "{answered} of {} dashboard queries returned a finite value; {key_answered} of {} key \
         panels showed data for {node}/{walk}",
        queries.len(),
        KEY_PANELS.len()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    replay.process.assert_running();
    prom.process.assert_running();
}

// === the dashboard against Grafana's types ===

/// Runs the checker on `files`; its exit status and output.
fn typecheck(files: &[&Path]) -> (bool, String) {
    let node = tool("node");
    let out = run(Command::new(node)
        .arg(repo_path(TYPECHECK))
        .args(files)
        .current_dir(REPO));
    if out.status.code() == Some(2) {
        panic!("the dashboard type-check is not set up:\n{}", text(&out));
    }
    (out.status.success(), text(&out))
}

#[test]
fn the_dashboard_type_checks_as_a_grafana_dashboard_and_mistakes_do_not() {
    let (ok, out) = typecheck(&[&repo_path(DASHBOARD)]);
    assert!(ok, "{DASHBOARD} is not a valid Grafana Dashboard:\n{out}");

    let dir = tempfile::tempdir().expect("temp dir");
    let original = read(DASHBOARD);
    let mut typo: Value = serde_json::from_str(&original).unwrap();
    let panels = typo
        .as_object_mut()
        .unwrap()
        .remove("panels")
        .expect("panels");
    typo["pannels"] = panels;
    let mut string_h: Value = serde_json::from_str(&original).unwrap();
    string_h["panels"][0]["gridPos"]["h"] = Value::from("8");
    for (name, mutated, expect) in [
        (
            "pannels.json",
            typo,
            "'\"pannels\"' does not exist in type 'Dashboard'",
        ),
        (
            "string-h.json",
            string_h,
            "Type 'string' is not assignable to type 'number'",
        ),
    ] {
        let path = dir.path().join(name);
        std::fs::write(&path, serde_json::to_string_pretty(&mutated).unwrap()).unwrap();
        let (ok, out) = typecheck(&[&path]);
        assert!(!ok, "{name} passed the type-check:\n{out}");
        assert!(
            out.contains(expect),
            "{name}: expected `{expect}` in:\n{out}"
        );
    }
}

#[test]
fn a_metrics_address_in_use_is_a_clear_startup_error() {
    let taken = TcpListener::bind("127.0.0.1:0").expect("a local port");
    let addr = taken.local_addr().unwrap();
    let dir = tempfile::tempdir().expect("temp dir");
    let log = dir.path().join("replay.log");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_mstar-chunking"));
    cmd.args(["replay", "--model", MODEL, "--requests", "10", "--hold"])
        .arg("--metrics-listen")
        .arg(addr.to_string())
        .env_clear()
        .current_dir(REPO);
    let mut replay = KillOnDrop::spawn("replay", cmd, log.clone());
    // With `--hold` it would serve forever; it must stop at startup instead.
    let status = poll(
        "the replay to refuse the address in use",
        Duration::from_secs(30),
        || replay.child.try_wait().ok().flatten(),
    );
    let out = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        !status.success(),
        "exit {status} with {addr} in use:\n{out}"
    );
    let want = format!("cannot listen for metrics on `{addr}`");
    assert!(out.contains(&want), "expected `{want}` in:\n{out}");
}
