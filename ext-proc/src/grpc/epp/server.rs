//! The tonic adapter of the endpoint-picker role: one `ExternalProcessor` server per configured
//! `endpoint_pickers[]` entry, each serving one pool, plus the gRPC health service
//! (`grpc.health.v1.Health`: `liveness`, `readiness` and `envoy.service.ext_proc.v3.ExternalProcessor`,
//! as the protocol's "Health Checking" asks). Nothing here decides anything itself.

use std::net::SocketAddr;
use std::sync::Arc;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};
use tracing::debug;

use crate::config::EndpointPickerConfig;
use crate::error::AdmissionError;
use crate::grpc::epp::stream::{Chooser, EppStream};
use crate::pools::PickOutcome;
use crate::scheduling::prompt::body_hashes;
use crate::state::{Live, Shared};

/// The load level at which the endpoint picker sheds (429): the pool's hard ceiling. The
/// protocol's requests carry no tenant tier, so the tiers' lower levels do not apply.
const EPP_SHED_LEVEL: f64 = 1.0;

/// The pool one EPP listener picks for, over the shared picker state.
struct PoolChooser {
    shared: Arc<Shared>,
    config: EndpointPickerConfig,
}

impl Chooser for PoolChooser {
    fn choose(&self, body: &[u8], subset: Option<&[SocketAddr]>) -> Result<Vec<String>, AdmissionError> {
        let pool = &self.config.pool;
        if let Some(shed) = self.shared.pools.check(pool, EPP_SHED_LEVEL) {
            return Err(AdmissionError::Overloaded {
                pool: pool.clone(),
                retry_after_secs: shed.retry_after_secs,
            });
        }
        let hashes = body_hashes(body, self.config.block_bytes, self.config.max_blocks)
            .map(|(_, hashes)| hashes)
            .unwrap_or_default();
        match self.shared.pools.pick(pool, &hashes, subset, "") {
            PickOutcome::Picked(pick) => Ok(vec![pick.value()]),
            PickOutcome::NotPicking | PickOutcome::NoneEligible => {
                Err(AdmissionError::NoEligibleEndpoint { pool: pool.clone() })
            }
        }
    }

    fn served(&self, endpoint: &str) {
        debug!(pool = %self.config.pool, endpoint, "served");
    }
}

/// Counts a picked request's end on the picker's per-endpoint in-flight count (its first-listed
/// endpoint, where the pick counted it) when the stream ends, however it ends. The pool's own
/// in-flight count (shedding) is the admission's and the access log's, as for every request.
struct PickEnd {
    shared: Arc<Shared>,
    pool: String,
    endpoint: Option<String>,
}

impl Drop for PickEnd {
    fn drop(&mut self) {
        if let Some(endpoint) = &self.endpoint {
            self.shared.pools.pick_finished(&self.pool, endpoint, None);
        }
    }
}

/// `envoy.service.ext_proc.v3.ExternalProcessor` in the endpoint-picker role, for one pool.
pub struct EndpointPicker {
    live: Arc<Live>,
    config: EndpointPickerConfig,
}

impl EndpointPicker {
    /// The picker of `config.pool`; each stream picks from the generation serving when it opens.
    pub fn new(live: Arc<Live>, config: EndpointPickerConfig) -> Self {
        Self { live, config }
    }
}

#[tonic::async_trait]
impl ExternalProcessor for EndpointPicker {
    type ProcessStream = ReceiverStream<Result<ProcessingResponse, Status>>;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(8);
        let shared = self.live.current();
        let chooser = PoolChooser { shared: Arc::clone(&shared), config: self.config.clone() };
        let max_body_bytes = self.config.max_body_bytes;
        let open = shared.stream_opened();
        let mut end = PickEnd { shared, pool: self.config.pool.clone(), endpoint: None };
        tokio::spawn(async move {
            let _open = open;
            let mut stream = EppStream::new(max_body_bytes);
            loop {
                let message = match inbound.message().await {
                    Ok(Some(m)) => m,
                    Ok(None) => break,
                    Err(status) => {
                        debug!(%status, "endpoint-picker stream ended");
                        break;
                    }
                };
                let responses = stream.on_message(message, &chooser);
                if end.endpoint.is_none() {
                    end.endpoint = stream.picked().and_then(|v| v.split(',').next()).map(str::to_owned);
                }
                for response in responses {
                    if tx.send(Ok(response)).await.is_err() {
                        return;
                    }
                }
                if stream.refused() {
                    break;
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// Binds every `endpoint_pickers[]` listener and serves it until `stop` turns true; prints
/// `gateway-ext-proc endpoint picker for POOL on ADDR` per listener (test harnesses read it).
///
/// # Errors
/// The address of a listener that cannot be bound, with the I/O error.
pub async fn spawn_all(
    live: &Arc<Live>,
    stop: tokio::sync::watch::Receiver<bool>,
) -> Result<Vec<tokio::task::JoinHandle<()>>, (SocketAddr, std::io::Error)> {
    let mut tasks = Vec::new();
    for config in live.current().config.endpoint_pickers.clone() {
        let listener = tokio::net::TcpListener::bind(config.listen).await.map_err(|e| (config.listen, e))?;
        let addr = listener.local_addr().map_err(|e| (config.listen, e))?;
        println!("gateway-ext-proc endpoint picker for {} on {addr}", config.pool);
        tracing::info!(%addr, pool = %config.pool, "endpoint picker listening");
        let (health_reporter, health) = tonic_health::server::health_reporter();
        for name in ["", "liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"] {
            health_reporter.set_service_status(name, tonic_health::ServingStatus::Serving).await;
        }
        let limit = config.max_body_bytes.saturating_add(1 << 20);
        let service = ExternalProcessorServer::new(EndpointPicker::new(Arc::clone(live), config))
            .max_decoding_message_size(limit);
        let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
        let mut stop = stop.clone();
        tasks.push(tokio::spawn(async move {
            let served = tonic::transport::Server::builder()
                .add_service(health)
                .add_service(service)
                .serve_with_incoming_shutdown(incoming, async move {
                    let _ = stop.wait_for(|s| *s).await;
                })
                .await;
            if let Err(error) = served {
                tracing::error!(%error, "endpoint picker server failed");
            }
        }));
    }
    Ok(tasks)
}
