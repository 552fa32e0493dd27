//! What a step hands to Python: the batch (`Batch`), its rows (`Row`, made when read), the
//! tokens a chunk runs (`Tokens`, a read-only buffer over the prepared input), what completing
//! it did (`StepOutcome`), and the one-trip answer (`Completed`).

use std::collections::BTreeMap;
use std::os::raw::c_int;
use std::sync::Arc;

use mstar_chunking::{Batch, BatchRow, ChunkInput, ChunkingError, Overrun, RowWork, StepOutcome};
use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::sync::GILOnceCell;
use pyo3::types::{PyDict, PyList, PyTuple};

use crate::boundary::{cached_class, py_bool, py_opt, py_repr_str, to_py_err, Failure};

/// A `#[pymethods]` block whose getters are written one line each: `name: Type = expr` with
/// `$s` bound to `&self`; further methods follow as they are.
macro_rules! pymethods_with_getters {
    (
        impl $ty:ty, |$s:ident| {
            $( $(#[doc = $doc:literal])* $name:ident : $t:ty = $e:expr ),* $(,)?
        }
        $($rest:tt)*
    ) => {
        #[pymethods]
        impl $ty {
            $(
                $(#[doc = $doc])*
                #[getter]
                fn $name(&self) -> $t {
                    let $s = self;
                    $e
                }
            )*
            $($rest)*
        }
    };
}

static CHUNK_RANGE: GILOnceCell<Py<PyAny>> = GILOnceCell::new();
static OVERRUN: GILOnceCell<Py<PyAny>> = GILOnceCell::new();

pub(crate) fn overrun_to_py<'py>(py: Python<'py>, o: &Overrun) -> PyResult<Bound<'py, PyAny>> {
    cached_class(py, &OVERRUN, "Overrun")?.call1((
        &*o.node,
        &*o.walk,
        o.budget,
        o.tokens,
        o.reason.as_str(),
    ))
}

/// The item format of a token view: one native-endian `uint32` (`I`).
const FORMAT_U32: &std::ffi::CStr = c"I";
/// The stride of a token view, in bytes.
static STRIDE_U32: ffi::Py_ssize_t = 4;

/// Token ids held by the actors (a chunk's, or a whole prepared input's), exported through
/// the buffer protocol as read-only `uint32`s (format `I`): `memoryview(tokens)` reads them
/// without a copy, and the view holds this object, and so the tokens, for as long as it
/// lives. Nothing can write through it (a writable buffer is refused) and nothing can free
/// the tokens under it (the object has no state to drop).
#[pyclass(module = "mstar_chunking._native", frozen)]
pub(crate) struct Tokens {
    view: ChunkInput,
    /// The view's shape, `[len]`: the buffer protocol points at it.
    shape: ffi::Py_ssize_t,
}

impl Tokens {
    pub(crate) fn new(view: ChunkInput) -> PyResult<Self> {
        let shape = ffi::Py_ssize_t::try_from(view.token_ids().len())
            .map_err(|_| PyBufferError::new_err("too many tokens for one buffer"))?;
        Ok(Self { view, shape })
    }
}

#[pymethods]
impl Tokens {
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

    /// The token ids as a `list` (a copy).
    fn tolist(&self) -> Vec<u32> {
        self.view.token_ids().to_vec()
    }

    fn __repr__(&self) -> String {
        let (start, end) = self.span();
        format!("Tokens(span=({start}, {end}), len={})", self.shape)
    }

    /// Fills `view` with a read-only buffer over the token ids; a writable one is refused.
    ///
    /// # Safety
    /// Called by CPython with a valid `view` to fill.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        if view.is_null() {
            return Err(PyBufferError::new_err("a null Py_buffer"));
        }
        if flags & ffi::PyBUF_WRITABLE == ffi::PyBUF_WRITABLE {
            return Err(PyBufferError::new_err(
                "token ids held by mstar_chunking are read-only: copy them to change them",
            ));
        }
        let me = slf.get();
        let ids = me.view.token_ids();
        // SAFETY: `view` is CPython's to fill (checked non-null). The pointers stored stay
        // valid while the view lives: the token ids and `shape` belong to this object, which
        // the view holds (`obj`, a new reference released by `PyBuffer_Release`); the format
        // and stride are statics. The object is frozen: nothing changes or drops them.
        unsafe {
            (*view).buf = ids.as_ptr() as *mut std::os::raw::c_void;
            (*view).len = me.shape * STRIDE_U32;
            (*view).readonly = 1;
            (*view).itemsize = STRIDE_U32;
            (*view).format = if flags & ffi::PyBUF_FORMAT == ffi::PyBUF_FORMAT {
                FORMAT_U32.as_ptr() as *mut std::os::raw::c_char
            } else {
                std::ptr::null_mut()
            };
            (*view).ndim = 1;
            (*view).shape = if flags & ffi::PyBUF_ND == ffi::PyBUF_ND {
                &me.shape as *const ffi::Py_ssize_t as *mut ffi::Py_ssize_t
            } else {
                std::ptr::null_mut()
            };
            (*view).strides = if flags & ffi::PyBUF_STRIDES == ffi::PyBUF_STRIDES {
                &STRIDE_U32 as *const ffi::Py_ssize_t as *mut ffi::Py_ssize_t
            } else {
                std::ptr::null_mut()
            };
            (*view).suboffsets = std::ptr::null_mut();
            (*view).internal = std::ptr::null_mut();
            (*view).obj = slf.into_any().into_ptr();
        }
        Ok(())
    }

    /// Nothing to release: the view's reference to this object is dropped by CPython.
    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {}
}

