//! The exact context-length check, for requests the wasm filter could not settle by bounds.
//!
//! The filter bounds a prompt's tokens without a vocabulary (it never tokenizes on Envoy's
//! worker threads). When the bounds cannot decide vLLM's rule, and the model is marked as having
//! an exact tokenizer here, it sets `x-gateway-context-check: exact`; the admission stream then
//! asks Envoy for the buffered body (`mode_override`) and calls [`ContextChecker::check`], which
//! counts the prompt with the model's own tokenizer and chat template
//! ([`gateway_tokenize::ModelTokenizer`]) and applies vLLM's rule
//! (`vllm/entrypoints/openai/serving_engine.py`, `_validate_input`):
//!
//! * with `max_tokens` (chat: `max_completion_tokens`, else `max_tokens`): reject when
//!   `prompt_tokens + max_tokens > max_model_len`;
//! * without: reject when `prompt_tokens >= max_model_len`.
//!
//! The rule is per sequence: `n` (and completions `best_of`) do not change it, but multiply the
//! completion tokens reserved ([`Counted::max_tokens`]).
//!
//! A batch of completions prompts is checked prompt by prompt, as vLLM does. Whatever cannot be
//! counted exactly (an unknown model, images, tools, a custom template, a template that raises)
//! is [`ContextError::Undecided`]: the request goes on with the filter's estimate and vLLM
//! decides, so the gateway never rejects what vLLM would accept.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use gateway_tokenize::{ChatOptions, ModelTokenizer, TokenizeError};
use serde_json::Value;

use crate::config::ModelConfig;

use crate::config::error::ConfigError;

/// Every configured model's tokenizer, loaded once at start-up.
#[derive(Debug)]
pub struct ContextChecker {
    models: HashMap<String, CheckedModel>,
    /// Counts running at once (one per CPU): counting is CPU-bound, and a burst of long prompts
    /// must not take every core from the sidecar's other work.
    slots: Arc<tokio::sync::Semaphore>,
    /// Counts one tenant may run at once (`context.max_counts_per_tenant`).
    per_tenant: usize,
    /// Each tenant's count slots (only tenants of the config reach a count).
    tenant_slots: std::sync::Mutex<HashMap<String, Arc<tokio::sync::Semaphore>>>,
}

#[derive(Debug)]
struct CheckedModel {
    max_model_len: u64,
    tokenizer: ModelTokenizer,
}

/// The exact counts of an admitted request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Counted {
    /// Prompt tokens, summed over a batch (for the tokens-per-minute reservation and metering).
    pub prompt_tokens: u64,
    /// The most completion tokens the request can produce over all its choices (sent on as
    /// `x-gateway-max-tokens`, reserved with the prompt): for each prompt (a completions batch has
    /// several), its per-choice cap (the request's, else what vLLM leaves for that prompt,
    /// `max_model_len - prompt`), times the sequences vLLM generates per prompt (`n`, on
    /// completions `max(n, best_of)`), saturating. vLLM bills `completion_tokens` summed over
    /// the choices.
    pub max_tokens: u64,
}

/// Why [`ContextChecker::check`] did not admit a request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ContextError {
    /// The exact count proves vLLM would refuse the request (400 `context_length_exceeded`).
    #[error("prompt of {prompt_tokens} tokens does not fit max_model_len {max_model_len} with max_tokens {max_tokens:?}")]
    Exceeded {
        /// `messages` or `prompt`.
        param: &'static str,
        /// Exact prompt tokens (the largest prompt of a batch).
        prompt_tokens: u64,
        /// The request's completion cap, when set.
        max_tokens: Option<u64>,
        /// The model's context window.
        max_model_len: u64,
    },
    /// No exact decision can be made; the request goes on with the filter's estimate.
    #[error("no exact count: {0}")]
    Undecided(String),
}

fn undecided(what: impl Into<String>) -> ContextError {
    ContextError::Undecided(what.into())
}

