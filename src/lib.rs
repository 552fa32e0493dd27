//! # mstar-chunking
//!
//! Chunked prefill for an LLM serving engine: long prompts are cut into chunks so that every
//! engine step stays inside a token budget (and, with a latency model, a time budget) and
//! decode rows never stall behind a long prompt. The rules the code enforces are in the
//! repository's `docs/` (`docs/README.md` is the index).
//!
//! ## A tour of the modules
//!
//! The functional core, plain structs without a runtime (all of it with the default
//! features):
//! - [`range`]: [`ChunkRange`], the tokens a chunked row runs in one step, and its stride rule;
//! - [`policy`]: the model's say: [`ChunkingPolicy`], [`NO_CHUNKING`], submodule capabilities;
//! - [`budget`]: the deployment's say: [`BudgetSettings`] (token and time budgets), their
//!   validation and the budget answers;
//! - [`snapshot`]: the immutable budget snapshot with every `(node, walk)`'s step parameters;
//! - [`planner`]: the step planner, a pure function from queues and parameters to a step plan;
//! - [`latency`]: the step latency model and the time limit of a chunk's end, its online fit
//!   ([`latency::fit`]) and public model/GPU presets ([`latency::presets`]);
//! - [`order`]: which waiting prompt a node starts first (`fcfs`, `priority`, `shortest_first`,
//!   `longest_prefix`) and the starvation bound;
//! - [`queues`]: one node's row queues and their progress;
//! - [`scheduler`]: all nodes' queues, the step in flight, assembly and completion;
//! - [`prepared`]: whole prepared inputs and the zero-copy chunk views cut from them;
//! - [`overrun`]: overrun classification, counts and the 1/2/4/8… warning cadence;
//! - [`metrics`]: every exported metric, labelled per facade instance;
//! - [`error`]: [`ChunkingError`] and its [`ErrorKind`].
//!
//! The edges, behind cargo features: `config` (`input`, the one bounded input path for every
//! file read; `manifest`, the model's file; `config`, the layered serving config, which a
//! program extends with sections of its own through `config::ExtraSections`; `reload`, hot
//! reload), `step-log` (`step_log`, the step log's lines and file, which the replay writes and
//! an engine can), `prometheus` (`metrics_server`, the metrics endpoint's bounded HTTP server).
//! The replay, sweeps and the `mstar-chunking` command are a crate of their own beside this one
//! (`mstar-chunking-sim`), built on this crate's public API as an engine is.
//!
//! The actor shell ([`actors`]), one actor per piece of state:
//!
//! ```text
//!  engine ──► ChunkingManagement (facade)
//!               │ SetPolicies      ┌────────────────┐ BindPolicies ┌──────────────┐ UseSnapshot (Arc)
//!               ├─────────────────►│ PolicyRegistry ├─────────────►│ BudgetConfig ├──────────────┐
//!               │ SetBudgets       └────────────────┘              └──────────────┘              ▼
//!               ├──────────────────────────────────────────────────────►            ┌───────────┐
//!               │ Admit / Continue / Assemble / Complete(AndAssemble) / Forget      │ Scheduler │
//!               ├──────────────────────────────────────────────────────────────────►└─┬───────┬─┘
//!               │ Get / Totals        ┌────────────────┐  Apply (one-way: hold,      │       │ Record
//!               └────────────────────►│ PreparedInputs │◄─ release, forget) ─────────┘       ▼ (overruns)
//!                                     └────────────────┘                       ┌───────────────────┐
//!                                                                              │ OverrunAccounting │
//!                                                                              └───────────────────┘
//! ```
//!
//! A step costs the engine one message: `complete_and_assemble` completes step N and answers
//! step N+1's batch (or `complete`, then `assemble`). The Scheduler plans the step and cuts the
//! chunk inputs from handles it keeps on the queued prompts' inputs, which PreparedInputs owns
//! and accounts for; the batch is held until the step completes, so a repeated `assemble`
//! answers it again. Budgets reach the scheduler as an `Arc` snapshot, never per row. Each step is a `tracing` span from assembly to completion,
//! and an engine shuts the component down with `begin_drain` / `drain`, which report what they
//! dropped. See `docs/actors.md`.

#![deny(missing_docs)]

pub mod actors;
pub mod budget;
#[cfg(feature = "config")]
pub mod config;
pub mod error;
#[cfg(feature = "config")]
pub mod input;
pub mod latency;
#[cfg(feature = "config")]
pub mod manifest;
pub mod metrics;
#[cfg(feature = "prometheus")]
pub mod metrics_server;
pub mod order;
pub mod overrun;
pub mod planner;
pub mod policy;
pub mod prepared;
pub mod queues;
pub mod range;
#[cfg(feature = "config")]
pub mod reload;
pub mod rows;
pub mod scheduler;
pub mod snapshot;
#[cfg(feature = "step-log")]
pub mod step_log;

pub use actors::{ActorThread, ChunkingManagement, DrainReport, QueueStats};
pub use budget::{
    BudgetSettings, BudgetTable, BudgetValue, NodeBudget, TimeBudget, TimeFloor,
    DEFAULT_MIN_CHUNK_TOKENS,
};
pub use error::{ChunkingError, ErrorKind};
pub use latency::presets::preset_model;
pub use latency::{LatencyModel, ModelSource};
pub use order::{AdmitOptions, Order};
pub use overrun::{Overrun, OverrunReason, TimeInactiveReason, TimeOverrunReason};
pub use planner::RowWork;
pub use policy::{ChunkingPolicy, SubmoduleCaps, NO_CHUNKING};
pub use prepared::{ChunkInput, PreparedInput};
pub use range::ChunkRange;
pub use scheduler::{
    Batch, BatchRow, Completed, LateMeasurement, LatencyModelReport, NextStep, RowKind,
    StepOutcome, Then,
};

/// The README's Rust examples run as doc-tests, so the embedding example stays true.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
mod readme {}

/// The embedding guide's Rust examples run as doc-tests too.
#[cfg(doctest)]
#[doc = include_str!("../docs/embedding.md")]
mod embedding_guide {}
