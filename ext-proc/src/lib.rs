//! `gateway-ext-proc`: the gateway's Envoy External Processing (ext_proc) sidecar.
//!
//! It enforces per-tenant (and per tenant × model) requests-per-minute and tokens-per-minute
//! limits in Redis (atomic Lua token buckets, answering 429 with `Retry-After` and OpenAI's
//! `x-ratelimit-*` headers), sheds requests (429 `overloaded`) in front of vLLM pools whose queue
//! or KV cache is over its threshold, lower tiers first, and records each admitted request's
//! token usage exactly once in Redis: measured on the streamed SSE response by the wasm filter
//! and delivered by Envoy's gRPC access log ([`grpc::access_log`]), or streamed here chunk by
//! chunk by an ext_proc metering filter. Redis failures are bounded by a timeout and a circuit
//! breaker, with a failure mode per tier.
//!
//! The tree follows a request (docs/architecture.md, "The sidecar's tree"): the stages
//! ([`admission`], whose [`admission::pipeline`] writes their order once; [`flow_control`];
//! [`scheduling`]; [`metering`]) keep their decisions pure; the adapters ([`grpc`] for Envoy's
//! gRPC services, [`store`] for Redis), the pools' scraper ([`pools`]) and the background tasks
//! only move data. `tools/check_layout.py` keeps the modules' layers.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let config = gateway_ext_proc::config::Config::load("sidecar.yaml".as_ref())?;
//! gateway_ext_proc::run(config, async { let _ = tokio::signal::ctrl_c().await; }).await?;
//! # Ok(()) }
//! ```

pub mod admission;
pub mod config;
pub mod error;
pub mod facts;
pub mod flow_control;
pub mod grpc;
pub mod metering;
pub mod metrics;
pub mod pools;
pub mod scheduling;
pub mod state;
pub mod store;
pub mod telemetry;

/// Protobuf types of `proto/llm_gateway/v1/usage.proto` and `lease.proto` (with the lease
/// service's server).
#[allow(missing_docs, clippy::all)]
pub mod proto {
    include!(concat!(env!("OUT_DIR"), "/llm_gateway.v1.rs"));
}

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::service::accesslog::v3::access_log_service_server::AccessLogServiceServer;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessorServer;
use tonic::transport::server::TcpIncoming;

use crate::admission::limiter::Limiter;
use crate::config::Config;
use crate::grpc::access_log::AccessLog;
use crate::grpc::ext_proc::Gateway;
use crate::metering::recorder::Recorder;
use crate::metrics::Metrics;
use crate::pools::Pools;
use crate::state::Shared;
use crate::store::Store;

