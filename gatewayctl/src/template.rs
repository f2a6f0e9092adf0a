//! The template files under `envoy/`, compiled in, and their `${NAME}` placeholders: the Envoy
//! configuration (bootstrap, filters, clusters, routes) that the standalone bootstrap, the Istio
//! EnvoyFilter and the Envoy Gateway EnvoyPatchPolicy share with `tests/stack.py`. The Kubernetes,
//! Istio and Envoy Gateway objects around it are typed documents ([`crate::render`]'s
//! `manifests`).
//!
//! The syntax is the subset of Python's `string.Template` that `tests/stack.py` renders the same
//! files with: `${NAME}` is replaced by a value, `$$` is a literal `$`. Values are inserted as
//! JSON (a string is quoted, a list is a one-line flow sequence), which YAML reads unchanged, so
//! the result is parsed with `serde_yaml_ng` into a [`Value`] tree (ordered mappings).

use std::collections::BTreeMap;

use crate::tree::Value;

/// One template: its path under the repository (for error messages) and its text.
#[derive(Debug, Clone, Copy)]
pub struct Template {
    /// Path relative to the repository root, e.g. `envoy/bootstrap.yaml`.
    pub path: &'static str,
    /// The file's text.
    pub text: &'static str,
}

macro_rules! template {
    ($path:literal) => {
        Template { path: $path, text: include_str!(concat!("../../", $path)) }
    };
}

/// The Envoy bootstrap (listener, route, admin); filters and clusters are inserted.
pub const BOOTSTRAP: Template = template!("envoy/bootstrap.yaml");
/// The wasm filter's HTTP filter entry.
pub const FILTER_WASM: Template = template!("envoy/filters/wasm.yaml");
/// The filter as an Envoy dynamic module (`filter-native/`), in the wasm filter's place.
pub const FILTER_NATIVE: Template = template!("envoy/filters/native.yaml");
/// The filter's entry with its configuration from a watched ECDS file (`envoy.live_config`).
pub const FILTER_ECDS: Template = template!("envoy/filters/ecds.yaml");
/// The admission ext_proc HTTP filter entry.
pub const FILTER_ADMISSION: Template = template!("envoy/filters/ext_proc_admission.yaml");
/// The admission filter wrapped in the matcher that skips it for leased admissions.
pub const FILTER_ADMISSION_LEASE_MATCHER: Template = template!("envoy/filters/admission_lease_matcher.yaml");
/// The RBAC guard before the router (nothing goes upstream without the filters' facts).
pub const FILTER_GUARD: Template = template!("envoy/filters/guard.yaml");
/// The metering ext_proc HTTP filter entry (Envoy Gateway, whose access log cannot log filter state).
pub const FILTER_METERING: Template = template!("envoy/filters/ext_proc_metering.yaml");
/// The metering gRPC access log entry (the HTTP connection manager's `access_log`).
pub const ACCESS_LOG_METERING: Template = template!("envoy/access_log_metering.yaml");
/// The usage journal: a file access log entry (standalone target, `sidecar.metering.journal_path`).
pub const ACCESS_LOG_JOURNAL: Template = template!("envoy/access_log_journal.yaml");
/// The request log: a file access log entry (standalone target, `envoy.access_log`).
pub const ACCESS_LOG_REQUESTS: Template = template!("envoy/access_log_requests.yaml");
/// The sidecar's cluster.
pub const EXT_PROC_CLUSTER: Template = template!("envoy/ext_proc_cluster.yaml");
/// The sidecar replicas' health checks and load balancing, merged into its cluster (standalone).
pub const EXT_PROC_HEALTH: Template = template!("envoy/ext_proc_health.yaml");
/// Envoy's command line for one hot-restart epoch (`envoy.hot_restart`; text, not YAML).
pub const START_ENVOY: Template = template!("envoy/hot_restart/start-envoy.sh");
/// The wrapper that starts the next epoch on SIGHUP (`envoy.hot_restart`; text, no placeholder).
pub const HOT_RESTARTER: Template = template!("envoy/hot_restart/hot-restarter.py");
/// The systemd unit of the hot-restarted Envoy (`envoy.hot_restart`; text).
pub const ENVOY_UNIT: Template = template!("envoy/hot_restart/llm-gateway-envoy.service");
/// mTLS to the sidecar: the transport socket of its cluster.
pub const EXT_PROC_UPSTREAM_TLS: Template = template!("envoy/ext_proc_upstream_tls.yaml");
/// One vLLM pool's cluster.
pub const POOL_CLUSTER: Template = template!("envoy/pool_cluster.yaml");
/// An ordered fallback chain: a composite cluster over pool clusters.
pub const FALLBACK_CLUSTER: Template = template!("envoy/fallback_cluster.yaml");
/// The route of a fallback chain, with its retry policy.
pub const FALLBACK_ROUTE: Template = template!("envoy/fallback_route.yaml");
/// The HTTP connection manager's OpenTelemetry tracing (`tracing`).
pub const TRACING: Template = template!("envoy/tracing.yaml");
/// The OpenTelemetry collector's cluster (`tracing`).
pub const OTEL_CLUSTER: Template = template!("envoy/otel_cluster.yaml");
/// The load-balancing policy of a picking pool's cluster (override host, LEAST_REQUEST fallback).
pub const POOL_PICKER_LB: Template = template!("envoy/pool_picker_lb.yaml");
/// The route of a picking pool, whose retries walk the sidecar's endpoint list.
pub const PICKER_ROUTE: Template = template!("envoy/picker_route.yaml");

