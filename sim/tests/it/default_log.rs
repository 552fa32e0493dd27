//! The default behaviour is pinned: a replay of the bundled trace's first 2,000 requests with
//! the default config and the demo model writes the step log of the build before order
//! policies existed, byte for byte (its SHA-256 below was taken from that build). An order, a
//! planner change or a simulation change that moves a single step under the defaults fails
//! here; a deliberate change records the new digest with the reason in its commit.

use sha2::{Digest, Sha256};

use crate::helpers::run;

/// SHA-256 of `replay --requests 2000 --step-log FILE` (68,480 steps for the whole trace were
/// compared with `cmp` against the same build too; 16,012 steps here).
const DEFAULT_LOG_SHA256: &str = "ca99bf4f212293d64c83608656f41b8f8360c6eae46fa0736544208d2366af3a";

#[test]
fn the_default_replays_step_log_is_unchanged_byte_for_byte() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("steps.jsonl");
    let r = run(
        &[
            "replay",
            "--requests",
            "2000",
            "--no-progress",
            "--step-log",
            log.to_str().unwrap(),
        ],
        &[],
    );
    assert_eq!(r.code, 0, "{r:?}");
    let bytes = std::fs::read(&log).unwrap();
    let digest: String = Sha256::digest(&bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(
        digest,
        DEFAULT_LOG_SHA256,
        "the default step log changed ({} lines)",
        bytes.iter().filter(|&&b| b == b'\n').count()
    );
}
