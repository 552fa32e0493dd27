//! Stopping a replay on SIGINT or SIGTERM at a step boundary: the flag a signal sets, the
//! signal's name in the report, and the exit status it gives.

use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Arc;

/// A signal's name, as the report states it.
pub(crate) fn signal_name(signal: i32) -> String {
    match signal {
        2 => "SIGINT".into(),
        15 => "SIGTERM".into(),
        n => format!("signal {n}"),
    }
}

/// The exit status of a run stopped by `signal` (by name): 128 + its number.
pub fn signal_exit_code(signal: &str) -> u8 {
    match signal {
        "SIGINT" => 130,
        "SIGTERM" => 143,
        _ => 1,
    }
}

/// Sets `flag` to the number of the first SIGINT or SIGTERM received, until dropped. Must be
/// called inside an actix system.
pub(super) fn watch_signals(flag: Arc<AtomicI32>) -> Option<SignalWatch> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut int = signal(SignalKind::interrupt()).ok()?;
        let mut term = signal(SignalKind::terminate()).ok()?;
        let task = actix::spawn(async move {
            let sig = tokio::select! {
                _ = int.recv() => 2,
                _ = term.recv() => 15,
            };
            flag.store(sig, Ordering::SeqCst);
        });
        Some(SignalWatch(task))
    }
    #[cfg(not(unix))]
    {
        let _ = flag;
        None
    }
}

/// Stops watching signals when dropped.
pub(super) struct SignalWatch(tokio::task::JoinHandle<()>);

impl Drop for SignalWatch {
    fn drop(&mut self) {
        self.0.abort();
    }
}
