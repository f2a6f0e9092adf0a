//! Prometheus metrics of the sidecar (prometheus-client), served on `metrics_listen` at
//! `/metrics`. Names and labels follow the OpenTelemetry GenAI semantic conventions v1.37.0
//! where one exists, in their Prometheus form (dots become underscores, the unit a suffix):
//! the gateway is the server its tenants call (`gen_ai.server.time_to_first_token` →
//! `gen_ai_server_time_to_first_token_seconds`, `gen_ai.server.time_per_output_token`,
//! `gen_ai.server.request.duration` with `error_type`) and the client of its vLLM pools
//! (`gen_ai.client.token.usage`: the counts the upstream reported), each with the labels of
//! [`labels::GenAi`]. `llm_gateway_*` are the gateway's own decisions, by tenant.
//!
//! Label sets are bounded: tenant and model values come from the filter's validated facts,
//! and at most 3 × [`MAX_LABEL_VALUES`] distinct values are kept across the tenant, model and
//! pool labels; later ones read `other`. The histograms carry no tenant (each tenant would
//! multiply their buckets); the counters do.

pub mod labels;

use crate::metrics::labels::{
    ConfigInfo, CountOutcome, Decision, EndpointLabel, Finished, GenAi, GenAiOutcome, GenAiTokens,
    LeaseOutcome, Op, Outcome, PoolBlocks, PoolEndpoint, PoolLabel, PoolReason, PoolTerm, PoolTier,
    QueueDequeue, QueueWait, Reason, ReloadResult, TenantApiKey, TenantLabel, TenantModel, TenantTokens,
    UsageReason,
};

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Registry, Unit};
use tracing::warn;

/// Distinct values kept per label kind (tenant, model, pool) before `other`.
pub const MAX_LABEL_VALUES: usize = 1000;

type GaugeF64 = Gauge<f64, AtomicU64>;

