//! The sidecar's user-facing errors and the one place that maps them to HTTP responses.
//!
//! Every error the client sees has OpenAI's shape, `{"error": {"message", "type", "param",
//! "code"}}`. Rate-limit 429s follow OpenAI's: `type` is `requests` or `tokens`, `code` is
//! `rate_limit_exceeded`, with `Retry-After` (whole seconds) and the `x-ratelimit-*` headers.
//! Overload 429s (the pool, not the tenant's quota) have code `overloaded`, so clients and
//! dashboards can tell them apart.

use serde_json::json;

use crate::admission::limits::BucketKind;

/// Errors the admission step answers with a local reply instead of forwarding the request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdmissionError {
    /// A tenant's requests- or tokens-per-minute bucket lacks what this request needs.
    #[error("rate limit reached for tenant on {} per min: limit {limit}", kind.as_str())]
    RateLimited {
        /// Which bucket ran out.
        kind: BucketKind,
        /// Its per-minute limit.
        limit: u64,
        /// What the request asked of it.
        requested: u64,
        /// Seconds until it would fit (`Retry-After`).
        retry_after_secs: u64,
        /// The `x-ratelimit-*` headers for all of the tenant's buckets.
        ratelimit_headers: Vec<(String, String)>,
    },
    /// A daily or monthly token quota of the tenant (or tenant × model) is used up
    /// ([`crate::admission::quota`]): 429 with OpenAI's `insufficient_quota` type and code (not
    /// `rate_limit_exceeded`: waiting a minute does not help), `Retry-After` until the period
    /// resets.
    #[error("{period} token quota of {limit} used up")]
    QuotaExceeded {
        /// `day` or `month`.
        period: &'static str,
        /// `tenant` or `model:<name>`.
        scope: String,
        /// The hard limit, tokens.
        limit: u64,
        /// Tokens counted in the period (used and reserved in flight).
        used: u64,
        /// When it resets, RFC 3339 UTC.
        reset: String,
        /// Seconds until it resets (`Retry-After`).
        retry_after_secs: u64,
    },
    /// The request carries no `x-gateway-tenant`: the wasm filter did not run before the sidecar
    /// (an Envoy configuration error).
    #[error("request reached the rate limiter without an authenticated tenant")]
    MissingTenant,
    /// The tenant is authenticated by the filter but has no limits in the sidecar config.
    #[error("tenant has no limits configured")]
    TenantNotConfigured,
    /// Redis could not decide and the failure mode is `closed`.
    #[error("the rate limiter is unavailable")]
    LimiterUnavailable,
    /// The exact prompt-token count (the model's own tokenizer and chat template, see
    /// [`crate::admission::context`]) proves vLLM would refuse the request. 400, `invalid_request_error`,
    /// code `context_length_exceeded`, param `messages` or `prompt`.
    #[error("prompt of {prompt_tokens} tokens exceeds the context window")]
    ContextLengthExceeded {
        /// `messages` (chat) or `prompt` (completions).
        param: &'static str,
        /// Exact prompt tokens (the largest prompt of a batch).
        prompt_tokens: u64,
        /// The request's completion cap, when it set one.
        max_tokens: Option<u64>,
        /// The model's context window in tokens.
        max_model_len: u64,
    },
    /// The request carried the endpoint-picker subset hint (`envoy.lb.subset_hint`) and no
    /// endpoint of it is eligible (unknown, metrics stale or failing): 503, as the Gateway API
    /// Inference Extension's endpoint-picker protocol requires.
    #[error("no eligible endpoint of pool {pool} in the request's subset")]
    NoEligibleEndpoint {
        /// The pool (Envoy cluster).
        pool: String,
    },
    /// The endpoint picker (`crate::grpc::epp`) buffers the body to read the prompt, up to
    /// `endpoint_pickers[].max_body_bytes`: 413, `invalid_request_error`, code `request_too_large`.
    #[error("request body over {max_bytes} bytes")]
    RequestTooLarge {
        /// The limit, in bytes.
        max_bytes: usize,
    },
    /// The request's pool is over its load threshold for this tier: shed before its queue grows.
    #[error("pool {pool} is overloaded")]
    Overloaded {
        /// The pool (Envoy cluster).
        pool: String,
        /// Seconds until it is expected to have room (`Retry-After`).
        retry_after_secs: u64,
    },
}

