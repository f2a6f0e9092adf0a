//! The Responses API's answers (`POST /v1/responses`), as vLLM gives them for a model without
//! tools or a reasoning parser.
//!
//! Sources: vLLM's `vllm/entrypoints/openai/serving_responses.py` (`responses_full_generator`,
//! `_process_simple_streaming_events`, `responses_stream_generator`), its `ResponsesResponse` and
//! `ResponseUsage` models (`vllm/entrypoints/openai/protocol.py`, later
//! `vllm/entrypoints/openai/responses/protocol.py`) and `_convert_stream_to_sse_events` of its API
//! server; the event types are the `openai` package's (`openai.types.responses`), whose fields
//! pydantic serialises in their declared (alphabetical) order, so `type` comes last.
//!
//! * Non-streamed: one `response` object ([`response_body`]): `status` `"completed"` (vLLM's
//!   catch-all for models without Harmony, even when `max_output_tokens` stopped it), one
//!   assistant `message` item whose `output_text` part holds the text, and `usage`
//!   `{"input_tokens", "input_tokens_details": {"cached_tokens"}, "output_tokens",
//!   "output_tokens_details": {"reasoning_tokens"}, "total_tokens"}` (the prompt and completion
//!   tokens of the chat formula). `cached_tokens` is always 0 here: vLLM reports the prompt tokens
//!   its prefix cache served, which the sim (either engine) does not track per request.
//! * Streamed ([`ResponseEvents`]): `event: <type>\ndata: <json>\n\n` per event, numbered by
//!   `sequence_number`: `response.created` and `response.in_progress` (the response so far, no
//!   usage), `response.output_item.added`, `response.content_part.added`, one
//!   `response.output_text.delta` per output token, `response.output_text.done`,
//!   `response.content_part.done`, `response.output_item.done`, then `response.completed` with
//!   the whole response and its usage. There is no `data: [DONE]`, and no `stream_options`:
//!   vLLM always ends the stream with the usage. `content_index` grows by one with each event
//!   after the part is added, as vLLM numbers it.
//!
//! The response object repeats a request's non-empty `instructions` (vLLM echoes them), so a
//! long `instructions` makes every `response.created`, `response.in_progress` and
//! `response.completed` event long: what a gateway reading the stream must not hold.

use bytes::Bytes;
use serde::Serialize;

use crate::response::{output_text, ResponseMeta, WORDS};
use crate::sse::{whole, EventKind, SseEvent};
use crate::tokens::OutputPlan;

#[derive(Serialize)]
struct ResponseObject<'a> {
    id: &'a str,
    created_at: u64,
    incomplete_details: Option<()>,
    instructions: Option<&'a str>,
    metadata: Option<()>,
    model: &'a str,
    object: &'static str,
    output: Vec<OutputMessage<'a>>,
    parallel_tool_calls: bool,
    temperature: f64,
    tool_choice: &'static str,
    tools: [(); 0],
    top_p: f64,
    background: bool,
    max_output_tokens: Option<u64>,
    max_tool_calls: Option<()>,
    previous_response_id: Option<()>,
    prompt: Option<()>,
    reasoning: Option<()>,
    service_tier: &'static str,
    status: &'static str,
    text: Option<()>,
    top_logprobs: u32,
    truncation: &'static str,
    usage: Option<Usage>,
    user: Option<()>,
}

#[derive(Serialize)]
struct OutputMessage<'a> {
    id: &'a str,
    content: Vec<OutputText<'a>>,
    role: &'static str,
    status: &'static str,
    #[serde(rename = "type")]
    kind: &'static str,
}

#[derive(Serialize)]
struct OutputText<'a> {
    annotations: [(); 0],
    text: &'a str,
    #[serde(rename = "type")]
    kind: &'static str,
    logprobs: Option<[(); 0]>,
}

#[derive(Serialize)]
struct Usage {
    input_tokens: u64,
    input_tokens_details: InputDetails,
    output_tokens: u64,
    output_tokens_details: OutputDetails,
    total_tokens: u64,
}

#[derive(Serialize)]
struct InputDetails {
    cached_tokens: u64,
}

#[derive(Serialize)]
struct OutputDetails {
    reasoning_tokens: u64,
}

