//! Prompt workloads: synthetic random prompts or a JSONL / ShareGPT dataset.
//!
//! Request bodies are serialized once, before a point starts, so the hot
//! path only clones a reference-counted [`Bytes`].
//!
//! * **Random**: each prompt is `input_len` words drawn uniformly from a
//!   fixed vocabulary of common single-token English words (words ≈
//!   tokens); `max_tokens = output_len`; `ignore_eos` defaults to `true`
//!   (vLLM's extension that forces exactly `max_tokens` output tokens).
//!   Each point gets fresh prompts (seed + point index) so prefix caching
//!   cannot carry over between points.
//! * **Dataset** (`--dataset-path`): JSON Lines, one object per line, either
//!   `{"prompt": "...", "max_tokens": N}` (`max_tokens` optional) or
//!   ShareGPT style `{"conversations": [{"from": "human", "value": ...},
//!   {"from": "gpt", "value": ...}, ...]}` (first human turn is the prompt;
//!   `max_tokens` = word count of the following gpt turn). A file whose first
//!   non-blank character is `[` is read as one JSON array of such objects
//!   (the usual ShareGPT dump), or a whole chat `{"messages": [{"role":
//!   "system", "content": ...}, {"role": "user", ...}, ...], "max_tokens": N}`
//!   (OpenAI's `messages`, sent as is; chat endpoint only: multi-turn
//!   conversations that resend their history, for prefix caching).
//!   `--output-len` overrides every `max_tokens`; entries without any get
//!   128. Each point samples entries in a seeded random order
//!   (`--dataset-order shuffled`) or sends them in file order
//!   (`--dataset-order in-order`, so turn k of a conversation follows turn
//!   k - 1), cycling when the dataset is smaller than needed.
//!
//! At most [`MAX_UNIQUE_REQUESTS`] distinct bodies are prepared per point;
//! longer runs cycle through them.

use crate::config::Endpoint;
use crate::error::BenchError;
use bytes::Bytes;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Upper bound on distinct request bodies prepared per point.
pub const MAX_UNIQUE_REQUESTS: u64 = 10_000;

/// Default `max_tokens` when neither the flag nor the dataset gives one.
pub const DEFAULT_OUTPUT_LEN: u32 = 128;

/// Where prompts come from.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum WorkloadSpec {
    /// Synthetic prompts of `input_len` words.
    Random {
        /// Prompt length in words (≈ tokens).
        input_len: u32,
        /// `max_tokens` of every request.
        output_len: u32,
        /// Send `ignore_eos: true`.
        ignore_eos: bool,
    },
    /// Prompts from a JSONL / ShareGPT file.
    Dataset {
        /// File path.
        path: PathBuf,
        /// Overrides every entry's `max_tokens` when set.
        output_len: Option<u32>,
        /// Send `ignore_eos: true`.
        ignore_eos: bool,
        /// Sampling order of the entries.
        #[serde(default)]
        order: DatasetOrder,
    },
}

/// How a point draws dataset entries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum DatasetOrder {
    /// A seeded random permutation per point.
    #[default]
    Shuffled,
    /// File order (warmup requests take the first entries).
    InOrder,
}

/// One ready-to-send request.
#[derive(Debug, Clone)]
pub struct PreparedRequest {
    /// Serialized JSON body.
    pub body: Bytes,
    /// Prompt length in words (fallback prompt-token count).
    pub prompt_words: u64,
    /// `max_tokens` requested.
    pub max_tokens: u32,
}

/// A loaded workload that can produce request bodies for each point.
#[derive(Debug)]
pub struct Workload {
    spec: WorkloadSpec,
    endpoint: Endpoint,
    model: String,
    /// Whether bodies ask for `stream_options.include_usage`.
    include_usage: bool,
    /// Dataset entries, pre-serialized.
    dataset: Vec<PreparedRequest>,
}

