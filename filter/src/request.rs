//! Request classification (method + path) and validation of OpenAI request bodies.
//!
//! Endpoints follow the OpenAI REST API: `POST /v1/chat/completions`, `POST /v1/completions`,
//! `POST /v1/responses`, `POST /v1/embeddings`, `GET /v1/models`. Body fields follow the OpenAI
//! request objects; only the fields the gateway needs are validated (`model`, `messages`/`prompt`,
//! `max_tokens`, `max_completion_tokens`, `n`, completions `best_of`, `stream`,
//! `stream_options.include_usage`; for the Responses API `instructions`, `input` and
//! `max_output_tokens`), everything else is passed to vLLM untouched.

use serde_json::{Map, Value};

use crate::error::{truncate_for_echo, GatewayError};
use crate::json_scan::{scan_object_bounded, ObjectScan};

/// The most top-level members a request body may have (both paths refuse more, 400
/// `too_many_members`). The OpenAI request objects have about 40 fields, vLLM's about 80 with its
/// extensions; a body of hundreds of thousands of small members (4 MiB of `"k1":0,`) only costs
/// the Envoy worker time per member.
pub const MAX_TOP_LEVEL_MEMBERS: usize = 1024;

/// The top-level members of `body` (at most [`MAX_TOP_LEVEL_MEMBERS`]: the walk stops at the next
/// one), without building values.
///
/// # Errors
/// [`GatewayError::InvalidJson`] when `body` is not an object, [`GatewayError::TooManyMembers`]
/// past the bound.
pub fn scan_members(body: &[u8]) -> Result<ObjectScan, GatewayError> {
    scan_object_bounded(body, MAX_TOP_LEVEL_MEMBERS)
        .ok_or(GatewayError::InvalidJson { detail: "the top-level object could not be scanned".into() })?
        .ok_or(GatewayError::TooManyMembers { limit: MAX_TOP_LEVEL_MEMBERS })
}

/// The API endpoints the gateway serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `POST /v1/chat/completions`.
    ChatCompletions,
    /// `POST /v1/completions` (legacy text completions).
    Completions,
    /// `POST /v1/responses` (OpenAI's Responses API, as vLLM serves it: stateless, `input` and
    /// `instructions` rendered as chat messages).
    Responses,
    /// `POST /v1/embeddings` (auth and routing only, no context check).
    Embeddings,
    /// `GET /v1/models`, answered locally.
    Models,
}

impl Endpoint {
    /// The one method the endpoint accepts.
    pub fn method(self) -> &'static str {
        match self {
            Endpoint::Models => "GET",
            _ => "POST",
        }
    }

    /// Name of the body field holding the prompt (`messages`, `prompt`, `input`); the `param`
    /// of context-length errors.
    pub fn prompt_param(self) -> &'static str {
        match self {
            Endpoint::ChatCompletions => "messages",
            Endpoint::Completions => "prompt",
            Endpoint::Responses | Endpoint::Embeddings | Endpoint::Models => "input",
        }
    }

    /// Whether vLLM reports a stream's usage only when asked with `stream_options.include_usage`
    /// (chat and completions), which the filter then injects. The Responses API always ends a
    /// stream with `response.completed` and its `usage` (vLLM's `responses_stream_generator`).
    pub fn stream_usage_needs_asking(self) -> bool {
        matches!(self, Endpoint::ChatCompletions | Endpoint::Completions)
    }

    /// The endpoint's OpenTelemetry `gen_ai.operation.name` ([`gateway_contract::OPERATIONS`]):
    /// the Responses API is `chat` (a conversation in, generated content out, as Chat Completions).
    pub fn operation(self) -> &'static str {
        match self {
            Endpoint::ChatCompletions | Endpoint::Responses | Endpoint::Models => "chat",
            Endpoint::Completions => "text_completion",
            Endpoint::Embeddings => "embeddings",
        }
    }

    /// The API whose response shapes the meter reads for this endpoint.
    pub fn meter_api(self) -> gateway_meter::Api {
        match self {
            Endpoint::Responses => gateway_meter::Api::Responses,
            _ => gateway_meter::Api::ChatCompletions,
        }
    }
}

/// Classifies a request by `:method` and `:path` (query string and fragment ignored; exact,
/// case-sensitive path match).
///
/// # Errors
/// [`GatewayError::NotFound`] for any other path, [`GatewayError::MethodNotAllowed`] for a known
/// path with the wrong method.
pub fn classify(method: &str, path: &str) -> Result<Endpoint, GatewayError> {
    let bare = path.split(['?', '#']).next().unwrap_or_default();
    let endpoint = match bare {
        "/v1/chat/completions" => Endpoint::ChatCompletions,
        "/v1/completions" => Endpoint::Completions,
        "/v1/responses" => Endpoint::Responses,
        "/v1/embeddings" => Endpoint::Embeddings,
        "/v1/models" => Endpoint::Models,
        _ => {
            return Err(GatewayError::NotFound {
                method: truncate_for_echo(method),
                path: truncate_for_echo(bare),
            })
        }
    };
    if method != endpoint.method() {
        return Err(GatewayError::MethodNotAllowed {
            method: truncate_for_echo(method),
            path: bare.to_string(),
            allow: endpoint.method(),
        });
    }
    Ok(endpoint)
}

/// One chat message, reduced to what the context check needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatMessage<'a> {
    /// `role` (`system`, `user`, `assistant`, `tool`, ...).
    pub role: &'a str,
    /// The text of `content`: the string itself, or the `text` of each `{"type":"text"}` part.
    /// Non-text parts (images, audio, ...) contribute nothing.
    pub texts: Vec<&'a str>,
}

