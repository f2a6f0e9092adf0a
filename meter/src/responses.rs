//! The OpenAI Responses API's stream events (`POST /v1/responses` with `"stream": true`), read one
//! at a time as their bytes arrive, in bounded memory.
//!
//! The stream is Server-Sent Events of typed JSON events, each framed as `event: <type>` then
//! `data: <json>` (vLLM's `_convert_stream_to_sse_events` in
//! `vllm/entrypoints/openai/responses/api_router.py`; OpenAI's streaming reference). An event's
//! JSON has a `type` (`response.created`, `response.in_progress`, `response.output_item.added`,
//! `response.content_part.added`, `response.output_text.delta`, ..., `response.completed`); vLLM
//! serialises the fields in its pydantic models' order, so `type` comes *last*
//! (`{"content_index":0,"delta":"Hi","item_id":"...","logprobs":[],"output_index":0,
//! "sequence_number":4,"type":"response.output_text.delta"}`), other servers put it first: the
//! reader takes the members in any order. A stream ends with one of the terminal events
//! `response.completed`, `response.incomplete` or `response.failed`, whose `response` is the whole
//! response object with its `usage`
//! (`{"input_tokens":12,"input_tokens_details":{"cached_tokens":0},"output_tokens":5,
//! "output_tokens_details":{"reasoning_tokens":0},"total_tokens":17}`); vLLM always sends it (no
//! `stream_options` needed) and no `data: [DONE]` (taken as an end too, should a server send one).
//!
//! The terminal event repeats everything the response holds (all its output text, logprobs when
//! asked for, the echoed `instructions`), so it can be far larger than any chat chunk: the reader
//! never holds an event. It walks the event's top-level members ([`Members`]) and keeps only the
//! `type` (at most [`MAX_TYPE_BYTES`]), the first two bytes of a `delta`, and the `response`
//! member's own top-level `usage` (found by a nested [`UsageScanner`], at most
//! [`crate::MAX_USAGE_BYTES`]).

use serde::Deserialize;

use crate::json_usage::{key_is, Capture, Members, Piece, UsageScanner};

/// Longest `type` value held (the longest event type of OpenAI's reference is under 60 bytes).
pub const MAX_TYPE_BYTES: usize = 96;

/// The Responses API's `usage` object (OpenAI's `ResponseUsage`, vLLM's `ResponseUsage` in
/// `vllm/entrypoints/openai/responses/protocol.py`), reduced to what the meter records.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub(crate) struct ResponsesUsage {
    /// `input_tokens`: the prompt's tokens.
    #[serde(default)]
    pub(crate) input_tokens: u64,
    /// `output_tokens`: the generated tokens (reasoning included).
    #[serde(default)]
    pub(crate) output_tokens: u64,
    /// `input_tokens_details` (`cached_tokens`: prompt tokens served from the prefix cache).
    #[serde(default)]
    pub(crate) input_tokens_details: Option<InputDetails>,
}

/// `usage.input_tokens_details`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub(crate) struct InputDetails {
    /// `cached_tokens`.
    #[serde(default)]
    pub(crate) cached_tokens: Option<u64>,
}

/// What one event was, for the meter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct EventSummary {
    /// A content event: a type ending in `.delta` (`response.output_text.delta`,
    /// `response.reasoning_text.delta`, `response.function_call_arguments.delta`, ...) whose
    /// `delta` is a non-empty string. vLLM sends one per decoded step.
    pub(crate) content: bool,
    /// A terminal event (`response.completed`, `response.incomplete`, `response.failed`) or
    /// `data: [DONE]`: the stream ended as the protocol ends it.
    pub(crate) end: bool,
    /// A `response.failed` event: the response ended in an error (its usage, when absent, is
    /// not owed as a whole).
    pub(crate) failed: bool,
    /// The `usage` of the event's `response` member, when it has one (not null).
    pub(crate) usage: Option<ResponsesUsage>,
}

/// Which member of the event is being read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Target {
    Other,
    Type,
    Delta,
    Response,
}

/// Reads one event's data, fed in pieces; [`EventReader::finish`] says what it was and readies it
/// for the next event.
#[derive(Debug)]
pub(crate) struct EventReader {
    members: Members,
    target: Target,
    /// The raw `type` value (quotes included) while it is read.
    kind: Capture,
    /// The event's type: from the data's `type`, else the `event:` line.
    data_type: Option<Kind>,
    line_type: Option<Kind>,
    /// The first two bytes of `delta` (`""` is empty) and how many arrived.
    delta_head: [u8; 2],
    delta_len: usize,
    delta_content: bool,
    response: UsageScanner<ResponsesUsage>,
    usage: Option<ResponsesUsage>,
    /// The first bytes of the data and its length, to recognise `[DONE]`.
    data_head: [u8; 6],
    data_len: usize,
    max_usage_bytes: usize,
}

/// An event type, as far as the meter cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Delta,
    Terminal,
    Failed,
    Other,
}

