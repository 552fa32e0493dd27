//! `Engine`: one model's chunking actors on a thread of their own, the handle
//! `ChunkingManagement` wraps, with every call of the facade; `NextStep`, the row changes a
//! one-trip step carries; token ids taken from Python.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::CString;
use std::mem::ManuallyDrop;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use mstar_chunking::budget::OrderSettings;
use mstar_chunking::policy::Name;
use mstar_chunking::scheduler::RowChangeRef;
use mstar_chunking::{
    ActorThread, AdmitOptions, ChunkingError, ChunkingManagement, ChunkingPolicy, NextStep, Order,
    Overrun, OverrunReason, PreparedInput, SubmoduleCaps, Then,
};
use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{PyRuntimeWarning, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyString};

use crate::boundary::{
    block_within, call_within, clock_arg, invalid, list_u32, measured_arg, name, name_pair,
    panic_message, priority_arg, py_attr, py_repr_str, ran_arg, timeout_arg, to_py_err, whole,
    whole_named, Failure, Owner,
};
use crate::settings::{drain_to_py, model_to_py, BudgetArgs, CostArg, PerWalk};
use crate::steps::{keyed_columns, overrun_to_py, Completed, Outcome, StepBatch, Tokens};

/// The logger overruns are reported to (`logging.getLogger("mstar_chunking")`).
const LOGGER: &str = "mstar_chunking";

