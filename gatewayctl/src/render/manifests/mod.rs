//! The Kubernetes objects gatewayctl renders, one `#[derive(Serialize)]` type per kind: their
//! members are declared in the order the rendered files list them, and a member that is not
//! always rendered is an `Option` skipped when `None`.
//!
//! [`core`] has the core kinds (Namespace, ConfigMap, Deployment, Service, PodDisruptionBudget,
//! NetworkPolicy), [`istio`] Istio's, [`gateway_api`] the Gateway API's and its Inference
//! Extension's, [`envoy_gateway`] Envoy Gateway's, [`monitoring`] the Prometheus Operator's. The Envoy configuration inside an EnvoyFilter or
//! an EnvoyPatchPolicy is the standalone bootstrap's (the templates under `envoy/`), carried as a
//! [`Value`] tree.

pub(crate) mod core;
pub(crate) mod envoy_gateway;
pub(crate) mod gateway_api;
pub(crate) mod istio;
pub(crate) mod monitoring;

use std::collections::BTreeMap;

use serde::ser::SerializeMap as _;
use serde::Serialize;

pub(crate) use crate::tree::Value;

/// Labels selecting objects, as the config gives them (a mapping ordered by key).
pub(crate) type MatchLabels = BTreeMap<String, String>;

/// A kind's `apiVersion` and `kind`.
pub(crate) trait Kind {
    /// `apiVersion`.
    const API_VERSION: &'static str;
    /// `kind`.
    const KIND: &'static str;
}

/// An object with a `spec`: `S` names the kind ([`Kind`]).
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Object<S> {
    api_version: &'static str,
    kind: &'static str,
    metadata: ObjectMeta,
    spec: S,
}

impl<S: Kind> Object<S> {
    /// The object `metadata` of `spec`'s kind.
    pub(crate) fn new(metadata: ObjectMeta, spec: S) -> Self {
        Self { api_version: S::API_VERSION, kind: S::KIND, metadata, spec }
    }
}

/// `metadata` (`namespace` absent for a cluster-scoped object).
#[derive(Debug, Clone, Serialize)]
pub(crate) struct ObjectMeta {
    pub(crate) name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) namespace: Option<String>,
    pub(crate) labels: Labels,
}

impl ObjectMeta {
    /// `name` in `namespace`, labelled as the gateway's `component`.
    pub(crate) fn new(name: impl Into<String>, namespace: &str, component: &str) -> Self {
        Self { name: name.into(), namespace: Some(namespace.to_owned()), labels: Labels::new(component) }
    }
}

/// The labels of every gateway object (`app.kubernetes.io/*`).
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Labels {
    #[serde(rename = "app.kubernetes.io/name")]
    name: String,
    #[serde(rename = "app.kubernetes.io/part-of")]
    part_of: &'static str,
    #[serde(rename = "app.kubernetes.io/managed-by")]
    managed_by: &'static str,
    /// The Namespace's `istio-injection: enabled` (istio target).
    #[serde(rename = "istio-injection", skip_serializing_if = "Option::is_none")]
    pub(crate) istio_injection: Option<&'static str>,
}

impl Labels {
    /// The labels of the gateway's `component`.
    pub(crate) fn new(component: &str) -> Self {
        Self {
            name: component.to_owned(),
            part_of: "llm-gateway",
            managed_by: "gatewayctl",
            istio_injection: None,
        }
    }
}

/// What selects one component's pods: its `app.kubernetes.io/name`.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct ComponentSelector {
    #[serde(rename = "app.kubernetes.io/name")]
    name: String,
}

impl ComponentSelector {
    /// The pods of `component`.
    pub(crate) fn new(component: &str) -> Self {
        Self { name: component.to_owned() }
    }
}

/// A label selector, `{matchLabels: ...}` (`{}` selects everything).
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Selector<L> {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) match_labels: Option<L>,
}

impl<L> Selector<L> {
    /// `{matchLabels: labels}`.
    pub(crate) fn matching(labels: L) -> Self {
        Self { match_labels: Some(labels) }
    }
}

/// A mapping whose keys keep the order they were added in (for keys that are data, such as
/// header names, where a struct cannot name them).
#[derive(Debug, Clone, Default)]
pub(crate) struct OrderedMap<V>(pub(crate) Vec<(String, V)>);

impl<V: Serialize> Serialize for OrderedMap<V> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(Some(self.0.len()))?;
        for (key, value) in &self.0 {
            map.serialize_entry(key, value)?;
        }
        map.end()
    }
}

/// A `{group, kind, name}` reference (a policy's target, a ReferenceGrant's `to`).
#[derive(Debug, Clone, Serialize)]
pub(crate) struct TypedRef {
    pub(crate) group: &'static str,
    pub(crate) kind: &'static str,
    pub(crate) name: String,
}

/// `{number}`.
#[derive(Debug, Serialize)]
pub(crate) struct PortNumber {
    pub(crate) number: u16,
}

/// `{}`.
#[derive(Debug, Serialize)]
pub(crate) struct Empty {}

/// A `kustomization.yaml` listing the manifests beside it (`kubectl apply -k <dir>`).
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Kustomization {
    api_version: &'static str,
    kind: &'static str,
    resources: Vec<String>,
}

impl Kustomization {
    /// The kustomization of `resources` (file names).
    pub(crate) fn new(resources: Vec<String>) -> Self {
        Self { api_version: "kustomize.config.k8s.io/v1beta1", kind: "Kustomization", resources }
    }
}
