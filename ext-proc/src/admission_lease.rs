//! Admission leases for the wasm filter, with no I/O: how large a lease of one (tenant, model)
//! is, what a returned lease gives back to each bucket, and the grant the filter reads
//! (`proto/llm_gateway/v1/lease.proto`). The tonic adapter is [`crate::lease_service`].
//!
//! A lease is `redis.lease_fraction` of the smallest capacity among the request plan's buckets of
//! each kind, taken from every bucket of that kind: the filter then admits one request per leased
//! request and its reservation (prompt + max tokens) from the leased tokens, exactly as the
//! ext_proc admission would have taken them. The take is all-or-nothing (`token_bucket_take_v3`
//! with the lease as the cost): a tenant near its limit gets no lease, and each of its requests is
//! decided against Redis by the ext_proc admission. A lease is granted only when it covers at
//! least two requests of the largest reservation the filter saw.

use crate::limits::{self, BucketKind, BucketSpec, TakeOutcome};
use crate::proto::{LeaseGrant, LimitState};

/// The size of one lease and the plan that takes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseSize {
    /// The request plan's buckets with the lease as each one's cost.
    pub plan: Vec<BucketSpec>,
    /// Requests leased (0 when `requests_unlimited`).
    pub requests: u64,
    /// Tokens leased (0 when `tokens_unlimited`).
    pub tokens: u64,
    /// No requests-per-minute bucket applies.
    pub requests_unlimited: bool,
    /// No tokens-per-minute bucket applies.
    pub tokens_unlimited: bool,
}

/// Sizes a lease for a request plan (from [`limits::plan`]) whose largest reservation is
/// `request_tokens`: `fraction` of the smallest capacity of each kind. `None` when a limited kind's
/// lease would not cover two requests (too tight to lease: the ext_proc admission decides).
pub fn size(plan: &[BucketSpec], fraction: f64, request_tokens: u64) -> Option<LeaseSize> {
    let lease_of = |kind: BucketKind| {
        plan.iter().filter(|b| b.kind == kind).map(|b| (b.capacity as f64 * fraction).floor() as u64).min()
    };
    let requests = lease_of(BucketKind::Requests);
    let tokens = lease_of(BucketKind::Tokens);
    if requests.is_some_and(|r| r < 2) || tokens.is_some_and(|t| t < request_tokens.max(1).saturating_mul(2))
    {
        return None;
    }
    let plan = plan
        .iter()
        .map(|b| BucketSpec {
            cost: match b.kind {
                BucketKind::Requests => requests.unwrap_or(0),
                BucketKind::Tokens => tokens.unwrap_or(0),
            },
            ..b.clone()
        })
        .collect();
    Some(LeaseSize {
        plan,
        requests: requests.unwrap_or(0),
        tokens: tokens.unwrap_or(0),
        requests_unlimited: requests.is_none(),
        tokens_unlimited: tokens.is_none(),
    })
}

/// What a returned lease gives back: `returned_requests` to every requests bucket of the plan
/// and `returned_tokens` to every tokens bucket (each at most its capacity), as settlements.
pub fn give_back(
    plan: &[BucketSpec],
    returned_requests: u64,
    returned_tokens: u64,
) -> Vec<(BucketSpec, i64)> {
    plan.iter()
        .filter_map(|b| {
            let back = match b.kind {
                BucketKind::Requests => returned_requests,
                BucketKind::Tokens => returned_tokens,
            }
            .min(b.capacity);
            (back > 0).then(|| (BucketSpec { cost: 0, ..b.clone() }, i64::try_from(back).unwrap_or(i64::MAX)))
        })
        .collect()
}

/// The grant of a lease Redis admitted (`outcome` of taking `size.plan`), admitting for `ttl_ms`.
/// Each kind reports its tightest bucket's `x-ratelimit-*` values at the grant.
pub fn grant(size: &LeaseSize, outcome: &TakeOutcome, ttl_ms: u64) -> LeaseGrant {
    let state = |kind: BucketKind| {
        size.plan
            .iter()
            .zip(&outcome.states)
            .filter(|(b, _)| b.kind == kind)
            .min_by_key(|(_, s)| s.remaining)
            .map(|(b, s)| LimitState {
                limit: b.rate_per_minute,
                remaining: s.remaining,
                reset: limits::format_reset(s.reset_ms),
            })
    };
    LeaseGrant {
        requests: size.requests,
        tokens: size.tokens,
        requests_unlimited: size.requests_unlimited,
        tokens_unlimited: size.tokens_unlimited,
        ttl_ms,
        retry_after_ms: 0,
        requests_state: state(BucketKind::Requests),
        tokens_state: state(BucketKind::Tokens),
    }
}

