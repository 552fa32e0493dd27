//! The integration tests, as one test binary.

mod config_cli;
mod core;
mod helpers;
mod props;
mod reload;
mod state_machine;
