//! The filter's plugin config and the sidecar's config, each accepted by the component's own
//! parser before it is returned: a rendered config that the component would refuse at start-up
//! is an error here, reported against the gateway config's field.

use std::path::Path;

use gateway_tokenize::spec::{ChatTemplateSpec, TokenizerSpec};

use crate::config::FieldError;
use crate::config::{
    GatewayConfig, LimitsSection, Loaded, PickerValue, PoolSection, USAGE_DELIVERY_MARGIN_MS,
};
use crate::tree::{b, f, map, n, s, seq, strings, to_json, to_yaml, Value};

use super::Error;

/// The wasm filter's plugin config, validated by `gateway_filter::config::Config::from_json`.
///
/// # Errors
/// A field the filter rejects (named as in the gateway config).
pub fn filter_config(loaded: &Loaded) -> Result<Value, Error> {
    let c = &loaded.config;
    let mut top = Vec::new();
    if let Some(max) = c.filter.full_parse_max_bytes {
        top.push(("full_parse_max_bytes", n(max)));
    }
    if let Some(max) = c.filter.max_body_bytes {
        top.push(("max_body_bytes", n(max)));
    }
    if let Some(max) = c.filter.max_uploads_per_tenant {
        top.push(("max_uploads_per_tenant", n(max)));
    }
    if let Some(max) = c.filter.max_n {
        top.push(("max_n", n(max)));
    }
    let tenants = c.tenants.iter().map(|t| {
        let mut fields = vec![("id", s(&t.id)), ("api_keys_sha256", strings(&t.api_keys_sha256))];
        if let Some(tier) = &t.tier {
            fields.push(("tier", s(tier)));
        }
        if let Some(models) = &t.models {
            fields.push(("models", strings(models)));
        }
        map(fields)
    });
    top.push(("tenants", seq(tenants)));
    let mut models = Vec::with_capacity(c.models.len());
    for m in &c.models {
        let mut fields = vec![("name", s(&m.name))];
        if let Some(pool) = &m.pool {
            fields.push(("pool", s(pool)));
        }
        if let Some(pools) = &m.pools {
            let split = pools.iter().map(|p| map([("pool", s(&p.pool)), ("weight", n(p.weight))]));
            fields.push(("pools", seq(split)));
        }
        if let Some(served) = &m.served_model_name {
            fields.push(("served_model_name", s(served)));
        }
        fields.push(("max_model_len", n(m.max_model_len)));
        if let Some(bytes) = m.max_token_bytes {
            fields.push(("max_token_bytes", n(bytes)));
        }
        if let Some(aliases) = &m.aliases {
            fields.push(("aliases", strings(aliases)));
        }
        if let Some(adapters) = &m.lora_adapters {
            fields.push(("lora_adapters", strings(adapters)));
        }
        if m.tokenizer.is_some() || m.model_dir.is_some() {
            // What the bounds cannot decide goes to the sidecar's exact count.
            fields.push(("exact_count", b(true)));
        }
        models.push(map(fields));
    }
    top.push(("models", seq(models)));
    if c.pools.iter().any(|p| p.picker.is_some()) {
        // The prompt-prefix hashes the sidecar's picker scores affinity by (the filter's
        // defaults: 64-byte blocks, at most 256).
        top.push(("prefix_hashing", map::<&str>([])));
    }
    // The rendered sidecars read the decision from the filter state; the headers are opt-in.
    top.push(("upstream_headers", s(c.filter.upstream_headers.as_deref().unwrap_or("routing"))));
    let config = map(top);

    let json = to_json(&config).map_err(Error::Internal)?;
    if let Err(e) = gateway_filter::config::Config::from_json(json.as_bytes()) {
        // The filter's paths are the gateway config's (tenants[i], models[i] map one to one),
        // except for the top-level body limit.
        let field = match e.path.as_str() {
            "max_body_bytes" => "filter.max_body_bytes".to_owned(),
            "full_parse_max_bytes" => "filter.full_parse_max_bytes".to_owned(),
            "max_uploads_per_tenant" => "filter.max_uploads_per_tenant".to_owned(),
            "max_n" => "filter.max_n".to_owned(),
            "upstream_headers" => "filter.upstream_headers".to_owned(),
            "configuration" => "config".to_owned(),
            other => other.to_owned(),
        };
        return Err(FieldError::new(field, format!("{} (gateway-filter)", e.message)).into());
    }
    Ok(config)
}

