//! The label sets of the sidecar's metrics (prometheus-client `EncodeLabelSet`s).

use prometheus_client::encoding::EncodeLabelSet;

/// `{tenant, model}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TenantModel {
    /// Tenant id.
    pub tenant: String,
    /// Public model name.
    pub model: String,
}

/// `{tenant, model, outcome}`: what admission decided.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Outcome {
    /// Tenant id.
    pub tenant: String,
    /// Public model name.
    pub model: String,
    /// `admitted`, `rate_limited_requests`, `rate_limited_tokens`, `overloaded`,
    /// `context_length_exceeded`, `limiter_unavailable`, `tenant_not_configured`, `missing_tenant`.
    pub outcome: String,
}

/// `{tenant, model, status, end_reason}`: how metered responses ended.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Finished {
    /// Tenant id.
    pub tenant: String,
    /// Public model name.
    pub model: String,
    /// Status class, `2xx`..`5xx`, or `none` when no response arrived.
    pub status: String,
    /// `completed` or `incomplete`.
    pub end_reason: String,
}

/// The OpenTelemetry GenAI attributes of a request's metrics (semantic conventions v1.37.0,
/// their Prometheus names): `gen_ai_operation_name`, `gen_ai_provider_name`,
/// `gen_ai_request_model`, `gen_ai_response_model`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct GenAi {
    /// `gen_ai.operation.name`: `chat`, `text_completion` or `embeddings`
    /// ([`gateway_contract::OPERATIONS`]); `unknown` from facts without it.
    pub gen_ai_operation_name: String,
    /// `gen_ai.provider.name`: [`PROVIDER`].
    pub gen_ai_provider_name: &'static str,
    /// `gen_ai.request.model`: the canonical public model name the tenant asked for.
    pub gen_ai_request_model: String,
    /// `gen_ai.response.model`: the model name sent upstream (vLLM's `served_model_name` or the
    /// LoRA adapter), the response's `model`; the request model from facts without it.
    pub gen_ai_response_model: String,
}

/// The `gen_ai.provider.name` of the pools' engine: vLLM (not one of the convention's
/// well-known values, which name hosted APIs; custom values are allowed).
pub const PROVIDER: &str = "vllm";

/// [`GenAi`] and `error_type` (OTel `error.type`): empty for a 2xx response, else the upstream's
/// HTTP status code, or `no_response` when none arrived, or `incomplete` for a response that
/// did not complete (the client or the upstream went away).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct GenAiOutcome {
    /// The request's GenAI attributes.
    #[prometheus(flatten)]
    pub gen_ai: GenAi,
    /// `error.type`.
    pub error_type: String,
}

/// [`GenAi`] and `gen_ai_token_type` (OTel `gen_ai.token.type`: `input` or `output`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct GenAiTokens {
    /// The request's GenAI attributes.
    #[prometheus(flatten)]
    pub gen_ai: GenAi,
    /// `input` or `output`.
    pub gen_ai_token_type: &'static str,
}

/// `{tenant}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TenantLabel {
    /// Tenant id.
    pub tenant: String,
}

/// `{tenant, api_key}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TenantApiKey {
    /// Tenant id.
    pub tenant: String,
    /// The API key's name (never the key): the gateway config's `tenants[].api_keys[].name`.
    pub api_key: String,
}

/// `{tenant, model, token_type}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TenantTokens {
    /// Tenant id.
    pub tenant: String,
    /// Public model name.
    pub model: String,
    /// `input` or `output`.
    pub token_type: String,
}

/// `{decision, degraded}` of a limit decision.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Decision {
    /// `admit` or `deny`.
    pub decision: String,
    /// `true` when made without Redis (local buckets or failure mode closed).
    pub degraded: String,
}

/// `{reason}` of a degraded decision: `breaker_open`, `redis_error`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Reason {
    /// Why Redis did not decide.
    pub reason: String,
}

/// `{outcome}` of an admission-lease call from the filter: `granted`, `given_back`, or why none was
/// granted (`off`, `unknown_tenant`, `picking`, `load_protected`, `shedding`, `headroom`, `too_tight`, `over_limit`, `quota`,
/// `redis_unavailable`); of a report on a held lease (`reported`, `report_closed`,
/// `report_failed`); also of a degraded bucket's reconciliation (`applied`, `retried`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LeaseOutcome {
    /// What the call got.
    pub outcome: String,
}

