//! What an operator writes to point the gateway at a model's tokenizer files: the serde shapes
//! (strict, `deny_unknown_fields`) and their validation. Paths are used as written (relative
//! paths resolve against the process's working directory).
//!
//! ```yaml
//! tokenizer:
//!   huggingface: /models/qwen2.5-7b-instruct/tokenizer.json
//! chat_template:
//!   tokenizer_config: /models/qwen2.5-7b-instruct/tokenizer_config.json
//! ```
//!
//! ```yaml
//! tokenizer:
//!   tiktoken:
//!     ranks: /opt/qwen/qwen.tiktoken          # or the builtin cl100k_base / o200k_base
//!     pattern: "(?i:'s|'t|'re|'ve|'m|'ll|'d)|..."
//!     special_tokens: ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
//!     normalization: nfc
//! chat_template:
//!   jinja: /opt/qwen/chat_template.jinja
//! ```
//!
//! ```yaml
//! tokenizer:
//!   tekken: /models/mistral-nemo/tekken.json
//! chat_template:
//!   jinja: /models/mistral-nemo/chat_template.jinja
//!   bos_token: "<s>"
//!   eos_token: "</s>"
//! ```

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// The builtin tiktoken encodings (ranks compiled into the binary by `tiktoken-rs`).
pub const BUILTIN_RANKS: [&str; 2] = ["cl100k_base", "o200k_base"];

/// The vocabulary that counts tokens. Exactly one of the three fields must be set.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TokenizerSpec {
    /// Path of a Hugging Face `tokenizer.json` (the file vLLM loads from the model folder).
    /// Chat prompts are tokenized without added special tokens (vLLM's chat default,
    /// `add_special_tokens: false`), completions prompts with them (the post-processor's BOS).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub huggingface: Option<PathBuf>,
    /// A tiktoken-format ranks file (`<base64 token> <rank>` per line) or a builtin encoding.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tiktoken: Option<TiktokenSpec>,
    /// Path of a Mistral `tekken.json` (tiktoken ranks in JSON, as `mistral-common` loads it).
    /// Its special tokens (`<s>`, `[INST]`, ...) are recognized in rendered templates;
    /// completions prompts count one BOS token and no special tokens, as vLLM's Mistral
    /// tokenizer (`Tekkenizer.encode(text, bos=True)`) encodes them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tekken: Option<PathBuf>,
}

/// A tiktoken-format vocabulary.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TiktokenSpec {
    /// `cl100k_base`, `o200k_base` (builtin: pattern and special tokens come with them), or the
    /// path of a ranks file: one `<base64 bytes> <rank>` per line, ranks unique.
    pub ranks: String,
    /// The pre-tokenizer regex (tiktoken's `pat_str`). Required for a ranks file, not allowed
    /// with a builtin.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pattern: Option<String>,
    /// Special tokens recognized anywhere in the text (each counts as one token), e.g. ChatML's
    /// `<|im_start|>`. Not allowed with a builtin (which has its own). Unique, non-empty.
    #[serde(default)]
    pub special_tokens: Vec<String>,
    /// Unicode normalization applied to the whole text before tokenizing (Qwen's tokenizers
    /// apply NFC). Default `none`.
    #[serde(default)]
    pub normalization: Normalization,
    /// Whether completions prompts count one BOS token before the text (the model's tokenizer
    /// adds one). Default false. Chat templates write their own BOS.
    #[serde(default)]
    pub add_bos: bool,
}

/// Unicode normalization before tokenizing.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Normalization {
    /// The text as is.
    #[default]
    None,
    /// Unicode NFC.
    Nfc,
}

/// The model's chat template. At least one of `tokenizer_config` and `jinja` must be set.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ChatTemplateSpec {
    /// Path of the model's `tokenizer_config.json`: its `chat_template` (a string, or the entry
    /// named `default` of a list) is the template unless `jinja` is set, and its `bos_token`,
    /// `eos_token`, `unk_token` and `pad_token` are template variables.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer_config: Option<PathBuf>,
    /// Path of a `.jinja` template file (e.g. the model folder's `chat_template.jinja`, or vLLM's
    /// `--chat-template`); it wins over `tokenizer_config`'s `chat_template`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub jinja: Option<PathBuf>,
    /// `bos_token` template variable; overrides `tokenizer_config`'s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bos_token: Option<String>,
    /// `eos_token` template variable; overrides `tokenizer_config`'s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eos_token: Option<String>,
    /// How message `content` reaches the template, as vLLM's `--chat-template-content-format`:
    /// `string` (text parts joined with `\n`; what templates that print `message.content`
    /// expect) or `openai` (a list of `{"type": "text", "text": ...}` parts). Default `string`.
    #[serde(default)]
    pub content_format: ContentFormat,
}

