//! The simulation loop (`docs/config.md#replay`).
//!
//! Simulated time, in ms, is never slept: a step that starts at `t` ends at
//! `t +` the cost model's prediction for what it ran (`docs/cost-model.md`; by default
//! `base_ms + per_token_ms * ran_tokens`), times the optional noise. Before each step every request that arrived by `t`
//! is admitted (in trace order); when nothing is queued the clock jumps to the next arrival.
//! A prompt's final chunk yields its first token at the end of its step; each further token
//! takes its continuing `decode` row one step it runs in.

use std::io::IsTerminal;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Arc;

use indicatif::{ProgressBar, ProgressStyle};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::prefix_cache::PrefixCache;
use super::report::{ChunkCounts, Latency, OverrunCounts, ReplayReport, TokenCounts};
use super::step_log::StepLog;
use super::trace::Trace;
use super::{ReplayError, ReplayOptions, Setup, DECODE_WALK, PREFILL_WALK};
use crate::latency::StepFeatures;
use crate::overrun::OverrunReason;
use crate::planner::Work;
use crate::prepared::PreparedInput;
use crate::scheduler::{Batch, NextStep, RowChangeRef};
use crate::ChunkingManagement;

/// Steps between progress bar updates (drawing per step would cost more than the step).
const PROGRESS_EVERY: u64 = 256;

/// A request's life in the simulation.
#[derive(Debug, Clone, Copy, Default)]
struct ReqState {
    /// Tokens still to generate after the current one.
    remaining: u32,
    /// When its last token was generated (simulated ms).
    last_token_ms: f64,
    /// Chunks its prompt ran in.
    chunks: u32,
}

/// One replay in progress.
pub struct Sim<'a> {
    cm: &'a ChunkingManagement,
    setup: &'a Setup,
    trace: &'a Trace,
    opts: &'a ReplayOptions,
    step_log: Option<StepLog>,
    /// Arrivals in simulated ms (trace times scaled by `1 / rate_scale`).
    arrivals: Vec<f64>,
    /// `rid -> index` into the trace's requests (rids skip bad lines).
    index_of_rid: Vec<u32>,
    state: Vec<ReqState>,
    cache: Option<PrefixCache>,
    rng: SmallRng,
    /// Draws the cost noise; its own stream, so the speculation draws stay as they were.
    noise_rng: SmallRng,
    /// The estimate a decode row is registered with: 1, or `k + 1` with `k` speculative tokens.
    estimate: u32,

    t_ms: f64,
    /// Prompts admitted and not yet through their final chunk; decode rows registered.
    prefilling: usize,
    decoding: usize,
    /// Prepared inputs held, mirrored from admissions and final chunks, for the peak.
    held_rows: usize,
    held_tokens: u64,
    /// Requests whose last token was generated.
    done: usize,
    /// Reused per step: the tokens each row ran.
    ran: Vec<u32>,
    /// The next request to admit, by index.
    next_arrival: usize,
    /// The next step's batch, answered with the last step's completion (one round trip a
    /// step, `ChunkingManagement::complete_and_assemble_with`).
    pending: Option<Arc<Batch>>,

    report: ReplayReport,
    budget_sum: u64,
    budget_used: u64,
    /// The same sums over the steps that cut a prompt.
    cut_budget_sum: u64,
    cut_budget_used: u64,
    ttft: Vec<f64>,
    tbt: Vec<f32>,
    /// Set to a signal number when the replay is to stop at the next step boundary.
    stop: Option<Arc<AtomicI32>>,
}

/// What one step did.
enum Stepped {
    Ran,
    /// The step had no row: nothing eligible for its walk.
    Empty,
}

