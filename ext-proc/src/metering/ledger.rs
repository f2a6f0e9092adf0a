//! The usage ledger's bookkeeping of each request, with no I/O (issue 14: idempotent by request,
//! nothing silently lost). The writes are `lua/ledger_v1.lua` and `lua/token_bucket_take_v3.lua`
//! through [`crate::store`]; the sweeper that charges forgotten reservations is
//! [`crate::metering::sweeper`].
//!
//! **Idempotent by request.** A usage record is named by its request
//! ([`gateway_contract::record_id`]: Envoy's `x-request-id` as the wasm filter saw it, and a random
//! nonce the filter draws for the request; both in the filter state, which clients cannot
//! write), so every delivery of one request's usage (a retry, a replay after a restart, a second
//! sink) carries the same id, and the ledger applies it, and settles its reservation, once.
//!
//! **Nothing silently lost.** An admission the sidecar decides in Redis records its reservation as
//! open in the same call ([`Reservation`], keyed by the record id, indexed by Redis's time). The
//! request's usage record closes it; so does a give-back before the request went upstream. A
//! reservation still open after the longest stream lifetime (`metering.reservations.
//! record_after_ms`) belongs to a request whose usage will never arrive (Envoy killed mid-stream,
//! its access-log entries lost): a sweeper on any replica claims it and records it as charged
//! ([`charged_record`]: `usage_source` reservation, end reason unreported), once: closing by a
//! record and charging exclude each other inside one script, and a usage record that arrives after
//! the charge is not applied (the reservation is the most the request could cost).
//!
//! Not tracked per request (no Redis call of their own to record them in): admissions from an
//! admission lease, the filter's or this sidecar's own (`redis.lease_fraction`), which took their
//! tokens per lease; and admissions decided in the sidecar's memory while Redis was away.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::admission::decision;
use crate::admission::limits::{BucketSpec, ReplyError};
use crate::admission::quota::{Period, QuotaSpec};
use crate::facts::RequestFacts;
use crate::metering::meter::{RequestInfo, Usage, UsageRecord};

/// Version of [`Reservation`]'s JSON.
pub const RESERVATION_VERSION: u32 = 1;

/// How long a claimed reservation is left to the replica that claimed it before another replica's
/// sweep may claim it again (its charge is written through the usage writer, which retries).
pub const CLAIM: Duration = Duration::from_secs(60);

/// How long the ledger remembers a charged reservation, so that the request's usage, should it
/// still arrive, is not applied on top of the charge.
pub const CHARGED_RETENTION: Duration = Duration::from_secs(86_400);

/// How long a tenant's reservation keys outlive `record_after_ms` past their last write (a
/// sweeper that was down that long finds nothing to charge: the keys are gone).
pub const KEEP_MARGIN: Duration = Duration::from_secs(86_400);

/// The hash of a tenant's open reservations: `<prefix>:reservations:{<tenant>}` (record id ->
/// [`Reservation`] JSON).
pub fn reservations_key(prefix: &str, tenant: &str) -> String {
    format!("{prefix}:reservations:{{{tenant}}}")
}

/// The index of a tenant's open reservations by admission time (ms, Redis's clock; a claim moves
/// it on by [`CLAIM`]): `<prefix>:reservations-due:{<tenant>}`.
pub fn due_key(prefix: &str, tenant: &str) -> String {
    format!("{prefix}:reservations-due:{{{tenant}}}")
}

/// The reservations charged in the last [`CHARGED_RETENTION`]:
/// `<prefix>:reservations-charged:{<tenant>}` (record id -> when, ms).
pub fn charged_key(prefix: &str, tenant: &str) -> String {
    format!("{prefix}:reservations-charged:{{{tenant}}}")
}

/// The hash of a tenant's open admission leases: `<prefix>:leases:{<tenant>}` (lease id ->
/// [`crate::admission::admission_lease::LeaseRecord`] JSON), written by the lease's take.
pub fn leases_key(prefix: &str, tenant: &str) -> String {
    format!("{prefix}:leases:{{{tenant}}}")
}

/// The index of a tenant's open admission leases by grant time (ms, Redis's clock; a claim moves
/// it on by [`CLAIM`]): `<prefix>:leases-due:{<tenant>}`.
pub fn lease_due_key(prefix: &str, tenant: &str) -> String {
    format!("{prefix}:leases-due:{{{tenant}}}")
}

