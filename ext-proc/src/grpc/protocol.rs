//! The ext_proc protocol as the sidecar speaks it (Envoy's `envoy.service.ext_proc.v3`): the
//! request's facts from the attributes (or headers) Envoy sends, CONTINUE and ImmediateResponse
//! answers, the admission's dynamic metadata (namespace `llm_gateway`) and the endpoint pick's
//! (`envoy.lb`), and the subset hint of the endpoint-picker protocol. Shapes only: no decision.

use std::collections::HashMap;
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, HeaderValueOption};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as ProcRequest;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as ProcResponse;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    CommonResponse, HeaderMutation, HeadersResponse, HttpHeaders, ImmediateResponse, ProcessingRequest,
    ProcessingResponse,
};
use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};

use crate::admission::context::Counted;
use crate::admission::decision::Admitted;
use crate::config::FactsSource;
use crate::error::AdmissionError;
use crate::facts::RequestFacts;
use crate::facts::ADMISSION_REPLY_DETAILS;
use crate::scheduling::picker::Pick;
use gateway_contract::{
    ATTRIBUTES_FILTER_NAME, ATTRIBUTE_REQUEST, CONTEXT_CHECK_EXACT, H_CONTEXT_CHECK, H_CONTEXT_MODEL,
    H_MAX_TOKENS, H_MODEL, H_POOL, H_PROMPT_TOKENS, H_PROMPT_TOKENS_SOURCE, H_REQUEST_ID, H_REQUEST_NONCE,
    H_TENANT, H_TIER, MD_DESTINATION_ENDPOINT, MD_NAMESPACE_LB, MD_PICKED_ENDPOINT, MD_QUEUE_WAIT_MS,
};

pub use gateway_contract::{
    MD_ADMITTED, MD_PROMPT_TOKENS, MD_QUOTA_WARNING, MD_RESERVED_LOCALLY, MD_RESERVED_TOKENS,
    METADATA_NAMESPACE,
};
/// gRPC initial-metadata key naming the role of an ext_proc filter.
pub const ROLE_METADATA_KEY: &str = "x-gateway-ext-proc-role";

/// A request's facts and, when the filter asks for the exact context check, the base model to
/// count with. From the filter's state (ext_proc `request_attributes`), or with
/// `request_facts: headers` (Envoy Gateway) from the `x-gateway-*` headers. No facts: a
/// request the filter never decided (tenant `None`), which is neither admitted nor metered.
pub(crate) fn request_facts(
    source: FactsSource,
    message: &ProcessingRequest,
    headers: &HttpHeaders,
) -> (RequestFacts, Option<String>) {
    let request_id = header(headers, H_REQUEST_ID).unwrap_or_default();
    match source {
        FactsSource::FilterState => match filter_facts(message) {
            Some(facts) => {
                let context_model = facts.context_model.clone();
                (RequestFacts::from_filter(facts, request_id), context_model)
            }
            None => (RequestFacts { request_id, ..Default::default() }, None),
        },
        FactsSource::Headers => {
            let facts = facts_from_headers(|name| header(headers, name));
            let exact = header(headers, H_CONTEXT_CHECK).as_deref() == Some(CONTEXT_CHECK_EXACT);
            let context_model =
                exact.then(|| header(headers, H_CONTEXT_MODEL).unwrap_or_else(|| facts.model.clone()));
            (facts, context_model)
        }
    }
}

/// The filter's [`gateway_contract::RequestFacts`] from the attributes Envoy's ext_proc filter
/// sends (`request_attributes: ["filter_state['wasm.llm_gateway.request']"]`): the CEL value of
/// a wasm property is its bytes, which Envoy sends as a string value.
pub(crate) fn filter_facts(message: &ProcessingRequest) -> Option<gateway_contract::RequestFacts> {
    let value = message.attributes.get(ATTRIBUTES_FILTER_NAME)?.fields.get(ATTRIBUTE_REQUEST)?;
    match &value.kind {
        Some(Kind::StringValue(json)) => gateway_contract::RequestFacts::from_json(json.as_bytes()),
        _ => None,
    }
}

