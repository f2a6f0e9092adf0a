//! Per-request metering, with no I/O: a state machine fed the request headers, the response
//! headers and each response body chunk as Envoy's observability-mode ext_proc filter sends them,
//! that yields exactly one [`UsageRecord`] per admitted request, however the stream ends.
//!
//! Usage comes from the upstream's OpenAI `usage` object (the final SSE chunk, which the filter
//! makes vLLM send with `stream_options.include_usage`, or the JSON body of a non-streaming
//! response). When none arrives (client abort, upstream reset, truncated stream) the completion
//! tokens are counted from the streamed chunks, one per chunk with non-empty `delta.content`,
//! `delta.reasoning_content` or `text` (vLLM streams one chunk per decoded step), and the prompt
//! tokens are the filter's estimate when a 2xx response had started, else 0.

use std::time::Instant;

use serde::Deserialize;

use crate::sse::SseParser;

/// Largest single SSE event the meter holds while parsing, in bytes.
pub const MAX_SSE_EVENT_BYTES: usize = 1 << 20;

/// Most inter-token gaps held between two [`Meter::drain_gaps`] calls.
const MAX_PENDING_GAPS: usize = 256;

/// What the request headers told the meter (set by the wasm filter and the admission step).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestInfo {
    /// Envoy's `x-request-id`.
    pub request_id: String,
    /// `x-gateway-tenant`.
    pub tenant: String,
    /// `x-gateway-model` (public model name).
    pub model: String,
    /// `x-gateway-pool` (Envoy cluster of the vLLM pool).
    pub pool: String,
    /// `x-gateway-prompt-tokens`: the filter's prompt token count (exact or estimate).
    pub prompt_tokens_estimate: u64,
    /// Tokens reserved at admission against the tenant's TPM bucket (0 when it has none).
    pub reserved_tokens: u64,
    /// Whether the reservation was taken in the sidecar's memory (Redis was unavailable).
    pub reserved_locally: bool,
    /// `x-gateway-tier`.
    pub tier: String,
    /// Unique id of the usage record, made by the sidecar (the key that makes its write
    /// idempotent).
    pub record_id: String,
}

/// How the request ended, as the meter saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndReason {
    /// The last response body chunk (or a body-less response) arrived.
    Completed,
    /// The stream ended before the response did (abort, reset, timeout), or a 2xx SSE stream
    /// ended without `data: [DONE]` (truncated upstream).
    Incomplete,
}

/// Where the token counts came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UsageSource {
    /// The upstream's `usage` object.
    Upstream,
    /// Counted from streamed chunks (no `usage` arrived).
    StreamedChunks,
}

/// One finished request's usage (becomes a `llm_gateway.v1.UsageEvent`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UsageRecord {
    /// The request's identity and reservation.
    pub info: RequestInfo,
    /// OpenAI `usage.prompt_tokens`.
    pub prompt_tokens: u64,
    /// OpenAI `usage.completion_tokens`.
    pub completion_tokens: u64,
    /// OpenAI `usage.prompt_tokens_details.cached_tokens`.
    pub cached_tokens: u64,
    /// Microseconds from the request headers to the first content chunk (0: none).
    pub ttft_us: u64,
    /// Microseconds from the request headers to the end.
    pub duration_us: u64,
    /// Upstream HTTP status (0: no response headers arrived).
    pub status: u16,
    /// How it ended.
    pub end_reason: EndReason,
    /// Where the counts came from.
    pub usage_source: UsageSource,
    /// Unix time of the end, in milliseconds; stamped by the caller (the meter reads no clock
    /// but the monotonic instants it is given). 0 until then.
    pub finished_at_unix_ms: u64,
}

