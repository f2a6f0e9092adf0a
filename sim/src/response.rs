//! Non-streamed response bodies (`chat.completion`, `text_completion`, the `/v1/models`
//! list), response ids and the simulated output text.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use serde::Serialize;

use crate::request::Endpoint;
use crate::tokens::OutputPlan;

/// The simulated vocabulary: output token `i` is `WORDS[i % WORDS.len()]`, one short
/// ASCII word plus a space, so the text needs no JSON escaping and a completion of `n`
/// tokens is exactly `n` words (and `n` streamed content chunks).
pub const WORDS: [&str; 8] = ["the ", "quick ", "brown ", "fox ", "jumps ", "over ", "lazy ", "dog "];

/// The output text of `tokens` tokens: the first `tokens` words of the cycled [`WORDS`].
pub fn output_text(tokens: u64) -> String {
    let n = usize::try_from(tokens).unwrap_or(usize::MAX);
    let mut text = String::with_capacity(n.saturating_mul(6));
    WORDS.iter().cycle().take(n).for_each(|w| text.push_str(w));
    text
}

/// Seconds since the Unix epoch, for the `created` fields.
pub fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// Generates response ids: `chatcmpl-` / `cmpl-` / `resp_` followed by 32 hex digits, as vLLM's
/// `chatcmpl-{uuid4 hex}`; unique within the process (a per-process nonce plus a counter).
#[derive(Debug)]
pub struct IdGen {
    nonce: u64,
    counter: AtomicU64,
}

impl IdGen {
    /// A generator whose ids differ from other processes' through `nonce`.
    pub fn new(nonce: u64) -> Self {
        Self { nonce, counter: AtomicU64::new(0) }
    }

    /// The next id for a response of `endpoint`.
    pub fn next(&self, endpoint: Endpoint) -> String {
        let n = self.counter.fetch_add(1, Ordering::Relaxed);
        let prefix = match endpoint {
            Endpoint::Chat => "chatcmpl-",
            Endpoint::Completions => "cmpl-",
            // vLLM's `resp_{random_uuid()}`.
            Endpoint::Responses => "resp_",
        };
        let tail = crate::fault::mix64(self.nonce.wrapping_add(n));
        format!("{prefix}{:016x}{tail:016x}", self.nonce)
    }
}

/// What every response and chunk of one request repeats.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResponseMeta<'a> {
    /// Endpoint the request came in on: picks `object` and the choice shape.
    pub endpoint: Endpoint,
    /// `id`, from [`IdGen`].
    pub id: String,
    /// `created`, Unix seconds.
    pub created: u64,
    /// `model`: the first served model name, as vLLM answers.
    pub model: &'a str,
    /// Responses API: the request's non-empty `instructions`, which the response object echoes.
    pub instructions: Option<&'a str>,
    /// Responses API: the request's `max_output_tokens`, which the response object echoes.
    pub max_output_tokens: Option<u64>,
}

#[derive(Serialize)]
struct Usage {
    prompt_tokens: u64,
    completion_tokens: u64,
    total_tokens: u64,
}

impl Usage {
    fn of(plan: &OutputPlan) -> Self {
        Self {
            prompt_tokens: plan.prompt_tokens,
            completion_tokens: plan.total_completion_tokens(),
            total_tokens: plan.prompt_tokens.saturating_add(plan.total_completion_tokens()),
        }
    }
}

#[derive(Serialize)]
struct Completion<'a, C> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: Vec<C>,
    usage: Usage,
}

#[derive(Serialize)]
struct ChatChoice<'a> {
    index: u32,
    message: ChatMessage<'a>,
    logprobs: Option<ChatLogprobs>,
    finish_reason: &'static str,
    stop_reason: Option<()>,
}

#[derive(Serialize)]
struct ChatMessage<'a> {
    role: &'static str,
    content: &'a str,
}

/// vLLM's chat `choices[].logprobs`: `{"content": [{"token", "logprob", "bytes", "top_logprobs":
/// [{"token", "logprob", "bytes"}]}]}`, one entry per output token.
#[derive(Serialize)]
struct ChatLogprobs {
    content: Vec<TokenLogprob>,
}

#[derive(Serialize)]
struct TokenLogprob {
    token: &'static str,
    logprob: f64,
    bytes: &'static [u8],
    top_logprobs: Vec<TopLogprob>,
}

#[derive(Serialize)]
struct TopLogprob {
    token: &'static str,
    logprob: f64,
    bytes: &'static [u8],
}

