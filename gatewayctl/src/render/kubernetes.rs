//! Kubernetes manifests of the sidecar (ConfigMap, Deployment, Service, PodDisruptionBudget)
//! and of the trial Redis, from the templates in envoy/kubernetes/.

use sha2::{Digest, Sha256};

use crate::config::{FieldError, KubernetesSection, Loaded};
use crate::template::{self, Values};
use crate::tree::{map, n, s, seq, to_yaml, Value};

use super::components::{self, Flavor};
use super::{Error, File};

/// Name of the sidecar's Deployment, Service, ConfigMap and PodDisruptionBudget.
pub const SIDECAR_NAME: &str = "llm-gateway-ext-proc";

/// The labels of every gateway object (`app.kubernetes.io/*`).
pub fn labels(component: &str) -> Value {
    map([
        ("app.kubernetes.io/name", s(component)),
        ("app.kubernetes.io/part-of", s("llm-gateway")),
        ("app.kubernetes.io/managed-by", s("gatewayctl")),
    ])
}

fn selector(component: &str) -> Value {
    map([("app.kubernetes.io/name", s(component))])
}

/// The `kubernetes` section, or the error naming it for `target`.
pub fn section<'c>(loaded: &'c Loaded, target: &str) -> Result<&'c KubernetesSection, Error> {
    loaded.config.kubernetes.as_ref().ok_or_else(|| {
        FieldError::new(
            "kubernetes",
            format!("required by the {target} target (namespace and sidecar image)"),
        )
        .into()
    })
}

/// Seconds the sidecar pod's `terminationGracePeriodSeconds` adds to the sidecar's
/// `shutdown_grace_ms`: its last flush of usage records (5 s at most) and process exit.
const SHUTDOWN_FLUSH_MARGIN_S: u64 = 10;

/// The sidecar's gRPC port (the same in a pod as on a host).
pub fn sidecar_port(loaded: &Loaded) -> u16 {
    loaded.config.sidecar.listen.port()
}

/// The port of the first endpoint-picker listener: the Gateway API Inference Extension's EPP
/// serves its ext_proc on 9002; picking pool `k` (in config order) gets `9002 + k`.
pub const EPP_BASE_PORT: u16 = 9002;

/// One endpoint-picker listener of the sidecar on the istio and envoy-gateway targets: the
/// ext_proc service an InferencePool's `endpointPickerRef` names (sidecar config
/// `endpoint_pickers[]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointPicker<'c> {
    /// Index of the pool in the gateway config's `pools`.
    pub index: usize,
    /// The pool's name (`pools[index].name`).
    pub pool: &'c str,
    /// Its port: [`EPP_BASE_PORT`] + its rank among the picking pools.
    pub port: u16,
    /// The container and Service port name, `grpc-epp-<rank>` (the `grpc-` prefix and
    /// `appProtocol: grpc` make Istio speak HTTP/2 to it).
    pub port_name: String,
}

/// The endpoint-picker listeners of the mesh targets: one per pool with a `picker`, in config
/// order, on ports 9002, 9003, ...
///
/// # Errors
/// `sidecar.listen` or `sidecar.metrics_listen` on one of those ports (named with the pool that
/// takes it), or more picking pools than ports above 9002.
pub fn endpoint_pickers(loaded: &Loaded) -> Result<Vec<EndpointPicker<'_>>, Error> {
    let c = &loaded.config;
    let mut pickers = Vec::new();
    for (index, pool) in c.pools.iter().enumerate() {
        if pool.picker.is_none() {
            continue;
        }
        let rank = pickers.len();
        let port = u16::try_from(rank).ok().and_then(|k| EPP_BASE_PORT.checked_add(k)).ok_or_else(|| {
            FieldError::new(format!("pools[{index}].picker"), "too many picking pools for ports above 9002")
        })?;
        let taken = [
            ("sidecar.listen", Some(c.sidecar.listen)),
            ("sidecar.metrics_listen", c.sidecar.metrics_listen),
        ];
        for (field, addr) in taken {
            if addr.is_some_and(|a| a.port() == port) {
                return Err(FieldError::new(
                    field,
                    format!(
                        "port {port} is the endpoint picker port of pools[{index}] ('{}') on the \
                         Kubernetes targets (picking pool k in config order takes {EPP_BASE_PORT} + k): \
                         choose another port",
                        pool.name
                    ),
                )
                .into());
            }
        }
        pickers.push(EndpointPicker { index, pool: &pool.name, port, port_name: format!("grpc-epp-{rank}") });
    }
    Ok(pickers)
}