/// Logs an overrun through Python's `logging` when it is the 1st, 2nd, 4th, … of its
/// `(node, walk)` (`count`: the overruns counted there so far, this one included). A failure
/// of the logging call is reported as an unraisable exception (`sys.unraisablehook`), never
/// raised: the step it reports on stands, and its outcome is the caller's answer.
fn log_overrun(py: Python<'_>, o: &Overrun, count: u64) {
    if !count.is_power_of_two() {
        return;
    }
    let logged = (|| -> PyResult<()> {
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
    })();
    if let Err(e) = logged {
        let what = PyString::new(
            py,
            "logging an overrun of mstar_chunking (the step completed)",
        );
        e.write_unraisable(py, Some(what.as_any()));
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A prompt's token ids from Python: a buffer of native `uint32`s read as it is, anything else
/// converted by `mstar_chunking._types._token_array` (lists, ranges, other integer buffers,
/// `uint32` of the other byte order). Text is refused: it must be tokenized first.
pub(crate) fn token_ids(
    py: Python<'_>,
    rid: u64,
    node: &str,
    tokens: &Bound<'_, PyAny>,
) -> PyResult<Arc<[u32]>> {
    if tokens.is_instance_of::<PyString>() {
        return Err(invalid(
            py,
            &format!("rid {rid} on `{node}`: a prompt is token ids, not text (got a str): tokenize it first, e.g. tokenizer.encode(text)"),
        ));
    }
    // pyo3 takes `>I` for `u32` whatever the machine's byte order: the format is checked here.
    const NATIVE: &[u8] = if cfg!(target_endian = "little") {
        b"<I"
    } else {
        b">I"
    };
    // A list of ints (vLLM's prompts are lists) is read item by item here, a few ns each: the
    // converter takes several times as long. Anything in it that is not an int in range goes
    // to the converter, which accepts or refuses it with its error.
    if let Ok(list) = tokens.downcast::<PyList>() {
        if let Some(ids) = list_u32(list) {
            return Ok(ids.into());
        }
    }
    if let Ok(buf) = PyBuffer::<u32>::get(tokens) {
        let format = buf.format().to_bytes();
        let native = matches!(format, b"I" | b"@I" | b"=I") || format == NATIVE;
        if native && buf.dimensions() == 1 {
            // One allocation and one copy, into the `Arc` the actors hold.
            return Ok(match buf.as_slice(py) {
                Some(ids) => ids.iter().map(|c| c.get()).collect(),
                None => buf.to_vec(py)?.into(),
            });
        }
    }
    // Anything else (and a buffer that is not aligned for `u32`s) goes through the converter,
    // whose array's bytes are read as native `u32`s.
    let converted =
        py_attr(py, "mstar_chunking._types", "_token_array")?.call1((rid, node, tokens))?;
    let bytes = converted.call_method0("tobytes")?;
    let bytes = bytes.downcast::<PyBytes>()?.as_bytes();
    Ok(bytes
        .chunks_exact(4)
        .map(|b| u32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
        .collect())
}

/// The `(rid, node)` keys admitted through one [`Engine`], each with its admission's number.
/// By rid (an engine's prompts live on one node or a few), so that recording one and
/// forgetting a request compare integers, not names, however many are held.
#[derive(Default)]
struct Admitted {
    keys: BTreeMap<u64, Vec<(Name, u64)>>,
    next: u64,
}

impl Admitted {
    /// Records `(rid, node)`: a clone of a `Name` the caller has allocates nothing.
    fn insert(&mut self, rid: u64, node: Name) {
        self.next += 1;
        let n = self.next;
        let nodes = self.keys.entry(rid).or_default();
        match nodes.iter_mut().find(|(m, _)| *m == node) {
            Some(slot) => slot.1 = n,
            None => nodes.push((node, n)),
        }
    }

    /// Every `((rid, node), admission)`, by rid then node.
    fn all(&self) -> Vec<((u64, Name), u64)> {
        let mut out: Vec<((u64, Name), u64)> = self
            .keys
            .iter()
            .flat_map(|(rid, nodes)| nodes.iter().map(|(m, n)| ((*rid, m.clone()), *n)))
            .collect();
        out.sort_unstable();
        out
    }

    /// Drops `(rid, node)`, if it is still admission `n` (any admission: `None`).
    fn remove(&mut self, rid: u64, node: &str, n: Option<u64>) {
        if let Some(nodes) = self.keys.get_mut(&rid) {
            nodes.retain(|(m, k)| !(&**m == node && n.is_none_or(|n| n == *k)));
            if nodes.is_empty() {
                self.keys.remove(&rid);
            }
        }
    }
}

/// One model's chunking actors, on a thread of their own (`ChunkingManagement` in Python wraps
/// it). Frozen: every method takes `&self`, so calls from several Python threads run at once.
#[pyclass(module = "mstar_chunking._native", frozen)]
pub(crate) struct Engine {
    /// Never dropped in a forked child (see `Drop`).
    cm: ManuallyDrop<ChunkingManagement>,
    /// The actors' own thread; `None` with `caller_thread` (then `caller` runs them) and once
    /// closed.
    actors: Mutex<Option<ActorThread>>,
    /// With `caller_thread`: the actors' System, run by each call on the thread that made the
    /// engine.
    caller: Option<CallerSystem>,
    owner: Owner,
    /// `(rid, node)` admitted and perhaps still held, with the admission's number: the public
    /// API answers whether one key is held, not which are, so iterating `prepared` checks these
    /// (and drops a key found gone only if it was not admitted again meanwhile).
    admitted: Mutex<Admitted>,
    /// How long a call waits for the actors (`None`: for ever), timed on the calling thread
    /// (the facade's own timeout is off: see `boundary::block_within`).
    timeout: Option<Duration>,
    /// The orders set last (`set_budgets`, `from_config`) and the nodes warned about a priority
    /// given where it orders nothing.
    orders: Mutex<Orders>,
}

/// The nodes' orders as set through this engine, to warn (once per node) about a priority given
/// where the node's order is not `priority`, without asking the actors.
#[derive(Default)]
struct Orders {
    nodes: Vec<String>,
    settings: OrderSettings,
    warned: BTreeSet<String>,
}

impl Orders {
    /// The warning to give for a priority given to `rid` on `node` (a node of this engine),
    /// once per node: `None` when the priority is 0, the node orders by priority, or the node
    /// was warned about before (from now on it counts as warned).
    fn warning(&mut self, rid: u64, node: &str, priority: i32) -> Option<CString> {
        if priority == 0 || !self.nodes.iter().any(|n| n == node) {
            return None;
        }
        let order = self.settings.of(node).order;
        if order == Order::Priority || self.warned.contains(node) {
            return None;
        }
        self.warned.insert(node.to_owned());
        CString::new(format!(
            "priority {priority} given to rid {rid} on node `{node}`, whose order is `{order}`, not `priority`: it is kept but does not change the order there (set_budgets(..., order=\"priority\")); warned once per node"
        ))
        .ok()
    }
}

/// Warns, as a `RuntimeWarning` from the caller's line, about each priority given where it
/// orders nothing (`rids`: `(rid, priority)` admitted on `node`), once per node. A warning
/// filter that turns it into an error raises it (before anything is sent to the actors).
fn warn_priorities(
    py: Python<'_>,
    orders: &Mutex<Orders>,
    node: &str,
    rids: impl IntoIterator<Item = (u64, i32)>,
) -> PyResult<()> {
    let mut rids = rids.into_iter().filter(|&(_, p)| p != 0).peekable();
    if rids.peek().is_none() {
        return Ok(());
    }
    let warnings: Vec<CString> = {
        let mut o = lock(orders);
        rids.filter_map(|(rid, p)| o.warning(rid, node, p))
            .collect()
    };
    if warnings.is_empty() {
        return Ok(());
    }
    let category = py.get_type::<PyRuntimeWarning>();
    for w in warnings {
        PyErr::warn(py, category.as_any(), &w, 1)?;
    }
    Ok(())
}

/// The actors' actix System when they run on the calling thread (`caller_thread=True`): each
/// call runs it until its answer is there, on the thread that made the engine, with the GIL
/// held; between two calls nothing runs. No thread is woken and none waits for another.
struct CallerSystem {
    /// `None` once closed.
    runner: Mutex<Option<actix::SystemRunner>>,
    thread: std::thread::ThreadId,
}

// SAFETY: the runner (a tokio runtime and local task set, neither `Send` nor `Sync`) is only
// touched on `thread`, the thread that made it: every use checks the calling thread first
// (`CallerSystem::runner`), and a drop elsewhere leaks it (`Engine`'s `Drop`). The mutex
// only keeps a second use on the same thread from overlapping the first (it cannot: no
// Python code runs during a call).
unsafe impl Send for CallerSystem {}
unsafe impl Sync for CallerSystem {}

impl CallerSystem {
    /// The runner (`None` once closed), on the thread that made it: elsewhere, the error to
    /// raise.
    fn runner<'a>(
        &'a self,
        py: Python<'_>,
    ) -> PyResult<std::sync::MutexGuard<'a, Option<actix::SystemRunner>>> {
        if std::thread::current().id() != self.thread {
            return Err(crate::boundary::error(
                py,
                "ChunkingError",
                "this ChunkingManagement runs its actors on the thread that made it (caller_thread=True): call it from that thread",
            ));
        }
        let guard = self.runner.try_lock().map_err(|_| {
            crate::boundary::error(
                py,
                "ChunkingError",
                "a call of this ChunkingManagement (caller_thread=True) was made while another was running on the same thread",
            )
        })?;
        Ok(guard)
    }

    /// Runs `make()`'s future on the System until it answers, at most `timeout`. Each turn of
    /// the System's task set runs every task made ready before the future is polled again, so
    /// a message an actor sends another before answering (inputs changed, an overrun counted)
    /// is handled by the time the call returns, as on the actors' own thread; and it is in the
    /// other actor's mailbox ahead of anything a later call sends. A panic is caught here.
    fn call<T, F, Fut>(&self, py: Python<'_>, timeout: Option<Duration>, make: F) -> PyResult<T>
    where
        F: FnOnce() -> Fut,
        Fut: std::future::Future<Output = Result<T, ChunkingError>>,
    {
        let guard = self.runner(py)?;
        let Some(runner) = guard.as_ref() else {
            return Err(to_py_err(py, Failure::Chunking(stopped())));
        };
        let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            runner.block_on(async {
                match timeout {
                    None => Some(make().await),
                    Some(after) => actix::clock::timeout(after, make()).await.ok(),
                }
            })
        }));
        crate::boundary::answer_of(ran, timeout).map_err(|f| to_py_err(py, f))
    }
}

/// What a call of a closed `caller_thread` engine answers.
fn stopped() -> ChunkingError {
    ChunkingError::ActorStopped {
        actor: crate::boundary::TIMED_OUT_ACTOR,
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        if let Some(caller) = self.caller.take() {
            if self.owner.is_here() && std::thread::current().id() == caller.thread {
                // SAFETY: dropped once, here; never used again. The handle goes before the
                // System its actors run on.
                unsafe { ManuallyDrop::drop(&mut self.cm) };
                drop(caller);
            } else {
                // Another thread, or a forked child: the System is only touched on its own
                // thread, so it and the handle are left (their memory is not reclaimed).
                std::mem::forget(caller);
            }
            return;
        }
        if self.owner.is_here() {
            // SAFETY: dropped once, here; never used again.
            unsafe { ManuallyDrop::drop(&mut self.cm) };
            return;
        }
        // A forked child: the actors' thread and runtime are not in this process. Stopping the
        // thread would join a thread that does not exist, and dropping the handle could wake
        // tasks of a runtime nobody runs here: both are left to the parent.
        if let Some(actors) = self.actors.get_mut().ok().and_then(Option::take) {
            std::mem::forget(actors);
        }
    }
}

