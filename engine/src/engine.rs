//! The engine loop: an actor on a thread of its own that owns the model, every request's KV
//! cache and the component's handle, and runs one model step per assembled batch.
//!
//! Its mailbox takes [`Command`]s (submit, drain, stats). Each turn of the loop:
//! 1. reads the mailbox; drops requests whose client went away (`forget_request`);
//! 2. admits waiting requests, oldest first, while their KV reservation fits `kv_tokens`
//!    (a request waits for memory rather than failing);
//! 3. assembles a step on the combined walk `mixed` (prefill chunks and decode rows), runs it
//!    as one model step, and completes it with the measured wall time (`complete_measured`);
//! 4. samples a token for every final chunk and decode row; a request whose prompt finished
//!    becomes a decode row (`continue_row_with_context`); a finished request is forgotten.

use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::num::NonZeroU32;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use mstar_chunking::latency::LatencyModel;
use mstar_chunking::{
    ActorThread, Batch, BudgetSettings, BudgetValue, ChunkingManagement, ChunkingPolicy,
    DrainReport, PreparedInput, RowWork, StepOutcome, SubmoduleCaps,
};
use tokio::sync::{mpsc, oneshot};

use crate::model::{KvCache, Model, Sampler, StepRow};

/// The node the engine's model is registered as.
pub const NODE: &str = "llm";
/// The walk prompts are admitted on.
pub const PREFILL: &str = "prefill";
/// The walk generated tokens run on.
pub const DECODE: &str = "decode";
/// The combined walk every step is assembled on.
pub const MIXED: &str = "mixed";

/// How prompts are cut.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Chunking {
    /// A token budget per step (prompts are cut to fit it, aligned to `align`).
    Tokens(u32),
    /// No chunking: a prompt runs whole in one step.
    Off,
}

/// The engine's settings (`mstar-engine serve --help` names each flag).
#[derive(Debug, Clone)]
pub struct EngineSettings {
    /// The component's model label.
    pub name: String,
    /// Token budget per step.
    pub chunking: Chunking,
    /// Chunk alignment.
    pub align: u32,
    /// The floor: the fewest tokens a prompt is cut to.
    pub min_chunk_tokens: u32,
    /// A time budget per step, in ms.
    pub max_step_ms: Option<f64>,
    /// A latency model to plan with (else, with a time budget, the online fit).
    pub cost: Option<LatencyModel>,
    /// Fit the latency model online from measured step times.
    pub learn_cost: bool,
    /// Plan timed steps with a time margin at this quantile of the recent measured ÷ predicted
    /// step times (the component's `time_margin`).
    pub time_margin: Option<f64>,
    /// KV cache capacity in tokens over all requests (`engine.kv_tokens`).
    pub kv_tokens: u64,
    /// Requests that may wait for admission; more are refused (HTTP 503).
    pub max_waiting: usize,
    /// Where to write the step log (JSON Lines, as `replay --step-log`).
    pub step_log: Option<PathBuf>,
}

impl Default for EngineSettings {
    fn default() -> Self {
        EngineSettings {
            name: "mstar-engine".into(),
            chunking: Chunking::Tokens(256),
            align: 16,
            min_chunk_tokens: 16,
            max_step_ms: None,
            cost: None,
            learn_cost: false,
            time_margin: None,
            kv_tokens: 65_536,
            max_waiting: 1024,
            step_log: None,
        }
    }
}

/// A generation request, tokenised.
#[derive(Debug, Clone)]
pub struct GenRequest {
    /// The prompt's tokens.
    pub prompt: Vec<u32>,
    /// Tokens to generate at most (≥ 1).
    pub max_tokens: u32,
    /// Sampling temperature (0: greedy).
    pub temperature: f32,
    /// Nucleus sampling mass.
    pub top_p: f32,
    /// Sampling seed.
    pub seed: u64,
    /// Keep generating past EOS.
    pub ignore_eos: bool,
}

/// Why a request stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// It generated `max_tokens`.
    Length,
    /// It generated EOS.
    Stop,
    /// The engine shut down before it finished.
    Abort,
}

