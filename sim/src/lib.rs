//! # mstar-chunking-sim
//!
//! Capacity planning for the `mstar-chunking` component: it drives the component's real actors
//! through request traces on a simulated clock, over grids of budgets and rates, and is the
//! `mstar-chunking` command. It uses the component through its public API only.
//!
//! - [`replay`]: one replay of a trace (one worker, a fleet behind a router, or prefill and
//!   decode pools), its trace readers, step log and report;
//! - [`sweep`]: replays over a grid of settings and rates, capacity searches, the verdict,
//!   tables, plots and the HTML report;
//! - [`config`]: the component's layered config with the `[replay]` section;
//! - [`cli`]: the `mstar-chunking` command (`replay`, `sweep`, `fit`, `check`, `budgets`),
//!   with the offline `fit` of a step log;
//! - [`logging`]: the command's log lines; `text`: how numbers read in reports.

#![deny(missing_docs)]

pub mod cli;
pub mod config;
pub mod logging;
pub mod replay;
pub mod sweep;
pub(crate) mod text;
