//! When a flow-controlled pool has room for one more request, and how long a new request is
//! expected to wait: pure arithmetic over the pool's signals ([`PoolSignals`]).
//!
//! **The room rule.** A pool has room while every limit configured on it holds (for a tier with
//! `max_load` below 1, each limit scaled by it: the rest of the room is kept for higher tiers):
//! - `in_flight < max_in_flight`: the requests this gateway has in the pool (every sidecar
//!   replica's admissions minus the ends seen, [`crate::pools`]), counted the moment a request
//!   is dispatched, so it is exact between scrapes;
//! - `waiting + dispatched − finished < max_queue_depth`: vLLM's `vllm:num_requests_waiting`
//!   at the last scrape, plus the requests this sidecar dispatched since that scrape, minus those
//!   whose end it saw since (each end lets a waiting request run): an estimate that does not
//!   wait for the next scrape to see its own dispatches;
//! - `kv_cache_usage < max_kv_cache_usage` (the highest endpoint's, at the last scrape).
//!
//! A limit whose signal is unknown (never scraped, or an endpoint not answering) does not hold
//! requests back: the pool is then served as it would be without the gateway, bounded by
//! `max_in_flight` where that is set.
//!
//! **The drain rate** predicts a new request's wait: the requests per second whose end this
//! sidecar saw while its queue held requests ([`DrainMeter`]), i.e. the pool's throughput when
//! saturated. It is measured only while requests wait, so it does not decay while the pool is
//! idle (vLLM's `vllm:request_success_total` rate would, and the first burst after a quiet
//! spell would then be predicted to wait for ever). Until a first second of saturation has
//! been measured there is no prediction: a request waits, at most its budget.

use std::time::{Duration, Instant};

use crate::admission::shedding::PoolSignals;
use crate::config::PoolConfig;

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
    let mut load: f64 = 0.0;
    if let Some(max) = pool.max_in_flight {
        load = load.max(s.in_flight as f64 / max as f64);
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

/// The expected wait of a request with `ahead` requests to be dispatched before it, at the
/// pool's drain rate (requests/s); None while the rate is unknown or zero.
pub fn predicted_wait(ahead: usize, drain_per_s: Option<f64>) -> Option<Duration> {
    let rate = drain_per_s.filter(|r| r.is_finite() && *r > 0.0)?;
    Some(Duration::from_secs_f64(((ahead + 1) as f64 / rate).min(86_400.0)))
}

/// The expected wait of a new request of a tenant with `own` requests queued, `ahead` of it in
/// the fair order ([`crate::flow_control::queue::FlowQueue::ahead`]): the longer of `ahead` at
/// the pool's drain rate and, for a tenant already backlogged, its own queue at the rate it was
/// served while backlogged (`tenant_per_s`): a backlogged tenant gets its share, not the pool's
/// rate, as tenants under their share keep going ahead of it. None while neither is known.
pub fn predicted_wait_of(
    ahead: usize,
    drain_per_s: Option<f64>,
    own: usize,
    tenant_per_s: Option<f64>,
) -> Option<Duration> {
    let by_pool = predicted_wait(ahead, drain_per_s);
    let by_tenant = if own > 0 { predicted_wait(own, tenant_per_s) } else { None };
    match (by_pool, by_tenant) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, b) => a.or(b),
    }
}

/// `Retry-After` in whole seconds (1..=30) for a request refused by the queue: the time until the
/// requests now ahead of it have drained to what its tier's `budget` can wait for; 1 while the
/// drain rate is unknown.
pub fn retry_after_secs(ahead: usize, drain_per_s: Option<f64>, budget: Duration) -> u64 {
    let Some(wait) = predicted_wait(ahead, drain_per_s) else { return 1 };
    retry_after_wait(wait, budget)
}

/// `Retry-After` in whole seconds (1..=30) for a request predicted to wait `wait` against its
/// tier's `budget`: the time until the wait would fit.
pub fn retry_after_wait(wait: Duration, budget: Duration) -> u64 {
    (wait.saturating_sub(budget).as_secs_f64().ceil() as u64).clamp(1, 30)
}