impl Engine {
    fn start(
        py: Python<'_>,
        model: &str,
        caps: Vec<(String, SubmoduleCaps)>,
        timeout: Option<f64>,
        caller_thread: bool,
    ) -> PyResult<Self> {
        let timeout = timeout_arg(timeout)?;
        let nodes: Vec<String> = caps.iter().map(|(n, _)| n.clone()).collect();
        let started = if caller_thread {
            // The actors' runtime has timers and no I/O driver (`actor_system`): a call then
            // polls no descriptor (an `epoll_wait` per call with one).
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let runner = mstar_chunking::actors::actor_system()?;
                let cm = runner.block_on(async { ChunkingManagement::start(model, caps) })?;
                let caller = CallerSystem {
                    runner: Mutex::new(Some(runner)),
                    thread: std::thread::current().id(),
                };
                Ok((cm, None, Some(caller)))
            }))
        } else {
            py.allow_threads(|| {
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    let (cm, actors) = ChunkingManagement::start_on_own_thread(model, caps)?;
                    Ok((cm, Some(actors), None))
                }))
            })
        };
        let (cm, actors, caller) = started
            .unwrap_or_else(|p| {
                Err(ChunkingError::ThreadStart {
                    reason: panic_message(&*p),
                })
            })
            .map_err(|e| to_py_err(py, Failure::Chunking(e)))?;
        Ok(Self {
            cm: ManuallyDrop::new(cm.with_timeout(None)),
            timeout,
            actors: Mutex::new(actors),
            caller,
            owner: Owner::here(),
            admitted: Mutex::new(Admitted::default()),
            orders: Mutex::new(Orders {
                nodes,
                ..Orders::default()
            }),
        })
    }

    /// Runs `make()`'s future with the GIL released, waiting at most the engine's timeout.
    fn call<T, F, Fut>(&self, py: Python<'_>, make: F) -> PyResult<T>
    where
        F: FnOnce() -> Fut + Send,
        Fut: std::future::Future<Output = Result<T, ChunkingError>>,
        T: Send,
    {
        match &self.caller {
            None => call_within(py, self.timeout, make),
            Some(caller) => caller.call(py, self.timeout, make),
        }
    }

    /// The handle, in the process that started the actors; in a forked child, the error.
    fn cm(&self, py: Python<'_>) -> PyResult<&ChunkingManagement> {
        self.owner.check(py)?;
        Ok(&self.cm)
    }

    /// Completes step `step` and assembles `next` after its row changes, in one round trip:
    /// the core's answer and the overrun count of the completed step's walk. The prompts it
    /// admits are recorded for `prepared_keys` (a key whose admission was refused is dropped
    /// there when found gone), and their priorities checked against the node's order.
    fn one_trip(
        &self,
        py: Python<'_>,
        cm: &ChunkingManagement,
        step: u64,
        ran: Vec<u32>,
        measured_ms: Option<f64>,
        next: NextStep,
    ) -> PyResult<(mstar_chunking::Completed, u64)> {
        let admits: Vec<(u64, i32)> = next
            .row_changes()
            .filter_map(|c| match c {
                RowChangeRef::Admit { rid, priority, .. } => Some((rid, priority)),
                _ => None,
            })
            .collect();
        let node = next.node().clone();
        warn_priorities(py, &self.orders, &node, admits.iter().copied())?;
        let (done, count) = self.call(py, || async {
            let done = cm
                .complete_and_assemble(step, ran, measured_ms, next)
                .await?;
            let count = overrun_count_of(cm, &done.outcome).await?;
            Ok((done, count))
        })?;
        if !admits.is_empty() {
            let mut admitted = lock(&self.admitted);
            for (rid, _) in admits {
                admitted.insert(rid, node.clone());
            }
        }
        Ok((done, count))
    }

    /// Logs a completed step's token overrun, if it had one (`count`: its walk's overruns).
    fn finish_step(py: Python<'_>, outcome: &mstar_chunking::StepOutcome, count: u64) {
        if let Some(o) = &outcome.overrun {
            log_overrun(py, o, count);
        }
    }
}

/// `ran` of step `step`: the tokens each row ran (a sequence of ints), or the step's `Batch`
/// itself for "every row ran its planned tokens" (as `batch.planned()`, without making the
/// list); the `Batch` of another step is refused.
fn ran_of_step(py: Python<'_>, step: u64, ran: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    match ran.downcast::<StepBatch>() {
        Ok(b) => {
            let batch = &b.get().batch;
            if batch.step != step {
                return Err(invalid(
                    py,
                    &format!(
                        "ran is the Batch of step {}, not of step {step}: pass that step's Batch, or the tokens each row ran",
                        batch.step
                    ),
                ));
            }
            Ok(batch.rows.iter().map(|r| r.tokens()).collect())
        }
        Err(_) => ran_arg(py, ran),
    }
}

/// `set_budgets`, answered once the scheduler has taken the new budgets in: the budgets' actor
/// hands them to the scheduler on its own after answering, so a question to the scheduler
/// (answered in its mailbox's order) waits for that. The gauges the scheduler publishes with
/// them (rows, orders, latency models) are then in `render_metrics()`.
async fn set_budgets_seen(
    cm: &ChunkingManagement,
    settings: mstar_chunking::BudgetSettings,
) -> Result<(), ChunkingError> {
    cm.set_budgets(settings).await?;
    cm.queue_stats().await.map(drop)
}

/// The overruns counted for an outcome's `(node, walk)`, when it has one (else 0).
async fn overrun_count_of(
    cm: &ChunkingManagement,
    outcome: &mstar_chunking::StepOutcome,
) -> Result<u64, ChunkingError> {
    match &outcome.overrun {
        Some(o) => cm.overrun_count(&o.node, &o.walk, None).await,
        None => Ok(0),
    }
}

#[pymethods]
impl Engine {
    /// Starts the actors of `model` for `submodules`, `[(node, chunkable_walks,
    /// can_override_mixed_max_tokens)]`; `timeout` in seconds (`None`: wait for ever).
    #[new]
    #[pyo3(signature = (model, submodules, timeout=Some(5.0), caller_thread=false))]
    fn new(
        py: Python<'_>,
        model: String,
        submodules: Vec<(String, Vec<String>, bool)>,
        timeout: Option<f64>,
        caller_thread: bool,
    ) -> PyResult<Self> {
        let caps = submodules
            .into_iter()
            .map(|(n, w, o)| (n, SubmoduleCaps::new(w, o)))
            .collect();
        Self::start(py, &model, caps, timeout, caller_thread)
    }

