//! Metering of one OpenAI-style response, with no I/O and no clock: a state machine fed the
//! response headers and each response body chunk as they pass (by the wasm filter in Envoy, or
//! the sidecar's ext_proc metering stream), that yields exactly one [`Usage`] however the stream
//! ends.
//!
//! Usage comes from the upstream's OpenAI `usage` object (the final SSE chunk, which the filter
//! makes vLLM send with `stream_options.include_usage`, or the top-level `usage` member of a
//! non-streaming response's JSON body, found by an incremental scanner that holds none of the body
//! ([`json_usage`]: a body of any size, `logprobs` or a large `n` included, is metered in bounded
//! memory). When none arrives (client abort, upstream reset, truncated stream) the completion
//! tokens are counted from the streamed chunks, one per chunk with non-empty `delta.content`,
//! `delta.reasoning_content` or `text` (vLLM streams one chunk per decoded step), and the prompt
//! tokens are left to the caller (the estimate or exact count it holds; see
//! [`Usage::prompt_tokens_known`]).
//!
//! Times are microseconds on any clock that does not go backwards between calls, given by the
//! caller (`now_us`). A body chunk needs a time only while [`Meter::needs_clock`] says so (until the
//! first content, for TTFT) and with the last chunk: a caller whose clock costs a host call (the
//! wasm filter) passes `None` otherwise, and the time per output token of a completed stream then
//! ends at its last chunk.
//!
//! A request that ends before any response headers charges nothing from the meter; the caller,
//! which knows whether the request reached the upstream, charges a non-streaming one its
//! reservation instead ([`Usage::charges_reservation`] gives the rule, [`UsageSource::Reservation`]
//! marks the record).

pub mod json_usage;
pub mod sse;

use std::borrow::Cow;
use std::fmt;

use serde::de::{SeqAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize};

use crate::json_usage::UsageScanner;
use crate::sse::SseParser;

pub use crate::json_usage::MAX_USAGE_BYTES;

/// Largest single SSE event the meter holds while parsing, in bytes.
pub const MAX_SSE_EVENT_BYTES: usize = 1 << 20;

/// Version of the [`Usage`] wire shape (its `v` field).
pub const USAGE_VERSION: u32 = 1;

/// How the request ended, as the meter saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EndReason {
    /// The last response body chunk (or a body-less response) arrived.
    Completed,
    /// The stream ended before the response did (abort, reset, timeout), or a 2xx SSE stream
    /// ended without `data: [DONE]` (truncated upstream).
    Incomplete,
}

/// Where the token counts came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UsageSource {
    /// The upstream's `usage` object.
    Upstream,
    /// Counted from streamed chunks (no `usage` arrived).
    StreamedChunks,
    /// Never set by the meter: the caller charged the request's reservation (prompt plus the
    /// completion cap) because it reached the upstream but ended before any response headers
    /// while not streaming ([`Usage::charges_reservation`]).
    Reservation,
}

/// One finished response's usage. Also the JSON the wasm filter hands the sidecar through Envoy's
/// filter state (`wasm.llm_gateway.usage`, logged by the gRPC access log), e.g.
/// `{"v":1,"status":200,"prompt_tokens":17,"completion_tokens":3,"cached_tokens":0,
/// "ttft_us":2100,"tpot_us":5000,"duration_us":9000,"end_reason":"completed",
/// "usage_source":"upstream"}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Usage {
    /// Wire version, [`USAGE_VERSION`].
    pub v: u32,
    /// Upstream HTTP status (0: no response headers arrived).
    pub status: u16,
    /// OpenAI `usage.prompt_tokens`; 0 when [`UsageSource::StreamedChunks`] (the caller knows
    /// its own count).
    pub prompt_tokens: u64,
    /// OpenAI `usage.completion_tokens`, or the content chunks streamed.
    pub completion_tokens: u64,
    /// OpenAI `usage.prompt_tokens_details.cached_tokens`.
    pub cached_tokens: u64,
    /// Microseconds from the start (the request) to the first content chunk (0: none).
    pub ttft_us: u64,
    /// Mean microseconds between content chunks after the first (OTel
    /// `gen_ai.server.time_per_output_token`; 0 with fewer than two chunks).
    pub tpot_us: u64,
    /// Microseconds from the start to the end.
    pub duration_us: u64,
    /// How it ended.
    pub end_reason: EndReason,
    /// Where the counts came from.
    pub usage_source: UsageSource,
    /// The request's OpenAI `stream` flag, as the caller that started the meter knew it
    /// ([`Meter::set_stream`]); absent (and not serialised) when it did not (the sidecar's ext_proc
    /// metering sees no request body).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<bool>,
}

