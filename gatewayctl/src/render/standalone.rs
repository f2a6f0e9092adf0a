//! The standalone edge: the Envoy bootstrap, assembled from the same template files that
//! `tests/stack.py` assembles (envoy/bootstrap.yaml, envoy/filters/*.yaml,
//! envoy/ext_proc_cluster.yaml, envoy/pool_cluster.yaml, envoy/fallback_cluster.yaml,
//! envoy/fallback_route.yaml), plus what an edge needs on top: the listener address, each pool's
//! health check, outlier detection and circuit breakers, and DNS endpoints.
//!
//! Fallback: a pool with `fallback: [b, c]` becomes a fallback chain of the same name, a
//! composite cluster (`envoy.clusters.composite`, RETRY mode) over `[<pool>-primary, b, c]`,
//! where `<pool>-primary` holds the pool's own endpoints, with its own route whose retry policy
//! (`connect-failure,refused-stream,reset,5xx`, one retry per further pool) moves each retry to
//! the next pool. The first attempt always goes to the pool itself; a pool with no healthy
//! endpoint answers 503 at once, which is retried on the next. The filter keeps naming the pool
//! (`x-gateway-pool: <pool>`), so routing, the sidecar's shedding and the metering see one name.

use gateway_filter::config::RawConfig;

use crate::config::FieldError;
use crate::config::{parse_host_port, primary_cluster, EdgeSection, HostPort, Loaded, PoolSection};
use crate::template::{self, Template, Values};
use crate::tree::{at_mut, merge, set, to_json, to_tree, Key, Value};

use super::envoy_config::{
    HealthCheck, HttpHealthCheck, LbEndpoint, Named, OutlierDetection, PoolClusterSettings, Router,
    Thresholds,
};
use super::Error;

/// Default body limit of the filter when the config sets none (the filter's own default).
const DEFAULT_MAX_BODY_BYTES: u64 = gateway_filter::config::DEFAULT_MAX_BODY_BYTES;

/// Formats milliseconds as a protobuf JSON duration (`1.5s`).
pub fn duration(ms: u64) -> String {
    let (secs, rest) = (ms / 1000, ms % 1000);
    if rest == 0 {
        format!("{secs}s")
    } else {
        format!("{secs}.{rest:03}s")
    }
}

fn missing(what: &str) -> Error {
    Error::Internal(format!("envoy/bootstrap.yaml: {what} not found where expected"))
}

/// A typed piece of configuration as a tree.
fn tree(value: &impl serde::Serialize) -> Result<Value, Error> {
    to_tree(value).map_err(Error::Internal)
}

/// Name of the cluster holding a pool's own endpoints.
fn endpoints_cluster(pool: &PoolSection) -> String {
    if pool.fallback.is_empty() {
        pool.name.clone()
    } else {
        primary_cluster(&pool.name)
    }
}

/// The values of envoy/tracing.yaml and envoy/otel_cluster.yaml.
fn tracing_values(t: &crate::config::TracingSection) -> Values {
    let (host, port) = t.host_port().unwrap_or(("", 0));
    Values::new()
        .set("SERVICE_NAME", "llm-gateway")
        .set("RANDOM_SAMPLING", t.sampling_percent)
        .set("OTLP_HOST", host)
        .set("OTLP_PORT", port)
}

/// The filter's HTTP filter template, its placeholder for the module's path, and the module's
/// path on the Envoy host: the wasm module, or the same filter as a dynamic module (config
/// validation allows one).
fn filter_module(loaded: &Loaded) -> Result<(Template, &'static str, std::path::PathBuf), Error> {
    let f = &loaded.config.filter;
    match (&f.wasm_file, &f.native_module) {
        (Some(wasm), _) => Ok((template::FILTER_WASM, "WASM_PATH", loaded.resolve(wasm))),
        (None, Some(native)) => Ok((template::FILTER_NATIVE, "NATIVE_MODULE_PATH", loaded.resolve(native))),
        (None, None) => Err(FieldError::new(
            "filter.wasm_file",
            "required by the standalone target (path of gateway_filter.wasm on the Envoy host; \
             or filter.native_module, the dynamic module's)",
        )
        .into()),
    }
}

