//! The `mstar-chunking` binary: `replay`, `check` and `budgets` (see `cli.rs`).

use std::process::ExitCode;

use clap::Parser;
use mstar_chunking::cli::{self, Cli, Command, ReplayArgs};

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Replay(args) => replay(&args),
        Command::Check(args) => cli::check(&args),
        Command::Budgets(args) => cli::budgets(&args),
    }
}

/// Placeholder until the replay module is merged: the lead replaces this body with the call
/// into `replay` at merge time.
fn replay(_args: &ReplayArgs) -> ExitCode {
    eprintln!("error: replay is wired by the lead (not in this build yet)");
    ExitCode::FAILURE
}
