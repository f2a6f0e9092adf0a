//! Sidecar configuration: a strict YAML file, validated once at start-up.
//!
//! Unknown fields are rejected (`deny_unknown_fields`) and every check names the field it failed
//! on, e.g. `tenants[1].limits.requests_per_minute: must be > 0`.

use std::collections::{BTreeMap, HashSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

/// Errors from loading the sidecar configuration. Each names the file or the field.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("{path}: {source}")]
    Read {
        /// The config file's path.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The YAML did not match the schema (unknown field, wrong type, missing field).
    #[error("{path}: {message}")]
    Parse {
        /// The config file's path.
        path: String,
        /// serde's message, which names the field and the line.
        message: String,
    },
    /// A value parsed but is not valid.
    #[error("{field}: {message}")]
    Invalid {
        /// Dotted path of the offending field, e.g. `tenants[0].id`.
        field: String,
        /// What is wrong with it.
        message: String,
    },
}

fn invalid(field: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid { field: field.into(), message: message.into() }
}

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
    /// Where the ext_proc streams read a request's tenant, model, pool, token counts and lease
    /// (default `filter_state`). The gRPC access log always reads the filter state.
    #[serde(default)]
    pub request_facts: FactsSource,
    /// The sidecar as the endpoint picker (EPP) of Gateway API Inference Extension InferencePools
    /// ([`crate::epp`]): one gRPC listener per entry, each picking for one pool that has a
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
    /// `picker` does not allow them ([`PickerConfig::admission_leases`]); a pool the config does
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
#[derive(Debug, Clone, Deserialize)]
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
    #[serde(default)]
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

/// One vLLM pool (an Envoy cluster, named as the filter's `x-gateway-pool`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolConfig {
    /// The Envoy cluster name.
    pub name: String,
    /// Base URLs of its vLLM endpoints (`http://host:port`), whose `/metrics` are scraped for
    /// `vllm:num_requests_waiting`, `vllm:num_requests_running`, `vllm:kv_cache_usage_perc`
    /// (or the older `vllm:gpu_cache_usage_perc`) and `vllm:request_success_total`.
    #[serde(default)]
    pub endpoints: Vec<String>,
    /// Scrape interval in milliseconds (default 500).
    #[serde(default = "default_scrape_interval_ms")]
    pub scrape_interval_ms: u64,
    /// Requests waiting in the pool's queues (summed over endpoints) at which the pool is full.
    #[serde(default)]
    pub max_queue_depth: Option<u64>,
    /// KV-cache usage (0..1, the highest endpoint's) at which the pool is full.
    #[serde(default)]
    pub max_kv_cache_usage: Option<f64>,
    /// Requests admitted to the pool and not yet finished, over every sidecar replica sharing
    /// the Redis (`crate::pools`), at which the pool is full.
    #[serde(default)]
    pub max_in_flight: Option<u64>,
    /// The endpoint picker (issue 12): with it, every request this sidecar admits to the pool is
    /// sent to an endpoint it picks ([`crate::scheduling`]); without it, Envoy's `LEAST_REQUEST`
    /// picks. Needs `endpoints`, each `http://ip:port` (an IP literal: the pick names Envoy's
    /// host by address).
    #[serde(default)]
    pub picker: Option<PickerConfig>,
    /// Flow control (issue 13): with it, a request of a tier listed in `flow_control.tiers`
    /// that finds the pool without room ([`crate::flow_control::drain`]: `max_in_flight`,
    /// `max_queue_depth`, `max_kv_cache_usage`) waits in the pool's queue instead of being shed.
    #[serde(default)]
    pub flow_control: Option<PoolFlowConfig>,
    /// Whether the sidecar grants the filter admission leases for this pool (with
    /// `redis.lease_fraction`). A request admitted from a lease never reaches the sidecar: it is
    /// not shed, queued or picked one by one, and the pool's load sees it only through the
    /// filter's next report. For a pool with a `max_*` threshold or `flow_control`, a lease
    /// therefore covers at most the pool's headroom before its shedding level less what this
    /// replica's other leases of it may still admit ([`crate::admission::lease_headroom`]; unbounded, an
    /// overloaded shed pool's TTFT p99 was 4.64× unloaded against 0.97× decided one by one:
    /// docs/deploy.md, "Why leases are the default").
    /// Unset: false for a pool with `flow_control` (its queue orders the requests), its picker's
    /// `admission_leases` for a picking pool, true otherwise
    /// ([`Config::pool_allows_admission_leases`]).
    #[serde(default)]
    pub admission_leases: Option<bool>,
}

impl PoolConfig {
    /// Whether the sidecar sheds or queues this pool's requests by its load: a `max_*` threshold
    /// or `flow_control`.
    pub fn load_protected(&self) -> bool {
        self.max_queue_depth.is_some()
            || self.max_kv_cache_usage.is_some()
            || self.max_in_flight.is_some()
            || self.flow_control.is_some()
    }
}

fn default_scrape_interval_ms() -> u64 {
    500
}

/// `flow_control`: which tiers queue, in which order, for how long, and how tenants share.
#[derive(Debug, Clone, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct FlowControlConfig {
    /// The tiers that wait in a saturated pool's queue, highest priority first: a queued request
    /// of a tier is always dispatched before any of the tiers after it. A tier not listed is
    /// never queued: it is shed at its `shedding.tier_levels` level (1.0 unlisted) as before.
    pub tiers: Vec<QueueTierConfig>,
    /// Weight of a completion token against a prompt token in a tenant's attained service (the
    /// virtual token counter of "Fairness in Serving Large Language Models", OSDI 2024, whose
    /// evaluation uses 2). Default 2; 0 to 100.
    #[serde(default = "default_output_token_weight")]
    pub output_token_weight: f64,
    /// Fair-share weight per tenant id (default 1): a tenant of weight 2 is served twice the
    /// tokens of a tenant of weight 1 of its tier while both are backlogged. Each > 0 and at most
    /// 1000; the tenant must be in `tenants`.
    #[serde(default)]
    pub tenant_weights: BTreeMap<String, f64>,
    /// The share of each tier's room (0 to 0.5, default 0) that requests of backlogged tenants
    /// leave free, for a request whose tenant had nothing queued in its tier when it came
    /// ([`crate::flow_control::queue::FlowQueue::pass_newcomer`], `pop_newcomer`): it is let in
    /// at once instead of waiting for the pool's next completion (trunk reservation, as
    /// telephone exchanges keep circuits back). The price: backlogged tenants fill the pool only
    /// to `1 - newcomer_reserve` of each tier's `max_load`, so a saturated pool serves up to that
    /// share less while no newcomer uses it.
    #[serde(default)]
    pub newcomer_reserve: f64,
}

fn default_output_token_weight() -> f64 {
    2.0
}

/// `flow_control.tiers[]`.
#[derive(Debug, Clone, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct QueueTierConfig {
    /// The tier, as the filter's tenants name it (`x-gateway-tier`).
    pub name: String,
    /// The longest a request of the tier may wait in the queue, in milliseconds (1 to 600,000):
    /// the part of its TTFT budget the queue may spend. A request whose predicted wait is longer
    /// is refused 429 `overloaded` at once; one still queued when it runs out gets the same 429.
    /// Envoy's admission filter must allow the wait: its `max_message_timeout` at least the
    /// largest budget plus [`crate::flow_control::MESSAGE_TIMEOUT_MARGIN`].
    pub max_queue_wait_ms: u64,
    /// The share of a pool's room the tier may fill (default 1; in (0, 1], never above the
    /// tier before it): its requests are dispatched only while the pool's load
    /// ([`crate::flow_control::drain::load`]) is below it, so that the rest stays free for the
    /// higher tiers' requests, which then wait for nothing (e.g. batch 0.6).
    #[serde(default = "default_max_load")]
    pub max_load: f64,
}

fn default_max_load() -> f64 {
    1.0
}

/// `pools[].flow_control`.
#[derive(Debug, Clone, Copy, Deserialize, serde::Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PoolFlowConfig {
    /// The most requests the pool's queue holds (default 1000; 1 to 1,000,000). A request that
    /// finds it full takes the place of the newest request of the lowest tier below its own, or
    /// is refused 429 `overloaded`.
    #[serde(default = "default_max_queued")]
    pub max_queued: usize,
    /// The most bytes of request bodies the pool's queue holds, which Envoy keeps buffered while
    /// their requests wait (default 64 MiB; 1 MiB to 64 GiB). Shared among the tenants with
    /// requests queued by their weights, as `max_queued` is; a request whose body finds no room
    /// is refused 429 `overloaded` (`reason="bytes"`). Keep the sum over the pools, with the
    /// filter's upload buffers (`max_uploads_per_tenant` x `max_body_bytes` per tenant and
    /// worker), well under Envoy's heap limit (`envoy.edge.max_heap_bytes`), so that no tenant's
    /// queued bodies can bring Envoy's overload manager to refuse every request.
    #[serde(default = "default_max_queued_bytes")]
    pub max_queued_bytes: u64,
    /// The filter's admission leases for the pool stop while anything is queued or its load
    /// (`shedding::load`) is at this level, so that its requests go through the queue (default
    /// 0.8; in (0, 1]).
    #[serde(default = "default_leases_below_load")]
    pub leases_below_load: f64,
}

fn default_max_queued() -> usize {
    1000
}

