//! Parsing of `/v1/chat/completions`, `/v1/completions` and `/v1/responses` request bodies.
//!
//! Only the fields the simulator honours are read (`n` included: that many choices are
//! generated); all others (sampling parameters, tools, `best_of`, ...) are accepted and ignored. Texts are never copied: the deserialisers count
//! their tokens while parsing (see [`crate::tokens`]).

use std::borrow::Cow;
use std::fmt;

use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::Deserialize;

use crate::error::ApiError;
use crate::tokens::{self, GENERATION_PROMPT_TOKENS};

/// Which OpenAI endpoint a request came in on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `POST /v1/chat/completions`: `messages` in, `chat.completion` objects out.
    Chat,
    /// `POST /v1/completions`: `prompt` in, `text_completion` objects out.
    Completions,
    /// `POST /v1/responses`: `input` (and `instructions`) in, `response` objects or typed
    /// events out ([`crate::responses`]).
    Responses,
}

/// The honoured fields of one inference request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InferenceRequest<'a> {
    /// `model`; vLLM accepts a request without one and serves the first served model.
    pub model: Option<Cow<'a, str>>,
    /// Prompt tokens of `messages` or `prompt`, by the formula in the crate docs.
    pub prompt_tokens: u64,
    /// Chat: `max_completion_tokens`, else `max_tokens`; completions: `max_tokens`; responses:
    /// `max_output_tokens`.
    pub max_tokens: Option<u64>,
    /// `stream`.
    pub stream: bool,
    /// `stream_options.include_usage`.
    pub include_usage: bool,
    /// vLLM's `ignore_eos` extension.
    pub ignore_eos: bool,
    /// `n`: the number of choices, each generated the same way (default 1).
    pub n: u64,
    /// Chat `logprobs: true`: `Some(top_logprobs)` (0 when absent), answered in a non-streamed
    /// response's `choices[].logprobs` (streamed chunks carry none); always `None` for completions
    /// and responses.
    pub logprobs: Option<u32>,
    /// Responses: `instructions`, echoed in the response object as vLLM echoes it.
    pub instructions: Option<Cow<'a, str>>,
}

/// Largest chat `top_logprobs` (vLLM's default `--max-logprobs`, OpenAI's limit).
pub const MAX_TOP_LOGPROBS: u32 = 20;

#[derive(Deserialize)]
struct ChatBody<'a> {
    #[serde(default, borrow)]
    model: Option<Cow<'a, str>>,
    messages: ChatPromptTokens,
    #[serde(default)]
    max_tokens: Option<u64>,
    #[serde(default)]
    max_completion_tokens: Option<u64>,
    #[serde(default)]
    n: Option<u64>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    ignore_eos: Option<bool>,
    #[serde(default)]
    logprobs: Option<bool>,
    #[serde(default)]
    top_logprobs: Option<i64>,
}

#[derive(Deserialize)]
struct CompletionBody<'a> {
    #[serde(default, borrow)]
    model: Option<Cow<'a, str>>,
    prompt: PromptTokens,
    #[serde(default)]
    max_tokens: Option<u64>,
    #[serde(default)]
    n: Option<u64>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    ignore_eos: Option<bool>,
}

#[derive(Deserialize)]
struct ResponsesBody<'a> {
    #[serde(default, borrow)]
    model: Option<Cow<'a, str>>,
    input: ResponsesInputTokens,
    #[serde(default, borrow)]
    instructions: Option<Cow<'a, str>>,
    #[serde(default)]
    max_output_tokens: Option<u64>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    ignore_eos: Option<bool>,
}

#[derive(Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: Option<bool>,
}