impl Finish {
    /// The OpenAI `finish_reason`.
    pub fn as_str(self) -> &'static str {
        match self {
            Finish::Length => "length",
            Finish::Stop => "stop",
            Finish::Abort => "abort",
        }
    }
}

/// What a request's stream receives.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A generated token.
    Token(u32),
    /// The request ended.
    Done {
        /// Why.
        finish: Finish,
        /// Prompt tokens.
        prompt_tokens: u32,
        /// Generated tokens.
        completion_tokens: u32,
    },
}

/// Why a submission is refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SubmitError {
    /// Too many requests wait already.
    #[error("the queue is full ({0} requests waiting)")]
    QueueFull(usize),
    /// The engine is shutting down.
    #[error("the engine is shutting down")]
    Draining,
    /// The request can never fit.
    #[error("{0}")]
    TooLarge(String),
    /// The engine stopped.
    #[error("the engine stopped")]
    Stopped,
}

/// A snapshot of the engine's state.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineStats {
    /// Requests admitted and not finished.
    pub running: usize,
    /// Requests waiting for KV memory.
    pub waiting: usize,
    /// KV tokens held by caches now.
    pub kv_used: u64,
    /// KV tokens reserved by admitted requests.
    pub kv_reserved: u64,
    /// KV capacity.
    pub kv_capacity: u64,
    /// Prepared inputs the component holds: (rows, tokens).
    pub prepared: (usize, u64),
    /// Prefill rows queued in the component.
    pub prefill_rows: usize,
    /// Continuing rows queued in the component.
    pub continuing_rows: usize,
    /// Steps in flight in the component.
    pub steps_in_flight: usize,
    /// Steps run.
    pub steps: u64,
}

/// The engine's mailbox.
pub enum Command {
    /// Queue a request; its events go to `events`.
    Submit {
        /// The request.
        req: GenRequest,
        /// Its event stream; dropping the receiver aborts the request.
        events: mpsc::UnboundedSender<Event>,
        /// The answer: accepted (the request id) or refused.
        reply: oneshot::Sender<Result<u64, SubmitError>>,
    },
    /// Stop admitting; finish running requests within `grace`, abort the rest, then stop.
    Drain {
        /// The grace period.
        grace: Duration,
        /// Answered when the engine has stopped, with what the component's drain dropped.
        done: oneshot::Sender<Option<DrainReport>>,
    },
    /// Report [`EngineStats`].
    Stats(oneshot::Sender<EngineStats>),
}

/// A handle to the engine actor (cheap to clone).
#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::UnboundedSender<Command>,
    /// The component's handle, for its metrics and state.
    pub chunking: ChunkingManagement,
    /// The served model's tokenizer.
    pub tokenizer: std::sync::Arc<crate::tokenizer::Tokenizer>,
}

impl EngineHandle {
    /// Submits a request: its events arrive on the returned receiver (drop it to abort).
    ///
    /// # Errors
    /// The refusal of [`SubmitError`].
    pub async fn submit(
        &self,
        req: GenRequest,
    ) -> Result<(u64, mpsc::UnboundedReceiver<Event>), SubmitError> {
        let (events, rx) = mpsc::unbounded_channel();
        let (reply, answer) = oneshot::channel();
        self.tx
            .send(Command::Submit { req, events, reply })
            .map_err(|_| SubmitError::Stopped)?;
        let rid = answer.await.map_err(|_| SubmitError::Stopped)??;
        Ok((rid, rx))
    }

    /// The engine's state.
    pub async fn stats(&self) -> Option<EngineStats> {
        let (tx, rx) = oneshot::channel();
        self.tx.send(Command::Stats(tx)).ok()?;
        rx.await.ok()
    }

    /// Stops admitting, lets running requests finish for `grace`, aborts the rest, then drains
    /// the component (`ChunkingManagement::drain`); returns when the engine has stopped, with
    /// the component's report (all zeros: every request was finished or forgotten first).
    /// `None` when the engine had already stopped or the component's drain failed.
    pub async fn drain(&self, grace: Duration) -> Option<DrainReport> {
        let (done, rx) = oneshot::channel();
        self.tx.send(Command::Drain { grace, done }).ok()?;
        rx.await.ok().flatten()
    }
}

