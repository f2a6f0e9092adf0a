//! The request/response decisions of the filter as pure functions over header lists and body
//! bytes. The wasm adapter (`wasm.rs`) only moves data between Envoy and these functions.
//!
//! Header contract (request headers toward the upstream and the sidecar; every client-sent
//! `x-gateway-*` header is removed first, as are `authorization` and `x-api-key`):
//!
//! | header | value |
//! |---|---|
//! | `x-gateway-tenant` | tenant id |
//! | `x-gateway-tier` | tenant tier |
//! | `x-gateway-model` | canonical model name (after alias resolution), or the LoRA adapter name |
//! | `x-gateway-pool` | Envoy cluster (route uses `cluster_header: x-gateway-pool`) |
//! | `x-gateway-prompt-tokens` | prompt token estimate (decimal integer; sum over a batch) |
//! | `x-gateway-prompt-tokens-source` | `estimate` or `exact` |
//! | `x-gateway-max-tokens` | the most completion tokens the request can produce over all its choices: the per-choice cap (`max_completion_tokens`/`max_tokens`; if unset, `max_model_len - estimate` floored at 0) times the sequences vLLM generates (`n`, on completions `max(n, best_of)`, for each prompt of a batch), saturating; for the Responses API `max_output_tokens` capped at `max_model_len - estimate` ([`crate::context::responses_budget`]); 0 for embeddings |
//! | `x-gateway-usage-injected` | `1`, only when the filter injected `stream_options.include_usage` (chat and completions streams; never for the Responses API, whose streams report usage unasked) |
//! | `x-gateway-context-check` | `exact`, only when the bounds cannot decide the context rule and the model has `exact_count` (the sidecar counts exactly) |
//! | `x-gateway-context-model` | with `x-gateway-context-check`: the base model whose tokenizer counts |
//!
//! These headers are informational (for the upstream and for people reading logs): a client can
//! send them to any hop that answers before this filter runs. What the sidecar admits and meters
//! by is [`ForwardPlan::facts`], which the adapter sets as the filter state
//! `wasm.llm_gateway.request` (with `leased_tokens` for a request admitted from an admission lease,
//! which also sets `wasm.llm_gateway.admission` to `lease`, so that Envoy's matcher skips the
//! ext_proc admission): see the `gateway-contract` crate.

use serde::Serialize;
use serde_json::Value;

use crate::auth::authenticate;
use crate::config::{Config, UpstreamHeaders};
use crate::context::{
    check_context, completion_budget, count_prompt, fits_by_upper_bound, responses_budget, ByteBoundCounter,
    CountSource, PromptCounts, TokenCounter,
};
use crate::error::{truncate_for_echo, GatewayError, LocalReply};
use crate::json_scan::{
    apply_edits, apply_edits_in_place, array_elements, scan_object, string_bytes_lower, Edit,
};
use crate::lease::AdmissionFacts;
use crate::request::{classify, parse_json, validate, Endpoint, ValidatedRequest};
use crate::routing::{listed_models, route, Route};

pub use gateway_contract::{
    RequestFacts, GATEWAY_HEADER_PREFIX, H_CONTEXT_CHECK, H_CONTEXT_MODEL, H_MAX_TOKENS, H_MODEL, H_POOL,
    H_PROMPT_TOKENS, H_PROMPT_TOKENS_SOURCE, H_TENANT, H_TIER, H_USAGE_INJECTED,
};

/// A header list as Envoy hands it over: lowercase names, raw value bytes.
pub type HeaderList = [(String, Vec<u8>)];

/// First value of header `name` (ASCII case-insensitive), ignoring gateway-owned headers.
pub fn header<'a>(headers: &'a HeaderList, name: &str) -> Option<&'a [u8]> {
    headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case(name) && !is_gateway_header(k))
        .map(|(_, v)| v.as_slice())
}

fn is_gateway_header(name: &str) -> bool {
    name.get(..GATEWAY_HEADER_PREFIX.len()).is_some_and(|p| p.eq_ignore_ascii_case(GATEWAY_HEADER_PREFIX))
}

/// Names of the request headers to remove before anything else: every `x-gateway-*` header, and
/// `authorization` / `x-api-key` (credentials never go upstream). Lowercase, deduplicated.
pub fn headers_to_remove(headers: &HeaderList) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for (k, _) in headers {
        // Only a dropped name is lowered (a copy): most requests carry one, `authorization`.
        let drop = is_gateway_header(k)
            || k.eq_ignore_ascii_case("authorization")
            || k.eq_ignore_ascii_case("x-api-key");
        if drop && !out.iter().any(|o| o.eq_ignore_ascii_case(k)) {
            out.push(k.to_ascii_lowercase());
        }
    }
    out
}

/// State carried from the request headers to the request body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingRequest {
    /// The endpoint (never `Models`, which is answered at once).
    pub endpoint: Endpoint,
    /// Index of the authenticated tenant in [`Config::tenants`].
    pub tenant: usize,
    /// Index of the API key it authenticated with in [`Config::api_keys`].
    pub api_key: usize,
    /// `x-request-id`, for the weighted pool choice.
    pub request_id: Option<Vec<u8>>,
    /// Whether the request carries `content-length` (updated when the body is rewritten).
    pub has_content_length: bool,
    /// Whether the client's `accept-encoding` asks for a content coding (anything but
    /// `identity`): the forwarded request then asks for `identity` instead, so that the response
    /// the meter reads is not compressed ([`gateway_meter::Meter::mark_encoded`]).
    pub accepts_coding: bool,
}

/// What to do after the request headers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeadersDecision {
    /// Send this local reply and stop.
    Reply(LocalReply),
    /// Buffer the body (return `Pause`), then call [`on_request_body`].
    AwaitBody(PendingRequest),
}

/// Result of [`on_request_headers`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeadersOutcome {
    /// Request headers to remove, in every case.
    pub remove: Vec<String>,
    /// The decision.
    pub decision: HeadersDecision,
}

/// Request-headers phase: strip gateway headers and credentials, classify the path, authenticate
/// (the key's window checked at `now_s`, seconds since the Unix epoch), enforce
/// `content-length <= max_body_bytes`, answer `GET /v1/models`.
pub fn on_request_headers(cfg: &Config, headers: &HeaderList, now_s: u64) -> HeadersOutcome {
    let remove = headers_to_remove(headers);
    let decision = match decide_headers(cfg, headers, now_s) {
        Ok(d) => d,
        Err(e) => HeadersDecision::Reply(e.to_reply()),
    };
    HeadersOutcome { remove, decision }
}

fn decide_headers(cfg: &Config, headers: &HeaderList, now_s: u64) -> Result<HeadersDecision, GatewayError> {
    let method = String::from_utf8_lossy(header(headers, ":method").unwrap_or_default());
    let path = String::from_utf8_lossy(header(headers, ":path").unwrap_or_default());
    let endpoint = classify(&method, &path)?;
    let key_idx =
        authenticate(&cfg.key_digests, header(headers, "authorization"), header(headers, "x-api-key"))?;
    let key = cfg.api_keys.get(key_idx).ok_or(GatewayError::Internal { what: "key index out of range" })?;
    key.window.check(now_s)?;
    let tenant_idx = key.tenant;
    let tenant =
        cfg.tenants.get(tenant_idx).ok_or(GatewayError::Internal { what: "tenant index out of range" })?;

    if endpoint == Endpoint::Models {
        let data = listed_models(cfg, tenant)
            .into_iter()
            .map(|id| ModelObject { id, object: "model", created: 0, owned_by: "gateway" })
            .collect();
        return Ok(HeadersDecision::Reply(LocalReply::json(200, &ModelList { object: "list", data })));
    }

    let content_length = header(headers, "content-length");
    if let Some(len) =
        content_length.and_then(|v| std::str::from_utf8(v).ok()).and_then(|s| s.trim().parse::<u64>().ok())
    {
        check_body_size(cfg, len)?;
    }
    Ok(HeadersDecision::AwaitBody(PendingRequest {
        endpoint,
        tenant: tenant_idx,
        api_key: key_idx,
        request_id: header(headers, "x-request-id").map(<[u8]>::to_vec),
        has_content_length: content_length.is_some(),
        accepts_coding: header(headers, "accept-encoding").is_some_and(asks_for_coding),
    }))
}

/// Whether an `accept-encoding` value names a content coding other than `identity` (`gzip`,
/// `br`, `*`, ...; RFC 9110 section 12.5.3).
fn asks_for_coding(value: &[u8]) -> bool {
    value.split(|&b| b == b',').any(|item| {
        let coding = item.split(|&b| b == b';').next().unwrap_or_default().trim_ascii();
        !coding.is_empty() && !coding.eq_ignore_ascii_case(b"identity")
    })
}

/// `GET /v1/models` body: the OpenAI list shape.
#[derive(Serialize)]
struct ModelList<'a> {
    object: &'static str,
    data: Vec<ModelObject<'a>>,
}

/// One entry of [`ModelList`]: the OpenAI model object (`created` is always 0).
#[derive(Serialize)]
struct ModelObject<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    owned_by: &'static str,
}

/// A fresh [`gateway_contract::RequestFacts::nonce`]: SipHash, under std's random keys
/// (`RandomState`: in the wasm module seeded from Envoy's `random_get`, natively by the OS; every
/// `new()` moves its keys on, so no two draws share them), of the clock as the request's headers
/// phase read it (`started_us`, microseconds since the Unix epoch: no clock read of its own), as
/// 16 lowercase hex digits. Both adapters (`wasm.rs`, `filter-native`) name requests with it.
pub fn request_nonce(started_us: u64) -> String {
    use std::hash::BuildHasher;
    format!("{:016x}", std::hash::RandomState::new().hash_one(started_us))
}

/// Enforces `max_body_bytes` on a declared or buffered body size in bytes.
///
/// # Errors
/// [`GatewayError::RequestTooLarge`] (413) when `size > max_body_bytes`.
pub fn check_body_size(cfg: &Config, size: u64) -> Result<(), GatewayError> {
    if size > cfg.max_body_bytes {
        return Err(GatewayError::RequestTooLarge { limit: cfg.max_body_bytes });
    }
    Ok(())
}

/// What to forward upstream after a valid body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ForwardPlan {
    /// Request headers to set (replacing any value), in contract order; includes
    /// `content-length` when the body changed and the request had one.
    pub set_headers: Vec<(&'static str, String)>,
    /// The new body, when it changed (`model` rewritten and/or `stream_options` injected).
    pub new_body: Option<Vec<u8>>,
    /// Whether `stream_options.include_usage` was injected (the response must be stripped).
    pub usage_injected: bool,
    /// Whether the adapter also sets `x-gateway-request-nonce` to the nonce it draws for the
    /// facts (`upstream_headers: all`, for a sidecar that reads the facts from the headers).
    pub nonce_header: bool,
    /// The request's OpenAI `stream` flag, for the meter (what an abort before the response
    /// headers is charged: `gateway_meter::Usage::charges_reservation`).
    pub stream: bool,
    /// The API whose response shapes the meter reads (the Responses API's differ from chat's).
    pub api: gateway_meter::Api,
    /// What an admission lease needs to admit the request; `None` when only the sidecar can
    /// (its exact context check).
    pub admission: Option<AdmissionFacts>,
    /// The decision, for the sidecar: set as the filter state `wasm.llm_gateway.request`
    /// (`leased_tokens` is filled in by the adapter when a lease admits the request).
    pub facts: RequestFacts,
}

