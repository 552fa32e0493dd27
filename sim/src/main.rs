//! The `mstar-chunking` binary: `replay`, `sweep`, `fit`, `check` and `budgets` (see `cli/`).

use std::process::ExitCode;

use clap::Parser;
use mstar_chunking_sim::cli::{self, Cli, Command};

fn main() -> ExitCode {
    match Cli::parse().command {
        Command::Replay(args) => cli::replay(&args),
        Command::Check(args) => cli::check(&args),
        Command::Budgets(args) => cli::budgets(&args),
        Command::Sweep(args) => cli::sweep(&args),
        Command::Fit(args) => cli::fit(&args),
        Command::SweepCell(args) => cli::sweep_cell(&args),
    }
}