/// The component's budgets for `settings`.
pub fn budget_settings(settings: &EngineSettings) -> BudgetSettings {
    let mut b = BudgetSettings::new([PREFILL, DECODE, MIXED])
        .combined(MIXED, [PREFILL, DECODE])
        .min_chunk_tokens(NonZeroU32::new(settings.min_chunk_tokens.max(1)).expect("max(1)"));
    if settings.chunking == Chunking::Off {
        b = b.budget(NODE, BudgetValue::Off);
    }
    if let Some(ms) = settings.max_step_ms {
        b = b.max_step_ms(NODE, ms);
    }
    if let Some(m) = settings.cost {
        b = b.cost(NODE, m);
    }
    b.time.learn = settings.learn_cost;
    if let Some(q) = settings.time_margin {
        b = b.time_margin(q);
    }
    b
}

/// Starts the component on its own thread and binds the engine's policies and budgets (from
/// inside a runtime: call it on the engine's thread).
///
/// # Errors
/// The component refused the settings.
pub async fn start_chunking(
    settings: &EngineSettings,
) -> Result<(ChunkingManagement, ActorThread), String> {
    let (cm, thread) = ChunkingManagement::start_on_own_thread(
        &settings.name,
        [(NODE, SubmoduleCaps::new([PREFILL, MIXED], false))],
    )
    .map_err(|e| e.to_string())?;
    let budget = match settings.chunking {
        Chunking::Tokens(b) => b,
        Chunking::Off => 1 << 20,
    };
    let policy = ChunkingPolicy::budget(budget).aligned(settings.align.max(1));
    cm.set_policies([((NODE, PREFILL), policy), ((NODE, MIXED), policy)])
        .await
        .map_err(|e| format!("setting the policies: {e}"))?;
    cm.set_budgets(budget_settings(settings))
        .await
        .map_err(|e| format!("setting the budgets: {e}"))?;
    Ok((cm, thread))
}

struct Running {
    req: GenRequest,
    events: mpsc::UnboundedSender<Event>,
    cache: KvCache,
    sampler: Sampler,
    /// The last sampled token, not yet run (a decode row runs it).
    pending: Option<u32>,
    generated: u32,
    reserved: u64,
    arrived: Instant,
    last_token: Option<Instant>,
}

struct Waiting {
    rid: u64,
    req: GenRequest,
    events: mpsc::UnboundedSender<Event>,
    arrived: Instant,
}

/// Starts the engine actor on a thread of its own. Returns its handle and the thread.
///
/// # Errors
/// The component refused the settings, or the step log cannot be created.
pub fn start(
    model: Model,
    settings: EngineSettings,
) -> Result<(EngineHandle, std::thread::JoinHandle<()>), String> {
    let log = match &settings.step_log {
        Some(p) => Some(BufWriter::new(
            File::create(p).map_err(|e| format!("step log {}: {e}", p.display()))?,
        )),
        None => None,
    };
    let tokenizer = model.tokenizer().clone();
    let (tx, rx) = mpsc::unbounded_channel();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let thread = std::thread::Builder::new()
        .name("mstar-engine".into())
        .spawn(move || {
            let rt = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    let _ = ready_tx.send(Err(e.to_string()));
                    return;
                }
            };
            let (cm, actors) = match rt.block_on(start_chunking(&settings)) {
                Ok(x) => x,
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                    return;
                }
            };
            let _ = ready_tx.send(Ok(cm.clone()));
            let mut engine = Engine {
                model,
                settings,
                cm,
                rx,
                running: HashMap::new(),
                waiting: VecDeque::new(),
                next_rid: AtomicU64::new(0),
                kv_reserved: 0,
                draining: None,
                steps: 0,
                log,
                started: Instant::now(),
            };
            rt.block_on(engine.run());
            if let Some(mut l) = engine.log.take() {
                let _ = l.flush();
            }
            drop(engine);
            actors.stop();
        })
        .map_err(|e| e.to_string())?;
    let chunking = ready_rx
        .recv()
        .map_err(|_| "the engine thread ended before starting".to_owned())??;
    Ok((
        EngineHandle {
            tx,
            chunking,
            tokenizer,
        },
        thread,
    ))
}