/// Where a sidecar config is for: the standalone host, or a Kubernetes pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flavor {
    /// Next to the standalone Envoy: `sidecar.listen`, pool `endpoints`, `redis` as given.
    Standalone,
    /// A pod (istio and envoy-gateway targets): all interfaces, pool Services, the trial Redis
    /// when configured, and an endpoint-picker listener per picking pool
    /// ([`super::kubernetes::endpoint_pickers`]).
    Kubernetes,
}

/// The trial Redis's URL inside the cluster.
pub fn trial_redis_url(namespace: &str) -> String {
    format!("redis://llm-gateway-redis.{namespace}.svc.cluster.local:6379/0")
}

fn limits(l: &LimitsSection) -> Value {
    let mut fields = Vec::new();
    for (name, value) in [
        ("requests_per_minute", l.requests_per_minute),
        ("request_burst", l.request_burst),
        ("tokens_per_minute", l.tokens_per_minute),
        ("token_burst", l.token_burst),
    ] {
        if let Some(v) = value {
            fields.push((name, n(v)));
        }
    }
    map(fields)
}

/// Scrape URLs of a pool's endpoints for the sidecar (its `/metrics`). A picking pool's are its
/// `endpoints` on every target: the picker names one of them to Envoy as `ip:port`, which a
/// Service's address is not (the sidecar does not discover a Service's Pods).
fn scrape_urls(pool: &PoolSection, flavor: Flavor) -> Vec<String> {
    match (flavor, &pool.service) {
        (Flavor::Kubernetes, Some(service)) if pool.picker.is_none() => {
            vec![format!("http://{}:{}", service.fqdn(), service.port)]
        }
        _ => pool.endpoints.iter().map(|e| format!("http://{e}")).collect(),
    }
}

