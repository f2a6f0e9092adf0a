//! Token accounting without a tokenizer: prompt-token counts, vLLM's context-length check
//! and the completion-length rules.
//!
//! The counts are a deterministic stand-in for a tokenizer, documented in the crate docs:
//! a text costs `ceil(utf8_bytes / 4)` tokens; a chat message costs its role and content
//! plus [`MESSAGE_OVERHEAD_TOKENS`]; a chat prompt adds [`GENERATION_PROMPT_TOKENS`].

/// Tokens added per chat message for the chat template's role markers.
pub const MESSAGE_OVERHEAD_TOKENS: u64 = 3;
/// Tokens added once per chat prompt for the assistant generation prompt.
pub const GENERATION_PROMPT_TOKENS: u64 = 3;

/// Tokens of one text: `ceil(utf8_bytes / 4)`, so 0 for an empty text and at least 1 otherwise.
pub fn text_tokens(text: &str) -> u64 {
    (text.len() as u64).div_ceil(4)
}

/// Tokens of one chat message from its role's and content's token counts:
/// `role + content + MESSAGE_OVERHEAD_TOKENS`.
pub fn message_tokens(role_tokens: u64, content_tokens: u64) -> u64 {
    role_tokens.saturating_add(content_tokens).saturating_add(MESSAGE_OVERHEAD_TOKENS)
}

/// Why generation stopped, as in OpenAI's and vLLM's `finish_reason`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// `"stop"`: the simulated model emitted EOS after `--output-tokens` tokens.
    Stop,
    /// `"length"`: the output reached `max_tokens` (or the context-window cap).
    Length,
}

impl FinishReason {
    /// The wire value of `finish_reason` and of vLLM's `finished_reason` metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
        }
    }
}

/// The sizes of one request's generation once it passed the context check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutputPlan {
    /// Prompt tokens (`usage.prompt_tokens`).
    pub prompt_tokens: u64,
    /// Tokens to generate for each choice; at least 1.
    pub completion_tokens: u64,
    /// `finish_reason` once all of them are sent.
    pub finish_reason: FinishReason,
    /// Choices (the request's `n`), each of `completion_tokens` tokens; at least 1.
    pub choices: u64,
}

impl OutputPlan {
    /// `usage.completion_tokens`: the tokens of every choice, as vLLM sums them.
    pub fn total_completion_tokens(&self) -> u64 {
        self.completion_tokens.saturating_mul(self.choices)
    }
}

/// The length-related fields of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LengthRequest {
    /// Prompt tokens as counted by this module.
    pub prompt_tokens: u64,
    /// `max_completion_tokens` (chat) or else `max_tokens`, when the request sets one.
    pub max_tokens: Option<u64>,
    /// vLLM's `ignore_eos` extension: generate exactly the (effective) `max_tokens`.
    pub ignore_eos: bool,
}

/// The engine limits the plan is checked against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// `--max-model-len`, in tokens.
    pub max_model_len: u64,
    /// `--output-tokens`: where the simulated model emits EOS.
    pub output_tokens: u64,
}

/// A request rejected by the length checks; `Display` is vLLM's error message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LengthError {
    /// `max_tokens` is 0 (vLLM's `SamplingParams` check).
    #[error("max_tokens must be at least 1, got 0.")]
    ZeroMaxTokens,
    /// The prompt has no token at all (vLLM: empty decoder prompt).
    #[error("The decoder prompt cannot be empty")]
    EmptyPrompt,
    /// No `max_tokens` and the prompt alone fills the context window.
    #[error(
        "This model's maximum context length is {max_model_len} tokens. However, you requested \
         {prompt_tokens} tokens in the messages. Please reduce the length of the messages."
    )]
    PromptTooLong {
        /// `--max-model-len`.
        max_model_len: u64,
        /// Prompt tokens.
        prompt_tokens: u64,
    },
    /// Prompt plus `max_tokens` exceeds the context window.
    #[error(
        "This model's maximum context length is {max_model_len} tokens. However, you requested \
         {} tokens ({prompt_tokens} in the messages, {max_tokens} in the completion). \
         Please reduce the length of the messages or completion.",
        prompt_tokens.saturating_add(*max_tokens)
    )]
    RequestTooLong {
        /// `--max-model-len`.
        max_model_len: u64,
        /// Prompt tokens.
        prompt_tokens: u64,
        /// The requested `max_tokens`.
        max_tokens: u64,
    },
}