impl Usage {
    fn of(plan: &OutputPlan) -> Self {
        let output = plan.total_completion_tokens();
        Self {
            input_tokens: plan.prompt_tokens,
            input_tokens_details: InputDetails { cached_tokens: 0 },
            output_tokens: output,
            output_tokens_details: OutputDetails { reasoning_tokens: 0 },
            total_tokens: plan.prompt_tokens.saturating_add(output),
        }
    }
}

/// The output message's id: `msg_` and the response id's hex digits.
fn item_id(meta: &ResponseMeta<'_>) -> String {
    format!("msg_{}", meta.id.trim_start_matches("resp_"))
}

fn text_part(text: &str, logprobs: Option<[(); 0]>) -> OutputText<'_> {
    OutputText { annotations: [], text, kind: "output_text", logprobs }
}

/// The response object: in progress (no output, no usage) or completed (the text and usage).
fn response_object<'a>(
    meta: &'a ResponseMeta<'a>,
    item: &'a str,
    text: Option<&'a str>,
    plan: &OutputPlan,
) -> ResponseObject<'a> {
    let output = match text {
        Some(text) => vec![OutputMessage {
            id: item,
            content: vec![text_part(text, None)],
            role: "assistant",
            status: "completed",
            kind: "message",
        }],
        None => Vec::new(),
    };
    ResponseObject {
        id: &meta.id,
        created_at: meta.created,
        incomplete_details: None,
        instructions: meta.instructions,
        metadata: None,
        model: meta.model,
        object: "response",
        output,
        parallel_tool_calls: true,
        temperature: 1.0,
        tool_choice: "auto",
        tools: [],
        top_p: 1.0,
        background: false,
        max_output_tokens: meta.max_output_tokens,
        max_tool_calls: None,
        previous_response_id: None,
        prompt: None,
        reasoning: None,
        service_tier: "auto",
        status: if text.is_some() { "completed" } else { "in_progress" },
        text: None,
        top_logprobs: 0,
        truncation: "disabled",
        usage: text.is_some().then(|| Usage::of(plan)),
        user: None,
    }
}

/// The non-streamed body: the completed `response` object with `plan.completion_tokens` words
/// of output and its usage.
pub fn response_body(meta: &ResponseMeta<'_>, plan: &OutputPlan) -> Bytes {
    let text = output_text(plan.completion_tokens);
    let item = item_id(meta);
    Bytes::from(serde_json::to_vec(&response_object(meta, &item, Some(&text), plan)).unwrap_or_default())
}

/// One event on the wire: `event: <type>\ndata: <json>\n\n`, its `sequence_number` and `type`
/// appended after `fields` (the event's other members, in order, as a JSON object's inside).
fn event(kind: &str, fields: &str, sequence: u64) -> Bytes {
    let sep = if fields.is_empty() { "" } else { "," };
    Bytes::from(format!(
        "event: {kind}\ndata: {{{fields}{sep}\"sequence_number\":{sequence},\"type\":\"{kind}\"}}\n\n"
    ))
}

/// `"<name>":<json>`.
fn member<T: Serialize + ?Sized>(name: &str, value: &T) -> String {
    format!("\"{name}\":{}", serde_json::to_string(value).unwrap_or_default())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    Created,
    InProgress,
    ItemAdded,
    PartAdded,
    Token(u64),
    TextDone,
    PartDone,
    ItemDone,
    Completed,
    End,
}

/// The events of one streamed response, in order (see the module docs). The fixed events are
/// serialised once, when the request is accepted; a delta event is built when it is sent.
#[derive(Debug)]
pub struct ResponseEvents {
    created: Bytes,
    in_progress: Bytes,
    item_added: Bytes,
    part_added: Bytes,
    /// `"item_id":"...","logprobs":[],"output_index":0` of every delta.
    delta_tail: String,
    text_done: Bytes,
    part_done: Bytes,
    item_done: Bytes,
    completed: Bytes,
    tokens: u64,
    step: Step,
}

