//! # mstar-engine
//!
//! A reference serving engine built on `mstar-chunking`'s public API (default features off):
//! a Llama-architecture decoder on candle ([`model`]: random weights, or a GGUF file such as
//! SmolLM2-135M-Instruct with its [`tokenizer`]), run one step per assembled batch by an
//! engine actor ([`engine`]), served over an OpenAI-compatible HTTP API ([`server`], its
//! request bodies in [`api`], chat prompts rendered by [`chat`], its connections shed at the
//! cap by [`conns`]) with its metrics in
//! [`metrics`], and driven by a trace-replaying load generator ([`bench`](mod@bench)); [`files`] holds
//! the rules for the files it reads and writes.
//! `engine/README.md` describes the design, with `docs/engine-model.md`, `docs/engine-api.md` and
//! `docs/engine-measuring.md`.

#![deny(missing_docs)]

pub mod api;
pub mod bench;
pub mod chat;
pub mod conns;
pub mod engine;
pub mod files;
pub mod metrics;
pub mod model;
pub mod sampling;
pub mod server;
pub mod tokenizer;
