//! `mstar_chunking._native`: the crate's public API ([`ChunkingManagement`] started with
//! `start_on_own_thread`) for the pure-Python package `mstar_chunking`, which gives it the
//! documented API of `mstar.engine.chunking` (see `python/README.md`).
//!
//! Every call that waits for the actors releases the GIL and runs the facade's future to
//! completion on a current-thread tokio runtime of the calling thread (its timer serves the
//! facade's request timeout), inside `catch_unwind`: a Rust panic becomes a `ChunkingError`, never
//! a Python `PanicException`. Errors become the exception classes of `mstar_chunking._errors`,
//! chosen by the error's kind.

use std::collections::BTreeMap;
use std::future::Future;
use std::num::NonZeroU32;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use mstar_chunking::budget::{BudgetValue, NodeBudget};
use mstar_chunking::{
    ActorThread, Batch, BudgetSettings, ChunkInput, ChunkingError, ChunkingManagement,
    ChunkingPolicy, ErrorKind, Overrun, OverrunReason, PreparedInput, RowWork, StepOutcome,
    SubmoduleCaps,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::sync::GILOnceCell;
use pyo3::types::{PyDict, PyList, PyTuple};

/// The logger overruns are reported to (`logging.getLogger("mstar_chunking")`).
const LOGGER: &str = "mstar_chunking";

thread_local! {
    /// The runtime the calling thread drives the facade's futures on: current-thread, with the
    /// timer the request timeout needs. One per Python thread that calls in, built on first use.
    static RUNTIME: Result<tokio::runtime::Runtime, String> = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .map_err(|e| e.to_string());
}

/// What a blocking call can fail with before it becomes a Python exception.
enum Failure {
    Chunking(ChunkingError),
    /// A panic in the Rust code, or a runtime that could not be built.
    Internal(String),
}

impl From<ChunkingError> for Failure {
    fn from(e: ChunkingError) -> Self {
        Failure::Chunking(e)
    }
}

/// Runs `make()`'s future to completion with the GIL released; a panic is caught here.
fn block<T, F, Fut>(py: Python<'_>, make: F) -> Result<T, Failure>
where
    F: FnOnce() -> Fut + Send,
    Fut: Future<Output = Result<T, ChunkingError>>,
    T: Send,
{
    py.allow_threads(|| {
        let ran = catch_unwind(AssertUnwindSafe(|| {
            RUNTIME.with(|rt| match rt {
                Ok(rt) => rt.block_on(make()).map_err(Failure::from),
                Err(e) => Err(Failure::Internal(format!(
                    "cannot build the calling thread's runtime: {e}"
                ))),
            })
        }));
        ran.unwrap_or_else(|panic| Err(Failure::Internal(panic_message(&*panic))))
    })
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    let what = panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_owned());
    format!("internal error in mstar_chunking (a Rust panic, caught): {what}")
}

/// A class of the pure-Python part of the package (`mstar_chunking._types` / `._errors`).
fn py_attr<'py>(py: Python<'py>, module: &str, name: &str) -> PyResult<Bound<'py, PyAny>> {
    py.import(module)?.getattr(name)
}

/// The exception class for `e`'s kind; a timeout is a `TimeoutError`.
fn error_class(e: &ChunkingError) -> &'static str {
    if matches!(e, ChunkingError::Timeout { .. }) {
        return "ChunkingTimeoutError";
    }
    match e.kind() {
        ErrorKind::InvalidRequest => "InvalidRequestError",
        ErrorKind::RefusedSettings => "RefusedSettingsError",
        ErrorKind::Conflict => "ConflictError",
        ErrorKind::Transient => "TransientError",
        ErrorKind::Fatal => "ActorsStoppedError",
        _ => "ChunkingError",
    }
}

fn kind_name(e: &ChunkingError) -> &'static str {
    match e.kind() {
        ErrorKind::InvalidRequest => "invalid_request",
        ErrorKind::RefusedSettings => "refused_settings",
        ErrorKind::Conflict => "conflict",
        ErrorKind::Transient => "transient",
        ErrorKind::Fatal => "fatal",
        _ => "other",
    }
}