/// Every metric of the sidecar.
pub struct Metrics {
    registry: Registry,
    labels: Mutex<LabelBudget>,
    /// `llm_gateway_requests_total{tenant,model,outcome}`: admission outcomes.
    pub requests: Family<Outcome, Counter>,
    /// `llm_gateway_responses_total{tenant,model,status,end_reason}`: metered responses.
    pub responses: Family<Finished, Counter>,
    /// `gen_ai_server_time_to_first_token_seconds{gen_ai_*}`: from the request reaching the
    /// gateway to its first content chunk, for responses that streamed one.
    pub ttft: Family<GenAi, Histogram>,
    /// `gen_ai_server_time_per_output_token_seconds{gen_ai_*}`: per request, the mean gap between
    /// content chunks after the first (OTel `gen_ai.server.time_per_output_token`).
    pub itl: Family<GenAi, Histogram>,
    /// `gen_ai_server_request_duration_seconds{gen_ai_*,error_type}`.
    pub duration: Family<GenAiOutcome, Histogram>,
    /// `gen_ai_client_token_usage{gen_ai_*,gen_ai_token_type}`: tokens per request (OTel's
    /// buckets, powers of 4 from 1 to 4^13).
    pub token_usage: Family<GenAiTokens, Histogram>,
    /// `llm_gateway_tokens_total{tenant,model,token_type}`.
    pub tokens: Family<TenantTokens, Counter>,
    /// `llm_gateway_cost_usd_total{tenant,model}`: the cost of metered usage at the configured
    /// `prices` (USD; models without a price add nothing), as the ledger's records carry it.
    pub cost_usd: Family<TenantModel, Counter<f64, AtomicU64>>,
    /// `llm_gateway_api_key_requests_total{tenant,api_key}`: metered requests by the name of the
    /// API key they authenticated with (names come from the gateway config, through the filter's
    /// facts; bounded as the other labels).
    pub api_key_requests: Family<TenantApiKey, Counter>,
    /// `llm_gateway_quota_warnings_total{tenant}`: admissions past a quota's soft limit (each
    /// answered with `x-gateway-quota-warning`).
    pub quota_warnings: Family<TenantLabel, Counter>,
    /// `llm_gateway_limit_decisions_total{decision,degraded}`.
    pub limit_decisions: Family<Decision, Counter>,
    /// `llm_gateway_degraded_decisions_total{reason}`: every decision made without Redis.
    pub degraded: Family<Reason, Counter>,
    /// `llm_gateway_degraded_reconciliations_total{outcome}`: buckets charged to Redis with what
    /// the local buckets admitted while it was away (`applied`; `retried`: Redis did not answer,
    /// owed again).
    pub reconciliations: Family<LeaseOutcome, Counter>,
    /// `llm_gateway_shed_total{pool,tier}`.
    pub shed: Family<PoolTier, Counter>,
    /// `llm_gateway_admission_leases_total{outcome}`: the filter's lease calls.
    pub admission_leases: Family<LeaseOutcome, Counter>,
    /// `llm_gateway_exact_counts_total{outcome}`: exact context counts run for admitted
    /// requests: `fits`, `exceeded`, `undecided` (timed out, the tenant's counts busy, or
    /// nothing exact to count).
    pub exact_counts: Family<CountOutcome, Counter>,
    /// `llm_gateway_in_flight_requests{pool}`: admitted and not yet finished, over every sidecar
    /// replica sharing the Redis (this replica's own count while Redis is away).
    pub in_flight: Family<PoolLabel, Gauge>,
    /// `llm_gateway_in_flight_corrections_total{pool}`: requests taken off (or, at idle, put
    /// back on) the pool-wide in-flight count to match vLLM's metrics.
    pub in_flight_corrections: Family<PoolLabel, Counter>,
    /// `llm_gateway_pool_sidecar_replicas{pool}`: the sidecar replicas that flushed the pool's
    /// in-flight counts within the report lag, this one included, at its last flush; each
    /// leases its equal part of a shed pool's headroom (`crate::admission::lease_headroom`).
    pub pool_sidecar_replicas: Family<PoolLabel, Gauge>,
    /// `llm_gateway_pool_load{pool}`: the load ratio shedding compares with tier levels.
    pub pool_load: Family<PoolLabel, GaugeF64>,
    /// `llm_gateway_pool_requests_waiting{pool}`: scraped `vllm:num_requests_waiting`, summed.
    pub pool_waiting: Family<PoolLabel, GaugeF64>,
    /// `llm_gateway_pool_kv_cache_usage{pool}`: scraped `vllm:kv_cache_usage_perc`, highest.
    pub pool_kv_cache: Family<PoolLabel, GaugeF64>,
    /// `llm_gateway_endpoint_scrape_ok{pool,endpoint}`: 1 when the endpoint's last `/metrics`
    /// scrape succeeded, 0 when it failed (a picking pool's endpoint is then not eligible).
    pub endpoint_scrape_ok: Family<EndpointLabel, Gauge>,
    /// `llm_gateway_endpoint_scrape_filtered{pool,endpoint}`: 1 when the endpoint's last
    /// successful scrape asked vLLM for the samples the sidecar reads only (`/metrics/` with
    /// `name[]`: `crate::pools::signals::FILTERED_METRICS_PATH`), 0 when it read the whole
    /// `/metrics` (an endpoint that ignores the filter).
    pub endpoint_scrape_filtered: Family<EndpointLabel, Gauge>,
    /// `llm_gateway_endpoint_last_scrape_timestamp_seconds{pool,endpoint}`: Unix time of the
    /// endpoint's last successful scrape (the picker ignores one older than `stale_after_ms`).
    pub endpoint_last_scrape: Family<EndpointLabel, GaugeF64>,
    /// `llm_gateway_redis_command_duration_seconds{op}`.
    pub redis_latency: Family<Op, Histogram>,
    /// `llm_gateway_redis_errors_total{op}`.
    pub redis_errors: Family<Op, Counter>,
    /// `llm_gateway_usage_records_buffered`: records waiting for Redis.
    pub records_buffered: Gauge,
    /// `llm_gateway_usage_records_written_total`.
    pub records_written: Counter,
    /// `llm_gateway_usage_records_dropped_total`: past `metering.buffer_records` (each logged).
    pub records_dropped: Counter,
    /// `llm_gateway_usage_records_refused_total`: usage counts the ledger cannot hold exactly
    /// (each logged).
    pub records_refused: Counter,
    /// `llm_gateway_usage_out_of_bounds_total{reason}`: an upstream's usage past what its request
    /// could produce, billed at the reservation (each logged).
    pub usage_out_of_bounds: Family<UsageReason, Counter>,
    /// `llm_gateway_usage_unreadable_total{reason}`: a 2xx response whose usage could not be
    /// read (coded, missing, given twice), billed at the reservation (each logged).
    pub usage_unreadable: Family<UsageReason, Counter>,
    /// `llm_gateway_usage_records_unconfirmed_total`: given up, each logged whole, because a write
    /// that may have landed is older than the ledger's idempotency retention (retrying could count
    /// it twice).
    pub records_unconfirmed: Counter,
    /// `llm_gateway_usage_records_unknown_tenant_total`: records of a tenant the config does not
    /// list, dropped (never stored).
    pub records_unknown_tenant: Counter,
    /// `llm_gateway_usage_records_duplicate_total`: deliveries of a record the ledger had applied
    /// already (a retry, a replay, a second sink), not applied again.
    pub records_duplicate: Counter,
    /// `llm_gateway_usage_records_from_reservation_total`: reservations whose usage never arrived,
    /// recorded as charged by this replica's sweeper (`usage_source` reservation, end reason
    /// unreported).
    pub records_charged: Counter,
    /// `llm_gateway_usage_records_after_charge_total`: usage that arrived after its request's
    /// reservation was charged, not applied (each logged).
    pub records_after_charge: Counter,
    /// `llm_gateway_reservations_released_total`: admissions given back before their request
    /// went upstream, their reservation closed.
    pub reservations_released: Counter,
    /// `llm_gateway_admission_leases_reclaimed_total`: filters' admission leases reclaimed as
    /// orphaned (not given back within their TTL: the VM went away, or its give-back was lost).
    pub leases_reclaimed: Counter,
    /// `llm_gateway_admission_lease_requests_charged_total`: requests a filter reported admitted
    /// from a lease later reclaimed, whose usage never arrived, charged their reservations as
    /// usage (the longest stream lifetime after the reclaim).
    pub leases_charged_requests: Counter,
    /// `llm_gateway_reservations_open`: open reservations over the configured tenants, as this
    /// replica's last sweep counted them (requests admitted whose usage has not landed).
    pub reservations_open: Gauge,
    /// `llm_gateway_journal_lines_total`: usage journal lines this replica read.
    pub journal_lines: Counter,
    /// `llm_gateway_journal_records_applied_total`: ledger writes the usage journal applied that
    /// no other delivery had (what the gRPC access log lost).
    pub journal_records_applied: Counter,
    /// `llm_gateway_journal_lines_landed_total`: journal lines not written to Redis because this
    /// replica's gRPC access-log path saw their write land ([`crate::metering::landed`]).
    pub journal_lines_landed: Counter,
    /// `llm_gateway_journal_parse_errors_total`: journal lines that are not entries, skipped.
    pub journal_parse_errors: Counter,
    /// `llm_gateway_journal_lag_bytes`: bytes of the journal not yet applied, at the last poll.
    pub journal_lag_bytes: Gauge,
    /// `llm_gateway_journal_holder`: 1 while this replica holds the journal's lease.
    pub journal_holder: Gauge,
    /// `llm_gateway_journal_files_total`: journal files started after a rotation.
    pub journal_files: Counter,
    /// `llm_gateway_picker_picks_total{pool,endpoint,by}`: the endpoint picker's picks.
    pub picks: Family<PoolEndpoint, Counter>,
    /// `llm_gateway_picker_prefix_blocks_total{pool,kind}`: prompt blocks of picked requests
    /// (`requested`) and those the picked endpoint had served recently (`hit`).
    pub pick_prefix_blocks: Family<PoolBlocks, Counter>,
    /// `llm_gateway_picker_no_pick_total{pool,reason}`: admitted requests of a picking pool sent
    /// without a pick (`none_eligible`) or refused 503 (`subset_none_eligible`).
    pub no_pick: Family<PoolReason, Counter>,
    /// `llm_gateway_picker_in_flight_requests{pool,endpoint}`: this sidecar's picks of the
    /// endpoint whose end it has not seen (the in-flight scorer's input).
    pub pick_in_flight: Family<EndpointLabel, Gauge>,
    /// `llm_gateway_picker_pick_duration_seconds{pool}`: the time of one pick (the lock, the
    /// scores, the prefix lookups).
    pub pick_duration: Family<PoolLabel, Histogram>,
    /// `llm_gateway_picker_ttft_model{pool,term}`: the pool's fitted TTFT model, updated at each
    /// request's end: `TTFT ≈ floor_seconds + per_request_ahead_seconds × requests ahead +
    /// per_uncached_kib_seconds × uncached prompt KiB`, its `samples`, and the pool's measured
    /// `prompt_bytes_per_token` (what sizes its prefix index from the engine's cache).
    pub pick_ttft_model: Family<PoolTerm, GaugeF64>,
    /// `llm_gateway_queue_requests{pool,tier}`: requests waiting in a flow-control queue.
    pub queue_length: Family<PoolTier, Gauge>,
    /// `llm_gateway_queue_wait_seconds{pool,tier,tenant}`: how long dispatched requests waited.
    pub queue_wait: Family<QueueWait, Histogram>,
    /// `llm_gateway_queue_dequeues_total{pool,tier,reason}`: requests leaving a queue (or
    /// refused before entering it), by reason; `reserve`: let past a non-empty queue into the
    /// newcomer reserve (`flow_control.newcomer_reserve`).
    pub queue_dequeues: Family<QueueDequeue, Counter>,
    /// `llm_gateway_config_reloads_total{result}`: config reloads, `applied` or `refused`.
    pub config_reloads: Family<ReloadResult, Counter>,
    /// `llm_gateway_config_info{sha256}`: 1 for the config file serving new requests now.
    pub config_info: Family<ConfigInfo, Gauge>,
    /// `llm_gateway_config_generation`: 1 at start, one more per applied reload.
    pub config_generation: Gauge,
}