/// No lease: the filter sends the requests of this key to the ext_proc admission, and asks again
/// after `retry_after_ms` at the earliest.
pub fn refusal(retry_after_ms: u64) -> LeaseGrant {
    LeaseGrant { retry_after_ms: retry_after_ms.max(1), ..Default::default() }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Limits, TenantConfig};
    use crate::limits::BucketState;

    fn tenant(rpm: Option<u64>, tpm: Option<u64>) -> TenantConfig {
        let limits = Limits {
            requests_per_minute: rpm,
            request_burst: None,
            tokens_per_minute: tpm,
            token_burst: None,
        };
        TenantConfig {
            id: "acme".into(),
            limits,
            model_limits: Default::default(),
            quota: Default::default(),
            model_quotas: Default::default(),
        }
    }

    #[test]
    fn a_lease_is_a_fraction_of_the_smallest_bucket_of_each_kind() {
        let mut t = tenant(Some(6000), Some(1_000_000));
        t.model_limits.insert(
            "m".into(),
            Limits {
                requests_per_minute: Some(1000),
                request_burst: None,
                tokens_per_minute: None,
                token_burst: None,
            },
        );
        let plan = limits::plan("p", &t, "m", 300);
        let s = size(&plan, 0.01, 300).unwrap();
        assert_eq!(
            (s.requests, s.tokens, s.requests_unlimited, s.tokens_unlimited),
            (10, 10_000, false, false)
        );
        let costs: Vec<_> = s.plan.iter().map(|b| b.cost).collect();
        assert_eq!(costs, [10, 10_000, 10], "every bucket of a kind gives the same lease");
    }

    #[test]
    fn too_tight_limits_are_not_leased_and_absent_kinds_are_unlimited() {
        let plan = limits::plan("p", &tenant(Some(100), Some(1_000_000)), "m", 300);
        assert_eq!(size(&plan, 0.01, 300), None, "1 % of 100 requests is one request");
        let plan = limits::plan("p", &tenant(Some(6000), Some(50_000)), "m", 300);
        assert_eq!(size(&plan, 0.01, 300), None, "500 tokens do not cover two requests of 300");
        assert!(size(&plan, 0.01, 250).is_some());
        let plan = limits::plan("p", &tenant(None, Some(1_000_000)), "m", 300);
        let s = size(&plan, 0.01, 300).unwrap();
        assert!(s.requests_unlimited && !s.tokens_unlimited);
        let s = size(&[], 0.01, 300).unwrap();
        assert!(s.requests_unlimited && s.tokens_unlimited && s.plan.is_empty());
    }

    #[test]
    fn returns_go_to_every_bucket_of_their_kind() {
        let plan = limits::plan("p", &tenant(Some(6000), Some(1000)), "m", 300);
        let back = give_back(&plan, 3, 5000);
        assert_eq!(
            back.iter().map(|(b, d)| (b.kind, *d)).collect::<Vec<_>>(),
            [(BucketKind::Requests, 3), (BucketKind::Tokens, 1000)]
        );
        assert!(give_back(&plan, 0, 0).is_empty());
    }

    #[test]
    fn a_grant_reports_the_tightest_bucket() {
        let plan = limits::plan("p", &tenant(Some(6000), Some(1_000_000)), "m", 300);
        let s = size(&plan, 0.01, 300).unwrap();
        let outcome = TakeOutcome {
            denied: None,
            states: vec![
                BucketState { remaining: 5900, reset_ms: 1000, retry_after_ms: Some(0) },
                BucketState { remaining: 990_000, reset_ms: 600, retry_after_ms: Some(0) },
            ],
        };
        let g = grant(&s, &outcome, 1000);
        assert_eq!((g.requests, g.tokens, g.ttl_ms), (60, 10_000, 1000));
        let r = g.requests_state.unwrap();
        assert_eq!((r.limit, r.remaining, r.reset.as_str()), (6000, 5900, "1s"));
        assert_eq!(g.tokens_state.unwrap().reset, "0.6s");
        assert_eq!(refusal(0).retry_after_ms, 1);
    }
}