/// The simulated logprobs of `tokens` output tokens with `top` alternatives each: token `i` is
/// [`WORDS`]`[i % 8]` at logprob -0.125; its `top` alternatives are the following words, the
/// first being the token itself, at -0.125 - j. About 60 + 50 x `top` bytes of JSON per token.
fn chat_logprobs(tokens: u64, top: u32) -> ChatLogprobs {
    let word = |i: usize| WORDS.get(i % WORDS.len()).copied().unwrap_or_default();
    let n = usize::try_from(tokens).unwrap_or(usize::MAX);
    let content = (0..n)
        .map(|i| TokenLogprob {
            token: word(i),
            logprob: -0.125,
            bytes: word(i).as_bytes(),
            top_logprobs: (0..top)
                .map(|j| TopLogprob {
                    token: word(i + j as usize),
                    logprob: -0.125 - f64::from(j),
                    bytes: word(i + j as usize).as_bytes(),
                })
                .collect(),
        })
        .collect();
    ChatLogprobs { content }
}

#[derive(Serialize)]
struct TextChoice<'a> {
    index: u32,
    text: &'a str,
    logprobs: Option<()>,
    finish_reason: &'static str,
    stop_reason: Option<()>,
}

/// The non-streamed body: a `chat.completion` with `choices[i].message` or a
/// `text_completion` with `choices[i].text` (for the Responses API, the `response` object of
/// [`crate::responses::response_body`]), one choice per `plan.choices` (index `0..n`, the
/// same text each), `finish_reason` from the plan and `usage`
/// `{prompt_tokens, completion_tokens, total_tokens}` (completion tokens summed over the
/// choices, the prompt counted once, as vLLM reports them).
/// A chat request's `logprobs` (`Some(top_logprobs)`) fills each choice's `logprobs`
/// ([`chat_logprobs`]); `usage` comes last, as vLLM orders it.
pub fn completion_body(meta: &ResponseMeta<'_>, plan: &OutputPlan, logprobs: Option<u32>) -> Bytes {
    if meta.endpoint == Endpoint::Responses {
        return crate::responses::response_body(meta, plan);
    }
    let text = output_text(plan.completion_tokens);
    let finish_reason = plan.finish_reason.as_str();
    let json = match meta.endpoint {
        Endpoint::Chat | Endpoint::Responses => serde_json::to_vec(&Completion {
            id: &meta.id,
            object: "chat.completion",
            created: meta.created,
            model: meta.model,
            choices: (0..plan.choices)
                .map(|i| ChatChoice {
                    index: u32::try_from(i).unwrap_or(u32::MAX),
                    message: ChatMessage { role: "assistant", content: &text },
                    logprobs: logprobs.map(|top| chat_logprobs(plan.completion_tokens, top)),
                    finish_reason,
                    stop_reason: None,
                })
                .collect(),
            usage: Usage::of(plan),
        }),
        Endpoint::Completions => serde_json::to_vec(&Completion {
            id: &meta.id,
            object: "text_completion",
            created: meta.created,
            model: meta.model,
            choices: (0..plan.choices)
                .map(|i| TextChoice {
                    index: u32::try_from(i).unwrap_or(u32::MAX),
                    text: &text,
                    logprobs: None,
                    finish_reason,
                    stop_reason: None,
                })
                .collect(),
            usage: Usage::of(plan),
        }),
    };
    // Serialising strings and integers into a Vec cannot fail.
    Bytes::from(json.unwrap_or_default())
}

#[derive(Serialize)]
struct ModelList<'a> {
    object: &'static str,
    data: Vec<ModelCard<'a>>,
}

#[derive(Serialize)]
struct ModelCard<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    owned_by: &'static str,
    root: &'a str,
    parent: Option<()>,
    max_model_len: u32,
}

