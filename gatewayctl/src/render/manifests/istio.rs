//! Istio kinds: EnvoyFilter, WasmPlugin, VirtualService, DestinationRule, Telemetry,
//! PeerAuthentication, AuthorizationPolicy.

use gateway_filter::config::RawConfig;
use serde::Serialize;

use super::{ComponentSelector, Empty, Kind, MatchLabels, Object, OrderedMap, PortNumber, Selector, Value};

/// An EnvoyFilter.
pub(crate) type EnvoyFilter = Object<EnvoyFilterSpec>;

/// An EnvoyFilter's `spec`: the patches, on the workloads with these labels.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct EnvoyFilterSpec {
    pub(crate) workload_selector: WorkloadSelector,
    pub(crate) config_patches: Vec<ConfigPatch>,
}

impl Kind for EnvoyFilterSpec {
    const API_VERSION: &'static str = "networking.istio.io/v1alpha3";
    const KIND: &'static str = "EnvoyFilter";
}

/// `workloadSelector`.
#[derive(Debug, Serialize)]
pub(crate) struct WorkloadSelector {
    pub(crate) labels: MatchLabels,
}

/// One `configPatches[]` entry.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct ConfigPatch {
    pub(crate) apply_to: &'static str,
    #[serde(rename = "match", skip_serializing_if = "Option::is_none")]
    pub(crate) matching: Option<PatchMatch>,
    pub(crate) patch: Patch,
}

/// What a patch applies to: the gateway's listeners, or a filter of their HTTP connection
/// manager.
#[derive(Debug, Serialize)]
pub(crate) struct PatchMatch {
    pub(crate) context: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) listener: Option<ListenerMatch>,
}

/// `listener.filterChain.filter`.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct ListenerMatch {
    pub(crate) filter_chain: FilterChainMatch,
}

/// `filterChain.filter`.
#[derive(Debug, Serialize)]
pub(crate) struct FilterChainMatch {
    pub(crate) filter: FilterMatch,
}

/// A network filter by name, and one of its HTTP filters (`subFilter`).
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct FilterMatch {
    pub(crate) name: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) sub_filter: Option<NamedFilter>,
}

/// `{name}`.
#[derive(Debug, Serialize)]
pub(crate) struct NamedFilter {
    pub(crate) name: String,
}

/// A patch: the operation and its value.
#[derive(Debug, Serialize)]
pub(crate) struct Patch {
    pub(crate) operation: &'static str,
    pub(crate) value: PatchValue,
}

/// What a patch merges or inserts.
#[derive(Debug, Serialize)]
#[serde(untagged)]
pub(crate) enum PatchValue {
    /// Merged into the listener.
    Listener(ListenerMerge),
    /// Merged into the HTTP connection manager.
    ConnectionManager(ConnectionManagerMerge),
    /// An ECDS extension config.
    ExtensionConfig(ExtensionConfig),
    /// An HTTP filter discovered over ECDS.
    DiscoveredFilter(DiscoveredFilter),
    /// An HTTP filter entry of the standalone bootstrap (envoy/filters/*.yaml).
    Filter(Value),
}

/// The listener's per-connection buffer.
#[derive(Debug, Serialize)]
pub(crate) struct ListenerMerge {
    pub(crate) per_connection_buffer_limit_bytes: u64,
}

/// The HTTP connection manager's access logs.
#[derive(Debug, Serialize)]
pub(crate) struct ConnectionManagerMerge {
    pub(crate) typed_config: AccessLogs,
}

/// `typed_config` with `access_log`.
#[derive(Debug, Serialize)]
pub(crate) struct AccessLogs {
    #[serde(rename = "@type")]
    pub(crate) type_url: &'static str,
    pub(crate) access_log: Vec<Value>,
}

/// An extension config: a name and its `typed_config`.
#[derive(Debug, Serialize)]
pub(crate) struct ExtensionConfig {
    pub(crate) name: &'static str,
    pub(crate) typed_config: Value,
}

/// An HTTP filter whose config comes over ECDS (from the ADS stream).
#[derive(Debug, Serialize)]
pub(crate) struct DiscoveredFilter {
    pub(crate) name: &'static str,
    pub(crate) config_discovery: ConfigDiscovery,
}