/// What the requests of a tenant's open leases used, by the usage records that landed:
/// `<prefix>:leases-used:{<tenant>}` (`<lease id>:r` requests, `<lease id>:t` reserved tokens).
pub fn lease_used_key(prefix: &str, tenant: &str) -> String {
    format!("{prefix}:leases-used:{{{tenant}}}")
}

/// The leases reclaimed as orphaned and not yet charged (`lua/ledger_v1.lua` `lease_charge`):
/// `<prefix>:leases-reclaimed:{<tenant>}` (lease id -> when, ms).
pub fn leases_reclaimed_key(prefix: &str, tenant: &str) -> String {
    format!("{prefix}:leases-reclaimed:{{{tenant}}}")
}

/// The reclaimed leases whose reported requests without usage were charged, kept
/// [`CHARGED_RETENTION`]: `<prefix>:leases-charged:{<tenant>}` (lease id -> when,
/// ms).
pub fn leases_charged_key(prefix: &str, tenant: &str) -> String {
    format!("{prefix}:leases-charged:{{{tenant}}}")
}

/// An open reservation, as the ledger keeps it (JSON): what a charge records should the
/// request's usage never arrive.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reservation {
    /// [`RESERVATION_VERSION`].
    pub v: u32,
    /// Tokens reserved against the tenant's TPM buckets (0 without one), as admission's
    /// `reserved_tokens`: what a give-back returns (each bucket at most its capacity).
    pub reserved: u64,
    /// The prompt tokens the admission knew (the filter's estimate, or the exact count).
    pub prompt: u64,
    /// The most completion tokens the request can produce over all its choices.
    pub max_tokens: u64,
    /// The public model name.
    pub model: String,
    /// The pool.
    pub pool: String,
    /// The tenant's tier.
    pub tier: String,
    /// Envoy's `x-request-id`.
    pub request_id: String,
    /// Unix ms of the admission (the sidecar's clock): a charge is dated by it.
    pub at_ms: u64,
    /// Tokens the admission charged the tenant's quota counters ([`crate::admission::quota`]; 0: none):
    /// the usage record corrects them by the tokens used minus this, a give-back takes it off.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub quota: u64,
    /// The UTC day (`YYYY-MM-DD`) of the daily counters it charged.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub qday: String,
    /// The month (`YYYY-MM`) of the monthly counters it charged.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub qmonth: String,
    /// The name of the API key the request authenticated with (the facts'; absent from a
    /// reservation written before it): a charged reservation's record carries it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key: Option<String>,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl Reservation {
    /// The reservation of an admission of `facts` that reserved `reserved` tokens at `at_ms`.
    pub fn of(facts: &RequestFacts, reserved: u64, at_ms: u64) -> Self {
        Self {
            v: RESERVATION_VERSION,
            reserved,
            prompt: facts.prompt_tokens,
            max_tokens: facts.max_tokens,
            model: facts.model.clone(),
            pool: facts.pool.clone(),
            tier: facts.tier.clone(),
            request_id: facts.request_id.clone(),
            at_ms,
            quota: 0,
            qday: String::new(),
            qmonth: String::new(),
            api_key: facts.api_key.clone(),
        }
    }

    /// The same, having charged `tokens` to the quota counters of the periods of `quota_ms`
    /// (the admission's time on the quota clock, [`crate::admission::quota::Clock`]).
    pub fn with_quota(mut self, tokens: u64, quota_ms: u64) -> Self {
        if tokens > 0 {
            self.quota = tokens;
            self.qday = crate::admission::quota::day_label(quota_ms / 1000);
            self.qmonth = crate::admission::quota::month_label(quota_ms / 1000);
        }
        self
    }

    /// Its JSON.
    pub fn to_json(&self) -> String {
        // A struct of numbers and strings always serializes.
        serde_json::to_string(self).unwrap_or_default()
    }

    /// Reads a reservation's JSON: `None` when unreadable or of another version.
    pub fn from_json(json: &[u8]) -> Option<Self> {
        let r: Self = serde_json::from_slice(json).ok()?;
        (r.v == RESERVATION_VERSION).then_some(r)
    }
}