/// Request-body phase (whole body buffered): size limit, parse and validate, route, context
/// check, header outputs and body rewrite (`new_body`, a rewritten copy of `body`).
///
/// # Errors
/// Any [`GatewayError`] to send as a local reply.
pub fn on_request_body(
    cfg: &Config,
    pending: &PendingRequest,
    body: &[u8],
) -> Result<ForwardPlan, GatewayError> {
    let (mut plan, edits) = plan_request_body(cfg, pending, body)?;
    if !edits.is_empty() {
        plan.new_body = Some(apply_edits(body, edits).ok_or_else(rewrite_failed)?);
    }
    Ok(plan)
}

/// [`on_request_body`] on a body the caller gives away: a rewrite edits it in place and returns it
/// as `new_body` (no second copy of a large body in the VM's memory).
///
/// # Errors
/// As [`on_request_body`].
pub fn on_request_body_owned(
    cfg: &Config,
    pending: &PendingRequest,
    mut body: Vec<u8>,
) -> Result<ForwardPlan, GatewayError> {
    let (mut plan, edits) = plan_request_body(cfg, pending, &body)?;
    if !edits.is_empty() {
        apply_edits_in_place(&mut body, edits).ok_or_else(rewrite_failed)?;
        plan.new_body = Some(body);
    }
    Ok(plan)
}

fn rewrite_failed() -> GatewayError {
    GatewayError::Internal { what: "request body rewrite failed" }
}

/// The plan of a request body (`new_body` unset) and the edits that rewrite it.
fn plan_request_body(
    cfg: &Config,
    pending: &PendingRequest,
    body: &[u8],
) -> Result<(ForwardPlan, Vec<Edit>), GatewayError> {
    check_body_size(cfg, body.len() as u64)?;
    let tenant = cfg
        .tenants
        .get(pending.tenant)
        .ok_or(GatewayError::Internal { what: "tenant index out of range" })?;
    if body.len() as u64 > cfg.full_parse_max_bytes {
        return on_large_body(cfg, pending, tenant, body);
    }
    let value = parse_json(body)?;
    let req = validate(pending.endpoint, body, &value)?;
    check_sequences(cfg, &req)?;
    let route = route(cfg, tenant, req.model, pending.request_id.as_deref())?;

    let counter = ByteBoundCounter::for_model(route.model);
    let counts = count_prompt(&counter as &dyn TokenCounter, &req.prompt);
    let max_model_len = route.model.max_model_len;
    let mut exact_check = false;
    let budget = match pending.endpoint {
        Endpoint::Embeddings => 0,
        Endpoint::Responses => {
            // vLLM's rule for the Responses API (`_validate_generator_input`,
            // `vllm/entrypoints/openai/serving_responses.py`): a prompt of `max_model_len` tokens
            // or more is refused, `max_output_tokens` capped to what the context leaves (later
            // releases refuse more; vLLM answers those itself). The sidecar's exact count reads
            // chat and completions bodies only: the bounds decide, else vLLM.
            check_context(max_model_len, &counts, None, pending.endpoint.prompt_param())?;
            responses_budget(max_model_len, &counts, req.max_tokens)
        }
        _ => {
            check_context(max_model_len, &counts, req.max_tokens, pending.endpoint.prompt_param())?;
            // The lower bound fits; the upper bound settles it unless it is unknown or too large.
            let settled = fits_by_upper_bound(route.model, &req.prompt, &value, req.max_tokens);
            exact_check = !settled && route.model.exact_count;
            completion_budget(max_model_len, &counts, req.max_tokens, req.choices, req.prompt.count())
        }
    };

    let prefix = cfg
        .prefix_hashing
        .and_then(|c| crate::prefix::encoded_prompt_hashes(c, route.public_name, &req.prompt));
    let mut planned =
        finish_plan(cfg, pending, tenant, body, &req, &value, &route, &counts, budget, exact_check)?;
    planned.0.facts.prefix_hashes = prefix;
    set_usage_bounds(&mut planned.0.facts, pending.endpoint, max_model_len, &req, req.prompt.count());
    Ok(planned)
}

/// Refuses a request that asks for more sequences per prompt (`n`, completions `best_of`) than
/// [`Config::max_n`] allows.
///
/// # Errors
/// [`GatewayError::InvalidValue`] (400) naming the parameter.
fn check_sequences(cfg: &Config, req: &ValidatedRequest<'_>) -> Result<(), GatewayError> {
    match req.sequences.iter().find_map(|(param, v)| v.filter(|v| *v > cfg.max_n).map(|v| (*param, v))) {
        Some((param, v)) => Err(GatewayError::InvalidValue {
            param: param.into(),
            reason: format!("{param} must be at most {}, got {v}.", cfg.max_n),
        }),
        None => Ok(()),
    }
}

/// Sets the facts' bounds on what the upstream can report ([`RequestFacts::prompt_tokens_max`],
/// [`RequestFacts::completion_tokens_max`]): `max_model_len` per prompt, and each sequence's
/// cap as sent (at most `max_model_len`; `max_model_len` without one) times the sequences of
/// every prompt; no completion for embeddings. Saturating.
fn set_usage_bounds(
    facts: &mut RequestFacts,
    endpoint: Endpoint,
    max_model_len: u64,
    req: &ValidatedRequest<'_>,
    prompts: u64,
) {
    let prompts = prompts.max(1);
    let per_sequence = req.max_tokens.map_or(max_model_len, |m| m.value.min(max_model_len));
    let completion = match endpoint {
        Endpoint::Embeddings | Endpoint::Models => 0,
        _ => per_sequence.saturating_mul(req.choices).saturating_mul(prompts),
    };
    facts.prompt_tokens_max = Some(max_model_len.saturating_mul(prompts));
    facts.completion_tokens_max = Some(completion);
}

/// The plan of a validated, routed request: the headers, and the edits that rewrite the body.
#[allow(clippy::too_many_arguments)]
fn finish_plan(
    cfg: &Config,
    pending: &PendingRequest,
    tenant: &crate::config::Tenant,
    body: &[u8],
    req: &ValidatedRequest<'_>,
    value: &Value,
    route: &Route<'_>,
    counts: &PromptCounts,
    max_tokens_header: u64,
    exact_check: bool,
) -> Result<(ForwardPlan, Vec<Edit>), GatewayError> {
    let inject = pending.endpoint.stream_usage_needs_asking() && req.stream && !req.include_usage;
    let edits = body_edits(body, req, value, route, inject)?;

    let all_headers = cfg.upstream_headers == UpstreamHeaders::All;
    let mut set_headers = if all_headers {
        vec![
            (H_TENANT, tenant.id.clone()),
            (H_TIER, tenant.tier.clone()),
            (H_MODEL, route.public_name.to_string()),
            (H_POOL, route.pool.to_string()),
            (H_PROMPT_TOKENS, counts.total_estimate.to_string()),
            (H_PROMPT_TOKENS_SOURCE, counts.source.as_str().to_string()),
            (H_MAX_TOKENS, max_tokens_header.to_string()),
        ]
    } else {
        vec![(H_POOL, route.pool.to_string())]
    };
    if inject && all_headers {
        set_headers.push((H_USAGE_INJECTED, "1".to_string()));
    }
    if exact_check && all_headers {
        set_headers.push((H_CONTEXT_CHECK, gateway_contract::CONTEXT_CHECK_EXACT.to_string()));
        set_headers.push((H_CONTEXT_MODEL, route.model.name.clone()));
    }
    if !edits.is_empty() && pending.has_content_length {
        let added: usize = edits.iter().map(|e| e.with.len()).sum();
        let removed: usize = edits.iter().map(|e| e.end.saturating_sub(e.start)).sum();
        set_headers.push(("content-length", (body.len() + added).saturating_sub(removed).to_string()));
    }
    if pending.accepts_coding {
        // The meter reads only an uncoded response (gateway_meter::Meter::mark_encoded).
        set_headers.push(("accept-encoding", "identity".to_string()));
    }
    let key = cfg.api_keys.get(pending.api_key);
    let facts = RequestFacts {
        v: gateway_contract::FACTS_VERSION,
        tenant: tenant.id.clone(),
        api_key: key.map(|k| k.name.clone()),
        tier: tenant.tier.clone(),
        model: route.public_name.to_string(),
        pool: route.pool.to_string(),
        prompt_tokens: counts.total_estimate,
        max_tokens: max_tokens_header,
        context_model: exact_check.then(|| route.model.name.clone()),
        leased_tokens: None,
        lease_id: None,
        lease_seq: None,
        prefix_hashes: None,
        // Envoy's id of the request as this filter saw it; the nonce is drawn by the adapter.
        request_id: pending.request_id.as_deref().map(|id| String::from_utf8_lossy(id).into_owned()),
        nonce: None,
        prompt_tokens_max: None,
        completion_tokens_max: None,
        body_bytes: Some(body.len() as u64),
        operation: Some(pending.endpoint.operation().to_owned()),
        upstream_model: Some(route.body_model.to_owned()),
    };
    // A key with limits of its own takes the sidecar's admission: a lease covers only the tenant's.
    let own_limits = key.is_none_or(|k| k.own_limits);
    let admission = (!exact_check && !own_limits).then(|| AdmissionFacts {
        tenant: facts.tenant.clone(),
        tier: facts.tier.clone(),
        model: facts.model.clone(),
        pool: facts.pool.clone(),
        reserve_tokens: facts.reserve_tokens(),
        prompt_tokens: facts.prompt_tokens,
    });
    Ok((
        ForwardPlan {
            set_headers,
            new_body: None,
            usage_injected: inject,
            nonce_header: all_headers,
            stream: req.stream,
            api: pending.endpoint.meter_api(),
            admission,
            facts,
        },
        edits,
    ))
}

/// The top-level members [`validate`] reads besides the prompt member: all a large body's
/// members the filter parses into values ([`on_large_body`]).
const READ_MEMBERS: [&str; 9] = [
    "model",
    "max_tokens",
    "max_completion_tokens",
    "max_output_tokens",
    "n",
    "best_of",
    "stream",
    "stream_options",
    "instructions",
];

