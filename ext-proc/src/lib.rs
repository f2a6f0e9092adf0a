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
pub mod reload;
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
use crate::state::{Live, Shared};
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

/// [`run_watching`] without a config file to watch: the config never reloads.
///
/// # Errors
/// As [`run_watching`].
pub async fn run(config: Config, shutdown: impl Future<Output = ()> + Send) -> Result<(), RunError> {
    run_watching(config, None, shutdown).await
}

/// Connects to Redis, starts the pool scrapers, the usage writer and the metrics listener, binds
/// the gRPC listener (mTLS with `tls`: every client must present a certificate from
/// `tls.client_ca_file`), prints `gateway-ext-proc listening on ADDR` on stdout (test harnesses read
/// the port from it), with the gRPC health service beside Envoy's, and serves until `shutdown`
/// completes; then reports `NOT_SERVING`, refuses new admissions (for Envoy to retry them on another
/// replica) and serves on while gRPC streams are open, for up to `shutdown_grace_ms` (Envoy's
/// access-log stream carries the usage of the requests it still drains), gives the held leases
/// back and writes the buffered usage records. With `watched`, the config file is reloaded when
/// it changes or at SIGHUP ([`reload`]).
///
/// # Errors
/// [`RunError`] when Redis is unreachable at start, an address cannot be bound, or the server
/// fails.
pub async fn run_watching(
    config: Config,
    watched: Option<reload::Watched>,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), RunError> {
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
    let limiter = Arc::new(Limiter::new(store, &config.redis, Arc::clone(&metrics)));
    let leasing = config.redis.lease_fraction > 0.0;
    metrics.config_serving(None, watched.as_ref().map_or("", |w| w.sha256()), 1);
    let shared = Arc::new(Shared::new(config, Arc::clone(&limiter), recorder, pools, metrics, context));
    // What the process reads of its first config; the generation itself is left to `live`, so
    // that a reload retires it once its streams end.
    let journal_config = shared.config.metering.journal.clone();
    let max_message_bytes = shared.config.context.grpc_max_message_bytes();
    let tls_pem = shared.config.tls.as_ref().and_then(|t| t.pem.clone());
    let live = Live::new(shared);
    let (stopping, stop) = tokio::sync::watch::channel(false);
    let reloads = watched.map(|w| tokio::spawn(reload::run(Arc::clone(&live), w, stop.clone())));
    let background = Background::spawn(&live, &limiter, leasing, journal_config, &stop);
    let endpoint_pickers = crate::grpc::epp::server::spawn_all(&live, stop.clone())
        .await
        .map_err(|(addr, source)| RunError::Bind { addr, source })?;
    let access_log = AccessLogServiceServer::new(AccessLog::new(Arc::clone(&live)));
    let (readiness, health) = crate::grpc::health::Readiness::start().await;
    // A body at the filter's max_body_bytes comes whole for an exact count.
    let gateway = Gateway::new(Arc::clone(&live)).with_readiness(readiness.clone());
    let service = ExternalProcessorServer::new(gateway).max_decoding_message_size(max_message_bytes);
    let leases = proto::admission_leases_server::AdmissionLeasesServer::new(
        crate::grpc::lease_service::AdmissionLeaseService::new(Arc::clone(&live)),
    );
    let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
    let mtls = tls_pem.is_some();
    println!("gateway-ext-proc listening on {addr}");
    tracing::info!(%addr, mtls, "listening");
    let mut graceful = stop.clone();
    let mut builder = tonic::transport::Server::builder();
    if let Some(pem) = &tls_pem {
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
        .add_service(health)
        .serve_with_incoming_shutdown(incoming, async move {
            let _ = graceful.wait_for(|stopping| *stopping).await;
        });
    tokio::pin!(server);
    let served = tokio::select! {
        served = &mut server => served,
        () = shutdown => drain(&mut server, &live, &stopping, &readiness).await,
    };
    let _ = stopping.send(true);
    if let Some(reloads) = reloads {
        let _ = reloads.await;
    }
    for task in endpoint_pickers {
        let _ = task.await;
    }
    background.join().await;
    limiter.give_back_all_leases().await;
    // Streams still open past the grace hold a Recorder: close the writer's queue explicitly; it
    // writes what is queued, then ends.
    let _ = closing.send(true);
    let _ = writer.await;
    served?;
    Ok(())
}

/// The background tasks over the live state, each until `stop` turns true.
struct Background {
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Background {
    fn spawn(
        live: &Arc<Live>,
        limiter: &Arc<Limiter>,
        leasing: bool,
        journal: Option<config::JournalConfig>,
        stop: &tokio::sync::watch::Receiver<bool>,
    ) -> Self {
        let mut tasks = Vec::new();
        if leasing {
            let (limiter, mut stop) = (Arc::clone(limiter), stop.clone());
            tasks.push(tokio::spawn(async move {
                tokio::select! {
                    () = limiter.run_lease_expiry() => {}
                    _ = stop.wait_for(|stopping| *stopping) => {}
                }
            }));
        }
        // Charges the reservations whose usage never arrived (every replica sweeps).
        tasks.push(tokio::spawn(metering::sweeper::run(Arc::clone(live), stop.clone())));
        // Reclaims the filters' admission leases whose VM went away (every replica sweeps), also
        // while leases are off: those taken before are still reclaimed and charged.
        tasks.push(tokio::spawn(metering::sweeper::run_leases(Arc::clone(live), stop.clone())));
        // Replays the usage journal Envoy writes, from its checkpoint (one replica at a time).
        if let Some(config) = journal {
            tasks.push(tokio::spawn(metering::journal::tail::run(Arc::clone(live), config, stop.clone())));
        }
        Self { tasks }
    }

    async fn join(self) {
        for task in self.tasks {
            let _ = task.await;
        }
    }
}

/// After SIGTERM/SIGINT: at once reports `NOT_SERVING` on the gRPC health service and answers
/// every new admission stream `UNAVAILABLE`, which Envoy retries on another replica
/// ([`grpc::health`]); serves on, new connections included, while gRPC streams are open (Envoy's
/// access-log stream stays open as long as Envoy runs, and the requests it drains deliver their
/// usage on it), up to `grace`; then stops accepting, gives the server a second to end, and
/// returns (streams still open end with the process).
async fn drain<S>(
    server: &mut std::pin::Pin<&mut S>,
    live: &Live,
    stopping: &tokio::sync::watch::Sender<bool>,
    readiness: &grpc::health::Readiness,
) -> Result<(), tonic::transport::Error>
where
    S: Future<Output = Result<(), tonic::transport::Error>>,
{
    let shared = live.current();
    let grace = Duration::from_millis(shared.config.shutdown_grace_ms);
    readiness.drain().await;
    let served = serve_open_streams(server, &shared, grace).await;
    tracing::info!(refused = readiness.refused(), "admission streams refused while draining");
    if let Some(served) = served {
        return served;
    }
    let _ = stopping.send(true);
    tokio::time::timeout(Duration::from_secs(1), server.as_mut()).await.unwrap_or(Ok(()))
}

/// Serves while gRPC streams are open, up to `grace`; `Some` when the server ended by itself.
async fn serve_open_streams<S>(
    server: &mut std::pin::Pin<&mut S>,
    shared: &Shared,
    grace: Duration,
) -> Option<Result<(), tonic::transport::Error>>
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
            served = server.as_mut() => return Some(served),
            () = tokio::time::sleep(Duration::from_millis(100)) => {}
        }
    }
    None
}