/// With `envoy.live_config`: the filter's ECDS file (`filter.json` in its directory), a
/// discovery response holding the filter's entry (module and `filter_config`) as a
/// `TypedExtensionConfig` named as the bootstrap's filter.
///
/// # Errors
/// The filter's module is not configured, or a template error.
pub fn live_filter(loaded: &Loaded, filter_config: &RawConfig) -> Result<Option<Value>, Error> {
    if loaded.config.envoy.live_config.is_none() {
        return Ok(None);
    }
    let (filter_template, module_key, module_path) = filter_module(loaded)?;
    let values = Values::new()
        .set("FILTER_CONFIG_JSON", to_json(filter_config).map_err(Error::Internal)?)
        .set(module_key, module_path.display().to_string());
    let entry = template::render(filter_template, &values)?;
    let (Some(name), Some(typed_config)) = (entry.get("name").cloned(), entry.get("typed_config").cloned())
    else {
        return Err(Error::Internal(format!("{}: no name or typed_config", filter_template.path)));
    };
    let mut resource = crate::tree::Mapping::new();
    resource.insert("@type".into(), "type.googleapis.com/envoy.config.core.v3.TypedExtensionConfig".into());
    resource.insert("name".into(), name);
    resource.insert("typed_config".into(), typed_config);
    let mut doc = crate::tree::Mapping::new();
    doc.insert("resources".into(), Value::Sequence(vec![Value::Mapping(resource)]));
    Ok(Some(Value::Mapping(doc)))
}

/// Where Envoy reaches the sidecar: `sidecar.address`, or `sidecar.listen` with an unspecified
/// address replaced by 127.0.0.1.
fn sidecar_address(loaded: &Loaded) -> Result<HostPort, Error> {
    let sidecar = &loaded.config.sidecar;
    let address = match &sidecar.address {
        Some(a) => a.clone(),
        None => {
            let ip = if sidecar.listen.ip().is_unspecified() {
                "127.0.0.1".to_owned()
            } else {
                sidecar.listen.ip().to_string()
            };
            // An IPv6 literal needs brackets in host:port.
            if ip.contains(':') {
                format!("[{ip}]:{}", sidecar.listen.port())
            } else {
                format!("{ip}:{}", sidecar.listen.port())
            }
        }
    };
    parse_host_port(&address).ok_or_else(|| FieldError::new("sidecar.address", "must be host:port").into())
}

/// The path of the HTTP connection manager's `typed_config` in envoy/bootstrap.yaml.
const HCM_PATH: [Key<'static>; 8] = [
    Key::Field("static_resources"),
    Key::Field("listeners"),
    Key::Index(0),
    Key::Field("filter_chains"),
    Key::Index(0),
    Key::Field("filters"),
    Key::Index(0),
    Key::Field("typed_config"),
];

/// The Envoy bootstrap for the standalone edge, with `filter_config` embedded.
///
/// # Errors
/// A field the standalone target needs but the config lacks, or an internal template error.
pub fn bootstrap(loaded: &Loaded, filter_config: &RawConfig) -> Result<Value, Error> {
    let c = &loaded.config;
    let (filter_template, module_key, module_path) = filter_module(loaded)?;
    let sidecar = sidecar_address(loaded)?;
    let max_body = c.filter.max_body_bytes.unwrap_or(DEFAULT_MAX_BODY_BYTES);
    if c.pools.is_empty() {
        return Err(FieldError::new("pools", "must not be empty").into());
    }

    let values = Values::new()
        .set("ADMIN_PORT", c.envoy.admin_port)
        .set("LISTEN_PORT", c.envoy.listen.port())
        .set("BUFFER_LIMIT_BYTES", max_body.saturating_add(1 << 20))
        .set("FILTER_CONFIG_JSON", to_json(filter_config).map_err(Error::Internal)?)
        .set(module_key, module_path.display().to_string())
        .set("EXT_PROC_PORT", sidecar.port);
    let values = with_edge(values, &c.envoy.edge);

    let mut bootstrap = template::render(template::BOOTSTRAP, &values)?;
    let address = [Key::from("static_resources"), "listeners".into(), 0.into(), "address".into()];
    let address = at_mut(&mut bootstrap, &address).and_then(|a| a.get_mut("socket_address"));
    *address.and_then(|a| a.get_mut("address")).ok_or_else(|| missing("listener address"))? =
        Value::String(c.envoy.listen.ip().to_string());
    let hcm = at_mut(&mut bootstrap, &HCM_PATH).ok_or_else(|| missing("http_connection_manager"))?;
    connection_manager(loaded, hcm, &values, filter_template)?;

    let mut clusters = vec![ext_proc_cluster(loaded, &values, &sidecar)?];
    if let Some(t) = &c.tracing {
        clusters.push(template::render(template::OTEL_CLUSTER, &tracing_values(t))?);
    }
    for (i, pool) in c.pools.iter().enumerate() {
        clusters.push(pool_cluster(i, pool)?);
    }
    let routes = pool_routes(loaded, &mut clusters)?;
    // Each chain's (and picking pool's) route goes before the generic x-gateway-pool route, as
    // tests/stack.py does.
    let mut routes_path = HCM_PATH.to_vec();
    routes_path.extend([Key::from("route_config"), "virtual_hosts".into(), 0.into(), "routes".into()]);
    let existing = at_mut(&mut bootstrap, &routes_path)
        .and_then(Value::as_sequence_mut)
        .ok_or_else(|| missing("routes"))?;
    for (i, route) in routes.into_iter().enumerate() {
        existing.insert(i, route);
    }
    *at_mut(&mut bootstrap, &["static_resources".into(), "clusters".into()])
        .ok_or_else(|| missing("clusters"))? = Value::Sequence(clusters);
    Ok(bootstrap)
}

