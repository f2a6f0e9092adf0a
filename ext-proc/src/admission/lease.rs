//! Token leases, with no I/O and an injected clock: a sidecar takes a little more than a request
//! needs from a Redis bucket (`lua/token_bucket_take_v3.lua`) and admits the next requests of
//! that bucket from what it holds, without a Redis round trip, until the lease runs out or
//! expires. Leased tokens are already gone from Redis, so leases never over-admit; a lease held
//! by one sidecar while another is refused under-admits by at most the lease. Unused tokens go
//! back to Redis when a lease expires (`redis.lease_ttl_ms` after its last grant).
//!
//! A bucket is leased only when `redis.lease_fraction` × its capacity covers at least two of the
//! request's costs; tighter limits go to Redis on every request, exactly as without leases. The
//! `x-ratelimit-remaining-*` of a request admitted from a lease is Redis's remaining at the last
//! grant plus what the lease still holds (approximate: it ignores the refill and other sidecars
//! since).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::admission::limits::{BucketSpec, BucketState, TakeOutcome};

#[derive(Debug, Clone)]
struct Lease {
    /// Tokens held (taken from Redis, not yet used).
    tokens: u64,
    /// The bucket, for giving tokens back.
    spec: BucketSpec,
    /// Redis's remaining and reset at the last grant.
    remaining: u64,
    reset_ms: u64,
    /// When the lease stops admitting (its tokens then go back).
    expires: Instant,
}

/// The leases of one sidecar, keyed by bucket.
#[derive(Debug)]
pub struct Leases {
    entries: HashMap<String, Lease>,
    fraction: f64,
    ttl: Duration,
}

impl Leases {
    /// Leases of up to `fraction` (0: none) of each bucket's capacity, expiring `ttl` after their
    /// last grant.
    pub fn new(fraction: f64, ttl: Duration) -> Self {
        Self { entries: HashMap::new(), fraction, ttl }
    }

    /// The lease a bucket is topped up to for a request of its cost: `fraction` of its capacity
    /// when that covers at least two such costs, else 0.
    fn target(&self, b: &BucketSpec) -> u64 {
        let target = (b.capacity as f64 * self.fraction).floor() as u64;
        if target >= 2 * b.cost.max(1) {
            target
        } else {
            0
        }
    }

    /// Admits the plan from the leases held when every bucket's unexpired lease covers its cost
    /// (taking the costs); `None` otherwise (Redis decides).
    pub fn try_take(&mut self, plan: &[BucketSpec], now: Instant) -> Option<TakeOutcome> {
        if self.fraction <= 0.0 || plan.is_empty() {
            return None;
        }
        let covered = plan
            .iter()
            .all(|b| self.entries.get(&b.key).is_some_and(|l| l.expires > now && l.tokens >= b.cost));
        if !covered {
            return None;
        }
        let mut states = Vec::with_capacity(plan.len());
        for b in plan {
            let lease = self.entries.get_mut(&b.key)?;
            lease.tokens = lease.tokens.saturating_sub(b.cost);
            states.push(BucketState {
                remaining: lease.remaining.saturating_add(lease.tokens),
                reset_ms: lease.reset_ms,
                retry_after_ms: Some(0),
            });
        }
        Some(TakeOutcome { denied: None, states })
    }

    /// Lease tokens to ask Redis for with this plan's costs: each bucket's target less what is
    /// held.
    pub fn wanted(&self, plan: &[BucketSpec]) -> Vec<u64> {
        if self.fraction <= 0.0 {
            return Vec::new();
        }
        plan.iter()
            .map(|b| {
                let held = self.entries.get(&b.key).map_or(0, |l| l.tokens);
                self.target(b).saturating_sub(held)
            })
            .collect()
    }

    /// Records Redis's answer to a take that asked for leases: the granted tokens join each
    /// bucket's lease, which expires `ttl` from now.
    pub fn granted(&mut self, plan: &[BucketSpec], outcome: &TakeOutcome, granted: &[u64], now: Instant) {
        if self.fraction <= 0.0 || outcome.denied.is_some() {
            return;
        }
        for ((b, state), &tokens) in plan.iter().zip(&outcome.states).zip(granted) {
            match self.entries.get_mut(&b.key) {
                Some(lease) => {
                    lease.tokens = lease.tokens.saturating_add(tokens);
                    lease.remaining = state.remaining;
                    lease.reset_ms = state.reset_ms;
                    lease.expires = now + self.ttl;
                }
                None if tokens > 0 => {
                    let spec = BucketSpec { cost: 0, ..b.clone() };
                    let lease = Lease {
                        tokens,
                        spec,
                        remaining: state.remaining,
                        reset_ms: state.reset_ms,
                        expires: now + self.ttl,
                    };
                    self.entries.insert(b.key.clone(), lease);
                }
                None => {}
            }
        }
    }

