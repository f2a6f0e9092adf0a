//! Admission leases for the wasm filter, with no I/O: how large a lease of one (tenant, model)
//! is, what a returned lease gives back to each bucket, and the grant the filter reads
//! (`proto/llm_gateway/v1/lease.proto`). The tonic adapter is [`crate::grpc::lease_service`].
//!
//! A lease is `redis.lease_fraction` of the smallest capacity among the request plan's buckets of
//! each kind, taken from every bucket of that kind: the filter then admits one request per leased
//! request and its reservation (prompt + max tokens) from the leased tokens, exactly as the
//! ext_proc admission would have taken them. The take is all-or-nothing (`token_bucket_take_v3`
//! with the lease as the cost): a tenant near its limit gets no lease, and each of its requests is
//! decided against Redis by the ext_proc admission. A lease is granted only when it covers at
//! least two requests of the largest reservation the filter saw.
//!
//! **Orphaned leases** (issue 14 item 4). A lease taken from Redis has an id and is recorded open
//! in the same take ([`LeaseRecord`] in `<prefix>:leases:{<tenant>}`, indexed by grant time). The
//! filter gives it back by id (`lua/ledger_v1.lua` `lease_return`, applied only while open), and
//! reports on each tick how many requests it admitted from a lease it holds (`lease_report`). A
//! lease still open [`reclaim_after`] its grant (its VM went away, or its give-back was lost) is
//! reclaimed by the sweeper of any replica (`lease_reclaim`): what it took, less the reservations
//! of its reported requests and of its finished ones, goes back; its requests admitted after the
//! last report and still in flight then pay their reservation again when their usage lands
//! ([`charges_if_reclaimed`]), so each costs its usage.
//!
//! A reported request whose usage has not landed when its lease is reclaimed is charged its
//! reservation as usage by the reclaim (the usage hash, the quota counters and one usage event
//! for the lease), as an exact admission's unreported reservation is charged; its usage, should
//! it land later, is not applied. A usage record numbered within a report Redis recorded needs
//! no reclaim charges in its lease section ([`ReportedLeases`]): the report counts the request.

use std::num::NonZeroUsize;
use std::sync::Mutex;
use std::time::Duration;

use lru::LruCache;

use serde::{Deserialize, Serialize};

use crate::admission::limits::{self, BucketKind, BucketSpec, TakeOutcome};
use crate::config::tenants::TenantConfig;
use crate::metering::meter::RequestInfo;
use crate::proto::{LeaseGrant, LimitState};

/// [`LeaseRecord::v`] of this sidecar.
pub const LEASE_RECORD_VERSION: u32 = 1;

/// An admission lease taken from Redis, as the ledger keeps it while open (JSON).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseRecord {
    /// [`LEASE_RECORD_VERSION`].
    pub v: u32,
    /// The model the buckets were planned for ([`limits::plan`]).
    pub model: String,
    /// Requests taken from every requests bucket (0: none applies).
    pub requests: u64,
    /// Tokens taken from every tokens bucket (0: none applies).
    pub tokens: u64,
}

impl LeaseRecord {
    /// The record of a lease of `size` for `model`.
    pub fn of(size: &LeaseSize, model: &str) -> Self {
        Self {
            v: LEASE_RECORD_VERSION,
            model: model.to_owned(),
            requests: size.requests,
            tokens: size.tokens,
        }
    }

    /// Its JSON.
    pub fn to_json(&self) -> String {
        // A struct of numbers and strings always serializes.
        serde_json::to_string(self).unwrap_or_default()
    }

    /// Reads a lease record: `None` when unreadable or of another version.
    pub fn from_json(json: &[u8]) -> Option<Self> {
        let r: Self = serde_json::from_slice(json).ok()?;
        (r.v == LEASE_RECORD_VERSION).then_some(r)
    }
}

