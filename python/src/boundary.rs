//! The boundary every call crosses: the future run on the calling thread, panics caught, the process
//! the actors live in (a forked child has no actors' thread), Rust errors turned into the
//! exception classes of `mstar_chunking._errors`, and arguments checked with errors that name
//! them.

use std::collections::BTreeSet;
use std::future::Future;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use mstar_chunking::budget::SettingKey;
use mstar_chunking::policy::Name;
use mstar_chunking::{ChunkingError, ErrorKind};
use pyo3::exceptions::PyValueError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::sync::GILOnceCell;
use pyo3::types::{PyList, PyTuple};

/// Wakes the thread that polls a future by unparking it.
struct Unpark(std::thread::Thread);

impl Wake for Unpark {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.0.unpark();
    }
}

thread_local! {
    /// The waker of the calling thread's futures: it unparks the thread.
    static WAKER: Waker = Waker::from(Arc::new(Unpark(std::thread::current())));
}

/// Runs `fut` to completion on the calling thread, parked while it waits, or until `timeout`
/// has passed since it first waited (then `None`, the future dropped). The facade's futures
/// need no runtime of the caller's: what they await are channels to the actors' thread. A
/// plain park per wait costs less than entering a runtime per call.
fn block_on<F: Future>(fut: F, timeout: Option<Duration>) -> Option<F::Output> {
    let mut fut = std::pin::pin!(fut);
    WAKER.with(|waker| {
        let mut cx = Context::from_waker(waker);
        // The deadline, read from the clock when the future first waits (its message sent),
        // not before; `Some(None)`: a timeout too long for the clock, no limit.
        let mut deadline: Option<Option<Instant>> = None;
        loop {
            if let Poll::Ready(out) = fut.as_mut().poll(&mut cx) {
                return Some(out);
            }
            // A wake-up that came before the park makes it return at once; a spurious one
            // polls again.
            let Some(timeout) = timeout else {
                std::thread::park();
                continue;
            };
            let now = Instant::now();
            match *deadline.get_or_insert_with(|| now.checked_add(timeout)) {
                None => std::thread::park(),
                Some(until) if now >= until => return None,
                Some(until) => std::thread::park_timeout(until - now),
            }
        }
    })
}

/// The most names [`name`] keeps: an engine names a few nodes and walks; past this many, a
/// name is allocated per call as before.
const NAMES_KEPT: usize = 64;

/// `s` as a [`Name`], the same `Arc` every time for the first [`NAMES_KEPT`] names seen: the
/// node and walk a step names from Python (a `(node, walk)` pair, a `NextStep`) allocate no
/// name per call.
pub(crate) fn name(s: &str) -> Name {
    static NAMES: Mutex<BTreeSet<Name>> = Mutex::new(BTreeSet::new());
    let mut names = NAMES.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(kept) = names.get(s) {
        return kept.clone();
    }
    let new = Name::from(s);
    if names.len() < NAMES_KEPT {
        names.insert(new.clone());
    }
    new
}

/// `(node, walk)` from a pair of `str`s (a `tuple`, as `extract::<(String, String)>` takes),
/// as kept names; `None` for anything else.
pub(crate) fn name_pair(pair: &Bound<'_, PyAny>) -> Option<(Name, Name)> {
    let pair = pair.downcast::<PyTuple>().ok()?;
    if pair.len() != 2 {
        return None;
    }
    let item = |i| -> Option<Name> {
        let item = pair.get_borrowed_item(i).ok()?;
        Some(name(
            item.downcast::<pyo3::types::PyString>()
                .ok()?
                .to_str()
                .ok()?,
        ))
    };
    Some((item(0)?, item(1)?))
}

/// The actor a timeout names: the engine's calls time their whole wait for the actors (one
/// call may ask several), not one actor's answer.
pub(crate) const TIMED_OUT_ACTOR: &str = "chunking";

/// What a blocking call can fail with before it becomes a Python exception.
pub(crate) enum Failure {
    Chunking(ChunkingError),
    /// A panic in the Rust code.
    Internal(String),
}

impl From<ChunkingError> for Failure {
    fn from(e: ChunkingError) -> Self {
        Failure::Chunking(e)
    }
}

