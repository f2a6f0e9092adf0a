//! Prompt-prefix block hashes for the sidecar's endpoint picker (`prefix_hashing` in the plugin
//! configuration; issue 12's prefix affinity).
//!
//! The prompt text is cut from its start into blocks of `block_bytes` bytes; each full block is
//! hashed with XXH3-64 (crate `xxhash-rust`, pure Rust: the same values on wasm32 and the host)
//! seeded with the previous block's hash, so block `i`'s hash stands for the whole prefix up to
//! and including it, as the Gateway API Inference Extension's prefix-cache scorer does. The chain
//! starts from the XXH3-64 of the model name (the facts' `model`: vLLM's prefix cache is per model
//! and per LoRA adapter). A trailing partial block is not hashed (a longer prompt sharing the
//! prefix would hash it differently), and at most `max_blocks` blocks are.
//!
//! The text: for chat, each message in order as its `role`, a 0 byte, the text of its `content`
//! (the string, or the `text` parts concatenated), a 0 byte; for completions, the prompt string.
//! A batched completions prompt (several prompts), a pre-tokenized prompt and embeddings get no
//! hashes; neither does a body over `full_parse_max_bytes`, whose prompt the filter only scans
//! (`pipeline::on_large_body`): those requests are picked without prefix affinity.

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

use crate::config::PrefixHashing;
use crate::request::{Prompt, PromptItem};

/// Cuts a byte stream into blocks and hashes each full block, chained, up to a bound.
struct BlockHasher {
    block: Vec<u8>,
    block_bytes: usize,
    max_blocks: usize,
    previous: u64,
    hashes: Vec<u64>,
}

impl BlockHasher {
    fn new(config: PrefixHashing, seed: u64) -> Self {
        let block_bytes = usize::try_from(config.block_bytes).unwrap_or(usize::MAX).max(1);
        let max_blocks = usize::try_from(config.max_blocks).unwrap_or(usize::MAX);
        Self {
            block: Vec::with_capacity(block_bytes),
            block_bytes,
            max_blocks,
            previous: seed,
            hashes: Vec::new(),
        }
    }

    fn full(&self) -> bool {
        self.hashes.len() >= self.max_blocks
    }

    /// Feeds bytes; returns false once `max_blocks` are hashed (nothing more is needed).
    fn feed(&mut self, mut bytes: &[u8]) -> bool {
        while !bytes.is_empty() && !self.full() {
            let room = self.block_bytes.saturating_sub(self.block.len());
            let (head, rest) = bytes.split_at(room.min(bytes.len()));
            self.block.extend_from_slice(head);
            bytes = rest;
            if self.block.len() == self.block_bytes {
                self.previous = xxh3_64_with_seed(&self.block, self.previous);
                self.hashes.push(self.previous);
                self.block.clear();
            }
        }
        !self.full()
    }
}

/// The chained block hashes of a request's prompt for `model` (see the module doc); `None` for
/// prompts that get none (batched, pre-tokenized).
pub fn prompt_hashes(config: PrefixHashing, model: &str, prompt: &Prompt<'_>) -> Option<Vec<u64>> {
    let mut hasher = BlockHasher::new(config, xxh3_64(model.as_bytes()));
    match prompt {
        Prompt::Chat(messages) => {
            for m in messages {
                let mut more = hasher.feed(m.role.as_bytes()) && hasher.feed(&[0]);
                for text in &m.texts {
                    more = more && hasher.feed(text.as_bytes());
                }
                if !(more && hasher.feed(&[0])) {
                    break;
                }
            }
        }
        Prompt::Items(items) => match items.as_slice() {
            [PromptItem::Text(text)] => {
                hasher.feed(text.as_bytes());
            }
            _ => return None,
        },
    }
    Some(hasher.hashes)
}

