//! The benchmark's Rust side and the test doors: code the package's tests and `bench.py` call,
//! not part of the API (their names start with `_`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use mstar_chunking::{
    BudgetSettings, ChunkingError, ChunkingManagement, ChunkingPolicy, NextStep, PreparedInput,
    RowWork, SubmoduleCaps,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::boundary::{call, call_within, to_py_err, Failure};

/// One benchmark workload's step loop on the Rust facade directly: node `llm` cutting
/// `prefill` rows inside `mixed` under `budget` (align 16), `decode_rows` continuing rows
/// (estimate 1) and `prompts` prompts of `prompt_tokens`, each replaced by a new one when its
/// final chunk runs. Each step is one `complete_and_assemble` carrying the replacement
/// admissions. `warm` steps run first; answers the wall-clock and the process's CPU seconds
/// (`time.process_time()`, the actors' thread included) of `steps` steps.
///
/// By default the actors run on their own thread (`start_on_own_thread`) and are awaited from
/// the calling thread, as the package's calls are. With `facade_timeout` (the default) the
/// facade times each request as a Rust engine's handle does by default (a timer task on the
/// actors' thread); without, it waits for every answer (`with_timeout(None)`), as the package's
/// handle does (it times calls itself). With `same_thread` the actors run on the calling thread
/// instead, the loop awaiting them inside their System (`actor_system`), as a Rust engine that
/// starts them in its own System does and as `caller_thread=True` runs them from Python; the
/// timeout is then the facade's default.
#[pyfunction]
#[pyo3(signature = (steps, decode_rows, prompts, prompt_tokens, budget, warm=200, facade_timeout=true, same_thread=false))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn _bench_facade(
    py: Python<'_>,
    steps: u64,
    decode_rows: u64,
    prompts: u64,
    prompt_tokens: u32,
    budget: u32,
    warm: u64,
    facade_timeout: bool,
    same_thread: bool,
) -> PyResult<(f64, f64)> {
    let w = BenchWorkload {
        steps,
        decode_rows,
        prompts,
        prompt_tokens,
        budget,
        warm,
    };
    let caps = [("llm", SubmoduleCaps::new(["prefill", "mixed"], false))];
    if same_thread {
        let ran = py.allow_threads(|| {
            mstar_chunking::actors::actor_system()?.block_on(async {
                let cm = ChunkingManagement::start("bench-rust", caps)?;
                w.run(&cm).await
            })
        });
        return ran.map_err(|e| to_py_err(py, Failure::Chunking(e)));
    }
    let started = py.allow_threads(|| ChunkingManagement::start_on_own_thread("bench-rust", caps));
    let (cm, actors) = started.map_err(|e| to_py_err(py, Failure::Chunking(e)))?;
    let cm = if facade_timeout {
        cm
    } else {
        cm.with_timeout(None)
    };
    let result = call(py, || w.run(&cm));
    py.allow_threads(|| actors.stop());
    result
}

/// The workload `_bench_facade` steps.
struct BenchWorkload {
    steps: u64,
    decode_rows: u64,
    prompts: u64,
    prompt_tokens: u32,
    budget: u32,
    warm: u64,
}

impl BenchWorkload {
    /// Sets up the rows and runs the steps on `cm`: the wall-clock and CPU seconds of the
    /// steps after the warm-up.
    async fn run(&self, cm: &ChunkingManagement) -> Result<(f64, f64), ChunkingError> {
        // Each admission carries a prompt of its own, copied from the tokens as an engine's new
        // prompt is (from its tokenizer's output), as the Python side's admissions copy theirs.
        let tokens: Vec<u32> = (0..self.prompt_tokens).collect();
        let prompt = || PreparedInput::tokens(Arc::<[u32]>::from(&tokens[..]));
        let policy = ChunkingPolicy::budget(self.budget).aligned(16);
        cm.set_policies([(("llm", "mixed"), policy)]).await?;
        cm.set_budgets(
            BudgetSettings::new(["prefill", "decode", "mixed"])
                .combined("mixed", ["prefill", "decode"]),
        )
        .await?;
        for rid in 1..=self.decode_rows {
            cm.continue_row(rid, "llm", "decode", 1).await?;
        }
        let mut next_rid = 1u64 << 32;
        for _ in 0..self.prompts {
            cm.admit(next_rid, "llm", "prefill", prompt(), 0).await?;
            next_rid += 1;
        }
        let template = NextStep::new("llm", "mixed");
        let mut batch = cm.assemble("llm", "mixed").await?;
        let mut t0 = Instant::now();
        let mut cpu0 = process_time();
        for i in 0..self.warm + self.steps {
            if i == self.warm {
                t0 = Instant::now();
                cpu0 = process_time();
            }
            let ran: Vec<u32> = batch.rows.iter().map(|r| r.tokens()).collect();
            let mut next = template.clone();
            for r in &batch.rows {
                if matches!(r.work, RowWork::Chunk { range, .. } if range.is_final()) {
                    next = next.admit(next_rid, "prefill", prompt(), 0);
                    next_rid += 1;
                }
            }
            let done = cm
                .complete_and_assemble(batch.step, ran, None, next)
                .await?;
            batch = done.next?;
        }
        Ok((t0.elapsed().as_secs_f64(), process_time() - cpu0))
    }
}