impl ContextChecker {
    /// Loads the tokenizer and chat template of every model.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] naming the field, e.g.
    /// `models[0].tokenizer.huggingface: /m/tokenizer.json: No such file or directory (os error 2)`.
    pub fn from_config(models: &[ModelConfig]) -> Result<Self, ConfigError> {
        let mut out = HashMap::with_capacity(models.len());
        for (i, m) in models.iter().enumerate() {
            let tokenizer = ModelTokenizer::load(&m.tokenizer, m.chat_template.as_ref()).map_err(|e| {
                ConfigError::Invalid { field: format!("models[{i}].{}", e.field), message: e.message }
            })?;
            out.insert(m.name.clone(), CheckedModel { max_model_len: m.max_model_len, tokenizer });
        }
        let cpus = std::thread::available_parallelism().map_or(1, usize::from);
        Ok(ContextChecker {
            models: out,
            slots: Arc::new(tokio::sync::Semaphore::new(cpus)),
            per_tenant: 1,
            tenant_slots: std::sync::Mutex::default(),
        })
    }

    /// Lets one tenant run at most `n` counts at once (at least 1).
    #[must_use]
    pub fn with_counts_per_tenant(self, n: usize) -> Self {
        Self { per_tenant: n.max(1), ..self }
    }

    /// One of `tenant`'s count slots, if it has one free now (never waits).
    fn tenant_slot(&self, tenant: &str) -> Option<tokio::sync::OwnedSemaphorePermit> {
        let semaphore = {
            let mut slots = self.tenant_slots.lock().ok()?;
            Arc::clone(
                slots
                    .entry(tenant.to_owned())
                    .or_insert_with(|| Arc::new(tokio::sync::Semaphore::new(self.per_tenant))),
            )
        };
        semaphore.try_acquire_owned().ok()
    }

    /// [`ContextChecker::check`] for `tenant`'s request, off the async workers. A tenant runs at
    /// most `max_counts_per_tenant` counts at once: past that its request is undecided at once
    /// (vLLM decides, with the filter's estimate reserved) rather than queued. A count cannot be
    /// interrupted inside the tokenizer: one past `limit` answers undecided but runs on to its
    /// end, still holding its tenant's slot and a CPU slot, so that no tenant can pile up
    /// abandoned counts. Otherwise: on a blocking thread, at most one count
    /// per CPU at a time, the wait for a slot and the count within `limit`.
    ///
    /// # Errors
    /// As [`ContextChecker::check`]; past `limit` (or if the count task fails),
    /// [`ContextError::Undecided`].
    pub async fn check_blocking(
        self: &Arc<Self>,
        tenant: &str,
        model: &str,
        body: Vec<u8>,
        limit: Duration,
    ) -> Result<Counted, ContextError> {
        let tenant_slot = self
            .tenant_slot(tenant)
            .ok_or_else(|| undecided(format!("tenant {tenant} already runs its most counts")))?;
        let this = Arc::clone(self);
        let model = model.to_owned();
        let count = async move {
            let permit = Arc::clone(&this.slots)
                .acquire_owned()
                .await
                .map_err(|_| undecided("the count slots are closed"))?;
            tokio::task::spawn_blocking(move || {
                let _permits = (permit, tenant_slot);
                this.check(&model, &body)
            })
            .await
            .map_err(|e| undecided(format!("count task failed: {e}")))?
        };
        tokio::time::timeout(limit, count)
            .await
            .unwrap_or_else(|_| Err(undecided(format!("count took over {} ms", limit.as_millis()))))
    }

    /// Whether `model` (the filter's `x-gateway-model`) has a tokenizer here.
    pub fn knows(&self, model: &str) -> bool {
        self.models.contains_key(model)
    }