#[derive(Default)]
struct LabelBudget {
    seen: HashSet<String>,
}

fn latency_buckets() -> impl Iterator<Item = f64> {
    // 100 µs .. ~100 s
    exponential_buckets(0.0001, 2.0, 21)
}

impl Metrics {
    /// Registers every metric.
    pub fn new() -> Arc<Self> {
        let mut r = Registry::default();
        let hist = || Family::<GenAi, Histogram>::new_with_constructor(|| Histogram::new(latency_buckets()));
        let m = Self {
            labels: Mutex::new(LabelBudget::default()),
            requests: Family::default(),
            responses: Family::default(),
            ttft: hist(),
            itl: hist(),
            duration: Family::new_with_constructor(|| Histogram::new(latency_buckets())),
            token_usage: Family::new_with_constructor(|| Histogram::new(exponential_buckets(1.0, 4.0, 14))),
            tokens: Family::default(),
            cost_usd: Family::default(),
            api_key_requests: Family::default(),
            quota_warnings: Family::default(),
            limit_decisions: Family::default(),
            degraded: Family::default(),
            reconciliations: Family::default(),
            shed: Family::default(),
            admission_leases: Family::default(),
            exact_counts: Family::default(),
            in_flight: Family::default(),
            in_flight_corrections: Family::default(),
            pool_sidecar_replicas: Family::default(),
            pool_load: Family::default(),
            pool_waiting: Family::default(),
            pool_kv_cache: Family::default(),
            endpoint_scrape_ok: Family::default(),
            endpoint_scrape_filtered: Family::default(),
            endpoint_last_scrape: Family::default(),
            redis_latency: Family::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.00005, 2.0, 16))
            }),
            redis_errors: Family::default(),
            records_buffered: Gauge::default(),
            records_written: Counter::default(),
            records_dropped: Counter::default(),
            records_refused: Counter::default(),
            usage_out_of_bounds: Family::default(),
            usage_unreadable: Family::default(),
            records_unconfirmed: Counter::default(),
            records_unknown_tenant: Counter::default(),
            records_duplicate: Counter::default(),
            records_charged: Counter::default(),
            records_after_charge: Counter::default(),
            reservations_released: Counter::default(),
            leases_reclaimed: Counter::default(),
            leases_charged_requests: Counter::default(),
            reservations_open: Gauge::default(),
            journal_lines: Counter::default(),
            journal_records_applied: Counter::default(),
            journal_lines_landed: Counter::default(),
            journal_parse_errors: Counter::default(),
            journal_lag_bytes: Gauge::default(),
            journal_holder: Gauge::default(),
            journal_files: Counter::default(),
            picks: Family::default(),
            pick_prefix_blocks: Family::default(),
            no_pick: Family::default(),
            pick_in_flight: Family::default(),
            pick_ttft_model: Family::default(),
            // 1 µs .. ~32 ms
            pick_duration: Family::new_with_constructor(|| {
                Histogram::new(exponential_buckets(1e-6, 2.0, 16))
            }),
            queue_length: Family::default(),
            queue_wait: Family::new_with_constructor(|| Histogram::new(latency_buckets())),
            queue_dequeues: Family::default(),
            config_reloads: Family::default(),
            config_info: Family::default(),
            config_generation: Gauge::default(),
            registry: Registry::default(),
        };
        m.register_requests(&mut r);
        m.register_pools(&mut r);
        m.register_usage(&mut r);
        m.register_journal_picker_queue(&mut r);
        m.register_config(&mut r);
        Arc::new(Self { registry: r, ..m })
    }

    /// Registers the config reload's metrics.
    fn register_config(&self, r: &mut Registry) {
        r.register("llm_gateway_config_reloads", "Config reloads by result", self.config_reloads.clone());
        r.register(
            "llm_gateway_config_info",
            "The config file serving new requests",
            self.config_info.clone(),
        );
        r.register(
            "llm_gateway_config_generation",
            "Config generation (1 at start, +1 per applied reload)",
            self.config_generation.clone(),
        );
    }

    /// Marks the config file of SHA-256 `sha256` (lowercase hex) as the one serving, in place of
    /// `previous`, at generation `generation`.
    pub fn config_serving(&self, previous: Option<&str>, sha256: &str, generation: u64) {
        if let Some(previous) = previous {
            self.config_info.remove(&ConfigInfo { sha256: previous.to_owned() });
        }
        self.config_info.get_or_create(&ConfigInfo { sha256: sha256.to_owned() }).set(1);
        self.config_generation.set(i64::try_from(generation).unwrap_or(i64::MAX));
    }

    /// Registers the metrics of admission, responses, latencies and tokens.
    fn register_requests(&self, r: &mut Registry) {
        r.register("llm_gateway_requests", "Admission outcomes", self.requests.clone());
        r.register(
            "llm_gateway_responses",
            "Metered responses by status class and end",
            self.responses.clone(),
        );
        r.register_with_unit(
            "gen_ai_server_time_to_first_token",
            "Time from the request reaching the sidecar to the first content chunk",
            Unit::Seconds,
            self.ttft.clone(),
        );
        r.register_with_unit(
            "gen_ai_server_time_per_output_token",
            "Gap between consecutive content chunks of a stream",
            Unit::Seconds,
            self.itl.clone(),
        );
        r.register_with_unit(
            "gen_ai_server_request_duration",
            "Duration of metered requests",
            Unit::Seconds,
            self.duration.clone(),
        );
        r.register(
            "gen_ai_client_token_usage",
            "Tokens per request, input or output, as the upstream reported them",
            self.token_usage.clone(),
        );
        r.register(
            "llm_gateway_tokens",
            "Prompt (input) and completion (output) tokens",
            self.tokens.clone(),
        );
        r.register_with_unit(
            "llm_gateway_cost",
            "Cost of metered usage at the configured prices",
            Unit::Other("usd".to_owned()),
            self.cost_usd.clone(),
        );
        r.register(
            "llm_gateway_api_key_requests",
            "Metered requests by API key name",
            self.api_key_requests.clone(),
        );
        r.register(
            "llm_gateway_quota_warnings",
            "Admissions past a quota's soft limit",
            self.quota_warnings.clone(),
        );
        r.register("llm_gateway_limit_decisions", "Rate-limit decisions", self.limit_decisions.clone());
        r.register("llm_gateway_degraded_decisions", "Decisions made without Redis", self.degraded.clone());
        r.register(
            "llm_gateway_degraded_reconciliations",
            "Buckets charged to Redis with what was admitted while it was away, by outcome",
            self.reconciliations.clone(),
        );
        r.register("llm_gateway_shed", "Requests shed (429 overloaded) by pool and tier", self.shed.clone());
        r.register(
            "llm_gateway_admission_leases",
            "Admission-lease calls from the wasm filter, by outcome",
            self.admission_leases.clone(),
        );
        r.register(
            "llm_gateway_exact_counts",
            "Exact context counts of admitted requests, by outcome",
            self.exact_counts.clone(),
        );
    }

    /// Registers the metrics of the pools (in flight, load, waiting, KV cache) and Redis.
    fn register_pools(&self, r: &mut Registry) {
        r.register(
            "llm_gateway_in_flight_requests",
            "Requests admitted and not finished, over every sidecar replica",
            self.in_flight.clone(),
        );
        r.register(
            "llm_gateway_in_flight_corrections",
            "Requests taken off (or at idle put back on) the in-flight count to match vLLM's metrics",
            self.in_flight_corrections.clone(),
        );
        r.register(
            "llm_gateway_pool_sidecar_replicas",
            "Sidecar replicas that flushed the pool's in-flight counts within the report lag",
            self.pool_sidecar_replicas.clone(),
        );
        r.register("llm_gateway_pool_load", "Pool load ratio used for shedding", self.pool_load.clone());
        r.register(
            "llm_gateway_pool_requests_waiting",
            "Scraped vllm:num_requests_waiting",
            self.pool_waiting.clone(),
        );
        r.register(
            "llm_gateway_pool_kv_cache_usage",
            "Scraped vLLM KV-cache usage (0..1)",
            self.pool_kv_cache.clone(),
        );
        r.register(
            "llm_gateway_endpoint_scrape_ok",
            "1 when the endpoint's last /metrics scrape succeeded",
            self.endpoint_scrape_ok.clone(),
        );
        r.register(
            "llm_gateway_endpoint_scrape_filtered",
            "1 when the endpoint's last scrape read only the vLLM samples the sidecar uses (/metrics/ with name[])",
            self.endpoint_scrape_filtered.clone(),
        );
        r.register(
            "llm_gateway_endpoint_last_scrape_timestamp_seconds",
            "Unix time of the endpoint's last successful /metrics scrape",
            self.endpoint_last_scrape.clone(),
        );
        r.register_with_unit(
            "llm_gateway_redis_command_duration",
            "Redis command latency",
            Unit::Seconds,
            self.redis_latency.clone(),
        );
        r.register("llm_gateway_redis_errors", "Redis errors and timeouts", self.redis_errors.clone());
    }

    /// Registers the metrics of usage records and the ledger's reservations and leases.
    fn register_usage(&self, r: &mut Registry) {
        r.register(
            "llm_gateway_usage_records_buffered",
            "Usage records waiting for Redis",
            self.records_buffered.clone(),
        );
        r.register(
            "llm_gateway_usage_records_written",
            "Usage records written",
            self.records_written.clone(),
        );
        r.register(
            "llm_gateway_usage_records_dropped",
            "Usage records dropped (logged)",
            self.records_dropped.clone(),
        );
        r.register(
            "llm_gateway_usage_records_refused",
            "Usage records refused: counts the ledger cannot hold exactly (logged)",
            self.records_refused.clone(),
        );
        r.register(
            "llm_gateway_usage_out_of_bounds",
            "Upstream usage past what its request could produce, billed at the reservation (logged)",
            self.usage_out_of_bounds.clone(),
        );
        r.register(
            "llm_gateway_usage_unreadable",
            "2xx responses whose usage could not be read (coded, missing, given twice), billed at the reservation (logged)",
            self.usage_unreadable.clone(),
        );
        r.register(
            "llm_gateway_usage_records_unconfirmed",
            "Usage records given up because a write that may have landed is past the idempotency retention (logged)",
            self.records_unconfirmed.clone(),
        );
        r.register(
            "llm_gateway_usage_records_unknown_tenant",
            "Usage records of an unconfigured tenant, dropped (logged)",
            self.records_unknown_tenant.clone(),
        );
        r.register(
            "llm_gateway_usage_records_duplicate",
            "Deliveries of a usage record the ledger had applied already, not applied again",
            self.records_duplicate.clone(),
        );
        r.register(
            "llm_gateway_usage_records_from_reservation",
            "Reservations whose usage never arrived, recorded as charged by this replica's sweeper",
            self.records_charged.clone(),
        );
        r.register(
            "llm_gateway_usage_records_after_charge",
            "Usage that arrived after its reservation was charged, not applied (logged)",
            self.records_after_charge.clone(),
        );
        r.register(
            "llm_gateway_reservations_released",
            "Admissions given back before their request went upstream, their reservation closed",
            self.reservations_released.clone(),
        );
        r.register(
            "llm_gateway_admission_leases_reclaimed",
            "Admission leases reclaimed as orphaned: not given back within their TTL",
            self.leases_reclaimed.clone(),
        );
        r.register(
            "llm_gateway_admission_lease_requests_charged",
            "Reported leased requests of reclaimed leases whose usage never arrived, charged their reservations",
            self.leases_charged_requests.clone(),
        );
        r.register(
            "llm_gateway_reservations_open",
            "Open reservations over the configured tenants at this replica's last sweep",
            self.reservations_open.clone(),
        );
    }

    /// Registers the metrics of the usage journal, the endpoint picker and flow control's queues.
    fn register_journal_picker_queue(&self, r: &mut Registry) {
        r.register("llm_gateway_journal_lines", "Usage journal lines read", self.journal_lines.clone());
        r.register(
            "llm_gateway_journal_records_applied",
            "Ledger writes the usage journal applied that no other delivery had",
            self.journal_records_applied.clone(),
        );
        r.register(
            "llm_gateway_journal_lines_landed",
            "Usage journal lines skipped: their write landed through this replica's gRPC access log",
            self.journal_lines_landed.clone(),
        );
        r.register(
            "llm_gateway_journal_parse_errors",
            "Usage journal lines that are not entries, skipped",
            self.journal_parse_errors.clone(),
        );
        r.register(
            "llm_gateway_journal_lag_bytes",
            "Bytes of the usage journal not yet applied",
            self.journal_lag_bytes.clone(),
        );
        r.register(
            "llm_gateway_journal_holder",
            "1 while this replica holds the usage journal's lease",
            self.journal_holder.clone(),
        );
        r.register(
            "llm_gateway_journal_files",
            "Usage journal files started after a rotation",
            self.journal_files.clone(),
        );
        r.register(
            "llm_gateway_picker_picks",
            "Endpoint picks by pool, endpoint and what decided",
            self.picks.clone(),
        );
        r.register(
            "llm_gateway_picker_prefix_blocks",
            "Prompt blocks of picked requests (requested) and those the pick had served recently (hit)",
            self.pick_prefix_blocks.clone(),
        );
        r.register(
            "llm_gateway_picker_no_pick",
            "Admitted requests of a picking pool without a pick: none_eligible (LEAST_REQUEST) or subset_none_eligible (503)",
            self.no_pick.clone(),
        );
        r.register(
            "llm_gateway_picker_in_flight_requests",
            "This sidecar's picks of an endpoint whose end it has not seen",
            self.pick_in_flight.clone(),
        );
        r.register(
            "llm_gateway_picker_ttft_model",
            "A picking pool's fitted TTFT model: floor, per request ahead and per uncached prompt KiB (seconds), samples; its prompt bytes per token",
            self.pick_ttft_model.clone(),
        );
        r.register_with_unit(
            "llm_gateway_picker_pick_duration",
            "Time of one endpoint pick",
            Unit::Seconds,
            self.pick_duration.clone(),
        );
        r.register(
            "llm_gateway_queue_requests",
            "Requests waiting in a pool's flow-control queue, by tier",
            self.queue_length.clone(),
        );
        r.register_with_unit(
            "llm_gateway_queue_wait",
            "Time dispatched requests waited in a flow-control queue",
            Unit::Seconds,
            self.queue_wait.clone(),
        );
        r.register(
            "llm_gateway_queue_dequeues",
            "Requests leaving a flow-control queue (or refused before entering it), by reason",
            self.queue_dequeues.clone(),
        );
    }

    /// A label value, or `other` once [`MAX_LABEL_VALUES`] distinct values have been seen.
    pub fn bounded(&self, value: &str) -> String {
        let Ok(mut budget) = self.labels.lock() else { return "other".to_owned() };
        if budget.seen.contains(value) || budget.seen.len() < MAX_LABEL_VALUES * 3 {
            budget.seen.insert(value.to_owned());
            value.to_owned()
        } else {
            "other".to_owned()
        }
    }

    /// `{tenant, model}` with bounded values.
    pub fn tenant_model(&self, tenant: &str, model: &str) -> TenantModel {
        TenantModel { tenant: self.bounded(tenant), model: self.bounded(model) }
    }

    /// Counts an admission outcome.
    pub fn request(&self, tenant: &str, model: &str, outcome: &str) {
        let tm = self.tenant_model(tenant, model);
        self.requests
            .get_or_create(&Outcome { tenant: tm.tenant, model: tm.model, outcome: outcome.to_owned() })
            .inc();
    }

    /// Runs a Redis call, its latency and failure counted under `op`
    /// (`llm_gateway_redis_command_duration_seconds{op}`, `llm_gateway_redis_errors_total{op}`).
    pub async fn timed_redis<T, E>(
        &self,
        op: &str,
        call: impl std::future::Future<Output = Result<T, E>>,
    ) -> Result<T, E> {
        let started = std::time::Instant::now();
        let result = call.await;
        self.redis_call(op, started.elapsed(), result.is_ok());
        result
    }

    /// Records the latency (and failure) of a Redis call.
    pub fn redis_call(&self, op: &str, elapsed: Duration, ok: bool) {
        let op = Op { op: op.to_owned() };
        self.redis_latency.get_or_create(&op).observe(elapsed.as_secs_f64());
        if !ok {
            self.redis_errors.get_or_create(&op).inc();
        }
    }

    /// The Prometheus text exposition of every metric.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

