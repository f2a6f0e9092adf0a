//! `gateway-tokenize`: exact prompt-token counts, equal to vLLM's `usage.prompt_tokens`.
//!
//! A [`ModelTokenizer`] is loaded once from the files vLLM loads from the model folder (see
//! [`spec`]): a vocabulary (Hugging Face `tokenizer.json` through the `tokenizers` crate,
//! tiktoken-format ranks or Mistral's `tekken.json` through `tiktoken-rs`) and a chat template
//! (minijinja, configured as transformers configures jinja2). It then counts many requests:
//!
//! * chat: [`ModelTokenizer::count_chat`] renders the OpenAI `messages` with the template
//!   (`add_generation_prompt`, the template's own defaults such as Qwen2.5's default system
//!   prompt) and counts the rendered text as vLLM does for chat (`add_special_tokens: false`:
//!   the template writes BOS itself);
//! * completions: [`ModelTokenizer::count_text`] counts a prompt string as vLLM does for
//!   completions (`add_special_tokens: true`: BOS where the tokenizer adds one).
//!
//! What cannot be reproduced exactly (images, tool calls, a template that raises) is an error,
//! never a guess, so callers can fall back to letting vLLM decide.
//!
//! ```no_run
//! use gateway_tokenize::{ChatOptions, ModelTokenizer};
//! use gateway_tokenize::spec::{ChatTemplateSpec, TokenizerSpec};
//! # fn demo(t: TokenizerSpec, c: ChatTemplateSpec) -> Result<(), Box<dyn std::error::Error>> {
//! let tokenizer = ModelTokenizer::load(&t, Some(&c))?;
//! let messages = serde_json::json!([{"role": "user", "content": "Hello"}]);
//! let n = tokenizer.count_chat(&messages, &ChatOptions::default())?;
//! # Ok(()) }
//! ```

pub mod spec;
mod template;
mod vocab;

use serde_json::{Map, Value};

pub use spec::SpecError;
use spec::{ChatTemplateSpec, TokenizerSpec};
use template::ChatTemplate;
use vocab::Vocabulary;

/// Why a count could not be made. None of these is a statement about the prompt's length.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenizeError {
    /// The model has no chat template configured.
    #[error("no chat template is configured for this model")]
    NoChatTemplate,
    /// The request uses something whose tokens this crate cannot reproduce exactly (non-text
    /// content parts, tool calls, ...). The text names it.
    #[error("unsupported for exact counting: {0}")]
    Unsupported(String),
    /// `messages` does not have the OpenAI shape.
    #[error("invalid messages: {0}")]
    InvalidMessages(String),
    /// The template failed to render (including its own `raise_exception`, whose message this
    /// is); vLLM would answer 400.
    #[error("chat template: {0}")]
    Template(String),
    /// The tokenizer failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
}

/// Per-request rendering options (the vLLM chat request fields that change the rendering).
#[derive(Debug, Clone, Copy)]
pub struct ChatOptions<'a> {
    /// vLLM's `add_generation_prompt` (default true).
    pub add_generation_prompt: bool,
    /// vLLM's `chat_template_kwargs`: extra template variables.
    pub template_kwargs: Option<&'a Map<String, Value>>,
}

impl Default for ChatOptions<'_> {
    fn default() -> Self {
        ChatOptions { add_generation_prompt: true, template_kwargs: None }
    }
}

/// A model's vocabulary and chat template, loaded once; counting borrows it immutably and is
/// safe from many threads at once.
pub struct ModelTokenizer {
    vocab: Vocabulary,
    template: Option<ChatTemplate>,
}

impl std::fmt::Debug for ModelTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelTokenizer")
            .field("chat_template", &self.template.is_some())
            .finish_non_exhaustive()
    }
}

impl ModelTokenizer {
    /// Loads the vocabulary and, when given, compiles the chat template.
    ///
    /// # Errors
    /// [`SpecError`] naming the field (`tokenizer.huggingface`, `chat_template.jinja`, ...) with
    /// the file and what is wrong: shape, unreadable file, bad format, a pattern or a template
    /// that does not compile.
    pub fn load(
        tokenizer: &TokenizerSpec,
        chat_template: Option<&ChatTemplateSpec>,
    ) -> Result<Self, SpecError> {
        let vocab = Vocabulary::load(tokenizer)?;
        let template = chat_template.map(ChatTemplate::load).transpose()?;
        Ok(ModelTokenizer { vocab, template })
    }

    /// Whether a chat template is configured (else [`ModelTokenizer::count_chat`] fails).
    pub fn has_chat_template(&self) -> bool {
        self.template.is_some()
    }

    /// The chat prompt text vLLM would tokenize for OpenAI `messages`.
    ///
    /// # Errors
    /// [`TokenizeError::NoChatTemplate`], [`TokenizeError::InvalidMessages`],
    /// [`TokenizeError::Unsupported`], [`TokenizeError::Template`].
    pub fn render_chat(&self, messages: &Value, options: &ChatOptions<'_>) -> Result<String, TokenizeError> {
        self.template.as_ref().ok_or(TokenizeError::NoChatTemplate)?.render(
            messages,
            options.add_generation_prompt,
            options.template_kwargs,
        )
    }

    /// Prompt tokens of a chat request: the rendered template, tokenized with the special
    /// tokens it writes recognized and nothing added.
    ///
    /// # Errors
    /// As [`ModelTokenizer::render_chat`], and [`TokenizeError::Tokenizer`].
    pub fn count_chat(&self, messages: &Value, options: &ChatOptions<'_>) -> Result<usize, TokenizeError> {
        let text = self.render_chat(messages, options)?;
        self.vocab.count_rendered(&text)
    }

    /// Tokens of text that is the model's whole input (e.g. a rendered template): special tokens
    /// written in it count as one each, nothing is added.
    ///
    /// # Errors
    /// [`TokenizeError::Tokenizer`].
    pub fn count_rendered(&self, text: &str) -> Result<usize, TokenizeError> {
        self.vocab.count_rendered(text)
    }

    /// Prompt tokens of one completions prompt string, as vLLM counts it
    /// (`add_special_tokens: true`: the BOS the tokenizer adds, if any).
    ///
    /// # Errors
    /// [`TokenizeError::Tokenizer`].
    pub fn count_text(&self, text: &str) -> Result<usize, TokenizeError> {
        self.vocab.count_prompt(text)
    }

    /// Length in bytes of the vocabulary's longest token (special tokens included): the
    /// filter's `max_token_bytes`. `None` when it cannot be known exactly (builtin tiktoken
    /// encodings, non-ByteLevel Hugging Face vocabularies).
    pub fn max_token_bytes(&self) -> Option<usize> {
        self.vocab.max_token_bytes()
    }
}
