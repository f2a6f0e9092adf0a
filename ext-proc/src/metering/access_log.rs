//! The metering's reading of one Envoy access log entry (`envoy.data.accesslog.v3.HTTPAccessLogEntry`,
//! from the gRPC access log service, [`crate::grpc::access_log`], or the usage journal's file,
//! [`crate::metering::journal`]): Envoy's `envoy.access_loggers.http_grpc` logger sends
//! one `HTTPAccessLogEntry` per finished HTTP stream (batched per worker, off the request path),
//! with two filter states the wasm filter set, [`FS_REQUEST`] (its decision: tenant, model, pool,
//! token counts, lease) and [`FS_USAGE`] (the [`gateway_meter::Usage`] JSON it measured on the
//! response), and admission's dynamic metadata (namespace `llm_gateway`: the reservation). Each
//! entry of an admitted request becomes one usage record ([`crate::metering::finish::finish`]: reservation
//! settled, record queued). Only what clients cannot write counts: an entry without the filter's
//! decision (a local reply before the filter ran: an `Upgrade` Envoy refused, an RBAC denial, the
//! filter's own 401/400) or without an admission (the ext_proc admission's reservation, or the
//! filter's lease) produces no record and settles nothing, whatever its request headers say.
//!
//! Envoy logs a stream once, at its end, whether it completed, was reset or the client went
//! away: one entry, one record. An admitted request whose entry lacks the filter state (the
//! filter never saw its response) is recorded as `incomplete` with no tokens, so its reservation
//! is still settled. The record's id comes from the request (the facts' request id and nonce,
//! [`gateway_contract::record_id`]), so an entry delivered twice, or replayed after a restart, is
//! applied once ([`crate::metering::ledger`]).
//!
//! An entry of a request the filter decided but whose admission answer Envoy never received (the
//! sidecar died or did not answer in time after taking the buckets, or the client left
//! meanwhile: status 0 or 5xx, not a reply of the sidecar's own) releases the request's
//! reservation, should the ledger hold one open, so that it is never charged.

use envoy_types::pb::envoy::data::accesslog::v3::HttpAccessLogEntry;
use envoy_types::pb::google::protobuf::Any;
use prost::Message;
use tracing::warn;

use gateway_contract::{FS_REQUEST, FS_USAGE, MD_PROMPT_TOKENS, MD_RESERVED_TOKENS, METADATA_NAMESPACE};

use crate::facts::RequestFacts;

use crate::facts::ADMISSION_REPLY_DETAILS;
use crate::metering::meter::{RequestInfo, Usage, UsageRecord};

/// What one access-log entry asks of the ledger.
#[derive(Debug)]
pub(crate) enum Entry {
    /// An admitted request's usage.
    Record(Box<UsageRecord>),
    /// A request the filter decided whose admission answer Envoy never received: its reservation,
    /// if open, is released.
    Release {
        /// The tenant.
        tenant: String,
        /// The model (its buckets).
        model: String,
        /// The request's record id.
        record_id: String,
    },
    /// Nothing: the filter did not decide the request, or the sidecar answered it (refused).
    Nothing,
}

/// What an access-log entry asks of the ledger: the usage record of an admitted request
/// ([`record_with`]); the release of the reservation of a request the filter decided (with a nonce)
/// whose admission Envoy never received (not admitted, not a lease, and ended with status 0 or
/// 5xx that is not the sidecar's own reply, [`ADMISSION_REPLY_DETAILS`]); else nothing.
pub(crate) fn entry_of(entry: &HttpAccessLogEntry, record_id: impl FnOnce() -> String) -> Entry {
    let Some(facts) = decided(entry) else { return Entry::Nothing };
    let facts = match record_with(entry, facts, record_id) {
        Ok(record) => return Entry::Record(Box::new(record)),
        Err(facts) => *facts,
    };
    let response = entry.response.as_ref();
    let status = response.and_then(|r| r.response_code).map_or(0, |c| c.value);
    let by_the_sidecar = response.is_some_and(|r| r.response_code_details == ADMISSION_REPLY_DETAILS);
    let unanswered = (status == 0 || status >= 500) && !by_the_sidecar && facts.leased_tokens.is_none();
    match (unanswered, facts.record_id(), facts.tenant) {
        (true, Some(record_id), Some(tenant)) => Entry::Release { tenant, model: facts.model, record_id },
        _ => Entry::Nothing,
    }
}

