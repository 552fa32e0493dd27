//! The integration tests, as one test binary.

mod core;
mod props;
mod state_machine;