/// The HTTP connection manager's filters (the filter, the admission, the guard, the router), its
/// access logs (the metering log, the usage journal when configured, the request log unless
/// turned off) and its tracing.
fn connection_manager(
    loaded: &Loaded,
    hcm: &mut Value,
    values: &Values,
    filter: Template,
) -> Result<(), Error> {
    let c = &loaded.config;
    let mut filter_entry = template::render(filter, values)?;
    if let Some(live) = &c.envoy.live_config {
        let type_url = filter_entry
            .get("typed_config")
            .and_then(|t| t.get("@type"))
            .and_then(Value::as_str)
            .ok_or_else(|| Error::Internal(format!("{}: no typed_config @type", filter.path)))?
            .to_owned();
        filter_entry = template::render(
            template::FILTER_ECDS,
            &values
                .clone()
                .set("ECDS_PATH", live.filter_path().display().to_string())
                .set("ECDS_DIR", live.dir.display().to_string())
                .set("ECDS_TYPE_URL", type_url),
        )?;
    }
    let filters = vec![
        filter_entry,
        super::admission_filter(loaded, template::render(template::FILTER_ADMISSION, values)?)?,
        template::render(template::FILTER_GUARD, values)?,
        tree(&Router::new())?,
    ];
    if !set(hcm, "http_filters", Value::Sequence(filters)) {
        return Err(missing("http_filters"));
    }
    let mut access_logs = vec![template::render(template::ACCESS_LOG_METERING, values)?];
    if let Some(path) = c.sidecar.metering.as_ref().and_then(|m| m.journal_path.as_ref()) {
        let journal = values.clone().set("JOURNAL_PATH", path.display().to_string());
        access_logs.push(template::render(template::ACCESS_LOG_JOURNAL, &journal)?);
    }
    if c.envoy.access_log.enabled {
        let log = values.clone().set("ACCESS_LOG_PATH", c.envoy.access_log.path.display().to_string());
        access_logs.push(template::render(template::ACCESS_LOG_REQUESTS, &log)?);
    }
    if !set(hcm, "access_log", Value::Sequence(access_logs)) {
        return Err(missing("access_log"));
    }
    if let Some(t) = &c.tracing {
        set(hcm, "tracing", template::render(template::TRACING, &tracing_values(t))?);
    }
    Ok(())
}

/// The routes that go before the bootstrap's own: a picking pool's, whose retries walk the
/// sidecar's endpoint list, and each fallback chain's (a pool in a chain keeps the chain's route:
/// its retries move to the next pool instead), whose composite clusters are added to `clusters`.
fn pool_routes(loaded: &Loaded, clusters: &mut Vec<Value>) -> Result<Vec<Value>, Error> {
    let c = &loaded.config;
    let mut routes = Vec::new();
    for pool in c.pools.iter().filter(|p| p.picker.is_some() && p.fallback.is_empty()) {
        let retries = pool.endpoints.len().saturating_sub(1).max(1);
        let route = Values::new().set("NAME", pool.name.as_str()).set("RETRIES", retries);
        routes.push(template::render(template::PICKER_ROUTE, &route)?);
    }
    for pool in c.pools.iter().filter(|p| !p.fallback.is_empty()) {
        let mut members = vec![Named { name: endpoints_cluster(pool) }];
        for other in &pool.fallback {
            let other =
                c.pool(other).ok_or_else(|| FieldError::new("pools", format!("unknown pool '{other}'")))?;
            members.push(Named { name: endpoints_cluster(other) });
        }
        let chain = Values::new()
            .set("NAME", pool.name.as_str())
            .set("SUB_CLUSTERS", tree(&members)?)
            .set("RETRIES", pool.fallback.len());
        clusters.push(template::render(template::FALLBACK_CLUSTER, &chain)?);
        routes.push(template::render(template::FALLBACK_ROUTE, &chain)?);
    }
    Ok(routes)
}