/// Parses a request body for `endpoint`; malformed JSON, missing or mistyped fields and
/// `stream_options` without `stream: true` and `n: 0` are 400 `BadRequestError`s, as in vLLM.
pub fn parse(endpoint: Endpoint, body: &[u8]) -> Result<InferenceRequest<'_>, ApiError> {
    let invalid = |e: serde_json::Error| ApiError::bad_request(format!("Invalid request body: {e}"));
    let (request, stream_options) = match endpoint {
        Endpoint::Chat => {
            let b: ChatBody<'_> = serde_json::from_slice(body).map_err(invalid)?;
            let logprobs = chat_logprobs(b.logprobs, b.top_logprobs)?;
            let request = InferenceRequest {
                model: b.model,
                prompt_tokens: b.messages.0,
                max_tokens: b.max_completion_tokens.or(b.max_tokens),
                stream: b.stream.unwrap_or(false),
                include_usage: false,
                ignore_eos: b.ignore_eos.unwrap_or(false),
                n: b.n.unwrap_or(1),
                logprobs,
                instructions: None,
            };
            (request, b.stream_options)
        }
        Endpoint::Completions => {
            let b: CompletionBody<'_> = serde_json::from_slice(body).map_err(invalid)?;
            let request = InferenceRequest {
                model: b.model,
                prompt_tokens: b.prompt.0,
                max_tokens: b.max_tokens,
                stream: b.stream.unwrap_or(false),
                include_usage: false,
                ignore_eos: b.ignore_eos.unwrap_or(false),
                n: b.n.unwrap_or(1),
                logprobs: None,
                instructions: None,
            };
            (request, b.stream_options)
        }
        Endpoint::Responses => {
            let b: ResponsesBody<'_> = serde_json::from_slice(body).map_err(invalid)?;
            // vLLM renders a non-empty `instructions` as a leading system message.
            let instructions = b.instructions.filter(|i| !i.is_empty());
            let system = instructions
                .as_deref()
                .map_or(0, |i| tokens::message_tokens(tokens::text_tokens("system"), tokens::text_tokens(i)));
            let request = InferenceRequest {
                model: b.model,
                prompt_tokens: GENERATION_PROMPT_TOKENS.saturating_add(system).saturating_add(b.input.0),
                max_tokens: b.max_output_tokens,
                stream: b.stream.unwrap_or(false),
                include_usage: false,
                ignore_eos: b.ignore_eos.unwrap_or(false),
                n: 1,
                logprobs: None,
                instructions,
            };
            // The Responses API has no `stream_options` of vLLM's: its streams end with their usage.
            (request, None)
        }
    };
    if request.n == 0 {
        // vLLM's `SamplingParams` check.
        return Err(ApiError::bad_request("n must be at least 1, got 0."));
    }
    match stream_options {
        Some(_) if !request.stream => {
            Err(ApiError::bad_request("Stream options can only be defined when `stream=True`."))
        }
        Some(options) => {
            Ok(InferenceRequest { include_usage: options.include_usage.unwrap_or(false), ..request })
        }
        None => Ok(request),
    }
}

/// Chat `logprobs` / `top_logprobs` checked as vLLM checks them: `top_logprobs` negative (other
/// than vLLM's -1, "all", taken here as [`MAX_TOP_LOGPROBS`]), above the limit, or positive without
/// `logprobs: true` is a 400.
fn chat_logprobs(logprobs: Option<bool>, top: Option<i64>) -> Result<Option<u32>, ApiError> {
    let top = match top {
        None | Some(0) => 0,
        Some(-1) => MAX_TOP_LOGPROBS,
        Some(t) if t < 0 => return Err(ApiError::bad_request("`top_logprobs` must be a positive value.")),
        Some(t) => match u32::try_from(t) {
            Ok(t) if t <= MAX_TOP_LOGPROBS => t,
            _ => {
                return Err(ApiError::bad_request(format!(
                    "`top_logprobs` must be at most {MAX_TOP_LOGPROBS}, got {t}."
                )))
            }
        },
    };
    match (logprobs.unwrap_or(false), top) {
        (true, top) => Ok(Some(top)),
        (false, 0) => Ok(None),
        (false, _) => {
            Err(ApiError::bad_request("when using `top_logprobs`, `logprobs` must be set to true."))
        }
    }
}

/// Token count of a JSON string (or `null`, 0 tokens) read without copying it.
struct TextTokens(u64);

impl<'de> Deserialize<'de> for TextTokens {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = TextTokens;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<TextTokens, E> {
                Ok(TextTokens(tokens::text_tokens(v)))
            }
            fn visit_unit<E: de::Error>(self) -> Result<TextTokens, E> {
                Ok(TextTokens(0))
            }
        }
        d.deserialize_any(V)
    }
}

/// One chat message: `role` and `content`; other fields (`name`, `tool_calls`, ...) are ignored.
#[derive(Deserialize)]
struct Message {
    role: TextTokens,
    #[serde(default)]
    content: Option<ContentTokens>,
}

/// Token count of a message `content`: a string, `null`, or an array of parts of which
/// only `{"type": "text", "text": ...}` parts count (images and audio count 0).
struct ContentTokens(u64);

#[derive(Deserialize)]
struct Part<'a> {
    #[serde(rename = "type", borrow)]
    kind: Cow<'a, str>,
    #[serde(default)]
    text: Option<TextTokens>,
}