/// One prompt of a (possibly batched) completions or embeddings request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PromptItem<'a> {
    /// A text prompt.
    Text(&'a str),
    /// A pre-tokenized prompt: the number of token ids (an exact count).
    Tokens(u64),
}

/// The prompt of a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prompt<'a> {
    /// Chat `messages`; for the Responses API, `instructions` (a `system` message, as vLLM
    /// renders it) and the `input` messages.
    Chat(Vec<ChatMessage<'a>>),
    /// Completions `prompt` or embeddings `input`: each item is a separate prompt for vLLM.
    Items(Vec<PromptItem<'a>>),
}

impl Prompt<'_> {
    /// Prompts vLLM generates for separately: the items of a completions batch; 1 for chat.
    pub fn count(&self) -> u64 {
        match self {
            Prompt::Chat(_) => 1,
            Prompt::Items(items) => items.len() as u64,
        }
    }
}

/// The client's requested completion limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MaxTokens {
    /// The value (>= 1).
    pub value: u64,
    /// The field it came from: `max_completion_tokens` or `max_tokens`.
    pub param: &'static str,
}

/// A validated request body, borrowing from the parsed JSON.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValidatedRequest<'a> {
    /// `model` as sent.
    pub model: &'a str,
    /// The prompt.
    pub prompt: Prompt<'a>,
    /// Effective max tokens: chat `max_completion_tokens` if set, else `max_tokens`; completions
    /// `max_tokens`; Responses `max_output_tokens`; embeddings never.
    pub max_tokens: Option<MaxTokens>,
    /// Sequences vLLM generates for each prompt, each up to `max_tokens`: `n` (OpenAI's number
    /// of choices, default 1), on completions `max(n, best_of)` (vLLM samples `best_of` and
    /// returns the best `n`). Always >= 1; 1 for embeddings.
    pub choices: u64,
    /// The `n` and `best_of` the body set (`None`: absent or null), for the configured cap on
    /// sequences per prompt ([`crate::config::Config::max_n`]).
    pub sequences: [(&'static str, Option<u64>); 2],
    /// `stream` (false when absent or null; always false for embeddings).
    pub stream: bool,
    /// Whether the client itself set `stream_options.include_usage: true` (always false for the
    /// Responses API, whose streams report their usage unasked).
    pub include_usage: bool,
    /// Byte offsets of the body's top-level members (for surgical rewrites).
    pub scan: ObjectScan,
}

/// Parses a request body as a JSON object.
///
/// # Errors
/// [`GatewayError::InvalidJson`] for an empty body, invalid JSON, or a non-object document.
pub fn parse_json(body: &[u8]) -> Result<Value, GatewayError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Err(GatewayError::InvalidJson { detail: "the body is empty".into() });
    }
    let value: Value =
        serde_json::from_slice(body).map_err(|e| GatewayError::InvalidJson { detail: e.to_string() })?;
    if !value.is_object() {
        return Err(GatewayError::InvalidJson {
            detail: format!("expected a JSON object, but got {}", type_name(&value)),
        });
    }
    Ok(value)
}

/// The JSON type of `v` in words, as used in `invalid_type` messages.
pub fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(n) if n.is_i64() || n.is_u64() => "an integer",
        Value::Number(_) => "a decimal number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn invalid_type(param: impl Into<String>, expected: &'static str, got: &Value) -> GatewayError {
    GatewayError::InvalidType { param: param.into(), expected, got: type_name(got) }
}

/// `obj[key]`, with JSON `null` treated as absent.
fn field<'a>(obj: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    obj.get(key).filter(|v| !v.is_null())
}

/// Validates the body of a chat, completions or embeddings request. `body` is the raw bytes
/// `value` was parsed from (for [`ValidatedRequest::scan`]).
///
/// # Errors
/// 400-class [`GatewayError`]s naming the parameter: `DuplicateParameter` for a repeated
/// top-level key, `MissingParameter` (`model`, `messages`, `prompt`, `messages[i].role`, `input`,
/// `input[i].role` of a `"type": "message"` item), `InvalidType`, `InvalidValue` (empty
/// `messages`/`prompt`, `max_tokens`, `max_output_tokens`, `n` or `best_of` < 1, `best_of` < `n`).
pub fn validate<'a>(
    endpoint: Endpoint,
    body: &[u8],
    value: &'a Value,
) -> Result<ValidatedRequest<'a>, GatewayError> {
    let obj = value.as_object().ok_or_else(|| GatewayError::InvalidJson {
        detail: format!("expected a JSON object, but got {}", type_name(value)),
    })?;
    let scan = scan_members(body)?;
    if let Some(dup) = scan.first_duplicate() {
        return Err(GatewayError::DuplicateParameter { param: truncate_for_echo(dup) });
    }

    let model = match field(obj, "model") {
        None => return Err(GatewayError::MissingParameter { param: "model".into() }),
        Some(Value::String(s)) if s.is_empty() => {
            return Err(GatewayError::MissingParameter { param: "model".into() })
        }
        Some(Value::String(s)) => s.as_str(),
        Some(other) => return Err(invalid_type("model", "a string", other)),
    };

    let (prompt, max_tokens, sequences, stream, include_usage) = match endpoint {
        Endpoint::ChatCompletions => {
            let prompt = chat_messages(obj)?;
            let mct = max_tokens_field(obj, "max_completion_tokens")?;
            let mt = max_tokens_field(obj, "max_tokens")?;
            let n = positive_integer(obj, "n")?;
            let (stream, include_usage) = stream_fields(obj)?;
            (prompt, mct.or(mt), [n, None], stream, include_usage)
        }
        Endpoint::Completions => {
            let prompt = match field(obj, "prompt") {
                None => return Err(GatewayError::MissingParameter { param: "prompt".into() }),
                Some(p) => prompt_items(p, "prompt")?,
            };
            let mt = max_tokens_field(obj, "max_tokens")?;
            let sequences = completion_sequences(obj)?;
            let (stream, include_usage) = stream_fields(obj)?;
            (prompt, mt, sequences, stream, include_usage)
        }
        Endpoint::Responses => {
            let prompt = responses_input(obj)?;
            let max_output = max_tokens_field(obj, "max_output_tokens")?;
            (prompt, max_output, [None, None], stream_flag(obj)?, false)
        }
        Endpoint::Embeddings | Endpoint::Models => {
            // Auth and routing only: `input` is read for the token estimate, never rejected.
            let prompt = field(obj, "input")
                .and_then(|v| prompt_items(v, "input").ok())
                .unwrap_or(Prompt::Items(Vec::new()));
            (prompt, None, [None, None], false, false)
        }
    };
    let [n, best_of] = sequences;
    // vLLM samples `best_of` sequences (at least `n`) and returns the best `n`.
    let choices = best_of.unwrap_or(1).max(n.unwrap_or(1));
    let sequences = [("n", n), ("best_of", best_of)];
    Ok(ValidatedRequest { model, prompt, max_tokens, choices, sequences, stream, include_usage, scan })
}