impl Usage {
    /// Whether `prompt_tokens` came from the upstream; when not, the caller's own count applies
    /// if the response had started (a 2xx), else 0.
    pub fn prompt_tokens_known(&self) -> bool {
        self.usage_source == UsageSource::Upstream
    }

    /// Whether a 2xx response had started (the prompt was processed upstream).
    pub fn started(&self) -> bool {
        (200..300).contains(&self.status)
    }

    /// The usage of a request that ended before the meter saw anything (no response headers).
    pub fn unseen(duration_us: u64, status: u16) -> Self {
        Self {
            v: USAGE_VERSION,
            status,
            prompt_tokens: 0,
            completion_tokens: 0,
            cached_tokens: 0,
            ttft_us: 0,
            tpot_us: 0,
            duration_us,
            end_reason: EndReason::Incomplete,
            usage_source: UsageSource::StreamedChunks,
            stream: None,
        }
    }

    /// Whether the request must be charged its reservation instead of these counts: it ended
    /// before any response headers (`status` 0, incomplete) after it reached the upstream
    /// (`reached_upstream`, what the caller knows: Envoy sent the whole request upstream), and it
    /// was not a stream (`stream` false or unknown).
    ///
    /// The rule: vLLM builds a non-streaming response whole before its headers, so a client that
    /// leaves (or a stream reset) before them leaves GPU work done that nothing reports; the
    /// reservation is the most it can have cost. A stream's headers come before any generation
    /// (vLLM starts its streaming response, then runs the request, and aborts it when the client
    /// goes away), so a stream is charged what it streamed: nothing before its headers, and once
    /// they came the prompt (prefill may have run) plus the content chunks counted. A request
    /// that never reached the upstream did no GPU work and is charged nothing.
    pub fn charges_reservation(&self, reached_upstream: bool) -> bool {
        self.status == 0
            && self.end_reason == EndReason::Incomplete
            && reached_upstream
            && self.stream != Some(true)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
struct WireUsage {
    #[serde(default)]
    prompt_tokens: u64,
    #[serde(default)]
    completion_tokens: u64,
    #[serde(default)]
    prompt_tokens_details: Option<PromptDetails>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
struct PromptDetails {
    #[serde(default)]
    cached_tokens: Option<u64>,
}

/// One SSE chunk of a chat or completions stream, read without allocating (strings borrowed
/// unless escaped, choices folded into how many carry content).
#[derive(Deserialize)]
struct Chunk {
    #[serde(default)]
    choices: AnyContent,
    #[serde(default)]
    usage: Option<WireUsage>,
}

/// How many of a chunk's `choices` have content ([`Choice::has_content`]): vLLM streams each
/// choice of `n` > 1 in chunks of its own, but a chunk may carry several.
#[derive(Default)]
struct AnyContent(u64);

impl<'de> Deserialize<'de> for AnyContent {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Choices;
        impl<'de> Visitor<'de> for Choices {
            type Value = AnyContent;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an array of choices")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<AnyContent, A::Error> {
                let mut any = 0u64;
                while let Some(choice) = seq.next_element::<Choice<'de>>()? {
                    any = any.saturating_add(u64::from(choice.has_content()));
                }
                Ok(AnyContent(any))
            }
        }
        deserializer.deserialize_seq(Choices)
    }
}

#[derive(Deserialize)]
struct Choice<'a> {
    #[serde(default, borrow)]
    delta: Option<Delta<'a>>,
    #[serde(default, borrow)]
    text: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
struct Delta<'a> {
    #[serde(default, borrow)]
    content: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    reasoning_content: Option<Cow<'a, str>>,
}

#[derive(Debug)]
enum Body {
    /// Not known yet (no response headers).
    Unknown,
    /// `text/event-stream`.
    Sse(SseParser),
    /// Anything else: scanned for its top-level `usage` member, nothing else held.
    Json(UsageScanner<WireUsage>),
}