/// [`prompt_hashes`] in the facts' encoding ([`gateway_contract::encode_prefix_hashes`]); `None`
/// when the prompt gets no hashes or is shorter than one block.
pub fn encoded_prompt_hashes(config: PrefixHashing, model: &str, prompt: &Prompt<'_>) -> Option<String> {
    prompt_hashes(config, model, prompt)
        .filter(|h| !h.is_empty())
        .map(|h| gateway_contract::encode_prefix_hashes(&h))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::ChatMessage;

    const CFG: PrefixHashing = PrefixHashing { block_bytes: 4, max_blocks: 8 };

    fn chat<'a>(messages: &[(&'a str, &'a str)]) -> Prompt<'a> {
        Prompt::Chat(messages.iter().map(|(role, text)| ChatMessage { role, texts: vec![text] }).collect())
    }

    #[test]
    fn blocks_are_chained_from_the_model_seed() {
        let p = Prompt::Items(vec![PromptItem::Text("abcdefgh-x")]);
        let h = prompt_hashes(CFG, "m", &p).unwrap();
        let first = xxh3_64_with_seed(b"abcd", xxh3_64(b"m"));
        assert_eq!(h, vec![first, xxh3_64_with_seed(b"efgh", first)], "the partial block is not hashed");
        // XXH3 is specified bit for bit (the same on wasm32 and the host): the reference
        // implementation's value for the empty input, and this one pinned.
        assert_eq!(xxh3_64(b""), 0x2d06_8005_38d3_94c2);
        assert_eq!(xxh3_64(b"m"), 0xf090_4807_418c_57fc);
        assert_ne!(prompt_hashes(CFG, "other", &p).unwrap(), h, "another model, another chain");
    }

    #[test]
    fn a_shared_prefix_shares_hashes_and_a_change_breaks_the_chain_after_it() {
        let sys = "you are a helpful assistant";
        let a = prompt_hashes(CFG, "m", &chat(&[("system", sys), ("user", "what is 1+1?")])).unwrap();
        let b = prompt_hashes(CFG, "m", &chat(&[("system", sys), ("user", "tell me a joke")])).unwrap();
        let shared = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
        // "system\0" + sys + "\0" + "user\0" = 7 + 27 + 1 + 5 = 40 bytes = 10 blocks, capped at 8.
        assert_eq!((a.len(), shared), (8, 8));
        let cfg = PrefixHashing { block_bytes: 4, max_blocks: 64 };
        let a = prompt_hashes(cfg, "m", &chat(&[("system", sys), ("user", "what is 1+1?")])).unwrap();
        let b = prompt_hashes(cfg, "m", &chat(&[("system", sys), ("user", "tell me a joke")])).unwrap();
        let shared = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
        assert_eq!(shared, 10, "the blocks before the first differing byte");
        // The role is part of the text: the same words from another role are another prefix.
        let c = prompt_hashes(cfg, "m", &chat(&[("user", sys)])).unwrap();
        assert_ne!(c.first(), a.first());
    }

    #[test]
    fn text_parts_hash_like_the_string_they_concatenate() {
        let parts =
            Prompt::Chat(vec![ChatMessage { role: "user", texts: vec!["hello ", "world, how are you"] }]);
        assert_eq!(
            prompt_hashes(CFG, "m", &parts),
            prompt_hashes(CFG, "m", &chat(&[("user", "hello world, how are you")]))
        );
    }

    #[test]
    fn batches_and_tokens_get_none_and_short_prompts_encode_to_none() {
        let batch = Prompt::Items(vec![PromptItem::Text("abcdefgh"), PromptItem::Text("abcdefgh")]);
        assert_eq!(prompt_hashes(CFG, "m", &batch), None);
        assert_eq!(prompt_hashes(CFG, "m", &Prompt::Items(vec![PromptItem::Tokens(9)])), None);
        let short = Prompt::Items(vec![PromptItem::Text("abc")]);
        assert_eq!(prompt_hashes(CFG, "m", &short), Some(vec![]));
        assert_eq!(encoded_prompt_hashes(CFG, "m", &short), None);
        let long = Prompt::Items(vec![PromptItem::Text("abcdefgh")]);
        let encoded = encoded_prompt_hashes(CFG, "m", &long).unwrap();
        assert_eq!(gateway_contract::decode_prefix_hashes(&encoded, 8), prompt_hashes(CFG, "m", &long));
    }

    #[test]
    fn at_most_max_blocks_are_hashed() {
        let text = "x".repeat(10_000);
        let p = Prompt::Items(vec![PromptItem::Text(&text)]);
        assert_eq!(prompt_hashes(CFG, "m", &p).map(|h| h.len()), Some(8));
    }
}
