//! Per endpoint, the prompt-block hashes it served recently: an LRU (crate `lru`) bounded by
//! `pools[].picker.prefix_lru_blocks`, an approximation of the replica's prefix cache (which
//! evicts least-recently-used blocks too). The hashes are chained (the filter's
//! `gateway_filter::prefix`): block `i`'s hash stands for the whole prefix up to it, so the
//! longest match is the last of the request's hashes the LRU holds, looked up from the longest
//! prefix down.

use std::num::NonZeroUsize;

use lru::LruCache;

/// One endpoint's recently served block hashes.
#[derive(Debug)]
pub struct PrefixIndex {
    blocks: LruCache<u64, ()>,
}

impl PrefixIndex {
    /// An empty index holding at most `capacity` hashes (at least 1).
    pub fn new(capacity: usize) -> Self {
        Self { blocks: LruCache::new(NonZeroUsize::new(capacity).unwrap_or(NonZeroUsize::MIN)) }
    }

    /// The request's leading blocks this endpoint served: 1 + the index of the last of `hashes`
    /// the index holds (longest prefix first), 0 when none. Lookups do not refresh recency.
    pub fn matched(&self, hashes: &[u64]) -> usize {
        hashes.iter().rposition(|h| self.blocks.contains(h)).map_or(0, |i| i + 1)
    }

    /// Records the request's hashes as served here, the first block most recently (every longer
    /// prefix needs it), so a full index evicts the deepest blocks first, as vLLM frees a
    /// sequence's blocks from its tail.
    pub fn record(&mut self, hashes: &[u64]) {
        for h in hashes.iter().rev() {
            self.blocks.put(*h, ());
        }
    }

    /// Holds at most `capacity` hashes from now on (at least 1), the least recent evicted.
    pub fn set_capacity(&mut self, capacity: usize) {
        self.blocks.resize(NonZeroUsize::new(capacity).unwrap_or(NonZeroUsize::MIN));
    }

    /// Hashes held now.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_longest_recorded_prefix() {
        let mut i = PrefixIndex::new(100);
        assert_eq!(i.matched(&[1, 2, 3]), 0);
        i.record(&[1, 2, 3]);
        assert_eq!(i.matched(&[1, 2, 3, 4, 5]), 3);
        assert_eq!(i.matched(&[1, 2, 9]), 2);
        assert_eq!(i.matched(&[7, 8]), 0);
        assert_eq!(i.matched(&[]), 0);
    }

    #[test]
    fn the_lru_is_bounded_and_evicts_the_least_recent() {
        let mut i = PrefixIndex::new(4);
        i.record(&[1, 2, 3]);
        i.record(&[10, 11, 12]);
        assert_eq!(i.len(), 4, "bounded by the capacity");
        // The most recent four: the second request's 12, 11, 10 and the first request's head 1
        // (each request refreshes its first block last).
        assert_eq!(i.matched(&[10, 11, 12]), 3);
        assert_eq!(i.matched(&[1]), 1);
        assert_eq!(i.matched(&[1, 2, 3]), 1, "the first request's deeper blocks were evicted");
        assert!(PrefixIndex::new(0).is_empty(), "a capacity of 0 is taken as 1");
    }
}
