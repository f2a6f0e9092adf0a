//! The sidecar's config file as gatewayctl writes it (`gateway_ext_proc::config::Config`'s YAML).
//!
//! A section the sidecar's own type writes member for member is that type (`tls`, `tenants`,
//! `prices`, `models`, `flow_control`, `shedding`, `redis.tls`, `pools[].flow_control`). The
//! others are the sidecar's sections with only the members gatewayctl sets: the sidecar's types
//! hold every member with its default filled in, and writing those defaults out would change what
//! the sidecar reads whenever its defaults change. Members are declared in the order the file
//! lists them.

use std::collections::BTreeMap;

use gateway_ext_proc::config::ModelConfig;

use gateway_ext_proc::config::pools::{FlowControlConfig, PoolFlowConfig, SheddingConfig};

use gateway_ext_proc::config::redis::{FailureMode, ListenerTls, RedisTls};

use gateway_ext_proc::config::tenants::{Price, TenantConfig};
use serde::Serialize;

use crate::config::{BreakerSection, PickerSection};

/// The whole file.
#[derive(Debug, Serialize)]
pub struct SidecarFile {
    /// `listen`: the gRPC listener.
    pub listen: String,
    /// `tls`: mTLS of the gRPC listener (standalone).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls: Option<ListenerTls>,
    /// `redis`.
    pub redis: RedisFile,
    /// `tenants`: each tenant's limits and quotas.
    pub tenants: Vec<TenantConfig>,
    /// `prices`: per model.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub prices: BTreeMap<String, Price>,
    /// `metering`.
    pub metering: MeteringFile,
    /// `shutdown_grace_ms`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shutdown_grace_ms: Option<u64>,
    /// `drain_refuses_admissions`: with two or more replicas.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub drain_refuses_admissions: bool,
    /// `context`: the exact count's body limit.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub context: Option<ContextFile>,
    /// `models`: the models counted exactly.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub models: Vec<ModelConfig>,
    /// `pools`: those shed, queued or picked for.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub pools: Vec<PoolFile>,
    /// `flow_control`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub flow_control: Option<FlowControlConfig>,
    /// `tracing`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tracing: Option<TracingFile>,
    /// `endpoint_pickers`: one listener per picking pool (mesh targets).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub endpoint_pickers: Vec<EndpointPickerFile>,
    /// `shedding`: the tiers' levels.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shedding: Option<SheddingConfig>,
    /// `metrics_listen`: the Prometheus listener.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metrics_listen: Option<String>,
}

/// `redis`.
#[derive(Debug, Default, Serialize)]
pub struct RedisFile {
    /// Single-instance URL.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// Seed node URLs of a Redis Cluster.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cluster_urls: Option<Vec<String>>,
    /// Timeout of one command, ms.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub command_timeout_ms: Option<u64>,
    /// Share of each limit while Redis is away.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub local_share: Option<f64>,
    /// Share of a bucket leased ahead.
    pub lease_fraction: f64,
    /// How long a lease admits, ms.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lease_ttl_ms: Option<u64>,
    /// Prefix of every key.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key_prefix: Option<String>,
    /// When Redis cannot decide.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub failure_mode: Option<FailureMode>,
    /// Per tier.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub tier_failure_modes: BTreeMap<String, FailureMode>,
    /// ACL user.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub username: Option<String>,
    /// File holding the password.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub password_file: Option<String>,
    /// Variable holding the password.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub password_env: Option<String>,
    /// TLS files.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls: Option<RedisTls>,
    /// Circuit breaker.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub breaker: Option<BreakerSection>,
}

/// `metering`.
#[derive(Debug, Serialize)]
pub struct MeteringFile {
    /// Redis Stream of usage events.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stream: Option<String>,
    /// Its approximate length.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stream_maxlen: Option<u64>,
    /// No longer used by the sidecar; passed on.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_json_body_bytes: Option<u64>,
    /// When a reservation is charged.
    pub reservations: ReservationsFile,
    /// The usage journal (standalone).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub journal: Option<JournalFile>,
}

/// `metering.reservations`.
#[derive(Debug, Serialize)]
pub struct ReservationsFile {
    /// Age past which an open reservation is charged, ms.
    pub record_after_ms: u64,
}

/// `metering.journal`.
#[derive(Debug, Serialize)]
pub struct JournalFile {
    /// The journal file.
    pub path: String,
}

/// `context`.
#[derive(Debug, Serialize)]
pub struct ContextFile {
    /// Largest body buffered, bytes.
    pub max_body_bytes: u64,
}

/// One of `pools[]`.
#[derive(Debug, Serialize)]
pub struct PoolFile {
    /// The pool.
    pub name: String,
    /// Base URLs of its endpoints (their /metrics).
    pub endpoints: Vec<String>,
    /// Scrape interval, ms.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scrape_interval_ms: Option<u64>,
    /// Waiting requests at which it is full.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_queue_depth: Option<u64>,
    /// KV-cache usage at which it is full.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_kv_cache_usage: Option<f64>,
    /// Requests in flight at which it is full.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_in_flight: Option<u64>,
    /// The endpoint picker.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub picker: Option<PickerSection>,
    /// Its queue.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub flow_control: Option<PoolFlowConfig>,
    /// Whether the filter may admit it from leases.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub admission_leases: Option<bool>,
}

/// `tracing`.
#[derive(Debug, Serialize)]
pub struct TracingFile {
    /// The collector, `http://host:port`.
    pub otlp_endpoint: String,
    /// Share of traces sampled.
    pub sampling_ratio: f64,
}

/// One of `endpoint_pickers[]`.
#[derive(Debug, Serialize)]
pub struct EndpointPickerFile {
    /// The picking pool.
    pub pool: String,
    /// Its listener.
    pub listen: String,
    /// Largest body buffered, bytes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_body_bytes: Option<u64>,
}
