//! Envoy Gateway: the EnvoyExtensionPolicy (wasm + two extProc entries), the HTTPRoute routing
//! the filter's `x-gateway-pool` header to the pools' Services, the ReferenceGrants that
//! cross-namespace references need, the EnvoyProxy filter order, and the EnvoyPatchPolicy that
//! adds to the generated listener what an EnvoyExtensionPolicy cannot express.

use std::collections::BTreeMap;

use gateway_filter::config::RawConfig;

use crate::config::{AttachTo, EnvoyGatewaySection, FieldError, Loaded, WasmModule};
use crate::template::{self, Values};
use crate::tree::{at_mut, Key, Value};

use super::kubernetes::{self, SIDECAR_NAME};
use super::manifests::envoy_gateway::{
    EnvoyExtensionPolicy, EnvoyExtensionPolicySpec, EnvoyPatchPolicy, EnvoyPatchPolicySpec, EnvoyProxy,
    EnvoyProxySpec, ExtProc, ExtProcMetadata, FilterOrder, Fraction, JsonPatch, JsonPatchOperation,
    LogLevels, ProcessingMode, ProxyLogging, ProxyTelemetry, ProxyTracing, ResponseMode, TracingProvider,
    Wasm, WasmCode, WasmSource,
};
use super::manifests::gateway_api::{
    BackendRef, GrantFrom, Header, HeaderMatch, HeaderModifier, HttpRoute, HttpRouteSpec, ParentRef,
    PathMatch, ReferenceGrant, ReferenceGrantSpec, RouteFilter, RouteMatch, RouteRule, RouteTimeouts,
    GATEWAY_API,
};
use super::manifests::{Empty, ObjectMeta, TypedRef};
use super::{module, pool_service, ratelimit_headers, Error, File};

/// Gateway API allows 16 rules per HTTPRoute; one is the catch-all.
const MAX_POOLS: usize = 15;
/// Name of the rendered EnvoyExtensionPolicy, HTTPRoute, EnvoyProxy and EnvoyPatchPolicy.
const POLICY_NAME: &str = "llm-gateway";
/// The router, the last HTTP filter of every Envoy Gateway listener.
const ROUTER: &str = "envoy.filters.http.router";
/// The gateway's objects' `app.kubernetes.io/name`.
const COMPONENT: &str = "llm-gateway";
/// The xDS type the EnvoyPatchPolicy patches.
const LISTENER_TYPE: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";

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

/// The Gateway.
fn gateway_ref(eg: &EnvoyGatewaySection) -> TypedRef {
    TypedRef { group: GATEWAY_API, kind: "Gateway", name: eg.gateway.name.clone() }
}

