//! Fuzz-style property tests of the config parsers (issue 16, item 5): the gateway config
//! (`gatewayctl`), the filter's plugin configuration and the sidecar's config never panic, on
//! arbitrary text and on valid configs mutated (a value replaced by one of another type or out of
//! range, a key removed or renamed, bytes flipped): they return `Ok` or an `Err`. A mutated gateway
//! config that `gatewayctl` accepts renders (every target it has sections for) without panicking, and the filter and
//! sidecar configs it renders are accepted by the filter and the sidecar.
//!
//! The seeds are envoy/examples/gateway.yaml and its rendered standalone filter.json and
//! sidecar.yaml. `PROPTEST_CASES` sets the number of cases (CI: the default below; `make fuzz`:
//! many more).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use std::path::{Path, PathBuf};

use gatewayctl::config::Loaded;
use gatewayctl::render::{render, Target};
use proptest::prelude::*;
use proptest::test_runner::{Config as PtConfig, FileFailurePersistence};
use serde_json::{json, Value};

const EXAMPLE: &str = "../envoy/examples/gateway.yaml";

fn cases(default: u32) -> PtConfig {
    let cases = std::env::var("PROPTEST_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(default);
    PtConfig {
        cases,
        failure_persistence: Some(Box::new(FileFailurePersistence::Off)),
        ..PtConfig::default()
    }
}

struct Seeds {
    gateway: Value,
    filter: Value,
    sidecar: Value,
    dir: PathBuf,
}

fn seeds() -> &'static Seeds {
    static SEEDS: std::sync::OnceLock<Seeds> = std::sync::OnceLock::new();
    SEEDS.get_or_init(|| {
        let text = std::fs::read_to_string(EXAMPLE).unwrap();
        let loaded = Loaded::load(Path::new(EXAMPLE)).unwrap();
        let files = render(&loaded, Target::Standalone).unwrap().files;
        let file = |suffix: &str| files.iter().find(|f| f.path.ends_with(suffix)).unwrap().content.clone();
        Seeds {
            gateway: serde_yaml_ng::from_str(&text).unwrap(),
            filter: serde_json::from_str(&file("filter.json")).unwrap(),
            sidecar: serde_yaml_ng::from_str(&file("sidecar.yaml")).unwrap(),
            dir: Path::new(EXAMPLE).parent().unwrap().to_path_buf(),
        }
    })
}

/// A replacement value: of another type, empty, negative, huge, fractional, long.
fn replacement(choice: u8) -> Value {
    match choice % 16 {
        0 => Value::Null,
        1 => json!(-1),
        2 => json!(0),
        3 => json!(u64::MAX),
        4 => json!(1e300),
        5 => json!(0.5),
        6 => json!(""),
        7 => json!("x".repeat(300)),
        8 => json!([]),
        9 => json!({}),
        10 => json!(true),
        11 => json!("127.0.0.1:99999"),
        12 => json!("redis://"),
        13 => json!([{"": null}]),
        14 => json!(i64::MIN),
        _ => json!("\u{0}é😀"),
    }
}

/// A value of the same JSON type as `v` that validation must look at: zero, negative, huge or
/// fractional numbers; empty, long or odd strings; the other boolean.
fn same_type(v: &Value, choice: u8) -> Value {
    match v {
        Value::Number(_) => {
            [json!(0), json!(-1), json!(u64::MAX), json!(1e300), json!(0.5), json!(1), json!(-0.0)]
                [usize::from(choice) % 7]
                .clone()
        }
        Value::String(_) => {
            [json!(""), json!("x".repeat(300)), json!(" "), json!("0.0.0.0:0"), json!("a/b"), json!("../..")]
                [usize::from(choice) % 6]
                .clone()
        }
        Value::Bool(b) => json!(!b),
        Value::Array(_) => json!([]),
        Value::Object(_) => json!({}),
        Value::Null => replacement(choice),
    }
}

/// Applies one mutation at a node picked by `seed` (a walk down the tree).
fn mutate(v: &mut Value, op: u8, seed: u64, choice: u8) {
    let mut node = v;
    let mut s = seed;
    // Walk down a few levels, stopping early sometimes.
    for _ in 0..(seed % 6) {
        let len = match &*node {
            Value::Object(m) => m.len(),
            Value::Array(a) => a.len(),
            _ => 0,
        };
        if len == 0 {
            break;
        }
        let i = (s % len as u64) as usize;
        s /= 7;
        node = match node {
            Value::Object(m) => m.values_mut().nth(i).unwrap(),
            Value::Array(a) => &mut a[i],
            _ => unreachable!(),
        };
    }
    match (op % 5, node) {
        (0, Value::Object(m)) if !m.is_empty() => {
            let key = m.keys().nth((s % m.len() as u64) as usize).unwrap().clone();
            m.remove(&key);
        }
        (1, Value::Object(m)) if !m.is_empty() => {
            let key = m.keys().nth((s % m.len() as u64) as usize).unwrap().clone();
            let value = m.remove(&key).unwrap();
            m.insert(format!("{key}x"), value);
        }
        (2, Value::Array(a)) if !a.is_empty() => {
            let first = a[0].clone();
            a.push(first);
        }
        (3, node) => *node = same_type(node, choice),
        (_, node) => *node = replacement(choice),
    }
}

