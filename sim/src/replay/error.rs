//! [`ReplayError`]: why a replay failed.

use std::path::PathBuf;

use super::trace::TraceError;
use mstar_chunking::budget::BudgetValue;
use mstar_chunking::error::ChunkingError;

/// Why a replay failed.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// The trace could not be read.
    #[error(transparent)]
    Trace(#[from] TraceError),
    /// An actor refused or did not answer.
    #[error("{during}: {source}")]
    Chunking {
        /// What the replay was doing.
        during: &'static str,
        /// The actors' error.
        #[source]
        source: ChunkingError,
    },
    /// A `[replay]` setting refused (see [`super::settings::check`]).
    #[error("`{key}` {problem}")]
    Config {
        /// The key.
        key: &'static str,
        /// Its value and why it was refused.
        problem: String,
    },
    /// `--rate-scale` out of range.
    #[error("{0}")]
    RateScale(String),
    /// `--budget` (or `--budget-off`) gives budgets the config would refuse (see
    /// [`super::replay_budgets`]).
    #[error("`{flag}`{} is refused as the config would refuse it: {reason}", value.map_or_else(String::new, |v| format!(" = {v}")))]
    Budget {
        /// `--budget` or `--budget-off`.
        flag: &'static str,
        /// The value of `--budget`.
        value: Option<BudgetValue>,
        /// Every refusal, escaped.
        reason: String,
    },
    /// An output refused before anything ran (see `check_outputs`).
    #[error("the {what} `{path}` {problem}", path = crate::config::problem::escape(&.path.display().to_string()))]
    Output {
        /// `step log` or `JSON report`.
        what: &'static str,
        /// Its path.
        path: PathBuf,
        /// Why it was refused.
        problem: String,
    },
    /// An output could not be written.
    #[error("cannot write the {what} `{path}`: {source}", path = .path.display())]
    Write {
        /// `step log` or `JSON report`.
        what: &'static str,
        /// Its path.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// Rows are queued that no step schedules.
    #[error("replay stalled at {t_ms:.3} ms: {prefilling} prompts and {decoding} decode rows are queued on `{node}` but no step schedules any of them")]
    Stalled {
        /// Simulated time.
        t_ms: f64,
        /// The node.
        node: String,
        /// Prompts queued.
        prefilling: usize,
        /// Decode rows registered.
        decoding: usize,
    },
    /// A request needs more KV blocks than the pool holds, even alone.
    #[error("request {rid} needs {tokens} tokens of KV cache ({need} blocks of {block_tokens} tokens: its prompt, outputs and speculative tokens) but `replay.kv` holds {blocks} blocks, so it could never run; give the replay more memory, or leave such requests out (`--requests`)")]
    KvTooSmall {
        /// The request (its position in the trace).
        rid: u64,
        /// The tokens it needs.
        tokens: u64,
        /// The blocks it needs.
        need: u64,
        /// The pool's blocks.
        blocks: u64,
        /// Tokens per block.
        block_tokens: u32,
    },
    /// A step's rows could not be given blocks with nothing left to preempt (a bug: reported,
    /// never a panic).
    #[error("request {rid}: no block left to give and nothing left to preempt in a pool of {blocks} blocks")]
    KvStuck {
        /// The request whose row did not fit.
        rid: u64,
        /// The pool's blocks.
        blocks: u64,
    },
    /// Prepared inputs still held after every prompt finished.
    #[error("{rows} prepared inputs ({tokens} tokens) were still held after the replay; every one must be released after its final chunk")]
    PreparedLeft {
        /// Rows held.
        rows: usize,
        /// Their tokens.
        tokens: u64,
    },
}

impl ReplayError {
    pub(super) fn chunking(during: &'static str) -> impl FnOnce(ChunkingError) -> Self {
        move |source| Self::Chunking { during, source }
    }
}