    /// Counts the prompt of an OpenAI chat (`messages`) or completions (`prompt`) body exactly
    /// and applies vLLM's rule for `model` (the canonical name, `x-gateway-model`; the body's
    /// `model` may have been rewritten to the served name).
    ///
    /// # Errors
    /// [`ContextError::Exceeded`] when vLLM would refuse it; [`ContextError::Undecided`] when it
    /// cannot be counted exactly.
    pub fn check(&self, model: &str, body: &[u8]) -> Result<Counted, ContextError> {
        let m = self.models.get(model).ok_or_else(|| undecided(format!("model {model} has no tokenizer")))?;
        let body: Value =
            serde_json::from_slice(body).map_err(|e| undecided(format!("body is not JSON: {e}")))?;
        let obj = body.as_object().ok_or_else(|| undecided("body is not an object"))?;
        let present = |k: &str| obj.get(k).is_some_and(|v| !v.is_null());
        let (param, prompts, max_tokens, choices) = if let Some(messages) = obj.get("messages") {
            for field in ["tools", "documents", "chat_template"] {
                if present(field) {
                    return Err(undecided(format!("`{field}` is not reproduced exactly")));
                }
            }
            for field in ["continue_final_message", "add_special_tokens"] {
                if obj.get(field).and_then(Value::as_bool) == Some(true) {
                    return Err(undecided(format!("`{field}: true` is not reproduced exactly")));
                }
            }
            let options = ChatOptions {
                add_generation_prompt: obj
                    .get("add_generation_prompt")
                    .and_then(Value::as_bool)
                    .unwrap_or(true),
                template_kwargs: obj.get("chat_template_kwargs").and_then(Value::as_object),
            };
            let n = m.tokenizer.count_chat(messages, &options).map_err(tokenize_undecided)?;
            let max =
                max_tokens_field(obj, "max_completion_tokens")?.or(max_tokens_field(obj, "max_tokens")?);
            ("messages", vec![n as u64], max, choices_field(obj, "n")?)
        } else if let Some(prompt) = obj.get("prompt") {
            if obj.get("add_special_tokens").and_then(Value::as_bool) == Some(false) {
                return Err(undecided("`add_special_tokens: false` is not reproduced exactly"));
            }
            let choices = choices_field(obj, "n")?.max(choices_field(obj, "best_of")?);
            (
                "prompt",
                completion_prompts(&m.tokenizer, prompt)?,
                max_tokens_field(obj, "max_tokens")?,
                choices,
            )
        } else {
            return Err(undecided("neither `messages` nor `prompt`"));
        };
        let largest = prompts.iter().copied().max().unwrap_or(0);
        let exceeded = match max_tokens {
            Some(mt) => largest.saturating_add(mt) > m.max_model_len,
            None => largest >= m.max_model_len,
        };
        if exceeded {
            return Err(ContextError::Exceeded {
                param,
                prompt_tokens: largest,
                max_tokens,
                max_model_len: m.max_model_len,
            });
        }
        Ok(Counted {
            prompt_tokens: prompts.iter().fold(0u64, |a, n| a.saturating_add(*n)),
            max_tokens: prompts
                .iter()
                .map(|p| max_tokens.unwrap_or(m.max_model_len.saturating_sub(*p)))
                .fold(0u64, u64::saturating_add)
                .saturating_mul(choices),
        })
    }
}

fn tokenize_undecided(e: TokenizeError) -> ContextError {
    ContextError::Undecided(e.to_string())
}

/// `max_tokens`-like field: absent or null is `None`; a positive integer is the value; anything
/// else (the filter has validated it) is undecided.
fn max_tokens_field(obj: &serde_json::Map<String, Value>, key: &str) -> Result<Option<u64>, ContextError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => {
            v.as_u64().map(Some).ok_or_else(|| undecided(format!("`{key}` is not a non-negative integer")))
        }
    }
}

/// `n` / `best_of`: absent or null is 1; a positive integer is the value; anything else (the
/// filter has validated it) is undecided.
fn choices_field(obj: &serde_json::Map<String, Value>, key: &str) -> Result<u64, ContextError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(1),
        Some(v) => v
            .as_u64()
            .filter(|n| *n >= 1)
            .ok_or_else(|| undecided(format!("`{key}` is not a positive integer"))),
    }
}

