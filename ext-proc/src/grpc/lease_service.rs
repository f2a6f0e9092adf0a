//! The tonic adapter of the admission-lease service (`llm_gateway.v1.AdmissionLeases`,
//! `proto/llm_gateway/v1/lease.proto`), called by the filter on each Envoy worker (the wasm
//! module's root context, or the native module's ticks). Each call gives the previous lease's rest
//! back to the buckets, counts the requests admitted from it toward the pool's in-flight count,
//! and, when asked, takes a new lease from Redis ([`crate::admission::admission_lease`] sizes it). A report
//! (`report_lease_id`) instead records how many requests a lease the filter still holds admitted,
//! which a reclaim keeps charged, and counts those admitted since the last call toward the
//! in-flight count. No lease while `redis.lease_fraction` is 0, while Redis cannot decide, while
//! the pool's load is at the lowest tier's shedding level, or, for a flow-controlled pool, while
//! its queue holds requests or its load is at `leases_below_load`: the filter's requests then go
//! through the ext_proc admission, which sheds (or queues) and limits them one by one. A lease
//! for a pool the sidecar sheds or queues by its load covers at most the pool's headroom
//! ([`crate::admission::lease_headroom`]).

use std::sync::Arc;

use tonic::{Request, Response, Status};
use tracing::debug;

use crate::admission::admission_lease;
use crate::admission::limits;
use crate::admission::quota::QuotaTake;
use crate::metrics::labels::LeaseOutcome;
use crate::proto::admission_leases_server::AdmissionLeases;
use crate::proto::{LeaseGrant, LeaseRequest};
use crate::state::{Live, Shared};

/// How long a filter waits before asking again when leases are off or the tenant is unknown, in
/// milliseconds.
const LEASES_OFF_RETRY_MS: u64 = 60_000;

/// The outcome of a report Redis did not record: answered `UNAVAILABLE`, so that the filter sends
/// it again.
const REPORT_FAILED: &str = "report_failed";

/// The lease service.
pub struct AdmissionLeaseService {
    live: Arc<Live>,
}

impl AdmissionLeaseService {
    /// A service over the live state: each call is served by the generation serving when it
    /// arrives.
    pub fn new(live: Arc<Live>) -> Self {
        Self { live }
    }
}

#[tonic::async_trait]
impl AdmissionLeases for AdmissionLeaseService {
    async fn acquire(&self, request: Request<LeaseRequest>) -> Result<Response<LeaseGrant>, Status> {
        let shared = self.live.current();
        let _open = shared.stream_opened();
        let request = request.into_inner();
        let (mut grant, outcome) = acquire(&shared, &request).await;
        let refused = request.want && request.report_lease_id.is_empty() && outcome != "granted";
        if refused && grant.tenant_requests_retry_ms == 0 {
            grant.tenant_requests_retry_ms = tenant_requests_wait_ms(&shared, &request);
        }
        shared.metrics.admission_leases.get_or_create(&LeaseOutcome { outcome: outcome.to_owned() }).inc();
        debug!(
            tenant = %request.tenant,
            model = %request.model,
            returned_requests = request.returned_requests,
            returned_tokens = request.returned_tokens,
            admitted = request.admitted,
            requests = grant.requests,
            tokens = grant.tokens,
            outcome,
            "admission lease"
        );
        if outcome == REPORT_FAILED {
            // The filter keeps the report and sends it again.
            return Err(Status::unavailable("the lease report was not recorded"));
        }
        Ok(Response::new(grant))
    }
}