/// A body over `full_parse_max_bytes`: only its top-level members are scanned (no parse of the
/// prompt member, which is nearly all of it), so that it holds the Envoy worker about as long as
/// a body of `full_parse_max_bytes`. The members the filter reads ([`READ_MEMBERS`]) are parsed
/// and validated as usual; every other member is checked as the full parse checks it, without
/// building its value ([`crate::json_scan::CheckedValue`]), so that a body of many small members
/// costs time per byte like any other and no memory per member beyond its key; the prompt member
/// must be present (and for chat an
/// array, for the Responses API a string or an array; its `instructions` count with it). Its
/// content is not validated here and the context rule is not applied from bounds:
/// a model with `exact_count` gets `x-gateway-context-check: exact` (the sidecar counts the body
/// natively and answers the 400), any other the rule of vLLM itself (which answers its own 400
/// before any GPU work). `max_tokens` above `max_model_len` is still refused here, and the token
/// estimate for the sidecar's reservation is the prompt member's bytes / 4.
fn on_large_body(
    cfg: &Config,
    pending: &PendingRequest,
    tenant: &crate::config::Tenant,
    body: &[u8],
) -> Result<(ForwardPlan, Vec<Edit>), GatewayError> {
    let scan = crate::request::scan_members(body).map_err(|e| match e {
        GatewayError::InvalidJson { .. } => {
            GatewayError::InvalidJson { detail: "expected a JSON object".into() }
        }
        other => other,
    })?;
    // As serde_json and Python's `json` (vLLM): nothing but whitespace after the object.
    if !body
        .get(scan.close + 1..)
        .unwrap_or_default()
        .iter()
        .all(|b| matches!(b, b' ' | b'\t' | b'\n' | b'\r'))
    {
        return Err(GatewayError::InvalidJson { detail: "trailing characters after the JSON object".into() });
    }
    if let Some(dup) = scan.first_duplicate() {
        return Err(GatewayError::DuplicateParameter { param: truncate_for_echo(dup) });
    }
    let prompt_key = pending.endpoint.prompt_param();
    let internal = GatewayError::Internal { what: "request body scan failed" };
    let mut members = serde_json::Map::new();
    let mut prompt_bytes = 0u64;
    let mut prompt_raw: &[u8] = &[];
    for m in &scan.members {
        let raw = body.get(m.value_start..m.value_end).ok_or_else(|| internal.clone())?;
        if m.key == prompt_key {
            prompt_bytes = raw.len() as u64;
            prompt_raw = raw;
            // A stand-in that passes validation: the real prompt is checked downstream.
            let stand_in = match (pending.endpoint, raw.first()) {
                (Endpoint::ChatCompletions, Some(b'[')) => {
                    serde_json::json!([{"role": "user", "content": "(not parsed in the filter)"}])
                }
                (Endpoint::ChatCompletions, _) => {
                    return Err(GatewayError::InvalidType {
                        param: prompt_key.into(),
                        expected: "an array",
                        got: json_type_of(raw.first().copied()),
                    })
                }
                (Endpoint::Responses, Some(b'[')) => serde_json::json!([]),
                (Endpoint::Responses, Some(b'"')) => Value::String("(not parsed in the filter)".into()),
                (Endpoint::Responses, Some(b'n')) => Value::Null,
                (Endpoint::Responses, _) => {
                    return Err(GatewayError::InvalidType {
                        param: prompt_key.into(),
                        expected: "a string or an array",
                        got: json_type_of(raw.first().copied()),
                    })
                }
                _ => Value::String("(not parsed in the filter)".into()),
            };
            members.insert(m.key.clone(), stand_in);
            continue;
        }
        let invalid = |e: serde_json::Error| GatewayError::InvalidJson {
            detail: format!("{}: {e}", truncate_for_echo(&m.key)),
        };
        if READ_MEMBERS.contains(&m.key.as_str()) {
            members.insert(m.key.clone(), serde_json::from_slice::<Value>(raw).map_err(invalid)?);
        } else {
            serde_json::from_slice::<crate::json_scan::CheckedValue>(raw).map_err(invalid)?;
        }
    }
    let value = Value::Object(members);
    let small = serde_json::to_vec(&value).map_err(|_| internal.clone())?;
    let mut req = validate(pending.endpoint, &small, &value)?;
    check_sequences(cfg, &req)?;
    // Offsets in the real body, for the surgical rewrites.
    req.scan = scan;
    let route = route(cfg, tenant, req.model, pending.request_id.as_deref())?;

    // The Responses API's `instructions` (parsed above, it is not the prompt member) are prompt too.
    let instructions = match (pending.endpoint, value.get("instructions")) {
        (Endpoint::Responses, Some(Value::String(s))) => s.trim().len() as u64,
        _ => 0,
    };
    let prompt_bytes = prompt_bytes.saturating_add(instructions);
    let estimate = prompt_bytes.div_ceil(4);
    let max_model_len = route.model.max_model_len;
    let max_token_bytes = route.model.max_token_bytes.max(1);
    // The Responses API's rule ignores `max_output_tokens` (vLLM caps it): see `plan_request_body`.
    let rule_max_tokens = if pending.endpoint == Endpoint::Responses { None } else { req.max_tokens };
    // A lower bound only when it could refuse (the prompt's raw bytes are more than its text): a
    // second walk over the prompt's strings, without decoding them.
    let could_refuse =
        !crate::context::fits(max_model_len, prompt_bytes.div_ceil(max_token_bytes), rule_max_tokens);
    let max_lower = if could_refuse && pending.endpoint != Endpoint::Embeddings {
        prompt_text_lower(pending.endpoint, prompt_raw).saturating_add(instructions).div_ceil(max_token_bytes)
    } else {
        0
    };
    let counts = PromptCounts {
        max_lower,
        max_estimate: estimate.max(max_lower),
        total_estimate: estimate.max(max_lower),
        source: CountSource::Estimate,
    };
    let prompts = large_prompt_count(pending.endpoint, prompt_raw);
    let (budget, exact_check) = match pending.endpoint {
        Endpoint::Embeddings => (0, false),
        Endpoint::Responses => {
            // Refuses prompts whose text alone fills the context; vLLM decides the rest.
            check_context(max_model_len, &counts, None, prompt_key)?;
            (responses_budget(max_model_len, &counts, req.max_tokens), false)
        }
        _ => {
            // Refuses max_tokens over max_model_len, and prompts whose text alone is too long.
            check_context(max_model_len, &counts, req.max_tokens, prompt_key)?;
            (
                completion_budget(max_model_len, &counts, req.max_tokens, req.choices, prompts),
                route.model.exact_count,
            )
        }
    };
    let mut planned =
        finish_plan(cfg, pending, tenant, body, &req, &value, &route, &counts, budget, exact_check)?;
    set_usage_bounds(&mut planned.0.facts, pending.endpoint, max_model_len, &req, prompts);
    Ok(planned)
}

/// A lower bound on the bytes of prompt text in an unparsed prompt member: for chat and the
/// Responses API's input items, the string `content` of each message (parts and roles not
/// counted), for a Responses `input` string the string; for completions, the longest string (a
/// batch is checked per prompt). Escapes are not decoded ([`string_bytes_lower`]).
fn prompt_text_lower(endpoint: Endpoint, raw: &[u8]) -> u64 {
    let elements = || array_elements(raw).unwrap_or_default().into_iter().filter_map(|(a, b)| raw.get(a..b));
    match endpoint {
        Endpoint::Responses if raw.first() == Some(&b'"') => string_bytes_lower(raw),
        // Only message items (a `role`, `type` absent, null or "message") reach the template as
        // text, as the full parse counts them (`request::responses_input`).
        Endpoint::Responses => elements()
            .filter_map(|item| {
                let scan = scan_object(item)?;
                let role = scan.get("role")?;
                if item.get(role.value_start..role.value_end) == Some(b"null") {
                    return None;
                }
                let is_message = scan.get("type").is_none_or(|t| {
                    matches!(item.get(t.value_start..t.value_end), Some(b"null" | b"\"message\""))
                });
                let content = scan.get("content").filter(|_| is_message)?;
                item.get(content.value_start..content.value_end).map(string_bytes_lower)
            })
            .fold(0u64, u64::saturating_add),
        Endpoint::ChatCompletions => elements()
            .filter_map(|message| {
                let scan = scan_object(message)?;
                let content = scan.get("content")?;
                message.get(content.value_start..content.value_end).map(string_bytes_lower)
            })
            .fold(0u64, u64::saturating_add),
        Endpoint::Completions if raw.first() == Some(&b'"') => string_bytes_lower(raw),
        Endpoint::Completions => elements().map(string_bytes_lower).max().unwrap_or(0),
        Endpoint::Embeddings | Endpoint::Models => 0,
    }
}

/// Prompts of an unparsed prompt member that vLLM generates for (completions) or embeds
/// (embeddings) separately: the elements of a batch (strings or arrays of token ids), else 1
/// (chat, one string, one array of token ids).
fn large_prompt_count(endpoint: Endpoint, raw: &[u8]) -> u64 {
    if !matches!(endpoint, Endpoint::Completions | Endpoint::Embeddings) || raw.first() != Some(&b'[') {
        return 1;
    }
    let elements = array_elements(raw).unwrap_or_default();
    match elements.first().and_then(|&(a, _)| raw.get(a)) {
        Some(b'"' | b'[') => elements.len() as u64,
        _ => 1,
    }
}

/// The JSON type of a value from its first byte, in `invalid_type` words.
fn json_type_of(first: Option<u8>) -> &'static str {
    match first {
        Some(b'{') => "an object",
        Some(b'[') => "an array",
        Some(b'"') => "a string",
        Some(b't' | b'f') => "a boolean",
        Some(b'n') => "null",
        _ => "a number",
    }
}

const INCLUDE_USAGE_OBJECT: &[u8] = br#"{"include_usage":true}"#;

/// Surgical body rewrite: the edits that replace the `model` value when vLLM expects another
/// name, and inject `stream_options.include_usage: true`. Every other byte is kept. None when
/// nothing changes.
fn body_edits(
    body: &[u8],
    req: &ValidatedRequest<'_>,
    value: &Value,
    route: &Route<'_>,
    inject: bool,
) -> Result<Vec<Edit>, GatewayError> {
    let internal = rewrite_failed();
    let mut edits = Vec::new();
    if route.body_model != req.model {
        let m = req.scan.get("model").ok_or_else(|| internal.clone())?;
        let with = serde_json::to_vec(route.body_model).map_err(|_| internal.clone())?;
        edits.push(Edit { start: m.value_start, end: m.value_end, with });
    }
    if inject {
        edits.push(stream_options_edit(body, req, value).ok_or_else(|| internal.clone())?);
    }
    Ok(edits)
}