impl ResponseEvents {
    /// The events for `meta` and `plan` (`plan.completion_tokens` deltas, at least 1).
    pub fn new(meta: &ResponseMeta<'_>, plan: &OutputPlan) -> Self {
        let tokens = plan.completion_tokens.max(1);
        let item = item_id(meta);
        let text = output_text(tokens);
        let pending = member("response", &response_object(meta, &item, None, plan));
        let in_progress_item = OutputMessage {
            id: &item,
            content: Vec::new(),
            role: "assistant",
            status: "in_progress",
            kind: "message",
        };
        let done_item = OutputMessage {
            id: &item,
            content: vec![text_part(&text, None)],
            role: "assistant",
            status: "completed",
            kind: "message",
        };
        let item_json = serde_json::to_string(&item).unwrap_or_default();
        // Sequence numbers: created 0, in_progress 1, item 2, part 3, deltas 4.., then four more.
        let after = 4 + tokens;
        // vLLM's content_index: 0 for the part added, then one more for each event after it.
        let done_index = 1 + tokens;
        Self {
            created: event("response.created", &pending, 0),
            in_progress: event("response.in_progress", &pending, 1),
            item_added: event(
                "response.output_item.added",
                &format!("{},\"output_index\":0", member("item", &in_progress_item)),
                2,
            ),
            part_added: event(
                "response.content_part.added",
                &format!(
                    "\"content_index\":0,\"item_id\":{item_json},\"output_index\":0,{}",
                    member("part", &text_part("", Some([])))
                ),
                3,
            ),
            delta_tail: format!("\"item_id\":{item_json},\"logprobs\":[],\"output_index\":0"),
            text_done: event(
                "response.output_text.done",
                &format!(
                    "\"content_index\":{done_index},\"item_id\":{item_json},\"logprobs\":[],\"output_index\":0,{}",
                    member("text", &text)
                ),
                after,
            ),
            part_done: event(
                "response.content_part.done",
                &format!(
                    "\"content_index\":{},\"item_id\":{item_json},\"output_index\":0,{}",
                    done_index + 1,
                    member("part", &text_part(&text, None))
                ),
                after + 1,
            ),
            item_done: event(
                "response.output_item.done",
                &format!("{},\"output_index\":0", member("item", &done_item)),
                after + 2,
            ),
            completed: event(
                "response.completed",
                &member("response", &response_object(meta, &item, Some(&text), plan)),
                after + 3,
            ),
            tokens,
            step: Step::Created,
        }
    }

    fn delta(&self, index: u64) -> Bytes {
        let word = WORDS.get((index % WORDS.len() as u64) as usize).copied().unwrap_or_default();
        event(
            "response.output_text.delta",
            &format!("\"content_index\":{},\"delta\":\"{word}\",{}", 1 + index, self.delta_tail),
            4 + index,
        )
    }
}

impl Iterator for ResponseEvents {
    type Item = SseEvent;

