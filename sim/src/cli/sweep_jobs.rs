//! A sweep on a cluster engine (`docs/cluster-sweeps.md`): `sweep --emit-jobs DIR` writes the
//! job directory (the inputs copied in, the manifest), `sweep-cell DIR [INDEX]` runs one cell
//! and writes its result atomically, `sweep --merge DIR --out OUT` writes the sweep's outputs
//! from the results, or the next wave of capacity probes. The manifest, the results and the
//! merge itself are `crate::sweep::jobs`'.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use super::*;
use crate::sweep::jobs::{
    self, Body, Inputs, JobCell, JobError, Manifest, Merged, SettingFlags, TraceFlags,
};

/// The exit code of a merge that added a wave of cells to run before the next merge.
pub const EXIT_MORE_CELLS: u8 = 3;

/// What the sweep being emitted was checked to run.
pub(super) struct Plan<'a> {
    pub load: &'a LoadOptions,
    pub loaded: &'a LoadedConfig,
    pub setup: &'a crate::replay::ReplaySetup,
    pub base: &'a crate::replay::ReplayOptions,
    pub trace: &'a crate::replay::Trace,
    pub budgets: &'a [crate::sweep::Budget],
    pub rates: &'a [f64],
    pub slo: Option<crate::sweep::Slo>,
}

fn io_error(path: &Path) -> impl Fn(std::io::Error) -> JobError + '_ {
    move |source| JobError::Io {
        path: path.to_owned(),
        source,
    }
}

/// Copies `from` to `dir/name`, answering the copy's path relative to the job directory.
fn copy_in(from: &Path, job: &Path, name: &str) -> Result<String, JobError> {
    let rel = format!("{}/{name}", jobs::INPUTS);
    let to = job.join(&rel);
    std::fs::copy(from, &to).map_err(io_error(from))?;
    Ok(rel)
}

/// Writes `text` as `dir/name`, answering its path relative to the job directory.
fn write_in(text: &str, job: &Path, name: &str) -> Result<String, JobError> {
    let rel = format!("{}/{name}", jobs::INPUTS);
    let to = job.join(&rel);
    std::fs::write(&to, text).map_err(io_error(&to))?;
    Ok(rel)
}

fn file_name(p: &Path) -> String {
    p.file_name()
        .map_or_else(|| "file".into(), |n| n.to_string_lossy().into_owned())
}

/// The `MSTAR__…` variables of this process, which the cells read as the emitting sweep did.
fn env_overrides() -> BTreeMap<String, String> {
    std::env::vars()
        .filter(|(k, _)| {
            k.get(..config::ENV_PREFIX.len())
                .is_some_and(|p| p.eq_ignore_ascii_case(config::ENV_PREFIX))
        })
        .collect()
}

/// Copies the sweep's inputs into `dir` and says how a cell reads them.
fn copy_inputs(args: &SweepArgs, dir: &Path, plan: &Plan<'_>) -> Result<Inputs, JobError> {
    let load = plan.load;
    let config_dir = dir.join(jobs::INPUTS).join("config");
    std::fs::create_dir_all(&config_dir).map_err(io_error(&config_dir))?;
    let default = load.config_dir.join("default.toml");
    if default.is_file() {
        copy_in(&default, dir, "config/default.toml")?;
    } else {
        write_in(config::DEFAULT_CONFIG_TOML, dir, "config/default.toml")?;
    }
    if let Some(env) = &load.mstar_env {
        let layer = load.config_dir.join(format!("{env}.toml"));
        copy_in(&layer, dir, &format!("config/{env}.toml"))?;
    }
    let mut configs = Vec::new();
    for (i, c) in load.configs.iter().enumerate() {
        configs.push(copy_in(c, dir, &format!("layer-{i}-{}", file_name(c)))?);
    }
    let model = match load.model_path() {
        Some(m) => copy_in(&m, dir, &format!("model-{}", file_name(&m)))?,
        None => write_in(config::DEMO_MANIFEST_TOML, dir, "model-demo.toml")?,
    };
    let trace = match &args.source.trace {
        Some(t) => Some(copy_in(t, dir, &format!("trace-{}", file_name(t)))?),
        None => None,
    };
    let s = &args.settings;
    Ok(Inputs {
        config_dir: format!("{}/config", jobs::INPUTS),
        mstar_env: load.mstar_env.clone(),
        configs,
        model,
        env: env_overrides(),
        trace,
        trace_flags: TraceFlags {
            format: args.source.format.map(|f| f.name().to_owned()),
            arrivals: args.source.arrivals.map(|a| a.to_string()),
            requests: args.source.requests,
            skip_bad_lines: args.source.skip_bad_lines,
            priority_by: args.source.priority_by.map(|p| p.to_string()),
        },
        setting_flags: SettingFlags {
            max_step_ms: s.max_step_ms.clone(),
            cost: s.cost.clone(),
            learn_cost: s.learn_cost,
            sim_cost: s.sim_cost.clone(),
            time_margin: s.time_margin.clone(),
        },
    })
}

