//! Stopping a replay on SIGINT or SIGTERM at a step boundary: the flag a signal sets, the
//! signal's name in the report, and the exit status it gives.
//!
//! The flag is set inside the signal handler itself (an atomic store, which is
//! async-signal-safe), not by a task the runtime polls later: once a signal has been received
//! the flag holds it, so a check made any time after sees it. A replay checks it at every step
//! boundary and once more after its last step, before its report is written.

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

/// Sets `flag` to the number of the first SIGINT or SIGTERM received (a later one leaves it),
/// from this call until the answer is dropped. Needs no runtime.
pub(crate) fn catch_signals(flag: Arc<AtomicI32>) -> Option<SignalCatch> {
    #[cfg(unix)]
    {
        let mut ids = Vec::with_capacity(2);
        for sig in [2, 15] {
            let flag = flag.clone();
            // SAFETY: the action only does a compare-and-swap on an atomic it owns (a clone of
            // an `Arc` moved in), which is async-signal-safe: no allocation, lock or I/O.
            let id = unsafe {
                signal_hook_registry::register(sig, move || {
                    let _ = flag.compare_exchange(0, sig, Ordering::SeqCst, Ordering::SeqCst);
                })
            };
            match id {
                Ok(id) => ids.push(id),
                Err(_) => {
                    ids.into_iter().for_each(|id| {
                        signal_hook_registry::unregister(id);
                    });
                    return None;
                }
            }
        }
        Some(SignalCatch(ids))
    }
    #[cfg(not(unix))]
    {
        let _ = flag;
        None
    }
}

/// Stops setting the flag when dropped. The process keeps a handler for both signals (the
/// default action, ending the process, does not come back): a signal received later is let
/// go, so whoever owns the run checks the flag before the report is out.
pub(crate) struct SignalCatch(#[cfg(unix)] Vec<signal_hook_registry::SigId>);

impl Drop for SignalCatch {
    fn drop(&mut self) {
        #[cfg(unix)]
        for id in self.0.drain(..) {
            signal_hook_registry::unregister(id);
        }
    }
}

/// A test door (`test-hooks` feature): when `MSTAR_TEST_SIGNAL_AT` is `POINT:INT` or
/// `POINT:TERM` and `point` is `POINT`, sends that signal to this process and waits (at most
/// 10 s) until `flag` holds a signal, so a test can land one exactly at `point`.
#[cfg(feature = "test-hooks")]
pub(crate) fn test_signal_at(point: &str, flag: &AtomicI32) {
    let Ok(at) = std::env::var("MSTAR_TEST_SIGNAL_AT") else {
        return;
    };
    let Some((p, sig)) = at.split_once(':') else {
        return;
    };
    if p != point {
        return;
    }
    let sent = std::process::Command::new("kill")
        .args(["-s", sig, &std::process::id().to_string()])
        .status()
        .is_ok_and(|s| s.success());
    if sent {
        for _ in 0..10_000 {
            if flag.load(Ordering::SeqCst) != 0 {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
}

/// Without the `test-hooks` feature: nothing.
#[cfg(not(feature = "test-hooks"))]
#[inline]
pub(crate) fn test_signal_at(_point: &str, _flag: &AtomicI32) {}
