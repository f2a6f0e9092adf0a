//! Whether a pool has room for one more request, with no I/O: its load from its signals and what
//! this sidecar did since their scrape ([`SinceScrape`]), against a tier's level. Flow control
//! lets a request in, and an admission lease is sized, by it.

use crate::config::pools::PoolConfig;
use crate::pools::signals::PoolSignals;

/// The requests this sidecar dispatched to a pool, and the ends it saw, since the last scrape.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SinceScrape {
    /// Dispatched (admitted) since the scrape.
    pub dispatched: u64,
    /// Ended since the scrape.
    pub finished: u64,
}

/// The pool's load now, for the room rule: the highest of `in_flight / max_in_flight`,
/// `(waiting + dispatched − finished) / max_queue_depth` and `kv_cache_usage /
/// max_kv_cache_usage`, each where configured and known (0 with none).
pub fn load(pool: &PoolConfig, s: &PoolSignals, since: SinceScrape) -> f64 {
    load_beyond(pool, s, since, 0)
}

/// [`load`] with `extra` more requests allowed in flight than `max_in_flight` (the slots a
/// slot-dispatching pool overcommits, [`crate::scheduling::slots`]); the other terms as they are.
pub fn load_beyond(pool: &PoolConfig, s: &PoolSignals, since: SinceScrape, extra: u64) -> f64 {
    let mut load: f64 = 0.0;
    if let Some(max) = pool.max_in_flight {
        load = load.max(s.in_flight as f64 / max.saturating_add(extra) as f64);
    }
    if let (Some(max), Some(waiting)) = (pool.max_queue_depth, s.waiting) {
        let estimate = waiting + since.dispatched as f64 - since.finished as f64;
        load = load.max(estimate.max(0.0) / max as f64);
    }
    if let (Some(max), Some(kv)) = (pool.max_kv_cache_usage, s.kv_cache_usage) {
        load = load.max(kv / max);
    }
    load
}

/// Whether the pool has room for one more request of a tier that may fill it up to `level`
/// (`flow_control.tiers[].max_load`, 1 for the whole room): its [`load`] is below the level.
pub fn has_room(pool: &PoolConfig, s: &PoolSignals, since: SinceScrape, level: f64) -> bool {
    load(pool, s, since) < level
}

/// [`has_room`] with `extra` more requests allowed in flight ([`load_beyond`]).
pub fn has_room_beyond(
    pool: &PoolConfig,
    s: &PoolSignals,
    since: SinceScrape,
    level: f64,
    extra: u64,
) -> bool {
    load_beyond(pool, s, since, extra) < level
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(in_flight: Option<u64>, depth: Option<u64>, kv: Option<f64>) -> PoolConfig {
        PoolConfig {
            name: "p".into(),
            endpoints: vec![],
            scrape_interval_ms: 100,
            max_queue_depth: depth,
            max_kv_cache_usage: kv,
            max_in_flight: in_flight,
            picker: None,
            flow_control: None,
            admission_leases: None,
        }
    }

    #[test]
    fn in_flight_is_counted_at_once() {
        let p = pool(Some(8), None, None);
        let s = |n| PoolSignals { in_flight: n, ..Default::default() };
        assert!(has_room(&p, &s(7), SinceScrape::default(), 1.0));
        assert!(!has_room(&p, &s(8), SinceScrape::default(), 1.0));
        // Overcommitted slots: 4 more in flight, the level's share of them too.
        assert!(has_room_beyond(&p, &s(11), SinceScrape::default(), 1.0, 4));
        assert!(!has_room_beyond(&p, &s(12), SinceScrape::default(), 1.0, 4));
        assert!(!has_room_beyond(&p, &s(6), SinceScrape::default(), 0.5, 4));
    }

    #[test]
    fn vllm_queue_estimate_counts_own_dispatches_and_ends_since_the_scrape() {
        let p = pool(None, Some(2), None);
        let s = PoolSignals { waiting: Some(1.0), ..Default::default() };
        assert!(has_room(&p, &s, SinceScrape::default(), 1.0));
        assert!(!has_room(&p, &s, SinceScrape { dispatched: 1, finished: 0 }, 1.0));
        assert!(has_room(&p, &s, SinceScrape { dispatched: 3, finished: 3 }, 1.0));
        // Never scraped: not held back.
        assert!(has_room(&p, &PoolSignals::default(), SinceScrape { dispatched: 100, finished: 0 }, 1.0));
    }

    #[test]
    fn a_tier_below_the_whole_room_leaves_the_rest_to_higher_tiers() {
        let p = pool(Some(10), None, None);
        let s = |n| PoolSignals { in_flight: n, ..Default::default() };
        assert!(has_room(&p, &s(5), SinceScrape::default(), 0.6));
        assert!(!has_room(&p, &s(6), SinceScrape::default(), 0.6));
        assert!(has_room(&p, &s(9), SinceScrape::default(), 1.0));
    }

    #[test]
    fn kv_cache_full_holds_requests() {
        let p = pool(None, None, Some(0.9));
        let kv = |v| PoolSignals { kv_cache_usage: Some(v), ..Default::default() };
        assert!(!has_room(&p, &kv(0.95), SinceScrape::default(), 1.0));
        assert!(has_room(&p, &kv(0.5), SinceScrape::default(), 1.0));
    }
}
