//! Kubernetes manifests of the sidecar (Namespace, ConfigMap, Deployment, Service,
//! PodDisruptionBudget, NetworkPolicy) and of the trial Redis.

use sha2::{Digest, Sha256};

use crate::config::{FieldError, KubernetesSection, Loaded};
use crate::tree::{to_tree, to_yaml};

use super::components::{self, Flavor};
use super::manifests::core::{
    ConfigMap, Container, ContainerPort, ContainerSecurityContext, Deployment, DeploymentSpec, EnvSource,
    EnvVar, ExecAction, IngressRule, MemoryLimit, NameRef, Namespace, NetworkPolicy, NetworkPolicySpec, Peer,
    PeerLabels, PodDisruptionBudget, PodDisruptionBudgetSpec, PodMeta, PodSecurityContext, PodSpec,
    PodTemplate, PolicyPort, Probe, ResourceList, Resources, SecretKeyRef, SecretVolume, Service,
    ServicePort, ServiceSpec, TcpSocket, TopologySpreadConstraint, Volume, VolumeMount,
};
use super::manifests::monitoring::{PodMetricsEndpoint, PodMonitorSpec, PrometheusRuleSpec, Relabeling};
use super::manifests::{
    ComponentSelector, Kustomization, Labels, MatchLabels, Object, ObjectMeta, OrderedMap, Selector, Value,
};
use super::{Error, File};

/// Name of the sidecar's Deployment, Service, ConfigMap and PodDisruptionBudget.
pub const SIDECAR_NAME: &str = "llm-gateway-ext-proc";

/// Name of the trial Redis's Deployment, Service and NetworkPolicy.
const REDIS_NAME: &str = "llm-gateway-redis";

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
/// error.
pub fn manifests(loaded: &Loaded, target: &str) -> Result<Vec<File>, Error> {
    let k8s = section(loaded, target)?;
    let ns = k8s.namespace.as_str();
    let sidecar = components::sidecar_config(loaded, Flavor::Kubernetes)?;
    let sidecar_yaml = to_yaml(&to_tree(&sidecar).map_err(Error::Internal)?).map_err(Error::Internal)?;
    if sidecar_port(loaded) == 0 {
        return Err(FieldError::new(
            "sidecar.listen",
            format!("the {target} target needs a fixed port (the Service's)"),
        )
        .into());
    }
    let meta = ObjectMeta::new(SIDECAR_NAME, ns, SIDECAR_NAME);
    let mut namespace_labels = Labels::new("llm-gateway");
    if loaded.config.istio.is_some() {
        // The sidecar's pods join the mesh whose mTLS the istio target relies on.
        namespace_labels.istio_injection = Some("enabled");
    }
    let mut files = vec![
        File::yaml("kubernetes/namespace.yaml", &Namespace::new(ns, namespace_labels))?,
        // The sidecar's config file, mounted at /etc/llm-gateway/sidecar.yaml, accepted by
        // gateway-ext-proc's own parser before it is written.
        File::yaml(
            "kubernetes/sidecar-configmap.yaml",
            &ConfigMap::new(meta.clone(), "sidecar.yaml", sidecar_yaml.clone()),
        )?,
        File::yaml("kubernetes/sidecar-deployment.yaml", &sidecar_deployment(loaded, k8s, &sidecar_yaml)?)?,
        File::yaml("kubernetes/sidecar-service.yaml", &sidecar_service(loaded, meta.clone())?)?,
        // Voluntary disruptions (node drains, upgrades) take at most one sidecar replica at a time.
        File::yaml(
            "kubernetes/sidecar-pdb.yaml",
            &PodDisruptionBudget::new(
                meta.clone(),
                PodDisruptionBudgetSpec {
                    max_unavailable: 1,
                    selector: Selector::matching(ComponentSelector::new(SIDECAR_NAME)),
                },
            ),
        )?,
        File::yaml(
            "kubernetes/sidecar-networkpolicy.yaml",
            &network_policy(meta, SIDECAR_NAME, network_policy_ingress(loaded)?),
        )?,
    ];
    if let Some(redis) = &k8s.trial_redis {
        files.extend(trial_redis(ns, &redis.image)?);
    }
    files.push(kustomization("kubernetes", &files)?);
    files.extend(monitoring(loaded, ns)?);
    Ok(files)
}

