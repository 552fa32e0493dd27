//! The step log (`replay --step-log FILE`): one JSON object per step
//! (`docs/replay.md#the-step-log`).
//!
//! The line is the component's ([`mstar_chunking::step_log`], which states its keys), with the
//! replay's `ms` the step's simulated duration and each continuing row's `context` the
//! simulated engine's (prompt + tokens generated). The replay adds keys of its own:
//!
//! ```text
//! after "step", in a fleet of two workers or more: "worker", and in a disaggregated one: "pool";
//! at the end, with a KV limit only: "kv": {"blocks", "cache_blocks", "limit", "waiting",
//!  "preempted": [{"rid", "row_rid", "readmit_rid", "generated", "during_prefill",
//!  "discarded_tokens", "blocks"}]}
//! ```
//!
//! The log is written into a temporary file next to it, renamed over it by
//! [`StepLog::finish`]: an interrupted or failed run leaves the previous file or a complete one,
//! never half a line.

use std::cell::RefCell;
use std::io;
use std::path::{Path, PathBuf};
use std::rc::Rc;

use serde::ser::SerializeMap;
use serde::Serialize;

use mstar_chunking::scheduler::{Batch, StepOutcome};
pub use mstar_chunking::step_log::AtomicFile;
use mstar_chunking::step_log::{Extras, StepLine, StepLogFile};

/// A step log being written.
pub struct StepLog(StepLogFile);

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

impl StepLog {
    /// Starts the log that will be at `path` once finished.
    ///
    /// # Errors
    /// The temporary file cannot be created.
    pub fn create(path: &Path) -> io::Result<Self> {
        StepLogFile::create(path).map(Self)
    }

    /// The log's path.
    pub fn path(&self) -> &Path {
        self.0.path()
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
        let line = StepLine::new(batch, outcome, t_ms, outcome.measured_ms, contexts)
            .with_extras(ReplayKeys { worker, kv });
        self.0.write(&line)
    }

    /// Flushes the log and puts it at its path.
    ///
    /// # Errors
    /// The flush or the rename failed.
    pub fn finish(self) -> io::Result<()> {
        self.0.finish()
    }
}

/// The replay's keys on a line: the worker after `step`, the KV memory at the end.
struct ReplayKeys<'a> {
    worker: Worker,
    kv: Option<&'a KvStepLine>,
}

impl Extras for ReplayKeys<'_> {
    fn after_step<M: SerializeMap>(&self, m: &mut M) -> Result<(), M::Error> {
        if let Some(w) = self.worker.0 {
            m.serialize_entry("worker", &w)?;
        }
        if let Some(p) = self.worker.1 {
            m.serialize_entry("pool", p)?;
        }
        Ok(())
    }

    fn at_end<M: SerializeMap>(&self, m: &mut M) -> Result<(), M::Error> {
        if let Some(kv) = self.kv {
            m.serialize_entry("kv", kv)?;
        }
        Ok(())
    }
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
