//! Istio: the EnvoyFilter that adds the gateway's filters to an ingress gateway (and the
//! WasmPlugin when `istio.wasm_delivery` is `wasm_plugin`), the VirtualService routing the
//! filter's `x-gateway-pool` header to the pools' Services, and a DestinationRule per pool.
//!
//! The filter definitions are the standalone bootstrap's (envoy/filters/*.yaml), with the
//! module fetched from `filter.module` and the sidecar reached through Istio's outbound cluster
//! of its Service.

use crate::config::{FieldError, IstioSection, Loaded, WasmDelivery};
use crate::template::{self, Values};
use crate::tree::{at_mut, f, map, n, s, seq, strings, to_json, Value};

use super::kubernetes::{self, SIDECAR_NAME};
use super::standalone::duration;
use super::{module, pool_service, ratelimit_headers, Error, File};

/// The HTTP filter name of the wasm filter (and of its ECDS extension config).
const WASM_FILTER_NAME: &str = "llm_gateway.filter";
/// Name of the admission filter in envoy/filters/ext_proc_admission.yaml.
const WASM_TYPE_URL: &str = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm";
const HCM: &str = "envoy.filters.network.http_connection_manager";
const HCM_TYPE: &str =
    "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager";
const ROUTER: &str = "envoy.filters.http.router";

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

fn http_filter_patch(operation: &str, anchor: &str, value: Value) -> Value {
    map([
        ("applyTo", s("HTTP_FILTER")),
        (
            "match",
            map([
                ("context", s("GATEWAY")),
                (
                    "listener",
                    map([(
                        "filterChain",
                        map([("filter", map([("name", s(HCM)), ("subFilter", map([("name", s(anchor))]))]))]),
                    )]),
                ),
            ]),
        ),
        ("patch", map([("operation", s(operation)), ("value", value)])),
    ])
}

/// The sidecar in the mesh: a PeerAuthentication that makes its pods accept only Istio mTLS
/// (`STRICT`), and an AuthorizationPolicy that lets only the ingress gateway's principals call its
/// gRPC port and endpoint-picker ports (the metrics port, if any, stays open to the mesh). The
/// mesh's mTLS stands in for the sidecar's own `tls` on this target: its namespace must have
/// sidecar injection
/// (the rendered Namespace is labelled `istio-injection: enabled`).
fn sidecar_mesh_policies(loaded: &Loaded, istio: &IstioSection, namespace: &str) -> Result<Vec<File>, Error> {
    let c = &loaded.config;
    let selector = map([("matchLabels", map([("app.kubernetes.io/name", s(SIDECAR_NAME))]))]);
    let metadata = map([
        ("name", s(SIDECAR_NAME)),
        ("namespace", s(namespace)),
        ("labels", kubernetes::labels(SIDECAR_NAME)),
    ]);
    let peer = map([
        ("apiVersion", s("security.istio.io/v1")),
        ("kind", s("PeerAuthentication")),
        ("metadata", metadata.clone()),
        ("spec", map([("selector", selector.clone()), ("mtls", map([("mode", s("STRICT"))]))])),
    ]);
    let port = |p: u16| map([("operation", map([("ports", strings([p.to_string()]))]))]);
    // The gateway calls the gRPC port (admission, access log, leases) and, for an InferencePool,
    // its pool's endpoint-picker port.
    let mut to = vec![port(kubernetes::sidecar_port(loaded))];
    to.extend(kubernetes::endpoint_pickers(loaded)?.iter().map(|epp| port(epp.port)));
    let mut rules = vec![map([
        ("from", seq([map([("source", map([("principals", strings(istio.principals()))]))])])),
        ("to", seq(to)),
    ])];
    if let Some(metrics) = c.sidecar.metrics_listen {
        rules.push(map([("to", seq([port(metrics.port())]))]));
    }
    let authz = map([
        ("apiVersion", s("security.istio.io/v1")),
        ("kind", s("AuthorizationPolicy")),
        ("metadata", metadata),
        ("spec", map([("selector", selector), ("action", s("ALLOW")), ("rules", seq(rules))])),
    ]);
    Ok(vec![
        File::yaml("istio/sidecar-peerauthentication.yaml", &peer)?,
        File::yaml("istio/sidecar-authorizationpolicy.yaml", &authz)?,
    ])
}

