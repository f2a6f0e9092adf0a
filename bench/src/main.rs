//! `gateway-bench` command-line entry point; see the library docs.

use clap::Parser;
use std::process::ExitCode;

fn main() -> ExitCode {
    let cli = gateway_bench::Cli::parse();
    match gateway_bench::run_cli(&cli) {
        Ok(_) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gateway-bench: {e}");
            ExitCode::FAILURE
        }
    }
}
