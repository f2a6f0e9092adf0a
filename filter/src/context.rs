//! Context-length check without a tokenizer, and the prompt-token estimate sent to the sidecar.
//!
//! In a byte-level BPE vocabulary every token decodes to between 1 and `max_token_bytes` bytes,
//! so a text of `b` bytes has between `ceil(b / max_token_bytes)` and `b` tokens. The check
//! rejects a request only when the *lower* bound proves it cannot fit, applying vLLM's rule
//! (`vllm/entrypoints/openai/serving_engine.py`, input validation):
//!
//! * with `max_tokens` set: reject when `prompt_tokens + max_tokens > max_model_len`;
//! * without: reject when `prompt_tokens >= max_model_len`.
//!
//! Because the real prompt has at least as many tokens as the lower bound, this never rejects a
//! request vLLM would accept (given a correct `max_token_bytes`).
//!
//! The other side is an upper bound, [`prompt_upper`]: a token stands for at least one byte of
//! the text the tokenizer sees, so a prompt has at most as many tokens as bytes of its rendered
//! template (the messages' roles and text plus the model's configured `template_overhead_bytes`;
//! with NFC normalization, 3 bytes per non-ASCII byte, NFC's (and NFD's) largest growth), plus
//! [`UPPER_BOUND_SLACK_TOKENS`]. When it fits ([`fits`]), the request is accepted without
//! counting. Between the bounds, only an exact count decides: the filter never tokenizes (no
//! vocabulary in the VM, no worker-thread stall) and marks the request for the sidecar's exact
//! check (`x-gateway-context-check: exact`) when the model has `exact_count`, else lets vLLM
//! decide.

use serde_json::Value;

use crate::config::{Model, TemplateOverhead};
use crate::error::GatewayError;
use crate::request::{ChatMessage, MaxTokens, Prompt, PromptItem};

/// Where a token count comes from; sent as `x-gateway-prompt-tokens-source`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CountSource {
    /// Byte-bound estimate (`estimate`).
    Estimate,
    /// Exact count: a tokenizer, or token ids sent by the client (`exact`).
    Exact,
}

impl CountSource {
    /// The header value: `estimate` or `exact`.
    pub fn as_str(self) -> &'static str {
        match self {
            CountSource::Estimate => "estimate",
            CountSource::Exact => "exact",
        }
    }
}

/// Token bounds of one prompt. Invariant: `lower <= estimate <= upper`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenCount {
    /// Proven minimum number of tokens.
    pub lower: u64,
    /// Maximum number of tokens of the counted text (template tokens not included).
    pub upper: u64,
    /// Best guess, used for the sidecar's token-per-minute reservation.
    pub estimate: u64,
    /// How the numbers were obtained.
    pub source: CountSource,
}

impl TokenCount {
    /// An exact count of `n` tokens.
    pub fn exact(n: u64) -> Self {
        TokenCount { lower: n, upper: n, estimate: n, source: CountSource::Exact }
    }

    /// Bounds for `bytes` bytes of text: lower `ceil(bytes / max_token_bytes)`, upper `bytes`,
    /// estimate `clamp(ceil(bytes / 4), lower, upper)`. `max_token_bytes` of 0 is treated as 1.
    pub fn from_bytes(bytes: u64, max_token_bytes: u64) -> Self {
        let lower = bytes.div_ceil(max_token_bytes.max(1));
        let upper = bytes;
        let estimate = bytes.div_ceil(4).clamp(lower, upper);
        TokenCount { lower, upper, estimate, source: CountSource::Estimate }
    }
}