/// Every manifest under `istio/` (and `kubernetes/`).
///
/// # Errors
/// A section or field the istio target needs, or a component rejecting its rendered config.
pub fn manifests(loaded: &Loaded, filter_config: &Value) -> Result<Vec<File>, Error> {
    let c = &loaded.config;
    let istio = section(loaded)?;
    let k8s = kubernetes::section(loaded, "istio")?;
    let module = module(loaded, "istio")?;
    let mut files = kubernetes::manifests(loaded, "istio")?;

    let labels = kubernetes::labels("llm-gateway");
    let selector = map(istio.selector.iter().map(|(k, v)| (k.clone(), s(v))));
    let max_body = c.filter.max_body_bytes.unwrap_or(gateway_filter::config::DEFAULT_MAX_BODY_BYTES);
    let sidecar_cluster = format!(
        "outbound|{}||{SIDECAR_NAME}.{}.svc.cluster.local",
        kubernetes::sidecar_port(loaded),
        k8s.namespace
    );
    let filter_config = &super::with_admission_leases(loaded, filter_config, &sidecar_cluster);
    let filter_json = to_json(filter_config).map_err(Error::Internal)?;
    let values = Values::new()
        .set("FILTER_CONFIG_JSON", filter_json.as_str())
        .set("WASM_PATH", "/unused.wasm")
        .set("NAMESPACE", istio.namespace.as_str())
        .set("LABELS", labels.clone())
        .set("SELECTOR", selector.clone());

    let mut admission = template::render(template::FILTER_ADMISSION, &values)?;
    let cluster = at_mut(
        &mut admission,
        &["typed_config".into(), "grpc_service".into(), "envoy_grpc".into(), "cluster_name".into()],
    )
    .ok_or_else(|| {
        Error::Internal(format!("{}: no envoy_grpc cluster_name", template::FILTER_ADMISSION.path))
    })?;
    *cluster = s(&sidecar_cluster);
    let admission = super::admission_filter(loaded, admission)?;
    // Metering: the gRPC access log, merged into the gateway's HTTP connection manager.
    let mut access_log = template::render(template::ACCESS_LOG_METERING, &values)?;
    let cluster = at_mut(
        &mut access_log,
        &[
            "typed_config".into(),
            "common_config".into(),
            "grpc_service".into(),
            "envoy_grpc".into(),
            "cluster_name".into(),
        ],
    )
    .ok_or_else(|| {
        Error::Internal(format!("{}: no envoy_grpc cluster_name", template::ACCESS_LOG_METERING.path))
    })?;
    *cluster = s(&sidecar_cluster);

    // The RBAC guard just before the router: nothing reaches a pool without the wasm filter's
    // facts and an admission (envoy/filters/guard.yaml).
    let guard = template::render(template::FILTER_GUARD, &values)?;

    // The filter buffers the body: the listener's buffer must exceed the body limit.
    let mut patches = vec![
        map([
            ("applyTo", s("LISTENER")),
            ("match", map([("context", s("GATEWAY"))])),
            (
                "patch",
                map([
                    ("operation", s("MERGE")),
                    (
                        "value",
                        map([("per_connection_buffer_limit_bytes", n(max_body.saturating_add(1 << 20)))]),
                    ),
                ]),
            ),
        ]),
        map([
            ("applyTo", s("NETWORK_FILTER")),
            (
                "match",
                map([
                    ("context", s("GATEWAY")),
                    ("listener", map([("filterChain", map([("filter", map([("name", s(HCM))]))]))])),
                ]),
            ),
            (
                "patch",
                map([
                    ("operation", s("MERGE")),
                    (
                        "value",
                        map([(
                            "typed_config",
                            map([("@type", s(HCM_TYPE)), ("access_log", seq([access_log]))]),
                        )]),
                    ),
                ]),
            ),
        ]),
    ];
    match istio.wasm_delivery {
        WasmDelivery::EnvoyFilter => {
            let mut wasm = template::render(template::FILTER_WASM, &values)?;
            let config = at_mut(&mut wasm, &["typed_config".into(), "config".into()])
                .ok_or_else(|| Error::Internal("envoy/filters/wasm.yaml: no config".into()))?;
            let code = at_mut(config, &["vm_config".into(), "code".into()])
                .ok_or_else(|| Error::Internal("envoy/filters/wasm.yaml: no code".into()))?;
            let mut remote = vec![("http_uri", map([("uri", s(&module.url)), ("timeout", s("30s"))]))];
            if let Some(sha) = &module.sha256 {
                remote.push(("sha256", s(sha)));
            }
            *code = map([("remote", map(remote))]);
            let typed_config = wasm
                .get("typed_config")
                .cloned()
                .ok_or_else(|| Error::Internal("envoy/filters/wasm.yaml: no typed_config".into()))?;
            patches.push(map([
                ("applyTo", s("EXTENSION_CONFIG")),
                (
                    "patch",
                    map([
                        ("operation", s("ADD")),
                        ("value", map([("name", s(WASM_FILTER_NAME)), ("typed_config", typed_config)])),
                    ]),
                ),
            ]));
            let discovered = map([
                ("name", s(WASM_FILTER_NAME)),
                (
                    "config_discovery",
                    map([
                        ("config_source", map([("ads", map::<&str>([]))])),
                        ("type_urls", strings([WASM_TYPE_URL])),
                    ]),
                ),
            ]);
            // Each INSERT_BEFORE the router lands after the previous one: wasm, admission,
            // guard, router.
            patches.push(http_filter_patch("INSERT_BEFORE", ROUTER, discovered));
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
            let plugin_config: Value =
                serde_yaml_ng::from_str(&filter_json).map_err(|e| Error::Internal(e.to_string()))?;
            let url = if module.url.starts_with("oci://")
                || module.url.starts_with("http://")
                || module.url.starts_with("https://")
            {
                module.url.clone()
            } else {
                format!("oci://{}", module.url)
            };
            let plugin = template::render(
                template::ISTIO_WASM_PLUGIN,
                &values
                    .clone()
                    .set("URL", url)
                    .set("SHA256", module.sha256.clone().unwrap_or_default())
                    .set("PLUGIN_CONFIG", plugin_config),
            )?;
            files.push(File::yaml("istio/wasmplugin.yaml", &plugin)?);
        }
    }
    let envoy_filter =
        template::render(template::ISTIO_ENVOY_FILTER, &values.clone().set("PATCHES", seq(patches)))?;
    files.push(File::yaml("istio/envoyfilter.yaml", &envoy_filter)?);
    if let Some(t) = &c.tracing {
        let provider = t.istio_provider.as_deref().ok_or_else(|| {
            FieldError::new(
                "tracing.istio_provider",
                "needed by the istio target: the name of the OpenTelemetry extensionProviders entry of Istio's MeshConfig",
            )
        })?;
        let telemetry = template::render(
            template::ISTIO_TELEMETRY,
            &values.clone().set("PROVIDER", provider).set("SAMPLING", f(t.sampling_percent)),
        )?;
        files.push(File::yaml("istio/telemetry.yaml", &telemetry)?);
    }

    let retry_on = super::standalone::fallback_retry_on()?;
    let mut routes = Vec::new();
    for (i, pool) in c.pools.iter().enumerate() {
        let service = pool_service(i, pool, "istio")?;
        let destination = map([(
            "destination",
            map([("host", s(service.fqdn())), ("port", map([("number", n(service.port))]))]),
        )]);
        routes.push(map([
            ("name", s(crate::config::pool_label(&pool.name))),
            ("match", seq([map([("headers", map([("x-gateway-pool", map([("exact", s(&pool.name))]))]))])])),
            ("route", seq([destination])),
            ("timeout", s("0s")),
            ("retries", map([("attempts", n(1u64)), ("retryOn", s(&retry_on))])),
            ("headers", map([("response", map([("add", map(ratelimit_headers()))]))])),
        ]));
        let rule = template::render(
            template::ISTIO_DESTINATION_RULE,
            &Values::new()
                .set("NAME", format!("llm-gateway-{}", crate::config::pool_label(&pool.name)))
                .set("NAMESPACE", istio.namespace.as_str())
                .set("LABELS", labels.clone())
                .set("HOST", service.fqdn())
                .set("MAX_CONNECTIONS", pool.circuit_breakers.max_connections)
                .set("CONNECT_TIMEOUT", duration(pool.connect_timeout_ms))
                .set("MAX_PENDING_REQUESTS", pool.circuit_breakers.max_pending_requests)
                .set("MAX_REQUESTS", pool.circuit_breakers.max_requests)
                .set("CONSECUTIVE_5XX", pool.outlier_detection.consecutive_5xx)
                .set("BASE_EJECTION_TIME", duration(pool.outlier_detection.base_ejection_time_ms))
                .set("MAX_EJECTION_PERCENT", pool.outlier_detection.max_ejection_percent),
        )?;
        files.push(File::yaml(
            &format!("istio/destinationrule-{}.yaml", crate::config::pool_label(&pool.name)),
            &rule,
        )?);
    }
    // Every request that passes the filter carries x-gateway-pool; the filter answers the rest
    // itself. The default route reaches no pool: it answers the standalone bootstrap's 404.
    let (status, body) = super::standalone::not_routed_response()?;
    routes.push(map([
        ("name", s("not-routed")),
        ("directResponse", map([("status", n(status)), ("body", map([("string", s(body))]))])),
    ]));
    let virtual_service = template::render(
        template::ISTIO_VIRTUAL_SERVICE,
        &Values::new()
            .set("NAMESPACE", k8s.namespace.as_str())
            .set("LABELS", labels)
            .set("HOSTS", strings(&istio.hosts))
            .set("GATEWAYS", strings(&istio.gateways))
            .set("ROUTES", seq(routes)),
    )?;
    files.push(File::yaml("istio/virtualservice.yaml", &virtual_service)?);
    files.extend(sidecar_mesh_policies(loaded, istio, &k8s.namespace)?);
    files.extend(super::inference_pools(loaded, "istio", "istio")?);
    let istio_files: Vec<File> = files.iter().filter(|f| f.path.starts_with("istio/")).cloned().collect();
    files.push(kubernetes::kustomization("istio", &istio_files)?);
    Ok(files)
}
