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
//! A chat or completions stream is split into events by memchr (no byte-at-a-time loop), and a
//! content chunk is only counted: walked once without allocating, from where the stream's common
//! prefix ends, by a reader that answers only when it knows serde_json's reading of it (no usage,
//! that many choices with content); the usage chunk and anything unusual are parsed in full, so
//! the meter's answer is the same.
//!
//! A response of the Responses API ([`Api::Responses`], `POST /v1/responses`) is read the same
//! way in its own shapes: a JSON body's top-level `usage` has `input_tokens`, `output_tokens` and
//! `input_tokens_details.cached_tokens`; a stream is typed events (`event:` / `data:`), its usage
//! the `response.usage` of the terminal `response.completed` (or `response.incomplete`,
//! `response.failed`) event, its content the `*.delta` events with a non-empty `delta`, one per
//! decoded step. Those events are never held: the stream is read by [`sse::SseStream`] and an
//! incremental reader of each event's JSON, so a terminal event that repeats a response of any
//! size is metered in bounded memory (see the `responses` module).
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

mod chunk;
pub mod json_usage;
mod responses;
pub mod sse;

use std::borrow::Cow;
use std::fmt;

use serde::de::{SeqAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize};

use crate::json_usage::UsageScanner;
use crate::responses::{EventReader, ResponsesUsage};
use crate::sse::{SseParser, SsePiece, SseStream};

pub use crate::chunk::ChunkUsage;
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
    /// ended without its protocol's end (truncated upstream): `data: [DONE]`, or for the
    /// Responses API a terminal event (`response.completed`, `.incomplete`, `.failed`).
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

/// Why a 2xx response's usage could not be read. The caller bills the request its reservation
/// instead (the sidecar's `UsageRecord::new`, `usage_source` reservation), never the prompt
/// estimate alone: the upstream did the work, and no number it reported can be trusted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UnreadUsage {
    /// The body is content-coded (`Content-Encoding` other than `identity`: gzip, deflate, br,
    /// zstd), which the meter does not decode ([`Meter::mark_encoded`]). The filter asks the
    /// upstream for `accept-encoding: identity`; an upstream that compresses all the same lands
    /// here.
    Encoded,
    /// The response completed without a usage: a JSON body whose `usage` is absent or `null`
    /// (a Responses API `background: true` answer), or a stream that ended as its protocol ends
    /// (`data: [DONE]`, a Responses terminal event) with none.
    Missing,
    /// The usage came twice: a usage after a chat or completions stream's final usage chunk (the
    /// one with no `choices`), a second Responses event with a usage, or a JSON body with two
    /// top-level `usage` members.
    Duplicate,
}

impl UnreadUsage {
    /// The `reason` label of the sidecar's counters (`encoded`, `missing`, `duplicate`).
    pub fn label(self) -> &'static str {
        match self {
            UnreadUsage::Encoded => "encoded",
            UnreadUsage::Missing => "missing",
            UnreadUsage::Duplicate => "duplicate",
        }
    }
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
    /// OpenAI `usage.prompt_tokens` (Responses API: `usage.input_tokens`); 0 when
    /// [`UsageSource::StreamedChunks`] (the caller knows its own count).
    pub prompt_tokens: u64,
    /// OpenAI `usage.completion_tokens` (Responses API: `usage.output_tokens`), or the content
    /// chunks (Responses API: content delta events) streamed.
    pub completion_tokens: u64,
    /// OpenAI `usage.prompt_tokens_details.cached_tokens` (Responses API:
    /// `usage.input_tokens_details.cached_tokens`).
    pub cached_tokens: u64,
    /// Microseconds from the start (the request) to the first content chunk or delta event
    /// (0: none).
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
    /// Set when a 2xx response's usage could not be read ([`UnreadUsage`]): the counts above are
    /// then the meter's fallback (content chunks), and the caller bills the reservation. Absent
    /// (and not serialised) otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unread: Option<UnreadUsage>,
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
            unread: None,
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