#[derive(Debug)]
struct Active {
    started: u64,
    status: u16,
    body: Body,
    usage: Option<WireUsage>,
    content_chunks: u64,
    first_content: Option<u64>,
    last_content: Option<u64>,
    /// Content arrived in a chunk given no time (after the first content): the last content's
    /// time is then the end of a completed stream, and unknown for an incomplete one.
    last_content_untimed: bool,
    saw_done: bool,
}

/// The metering state of one HTTP response. Feed it events in order; it returns the usage once.
#[derive(Debug)]
pub struct Meter {
    state: State,
    max_usage_bytes: usize,
    stream: Option<bool>,
}

#[derive(Debug)]
enum State {
    /// Not started: a local reply, or a request this meter is not asked about. Never metered.
    Unstarted,
    Active(Box<Active>),
    Done,
}

impl Meter {
    /// A meter that holds at most `max_usage_bytes` of a non-streaming response's `usage` member
    /// ([`MAX_USAGE_BYTES`] is plenty; the body itself is never held, whatever its size). It
    /// meters nothing until [`Meter::start`].
    pub fn new(max_usage_bytes: usize) -> Self {
        Self { state: State::Unstarted, max_usage_bytes, stream: None }
    }

    /// Records the request's OpenAI `stream` flag, carried into the [`Usage`] (it decides what an
    /// abort before the response headers is charged: [`Usage::charges_reservation`]).
    pub fn set_stream(&mut self, stream: bool) {
        self.stream = Some(stream);
    }

    /// The request went upstream at `now_us`: from now on the response is metered.
    pub fn start(&mut self, now_us: u64) {
        if matches!(self.state, State::Unstarted) {
            self.state = State::Active(Box::new(Active {
                started: now_us,
                status: 0,
                body: Body::Unknown,
                usage: None,
                content_chunks: 0,
                first_content: None,
                last_content: None,
                last_content_untimed: false,
                saw_done: false,
            }));
        }
    }

    /// Whether this response is metered (started and not finished).
    pub fn is_active(&self) -> bool {
        matches!(self.state, State::Active(_))
    }

    /// Whether the next body chunk needs its time (no content seen yet: it may be the first, which
    /// dates TTFT). The last chunk (`end_of_stream`) always needs it.
    pub fn needs_clock(&self) -> bool {
        matches!(&self.state, State::Active(a) if a.first_content.is_none())
    }

    /// Whether the next body chunk's bytes can change the usage. False once a JSON body's
    /// top-level object has closed (its `usage` read): a caller whose copy of a chunk costs (the
    /// wasm filter) then passes an empty chunk, still with `end_of_stream` on the last one.
    pub fn needs_body(&self) -> bool {
        match &self.state {
            State::Active(a) => match &a.body {
                Body::Json(scanner) => scanner.wants_more() || a.first_content.is_none(),
                Body::Sse(_) | Body::Unknown => true,
            },
            State::Unstarted | State::Done => false,
        }
    }

    /// Response headers arrived. Returns the usage when the response has no body.
    pub fn on_response_headers(
        &mut self,
        status: u16,
        content_type: &str,
        end_of_stream: bool,
        now_us: u64,
    ) -> Option<Usage> {
        if let State::Active(a) = &mut self.state {
            a.status = status;
            a.body = if content_type.trim_start().starts_with("text/event-stream") {
                Body::Sse(SseParser::new(MAX_SSE_EVENT_BYTES))
            } else {
                Body::Json(UsageScanner::new(self.max_usage_bytes))
            };
        }
        if end_of_stream {
            self.finish(EndReason::Completed, now_us)
        } else {
            None
        }
    }