impl Kind {
    fn of(name: &str) -> Self {
        match name {
            "response.completed" | "response.incomplete" => Kind::Terminal,
            "response.failed" => Kind::Failed,
            n if n.ends_with(".delta") => Kind::Delta,
            _ => Kind::Other,
        }
    }
}

impl EventReader {
    /// A reader for the first event; a `response.usage` over `max_usage_bytes` reads as none.
    pub(crate) fn new(max_usage_bytes: usize) -> Self {
        Self {
            members: Members::new(),
            target: Target::Other,
            kind: Capture::new(MAX_TYPE_BYTES + 2),
            data_type: None,
            line_type: None,
            delta_head: [0; 2],
            delta_len: 0,
            delta_content: false,
            response: UsageScanner::new(max_usage_bytes),
            usage: None,
            data_head: [0; 6],
            data_len: 0,
            max_usage_bytes,
        }
    }

    /// The event's `event:` line.
    pub(crate) fn set_name(&mut self, name: &[u8]) {
        self.line_type = std::str::from_utf8(name).ok().map(Kind::of);
    }

    /// The next bytes of the event's data.
    pub(crate) fn feed(&mut self, data: &[u8]) {
        for (slot, &b) in self.data_head.iter_mut().skip(self.data_len).zip(data) {
            *slot = b;
        }
        self.data_len = self.data_len.saturating_add(data.len());
        let Self {
            members,
            target,
            kind,
            data_type,
            delta_head,
            delta_len,
            delta_content,
            response,
            usage,
            max_usage_bytes,
            ..
        } = self;
        members.feed(data, &mut |piece| match piece {
            Piece::Key(key) => {
                *target = if key_is(key, "type") {
                    kind.clear();
                    Target::Type
                } else if key_is(key, "delta") {
                    *delta_len = 0;
                    Target::Delta
                } else if key_is(key, "response") {
                    *response = UsageScanner::new(*max_usage_bytes);
                    Target::Response
                } else {
                    Target::Other
                };
            }
            Piece::Value(bytes) => match target {
                Target::Type => kind.push(bytes),
                Target::Delta => {
                    for (slot, &b) in delta_head.iter_mut().skip(*delta_len).zip(bytes) {
                        *slot = b;
                    }
                    *delta_len = delta_len.saturating_add(bytes.len());
                }
                Target::Response => response.feed(bytes),
                Target::Other => {}
            },
            Piece::End => {
                match target {
                    Target::Type => {
                        *data_type = kind
                            .get()
                            .and_then(|raw| serde_json::from_slice::<String>(raw).ok())
                            .map(|name| Kind::of(&name));
                    }
                    Target::Delta => {
                        // A JSON string of at least one character: `"` then anything but `"`.
                        *delta_content =
                            *delta_len >= 2 && matches!(delta_head, [b'"', second] if *second != b'"');
                    }
                    Target::Response => *usage = response.usage(),
                    Target::Other => {}
                }
                *target = Target::Other;
            }
        });
    }

    /// What the event was (its data complete); the reader is then ready for the next event.
    pub(crate) fn finish(&mut self) -> EventSummary {
        let kind = self.data_type.or(self.line_type).unwrap_or(Kind::Other);
        let done_marker = self.data_len == 6 && &self.data_head == b"[DONE]";
        let summary = EventSummary {
            content: kind == Kind::Delta && self.delta_content,
            end: matches!(kind, Kind::Terminal | Kind::Failed) || done_marker,
            failed: kind == Kind::Failed,
            usage: self.usage,
        };
        self.reset();
        summary
    }

