//! The sidecar as the endpoint picker (EPP) of a Gateway API Inference Extension InferencePool:
//! the same picker as the admission path ([`crate::scheduling`]), spoken over the extension's
//! endpoint-picker protocol (`../shared/reference/gaie-endpoint-picker-protocol.md`) on a listener
//! of its own (`endpoint_pickers[].listen`), because Istio and Envoy Gateway configure that
//! ext_proc filter themselves (full-duplex streamed bodies, no initial metadata, no filter-state
//! attributes).
//!
//! - [`stream`]: the per-request state machine (no I/O);
//! - [`crate::scheduling::prompt`]: the raw body's prompt, hashed as the wasm filter hashes it;
//! - [`server`]: the tonic adapter and the gRPC health service the protocol asks for.

pub mod server;
pub mod stream;