/// Runs `make()`'s future to completion with the GIL released, waiting at most `timeout`
/// (`None`: for ever) for it: then the future is dropped, as the facade drops a request that
/// timed out, and the answer is [`ChunkingError::Timeout`]. Timed here, on the calling thread,
/// rather than by the facade on the actors' runtime: a call then sends the actors one message,
/// with no timer task beside it. A panic is caught here.
pub(crate) fn block_within<T, F, Fut>(
    py: Python<'_>,
    timeout: Option<Duration>,
    make: F,
) -> Result<T, Failure>
where
    F: FnOnce() -> Fut + Send,
    Fut: Future<Output = Result<T, ChunkingError>>,
    T: Send,
{
    py.allow_threads(|| {
        answer_of(
            catch_unwind(AssertUnwindSafe(|| block_on(make(), timeout))),
            timeout,
        )
    })
}

/// A blocking call's answer from how its wait ended: the future's answer, `None` when
/// `timeout` ran out first ([`ChunkingError::Timeout`]), or a panic caught while it ran.
pub(crate) fn answer_of<T>(
    ran: std::thread::Result<Option<Result<T, ChunkingError>>>,
    timeout: Option<Duration>,
) -> Result<T, Failure> {
    match ran {
        Ok(Some(answer)) => answer.map_err(Failure::from),
        Ok(None) => Err(Failure::Chunking(ChunkingError::Timeout {
            actor: TIMED_OUT_ACTOR,
            after: timeout.unwrap_or_default(),
        })),
        Err(panic) => Err(Failure::Internal(panic_message(&*panic))),
    }
}

/// `whole`, the value named by `what()` only when it is refused: no name is made for each
/// item of a list read on a step's path.
pub(crate) fn whole_named<T>(
    py: Python<'_>,
    what: impl FnOnce() -> String,
    value: &Bound<'_, PyAny>,
) -> PyResult<T>
where
    T: for<'a> FromPyObject<'a> + num_max::Max,
{
    whole::<T>(py, "", value).or_else(|_| whole::<T>(py, &what(), value))
}

/// `block_within`, with the failure turned into its Python exception.
pub(crate) fn call_within<T, F, Fut>(
    py: Python<'_>,
    timeout: Option<Duration>,
    make: F,
) -> PyResult<T>
where
    F: FnOnce() -> Fut + Send,
    Fut: Future<Output = Result<T, ChunkingError>>,
    T: Send,
{
    block_within(py, timeout, make).map_err(|f| to_py_err(py, f))
}

/// `block`, with the failure turned into its Python exception.
pub(crate) fn call<T, F, Fut>(py: Python<'_>, make: F) -> PyResult<T>
where
    F: FnOnce() -> Fut + Send,
    Fut: Future<Output = Result<T, ChunkingError>>,
    T: Send,
{
    call_within(py, None, make)
}

pub(crate) fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    let what = panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_owned());
    format!("internal error in mstar_chunking (a Rust panic, caught): {what}")
}

/// Forks of this process that Python was told of (`os.register_at_fork`'s `after_in_child`,
/// which `os.fork`, `multiprocessing` and `PyOS_AfterFork_Child` run): a child counts one more
/// than its parent.
static FORKS: AtomicU64 = AtomicU64::new(0);

/// Counts a fork in the child (registered with `os.register_at_fork` when the module loads).
#[pyfunction]
pub(crate) fn _after_fork_in_child() {
    FORKS.fetch_add(1, Ordering::Relaxed);
}

/// The process that started a manager's actors. A forked child inherits the handle but not the
/// actors' thread: its calls would wait for an answer that never comes, and stopping the
/// thread would join a thread that does not exist there. Told by the forks counted (an atomic
/// load per call, where asking the process id is a system call), with the process id for the
/// message.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Owner {
    pid: u32,
    forks: u64,
}

impl Owner {
    pub(crate) fn here() -> Self {
        Self {
            pid: std::process::id(),
            forks: FORKS.load(Ordering::Relaxed),
        }
    }

    /// Whether this is the process that started the actors.
    pub(crate) fn is_here(self) -> bool {
        FORKS.load(Ordering::Relaxed) == self.forks
    }

    /// `Ok` in the process that started the actors; in a forked child, `ActorsStoppedError`.
    pub(crate) fn check(self, py: Python<'_>) -> PyResult<()> {
        if self.is_here() {
            return Ok(());
        }
        Err(error(
            py,
            "ActorsStoppedError",
            &format!(
                "this ChunkingManagement was started in process {} and this is a forked child (process {}): the actors' thread does not exist here; create a new ChunkingManagement in the child",
                self.pid,
                std::process::id()
            ),
        ))
    }
}