/// The Prometheus rules and alerts of docs/operations.md, as the standalone target's Prometheus
/// loads them.
const RULES: &str = include_str!("../../../deploy/prometheus/rules.yaml");

/// `kubernetes/monitoring/`, with `sidecar.metrics_listen` set: a PodMonitor scraping the
/// sidecar's `metrics` port as job `llm-gateway-sidecar` (what the alerts select) and a
/// PrometheusRule with the rules and alerts (`deploy/prometheus/rules.yaml`). Their own
/// kustomization, apart from the sidecar's: they need the Prometheus Operator's CRDs.
fn monitoring(loaded: &Loaded, ns: &str) -> Result<Vec<File>, Error> {
    if loaded.config.sidecar.metrics_listen.is_none() {
        return Ok(Vec::new());
    }
    let rules: Value =
        serde_yaml_ng::from_str(RULES).map_err(|e| Error::Internal(format!("rules.yaml: {e}")))?;
    let groups =
        rules.get("groups").cloned().ok_or_else(|| Error::Internal("rules.yaml: no groups".to_owned()))?;
    let pod_monitor = PodMonitorSpec {
        selector: Selector::matching(ComponentSelector::new(SIDECAR_NAME)),
        pod_metrics_endpoints: vec![PodMetricsEndpoint {
            port: "metrics",
            path: "/metrics",
            interval: "30s",
            relabelings: vec![Relabeling {
                action: "replace",
                target_label: "job",
                replacement: "llm-gateway-sidecar",
            }],
        }],
    };
    let files = vec![
        File::yaml(
            "kubernetes/monitoring/sidecar-podmonitor.yaml",
            &Object::new(ObjectMeta::new(SIDECAR_NAME, ns, SIDECAR_NAME), pod_monitor),
        )?,
        File::yaml(
            "kubernetes/monitoring/prometheusrule.yaml",
            &Object::new(ObjectMeta::new("llm-gateway", ns, "llm-gateway"), PrometheusRuleSpec { groups }),
        )?,
    ];
    let mut out = vec![kustomization("kubernetes/monitoring", &files)?];
    out.extend(files);
    Ok(out)
}

/// A port of the sidecar's pods.
struct SidecarPort {
    /// The container port's name.
    name: String,
    port: u16,
    /// Whether it serves gRPC.
    grpc: bool,
}

/// The sidecar's ports: its gRPC port, one endpoint-picker port per picking pool, and its
/// metrics port when there is one.
fn sidecar_ports(loaded: &Loaded) -> Result<Vec<SidecarPort>, Error> {
    let grpc = |name, port| SidecarPort { name, port, grpc: true };
    let mut ports = vec![grpc("grpc".to_owned(), sidecar_port(loaded))];
    ports.extend(endpoint_pickers(loaded)?.into_iter().map(|epp| grpc(epp.port_name, epp.port)));
    if let Some(metrics) = loaded.config.sidecar.metrics_listen {
        ports.push(SidecarPort { name: "metrics".to_owned(), port: metrics.port(), grpc: false });
    }
    Ok(ports)
}

