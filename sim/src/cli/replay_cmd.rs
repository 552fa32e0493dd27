//! `replay`: one replay of a trace through the actors, with its metrics endpoint, step log and
//! JSON report.

use std::process::ExitCode;

use super::*;

/// The configuration checked for a replay: the load (with the setting flags over every layer),
/// and `[replay]` resolved against the model.
/// `check` runs the same check (see [`check`]), so that both agree on every setting.
///
/// # Errors
/// Every problem, each naming its key and layer (or the manifest, for a model replay cannot
/// drive).
pub fn load_for_replay(
    opts: &LoadOptions,
    flags: &[config::FlagSetting],
) -> Result<(LoadedConfig, crate::replay::ReplaySetup), ConfigErrors> {
    let loaded = config::load_with_flags(opts, flags)?;
    match crate::replay::settings::check(&loaded.manifest, &loaded.settings.replay) {
        Ok(setup) => Ok((loaded, setup)),
        Err(problems) => {
            let (settings, model) = replay_problems(&loaded, problems);
            let mut errors = ConfigErrors::default();
            errors.extend(settings.into_iter().chain(model));
            Err(errors)
        }
    }
}

/// `[replay]` problems as config problems: those of a setting (naming its key and layer), and
/// those of the model itself (a model without `prefill` or `decode`, which replay cannot drive
/// whatever the settings say).
pub(super) fn replay_problems(
    loaded: &LoadedConfig,
    problems: Vec<crate::replay::settings::SettingProblem>,
) -> (Vec<ConfigProblem>, Vec<ConfigProblem>) {
    let (model, settings): (Vec<_>, Vec<_>) = problems
        .into_iter()
        .partition(|p| matches!(p.key, "walks" | "nodes"));
    (
        settings
            .into_iter()
            .map(|p| loaded.origins.problem(p.key, p.value, p.reason))
            .collect(),
        model
            .into_iter()
            .map(|p| ConfigProblem::Manifest {
                path: loaded.model_origin.clone(),
                reason: format!("`{}` {}", p.key, p.reason),
            })
            .collect(),
    )
}

/// Says once, on stderr, when the built-in copies of `config/default.toml` or the demo model
/// stand in for files that are not there (a run outside the repository).
pub(super) fn note_built_in_copies(loaded: &LoadedConfig) {
    let mut copies = Vec::new();
    if loaded
        .layers
        .first()
        .is_some_and(|l| l.starts_with("built-in "))
    {
        copies.push("config/default.toml");
    }
    if loaded.model_origin.starts_with("built-in ") {
        copies.push("config/models/demo.toml");
    }
    if !copies.is_empty() {
        say(&format!(
            "note: {} not found in ./config (running outside the repository?): using the cop{} built into this binary",
            copies.join(" and "),
            if copies.len() == 1 { "y" } else { "ies" }
        ));
    }
}

/// Warns when the metrics endpoint listens beyond this machine.
fn warn_if_exposed(addr: std::net::SocketAddr) {
    if !addr.ip().is_loopback() {
        tracing::warn!(
            %addr,
            "the metrics endpoint listens on a non-loopback address: anyone who can reach it can read every metric (node and walk names, budgets, queue depths, overrun counts); bind 127.0.0.1 or put it behind a firewall"
        );
    }
}

