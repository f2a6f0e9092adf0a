//! `pools`: the vLLM pools the sidecar watches, sheds, queues and picks for, and the top-level
//! `flow_control` and `shedding` sections.

use std::collections::{BTreeMap, HashSet};

use serde::Deserialize;

use crate::config::error::{invalid, ConfigError};

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
    /// ([`crate::config::Config::pool_allows_admission_leases`]).
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
    /// ([`crate::pools::room::load`]) is below it, so that the rest stays free for the
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
    /// Prefix homes ([`crate::scheduling::home`]): a request whose prompt shares a prefix the
    /// pool has seen goes to that prefix's home (the endpoint its first request went to) while
    /// the home's occupancy (requests held: in flight, or vLLM's running + waiting) + 1 is at most
    /// `ceil(home_load_factor x (the pool's occupancy + 1) / endpoints)`, whatever `scoring`
    /// ranked; past it the ranking picks and the prefix keeps its home. Homes keep the replicas'
    /// caches disjoint, as a static split of the prefixes does. 0 (the default) turns this step
    /// off; otherwise finite, >= 1. Measured (docs/deploy.md): on the CPU engine's long shared
    /// prefixes 1.5 raised prefix-cache hits from 51 % to 64 % but throughput only to 1.04x of
    /// LEAST_REQUEST (two runs of one round each); on vllm-sim's shared prefixes it unbalanced the
    /// replicas. A pool with `max_in_flight` and `flow_control` keeps homes whatever this says:
    /// its queue hands a freed slot to a request homed there ([`crate::scheduling::slots`]).
    #[serde(default = "default_home_load_factor")]
    pub home_load_factor: f64,
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
    /// How endpoints are ranked: `predicted_ttft` (the default) ranks by each endpoint's
    /// predicted time to first token for this request, from a model fitted online to the TTFTs
    /// the gateway measures (`crate::scheduling::ttft_model`: queue ahead and uncached prompt);
    /// until it has seen enough requests, and with `weighted`, by the fixed weights above and
    /// bounded-load affinity.
    #[serde(default)]
    pub scoring: PickerScoring,
    /// Bytes of prompt text per hashed block, as the filter's `prefix_hashing.block_bytes`
    /// hashes them (gatewayctl renders both from one value): the unit of the uncached prompt the
    /// TTFT model weighs, and of the engine's cache size in blocks. 1..=4096; default 64.
    #[serde(default = "default_picker_block_bytes")]
    pub block_bytes: usize,
    /// Requests beyond its slots each endpoint of a slot-dispatching pool (`picker` with
    /// `max_in_flight` and `flow_control`, [`crate::scheduling::slots`]) may hold in its own
    /// queue: a queued request whose prefix that endpoint holds (its home, else its longest
    /// matched prefix), or one whose prompt no endpoint holds (no home, no matched block) on an
    /// endpoint that holds none of the prefixes of the next queued requests (an engine's queue
    /// takes its next free slot, which those should get). Either way the request gets what a
    /// slot dispatch would give it, and, waiting in the engine, refills a freed slot without a
    /// round trip through the gateway. So the pool holds up to
    /// `max_in_flight + slot_overcommit x endpoints`.
    /// 0..=64; default 2 (docs/benchmarks.md, "On a real engine": random prompts on the CPU
    /// engine).
    #[serde(default = "default_slot_overcommit")]
    pub slot_overcommit: u64,
}

/// How the picker ranks endpoints (`pools[].picker.scoring`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PickerScoring {
    /// By predicted TTFT, fitted online (fixed weights until the fit has its samples).
    #[default]
    PredictedTtft,
    /// By the fixed weights and bounded-load affinity.
    Weighted,
}

fn default_picker_block_bytes() -> usize {
    64
}

/// `picker.slot_overcommit` when unset.
pub const DEFAULT_SLOT_OVERCOMMIT: u64 = 2;

/// Most `picker.slot_overcommit`.
pub const MAX_SLOT_OVERCOMMIT: u64 = 64;

fn default_slot_overcommit() -> u64 {
    DEFAULT_SLOT_OVERCOMMIT
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

/// `picker.home_load_factor` when unset.
pub const DEFAULT_HOME_LOAD_FACTOR: f64 = 0.0;

fn default_home_load_factor() -> f64 {
    DEFAULT_HOME_LOAD_FACTOR
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

    pub(super) fn validate(&self, field: &str, scrape_interval_ms: u64) -> Result<(), ConfigError> {
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
        let home = self.home_load_factor;
        if !(home == 0.0 || (home.is_finite() && home >= 1.0)) {
            return Err(invalid(
                format!("{field}.home_load_factor"),
                "must be 0 (off) or a finite number >= 1",
            ));
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
        if !(1..=4096).contains(&self.block_bytes) {
            return Err(invalid(format!("{field}.block_bytes"), "must be in 1..=4096"));
        }
        if self.slot_overcommit > MAX_SLOT_OVERCOMMIT {
            return Err(invalid(
                format!("{field}.slot_overcommit"),
                format!("must be at most {MAX_SLOT_OVERCOMMIT}"),
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
#[derive(Debug, Clone, Default, Deserialize, serde::Serialize)]
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

impl FlowControlConfig {
    pub(super) fn validate(&self, is_tenant: impl Fn(&str) -> bool) -> Result<(), ConfigError> {
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
            if !is_tenant(tenant) {
                return Err(invalid(field, "is not a tenant of tenants[]"));
            }
        }
        Ok(())
    }
}