/// The sidecar's Deployment (gateway-ext-proc): stateless, all shared state is in Redis, so it
/// scales horizontally behind its Service. The pod template carries the config's digest, so a
/// changed config rolls the pods.
fn sidecar_deployment(
    loaded: &Loaded,
    k8s: &KubernetesSection,
    sidecar_yaml: &str,
) -> Result<Deployment, Error> {
    let workload = &k8s.sidecar;
    let digest = hex::encode(Sha256::digest(sidecar_yaml.as_bytes()));
    let mut annotations = vec![("llm-gateway.io/sidecar-config-sha256".to_owned(), digest)];
    if let Some(metrics) = loaded.config.sidecar.metrics_listen {
        annotations.extend([
            ("prometheus.io/scrape".to_owned(), "true".to_owned()),
            ("prometheus.io/port".to_owned(), metrics.port().to_string()),
            ("prometheus.io/path".to_owned(), "/metrics".to_owned()),
        ]);
    }
    // After SIGTERM the sidecar serves open streams for its shutdown grace (Envoy's access log
    // carries the usage of the requests it drains), then writes the usage records it holds (at
    // most 5 s more while Redis is away): the pod's grace covers both.
    let shutdown_grace_s = gateway_ext_proc::config::Config::from_yaml(sidecar_yaml)
        .map(|config| config.shutdown_grace_ms.div_ceil(1000))
        .map_err(|e| Error::Internal(format!("sidecar config: {e}")))?;
    let ports = sidecar_ports(loaded)?;
    let container = Container {
        name: "ext-proc",
        image: workload.pinned_image(),
        args: vec!["--config", "/etc/llm-gateway/sidecar.yaml"],
        env: sidecar_env(k8s),
        ports: ports.into_iter().map(|p| ContainerPort { name: p.name, container_port: p.port }).collect(),
        // The sidecar binds its gRPC port last, once it has reached Redis: ready means able to
        // serve.
        readiness_probe: Probe {
            tcp_socket: Some(TcpSocket { port: "grpc" }),
            period_seconds: 5,
            ..Probe::default()
        },
        liveness_probe: Probe {
            tcp_socket: Some(TcpSocket { port: "grpc" }),
            initial_delay_seconds: Some(5),
            period_seconds: 10,
            failure_threshold: Some(3),
            ..Probe::default()
        },
        resources: Resources {
            requests: ResourceList {
                cpu: workload.resources.cpu_request.clone(),
                memory: workload.resources.memory_request.clone(),
            },
            limits: MemoryLimit { memory: workload.resources.memory_limit.clone() },
        },
        security_context: ContainerSecurityContext::restricted(Some(true)),
        volume_mounts: Vec::new(),
    };
    let (volume_mounts, volumes) = sidecar_volumes(k8s);
    let selector = || Selector::matching(ComponentSelector::new(SIDECAR_NAME));
    let pod = PodSpec {
        // Replicas on different nodes where possible: losing one node leaves admission running.
        topology_spread_constraints: vec![TopologySpreadConstraint {
            max_skew: 1,
            topology_key: "kubernetes.io/hostname",
            when_unsatisfiable: "ScheduleAnyway",
            label_selector: selector(),
        }],
        termination_grace_period_seconds: Some(shutdown_grace_s + SHUTDOWN_FLUSH_MARGIN_S),
        security_context: PodSecurityContext::non_root(65532),
        containers: vec![Container { volume_mounts, ..container }],
        volumes,
    };
    Ok(Deployment::new(
        ObjectMeta::new(SIDECAR_NAME, &k8s.namespace, SIDECAR_NAME),
        DeploymentSpec {
            replicas: workload.replicas,
            selector: selector(),
            template: PodTemplate {
                metadata: PodMeta {
                    labels: Labels::new(SIDECAR_NAME),
                    annotations: Some(OrderedMap(annotations)),
                },
                spec: pod,
            },
        },
    ))
}

/// The sidecar's environment: its log level, and the Redis password from its Secret.
fn sidecar_env(k8s: &KubernetesSection) -> Vec<EnvVar> {
    let mut env = vec![EnvVar { name: "RUST_LOG", value: Some("info"), value_from: None }];
    if let Some(secret) = &k8s.sidecar.redis_password_secret {
        env.push(EnvVar {
            name: components::REDIS_PASSWORD_ENV,
            value: None,
            value_from: Some(EnvSource {
                secret_key_ref: SecretKeyRef { name: secret.name.clone(), key: secret.key.clone() },
            }),
        });
    }
    env
}