const VOCAB: &[&str] = &[
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "you",
    "that",
    "it",
    "he",
    "was",
    "for",
    "on",
    "are",
    "as",
    "with",
    "his",
    "they",
    "at",
    "be",
    "this",
    "have",
    "from",
    "or",
    "one",
    "had",
    "by",
    "word",
    "but",
    "not",
    "what",
    "all",
    "were",
    "we",
    "when",
    "your",
    "can",
    "said",
    "there",
    "use",
    "an",
    "each",
    "which",
    "she",
    "do",
    "how",
    "their",
    "if",
    "will",
    "up",
    "other",
    "about",
    "out",
    "many",
    "then",
    "them",
    "these",
    "so",
    "some",
    "her",
    "would",
    "make",
    "like",
    "him",
    "into",
    "time",
    "has",
    "look",
    "two",
    "more",
    "write",
    "go",
    "see",
    "number",
    "no",
    "way",
    "could",
    "people",
    "my",
    "than",
    "first",
    "water",
    "been",
    "call",
    "who",
    "its",
    "now",
    "find",
    "long",
    "down",
    "day",
    "did",
    "get",
    "come",
    "made",
    "may",
    "part",
    "over",
    "new",
    "sound",
    "take",
    "only",
    "little",
    "work",
    "know",
    "place",
    "year",
    "live",
    "me",
    "back",
    "give",
    "most",
    "very",
    "after",
    "thing",
    "our",
    "just",
    "name",
    "good",
    "sentence",
    "man",
    "think",
    "say",
    "great",
    "where",
    "help",
    "through",
    "much",
    "before",
    "line",
    "right",
    "too",
    "mean",
    "old",
    "any",
    "same",
    "tell",
    "boy",
    "follow",
    "came",
    "want",
    "show",
    "also",
    "around",
    "form",
    "three",
    "small",
    "set",
    "put",
    "end",
    "does",
    "another",
    "well",
    "large",
    "must",
    "big",
    "even",
    "such",
    "because",
    "turn",
    "here",
    "why",
    "ask",
    "went",
    "men",
    "read",
    "need",
    "land",
    "different",
    "home",
    "us",
    "move",
    "try",
    "kind",
    "hand",
    "picture",
    "again",
    "change",
    "off",
    "play",
    "spell",
    "air",
    "away",
    "animal",
    "house",
    "point",
    "page",
    "letter",
    "mother",
    "answer",
    "found",
    "study",
    "still",
    "learn",
    "should",
    "world",
    "high",
    "every",
    "near",
    "add",
    "food",
    "between",
    "own",
    "below",
    "country",
    "plant",
    "last",
    "school",
    "father",
    "keep",
    "tree",
    "never",
    "start",
    "city",
    "earth",
    "eye",
    "light",
    "thought",
    "head",
    "under",
    "story",
    "saw",
    "left",
];

impl Workload {
    /// Loads the workload (reads and validates the dataset file if any); `include_usage`: the
    /// bodies ask for `stream_options.include_usage` (else tokens are counted from the stream's
    /// content events, as a client that did not ask must).
    pub fn load(
        spec: &WorkloadSpec,
        endpoint: Endpoint,
        model: &str,
        include_usage: bool,
    ) -> Result<Self, BenchError> {
        let mut w = Self {
            spec: spec.clone(),
            endpoint,
            model: model.to_string(),
            include_usage,
            dataset: Vec::new(),
        };
        if let WorkloadSpec::Dataset { path, output_len, ignore_eos, .. } = spec {
            let entries = read_dataset(path)?;
            for (i, e) in entries.into_iter().enumerate() {
                let max_tokens = output_len.or(e.max_tokens).unwrap_or(DEFAULT_OUTPUT_LEN);
                let body = match &e.prompt {
                    Prompt::Text(text) => {
                        build_body(endpoint, model, text, max_tokens, *ignore_eos, include_usage)?
                    }
                    Prompt::Messages(messages) => {
                        if endpoint != Endpoint::Chat {
                            return Err(BenchError::Dataset {
                                path: path.clone(),
                                message: format!(
                                    "entry {}: `messages` needs the chat endpoint, not /v1/completions",
                                    i + 1
                                ),
                            });
                        }
                        build_chat_body(model, messages, max_tokens, *ignore_eos, include_usage)?
                    }
                };
                w.dataset.push(PreparedRequest { body, prompt_words: e.prompt.words(), max_tokens });
            }
        }
        Ok(w)
    }

    /// Number of dataset entries (0 for random workloads).
    pub fn dataset_len(&self) -> usize {
        self.dataset.len()
    }