impl<'a> Sim<'a> {
    /// Prepares a replay of `trace` on `cm` (policies and budgets already set).
    pub fn new(
        cm: &'a ChunkingManagement,
        setup: &'a Setup,
        trace: &'a Trace,
        opts: &'a ReplayOptions,
        step_log: Option<StepLog>,
    ) -> Self {
        let reqs = &trace.requests;
        let last_rid = reqs.last().map_or(0, |r| r.rid);
        let mut index_of_rid = vec![u32::MAX; usize::try_from(last_rid).unwrap_or(0) + 1];
        for (i, r) in reqs.iter().enumerate() {
            index_of_rid[r.rid as usize] = i as u32;
        }
        let report = ReplayReport {
            // Filled in by `replay::run`, which knows the budgets and the trace's reading.
            settings: Default::default(),
            step_ms: Default::default(),
            warnings: Vec::new(),
            trace: trace.file.clone(),
            format: trace.format,
            node: setup.node.clone(),
            walks: setup.walks.clone(),
            budget_off: opts.budget_off,
            rate_scale: opts.rate_scale,
            requests: reqs.len(),
            skipped_lines: trace.skipped_lines,
            bad_line_examples: trace.bad_line_examples.clone(),
            steps: 0,
            budgeted_steps: 0,
            tokens: TokenCounts::default(),
            budget_utilisation: None,
            cut_steps: 0,
            cut_step_utilisation: None,
            chunks: ChunkCounts::default(),
            overruns: OverrunCounts::default(),
            time_overruns: Default::default(),
            latency_model: Default::default(),
            decode_row_waits: 0,
            ttft_ms: None,
            tbt_ms: None,
            peak_prepared_rows: 0,
            peak_prepared_tokens: 0,
            prepared_left_rows: 0,
            prepared_left_tokens: 0,
            simulated_ms: 0.0,
            wall_ms: 0.0,
            steps_per_second: 0.0,
            step_log: step_log.as_ref().map(|l| l.path().display().to_string()),
            interrupted: None,
        };
        Self {
            cm,
            setup,
            trace,
            opts,
            step_log,
            arrivals: reqs
                .iter()
                .map(|r| r.arrival_ms / opts.rate_scale)
                .collect(),
            index_of_rid,
            state: vec![ReqState::default(); reqs.len()],
            cache: (setup.cache_blocks > 0)
                .then(|| PrefixCache::new(setup.cache_blocks, setup.cache_block_tokens)),
            rng: SmallRng::seed_from_u64(setup.seed),
            noise_rng: SmallRng::seed_from_u64(setup.seed ^ 0x9e37_79b9_7f4a_7c15),
            estimate: setup.spec_tokens + 1,
            t_ms: 0.0,
            prefilling: 0,
            decoding: 0,
            held_rows: 0,
            held_tokens: 0,
            done: 0,
            ran: Vec::new(),
            next_arrival: 0,
            pending: None,
            report,
            budget_sum: 0,
            budget_used: 0,
            cut_budget_sum: 0,
            cut_budget_used: 0,
            // Latency samples grow with the tokens generated, never reserved from the trace's
            // declared sizes (50,000 rows within the limits would declare 10^11 tokens).
            ttft: Vec::new(),
            tbt: Vec::new(),
            stop: None,
        }
    }

    /// Stops the replay at the next step boundary once `flag` holds a signal number (not 0):
    /// the report then covers what ran and names the signal.
    #[must_use]
    pub fn stop_on(mut self, flag: Arc<AtomicI32>) -> Self {
        self.stop = Some(flag);
        self
    }

    /// Runs the replay to the end: every request admitted, prefilled and done generating.
    ///
    /// # Errors
    /// An actor refused or did not answer, the step log could not be written, or the queues
    /// stalled (rows queued that no step schedules).
    pub async fn run(mut self) -> Result<ReplayReport, ReplayError> {
        let progress = self.progress_bar();
        let n = self.arrivals.len();
        let mut turn = 0usize;
        let mut empty_streak = 0usize;
        loop {
            if let Some(sig) = self.stop.as_ref().map(|f| f.load(Ordering::SeqCst)) {
                if sig != 0 {
                    self.report.interrupted = Some(super::signal_name(sig));
                    break;
                }
            }
            if self.prefilling == 0 && self.decoding == 0 {
                if self.next_arrival == n {
                    break;
                }
                self.t_ms = self.t_ms.max(self.arrivals[self.next_arrival]);
            }
            self.admit_arrived(self.t_ms).await?;
            let setup = self.setup;
            let walk = &setup.walks[turn % setup.walks.len()];
            turn += 1;
            let next_walk = &setup.walks[turn % setup.walks.len()];
            match self.step(walk, next_walk).await? {
                Stepped::Ran => empty_streak = 0,
                Stepped::Empty => {
                    empty_streak += 1;
                    // Every step walk had its turn and none scheduled a row: nothing will change.
                    if empty_streak >= self.setup.walks.len() {
                        return Err(ReplayError::Stalled {
                            t_ms: self.t_ms,
                            node: self.setup.node.clone(),
                            prefilling: self.prefilling,
                            decoding: self.decoding,
                        });
                    }
                }
            }
            if let Some(hook) = &self.opts.on_step {
                hook.call(self.report.steps);
            }
            if let Some(pb) = &progress {
                if self.report.steps.is_multiple_of(PROGRESS_EVERY) {
                    pb.set_position(self.done as u64);
                }
            }
        }
        if let Some(pb) = progress {
            pb.finish_and_clear();
        }
        // Interrupted: the step assembled with the last completion never runs.
        if let Some(batch) = self.pending.take() {
            // A use of `abandon` (its signature changes with issue 18).
            self.cm
                .abandon(&self.setup.node, batch.step)
                .await
                .map_err(ReplayError::chunking("abandoning the next step"))?;
        }
        self.finish()
    }

