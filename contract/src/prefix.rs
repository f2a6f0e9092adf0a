//! Prompt-prefix block hashes: the one definition the wasm filter (from its parsed body) and the
//! sidecar's endpoint-picker role (from the body Envoy streams to it) both use, so that the same
//! prompt gets the same hashes on either path (issue 12's prefix affinity).
//!
//! The prompt text is cut from its start into blocks of `block_bytes` bytes; each full block is
//! hashed with XXH3-64 (crate `xxhash-rust`, pure Rust: the same values on wasm32 and the host)
//! seeded with the previous block's hash, so block `i`'s hash stands for the whole prefix up to
//! and including it, as the Gateway API Inference Extension's prefix-cache scorer does. The chain
//! starts from the XXH3-64 of the model name (vLLM's prefix cache is per model and per LoRA
//! adapter). A trailing partial block is not hashed (a longer prompt sharing the prefix would
//! hash it differently), and at most `max_blocks` blocks are.
//!
//! The text: for chat, each message in order as its `role`, a 0 byte, the text of its `content`
//! (the string, or the `text` parts concatenated), a 0 byte ([`BlockHasher::message`]); for
//! completions, the prompt string ([`BlockHasher::feed`]).

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// Cuts a byte stream into blocks and hashes each full block, chained, up to a bound.
#[derive(Debug, Clone)]
pub struct BlockHasher {
    block: Vec<u8>,
    block_bytes: usize,
    max_blocks: usize,
    previous: u64,
    hashes: Vec<u64>,
}

impl BlockHasher {
    /// A hasher for `model`'s prompts: blocks of `block_bytes` (at least 1), at most `max_blocks`.
    pub fn new(model: &str, block_bytes: usize, max_blocks: usize) -> Self {
        let block_bytes = block_bytes.max(1);
        Self {
            block: Vec::with_capacity(block_bytes),
            block_bytes,
            max_blocks,
            previous: xxh3_64(model.as_bytes()),
            hashes: Vec::new(),
        }
    }

    /// Whether `max_blocks` blocks are hashed (nothing more is needed).
    pub fn full(&self) -> bool {
        self.hashes.len() >= self.max_blocks
    }

    /// Feeds bytes; returns false once `max_blocks` are hashed.
    pub fn feed(&mut self, mut bytes: &[u8]) -> bool {
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

    /// Feeds one chat message: its role, a 0 byte, its texts, a 0 byte. Returns false once full.
    pub fn message<'t>(&mut self, role: &str, texts: impl IntoIterator<Item = &'t str>) -> bool {
        let mut more = self.feed(role.as_bytes()) && self.feed(&[0]);
        for text in texts {
            more = more && self.feed(text.as_bytes());
        }
        more && self.feed(&[0])
    }

    /// The hashes of the full blocks fed so far.
    pub fn finish(self) -> Vec<u64> {
        self.hashes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_chained_from_the_model_seed_and_partial_blocks_are_dropped() {
        let mut h = BlockHasher::new("m", 4, 8);
        h.feed(b"abcdefgh-x");
        let first = xxh3_64_with_seed(b"abcd", xxh3_64(b"m"));
        assert_eq!(h.finish(), vec![first, xxh3_64_with_seed(b"efgh", first)]);
        // XXH3 is specified bit for bit (the same on wasm32 and the host).
        assert_eq!(xxh3_64(b""), 0x2d06_8005_38d3_94c2);
    }

    #[test]
    fn messages_are_role_nul_texts_nul_and_the_bound_holds() {
        let mut a = BlockHasher::new("m", 4, 3);
        assert!(!a.message("user", ["hello ", "world"]), "full after 3 blocks");
        let mut b = BlockHasher::new("m", 4, 3);
        b.feed(b"user\0hello world\0");
        assert_eq!(a.finish(), b.finish());
    }
}