/// `sweep --emit-jobs DIR`: the job directory of the checked sweep `plan`, and how to run it.
pub(super) fn emit(args: &SweepArgs, dir: &Path, plan: &Plan<'_>) -> ExitCode {
    let shown = config::problem::escape(&dir.display().to_string());
    if dir.join(jobs::MANIFEST).exists() {
        say(&format!(
            "error: `{shown}` is a job directory already: merge it, or remove it to emit again"
        ));
        return ExitCode::from(EXIT_CONFIG);
    }
    let opts = crate::sweep::SweepOptions {
        budgets: plan.budgets.to_vec(),
        rates: plan.rates.to_vec(),
        slo: plan.slo,
        jobs: 1,
        progress: false,
        step_time_rate: args.step_time_rate,
        trace_rps: crate::sweep::cells::trace_rps(plan.trace),
        settings: crate::sweep::cells::labels(
            plan.loaded,
            plan.setup,
            plan.base,
            plan.trace,
            plan.budgets,
        ),
        stop: None,
    };
    let step_time_rate = match opts.check() {
        Ok(r) => r,
        Err(e) => {
            say(&format!("error: {e}"));
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let written = (|| -> Result<Manifest, JobError> {
        let results = dir.join(jobs::RESULTS);
        std::fs::create_dir_all(&results).map_err(io_error(&results))?;
        let inputs = copy_inputs(args, dir, plan)?;
        let mut cells = Vec::new();
        for b in plan.budgets {
            for r in plan.rates {
                cells.push(JobCell {
                    index: cells.len(),
                    budget: b.to_string(),
                    rate_scale: *r,
                    wave: 0,
                });
            }
        }
        let m = Manifest::new(Body {
            inputs,
            settings: opts.settings.clone(),
            budgets: plan.budgets.iter().map(ToString::to_string).collect(),
            rates: plan.rates.to_vec(),
            slo_tbt_p99_ms: plan.slo.and_then(|s| s.tbt_p99_ms),
            slo_ttft_p90_ms: plan.slo.and_then(|s| s.ttft_p90_ms),
            step_time_rate,
            trace_rps: opts.trace_rps,
            cells,
        });
        m.write(dir)?;
        Ok(m)
    })();
    match written {
        Ok(m) => {
            let _ = print_stdout(&how_to_run(dir, 0..m.body.cells.len()));
            ExitCode::SUCCESS
        }
        Err(e) => {
            say(&format!("error: {e}"));
            ExitCode::FAILURE
        }
    }
}

/// How to run cells `range` of `dir`, then merge.
fn how_to_run(dir: &Path, range: std::ops::Range<usize>) -> String {
    let d = config::problem::escape(&dir.display().to_string());
    let (first, last) = (range.start, range.end.saturating_sub(1));
    format!(
        "wrote {n} cells ({first} to {last}) into {d}; run each once, anywhere this binary and {d} are:\n\
         \x20 one by one:   for i in $(seq {first} {last}); do mstar-chunking sweep-cell {d} \"$i\"; done\n\
         \x20 GNU parallel: seq {first} {last} | parallel mstar-chunking sweep-cell {d} {{}}\n\
         \x20 Slurm:        sbatch --array={first}-{last} deploy/slurm/sweep-cell.sh {d}\n\
         \x20 Kubernetes:   an Indexed Job of {n} completions running `mstar-chunking sweep-cell {d}` (the index from JOB_COMPLETION_INDEX{offset})\n\
         then: mstar-chunking sweep --merge {d} --out OUT\n",
        n = range.len(),
        offset = if first > 0 {
            format!(", plus {first}: pass the index explicitly")
        } else {
            String::new()
        }
    )
}

/// The cell index: the argument, else `$JOB_COMPLETION_INDEX`, else `$SLURM_ARRAY_TASK_ID`.
fn cell_index(args: &SweepCellArgs) -> Result<u64, String> {
    if let Some(i) = args.index {
        return Ok(i);
    }
    for var in ["JOB_COMPLETION_INDEX", "SLURM_ARRAY_TASK_ID"] {
        if let Ok(v) = std::env::var(var) {
            return v.trim().parse::<u64>().map_err(|_| {
                format!(
                    "`{var}` is {}, not a cell index",
                    config::problem::quote(&v)
                )
            });
        }
    }
    Err("give the cell's INDEX, or run it where JOB_COMPLETION_INDEX (a Kubernetes Indexed Job) or SLURM_ARRAY_TASK_ID (a Slurm job array) is set".into())
}

/// `sweep-cell DIR [INDEX]`: runs one cell and writes its result into the directory. A cell
/// whose result is there already is not run again. Exit codes: 0 done (or already done), 2 a
/// refused directory or index, 1 a failed replay or write.
pub fn sweep_cell(args: &SweepCellArgs) -> ExitCode {
    let index = match cell_index(args) {
        Ok(i) => i,
        Err(e) => {
            say(&format!("error: {e}"));
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let manifest = match Manifest::read(&args.dir) {
        Ok(m) => m,
        Err(e) => {
            say(&format!("error: {e}"));
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let cell = match manifest.cell(index, &args.dir) {
        Ok(c) => c.clone(),
        Err(e) => {
            say(&format!("error: {e}"));
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let out = jobs::result_path(&args.dir, cell.index);
    if out.exists() {
        say(&format!(
            "cell {} (budget {}, rate scale {}): already done ({})",
            cell.index,
            cell.budget,
            crate::text::fmt_rate(cell.rate_scale),
            out.display()
        ));
        return ExitCode::SUCCESS;
    }
    let wall = std::time::Instant::now();
    match run_job_cell(&args.dir, &manifest, &cell) {
        Ok(()) => {
            say(&format!(
                "cell {} (budget {}, rate scale {}): done in {:.1} s",
                cell.index,
                cell.budget,
                crate::text::fmt_rate(cell.rate_scale),
                wall.elapsed().as_secs_f64()
            ));
            ExitCode::SUCCESS
        }
        Err(CellFailure::Usage(e)) => {
            say(&format!("error: {e}"));
            ExitCode::from(EXIT_CONFIG)
        }
        Err(CellFailure::Failed(e)) => {
            say(&format!("error: {e}"));
            ExitCode::FAILURE
        }
    }
}

enum CellFailure {
    /// The directory's inputs were refused.
    Usage(String),
    /// The replay or the write failed.
    Failed(String),
}

/// Loads the job directory's inputs as the emitting sweep loaded its own, runs `cell` and
/// writes its result.
fn run_job_cell(dir: &Path, manifest: &Manifest, cell: &JobCell) -> Result<(), CellFailure> {
    let i = &manifest.body.inputs;
    let load = LoadOptions {
        model: Some(dir.join(&i.model)),
        configs: i.configs.iter().map(|c| dir.join(c)).collect(),
        config_dir: dir.join(&i.config_dir),
        mstar_env: i.mstar_env.clone(),
        env: Some(i.env.clone().into_iter().collect()),
    };
    let flags = i.setting_flags.clone();
    let settings = SettingArgs {
        max_step_ms: flags.max_step_ms,
        cost: flags.cost,
        learn_cost: flags.learn_cost,
        sim_cost: flags.sim_cost,
        time_margin: flags.time_margin,
    };
    let t = &i.trace_flags;
    let usage =
        |what: &str, e: String| CellFailure::Usage(format!("{what} of the job directory: {e}"));
    let (loaded, setup) = load_for_replay(&load, &settings.flags()).map_err(|errors| {
        CellFailure::Usage(format!(
            "the job directory's config was refused: {}",
            errors.lines().join("; ")
        ))
    })?;
    let base = crate::replay::ReplayOptions {
        trace: i.trace.as_ref().map(|t| dir.join(t)),
        requests: t.requests.map(|n| usize::try_from(n).unwrap_or(usize::MAX)),
        format: t
            .format
            .as_deref()
            .map(str::parse)
            .transpose()
            .map_err(|e: crate::replay::TraceError| usage("the trace format", e.to_string()))?,
        arrivals: t.arrivals.as_deref().map(str::parse).transpose().map_err(
            |e: crate::replay::arrivals::ArrivalsError| usage("the arrivals", e.to_string()),
        )?,
        skip_bad_lines: t.skip_bad_lines,
        priority_by: t
            .priority_by
            .as_deref()
            .map(str::parse)
            .transpose()
            .map_err(|e: String| usage("the priority rule", e))?,
        progress: false,
        ..Default::default()
    };
    let trace = crate::replay::load_trace(&base, setup.seed)
        .map_err(|e| CellFailure::Failed(e.to_string()))?;
    let budget = cell
        .budget
        .parse::<crate::sweep::Budget>()
        .map_err(|e| usage("a budget", e.to_string()))?;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicI32::new(0));
    let summary = crate::sweep::cells::run_cell(
        &loaded.manifest,
        &loaded.settings,
        &base,
        &trace,
        budget,
        cell.rate_scale,
        &stop,
    )
    .map_err(|e| {
        CellFailure::Failed(format!(
            "the replay of cell {} (budget {}, rate scale {}) failed: {e}",
            cell.index, cell.budget, cell.rate_scale
        ))
    })?;
    let meets = manifest.slo().map(|slo| slo.meets(&summary));
    let json = jobs::result_json(cell, meets, &summary);
    let mut bytes = serde_json::to_vec_pretty(&json).unwrap_or_default();
    bytes.push(b'\n');
    write_result(&jobs::result_path(dir, cell.index), &bytes)
        .map_err(|e| CellFailure::Failed(e.to_string()))
}

/// Writes a result atomically and once: to a temporary file, then linked to its name, which
/// fails if the name exists. Another run of the same cell that finished first is fine when it
/// wrote the same bytes (the replay is deterministic), and refused when not.
fn write_result(path: &Path, bytes: &[u8]) -> Result<(), JobError> {
    let tmp = path.with_file_name(format!(".{}.{}.tmp", file_name(path), std::process::id()));
    let result = (|| {
        std::fs::write(&tmp, bytes)
            .and_then(|()| std::fs::File::open(&tmp)?.sync_all())
            .map_err(io_error(&tmp))?;
        match std::fs::hard_link(&tmp, path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                let there = std::fs::read(path).map_err(io_error(path))?;
                if there == bytes {
                    Ok(())
                } else {
                    Err(JobError::Result {
                        path: path.to_owned(),
                        problem: "was written by another run of the same cell with different figures: two job directories share their results, or a result was edited".into(),
                    })
                }
            }
            Err(e) => Err(JobError::Io {
                path: path.to_owned(),
                source: e,
            }),
        }
    })();
    let _ = std::fs::remove_file(&tmp);
    result
}

/// Reads every result of `manifest`'s cells.
fn read_results(
    dir: &Path,
    manifest: &Manifest,
) -> Result<BTreeMap<usize, (Option<bool>, crate::sweep::RunSummary)>, JobError> {
    let mut results = BTreeMap::new();
    let mut missing = Vec::new();
    for c in &manifest.body.cells {
        let path = jobs::result_path(dir, c.index);
        if !path.exists() {
            missing.push(c.index);
            continue;
        }
        let text =
            mstar_chunking::input::read_text(&path, 1 << 20).map_err(|e| JobError::Result {
                path: path.clone(),
                problem: format!("cannot be read: {e}"),
            })?;
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| JobError::Result {
            path: path.clone(),
            problem: format!("is not a result: {e}"),
        })?;
        let r = jobs::parse_result(&v, c).map_err(|problem| JobError::Result {
            path: path.clone(),
            problem,
        })?;
        results.insert(c.index, r);
    }
    if !missing.is_empty() {
        let writing = std::fs::read_dir(dir.join(jobs::RESULTS))
            .map(|d| {
                d.filter_map(Result::ok)
                    .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
                    .count()
            })
            .unwrap_or(0);
        return Err(JobError::Missing {
            missing,
            total: manifest.body.cells.len(),
            writing,
        });
    }
    Ok(results)
}

/// `sweep --merge DIR --out OUT`: the outputs of the sweep whose cells ran, or the next wave
/// of capacity probes (exit [`EXIT_MORE_CELLS`]). Exit codes: 0 written, 2 a refused
/// directory or output, 1 cells without results or a failed write.
pub(super) fn merge(args: &SweepArgs, dir: &Path) -> ExitCode {
    if within(&args.out, dir) {
        say(&format!(
            "error: --out {} is inside the job directory {}: the outputs would mix with its manifest and results; name a directory outside it",
            args.out.display(),
            dir.display()
        ));
        return ExitCode::from(EXIT_CONFIG);
    }
    let mut manifest = match Manifest::read(dir) {
        Ok(m) => m,
        Err(e) => {
            say(&format!("error: {e}"));
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let results = match read_results(dir, &manifest) {
        Ok(r) => r,
        Err(e) => {
            say(&format!("error: {e}"));
            return ExitCode::FAILURE;
        }
    };
    let sweep = match jobs::merge(&mut manifest, &results) {
        Ok(Merged::Done(s)) => s,
        Ok(Merged::NextWave(range)) => {
            if let Err(e) = manifest.write(dir) {
                say(&format!("error: {e}"));
                return ExitCode::FAILURE;
            }
            say(&format!(
                "the capacity searches need {} more cells (wave {}): run them, then merge again",
                range.len(),
                manifest.body.cells.last().map_or(0, |c| c.wave)
            ));
            let _ = print_stdout(&how_to_run(dir, range));
            return ExitCode::from(EXIT_MORE_CELLS);
        }
        Err(e) => {
            say(&format!("error: {e}"));
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let mut inputs: Vec<PathBuf> = vec![dir.join(jobs::MANIFEST)];
    let i = &manifest.body.inputs;
    inputs.extend(i.configs.iter().chain([&i.model]).map(|p| dir.join(p)));
    inputs.extend(i.trace.iter().map(|t| dir.join(t)));
    let code = print_stdout(&crate::sweep::output::table(&sweep));
    match crate::sweep::write_outputs(&sweep, &args.out, &inputs) {
        Ok(written) => {
            say(&format!(
                "merged {} cells of {} into {}: {}",
                manifest.body.cells.len(),
                config::problem::escape(&dir.display().to_string()),
                config::problem::escape(&args.out.display().to_string()),
                file_names(&written.paths)
            ));
            code
        }
        Err(
            e @ (crate::sweep::SweepError::OutputIsInput(_)
            | crate::sweep::SweepError::OutputNotADirectory(_)
            | crate::sweep::SweepError::OutputNotAFile(_)),
        ) => {
            say(&format!("error: {e}"));
            ExitCode::from(EXIT_CONFIG)
        }
        Err(e) => {
            say(&format!("error: {e}"));
            ExitCode::FAILURE
        }
    }
}

/// Whether `path` is `dir` or below it: `..` taken lexically, then symbolic links resolved as far
/// as the path exists (an output not made yet is judged by its nearest existing ancestor).
fn within(path: &Path, dir: &Path) -> bool {
    let Ok(dir) = dir.canonicalize() else {
        return false;
    };
    let Ok(absolute) = std::path::absolute(path) else {
        return false;
    };
    // `..` taken lexically: a part that does not exist yet cannot be resolved by the system.
    let mut existing = std::path::PathBuf::new();
    for c in absolute.components() {
        match c {
            std::path::Component::ParentDir => {
                existing.pop();
            }
            std::path::Component::CurDir => {}
            c => existing.push(c),
        }
    }
    let mut rest = Vec::new();
    let resolved = loop {
        if let Ok(p) = existing.canonicalize() {
            break p;
        }
        match (existing.file_name(), existing.parent()) {
            (Some(name), Some(parent)) => {
                rest.push(name.to_owned());
                existing = parent.to_path_buf();
            }
            _ => return false,
        }
    };
    let full = rest.iter().rev().fold(resolved, |p, n| p.join(n));
    full.starts_with(&dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_result_is_written_once_and_two_different_ones_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cell-000002.json");
        write_result(&path, b"{\"a\": 1}\n").unwrap();
        // The same cell finishing twice (a requeued task): the same bytes, accepted.
        write_result(&path, b"{\"a\": 1}\n").unwrap();
        let e = write_result(&path, b"{\"a\": 2}\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("cell-000002.json"), "{e}");
        assert!(
            e.contains("another run of the same cell with different figures"),
            "{e}"
        );
        assert_eq!(std::fs::read(&path).unwrap(), b"{\"a\": 1}\n");
        // No temporary file is left behind.
        let left: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(left, ["cell-000002.json"]);
    }

    #[test]
    fn the_index_comes_from_the_argument_then_the_cluster_engines_variables() {
        let args = |index| SweepCellArgs {
            dir: PathBuf::from("d"),
            index,
        };
        assert_eq!(cell_index(&args(Some(4))), Ok(4));
    }

    #[test]
    fn an_output_inside_the_job_directory_is_told_apart_from_one_beside_it() {
        let root = tempfile::tempdir().unwrap();
        let jobs = root.path().join("jobs");
        std::fs::create_dir_all(jobs.join("results")).unwrap();
        assert!(super::within(&jobs, &jobs));
        assert!(super::within(&jobs.join("results"), &jobs));
        assert!(super::within(&jobs.join("not-yet/out"), &jobs));
        assert!(super::within(&root.path().join("x/../jobs/out"), &jobs));
        assert!(!super::within(&root.path().join("jobs-out"), &jobs));
        assert!(!super::within(&root.path().join("merged"), &jobs));
        #[cfg(unix)]
        {
            let link = root.path().join("link");
            std::os::unix::fs::symlink(&jobs, &link).unwrap();
            assert!(super::within(&link.join("out"), &jobs));
        }
    }
}
