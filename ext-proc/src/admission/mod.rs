//! The admission stage: whether a request goes upstream now, and what it reserves.
//!
//! A request's path through it (`crate::service` drives it per ext_proc stream): the exact
//! prompt count where only it can decide the context rule ([`context`]); shedding in front of a
//! saturated pool ([`shedding`]; flow control's queue is [`crate::flow_control`]); quotas
//! ([`quota`]); the RPM/TPM plan and its take in Redis ([`limits`], [`limiter`], with the
//! in-memory buckets of [`local_limiter`], the circuit breaker of [`breaker`] and the sidecar's
//! own token leases of [`lease`]); and the filter's admission leases ([`admission_lease`], served
//! by [`lease_service`], bounded by a load-protected pool's headroom: [`lease_headroom`]). This module holds the pure decisions over the limiter's outcome.
//!
//! Admission decisions, with no I/O: what a request reserves, and what the limiter's outcome
//! means for it (admit with `x-ratelimit-*` values, or a 429).

pub mod admission_lease;
pub mod admit;
pub mod breaker;
pub mod context;
pub mod lease;
pub mod lease_headroom;
pub mod lease_service;
pub mod limiter;
pub mod limits;
pub mod local_limiter;
pub mod pipeline;
pub mod quota;
pub mod shedding;

use crate::error::AdmissionError;
use limits::{BucketSpec, TakeOutcome};

/// What the wasm filter told the sidecar about a request: its [`gateway_contract::RequestFacts`]
/// (filter state), and Envoy's `x-request-id`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestFacts {
    /// `x-gateway-tenant`: the authenticated tenant (None: the filter did not decide the
    /// request).
    pub tenant: Option<String>,
    /// `x-gateway-model`: the public model name.
    pub model: String,
    /// `x-gateway-pool`: the Envoy cluster of the vLLM pool.
    pub pool: String,
    /// `x-gateway-prompt-tokens`: prompt tokens, exact or estimated (0 when absent).
    pub prompt_tokens: u64,
    /// `max_tokens` of the facts: the most completion tokens the request can produce over all its
    /// choices (0 when absent).
    pub max_tokens: u64,
    /// `x-request-id`.
    pub request_id: String,
    /// `x-gateway-tier`: the tenant's priority tier (empty when absent).
    pub tier: String,
    /// `x-gateway-reserved-tokens`, when the filter admitted the request from an admission lease
    /// (`x-gateway-admission: lease`): the tokens it reserved from the lease.
    pub leased_tokens: Option<u64>,
    /// The lease that admitted the request ([`gateway_contract::RequestFacts::lease_id`]; only
    /// with `leased_tokens`).
    pub lease_id: Option<String>,
    /// The request's number among its lease's admissions
    /// ([`gateway_contract::RequestFacts::lease_seq`]; only with `lease_id`).
    pub lease_seq: Option<u64>,
    /// The filter's prompt-prefix hashes ([`gateway_contract::RequestFacts::prefix_hashes`],
    /// encoded), for the endpoint picker.
    pub prefix_hashes: Option<String>,
    /// The filter's per-request nonce ([`gateway_contract::RequestFacts::nonce`]; `None` from an
    /// older filter).
    pub nonce: Option<String>,
    /// The most prompt tokens the upstream can report
    /// ([`gateway_contract::RequestFacts::prompt_tokens_max`]; `None` from an older filter or
    /// from headers).
    pub prompt_tokens_max: Option<u64>,
    /// The most completion tokens the upstream can report
    /// ([`gateway_contract::RequestFacts::completion_tokens_max`]).
    pub completion_tokens_max: Option<u64>,
    /// The request body's size in bytes ([`gateway_contract::RequestFacts::body_bytes`]): what
    /// Envoy holds for it while it is queued.
    pub body_bytes: Option<u64>,
}

