//! Admission decisions, with no I/O: what a request reserves, and what the limiter's outcome
//! means for it (admit with `x-ratelimit-*` values, or a 429).

use crate::admission::limits::{self, BucketSpec, TakeOutcome};
use crate::error::AdmissionError;

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
    use crate::facts::RequestFacts;

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
                api_keys: Vec::new(),
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