struct Engine {
    model: Model,
    settings: EngineSettings,
    cm: ChunkingManagement,
    rx: mpsc::UnboundedReceiver<Command>,
    running: HashMap<u64, Running>,
    waiting: VecDeque<Waiting>,
    next_rid: AtomicU64,
    kv_reserved: u64,
    /// Set by a drain: the deadline and who to tell.
    draining: Option<(Instant, Vec<oneshot::Sender<Option<DrainReport>>>)>,
    steps: u64,
    log: Option<BufWriter<File>>,
    started: Instant,
}

impl Engine {
    async fn run(&mut self) {
        loop {
            // 1. The mailbox: block only when there is nothing to run.
            let idle = self.running.is_empty() && self.waiting.is_empty();
            if idle {
                if self.draining.is_some() {
                    break;
                }
                match self.rx.recv().await {
                    Some(c) => self.handle(c).await,
                    None => break,
                }
            }
            while let Ok(c) = self.rx.try_recv() {
                self.handle(c).await;
            }
            self.drop_disconnected().await;
            match &self.draining {
                // Draining: no admission; stop once nothing runs or the grace period is over.
                Some((deadline, _)) => {
                    if self.running.is_empty() || Instant::now() >= *deadline {
                        self.abort_all().await;
                        break;
                    }
                }
                // 2. Admission under the KV bound.
                None => self.admit().await,
            }
            if self.running.is_empty() {
                continue;
            }
            // 3. One step.
            if let Err(e) = self.step().await {
                tracing::error!(error = %e, "engine step failed; aborting its requests");
                self.abort_all().await;
            }
        }
        if let Some((_, tellers)) = self.draining.take() {
            // Shut the component down too: every request was finished or aborted (and forgotten)
            // above, so its report is all zeros unless something was left behind.
            let report = match self.cm.drain().await {
                Ok(report) if report == DrainReport::default() => {
                    tracing::info!("component drained; it held nothing");
                    Some(report)
                }
                Ok(report) => {
                    tracing::warn!(?report, "component drained what was left");
                    Some(report)
                }
                Err(e) => {
                    tracing::warn!(error = %e, "component drain failed");
                    None
                }
            };
            for t in tellers {
                let _ = t.send(report);
            }
        }
    }

    async fn handle(&mut self, c: Command) {
        match c {
            Command::Submit { req, events, reply } => {
                let r = self.check(&req).map(|()| {
                    let rid = self.next_rid.fetch_add(1, Ordering::Relaxed);
                    self.waiting.push_back(Waiting {
                        rid,
                        req,
                        events,
                        arrived: Instant::now(),
                    });
                    rid
                });
                let _ = reply.send(r);
                metrics::gauge!("engine_requests_waiting").set(self.waiting.len() as f64);
            }
            Command::Drain { grace, done } => match &mut self.draining {
                Some((_, tellers)) => tellers.push(done),
                None => self.draining = Some((Instant::now() + grace, vec![done])),
            },
            Command::Stats(tx) => {
                let _ = tx.send(self.stats().await);
            }
        }
    }

    fn check(&self, req: &GenRequest) -> Result<(), SubmitError> {
        if self.draining.is_some() {
            return Err(SubmitError::Draining);
        }
        if self.waiting.len() >= self.settings.max_waiting {
            return Err(SubmitError::QueueFull(self.waiting.len()));
        }
        let need = reservation(req);
        if need > self.settings.kv_tokens {
            return Err(SubmitError::TooLarge(format!(
                "prompt ({} tokens) + max_tokens ({}) = {need} exceeds the engine's KV capacity of {} tokens",
                req.prompt.len(),
                req.max_tokens,
                self.settings.kv_tokens
            )));
        }
        if need > self.model.config.max_positions as u64 {
            return Err(SubmitError::TooLarge(format!(
                "prompt ({} tokens) + max_tokens ({}) = {need} exceeds the model's context of {} tokens",
                req.prompt.len(),
                req.max_tokens,
                self.model.config.max_positions
            )));
        }
        Ok(())
    }

