//! The filter's single request-path error type, [`GatewayError`], and the one exhaustive
//! function, [`GatewayError::to_reply`], that turns it into a local reply.
//!
//! Every local reply has an OpenAI-shaped JSON body
//! (`{"error":{"message":..,"type":..,"param":..,"code":..}}`, the shape of the OpenAI REST API's
//! error object) and `content-type: application/json`. Messages never contain API keys; strings
//! that come from the client (path, model name) are truncated to [`MAX_ECHO_CHARS`] characters.

use serde::Serialize;
use thiserror::Error;

/// Longest client-supplied string (path, method, model name) echoed back in an error message, in
/// characters. Longer strings are cut and end with `...`.
pub const MAX_ECHO_CHARS: usize = 256;

/// Everything that can end a request inside the filter with a local reply.
///
/// The `Display` text of each variant is the `error.message` of the reply. The HTTP status, error
/// `type`, `code`, `param` and extra headers of each variant are fixed by
/// [`GatewayError::to_reply`].
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum GatewayError {
    /// The path is not one the gateway serves. 404, `invalid_request_error`, code `not_found`.
    #[error("Invalid URL ({method} {path})")]
    NotFound {
        /// `:method` of the request (truncated).
        method: String,
        /// `:path` of the request without the query string (truncated).
        path: String,
    },
    /// The path exists but not with this method. 405, `invalid_request_error`,
    /// code `method_not_allowed`, plus an `allow` header.
    #[error("Invalid method for URL ({method} {path}). Allowed: {allow}.")]
    MethodNotAllowed {
        /// `:method` of the request (truncated).
        method: String,
        /// `:path` of the request without the query string.
        path: String,
        /// The one method the path accepts (`GET` or `POST`), also sent as the `allow` header.
        allow: &'static str,
    },
    /// Neither `Authorization: Bearer <key>` nor `x-api-key: <key>` carried a key.
    /// 401, `invalid_request_error`, code `invalid_api_key`.
    #[error(
        "You didn't provide an API key. You need to provide your API key in an Authorization \
         header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY), or in an x-api-key header."
    )]
    MissingApiKey,
    /// The key's SHA-256 matches no configured digest. 401, `invalid_request_error`,
    /// code `invalid_api_key`. The key itself is never echoed.
    #[error("Incorrect API key provided.")]
    InvalidApiKey,
    /// The key is configured, but its `expires_at` has passed. 401, `invalid_request_error`,
    /// code `invalid_api_key`. The key itself is never echoed.
    #[error("The API key provided has expired.")]
    ApiKeyExpired,
    /// The key is configured, but its `not_before` has not come yet. 401,
    /// `invalid_request_error`, code `invalid_api_key`. The key itself is never echoed.
    #[error("The API key provided is not yet valid.")]
    ApiKeyNotYetValid,
    /// `content-length` or the buffered body exceeds `max_body_bytes`. 413,
    /// `invalid_request_error`, code `request_too_large`.
    #[error("Request body too large: the limit is {limit} bytes.")]
    RequestTooLarge {
        /// The configured `max_body_bytes`.
        limit: u64,
    },
    /// The body is empty, not JSON, or not a JSON object. 400, `invalid_request_error`,
    /// code `invalid_json`, param null.
    #[error("We could not parse the JSON body of your request: {detail}.")]
    InvalidJson {
        /// What is wrong (serde_json's message, or "the body is empty", ...).
        detail: String,
    },
    /// A top-level field appears twice in the body, which parsers resolve differently.
    /// 400, `invalid_request_error`, code `duplicate_parameter`, param = the field.
    #[error("Duplicate parameter: '{param}' appears more than once in the request body.")]
    DuplicateParameter {
        /// The repeated top-level field name (truncated).
        param: String,
    },
    /// The body's top-level object has more members than the filter reads
    /// ([`crate::request::MAX_TOP_LEVEL_MEMBERS`]): a body of many small members costs the worker
    /// per member, before any limit applies. 400, `invalid_request_error`, code
    /// `too_many_members`, param null.
    #[error("The request body has more than {limit} top-level members.")]
    TooManyMembers {
        /// [`crate::request::MAX_TOP_LEVEL_MEMBERS`].
        limit: usize,
    },
    /// A required field is missing (or null). 400, `invalid_request_error`,
    /// code `missing_required_parameter`, param = the field.
    #[error("Missing required parameter: '{param}'.")]
    MissingParameter {
        /// The field, e.g. `model`, `messages`, `prompt`, `messages[2].role`.
        param: String,
    },
    /// A field has the wrong JSON type. 400, `invalid_request_error`, code `invalid_type`,
    /// param = the field.
    #[error("Invalid type for '{param}': expected {expected}, but got {got} instead.")]
    InvalidType {
        /// The field, e.g. `max_tokens`, `stream`, `messages[0].content`.
        param: String,
        /// The expected type in words, e.g. `an integer`.
        expected: &'static str,
        /// The JSON type received in words, e.g. `a string`.
        got: &'static str,
    },
    /// A field has the right type but an unacceptable value. 400, `invalid_request_error`,
    /// code `invalid_value`, param = the field.
    #[error("Invalid '{param}': {reason}")]
    InvalidValue {
        /// The field, e.g. `max_tokens`, `messages`.
        param: String,
        /// Why, as a sentence.
        reason: String,
    },
    /// The requested model is not configured (by name, alias or LoRA adapter). 404,
    /// `invalid_request_error`, code `model_not_found`, param `model`.
    #[error("The model `{model}` does not exist.")]
    ModelNotFound {
        /// The requested model (truncated).
        model: String,
    },
    /// The model exists but the tenant's `models` list does not include it. 403,
    /// `invalid_request_error`, code `model_not_allowed`, param `model`.
    #[error("You do not have access to the model `{model}`.")]
    ModelNotAllowed {
        /// The requested model (truncated).
        model: String,
    },
    /// The effective max tokens alone exceed the model's `max_model_len`. 400,
    /// `invalid_request_error`, code `invalid_value`, param = the field used
    /// (`max_tokens` or `max_completion_tokens`).
    #[error(
        "'{param}' is too large: {requested}. This model's maximum context length is \
         {max_model_len} tokens."
    )]
    MaxTokensTooLarge {
        /// `max_tokens` or `max_completion_tokens`.
        param: &'static str,
        /// The requested value.
        requested: u64,
        /// The model's `max_model_len`.
        max_model_len: u64,
    },
    /// The lower bound of the prompt's token count proves the request cannot fit the model's
    /// context window under vLLM's rule. 400, `invalid_request_error`,
    /// code `context_length_exceeded`, param `messages` or `prompt`.
    #[error("{}", context_message(*.max_model_len, *.prompt_lower_bound, *.max_tokens))]
    ContextLengthExceeded {
        /// `messages` (chat) or `prompt` (completions).
        param: &'static str,
        /// The model's `max_model_len`.
        max_model_len: u64,
        /// Proven minimum number of prompt tokens.
        prompt_lower_bound: u64,
        /// The effective max tokens when the client set one.
        max_tokens: Option<u64>,
    },
    /// The tenant already has `max_uploads_per_tenant` request bodies being received by this
    /// Envoy worker. 429, `requests`, code `rate_limit_exceeded`, plus `retry-after: 1`.
    #[error("Too many requests of this API key are sending their body at once (the limit is {limit} per gateway worker); retry when one has finished.")]
    TooManyUploads {
        /// The configured `max_uploads_per_tenant`.
        limit: u32,
    },
    /// The sidecar said the tenant's own requests-per-minute bucket (its `limits`, shared by all
    /// its models) is empty for a while yet (an admission lease refused for it,
    /// [`crate::lease::Leases::tenant_over_rpm`]): answered at the request's headers, before its
    /// body is read. 429, `requests`, code `rate_limit_exceeded`, plus `retry-after`.
    #[error("Rate limit reached on requests per minute. Please try again in {retry_after_secs}s.")]
    TenantOverRequestLimit {
        /// Whole seconds until the bucket holds a request again (at least 1).
        retry_after_secs: u64,
    },
    /// The filter has no valid configuration, or the host failed a call. 500, `server_error`,
    /// code `internal_error`, param null.
    #[error("The gateway could not process the request ({what}).")]
    Internal {
        /// Short description of what failed; never contains request data.
        what: &'static str,
    },
}