/// How long after its grant an open lease is reclaimed as orphaned: its TTL and half of it
/// again. A live filter gives its lease back at its expiry (its next tick); one whose give-back
/// arrives after the reclaim gives nothing back twice.
pub fn reclaim_after(ttl: Duration) -> Duration {
    ttl.saturating_add(ttl / 2)
}

/// What a leased request that reserved `reserved` tokens costs again should its lease have been
/// reclaimed before its usage landed (the reclaim gave its reservation back): 1 from each
/// requests bucket and `min(reserved, capacity)` from each tokens bucket of `plan`.
pub fn charges_if_reclaimed(plan: &[BucketSpec], reserved: u64) -> Vec<(BucketSpec, i64)> {
    plan.iter()
        .filter_map(|b| {
            let cost = match b.kind {
                BucketKind::Requests => 1,
                BucketKind::Tokens => reserved.min(b.capacity),
            };
            (cost > 0)
                .then(|| (BucketSpec { cost: 0, ..b.clone() }, -i64::try_from(cost).unwrap_or(i64::MAX)))
        })
        .collect()
}

/// A leased request's part in its lease's books, written with its usage record
/// (`lua/ledger_v1.lua`, the record's lease section).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseUse {
    /// The lease ([`gateway_contract::RequestFacts::lease_id`]).
    pub lease_id: String,
    /// Tokens the request reserved from the lease.
    pub reserved: u64,
    /// The prompt estimate within `reserved` (the facts' `prompt_tokens`).
    pub prompt: u64,
    /// The request's number among the lease's admissions
    /// ([`gateway_contract::RequestFacts::lease_seq`]; `None` from a filter that does not number
    /// them). Numbered within the filter's last report on the lease, its reservation stays
    /// charged at a reclaim; numbered after it (or not numbered), a reclaim gives it back and
    /// the request pays it again ([`LeaseUse::if_reclaimed`]).
    pub seq: Option<u64>,
    /// What the request costs again should the lease have been reclaimed before the filter
    /// reported it ([`charges_if_reclaimed`]); empty when a report Redis recorded numbers it.
    pub if_reclaimed: Vec<(BucketSpec, i64)>,
}

impl LeaseUse {
    /// The lease part of the record of a request of `model` that reserved `reserved` tokens
    /// (`prompt` of them its prompt estimate) from lease `lease_id` (`None`: not admitted from a
    /// lease with an id) as its admission number `seq`, with `plan` the request plan's buckets
    /// ([`limits::plan`]).
    pub fn of(
        lease_id: Option<&str>,
        seq: Option<u64>,
        plan: &[BucketSpec],
        reserved: u64,
        prompt: u64,
    ) -> Option<Self> {
        let lease_id = lease_id.filter(|id| !id.is_empty())?;
        Some(Self {
            lease_id: lease_id.to_owned(),
            reserved,
            prompt: prompt.min(reserved),
            seq,
            if_reclaimed: charges_if_reclaimed(plan, reserved),
        })
    }

    /// The lease part of a usage record of `tenant`: `None` when the request was not admitted
    /// from a lease with an id (most records); without reclaim charges, planning nothing, when
    /// `reported` knows that Redis recorded a report numbering it.
    pub fn of_record(
        prefix: &str,
        tenant: &TenantConfig,
        info: &RequestInfo,
        reported: &ReportedLeases,
    ) -> Option<Self> {
        let lease_id = info.lease_id.as_deref()?;
        if info.lease_seq.is_some_and(|seq| reported.covers(lease_id, seq)) {
            return Self::of(
                Some(lease_id),
                info.lease_seq,
                &[],
                info.reserved_tokens,
                info.prompt_tokens_estimate,
            );
        }
        let plan = limits::plan(prefix, tenant, &info.model, 0);
        Self::of(Some(lease_id), info.lease_seq, &plan, info.reserved_tokens, info.prompt_tokens_estimate)
    }
}

