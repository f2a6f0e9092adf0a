//! Envoy Gateway: the EnvoyExtensionPolicy (wasm + two extProc entries), the HTTPRoute routing
//! the filter's `x-gateway-pool` header to the pools' Services, the ReferenceGrants that
//! cross-namespace references need, the EnvoyProxy filter order, and the EnvoyPatchPolicy that
//! adds to the generated listener what an EnvoyExtensionPolicy cannot express.

use std::collections::BTreeMap;

use crate::config::{AttachTo, EnvoyGatewaySection, FieldError, Loaded};
use crate::template::{self, Values};
use crate::tree::{at_mut, map, n, s, seq, set, strings, Key, Value};

use super::kubernetes::{self, SIDECAR_NAME};
use super::{module, pool_service, ratelimit_headers, Error, File};

const GATEWAY_API: &str = "gateway.networking.k8s.io";
/// Gateway API allows 16 rules per HTTPRoute; one is the catch-all.
const MAX_POOLS: usize = 15;
/// Name of the rendered EnvoyExtensionPolicy (envoy/envoy-gateway/envoyextensionpolicy.yaml).
const POLICY_NAME: &str = "llm-gateway";
/// The router, the last HTTP filter of every Envoy Gateway listener.
const ROUTER: &str = "envoy.filters.http.router";

/// The name Envoy Gateway gives the HTTP filter of entry `index` of an EnvoyExtensionPolicy's
/// `wasm` (`kind` `wasm`, filter type `envoy.filters.http.wasm`) or `extProc` (`extproc`,
/// `envoy.filters.http.ext_proc`) list: `<filter type>/envoyextensionpolicy/<policy
/// namespace>/<policy name>/<kind>/<index>` (envoyproxy/gateway internal/xds/translator,
/// `perRouteFilterName`).
fn policy_filter_name(filter_type: &str, policy_ns: &str, kind: &str, index: usize) -> String {
    format!("{filter_type}/envoyextensionpolicy/{policy_ns}/{POLICY_NAME}/{kind}/{index}")
}

/// A JSONPath selecting the HTTP filter `name` in every filter chain of a listener (the
/// plain-HTTP `default_filter_chain` and the TLS `filter_chains` alike), then `then` under it.
fn http_filter_json_path(name: &str, then: &str) -> String {
    format!("$..http_filters[?(@.name=='{name}')]{then}")
}

/// One value of a rendered standalone filter definition (envoy/filters/*.yaml); the wasm
/// filter's module path and plugin config are placeholders here (Envoy Gateway sets both).
fn template_value(template: template::Template, path: &[&str]) -> Result<Value, Error> {
    let values = Values::new().set("FILTER_CONFIG_JSON", "{}").set("WASM_PATH", "/unused.wasm");
    let mut rendered = template::render(template, &values)?;
    let keys: Vec<Key<'_>> = path.iter().map(|k| Key::from(*k)).collect();
    at_mut(&mut rendered, &keys)
        .map(|v| v.clone())
        .ok_or_else(|| Error::Internal(format!("{}: no {}", template.path, path.join("."))))
}