/// A local reply: status, JSON body and headers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalReply {
    /// HTTP status code.
    pub status: u16,
    /// OpenAI-shaped JSON error body.
    pub body: Vec<u8>,
    /// Response headers (besides `content-type: application/json`).
    pub headers: Vec<(String, String)>,
}

impl AdmissionError {
    /// Maps the error to its HTTP response. This is the only place that does.
    pub fn to_reply(&self) -> LocalReply {
        let (status, kind, code, message, headers) = match self {
            AdmissionError::RateLimited { kind, limit, requested, retry_after_secs, ratelimit_headers } => {
                let name = match kind {
                    BucketKind::Requests => "requests per min (RPM)",
                    BucketKind::Tokens => "tokens per min (TPM)",
                };
                let mut headers = ratelimit_headers.clone();
                headers.push(("retry-after".to_owned(), retry_after_secs.to_string()));
                (
                    429,
                    kind.as_str(),
                    "rate_limit_exceeded",
                    format!(
                        "Rate limit reached on {name}: Limit {limit}, Requested {requested}. Please try again in {retry_after_secs}s."
                    ),
                    headers,
                )
            }
            AdmissionError::QuotaExceeded { period, scope, limit, used, reset, retry_after_secs } => {
                let whose = match scope.strip_prefix("model:") {
                    Some(model) => format!("your quota for model {model}"),
                    None => "your quota".to_owned(),
                };
                (
                    429,
                    "insufficient_quota",
                    "insufficient_quota",
                    format!(
                        "You exceeded {whose}: {used} of {limit} tokens per {period} used. It resets at {reset}. Please check your plan and billing details."
                    ),
                    vec![("retry-after".to_owned(), retry_after_secs.to_string())],
                )
            }
            AdmissionError::MissingTenant => (
                403,
                "invalid_request_error",
                "missing_tenant",
                "The request was not authenticated by the gateway.".to_owned(),
                Vec::new(),
            ),
            AdmissionError::TenantNotConfigured => (
                403,
                "invalid_request_error",
                "tenant_not_configured",
                "Your organization has no rate limits configured on this gateway; contact its operator."
                    .to_owned(),
                Vec::new(),
            ),
            AdmissionError::Overloaded { retry_after_secs, .. } => (
                429,
                "server_overloaded",
                "overloaded",
                format!(
                    "The model's servers are overloaded; please retry in {retry_after_secs}s. This is not your rate limit."
                ),
                vec![("retry-after".to_owned(), retry_after_secs.to_string())],
            ),
            AdmissionError::ContextLengthExceeded { param, prompt_tokens, max_tokens, max_model_len } => {
                let (what, has) = if *param == "prompt" { ("prompt", "has") } else { ("messages", "have") };
                let message = match max_tokens {
                    Some(m) => format!(
                        "This model's maximum context length is {max_model_len} tokens. However, you requested {} tokens ({prompt_tokens} in the {what}, {m} in the completion). Please reduce the length of the {what} or completion.",
                        prompt_tokens.saturating_add(*m)
                    ),
                    None => format!(
                        "This model's maximum context length is {max_model_len} tokens. However, your {what} {has} {prompt_tokens} tokens, which leaves no room for the completion. Please reduce the length of the {what}."
                    ),
                };
                (400, "invalid_request_error", "context_length_exceeded", message, Vec::new())
            }
            AdmissionError::NoEligibleEndpoint { .. } => (
                503,
                "server_error",
                "no_eligible_endpoint",
                "None of the model's servers this request may use is available; please retry.".to_owned(),
                vec![("retry-after".to_owned(), "1".to_owned())],
            ),
            AdmissionError::RequestTooLarge { max_bytes } => (
                413,
                "invalid_request_error",
                "request_too_large",
                format!("The request body is larger than the gateway's limit of {max_bytes} bytes."),
                Vec::new(),
            ),
            AdmissionError::LimiterUnavailable => (
                503,
                "server_error",
                "rate_limiter_unavailable",
                "The gateway's rate limiter is unavailable; please retry.".to_owned(),
                vec![("retry-after".to_owned(), "1".to_owned())],
            ),
        };
        let param = match self {
            AdmissionError::ContextLengthExceeded { param, .. } => Some(*param),
            _ => None,
        };
        let body = json!({"error": {"message": message, "type": kind, "param": param, "code": code}});
        LocalReply { status, body: body.to_string().into_bytes(), headers }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn context_length_exceeded_names_both_numbers() {
        let e = AdmissionError::ContextLengthExceeded {
            param: "messages",
            prompt_tokens: 4000,
            max_tokens: Some(200),
            max_model_len: 4096,
        };
        let r = e.to_reply();
        assert_eq!(r.status, 400);
        let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(v["error"]["code"], "context_length_exceeded");
        assert_eq!(v["error"]["param"], "messages");
        assert_eq!(
            v["error"]["message"],
            "This model's maximum context length is 4096 tokens. However, you requested 4200 tokens (4000 in the messages, 200 in the completion). Please reduce the length of the messages or completion."
        );
        let e = AdmissionError::ContextLengthExceeded {
            param: "prompt",
            prompt_tokens: 4096,
            max_tokens: None,
            max_model_len: 4096,
        };
        let v: serde_json::Value = serde_json::from_slice(&e.to_reply().body).unwrap();
        assert_eq!(v["error"]["param"], "prompt");
        assert_eq!(
            v["error"]["message"],
            "This model's maximum context length is 4096 tokens. However, your prompt has 4096 tokens, which leaves no room for the completion. Please reduce the length of the prompt."
        );
        assert!(r.headers.is_empty());
    }

    #[test]
    fn rate_limited_is_openai_shaped() {
        let e = AdmissionError::RateLimited {
            kind: BucketKind::Requests,
            limit: 60,
            requested: 1,
            retry_after_secs: 2,
            ratelimit_headers: vec![("x-ratelimit-limit-requests".into(), "60".into())],
        };
        let r = e.to_reply();
        assert_eq!(r.status, 429);
        let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
        assert_eq!(v["error"]["type"], "requests");
        assert_eq!(v["error"]["code"], "rate_limit_exceeded");
        assert_eq!(v["error"]["param"], serde_json::Value::Null);
        assert!(v["error"]["message"].as_str().unwrap().contains("Limit 60, Requested 1"));
        assert!(r.headers.contains(&("retry-after".into(), "2".into())));
        assert!(r.headers.contains(&("x-ratelimit-limit-requests".into(), "60".into())));
    }

    #[test]
    fn insufficient_quota_is_openai_shaped_and_not_a_rate_limit() {
        let e = AdmissionError::QuotaExceeded {
            period: "day",
            scope: "model:big".into(),
            limit: 1000,
            used: 1002,
            reset: "2026-11-27T00:00:00Z".into(),
            retry_after_secs: 3600,
        };
        let r = e.to_reply();
        assert_eq!(r.status, 429);
        let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
        assert_eq!(v["error"]["type"], "insufficient_quota");
        assert_eq!(v["error"]["code"], "insufficient_quota");
        assert_eq!(v["error"]["param"], serde_json::Value::Null);
        let message = v["error"]["message"].as_str().unwrap();
        assert!(
            message.contains("model big") && message.contains("1002 of 1000 tokens per day"),
            "{message}"
        );
        assert_eq!(r.headers, [("retry-after".to_owned(), "3600".to_owned())]);
    }

    #[test]
    fn every_variant_maps_to_a_status() {
        assert_eq!(AdmissionError::MissingTenant.to_reply().status, 403);
        assert_eq!(AdmissionError::TenantNotConfigured.to_reply().status, 403);
        assert_eq!(AdmissionError::LimiterUnavailable.to_reply().status, 503);
        let n = AdmissionError::NoEligibleEndpoint { pool: "p".into() }.to_reply();
        assert_eq!(n.status, 503);
        let v: serde_json::Value = serde_json::from_slice(&n.body).unwrap();
        assert_eq!(
            (v["error"]["type"].as_str(), v["error"]["code"].as_str()),
            (Some("server_error"), Some("no_eligible_endpoint"))
        );
        let o = AdmissionError::Overloaded { pool: "p".into(), retry_after_secs: 3 }.to_reply();
        assert_eq!(o.status, 429);
        let v: serde_json::Value = serde_json::from_slice(&o.body).unwrap();
        assert_eq!(v["error"]["code"], "overloaded");
        assert!(o.headers.contains(&("retry-after".into(), "3".into())));
    }
}