    async fn stats(&self) -> EngineStats {
        let prepared = self.cm.prepared_totals().await.unwrap_or((usize::MAX, 0));
        let q = self.cm.queue_stats().await.ok();
        EngineStats {
            running: self.running.len(),
            waiting: self.waiting.len(),
            kv_used: self.kv_used(),
            kv_reserved: self.kv_reserved,
            kv_capacity: self.settings.kv_tokens,
            prepared,
            prefill_rows: q.as_ref().map_or(usize::MAX, |q| q.prefill_rows),
            continuing_rows: q.as_ref().map_or(usize::MAX, |q| q.continuing_rows),
            steps_in_flight: q.as_ref().map_or(usize::MAX, |q| q.steps_in_flight),
            steps: self.steps,
        }
    }

    fn kv_used(&self) -> u64 {
        self.running.values().map(|r| r.cache.len() as u64).sum()
    }

    fn publish_gauges(&self) {
        metrics::gauge!("engine_requests_running").set(self.running.len() as f64);
        metrics::gauge!("engine_requests_waiting").set(self.waiting.len() as f64);
        metrics::gauge!("engine_kv_tokens_used").set(self.kv_used() as f64);
        metrics::gauge!("engine_kv_tokens_reserved").set(self.kv_reserved as f64);
        metrics::gauge!("engine_kv_tokens_capacity").set(self.settings.kv_tokens as f64);
    }

    /// Requests whose client dropped its stream: forgotten, their memory released.
    async fn drop_disconnected(&mut self) {
        let gone: Vec<u64> = self
            .running
            .iter()
            .filter(|(_, r)| r.events.is_closed())
            .map(|(&rid, _)| rid)
            .collect();
        for rid in gone {
            self.finish(rid, Finish::Abort).await;
            metrics::counter!("engine_requests_total", "result" => "disconnected").increment(1);
        }
        let before = self.waiting.len();
        self.waiting.retain(|w| !w.events.is_closed());
        let dropped = before - self.waiting.len();
        if dropped > 0 {
            metrics::counter!("engine_requests_total", "result" => "disconnected")
                .increment(dropped as u64);
        }
    }

    async fn admit(&mut self) {
        while let Some(w) = self.waiting.front() {
            let need = reservation(&w.req);
            if self.kv_reserved + need > self.settings.kv_tokens {
                break; // waits for memory, in arrival order
            }
            let w = self.waiting.pop_front().expect("front exists");
            let input = PreparedInput::tokens(w.req.prompt.clone());
            if let Err(e) = self.cm.admit(w.rid, NODE, PREFILL, input, 0).await {
                tracing::error!(rid = w.rid, error = %e, "admit refused");
                let _ = w.events.send(Event::Done {
                    finish: Finish::Abort,
                    prompt_tokens: w.req.prompt.len() as u32,
                    completion_tokens: 0,
                });
                continue;
            }
            self.kv_reserved += need;
            let sampler = Sampler::new(w.req.seed, w.req.temperature, w.req.top_p);
            self.running.insert(
                w.rid,
                Running {
                    cache: KvCache::new(&self.model),
                    sampler,
                    pending: None,
                    generated: 0,
                    reserved: need,
                    arrived: w.arrived,
                    last_token: None,
                    req: w.req,
                    events: w.events,
                },
            );
        }
        self.publish_gauges();
    }

