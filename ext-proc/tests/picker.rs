//! The endpoint picker through the sidecar's real ext_proc service (in process, with a real
//! `redis-server` and stand-in vLLM `/metrics` endpoints on loopback): the CONTINUE of an
//! admitted request of a picking pool carries the `x-gateway-destination-endpoint` header
//! mutation and the same value in the `envoy.lb` metadata; prefix hashes in the facts keep a
//! conversation on its endpoint; the subset hint restricts the pick; an empty subset, or one
//! whose endpoints are not eligible, gets a 503 and the admission given back; a pool without a
//! picker gets no pick. Needs `redis-server` on the PATH (`make setup`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

mod common;

use common::{free_port, Redis, DEADLINE};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::config::core::v3::header_value_option::HeaderAppendAction;
use envoy_types::pb::envoy::config::core::v3::Metadata;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as ProcRequest;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as ProcResponse;
use envoy_types::pb::envoy::service::ext_proc::v3::{HttpHeaders, ProcessingRequest, ProcessingResponse};
use envoy_types::pb::google::protobuf::{value::Kind, ListValue, Struct, Value};
use gateway_contract::{
    encode_prefix_hashes, RequestFacts, ATTRIBUTES_FILTER_NAME, ATTRIBUTE_REQUEST, FACTS_VERSION,
    H_DESTINATION_ENDPOINT, MD_ADMITTED, MD_DESTINATION_ENDPOINT, MD_DESTINATION_ENDPOINT_SUBSET,
    MD_NAMESPACE_LB, MD_NAMESPACE_SUBSET_HINT, MD_PICKED_ENDPOINT, METADATA_NAMESPACE,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A stand-in vLLM endpoint answering `/metrics` with `waiting` queued requests.
async fn fake_vllm(waiting: u32) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut conn, _)) = listener.accept().await else { return };
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 1024];
                while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                    match conn.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
                let body = format!(
                    "vllm:num_requests_waiting {waiting}\nvllm:num_requests_running 1\nvllm:kv_cache_usage_perc 0.1\n"
                );
                let response = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = conn.write_all(response.as_bytes()).await;
            });
        }
    });
    addr
}

/// One admission round trip: the request headers of a request with the filter's facts for
/// `tenant` and `pool` (and prefix `hashes`), and the subset hint when given.
async fn admit(
    client: &mut ExternalProcessorClient<tonic::transport::Channel>,
    tenant: &str,
    pool: &str,
    hashes: &[u64],
    subset: Option<&[String]>,
) -> ProcessingResponse {
    let facts = RequestFacts {
        v: FACTS_VERSION,
        tenant: tenant.into(),
        tier: "standard".into(),
        model: "m".into(),
        pool: pool.into(),
        prompt_tokens: 10,
        max_tokens: 10,
        prefix_hashes: (!hashes.is_empty()).then(|| encode_prefix_hashes(hashes)),
        ..Default::default()
    };
    let json = String::from_utf8(facts.to_json().unwrap()).unwrap();
    let mut message = ProcessingRequest {
        request: Some(ProcRequest::RequestHeaders(HttpHeaders::default())),
        ..Default::default()
    };
    let fields =
        HashMap::from([(ATTRIBUTE_REQUEST.to_owned(), Value { kind: Some(Kind::StringValue(json)) })]);
    message.attributes.insert(ATTRIBUTES_FILTER_NAME.to_owned(), Struct { fields });
    if let Some(subset) = subset {
        let values = subset.iter().map(|s| Value { kind: Some(Kind::StringValue(s.clone())) }).collect();
        let fields = HashMap::from([(
            MD_DESTINATION_ENDPOINT_SUBSET.to_owned(),
            Value { kind: Some(Kind::ListValue(ListValue { values })) },
        )]);
        message.metadata_context = Some(Metadata {
            filter_metadata: HashMap::from([(MD_NAMESPACE_SUBSET_HINT.to_owned(), Struct { fields })]),
            ..Default::default()
        });
    }
    let mut request = tonic::Request::new(tokio_stream::iter(vec![message]));
    request.metadata_mut().insert("x-gateway-ext-proc-role", "admission".parse().unwrap());
    let mut responses = client.process(request).await.unwrap().into_inner();
    responses.message().await.unwrap().expect("one response")
}

/// The `x-gateway-destination-endpoint` header a CONTINUE sets (None: none, or not a CONTINUE).
fn destination_header(r: &ProcessingResponse) -> Option<String> {
    let Some(ProcResponse::RequestHeaders(h)) = &r.response else { return None };
    let mutation = h.response.as_ref()?.header_mutation.as_ref()?;
    mutation
        .set_headers
        .iter()
        .find(|o| o.header.as_ref().is_some_and(|h| h.key == H_DESTINATION_ENDPOINT))
        .map(|o| {
            assert_eq!(o.append_action, HeaderAppendAction::OverwriteIfExistsOrAdd as i32, "replaces");
            String::from_utf8(o.header.as_ref().unwrap().raw_value.clone()).unwrap()
        })
}

