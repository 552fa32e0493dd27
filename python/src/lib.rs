//! `mstar_chunking._native`: the crate's public API ([`ChunkingManagement`] started with
//! `start_on_own_thread`) for the pure-Python package `mstar_chunking`, which gives it the
//! documented API of `mstar.engine.chunking` (see `python/README.md`). By concept:
//!
//! - [`boundary`]: every call's crossing: the calling thread's runtime, panics caught, forked
//!   children refused, errors as the package's exception classes, arguments checked by name;
//! - [`engine`]: `Engine`, one model's actors and every call of the facade, and `NextStep`;
//! - [`steps`]: what a step hands back: `Batch`, `Row`, `Tokens` (a read-only buffer),
//!   `StepOutcome`, `Completed`;
//! - [`settings`]: `set_budgets`' arguments as `BudgetSettings`, latency models;
//! - [`metrics`]: the process's Prometheus recorder, endpoint and text;
//! - [`hooks`]: the benchmark's Rust side and the test doors.
//!
//! Every call that waits for the actors releases the GIL and runs the facade's future to
//! completion on the calling thread, parked while it waits (the request timeout is timed there,
//! by the park's deadline, not by the facade on the actors' runtime), inside `catch_unwind`: a
//! Rust panic becomes a `ChunkingError`, never a Python `PanicException`.
//!
//! [`ChunkingManagement`]: mstar_chunking::ChunkingManagement

mod boundary;
mod engine;
mod hooks;
mod metrics;
mod settings;
mod steps;

use pyo3::prelude::*;

/// The native part of `mstar_chunking`.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // First: every manager's series go to this recorder from its start.
    metrics::install();
    m.add_class::<engine::Engine>()?;
    m.add_class::<engine::PyNextStep>()?;
    m.add_class::<steps::Tokens>()?;
    m.add_class::<steps::StepBatch>()?;
    m.add_class::<steps::Row>()?;
    m.add_class::<steps::Outcome>()?;
    m.add_class::<steps::Completed>()?;
    m.add_function(wrap_pyfunction!(metrics::serve_metrics, m)?)?;
    m.add_function(wrap_pyfunction!(metrics::render_metrics, m)?)?;
    m.add_function(wrap_pyfunction!(settings::preset_cost, m)?)?;
    m.add_function(wrap_pyfunction!(settings::preset_names_py, m)?)?;
    m.add_function(wrap_pyfunction!(boundary::_after_fork_in_child, m)?)?;
    // A manager made before a fork answers `ActorsStoppedError` in the child (`Owner`).
    let kwargs = pyo3::types::PyDict::new(m.py());
    kwargs.set_item("after_in_child", m.getattr("_after_fork_in_child")?)?;
    m.py()
        .import("os")?
        .call_method("register_at_fork", (), Some(&kwargs))?;
    m.add_function(wrap_pyfunction!(hooks::_bench_facade, m)?)?;
    m.add_function(wrap_pyfunction!(hooks::_bench_trips, m)?)?;
    m.add_function(wrap_pyfunction!(hooks::_error_for_test, m)?)?;
    m.add_function(wrap_pyfunction!(hooks::_panic_for_test, m)?)?;
    m.add_function(wrap_pyfunction!(hooks::_timeout_for_test, m)?)?;
    m.add_function(wrap_pyfunction!(hooks::_buffer_address, m)?)?;
    m.add(
        "DEFAULT_MIN_CHUNK_TOKENS",
        mstar_chunking::DEFAULT_MIN_CHUNK_TOKENS,
    )?;
    m.add(
        "DEFAULT_REQUEST_TIMEOUT_S",
        mstar_chunking::actors::DEFAULT_REQUEST_TIMEOUT.as_secs_f64(),
    )?;
    Ok(())
}