/// `n` trips to the actors (`queue_stats`) awaited in one call on a manager of its own: the
/// process's CPU seconds and the wall-clock seconds they took, to compare with the same calls
/// from Python.
/// The manager's handle waits as the package's do (the facade's timeout off, each call timed
/// by the calling thread's park, 5 s).
/// With `separate`, each trip is a blocking call of its own (as a call from Python is), and
/// `gap_us` microseconds pass between two of them, spent spinning on the calling thread (as a
/// Python loop spends them between its calls; the spin's CPU time is in the answer).
#[pyfunction]
#[pyo3(signature = (n, separate=false, gap_us=0.0))]
pub(crate) fn _bench_trips(
    py: Python<'_>,
    n: u64,
    separate: bool,
    gap_us: f64,
) -> PyResult<(f64, f64)> {
    let gap = Duration::try_from_secs_f64(gap_us / 1e6)
        .map_err(|_| PyValueError::new_err(format!("gap_us must be >= 0, got {gap_us}")))?;
    let started = py.allow_threads(|| {
        ChunkingManagement::start_on_own_thread(
            "bench-trips",
            [("llm", SubmoduleCaps::new(["prefill"], false))],
        )
    });
    let (cm, actors) = started.map_err(|e| to_py_err(py, Failure::Chunking(e)))?;
    let cm = cm.with_timeout(None);
    let timeout = Some(mstar_chunking::actors::DEFAULT_REQUEST_TIMEOUT);
    let result = if separate {
        // Each trip a call of its own, as from Python: the GIL released and taken again.
        let (t0, cpu0) = (Instant::now(), process_time());
        (0..n)
            .try_for_each(|_| {
                let t = Instant::now();
                while t.elapsed() < gap {
                    std::hint::spin_loop();
                }
                call_within(py, timeout, || cm.queue_stats()).map(drop)
            })
            .map(|()| (process_time() - cpu0, t0.elapsed().as_secs_f64()))
    } else {
        call_within(py, timeout, || async {
            let (t0, cpu0) = (Instant::now(), process_time());
            for _ in 0..n {
                cm.queue_stats().await?;
            }
            Ok((process_time() - cpu0, t0.elapsed().as_secs_f64()))
        })
    };
    py.allow_threads(|| actors.stop());
    result
}

/// `time.process_time()`, read with the GIL taken again for the moment (twice a run).
fn process_time() -> f64 {
    Python::with_gil(|py| {
        py.import("time")
            .and_then(|t| t.call_method0("process_time"))
            .and_then(|v| v.extract::<f64>())
            .unwrap_or(f64::NAN)
    })
}

/// A Rust error of `kind` (`timeout` only) converted as every call converts its errors: the
/// facade's timeout cannot be provoked deterministically from a test.
#[pyfunction]
pub(crate) fn _error_for_test(py: Python<'_>, kind: &str) -> PyResult<PyObject> {
    let e = match kind {
        "timeout" => ChunkingError::Timeout {
            actor: "Scheduler",
            after: Duration::from_millis(5),
        },
        other => {
            return Err(PyValueError::new_err(format!(
                "unknown test error `{other}`"
            )))
        }
    };
    Ok(to_py_err(py, Failure::Chunking(e))
        .into_value(py)
        .into_any())
}

/// Panics inside a blocking call, to show the panic comes back as a `ChunkingError`.
#[pyfunction]
pub(crate) fn _panic_for_test(py: Python<'_>) -> PyResult<()> {
    call(py, || async {
        if std::hint::black_box(true) {
            panic!("injected");
        }
        Ok(())
    })
}

/// The address of the memory `obj`'s buffer exports, to show two views share it (no copy).
#[pyfunction]
pub(crate) fn _buffer_address(obj: &Bound<'_, PyAny>) -> PyResult<usize> {
    let mut view = std::mem::MaybeUninit::<pyo3::ffi::Py_buffer>::zeroed();
    // SAFETY: `view` is filled by `PyObject_GetBuffer` and released once, below.
    unsafe {
        if pyo3::ffi::PyObject_GetBuffer(obj.as_ptr(), view.as_mut_ptr(), pyo3::ffi::PyBUF_SIMPLE)
            != 0
        {
            return Err(PyErr::fetch(obj.py()));
        }
        let address = (*view.as_ptr()).buf as usize;
        pyo3::ffi::PyBuffer_Release(view.as_mut_ptr());
        Ok(address)
    }
}

/// Waits `timeout` seconds for an answer that never comes, as a call to actors that do not
/// answer would: the timeout every call is timed with, provoked.
#[pyfunction]
pub(crate) fn _timeout_for_test(py: Python<'_>, timeout: f64) -> PyResult<()> {
    let timeout = crate::boundary::timeout_arg(Some(timeout))?;
    crate::boundary::call_within(py, timeout, std::future::pending)
}