impl<'de> Deserialize<'de> for ContentTokens {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = ContentTokens;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string or an array of content parts")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(ContentTokens(tokens::text_tokens(v)))
            }
            fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(ContentTokens(0))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut total = 0u64;
                while let Some(part) = seq.next_element::<Part<'de>>()? {
                    if part.kind == "text" {
                        total = total.saturating_add(part.text.map_or(0, |t| t.0));
                    }
                }
                Ok(ContentTokens(total))
            }
        }
        d.deserialize_any(V)
    }
}

/// Token count of a Responses API message item's `content`: a string, `null`, or an array of
/// parts of which the `input_text`, `output_text` and `text` parts count (vLLM's chat parser
/// reads those three; images, files and refusals count 0).
struct ResponsesContentTokens(u64);

impl<'de> Deserialize<'de> for ResponsesContentTokens {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = ResponsesContentTokens;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string or an array of content parts")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(ResponsesContentTokens(tokens::text_tokens(v)))
            }
            fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(ResponsesContentTokens(0))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut total = 0u64;
                while let Some(part) = seq.next_element::<Part<'de>>()? {
                    if matches!(part.kind.as_ref(), "input_text" | "output_text" | "text") {
                        total = total.saturating_add(part.text.map_or(0, |t| t.0));
                    }
                }
                Ok(ResponsesContentTokens(total))
            }
        }
        d.deserialize_any(V)
    }
}

/// One Responses API input item: a message (a `role`, `type` absent or `"message"`) costs its
/// role and content as a chat message does; other items (function calls and outputs, reasoning,
/// item references) cost nothing here.
#[derive(Deserialize)]
struct InputItem<'a> {
    #[serde(rename = "type", default, borrow)]
    kind: Option<Cow<'a, str>>,
    #[serde(default)]
    role: Option<TextTokens>,
    #[serde(default)]
    content: Option<ResponsesContentTokens>,
}

/// Prompt tokens of a Responses API `input` (without the generation prompt): a string is one
/// `user` message; an array, the sum of its message items.
struct ResponsesInputTokens(u64);

impl<'de> Deserialize<'de> for ResponsesInputTokens {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = ResponsesInputTokens;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string or an array of input items")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(ResponsesInputTokens(tokens::message_tokens(
                    tokens::text_tokens("user"),
                    tokens::text_tokens(v),
                )))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut total = 0u64;
                while let Some(item) = seq.next_element::<InputItem<'de>>()? {
                    let message = matches!(item.kind.as_deref(), None | Some("message"));
                    if let (true, Some(role)) = (message, item.role) {
                        let content = item.content.map_or(0, |c| c.0);
                        total = total.saturating_add(tokens::message_tokens(role.0, content));
                    }
                }
                Ok(ResponsesInputTokens(total))
            }
        }
        d.deserialize_any(V)
    }
}

/// Prompt tokens of a chat `messages` array: the sum of the messages' tokens plus
/// [`GENERATION_PROMPT_TOKENS`].
struct ChatPromptTokens(u64);

impl<'de> Deserialize<'de> for ChatPromptTokens {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = ChatPromptTokens;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an array of messages")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<ChatPromptTokens, A::Error> {
                let mut total = GENERATION_PROMPT_TOKENS;
                while let Some(m) = seq.next_element::<Message>()? {
                    let content = m.content.map_or(0, |c| c.0);
                    total = total.saturating_add(tokens::message_tokens(m.role.0, content));
                }
                Ok(ChatPromptTokens(total))
            }
        }
        d.deserialize_seq(V)
    }
}

/// Prompt tokens of a completions `prompt`: a string; an array of strings (their tokens
/// summed, answered as one choice); an array of token ids (one token each); or an array of
/// token-id arrays.
struct PromptTokens(u64);

/// One element of a `prompt` array.
struct PromptItem(u64);

impl<'de> Deserialize<'de> for PromptItem {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = PromptItem;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string, a token id or an array of token ids")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<PromptItem, E> {
                Ok(PromptItem(tokens::text_tokens(v)))
            }
            fn visit_u64<E: de::Error>(self, _: u64) -> Result<PromptItem, E> {
                Ok(PromptItem(1))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<PromptItem, A::Error> {
                let mut ids = 0u64;
                while seq.next_element::<u64>()?.is_some() {
                    ids += 1;
                }
                Ok(PromptItem(ids))
            }
        }
        d.deserialize_any(V)
    }
}

