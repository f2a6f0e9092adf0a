//! Core Kubernetes kinds: Namespace, ConfigMap, Deployment, Service, PodDisruptionBudget,
//! NetworkPolicy (the members gatewayctl renders, in its order).

use serde::Serialize;

use super::{ComponentSelector, Kind, Labels, MatchLabels, Object, ObjectMeta, OrderedMap, Selector};

/// A Namespace (no `spec`).
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Namespace {
    api_version: &'static str,
    kind: &'static str,
    metadata: NamespaceMeta,
}

#[derive(Debug, Serialize)]
struct NamespaceMeta {
    name: String,
    labels: Labels,
}

impl Namespace {
    /// The Namespace `name` with `labels`.
    pub(crate) fn new(name: &str, labels: Labels) -> Self {
        Self {
            api_version: "v1",
            kind: "Namespace",
            metadata: NamespaceMeta { name: name.to_owned(), labels },
        }
    }
}

/// A ConfigMap of one file.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct ConfigMap {
    api_version: &'static str,
    kind: &'static str,
    metadata: ObjectMeta,
    data: OrderedMap<String>,
}

impl ConfigMap {
    /// The ConfigMap holding `file` as `key`.
    pub(crate) fn new(metadata: ObjectMeta, key: &str, file: String) -> Self {
        Self {
            api_version: "v1",
            kind: "ConfigMap",
            metadata,
            data: OrderedMap(vec![(key.to_owned(), file)]),
        }
    }
}

/// A Deployment.
pub(crate) type Deployment = Object<DeploymentSpec>;

/// A Deployment's `spec`.
#[derive(Debug, Serialize)]
pub(crate) struct DeploymentSpec {
    pub(crate) replicas: u32,
    pub(crate) selector: Selector<ComponentSelector>,
    pub(crate) template: PodTemplate,
}

impl Kind for DeploymentSpec {
    const API_VERSION: &'static str = "apps/v1";
    const KIND: &'static str = "Deployment";
}

/// A pod template.
#[derive(Debug, Serialize)]
pub(crate) struct PodTemplate {
    pub(crate) metadata: PodMeta,
    pub(crate) spec: PodSpec,
}

/// A pod template's `metadata`.
#[derive(Debug, Serialize)]
pub(crate) struct PodMeta {
    pub(crate) labels: Labels,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) annotations: Option<OrderedMap<String>>,
}

/// A pod's `spec`.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct PodSpec {
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub(crate) topology_spread_constraints: Vec<TopologySpreadConstraint>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) termination_grace_period_seconds: Option<u64>,
    pub(crate) security_context: PodSecurityContext,
    pub(crate) containers: Vec<Container>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub(crate) volumes: Vec<Volume>,
}

/// One `topologySpreadConstraints[]` entry.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct TopologySpreadConstraint {
    pub(crate) max_skew: u32,
    pub(crate) topology_key: &'static str,
    pub(crate) when_unsatisfiable: &'static str,
    pub(crate) label_selector: Selector<ComponentSelector>,
}

/// A pod's `securityContext`: a non-root user with the runtime's default seccomp profile.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct PodSecurityContext {
    run_as_non_root: bool,
    run_as_user: u32,
    run_as_group: u32,
    seccomp_profile: SeccompProfile,
}

impl PodSecurityContext {
    /// Runs as `uid` (and that group id), never as root.
    pub(crate) fn non_root(uid: u32) -> Self {
        Self {
            run_as_non_root: true,
            run_as_user: uid,
            run_as_group: uid,
            seccomp_profile: SeccompProfile { kind: "RuntimeDefault" },
        }
    }
}

#[derive(Debug, Serialize)]
struct SeccompProfile {
    #[serde(rename = "type")]
    kind: &'static str,
}

/// A container.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Container {
    pub(crate) name: &'static str,
    pub(crate) image: String,
    pub(crate) args: Vec<&'static str>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub(crate) env: Vec<EnvVar>,
    pub(crate) ports: Vec<ContainerPort>,
    pub(crate) readiness_probe: Probe,
    pub(crate) liveness_probe: Probe,
    pub(crate) resources: Resources,
    pub(crate) security_context: ContainerSecurityContext,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub(crate) volume_mounts: Vec<VolumeMount>,
}

/// An environment variable: a value, or a Secret's key.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct EnvVar {
    pub(crate) name: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) value: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) value_from: Option<EnvSource>,
}

/// `valueFrom`.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct EnvSource {
    pub(crate) secret_key_ref: SecretKeyRef,
}

/// A key of a Secret.
#[derive(Debug, Serialize)]
pub(crate) struct SecretKeyRef {
    pub(crate) name: String,
    pub(crate) key: String,
}

/// A named container port.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct ContainerPort {
    pub(crate) name: String,
    pub(crate) container_port: u16,
}

/// A readiness or liveness probe.
#[derive(Debug, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Probe {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) exec: Option<ExecAction>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) tcp_socket: Option<TcpSocket>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) initial_delay_seconds: Option<u32>,
    pub(crate) period_seconds: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) failure_threshold: Option<u32>,
}

