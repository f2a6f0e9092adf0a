//! Istio: the EnvoyFilter that adds the gateway's filters to an ingress gateway (and the
//! WasmPlugin when `istio.wasm_delivery` is `wasm_plugin`), the VirtualService routing the
//! filter's `x-gateway-pool` header to the pools' Services, and a DestinationRule per pool.
//!
//! The filter definitions are the standalone bootstrap's (envoy/filters/*.yaml), with the
//! module fetched from `filter.module` and the sidecar reached through Istio's outbound cluster
//! of its Service.

use gateway_filter::config::RawConfig;

use crate::config::{FieldError, IstioSection, KubernetesSection, Loaded, WasmDelivery, WasmModule};
use crate::template::{self, Values};
use crate::tree::{at_mut, to_json, to_tree, Key, Value};

use super::envoy_config::RemoteCode;
use super::kubernetes::{self, SIDECAR_NAME};
use super::manifests::istio::{
    AccessLogs, AddHeaders, AdsSource, AuthorizationPolicy, AuthorizationPolicySpec, ConfigDiscovery,
    ConfigPatch, ConnectionManagerMerge, ConnectionPool, Destination, DestinationRule, DestinationRuleSpec,
    DirectResponse, DiscoveredFilter, EnvoyFilter, EnvoyFilterSpec, ExactMatch, ExtensionConfig,
    FilterChainMatch, FilterMatch, HeaderOperations, HttpMatch, HttpRoute, HttpSettings, ListenerMatch,
    ListenerMerge, LoadBalancer, MutualTls, NamedFilter, OutlierDetection, Patch, PatchMatch, PatchValue,
    PeerAuthentication, PeerAuthenticationSpec, PoolHeader, Ports, Principals, Retries, RouteDestination,
    Rule, RuleFrom, RuleTo, StringBody, TcpSettings, Telemetry, TelemetrySpec, Tracing, TrafficPolicy,
    VirtualService, VirtualServiceSpec, WasmPlugin, WasmPluginSpec, WorkloadSelector,
};
use super::manifests::{ComponentSelector, Empty, ObjectMeta, PortNumber, Selector};
use super::standalone::duration;
use super::{module, pool_service, ratelimit_headers, Error, File};

/// The HTTP filter name of the wasm filter (and of its ECDS extension config).
const WASM_FILTER_NAME: &str = "llm_gateway.filter";
const WASM_TYPE_URL: &str = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm";
const HCM: &str = "envoy.filters.network.http_connection_manager";
const HCM_TYPE: &str =
    "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager";
const ROUTER: &str = "envoy.filters.http.router";
/// The gateway's objects' `app.kubernetes.io/name`.
const COMPONENT: &str = "llm-gateway";

fn section(loaded: &Loaded) -> Result<&IstioSection, Error> {
    loaded.config.istio.as_ref().ok_or_else(|| {
        FieldError::new("istio", "required by the istio target (ingress gateway selector and Gateways)")
            .into()
    })
}

/// The names a WasmPlugin's filter has in the gateway's HTTP filter chain, by Istio release:
/// up to 1.25 (with Istio's typo), 1.26 to 1.29, and 1.30 on (translated to a
/// TrafficExtension). An EnvoyFilter patch anchored on a name that does not exist is a no-op,
/// so one patch per name inserts the filter exactly once.
fn wasm_plugin_filter_names(namespace: &str, name: &str) -> [String; 3] {
    [
        format!("extenstions.istio.io/wasmplugin/{namespace}.{name}"),
        format!("extensions.istio.io/wasmplugin/{namespace}.{name}"),
        format!("extensions.istio.io/trafficextension/{namespace}.{name}~istio-translated-wasmplugin"),
    ]
}

/// A patch of the gateway's listeners: `listener` names the network filter (and its HTTP filter)
/// it applies to, none for the listener itself.
fn gateway_patch(
    apply_to: &'static str,
    listener: Option<FilterMatch>,
    operation: &'static str,
    value: PatchValue,
) -> ConfigPatch {
    let listener = listener.map(|filter| ListenerMatch { filter_chain: FilterChainMatch { filter } });
    ConfigPatch {
        apply_to,
        matching: Some(PatchMatch { context: "GATEWAY", listener }),
        patch: Patch { operation, value },
    }
}

