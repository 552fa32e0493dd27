//! The step log (`replay --step-log FILE`): one JSON object per step
//! (`docs/replay.md#the-step-log`).
//!
//! ```text
//! {"step", "t_ms", "node", "walk", "budget" (null when none), "floor", "caps" (object or null),
//!  "rows": [{"rid", "walk", "kind": "continue"|"chunk", "tokens",
//!            chunks only: "start", "end", "total", "stride", "final", first chunks only: "cached"}],
//!  continuing rows also: "context" (the simulated engine's: prompt + tokens generated)],
//!  "scheduled_tokens", "ran_tokens", "overrun" (null or {"reason"}), "waiting",
//!  "ms" (the step's simulated duration), "predicted_ms" (null without a latency model),
//!  "max_step_ms" (null without a time budget), "time_overrun" (null or {"reason"}),
//!  with a KV limit only: "kv": {"blocks", "cache_blocks", "limit", "waiting",
//!  "preempted": [{"rid", "row_rid", "readmit_rid", "generated", "during_prefill",
//!  "discarded_tokens", "blocks"}]}}
//! ```
//!
//! Lines are serialised straight from the batch (no intermediate values) through a `BufWriter`
//! into a temporary file next to the log, renamed over it by [`StepLog::finish`]: an
//! interrupted or failed run leaves the previous file or a complete one, never half a line.

use std::cell::RefCell;
use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::rc::Rc;

use serde::ser::{SerializeMap, Serializer};
use serde::Serialize;

use mstar_chunking::planner::RowWork;
use mstar_chunking::policy::Name;
use mstar_chunking::scheduler::{Batch, BatchRow, StepOutcome};

/// A step log being written.
pub struct StepLog {
    path: PathBuf,
    out: Option<AtomicFile>,
}

/// Where a simulation writes its steps: a log of its own (one worker), or the log a fleet's
/// workers share, each line naming the worker that ran the step.
pub enum StepSink {
    /// The replay's own log.
    Own(StepLog),
    /// A fleet's log, and the worker writing to it.
    Shared {
        /// The log, finished by the fleet once every worker is done.
        log: Rc<RefCell<StepLog>>,
        /// The worker's index, written on each of its lines when the fleet has two workers or
        /// more (`None`: a fleet of one writes the lines of a single replay).
        worker: Option<u32>,
        /// The worker's pool in a disaggregated fleet (`prefill` or `decode`), written after
        /// `worker`; `None` in a colocated one.
        pool: Option<&'static str>,
    },
}

impl StepSink {
    /// The log's path.
    pub fn path(&self) -> PathBuf {
        match self {
            StepSink::Own(log) => log.path().to_owned(),
            StepSink::Shared { log, .. } => log.borrow().path().to_owned(),
        }
    }

    /// Writes one step, as [`StepLog::write_line`] does, with the worker on a shared log.
    ///
    /// # Errors
    /// The write failed.
    pub fn write_with(
        &mut self,
        t_ms: f64,
        batch: &Batch,
        contexts: &[u64],
        outcome: &StepOutcome,
        kv: Option<&KvStepLine>,
    ) -> io::Result<()> {
        match self {
            StepSink::Own(log) => {
                log.write_line(Worker(None, None), t_ms, batch, contexts, outcome, kv)
            }
            StepSink::Shared { log, worker, pool } => log.borrow_mut().write_line(
                Worker(*worker, *pool),
                t_ms,
                batch,
                contexts,
                outcome,
                kv,
            ),
        }
    }
}

/// Who ran a step, as a fleet's log line names it: the worker's index (`None`: no `worker` key)
/// and its pool in a disaggregated fleet (`None`: no `pool` key).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Worker(pub Option<u32>, pub Option<&'static str>);

/// A file written under a temporary name in the same directory and renamed over its path when
/// complete; dropped unfinished, the temporary file is removed and the path left as it was.
pub struct AtomicFile {
    path: PathBuf,
    tmp: PathBuf,
    out: BufWriter<File>,
}