    /// Removes the expired leases; returns those holding tokens, to give back to Redis.
    pub fn expire(&mut self, now: Instant) -> Vec<(BucketSpec, u64)> {
        let mut back = Vec::new();
        self.entries.retain(|_, lease| {
            if lease.expires > now {
                return true;
            }
            if lease.tokens > 0 {
                back.push((lease.spec.clone(), lease.tokens));
            }
            false
        });
        back
    }

    /// Tokens held in the lease of one bucket.
    pub fn held_for(&self, key: &str) -> u64 {
        self.entries.get(key).map_or(0, |l| l.tokens)
    }

    /// Tokens held across all leases (for tests and metrics).
    pub fn held(&self) -> u64 {
        self.entries.values().fold(0, |sum, l| sum.saturating_add(l.tokens))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admission::limits::BucketKind;

    fn bucket(capacity: u64, cost: u64) -> BucketSpec {
        BucketSpec { kind: BucketKind::Requests, key: "k".into(), capacity, rate_per_minute: capacity, cost }
    }

    fn admitted(remaining: u64) -> TakeOutcome {
        TakeOutcome {
            denied: None,
            states: vec![BucketState { remaining, reset_ms: 10, retry_after_ms: Some(0) }],
        }
    }

    #[test]
    fn admits_from_a_lease_until_it_runs_out_or_expires() {
        let t0 = Instant::now();
        let mut l = Leases::new(0.01, Duration::from_secs(1));
        let plan = [bucket(1000, 1)];
        assert_eq!(l.try_take(&plan, t0), None, "nothing held yet");
        assert_eq!(l.wanted(&plan), [10]);
        l.granted(&plan, &admitted(889), &[10], t0);
        for held in (0..10).rev() {
            let o = l.try_take(&plan, t0).unwrap();
            assert_eq!(o.states[0].remaining, 889 + held);
        }
        assert_eq!(l.try_take(&plan, t0), None, "used up");
        assert_eq!(l.wanted(&plan), [10]);
        l.granted(&plan, &admitted(878), &[10], t0);
        assert_eq!(l.try_take(&plan, t0 + Duration::from_secs(1)), None, "expired");
        assert_eq!(l.expire(t0 + Duration::from_secs(1)), vec![(bucket(1000, 0), 10)]);
        assert_eq!(l.held(), 0);
    }

    #[test]
    fn tight_limits_and_refusals_lease_nothing() {
        let t0 = Instant::now();
        let mut l = Leases::new(0.01, Duration::from_secs(1));
        assert_eq!(l.wanted(&[bucket(100, 1)]), [0], "1 % of 100 is less than two requests");
        assert_eq!(l.wanted(&[bucket(10_000, 50)]), [100]);
        assert_eq!(l.wanted(&[bucket(10_000, 51)]), [0]);
        let plan = [bucket(1000, 1)];
        let mut refused = admitted(0);
        refused.denied = Some(0);
        l.granted(&plan, &refused, &[10], t0);
        assert_eq!(l.held(), 0);
        assert!(Leases::new(0.0, Duration::from_secs(1)).wanted(&plan).is_empty());
    }

    #[test]
    fn every_bucket_must_be_covered() {
        let t0 = Instant::now();
        let mut l = Leases::new(0.01, Duration::from_secs(1));
        let a = bucket(1000, 1);
        let b = BucketSpec { key: "other".into(), ..bucket(100, 1) };
        let plan = [a.clone(), b];
        let two = TakeOutcome { denied: None, states: vec![admitted(5).states[0], admitted(5).states[0]] };
        l.granted(&plan, &two, &[10, 0], t0);
        assert_eq!(l.try_take(&plan, t0), None, "the second bucket holds no lease");
        assert!(l.try_take(&[a], t0).is_some());
    }
}