/// Which OpenAI API's response shapes a [`Meter`] reads ([`Meter::set_api`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Api {
    /// Chat Completions and (legacy) Completions, and anything else: `usage` with
    /// `prompt_tokens` / `completion_tokens`, streams of `data:` chunks with `choices` ending in
    /// `data: [DONE]`.
    #[default]
    ChatCompletions,
    /// The Responses API (`POST /v1/responses`): `usage` with `input_tokens` / `output_tokens`,
    /// streams of typed events ending in `response.completed` (or `.incomplete`, `.failed`).
    Responses,
}

/// The request path of the Responses API, [`Api::Responses`].
pub const RESPONSES_PATH: &str = "/v1/responses";

impl Api {
    /// The API of a request path (`:path`, query string and fragment ignored; exact,
    /// case-sensitive, as the filter classifies it).
    pub fn for_path(path: &str) -> Self {
        match path.split(['?', '#']).next() {
            Some(RESPONSES_PATH) => Api::Responses,
            _ => Api::ChatCompletions,
        }
    }
}

/// Token counts read from an upstream's usage object, whatever its API's names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Counts {
    prompt: u64,
    completion: u64,
    cached: u64,
}

impl From<WireUsage> for Counts {
    fn from(u: WireUsage) -> Self {
        Self {
            prompt: u.prompt_tokens,
            completion: u.completion_tokens,
            cached: u.prompt_tokens_details.and_then(|d| d.cached_tokens).unwrap_or(0),
        }
    }
}

impl From<ResponsesUsage> for Counts {
    fn from(u: ResponsesUsage) -> Self {
        Self {
            prompt: u.input_tokens,
            completion: u.output_tokens,
            cached: u.input_tokens_details.and_then(|d| d.cached_tokens).unwrap_or(0),
        }
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
/// unless escaped, choices folded into how many there are and how many carry content).
#[derive(Deserialize)]
struct Chunk {
    #[serde(default)]
    choices: AnyContent,
    #[serde(default)]
    usage: Option<WireUsage>,
}

/// How many of a chunk's `choices` have content ([`Choice::has_content`]; vLLM streams each
/// choice of `n` > 1 in chunks of its own, but a chunk may carry several), and how many choices
/// it has (the final usage chunk has none).
#[derive(Default)]
struct AnyContent {
    with_content: u64,
    choices: u64,
}

impl<'de> Deserialize<'de> for AnyContent {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Choices;
        impl<'de> Visitor<'de> for Choices {
            type Value = AnyContent;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an array of choices")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<AnyContent, A::Error> {
                let mut any = AnyContent::default();
                while let Some(choice) = seq.next_element::<Choice<'de>>()? {
                    any.with_content = any.with_content.saturating_add(u64::from(choice.has_content()));
                    any.choices = any.choices.saturating_add(1);
                }
                Ok(any)
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
    /// `text/event-stream` of chat or completions chunks, and the reader of their content.
    Sse(SseParser, chunk::ChunkReader),
    /// Anything else: scanned for its top-level `usage` member, nothing else held.
    Json(UsageScanner<WireUsage>),
    /// `text/event-stream` of Responses API events, read as they arrive (no event held).
    ResponsesSse(Box<ResponsesStream>),
    /// A Responses API JSON body, scanned for its top-level `usage`.
    ResponsesJson(UsageScanner<ResponsesUsage>),
}

/// The readers of a Responses API stream.
#[derive(Debug)]
struct ResponsesStream {
    sse: SseStream,
    event: EventReader,
}

#[derive(Debug)]
struct Active {
    started: u64,
    status: u16,
    body: Body,
    usage: Option<Counts>,
    content_chunks: u64,
    first_content: Option<u64>,
    last_content: Option<u64>,
    /// Content arrived in a chunk given no time (after the first content): the last content's
    /// time is then the end of a completed stream, and unknown for an incomplete one.
    last_content_untimed: bool,
    saw_done: bool,
    /// The events of a chat or completions stream read since [`Meter::take_event_usage`].
    events: EventsRead,
    /// A chat or completions stream's final usage chunk (a usage with no choices) was read, or a
    /// Responses event with a usage: any later usage is a second one.
    final_usage: bool,
    /// A second usage arrived ([`UnreadUsage::Duplicate`]).
    duplicate: bool,
    /// The body is content-coded ([`Meter::mark_encoded`]): not read.
    encoded: bool,
    /// A Responses stream ended with `response.failed`: an error, whose missing usage is not
    /// [`UnreadUsage::Missing`] (what streamed is counted).
    failed: bool,
}

/// What [`Meter::take_event_usage`] answers from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum EventsRead {
    None,
    /// One event: its data's length, and its usage member if the content walk read it.
    One(usize, Option<ChunkUsage>),
    Several,
}

/// The metering state of one HTTP response. Feed it events in order; it returns the usage once.
#[derive(Debug)]
pub struct Meter {
    state: State,
    max_usage_bytes: usize,
    stream: Option<bool>,
    api: Api,
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
        Self { state: State::Unstarted, max_usage_bytes, stream: None, api: Api::ChatCompletions }
    }