/// The EnvoyPatchPolicy on the Gateway's listener: what an EnvoyExtensionPolicy cannot express,
/// patched into the xDS listener Envoy Gateway generates for the gateway's Gateway listener (JSON
/// Patch; each jsonPath names one filter by the name Envoy Gateway gives it, and a jsonPath that
/// matches nothing marks the policy Invalid in its status instead of failing silently). Envoy
/// Gateway applies it only with `extensionApis.enableEnvoyPatchPolicy: true` in its EnvoyGateway
/// config (docs/deploy.md, "5. Envoy Gateway"), and only in its target Gateway's namespace. Every
/// value comes from the standalone filter definitions (envoy/filters/*.yaml), never retyped.
/// `policy_ns` is the EnvoyExtensionPolicy's namespace (part of its filters' names).
fn patch_policy(
    loaded: &Loaded,
    eg: &EnvoyGatewaySection,
    policy_ns: &str,
) -> Result<EnvoyPatchPolicy, Error> {
    let max_body =
        loaded.config.filter.max_body_bytes.unwrap_or(gateway_filter::config::DEFAULT_MAX_BODY_BYTES);
    // The entries' order in the EnvoyExtensionPolicy: one wasm, then the admission extProc and
    // the metering extProc.
    let wasm = policy_filter_name("envoy.filters.http.wasm", policy_ns, "wasm", 0);
    let admission = policy_filter_name("envoy.filters.http.ext_proc", policy_ns, "extproc", 0);
    let metering = policy_filter_name("envoy.filters.http.ext_proc", policy_ns, "extproc", 1);
    let listener = eg.xds_listener_name();
    let add = |json_path: Option<String>, path: Option<&'static str>, value: Value| JsonPatch {
        type_url: LISTENER_TYPE,
        name: listener.clone(),
        operation: JsonPatchOperation { op: "add", json_path, path, value },
    };
    let filter = |name: &str| Some(http_filter_json_path(name, ".typed_config"));
    let attributes = ["typed_config", "request_attributes"];
    let json_patches = vec![
        // The wasm filter pauses in the request headers until it has the body: without this Envoy
        // never hands it the body and every request hangs (envoyproxy/gateway#8382).
        add(
            Some(http_filter_json_path(&wasm, ".typed_config.config")),
            Some("allow_on_headers_stop_iteration"),
            template_value(
                template::FILTER_WASM,
                &["typed_config", "config", "allow_on_headers_stop_iteration"],
            )?,
        ),
        // Both ext_proc filters send the wasm filter's decision (filter state, which clients
        // cannot write): the sidecar admits and meters only by it.
        add(
            filter(&admission),
            Some("request_attributes"),
            template_value(template::FILTER_ADMISSION, &attributes)?,
        ),
        add(
            filter(&metering),
            Some("request_attributes"),
            template_value(template::FILTER_METERING, &attributes)?,
        ),
        // Flow control: how long the sidecar may hold a queued request's answer (it asks with
        // override_message_timeout); the EnvoyExtensionPolicy has no field for it.
        add(
            filter(&admission),
            Some("max_message_timeout"),
            template_value(template::FILTER_ADMISSION, &["typed_config", "max_message_timeout"])?,
        ),
        // The fail-closed RBAC guard (envoy/filters/guard.yaml), added at the router's index, i.e.
        // just before the router, enabled on every route of the listener: where the
        // EnvoyExtensionPolicy does not attach, nothing passes it, a client's own x-gateway-pool
        // header included.
        add(
            Some(http_filter_json_path(ROUTER, "")),
            None,
            template::render(template::FILTER_GUARD, &Values::new())?,
        ),
        // The filter buffers the body: the listener's per-connection buffer must exceed
        // filter.max_body_bytes (as the standalone render sets it), or larger bodies get Envoy's
        // 413.
        add(None, Some("/per_connection_buffer_limit_bytes"), Value::from(max_body.saturating_add(1 << 20))),
    ];
    Ok(EnvoyPatchPolicy::new(
        ObjectMeta::new(POLICY_NAME, &eg.gateway.namespace, COMPONENT),
        EnvoyPatchPolicySpec { target_ref: gateway_ref(eg), kind: "JSONPatch", json_patches },
    ))
}

/// The ReferenceGrants by namespace: who may refer (kind, namespace, group) to which of its
/// Services.
#[derive(Debug, Default)]
struct Grants(BTreeMap<String, Grant>);

/// One ReferenceGrant's referrers and Services.
#[derive(Debug, Default)]
struct Grant {
    from: Vec<GrantFrom>,
    to: Vec<String>,
}

impl Grants {
    /// Lets `from` refer to the Service `service` of `namespace`.
    fn allow(&mut self, namespace: &str, from: GrantFrom, service: &str) {
        let grant = self.0.entry(namespace.to_owned()).or_default();
        if !grant.from.contains(&from) {
            grant.from.push(from);
        }
        if !grant.to.iter().any(|s| s == service) {
            grant.to.push(service.to_owned());
        }
    }

    /// Each ReferenceGrant's file.
    fn files(self) -> Result<Vec<File>, Error> {
        let mut files = Vec::new();
        for (ns, grant) in self.0 {
            let to = grant.to.into_iter().map(|name| TypedRef { group: "", kind: "Service", name });
            let doc = ReferenceGrant::new(
                ObjectMeta::new(POLICY_NAME, &ns, COMPONENT),
                ReferenceGrantSpec { from: grant.from, to: to.collect() },
            );
            files.push(File::yaml(&format!("envoy-gateway/referencegrant-{ns}.yaml"), &doc)?);
        }
        Ok(files)
    }
}

fn section(loaded: &Loaded) -> Result<&EnvoyGatewaySection, Error> {
    loaded.config.envoy_gateway.as_ref().ok_or_else(|| {
        FieldError::new("envoy_gateway", "required by the envoy-gateway target (the Gateway to attach to)")
            .into()
    })
}

