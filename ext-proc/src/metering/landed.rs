//! The record ids whose ledger write this replica saw land in Redis, so the usage journal
//! ([`crate::metering::journal`]) does not send Redis a second write it would answer with "nothing to do".
//!
//! Every access-log entry reaches the ledger twice on a standalone Envoy: first through the gRPC
//! access log ([`crate::metering::recorder`]), then, about a second later, as a line of the journal file. The
//! second write is idempotent (`lua/ledger_v1.lua` deduplicates it by its record id) but not free:
//! one more script call per request, the most expensive thing Redis did per request after the
//! first write (measured with `INFO commandstats` through `bench/overhead.py`'s leased gateway:
//! three `EVALSHA` per request, 18.6 µs each on average). The journal skips the lines whose write
//! this replica already confirmed; every other line (a write still buffered, failed, given up, or
//! done by another replica, and every line after a restart, which starts with an empty set) goes
//! to Redis as before, so the journal repairs exactly what it repaired before.
//!
//! What it gives up: should Redis lose a write it had acknowledged (a failover to a replica that
//! had not received it yet), the journal no longer writes it again. It never did so for a line it
//! had passed already, and Redis's own replication, not the journal, is what covers that window.
//!
//! The set is bounded by count ([`LANDED_IDS`], least recently added evicted first: about 30 s of
//! lines at a thousand requests a second, 6 s at the five thousand of the saturation benchmark,
//! while the journal trails the gRPC path by about a second), so its memory is bounded whatever
//! the rate. It keeps a 64-bit hash of each id, not the id: about 2 MB in all. Two ids share a
//! hash with odds of about one in 2^49 per line; a shared hash would skip a line only if the gRPC
//! path had also lost that line's write.

use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::Mutex;

use lru::LruCache;

/// How many record ids are remembered.
pub const LANDED_IDS: usize = 32_768;

/// The set of record ids whose ledger write landed (shared by the recorder's writer and the
/// journal; cheap to lock: one hash lookup or insert).
pub struct Landed {
    ids: Mutex<LruCache<u64, ()>>,
}

/// The id's 64-bit hash (SipHash with fixed keys: the same in every call of the process).
fn hash_of(record_id: &str) -> u64 {
    let mut hasher = DefaultHasher::new();
    record_id.hash(&mut hasher);
    hasher.finish()
}

impl Default for Landed {
    fn default() -> Self {
        Self::with_capacity(LANDED_IDS)
    }
}

impl Landed {
    /// A set that keeps the last `capacity` ids (at least one).
    pub fn with_capacity(capacity: usize) -> Self {
        let capacity = std::num::NonZeroUsize::new(capacity).unwrap_or(std::num::NonZeroUsize::MIN);
        Self { ids: Mutex::new(LruCache::new(capacity)) }
    }

    /// Remembers that `record_id`'s write is done in Redis (applied, or found applied already).
    pub fn insert(&self, record_id: &str) {
        if record_id.is_empty() {
            return;
        }
        let mut ids = self.ids.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        ids.put(hash_of(record_id), ());
    }

    /// Whether `record_id`'s write is known done.
    pub fn contains(&self, record_id: &str) -> bool {
        let ids = self.ids.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        ids.contains(&hash_of(record_id))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remembers_the_last_ids_and_never_the_empty_one() {
        let landed = Landed::with_capacity(2);
        landed.insert("a");
        landed.insert("b");
        landed.insert("");
        assert!(landed.contains("a") && landed.contains("b"));
        assert!(!landed.contains(""), "an entry without a record id is never skipped");
        landed.insert("c");
        assert!(!landed.contains("a"), "the oldest goes first");
        assert!(landed.contains("b") && landed.contains("c"));
    }
}
