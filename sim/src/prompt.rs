//! The rendered prompt's block hashes, for the batched engine's prefix cache.
//!
//! Without a tokenizer the sim's "token stream" of a prompt is its rendered bytes, 4 bytes a token
//! (as [`crate::tokens`] counts them), so a KV block of `block_size` tokens is `4 x block_size`
//! bytes:
//!
//! * chat: each message's `role` then its `content` (a string, or the `text` of its text parts
//!   in order; `null` and other parts render nothing), message after message, with no separator;
//! * completions: the `prompt` string; for an array, each string's bytes, each token id as 4 bytes
//!   (little-endian `u32`, so one id is one token) and each array of ids likewise;
//! * responses: as chat, over the messages vLLM builds: a non-empty `instructions` as `system`,
//!   then `input` (a string as `user`, or the message items of an array, their `input_text`,
//!   `output_text` and `text` parts).
//!
//! Every full block gets a chained hash, `hash(parent hash, block bytes)` from a fixed root (as
//! vLLM's prefix caching chains block hashes), so two prompts share block `i`'s hash exactly when
//! their first `i + 1` blocks are equal. The trailing partial block is not hashed. The hash is
//! std's SipHash with fixed keys: stable within a process, which is all one sim needs.

use std::hash::{DefaultHasher, Hash, Hasher};

use serde::Deserialize;

use crate::request::Endpoint;

/// Bytes of rendered prompt per token, as [`crate::tokens::text_tokens`] counts them.
pub const BYTES_PER_TOKEN: usize = 4;

/// The parent hash of a prompt's first block.
pub const ROOT_HASH: u64 = 0;

#[derive(Deserialize)]
struct ChatPrompt {
    messages: Vec<Message>,
}

#[derive(Deserialize)]
struct Message {
    #[serde(default)]
    role: Option<String>,
    #[serde(default)]
    content: Option<Content>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Deserialize)]
struct Part {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    text: Option<String>,
}

#[derive(Deserialize)]
struct ResponsesPrompt {
    #[serde(default)]
    instructions: Option<String>,
    input: ResponsesInput,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum ResponsesInput {
    Text(String),
    Items(Vec<InputItem>),
}

#[derive(Deserialize)]
struct InputItem {
    #[serde(rename = "type", default)]
    kind: Option<String>,
    #[serde(default)]
    role: Option<String>,
    #[serde(default)]
    content: Option<Content>,
}

#[derive(Deserialize)]
struct CompletionPrompt {
    prompt: PromptValue,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum PromptValue {
    Text(String),
    Items(Vec<PromptItem>),
}

#[derive(Deserialize)]
#[serde(untagged)]
enum PromptItem {
    Text(String),
    Id(u64),
    Ids(Vec<u64>),
}

/// Collects rendered bytes up to a limit.
struct Render {
    bytes: Vec<u8>,
    limit: usize,
}

impl Render {
    fn push(&mut self, part: &[u8]) {
        let room = self.limit.saturating_sub(self.bytes.len());
        self.bytes.extend_from_slice(part.get(..room.min(part.len())).unwrap_or_default());
    }