    /// Admits every request that arrived by `t_ms`, in trace order.
    async fn admit_arrived(&mut self, t_ms: f64) -> Result<(), ReplayError> {
        while self.next_arrival < self.arrivals.len() && self.arrivals[self.next_arrival] <= t_ms {
            self.admit(self.next_arrival).await?;
            self.next_arrival += 1;
        }
        Ok(())
    }

    fn progress_bar(&self) -> Option<ProgressBar> {
        if !self.opts.progress || !std::io::stderr().is_terminal() {
            return None;
        }
        let pb = ProgressBar::new(self.arrivals.len() as u64);
        if let Ok(style) = ProgressStyle::with_template(
            "{spinner} replay [{elapsed_precise}] {wide_bar} {pos}/{len} requests done ({eta})",
        ) {
            pb.set_style(style);
        }
        Some(pb)
    }

    /// Admits request `i`: its prompt as a real prepared input, its cached prefix looked up.
    async fn admit(&mut self, i: usize) -> Result<(), ReplayError> {
        let (rid, input, cached) = self.admission(i);
        self.cm
            .admit(rid, &self.setup.node, PREFILL_WALK, input, cached)
            .await
            .map_err(ReplayError::chunking("admitting a prompt"))
    }

    /// Request `i`'s prompt as a real prepared input, with its cached prefix looked up;
    /// counted as prefilling and held from now on.
    fn admission(&mut self, i: usize) -> (u64, PreparedInput, u32) {
        let r = &self.trace.requests[i];
        let n = r.input_tokens;
        // Synthetic token ids, but a real allocation of the prompt's length.
        let base = (r.rid as u32).wrapping_mul(31);
        let ids: Arc<[u32]> = (0..n).map(|t| base.wrapping_add(t)).collect();
        let cached = match &mut self.cache {
            Some(c) => c.lookup(self.trace.hashes(r), n),
            None => 0,
        };
        if cached > 0 {
            self.report.chunks.prefix_cache_hits += 1;
            self.report.tokens.cached += u64::from(cached);
        }
        self.prefilling += 1;
        self.held_rows += 1;
        self.held_tokens += u64::from(n);
        self.report.peak_prepared_rows = self.report.peak_prepared_rows.max(self.held_rows);
        self.report.peak_prepared_tokens = self.report.peak_prepared_tokens.max(self.held_tokens);
        (r.rid, PreparedInput::tokens(ids), cached)
    }

    /// `next` with every request that arrived by `t_ms` admitted, in trace order.
    fn admissions_arrived(&mut self, t_ms: f64, mut next: NextStep) -> NextStep {
        while self.next_arrival < self.arrivals.len() && self.arrivals[self.next_arrival] <= t_ms {
            let (rid, input, cached) = self.admission(self.next_arrival);
            next = next.admit(rid, PREFILL_WALK, input, cached);
            self.next_arrival += 1;
        }
        next
    }

    /// Tokens a continuing row actually runs: its estimate, or with speculation and probability
    /// `overshoot_rate`, 1 to `k` more (the merge sized it before its input existed).
    fn continue_ran(&mut self, estimate: u32) -> u32 {
        let k = self.setup.spec_tokens;
        if k == 0 || self.setup.overshoot_rate <= 0.0 {
            return estimate;
        }
        if self.rng.gen_bool(self.setup.overshoot_rate) {
            estimate + self.rng.gen_range(1..=k)
        } else {
            estimate
        }
    }