/// The reports on admission leases that Redis recorded, as this replica made them (lease id ->
/// the requests reported admitted: [`crate::store::Store::lease_report`] answered true), the
/// least recently reported forgotten past a bound.
///
/// Redis keeps a lease's reported count only growing, and a record numbered within it is never
/// charged again for its lease, whatever becomes of the lease: while it is open the report
/// counts the request (the record joins the lease's landed counts), a reclaim charged it (the
/// record is not applied), and a given-back lease has no books. Such a record's lease section
/// (`lua/ledger_v1.lua`) carries no reclaim charges, `3 × buckets` arguments and as many keys
/// fewer; a record this replica cannot place (reported through another replica, or forgotten)
/// carries them, to the same effect.
pub struct ReportedLeases {
    inner: Mutex<LruCache<String, u64>>,
}

impl ReportedLeases {
    /// Leases remembered at most: a few per Envoy worker and tenant are open at once.
    pub const CAPACITY: usize = 16_384;

    /// An empty table of at most [`ReportedLeases::CAPACITY`] leases.
    pub fn new() -> Self {
        let capacity = NonZeroUsize::new(Self::CAPACITY).unwrap_or(NonZeroUsize::MIN);
        Self { inner: Mutex::new(LruCache::new(capacity)) }
    }

    /// Redis recorded a report of `admitted` requests on `lease_id`.
    pub fn recorded(&self, lease_id: &str, admitted: u64) {
        let Ok(mut inner) = self.inner.lock() else { return };
        match inner.get_mut(lease_id) {
            Some(known) => *known = (*known).max(admitted),
            None => {
                inner.put(lease_id.to_owned(), admitted);
            }
        }
    }

    /// Whether a report Redis recorded numbers request `seq` of `lease_id`.
    pub fn covers(&self, lease_id: &str, seq: u64) -> bool {
        self.inner
            .lock()
            .ok()
            .and_then(|mut inner| inner.get(lease_id).copied())
            .is_some_and(|known| seq <= known)
    }
}

impl Default for ReportedLeases {
    fn default() -> Self {
        Self::new()
    }
}

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

/// `size` covering at most `most` requests (a load-protected pool's headroom,
/// [`crate::admission::lease_headroom`]): its requests, unlimited ones included, capped at `most`, and each
/// requests bucket of its plan taking that many. `None` when `most` is 0 (no lease). A lease of
/// one request is still worth its call: the call is made on the filter's tick, off the request's
/// path. A lease capped where no requests bucket applies takes nothing more from Redis: the
/// filter counts its requests down all the same.
pub fn cap_requests(mut size: LeaseSize, most: u64) -> Option<LeaseSize> {
    if most == 0 {
        return None;
    }
    if size.requests_unlimited || size.requests > most {
        size.requests = most;
        size.requests_unlimited = false;
        for bucket in size.plan.iter_mut().filter(|b| b.kind == BucketKind::Requests) {
            bucket.cost = most;
        }
    }
    Some(size)
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

/// The grant of a lease Redis admitted (`outcome` of taking `size.plan`), admitting for `ttl_ms`,
/// named `lease_id` (empty: nothing was taken). Each kind reports its tightest bucket's
/// `x-ratelimit-*` values at the grant.
pub fn grant(size: &LeaseSize, outcome: &TakeOutcome, ttl_ms: u64, lease_id: String) -> LeaseGrant {
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
        lease_id,
        tenant_requests_retry_ms: 0,
    }
}

/// No lease: the filter sends the requests of this key to the ext_proc admission, and asks again
/// after `retry_after_ms` at the earliest.
pub fn refusal(retry_after_ms: u64) -> LeaseGrant {
    LeaseGrant { retry_after_ms: retry_after_ms.max(1), ..Default::default() }
}