/// Counts prompt tokens for one model. Implementations must never overstate `lower`.
pub trait TokenCounter {
    /// Bounds for a chat prompt (`messages`, rendered by the model's chat template).
    fn count_chat(&self, messages: &[ChatMessage<'_>]) -> TokenCount;
    /// Bounds for one text prompt (completions `prompt`, embeddings `input`), tokenized as is.
    fn count_text(&self, text: &str) -> TokenCount;
}

/// The tokenizer-free counter: byte bounds with the model's `max_token_bytes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ByteBoundCounter {
    /// Longest token of the vocabulary, in bytes of decoded text.
    pub max_token_bytes: u64,
}

impl ByteBoundCounter {
    /// The counter for `model`.
    pub fn for_model(model: &Model) -> Self {
        ByteBoundCounter { max_token_bytes: model.max_token_bytes }
    }
}

impl TokenCounter for ByteBoundCounter {
    fn count_chat(&self, messages: &[ChatMessage<'_>]) -> TokenCount {
        TokenCount::from_bytes(chat_text_bytes(messages), self.max_token_bytes)
    }

    fn count_text(&self, text: &str) -> TokenCount {
        TokenCount::from_bytes(text.len() as u64, self.max_token_bytes)
    }
}

/// Bytes of chat text that certainly reach the tokenizer: for every message, its `role` plus each
/// text part with surrounding whitespace trimmed (templates such as Llama 3's `| trim` it) and,
/// for `assistant` messages, only what follows the last `</think>` (templates such as Qwen3's drop
/// earlier reasoning). Every message also adds template tokens that are not counted, which keeps
/// this a lower bound even for templates that rename roles.
pub fn chat_text_bytes(messages: &[ChatMessage<'_>]) -> u64 {
    messages
        .iter()
        .map(|m| {
            let texts: u64 = m
                .texts
                .iter()
                .map(|t| {
                    let t = if m.role == "assistant" { t.rsplit("</think>").next().unwrap_or(t) } else { t };
                    t.trim().len() as u64
                })
                .sum();
            m.role.len() as u64 + texts
        })
        .sum()
}

/// Tokens the upper bound allows beyond the bytes of the rendered text: the ones that stand for no
/// byte of it (a BOS added by the tokenizer's post-processor, SentencePiece's dummy-prefix `▁`).
pub const UPPER_BOUND_SLACK_TOKENS: u64 = 2;

/// Most tokens `text` can become: its bytes, or with NFC normalization its ASCII bytes plus three
/// times the others (no code point's NFD form is longer than 3x its UTF-8 bytes, composition
/// only shortens, and ASCII never changes).
pub fn text_upper(text: &str, nfc: bool) -> u64 {
    let bytes = text.len() as u64;
    if !nfc {
        return bytes;
    }
    bytes.saturating_add(non_ascii_bytes(text.as_bytes()).saturating_mul(2))
}

/// Bytes >= 0x80, counted 8 at a time (this runs on Envoy's worker threads).
fn non_ascii_bytes(s: &[u8]) -> u64 {
    let chunks = s.chunks_exact(8);
    let tail = chunks.remainder().iter().filter(|b| !b.is_ascii()).count() as u64;
    chunks.fold(tail, |n, chunk| {
        let word = <[u8; 8]>::try_from(chunk).map_or(0, u64::from_le_bytes);
        n + u64::from((word & 0x8080_8080_8080_8080).count_ones())
    })
}

/// Whether a chat request renders only what [`chat_upper`] counts: top-level `tools`,
/// `documents`, `chat_template`, `chat_template_kwargs` absent or null,
/// `continue_final_message` and `add_special_tokens` not true, and every message made of `role`
/// and `content` only (a string, null, or `{"type": "text"}` parts).
pub fn chat_is_plain(body: &Value) -> bool {
    let Some(obj) = body.as_object() else { return false };
    let set = |k: &str| obj.get(k).is_some_and(|v| !v.is_null());
    let on = |k: &str| obj.get(k).and_then(Value::as_bool) == Some(true);
    if ["tools", "documents", "chat_template", "chat_template_kwargs"].iter().any(|k| set(k))
        || on("continue_final_message")
        || on("add_special_tokens")
    {
        return false;
    }
    let Some(messages) = obj.get("messages").and_then(Value::as_array) else { return false };
    messages.iter().all(|m| {
        m.as_object().is_some_and(|m| {
            m.keys().all(|k| k == "role" || k == "content")
                && match m.get("content") {
                    None | Some(Value::Null | Value::String(_)) => true,
                    Some(Value::Array(parts)) => {
                        parts.iter().all(|p| p.get("type").and_then(Value::as_str) == Some("text"))
                    }
                    Some(_) => false,
                }
        })
    })
}

/// Upper bound on the tokens of a plain chat prompt (see [`chat_is_plain`]): every message's role
/// and text (parts joined with a newline, as vLLM joins them) and `per_message` bytes, plus
/// `fixed` bytes, plus [`UPPER_BOUND_SLACK_TOKENS`].
pub fn chat_upper(messages: &[ChatMessage<'_>], overhead: TemplateOverhead, nfc: bool) -> u64 {
    let per_messages = messages.iter().fold(0u64, |acc, m| {
        let texts = m.texts.iter().fold(0u64, |a, t| a.saturating_add(text_upper(t, nfc)));
        let joins = m.texts.len().saturating_sub(1) as u64;
        acc.saturating_add(text_upper(m.role, nfc))
            .saturating_add(texts)
            .saturating_add(joins)
            .saturating_add(overhead.per_message)
    });
    per_messages.saturating_add(overhead.fixed).saturating_add(UPPER_BOUND_SLACK_TOKENS)
}

/// Upper bound on the largest prompt of a request, `None` when there is none: a chat prompt that
/// is not plain or whose model has no `template_overhead_bytes`. Completions prompts: their bytes
/// (NFC-adjusted) plus [`UPPER_BOUND_SLACK_TOKENS`]; token ids exactly.
pub fn prompt_upper(model: &Model, prompt: &Prompt<'_>, body: &Value) -> Option<u64> {
    upper_with(model, prompt, body, model.nfc)
}

fn upper_with(model: &Model, prompt: &Prompt<'_>, body: &Value, nfc: bool) -> Option<u64> {
    match prompt {
        Prompt::Chat(messages) => {
            let overhead = model.template_overhead?;
            chat_is_plain(body).then(|| chat_upper(messages, overhead, nfc))
        }
        Prompt::Items(items) => items
            .iter()
            .map(|item| match item {
                PromptItem::Text(t) => text_upper(t, nfc).saturating_add(UPPER_BOUND_SLACK_TOKENS),
                PromptItem::Tokens(n) => *n,
            })
            .max(),
    }
}

/// Whether the upper bound proves the request fits vLLM's rule. The NFC allowance (a scan for
/// non-ASCII bytes) is only computed when the plain byte bound fits, which keeps that scan below
/// `max_model_len` bytes.
pub fn fits_by_upper_bound(
    model: &Model,
    prompt: &Prompt<'_>,
    body: &Value,
    max_tokens: Option<MaxTokens>,
) -> bool {
    let fits_with =
        |nfc| upper_with(model, prompt, body, nfc).is_some_and(|u| fits(model.max_model_len, u, max_tokens));
    fits_with(false) && (!model.nfc || fits_with(true))
}

/// vLLM's rule for a prompt of `prompt_tokens`: `prompt + max_tokens <= max_model_len`, or
/// without max tokens `prompt < max_model_len`.
pub fn fits(max_model_len: u64, prompt_tokens: u64, max_tokens: Option<MaxTokens>) -> bool {
    match max_tokens {
        Some(mt) => prompt_tokens.saturating_add(mt.value) <= max_model_len,
        None => prompt_tokens < max_model_len,
    }
}

/// Token counts of a whole request (all prompts of a batch).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PromptCounts {
    /// Largest per-prompt lower bound (vLLM checks each prompt of a batch separately).
    pub max_lower: u64,
    /// Largest per-prompt estimate.
    pub max_estimate: u64,
    /// Sum of the estimates of all prompts; sent as `x-gateway-prompt-tokens`.
    pub total_estimate: u64,
    /// `Exact` only when every prompt was counted exactly (and there is at least one).
    pub source: CountSource,
}

/// Counts every prompt of `prompt` with `counter`; token-id prompts are counted exactly.
pub fn count_prompt(counter: &dyn TokenCounter, prompt: &Prompt<'_>) -> PromptCounts {
    let counts: Vec<TokenCount> = match prompt {
        Prompt::Chat(messages) => vec![counter.count_chat(messages)],
        Prompt::Items(items) => items
            .iter()
            .map(|item| match item {
                PromptItem::Text(t) => counter.count_text(t),
                PromptItem::Tokens(n) => TokenCount::exact(*n),
            })
            .collect(),
    };
    let all_exact = !counts.is_empty() && counts.iter().all(|c| c.source == CountSource::Exact);
    PromptCounts {
        max_lower: counts.iter().map(|c| c.lower).max().unwrap_or(0),
        max_estimate: counts.iter().map(|c| c.estimate).max().unwrap_or(0),
        total_estimate: counts.iter().fold(0u64, |acc, c| acc.saturating_add(c.estimate)),
        source: if all_exact { CountSource::Exact } else { CountSource::Estimate },
    }
}

/// Applies vLLM's context rule to the lower bound.
///
/// # Errors
/// [`GatewayError::MaxTokensTooLarge`] when `max_tokens` alone exceeds `max_model_len`;
/// [`GatewayError::ContextLengthExceeded`] (param `prompt_param`) when `max_lower + max_tokens >
/// max_model_len`, or, without `max_tokens`, when `max_lower >= max_model_len`.
pub fn check_context(
    max_model_len: u64,
    counts: &PromptCounts,
    max_tokens: Option<MaxTokens>,
    prompt_param: &'static str,
) -> Result<(), GatewayError> {
    let lower = counts.max_lower;
    let exceeded = match max_tokens {
        Some(mt) if mt.value > max_model_len => {
            return Err(GatewayError::MaxTokensTooLarge {
                param: mt.param,
                requested: mt.value,
                max_model_len,
            })
        }
        Some(mt) => lower.saturating_add(mt.value) > max_model_len,
        None => lower >= max_model_len,
    };
    if exceeded {
        return Err(GatewayError::ContextLengthExceeded {
            param: prompt_param,
            max_model_len,
            prompt_lower_bound: lower,
            max_tokens: max_tokens.map(|m| m.value),
        });
    }
    Ok(())
}

/// The effective completion limit sent as `x-gateway-max-tokens`: the client's value, else
/// `max_model_len - max_estimate` floored at 0 (what vLLM would allow for the largest prompt).
pub fn effective_max_tokens(max_model_len: u64, counts: &PromptCounts, max_tokens: Option<MaxTokens>) -> u64 {
    match max_tokens {
        Some(mt) => mt.value,
        None => max_model_len.saturating_sub(counts.max_estimate),
    }
}

/// The most completion tokens a request can produce over all its choices, sent as
/// `x-gateway-max-tokens` and reserved against the tenant's tokens per minute. vLLM generates
/// `choices` sequences (`n`, on completions `max(n, best_of)`) for each of the `prompts` of a
/// request (a completions batch; 1 otherwise) and bills `completion_tokens` summed over them. Each
/// sequence may produce `max_tokens`, or without it what the context leaves after its prompt:
/// over a batch, `prompts x max_model_len - total_estimate` (for one prompt,
/// [`effective_max_tokens`]). Saturating at `u64::MAX`, floored at 0. The context rule stays per
/// sequence ([`check_context`]).
pub fn completion_budget(
    max_model_len: u64,
    counts: &PromptCounts,
    max_tokens: Option<MaxTokens>,
    choices: u64,
    prompts: u64,
) -> u64 {
    let per_choice = match max_tokens {
        Some(mt) => mt.value.saturating_mul(prompts),
        None => max_model_len.saturating_mul(prompts).saturating_sub(counts.total_estimate),
    };
    per_choice.saturating_mul(choices)
}

/// The completion budget of a Responses API request (`x-gateway-max-tokens`, reserved with the
/// prompt): `max_output_tokens` capped at what the context leaves after the prompt estimate, else
/// what it leaves. vLLM's Responses API caps `max_output_tokens` so
/// (`ResponsesRequest.to_sampling_params`: `min(max_output_tokens, max_model_len - prompt)`); its
/// later releases refuse a request whose `max_output_tokens` does not fit, so an admitted request
/// generates at most this either way. One sequence (no `n`).
pub fn responses_budget(
    max_model_len: u64,
    counts: &PromptCounts,
    max_output_tokens: Option<MaxTokens>,
) -> u64 {
    let left = max_model_len.saturating_sub(counts.total_estimate);
    max_output_tokens.map_or(left, |m| m.value.min(left))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mt(v: u64) -> Option<MaxTokens> {
        Some(MaxTokens { value: v, param: "max_tokens" })
    }

    fn counts(lower: u64) -> PromptCounts {
        PromptCounts {
            max_lower: lower,
            max_estimate: lower,
            total_estimate: lower,
            source: CountSource::Estimate,
        }
    }

    #[test]
    fn byte_bounds() {
        assert_eq!(
            TokenCount::from_bytes(1000, 256),
            TokenCount { lower: 4, upper: 1000, estimate: 250, source: CountSource::Estimate }
        );
        assert_eq!(
            TokenCount::from_bytes(0, 256),
            TokenCount { lower: 0, upper: 0, estimate: 0, source: CountSource::Estimate }
        );
        assert_eq!(TokenCount::from_bytes(1, 256).lower, 1);
        assert_eq!(TokenCount::from_bytes(257, 256).lower, 2);
        assert_eq!(
            TokenCount::from_bytes(3, 1),
            TokenCount { lower: 3, upper: 3, estimate: 3, source: CountSource::Estimate }
        );
        // clamp: estimate never below the lower bound
        assert_eq!(TokenCount::from_bytes(100, 2).estimate, 50);
        assert_eq!(TokenCount::from_bytes(7, 0).lower, 7);
    }

    #[test]
    fn chat_bytes_rules() {
        let msgs = vec![
            ChatMessage { role: "system", texts: vec!["  be brief \n"] },
            ChatMessage { role: "user", texts: vec!["hello", " world "] },
            ChatMessage { role: "assistant", texts: vec!["<think>long reasoning</think>\n\nanswer"] },
        ];
        // system(6)+"be brief"(8) + user(4)+"hello"(5)+"world"(5) + assistant(9)+"answer"(6)
        assert_eq!(chat_text_bytes(&msgs), 6 + 8 + 4 + 5 + 5 + 9 + 6);
        // `</think>` only matters for assistant messages
        let user = vec![ChatMessage { role: "user", texts: vec!["a</think>b"] }];
        assert_eq!(chat_text_bytes(&user), 4 + 10);
    }

    #[test]
    fn count_prompt_variants() {
        let c = ByteBoundCounter { max_token_bytes: 4 };
        let p = Prompt::Items(vec![PromptItem::Text("12345678"), PromptItem::Tokens(10)]);
        let r = count_prompt(&c, &p);
        assert_eq!(
            r,
            PromptCounts {
                max_lower: 10,
                max_estimate: 10,
                total_estimate: 12,
                source: CountSource::Estimate
            }
        );
        let p = Prompt::Items(vec![PromptItem::Tokens(3), PromptItem::Tokens(5)]);
        assert_eq!(count_prompt(&c, &p).source, CountSource::Exact);
        assert_eq!(count_prompt(&c, &p).total_estimate, 8);
        let empty = count_prompt(&c, &Prompt::Items(vec![]));
        assert_eq!(
            empty,
            PromptCounts { max_lower: 0, max_estimate: 0, total_estimate: 0, source: CountSource::Estimate }
        );
    }

    #[test]
    fn vllm_rule_with_max_tokens() {
        assert!(check_context(4096, &counts(3096), mt(1000), "messages").is_ok());
        let e = check_context(4096, &counts(3097), mt(1000), "messages").unwrap_err();
        assert_eq!(
            e,
            GatewayError::ContextLengthExceeded {
                param: "messages",
                max_model_len: 4096,
                prompt_lower_bound: 3097,
                max_tokens: Some(1000)
            }
        );
        assert_eq!(e.parts(), (400, "invalid_request_error", "context_length_exceeded", Some("messages")));
    }

    #[test]
    fn vllm_rule_without_max_tokens() {
        assert!(check_context(4096, &counts(4095), None, "prompt").is_ok());
        let e = check_context(4096, &counts(4096), None, "prompt").unwrap_err();
        assert_eq!(e.parts().3, Some("prompt"));
    }

    #[test]
    fn max_tokens_alone_too_large() {
        assert!(check_context(4096, &counts(0), mt(4096), "messages").is_ok());
        let e = check_context(4096, &counts(0), mt(4097), "messages").unwrap_err();
        assert_eq!(
            e,
            GatewayError::MaxTokensTooLarge { param: "max_tokens", requested: 4097, max_model_len: 4096 }
        );
        assert_eq!(e.parts(), (400, "invalid_request_error", "invalid_value", Some("max_tokens")));
        assert_eq!(
            e.to_string(),
            "'max_tokens' is too large: 4097. This model's maximum context length is 4096 tokens."
        );
    }

    #[test]
    fn never_rejects_when_true_count_fits() {
        // For any text, the lower bound is at most the byte count divided by the longest token,
        // so a prompt whose real token count fits is never rejected: exhaustive over small sizes.
        for max_token_bytes in [1u64, 2, 3, 16, 256] {
            for bytes in 0u64..600 {
                let lower = TokenCount::from_bytes(bytes, max_token_bytes).lower;
                // the tokenization with the fewest tokens uses the longest tokens
                let min_real = bytes.div_ceil(max_token_bytes);
                assert!(lower <= min_real);
                for len in [100u64, 300, 599] {
                    let fits = min_real + 10 <= len;
                    let c = PromptCounts {
                        max_lower: lower,
                        max_estimate: lower,
                        total_estimate: lower,
                        source: CountSource::Estimate,
                    };
                    if fits {
                        assert!(check_context(len, &c, mt(10), "prompt").is_ok());
                    }
                }
            }
        }
    }

    #[test]
    fn text_upper_bounds() {
        assert_eq!(text_upper("hello", false), 5);
        assert_eq!(text_upper("hello", true), 5);
        assert_eq!(text_upper("héllo", false), 6);
        // 4 ASCII bytes + 2 non-ASCII bytes counted thrice
        assert_eq!(text_upper("héllo", true), 10);
        assert_eq!(text_upper("", true), 0);
    }

    #[test]
    fn non_ascii_counting() {
        for text in [
            "",
            "a",
            "é",
            "abcdefgh",
            "abcdefgé",
            "日本語のテキストと English mixed 😀😀",
            "é".repeat(33).as_str(),
        ] {
            let want = text.bytes().filter(|b| !b.is_ascii()).count() as u64;
            assert_eq!(non_ascii_bytes(text.as_bytes()), want, "{text:?}");
        }
    }

    #[test]
    fn nfc_growth_is_within_the_bound() {
        // The largest NFC growths of single code points: U+0344 (2 -> 4 bytes), U+0F73 (3 -> 6),
        // U+FB2C (3 -> 6), U+1D160 (4 -> 12, the 3x worst case); U+0390 is NFD's 3x worst case.
        for (c, nfc_bytes) in
            [("\u{344}", 4u64), ("\u{f73}", 6), ("\u{fb2c}", 6), ("\u{1d160}", 12), ("\u{390}", 2)]
        {
            assert!(text_upper(c, true) >= nfc_bytes, "{c:?}");
        }
    }

    #[test]
    fn chat_upper_sums_roles_texts_and_overhead() {
        let msgs = vec![
            ChatMessage { role: "system", texts: vec!["  be brief \n"] },
            ChatMessage { role: "user", texts: vec!["hello", "world"] },
        ];
        let o = TemplateOverhead { per_message: 24, fixed: 109 };
        // system(6) + 12 + 24, user(4) + 5 + 5 + one "\n" join + 24, fixed 109, slack 2.
        assert_eq!(chat_upper(&msgs, o, false), 6 + 12 + 24 + 4 + 5 + 5 + 1 + 24 + 109 + 2);
        assert_eq!(chat_upper(&[], o, false), 109 + 2);
    }

    #[test]
    fn plain_chats() {
        use serde_json::json;
        assert!(chat_is_plain(&json!({"messages": [{"role": "user", "content": "x"}]})));
        assert!(chat_is_plain(&json!({"messages": [{"role": "assistant", "content": null}], "tools": null})));
        assert!(chat_is_plain(
            &json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}],
            "add_generation_prompt": false, "continue_final_message": false})
        ));
        for body in [
            json!({"messages": [{"role": "user", "content": "x"}], "tools": []}),
            json!({"messages": [{"role": "user", "content": "x"}], "documents": [{"text": "d"}]}),
            json!({"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 1 }}"}),
            json!({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {}}),
            json!({"messages": [{"role": "user", "content": "x"}], "continue_final_message": true}),
            json!({"messages": [{"role": "user", "content": "x"}], "add_special_tokens": true}),
            json!({"messages": [{"role": "user", "content": "x", "name": "n"}]}),
            json!({"messages": [{"role": "assistant", "content": null, "tool_calls": []}]}),
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]}),
            json!({"messages": "x"}),
            json!([]),
        ] {
            assert!(!chat_is_plain(&body), "{body}");
        }
    }

    #[test]
    fn fits_is_vllms_rule() {
        assert!(fits(100, 90, mt(10)));
        assert!(!fits(100, 91, mt(10)));
        assert!(fits(100, 99, None));
        assert!(!fits(100, 100, None));
    }

    #[test]
    fn effective_max() {
        assert_eq!(effective_max_tokens(4096, &counts(100), mt(50)), 50);
        assert_eq!(effective_max_tokens(4096, &counts(100), None), 3996);
        assert_eq!(effective_max_tokens(10, &counts(100), None), 0);
    }

    #[test]
    fn responses_budget_is_capped_by_the_context() {
        assert_eq!(responses_budget(4096, &counts(100), mt(50)), 50);
        assert_eq!(responses_budget(4096, &counts(100), None), 3996);
        assert_eq!(responses_budget(4096, &counts(100), mt(5000)), 3996);
        assert_eq!(responses_budget(10, &counts(100), mt(5)), 0);
    }

    #[test]
    fn completion_budget_covers_every_choice() {
        assert_eq!(completion_budget(4096, &counts(100), mt(50), 1, 1), 50);
        assert_eq!(completion_budget(4096, &counts(100), mt(50), 3, 1), 150);
        // No max_tokens: each choice may run to the end of the context.
        assert_eq!(completion_budget(4096, &counts(100), None, 4, 1), 4 * 3996);
        assert_eq!(completion_budget(4096, &counts(100), mt(4096), u64::MAX, 1), u64::MAX);
        assert_eq!(completion_budget(u64::MAX, &counts(0), None, 2, 1), u64::MAX);
        assert_eq!(completion_budget(10, &counts(100), None, 1000, 1), 0);
        // A batch: every prompt gets its own choices.
        assert_eq!(completion_budget(4096, &counts(100), mt(50), 2, 5), 500);
        let batch = PromptCounts {
            max_lower: 60,
            max_estimate: 60,
            total_estimate: 100,
            source: CountSource::Estimate,
        };
        // Two prompts of 40 and 60 tokens: (4096 - 40) + (4096 - 60), for each of 3 choices.
        assert_eq!(completion_budget(4096, &batch, None, 3, 2), 3 * (2 * 4096 - 100));
        assert_eq!(completion_budget(4096, &batch, mt(1), 1, u64::MAX), u64::MAX);
    }
}