/// The EnvoyPatchPolicy (envoy/envoy-gateway/envoypatchpolicy.yaml) on the Gateway's listener:
/// `allow_on_headers_stop_iteration` on the wasm filter, the filter-state `request_attributes` on
/// both ext_proc filters, the RBAC guard just before the router, and the per-connection buffer
/// above `filter.max_body_bytes`. `policy_ns` is the EnvoyExtensionPolicy's namespace (part of
/// its filters' names).
fn patch_policy(
    loaded: &Loaded,
    eg: &EnvoyGatewaySection,
    policy_ns: &str,
    labels: Value,
) -> Result<Value, Error> {
    let max_body =
        loaded.config.filter.max_body_bytes.unwrap_or(gateway_filter::config::DEFAULT_MAX_BODY_BYTES);
    // The entries' order in envoy/envoy-gateway/envoyextensionpolicy.yaml: one wasm, then the
    // admission extProc and the metering extProc.
    let wasm = policy_filter_name("envoy.filters.http.wasm", policy_ns, "wasm", 0);
    let admission = policy_filter_name("envoy.filters.http.ext_proc", policy_ns, "extproc", 0);
    let metering = policy_filter_name("envoy.filters.http.ext_proc", policy_ns, "extproc", 1);
    let values = Values::new()
        .set("NAMESPACE", eg.gateway.namespace.as_str())
        .set("LABELS", labels)
        .set(
            "TARGET_REF",
            map([("group", s(GATEWAY_API)), ("kind", s("Gateway")), ("name", s(&eg.gateway.name))]),
        )
        .set("LISTENER", eg.xds_listener_name())
        .set("WASM_PLUGIN_CONFIG", http_filter_json_path(&wasm, ".typed_config.config"))
        .set(
            "ALLOW_ON_HEADERS_STOP_ITERATION",
            template_value(
                template::FILTER_WASM,
                &["typed_config", "config", "allow_on_headers_stop_iteration"],
            )?,
        )
        .set("ADMISSION_FILTER_CONFIG", http_filter_json_path(&admission, ".typed_config"))
        .set(
            "ADMISSION_REQUEST_ATTRIBUTES",
            template_value(template::FILTER_ADMISSION, &["typed_config", "request_attributes"])?,
        )
        .set(
            "ADMISSION_MAX_MESSAGE_TIMEOUT",
            template_value(template::FILTER_ADMISSION, &["typed_config", "max_message_timeout"])?,
        )
        .set("METERING_FILTER_CONFIG", http_filter_json_path(&metering, ".typed_config"))
        .set(
            "METERING_REQUEST_ATTRIBUTES",
            template_value(template::FILTER_METERING, &["typed_config", "request_attributes"])?,
        )
        .set("ROUTER_FILTER", http_filter_json_path(ROUTER, ""))
        .set("GUARD", template::render(template::FILTER_GUARD, &Values::new())?)
        .set("BUFFER_LIMIT_BYTES", max_body.saturating_add(1 << 20));
    Ok(template::render(template::EG_PATCH_POLICY, &values)?)
}

/// One ReferenceGrant: who may refer (kind, namespace, group) to which Services.
#[derive(Debug, Default)]
struct Grant {
    from: Vec<(&'static str, String, &'static str)>,
    to: Vec<String>,
}

impl Grant {
    fn allow(&mut self, from: (&'static str, String, &'static str), service: &str) {
        if !self.from.contains(&from) {
            self.from.push(from);
        }
        if !self.to.iter().any(|s| s == service) {
            self.to.push(service.to_owned());
        }
    }
}

fn section(loaded: &Loaded) -> Result<&EnvoyGatewaySection, Error> {
    loaded.config.envoy_gateway.as_ref().ok_or_else(|| {
        FieldError::new("envoy_gateway", "required by the envoy-gateway target (the Gateway to attach to)")
            .into()
    })
}

fn backend_ref(name: &str, namespace: Option<&str>, port: u16) -> Value {
    let mut fields = vec![("group", s("")), ("kind", s("Service")), ("name", s(name))];
    if let Some(ns) = namespace {
        fields.push(("namespace", s(ns)));
    }
    fields.push(("port", n(port)));
    map(fields)
}