/// A command the probe runs.
#[derive(Debug, Serialize)]
pub(crate) struct ExecAction {
    pub(crate) command: Vec<&'static str>,
}

/// A port the probe connects to (by name).
#[derive(Debug, Serialize)]
pub(crate) struct TcpSocket {
    pub(crate) port: &'static str,
}

/// Resource requests and the memory limit.
#[derive(Debug, Serialize)]
pub(crate) struct Resources {
    pub(crate) requests: ResourceList,
    pub(crate) limits: MemoryLimit,
}

/// CPU and memory.
#[derive(Debug, Serialize)]
pub(crate) struct ResourceList {
    pub(crate) cpu: String,
    pub(crate) memory: String,
}

/// Memory alone.
#[derive(Debug, Serialize)]
pub(crate) struct MemoryLimit {
    pub(crate) memory: String,
}

/// A container's `securityContext`: no privilege escalation, no capability.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct ContainerSecurityContext {
    allow_privilege_escalation: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    read_only_root_filesystem: Option<bool>,
    capabilities: Capabilities,
}

impl ContainerSecurityContext {
    /// Every capability dropped; `read_only_root_filesystem` when given.
    pub(crate) fn restricted(read_only_root_filesystem: Option<bool>) -> Self {
        Self {
            allow_privilege_escalation: false,
            read_only_root_filesystem,
            capabilities: Capabilities { drop: vec!["ALL"] },
        }
    }
}

#[derive(Debug, Serialize)]
struct Capabilities {
    drop: Vec<&'static str>,
}

/// A volume mounted read-only.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct VolumeMount {
    name: &'static str,
    mount_path: String,
    read_only: bool,
}

impl VolumeMount {
    /// Volume `name` at `mount_path`, read-only.
    pub(crate) fn read_only(name: &'static str, mount_path: &str) -> Self {
        Self { name, mount_path: mount_path.to_owned(), read_only: true }
    }
}

/// A pod volume: a ConfigMap, a Secret, or a volume source from the config.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Volume {
    pub(crate) name: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) config_map: Option<NameRef>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) secret: Option<SecretVolume>,
    /// A volume source as the config gives it (`kubernetes.sidecar.tokenizers.volume`).
    #[serde(flatten)]
    pub(crate) source: Option<serde_yaml_ng::Mapping>,
}

/// `{name}`.
#[derive(Debug, Serialize)]
pub(crate) struct NameRef {
    pub(crate) name: String,
}

/// A Secret volume.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct SecretVolume {
    pub(crate) secret_name: String,
}

/// A Service.
pub(crate) type Service = Object<ServiceSpec>;

/// A Service's `spec`.
#[derive(Debug, Serialize)]
pub(crate) struct ServiceSpec {
    pub(crate) selector: ComponentSelector,
    pub(crate) ports: Vec<ServicePort>,
}

impl Kind for ServiceSpec {
    const API_VERSION: &'static str = "v1";
    const KIND: &'static str = "Service";
}

/// A Service port, to the container port of the same name.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct ServicePort {
    pub(crate) name: String,
    pub(crate) port: u16,
    pub(crate) target_port: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) app_protocol: Option<&'static str>,
}

/// A PodDisruptionBudget.
pub(crate) type PodDisruptionBudget = Object<PodDisruptionBudgetSpec>;

/// A PodDisruptionBudget's `spec`.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct PodDisruptionBudgetSpec {
    pub(crate) max_unavailable: u32,
    pub(crate) selector: Selector<ComponentSelector>,
}

impl Kind for PodDisruptionBudgetSpec {
    const API_VERSION: &'static str = "policy/v1";
    const KIND: &'static str = "PodDisruptionBudget";
}

/// A NetworkPolicy (ingress only).
pub(crate) type NetworkPolicy = Object<NetworkPolicySpec>;

/// A NetworkPolicy's `spec`.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct NetworkPolicySpec {
    pub(crate) pod_selector: Selector<ComponentSelector>,
    pub(crate) policy_types: Vec<&'static str>,
    pub(crate) ingress: Vec<IngressRule>,
}

impl Kind for NetworkPolicySpec {
    const API_VERSION: &'static str = "networking.k8s.io/v1";
    const KIND: &'static str = "NetworkPolicy";
}

/// Who may reach which ports.
#[derive(Debug, Serialize)]
pub(crate) struct IngressRule {
    pub(crate) from: Vec<Peer>,
    pub(crate) ports: Vec<PolicyPort>,
}

/// Pods by namespace and labels.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Peer {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) namespace_selector: Option<Selector<MatchLabels>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) pod_selector: Option<Selector<PeerLabels>>,
}

/// The labels a peer's pods are selected by.
#[derive(Debug, Serialize)]
#[serde(untagged)]
pub(crate) enum PeerLabels {
    /// A gateway component's pods.
    Component(ComponentSelector),
    /// Labels from the config.
    Labels(MatchLabels),
}

/// A TCP port.
#[derive(Debug, Serialize)]
pub(crate) struct PolicyPort {
    protocol: &'static str,
    port: u16,
}

impl PolicyPort {
    /// TCP `port`.
    pub(crate) fn tcp(port: u16) -> Self {
        Self { protocol: "TCP", port }
    }
}
