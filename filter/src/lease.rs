//! Admission leases, with no I/O and an injected clock (microseconds): the filter admits a
//! tenant's requests itself, without the ext_proc admission round trip, from requests and tokens
//! the sidecar took ahead from the tenant's Redis buckets (`proto/llm_gateway/v1/lease.proto`).
//!
//! Each Envoy worker's VM holds one [`Leases`] table in its root context. A routed request asks
//! [`Leases::try_admit`]: when the (tenant, model, pool) lease is live and covers one request and
//! the request's reservation (prompt + max tokens, as the sidecar would reserve it), both are
//! taken from the lease and the request goes on with `x-gateway-admission: lease` and
//! `x-gateway-reserved-tokens` (Envoy's matcher then skips the ext_proc admission; the access log
//! carries both headers to the sidecar, which settles the reservation against the real usage as
//! for any admitted request). Otherwise the request goes through the ext_proc admission, which
//! decides it exactly, and the key is marked as wanted.
//!
//! The root context's tick calls [`Leases::due`] for the calls to make: a lease for a wanted key,
//! a renewal of a lease that is running low or about to expire while in use, and the give-back of
//! an expired lease's unused part. Each call gives the previous lease's rest back (it stops
//! admitting at once) and reports the requests admitted since the last call (for the pool's
//! in-flight count).
//! Leased tokens are gone from Redis, so leases never over-admit. Each lease has an id (the
//! grant's `lease_id`), copied into the facts of every request it admits and sent back with its
//! give-back: a lease lost with its VM (or with a failed call) stays open in Redis, and the
//! sidecar reclaims it half a TTL after its expiry.
//!
//! A held lease numbers its admissions (1, 2, ...: the facts' `lease_seq`), and each tick in
//! which it admitted any sends a report ([`LeaseCall::report`]: the count and the tokens they
//! reserved, cumulative; the lease keeps admitting meanwhile), which also carries the requests
//! admitted since the last call, so that the pool's in-flight count lags a leased tenant by one
//! tick, not one lease. A reclaim keeps the reported requests' reservations charged (in the
//! buckets), so that a request in flight when Envoy was killed stays charged, as an exact
//! admission whose usage never arrives does; only the admissions of the last tick before the
//! kill (at most `refresh_ms` of them, unreported) are not. The report is not an acknowledgement of
//! the in-flight count: a failed report loses it, as a failed lease call does.
//!
//! `x-ratelimit-remaining-*` of a leased admission is Redis's remaining at the grant plus what the
//! lease still holds: approximate, like every leased admission.

use std::collections::HashMap;

use crate::proto::{LeaseGrant, LeaseRequest, LimitState};

/// How long a key whose call failed waits before the next call, in microseconds.
pub const FAILURE_BACKOFF_US: u64 = 1_000_000;

/// The facts of a routed request that a lease may admit (from the filter's own decisions).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdmissionFacts {
    /// Tenant id (`x-gateway-tenant`).
    pub tenant: String,
    /// Tenant tier (`x-gateway-tier`).
    pub tier: String,
    /// Public model name or LoRA adapter (`x-gateway-model`): the sidecar plans buckets by it.
    pub model: String,
    /// Envoy cluster of the pool (`x-gateway-pool`).
    pub pool: String,
    /// Tokens the sidecar would reserve: prompt estimate + effective max tokens.
    pub reserve_tokens: u64,
    /// The prompt estimate within `reserve_tokens` (`x-gateway-prompt-tokens`): a reclaimed
    /// lease charges the reported requests whose usage never arrived this much as prompt tokens.
    pub prompt_tokens: u64,
}

/// A request admitted from a lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseAdmission {
    /// Tokens reserved from the lease (`x-gateway-reserved-tokens`).
    pub reserved_tokens: u64,
    /// The grant's `lease_id` (empty: the lease has none), for the request's facts.
    pub lease_id: String,
    /// The request's number among the lease's admissions, from 1 (the facts' `lease_seq`).
    pub lease_seq: u64,
    /// OpenAI's `x-ratelimit-*` response headers, for the kinds the tenant is limited in.
    pub response_headers: Vec<(&'static str, String)>,
}

/// One kind of a lease: what it still holds (`None`: the tenant is unlimited in this kind).
#[derive(Debug, Clone, Default)]
struct Part {
    left: Option<u64>,
    granted: u64,
    state: Option<LimitState>,
}