/// `values` with the edge settings' placeholders of envoy/bootstrap.yaml filled from `edge`.
fn with_edge(values: Values, edge: &EdgeSection) -> Values {
    values
        .set("MAX_HEAP_BYTES", edge.max_heap_bytes)
        .set("MAX_DOWNSTREAM_CONNECTIONS", edge.max_downstream_connections)
        .set("REQUEST_HEADERS_TIMEOUT", duration(edge.request_headers_timeout_ms))
        .set("REQUEST_TIMEOUT", duration(edge.request_timeout_ms))
        .set("MAX_REQUEST_HEADERS_KB", edge.max_request_headers_kb)
        .set("MAX_STREAM_DURATION", duration(edge.max_stream_duration_ms))
}

/// The status and body of envoy/bootstrap.yaml's catch-all route, the direct response to a
/// request the filter did not route (no route reaches a pool without the filter's decision),
/// which the mesh targets' catch-all routes answer too.
///
/// # Errors
/// An internal template error.
pub fn not_routed_response() -> Result<(u64, String), Error> {
    let values = Values::new().set("ADMIN_PORT", 0).set("LISTEN_PORT", 0).set("BUFFER_LIMIT_BYTES", 0);
    let values = with_edge(values, &EdgeSection::default());
    let bootstrap = template::render(template::BOOTSTRAP, &values)?;
    let hcm = bootstrap
        .get("static_resources")
        .and_then(|r| r.get("listeners"))
        .and_then(|l| l.get(0))
        .and_then(|l| l.get("filter_chains"))
        .and_then(|c| c.get(0))
        .and_then(|c| c.get("filters"))
        .and_then(|f| f.get(0))
        .and_then(|f| f.get("typed_config"))
        .ok_or_else(|| missing("http_connection_manager"))?;
    let direct = hcm
        .get("route_config")
        .and_then(|r| r.get("virtual_hosts"))
        .and_then(|v| v.get(0))
        .and_then(|v| v.get("routes"))
        .and_then(Value::as_sequence)
        .and_then(|routes| routes.last())
        .and_then(|r| r.get("direct_response"))
        .ok_or_else(|| missing("the catch-all route's direct_response"))?;
    let status = direct.get("status").and_then(Value::as_u64);
    let body = direct.get("body").and_then(|b| b.get("inline_string")).and_then(Value::as_str);
    match (status, body) {
        (Some(status), Some(body)) => Ok((status, body.to_owned())),
        _ => Err(missing("the catch-all route's status and body")),
    }
}

/// The retry conditions of a fallback chain's route (envoy/fallback_route.yaml), which the mesh
/// targets reuse for their retries.
///
/// # Errors
/// An internal template error.
pub fn fallback_retry_on() -> Result<String, Error> {
    let route =
        template::render(template::FALLBACK_ROUTE, &Values::new().set("NAME", "chain").set("RETRIES", 1))?;
    route
        .get("route")
        .and_then(|r| r.get("retry_policy"))
        .and_then(|r| r.get("retry_on"))
        .and_then(Value::as_str)
        .map(str::to_owned)
        .ok_or_else(|| Error::Internal("envoy/fallback_route.yaml: no retry_on".into()))
}

