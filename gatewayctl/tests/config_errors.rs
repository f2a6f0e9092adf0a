//! One fixture per config error: `tests/fixtures/errors/<case>.yaml` starts with
//! `# expect: <message>`, the exact error `gatewayctl validate` reports for it (file, field,
//! message). Validation is loading plus rendering every configured target in memory, so the
//! fixtures cover gatewayctl's own checks and the checks of the filter's and the sidecar's
//! parsers, reported against the gateway config's field.

// Test helpers outside #[test] fns are not covered by clippy.toml's allow-*-in-tests settings.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use std::path::Path;

use gatewayctl::config::Loaded;
use gatewayctl::render::{render, Target};

fn validate(path: &Path) -> Result<(), String> {
    let loaded = Loaded::load(path).map_err(|e| e.to_string())?;
    render(&loaded, Target::All).map_err(|e| e.to_string())?;
    Ok(())
}

#[test]
fn every_fixture_fails_with_its_exact_message() {
    let dir = Path::new("tests/fixtures/errors");
    let mut cases: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    cases.sort();
    assert!(cases.len() >= 30, "fixtures missing: {}", cases.len());
    let mut failures = Vec::new();
    for path in &cases {
        let text = std::fs::read_to_string(path).unwrap();
        let expected = text
            .lines()
            .next()
            .and_then(|l| l.strip_prefix("# expect: "))
            .unwrap_or_else(|| panic!("{}: first line must be `# expect: ...`", path.display()));
        let file = path.display().to_string();
        assert!(
            expected.starts_with(&format!("{file}: ")),
            "{file}: the expected message must name the file"
        );
        match validate(path) {
            Ok(()) => failures.push(format!("{file}: accepted, expected `{expected}`")),
            Err(got) if got != expected => {
                failures.push(format!("{file}:\n  expected `{expected}`\n  got      `{got}`"))
            }
            Err(_) => {}
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn unreadable_file_is_named() {
    let e = Loaded::load(Path::new("tests/fixtures/no-such-file.yaml")).unwrap_err();
    assert_eq!(e.file, "tests/fixtures/no-such-file.yaml");
    assert!(e.to_string().starts_with("tests/fixtures/no-such-file.yaml: cannot read: "));
}

#[test]
fn the_example_config_is_valid() {
    validate(Path::new("../envoy/examples/gateway.yaml")).unwrap();
}