    /// A response body chunk arrived at `now` (`None`: not timed, allowed while
    /// [`Meter::needs_clock`] is false and the chunk is not the last). Returns the usage on the
    /// last chunk.
    pub fn on_response_body(&mut self, chunk: &[u8], end_of_stream: bool, now: Option<u64>) -> Option<Usage> {
        let mut end = now;
        if let State::Active(a) = &mut self.state {
            let Active {
                started,
                body,
                usage,
                content_chunks,
                first_content,
                last_content,
                last_content_untimed,
                saw_done,
                ..
            } = a.as_mut();
            end = end.or(*last_content).or(Some(*started));
            match body {
                Body::Sse(parser) => parser.feed(chunk, |data| {
                    if data == b"[DONE]" {
                        *saw_done = true;
                        return;
                    }
                    let Ok(parsed) = serde_json::from_slice::<Chunk>(data) else {
                        return;
                    };
                    if parsed.usage.is_some() {
                        *usage = parsed.usage;
                    }
                    if parsed.choices.0 > 0 {
                        *content_chunks = content_chunks.saturating_add(parsed.choices.0);
                        match now {
                            Some(t) => {
                                first_content.get_or_insert(t);
                                *last_content = Some(t);
                                *last_content_untimed = false;
                            }
                            None => *last_content_untimed = true,
                        }
                    }
                }),
                Body::Json(scanner) => {
                    if let (false, Some(t)) = (chunk.is_empty(), now) {
                        first_content.get_or_insert(t);
                    }
                    scanner.feed(chunk);
                }
                Body::Unknown => {}
            }
        }
        if end_of_stream {
            self.finish(EndReason::Completed, end.unwrap_or(0))
        } else {
            None
        }
    }

    /// The stream ended (reset, abort, or the caller's end of the request). Returns the usage if
    /// the response had not already finished.
    pub fn on_stream_end(&mut self, now_us: u64) -> Option<Usage> {
        self.finish(EndReason::Incomplete, now_us)
    }

    fn finish(&mut self, end_reason: EndReason, now: u64) -> Option<Usage> {
        let State::Active(a) = std::mem::replace(&mut self.state, State::Done) else {
            return None;
        };
        let a = *a;
        // An SSE stream that ended cleanly but without `data: [DONE]` was truncated upstream.
        let end_reason = match (&a.body, end_reason) {
            (Body::Sse(_), EndReason::Completed) if !a.saw_done && (200..300).contains(&a.status) => {
                EndReason::Incomplete
            }
            (_, reason) => reason,
        };
        let usage = a.usage.or_else(|| match &a.body {
            Body::Json(scanner) => scanner.usage(),
            Body::Sse(_) | Body::Unknown => None,
        });
        let (prompt_tokens, completion_tokens, cached_tokens, usage_source) = match usage {
            Some(u) => (
                u.prompt_tokens,
                u.completion_tokens,
                u.prompt_tokens_details.and_then(|d| d.cached_tokens).unwrap_or(0),
                UsageSource::Upstream,
            ),
            None => (0, a.content_chunks, 0, UsageSource::StreamedChunks),
        };
        let last_content = match (a.last_content_untimed, end_reason) {
            (false, _) => a.last_content,
            (true, EndReason::Completed) => Some(now),
            (true, EndReason::Incomplete) => None,
        };
        let tpot_us = match (a.first_content, last_content) {
            (Some(first), Some(last)) if a.content_chunks > 1 => {
                last.saturating_sub(first) / (a.content_chunks - 1)
            }
            _ => 0,
        };
        Some(Usage {
            v: USAGE_VERSION,
            status: a.status,
            prompt_tokens,
            completion_tokens,
            cached_tokens,
            ttft_us: a.first_content.map_or(0, |t| t.saturating_sub(a.started)),
            tpot_us,
            duration_us: now.saturating_sub(a.started),
            end_reason,
            usage_source,
            stream: self.stream,
        })
    }
}