/// The Python exception for a failure: the class by kind, the Rust message, and `kind`,
/// `retryable` and (for refused settings) `problems` as attributes.
fn to_py_err(py: Python<'_>, f: Failure) -> PyErr {
    let made = (|| -> PyResult<PyErr> {
        let (class, message, kind, retryable, problems) = match &f {
            Failure::Chunking(e) => {
                let problems: Vec<String> = match e {
                    ChunkingError::Budget(b) => b.0.iter().map(ToString::to_string).collect(),
                    ChunkingError::Policy(p) => p.iter().map(ToString::to_string).collect(),
                    _ => Vec::new(),
                };
                (
                    error_class(e),
                    e.to_string(),
                    kind_name(e),
                    e.is_retryable(),
                    problems,
                )
            }
            Failure::Internal(m) => ("ChunkingError", m.clone(), "internal", false, Vec::new()),
        };
        let class = py_attr(py, "mstar_chunking._errors", class)?;
        let exc = class.call1((message,))?;
        exc.setattr("kind", kind)?;
        exc.setattr("retryable", retryable)?;
        exc.setattr("problems", problems)?;
        Ok(PyErr::from_value(exc))
    })();
    made.unwrap_or_else(|e| e)
}

/// `block`, with the failure turned into its Python exception.
fn call<T, F, Fut>(py: Python<'_>, make: F) -> PyResult<T>
where
    F: FnOnce() -> Fut + Send,
    Fut: Future<Output = Result<T, ChunkingError>>,
    T: Send,
{
    block(py, make).map_err(|f| to_py_err(py, f))
}

/// A class of `mstar_chunking._types`, looked up once.
fn cached_class<'py>(
    py: Python<'py>,
    cell: &'static GILOnceCell<Py<PyAny>>,
    name: &str,
) -> PyResult<&'py Bound<'py, PyAny>> {
    cell.get_or_try_init(py, || {
        Ok::<_, PyErr>(py_attr(py, "mstar_chunking._types", name)?.unbind())
    })
    .map(|c| c.bind(py))
}

static CHUNK_RANGE: GILOnceCell<Py<PyAny>> = GILOnceCell::new();
static OVERRUN: GILOnceCell<Py<PyAny>> = GILOnceCell::new();
static VIEW: GILOnceCell<Py<PyAny>> = GILOnceCell::new();

fn overrun_to_py<'py>(py: Python<'py>, o: &Overrun) -> PyResult<Bound<'py, PyAny>> {
    cached_class(py, &OVERRUN, "Overrun")?.call1((
        &*o.node,
        &*o.walk,
        o.budget,
        o.tokens,
        o.reason.as_str(),
    ))
}