/// A read-only `memoryview` over `tokens` (format `I`).
pub(crate) fn token_view<'py>(py: Python<'py>, view: ChunkInput) -> PyResult<Bound<'py, PyAny>> {
    let tokens = Bound::new(py, Tokens::new(view)?)?;
    // SAFETY: `tokens` is a live object exporting a buffer; `PyMemoryView_FromObject` takes
    // its own reference to it through the buffer it gets.
    unsafe { Bound::from_owned_ptr_or_err(py, ffi::PyMemoryView_FromObject(tokens.as_ptr())) }
}

/// One assembled step (`assemble`'s answer). Its rows' inputs are views of the prepared
/// inputs; the batch is the same object's content until the step completes or is abandoned.
#[pyclass(module = "mstar_chunking._native", frozen, name = "Batch")]
pub(crate) struct StepBatch {
    pub(crate) batch: Arc<Batch>,
}

pymethods_with_getters! {
    impl StepBatch, |s| {
        /// The step's number: `complete` and `abandon` name it.
        step: u64 = s.batch.step,
        /// The node the step runs.
        node: &str = &s.batch.node,
        /// The step walk (a combined walk takes its member walks' rows too).
        walk: &str = &s.batch.walk,
        /// `B`, the token budget the step was scheduled under (`None`: no budget).
        budget: Option<u32> = s.batch.budget,
        /// `F`, the floor (`None` without a budget).
        floor: Option<u32> = s.batch.floor,
        /// Sum of the rows' scheduled tokens.
        scheduled_tokens: u64 = s.batch.scheduled_tokens,
        /// A row that cannot be cut runs whole over the budget: the step overruns by plan.
        uncut_over_budget: bool = s.batch.uncut_over_budget,
        /// Eligible rows that wait for a later step.
        waiting: u32 = s.batch.waiting,
        /// The step's time budget in ms, if it was planned under one.
        max_step_ms: Option<f64> = s.batch.max_step_ms,
        /// The step's predicted time in ms under the node's latency model, if it has one.
        predicted_ms: Option<f64> = s.batch.predicted_ms,
    }

    /// The step walk, then its member walks.
    #[getter]
    fn walks<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, self.batch.walks.iter().map(|w| &**w))
    }

    /// Member walk caps (`walk -> tokens`) under a combined walk on an `override_mixed` node.
    #[getter]
    fn caps(&self) -> Option<BTreeMap<String, u32>> {
        self.batch
            .caps
            .as_ref()
            .map(|c| c.iter().map(|(w, n)| (w.to_string(), *n)).collect())
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
    fn planned<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        int_list(py, self.batch.rows.iter().map(BatchRow::tokens))
    }

    /// The rids whose final chunk this step runs: their prefill ends with it (what an engine
    /// turns into decode rows), read without making a `Row` per row.
    fn final_rids(&self) -> Vec<u64> {
        self.batch
            .rows
            .iter()
            .filter(|r| matches!(r.work, RowWork::Chunk { range, .. } if range.is_final()))
            .map(|r| r.rid)
            .collect()
    }

    /// The rows in bulk, without a `Row` per row: `(rids, tokens, starts, finals)`, four
    /// lists. `rids[i]` and `tokens[i]` are row `i`'s request and scheduled tokens; `starts`
    /// holds each chunk's start (`range.start`), in row order: the chunks are the last
    /// `len(starts)` rows, after the continuing rows; `finals` holds the indices of the rows
    /// whose chunk is final (`is_final`).
    fn columns<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        let rows = &self.batch.rows;
        let rids = int_list(py, rows.iter().map(|r| r.rid))?;
        let tokens = int_list(py, rows.iter().map(BatchRow::tokens))?;
        let chunk = |r: &BatchRow| match r.work {
            RowWork::Chunk { range, .. } => Some(range),
            RowWork::Continue { .. } => None,
        };
        let first = rows.iter().take_while(|r| chunk(r).is_none()).count();
        // The core's order (continuing rows first); a chunk among them would be a change of it.
        if let Some(i) = rows[first..].iter().position(|r| chunk(r).is_none()) {
            return Err(pyo3::exceptions::PyRuntimeError::new_err(format!(
                "step {}: row {} continues after a chunk (the rows are continuing rows, then chunks)",
                self.batch.step,
                first + i
            )));
        }
        let starts = int_list(
            py,
            rows[first..]
                .iter()
                .map(|r| chunk(r).map_or(0, |c| c.start)),
        )?;
        let finals = int_list(
            py,
            rows.iter()
                .enumerate()
                .filter(|(_, r)| chunk(r).is_some_and(|c| c.is_final()))
                .map(|(i, _)| i as u64)
                .collect::<Vec<u64>>()
                .into_iter(),
        )?;
        PyTuple::new(py, [rids, tokens, starts, finals])
    }

    /// The rows in bulk under the caller's keys (an engine's own request ids): `keys` maps each
    /// row's rid to its key (a `dict`; a rid it lacks is a `KeyError` naming it, two rows under
    /// one key a `ValueError` naming the key and both rids). Answers
    /// `(row_keys, tokens, starts, finals)`: each row's key, in row order; the scheduled tokens
    /// by key (in row order); each chunk's start by key; the indices of the rows whose chunk is
    /// final. One call, no `int` made per row.
    fn keyed<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyDict>,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let (row_keys, tokens, starts, finals) = keyed_columns(py, &self.batch, keys)?;
        let finals = int_list(py, finals.into_iter().map(|i| i as u64))?;
        PyTuple::new(
            py,
            [
                row_keys.into_any(),
                tokens.into_any(),
                starts.into_any(),
                finals.into_any(),
            ],
        )
    }

    fn __len__(&self) -> usize {
        self.batch.rows.len()
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "Batch(step={}, node={}, walk={}, rows={}, scheduled_tokens={}, budget={}, max_step_ms={})",
            self.batch.step,
            py_repr_str(py, &self.batch.node),
            py_repr_str(py, &self.batch.walk),
            self.batch.rows.len(),
            self.batch.scheduled_tokens,
            py_opt(self.batch.budget),
            py_opt(self.batch.max_step_ms.map(py_float)),
        )
    }
}

