//! The command line (SPEC §7): `replay`, `check` and `budgets`, each taking `--model FILE` and
//! repeatable `--config FILE`. `check` and `budgets` live here; `replay` is dispatched by
//! `main.rs` to the replay module.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

use crate::settings::{self, BudgetRow, ConfigErrors, Listen, LoadOptions, Loaded};

/// The exit code of a refused configuration (and of clap's usage errors).
pub const EXIT_CONFIG: u8 = 2;

/// mstar-chunking: chunked prefill for an LLM serving engine.
#[derive(Debug, Parser)]
#[command(name = "mstar-chunking", version, about, propagate_version = true)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Replay a request trace through the chunking actors on a simulated clock.
    Replay(ReplayArgs),
    /// Load, layer and validate the config against a model; print the effective budget table.
    /// Exits 2 and lists every problem when anything is wrong.
    Check(ConfigArgs),
    /// Print the effective budget table only (`--json`: one object per node and walk).
    Budgets(BudgetsArgs),
}

/// Where the model and the config layers come from.
#[derive(Debug, Clone, Default, PartialEq, Eq, Args)]
pub struct ConfigArgs {
    /// Model manifest [default: config/models/demo.toml, else the built-in demo model]
    #[arg(long, value_name = "FILE")]
    pub model: Option<PathBuf>,
    /// A config layer on top of config/default.toml and config/$MSTAR_ENV.toml; repeatable,
    /// applied in order, then MSTAR__SECTION__KEY environment variables
    #[arg(long = "config", value_name = "FILE")]
    pub configs: Vec<PathBuf>,
}

impl ConfigArgs {
    /// Load options for these arguments, `./config`, `$MSTAR_ENV` and the process environment.
    pub fn load_options(&self) -> LoadOptions {
        LoadOptions::from_process(self.model.clone(), self.configs.clone())
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Args)]
pub struct BudgetsArgs {
    #[command(flatten)]
    pub config: ConfigArgs,
    /// Print a JSON array instead of a table
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Clone, PartialEq, Args)]
pub struct ReplayArgs {
    #[command(flatten)]
    pub config: ConfigArgs,
    /// Request trace: Azure LLM inference CSV or Mooncake JSON Lines [default: the bundled trace]
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,
    /// Replay only the first N requests of the trace
    #[arg(long, value_name = "N")]
    pub requests: Option<u64>,
    /// Multiply the arrival rate (2.0 = arrivals twice as dense)
    #[arg(long, value_name = "X", default_value_t = 1.0, value_parser = positive_f64)]
    pub rate_scale: f64,
    /// Turn every budget off (a baseline without chunking)
    #[arg(long)]
    pub budget_off: bool,
    /// Write one JSON object per step to FILE
    #[arg(long, value_name = "FILE")]
    pub step_log: Option<PathBuf>,
    /// Write the summary as JSON to FILE
    #[arg(long, value_name = "FILE")]
    pub report_json: Option<PathBuf>,
    /// Skip trace lines that cannot be parsed instead of stopping
    #[arg(long)]
    pub skip_bad_lines: bool,
    /// Metrics endpoint address, or "off" [default: metrics.listen of the config]
    #[arg(long, value_name = "ADDR|off")]
    pub metrics_listen: Option<Listen>,
    /// Keep serving metrics after the replay ends, until interrupted
    #[arg(long)]
    pub hold: bool,
    /// Reload the config files when they change (or on SIGHUP) while replaying
    #[arg(long, conflicts_with = "budget_off")]
    pub watch_config: bool,
    /// No progress bar
    #[arg(long)]
    pub no_progress: bool,
}

fn positive_f64(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(x) if x.is_finite() && x > 0.0 => Ok(x),
        _ => Err(format!(
            "expected a positive number such as 1.0 or 2.5, got {s:?}"
        )),
    }
}

