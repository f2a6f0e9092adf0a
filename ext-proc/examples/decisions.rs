//! Limit decisions per second of one sidecar, without Envoy: `CONCURRENCY` tasks each open an
//! admission ext_proc stream per request (as Envoy does), send the request headers of a tenant and
//! wait for the decision, for `SECONDS`.
//!
//! ```sh
//! cargo run --release -p gateway-ext-proc --example decisions -- 127.0.0.1:PORT TENANT [CONCURRENCY] [SECONDS]
//! ```
//! Prints one JSON line: decisions, admitted, refused, seconds, decisions_per_s, p50/p99 latency.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

use std::time::{Duration, Instant};

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as ProcRequest;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as ProcResponse;
use envoy_types::pb::envoy::service::ext_proc::v3::{HttpHeaders, ProcessingRequest};
use tonic::metadata::MetadataValue;

fn headers(tenant: &str, n: u64) -> ProcessingRequest {
    let pairs = [
        ("x-gateway-tenant", tenant.to_owned()),
        ("x-gateway-model", "m".to_owned()),
        ("x-gateway-pool", "pool".to_owned()),
        ("x-gateway-prompt-tokens", "100".to_owned()),
        ("x-gateway-max-tokens", "100".to_owned()),
        ("x-request-id", format!("bench-{n}")),
    ];
    let headers = pairs
        .iter()
        .map(|(k, v)| HeaderValue {
            key: (*k).to_owned(),
            value: String::new(),
            raw_value: v.as_bytes().to_vec(),
        })
        .collect();
    ProcessingRequest {
        request: Some(ProcRequest::RequestHeaders(HttpHeaders {
            headers: Some(HeaderMap { headers }),
            ..Default::default()
        })),
        ..Default::default()
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let addr = args.get(1).expect("ADDR");
    let tenant = args.get(2).expect("TENANT").clone();
    let concurrency: usize = args.get(3).map_or(16, |s| s.parse().unwrap());
    let seconds: f64 = args.get(4).map_or(5.0, |s| s.parse().unwrap());
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .tcp_nodelay(true)
        .connect()
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs_f64(seconds);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for t in 0..concurrency {
        let channel = channel.clone();
        let tenant = tenant.clone();
        tasks.push(tokio::spawn(async move {
            let mut client = ExternalProcessorClient::new(channel);
            let (mut admitted, mut refused, mut latencies) = (0u64, 0u64, Vec::new());
            let mut n = t as u64 * 1_000_000_000;
            while Instant::now() < deadline {
                n += 1;
                let sent = Instant::now();
                let mut request = tonic::Request::new(tokio_stream::iter([headers(&tenant, n)]));
                request
                    .metadata_mut()
                    .insert("x-gateway-ext-proc-role", MetadataValue::from_static("admission"));
                let mut inbound = client.process(request).await.unwrap().into_inner();
                match inbound.message().await.unwrap().and_then(|r| r.response) {
                    Some(ProcResponse::RequestHeaders(_)) => admitted += 1,
                    Some(ProcResponse::ImmediateResponse(_)) => refused += 1,
                    other => panic!("unexpected {other:?}"),
                }
                // Read to the end of the RPC (its trailers), as Envoy does.
                while inbound.message().await.unwrap().is_some() {}
                latencies.push(sent.elapsed());
            }
            (admitted, refused, latencies)
        }));
    }
    let (mut admitted, mut refused, mut latencies) = (0, 0, Vec::new());
    for task in tasks {
        let (a, r, l) = task.await.unwrap();
        admitted += a;
        refused += r;
        latencies.extend(l);
    }
    let elapsed = started.elapsed().as_secs_f64();
    latencies.sort();
    let pct = |p: f64| {
        latencies.get(((latencies.len() as f64 - 1.0) * p) as usize).map_or(0.0, |d| d.as_secs_f64() * 1e3)
    };
    println!(
        "{{\"decisions\":{},\"admitted\":{admitted},\"refused\":{refused},\"seconds\":{elapsed:.2},\"decisions_per_s\":{:.0},\"p50_ms\":{:.3},\"p99_ms\":{:.3}}}",
        admitted + refused,
        (admitted + refused) as f64 / elapsed,
        pct(0.5),
        pct(0.99)
    );
}