impl AtomicFile {
    /// Starts writing what will become `path`.
    ///
    /// # Errors
    /// The temporary file cannot be created.
    pub fn create(path: &Path) -> io::Result<Self> {
        let name = path
            .file_name()
            .ok_or_else(|| io::Error::other("names no file"))?;
        let mut tmp_name = std::ffi::OsString::from(".");
        tmp_name.push(name);
        tmp_name.push(format!(".{}.tmp", std::process::id()));
        let tmp = path.with_file_name(tmp_name);
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)?;
        Ok(Self {
            path: path.to_owned(),
            tmp,
            out: BufWriter::with_capacity(1 << 16, file),
        })
    }

    /// Flushes and renames the file over its path.
    ///
    /// # Errors
    /// The flush or the rename failed (the temporary file is then removed).
    pub fn commit(mut self) -> io::Result<()> {
        let done = self
            .out
            .flush()
            .and_then(|()| self.out.get_ref().sync_data())
            .and_then(|()| std::fs::rename(&self.tmp, &self.path));
        if done.is_ok() {
            // Renamed: nothing left to remove.
            self.tmp = PathBuf::new();
        }
        done
    }
}

impl Write for AtomicFile {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.out.write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.out.flush()
    }
}

impl Drop for AtomicFile {
    fn drop(&mut self) {
        if !self.tmp.as_os_str().is_empty() {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

impl StepLog {
    /// Starts the log that will be at `path` once finished.
    ///
    /// # Errors
    /// The temporary file cannot be created.
    pub fn create(path: &Path) -> io::Result<Self> {
        Ok(Self {
            path: path.to_owned(),
            out: Some(AtomicFile::create(path)?),
        })
    }

    /// The log's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes one step: `batch` as assembled, started at `t_ms` of simulated time, which ran
    /// `ran_tokens` and overran (or not) as its completion said. `contexts` holds each row's
    /// context as the simulated engine knows it (by row; a chunk's entry is unused): what a
    /// continuing row's `context` shows, and what its step was priced with. `kv` is the KV
    /// memory of the step when the replay models it (a `kv` object; no such key without a KV
    /// limit).
    ///
    /// The line names `worker` when there is one (a fleet's), and its `pool` when it has one.
    ///
    /// # Errors
    /// The write failed.
    pub fn write_line(
        &mut self,
        worker: Worker,
        t_ms: f64,
        batch: &Batch,
        contexts: &[u64],
        outcome: &StepOutcome,
        kv: Option<&KvStepLine>,
    ) -> io::Result<()> {
        let line = StepLine {
            worker,
            t_ms,
            batch,
            contexts,
            outcome,
            kv,
        };
        let out = self
            .out
            .as_mut()
            .ok_or_else(|| io::Error::other("the step log is finished"))?;
        serde_json::to_writer(&mut *out, &line)?;
        out.write_all(b"\n")
    }

    /// Flushes the log and puts it at its path.
    ///
    /// # Errors
    /// The flush or the rename failed.
    pub fn finish(mut self) -> io::Result<()> {
        match self.out.take() {
            Some(out) => out.commit(),
            None => Ok(()),
        }
    }
}

struct StepLine<'a> {
    worker: Worker,
    t_ms: f64,
    batch: &'a Batch,
    contexts: &'a [u64],
    outcome: &'a StepOutcome,
    kv: Option<&'a KvStepLine>,
}

/// A step's KV memory (`docs/kv-memory.md#the-step-log`): the blocks in use while it ran
/// (requests' and prefix cache's), the pool's size, the requests waiting for memory, and the
/// preemptions made to fit it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct KvStepLine {
    /// Blocks in use while the step ran, the prefix cache's included.
    pub blocks: u64,
    /// Of which the prefix cache's.
    pub cache_blocks: u64,
    /// Blocks in the pool.
    pub limit: u64,
    /// Requests waiting for memory when the step ran.
    pub waiting: usize,
    /// Requests preempted to fit this step (or an earlier one planned again).
    pub preempted: Vec<Preemption>,
}

/// One preemption by recompute.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Preemption {
    /// The request's position in the trace.
    pub rid: u64,
    /// The rid of the preempted row itself (the admission it ran under: `rid` at first,
    /// `readmit_rid` of the previous preemption after one), as the step log's rows show it.
    pub row_rid: u64,
    /// The rid its recompute is admitted under (`rid + attempts << 32`).
    pub readmit_rid: u64,
    /// Tokens it had generated: its recompute prefills its prompt and these.
    pub generated: u32,
    /// Whether it was preempted before its final chunk: that admission's prefill never
    /// finishes (its rid is `readmit_rid - 2^32`).
    pub during_prefill: bool,
    /// The tokens its KV cache held, thrown away.
    pub discarded_tokens: u64,
    /// The blocks freed.
    pub blocks: u64,
}