fn context_message(max_model_len: u64, lower: u64, max_tokens: Option<u64>) -> String {
    match max_tokens {
        Some(m) => format!(
            "This model's maximum context length is {max_model_len} tokens. However, your request \
             needs at least {} tokens ({lower} in the prompt, lower bound; {m} for max_tokens).",
            lower.saturating_add(m)
        ),
        None => format!(
            "This model's maximum context length is {max_model_len} tokens. However, your prompt \
             needs at least {lower} tokens (lower bound), which leaves no room for the completion."
        ),
    }
}

/// A local reply for Envoy's `send_local_response` (proxy-wasm `send_http_response`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalReply {
    /// HTTP status code.
    pub status: u32,
    /// Response headers; always includes `content-type: application/json`.
    pub headers: Vec<(&'static str, String)>,
    /// JSON body bytes.
    pub body: Vec<u8>,
    /// Envoy's response code details for the reply (`%RESPONSE_CODE_DETAILS%` in the request
    /// log): `llm_gateway_` and the OpenAI error `code` the body carries (e.g.
    /// `llm_gateway_invalid_api_key`), `llm_gateway_filter` for a reply that is not an error.
    pub details: &'static str,
}

/// `{"error": {...}}`, fields in the order of the OpenAI API.
#[derive(Serialize)]
struct ErrorBody<'a> {
    error: ErrorObject<'a>,
}