/// A class of the pure-Python part of the package (`mstar_chunking._types` / `._errors`).
pub(crate) fn py_attr<'py>(
    py: Python<'py>,
    module: &str,
    name: &str,
) -> PyResult<Bound<'py, PyAny>> {
    py.import(module)?.getattr(name)
}

/// A class of `mstar_chunking._types`, looked up once.
pub(crate) fn cached_class<'py>(
    py: Python<'py>,
    cell: &'static GILOnceCell<Py<PyAny>>,
    name: &str,
) -> PyResult<&'py Bound<'py, PyAny>> {
    cell.get_or_try_init(py, || {
        Ok::<_, PyErr>(py_attr(py, "mstar_chunking._types", name)?.unbind())
    })
    .map(|c| c.bind(py))
}

/// An exception of class `class` (of `mstar_chunking._errors`) with `message`.
pub(crate) fn error(py: Python<'_>, class: &str, message: &str) -> PyErr {
    match py_attr(py, "mstar_chunking._errors", class).and_then(|c| c.call1((message,))) {
        Ok(exc) => PyErr::from_value(exc),
        Err(e) => e,
    }
}

/// An `InvalidRequestError` with `message`.
pub(crate) fn invalid(py: Python<'_>, message: &str) -> PyErr {
    error(py, "InvalidRequestError", message)
}

/// The exception class for `e`'s kind; a timeout is a `TimeoutError`, a refused time budget,
/// latency model or margin a `TimeSettingsError`.
fn error_class(e: &ChunkingError) -> &'static str {
    match e {
        ChunkingError::Timeout { .. } => return "ChunkingTimeoutError",
        ChunkingError::Budget(b) => {
            let timed = b.0.iter().filter_map(|p| p.subject()).any(|s| {
                matches!(
                    s.setting,
                    SettingKey::MaxStepMs | SettingKey::Cost | SettingKey::TimeMargin
                )
            });
            if timed {
                return "TimeSettingsError";
            }
        }
        _ => {}
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

/// The `set_budgets` argument a refused setting came from.
pub(crate) fn argument_of(setting: SettingKey) -> &'static str {
    match setting {
        SettingKey::MaxBatchTokens => "overrides",
        other => other.key(),
    }
}