/// The sidecar's config, validated by `gateway_ext_proc::config::Config::from_yaml`.
///
/// # Errors
/// A field the sidecar rejects, named as in the gateway config.
pub fn sidecar_config(loaded: &Loaded, flavor: Flavor) -> Result<Value, Error> {
    let c = &loaded.config;
    let mut top = Vec::new();
    let listen = match flavor {
        Flavor::Standalone => c.sidecar.listen.to_string(),
        Flavor::Kubernetes => format!("0.0.0.0:{}", c.sidecar.listen.port()),
    };
    top.push(("listen", s(listen)));
    if let (Flavor::Standalone, Some(tls)) = (flavor, &c.sidecar.tls) {
        let path = |p: &std::path::Path| s(loaded.resolve(p).display().to_string());
        top.push((
            "tls",
            map([
                ("cert_file", path(&tls.cert_file)),
                ("key_file", path(&tls.key_file)),
                ("client_ca_file", path(&tls.client_ca_file)),
            ]),
        ));
    }
    top.push(("redis", redis(loaded, flavor)));
    let tenants = c.tenants.iter().map(|t| {
        let mut fields = vec![("id", s(&t.id)), ("limits", limits(&t.limits))];
        if !t.model_limits.is_empty() {
            let per_model = t.model_limits.iter().map(|(model, l)| (model.clone(), limits(l)));
            fields.push(("model_limits", map(per_model)));
        }
        if t.quota != Default::default() {
            fields.push(("quota", to_value(&t.quota)?));
        }
        if !t.model_quotas.is_empty() {
            fields.push(("model_quotas", to_value(&t.model_quotas)?));
        }
        Ok(map(fields))
    });
    top.push(("tenants", seq(tenants.collect::<Result<Vec<_>, Error>>()?)));
    if !c.prices.is_empty() {
        top.push(("prices", to_value(&c.prices)?));
    }
    let mut metering = Vec::new();
    if let Some(m) = &c.sidecar.metering {
        if let Some(stream) = &m.stream {
            metering.push(("stream", s(stream)));
        }
        if let Some(len) = m.stream_maxlen {
            metering.push(("stream_maxlen", n(len)));
        }
        if let Some(bytes) = m.max_json_body_bytes {
            metering.push(("max_json_body_bytes", n(bytes)));
        }
    }
    // A reservation is charged once no usage arrived within the longest stream lifetime (the
    // standalone bootstrap's max_stream_duration; on the mesh targets, the bound set there).
    let record_after = c.envoy.edge.max_stream_duration_ms.saturating_add(USAGE_DELIVERY_MARGIN_MS);
    metering.push(("reservations", map([("record_after_ms", n(record_after))])));
    if let (Flavor::Standalone, Some(path)) =
        (flavor, c.sidecar.metering.as_ref().and_then(|m| m.journal_path.as_ref()))
    {
        metering.push(("journal", map([("path", s(path.display().to_string()))])));
    }
    top.push(("metering", map(metering)));
    if let Some(grace) = c.sidecar.shutdown_grace_ms {
        top.push(("shutdown_grace_ms", n(grace)));
    }
    if let Some(max) = c.filter.max_body_bytes {
        // The exact count receives bodies up to the filter's limit.
        top.push(("context", map([("max_body_bytes", n(max))])));
    }
    let counted = exact_count_models(loaded, flavor)?;
    if !counted.is_empty() {
        top.push(("models", seq(counted)));
    }
    // Sidecar pools[j] is the gateway config's pools[shed[j]]: the pools it sheds in front of
    // or picks endpoints for (or both).
    let shed: Vec<usize> = c
        .pools
        .iter()
        .enumerate()
        .filter(|(_, p)| p.shedding.is_some() || p.picker.is_some() || p.flow_control.is_some())
        .map(|(i, _)| i)
        .collect();
    if !shed.is_empty() {
        let pools = shed.iter().filter_map(|&i| c.pools.get(i)).map(|p| -> Result<Value, Error> {
            let mut fields = vec![("name", s(&p.name)), ("endpoints", strings(scrape_urls(p, flavor)))];
            if let Some(sh) = &p.shedding {
                if let Some(v) = sh.scrape_interval_ms {
                    fields.push(("scrape_interval_ms", n(v)));
                }
                if let Some(v) = sh.max_queue_depth {
                    fields.push(("max_queue_depth", n(v)));
                }
                if let Some(v) = sh.max_kv_cache_usage {
                    fields.push(("max_kv_cache_usage", f(v)));
                }
                if let Some(v) = sh.max_in_flight {
                    fields.push(("max_in_flight", n(v)));
                }
            }
            if let Some(picker) = &p.picker {
                let members = picker.members().into_iter().map(|(name, value)| match value {
                    PickerValue::Float(v) => (name, f(v)),
                    PickerValue::Int(v) => (name, n(v)),
                    PickerValue::Bool(v) => (name, b(v)),
                });
                fields.push(("picker", map(members)));
            }
            if let Some(flow) = &p.flow_control {
                fields.push(("flow_control", to_value(flow)?));
            }
            if let Some(v) = p.admission_leases {
                fields.push(("admission_leases", b(v)));
            }
            Ok(map(fields))
        });
        top.push(("pools", seq(pools.collect::<Result<Vec<_>, _>>()?)));
    }
    if let Some(flow) = &c.flow_control {
        top.push(("flow_control", to_value(flow)?));
    }
    if let Some(t) = &c.tracing {
        top.push((
            "tracing",
            map([
                ("otlp_endpoint", s(format!("http://{}", t.otlp_endpoint))),
                ("sampling_ratio", f(t.sampling_percent / 100.0)),
            ]),
        ));
    }
    if flavor == Flavor::Kubernetes {
        // On the mesh targets each picking pool's picks come from its InferencePool's call to an
        // endpoint-picker listener of its own (then the admission does not pick for it); the
        // standalone sidecar picks on the admission path.
        let pickers = super::kubernetes::endpoint_pickers(loaded)?;
        if !pickers.is_empty() {
            let pickers = pickers.iter().map(|epp| {
                let mut fields = vec![("pool", s(epp.pool)), ("listen", s(format!("0.0.0.0:{}", epp.port)))];
                if let Some(max) = c.filter.max_body_bytes {
                    // It buffers the bodies the filter let through.
                    fields.push(("max_body_bytes", n(max)));
                }
                map(fields)
            });
            top.push(("endpoint_pickers", seq(pickers)));
        }
    }
    let levels: Vec<(String, Value)> =
        c.tiers.iter().filter_map(|(tier, t)| Some((tier.clone(), f(t.shed_level?)))).collect();
    if !levels.is_empty() {
        top.push(("shedding", map([("tier_levels", map(levels))])));
    }
    if let Some(metrics) = c.sidecar.metrics_listen {
        let addr = match flavor {
            Flavor::Standalone => metrics.to_string(),
            Flavor::Kubernetes => format!("0.0.0.0:{}", metrics.port()),
        };
        top.push(("metrics_listen", s(addr)));
    }
    let config = map(top);

    let yaml = to_yaml(&config).map_err(Error::Internal)?;
    match gateway_ext_proc::config::Config::from_yaml(&yaml) {
        Ok(_) => Ok(config),
        Err(gateway_ext_proc::config::ConfigError::Invalid { field, message }) => {
            Err(FieldError::new(sidecar_field(&field, &shed), format!("{message} (gateway-ext-proc)")).into())
        }
        Err(other) => {
            Err(Error::Internal(format!("gateway-ext-proc rejects the rendered sidecar config: {other}")))
        }
    }
}