/// The filter's facts in an entry's filter state (None: absent or unreadable).
fn decided(entry: &HttpAccessLogEntry) -> Option<gateway_contract::RequestFacts> {
    let common = entry.common_properties.as_ref()?;
    common.filter_state_objects.get(FS_REQUEST).and_then(|any| match bytes_of(any) {
        Ok(bytes) => gateway_contract::RequestFacts::from_json(&bytes),
        Err(why) => {
            warn!(%why, "unreadable request facts in the access log");
            None
        }
    })
}

/// [`record_with`] of an entry's facts; `None` without them, or when not admitted.
#[cfg(test)]
fn record_of(entry: &HttpAccessLogEntry, record_id: impl FnOnce() -> String) -> Option<UsageRecord> {
    record_with(entry, decided(entry)?, record_id).ok()
}

/// The usage record of one access-log entry of a request the filter decided (`decided`, its
/// [`FS_REQUEST`]); the facts back when it was not admitted: neither the ext_proc admission's
/// reservation in its dynamic metadata (namespace `llm_gateway`) nor the filter's lease in its
/// facts. Its id is the request's ([`gateway_contract::record_id`]); facts without a nonce (an
/// older filter) name it by the request id and Envoy's start time of the stream, else by
/// `record_id()`.
fn record_with(
    entry: &HttpAccessLogEntry,
    decided: gateway_contract::RequestFacts,
    record_id: impl FnOnce() -> String,
) -> Result<UsageRecord, Box<RequestFacts>> {
    let request_id = entry.request.as_ref().map(|r| r.request_id.clone()).unwrap_or_default();
    let mut facts = RequestFacts::from_filter(decided, request_id);
    let Some(common) = entry.common_properties.as_ref() else { return Err(Box::new(facts)) };
    let metadata = common.metadata.as_ref();
    let admission = metadata.and_then(|m| m.filter_metadata.get(METADATA_NAMESPACE)).map(|s| &s.fields);
    let reserved = match facts.leased_tokens {
        Some(tokens) => (tokens, false),
        None => {
            if !admission.is_some_and(|f| f.contains_key(MD_RESERVED_TOKENS)) {
                return Err(Box::new(facts));
            }
            crate::facts::reservation(metadata)
        }
    };
    if let Some(counted) = admission.and_then(|f| crate::facts::metadata_number(f.get(MD_PROMPT_TOKENS)?)) {
        facts.prompt_tokens = counted;
    }
    let status = entry
        .response
        .as_ref()
        .and_then(|r| r.response_code)
        .and_then(|c| u16::try_from(c.value).ok())
        .unwrap_or(0);
    let usage = match common.filter_state_objects.get(FS_USAGE) {
        Some(any) => {
            match bytes_of(any).and_then(|b| serde_json::from_slice(&b).map_err(|e| e.to_string())) {
                Ok(usage) => usage,
                Err(why) => {
                    warn!(request_id = %facts.request_id, %why, "unreadable usage in the access log");
                    Usage::unseen(duration_us(entry), status)
                }
            }
        }
        None => Usage::unseen(duration_us(entry), status),
    };
    let id = facts.record_id().or_else(|| started_id(entry, &facts.request_id)).unwrap_or_else(record_id);
    let info = RequestInfo::new(facts, reserved, id);
    let mut record = UsageRecord::new(info, usage, reached_upstream(common));
    record.finished_at_unix_ms = finished_at_unix_ms(entry);
    Ok(record)
}