/// The sidecar's volumes and their mounts: the config at /etc/llm-gateway; Redis's CA and client
/// certificate (a Secret) at /etc/llm-gateway/redis-tls when kubernetes.sidecar.redis_tls_secret
/// is set; the models' tokenizer files (sidecar `models[]`, paths below this mount).
fn sidecar_volumes(k8s: &KubernetesSection) -> (Vec<VolumeMount>, Vec<Volume>) {
    let volume = |name| Volume { name, config_map: None, secret: None, source: None };
    let mut mounts = vec![VolumeMount::read_only("config", "/etc/llm-gateway")];
    let mut volumes =
        vec![Volume { config_map: Some(NameRef { name: SIDECAR_NAME.to_owned() }), ..volume("config") }];
    if let Some(secret) = &k8s.sidecar.redis_tls_secret {
        mounts.push(VolumeMount::read_only("redis-tls", components::REDIS_TLS_MOUNT));
        volumes.push(Volume {
            secret: Some(SecretVolume { secret_name: secret.clone() }),
            ..volume("redis-tls")
        });
    }
    if let Some(tokenizers) = &k8s.sidecar.tokenizers {
        mounts.push(VolumeMount::read_only("tokenizers", components::TOKENIZERS_MOUNT));
        volumes.push(Volume { source: Some(tokenizers.volume.clone()), ..volume("tokenizers") });
    }
    (mounts, volumes)
}

/// The sidecar's Service: its gRPC (ext_proc) port, named `grpc` so that Istio speaks HTTP/2 to
/// it, one endpoint-picker port per picking pool (`grpc-epp-<k>`, 9002 + k, appProtocol grpc: the
/// port its InferencePool's endpointPickerRef names), and its Prometheus port when the config
/// sets sidecar.metrics_listen.
fn sidecar_service(loaded: &Loaded, meta: ObjectMeta) -> Result<Service, Error> {
    let ports = sidecar_ports(loaded)?.into_iter().map(|p| ServicePort {
        target_port: p.name.clone(),
        name: p.name,
        port: p.port,
        app_protocol: p.grpc.then_some("grpc"),
    });
    Ok(Service::new(
        meta,
        ServiceSpec { selector: ComponentSelector::new(SIDECAR_NAME), ports: ports.collect() },
    ))
}

/// An ingress-only NetworkPolicy of `component`'s pods.
fn network_policy(meta: ObjectMeta, component: &str, ingress: Vec<IngressRule>) -> NetworkPolicy {
    NetworkPolicy::new(
        meta,
        NetworkPolicySpec {
            pod_selector: Selector::matching(ComponentSelector::new(component)),
            policy_types: vec!["Ingress"],
            ingress,
        },
    )
}

/// A single Redis for trials only: no persistence, no replica (in production point the gateway
/// config's redis.cluster_urls at an existing Redis Cluster instead, docs/deploy.md), its Service
/// (redis://llm-gateway-redis.<namespace>.svc.cluster.local:6379/0), and a NetworkPolicy that lets
/// only the sidecar's pods reach its port.
fn trial_redis(ns: &str, image: &str) -> Result<Vec<File>, Error> {
    let meta = ObjectMeta::new(REDIS_NAME, ns, REDIS_NAME);
    let selector = || Selector::matching(ComponentSelector::new(REDIS_NAME));
    let container = Container {
        name: "redis",
        image: image.to_owned(),
        args: vec!["--save", "", "--appendonly", "no"],
        env: Vec::new(),
        ports: vec![ContainerPort { name: "redis".to_owned(), container_port: 6379 }],
        readiness_probe: Probe {
            exec: Some(ExecAction { command: vec!["redis-cli", "ping"] }),
            period_seconds: 5,
            ..Probe::default()
        },
        liveness_probe: Probe {
            tcp_socket: Some(TcpSocket { port: "redis" }),
            period_seconds: 10,
            ..Probe::default()
        },
        resources: Resources {
            requests: ResourceList { cpu: "100m".to_owned(), memory: "128Mi".to_owned() },
            limits: MemoryLimit { memory: "512Mi".to_owned() },
        },
        security_context: ContainerSecurityContext::restricted(None),
        volume_mounts: Vec::new(),
    };
    let deployment = Deployment::new(
        meta.clone(),
        DeploymentSpec {
            replicas: 1,
            selector: selector(),
            template: PodTemplate {
                metadata: PodMeta { labels: Labels::new(REDIS_NAME), annotations: None },
                spec: PodSpec {
                    topology_spread_constraints: Vec::new(),
                    termination_grace_period_seconds: None,
                    security_context: PodSecurityContext::non_root(999),
                    containers: vec![container],
                    volumes: Vec::new(),
                },
            },
        },
    );
    let service = Service::new(
        meta.clone(),
        ServiceSpec {
            selector: ComponentSelector::new(REDIS_NAME),
            ports: vec![ServicePort {
                name: "redis".to_owned(),
                port: 6379,
                target_port: "redis".to_owned(),
                app_protocol: None,
            }],
        },
    );
    let from_sidecar = Peer {
        namespace_selector: None,
        pod_selector: Some(Selector::matching(PeerLabels::Component(ComponentSelector::new(SIDECAR_NAME)))),
    };
    let ingress = vec![IngressRule { from: vec![from_sidecar], ports: vec![PolicyPort::tcp(6379)] }];
    Ok(vec![
        File::yaml("kubernetes/redis-deployment.yaml", &deployment)?,
        File::yaml("kubernetes/redis-service.yaml", &service)?,
        File::yaml("kubernetes/redis-networkpolicy.yaml", &network_policy(meta, REDIS_NAME, ingress))?,
    ])
}

