//! The usage ledger through the sidecar's real services (in process, with a real `redis-server`
//! on loopback), as Envoy drives them: ext_proc admissions with the wasm filter's facts, then
//! gRPC access-log entries (issue 14, items 2 and 3).
//!
//! - The same entries delivered twice, on two streams, and again to a restarted sidecar, give
//!   one record and one settlement each: the usage hash counts each request once, the stream
//!   holds one event per request, and the TPM bucket ends where one settlement per request puts
//!   it (its refill is 1 token a minute, so nothing hides a second one).
//! - Reservations whose usage never arrives are charged once, by either of two sidecars sweeping
//!   the same Redis: one `reservation` record each; usage arriving after the charge is not
//!   applied; an admission whose answer Envoy never received is released, never charged.
//!
//! - A key with limits of its own draws on its buckets on top of its tenant's, and is settled
//!   there; its usage events and metrics carry its name (never a key).
//!
//! Needs `redis-server` on the PATH (`make setup`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

mod common;

use common::{free_port, Redis, DEADLINE};
use std::collections::HashMap;
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::config::core::v3::Metadata;
use envoy_types::pb::envoy::data::accesslog::v3::{
    AccessLogCommon, HttpAccessLogEntry, HttpRequestProperties, HttpResponseProperties,
};
use envoy_types::pb::envoy::service::accesslog::v3::access_log_service_client::AccessLogServiceClient;
use envoy_types::pb::envoy::service::accesslog::v3::stream_access_logs_message::{
    HttpAccessLogEntries, LogEntries,
};
use envoy_types::pb::envoy::service::accesslog::v3::StreamAccessLogsMessage;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as ProcRequest;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as ProcResponse;
use envoy_types::pb::envoy::service::ext_proc::v3::{HttpHeaders, ProcessingRequest, ProcessingResponse};
use envoy_types::pb::google::protobuf::{value::Kind, Any, Struct, UInt32Value, Value};
use gateway_contract::{
    RequestFacts, ATTRIBUTES_FILTER_NAME, ATTRIBUTE_REQUEST, FACTS_VERSION, FS_REQUEST, FS_USAGE,
    MD_ADMITTED, MD_RESERVED_TOKENS, METADATA_NAMESPACE,
};
use gateway_ext_proc::proto::UsageEvent;
use prost::Message;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Tokens the facts reserve (prompt 10 + max tokens 20) and the usage reports (10 + 5).
/// The two tests start sidecars on ports `free_port` found free a moment before: run one at a time,
/// so that neither binds (or connects to) a port the other just found or let go.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const RESERVED: u64 = 30;
const USED: u64 = 15;
/// The TPM bucket's size; it refills 1 token a minute.
const TOKEN_BURST: u64 = 100_000;

/// The TPM bucket of tenant `keyed`'s key `ci` (refills 1 token a minute).
const KEY_TOKEN_BURST: u64 = 1_000;

/// A sidecar running in this process, stopped (gracefully) when `stop` is called.
struct Sidecar {
    listen: u16,
    metrics: u16,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    server: tokio::task::JoinHandle<Result<(), gateway_ext_proc::RunError>>,
}