impl UsageRecord {
    /// Prompt plus completion tokens: what the tenant's TPM bucket is charged.
    pub fn total_tokens(&self) -> u64 {
        self.prompt_tokens + self.completion_tokens
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
struct Usage {
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

#[derive(Deserialize)]
struct Chunk {
    #[serde(default)]
    choices: Vec<Choice>,
    #[serde(default)]
    usage: Option<Usage>,
}

#[derive(Deserialize)]
struct Choice {
    #[serde(default)]
    delta: Option<Delta>,
    #[serde(default)]
    text: Option<String>,
}

#[derive(Deserialize)]
struct Delta {
    #[serde(default)]
    content: Option<String>,
    #[serde(default)]
    reasoning_content: Option<String>,
}

#[derive(Deserialize)]
struct JsonBody {
    #[serde(default)]
    usage: Option<Usage>,
}

#[derive(Debug)]
enum Body {
    /// Not known yet (no response headers).
    Unknown,
    /// `text/event-stream`.
    Sse(SseParser),
    /// Anything else, buffered up to the bound to read `usage` at the end.
    Json { buf: Vec<u8>, overflowed: bool },
}

#[derive(Debug)]
struct Active {
    info: RequestInfo,
    started: Instant,
    status: u16,
    body: Body,
    usage: Option<Usage>,
    content_chunks: u64,
    first_content: Option<Instant>,
    last_content: Option<Instant>,
    gaps: Vec<std::time::Duration>,
    saw_done: bool,
}

/// The metering state of one HTTP request. Feed it events in order; it returns the record once.
#[derive(Debug)]
pub struct Meter {
    state: State,
    max_json_body_bytes: usize,
}

#[derive(Debug)]
enum State {
    /// No request headers seen: a local reply (401, 429...) or not yet started. Never metered.
    Unadmitted,
    Active(Box<Active>),
    Done,
}

impl Meter {
    /// A meter that buffers at most `max_json_body_bytes` of a non-streaming response body.
    pub fn new(max_json_body_bytes: usize) -> Self {
        Self { state: State::Unadmitted, max_json_body_bytes }
    }

    /// The request headers arrived: the request was admitted and is now metered.
    pub fn on_request_headers(&mut self, info: RequestInfo, now: Instant) {
        if matches!(self.state, State::Unadmitted) {
            self.state = State::Active(Box::new(Active {
                info,
                started: now,
                status: 0,
                body: Body::Unknown,
                usage: None,
                content_chunks: 0,
                first_content: None,
                last_content: None,
                gaps: Vec::new(),
                saw_done: false,
            }));
        }
    }

    /// Takes the inter-token gaps (between consecutive content chunks) seen since the last call,
    /// for the ITL histogram.
    pub fn drain_gaps(&mut self) -> Vec<std::time::Duration> {
        match &mut self.state {
            State::Active(a) => std::mem::take(&mut a.gaps),
            _ => Vec::new(),
        }
    }

    /// Whether this stream is metered (request headers seen and not finished).
    pub fn is_active(&self) -> bool {
        matches!(self.state, State::Active(_))
    }

    /// Response headers arrived. Returns the record when the response has no body.
    pub fn on_response_headers(
        &mut self,
        status: u16,
        content_type: &str,
        end_of_stream: bool,
        now: Instant,
    ) -> Option<UsageRecord> {
        if let State::Active(a) = &mut self.state {
            a.status = status;
            a.body = if content_type.trim_start().starts_with("text/event-stream") {
                Body::Sse(SseParser::new(MAX_SSE_EVENT_BYTES))
            } else {
                Body::Json { buf: Vec::new(), overflowed: false }
            };
        }
        if end_of_stream {
            self.finish(EndReason::Completed, now)
        } else {
            None
        }
    }

    /// A response body chunk arrived. Returns the record on the last chunk.
    pub fn on_response_body(
        &mut self,
        chunk: &[u8],
        end_of_stream: bool,
        now: Instant,
    ) -> Option<UsageRecord> {
        let max_json = self.max_json_body_bytes;
        if let State::Active(a) = &mut self.state {
            let Active { body, usage, content_chunks, first_content, last_content, gaps, saw_done, .. } =
                a.as_mut();
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
                    if parsed.choices.iter().any(Choice::has_content) {
                        *content_chunks += 1;
                        first_content.get_or_insert(now);
                        if let Some(last) = last_content.replace(now) {
                            if gaps.len() < MAX_PENDING_GAPS {
                                gaps.push(now.saturating_duration_since(last));
                            }
                        }
                    }
                }),
                Body::Json { buf, overflowed } => {
                    if !chunk.is_empty() {
                        first_content.get_or_insert(now);
                    }
                    if buf.len() + chunk.len() > max_json {
                        *overflowed = true;
                        buf.clear();
                    } else if !*overflowed {
                        buf.extend_from_slice(chunk);
                    }
                }
                Body::Unknown => {}
            }
        }
        if end_of_stream {
            self.finish(EndReason::Completed, now)
        } else {
            None
        }
    }