    /// Records which API the request used, so that its response is read in that API's shapes
    /// ([`Api::ChatCompletions`] unless set). Set it before the response headers.
    pub fn set_api(&mut self, api: Api) {
        self.api = api;
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
                events: EventsRead::None,
                final_usage: false,
                duplicate: false,
                encoded: false,
                failed: false,
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
                Body::ResponsesJson(scanner) => scanner.wants_more() || a.first_content.is_none(),
                Body::Sse(..) | Body::ResponsesSse(_) | Body::Unknown => true,
            },
            State::Unstarted | State::Done => false,
        }
    }

    /// The response's `Content-Encoding` (call with its value, when the response has one, before
    /// its body): any coding but `identity` (gzip, deflate, br, zstd, ...) makes the body
    /// unreadable to the meter, which then reads none of it and reports a 2xx response's usage as
    /// [`UnreadUsage::Encoded`].
    pub fn mark_encoded(&mut self, content_encoding: &[u8]) {
        let coded = content_encoding
            .split(|&b| b == b',')
            .map(<[u8]>::trim_ascii)
            .any(|c| !c.is_empty() && !c.eq_ignore_ascii_case(b"identity"));
        if let (true, State::Active(a)) = (coded, &mut self.state) {
            a.encoded = true;
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
            let sse = content_type.trim_start().starts_with("text/event-stream");
            a.body = match (self.api, sse) {
                // A coded body is not read at all (its bytes are not JSON or SSE).
                _ if a.encoded => Body::Unknown,
                (Api::ChatCompletions, true) => {
                    Body::Sse(SseParser::new(MAX_SSE_EVENT_BYTES), chunk::ChunkReader::default())
                }
                (Api::ChatCompletions, false) => Body::Json(UsageScanner::new(self.max_usage_bytes)),
                (Api::Responses, true) => Body::ResponsesSse(Box::new(ResponsesStream {
                    sse: SseStream::new(),
                    event: EventReader::new(self.max_usage_bytes),
                })),
                (Api::Responses, false) => Body::ResponsesJson(UsageScanner::new(self.max_usage_bytes)),
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
                events,
                final_usage,
                duplicate,
                failed,
                ..
            } = a.as_mut();
            end = end.or(*last_content).or(Some(*started));
            match body {
                Body::Sse(parser, reader) => parser.feed(chunk, |data| {
                    let walked = (data != b"[DONE]").then(|| reader.content_and_usage(data)).flatten();
                    *events = match events {
                        EventsRead::None => EventsRead::One(data.len(), walked.and_then(|(_, u)| u)),
                        EventsRead::One(..) | EventsRead::Several => EventsRead::Several,
                    };
                    if data == b"[DONE]" {
                        *saw_done = true;
                        return;
                    }
                    // A content chunk is only counted (`chunk::ChunkReader::content_and_usage`);
                    // the usage chunk, and anything unusual, is read in full.
                    let with_content = match walked {
                        Some((n, _)) => n,
                        None => {
                            let Ok(parsed) = serde_json::from_slice::<Chunk>(data) else {
                                return;
                            };
                            if let Some(u) = parsed.usage {
                                // Usage in content chunks (vLLM's `continuous_usage_stats`) is
                                // cumulative: the last one counts, up to the final usage chunk
                                // (no choices); any usage after that one is a second usage.
                                if *final_usage {
                                    *duplicate = true;
                                } else {
                                    *usage = Some(u.into());
                                    *final_usage = parsed.choices.choices == 0;
                                }
                            }
                            parsed.choices.with_content
                        }
                    };
                    if with_content > 0 {
                        *content_chunks = content_chunks.saturating_add(with_content);
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
                Body::ResponsesSse(reader) => {
                    let ResponsesStream { sse, event } = reader.as_mut();
                    sse.feed(chunk, |piece| match piece {
                        SsePiece::Data(data) => event.feed(data),
                        SsePiece::EventName(name) => event.set_name(name),
                        SsePiece::EventEnd { data: false } => event.reset(),
                        SsePiece::EventEnd { data: true } => {
                            let summary = event.finish();
                            *saw_done |= summary.end;
                            *failed |= summary.failed;
                            if let Some(u) = summary.usage {
                                if std::mem::replace(final_usage, true) {
                                    *duplicate = true;
                                } else {
                                    *usage = Some(u.into());
                                }
                            }
                            if summary.content {
                                *content_chunks = content_chunks.saturating_add(1);
                                match now {
                                    Some(t) => {
                                        first_content.get_or_insert(t);
                                        *last_content = Some(t);
                                        *last_content_untimed = false;
                                    }
                                    None => *last_content_untimed = true,
                                }
                            }
                        }
                    });
                }
                Body::Json(scanner) => {
                    if let (false, Some(t)) = (chunk.is_empty(), now) {
                        first_content.get_or_insert(t);
                    }
                    scanner.feed(chunk);
                }
                Body::ResponsesJson(scanner) => {
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

    /// The usage member of the one event of a chat or completions stream that the calls to
    /// [`Meter::on_response_body`] since the last call to this one dispatched: the length of the
    /// event's data and its [`ChunkUsage`], where the meter's content walk read it (a content
    /// chunk as serde_json reads it; `None` for any other event, for none or several, and for any
    /// other body). A caller that feeds the meter one whole event at a time (the wasm filter's
    /// usage stripper) strips that event from it without walking it again.
    pub fn take_event_usage(&mut self) -> Option<(usize, ChunkUsage)> {
        let State::Active(a) = &mut self.state else { return None };
        match std::mem::replace(&mut a.events, EventsRead::None) {
            EventsRead::One(len, Some(usage)) => Some((len, usage)),
            EventsRead::One(_, None) | EventsRead::None | EventsRead::Several => None,
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
        // An SSE stream that ended cleanly but without its protocol's end (`data: [DONE]`, or a
        // Responses terminal event) was truncated upstream.
        let end_reason = match (&a.body, end_reason) {
            (Body::Sse(..) | Body::ResponsesSse(_), EndReason::Completed)
                if !a.saw_done && (200..300).contains(&a.status) =>
            {
                EndReason::Incomplete
            }
            (_, reason) => reason,
        };
        let usage = a.usage.or_else(|| match &a.body {
            Body::Json(scanner) => scanner.usage().map(Counts::from),
            Body::ResponsesJson(scanner) => scanner.usage().map(Counts::from),
            Body::Sse(..) | Body::ResponsesSse(_) | Body::Unknown => None,
        });
        let duplicate = a.duplicate
            || match &a.body {
                Body::Json(scanner) => scanner.duplicate(),
                Body::ResponsesJson(scanner) => scanner.duplicate(),
                Body::Sse(..) | Body::ResponsesSse(_) | Body::Unknown => false,
            };
        // Only a 2xx response's usage is owed; an error's is nothing, whatever it says.
        let unread = if !(200..300).contains(&a.status) {
            None
        } else if a.encoded {
            Some(UnreadUsage::Encoded)
        } else if duplicate {
            Some(UnreadUsage::Duplicate)
        } else if usage.is_none() && end_reason == EndReason::Completed && !a.failed {
            Some(UnreadUsage::Missing)
        } else {
            None
        };
        let usage = usage.filter(|_| unread.is_none());
        let (prompt_tokens, completion_tokens, cached_tokens, usage_source) = match usage {
            Some(u) => (u.prompt, u.completion, u.cached, UsageSource::Upstream),
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
            unread,
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

    /// A Responses API stream as vLLM sends it: `event:` + `data:` per event, fields in vLLM's
    /// (pydantic) order with `type` last, deltas of `words`, then `response.completed` with the
    /// usage (when `usage` is set); no `[DONE]`.
    fn responses_stream(words: &[&str], usage: Option<(u64, u64, u64)>) -> String {
        let ev = |t: &str, json: String| format!("event: {t}\ndata: {json}\n\n");
        let head = r#"{"id":"resp_1","created_at":1,"incomplete_details":null,"instructions":"Be brief.","metadata":null,"model":"m","object":"response","output":[],"status":"in_progress","usage":null}"#;
        let mut s = ev(
            "response.created",
            format!(r#"{{"response":{head},"sequence_number":0,"type":"response.created"}}"#),
        );
        s.push_str(&ev(
            "response.in_progress",
            format!(r#"{{"response":{head},"sequence_number":1,"type":"response.in_progress"}}"#),
        ));
        s.push_str(&ev("response.output_item.added", r#"{"item":{"id":"msg_1","content":[],"role":"assistant","status":"in_progress","type":"message"},"output_index":0,"sequence_number":2,"type":"response.output_item.added"}"#.into()));
        s.push_str(&ev("response.content_part.added", r#"{"content_index":0,"item_id":"msg_1","output_index":0,"part":{"annotations":[],"text":"","type":"output_text","logprobs":[]},"sequence_number":3,"type":"response.content_part.added"}"#.into()));
        for (i, w) in words.iter().enumerate() {
            s.push_str(&ev("response.output_text.delta", format!(r#"{{"content_index":0,"delta":"{w}","item_id":"msg_1","logprobs":[],"output_index":0,"sequence_number":{},"type":"response.output_text.delta"}}"#, 4 + i)));
        }
        let text: String = words.concat();
        s.push_str(&ev("response.output_text.done", format!(r#"{{"content_index":0,"item_id":"msg_1","logprobs":[],"output_index":0,"sequence_number":90,"text":"{text}","type":"response.output_text.done"}}"#)));
        if let Some((input, output, cached)) = usage {
            s.push_str(&ev("response.completed", format!(r#"{{"response":{{"id":"resp_1","created_at":1,"incomplete_details":null,"instructions":"Be brief.","output":[{{"id":"msg_1","content":[{{"annotations":[],"text":"{text}","type":"output_text","logprobs":null}}],"role":"assistant","status":"completed","type":"message"}}],"status":"completed","usage":{{"input_tokens":{input},"input_tokens_details":{{"cached_tokens":{cached}}},"output_tokens":{output},"output_tokens_details":{{"reasoning_tokens":0}},"total_tokens":{}}},"user":null}},"sequence_number":99,"type":"response.completed"}}"#, input + output)));
        }
        s
    }

    fn responses_meter(t0: u64) -> Meter {
        let mut m = Meter::new(MAX_USAGE_BYTES);
        m.set_api(Api::Responses);
        m.set_stream(true);
        m.start(t0);
        assert!(m.on_response_headers(200, "text/event-stream; charset=utf-8", false, t0).is_none());
        m
    }

    #[test]
    fn responses_usage_from_the_completed_event_at_every_split() {
        let s = responses_stream(&["a ", "b ", "c "], Some((17, 3, 5)));
        for split in 0..=s.len() {
            let t0 = 1_000_000u64;
            let mut m = responses_meter(t0);
            let (a, b) = s.as_bytes().split_at(split);
            assert!(m.on_response_body(a, false, Some(t0 + 5 * MS)).is_none());
            let r = m.on_response_body(b, true, Some(t0 + 9 * MS)).unwrap();
            assert_eq!((r.prompt_tokens, r.completion_tokens, r.cached_tokens), (17, 3, 5), "split {split}");
            assert_eq!((r.usage_source, r.end_reason), (UsageSource::Upstream, EndReason::Completed));
            assert_eq!((r.duration_us, r.stream), (9 * MS, Some(true)));
            assert!(m.on_stream_end(t0).is_none(), "recorded twice");
        }
    }

    #[test]
    fn responses_ttft_is_the_first_delta_and_an_abort_counts_the_deltas() {
        let s = responses_stream(&["a ", "b ", "c "], Some((17, 3, 0)));
        let events: Vec<&str> = s.split_inclusive("\n\n").collect();
        let t0 = 1_000_000u64;
        let mut m = responses_meter(t0);
        // created, in_progress, output_item.added, content_part.added: no content.
        for (i, e) in events.iter().take(4).enumerate() {
            m.on_response_body(e.as_bytes(), false, Some(t0 + i as u64 * MS));
            assert!(m.needs_clock());
        }
        m.on_response_body(events[4].as_bytes(), false, Some(t0 + 20 * MS));
        assert!(!m.needs_clock());
        m.on_response_body(events[5].as_bytes(), false, None);
        let r = m.on_stream_end(t0 + 50 * MS).unwrap();
        assert_eq!((r.prompt_tokens, r.completion_tokens), (0, 2));
        assert_eq!((r.usage_source, r.end_reason), (UsageSource::StreamedChunks, EndReason::Incomplete));
        assert_eq!((r.ttft_us, r.tpot_us, r.duration_us), (20 * MS, 0, 50 * MS));
        assert!(!r.prompt_tokens_known() && r.started());
    }

    #[test]
    fn a_responses_stream_without_its_terminal_event_is_incomplete() {
        let s = responses_stream(&["a ", "b "], None);
        let t0 = 1_000_000u64;
        let mut m = responses_meter(t0);
        let r = m.on_response_body(s.as_bytes(), true, Some(t0 + MS)).unwrap();
        assert_eq!(
            (r.end_reason, r.usage_source, r.completion_tokens),
            (EndReason::Incomplete, UsageSource::StreamedChunks, 2)
        );
        // `[DONE]`, should a server send one, ends it too.
        let mut m = responses_meter(t0);
        let r = m.on_response_body(format!("{s}data: [DONE]\n\n").as_bytes(), true, Some(t0)).unwrap();
        assert_eq!((r.end_reason, r.completion_tokens), (EndReason::Completed, 2));
    }

    #[test]
    fn responses_incomplete_and_failed_ends() {
        let t0 = 1_000_000u64;
        let base = responses_stream(&["a ", "b "], None);
        // max_output_tokens reached: OpenAI's `response.incomplete`, with its usage.
        let incomplete = format!("{base}event: response.incomplete\ndata: {{\"type\":\"response.incomplete\",\"response\":{{\"status\":\"incomplete\",\"incomplete_details\":{{\"reason\":\"max_output_tokens\"}},\"usage\":{{\"input_tokens\":9,\"output_tokens\":2,\"total_tokens\":11}}}}}}\n\n");
        let r = responses_meter(t0).on_response_body(incomplete.as_bytes(), true, Some(t0)).unwrap();
        assert_eq!(
            (r.prompt_tokens, r.completion_tokens, r.cached_tokens, r.end_reason),
            (9, 2, 0, EndReason::Completed)
        );
        // Failed without a usage: ended as the protocol ends, counted from the deltas.
        let failed = format!("{base}event: response.failed\ndata: {{\"type\":\"response.failed\",\"response\":{{\"status\":\"failed\",\"error\":{{\"code\":\"server_error\"}},\"usage\":null}}}}\n\n");
        let r = responses_meter(t0).on_response_body(failed.as_bytes(), true, Some(t0)).unwrap();
        assert_eq!(
            (r.completion_tokens, r.usage_source, r.end_reason),
            (2, UsageSource::StreamedChunks, EndReason::Completed)
        );
    }

    #[test]
    fn a_non_streamed_response_is_metered_from_its_usage() {
        let t0 = 1_000_000u64;
        let body = br#"{"id":"resp_1","object":"response","output":[{"type":"message","content":[{"type":"output_text","text":"\"usage\":{\"input_tokens\":1}"}]}],"status":"completed","usage":{"input_tokens":12,"input_tokens_details":{"cached_tokens":3},"output_tokens":6,"output_tokens_details":{"reasoning_tokens":0},"total_tokens":18}}"#;
        for split in 0..=body.len() {
            let mut m = Meter::new(MAX_USAGE_BYTES);
            m.set_api(Api::Responses);
            m.set_stream(false);
            m.start(t0);
            m.on_response_headers(200, "application/json", false, t0);
            let (a, b) = body.split_at(split);
            m.on_response_body(a, false, Some(t0 + MS));
            let r = m.on_response_body(b, true, Some(t0 + 2 * MS)).unwrap();
            assert_eq!(
                (r.prompt_tokens, r.completion_tokens, r.cached_tokens, r.usage_source),
                (12, 6, 3, UsageSource::Upstream),
                "split {split}"
            );
        }
        // The same body read as a chat completion has no usage it knows.
        let mut m = Meter::new(MAX_USAGE_BYTES);
        m.start(t0);
        m.on_response_headers(200, "application/json", false, t0);
        let r = m.on_response_body(body, true, Some(t0)).unwrap();
        assert_eq!((r.prompt_tokens, r.completion_tokens, r.usage_source), (0, 0, UsageSource::Upstream));
    }

    #[test]
    fn a_chat_stream_is_not_read_as_responses_events_nor_the_reverse() {
        let t0 = 1_000_000u64;
        let mut m = responses_meter(t0);
        let r = m.on_response_body(stream(true).as_bytes(), true, Some(t0)).unwrap();
        assert_eq!(
            (r.completion_tokens, r.usage_source, r.end_reason),
            (0, UsageSource::StreamedChunks, EndReason::Completed)
        );
        let mut m = Meter::new(MAX_USAGE_BYTES);
        m.start(t0);
        m.on_response_headers(200, "text/event-stream", false, t0);
        let r =
            m.on_response_body(responses_stream(&["a"], Some((1, 1, 0))).as_bytes(), true, Some(t0)).unwrap();
        assert_eq!((r.completion_tokens, r.end_reason), (0, EndReason::Incomplete));
    }

    /// The usage of one response read whole: `body` as a 200 of `content_type`.
    fn read_whole(api: Api, content_type: &str, body: &str) -> Usage {
        let t0 = 1_000_000u64;
        let mut m = Meter::new(MAX_USAGE_BYTES);
        m.set_api(api);
        m.start(t0);
        m.on_response_headers(200, content_type, false, t0);
        m.on_response_body(body.as_bytes(), true, Some(t0 + MS)).unwrap()
    }

    /// A second usage in one response is read as no usage at all ([`UnreadUsage::Duplicate`]):
    /// the caller bills the reservation, whatever either number said.
    #[test]
    fn a_second_usage_is_a_duplicate() {
        let liar = "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":1000,\"completion_tokens\":1000}}\n\n";
        let again = "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":1}}\n\n";
        let s = format!("{ROLE}{}{liar}{again}data: [DONE]\n\n", chunk("a"));
        let r = read_whole(Api::ChatCompletions, "text/event-stream", &s);
        assert_eq!(r.unread, Some(UnreadUsage::Duplicate));
        assert_eq!(
            (r.prompt_tokens, r.completion_tokens, r.usage_source),
            (0, 1, UsageSource::StreamedChunks)
        );
        // Usage in every content chunk (vLLM's continuous_usage_stats) is cumulative: the final
        // usage chunk's counts, no duplicate.
        let with_usage = |c: &str, n: u64| {
            format!("data: {{\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{c}\"}}}}],\"usage\":{{\"prompt_tokens\":5,\"completion_tokens\":{n}}}}}\n\n")
        };
        let continuous = format!("{}{}{USAGE}data: [DONE]\n\n", with_usage("a", 1), with_usage("b", 2));
        let r = read_whole(Api::ChatCompletions, "text/event-stream", &continuous);
        assert_eq!((r.prompt_tokens, r.completion_tokens, r.unread), (17, 3, None));
        // A usage in a content chunk after the final one is a second usage too.
        let late = format!("{USAGE}{}data: [DONE]\n\n", with_usage("c", 9));
        assert_eq!(
            read_whole(Api::ChatCompletions, "text/event-stream", &late).unread,
            Some(UnreadUsage::Duplicate)
        );
        // A JSON body with two top-level usage members (serde_json refuses it).
        let json = r#"{"usage":{"prompt_tokens":1000,"completion_tokens":1000},"usage":{"prompt_tokens":1,"completion_tokens":1}}"#;
        let r = read_whole(Api::ChatCompletions, "application/json", json);
        assert_eq!((r.unread, r.usage_source), (Some(UnreadUsage::Duplicate), UsageSource::StreamedChunks));
        // Two Responses events with a usage.
        let once = responses_stream(&["a"], Some((12, 1, 0)));
        let twice = format!("{once}{}", responses_stream(&[], Some((1, 1, 0))));
        assert_eq!(read_whole(Api::Responses, "text/event-stream", &once).unread, None);
        assert_eq!(
            read_whole(Api::Responses, "text/event-stream", &twice).unread,
            Some(UnreadUsage::Duplicate)
        );
    }

    /// A 2xx that completed without a usage, or whose body is coded, is read as no usage
    /// ([`UnreadUsage::Missing`], [`UnreadUsage::Encoded`]); an error, a stream cut short and a
    /// failed Responses stream keep their counts.
    #[test]
    fn a_completed_response_without_a_readable_usage_is_unread() {
        let r = read_whole(
            Api::ChatCompletions,
            "application/json",
            r#"{"choices":[{"message":{"content":"hi"}}]}"#,
        );
        assert_eq!(r.unread, Some(UnreadUsage::Missing));
        let r = read_whole(Api::ChatCompletions, "text/event-stream", &stream(false));
        assert_eq!((r.unread, r.completion_tokens), (Some(UnreadUsage::Missing), 3));
        // A Responses background answer: `usage: null`.
        let background = r#"{"id":"resp_1","object":"response","status":"queued","background":true,"output":[],"usage":null}"#;
        assert_eq!(
            read_whole(Api::Responses, "application/json", background).unread,
            Some(UnreadUsage::Missing)
        );
        // Cut short (no [DONE]): incomplete, counted as before.
        let cut = format!("{ROLE}{}", chunk("a"));
        let r = read_whole(Api::ChatCompletions, "text/event-stream", &cut);
        assert_eq!((r.unread, r.end_reason, r.completion_tokens), (None, EndReason::Incomplete, 1));
        // An error status owes nothing, usage or not.
        let t0 = 1_000_000u64;
        let mut m = Meter::new(MAX_USAGE_BYTES);
        m.start(t0);
        m.on_response_headers(500, "application/json", false, t0);
        assert_eq!(m.on_response_body(b"{}", true, Some(t0)).unwrap().unread, None);
        // Coded: not read, whatever it holds.
        for (coding, unread) in [
            ("gzip", Some(UnreadUsage::Encoded)),
            ("br", Some(UnreadUsage::Encoded)),
            ("identity", None),
            (" Identity ", None),
        ] {
            let mut m = Meter::new(MAX_USAGE_BYTES);
            m.start(t0);
            m.mark_encoded(coding.as_bytes());
            m.on_response_headers(200, "application/json", false, t0);
            let r = m
                .on_response_body(br#"{"usage":{"prompt_tokens":4,"completion_tokens":1}}"#, true, Some(t0))
                .unwrap();
            assert_eq!(r.unread, unread, "{coding}");
            assert_eq!(r.prompt_tokens, if unread.is_some() { 0 } else { 4 }, "{coding}");
        }
        // The wire shape carries it, and leaves it out when unset.
        let json =
            serde_json::to_string(&Usage { unread: Some(UnreadUsage::Encoded), ..Usage::unseen(1, 200) })
                .unwrap();
        assert!(json.ends_with(r#""unread":"encoded"}"#), "{json}");
        assert!(!serde_json::to_string(&Usage::unseen(1, 200)).unwrap().contains("unread"));
    }

    #[test]
    fn api_of_a_path() {
        assert_eq!(Api::for_path("/v1/responses"), Api::Responses);
        assert_eq!(Api::for_path("/v1/responses?stream=true"), Api::Responses);
        assert_eq!(Api::for_path("/v1/responses/resp_1"), Api::ChatCompletions);
        assert_eq!(Api::for_path("/v1/chat/completions"), Api::ChatCompletions);
        assert_eq!(Api::for_path(""), Api::ChatCompletions);
        assert_eq!(Api::default(), Api::ChatCompletions);
    }
}