fn chat_messages(obj: &Map<String, Value>) -> Result<Prompt<'_>, GatewayError> {
    let messages = match field(obj, "messages") {
        None => return Err(GatewayError::MissingParameter { param: "messages".into() }),
        Some(Value::Array(a)) => a,
        Some(other) => return Err(invalid_type("messages", "an array", other)),
    };
    if messages.is_empty() {
        return Err(GatewayError::InvalidValue {
            param: "messages".into(),
            reason: "expected an array with at least 1 element, but got an empty array.".into(),
        });
    }
    let mut out = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        let m = m.as_object().ok_or_else(|| invalid_type(format!("messages[{i}]"), "an object", m))?;
        let role = match field(m, "role") {
            None => return Err(GatewayError::MissingParameter { param: format!("messages[{i}].role") }),
            Some(Value::String(s)) => s.as_str(),
            Some(other) => return Err(invalid_type(format!("messages[{i}].role"), "a string", other)),
        };
        let texts = match field(m, "content") {
            None => Vec::new(),
            Some(Value::String(s)) => vec![s.as_str()],
            Some(Value::Array(parts)) => {
                let mut texts = Vec::new();
                for (j, part) in parts.iter().enumerate() {
                    let p = part.as_object().ok_or_else(|| {
                        invalid_type(format!("messages[{i}].content[{j}]"), "an object", part)
                    })?;
                    if p.get("type").and_then(Value::as_str) == Some("text") {
                        match p.get("text") {
                            Some(Value::String(t)) => texts.push(t.as_str()),
                            Some(other) => {
                                return Err(invalid_type(
                                    format!("messages[{i}].content[{j}].text"),
                                    "a string",
                                    other,
                                ))
                            }
                            None => {
                                return Err(GatewayError::MissingParameter {
                                    param: format!("messages[{i}].content[{j}].text"),
                                })
                            }
                        }
                    }
                }
                texts
            }
            Some(other) => {
                return Err(invalid_type(format!("messages[{i}].content"), "a string or an array", other))
            }
        };
        out.push(ChatMessage { role, texts });
    }
    Ok(Prompt::Chat(out))
}