    fn next(&mut self) -> Option<SseEvent> {
        let (kind, bytes, next) = match self.step {
            Step::Created => (EventKind::Prelude, self.created.clone(), Step::InProgress),
            Step::InProgress => (EventKind::Prelude, self.in_progress.clone(), Step::ItemAdded),
            // vLLM adds the item and its part when the first token is decoded.
            Step::ItemAdded => (EventKind::Role, self.item_added.clone(), Step::PartAdded),
            Step::PartAdded => (EventKind::Role, self.part_added.clone(), Step::Token(0)),
            Step::Token(index) => {
                let next = if index.saturating_add(1) < self.tokens {
                    Step::Token(index + 1)
                } else {
                    Step::TextDone
                };
                (EventKind::Token { index }, self.delta(index), next)
            }
            Step::TextDone => (EventKind::Trailer, self.text_done.clone(), Step::PartDone),
            Step::PartDone => (EventKind::Trailer, self.part_done.clone(), Step::ItemDone),
            Step::ItemDone => (EventKind::Trailer, self.item_done.clone(), Step::Completed),
            Step::Completed => (EventKind::Done, self.completed.clone(), Step::End),
            Step::End => return None,
        };
        self.step = next;
        Some(SseEvent { kind, buf: whole(bytes) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::Endpoint;
    use crate::response::IdGen;
    use crate::tokens::FinishReason;
    use bytes::Buf;
    use serde_json::{json, Value};

    fn meta(instructions: Option<&'static str>) -> ResponseMeta<'static> {
        ResponseMeta {
            endpoint: Endpoint::Responses,
            id: IdGen::new(1).next(Endpoint::Responses),
            created: 1_700_000_000,
            model: "sim-model",
            instructions,
            max_output_tokens: Some(3),
        }
    }

    const PLAN: OutputPlan = OutputPlan {
        prompt_tokens: 10,
        completion_tokens: 3,
        finish_reason: FinishReason::Length,
        choices: 1,
    };

    #[test]
    fn the_response_object() {
        let m = meta(Some("Be brief."));
        let v: Value = serde_json::from_slice(&response_body(&m, &PLAN)).unwrap();
        assert!(m.id.starts_with("resp_") && m.id.len() == 5 + 32, "{}", m.id);
        assert_eq!(
            (v["id"].as_str(), v["object"].as_str(), v["status"].as_str()),
            (Some(m.id.as_str()), Some("response"), Some("completed"))
        );
        assert_eq!(
            (v["model"].as_str(), v["instructions"].as_str(), v["created_at"].as_u64()),
            (Some("sim-model"), Some("Be brief."), Some(1_700_000_000))
        );
        assert_eq!(v["output"][0]["type"], "message");
        assert_eq!(v["output"][0]["role"], "assistant");
        assert_eq!(
            v["output"][0]["content"][0],
            json!({"annotations": [], "text": "the quick brown ", "type": "output_text", "logprobs": null})
        );
        assert_eq!(
            v["usage"],
            json!({"input_tokens": 10, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 3,
                   "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 13})
        );
        // vLLM's field order: `usage` then `user` last.
        let text = String::from_utf8(response_body(&m, &PLAN).to_vec()).unwrap();
        assert!(
            text.starts_with(r#"{"id":"resp_"#) && text.ends_with(r#""total_tokens":13},"user":null}"#),
            "{text}"
        );
    }

    fn events(instructions: Option<&'static str>) -> Vec<(EventKind, String, Value)> {
        ResponseEvents::new(&meta(instructions), &PLAN)
            .map(|mut e| {
                let bytes = e.buf.copy_to_bytes(e.buf.remaining());
                let text = String::from_utf8(bytes.to_vec()).unwrap();
                let (head, data) = text.strip_suffix("\n\n").unwrap().split_once('\n').unwrap();
                let name = head.strip_prefix("event: ").unwrap().to_owned();
                let v: Value = serde_json::from_str(data.strip_prefix("data: ").unwrap()).unwrap();
                assert!(data.ends_with(&format!(r#""type":"{name}"}}"#)), "type last: {data}");
                assert_eq!(v["type"], name.as_str());
                (e.kind, name, v)
            })
            .collect()
    }

    #[test]
    fn the_event_stream() {
        let evs = events(None);
        let names: Vec<&str> = evs.iter().map(|e| e.1.as_str()).collect();
        assert_eq!(
            names,
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.completed"
            ]
        );
        let kinds: Vec<EventKind> = evs.iter().map(|e| e.0).collect();
        assert_eq!(
            &kinds[..5],
            [
                EventKind::Prelude,
                EventKind::Prelude,
                EventKind::Role,
                EventKind::Role,
                EventKind::Token { index: 0 }
            ]
        );
        assert_eq!(
            &kinds[7..],
            [EventKind::Trailer, EventKind::Trailer, EventKind::Trailer, EventKind::Done]
        );
        for (i, e) in evs.iter().enumerate() {
            assert_eq!(e.2["sequence_number"], i, "{}", e.1);
        }
        assert_eq!(evs[0].2["response"]["status"], "in_progress");
        assert_eq!(evs[0].2["response"]["usage"], Value::Null);
        let deltas: Vec<&Value> = evs[4..7].iter().map(|e| &e.2["delta"]).collect();
        assert_eq!(deltas, [&json!("the "), &json!("quick "), &json!("brown ")]);
        assert_eq!(evs[4].2["content_index"], 1);
        assert_eq!(evs[7].2["text"], "the quick brown ");
        let item = evs[2].2["item"]["id"].as_str().unwrap();
        assert!(evs[4..10].iter().all(|e| e.2["item_id"] == item || e.2["item"]["id"] == item));
        let done = &evs[10].2["response"];
        assert_eq!(done["status"], "completed");
        assert_eq!(done["output"][0]["content"][0]["text"], "the quick brown ");
        assert_eq!(
            (done["usage"]["input_tokens"].as_u64(), done["usage"]["output_tokens"].as_u64()),
            (Some(10), Some(3))
        );
    }

    #[test]
    fn instructions_are_echoed_in_the_response_events() {
        let evs = events(Some("Answer in \"one\" word."));
        for i in [0, 1, 10] {
            assert_eq!(evs[i].2["response"]["instructions"], "Answer in \"one\" word.");
        }
    }
}