/// `pools[].flow_control.max_queued_bytes` when unset: 64 MiB.
pub const DEFAULT_MAX_QUEUED_BYTES: u64 = 64 << 20;

fn default_max_queued_bytes() -> u64 {
    DEFAULT_MAX_QUEUED_BYTES
}

fn default_leases_below_load() -> f64 {
    0.8
}

/// `pools[].picker`: the weights of the endpoint picker's scorers and its bounds
/// ([`crate::scheduling`]). Every member is optional, with the default given.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PickerConfig {
    /// Weight of the prefix-affinity score (the share of the request's prompt blocks the
    /// endpoint served recently). Finite, >= 0; default 3.
    #[serde(default = "default_prefix_weight")]
    pub prefix_weight: f64,
    /// Weight of the queue score (`vllm:num_requests_waiting`, min-max normalized over the
    /// eligible endpoints). Finite, >= 0; default 2.
    #[serde(default = "default_load_weight")]
    pub queue_weight: f64,
    /// Weight of the KV-cache score (1 - `vllm:kv_cache_usage_perc`). Finite, >= 0; default 2.
    #[serde(default = "default_load_weight")]
    pub kv_cache_weight: f64,
    /// Weight of the in-flight score (this sidecar's requests on the endpoint not yet finished,
    /// min-max normalized). Finite, >= 0; default 2.
    #[serde(default = "default_load_weight")]
    pub in_flight_weight: f64,
    /// Weight of the latency score (the expected wait: the endpoint's recent mean
    /// `vllm:time_to_first_token_seconds` × (waiting + in flight + 1), min-max normalized: the
    /// shortest scores 1). Finite, >= 0; default 1 (it is the one score that weighs load by speed;
    /// its TTFT includes prefix-cache hits, so a heavier weight herds new prompts onto the
    /// replicas that hit most: bench/picker.py scenario a, TTFT p99 0.69x of LEAST_REQUEST at
    /// weight 4 against 0.47x at 1, scenario c 0.46x against 0.59x).
    #[serde(default = "default_latency_weight")]
    pub latency_weight: f64,
    /// Bounded-load affinity: the endpoint holding the request's longest prefix wins outright
    /// while `load + 1 <= affinity_load_factor x (least load + 1)` over the eligible endpoints
    /// (load = waiting + in flight, see [`crate::scheduling::picker`]); past it the scores
    /// decide. Finite, >= 1; default 2.
    #[serde(default = "default_affinity_load_factor")]
    pub affinity_load_factor: f64,
    /// Block hashes remembered per endpoint (an LRU). >= 1, at most 10,000,000; default 16,384:
    /// 1 MiB of prompt text at the filter's default 64-byte blocks, about 250k tokens. Size it
    /// to what one replica's prefix cache holds.
    #[serde(default = "default_prefix_lru_blocks")]
    pub prefix_lru_blocks: usize,
    /// Endpoints sent after the pick, best first, for Envoy to try when the pick fails. At most
    /// 16; default 1.
    #[serde(default = "default_fallback_endpoints")]
    pub fallback_endpoints: usize,
    /// An endpoint whose last successful scrape is older than this (milliseconds), or whose last
    /// scrape failed, is never picked. > `scrape_interval_ms`; default the larger of 2,000 and
    /// 3 x `scrape_interval_ms` (set when the config is loaded).
    #[serde(default)]
    pub stale_after_ms: Option<u64>,
    /// Whether the sidecar grants the filter admission leases for this pool (with
    /// `redis.lease_fraction`). Requests admitted from a lease never reach the sidecar, so they are
    /// not picked (Envoy's LEAST_REQUEST chooses their replica): default false, every request of a
    /// picking pool takes the ext_proc admission and is picked. docs/benchmarks.md ("Endpoint
    /// picking", target `picker-leases`) measures what leases cost the picker.
    #[serde(default)]
    pub admission_leases: bool,
}

fn default_prefix_weight() -> f64 {
    3.0
}
fn default_load_weight() -> f64 {
    2.0
}
fn default_affinity_load_factor() -> f64 {
    2.0
}
fn default_latency_weight() -> f64 {
    1.0
}
fn default_prefix_lru_blocks() -> usize {
    16_384
}
fn default_fallback_endpoints() -> usize {
    1
}

/// Most `picker.prefix_lru_blocks`.
pub const MAX_PREFIX_LRU_BLOCKS: usize = 10_000_000;
/// Most `picker.fallback_endpoints`.
pub const MAX_FALLBACK_ENDPOINTS: usize = 16;

impl PickerConfig {
    /// `stale_after_ms`, or its default for a pool scraped every `scrape_interval_ms`.
    pub fn stale_after_ms(&self, scrape_interval_ms: u64) -> u64 {
        self.stale_after_ms.unwrap_or_else(|| scrape_interval_ms.saturating_mul(3).max(2_000))
    }

    fn validate(&self, field: &str, scrape_interval_ms: u64) -> Result<(), ConfigError> {
        for (name, w) in [
            ("prefix_weight", self.prefix_weight),
            ("queue_weight", self.queue_weight),
            ("kv_cache_weight", self.kv_cache_weight),
            ("in_flight_weight", self.in_flight_weight),
            ("latency_weight", self.latency_weight),
        ] {
            if !(w.is_finite() && w >= 0.0) {
                return Err(invalid(format!("{field}.{name}"), "must be a finite number >= 0"));
            }
        }
        if !(self.affinity_load_factor.is_finite() && self.affinity_load_factor >= 1.0) {
            return Err(invalid(format!("{field}.affinity_load_factor"), "must be a finite number >= 1"));
        }
        if !(1..=MAX_PREFIX_LRU_BLOCKS).contains(&self.prefix_lru_blocks) {
            return Err(invalid(
                format!("{field}.prefix_lru_blocks"),
                format!("must be in 1..={MAX_PREFIX_LRU_BLOCKS}"),
            ));
        }
        if self.fallback_endpoints > MAX_FALLBACK_ENDPOINTS {
            return Err(invalid(
                format!("{field}.fallback_endpoints"),
                format!("must be at most {MAX_FALLBACK_ENDPOINTS}"),
            ));
        }
        if let Some(ms) = self.stale_after_ms {
            if ms <= scrape_interval_ms {
                return Err(invalid(
                    format!("{field}.stale_after_ms"),
                    format!("must be > scrape_interval_ms ({scrape_interval_ms})"),
                ));
            }
        }
        Ok(())
    }
}

/// The `ip:port` of an endpoint base URL `http://ip:port` (a trailing `/` allowed), as the pick
/// names it (IPv6 as `[addr]:port`); None for anything else (a host name, a path, no port).
pub fn endpoint_addr(url: &str) -> Option<std::net::SocketAddr> {
    url.strip_prefix("http://")?.trim_end_matches('/').parse().ok()
}

/// Tier shedding levels: a request of a tier is shed when its pool's load (the highest of
/// waiting/max_queue_depth, kv_cache_usage/max_kv_cache_usage, in_flight/max_in_flight) reaches
/// the tier's level. Tiers not listed (the highest) are shed only at the hard ceiling, 1.0.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SheddingConfig {
    /// Level per tier, in (0, 1], e.g. `{batch: 0.5, standard: 0.8}`.
    #[serde(default)]
    pub tier_levels: BTreeMap<String, f64>,
}

impl SheddingConfig {
    /// The load level at which a tier is shed (1.0 for tiers not listed).
    pub fn level(&self, tier: &str) -> f64 {
        self.tier_levels.get(tier).copied().unwrap_or(1.0)
    }

    /// The lowest level any tier is shed at (1.0, the hard ceiling, when none is listed): below
    /// it no request of the pool is shed.
    pub fn lowest_level(&self) -> f64 {
        self.tier_levels.values().copied().fold(1.0, f64::min)
    }
}

/// mTLS of the sidecar's gRPC listener: its certificate, and the CA whose certificates clients
/// (Envoy) must present; a connection without one, or with one from another CA, fails its TLS
/// handshake before any gRPC call. PEM files, read once at start-up.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListenerTls {
    /// The server certificate chain (PEM, leaf first).
    pub cert_file: PathBuf,
    /// The server's private key (PEM: PKCS#8, PKCS#1 or SEC1).
    pub key_file: PathBuf,
    /// The CA certificate(s) (PEM) that sign the clients' certificates. Required: the listener
    /// never accepts a client without a certificate.
    pub client_ca_file: PathBuf,
    /// PEM bytes read at load time (see [`Config::load`]).
    #[serde(skip)]
    pub pem: Option<ListenerPem>,
}

/// The PEM contents of [`ListenerTls`]'s files, checked at load.
#[derive(Clone)]
pub struct ListenerPem {
    /// Certificate chain.
    pub cert: Vec<u8>,
    /// Private key.
    pub key: Secret<Vec<u8>>,
    /// Client CA certificate(s).
    pub client_ca: Vec<u8>,
}

impl std::fmt::Debug for ListenerPem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ListenerPem").field("key", &self.key).finish_non_exhaustive()
    }
}

/// A secret (a Redis password, a private key): its `Debug` prints `<redacted>`, it has no
/// `Display`, and it is read only through [`Secret::expose`].
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Secret<T>(T);

impl<T> Secret<T> {
    /// The secret value.
    pub fn expose(&self) -> &T {
        &self.0
    }
}

impl<T> std::fmt::Debug for Secret<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

