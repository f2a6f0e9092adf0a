//! `gateway-filter`: the proxy-wasm HTTP filter of the LLM inference gateway (Envoy, V8 runtime).
//!
//! Per request it removes client-sent `x-gateway-*` headers, authenticates the API key against
//! SHA-256 digests, validates the OpenAI request body, resolves the model to an Envoy cluster,
//! rejects requests whose prompt provably exceeds the model's context window, and hands routing and
//! metering data to Envoy and the sidecar in `x-gateway-*` request headers (see [`pipeline`] for
//! the header contract and [`error`] for the error replies).
//!
//! All decisions are pure, host-testable code; [`driver`] holds the request/response sequence
//! both hosts run, and [`wasm`] (wasm32 only) binds it to proxy-wasm 0.2.5 (`filter-native`
//! binds it to Envoy's dynamic-module C ABI).

pub mod auth;
pub mod config;
pub mod context;
pub mod driver;
pub mod error;
pub mod json_scan;
pub mod lease;
pub mod pipeline;
pub mod prefix;
pub mod request;
pub mod routing;
pub mod sse;
pub mod uploads;

/// Protobuf messages of `proto/llm_gateway/v1/lease.proto` (the filter's lease calls).
#[allow(missing_docs, clippy::all)]
pub mod proto {
    include!(concat!(env!("OUT_DIR"), "/llm_gateway.v1.rs"));
}

#[cfg(target_arch = "wasm32")]
pub mod wasm;