impl Part {
    fn from_grant(unlimited: bool, granted: u64, state: Option<LimitState>) -> Self {
        if unlimited {
            Part { left: None, granted: 0, state: None }
        } else {
            Part { left: Some(granted), granted, state }
        }
    }

    fn covers(&self, cost: u64) -> bool {
        self.left.is_none_or(|left| left >= cost)
    }

    fn low(&self) -> bool {
        self.left.is_some_and(|left| left.saturating_mul(2) < self.granted)
    }

    /// Gives the rest back: returns it and holds nothing more.
    fn take_rest(&mut self) -> u64 {
        let rest = self.left.unwrap_or(0);
        if self.left.is_some() {
            self.left = Some(0);
        }
        rest
    }

    fn headers(&self, kind: Kind, out: &mut Vec<(&'static str, String)>) {
        let (Some(left), Some(state)) = (self.left, self.state.as_ref()) else { return };
        let (limit, remaining, reset) = match kind {
            Kind::Requests => {
                ("x-ratelimit-limit-requests", "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests")
            }
            Kind::Tokens => {
                ("x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens")
            }
        };
        out.push((limit, state.limit.to_string()));
        out.push((remaining, state.remaining.saturating_add(left).to_string()));
        out.push((reset, state.reset.clone()));
    }
}

impl Entry {
    /// A report on the held lease, when it is live, has an id and admitted since the last
    /// acknowledged report, and no report is in flight or backing off.
    fn report(&mut self, key: &LeaseKey, now_us: u64) -> Option<(LeaseCall, LeaseRequest)> {
        let due = self.held
            && now_us < self.expires_us
            && !self.lease_id.is_empty()
            && self.seq > self.reported
            && self.reporting.is_none()
            && now_us >= self.report_not_before_us;
        if !due {
            return None;
        }
        self.reporting = Some((self.lease_id.clone(), self.seq));
        let request = LeaseRequest {
            tenant: key.0.clone(),
            model: key.1.clone(),
            pool: key.2.clone(),
            tier: self.tier.clone(),
            report_lease_id: self.lease_id.clone(),
            report_admitted: self.seq,
            report_reserved_tokens: self.reserved,
            report_prompt_tokens: self.prompt,
            admitted: std::mem::take(&mut self.admitted),
            ..Default::default()
        };
        Some((LeaseCall { key: key.clone(), report: true }, request))
    }
}

#[derive(Debug, Clone, Copy)]
enum Kind {
    Requests,
    Tokens,
}

#[derive(Debug, Clone, Default)]
struct Entry {
    tier: String,
    /// A live lease is held (granted, not yet given back).
    held: bool,
    /// The held lease's `lease_id`.
    lease_id: String,
    expires_us: u64,
    requests: Part,
    tokens: Part,
    /// Requests admitted from the lease since the last call (a report included), for the pool's
    /// in-flight count.
    admitted: u64,
    /// The lease admitted since the last lease call (reports aside): renew it before it expires.
    in_use: bool,
    /// Requests admitted from the held lease since its grant (the last one's `lease_seq`), and
    /// the tokens they reserved, and the prompt estimates within those.
    seq: u64,
    reserved: u64,
    prompt: u64,
    /// The `seq` the sidecar acknowledged in a report on the held lease.
    reported: u64,
    /// A report in flight: the lease and the `seq` it reports.
    reporting: Option<(String, u64)>,
    /// No report before this time (a failed report's back-off).
    report_not_before_us: u64,
    /// Largest reservation asked of this key since the last call.
    max_request_tokens: u64,
    /// A request found no lease (or the lease runs low): ask for one.
    wanted: bool,
    /// A call for this key is in flight.
    calling: bool,
    /// No call before this time (the sidecar's `retry_after_ms`, or a failure's back-off).
    not_before_us: u64,
}

/// The key of a lease: (tenant, model, pool).
pub type LeaseKey = (String, String, String);

/// One call [`Leases::due`] asks for, handed back with its answer.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct LeaseCall {
    /// The lease's key.
    pub key: LeaseKey,
    /// A report on a held lease (its `report_*` fields) rather than a call that gives it back
    /// and asks for the next one.
    pub report: bool,
}