impl Choice<'_> {
    fn has_content(&self) -> bool {
        let nonempty = |s: &Option<Cow<'_, str>>| s.as_deref().is_some_and(|s| !s.is_empty());
        nonempty(&self.text)
            || self.delta.as_ref().is_some_and(|d| nonempty(&d.content) || nonempty(&d.reasoning_content))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1000;

    fn chunk(content: &str) -> String {
        format!(
            "data: {{\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{content}\"}},\"finish_reason\":null}}]}}\n\n"
        )
    }

    const ROLE: &str =
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n";
    const USAGE: &str = "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":17,\"completion_tokens\":3,\"total_tokens\":20,\"prompt_tokens_details\":{\"cached_tokens\":5}}}\n\n";

    fn stream(with_usage: bool) -> String {
        let mut s = String::from(ROLE);
        for w in ["a ", "b ", "c "] {
            s.push_str(&chunk(w));
        }
        if with_usage {
            s.push_str(USAGE);
        }
        s.push_str("data: [DONE]\n\n");
        s
    }

    #[test]
    fn usage_from_the_final_chunk_at_every_split() {
        let s = stream(true);
        for split in 0..=s.len() {
            let t0 = 1_000_000u64;
            let mut m = Meter::new(1024);
            m.start(t0);
            assert!(m.on_response_headers(200, "text/event-stream", false, t0).is_none());
            let (a, b) = s.as_bytes().split_at(split);
            assert!(m.on_response_body(a, false, Some(t0 + 5 * MS)).is_none());
            let r = m.on_response_body(b, true, Some(t0 + 9 * MS)).unwrap();
            assert_eq!((r.prompt_tokens, r.completion_tokens, r.cached_tokens), (17, 3, 5), "split {split}");
            assert_eq!(r.usage_source, UsageSource::Upstream);
            assert_eq!(r.end_reason, EndReason::Completed);
            assert_eq!(r.duration_us, 9000);
            assert!(m.on_stream_end(t0).is_none(), "recorded twice");
        }
    }

    #[test]
    fn abort_counts_streamed_chunks_once() {
        let t0 = 1_000_000u64;
        let mut m = Meter::new(1024);
        m.start(t0);
        m.on_response_headers(200, "text/event-stream; charset=utf-8", false, t0);
        m.on_response_body(ROLE.as_bytes(), false, Some(t0 + MS));
        m.on_response_body(chunk("x").as_bytes(), false, Some(t0 + 2 * MS));
        m.on_response_body(chunk("y").as_bytes(), false, Some(t0 + 3 * MS));
        let r = m.on_stream_end(t0 + 4 * MS).unwrap();
        assert_eq!((r.prompt_tokens, r.completion_tokens), (0, 2));
        assert!(!r.prompt_tokens_known() && r.started());
        assert_eq!(r.ttft_us, 2000, "the role chunk carries no content");
        assert_eq!((r.end_reason, r.usage_source), (EndReason::Incomplete, UsageSource::StreamedChunks));
        assert!(m.on_stream_end(t0).is_none());
        assert!(m.on_response_body(b"", true, Some(t0)).is_none());
    }

    #[test]
    fn non_streaming_json_usage() {
        let t0 = 1_000_000u64;
        let mut m = Meter::new(1024);
        m.start(t0);
        m.on_response_headers(200, "application/json", false, t0);
        let body = br#"{"id":"x","choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens":7,"completion_tokens":2,"total_tokens":9}}"#;
        let (a, b) = body.split_at(30);
        m.on_response_body(a, false, Some(t0));
        let r = m.on_response_body(b, true, Some(t0)).unwrap();
        assert_eq!((r.prompt_tokens, r.completion_tokens, r.usage_source), (7, 2, UsageSource::Upstream));
    }

    #[test]
    fn upstream_error_charges_nothing() {
        let t0 = 1_000_000u64;
        let mut m = Meter::new(1024);
        m.start(t0);
        m.on_response_headers(400, "application/json", false, t0);
        let r = m
            .on_response_body(
                br#"{"error":{"message":"too long","type":"BadRequestError","code":400}}"#,
                true,
                Some(t0),
            )
            .unwrap();
        assert_eq!((r.status, r.prompt_tokens + r.completion_tokens), (400, 0));
    }

    #[test]
    fn an_oversized_usage_member_falls_back_to_estimate() {
        let t0 = 1_000_000u64;
        let mut m = Meter::new(8);
        m.start(t0);
        m.on_response_headers(200, "application/json", false, t0);
        let r = m.on_response_body(b"{\"usage\":{\"prompt_tokens\":1}}", true, Some(t0)).unwrap();
        assert_eq!((r.prompt_tokens, r.usage_source), (0, UsageSource::StreamedChunks));
    }

    /// A chat.completion with vLLM-shaped `logprobs` (`top_logprobs` per token) of `tokens`
    /// tokens, and content that quotes a fake `usage`.
    fn logprobs_body(tokens: usize) -> String {
        let entry = r#"{"token":"the","logprob":-0.1,"bytes":[116,104,101],"top_logprobs":[{"token":"the","logprob":-0.1,"bytes":[116,104,101]},{"token":"}\"{","logprob":-4.0,"bytes":[125,34,123]}]}"#;
        let entries = vec![entry; tokens].join(",");
        format!(
            r#"{{"id":"chatcmpl-1","object":"chat.completion","choices":[{{"index":0,"message":{{"role":"assistant","content":"\"usage\":{{\"prompt_tokens\":1}}"}},"logprobs":{{"content":[{entries}]}},"finish_reason":"length"}}],"usage":{{"prompt_tokens":17,"total_tokens":{},"completion_tokens":{tokens},"prompt_tokens_details":{{"cached_tokens":16}}}}}}"#,
            17 + tokens
        )
    }

    #[test]
    fn a_json_body_of_any_size_is_metered_from_its_usage() {
        let body = logprobs_body(40_000);
        assert!(body.len() > 5 << 20, "{}", body.len());
        let t0 = 1_000_000u64;
        let mut m = Meter::new(MAX_USAGE_BYTES);
        m.set_stream(false);
        m.start(t0);
        m.on_response_headers(200, "application/json", false, t0);
        let chunks: Vec<&[u8]> = body.as_bytes().chunks(16 * 1024).collect();
        let (last, rest) = chunks.split_last().unwrap();
        for (i, c) in rest.iter().enumerate() {
            assert!(m.needs_body());
            assert!(m.on_response_body(c, false, (i == 0).then_some(t0 + 3 * MS)).is_none());
        }
        let r = m.on_response_body(last, true, Some(t0 + 9 * MS)).unwrap();
        assert_eq!(
            (r.prompt_tokens, r.completion_tokens, r.cached_tokens, r.usage_source),
            (17, 40_000, 16, UsageSource::Upstream)
        );
        assert_eq!((r.ttft_us, r.duration_us, r.stream), (3 * MS, 9 * MS, Some(false)));
    }

    #[test]
    fn json_usage_at_every_split_equals_serde_json() {
        let body = logprobs_body(3);
        let expected: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(expected["usage"]["completion_tokens"], 3);
        for split in 0..=body.len() {
            let t0 = 1_000_000u64;
            let mut m = Meter::new(MAX_USAGE_BYTES);
            m.start(t0);
            m.on_response_headers(200, "application/json", false, t0);
            let (a, b) = body.as_bytes().split_at(split);
            m.on_response_body(a, false, Some(t0));
            let r = m.on_response_body(b, true, Some(t0)).unwrap();
            assert_eq!((r.prompt_tokens, r.completion_tokens, r.cached_tokens), (17, 3, 16), "split {split}");
        }
    }

    #[test]
    fn a_closed_json_body_needs_no_more_bytes() {
        let t0 = 1_000_000u64;
        let mut m = Meter::new(MAX_USAGE_BYTES);
        m.start(t0);
        m.on_response_headers(200, "application/json", false, t0);
        m.on_response_body(br#"{"usage":{"prompt_tokens":2,"completion_tokens":1}}"#, false, Some(t0 + MS));
        assert!(!m.needs_body());
        let r = m.on_response_body(b"", true, Some(t0 + 2 * MS)).unwrap();
        assert_eq!((r.completion_tokens, r.duration_us), (1, 2 * MS));
        assert!(!m.needs_body(), "done");
        let mut sse = Meter::new(MAX_USAGE_BYTES);
        sse.start(t0);
        sse.on_response_headers(200, "text/event-stream", false, t0);
        assert!(sse.needs_body());
    }

    #[test]
    fn only_a_non_stream_that_reached_the_upstream_and_got_no_headers_charges_its_reservation() {
        let t0 = 1_000_000u64;
        let aborted = |stream: Option<bool>| {
            let mut m = Meter::new(MAX_USAGE_BYTES);
            if let Some(s) = stream {
                m.set_stream(s);
            }
            m.start(t0);
            m.on_stream_end(t0 + MS).unwrap()
        };
        assert!(aborted(Some(false)).charges_reservation(true));
        assert!(aborted(None).charges_reservation(true), "unknown: treated as not streaming");
        assert!(!aborted(Some(false)).charges_reservation(false), "never reached the upstream");
        assert!(!aborted(Some(true)).charges_reservation(true), "a stream is charged what it streamed");
        // Headers came (an error, or a 2xx cut short): the meter's counts apply.
        let mut m = Meter::new(MAX_USAGE_BYTES);
        m.set_stream(false);
        m.start(t0);
        m.on_response_headers(200, "application/json", false, t0);
        assert!(!m.on_stream_end(t0).unwrap().charges_reservation(true));
        let mut m = Meter::new(MAX_USAGE_BYTES);
        m.start(t0);
        assert!(!m.on_response_headers(503, "text/plain", true, t0).unwrap().charges_reservation(true));
    }

    #[test]
    fn a_stream_without_done_is_incomplete() {
        let t0 = 1_000_000u64;
        let mut m = Meter::new(1024);
        m.start(t0);
        m.on_response_headers(200, "text/event-stream", false, t0);
        let r = m.on_response_body(format!("{ROLE}{}", chunk("a")).as_bytes(), true, Some(t0)).unwrap();
        assert_eq!((r.end_reason, r.completion_tokens), (EndReason::Incomplete, 1));
    }

    #[test]
    fn local_replies_are_never_metered() {
        let t0 = 1_000_000u64;
        let mut m = Meter::new(1024);
        assert!(m.on_response_headers(429, "application/json", false, t0).is_none());
        assert!(m.on_response_body(b"{}", true, Some(t0)).is_none());
        assert!(m.on_stream_end(t0).is_none());
        assert!(!m.is_active());
    }

    #[test]
    fn bodyless_response_finishes_on_headers() {
        let t0 = 1_000_000u64;
        let mut m = Meter::new(1024);
        m.start(t0);
        let r = m.on_response_headers(204, "", true, t0).unwrap();
        assert_eq!((r.status, r.end_reason), (204, EndReason::Completed));
    }

    #[test]
    fn reset_before_response_headers_charges_nothing() {
        let t0 = 1_000_000u64;
        let mut m = Meter::new(1024);
        m.start(t0);
        let r = m.on_stream_end(t0).unwrap();
        assert_eq!(
            (r.status, r.prompt_tokens + r.completion_tokens, r.end_reason),
            (0, 0, EndReason::Incomplete)
        );
    }

    /// Issue 17, item 4: with `n` > 1 the content of every choice counts (vLLM sends each
    /// choice's deltas as chunks of their own, with its `index`), and the usage chunk's
    /// `completion_tokens`, already summed over the choices by vLLM, is taken as is.
    #[test]
    fn every_choice_of_n_counts() {
        let choice = |i: u32, content: &str| {
            format!("data: {{\"choices\":[{{\"index\":{i},\"delta\":{{\"content\":\"{content}\"}}}}]}}\n\n")
        };
        let mut s = String::new();
        for i in 0..3 {
            s.push_str(&format!("data: {{\"choices\":[{{\"index\":{i},\"delta\":{{\"role\":\"assistant\",\"content\":\"\"}}}}]}}\n\n"));
        }
        for w in ["a", "b"] {
            for i in 0..3 {
                s.push_str(&choice(i, w));
            }
        }
        // One chunk carrying two choices' content counts twice.
        s.push_str("data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"c\"}},{\"index\":1,\"text\":\"c\"}]}\n\n");
        let run = |body: &str| {
            let mut m = Meter::new(1024);
            m.start(0);
            assert!(m.on_response_headers(200, "text/event-stream", false, 0).is_none());
            m.on_response_body(body.as_bytes(), true, Some(MS)).unwrap()
        };
        let r = run(&format!("{s}data: [DONE]\n\n"));
        assert_eq!((r.completion_tokens, r.usage_source), (8, UsageSource::StreamedChunks));
        let usage = "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":4,\"completion_tokens\":30,\"total_tokens\":34}}\n\n";
        let r = run(&format!("{s}{usage}data: [DONE]\n\n"));
        assert_eq!((r.prompt_tokens, r.completion_tokens, r.usage_source), (4, 30, UsageSource::Upstream));
    }

    #[test]
    fn completions_text_chunks_are_counted() {
        let t0 = 1_000_000u64;
        let mut m = Meter::new(1024);
        m.start(t0);
        m.on_response_headers(200, "text/event-stream", false, t0);
        let s = "data: {\"object\":\"text_completion\",\"choices\":[{\"index\":0,\"text\":\"hi \"}]}\n\ndata: {\"choices\":[{\"index\":0,\"text\":\"yo \"}]}\n\n";
        m.on_response_body(s.as_bytes(), false, Some(t0));
        let r = m.on_stream_end(t0).unwrap();
        assert_eq!(r.completion_tokens, 2);
    }

    #[test]
    fn time_per_output_token_is_the_mean_gap_after_the_first() {
        let t0 = 1_000_000u64;
        let mut m = Meter::new(1024);
        m.start(t0);
        m.on_response_headers(200, "text/event-stream", false, t0);
        m.on_response_body(chunk("a").as_bytes(), false, Some(t0 + 20 * MS));
        m.on_response_body(chunk("b").as_bytes(), false, Some(t0 + 25 * MS));
        m.on_response_body(chunk("c").as_bytes(), false, Some(t0 + 36 * MS));
        let r = m.on_response_body(b"data: [DONE]\n\n", true, Some(t0 + 40 * MS)).unwrap();
        assert_eq!((r.ttft_us, r.tpot_us, r.duration_us), (20 * MS, 8 * MS, 40 * MS));
    }

    #[test]
    fn untimed_chunks_after_the_first_content_end_at_the_last_chunk() {
        let t0 = 1_000_000u64;
        let mut m = Meter::new(1024);
        m.start(t0);
        m.on_response_headers(200, "text/event-stream", false, t0);
        assert!(m.needs_clock(), "no content yet");
        m.on_response_body(ROLE.as_bytes(), false, Some(t0 + 5 * MS));
        assert!(m.needs_clock(), "the role chunk has no content");
        m.on_response_body(chunk("a").as_bytes(), false, Some(t0 + 20 * MS));
        assert!(!m.needs_clock());
        m.on_response_body(chunk("b").as_bytes(), false, None);
        m.on_response_body(chunk("c").as_bytes(), false, None);
        let r = m.on_response_body(b"data: [DONE]\n\n", true, Some(t0 + 40 * MS)).unwrap();
        assert_eq!(
            (r.ttft_us, r.tpot_us, r.duration_us, r.completion_tokens),
            (20 * MS, 10 * MS, 40 * MS, 3)
        );
        // Cut short: the last content's time is unknown, so no time per output token.
        let mut m = Meter::new(1024);
        m.start(t0);
        m.on_response_headers(200, "text/event-stream", false, t0);
        m.on_response_body(chunk("a").as_bytes(), false, Some(t0 + 20 * MS));
        m.on_response_body(chunk("b").as_bytes(), false, None);
        let r = m.on_stream_end(t0 + 900 * MS).unwrap();
        assert_eq!((r.ttft_us, r.tpot_us, r.completion_tokens), (20 * MS, 0, 2));
    }

    #[test]
    fn escaped_and_odd_chunks_are_read_as_before() {
        let t0 = 1_000_000u64;
        let mut m = Meter::new(1024);
        m.start(t0);
        m.on_response_headers(200, "text/event-stream", false, t0);
        let events = [
            r#"{"choices":[{"delta":{"content":"\u00e9\"q\""}}]}"#,
            r#"{"choices":[{"delta":{"content":""}},{"text":"x"}]}"#,
            r#"{"choices":null}"#,
            r#"{"choices":[{"delta":{"reasoning_content":"hm"},"logprobs":{"content":[{"token":"a"}]}}],"usage":null}"#,
            r#"{"choices":[{"delta":{"content":null}}]}"#,
        ];
        for e in events {
            m.on_response_body(format!("data: {e}\n\n").as_bytes(), false, Some(t0));
        }
        let r = m.on_stream_end(t0).unwrap();
        assert_eq!(r.completion_tokens, 3, "escaped, a second choice's text, reasoning; not null or empty");
    }

    #[test]
    fn the_wire_shape_round_trips_and_is_strict() {
        let u = Usage { completion_tokens: 3, ..Usage::unseen(9, 200) };
        let json = serde_json::to_string(&u).unwrap();
        assert_eq!(
            json,
            r#"{"v":1,"status":200,"prompt_tokens":0,"completion_tokens":3,"cached_tokens":0,"ttft_us":0,"tpot_us":0,"duration_us":9,"end_reason":"incomplete","usage_source":"streamed_chunks"}"#
        );
        assert_eq!(serde_json::from_str::<Usage>(&json).unwrap(), u);
        assert!(serde_json::from_str::<Usage>(&json.replace("\"v\"", "\"x\"")).is_err());
        // The request's stream flag, when known, rides along.
        let s = Usage { stream: Some(false), ..u };
        let json = serde_json::to_string(&s).unwrap();
        assert!(json.ends_with(r#""usage_source":"streamed_chunks","stream":false}"#), "{json}");
        assert_eq!(serde_json::from_str::<Usage>(&json).unwrap(), s);
        assert_eq!(serde_json::to_string(&UsageSource::Reservation).unwrap(), r#""reservation""#);
    }
}
