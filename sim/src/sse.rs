//! Server-sent events as vLLM streams them: `data: {json}\n\n` per chunk, then
//! `data: [DONE]\n\n`.
//!
//! Chat streams (`chat.completion.chunk`): a role chunk
//! (`"delta":{"role":"assistant","content":""}`), one chunk per output token
//! (`"delta":{"content":"<word>"}`), the last one carrying `finish_reason` (and
//! `"stop_reason":null`), then, with `stream_options.include_usage`, a chunk with
//! `"choices":[]` and `usage`, and `[DONE]`. With `include_usage` every other chunk has
//! `"usage":null`, as vLLM sets it. Completions streams (`text_completion`) have no role chunk
//! and put the token in `choices[0].text`.
//!
//! With `n` > 1 choices (vLLM's order): a role chunk per choice (`index` 0..n), then for each
//! token position one chunk per choice, each carrying its own `index` (the last one of each
//! choice its `finish_reason`); the usage chunk's `completion_tokens` is summed over the choices.
//!
//! All fixed parts of one stream are serialised once per request into a single buffer;
//! a token event is three shared slices (prefix, word, suffix), so emitting a token of choice 0
//! allocates nothing (the prefix of another choice is built per chunk).

use bytes::buf::Chain;
use bytes::{Buf, BufMut, Bytes, BytesMut};

use crate::request::Endpoint;
use crate::response::{ResponseMeta, WORDS};
use crate::tokens::OutputPlan;

/// One SSE event on the wire: up to three byte slices written back to back
/// (hyper sends them with vectored writes).
pub type EventBuf = Chain<Chain<Bytes, Bytes>, Bytes>;

/// The terminating event.
pub const DONE: &[u8] = b"data: [DONE]\n\n";

/// An event made of one slice.
pub fn whole(bytes: Bytes) -> EventBuf {
    bytes.chain(Bytes::new()).chain(Bytes::new())
}

/// What an event is, for pacing and accounting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventKind {
    /// Chat only: the first chunk, `delta.role`; sent together with the first token.
    Role,
    /// The output token `index` (0-based): one content chunk.
    Token {
        /// 0-based token position.
        index: u64,
    },
    /// The `include_usage` chunk: `"choices":[]` and `usage`.
    Usage,
    /// `data: [DONE]`; for the Responses API, `response.completed`: the last event.
    Done,
    /// Responses API: an event sent as soon as the request generates (`response.created`,
    /// `response.in_progress`), before any token.
    Prelude,
    /// Responses API: an event after the last token and before `response.completed`
    /// (`response.output_text.done`, ...), sent at once.
    Trailer,
}

/// The events of one stream: chat or completions chunks, or Responses API events.
#[derive(Debug)]
pub enum Events {
    /// `chat.completion.chunk` / `text_completion` chunks and `[DONE]`.
    Chunks(SseEvents),
    /// Responses API events ([`crate::responses::ResponseEvents`]).
    Responses(crate::responses::ResponseEvents),
}

impl Iterator for Events {
    type Item = SseEvent;

    fn next(&mut self) -> Option<SseEvent> {
        match self {
            Events::Chunks(events) => events.next(),
            Events::Responses(events) => events.next(),
        }
    }
}

/// One event: its kind and its bytes.
#[derive(Debug)]
pub struct SseEvent {
    /// What the event is.
    pub kind: EventKind,
    /// The `data: ...\n\n` bytes.
    pub buf: EventBuf,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    /// The role chunk of a choice.
    Role(u64),
    /// The token at a position, of a choice.
    Token(u64, u64),
    Usage,
    Done,
    End,
}

/// The events of one stream, in order; see the module docs for the sequence.
#[derive(Debug)]
pub struct SseEvents {
    role: Bytes,
    token_prefix: Bytes,
    token_suffix: Bytes,
    last_suffix: Bytes,
    usage: Option<Bytes>,
    /// `data: {...,"choices":[`, for the chunks of choices other than 0.
    head: Bytes,
    /// The role chunk after `{"index":0,` (chat).
    role_rest: Bytes,
    /// The token prefix after `{"index":0,`.
    token_rest: Bytes,
    tokens: u64,
    choices: u64,
    step: Step,
}

