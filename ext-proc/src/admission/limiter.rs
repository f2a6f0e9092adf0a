//! Rate-limit decisions with Redis's failure policy: Redis decides while it answers (within
//! `command_timeout_ms`); after repeated failures a circuit breaker stops asking it, so a dead
//! Redis costs requests no wait; while Redis cannot decide, each tier's failure mode applies:
//! `open` decides from in-memory buckets ([`LocalLimiter`]), `closed` refuses (503). Every
//! degraded decision is counted in `llm_gateway_degraded_decisions_total`. With
//! `redis.lease_fraction`, requests are admitted from token leases taken from Redis ([`Leases`])
//! before Redis is asked. What the local buckets admitted, and the settlements that could not
//! reach Redis, are charged to Redis before this sidecar's next Redis call once it answers again
//! ([`LocalLimiter::take_reconciliations`], `lua/token_bucket_reconcile_v1.lua`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tracing::warn;

use crate::admission::admission_lease::LeaseRecord;
use crate::admission::breaker::Breaker;
use crate::admission::lease::Leases;
use crate::admission::limits::{BucketSpec, TakeOutcome};
use crate::admission::local_limiter::LocalLimiter;
use crate::admission::quota::{QuotaOutcome, QuotaTake};
use crate::config::redis::{FailureMode, RedisConfig};
use crate::metering::ledger;
use crate::metrics::labels::{LeaseOutcome, Reason};
use crate::metrics::Metrics;
use crate::store::{Store, Tracking};

/// Result of a take.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Take {
    /// Redis decided.
    Redis(TakeOutcome),
    /// Redis could not; the in-memory buckets decided (failure mode `open`).
    Local(TakeOutcome),
    /// Redis could not and the failure mode is `closed`.
    Unavailable,
}

/// The limiter: Redis, its breaker and the local fallback.
pub struct Limiter {
    store: Store,
    breaker: Mutex<Breaker>,
    local: Mutex<LocalLimiter>,
    /// Set while the local buckets owe Redis (checked on every call: one atomic load).
    owes: AtomicBool,
    /// One reconciliation at a time.
    reconciling: tokio::sync::Mutex<()>,
    /// `None` when `redis.lease_fraction` is 0: no lease lock on the request path.
    leases: Option<Mutex<Leases>>,
    lease_ttl: Duration,
    metrics: Arc<Metrics>,
}

impl Limiter {
    /// A limiter over `store`.
    pub fn new(store: Store, config: &RedisConfig, metrics: Arc<Metrics>) -> Self {
        Self {
            store,
            breaker: Mutex::new(Breaker::new(
                config.breaker.failure_threshold,
                Duration::from_millis(config.breaker.open_ms),
            )),
            local: Mutex::new(LocalLimiter::new(config.local_share)),
            owes: AtomicBool::new(false),
            reconciling: tokio::sync::Mutex::new(()),
            leases: (config.lease_fraction > 0.0).then(|| {
                Mutex::new(Leases::new(config.lease_fraction, Duration::from_millis(config.lease_ttl_ms)))
            }),
            lease_ttl: Duration::from_millis(config.lease_ttl_ms),
            metrics,
        }
    }

    /// The Redis store.
    pub fn store(&self) -> &Store {
        &self.store
    }

    fn allow(&self) -> bool {
        self.breaker.lock().map(|mut b| b.allow(Instant::now())).unwrap_or(true)
    }

    fn record(&self, ok: bool) {
        if let Ok(mut b) = self.breaker.lock() {
            b.record(ok, Instant::now());
        }
    }

    /// Notes that the local buckets owe Redis `tokens` of `bucket` (negative: less).
    fn owe(&self, bucket: &BucketSpec, tokens: i64) {
        if let Ok(mut local) = self.local.lock() {
            local.owe(bucket, tokens);
        }
        self.owes.store(true, Ordering::Release);
    }

