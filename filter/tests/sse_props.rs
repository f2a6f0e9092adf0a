//! Fuzz-style property tests of the filter's SSE path (issue 16, item 5): the
//! [`UsageStripper`], which removes the usage event the filter injected and `"usage":null`
//! members from a vLLM stream, gives the same bytes however the stream is split, keeps every
//! other event, and on garbage or huge lines never panics and never holds more than its bound.
//!
//! `PROPTEST_CASES` sets the number of cases (CI: the default below; `make fuzz`: many more).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use gateway_filter::sse::{ChunkOutput, UsageStripper};
use proptest::prelude::*;
use proptest::test_runner::{Config as PtConfig, FileFailurePersistence};
use serde_json::{json, Value};

fn cases(default: u32) -> PtConfig {
    let cases = std::env::var("PROPTEST_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(default);
    PtConfig {
        cases,
        failure_persistence: Some(Box::new(FileFailurePersistence::Off)),
        ..PtConfig::default()
    }
}

fn split<'a>(body: &'a [u8], cuts: &[usize]) -> Vec<&'a [u8]> {
    let mut points: Vec<usize> = cuts.iter().map(|c| c % (body.len() + 1)).collect();
    points.sort_unstable();
    points.dedup();
    let mut out = Vec::new();
    let mut at = 0;
    for p in points {
        out.push(&body[at..p]);
        at = p;
    }
    out.push(&body[at..]);
    out
}

/// The bytes the stripper sends on for `chunks` (the last with `end_of_stream`), checking its
/// held-back bytes stay within `max` after every chunk.
fn strip(chunks: &[&[u8]], max: usize) -> Vec<u8> {
    let mut s = UsageStripper::new(max);
    let mut out = Vec::new();
    for (i, c) in chunks.iter().enumerate() {
        match s.push(c, i + 1 == chunks.len()) {
            ChunkOutput::Unchanged => out.extend_from_slice(c),
            ChunkOutput::Replace(b) => out.extend_from_slice(&b),
        }
        assert!(s.pending_len() <= max, "holds {} bytes over the bound {max}", s.pending_len());
    }
    out
}

/// A vLLM stream with `stream_options.include_usage` injected: content chunks carrying
/// `"usage":null`, the usage chunk (`choices: []`), `[DONE]`.
fn injected_stream() -> impl Strategy<Value = (Vec<u8>, Vec<Value>)> {
    (prop::collection::vec(("\\PC{0,20}", any::<bool>(), 0usize..3), 0..10), 0u8..3).prop_map(
        |(contents, eol)| {
            // Every line end the SSE format allows: `\n` (vLLM's), `\r\n`, a bare `\r`.
            let nl = ["\n", "\r\n", "\r"][usize::from(eol)];
            let mut s = String::new();
            let mut kept = Vec::new();
            for (text, comment, usage_at) in contents {
                if comment {
                    s.push_str(&format!(": ping{nl}{nl}"));
                }
                let chunk = json!({"id": "c", "choices": [{"index": 0, "delta": {"content": text}}]});
                kept.push(chunk.clone());
                // `"usage":null` first, in the middle or last.
                let body = chunk.to_string();
                let body = match usage_at {
                    0 => format!(r#"{{"usage":null,{}"#, &body[1..]),
                    1 => body.replacen(r#","choices""#, r#","usage":null,"choices""#, 1),
                    _ => format!(r#"{},"usage":null}}"#, &body[..body.len() - 1]),
                };
                s.push_str(&format!("data: {body}{nl}{nl}"));
            }
            let usage =
                json!({"id": "c", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}});
            s.push_str(&format!("data: {usage}{nl}{nl}data: [DONE]{nl}{nl}"));
            (s.into_bytes(), kept)
        },
    )
}

/// The JSON of each `data:` event in an SSE byte stream (`[DONE]` and comments left out).
fn data_events(body: &[u8]) -> Vec<Value> {
    let text = String::from_utf8_lossy(body).replace("\r\n", "\n").replace('\r', "\n");
    text.split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap_or_else(|err| panic!("{err}: {d}")))
        .collect()
}

/// Random bytes, about half of them drawn from `specials` (the bytes the parser acts on).
fn garbage(specials: &'static [u8], max_len: usize) -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(any::<u8>(), 0..max_len).prop_map(move |raw| {
        raw.into_iter().map(|b| if b < 128 { specials[usize::from(b) % specials.len()] } else { b }).collect()
    })
}

proptest! {
    #![proptest_config(cases(256))]

    /// The usage event and every `"usage":null` go, every other event stays, whatever the split.
    #[test]
    fn stripping_does_not_depend_on_chunking(
        (body, kept) in injected_stream(),
        cuts in prop::collection::vec(any::<usize>(), 0..40),
    ) {
        let whole = strip(&[&body], 1 << 20);
        prop_assert_eq!(strip(&split(&body, &cuts), 1 << 20), whole.clone());
        prop_assert_eq!(data_events(&whole), kept);
        prop_assert!(!String::from_utf8_lossy(&whole).contains("usage"));
        let text = String::from_utf8_lossy(&whole);
        let ends_done = ["\n\n", "\r\n\r\n", "\r\r"].iter().any(|nl| text.ends_with(&format!("data: [DONE]{nl}")));
        prop_assert!(ends_done);
    }

    /// Garbage, huge lines and tiny bounds: no panic, nothing held past the bound, and every byte
    /// that is not a removed usage goes on (the output is never longer than the input).
    #[test]
    fn stripper_garbage_is_bounded(
        body in garbage(b"\n\r{}\":", 1500),
        prefix in any::<bool>(),
        cuts in prop::collection::vec(any::<usize>(), 0..20),
        max in 1usize..300,
    ) {
        let mut body = body;
        if prefix {
            let mut b = b"data: {\"usage\":null,\"choices\":[".to_vec();
            b.extend_from_slice(&body);
            body = b;
        }
        let out = strip(&split(&body, &cuts), max);
        prop_assert!(out.len() <= body.len());
    }
}