/// Serves one call; returns the grant and its metric outcome: `granted`, `given_back` (nothing
/// asked), `reported` and `report_closed` (a report on a lease open in Redis, or on one given back
/// or reclaimed already: nothing recorded), `report_failed` (Redis did not answer: the filter
/// reports again), or why nothing was granted: `off` (`redis.lease_fraction` 0), `unknown_tenant`,
/// `picking` (the pool's `picker` takes no leases), `load_protected` (the pool is queued by flow
/// control, or its `admission_leases` is false), `shedding` (the pool is at the lowest tier's
/// shedding level, or near saturation with flow control), `too_tight` (a lease would not
/// cover two requests), `headroom` (a pool shed or queued by its load has no room for another
/// request beside this replica's other leases of it, or its signals bound nothing yet,
/// [`crate::admission::lease_headroom`]), `over_limit` (the buckets lack the lease), `quota` (a quota
/// counter of the tenant lacks room for the lease's tokens, or the tenant has quotas and no
/// tokens bucket), `redis_unavailable`.
async fn acquire(shared: &Shared, request: &LeaseRequest) -> (LeaseGrant, &'static str) {
    let config = &shared.config;
    if request.admitted > 0 {
        shared.pools.admitted_many(&request.pool, request.admitted);
    }
    let protected = config.load_protected_pool(&request.pool);
    let used = request.admitted.saturating_add(request.returned_requests);
    if protected.is_some() && used > 0 {
        // Admitted (now in the in-flight count) or given back: no longer outstanding.
        shared.pools.lease_used(&request.pool, &request.tenant, &request.model, used);
    }
    let Some(tenant) = config.tenant(&request.tenant) else {
        return (admission_lease::refusal(LEASES_OFF_RETRY_MS), "unknown_tenant");
    };
    if !request.report_lease_id.is_empty() {
        return (LeaseGrant::default(), report(shared, &tenant.id, request).await);
    }
    let plan = limits::plan(shared.limiter.store().prefix(), tenant, &request.model, request.request_tokens);
    let back = admission_lease::give_back(&plan, request.returned_requests, request.returned_tokens);
    if !request.returned_lease_id.is_empty() {
        // Given back by id, once, and only while open: a lease the sweeper reclaimed as
        // orphaned gave its rest back already. Should Redis fail now, the lease stays open and
        // is reclaimed.
        let store = shared.limiter.store();
        let result = shared
            .metrics
            .timed_redis("lease_return", store.lease_return(&tenant.id, &request.returned_lease_id, &back))
            .await;
        if let Err(error) = result {
            debug!(%error, lease_id = %request.returned_lease_id, "lease give-back failed; left to the reclaim");
        }
    } else {
        // A lease without an id (an older filter, or nothing was taken from Redis).
        for (bucket, delta) in back {
            shared.limiter.settle(&bucket, delta, false).await;
        }
    }
    if !request.want {
        return (LeaseGrant::default(), "given_back");
    }
    let fraction = config.redis.lease_fraction;
    let ttl_ms = config.redis.lease_ttl_ms;
    if fraction <= 0.0 {
        return (admission_lease::refusal(LEASES_OFF_RETRY_MS), "off");
    }
    if !config.pool_allows_admission_leases(&request.pool) {
        // Every request of a picking or queued pool (or of one that says no) goes through the
        // admission, where it is picked, shed or queued one by one.
        let picking = config.pools.iter().any(|p| p.name == request.pool && p.picker.is_some());
        return (
            admission_lease::refusal(LEASES_OFF_RETRY_MS),
            if picking { "picking" } else { "load_protected" },
        );
    }
    if shared.pools.check(&request.pool, config.shedding.lowest_level()).is_some()
        || shared.pools.near_saturation(&request.pool)
    {
        // The pool's requests go request by request through the admission (and its queue).
        return (admission_lease::refusal(ttl_ms), "shedding");
    }
    let Some(size) = admission_lease::size(&plan, fraction, request.request_tokens) else {
        return (admission_lease::refusal(ttl_ms), "too_tight");
    };
    let Some(pool) = protected else {
        return take(shared, &tenant.id, request, size, ttl_ms).await;
    };
    // A load-protected pool: the lease is capped at its share of the pool's headroom, and its
    // requests are held among the pool's leases until the take's answer (taken off again
    // unless granted).
    let until =
        std::time::Instant::now() + admission_lease::reclaim_after(std::time::Duration::from_millis(ttl_ms));
    let key = (request.tenant.as_str(), request.model.as_str());
    let Some(size) = shared.pools.hold_lease(&pool.name, config.lease_level(pool), key, until, size) else {
        let retry_ms = ttl_ms.min(pool.scrape_interval_ms).max(1);
        return (admission_lease::refusal(retry_ms), "headroom");
    };
    let held = size.requests;
    let (grant, outcome) = take(shared, &tenant.id, request, size, ttl_ms).await;
    if outcome != "granted" {
        shared.pools.lease_used(&request.pool, &request.tenant, &request.model, held);
    }
    (grant, outcome)
}