fn stream_options_edit(body: &[u8], req: &ValidatedRequest<'_>, value: &Value) -> Option<Edit> {
    match req.scan.get("stream_options") {
        Some(m) if value.get("stream_options").is_some_and(Value::is_object) => {
            let inner = scan_object(body.get(m.value_start..m.value_end)?)?;
            if let Some(iu) = inner.get("include_usage") {
                Some(Edit {
                    start: m.value_start + iu.value_start,
                    end: m.value_start + iu.value_end,
                    with: b"true".to_vec(),
                })
            } else if inner.members.is_empty() {
                Some(Edit { start: m.value_start, end: m.value_end, with: INCLUDE_USAGE_OBJECT.to_vec() })
            } else {
                let at = m.value_start + inner.open + 1;
                Some(Edit { start: at, end: at, with: br#""include_usage":true,"#.to_vec() })
            }
        }
        // present but null
        Some(m) => Some(Edit { start: m.value_start, end: m.value_end, with: INCLUDE_USAGE_OBJECT.to_vec() }),
        None => {
            let (at, with) = match req.scan.members.last() {
                Some(last) => {
                    (last.value_end, [br#","stream_options":"#.as_slice(), INCLUDE_USAGE_OBJECT].concat())
                }
                None => {
                    (req.scan.open + 1, [br#""stream_options":"#.as_slice(), INCLUDE_USAGE_OBJECT].concat())
                }
            };
            Some(Edit { start: at, end: at, with })
        }
    }
}

/// Whether a response to an injected request must go through the
/// [`UsageStripper`](crate::sse::UsageStripper): `:status` 200, `content-type`
/// `text/event-stream` (case-insensitive, parameters allowed) and no content coding (a coded
/// stream's bytes are not events). Error bodies pass untouched.
pub fn response_needs_stripping(
    status: Option<&[u8]>,
    content_type: Option<&[u8]>,
    content_encoding: Option<&[u8]>,
) -> bool {
    let ok = status.is_some_and(|s| s == b"200");
    let sse = content_type
        .is_some_and(|ct| ct.get(..17).is_some_and(|p| p.eq_ignore_ascii_case(b"text/event-stream")));
    let coded = content_encoding.is_some_and(|e| !e.trim_ascii().eq_ignore_ascii_case(b"identity"));
    ok && sse && !coded
}

/// Feeds a response's headers to the meter (both adapters, `filter/src/wasm.rs` and
/// `filter-native/`): its `:status`, `content-type` and `content-encoding`
/// ([`gateway_meter::Meter::mark_encoded`]) as Envoy hands them over. Returns the usage when the
/// response ends with its headers (`end_of_stream`, at `now_us`).
pub fn meter_response_headers(
    meter: &mut gateway_meter::Meter,
    status: Option<&[u8]>,
    content_type: Option<&[u8]>,
    content_encoding: Option<&[u8]>,
    end_of_stream: bool,
    now_us: u64,
) -> Option<gateway_meter::Usage> {
    let code = status.and_then(|s| std::str::from_utf8(s).ok()?.parse().ok()).unwrap_or(0);
    let kind = content_type.and_then(|c| std::str::from_utf8(c).ok()).unwrap_or("");
    if let Some(coding) = content_encoding {
        meter.mark_encoded(coding);
    }
    meter.on_response_headers(code, kind, end_of_stream, now_us)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::hash_key;
    use serde_json::json;

    /// The clock the tests decide at: 2026-07-01T00:00:00Z.
    const NOW_S: u64 = 1_782_864_000;

    fn cfg() -> Config {
        let v = json!({
            "max_body_bytes": 2000,
            "tenants": [
                {"id": "demo", "api_keys_sha256": [hex::encode(hash_key(b"sk-demo"))], "tier": "gold", "models": ["qwen", "tiny"]},
                {"id": "all", "api_keys_sha256": [hex::encode(hash_key(b"sk-all"))]}
            ],
            "models": [
                {"name": "qwen", "pool": "pool_a", "served_model_name": "Qwen/Qwen2.5-0.5B-Instruct",
                 "max_model_len": 4096, "max_token_bytes": 256, "aliases": ["qwen-latest"], "lora_adapters": ["sql-lora"]},
                {"name": "llama", "pool": "pool_b", "max_model_len": 8192},
                {"name": "tiny", "pool": "pool_t", "max_model_len": 100, "max_token_bytes": 4}
            ]
        });
        Config::from_json(v.to_string().as_bytes()).unwrap()
    }

    fn hdrs(list: &[(&str, &str)]) -> Vec<(String, Vec<u8>)> {
        list.iter().map(|(k, v)| (k.to_string(), v.as_bytes().to_vec())).collect()
    }

    fn post(path: &str, key: &str) -> Vec<(String, Vec<u8>)> {
        hdrs(&[
            (":method", "POST"),
            (":path", path),
            ("authorization", &format!("Bearer {key}")),
            ("content-length", "10"),
            ("x-request-id", "rid-1"),
        ])
    }

    fn pending(path: &str, key: &str) -> PendingRequest {
        pending_in(&cfg(), path, key)
    }

    /// The pending request of `POST path` with `key` under `cfg` (the headers phase must pass).
    fn pending_in(cfg: &Config, path: &str, key: &str) -> PendingRequest {
        match on_request_headers(cfg, &post(path, key), NOW_S).decision {
            HeadersDecision::AwaitBody(p) => p,
            HeadersDecision::Reply(r) => panic!("unexpected reply {r:?}"),
        }
    }

    fn reply(d: HeadersDecision) -> (u32, Value) {
        match d {
            HeadersDecision::Reply(r) => (r.status, serde_json::from_slice(&r.body).unwrap()),
            HeadersDecision::AwaitBody(p) => panic!("unexpected await {p:?}"),
        }
    }

    fn chat(body: Value) -> Result<ForwardPlan, GatewayError> {
        both(&cfg(), &pending("/v1/chat/completions", "sk-demo"), body.to_string().as_bytes())
    }

    /// The plan of [`on_request_body`], checked equal to [`on_request_body_owned`]'s (which
    /// rewrites the body in place).
    fn both(c: &Config, p: &PendingRequest, body: &[u8]) -> Result<ForwardPlan, GatewayError> {
        let copied = on_request_body(c, p, body);
        assert_eq!(copied, on_request_body_owned(c, p, body.to_vec()), "the in-place rewrite differs");
        copied
    }

    fn header_map(plan: &ForwardPlan) -> Vec<(String, String)> {
        plan.set_headers.iter().map(|(k, v)| (k.to_string(), v.clone())).collect()
    }

    #[test]
    fn strips_gateway_headers_and_credentials() {
        let h = hdrs(&[
            (":method", "POST"),
            (":path", "/v1/chat/completions"),
            ("x-gateway-tenant", "evil"),
            ("X-Gateway-Pool", "evil"),
            ("x-gateway-tenant", "evil2"),
            ("authorization", "Bearer sk-demo"),
            ("x-api-key", "sk-demo"),
            ("x-gatewayish", "keep"),
        ]);
        let out = on_request_headers(&cfg(), &h, NOW_S);
        assert_eq!(out.remove, vec!["x-gateway-tenant", "x-gateway-pool", "authorization", "x-api-key"]);
        assert!(matches!(out.decision, HeadersDecision::AwaitBody(_)));
        // Removed even when the request is rejected.
        let out = on_request_headers(
            &cfg(),
            &hdrs(&[(":method", "POST"), (":path", "/nope"), ("x-gateway-model", "x")]),
            NOW_S,
        );
        assert_eq!(out.remove, vec!["x-gateway-model"]);
    }

    #[test]
    fn client_gateway_headers_are_never_read() {
        // A client cannot smuggle `:path`-like or credential data through x-gateway-* names,
        // and `header()` skips x-gateway-* names.
        let h = hdrs(&[("x-gateway-tenant", "evil")]);
        assert_eq!(header(&h, "x-gateway-tenant"), None);
    }

    #[test]
    fn path_and_method_errors() {
        let (s, b) = reply(on_request_headers(&cfg(), &post("/v1/foo", "sk-demo"), NOW_S).decision);
        assert_eq!(s, 404);
        assert_eq!(
            b,
            json!({"error": {"message": "Invalid URL (POST /v1/foo)", "type": "invalid_request_error", "param": null, "code": "not_found"}})
        );
        let h = hdrs(&[(":method", "GET"), (":path", "/v1/chat/completions")]);
        let out = on_request_headers(&cfg(), &h, NOW_S);
        match out.decision {
            HeadersDecision::Reply(r) => {
                assert_eq!(r.status, 405);
                assert!(r.headers.contains(&("allow", "POST".to_string())));
                assert!(r.headers.contains(&("content-type", "application/json".to_string())));
            }
            HeadersDecision::AwaitBody(_) => panic!(),
        }
    }

    #[test]
    fn auth_errors() {
        let (s, b) =
            reply(on_request_headers(&cfg(), &post("/v1/chat/completions", "sk-wrong"), NOW_S).decision);
        assert_eq!(s, 401);
        assert_eq!(b["error"]["code"], "invalid_api_key");
        assert_eq!(b["error"]["message"], "Incorrect API key provided.");
        let h = hdrs(&[(":method", "POST"), (":path", "/v1/chat/completions")]);
        let (s, b) = reply(on_request_headers(&cfg(), &h, NOW_S).decision);
        assert_eq!(s, 401);
        assert_eq!(b["error"]["type"], "invalid_request_error");
        // x-api-key works too
        let h = hdrs(&[(":method", "POST"), (":path", "/v1/completions"), ("x-api-key", "sk-all")]);
        assert!(matches!(
            on_request_headers(&cfg(), &h, NOW_S).decision,
            HeadersDecision::AwaitBody(PendingRequest { tenant: 1, .. })
        ));
    }

    #[test]
    fn content_length_limit() {
        let mut h = post("/v1/chat/completions", "sk-demo");
        h.retain(|(k, _)| k != "content-length");
        h.push(("content-length".into(), b"2001".to_vec()));
        let (s, b) = reply(on_request_headers(&cfg(), &h, NOW_S).decision);
        assert_eq!(s, 413);
        assert_eq!(b["error"]["code"], "request_too_large");
        assert_eq!(b["error"]["message"], "Request body too large: the limit is 2000 bytes.");
        // Unauthenticated oversize requests get 401 first.
        let mut h = hdrs(&[(":method", "POST"), (":path", "/v1/chat/completions")]);
        h.push(("content-length".into(), b"999999".to_vec()));
        assert_eq!(reply(on_request_headers(&cfg(), &h, NOW_S).decision).0, 401);
        // Buffered size limit.
        let big = vec![b' '; 2001];
        let e = on_request_body(&cfg(), &pending("/v1/chat/completions", "sk-demo"), &big).unwrap_err();
        assert_eq!(e.parts().0, 413);
        assert!(check_body_size(&cfg(), 2000).is_ok());
    }

    #[test]
    fn models_listing() {
        let h = hdrs(&[(":method", "GET"), (":path", "/v1/models"), ("x-api-key", "sk-demo")]);
        let (s, b) = reply(on_request_headers(&cfg(), &h, NOW_S).decision);
        assert_eq!(s, 200);
        assert_eq!(
            b,
            json!({"object": "list", "data": [
                {"id": "qwen", "object": "model", "created": 0, "owned_by": "gateway"},
                {"id": "sql-lora", "object": "model", "created": 0, "owned_by": "gateway"},
                {"id": "tiny", "object": "model", "created": 0, "owned_by": "gateway"}
            ]})
        );
        let h = hdrs(&[(":method", "GET"), (":path", "/v1/models?limit=1"), ("x-api-key", "sk-all")]);
        match on_request_headers(&cfg(), &h, NOW_S).decision {
            HeadersDecision::Reply(r) => {
                assert_eq!(r.headers, vec![("content-type", "application/json".to_string())]);
                assert!(String::from_utf8(r.body).unwrap().starts_with(
                    r#"{"object":"list","data":[{"id":"qwen","object":"model","created":0,"owned_by":"gateway"},"#
                ));
            }
            HeadersDecision::AwaitBody(_) => panic!(),
        }
        let h = hdrs(&[(":method", "GET"), (":path", "/v1/models")]);
        assert_eq!(reply(on_request_headers(&cfg(), &h, NOW_S).decision).0, 401);
    }

    #[test]
    fn header_outputs_for_chat() {
        let plan = chat(json!({"model": "qwen-latest", "messages": [{"role": "user", "content": "x".repeat(1000)}], "max_tokens": 100})).unwrap();
        assert_eq!(
            header_map(&plan),
            vec![
                ("x-gateway-tenant".into(), "demo".into()),
                ("x-gateway-tier".into(), "gold".into()),
                ("x-gateway-model".into(), "qwen".into()),
                ("x-gateway-pool".into(), "pool_a".into()),
                // (4 + 1000) bytes -> ceil(1004/4) = 251
                ("x-gateway-prompt-tokens".into(), "251".into()),
                ("x-gateway-prompt-tokens-source".into(), "estimate".into()),
                ("x-gateway-max-tokens".into(), "100".into()),
                ("content-length".into(), plan.new_body.as_ref().unwrap().len().to_string()),
            ]
        );
        assert!(!plan.usage_injected);
        let body: Value = serde_json::from_slice(plan.new_body.as_ref().unwrap()).unwrap();
        assert_eq!(body["model"], "Qwen/Qwen2.5-0.5B-Instruct");
    }

    #[test]
    fn default_max_tokens_header() {
        let plan =
            chat(json!({"model": "tiny", "messages": [{"role": "user", "content": "abcdefgh"}]})).unwrap();
        // 12 bytes, max_token_bytes 4: lower 3, estimate 3; 100 - 3 = 97
        assert!(plan.set_headers.contains(&(H_PROMPT_TOKENS, "3".into())));
        assert!(plan.set_headers.contains(&(H_MAX_TOKENS, "97".into())));
        assert_eq!(plan.new_body, None);
    }

    #[test]
    fn model_errors() {
        let e = chat(json!({"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]})).unwrap_err();
        assert_eq!(e.parts(), (404, "invalid_request_error", "model_not_found", Some("model")));
        let e = chat(json!({"model": "llama", "messages": [{"role": "user", "content": "x"}]})).unwrap_err();
        assert_eq!(e.parts(), (403, "invalid_request_error", "model_not_allowed", Some("model")));
    }

    #[test]
    fn context_errors() {
        // tiny: max_model_len 100, max_token_bytes 4. user(4) + 392 bytes = 396 -> lower 99.
        let msg = |n: usize| json!([{"role": "user", "content": "y".repeat(n)}]);
        assert!(chat(json!({"model": "tiny", "messages": msg(392), "max_tokens": 1})).is_ok());
        let e = chat(json!({"model": "tiny", "messages": msg(392), "max_tokens": 2})).unwrap_err();
        assert_eq!(e.parts(), (400, "invalid_request_error", "context_length_exceeded", Some("messages")));
        assert_eq!(
            e.to_string(),
            "This model's maximum context length is 100 tokens. However, your request needs at least 101 tokens (99 in the prompt, lower bound; 2 for max_tokens)."
        );
        assert!(chat(json!({"model": "tiny", "messages": msg(392)})).is_ok());
        let e = chat(json!({"model": "tiny", "messages": msg(396)})).unwrap_err();
        assert_eq!(e.parts().2, "context_length_exceeded");
        let e = chat(json!({"model": "tiny", "messages": msg(1), "max_completion_tokens": 101})).unwrap_err();
        assert_eq!(e.parts(), (400, "invalid_request_error", "invalid_value", Some("max_completion_tokens")));

        let p = pending("/v1/completions", "sk-demo");
        let body = json!({"model": "tiny", "prompt": ["ok", "z".repeat(400)]}).to_string();
        let e = on_request_body(&cfg(), &p, body.as_bytes()).unwrap_err();
        assert_eq!(e.parts(), (400, "invalid_request_error", "context_length_exceeded", Some("prompt")));
    }

    #[test]
    fn completions_token_ids_are_exact() {
        let p = pending("/v1/completions", "sk-demo");
        let body = json!({"model": "tiny", "prompt": [1, 2, 3, 4, 5], "max_tokens": 7}).to_string();
        let plan = on_request_body(&cfg(), &p, body.as_bytes()).unwrap();
        assert!(plan.set_headers.contains(&(H_PROMPT_TOKENS, "5".into())));
        assert!(plan.set_headers.contains(&(H_PROMPT_TOKENS_SOURCE, "exact".into())));
        assert!(plan.set_headers.contains(&(H_MAX_TOKENS, "7".into())));
        // A lease would reserve what the sidecar reserves: the prompt tokens plus max tokens.
        let facts = plan.admission.unwrap();
        assert_eq!((facts.tenant.as_str(), facts.model.as_str(), facts.reserve_tokens), ("demo", "tiny", 12));
    }

    /// `upstream_headers: routing` sets `x-gateway-pool` (and `content-length` of a rewritten
    /// body) and nothing else of the contract, and decides exactly as `all` does: the same
    /// facts, body, injection and admission, in the full-parse path, the large-body path and
    /// the exact-count path.
    #[test]
    fn routing_headers_only_drop_the_informational_headers() {
        let config = |headers: &str| {
            let v = json!({
                "tenants": [{"id": "t", "api_keys_sha256": [hex::encode(hash_key(b"sk-t"))]}],
                "models": [
                    {"name": "ex", "pool": "p", "max_model_len": 100, "max_token_bytes": 4,
                     "template_overhead_bytes": {"per_message": 10, "fixed": 20}, "exact_count": true,
                     "lora_adapters": ["ex-lora"]},
                    {"name": "big", "pool": "q", "served_model_name": "org/big", "max_model_len": 1_000_000}
                ],
                "upstream_headers": headers
            });
            Config::from_json(v.to_string().as_bytes()).unwrap()
        };
        let (all, routing) = (config("all"), config("routing"));
        assert_eq!(
            (all.upstream_headers, routing.upstream_headers),
            (UpstreamHeaders::All, UpstreamHeaders::Routing)
        );
        let big = "w ".repeat(70_000);
        let bodies = [
            json!({"model": "big", "messages": [{"role": "user", "content": "hi"}], "stream": true}),
            json!({"model": "ex", "messages": [{"role": "user", "content": "z".repeat(64)}]}),
            json!({"model": "ex-lora", "prompt": "hello", "max_tokens": 3}),
            json!({"model": "big", "messages": [{"role": "user", "content": big}], "stream": true}),
        ];
        for body in bodies {
            let path = if body.get("prompt").is_some() { "/v1/completions" } else { "/v1/chat/completions" };
            let bytes = body.to_string();
            let full = both(&all, &pending_in(&all, path, "sk-t"), bytes.as_bytes()).unwrap();
            let plan = both(&routing, &pending_in(&routing, path, "sk-t"), bytes.as_bytes()).unwrap();
            let kept: Vec<_> = full
                .set_headers
                .iter()
                .filter(|(name, _)| *name == H_POOL || *name == "content-length")
                .cloned()
                .collect();
            assert_eq!(plan.set_headers, kept, "{path}");
            assert!(full.nonce_header && !plan.nonce_header);
            assert_eq!(
                ForwardPlan { set_headers: full.set_headers.clone(), nonce_header: true, ..plan },
                full,
                "{path}: the decision differs"
            );
        }
    }

    #[test]
    fn only_the_sidecar_admits_a_request_it_must_count_exactly() {
        let cfg = bounds_cfg();
        let p = pending_in(&cfg, "/v1/chat/completions", "sk-t");
        let body = |content: &str| json!({"model": "ex", "messages": [{"role": "user", "content": content}]});
        let plan = on_request_body(&cfg, &p, body(&"z".repeat(64)).to_string().as_bytes()).unwrap();
        assert!(header_map(&plan).iter().any(|(k, _)| k == H_CONTEXT_CHECK));
        assert_eq!(plan.admission, None, "the exact count needs the sidecar");
        assert_eq!(plan.facts.context_model.as_deref(), Some("ex"), "the sidecar learns it from the facts");
        let plan = on_request_body(&cfg, &p, body("hi").to_string().as_bytes()).unwrap();
        assert!(plan.admission.is_some());
        assert_eq!(plan.facts.context_model, None);
    }

    #[test]
    fn the_facts_say_what_the_headers_say() {
        let p = pending("/v1/chat/completions", "sk-demo");
        let body = json!({"model": "tiny", "max_tokens": 7, "messages": [{"role": "user", "content": "hi"}]});
        let plan = on_request_body(&cfg(), &p, body.to_string().as_bytes()).unwrap();
        let h = header_map(&plan);
        let get = |name: &str| h.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone()).unwrap();
        let f = &plan.facts;
        assert_eq!(f.v, gateway_contract::FACTS_VERSION);
        assert_eq!((f.tenant.clone(), f.tier.clone()), (get(H_TENANT), get(H_TIER)));
        assert_eq!((f.model.clone(), f.pool.clone()), (get(H_MODEL), get(H_POOL)));
        assert_eq!(
            (f.prompt_tokens.to_string(), f.max_tokens.to_string()),
            (get(H_PROMPT_TOKENS), get(H_MAX_TOKENS))
        );
        assert_eq!(f.max_tokens, 7);
        assert_eq!(f.leased_tokens, None, "a lease is the adapter's to record");
        assert_eq!(plan.admission.unwrap().reserve_tokens, f.reserve_tokens());
        // Envoy's x-request-id as the filter saw it names the usage record, with the nonce the
        // adapter draws.
        assert_eq!((f.request_id.as_deref(), f.nonce.as_deref()), (Some("rid-1"), None));
    }

    #[test]
    fn prefix_hashes_go_in_the_facts_when_configured_and_not_for_scanned_bodies() {
        let p = pending("/v1/chat/completions", "sk-demo");
        let text = "a system prompt long enough for a few blocks of sixteen bytes";
        let body = json!({"model": "qwen-latest", "max_tokens": 7, "messages": [{"role": "system", "content": text}]});
        let plan = on_request_body(&cfg(), &p, body.to_string().as_bytes()).unwrap();
        assert_eq!(plan.facts.prefix_hashes, None, "not configured: none");
        let mut c = cfg();
        c.prefix_hashing = Some(crate::config::PrefixHashing { block_bytes: 16, max_blocks: 256 });
        let plan = both(&c, &p, body.to_string().as_bytes()).unwrap();
        let chat = crate::request::Prompt::Chat(vec![crate::request::ChatMessage {
            role: "system",
            texts: vec![text],
        }]);
        let expected = crate::prefix::encoded_prompt_hashes(c.prefix_hashing.unwrap(), "qwen", &chat);
        assert!(expected.is_some());
        assert_eq!(plan.facts.prefix_hashes, expected, "seeded with the canonical model, not the alias");
        // A body over full_parse_max_bytes is only scanned: no hashes.
        c.full_parse_max_bytes = 50;
        let plan = on_request_body(&c, &p, body.to_string().as_bytes()).unwrap();
        assert_eq!(plan.facts.prefix_hashes, None);
    }

    #[test]
    fn embeddings_route_without_context_check() {
        let p = pending("/v1/embeddings", "sk-demo");
        let body = json!({"model": "tiny", "input": "w".repeat(1000)}).to_string();
        let plan = on_request_body(&cfg(), &p, body.as_bytes()).unwrap();
        assert!(plan.set_headers.contains(&(H_POOL, "pool_t".into())));
        assert!(plan.set_headers.contains(&(H_MAX_TOKENS, "0".into())));
        assert!(plan.set_headers.contains(&(H_PROMPT_TOKENS, "250".into())));
        assert!(!plan.usage_injected);
    }

    #[test]
    fn body_rewrite_keeps_other_bytes() {
        let body =
            br#"{ "temperature": 0.70, "model" : "qwen", "messages":[{"role":"user","content":"h\u00e9"}] }"#;
        let plan = on_request_body(&cfg(), &pending("/v1/chat/completions", "sk-demo"), body).unwrap();
        assert_eq!(
            plan.new_body.unwrap(),
            br#"{ "temperature": 0.70, "model" : "Qwen/Qwen2.5-0.5B-Instruct", "messages":[{"role":"user","content":"h\u00e9"}] }"#.to_vec()
        );
        // Adapter names stay in the body.
        let body = br#"{"model":"sql-lora","messages":[{"role":"user","content":"q"}]}"#;
        let plan = on_request_body(&cfg(), &pending("/v1/chat/completions", "sk-demo"), body).unwrap();
        assert_eq!(plan.new_body, None);
        assert!(plan.set_headers.contains(&(H_MODEL, "sql-lora".into())));
        assert!(plan.set_headers.contains(&(H_POOL, "pool_a".into())));
        assert!(!plan.set_headers.iter().any(|(k, _)| *k == "content-length"));
    }

    #[test]
    fn usage_injection_variants() {
        let run = |body: &str| {
            let plan = on_request_body(&cfg(), &pending("/v1/chat/completions", "sk-demo"), body.as_bytes())
                .unwrap();
            (plan.usage_injected, plan.new_body.map(|b| String::from_utf8(b).unwrap()), plan.set_headers)
        };
        let (inj, body, hdrs) =
            run(r#"{"model":"tiny","messages":[{"role":"user","content":"q"}],"stream":true}"#);
        assert!(inj);
        assert_eq!(
            body.as_deref(),
            Some(
                r#"{"model":"tiny","messages":[{"role":"user","content":"q"}],"stream":true,"stream_options":{"include_usage":true}}"#
            )
        );
        assert!(hdrs.contains(&(H_USAGE_INJECTED, "1".into())));
        let (inj, body, _) = run(
            r#"{"model":"tiny","messages":[{"role":"user","content":"q"}],"stream":true,"stream_options":null}"#,
        );
        assert!(inj);
        assert!(body.unwrap().ends_with(r#""stream":true,"stream_options":{"include_usage":true}}"#));
        let (_, body, _) = run(
            r#"{"model":"tiny","messages":[{"role":"user","content":"q"}],"stream":true,"stream_options":{"include_usage":false}}"#,
        );
        assert!(body.unwrap().ends_with(r#""stream_options":{"include_usage":true}}"#));
        let (_, body, _) = run(
            r#"{"model":"tiny","messages":[{"role":"user","content":"q"}],"stream":true,"stream_options":{}}"#,
        );
        assert!(body.unwrap().ends_with(r#""stream_options":{"include_usage":true}}"#));
        let (_, body, _) = run(
            r#"{"model":"tiny","messages":[{"role":"user","content":"q"}],"stream":true,"stream_options":{"continuous_usage_stats":false}}"#,
        );
        assert!(body
            .unwrap()
            .ends_with(r#""stream_options":{"include_usage":true,"continuous_usage_stats":false}}"#));
        // Client asked for usage itself: nothing injected, nothing stripped.
        let (inj, body, hdrs) = run(
            r#"{"model":"tiny","messages":[{"role":"user","content":"q"}],"stream":true,"stream_options":{"include_usage":true}}"#,
        );
        assert!(!inj && body.is_none());
        assert!(!hdrs.iter().any(|(k, _)| *k == H_USAGE_INJECTED));
        // The meter learns the stream flag whatever was injected.
        let stream = |body: &str| {
            on_request_body(&cfg(), &pending("/v1/chat/completions", "sk-demo"), body.as_bytes())
                .unwrap()
                .stream
        };
        assert!(stream(
            r#"{"model":"tiny","messages":[{"role":"user","content":"q"}],"stream":true,"stream_options":{"include_usage":true}}"#
        ));
        assert!(!stream(r#"{"model":"tiny","messages":[{"role":"user","content":"q"}]}"#));
        // Not streaming: nothing injected.
        let (inj, body, _) =
            run(r#"{"model":"tiny","messages":[{"role":"user","content":"q"}],"stream":false}"#);
        assert!(!inj && body.is_none());
        // Both rewrites at once, and the body stays valid JSON.
        let (inj, body, hdrs) =
            run(r#"{"model":"qwen","messages":[{"role":"user","content":"q"}],"stream":true}"#);
        assert!(inj);
        let body = body.unwrap();
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["model"], "Qwen/Qwen2.5-0.5B-Instruct");
        assert_eq!(v["stream_options"]["include_usage"], true);
        assert!(hdrs.contains(&("content-length", body.len().to_string())));
    }

    #[test]
    fn validation_errors_surface() {
        let e =
            chat(json!({"model": "qwen", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}))
                .unwrap_err();
        assert_eq!(e.parts().3, Some("stream"));
        let e =
            on_request_body(&cfg(), &pending("/v1/chat/completions", "sk-demo"), b"not json").unwrap_err();
        assert_eq!(e.parts(), (400, "invalid_request_error", "invalid_json", None));
        let e = on_request_body(&cfg(), &pending("/v1/chat/completions", "sk-demo"), b"").unwrap_err();
        assert_eq!(e.parts().2, "invalid_json");
    }

    /// Models for the bound decisions: `ex` (sidecar counts exactly), `noex` (no exact count),
    /// `nfc` (NFC tokenizer, exact count), `bare` (exact count, no template overhead).
    fn bounds_cfg() -> Config {
        let overhead = json!({"per_message": 10, "fixed": 20});
        let v = json!({
            "tenants": [{"id": "t", "api_keys_sha256": [hex::encode(hash_key(b"sk-t"))]}],
            "models": [
                {"name": "ex", "pool": "p", "max_model_len": 100, "max_token_bytes": 4,
                 "template_overhead_bytes": overhead, "exact_count": true, "lora_adapters": ["ex-lora"]},
                {"name": "noex", "pool": "p", "max_model_len": 100, "max_token_bytes": 4,
                 "template_overhead_bytes": overhead},
                {"name": "nfc", "pool": "p", "max_model_len": 100, "max_token_bytes": 4,
                 "template_overhead_bytes": overhead, "normalization": "nfc", "exact_count": true},
                {"name": "bare", "pool": "p", "max_model_len": 100, "max_token_bytes": 4, "exact_count": true}
            ]
        });
        Config::from_json(v.to_string().as_bytes()).unwrap()
    }

    /// The `x-gateway-context-check` / `-model` headers the filter sets for `body` on `path`.
    fn context_headers(path: &str, body: Value) -> Vec<(String, String)> {
        let cfg = bounds_cfg();
        let p = pending_in(&cfg, path, "sk-t");
        let plan = on_request_body(&cfg, &p, body.to_string().as_bytes()).unwrap();
        header_map(&plan).into_iter().filter(|(k, _)| k.starts_with("x-gateway-context")).collect()
    }

    fn exact(model: &str) -> Vec<(String, String)> {
        vec![(H_CONTEXT_CHECK.into(), "exact".into()), (H_CONTEXT_MODEL.into(), model.into())]
    }

    #[test]
    fn upper_bound_settles_or_asks_for_the_exact_count() {
        let chat = |model: &str, content: &str, extra: Value| {
            let mut body = json!({"model": model, "messages": [{"role": "user", "content": content}]});
            for (k, v) in extra.as_object().unwrap() {
                body[k] = v.clone();
            }
            context_headers("/v1/chat/completions", body)
        };
        let c60 = "z".repeat(60);
        // upper = user(4) + 60 + per_message 10 + fixed 20 + slack 2 = 96 tokens.
        assert_eq!(chat("ex", &c60, json!({"max_tokens": 4})), vec![]); // 96 + 4 <= 100
        assert_eq!(chat("ex", &c60, json!({"max_tokens": 5})), exact("ex")); // 101 > 100, lower 16 + 5 fits
        assert_eq!(chat("ex", &c60, json!({})), vec![]); // 96 < 100
        assert_eq!(chat("ex", &"z".repeat(64), json!({})), exact("ex")); // 100, not < 100
                                                                         // Without exact_count, vLLM decides.
        assert_eq!(chat("noex", &c60, json!({"max_tokens": 5})), vec![]);
        // Adapters count with the base model's tokenizer.
        assert_eq!(chat("ex-lora", &c60, json!({"max_tokens": 5})), exact("ex"));
        // No template overhead configured: no upper bound for chat.
        assert_eq!(chat("bare", "hi", json!({"max_tokens": 5})), exact("bare"));
        // What the template may render beyond roles and text: no upper bound.
        assert_eq!(chat("ex", "hi", json!({"tools": [{"type": "function"}]})), exact("ex"));
        assert_eq!(
            chat("ex", "hi", json!({"chat_template_kwargs": {"enable_thinking": false}})),
            exact("ex")
        );
        assert_eq!(chat("ex", "hi", json!({"tools": null})), vec![]);
        let named = json!({"model": "ex", "messages": [{"role": "user", "content": "hi", "name": "bob"}]});
        assert_eq!(context_headers("/v1/chat/completions", named), exact("ex"));
        // NFC may triple non-ASCII bytes: 4 + 3 * 40 + 32 = 156.
        let accents = "é".repeat(20);
        assert_eq!(chat("nfc", &accents, json!({})), exact("nfc"));
        assert_eq!(chat("ex", &accents, json!({})), vec![]); // 4 + 40 + 32 = 76
                                                             // Completions: bytes + slack, token ids exact, the largest prompt of a batch decides.
        let comp = |prompt: Value, max: u64| {
            context_headers("/v1/completions", json!({"model": "ex", "prompt": prompt, "max_tokens": max}))
        };
        assert_eq!(comp(json!("y".repeat(90)), 8), vec![]); // 92 + 8
        assert_eq!(comp(json!("y".repeat(90)), 9), exact("ex"));
        assert_eq!(comp(json!(["a", "y".repeat(90)]), 9), exact("ex"));
        assert_eq!(comp(json!([[1, 2, 3], [4]]), 90), vec![]);
        // Embeddings are never checked.
        let emb = json!({"model": "ex", "input": "w".repeat(1000)});
        assert_eq!(context_headers("/v1/embeddings", emb), vec![]);
    }

    #[test]
    fn lower_bound_still_rejects_first() {
        let cfg = bounds_cfg();
        let p = pending_in(&cfg, "/v1/chat/completions", "sk-t");
        // user(4) + 392 bytes, max_token_bytes 4: lower 99 + 2 > 100.
        let body = json!({"model": "ex", "messages": [{"role": "user", "content": "y".repeat(392)}], "max_tokens": 2});
        let e = on_request_body(&cfg, &p, body.to_string().as_bytes()).unwrap_err();
        assert_eq!(e.parts().2, "context_length_exceeded");
    }

    #[test]
    fn response_stripping_condition() {
        assert!(response_needs_stripping(Some(b"200"), Some(b"text/event-stream; charset=utf-8"), None));
        assert!(response_needs_stripping(Some(b"200"), Some(b"Text/Event-Stream"), Some(b"identity")));
        assert!(!response_needs_stripping(Some(b"200"), Some(b"text/event-stream"), Some(b"gzip")));
        assert!(!response_needs_stripping(Some(b"400"), Some(b"text/event-stream"), None));
        assert!(!response_needs_stripping(Some(b"200"), Some(b"application/json"), None));
        assert!(!response_needs_stripping(None, None, None));
    }

    /// `cfg()` with bodies over 200 bytes taking the large-body path.
    fn large(body: Value) -> Result<ForwardPlan, GatewayError> {
        let mut c = cfg();
        c.full_parse_max_bytes = 200;
        both(&c, &pending("/v1/chat/completions", "sk-demo"), body.to_string().as_bytes())
    }

    fn long_messages() -> Value {
        json!([{"role": "user", "content": "word ".repeat(80)}])
    }

    #[test]
    fn a_large_body_is_routed_from_its_top_level_members() {
        let plan =
            large(json!({"model": "qwen-latest", "messages": long_messages(), "stream": true})).unwrap();
        let h = header_map(&plan);
        assert!(h.contains(&("x-gateway-pool".into(), "pool_a".into())));
        assert!(h.contains(&("x-gateway-prompt-tokens-source".into(), "estimate".into())));
        let body: Value = serde_json::from_slice(plan.new_body.as_ref().unwrap()).unwrap();
        // The surgical rewrites apply to the real body; its messages pass untouched.
        assert_eq!(body["model"], "Qwen/Qwen2.5-0.5B-Instruct");
        assert_eq!(body["stream_options"], json!({"include_usage": true}));
        assert_eq!(body["messages"], long_messages());
        assert!(plan.usage_injected);
    }

    /// `x-gateway-max-tokens` and the lease reservation of a plan.
    fn reservation(plan: &ForwardPlan) -> (u64, u64, u64) {
        let h = header_map(plan);
        let get = |k: &str| h.iter().find(|(n, _)| n == k).unwrap().1.parse::<u64>().unwrap();
        (get(H_PROMPT_TOKENS), get(H_MAX_TOKENS), plan.admission.as_ref().unwrap().reserve_tokens)
    }

    /// Issue 17, item 4: `n` (and completions `best_of`) multiply what a request can generate;
    /// the header the sidecar reserves from and the lease reservation cover every choice, on the
    /// parsed and the large-body paths alike, while the context rule stays per sequence.
    #[test]
    fn reservations_cover_every_choice() {
        let msgs = json!([{"role": "user", "content": "hello"}]);
        // tiny: max_model_len 100; "user" + "hello" = 9 bytes, estimate 3 tokens.
        let plan = chat(json!({"model": "tiny", "messages": msgs, "max_tokens": 10, "n": 3})).unwrap();
        assert_eq!(reservation(&plan), (3, 30, 33));
        let plan = chat(json!({"model": "tiny", "messages": msgs, "max_tokens": 10})).unwrap();
        assert_eq!(reservation(&plan), (3, 10, 13));
        // No max_tokens: each choice may run to the end of the context.
        let plan = chat(json!({"model": "tiny", "messages": msgs, "n": 4})).unwrap();
        assert_eq!(reservation(&plan), (3, 4 * 97, 3 + 4 * 97));
        // The context rule is per sequence: n does not refuse what fits once.
        let plan = chat(json!({"model": "tiny", "messages": msgs, "max_tokens": 90, "n": 50})).unwrap();
        assert_eq!(reservation(&plan).1, 4500);
        // An absurd n is refused past max_n (vLLM's own limit by default), naming the parameter;
        // under a limit raised to it, the reservation saturates.
        let e =
            chat(json!({"model": "tiny", "messages": msgs, "max_tokens": 90, "n": u64::MAX})).unwrap_err();
        assert_eq!(e.parts(), (400, "invalid_request_error", "invalid_value", Some("n")));
        let mut unlimited = cfg();
        unlimited.max_n = u64::MAX;
        let body = json!({"model": "tiny", "messages": msgs, "max_tokens": 90, "n": u64::MAX}).to_string();
        let plan = both(&unlimited, &pending("/v1/chat/completions", "sk-demo"), body.as_bytes()).unwrap();
        assert_eq!(reservation(&plan), (3, u64::MAX, u64::MAX));
        // Completions: best_of sequences are generated, n returned.
        let comp =
            |body: Value| both(&cfg(), &pending("/v1/completions", "sk-demo"), body.to_string().as_bytes());
        let plan =
            comp(json!({"model": "tiny", "prompt": "hello!!!", "max_tokens": 7, "n": 2, "best_of": 5}))
                .unwrap();
        assert_eq!(reservation(&plan), (2, 35, 37));
        let e = comp(json!({"model": "tiny", "prompt": "x", "n": 3, "best_of": 2})).unwrap_err();
        assert_eq!(e.parts(), (400, "invalid_request_error", "invalid_value", Some("best_of")));
        let e = chat(json!({"model": "tiny", "messages": msgs, "n": 0})).unwrap_err();
        assert_eq!(e.parts(), (400, "invalid_request_error", "invalid_value", Some("n")));
        // The large-body path: same header and reservation arithmetic, same validation.
        let plan =
            large(json!({"model": "qwen", "messages": long_messages(), "max_tokens": 100, "n": 3})).unwrap();
        let (prompt, max, reserve) = reservation(&plan);
        assert_eq!((max, reserve), (300, prompt + 300));
        let plan = large(json!({"model": "qwen", "messages": long_messages(), "n": 2})).unwrap();
        let (prompt, max, _) = reservation(&plan);
        assert_eq!(max, 2 * (4096 - prompt));
        let e = large(json!({"model": "qwen", "messages": long_messages(), "n": "2"})).unwrap_err();
        assert_eq!(e.parts(), (400, "invalid_request_error", "invalid_type", Some("n")));
        // A completions batch: each prompt gets its own n choices, parsed or not.
        let plan =
            comp(json!({"model": "tiny", "prompt": ["ab", "cd", "ef"], "max_tokens": 7, "n": 2})).unwrap();
        assert_eq!(reservation(&plan), (3, 3 * 2 * 7, 3 + 42));
        let plan = comp(json!({"model": "tiny", "prompt": [[1, 2], [3]], "n": 2})).unwrap();
        // No max_tokens: (100 - 2) + (100 - 1) for each of 2 choices.
        assert_eq!(reservation(&plan), (3, 2 * 197, 3 + 2 * 197));
        let plan = comp(json!({"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 7})).unwrap();
        assert_eq!(reservation(&plan).1, 7);
        let mut c = cfg();
        c.full_parse_max_bytes = 200;
        let p = pending("/v1/completions", "sk-demo");
        let batch = json!({"model": "qwen", "prompt": vec!["word ".repeat(20); 4], "max_tokens": 10, "n": 3});
        assert_eq!(reservation(&both(&c, &p, batch.to_string().as_bytes()).unwrap()).1, 4 * 3 * 10);
        let ids = json!({"model": "qwen", "prompt": vec![7; 100], "max_tokens": 10});
        assert_eq!(reservation(&both(&c, &p, ids.to_string().as_bytes()).unwrap()).1, 10);
    }

    /// A body of more top-level members than MAX_TOP_LEVEL_MEMBERS is refused on both paths (the
    /// attacker's 4 MiB of `"k1":0,` costs the walk over its bytes, no key's allocation); at the
    /// bound it passes.
    #[test]
    fn top_level_members_are_bounded() {
        use crate::request::MAX_TOP_LEVEL_MEMBERS;
        let body = |members: usize, pad: usize| {
            let mut v = json!({"model": "qwen", "messages": long_messages(), "pad": "p".repeat(pad)});
            for i in 0..members - 3 {
                v[format!("k{i}")] = json!(0);
            }
            v.to_string()
        };
        let mut c = cfg();
        c.max_body_bytes = 1 << 20;
        let p = pending("/v1/chat/completions", "sk-demo");
        for large in [false, true] {
            c.full_parse_max_bytes = if large { 200 } else { 1 << 20 };
            assert!(both(&c, &p, body(MAX_TOP_LEVEL_MEMBERS, 0).as_bytes()).is_ok(), "large: {large}");
            let e = both(&c, &p, body(MAX_TOP_LEVEL_MEMBERS + 1, 0).as_bytes()).unwrap_err();
            assert_eq!(e.parts(), (400, "invalid_request_error", "too_many_members", None), "large: {large}");
        }
    }

    /// `n` and completions `best_of` past `max_n` are refused 400 naming the parameter, on the
    /// parsed and the large-body paths alike; at the limit they pass.
    #[test]
    fn sequences_are_capped_by_max_n() {
        let mut c = cfg();
        c.max_n = 4;
        let msgs = json!([{"role": "user", "content": "hello"}]);
        let chat_p = pending("/v1/chat/completions", "sk-demo");
        let comp_p = pending("/v1/completions", "sk-demo");
        let run = |p: &PendingRequest, body: Value| both(&c, p, body.to_string().as_bytes());
        assert!(run(&chat_p, json!({"model": "tiny", "messages": msgs, "n": 4})).is_ok());
        let e = run(&chat_p, json!({"model": "tiny", "messages": msgs, "n": 5})).unwrap_err();
        assert_eq!(e.parts(), (400, "invalid_request_error", "invalid_value", Some("n")));
        assert!(e.to_string().contains("at most 4"), "{e}");
        let e = run(&comp_p, json!({"model": "tiny", "prompt": "x", "n": 2, "best_of": 9})).unwrap_err();
        assert_eq!(e.parts().3, Some("best_of"));
        // Chat has no best_of: vLLM ignores it, so does the cap.
        assert!(run(&chat_p, json!({"model": "tiny", "messages": msgs, "best_of": 9})).is_ok());
        let mut small = c.clone();
        small.full_parse_max_bytes = 200;
        let big = json!({"model": "qwen", "messages": long_messages(), "n": 18_446_744_073_709_551_615u64});
        let e = both(&small, &chat_p, big.to_string().as_bytes()).unwrap_err();
        assert_eq!(e.parts().3, Some("n"));
    }

    /// The facts bound what the upstream may report (`max_model_len` per prompt, each sequence's
    /// cap times the sequences), carry the body's size, and a client's content coding is asked
    /// away.
    #[test]
    fn facts_bound_the_usage_and_carry_the_body_size() {
        let msgs = json!([{"role": "user", "content": "hello"}]);
        let body = json!({"model": "tiny", "messages": msgs, "max_tokens": 10, "n": 3});
        let plan = chat(body.clone()).unwrap();
        assert_eq!((plan.facts.prompt_tokens_max, plan.facts.completion_tokens_max), (Some(100), Some(30)));
        assert_eq!(plan.facts.body_bytes, Some(body.to_string().len() as u64));
        // No max_tokens: each sequence may run to max_model_len, whatever the estimate.
        let plan = chat(json!({"model": "tiny", "messages": msgs, "n": 2})).unwrap();
        assert_eq!(plan.facts.completion_tokens_max, Some(200));
        // A completions batch: per prompt; embeddings: no completion.
        let comp = |path: &str, body: Value| {
            both(&cfg(), &pending(path, "sk-demo"), body.to_string().as_bytes()).unwrap().facts
        };
        let f = comp(
            "/v1/completions",
            json!({"model": "tiny", "prompt": ["a", "b"], "max_tokens": 50, "best_of": 2}),
        );
        assert_eq!((f.prompt_tokens_max, f.completion_tokens_max), (Some(200), Some(200)));
        let f = comp("/v1/embeddings", json!({"model": "tiny", "input": ["a", "b", "c"]}));
        assert_eq!((f.prompt_tokens_max, f.completion_tokens_max), (Some(300), Some(0)));
        // The large-body path bounds the same way.
        let plan =
            large(json!({"model": "qwen", "messages": long_messages(), "max_tokens": 7, "n": 2})).unwrap();
        assert_eq!((plan.facts.prompt_tokens_max, plan.facts.completion_tokens_max), (Some(4096), Some(14)));
        // accept-encoding: a coding asked for becomes identity upstream; none or identity: untouched.
        for (value, asked) in [
            ("gzip, deflate, br, zstd", true),
            ("identity", false),
            ("identity;q=1, *;q=0", true),
            ("", false),
        ] {
            let mut h = post("/v1/chat/completions", "sk-demo");
            h.push(("accept-encoding".to_string(), value.as_bytes().to_vec()));
            let HeadersDecision::AwaitBody(p) = on_request_headers(&cfg(), &h, NOW_S).decision else {
                panic!()
            };
            let plan = on_request_body(&cfg(), &p, body.to_string().as_bytes()).unwrap();
            let identity = header_map(&plan).contains(&("accept-encoding".into(), "identity".into()));
            assert_eq!(identity, asked, "{value:?}");
        }
    }

    #[test]
    fn a_large_body_keeps_the_checks_of_its_small_members() {
        let e = large(json!({"model": 7, "messages": long_messages()})).unwrap_err();
        assert_eq!(e.parts().2, "invalid_type");
        let e = large(json!({"model": "qwen", "messages": "word ".repeat(80)})).unwrap_err();
        assert!(
            matches!(e, GatewayError::InvalidType { ref param, got: "a string", .. } if param == "messages")
        );
        let e = large(json!({"model": "qwen", "prompt": "word ".repeat(80)})).unwrap_err();
        assert!(matches!(e, GatewayError::MissingParameter { ref param } if param == "messages"));
        let e = large(json!({"model": "qwen", "messages": long_messages(), "max_tokens": 5000})).unwrap_err();
        assert!(matches!(e, GatewayError::MaxTokensTooLarge { .. }), "{e:?}");
        let e = large(json!({"model": "nope", "messages": long_messages()})).unwrap_err();
        assert_eq!(e.parts().0, 404);
    }

    /// Issue 16, item 5 (found by tests/parse_props.rs): a large body with bytes after its object
    /// was admitted from its members, where serde_json and vLLM's `json.loads` refuse it whole.
    #[test]
    fn a_large_body_with_trailing_characters_is_refused() {
        let mut c = cfg();
        c.full_parse_max_bytes = 200;
        let p = pending("/v1/chat/completions", "sk-demo");
        let body = json!({"model": "qwen", "messages": long_messages()}).to_string();
        assert!(both(&c, &p, format!(" {body} \r\n").as_bytes()).is_ok());
        for tail in ["x", "}", r#"{"model":"llama"}"#, ",", "\u{0}"] {
            let e = both(&c, &p, format!("{body}{tail}").as_bytes()).unwrap_err();
            assert_eq!(e.parts(), (400, "invalid_request_error", "invalid_json", None), "{tail}");
        }
    }

    #[test]
    fn a_large_body_is_refused_by_its_text_alone_and_else_left_downstream() {
        // 400 bytes of text for a model of 100 tokens with 4-byte tokens: refused either way.
        let over = json!({"model": "tiny", "messages": [{"role": "user", "content": "x".repeat(400)}]});
        assert_eq!(chat(over.clone()).unwrap_err().parts().2, "context_length_exceeded");
        assert_eq!(large(over).unwrap_err().parts().2, "context_length_exceeded");
        // Escapes are not decoded: 60 × "\u00e9" is 120 bytes of text, at least 60 raw bytes.
        let fits = json!({"model": "tiny", "messages": [{"role": "user", "content": "é".repeat(60)}], "x": "y".repeat(200)});
        let plan = large(fits.clone()).unwrap();
        assert!(!header_map(&plan).iter().any(|(k, _)| k == "x-gateway-context-check"));
        // A model with exact_count: the sidecar counts it.
        let mut c = cfg();
        c.full_parse_max_bytes = 200;
        if let Some(m) = c.models.iter_mut().find(|m| m.name == "tiny") {
            m.exact_count = true;
        }
        let plan =
            on_request_body(&c, &pending("/v1/chat/completions", "sk-demo"), fits.to_string().as_bytes());
        assert!(header_map(&plan.unwrap()).contains(&("x-gateway-context-check".into(), "exact".into())));
    }

    fn responses(body: Value) -> Result<ForwardPlan, GatewayError> {
        both(&cfg(), &pending("/v1/responses", "sk-demo"), body.to_string().as_bytes())
    }

    /// Issue 15, item 5: the Responses API is routed, estimated and reserved like chat, with its
    /// own rule (vLLM caps `max_output_tokens`), and never gets `stream_options` injected.
    #[test]
    fn a_responses_request_is_planned_like_chat() {
        let body = json!({"model": "qwen-latest", "instructions": "be brief", "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "x".repeat(100)}]}],
            "max_output_tokens": 50, "stream": true});
        let plan = responses(body.clone()).unwrap();
        // system(6) + 8, user(4) + 100 = 118 bytes: estimate 30.
        assert_eq!(reservation(&plan), (30, 50, 80));
        let h = header_map(&plan);
        assert!(h.contains(&("x-gateway-pool".into(), "pool_a".into())));
        assert!(h.contains(&("x-gateway-model".into(), "qwen".into())));
        assert!(!h.iter().any(|(k, _)| k == H_USAGE_INJECTED), "{h:?}");
        assert!(!plan.usage_injected && plan.stream);
        assert_eq!(plan.api, gateway_meter::Api::Responses);
        // Only the model is rewritten: no stream_options.
        let sent: Value = serde_json::from_slice(plan.new_body.as_ref().unwrap()).unwrap();
        let mut expected = body;
        expected["model"] = json!("Qwen/Qwen2.5-0.5B-Instruct");
        assert_eq!(sent, expected);
        // The facts the sidecar admits by.
        assert_eq!(
            (plan.facts.prompt_tokens, plan.facts.max_tokens, plan.facts.pool.as_str()),
            (30, 50, "pool_a")
        );
        // Chat is metered as chat.
        let chat_plan =
            chat(json!({"model": "qwen", "messages": [{"role": "user", "content": "x"}]})).unwrap();
        assert_eq!(chat_plan.api, gateway_meter::Api::ChatCompletions);
    }

    #[test]
    fn the_responses_context_rule_refuses_only_a_prompt_that_fills_the_context() {
        // tiny: max_model_len 100, max_token_bytes 4. user(4) + 392 bytes: lower bound 99 fits...
        let fits = json!({"model": "tiny", "input": "y".repeat(392), "max_output_tokens": 1000});
        let plan = responses(fits).unwrap();
        // ...and max_output_tokens is capped by what the context leaves after the estimate (99).
        assert_eq!(reservation(&plan), (99, 1, 100));
        // 396 bytes: lower bound 100, the whole context.
        let e = responses(json!({"model": "tiny", "input": "y".repeat(396)})).unwrap_err();
        assert_eq!(e.parts(), (400, "invalid_request_error", "context_length_exceeded", Some("input")));
        // Instructions count: 4 bytes of "y" moved there (system(6) + 4) still fill it.
        let e = responses(json!({"model": "tiny", "instructions": "yyyy", "input": "y".repeat(392)}))
            .unwrap_err();
        assert_eq!(e.parts().2, "context_length_exceeded");
        // A max_output_tokens beyond max_model_len alone is vLLM's to cap, not refused.
        let plan = responses(json!({"model": "tiny", "input": "hi", "max_output_tokens": 5000})).unwrap();
        assert_eq!(reservation(&plan).1, 100 - 2);
        // Without max_output_tokens: what the context leaves.
        let plan = responses(json!({"model": "tiny", "input": "hi"})).unwrap();
        assert_eq!(reservation(&plan), (2, 98, 100));
        // Never marked for the sidecar's exact count, which reads chat and completions bodies only.
        let c = bounds_cfg();
        let p = pending_in(&c, "/v1/responses", "sk-t");
        let plan =
            on_request_body(&c, &p, json!({"model": "ex", "input": "z".repeat(64)}).to_string().as_bytes())
                .unwrap();
        assert!(!header_map(&plan).iter().any(|(k, _)| k.starts_with("x-gateway-context")));
        assert!(plan.admission.is_some(), "a lease may admit it");
    }

    #[test]
    fn a_large_responses_body_decides_as_the_full_parse() {
        let mut c = cfg();
        c.full_parse_max_bytes = 200;
        let p = pending("/v1/responses", "sk-demo");
        let run = |body: Value| both(&c, &p, body.to_string().as_bytes());
        let items = json!([{"role": "user", "content": "word ".repeat(80)}, {"type": "function_call_output", "content": "z".repeat(500), "role": "tool"}]);
        let plan =
            run(json!({"model": "qwen-latest", "input": items, "stream": true, "max_output_tokens": 7}))
                .unwrap();
        let h = header_map(&plan);
        assert!(h.contains(&("x-gateway-pool".into(), "pool_a".into())));
        assert_eq!(reservation(&plan).1, 7);
        assert!(!plan.usage_injected && plan.api == gateway_meter::Api::Responses);
        let body: Value = serde_json::from_slice(plan.new_body.as_ref().unwrap()).unwrap();
        assert_eq!(body["input"], items);
        assert_eq!(body.get("stream_options"), None);
        // The same checks of the small members and of the input's type.
        let e = run(json!({"model": "qwen", "input": 5, "pad": "p".repeat(300)})).unwrap_err();
        assert_eq!(e.parts(), (400, "invalid_request_error", "invalid_type", Some("input")));
        let e = run(json!({"model": "qwen", "input": null, "pad": "p".repeat(300)})).unwrap_err();
        assert_eq!(e.parts().3, Some("input"));
        let e =
            run(json!({"model": "qwen", "input": "w".repeat(300), "max_output_tokens": "7"})).unwrap_err();
        assert_eq!(e.parts().3, Some("max_output_tokens"));
        // A text that fills the context alone is refused here too; the function call output's
        // content is not counted (the full parse does not count it either).
        let over = json!({"model": "tiny", "input": "x".repeat(400)});
        assert_eq!(responses(over.clone()).unwrap_err().parts().2, "context_length_exceeded");
        assert_eq!(run(over).unwrap_err().parts().2, "context_length_exceeded");
        let tool = json!({"model": "tiny", "input": [{"type": "function_call_output", "role": "tool", "content": "x".repeat(400)}]});
        assert!(responses(tool.clone()).is_ok());
        assert!(run(tool).is_ok());
        let instructions =
            json!({"model": "tiny", "instructions": "x".repeat(300), "input": "x".repeat(100)});
        assert_eq!(responses(instructions.clone()).unwrap_err().parts().2, "context_length_exceeded");
        assert_eq!(run(instructions).unwrap_err().parts().2, "context_length_exceeded");
    }
}