/// A template could not be rendered: a placeholder without a value, or YAML that does not
/// parse after substitution. Both are bugs in gatewayctl or in the template, never in the
/// user's config (values are JSON-encoded).
#[derive(Debug, thiserror::Error)]
#[error("{path}: {message}")]
pub struct TemplateError {
    /// The template's path.
    pub path: &'static str,
    /// What went wrong.
    pub message: String,
}

/// Values for a template's placeholders, JSON-encoded on insertion.
#[derive(Debug, Default, Clone)]
pub struct Values(BTreeMap<&'static str, Value>);

impl Values {
    /// An empty set of values.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets one value (builder style).
    pub fn set(mut self, name: &'static str, value: impl Into<Value>) -> Self {
        self.0.insert(name, value.into());
        self
    }
}

/// Substitutes the placeholders of `template` with `values` (text out, not yet parsed).
///
/// # Errors
/// A placeholder without a value, or a `$` not followed by `{NAME}` or `$`.
pub fn substitute(template: Template, values: &Values) -> Result<String, TemplateError> {
    let fail = |message: String| TemplateError { path: template.path, message };
    let text = template.text;
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find('$') {
        let (before, after) = rest.split_at(at);
        out.push_str(before);
        let after = after.get(1..).unwrap_or_default();
        if let Some(tail) = after.strip_prefix('$') {
            out.push('$');
            rest = tail;
        } else if let Some(tail) = after.strip_prefix('{') {
            let end = tail.find('}').ok_or_else(|| fail("unterminated ${ placeholder".to_owned()))?;
            let (name, tail) = tail.split_at(end);
            let value = values.0.get(name).ok_or_else(|| fail(format!("no value for ${{{name}}}")))?;
            let json = crate::tree::to_json(value).map_err(fail)?;
            out.push_str(&json);
            rest = tail.get(1..).unwrap_or_default();
        } else {
            return Err(fail("a '$' must start ${NAME} or be written $$".to_owned()));
        }
    }
    out.push_str(rest);
    Ok(out)
}

/// Substitutes and parses a template into a value tree.
///
/// # Errors
/// As [`substitute`], or YAML that does not parse.
pub fn render(template: Template, values: &Values) -> Result<Value, TemplateError> {
    let text = substitute(template, values)?;
    serde_yaml_ng::from_str(&text).map_err(|e| TemplateError {
        path: template.path,
        message: format!("does not parse after substitution: {e}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: Template = Template { path: "t.yaml", text: "a: ${A}\nb: ${B}\nc: '$$5'\n" };

    #[test]
    fn substitutes_json_values() {
        let v = Values::new()
            .set("A", "x: y")
            .set("B", Value::Sequence(vec![Value::from(1u64), Value::from(2u64)]));
        assert_eq!(substitute(T, &v).unwrap(), "a: \"x: y\"\nb: [1,2]\nc: '$5'\n");
        let parsed = render(T, &v).unwrap();
        assert_eq!(parsed["a"], "x: y");
        assert_eq!(parsed["b"][1], 2);
        assert_eq!(parsed["c"], "$5");
    }

    #[test]
    fn missing_value_is_an_error() {
        let e = substitute(T, &Values::new().set("A", 1)).unwrap_err();
        assert_eq!(e.to_string(), "t.yaml: no value for ${B}");
    }

    #[test]
    fn stray_dollar_is_an_error() {
        let t = Template { path: "u.yaml", text: "a: $A\n" };
        assert!(substitute(t, &Values::new()).is_err());
    }

    #[test]
    fn every_template_parses_with_its_placeholders_filled() {
        // Each template with every placeholder it uses set to a plausible value.
        for t in [
            BOOTSTRAP,
            FILTER_WASM,
            FILTER_NATIVE,
            FILTER_ADMISSION,
            FILTER_ADMISSION_LEASE_MATCHER,
            FILTER_METERING,
            FILTER_GUARD,
            ACCESS_LOG_METERING,
            ACCESS_LOG_JOURNAL,
            EXT_PROC_CLUSTER,
            EXT_PROC_HEALTH,
            EXT_PROC_UPSTREAM_TLS,
            POOL_CLUSTER,
            FALLBACK_CLUSTER,
            FALLBACK_ROUTE,
        ] {
            let v = Values::new()
                .set("ADMIN_PORT", 1)
                .set("LISTEN_PORT", 2)
                .set("BUFFER_LIMIT_BYTES", 3)
                .set("FILTER_CONFIG_JSON", "{}")
                .set("WASM_PATH", "/x.wasm")
                .set("NATIVE_MODULE_PATH", "/x.so")
                .set("JOURNAL_PATH", "/var/lib/llm-gateway/usage.journal")
                .set("EXT_PROC_PORT", 4)
                .set("MAX_HEAP_BYTES", 1u64 << 30)
                .set("MAX_DOWNSTREAM_CONNECTIONS", 5)
                .set("REQUEST_HEADERS_TIMEOUT", "10s")
                .set("REQUEST_TIMEOUT", "60s")
                .set("MAX_REQUEST_HEADERS_KB", 32)
                .set("MAX_STREAM_DURATION", "3600s")
                .set("POOL", "p")
                .set("ENDPOINTS", Value::Sequence(Vec::new()))
                .set("NAME", "chain")
                .set("SUB_CLUSTERS", Value::Sequence(Vec::new()))
                .set("RETRIES", 1)
                .set("ADMISSION_FILTER", serde_yaml_ng::from_str::<Value>("{name: admission}").unwrap())
                .set("SIDECAR_SERVER_NAME", "ext-proc.test")
                .set("CLIENT_CERT_FILE", "/envoy.crt")
                .set("CLIENT_KEY_FILE", "/envoy.key")
                .set("SIDECAR_CA_FILE", "/ca.crt");
            render(t, &v).unwrap();
        }
    }
}
