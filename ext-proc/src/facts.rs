//! What the gateway knows of a request, from what clients cannot write: the filter's facts
//! (its `FS_REQUEST` filter state, [`gateway_contract::RequestFacts`]) and what the sidecar's
//! admission forwards in Envoy's dynamic metadata (namespace `llm_gateway`, the names in
//! [`gateway_contract`]). Every stage reads a request through these; none reads a request
//! header for a fact.

use envoy_types::pb::envoy::config::core::v3::Metadata;
use envoy_types::pb::google::protobuf::{value::Kind, Value};
use gateway_contract::{
    MD_DESTINATION_ENDPOINT_SUBSET, MD_NAMESPACE_SUBSET_HINT, MD_PICKED_ENDPOINT, MD_QUEUE_WAIT_MS,
    MD_RESERVED_LOCALLY, MD_RESERVED_TOKENS, METADATA_NAMESPACE,
};

/// The `details` of the sidecar's own replies (ImmediateResponse), which Envoy logs as the
/// response code details: the access log tells the sidecar's refusals from requests whose
/// admission answer never arrived.
pub const ADMISSION_REPLY_DETAILS: &str = "llm_gateway_admission";

/// What the wasm filter told the sidecar about a request: its [`gateway_contract::RequestFacts`]
/// (filter state), and Envoy's `x-request-id`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestFacts {
    /// `x-gateway-tenant`: the authenticated tenant (None: the filter did not decide the
    /// request).
    pub tenant: Option<String>,
    /// The name of the API key the request authenticated with
    /// ([`gateway_contract::RequestFacts::api_key`]; never the key; `None` from an older filter
    /// or from headers).
    pub api_key: Option<String>,
    /// `x-gateway-model`: the public model name.
    pub model: String,
    /// `x-gateway-pool`: the Envoy cluster of the vLLM pool.
    pub pool: String,
    /// `x-gateway-prompt-tokens`: prompt tokens, exact or estimated (0 when absent).
    pub prompt_tokens: u64,
    /// `max_tokens` of the facts: the most completion tokens the request can produce over all its
    /// choices (0 when absent).
    pub max_tokens: u64,
    /// `x-request-id`.
    pub request_id: String,
    /// `x-gateway-tier`: the tenant's priority tier (empty when absent).
    pub tier: String,
    /// `x-gateway-reserved-tokens`, when the filter admitted the request from an admission lease
    /// (`x-gateway-admission: lease`): the tokens it reserved from the lease.
    pub leased_tokens: Option<u64>,
    /// The lease that admitted the request ([`gateway_contract::RequestFacts::lease_id`]; only
    /// with `leased_tokens`).
    pub lease_id: Option<String>,
    /// The request's number among its lease's admissions
    /// ([`gateway_contract::RequestFacts::lease_seq`]; only with `lease_id`).
    pub lease_seq: Option<u64>,
    /// The filter's prompt-prefix hashes ([`gateway_contract::RequestFacts::prefix_hashes`],
    /// encoded), for the endpoint picker.
    pub prefix_hashes: Option<String>,
    /// The filter's per-request nonce ([`gateway_contract::RequestFacts::nonce`]; `None` from an
    /// older filter).
    pub nonce: Option<String>,
    /// The most prompt tokens the upstream can report
    /// ([`gateway_contract::RequestFacts::prompt_tokens_max`]; `None` from an older filter or
    /// from headers).
    pub prompt_tokens_max: Option<u64>,
    /// The most completion tokens the upstream can report
    /// ([`gateway_contract::RequestFacts::completion_tokens_max`]).
    pub completion_tokens_max: Option<u64>,
    /// The request body's size in bytes ([`gateway_contract::RequestFacts::body_bytes`]): what
    /// Envoy holds for it while it is queued.
    pub body_bytes: Option<u64>,
    /// OpenTelemetry `gen_ai.operation.name` ([`gateway_contract::RequestFacts::operation`]).
    pub operation: Option<String>,
    /// The model name sent upstream ([`gateway_contract::RequestFacts::upstream_model`]).
    pub upstream_model: Option<String>,
}

impl RequestFacts {
    /// The facts the filter set (filter state); the request id is the one the filter saw, else
    /// `request_id` (Envoy's `x-request-id` where the caller reads it, from a filter older than
    /// the facts' `request_id`).
    pub fn from_filter(facts: gateway_contract::RequestFacts, request_id: String) -> Self {
        Self {
            tenant: Some(facts.tenant),
            api_key: facts.api_key,
            model: facts.model,
            pool: facts.pool,
            prompt_tokens: facts.prompt_tokens,
            max_tokens: facts.max_tokens,
            request_id: facts.request_id.unwrap_or(request_id),
            tier: facts.tier,
            leased_tokens: facts.leased_tokens,
            lease_seq: facts.lease_seq.filter(|_| facts.leased_tokens.is_some() && facts.lease_id.is_some()),
            lease_id: facts.lease_id.filter(|_| facts.leased_tokens.is_some()),
            prefix_hashes: facts.prefix_hashes,
            nonce: facts.nonce,
            prompt_tokens_max: facts.prompt_tokens_max,
            completion_tokens_max: facts.completion_tokens_max,
            body_bytes: facts.body_bytes,
            operation: facts.operation,
            upstream_model: facts.upstream_model,
        }
    }