/// `config_discovery`.
#[derive(Debug, Serialize)]
pub(crate) struct ConfigDiscovery {
    pub(crate) config_source: AdsSource,
    pub(crate) type_urls: Vec<&'static str>,
}

/// `{ads: {}}`.
#[derive(Debug, Serialize)]
pub(crate) struct AdsSource {
    pub(crate) ads: Empty,
}

/// A WasmPlugin.
pub(crate) type WasmPlugin = Object<WasmPluginSpec>;

/// A WasmPlugin's `spec`.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct WasmPluginSpec {
    pub(crate) selector: Selector<MatchLabels>,
    pub(crate) url: String,
    pub(crate) sha256: String,
    pub(crate) image_pull_policy: &'static str,
    pub(crate) plugin_name: &'static str,
    pub(crate) phase: &'static str,
    pub(crate) fail_strategy: &'static str,
    #[serde(rename = "type")]
    pub(crate) kind: &'static str,
    pub(crate) plugin_config: RawConfig,
}

impl Kind for WasmPluginSpec {
    const API_VERSION: &'static str = "extensions.istio.io/v1alpha1";
    const KIND: &'static str = "WasmPlugin";
}

/// A VirtualService.
pub(crate) type VirtualService = Object<VirtualServiceSpec>;

/// A VirtualService's `spec`.
#[derive(Debug, Serialize)]
pub(crate) struct VirtualServiceSpec {
    pub(crate) hosts: Vec<String>,
    pub(crate) gateways: Vec<String>,
    pub(crate) http: Vec<HttpRoute>,
}

impl Kind for VirtualServiceSpec {
    const API_VERSION: &'static str = "networking.istio.io/v1";
    const KIND: &'static str = "VirtualService";
}

/// One `http[]` route: to a destination, or a direct response.
#[derive(Debug, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct HttpRoute {
    pub(crate) name: String,
    #[serde(rename = "match", skip_serializing_if = "Vec::is_empty")]
    pub(crate) matches: Vec<HttpMatch>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub(crate) route: Vec<RouteDestination>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) timeout: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) retries: Option<Retries>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) headers: Option<HeaderOperations>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) direct_response: Option<DirectResponse>,
}

/// Matches on the `x-gateway-pool` request header.
#[derive(Debug, Serialize)]
pub(crate) struct HttpMatch {
    pub(crate) headers: PoolHeader,
}

/// `{x-gateway-pool: {exact: <pool>}}`.
#[derive(Debug, Serialize)]
pub(crate) struct PoolHeader {
    #[serde(rename = "x-gateway-pool")]
    pub(crate) pool: ExactMatch,
}

/// `{exact}`.
#[derive(Debug, Serialize)]
pub(crate) struct ExactMatch {
    pub(crate) exact: String,
}

/// `{destination: {host, port: {number}}}`.
#[derive(Debug, Serialize)]
pub(crate) struct RouteDestination {
    pub(crate) destination: Destination,
}

/// A Service's host name and port.
#[derive(Debug, Serialize)]
pub(crate) struct Destination {
    pub(crate) host: String,
    pub(crate) port: PortNumber,
}

/// A route's retries.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Retries {
    pub(crate) attempts: u32,
    pub(crate) retry_on: String,
}

/// Response headers added.
#[derive(Debug, Serialize)]
pub(crate) struct HeaderOperations {
    pub(crate) response: AddHeaders,
}

/// `{add: {name: value}}`.
#[derive(Debug, Serialize)]
pub(crate) struct AddHeaders {
    pub(crate) add: OrderedMap<String>,
}

/// A direct response.
#[derive(Debug, Serialize)]
pub(crate) struct DirectResponse {
    pub(crate) status: u64,
    pub(crate) body: StringBody,
}

/// `{string}`.
#[derive(Debug, Serialize)]
pub(crate) struct StringBody {
    pub(crate) string: String,
}

/// A DestinationRule.
pub(crate) type DestinationRule = Object<DestinationRuleSpec>;

/// A DestinationRule's `spec`.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct DestinationRuleSpec {
    pub(crate) host: String,
    pub(crate) export_to: Vec<&'static str>,
    pub(crate) traffic_policy: TrafficPolicy,
}