    /// Loads the model manifest and the layered serving config as the binary does (`paths`
    /// as `--config FILE`s, `manifest` as `--model FILE`, `./config`, `$MSTAR_ENV` and
    /// `MSTAR__…` variables), starts the actors and applies the model's policies and the
    /// config's `[chunking]`. Answers the engine and what was loaded.
    #[staticmethod]
    #[pyo3(signature = (paths, model=None, manifest=None, timeout=Some(5.0), caller_thread=false))]
    fn from_config<'py>(
        py: Python<'py>,
        paths: Vec<PathBuf>,
        model: Option<String>,
        manifest: Option<PathBuf>,
        timeout: Option<f64>,
        caller_thread: bool,
    ) -> PyResult<(Self, Bound<'py, PyDict>)> {
        use mstar_chunking::config::{load, LoadOptions};
        timeout_arg(timeout)?;
        let opts = LoadOptions::from_process(manifest, paths);
        let loaded = py.allow_threads(|| load(&opts)).map_err(|errors| {
            let lines = errors.lines();
            let e = crate::boundary::error(
                py,
                "ConfigError",
                &format!("the config did not load:\n  {}", lines.join("\n  ")),
            );
            let _ = e.value(py).setattr("problems", lines);
            e
        })?;
        let model = model.unwrap_or_else(|| loaded.manifest.name.clone());
        let caps: Vec<(String, SubmoduleCaps)> = loaded
            .manifest
            .submodules()
            .into_iter()
            .map(|(n, c)| (n.to_string(), c))
            .collect();
        let engine = Self::start(py, &model, caps, timeout, caller_thread)?;
        let policies: Vec<((String, String), ChunkingPolicy)> = loaded
            .manifest
            .policies()
            .into_iter()
            .map(|((n, w), p)| ((n.to_string(), w.to_string()), p))
            .collect();
        let budgets = loaded.manifest.budget_settings(&loaded.settings.chunking);
        let orders = budgets.order.clone();
        engine.call(py, || async {
            engine.cm.set_policies(policies).await?;
            set_budgets_seen(&engine.cm, budgets).await
        })?;
        lock(&engine.orders).settings = orders;
        let info = PyDict::new(py);
        let nodes: Vec<&String> = loaded.manifest.nodes.keys().collect();
        info.set_item("nodes", nodes)?;
        info.set_item("model", &model)?;
        info.set_item("manifest", &loaded.model_origin)?;
        info.set_item("layers", &loaded.layers)?;
        info.set_item("warnings", &loaded.warnings)?;
        info.set_item("walks", &loaded.manifest.walks)?;
        info.set_item("combined_walk", loaded.manifest.combined_walk())?;
        info.set_item("slots_per_row", loaded.settings.chunking.slots_per_row)?;
        let listen = match loaded.settings.metrics.listen {
            mstar_chunking::config::Listen::Off => None,
            mstar_chunking::config::Listen::Addr(a) => Some(a.to_string()),
        };
        info.set_item("metrics_listen", listen)?;
        Ok((engine, info))
    }

    /// Drains (`drain()`) and stops the actors; answers the drain report, or `None` when they
    /// were already stopped. Later calls raise `ActorsStoppedError`. In a forked child, a
    /// no-op: the actors are the parent's.
    fn close<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        if !self.owner.is_here() {
            return Ok(None);
        }
        if let Some(caller) = &self.caller {
            if std::thread::current().id() != caller.thread {
                return Ok(None);
            }
            let report = self.call(py, || self.cm.drain());
            // The System and its actors end here; later calls find it gone.
            let Some(runner) = caller.runner(py).ok().and_then(|mut r| r.take()) else {
                return Ok(None);
            };
            drop(runner);
            return report.and_then(|r| Ok(Some(drain_to_py(py, &r)?)));
        }
        let Some(actors) = lock(&self.actors).take() else {
            return Ok(None);
        };
        let report = block_within(py, self.timeout, || self.cm.drain());
        py.allow_threads(|| actors.stop());
        match report {
            Ok(r) => Ok(Some(drain_to_py(py, &r)?)),
            Err(f) => Err(to_py_err(py, f)),
        }
    }

    /// Starts the shutdown: admissions, continuing rows and new steps are refused from now on
    /// (`ChunkingError`, "draining"); the step in flight may still complete. Answers the steps
    /// in flight.
    fn begin_drain(&self, py: Python<'_>) -> PyResult<usize> {
        let cm = self.cm(py)?;
        self.call(py, || cm.begin_drain())
    }

    /// Ends the shutdown (starting it first if needed): abandons steps still in flight, drops
    /// every queued row and prepared input, and answers what it dropped.
    fn drain<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let cm = self.cm(py)?;
        let r = self.call(py, || cm.drain())?;
        drain_to_py(py, &r)
    }

    /// `[(node, walk, max_batch_tokens | None, align)]`.
    fn set_policies(
        &self,
        py: Python<'_>,
        policies: Vec<(String, String, Option<u32>, u32)>,
    ) -> PyResult<()> {
        let cm = self.cm(py)?;
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
        self.call(py, || cm.set_policies(policies))
    }

    /// The arguments of `set_budgets`, normalised by the package (keywords only).
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (*, walks, node_wide=Vec::new(), per_walk=Vec::new(), combined_walk_of=Vec::new(), override_mixed=Vec::new(), no_chunking=Vec::new(), min_chunk_tokens=mstar_chunking::DEFAULT_MIN_CHUNK_TOKENS, max_row_tokens=None, max_partial_prefills=None, slots_per_row=0, max_step_ms=Vec::new(), max_step_ms_per_walk=Vec::new(), cost=Vec::new(), learn_cost=false, time_margin=None, order=None, order_per_node=Vec::new(), max_wait_ms=None, max_wait_steps=None, time_floor=None))]
    fn set_budgets(
        &self,
        py: Python<'_>,
        walks: Vec<String>,
        node_wide: Vec<(String, Option<u32>)>,
        per_walk: PerWalk<u32>,
        combined_walk_of: Vec<(String, String)>,
        override_mixed: Vec<String>,
        no_chunking: Vec<String>,
        min_chunk_tokens: u32,
        max_row_tokens: Option<u32>,
        max_partial_prefills: Option<u32>,
        slots_per_row: u32,
        max_step_ms: Vec<(String, Option<f64>)>,
        max_step_ms_per_walk: PerWalk<f64>,
        cost: Vec<(String, CostArg)>,
        learn_cost: bool,
        time_margin: Option<f64>,
        order: Option<String>,
        order_per_node: Vec<(String, String)>,
        max_wait_ms: Option<f64>,
        max_wait_steps: Option<u64>,
        time_floor: Option<String>,
    ) -> PyResult<()> {
        let cm = self.cm(py)?;
        let settings = BudgetArgs {
            node_wide,
            per_walk,
            walks,
            combined_walk_of,
            override_mixed,
            no_chunking,
            min_chunk_tokens,
            max_row_tokens,
            max_partial_prefills,
            slots_per_row,
            time_node_wide: max_step_ms,
            time_per_walk: max_step_ms_per_walk,
            cost,
            learn_cost,
            time_margin,
            order,
            order_per_node,
            max_wait_ms,
            max_wait_steps,
            time_floor,
        }
        .settings(py)?;
        let orders = settings.order.clone();
        self.call(py, || set_budgets_seen(cm, settings))?;
        lock(&self.orders).settings = orders;
        Ok(())
    }

    /// `(max_batch_tokens | None, align)` of the model's policy.
    fn policy(&self, py: Python<'_>, node: &str, walk: &str) -> PyResult<(Option<u32>, u32)> {
        let cm = self.cm(py)?;
        let p = self.call(py, || cm.policy(node, walk))?;
        Ok((p.max_batch_tokens, p.align))
    }

    /// Whether `walk` is chunked on `node`.
    fn chunkable(&self, py: Python<'_>, node: &str, walk: &str) -> PyResult<bool> {
        let cm = self.cm(py)?;
        self.call(py, || cm.chunkable(node, walk))
    }

    /// The walk's token budget in force (`None`: off).
    fn max_batch_tokens(&self, py: Python<'_>, node: &str, walk: &str) -> PyResult<Option<u32>> {
        let cm = self.cm(py)?;
        self.call(py, || cm.max_batch_tokens(node, walk))
    }

    /// The floor under `budget`.
    fn min_chunk_tokens(&self, py: Python<'_>, budget: u32) -> PyResult<u32> {
        let cm = self.cm(py)?;
        self.call(py, || cm.min_chunk_tokens(budget))
    }

    /// Member walk caps under a combined walk, or `None`.
    fn walk_caps(
        &self,
        py: Python<'_>,
        node: &str,
        walk: &str,
    ) -> PyResult<Option<BTreeMap<String, u32>>> {
        let cm = self.cm(py)?;
        let caps = self.call(py, || cm.walk_caps(node, walk))?;
        Ok(caps.map(|m| m.into_iter().map(|(w, c)| (w.to_string(), c)).collect()))
    }

    /// The whole prepared input held for `(rid, node)`, as the native token view.
    fn prepared(&self, py: Python<'_>, rid: u64, node: &str) -> PyResult<Option<Tokens>> {
        let cm = self.cm(py)?;
        let input = self.call(py, || cm.prepared(rid, node))?;
        input
            .map(|i| {
                let n = i.len();
                Tokens::new(i.cut(0..n))
            })
            .transpose()
    }

    /// The `(rid, node)` keys whose input is held now.
    fn prepared_keys(&self, py: Python<'_>) -> PyResult<Vec<(u64, String)>> {
        let cm = self.cm(py)?;
        let candidates = lock(&self.admitted).all();
        let (held, gone) = self.call(py, || async {
            let (mut held, mut gone) = (Vec::new(), Vec::new());
            for (key, n) in &candidates {
                if cm.prepared(key.0, &key.1).await?.is_some() {
                    held.push((key.0, key.1.to_string()));
                } else {
                    gone.push((key, *n));
                }
            }
            Ok((held, gone))
        })?;
        let mut admitted = lock(&self.admitted);
        for (key, n) in gone {
            admitted.remove(key.0, &key.1, Some(n));
        }
        Ok(held)
    }

    /// `(rows, tokens)` of prepared inputs held over all nodes.
    fn prepared_totals(&self, py: Python<'_>) -> PyResult<(usize, u64)> {
        let cm = self.cm(py)?;
        self.call(py, || cm.prepared_totals())
    }

    /// Drops the row of `rid` at `node` and its whole input there; answers whether one was held.
    fn release(&self, py: Python<'_>, rid: &Bound<'_, PyAny>, node: &str) -> PyResult<bool> {
        let cm = self.cm(py)?;
        let rid = whole::<u64>(py, "rid", rid)?;
        let held = self.call(py, || cm.release(rid, node))?;
        lock(&self.admitted).remove(rid, node, None);
        Ok(held)
    }

    /// Ends request `rid` on every node: its rows and inputs are dropped.
    fn forget_request(&self, py: Python<'_>, rid: &Bound<'_, PyAny>) -> PyResult<()> {
        let cm = self.cm(py)?;
        let rid = whole::<u64>(py, "rid", rid)?;
        self.call(py, || cm.forget_request(rid))?;
        lock(&self.admitted).keys.remove(&rid);
        Ok(())
    }

    /// Holds a prompt's whole prepared input (token ids: a buffer of `uint32`, a list, a
    /// range, …; text is refused) and queues its row at `node` for `walk`; `cached` tokens
    /// of it are a cached prefix. The ids are copied once, here. `priority` (lower first)
    /// orders it under the `priority` order (elsewhere it is kept, with a `RuntimeWarning`
    /// once per node); `arrival_ms`, on the engine's clock, starts its wait for `max_wait_ms`.
    #[pyo3(signature = (rid, node, walk, tokens, cached=None, *, priority=None, arrival_ms=None))]
    #[allow(clippy::too_many_arguments)]
    fn admit(
        &self,
        py: Python<'_>,
        rid: &Bound<'_, PyAny>,
        node: &str,
        walk: &str,
        tokens: &Bound<'_, PyAny>,
        cached: Option<&Bound<'_, PyAny>>,
        priority: Option<&Bound<'_, PyAny>>,
        arrival_ms: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let cm = self.cm(py)?;
        let rid = whole::<u64>(py, "rid", rid)?;
        let options = AdmitOptions {
            cached: cached.map_or(Ok(0), |c| whole::<u32>(py, "cached", c))?,
            priority: priority_arg(py, priority)?,
            arrival_ms: clock_arg(py, "arrival_ms", arrival_ms)?,
        };
        let input = PreparedInput::tokens(token_ids(py, rid, node, tokens)?);
        warn_priorities(py, &self.orders, node, [(rid, options.priority)])?;
        self.call(py, || cm.admit_with(rid, node, walk, input, options))?;
        lock(&self.admitted).insert(rid, Name::from(node));
        Ok(())
    }

    /// Queues a continuing row (decode, speculative verify) of `rid` at `node` for `walk`,
    /// running `estimate` tokens a step until `forget_request` or `release`; `context` (its
    /// tokens so far) lets a time budget predict its KV and attention terms.
    #[pyo3(signature = (rid, node, walk, estimate=None, context=None))]
    fn continue_row(
        &self,
        py: Python<'_>,
        rid: &Bound<'_, PyAny>,
        node: &str,
        walk: &str,
        estimate: Option<&Bound<'_, PyAny>>,
        context: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let cm = self.cm(py)?;
        let rid = whole::<u64>(py, "rid", rid)?;
        let estimate = estimate.map_or(Ok(1), |e| whole::<u32>(py, "estimate", e))?;
        let context = match context.filter(|c| !c.is_none()) {
            None => None,
            Some(c) => Some(whole::<u64>(py, "context", c)?),
        };
        self.call(py, || async {
            match context {
                None => cm.continue_row(rid, node, walk, estimate).await,
                Some(c) => {
                    cm.continue_row_with_context(rid, node, walk, estimate, c)
                        .await
                }
            }
        })
    }

    /// Plans the node's next step (answered again, the same batch, while it is in flight);
    /// `at_ms`, the step's time on the engine's clock, is what `max_wait_ms` measures waits to.
    #[pyo3(signature = (node, walk, *, at_ms=None))]
    fn assemble(
        &self,
        py: Python<'_>,
        node: &str,
        walk: &str,
        at_ms: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<StepBatch> {
        let cm = self.cm(py)?;
        let at_ms = clock_arg(py, "at_ms", at_ms)?;
        let batch = self.call(py, || async {
            match at_ms {
                None => cm.assemble(node, walk).await,
                Some(ms) => cm.assemble_at(node, walk, ms).await,
            }
        })?;
        Ok(StepBatch { batch })
    }

    /// Completes a step with the tokens each row ran (a chunk: 0 or its planned tokens) and,
    /// optionally, its measured time in ms (checked against the time budget, fed to the
    /// online fit and the margin). A token overrun is logged on the 1st, 2nd, 4th, … of its
    /// `(node, walk)`.
    #[pyo3(signature = (step, ran, measured_ms=None))]
    fn complete(
        &self,
        py: Python<'_>,
        step: &Bound<'_, PyAny>,
        ran: &Bound<'_, PyAny>,
        measured_ms: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Outcome> {
        let cm = self.cm(py)?;
        let step = whole::<u64>(py, "step", step)?;
        let ran = ran_of_step(py, step, ran)?;
        let measured_ms = measured_arg(py, measured_ms)?;
        let (outcome, count) = self.call(py, || async {
            let outcome = cm.complete(step, ran, measured_ms).await?;
            let count = overrun_count_of(cm, &outcome).await?;
            Ok((outcome, count))
        })?;
        Self::finish_step(py, &outcome, count);
        Ok(Outcome {
            outcome: Arc::new(outcome),
        })
    }

    /// Completes step `step` (as `complete`) and assembles the next step of `next` (a
    /// `NextStep`, or a `(node, walk)` pair) after applying its row changes, in one round
    /// trip. A repeat of the call whose answer was lost gets the same outcome and the batch
    /// in flight; the completion is applied once. `at_ms` (else `next`'s own) is the next
    /// step's time on the engine's clock.
    #[pyo3(signature = (step, ran, measured_ms=None, *, next=None, at_ms=None))]
    fn complete_and_assemble(
        &self,
        py: Python<'_>,
        step: &Bound<'_, PyAny>,
        ran: &Bound<'_, PyAny>,
        measured_ms: Option<&Bound<'_, PyAny>>,
        next: Option<&Bound<'_, PyAny>>,
        at_ms: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Completed> {
        let cm = self.cm(py)?;
        let step = whole::<u64>(py, "step", step)?;
        let ran = ran_of_step(py, step, ran)?;
        let measured_ms = measured_arg(py, measured_ms)?;
        let at_ms = clock_arg(py, "at_ms", at_ms)?;
        let Some(next) = next.filter(|n| !n.is_none()) else {
            // The same node and walk as the step's, no row changes.
            let (done, count) = self.call(py, || async {
                let then = at_ms.map_or(Then::Same, Then::SameAt);
                let done = cm
                    .complete_and_assemble(step, ran, measured_ms, then)
                    .await?;
                let count = overrun_count_of(cm, &done.outcome).await?;
                Ok((done, count))
            })?;
            return one_trip_answer(py, done, count);
        };
        let (mut next, own_at_ms) = if let Ok(n) = next.downcast::<PyNextStep>() {
            let n = n.borrow();
            (n.next.clone(), n.at_ms)
        } else if let Some((node, walk)) = name_pair(next) {
            (NextStep::new(node, walk), None)
        } else {
            return Err(invalid(
                py,
                &format!(
                    "next must be a NextStep or a (node, walk) pair, got {}",
                    crate::boundary::short_repr(next)
                ),
            ));
        };
        if let Some(ms) = at_ms.or(own_at_ms) {
            next = next.at_ms(ms);
        }
        let (done, count) = self.one_trip(py, cm, step, ran, measured_ms, next)?;
        one_trip_answer(py, done, count)
    }

    /// The vLLM scheduler's step in one call (`mstar_chunking.vllm`): completes step `step`
    /// (as `complete_and_assemble`), applies the row changes given as lists rather than a
    /// `NextStep`, assembles `(node, walk)`'s next step and answers it keyed (as
    /// `Batch.keyed(keys)`). The changes, in this order: each item of `continues`, a rid or a
    /// `(rid, estimate)`, continues as a row of `continue_walk` with that estimate, else
    /// `estimate` (1: plain decode; `k + 1` with `k` speculative tokens; a row continuing
    /// already takes the new estimate); each `(rid, tokens, cached)` of `changes` forgets
    /// the request (`tokens` `None`) or admits the prompt on `admit_walk` with `cached` tokens
    /// already in the KV cache. Answers `(outcome, next)`: `next` is `(batch, row_keys, tokens,
    /// starts, final_rows)` (`final_rows`: `(row, rid)` of the rows whose chunk is final), or
    /// the exception the assembly failed with (the completion stands either way).
    #[pyo3(signature = (step, ran, measured_ms, node, walk, continue_walk, continues, admit_walk, changes, keys, estimate = 1))]
    #[allow(clippy::too_many_arguments)]
    fn _complete_and_assemble_keyed<'py>(
        &self,
        py: Python<'py>,
        step: &Bound<'py, PyAny>,
        ran: &Bound<'py, PyAny>,
        measured_ms: Option<&Bound<'py, PyAny>>,
        node: &str,
        walk: &str,
        continue_walk: &str,
        continues: &Bound<'py, PyList>,
        admit_walk: &str,
        changes: &Bound<'py, PyList>,
        keys: &Bound<'py, PyDict>,
        estimate: u32,
    ) -> PyResult<(Py<Outcome>, PyObject)> {
        let cm = self.cm(py)?;
        let step = whole::<u64>(py, "step", step)?;
        let ran = ran_of_step(py, step, ran)?;
        let measured_ms = measured_arg(py, measured_ms)?;
        let node = name(node);
        let mut next = NextStep::new(node.clone(), name(walk));
        if !continues.is_empty() {
            let walk = name(continue_walk);
            for (i, item) in continues.iter().enumerate() {
                let (rid, est) = match item.extract::<(Bound<'_, PyAny>, Bound<'_, PyAny>)>() {
                    Ok((rid, est)) => (
                        whole_named::<u64>(py, || format!("continues[{i}]: rid"), &rid)?,
                        whole_named::<u32>(py, || format!("continues[{i}]: estimate"), &est)?,
                    ),
                    Err(_) => (
                        whole_named::<u64>(py, || format!("continues[{i}]"), &item)?,
                        estimate,
                    ),
                };
                next = next.continue_row(rid, walk.clone(), est);
            }
        }
        if !changes.is_empty() {
            let walk = name(admit_walk);
            for (i, change) in changes.iter().enumerate() {
                let (rid, tokens, cached): (Bound<'_, PyAny>, Bound<'_, PyAny>, Bound<'_, PyAny>) =
                    change.extract().map_err(|_| {
                        invalid(
                            py,
                            &format!(
                                "changes[{i}] is (rid, tokens or None, cached), got {}",
                                crate::boundary::short_repr(&change)
                            ),
                        )
                    })?;
                let rid = whole_named::<u64>(py, || format!("changes[{i}]: rid"), &rid)?;
                next = if tokens.is_none() {
                    next.forget_request(rid)
                } else {
                    let options = AdmitOptions {
                        cached: whole_named::<u32>(
                            py,
                            || format!("changes[{i}]: cached"),
                            &cached,
                        )?,
                        ..AdmitOptions::default()
                    };
                    let input = PreparedInput::tokens(token_ids(py, rid, &node, &tokens)?);
                    next.admit_with(rid, walk.clone(), input, options)
                };
            }
        }
        let (done, count) = self.one_trip(py, cm, step, ran, measured_ms, next)?;
        Engine::finish_step(py, &done.outcome, count);
        let outcome = Py::new(
            py,
            Outcome {
                outcome: Arc::new(done.outcome),
            },
        )?;
        let next = match done.next {
            Ok(batch) => {
                let (row_keys, tokens, starts, finals) = keyed_columns(py, &batch, keys)?;
                let final_rows = PyList::empty(py);
                for i in finals {
                    final_rows.append((i, batch.rows[i].rid))?;
                }
                let batch = Py::new(py, StepBatch { batch })?;
                (batch, row_keys, tokens, starts, final_rows)
                    .into_pyobject(py)?
                    .into_any()
                    .unbind()
            }
            Err(e) => to_py_err(py, Failure::Chunking(e))
                .into_value(py)
                .into_any(),
        };
        Ok((outcome, next))
    }

    /// The step ran nothing: no row advances, the node can assemble again.
    fn abandon(&self, py: Python<'_>, step: &Bound<'_, PyAny>) -> PyResult<()> {
        let cm = self.cm(py)?;
        let step = whole::<u64>(py, "step", step)?;
        self.call(py, || cm.abandon(step))
    }

    /// Checks `batch` as it ran (`ran[i]`: the tokens row `i` ran); counts, logs (1st, 2nd,
    /// 4th, …) and returns the overrun, if any.
    fn check_budget<'py>(
        &self,
        py: Python<'py>,
        batch: &StepBatch,
        ran: &Bound<'_, PyAny>,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        let cm = self.cm(py)?;
        let ran = ran_arg(py, ran)?;
        let b = batch.batch.clone();
        let (overrun, count) = self.call(py, || async {
            let overrun = cm.check_budget(&b, &ran).await?;
            let count = match &overrun {
                Some(o) => cm.overrun_count(&o.node, &o.walk, None).await?,
                None => 0,
            };
            Ok((overrun, count))
        })?;
        match overrun {
            None => Ok(None),
            Some(o) => {
                log_overrun(py, &o, count);
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
        let cm = self.cm(py)?;
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
        self.call(py, || cm.overrun_count(node, walk, reason))
    }

    /// `{prefill_rows, mid_prefill_rows, continuing_rows, steps_in_flight}`.
    fn queue_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let cm = self.cm(py)?;
        let s = self.call(py, || cm.queue_stats())?;
        let d = PyDict::new(py);
        d.set_item("prefill_rows", s.prefill_rows)?;
        d.set_item("mid_prefill_rows", s.mid_prefill_rows)?;
        d.set_item("continuing_rows", s.continuing_rows)?;
        d.set_item("steps_in_flight", s.steps_in_flight)?;
        Ok(d)
    }

    /// Reports the measured time of step `step`, completed before its time was known
    /// (asynchronous scheduling): the time budget check, the online fit and the margin read
    /// it then. Answers a dict: `step`, `node`, `walk`, `measured_ms`, `predicted_ms`,
    /// `max_step_ms`, `time_overrun` (a reason or None), `time_margin`.
    fn measured<'py>(
        &self,
        py: Python<'py>,
        step: &Bound<'_, PyAny>,
        measured_ms: &Bound<'_, PyAny>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let cm = self.cm(py)?;
        let step = whole::<u64>(py, "step", step)?;
        let Some(ms) = measured_arg(py, Some(measured_ms))? else {
            return Err(invalid(
                py,
                "measured_ms must be a finite number of ms >= 0, got None",
            ));
        };
        let m = self.call(py, || cm.measured_late(step, ms))?;
        let d = PyDict::new(py);
        d.set_item("step", m.step)?;
        d.set_item("node", &*m.node)?;
        d.set_item("walk", &*m.walk)?;
        d.set_item("measured_ms", m.measured_ms)?;
        d.set_item("predicted_ms", m.predicted_ms)?;
        d.set_item("max_step_ms", m.max_step_ms)?;
        d.set_item("time_overrun", m.time_overrun.map(|r| r.as_str()))?;
        d.set_item("time_margin", m.time_margin)?;
        Ok(d)
    }

    /// The latency model `node` plans its time budgets with (`LatencyModelState`).
    fn latency_model<'py>(&self, py: Python<'py>, node: &str) -> PyResult<Bound<'py, PyAny>> {
        let cm = self.cm(py)?;
        let r = self.call(py, || cm.latency_model(node))?;
        let model = |m: Option<&mstar_chunking::LatencyModel>| -> PyResult<PyObject> {
            Ok(match m {
                Some(m) => model_to_py(py, m)?.unbind(),
                None => py.None(),
            })
        };
        let fit = match &r.fit {
            Some(f) => py_attr(py, "mstar_chunking._types", "OnlineFit")?
                .call1((model(Some(&f.model))?, f.samples, f.relative_rms, f.trusted))?
                .unbind(),
            None => py.None(),
        };
        py_attr(py, "mstar_chunking._types", "LatencyModelState")?.call1((
            model(r.model.as_ref())?,
            r.source.as_str(),
            model(r.configured.as_ref())?,
            r.learn_cost,
            fit,
            r.time_inactive_steps,
            r.time_inactive.map(|r| r.as_str()),
        ))
    }

    /// The model's name as its metric series' `model` label.
    #[getter]
    fn model(&self) -> &str {
        self.cm.model()
    }
}

