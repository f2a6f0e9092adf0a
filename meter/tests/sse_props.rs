//! Fuzz-style property tests of the response meter (issue 16, item 5): the SSE parser, the JSON
//! `usage` scanner and the [`Meter`] give the same answer however the body is split into chunks,
//! and garbage or huge lines never panic and never grow memory past the bound. Issue 15, item 5
//! adds the Responses API: the event-at-a-time SSE reader ([`SseStream`]) dispatches what the
//! parser does, and a Responses stream is metered the same under any split, whatever its events'
//! member order, framing and size.
//!
//! `PROPTEST_CASES` sets the number of cases (CI: the default below; `make fuzz`: many more).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use gateway_meter::json_usage::UsageScanner;
use gateway_meter::sse::{SseParser, SsePiece, SseStream};
use gateway_meter::{Api, EndReason, Meter, UsageSource, MAX_USAGE_BYTES};
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

/// One SSE line ending: 0 `\n` (what vLLM sends), 1 `\r\n`, 2 a bare `\r` (the format allows all three).
fn eol(kind: u8) -> &'static str {
    match kind {
        0 => "\n",
        1 => "\r\n",
        _ => "\r",
    }
}

/// A vLLM-like chat stream: content chunks, optionally comments and multi-line data, a usage
/// chunk, `[DONE]`.
fn sse_stream() -> impl Strategy<Value = (Vec<u8>, u64, u64)> {
    (
        prop::collection::vec(("\\PC{0,20}", any::<bool>(), any::<bool>()), 0..12),
        0u64..100_000,
        0u64..100_000,
        0u8..3,
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
    meter_api(chunks, content_type, Api::ChatCompletions)
}

fn meter_api(chunks: &[&[u8]], content_type: &str, api: Api) -> gateway_meter::Usage {
    let mut m = Meter::new(MAX_USAGE_BYTES);
    m.set_api(api);
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

/// The events [`SseStream`] dispatches: each event's data pieces joined.
fn stream_events(chunks: &[&[u8]]) -> Vec<Vec<u8>> {
    let mut s = SseStream::new();
    let (mut events, mut data) = (Vec::new(), Vec::new());
    for c in chunks {
        s.feed(c, |piece| match piece {
            SsePiece::Data(d) => data.extend_from_slice(d),
            SsePiece::EventName(_) => {}
            SsePiece::EventEnd { data: had } => {
                if had {
                    events.push(std::mem::take(&mut data));
                }
            }
        });
    }
    events
}

/// SSE-ish text: lines drawn from the fields a parser acts on (data with and without a space or
/// a value, event, comments, other fields, stray `\r`), random text, `\n` or `\r\n` ends.
fn sse_lines() -> impl Strategy<Value = Vec<u8>> {
    let line = prop_oneof![
        Just("data: ".to_string()),
        Just("data:".to_string()),
        Just("data".to_string()),
        Just("event: response.completed".to_string()),
        Just("event".to_string()),
        Just(": keep-alive".to_string()),
        Just("id: 7".to_string()),
        Just("datax: no".to_string()),
        Just("\r".to_string()),
        Just(String::new()),
        "\\PC{0,12}",
    ];
    prop::collection::vec((line, "[ -~\r]{0,10}", 0u8..3), 0..30).prop_map(|lines| {
        let mut out = String::new();
        for (head, tail, crlf) in lines {
            out.push_str(&head);
            out.push_str(&tail);
            out.push_str(eol(crlf));
        }
        out.into_bytes()
    })
}

/// Where `type` goes in an event's JSON.
#[derive(Debug, Clone, Copy)]
enum TypeAt {
    /// Last, as vLLM's pydantic models serialise it.
    Last,
    /// First, as llmock and OpenAI's own examples.
    First,
    /// Only on the `event:` line.
    LineOnly,
}

/// A Responses API stream: `deltas` content events (an empty delta counts nothing), an
/// `output_text.done` and a terminal event repeating `padding` (any text: the output a terminal
/// event repeats, escapes and braces included), `event:` lines or not, `\n` or `\r\n`.
/// Returns the bytes, the same without the terminal event, the usage the terminal event reports
/// (when it has one) and the content deltas.
#[allow(clippy::type_complexity)]
fn responses_stream() -> impl Strategy<Value = (Vec<u8>, Vec<u8>, Option<(u64, u64, u64)>, u64)> {
    (
        prop::collection::vec("\\PC{0,12}", 0..12),
        prop::option::of((0u64..100_000, 0u64..100_000, 0u64..1000)),
        prop_oneof![Just(TypeAt::Last), Just(TypeAt::First), Just(TypeAt::LineOnly)],
        0u8..3,
        any::<bool>(),
        "\\PC{0,300}",
        prop_oneof![Just("response.completed"), Just("response.incomplete"), Just("response.failed")],
    )
        .prop_map(|(deltas, usage, type_at, crlf, event_lines, padding, terminal)| {
            let nl = eol(crlf);
            // Members in the given order (serde_json's maps sort their keys), `type` placed as
            // `type_at` says.
            let event = |kind: &str, members: Vec<(&str, Value)>| {
                let mut parts: Vec<String> = members.iter().map(|(k, v)| format!("{}:{v}", json!(k))).collect();
                let ty = format!("\"type\":{}", json!(kind));
                match type_at {
                    TypeAt::First => parts.insert(0, ty),
                    TypeAt::Last => parts.push(ty),
                    TypeAt::LineOnly if !event_lines => parts.push(ty),
                    TypeAt::LineOnly => {}
                }
                let line = if event_lines { format!("event: {kind}{nl}") } else { String::new() };
                format!("{line}data: {{{}}}{nl}{nl}", parts.join(","))
            };
            let mut events = Vec::new();
            let head = json!({"id": "resp_1", "output": [], "status": "in_progress", "usage": null, "instructions": padding});
            events.push(event("response.created", vec![("response", head.clone()), ("sequence_number", json!(0))]));
            events.push(event("response.in_progress", vec![("response", head), ("sequence_number", json!(1))]));
            let mut content = 0;
            for (i, d) in deltas.iter().enumerate() {
                content += u64::from(!d.is_empty());
                events.push(event("response.output_text.delta", vec![("content_index", json!(0)), ("delta", json!(d)),
                    ("item_id", json!("msg_1")), ("logprobs", json!([])), ("output_index", json!(0)),
                    ("sequence_number", json!(2 + i))]));
            }
            let text: String = deltas.concat();
            events.push(event("response.output_text.done", vec![("delta", json!("not content")), ("text", json!(text))]));
            let usage_json = usage.map(|(i, o, c)| json!({"input_tokens": i, "input_tokens_details": {"cached_tokens": c},
                "output_tokens": o, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": i + o}));
            // The response object's own keys sort `usage` after `output`, whose content quotes a
            // nested `usage` that is not the response's.
            let response = json!({"id": "resp_1", "instructions": padding, "output": [{"type": "message",
                "content": [{"type": "output_text", "text": format!("{text}{padding}"), "usage": {"input_tokens": 1}}]}],
                "usage": usage_json.unwrap_or(Value::Null)});
            let without_terminal = events.concat().into_bytes();
            events.push(event(terminal, vec![("response", response), ("sequence_number", json!(99))]));
            (events.concat().into_bytes(), without_terminal, usage, content)
        })
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

    /// The event-at-a-time reader dispatches the events the parser does, under any split.
    #[test]
    fn the_stream_reader_dispatches_what_the_parser_does(
        body in prop_oneof![sse_lines(), sse_stream().prop_map(|(b, _, _)| b), garbage(b"\n\r: datev", 600)],
        cuts in prop::collection::vec(any::<usize>(), 0..40),
    ) {
        let (whole, _) = parse_events(&[&body], 1 << 20);
        prop_assert_eq!(stream_events(&split(&body, &cuts)), whole);
    }

    /// A Responses stream is metered the same under any split: the terminal event's usage when it
    /// has one, else the non-empty deltas; ended as the protocol ends it.
    #[test]
    fn a_responses_stream_is_metered_the_same_under_any_split(
        (full, without_terminal, usage, content) in responses_stream(),
        cuts in prop::collection::vec(any::<usize>(), 0..40),
        truncate in any::<bool>(),
    ) {
        // Cut before the terminal event: no usage, counted from the deltas, incomplete.
        let body = if truncate { without_terminal } else { full };
        let whole = meter_api(&[&body], "text/event-stream", Api::Responses);
        let parts = meter_api(&split(&body, &cuts), "text/event-stream", Api::Responses);
        let expected = match (usage, truncate) {
            (Some((i, o, c)), false) => (i, o, c, UsageSource::Upstream),
            _ => (0, content, 0, UsageSource::StreamedChunks),
        };
        prop_assert_eq!((parts.prompt_tokens, parts.completion_tokens, parts.cached_tokens, parts.usage_source), expected);
        let end = if truncate { EndReason::Incomplete } else { EndReason::Completed };
        prop_assert_eq!(parts.end_reason, end);
        prop_assert_eq!((whole.prompt_tokens, whole.completion_tokens, whole.end_reason, whole.usage_source),
            (parts.prompt_tokens, parts.completion_tokens, parts.end_reason, parts.usage_source));
    }

    /// Garbage to a Responses meter (stream or JSON) never panics.
    #[test]
    fn responses_garbage_never_panics(
        body in prop_oneof![garbage(b"\n\r:{}\"\\,", 2000), sse_lines()],
        cuts in prop::collection::vec(any::<usize>(), 0..20),
    ) {
        let _ = meter_api(&split(&body, &cuts), "text/event-stream", Api::Responses);
        let _ = meter_api(&split(&body, &cuts), "application/json", Api::Responses);
    }
}