/// Serves `GET /metrics` (anything else: 404) until the process ends.
pub async fn serve(addr: SocketAddr, metrics: Arc<Metrics>) -> std::io::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else { continue };
            let metrics = Arc::clone(&metrics);
            tokio::spawn(async move {
                let service = service_fn(move |req: Request<hyper::body::Incoming>| {
                    let metrics = Arc::clone(&metrics);
                    async move {
                        let response = if req.uri().path() == "/metrics" {
                            Response::builder()
                                .header(
                                    "content-type",
                                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                                )
                                .body(Full::new(Bytes::from(metrics.encode())))
                        } else {
                            Response::builder().status(404).body(Full::new(Bytes::new()))
                        };
                        response.map_err(std::io::Error::other)
                    }
                });
                if let Err(error) = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await
                {
                    warn!(%error, "metrics connection");
                }
            });
        }
    });
    Ok(bound)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposes_otel_names_and_bounds_labels() {
        let m = Metrics::new();
        m.request("acme", "m1", "admitted");
        let gen_ai = GenAi {
            gen_ai_operation_name: "chat".into(),
            gen_ai_provider_name: labels::PROVIDER,
            gen_ai_request_model: "m1".into(),
            gen_ai_response_model: "org/m1".into(),
        };
        m.ttft.get_or_create(&gen_ai).observe(0.05);
        m.duration.get_or_create(&GenAiOutcome { gen_ai, error_type: "503".into() }).observe(0.5);
        m.cost_usd.get_or_create(&m.tenant_model("acme", "m1")).inc_by(0.25);
        m.redis_call("take", Duration::from_micros(300), false);
        let text = m.encode();
        assert!(
            text.contains("llm_gateway_requests_total{tenant=\"acme\",model=\"m1\",outcome=\"admitted\"} 1"),
            "{text}"
        );
        assert!(
            text.contains(
                "gen_ai_server_time_to_first_token_seconds_count{gen_ai_operation_name=\"chat\",\
                 gen_ai_provider_name=\"vllm\",gen_ai_request_model=\"m1\",gen_ai_response_model=\"org/m1\"} 1"
            ),
            "{text}"
        );
        assert!(text.contains("gen_ai_response_model=\"org/m1\",error_type=\"503\"} 1"), "{text}");
        assert!(text.contains("llm_gateway_cost_usd_total{tenant=\"acme\",model=\"m1\"} 0.25"), "{text}");
        assert!(text.contains("llm_gateway_redis_errors_total{op=\"take\"} 1"), "{text}");
        for i in 0..(MAX_LABEL_VALUES * 3 + 10) {
            m.bounded(&format!("t{i}"));
        }
        assert_eq!(m.bounded("late-newcomer"), "other");
        assert_eq!(m.bounded("acme"), "acme");
    }
}