/// Logs an overrun through Python's `logging` when it is the 1st, 2nd, 4th, … of its
/// `(node, walk)` (`count`: the overruns counted there so far, this one included).
fn log_overrun(py: Python<'_>, o: &Overrun, count: u64) -> PyResult<()> {
    if !count.is_power_of_two() {
        return Ok(());
    }
    let logger = py.import("logging")?.call_method1("getLogger", (LOGGER,))?;
    logger.call_method1(
        "warning",
        (
            "step of %s/%s ran %d tokens over its budget of %d (%s); overrun %d of this walk (logged on the 1st, 2nd, 4th, ...)",
            &*o.node,
            &*o.walk,
            o.tokens,
            o.budget,
            o.reason.as_str(),
            count,
        ),
    )?;
    Ok(())
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn nonzero(what: &str, n: u32) -> PyResult<NonZeroU32> {
    NonZeroU32::new(n)
        .ok_or_else(|| PyValueError::new_err(format!("{what} must be at least 1, got 0")))
}

/// Per node, `walk -> budget` (`None`: off), as the package passes per-walk overrides.
type PerWalk = Vec<(String, Vec<(String, Option<u32>)>)>;

/// Builds the settings of `set_budgets` from the package's normalised arguments. One place for
/// the `BudgetSettings` fields, which the API of the budgets may rename.
#[allow(clippy::too_many_arguments)]
fn budget_settings(
    node_wide: Vec<(String, Option<u32>)>,
    per_walk: PerWalk,
    walks: Vec<String>,
    combined_walk_of: Vec<(String, String)>,
    override_mixed: Vec<String>,
    no_chunking: Vec<String>,
    min_chunk_tokens: u32,
    max_row_tokens: Option<u32>,
    max_partial_prefills: Option<u32>,
) -> PyResult<BudgetSettings> {
    let value = |key: String, b: Option<u32>| -> PyResult<BudgetValue> {
        Ok(match b {
            None => BudgetValue::Off,
            Some(n) => BudgetValue::Tokens(nonzero(&key, n)?),
        })
    };
    let mut s = BudgetSettings::new(walks);
    for (node, b) in node_wide {
        let v = value(format!("overrides[{node:?}]"), b)?;
        s.overrides.insert(node.as_str().into(), NodeBudget::All(v));
    }
    for (node, per) in per_walk {
        let mut m = BTreeMap::new();
        for (walk, b) in per {
            let v = value(format!("overrides[{node:?}][{walk:?}]"), b)?;
            m.insert(walk.as_str().into(), v);
        }
        s.overrides
            .insert(node.as_str().into(), NodeBudget::PerWalk(m));
    }
    // Set as given (not with `combined`, which would also serve the walks): a combined walk the
    // deployment does not serve is refused, as the original's rule says.
    s.combined_walk_of = combined_walk_of
        .into_iter()
        .map(|(m, c)| (m.as_str().into(), c.as_str().into()))
        .collect();
    s.override_mixed = override_mixed.iter().map(|n| n.as_str().into()).collect();
    s.no_chunking = no_chunking.iter().map(|n| n.as_str().into()).collect();
    s.min_chunk_tokens = min_chunk_tokens;
    s.max_row_tokens = max_row_tokens;
    s.max_partial_prefills = max_partial_prefills;
    Ok(s)
}

/// The `(rid, node)` keys admitted through one [`Engine`], each with its admission's number.
#[derive(Default)]
struct Admitted {
    keys: BTreeMap<(u64, String), u64>,
    next: u64,
}

/// One model's chunking actors, on a thread of their own (`ChunkingManagement` in Python wraps
/// it). Frozen: every method takes `&self`, so calls from several Python threads run at once.
#[pyclass(module = "mstar_chunking._native", frozen)]
struct Engine {
    cm: ChunkingManagement,
    actors: Mutex<Option<ActorThread>>,
    /// `(rid, node)` admitted and perhaps still held, with the admission's number: the public
    /// API answers whether one key is held, not which are, so iterating `prepared` checks these
    /// (and drops a key found gone only if it was not admitted again meanwhile).
    admitted: Mutex<Admitted>,
}

#[pymethods]
impl Engine {
    /// Starts the actors of `model` for `submodules`, `[(node, chunkable_walks,
    /// can_override_mixed_max_tokens)]`; `timeout` in seconds (`None`: wait for ever).
    #[new]
    #[pyo3(signature = (model, submodules, timeout=Some(5.0)))]
    fn new(
        py: Python<'_>,
        model: String,
        submodules: Vec<(String, Vec<String>, bool)>,
        timeout: Option<f64>,
    ) -> PyResult<Self> {
        let timeout = match timeout {
            None => None,
            Some(t) if t.is_finite() && t > 0.0 => Some(Duration::from_secs_f64(t)),
            Some(t) => {
                return Err(PyValueError::new_err(format!(
                    "timeout must be a finite number of seconds above 0, or None, got {t}"
                )))
            }
        };
        let caps: Vec<(String, SubmoduleCaps)> = submodules
            .into_iter()
            .map(|(n, w, o)| (n, SubmoduleCaps::new(w, o)))
            .collect();
        let started = py.allow_threads(|| {
            catch_unwind(AssertUnwindSafe(|| {
                ChunkingManagement::start_on_own_thread(&model, caps)
            }))
            .unwrap_or_else(|p| {
                Err(ChunkingError::ThreadStart {
                    reason: panic_message(&*p),
                })
            })
        });
        let (cm, actors) = started.map_err(|e| to_py_err(py, Failure::Chunking(e)))?;
        Ok(Self {
            cm: cm.with_timeout(timeout),
            actors: Mutex::new(Some(actors)),
            admitted: Mutex::new(Admitted::default()),
        })
    }

    /// Stops the actors; later calls raise `ActorsStoppedError`.
    fn close(&self, py: Python<'_>) {
        let actors = lock(&self.actors).take();
        if let Some(a) = actors {
            py.allow_threads(|| a.stop());
        }
    }

    /// `[(node, walk, max_batch_tokens | None, align)]`.
    fn set_policies(
        &self,
        py: Python<'_>,
        policies: Vec<(String, String, Option<u32>, u32)>,
    ) -> PyResult<()> {
        let policies: Vec<((String, String), ChunkingPolicy)> = policies
            .into_iter()
            .map(|(n, w, b, align)| {
                (
                    (n, w),
                    ChunkingPolicy {
                        max_batch_tokens: b,
                        align,
                    },
                )
            })
            .collect();
        call(py, || self.cm.set_policies(policies))
    }

    /// The arguments of `set_budgets`, normalised by the package.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (node_wide, per_walk, walks, combined_walk_of, override_mixed, no_chunking, min_chunk_tokens, max_row_tokens=None, max_partial_prefills=None))]
    fn set_budgets(
        &self,
        py: Python<'_>,
        node_wide: Vec<(String, Option<u32>)>,
        per_walk: PerWalk,
        walks: Vec<String>,
        combined_walk_of: Vec<(String, String)>,
        override_mixed: Vec<String>,
        no_chunking: Vec<String>,
        min_chunk_tokens: u32,
        max_row_tokens: Option<u32>,
        max_partial_prefills: Option<u32>,
    ) -> PyResult<()> {
        let settings = budget_settings(
            node_wide,
            per_walk,
            walks,
            combined_walk_of,
            override_mixed,
            no_chunking,
            min_chunk_tokens,
            max_row_tokens,
            max_partial_prefills,
        )?;
        call(py, || self.cm.set_budgets(settings))
    }

    /// `(max_batch_tokens | None, align)` of the model's policy.
    fn policy(&self, py: Python<'_>, node: &str, walk: &str) -> PyResult<(Option<u32>, u32)> {
        let p = call(py, || self.cm.policy(node, walk))?;
        Ok((p.max_batch_tokens, p.align))
    }

    fn chunkable(&self, py: Python<'_>, node: &str, walk: &str) -> PyResult<bool> {
        call(py, || self.cm.chunkable(node, walk))
    }

    fn max_batch_tokens(&self, py: Python<'_>, node: &str, walk: &str) -> PyResult<Option<u32>> {
        call(py, || self.cm.max_batch_tokens(node, walk))
    }

    fn min_chunk_tokens(&self, py: Python<'_>, budget: u32) -> PyResult<u32> {
        call(py, || self.cm.min_chunk_tokens(budget))
    }

    fn walk_caps(
        &self,
        py: Python<'_>,
        node: &str,
        walk: &str,
    ) -> PyResult<Option<BTreeMap<String, u32>>> {
        let caps = call(py, || self.cm.walk_caps(node, walk))?;
        Ok(caps.map(|m| m.into_iter().map(|(w, c)| (w.to_string(), c)).collect()))
    }

    /// The whole prepared input held for `(rid, node)`, as a zero-copy token view.
    fn prepared(&self, py: Python<'_>, rid: u64, node: &str) -> PyResult<Option<Tokens>> {
        let input = call(py, || self.cm.prepared(rid, node))?;
        Ok(input.map(|i| {
            let n = i.len();
            Tokens { view: i.cut(0..n) }
        }))
    }

    /// The `(rid, node)` keys whose input is held now.
    fn prepared_keys(&self, py: Python<'_>) -> PyResult<Vec<(u64, String)>> {
        let candidates: Vec<((u64, String), u64)> = lock(&self.admitted)
            .keys
            .iter()
            .map(|(k, n)| (k.clone(), *n))
            .collect();
        let (held, gone) = call(py, || async {
            let (mut held, mut gone) = (Vec::new(), Vec::new());
            for (key, n) in &candidates {
                if self.cm.prepared(key.0, &key.1).await?.is_some() {
                    held.push(key.clone());
                } else {
                    gone.push((key, *n));
                }
            }
            Ok((held, gone))
        })?;
        let mut admitted = lock(&self.admitted);
        for (key, n) in gone {
            if admitted.keys.get(key) == Some(&n) {
                admitted.keys.remove(key);
            }
        }
        Ok(held)
    }

    /// `(rows, tokens)` of prepared inputs held over all nodes.
    fn prepared_totals(&self, py: Python<'_>) -> PyResult<(usize, u64)> {
        call(py, || self.cm.prepared_totals())
    }

    fn release(&self, py: Python<'_>, rid: u64, node: &str) -> PyResult<bool> {
        let held = call(py, || self.cm.release(rid, node))?;
        lock(&self.admitted).keys.remove(&(rid, node.to_owned()));
        Ok(held)
    }

    fn forget_request(&self, py: Python<'_>, rid: u64) -> PyResult<()> {
        call(py, || self.cm.forget_request(rid))?;
        lock(&self.admitted).keys.retain(|(r, _), _| *r != rid);
        Ok(())
    }

    /// Admits a prompt; `tokens` holds its token ids as native-endian `uint32`s.
    #[pyo3(signature = (rid, node, walk, tokens, cached=0))]
    fn admit(
        &self,
        py: Python<'_>,
        rid: u64,
        node: &str,
        walk: &str,
        tokens: &[u8],
        cached: u32,
    ) -> PyResult<()> {
        if !tokens.len().is_multiple_of(4) {
            return Err(PyValueError::new_err(format!(
                "rid {rid} on `{node}`: token bytes must be whole uint32s, got {} bytes",
                tokens.len()
            )));
        }
        let ids: Arc<[u32]> = tokens
            .chunks_exact(4)
            .map(|b| u32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let input = PreparedInput::tokens(ids);
        call(py, || self.cm.admit(rid, node, walk, input, cached))?;
        let mut admitted = lock(&self.admitted);
        admitted.next += 1;
        let n = admitted.next;
        admitted.keys.insert((rid, node.to_owned()), n);
        Ok(())
    }

    #[pyo3(signature = (rid, node, walk, estimate=1, context=None))]
    fn continue_row(
        &self,
        py: Python<'_>,
        rid: u64,
        node: &str,
        walk: &str,
        estimate: u32,
        context: Option<u64>,
    ) -> PyResult<()> {
        call(py, || async {
            match context {
                None => self.cm.continue_row(rid, node, walk, estimate).await,
                Some(c) => {
                    self.cm
                        .continue_row_with_context(rid, node, walk, estimate, c)
                        .await
                }
            }
        })
    }

    fn assemble(&self, py: Python<'_>, node: &str, walk: &str) -> PyResult<StepBatch> {
        let batch = call(py, || self.cm.assemble(node, walk))?;
        Ok(StepBatch { batch })
    }

    /// Completes a step with the tokens each row ran and, optionally, its measured time in ms.
    /// A token overrun is logged on the 1st, 2nd, 4th, … of its `(node, walk)`.
    #[pyo3(signature = (step, ran, measured_ms=None))]
    fn complete(
        &self,
        py: Python<'_>,
        step: u64,
        ran: Vec<u32>,
        measured_ms: Option<f64>,
    ) -> PyResult<Outcome> {
        let (outcome, count) = call(py, || async {
            let outcome = match measured_ms {
                None => self.cm.complete(step, ran).await?,
                Some(ms) => self.cm.complete_measured(step, ran, ms).await?,
            };
            let count = match &outcome.overrun {
                Some(o) => self.cm.overrun_count(&o.node, &o.walk, None).await?,
                None => 0,
            };
            Ok((outcome, count))
        })?;
        if let Some(o) = &outcome.overrun {
            log_overrun(py, o, count)?;
        }
        Ok(Outcome { outcome })
    }

    fn abandon(&self, py: Python<'_>, step: u64) -> PyResult<()> {
        call(py, || self.cm.abandon(step))
    }

    /// Checks `batch` as it ran (`ran[i]`: the tokens row `i` ran); counts, logs (1st, 2nd,
    /// 4th, …) and returns the overrun, if any.
    fn check_budget<'py>(
        &self,
        py: Python<'py>,
        batch: &StepBatch,
        ran: Vec<u32>,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        let b = batch.batch.clone();
        let (overrun, count) = call(py, || async {
            let overrun = self.cm.check_budget(&b, &ran).await?;
            let count = match &overrun {
                Some(o) => self.cm.overrun_count(&o.node, &o.walk, None).await?,
                None => 0,
            };
            Ok((overrun, count))
        })?;
        match overrun {
            None => Ok(None),
            Some(o) => {
                log_overrun(py, &o, count)?;
                Ok(Some(overrun_to_py(py, &o)?))
            }
        }
    }

    /// Overruns counted for `(node, walk)`, for one reason (`uncut_row`,
    /// `speculation_estimate`, `other`) or all.
    #[pyo3(signature = (node, walk, reason=None))]
    fn overrun_count(
        &self,
        py: Python<'_>,
        node: &str,
        walk: &str,
        reason: Option<&str>,
    ) -> PyResult<u64> {
        let reason = match reason {
            None => None,
            Some(r) => Some(
                OverrunReason::ALL
                    .into_iter()
                    .find(|x| x.as_str() == r)
                    .ok_or_else(|| {
                        PyValueError::new_err(format!(
                            "unknown overrun reason `{r}`: one of uncut_row, speculation_estimate, other"
                        ))
                    })?,
            ),
        };
        call(py, || self.cm.overrun_count(node, walk, reason))
    }

    /// `{prefill_rows, mid_prefill_rows, continuing_rows, steps_in_flight}`.
    fn queue_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = call(py, || self.cm.queue_stats())?;
        let d = PyDict::new(py);
        d.set_item("prefill_rows", s.prefill_rows)?;
        d.set_item("mid_prefill_rows", s.mid_prefill_rows)?;
        d.set_item("continuing_rows", s.continuing_rows)?;
        d.set_item("steps_in_flight", s.steps_in_flight)?;
        Ok(d)
    }
}