/// `replay`: loads the config, starts the metrics endpoint and the actors, replays the trace
/// and prints the summary. Exit codes: 0 done, 2 refused config, 1 any other failure.
pub fn replay(args: &ReplayArgs) -> ExitCode {
    let load = args.config.load_options();
    let loaded = match load_or_report(&load) {
        Ok(l) => l,
        Err(code) => return code,
    };
    if let Listen::Addr(addr) = args
        .metrics_listen
        .unwrap_or(loaded.settings.metrics.listen)
    {
        if let Err(e) = crate::metrics::install_prometheus(addr) {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    }
    let opts = crate::replay::ReplayOptions {
        trace: args.trace.clone(),
        requests: args
            .requests
            .map(|n| usize::try_from(n).unwrap_or(usize::MAX)),
        rate_scale: args.rate_scale,
        budget_off: args.budget_off,
        step_log: args.step_log.clone(),
        report_json: args.report_json.clone(),
        skip_bad_lines: args.skip_bad_lines,
        progress: !args.no_progress,
    };
    actix::System::new().block_on(async {
        let cm = match crate::ChunkingManagement::start(
            &loaded.manifest.name,
            loaded.manifest.submodules(),
        ) {
            Ok(cm) => cm,
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::FAILURE;
            }
        };
        // Bound before the watcher starts, so that a reload always has policies to layer on.
        if let Err(e) = cm.set_policies(loaded.manifest.policies()).await {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
        let _watcher = if args.watch_config {
            let reloader =
                crate::reload::Reloader::new(cm.clone(), load.clone(), loaded.manifest.clone());
            match crate::reload::watch(reloader) {
                Ok(w) => Some(w),
                Err(e) => {
                    eprintln!("error: {e}");
                    return ExitCode::FAILURE;
                }
            }
        } else {
            None
        };
        match crate::replay::run_on(&cm, &loaded.manifest, &loaded.settings, &opts).await {
            Ok(report) => {
                println!("{report}");
                if args.hold {
                    eprintln!("holding: metrics stay served until interrupted (Ctrl-C)");
                    let _ = tokio::signal::ctrl_c().await;
                }
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("error: {e}");
                ExitCode::FAILURE
            }
        }
    })
}

/// `check`: loads and validates everything, prints the layers and the effective table.
pub fn check(args: &ConfigArgs) -> ExitCode {
    let loaded = match load_or_report(&args.load_options()) {
        Ok(l) => l,
        Err(code) => return code,
    };
    let rows = loaded.rows();
    let mut out = format!(
        "model `{}` from {}\nlayers: {}\n\n{}",
        loaded.manifest.name,
        loaded.model_origin,
        loaded.layers.join(" -> "),
        render_table(&rows)
    );
    out.push_str(&format!(
        "\nok: {} nodes, {} walks, min_chunk_tokens {}\n",
        loaded.manifest.nodes.len(),
        loaded.manifest.walks.len(),
        loaded.settings.chunking.min_chunk_tokens
    ));
    print_stdout(&out)
}

/// `budgets`: the effective table only, or its JSON.
pub fn budgets(args: &BudgetsArgs) -> ExitCode {
    let loaded = match load_or_report(&args.config.load_options()) {
        Ok(l) => l,
        Err(code) => return code,
    };
    let rows = loaded.rows();
    let out = if args.json {
        rows_json(&rows)
    } else {
        render_table(&rows)
    };
    print_stdout(&out)
}

/// Loads, and on failure prints every problem to stderr and returns exit code 2.
///
/// # Errors
/// The exit code to return when the configuration was refused.
pub fn load_or_report(opts: &LoadOptions) -> Result<Loaded, ExitCode> {
    match settings::load(opts) {
        Ok(loaded) => {
            crate::logging::init(&loaded.settings.log);
            tracing::debug!(
                model = %loaded.model_origin,
                layers = %loaded.layers.join(" -> "),
                "configuration loaded"
            );
            Ok(loaded)
        }
        Err(errors) => {
            report(&errors);
            Err(ExitCode::from(EXIT_CONFIG))
        }
    }
}

/// Prints every problem, one per line, and how many there were.
pub fn report(errors: &ConfigErrors) {
    let n = errors.0.len();
    eprintln!(
        "error: the configuration was refused ({n} problem{}):",
        if n == 1 { "" } else { "s" }
    );
    for p in &errors.0 {
        eprintln!("  {p}");
    }
}

fn print_stdout(text: &str) -> ExitCode {
    let mut stdout = std::io::stdout().lock();
    match stdout
        .write_all(text.as_bytes())
        .and_then(|()| stdout.flush())
    {
        Ok(()) => ExitCode::SUCCESS,
        // A closed pipe (`| head`) is the reader's choice, not a failure worth a message.
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: cannot write to stdout: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The effective table as aligned text columns; `-` where there is none.
pub fn render_table(rows: &[BudgetRow]) -> String {
    let opt = |v: Option<u32>| v.map_or_else(|| "-".to_string(), |v| v.to_string());
    let mut cells = vec![[
        "node",
        "walk",
        "policy",
        "budget",
        "chunkable",
        "floor",
        "caps",
    ]
    .map(String::from)];
    for r in rows {
        let caps = r.walk_caps.as_ref().map_or_else(
            || "-".to_string(),
            |caps| {
                let parts: Vec<String> = caps.iter().map(|(w, c)| format!("{w}={c}")).collect();
                if parts.is_empty() {
                    "{}".to_string()
                } else {
                    parts.join(",")
                }
            },
        );
        let budget = match (r.max_batch_tokens, r.policy_budget) {
            (Some(b), _) => b.to_string(),
            // Distinguish a budget the config turned off from one the model never declared.
            (None, Some(_)) => "off".to_string(),
            (None, None) => "-".to_string(),
        };
        cells.push([
            r.node.clone(),
            r.walk.clone(),
            opt(r.policy_budget),
            budget,
            if r.chunkable { "yes" } else { "no" }.to_string(),
            opt(r.min_chunk_tokens),
            caps,
        ]);
    }
    let mut widths = [0usize; 7];
    for row in &cells {
        for (w, c) in widths.iter_mut().zip(row) {
            *w = (*w).max(c.chars().count());
        }
    }
    let mut out = String::new();
    for row in &cells {
        let line: Vec<String> = row
            .iter()
            .zip(widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        out.push_str(line.join("  ").trim_end());
        out.push('\n');
    }
    out
}

/// The JSON of `budgets --json` (SPEC §7): an array, one object per row, and a newline.
pub fn rows_json(rows: &[BudgetRow]) -> String {
    // BudgetRow holds only strings, numbers, booleans and string-keyed maps: it always
    // serializes.
    let mut s = serde_json::to_string_pretty(rows).unwrap_or_else(|_| "[]".to_string());
    s.push('\n');
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn row(node: &str, walk: &str) -> BudgetRow {
        BudgetRow {
            node: node.into(),
            walk: walk.into(),
            policy_budget: Some(8192),
            max_batch_tokens: Some(6144),
            chunkable: true,
            min_chunk_tokens: Some(64),
            walk_caps: Some(BTreeMap::from([
                ("decode".into(), 192),
                ("prefill".into(), 4096),
            ])),
        }
    }

    #[test]
    fn the_table_marks_off_budgets_and_lists_caps() {
        let mut off = row("talker", "prefill");
        off.max_batch_tokens = None;
        off.min_chunk_tokens = None;
        off.chunkable = false;
        off.walk_caps = None;
        let text = render_table(&[row("thinker", "mixed"), off]);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines[0],
            "node     walk     policy  budget  chunkable  floor  caps"
        );
        assert_eq!(
            lines[1],
            "thinker  mixed    8192    6144    yes        64     decode=192,prefill=4096"
        );
        assert_eq!(
            lines[2],
            "talker   prefill  8192    off     no         -      -"
        );
    }

    #[test]
    fn json_rows_have_the_contract_keys() {
        let v: serde_json::Value =
            serde_json::from_str(&rows_json(&[row("thinker", "mixed")])).unwrap();
        assert_eq!(
            v,
            serde_json::json!([{
                "node": "thinker", "walk": "mixed", "policy_budget": 8192,
                "max_batch_tokens": 6144, "chunkable": true, "min_chunk_tokens": 64,
                "walk_caps": {"decode": 192, "prefill": 4096}
            }])
        );
    }

    #[test]
    fn replay_flags_parse() {
        let cli = Cli::try_parse_from([
            "mstar-chunking",
            "replay",
            "--model",
            "m.toml",
            "--config",
            "a.toml",
            "--config",
            "b.toml",
            "--trace",
            "t.csv",
            "--requests",
            "10",
            "--rate-scale",
            "2.5",
            "--budget-off",
            "--step-log",
            "s.jsonl",
            "--report-json",
            "r.json",
            "--skip-bad-lines",
            "--metrics-listen",
            "off",
            "--hold",
            "--no-progress",
        ])
        .unwrap();
        let Command::Replay(r) = cli.command else {
            panic!("not replay")
        };
        assert_eq!(
            r.config.configs,
            [PathBuf::from("a.toml"), PathBuf::from("b.toml")]
        );
        assert_eq!(r.requests, Some(10));
        assert_eq!(r.rate_scale, 2.5);
        assert_eq!(r.metrics_listen, Some(Listen::Off));
        assert!(r.budget_off && r.skip_bad_lines && r.hold && !r.watch_config && r.no_progress);
        // A reload would apply the config's budgets over --budget-off: refused together.
        assert!(Cli::try_parse_from([
            "mstar-chunking",
            "replay",
            "--budget-off",
            "--watch-config"
        ])
        .is_err());
        let cli = Cli::try_parse_from(["mstar-chunking", "replay", "--watch-config"]).unwrap();
        assert!(matches!(cli.command, Command::Replay(r) if r.watch_config));
        let cli = Cli::try_parse_from(["mstar-chunking", "replay"]).unwrap();
        let Command::Replay(r) = cli.command else {
            panic!("not replay")
        };
        assert_eq!(r.rate_scale, 1.0);
        assert_eq!(r.metrics_listen, None);
        for bad in [
            &["replay", "--rate-scale", "0"][..],
            &["replay", "--rate-scale", "-1"],
            &["replay", "--metrics-listen", "nowhere"],
            &["budgets", "--jsn"],
        ] {
            let args = std::iter::once("mstar-chunking").chain(bad.iter().copied());
            assert!(Cli::try_parse_from(args).is_err(), "{bad:?}");
        }
    }
}