/// Envoy Gateway's default namespace for the Envoy pods it runs (its controller's).
pub const ENVOY_GATEWAY_PROXY_NAMESPACE: &str = "envoy-gateway-system";

/// The sidecar NetworkPolicy's ingress rules: only the gateway's Envoy pods reach the sidecar's
/// gRPC port (ext_proc, the access log service, the lease service: whoever reaches it could forge
/// usage records or drain a tenant's buckets) and its endpoint-picker ports ([`endpoint_pickers`],
/// the InferencePools' ext_proc calls), from the gateway's pods of each mesh target the config has
/// (Istio: `istio.namespace` and `istio.selector`; Envoy Gateway: the pods it runs for
/// `envoy_gateway.gateway`, in [`ENVOY_GATEWAY_PROXY_NAMESPACE`], by its
/// `gateway.envoyproxy.io/owning-gateway-*` labels); the metrics port, when there is one, from any
/// pod (Prometheus). Needs a CNI that enforces NetworkPolicy.
fn network_policy_ingress(loaded: &Loaded) -> Result<Vec<IngressRule>, Error> {
    let c = &loaded.config;
    let mut peers = Vec::new();
    let in_namespace = |ns: &str, labels: MatchLabels| Peer {
        namespace_selector: Some(Selector::matching(MatchLabels::from([(
            "kubernetes.io/metadata.name".to_owned(),
            ns.to_owned(),
        )]))),
        pod_selector: Some(Selector::matching(PeerLabels::Labels(labels))),
    };
    if let Some(istio) = &c.istio {
        peers.push(in_namespace(&istio.namespace, istio.selector.clone()));
    }
    if let Some(eg) = &c.envoy_gateway {
        let owner = MatchLabels::from([
            ("gateway.envoyproxy.io/owning-gateway-name".to_owned(), eg.gateway.name.clone()),
            ("gateway.envoyproxy.io/owning-gateway-namespace".to_owned(), eg.gateway.namespace.clone()),
        ]);
        peers.push(in_namespace(ENVOY_GATEWAY_PROXY_NAMESPACE, owner));
    }
    let mut ports = vec![PolicyPort::tcp(sidecar_port(loaded))];
    ports.extend(endpoint_pickers(loaded)?.iter().map(|epp| PolicyPort::tcp(epp.port)));
    let mut rules = vec![IngressRule { from: peers, ports }];
    if let Some(metrics) = c.sidecar.metrics_listen {
        let any = Peer { namespace_selector: Some(Selector { match_labels: None }), pod_selector: None };
        rules.push(IngressRule { from: vec![any], ports: vec![PolicyPort::tcp(metrics.port())] });
    }
    Ok(rules)
}

/// A `kustomization.yaml` in `dir` listing `files` (those under `dir`), so that
/// `kubectl apply -k <dir>` applies them.
///
/// # Errors
/// An internal error.
pub fn kustomization(dir: &str, files: &[File]) -> Result<File, Error> {
    let prefix = format!("{dir}/");
    let resources = files
        .iter()
        .filter_map(|f| f.path.strip_prefix(&prefix))
        .filter(|p| p.ends_with(".yaml"))
        .map(str::to_owned)
        .collect();
    File::yaml(&format!("{dir}/kustomization.yaml"), &Kustomization::new(resources))
}