    /// The simulated duration of `batch` as it ran (`self.ran`): the cost model over what it ran
    /// (`docs/cost-model.md`), times a noise factor from `[1 - noise, 1 + noise]`.
    fn step_ms(&mut self, batch: &crate::scheduler::Batch) -> f64 {
        let mut features = StepFeatures::EMPTY;
        for (row, &r) in batch.rows.iter().zip(&self.ran) {
            match row.work {
                Work::Continue { .. } => features.add_continuing(r, row.context),
                Work::Chunk { range, .. } => features.add_chunk(range.start, range.end),
            }
        }
        let ms = self.setup.cost.predict_ms(&features);
        if self.setup.noise > 0.0 {
            let r = self.setup.noise;
            ms * self.noise_rng.gen_range(1.0 - r..=1.0 + r)
        } else {
            ms
        }
    }

    /// Runs one step of `walk`: the batch answered with the last completion, or a new one.
    /// Completes it and assembles the next step of `next_walk` in one round trip, with the row
    /// changes it brought (requests done, prompts that decode from now on) and the arrivals up
    /// to its end admitted before that step is planned; when nothing is left queued, completes
    /// it alone (the clock then jumps to the next arrival).
    async fn step(&mut self, walk: &str, next_walk: &str) -> Result<Stepped, ReplayError> {
        let cm = self.cm;
        let node = self.setup.node.as_str();
        let batch = match self.pending.take() {
            Some(batch) => batch,
            None => cm
                .assemble(node, walk)
                .await
                .map_err(ReplayError::chunking("assembling a step"))?,
        };
        if batch.rows.is_empty() {
            cm.complete(batch.step, Vec::new())
                .await
                .map_err(ReplayError::chunking("completing an empty step"))?;
            return Ok(Stepped::Empty);
        }

        self.ran.clear();
        let mut decode_rows = 0usize;
        let mut cuts = false;
        for row in &batch.rows {
            let r = match row.work {
                Work::Continue { estimate } => {
                    decode_rows += 1;
                    self.continue_ran(estimate)
                }
                Work::Chunk { range, .. } => {
                    cuts |= !range.is_final();
                    range.tokens()
                }
            };
            self.ran.push(r);
        }
        let t_start = self.t_ms;
        let step_ms = self.step_ms(&batch);
        let t_end = t_start + step_ms;
        self.report.step_ms.record(step_ms);
        // Decode rows registered before this step that it did not run waited a step.
        if walk != PREFILL_WALK {
            self.report.decode_row_waits += self.decoding.saturating_sub(decode_rows) as u64;
        }
        let next = self.rows_ran(&batch, t_end, NextStep::new(node, next_walk));

        let outcome = if self.prefilling == 0 && self.decoding == 0 {
            let outcome = cm
                .complete_measured(batch.step, self.ran.clone(), step_ms)
                .await
                .map_err(ReplayError::chunking("completing a step"))?;
            self.apply_alone(&next).await?;
            outcome
        } else {
            // Requests that arrived while the step ran are queued before the next is planned.
            let next = self.admissions_arrived(t_end, next);
            let done = cm
                .complete_and_assemble_with(batch.step, self.ran.clone(), Some(step_ms), next)
                .await
                .map_err(ReplayError::chunking("completing a step"))?;
            self.pending = Some(
                done.next
                    .map_err(ReplayError::chunking("assembling a step"))?,
            );
            done.outcome
        };
        if let Some(log) = &mut self.step_log {
            log.write(t_start, &batch, &outcome)
                .map_err(|source| ReplayError::Write {
                    what: "step log",
                    path: log.path().to_owned(),
                    source,
                })?;
        }

        let rep = &mut self.report;
        rep.steps += 1;
        rep.tokens.scheduled += batch.scheduled_tokens;
        rep.tokens.ran += outcome.tokens.ran;
        if let Some(b) = batch.budget {
            rep.budgeted_steps += 1;
            self.budget_sum += u64::from(b);
            let used = batch.scheduled_tokens.min(u64::from(b));
            self.budget_used += used;
            if cuts {
                rep.cut_steps += 1;
                self.cut_budget_sum += u64::from(b);
                self.cut_budget_used += used;
            }
        }
        if let Some(reason) = outcome.time_overrun {
            rep.time_overruns.count(reason);
        }
        rep.latency_model = outcome.model.into();
        if let Some(o) = &outcome.overrun {
            let c = &mut rep.overruns;
            c.total += 1;
            match o.reason {
                OverrunReason::UncutRow => c.uncut_row += 1,
                OverrunReason::SpeculationEstimate => c.speculation_estimate += 1,
                OverrunReason::Other => c.other += 1,
            }
        }
        self.t_ms = t_end;
        Ok(Stepped::Ran)
    }

