//! vLLM's error answers.
//!
//! vLLM's OpenAI server answers every rejected request with its `ErrorResponse` model:
//! `{"error": {"message": str, "type": str, "param": str | null, "code": int}}`, where
//! `code` repeats the HTTP status and `type` names the status (`BadRequestError`, ...).

use bytes::Bytes;
use http::StatusCode;
use serde::Serialize;

/// One rejected request: HTTP status plus the fields of vLLM's `ErrorResponse`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{status}: {message}")]
pub struct ApiError {
    /// HTTP status; also the body's `error.code`.
    pub status: StatusCode,
    /// `error.type`, e.g. `BadRequestError`.
    pub kind: &'static str,
    /// `error.message`.
    pub message: String,
    /// `error.param`: the offending request field, when vLLM names one.
    pub param: Option<&'static str>,
}

#[derive(Serialize)]
struct Envelope<'a> {
    error: Detail<'a>,
}

#[derive(Serialize)]
struct Detail<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'a str,
    param: Option<&'a str>,
    code: u16,
}

impl ApiError {
    /// 400 `BadRequestError`: malformed JSON, missing fields, failed length checks.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            kind: "BadRequestError",
            message: message.into(),
            param: None,
        }
    }

    /// 404 `NotFoundError` for a `model` that is not served:
    /// "The model `X` does not exist." with `param` `"model"`.
    pub fn model_not_found(model: &str) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            kind: "NotFoundError",
            message: format!("The model `{model}` does not exist."),
            param: Some("model"),
        }
    }

    /// 500 `InternalServerError`, used for the faults injected by `--error-rate`.
    pub fn internal(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            kind: "InternalServerError",
            message: message.into(),
            param: None,
        }
    }

    /// 503 `ServiceUnavailableError`: the server is shutting down and the request never ran.
    pub fn shutting_down() -> Self {
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            kind: "ServiceUnavailableError",
            message: "The server is shutting down.".to_owned(),
            param: None,
        }
    }

    /// The JSON body, `{"error": {"message", "type", "param", "code"}}`.
    pub fn to_body(&self) -> Bytes {
        let envelope = Envelope {
            error: Detail {
                message: &self.message,
                kind: self.kind,
                param: self.param,
                code: self.status.as_u16(),
            },
        };
        // Serialising plain strings and integers cannot fail.
        Bytes::from(serde_json::to_vec(&envelope).unwrap_or_default())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn body_has_vllm_error_shape() {
        let body: serde_json::Value =
            serde_json::from_slice(&ApiError::bad_request("bad \"x\"").to_body()).unwrap();
        assert_eq!(
            body,
            serde_json::json!({"error": {"message": "bad \"x\"", "type": "BadRequestError", "param": null, "code": 400}})
        );
        let body: serde_json::Value =
            serde_json::from_slice(&ApiError::model_not_found("gpt-4").to_body()).unwrap();
        assert_eq!(body["error"]["message"], "The model `gpt-4` does not exist.");
        assert_eq!(body["error"]["type"], "NotFoundError");
        assert_eq!(body["error"]["code"], 404);
    }
}