/// Shortest span of saturation a drain-rate sample covers.
const DRAIN_WINDOW: Duration = Duration::from_secs(1);
/// Weight of the newest sample in the smoothed drain rate.
const DRAIN_ALPHA: f64 = 0.5;

/// The pool's drain rate while saturated: ends seen while the queue held requests, per second,
/// over windows of at least [`DRAIN_WINDOW`], exponentially smoothed ([`DRAIN_ALPHA`]).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct DrainMeter {
    /// When the current window started, and the ends counted in it.
    window: Option<(Instant, u64)>,
    rate: Option<f64>,
}

impl DrainMeter {
    /// A request of the pool ended at `now`, with requests queued (`backlogged`) or not. An end
    /// with nothing queued closes the window without a sample: the pool was not saturated.
    pub fn finished(&mut self, now: Instant, backlogged: bool) {
        if !backlogged {
            self.window = None;
            return;
        }
        let Some((start, ends)) = self.window else {
            self.window = Some((now, 0));
            return;
        };
        let ends = ends + 1;
        let elapsed = now.saturating_duration_since(start);
        if elapsed >= DRAIN_WINDOW {
            let sample = ends as f64 / elapsed.as_secs_f64();
            self.rate = Some(crate::admission::shedding::smooth_rate(self.rate, sample, DRAIN_ALPHA));
            self.window = Some((now, 0));
        } else {
            self.window = Some((start, ends));
        }
    }

    /// Requests per second, None until a first window was measured.
    pub fn rate(&self) -> Option<f64> {
        self.rate
    }
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

    #[test]
    fn a_backlogged_tenant_waits_at_its_own_rate() {
        let s = Duration::from_secs;
        // 40 queued ahead at 50/s: 0.82 s by the pool. But the tenant is served 10/s while
        // backlogged, and 40 of its own are queued: 4.1 s.
        assert_eq!(predicted_wait_of(40, Some(50.0), 40, Some(10.0)), Some(Duration::from_millis(4100)));
        // Not backlogged, or its rate unknown: the pool's estimate.
        assert_eq!(predicted_wait_of(49, Some(50.0), 0, Some(10.0)), Some(s(1)));
        assert_eq!(predicted_wait_of(49, Some(50.0), 3, None), Some(s(1)));
        // The tenant's own rate alone, before the pool's is measured.
        assert_eq!(predicted_wait_of(9, None, 9, Some(10.0)), Some(s(1)));
        assert_eq!(predicted_wait_of(9, None, 0, None), None);
        assert_eq!(retry_after_wait(Duration::from_millis(4100), s(2)), 3);
    }

    #[test]
    fn the_drain_rate_is_measured_while_saturated_only() {
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        let mut m = DrainMeter::default();
        // Ends with nothing queued: no sample.
        for i in 0..20 {
            m.finished(at(i * 10), false);
        }
        assert_eq!(m.rate(), None);
        // One end every 100 ms while backlogged: 10/s once a second has passed.
        for i in 0..=10 {
            m.finished(at(1000 + i * 100), true);
        }
        assert_eq!(m.rate(), Some(10.0));
        // Idle for an hour: the rate is kept.
        m.finished(at(3_600_000), false);
        assert_eq!(m.rate(), Some(10.0));
        // Saturated again at 20/s: smoothed toward it.
        for i in 0..=20 {
            m.finished(at(3_700_000 + i * 50), true);
        }
        assert_eq!(m.rate(), Some(15.0));
    }

    #[test]
    fn waits_from_the_drain_rate() {
        assert_eq!(predicted_wait(9, Some(10.0)), Some(Duration::from_secs(1)));
        assert_eq!(predicted_wait(9, None), None);
        assert_eq!(predicted_wait(9, Some(0.0)), None);
        assert_eq!(retry_after_secs(39, Some(10.0), Duration::from_secs(1)), 3);
        assert_eq!(retry_after_secs(5, Some(10.0), Duration::from_secs(1)), 1);
        assert_eq!(retry_after_secs(100_000, Some(1.0), Duration::ZERO), 30);
        assert_eq!(retry_after_secs(3, None, Duration::ZERO), 1);
    }
}
