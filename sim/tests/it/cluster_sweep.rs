//! A sweep as a job directory (`docs/cluster-sweeps.md`): emitted, its cells run one by one in
//! any order (by argument, `JOB_COMPLETION_INDEX` or `SLURM_ARRAY_TASK_ID`, and through the
//! Slurm script), merged in waves, it writes the local sweep's outputs byte for byte; and every
//! way a job directory goes wrong is refused naming what and where.

use std::path::Path;
use std::process::Command;

use crate::helpers::{repo_root, run, Run};

/// The grid both sweeps run: two budgets, three rates and an objective, so the capacity
/// searches take several waves.
const GRID: [&str; 10] = [
    "--requests",
    "120",
    "--budgets",
    "1024,off",
    "--rates",
    "0.5,1,2",
    "--slo-tbt-p99",
    "60",
    "--slo-ttft-p90",
    "3000",
];

fn emit(dir: &Path) -> Run {
    let mut args = vec!["sweep", "--emit-jobs", dir.to_str().unwrap()];
    args.extend(GRID);
    run(&args, &[])
}

fn cells(dir: &Path) -> usize {
    let m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("jobs.json")).unwrap()).unwrap();
    m["body"]["cells"].as_array().unwrap().len()
}

fn merge(dir: &Path, out: &Path) -> Run {
    run(
        &[
            "sweep",
            "--merge",
            dir.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ],
        &[],
    )
}

/// Runs cell `i` of `dir` the way its position picks: by argument, as a Kubernetes Indexed
/// Job's pod, as a Slurm array task through the shipped script.
fn run_cell(dir: &Path, i: usize) -> Run {
    let d = dir.to_str().unwrap();
    let index = i.to_string();
    match i % 3 {
        0 => run(&["sweep-cell", d, &index], &[]),
        1 => run(&["sweep-cell", d], &[("JOB_COMPLETION_INDEX", &index)]),
        _ => {
            let out = Command::new("bash")
                .arg(repo_root().join("deploy/slurm/sweep-cell.sh"))
                .arg(d)
                .env_clear()
                .env("PATH", std::env::var("PATH").unwrap_or_default())
                .env("SLURM_ARRAY_TASK_ID", &index)
                .env("MSTAR_CHUNKING", env!("CARGO_BIN_EXE_mstar-chunking"))
                .current_dir(repo_root())
                .output()
                .unwrap();
            Run {
                code: out.status.code().unwrap_or(-1),
                stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
                stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
            }
        }
    }
}

#[test]
fn a_merged_sweep_is_the_local_sweep_byte_for_byte() {
    let tmp = tempfile::tempdir().unwrap();
    let (jobs, merged, local) = (
        tmp.path().join("jobs"),
        tmp.path().join("merged"),
        tmp.path().join("local"),
    );
    let r = emit(&jobs);
    assert_eq!(r.code, 0, "{r:?}");
    assert!(r.stdout.contains("wrote 6 cells (0 to 5)"), "{}", r.stdout);
    assert!(r.stdout.contains("sweep --merge"), "{}", r.stdout);
    let mut waves = 0;
    loop {
        // Cells in reverse order: the order they run in changes nothing.
        for i in (0..cells(&jobs)).rev() {
            let r = run_cell(&jobs, i);
            assert_eq!(r.code, 0, "cell {i}: {r:?}");
        }
        let r = merge(&jobs, &merged);
        match r.code {
            0 => break,
            3 => {
                assert!(r.stderr.contains("more cells (wave"), "{}", r.stderr);
                waves += 1;
                assert!(waves < 30, "{r:?}");
            }
            _ => panic!("{r:?}"),
        }
    }
    assert!(waves >= 2, "the capacity searches took {waves} waves");
    let mut args = vec!["sweep", "--no-progress", "--out", local.to_str().unwrap()];
    args.extend(GRID);
    let r = run(&args, &[]);
    assert_eq!(r.code, 0, "{r:?}");
    for f in [
        "sweep.csv",
        "sweep.json",
        "report.html",
        "tradeoff.svg",
        "capacity.svg",
        "step_times.svg",
        "capacity.png",
    ] {
        let (a, b) = (
            std::fs::read(local.join(f)).unwrap(),
            std::fs::read(merged.join(f)).unwrap(),
        );
        assert!(a == b, "{f} differs between the local and the merged sweep");
    }
    // A cell run again after its success changes nothing.
    let result = jobs.join("results/cell-000004.json");
    let before = std::fs::read(&result).unwrap();
    let r = run(&["sweep-cell", jobs.to_str().unwrap(), "4"], &[]);
    assert_eq!(r.code, 0, "{r:?}");
    assert!(r.stderr.contains("already done"), "{}", r.stderr);
    assert_eq!(std::fs::read(&result).unwrap(), before);
}