/// A string or bool field of a dynamic-metadata namespace.
fn metadata_field(r: &ProcessingResponse, namespace: &str, key: &str) -> Option<Kind> {
    let Some(Kind::StructValue(inner)) = r.dynamic_metadata.as_ref()?.fields.get(namespace)?.kind.clone()
    else {
        return None;
    };
    inner.fields.get(key)?.kind.clone()
}

fn immediate_status(r: &ProcessingResponse) -> Option<(i32, serde_json::Value)> {
    let Some(ProcResponse::ImmediateResponse(i)) = &r.response else { return None };
    Some((i.status.as_ref()?.code, serde_json::from_slice(&i.body).unwrap()))
}

/// The sidecar's Prometheus text.
async fn scrape_metrics(port: u16) -> String {
    let mut conn = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    conn.write_all(b"GET /metrics HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").await.unwrap();
    let mut text = String::new();
    conn.read_to_string(&mut text).await.unwrap();
    text
}

/// One access-log entry, as Envoy's gRPC access log sends it, of an admitted request of tenant
/// `free` picked for `endpoint`.
async fn send_access_log(listen: u16, endpoint: &str) {
    use envoy_types::pb::envoy::data::accesslog::v3::{AccessLogCommon, HttpAccessLogEntry};
    use envoy_types::pb::envoy::service::accesslog::v3::access_log_service_client::AccessLogServiceClient;
    use envoy_types::pb::envoy::service::accesslog::v3::stream_access_logs_message::{
        HttpAccessLogEntries, LogEntries,
    };
    use envoy_types::pb::envoy::service::accesslog::v3::StreamAccessLogsMessage;
    use envoy_types::pb::google::protobuf::Any;
    use prost::Message;
    let facts = r#"{"v":1,"tenant":"free","tier":"standard","model":"m","pool":"picked","prompt_tokens":10,"max_tokens":10}"#;
    let any = Any {
        type_url: "type.googleapis.com/google.protobuf.BytesValue".into(),
        value: facts.as_bytes().to_vec().encode_to_vec(),
    };
    let fields = HashMap::from([
        (gateway_contract::MD_RESERVED_TOKENS.to_owned(), Value { kind: Some(Kind::NumberValue(20.0)) }),
        (MD_PICKED_ENDPOINT.to_owned(), Value { kind: Some(Kind::StringValue(endpoint.to_owned())) }),
    ]);
    let entry = HttpAccessLogEntry {
        common_properties: Some(AccessLogCommon {
            filter_state_objects: HashMap::from([(gateway_contract::FS_REQUEST.to_owned(), any)]),
            metadata: Some(Metadata {
                filter_metadata: HashMap::from([(METADATA_NAMESPACE.to_owned(), Struct { fields })]),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    };
    let message = StreamAccessLogsMessage {
        log_entries: Some(LogEntries::HttpLogs(HttpAccessLogEntries { log_entry: vec![entry] })),
        ..Default::default()
    };
    let mut client = AccessLogServiceClient::connect(format!("http://127.0.0.1:{listen}")).await.unwrap();
    client.stream_access_logs(tokio_stream::iter(vec![message])).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_continue_carries_the_pick_and_the_subset_hint_restricts_it() {
    let redis = Redis::start();
    let a = fake_vllm(0).await;
    let b = fake_vllm(0).await;
    let c = fake_vllm(0).await;
    // An endpoint that never answers its scrape: never eligible.
    let dead: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let listen = free_port();
    let metrics_port = free_port();
    let yaml = format!(
        "listen: 127.0.0.1:{listen}
metrics_listen: 127.0.0.1:{metrics_port}
redis: {{url: 'redis://127.0.0.1:{}'}}
tenants:
  - {{id: free, limits: {{}}}}
  - {{id: tight, limits: {{requests_per_minute: 1}}}}
pools:
  - name: picked
    endpoints: ['http://{a}', 'http://{b}', 'http://{c}', 'http://{dead}']
    scrape_interval_ms: 100
    picker: {{fallback_endpoints: 1, stale_after_ms: 5000}}
  - {{name: plain, endpoints: ['http://{a}'], max_in_flight: 100}}
",
        redis.1
    );
    let config = gateway_ext_proc::config::Config::from_yaml(&yaml).unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(gateway_ext_proc::run(config, async {
        let _ = stopped.await;
    }));
    let start = Instant::now();
    let mut client = loop {
        match ExternalProcessorClient::connect(format!("http://127.0.0.1:{listen}")).await {
            Ok(c) => break c,
            Err(e) => assert!(start.elapsed() < DEADLINE, "sidecar not listening: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };

    // Until its first scrape an endpoint is not eligible: a subset of the last one scraped (c)
    // is answered 503 until then, and picked from then on (a and b are scraped before it).
    let only_c = [c.to_string()];
    loop {
        let r = admit(&mut client, "free", "picked", &[], Some(&only_c)).await;
        if let Some(value) = destination_header(&r) {
            assert_eq!(value, c.to_string());
            break;
        }
        assert_eq!(immediate_status(&r).map(|(s, _)| s), Some(503), "{r:?}");
        assert!(start.elapsed() < DEADLINE, "no pick: {r:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let r = admit(&mut client, "free", "picked", &[], None).await;
    let value = destination_header(&r).unwrap_or_else(|| panic!("no pick: {r:?}"));
    let live = [a.to_string(), b.to_string(), c.to_string()];
    let listed: Vec<&str> = value.split(',').collect();
    assert_eq!(listed.len(), 2, "the pick and one fallback: {value}");
    assert!(listed.iter().all(|e| live.contains(&e.to_string())), "{value}: never the dead endpoint");
    assert_ne!(listed[0], listed[1]);
    assert_eq!(
        metadata_field(&r, MD_NAMESPACE_LB, MD_DESTINATION_ENDPOINT),
        Some(Kind::StringValue(value.clone())),
        "the same value in envoy.lb"
    );
    assert_eq!(metadata_field(&r, METADATA_NAMESPACE, MD_ADMITTED), Some(Kind::BoolValue(true)));
    assert_eq!(
        metadata_field(&r, METADATA_NAMESPACE, MD_PICKED_ENDPOINT),
        Some(Kind::StringValue(listed[0].to_owned()))
    );

    // A conversation's prefix keeps it on its endpoint; another prompt goes elsewhere.
    let conversation = admit(&mut client, "free", "picked", &[1, 2, 3], None).await;
    let home = destination_header(&conversation).unwrap();
    let home = home.split(',').next().unwrap().to_owned();
    for turn in 0..3u64 {
        let r = admit(&mut client, "free", "picked", &[1, 2, 3, 10 + turn], None).await;
        assert_eq!(destination_header(&r).unwrap().split(',').next(), Some(home.as_str()), "turn {turn}");
    }
    let other = admit(&mut client, "free", "picked", &[7, 8, 9], None).await;
    assert_ne!(destination_header(&other).unwrap().split(',').next(), Some(home.as_str()));

    // The subset hint: only its endpoints, not even as fallbacks.
    for _ in 0..3 {
        let r = admit(&mut client, "free", "picked", &[1, 2, 3], Some(&only_c)).await;
        assert_eq!(destination_header(&r), Some(c.to_string()));
    }
    // A subset of endpoints that are not eligible, or an empty one: 503.
    for subset in [vec![dead.to_string()], vec!["10.9.9.9:1".to_owned()], vec![]] {
        let r = admit(&mut client, "free", "picked", &[], Some(&subset)).await;
        let (status, body) = immediate_status(&r).unwrap_or_else(|| panic!("{subset:?}: {r:?}"));
        assert_eq!(status, 503, "{subset:?}");
        assert_eq!(body["error"]["code"], "no_eligible_endpoint");
    }
    // The 503 gives the admission back: the tight tenant (1 request a minute) is admitted after.
    let r = admit(&mut client, "tight", "picked", &[], Some(&[])).await;
    assert_eq!(immediate_status(&r).map(|(s, _)| s), Some(503));
    loop {
        let r = admit(&mut client, "tight", "picked", &[], None).await;
        if destination_header(&r).is_some() {
            break;
        }
        assert!(start.elapsed() < DEADLINE, "the 503's request was not given back: {r:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // A pool without a picker: admitted, no pick.
    let r = admit(&mut client, "free", "plain", &[1, 2, 3], None).await;
    assert_eq!(metadata_field(&r, METADATA_NAMESPACE, MD_ADMITTED), Some(Kind::BoolValue(true)));
    assert_eq!(destination_header(&r), None);
    assert_eq!(metadata_field(&r, MD_NAMESPACE_LB, MD_DESTINATION_ENDPOINT), None);

    // The access log's entry of a picked request takes it off its endpoint's in-flight count.
    let r = admit(&mut client, "free", "picked", &[], None).await;
    let endpoint = destination_header(&r).unwrap().split(',').next().unwrap().to_owned();
    let gauge = |text: &str| {
        let prefix =
            format!("llm_gateway_picker_in_flight_requests{{pool=\"picked\",endpoint=\"{endpoint}\"}} ");
        text.lines().find_map(|l| l.strip_prefix(&prefix)).map(|v| v.trim().parse::<i64>().unwrap())
    };
    let before = gauge(&scrape_metrics(metrics_port).await).expect("the gauge of the pick");
    assert!(before >= 1);
    send_access_log(listen, &endpoint).await;
    loop {
        let now = gauge(&scrape_metrics(metrics_port).await).unwrap();
        if now < before {
            break;
        }
        assert!(start.elapsed() < DEADLINE, "in flight still {now} after the access log");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let _ = stop.send(());
    let _ = tokio::time::timeout(Duration::from_secs(15), server).await;
}