/// Where `kubernetes.sidecar.redis_tls_secret` is mounted in the sidecar's pods.
pub const REDIS_TLS_MOUNT: &str = "/etc/llm-gateway/redis-tls";
/// The env var the pods get `kubernetes.sidecar.redis_password_secret` in.
pub const REDIS_PASSWORD_ENV: &str = "REDIS_PASSWORD";

fn redis(loaded: &Loaded, flavor: Flavor) -> Value {
    let c: &GatewayConfig = &loaded.config;
    let r = &c.redis;
    let mut fields = Vec::new();
    let trial = match (flavor, &c.kubernetes) {
        (Flavor::Kubernetes, Some(k8s)) if k8s.trial_redis.is_some() => Some(trial_redis_url(&k8s.namespace)),
        _ => None,
    };
    match (trial, &r.url) {
        (Some(url), _) => fields.push(("url", s(url))),
        (None, Some(url)) => fields.push(("url", s(url))),
        (None, None) => fields.push(("cluster_urls", strings(&r.cluster_urls))),
    }
    if let Some(ms) = r.command_timeout_ms {
        fields.push(("command_timeout_ms", n(ms)));
    }
    if let Some(share) = r.local_share {
        fields.push(("local_share", Value::from(share)));
    }
    fields.push(("lease_fraction", Value::from(c.lease_fraction())));
    if let Some(ms) = r.lease_ttl_ms {
        fields.push(("lease_ttl_ms", n(ms)));
    }
    if let Some(prefix) = &r.key_prefix {
        fields.push(("key_prefix", s(prefix)));
    }
    if let Some(mode) = r.failure_mode {
        fields.push(("failure_mode", s(mode.as_str())));
    }
    let per_tier: Vec<(String, Value)> =
        c.tiers.iter().filter_map(|(tier, t)| Some((tier.clone(), s(t.failure_mode?.as_str())))).collect();
    if !per_tier.is_empty() {
        fields.push(("tier_failure_modes", map(per_tier)));
    }
    if let Some(user) = &r.username {
        fields.push(("username", s(user)));
    }
    let path = |p: &std::path::Path| s(loaded.resolve(p).display().to_string());
    let workload = match flavor {
        Flavor::Kubernetes => c.kubernetes.as_ref().map(|k| &k.sidecar),
        Flavor::Standalone => None,
    };
    match (workload.and_then(|w| w.redis_password_secret.as_ref()), &r.password_file, &r.password_env) {
        (Some(_), _, _) => fields.push(("password_env", s(REDIS_PASSWORD_ENV))),
        (None, Some(file), _) => fields.push(("password_file", path(file))),
        (None, None, Some(var)) => fields.push(("password_env", s(var))),
        (None, None, None) => {}
    }
    match (workload.and_then(|w| w.redis_tls_secret.as_ref().map(|_| w)), &r.tls) {
        (Some(w), _) => {
            let mut t = vec![("ca_file", s(format!("{REDIS_TLS_MOUNT}/ca.crt")))];
            if w.redis_tls_client_certificate {
                t.push(("cert_file", s(format!("{REDIS_TLS_MOUNT}/tls.crt"))));
                t.push(("key_file", s(format!("{REDIS_TLS_MOUNT}/tls.key"))));
            }
            fields.push(("tls", map(t)));
        }
        (None, Some(tls)) => {
            let mut t = Vec::new();
            for (name, file) in
                [("ca_file", &tls.ca_file), ("cert_file", &tls.cert_file), ("key_file", &tls.key_file)]
            {
                if let Some(file) = file {
                    t.push((name, path(file)));
                }
            }
            fields.push(("tls", map(t)));
        }
        (None, None) => {}
    }
    if let Some(breaker) = &r.breaker {
        let mut b = Vec::new();
        if let Some(t) = breaker.failure_threshold {
            b.push(("failure_threshold", n(t)));
        }
        if let Some(ms) = breaker.open_ms {
            b.push(("open_ms", n(ms)));
        }
        fields.push(("breaker", map(b)));
    }
    map(fields)
}