    /// The stream ended (the gRPC stream closed or was reset). Returns the record if the
    /// response had not already finished.
    pub fn on_stream_end(&mut self, now: Instant) -> Option<UsageRecord> {
        self.finish(EndReason::Incomplete, now)
    }

    fn finish(&mut self, end_reason: EndReason, now: Instant) -> Option<UsageRecord> {
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
            Body::Json { buf, overflowed: false } if !buf.is_empty() => {
                serde_json::from_slice::<JsonBody>(buf).ok().and_then(|b| b.usage)
            }
            _ => None,
        });
        let micros = |t: Instant| {
            u64::try_from(t.saturating_duration_since(a.started).as_micros()).unwrap_or(u64::MAX)
        };
        let (prompt_tokens, completion_tokens, cached_tokens, usage_source) = match usage {
            Some(u) => (
                u.prompt_tokens,
                u.completion_tokens,
                u.prompt_tokens_details.and_then(|d| d.cached_tokens).unwrap_or(0),
                UsageSource::Upstream,
            ),
            None => {
                let started = (200..300).contains(&a.status);
                let prompt = if started { a.info.prompt_tokens_estimate } else { 0 };
                (prompt, a.content_chunks, 0, UsageSource::StreamedChunks)
            }
        };
        Some(UsageRecord {
            prompt_tokens,
            completion_tokens,
            cached_tokens,
            ttft_us: a.first_content.map(micros).unwrap_or(0),
            duration_us: micros(now),
            status: a.status,
            end_reason,
            usage_source,
            finished_at_unix_ms: 0,
            info: a.info,
        })
    }
}