/// The record of a reservation charged because no usage arrived: its prompt count plus the rest
/// of `max(reserved, prompt + max_tokens)` as completion tokens (what the request could cost at
/// most, as a non-stream gone before its headers is charged: [`UsageRecord::new`]), status 0,
/// `usage_source` reservation, [`UsageRecord::unreported`], dated by the admission.
pub fn charged_record(tenant: &str, record_id: &str, r: &Reservation) -> UsageRecord {
    let info = RequestInfo {
        request_id: r.request_id.clone(),
        tenant: tenant.to_owned(),
        api_key: r.api_key.clone(),
        model: r.model.clone(),
        pool: r.pool.clone(),
        prompt_tokens_estimate: r.prompt,
        max_tokens: r.max_tokens,
        reserved_tokens: r.reserved,
        reserved_locally: false,
        tier: r.tier.clone(),
        record_id: record_id.to_owned(),
        lease_id: None,
        lease_seq: None,
        prompt_tokens_max: None,
        completion_tokens_max: None,
        operation: None,
        upstream_model: None,
    };
    // Reached the upstream, ended before any response headers, not known as a stream: charged
    // its reservation.
    let usage = Usage { stream: Some(false), ..Usage::unseen(0, 0) };
    let mut record = UsageRecord::new(info, usage, true);
    record.unreported = true;
    record.finished_at_unix_ms = r.at_ms;
    record
}

/// What settling a request that reserved `reserved` tokens and used `used` moves in each of
/// `buckets` (its TPM buckets): [`decision::settlement`], the buckets that do not move left out.
pub fn settlements(buckets: Vec<BucketSpec>, reserved: u64, used: u64) -> Vec<(BucketSpec, i64)> {
    buckets
        .into_iter()
        .map(|b| {
            let delta = decision::settlement(&b, reserved, used);
            (b, delta)
        })
        .filter(|(_, delta)| *delta != 0)
        .collect()
}

/// A tenant's open reservations due for a charge ([`crate::store::Store::claim`]), or its open
/// admission leases due for a reclaim (`T` the lease's record).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claimed<T = Reservation> {
    /// Open reservations (leases) of the tenant (due or not).
    pub open: u64,
    /// The due ones: record (lease) id and what it holds (`None`: unreadable JSON).
    pub due: Vec<(String, Option<T>)>,
}

impl<T> Default for Claimed<T> {
    fn default() -> Self {
        Self { open: 0, due: Vec::new() }
    }
}

/// Reads the `claim` operation's reply of reservations: `[open, id1, json1, id2, json2, ...]`.
///
/// # Errors
/// [`ReplyError`] when it does not have that shape.
pub fn read_claim(reply: &[redis::Value]) -> Result<Claimed, ReplyError> {
    read_claim_with(reply, Reservation::from_json)
}

/// Reads the `claim` operation's reply, each JSON read by `parse`.
///
/// # Errors
/// [`ReplyError`] when it does not have that shape.
pub fn read_claim_with<T>(
    reply: &[redis::Value],
    parse: fn(&[u8]) -> Option<T>,
) -> Result<Claimed<T>, ReplyError> {
    let bytes = |v: &redis::Value| match v {
        redis::Value::BulkString(b) => Some(b.clone()),
        redis::Value::SimpleString(s) => Some(s.clone().into_bytes()),
        _ => None,
    };
    let Some((first, rest)) = reply.split_first() else {
        return Err(ReplyError("ledger claim: empty reply".to_owned()));
    };
    let open = match first {
        redis::Value::Int(n) => u64::try_from(*n).unwrap_or(0),
        other => return Err(ReplyError(format!("ledger claim: count {other:?}"))),
    };
    if rest.len() % 2 != 0 {
        return Err(ReplyError(format!("ledger claim: {} values after the count", rest.len())));
    }
    let mut due = Vec::with_capacity(rest.len() / 2);
    for pair in rest.chunks_exact(2) {
        let (Some(id), Some(json)) = (pair.first().and_then(bytes), pair.get(1).and_then(bytes)) else {
            return Err(ReplyError("ledger claim: not an id and a JSON".to_owned()));
        };
        let id = String::from_utf8(id).map_err(|_| ReplyError("ledger claim: id not UTF-8".to_owned()))?;
        due.push((id, parse(&json)));
    }
    Ok(Claimed { open, due })
}

/// How one quota counter moves when a ledger write lands (`lua/ledger_v1.lua`'s
/// `adjust_quotas`, which applies it atomically with the write): by the tokens `used` minus what
/// the admission charged it (`reservation`'s `quota`, 0 or `None`: nothing charged, so the
/// counter gains `used`). A reservation charged in another period than the counter's (the
/// request crossed midnight, or a month's end) leaves the counter alone: the admission's period
/// keeps the reservation as used. A counter of another model's scope does not move. A give-back
/// is `used` = 0: the charge comes off.
pub fn quota_delta(counter: &QuotaSpec, model: &str, used: u64, reservation: Option<&Reservation>) -> i64 {
    if counter.model.as_deref().is_some_and(|scope| scope != model) {
        return 0;
    }
    let used = i64::try_from(used).unwrap_or(i64::MAX);
    let Some(r) = reservation.filter(|r| r.quota > 0) else { return used };
    let charged_in = match counter.period {
        Period::Day => &r.qday,
        Period::Month => &r.qmonth,
    };
    if *charged_in == counter.label {
        used.saturating_sub(i64::try_from(r.quota).unwrap_or(i64::MAX))
    } else {
        0
    }
}