/// A `list` of `items` as Python `int`s, filled in place (a step's rows can number in the
/// thousands: a third of the cost of a list made item by item through conversions).
fn int_list<'py, T: Into<u64>>(
    py: Python<'py>,
    items: impl ExactSizeIterator<Item = T>,
) -> PyResult<Bound<'py, PyList>> {
    let n = ffi::Py_ssize_t::try_from(items.len())
        .map_err(|_| pyo3::exceptions::PyOverflowError::new_err("too many rows for a list"))?;
    // SAFETY: `PyList_New(n)` answers a new list of `n` empty slots (or NULL with an error
    // set, returned here); each slot `i < n` is filled once by `PyList_SetItem`, which steals
    // the reference it is given: a new one from `PyLong_FromUnsignedLongLong`, or, for a value
    // equal to the one before it (a run of decode rows' `1`s), one more reference to that
    // item's `int` (ints do not change), which the list holds. A failed conversion leaves the
    // rest of the slots empty, which a list's deallocation accepts.
    unsafe {
        let list = Bound::from_owned_ptr_or_err(py, ffi::PyList_New(n))?;
        let mut last: Option<(u64, *mut ffi::PyObject)> = None;
        for (i, v) in (0..n).zip(items) {
            let v: u64 = v.into();
            let int = match last {
                Some((w, int)) if w == v => {
                    ffi::Py_INCREF(int);
                    int
                }
                _ => {
                    let int = ffi::PyLong_FromUnsignedLongLong(v);
                    if int.is_null() {
                        return Err(PyErr::fetch(py));
                    }
                    last = Some((v, int));
                    int
                }
            };
            ffi::PyList_SetItem(list.as_ptr(), i, int);
        }
        Ok(list.downcast_into_unchecked())
    }
}