#[derive(Serialize)]
struct ErrorObject<'a> {
    message: String,
    #[serde(rename = "type")]
    kind: &'static str,
    param: Option<&'a str>,
    code: &'static str,
}

impl LocalReply {
    /// A reply with `status`, `content-type: application/json` and `body` serialized from `value`.
    pub fn json<T: Serialize + ?Sized>(status: u32, value: &T) -> Self {
        // Serializing these shapes cannot fail (all keys are strings); fall back to a fixed body
        // rather than panicking if it ever does.
        let body = serde_json::to_vec(value).unwrap_or_else(|_| {
            br#"{"error":{"message":"internal error","type":"server_error","param":null,"code":"internal_error"}}"#
                .to_vec()
        });
        LocalReply {
            status,
            headers: vec![("content-type", "application/json".to_string())],
            body,
            details: "llm_gateway_filter",
        }
    }
}

impl GatewayError {
    /// HTTP status, error `type`, `code` and `param` of this error (see the variant docs).
    pub fn parts(&self) -> (u32, &'static str, &'static str, Option<&str>) {
        const IRE: &str = "invalid_request_error";
        match self {
            GatewayError::NotFound { .. } => (404, IRE, "not_found", None),
            GatewayError::MethodNotAllowed { .. } => (405, IRE, "method_not_allowed", None),
            GatewayError::MissingApiKey
            | GatewayError::InvalidApiKey
            | GatewayError::ApiKeyExpired
            | GatewayError::ApiKeyNotYetValid => (401, IRE, "invalid_api_key", None),
            GatewayError::RequestTooLarge { .. } => (413, IRE, "request_too_large", None),
            GatewayError::InvalidJson { .. } => (400, IRE, "invalid_json", None),
            GatewayError::DuplicateParameter { param } => (400, IRE, "duplicate_parameter", Some(param)),
            GatewayError::TooManyMembers { .. } => (400, IRE, "too_many_members", None),
            GatewayError::MissingParameter { param } => (400, IRE, "missing_required_parameter", Some(param)),
            GatewayError::InvalidType { param, .. } => (400, IRE, "invalid_type", Some(param)),
            GatewayError::InvalidValue { param, .. } => (400, IRE, "invalid_value", Some(param)),
            GatewayError::ModelNotFound { .. } => (404, IRE, "model_not_found", Some("model")),
            GatewayError::ModelNotAllowed { .. } => (403, IRE, "model_not_allowed", Some("model")),
            GatewayError::MaxTokensTooLarge { param, .. } => (400, IRE, "invalid_value", Some(param)),
            GatewayError::ContextLengthExceeded { param, .. } => {
                (400, IRE, "context_length_exceeded", Some(param))
            }
            GatewayError::TooManyUploads { .. } | GatewayError::TenantOverRequestLimit { .. } => {
                (429, "requests", "rate_limit_exceeded", None)
            }
            GatewayError::Internal { .. } => (500, "server_error", "internal_error", None),
        }
    }

