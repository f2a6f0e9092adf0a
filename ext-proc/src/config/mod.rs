//! Sidecar configuration: a strict YAML file, validated once at start-up.
//!
//! Unknown fields are rejected (`deny_unknown_fields`) and every check names the field it failed
//! on, e.g. `tenants[1].limits.requests_per_minute: must be > 0`.

pub mod error;
pub mod pools;
pub mod redis;
pub mod reload;
pub mod tenants;
#[cfg(test)]
mod tests;
mod validate;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::config::error::{invalid, ConfigError};
use crate::config::pools::{FlowControlConfig, PoolConfig, SheddingConfig};
use crate::config::redis::{read_pem, ListenerPem, ListenerTls, PemKind, RedisConfig, Secret};
use crate::config::tenants::{Price, TenantConfig};

/// The whole sidecar configuration.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Address of the gRPC ext_proc listener, e.g. `127.0.0.1:50051` (port 0 picks a free one).
    pub listen: SocketAddr,
    /// TLS with client certificates (mTLS) on the gRPC listener (ext_proc, the access log
    /// service and the lease service): absent, the listener speaks plaintext HTTP/2 and must be
    /// reachable only by Envoy (loopback, or a NetworkPolicy / mesh mTLS, docs/deploy.md).
    #[serde(default)]
    pub tls: Option<ListenerTls>,
    /// Redis connection and key layout.
    pub redis: RedisConfig,
    /// Per-tenant limits. A tenant that the filter authenticates but that is missing here is
    /// refused with 403 `tenant_not_configured` (a configuration mistake should be loud).
    pub tenants: Vec<TenantConfig>,
    /// Prices per model (public model name), USD per 1M tokens: each usage record carries its
    /// cost, summed in the daily usage hash (docs/deploy.md, "Quotas and cost"). A model not
    /// listed costs 0.
    #[serde(default)]
    pub prices: BTreeMap<String, Price>,
    /// Metering settings.
    #[serde(default)]
    pub metering: MeteringConfig,
    /// vLLM pools whose load the sidecar watches to shed requests (429 `overloaded`) before their
    /// queues grow. A pool not listed is never shed.
    #[serde(default)]
    pub pools: Vec<PoolConfig>,
    /// How tiers are shed.
    #[serde(default)]
    pub shedding: SheddingConfig,
    /// Flow control (issue 13): the tiers whose requests wait in a saturated pool's queue
    /// (`pools[].flow_control`) instead of being refused, their order and budgets, and the
    /// tenants' fair shares. Needed when a pool has `flow_control`; absent, nothing is queued.
    #[serde(default)]
    pub flow_control: Option<FlowControlConfig>,
    /// Address of the Prometheus `/metrics` HTTP listener (absent: no listener).
    #[serde(default)]
    pub metrics_listen: Option<SocketAddr>,
    /// Models whose prompts the sidecar can count exactly (their tokenizer files are loaded at
    /// start-up), for the requests the filter sends with `x-gateway-context-check: exact`.
    #[serde(default)]
    pub models: Vec<ModelConfig>,
    /// The exact context check's settings.
    #[serde(default)]
    pub context: ContextConfig,
    /// After SIGTERM/SIGINT, how long open gRPC streams may go on, in milliseconds (default
    /// 10,000; 1 to 600,000): Envoy's access-log stream stays open as long as Envoy runs, and the
    /// requests Envoy is still draining deliver their usage on it. Past it the streams are closed;
    /// then the buffered usage records are flushed and leases given back. Keep it below the pod's
    /// `terminationGracePeriodSeconds`.
    #[serde(default = "default_shutdown_grace_ms")]
    pub shutdown_grace_ms: u64,
    /// Whether, from SIGTERM on, new admission streams are answered `UNAVAILABLE` at once, for
    /// Envoy to retry them on another replica (its gRPC health check sees `NOT_SERVING` either
    /// way). Right with two or more replicas behind the admission filter's retry policy (gatewayctl
    /// renders it so); with one, a refused admission has nowhere to go, and the default (false)
    /// admits them until the sidecar exits.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub drain_refuses_admissions: bool,
    /// Where the ext_proc streams read a request's tenant, model, pool, token counts and lease
    /// (default `filter_state`). The gRPC access log always reads the filter state.
    #[serde(default)]
    pub request_facts: FactsSource,
    /// The sidecar as the endpoint picker (EPP) of Gateway API Inference Extension InferencePools
    /// ([`crate::grpc::epp`]): one gRPC listener per entry, each picking for one pool that has a
    /// `picker`. Requests admitted to such a pool are not picked by the admission (the
    /// InferencePool's own ext_proc call picks them). Default none.
    #[serde(default)]
    pub endpoint_pickers: Vec<EndpointPickerConfig>,
    /// OpenTelemetry traces of the admission (issue 15): absent, no spans leave the process
    /// ([`crate::telemetry`]).
    #[serde(default)]
    pub tracing: Option<TracingConfig>,
}