/// Requests, reserved tokens and prompt estimates within them: one side of an admission lease's
/// books (`LU`'s `<id>:a`, `:at`, `:ap` as the filter reported them; `:l`, `:lt`, `:lp` of those
/// whose usage landed).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LeaseCounts {
    /// Requests.
    pub requests: u64,
    /// Tokens they reserved.
    pub tokens: u64,
    /// The prompt estimates within `tokens`.
    pub prompt_tokens: u64,
}

/// What the charge of a reclaimed admission lease charges (`lua/ledger_v1.lua`'s `lease_charge`):
/// its reported requests whose usage never landed, their reservations, and within those the
/// prompt estimates (at most the tokens: the rest is billed as completion). Nothing when the
/// lease's model is unknown (reclaimed by an older sidecar that kept no landed counts: nothing
/// can be told landed), or when every reported request landed.
pub fn lease_charge(reported: LeaseCounts, landed: LeaseCounts, model_known: bool) -> LeaseCounts {
    let requests = if model_known { reported.requests.saturating_sub(landed.requests) } else { 0 };
    if requests == 0 {
        return LeaseCounts::default();
    }
    let tokens = reported.tokens.saturating_sub(landed.tokens);
    let prompt_tokens = reported.prompt_tokens.saturating_sub(landed.prompt_tokens).min(tokens);
    LeaseCounts { requests, tokens, prompt_tokens }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admission::limits::BucketKind;
    use crate::metering::meter::{EndReason, UsageSource};

    fn reservation() -> Reservation {
        let facts = RequestFacts {
            tenant: Some("acme".into()),
            model: "m".into(),
            pool: "p".into(),
            prompt_tokens: 12,
            max_tokens: 30,
            request_id: "rid".into(),
            tier: "standard".into(),
            ..Default::default()
        };
        Reservation::of(&facts, 42, 1_700_000_000_000)
    }

    #[test]
    fn a_reservation_round_trips_and_refuses_other_versions() {
        let r = reservation();
        let json = r.to_json();
        assert_eq!(Reservation::from_json(json.as_bytes()), Some(r.clone()));
        assert!(json.contains("\"reserved\":42"), "the script reads `reserved`: {json}");
        let v2 = json.replace("\"v\":1", "\"v\":2");
        assert_eq!(Reservation::from_json(v2.as_bytes()), None);
        assert_eq!(Reservation::from_json(b"{"), None);
    }

    #[test]
    fn a_charge_is_the_reservation_dated_by_the_admission() {
        let r = reservation();
        let c = charged_record("acme", "rid.0123456789abcdef", &r);
        assert_eq!((c.info.tenant.as_str(), c.info.record_id.as_str()), ("acme", "rid.0123456789abcdef"));
        assert_eq!((c.prompt_tokens, c.completion_tokens, c.total_tokens()), (12, 30, 42));
        assert_eq!(
            (c.status, c.end_reason, c.usage_source),
            (0, EndReason::Incomplete, UsageSource::Reservation)
        );
        assert!(c.unreported);
        assert_eq!(c.finished_at_unix_ms, 1_700_000_000_000);
        // Its settlement moves nothing: the buckets keep what the admission took.
        let tpm = BucketSpec {
            kind: BucketKind::Tokens,
            key: "k".into(),
            capacity: 1000,
            rate_per_minute: 1000,
            cost: 0,
        };
        assert!(settlements(vec![tpm.clone()], c.info.reserved_tokens, c.total_tokens()).is_empty());
        // A reservation capped by a small bucket, or none (no TPM limit): charged prompt + cap.
        let none = Reservation { reserved: 0, ..r.clone() };
        let c = charged_record("acme", "x", &none);
        assert_eq!(c.total_tokens(), 42);
        let small = BucketSpec { capacity: 20, ..tpm };
        let capped = Reservation { reserved: 42, ..r };
        let c = charged_record("acme", "x", &capped);
        assert_eq!(settlements(vec![small], c.info.reserved_tokens, c.total_tokens())[0].1, -22);
    }

    #[test]
    fn a_claim_reply_is_read() {
        use redis::Value;
        let json = reservation().to_json();
        let reply = [
            Value::Int(3),
            Value::BulkString(b"a.0123456789abcdef".to_vec()),
            Value::BulkString(json.into_bytes()),
            Value::BulkString(b"b.0123456789abcdef".to_vec()),
            Value::BulkString(b"not json".to_vec()),
        ];
        let c = read_claim(&reply).unwrap();
        assert_eq!(c.open, 3);
        assert_eq!(c.due.len(), 2);
        assert_eq!(c.due[0], ("a.0123456789abcdef".to_owned(), Some(reservation())));
        assert_eq!(c.due[1].1, None);
        assert_eq!(read_claim(&[Value::Int(0)]).unwrap(), Claimed::default());
        assert!(read_claim(&[]).is_err());
        assert!(read_claim(&[Value::Int(1), Value::BulkString(b"a".to_vec())]).is_err());
        assert!(read_claim(&[Value::Nil]).is_err());
    }

    #[test]
    fn keys_share_the_tenants_hash_tag() {
        assert_eq!(reservations_key("p", "acme"), "p:reservations:{acme}");
        assert_eq!(due_key("p", "acme"), "p:reservations-due:{acme}");
        assert_eq!(charged_key("p", "acme"), "p:reservations-charged:{acme}");
    }

    fn counter(period: Period, label: &str, model: Option<&str>) -> QuotaSpec {
        QuotaSpec {
            key: "k".into(),
            model: model.map(str::to_owned),
            period,
            label: label.into(),
            hard: 100,
            soft: None,
            reset_at_secs: 0,
            expire_at_secs: 0,
        }
    }

    fn charged(quota: u64, qday: &str, qmonth: &str) -> Reservation {
        Reservation { quota, qday: qday.into(), qmonth: qmonth.into(), ..Reservation::default() }
    }

    #[test]
    fn a_quota_counter_moves_by_usage_less_the_admissions_charge() {
        let day = counter(Period::Day, "2026-11-28", None);
        let month = counter(Period::Month, "2026-11", None);
        let r = charged(40, "2026-11-28", "2026-11");
        // The record: 15 used of the 40 charged.
        assert_eq!(quota_delta(&day, "m", 15, Some(&r)), -25);
        assert_eq!(quota_delta(&month, "m", 15, Some(&r)), -25);
        // A give-back: the charge comes off.
        assert_eq!(quota_delta(&day, "m", 0, Some(&r)), -40);
        // No reservation, or one that charged nothing: the counter gains what was used.
        assert_eq!(quota_delta(&day, "m", 15, None), 15);
        assert_eq!(quota_delta(&day, "m", 15, Some(&charged(0, "", ""))), 15);
        // Charged yesterday (crossed midnight): today's counter is left alone, the month's moves.
        let yesterday = charged(40, "2026-11-27", "2026-11");
        assert_eq!(quota_delta(&day, "m", 15, Some(&yesterday)), 0);
        assert_eq!(quota_delta(&month, "m", 15, Some(&yesterday)), -25);
        // A model's quota moves for that model only.
        let big = counter(Period::Month, "2026-11", Some("big"));
        assert_eq!(quota_delta(&big, "m", 15, None), 0);
        assert_eq!(quota_delta(&big, "big", 15, None), 15);
    }

    #[test]
    fn a_reclaimed_lease_is_charged_for_what_never_landed() {
        let reported = LeaseCounts { requests: 5, tokens: 500, prompt_tokens: 200 };
        let landed = LeaseCounts { requests: 3, tokens: 300, prompt_tokens: 150 };
        assert_eq!(
            lease_charge(reported, landed, true),
            LeaseCounts { requests: 2, tokens: 200, prompt_tokens: 50 }
        );
        // Everything landed, or the model is unknown: nothing.
        assert_eq!(lease_charge(reported, reported, true), LeaseCounts::default());
        assert_eq!(lease_charge(reported, landed, false), LeaseCounts::default());
        // Prompt estimates are at most the tokens charged.
        let odd = LeaseCounts { requests: 1, tokens: 10, prompt_tokens: 50 };
        assert_eq!(lease_charge(odd, LeaseCounts::default(), true).prompt_tokens, 10);
        // Landed counts past the report (a late report) never charge a negative amount.
        assert_eq!(lease_charge(landed, reported, true), LeaseCounts::default());
    }
}
