//! The integration tests, as one test binary.

mod config_cli;
mod core;
mod helpers;
mod hostile;
mod kv_memory;
mod metrics_live;
mod props;
mod reload;
mod replay;
mod state_machine;
mod sweep_cli;
mod time_budget;
