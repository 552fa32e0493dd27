//! # mstar-chunking
//!
//! Chunked prefill for an LLM serving engine: long prompts are cut into chunks so that every
//! engine step stays inside a token budget and decode rows never stall behind a long prompt.
//!
//! ## A tour of the modules
//!
//! The functional core, plain structs without a runtime:
//! - [`range`]: [`ChunkRange`], the tokens a chunked row runs in one step, and its stride rule;
//! - [`policy`]: the model's say: [`ChunkingPolicy`], [`NO_CHUNKING`], submodule capabilities;
//! - [`budget`]: the deployment's say: `set_budgets` validation and the budget answers;
//! - [`snapshot`]: the immutable budget snapshot with every `(node, walk)`'s step parameters;
//! - [`planner`]: the step planner, a pure function from queues and parameters to a step plan;
//! - [`queues`]: one node's row queues and their progress;
//! - [`scheduler`]: all nodes' queues, the step in flight, assembly and completion;
//! - [`prepared`]: whole prepared inputs and the zero-copy chunk views cut from them;
//! - [`overrun`]: overrun classification, counts and the 1/2/4/8… warning cadence;
//! - [`metrics`]: every exported metric.
//!
//! The edges: [`manifest`] (the model's file), [`settings`] (the layered serving config and
//! its loader), [`logging`] and [`cli`] (the binary's `check` and `budgets`). [`replay`] drives
//! the actors through a request trace on a simulated clock (docs/replay.md).
//!
//! The actor shell ([`actors`]), one actor per piece of state:
//!
//! ```text
//!  engine ──► ChunkingManagement (facade)
//!               │ SetPolicies      ┌────────────────┐ BindPolicies ┌──────────────┐ UseSnapshot (Arc)
//!               ├─────────────────►│ PolicyRegistry ├─────────────►│ BudgetConfig ├──────────────┐
//!               │ SetBudgets       └────────────────┘              └──────────────┘              ▼
//!               ├──────────────────────────────────────────────────────►            ┌───────────┐
//!               │ Admit / Continue / Assemble / Complete / Forget                   │ Scheduler │
//!               ├──────────────────────────────────────────────────────────────────►└─┬───────┬─┘
//!               │ Insert / Cut / Forget   ┌────────────────┐   Release (final chunks)  │       │ Record
//!               └────────────────────────►│ PreparedInputs │◄──────────────────────────┘       ▼ (overruns)
//!                                         └────────────────┘                   ┌───────────────────┐
//!                                                                              │ OverrunAccounting │
//!                                                                              └───────────────────┘
//! ```
//!
//! A step costs the engine one message to assemble (the Scheduler plans, then has
//! PreparedInputs cut the chunk inputs) and one to complete; budgets reach the scheduler as an
//! `Arc` snapshot, never per row.

#![deny(missing_docs)]

use std::sync::Arc;

pub mod actors;
pub mod budget;
#[cfg(feature = "cli")]
#[allow(missing_docs)] // TODO(config-wing merge): document
pub mod cli;
#[cfg(feature = "config")]
pub mod config;
pub mod error;
pub mod latency;
pub mod latency_fit;
#[cfg(feature = "replay")]
pub mod latency_fit_file;
pub mod latency_presets;
#[cfg(feature = "cli")]
#[allow(missing_docs)] // TODO(config-wing merge): document
pub mod logging;
#[cfg(feature = "config")]
#[allow(missing_docs)] // TODO(config-wing merge): document
pub mod manifest;
pub mod metrics;
pub mod overrun;
pub mod planner;
pub mod policy;
pub mod prepared;
pub mod queues;
pub mod range;
#[cfg(feature = "config")]
#[allow(missing_docs)] // TODO(config-wing merge): document
pub mod reload;
#[cfg(feature = "replay")]
#[allow(missing_docs)] // TODO(config-wing merge): document
pub mod replay;
pub mod scheduler;
pub mod snapshot;
#[cfg(feature = "sweep")]
pub mod sweep;

/// A node or walk name. Cloning is a reference-count increment.
pub type Name = Arc<str>;

pub use actors::{ActorThread, ChunkingManagement, QueueStats};
pub use budget::{BudgetSettings, BudgetTable, BudgetValue, NodeBudget, DEFAULT_MIN_CHUNK_TOKENS};
pub use error::{ChunkingError, ErrorKind};
pub use overrun::{Overrun, OverrunReason};
pub use planner::Work;
pub use policy::{ChunkingPolicy, SubmoduleCaps, NO_CHUNKING};
pub use prepared::{ChunkInput, PreparedInput};
pub use range::ChunkRange;
pub use scheduler::{Batch, BatchRow, StepOutcome};

/// The README's Rust examples run as doc-tests, so the embedding example stays true.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
mod readme {}