impl RequestFacts {
    /// The facts the filter set (filter state); the request id is the one the filter saw, else
    /// `request_id` (Envoy's `x-request-id` where the caller reads it, from a filter older than
    /// the facts' `request_id`).
    pub fn from_filter(facts: gateway_contract::RequestFacts, request_id: String) -> Self {
        Self {
            tenant: Some(facts.tenant),
            model: facts.model,
            pool: facts.pool,
            prompt_tokens: facts.prompt_tokens,
            max_tokens: facts.max_tokens,
            request_id: facts.request_id.unwrap_or(request_id),
            tier: facts.tier,
            leased_tokens: facts.leased_tokens,
            lease_seq: facts.lease_seq.filter(|_| facts.leased_tokens.is_some() && facts.lease_id.is_some()),
            lease_id: facts.lease_id.filter(|_| facts.leased_tokens.is_some()),
            prefix_hashes: facts.prefix_hashes,
            nonce: facts.nonce,
            prompt_tokens_max: facts.prompt_tokens_max,
            completion_tokens_max: facts.completion_tokens_max,
            body_bytes: facts.body_bytes,
        }
    }

    /// The request's record id in the ledger ([`gateway_contract::record_id`] of its request id
    /// and nonce); `None` without a valid nonce (facts of an older filter: its usage record gets
    /// another id, and its reservation is not tracked).
    pub fn record_id(&self) -> Option<String> {
        gateway_contract::record_id(&self.request_id, self.nonce.as_deref()?)
    }

    /// Tokens to reserve against the tenant's TPM bucket: prompt plus the completion cap, the
    /// most the request can cost. Settled against the real usage when it ends.
    pub fn reserve_tokens(&self) -> u64 {
        self.prompt_tokens.saturating_add(self.max_tokens)
    }
}

/// The decision for an admitted request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Admitted {
    /// OpenAI's `x-ratelimit-*` headers for the response.
    pub ratelimit_headers: Vec<(String, String)>,
    /// The reservation: prompt + max tokens, when the request drew on a TPM bucket (0 without
    /// one). Each TPM bucket took `min(reserved_tokens, its capacity)`; [`settlement`] gives each
    /// its own difference back.
    pub reserved_tokens: u64,
    /// Whether the buckets were taken in this sidecar's memory (Redis unavailable, failure mode
    /// `open`), so the settlement goes there too.
    pub reserved_locally: bool,
    /// When the take recorded the reservation as open in the ledger ([`crate::metering::ledger`]): the
    /// admission's Unix time in ms (the reservation's `at_ms`). A give-back then closes it there.
    pub tracked_at_ms: Option<u64>,
    /// What the take charged the tenant's quota counters ([`crate::admission::quota`]; 0: none), and the
    /// admission's time on the quota clock (their periods).
    pub quota: (u64, u64),
    /// The `x-gateway-quota-warning` value, when a quota is past its soft limit.
    pub quota_warning: Option<String>,
}

/// What settling a finished request gives back to (positive) or charges (negative) one TPM
/// bucket: the bucket's own reservation, `min(reserved, capacity)`, minus the tokens used.
pub fn settlement(bucket: &BucketSpec, reserved_tokens: u64, used_tokens: u64) -> i64 {
    let taken = reserved_tokens.min(bucket.capacity);
    i64::try_from(taken).unwrap_or(i64::MAX).saturating_sub(i64::try_from(used_tokens).unwrap_or(i64::MAX))
}

/// What moving one TPM bucket's reservation from `before` to `after` tokens gives back to it
/// (positive) or charges (negative): each bucket holds `min(reservation, its capacity)`.
pub fn rereservation(bucket: &BucketSpec, before: u64, after: u64) -> i64 {
    let held = |tokens: u64| i64::try_from(tokens.min(bucket.capacity)).unwrap_or(i64::MAX);
    held(before).saturating_sub(held(after))
}

