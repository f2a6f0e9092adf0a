//! Prefix homes: where each prompt prefix a pool has seen lives, so that the replicas' caches
//! stay disjoint.
//!
//! The per-endpoint prefix index alone lets a popular prefix spread: once a load bound sends one
//! of its requests elsewhere, two endpoints hold it, the next pick goes to whichever is less busy,
//! and soon every endpoint caches every prefix, each cache holding less of what it is asked for.
//! A prefix's *home* is the endpoint its first request was picked for: every prompt block (by its
//! chained hash, which stands for the whole prefix up to it) gets the endpoint that first served
//! it, and keeps it while it is remembered (an LRU, [`Homes`]). A request goes to the home of its
//! longest homed prefix while the home is under its bounded-load capacity
//! ([`within_capacity`]); past it the ranking picks, and the request's own new blocks (those past
//! the homed prefix) get the endpoint it went to, while the prefix keeps its home. So a multi-turn
//! conversation follows its first turn, a shared document stays where it was first read, and a
//! prefix that overflows for a moment does not move. A home that is not eligible (down, stale,
//! outside the subset) is replaced by the request's pick.
//!
//! The capacity is that of consistent hashing with bounded loads (Mirrokni, Thorup and
//! Zadimoghaddam; HAProxy's `hash-balance-factor` uses the same bound): an endpoint takes a
//! request while `occupancy + 1 <= ceil(factor x (occupancy of all + 1) / endpoints)`, occupancy
//! being the requests it holds ([`crate::scheduling::scorers::Candidate::occupancy`]). The least
//! occupied endpoint is always under it (for `factor >= 1`), so one prefix can take no more than
//! `factor` times its fair share of a pool; a prompt all requests share (a common system prompt)
//! costs at most that imbalance.

use std::num::NonZeroUsize;

use lru::LruCache;

/// The pool's prompt blocks and the endpoint (by index, in the pool's config order) that first
/// served each, at most a capacity of them (the least recent forgotten).
#[derive(Debug)]
pub struct Homes {
    blocks: LruCache<u64, usize>,
}

impl Homes {
    /// No homes yet, remembering at most `capacity` blocks (at least 1).
    pub fn new(capacity: usize) -> Self {
        Self { blocks: LruCache::new(NonZeroUsize::new(capacity).unwrap_or(NonZeroUsize::MIN)) }
    }

    /// The home of the longest of `hashes`' prefixes that has one: (endpoint index, the prefix's
    /// blocks). `None` when no block of the prompt has a home. Lookups do not refresh recency.
    pub fn of(&self, hashes: &[u64]) -> Option<(usize, usize)> {
        let at = hashes.iter().rposition(|h| self.blocks.contains(h))?;
        let home = *self.blocks.peek(hashes.get(at)?)?;
        Some((home, at + 1))
    }

    /// A request whose prompt hashes to `hashes` went to `endpoint`: its blocks from index `from`
    /// on get `endpoint` as their home, the first `from` (a homed prefix) keep theirs; all are
    /// refreshed, the first block most recently (as [`crate::scheduling::prefix_index`] does).
    pub fn record(&mut self, hashes: &[u64], endpoint: usize, from: usize) {
        for (i, h) in hashes.iter().enumerate().rev() {
            if i >= from || self.blocks.get(h).is_none() {
                self.blocks.put(*h, endpoint);
            }
        }
    }

    /// Blocks remembered now.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Whether no block has a home.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }
}

/// Whether candidate `at` of those holding `occupancy` requests (same order) may take one more
/// under `factor`: `occupancy[at] + 1 <= ceil(factor x (sum + 1) / n)`. A non-finite occupancy
/// counts as full (and not in the sum); false for an index out of range or a `factor` that is not
/// a finite number >= 1.
pub fn within_capacity(occupancy: &[f64], at: usize, factor: f64) -> bool {
    if !(factor.is_finite() && factor >= 1.0) {
        return false;
    }
    let Some(held) = occupancy.get(at).copied().filter(|v| v.is_finite()) else {
        return false;
    };
    let total: f64 = occupancy.iter().filter(|v| v.is_finite()).map(|v| v.max(0.0)).sum();
    let capacity = (factor * (total + 1.0) / occupancy.len() as f64).ceil();
    held.max(0.0) + 1.0 <= capacity
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_keeps_the_home_of_its_first_request_and_new_blocks_take_the_pick() {
        let mut h = Homes::new(100);
        assert_eq!(h.of(&[1, 2, 3]), None);
        // Turn 1 of a conversation went to endpoint 0.
        h.record(&[1, 2, 3], 0, 0);
        assert_eq!(h.of(&[1, 2, 3, 4, 5]), Some((0, 3)));
        // Turn 2 spilled to endpoint 1: its prefix stays at 0, its new blocks live at 1.
        h.record(&[1, 2, 3, 4, 5], 1, 3);
        assert_eq!(h.of(&[1, 2, 3, 9]), Some((0, 3)));
        assert_eq!(h.of(&[1, 2, 3, 4, 5, 6]), Some((1, 5)), "turn 3 follows turn 2's context");
        // A home that went away is replaced from the first block.
        h.record(&[1, 2, 3], 1, 0);
        assert_eq!(h.of(&[1, 2, 3, 9]), Some((1, 3)));
        assert_eq!(h.of(&[7]), None);
    }

    #[test]
    fn homes_are_bounded_and_a_prompts_first_block_is_forgotten_last() {
        let mut h = Homes::new(4);
        h.record(&[1, 2, 3], 0, 0);
        h.record(&[10, 11, 12], 1, 0);
        assert_eq!(h.len(), 4);
        assert_eq!(h.of(&[10, 11, 12]), Some((1, 3)));
        assert_eq!(h.of(&[1, 2, 3]), Some((0, 1)), "the first request's deeper blocks went first");
        assert!(Homes::new(0).is_empty(), "a capacity of 0 is taken as 1");
    }

    #[test]
    fn the_capacity_bounds_one_endpoint_to_factor_times_its_share() {
        // 8 held on two endpoints, capacity ceil(1.25 x 9 / 2) = 6.
        assert!(within_capacity(&[5.0, 3.0], 0, 1.25));
        assert!(!within_capacity(&[6.0, 2.0], 0, 1.25));
        // At factor 1, only an endpoint at or under its fair share: ceil(9 / 2) = 5.
        assert!(within_capacity(&[4.0, 4.0], 0, 1.0));
        assert!(!within_capacity(&[5.0, 3.0], 0, 1.0));
        // A larger factor lets a home take more.
        assert!(within_capacity(&[6.0, 2.0], 0, 2.0));
    }

    #[test]
    fn the_least_occupied_endpoint_is_always_under_capacity() {
        for total in 0..40u32 {
            for at in 0..3usize {
                let occupancy: Vec<f64> =
                    (0..3).map(|i| if i == at { 0.0 } else { f64::from(total) }).collect();
                assert!(within_capacity(&occupancy, at, 1.0), "total {total}, idle {at}");
            }
        }
    }

    #[test]
    fn bad_inputs_are_never_under_capacity() {
        assert!(!within_capacity(&[], 0, 1.25));
        assert!(!within_capacity(&[0.0], 1, 1.25));
        assert!(!within_capacity(&[0.0, 0.0], 0, 0.5));
        assert!(!within_capacity(&[0.0, 0.0], 0, f64::NAN));
        assert!(!within_capacity(&[f64::NAN, 0.0], 0, 1.25), "a non-finite occupancy is full");
        assert!(within_capacity(&[f64::NAN, 0.0], 1, 1.25));
    }
}