/// TLS towards Redis (`rediss://` URLs): the CA that signs the Redis server certificates
/// (absent: the system's roots) and a client certificate for a Redis that requires one
/// (`tls-auth-clients yes`). PEM files, read once at start-up. The server's name (or IP) in the
/// URL must be in its certificate; there is no way to skip the check.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RedisTls {
    /// CA certificate(s) (PEM) trusted for the Redis servers, instead of the system's roots.
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
    /// Client certificate chain (PEM); with `key_file`.
    #[serde(default)]
    pub cert_file: Option<PathBuf>,
    /// Client private key (PEM); with `cert_file`.
    #[serde(default)]
    pub key_file: Option<PathBuf>,
}

/// The PEM contents of [`RedisTls`]'s files and the password, read at load.
#[derive(Debug, Clone, Default)]
pub struct RedisSecrets {
    /// The password (`redis.password_file` or `redis.password_env`).
    pub password: Option<Secret<String>>,
    /// The CA certificate(s).
    pub ca: Option<Vec<u8>>,
    /// The client certificate chain and key.
    pub client: Option<(Vec<u8>, Secret<Vec<u8>>)>,
}

/// Redis connection settings.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RedisConfig {
    /// Single-instance URL: `redis://host:6379/0`, or `rediss://host:6380/0` for TLS. Exactly one
    /// of `url` and `cluster_urls` must be set. Credentials never go in a URL (refused: a URL
    /// with `user@`, `user:password@` or a `pass=` parameter); set `username` and
    /// `password_file` / `password_env`.
    #[serde(default)]
    pub url: Option<String>,
    /// Seed node URLs of a Redis Cluster (all `redis://` or all `rediss://`).
    #[serde(default)]
    pub cluster_urls: Vec<String>,
    /// Redis ACL user to authenticate as (`AUTH <username> <password>`); needs a password.
    /// Absent: `AUTH <password>` (the `default` user, `requirepass`) when a password is set.
    #[serde(default)]
    pub username: Option<String>,
    /// File holding the Redis password (one trailing newline is ignored), e.g. a mounted
    /// Kubernetes Secret. At most one of `password_file` and `password_env`.
    #[serde(default)]
    pub password_file: Option<PathBuf>,
    /// Environment variable holding the Redis password.
    #[serde(default)]
    pub password_env: Option<String>,
    /// TLS settings for `rediss://` URLs (absent with `rediss://`: the system's roots, no
    /// client certificate).
    #[serde(default)]
    pub tls: Option<RedisTls>,
    /// The password and PEM contents, read at load ([`Config::load`]); never printed.
    #[serde(skip)]
    pub secrets: RedisSecrets,
    /// Timeout of one Redis command, in milliseconds (default 25).
    #[serde(default = "default_command_timeout_ms")]
    pub command_timeout_ms: u64,
    /// Prefix of every key the sidecar writes (default `llmgw`).
    #[serde(default = "default_key_prefix")]
    pub key_prefix: String,
    /// What admission does when Redis cannot decide (error, timeout, open breaker): `open`
    /// applies approximate limits from in-memory buckets in this sidecar, `closed` answers 503
    /// `rate_limiter_unavailable`. Default `open`; per tier in `tier_failure_modes`.
    #[serde(default)]
    pub failure_mode: FailureMode,
    /// Failure mode per tenant tier (`x-gateway-tier`), overriding `failure_mode`.
    #[serde(default)]
    pub tier_failure_modes: BTreeMap<String, FailureMode>,
    /// Circuit breaker in front of Redis.
    #[serde(default)]
    pub breaker: BreakerConfig,
    /// With failure mode `open`, the share of each limit (burst and rate) this sidecar's
    /// in-memory buckets allow, in (0, 1] (default 1). With N sidecars, 1/N keeps the tenant near
    /// its limit while Redis is away instead of up to N times it.
    #[serde(default = "default_local_share")]
    pub local_share: f64,
    /// Token leases (default 0: none): a sidecar takes up to this fraction of a bucket's capacity
    /// from Redis with a request, and admits the next requests of that bucket from it without a
    /// Redis round trip. In [0, 0.5]. Never over-admits; under-admits by at most the leases the
    /// other sidecars hold, and `x-ratelimit-remaining-*` of a leased admission is approximate.
    /// Buckets whose lease would not cover two requests are not leased.
    #[serde(default)]
    pub lease_fraction: f64,
    /// How long a lease admits after its last grant before its unused tokens go back to Redis,
    /// in milliseconds (default 1000).
    #[serde(default = "default_lease_ttl_ms")]
    pub lease_ttl_ms: u64,
}

fn default_lease_ttl_ms() -> u64 {
    1000
}

fn default_local_share() -> f64 {
    1.0
}

impl RedisConfig {
    /// The failure mode of a tier.
    pub fn failure_mode(&self, tier: &str) -> FailureMode {
        self.tier_failure_modes.get(tier).copied().unwrap_or(self.failure_mode)
    }
}

/// Circuit breaker settings: after `failure_threshold` consecutive Redis failures, decisions are
/// made degraded at once for `open_ms`, then one probe goes to Redis.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BreakerConfig {
    /// Consecutive failures that open the breaker (default 3).
    #[serde(default = "default_failure_threshold")]
    pub failure_threshold: u32,
    /// How long it stays open, in milliseconds (default 1000).
    #[serde(default = "default_open_ms")]
    pub open_ms: u64,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        Self { failure_threshold: default_failure_threshold(), open_ms: default_open_ms() }
    }
}

fn default_failure_threshold() -> u32 {
    3
}

fn default_open_ms() -> u64 {
    1000
}

/// Admission's behaviour when the limiter cannot decide.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureMode {
    /// Admit the request (limits are not enforced while Redis is away).
    #[default]
    Open,
    /// Refuse the request with 503.
    Closed,
}

fn default_command_timeout_ms() -> u64 {
    25
}

fn default_key_prefix() -> String {
    "llmgw".to_owned()
}

/// One tenant's limits.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantConfig {
    /// Tenant id, as the filter sends it in `x-gateway-tenant`. Letters, digits, `.`, `_`, `-`.
    pub id: String,
    /// The tenant's limits across all models.
    pub limits: Limits,
    /// Further limits per model (public model name, `x-gateway-model`), applied on top of
    /// `limits`: a request draws on both.
    #[serde(default)]
    pub model_limits: BTreeMap<String, Limits>,
    /// The tenant's token quotas per UTC day and calendar month across all models (absent: none;
    /// docs/deploy.md, "Quotas and cost").
    #[serde(default)]
    pub quota: Quota,
    /// Further quotas per model (public model name), on top of `quota`.
    #[serde(default)]
    pub model_quotas: BTreeMap<String, Quota>,
}

/// Token quotas (prompt plus completion tokens) per UTC day and per calendar month (UTC), each a
/// hard limit (429 `insufficient_quota` once used up) with an optional soft limit (the
/// `x-gateway-quota-warning` response header from there on). The default has none.
#[derive(Debug, Clone, Copy, Default, Deserialize, serde::Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Quota {
    /// Tokens per UTC day (hard limit). Absent: no daily quota.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_day: Option<u64>,
    /// Tokens per UTC day after which responses carry the warning header (below
    /// `tokens_per_day`). Absent: no warning.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub soft_tokens_per_day: Option<u64>,
    /// Tokens per calendar month, UTC (hard limit). Absent: no monthly quota.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_month: Option<u64>,
    /// Tokens per calendar month after which responses carry the warning header (below
    /// `tokens_per_month`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub soft_tokens_per_month: Option<u64>,
}

impl Quota {
    /// Whether no quota is set.
    pub fn is_empty(&self) -> bool {
        self.tokens_per_day.is_none() && self.tokens_per_month.is_none()
    }

    fn validate(&self, field: &str) -> Result<(), ConfigError> {
        for (hard_name, hard, soft_name, soft) in [
            ("tokens_per_day", self.tokens_per_day, "soft_tokens_per_day", self.soft_tokens_per_day),
            ("tokens_per_month", self.tokens_per_month, "soft_tokens_per_month", self.soft_tokens_per_month),
        ] {
            match (hard, soft) {
                (Some(0), _) => {
                    return Err(invalid(
                        format!("{field}.{hard_name}"),
                        "must be > 0 (omit it for no quota)",
                    ));
                }
                (Some(h), _) if h > MAX_QUOTA_TOKENS => {
                    return Err(invalid(
                        format!("{field}.{hard_name}"),
                        format!("must be <= {MAX_QUOTA_TOKENS}"),
                    ));
                }
                (None, Some(_)) => {
                    return Err(invalid(format!("{field}.{soft_name}"), format!("needs {hard_name}")));
                }
                (Some(h), Some(s)) if s == 0 || s >= h => {
                    return Err(invalid(
                        format!("{field}.{soft_name}"),
                        format!("must be in 1..{hard_name} ({h})"),
                    ));
                }
                _ => {}
            }
        }
        if let (Some(day), Some(month)) = (self.tokens_per_day, self.tokens_per_month) {
            if day > month {
                return Err(invalid(
                    format!("{field}.tokens_per_day"),
                    format!("must not exceed tokens_per_month ({month})"),
                ));
            }
        }
        Ok(())
    }
}

/// The largest quota: 10^15 tokens (Redis counters and Lua's doubles stay exact far beyond).
pub const MAX_QUOTA_TOKENS: u64 = 1_000_000_000_000_000;