/// A read-only view of token ids held by the actors (a chunk's, or a whole prepared input's):
/// the package turns it into a `memoryview` of format `I` over the same memory, which keeps
/// this object, and so the tokens, alive.
#[pyclass(module = "mstar_chunking._native", frozen)]
struct Tokens {
    view: ChunkInput,
}

#[pymethods]
impl Tokens {
    /// The address of the first token id (valid while this object lives).
    #[getter]
    fn address(&self) -> usize {
        self.view.token_ids().as_ptr() as usize
    }

    fn __len__(&self) -> usize {
        self.view.token_ids().len()
    }

    /// `(start, end)` of the whole input this view covers.
    #[getter]
    fn span(&self) -> (usize, usize) {
        let r = self.view.range();
        (r.start, r.end)
    }

    /// The per-token extras, if the node has them (a copy).
    fn extras(&self) -> Option<Vec<f32>> {
        self.view.extras().map(<[f32]>::to_vec)
    }
}

/// One assembled step (`assemble`'s answer). Its rows' inputs are views of the prepared
/// inputs; the batch is the same object's content until the step completes or is abandoned.
#[pyclass(module = "mstar_chunking._native", frozen, name = "Batch")]
struct StepBatch {
    batch: Arc<Batch>,
}

#[pymethods]
impl StepBatch {
    #[getter]
    fn step(&self) -> u64 {
        self.batch.step
    }
    #[getter]
    fn node(&self) -> &str {
        &self.batch.node
    }
    #[getter]
    fn walk(&self) -> &str {
        &self.batch.walk
    }
    /// The step walk, then its member walks.
    #[getter]
    fn walks<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, self.batch.walks.iter().map(|w| &**w))
    }
    /// `B`, the budget the step was scheduled under.
    #[getter]
    fn budget(&self) -> Option<u32> {
        self.batch.budget
    }
    /// `F`, the floor.
    #[getter]
    fn floor(&self) -> Option<u32> {
        self.batch.floor
    }
    #[getter]
    fn caps(&self) -> Option<BTreeMap<String, u32>> {
        self.batch
            .caps
            .as_ref()
            .map(|c| c.iter().map(|(w, n)| (w.to_string(), *n)).collect())
    }
    #[getter]
    fn scheduled_tokens(&self) -> u64 {
        self.batch.scheduled_tokens
    }
    #[getter]
    fn uncut_over_budget(&self) -> bool {
        self.batch.uncut_over_budget
    }
    #[getter]
    fn waiting(&self) -> u32 {
        self.batch.waiting
    }
    #[getter]
    fn max_step_ms(&self) -> Option<f64> {
        self.batch.max_step_ms
    }
    #[getter]
    fn predicted_ms(&self) -> Option<f64> {
        self.batch.predicted_ms
    }
    /// The rows: continuing rows first, then chunks in planning order.
    #[getter]
    fn rows<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let rows = (0..self.batch.rows.len()).map(|i| Row {
            batch: self.batch.clone(),
            i,
        });
        PyList::new(py, rows)
    }
    /// The tokens each row is scheduled to run: what `complete` takes when every row ran.
    fn planned(&self) -> Vec<u32> {
        self.batch.rows.iter().map(|r| r.tokens()).collect()
    }
    fn __len__(&self) -> usize {
        self.batch.rows.len()
    }
    fn __repr__(&self) -> String {
        format!(
            "Batch(step={}, node={:?}, walk={:?}, rows={}, scheduled_tokens={}, budget={:?})",
            self.batch.step,
            &*self.batch.node,
            &*self.batch.walk,
            self.batch.rows.len(),
            self.batch.scheduled_tokens,
            self.batch.budget
        )
    }
}

