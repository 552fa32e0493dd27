//! Tests of `jobs.rs`: the job directory, a cell's result and the merge.

use super::*;
use crate::sweep::run_sweep;
use crate::sweep::tests::{fake, options};

fn inputs() -> Inputs {
    Inputs {
        config_dir: "inputs/config".into(),
        mstar_env: None,
        configs: Vec::new(),
        model: "inputs/model.toml".into(),
        env: BTreeMap::new(),
        trace: None,
        trace_flags: TraceFlags {
            requests: Some(100),
            ..TraceFlags::default()
        },
        setting_flags: SettingFlags::default(),
    }
}

/// The manifest of `options(slo)`'s grid.
fn manifest(slo: Option<Slo>) -> Manifest {
    let o = options(slo);
    let mut cells = Vec::new();
    for b in &o.budgets {
        for r in &o.rates {
            cells.push(JobCell {
                index: cells.len(),
                budget: b.to_string(),
                rate_scale: *r,
                wave: 0,
            });
        }
    }
    Manifest::new(Body {
        inputs: inputs(),
        settings: o.settings.clone(),
        budgets: o.budgets.iter().map(ToString::to_string).collect(),
        rates: o.rates.clone(),
        slo_tbt_p99_ms: slo.and_then(|s| s.tbt_p99_ms),
        slo_ttft_p90_ms: slo.and_then(|s| s.ttft_p90_ms),
        step_time_rate: 1.0,
        trace_rps: o.trace_rps,
        cells,
    })
}

/// Runs every cell of `m` not yet run with the fake replay, through the result files'
/// JSON, as `sweep-cell` does.
fn run_cells(m: &Manifest, results: &mut BTreeMap<usize, (Option<bool>, RunSummary)>) {
    for c in &m.body.cells {
        if results.contains_key(&c.index) {
            continue;
        }
        let b: Budget = c.budget.parse().unwrap();
        let s = fake(b, c.rate_scale).unwrap();
        let meets = m.slo().map(|slo| slo.meets(&s));
        let json = result_json(c, meets, &s);
        let text = serde_json::to_string(&json).unwrap();
        let back: serde_json::Value = serde_json::from_str(&text).unwrap();
        results.insert(c.index, parse_result(&back, c).unwrap());
    }
}

#[test]
fn waves_of_probes_end_in_the_local_sweep_exactly() {
    let slo = Slo::new(Some(60.0), Some(5000.0)).unwrap();
    let local = run_sweep(&options(Some(slo)), fake).unwrap();
    let mut m = manifest(Some(slo));
    let mut results = BTreeMap::new();
    let mut waves = 0;
    let merged = loop {
        run_cells(&m, &mut results);
        match merge(&mut m, &results).unwrap() {
            Merged::Done(s) => break s,
            Merged::NextWave(r) => {
                waves += 1;
                // One probe per budget whose search goes on, at most.
                assert!(r.len() <= 3, "{r:?}");
                assert!(waves < 40);
            }
        }
    };
    assert!(waves > 2, "the searches bisect: {waves}");
    assert_eq!(*merged, local);
    let csv = |s: &Sweep| crate::sweep::output::to_csv(s).unwrap();
    assert_eq!(csv(&merged), csv(&local));
    // Every manifest written on the way still reads back.
    let dir = tempfile::tempdir().unwrap();
    m.write(dir.path()).unwrap();
    assert_eq!(Manifest::read(dir.path()).unwrap(), m);
}

#[test]
fn without_an_objective_one_wave_is_the_whole_sweep() {
    let local = run_sweep(&options(None), fake).unwrap();
    let mut m = manifest(None);
    let mut results = BTreeMap::new();
    run_cells(&m, &mut results);
    let Merged::Done(merged) = merge(&mut m, &results).unwrap() else {
        panic!("no capacity search without an objective");
    };
    assert_eq!(*merged, local);
}

#[test]
fn an_edited_or_foreign_manifest_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let m = manifest(None);
    m.write(dir.path()).unwrap();
    assert!(Manifest::read(dir.path()).is_ok());
    let path = dir.path().join(MANIFEST);
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::write(
        &path,
        text.replace("\"rate_scale\": 2.0", "\"rate_scale\": 3.0"),
    )
    .unwrap();
    let e = Manifest::read(dir.path()).unwrap_err().to_string();
    assert!(e.contains("was changed after it was written"), "{e}");
    let mut old = m.clone();
    old.version = "0.0.1".into();
    std::fs::write(&path, serde_json::to_vec(&old).unwrap()).unwrap();
    let e = Manifest::read(dir.path()).unwrap_err().to_string();
    assert!(e.contains("written by mstar-chunking 0.0.1"), "{e}");
    std::fs::write(&path, "{}").unwrap();
    let e = Manifest::read(dir.path()).unwrap_err().to_string();
    assert!(e.contains("is not a job manifest"), "{e}");
    let e = Manifest::read(&dir.path().join("nowhere"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("is `") && e.contains("a job directory"), "{e}");
    assert!(m.cell(9, dir.path()).is_err());
    assert_eq!(m.cell(8, dir.path()).unwrap().index, 8);
}

#[test]
fn a_result_reads_back_exactly_and_only_for_its_cell() {
    let m = manifest(None);
    let c = &m.body.cells[4];
    let mut s = fake(Budget::Off, 1.0).unwrap();
    s.tbt_p99_ms = Some(0.1 + 0.2);
    let v = result_json(c, Some(true), &s);
    assert_eq!(parse_result(&v, c).unwrap(), (Some(true), s));
    let e = parse_result(&v, &m.body.cells[5]).unwrap_err();
    assert!(e.contains("is not the result of cell 5"), "{e}");
}

#[test]
fn a_merge_names_the_cells_without_results() {
    let e = JobError::Missing {
        missing: vec![3, 7],
        total: 9,
        writing: 1,
    };
    assert_eq!(
        e.to_string(),
        "2 of 9 cells have no result yet: 3, 7 (1 still being written: cells are running; merge once they are done)"
    );
}
