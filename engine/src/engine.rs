//! The engine loop: an actor on a thread of its own that owns the model, every request's KV
//! cache and the component's handle, and runs one model step per assembled batch.
//!
//! Its mailbox takes [`Command`]s (submit, drain, stats). Each turn of the loop:
//! 1. reads the mailbox; ends requests whose client went away (their cache and reservation
//!    freed at once);
//! 2. admits waiting requests, oldest first, while their KV reservation fits `kv_tokens`
//!    (a request waits for memory rather than failing);
//! 3. runs the step in flight (a batch on the combined walk `mixed`: prefill chunks and decode
//!    rows) as one model step;
//! 4. samples a token for every final chunk and decode row, and sends the component **one
//!    message**: `complete_and_assemble` with the measured wall time and a [`NextStep`]
//!    carrying the step's row changes (requests that ended: `forget_request`; prompts whose
//!    final chunk ran: `continue_row_with_context` on `decode`; requests admitted:
//!    `admit`), which answers the next step's batch.
//!
//! The fallback, one call per change and then `assemble`, runs only where no completion can
//! carry the changes: the first step of a walk (nothing in flight: the engine was idle or the
//! last batch was empty), and after a refused change (`flush_changes`).

use std::collections::{HashMap, VecDeque};
use std::num::NonZeroU32;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mstar_chunking::latency::LatencyModel;
use mstar_chunking::step_log::{StepLine, StepLogFile};
use mstar_chunking::{
    ActorThread, Batch, BudgetSettings, BudgetValue, ChunkingError, ChunkingManagement,
    ChunkingPolicy, DrainReport, NextStep, PreparedInput, RowWork, StepOutcome, SubmoduleCaps,
};
use tokio::sync::{mpsc, oneshot};

use crate::api::ModelLimits;
use crate::metrics::{self as em, Outcome};
use crate::model::{KvCache, Model, Sampler, StepRow};
use crate::sampling::SamplingParams;

/// The longest grace a drain may be given (`--grace-secs`): one day.
pub const MAX_GRACE: Duration = Duration::from_secs(86_400);

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
    /// Requests that may wait for KV memory; a request that would wait beyond them is refused
    /// (HTTP 503). A request that fits now is never counted.
    pub max_waiting: usize,
    /// Where to write the step log (JSON Lines, as `replay --step-log`).
    pub step_log: Option<PathBuf>,
    /// Called on the engine's thread with the step's id before each model step runs: a
    /// stand-in for a long step in tests (a hook that blocks holds the engine there).
    pub before_step: Option<StepHook>,
}

/// A function the engine calls before each model step ([`EngineSettings::before_step`]).
#[derive(Clone)]
pub struct StepHook(pub Arc<dyn Fn(u64) + Send + Sync>);

impl std::fmt::Debug for StepHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StepHook")
    }
}

impl EngineSettings {
    /// Refuses settings the engine cannot serve with, naming the flag that sets each. The
    /// budgets are checked by the component when the engine starts.
    ///
    /// # Errors
    /// A KV capacity of 0 (every request would be refused), a waiting queue of 0 (every
    /// request that has to wait would be refused, even on an idle engine).
    pub fn check(&self) -> Result<(), String> {
        if self.kv_tokens == 0 {
            return Err(
                "--kv-tokens 0: the KV capacity must be at least 1 token (0 refuses every request)"
                    .into(),
            );
        }
        if self.max_waiting == 0 {
            return Err("--max-waiting 0: at least 1 request must be able to wait for memory (0 refuses every request that has to wait)".into());
        }
        Ok(())
    }
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
            before_step: None,
        }
    }
}

/// A generation request, tokenised.
#[derive(Debug, Clone, Default)]
pub struct GenRequest {
    /// The prompt's tokens.
    pub prompt: Vec<u32>,
    /// Tokens to generate at most (≥ 1).
    pub max_tokens: u32,
    /// How its tokens are drawn, what ends it and what is sent with each token.
    pub sampling: SamplingParams,
}

/// The most alternatives a token's log-probabilities list (OpenAI's `top_logprobs` bound).
pub use crate::sampling::MAX_TOP_LOGPROBS;

