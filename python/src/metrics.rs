//! The process's metrics: the crate's Prometheus recorder, installed when the module is
//! imported (before any manager can start, so no series registered at start-up is lost), served
//! on the crate's bounded endpoint (`serve_metrics`) or rendered as text (`render_metrics`).

use std::net::SocketAddr;
use std::sync::{Mutex, OnceLock, PoisonError};

use mstar_chunking::metrics::{install_prometheus_recorder, serve_prometheus, PrometheusHandle};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::boundary::error;

/// The recorder's handle, or why it could not be installed.
static RECORDER: OnceLock<Result<PrometheusHandle, String>> = OnceLock::new();
/// The address `serve_metrics` serves on, once it does.
static SERVING: Mutex<Option<SocketAddr>> = Mutex::new(None);

/// Installs the recorder (once per process; the module's import does it).
pub(crate) fn install() {
    RECORDER.get_or_init(|| install_prometheus_recorder().map_err(|e| e.to_string()));
}

fn handle(py: Python<'_>) -> PyResult<&'static PrometheusHandle> {
    install();
    match RECORDER.get() {
        Some(Ok(h)) => Ok(h),
        Some(Err(e)) => Err(error(py, "ChunkingError", &format!("no metrics: {e}"))),
        None => Err(error(
            py,
            "ChunkingError",
            "no metrics: the recorder is not installed",
        )),
    }
}

/// `serve_metrics(addr)`: serves the process's metrics (every manager's series, by `model`
/// label) at `http://ADDR/metrics` from a thread of its own, with the crate's bounds (a
/// connection cap, header and connection deadlines). `addr` is `"host:port"`; port 0 picks a
/// free port. Answers the address bound. Once per process: a second call is refused.
#[pyfunction]
pub(crate) fn serve_metrics(py: Python<'_>, addr: &str) -> PyResult<String> {
    let listen: SocketAddr = addr.trim().parse().map_err(|_| {
        PyValueError::new_err(format!(
            "addr must be an address such as \"127.0.0.1:9464\", got {addr:?}"
        ))
    })?;
    let handle = handle(py)?.clone();
    let mut serving = SERVING.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(at) = *serving {
        return Err(error(
            py,
            "ConflictError",
            &format!("metrics are already served at http://{at}/metrics (serve_metrics is called once per process)"),
        ));
    }
    let bound = py
        .allow_threads(|| serve_prometheus(listen, handle))
        .map_err(|e| error(py, "ChunkingError", &e.to_string()))?;
    *serving = Some(bound);
    Ok(bound.to_string())
}

/// `render_metrics()`: the Prometheus text of every series in the process, for an engine that
/// serves its own `/metrics` and appends it.
#[pyfunction]
pub(crate) fn render_metrics(py: Python<'_>) -> PyResult<String> {
    let handle = handle(py)?;
    Ok(py.allow_threads(|| handle.render()))
}