    /// The request's record id in the ledger ([`gateway_contract::record_id`] of its request id
    /// and nonce); `None` without a valid nonce (facts of an older filter: its usage record gets
    /// another id, and its reservation is not tracked).
    pub fn record_id(&self) -> Option<String> {
        gateway_contract::record_id(&self.request_id, self.nonce.as_deref()?)
    }

    /// Tokens to reserve against the tenant's TPM bucket: prompt plus the completion cap, the
    /// most the request can cost. Settled against the real usage when it ends.
    pub fn reserve_tokens(&self) -> u64 {
        self.prompt_tokens.saturating_add(self.max_tokens)
    }
}

/// The reservation admission made, from the forwarded `llm_gateway` metadata: (tokens, whether
/// in this sidecar's memory). None forwarded: (0, false).
pub fn reservation(metadata: Option<&Metadata>) -> (u64, bool) {
    let fields = metadata.and_then(|m| m.filter_metadata.get(METADATA_NAMESPACE)).map(|s| &s.fields);
    let tokens = fields.and_then(|f| metadata_number(f.get(MD_RESERVED_TOKENS)?)).unwrap_or(0);
    let locally = fields
        .and_then(|f| f.get(MD_RESERVED_LOCALLY))
        .is_some_and(|v| matches!(v.kind, Some(Kind::BoolValue(true))));
    (tokens, locally)
}

/// A whole, non-negative number the admission wrote to the metadata (None: another kind, or not
/// a count: negative, fractional, not finite or above 2^53).
pub fn metadata_number(value: &Value) -> Option<u64> {
    match value.kind {
        Some(Kind::NumberValue(n)) if (0.0..=9_007_199_254_740_992.0).contains(&n) && n.fract() == 0.0 => {
            Some(n as u64)
        }
        _ => None,
    }
}

/// The endpoint-picker protocol's subset hint in an ext_proc request's `metadata_context`:
/// `filter_metadata["envoy.lb.subset_hint"]["x-gateway-destination-endpoint-subset"]`, a list of
/// `ip:port` strings (a comma-separated string is read too). `None` when the key is absent; the
/// addresses that parse otherwise (none, for an empty list or a value of another kind).
pub fn subset_hint(metadata: Option<&Metadata>) -> Option<Vec<std::net::SocketAddr>> {
    let value = metadata?
        .filter_metadata
        .get(MD_NAMESPACE_SUBSET_HINT)?
        .fields
        .get(MD_DESTINATION_ENDPOINT_SUBSET)?;
    let mut addrs = Vec::new();
    let mut add =
        |s: &str| addrs.extend(s.split(',').filter_map(|a| a.trim().parse::<std::net::SocketAddr>().ok()));
    match &value.kind {
        Some(Kind::ListValue(list)) => {
            for v in &list.values {
                if let Some(Kind::StringValue(s)) = &v.kind {
                    add(s);
                }
            }
        }
        Some(Kind::StringValue(s)) => add(s),
        _ => {}
    }
    Some(addrs)
}

/// How long a request waited in its pool's flow-control queue, from the forwarded
/// `llm_gateway` metadata (`queue_wait_ms`: milliseconds as a decimal string, written by the
/// admission of a request that was queued); zero when it was not queued or the value is not a
/// number.
pub fn queue_wait(metadata: Option<&Metadata>) -> std::time::Duration {
    let ms = gateway_string(metadata, MD_QUEUE_WAIT_MS).and_then(|s| s.parse::<u64>().ok()).unwrap_or(0);
    std::time::Duration::from_millis(ms)
}

/// The string value of `key` in the forwarded `llm_gateway` metadata; None when absent, of
/// another kind, or empty.
fn gateway_string<'a>(metadata: Option<&'a Metadata>, key: &str) -> Option<&'a str> {
    match &metadata?.filter_metadata.get(METADATA_NAMESPACE)?.fields.get(key)?.kind {
        Some(Kind::StringValue(s)) if !s.is_empty() => Some(s.as_str()),
        _ => None,
    }
}

/// The endpoint the picker picked for a request, from the forwarded `llm_gateway` metadata
/// (`picked_endpoint`); None when it was not picked.
pub fn picked_endpoint(metadata: Option<&Metadata>) -> Option<String> {
    gateway_string(metadata, MD_PICKED_ENDPOINT).map(str::to_owned)
}