/// `tracing`: the admission's spans (the limit decision and its Redis call, the exact count, the
/// flow-control wait) exported over OTLP/gRPC, children of Envoy's span when Envoy's ext_proc
/// call carries a W3C `traceparent`. Attributes follow the OpenTelemetry GenAI semantic
/// conventions (`gen_ai.request.model`, `gen_ai.usage.input_tokens`) plus the tenant; never an
/// API key (the sidecar never sees one).
#[derive(Debug, Clone, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct TracingConfig {
    /// The collector's OTLP/gRPC endpoint, `http://host:port` (4317 by convention) or `https://`.
    pub otlp_endpoint: String,
    /// Share of the admissions whose trace starts here that are sampled, in 0..=1 (default 1). A
    /// request whose ext_proc call carries Envoy's trace context follows Envoy's decision.
    #[serde(default = "default_sampling_ratio")]
    pub sampling_ratio: f64,
    /// The spans' `service.name` (default `llm-gateway-ext-proc`).
    #[serde(default = "default_service_name")]
    pub service_name: String,
}

fn default_sampling_ratio() -> f64 {
    1.0
}

fn default_service_name() -> String {
    "llm-gateway-ext-proc".to_owned()
}

/// `endpoint_pickers[]`: one endpoint-picker listener (the Inference Extension's ext_proc
/// protocol; its InferencePool's `endpointPickerRef` names this port).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EndpointPickerConfig {
    /// The pool (a `pools[].name` with a `picker`) whose endpoints it picks from.
    pub pool: String,
    /// Address of its plaintext gRPC listener (the Inference Extension's EPP serves on 9002), e.g.
    /// `0.0.0.0:9002`; port 0 asks for an ephemeral one.
    pub listen: SocketAddr,
    /// Largest request body it buffers to read the prompt, in bytes (default 4 MiB); a larger one
    /// gets 413.
    #[serde(default = "default_epp_max_body_bytes")]
    pub max_body_bytes: usize,
    /// Bytes per prompt block hashed for prefix affinity (default 64, as the wasm filter's
    /// `prefix_hashing.block_bytes`).
    #[serde(default = "default_epp_block_bytes")]
    pub block_bytes: usize,
    /// Most prompt blocks hashed (default 256).
    #[serde(default = "default_epp_max_blocks")]
    pub max_blocks: usize,
}

fn default_epp_max_body_bytes() -> usize {
    4 << 20
}

fn default_epp_block_bytes() -> usize {
    64
}

fn default_epp_max_blocks() -> usize {
    256
}

impl Config {
    /// Whether the filter may admit `pool`'s requests from admission leases: the pool's
    /// `admission_leases` when set; unset, not for a pool flow control queues, nor for one whose
    /// `picker` does not allow them ([`crate::config::pools::PickerConfig::admission_leases`]); a pool the config does
    /// not list may. A pool the sidecar sheds or queues by its load is leased only within its
    /// headroom ([`crate::admission::lease_headroom`]).
    pub fn pool_allows_admission_leases(&self, pool: &str) -> bool {
        let Some(p) = self.pools.iter().find(|p| p.name == pool) else {
            return true;
        };
        p.admission_leases.unwrap_or_else(|| {
            p.flow_control.is_none() && p.picker.is_none_or(|picker| picker.admission_leases)
        })
    }

