//! The tonic adapter of Envoy's gRPC access log service (`envoy.service.accesslog.v3`,
//! `StreamAccessLogs`), the metering path: Envoy's `envoy.access_loggers.http_grpc` logger sends
//! one `HTTPAccessLogEntry` per finished HTTP stream (batched per worker, off the request path),
//! with the request's `x-gateway-*` headers (`additional_request_headers_to_log`), admission's
//! dynamic metadata (namespace `llm_gateway`: the reservation) and the filter state
//! [`USAGE_FILTER_STATE`], the [`gateway_meter::Usage`] JSON the wasm filter measured on the
//! response. Each entry of an admitted request becomes one usage record ([`service::finish`]:
//! reservation settled, record queued); entries without admission metadata (local replies: 401,
//! 429, 400) are not metered.
//!
//! Envoy logs a stream once, at its end, whether it completed, was reset or the client went
//! away: one entry, one record. An admitted request whose entry lacks the filter state (the
//! filter never saw its response) is recorded as `incomplete` with no tokens, so its reservation
//! is still settled.

use std::sync::Arc;

use envoy_types::pb::envoy::data::accesslog::v3::HttpAccessLogEntry;
use envoy_types::pb::envoy::service::accesslog::v3::access_log_service_server::AccessLogService;
use envoy_types::pb::envoy::service::accesslog::v3::stream_access_logs_message::LogEntries;
use envoy_types::pb::envoy::service::accesslog::v3::{StreamAccessLogsMessage, StreamAccessLogsResponse};
use envoy_types::pb::google::protobuf::Any;
use prost::Message;
use tonic::{Request, Response, Status, Streaming};
use tracing::warn;

use crate::meter::{RequestInfo, Usage, UsageRecord};
use crate::service::{self, Shared, METADATA_NAMESPACE, RESERVED_TOKENS_KEY};

/// Envoy filter-state key of the usage the wasm filter measured (it sets the property
/// `llm_gateway.usage`; Envoy prefixes properties set from wasm with `wasm.`). The access log
/// lists it in `filter_state_objects_to_log`.
pub const USAGE_FILTER_STATE: &str = "wasm.llm_gateway.usage";

/// The access log service.
pub struct AccessLog {
    shared: Arc<Shared>,
}

impl AccessLog {
    /// A service over the shared state.
    pub fn new(shared: Arc<Shared>) -> Self {
        Self { shared }
    }
}

#[tonic::async_trait]
impl AccessLogService for AccessLog {
    async fn stream_access_logs(
        &self,
        request: Request<Streaming<StreamAccessLogsMessage>>,
    ) -> Result<Response<StreamAccessLogsResponse>, Status> {
        let _open = self.shared.stream_opened();
        let mut inbound = request.into_inner();
        while let Some(message) = inbound.message().await? {
            let Some(LogEntries::HttpLogs(logs)) = message.log_entries else { continue };
            for entry in logs.log_entry {
                if let Some(record) = record_of(&entry, || self.shared.ids.next()) {
                    service::finish(&self.shared, record);
                }
            }
        }
        Ok(Response::new(StreamAccessLogsResponse {}))
    }
}

