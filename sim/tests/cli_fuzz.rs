//! Fuzz-style property test of `vllm-sim`'s configuration (issue 16, item 5): any command line
//! (every flag of the `Cli`, with values empty, negative, huge, fractional, infinite, NaN or not
//! numbers at all) parses to `Ok` or an `Err`, and a parsed config's `validate` and `pacing`
//! return `Ok` or an `Err`: nothing panics.
//!
//! `PROPTEST_CASES` sets the number of cases (CI: the default below; `make fuzz`: many more).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use clap::{CommandFactory, Parser};
use proptest::prelude::*;
use proptest::test_runner::{Config as PtConfig, FileFailurePersistence};
use vllm_sim::config::Cli;

const VALUES: &[&str] = &[
    "",
    "0",
    "-1",
    "1",
    "2",
    "0.5",
    "-0",
    "inf",
    "-inf",
    "NaN",
    "1e309",
    "1e-320",
    "3600000",
    "3600000.1",
    "18446744073709551616",
    "4294967296",
    "65536",
    "x",
    "a b",
    "name=path",
    "127.0.0.1",
    "é😀",
];

fn cases(default: u32) -> PtConfig {
    let cases = std::env::var("PROPTEST_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(default);
    PtConfig {
        cases,
        failure_persistence: Some(Box::new(FileFailurePersistence::Off)),
        ..PtConfig::default()
    }
}

fn flags() -> Vec<String> {
    Cli::command().get_arguments().filter_map(|a| a.get_long().map(|l| format!("--{l}"))).collect()
}

proptest! {
    #![proptest_config(cases(512))]

    #[test]
    fn any_command_line_parses_or_errs(
        args in prop::collection::vec((any::<usize>(), any::<usize>(), any::<bool>(), "\\PC{0,12}"), 0..8),
    ) {
        let flags = flags();
        let mut argv = vec!["vllm-sim".to_string()];
        for (f, v, own, text) in args {
            argv.push(flags[f % flags.len()].clone());
            argv.push(if own { text } else { VALUES[v % VALUES.len()].to_string() });
        }
        if let Ok(cli) = Cli::try_parse_from(&argv) {
            if cli.sim.validate().is_ok() {
                let pacing = cli.sim.pacing().unwrap();
                let _ = pacing.token_offset(u64::MAX);
            }
        }
    }
}