    /// The pool `pool` when the sidecar sheds or queues it by its load
    /// ([`PoolConfig::load_protected`]): its leases are bounded by its headroom.
    pub fn load_protected_pool(&self, pool: &str) -> Option<&PoolConfig> {
        self.pools.iter().find(|p| p.name == pool && p.load_protected())
    }

    /// The load at which `pool`'s admission leases stop: the lowest tier's shedding level
    /// (`shedding.tier_levels`, 1.0 with none), and for a flow-controlled pool at most its
    /// `flow_control.leases_below_load`.
    pub fn lease_level(&self, pool: &PoolConfig) -> f64 {
        let lowest = self.shedding.lowest_level();
        pool.flow_control.map_or(lowest, |f| f.leases_below_load.min(lowest))
    }

    /// Whether an `endpoint_pickers[]` listener picks for `pool` (then the admission does not).
    pub fn pool_has_endpoint_picker(&self, pool: &str) -> bool {
        self.endpoint_pickers.iter().any(|e| e.pool == pool)
    }
}

/// Where the sidecar's ext_proc streams take a request's facts from.
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum FactsSource {
    /// The wasm filter's filter state `wasm.llm_gateway.request`, which clients cannot write,
    /// sent by Envoy's ext_proc filter as an attribute (`request_attributes`). A request without
    /// it is refused (403 `missing_tenant`) and never metered.
    #[default]
    FilterState,
    /// The `x-gateway-*` request headers, for Envoy Gateway, whose ext_proc cannot be sent
    /// filter state: trusted only because the wasm filter runs first and removes client-sent
    /// `x-gateway-*` headers; leases are never honoured this way. The filter must set them
    /// (its `upstream_headers: all`); with `routing` every request lacks a tenant and is
    /// refused (403 `missing_tenant`).
    Headers,
}

fn default_shutdown_grace_ms() -> u64 {
    10_000
}

/// A model with an exact tokenizer (see [`crate::admission::context`]).
#[derive(Debug, Clone, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// The canonical model name, as the filter sends it in `x-gateway-model`. Unique, non-empty.
    pub name: String,
    /// The model's context window in tokens (vLLM `--max-model-len`), > 0.
    pub max_model_len: u64,
    /// The vocabulary: `{huggingface: PATH}`, `{tiktoken: {ranks, pattern, special_tokens,
    /// normalization, add_bos}}` or `{tekken: PATH}` (see `gateway_tokenize::spec`).
    pub tokenizer: gateway_tokenize::spec::TokenizerSpec,
    /// The chat template: `{tokenizer_config: PATH, jinja: PATH, bos_token, eos_token,
    /// content_format}`. Absent: only completions prompts are counted exactly.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chat_template: Option<gateway_tokenize::spec::ChatTemplateSpec>,
}

/// Settings of the exact context check.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ContextConfig {
    /// Longest time one exact count may take, in milliseconds (default 300); past it the request
    /// goes on with the filter's estimate and vLLM decides. Keep it below the admission filter's
    /// `message_timeout`.
    #[serde(default = "default_count_timeout_ms")]
    pub count_timeout_ms: u64,
    /// Exact counts one tenant may run at once (default 1, at least 1): its further requests
    /// needing one go on undecided (vLLM decides) instead of queueing behind the CPU.
    #[serde(default = "default_max_counts_per_tenant")]
    pub max_counts_per_tenant: usize,
    /// The largest request body Envoy may send for an exact count, in bytes: the filter's
    /// `max_body_bytes` (default 4 MiB, the filter's default). The gRPC server's decode limit is
    /// this plus 1 MiB for the message around it (tonic's own default, 4 MiB, would refuse a body
    /// at the filter's limit and fail the request with a 500).
    #[serde(default = "default_context_max_body_bytes")]
    pub max_body_bytes: usize,
}