    /// Why the filter refused the request, one value per variant (finer than the OpenAI
    /// `code`: a missing key and a wrong one differ): the reply's Envoy response code details
    /// (`%RESPONSE_CODE_DETAILS%`), `llm_gateway_` and the reason.
    pub fn details(&self) -> &'static str {
        match self {
            GatewayError::NotFound { .. } => "llm_gateway_not_found",
            GatewayError::MethodNotAllowed { .. } => "llm_gateway_method_not_allowed",
            GatewayError::MissingApiKey => "llm_gateway_missing_api_key",
            GatewayError::InvalidApiKey => "llm_gateway_invalid_api_key",
            GatewayError::ApiKeyExpired => "llm_gateway_api_key_expired",
            GatewayError::ApiKeyNotYetValid => "llm_gateway_api_key_not_yet_valid",
            GatewayError::RequestTooLarge { .. } => "llm_gateway_request_too_large",
            GatewayError::InvalidJson { .. } => "llm_gateway_invalid_json",
            GatewayError::DuplicateParameter { .. } => "llm_gateway_duplicate_parameter",
            GatewayError::TooManyMembers { .. } => "llm_gateway_too_many_members",
            GatewayError::MissingParameter { .. } => "llm_gateway_missing_required_parameter",
            GatewayError::InvalidType { .. } => "llm_gateway_invalid_type",
            GatewayError::InvalidValue { .. } => "llm_gateway_invalid_value",
            GatewayError::ModelNotFound { .. } => "llm_gateway_model_not_found",
            GatewayError::ModelNotAllowed { .. } => "llm_gateway_model_not_allowed",
            GatewayError::MaxTokensTooLarge { .. } => "llm_gateway_max_tokens_too_large",
            GatewayError::ContextLengthExceeded { .. } => "llm_gateway_context_length_exceeded",
            GatewayError::TooManyUploads { .. } => "llm_gateway_too_many_uploads",
            GatewayError::TenantOverRequestLimit { .. } => "llm_gateway_tenant_over_rpm",
            GatewayError::Internal { .. } => "llm_gateway_internal_error",
        }
    }

    /// The local reply for this error: status from [`GatewayError::parts`], body
    /// `{"error":{"message":<Display>,"type":..,"param":..,"code":..}}`,
    /// `content-type: application/json`, and `allow` for 405.
    pub fn to_reply(&self) -> LocalReply {
        let (status, kind, code, param) = self.parts();
        let body = ErrorBody { error: ErrorObject { message: self.to_string(), kind, param, code } };
        let mut reply = LocalReply::json(status, &body);
        reply.details = self.details();
        match self {
            GatewayError::MethodNotAllowed { allow, .. } => {
                reply.headers.push(("allow", (*allow).to_string()))
            }
            GatewayError::TooManyUploads { .. } => reply.headers.push(("retry-after", "1".to_string())),
            GatewayError::TenantOverRequestLimit { retry_after_secs } => {
                reply.headers.push(("retry-after", retry_after_secs.to_string()));
            }
            _ => {}
        }
        reply
    }
}