    async fn step(&mut self) -> Result<(), String> {
        let batch = self
            .cm
            .assemble(NODE, MIXED)
            .await
            .map_err(|e| format!("assemble: {e}"))?;
        if batch.rows.is_empty() {
            // Nothing eligible: an empty batch is not a step in flight (nothing to complete);
            // yield briefly rather than spin.
            tokio::time::sleep(Duration::from_millis(1)).await;
            return Ok(());
        }
        // Take each row's state out of the map so the model can borrow the caches mutably.
        let mut states: Vec<(u64, Running)> = Vec::with_capacity(batch.rows.len());
        let mut ran = Vec::with_capacity(batch.rows.len());
        let mut tokens: Vec<Vec<u32>> = Vec::with_capacity(batch.rows.len());
        let mut wants = Vec::with_capacity(batch.rows.len());
        for row in &batch.rows {
            let Some(state) = self.running.remove(&row.rid) else {
                return Err(format!("row of unknown request {}", row.rid));
            };
            match (&row.work, &row.input) {
                (RowWork::Chunk { range, .. }, Some(input)) => {
                    tokens.push(input.token_ids().to_vec());
                    wants.push(range.is_final());
                    ran.push(range.tokens());
                }
                (RowWork::Continue { .. }, _) => {
                    let t = state
                        .pending
                        .ok_or_else(|| format!("decode row {} has no token", row.rid))?;
                    tokens.push(vec![t]);
                    wants.push(true);
                    ran.push(1);
                }
                (RowWork::Chunk { .. }, None) => {
                    return Err(format!("chunk row {} without input", row.rid));
                }
            }
            states.push((row.rid, state));
        }
        let t0 = Instant::now();
        let t_ms = self.started.elapsed().as_secs_f64() * 1000.0;
        let result = {
            let mut rows: Vec<StepRow<'_>> = states
                .iter_mut()
                .zip(&tokens)
                .zip(&wants)
                .map(|(((_, s), t), &w)| StepRow {
                    tokens: t,
                    cache: &mut s.cache,
                    logits: w,
                })
                .collect();
            self.model.step(&mut rows)
        };
        let ms = t0.elapsed().as_secs_f64() * 1000.0;
        // Put the states back before anything can fail.
        let rids: Vec<u64> = states.iter().map(|(r, _)| *r).collect();
        for (rid, s) in states {
            self.running.insert(rid, s);
        }
        let logits = match result {
            Ok(l) => l,
            Err(e) => {
                let _ = self.cm.abandon(batch.step).await;
                return Err(format!("model step: {e}"));
            }
        };
        let outcome = self
            .cm
            .complete_measured(batch.step, ran, ms)
            .await
            .map_err(|e| format!("complete: {e}"))?;
        self.steps += 1;
        metrics::histogram!("engine_step_seconds").record(ms / 1000.0);
        metrics::counter!("engine_step_tokens_total").increment(batch.scheduled_tokens);
        self.write_log(t_ms, ms, &batch, &outcome);

        let now = Instant::now();
        for ((rid, row), l) in rids.iter().zip(&batch.rows).zip(logits) {
            let Some(l) = l else { continue };
            let Some(s) = self.running.get_mut(rid) else {
                continue;
            };
            let tok = s.sampler.sample(&l);
            s.generated += 1;
            s.pending = Some(tok);
            match s.last_token {
                None => metrics::histogram!("engine_ttft_seconds")
                    .record((now - s.arrived).as_secs_f64()),
                Some(prev) => {
                    metrics::histogram!("engine_tbt_seconds").record((now - prev).as_secs_f64())
                }
            }
            s.last_token = Some(now);
            let _ = s.events.send(Event::Token(tok));
            let done = if tok == self.model.tokenizer().eos() && !s.req.ignore_eos {
                Some(Finish::Stop)
            } else if s.generated >= s.req.max_tokens {
                Some(Finish::Length)
            } else {
                None
            };
            match done {
                Some(f) => self.finish(*rid, f).await,
                None => {
                    if matches!(row.work, RowWork::Chunk { .. }) {
                        let ctx = s.cache.len() as u64;
                        self.cm
                            .continue_row_with_context(*rid, NODE, DECODE, 1, ctx)
                            .await
                            .map_err(|e| format!("continue_row: {e}"))?;
                    }
                }
            }
        }
        self.publish_gauges();
        Ok(())
    }

