//! The sidecar's readiness for Envoy: the standard gRPC health service (`grpc.health.v1.Health`)
//! on the gRPC listener, and the refusal of new admission streams once the sidecar drains.
//!
//! From start to SIGTERM the service reports `SERVING` for the server (`""`) and for
//! `envoy.service.ext_proc.v3.ExternalProcessor`; from SIGTERM on, `NOT_SERVING`, so that Envoy's
//! health check (gatewayctl's standalone ext_proc cluster, envoy/ext_proc_health.yaml) takes the
//! replica out of its load balancing. Until Envoy has seen that, a new admission stream that still
//! reaches this replica is answered at once with `UNAVAILABLE` (a trailers-only response, before
//! anything was decided or taken): the admission filter's `grpc_service.retry_policy` retries it
//! on another replica. Streams already open, the metering streams and Envoy's access-log stream
//! (the usage of requests still in flight) are served on until the grace ends ([`crate::run`]).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use tonic_health::pb::health_server::{Health, HealthServer};
use tonic_health::server::HealthReporter;
use tonic_health::ServingStatus;

/// The services whose status Envoy may check: the whole server, and the ext_proc service.
const SERVICES: [&str; 2] = ["", "envoy.service.ext_proc.v3.ExternalProcessor"];

/// The message of the `UNAVAILABLE` answer to a stream refused while draining.
pub const DRAINING_MESSAGE: &str = "gateway-ext-proc is draining: retry on another replica";

/// Whether this replica takes new admissions, shared by the ext_proc service and the shutdown.
#[derive(Clone)]
pub struct Readiness {
    draining: Arc<AtomicBool>,
    refused: Arc<AtomicU64>,
    reporter: HealthReporter,
}

impl Readiness {
    /// A replica taking admissions, and the health service (every service `SERVING`) to add to
    /// the gRPC server.
    pub async fn start() -> (Self, HealthServer<impl Health>) {
        let (reporter, service) = tonic_health::server::health_reporter();
        for name in SERVICES {
            reporter.set_service_status(name, ServingStatus::Serving).await;
        }
        let readiness = Self {
            draining: Arc::new(AtomicBool::new(false)),
            refused: Arc::new(AtomicU64::new(0)),
            reporter,
        };
        (readiness, service)
    }

    /// From now on: `NOT_SERVING`, and new admission streams refused.
    pub async fn drain(&self) {
        self.draining.store(true, Ordering::Relaxed);
        for name in SERVICES {
            self.reporter.set_service_status(name, ServingStatus::NotServing).await;
        }
    }

    /// Whether [`Readiness::drain`] was called.
    pub fn draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    /// The answer to a new admission stream while draining (`UNAVAILABLE`, which the admission
    /// filter's retry policy retries on another replica), counted.
    pub fn refuse(&self) -> tonic::Status {
        self.refused.fetch_add(1, Ordering::Relaxed);
        tonic::Status::unavailable(DRAINING_MESSAGE)
    }

    /// Admission streams refused since [`Readiness::drain`].
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use tonic_health::pb::health_check_response::ServingStatus as Wire;
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;

    use super::*;

    #[tokio::test]
    async fn serving_until_drain_then_not_serving_and_refusing() {
        let (readiness, service) = Readiness::start().await;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let incoming = tonic::transport::server::TcpIncoming::from(listener);
        tokio::spawn(tonic::transport::Server::builder().add_service(service).serve_with_incoming(incoming));
        let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{addr}")).expect("url");
        let mut client = HealthClient::new(endpoint.connect().await.expect("connect"));
        let check = |service: &str| HealthCheckRequest { service: service.to_owned() };
        for name in SERVICES {
            let status = client.check(check(name)).await.expect("check").into_inner().status;
            assert_eq!(status, Wire::Serving as i32, "{name:?}");
        }
        assert!(!readiness.draining());
        readiness.drain().await;
        assert!(readiness.draining());
        for name in SERVICES {
            let status = client.check(check(name)).await.expect("check").into_inner().status;
            assert_eq!(status, Wire::NotServing as i32, "{name:?}");
        }
        let refused = readiness.clone().refuse();
        assert_eq!(refused.code(), tonic::Code::Unavailable);
        assert_eq!(readiness.refused(), 1);
    }
}