fn default_context_max_body_bytes() -> usize {
    4 << 20
}

impl ContextConfig {
    /// The gRPC decode limit in bytes: [`ContextConfig::max_body_bytes`] plus 1 MiB.
    pub fn grpc_max_message_bytes(&self) -> usize {
        self.max_body_bytes.saturating_add(1 << 20)
    }
}

impl Default for ContextConfig {
    fn default() -> Self {
        Self {
            count_timeout_ms: default_count_timeout_ms(),
            max_counts_per_tenant: default_max_counts_per_tenant(),
            max_body_bytes: default_context_max_body_bytes(),
        }
    }
}

fn default_max_counts_per_tenant() -> usize {
    1
}

fn default_count_timeout_ms() -> u64 {
    300
}

/// Metering settings.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MeteringConfig {
    /// Redis Stream that receives one protobuf `llm_gateway.v1.UsageEvent` per finished request
    /// (default `<key_prefix>:usage-events`).
    #[serde(default)]
    pub stream: Option<String>,
    /// Approximate maximum length of that stream (XADD MAXLEN ~), default 1,000,000.
    #[serde(default = "default_stream_maxlen")]
    pub stream_maxlen: u64,
    /// No longer used (default 4 MiB, must be > 0): the meter no longer buffers a non-streaming
    /// JSON response but scans it for its top-level `usage` (holding at most
    /// `gateway_meter::MAX_USAGE_BYTES` of it), so bodies of any size are metered. Still accepted
    /// so that existing configurations load.
    #[serde(default = "default_max_json_body_bytes")]
    pub max_json_body_bytes: usize,
    /// Usage records held in memory while Redis is unavailable, flushed when it returns
    /// (default 100,000). Past it, the oldest record is logged whole at error level and counted
    /// in `llm_gateway_usage_records_dropped_total`, never dropped silently.
    #[serde(default = "default_buffer_records")]
    pub buffer_records: usize,
    /// The ledger's open reservations ([`crate::metering::ledger`]): when one whose usage never arrived is
    /// recorded as charged.
    #[serde(default)]
    pub reservations: ReservationsConfig,
    /// The usage journal this replica tails ([`crate::metering::journal`]; standalone: the file Envoy's
    /// journal access log writes). Absent: none.
    #[serde(default)]
    pub journal: Option<JournalConfig>,
}

fn default_buffer_records() -> usize {
    100_000
}

impl Default for MeteringConfig {
    fn default() -> Self {
        Self {
            stream: None,
            stream_maxlen: default_stream_maxlen(),
            max_json_body_bytes: default_max_json_body_bytes(),
            buffer_records: default_buffer_records(),
            reservations: ReservationsConfig::default(),
            journal: None,
        }
    }
}

/// `metering.reservations`: how the sweeper ([`crate::metering::sweeper`], on every replica) records as
/// charged the reservations of admitted requests whose usage never arrived.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ReservationsConfig {
    /// Age in milliseconds past which an open reservation is recorded as charged: the longest a
    /// request's stream can live plus the time its usage can take to arrive (default 3,900,000:
    /// the standalone bootstrap's `max_stream_duration`, 1 h, which bounds a stream's life in
    /// Envoy whatever it streams, plus 5 minutes for the access log's batching and connection
    /// retries; 1,000 to 604,800,000). Envoy's idle timeouts (`stream_idle_timeout`, the route's
    /// `idle_timeout`) only bound a stream's silences: without a `max_stream_duration` below this
    /// age, a live stream can outlast it, and its real usage, arriving after the charge, is not
    /// applied.
    #[serde(default = "default_record_after_ms")]
    pub record_after_ms: u64,
    /// How often each replica sweeps, in milliseconds (default 5,000; 100 to 600,000). A sweep is
    /// one Redis call per configured tenant.
    #[serde(default = "default_sweep_interval_ms")]
    pub sweep_interval_ms: u64,
    /// Most reservations one sweep charges per tenant (default 100; 1 to 10,000).
    #[serde(default = "default_sweep_batch")]
    pub sweep_batch: usize,
}