/// The leases of one filter VM.
#[derive(Debug, Default)]
pub struct Leases {
    entries: HashMap<LeaseKey, Entry>,
    /// Tenants whose own requests-per-minute bucket the sidecar said is empty, and until when
    /// (microseconds): their requests are refused at their headers ([`Leases::tenant_over_rpm`]).
    over_rpm: HashMap<String, u64>,
}

impl Leases {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// Admits the request from its key's lease when the lease is live and covers one request and
    /// `facts.reserve_tokens` (taking both), else `None` (the ext_proc admission decides) and the
    /// key is marked as wanted for the next tick.
    pub fn try_admit(&mut self, facts: &AdmissionFacts, now_us: u64) -> Option<LeaseAdmission> {
        let key = (facts.tenant.clone(), facts.model.clone(), facts.pool.clone());
        let entry = self.entries.entry(key).or_default();
        entry.tier.clone_from(&facts.tier);
        entry.max_request_tokens = entry.max_request_tokens.max(facts.reserve_tokens);
        let live = entry.held && now_us < entry.expires_us;
        if !live || !entry.requests.covers(1) || !entry.tokens.covers(facts.reserve_tokens) {
            entry.wanted = true;
            return None;
        }
        if let Some(left) = entry.requests.left.as_mut() {
            *left -= 1;
        }
        if let Some(left) = entry.tokens.left.as_mut() {
            *left -= facts.reserve_tokens;
        }
        entry.admitted += 1;
        entry.in_use = true;
        entry.seq += 1;
        entry.reserved = entry.reserved.saturating_add(facts.reserve_tokens);
        entry.prompt = entry.prompt.saturating_add(facts.prompt_tokens.min(facts.reserve_tokens));
        if entry.requests.low() || entry.tokens.low() {
            entry.wanted = true;
        }
        let mut response_headers = Vec::with_capacity(6);
        entry.requests.headers(Kind::Requests, &mut response_headers);
        entry.tokens.headers(Kind::Tokens, &mut response_headers);
        Some(LeaseAdmission {
            reserved_tokens: facts.reserve_tokens,
            lease_id: entry.lease_id.clone(),
            lease_seq: entry.seq,
            response_headers,
        })
    }

    /// The lease calls to make now: a lease for a wanted key, the renewal of a lease in use that
    /// expires within `horizon_us`, the give-back of an expired lease (and of what the previous
    /// lease left, in every call), each of which stops the key's lease admitting until the answer
    /// ([`Leases::on_grant`] / [`Leases::on_failure`]); and a report on each other live lease with
    /// an id that admitted since its last acknowledged report, which does not.
    pub fn due(&mut self, now_us: u64, horizon_us: u64) -> Vec<(LeaseCall, LeaseRequest)> {
        let mut calls = Vec::new();
        for (key, e) in &mut self.entries {
            if e.calling {
                continue;
            }
            if now_us < e.not_before_us {
                if let Some(report) = e.report(key, now_us) {
                    calls.push(report);
                }
                continue;
            }
            let expired = e.held && now_us >= e.expires_us;
            let renew = e.held && e.in_use && e.expires_us <= now_us.saturating_add(horizon_us);
            if !(e.wanted || expired || renew) {
                if let Some(report) = e.report(key, now_us) {
                    calls.push(report);
                }
                continue;
            }
            let want = e.wanted || renew;
            let request = LeaseRequest {
                tenant: key.0.clone(),
                model: key.1.clone(),
                pool: key.2.clone(),
                tier: e.tier.clone(),
                request_tokens: e.max_request_tokens,
                returned_requests: e.requests.take_rest(),
                returned_tokens: e.tokens.take_rest(),
                admitted: std::mem::take(&mut e.admitted),
                want,
                returned_lease_id: if e.held { std::mem::take(&mut e.lease_id) } else { String::new() },
                ..Default::default()
            };
            e.held = false;
            e.wanted = false;
            e.in_use = false;
            e.calling = true;
            if want {
                e.max_request_tokens = 0;
            }
            calls.push((LeaseCall { key: key.clone(), report: false }, request));
        }
        calls
    }