/// The `GET /v1/models` body, OpenAI's list shape with vLLM's model cards:
/// `{"object":"list","data":[{"id","object":"model","created","owned_by":"vllm","root","parent":null,"max_model_len"}]}`,
/// one card per served name, `root` being the first name (the "model path").
pub fn models_body(names: &[String], max_model_len: u32, created: u64) -> Bytes {
    let root = names.first().map_or("", String::as_str);
    let list = ModelList {
        object: "list",
        data: names
            .iter()
            .map(|id| ModelCard {
                id,
                object: "model",
                created,
                owned_by: "vllm",
                root,
                parent: None,
                max_model_len,
            })
            .collect(),
    };
    Bytes::from(serde_json::to_vec(&list).unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokens::FinishReason;
    use serde_json::Value;

    fn meta(endpoint: Endpoint) -> ResponseMeta<'static> {
        ResponseMeta {
            endpoint,
            id: IdGen::new(1).next(endpoint),
            created: 1_700_000_000,
            model: "sim-model",
            instructions: None,
            max_output_tokens: None,
        }
    }

    const PLAN: OutputPlan = OutputPlan {
        prompt_tokens: 10,
        completion_tokens: 3,
        finish_reason: FinishReason::Length,
        choices: 1,
    };

    #[test]
    fn output_text_cycles_words() {
        assert_eq!(output_text(3), "the quick brown ");
        assert_eq!(output_text(9), "the quick brown fox jumps over lazy dog the ");
        assert_eq!(output_text(0), "");
    }

    #[test]
    fn ids_are_unique_and_prefixed() {
        let ids = IdGen::new(7);
        let a = ids.next(Endpoint::Chat);
        let b = ids.next(Endpoint::Chat);
        assert_ne!(a, b);
        assert!(a.starts_with("chatcmpl-") && a.len() == 9 + 32, "{a}");
        assert!(ids.next(Endpoint::Completions).starts_with("cmpl-"));
    }

    #[test]
    fn chat_completion_shape() {
        let m = meta(Endpoint::Chat);
        let v: Value = serde_json::from_slice(&completion_body(&m, &PLAN, None)).unwrap();
        assert_eq!(v["id"], m.id.as_str());
        assert_eq!(v["object"], "chat.completion");
        assert_eq!(v["created"], 1_700_000_000);
        assert_eq!(v["model"], "sim-model");
        assert_eq!(v["choices"][0]["index"], 0);
        assert_eq!(v["choices"][0]["message"]["role"], "assistant");
        assert_eq!(v["choices"][0]["message"]["content"], "the quick brown ");
        assert_eq!(v["choices"][0]["logprobs"], Value::Null);
        assert_eq!(v["choices"][0]["finish_reason"], "length");
        assert_eq!(
            v["usage"],
            serde_json::json!({"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13})
        );
    }

    #[test]
    fn n_choices_sum_their_completion_tokens() {
        let plan = OutputPlan { choices: 3, ..PLAN };
        for endpoint in [Endpoint::Chat, Endpoint::Completions] {
            let v: Value = serde_json::from_slice(&completion_body(&meta(endpoint), &plan, None)).unwrap();
            let choices = v["choices"].as_array().unwrap();
            assert_eq!(choices.len(), 3);
            for (i, c) in choices.iter().enumerate() {
                assert_eq!(c["index"], i);
                assert_eq!(c["finish_reason"], "length");
                let text = if endpoint == Endpoint::Chat { &c["message"]["content"] } else { &c["text"] };
                assert_eq!(text, "the quick brown ");
            }
            assert_eq!(
                v["usage"],
                serde_json::json!({"prompt_tokens": 10, "completion_tokens": 9, "total_tokens": 19})
            );
        }
    }

    #[test]
    fn chat_logprobs_shape() {
        let body = completion_body(&meta(Endpoint::Chat), &PLAN, Some(2));
        let v: Value = serde_json::from_slice(&body).unwrap();
        let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
        assert_eq!(content.len(), 3);
        assert_eq!(
            content[1],
            serde_json::json!({"token": "quick ", "logprob": -0.125, "bytes": [113, 117, 105, 99, 107, 32],
                "top_logprobs": [{"token": "quick ", "logprob": -0.125, "bytes": [113, 117, 105, 99, 107, 32]},
                                 {"token": "brown ", "logprob": -1.125, "bytes": [98, 114, 111, 119, 110, 32]}]})
        );
        let no_top: Value =
            serde_json::from_slice(&completion_body(&meta(Endpoint::Chat), &PLAN, Some(0))).unwrap();
        assert_eq!(no_top["choices"][0]["logprobs"]["content"][0]["top_logprobs"], serde_json::json!([]));
        // Usage stays last, where vLLM puts it.
        assert!(std::str::from_utf8(&body)
            .unwrap()
            .ends_with(r#""usage":{"prompt_tokens":10,"completion_tokens":3,"total_tokens":13}}"#));
    }

    #[test]
    fn text_completion_shape() {
        let v: Value =
            serde_json::from_slice(&completion_body(&meta(Endpoint::Completions), &PLAN, Some(2))).unwrap();
        assert_eq!(v["choices"][0]["logprobs"], Value::Null);
        assert_eq!(v["object"], "text_completion");
        assert_eq!(v["choices"][0]["text"], "the quick brown ");
        assert_eq!(v["usage"]["total_tokens"], 13);
    }

    #[test]
    fn models_list_shape() {
        let names = vec!["a".to_owned(), "b".to_owned()];
        let v: Value = serde_json::from_slice(&models_body(&names, 4096, 5)).unwrap();
        assert_eq!(v["object"], "list");
        assert_eq!(v["data"][1]["id"], "b");
        assert_eq!(v["data"][1]["object"], "model");
        assert_eq!(v["data"][1]["owned_by"], "vllm");
        assert_eq!(v["data"][1]["max_model_len"], 4096);
        assert_eq!(v["data"][1]["root"], "a");
    }
}