/// How long the tenant's own requests-per-minute bucket (its `limits`, shared by all its
/// models) stays empty, by what Redis last answered this sidecar for it (an ext_proc refusal, a
/// lease take), in milliseconds; 0 when it holds a request, was not seen, or the tenant has no
/// such limit. What a refused lease tells the filter (`LeaseGrant.tenant_requests_retry_ms`).
fn tenant_requests_wait_ms(shared: &Shared, request: &LeaseRequest) -> u64 {
    let Some(tenant) = shared.config.tenant(&request.tenant) else { return 0 };
    let prefix = shared.limiter.store().prefix();
    let key = limits::bucket_key(prefix, &tenant.id, limits::Scope::Tenant, limits::BucketKind::Requests);
    limits::plan(prefix, tenant, &request.model, 0)
        .iter()
        .find(|b| b.key == key)
        .and_then(|b| shared.limiter.wait_for_one_ms(b))
        .unwrap_or(0)
}

/// Takes the lease `size` of `tenant` from Redis (with its quota counters); the grant and its
/// metric outcome.
async fn take(
    shared: &Shared,
    tenant_id: &str,
    request: &LeaseRequest,
    size: admission_lease::LeaseSize,
    ttl_ms: u64,
) -> (LeaseGrant, &'static str) {
    // Quotas (crate::admission::quota): a lease only while every counter of the tenant (and tenant × model)
    // has room for all of the lease's tokens, and never without a tokens bucket to bound them.
    let store = shared.limiter.store();
    let quota_specs =
        store.quotas().plan(store.prefix(), tenant_id, &request.model, store.quotas().clock.now_ms());
    if !quota_specs.is_empty() && size.tokens_unlimited {
        return (admission_lease::refusal(ttl_ms), "quota");
    }
    let quota_take = QuotaTake { specs: &quota_specs, need: size.tokens, charge: 0 };
    let quotas = (!quota_specs.is_empty()).then_some((tenant_id, &quota_take));
    if size.plan.is_empty() && quotas.is_none() {
        // No limit applies: nothing to take, nothing to give back.
        let outcome = limits::TakeOutcome { denied: None, states: Vec::new() };
        return (admission_lease::grant(&size, &outcome, ttl_ms, String::new()), "granted");
    }
    let lease_id = format!("l-{}", shared.ids.next());
    let record = admission_lease::LeaseRecord::of(&size, &request.model);
    let quotas = quotas.map(|(_, q)| q);
    match shared.limiter.take_lease(tenant_id, &lease_id, &record, &size.plan, quotas).await {
        Some((_, true)) => (admission_lease::refusal(ttl_ms), "quota"),
        Some((outcome, false)) if outcome.denied.is_none() => {
            (admission_lease::grant(&size, &outcome, ttl_ms, lease_id), "granted")
        }
        Some((outcome, _)) => {
            // The tenant's own RPM bucket empty: the filter refuses its requests at their headers.
            let tenant_rpm = limits::bucket_key(
                store.prefix(),
                tenant_id,
                limits::Scope::Tenant,
                limits::BucketKind::Requests,
            );
            let grant = LeaseGrant {
                tenant_requests_retry_ms: admission_lease::tenant_requests_wait_ms(
                    &size.plan,
                    &outcome,
                    &tenant_rpm,
                )
                .unwrap_or(0),
                ..admission_lease::refusal(ttl_ms)
            };
            (grant, "over_limit")
        }
        None => (admission_lease::refusal(ttl_ms), "redis_unavailable"),
    }
}

/// Records a report on a lease the filter holds ([`crate::store::Store::lease_report`]); its
/// metric outcome.
async fn report(shared: &Shared, tenant: &str, request: &LeaseRequest) -> &'static str {
    let store = shared.limiter.store();
    let result = shared
        .metrics
        .timed_redis(
            "lease_report",
            store.lease_report(
                tenant,
                &request.report_lease_id,
                request.report_admitted,
                request.report_reserved_tokens,
                request.report_prompt_tokens,
            ),
        )
        .await;
    match result {
        Ok(true) => {
            shared.reported_leases.recorded(&request.report_lease_id, request.report_admitted);
            "reported"
        }
        Ok(false) => "report_closed",
        Err(error) => {
            debug!(%error, lease_id = %request.report_lease_id, "lease report failed; the filter reports again");
            REPORT_FAILED
        }
    }
}