/// A time in ms to the µs: enough to order and compare steps, short to print.
fn ms(v: f64) -> f64 {
    (v * 1000.0).round() / 1000.0
}

impl Serialize for StepLine<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let (b, o) = (self.batch, self.outcome);
        let mut m = s.serialize_map(Some(16))?;
        m.serialize_entry("step", &b.step)?;
        if let Some(w) = self.worker.0 {
            m.serialize_entry("worker", &w)?;
        }
        if let Some(p) = self.worker.1 {
            m.serialize_entry("pool", p)?;
        }
        m.serialize_entry("t_ms", &ms(self.t_ms))?;
        m.serialize_entry("node", &*b.node)?;
        m.serialize_entry("walk", &*b.walk)?;
        m.serialize_entry("budget", &b.budget)?;
        m.serialize_entry("floor", &b.floor)?;
        m.serialize_entry("caps", &b.caps.as_deref().map(Caps))?;
        m.serialize_entry("rows", &Rows(b, self.contexts))?;
        m.serialize_entry("scheduled_tokens", &b.scheduled_tokens)?;
        m.serialize_entry("ran_tokens", &o.tokens.ran)?;
        m.serialize_entry(
            "overrun",
            &o.overrun.as_ref().map(|o| Reason(o.reason.as_str())),
        )?;
        m.serialize_entry("waiting", &b.waiting)?;
        m.serialize_entry("ms", &o.measured_ms.map(ms))?;
        m.serialize_entry("predicted_ms", &o.predicted_ms.map(ms))?;
        m.serialize_entry("max_step_ms", &o.max_step_ms)?;
        m.serialize_entry("time_overrun", &o.time_overrun.map(|r| Reason(r.as_str())))?;
        if let Some(kv) = self.kv {
            m.serialize_entry("kv", kv)?;
        }
        m.end()
    }
}

struct Caps<'a>(&'a [(Name, u32)]);

impl Serialize for Caps<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_map(self.0.iter().map(|(w, c)| (&**w, c)))
    }
}

struct Reason(&'static str);

impl Serialize for Reason {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(Some(1))?;
        m.serialize_entry("reason", self.0)?;
        m.end()
    }
}

/// A batch's rows, with the true context of each (by row).
struct Rows<'a>(&'a Batch, &'a [u64]);

impl Serialize for Rows<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.0.rows.iter().enumerate().map(|(i, r)| {
            // Without an entry (never, from the replay), the component's own context.
            let context = self.1.get(i).copied().unwrap_or(r.context);
            Row(r, self.0.walk_of(r), context)
        }))
    }
}

struct Row<'a>(&'a BatchRow, &'a str, u64);

impl Serialize for Row<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let (r, walk, context) = (self.0, self.1, self.2);
        match r.work {
            RowWork::Continue { estimate } => {
                let mut m = s.serialize_map(Some(5))?;
                m.serialize_entry("rid", &r.rid)?;
                m.serialize_entry("walk", walk)?;
                m.serialize_entry("kind", "continue")?;
                m.serialize_entry("tokens", &estimate)?;
                m.serialize_entry("context", &context)?;
                m.end()
            }
            RowWork::Chunk { range, cached } => {
                // A first chunk moves the Loop by its `end`; a later one never starts at 0.
                let first = range.stride == range.end;
                let mut m = s.serialize_map(Some(if first { 10 } else { 9 }))?;
                m.serialize_entry("rid", &r.rid)?;
                m.serialize_entry("walk", walk)?;
                m.serialize_entry("kind", "chunk")?;
                m.serialize_entry("tokens", &range.tokens())?;
                m.serialize_entry("start", &range.start)?;
                m.serialize_entry("end", &range.end)?;
                m.serialize_entry("total", &range.total)?;
                m.serialize_entry("stride", &range.stride)?;
                m.serialize_entry("final", &range.is_final())?;
                if first {
                    m.serialize_entry("cached", &cached)?;
                }
                m.end()
            }
        }
    }
}