    /// The sidecar's answer to `call`: to a report, its acknowledgement (`grant` is empty); to a
    /// lease call, a new lease, or none (then no call before its `retry_after_ms`). An idle key
    /// that holds nothing and need not wait is forgotten.
    pub fn on_grant(&mut self, call: &LeaseCall, grant: &LeaseGrant, now_us: u64) {
        let key = &call.key;
        let Some(e) = self.entries.get_mut(key) else { return };
        if call.report {
            if let Some((lease_id, seq)) = e.reporting.take() {
                if lease_id == e.lease_id {
                    e.reported = e.reported.max(seq);
                }
            }
            return;
        }
        e.calling = false;
        let granted = (grant.requests_unlimited || grant.requests > 0)
            && (grant.tokens_unlimited || grant.tokens > 0)
            && grant.ttl_ms > 0;
        if granted {
            e.held = true;
            e.lease_id.clone_from(&grant.lease_id);
            e.expires_us = now_us.saturating_add(grant.ttl_ms.saturating_mul(1000));
            e.requests =
                Part::from_grant(grant.requests_unlimited, grant.requests, grant.requests_state.clone());
            e.tokens = Part::from_grant(grant.tokens_unlimited, grant.tokens, grant.tokens_state.clone());
            (e.seq, e.reserved, e.prompt, e.reported) = (0, 0, 0, 0);
        } else {
            e.not_before_us = now_us.saturating_add(grant.retry_after_ms.saturating_mul(1000));
            if !e.wanted && e.admitted == 0 && grant.retry_after_ms == 0 {
                self.entries.remove(key);
            }
            if grant.tenant_requests_retry_ms > 0 {
                let until = now_us.saturating_add(grant.tenant_requests_retry_ms.saturating_mul(1000));
                self.over_rpm.insert(key.0.clone(), until);
            }
        }
    }

    /// Whether `tenant`'s own requests-per-minute bucket is empty at `now_us`, as the sidecar
    /// said when it refused a lease (`LeaseGrant.tenant_requests_retry_ms`): the whole seconds to
    /// wait (the `Retry-After`, at least 1), else `None`. The filter then refuses the request at
    /// its headers, before its body costs a parse: a tenant over its limit cannot make the worker
    /// read what the sidecar would refuse. One map lookup (empty unless a tenant is over).
    pub fn tenant_over_rpm(&mut self, tenant: &str, now_us: u64) -> Option<u64> {
        let until = *self.over_rpm.get(tenant)?;
        if now_us >= until {
            self.over_rpm.remove(tenant);
            return None;
        }
        Some((until - now_us).div_ceil(1_000_000).max(1))
    }

    /// `call` failed (sidecar away, timeout). A lease call: what it reported is lost, and what it
    /// gave back, if the call did not land, is reclaimed by the sidecar once the lease is
    /// orphaned (its id is open in Redis); no call for [`FAILURE_BACKOFF_US`]. A report: the
    /// next one, after [`FAILURE_BACKOFF_US`], reports its admissions again (reports are
    /// cumulative).
    pub fn on_failure(&mut self, call: &LeaseCall, now_us: u64) {
        if let Some(e) = self.entries.get_mut(&call.key) {
            if call.report {
                e.reporting = None;
                e.report_not_before_us = now_us.saturating_add(FAILURE_BACKOFF_US);
            } else {
                e.calling = false;
                e.not_before_us = now_us.saturating_add(FAILURE_BACKOFF_US);
            }
        }
    }

    /// Keys in the table (for tests).
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether the table is empty.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts(tokens: u64) -> AdmissionFacts {
        AdmissionFacts {
            tenant: "acme".into(),
            tier: "standard".into(),
            model: "qwen".into(),
            pool: "pool_a".into(),
            reserve_tokens: tokens,
            prompt_tokens: tokens / 2,
        }
    }

    fn key() -> LeaseKey {
        ("acme".into(), "qwen".into(), "pool_a".into())
    }

    fn call() -> LeaseCall {
        LeaseCall { key: key(), report: false }
    }

    fn report_of(key: LeaseKey) -> LeaseCall {
        LeaseCall { key, report: true }
    }

    fn grant(requests: u64, tokens: u64) -> LeaseGrant {
        LeaseGrant {
            requests,
            tokens,
            ttl_ms: 1000,
            requests_state: Some(LimitState { limit: 600, remaining: 500, reset: "10s".into() }),
            tokens_state: Some(LimitState { limit: 60_000, remaining: 50_000, reset: "10s".into() }),
            lease_id: "lease-1".into(),
            ..Default::default()
        }
    }