/// vLLM's chat-template content format.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ContentFormat {
    /// `content` is a string.
    #[default]
    String,
    /// `content` is a list of parts.
    Openai,
}

/// A spec error: `field` is the path inside the spec (`tokenizer.tiktoken.pattern`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct SpecError {
    /// Path of the offending field, relative to the model entry.
    pub field: String,
    /// What is wrong.
    pub message: String,
}

pub(crate) fn spec_error(field: impl Into<String>, message: impl Into<String>) -> SpecError {
    SpecError { field: field.into(), message: message.into() }
}

impl TokenizerSpec {
    /// The same spec with every file path passed through `f` (the builtin tiktoken encodings,
    /// which are no paths, stay as they are).
    #[must_use]
    pub fn map_paths(&self, mut f: impl FnMut(&std::path::Path) -> PathBuf) -> Self {
        let mut out = self.clone();
        if let Some(p) = &self.huggingface {
            out.huggingface = Some(f(p));
        }
        if let Some(p) = &self.tekken {
            out.tekken = Some(f(p));
        }
        if let (Some(t), Some(o)) = (&self.tiktoken, out.tiktoken.as_mut()) {
            if !BUILTIN_RANKS.contains(&t.ranks.as_str()) {
                o.ranks = f(std::path::Path::new(&t.ranks)).display().to_string();
            }
        }
        out
    }

    /// Checks the shape without touching files.
    ///
    /// # Errors
    /// [`SpecError`] naming `tokenizer` (not exactly one kind) or the offending field.
    pub fn validate(&self) -> Result<(), SpecError> {
        let set = [self.huggingface.is_some(), self.tiktoken.is_some(), self.tekken.is_some()]
            .iter()
            .filter(|b| **b)
            .count();
        if set != 1 {
            return Err(spec_error(
                "tokenizer",
                "exactly one of `huggingface`, `tiktoken` and `tekken` must be set",
            ));
        }
        if let Some(t) = &self.tiktoken {
            let builtin = BUILTIN_RANKS.contains(&t.ranks.as_str());
            if t.ranks.is_empty() {
                return Err(spec_error("tokenizer.tiktoken.ranks", "must not be empty"));
            }
            match (&t.pattern, builtin) {
                (Some(_), true) => {
                    return Err(spec_error(
                        "tokenizer.tiktoken.pattern",
                        "not allowed with a builtin encoding (it has its own)",
                    ))
                }
                (None, false) => {
                    return Err(spec_error("tokenizer.tiktoken.pattern", "required with a ranks file"))
                }
                (Some(p), false) if p.is_empty() => {
                    return Err(spec_error("tokenizer.tiktoken.pattern", "must not be empty"))
                }
                _ => {}
            }
            if builtin && !t.special_tokens.is_empty() {
                return Err(spec_error(
                    "tokenizer.tiktoken.special_tokens",
                    "not allowed with a builtin encoding (it has its own)",
                ));
            }
            for (i, s) in t.special_tokens.iter().enumerate() {
                let field = format!("tokenizer.tiktoken.special_tokens[{i}]");
                if s.is_empty() {
                    return Err(spec_error(field, "must not be empty"));
                }
                if t.special_tokens.get(..i).is_some_and(|before| before.contains(s)) {
                    return Err(spec_error(field, format!("duplicate special token {s:?}")));
                }
            }
        }
        Ok(())
    }
}

impl ChatTemplateSpec {
    /// The same spec with every file path passed through `f`.
    #[must_use]
    pub fn map_paths(&self, mut f: impl FnMut(&std::path::Path) -> PathBuf) -> Self {
        Self {
            tokenizer_config: self.tokenizer_config.as_deref().map(&mut f),
            jinja: self.jinja.as_deref().map(&mut f),
            ..self.clone()
        }
    }

    /// Checks the shape without touching files.
    ///
    /// # Errors
    /// [`SpecError`] naming `chat_template` when neither file is set.
    pub fn validate(&self) -> Result<(), SpecError> {
        if self.tokenizer_config.is_none() && self.jinja.is_none() {
            return Err(spec_error(
                "chat_template",
                "at least one of `tokenizer_config` and `jinja` must be set",
            ));
        }
        Ok(())
    }
}