/// A generated token's log-probability under the model (the softmax of its logits, before
/// temperature and top-p), and the most likely tokens at its position with theirs.
#[derive(Debug, Clone, PartialEq)]
pub struct Logprobs {
    /// The token's log-probability.
    pub logprob: f32,
    /// The most likely tokens, most likely first: (token, log-probability).
    pub top: Vec<(u32, f32)>,
}

impl Logprobs {
    /// The log-probability of `token` under `logits`, and the `top` most likely tokens.
    pub fn of(logits: &[f32], token: u32, top: usize) -> Self {
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let sum: f64 = logits.iter().map(|&l| f64::from(l - max).exp()).sum();
        let lse = f64::from(max) + sum.ln();
        let lp = |t: u32| (f64::from(logits[t as usize]) - lse) as f32;
        let mut best: Vec<u32> = Vec::with_capacity(top + 1);
        if top > 0 {
            for (i, &l) in logits.iter().enumerate() {
                let pos = best
                    .iter()
                    .position(|&b| l > logits[b as usize])
                    .unwrap_or(best.len());
                if pos < top {
                    best.insert(pos, i as u32);
                    best.truncate(top);
                }
            }
        }
        Logprobs {
            logprob: logits
                .get(token as usize)
                .map_or(f32::NEG_INFINITY, |_| lp(token)),
            top: best.into_iter().map(|t| (t, lp(t))).collect(),
        }
    }
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
    /// A generated token, with its log-probabilities when the request asked for them.
    Token {
        /// The token.
        id: u32,
        /// Its log-probabilities ([`SamplingParams::logprobs`]).
        logprobs: Option<Logprobs>,
    },
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
    /// Too many requests wait for KV memory already.
    #[error("the queue is full ({0} requests waiting for KV memory)")]
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
    /// Requests accepted and not admitted yet (waiting for KV memory, or for the next turn).
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
    /// End a request as finished with `stop` (its client matched a stop string): its memory is
    /// freed at once and it is counted `result="stop"`.
    Stop(u64),
}

/// A handle to the engine actor (cheap to clone).
#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::UnboundedSender<Command>,
    /// The component's handle, for its metrics and state.
    pub chunking: ChunkingManagement,
    /// What the model bounds a request by.
    pub limits: ModelLimits,
    /// The served model's tokenizer.
    pub tokenizer: std::sync::Arc<crate::tokenizer::Tokenizer>,
    /// The KV capacity in tokens (`--kv-tokens`): no request reserves more.
    pub kv_tokens: u64,
    /// The time budget per step (`--max-step-ms`), for `/health`.
    pub max_step_ms: Option<f64>,
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

    /// Ends request `rid` as finished with `stop` at the engine's next turn (a stop string was
    /// matched in its text); tokens it generates meanwhile are still sent.
    pub fn stop(&self, rid: u64) {
        let _ = self.tx.send(Command::Stop(rid));
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
        .map_err(|e| budget_refusal(&e))?;
    if settings.max_step_ms.is_some() && settings.learn_cost && settings.cost.is_none() {
        tracing::warn!(
            "--max-step-ms with --learn-cost and no --cost: no latency model to plan against until the online fit is trusted (50 measured steps within 10%), so steps run under the token budget alone until then (GET /health shows it); pass --cost (a prior, e.g. from `mstar-chunking fit`) to keep the time budget from the first step"
        );
    }
    Ok((cm, thread))
}

