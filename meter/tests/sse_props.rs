//! Fuzz-style property tests of the response meter (issue 16, item 5): the SSE parser, the JSON
//! `usage` scanner and the [`Meter`] give the same answer however the body is split into chunks,
//! and garbage or huge lines never panic and never grow memory past the bound.
//!
//! `PROPTEST_CASES` sets the number of cases (CI: the default below; `make fuzz`: many more).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use gateway_meter::json_usage::UsageScanner;
use gateway_meter::sse::SseParser;
use gateway_meter::{EndReason, Meter, MAX_USAGE_BYTES};
use proptest::prelude::*;
use proptest::test_runner::{Config as PtConfig, FileFailurePersistence};
use serde::Deserialize;
use serde_json::{json, Value};

fn cases(default: u32) -> PtConfig {
    let cases = std::env::var("PROPTEST_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(default);
    PtConfig {
        cases,
        failure_persistence: Some(Box::new(FileFailurePersistence::Off)),
        ..PtConfig::default()
    }
}

/// `body` cut at the given points (sorted, deduplicated, in range): every byte once, in order.
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

/// One SSE line ending (vLLM sends `\n`; the format allows `\r\n`).
fn eol(crlf: bool) -> &'static str {
    if crlf {
        "\r\n"
    } else {
        "\n"
    }
}

/// A vLLM-like chat stream: content chunks, optionally comments and multi-line data, a usage
/// chunk, `[DONE]`.
fn sse_stream() -> impl Strategy<Value = (Vec<u8>, u64, u64)> {
    (
        prop::collection::vec(("\\PC{0,20}", any::<bool>(), any::<bool>()), 0..12),
        0u64..100_000,
        0u64..100_000,
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(|(contents, prompt, completion, crlf, with_done)| {
            let nl = eol(crlf);
            let mut s = String::new();
            for (text, comment, multiline) in contents {
                if comment {
                    s.push_str(&format!(": keep-alive{nl}"));
                }
                let chunk = json!({"id": "c", "object": "chat.completion.chunk",
                    "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": null}], "usage": null});
                let body = chunk.to_string();
                if multiline {
                    // The same JSON over two `data:` lines, joined by the parser with `\n`.
                    let (a, b) = body.split_at(body.find(',').unwrap_or(0));
                    s.push_str(&format!("data: {a}{nl}data:{b}{nl}{nl}"));
                } else {
                    s.push_str(&format!("data: {body}{nl}{nl}"));
                }
            }
            let usage = json!({"id": "c", "choices": [], "usage": {"prompt_tokens": prompt,
                "completion_tokens": completion, "total_tokens": prompt + completion}});
            s.push_str(&format!("data: {usage}{nl}{nl}"));
            if with_done {
                s.push_str(&format!("data: [DONE]{nl}{nl}"));
            }
            (s.into_bytes(), prompt, completion)
        })
}

fn parse_events(chunks: &[&[u8]], max: usize) -> (Vec<Vec<u8>>, u64) {
    let mut p = SseParser::new(max);
    let mut events = Vec::new();
    for c in chunks {
        p.feed(c, |e| events.push(e.to_vec()));
    }
    (events, p.dropped_events())
}

fn meter(chunks: &[&[u8]], content_type: &str) -> gateway_meter::Usage {
    let mut m = Meter::new(MAX_USAGE_BYTES);
    m.start(0);
    assert!(m.on_response_headers(200, content_type, false, 1).is_none());
    let mut out = None;
    for (i, c) in chunks.iter().enumerate() {
        let last = i + 1 == chunks.len();
        let u = m.on_response_body(c, last, Some(2 + i as u64));
        assert!(out.is_none() || u.is_none(), "usage returned twice");
        out = out.or(u);
    }
    out.expect("the last chunk returns the usage")
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
struct Counts {
    prompt_tokens: u64,
    completion_tokens: u64,
}

/// Random bytes, about half of them drawn from `specials` (the bytes the parser acts on).
fn garbage(specials: &'static [u8], max_len: usize) -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(any::<u8>(), 0..max_len).prop_map(move |raw| {
        raw.into_iter().map(|b| if b < 128 { specials[usize::from(b) % specials.len()] } else { b }).collect()
    })
}