/// Every manifest under `envoy-gateway/` (and `kubernetes/`).
///
/// # Errors
/// A section or field the envoy-gateway target needs, or a component rejecting its config.
pub fn manifests(loaded: &Loaded, filter_config: &RawConfig) -> Result<Vec<File>, Error> {
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
    let route_ns = k8s.namespace.as_str();
    let mut grants = Grants::default();
    files.push(File::yaml("envoy-gateway/httproute.yaml", &http_route(loaded, eg, route_ns, &mut grants)?)?);

    // The policy lives with its target.
    let (policy_ns, target) = match eg.attach_to {
        AttachTo::HttpRoute => (route_ns.to_owned(), ("HTTPRoute", POLICY_NAME.to_owned())),
        AttachTo::Gateway => (eg.gateway.namespace.clone(), ("Gateway", eg.gateway.name.clone())),
    };
    let sidecar_ns = (policy_ns != route_ns).then_some(route_ns);
    if sidecar_ns.is_some() {
        let from = GrantFrom {
            group: "gateway.envoyproxy.io",
            kind: "EnvoyExtensionPolicy",
            namespace: policy_ns.clone(),
        };
        grants.allow(route_ns, from, SIDECAR_NAME);
    }
    let sidecar_port = kubernetes::sidecar_port(loaded);
    let policy = EnvoyExtensionPolicy::new(
        ObjectMeta::new(POLICY_NAME, &policy_ns, COMPONENT),
        EnvoyExtensionPolicySpec {
            target_refs: vec![TypedRef { group: GATEWAY_API, kind: target.0, name: target.1 }],
            wasm: vec![wasm(module, filter_config.clone())],
            ext_proc: ext_procs(|| BackendRef::service(SIDECAR_NAME, sidecar_ns, sidecar_port)),
        },
    );
    files.push(File::yaml("envoy-gateway/envoyextensionpolicy.yaml", &policy)?);
    files.extend(grants.files()?);
    files.push(File::yaml("envoy-gateway/envoyproxy.yaml", &envoy_proxy(loaded, eg))?);
    files.push(File::yaml("envoy-gateway/envoypatchpolicy.yaml", &patch_policy(loaded, eg, &policy_ns)?)?);
    files.extend(super::inference_pools(loaded, "envoy-gateway", "envoy-gateway")?);
    let eg_files: Vec<File> =
        files.iter().filter(|f| f.path.starts_with("envoy-gateway/")).cloned().collect();
    files.push(kubernetes::kustomization("envoy-gateway", &eg_files)?);
    Ok(files)
}

/// The HTTPRoute, in the sidecar's namespace (`route_ns`): routes on the x-gateway-pool header
/// that the wasm filter sets to each pool's Service, with a ReferenceGrant in `grants` for each
/// Service in another namespace (allowing the route to reach the named Services only). The
/// catch-all rule comes last in precedence (fewest header matches) and exists because Envoy
/// Gateway enables policy filters per route: a request must match some rule of this route before
/// the wasm filter has set the header, or no gateway filter runs on it. It has no backend: a
/// request the filter did not route (a policy that did not attach) reaches no pool, and Envoy
/// Gateway answers it 500 (Gateway API: a rule without backends).
fn http_route(
    loaded: &Loaded,
    eg: &EnvoyGatewaySection,
    route_ns: &str,
    grants: &mut Grants,
) -> Result<HttpRoute, Error> {
    let headers = ratelimit_headers().0.into_iter().map(|(name, value)| Header { name, value });
    let filters = vec![RouteFilter {
        kind: "ResponseHeaderModifier",
        response_header_modifier: HeaderModifier { add: headers.collect() },
    }];
    let timeouts = || RouteTimeouts { request: "0s" };
    let mut rules = Vec::new();
    for (i, pool) in loaded.config.pools.iter().enumerate() {
        let service = pool_service(i, pool, "envoy-gateway")?;
        let ns = (service.namespace != route_ns).then_some(service.namespace.as_str());
        if let Some(ns) = ns {
            let from = GrantFrom { group: GATEWAY_API, kind: "HTTPRoute", namespace: route_ns.to_owned() };
            grants.allow(ns, from, &service.name);
        }
        let pool_header = HeaderMatch { kind: "Exact", name: "x-gateway-pool", value: pool.name.clone() };
        rules.push(RouteRule {
            matches: vec![RouteMatch { headers: vec![pool_header], path: None }],
            filters: filters.clone(),
            backend_refs: vec![BackendRef::service(&service.name, ns, service.port)],
            timeouts: timeouts(),
        });
    }
    rules.push(RouteRule {
        matches: vec![RouteMatch {
            headers: Vec::new(),
            path: Some(PathMatch { kind: "PathPrefix", value: "/" }),
        }],
        filters,
        backend_refs: Vec::new(),
        timeouts: timeouts(),
    });
    Ok(HttpRoute::new(
        ObjectMeta::new(POLICY_NAME, route_ns, COMPONENT),
        HttpRouteSpec {
            parent_refs: vec![ParentRef {
                group: GATEWAY_API,
                kind: "Gateway",
                name: eg.gateway.name.clone(),
                namespace: eg.gateway.namespace.clone(),
                // Only the listener the EnvoyPatchPolicy patches (its guard included).
                section_name: eg.listener.name.clone(),
            }],
            hostnames: eg.hostnames.clone(),
            rules,
        },
    ))
}