/// Every manifest under `kubernetes/`, with a kustomization.yaml listing them.
///
/// # Errors
/// A missing `kubernetes` section, a sidecar config the sidecar rejects, or an internal
/// template error.
pub fn manifests(loaded: &Loaded, target: &str) -> Result<Vec<File>, Error> {
    let k8s = section(loaded, target)?;
    let c = &loaded.config;
    let ns = k8s.namespace.as_str();
    let sidecar_yaml =
        to_yaml(&components::sidecar_config(loaded, Flavor::Kubernetes)?).map_err(Error::Internal)?;
    let digest = hex::encode(Sha256::digest(sidecar_yaml.as_bytes()));
    let port = sidecar_port(loaded);
    if port == 0 {
        return Err(FieldError::new(
            "sidecar.listen",
            format!("the {target} target needs a fixed port (the Service's)"),
        )
        .into());
    }

    let mut annotations = vec![("llm-gateway.io/sidecar-config-sha256", s(digest))];
    let mut container_ports = vec![map([("name", s("grpc")), ("containerPort", n(port))])];
    let mut service_ports = vec![map([
        ("name", s("grpc")),
        ("port", n(port)),
        ("targetPort", s("grpc")),
        ("appProtocol", s("grpc")),
    ])];
    for epp in endpoint_pickers(loaded)? {
        container_ports.push(map([("name", s(&epp.port_name)), ("containerPort", n(epp.port))]));
        service_ports.push(map([
            ("name", s(&epp.port_name)),
            ("port", n(epp.port)),
            ("targetPort", s(&epp.port_name)),
            ("appProtocol", s("grpc")),
        ]));
    }
    if let Some(metrics) = c.sidecar.metrics_listen {
        let mport = metrics.port();
        annotations.extend([
            ("prometheus.io/scrape", s("true")),
            ("prometheus.io/port", s(mport.to_string())),
            ("prometheus.io/path", s("/metrics")),
        ]);
        container_ports.push(map([("name", s("metrics")), ("containerPort", n(mport))]));
        service_ports.push(map([("name", s("metrics")), ("port", n(mport)), ("targetPort", s("metrics"))]));
    }
    // After SIGTERM the sidecar serves open streams for its shutdown grace, then writes the usage
    // records it holds (at most 5 s more while Redis is away): the pod's grace covers both.
    let shutdown_grace_s = gateway_ext_proc::config::Config::from_yaml(&sidecar_yaml)
        .map(|config| config.shutdown_grace_ms.div_ceil(1000))
        .map_err(|e| Error::Internal(format!("sidecar config: {e}")))?;
    let termination_grace_s = shutdown_grace_s + SHUTDOWN_FLUSH_MARGIN_S;
    // The gRPC port is bound last, once Redis was reached: ready means able to serve.
    let readiness = map([("tcpSocket", map([("port", s("grpc"))])), ("periodSeconds", n(5u64))]);
    let mut env = vec![map([("name", s("RUST_LOG")), ("value", s("info"))])];
    if let Some(secret) = &k8s.sidecar.redis_password_secret {
        env.push(map([
            ("name", s(components::REDIS_PASSWORD_ENV)),
            ("valueFrom", map([("secretKeyRef", map([("name", s(&secret.name)), ("key", s(&secret.key))]))])),
        ]));
    }
    let mut mounts = vec![map([
        ("name", s("config")),
        ("mountPath", s("/etc/llm-gateway")),
        ("readOnly", Value::from(true)),
    ])];
    let mut volumes = vec![map([("name", s("config")), ("configMap", map([("name", s(SIDECAR_NAME))]))])];
    if let Some(secret) = &k8s.sidecar.redis_tls_secret {
        mounts.push(map([
            ("name", s("redis-tls")),
            ("mountPath", s(components::REDIS_TLS_MOUNT)),
            ("readOnly", Value::from(true)),
        ]));
        volumes.push(map([("name", s("redis-tls")), ("secret", map([("secretName", s(secret))]))]));
    }
    if let Some(tokenizers) = &k8s.sidecar.tokenizers {
        // The models' tokenizer files (sidecar `models[]`, paths below this mount).
        mounts.push(map([
            ("name", s("tokenizers")),
            ("mountPath", s(components::TOKENIZERS_MOUNT)),
            ("readOnly", Value::from(true)),
        ]));
        let mut volume = serde_yaml_ng::Mapping::new();
        volume.insert(s("name"), s("tokenizers"));
        for (k, v) in &tokenizers.volume {
            volume.insert(k.clone(), v.clone());
        }
        volumes.push(Value::Mapping(volume));
    }

    let base = Values::new()
        .set("NAMESPACE", ns)
        .set("LABELS", labels(SIDECAR_NAME))
        .set("SELECTOR", selector(SIDECAR_NAME));
    let mut files = Vec::new();
    files.push(File::yaml(
        "kubernetes/namespace.yaml",
        &map([
            ("apiVersion", s("v1")),
            ("kind", s("Namespace")),
            ("metadata", map([("name", s(ns)), ("labels", namespace_labels(loaded))])),
        ]),
    )?);
    files.push(File::yaml(
        "kubernetes/sidecar-configmap.yaml",
        &template::render(
            template::K8S_SIDECAR_CONFIG,
            &base.clone().set("SIDECAR_YAML", sidecar_yaml.as_str()),
        )?,
    )?);
    let r = &k8s.sidecar.resources;
    files.push(File::yaml(
        "kubernetes/sidecar-deployment.yaml",
        &template::render(
            template::K8S_SIDECAR_DEPLOYMENT,
            &base
                .clone()
                .set("REPLICAS", k8s.sidecar.replicas)
                .set("TERMINATION_GRACE_S", termination_grace_s)
                .set("POD_ANNOTATIONS", map(annotations))
                .set("IMAGE", k8s.sidecar.pinned_image())
                .set("PORTS", seq(container_ports))
                .set("READINESS_PROBE", readiness)
                .set("ENV", seq(env))
                .set("VOLUME_MOUNTS", seq(mounts))
                .set("VOLUMES", seq(volumes))
                .set("CPU_REQUEST", r.cpu_request.as_str())
                .set("MEMORY_REQUEST", r.memory_request.as_str())
                .set("MEMORY_LIMIT", r.memory_limit.as_str()),
        )?,
    )?);
    files.push(File::yaml(
        "kubernetes/sidecar-service.yaml",
        &template::render(template::K8S_SIDECAR_SERVICE, &base.clone().set("PORTS", seq(service_ports)))?,
    )?);
    files.push(File::yaml(
        "kubernetes/sidecar-pdb.yaml",
        &template::render(template::K8S_SIDECAR_PDB, &base)?,
    )?);
    files.push(File::yaml(
        "kubernetes/sidecar-networkpolicy.yaml",
        &template::render(
            template::K8S_SIDECAR_NETWORK_POLICY,
            &base.clone().set("INGRESS", network_policy_ingress(loaded)?),
        )?,
    )?);
    if let Some(redis) = &k8s.trial_redis {
        let redis_values = Values::new()
            .set("NAMESPACE", ns)
            .set("LABELS", labels("llm-gateway-redis"))
            .set("SELECTOR", selector("llm-gateway-redis"))
            .set("IMAGE", redis.image.as_str());
        files.push(File::yaml(
            "kubernetes/redis-deployment.yaml",
            &template::render(template::K8S_REDIS_DEPLOYMENT, &redis_values)?,
        )?);
        files.push(File::yaml(
            "kubernetes/redis-service.yaml",
            &template::render(template::K8S_REDIS_SERVICE, &redis_values)?,
        )?);
        files.push(File::yaml(
            "kubernetes/redis-networkpolicy.yaml",
            &template::render(
                template::K8S_REDIS_NETWORK_POLICY,
                &redis_values.set("SIDECAR_SELECTOR", selector(SIDECAR_NAME)),
            )?,
        )?);
    }
    files.push(kustomization("kubernetes", &files)?);
    Ok(files)
}