/// The node, walk and row changes of the next step of a one-trip step
/// (`complete_and_assemble(..., next=...)`): requests that ended, prompts that continue as
/// decode rows, prompts that arrived, applied in order after the completion and before the
/// next step is planned. Each method appends one change and answers the same object; it can
/// be passed again to repeat a call whose answer was lost.
#[pyclass(module = "mstar_chunking._native", name = "NextStep")]
pub(crate) struct PyNextStep {
    /// The node, walk and row changes (its step time is `at_ms`, set on each call's copy).
    next: NextStep,
    at_ms: Option<f64>,
}

impl PyNextStep {
    fn push(&mut self, change: impl FnOnce(NextStep) -> NextStep) {
        let empty = NextStep::new(self.next.node().clone(), self.next.walk().clone());
        let next = std::mem::replace(&mut self.next, empty);
        self.next = change(next);
    }
}

#[pymethods]
impl PyNextStep {
    #[new]
    #[pyo3(signature = (node, walk, *, at_ms=None))]
    fn new(
        py: Python<'_>,
        node: &str,
        walk: &str,
        at_ms: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        Ok(Self {
            next: NextStep::new(name(node), name(walk)),
            at_ms: clock_arg(py, "at_ms", at_ms)?,
        })
    }

    /// The next step's time in ms on the engine's clock (`None`: not given), which
    /// `max_wait_ms` measures waits to; settable.
    #[getter]
    fn get_at_ms(&self) -> Option<f64> {
        self.at_ms
    }

