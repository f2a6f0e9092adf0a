//! Rendering: from a loaded gateway config to the files of each target.
//!
//! | target | files |
//! |---|---|
//! | `standalone` | `standalone/envoy.yaml` (bootstrap), `standalone/filter.json`, `standalone/sidecar.yaml` (and `sidecar-<k>.yaml` per further replica), with `envoy.hot_restart` `start-envoy.sh`, `hot-restarter.py`, `llm-gateway-envoy.service` |
//! | `istio` | `kubernetes/*` (sidecar, trial Redis), `istio/*` (EnvoyFilter, VirtualService, DestinationRules) |
//! | `envoy-gateway` | `kubernetes/*`, `envoy-gateway/*` (EnvoyExtensionPolicy, HTTPRoute, ReferenceGrants, EnvoyProxy) |
//!
//! Nothing is written until every file has rendered, and every filter and sidecar config has
//! been accepted by that component's own parser first.

pub mod components;
pub(crate) mod envoy_config;
pub mod envoy_gateway;
pub mod istio;
pub mod kubernetes;
pub(crate) mod manifests;
pub mod sidecar_file;
pub mod standalone;
pub mod upgrades;

use std::collections::BTreeMap;
use std::path::Path;

use gateway_filter::config::{RawAdmissionLeases, RawConfig};
use serde::Serialize;

use crate::config::{ConfigError, FieldError, Loaded, PoolSection, ServiceRef, WasmModule};
use crate::template::TemplateError;
use crate::tree::{to_json, to_tree, to_yaml, Value};

use manifests::gateway_api::{EndpointPickerRef, InferencePool, InferencePoolSpec};
use manifests::{ObjectMeta, OrderedMap, PortNumber, Selector};

/// A render target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, clap::ValueEnum)]
pub enum Target {
    /// Envoy bootstrap, filter config and sidecar config for an Envoy you run yourself.
    Standalone,
    /// Kubernetes manifests and Istio resources for an Istio ingress gateway.
    Istio,
    /// Kubernetes manifests and Envoy Gateway resources.
    EnvoyGateway,
    /// Every target the config has the sections for.
    All,
}

impl Target {
    fn name(self) -> &'static str {
        match self {
            Target::Standalone => "standalone",
            Target::Istio => "istio",
            Target::EnvoyGateway => "envoy-gateway",
            Target::All => "all",
        }
    }
}

/// A rendering error: one naming a field of the config, or a bug (a template that does not
/// render, a component rejecting a config for a reason no field explains).
#[derive(Debug)]
pub enum Error {
    /// A field of the gateway config.
    Field(FieldError),
    /// A template file.
    Template(TemplateError),
    /// Anything else (a bug in gatewayctl).
    Internal(String),
}

impl From<FieldError> for Error {
    fn from(e: FieldError) -> Self {
        Error::Field(e)
    }
}

impl From<TemplateError> for Error {
    fn from(e: TemplateError) -> Self {
        Error::Template(e)
    }
}

impl Error {
    /// The error as a [`ConfigError`] located in `file` (template errors name the template).
    pub fn in_file(self, file: &str) -> ConfigError {
        match self {
            Error::Field(e) => e.in_file(file),
            Error::Template(e) => ConfigError {
                file: e.path.to_owned(),
                field: String::new(),
                message: format!("{} (a gatewayctl bug)", e.message),
            },
            Error::Internal(message) => ConfigError {
                file: file.to_owned(),
                field: String::new(),
                message: format!("{message} (a gatewayctl bug)"),
            },
        }
    }
}

/// One rendered file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct File {
    /// Path relative to the output directory, `/`-separated.
    pub path: String,
    /// Its content.
    pub content: String,
}

const HEADER: &str = "# Rendered by gatewayctl from the gateway config; edit that and re-render.\n";