impl Default for ReservationsConfig {
    fn default() -> Self {
        Self {
            record_after_ms: default_record_after_ms(),
            sweep_interval_ms: default_sweep_interval_ms(),
            sweep_batch: default_sweep_batch(),
        }
    }
}

fn default_record_after_ms() -> u64 {
    3_900_000
}

fn default_sweep_interval_ms() -> u64 {
    5_000
}

fn default_sweep_batch() -> usize {
    100
}

fn default_stream_maxlen() -> u64 {
    1_000_000
}

fn default_max_json_body_bytes() -> usize {
    4 << 20
}

/// `metering.journal`: the usage journal this replica tails.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct JournalConfig {
    /// The file Envoy's journal access log writes (`envoy/access_log_journal.yaml`'s `path`),
    /// readable by the sidecar.
    pub path: PathBuf,
    /// The journal's name in Redis (its lease and checkpoint keys; default: the path). Give each
    /// Envoy's journal its own name when several Envoys share a Redis.
    #[serde(default)]
    pub name: Option<String>,
    /// How often the holder reads what was appended, in milliseconds (default 200; 10 to 60,000).
    #[serde(default = "default_poll_interval_ms")]
    pub poll_interval_ms: u64,
    /// How long the lease outlives its holder's last renewal, in milliseconds: how soon another
    /// replica takes over a dead holder's journal (default 3,000; 500 to 600,000; above 2 polls).
    #[serde(default = "default_lease_ms")]
    pub lease_ms: u64,
    /// Most lines applied per Redis batch before the checkpoint moves (default 512; 1 to 100,000).
    #[serde(default = "default_batch_lines")]
    pub batch_lines: usize,
}

fn default_poll_interval_ms() -> u64 {
    200
}

fn default_lease_ms() -> u64 {
    3_000
}

fn default_batch_lines() -> usize {
    512
}

impl JournalConfig {
    /// Checks the settings; errors name the field (`field` is this section's path).
    ///
    /// # Errors
    /// `(field, message)` of the first invalid setting.
    pub fn validate(&self, field: &str) -> Result<(), (String, &'static str)> {
        if self.path.as_os_str().is_empty() || !self.path.is_absolute() {
            return Err((format!("{field}.path"), "must be an absolute path"));
        }
        if self.name.as_deref().is_some_and(|n| n.is_empty() || n.len() > 200) {
            return Err((format!("{field}.name"), "must be 1 to 200 characters"));
        }
        if !(10..=60_000).contains(&self.poll_interval_ms) {
            return Err((format!("{field}.poll_interval_ms"), "must be in 10..=60000"));
        }
        if !(500..=600_000).contains(&self.lease_ms) {
            return Err((format!("{field}.lease_ms"), "must be in 500..=600000"));
        }
        if self.lease_ms <= 2 * self.poll_interval_ms {
            return Err((format!("{field}.lease_ms"), "must be more than twice poll_interval_ms"));
        }
        if !(1..=100_000).contains(&self.batch_lines) {
            return Err((format!("{field}.batch_lines"), "must be in 1..=100000"));
        }
        Ok(())
    }

    /// The journal's name in Redis.
    pub fn name(&self) -> String {
        self.name.clone().unwrap_or_else(|| self.path.display().to_string())
    }
}

