//! # mstar-engine
//!
//! A reference serving engine built on `mstar-chunking`'s public API (default features off):
//! a Llama-architecture decoder on candle ([`model`]), scheduled one step per `assemble`.
//! `engine/README.md` describes the design.

#![deny(missing_docs)]

pub mod bench;
pub mod engine;
pub mod model;
pub mod server;
