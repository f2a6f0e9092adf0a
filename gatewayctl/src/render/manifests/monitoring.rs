//! The Prometheus Operator's kinds (`monitoring.coreos.com/v1`): the PodMonitor that scrapes the
//! sidecar and the PrometheusRule that carries `deploy/prometheus/rules.yaml`.

use serde::Serialize;

use super::{ComponentSelector, Kind, Selector, Value};

/// `PodMonitor.spec`: the sidecar's pods, their `metrics` port.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct PodMonitorSpec {
    pub(crate) selector: Selector<ComponentSelector>,
    pub(crate) pod_metrics_endpoints: Vec<PodMetricsEndpoint>,
}

impl Kind for PodMonitorSpec {
    const API_VERSION: &'static str = "monitoring.coreos.com/v1";
    const KIND: &'static str = "PodMonitor";
}

/// One scraped port of the selected pods.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct PodMetricsEndpoint {
    /// The container port's name.
    pub(crate) port: &'static str,
    pub(crate) path: &'static str,
    pub(crate) interval: &'static str,
    /// Sets `job` to what the rules' alerts select (`llm-gateway-sidecar`).
    pub(crate) relabelings: Vec<Relabeling>,
}

/// A `replace` relabeling of `target_label` to `replacement`.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Relabeling {
    pub(crate) action: &'static str,
    pub(crate) target_label: &'static str,
    pub(crate) replacement: &'static str,
}

/// `PrometheusRule.spec`: the rule groups, as Prometheus's rule file holds them.
#[derive(Debug, Serialize)]
pub(crate) struct PrometheusRuleSpec {
    pub(crate) groups: Value,
}

impl Kind for PrometheusRuleSpec {
    const API_VERSION: &'static str = "monitoring.coreos.com/v1";
    const KIND: &'static str = "PrometheusRule";
}