impl<'de> Deserialize<'de> for PromptTokens {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = PromptTokens;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string or an array")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<PromptTokens, E> {
                Ok(PromptTokens(tokens::text_tokens(v)))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<PromptTokens, A::Error> {
                let mut total = 0u64;
                while let Some(item) = seq.next_element::<PromptItem>()? {
                    total = total.saturating_add(item.0);
                }
                Ok(PromptTokens(total))
            }
        }
        d.deserialize_any(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn chat(body: serde_json::Value) -> Result<InferenceRequest<'static>, ApiError> {
        let bytes: &'static [u8] = Box::leak(serde_json::to_vec(&body).unwrap().into_boxed_slice());
        parse(Endpoint::Chat, bytes)
    }

    fn completion(body: serde_json::Value) -> Result<InferenceRequest<'static>, ApiError> {
        let bytes: &'static [u8] = Box::leak(serde_json::to_vec(&body).unwrap().into_boxed_slice());
        parse(Endpoint::Completions, bytes)
    }

    #[test]
    fn chat_prompt_tokens_follow_the_formula() {
        // user: 1, "Hello world!" (12 bytes): 3, +3 per message, +3 generation prompt.
        let r =
            chat(json!({"model": "m", "messages": [{"role": "user", "content": "Hello world!"}]})).unwrap();
        assert_eq!(r.prompt_tokens, 1 + 3 + 3 + 3);
        assert_eq!(r.model.as_deref(), Some("m"));
        assert!(!r.stream && !r.include_usage && !r.ignore_eos);
        // system (6 bytes): 2, "Be brief." (9): 3; assistant (9): 3, null content: 0.
        let r = chat(json!({"messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "assistant", "content": null, "tool_calls": []},
        ]}))
        .unwrap();
        assert_eq!(r.prompt_tokens, (2 + 3 + 3) + (3 + 3) + 3);
        assert_eq!(r.model, None);
    }

    #[test]
    fn chat_content_parts_count_text_only() {
        let r = chat(json!({"messages": [{"role": "user", "content": [
            {"type": "text", "text": "abcdefgh"},
            {"type": "image_url", "image_url": {"url": "http://x/y.png"}},
            {"type": "text", "text": "a"},
        ]}]}))
        .unwrap();
        assert_eq!(r.prompt_tokens, 1 + (2 + 1) + 3 + 3);
    }

    #[test]
    fn escaped_text_counts_decoded_bytes() {
        let r = completion(json!({"prompt": "\"\"\"\""})).unwrap();
        assert_eq!(r.prompt_tokens, 1);
    }

    #[test]
    fn completions_prompt_shapes() {
        assert_eq!(completion(json!({"prompt": "abcdefghi"})).unwrap().prompt_tokens, 3);
        assert_eq!(completion(json!({"prompt": ["abcd", "abcde"]})).unwrap().prompt_tokens, 3);
        assert_eq!(completion(json!({"prompt": [1, 2, 3, 4, 5]})).unwrap().prompt_tokens, 5);
        assert_eq!(completion(json!({"prompt": [[1, 2], [3]]})).unwrap().prompt_tokens, 3);
    }

    #[test]
    fn max_completion_tokens_takes_precedence() {
        let r = chat(json!({"messages": [], "max_tokens": 7, "max_completion_tokens": 3})).unwrap();
        assert_eq!(r.max_tokens, Some(3));
        let r = chat(json!({"messages": [], "max_tokens": 7})).unwrap();
        assert_eq!(r.max_tokens, Some(7));
        let r = completion(json!({"prompt": "x", "max_tokens": 9, "ignore_eos": true})).unwrap();
        assert_eq!((r.max_tokens, r.ignore_eos), (Some(9), true));
    }

    #[test]
    fn n_is_read_and_checked() {
        assert_eq!(chat(json!({"messages": []})).unwrap().n, 1);
        assert_eq!(chat(json!({"messages": [], "n": 3})).unwrap().n, 3);
        assert_eq!(completion(json!({"prompt": "x", "n": 2, "best_of": 4})).unwrap().n, 2);
        let e = chat(json!({"messages": [], "n": 0})).unwrap_err();
        assert_eq!(e, ApiError::bad_request("n must be at least 1, got 0."));
        assert!(completion(json!({"prompt": "x", "n": "2"})).is_err());
    }

    #[test]
    fn chat_logprobs_are_checked_as_vllm_does() {
        assert_eq!(chat(json!({"messages": []})).unwrap().logprobs, None);
        assert_eq!(chat(json!({"messages": [], "logprobs": true})).unwrap().logprobs, Some(0));
        let r = chat(json!({"messages": [], "logprobs": true, "top_logprobs": 20})).unwrap();
        assert_eq!(r.logprobs, Some(20));
        let r = chat(json!({"messages": [], "logprobs": false, "top_logprobs": 0})).unwrap();
        assert_eq!(r.logprobs, None);
        for bad in [
            json!({"top_logprobs": 2}),
            json!({"logprobs": true, "top_logprobs": 21}),
            json!({"logprobs": true, "top_logprobs": -2}),
        ] {
            let mut body = bad.clone();
            body["messages"] = json!([]);
            assert_eq!(chat(body).unwrap_err().status, http::StatusCode::BAD_REQUEST, "{bad}");
        }
        let r = completion(json!({"prompt": "x", "logprobs": 3})).unwrap();
        assert_eq!(r.logprobs, None, "completions logprobs are not simulated");
    }

    #[test]
    fn stream_options() {
        let r =
            chat(json!({"messages": [], "stream": true, "stream_options": {"include_usage": true}})).unwrap();
        assert!(r.stream && r.include_usage);
        let r = chat(json!({"messages": [], "stream": true, "stream_options": null})).unwrap();
        assert!(r.stream && !r.include_usage);
        let e = chat(json!({"messages": [], "stream_options": {"include_usage": true}})).unwrap_err();
        assert_eq!(e.message, "Stream options can only be defined when `stream=True`.");
    }

    #[test]
    fn malformed_bodies_are_bad_requests() {
        for bad in [&b"{"[..], b"[]", b"{\"model\": \"m\"}", b"{\"messages\": \"hi\"}"] {
            let e = parse(Endpoint::Chat, bad).unwrap_err();
            assert_eq!(e.status, http::StatusCode::BAD_REQUEST);
            assert_eq!(e.kind, "BadRequestError");
        }
        let e = parse(Endpoint::Completions, b"{\"model\": \"m\"}").unwrap_err();
        assert!(e.message.contains("missing field `prompt`"), "{}", e.message);
        let e = parse(Endpoint::Chat, b"{\"messages\": [], \"max_tokens\": -1}").unwrap_err();
        assert_eq!(e.status, http::StatusCode::BAD_REQUEST);
    }

    fn responses(body: serde_json::Value) -> Result<InferenceRequest<'static>, ApiError> {
        let bytes: &'static [u8] = Box::leak(serde_json::to_vec(&body).unwrap().into_boxed_slice());
        parse(Endpoint::Responses, bytes)
    }

    #[test]
    fn responses_prompt_tokens_follow_the_chat_formula() {
        // user: 1, "Hello world!": 3, +3 per message, +3 generation prompt.
        let r = responses(json!({"model": "m", "input": "Hello world!"})).unwrap();
        assert_eq!(r.prompt_tokens, 1 + 3 + 3 + 3);
        assert_eq!((r.max_tokens, r.stream, r.include_usage, r.n), (None, false, false, 1));
        // instructions: a system message (system: 2, "Be brief.": 3, +3).
        let r =
            responses(json!({"input": "Hello world!", "instructions": "Be brief.", "max_output_tokens": 7,
            "stream": true, "ignore_eos": true}))
            .unwrap();
        assert_eq!(r.prompt_tokens, (2 + 3 + 3) + (1 + 3 + 3) + 3);
        assert_eq!((r.max_tokens, r.stream, r.ignore_eos), (Some(7), true, true));
        assert_eq!(r.instructions.as_deref(), Some("Be brief."));
        let r = responses(json!({"input": "x", "instructions": ""})).unwrap();
        assert_eq!((r.prompt_tokens, r.instructions), (1 + 1 + 3 + 3, None));
        // Items: messages count, other items do not; text-like parts count.
        let r = responses(json!({"input": [
            {"role": "user", "content": "abcd"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "abcdefgh"},
                {"type": "refusal", "refusal": "no"}]},
            {"type": "function_call_output", "call_id": "c", "output": "a long tool output"},
            {"id": "ref_1"},
            {"role": "developer", "content": [{"type": "input_text", "text": "a"}, {"type": "input_image", "image_url": "u"}]},
        ]}))
        .unwrap();
        assert_eq!(r.prompt_tokens, (1 + 1 + 3) + (3 + 2 + 3) + (3 + 1 + 3) + 3);
        assert!(responses(json!({"model": "m"})).is_err());
        assert!(responses(json!({"input": 5})).is_err());
        assert!(responses(json!({"input": "x", "max_output_tokens": -1})).is_err());
    }
}