/// `s` cut to [`MAX_ECHO_CHARS`] characters (with `...` appended when cut), for echoing
/// client-supplied strings in error messages.
pub fn truncate_for_echo(s: &str) -> String {
    match s.char_indices().nth(MAX_ECHO_CHARS) {
        Some((cut, _)) => format!("{}...", s.get(..cut).unwrap_or_default()),
        None => s.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn body(e: &GatewayError) -> serde_json::Value {
        serde_json::from_slice(&e.to_reply().body).unwrap()
    }

    #[test]
    fn reply_shape_is_openai_error() {
        let e = GatewayError::InvalidApiKey;
        let r = e.to_reply();
        assert_eq!(r.status, 401);
        assert_eq!(r.headers, vec![("content-type", "application/json".to_string())]);
        assert_eq!(
            body(&e),
            json!({"error":{"message":"Incorrect API key provided.","type":"invalid_request_error","param":null,"code":"invalid_api_key"}})
        );
        // Field order as in the OpenAI API.
        assert_eq!(
            String::from_utf8(r.body).unwrap(),
            r#"{"error":{"message":"Incorrect API key provided.","type":"invalid_request_error","param":null,"code":"invalid_api_key"}}"#
        );
    }

    #[test]
    fn method_not_allowed_has_allow_header() {
        let e = GatewayError::MethodNotAllowed {
            method: "GET".into(),
            path: "/v1/chat/completions".into(),
            allow: "POST",
        };
        let r = e.to_reply();
        assert_eq!(r.status, 405);
        assert!(r.headers.contains(&("allow", "POST".to_string())));
        assert_eq!(body(&e)["error"]["code"], "method_not_allowed");
    }

    #[test]
    fn too_many_uploads_is_a_429_with_retry_after() {
        let e = GatewayError::TooManyUploads { limit: 8 };
        let r = e.to_reply();
        assert_eq!(r.status, 429);
        assert!(r.headers.contains(&("retry-after", "1".to_string())));
        assert_eq!(body(&e)["error"]["code"], "rate_limit_exceeded");
        assert_eq!(body(&e)["error"]["type"], "requests");
    }

    #[test]
    fn context_messages_give_both_numbers() {
        let e = GatewayError::ContextLengthExceeded {
            param: "messages",
            max_model_len: 4096,
            prompt_lower_bound: 4000,
            max_tokens: Some(1000),
        };
        assert_eq!(
            e.to_string(),
            "This model's maximum context length is 4096 tokens. However, your request needs at \
             least 5000 tokens (4000 in the prompt, lower bound; 1000 for max_tokens)."
        );
        let b = body(&e);
        assert_eq!(b["error"]["param"], "messages");
        assert_eq!(b["error"]["code"], "context_length_exceeded");
        let e = GatewayError::ContextLengthExceeded {
            param: "prompt",
            max_model_len: 4096,
            prompt_lower_bound: 4096,
            max_tokens: None,
        };
        assert_eq!(
            e.to_string(),
            "This model's maximum context length is 4096 tokens. However, your prompt needs at \
             least 4096 tokens (lower bound), which leaves no room for the completion."
        );
    }

    #[test]
    fn truncation() {
        assert_eq!(truncate_for_echo("abc"), "abc");
        let long = "é".repeat(300);
        let t = truncate_for_echo(&long);
        assert_eq!(t.chars().count(), MAX_ECHO_CHARS + 3);
        assert!(t.ends_with("..."));
    }

    #[test]
    fn every_variant_maps() {
        let all = [
            GatewayError::NotFound { method: "POST".into(), path: "/x".into() },
            GatewayError::MissingApiKey,
            GatewayError::RequestTooLarge { limit: 1 },
            GatewayError::InvalidJson { detail: "x".into() },
            GatewayError::DuplicateParameter { param: "model".into() },
            GatewayError::MissingParameter { param: "model".into() },
            GatewayError::InvalidType { param: "stream".into(), expected: "a boolean", got: "a string" },
            GatewayError::InvalidValue { param: "max_tokens".into(), reason: "x".into() },
            GatewayError::ModelNotFound { model: "m".into() },
            GatewayError::ModelNotAllowed { model: "m".into() },
            GatewayError::MaxTokensTooLarge { param: "max_tokens", requested: 9, max_model_len: 8 },
            GatewayError::TooManyUploads { limit: 8 },
            GatewayError::TenantOverRequestLimit { retry_after_secs: 3 },
            GatewayError::TooManyMembers { limit: 1024 },
            GatewayError::Internal { what: "x" },
        ];
        let statuses: Vec<u32> = all.iter().map(|e| e.to_reply().status).collect();
        assert_eq!(statuses, vec![404, 401, 413, 400, 400, 400, 400, 400, 404, 403, 400, 429, 429, 400, 500]);
        let over = GatewayError::TenantOverRequestLimit { retry_after_secs: 3 }.to_reply();
        assert!(over.headers.contains(&("retry-after", "3".to_string())));
        for e in &all {
            let b = body(e);
            assert!(b["error"]["message"].is_string());
            assert!(b["error"]["type"].is_string());
            assert!(b["error"]["code"].is_string());
        }
        assert_eq!(body(&GatewayError::Internal { what: "x" })["error"]["type"], "server_error");
    }
}