impl Config {
    /// Reads, parses and validates a YAML config file, then reads the files and environment
    /// variables it names ([`Config::read_secrets`]).
    ///
    /// # Errors
    /// [`ConfigError`] naming the file (read and parse errors) or the field (validation, and a
    /// TLS file or password that cannot be read).
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let display = path.display().to_string();
        let text = std::fs::read_to_string(path)
            .map_err(|source| ConfigError::Read { path: display.clone(), source })?;
        let mut config = Self::from_yaml(&text).map_err(|e| match e {
            ConfigError::Parse { message, .. } => ConfigError::Parse { path: display, message },
            other => other,
        })?;
        config.read_secrets()?;
        Ok(config)
    }

    /// Parses and validates YAML text. Reads no file: the TLS files and the Redis password are
    /// read by [`Config::read_secrets`] (gatewayctl validates configs for other hosts with this).
    ///
    /// # Errors
    /// [`ConfigError::Parse`] (with an empty path) or [`ConfigError::Invalid`].
    pub fn from_yaml(text: &str) -> Result<Self, ConfigError> {
        let config: Config = serde_yaml_ng::from_str(text)
            .map_err(|e| ConfigError::Parse { path: String::new(), message: e.to_string() })?;
        config.validate()?;
        Ok(config)
    }

    /// Reads the files and environment variables the config names: the listener's certificate,
    /// key and client CA (`tls.*`), Redis's CA and client certificate (`redis.tls.*`) and the
    /// Redis password (`redis.password_file` or `redis.password_env`), into
    /// [`ListenerTls::pem`] and [`RedisConfig::secrets`].
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] naming the field: a file that cannot be read or holds no PEM of
    /// the expected kind, an unset variable, an empty password (never the secret itself).
    pub fn read_secrets(&mut self) -> Result<(), ConfigError> {
        if let Some(tls) = &mut self.tls {
            let cert = read_pem("tls.cert_file", &tls.cert_file, PemKind::Certificates)?;
            let key = read_pem("tls.key_file", &tls.key_file, PemKind::PrivateKey)?;
            let client_ca = read_pem("tls.client_ca_file", &tls.client_ca_file, PemKind::Certificates)?;
            tls.pem = Some(ListenerPem { cert, key: Secret(key), client_ca });
        }
        let redis = &mut self.redis;
        let password = match (&redis.password_file, &redis.password_env) {
            (Some(path), None) => {
                let text = std::fs::read_to_string(path)
                    .map_err(|e| invalid("redis.password_file", format!("{}: {e}", path.display())))?;
                Some(
                    text.strip_suffix('\n')
                        .map(|t| t.strip_suffix('\r').unwrap_or(t))
                        .unwrap_or(&text)
                        .to_owned(),
                )
            }
            (None, Some(var)) => Some(std::env::var(var).map_err(|_| {
                invalid("redis.password_env", format!("environment variable {var} is not set (or not UTF-8)"))
            })?),
            _ => None,
        };
        if let Some(password) = &password {
            let field =
                if redis.password_file.is_some() { "redis.password_file" } else { "redis.password_env" };
            if password.is_empty() {
                return Err(invalid(field, "the password is empty"));
            }
            if password.contains(['\n', '\r']) {
                return Err(invalid(field, "the password has a line break inside"));
            }
        }
        redis.secrets.password = password.map(Secret);
        if let Some(tls) = &redis.tls {
            redis.secrets.ca = match &tls.ca_file {
                Some(path) => Some(read_pem("redis.tls.ca_file", path, PemKind::Certificates)?),
                None => None,
            };
            redis.secrets.client = match (&tls.cert_file, &tls.key_file) {
                (Some(cert), Some(key)) => Some((
                    read_pem("redis.tls.cert_file", cert, PemKind::Certificates)?,
                    Secret(read_pem("redis.tls.key_file", key, PemKind::PrivateKey)?),
                )),
                _ => None,
            };
        }
        Ok(())
    }
    /// The limits of a tenant, if configured.
    pub fn tenant(&self, id: &str) -> Option<&TenantConfig> {
        self.tenants.iter().find(|t| t.id == id)
    }

    /// Name of the usage-event Redis Stream.
    pub fn usage_stream(&self) -> String {
        self.metering.stream.clone().unwrap_or_else(|| format!("{}:usage-events", self.redis.key_prefix))
    }

    /// Whether `flow_control` is set but no pool has its own `flow_control` section, so that no
    /// request is ever queued (a pool with `max_in_flight` alone sheds its tiers instead): the
    /// sidecar warns of it at start.
    pub fn flow_control_unused(&self) -> bool {
        self.flow_control.is_some() && self.pools.iter().all(|p| p.flow_control.is_none())
    }
}