/// The request's facts from its `x-gateway-*` headers and `x-request-id`, read through
/// `header` (lower-case names). Only for `request_facts: headers`, where the wasm filter runs
/// first and removes client-sent `x-gateway-*` headers (Envoy Gateway, whose ext_proc cannot
/// be sent filter state); leases are never claimed this way.
pub(crate) fn facts_from_headers(header: impl Fn(&str) -> Option<String>) -> RequestFacts {
    let number = |name| header(name).and_then(|v| v.trim().parse().ok()).unwrap_or(0);
    RequestFacts {
        tenant: header(H_TENANT).filter(|t| !t.is_empty()),
        // No header names the key: per-key limits and names need the filter state.
        api_key: None,
        model: header(H_MODEL).unwrap_or_default(),
        pool: header(H_POOL).unwrap_or_default(),
        prompt_tokens: number(H_PROMPT_TOKENS),
        max_tokens: number(H_MAX_TOKENS),
        request_id: header(H_REQUEST_ID).unwrap_or_default(),
        tier: header(H_TIER).unwrap_or_default(),
        leased_tokens: None,
        lease_id: None,
        lease_seq: None,
        prefix_hashes: None,
        nonce: header(H_REQUEST_NONCE),
        prompt_tokens_max: None,
        completion_tokens_max: None,
        body_bytes: None,
        operation: None,
        upstream_model: None,
    }
}

/// A header's value; Envoy sends values in `raw_value` (bytes) with `value` empty.
pub(crate) fn header(headers: &HttpHeaders, name: &str) -> Option<String> {
    find_header(headers.headers.as_ref()?, name)
}

pub(crate) fn find_header(map: &HeaderMap, name: &str) -> Option<String> {
    map.headers.iter().find(|h| h.key.eq_ignore_ascii_case(name)).map(|h| {
        if h.raw_value.is_empty() {
            h.value.clone()
        } else {
            String::from_utf8_lossy(&h.raw_value).into_owned()
        }
    })
}

/// A CONTINUE answer to whatever phase the request was, with optional dynamic metadata.
pub(crate) fn continue_response(
    request: &Option<ProcRequest>,
    metadata: Option<Struct>,
) -> ProcessingResponse {
    let headers = HeadersResponse { response: Some(CommonResponse::default()) };
    let response = match request {
        Some(ProcRequest::ResponseHeaders(_)) => ProcResponse::ResponseHeaders(headers),
        Some(ProcRequest::RequestBody(_)) => ProcResponse::RequestBody(Default::default()),
        Some(ProcRequest::ResponseBody(_)) => ProcResponse::ResponseBody(Default::default()),
        Some(ProcRequest::RequestTrailers(_)) => ProcResponse::RequestTrailers(Default::default()),
        Some(ProcRequest::ResponseTrailers(_)) => ProcResponse::ResponseTrailers(Default::default()),
        Some(ProcRequest::RequestHeaders(_)) | None => ProcResponse::RequestHeaders(headers),
    };
    ProcessingResponse { response: Some(response), dynamic_metadata: metadata, ..Default::default() }
}

pub(crate) fn immediate_response(error: &AdmissionError) -> ProcessingResponse {
    let reply = error.to_reply();
    let mut set_headers = vec![header_option("content-type", "application/json")];
    set_headers.extend(reply.headers.iter().map(|(k, v)| header_option(k, v)));
    ProcessingResponse {
        response: Some(ProcResponse::ImmediateResponse(ImmediateResponse {
            status: Some(HttpStatus { code: i32::from(reply.status) }),
            headers: Some(HeaderMutation { set_headers, remove_headers: Vec::new() }),
            body: reply.body,
            grpc_status: None,
            details: ADMISSION_REPLY_DETAILS.to_owned(),
        })),
        ..Default::default()
    }
}

pub(crate) fn header_option(key: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: key.to_owned(),
            value: String::new(),
            raw_value: value.as_bytes().to_vec(),
        }),
        ..Default::default()
    }
}