/// The prompt of a Responses API request, as vLLM builds its chat messages
/// (`_construct_input_messages` in `vllm/entrypoints/openai/serving_responses.py`): a non-empty
/// `instructions` first as a `system` message, then `input`, a string (one `user` message) or an
/// array of input items. An item that is a message (a `role`, and `type` absent or `"message"`)
/// contributes its `content`: a string, or the `text` of its `input_text`, `output_text` and
/// `text` parts (vLLM's chat parser reads those three; images, files and other parts count
/// nothing). Other items (function calls and their outputs, reasoning, item references) count
/// nothing: the prompt's lower bound stays a lower bound. Only what the gateway reads is typed
/// strictly; other fields and item kinds go to vLLM untouched.
fn responses_input(obj: &Map<String, Value>) -> Result<Prompt<'_>, GatewayError> {
    let mut out = Vec::new();
    match field(obj, "instructions") {
        None => {}
        // vLLM adds the system message only for a non-empty `instructions`.
        Some(Value::String(s)) if s.is_empty() => {}
        Some(Value::String(s)) => out.push(ChatMessage { role: "system", texts: vec![s.as_str()] }),
        Some(other) => return Err(invalid_type("instructions", "a string", other)),
    }
    let items = match field(obj, "input") {
        None => return Err(GatewayError::MissingParameter { param: "input".into() }),
        Some(Value::String(s)) => {
            out.push(ChatMessage { role: "user", texts: vec![s.as_str()] });
            return Ok(Prompt::Chat(out));
        }
        Some(Value::Array(items)) => items,
        Some(other) => return Err(invalid_type("input", "a string or an array", other)),
    };
    for (i, item) in items.iter().enumerate() {
        let item = item.as_object().ok_or_else(|| invalid_type(format!("input[{i}]"), "an object", item))?;
        let kind = match field(item, "type") {
            None => None,
            Some(Value::String(t)) => Some(t.as_str()),
            Some(other) => return Err(invalid_type(format!("input[{i}].type"), "a string", other)),
        };
        let role = match field(item, "role") {
            None => None,
            Some(Value::String(r)) => Some(r.as_str()),
            Some(other) => return Err(invalid_type(format!("input[{i}].role"), "a string", other)),
        };
        let role = match (kind, role) {
            (None | Some("message"), Some(role)) => role,
            (Some("message"), None) => {
                return Err(GatewayError::MissingParameter { param: format!("input[{i}].role") })
            }
            _ => continue,
        };
        let texts = match field(item, "content") {
            None => Vec::new(),
            Some(Value::String(s)) => vec![s.as_str()],
            Some(Value::Array(parts)) => {
                let mut texts = Vec::new();
                for (j, part) in parts.iter().enumerate() {
                    let p = part
                        .as_object()
                        .ok_or_else(|| invalid_type(format!("input[{i}].content[{j}]"), "an object", part))?;
                    if !matches!(
                        p.get("type").and_then(Value::as_str),
                        Some("input_text" | "output_text" | "text")
                    ) {
                        continue;
                    }
                    match p.get("text") {
                        Some(Value::String(t)) => texts.push(t.as_str()),
                        Some(other) => {
                            return Err(invalid_type(
                                format!("input[{i}].content[{j}].text"),
                                "a string",
                                other,
                            ))
                        }
                        None => {
                            return Err(GatewayError::MissingParameter {
                                param: format!("input[{i}].content[{j}].text"),
                            })
                        }
                    }
                }
                texts
            }
            Some(other) => {
                return Err(invalid_type(format!("input[{i}].content"), "a string or an array", other))
            }
        };
        out.push(ChatMessage { role, texts });
    }
    Ok(Prompt::Chat(out))
}

/// A completions `prompt` / embeddings `input`: a string, an array of strings, an array of token
/// ids, or an array of arrays of token ids.
fn prompt_items<'a>(v: &'a Value, param: &'static str) -> Result<Prompt<'a>, GatewayError> {
    let expected = "a string, an array of strings, or an array of token ids";
    match v {
        Value::String(s) => Ok(Prompt::Items(vec![PromptItem::Text(s)])),
        Value::Array(a) if a.is_empty() => Err(GatewayError::InvalidValue {
            param: param.into(),
            reason: "expected an array with at least 1 element, but got an empty array.".into(),
        }),
        Value::Array(a) => {
            if a.iter().all(Value::is_string) {
                Ok(Prompt::Items(a.iter().filter_map(Value::as_str).map(PromptItem::Text).collect()))
            } else if a.iter().all(Value::is_u64) {
                Ok(Prompt::Items(vec![PromptItem::Tokens(a.len() as u64)]))
            } else if a.iter().all(|x| x.as_array().is_some_and(|t| t.iter().all(Value::is_u64))) {
                Ok(Prompt::Items(
                    a.iter()
                        .filter_map(Value::as_array)
                        .map(|t| PromptItem::Tokens(t.len() as u64))
                        .collect(),
                ))
            } else {
                Err(invalid_type(param, expected, v))
            }
        }
        other => Err(invalid_type(param, expected, other)),
    }
}

fn max_tokens_field(
    obj: &Map<String, Value>,
    param: &'static str,
) -> Result<Option<MaxTokens>, GatewayError> {
    Ok(positive_integer(obj, param)?.map(|value| MaxTokens { value, param }))
}

/// A completions request's `n` and `best_of`, as vLLM's `SamplingParams` reads them (`n` >= 1,
/// `best_of` >= `n`, `best_of` defaulting to `n`): it generates `max(n, best_of)` sequences per
/// prompt.
fn completion_sequences(obj: &Map<String, Value>) -> Result<[Option<u64>; 2], GatewayError> {
    let n = positive_integer(obj, "n")?;
    let best_of = positive_integer(obj, "best_of")?;
    match (n.unwrap_or(1), best_of) {
        (n, Some(best_of)) if best_of < n => Err(GatewayError::InvalidValue {
            param: "best_of".into(),
            reason: format!(
                "best_of must be greater than or equal to n. Expected a value >= {n}, but got {best_of} instead."
            ),
        }),
        _ => Ok([n, best_of]),
    }
}

/// An integer field that must be >= 1 (`max_tokens`, `n`, `best_of`); absent or null is `None`.
fn positive_integer(obj: &Map<String, Value>, param: &'static str) -> Result<Option<u64>, GatewayError> {
    match field(obj, param) {
        None => Ok(None),
        Some(Value::Number(n)) => match (n.as_u64(), n.as_i64()) {
            (Some(v), _) if v >= 1 => Ok(Some(v)),
            (Some(v), _) => Err(GatewayError::InvalidValue {
                param: param.into(),
                reason: format!("integer below minimum value. Expected a value >= 1, but got {v} instead."),
            }),
            (None, Some(v)) => Err(GatewayError::InvalidValue {
                param: param.into(),
                reason: format!("integer below minimum value. Expected a value >= 1, but got {v} instead."),
            }),
            (None, None) => Err(GatewayError::InvalidType {
                param: param.into(),
                expected: "an integer",
                got: "a decimal number",
            }),
        },
        Some(other) => Err(invalid_type(param, "an integer", other)),
    }
}