impl File {
    /// A YAML file of `value` (a typed document, or a tree).
    ///
    /// # Errors
    /// A value YAML cannot represent (a bug).
    pub fn yaml<T: Serialize + ?Sized>(path: &str, value: &T) -> Result<File, Error> {
        let tree = to_tree(value).map_err(Error::Internal)?;
        Ok(File {
            path: path.to_owned(),
            content: format!("{HEADER}{}", to_yaml(&tree).map_err(Error::Internal)?),
        })
    }

    /// A JSON file (pretty-printed).
    ///
    /// # Errors
    /// A value JSON cannot represent (a bug).
    pub fn json<T: Serialize + ?Sized>(path: &str, value: &T) -> Result<File, Error> {
        let text = serde_json::to_string_pretty(value).map_err(|e| Error::Internal(e.to_string()))?;
        Ok(File { path: path.to_owned(), content: format!("{text}\n") })
    }
}

/// With `envoy.live_config`: the filter's ECDS file as rendered, to be placed at
/// `envoy.live_config.dir`/filter.json (`gatewayctl apply` does).
pub const LIVE_FILTER_FILE: &str = "standalone/live/filter.json";

/// With `envoy.live_config`: the sidecar replicas' configs as rendered (`sidecar.yaml`,
/// `sidecar-<k>.yaml`) under this directory, to be placed in `envoy.live_config.dir`: the files
/// the replicas are started with and reload (`gatewayctl apply` swaps them).
pub const LIVE_DIR: &str = "standalone/live/";

/// The rendered files, and notes for the operator (settings a target cannot carry).
#[derive(Debug, Default)]
pub struct Output {
    /// Files by path.
    pub files: Vec<File>,
    /// One line each.
    pub notes: Vec<String>,
}

/// The name of the sidecar's cluster in the standalone bootstrap (`envoy/ext_proc_cluster.yaml`).
pub const STANDALONE_EXT_PROC_CLUSTER: &str = "llm_gateway_ext_proc";

/// The filter config with `admission_leases` naming the sidecar's Envoy cluster when admission
/// leases are on ([`crate::config::GatewayConfig::admission_leases`]); unchanged otherwise.
fn with_admission_leases(loaded: &Loaded, filter_config: &RawConfig, cluster: &str) -> RawConfig {
    let mut config = filter_config.clone();
    if loaded.config.admission_leases() {
        config.admission_leases =
            Some(RawAdmissionLeases { cluster: cluster.to_owned(), refresh_ms: None, timeout_ms: None });
    }
    config
}

/// The admission filter entry, wrapped in the matcher that skips it for the filter's leased
/// admissions (`envoy/filters/admission_lease_matcher.yaml`) when admission leases are on.
fn admission_filter(loaded: &Loaded, admission: Value) -> Result<Value, Error> {
    if !loaded.config.admission_leases() {
        return Ok(admission);
    }
    let values = crate::template::Values::new().set("ADMISSION_FILTER", admission);
    Ok(crate::template::render(crate::template::FILTER_ADMISSION_LEASE_MATCHER, &values)?)
}

/// The module the mesh targets fetch, or the error naming `filter.module`.
fn module<'c>(loaded: &'c Loaded, target: &str) -> Result<&'c WasmModule, Error> {
    loaded.config.filter.module.as_ref().ok_or_else(|| {
        FieldError::new(
            "filter.module",
            format!("required by the {target} target (OCI image or HTTP URL of the wasm module)"),
        )
        .into()
    })
}

/// A pool's Service, or the error naming `pools[i].service`.
fn pool_service<'c>(i: usize, pool: &'c PoolSection, target: &str) -> Result<&'c ServiceRef, Error> {
    pool.service.as_ref().ok_or_else(|| {
        FieldError::new(
            format!("pools[{i}].service"),
            format!("required by the {target} target (the pool's Kubernetes Service)"),
        )
        .into()
    })
}

