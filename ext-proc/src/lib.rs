//! `gateway-ext-proc`: the gateway's Envoy External Processing (ext_proc) sidecar.
//!
//! It enforces per-tenant requests-per-minute and tokens-per-minute limits in Redis (atomic Lua
//! token buckets, answering 429 with `Retry-After` and OpenAI's `x-ratelimit-*` headers), and
//! meters each admitted request's token usage from the streamed SSE response, recording it once
//! in Redis. The decisions are pure code ([`limits`], [`admission`], [`meter`], [`sse`]); the
//! tonic adapter ([`service`]) and the Redis client ([`store`]) only move data.
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
pub mod limits;
pub mod meter;
pub mod service;
pub mod sse;
pub mod store;

/// Protobuf types of `proto/llm_gateway/v1/usage.proto`.
#[allow(missing_docs, clippy::all)]
pub mod proto {
    include!(concat!(env!("OUT_DIR"), "/llm_gateway.v1.rs"));
}

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessorServer;
use tonic::transport::server::TcpIncoming;

use crate::config::Config;
use crate::service::Gateway;
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
}

/// Connects to Redis, binds the gRPC listener, prints `gateway-ext-proc listening on ADDR` on
/// stdout (test harnesses read the port from it), and serves until `shutdown` completes.
///
/// # Errors
/// [`RunError`] when Redis is unreachable at start, the address cannot be bound, or the server
/// fails.
pub async fn run(
    config: Config,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), RunError> {
    let store = Store::connect(
        &config.redis,
        config.usage_stream(),
        config.metering.stream_maxlen,
    )
    .await?;
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .map_err(|source| RunError::Bind {
            addr: config.listen,
            source,
        })?;
    let addr = listener.local_addr().map_err(|source| RunError::Bind {
        addr: config.listen,
        source,
    })?;
    let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
    let service = ExternalProcessorServer::new(Gateway::new(Arc::new(config), store));
    println!("gateway-ext-proc listening on {addr}");
    tracing::info!(%addr, "listening");
    tonic::transport::Server::builder()
        .add_service(service)
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await?;
    Ok(())
}