/// Every manifest under `envoy-gateway/` (and `kubernetes/`).
///
/// # Errors
/// A section or field the envoy-gateway target needs, or a component rejecting its config.
pub fn manifests(loaded: &Loaded, filter_config: &Value) -> Result<Vec<File>, Error> {
    let c = &loaded.config;
    let eg = section(loaded)?;
    let k8s = kubernetes::section(loaded, "envoy-gateway")?;
    let module = module(loaded, "envoy-gateway")?;
    // Unset, admission leases are off here (the sidecar's own token leases stay on).
    if c.filter.admission_leases == Some(true) {
        return Err(FieldError::new(
            "filter.admission_leases",
            "not rendered by the envoy-gateway target: an EnvoyExtensionPolicy cannot wrap the \
             ext_proc filter in the matcher that skips it for leased admissions (use the standalone \
             or istio target)",
        )
        .into());
    }
    if c.pools.len() > MAX_POOLS {
        return Err(FieldError::new(
            "pools",
            format!("the envoy-gateway target routes at most {MAX_POOLS} pools (one HTTPRoute)"),
        )
        .into());
    }
    let mut files = kubernetes::manifests(loaded, "envoy-gateway")?;
    let labels = kubernetes::labels("llm-gateway");
    let route_ns = k8s.namespace.as_str();

    // The HTTPRoute, in the sidecar's namespace.
    let filters = seq([map([
        ("type", s("ResponseHeaderModifier")),
        (
            "responseHeaderModifier",
            map([(
                "add",
                seq(ratelimit_headers()
                    .into_iter()
                    .map(|(name, value)| map([("name", s(name)), ("value", value)]))),
            )]),
        ),
    ])]);
    // Cross-namespace references need a ReferenceGrant in the referenced namespace, allowing the
    // referring kinds to reach the named Services only.
    let mut grants: BTreeMap<String, Grant> = BTreeMap::new();
    let mut rules = Vec::new();
    for (i, pool) in c.pools.iter().enumerate() {
        let service = pool_service(i, pool, "envoy-gateway")?;
        let ns = (service.namespace != route_ns).then_some(service.namespace.as_str());
        if ns.is_some() {
            grants
                .entry(service.namespace.clone())
                .or_default()
                .allow(("HTTPRoute", route_ns.to_owned(), GATEWAY_API), &service.name);
        }
        rules.push(map([
            (
                "matches",
                seq([map([(
                    "headers",
                    seq([map([
                        ("type", s("Exact")),
                        ("name", s("x-gateway-pool")),
                        ("value", s(&pool.name)),
                    ])]),
                )])]),
            ),
            ("filters", filters.clone()),
            ("backendRefs", seq([backend_ref(&service.name, ns, service.port)])),
            ("timeouts", map([("request", s("0s"))])),
        ]));
    }
    // The catch-all rule: Envoy Gateway runs the policy's filters only on requests that match a
    // rule, so every request must match one before the filter has set x-gateway-pool. It has no
    // backend, so a request the filter did not route reaches no pool (Gateway API: a rule
    // without backends answers 500).
    rules.push(map([
        ("matches", seq([map([("path", map([("type", s("PathPrefix")), ("value", s("/"))]))])])),
        ("filters", filters.clone()),
        ("timeouts", map([("request", s("0s"))])),
    ]));
    let route = template::render(
        template::EG_HTTP_ROUTE,
        &Values::new()
            .set("NAMESPACE", route_ns)
            .set("LABELS", labels.clone())
            .set(
                "PARENT_REFS",
                seq([map([
                    ("group", s(GATEWAY_API)),
                    ("kind", s("Gateway")),
                    ("name", s(&eg.gateway.name)),
                    ("namespace", s(&eg.gateway.namespace)),
                    // Only the listener the EnvoyPatchPolicy patches (its guard included).
                    ("sectionName", s(&eg.listener.name)),
                ])]),
            )
            .set("HOSTNAMES", strings(&eg.hostnames))
            .set("RULES", seq(rules)),
    )?;
    files.push(File::yaml("envoy-gateway/httproute.yaml", &route)?);

    // The policy lives with its target.
    let (policy_ns, target) = match eg.attach_to {
        AttachTo::HttpRoute => (route_ns.to_owned(), ("HTTPRoute", "llm-gateway".to_owned())),
        AttachTo::Gateway => (eg.gateway.namespace.clone(), ("Gateway", eg.gateway.name.clone())),
    };
    let sidecar_ns = (policy_ns != route_ns).then_some(route_ns);
    if sidecar_ns.is_some() {
        grants
            .entry(route_ns.to_owned())
            .or_default()
            .allow(("EnvoyExtensionPolicy", policy_ns.clone(), "gateway.envoyproxy.io"), SIDECAR_NAME);
    }
    let code = if let Some(image) = module.url.strip_prefix("oci://") {
        let mut fields = vec![("url", s(image))];
        if let Some(sha) = &module.sha256 {
            fields.push(("sha256", s(sha)));
        }
        map([("type", s("Image")), ("image", map(fields))])
    } else {
        let mut fields = vec![("url", s(&module.url))];
        if let Some(sha) = &module.sha256 {
            fields.push(("sha256", s(sha)));
        }
        map([("type", s("HTTP")), ("http", map(fields))])
    };
    let policy = template::render(
        template::EG_EXTENSION_POLICY,
        &Values::new()
            .set("NAMESPACE", policy_ns.as_str())
            .set("LABELS", labels.clone())
            .set(
                "TARGET_REFS",
                seq([map([("group", s(GATEWAY_API)), ("kind", s(target.0)), ("name", s(target.1))])]),
            )
            .set("CODE", code)
            .set("PLUGIN_CONFIG", filter_config.clone())
            .set(
                "SIDECAR_BACKEND_REFS",
                seq([backend_ref(SIDECAR_NAME, sidecar_ns, kubernetes::sidecar_port(loaded))]),
            ),
    )?;
    files.push(File::yaml("envoy-gateway/envoyextensionpolicy.yaml", &policy)?);

    for (ns, grant) in &grants {
        let from = grant.from.iter().map(|(kind, from_ns, group)| {
            map([("group", s(*group)), ("kind", s(*kind)), ("namespace", s(from_ns))])
        });
        let grant = map([
            ("apiVersion", s("gateway.networking.k8s.io/v1beta1")),
            ("kind", s("ReferenceGrant")),
            ("metadata", map([("name", s("llm-gateway")), ("namespace", s(ns)), ("labels", labels.clone())])),
            (
                "spec",
                map([
                    ("from", seq(from)),
                    (
                        "to",
                        seq(grant
                            .to
                            .iter()
                            .map(|name| map([("group", s("")), ("kind", s("Service")), ("name", s(name))]))),
                    ),
                ]),
            ),
        ]);
        files.push(File::yaml(&format!("envoy-gateway/referencegrant-{ns}.yaml"), &grant)?);
    }
    let mut proxy = template::render(
        template::EG_ENVOY_PROXY,
        &Values::new().set("NAMESPACE", eg.gateway.namespace.as_str()).set("LABELS", labels.clone()),
    )?;
    if let Some(t) = &loaded.config.tracing {
        // Envoy Gateway's tracer (OpenTelemetry, to the collector), sampled per 10,000.
        let (host, port) = t.host_port().unwrap_or(("", 0));
        let numerator = (t.sampling_percent * 100.0).round().clamp(0.0, 10_000.0) as u64;
        let tracing = map([
            ("samplingFraction", map([("numerator", n(numerator)), ("denominator", n(10_000u64))])),
            ("provider", map([("type", s("OpenTelemetry")), ("host", s(host)), ("port", n(port))])),
        ]);
        let spec = at_mut(&mut proxy, &["spec".into()])
            .ok_or_else(|| Error::Internal("EnvoyProxy: no spec".into()))?;
        set(spec, "telemetry", map([("tracing", tracing)]));
    }
    files.push(File::yaml("envoy-gateway/envoyproxy.yaml", &proxy)?);
    let patch = patch_policy(loaded, eg, &policy_ns, labels)?;
    files.push(File::yaml("envoy-gateway/envoypatchpolicy.yaml", &patch)?);
    files.extend(super::inference_pools(loaded, "envoy-gateway", "envoy-gateway")?);
    let eg_files: Vec<File> =
        files.iter().filter(|f| f.path.starts_with("envoy-gateway/")).cloned().collect();
    files.push(kubernetes::kustomization("envoy-gateway", &eg_files)?);
    Ok(files)
}