impl SseEvents {
    /// Serialises the fixed parts of the stream for `meta` and `plan`
    /// (`plan.completion_tokens` content chunks, at least 1, for each of `plan.choices`).
    pub fn new(meta: &ResponseMeta<'_>, plan: &OutputPlan, include_usage: bool) -> Self {
        let usage_null: &[u8] = if include_usage { b",\"usage\":null" } else { b"" };
        let mut buf = BytesMut::with_capacity(4 * (meta.id.len() + meta.model.len() + 128) + 256);
        let head = |buf: &mut BytesMut| {
            buf.put_slice(b"data: {\"id\":\"");
            buf.put_slice(meta.id.as_bytes());
            buf.put_slice(match meta.endpoint {
                Endpoint::Chat | Endpoint::Responses => {
                    b"\",\"object\":\"chat.completion.chunk\",\"created\":"
                }
                Endpoint::Completions => b"\",\"object\":\"text_completion\",\"created\":",
            });
            buf.put_slice(meta.created.to_string().as_bytes());
            buf.put_slice(b",\"model\":");
            put_json_str(buf, meta.model);
            buf.put_slice(b",\"choices\":[");
        };
        let tail = |buf: &mut BytesMut, choice_end: &[u8]| {
            buf.put_slice(choice_end);
            buf.put_slice(usage_null);
            buf.put_slice(b"}\n\n");
        };
        let finish = plan.finish_reason.as_str().as_bytes();
        head(&mut buf);
        let head_bytes = buf.split().freeze();
        tail(
            &mut buf,
            b"\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"logprobs\":null,\"finish_reason\":null}]",
        );
        let role_rest = buf.split().freeze();
        let token_rest = Bytes::from_static(match meta.endpoint {
            Endpoint::Chat | Endpoint::Responses => b"\"delta\":{\"content\":\"",
            Endpoint::Completions => b"\"text\":\"",
        });

        let role = match meta.endpoint {
            Endpoint::Chat | Endpoint::Responses => {
                head(&mut buf);
                tail(
                    &mut buf,
                    b"{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"logprobs\":null,\"finish_reason\":null}]",
                );
                buf.split().freeze()
            }
            Endpoint::Completions => Bytes::new(),
        };
        head(&mut buf);
        buf.put_slice(match meta.endpoint {
            Endpoint::Chat | Endpoint::Responses => b"{\"index\":0,\"delta\":{\"content\":\"",
            Endpoint::Completions => b"{\"index\":0,\"text\":\"",
        });
        let token_prefix = buf.split().freeze();
        let (mid_end, last_start): (&[u8], &[u8]) = match meta.endpoint {
            Endpoint::Chat | Endpoint::Responses => (
                b"\"},\"logprobs\":null,\"finish_reason\":null}]",
                b"\"},\"logprobs\":null,\"finish_reason\":\"",
            ),
            Endpoint::Completions => (
                b"\",\"logprobs\":null,\"finish_reason\":null,\"stop_reason\":null}]",
                b"\",\"logprobs\":null,\"finish_reason\":\"",
            ),
        };
        tail(&mut buf, mid_end);
        let token_suffix = buf.split().freeze();
        buf.put_slice(last_start);
        buf.put_slice(finish);
        tail(&mut buf, b"\",\"stop_reason\":null}]");
        let last_suffix = buf.split().freeze();
        let usage = include_usage.then(|| {
            head(&mut buf);
            let completion = plan.total_completion_tokens();
            let total = plan.prompt_tokens.saturating_add(completion);
            let usage = format!(
                "],\"usage\":{{\"prompt_tokens\":{},\"completion_tokens\":{completion},\"total_tokens\":{total}}}}}\n\n",
                plan.prompt_tokens
            );
            buf.put_slice(usage.as_bytes());
            buf.split().freeze()
        });
        Self {
            role,
            token_prefix,
            token_suffix,
            last_suffix,
            usage,
            head: head_bytes,
            role_rest,
            token_rest,
            tokens: plan.completion_tokens,
            choices: plan.choices.max(1),
            step: match meta.endpoint {
                Endpoint::Chat | Endpoint::Responses => Step::Role(0),
                Endpoint::Completions => Step::Token(0, 0),
            },
        }
    }

    /// `head` `{"index":<choice>,` `rest`: the start of a chunk of choice `choice` > 0.
    fn choice_prefix(&self, choice: u64, rest: &Bytes) -> Bytes {
        let index = choice.to_string();
        let mut buf = BytesMut::with_capacity(self.head.len() + index.len() + rest.len() + 10);
        buf.put_slice(&self.head);
        buf.put_slice(b"{\"index\":");
        buf.put_slice(index.as_bytes());
        buf.put_u8(b',');
        buf.put_slice(rest);
        buf.freeze()
    }
}

impl Iterator for SseEvents {
    type Item = SseEvent;