/// After a lease take the buckets refused (`outcome`, of `plan`): when the tenant's own
/// requests-per-minute bucket (key `tenant_rpm_key`: its `limits`, shared by all its models)
/// holds less than one request, the milliseconds until it holds one again, from its level
/// (`capacity - reset_ms * rate / 60000`), for `LeaseGrant.tenant_requests_retry_ms`; `None`
/// while it holds one (the lease was refused for its size, or for another bucket) or when it has
/// no refill.
pub fn tenant_requests_wait_ms(
    plan: &[BucketSpec],
    outcome: &TakeOutcome,
    tenant_rpm_key: &str,
) -> Option<u64> {
    let (spec, state) = plan
        .iter()
        .zip(&outcome.states)
        .find(|(spec, _)| spec.kind == BucketKind::Requests && spec.key == tenant_rpm_key)?;
    if state.remaining >= 1 || spec.rate_per_minute == 0 {
        return None;
    }
    let rate = spec.rate_per_minute as f64;
    let level = (spec.capacity as f64 - state.reset_ms as f64 * rate / 60_000.0).max(0.0);
    let wait_ms = ((1.0 - level).max(0.0) * 60_000.0 / rate).floor() as u64;
    (wait_ms > 0).then_some(wait_ms)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admission::limits::BucketState;
    use crate::config::tenants::{Limits, TenantConfig};

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
            api_keys: Vec::new(),
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

    /// A refused lease tells the filter how long the tenant's own RPM bucket stays empty: from
    /// its level, only while it holds less than one request, and never for a per-model bucket.
    #[test]
    fn an_empty_tenant_requests_bucket_is_told_with_its_wait() {
        let mut t = tenant(Some(60), Some(1_000_000));
        t.model_limits.insert(
            "m".into(),
            Limits {
                requests_per_minute: Some(6),
                request_burst: None,
                tokens_per_minute: None,
                token_burst: None,
            },
        );
        let plan = limits::plan("p", &t, "m", 300);
        let key = limits::bucket_key("p", "acme", limits::Scope::Tenant, BucketKind::Requests);
        // 60 a minute, burst 60: 0.25 of a request left is 59.75 from full, 59,750 ms to refill;
        // one request is 0.75 of a second away.
        let state = |remaining, reset_ms| BucketState { remaining, reset_ms, retry_after_ms: Some(1) };
        let outcome = |rpm: BucketState| TakeOutcome {
            denied: Some(0),
            states: vec![rpm, state(500_000, 100), state(0, 60_000)],
        };
        assert_eq!(tenant_requests_wait_ms(&plan, &outcome(state(0, 59_750)), &key), Some(750));
        // Empty: a whole second.
        assert_eq!(tenant_requests_wait_ms(&plan, &outcome(state(0, 60_000)), &key), Some(1000));
        // One request left: the lease was refused for its size only.
        assert_eq!(tenant_requests_wait_ms(&plan, &outcome(state(1, 59_000)), &key), None);
        // The per-model bucket is empty (states[2]), the tenant's is not: nothing to tell.
        assert_eq!(tenant_requests_wait_ms(&plan, &outcome(state(30, 30_000)), &key), None);
        // A tenant without an RPM limit.
        let plan = limits::plan("p", &tenant(None, Some(1_000_000)), "m", 300);
        let outcome = TakeOutcome { denied: Some(0), states: vec![state(0, 60_000)] };
        assert_eq!(tenant_requests_wait_ms(&plan, &outcome, &key), None);
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
    fn a_capped_lease_covers_at_most_the_headroom_unlimited_requests_included() {
        let plan = limits::plan("p", &tenant(Some(6000), Some(1_000_000)), "m", 300);
        let s = size(&plan, 0.01, 300).unwrap();
        let capped = cap_requests(s.clone(), 4).unwrap();
        assert_eq!((capped.requests, capped.tokens, capped.requests_unlimited), (4, 10_000, false));
        let costs: Vec<_> = capped.plan.iter().map(|b| b.cost).collect();
        assert_eq!(costs, [4, 10_000], "the requests bucket takes only the capped lease");
        assert_eq!(cap_requests(s.clone(), 1000), Some(s.clone()), "room for more: unchanged");
        assert_eq!(cap_requests(s.clone(), 1).map(|c| c.requests), Some(1), "one request still pays");
        assert_eq!(cap_requests(s, 0), None, "no headroom: no lease");
        let unlimited = size(&[], 0.01, 300).unwrap();
        let capped = cap_requests(unlimited, 3).unwrap();
        assert_eq!((capped.requests, capped.requests_unlimited, capped.tokens_unlimited), (3, false, true));
        assert!(capped.plan.is_empty(), "nothing more to take from Redis");
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
        let g = grant(&s, &outcome, 1000, "l1".into());
        assert_eq!((g.requests, g.tokens, g.ttl_ms), (60, 10_000, 1000));
        let r = g.requests_state.unwrap();
        assert_eq!((r.limit, r.remaining, r.reset.as_str()), (6000, 5900, "1s"));
        assert_eq!(g.tokens_state.unwrap().reset, "0.6s");
        assert_eq!(refusal(0).retry_after_ms, 1);
        assert_eq!(g.lease_id, "l1");
    }

    #[test]
    fn a_lease_record_round_trips_and_refuses_other_versions() {
        let plan = limits::plan("p", &tenant(Some(6000), Some(1_000_000)), "m", 300);
        let r = LeaseRecord::of(&size(&plan, 0.01, 300).unwrap(), "m");
        assert_eq!((r.requests, r.tokens), (60, 10_000));
        assert_eq!(LeaseRecord::from_json(r.to_json().as_bytes()), Some(r.clone()));
        let other = LeaseRecord { v: 2, ..r };
        assert_eq!(LeaseRecord::from_json(other.to_json().as_bytes()), None);
        assert_eq!(LeaseRecord::from_json(b"{"), None);
    }

    #[test]
    fn a_request_of_a_reclaimed_lease_pays_its_reservation_again_and_orphans_wait_half_a_ttl() {
        let plan = limits::plan("p", &tenant(Some(6000), Some(1_000)), "m", 300);
        let charges = charges_if_reclaimed(&plan, 5_000);
        let deltas: Vec<(BucketKind, i64)> = charges.iter().map(|(b, d)| (b.kind, *d)).collect();
        assert!(deltas.contains(&(BucketKind::Requests, -1)));
        assert!(deltas.contains(&(BucketKind::Tokens, -1_000)), "at most the capacity: {deltas:?}");
        assert!(charges.iter().all(|(b, _)| b.cost == 0));
        assert_eq!(reclaim_after(Duration::from_millis(1000)), Duration::from_millis(1500));
    }

    #[test]
    fn a_record_within_a_recorded_report_has_no_reclaim_charges() {
        let t = tenant(Some(6000), Some(1_000_000));
        let reported = ReportedLeases::new();
        let info = |seq: Option<u64>| RequestInfo {
            tenant: "acme".into(),
            model: "m".into(),
            reserved_tokens: 100,
            prompt_tokens_estimate: 30,
            lease_id: Some("L".into()),
            lease_seq: seq,
            ..Default::default()
        };
        let section = |seq| LeaseUse::of_record("llmgw", &t, &info(seq), &reported);
        assert_eq!(
            section(Some(3)).map(|l| (l.seq, l.if_reclaimed.len())),
            Some((Some(3), 2)),
            "nothing known"
        );
        reported.recorded("L", 3);
        reported.recorded("L", 2);
        reported.recorded("other", 9);
        assert_eq!(
            section(Some(3)).map(|l| (l.seq, l.reserved, l.prompt, l.if_reclaimed.len())),
            Some((Some(3), 100, 30, 0)),
            "3 is within the report of 3 (an older report of 2 lowers nothing)"
        );
        assert_eq!(section(Some(4)).and_then(|l| l.seq), Some(4), "past it");
        assert_eq!(section(None).map(|l| l.seq), Some(None), "not numbered: always sent");
        let no_lease = RequestInfo { lease_id: None, ..info(Some(1)) };
        assert_eq!(LeaseUse::of_record("llmgw", &t, &no_lease, &reported), None);
    }
}