/// An HTTP filter inserted before or after the HTTP filter `anchor`.
fn http_filter_patch(operation: &'static str, anchor: &str, value: Value) -> ConfigPatch {
    let filter = FilterMatch { name: HCM, sub_filter: Some(NamedFilter { name: anchor.to_owned() }) };
    gateway_patch("HTTP_FILTER", Some(filter), operation, PatchValue::Filter(value))
}

/// The sidecar in the mesh: a PeerAuthentication that makes its pods accept only Istio mTLS
/// (`STRICT`), and an AuthorizationPolicy that lets only the ingress gateway's principals call its
/// gRPC port and endpoint-picker ports (the metrics port, if any, stays open to the mesh). The
/// mesh's mTLS stands in for the sidecar's own `tls` on this target: its namespace must have
/// sidecar injection
/// (the rendered Namespace is labelled `istio-injection: enabled`).
fn sidecar_mesh_policies(loaded: &Loaded, istio: &IstioSection, namespace: &str) -> Result<Vec<File>, Error> {
    let c = &loaded.config;
    let selector = || Selector::matching(ComponentSelector::new(SIDECAR_NAME));
    let metadata = ObjectMeta::new(SIDECAR_NAME, namespace, SIDECAR_NAME);
    let peer = PeerAuthentication::new(
        metadata.clone(),
        PeerAuthenticationSpec { selector: selector(), mtls: MutualTls { mode: "STRICT" } },
    );
    let port = |p: u16| RuleTo { operation: Ports { ports: vec![p.to_string()] } };
    // The gateway calls the gRPC port (admission, access log, leases) and, for an InferencePool,
    // its pool's endpoint-picker port.
    let mut to = vec![port(kubernetes::sidecar_port(loaded))];
    to.extend(kubernetes::endpoint_pickers(loaded)?.iter().map(|epp| port(epp.port)));
    let from = vec![RuleFrom { source: Principals { principals: istio.principals() } }];
    let mut rules = vec![Rule { from, to }];
    if let Some(metrics) = c.sidecar.metrics_listen {
        rules.push(Rule { from: Vec::new(), to: vec![port(metrics.port())] });
    }
    let authz = AuthorizationPolicy::new(
        metadata,
        AuthorizationPolicySpec { selector: selector(), action: "ALLOW", rules },
    );
    Ok(vec![
        File::yaml("istio/sidecar-peerauthentication.yaml", &peer)?,
        File::yaml("istio/sidecar-authorizationpolicy.yaml", &authz)?,
    ])
}

/// Every manifest under `istio/` (and `kubernetes/`).
///
/// # Errors
/// A section or field the istio target needs, or a component rejecting its rendered config.
pub fn manifests(loaded: &Loaded, filter_config: &RawConfig) -> Result<Vec<File>, Error> {
    let istio = section(loaded)?;
    let k8s = kubernetes::section(loaded, "istio")?;
    let module = module(loaded, "istio")?;
    let mut files = kubernetes::manifests(loaded, "istio")?;
    files.extend(envoy_filter(loaded, istio, k8s, module, filter_config)?);
    if let Some(t) = &loaded.config.tracing {
        let provider = t.istio_provider.as_deref().ok_or_else(|| {
            FieldError::new(
                "tracing.istio_provider",
                "needed by the istio target: the name of the OpenTelemetry extensionProviders entry of Istio's MeshConfig",
            )
        })?;
        // Istio configures the ingress gateway's tracer itself, from the OpenTelemetry collector
        // named in its MeshConfig's `extensionProviders`; this turns it on for the gateway's pods.
        // Envoy then passes `traceparent` to vLLM and to the sidecar, which exports its admission
        // spans to the collector named by tracing.otlp_endpoint.
        let telemetry = Telemetry::new(
            ObjectMeta::new("llm-gateway-tracing", &istio.namespace, COMPONENT),
            TelemetrySpec {
                selector: Selector::matching(istio.selector.clone()),
                tracing: vec![Tracing {
                    providers: vec![NamedFilter { name: provider.to_owned() }],
                    random_sampling_percentage: t.sampling_percent,
                }],
            },
        );
        files.push(File::yaml("istio/telemetry.yaml", &telemetry)?);
    }
    files.extend(routes(loaded, istio, k8s)?);
    files.extend(sidecar_mesh_policies(loaded, istio, &k8s.namespace)?);
    files.extend(super::inference_pools(loaded, "istio", "istio")?);
    let istio_files: Vec<File> = files.iter().filter(|f| f.path.starts_with("istio/")).cloned().collect();
    files.push(kubernetes::kustomization("istio", &istio_files)?);
    Ok(files)
}

