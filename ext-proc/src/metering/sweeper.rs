//! The ledger's sweeper ([`crate::metering::ledger`]), a task on every replica: every
//! `metering.reservations.sweep_interval_ms`, one Redis call per configured tenant claims up to
//! `sweep_batch` of its open reservations older than `record_after_ms` ([`Store::claim`], by
//! Redis's clock) and queues each one's charge to the usage writer ([`Recorder::charge`]), which
//! records it as a usage record (`usage_source` reservation, end reason unreported) counted in
//! `llm_gateway_usage_records_from_reservation_total`.
//!
//! Any number of replicas may sweep at once: a claim moves what it returns out of the others'
//! reach for [`CLAIM`], and a charge applies only to a reservation still open
//! (`lua/ledger_v1.lua`), so each is charged once whoever claims it, and a replica that dies
//! between its claim and its charge leaves the reservation to the next sweep after [`CLAIM`].
//!
//! With admission leases on (`redis.lease_fraction` > 0), a second task ([`run_leases`]) reclaims
//! the filters' orphaned leases the same way: every half `redis.lease_ttl_ms`, one Redis call per
//! configured tenant claims its leases still open [`admission_lease::reclaim_after`] their grant,
//! and each is reclaimed once ([`Store::lease_reclaim`]) whoever claims it, so a lease whose VM
//! went away is back within one lease TTL of its expiry. Counted in
//! `llm_gateway_admission_leases_reclaimed_total`.
//!
//! [`Store::claim`]: crate::store::Store::claim
//! [`Store::lease_reclaim`]: crate::store::Store::lease_reclaim
//! [`Recorder::charge`]: crate::metering::recorder::Recorder::charge

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::MissedTickBehavior;
use tracing::{debug, warn};

use crate::admission::admission_lease;
use crate::admission::limits;
use crate::metering::ledger::{self, CLAIM};
use crate::state::{Live, Shared};
use crate::store::LeaseCharge;

/// Sweeps every `sweep_interval_ms` until `stop` turns true.
pub async fn run(live: Arc<Live>, stop: watch::Receiver<bool>) {
    let every = Duration::from_millis(live.current().config.metering.reservations.sweep_interval_ms);
    every_until(every, stop, || async {
        sweep(&live.current()).await;
    })
    .await;
}

/// Calls `pass` every `every` (the first at once; a late one delays the next) until `stop`
/// turns true.
async fn every_until<F, Fut>(every: Duration, mut stop: watch::Receiver<bool>, mut pass: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.wait_for(|stopping| *stopping) => return,
        }
        pass().await;
    }
}

/// One sweep over the configured tenants; returns how many charges it queued.
pub async fn sweep(shared: &Shared) -> usize {
    let settings = shared.config.metering.reservations;
    let age = Duration::from_millis(settings.record_after_ms);
    let store = shared.limiter.store();
    let mut open: u64 = 0;
    let mut charged = 0;
    for tenant in &shared.config.tenants {
        let result = shared
            .metrics
            .timed_redis("claim", store.claim(&tenant.id, age, CLAIM, settings.sweep_batch))
            .await;
        let claimed = match result {
            Ok(claimed) => claimed,
            Err(error) => {
                debug!(%error, tenant = %tenant.id, "reservation sweep failed");
                continue;
            }
        };
        open = open.saturating_add(claimed.open);
        for (record_id, reservation) in claimed.due {
            let Some(reservation) = reservation else {
                // Written by another version of the sidecar: left to one that reads it.
                warn!(tenant = %tenant.id, %record_id, "unreadable reservation left open");
                continue;
            };
            let record = ledger::charged_record(&tenant.id, &record_id, &reservation);
            warn!(
                tenant = %tenant.id,
                request_id = %reservation.request_id,
                %record_id,
                tokens = record.total_tokens(),
                "no usage arrived within metering.reservations.record_after_ms: reservation charged"
            );
            let api_key = reservation.api_key.as_deref();
            let buckets = limits::token_buckets_for_key(store.prefix(), tenant, &reservation.model, api_key);
            let settlements = ledger::settlements(buckets, reservation.reserved, record.total_tokens());
            shared.recorder.charge(record, settlements);
            charged += 1;
        }
    }
    shared.metrics.reservations_open.set(i64::try_from(open).unwrap_or(i64::MAX));
    charged
}

/// How often the lease sweep runs while `redis.lease_fraction` is 0: nothing new is leased, but
/// leases taken before leases were turned off are still reclaimed and their reported requests
/// charged, at a pace that costs Redis one call per tenant a minute.
pub const LEASES_OFF_SWEEP: Duration = Duration::from_secs(60);

/// How often the lease sweep runs: every half `redis.lease_ttl_ms` while leases are on, every
/// [`LEASES_OFF_SWEEP`] while they are off.
pub fn lease_sweep_interval(redis: &crate::config::redis::RedisConfig) -> Duration {
    if redis.lease_fraction > 0.0 {
        Duration::from_millis((redis.lease_ttl_ms / 2).max(1))
    } else {
        LEASES_OFF_SWEEP
    }
}

/// Reclaims orphaned admission leases, and charges the reclaimed ones' reported requests, every
/// [`lease_sweep_interval`] until `stop` turns true.
pub async fn run_leases(live: Arc<Live>, stop: watch::Receiver<bool>) {
    let every = lease_sweep_interval(&live.current().config.redis);
    every_until(every, stop, || async {
        reclaim_leases(&live.current()).await;
    })
    .await;
}