    fn next(&mut self) -> Option<SseEvent> {
        let (kind, buf, next) = match self.step {
            Step::Role(choice) => {
                let buf =
                    if choice == 0 { self.role.clone() } else { self.choice_prefix(choice, &self.role_rest) };
                let next = if choice.saturating_add(1) < self.choices {
                    Step::Role(choice + 1)
                } else {
                    Step::Token(0, 0)
                };
                (EventKind::Role, whole(buf), next)
            }
            Step::Token(index, choice) => {
                let word = WORDS.get((index % WORDS.len() as u64) as usize).copied().unwrap_or_default();
                let last = index.saturating_add(1) >= self.tokens;
                let suffix = if last { &self.last_suffix } else { &self.token_suffix };
                let prefix = if choice == 0 {
                    self.token_prefix.clone()
                } else {
                    self.choice_prefix(choice, &self.token_rest)
                };
                let buf = prefix.chain(Bytes::from_static(word.as_bytes())).chain(suffix.clone());
                let next = match (choice.saturating_add(1) < self.choices, last, self.usage.is_some()) {
                    (true, _, _) => Step::Token(index, choice + 1),
                    (false, false, _) => Step::Token(index + 1, 0),
                    (false, true, true) => Step::Usage,
                    (false, true, false) => Step::Done,
                };
                (EventKind::Token { index }, buf, next)
            }
            Step::Usage => {
                let usage = self.usage.clone().unwrap_or_default();
                (EventKind::Usage, whole(usage), Step::Done)
            }
            Step::Done => (EventKind::Done, whole(Bytes::from_static(DONE)), Step::End),
            Step::End => return None,
        };
        self.step = next;
        Some(SseEvent { kind, buf })
    }
}