    /// Prepares `min(count, MAX_UNIQUE_REQUESTS)` request bodies for one
    /// point; the runner cycles through them.
    pub fn requests_for_point(&self, count: u64, seed: u64) -> Result<Arc<[PreparedRequest]>, BenchError> {
        let n = usize::try_from(count.clamp(1, MAX_UNIQUE_REQUESTS)).unwrap_or(1);
        let mut rng = StdRng::seed_from_u64(seed);
        match &self.spec {
            WorkloadSpec::Random { input_len, output_len, ignore_eos } => {
                let mut out = Vec::with_capacity(n);
                let mut prompt = String::new();
                for _ in 0..n {
                    random_prompt(&mut rng, *input_len, &mut prompt);
                    let body = build_body(
                        self.endpoint,
                        &self.model,
                        &prompt,
                        *output_len,
                        *ignore_eos,
                        self.include_usage,
                    )?;
                    out.push(PreparedRequest {
                        body,
                        prompt_words: u64::from(*input_len),
                        max_tokens: *output_len,
                    });
                }
                Ok(out.into())
            }
            WorkloadSpec::Dataset { order: dataset_order, .. } => {
                let mut order: Vec<usize> = (0..self.dataset.len()).collect();
                if *dataset_order == DatasetOrder::Shuffled {
                    order.shuffle(&mut rng);
                }
                Ok(order.iter().cycle().take(n).filter_map(|&i| self.dataset.get(i).cloned()).collect())
            }
        }
    }
}

/// Writes `words` random vocabulary words separated by spaces into `out`.
pub fn random_prompt(rng: &mut impl Rng, words: u32, out: &mut String) {
    out.clear();
    for i in 0..words {
        if i > 0 {
            out.push(' ');
        }
        let w = VOCAB.get(rng.random_range(0..VOCAB.len())).copied().unwrap_or("the");
        out.push_str(w);
    }
}

#[derive(Serialize)]
struct Message<'a> {
    role: &'a str,
    content: &'a str,
}

#[derive(Serialize)]
struct StreamOptions {
    include_usage: bool,
}

#[derive(Serialize)]
struct Body<'a> {
    model: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    messages: Option<Vec<Message<'a>>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    prompt: Option<&'a str>,
    max_tokens: u32,
    stream: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    stream_options: Option<StreamOptions>,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    ignore_eos: bool,
}

/// Serializes a streaming request body for `endpoint` (`include_usage`: with
/// `stream_options.include_usage: true`).
pub fn build_body(
    endpoint: Endpoint,
    model: &str,
    prompt: &str,
    max_tokens: u32,
    ignore_eos: bool,
    include_usage: bool,
) -> Result<Bytes, BenchError> {
    let (messages, prompt) = match endpoint {
        Endpoint::Chat => (Some(vec![Message { role: "user", content: prompt }]), None),
        Endpoint::Completions => (None, Some(prompt)),
    };
    let body = Body {
        model,
        messages,
        prompt,
        max_tokens,
        stream: true,
        stream_options: include_usage.then_some(StreamOptions { include_usage: true }),
        ignore_eos,
    };
    Ok(Bytes::from(serde_json::to_vec(&body)?))
}

/// Serializes a streaming chat request body with the whole `messages` list (`include_usage` as in
/// [`build_body`]).
pub fn build_chat_body(
    model: &str,
    messages: &[ChatMessage],
    max_tokens: u32,
    ignore_eos: bool,
    include_usage: bool,
) -> Result<Bytes, BenchError> {
    let body = Body {
        model,
        messages: Some(messages.iter().map(|m| Message { role: &m.role, content: &m.content }).collect()),
        prompt: None,
        max_tokens,
        stream: true,
        stream_options: include_usage.then_some(StreamOptions { include_usage: true }),
        ignore_eos,
    };
    Ok(Bytes::from(serde_json::to_vec(&body)?))
}

/// One chat message of a dataset entry (OpenAI's `messages[]`: `role`, string `content`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// The message text.
    pub content: String,
}

/// What a dataset entry sends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prompt {
    /// One text: the chat endpoint's single user message, or the completions `prompt`.
    Text(String),
    /// A whole chat, sent as `messages`.
    Messages(Vec<ChatMessage>),
}

impl Prompt {
    /// Whitespace-separated words of every text (the fallback prompt-token count).
    pub fn words(&self) -> u64 {
        match self {
            Self::Text(t) => t.split_whitespace().count() as u64,
            Self::Messages(m) => m.iter().map(|m| m.content.split_whitespace().count() as u64).sum(),
        }
    }
}