/// A filter definition of the standalone bootstrap with the sidecar's cluster at `path` set to
/// Istio's outbound cluster of the sidecar's Service.
fn to_sidecar(
    template: template::Template,
    values: &Values,
    path: &[&str],
    cluster: &str,
) -> Result<Value, Error> {
    let mut rendered = template::render(template, values)?;
    let keys: Vec<Key<'_>> = path.iter().map(|k| Key::from(*k)).collect();
    let target = at_mut(&mut rendered, &keys)
        .ok_or_else(|| Error::Internal(format!("{}: no envoy_grpc cluster_name", template.path)))?;
    *target = Value::String(cluster.to_owned());
    Ok(rendered)
}

/// The EnvoyFilter that adds the gateway's filters to the ingress gateway, just before the
/// router: the wasm filter, then the admission ext_proc filter and the RBAC guard, with the
/// metering access log merged into the HTTP connection manager. With `wasm_delivery:
/// envoy_filter` (the default) the wasm filter is an ECDS extension config (EXTENSION_CONFIG
/// patch; istio-agent fetches and verifies the module), because only there can
/// `allow_on_headers_stop_iteration` be set, which the filter needs to buffer the body; with
/// `wasm_plugin` the WasmPlugin (returned first) delivers it and the patches insert the admission
/// filter after it.
fn envoy_filter(
    loaded: &Loaded,
    istio: &IstioSection,
    k8s: &KubernetesSection,
    module: &WasmModule,
    filter_config: &RawConfig,
) -> Result<Vec<File>, Error> {
    let max_body =
        loaded.config.filter.max_body_bytes.unwrap_or(gateway_filter::config::DEFAULT_MAX_BODY_BYTES);
    let sidecar_cluster = format!(
        "outbound|{}||{SIDECAR_NAME}.{}.svc.cluster.local",
        kubernetes::sidecar_port(loaded),
        k8s.namespace
    );
    let filter_config = super::with_admission_leases(loaded, filter_config, &sidecar_cluster);
    let values = Values::new()
        .set("FILTER_CONFIG_JSON", to_json(&filter_config).map_err(Error::Internal)?)
        .set("WASM_PATH", "/unused.wasm");
    let grpc_cluster = ["grpc_service", "envoy_grpc", "cluster_name"];
    let admission_path = [&["typed_config"][..], &grpc_cluster].concat();
    let admission = to_sidecar(template::FILTER_ADMISSION, &values, &admission_path, &sidecar_cluster)?;
    let admission = super::admission_filter(loaded, admission)?;
    // Metering: the gRPC access log, merged into the gateway's HTTP connection manager.
    let log_path = [&["typed_config", "common_config"][..], &grpc_cluster].concat();
    let access_log = to_sidecar(template::ACCESS_LOG_METERING, &values, &log_path, &sidecar_cluster)?;
    // The RBAC guard just before the router: nothing reaches a pool without the wasm filter's
    // facts and an admission (envoy/filters/guard.yaml).
    let guard = template::render(template::FILTER_GUARD, &values)?;

    // The filter buffers the body: the listener's buffer must exceed the body limit.
    let listener = ListenerMerge { per_connection_buffer_limit_bytes: max_body.saturating_add(1 << 20) };
    let hcm = ConnectionManagerMerge {
        typed_config: AccessLogs { type_url: HCM_TYPE, access_log: vec![access_log] },
    };
    let mut patches = vec![
        gateway_patch("LISTENER", None, "MERGE", PatchValue::Listener(listener)),
        gateway_patch(
            "NETWORK_FILTER",
            Some(FilterMatch { name: HCM, sub_filter: None }),
            "MERGE",
            PatchValue::ConnectionManager(hcm),
        ),
    ];
    let mut files = Vec::new();
    match istio.wasm_delivery {
        WasmDelivery::EnvoyFilter => {
            // Each INSERT_BEFORE the router lands after the previous one: wasm, admission,
            // guard, router.
            patches.extend(ecds_wasm_patches(&values, module)?);
            patches.push(http_filter_patch("INSERT_BEFORE", ROUTER, admission));
            patches.push(http_filter_patch("INSERT_BEFORE", ROUTER, guard));
        }
        WasmDelivery::WasmPlugin => {
            for anchor in wasm_plugin_filter_names(&istio.namespace, "llm-gateway") {
                patches.push(http_filter_patch("INSERT_AFTER", &anchor, admission.clone()));
            }
            // Anchored on the router, not on the plugin: it applies even where the WasmPlugin
            // (and so the admission anchored on it) is missing, and then refuses every request.
            patches.push(http_filter_patch("INSERT_BEFORE", ROUTER, guard));
            files.push(File::yaml("istio/wasmplugin.yaml", &wasm_plugin(istio, module, filter_config))?);
        }
    }
    let envoy_filter = EnvoyFilter::new(
        ObjectMeta::new("llm-gateway", &istio.namespace, COMPONENT),
        EnvoyFilterSpec {
            workload_selector: WorkloadSelector { labels: istio.selector.clone() },
            config_patches: patches,
        },
    );
    files.push(File::yaml("istio/envoyfilter.yaml", &envoy_filter)?);
    Ok(files)
}

