//! The admission proper, for one request: its tenant, shedding in front of its pool, its limits
//! and quotas taken in Redis (or the limiter's fallback) with its reservation recorded in the
//! ledger, and what the outcome means ([`crate::admission::decision::decide`], [`crate::admission::quota::decide`]).

use tracing::{debug, Instrument};

use crate::admission::decision;
use crate::admission::decision::Admitted;
use crate::admission::limiter::Take;
use crate::admission::limits::{self, BucketKind};
use crate::admission::quota::{self, QuotaTake};
use crate::error::AdmissionError;
use crate::facts::RequestFacts;
use crate::metering::ledger::Reservation;
use crate::metrics::labels::{Decision, PoolTier};
use crate::state::Shared;
use crate::store::Tracking;

/// Admits a request, or refuses it ([`AdmissionError`]): see the module's documentation.
pub async fn admit(shared: &Shared, facts: &RequestFacts) -> Result<Admitted, AdmissionError> {
    let config = &shared.config;
    let tenant = facts.tenant.as_deref().ok_or(AdmissionError::MissingTenant)?;
    let tenant_config = config.tenant(tenant).ok_or(AdmissionError::TenantNotConfigured)?;
    // Shed before taking quota: a request the pool cannot serve soon costs the tenant nothing.
    // A tier that queues in a flow-controlled pool is not shed: its predicted wait was checked
    // before (admission_stream).
    let shed = match shared.queued_tier(facts) {
        Some(_) => None,
        None => shared.pools.check(&facts.pool, config.shedding.level(&facts.tier)),
    };
    if let Some(shed) = shed {
        let labels =
            PoolTier { pool: shared.metrics.bounded(&facts.pool), tier: shared.metrics.bounded(&facts.tier) };
        shared.metrics.shed.get_or_create(&labels).inc();
        debug!(load = shed.load, pool = %facts.pool, "shed");
        return Err(AdmissionError::Overloaded {
            pool: facts.pool.clone(),
            retry_after_secs: shed.retry_after_secs,
        });
    }
    let prefix = shared.limiter.store().prefix();
    let api_key = facts.api_key.as_deref();
    let plan = limits::plan_for_key(prefix, tenant_config, &facts.model, api_key, facts.reserve_tokens());
    // The reservation the ledger keeps open until the request's usage lands (crate::metering::ledger):
    // recorded by the same Redis call that takes the buckets.
    let at_ms = unix_ms();
    let reserved = if plan.iter().any(|b| b.kind == BucketKind::Tokens) { facts.reserve_tokens() } else { 0 };
    let record_id = facts.record_id();
    // The tenant's quota counters (crate::admission::quota), checked and charged in the same call; charged
    // only with a tracked reservation (the record corrects what the reservation charged).
    let store = shared.limiter.store();
    let quota_ms = store.quotas().clock.shift_ms(at_ms);
    let quota_specs = store.quotas().plan(store.prefix(), tenant, &facts.model, quota_ms);
    let quota_charge =
        if record_id.is_some() && !quota_specs.is_empty() { facts.reserve_tokens().max(1) } else { 0 };
    let reservation = Reservation::of(facts, reserved, at_ms).with_quota(quota_charge, quota_ms);
    let tracking = record_id.as_deref().map(|record_id| Tracking {
        tenant,
        record_id,
        reservation: &reservation,
        keep: shared.reservation_keep(),
    });
    if plan.is_empty() && quota_specs.is_empty() {
        // No limit to take: the reservation alone is recorded (one Redis call).
        let tracked = match &tracking {
            Some(t) => shared.limiter.track(t).await,
            None => false,
        };
        return Ok(Admitted {
            ratelimit_headers: Vec::new(),
            reserved_tokens: 0,
            reserved_locally: false,
            tracked_at_ms: tracked.then_some(at_ms),
            quota: (0, 0),
            quota_warning: None,
        });
    }
    let quota_take = QuotaTake { specs: &quota_specs, need: 0, charge: quota_charge };
    let quotas = (!quota_specs.is_empty()).then_some((tenant, &quota_take));
    let mode = config.redis.failure_mode(&facts.tier);
    let (take, tracked, quota) = shared
        .limiter
        .take(&plan, mode, tracking.as_ref(), quotas)
        .instrument(tracing::info_span!("rate_limit", db.system = "redis", otel.kind = "client"))
        .await;
    let (outcome, degraded) = match take {
        Take::Redis(outcome) => (outcome, false),
        Take::Local(outcome) => (outcome, true),
        Take::Unavailable => return Err(AdmissionError::LimiterUnavailable),
    };
    let decision = decision::decide(&plan, &outcome, facts.reserve_tokens())
        .and_then(|admitted| match &quota {
            Some(q) => quota::decide(&quota_specs, q, quota_ms).map(|warning| Admitted {
                quota: (if tracked { quota_charge } else { 0 }, quota_ms),
                quota_warning: warning,
                ..admitted
            }),
            None => Ok(admitted),
        })
        .map(|admitted| Admitted {
            reserved_locally: degraded,
            tracked_at_ms: tracked.then_some(at_ms),
            ..admitted
        });
    let labels = Decision {
        decision: if decision.is_ok() { "admit" } else { "deny" }.to_owned(),
        degraded: degraded.to_string(),
    };
    shared.metrics.limit_decisions.get_or_create(&labels).inc();
    decision
}

/// Unix milliseconds now (the sidecar's clock).
fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}