/// `replay`: loads the config, starts the metrics endpoint and the actors, replays the trace
/// and prints the summary. Exit codes: 0 done, 2 refused config, 1 any other failure.
pub fn replay(args: &ReplayArgs) -> ExitCode {
    // Caught from the start, so that a signal received at any time before the report is out
    // gives the signal's exit status (the replay also stops at its next step).
    let stop = crate::replay::StopFlag::default();
    let signals = crate::replay::catch_signals(stop.0.clone());
    crate::replay::test_signal_at("start", &stop.0);
    let load = args.config.load_options();
    let mut flags = args.settings.flags();
    flags.extend(args.kv.flags());
    flags.extend(args.fleet.flags());
    let (loaded, workers) = match load_for_replay(&load, &flags) {
        Ok((l, setup)) => {
            init_logging(&l);
            note_built_in_copies(&l);
            (l, setup.fleet.size())
        }
        Err(errors) => {
            report(&errors);
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let listen = metrics_listen(args, &loaded);
    if let Listen::Addr(addr) = listen {
        warn_if_exposed(addr);
        if let Err(e) = mstar_chunking::metrics::install_prometheus(addr) {
            say(&format!("error: {e}"));
            return ExitCode::FAILURE;
        }
    }
    let opts = crate::replay::ReplayOptions {
        rate_scale: args.rate_scale,
        budget_off: args.budget_off,
        budget: args.budget,
        step_log: args.step_log.clone(),
        report_json: args.report_json.clone(),
        progress: !args.no_progress,
        config_layers: loaded.layers.clone(),
        inputs: load
            .config_files()
            .into_iter()
            .chain(load.configs.iter().cloned())
            .chain(load.model_path())
            .collect(),
        handle_signals: true,
        on_step: None,
        stop: Some(stop.clone()),
        ..args.source.options()
    };
    if args.watch_config && workers > 1 {
        let split = loaded.settings.replay.fleet.prefill_workers.is_some();
        say(&if split {
            format!(
                "error: `--watch-config` reloads one worker's budgets, and `replay.fleet.prefill_workers` and `decode_workers` make a fleet of {workers} (from {}): replay a fleet without it",
                loaded.origins.of("replay.fleet.prefill_workers")
            )
        } else {
            format!(
                "error: `--watch-config` reloads one worker's budgets, and `replay.fleet.workers` is {workers} (from {}): replay a fleet without it",
                loaded.origins.of("replay.fleet.workers")
            )
        });
        return ExitCode::from(EXIT_CONFIG);
    }
    actix::System::new().block_on(async {
        // Worker 0 of a fleet is labelled as its others are (a `worker` label only then).
        let started = if workers > 1 {
            mstar_chunking::ChunkingManagement::start_worker(
                &loaded.manifest.name,
                "0",
                loaded.manifest.submodules(),
            )
        } else {
            mstar_chunking::ChunkingManagement::start(
                &loaded.manifest.name,
                loaded.manifest.submodules(),
            )
        };
        let cm = match started {
            Ok(cm) => cm,
            Err(e) => {
                say(&format!("error: {e}"));
                return ExitCode::FAILURE;
            }
        };
        // Bound before the watcher starts, so that a reload always has policies to layer on.
        if let Err(e) = cm.set_policies(loaded.manifest.policies()).await {
            say(&format!("error: {e}"));
            return ExitCode::FAILURE;
        }
        let _watcher = if args.watch_config {
            let reloader = mstar_chunking::reload::Reloader::new(
                cm.clone(),
                load.clone(),
                loaded.manifest.clone(),
            )
            .running(
                loaded.settings.component.clone(),
                loaded.settings.sections(),
            );
            match mstar_chunking::reload::watch(reloader) {
                Ok(w) => Some(w),
                Err(e) => {
                    say(&format!("error: {e}"));
                    return ExitCode::FAILURE;
                }
            }
        } else {
            None
        };
        match crate::replay::run_on(&cm, &loaded.manifest, &loaded.settings, &opts).await {
            Ok(mut report) => {
                crate::replay::test_signal_at("written", &stop.0);
                let signalled = || stop.signal().map(crate::replay::signal_name);
                if report.interrupted.is_none() {
                    report.interrupted = signalled();
                }
                for w in &report.warnings {
                    say(&format!("warning: {w}"));
                }
                let code = print_stdout(&format!("{report}\n"));
                crate::replay::test_signal_at("printed", &stop.0);
                if let Some(signal) = report.interrupted.or_else(signalled) {
                    say(&format!(
                        "interrupted by {signal}: the report covers the steps that ran"
                    ));
                    return ExitCode::from(crate::replay::signal_exit_code(&signal));
                }
                // Holding ends on the hold's own signal watch.
                drop(signals);
                if args.hold {
                    say(match listen {
                        Listen::Addr(_) => {
                            "holding: metrics stay served until SIGINT (Ctrl-C) or SIGTERM"
                        }
                        Listen::Off => "holding until SIGINT (Ctrl-C) or SIGTERM; metrics are off",
                    });
                    let signal = hold_until_signal().await;
                    say(&format!("{signal}: stopped holding"));
                }
                code
            }
            Err(e) => {
                say(&format!("error: {e}"));
                match e {
                    // Refused before anything ran: usage, as a refused config.
                    e if is_usage(&e) => ExitCode::from(EXIT_CONFIG),
                    _ => ExitCode::FAILURE,
                }
            }
        }
    })
}

/// Waits for SIGINT or SIGTERM (a service manager's stop) and names it. The replay is done by
/// then, so either ends the hold with the replay's own exit status.
async fn hold_until_signal() -> &'static str {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        if let (Ok(mut int), Ok(mut term)) = (
            signal(SignalKind::interrupt()),
            signal(SignalKind::terminate()),
        ) {
            return tokio::select! {
                _ = int.recv() => "SIGINT",
                _ = term.recv() => "SIGTERM",
            };
        }
    }
    let _ = tokio::signal::ctrl_c().await;
    "SIGINT"
}

/// Whether a replay error refuses what was asked before anything ran (exit 2): an output, a
/// setting, the rate scale, `--budget`, or `--format` / `--arrivals` against the trace.
pub(super) fn is_usage(e: &crate::replay::ReplayError) -> bool {
    use crate::replay::{ReplayError, TraceError};
    match e {
        ReplayError::Output { .. }
        | ReplayError::Config { .. }
        | ReplayError::RateScale(_)
        | ReplayError::Budget { .. }
        | ReplayError::KvTooSmall { .. } => true,
        ReplayError::Trace(t) => matches!(
            t,
            TraceError::Bundled { .. }
                | TraceError::UnknownName(_)
                | TraceError::Unknown { .. }
                | TraceError::NeedsArrivals { .. }
                | TraceError::HasArrivals { .. }
                | TraceError::Arrivals(_)
        ),
        _ => false,
    }
}

/// Where a replay serves metrics (`docs/replay.md#quiet-batch-runs`): `--metrics-listen` when
/// given; else `metrics.listen` when `--hold` asks for metrics or a config layer (a file or an
/// environment variable, not the built-in default) sets it; else nowhere, so that batch runs
/// never clash over a port.
fn metrics_listen(args: &ReplayArgs, loaded: &LoadedConfig) -> Listen {
    if let Some(l) = args.metrics_listen {
        return l;
    }
    let who = loaded.origins.of("metrics.listen");
    let explicit = who != "built-in default" && loaded.layers.first() != Some(&who);
    if args.hold || explicit {
        loaded.settings.metrics.listen
    } else {
        Listen::Off
    }
}
