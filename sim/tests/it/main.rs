//! The integration tests, as one test binary.

mod cluster_sweep;
#[path = "../../../tests/common/mod.rs"]
mod common;
mod config_cli;
mod core;
mod default_log;
mod disagg;
mod doc_commands;
mod drain;
mod endpoint;
mod fleet;
mod helpers;
mod hostile;
mod kv_memory;
mod metrics_live;
mod order;
mod priority;
mod props;
mod readme;
mod reload;
mod replay;
mod setting_flags;
mod sim_truth;
mod state_machine;
mod sweep_cli;
mod sweep_digests;
mod time_budget;
mod trusted_sweep;
mod truth_cli;
mod verdict;
mod vocabulary;