    fn push_id(&mut self, id: u64) {
        self.push(&u32::try_from(id).unwrap_or(u32::MAX).to_le_bytes());
    }
}

/// The chained hashes of the first `max_blocks` full blocks of `block_bytes` bytes of the
/// prompt rendered from `body` (a request body of `endpoint` that [`crate::request::parse`]
/// accepted); empty when the body does not have the expected shape or `block_bytes` is 0.
pub fn block_hashes(endpoint: Endpoint, body: &[u8], block_bytes: usize, max_blocks: usize) -> Vec<u64> {
    if block_bytes == 0 {
        return Vec::new();
    }
    let mut render = Render { bytes: Vec::new(), limit: block_bytes.saturating_mul(max_blocks) };
    match endpoint {
        Endpoint::Chat => {
            let Ok(chat) = serde_json::from_slice::<ChatPrompt>(body) else { return Vec::new() };
            for m in chat.messages {
                render.push(m.role.unwrap_or_default().as_bytes());
                match m.content {
                    Some(Content::Text(text)) => render.push(text.as_bytes()),
                    Some(Content::Parts(parts)) => {
                        for part in parts.iter().filter(|p| p.kind == "text") {
                            render.push(part.text.as_deref().unwrap_or_default().as_bytes());
                        }
                    }
                    None => {}
                }
            }
        }
        Endpoint::Responses => {
            let Ok(responses) = serde_json::from_slice::<ResponsesPrompt>(body) else { return Vec::new() };
            if let Some(instructions) = responses.instructions.filter(|i| !i.is_empty()) {
                render.push(b"system");
                render.push(instructions.as_bytes());
            }
            match responses.input {
                ResponsesInput::Text(text) => {
                    render.push(b"user");
                    render.push(text.as_bytes());
                }
                ResponsesInput::Items(items) => {
                    for item in items {
                        let message = matches!(item.kind.as_deref(), None | Some("message"));
                        let Some(role) = item.role.filter(|_| message) else { continue };
                        render.push(role.as_bytes());
                        match item.content {
                            Some(Content::Text(text)) => render.push(text.as_bytes()),
                            Some(Content::Parts(parts)) => {
                                for part in parts.iter().filter(|p| {
                                    matches!(p.kind.as_str(), "input_text" | "output_text" | "text")
                                }) {
                                    render.push(part.text.as_deref().unwrap_or_default().as_bytes());
                                }
                            }
                            None => {}
                        }
                    }
                }
            }
        }
        Endpoint::Completions => {
            let Ok(completion) = serde_json::from_slice::<CompletionPrompt>(body) else { return Vec::new() };
            match completion.prompt {
                PromptValue::Text(text) => render.push(text.as_bytes()),
                PromptValue::Items(items) => {
                    for item in items {
                        match item {
                            PromptItem::Text(text) => render.push(text.as_bytes()),
                            PromptItem::Id(id) => render.push_id(id),
                            PromptItem::Ids(ids) => ids.into_iter().for_each(|id| render.push_id(id)),
                        }
                    }
                }
            }
        }
    }
    chain_hashes(&render.bytes, block_bytes)
}

/// `hash(parent, block)` over the full `block_bytes` chunks of `bytes`, from [`ROOT_HASH`].
pub fn chain_hashes(bytes: &[u8], block_bytes: usize) -> Vec<u64> {
    if block_bytes == 0 {
        return Vec::new();
    }
    let mut parent = ROOT_HASH;
    bytes
        .chunks_exact(block_bytes)
        .map(|block| {
            let mut hasher = DefaultHasher::new();
            parent.hash(&mut hasher);
            block.hash(&mut hasher);
            parent = hasher.finish();
            parent
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn chat(messages: serde_json::Value) -> Vec<u64> {
        block_hashes(Endpoint::Chat, &serde_json::to_vec(&json!({"messages": messages})).unwrap(), 8, 100)
    }

    #[test]
    fn chat_renders_roles_and_contents_in_order() {
        // "user" + "abcdefghijkl" = 16 bytes: two blocks of 8.
        let a = chat(json!([{"role": "user", "content": "abcdefghijkl"}]));
        assert_eq!(a, chain_hashes(b"userabcdefghijkl", 8));
        assert_eq!(a.len(), 2);
        let parts = chat(json!([{"role": "user", "content": [
            {"type": "text", "text": "abcd"}, {"type": "image_url", "image_url": {"url": "x"}},
            {"type": "text", "text": "efghijkl"}]}]));
        assert_eq!(parts, a);
        // A shared first block, a different second one.
        let b = chat(json!([{"role": "user", "content": "abcdXXXXijkl"}]));
        assert_eq!(b.first(), a.first());
        assert_ne!(b.get(1), a.get(1));
        // The chain: equal second blocks after different first blocks hash differently.
        let c = chat(json!([{"role": "userX", "content": "bcdefghijkl"}]));
        assert_ne!(c.first(), a.first());
        assert_ne!(c.get(1), a.get(1));
        // A partial block is not hashed; null content renders nothing.
        assert_eq!(chat(json!([{"role": "user", "content": null}])), Vec::<u64>::new());
    }

    #[test]
    fn completions_render_strings_and_ids() {
        let hashes = |prompt: serde_json::Value| {
            block_hashes(
                Endpoint::Completions,
                &serde_json::to_vec(&json!({"prompt": prompt})).unwrap(),
                8,
                100,
            )
        };
        assert_eq!(hashes(json!("abcdefgh")), chain_hashes(b"abcdefgh", 8));
        assert_eq!(hashes(json!(["abcd", "efgh"])), chain_hashes(b"abcdefgh", 8));
        let ids = [1u32.to_le_bytes(), 2u32.to_le_bytes()].concat();
        assert_eq!(hashes(json!([1, 2])), chain_hashes(&ids, 8));
        assert_eq!(hashes(json!([[1, 2]])), chain_hashes(&ids, 8));
    }

    #[test]
    fn responses_render_as_the_chat_vllm_builds() {
        let hashes = |body: serde_json::Value| {
            block_hashes(Endpoint::Responses, &serde_json::to_vec(&body).unwrap(), 8, 100)
        };
        let chat_equivalent = chat(
            json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "abcdefgh"}]),
        );
        assert_eq!(hashes(json!({"instructions": "Be brief.", "input": "abcdefgh"})), chat_equivalent);
        let items = json!({"instructions": "Be brief.", "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "abcd"}, {"type": "input_image", "image_url": "u"}]},
            {"type": "function_call_output", "call_id": "c", "output": "zzzz"},
            {"role": "user", "content": "efgh"}]});
        // "system" "Be brief." "user" "abcd" "user" "efgh": a different third block than "userabcdefgh".
        assert_eq!(hashes(items), chain_hashes(b"systemBe brief.userabcduserefgh", 8));
        assert_eq!(
            hashes(json!({"instructions": "", "input": "abcdefgh"})),
            chain_hashes(b"userabcdefgh", 8)
        );
        assert!(hashes(json!({"input": 5})).is_empty());
    }

    #[test]
    fn max_blocks_and_bad_bodies() {
        let body = serde_json::to_vec(&json!({"prompt": "a".repeat(100)})).unwrap();
        assert_eq!(block_hashes(Endpoint::Completions, &body, 8, 3).len(), 3);
        assert_eq!(block_hashes(Endpoint::Completions, &body, 8, 100).len(), 12);
        assert!(block_hashes(Endpoint::Completions, &body, 0, 100).is_empty());
        assert!(block_hashes(Endpoint::Chat, b"{", 8, 100).is_empty());
    }
}
