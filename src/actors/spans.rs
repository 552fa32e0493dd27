//! Steps and requests as `tracing` spans (`docs/monitoring.md#tracing`), so that an engine's traces
//! follow a step from its assembly to its completion or abandonment, and a request from its
//! admission to its forgetting, as TGI's router does:
//!
//! - `step` (debug), fields `model`, `node`, `walk`, `step`: entered for every event of the
//!   step (assembled, completed, abandoned, its overrun, a refused completion or row change);
//!   it follows from the spans of the requests whose rows it runs;
//! - `request` (debug), fields `model`, `rid`: its admission and its forgetting.
//!
//! Spans are kept only while a subscriber wants them: with none (or above `debug`), creating
//! one is a callsite check and nothing is stored.

use rustc_hash::FxHashMap;
use tracing::Span;

use crate::policy::Name;
use crate::scheduler::Batch;

/// The open spans of one Scheduler.
#[derive(Debug)]
pub(crate) struct Spans {
    model: Name,
    /// Each step assembled and not yet completed or abandoned.
    pub(super) steps: FxHashMap<u64, Span>,
    /// Each request admitted and not yet forgotten.
    pub(super) requests: FxHashMap<u64, Span>,
}

impl Spans {
    pub(crate) fn new(model: Name) -> Self {
        Self {
            model,
            steps: FxHashMap::default(),
            requests: FxHashMap::default(),
        }
    }

    /// Opens the span of a step just planned; `known` says which older steps are still in
    /// flight (a node's empty step may never be completed: its span is dropped here).
    pub(crate) fn assembled(&mut self, batch: &Batch, known: impl Fn(u64) -> bool) -> Span {
        let span = tracing::debug_span!(
            "step",
            model = %self.model,
            node = %batch.node,
            walk = %batch.walk,
            step = batch.step
        );
        if span.is_disabled() {
            return span;
        }
        for row in &batch.rows {
            if let Some(request) = self.requests.get(&row.rid) {
                span.follows_from(request);
            }
        }
        span.in_scope(|| {
            tracing::debug!(
                rows = batch.rows.len(),
                scheduled_tokens = batch.scheduled_tokens,
                budget = batch.budget,
                "step assembled"
            );
        });
        self.steps.retain(|step, _| known(*step));
        self.steps.insert(batch.step, span.clone());
        span
    }

    /// The span of step `step` (a disabled one when it has none).
    pub(crate) fn step(&self, step: u64) -> Span {
        self.steps.get(&step).cloned().unwrap_or_else(Span::none)
    }

    /// Closes the span of step `step`: it was completed or abandoned.
    pub(crate) fn ended(&mut self, step: u64) {
        self.steps.remove(&step);
    }

    /// Opens the span of request `rid`, admitted on `node`/`walk` (a request with a span
    /// already keeps it: a continuing row after its prompt).
    pub(crate) fn admitted(&mut self, rid: u64, node: &str, walk: &str) {
        if self.requests.contains_key(&rid) {
            return;
        }
        let span = tracing::debug_span!("request", model = %self.model, rid);
        if span.is_disabled() {
            return;
        }
        span.in_scope(|| tracing::debug!(node, walk, "request admitted"));
        self.requests.insert(rid, span);
    }

    /// Closes the span of request `rid`: it was forgotten.
    pub(crate) fn forgotten(&mut self, rid: u64) {
        if let Some(span) = self.requests.remove(&rid) {
            span.in_scope(|| tracing::debug!("request forgotten"));
        }
    }
}
