//! In-memory token buckets, with no I/O and an injected clock: the approximate limits that
//! admission applies while Redis is unavailable and the tier's failure mode is `open`. Same
//! arithmetic as `lua/token_bucket_take_v3.lua` (continuous refill, all-or-nothing take), per
//! sidecar process, over `share` of each bucket's burst and rate (`redis.local_share`; with N
//! sidecars and share 1 a tenant may get up to N times its limit while degraded). Each bucket
//! starts from its level in Redis's last answer (times the share) when there was one, so an
//! outage does not hand every tenant a fresh burst.
//!
//! What the local buckets admit is owed to Redis: each bucket touched while degraded keeps a debt
//! (tokens taken, net of what settlements that could not reach Redis gave back) and the level
//! Redis last answered, and [`LocalLimiter::take_reconciliations`] hands them over to be charged
//! (`lua/token_bucket_reconcile_v1.lua`) when Redis answers again, so that an outage admits no more
//! than the limits over its whole span, and a cluster node that comes back empty does not hand
//! out a fresh burst either.

use std::collections::HashMap;
use std::time::Instant;

use crate::admission::limits::{BucketSpec, BucketState, TakeOutcome};

#[derive(Debug, Clone, Copy)]
struct Level {
    tokens: f64,
    at: Instant,
}

/// One bucket's account with Redis while degraded.
#[derive(Debug, Clone)]
struct Debt {
    /// The bucket as Redis keeps it (the whole limit, not this sidecar's share).
    bucket: BucketSpec,
    /// Tokens taken here and not yet charged to Redis (negative: more given back than taken).
    tokens: i64,
}

/// What to charge one Redis bucket with once Redis answers again
/// ([`crate::store::Store::reconcile`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reconciliation {
    /// The bucket (its key, capacity and rate; `cost` unused).
    pub bucket: BucketSpec,
    /// Tokens to charge (negative: to give back).
    pub debt: i64,
    /// What Redis last answered this sidecar for this bucket; `None` when it never answered.
    pub hint: Option<Hint>,
}

/// A bucket's level as Redis last answered a sidecar ([`Reconciliation::hint`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hint {
    /// That level plus the refill since, not capped at the capacity (whole tokens, floored).
    pub level: u64,
    /// Milliseconds since that answer: only refill Redis dropped at its capacity since (while
    /// this sidecar was away) may be credited against the debt; other sidecars may have taken
    /// from Redis since, so the level is an upper bound, never a level to restore.
    pub age_ms: u64,
}