/// The component's refusal of the budgets, each problem prefixed with the flag that set the
/// refused setting (the component validates flags as it validates its config).
fn budget_refusal(e: &ChunkingError) -> String {
    use mstar_chunking::budget::SettingKey as K;
    let Some(errors) = e.budget_errors() else {
        return format!("setting the budgets: {e}");
    };
    let flag = |k: K| match k {
        K::MaxStepMs => "--max-step-ms",
        K::Cost => "--cost",
        K::TimeMargin => "--time-margin",
        K::MinChunkTokens => "--min-chunk-tokens",
        K::MaxBatchTokens => "--budget",
        _ => "the budgets",
    };
    errors
        .0
        .iter()
        .map(|b| match b.subject() {
            Some(s) => format!("{}: {b}", flag(s.setting)),
            None => format!("the budgets: {b}"),
        })
        .collect::<Vec<_>>()
        .join("; ")
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

/// Starts the engine actor on a thread of its own. Returns its handle and the thread, which
/// ends with `Err` naming what failed on the way (a step log that could not be written).
///
/// The process's metrics recorder is installed first ([`crate::metrics::install`]), before the
/// component starts, so every series the component registers is recorded.
///
/// # Errors
/// The settings are refused ([`EngineSettings::check`], or by the component), or the step log
/// cannot be created.
pub fn start(
    model: Model,
    settings: EngineSettings,
) -> Result<(EngineHandle, std::thread::JoinHandle<Result<(), String>>), String> {
    settings.check()?;
    crate::metrics::install();
    let log = match &settings.step_log {
        Some(p) => Some(StepLog::create(p)?),
        None => None,
    };
    let tokenizer = model.tokenizer().clone();
    let settings_kv_tokens = settings.kv_tokens;
    let max_step_ms = settings.max_step_ms;
    let limits = ModelLimits {
        vocab: tokenizer.vocab_size() as u32,
        max_positions: model.config.max_positions,
    };
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
                    return Ok(());
                }
            };
            let (cm, actors) = match rt.block_on(start_chunking(&settings)) {
                Ok(x) => x,
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                    return Ok(());
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
                next_rid: 0,
                kv_reserved: 0,
                draining: None,
                steps: 0,
                log,
                started: Instant::now(),
                in_flight: None,
                changes: Changes::default(),
            };
            rt.block_on(engine.run());
            let log = engine.log.take();
            drop(engine);
            actors.stop();
            match log {
                Some(l) => l.finish(),
                None => Ok(()),
            }
        })
        .map_err(|e| e.to_string())?;
    let kv_tokens = settings_kv_tokens;
    let chunking = ready_rx
        .recv()
        .map_err(|_| "the engine thread ended before starting".to_owned())??;
    Ok((
        EngineHandle {
            tx,
            chunking,
            limits,
            tokenizer,
            kv_tokens,
            max_step_ms,
        },
        thread,
    ))
}

/// The step log's file ([`StepLogFile::create_live`]: written as the engine runs, so it can be
/// read while the engine serves); the first write error closes it and is the engine thread's
/// answer at exit.
struct StepLog {
    path: PathBuf,
    out: Option<StepLogFile>,
    error: Option<String>,
}

impl StepLog {
    fn create(path: &Path) -> Result<Self, String> {
        crate::files::check_output(path, "--step-log", &[])?;
        let out = StepLogFile::create_live(path)
            .map_err(|e| format!("--step-log {}: {e}", path.display()))?;
        Ok(StepLog {
            path: path.to_owned(),
            out: Some(out),
            error: None,
        })
    }

    fn write(&mut self, line: &StepLine<'_>) {
        let Some(out) = self.out.as_mut() else { return };
        if let Err(e) = out.write(line) {
            self.fail(&e);
        }
    }

    fn fail(&mut self, e: &std::io::Error) {
        let msg = format!("--step-log {}: {e}", self.path.display());
        tracing::error!(error = %msg, "the step log cannot be written; it is closed");
        self.error.get_or_insert(msg);
        self.out = None;
    }

    fn finish(mut self) -> Result<(), String> {
        if let Some(out) = self.out.take() {
            if let Err(e) = out.finish() {
                self.fail(&e);
            }
        }
        self.error.map_or(Ok(()), Err)
    }
}

/// Row changes made since the last step, sent with the next completion (one message a step).
#[derive(Default)]
struct Changes {
    /// Requests that ended (finished, aborted, disconnected).
    forget: Vec<u64>,
    /// Requests whose final chunk ran: (rid, context).
    decode: Vec<(u64, u64)>,
    /// Requests admitted under the KV bound: (rid, prompt).
    admit: Vec<(u64, PreparedInput)>,
}

impl Changes {
    fn is_empty(&self) -> bool {
        self.forget.is_empty() && self.decode.is_empty() && self.admit.is_empty()
    }

