//! Limit arithmetic, with no I/O: which token buckets a request draws on, how the Redis script's
//! reply is read, and the `Retry-After` / `x-ratelimit-*` values that follow from it.
//!
//! Buckets live in Redis (see `lua/token_bucket_take_v3.lua`); keys carry the tenant as a hash tag
//! (`<prefix>:rl:{<tenant>}:rpm`) so one tenant's buckets share a Redis Cluster slot and one
//! script call can touch them all atomically.

use crate::config::tenants::TenantConfig;

/// What a bucket counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BucketKind {
    /// Requests per minute (OpenAI's `x-ratelimit-*-requests`).
    Requests,
    /// Tokens per minute, prompt plus completion (OpenAI's `x-ratelimit-*-tokens`).
    Tokens,
}

impl BucketKind {
    /// The word OpenAI uses in its 429 `error.type` and header names: `requests` or `tokens`.
    pub fn as_str(self) -> &'static str {
        match self {
            BucketKind::Requests => "requests",
            BucketKind::Tokens => "tokens",
        }
    }
}

/// One bucket to draw from: its Redis key, size, refill rate and the cost of this request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BucketSpec {
    /// What it counts.
    pub kind: BucketKind,
    /// Redis key (hash-tagged by tenant).
    pub key: String,
    /// Most tokens the bucket holds (the burst).
    pub capacity: u64,
    /// Refill rate, per minute.
    pub rate_per_minute: u64,
    /// What this request takes from it.
    pub cost: u64,
}

/// Whose bucket: the tenant's across all models, or the tenant's for one model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope<'a> {
    /// `tenants[].limits`.
    Tenant,
    /// `tenants[].model_limits.<model>`.
    Model(&'a str),
    /// `tenants[].api_keys[]`, by the key's name.
    ApiKey(&'a str),
}

/// The Redis key of a bucket: `<prefix>:rl:{<tenant>}:rpm` (or `:tpm`),
/// `<prefix>:rl:{<tenant>}:m:<model>:rpm` for a per-model bucket and
/// `<prefix>:rl:{<tenant>}:k:<key name>:rpm` for a per-key one. The `{tenant}` hash tag puts all
/// of a tenant's buckets in one Redis Cluster slot.
pub fn bucket_key(prefix: &str, tenant: &str, scope: Scope<'_>, kind: BucketKind) -> String {
    let suffix = match kind {
        BucketKind::Requests => "rpm",
        BucketKind::Tokens => "tpm",
    };
    match scope {
        Scope::Tenant => format!("{prefix}:rl:{{{tenant}}}:{suffix}"),
        Scope::Model(model) => format!("{prefix}:rl:{{{tenant}}}:m:{model}:{suffix}"),
        Scope::ApiKey(name) => format!("{prefix}:rl:{{{tenant}}}:k:{name}:{suffix}"),
    }
}

/// The buckets one request draws on, for the tenant and (if configured) the tenant × model:
/// one request from each RPM bucket, and `reserve_tokens` from each TPM bucket, capped at the
/// bucket's capacity (a reservation larger than the burst could never be admitted; the excess is
/// charged when the request is settled).
pub fn plan(prefix: &str, tenant: &TenantConfig, model: &str, reserve_tokens: u64) -> Vec<BucketSpec> {
    plan_for_key(prefix, tenant, model, None, reserve_tokens)
}

/// [`plan`], and the buckets of the request's API key (its name, `api_key`) when the tenant
/// gives it limits of its own.
pub fn plan_for_key(
    prefix: &str,
    tenant: &TenantConfig,
    model: &str,
    api_key: Option<&str>,
    reserve_tokens: u64,
) -> Vec<BucketSpec> {
    let mut scopes = vec![(Scope::Tenant, &tenant.limits)];
    if let Some(limits) = tenant.model_limits.get(model) {
        scopes.push((Scope::Model(model), limits));
    }
    if let Some((name, limits)) = api_key.and_then(|k| Some((k, tenant.key_limits(k)?))) {
        scopes.push((Scope::ApiKey(name), limits));
    }
    let mut buckets = Vec::with_capacity(4);
    for (scope, limits) in scopes {
        if let Some(rate) = limits.requests_per_minute {
            buckets.push(BucketSpec {
                kind: BucketKind::Requests,
                key: bucket_key(prefix, &tenant.id, scope, BucketKind::Requests),
                capacity: limits.request_burst.unwrap_or(rate),
                rate_per_minute: rate,
                cost: 1,
            });
        }
        if let Some(rate) = limits.tokens_per_minute {
            let capacity = limits.token_burst.unwrap_or(rate);
            buckets.push(BucketSpec {
                kind: BucketKind::Tokens,
                key: bucket_key(prefix, &tenant.id, scope, BucketKind::Tokens),
                capacity,
                rate_per_minute: rate,
                cost: reserve_tokens.min(capacity),
            });
        }
    }
    buckets
}

/// The token buckets a request's usage is settled against (cost 0), tenant and tenant × model.
pub fn token_buckets(prefix: &str, tenant: &TenantConfig, model: &str) -> Vec<BucketSpec> {
    token_buckets_for_key(prefix, tenant, model, None)
}

/// [`token_buckets`], and the API key's own when it has limits ([`plan_for_key`]).
pub fn token_buckets_for_key(
    prefix: &str,
    tenant: &TenantConfig,
    model: &str,
    api_key: Option<&str>,
) -> Vec<BucketSpec> {
    plan_for_key(prefix, tenant, model, api_key, 0)
        .into_iter()
        .filter(|b| b.kind == BucketKind::Tokens)
        .collect()
}

/// State of one bucket after a take, as the script reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BucketState {
    /// Tokens left (after taking, when admitted), floored.
    pub remaining: u64,
    /// Milliseconds until the bucket is full again.
    pub reset_ms: u64,
    /// Milliseconds until this request's cost would fit (0 when it fits; `None` never).
    pub retry_after_ms: Option<u64>,
}