fn mutated(seed: &Value, ops: &[(u8, u64, u8)]) -> Value {
    let mut v = seed.clone();
    for &(op, at, choice) in ops {
        mutate(&mut v, op, at, choice);
    }
    v
}

/// Flips, inserts or deletes a few bytes of `text` (kept UTF-8, lossily).
fn flip_bytes(text: &str, flips: &[(usize, u8, u8)]) -> String {
    let mut b = text.as_bytes().to_vec();
    for &(at, kind, byte) in flips {
        if b.is_empty() {
            break;
        }
        let i = at % b.len();
        match kind % 3 {
            0 => b[i] = byte,
            1 => b.insert(i, byte),
            _ => {
                b.remove(i);
            }
        }
    }
    String::from_utf8_lossy(&b).into_owned()
}

fn filter_parse(text: &str) -> bool {
    gateway_filter::config::Config::from_json(text.as_bytes()).is_ok()
}

fn sidecar_parse(text: &str) -> bool {
    gateway_ext_proc::config::Config::from_yaml(text).is_ok()
}

/// Parses a gateway config; when it is accepted, renders every target, and the rendered filter
/// and sidecar configs must be accepted by their own parsers.
fn gateway_parse(text: &str) -> Result<bool, TestCaseError> {
    let Ok(loaded) = Loaded::from_yaml(text, "fuzz.yaml", seeds().dir.clone()) else { return Ok(false) };
    // `All`: every target the config has the sections for (the example has them all).
    let Ok(out) = render(&loaded, Target::All) else { return Ok(true) };
    for f in &out.files {
        if f.path.ends_with("filter.json") {
            prop_assert!(
                filter_parse(&f.content),
                "rendered {} refused by the filter:\n{}",
                f.path,
                f.content
            );
        }
        if f.path.ends_with("sidecar.yaml") {
            prop_assert!(
                sidecar_parse(&f.content),
                "rendered {} refused by the sidecar:\n{}",
                f.path,
                f.content
            );
        }
    }
    Ok(true)
}

fn ops() -> impl Strategy<Value = Vec<(u8, u64, u8)>> {
    prop::collection::vec((any::<u8>(), any::<u64>(), any::<u8>()), 1..4)
}

fn flips() -> impl Strategy<Value = Vec<(usize, u8, u8)>> {
    prop::collection::vec((any::<usize>(), any::<u8>(), any::<u8>()), 0..4)
}

#[test]
fn the_seeds_are_valid() {
    let s = seeds();
    assert!(filter_parse(&s.filter.to_string()));
    assert!(sidecar_parse(&serde_yaml_ng::to_string(&s.sidecar).unwrap()));
    assert!(gateway_parse(&serde_yaml_ng::to_string(&s.gateway).unwrap()).unwrap());
}

proptest! {
    #![proptest_config(cases(128))]

    #[test]
    fn filter_config_never_panics(ops in ops(), flips in flips()) {
        let v = mutated(&seeds().filter, &ops);
        filter_parse(&v.to_string());
        filter_parse(&flip_bytes(&v.to_string(), &flips));
        filter_parse(&flip_bytes(&seeds().filter.to_string(), &flips));
    }

    #[test]
    fn sidecar_config_never_panics(ops in ops(), flips in flips()) {
        let text = serde_yaml_ng::to_string(&mutated(&seeds().sidecar, &ops)).unwrap();
        sidecar_parse(&text);
        sidecar_parse(&flip_bytes(&text, &flips));
    }

    #[test]
    fn gateway_config_never_panics_and_renders_what_the_components_accept(ops in ops(), flips in flips()) {
        let text = serde_yaml_ng::to_string(&mutated(&seeds().gateway, &ops)).unwrap();
        gateway_parse(&text)?;
        gateway_parse(&flip_bytes(&text, &flips))?;
    }

    #[test]
    fn arbitrary_text_never_panics(text in "\\PC{0,200}", bytes in prop::collection::vec(any::<u8>(), 0..200)) {
        let lossy = String::from_utf8_lossy(&bytes).into_owned();
        for t in [&text, &lossy] {
            filter_parse(t);
            sidecar_parse(t);
            gateway_parse(t)?;
        }
        let _ = gateway_filter::config::Config::from_json(&bytes);
    }
}
