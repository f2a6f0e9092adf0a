//! In-memory token buckets, with no I/O and an injected clock: the approximate limits that
//! admission applies while Redis is unavailable and the tier's failure mode is `open`. Same
//! arithmetic as `lua/token_bucket_take_v3.lua` (continuous refill, all-or-nothing take), per
//! sidecar process, over `share` of each bucket's burst and rate (`redis.local_share`; with N
//! sidecars and share 1 a tenant may get up to N times its limit while degraded). Each bucket
//! starts from its level in Redis's last answer (times the share) when there was one, so an
//! outage does not hand every tenant a fresh burst.

use std::collections::HashMap;
use std::time::Instant;

use crate::limits::{BucketSpec, BucketState, TakeOutcome};

#[derive(Debug, Clone, Copy)]
struct Level {
    tokens: f64,
    at: Instant,
}

/// Local buckets keyed like the Redis ones; bounded by the number of configured buckets.
#[derive(Debug)]
pub struct LocalLimiter {
    buckets: HashMap<String, Level>,
    share: f64,
}

impl Default for LocalLimiter {
    fn default() -> Self {
        Self::new(1.0)
    }
}

impl LocalLimiter {
    /// An empty limiter over `share` (in (0, 1]) of each limit; a bucket never seen starts full.
    pub fn new(share: f64) -> Self {
        Self { buckets: HashMap::new(), share }
    }

    /// Remembers the levels Redis answered with (`outcome` of `plan`), as this sidecar's share.
    pub fn observe(&mut self, plan: &[BucketSpec], outcome: &TakeOutcome, now: Instant) {
        for (b, state) in plan.iter().zip(&outcome.states) {
            let level = Level { tokens: state.remaining as f64 * self.share, at: now };
            match self.buckets.get_mut(&b.key) {
                Some(l) => *l = level,
                None => {
                    self.buckets.insert(b.key.clone(), level);
                }
            }
        }
    }

    /// This sidecar's share of a bucket (burst and rate; the cost is the request's own).
    fn scaled(&self, b: &BucketSpec) -> BucketSpec {
        let scale = |v: u64| ((v as f64 * self.share).round() as u64).max(1);
        BucketSpec { capacity: scale(b.capacity), rate_per_minute: scale(b.rate_per_minute), ..b.clone() }
    }

    /// Takes each bucket's cost from every bucket, or from none, as the Redis script does.
    pub fn take(&mut self, plan: &[BucketSpec], now: Instant) -> TakeOutcome {
        let plan: Vec<BucketSpec> = plan.iter().map(|b| self.scaled(b)).collect();
        let plan = plan.as_slice();
        let levels: Vec<f64> = plan.iter().map(|b| self.level(b, now)).collect();
        let denied = plan.iter().zip(&levels).position(|(b, level)| *level < b.cost as f64);
        let states = plan
            .iter()
            .zip(&levels)
            .map(|(b, &level)| {
                let rate_per_ms = b.rate_per_minute as f64 / 60_000.0;
                let after = if denied.is_none() { level - b.cost as f64 } else { level };
                if denied.is_none() {
                    self.buckets.insert(b.key.clone(), Level { tokens: after, at: now });
                }
                let missing = (b.capacity as f64 - after).max(0.0);
                let lacking = (b.cost as f64 - after).max(0.0);
                BucketState {
                    remaining: after.max(0.0).floor() as u64,
                    reset_ms: (missing / rate_per_ms).ceil() as u64,
                    retry_after_ms: Some(if denied.is_some() {
                        (lacking / rate_per_ms).ceil() as u64
                    } else {
                        0
                    }),
                }
            })
            .collect();
        TakeOutcome { denied, states }
    }

    /// Settles a reservation locally (`delta` back; negative charges more).
    pub fn settle(&mut self, bucket: &BucketSpec, delta: i64, now: Instant) {
        let bucket = &self.scaled(bucket);
        let level = (self.level(bucket, now) + delta as f64).min(bucket.capacity as f64);
        self.buckets.insert(bucket.key.clone(), Level { tokens: level, at: now });
    }

    fn level(&self, b: &BucketSpec, now: Instant) -> f64 {
        match self.buckets.get(&b.key) {
            None => b.capacity as f64,
            Some(l) => {
                let elapsed_ms = now.saturating_duration_since(l.at).as_secs_f64() * 1000.0;
                (l.tokens + elapsed_ms * b.rate_per_minute as f64 / 60_000.0).min(b.capacity as f64)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::config::{Limits, TenantConfig};
    use crate::limits;

    fn plan(reserve: u64) -> Vec<BucketSpec> {
        let l = Limits {
            requests_per_minute: Some(2),
            request_burst: None,
            tokens_per_minute: Some(600),
            token_burst: None,
        };
        limits::plan(
            "p",
            &TenantConfig {
                id: "t".into(),
                limits: l,
                model_limits: Default::default(),
                quota: Default::default(),
                model_quotas: Default::default(),
            },
            "m",
            reserve,
        )
    }

    #[test]
    fn all_or_nothing_and_refill() {
        let t0 = Instant::now();
        let mut l = LocalLimiter::default();
        assert_eq!(l.take(&plan(100), t0).denied, None);
        assert_eq!(l.take(&plan(100), t0).denied, None);
        let denied = l.take(&plan(100), t0);
        assert_eq!(denied.denied, Some(0));
        assert_eq!(denied.states[0].retry_after_ms, Some(30_000));
        // The token bucket was not charged by the denied take.
        assert_eq!(denied.states[1].remaining, 400);
        // 30 s later one request has refilled.
        assert_eq!(l.take(&plan(100), t0 + Duration::from_secs(30)).denied, None);
    }

    #[test]
    fn settle_gives_back_and_caps_at_capacity() {
        let t0 = Instant::now();
        let mut l = LocalLimiter::default();
        let p = plan(500);
        l.take(&p, t0);
        l.settle(&p[1], 450, t0);
        assert_eq!(l.take(&plan(0), t0).states[1].remaining, 550);
        l.settle(&p[1], 10_000, t0);
        assert_eq!(l.take(&plan(0), t0).states[1].remaining, 600);
    }

    #[test]
    fn a_share_of_the_limit_starting_from_redis_last_answer() {
        let t0 = Instant::now();
        let mut l = LocalLimiter::new(0.5);
        let p = plan(100);
        // Redis last said: 2 requests and 600 tokens left; this sidecar's half is 1 and 300.
        let redis = TakeOutcome {
            denied: None,
            states: vec![
                BucketState { remaining: 2, reset_ms: 0, retry_after_ms: Some(0) },
                BucketState { remaining: 600, reset_ms: 0, retry_after_ms: Some(0) },
            ],
        };
        l.observe(&p, &redis, t0);
        let first = l.take(&p, t0);
        assert_eq!((first.denied, first.states[1].remaining), (None, 200));
        assert_eq!(l.take(&p, t0).denied, Some(0), "half of 2 requests");
        // Half the rate: one request per 60 s instead of per 30 s.
        assert_eq!(l.take(&p, t0 + Duration::from_secs(30)).denied, Some(0));
        assert_eq!(l.take(&p, t0 + Duration::from_secs(60)).denied, None);
    }
}
