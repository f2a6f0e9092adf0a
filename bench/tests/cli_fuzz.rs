//! Fuzz-style property test of `gateway-bench`'s configuration (issue 16, item 5): any command
//! line (every flag of the `Cli`, with values empty, negative, huge, fractional, infinite, NaN, lists
//! or not numbers at all) parses to `Ok` or an `Err`, and `to_config` on a parsed one returns `Ok`
//! or an `Err`; any dataset text parses or errs: nothing panics.
//!
//! `PROPTEST_CASES` sets the number of cases (CI: the default below; `make fuzz`: many more).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use clap::{CommandFactory, Parser};
use gateway_bench::args::Cli;
use gateway_bench::workload::parse_dataset;
use proptest::prelude::*;
use proptest::test_runner::{Config as PtConfig, FileFailurePersistence};

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
    "1,2,3",
    "0,inf",
    ",",
    "18446744073709551616",
    "4294967296",
    "x",
    "chat",
    "completions",
    "/v1/completions",
    "http://",
    "http://h:1/p",
    "https://h",
    "/nonexistent/file",
    "true",
    "false",
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
        let mut argv = vec!["gateway-bench".to_string()];
        for (f, v, own, text) in args {
            argv.push(flags[f % flags.len()].clone());
            argv.push(if own { text } else { VALUES[v % VALUES.len()].to_string() });
        }
        if let Ok(cli) = Cli::try_parse_from(&argv) {
            let _ = cli.to_config();
        }
    }

    #[test]
    fn any_dataset_text_parses_or_errs(
        text in "\\PC{0,300}",
        lines in prop::collection::vec(prop_oneof![
            Just(r#"{"prompt":"a","output_len":3}"#.to_string()),
            Just(r#"{"prompt":"","output_len":-1}"#.to_string()),
            Just(r#"{"messages":[{"role":"user","content":"x"}]}"#.to_string()),
            Just(r#"[{"prompt":"a"}]"#.to_string()),
            Just("{".to_string()),
            "\\PC{0,40}",
        ], 0..6),
    ) {
        let _ = parse_dataset(&text);
        let _ = parse_dataset(&lines.join("\n"));
    }
}