    /// Ends a request: tells its client, forgets it in the component, frees its memory.
    async fn finish(&mut self, rid: u64, finish: Finish) {
        if let Some(s) = self.running.remove(&rid) {
            let _ = s.events.send(Event::Done {
                finish,
                prompt_tokens: s.req.prompt.len() as u32,
                completion_tokens: s.generated,
            });
            self.kv_reserved -= s.reserved;
            if finish != Finish::Abort {
                metrics::histogram!("engine_e2e_seconds").record(s.arrived.elapsed().as_secs_f64());
                metrics::counter!("engine_requests_total", "result" => finish.as_str())
                    .increment(1);
            }
        }
        if let Err(e) = self.cm.forget_request(rid).await {
            tracing::error!(rid, error = %e, "forget_request failed");
        }
    }

    async fn abort_all(&mut self) {
        let rids: Vec<u64> = self.running.keys().copied().collect();
        for rid in rids {
            self.finish(rid, Finish::Abort).await;
            metrics::counter!("engine_requests_total", "result" => "abort").increment(1);
        }
        for w in self.waiting.drain(..) {
            let _ = w.events.send(Event::Done {
                finish: Finish::Abort,
                prompt_tokens: w.req.prompt.len() as u32,
                completion_tokens: 0,
            });
        }
        self.publish_gauges();
    }

    fn write_log(&mut self, t_ms: f64, ms: f64, batch: &Batch, outcome: &StepOutcome) {
        let Some(log) = self.log.as_mut() else { return };
        let line = step_log_line(t_ms, ms, batch, outcome);
        if serde_json::to_writer(&mut *log, &line)
            .and_then(|()| log.write_all(b"\n").map_err(serde_json::Error::io))
            .is_err()
        {
            tracing::error!("step log write failed; the log is closed");
            self.log = None;
        }
    }
}

/// The KV tokens a request reserves at admission: its prompt and every token it may generate,
/// so an admitted request never runs out of memory mid-generation.
pub fn reservation(req: &GenRequest) -> u64 {
    req.prompt.len() as u64 + u64::from(req.max_tokens)
}

fn round_ms(v: f64) -> f64 {
    (v * 1000.0).round() / 1000.0
}

/// One step-log line in the shape of `replay --step-log` (docs/replay.md#the-step-log of the
/// component), with `ms` the measured wall time of the model step.
pub fn step_log_line(
    t_ms: f64,
    ms: f64,
    batch: &Batch,
    outcome: &StepOutcome,
) -> serde_json::Value {
    use serde_json::json;
    let rows: Vec<serde_json::Value> = batch
        .rows
        .iter()
        .map(|r| match r.work {
            RowWork::Continue { estimate } => json!({
                "rid": r.rid, "walk": batch.walk_of(r), "kind": "continue",
                "tokens": estimate, "context": r.context,
            }),
            RowWork::Chunk { range, cached } => {
                let first = range.stride == range.end;
                let mut v = json!({
                    "rid": r.rid, "walk": batch.walk_of(r), "kind": "chunk",
                    "tokens": range.tokens(), "start": range.start, "end": range.end,
                    "total": range.total, "stride": range.stride, "final": range.is_final(),
                });
                if first {
                    v["cached"] = json!(cached);
                }
                v
            }
        })
        .collect();
    let caps = batch.caps.as_deref().map(|c| {
        c.iter()
            .map(|(w, n)| (w.to_string(), json!(n)))
            .collect::<serde_json::Map<_, _>>()
    });
    json!({
        "step": batch.step,
        "t_ms": round_ms(t_ms),
        "node": &*batch.node,
        "walk": &*batch.walk,
        "budget": batch.budget,
        "floor": batch.floor,
        "caps": caps,
        "rows": rows,
        "scheduled_tokens": batch.scheduled_tokens,
        "ran_tokens": outcome.tokens.ran,
        "overrun": outcome.overrun.as_ref().map(|o| json!({"reason": o.reason.as_str()})),
        "waiting": batch.waiting,
        "ms": round_ms(ms),
        "predicted_ms": outcome.predicted_ms.map(round_ms),
        "max_step_ms": outcome.max_step_ms,
        "time_margin": outcome.time_margin,
        "time_overrun": outcome.time_overrun.map(|r| json!({"reason": r.as_str()})),
    })
}
