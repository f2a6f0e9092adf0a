//! Envoy Gateway kinds: EnvoyExtensionPolicy, EnvoyPatchPolicy, EnvoyProxy.

use gateway_filter::config::RawConfig;
use serde::Serialize;

use super::gateway_api::BackendRef;
use super::{Empty, Kind, Object, TypedRef, Value};

/// An EnvoyExtensionPolicy.
pub(crate) type EnvoyExtensionPolicy = Object<EnvoyExtensionPolicySpec>;

/// An EnvoyExtensionPolicy's `spec`: its targets, wasm filters and ext_proc filters.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct EnvoyExtensionPolicySpec {
    pub(crate) target_refs: Vec<TypedRef>,
    pub(crate) wasm: Vec<Wasm>,
    pub(crate) ext_proc: Vec<ExtProc>,
}

impl Kind for EnvoyExtensionPolicySpec {
    const API_VERSION: &'static str = "gateway.envoyproxy.io/v1alpha1";
    const KIND: &'static str = "EnvoyExtensionPolicy";
}

/// One wasm filter: its module and its plugin config.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Wasm {
    pub(crate) name: &'static str,
    #[serde(rename = "rootID")]
    pub(crate) root_id: &'static str,
    pub(crate) fail_open: bool,
    pub(crate) code: WasmCode,
    pub(crate) config: RawConfig,
}

/// Where the module comes from: an OCI image or an HTTP URL.
#[derive(Debug, Serialize)]
pub(crate) struct WasmCode {
    #[serde(rename = "type")]
    pub(crate) kind: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) image: Option<WasmSource>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) http: Option<WasmSource>,
}

/// `{url, sha256}`.
#[derive(Debug, Serialize)]
pub(crate) struct WasmSource {
    pub(crate) url: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) sha256: Option<String>,
}

/// One ext_proc filter.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct ExtProc {
    pub(crate) backend_refs: Vec<BackendRef>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) shadow_mode: Option<bool>,
    pub(crate) processing_mode: ProcessingMode,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) message_timeout: Option<&'static str>,
    pub(crate) fail_open: bool,
    pub(crate) metadata: ExtProcMetadata,
}

/// What is sent to the processor.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct ProcessingMode {
    pub(crate) request: Empty,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) response: Option<ResponseMode>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) allow_mode_override: Option<bool>,
}

/// `{body}`.
#[derive(Debug, Serialize)]
pub(crate) struct ResponseMode {
    pub(crate) body: &'static str,
}

/// The dynamic metadata namespaces the processor writes or reads.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct ExtProcMetadata {
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub(crate) writable_namespaces: Vec<&'static str>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub(crate) accessible_namespaces: Vec<&'static str>,
}

/// An EnvoyPatchPolicy.
pub(crate) type EnvoyPatchPolicy = Object<EnvoyPatchPolicySpec>;

/// An EnvoyPatchPolicy's `spec`: JSON patches on a Gateway's xDS.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct EnvoyPatchPolicySpec {
    pub(crate) target_ref: TypedRef,
    #[serde(rename = "type")]
    pub(crate) kind: &'static str,
    pub(crate) json_patches: Vec<JsonPatch>,
}

impl Kind for EnvoyPatchPolicySpec {
    const API_VERSION: &'static str = "gateway.envoyproxy.io/v1alpha1";
    const KIND: &'static str = "EnvoyPatchPolicy";
}

/// One JSON patch of an xDS resource.
#[derive(Debug, Serialize)]
pub(crate) struct JsonPatch {
    #[serde(rename = "type")]
    pub(crate) type_url: &'static str,
    pub(crate) name: String,
    pub(crate) operation: JsonPatchOperation,
}

/// `{op, jsonPath, path, value}`.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct JsonPatchOperation {
    pub(crate) op: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) json_path: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) path: Option<&'static str>,
    pub(crate) value: Value,
}

/// An EnvoyProxy.
pub(crate) type EnvoyProxy = Object<EnvoyProxySpec>;

/// An EnvoyProxy's `spec`.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct EnvoyProxySpec {
    pub(crate) logging: ProxyLogging,
    pub(crate) filter_order: Vec<FilterOrder>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) telemetry: Option<ProxyTelemetry>,
}

impl Kind for EnvoyProxySpec {
    const API_VERSION: &'static str = "gateway.envoyproxy.io/v1alpha1";
    const KIND: &'static str = "EnvoyProxy";
}

/// `{level}`.
#[derive(Debug, Serialize)]
pub(crate) struct ProxyLogging {
    pub(crate) level: LogLevels,
}

/// The default log level and the levels of Envoy's `http` and `http2` loggers.
#[derive(Debug, Serialize)]
pub(crate) struct LogLevels {
    pub(crate) default: &'static str,
    pub(crate) http: &'static str,
    pub(crate) http2: &'static str,
}

/// One filter placed before another.
#[derive(Debug, Serialize)]
pub(crate) struct FilterOrder {
    pub(crate) name: &'static str,
    pub(crate) before: &'static str,
}

/// `{tracing}`.
#[derive(Debug, Serialize)]
pub(crate) struct ProxyTelemetry {
    pub(crate) tracing: ProxyTracing,
}

/// The proxy's tracer.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct ProxyTracing {
    pub(crate) sampling_fraction: Fraction,
    pub(crate) provider: TracingProvider,
}

/// `{numerator, denominator}`.
#[derive(Debug, Serialize)]
pub(crate) struct Fraction {
    pub(crate) numerator: u64,
    pub(crate) denominator: u64,
}

/// An OpenTelemetry collector.
#[derive(Debug, Serialize)]
pub(crate) struct TracingProvider {
    #[serde(rename = "type")]
    pub(crate) kind: &'static str,
    pub(crate) host: String,
    pub(crate) port: u16,
}