/// The outcome of one take across a request's buckets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TakeOutcome {
    /// Index (into the plan) of the first bucket that lacked tokens; `None` when admitted.
    pub denied: Option<usize>,
    /// One state per planned bucket, in plan order.
    pub states: Vec<BucketState>,
}

/// Errors reading the take script's reply.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("unexpected reply from token_bucket_take_v3.lua: {0}")]
pub struct ReplyError(pub String);

impl TakeOutcome {
    /// Reads the flat reply of `token_bucket_take_v3.lua` for `n` buckets:
    /// `[admitted, denied_index, (remaining, reset_ms, retry_after_ms, granted) × n]`; returns the
    /// outcome and the lease tokens granted per bucket.
    ///
    /// # Errors
    /// [`ReplyError`] when the reply does not have that shape.
    pub fn from_reply(reply: &[i64], n: usize) -> Result<(Self, Vec<u64>), ReplyError> {
        if reply.len() != 2 + 4 * n {
            return Err(ReplyError(format!("{} values for {n} buckets", reply.len())));
        }
        let (head, rest) = reply.split_at(2);
        let denied = match head {
            [1, 0] => None,
            [0, i] if *i >= 1 && (*i as usize) <= n => Some(*i as usize - 1),
            other => return Err(ReplyError(format!("header {other:?}"))),
        };
        let mut granted = Vec::with_capacity(n);
        let states = rest
            .chunks_exact(4)
            .map(|c| match c {
                [remaining, reset, retry, lease] => {
                    granted.push((*lease).max(0) as u64);
                    BucketState {
                        remaining: (*remaining).max(0) as u64,
                        reset_ms: (*reset).max(0) as u64,
                        retry_after_ms: u64::try_from(*retry).ok(),
                    }
                }
                _ => BucketState { remaining: 0, reset_ms: 0, retry_after_ms: None },
            })
            .collect();
        Ok((Self { denied, states }, granted))
    }
}

/// OpenAI's `x-ratelimit-*` response headers for the buckets of a request, e.g.
/// `x-ratelimit-limit-requests: 60`, `x-ratelimit-remaining-requests: 59`,
/// `x-ratelimit-reset-requests: 1s` (a duration in OpenAI's `1m30s` / `0.5s` style).
/// The limit is the per-minute rate. When a request draws on a tenant bucket and a tenant × model
/// bucket of the same kind, the one with the fewest remaining is reported. A request admitted
/// from a lease (this sidecar's token lease, or a filter's admission lease: on by default in
/// gatewayctl's renders) reports the bucket's remaining at the lease's grant plus what the lease
/// still holds: approximate (docs/deploy.md, "Why leases are the default").
pub fn ratelimit_headers(plan: &[BucketSpec], outcome: &TakeOutcome) -> Vec<(String, String)> {
    let mut headers = Vec::with_capacity(6);
    for kind in [BucketKind::Requests, BucketKind::Tokens] {
        let tightest =
            plan.iter().zip(&outcome.states).filter(|(b, _)| b.kind == kind).min_by_key(|(_, s)| s.remaining);
        if let Some((bucket, state)) = tightest {
            let kind = kind.as_str();
            headers.push((format!("x-ratelimit-limit-{kind}"), bucket.rate_per_minute.to_string()));
            headers.push((format!("x-ratelimit-remaining-{kind}"), state.remaining.to_string()));
            headers.push((format!("x-ratelimit-reset-{kind}"), format_reset(state.reset_ms)));
        }
    }
    headers
}