/// A record id from the request id and Envoy's start time of the stream, in nanoseconds (in the
/// nonce's place), for facts without a nonce; `None` without either.
fn started_id(entry: &HttpAccessLogEntry, request_id: &str) -> Option<String> {
    let start = entry.common_properties.as_ref()?.start_time.as_ref()?;
    if request_id.is_empty() {
        return None;
    }
    let ns = u64::try_from(start.seconds)
        .ok()?
        .checked_mul(1_000_000_000)?
        .checked_add(u64::try_from(start.nanos).ok()?)?;
    gateway_contract::record_id(request_id, &format!("{ns:016x}"))
}

/// Whether Envoy sent the whole request upstream (`time_to_last_upstream_tx_byte` is set): only
/// then can the upstream have run it. A request refused or abandoned before (a local reply, a
/// client gone while Envoy waited for a connection) did no GPU work.
fn reached_upstream(common: &envoy_types::pb::envoy::data::accesslog::v3::AccessLogCommon) -> bool {
    common.time_to_last_upstream_tx_byte.is_some()
}

/// Unix milliseconds when Envoy sent the last response byte (or ended the stream): the entry's
/// `start_time` plus `time_to_last_downstream_tx_byte`; 0 when Envoy gave no start time.
fn finished_at_unix_ms(entry: &HttpAccessLogEntry) -> u64 {
    let Some(start) = entry.common_properties.as_ref().and_then(|c| c.start_time.as_ref()) else {
        return 0;
    };
    let start_us = i128::from(start.seconds) * 1_000_000 + i128::from(start.nanos) / 1000;
    u64::try_from((start_us + i128::from(duration_us(entry))) / 1000).unwrap_or(0)
}

/// Microseconds from the first request byte to the last response byte Envoy sent (0: unknown).
fn duration_us(entry: &HttpAccessLogEntry) -> u64 {
    entry.common_properties.as_ref().and_then(|c| c.time_to_last_downstream_tx_byte.as_ref()).map_or(0, |d| {
        let micros = i128::from(d.seconds) * 1_000_000 + i128::from(d.nanos) / 1000;
        u64::try_from(micros).unwrap_or(0)
    })
}