impl Choice {
    fn has_content(&self) -> bool {
        let nonempty = |s: &Option<String>| s.as_deref().is_some_and(|s| !s.is_empty());
        nonempty(&self.text)
            || self.delta.as_ref().is_some_and(|d| nonempty(&d.content) || nonempty(&d.reasoning_content))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn info() -> RequestInfo {
        RequestInfo {
            request_id: "r1".into(),
            tenant: "acme".into(),
            model: "m".into(),
            pool: "pool_a".into(),
            prompt_tokens_estimate: 42,
            reserved_tokens: 100,
            reserved_locally: false,
            tier: "standard".into(),
            record_id: "rec-1".into(),
        }
    }

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
            let t0 = Instant::now();
            let mut m = Meter::new(1024);
            m.on_request_headers(info(), t0);
            assert!(m.on_response_headers(200, "text/event-stream", false, t0).is_none());
            let (a, b) = s.as_bytes().split_at(split);
            assert!(m.on_response_body(a, false, t0 + Duration::from_millis(5)).is_none());
            let r = m.on_response_body(b, true, t0 + Duration::from_millis(9)).unwrap();
            assert_eq!((r.prompt_tokens, r.completion_tokens, r.cached_tokens), (17, 3, 5), "split {split}");
            assert_eq!(r.usage_source, UsageSource::Upstream);
            assert_eq!(r.end_reason, EndReason::Completed);
            assert_eq!(r.duration_us, 9000);
            assert!(m.on_stream_end(t0).is_none(), "recorded twice");
        }
    }

    #[test]
    fn abort_counts_streamed_chunks_once() {
        let t0 = Instant::now();
        let mut m = Meter::new(1024);
        m.on_request_headers(info(), t0);
        m.on_response_headers(200, "text/event-stream; charset=utf-8", false, t0);
        m.on_response_body(ROLE.as_bytes(), false, t0 + Duration::from_millis(1));
        m.on_response_body(chunk("x").as_bytes(), false, t0 + Duration::from_millis(2));
        m.on_response_body(chunk("y").as_bytes(), false, t0 + Duration::from_millis(3));
        let r = m.on_stream_end(t0 + Duration::from_millis(4)).unwrap();
        assert_eq!((r.prompt_tokens, r.completion_tokens), (42, 2));
        assert_eq!(r.ttft_us, 2000, "the role chunk carries no content");
        assert!(m.drain_gaps().is_empty(), "finished: nothing pending");
        assert_eq!((r.end_reason, r.usage_source), (EndReason::Incomplete, UsageSource::StreamedChunks));
        assert!(m.on_stream_end(t0).is_none());
        assert!(m.on_response_body(b"", true, t0).is_none());
    }

    #[test]
    fn inter_token_gaps_are_drained() {
        let t0 = Instant::now();
        let mut m = Meter::new(1024);
        m.on_request_headers(info(), t0);
        m.on_response_headers(200, "text/event-stream", false, t0);
        m.on_response_body(chunk("a").as_bytes(), false, t0 + Duration::from_millis(10));
        assert!(m.drain_gaps().is_empty());
        m.on_response_body(
            format!("{}{}", chunk("b"), chunk("c")).as_bytes(),
            false,
            t0 + Duration::from_millis(25),
        );
        assert_eq!(m.drain_gaps(), vec![Duration::from_millis(15), Duration::ZERO]);
        assert!(m.drain_gaps().is_empty());
    }

    #[test]
    fn non_streaming_json_usage() {
        let t0 = Instant::now();
        let mut m = Meter::new(1024);
        m.on_request_headers(info(), t0);
        m.on_response_headers(200, "application/json", false, t0);
        let body = br#"{"id":"x","choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens":7,"completion_tokens":2,"total_tokens":9}}"#;
        let (a, b) = body.split_at(30);
        m.on_response_body(a, false, t0);
        let r = m.on_response_body(b, true, t0).unwrap();
        assert_eq!((r.prompt_tokens, r.completion_tokens, r.usage_source), (7, 2, UsageSource::Upstream));
    }

    #[test]
    fn upstream_error_charges_nothing() {
        let t0 = Instant::now();
        let mut m = Meter::new(1024);
        m.on_request_headers(info(), t0);
        m.on_response_headers(400, "application/json", false, t0);
        let r = m
            .on_response_body(
                br#"{"error":{"message":"too long","type":"BadRequestError","code":400}}"#,
                true,
                t0,
            )
            .unwrap();
        assert_eq!((r.status, r.total_tokens()), (400, 0));
    }

    #[test]
    fn oversized_json_body_falls_back_to_estimate() {
        let t0 = Instant::now();
        let mut m = Meter::new(8);
        m.on_request_headers(info(), t0);
        m.on_response_headers(200, "application/json", false, t0);
        let r = m.on_response_body(b"{\"usage\":{\"prompt_tokens\":1}}", true, t0).unwrap();
        assert_eq!((r.prompt_tokens, r.usage_source), (42, UsageSource::StreamedChunks));
    }

    #[test]
    fn a_stream_without_done_is_incomplete() {
        let t0 = Instant::now();
        let mut m = Meter::new(1024);
        m.on_request_headers(info(), t0);
        m.on_response_headers(200, "text/event-stream", false, t0);
        let r = m.on_response_body(format!("{ROLE}{}", chunk("a")).as_bytes(), true, t0).unwrap();
        assert_eq!((r.end_reason, r.completion_tokens), (EndReason::Incomplete, 1));
    }

    #[test]
    fn local_replies_are_never_metered() {
        let t0 = Instant::now();
        let mut m = Meter::new(1024);
        assert!(m.on_response_headers(429, "application/json", false, t0).is_none());
        assert!(m.on_response_body(b"{}", true, t0).is_none());
        assert!(m.on_stream_end(t0).is_none());
        assert!(!m.is_active());
    }

    #[test]
    fn bodyless_response_finishes_on_headers() {
        let t0 = Instant::now();
        let mut m = Meter::new(1024);
        m.on_request_headers(info(), t0);
        let r = m.on_response_headers(204, "", true, t0).unwrap();
        assert_eq!((r.status, r.end_reason), (204, EndReason::Completed));
    }

    #[test]
    fn reset_before_response_headers_charges_nothing() {
        let t0 = Instant::now();
        let mut m = Meter::new(1024);
        m.on_request_headers(info(), t0);
        let r = m.on_stream_end(t0).unwrap();
        assert_eq!((r.status, r.total_tokens(), r.end_reason), (0, 0, EndReason::Incomplete));
    }

    #[test]
    fn completions_text_chunks_are_counted() {
        let t0 = Instant::now();
        let mut m = Meter::new(1024);
        m.on_request_headers(info(), t0);
        m.on_response_headers(200, "text/event-stream", false, t0);
        let s = "data: {\"object\":\"text_completion\",\"choices\":[{\"index\":0,\"text\":\"hi \"}]}\n\ndata: {\"choices\":[{\"index\":0,\"text\":\"yo \"}]}\n\n";
        m.on_response_body(s.as_bytes(), false, t0);
        let r = m.on_stream_end(t0).unwrap();
        assert_eq!(r.completion_tokens, 2);
    }
}