/// Where the sidecar pods mount `kubernetes.sidecar.tokenizers`.
pub const TOKENIZERS_MOUNT: &str = "/models";

/// The tokenizer and chat template of `models[i]` with their files resolved on this machine
/// (against the config file's folder), and the gateway-config field they come from; None for a
/// model without exact counting.
fn local_specs(
    loaded: &Loaded,
    i: usize,
) -> Result<Option<(TokenizerSpec, Option<ChatTemplateSpec>, String)>, Error> {
    let Some(m) = loaded.config.models.get(i) else { return Ok(None) };
    if let Some(dir) = &m.model_dir {
        let dir = loaded.resolve(dir);
        let field = format!("models[{i}].model_dir");
        let file = |name: &str| Some(dir.join(name)).filter(|p| p.is_file());
        let tokenizer = match (file("tokenizer.json"), file("tekken.json")) {
            (Some(p), _) => TokenizerSpec { huggingface: Some(p), tiktoken: None, tekken: None },
            (None, Some(p)) => TokenizerSpec { huggingface: None, tiktoken: None, tekken: Some(p) },
            (None, None) => {
                return Err(FieldError::new(
                    field,
                    format!("{}: holds neither tokenizer.json nor tekken.json", dir.display()),
                )
                .into())
            }
        };
        let (config, jinja) = (file("tokenizer_config.json"), file("chat_template.jinja"));
        let template = (config.is_some() || jinja.is_some()).then(|| ChatTemplateSpec {
            tokenizer_config: config,
            jinja,
            bos_token: None,
            eos_token: None,
            content_format: Default::default(),
        });
        return Ok(Some((tokenizer, template, field)));
    }
    let Some(tokenizer) = &m.tokenizer else { return Ok(None) };
    let resolve = |p: &Path| loaded.resolve(p);
    let template = m.chat_template.as_ref().map(|t| t.map_paths(resolve));
    Ok(Some((tokenizer.map_paths(resolve), template, format!("models[{i}]"))))
}

/// The sidecar's `models[]`: every model with a tokenizer, its files loaded here by the
/// sidecar's own loader (a missing or bad file is an error naming the gateway config's field),
/// then named as the sidecar sees them: these paths on the standalone host, or below
/// [`TOKENIZERS_MOUNT`] in a pod (`kubernetes.sidecar.tokenizers`).
fn exact_count_models(loaded: &Loaded, flavor: Flavor) -> Result<Vec<Value>, Error> {
    let c = &loaded.config;
    let mut out = Vec::new();
    for (i, m) in c.models.iter().enumerate() {
        let Some((tokenizer, template, field)) = local_specs(loaded, i)? else { continue };
        let local = gateway_ext_proc::config::ModelConfig {
            name: m.name.clone(),
            max_model_len: m.max_model_len,
            tokenizer: tokenizer.clone(),
            chat_template: template.clone(),
        };
        if let Err(e) =
            gateway_ext_proc::admission::context::ContextChecker::from_config(std::slice::from_ref(&local))
        {
            let (at, message) = match e {
                gateway_ext_proc::config::ConfigError::Invalid { field: f, message } => (f, message),
                other => (String::new(), other.to_string()),
            };
            // `models[0].tokenizer.huggingface` of the one-model check: this model's field.
            let sub = at.strip_prefix("models[0]").unwrap_or("");
            let named = if field.ends_with("model_dir") { field.clone() } else { format!("{field}{sub}") };
            return Err(FieldError::new(named, format!("{message} (gateway-ext-proc)")).into());
        }
        let (tokenizer, template) = match flavor {
            Flavor::Standalone => (tokenizer, template),
            Flavor::Kubernetes => {
                let Some(volume) = c.kubernetes.as_ref().and_then(|k| k.sidecar.tokenizers.as_ref()) else {
                    return Err(FieldError::new(
                        "kubernetes.sidecar.tokenizers",
                        format!("needed by {field}: the sidecar pods read tokenizer files from a volume"),
                    )
                    .into());
                };
                let root = loaded.resolve(&volume.root);
                let mut outside = None;
                let mut in_pod = |p: &Path| match p.strip_prefix(&root) {
                    Ok(rel) => Path::new(TOKENIZERS_MOUNT).join(rel),
                    Err(_) => {
                        outside.get_or_insert_with(|| p.display().to_string());
                        p.to_path_buf()
                    }
                };
                let mapped = (tokenizer.map_paths(&mut in_pod), template.map(|t| t.map_paths(&mut in_pod)));
                if let Some(path) = outside {
                    return Err(FieldError::new(
                        field,
                        format!(
                            "{path} is not below kubernetes.sidecar.tokenizers.root ({})",
                            root.display()
                        ),
                    )
                    .into());
                }
                mapped
            }
        };
        let mut fields = vec![
            ("name", s(&m.name)),
            ("max_model_len", n(m.max_model_len)),
            ("tokenizer", to_value(&tokenizer)?),
        ];
        if let Some(t) = &template {
            fields.push(("chat_template", to_value(t)?));
        }
        out.push(map(fields));
    }
    Ok(out)
}

