//! The pieces of Envoy configuration gatewayctl writes itself, on top of the templates under
//! `envoy/` (which `tests/stack.py` assembles too): a pool's endpoints and the settings the
//! gateway config gives it, a fallback chain's members, the router, and the remote wasm module of
//! the Istio target. Members are declared in the order the templates list them.

use serde::Serialize;

/// `{name}`: an HTTP filter, or a member cluster of a composite cluster.
#[derive(Debug, Serialize)]
pub(crate) struct Named {
    pub(crate) name: String,
}

/// The router, the last HTTP filter.
#[derive(Debug, Serialize)]
pub(crate) struct Router {
    name: &'static str,
    typed_config: TypedConfig,
}

impl Router {
    /// `envoy.filters.http.router`.
    pub(crate) fn new() -> Self {
        Self {
            name: "envoy.filters.http.router",
            typed_config: TypedConfig {
                type_url: "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router",
            },
        }
    }
}

/// A `typed_config` with no member but its type.
#[derive(Debug, Serialize)]
struct TypedConfig {
    #[serde(rename = "@type")]
    type_url: &'static str,
}

/// One of a cluster's `lb_endpoints`.
#[derive(Debug, Serialize)]
pub(crate) struct LbEndpoint {
    endpoint: Endpoint,
}

impl LbEndpoint {
    /// `host:port`.
    pub(crate) fn new(host: String, port: u16) -> Self {
        Self {
            endpoint: Endpoint {
                address: Address { socket_address: SocketAddress { address: host, port_value: port } },
            },
        }
    }
}

#[derive(Debug, Serialize)]
struct Endpoint {
    address: Address,
}

#[derive(Debug, Serialize)]
struct Address {
    socket_address: SocketAddress,
}

#[derive(Debug, Serialize)]
struct SocketAddress {
    address: String,
    port_value: u16,
}

/// What a pool's cluster takes from the gateway config (merged into envoy/pool_cluster.yaml,
/// each in its place there).
#[derive(Debug, Serialize)]
pub(crate) struct PoolClusterSettings {
    /// `STRICT_DNS` when an endpoint is a name to resolve.
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub(crate) kind: Option<&'static str>,
    pub(crate) connect_timeout: String,
    pub(crate) outlier_detection: OutlierDetection,
}

/// A cluster's outlier detection.
#[derive(Debug, Serialize)]
pub(crate) struct OutlierDetection {
    pub(crate) consecutive_5xx: u32,
    pub(crate) base_ejection_time: String,
    pub(crate) max_ejection_percent: u32,
}

/// A cluster's circuit breaker limits (merged into its `thresholds[0]`).
#[derive(Debug, Serialize)]
pub(crate) struct Thresholds {
    pub(crate) max_connections: u32,
    pub(crate) max_pending_requests: u32,
    pub(crate) max_requests: u32,
}

/// A cluster's active health check (merged into its `health_checks[0]`).
#[derive(Debug, Serialize)]
pub(crate) struct HealthCheck {
    pub(crate) timeout: String,
    pub(crate) interval: String,
    pub(crate) unhealthy_threshold: u32,
    pub(crate) healthy_threshold: u32,
    pub(crate) http_health_check: HttpHealthCheck,
}

/// `{path}`.
#[derive(Debug, Serialize)]
pub(crate) struct HttpHealthCheck {
    pub(crate) path: String,
}

/// The wasm module fetched over HTTP (Istio's agent fetches an `oci://` URL too).
#[derive(Debug, Serialize)]
pub(crate) struct RemoteCode {
    remote: RemoteSource,
}

impl RemoteCode {
    /// `uri`, checked against `sha256` when given.
    pub(crate) fn new(uri: &str, sha256: Option<&str>) -> Self {
        Self {
            remote: RemoteSource {
                http_uri: HttpUri { uri: uri.to_owned(), timeout: "30s" },
                sha256: sha256.map(str::to_owned),
            },
        }
    }
}

#[derive(Debug, Serialize)]
struct RemoteSource {
    http_uri: HttpUri,
    #[serde(skip_serializing_if = "Option::is_none")]
    sha256: Option<String>,
}

#[derive(Debug, Serialize)]
struct HttpUri {
    uri: String,
    timeout: &'static str,
}