/// One pass over the configured tenants' open admission leases; returns how many it reclaimed.
pub async fn reclaim_leases(shared: &Shared) -> usize {
    let ttl = Duration::from_millis(shared.config.redis.lease_ttl_ms);
    let age = admission_lease::reclaim_after(ttl);
    // Their requests still in flight may end up to the longest stream lifetime later.
    let retention = Duration::from_millis(shared.config.metering.reservations.record_after_ms);
    let batch = shared.config.metering.reservations.sweep_batch;
    let store = shared.limiter.store();
    let mut reclaimed = 0;
    for tenant in &shared.config.tenants {
        let result = shared
            .metrics
            .timed_redis("lease_claim", store.claim_leases(&tenant.id, age, CLAIM, batch))
            .await;
        let claimed = match result {
            Ok(claimed) => claimed,
            Err(error) => {
                debug!(%error, tenant = %tenant.id, "lease reclaim sweep failed");
                continue;
            }
        };
        for (lease_id, record) in claimed.due {
            let Some(record) = record else {
                warn!(tenant = %tenant.id, %lease_id, "unreadable admission lease left open");
                continue;
            };
            let buckets = limits::plan(store.prefix(), tenant, &record.model, 0);
            let result = shared
                .metrics
                .timed_redis("lease_reclaim", store.lease_reclaim(&tenant.id, &lease_id, &buckets, retention))
                .await;
            match result {
                Ok(Some((requests, tokens))) => {
                    warn!(tenant = %tenant.id, model = %record.model, %lease_id, requests, tokens,
                        "admission lease not given back within its TTL (its filter VM went away): reclaimed");
                    shared.metrics.leases_reclaimed.inc();
                    reclaimed += 1;
                }
                // Given back meanwhile, or reclaimed by another replica.
                Ok(None) => {}
                // Due again after the claim: this or another replica retries.
                Err(error) => debug!(%error, tenant = %tenant.id, %lease_id, "lease reclaim failed"),
            }
        }
        charge_leases(shared, &tenant.id, retention, batch).await;
    }
    reclaimed
}

/// Charges the tenant's leases reclaimed more than `retention` (the longest stream lifetime)
/// ago: their reported requests whose usage never landed are charged their reservations as usage
/// ([`crate::store::Store::lease_charge`], once whoever charges), and each charge gets its usage
/// event ([`crate::store::Store::append_lease_charge`]); at most `most` per pass.
async fn charge_leases(shared: &Shared, tenant: &str, retention: Duration, most: usize) {
    let store = shared.limiter.store();
    let due = shared
        .metrics
        .timed_redis("lease_charges_due", store.lease_charges_due(tenant, retention, most))
        .await;
    let due = match due {
        Ok(due) => due,
        Err(error) => {
            debug!(%error, tenant, "lease charge sweep failed");
            return;
        }
    };
    for (lease_id, model) in due {
        let result =
            shared.metrics.timed_redis("lease_charge", store.lease_charge(tenant, &lease_id, &model)).await;
        match result {
            Ok(Some(charge)) if charge.requests > 0 => {
                warn!(tenant, %model, %lease_id, requests = charge.requests, tokens = charge.tokens,
                    "reclaimed admission lease: reported requests whose usage never arrived charged their reservations");
                shared.metrics.leases_charged_requests.inc_by(charge.requests);
                append_lease_charge(shared, tenant, &lease_id, &model, &charge).await;
            }
            // Every reported request's usage landed; or charged by another replica.
            Ok(_) => {}
            // Still in the reclaimed set: the next pass, here or on another replica, retries.
            Err(error) => debug!(%error, tenant, %lease_id, "lease charge failed"),
        }
    }
}

/// The usage event of a reclaimed lease's charge ([`crate::store::Store::append_lease_charge`]),
/// tried up to three times: the charge itself has landed, so a failure here loses the event only
/// (logged), never the books.
async fn append_lease_charge(
    shared: &Shared,
    tenant: &str,
    lease_id: &str,
    model: &str,
    charge: &LeaseCharge,
) {
    let store = shared.limiter.store();
    for attempt in 1..=3u32 {
        let result = shared
            .metrics
            .timed_redis("usage_append", store.append_lease_charge(tenant, lease_id, model, charge))
            .await;
        match result {
            Ok(_) => return,
            Err(error) if attempt == 3 => {
                warn!(%error, tenant, lease_id, "usage event of a reclaimed lease's charge not appended")
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(50 * u64::from(attempt))).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn redis(yaml: &str) -> crate::config::redis::RedisConfig {
        serde_yaml_ng::from_str(yaml).unwrap()
    }

    #[test]
    fn the_lease_sweep_runs_every_half_ttl_and_slowly_while_leases_are_off() {
        let on = redis("{url: 'redis://127.0.0.1:6379/0', lease_fraction: 0.01, lease_ttl_ms: 1000}");
        assert_eq!(lease_sweep_interval(&on), Duration::from_millis(500));
        let off = redis("{url: 'redis://127.0.0.1:6379/0', lease_ttl_ms: 1000}");
        assert_eq!(lease_sweep_interval(&off), LEASES_OFF_SWEEP, "leases taken before are still reclaimed");
        let tiny = redis("{url: 'redis://127.0.0.1:6379/0', lease_fraction: 0.01, lease_ttl_ms: 1}");
        assert_eq!(lease_sweep_interval(&tiny), Duration::from_millis(1));
    }
}