    /// Forgets the current event (its data ended or it had none).
    pub(crate) fn reset(&mut self) {
        self.members = Members::new();
        self.target = Target::Other;
        self.kind.clear();
        self.data_type = None;
        self.line_type = None;
        self.delta_len = 0;
        self.delta_content = false;
        self.usage = None;
        self.data_len = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MAX_USAGE_BYTES;

    fn read(parts: &[&[u8]], name: Option<&str>) -> EventSummary {
        let mut r = EventReader::new(MAX_USAGE_BYTES);
        if let Some(n) = name {
            r.set_name(n.as_bytes());
        }
        for p in parts {
            r.feed(p);
        }
        r.finish()
    }

    const COMPLETED: &str = r#"{"response":{"id":"resp_1","created_at":1,"incomplete_details":null,"instructions":"say \"usage\":{\"input_tokens\":99}","output":[{"type":"message","content":[{"type":"output_text","text":"the \"usage\": {} quick","annotations":[],"usage":{"input_tokens":98}}]}],"status":"completed","usage":{"input_tokens":12,"input_tokens_details":{"cached_tokens":4},"output_tokens":5,"output_tokens_details":{"reasoning_tokens":0},"total_tokens":17},"user":null},"sequence_number":9,"type":"response.completed"}"#;

    #[test]
    fn a_completed_event_yields_its_usage_at_every_split() {
        let want = EventSummary {
            content: false,
            end: true,
            failed: false,
            usage: Some(ResponsesUsage {
                input_tokens: 12,
                output_tokens: 5,
                input_tokens_details: Some(InputDetails { cached_tokens: Some(4) }),
            }),
        };
        let b = COMPLETED.as_bytes();
        for split in 0..=b.len() {
            let (x, y) = b.split_at(split);
            assert_eq!(read(&[x, y], None), want, "split {split}");
        }
        let bytes: Vec<&[u8]> = b.chunks(1).collect();
        assert_eq!(read(&bytes, Some("response.completed")), want);
    }

    #[test]
    fn deltas_count_when_non_empty_whatever_the_member_order() {
        let content = |json: &str, name: Option<&str>| read(&[json.as_bytes()], name).content;
        assert!(content(
            r#"{"content_index":0,"delta":"Hi","item_id":"m","logprobs":[],"output_index":0,"sequence_number":4,"type":"response.output_text.delta"}"#,
            None
        ));
        assert!(content(r#"{"type":"response.output_text.delta","sequence_number":4,"delta":" "}"#, None));
        assert!(content(r#"{"type":"response.reasoning_text.delta","delta":"\"hm\""}"#, None));
        assert!(content(r#"{"type":"response.function_call_arguments.delta","delta" : "{"}"#, None));
        assert!(!content(r#"{"type":"response.output_text.delta","delta":""}"#, None));
        assert!(!content(r#"{"type":"response.output_text.delta","delta":"" }"#, None));
        assert!(!content(r#"{"type":"response.output_text.delta","delta":null}"#, None));
        assert!(!content(r#"{"type":"response.output_text.done","text":"all of it","delta":"x"}"#, None));
        assert!(!content(r#"{"type":"response.output_text.delta"}"#, None));
        // The event line names the type when the data has none; the data's type wins.
        assert!(content(r#"{"delta":"x"}"#, Some("response.output_text.delta")));
        assert!(!content(r#"{"delta":"x","type":"response.created"}"#, Some("response.output_text.delta")));
        assert!(content(r#"{"delta":"x","type":"response.output_text.\u0064elta"}"#, None));
    }

    #[test]
    fn ends_and_odd_events() {
        let end = |json: &str| read(&[json.as_bytes()], None).end;
        assert!(end(r#"{"type":"response.incomplete","response":{"usage":null}}"#));
        assert!(end(r#"{"type":"response.failed","response":{"status":"failed","usage":null}}"#));
        assert!(end("[DONE]"));
        assert!(!end("[DONE] "));
        assert!(!end(r#"{"type":"response.created","response":{"usage":null}}"#));
        assert!(!end(r#"{"type":"error","code":"server_error"}"#));
        for garbage in
            ["", "{", "[]", "{\"type\":", "{\"type\":1}", "{\"response\":{\"usage\":{\"input_tokens\":-1}}}"]
        {
            assert_eq!(read(&[garbage.as_bytes()], None), EventSummary::default(), "{garbage}");
        }
        let failed = read(
            &[br#"{"type":"response.failed","response":{"usage":{"input_tokens":3,"output_tokens":0}}}"#],
            None,
        );
        assert_eq!(failed.usage.map(|u| (u.input_tokens, u.output_tokens)), Some((3, 0)));
    }

    #[test]
    fn a_reader_forgets_each_event() {
        let mut r = EventReader::new(MAX_USAGE_BYTES);
        r.set_name(b"response.output_text.delta");
        r.feed(br#"{"delta":"a","response":{"usage":{"input_tokens":1}}}"#);
        assert!(r.finish().content);
        r.feed(br#"{"type":"response.in_progress"}"#);
        assert_eq!(r.finish(), EventSummary::default());
        // An event cut short (no blank line yet) and reset.
        r.feed(br#"{"type":"response.completed","resp"#);
        r.reset();
        r.feed(br#"{"delta":"b"}"#);
        assert_eq!(r.finish(), EventSummary::default());
    }

    #[test]
    fn a_huge_completed_event_is_read_in_bounded_memory() {
        let mut r = EventReader::new(MAX_USAGE_BYTES);
        r.feed(br#"{"response":{"id":"resp_1","output":[{"type":"message","content":[{"type":"output_text","text":""#);
        let chunk = "the \\\"quick\\\" {brown} [fox] ".repeat(2048);
        for _ in 0..200 {
            r.feed(chunk.as_bytes());
            assert!(r.kind.capacity() <= MAX_TYPE_BYTES + 2);
        }
        r.feed(br#"","annotations":[]}]}],"usage":{"input_tokens":7,"output_tokens":1000000}},"type":"response.completed"}"#);
        let s = r.finish();
        assert!(s.end);
        assert_eq!(s.usage.map(|u| (u.input_tokens, u.output_tokens)), Some((7, 1_000_000)));
    }
}