/// Local buckets keyed like the Redis ones; bounded by the number of configured buckets.
#[derive(Debug)]
pub struct LocalLimiter {
    buckets: HashMap<String, Level>,
    /// Redis's last answer per bucket (the whole level, unscaled).
    seen: HashMap<String, Level>,
    /// Redis's last answer per bucket, the level unfloored (from its time to be full again).
    exact: HashMap<String, Level>,
    debts: HashMap<String, Debt>,
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
        Self {
            buckets: HashMap::new(),
            seen: HashMap::new(),
            exact: HashMap::new(),
            debts: HashMap::new(),
            share,
        }
    }

    /// Remembers the levels Redis answered with (`outcome` of `plan`), as this sidecar's share.
    pub fn observe(&mut self, plan: &[BucketSpec], outcome: &TakeOutcome, now: Instant) {
        for (b, state) in plan.iter().zip(&outcome.states) {
            self.seen.insert(b.key.clone(), Level { tokens: state.remaining as f64, at: now });
            let missing = state.reset_ms as f64 * b.rate_per_minute as f64 / 60_000.0;
            let tokens = (b.capacity as f64 - missing).clamp(0.0, b.capacity as f64);
            self.exact.insert(b.key.clone(), Level { tokens, at: now });
            let level = Level { tokens: state.remaining as f64 * self.share, at: now };
            match self.buckets.get_mut(&b.key) {
                Some(l) => *l = level,
                None => {
                    self.buckets.insert(b.key.clone(), level);
                }
            }
        }
    }

    /// Milliseconds until bucket `b` holds one token again, from Redis's last answer for it and
    /// its refill since; `None` when it holds one now, was never seen, or has no refill.
    pub fn wait_for_one_ms(&self, b: &BucketSpec, now: Instant) -> Option<u64> {
        let seen = self.exact.get(&b.key)?;
        if b.rate_per_minute == 0 {
            return None;
        }
        let per_ms = b.rate_per_minute as f64 / 60_000.0;
        let level = seen.tokens + now.saturating_duration_since(seen.at).as_millis() as f64 * per_ms;
        let wait = ((1.0 - level) / per_ms).ceil();
        (wait >= 1.0).then_some(wait as u64)
    }

    /// This sidecar's share of a bucket (burst and rate; the cost is the request's own).
    fn scaled(&self, b: &BucketSpec) -> BucketSpec {
        let scale = |v: u64| ((v as f64 * self.share).round() as u64).max(1);
        BucketSpec { capacity: scale(b.capacity), rate_per_minute: scale(b.rate_per_minute), ..b.clone() }
    }

    /// Takes each bucket's cost from every bucket, or from none, as the Redis script does; what it
    /// takes is owed to Redis ([`Self::take_reconciliations`]).
    pub fn take(&mut self, plan: &[BucketSpec], now: Instant) -> TakeOutcome {
        let whole = plan;
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
        for b in whole {
            let cost = if denied.is_none() { i64::try_from(b.cost).unwrap_or(i64::MAX) } else { 0 };
            self.owe(b, cost);
        }
        TakeOutcome { denied, states }
    }

    /// Owes Redis `tokens` more of `bucket` (negative: less), to be charged when it answers again.
    pub fn owe(&mut self, bucket: &BucketSpec, tokens: i64) {
        match self.debts.get_mut(&bucket.key) {
            Some(d) => d.tokens = d.tokens.saturating_add(tokens),
            None => {
                self.debts.insert(bucket.key.clone(), Debt { bucket: bucket.clone(), tokens });
            }
        }
    }

    /// Whether anything awaits reconciliation with Redis.
    pub fn owes(&self) -> bool {
        !self.debts.is_empty()
    }

    /// Every bucket touched while degraded, with its debt and Redis's last level refilled to
    /// `now`; the debts are cleared (give back what could not be charged with
    /// [`Self::restore`]).
    pub fn take_reconciliations(&mut self, now: Instant) -> Vec<Reconciliation> {
        let debts = std::mem::take(&mut self.debts);
        debts
            .into_values()
            .map(|d| {
                let hint = self.seen.get(&d.bucket.key).map(|l| {
                    let elapsed_ms = now.saturating_duration_since(l.at).as_secs_f64() * 1000.0;
                    // Not capped: the refill of the outage is what the local admissions used.
                    let level = l.tokens + elapsed_ms * d.bucket.rate_per_minute as f64 / 60_000.0;
                    Hint { level: level.max(0.0).floor() as u64, age_ms: elapsed_ms.floor() as u64 }
                });
                Reconciliation { bucket: d.bucket, debt: d.tokens, hint }
            })
            .collect()
    }

    /// Owes again a reconciliation that Redis did not apply.
    pub fn restore(&mut self, r: Reconciliation) {
        self.owe(&r.bucket, r.debt);
    }

    /// Settles a reservation locally (`delta` back; negative charges more); what Redis should
    /// also be told is [`Self::owe`]d separately.
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
    use crate::admission::limits;
    use crate::config::tenants::{Limits, TenantConfig};

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
                api_keys: Vec::new(),
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

    /// The wait until a bucket holds one token again, from Redis's last answer (its level from
    /// the time it would take to be full) and the refill since.
    #[test]
    fn the_wait_for_one_token_follows_redis_last_answer() {
        let t0 = Instant::now();
        let mut l = LocalLimiter::default();
        let p = plan(100);
        assert_eq!(l.wait_for_one_ms(&p[0], t0), None, "never seen");
        // 2 a minute, burst 2: 0.25 of a request left is 1.75 from full (52.5 s); one request is
        // 22.5 s away.
        let state = |remaining, reset_ms| BucketState { remaining, reset_ms, retry_after_ms: None };
        let refused = TakeOutcome { denied: Some(0), states: vec![state(0, 52_500), state(500, 1000)] };
        l.observe(&p, &refused, t0);
        assert_eq!(l.wait_for_one_ms(&p[0], t0), Some(22_500));
        assert_eq!(l.wait_for_one_ms(&p[0], t0 + Duration::from_secs(20)), Some(2_500));
        assert_eq!(l.wait_for_one_ms(&p[0], t0 + Duration::from_millis(22_500)), None);
        assert_eq!(l.wait_for_one_ms(&p[1], t0), None, "the token bucket holds plenty");
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
    fn what_is_admitted_locally_is_owed_to_redis_with_its_last_level() {
        let t0 = Instant::now();
        let mut l = LocalLimiter::new(0.5);
        let p = plan(100);
        let redis = TakeOutcome {
            denied: None,
            states: vec![
                BucketState { remaining: 1, reset_ms: 0, retry_after_ms: Some(0) },
                BucketState { remaining: 300, reset_ms: 0, retry_after_ms: Some(0) },
            ],
        };
        l.observe(&p, &redis, t0);
        assert!(!l.owes(), "nothing taken locally yet");
        let t1 = t0 + Duration::from_secs(30);
        assert_eq!(l.take(&p, t1).denied, None, "30 s refilled half a request at half the rate");
        // The settle of that request gave 40 of its 100 reserved tokens back while Redis was away.
        l.owe(&p[1], -40);
        assert!(l.owes());
        let t2 = t0 + Duration::from_secs(60);
        let mut r = l.take_reconciliations(t2);
        r.sort_by(|a, b| a.bucket.key.cmp(&b.bucket.key));
        let requests =
            r.iter().find(|r| r.bucket.kind == limits::BucketKind::Requests).map(|r| (r.debt, r.hint));
        let tokens = r.iter().find(|r| r.bucket.kind == limits::BucketKind::Tokens).map(|r| (r.debt, r.hint));
        // Whole limits, not the share, and not capped: 1 + 2/min x 1 min = 3 requests,
        // 300 + 600 tokens; answered 60 s ago.
        assert_eq!(requests, Some((1, Some(Hint { level: 3, age_ms: 60_000 }))));
        assert_eq!(tokens, Some((60, Some(Hint { level: 900, age_ms: 60_000 }))));
        assert!(!l.owes(), "handed over");
        // Redis refused it: owed again, not lost.
        for x in r {
            l.restore(x);
        }
        assert_eq!(l.take_reconciliations(t2).iter().map(|r| r.debt).sum::<i64>(), 61);
    }

    #[test]
    fn a_denied_local_take_is_noted_but_owes_nothing() {
        let t0 = Instant::now();
        let mut l = LocalLimiter::default();
        let p = plan(100);
        l.take(&p, t0);
        l.take(&p, t0);
        assert_eq!(l.take(&p, t0).denied, Some(0));
        let r = l.take_reconciliations(t0);
        assert_eq!(r.iter().map(|r| r.debt).sum::<i64>(), 2 + 200);
        assert!(r.iter().all(|r| r.hint.is_none()), "Redis never answered");
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