/// `stream`: a boolean, false when absent or null.
fn stream_flag(obj: &Map<String, Value>) -> Result<bool, GatewayError> {
    match field(obj, "stream") {
        None => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(other) => Err(invalid_type("stream", "a boolean", other)),
    }
}

fn stream_fields(obj: &Map<String, Value>) -> Result<(bool, bool), GatewayError> {
    let stream = stream_flag(obj)?;
    let include_usage = match field(obj, "stream_options") {
        None => false,
        Some(Value::Object(o)) => match field(o, "include_usage") {
            None => false,
            Some(Value::Bool(b)) => *b,
            Some(other) => return Err(invalid_type("stream_options.include_usage", "a boolean", other)),
        },
        Some(other) => return Err(invalid_type("stream_options", "an object", other)),
    };
    Ok((stream, include_usage))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn run(endpoint: Endpoint, v: &Value) -> Result<(Option<MaxTokens>, bool, bool, String), GatewayError> {
        let body = serde_json::to_vec(v).unwrap();
        let parsed = parse_json(&body)?;
        let r = validate(endpoint, &body, &parsed)?;
        Ok((r.max_tokens, r.stream, r.include_usage, format!("{:?}", r.prompt)))
    }

    fn chat_err(v: Value) -> GatewayError {
        run(Endpoint::ChatCompletions, &v).unwrap_err()
    }

    fn param(e: &GatewayError) -> Option<String> {
        e.parts().3.map(str::to_string)
    }

    #[test]
    fn classify_paths_and_methods() {
        assert_eq!(classify("POST", "/v1/chat/completions"), Ok(Endpoint::ChatCompletions));
        assert_eq!(classify("POST", "/v1/completions?x=1"), Ok(Endpoint::Completions));
        assert_eq!(classify("POST", "/v1/embeddings"), Ok(Endpoint::Embeddings));
        assert_eq!(classify("GET", "/v1/models"), Ok(Endpoint::Models));
        assert_eq!(
            classify("GET", "/v1/chat/completions"),
            Err(GatewayError::MethodNotAllowed {
                method: "GET".into(),
                path: "/v1/chat/completions".into(),
                allow: "POST"
            })
        );
        assert_eq!(
            classify("POST", "/v1/models"),
            Err(GatewayError::MethodNotAllowed {
                method: "POST".into(),
                path: "/v1/models".into(),
                allow: "GET"
            })
        );
        let e = classify("POST", "/v1/foo?key=secret").unwrap_err();
        assert_eq!(e, GatewayError::NotFound { method: "POST".into(), path: "/v1/foo".into() });
        assert_eq!(e.to_string(), "Invalid URL (POST /v1/foo)");
        assert_eq!(e.parts(), (404, "invalid_request_error", "not_found", None));
        assert!(classify("POST", "/v1/chat/completions/").is_err());
        assert!(classify("POST", "/V1/models").is_err());
    }

    #[test]
    fn invalid_json() {
        let e = parse_json(b"").unwrap_err();
        assert_eq!(e.to_string(), "We could not parse the JSON body of your request: the body is empty.");
        assert_eq!(e.parts(), (400, "invalid_request_error", "invalid_json", None));
        let e = parse_json(b"{\"model\":").unwrap_err();
        assert_eq!(
            e.to_string(),
            "We could not parse the JSON body of your request: EOF while parsing a value at line 1 column 9."
        );
        let e = parse_json(b"[1,2]").unwrap_err();
        assert_eq!(
            e.to_string(),
            "We could not parse the JSON body of your request: expected a JSON object, but got an array."
        );
    }

    #[test]
    fn duplicate_key() {
        let body = br#"{"model":"qwen","messages":[{"role":"user","content":"hi"}],"model":"llama"}"#;
        let v = parse_json(body).unwrap();
        let e = validate(Endpoint::ChatCompletions, body, &v).unwrap_err();
        assert_eq!(e, GatewayError::DuplicateParameter { param: "model".into() });
        assert_eq!(e.parts(), (400, "invalid_request_error", "duplicate_parameter", Some("model")));
    }

    #[test]
    fn model_errors() {
        let e = chat_err(json!({"messages": [{"role": "user", "content": "hi"}]}));
        assert_eq!(e.to_string(), "Missing required parameter: 'model'.");
        assert_eq!(e.parts(), (400, "invalid_request_error", "missing_required_parameter", Some("model")));
        let e = chat_err(json!({"model": null, "messages": []}));
        assert_eq!(param(&e).as_deref(), Some("model"));
        let e = chat_err(json!({"model": "", "messages": []}));
        assert_eq!(param(&e).as_deref(), Some("model"));
        let e = chat_err(json!({"model": 5, "messages": []}));
        assert_eq!(e.to_string(), "Invalid type for 'model': expected a string, but got an integer instead.");
        assert_eq!(e.parts().2, "invalid_type");
    }

    #[test]
    fn messages_errors() {
        let e = chat_err(json!({"model": "m"}));
        assert_eq!(e.to_string(), "Missing required parameter: 'messages'.");
        let e = chat_err(json!({"model": "m", "messages": []}));
        assert_eq!(
            e.to_string(),
            "Invalid 'messages': expected an array with at least 1 element, but got an empty array."
        );
        assert_eq!(e.parts(), (400, "invalid_request_error", "invalid_value", Some("messages")));
        let e = chat_err(json!({"model": "m", "messages": "hi"}));
        assert_eq!(
            e.to_string(),
            "Invalid type for 'messages': expected an array, but got a string instead."
        );
        let e = chat_err(json!({"model": "m", "messages": ["hi"]}));
        assert_eq!(param(&e).as_deref(), Some("messages[0]"));
        let e =
            chat_err(json!({"model": "m", "messages": [{"role": "user", "content": "a"}, {"content": "b"}]}));
        assert_eq!(e.to_string(), "Missing required parameter: 'messages[1].role'.");
        let e = chat_err(json!({"model": "m", "messages": [{"role": 1, "content": "b"}]}));
        assert_eq!(param(&e).as_deref(), Some("messages[0].role"));
        let e = chat_err(json!({"model": "m", "messages": [{"role": "user", "content": 5}]}));
        assert_eq!(
            e.to_string(),
            "Invalid type for 'messages[0].content': expected a string or an array, but got an integer instead."
        );
        let e = chat_err(
            json!({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]}),
        );
        assert_eq!(param(&e).as_deref(), Some("messages[0].content[0].text"));
        let e =
            chat_err(json!({"model": "m", "messages": [{"role": "user", "content": [{"type": "text"}]}]}));
        assert_eq!(param(&e).as_deref(), Some("messages[0].content[0].text"));
        let e = chat_err(json!({"model": "m", "messages": [{"role": "user", "content": ["x"]}]}));
        assert_eq!(param(&e).as_deref(), Some("messages[0].content[0]"));
    }

    #[test]
    fn chat_prompt_extraction() {
        let v = json!({"model": "m", "messages": [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": null, "tool_calls": []}
        ]});
        let body = serde_json::to_vec(&v).unwrap();
        let parsed = parse_json(&body).unwrap();
        let r = validate(Endpoint::ChatCompletions, &body, &parsed).unwrap();
        assert_eq!(
            r.prompt,
            Prompt::Chat(vec![
                ChatMessage { role: "system", texts: vec!["sys"] },
                ChatMessage { role: "user", texts: vec!["a", "b"] },
                ChatMessage { role: "assistant", texts: vec![] },
            ])
        );
        assert_eq!(r.model, "m");
        assert_eq!(r.max_tokens, None);
        assert!(!r.stream);
    }

    #[test]
    fn max_tokens_rules() {
        let base = |extra: Value| {
            let mut v = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
            for (k, x) in extra.as_object().unwrap() {
                v[k] = x.clone();
            }
            v
        };
        let (mt, ..) = run(Endpoint::ChatCompletions, &base(json!({"max_tokens": 10}))).unwrap();
        assert_eq!(mt, Some(MaxTokens { value: 10, param: "max_tokens" }));
        let (mt, ..) =
            run(Endpoint::ChatCompletions, &base(json!({"max_tokens": 10, "max_completion_tokens": 20})))
                .unwrap();
        assert_eq!(mt, Some(MaxTokens { value: 20, param: "max_completion_tokens" }));
        let (mt, ..) = run(Endpoint::ChatCompletions, &base(json!({"max_tokens": null}))).unwrap();
        assert_eq!(mt, None);

        let e = chat_err(base(json!({"max_tokens": "10"})));
        assert_eq!(
            e.to_string(),
            "Invalid type for 'max_tokens': expected an integer, but got a string instead."
        );
        assert_eq!(e.parts(), (400, "invalid_request_error", "invalid_type", Some("max_tokens")));
        let e = chat_err(base(json!({"max_tokens": 1.5})));
        assert_eq!(
            e.to_string(),
            "Invalid type for 'max_tokens': expected an integer, but got a decimal number instead."
        );
        let e = chat_err(base(json!({"max_tokens": -3})));
        assert_eq!(
            e.to_string(),
            "Invalid 'max_tokens': integer below minimum value. Expected a value >= 1, but got -3 instead."
        );
        assert_eq!(e.parts(), (400, "invalid_request_error", "invalid_value", Some("max_tokens")));
        let e = chat_err(base(json!({"max_tokens": 0})));
        assert_eq!(param(&e).as_deref(), Some("max_tokens"));
        let e = chat_err(base(json!({"max_completion_tokens": true})));
        assert_eq!(param(&e).as_deref(), Some("max_completion_tokens"));
    }

    /// Issue 17, item 4: `n` and (completions) `best_of` as vLLM validates them.
    #[test]
    fn n_and_best_of_rules() {
        let choices = |endpoint: Endpoint, extra: Value| {
            let mut v = match endpoint {
                Endpoint::Completions => json!({"model": "m", "prompt": "hi"}),
                _ => json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
            };
            for (k, x) in extra.as_object().unwrap() {
                v[k] = x.clone();
            }
            let body = serde_json::to_vec(&v).unwrap();
            let parsed = parse_json(&body).unwrap();
            validate(endpoint, &body, &parsed).map(|r| r.choices)
        };
        let (chat, comp) = (Endpoint::ChatCompletions, Endpoint::Completions);
        assert_eq!(choices(chat, json!({})), Ok(1));
        assert_eq!(choices(chat, json!({"n": null})), Ok(1));
        assert_eq!(choices(chat, json!({"n": 3})), Ok(3));
        assert_eq!(choices(comp, json!({"n": 3})), Ok(3));
        assert_eq!(choices(comp, json!({"best_of": 5})), Ok(5));
        assert_eq!(choices(comp, json!({"n": 2, "best_of": 5})), Ok(5));
        assert_eq!(choices(comp, json!({"n": 4, "best_of": 4})), Ok(4));
        // vLLM's chat API has no best_of: passed on untouched, not counted.
        assert_eq!(choices(chat, json!({"n": 2, "best_of": 1})), Ok(2));
        assert_eq!(choices(Endpoint::Embeddings, json!({"input": "x", "n": "many"})), Ok(1));
        assert_eq!(choices(chat, json!({"n": u64::MAX})), Ok(u64::MAX));

        let e = choices(chat, json!({"n": 0})).unwrap_err();
        assert_eq!(
            e.to_string(),
            "Invalid 'n': integer below minimum value. Expected a value >= 1, but got 0 instead."
        );
        assert_eq!(e.parts(), (400, "invalid_request_error", "invalid_value", Some("n")));
        let e = choices(comp, json!({"n": -2})).unwrap_err();
        assert_eq!(e.parts(), (400, "invalid_request_error", "invalid_value", Some("n")));
        let e = choices(chat, json!({"n": "3"})).unwrap_err();
        assert_eq!(e.to_string(), "Invalid type for 'n': expected an integer, but got a string instead.");
        assert_eq!(e.parts(), (400, "invalid_request_error", "invalid_type", Some("n")));
        let e = choices(chat, json!({"n": 1.5})).unwrap_err();
        assert_eq!(e.parts().3, Some("n"));
        let e = choices(comp, json!({"best_of": 0})).unwrap_err();
        assert_eq!(e.parts(), (400, "invalid_request_error", "invalid_value", Some("best_of")));
        let e = choices(comp, json!({"best_of": [2]})).unwrap_err();
        assert_eq!(e.parts(), (400, "invalid_request_error", "invalid_type", Some("best_of")));
        let e = choices(comp, json!({"n": 3, "best_of": 2})).unwrap_err();
        assert_eq!(
            e.to_string(),
            "Invalid 'best_of': best_of must be greater than or equal to n. Expected a value >= 3, but got 2 instead."
        );
        assert_eq!(e.parts(), (400, "invalid_request_error", "invalid_value", Some("best_of")));
    }

    #[test]
    fn stream_rules() {
        let base = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
        let with = |k: &str, x: Value| {
            let mut v = base.clone();
            v[k] = x;
            v
        };
        let (_, s, iu, _) = run(Endpoint::ChatCompletions, &with("stream", json!(true))).unwrap();
        assert!(s && !iu);
        let mut v = with("stream", json!(true));
        v["stream_options"] = json!({"include_usage": true});
        let (_, s, iu, _) = run(Endpoint::ChatCompletions, &v).unwrap();
        assert!(s && iu);
        let e = chat_err(with("stream", json!("yes")));
        assert_eq!(e.to_string(), "Invalid type for 'stream': expected a boolean, but got a string instead.");
        assert_eq!(param(&e).as_deref(), Some("stream"));
        let e = chat_err(with("stream_options", json!(true)));
        assert_eq!(param(&e).as_deref(), Some("stream_options"));
        let e = chat_err(with("stream_options", json!({"include_usage": 1})));
        assert_eq!(param(&e).as_deref(), Some("stream_options.include_usage"));
    }

    #[test]
    fn completions_prompt_forms() {
        let p = |x: Value| run(Endpoint::Completions, &json!({"model": "m", "prompt": x}));
        assert_eq!(p(json!("hello")).unwrap().3, r#"Items([Text("hello")])"#);
        assert_eq!(p(json!(["a", "b"])).unwrap().3, r#"Items([Text("a"), Text("b")])"#);
        assert_eq!(p(json!([1, 2, 3])).unwrap().3, "Items([Tokens(3)])");
        assert_eq!(p(json!([[1, 2], [3]])).unwrap().3, "Items([Tokens(2), Tokens(1)])");
        let e = run(Endpoint::Completions, &json!({"model": "m"})).unwrap_err();
        assert_eq!(e.to_string(), "Missing required parameter: 'prompt'.");
        assert_eq!(e.parts(), (400, "invalid_request_error", "missing_required_parameter", Some("prompt")));
        let e = p(json!([])).unwrap_err();
        assert_eq!(param(&e).as_deref(), Some("prompt"));
        let e = p(json!(["a", 1])).unwrap_err();
        assert_eq!(
            e.to_string(),
            "Invalid type for 'prompt': expected a string, an array of strings, or an array of token ids, but got an array instead."
        );
        let e = p(json!(5)).unwrap_err();
        assert_eq!(param(&e).as_deref(), Some("prompt"));
        let e = p(json!([-1])).unwrap_err();
        assert_eq!(param(&e).as_deref(), Some("prompt"));
        let e =
            run(Endpoint::Completions, &json!({"model": "m", "prompt": "x", "max_tokens": "a"})).unwrap_err();
        assert_eq!(param(&e).as_deref(), Some("max_tokens"));
    }

    #[test]
    fn embeddings_are_lenient() {
        let r = run(
            Endpoint::Embeddings,
            &json!({"model": "m", "input": ["a", "b"], "max_tokens": "x", "stream": 3}),
        )
        .unwrap();
        assert_eq!(r, (None, false, false, r#"Items([Text("a"), Text("b")])"#.to_string()));
        let r = run(Endpoint::Embeddings, &json!({"model": "m", "input": {"weird": 1}})).unwrap();
        assert_eq!(r.3, "Items([])");
        let e = run(Endpoint::Embeddings, &json!({"input": "x"})).unwrap_err();
        assert_eq!(param(&e).as_deref(), Some("model"));
    }

    /// Issue 15, item 5: the Responses API's body, read as vLLM builds its chat messages.
    #[test]
    fn responses_prompt_forms() {
        let r = |v: Value| run(Endpoint::Responses, &v);
        let (mt, stream, iu, p) = r(json!({"model": "m", "input": "hello", "instructions": "be brief",
            "max_output_tokens": 5, "stream": true}))
        .unwrap();
        assert_eq!(mt, Some(MaxTokens { value: 5, param: "max_output_tokens" }));
        assert!(stream && !iu, "the Responses API never asks for include_usage");
        assert_eq!(
            p,
            r#"Chat([ChatMessage { role: "system", texts: ["be brief"] }, ChatMessage { role: "user", texts: ["hello"] }])"#
        );
        // Empty or null instructions add no system message (vLLM: `if request.instructions`).
        for instructions in [json!(""), Value::Null] {
            let p = r(json!({"model": "m", "input": "x", "instructions": instructions})).unwrap().3;
            assert_eq!(p, r#"Chat([ChatMessage { role: "user", texts: ["x"] }])"#);
        }
        let items = json!([
            {"role": "user", "content": "hi"},
            {"type": "message", "role": "assistant", "content": [
                {"type": "output_text", "text": "yo", "annotations": []}, {"type": "refusal", "refusal": "no"}]},
            {"type": "function_call_output", "call_id": "c", "output": "42"},
            {"id": "ref_1"},
            {"type": "reasoning", "role": "assistant", "summary": []},
            {"role": "developer", "type": null, "content": [{"type": "input_text", "text": "a"},
                {"type": "input_image", "image_url": "u"}, {"type": "text", "text": "b"}]},
            {"role": "user", "content": null}
        ]);
        let (mt, stream, _, p) =
            r(json!({"model": "m", "input": items, "stream": null, "stream_options": 5})).unwrap();
        assert_eq!((mt, stream), (None, false));
        assert_eq!(
            p,
            r#"Chat([ChatMessage { role: "user", texts: ["hi"] }, ChatMessage { role: "assistant", texts: ["yo"] }, ChatMessage { role: "developer", texts: ["a", "b"] }, ChatMessage { role: "user", texts: [] }])"#
        );
        assert_eq!(r(json!({"model": "m", "input": []})).unwrap().3, "Chat([])");
    }

    #[test]
    fn responses_errors_name_the_param() {
        let e = |v: Value| run(Endpoint::Responses, &v).unwrap_err();
        let err = e(json!({"model": "m"}));
        assert_eq!(err.to_string(), "Missing required parameter: 'input'.");
        assert_eq!(err.parts(), (400, "invalid_request_error", "missing_required_parameter", Some("input")));
        let err = e(json!({"model": "m", "input": 5}));
        assert_eq!(
            err.to_string(),
            "Invalid type for 'input': expected a string or an array, but got an integer instead."
        );
        let cases = [
            (json!({"input": "x"}), "model"),
            (json!({"model": "m", "input": ["x"]}), "input[0]"),
            (json!({"model": "m", "input": [{"type": 5, "role": "user"}]}), "input[0].type"),
            (json!({"model": "m", "input": [{"role": 5}]}), "input[0].role"),
            (
                json!({"model": "m", "input": [{"role": "user", "content": "a"}, {"type": "message", "content": "x"}]}),
                "input[1].role",
            ),
            (json!({"model": "m", "input": [{"role": "user", "content": 5}]}), "input[0].content"),
            (json!({"model": "m", "input": [{"role": "user", "content": ["x"]}]}), "input[0].content[0]"),
            (
                json!({"model": "m", "input": [{"role": "user", "content": [{"type": "input_text"}]}]}),
                "input[0].content[0].text",
            ),
            (
                json!({"model": "m", "input": [{"role": "user", "content": [{"type": "output_text", "text": 1}]}]}),
                "input[0].content[0].text",
            ),
            (json!({"model": "m", "input": "x", "instructions": ["a"]}), "instructions"),
            (json!({"model": "m", "input": "x", "max_output_tokens": "5"}), "max_output_tokens"),
            (json!({"model": "m", "input": "x", "max_output_tokens": 0}), "max_output_tokens"),
            (json!({"model": "m", "input": "x", "max_output_tokens": 1.5}), "max_output_tokens"),
            (json!({"model": "m", "input": "x", "stream": "true"}), "stream"),
        ];
        for (body, want) in cases {
            assert_eq!(param(&e(body.clone())).as_deref(), Some(want), "{body}");
        }
        assert_eq!(
            e(json!({"model": "m", "input": "x", "max_output_tokens": -1})).parts().2,
            "invalid_value"
        );
        assert_eq!(e(json!({"model": "m", "input": "x", "stream": 1})).parts().2, "invalid_type");
    }

    #[test]
    fn responses_path_and_meter_api() {
        assert_eq!(classify("POST", "/v1/responses"), Ok(Endpoint::Responses));
        assert_eq!(classify("POST", "/v1/responses?x=1"), Ok(Endpoint::Responses));
        assert_eq!(classify("GET", "/v1/responses").unwrap_err().parts().0, 405);
        assert!(classify("POST", "/v1/responses/resp_1").is_err());
        // The sidecar's metering stream picks the API from the path: it must agree.
        for path in
            ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings", "/v1/models"]
        {
            let method = if path == "/v1/models" { "GET" } else { "POST" };
            let endpoint = classify(method, path).unwrap();
            assert_eq!(endpoint.meter_api(), gateway_meter::Api::for_path(path), "{path}");
        }
        assert!(!Endpoint::Responses.stream_usage_needs_asking());
        assert!(
            Endpoint::ChatCompletions.stream_usage_needs_asking()
                && Endpoint::Completions.stream_usage_needs_asking()
        );
    }
}