/// `batch`'s rows under the caller's keys (`keys`: rid -> key; a rid it lacks is a `KeyError`
/// naming it, a key two rows share a `ValueError` naming it): each row's key in row order, the
/// scheduled tokens by key, each chunk's start by key, and the indices of the rows whose chunk
/// is final.
#[allow(clippy::type_complexity)]
pub(crate) fn keyed_columns<'py>(
    py: Python<'py>,
    batch: &Batch,
    keys: &Bound<'py, PyDict>,
) -> PyResult<(
    Bound<'py, PyList>,
    Bound<'py, PyDict>,
    Bound<'py, PyDict>,
    Vec<usize>,
)> {
    let row_keys = PyList::empty(py);
    let tokens = PyDict::new(py);
    let starts = PyDict::new(py);
    let mut finals = Vec::new();
    for (i, r) in batch.rows.iter().enumerate() {
        let Some(key) = keys.get_item(r.rid)? else {
            return Err(pyo3::exceptions::PyKeyError::new_err(format!(
                "step {}: rid {} of row {i} has no key",
                batch.step, r.rid
            )));
        };
        // Two rows under one key would leave one row's tokens: refused, naming both rows.
        if tokens.contains(&key)? {
            let j = row_keys
                .iter()
                .position(|k| k.eq(&key).unwrap_or(false))
                .unwrap_or(i);
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "step {}: rid {} of row {i} has key {}, as rid {} of row {j} has: each row needs a key of its own",
                batch.step,
                r.rid,
                key.repr()?,
                batch.rows[j].rid
            )));
        }
        row_keys.append(&key)?;
        tokens.set_item(&key, r.tokens())?;
        if let RowWork::Chunk { range, .. } = r.work {
            starts.set_item(&key, range.start)?;
            if range.is_final() {
                finals.push(i);
            }
        }
    }
    Ok((row_keys, tokens, starts, finals))
}

/// `x` as Python's `repr(float)` writes it (`100.0`, not `100`).
pub(crate) fn py_float(x: f64) -> String {
    if x.is_finite() && x.fract() == 0.0 && x.abs() < 1e16 {
        format!("{x:.1}")
    } else {
        format!("{x}")
    }
}

/// One row of a batch, made when `Batch.rows` is read.
#[pyclass(module = "mstar_chunking._native", frozen)]
pub(crate) struct Row {
    batch: Arc<Batch>,
    i: usize,
}