    #[setter]
    fn set_at_ms(&mut self, at_ms: &Bound<'_, PyAny>) -> PyResult<()> {
        self.at_ms = clock_arg(at_ms.py(), "at_ms", Some(at_ms))?;
        Ok(())
    }

    /// Ends request `rid` before the next step (as `forget_request`).
    fn forget_request<'py>(
        mut slf: PyRefMut<'py, Self>,
        rid: &Bound<'_, PyAny>,
    ) -> PyResult<PyRefMut<'py, Self>> {
        let rid = whole::<u64>(slf.py(), "rid", rid)?;
        slf.push(|n| n.forget_request(rid));
        Ok(slf)
    }

    /// Queues a continuing row of `rid` on the next step's node (as `continue_row`).
    #[pyo3(signature = (rid, walk, estimate=None, context=None))]
    fn continue_row<'py>(
        mut slf: PyRefMut<'py, Self>,
        rid: &Bound<'_, PyAny>,
        walk: &str,
        estimate: Option<&Bound<'_, PyAny>>,
        context: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyRefMut<'py, Self>> {
        let py = slf.py();
        let rid = whole::<u64>(py, "rid", rid)?;
        let estimate = estimate.map_or(Ok(1), |e| whole::<u32>(py, "estimate", e))?;
        let context = match context.filter(|c| !c.is_none()) {
            None => None,
            Some(c) => Some(whole::<u64>(py, "context", c)?),
        };
        let walk = name(walk);
        slf.push(|n| match context {
            None => n.continue_row(rid, walk, estimate),
            Some(c) => n.continue_row_with_context(rid, walk, estimate, c),
        });
        Ok(slf)
    }

    /// Admits a prompt on the next step's node before it is planned (as `admit`, with its
    /// `priority` and `arrival_ms`).
    #[pyo3(signature = (rid, walk, tokens, cached=None, *, priority=None, arrival_ms=None))]
    fn admit<'py>(
        mut slf: PyRefMut<'py, Self>,
        rid: &Bound<'_, PyAny>,
        walk: &str,
        tokens: &Bound<'_, PyAny>,
        cached: Option<&Bound<'_, PyAny>>,
        priority: Option<&Bound<'_, PyAny>>,
        arrival_ms: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyRefMut<'py, Self>> {
        let py = slf.py();
        let rid = whole::<u64>(py, "rid", rid)?;
        let options = AdmitOptions {
            cached: cached.map_or(Ok(0), |c| whole::<u32>(py, "cached", c))?,
            priority: priority_arg(py, priority)?,
            arrival_ms: clock_arg(py, "arrival_ms", arrival_ms)?,
        };
        let node = slf.next.node().clone();
        let input = PreparedInput::tokens(token_ids(py, rid, &node, tokens)?);
        slf.push(|n| n.admit_with(rid, name(walk), input, options));
        Ok(slf)
    }

    /// The next step's node.
    #[getter]
    fn node(&self) -> String {
        self.next.node().to_string()
    }

    /// The next step's walk.
    #[getter]
    fn walk(&self) -> String {
        self.next.walk().to_string()
    }

    /// The row changes carried.
    fn __len__(&self) -> usize {
        self.next.changes()
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        let at = match self.at_ms {
            Some(ms) => format!(", at_ms={}", crate::steps::py_float(ms)),
            None => String::new(),
        };
        format!(
            "NextStep(node={}, walk={}, changes={}{at})",
            py_repr_str(py, self.next.node()),
            py_repr_str(py, self.next.walk()),
            self.next.changes()
        )
    }
}

/// A one-trip step's answer: the completion logged and counted, the next batch wrapped.
fn one_trip_answer(
    py: Python<'_>,
    done: mstar_chunking::Completed,
    count: u64,
) -> PyResult<Completed> {
    Engine::finish_step(py, &done.outcome, count);
    let next = match done.next {
        Ok(batch) => Ok(Py::new(py, StepBatch { batch })?),
        Err(e) => Err(e),
    };
    Ok(Completed::new(done.outcome, next))
}