/// One InferencePool (`inference.networking.k8s.io/v1`) per pool with a `picker`, under `dir/`:
/// a picking pool as a Gateway API Inference Extension InferencePool, its model-server Pods
/// (selected by label in this namespace) on their container port, with the gateway's sidecar as
/// the endpoint picker: the sidecar's Service on this pool's own endpoint-picker port (9002 + k
/// for the k-th picking pool, [`kubernetes::endpoint_pickers`]; the sidecar config's
/// `endpoint_pickers[]` listener, which serves the endpoint-picker protocol over ext_proc:
/// `x-gateway-destination-endpoint` in `envoy.lb` metadata and the request header). It lives in
/// the sidecar's namespace (an endpointPickerRef names a Service of its own namespace) and
/// selects Pods of that namespace only, so the pool's Service must be there too. `FailClose`: a
/// request the picker cannot answer fails, as the gateway's own admission does when the sidecar
/// is away.
///
/// # Errors
/// A picking pool without `inference_pool` or `service`, or whose Service is in another namespace.
fn inference_pools(loaded: &Loaded, target: &str, dir: &str) -> Result<Vec<File>, Error> {
    let k8s = kubernetes::section(loaded, target)?;
    let mut files = Vec::new();
    for epp in kubernetes::endpoint_pickers(loaded)? {
        let i = epp.index;
        let Some(pool) = loaded.config.pools.get(i) else {
            return Err(Error::Internal(format!("endpoint picker of pools[{i}]: no such pool")));
        };
        let ip = pool.inference_pool.as_ref().ok_or_else(|| {
            FieldError::new(
                format!("pools[{i}].inference_pool"),
                format!(
                    "required by the {target} target for a pool with a picker (match_labels of the \
                     pool's Pods and their target_port, for its InferencePool)"
                ),
            )
        })?;
        let service = pool_service(i, pool, target)?;
        if service.namespace != k8s.namespace {
            return Err(FieldError::new(
                format!("pools[{i}].service.namespace"),
                format!(
                    "must be the sidecar's namespace '{}' for a pool with a picker: its \
                     InferencePool selects Pods of its own namespace and names the sidecar's \
                     Service there",
                    k8s.namespace
                ),
            )
            .into());
        }
        let label = crate::config::pool_label(&pool.name);
        let doc = InferencePool::new(
            ObjectMeta::new(format!("llm-gateway-{label}"), &k8s.namespace, "llm-gateway"),
            InferencePoolSpec {
                selector: Selector::matching(ip.match_labels.clone()),
                target_ports: vec![PortNumber { number: ip.target_port }],
                endpoint_picker_ref: EndpointPickerRef {
                    kind: "Service",
                    name: kubernetes::SIDECAR_NAME,
                    port: PortNumber { number: epp.port },
                    failure_mode: "FailClose",
                },
            },
        );
        files.push(File::yaml(&format!("{dir}/inferencepool-{label}.yaml"), &doc)?);
    }
    Ok(files)
}

/// OpenAI's rate-limit response headers, the flow-control queue's wait and the quota warning,
/// from the admission filter's dynamic metadata (an absent value adds no header), by name.
fn ratelimit_headers() -> OrderedMap<String> {
    let from_metadata = |key: &str| format!("%DYNAMIC_METADATA(llm_gateway:{key})%");
    let mut headers: Vec<(String, String)> = [
        "x-ratelimit-limit-requests",
        "x-ratelimit-remaining-requests",
        "x-ratelimit-reset-requests",
        "x-ratelimit-limit-tokens",
        "x-ratelimit-remaining-tokens",
        "x-ratelimit-reset-tokens",
    ]
    .into_iter()
    .map(|h| (h.to_owned(), from_metadata(h)))
    .collect();
    headers.extend([
        (gateway_contract::H_QUEUE_WAIT_MS.to_owned(), from_metadata(gateway_contract::MD_QUEUE_WAIT_MS)),
        (gateway_contract::H_QUOTA_WARNING.to_owned(), from_metadata(gateway_contract::MD_QUOTA_WARNING)),
    ]);
    OrderedMap(headers)
}