/// Appends `s` as a JSON string literal, quotes included.
fn put_json_str(buf: &mut BytesMut, s: &str) {
    buf.put_u8(b'"');
    for c in s.chars() {
        match c {
            '"' => buf.put_slice(b"\\\""),
            '\\' => buf.put_slice(b"\\\\"),
            c if u32::from(c) < 0x20 => buf.put_slice(format!("\\u{:04x}", u32::from(c)).as_bytes()),
            c => buf.put_slice(c.encode_utf8(&mut [0u8; 4]).as_bytes()),
        }
    }
    buf.put_u8(b'"');
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokens::FinishReason;
    use serde_json::Value;

    fn meta(endpoint: Endpoint) -> ResponseMeta<'static> {
        ResponseMeta {
            endpoint,
            id: "chatcmpl-abc".to_owned(),
            created: 17,
            model: "sim \"model\"",
            instructions: None,
            max_output_tokens: None,
        }
    }

    fn plan(n: u64, finish_reason: FinishReason) -> OutputPlan {
        OutputPlan { prompt_tokens: 10, completion_tokens: n, finish_reason, choices: 1 }
    }

    /// The events as (kind, wire text).
    fn collect(endpoint: Endpoint, n: u64, reason: FinishReason, usage: bool) -> Vec<(EventKind, String)> {
        SseEvents::new(&meta(endpoint), &plan(n, reason), usage)
            .map(|mut e| {
                let bytes = e.buf.copy_to_bytes(e.buf.remaining());
                (e.kind, String::from_utf8(bytes.to_vec()).unwrap())
            })
            .collect()
    }

    fn json(event: &str) -> Value {
        let body = event.strip_prefix("data: ").unwrap().strip_suffix("\n\n").unwrap();
        serde_json::from_str(body).unwrap()
    }

    #[test]
    fn chat_stream_sequence_without_usage() {
        let events = collect(Endpoint::Chat, 3, FinishReason::Length, false);
        let kinds: Vec<_> = events.iter().map(|e| e.0).collect();
        assert_eq!(
            kinds,
            [
                EventKind::Role,
                EventKind::Token { index: 0 },
                EventKind::Token { index: 1 },
                EventKind::Token { index: 2 },
                EventKind::Done
            ]
        );
        for (_, text) in &events {
            assert!(text.starts_with("data: ") && text.ends_with("\n\n"), "{text:?}");
        }
        let role = json(&events[0].1);
        assert_eq!(
            role,
            serde_json::json!({"id": "chatcmpl-abc", "object": "chat.completion.chunk", "created": 17,
                "model": "sim \"model\"", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                "logprobs": null, "finish_reason": null}]})
        );
        let first = json(&events[1].1);
        assert_eq!(first["choices"][0]["delta"], serde_json::json!({"content": "the "}));
        assert_eq!(first["choices"][0]["finish_reason"], Value::Null);
        assert!(first.get("usage").is_none());
        let last = json(&events[3].1);
        assert_eq!(last["choices"][0]["delta"]["content"], "brown ");
        assert_eq!(last["choices"][0]["finish_reason"], "length");
        assert_eq!(events[4].1, "data: [DONE]\n\n");
    }

    #[test]
    fn chat_stream_with_usage_ends_with_usage_then_done() {
        let events = collect(Endpoint::Chat, 2, FinishReason::Stop, true);
        assert_eq!(events.len(), 1 + 2 + 1 + 1);
        for (_, text) in &events[..3] {
            assert_eq!(json(text)["usage"], Value::Null, "{text}");
            assert!(json(text).get("usage").is_some());
        }
        assert_eq!(json(&events[2].1)["choices"][0]["finish_reason"], "stop");
        let usage = json(&events[3].1);
        assert_eq!(events[3].0, EventKind::Usage);
        assert_eq!(usage["choices"], serde_json::json!([]));
        assert_eq!(
            usage["usage"],
            serde_json::json!({"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12})
        );
        assert_eq!(usage["object"], "chat.completion.chunk");
        assert_eq!(events[4], (EventKind::Done, "data: [DONE]\n\n".to_owned()));
    }

    #[test]
    fn completions_stream_has_no_role_chunk() {
        let events = collect(Endpoint::Completions, 2, FinishReason::Length, false);
        let kinds: Vec<_> = events.iter().map(|e| e.0).collect();
        assert_eq!(kinds, [EventKind::Token { index: 0 }, EventKind::Token { index: 1 }, EventKind::Done]);
        let first = json(&events[0].1);
        assert_eq!(first["object"], "text_completion");
        assert_eq!(first["choices"][0]["text"], "the ");
        assert_eq!(first["choices"][0]["finish_reason"], Value::Null);
        assert_eq!(json(&events[1].1)["choices"][0]["finish_reason"], "length");
    }

    #[test]
    fn single_token_stream_finishes_on_its_only_chunk() {
        let events = collect(Endpoint::Chat, 1, FinishReason::Length, true);
        let kinds: Vec<_> = events.iter().map(|e| e.0).collect();
        assert_eq!(
            kinds,
            [EventKind::Role, EventKind::Token { index: 0 }, EventKind::Usage, EventKind::Done]
        );
        assert_eq!(json(&events[1].1)["choices"][0]["finish_reason"], "length");
    }

    /// `n` = 3: a role chunk per choice, then each position's chunk of every choice with its
    /// `index`, each choice's last with `finish_reason`, and the usage summed.
    #[test]
    fn n_choices_stream_each_with_its_index() {
        for endpoint in [Endpoint::Chat, Endpoint::Completions] {
            let plan = OutputPlan { choices: 3, ..plan(2, FinishReason::Length) };
            let events: Vec<(EventKind, Value)> = SseEvents::new(&meta(endpoint), &plan, true)
                .filter(|e| e.kind != EventKind::Done)
                .map(|mut e| {
                    let bytes = e.buf.copy_to_bytes(e.buf.remaining());
                    (e.kind, json(std::str::from_utf8(&bytes).unwrap()))
                })
                .collect();
            let roles = if endpoint == Endpoint::Chat { 3 } else { 0 };
            assert_eq!(events.len(), roles + 2 * 3 + 1);
            for (i, (kind, v)) in events.iter().take(roles).enumerate() {
                assert_eq!(*kind, EventKind::Role);
                assert_eq!(v["choices"][0]["index"], i);
                assert_eq!(v["choices"][0]["delta"]["role"], "assistant");
            }
            let tokens = &events[roles..roles + 6];
            for (k, (kind, v)) in tokens.iter().enumerate() {
                let (position, choice) = (k / 3, k % 3);
                assert_eq!(*kind, EventKind::Token { index: position as u64 });
                let c = &v["choices"][0];
                assert_eq!(c["index"], choice, "{v}");
                let text = if endpoint == Endpoint::Chat { &c["delta"]["content"] } else { &c["text"] };
                assert_eq!(text, ["the ", "quick "][position]);
                assert_eq!(
                    c["finish_reason"],
                    if position == 1 { serde_json::json!("length") } else { Value::Null }
                );
                assert_eq!(v["id"], "chatcmpl-abc");
            }
            let (kind, usage) = &events[roles + 6];
            assert_eq!(*kind, EventKind::Usage);
            assert_eq!(
                usage["usage"],
                serde_json::json!({"prompt_tokens": 10, "completion_tokens": 6, "total_tokens": 16})
            );
        }
    }

    #[test]
    fn json_strings_are_escaped() {
        let mut buf = BytesMut::new();
        put_json_str(&mut buf, "a\"b\\c\nd é");
        let parsed: String = serde_json::from_slice(&buf).unwrap();
        assert_eq!(parsed, "a\"b\\c\nd é");
    }
}