/// `{reason}` of a usage the sidecar could not use and billed at the reservation instead.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct UsageReason {
    /// `llm_gateway_usage_out_of_bounds_total`: `prompt_tokens`, `completion_tokens`,
    /// `cached_tokens`; `llm_gateway_usage_unreadable_total`: `encoded`, `missing`, `duplicate`.
    pub reason: &'static str,
}

/// `{outcome}` of an exact context count: `fits`, `exceeded` or `undecided`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CountOutcome {
    /// How the count ended.
    pub outcome: &'static str,
}

/// `{pool}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PoolLabel {
    /// Envoy cluster of the pool.
    pub pool: String,
}

/// `{pool, tier}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PoolTier {
    /// Envoy cluster of the pool.
    pub pool: String,
    /// Tenant tier.
    pub tier: String,
}

/// `{pool, endpoint}` of a pick.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PoolEndpoint {
    /// Envoy cluster of the pool.
    pub pool: String,
    /// The picked endpoint, `ip:port` (one of the pool's configured endpoints).
    pub endpoint: String,
    /// What decided it: `slot` (the free slot the flow-control queue promised it), `home` (its
    /// prefix's home), `affinity` (bounded-load prefix affinity), `predicted_affinity` /
    /// `predicted` (the predicted TTFT, with or without the longest prefix), else `score`.
    pub by: &'static str,
}

/// `{pool, endpoint}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EndpointLabel {
    /// Envoy cluster of the pool.
    pub pool: String,
    /// One of the pool's configured endpoints, `ip:port`.
    pub endpoint: String,
}

/// `{pool, kind}` of the picker's prompt blocks: `requested` (the requests' blocks) or `hit`
/// (those the picked endpoint had served recently).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PoolBlocks {
    /// Envoy cluster of the pool.
    pub pool: String,
    /// `requested` or `hit`.
    pub kind: &'static str,
}

/// `{pool, reason}` of an admitted request the picker did not pick for: `none_eligible` (sent
/// without a pick: Envoy's `LEAST_REQUEST` chooses) or `subset_none_eligible` (answered 503).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PoolReason {
    /// Envoy cluster of the pool.
    pub pool: String,
    /// Why no pick.
    pub reason: &'static str,
}

/// `{pool, term}` of a pool's fitted TTFT model (`crate::scheduling::ttft_model`): `floor_seconds`
/// (`a`), `per_request_ahead_seconds` (`b`), `per_uncached_kib_seconds` (`c`), `samples`, and the
/// pool's `prompt_bytes_per_token`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PoolTerm {
    /// Envoy cluster of the pool.
    pub pool: String,
    /// The model's term.
    pub term: &'static str,
}

/// `{op}` of a Redis call: `take`, `settle`, `record`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Op {
    /// The operation.
    pub op: String,
}

/// `{pool, tier, tenant}`: a flow-control queue's waits.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct QueueWait {
    /// Pool (Envoy cluster).
    pub pool: String,
    /// Tenant tier.
    pub tier: String,
    /// Tenant id.
    pub tenant: String,
}

/// `{pool, tier, reason}`: why a request left (or never entered) a flow-control queue.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct QueueDequeue {
    /// Pool (Envoy cluster).
    pub pool: String,
    /// Tenant tier.
    pub tier: String,
    /// `dispatched`, `timeout`, `predicted_wait`, `full`, `evicted`, `cancelled` (its stream went
    /// away), `shutdown`.
    pub reason: &'static str,
}

/// `{result}` of a config reload: `applied`, or `refused` (the file did not validate, or changed
/// a section that does not reload; the running config is kept).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReloadResult {
    /// `applied` or `refused`.
    pub result: &'static str,
}

/// `{sha256}` of the config file the sidecar serves by: the lowercase hex SHA-256 of its bytes
/// (`gatewayctl apply` waits for it to name the file it wrote).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ConfigInfo {
    /// SHA-256 of the file, lowercase hex.
    pub sha256: String,
}