/// Reads the limiter's outcome for the planned buckets.
///
/// # Errors
/// [`AdmissionError::RateLimited`] naming the first bucket that lacked tokens.
/// `reserve_tokens` is the request's reservation (prompt + max tokens) before capping.
pub fn decide(
    plan: &[BucketSpec],
    outcome: &TakeOutcome,
    reserve_tokens: u64,
) -> Result<Admitted, AdmissionError> {
    let ratelimit_headers = limits::ratelimit_headers(plan, outcome);
    if let Some(i) = outcome.denied {
        let (bucket, state) = match (plan.get(i), outcome.states.get(i)) {
            (Some(b), Some(s)) => (b, s),
            _ => return Err(AdmissionError::LimiterUnavailable),
        };
        // A cost that can never fit (rate 0) is not possible with validated config; answer a
        // minute then.
        let retry_ms = state.retry_after_ms.unwrap_or(60_000);
        return Err(AdmissionError::RateLimited {
            kind: bucket.kind,
            limit: bucket.rate_per_minute,
            requested: bucket.cost,
            retry_after_secs: limits::retry_after_secs(retry_ms),
            ratelimit_headers,
        });
    }
    let has_tokens = plan.iter().any(|b| b.kind == limits::BucketKind::Tokens);
    Ok(Admitted {
        ratelimit_headers,
        reserved_tokens: if has_tokens { reserve_tokens } else { 0 },
        reserved_locally: false,
        tracked_at_ms: None,
        quota: (0, 0),
        quota_warning: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::tenants::{Limits, TenantConfig};

    fn plan() -> Vec<BucketSpec> {
        let l = Limits {
            requests_per_minute: Some(2),
            request_burst: None,
            tokens_per_minute: Some(1000),
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
            300,
        )
    }

    #[test]
    fn admitted_carries_headers_and_reservation() {
        let p = plan();
        let (o, _) = TakeOutcome::from_reply(&[1, 0, 1, 30000, 0, 0, 700, 18000, 0, 0], 2).unwrap();
        let a = decide(&p, &o, 300).unwrap();
        assert_eq!(a.reserved_tokens, 300);
        assert!(a.ratelimit_headers.contains(&("x-ratelimit-remaining-requests".into(), "1".into())));
    }

    #[test]
    fn denied_names_the_bucket_and_rounds_retry_after_up() {
        let p = plan();
        let (o, _) = TakeOutcome::from_reply(&[0, 1, 0, 60000, 29001, 0, 1000, 0, 0, 0], 2).unwrap();
        match decide(&p, &o, 300).unwrap_err() {
            AdmissionError::RateLimited { kind, limit, requested, retry_after_secs, .. } => {
                assert_eq!(
                    (kind, limit, requested, retry_after_secs),
                    (limits::BucketKind::Requests, 2, 1, 30)
                );
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn each_bucket_is_settled_against_its_own_reservation() {
        let small = BucketSpec {
            kind: limits::BucketKind::Tokens,
            key: "k".into(),
            capacity: 100,
            rate_per_minute: 1,
            cost: 100,
        };
        let big = BucketSpec { capacity: 10_000, cost: 300, ..small.clone() };
        assert_eq!(settlement(&big, 300, 18), 282);
        assert_eq!(settlement(&small, 300, 18), 82, "it took only its capacity");
        assert_eq!(settlement(&small, 300, 250), -150, "usage beyond a capped reservation is charged");
        assert_eq!(settlement(&big, 0, 18), -18, "no reservation: the usage is charged");
    }

    #[test]
    fn an_exact_count_moves_each_buckets_reservation() {
        let small = BucketSpec {
            kind: limits::BucketKind::Tokens,
            key: "k".into(),
            capacity: 100,
            rate_per_minute: 1,
            cost: 0,
        };
        let big = BucketSpec { capacity: 10_000, ..small.clone() };
        assert_eq!(rereservation(&big, 300, 250), 50, "a smaller exact count gives back");
        assert_eq!(rereservation(&big, 250, 300), -50, "a larger one takes the rest");
        assert_eq!(rereservation(&small, 300, 250), 0, "both over its capacity: nothing moves");
        assert_eq!(rereservation(&small, 80, 300), -20, "up to its capacity");
        assert_eq!(rereservation(&big, u64::MAX, 0), 10_000);
    }

    #[test]
    fn reservation_saturates() {
        let f = RequestFacts { prompt_tokens: u64::MAX, max_tokens: 5, ..Default::default() };
        assert_eq!(f.reserve_tokens(), u64::MAX);
    }
}
