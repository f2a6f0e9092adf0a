//! Gateway API kinds: HTTPRoute, ReferenceGrant, and the Inference Extension's InferencePool.

use serde::Serialize;

use super::{Kind, MatchLabels, Object, PortNumber, Selector, TypedRef};

/// The Gateway API's group.
pub(crate) const GATEWAY_API: &str = "gateway.networking.k8s.io";

/// An HTTPRoute.
pub(crate) type HttpRoute = Object<HttpRouteSpec>;

/// An HTTPRoute's `spec`.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct HttpRouteSpec {
    pub(crate) parent_refs: Vec<ParentRef>,
    pub(crate) hostnames: Vec<String>,
    pub(crate) rules: Vec<RouteRule>,
}

impl Kind for HttpRouteSpec {
    const API_VERSION: &'static str = "gateway.networking.k8s.io/v1";
    const KIND: &'static str = "HTTPRoute";
}

/// A Gateway's listener the route attaches to.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct ParentRef {
    pub(crate) group: &'static str,
    pub(crate) kind: &'static str,
    pub(crate) name: String,
    pub(crate) namespace: String,
    pub(crate) section_name: String,
}

/// One rule: what it matches, its filters, its backends (none: it reaches no backend).
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct RouteRule {
    pub(crate) matches: Vec<RouteMatch>,
    pub(crate) filters: Vec<RouteFilter>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub(crate) backend_refs: Vec<BackendRef>,
    pub(crate) timeouts: RouteTimeouts,
}

/// A match on request headers or on the path.
#[derive(Debug, Serialize)]
pub(crate) struct RouteMatch {
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub(crate) headers: Vec<HeaderMatch>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) path: Option<PathMatch>,
}

/// `{type, name, value}`.
#[derive(Debug, Serialize)]
pub(crate) struct HeaderMatch {
    #[serde(rename = "type")]
    pub(crate) kind: &'static str,
    pub(crate) name: &'static str,
    pub(crate) value: String,
}

/// `{type, value}`.
#[derive(Debug, Serialize)]
pub(crate) struct PathMatch {
    #[serde(rename = "type")]
    pub(crate) kind: &'static str,
    pub(crate) value: &'static str,
}

/// A response header modifier.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct RouteFilter {
    #[serde(rename = "type")]
    pub(crate) kind: &'static str,
    pub(crate) response_header_modifier: HeaderModifier,
}

/// `{add: [{name, value}]}`.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct HeaderModifier {
    pub(crate) add: Vec<Header>,
}

/// `{name, value}`.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Header {
    pub(crate) name: String,
    pub(crate) value: String,
}

/// A Service as a backend (`namespace` absent: the referrer's).
#[derive(Debug, Serialize)]
pub(crate) struct BackendRef {
    group: &'static str,
    kind: &'static str,
    name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    namespace: Option<String>,
    port: u16,
}

impl BackendRef {
    /// The Service `name` (in `namespace`, when another than the referrer's) on `port`.
    pub(crate) fn service(name: &str, namespace: Option<&str>, port: u16) -> Self {
        Self {
            group: "",
            kind: "Service",
            name: name.to_owned(),
            namespace: namespace.map(str::to_owned),
            port,
        }
    }
}

/// `{request}`.
#[derive(Debug, Serialize)]
pub(crate) struct RouteTimeouts {
    pub(crate) request: &'static str,
}

/// A ReferenceGrant.
pub(crate) type ReferenceGrant = Object<ReferenceGrantSpec>;

/// A ReferenceGrant's `spec`: who may refer to which Services of its namespace.
#[derive(Debug, Serialize)]
pub(crate) struct ReferenceGrantSpec {
    pub(crate) from: Vec<GrantFrom>,
    pub(crate) to: Vec<TypedRef>,
}

impl Kind for ReferenceGrantSpec {
    const API_VERSION: &'static str = "gateway.networking.k8s.io/v1beta1";
    const KIND: &'static str = "ReferenceGrant";
}

/// A referring kind in a namespace.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct GrantFrom {
    pub(crate) group: &'static str,
    pub(crate) kind: &'static str,
    pub(crate) namespace: String,
}

/// An InferencePool.
pub(crate) type InferencePool = Object<InferencePoolSpec>;

/// An InferencePool's `spec`.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct InferencePoolSpec {
    pub(crate) selector: Selector<MatchLabels>,
    pub(crate) target_ports: Vec<PortNumber>,
    pub(crate) endpoint_picker_ref: EndpointPickerRef,
}

impl Kind for InferencePoolSpec {
    const API_VERSION: &'static str = "inference.networking.k8s.io/v1";
    const KIND: &'static str = "InferencePool";
}

/// The endpoint picker: a Service's port.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct EndpointPickerRef {
    pub(crate) kind: &'static str,
    pub(crate) name: &'static str,
    pub(crate) port: PortNumber,
    pub(crate) failure_mode: &'static str,
}