    /// Charges Redis with what the local buckets owe it, before this call's own Redis work (so a
    /// cluster node that came back empty gets its levels back before anything is taken from it).
    /// False when Redis refused, so the caller need not wait for it a second time, and while
    /// another call reconciles (it decides from the local buckets meanwhile, owing what it takes:
    /// no request waits behind a reconciliation, nor behind one that times out).
    async fn reconcile_first(&self) -> bool {
        if !self.owes.load(Ordering::Acquire) {
            return true;
        }
        let Ok(_one) = self.reconciling.try_lock() else { return false };
        // `owes` stays set until the end: a call meanwhile decides locally (owing it) instead of
        // taking from a bucket not rebuilt yet (a take would create it full).
        let owed = match self.local.lock() {
            Ok(mut local) => local.take_reconciliations(Instant::now()),
            Err(_) => return true,
        };
        let mut ok = true;
        for r in owed {
            if !ok {
                self.owe_again(r);
                continue;
            }
            let result =
                self.metrics.timed_redis("reconcile", self.store.reconcile(&r.bucket, r.debt, r.hint)).await;
            self.record(result.is_ok());
            let outcome = match result {
                Ok(level) => {
                    tracing::info!(key = %r.bucket.key, debt = r.debt, hint = ?r.hint, level, "bucket reconciled");
                    "applied"
                }
                Err(error) => {
                    // Owed again even when it may have been applied (a reply lost to a timeout):
                    // charged twice, the bucket under-admits once; dropped, it would over-admit.
                    warn!(%error, key = %r.bucket.key, debt = r.debt, "reconcile failed; owed again");
                    ok = false;
                    self.owe_again(r);
                    "retried"
                }
            };
            self.metrics.reconciliations.get_or_create(&LeaseOutcome { outcome: outcome.to_owned() }).inc();
        }
        // What calls owed meanwhile is charged by the next one (against the rebuilt level).
        let still = self.local.lock().is_ok_and(|local| local.owes());
        self.owes.store(still, Ordering::Release);
        ok
    }

    fn owe_again(&self, r: crate::admission::local_limiter::Reconciliation) {
        if let Ok(mut local) = self.local.lock() {
            local.restore(r);
        }
        self.owes.store(true, Ordering::Release);
    }