/// Exact tokens of each prompt of a completions `prompt`: a string, an array of strings, an array
/// of token ids, or an array of arrays of token ids.
fn completion_prompts(tokenizer: &ModelTokenizer, prompt: &Value) -> Result<Vec<u64>, ContextError> {
    let text = |s: &str| tokenizer.count_text(s).map(|n| n as u64).map_err(tokenize_undecided);
    let ids = |a: &[Value]| {
        if a.iter().all(Value::is_u64) {
            Ok(a.len() as u64)
        } else {
            Err(undecided("`prompt` array mixes token ids and other values"))
        }
    };
    match prompt {
        Value::String(s) => Ok(vec![text(s)?]),
        Value::Array(items) if items.is_empty() => Err(undecided("empty `prompt`")),
        Value::Array(items) if items.iter().all(Value::is_u64) => Ok(vec![items.len() as u64]),
        Value::Array(items) => items
            .iter()
            .map(|item| match item {
                Value::String(s) => text(s),
                Value::Array(a) => ids(a),
                _ => Err(undecided("`prompt` item is neither text nor token ids")),
            })
            .collect(),
        _ => Err(undecided("`prompt` is neither text nor token ids")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gateway_tokenize::spec::TokenizerSpec;
    use serde_json::json;

    /// cl100k_base (compiled into tiktoken-rs) and a ChatML-like template written here: the rule
    /// and the body handling are under test, not the vocabulary (tests/test_token_counts.py
    /// checks the counts against the reference implementations).
    fn checker(max_model_len: u64) -> ContextChecker {
        // A directory per call: tests in parallel threads would otherwise rewrite one another's
        // template while it is read.
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("ctx-test-{}-{max_model_len}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let template = dir.join("t.jinja");
        std::fs::write(
            &template,
            "{% for m in messages %}<|endoftext|>{{ m.role }}\n{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<|endoftext|>assistant\n{% endif %}",
        )
        .unwrap();
        let yaml = format!(
            "name: m\nmax_model_len: {max_model_len}\ntokenizer: {{tiktoken: {{ranks: cl100k_base}}}}\nchat_template: {{jinja: {}}}\n",
            template.display()
        );
        let model: ModelConfig = serde_yaml_ng::from_str(&yaml).unwrap();
        ContextChecker::from_config(&[model]).unwrap()
    }

    fn chat_tokens(c: &ContextChecker, body: &Value) -> u64 {
        let mut b = body.clone();
        b.as_object_mut().unwrap().remove("max_tokens");
        c.check("m", b.to_string().as_bytes()).unwrap().prompt_tokens
    }

    #[test]
    fn vllm_rule_on_exact_counts() {
        let c = checker(100);
        let body = json!({"model": "served", "messages": [{"role": "user", "content": "Hello there, how are you?"}]});
        let n = chat_tokens(&c, &body);
        // OpenAI's tiktoken on the rendered text: "<|endoftext|>" "user" "\n" "Hello" " there" ","
        // " how" " are" " you" "?\n" "<|endoftext|>" "assistant" "\n".
        assert_eq!(n, 13);
        let with = |mt: u64| {
            let mut b = body.clone();
            b["max_tokens"] = json!(mt);
            c.check("m", b.to_string().as_bytes())
        };
        assert_eq!(with(100 - n), Ok(Counted { prompt_tokens: n, max_tokens: 100 - n }));
        assert_eq!(
            with(100 - n + 1),
            Err(ContextError::Exceeded {
                param: "messages",
                prompt_tokens: n,
                max_tokens: Some(100 - n + 1),
                max_model_len: 100
            })
        );
        // max_completion_tokens wins over max_tokens.
        let mut b = body.clone();
        b["max_completion_tokens"] = json!(1);
        b["max_tokens"] = json!(1000);
        assert!(c.check("m", b.to_string().as_bytes()).is_ok());
        // Without max_tokens: prompt < max_model_len, and the cap is what is left.
        assert_eq!(c.check("m", body.to_string().as_bytes()).unwrap().max_tokens, 100 - n);
        let tight = checker(n);
        assert!(matches!(
            tight.check("m", body.to_string().as_bytes()),
            Err(ContextError::Exceeded { max_tokens: None, .. })
        ));
        assert!(checker(n + 1).check("m", body.to_string().as_bytes()).is_ok());
    }

    /// Issue 17, item 4: the exact count's reservation covers every choice; the rule does not
    /// change with them.
    #[test]
    fn reservation_covers_every_choice() {
        let c = checker(100);
        let chat = json!({"messages": [{"role": "user", "content": "Hello there, how are you?"}]});
        let n = chat_tokens(&c, &chat);
        let with = |body: &Value, extra: Value| {
            let mut b = body.clone();
            for (k, v) in extra.as_object().unwrap() {
                b[k] = v.clone();
            }
            c.check("m", b.to_string().as_bytes())
        };
        assert_eq!(
            with(&chat, json!({"max_tokens": 10, "n": 3})),
            Ok(Counted { prompt_tokens: n, max_tokens: 30 })
        );
        // No max_tokens: n x (max_model_len - prompt).
        assert_eq!(with(&chat, json!({"n": 4})).unwrap().max_tokens, 4 * (100 - n));
        // Per sequence: 100 - n fits once, so it fits with n = 5 too.
        assert_eq!(with(&chat, json!({"max_tokens": 100 - n, "n": 5})).unwrap().max_tokens, 5 * (100 - n));
        assert!(matches!(
            with(&chat, json!({"max_tokens": 101 - n, "n": 5})),
            Err(ContextError::Exceeded { .. })
        ));
        assert_eq!(with(&chat, json!({"max_tokens": 10, "n": u64::MAX})).unwrap().max_tokens, u64::MAX);
        // Chat has no best_of in vLLM's API.
        assert_eq!(with(&chat, json!({"max_tokens": 10, "best_of": 4})).unwrap().max_tokens, 10);
        let comp = json!({"prompt": [[1, 2, 3]]});
        assert_eq!(with(&comp, json!({"max_tokens": 7, "n": 2, "best_of": 5})).unwrap().max_tokens, 35);
        assert_eq!(with(&comp, json!({"max_tokens": 7, "n": 2})).unwrap().max_tokens, 14);
        assert!(matches!(with(&comp, json!({"n": "2"})), Err(ContextError::Undecided(_))));
        // A batch: each prompt has its own choices; without max_tokens each its own remainder.
        let batch = json!({"prompt": [[1, 2, 3], [4]]});
        assert_eq!(with(&batch, json!({"max_tokens": 7, "n": 2})).unwrap().max_tokens, 2 * 2 * 7);
        assert_eq!(with(&batch, json!({"n": 3})).unwrap().max_tokens, 3 * ((100 - 3) + (100 - 1)));
        assert!(matches!(with(&comp, json!({"n": 0})), Err(ContextError::Undecided(_))));
    }

    #[test]
    fn generation_prompt_and_kwargs() {
        let c = checker(1000);
        let body = json!({"messages": [{"role": "user", "content": "x"}]});
        let with = chat_tokens(&c, &body);
        let mut b = body.clone();
        b["add_generation_prompt"] = json!(false);
        assert_eq!(chat_tokens(&c, &b), with - 3);
    }

    #[test]
    fn completions_batches_are_checked_per_prompt() {
        let c = checker(10);
        let ok = json!({"prompt": ["one two three", [1, 2, 3, 4, 5, 6, 7]], "max_tokens": 3});
        // Each of the two prompts may generate max_tokens.
        assert_eq!(c.check("m", ok.to_string().as_bytes()), Ok(Counted { prompt_tokens: 10, max_tokens: 6 }));
        let over = json!({"prompt": [[1, 2, 3, 4, 5, 6, 7, 8]], "max_tokens": 3});
        assert_eq!(
            c.check("m", over.to_string().as_bytes()),
            Err(ContextError::Exceeded {
                param: "prompt",
                prompt_tokens: 8,
                max_tokens: Some(3),
                max_model_len: 10
            })
        );
        let ids = json!({"prompt": [1, 2, 3]});
        assert_eq!(c.check("m", ids.to_string().as_bytes()).unwrap().prompt_tokens, 3);
    }

    #[test]
    fn undecided_cases() {
        let c = checker(1000);
        let cases = [
            json!({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}),
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]}),
            json!({"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 1 }}"}),
            json!({"messages": [{"role": "user", "content": "x"}], "continue_final_message": true}),
            json!({"messages": "nope"}),
            json!({"prompt": [1, "x"]}),
            json!({"prompt": []}),
            json!({"input": "x"}),
        ];
        for body in cases {
            assert!(
                matches!(c.check("m", body.to_string().as_bytes()), Err(ContextError::Undecided(_))),
                "{body}"
            );
        }
        assert!(matches!(c.check("other", b"{}"), Err(ContextError::Undecided(_))));
        assert!(matches!(c.check("m", b"not json"), Err(ContextError::Undecided(_))));
        assert!(c.knows("m") && !c.knows("other"));
    }

    #[tokio::test]
    async fn blocking_check_and_its_deadline() {
        let c = Arc::new(checker(1000));
        let body = json!({"messages": [{"role": "user", "content": "Hello there, how are you?"}]});
        let ok = c.check_blocking("t", "m", body.to_string().into_bytes(), Duration::from_secs(10)).await;
        assert_eq!(ok.map(|n| n.prompt_tokens), Ok(13));
        // A count of milliseconds cannot finish within no time at all.
        let long =
            json!({"messages": [{"role": "user", "content": "Hello there, how are you? ".repeat(8000)}]});
        let late = c.check_blocking("t", "m", long.to_string().into_bytes(), Duration::ZERO).await;
        assert!(matches!(late, Err(ContextError::Undecided(_))), "{late:?}");
    }

    #[tokio::test]
    async fn a_tenant_runs_at_most_its_counts_and_a_late_count_keeps_its_slot() {
        let c = Arc::new(checker(1_000_000).with_counts_per_tenant(1));
        let long =
            json!({"messages": [{"role": "user", "content": "Hello there, how are you? ".repeat(40_000)}]});
        let short = json!({"messages": [{"role": "user", "content": "Hi"}]}).to_string().into_bytes();
        // Abandoned past its deadline, the long count runs on holding tenant a's one slot...
        let late = c.check_blocking("a", "m", long.to_string().into_bytes(), Duration::ZERO).await;
        assert!(matches!(late, Err(ContextError::Undecided(_))), "{late:?}");
        let busy = c.check_blocking("a", "m", short.clone(), Duration::from_secs(10)).await;
        assert!(
            matches!(&busy, Err(ContextError::Undecided(why)) if why.contains("most counts")),
            "{busy:?}"
        );
        // ...while another tenant counts.
        let other = c.check_blocking("b", "m", short.clone(), Duration::from_secs(10)).await;
        assert!(other.is_ok(), "{other:?}");
        // Once it ends, tenant a counts again.
        let mut again = Err(undecided("not yet"));
        for _ in 0..200 {
            again = c.check_blocking("a", "m", short.clone(), Duration::from_secs(10)).await;
            if again.is_ok() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(again.is_ok(), "{again:?}");
    }

    #[test]
    fn load_errors_name_the_field() {
        let model = ModelConfig {
            name: "m".into(),
            max_model_len: 10,
            tokenizer: TokenizerSpec {
                huggingface: Some("/nonexistent/tokenizer.json".into()),
                tiktoken: None,
                tekken: None,
            },
            chat_template: None,
        };
        let e = ContextChecker::from_config(&[model]).unwrap_err().to_string();
        assert!(e.starts_with("models[0].tokenizer.huggingface: /nonexistent/tokenizer.json: "), "{e}");
    }
}