/// The targets `target` stands for: itself, or for `all` each target the config has the
/// sections for.
fn expand(loaded: &Loaded, target: Target) -> Vec<Target> {
    if target != Target::All {
        return vec![target];
    }
    let c = &loaded.config;
    let mut targets = Vec::new();
    if c.filter.wasm_file.is_some() || c.filter.native_module.is_some() {
        targets.push(Target::Standalone);
    }
    if c.istio.is_some() {
        targets.push(Target::Istio);
    }
    if c.envoy_gateway.is_some() {
        targets.push(Target::EnvoyGateway);
    }
    if targets.is_empty() {
        // Nothing configured for any target: let the standalone target say what it needs.
        targets.push(Target::Standalone);
    }
    targets
}

/// Renders `target` in memory.
///
/// # Errors
/// A [`ConfigError`] naming the config file and field (or the template, for a bug).
pub fn render(loaded: &Loaded, target: Target) -> Result<Output, ConfigError> {
    render_inner(loaded, target).map_err(|e| e.in_file(&loaded.file))
}

pub(crate) fn render_inner(loaded: &Loaded, target: Target) -> Result<Output, Error> {
    let filter_config = components::filter_config(loaded)?;
    let mut files: BTreeMap<String, File> = BTreeMap::new();
    let mut notes = Vec::new();
    for t in expand(loaded, target) {
        let rendered = match t {
            Target::Standalone => {
                let sidecar = components::sidecar_config(loaded, components::Flavor::Standalone)?;
                let filter_config =
                    with_admission_leases(loaded, &filter_config, STANDALONE_EXT_PROC_CLUSTER);
                let bootstrap = standalone::bootstrap(loaded, &filter_config)?;
                let mut files = vec![
                    File::yaml("standalone/envoy.yaml", &bootstrap)?,
                    File::json("standalone/filter.json", &filter_config)?,
                ];
                let replicas = upgrades::sidecar_files(loaded, &sidecar)?;
                if let Some(ecds) = standalone::live_filter(loaded, &filter_config)? {
                    files.push(File::json(LIVE_FILTER_FILE, &ecds)?);
                    files.extend(replicas.iter().map(|f| File {
                        path: f.path.replacen("standalone/", LIVE_DIR, 1),
                        content: f.content.clone(),
                    }));
                }
                files.extend(replicas);
                files.extend(upgrades::hot_restart_files(loaded)?);
                notes.extend(upgrades::notes(loaded));
                files
            }
            Target::Istio => istio::manifests(loaded, &filter_config)?,
            Target::EnvoyGateway => envoy_gateway::manifests(loaded, &filter_config)?,
            Target::All => Vec::new(),
        };
        if t != Target::Standalone {
            for (i, pool) in loaded.config.pools.iter().enumerate() {
                if !pool.fallback.is_empty() {
                    let instead = match t {
                        Target::Istio => "retries once within the pool",
                        _ => "does not retry",
                    };
                    notes.push(format!(
                        "{}: pools[{i}].fallback applies to the standalone target only; the {} \
                         target {instead} (docs/deploy.md)",
                        loaded.file,
                        t.name()
                    ));
                }
            }
        }
        for file in rendered {
            files.insert(file.path.clone(), file);
        }
    }
    // The filter config is embedded in every target; its JSON must round-trip.
    to_json(&filter_config).map_err(Error::Internal)?;
    notes.extend(
        loaded
            .config
            .flow_control_tiers_unused()
            .into_iter()
            .map(|w| format!("warning: {w}: its queue stays empty")),
    );
    Ok(Output { files: files.into_values().collect(), notes })
}

/// Writes rendered files under `out` (creating directories).
///
/// # Errors
/// The first I/O error, with the path.
pub fn write(files: &[File], out: &Path) -> Result<(), String> {
    for file in files {
        let path = out.join(&file.path);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(|e| format!("{}: {e}", parent.display()))?;
        }
        std::fs::write(&path, &file.content).map_err(|e| format!("{}: {e}", path.display()))?;
    }
    Ok(())
}
