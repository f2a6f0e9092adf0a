//! The filter's plugin config and the sidecar's config, each accepted by the component's own
//! parser before it is returned: a rendered config that the component would refuse at start-up
//! is an error here, reported against the gateway config's field.

use std::path::Path;

use gateway_ext_proc::config::ModelConfig;

use gateway_ext_proc::config::pools::SheddingConfig;

use gateway_ext_proc::config::tenants::{ApiKeyLimits, TenantConfig};
use gateway_filter::config::{RawApiKey, RawConfig, RawModel, RawPrefixHashing, RawTenant};
use gateway_tokenize::spec::{ChatTemplateSpec, TokenizerSpec};

use crate::config::{FieldError, GatewayConfig, Loaded, PoolSection, USAGE_DELIVERY_MARGIN_MS};
use crate::tree::{to_json, to_yaml};

use super::sidecar_file::{
    ContextFile, EndpointPickerFile, JournalFile, MeteringFile, PoolFile, RedisFile, ReservationsFile,
    SidecarFile, TracingFile,
};
use super::Error;

/// The wasm filter's plugin config (the filter's own `RawConfig`), validated by
/// `gateway_filter::config::Config::from_json`.
///
/// # Errors
/// A field the filter rejects (named as in the gateway config).
pub fn filter_config(loaded: &Loaded) -> Result<RawConfig, Error> {
    let c = &loaded.config;
    let tenants = c.tenants.iter().map(|t| RawTenant {
        id: t.id.clone(),
        api_keys_sha256: t.api_keys_sha256.clone(),
        api_keys: t.api_keys.as_ref().map(|keys| {
            keys.iter()
                .map(|k| RawApiKey {
                    name: k.name.clone(),
                    sha256: k.sha256.clone(),
                    not_before: k.not_before.clone(),
                    expires_at: k.expires_at.clone(),
                    // A key the sidecar limits on its own is admitted by the sidecar.
                    own_limits: k.limits.is_some().then_some(true),
                })
                .collect()
        }),
        tier: t.tier.clone(),
        models: t.models.clone(),
    });
    let models = c.models.iter().map(|m| RawModel {
        name: m.name.clone(),
        pool: m.pool.clone(),
        pools: m.pools.clone(),
        served_model_name: m.served_model_name.clone(),
        max_model_len: m.max_model_len,
        max_token_bytes: m.max_token_bytes,
        aliases: m.aliases.clone(),
        lora_adapters: m.lora_adapters.clone(),
        template_overhead_bytes: None,
        normalization: None,
        // What the bounds cannot decide goes to the sidecar's exact count.
        exact_count: (m.tokenizer.is_some() || m.model_dir.is_some()).then_some(true),
    });
    let config = RawConfig {
        max_body_bytes: c.filter.max_body_bytes,
        full_parse_max_bytes: c.filter.full_parse_max_bytes,
        max_uploads_per_tenant: c.filter.max_uploads_per_tenant,
        max_n: c.filter.max_n,
        tenants: tenants.collect(),
        models: models.collect(),
        admission_leases: None,
        // The prompt-prefix hashes the sidecar's picker scores affinity by (the filter's
        // defaults: 64-byte blocks, at most 256).
        prefix_hashing: c
            .pools
            .iter()
            .any(|p| p.picker.is_some())
            .then_some(RawPrefixHashing { block_bytes: None, max_blocks: None }),
        // The rendered sidecars read the decision from the filter state; the headers are opt-in.
        upstream_headers: Some(c.filter.upstream_headers.clone().unwrap_or_else(|| "routing".to_owned())),
    };

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

/// An address on `flavor`'s host: `addr` itself standalone, all interfaces at its port in a pod.
fn listen_address(addr: std::net::SocketAddr, flavor: Flavor) -> String {
    match flavor {
        Flavor::Standalone => addr.to_string(),
        Flavor::Kubernetes => format!("0.0.0.0:{}", addr.port()),
    }
}

/// The sidecar's config, validated by `gateway_ext_proc::config::Config::from_yaml`.
///
/// # Errors
/// A field the sidecar rejects, named as in the gateway config.
pub fn sidecar_config(loaded: &Loaded, flavor: Flavor) -> Result<SidecarFile, Error> {
    let c = &loaded.config;
    let tls = match (flavor, &c.sidecar.tls) {
        (Flavor::Standalone, Some(tls)) => Some(gateway_ext_proc::config::redis::ListenerTls {
            cert_file: loaded.resolve(&tls.cert_file),
            key_file: loaded.resolve(&tls.key_file),
            client_ca_file: loaded.resolve(&tls.client_ca_file),
            pem: None,
        }),
        _ => None,
    };
    let tenants = c.tenants.iter().map(|t| TenantConfig {
        id: t.id.clone(),
        limits: t.limits,
        model_limits: t.model_limits.clone(),
        quota: t.quota,
        model_quotas: t.model_quotas.clone(),
        api_keys: t
            .api_keys
            .iter()
            .flatten()
            // Every named key, so that the sidecar's api_keys[j] is the gateway config's.
            .map(|k| ApiKeyLimits { name: k.name.clone(), limits: k.limits.unwrap_or_default() })
            .collect(),
    });
    // Sidecar pools[j] is the gateway config's pools[shed[j]]: the pools it sheds in front of
    // or picks endpoints for (or both).
    let shed: Vec<usize> = c
        .pools
        .iter()
        .enumerate()
        .filter(|(_, p)| p.shedding.is_some() || p.picker.is_some() || p.flow_control.is_some())
        .map(|(i, _)| i)
        .collect();
    let pools = shed.iter().filter_map(|&i| c.pools.get(i)).map(|p| sidecar_pool(p, flavor));
    let tier_levels: std::collections::BTreeMap<String, f64> =
        c.tiers.iter().filter_map(|(tier, t)| Some((tier.clone(), t.shed_level?))).collect();
    let config = SidecarFile {
        listen: listen_address(c.sidecar.listen, flavor),
        tls,
        redis: redis(loaded, flavor),
        tenants: tenants.collect(),
        prices: c.prices.clone(),
        metering: metering(c, flavor),
        shutdown_grace_ms: c.sidecar.shutdown_grace_ms,
        // A draining replica refuses new admissions only where another takes them (Envoy retries
        // them there): with one, it admits them until it exits.
        drain_refuses_admissions: match flavor {
            Flavor::Standalone => c.sidecar.replicas > 1,
            Flavor::Kubernetes => c.kubernetes.as_ref().is_some_and(|k| k.sidecar.replicas > 1),
        },
        // The exact count receives bodies up to the filter's limit.
        context: c.filter.max_body_bytes.map(|max_body_bytes| ContextFile { max_body_bytes }),
        models: exact_count_models(loaded, flavor)?,
        pools: pools.collect(),
        flow_control: c.flow_control.clone(),
        tracing: c.tracing.as_ref().map(|t| TracingFile {
            otlp_endpoint: format!("http://{}", t.otlp_endpoint),
            sampling_ratio: t.sampling_percent / 100.0,
        }),
        endpoint_pickers: endpoint_picker_listeners(loaded, flavor)?,
        shedding: (!tier_levels.is_empty()).then_some(SheddingConfig { tier_levels }),
        metrics_listen: c.sidecar.metrics_listen.map(|m| listen_address(m, flavor)),
    };

    let yaml = to_yaml(&crate::tree::to_tree(&config).map_err(Error::Internal)?).map_err(Error::Internal)?;
    match gateway_ext_proc::config::Config::from_yaml(&yaml) {
        Ok(_) => Ok(config),
        Err(gateway_ext_proc::config::error::ConfigError::Invalid { field, message }) => {
            Err(FieldError::new(sidecar_field(&field, &shed), format!("{message} (gateway-ext-proc)")).into())
        }
        Err(other) => {
            Err(Error::Internal(format!("gateway-ext-proc rejects the rendered sidecar config: {other}")))
        }
    }
}

/// One of the sidecar's `pools[]`: what it sheds the pool by, its picker and its flow control.
fn sidecar_pool(p: &PoolSection, flavor: Flavor) -> PoolFile {
    let shedding = p.shedding.as_ref();
    PoolFile {
        name: p.name.clone(),
        endpoints: scrape_urls(p, flavor),
        scrape_interval_ms: shedding.and_then(|s| s.scrape_interval_ms),
        max_queue_depth: shedding.and_then(|s| s.max_queue_depth),
        max_kv_cache_usage: shedding.and_then(|s| s.max_kv_cache_usage),
        max_in_flight: shedding.and_then(|s| s.max_in_flight),
        picker: p.picker.clone(),
        flow_control: p.flow_control,
        admission_leases: p.admission_leases,
    }
}

/// The sidecar's `metering`: the gateway config's settings, and when a reservation is charged.
fn metering(c: &GatewayConfig, flavor: Flavor) -> MeteringFile {
    let m = c.sidecar.metering.as_ref();
    // A reservation is charged once no usage arrived within the longest stream lifetime (the
    // standalone bootstrap's max_stream_duration; on the mesh targets, the bound set there).
    let record_after_ms = c.envoy.edge.max_stream_duration_ms.saturating_add(USAGE_DELIVERY_MARGIN_MS);
    let journal = match flavor {
        Flavor::Standalone => m.and_then(|m| m.journal_path.as_ref()),
        Flavor::Kubernetes => None,
    };
    MeteringFile {
        stream: m.and_then(|m| m.stream.clone()),
        stream_maxlen: m.and_then(|m| m.stream_maxlen),
        max_json_body_bytes: m.and_then(|m| m.max_json_body_bytes),
        reservations: ReservationsFile { record_after_ms },
        journal: journal.map(|path| JournalFile { path: path.display().to_string() }),
    }
}

/// On the mesh targets each picking pool's picks come from its InferencePool's call to an
/// endpoint-picker listener of its own (then the admission does not pick for it); the
/// standalone sidecar picks on the admission path.
fn endpoint_picker_listeners(loaded: &Loaded, flavor: Flavor) -> Result<Vec<EndpointPickerFile>, Error> {
    if flavor == Flavor::Standalone {
        return Ok(Vec::new());
    }
    let pickers = super::kubernetes::endpoint_pickers(loaded)?;
    Ok(pickers
        .iter()
        .map(|epp| EndpointPickerFile {
            pool: epp.pool.to_owned(),
            listen: format!("0.0.0.0:{}", epp.port),
            // It buffers the bodies the filter let through.
            max_body_bytes: loaded.config.filter.max_body_bytes,
        })
        .collect())
}

/// Where `kubernetes.sidecar.redis_tls_secret` is mounted in the sidecar's pods.
pub const REDIS_TLS_MOUNT: &str = "/etc/llm-gateway/redis-tls";
/// The env var the pods get `kubernetes.sidecar.redis_password_secret` in.
pub const REDIS_PASSWORD_ENV: &str = "REDIS_PASSWORD";

fn redis(loaded: &Loaded, flavor: Flavor) -> RedisFile {
    let c: &GatewayConfig = &loaded.config;
    let r = &c.redis;
    let trial = match (flavor, &c.kubernetes) {
        (Flavor::Kubernetes, Some(k8s)) if k8s.trial_redis.is_some() => Some(trial_redis_url(&k8s.namespace)),
        _ => None,
    };
    let mut file = RedisFile {
        command_timeout_ms: r.command_timeout_ms,
        local_share: r.local_share,
        lease_fraction: c.lease_fraction(),
        lease_ttl_ms: r.lease_ttl_ms,
        key_prefix: r.key_prefix.clone(),
        failure_mode: r.failure_mode,
        tier_failure_modes: c
            .tiers
            .iter()
            .filter_map(|(tier, t)| Some((tier.clone(), t.failure_mode?)))
            .collect(),
        username: r.username.clone(),
        breaker: r.breaker.clone(),
        ..RedisFile::default()
    };
    match (trial, &r.url) {
        (Some(url), _) => file.url = Some(url),
        (None, Some(url)) => file.url = Some(url.clone()),
        (None, None) => file.cluster_urls = Some(r.cluster_urls.clone()),
    }
    let path = |p: &Path| loaded.resolve(p).display().to_string();
    let workload = match flavor {
        Flavor::Kubernetes => c.kubernetes.as_ref().map(|k| &k.sidecar),
        Flavor::Standalone => None,
    };
    match (workload.and_then(|w| w.redis_password_secret.as_ref()), &r.password_file, &r.password_env) {
        (Some(_), _, _) => file.password_env = Some(REDIS_PASSWORD_ENV.to_owned()),
        (None, Some(f), _) => file.password_file = Some(path(f)),
        (None, None, Some(var)) => file.password_env = Some(var.clone()),
        (None, None, None) => {}
    }
    file.tls = match (workload.and_then(|w| w.redis_tls_secret.as_ref().map(|_| w)), &r.tls) {
        (Some(w), _) => {
            let mounted = |name: &str| Some(Path::new(REDIS_TLS_MOUNT).join(name));
            let client = w.redis_tls_client_certificate;
            Some(gateway_ext_proc::config::redis::RedisTls {
                ca_file: mounted("ca.crt"),
                cert_file: if client { mounted("tls.crt") } else { None },
                key_file: if client { mounted("tls.key") } else { None },
            })
        }
        (None, Some(tls)) => Some(gateway_ext_proc::config::redis::RedisTls {
            ca_file: tls.ca_file.as_deref().map(|p| loaded.resolve(p)),
            cert_file: tls.cert_file.as_deref().map(|p| loaded.resolve(p)),
            key_file: tls.key_file.as_deref().map(|p| loaded.resolve(p)),
        }),
        (None, None) => None,
    };
    file
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
        if !dir.is_dir() {
            return Err(FieldError::new(field, format!("{}: no such directory", dir.display())).into());
        }
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
fn exact_count_models(loaded: &Loaded, flavor: Flavor) -> Result<Vec<ModelConfig>, Error> {
    let c = &loaded.config;
    let mut out = Vec::new();
    for (i, m) in c.models.iter().enumerate() {
        let Some((tokenizer, template, field)) = local_specs(loaded, i)? else { continue };
        let mut model = ModelConfig {
            name: m.name.clone(),
            max_model_len: m.max_model_len,
            tokenizer,
            chat_template: template,
        };
        if let Err(e) =
            gateway_ext_proc::admission::context::ContextChecker::from_config(std::slice::from_ref(&model))
        {
            let (at, message) = match e {
                gateway_ext_proc::config::error::ConfigError::Invalid { field: f, message } => (f, message),
                other => (String::new(), other.to_string()),
            };
            // `models[0].tokenizer.huggingface` of the one-model check: this model's field.
            let sub = at.strip_prefix("models[0]").unwrap_or("");
            let named = if field.ends_with("model_dir") { field.clone() } else { format!("{field}{sub}") };
            return Err(FieldError::new(named, format!("{message} (gateway-ext-proc)")).into());
        }
        if flavor == Flavor::Kubernetes {
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
            model.tokenizer = model.tokenizer.map_paths(&mut in_pod);
            model.chat_template = model.chat_template.map(|t| t.map_paths(&mut in_pod));
            if let Some(path) = outside {
                return Err(FieldError::new(
                    field,
                    format!("{path} is not below kubernetes.sidecar.tokenizers.root ({})", root.display()),
                )
                .into());
            }
        }
        out.push(model);
    }
    Ok(out)
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