/// The wasm filter over ECDS: its extension config (envoy/filters/wasm.yaml's, the module fetched
/// from `module`), and the HTTP filter inserted before the router that names it.
fn ecds_wasm_patches(values: &Values, module: &WasmModule) -> Result<[ConfigPatch; 2], Error> {
    let mut wasm = template::render(template::FILTER_WASM, values)?;
    let code =
        at_mut(&mut wasm, &["typed_config".into(), "config".into(), "vm_config".into(), "code".into()])
            .ok_or_else(|| Error::Internal("envoy/filters/wasm.yaml: no code".into()))?;
    *code = to_tree(&RemoteCode::new(&module.url, module.sha256.as_deref())).map_err(Error::Internal)?;
    let typed_config = wasm
        .get("typed_config")
        .cloned()
        .ok_or_else(|| Error::Internal("envoy/filters/wasm.yaml: no typed_config".into()))?;
    let extension = ExtensionConfig { name: WASM_FILTER_NAME, typed_config };
    let discovered = DiscoveredFilter {
        name: WASM_FILTER_NAME,
        config_discovery: ConfigDiscovery {
            config_source: AdsSource { ads: Empty {} },
            type_urls: vec![WASM_TYPE_URL],
        },
    };
    let router = FilterMatch { name: HCM, sub_filter: Some(NamedFilter { name: ROUTER.to_owned() }) };
    Ok([
        ConfigPatch {
            apply_to: "EXTENSION_CONFIG",
            matching: None,
            patch: Patch { operation: "ADD", value: PatchValue::ExtensionConfig(extension) },
        },
        gateway_patch("HTTP_FILTER", Some(router), "INSERT_BEFORE", PatchValue::DiscoveredFilter(discovered)),
    ])
}

/// The wasm filter as an Istio WasmPlugin (`wasm_delivery: wasm_plugin`). WasmPlugin has no field
/// for `allow_on_headers_stop_iteration`, and without it Envoy never hands the request body to a
/// filter that pauses in the request headers, so requests hang: see docs/deploy.md before using
/// it. As envoy/filters/wasm.yaml's `failure_policy`, a failed VM fails its requests (503) and is
/// recreated (`FAIL_RELOAD`).
fn wasm_plugin(istio: &IstioSection, module: &WasmModule, filter_config: RawConfig) -> WasmPlugin {
    let url = if module.url.starts_with("oci://")
        || module.url.starts_with("http://")
        || module.url.starts_with("https://")
    {
        module.url.clone()
    } else {
        format!("oci://{}", module.url)
    };
    WasmPlugin::new(
        ObjectMeta::new("llm-gateway", &istio.namespace, COMPONENT),
        WasmPluginSpec {
            selector: Selector::matching(istio.selector.clone()),
            url,
            sha256: module.sha256.clone().unwrap_or_default(),
            image_pull_policy: "IfNotPresent",
            plugin_name: "llm_gateway",
            phase: "AUTHN",
            fail_strategy: "FAIL_RELOAD",
            kind: "HTTP",
            plugin_config: filter_config,
        },
    )
}