/// `Retry-After` in whole seconds (at least 1), rounded up from milliseconds.
pub fn retry_after_secs(ms: u64) -> u64 {
    ms.div_ceil(1000).max(1)
}

/// Formats a duration in milliseconds the way OpenAI's reset headers do: `0s`, `0.25s`, `12s`,
/// `1m30s`, `2h0m0s` (minutes and hours whole, seconds with up to 3 decimals).
pub fn format_reset(ms: u64) -> String {
    let hours = ms / 3_600_000;
    let minutes = (ms / 60_000) % 60;
    let millis = ms % 60_000;
    let seconds = if millis.is_multiple_of(1000) {
        format!("{}s", millis / 1000)
    } else {
        let s = format!("{:.3}", millis as f64 / 1000.0);
        format!("{}s", s.trim_end_matches('0').trim_end_matches('.'))
    };
    match (hours, minutes) {
        (0, 0) => seconds,
        (0, m) => format!("{m}m{seconds}"),
        (h, m) => format!("{h}h{m}m{seconds}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::tenants::Limits;

    fn limits(rpm: Option<u64>, tpm: Option<u64>) -> Limits {
        Limits { requests_per_minute: rpm, request_burst: None, tokens_per_minute: tpm, token_burst: None }
    }

    fn tenant(id: &str, l: Limits) -> TenantConfig {
        TenantConfig {
            id: id.into(),
            limits: l,
            model_limits: Default::default(),
            quota: Default::default(),
            model_quotas: Default::default(),
            api_keys: Vec::new(),
        }
    }

    fn plan(prefix: &str, id: &str, l: &Limits, reserve: u64) -> Vec<BucketSpec> {
        super::plan(prefix, &tenant(id, *l), "m", reserve)
    }

    #[test]
    fn model_limits_add_buckets_in_the_same_slot() {
        let mut t = tenant("acme", limits(Some(60), None));
        t.model_limits.insert("big".into(), limits(Some(5), Some(100)));
        let p = super::plan("p", &t, "big", 300);
        let keys: Vec<_> = p.iter().map(|b| b.key.as_str()).collect();
        assert_eq!(keys, ["p:rl:{acme}:rpm", "p:rl:{acme}:m:big:rpm", "p:rl:{acme}:m:big:tpm"]);
        assert_eq!(p[2].cost, 100, "capped at the model bucket's burst");
        assert_eq!(super::plan("p", &t, "small", 1).len(), 1);
        assert_eq!(token_buckets("p", &t, "big").len(), 1);
    }

    #[test]
    fn a_key_with_limits_adds_its_buckets_on_top_of_the_tenant() {
        use crate::config::tenants::ApiKeyLimits;
        let mut t = tenant("acme", limits(Some(60), Some(1000)));
        t.api_keys.push(ApiKeyLimits { name: "ci".into(), limits: limits(Some(2), Some(50)) });
        let p = plan_for_key("p", &t, "m", Some("ci"), 300);
        let keys: Vec<_> = p.iter().map(|b| b.key.as_str()).collect();
        assert_eq!(
            keys,
            ["p:rl:{acme}:rpm", "p:rl:{acme}:tpm", "p:rl:{acme}:k:ci:rpm", "p:rl:{acme}:k:ci:tpm"]
        );
        assert_eq!((p[2].capacity, p[3].cost), (2, 50), "capped at the key bucket's burst");
        // Another key of the tenant, or none, draws on the tenant's buckets alone.
        assert_eq!(plan_for_key("p", &t, "m", Some("other"), 300).len(), 2);
        assert_eq!(plan_for_key("p", &t, "m", None, 300), super::plan("p", &t, "m", 300));
        let settled: Vec<_> =
            token_buckets_for_key("p", &t, "m", Some("ci")).into_iter().map(|b| b.key).collect();
        assert_eq!(settled, ["p:rl:{acme}:tpm", "p:rl:{acme}:k:ci:tpm"]);
    }

    #[test]
    fn headers_report_the_tightest_bucket_of_a_kind() {
        let mut t = tenant("acme", limits(Some(60), None));
        t.model_limits.insert("big".into(), limits(Some(5), None));
        let p = super::plan("p", &t, "big", 0);
        let (o, _) = TakeOutcome::from_reply(&[1, 0, 59, 1000, 0, 0, 4, 12000, 0, 0], 2).unwrap();
        let h = ratelimit_headers(&p, &o);
        assert!(h.contains(&("x-ratelimit-limit-requests".into(), "5".into())));
        assert!(h.contains(&("x-ratelimit-remaining-requests".into(), "4".into())));
        assert_eq!(h.len(), 3);
    }

    #[test]
    fn plan_has_one_bucket_per_configured_limit() {
        assert!(plan("p", "t", &limits(None, None), 10).is_empty());
        let p = plan("p", "acme", &limits(Some(60), Some(1000)), 300);
        assert_eq!(p.len(), 2);
        assert_eq!(p[0].key, "p:rl:{acme}:rpm");
        assert_eq!((p[0].capacity, p[0].cost), (60, 1));
        assert_eq!(p[1].key, "p:rl:{acme}:tpm");
        assert_eq!(p[1].cost, 300);
    }

    #[test]
    fn reservation_is_capped_at_the_burst() {
        let mut l = limits(None, Some(1000));
        l.token_burst = Some(1500);
        let p = plan("p", "t", &l, 5000);
        assert_eq!((p[0].capacity, p[0].cost), (1500, 1500));
    }

    #[test]
    fn reads_an_admitted_reply() {
        let (o, granted) = TakeOutcome::from_reply(&[1, 0, 59, 1000, 0, 0, 700, 18000, 0, 40], 2).unwrap();
        assert_eq!(o.denied, None);
        assert_eq!(granted, [0, 40]);
        assert_eq!(o.states[0], BucketState { remaining: 59, reset_ms: 1000, retry_after_ms: Some(0) });
        assert_eq!(o.states[1].remaining, 700);
    }

    #[test]
    fn reads_a_denied_reply() {
        let (o, _) = TakeOutcome::from_reply(&[0, 2, 3, 0, 0, 0, 10, 5000, 1500, 0], 2).unwrap();
        assert_eq!(o.denied, Some(1));
        assert_eq!(o.states[1].retry_after_ms, Some(1500));
        let (never, _) = TakeOutcome::from_reply(&[0, 1, 0, 0, -1, 0], 1).unwrap();
        assert_eq!(never.states[0].retry_after_ms, None);
    }

    #[test]
    fn rejects_malformed_replies() {
        assert!(TakeOutcome::from_reply(&[1, 0, 1], 1).is_err());
        assert!(TakeOutcome::from_reply(&[0, 3, 0, 0, 0, 0], 1).is_err());
        assert!(TakeOutcome::from_reply(&[2, 0, 0, 0, 0, 0], 1).is_err());
    }

    #[test]
    fn headers_follow_openai_names() {
        let p = plan("p", "t", &limits(Some(60), Some(1000)), 10);
        let (o, _) = TakeOutcome::from_reply(&[1, 0, 59, 1000, 0, 0, 990, 600, 0, 0], 2).unwrap();
        let h = ratelimit_headers(&p, &o);
        let get = |n: &str| h.iter().find(|(k, _)| k == n).map(|(_, v)| v.as_str());
        assert_eq!(get("x-ratelimit-limit-requests"), Some("60"));
        assert_eq!(get("x-ratelimit-remaining-requests"), Some("59"));
        assert_eq!(get("x-ratelimit-reset-requests"), Some("1s"));
        assert_eq!(get("x-ratelimit-limit-tokens"), Some("1000"));
        assert_eq!(get("x-ratelimit-remaining-tokens"), Some("990"));
        assert_eq!(get("x-ratelimit-reset-tokens"), Some("0.6s"));
    }

    #[test]
    fn reset_format() {
        assert_eq!(format_reset(0), "0s");
        assert_eq!(format_reset(250), "0.25s");
        assert_eq!(format_reset(12_000), "12s");
        assert_eq!(format_reset(90_000), "1m30s");
        assert_eq!(format_reset(7_200_000), "2h0m0s");
    }

    #[test]
    fn retry_after_rounds_up_to_whole_seconds() {
        assert_eq!(retry_after_secs(0), 1);
        assert_eq!(retry_after_secs(1), 1);
        assert_eq!(retry_after_secs(1000), 1);
        assert_eq!(retry_after_secs(1001), 2);
    }
}