/// `{"llm_gateway": {"admitted": true, "x-ratelimit-...": "...", "reserved_tokens": N,
/// "reserved_locally": B}}`,
/// and `"prompt_tokens": N` when the admission counted the prompt exactly (the access log's
/// record then prefers it to the filter's estimate).
pub(crate) fn admission_metadata(admitted: &Admitted, exact_prompt_tokens: Option<u64>) -> Struct {
    let mut fields: HashMap<String, Value> = admitted
        .ratelimit_headers
        .iter()
        .map(|(k, v)| (k.clone(), Value { kind: Some(Kind::StringValue(v.clone())) }))
        .collect();
    // The marker Envoy's RBAC guard requires of a request admitted here (envoy/filters/guard.yaml).
    fields.insert(MD_ADMITTED.to_owned(), Value { kind: Some(Kind::BoolValue(true)) });
    fields.insert(
        MD_RESERVED_TOKENS.to_owned(),
        Value { kind: Some(Kind::NumberValue(admitted.reserved_tokens as f64)) },
    );
    fields.insert(
        MD_RESERVED_LOCALLY.to_owned(),
        Value { kind: Some(Kind::BoolValue(admitted.reserved_locally)) },
    );
    if let Some(n) = exact_prompt_tokens {
        fields.insert(MD_PROMPT_TOKENS.to_owned(), Value { kind: Some(Kind::NumberValue(n as f64)) });
    }
    if let Some(warning) = &admitted.quota_warning {
        fields.insert(MD_QUOTA_WARNING.to_owned(), Value { kind: Some(Kind::StringValue(warning.clone())) });
    }
    let inner = Value { kind: Some(Kind::StructValue(Struct { fields })) };
    Struct { fields: HashMap::from([(METADATA_NAMESPACE.to_owned(), inner)]) }
}

/// Request headers carrying the exact count toward the metering filter and the upstream.
pub(crate) fn exact_count_headers(counted: &Counted) -> Vec<HeaderValueOption> {
    vec![
        header_option(H_PROMPT_TOKENS, &counted.prompt_tokens.to_string()),
        header_option(H_PROMPT_TOKENS_SOURCE, "exact"),
        header_option(H_MAX_TOKENS, &counted.max_tokens.to_string()),
    ]
}

/// Adds a pick to the admission's dynamic metadata: `envoy.lb: {x-gateway-destination-endpoint:
/// "ip:port[,ip:port...]"}` (the same value as the header, for Envoy's override-host policy),
/// and `llm_gateway.picked_endpoint: "ip:port"` (the pick, which the access log hands back).
pub(crate) fn add_pick(metadata: &mut Struct, pick: &Pick) {
    let text = |s: String| Value { kind: Some(Kind::StringValue(s)) };
    if let Some(Value { kind: Some(Kind::StructValue(inner)) }) = metadata.fields.get_mut(METADATA_NAMESPACE)
    {
        inner.fields.insert(MD_PICKED_ENDPOINT.to_owned(), text(pick.primary().to_owned()));
    }
    let lb = Struct { fields: HashMap::from([(MD_DESTINATION_ENDPOINT.to_owned(), text(pick.value()))]) };
    metadata.fields.insert(MD_NAMESPACE_LB.to_owned(), Value { kind: Some(Kind::StructValue(lb)) });
}

/// Adds `llm_gateway.queue_wait_ms` (the route's `x-gateway-queue-wait-ms` response header).
pub(crate) fn add_queue_wait(metadata: &mut Struct, waited: Duration) {
    if let Some(Value { kind: Some(Kind::StructValue(inner)) }) = metadata.fields.get_mut(METADATA_NAMESPACE)
    {
        let ms = u64::try_from(waited.as_millis()).unwrap_or(u64::MAX);
        inner
            .fields
            .insert(MD_QUEUE_WAIT_MS.to_owned(), Value { kind: Some(Kind::StringValue(ms.to_string())) });
    }
}