impl Row {
    fn row(&self) -> &BatchRow {
        &self.batch.rows[self.i]
    }
}

pymethods_with_getters! {
    impl Row, |s| {
        /// The request.
        rid: u64 = s.row().rid,
        /// The row's own walk (a member walk in a combined step).
        walk: &str = s.batch.walk_of(s.row()),
        /// `"chunk"` or `"continue"`.
        kind: &'static str = match s.row().work {
            RowWork::Chunk { .. } => "chunk",
            RowWork::Continue { .. } => "continue",
        },
        /// Tokens the row is scheduled to run.
        tokens: u32 = s.row().tokens(),
        /// A continuing row's estimate; `None` for a chunk.
        estimate: Option<u32> = match s.row().work {
            RowWork::Continue { estimate } => Some(estimate),
            RowWork::Chunk { .. } => None,
        },
        /// Whether the row is a chunk that ends its prompt's prefill (`range.is_final`);
        /// `False` for a continuing row.
        is_final: bool = match s.row().work {
            RowWork::Chunk { range, .. } => range.is_final(),
            RowWork::Continue { .. } => false,
        },
        /// The cached prefix on a first chunk, else 0.
        cached: u32 = match s.row().work {
            RowWork::Chunk { cached, .. } => cached,
            RowWork::Continue { .. } => 0,
        },
        /// A continuing row's context in tokens; 0 for a chunk.
        context: u64 = s.row().context,
    }

    /// A chunk's `ChunkRange`; `None` for a continuing row.
    #[getter]
    fn range<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyAny>>> {
        match self.row().work {
            RowWork::Chunk { range, .. } => Ok(Some(cached_class(py, &CHUNK_RANGE, "ChunkRange")?.call1(
                (range.start, range.end, range.total, range.stride),
            )?)),
            RowWork::Continue { .. } => Ok(None),
        }
    }

    /// The chunk's input token ids, a read-only `memoryview` (format `I`) over the prepared
    /// input (no copy); `None` for a continuing row.
    #[getter]
    fn input<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyAny>>> {
        self.row().input.clone().map(|v| token_view(py, v)).transpose()
    }

    /// The chunk's input as the native `Tokens` (`len()`, `span`, `extras()`, the buffer).
    #[getter]
    fn input_tokens(&self) -> PyResult<Option<Tokens>> {
        self.row().input.clone().map(Tokens::new).transpose()
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        let r = self.row();
        let walk = py_repr_str(py, self.batch.walk_of(r));
        match r.work {
            RowWork::Chunk { range, cached } => format!(
                "Row(rid={}, walk={walk}, kind='chunk', range=ChunkRange(start={}, end={}, total={}, stride={}), cached={}, is_final={})",
                r.rid,
                range.start,
                range.end,
                range.total,
                range.stride,
                cached,
                py_bool(range.is_final()),
            ),
            RowWork::Continue { estimate } => format!(
                "Row(rid={}, walk={walk}, kind='continue', estimate={estimate}, context={})",
                r.rid, r.context
            ),
        }
    }
}

/// What completing a step did.
#[pyclass(module = "mstar_chunking._native", frozen, name = "StepOutcome")]
pub(crate) struct Outcome {
    pub(crate) outcome: Arc<StepOutcome>,
}