impl Sidecar {
    /// Tenants `acme` and `lost` (RPM and TPM buckets that refill 1 a minute), reservations
    /// charged after `record_after_ms`, swept every 100 ms.
    async fn start(redis: &Redis, record_after_ms: u64) -> Self {
        let listen = free_port();
        let metrics = free_port();
        let limits = format!(
            "{{requests_per_minute: 1, request_burst: 1000, tokens_per_minute: 1, token_burst: {TOKEN_BURST}}}"
        );
        let yaml = format!(
            "listen: 127.0.0.1:{listen}
metrics_listen: 127.0.0.1:{metrics}
shutdown_grace_ms: 100
redis: {{url: 'redis://127.0.0.1:{}'}}
tenants:
  - {{id: acme, limits: {limits}}}
  - {{id: lost, limits: {limits}}}
  - {{id: free, limits: {{}}}}
  - {{id: keyed, limits: {{}}, api_keys: [{{name: ci, limits: {{requests_per_minute: 1, request_burst: 2, tokens_per_minute: 1, token_burst: {KEY_TOKEN_BURST}}}}}]}}
metering: {{reservations: {{record_after_ms: {record_after_ms}, sweep_interval_ms: 100}}}}
",
            redis.1
        );
        let config = gateway_ext_proc::config::Config::from_yaml(&yaml).unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(gateway_ext_proc::run(config, async {
            let _ = stopped.await;
        }));
        let start = Instant::now();
        while tokio::net::TcpStream::connect(("127.0.0.1", listen)).await.is_err() {
            assert!(start.elapsed() < DEADLINE, "sidecar not listening on {listen}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Sidecar { listen, metrics, stop: Some(stop), server }
    }

    async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let _ = tokio::time::timeout(Duration::from_secs(15), &mut self.server).await;
    }

    /// A metric's value (its sample without labels), 0 when absent.
    async fn metric(&self, name: &str) -> f64 {
        let mut conn = tokio::net::TcpStream::connect(("127.0.0.1", self.metrics)).await.unwrap();
        conn.write_all(b"GET /metrics HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").await.unwrap();
        let mut text = String::new();
        conn.read_to_string(&mut text).await.unwrap();
        text.lines()
            .find_map(|l| l.strip_prefix(name).and_then(|rest| rest.strip_prefix(' ')))
            .map_or(0.0, |v| v.trim().parse().unwrap())
    }
}

/// The filter's facts of request `i` of `tenant`, as the filter state holds them.
fn facts(tenant: &str, i: u64) -> RequestFacts {
    RequestFacts {
        v: FACTS_VERSION,
        tenant: tenant.into(),
        tier: "standard".into(),
        model: "m".into(),
        pool: "p".into(),
        prompt_tokens: 10,
        max_tokens: 20,
        request_id: Some(format!("{tenant}-request-{i}")),
        nonce: Some(format!("{:016x}", 0xfeed_0000_u64 + i)),
        ..Default::default()
    }
}

/// One admission round trip with `facts`; the response.
async fn admit(listen: u16, facts: &RequestFacts) -> ProcessingResponse {
    let mut client = ExternalProcessorClient::connect(format!("http://127.0.0.1:{listen}")).await.unwrap();
    let json = String::from_utf8(facts.to_json().unwrap()).unwrap();
    let mut message = ProcessingRequest {
        request: Some(ProcRequest::RequestHeaders(HttpHeaders::default())),
        ..Default::default()
    };
    let fields =
        HashMap::from([(ATTRIBUTE_REQUEST.to_owned(), Value { kind: Some(Kind::StringValue(json)) })]);
    message.attributes.insert(ATTRIBUTES_FILTER_NAME.to_owned(), Struct { fields });
    let mut request = tonic::Request::new(tokio_stream::iter(vec![message]));
    request.metadata_mut().insert("x-gateway-ext-proc-role", "admission".parse().unwrap());
    let mut responses = client.process(request).await.unwrap().into_inner();
    responses.message().await.unwrap().expect("one response")
}

fn admitted(r: &ProcessingResponse) -> bool {
    let Some(ProcResponse::RequestHeaders(_)) = &r.response else { return false };
    let Some(Kind::StructValue(inner)) = r
        .dynamic_metadata
        .as_ref()
        .and_then(|m| m.fields.get(METADATA_NAMESPACE))
        .and_then(|v| v.kind.clone())
    else {
        return false;
    };
    matches!(inner.fields.get(MD_ADMITTED).and_then(|v| v.kind.clone()), Some(Kind::BoolValue(true)))
}

fn bytes_value(bytes: &[u8]) -> Any {
    Any {
        type_url: "type.googleapis.com/google.protobuf.BytesValue".into(),
        value: bytes.to_vec().encode_to_vec(),
    }
}

/// The access-log entry Envoy sends for a request with `facts`: admitted (the admission's
/// reservation in its metadata) with the filter's usage and status 200, or, when not
/// `admitted`, ended with `status` and no admission metadata. Started a second ago (Envoy's
/// start time of the stream dates the record, the same in every delivery of the entry).
fn entry(facts: &RequestFacts, admitted: bool, status: u32) -> HttpAccessLogEntry {
    let started = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() - 1;
    let mut states = HashMap::from([(FS_REQUEST.to_owned(), bytes_value(&facts.to_json().unwrap()))]);
    let mut fields = HashMap::new();
    if admitted {
        let usage = format!(
            r#"{{"v":1,"status":200,"prompt_tokens":10,"completion_tokens":{},"cached_tokens":0,"ttft_us":5,"tpot_us":1,"duration_us":9,"end_reason":"completed","usage_source":"upstream"}}"#,
            USED - 10
        );
        states.insert(FS_USAGE.to_owned(), bytes_value(usage.as_bytes()));
        fields
            .insert(MD_RESERVED_TOKENS.to_owned(), Value { kind: Some(Kind::NumberValue(RESERVED as f64)) });
    }
    HttpAccessLogEntry {
        common_properties: Some(AccessLogCommon {
            filter_state_objects: states,
            metadata: Some(Metadata {
                filter_metadata: HashMap::from([(METADATA_NAMESPACE.to_owned(), Struct { fields })]),
                ..Default::default()
            }),
            start_time: Some(envoy_types::pb::google::protobuf::Timestamp {
                seconds: i64::try_from(started).unwrap(),
                nanos: 0,
            }),
            ..Default::default()
        }),
        request: Some(HttpRequestProperties {
            request_id: facts.request_id.clone().unwrap_or_default(),
            ..Default::default()
        }),
        response: Some(HttpResponseProperties {
            response_code: Some(UInt32Value { value: status }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Sends `entries` on one access-log stream, in messages of at most 3 (Envoy batches per worker).
async fn deliver(listen: u16, entries: &[HttpAccessLogEntry]) {
    let messages: Vec<_> = entries
        .chunks(3)
        .map(|chunk| StreamAccessLogsMessage {
            log_entries: Some(LogEntries::HttpLogs(HttpAccessLogEntries { log_entry: chunk.to_vec() })),
            ..Default::default()
        })
        .collect();
    let mut client = AccessLogServiceClient::connect(format!("http://127.0.0.1:{listen}")).await.unwrap();
    client.stream_access_logs(tokio_stream::iter(messages)).await.unwrap();
}

/// The tenant's usage hashes, summed over their days.
async fn usage(conn: &mut redis::aio::MultiplexedConnection, tenant: &str) -> HashMap<String, i64> {
    let keys: Vec<String> =
        redis::cmd("KEYS").arg(format!("llmgw:usage:{{{tenant}}}:*")).query_async(conn).await.unwrap();
    let mut sum = HashMap::new();
    for key in keys {
        let h: HashMap<String, i64> = redis::cmd("HGETALL").arg(&key).query_async(conn).await.unwrap();
        for (k, v) in h {
            *sum.entry(k).or_insert(0) += v;
        }
    }
    sum
}

/// The decoded usage events of `tenant`, every stream entry (duplicates included).
async fn events(conn: &mut redis::aio::MultiplexedConnection, tenant: &str) -> Vec<UsageEvent> {
    let reply: redis::streams::StreamRangeReply =
        redis::cmd("XRANGE").arg("llmgw:usage-events").arg("-").arg("+").query_async(conn).await.unwrap();
    reply
        .ids
        .iter()
        .filter_map(|id| match id.map.get("event") {
            Some(redis::Value::BulkString(b)) => Some(UsageEvent::decode(b.as_slice()).unwrap()),
            _ => None,
        })
        .filter(|e| e.tenant == tenant)
        .collect()
}

/// A bucket's level (tokens, floored).
async fn level(conn: &mut redis::aio::MultiplexedConnection, key: &str) -> u64 {
    let t: Option<String> = redis::cmd("HGET").arg(key).arg("t").query_async(conn).await.unwrap();
    t.map_or(u64::MAX, |t| t.parse::<f64>().unwrap().floor() as u64)
}

async fn open_reservations(conn: &mut redis::aio::MultiplexedConnection, tenant: &str) -> u64 {
    redis::cmd("HLEN").arg(format!("llmgw:reservations:{{{tenant}}}")).query_async(conn).await.unwrap()
}

/// Polls `check` until it holds, or panics with `what` at the deadline.
async fn eventually<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    while !check().await {
        assert!(start.elapsed() < DEADLINE, "{what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_entries_delivered_twice_and_replayed_after_a_restart_record_once() {
    let _one = ONE_AT_A_TIME.lock().await;
    const N: u64 = 7;
    let redis = Redis::start();
    let mut conn = redis.conn().await;
    // Nothing is charged during this test: reservations would be after a minute.
    let sidecar = Sidecar::start(&redis, 60_000).await;
    let all: Vec<_> = (0..N).map(|i| facts("acme", i)).collect();
    for f in &all {
        assert!(admitted(&admit(sidecar.listen, f).await), "request {:?} admitted", f.request_id);
    }
    // Each admission's reservation is open in the ledger, taken from the TPM bucket.
    assert_eq!(open_reservations(&mut conn, "acme").await, N);
    assert_eq!(level(&mut conn, "llmgw:rl:{acme}:tpm").await, TOKEN_BURST - N * RESERVED);

    let entries: Vec<_> = all.iter().map(|f| entry(f, true, 200)).collect();
    deliver(sidecar.listen, &entries).await;
    eventually("the first delivery recorded", || async {
        sidecar.metric("llm_gateway_usage_records_written_total").await == N as f64
    })
    .await;
    // The same entries again, on another stream (Envoy's retry after a reconnect, a second sink).
    deliver(sidecar.listen, &entries).await;
    eventually("the second delivery seen as duplicates", || async {
        sidecar.metric("llm_gateway_usage_records_duplicate_total").await == N as f64
    })
    .await;
    assert_eq!(events(&mut conn, "acme").await.len() as u64, N, "a duplicate appends no second event");
    sidecar.stop().await;
    // As if the delivery that wrote the ledger had gone away before its events reached the
    // stream (killed between its two Redis calls): the stream and its appended-id sets are gone.
    let keys: Vec<String> =
        redis::cmd("KEYS").arg("llmgw:usage-events*").query_async(&mut conn).await.unwrap();
    assert!(!keys.is_empty());
    let _: () = redis::cmd("DEL").arg(&keys).query_async(&mut conn).await.unwrap();

    // And replayed to a sidecar started afresh: duplicates in the ledger, whose events it
    // appends again, once each.
    let restarted = Sidecar::start(&redis, 60_000).await;
    deliver(restarted.listen, &entries).await;
    eventually("the replay seen as duplicates", || async {
        restarted.metric("llm_gateway_usage_records_duplicate_total").await == N as f64
    })
    .await;
    eventually("the missing events appended", || async {
        let mut conn = redis.conn().await;
        events(&mut conn, "acme").await.len() as u64 == N
    })
    .await;
    assert_eq!(restarted.metric("llm_gateway_usage_records_written_total").await, 0.0);

    // One record per request: counts, events, settlement.
    let h = usage(&mut conn, "acme").await;
    assert_eq!(h.get("m:requests"), Some(&(N as i64)), "{h:?}");
    assert_eq!(h.get("m:prompt_tokens"), Some(&(N as i64 * 10)), "{h:?}");
    assert_eq!(h.get("m:completion_tokens"), Some(&(N as i64 * (USED as i64 - 10))), "{h:?}");
    let recorded = events(&mut conn, "acme").await;
    assert_eq!(recorded.len() as u64, N, "one event per request: {recorded:?}");
    let mut ids: Vec<_> = recorded.iter().map(|e| e.record_id.clone()).collect();
    ids.sort();
    let mut expected: Vec<_> = all.iter().map(|f| f.record_id().unwrap()).collect();
    expected.sort();
    assert_eq!(ids, expected, "named by the request id and the nonce");
    assert!(recorded.iter().all(|e| e.request_id.starts_with("acme-request-")));
    // Each request's reservation was settled once: the bucket holds what was used, no more and no
    // less (a second settlement would have given back RESERVED - USED again per request).
    assert_eq!(level(&mut conn, "llmgw:rl:{acme}:tpm").await, TOKEN_BURST - N * USED);
    assert_eq!(open_reservations(&mut conn, "acme").await, 0, "every reservation closed");
    restarted.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_with_its_own_limits_is_refused_past_them_and_named_in_its_usage() {
    let _one = ONE_AT_A_TIME.lock().await;
    let redis = Redis::start();
    let mut conn = redis.conn().await;
    let sidecar = Sidecar::start(&redis, 60_000).await;
    let keyed = |key: &str, i: u64| RequestFacts { api_key: Some(key.into()), ..facts("keyed", i) };
    let ci: Vec<_> = (0..2).map(|i| keyed("ci", i)).collect();
    for f in &ci {
        assert!(admitted(&admit(sidecar.listen, f).await), "within the key's burst of 2");
    }
    assert!(!admitted(&admit(sidecar.listen, &keyed("ci", 2)).await), "the key's third request is refused");
    // The tenant has no limits: its other keys are not held by this one's.
    let other = keyed("other", 3);
    assert!(admitted(&admit(sidecar.listen, &other).await));
    assert_eq!(level(&mut conn, "llmgw:rl:{keyed}:k:ci:tpm").await, KEY_TOKEN_BURST - 2 * RESERVED);

    let entries: Vec<_> = ci.iter().chain([&other]).map(|f| entry(f, true, 200)).collect();
    deliver(sidecar.listen, &entries).await;
    eventually("the key's records written", || async {
        sidecar.metric("llm_gateway_usage_records_written_total").await == 3.0
    })
    .await;
    let mut named: Vec<_> = events(&mut conn, "keyed").await.into_iter().map(|e| e.api_key).collect();
    named.sort();
    assert_eq!(named, ["ci", "ci", "other"]);
    // The daily hash counts the requests by model, and the named keys' by key too.
    let h = usage(&mut conn, "keyed").await;
    assert_eq!(
        (h.get("m:requests"), h.get("api_key ci:requests"), h.get("api_key other:requests")),
        (Some(&3), Some(&2), Some(&1)),
        "{h:?}"
    );
    assert_eq!(h.get("api_key ci:prompt_tokens"), Some(&20), "{h:?}");
    // Settled at its usage in the key's bucket, as in the tenant's.
    assert_eq!(level(&mut conn, "llmgw:rl:{keyed}:k:ci:tpm").await, KEY_TOKEN_BURST - 2 * USED);
    let per_key =
        |key: &str| format!("llm_gateway_api_key_requests_total{{tenant=\"keyed\",api_key=\"{key}\"}}");
    assert_eq!(sidecar.metric(&per_key("ci")).await, 2.0);
    assert_eq!(sidecar.metric(&per_key("other")).await, 1.0);
    sidecar.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reservations_whose_usage_never_arrives_are_charged_once_by_two_sweeping_sidecars() {
    let _one = ONE_AT_A_TIME.lock().await;
    const N: u64 = 12;
    let redis = Redis::start();
    let mut conn = redis.conn().await;
    let a = Sidecar::start(&redis, 3_000).await;
    let b = Sidecar::start(&redis, 3_000).await;
    let lost: Vec<_> = (0..N).map(|i| facts("lost", i)).collect();
    for (i, f) in lost.iter().enumerate() {
        // Admitted through either replica, as a Service spreads them.
        let listen = if i % 2 == 0 { a.listen } else { b.listen };
        assert!(admitted(&admit(listen, f).await));
    }
    // A request whose admission answer Envoy never received (the sidecar timed out after its
    // take; Envoy answered 504): its entry carries no admission, and releases the reservation.
    let unanswered = facts("lost", 100);
    assert!(admitted(&admit(a.listen, &unanswered).await));
    // A tenant without limits: its reservation is recorded too (a take of no bucket).
    let free = facts("free", 0);
    assert!(admitted(&admit(b.listen, &free).await));
    assert_eq!(open_reservations(&mut conn, "lost").await, N + 1);
    assert_eq!(open_reservations(&mut conn, "free").await, 1);
    deliver(b.listen, &[entry(&unanswered, false, 504)]).await;
    eventually("the unanswered admission released", || async {
        b.metric("llm_gateway_reservations_released_total").await == 1.0
    })
    .await;
    // Its request and tokens went back (the buckets refill 1 a minute).
    assert_eq!(level(&mut conn, "llmgw:rl:{lost}:rpm").await, 1000 - N);
    assert_eq!(level(&mut conn, "llmgw:rl:{lost}:tpm").await, TOKEN_BURST - N * RESERVED);

    // Both replicas sweep every 100 ms; each reservation is charged by one of them, once.
    let charged = || async {
        a.metric("llm_gateway_usage_records_from_reservation_total").await
            + b.metric("llm_gateway_usage_records_from_reservation_total").await
    };
    eventually("the lost requests charged", || async { charged().await >= (N + 1) as f64 }).await;
    // A few more sweeps: nothing more is charged.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(charged().await, (N + 1) as f64, "N lost, 1 free, and not the released one");
    let h = usage(&mut conn, "lost").await;
    assert_eq!(h.get("m:requests"), Some(&(N as i64)), "{h:?}");
    assert_eq!(h.get("m:prompt_tokens"), Some(&(N as i64 * 10)), "{h:?}");
    assert_eq!(h.get("m:completion_tokens"), Some(&(N as i64 * 20)), "charged the reservation: {h:?}");
    let charged_events = events(&mut conn, "lost").await;
    assert_eq!(charged_events.len() as u64, N, "{charged_events:?}");
    for e in &charged_events {
        assert_eq!((e.usage_source, e.end_reason), (3, 3), "reservation, unreported: {e:?}");
        assert_eq!(
            (e.status, e.reserved_tokens, e.prompt_tokens + e.completion_tokens),
            (0, RESERVED, RESERVED)
        );
    }
    let mut ids: Vec<_> = charged_events.iter().map(|e| e.record_id.clone()).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len() as u64, N, "one record per request");
    assert!(!ids.contains(&unanswered.record_id().unwrap()), "the released one is never charged");
    // The charge settles nothing: the bucket keeps the reservations.
    assert_eq!(level(&mut conn, "llmgw:rl:{lost}:tpm").await, TOKEN_BURST - N * RESERVED);
    assert_eq!(open_reservations(&mut conn, "lost").await, 0);
    assert_eq!(usage(&mut conn, "free").await.get("m:requests"), Some(&1));

    // The usage of a charged request, arriving late, is not applied on top of the charge.
    deliver(a.listen, &[entry(&lost[0], true, 200)]).await;
    eventually("the late usage refused", || async {
        a.metric("llm_gateway_usage_records_after_charge_total").await == 1.0
    })
    .await;
    assert_eq!(usage(&mut conn, "lost").await.get("m:requests"), Some(&(N as i64)));
    assert_eq!(events(&mut conn, "lost").await.len() as u64, N);
    a.stop().await;
    b.stop().await;
}