/// Applies vLLM's context check and the simulator's output-length rules.
///
/// * `max_tokens` set: rejected when `prompt + max_tokens > max_model_len`.
/// * `max_tokens` absent: rejected when `prompt >= max_model_len`; otherwise the effective
///   `max_tokens` is `max_model_len - prompt`, as vLLM caps it.
/// * Completion length: the effective `max_tokens` with `ignore_eos`, else
///   `min(effective max_tokens, output_tokens)`; `finish_reason` is `length` when the
///   completion reached the effective `max_tokens`, else `stop`.
pub fn plan_output(request: LengthRequest, limits: Limits) -> Result<OutputPlan, LengthError> {
    let prompt_tokens = request.prompt_tokens;
    if request.max_tokens == Some(0) {
        return Err(LengthError::ZeroMaxTokens);
    }
    if prompt_tokens == 0 {
        return Err(LengthError::EmptyPrompt);
    }
    let max_model_len = limits.max_model_len;
    let effective_max = match request.max_tokens {
        Some(max_tokens) if prompt_tokens.saturating_add(max_tokens) > max_model_len => {
            return Err(LengthError::RequestTooLong { max_model_len, prompt_tokens, max_tokens })
        }
        Some(max_tokens) => max_tokens,
        None if prompt_tokens >= max_model_len => {
            return Err(LengthError::PromptTooLong { max_model_len, prompt_tokens })
        }
        None => max_model_len - prompt_tokens,
    };
    let completion_tokens =
        if request.ignore_eos { effective_max } else { effective_max.min(limits.output_tokens) };
    let finish_reason =
        if completion_tokens == effective_max { FinishReason::Length } else { FinishReason::Stop };
    Ok(OutputPlan { prompt_tokens, completion_tokens, finish_reason, choices: 1 })
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits = Limits { max_model_len: 4096, output_tokens: 16 };

    fn plan(
        prompt_tokens: u64,
        max_tokens: Option<u64>,
        ignore_eos: bool,
    ) -> Result<OutputPlan, LengthError> {
        plan_output(LengthRequest { prompt_tokens, max_tokens, ignore_eos }, LIMITS)
    }

    #[test]
    fn text_tokens_is_ceil_bytes_over_four() {
        assert_eq!(text_tokens(""), 0);
        assert_eq!(text_tokens("a"), 1);
        assert_eq!(text_tokens("abcd"), 1);
        assert_eq!(text_tokens("abcde"), 2);
        // UTF-8 bytes, not chars: "é" is 2 bytes, "€" is 3.
        assert_eq!(text_tokens("éé€"), 2);
        assert_eq!(message_tokens(1, 3), 7);
    }

    #[test]
    fn default_output_stops_at_output_tokens() {
        let p = plan(10, None, false).unwrap();
        assert_eq!((p.completion_tokens, p.finish_reason), (16, FinishReason::Stop));
    }

    #[test]
    fn max_tokens_below_output_tokens_finishes_with_length() {
        let p = plan(10, Some(5), false).unwrap();
        assert_eq!((p.completion_tokens, p.finish_reason), (5, FinishReason::Length));
        let p = plan(10, Some(16), false).unwrap();
        assert_eq!((p.completion_tokens, p.finish_reason), (16, FinishReason::Length));
        let p = plan(10, Some(100), false).unwrap();
        assert_eq!((p.completion_tokens, p.finish_reason), (16, FinishReason::Stop));
    }

    #[test]
    fn ignore_eos_generates_exactly_max_tokens() {
        let p = plan(10, Some(100), true).unwrap();
        assert_eq!((p.completion_tokens, p.finish_reason), (100, FinishReason::Length));
    }

    #[test]
    fn absent_max_tokens_is_capped_by_the_context_window() {
        let p = plan(4000, None, true).unwrap();
        assert_eq!((p.completion_tokens, p.finish_reason), (96, FinishReason::Length));
        let p = plan(4090, None, false).unwrap();
        assert_eq!((p.completion_tokens, p.finish_reason), (6, FinishReason::Length));
    }

    #[test]
    fn context_check_messages_follow_vllm() {
        let err = plan(4000, Some(1000), false).unwrap_err();
        assert_eq!(
            err.to_string(),
            "This model's maximum context length is 4096 tokens. However, you requested 5000 \
             tokens (4000 in the messages, 1000 in the completion). Please reduce the length of \
             the messages or completion."
        );
        let err = plan(4096, None, false).unwrap_err();
        assert_eq!(
            err.to_string(),
            "This model's maximum context length is 4096 tokens. However, you requested 4096 \
             tokens in the messages. Please reduce the length of the messages."
        );
        // The boundary itself is allowed.
        assert!(plan(4000, Some(96), false).is_ok());
        assert!(plan(4095, None, false).is_ok());
        assert_eq!(plan(10, Some(0), false), Err(LengthError::ZeroMaxTokens));
        assert_eq!(plan(0, None, false), Err(LengthError::EmptyPrompt));
        assert!(matches!(plan(10, Some(u64::MAX), false), Err(LengthError::RequestTooLong { .. })));
    }
}