/// One dataset entry after normalization.
#[derive(Debug, Clone, PartialEq)]
pub struct DatasetEntry {
    /// What it sends.
    pub prompt: Prompt,
    /// `max_tokens` from the entry, if any.
    pub max_tokens: Option<u32>,
}

#[derive(Deserialize)]
struct RawEntry {
    #[serde(default)]
    prompt: Option<String>,
    #[serde(default)]
    max_tokens: Option<u32>,
    #[serde(default)]
    conversations: Option<Vec<Turn>>,
    #[serde(default)]
    messages: Option<Vec<ChatMessage>>,
}

#[derive(Deserialize)]
struct Turn {
    #[serde(default)]
    from: String,
    #[serde(default)]
    value: String,
}

impl RawEntry {
    fn normalize(self) -> Option<DatasetEntry> {
        if let Some(prompt) = self.prompt.filter(|p| !p.trim().is_empty()) {
            return Some(DatasetEntry { prompt: Prompt::Text(prompt), max_tokens: self.max_tokens });
        }
        if let Some(messages) = self.messages.filter(|m| !m.is_empty()) {
            return Some(DatasetEntry { prompt: Prompt::Messages(messages), max_tokens: self.max_tokens });
        }
        let turns = self.conversations?;
        let pos = turns.iter().position(|t| t.from == "human" || t.from == "user")?;
        let reply = turns
            .get(pos + 1..)
            .and_then(|rest| rest.iter().find(|t| t.from == "gpt" || t.from == "assistant"))
            .map(|t| u32::try_from(t.value.split_whitespace().count()).unwrap_or(u32::MAX))
            .filter(|&n| n > 0);
        let prompt = turns.into_iter().nth(pos)?.value;
        if prompt.trim().is_empty() {
            return None;
        }
        Some(DatasetEntry { prompt: Prompt::Text(prompt), max_tokens: self.max_tokens.or(reply) })
    }
}

/// Parses dataset text (JSON Lines, or a JSON array). Entries without a
/// usable prompt are skipped; malformed lines are errors (with line number).
pub fn parse_dataset(text: &str) -> Result<Vec<DatasetEntry>, String> {
    if text.trim_start().starts_with('[') {
        let raw: Vec<RawEntry> = serde_json::from_str(text).map_err(|e| e.to_string())?;
        return Ok(raw.into_iter().filter_map(RawEntry::normalize).collect());
    }
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let raw: RawEntry = serde_json::from_str(line).map_err(|e| format!("line {}: {e}", i + 1))?;
        out.extend(raw.normalize());
    }
    Ok(out)
}