pymethods_with_getters! {
    impl Outcome, |s| {
        /// The completed step.
        step: u64 = s.outcome.step,
        /// Its node.
        node: &str = &s.outcome.node,
        /// Its step walk.
        walk: &str = &s.outcome.walk,
        /// Rids whose final chunk completed (their inputs on the node are released).
        finished: Vec<u64> = s.outcome.finished.clone(),
        /// Chunks that ran.
        chunks: u32 = s.outcome.chunks,
        /// How many of the chunks that ran were final.
        final_chunks: u32 = s.outcome.final_chunks,
        /// Chunks reported with 0 tokens: planned again from the same place.
        unrun_chunks: u32 = s.outcome.unrun_chunks,
        /// Tokens the step was scheduled to run.
        scheduled_tokens: u64 = s.outcome.tokens.scheduled,
        /// Tokens it ran.
        ran_tokens: u64 = s.outcome.tokens.ran,
        /// The step time the engine measured, in ms, if it reported one.
        measured_ms: Option<f64> = s.outcome.measured_ms,
        /// The step's predicted time in ms, if the node had a latency model when it was planned.
        predicted_ms: Option<f64> = s.outcome.predicted_ms,
        /// The time budget the step was scheduled under, in ms.
        max_step_ms: Option<f64> = s.outcome.max_step_ms,
        /// The time margin the step was planned with (its plan's limit was
        /// `max_step_ms / time_margin`), if the node plans with one.
        time_margin: Option<f64> = s.outcome.time_margin,
        /// Why the step ran over its time budget (`floor`, `uncut_row`, `continuing`,
        /// `misprediction`), if it did.
        time_overrun: Option<&'static str> = s.outcome.time_overrun.map(|r| r.as_str()),
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

    fn __repr__(&self) -> String {
        format!(
            "StepOutcome(step={}, chunks={}, finished={:?}, overrun={}, measured_ms={}, time_overrun={})",
            self.outcome.step,
            self.outcome.chunks,
            self.outcome.finished,
            py_bool(self.outcome.overrun.is_some()),
            py_opt(self.outcome.measured_ms.map(py_float)),
            py_opt(self.outcome.time_overrun.map(|r| format!("'{}'", r.as_str()))),
        )
    }
}

/// `complete_and_assemble`'s answer: the completed step's outcome and the next step (or why
/// it could not be assembled: the completion stands either way).
#[pyclass(module = "mstar_chunking._native", frozen)]
pub(crate) struct Completed {
    /// The outcome, made a `StepOutcome` object when `outcome` is first read: a loop that
    /// reads only `next` makes none.
    outcome: Arc<StepOutcome>,
    outcome_py: GILOnceCell<Py<Outcome>>,
    pub(crate) next: Result<Py<StepBatch>, ChunkingError>,
}

impl Completed {
    pub(crate) fn new(outcome: StepOutcome, next: Result<Py<StepBatch>, ChunkingError>) -> Self {
        Self {
            outcome: Arc::new(outcome),
            outcome_py: GILOnceCell::new(),
            next,
        }
    }

    fn outcome_obj<'py>(&self, py: Python<'py>) -> PyResult<&Bound<'py, Outcome>> {
        self.outcome_py
            .get_or_try_init(py, || {
                Py::new(
                    py,
                    Outcome {
                        outcome: self.outcome.clone(),
                    },
                )
            })
            .map(|o| o.bind(py))
    }
}

#[pymethods]
impl Completed {
    /// What completing the step did (`StepOutcome`).
    #[getter]
    fn outcome<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, Outcome>> {
        self.outcome_obj(py).cloned()
    }

    /// The next step (`Batch`); raises the error its assembly (or a row change) failed with.
    /// The completion stands either way: `assemble`, or repeat the call, for the next batch.
    #[getter]
    fn next(&self, py: Python<'_>) -> PyResult<Py<StepBatch>> {
        match &self.next {
            Ok(b) => Ok(b.clone_ref(py)),
            Err(e) => Err(to_py_err(py, Failure::Chunking(e.clone()))),
        }
    }

    /// The error the next step's assembly failed with, or `None`.
    #[getter]
    fn next_error(&self, py: Python<'_>) -> Option<PyObject> {
        self.next.as_ref().err().map(|e| {
            to_py_err(py, Failure::Chunking(e.clone()))
                .into_value(py)
                .into_any()
        })
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let outcome = self.outcome_obj(py)?.repr()?.to_string();
        let next = match &self.next {
            Ok(b) => b.bind(py).repr()?.to_string(),
            Err(e) => format!("error({})", py_repr_str(py, &e.to_string())),
        };
        Ok(format!("Completed(outcome={outcome}, next={next})"))
    }
}