/// The Namespace's labels: with an `istio` section, `istio-injection: enabled`, so that the
/// sidecar's pods join the mesh whose mTLS the istio target relies on.
fn namespace_labels(loaded: &Loaded) -> Value {
    let mut l = labels("llm-gateway");
    if loaded.config.istio.is_some() {
        crate::tree::set(&mut l, "istio-injection", s("enabled"));
    }
    l
}

/// Envoy Gateway's default namespace for the Envoy pods it runs (its controller's).
pub const ENVOY_GATEWAY_PROXY_NAMESPACE: &str = "envoy-gateway-system";

/// The sidecar NetworkPolicy's ingress rules: the gRPC port and the endpoint-picker ports
/// ([`endpoint_pickers`]) from the gateway's pods of each mesh
/// target the config has (Istio: `istio.namespace` and `istio.selector`; Envoy Gateway: the pods
/// it runs for `envoy_gateway.gateway`, in [`ENVOY_GATEWAY_PROXY_NAMESPACE`], by its
/// `gateway.envoyproxy.io/owning-gateway-*` labels), and the metrics port from any pod.
fn network_policy_ingress(loaded: &Loaded) -> Result<Value, Error> {
    let c = &loaded.config;
    let mut peers = Vec::new();
    let ns_selector = |ns: &str| map([("matchLabels", map([("kubernetes.io/metadata.name", s(ns))]))]);
    if let Some(istio) = &c.istio {
        let labels = istio.selector.iter().map(|(k, v)| (k.clone(), s(v)));
        peers.push(map([
            ("namespaceSelector", ns_selector(&istio.namespace)),
            ("podSelector", map([("matchLabels", map(labels))])),
        ]));
    }
    if let Some(eg) = &c.envoy_gateway {
        peers.push(map([
            ("namespaceSelector", ns_selector(ENVOY_GATEWAY_PROXY_NAMESPACE)),
            (
                "podSelector",
                map([(
                    "matchLabels",
                    map([
                        ("gateway.envoyproxy.io/owning-gateway-name", s(&eg.gateway.name)),
                        ("gateway.envoyproxy.io/owning-gateway-namespace", s(&eg.gateway.namespace)),
                    ]),
                )]),
            ),
        ]));
    }
    let tcp = |port: u16| map([("protocol", s("TCP")), ("port", n(port))]);
    let mut ports = vec![tcp(sidecar_port(loaded))];
    ports.extend(endpoint_pickers(loaded)?.iter().map(|epp| tcp(epp.port)));
    let mut rules = vec![map([("from", seq(peers)), ("ports", seq(ports))])];
    if let Some(metrics) = c.sidecar.metrics_listen {
        let any = map([("namespaceSelector", map::<&str>([]))]);
        rules.push(map([("from", seq([any])), ("ports", seq([tcp(metrics.port())]))]));
    }
    Ok(seq(rules))
}

/// A `kustomization.yaml` in `dir` listing `files` (those under `dir`), so that
/// `kubectl apply -k <dir>` applies them.
pub fn kustomization(dir: &str, files: &[File]) -> Result<File, Error> {
    let prefix = format!("{dir}/");
    let resources =
        files.iter().filter_map(|f| f.path.strip_prefix(&prefix)).filter(|p| p.ends_with(".yaml")).map(s);
    File::yaml(
        &format!("{dir}/kustomization.yaml"),
        &map([
            ("apiVersion", s("kustomize.config.k8s.io/v1beta1")),
            ("kind", s("Kustomization")),
            ("resources", seq(resources)),
        ]),
    )
}