impl Kind for DestinationRuleSpec {
    const API_VERSION: &'static str = "networking.istio.io/v1";
    const KIND: &'static str = "DestinationRule";
}

/// `trafficPolicy`.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct TrafficPolicy {
    pub(crate) load_balancer: LoadBalancer,
    pub(crate) connection_pool: ConnectionPool,
    pub(crate) outlier_detection: OutlierDetection,
}

/// `{simple}`.
#[derive(Debug, Serialize)]
pub(crate) struct LoadBalancer {
    pub(crate) simple: &'static str,
}

/// `connectionPool`.
#[derive(Debug, Serialize)]
pub(crate) struct ConnectionPool {
    pub(crate) tcp: TcpSettings,
    pub(crate) http: HttpSettings,
}

/// `connectionPool.tcp`.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct TcpSettings {
    pub(crate) max_connections: u32,
    pub(crate) connect_timeout: String,
}

/// `connectionPool.http`.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct HttpSettings {
    pub(crate) http1_max_pending_requests: u32,
    pub(crate) http2_max_requests: u32,
}

/// `outlierDetection`.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct OutlierDetection {
    #[serde(rename = "consecutive5xxErrors")]
    pub(crate) consecutive_5xx_errors: u32,
    pub(crate) interval: &'static str,
    pub(crate) base_ejection_time: String,
    pub(crate) max_ejection_percent: u32,
}

/// A Telemetry.
pub(crate) type Telemetry = Object<TelemetrySpec>;

/// A Telemetry's `spec`.
#[derive(Debug, Serialize)]
pub(crate) struct TelemetrySpec {
    pub(crate) selector: Selector<MatchLabels>,
    pub(crate) tracing: Vec<Tracing>,
}

impl Kind for TelemetrySpec {
    const API_VERSION: &'static str = "telemetry.istio.io/v1";
    const KIND: &'static str = "Telemetry";
}

/// One `tracing[]` entry.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Tracing {
    pub(crate) providers: Vec<NamedFilter>,
    pub(crate) random_sampling_percentage: f64,
}

/// A PeerAuthentication.
pub(crate) type PeerAuthentication = Object<PeerAuthenticationSpec>;

/// A PeerAuthentication's `spec`.
#[derive(Debug, Serialize)]
pub(crate) struct PeerAuthenticationSpec {
    pub(crate) selector: Selector<ComponentSelector>,
    pub(crate) mtls: MutualTls,
}

impl Kind for PeerAuthenticationSpec {
    const API_VERSION: &'static str = "security.istio.io/v1";
    const KIND: &'static str = "PeerAuthentication";
}

/// `{mode}`.
#[derive(Debug, Serialize)]
pub(crate) struct MutualTls {
    pub(crate) mode: &'static str,
}

/// An AuthorizationPolicy.
pub(crate) type AuthorizationPolicy = Object<AuthorizationPolicySpec>;

/// An AuthorizationPolicy's `spec`.
#[derive(Debug, Serialize)]
pub(crate) struct AuthorizationPolicySpec {
    pub(crate) selector: Selector<ComponentSelector>,
    pub(crate) action: &'static str,
    pub(crate) rules: Vec<Rule>,
}

impl Kind for AuthorizationPolicySpec {
    const API_VERSION: &'static str = "security.istio.io/v1";
    const KIND: &'static str = "AuthorizationPolicy";
}

/// One rule: from these principals (any, when absent) to these ports.
#[derive(Debug, Serialize)]
pub(crate) struct Rule {
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub(crate) from: Vec<RuleFrom>,
    pub(crate) to: Vec<RuleTo>,
}

/// `{source: {principals}}`.
#[derive(Debug, Serialize)]
pub(crate) struct RuleFrom {
    pub(crate) source: Principals,
}

/// `{principals}`.
#[derive(Debug, Serialize)]
pub(crate) struct Principals {
    pub(crate) principals: Vec<String>,
}

/// `{operation: {ports}}`.
#[derive(Debug, Serialize)]
pub(crate) struct RuleTo {
    pub(crate) operation: Ports,
}

/// `{ports}` (strings).
#[derive(Debug, Serialize)]
pub(crate) struct Ports {
    pub(crate) ports: Vec<String>,
}