#[test]
fn a_bad_job_directory_or_index_is_refused_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    let jobs = tmp.path().join("jobs");
    assert_eq!(emit(&jobs).code, 0);
    let d = jobs.to_str().unwrap();
    // Emitting into a job directory again.
    let r = emit(&jobs);
    assert_eq!(r.code, 2, "{r:?}");
    assert!(
        r.stderr.contains("is a job directory already"),
        "{}",
        r.stderr
    );
    // No index anywhere; an index from the environment that is not one; one beyond the cells.
    let r = run(&["sweep-cell", d], &[]);
    assert_eq!(r.code, 2, "{r:?}");
    assert!(r.stderr.contains("JOB_COMPLETION_INDEX"), "{}", r.stderr);
    let r = run(&["sweep-cell", d], &[("SLURM_ARRAY_TASK_ID", "seven")]);
    assert_eq!(r.code, 2, "{r:?}");
    assert!(
        r.stderr.contains("`SLURM_ARRAY_TASK_ID` is \"seven\""),
        "{}",
        r.stderr
    );
    let r = run(&["sweep-cell", d, "6"], &[]);
    assert_eq!(r.code, 2, "{r:?}");
    assert!(r.stderr.contains("cell 6 is not in"), "{}", r.stderr);
    assert!(r.stderr.contains("0 to 5"), "{}", r.stderr);
    // Not a job directory.
    let r = run(&["sweep-cell", tmp.path().to_str().unwrap(), "0"], &[]);
    assert_eq!(r.code, 2, "{r:?}");
    assert!(r.stderr.contains("jobs.json"), "{}", r.stderr);
    // A merge while cells still run: the ones without results are named, and those being
    // written said to be running.
    assert_eq!(run(&["sweep-cell", d, "0"], &[]).code, 0);
    std::fs::write(jobs.join("results/.cell-000003.json.999.tmp"), "{").unwrap();
    let out = tmp.path().join("out");
    let r = merge(&jobs, &out);
    assert_eq!(r.code, 1, "{r:?}");
    assert!(
        r.stderr
            .contains("5 of 6 cells have no result yet: 1, 2, 3, 4, 5"),
        "{}",
        r.stderr
    );
    assert!(r.stderr.contains("1 still being written"), "{}", r.stderr);
    assert!(!out.exists(), "a refused merge wrote {out:?}");
    // A result edited into another cell's.
    let first = std::fs::read_to_string(jobs.join("results/cell-000000.json")).unwrap();
    std::fs::write(jobs.join("results/cell-000001.json"), &first).unwrap();
    for i in 2..6 {
        assert_eq!(run(&["sweep-cell", d, &i.to_string()], &[]).code, 0);
    }
    let r = merge(&jobs, &out);
    assert_eq!(r.code, 1, "{r:?}");
    assert!(r.stderr.contains("cell-000001.json"), "{}", r.stderr);
    assert!(
        r.stderr.contains("is not the result of cell 1"),
        "{}",
        r.stderr
    );
    // A manifest edited by hand, then one of another version.
    let manifest = jobs.join("jobs.json");
    let text = std::fs::read_to_string(&manifest).unwrap();
    std::fs::write(
        &manifest,
        text.replace("\"rate_scale\": 2.0", "\"rate_scale\": 4.0"),
    )
    .unwrap();
    for r in [run(&["sweep-cell", d, "0"], &[]), merge(&jobs, &out)] {
        assert_eq!(r.code, 2, "{r:?}");
        assert!(
            r.stderr.contains("was changed after it was written"),
            "{}",
            r.stderr
        );
    }
    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["version"] = "0.0.1".into();
    std::fs::write(&manifest, serde_json::to_vec(&v).unwrap()).unwrap();
    let r = run(&["sweep-cell", d, "0"], &[]);
    assert_eq!(r.code, 2, "{r:?}");
    assert!(
        r.stderr.contains("was written by mstar-chunking 0.0.1"),
        "{}",
        r.stderr
    );
    // The axes cannot be emitted.
    let r = run(&["sweep", "--emit-jobs", "x", "--workers", "1,2"], &[]);
    assert_eq!(r.code, 2, "{r:?}");
}

/// A time budget among the settings (`--budgets 512,95ms`) goes through a job directory as a
/// token budget does: its cells run by index, and the merged outputs, the verdict among them,
/// are the local sweep's byte for byte.
#[test]
fn time_budget_cells_merge_into_the_local_sweep_and_its_verdict() {
    let tmp = tempfile::tempdir().unwrap();
    let (jobs, merged, local) = (
        tmp.path().join("jobs"),
        tmp.path().join("merged"),
        tmp.path().join("local"),
    );
    let grid = [
        "--config",
        "config/examples/llama2-7b-a100.toml",
        "--requests",
        "100",
        "--budgets",
        "512,95ms",
        "--rates",
        "0.5,1",
        "--slo-tbt-p99",
        "100",
        "--slo-ttft-p90",
        "2000",
    ];
    let mut args = vec!["sweep", "--emit-jobs", jobs.to_str().unwrap()];
    args.extend(grid);
    let r = run(&args, &[]);
    assert_eq!(r.code, 0, "{r:?}");
    let d = jobs.to_str().unwrap();
    let mut done = 0;
    for wave in 0.. {
        assert!(wave < 30, "no end to the waves");
        for i in done..cells(&jobs) {
            let r = run(&["sweep-cell", d, &i.to_string()], &[]);
            assert_eq!(r.code, 0, "cell {i}: {r:?}");
        }
        done = cells(&jobs);
        let r = merge(&jobs, &merged);
        match r.code {
            0 => break,
            3 => continue,
            _ => panic!("{r:?}"),
        }
    }
    let mut args = vec!["sweep", "--no-progress", "--out", local.to_str().unwrap()];
    args.extend(grid);
    let r = run(&args, &[]);
    assert_eq!(r.code, 0, "{r:?}");
    for f in [
        "sweep.csv",
        "sweep.json",
        "verdict.json",
        "verdict-settings.csv",
        "report.html",
    ] {
        let (a, b) = (
            std::fs::read(local.join(f)).unwrap(),
            std::fs::read(merged.join(f)).unwrap(),
        );
        assert!(a == b, "{f} differs between the local and the merged sweep");
    }
    let v: serde_json::Value =
        serde_json::from_slice(&std::fs::read(merged.join("verdict.json")).unwrap()).unwrap();
    assert_eq!(v["traces"][0]["best_time"]["setting"], "95 ms", "{v}");
}
