//! Log setup: `tracing-subscriber` from the `[log]` section, to stderr so stdout stays the
//! command's output (tables, JSON).

use tracing_subscriber::EnvFilter;

use crate::config::{LogFormat, LogSection};

/// Installs the global subscriber: `RUST_LOG` when set, else `log.level`; JSON lines when
/// `log.format = "json"`. A second call keeps the first subscriber (tests call it repeatedly).
pub fn init(log: &LogSection) {
    let from_env = std::env::var("RUST_LOG")
        .ok()
        .filter(|v| !v.trim().is_empty())
        .map(|v| EnvFilter::builder().parse(&v).map_err(|e| (v, e)));
    // The loader validates `log.level`; "info" only guards callers that skipped it.
    let configured = || {
        EnvFilter::builder()
            .parse(&log.level)
            .unwrap_or_else(|_| EnvFilter::new("info"))
    };
    let (filter, bad_env) = match from_env {
        Some(Ok(filter)) => (filter, None),
        Some(Err(bad)) => (configured(), Some(bad)),
        None => (configured(), None),
    };
    // Colour only for a person at a terminal: escape codes in a log file or a pipe are noise.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr())
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_writer(std::io::stderr);
    let installed = match log.format {
        LogFormat::Json => builder.json().try_init(),
        LogFormat::Text => builder.try_init(),
    };
    if let (Ok(()), Some((value, e))) = (installed, bad_env) {
        tracing::warn!(rust_log = %crate::config::problem::escape(&value), error = %e, "RUST_LOG is not a valid filter; using log.level");
    }
}
