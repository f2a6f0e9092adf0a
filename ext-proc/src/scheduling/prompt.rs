//! The prompt of an OpenAI request body, read the way the wasm filter hashes it
//! ([`gateway_contract::prefix`]), for the endpoint-picker role, which sees the raw body.
//!
//! Chat (`messages`): each message's `role` and `content` (a string, or the `text` of its
//! `{"type": "text"}` parts, concatenated); completions (`prompt`): a string, or an array of
//! exactly one string. Anything else (a batch of prompts, token ids, a body that is not JSON)
//! gets no hashes: such a request is picked without prefix affinity.

use gateway_contract::prefix::BlockHasher;
use serde::Deserialize;

#[derive(Deserialize)]
struct Body<'a> {
    #[serde(default, borrow)]
    model: Option<std::borrow::Cow<'a, str>>,
    #[serde(default)]
    messages: Option<Vec<Message>>,
    #[serde(default)]
    prompt: Option<serde_json::Value>,
}

#[derive(Deserialize)]
struct Message {
    #[serde(default)]
    role: String,
    #[serde(default)]
    content: Option<Content>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Parts(Vec<Part>),
    Other(serde::de::IgnoredAny),
}

#[derive(Deserialize)]
struct Part {
    #[serde(default, rename = "type")]
    kind: String,
    #[serde(default)]
    text: Option<String>,
}

/// The body's `model` and its prompt's chained block hashes (`block_bytes`, at most
/// `max_blocks`); `None` when the body is not a JSON object with a hashable prompt.
pub fn body_hashes(body: &[u8], block_bytes: usize, max_blocks: usize) -> Option<(String, Vec<u64>)> {
    let parsed: Body<'_> = serde_json::from_slice(body).ok()?;
    let model = parsed.model.map(std::borrow::Cow::into_owned).unwrap_or_default();
    let mut hasher = BlockHasher::new(&model, block_bytes, max_blocks);
    if let Some(messages) = parsed.messages {
        for m in &messages {
            let texts: Vec<&str> = match &m.content {
                Some(Content::Text(t)) => vec![t.as_str()],
                Some(Content::Parts(parts)) => {
                    parts.iter().filter(|p| p.kind == "text").filter_map(|p| p.text.as_deref()).collect()
                }
                Some(Content::Other(_)) | None => Vec::new(),
            };
            if !hasher.message(&m.role, texts) {
                break;
            }
        }
    } else {
        let text = match parsed.prompt? {
            serde_json::Value::String(t) => t,
            serde_json::Value::Array(mut items) if items.len() == 1 => match items.pop() {
                Some(serde_json::Value::String(t)) => t,
                _ => return None,
            },
            _ => return None,
        };
        hasher.feed(text.as_bytes());
    }
    Some((model, hasher.finish()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference(model: &str, feed: &[u8]) -> Vec<u64> {
        let mut h = BlockHasher::new(model, 4, 64);
        h.feed(feed);
        h.finish()
    }

    #[test]
    fn chat_and_completions_hash_as_the_filter_does() {
        let (m, h) = body_hashes(
            br#"{"model":"m","messages":[{"role":"system","content":"be brief"},{"role":"user","content":[{"type":"text","text":"hi "},{"type":"image_url","image_url":{}},{"type":"text","text":"there"}]}]}"#,
            4,
            64,
        )
        .unwrap();
        assert_eq!(m, "m");
        assert_eq!(h, reference("m", b"system\0be brief\0user\0hi there\0"));
        let (_, h) = body_hashes(br#"{"model":"m","prompt":"abcdefgh"}"#, 4, 64).unwrap();
        assert_eq!(h, reference("m", b"abcdefgh"));
        let (_, h) = body_hashes(br#"{"model":"m","prompt":["abcdefgh"]}"#, 4, 64).unwrap();
        assert_eq!(h, reference("m", b"abcdefgh"));
    }

    #[test]
    fn batches_token_prompts_and_non_json_get_none() {
        assert!(body_hashes(br#"{"model":"m","prompt":["a","b"]}"#, 4, 64).is_none());
        assert!(body_hashes(br#"{"model":"m","prompt":[1,2,3]}"#, 4, 64).is_none());
        assert!(body_hashes(b"not json", 4, 64).is_none());
        assert!(body_hashes(br#"{"model":"m"}"#, 4, 64).is_none());
    }
}