/// Decodes the filter state Envoy logs for a property set from wasm: an `Any` holding a
/// `google.protobuf.BytesValue` (or `StringValue`) whose value is the property's bytes, possibly
/// wrapped in one more `Any`.
fn bytes_of(any: &Any) -> Result<Vec<u8>, String> {
    let bytes = match any.type_url.rsplit('/').next().unwrap_or_default() {
        "google.protobuf.Any" => {
            let inner = Any::decode(any.value.as_slice()).map_err(|e| e.to_string())?;
            if inner.type_url.ends_with("/google.protobuf.Any") {
                return Err("nested too deep".to_owned());
            }
            return bytes_of(&inner);
        }
        "google.protobuf.BytesValue" => {
            <Vec<u8> as Message>::decode(any.value.as_slice()).map_err(|e| e.to_string())?
        }
        "google.protobuf.StringValue" => {
            <String as Message>::decode(any.value.as_slice()).map_err(|e| e.to_string())?.into_bytes()
        }
        other => return Err(format!("unexpected type {other:?}")),
    };
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use envoy_types::pb::envoy::config::core::v3::Metadata;
    use envoy_types::pb::envoy::data::accesslog::v3::{
        AccessLogCommon, HttpRequestProperties, HttpResponseProperties,
    };
    use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};

    use super::*;
    use crate::metering::meter::{EndReason, UsageSource};

    fn any_bytes(json: &str) -> Any {
        let value = json.as_bytes().to_vec().encode_to_vec();
        Any { type_url: "type.googleapis.com/google.protobuf.BytesValue".into(), value }
    }

    const FACTS: &str = r#"{"v":1,"tenant":"acme","tier":"standard","model":"m","pool":"p","prompt_tokens":12,"max_tokens":38}"#;
    const LEASED: &str = r#"{"v":1,"tenant":"acme","tier":"standard","model":"m","pool":"p","prompt_tokens":12,"max_tokens":38,"leased_tokens":30}"#;

    /// An entry with the filter's facts (when `facts`), admission's reservation (when `admitted`)
    /// and the usage; its request headers claim everything a forger would.
    fn entry(facts: Option<&str>, admitted: bool, usage: Option<Any>) -> HttpAccessLogEntry {
        let mut fields = HashMap::new();
        if admitted {
            fields.insert(MD_RESERVED_TOKENS.to_owned(), Value { kind: Some(Kind::NumberValue(50.0)) });
        }
        let metadata = Metadata {
            filter_metadata: HashMap::from([(METADATA_NAMESPACE.to_owned(), Struct { fields })]),
            ..Default::default()
        };
        let mut states = HashMap::new();
        if let Some(facts) = facts {
            states.insert(FS_REQUEST.to_owned(), any_bytes(facts));
        }
        if let Some(usage) = usage {
            states.insert(FS_USAGE.to_owned(), usage);
        }
        HttpAccessLogEntry {
            common_properties: Some(AccessLogCommon {
                metadata: Some(metadata),
                filter_state_objects: states,
                ..Default::default()
            }),
            request: Some(HttpRequestProperties {
                request_id: "req-1".into(),
                request_headers: HashMap::from([
                    ("x-gateway-tenant".to_owned(), "forged".to_owned()),
                    ("x-gateway-model".to_owned(), "forged".to_owned()),
                    ("x-gateway-prompt-tokens".to_owned(), "99".to_owned()),
                    ("x-gateway-admission".to_owned(), "lease".to_owned()),
                    ("x-gateway-reserved-tokens".to_owned(), "99999999".to_owned()),
                ]),
                ..Default::default()
            }),
            response: Some(HttpResponseProperties {
                response_code: Some(envoy_types::pb::google::protobuf::UInt32Value { value: 200 }),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    const USAGE: &str = r#"{"v":1,"status":200,"prompt_tokens":10,"completion_tokens":3,"cached_tokens":0,"ttft_us":5,"tpot_us":1,"duration_us":9,"end_reason":"completed","usage_source":"upstream"}"#;

    #[test]
    fn an_admitted_entry_becomes_one_record_from_the_filters_facts() {
        let r = record_of(&entry(Some(FACTS), true, Some(any_bytes(USAGE))), || "id".into()).unwrap();
        assert_eq!((r.info.tenant.as_str(), r.info.request_id.as_str()), ("acme", "req-1"));
        assert_eq!((r.info.model.as_str(), r.info.pool.as_str()), ("m", "p"));
        assert_eq!((r.prompt_tokens, r.completion_tokens, r.info.reserved_tokens), (10, 3, 50));
        assert_eq!((r.end_reason, r.usage_source), (EndReason::Completed, UsageSource::Upstream));
        assert_eq!(r.finished_at_unix_ms, 0, "no start time logged");
    }

    #[test]
    fn request_headers_never_meter_or_settle() {
        // The Upgrade that Envoy refused before the filter ran: no facts, no admission, headers
        // claiming a lease of 99,999,999 tokens for tenant `forged`.
        assert!(record_of(&entry(None, false, None), || "id".into()).is_none());
        assert!(record_of(&entry(None, false, Some(any_bytes(USAGE))), || "id".into()).is_none());
        // Even with admission metadata (which only the sidecar writes), no facts: no record.
        assert!(record_of(&entry(None, true, Some(any_bytes(USAGE))), || "id".into()).is_none());
        // Facts that are not the filter's (another version, no tenant, not JSON): no record.
        for bad in [
            r#"{"v":2,"tenant":"acme","tier":"","model":"","pool":"","prompt_tokens":0,"max_tokens":0}"#,
            "{",
            "",
        ] {
            assert!(record_of(&entry(Some(bad), true, None), || "id".into()).is_none(), "{bad}");
        }
    }

    #[test]
    fn the_record_is_dated_by_envoy() {
        let mut e = entry(Some(FACTS), true, Some(any_bytes(USAGE)));
        let common = e.common_properties.as_mut().unwrap();
        common.start_time =
            Some(envoy_types::pb::google::protobuf::Timestamp { seconds: 1_700_000_000, nanos: 5_000_000 });
        common.time_to_last_downstream_tx_byte =
            Some(envoy_types::pb::google::protobuf::Duration { seconds: 1, nanos: 250_000_000 });
        assert_eq!(record_of(&e, || "id".into()).unwrap().finished_at_unix_ms, 1_700_000_001_255);
    }

    #[test]
    fn the_usage_may_come_wrapped_in_another_any() {
        let inner = any_bytes(USAGE);
        let outer =
            Any { type_url: "type.googleapis.com/google.protobuf.Any".into(), value: inner.encode_to_vec() };
        let usage: Usage = serde_json::from_slice(&bytes_of(&outer).unwrap()).unwrap();
        assert_eq!(usage.completion_tokens, 3);
    }

    #[test]
    fn decided_but_not_admitted_is_not_metered() {
        // The filter decided, then the admission refused (429): facts, no reservation.
        assert!(record_of(&entry(Some(FACTS), false, Some(any_bytes(USAGE))), || "id".into()).is_none());
    }

    #[test]
    fn a_leased_admission_is_metered_with_the_filters_reservation() {
        let mut e = entry(Some(LEASED), false, Some(any_bytes(USAGE)));
        // No dynamic metadata at all: the ext_proc admission never saw the request.
        e.common_properties.as_mut().unwrap().metadata = None;
        let r = record_of(&e, || "id".into()).unwrap();
        assert_eq!((r.info.reserved_tokens, r.info.reserved_locally), (30, false));
        assert_eq!(r.completion_tokens, 3);
    }

    #[test]
    fn an_exact_count_in_the_metadata_replaces_the_estimate() {
        let mut e = entry(Some(FACTS), true, None);
        let md = e.common_properties.as_mut().unwrap().metadata.as_mut().unwrap();
        let fields = &mut md.filter_metadata.get_mut(METADATA_NAMESPACE).unwrap().fields;
        fields.insert(MD_PROMPT_TOKENS.to_owned(), Value { kind: Some(Kind::NumberValue(21.0)) });
        assert_eq!(record_of(&e, || "id".into()).unwrap().total_tokens(), 21);
    }

    #[test]
    fn a_non_stream_gone_before_its_headers_is_charged_its_reservation_only_if_sent_upstream() {
        const GONE: &str = r#"{"v":1,"status":0,"prompt_tokens":0,"completion_tokens":0,"cached_tokens":0,"ttft_us":0,"tpot_us":0,"duration_us":9,"end_reason":"incomplete","usage_source":"streamed_chunks","stream":false}"#;
        let mut e = entry(Some(FACTS), true, Some(any_bytes(GONE)));
        e.response = None;
        let r = record_of(&e, || "id".into()).unwrap();
        assert_eq!((r.total_tokens(), r.usage_source), (0, UsageSource::StreamedChunks), "never sent");
        e.common_properties.as_mut().unwrap().time_to_last_upstream_tx_byte =
            Some(envoy_types::pb::google::protobuf::Duration { seconds: 0, nanos: 1_000_000 });
        let r = record_of(&e, || "id".into()).unwrap();
        assert_eq!(
            (r.prompt_tokens, r.completion_tokens, r.usage_source),
            (12, 38, UsageSource::Reservation)
        );
    }

    const NAMED: &str = r#"{"v":1,"tenant":"acme","tier":"standard","model":"m","pool":"p","prompt_tokens":12,"max_tokens":38,"request_id":"rid-7","nonce":"00000000000000ff"}"#;

    #[test]
    fn a_record_is_named_by_its_request() {
        let e = entry(Some(NAMED), true, Some(any_bytes(USAGE)));
        let r = record_of(&e, || panic!("named by the facts")).unwrap();
        assert_eq!(r.info.record_id, "rid-7.00000000000000ff");
        assert_eq!(r.info.request_id, "rid-7", "the request id the filter saw");
        // Every delivery of the entry names the same record.
        assert_eq!(record_of(&e, || panic!()).unwrap().info.record_id, r.info.record_id);
        // Facts of an older filter (no nonce): the request id and Envoy's start time of the stream.
        let mut old = entry(Some(FACTS), true, Some(any_bytes(USAGE)));
        old.common_properties.as_mut().unwrap().start_time =
            Some(envoy_types::pb::google::protobuf::Timestamp { seconds: 1, nanos: 5 });
        assert_eq!(record_of(&old, || panic!()).unwrap().info.record_id, "req-1.000000003b9aca05");
        // Neither: the sidecar's own id.
        let none = entry(Some(FACTS), true, Some(any_bytes(USAGE)));
        assert_eq!(record_of(&none, || "own".into()).unwrap().info.record_id, "own");
    }

    #[test]
    fn an_unanswered_admission_releases_its_reservation_and_a_refusal_does_not() {
        let ended = |status: u32, details: &str| {
            let mut e = entry(Some(NAMED), false, None);
            let response = e.response.as_mut().unwrap();
            response.response_code = Some(envoy_types::pb::google::protobuf::UInt32Value { value: status });
            response.response_code_details = details.to_owned();
            e
        };
        let release = |e: &HttpAccessLogEntry| match entry_of(e, || "id".into()) {
            Entry::Release { tenant, model, record_id } => Some((tenant, model, record_id)),
            Entry::Record(_) | Entry::Nothing => None,
        };
        let expected = Some(("acme".to_owned(), "m".to_owned(), "rid-7.00000000000000ff".to_owned()));
        // Envoy's own 500 (the sidecar died after its take), its 504 (no answer in time), a client
        // gone before any response: released.
        assert_eq!(release(&ended(500, "ext_proc_error_gRPC_error_14")), expected);
        assert_eq!(release(&ended(504, "ext_proc_error_message_timeout")), expected);
        assert_eq!(release(&ended(0, "")), expected);
        // The sidecar's own refusals (it gave back whatever it took itself), other 4xx: nothing.
        assert_eq!(release(&ended(503, ADMISSION_REPLY_DETAILS)), None);
        assert_eq!(release(&ended(429, ADMISSION_REPLY_DETAILS)), None);
        assert_eq!(release(&ended(403, "rbac_access_denied_matched_policy[none]")), None);
        // An older filter's facts (no nonce): no reservation to name.
        let mut old = ended(500, "");
        old.common_properties
            .as_mut()
            .unwrap()
            .filter_state_objects
            .insert(FS_REQUEST.to_owned(), any_bytes(FACTS));
        assert_eq!(release(&old), None);
        // No facts: nothing; admitted: a record.
        assert!(matches!(entry_of(&entry(None, false, None), || "id".into()), Entry::Nothing));
        assert!(matches!(entry_of(&entry(Some(NAMED), true, None), || "id".into()), Entry::Record(_)));
    }

    #[test]
    fn an_entry_without_usage_still_settles() {
        let r = record_of(&entry(Some(FACTS), true, None), || "id".into()).unwrap();
        assert_eq!(
            (r.status, r.end_reason, r.usage_source),
            (200, EndReason::Incomplete, UsageSource::StreamedChunks)
        );
        // No response seen by the filter, but a 2xx: the request's own prompt count.
        assert_eq!(r.total_tokens(), 12);
        let bad = record_of(&entry(Some(FACTS), true, Some(any_bytes("{"))), || "id".into()).unwrap();
        assert_eq!(bad.completion_tokens, 0);
    }
}
