//! The step log: one JSON object per step (JSON Lines), as the replay writes it
//! (`replay --step-log`, `docs/replay.md#the-step-log`) and as an engine on the component can
//! (the reference engine's `--step-log`), so that `fit` and the step-log checker read either.
//!
//! ```text
//! {"step", "t_ms", "node", "walk", "budget" (null when none), "floor", "caps" (object or null),
//!  "rows": [{"rid", "walk", "kind": "continue"|"chunk", "tokens",
//!            chunks only: "start", "end", "total", "stride", "final", first chunks only: "cached"}],
//!  continuing rows also: "context" (the KV the row read: prompt + tokens generated)],
//!  "scheduled_tokens", "ran_tokens", "overrun" (null or {"reason"}), "waiting",
//!  "ms" (the step's duration: simulated or measured; null when unknown),
//!  "predicted_ms" (null without a latency model), "max_step_ms" (null without a time budget),
//!  with [`StepLine::with_time_margin`] only: "time_margin" (null without a margin),
//!  "time_overrun" (null or {"reason"})}
//! ```
//!
//! Times are rounded to the µs. A writer adds keys of its own through [`Extras`]: after `step`
//! (the replay's fleet `worker` and `pool`) and at the end (the replay's `kv`).
//!
//! A line is serialised straight from the batch and its outcome (no intermediate values).
//! [`StepLogFile`] writes the lines through a `BufWriter`, either into a temporary file next to
//! the log renamed over it when finished ([`StepLogFile::create`]: an interrupted or failed run
//! leaves the previous file or a complete one, never half a line), or into the log itself as
//! steps run ([`StepLogFile::create_live`]: it can be read while the engine serves).

use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};

use serde::ser::{SerializeMap, Serializer};
use serde::Serialize;

use crate::planner::RowWork;
use crate::policy::Name;
use crate::scheduler::{Batch, BatchRow, StepOutcome};

/// Keys a writer adds to a step's line besides the component's.
pub trait Extras {
    /// Entries written right after `step`.
    ///
    /// # Errors
    /// The serialiser's.
    fn after_step<M: SerializeMap>(&self, _map: &mut M) -> Result<(), M::Error> {
        Ok(())
    }

    /// Entries written at the end of the line.
    ///
    /// # Errors
    /// The serialiser's.
    fn at_end<M: SerializeMap>(&self, _map: &mut M) -> Result<(), M::Error> {
        Ok(())
    }
}

/// No keys of a writer's own.
impl Extras for () {}

/// One step's line: the batch as assembled, its completion, when it started and how long it
/// took.
#[derive(Debug, Clone, Copy)]
pub struct StepLine<'a, X = ()> {
    batch: &'a Batch,
    outcome: &'a StepOutcome,
    t_ms: f64,
    ms: Option<f64>,
    contexts: &'a [u64],
    time_margin: bool,
    extras: X,
}

impl<'a> StepLine<'a> {
    /// The line of `batch`, which started at `t_ms` (ms on the writer's clock), took `ms` and
    /// completed as `outcome` says. `contexts` holds each row's context by row (a chunk's entry
    /// is unused): what a continuing row's `context` shows; a row without an entry shows the
    /// batch's own estimate ([`BatchRow::context`]).
    pub fn new(
        batch: &'a Batch,
        outcome: &'a StepOutcome,
        t_ms: f64,
        ms: Option<f64>,
        contexts: &'a [u64],
    ) -> Self {
        StepLine {
            batch,
            outcome,
            t_ms,
            ms,
            contexts,
            time_margin: false,
            extras: (),
        }
    }
}

impl<'a, X: Extras> StepLine<'a, X> {
    /// The line with `time_margin`, the margin the step was planned with
    /// ([`StepOutcome::time_margin`]), after `max_step_ms`.
    #[must_use]
    pub fn with_time_margin(mut self) -> Self {
        self.time_margin = true;
        self
    }

    /// The line with a writer's own keys.
    pub fn with_extras<Y: Extras>(self, extras: Y) -> StepLine<'a, Y> {
        StepLine {
            batch: self.batch,
            outcome: self.outcome,
            t_ms: self.t_ms,
            ms: self.ms,
            contexts: self.contexts,
            time_margin: self.time_margin,
            extras,
        }
    }

    /// Writes the line, and its newline, to `out`.
    ///
    /// # Errors
    /// The write failed.
    pub fn write_to<W: Write>(&self, mut out: W) -> io::Result<()> {
        serde_json::to_writer(&mut out, self)?;
        out.write_all(b"\n")
    }
}

/// A time in ms to the µs: enough to order and compare steps, short to print.
fn ms(v: f64) -> f64 {
    (v * 1000.0).round() / 1000.0
}

impl<X: Extras> Serialize for StepLine<'_, X> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let (b, o) = (self.batch, self.outcome);
        let mut m = s.serialize_map(None)?;
        m.serialize_entry("step", &b.step)?;
        self.extras.after_step(&mut m)?;
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
        m.serialize_entry("ms", &self.ms.map(ms))?;
        m.serialize_entry("predicted_ms", &o.predicted_ms.map(ms))?;
        m.serialize_entry("max_step_ms", &o.max_step_ms)?;
        if self.time_margin {
            m.serialize_entry("time_margin", &o.time_margin)?;
        }
        m.serialize_entry("time_overrun", &o.time_overrun.map(|r| Reason(r.as_str())))?;
        self.extras.at_end(&mut m)?;
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
            // Without an entry, the component's own context.
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

/// A step log being written to its file.
pub struct StepLogFile {
    path: PathBuf,
    out: Out,
}

enum Out {
    /// Renamed over the path when finished.
    Atomic(AtomicFile),
    /// The path itself, written as steps run.
    Live(BufWriter<File>),
}

impl StepLogFile {
    /// Starts the log that will be at `path` once finished (until then, `path` is left as it
    /// was).
    ///
    /// # Errors
    /// The temporary file cannot be created.
    pub fn create(path: &Path) -> io::Result<Self> {
        Ok(StepLogFile {
            path: path.to_owned(),
            out: Out::Atomic(AtomicFile::create(path)?),
        })
    }

    /// Starts the log at `path` itself (created, or truncated), written as steps run.
    ///
    /// # Errors
    /// The file cannot be created.
    pub fn create_live(path: &Path) -> io::Result<Self> {
        Ok(StepLogFile {
            path: path.to_owned(),
            out: Out::Live(BufWriter::new(File::create(path)?)),
        })
    }

    /// The log's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes one step's line.
    ///
    /// # Errors
    /// The write failed.
    pub fn write<X: Extras>(&mut self, line: &StepLine<'_, X>) -> io::Result<()> {
        match &mut self.out {
            Out::Atomic(f) => line.write_to(f),
            Out::Live(f) => line.write_to(f),
        }
    }

    /// Flushes the log to disk, and puts it at its path if it was not there yet.
    ///
    /// # Errors
    /// The flush, the sync or the rename failed.
    pub fn finish(self) -> io::Result<()> {
        match self.out {
            Out::Atomic(f) => f.commit(),
            Out::Live(mut f) => f.flush().and_then(|()| f.get_ref().sync_data()),
        }
    }
}

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

#[cfg(test)]
mod tests;