/// The VirtualService and one DestinationRule per pool. The VirtualService routes on the
/// x-gateway-pool header that the wasm filter sets (it clears the route cache after setting it)
/// to each pool's Service, adds OpenAI's x-ratelimit-* response headers from the admission
/// filter's dynamic metadata, and disables the route timeout for streamed completions.
fn routes(loaded: &Loaded, istio: &IstioSection, k8s: &KubernetesSection) -> Result<Vec<File>, Error> {
    let retry_on = super::standalone::fallback_retry_on()?;
    let mut routes = Vec::new();
    let mut files = Vec::new();
    for (i, pool) in loaded.config.pools.iter().enumerate() {
        let service = pool_service(i, pool, "istio")?;
        let label = crate::config::pool_label(&pool.name);
        routes.push(HttpRoute {
            name: label.clone(),
            matches: vec![HttpMatch {
                headers: PoolHeader { pool: ExactMatch { exact: pool.name.clone() } },
            }],
            route: vec![RouteDestination {
                destination: Destination { host: service.fqdn(), port: PortNumber { number: service.port } },
            }],
            timeout: Some("0s"),
            retries: Some(Retries { attempts: 1, retry_on: retry_on.clone() }),
            headers: Some(HeaderOperations { response: AddHeaders { add: ratelimit_headers() } }),
            direct_response: None,
        });
        files.push(File::yaml(
            &format!("istio/destinationrule-{label}.yaml"),
            &destination_rule(istio, pool, &label, service.fqdn()),
        )?);
    }
    // Every request that passes the filter carries x-gateway-pool; the filter answers the rest
    // itself. The default route reaches no pool: it answers the standalone bootstrap's 404.
    let (status, body) = super::standalone::not_routed_response()?;
    routes.push(HttpRoute {
        name: "not-routed".to_owned(),
        direct_response: Some(DirectResponse { status, body: StringBody { string: body } }),
        ..HttpRoute::default()
    });
    let virtual_service = VirtualService::new(
        ObjectMeta::new("llm-gateway", &k8s.namespace, COMPONENT),
        VirtualServiceSpec { hosts: istio.hosts.clone(), gateways: istio.gateways.clone(), http: routes },
    );
    files.push(File::yaml("istio/virtualservice.yaml", &virtual_service)?);
    Ok(files)
}

/// One pool's traffic policy for the ingress gateway: least-request balancing, the pool's circuit
/// breakers and outlier detection (Istio has no active health check; Kubernetes readiness on the
/// vLLM pods plays that part). Exported only to this namespace, so that it applies to the gateway
/// and overrides nothing the pool's owners set for other clients.
fn destination_rule(
    istio: &IstioSection,
    pool: &crate::config::PoolSection,
    label: &str,
    host: String,
) -> DestinationRule {
    let (cb, od) = (&pool.circuit_breakers, &pool.outlier_detection);
    DestinationRule::new(
        ObjectMeta::new(format!("llm-gateway-{label}"), &istio.namespace, COMPONENT),
        DestinationRuleSpec {
            host,
            export_to: vec!["."],
            traffic_policy: TrafficPolicy {
                load_balancer: LoadBalancer { simple: "LEAST_REQUEST" },
                connection_pool: ConnectionPool {
                    tcp: TcpSettings {
                        max_connections: cb.max_connections,
                        connect_timeout: duration(pool.connect_timeout_ms),
                    },
                    http: HttpSettings {
                        http1_max_pending_requests: cb.max_pending_requests,
                        http2_max_requests: cb.max_requests,
                    },
                },
                outlier_detection: OutlierDetection {
                    consecutive_5xx_errors: od.consecutive_5xx,
                    interval: "10s",
                    base_ejection_time: duration(od.base_ejection_time_ms),
                    max_ejection_percent: od.max_ejection_percent,
                },
            },
        },
    )
}