    /// What the rows of `batch` did, as they ran (`self.ran`) and ended at `t_end`: tokens
    /// generated, requests done, prompts through their final chunk. Returns `next` with the row
    /// changes that follow: done requests end, prompts that generate more continue on `decode`.
    fn rows_ran(&mut self, batch: &Batch, t_end: f64, mut next: NextStep) -> NextStep {
        for k in 0..batch.rows.len() {
            let (row, r) = (&batch.rows[k], self.ran[k]);
            let Some(i) = self
                .index_of_rid
                .get(row.rid as usize)
                .copied()
                .filter(|i| *i != u32::MAX)
            else {
                continue;
            };
            let i = i as usize;
            match row.work {
                Work::Continue { .. } => {
                    self.report.tokens.decode += u64::from(r);
                    self.report.tokens.generated += 1;
                    let s = &mut self.state[i];
                    self.tbt.push((t_end - s.last_token_ms) as f32);
                    s.last_token_ms = t_end;
                    s.remaining = s.remaining.saturating_sub(1);
                    if s.remaining == 0 {
                        next = next.forget_request(row.rid);
                        self.decoding -= 1;
                        self.done += 1;
                    }
                }
                Work::Chunk { range, .. } => {
                    self.report.tokens.prefill += u64::from(r);
                    self.report.chunks.total += 1;
                    self.state[i].chunks += 1;
                    if !range.is_final() {
                        continue;
                    }
                    if self.first_token(i, range.total, t_end) {
                        next = next.continue_row(row.rid, DECODE_WALK, self.estimate);
                        self.decoding += 1;
                    }
                }
            }
        }
        next
    }

    /// The row changes of `next` as separate calls, in its order, for a step completed without
    /// assembling the next one.
    async fn apply_alone(&self, next: &NextStep) -> Result<(), ReplayError> {
        for change in next.row_changes() {
            match change {
                RowChangeRef::Forget(rid) => self
                    .cm
                    .forget_request(rid)
                    .await
                    .map_err(ReplayError::chunking("ending a finished request"))?,
                RowChangeRef::Continue {
                    rid,
                    walk,
                    estimate,
                } => self
                    .cm
                    .continue_row(rid, &self.setup.node, walk, estimate)
                    .await
                    .map_err(ReplayError::chunking("continuing a request on `decode`"))?,
                RowChangeRef::Admit {
                    rid,
                    walk,
                    input,
                    cached,
                } => self
                    .cm
                    .admit(rid, &self.setup.node, walk, input.clone(), cached)
                    .await
                    .map_err(ReplayError::chunking("admitting a prompt"))?,
            }
        }
        Ok(())
    }

    /// A prompt's final chunk ran: its prepared input is released, its first token is out.
    /// Returns whether it generates more (it then continues as a decode row).
    fn first_token(&mut self, i: usize, total: u32, t_end: f64) -> bool {
        let req = &self.trace.requests[i];
        self.report.chunks.final_chunks += 1;
        self.report.tokens.generated += 1;
        if self.state[i].chunks > 1 {
            self.report.chunks.prompts_cut += 1;
        }
        self.prefilling -= 1;
        self.held_rows -= 1;
        self.held_tokens -= u64::from(total);
        self.ttft.push(t_end - self.arrivals[i]);
        if let Some(c) = &mut self.cache {
            c.insert(self.trace.hashes(req));
        }
        let s = &mut self.state[i];
        s.last_token_ms = t_end;
        s.remaining = req.output_tokens.saturating_sub(1);
        if s.remaining == 0 {
            self.done += 1;
            return false;
        }
        true
    }

    fn finish(mut self) -> Result<ReplayReport, ReplayError> {
        if let Some(log) = self.step_log.take() {
            let path = log.path().to_owned();
            log.finish().map_err(|source| ReplayError::Write {
                what: "step log",
                path,
                source,
            })?;
        }
        let first = self.arrivals.first().copied().unwrap_or(0.0);
        let mut rep = self.report;
        rep.simulated_ms = self.t_ms - first;
        rep.budget_utilisation =
            (self.budget_sum > 0).then(|| self.budget_used as f64 / self.budget_sum as f64);
        rep.cut_step_utilisation = (self.cut_budget_sum > 0)
            .then(|| self.cut_budget_used as f64 / self.cut_budget_sum as f64);
        rep.ttft_ms = Latency::of(&mut self.ttft);
        rep.tbt_ms = Latency::of(&mut self.tbt);
        Ok(rep)
    }
}
