//! Load shedding in front of the vLLM pools, with no I/O: from a pool's scraped vLLM metrics and
//! its in-flight count over every sidecar replica ([`crate::pools::signals::in_flight_view`]), its load ratio; whether a request of a tier is shed; and the
//! `Retry-After` estimated from the queue's drain rate.
//!
//! A pool's load is the highest of `waiting / max_queue_depth`, `kv_cache_usage /
//! max_kv_cache_usage` and `in_flight / max_in_flight` (each only where configured). A tier is
//! shed when the load reaches its level (`shedding.tier_levels`, e.g. batch 0.5, standard 0.8);
//! the highest tier, unlisted, only at the hard ceiling 1.0. Served requests then keep a bounded
//! queue ahead of them instead of one that grows with the offered load.

use crate::config::pools::PoolConfig;
use crate::pools::signals::PoolSignals;

/// The pool's load ratio (0 = idle, 1 = at its configured limit).
pub fn load(pool: &PoolConfig, s: &PoolSignals) -> f64 {
    let mut load: f64 = 0.0;
    if let (Some(max), Some(waiting)) = (pool.max_queue_depth, s.waiting) {
        load = load.max(waiting / max as f64);
    }
    if let (Some(max), Some(kv)) = (pool.max_kv_cache_usage, s.kv_cache_usage) {
        load = load.max(kv / max);
    }
    if let Some(max) = pool.max_in_flight {
        load = load.max(s.in_flight as f64 / max as f64);
    }
    load
}

/// Whether a request of a tier whose shedding level is `level` is shed at `load`.
pub fn should_shed(load: f64, level: f64) -> bool {
    load >= level
}

/// `Retry-After` in whole seconds (1..=30): the time for the pool to drain the queue beyond the
/// tier's share, at its measured drain rate; 1 s while the rate is unknown.
pub fn retry_after_secs(pool: &PoolConfig, s: &PoolSignals, level: f64) -> u64 {
    let Some(rate) = s.drain_per_s.filter(|r| *r > 0.0) else { return 1 };
    let backlog = match (pool.max_queue_depth, s.waiting) {
        (Some(max), Some(waiting)) => waiting - level * max as f64,
        _ => match pool.max_in_flight {
            Some(max) => s.in_flight as f64 - level * max as f64,
            None => 1.0,
        },
    };
    ((backlog.max(1.0) / rate).ceil() as u64).clamp(1, 30)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool() -> PoolConfig {
        PoolConfig {
            name: "p".into(),
            endpoints: vec!["http://h:1".into()],
            scrape_interval_ms: 500,
            max_queue_depth: Some(10),
            max_kv_cache_usage: Some(0.9),
            max_in_flight: None,
            picker: None,
            flow_control: None,
            admission_leases: None,
        }
    }

    #[test]
    fn load_is_the_highest_configured_ratio() {
        let s = PoolSignals { waiting: Some(5.0), kv_cache_usage: Some(0.81), ..Default::default() };
        assert!((load(&pool(), &s) - 0.9).abs() < 1e-9);
        assert_eq!(load(&pool(), &PoolSignals::default()), 0.0, "never scraped: not shed");
    }

    #[test]
    fn lower_tiers_shed_first() {
        let l = 0.85;
        assert!(should_shed(l, 0.5));
        assert!(should_shed(l, 0.8));
        assert!(!should_shed(l, 1.0));
        assert!(should_shed(1.0, 1.0));
    }

    #[test]
    fn retry_after_from_drain_rate() {
        let s = PoolSignals { waiting: Some(18.0), drain_per_s: Some(4.0), ..Default::default() };
        // 18 waiting, the tier's share is 8: 10 to drain at 4/s → 3 s.
        assert_eq!(retry_after_secs(&pool(), &s, 0.8), 3);
        assert_eq!(retry_after_secs(&pool(), &PoolSignals { drain_per_s: None, ..s }, 0.8), 1);
        let slow = PoolSignals { drain_per_s: Some(0.01), ..s };
        assert_eq!(retry_after_secs(&pool(), &slow, 0.8), 30);
    }
}
