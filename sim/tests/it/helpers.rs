//! Running the `mstar-chunking` binary the way a user does, in a clean environment; the shared
//! traces and the step-log checker.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The repository's root, where `config/`, `data/` and `docs/` live (this crate is `sim/`).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("sim/ is inside the repository")
        .to_path_buf()
}

/// A file under `tests/fixtures/config/`.
pub fn fixture(rel: &str) -> PathBuf {
    repo_root().join("tests/fixtures/config").join(rel)
}

/// The model manifest `tests/fixtures/config/models/{name}.toml`.
pub fn model_fixture(name: &str) -> mstar_chunking::manifest::Manifest {
    let path = fixture(&format!("models/{name}.toml"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    toml::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// What one run of the binary did.
#[derive(Debug)]
pub struct Run {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

/// Runs the binary in `cwd` with exactly the environment `env` (nothing inherited, so an
/// `MSTAR__…` variable of the developer's shell cannot change a result).
pub fn run_in(cwd: &Path, args: &[&str], env: &[(&str, &str)]) -> Run {
    let out = Command::new(env!("CARGO_BIN_EXE_mstar-chunking"))
        .args(args)
        .current_dir(cwd)
        .env_clear()
        .envs(env.iter().copied())
        .output()
        .expect("the mstar-chunking binary runs");
    Run {
        // A signal has no code; -1 fails every assertion on a code.
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// Runs the binary from the crate's root.
pub fn run(args: &[&str], env: &[(&str, &str)]) -> Run {
    run_in(&repo_root(), args, env)
}

/// `budgets --json` output, parsed.
pub fn budgets_json(args: &[&str], env: &[(&str, &str)]) -> serde_json::Value {
    let mut all = vec!["budgets", "--json"];
    all.extend_from_slice(args);
    let r = run(&all, env);
    assert_eq!(r.code, 0, "budgets failed: {r:?}");
    serde_json::from_str(&r.stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {}", r.stdout))
}

/// The row of `node`/`walk` in `budgets --json` output.
pub fn row<'a>(rows: &'a serde_json::Value, node: &str, walk: &str) -> &'a serde_json::Value {
    rows.as_array()
        .and_then(|a| a.iter().find(|r| r["node"] == node && r["walk"] == walk))
        .unwrap_or_else(|| panic!("no row {node}/{walk} in {rows}"))
}

/// The shared reference traces and tools: `$MSTAR_SHARED_DIR`, else `../shared` next to the
/// crate, else the copies in `tests/fixtures/shared` (the checker, and each trace's first 400
/// requests).
pub fn shared(rel: &str) -> PathBuf {
    let root = repo_root();
    let dir = std::env::var_os("MSTAR_SHARED_DIR")
        .map(PathBuf::from)
        .or_else(|| Some(root.join("../shared")).filter(|d| d.join(rel).exists()))
        .unwrap_or_else(|| root.join("tests/fixtures/shared"));
    let p = dir.join(rel);
    assert!(
        p.exists(),
        "{} is missing: set MSTAR_SHARED_DIR to the shared traces and tools",
        p.display()
    );
    p
}

/// Runs `check_step_log.py --complete --align N`; returns its last line, asserting success.
pub fn check_step_log(log: &Path, align: u32) -> String {
    let out = Command::new("python3")
        .arg(shared("tools/check_step_log.py"))
        .arg(log)
        .arg("--complete")
        .args(["--align", &align.to_string()])
        .output()
        .expect("python3 runs");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "check_step_log.py found violations in {}:\n{stdout}{}",
        log.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let last = stdout.lines().last().unwrap_or_default().to_owned();
    assert!(last.starts_with("0 violations"), "{last}");
    last
}

/// A safety net, not a timing assertion: kills process `pid` if it is still running after
/// `secs` seconds (a run that hangs, the failure the signal and endpoint tests guard against),
/// so that the suite reports it instead of hanging. Dropping the guard disarms it.
pub struct Watchdog(std::sync::mpsc::Sender<()>);

impl Watchdog {
    pub fn new(pid: u32, secs: u64) -> Self {
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        std::thread::spawn(move || {
            if rx
                .recv_timeout(std::time::Duration::from_secs(secs))
                .is_err()
            {
                let _ = Command::new("kill")
                    .args(["-KILL", &pid.to_string()])
                    .status();
            }
        });
        Self(tx)
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        let _ = self.0.send(());
    }
}

/// The rows of a CSV file (no quoted commas in it), the header first.
pub fn csv_rows(path: &Path) -> Vec<Vec<String>> {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .map(|l| l.split(',').map(str::to_owned).collect())
        .collect()
}

/// The small grid the fleet sweeps run: 200 requests, one budget, two rates, an objective.
pub const FLEET_SWEEP_GRID: [&str; 13] = [
    "--requests",
    "200",
    "--budgets",
    "2048",
    "--rates",
    "1,4",
    "--slo-tbt-p99",
    "60",
    "--slo-ttft-p90",
    "1500",
    "--no-progress",
    "--jobs",
    "2",
];