pub(crate) fn proto_duration(d: Duration) -> envoy_types::pb::google::protobuf::Duration {
    envoy_types::pb::google::protobuf::Duration {
        seconds: i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        nanos: i32::try_from(d.subsec_nanos()).unwrap_or(0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::facts::{picked_endpoint, queue_wait, reservation, subset_hint};
    use envoy_types::pb::envoy::config::core::v3::Metadata;
    use gateway_contract::{MD_DESTINATION_ENDPOINT_SUBSET, MD_NAMESPACE_SUBSET_HINT};

    fn headers(pairs: &[(&str, &str)]) -> HttpHeaders {
        HttpHeaders {
            headers: Some(HeaderMap {
                headers: pairs
                    .iter()
                    .map(|(k, v)| HeaderValue {
                        key: (*k).into(),
                        value: String::new(),
                        raw_value: v.as_bytes().to_vec(),
                    })
                    .collect(),
            }),
            ..Default::default()
        }
    }

    /// Request headers a forger sends, and a request-headers message with the filter's facts
    /// (when given) in its attributes, as Envoy's ext_proc filter sends them.
    fn message(facts: Option<&str>) -> (ProcessingRequest, HttpHeaders) {
        let h = headers(&[
            ("x-gateway-tenant", "forged"),
            ("x-gateway-prompt-tokens", "12"),
            ("x-gateway-max-tokens", "30"),
            ("x-gateway-context-check", "exact"),
            ("x-request-id", "abc"),
        ]);
        let mut m = ProcessingRequest::default();
        if let Some(facts) = facts {
            let value = Value { kind: Some(Kind::StringValue(facts.to_owned())) };
            let fields = HashMap::from([(ATTRIBUTE_REQUEST.to_owned(), value)]);
            m.attributes.insert(ATTRIBUTES_FILTER_NAME.to_owned(), Struct { fields });
        }
        (m, h)
    }

    #[test]
    fn facts_come_from_the_filter_state_not_the_headers() {
        let facts = r#"{"v":1,"tenant":"acme","tier":"t","model":"m","pool":"p","prompt_tokens":5,"max_tokens":7,"context_model":"base"}"#;
        let (m, h) = message(Some(facts));
        let (f, context_model) = request_facts(FactsSource::FilterState, &m, &h);
        assert_eq!(f.tenant.as_deref(), Some("acme"));
        assert_eq!(f.reserve_tokens(), 12);
        assert_eq!(f.request_id, "abc", "Envoy's request id, from the headers");
        assert_eq!(context_model.as_deref(), Some("base"));
        // No facts: the headers count for nothing.
        let (m, h) = message(None);
        let (f, context_model) = request_facts(FactsSource::FilterState, &m, &h);
        assert_eq!((f.tenant.clone(), f.reserve_tokens(), context_model), (None, 0, None));
    }

    #[test]
    fn envoy_gateway_reads_the_headers_and_never_a_lease() {
        let (m, mut h) = message(None);
        if let Some(map) = h.headers.as_mut() {
            map.headers.push(HeaderValue {
                key: "x-gateway-admission".into(),
                value: String::new(),
                raw_value: b"lease".to_vec(),
            });
        }
        let (f, context_model) = request_facts(FactsSource::Headers, &m, &h);
        assert_eq!(f.tenant.as_deref(), Some("forged"));
        assert_eq!((f.reserve_tokens(), f.leased_tokens), (42, None));
        assert_eq!(context_model.as_deref(), Some(""), "exact check asked, model from the headers");
    }

    #[test]
    fn the_record_id_comes_from_the_facts_request_id_and_nonce() {
        // The filter state's request id (as the filter saw it) wins over the header's.
        let facts = r#"{"v":1,"tenant":"acme","tier":"t","model":"m","pool":"p","prompt_tokens":5,"max_tokens":7,"request_id":"seen","nonce":"0123456789abcdef"}"#;
        let (m, h) = message(Some(facts));
        let (f, _) = request_facts(FactsSource::FilterState, &m, &h);
        assert_eq!(f.request_id, "seen");
        assert_eq!(f.record_id().as_deref(), Some("seen.0123456789abcdef"));
        // Facts of an older filter: the header's request id, and no record id of the request.
        let (m, h) = message(Some(
            r#"{"v":1,"tenant":"acme","tier":"t","model":"m","pool":"p","prompt_tokens":5,"max_tokens":7}"#,
        ));
        let (f, _) = request_facts(FactsSource::FilterState, &m, &h);
        assert_eq!((f.request_id.as_str(), f.record_id()), ("abc", None));
        // From the headers (request_facts: headers): the filter's nonce header.
        let (m, mut h) = message(None);
        if let Some(map) = h.headers.as_mut() {
            map.headers.push(HeaderValue {
                key: H_REQUEST_NONCE.into(),
                value: String::new(),
                raw_value: b"fedcba9876543210".to_vec(),
            });
        }
        let (f, _) = request_facts(FactsSource::Headers, &m, &h);
        assert_eq!(f.record_id().as_deref(), Some("abc.fedcba9876543210"));
    }

    #[test]
    fn metadata_round_trip() {
        let s = admission_metadata(
            &Admitted {
                ratelimit_headers: vec![],
                reserved_tokens: 77,
                reserved_locally: true,
                tracked_at_ms: None,
                quota: (0, 0),
                quota_warning: None,
            },
            None,
        );
        let m = Metadata {
            filter_metadata: s
                .fields
                .into_iter()
                .filter_map(|(k, v)| match v.kind {
                    Some(Kind::StructValue(s)) => Some((k, s)),
                    _ => None,
                })
                .collect(),
            ..Default::default()
        };
        let admitted = m.filter_metadata[METADATA_NAMESPACE].fields.get(MD_ADMITTED);
        assert!(matches!(admitted.and_then(|v| v.kind.as_ref()), Some(Kind::BoolValue(true))));
        assert_eq!(reservation(Some(&m)), (77, true));
        assert_eq!(reservation(None), (0, false));
    }

    fn metadata_of(namespace: &str, key: &str, value: Kind) -> Metadata {
        let fields = HashMap::from([(key.to_owned(), Value { kind: Some(value) })]);
        Metadata {
            filter_metadata: HashMap::from([(namespace.to_owned(), Struct { fields })]),
            ..Default::default()
        }
    }

    #[test]
    fn the_subset_hint_is_read_from_the_metadata_context() {
        use envoy_types::pb::google::protobuf::ListValue;
        let list = |items: &[&str]| {
            Kind::ListValue(ListValue {
                values: items
                    .iter()
                    .map(|s| Value { kind: Some(Kind::StringValue((*s).to_owned())) })
                    .collect(),
            })
        };
        let hint = |kind| {
            subset_hint(Some(&metadata_of(MD_NAMESPACE_SUBSET_HINT, MD_DESTINATION_ENDPOINT_SUBSET, kind)))
        };
        let a: std::net::SocketAddr = "10.0.0.1:8000".parse().unwrap();
        let b: std::net::SocketAddr = "[::1]:9".parse().unwrap();
        assert_eq!(hint(list(&["10.0.0.1:8000", "[::1]:9", "vllm:1"])), Some(vec![a, b]), "names dropped");
        assert_eq!(hint(Kind::StringValue("10.0.0.1:8000, [::1]:9".into())), Some(vec![a, b]));
        assert_eq!(hint(list(&[])), Some(vec![]), "present and empty: nothing eligible");
        assert_eq!(hint(Kind::NumberValue(1.0)), Some(vec![]));
        assert_eq!(subset_hint(None), None);
        let other_key = metadata_of(MD_NAMESPACE_SUBSET_HINT, "other", list(&["10.0.0.1:8000"]));
        assert_eq!(subset_hint(Some(&other_key)), None);
    }

    #[test]
    fn a_pick_goes_in_both_namespaces_and_comes_back_from_the_access_log() {
        let mut s = admission_metadata(
            &Admitted {
                ratelimit_headers: vec![],
                reserved_tokens: 1,
                reserved_locally: false,
                tracked_at_ms: None,
                quota: (0, 0),
                quota_warning: None,
            },
            None,
        );
        let pick = Pick {
            endpoints: vec!["10.0.0.1:1".into(), "10.0.0.2:1".into()],
            prefix_blocks: 0,
            request_blocks: 0,
            affinity: false,
            predicted: false,
            home: false,
            slot: false,
        };
        add_pick(&mut s, &pick);
        add_queue_wait(&mut s, Duration::from_millis(1_250));
        let m = Metadata {
            filter_metadata: s
                .fields
                .into_iter()
                .filter_map(|(k, v)| match v.kind {
                    Some(Kind::StructValue(s)) => Some((k, s)),
                    _ => None,
                })
                .collect(),
            ..Default::default()
        };
        let lb = m.filter_metadata[MD_NAMESPACE_LB].fields.get(MD_DESTINATION_ENDPOINT);
        assert!(
            matches!(lb.and_then(|v| v.kind.as_ref()), Some(Kind::StringValue(v)) if v == "10.0.0.1:1,10.0.0.2:1")
        );
        assert_eq!(picked_endpoint(Some(&m)).as_deref(), Some("10.0.0.1:1"));
        assert_eq!(reservation(Some(&m)), (1, false), "the admission's metadata is kept");
        assert_eq!(picked_endpoint(None), None);
        // The wait the access log takes off the TTFT the picker's model learns.
        assert_eq!(queue_wait(Some(&m)), Duration::from_millis(1_250));
        assert_eq!(queue_wait(None), Duration::ZERO);
    }

    #[test]
    fn immediate_response_sets_status_and_headers() {
        let r = immediate_response(&AdmissionError::LimiterUnavailable);
        let Some(ProcResponse::ImmediateResponse(i)) = r.response else { panic!() };
        assert_eq!(i.status.unwrap().code, 503);
        assert!(i
            .headers
            .unwrap()
            .set_headers
            .iter()
            .any(|h| h.header.as_ref().unwrap().key == "retry-after"));
    }
}