/// One row of a batch.
#[pyclass(module = "mstar_chunking._native", frozen)]
struct Row {
    batch: Arc<Batch>,
    i: usize,
}

impl Row {
    fn row(&self) -> &mstar_chunking::BatchRow {
        &self.batch.rows[self.i]
    }
}

#[pymethods]
impl Row {
    #[getter]
    fn rid(&self) -> u64 {
        self.row().rid
    }
    /// The row's own walk (a member walk in a combined step).
    #[getter]
    fn walk(&self) -> &str {
        self.batch.walk_of(self.row())
    }
    /// `"chunk"` or `"continue"`.
    #[getter]
    fn kind(&self) -> &'static str {
        match self.row().work {
            RowWork::Chunk { .. } => "chunk",
            RowWork::Continue { .. } => "continue",
        }
    }
    /// Tokens the row is scheduled to run.
    #[getter]
    fn tokens(&self) -> u32 {
        self.row().tokens()
    }
    /// A continuing row's estimate; `None` for a chunk.
    #[getter]
    fn estimate(&self) -> Option<u32> {
        match self.row().work {
            RowWork::Continue { estimate } => Some(estimate),
            RowWork::Chunk { .. } => None,
        }
    }
    /// A chunk's `ChunkRange`; `None` for a continuing row.
    #[getter]
    fn range<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyAny>>> {
        match self.row().work {
            RowWork::Chunk { range, .. } => {
                Ok(Some(cached_class(py, &CHUNK_RANGE, "ChunkRange")?.call1(
                    (range.start, range.end, range.total, range.stride),
                )?))
            }
            RowWork::Continue { .. } => Ok(None),
        }
    }
    /// The cached prefix on a first chunk, else 0.
    #[getter]
    fn cached(&self) -> u32 {
        match self.row().work {
            RowWork::Chunk { cached, .. } => cached,
            RowWork::Continue { .. } => 0,
        }
    }
    /// A continuing row's context in tokens; 0 for a chunk.
    #[getter]
    fn context(&self) -> u64 {
        self.row().context
    }
    /// The chunk's input token ids, a read-only `memoryview` (format `I`) over the prepared
    /// input (no copy); `None` for a continuing row.
    #[getter]
    fn input<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyAny>>> {
        match self.row().input.clone() {
            None => Ok(None),
            Some(view) => Ok(Some(
                cached_class(py, &VIEW, "_view")?.call1((Tokens { view },))?,
            )),
        }
    }
    /// The chunk's input as the native view (`address`, `len()`, `span`, `extras()`).
    #[getter]
    fn input_tokens(&self) -> Option<Tokens> {
        self.row().input.clone().map(|view| Tokens { view })
    }
    fn __repr__(&self) -> String {
        let r = self.row();
        match r.work {
            RowWork::Chunk { range, cached } => format!(
                "Row(rid={}, walk={:?}, chunk=[{}, {}) of {}, stride={}, cached={})",
                r.rid,
                &**self.batch.walk_of(r),
                range.start,
                range.end,
                range.total,
                range.stride,
                cached
            ),
            RowWork::Continue { estimate } => format!(
                "Row(rid={}, walk={:?}, continue estimate={})",
                r.rid,
                &**self.batch.walk_of(r),
                estimate
            ),
        }
    }
}