/// `(argument, node, walk)` of each refused setting, in order (`None` where the refusal is
/// about no one setting, node or walk).
type Refusal = (Option<&'static str>, Option<String>, Option<String>);

/// The Python exception for a failure: the class by kind, the Rust message, and `kind`,
/// `retryable`, `problems` (each refused setting's message) and `refusals` (each one's
/// `(argument, node, walk)`, with the first one's as `argument`, `node` and `walk`).
pub(crate) fn to_py_err(py: Python<'_>, f: Failure) -> PyErr {
    let made = (|| -> PyResult<PyErr> {
        let mut refusals: Vec<Refusal> = Vec::new();
        let (class, message, kind, retryable, problems) = match &f {
            Failure::Chunking(e) => {
                let problems: Vec<String> = match e {
                    ChunkingError::Budget(b) => {
                        refusals =
                            b.0.iter()
                                .map(|p| match p.subject() {
                                    Some(s) => (
                                        Some(argument_of(s.setting)),
                                        s.node.map(ToString::to_string),
                                        s.walk.map(ToString::to_string),
                                    ),
                                    None => (None, None, None),
                                })
                                .collect();
                        b.0.iter().map(ToString::to_string).collect()
                    }
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
        if !refusals.is_empty() {
            let first = refusals
                .iter()
                .find(|r| r.0.is_some())
                .cloned()
                .unwrap_or((None, None, None));
            exc.setattr("argument", first.0)?;
            exc.setattr("node", first.1)?;
            exc.setattr("walk", first.2)?;
            let list = PyList::empty(py);
            for r in refusals {
                list.append(PyTuple::new(
                    py,
                    [
                        r.0.into_pyobject(py)?.into_any(),
                        r.1.into_pyobject(py)?.into_any(),
                        r.2.into_pyobject(py)?.into_any(),
                    ],
                )?)?;
            }
            exc.setattr("refusals", list)?;
        }
        Ok(PyErr::from_value(exc))
    })();
    made.unwrap_or_else(|e| e)
}

/// A request timeout in seconds as `Duration` (`None`: no limit), or a `ValueError` naming
/// `timeout`: a finite number above 0 that a `Duration` can hold.
pub(crate) fn timeout_arg(timeout: Option<f64>) -> PyResult<Option<Duration>> {
    let Some(t) = timeout else { return Ok(None) };
    let refused = || {
        PyValueError::new_err(format!(
            "timeout must be a finite number of seconds above 0 (at most {}), or None, got {t}",
            u64::MAX
        ))
    };
    if !(t.is_finite() && t > 0.0) {
        return Err(refused());
    }
    Duration::try_from_secs_f64(t)
        .map(Some)
        .map_err(|_| refused())
}

/// A whole number `what` between 0 and `T::MAX`, or an `InvalidRequestError` naming it.
pub(crate) fn whole<T>(py: Python<'_>, what: &str, value: &Bound<'_, PyAny>) -> PyResult<T>
where
    T: for<'a> FromPyObject<'a> + num_max::Max,
{
    if value.is_instance_of::<pyo3::types::PyBool>()
        || !value.is_instance_of::<pyo3::types::PyInt>()
    {
        return Err(invalid(
            py,
            &format!(
                "{what} must be a whole number (int) between 0 and {}, got {}",
                T::MAX_TEXT,
                short_repr(value)
            ),
        ));
    }
    value.extract::<T>().map_err(|_| {
        invalid(
            py,
            &format!(
                "{what} must be between 0 and {}, got {}",
                T::MAX_TEXT,
                short_repr(value)
            ),
        )
    })
}

/// The largest value of the unsigned types arguments are checked against, as text.
pub(crate) mod num_max {
    pub(crate) trait Max {
        const MAX_TEXT: &'static str;
    }
    impl Max for u32 {
        const MAX_TEXT: &'static str = "4294967295";
    }
    impl Max for u64 {
        const MAX_TEXT: &'static str = "18446744073709551615";
    }
}

/// `ran` as a `list` of `int`s (exactly those types, as `Batch.planned()` makes), read item by
/// item without an iterator or a new reference; `None` for anything else, or an item out of
/// range, which the general path reads (or refuses, naming it).
fn ran_list(ran: &Bound<'_, PyAny>) -> Option<Vec<u32>> {
    list_u32(ran.downcast_exact::<PyList>().ok()?)
}

/// `ran`: one whole number of tokens per row, or an `InvalidRequestError` naming the entry.
pub(crate) fn ran_arg(py: Python<'_>, ran: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    if let Some(v) = ran_list(ran) {
        return Ok(v);
    }
    if ran.is_instance_of::<pyo3::types::PyString>() || ran.try_iter().is_err() {
        return Err(invalid(
            py,
            &format!(
                "ran must be a sequence of whole numbers of tokens, one per row, got {}",
                short_repr(ran)
            ),
        ));
    }
    // Any other sequence, item by item: an int of any kind (a subclass, numpy's), not a bool.
    let mut out = Vec::new();
    for (i, item) in ran.try_iter()?.enumerate() {
        let item = item?;
        let v = if item.is_instance_of::<pyo3::types::PyBool>() {
            None
        } else {
            item.extract::<u32>().ok()
        };
        match v {
            Some(v) => out.push(v),
            None => {
                return Err(invalid(
                    py,
                    &format!(
                        "ran[{i}] must be a whole number (int) between 0 and {}, got {}",
                        u32::MAX,
                        short_repr(&item)
                    ),
                ))
            }
        }
    }
    Ok(out)
}

/// A measured step time: a finite number of ms ≥ 0 (or `None`), else an `InvalidRequestError`
/// naming `measured_ms`.
pub(crate) fn measured_arg(py: Python<'_>, ms: Option<&Bound<'_, PyAny>>) -> PyResult<Option<f64>> {
    let Some(ms) = ms.filter(|m| !m.is_none()) else {
        return Ok(None);
    };
    let v = if ms.is_instance_of::<pyo3::types::PyBool>() {
        None
    } else {
        ms.extract::<f64>().ok()
    };
    match v {
        Some(v) if v.is_finite() && v >= 0.0 => Ok(Some(v)),
        _ => Err(invalid(
            py,
            &format!(
                "measured_ms must be a finite number of ms >= 0, or None, got {}",
                short_repr(ms)
            ),
        )),
    }
}

/// A time on the engine's clock in ms (`arrival_ms`, `at_ms`): any finite number (the clock's
/// origin is the engine's), or `None`; else an `InvalidRequestError` naming `what`.
pub(crate) fn clock_arg(
    py: Python<'_>,
    what: &str,
    ms: Option<&Bound<'_, PyAny>>,
) -> PyResult<Option<f64>> {
    let Some(ms) = ms.filter(|m| !m.is_none()) else {
        return Ok(None);
    };
    let v = if ms.is_instance_of::<pyo3::types::PyBool>() {
        None
    } else {
        ms.extract::<f64>().ok()
    };
    match v {
        Some(v) if v.is_finite() => Ok(Some(v)),
        _ => Err(invalid(
            py,
            &format!(
                "{what} must be a finite number of ms on the engine's clock, or None, got {}",
                short_repr(ms)
            ),
        )),
    }
}

/// A prompt's priority: a whole number between -2147483648 and 2147483647 (lower runs first
/// under the `priority` order), `None` for 0; else an `InvalidRequestError` naming `priority`.
pub(crate) fn priority_arg(py: Python<'_>, value: Option<&Bound<'_, PyAny>>) -> PyResult<i32> {
    let Some(value) = value.filter(|v| !v.is_none()) else {
        return Ok(0);
    };
    let refused = || {
        invalid(
            py,
            &format!(
                "priority must be a whole number (int) between {} and {}, got {}",
                i32::MIN,
                i32::MAX,
                short_repr(value)
            ),
        )
    };
    if value.is_instance_of::<pyo3::types::PyBool>()
        || !value.is_instance_of::<pyo3::types::PyInt>()
    {
        return Err(refused());
    }
    value.extract::<i32>().map_err(|_| refused())
}

/// `repr(value)`, cut to 80 characters.
pub(crate) fn short_repr(value: &Bound<'_, PyAny>) -> String {
    let r = value
        .repr()
        .map(|r| r.to_string())
        .unwrap_or_else(|_| "<unprintable>".to_owned());
    if r.chars().count() > 80 {
        format!("{}…", r.chars().take(80).collect::<String>())
    } else {
        r
    }
}

/// A name as Python writes it: `'llm'`.
pub(crate) fn py_repr_str(py: Python<'_>, s: &str) -> String {
    pyo3::types::PyString::new(py, s)
        .repr()
        .map(|r| r.to_string())
        .unwrap_or_else(|_| format!("'{s}'"))
}

/// `Some(x)` as `x`, `None` as `None`: an optional value as Python writes it.
pub(crate) fn py_opt<T: std::fmt::Display>(v: Option<T>) -> String {
    v.map_or_else(|| "None".to_owned(), |x| x.to_string())
}

/// `true` as `True`.
pub(crate) fn py_bool(b: bool) -> &'static str {
    if b {
        "True"
    } else {
        "False"
    }
}

/// The items of `list` as `u32`s when every one is an `int` (exactly) from 0 to `u32::MAX`;
/// `None` otherwise (nothing raised: the caller converts the list another way). An item that
/// is the same object as the one before it (a run of small ints, as decode rows' `1`s are)
/// is not converted again: an `int` does not change.
pub(crate) fn list_u32(list: &Bound<'_, PyList>) -> Option<Vec<u32>> {
    let n = list.len();
    let mut ids = Vec::with_capacity(n);
    let mut last: (*mut ffi::PyObject, u32) = (std::ptr::null_mut(), 0);
    for i in 0..n {
        // SAFETY: `list` is a live list, and `i` is below the length read with the GIL held
        // (nothing here runs Python code that could shrink it); `PyList_GetItem` answers a
        // borrowed reference, used before anything else touches the list (`last` only compares
        // the address of an item the list still holds). A conversion that fails sets an error,
        // fetched (cleared) here before `None` is answered.
        let id = unsafe {
            let item = ffi::PyList_GetItem(list.as_ptr(), i as ffi::Py_ssize_t);
            if item.is_null() {
                ffi::PyErr_Clear();
                return None;
            }
            if item == last.0 {
                last.1
            } else {
                if ffi::PyLong_CheckExact(item) == 0 {
                    return None;
                }
                let v = ffi::PyLong_AsUnsignedLong(item);
                if v == std::os::raw::c_ulong::MAX && !ffi::PyErr_Occurred().is_null() {
                    ffi::PyErr_Clear();
                    return None;
                }
                let v = u32::try_from(v).ok()?;
                last = (item, v);
                v
            }
        };
        ids.push(id);
    }
    Some(ids)
}