/// The wasm filter (its module fetched by Envoy Gateway from an OCI image or an HTTP URL with its
/// sha256). Envoy's fail-closed policy (Envoy Gateway has no reload option): a VM that fails
/// answers 503 on its worker until Envoy restarts (docs/deploy.md, "A failing filter VM").
fn wasm(module: &WasmModule, config: RawConfig) -> Wasm {
    let code = match module.url.strip_prefix("oci://") {
        Some(image) => WasmCode {
            kind: "Image",
            image: Some(WasmSource { url: image.to_owned(), sha256: module.sha256.clone() }),
            http: None,
        },
        None => WasmCode {
            kind: "HTTP",
            image: None,
            http: Some(WasmSource { url: module.url.clone(), sha256: module.sha256.clone() }),
        },
    };
    Wasm { name: "llm-gateway-filter", root_id: "llm_gateway", fail_open: false, code, config }
}

/// The sidecar as two extProc entries, each calling `sidecar()`. Admission: one blocking round
/// trip on the request headers; the sidecar writes the x-ratelimit-* values to the llm_gateway
/// metadata namespace. It may ask for the body of a request whose context length only an exact
/// token count can decide (mode override, as envoy/filters/ext_proc_admission.yaml allows).
/// Metering: send-and-go (shadow mode, Envoy's observability_mode) on the request headers and the
/// streamed response.
fn ext_procs(sidecar: impl Fn() -> BackendRef) -> Vec<ExtProc> {
    vec![
        ExtProc {
            backend_refs: vec![sidecar()],
            shadow_mode: None,
            processing_mode: ProcessingMode {
                request: Empty {},
                response: None,
                allow_mode_override: Some(true),
            },
            message_timeout: Some("500ms"),
            fail_open: false,
            metadata: ExtProcMetadata {
                writable_namespaces: vec!["llm_gateway"],
                accessible_namespaces: Vec::new(),
            },
        },
        ExtProc {
            backend_refs: vec![sidecar()],
            shadow_mode: Some(true),
            processing_mode: ProcessingMode {
                request: Empty {},
                response: Some(ResponseMode { body: "Streamed" }),
                allow_mode_override: None,
            },
            message_timeout: None,
            fail_open: true,
            metadata: ExtProcMetadata {
                writable_namespaces: Vec::new(),
                accessible_namespaces: vec!["llm_gateway"],
            },
        },
    ]
}

/// The EnvoyProxy: Envoy Gateway runs ext_proc filters before wasm filters unless told otherwise;
/// the gateway's admission and metering need the wasm filter's decision, so the wasm filter goes
/// first. Reference it from the Gateway (spec.infrastructure.parametersRef) or copy filterOrder
/// into the EnvoyProxy the Gateway already uses. Envoy's connection manager and codecs write
/// request headers as received, API keys included, at debug and trace (no redaction exists):
/// those two loggers stay at info whatever the default level (docs/deploy.md, "Secrets in
/// logs"). With `tracing`, Envoy Gateway's tracer (OpenTelemetry, to the collector), sampled per
/// 10,000.
fn envoy_proxy(loaded: &Loaded, eg: &EnvoyGatewaySection) -> EnvoyProxy {
    let telemetry = loaded.config.tracing.as_ref().map(|t| {
        let (host, port) = t.host_port().unwrap_or(("", 0));
        let numerator = (t.sampling_percent * 100.0).round().clamp(0.0, 10_000.0) as u64;
        ProxyTelemetry {
            tracing: ProxyTracing {
                sampling_fraction: Fraction { numerator, denominator: 10_000 },
                provider: TracingProvider { kind: "OpenTelemetry", host: host.to_owned(), port },
            },
        }
    });
    EnvoyProxy::new(
        ObjectMeta::new(POLICY_NAME, &eg.gateway.namespace, COMPONENT),
        EnvoyProxySpec {
            logging: ProxyLogging { level: LogLevels { default: "warn", http: "info", http2: "info" } },
            filter_order: vec![FilterOrder {
                name: "envoy.filters.http.wasm",
                before: "envoy.filters.http.ext_proc",
            }],
            telemetry,
        },
    )
}