fn read_dataset(path: &Path) -> Result<Vec<DatasetEntry>, BenchError> {
    let text = std::fs::read_to_string(path).map_err(|e| BenchError::io(path, e))?;
    let entries =
        parse_dataset(&text).map_err(|message| BenchError::Dataset { path: path.into(), message })?;
    if entries.is_empty() {
        return Err(BenchError::Dataset { path: path.into(), message: "no usable prompts".into() });
    }
    Ok(entries)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_prompts_have_requested_length_and_differ() {
        let w = Workload::load(
            &WorkloadSpec::Random { input_len: 32, output_len: 16, ignore_eos: true },
            Endpoint::Chat,
            "m",
            true,
        )
        .unwrap();
        let reqs = w.requests_for_point(5, 1).unwrap();
        assert_eq!(reqs.len(), 5);
        let v: serde_json::Value = serde_json::from_slice(&reqs[0].body).unwrap();
        assert_eq!(v["model"], "m");
        assert_eq!(v["max_tokens"], 16);
        assert_eq!(v["stream"], true);
        assert_eq!(v["stream_options"]["include_usage"], true);
        assert_eq!(v["ignore_eos"], true);
        let content = v["messages"][0]["content"].as_str().unwrap();
        assert_eq!(content.split(' ').count(), 32);
        assert_ne!(reqs[0].body, reqs[1].body);
        // Same seed → same prompts; other seed → different ones.
        assert_eq!(w.requests_for_point(5, 1).unwrap()[0].body, reqs[0].body);
        assert_ne!(w.requests_for_point(5, 2).unwrap()[0].body, reqs[0].body);
    }

    #[test]
    fn completions_body_shape() {
        let b = build_body(Endpoint::Completions, "m", "hi there", 7, false, false).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(v["prompt"], "hi there");
        assert!(v.get("messages").is_none());
        assert!(v.get("ignore_eos").is_none());
        // Not asked for: no `stream_options` at all, as the OpenAI SDKs send by default.
        assert!(v.get("stream_options").is_none());
        assert_eq!(v["max_tokens"], 7);
    }

    #[test]
    fn dataset_formats() {
        let jsonl = r#"{"prompt": "tell me a story", "max_tokens": 50}
{"prompt": "no limit"}

{"conversations":[{"from":"system","value":"sys"},{"from":"human","value":"what is rust"},{"from":"gpt","value":"a systems language"}]}
{"conversations":[{"from":"gpt","value":"orphan"}]}
"#;
        let e = parse_dataset(jsonl).unwrap();
        assert_eq!(e.len(), 3);
        assert_eq!(
            e[0],
            DatasetEntry { prompt: Prompt::Text("tell me a story".into()), max_tokens: Some(50) }
        );
        assert_eq!(e[1].max_tokens, None);
        assert_eq!(e[2], DatasetEntry { prompt: Prompt::Text("what is rust".into()), max_tokens: Some(3) });
        let arr = r#"[{"conversations":[{"from":"human","value":"q"},{"from":"gpt","value":"a b"}]}]"#;
        assert_eq!(parse_dataset(arr).unwrap()[0].max_tokens, Some(2));
        assert!(parse_dataset("{not json}\n").unwrap_err().contains("line 1"));
    }

    #[test]
    fn dataset_sampling_cycles_and_overrides_output_len() {
        let dir = std::env::temp_dir().join(format!("gateway-bench-ds-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("d.jsonl");
        std::fs::write(&path, "{\"prompt\":\"a\",\"max_tokens\":5}\n{\"prompt\":\"b\"}\n").unwrap();
        let spec = WorkloadSpec::Dataset {
            path: path.clone(),
            output_len: Some(9),
            ignore_eos: false,
            order: DatasetOrder::Shuffled,
        };
        let w = Workload::load(&spec, Endpoint::Completions, "m", true).unwrap();
        assert_eq!(w.dataset_len(), 2);
        let reqs = w.requests_for_point(5, 0).unwrap();
        assert_eq!(reqs.len(), 5);
        assert!(reqs.iter().all(|r| r.max_tokens == 9));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn chat_messages_entries_go_in_file_order() {
        let dir = std::env::temp_dir().join(format!("gateway-bench-msgs-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("d.jsonl");
        let lines = [
            r#"{"messages":[{"role":"system","content":"be brief"},{"role":"user","content":"one"}],"max_tokens":4}"#,
            r#"{"messages":[{"role":"system","content":"be brief"},{"role":"user","content":"one"},{"role":"assistant","content":"ok"},{"role":"user","content":"two"}]}"#,
            r#"{"prompt":"three"}"#,
        ];
        std::fs::write(&path, lines.join("\n")).unwrap();
        let spec = WorkloadSpec::Dataset {
            path: path.clone(),
            output_len: None,
            ignore_eos: false,
            order: DatasetOrder::InOrder,
        };
        let w = Workload::load(&spec, Endpoint::Chat, "m", true).unwrap();
        let reqs = w.requests_for_point(7, 3).unwrap();
        let firsts: Vec<serde_json::Value> =
            reqs.iter().map(|r| serde_json::from_slice::<serde_json::Value>(&r.body).unwrap()).collect();
        // File order, cycling; the whole history is sent.
        assert_eq!(firsts[0]["messages"].as_array().unwrap().len(), 2);
        assert_eq!(firsts[0]["messages"][0]["role"], "system");
        assert_eq!(firsts[0]["max_tokens"], 4);
        assert_eq!(firsts[1]["messages"].as_array().unwrap().len(), 4);
        assert_eq!(firsts[1]["messages"][3]["content"], "two");
        assert_eq!(firsts[2]["messages"][0]["content"], "three");
        assert_eq!(firsts[3]["messages"], firsts[0]["messages"]);
        assert_eq!(reqs[1].prompt_words, 5);
        // A chat entry cannot go to /v1/completions.
        let err = Workload::load(&spec, Endpoint::Completions, "m", true).unwrap_err();
        assert!(err.to_string().contains("entry 1"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