proptest! {
    #![proptest_config(cases(256))]

    /// Any split of a stream gives the same events as the whole stream in one chunk.
    #[test]
    fn sse_events_do_not_depend_on_chunking(
        (body, _, _) in sse_stream(),
        cuts in prop::collection::vec(any::<usize>(), 0..40),
    ) {
        let whole = parse_events(&[&body], 1 << 20);
        prop_assert_eq!(parse_events(&split(&body, &cuts), 1 << 20), whole);
    }

    /// Any split of a metered stream gives the same usage and end.
    #[test]
    fn metered_stream_does_not_depend_on_chunking(
        (body, prompt, completion) in sse_stream(),
        cuts in prop::collection::vec(any::<usize>(), 0..40),
    ) {
        let whole = meter(&[&body], "text/event-stream");
        let parts = meter(&split(&body, &cuts), "text/event-stream");
        prop_assert_eq!((parts.prompt_tokens, parts.completion_tokens), (prompt, completion));
        prop_assert_eq!(
            (parts.prompt_tokens, parts.completion_tokens, parts.end_reason, parts.usage_source),
            (whole.prompt_tokens, whole.completion_tokens, whole.end_reason, whole.usage_source)
        );
    }

    /// Garbage (random bytes, random splits, any bound) never panics; no event is longer than
    /// the bound; a line over the bound is dropped, not kept.
    #[test]
    fn sse_garbage_is_bounded(
        body in garbage(b"\n\r:", 2000),
        cuts in prop::collection::vec(any::<usize>(), 0..20),
        max in 1usize..256,
    ) {
        let (events, _) = parse_events(&split(&body, &cuts), max);
        for e in &events {
            prop_assert!(e.len() <= max, "event of {} bytes over the bound {max}", e.len());
        }
        let _ = meter(&split(&body, &cuts), "text/event-stream");
        let _ = meter(&split(&body, &cuts), "application/json");
    }

    /// A huge line among valid events is dropped whole, the events around it kept.
    #[test]
    fn huge_lines_are_dropped(
        huge in 300usize..5000,
        cuts in prop::collection::vec(any::<usize>(), 0..20),
        data_prefix in any::<bool>(),
    ) {
        let big = "x".repeat(huge);
        let line = if data_prefix { format!("data: {big}") } else { big };
        let body = format!("data: a\n\n{line}\n\ndata: b\n\n").into_bytes();
        let (events, dropped) = parse_events(&split(&body, &cuts), 256);
        prop_assert_eq!(events, vec![b"a".to_vec(), b"b".to_vec()]);
        // A `data:` line over the bound drops its event; another field line is ignored anyway
        // (counted as a drop only when it arrived split, before its end was seen).
        prop_assert!(if data_prefix { dropped == 1 } else { dropped <= 1 }, "dropped {dropped}");
    }

    /// The JSON scanner reads `usage` as serde_json reads it, under any split, whatever else the
    /// body holds (escapes, nesting, a `usage` key inside other members).
    #[test]
    fn json_usage_does_not_depend_on_chunking(
        prompt in any::<u32>(),
        completion in any::<u32>(),
        before in prop::collection::vec(("\\PC{0,8}", "\\PC{0,30}"), 0..4),
        after in prop::collection::vec(("[a-z]{1,8}", "\\PC{0,30}"), 0..4),
        spaced in any::<bool>(),
        cuts in prop::collection::vec(any::<usize>(), 0..30),
    ) {
        let mut obj = serde_json::Map::new();
        for (k, v) in &before {
            if k != "usage" {
                obj.insert(k.clone(), json!({"usage": v, "text": [v, {"usage": 1}]}));
            }
        }
        obj.insert("usage".into(), json!({"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": u64::from(prompt) + u64::from(completion)}));
        for (k, v) in &after {
            if k != "usage" {
                obj.insert(format!("z{k}"), Value::String(v.clone()));
            }
        }
        let body = if spaced {
            serde_json::to_string_pretty(&Value::Object(obj)).unwrap()
        } else {
            Value::Object(obj).to_string()
        };
        let body = body.into_bytes();
        let mut scanner = UsageScanner::<Counts>::new(MAX_USAGE_BYTES);
        for c in split(&body, &cuts) {
            scanner.feed(c);
        }
        prop_assert_eq!(
            scanner.usage(),
            Some(Counts { prompt_tokens: u64::from(prompt), completion_tokens: u64::from(completion) })
        );
        let m = meter(&split(&body, &cuts), "application/json");
        prop_assert_eq!((m.prompt_tokens, m.completion_tokens), (u64::from(prompt), u64::from(completion)));
        prop_assert_eq!(m.end_reason, EndReason::Completed);
    }

    /// Garbage to the JSON scanner never panics, and a `usage` it reports is one serde_json would
    /// read from the same bytes when they parse at all.
    #[test]
    fn json_usage_garbage(
        body in garbage(b"{}\"\\:,", 600),
        prefix in any::<bool>(),
        cuts in prop::collection::vec(any::<usize>(), 0..20),
    ) {
        let mut body = body;
        if prefix {
            let mut b = br#"{"usage":{"prompt_tokens":1,"completion_tokens":2},"x":"#.to_vec();
            b.extend_from_slice(&body);
            body = b;
        }
        let mut scanner = UsageScanner::<Counts>::new(64);
        for c in split(&body, &cuts) {
            scanner.feed(c);
        }
        if let (Some(u), Ok(Value::Object(map))) = (scanner.usage(), serde_json::from_slice::<Value>(&body)) {
            let v = map.get("usage").cloned().unwrap_or(Value::Null);
            prop_assert_eq!(Some(u), serde_json::from_value::<Counts>(v).ok());
        }
    }
}