/// The usage record of one access-log entry; `None` when the request was not admitted: neither
/// the ext_proc admission's reservation in its dynamic metadata (namespace `llm_gateway`) nor the
/// filter's leased admission in its request headers (`x-gateway-admission: lease`).
fn record_of(entry: &HttpAccessLogEntry, record_id: impl FnOnce() -> String) -> Option<UsageRecord> {
    let common = entry.common_properties.as_ref()?;
    let request = entry.request.as_ref();
    let facts = service::facts_from(|name| {
        let request = request?;
        if name == "x-request-id" && !request.request_id.is_empty() {
            return Some(request.request_id.clone());
        }
        request.request_headers.get(name).cloned()
    });
    let metadata = common.metadata.as_ref();
    let reserved = match facts.leased_tokens {
        Some(tokens) => (tokens, false),
        None => {
            let admitted = metadata
                .and_then(|m| m.filter_metadata.get(METADATA_NAMESPACE))
                .is_some_and(|s| s.fields.contains_key(RESERVED_TOKENS_KEY));
            if !admitted {
                return None;
            }
            service::reservation(metadata)
        }
    };
    let status = entry
        .response
        .as_ref()
        .and_then(|r| r.response_code)
        .and_then(|c| u16::try_from(c.value).ok())
        .unwrap_or(0);
    let usage = match common.filter_state_objects.get(USAGE_FILTER_STATE) {
        Some(any) => match usage_of(any) {
            Ok(usage) => usage,
            Err(why) => {
                warn!(request_id = %facts.request_id, %why, "unreadable usage in the access log");
                Usage::unseen(duration_us(entry), status)
            }
        },
        None => Usage::unseen(duration_us(entry), status),
    };
    let info = RequestInfo::new(facts, reserved, record_id());
    let mut record = UsageRecord::new(info, usage, reached_upstream(common));
    record.finished_at_unix_ms = finished_at_unix_ms(entry);
    Some(record)
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
/// `google.protobuf.BytesValue` (or `StringValue`) whose value is the [`Usage`] JSON, possibly
/// wrapped in one more `Any`.
fn usage_of(any: &Any) -> Result<Usage, String> {
    let bytes = match any.type_url.rsplit('/').next().unwrap_or_default() {
        "google.protobuf.Any" => {
            let inner = Any::decode(any.value.as_slice()).map_err(|e| e.to_string())?;
            if inner.type_url.ends_with("/google.protobuf.Any") {
                return Err("nested too deep".to_owned());
            }
            return usage_of(&inner);
        }
        "google.protobuf.BytesValue" => {
            <Vec<u8> as Message>::decode(any.value.as_slice()).map_err(|e| e.to_string())?
        }
        "google.protobuf.StringValue" => {
            <String as Message>::decode(any.value.as_slice()).map_err(|e| e.to_string())?.into_bytes()
        }
        other => return Err(format!("unexpected type {other:?}")),
    };
    serde_json::from_slice(&bytes).map_err(|e| e.to_string())
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
    use crate::meter::{EndReason, UsageSource};

    fn any_bytes(json: &str) -> Any {
        let value = json.as_bytes().to_vec().encode_to_vec();
        Any { type_url: "type.googleapis.com/google.protobuf.BytesValue".into(), value }
    }

    fn entry(admitted: bool, usage: Option<Any>) -> HttpAccessLogEntry {
        let mut fields = HashMap::new();
        if admitted {
            fields.insert(RESERVED_TOKENS_KEY.to_owned(), Value { kind: Some(Kind::NumberValue(50.0)) });
        }
        let metadata = Metadata {
            filter_metadata: HashMap::from([(METADATA_NAMESPACE.to_owned(), Struct { fields })]),
            ..Default::default()
        };
        HttpAccessLogEntry {
            common_properties: Some(AccessLogCommon {
                metadata: Some(metadata),
                filter_state_objects: usage
                    .map(|u| HashMap::from([(USAGE_FILTER_STATE.to_owned(), u)]))
                    .unwrap_or_default(),
                ..Default::default()
            }),
            request: Some(HttpRequestProperties {
                request_id: "req-1".into(),
                request_headers: HashMap::from([
                    ("x-gateway-tenant".to_owned(), "acme".to_owned()),
                    ("x-gateway-model".to_owned(), "m".to_owned()),
                    ("x-gateway-prompt-tokens".to_owned(), "12".to_owned()),
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
    fn an_admitted_entry_becomes_one_record() {
        let r = record_of(&entry(true, Some(any_bytes(USAGE))), || "id".into()).unwrap();
        assert_eq!((r.info.tenant.as_str(), r.info.request_id.as_str()), ("acme", "req-1"));
        assert_eq!((r.prompt_tokens, r.completion_tokens, r.info.reserved_tokens), (10, 3, 50));
        assert_eq!((r.end_reason, r.usage_source), (EndReason::Completed, UsageSource::Upstream));
        assert_eq!(r.finished_at_unix_ms, 0, "no start time logged");
    }

    #[test]
    fn the_record_is_dated_by_envoy() {
        let mut e = entry(true, Some(any_bytes(USAGE)));
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
        assert_eq!(usage_of(&outer).unwrap().completion_tokens, 3);
    }

    #[test]
    fn local_replies_are_not_metered() {
        assert!(record_of(&entry(false, Some(any_bytes(USAGE))), || "id".into()).is_none());
    }

    #[test]
    fn a_leased_admission_is_metered_with_the_filters_reservation() {
        let mut e = entry(false, Some(any_bytes(USAGE)));
        let headers = &mut e.request.as_mut().unwrap().request_headers;
        headers.insert("x-gateway-admission".into(), "lease".into());
        headers.insert("x-gateway-reserved-tokens".into(), "30".into());
        // No dynamic metadata at all: the ext_proc admission never saw the request.
        e.common_properties.as_mut().unwrap().metadata = None;
        let r = record_of(&e, || "id".into()).unwrap();
        assert_eq!((r.info.reserved_tokens, r.info.reserved_locally), (30, false));
        assert_eq!(r.completion_tokens, 3);
        let mut other = entry(false, Some(any_bytes(USAGE)));
        let headers = &mut other.request.as_mut().unwrap().request_headers;
        headers.insert("x-gateway-admission".into(), "exact".into());
        assert!(record_of(&other, || "id".into()).is_none(), "only `lease` admits");
    }

    #[test]
    fn a_non_stream_gone_before_its_headers_is_charged_its_reservation_only_if_sent_upstream() {
        const GONE: &str = r#"{"v":1,"status":0,"prompt_tokens":0,"completion_tokens":0,"cached_tokens":0,"ttft_us":0,"tpot_us":0,"duration_us":9,"end_reason":"incomplete","usage_source":"streamed_chunks","stream":false}"#;
        let mut e = entry(true, Some(any_bytes(GONE)));
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

    #[test]
    fn an_entry_without_usage_still_settles() {
        let r = record_of(&entry(true, None), || "id".into()).unwrap();
        assert_eq!(
            (r.status, r.end_reason, r.usage_source),
            (200, EndReason::Incomplete, UsageSource::StreamedChunks)
        );
        // No response seen by the filter, but a 2xx: the request's own prompt count.
        assert_eq!(r.total_tokens(), 12);
        let bad = record_of(&entry(true, Some(any_bytes("{"))), || "id".into()).unwrap();
        assert_eq!(bad.completion_tokens, 0);
    }
}