    /// The next step, with these changes in the order they apply: ends first, then decode
    /// rows, then admissions.
    fn next_step(&self) -> NextStep {
        let mut next = NextStep::new(NODE, MIXED);
        for &rid in &self.forget {
            next = next.forget_request(rid);
        }
        for &(rid, ctx) in &self.decode {
            next = next.continue_row_with_context(rid, DECODE, 1, ctx);
        }
        for (rid, input) in &self.admit {
            next = next.admit(*rid, PREFILL, input.clone(), 0);
        }
        next
    }
}

struct Engine {
    model: Model,
    settings: EngineSettings,
    cm: ChunkingManagement,
    rx: mpsc::UnboundedReceiver<Command>,
    running: HashMap<u64, Running>,
    waiting: VecDeque<Waiting>,
    next_rid: u64,
    kv_reserved: u64,
    /// Set by a drain: the deadline and who to tell.
    draining: Option<(Instant, Vec<oneshot::Sender<Option<DrainReport>>>)>,
    steps: u64,
    log: Option<StepLog>,
    started: Instant,
    /// The step the last completion assembled, not run yet.
    in_flight: Option<Arc<Batch>>,
    /// Row changes not yet sent to the component.
    changes: Changes,
}

impl Engine {
    async fn run(&mut self) {
        loop {
            // 1. The mailbox: block only when there is nothing to run.
            let idle =
                self.running.is_empty() && self.waiting.is_empty() && self.in_flight.is_none();
            if idle {
                if self.draining.is_some() {
                    break;
                }
                self.flush_changes().await;
                match self.rx.recv().await {
                    Some(c) => self.handle(c).await,
                    None => break,
                }
            }
            while let Ok(c) = self.rx.try_recv() {
                self.handle(c).await;
            }
            self.drop_disconnected();
            match &self.draining {
                // Draining: no admission; stop once nothing runs or the grace period is over.
                Some((deadline, _)) => {
                    if self.running.is_empty() || Instant::now() >= *deadline {
                        self.abort_all();
                        break;
                    }
                }
                // 2. Admission under the KV bound.
                None => self.admit(),
            }
            self.publish_gauges();
            if self.running.is_empty() && self.in_flight.is_none() {
                continue;
            }
            // 3. One step.
            if let Err(e) = self.step().await {
                tracing::error!(error = %e, "engine step failed; aborting its requests");
                self.abort_all();
                self.publish_gauges();
            }
        }
        if let Some(batch) = self.in_flight.take() {
            if let Err(e) = self.cm.abandon(batch.step).await {
                tracing::warn!(step = batch.step, error = %e, "abandoning the last step failed");
            }
        }
        self.flush_changes().await;
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
                    let rid = self.next_rid;
                    self.next_rid += 1;
                    self.waiting.push_back(Waiting {
                        rid,
                        req,
                        events,
                        arrived: Instant::now(),
                    });
                    rid
                });
                let _ = reply.send(r);
                self.publish_gauges();
            }
            Command::Drain { grace, done } => match &mut self.draining {
                Some((_, tellers)) => tellers.push(done),
                None => {
                    // The grace was bounded when the flag was read; saturate anyway.
                    let now = Instant::now();
                    let deadline = now.checked_add(grace).unwrap_or(now + MAX_GRACE);
                    self.draining = Some((deadline, vec![done]));
                }
            },
            Command::Stats(tx) => {
                let _ = tx.send(self.stats().await);
            }
            Command::Stop(rid) => {
                if self.running.contains_key(&rid) {
                    self.finish(rid, Finish::Stop);
                }
            }
        }
    }

    /// Requests queued ahead that are blocked on memory: in arrival order, those from the first
    /// whose reservation does not fit beside the running ones and those ahead of it. A request
    /// that fits now is not waiting, however many arrived with it since the last turn.
    fn blocked_on_memory(&self) -> usize {
        let mut reserved = self.kv_reserved;
        for (i, w) in self.waiting.iter().enumerate() {
            reserved += reservation(&w.req);
            if reserved > self.settings.kv_tokens {
                return self.waiting.len() - i;
            }
        }
        0
    }

    fn check(&self, req: &GenRequest) -> Result<(), SubmitError> {
        if self.draining.is_some() {
            return Err(SubmitError::Draining);
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
        let blocked = self.blocked_on_memory();
        let ahead: u64 = self.waiting.iter().map(|w| reservation(&w.req)).sum();
        let would_wait = blocked > 0 || self.kv_reserved + ahead + need > self.settings.kv_tokens;
        if would_wait && blocked >= self.settings.max_waiting {
            return Err(SubmitError::QueueFull(blocked));
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
        em::publish(em::Gauges {
            running: self.running.len(),
            waiting: self.waiting.len(),
            kv_used: self.kv_used(),
            kv_reserved: self.kv_reserved,
            kv_capacity: self.settings.kv_tokens,
        });
    }

    /// Requests whose client dropped its event receiver (a stream closed, a plain request's
    /// connection ended): ended now, their cache and reservation freed; the component forgets
    /// them with the next completion.
    fn drop_disconnected(&mut self) {
        let gone: Vec<u64> = self
            .running
            .iter()
            .filter(|(_, r)| r.events.is_closed())
            .map(|(&rid, _)| rid)
            .collect();
        for rid in &gone {
            self.finish(*rid, Finish::Abort);
        }
        if !gone.is_empty() {
            em::request_ended(Outcome::Disconnected, gone.len() as u64);
        }
        let before = self.waiting.len();
        self.waiting.retain(|w| !w.events.is_closed());
        let dropped = before - self.waiting.len();
        if dropped > 0 {
            em::request_ended(Outcome::Disconnected, dropped as u64);
        }
    }

    /// Admits waiting requests, oldest first, while their reservations fit; the component
    /// hears of them with the next completion.
    fn admit(&mut self) {
        while let Some(w) = self.waiting.front() {
            let need = reservation(&w.req);
            if self.kv_reserved + need > self.settings.kv_tokens {
                break; // waits for memory, in arrival order
            }
            let w = self.waiting.pop_front().expect("front exists");
            self.kv_reserved += need;
            let input = PreparedInput::tokens(w.req.prompt.clone());
            self.changes.admit.push((w.rid, input));
            let eos = self.model.tokenizer().eos();
            let sampler = Sampler::for_request(w.req.sampling.clone(), eos, &w.req.prompt);
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
    }

    /// Sends the row changes one call each: the fallback where no completion carries them
    /// (the first step of a walk, an idle engine, the end of a run, a refused change).
    /// A change already applied is not an error here: a forget or a continue is idempotent,
    /// and an admission the component holds already answers `AlreadyQueued`. An admission it
    /// refuses ends the request.
    async fn flush_changes(&mut self) {
        let changes = std::mem::take(&mut self.changes);
        for rid in changes.forget {
            if let Err(e) = self.cm.forget_request(rid).await {
                tracing::error!(rid, error = %e, "forget_request failed");
            }
        }
        for (rid, ctx) in changes.decode {
            if let Err(e) = self
                .cm
                .continue_row_with_context(rid, NODE, DECODE, 1, ctx)
                .await
            {
                tracing::error!(rid, error = %e, "continue_row refused; the request is aborted");
                self.finish(rid, Finish::Abort);
                em::request_ended(Outcome::Abort, 1);
            }
        }
        for (rid, input) in changes.admit {
            match self.cm.admit(rid, NODE, PREFILL, input, 0).await {
                Ok(()) | Err(ChunkingError::AlreadyQueued { .. }) => {}
                Err(e) => {
                    tracing::error!(rid, error = %e, "admit refused; the request is aborted");
                    self.finish(rid, Finish::Abort);
                    em::request_ended(Outcome::Abort, 1);
                }
            }
        }
        // Requests ended above are forgotten at once: nothing else will send it.
        if !self.changes.is_empty() {
            let ended = std::mem::take(&mut self.changes.forget);
            for rid in ended {
                let _ = self.cm.forget_request(rid).await;
            }
        }
    }

    async fn step(&mut self) -> Result<(), String> {
        let batch = match self.in_flight.take() {
            Some(b) => b,
            None => {
                // The fallback: no completion assembled this step (the first of a walk, or
                // after an empty batch or a refused change): its changes go one call each.
                self.flush_changes().await;
                self.cm
                    .assemble(NODE, MIXED)
                    .await
                    .map_err(|e| format!("assemble: {e}"))?
            }
        };
        if batch.rows.is_empty() {
            // Nothing eligible: an empty batch is not a step in flight (nothing to complete);
            // yield briefly rather than spin.
            tokio::time::sleep(Duration::from_millis(1)).await;
            return Ok(());
        }
        // Take each row's state out of the map so the model can borrow the caches mutably. A
        // row whose request ended since the step was assembled (its client went away) does
        // not run: it reports 0 tokens, and is forgotten with this completion.
        let mut states: Vec<(usize, u64, Running)> = Vec::with_capacity(batch.rows.len());
        let mut ran = vec![0u32; batch.rows.len()];
        // Each continuing row's true context for the step log: the KV it reads, its cache and
        // the token it runs (the component's `context` is an estimate it keeps only when a
        // latency model reads it); a row that does not run keeps the estimate.
        let mut contexts: Vec<u64> = batch.rows.iter().map(|r| r.context).collect();
        let mut tokens: Vec<Vec<u32>> = Vec::with_capacity(batch.rows.len());
        let mut wants = Vec::with_capacity(batch.rows.len());
        for (i, row) in batch.rows.iter().enumerate() {
            let Some(state) = self.running.remove(&row.rid) else {
                continue;
            };
            match (&row.work, &row.input) {
                (RowWork::Chunk { range, .. }, Some(input)) => {
                    tokens.push(input.token_ids().to_vec());
                    wants.push(range.is_final());
                    ran[i] = range.tokens();
                }
                (RowWork::Continue { .. }, _) => {
                    let Some(t) = state.pending else {
                        self.running.insert(row.rid, state);
                        let _ = self.cm.abandon(batch.step).await;
                        return Err(format!("decode row {} has no token", row.rid));
                    };
                    tokens.push(vec![t]);
                    wants.push(true);
                    ran[i] = 1;
                    contexts[i] = state.cache.len() as u64 + 1;
                }
                (RowWork::Chunk { .. }, None) => {
                    self.running.insert(row.rid, state);
                    let _ = self.cm.abandon(batch.step).await;
                    return Err(format!("chunk row {} without input", row.rid));
                }
            }
            states.push((i, row.rid, state));
        }
        if let Some(hook) = &self.settings.before_step {
            (hook.0)(batch.step);
        }
        let t0 = Instant::now();
        let t_ms = self.started.elapsed().as_secs_f64() * 1000.0;
        let result = if states.is_empty() {
            Ok(Vec::new())
        } else {
            let mut rows: Vec<StepRow<'_>> = states
                .iter_mut()
                .zip(&tokens)
                .zip(&wants)
                .map(|(((_, _, s), t), &w)| StepRow {
                    tokens: t,
                    cache: &mut s.cache,
                    logits: w,
                })
                .collect();
            self.model.step(&mut rows)
        };
        let ms = t0.elapsed().as_secs_f64() * 1000.0;
        // Put the states back before anything can fail.
        let ran_rows: Vec<(usize, u64)> = states.iter().map(|(i, r, _)| (*i, *r)).collect();
        for (_, rid, s) in states {
            self.running.insert(rid, s);
        }
        let logits = match result {
            Ok(l) => l,
            Err(e) => {
                let _ = self.cm.abandon(batch.step).await;
                return Err(format!("model step: {e}"));
            }
        };
        self.steps += 1;
        em::step(ms, batch.scheduled_tokens);

        // Sample, and collect the row changes this step makes.
        let now = Instant::now();
        for (&(i, rid), l) in ran_rows.iter().zip(logits) {
            let Some(l) = l else { continue };
            let Some(s) = self.running.get_mut(&rid) else {
                continue;
            };
            let tok = s.sampler.sample(&l);
            let logprobs = s
                .req
                .sampling
                .logprobs
                .map(|k| Logprobs::of(&l, tok, usize::from(k.min(MAX_TOP_LOGPROBS))));
            s.generated += 1;
            s.pending = Some(tok);
            let since = now - s.last_token.unwrap_or(s.arrived);
            em::token(s.last_token.is_none(), since.as_secs_f64());
            s.last_token = Some(now);
            let _ = s.events.send(Event::Token { id: tok, logprobs });
            let p = &s.req.sampling;
            let ends = tok == self.model.tokenizer().eos() || p.stop_tokens.contains(&tok);
            let done = if ends && !p.ignore_eos {
                Some(Finish::Stop)
            } else if s.generated >= s.req.max_tokens {
                Some(Finish::Length)
            } else {
                None
            };
            match done {
                Some(f) => self.finish(rid, f),
                None => {
                    if matches!(batch.rows[i].work, RowWork::Chunk { .. }) {
                        let ctx = s.cache.len() as u64;
                        self.changes.decode.push((rid, ctx));
                    }
                }
            }
        }
        // Waiting requests that fit now run from the next step.
        if self.draining.is_none() {
            self.admit();
        }

        // One message: complete this step, apply the changes, assemble the next.
        let next = self.changes.next_step();
        let sent = std::mem::take(&mut self.changes);
        let done = match self
            .cm
            .complete_and_assemble(batch.step, ran, Some(ms), next)
            .await
        {
            Ok(done) => done,
            Err(e) => {
                // Refused whole (nothing changed): the changes wait for the next call.
                self.changes = sent;
                let _ = self.cm.abandon(batch.step).await;
                return Err(format!("complete: {e}"));
            }
        };
        self.write_log(t_ms, ms, &batch, &done.outcome, &contexts);
        match done.next {
            Ok(next) if next.rows.is_empty() => {}
            Ok(next) => self.in_flight = Some(next),
            Err(e) => {
                // The completion stands; a change was refused and the ones after it were not
                // applied. Send them again one call each (applied ones are idempotent).
                tracing::warn!(error = %e, "a row change after the step was refused; sending the changes one by one");
                self.changes = sent;
                self.flush_changes().await;
            }
        }
        self.publish_gauges();
        Ok(())
    }

    /// Ends a request: tells its client, frees its memory; the component forgets it with the
    /// next completion.
    fn finish(&mut self, rid: u64, finish: Finish) {
        if let Some(s) = self.running.remove(&rid) {
            let _ = s.events.send(Event::Done {
                finish,
                prompt_tokens: s.req.prompt.len() as u32,
                completion_tokens: s.generated,
            });
            self.kv_reserved -= s.reserved;
            match finish {
                Finish::Abort => {}
                Finish::Length | Finish::Stop => {
                    em::e2e(s.arrived.elapsed().as_secs_f64());
                    em::request_ended(
                        if finish == Finish::Stop {
                            Outcome::Stop
                        } else {
                            Outcome::Length
                        },
                        1,
                    );
                }
            }
        }
        // Admitted since the last step and ended before the component heard of it: it never
        // hears of it (a later forget is harmless either way).
        self.changes.admit.retain(|(r, _)| *r != rid);
        self.changes.decode.retain(|(r, _)| *r != rid);
        self.changes.forget.push(rid);
    }

    fn abort_all(&mut self) {
        let rids: Vec<u64> = self.running.keys().copied().collect();
        let n = rids.len() as u64;
        for rid in rids {
            self.finish(rid, Finish::Abort);
        }
        if n > 0 {
            em::request_ended(Outcome::Abort, n);
        }
        for w in self.waiting.drain(..) {
            let _ = w.events.send(Event::Done {
                finish: Finish::Abort,
                prompt_tokens: w.req.prompt.len() as u32,
                completion_tokens: 0,
            });
        }
    }

    /// Writes the step's line: `ms` the measured wall time of the model step, each continuing
    /// row's `context` the KV it read (as a replay logs its simulated engine's, so that `fit`
    /// prices what the model really read), and the time margin the step was planned with.
    fn write_log(
        &mut self,
        t_ms: f64,
        ms: f64,
        batch: &Batch,
        outcome: &StepOutcome,
        contexts: &[u64],
    ) {
        let Some(log) = self.log.as_mut() else { return };
        log.write(&StepLine::new(batch, outcome, t_ms, Some(ms), contexts).with_time_margin());
    }
}

/// The KV tokens a request reserves at admission: its prompt and every token it may generate,
/// so an admitted request never runs out of memory mid-generation.
pub fn reservation(req: &GenRequest) -> u64 {
    req.prompt.len() as u64 + u64::from(req.max_tokens)
}