/// A model's prices in USD per 1M tokens, each a multiple of 0.001 (so that a token's price is a
/// whole number of nano-dollars and every cost is exact: [`Price::nano_usd_per_token`]).
#[derive(Debug, Clone, Copy, Deserialize, serde::Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Price {
    /// Prompt tokens not served from the prefix cache.
    pub input: f64,
    /// Prompt tokens served from the prefix cache (`cached_tokens`; default: `input`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cached_input: Option<f64>,
    /// Completion tokens.
    pub output: f64,
}

/// The highest price accepted, USD per 1M tokens.
pub const MAX_PRICE_USD_PER_MILLION: f64 = 1_000_000.0;

/// USD per 1M tokens as nano-dollars per token (USD per 1M tokens × 1000), if it is exact.
fn nano_per_token(usd_per_million: f64) -> Option<u64> {
    if !(0.0..=MAX_PRICE_USD_PER_MILLION).contains(&usd_per_million) {
        return None;
    }
    let scaled = usd_per_million * 1000.0;
    let rounded = scaled.round();
    ((scaled - rounded).abs() <= 1e-6 * rounded.max(1.0)).then_some(rounded as u64)
}

impl Price {
    /// (input, cached input, output) in nano-dollars per token. Validated prices are exact.
    pub fn nano_usd_per_token(&self) -> (u64, u64, u64) {
        let input = nano_per_token(self.input).unwrap_or(0);
        let cached = self.cached_input.map_or(input, |c| nano_per_token(c).unwrap_or(0));
        (input, cached, nano_per_token(self.output).unwrap_or(0))
    }

    fn validate(&self, field: &str) -> Result<(), ConfigError> {
        for (name, value) in
            [("input", Some(self.input)), ("cached_input", self.cached_input), ("output", Some(self.output))]
        {
            if let Some(v) = value {
                if nano_per_token(v).is_none() {
                    return Err(invalid(
                        format!("{field}.{name}"),
                        format!("must be USD per 1M tokens in 0..={MAX_PRICE_USD_PER_MILLION}, a multiple of 0.001"),
                    ));
                }
            }
        }
        Ok(())
    }
}