/// What completing a step did.
#[pyclass(module = "mstar_chunking._native", frozen, name = "StepOutcome")]
struct Outcome {
    outcome: StepOutcome,
}

#[pymethods]
impl Outcome {
    #[getter]
    fn step(&self) -> u64 {
        self.outcome.step
    }
    #[getter]
    fn node(&self) -> &str {
        &self.outcome.node
    }
    #[getter]
    fn walk(&self) -> &str {
        &self.outcome.walk
    }
    /// Rids whose final chunk completed (their inputs on the node are released).
    #[getter]
    fn finished(&self) -> Vec<u64> {
        self.outcome.finished.clone()
    }
    #[getter]
    fn chunks(&self) -> u32 {
        self.outcome.chunks
    }
    #[getter]
    fn final_chunks(&self) -> u32 {
        self.outcome.final_chunks
    }
    #[getter]
    fn unrun_chunks(&self) -> u32 {
        self.outcome.unrun_chunks
    }
    #[getter]
    fn scheduled_tokens(&self) -> u64 {
        self.outcome.tokens.scheduled
    }
    #[getter]
    fn ran_tokens(&self) -> u64 {
        self.outcome.tokens.ran
    }
    /// The token overrun (`Overrun`), if the step ran over its budget.
    #[getter]
    fn overrun<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyAny>>> {
        self.outcome
            .overrun
            .as_ref()
            .map(|o| overrun_to_py(py, o))
            .transpose()
    }
    #[getter]
    fn measured_ms(&self) -> Option<f64> {
        self.outcome.measured_ms
    }
    #[getter]
    fn predicted_ms(&self) -> Option<f64> {
        self.outcome.predicted_ms
    }
    #[getter]
    fn max_step_ms(&self) -> Option<f64> {
        self.outcome.max_step_ms
    }
    /// Why the step ran over its time budget, if it did.
    #[getter]
    fn time_overrun(&self) -> Option<&'static str> {
        self.outcome.time_overrun.map(|r| r.as_str())
    }
    fn __repr__(&self) -> String {
        format!(
            "StepOutcome(step={}, chunks={}, finished={:?}, overrun={})",
            self.outcome.step,
            self.outcome.chunks,
            self.outcome.finished,
            self.outcome.overrun.is_some()
        )
    }
}