    /// Takes the plan's costs: from Redis, or degraded per `mode`. With `tracking`, a take that
    /// Redis decides in a round trip also records the admission's reservation as open in the
    /// ledger ([`Store::take`]); the second value says whether it did (not for an admission from
    /// this sidecar's lease, nor a degraded one).
    ///
    /// With `quotas` (the tenant, its counters), Redis also checks and charges the tenant's quota
    /// counters in the same call (the third value: what they said; `None` when Redis did not
    /// decide, so no quota was checked), and this sidecar's own leases are not used: a leased
    /// admission would bypass the counters.
    pub async fn take(
        &self,
        plan: &[BucketSpec],
        mode: FailureMode,
        tracking: Option<&Tracking<'_>>,
        quotas: Option<(&str, &QuotaTake<'_>)>,
    ) -> (Take, bool, Option<QuotaOutcome>) {
        let leases = if quotas.is_some() { None } else { self.leases.as_ref() };
        let wanted = match leases.map(Mutex::lock) {
            Some(Ok(mut leases)) => match leases.try_take(plan, Instant::now()) {
                // Tokens Redis granted earlier: decided by Redis, without a round trip.
                Some(outcome) => return (Take::Redis(outcome), false, None),
                None => leases.wanted(plan),
            },
            Some(Err(_)) | None => Vec::new(),
        };
        let reason = if !self.allow() {
            "breaker_open"
        } else if !self.reconcile_first().await {
            "redis_error"
        } else {
            let result = self
                .metrics
                .timed_redis("take", self.store.take_with_quotas(plan, &wanted, tracking, quotas))
                .await;
            self.record(result.is_ok());
            match result {
                Ok((mut outcome, granted, quota)) => {
                    let now = Instant::now();
                    if let Ok(mut local) = self.local.lock() {
                        local.observe(plan, &outcome, now);
                    }
                    if let Some(Ok(mut leases)) = self.leases.as_ref().map(Mutex::lock) {
                        leases.granted(plan, &outcome, &granted, now);
                        // What this sidecar holds is still the tenant's to use, as a leased
                        // admission reports it.
                        if outcome.denied.is_none() {
                            for (b, state) in plan.iter().zip(outcome.states.iter_mut()) {
                                state.remaining = state.remaining.saturating_add(leases.held_for(&b.key));
                            }
                        }
                    }
                    let quota_denied = quota.as_ref().is_some_and(|q| q.denied.is_some());
                    let tracked = tracking.is_some() && outcome.denied.is_none() && !quota_denied;
                    return (Take::Redis(outcome), tracked, quota);
                }
                Err(error) => {
                    warn!(%error, "rate limit take failed");
                    "redis_error"
                }
            }
        };
        self.metrics.degraded.get_or_create(&Reason { reason: reason.to_owned() }).inc();
        let take = match mode {
            FailureMode::Open => match self.local.lock() {
                Ok(mut local) => {
                    // What it admits is owed to Redis (LocalLimiter::take).
                    self.owes.store(true, Ordering::Release);
                    Take::Local(local.take(plan, Instant::now()))
                }
                Err(_) => Take::Unavailable,
            },
            FailureMode::Closed => Take::Unavailable,
        };
        (take, false, None)
    }

    /// Milliseconds until bucket `b` holds one token again, as Redis last answered this sidecar
    /// for it ([`LocalLimiter::wait_for_one_ms`]); `None` when it holds one, or was never seen.
    pub fn wait_for_one_ms(&self, b: &BucketSpec) -> Option<u64> {
        self.local.lock().ok()?.wait_for_one_ms(b, Instant::now())
    }

    /// Records an admission that no limit applies to as open in the ledger (a take of no bucket,
    /// [`Store::take`]); whether it did. Redis unavailable: not recorded, the admission stands.
    pub async fn track(&self, tracking: &Tracking<'_>) -> bool {
        if !self.allow() || !self.reconcile_first().await {
            return false;
        }
        let result = self.metrics.timed_redis("take", self.store.take(&[], &[], Some(tracking))).await;
        self.record(result.is_ok());
        match result {
            Ok(_) => true,
            Err(error) => {
                warn!(%error, "reservation not recorded");
                false
            }
        }
    }

    /// Takes a filter's admission lease (the plan's costs are the lease), in Redis only: `None`
    /// when Redis cannot decide now (breaker open, error, timeout). Leases are never taken from
    /// the in-memory buckets; without Redis every request goes through the ext_proc admission.
    ///
    /// With `quotas`, a lease is refused (`denied` set to its first bucket, or a plan without
    /// buckets answered as refused) unless every quota counter has room for the lease's `need`
    /// tokens; the counters are not charged (the leased requests' records are).
    ///
    /// A lease taken is recorded open under `lease_id` (`record`), for its give-back by id or its
    /// reclaim as orphaned ([`crate::admission::admission_lease`]).
    pub async fn take_lease(
        &self,
        tenant: &str,
        lease_id: &str,
        record: &LeaseRecord,
        plan: &[BucketSpec],
        quotas: Option<&QuotaTake<'_>>,
    ) -> Option<(TakeOutcome, bool)> {
        if !self.allow() || !self.reconcile_first().await {
            return None;
        }
        let result = self
            .metrics
            .timed_redis(
                "lease",
                self.store.take_lease(tenant, lease_id, record, ledger::KEEP_MARGIN, plan, quotas),
            )
            .await;
        self.record(result.is_ok());
        match result {
            Ok((outcome, quota)) => Some((outcome, quota.is_some_and(|q| q.denied.is_some()))),
            Err(error) => {
                warn!(%error, "admission lease take failed");
                None
            }
        }
    }

    /// Gives the tokens of expired leases back to Redis, every half lease TTL, for ever (a task
    /// of its own; tokens Redis cannot take back are lost to the bucket until it refills).
    pub async fn run_lease_expiry(&self) {
        loop {
            tokio::time::sleep(self.lease_ttl / 2).await;
            if !self.give_back_leases(Instant::now()).await {
                return;
            }
        }
    }

    /// Gives every lease held back to Redis now (at shutdown). Leases are off: nothing to do.
    pub async fn give_back_all_leases(&self) {
        let after_every_lease = Instant::now().checked_add(self.lease_ttl * 2).unwrap_or_else(Instant::now);
        self.give_back_leases(after_every_lease).await;
    }

    /// Gives back the tokens of the leases expired at `now`. False when leases are off.
    async fn give_back_leases(&self, now: Instant) -> bool {
        let expired = match self.leases.as_ref().map(Mutex::lock) {
            Some(Ok(mut leases)) => leases.expire(now),
            Some(Err(_)) => return true,
            None => return false,
        };
        for (bucket, tokens) in expired {
            let delta = i64::try_from(tokens).unwrap_or(i64::MAX);
            self.settle(&bucket, delta, false).await;
        }
        true
    }

    /// Settles a reservation: `delta` tokens back into the bucket (negative charges more), in
    /// Redis. The local bucket is settled too when the reservation was taken there (`locally`),
    /// or instead when Redis cannot be told now, and then Redis is owed the settlement.
    pub async fn settle(&self, bucket: &BucketSpec, delta: i64, locally: bool) {
        if locally {
            if let Ok(mut local) = self.local.lock() {
                local.settle(bucket, delta, Instant::now());
            }
        }
        let mut maybe_applied = false;
        if self.allow() && self.reconcile_first().await {
            let result = self.metrics.timed_redis("settle", self.store.settle(bucket, delta)).await;
            self.record(result.is_ok());
            match result {
                Ok(_) => return,
                Err(error) => {
                    warn!(%error, key = %bucket.key, delta, "settle failed");
                    maybe_applied = error.maybe_applied();
                }
            }
        }
        if !locally {
            if let Ok(mut local) = self.local.lock() {
                local.settle(bucket, delta, Instant::now());
            }
        }
        // Owed to Redis unless it may have been applied (settled twice would move the bucket
        // twice; a settlement is small next to a local admission's whole cost).
        if !maybe_applied {
            self.owe(bucket, delta.saturating_neg());
        }
    }
}