    /// A table holding `grant` for [`key`], granted at time 0 after one miss.
    fn holding(grant: LeaseGrant) -> Leases {
        let mut l = Leases::new();
        assert_eq!(l.try_admit(&facts(10), 0), None);
        assert_eq!(l.due(0, 0).len(), 1);
        l.on_grant(&call(), &grant, 0);
        l
    }

    fn header<'a>(a: &'a LeaseAdmission, name: &str) -> Option<&'a str> {
        a.response_headers.iter().find(|(k, _)| *k == name).map(|(_, v)| v.as_str())
    }

    #[test]
    fn a_miss_asks_and_a_grant_admits_until_used_up() {
        let mut l = Leases::new();
        assert_eq!(l.try_admit(&facts(100), 0), None, "nothing held yet");
        let calls = l.due(0, 0);
        assert_eq!(calls.len(), 1);
        let (k, req) = &calls[0];
        assert_eq!(k, &call());
        assert!(req.want);
        assert_eq!((req.request_tokens, req.returned_requests, req.returned_tokens), (100, 0, 0));
        assert!(l.due(0, 0).is_empty(), "one call at a time");
        l.on_grant(&call(), &grant(3, 250), 10);
        let a = l.try_admit(&facts(100), 20).unwrap();
        assert_eq!(a.reserved_tokens, 100);
        assert_eq!(header(&a, "x-ratelimit-remaining-requests"), Some("502"));
        assert_eq!(header(&a, "x-ratelimit-remaining-tokens"), Some("50150"));
        assert_eq!(header(&a, "x-ratelimit-limit-tokens"), Some("60000"));
        assert_eq!(header(&a, "x-ratelimit-reset-requests"), Some("10s"));
        assert!(l.try_admit(&facts(100), 30).is_some());
        assert_eq!(l.try_admit(&facts(100), 40), None, "50 tokens left cannot cover 100");
        let calls = l.due(50, 0);
        let (_, req) = &calls[0];
        assert_eq!((req.returned_requests, req.returned_tokens, req.admitted), (1, 50, 2));
        assert_eq!(l.try_admit(&facts(1), 60), None, "given back: no admission while the call is out");
    }

    #[test]
    fn a_lease_id_names_each_admission_and_its_give_back_once() {
        let mut l = holding(grant(10, 1000));
        assert_eq!(l.try_admit(&facts(10), 1).unwrap().lease_id, "lease-1");
        assert_eq!(l.try_admit(&facts(2_000), 2), None, "not covered: a renewal is wanted");
        let (_, req) = l.due(3, 0).remove(0);
        assert_eq!(req.returned_lease_id, "lease-1");
        l.on_grant(&call(), &LeaseGrant { lease_id: "lease-2".into(), ..grant(10, 5_000) }, 4);
        assert_eq!(l.try_admit(&facts(2_000), 5).unwrap().lease_id, "lease-2");
        // The call fails: the lease it gave back is not given back again (the sidecar reclaims it).
        let (_, req) = l.due(2_000_000, 0).remove(0);
        assert_eq!(req.returned_lease_id, "lease-2");
        l.on_failure(&call(), 2_000_000);
        let (_, req) = l.due(3_000_001, 0).into_iter().next().unwrap_or_default();
        assert_eq!(req.returned_lease_id, "", "nothing held: nothing named");
    }

    #[test]
    fn an_expired_lease_stops_admitting_and_is_given_back() {
        let mut l = holding(grant(10, 1000));
        assert!(l.try_admit(&facts(10), 999_999).is_some());
        assert_eq!(l.try_admit(&facts(10), 1_000_000), None, "expired");
        // The miss wants a new lease; the call gives the old one's rest back with it.
        let (_, req) = l.due(1_000_000, 0).remove(0);
        assert_eq!((req.returned_requests, req.returned_tokens, req.admitted, req.want), (9, 990, 1, true));
    }

    #[test]
    fn an_unused_expired_lease_is_only_given_back_and_the_key_forgotten() {
        let mut l = holding(grant(10, 1000));
        assert!(l.due(500_000, 0).is_empty(), "live and unused: nothing to do");
        let (_, req) = l.due(1_000_000, 0).remove(0);
        assert!(!req.want);
        assert_eq!((req.returned_requests, req.returned_tokens), (10, 1000));
        l.on_grant(&call(), &LeaseGrant::default(), 1_000_100);
        assert!(l.is_empty());
    }

    #[test]
    fn a_lease_in_use_is_renewed_before_it_expires_or_runs_low() {
        let mut l = holding(grant(100, 10_000));
        assert!(l.try_admit(&facts(10), 100).is_some());
        let calls = l.due(700_000, 200_000);
        assert_eq!(calls.len(), 1);
        assert!(calls[0].0.report, "300 ms left, more than the horizon: only its report");
        l.on_grant(&calls[0].0, &LeaseGrant::default(), 700_100);
        let calls = l.due(800_000, 200_000);
        assert_eq!(calls.len(), 1, "expires within the horizon while in use");
        assert!(calls[0].1.want);
        l.on_grant(&call(), &grant(4, 10_000), 800_100);
        assert!(l.try_admit(&facts(10), 800_200).is_some());
        assert!(l.try_admit(&facts(10), 800_300).is_some());
        assert!(l.try_admit(&facts(10), 800_400).is_some(), "1 of 4 left: low");
        assert!(l.due(800_500, 0)[0].1.want, "a low lease asks for more");
    }

    #[test]
    fn refusals_and_failures_wait_before_asking_again() {
        let mut l = holding(LeaseGrant { retry_after_ms: 5000, ..Default::default() });
        assert_eq!(l.try_admit(&facts(10), 1), None);
        assert!(l.due(4_999_999, 0).is_empty(), "refused: wait retry_after_ms");
        assert_eq!(l.due(5_000_000, 0).len(), 1);
        l.on_failure(&call(), 5_000_000);
        l.try_admit(&facts(10), 5_000_001);
        assert!(l.due(5_999_999, 0).is_empty(), "failed: back off");
        assert_eq!(l.due(6_000_000, 0).len(), 1);
    }

    /// A lease refused because the tenant's own RPM bucket is empty marks the tenant over its
    /// limit until the bucket holds a request again: its requests are refused at their headers
    /// (whole seconds, at least 1), other tenants are not, and the mark goes by itself.
    #[test]
    fn a_tenant_over_its_requests_limit_is_known_until_its_bucket_refills() {
        let mut l = holding(LeaseGrant {
            retry_after_ms: 100,
            tenant_requests_retry_ms: 2_500,
            ..Default::default()
        });
        assert_eq!(l.tenant_over_rpm("acme", 1_000), Some(3));
        assert_eq!(l.tenant_over_rpm("acme", 2_000_000), Some(1));
        assert_eq!(l.tenant_over_rpm("other", 1_000), None);
        assert_eq!(l.tenant_over_rpm("acme", 2_500_000), None, "refilled");
        assert!(l.over_rpm.is_empty(), "forgotten once past");
        // A refusal for another reason (the pool sheds, the tokens bucket) marks nothing.
        let mut l = holding(LeaseGrant { retry_after_ms: 100, ..Default::default() });
        assert_eq!(l.tenant_over_rpm("acme", 1), None);
    }

    #[test]
    fn unlimited_kinds_are_not_counted_and_report_no_headers() {
        let mut l = Leases::new();
        l.try_admit(&facts(10), 0);
        l.due(0, 0);
        let g = LeaseGrant { tokens_unlimited: true, tokens_state: None, ..grant(2, 0) };
        l.on_grant(&call(), &g, 0);
        let a = l.try_admit(&facts(1_000_000), 1).unwrap();
        assert_eq!(header(&a, "x-ratelimit-remaining-tokens"), None);
        assert_eq!(header(&a, "x-ratelimit-remaining-requests"), Some("501"));
        let (_, req) = l.due(2, 1_000_000).remove(0);
        assert_eq!((req.returned_requests, req.returned_tokens), (1, 0), "renewed, its rest back");
    }

    #[test]
    fn keys_do_not_share_leases() {
        let mut l = holding(grant(10, 1000));
        let other = AdmissionFacts { pool: "pool_b".into(), ..facts(10) };
        assert_eq!(l.try_admit(&other, 1), None);
        assert_eq!(l.len(), 2);
    }

    #[test]
    fn a_held_lease_reports_its_admissions_each_tick_and_keeps_admitting() {
        let mut l = holding(grant(100, 10_000));
        assert!(l.due(1, 0).is_empty(), "nothing admitted: nothing to report");
        assert_eq!(l.try_admit(&facts(10), 2).unwrap().lease_seq, 1);
        assert_eq!(l.try_admit(&facts(30), 3).unwrap().lease_seq, 2);
        let mut calls = l.due(4, 0);
        assert_eq!(calls.len(), 1);
        let (c, req) = calls.remove(0);
        assert_eq!(c, report_of(key()));
        assert_eq!(
            (
                req.report_lease_id.as_str(),
                req.report_admitted,
                req.report_reserved_tokens,
                req.report_prompt_tokens,
                req.want
            ),
            ("lease-1", 2, 40, 20, false)
        );
        assert_eq!((req.returned_lease_id.as_str(), req.returned_requests, req.returned_tokens), ("", 0, 0));
        assert_eq!(req.admitted, 2, "the pool's in-flight count goes with every call");
        // The lease admits while its report is out; one report at a time.
        assert_eq!(l.try_admit(&facts(5), 5).unwrap().lease_seq, 3);
        assert!(l.due(6, 0).is_empty());
        l.on_grant(&c, &LeaseGrant::default(), 7);
        let (_, req) = l.due(8, 0).remove(0);
        assert_eq!(
            (req.report_admitted, req.report_reserved_tokens, req.report_prompt_tokens),
            (3, 45, 22),
            "cumulative"
        );
        assert_eq!(req.admitted, 1, "admitted since the last call");
        l.on_grant(&report_of(key()), &LeaseGrant::default(), 9);
        assert!(l.due(10, 0).is_empty(), "all acknowledged");
        assert!(l.try_admit(&facts(5), 11).is_some(), "an acknowledgement leaves the lease as it was");
    }

    #[test]
    fn a_failed_report_backs_off_and_reports_again() {
        let mut l = holding(LeaseGrant { ttl_ms: 60_000, ..grant(100, 10_000) });
        l.try_admit(&facts(10), 1);
        let (c, _) = l.due(2, 0).remove(0);
        l.on_failure(&c, 2);
        assert!(l.try_admit(&facts(10), 3).is_some(), "a report's failure stops nothing");
        assert!(l.due(FAILURE_BACKOFF_US + 1, 0).is_empty(), "backing off");
        let (c, req) = l.due(FAILURE_BACKOFF_US + 2, 0).remove(0);
        assert!(c.report);
        assert_eq!((req.report_admitted, req.report_reserved_tokens), (2, 20));
    }

    #[test]
    fn a_new_lease_numbers_its_admissions_from_one_and_a_late_acknowledgement_is_ignored() {
        let mut l = holding(grant(4, 10_000));
        l.try_admit(&facts(10), 1);
        let (report, _) = l.due(2, 0).remove(0);
        // Runs low: the renewal gives the lease back while the report is out.
        l.try_admit(&facts(10), 3);
        l.try_admit(&facts(10), 4);
        let (renewal, req) = l.due(5, 0).remove(0);
        assert!(!renewal.report && req.want);
        l.on_grant(&renewal, &LeaseGrant { lease_id: "lease-2".into(), ..grant(4, 10_000) }, 6);
        let a = l.try_admit(&facts(7), 7).unwrap();
        assert_eq!((a.lease_id.as_str(), a.lease_seq), ("lease-2", 1));
        l.on_grant(&report, &LeaseGrant::default(), 8);
        let (c, req) = l.due(9, 0).remove(0);
        assert!(c.report);
        assert_eq!(
            (req.report_lease_id.as_str(), req.report_admitted, req.report_reserved_tokens),
            ("lease-2", 1, 7)
        );
    }

    #[test]
    fn leases_without_an_id_or_expired_are_not_reported() {
        let mut l = holding(LeaseGrant { lease_id: String::new(), ..grant(100, 10_000) });
        l.try_admit(&facts(10), 1);
        assert!(l.due(2, 0).is_empty(), "no id: nothing in Redis to report on");
        let mut l = holding(grant(100, 10_000));
        l.try_admit(&facts(10), 1);
        let calls = l.due(1_000_000, 0);
        assert_eq!(calls.len(), 1);
        assert!(!calls[0].0.report, "expired: given back, not reported");
    }
}
