//! The integration tests: one binary, one module per area.

mod config_cli;
mod helpers;