/// The same step loop as `bench.py`'s Python side, run on the Rust facade directly: `steps`
/// steps of one `budget`-token chunk each (prompts of `prompt_tokens`, re-admitted as they
/// finish) plus `decode_rows` continuing rows. Answers `(steps, seconds)` of the loop alone.
#[pyfunction]
fn _bench_facade(
    py: Python<'_>,
    steps: u64,
    prompt_tokens: u32,
    budget: u32,
    decode_rows: u64,
) -> PyResult<(u64, f64)> {
    let started = py.allow_threads(|| {
        ChunkingManagement::start_on_own_thread(
            "bench-rust",
            [("llm", SubmoduleCaps::new(["prefill", "mixed"], false))],
        )
    });
    let (cm, actors) = started.map_err(|e| to_py_err(py, Failure::Chunking(e)))?;
    let prompt: Arc<[u32]> = (0..prompt_tokens).collect();
    let result = call(py, || async {
        let policy = ChunkingPolicy::budget(budget);
        cm.set_policies([(("llm", "prefill"), policy), (("llm", "mixed"), policy)])
            .await?;
        cm.set_budgets(
            BudgetSettings::new(["prefill", "decode", "mixed"])
                .combined("mixed", ["prefill", "decode"]),
        )
        .await?;
        let decode_base = 1u64 << 40;
        for d in 0..decode_rows {
            cm.continue_row(decode_base + d, "llm", "decode", 1).await?;
        }
        let mut rid = 0u64;
        cm.admit(
            rid,
            "llm",
            "prefill",
            PreparedInput::tokens(prompt.clone()),
            0,
        )
        .await?;
        let t0 = Instant::now();
        for _ in 0..steps {
            let b = cm.assemble("llm", "mixed").await?;
            let ran: Vec<u32> = b.rows.iter().map(|r| r.tokens()).collect();
            let out = cm.complete(b.step, ran).await?;
            if out.finished.contains(&rid) {
                cm.forget_request(rid).await?;
                rid += 1;
                cm.admit(
                    rid,
                    "llm",
                    "prefill",
                    PreparedInput::tokens(prompt.clone()),
                    0,
                )
                .await?;
            }
        }
        Ok((steps, t0.elapsed().as_secs_f64()))
    });
    py.allow_threads(|| actors.stop());
    result
}

/// A Rust error of `kind` (`timeout` only) converted as every call converts its errors: the
/// facade's timeout cannot be provoked deterministically from a test.
#[pyfunction]
fn _error_for_test(py: Python<'_>, kind: &str) -> PyResult<PyObject> {
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
fn _panic_for_test(py: Python<'_>) -> PyResult<()> {
    call(py, || async {
        if std::hint::black_box(true) {
            panic!("injected");
        }
        Ok(())
    })
}

/// The native part of `mstar_chunking`.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Engine>()?;
    m.add_class::<Tokens>()?;
    m.add_class::<StepBatch>()?;
    m.add_class::<Row>()?;
    m.add_class::<Outcome>()?;
    m.add_function(wrap_pyfunction!(_bench_facade, m)?)?;
    m.add_function(wrap_pyfunction!(_error_for_test, m)?)?;
    m.add_function(wrap_pyfunction!(_panic_for_test, m)?)?;
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