/// A section the gateway config takes over from the sidecar's own config type, as a tree.
fn to_value(section: &impl serde::Serialize) -> Result<Value, Error> {
    serde_yaml_ng::to_value(section).map_err(|e| Error::Internal(e.to_string()))
}

/// Maps a field of the rendered sidecar config back to the gateway config's field.
fn sidecar_field(field: &str, shed: &[usize]) -> String {
    if let Some(rest) = field.strip_prefix("pools[") {
        if let Some((j, rest)) = rest.split_once(']') {
            if let Some(i) = j.parse::<usize>().ok().and_then(|j| shed.get(j)) {
                return match rest.strip_prefix('.') {
                    Some("name") => format!("pools[{i}].name"),
                    Some(r)
                        if r.starts_with("endpoints")
                            || r.starts_with("picker")
                            || r.starts_with("flow_control") =>
                    {
                        format!("pools[{i}].{r}")
                    }
                    Some(r) => format!("pools[{i}].shedding.{r}"),
                    None => format!("pools[{i}].shedding"),
                };
            }
        }
    }
    if field == "context.max_body_bytes" {
        return "filter.max_body_bytes".to_owned();
    }
    if let Some(tier) = field.strip_prefix("shedding.tier_levels.") {
        return format!("tiers.{tier}.shed_level");
    }
    if let Some(tier) = field.strip_prefix("redis.tier_failure_modes.") {
        return format!("tiers.{tier}.failure_mode");
    }
    if field.starts_with("tls") {
        return format!("sidecar.{field}");
    }
    if field == "listen"
        || field == "metrics_listen"
        || field == "shutdown_grace_ms"
        || field.starts_with("metering")
    {
        return format!("sidecar.{field}");
    }
    field.to_owned()
}

#[cfg(test)]
mod tests {
    use super::sidecar_field;

    #[test]
    fn sidecar_fields_map_back() {
        assert_eq!(sidecar_field("pools[1].max_queue_depth", &[0, 3]), "pools[3].shedding.max_queue_depth");
        assert_eq!(sidecar_field("pools[0]", &[2]), "pools[2].shedding");
        assert_eq!(sidecar_field("pools[0].endpoints[1]", &[2]), "pools[2].endpoints[1]");
        assert_eq!(
            sidecar_field("pools[1].picker.affinity_load_factor", &[0, 4]),
            "pools[4].picker.affinity_load_factor"
        );
        assert_eq!(sidecar_field("shedding.tier_levels.batch", &[]), "tiers.batch.shed_level");
        assert_eq!(sidecar_field("tenants[0].limits.token_burst", &[]), "tenants[0].limits.token_burst");
        assert_eq!(
            sidecar_field("metering.max_json_body_bytes", &[]),
            "sidecar.metering.max_json_body_bytes"
        );
        assert_eq!(sidecar_field("shutdown_grace_ms", &[]), "sidecar.shutdown_grace_ms");
    }
}