/// The sidecar's cluster (envoy/ext_proc_cluster.yaml): one endpoint per replica from `sidecar`
/// on, their health checks (envoy/ext_proc_health.yaml), and mTLS when `sidecar.tls` is set.
fn ext_proc_cluster(loaded: &Loaded, values: &Values, sidecar: &HostPort) -> Result<Value, Error> {
    let mut cluster = template::render(template::EXT_PROC_CLUSTER, values)?;
    let endpoints = tree(&super::upgrades::sidecar_endpoints(loaded, sidecar))?;
    let group = at_mut(&mut cluster, &["load_assignment".into(), "endpoints".into(), 0.into()]);
    let placed = group.is_some_and(|g| set(g, "lb_endpoints", endpoints))
        && merge(&mut cluster, super::upgrades::sidecar_health()?);
    if !placed {
        return Err(Error::Internal("envoy/ext_proc_cluster.yaml: no endpoint group".into()));
    }
    if !sidecar.is_ip {
        set(&mut cluster, "type", Value::String("STRICT_DNS".to_owned()));
    }
    if let Some(tls) = &loaded.config.sidecar.tls {
        let path = |p: &std::path::Path| loaded.resolve(p).display().to_string();
        let tls_values = Values::new()
            .set("SIDECAR_SERVER_NAME", tls.server_name.as_str())
            .set("CLIENT_CERT_FILE", path(&tls.envoy_cert_file))
            .set("CLIENT_KEY_FILE", path(&tls.envoy_key_file))
            .set("SIDECAR_CA_FILE", path(&tls.ca_file));
        set(
            &mut cluster,
            "transport_socket",
            template::render(template::EXT_PROC_UPSTREAM_TLS, &tls_values)?,
        );
    }
    Ok(cluster)
}

/// A pool's cluster (envoy/pool_cluster.yaml) with its endpoints and the settings the gateway
/// config gives it.
fn pool_cluster(i: usize, pool: &PoolSection) -> Result<Value, Error> {
    let name = endpoints_cluster(pool);
    let mut endpoints = Vec::with_capacity(pool.endpoints.len());
    let mut all_ip = true;
    for (k, e) in pool.endpoints.iter().enumerate() {
        let hp = parse_host_port(e)
            .ok_or_else(|| FieldError::new(format!("pools[{i}].endpoints[{k}]"), "must be host:port"))?;
        all_ip &= hp.is_ip;
        endpoints.push(LbEndpoint::new(hp.host, hp.port));
    }
    if endpoints.is_empty() {
        return Err(FieldError::new(
            format!("pools[{i}].endpoints"),
            "required by the standalone target (host:port of each vLLM server)",
        )
        .into());
    }
    let values = Values::new().set("POOL", name.as_str()).set("ENDPOINTS", tree(&endpoints)?);
    let mut cluster = template::render(template::POOL_CLUSTER, &values)?;
    let bad = || Error::Internal("envoy/pool_cluster.yaml: unexpected shape".into());
    let (cb, hc, od) = (&pool.circuit_breakers, &pool.health_check, &pool.outlier_detection);
    let settings = PoolClusterSettings {
        // Names are resolved, every address they return is an endpoint (a headless Service).
        kind: (!all_ip).then_some("STRICT_DNS"),
        connect_timeout: duration(pool.connect_timeout_ms),
        outlier_detection: OutlierDetection {
            consecutive_5xx: od.consecutive_5xx,
            base_ejection_time: duration(od.base_ejection_time_ms),
            max_ejection_percent: od.max_ejection_percent,
        },
    };
    let thresholds = Thresholds {
        max_connections: cb.max_connections,
        max_pending_requests: cb.max_pending_requests,
        max_requests: cb.max_requests,
    };
    let check = HealthCheck {
        timeout: duration(hc.timeout_ms),
        interval: duration(hc.interval_ms),
        unhealthy_threshold: hc.unhealthy_threshold,
        healthy_threshold: hc.healthy_threshold,
        http_health_check: HttpHealthCheck { path: hc.path.clone() },
    };
    let (settings, thresholds, check) = (tree(&settings)?, tree(&thresholds)?, tree(&check)?);
    let merged = merge(&mut cluster, settings)
        && at_mut(&mut cluster, &["circuit_breakers".into(), "thresholds".into(), 0.into()])
            .is_some_and(|t| merge(t, thresholds))
        && at_mut(&mut cluster, &["health_checks".into(), 0.into()]).is_some_and(|h| merge(h, check));
    if !merged {
        return Err(bad());
    }
    if pool.picker.is_some() {
        // The sidecar's pick in envoy.lb metadata, LEAST_REQUEST without one.
        let policy = template::render(template::POOL_PICKER_LB, &Values::new())?;
        let fields = cluster.as_mapping_mut().ok_or_else(bad)?;
        if fields.remove("load_balancing_policy").is_none() {
            return Err(bad());
        }
        set(&mut cluster, "load_balancing_policy", policy);
    }
    Ok(cluster)
}

#[cfg(test)]
mod tests {
    use super::duration;

    #[test]
    fn durations() {
        assert_eq!(duration(1000), "1s");
        assert_eq!(duration(1500), "1.500s");
        assert_eq!(duration(50), "0.050s");
    }
}