/// Errors that stop the sidecar.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// Redis could not be reached at start-up.
    #[error("connecting to redis: {0}")]
    Store(#[from] store::StoreError),
    /// The listen address could not be bound.
    #[error("binding {addr}: {source}")]
    Bind {
        /// The configured address.
        addr: SocketAddr,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The gRPC server failed.
    #[error("grpc server: {0}")]
    Serve(#[from] tonic::transport::Error),
    /// A model's tokenizer files could not be loaded (the error names the field and the file).
    #[error("{0}")]
    Tokenizer(config::error::ConfigError),
}

/// Longest time a client may take over its TLS handshake on the gRPC listener.
const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Connects to Redis, starts the pool scrapers, the usage writer and the metrics listener, binds
/// the gRPC listener (mTLS with `tls`: every client must present a certificate from
/// `tls.client_ca_file`), prints `gateway-ext-proc listening on ADDR` on stdout (test harnesses read
/// the port from it), and serves until `shutdown` completes; then serves on while gRPC streams are
/// open, for up to `shutdown_grace_ms` (Envoy's access-log stream carries the usage of the requests
/// it still drains), gives the held leases back and writes the buffered usage records.
///
/// # Errors
/// [`RunError`] when Redis is unreachable at start, an address cannot be bound, or the server
/// fails.
pub async fn run(config: Config, shutdown: impl Future<Output = ()> + Send) -> Result<(), RunError> {
    let context = Arc::new(
        admission::context::ContextChecker::from_config(&config.models)
            .map_err(RunError::Tokenizer)?
            .with_counts_per_tenant(config.context.max_counts_per_tenant),
    );
    let metrics = Metrics::new();
    let store = Store::connect(&config.redis, config.usage_stream(), config.metering.stream_maxlen)
        .await?
        .with_quotas(admission::quota::QuotaBook::new(&config, admission::quota::Clock::from_env()));
    if let Some(addr) = config.metrics_listen {
        let bound = metrics::serve(addr, Arc::clone(&metrics))
            .await
            .map_err(|source| RunError::Bind { addr, source })?;
        println!("gateway-ext-proc metrics on {bound}");
        tracing::info!(%bound, "metrics listening");
    }
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .map_err(|source| RunError::Bind { addr: config.listen, source })?;
    let addr = listener.local_addr().map_err(|source| RunError::Bind { addr: config.listen, source })?;
    if config.flow_control_unused() {
        tracing::warn!("flow_control is set but no pool has a flow_control section: nothing is queued");
    }
    let pools =
        Pools::new(&config.pools, config.flow_control.as_ref(), Arc::clone(&metrics), Some(store.clone()));
    pools.spawn_scrapers();
    let (closing, closing_rx) = tokio::sync::watch::channel(false);
    let tenants = config.tenants.iter().map(|t| t.id.clone()).collect();
    let (recorder, writer) = Recorder::start(
        store.clone(),
        config.metering.buffer_records,
        Arc::clone(&metrics),
        closing_rx,
        tenants,
    );
    let limiter = Limiter::new(store, &config.redis, Arc::clone(&metrics));
    let leasing = config.redis.lease_fraction > 0.0;
    let shared = Arc::new(Shared::new(config, limiter, recorder, pools, metrics, context));
    let grace = Duration::from_millis(shared.config.shutdown_grace_ms);
    let (stopping, stop) = tokio::sync::watch::channel(false);
    let expiry = leasing.then(|| {
        let (shared, mut stop) = (Arc::clone(&shared), stop.clone());
        tokio::spawn(async move {
            tokio::select! {
                () = shared.limiter.run_lease_expiry() => {}
                _ = stop.wait_for(|stopping| *stopping) => {}
            }
        })
    });
    // Charges the reservations whose usage never arrived (every replica sweeps).
    let sweeper = tokio::spawn(metering::sweeper::run(Arc::clone(&shared), stop.clone()));
    // Reclaims the filters' admission leases whose VM went away (every replica sweeps), also
    // while leases are off: those taken before are still reclaimed and charged.
    let lease_sweeper = tokio::spawn(metering::sweeper::run_leases(Arc::clone(&shared), stop.clone()));
    // Replays the usage journal Envoy writes, from its checkpoint (one replica at a time).
    let journal =
        shared.config.metering.journal.clone().map(|config| {
            tokio::spawn(metering::journal::tail::run(Arc::clone(&shared), config, stop.clone()))
        });
    let endpoint_pickers = crate::grpc::epp::server::spawn_all(&shared, stop.clone())
        .await
        .map_err(|(addr, source)| RunError::Bind { addr, source })?;
    let access_log = AccessLogServiceServer::new(AccessLog::new(Arc::clone(&shared)));
    // A body at the filter's max_body_bytes comes whole for an exact count.
    let service = ExternalProcessorServer::new(Gateway::new(Arc::clone(&shared)))
        .max_decoding_message_size(shared.config.context.grpc_max_message_bytes());
    let leases = proto::admission_leases_server::AdmissionLeasesServer::new(
        crate::grpc::lease_service::AdmissionLeaseService::new(Arc::clone(&shared)),
    );
    let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
    let mtls = shared.config.tls.is_some();
    println!("gateway-ext-proc listening on {addr}");
    tracing::info!(%addr, mtls, "listening");
    let mut graceful = stop.clone();
    let mut builder = tonic::transport::Server::builder();
    if let Some(pem) = shared.config.tls.as_ref().and_then(|t| t.pem.as_ref()) {
        let identity = tonic::transport::Identity::from_pem(&pem.cert, pem.key.expose());
        let tls = tonic::transport::ServerTlsConfig::new()
            .identity(identity)
            .client_ca_root(tonic::transport::Certificate::from_pem(&pem.client_ca))
            .timeout(TLS_HANDSHAKE_TIMEOUT);
        builder = builder.tls_config(tls)?;
    }
    let server = builder
        .add_service(service)
        .add_service(access_log)
        .add_service(leases)
        .serve_with_incoming_shutdown(incoming, async move {
            let _ = graceful.wait_for(|stopping| *stopping).await;
        });
    tokio::pin!(server);
    let served = tokio::select! {
        served = &mut server => served,
        () = shutdown => drain(&mut server, &shared, grace, &stopping).await,
    };
    let _ = stopping.send(true);
    for task in endpoint_pickers {
        let _ = task.await;
    }
    if let Some(expiry) = expiry {
        let _ = expiry.await;
    }
    let _ = sweeper.await;
    let _ = lease_sweeper.await;
    if let Some(journal) = journal {
        let _ = journal.await;
    }
    shared.limiter.give_back_all_leases().await;
    // Streams still open past the grace hold a Recorder: close the writer's queue explicitly; it
    // writes what is queued, then ends.
    let _ = closing.send(true);
    let _ = writer.await;
    served?;
    Ok(())
}

/// After SIGTERM/SIGINT: serves on, new connections included, while gRPC streams are open (Envoy's
/// access-log stream stays open as long as Envoy runs, and the requests it drains deliver their
/// usage on it), up to `grace`; then stops accepting, gives the server a second to end, and
/// returns (streams still open end with the process).
async fn drain<S>(
    server: &mut std::pin::Pin<&mut S>,
    shared: &Shared,
    grace: Duration,
    stopping: &tokio::sync::watch::Sender<bool>,
) -> Result<(), tonic::transport::Error>
where
    S: Future<Output = Result<(), tonic::transport::Error>>,
{
    tracing::info!(
        grace_ms = grace.as_millis(),
        open_streams = shared.open_streams(),
        "shutting down: serving open streams until they end or the grace period is over"
    );
    // Every request waiting in a flow-control queue is answered now (429, Retry-After: 1, for
    // another replica to take), and nothing more is queued.
    shared.pools.close_queues();
    let deadline = tokio::time::Instant::now() + grace;
    while shared.open_streams() > 0 {
        if tokio::time::Instant::now() >= deadline {
            tracing::info!(
                open_streams = shared.open_streams(),
                "grace period over: closing the open streams"
            );
            break;
        }
        tokio::select! {
            served = server.as_mut() => return served,
            () = tokio::time::sleep(Duration::from_millis(100)) => {}
        }
    }
    let _ = stopping.send(true);
    tokio::time::timeout(Duration::from_secs(1), server.as_mut()).await.unwrap_or(Ok(()))
}