/// Requests-per-minute and tokens-per-minute limits; each is a token bucket that refills
/// continuously at the per-minute rate and holds at most its burst. The default has no limit.
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Limits {
    /// Requests per minute (RPM). Absent: no request limit.
    #[serde(default)]
    pub requests_per_minute: Option<u64>,
    /// Bucket size for requests (default: `requests_per_minute`).
    #[serde(default)]
    pub request_burst: Option<u64>,
    /// Tokens per minute (TPM), prompt plus completion tokens. Absent: no token limit.
    #[serde(default)]
    pub tokens_per_minute: Option<u64>,
    /// Bucket size for tokens (default: `tokens_per_minute`).
    #[serde(default)]
    pub token_burst: Option<u64>,
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
    pub journal: Option<crate::metering::journal::JournalConfig>,
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

    fn validate(&self) -> Result<(), ConfigError> {
        match (&self.redis.url, self.redis.cluster_urls.is_empty()) {
            (Some(_), false) => return Err(invalid("redis", "set either url or cluster_urls, not both")),
            (None, true) => return Err(invalid("redis", "one of url or cluster_urls is required")),
            _ => {}
        }
        self.redis.validate_connection()?;
        if self.redis.command_timeout_ms == 0 {
            return Err(invalid("redis.command_timeout_ms", "must be > 0"));
        }
        if !(self.redis.local_share > 0.0 && self.redis.local_share <= 1.0) {
            return Err(invalid("redis.local_share", "must be in (0, 1]"));
        }
        if !(0.0..=0.5).contains(&self.redis.lease_fraction) {
            return Err(invalid("redis.lease_fraction", "must be in [0, 0.5]"));
        }
        if self.redis.lease_ttl_ms == 0 {
            return Err(invalid("redis.lease_ttl_ms", "must be > 0"));
        }
        if !valid_key_part(&self.redis.key_prefix) {
            return Err(invalid(
                "redis.key_prefix",
                "must be non-empty letters, digits, '.', '_', '-' or ':'",
            ));
        }
        let mut ids = HashSet::new();
        for (i, tenant) in self.tenants.iter().enumerate() {
            let field = format!("tenants[{i}]");
            if !valid_key_part(&tenant.id) || tenant.id.contains(':') {
                return Err(invalid(
                    format!("{field}.id"),
                    "must be non-empty letters, digits, '.', '_' or '-'",
                ));
            }
            if !ids.insert(tenant.id.as_str()) {
                return Err(invalid(format!("{field}.id"), format!("duplicate tenant '{}'", tenant.id)));
            }
            tenant.limits.validate(&format!("{field}.limits"))?;
            for (model, limits) in &tenant.model_limits {
                if model.is_empty() || model.contains(['{', '}']) {
                    return Err(invalid(
                        format!("{field}.model_limits"),
                        format!("invalid model name '{model}'"),
                    ));
                }
                limits.validate(&format!("{field}.model_limits.{model}"))?;
            }
            tenant.quota.validate(&format!("{field}.quota"))?;
            for (model, quota) in &tenant.model_quotas {
                if model.is_empty() || model.contains(['{', '}']) {
                    return Err(invalid(
                        format!("{field}.model_quotas"),
                        format!("invalid model name '{model}'"),
                    ));
                }
                quota.validate(&format!("{field}.model_quotas.{model}"))?;
            }
        }
        for (model, price) in &self.prices {
            if model.is_empty() {
                return Err(invalid("prices", "invalid model name ''"));
            }
            price.validate(&format!("prices.{model}"))?;
        }
        if self.metering.max_json_body_bytes == 0 {
            return Err(invalid("metering.max_json_body_bytes", "must be > 0"));
        }
        if self.metering.buffer_records == 0 {
            return Err(invalid("metering.buffer_records", "must be > 0"));
        }
        let reservations = &self.metering.reservations;
        if !(1_000..=604_800_000).contains(&reservations.record_after_ms) {
            return Err(invalid("metering.reservations.record_after_ms", "must be in 1000..=604800000"));
        }
        if !(100..=600_000).contains(&reservations.sweep_interval_ms) {
            return Err(invalid("metering.reservations.sweep_interval_ms", "must be in 100..=600000"));
        }
        if !(1..=10_000).contains(&reservations.sweep_batch) {
            return Err(invalid("metering.reservations.sweep_batch", "must be in 1..=10000"));
        }
        if let Some(journal) = &self.metering.journal {
            journal.validate("metering.journal").map_err(|(field, message)| invalid(&field, message))?;
        }
        if self.redis.breaker.failure_threshold == 0 {
            return Err(invalid("redis.breaker.failure_threshold", "must be > 0"));
        }
        if self.redis.breaker.open_ms == 0 {
            return Err(invalid("redis.breaker.open_ms", "must be > 0"));
        }
        let mut pools = HashSet::new();
        for (i, pool) in self.pools.iter().enumerate() {
            let field = format!("pools[{i}]");
            if pool.name.is_empty() {
                return Err(invalid(format!("{field}.name"), "must be non-empty"));
            }
            if !pools.insert(pool.name.as_str()) {
                return Err(invalid(format!("{field}.name"), format!("duplicate pool '{}'", pool.name)));
            }
            for (j, url) in pool.endpoints.iter().enumerate() {
                if !url.starts_with("http://") {
                    return Err(invalid(format!("{field}.endpoints[{j}]"), "must be an http:// URL"));
                }
            }
            if pool.scrape_interval_ms == 0 {
                return Err(invalid(format!("{field}.scrape_interval_ms"), "must be > 0"));
            }
            if pool.max_queue_depth == Some(0) {
                return Err(invalid(format!("{field}.max_queue_depth"), "must be > 0"));
            }
            if pool.max_in_flight == Some(0) {
                return Err(invalid(format!("{field}.max_in_flight"), "must be > 0"));
            }
            if let Some(kv) = pool.max_kv_cache_usage {
                if !(kv > 0.0 && kv <= 1.0) {
                    return Err(invalid(format!("{field}.max_kv_cache_usage"), "must be in (0, 1]"));
                }
            }
            if let Some(flow) = &pool.flow_control {
                let field = format!("{field}.flow_control");
                if self.flow_control.is_none() {
                    return Err(invalid(field, "needs the top-level flow_control (its tiers)"));
                }
                if !(1..=1_000_000).contains(&flow.max_queued) {
                    return Err(invalid(format!("{field}.max_queued"), "must be in 1..=1000000"));
                }
                if !((1 << 20)..=(64 << 30)).contains(&flow.max_queued_bytes) {
                    return Err(invalid(
                        format!("{field}.max_queued_bytes"),
                        "must be in 1048576..=68719476736 (1 MiB to 64 GiB)",
                    ));
                }
                if !(flow.leases_below_load > 0.0 && flow.leases_below_load <= 1.0) {
                    return Err(invalid(format!("{field}.leases_below_load"), "must be in (0, 1]"));
                }
                if pool.max_in_flight.is_none()
                    && pool.max_queue_depth.is_none()
                    && pool.max_kv_cache_usage.is_none()
                {
                    return Err(invalid(
                        field,
                        "needs the pool's max_in_flight, max_queue_depth or max_kv_cache_usage (when it has room)",
                    ));
                }
            }
            if let Some(picker) = &pool.picker {
                picker.validate(&format!("{field}.picker"), pool.scrape_interval_ms)?;
                if pool.endpoints.is_empty() {
                    return Err(invalid(format!("{field}.endpoints"), "needed by picker"));
                }
                for (j, url) in pool.endpoints.iter().enumerate() {
                    if endpoint_addr(url).is_none() {
                        return Err(invalid(
                            format!("{field}.endpoints[{j}]"),
                            "the picker needs http://ip:port (an IP address and a port, no path)",
                        ));
                    }
                }
                continue;
            }
            let scraped = pool.max_queue_depth.is_some() || pool.max_kv_cache_usage.is_some();
            if scraped && pool.endpoints.is_empty() {
                return Err(invalid(
                    format!("{field}.endpoints"),
                    "needed to scrape max_queue_depth / max_kv_cache_usage",
                ));
            }
            if !scraped && pool.max_in_flight.is_none() {
                return Err(invalid(
                    field,
                    "set at least one of max_queue_depth, max_kv_cache_usage, max_in_flight",
                ));
            }
        }
        let mut picker_pools = HashSet::new();
        for (i, epp) in self.endpoint_pickers.iter().enumerate() {
            let field = format!("endpoint_pickers[{i}]");
            if !self.pools.iter().any(|p| p.name == epp.pool && p.picker.is_some()) {
                return Err(invalid(format!("{field}.pool"), "must name a pools[] entry that has a picker"));
            }
            if !picker_pools.insert(epp.pool.as_str()) {
                return Err(invalid(format!("{field}.pool"), "has another endpoint picker"));
            }
            if epp.listen.port() != 0 && epp.listen == self.listen {
                return Err(invalid(format!("{field}.listen"), "is the sidecar's own listen address"));
            }
            if epp.max_body_bytes == 0 {
                return Err(invalid(format!("{field}.max_body_bytes"), "must be > 0"));
            }
            if !(1..=4096).contains(&epp.block_bytes) {
                return Err(invalid(format!("{field}.block_bytes"), "must be in 1..=4096"));
            }
            if !(1..=4096).contains(&epp.max_blocks) {
                return Err(invalid(format!("{field}.max_blocks"), "must be in 1..=4096"));
            }
        }
        let mut models = HashSet::new();
        for (i, model) in self.models.iter().enumerate() {
            let field = format!("models[{i}]");
            if model.name.is_empty() {
                return Err(invalid(format!("{field}.name"), "must be non-empty"));
            }
            if !models.insert(model.name.as_str()) {
                return Err(invalid(format!("{field}.name"), format!("duplicate model '{}'", model.name)));
            }
            if model.max_model_len == 0 {
                return Err(invalid(format!("{field}.max_model_len"), "must be > 0"));
            }
            let spec = model.tokenizer.validate().and_then(|()| match &model.chat_template {
                Some(t) => t.validate(),
                None => Ok(()),
            });
            spec.map_err(|e| invalid(format!("{field}.{}", e.field), e.message))?;
        }
        if !(1..=600_000).contains(&self.shutdown_grace_ms) {
            return Err(invalid("shutdown_grace_ms", "must be in 1..=600000"));
        }
        if self.context.count_timeout_ms == 0 {
            return Err(invalid("context.count_timeout_ms", "must be > 0"));
        }
        if self.context.max_counts_per_tenant == 0 {
            return Err(invalid("context.max_counts_per_tenant", "must be > 0"));
        }
        if self.context.max_body_bytes == 0 {
            return Err(invalid("context.max_body_bytes", "must be > 0"));
        }
        for (tier, level) in &self.shedding.tier_levels {
            if !(*level > 0.0 && *level <= 1.0) {
                return Err(invalid(format!("shedding.tier_levels.{tier}"), "must be in (0, 1]"));
            }
        }
        if let Some(flow) = &self.flow_control {
            flow.validate(self)?;
        }
        if let Some(t) = &self.tracing {
            let scheme = t.otlp_endpoint.split_once("://").map(|(scheme, _)| scheme);
            if !matches!(scheme, Some("http" | "https")) || t.otlp_endpoint.ends_with("://") {
                return Err(invalid(
                    "tracing.otlp_endpoint",
                    "must be http://host:port or https://host:port",
                ));
            }
            if !(0.0..=1.0).contains(&t.sampling_ratio) {
                return Err(invalid("tracing.sampling_ratio", "must be in 0..=1"));
            }
            if t.service_name.is_empty() {
                return Err(invalid("tracing.service_name", "must be non-empty"));
            }
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
}

impl FlowControlConfig {
    fn validate(&self, config: &Config) -> Result<(), ConfigError> {
        if self.tiers.is_empty() {
            return Err(invalid("flow_control.tiers", "must list at least one tier"));
        }
        let mut names = HashSet::new();
        for (i, tier) in self.tiers.iter().enumerate() {
            let field = format!("flow_control.tiers[{i}]");
            if tier.name.is_empty() {
                return Err(invalid(format!("{field}.name"), "must be non-empty"));
            }
            if !names.insert(tier.name.as_str()) {
                return Err(invalid(format!("{field}.name"), format!("duplicate tier '{}'", tier.name)));
            }
            if !(1..=600_000).contains(&tier.max_queue_wait_ms) {
                return Err(invalid(format!("{field}.max_queue_wait_ms"), "must be in 1..=600000"));
            }
            if !(tier.max_load > 0.0 && tier.max_load <= 1.0) {
                return Err(invalid(format!("{field}.max_load"), "must be in (0, 1]"));
            }
            if i > 0 && self.tiers.get(i - 1).is_some_and(|higher| higher.max_load < tier.max_load) {
                return Err(invalid(format!("{field}.max_load"), "must not be above the higher tier's"));
            }
        }
        if !(0.0..=100.0).contains(&self.output_token_weight) {
            return Err(invalid("flow_control.output_token_weight", "must be in 0..=100"));
        }
        if !(0.0..=0.5).contains(&self.newcomer_reserve) {
            return Err(invalid("flow_control.newcomer_reserve", "must be in 0..=0.5"));
        }
        for (tenant, weight) in &self.tenant_weights {
            let field = format!("flow_control.tenant_weights.{tenant}");
            if !(*weight > 0.0 && *weight <= 1000.0) {
                return Err(invalid(field, "must be in (0, 1000]"));
            }
            if config.tenant(tenant).is_none() {
                return Err(invalid(field, "is not a tenant of tenants[]"));
            }
        }
        Ok(())
    }
}

impl Limits {
    fn validate(&self, field: &str) -> Result<(), ConfigError> {
        check_pair(
            field,
            "requests_per_minute",
            self.requests_per_minute,
            "request_burst",
            self.request_burst,
        )?;
        check_pair(field, "tokens_per_minute", self.tokens_per_minute, "token_burst", self.token_burst)
    }
}

fn check_pair(
    field: &str,
    rate_name: &str,
    rate: Option<u64>,
    burst_name: &str,
    burst: Option<u64>,
) -> Result<(), ConfigError> {
    if rate == Some(0) {
        return Err(invalid(format!("{field}.{rate_name}"), "must be > 0 (omit it for no limit)"));
    }
    match (rate, burst) {
        (None, Some(_)) => Err(invalid(format!("{field}.{burst_name}"), format!("needs {rate_name}"))),
        (Some(_), Some(0)) => Err(invalid(format!("{field}.{burst_name}"), "must be > 0")),
        _ => Ok(()),
    }
}

/// What a PEM file must hold.
#[derive(Clone, Copy)]
enum PemKind {
    /// One or more certificates.
    Certificates,
    /// One private key.
    PrivateKey,
}

/// Reads a PEM file and checks it holds what `kind` says (errors name `field` and the path).
fn read_pem(field: &str, path: &Path, kind: PemKind) -> Result<Vec<u8>, ConfigError> {
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::{CertificateDer, PrivateKeyDer};
    let bytes = std::fs::read(path).map_err(|e| invalid(field, format!("{}: {e}", path.display())))?;
    let bad = |what: &str| invalid(field, format!("{}: {what}", path.display()));
    match kind {
        PemKind::Certificates => {
            let certs = CertificateDer::pem_slice_iter(&bytes)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| bad(&format!("not PEM certificates ({e})")))?;
            if certs.is_empty() {
                return Err(bad("no PEM certificate in it"));
            }
        }
        PemKind::PrivateKey => {
            // The key's parse error is not printed: it could quote key material.
            PrivateKeyDer::from_pem_slice(&bytes).map_err(|_| bad("no PEM private key in it"))?;
        }
    }
    Ok(bytes)
}

/// Checks a Redis URL without printing it: a scheme the sidecar supports, no credentials in it,
/// no `#insecure` (which would skip the server certificate check).
fn check_redis_url(field: &str, url: &str) -> Result<bool, ConfigError> {
    let (scheme, rest) =
        url.split_once("://").ok_or_else(|| invalid(field, "not a URL (redis://... or rediss://...)"))?;
    let tls = match scheme {
        "redis" => false,
        "rediss" => true,
        _ => return Err(invalid(field, "the scheme must be redis:// or rediss://")),
    };
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    if authority.contains('@') || rest.contains("pass=") || rest.contains("user=") {
        return Err(invalid(
            field,
            "must not carry credentials; set redis.username and redis.password_file or redis.password_env",
        ));
    }
    if rest.contains('#') {
        return Err(invalid(field, "a #fragment (e.g. #insecure) is not supported"));
    }
    Ok(tls)
}

impl RedisConfig {
    /// Checks the URLs, credentials and TLS settings (no file is read here).
    fn validate_connection(&self) -> Result<(), ConfigError> {
        let mut schemes = Vec::new();
        if let Some(url) = &self.url {
            schemes.push(check_redis_url("redis.url", url)?);
        }
        for (i, url) in self.cluster_urls.iter().enumerate() {
            schemes.push(check_redis_url(&format!("redis.cluster_urls[{i}]"), url)?);
        }
        let tls = schemes.first().copied().unwrap_or(false);
        if schemes.iter().any(|s| *s != tls) {
            return Err(invalid("redis.cluster_urls", "mixes redis:// and rediss:// URLs"));
        }
        if let Some(t) = &self.tls {
            if !tls {
                return Err(invalid("redis.tls", "needs rediss:// URLs"));
            }
            if t.cert_file.is_some() != t.key_file.is_some() {
                return Err(invalid("redis.tls", "set both cert_file and key_file, or neither"));
            }
        }
        if self.password_file.is_some() && self.password_env.is_some() {
            return Err(invalid("redis", "set at most one of password_file and password_env"));
        }
        if let Some(user) = &self.username {
            if user.is_empty() || user.contains(char::is_whitespace) {
                return Err(invalid("redis.username", "must be non-empty, without spaces"));
            }
            if self.password_file.is_none() && self.password_env.is_none() {
                return Err(invalid("redis.username", "needs redis.password_file or redis.password_env"));
            }
        }
        if matches!(&self.password_env, Some(v) if v.is_empty()) {
            return Err(invalid("redis.password_env", "must name a variable"));
        }
        Ok(())
    }

    /// Whether the URLs are `rediss://`.
    pub fn uses_tls(&self) -> bool {
        self.url.iter().chain(&self.cluster_urls).any(|u| u.starts_with("rediss://"))
    }
}

fn valid_key_part(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b':'))
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = "listen: 127.0.0.1:0\nredis: {url: 'redis://127.0.0.1:6379'}\n";

    fn err(yaml: &str) -> String {
        let mut config = match Config::from_yaml(yaml) {
            Ok(c) => c,
            Err(e) => return e.to_string(),
        };
        config.read_secrets().unwrap_err().to_string()
    }

    fn load_yaml(yaml: &str) -> Config {
        let mut config = Config::from_yaml(yaml).unwrap();
        config.read_secrets().unwrap();
        config
    }

    #[test]
    fn accepts_a_full_config() {
        let c = Config::from_yaml(&format!(
            "{BASE}tenants:\n  - id: acme\n    limits: {{requests_per_minute: 60, tokens_per_minute: 1000, token_burst: 2000}}\n"
        ))
        .unwrap();
        assert_eq!(c.tenant("acme").unwrap().limits.token_burst, Some(2000));
        assert_eq!(c.redis.command_timeout_ms, 25);
        assert_eq!(c.usage_stream(), "llmgw:usage-events");
    }

    #[test]
    fn models_with_tokenizers() {
        let c = Config::from_yaml(&format!(
            "{BASE}tenants: []\nmodels:\n  - name: qwen\n    max_model_len: 32768\n    tokenizer: {{huggingface: /m/tokenizer.json}}\n    chat_template: {{tokenizer_config: /m/tokenizer_config.json}}\n  - name: gpt\n    max_model_len: 8192\n    tokenizer: {{tiktoken: {{ranks: cl100k_base}}}}\n"
        ))
        .unwrap();
        assert_eq!(c.models.len(), 2);
        assert!(c.models[1].chat_template.is_none());
        assert_eq!(c.context.count_timeout_ms, 300);
        assert_eq!(c.shutdown_grace_ms, 10_000);
    }

    #[test]
    fn model_errors_name_the_field() {
        let model = |body: &str| err(&format!("{BASE}tenants: []\nmodels:\n  - {body}\n"));
        assert_eq!(
            model("{name: '', max_model_len: 1, tokenizer: {tiktoken: {ranks: cl100k_base}}}"),
            "models[0].name: must be non-empty"
        );
        assert_eq!(
            model("{name: a, max_model_len: 0, tokenizer: {tiktoken: {ranks: cl100k_base}}}"),
            "models[0].max_model_len: must be > 0"
        );
        assert_eq!(
            model("{name: a, max_model_len: 1, tokenizer: {}}"),
            "models[0].tokenizer: exactly one of `huggingface`, `tiktoken` and `tekken` must be set"
        );
        assert_eq!(
            model("{name: a, max_model_len: 1, tokenizer: {tiktoken: {ranks: /x.tiktoken}}}"),
            "models[0].tokenizer.tiktoken.pattern: required with a ranks file"
        );
        assert_eq!(
            model("{name: a, max_model_len: 1, tokenizer: {tiktoken: {ranks: o200k_base, special_tokens: ['<x>']}}}"),
            "models[0].tokenizer.tiktoken.special_tokens: not allowed with a builtin encoding (it has its own)"
        );
        assert_eq!(
            model("{name: a, max_model_len: 1, tokenizer: {tiktoken: {ranks: /r, pattern: p, special_tokens: ['<x>', '<x>']}}}"),
            "models[0].tokenizer.tiktoken.special_tokens[1]: duplicate special token \"<x>\""
        );
        assert_eq!(
            model("{name: a, max_model_len: 1, tokenizer: {tekken: /t.json}, chat_template: {bos_token: '<s>'}}"),
            "models[0].chat_template: at least one of `tokenizer_config` and `jinja` must be set"
        );
        let e = model("{name: a, max_model_len: 1, tokenizer: {tekken: /t.json, hf: 1}}");
        assert!(e.contains("unknown field `hf`"), "{e}");
        let e = model(
            "{name: a, max_model_len: 1, tokenizer: {tiktoken: {ranks: cl100k_base, normalization: nfd}}}",
        );
        assert!(e.contains("unknown variant `nfd`"), "{e}");
        let two = err(&format!(
            "{BASE}tenants: []\nmodels:\n  - {{name: a, max_model_len: 1, tokenizer: {{tekken: /t}}}}\n  - {{name: a, max_model_len: 1, tokenizer: {{tekken: /t}}}}\n"
        ));
        assert_eq!(two, "models[1].name: duplicate model 'a'");
        assert_eq!(
            err(&format!("{BASE}tenants: []\ncontext: {{count_timeout_ms: 0}}\n")),
            "context.count_timeout_ms: must be > 0"
        );
        assert_eq!(
            err(&format!("{BASE}tenants: []\ncontext: {{max_counts_per_tenant: 0}}\n")),
            "context.max_counts_per_tenant: must be > 0"
        );
        assert_eq!(
            err(&format!("{BASE}tenants: []\nshutdown_grace_ms: 0\n")),
            "shutdown_grace_ms: must be in 1..=600000"
        );
        assert_eq!(
            err(&format!("{BASE}tenants: []\nshutdown_grace_ms: 600001\n")),
            "shutdown_grace_ms: must be in 1..=600000"
        );
    }

    #[test]
    fn reservations_are_validated_and_named() {
        let c = Config::from_yaml(&format!("{BASE}tenants: []\n")).unwrap();
        assert_eq!(
            c.metering.reservations,
            ReservationsConfig { record_after_ms: 3_900_000, sweep_interval_ms: 5_000, sweep_batch: 100 }
        );
        let r = |yaml: &str| err(&format!("{BASE}tenants: []\nmetering: {{reservations: {yaml}}}\n"));
        assert_eq!(
            r("{record_after_ms: 999}"),
            "metering.reservations.record_after_ms: must be in 1000..=604800000"
        );
        assert_eq!(
            r("{record_after_ms: 604800001}"),
            "metering.reservations.record_after_ms: must be in 1000..=604800000"
        );
        assert_eq!(
            r("{sweep_interval_ms: 99}"),
            "metering.reservations.sweep_interval_ms: must be in 100..=600000"
        );
        assert_eq!(r("{sweep_batch: 0}"), "metering.reservations.sweep_batch: must be in 1..=10000");
        assert_eq!(r("{sweep_batch: 10001}"), "metering.reservations.sweep_batch: must be in 1..=10000");
        let e = r("{after_ms: 1}");
        assert!(e.contains("unknown field `after_ms`"), "{e}");
        let c = Config::from_yaml(&format!(
            "{BASE}tenants: []\nmetering: {{reservations: {{record_after_ms: 1000, sweep_interval_ms: 100}}}}\n"
        ))
        .unwrap();
        assert_eq!(
            (c.metering.reservations.record_after_ms, c.metering.reservations.sweep_batch),
            (1000, 100)
        );
    }

    #[test]
    fn unknown_field_is_named() {
        let e = err(&format!("{BASE}tenants: []\nbogus: 1\n"));
        assert!(e.contains("unknown field `bogus`"), "{e}");
    }

    #[test]
    fn unknown_limit_field_is_named() {
        let e = err(&format!("{BASE}tenants:\n  - id: a\n    limits: {{rpm: 1}}\n"));
        assert!(e.contains("unknown field `rpm`"), "{e}");
    }

    #[test]
    fn zero_rate() {
        assert_eq!(
            err(&format!("{BASE}tenants:\n  - id: a\n    limits: {{requests_per_minute: 0}}\n")),
            "tenants[0].limits.requests_per_minute: must be > 0 (omit it for no limit)"
        );
    }

    #[test]
    fn burst_without_rate() {
        assert_eq!(
            err(&format!("{BASE}tenants:\n  - id: a\n    limits: {{token_burst: 5}}\n")),
            "tenants[0].limits.token_burst: needs tokens_per_minute"
        );
    }

    #[test]
    fn zero_burst() {
        assert_eq!(
            err(&format!(
                "{BASE}tenants:\n  - id: a\n    limits: {{requests_per_minute: 5, request_burst: 0}}\n"
            )),
            "tenants[0].limits.request_burst: must be > 0"
        );
    }

    #[test]
    fn duplicate_tenant() {
        assert_eq!(
            err(&format!("{BASE}tenants:\n  - {{id: a, limits: {{}}}}\n  - {{id: a, limits: {{}}}}\n")),
            "tenants[1].id: duplicate tenant 'a'"
        );
    }

    #[test]
    fn bad_tenant_id() {
        assert_eq!(
            err(&format!("{BASE}tenants:\n  - {{id: 'a{{b}}', limits: {{}}}}\n")),
            "tenants[0].id: must be non-empty letters, digits, '.', '_' or '-'"
        );
    }

    #[test]
    fn redis_needs_exactly_one_target() {
        assert_eq!(
            err("listen: 127.0.0.1:0\nredis: {}\ntenants: []\n"),
            "redis: one of url or cluster_urls is required"
        );
        assert_eq!(
            err("listen: 127.0.0.1:0\nredis: {url: 'redis://x', cluster_urls: ['redis://y']}\ntenants: []\n"),
            "redis: set either url or cluster_urls, not both"
        );
    }

    #[test]
    fn zero_timeout() {
        assert_eq!(
            err("listen: 127.0.0.1:0\nredis: {url: 'redis://x', command_timeout_ms: 0}\ntenants: []\n"),
            "redis.command_timeout_ms: must be > 0"
        );
        assert_eq!(
            err("listen: 127.0.0.1:0\nredis: {url: 'redis://x', local_share: 0}\ntenants: []\n"),
            "redis.local_share: must be in (0, 1]"
        );
        assert_eq!(
            err("listen: 127.0.0.1:0\nredis: {url: 'redis://x', lease_fraction: 0.6}\ntenants: []\n"),
            "redis.lease_fraction: must be in [0, 0.5]"
        );
    }

    const POOL: &str = "listen: 127.0.0.1:0\nredis: {url: 'redis://x'}\ntenants: []\npools:\n";

    #[test]
    fn pool_needs_a_threshold() {
        assert_eq!(
            err(&format!("{POOL}  - {{name: a, endpoints: ['http://127.0.0.1:1']}}\n")),
            "pools[0]: set at least one of max_queue_depth, max_kv_cache_usage, max_in_flight"
        );
    }

    #[test]
    fn scraped_threshold_needs_endpoints() {
        assert_eq!(
            err(&format!("{POOL}  - {{name: a, max_queue_depth: 4}}\n")),
            "pools[0].endpoints: needed to scrape max_queue_depth / max_kv_cache_usage"
        );
    }

    #[test]
    fn kv_cache_usage_is_a_fraction() {
        assert_eq!(
            err(&format!("{POOL}  - {{name: a, endpoints: ['http://h:1'], max_kv_cache_usage: 95}}\n")),
            "pools[0].max_kv_cache_usage: must be in (0, 1]"
        );
    }

    #[test]
    fn endpoint_must_be_http() {
        assert_eq!(
            err(&format!("{POOL}  - {{name: a, endpoints: ['h:1'], max_queue_depth: 1}}\n")),
            "pools[0].endpoints[0]: must be an http:// URL"
        );
    }

    #[test]
    fn picker_defaults_and_errors() {
        let ok = |picker: &str| {
            Config::from_yaml(&format!(
                "{POOL}  - {{name: a, endpoints: ['http://10.0.0.1:8000/', 'http://[::1]:9'], picker: {picker}}}\n"
            ))
            .unwrap()
            .pools[0]
            .picker
            .unwrap()
        };
        let p = ok("{}");
        assert_eq!(
            (p.prefix_weight, p.queue_weight, p.kv_cache_weight, p.in_flight_weight),
            (3.0, 2.0, 2.0, 2.0)
        );
        assert_eq!((p.affinity_load_factor, p.prefix_lru_blocks, p.fallback_endpoints), (2.0, 16_384, 1));
        assert_eq!((p.stale_after_ms, p.stale_after_ms(500), p.stale_after_ms(5_000)), (None, 2_000, 15_000));
        assert_eq!(ok("{stale_after_ms: 501}").stale_after_ms(500), 501);
        assert!(!p.admission_leases && ok("{admission_leases: true}").admission_leases);
        let leases = |picker: &str| {
            Config::from_yaml(&format!(
                "{POOL}  - {{name: a, endpoints: ['http://10.0.0.1:8000'], {picker}}}\n  - {{name: b, max_in_flight: 4}}\n"
            ))
            .unwrap()
        };
        let c = leases("picker: {}");
        assert!(!c.pool_allows_admission_leases("a"), "a picking pool gets no leases by default");
        assert!(c.pool_allows_admission_leases("b"), "a pool shed by its load does, within its headroom");
        assert_eq!(c.load_protected_pool("b").map(|p| p.name.as_str()), Some("b"));
        assert!(c.load_protected_pool("a").is_none() && c.load_protected_pool("unknown").is_none());
        assert_eq!(c.lease_level(&c.pools[1]), 1.0, "no tier levels: shed at 1.0");
        assert!(c.pool_allows_admission_leases("unknown"), "a pool the sidecar does not watch may");
        assert!(leases("picker: {admission_leases: true}").pool_allows_admission_leases("a"));
        assert!(!leases("picker: {admission_leases: true}, admission_leases: false")
            .pool_allows_admission_leases("a"));
        let opted =
            Config::from_yaml(&format!("{POOL}  - {{name: b, max_in_flight: 4, admission_leases: true}}\n"))
                .unwrap();
        assert!(opted.pool_allows_admission_leases("b"));
        let out =
            Config::from_yaml(&format!("{POOL}  - {{name: b, max_in_flight: 4, admission_leases: false}}\n"))
                .unwrap();
        assert!(!out.pool_allows_admission_leases("b"), "the pool's own setting wins");
        let bad = |picker: &str| {
            err(&format!("{POOL}  - {{name: a, endpoints: ['http://10.0.0.1:8000'], picker: {picker}}}\n"))
        };
        assert_eq!(bad("{queue_weight: -1}"), "pools[0].picker.queue_weight: must be a finite number >= 0");
        assert_eq!(
            bad("{prefix_weight: .nan}"),
            "pools[0].picker.prefix_weight: must be a finite number >= 0"
        );
        assert_eq!(
            bad("{affinity_load_factor: 0.5}"),
            "pools[0].picker.affinity_load_factor: must be a finite number >= 1"
        );
        assert_eq!(
            bad("{prefix_lru_blocks: 0}"),
            "pools[0].picker.prefix_lru_blocks: must be in 1..=10000000"
        );
        assert_eq!(bad("{fallback_endpoints: 17}"), "pools[0].picker.fallback_endpoints: must be at most 16");
        assert_eq!(
            bad("{stale_after_ms: 500}"),
            "pools[0].picker.stale_after_ms: must be > scrape_interval_ms (500)"
        );
        assert!(bad("{queue_weigth: 1}").contains("unknown field `queue_weigth`"));
        assert_eq!(
            err(&format!("{POOL}  - {{name: a, endpoints: ['http://vllm-0:8000'], picker: {{}}}}\n")),
            "pools[0].endpoints[0]: the picker needs http://ip:port (an IP address and a port, no path)"
        );
        assert_eq!(
            err(&format!("{POOL}  - {{name: a, picker: {{}}}}\n")),
            "pools[0].endpoints: needed by picker"
        );
    }

    #[test]
    fn duplicate_pool() {
        assert_eq!(
            err(&format!("{POOL}  - {{name: a, max_in_flight: 1}}\n  - {{name: a, max_in_flight: 1}}\n")),
            "pools[1].name: duplicate pool 'a'"
        );
    }

    #[test]
    fn flow_control() {
        let tenants = "tenants:\n  - {id: heavy, limits: {}}\n";
        let pool = |flow: &str| {
            format!("pools:\n  - {{name: p, endpoints: ['http://h:1'], max_in_flight: 8, flow_control: {flow}}}\n")
        };
        let tiers = "flow_control: {tiers: [{name: premium, max_queue_wait_ms: 500}, {name: batch, max_queue_wait_ms: 5000}], tenant_weights: {heavy: 2}}\n";
        let c = load_yaml(&format!("{BASE}{tenants}{}{tiers}", pool("{}")));
        let flow = c.flow_control.as_ref().unwrap();
        assert_eq!(flow.output_token_weight, 2.0);
        assert_eq!(flow.tiers[1].max_queue_wait_ms, 5000);
        assert_eq!(
            c.pools[0].flow_control,
            Some(PoolFlowConfig {
                max_queued: 1000,
                max_queued_bytes: DEFAULT_MAX_QUEUED_BYTES,
                leases_below_load: 0.8
            })
        );
        for (yaml, expected) in [
            (format!("{BASE}{tenants}{}", pool("{}")), "pools[0].flow_control: needs the top-level flow_control"),
            (format!("{BASE}{tenants}{}{tiers}", pool("{max_queued: 0}")), "pools[0].flow_control.max_queued: must be in"),
            (
                format!("{BASE}{tenants}{}{tiers}", pool("{max_queued_bytes: 1000}")),
                "pools[0].flow_control.max_queued_bytes: must be in 1048576..=68719476736",
            ),
            (format!("{BASE}{tenants}{}{tiers}", pool("{leases_below_load: 1.5}")), "pools[0].flow_control.leases_below_load"),
            (
                format!("{BASE}{tenants}pools:\n  - {{name: p, endpoints: ['http://h:1'], flow_control: {{}}}}\n{tiers}"),
                "pools[0].flow_control: needs the pool's max_in_flight",
            ),
            (format!("{BASE}{tenants}flow_control: {{tiers: []}}\n"), "flow_control.tiers: must list at least one tier"),
            (
                format!("{BASE}{tenants}flow_control: {{tiers: [{{name: a, max_queue_wait_ms: 1}}, {{name: a, max_queue_wait_ms: 1}}]}}\n"),
                "flow_control.tiers[1].name: duplicate tier 'a'",
            ),
            (
                format!("{BASE}{tenants}flow_control: {{tiers: [{{name: a, max_queue_wait_ms: 0}}]}}\n"),
                "flow_control.tiers[0].max_queue_wait_ms: must be in 1..=600000",
            ),
            (
                format!("{BASE}{tenants}flow_control: {{tiers: [{{name: a, max_queue_wait_ms: 1}}], tenant_weights: {{ghost: 1}}}}\n"),
                "flow_control.tenant_weights.ghost: is not a tenant",
            ),
            (
                format!("{BASE}{tenants}flow_control: {{tiers: [{{name: a, max_queue_wait_ms: 1}}], tenant_weights: {{heavy: 0}}}}\n"),
                "flow_control.tenant_weights.heavy: must be in (0, 1000]",
            ),
            (
                format!("{BASE}{tenants}flow_control: {{tiers: [{{name: a, max_queue_wait_ms: 1}}], output_token_weight: -1}}\n"),
                "flow_control.output_token_weight: must be in 0..=100",
            ),
            (
                format!("{BASE}{tenants}flow_control: {{tiers: [{{name: a, max_queue_wait_ms: 1}}], newcomer_reserve: 0.6}}\n"),
                "flow_control.newcomer_reserve: must be in 0..=0.5",
            ),
            (format!("{BASE}{tenants}flow_control: {{tiers: [{{name: a, max_wait: 1}}]}}\n"), "unknown field `max_wait`"),
            (
                format!("{BASE}{tenants}flow_control: {{tiers: [{{name: a, max_queue_wait_ms: 1, max_load: 0.5}}, {{name: b, max_queue_wait_ms: 1}}]}}\n"),
                "flow_control.tiers[1].max_load: must not be above the higher tier's",
            ),
            (
                format!("{BASE}{tenants}flow_control: {{tiers: [{{name: a, max_queue_wait_ms: 1, max_load: 0}}]}}\n"),
                "flow_control.tiers[0].max_load: must be in (0, 1]",
            ),
        ] {
            let e = err(&yaml);
            assert!(e.contains(expected), "{yaml}\n=> {e}");
        }
    }

    #[test]
    fn tier_level_range() {
        assert_eq!(
            err("listen: 127.0.0.1:0\nredis: {url: 'redis://x'}\ntenants: []\nshedding: {tier_levels: {batch: 0}}\n"),
            "shedding.tier_levels.batch: must be in (0, 1]"
        );
    }

    #[test]
    fn model_limits_are_validated() {
        assert_eq!(
            err(&format!(
                "{BASE}tenants:\n  - id: a\n    limits: {{}}\n    model_limits: {{m1: {{tokens_per_minute: 0}}}}\n"
            )),
            "tenants[0].model_limits.m1.tokens_per_minute: must be > 0 (omit it for no limit)"
        );
    }

    #[test]
    fn breaker_threshold() {
        assert_eq!(
            err("listen: 127.0.0.1:0\nredis: {url: 'redis://x', breaker: {failure_threshold: 0}}\ntenants: []\n"),
            "redis.breaker.failure_threshold: must be > 0"
        );
    }

    #[test]
    fn tier_failure_modes() {
        let c = Config::from_yaml(
            "listen: 127.0.0.1:0\nredis: {url: 'redis://x', failure_mode: closed, tier_failure_modes: {premium: open}}\ntenants: []\n",
        )
        .unwrap();
        assert_eq!(c.redis.failure_mode("premium"), FailureMode::Open);
        assert_eq!(c.redis.failure_mode("free"), FailureMode::Closed);
    }

    #[test]
    fn redis_urls_never_carry_credentials() {
        for url in [
            "redis://:hunter2@h:6379",
            "rediss://llmgw:hunter2@h:6380/0",
            "redis://llmgw@h",
            "redis://h:6379/0?pass=hunter2",
        ] {
            let e = err(&format!("listen: 127.0.0.1:0\nredis: {{url: '{url}'}}\ntenants: []\n"));
            assert!(e.starts_with("redis.url: must not carry credentials"), "{e}");
            assert!(!e.contains("hunter2"), "{e}");
        }
        let e = err("listen: 127.0.0.1:0\nredis: {cluster_urls: ['rediss://a:1', 'rediss://u:hunter2@b:1']}\ntenants: []\n");
        assert!(e.starts_with("redis.cluster_urls[1]: must not carry credentials"), "{e}");
        assert_eq!(
            err("listen: 127.0.0.1:0\nredis: {url: 'rediss://h:1/#insecure'}\ntenants: []\n"),
            "redis.url: a #fragment (e.g. #insecure) is not supported"
        );
        assert_eq!(
            err("listen: 127.0.0.1:0\nredis: {url: 'http://h:1'}\ntenants: []\n"),
            "redis.url: the scheme must be redis:// or rediss://"
        );
        assert_eq!(
            err("listen: 127.0.0.1:0\nredis: {cluster_urls: ['rediss://a:1', 'redis://b:1']}\ntenants: []\n"),
            "redis.cluster_urls: mixes redis:// and rediss:// URLs"
        );
    }

    #[test]
    fn redis_credentials_and_tls_are_checked() {
        let redis = |body: &str| err(&format!("listen: 127.0.0.1:0\nredis: {{{body}}}\ntenants: []\n"));
        assert_eq!(redis("url: 'redis://h', tls: {ca_file: /ca.pem}"), "redis.tls: needs rediss:// URLs");
        assert_eq!(
            redis("url: 'rediss://h', tls: {cert_file: /c.pem}"),
            "redis.tls: set both cert_file and key_file, or neither"
        );
        assert_eq!(
            redis("url: 'rediss://h', username: llmgw"),
            "redis.username: needs redis.password_file or redis.password_env"
        );
        assert_eq!(
            redis("url: 'rediss://h', password_file: /p, password_env: P"),
            "redis: set at most one of password_file and password_env"
        );
        assert_eq!(
            redis("url: 'rediss://h', password_env: GATEWAY_TEST_SURELY_UNSET_VAR"),
            "redis.password_env: environment variable GATEWAY_TEST_SURELY_UNSET_VAR is not set (or not UTF-8)"
        );
        let e = redis("url: 'rediss://h', tls: {ca_file: /nonexistent/ca.pem}");
        assert!(e.starts_with("redis.tls.ca_file: /nonexistent/ca.pem: "), "{e}");
        let e = redis("url: 'redis://h', password_file: /nonexistent/pw");
        assert!(e.starts_with("redis.password_file: /nonexistent/pw: "), "{e}");
    }

    #[test]
    fn a_password_file_is_read_and_never_printed() {
        let dir = std::env::temp_dir().join(format!("gw-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let pw = dir.join("pw");
        std::fs::write(&pw, "s3cret-Pa55\n").unwrap();
        let c = load_yaml(&format!(
            "listen: 127.0.0.1:0\nredis: {{url: 'redis://h', username: llmgw, password_file: '{}'}}\ntenants: []\n",
            pw.display()
        ));
        assert_eq!(c.redis.secrets.password.as_ref().unwrap().expose(), "s3cret-Pa55");
        assert!(!format!("{c:?}").contains("s3cret"), "{c:?}");
        std::fs::write(&pw, "\n").unwrap();
        let e = err(&format!(
            "listen: 127.0.0.1:0\nredis: {{url: 'redis://h', password_file: '{}'}}\ntenants: []\n",
            pw.display()
        ));
        assert_eq!(e, "redis.password_file: the password is empty");
        let notpem = dir.join("not.pem");
        std::fs::write(&notpem, "hello").unwrap();
        let e = err(&format!(
            "listen: 127.0.0.1:0\ntls: {{cert_file: '{0}', key_file: '{0}', client_ca_file: '{0}'}}\nredis: {{url: 'redis://h'}}\ntenants: []\n",
            notpem.display()
        ));
        assert!(e.starts_with("tls.cert_file: ") && e.ends_with("no PEM certificate in it"), "{e}");
        let e = err("listen: 127.0.0.1:0
tls: {cert_file: /c}
redis: {url: 'redis://h'}
tenants: []
");
        assert!(e.contains("missing field `key_file`"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn bad_listen_address() {
        let e = err("listen: nowhere\nredis: {url: 'redis://x'}\ntenants: []\n");
        assert!(e.contains("listen"), "{e}");
    }
}
