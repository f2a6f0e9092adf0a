//! Upgrades with no request lost, standalone target.
//!
//! - The sidecar replicas (`sidecar.replicas`): one config file per replica, replica k on the
//!   configured ports + k, and one endpoint per replica in Envoy's ext_proc cluster, with their
//!   gRPC health checks (envoy/ext_proc_health.yaml). A replica given SIGTERM reports
//!   `NOT_SERVING` and refuses new admissions with `UNAVAILABLE`, which the admission filter
//!   retries on another replica (envoy/filters/ext_proc_admission.yaml, `retry_policy`).
//! - Envoy's hot restart (`envoy.hot_restart`): `standalone/start-envoy.sh` (one epoch's command
//!   line), `standalone/hot-restarter.py` (the next epoch on SIGHUP) and the systemd unit
//!   `standalone/llm-gateway-envoy.service` (`systemctl reload` hot-restarts).

use crate::config::{HostPort, HotRestartSection, Loaded, SidecarSection};
use crate::template::{self, Values};
use crate::tree::{set, to_tree, Value};

use super::envoy_config::LbEndpoint;
use super::{Error, File};

/// The path of replica `k`'s config file: `standalone/sidecar.yaml` for the first, as with one.
pub fn sidecar_path(k: u16) -> String {
    if k == 0 {
        "standalone/sidecar.yaml".to_owned()
    } else {
        format!("standalone/sidecar-{k}.yaml")
    }
}

/// One config file per replica: `sidecar` with replica k's `listen` and `metrics_listen` (the
/// configured ports + k; a metrics port 0 stays 0).
///
/// # Errors
/// A sidecar config that is not a mapping (a bug).
pub fn sidecar_files<T: serde::Serialize>(loaded: &Loaded, sidecar: &T) -> Result<Vec<File>, Error> {
    let s = &loaded.config.sidecar;
    let base = to_tree(sidecar).map_err(Error::Internal)?;
    let mut files = Vec::with_capacity(usize::from(s.replicas));
    for k in 0..s.replicas {
        let mut replica = base.clone();
        if k > 0 {
            let mut listen = s.listen;
            listen.set_port(SidecarSection::replica_port(listen.port(), k));
            let mut ok = set(&mut replica, "listen", Value::String(listen.to_string()));
            if let Some(mut metrics) = s.metrics_listen.filter(|m| m.port() != 0) {
                metrics.set_port(SidecarSection::replica_port(metrics.port(), k));
                ok &= set(&mut replica, "metrics_listen", Value::String(metrics.to_string()));
            }
            if !ok {
                return Err(Error::Internal("the sidecar config is not a mapping".into()));
            }
        }
        files.push(File::yaml(&sidecar_path(k), &replica)?);
    }
    Ok(files)
}

/// The ext_proc cluster's endpoints: `first` (where Envoy reaches replica 0) and the next
/// `sidecar.replicas - 1` ports on the same host.
pub(crate) fn sidecar_endpoints(loaded: &Loaded, first: &HostPort) -> Vec<LbEndpoint> {
    (0..loaded.config.sidecar.replicas)
        .map(|k| LbEndpoint::new(first.host.clone(), SidecarSection::replica_port(first.port, k)))
        .collect()
}

/// The ext_proc cluster's health checks and load balancing (envoy/ext_proc_health.yaml).
///
/// # Errors
/// An internal template error.
pub fn sidecar_health() -> Result<Value, Error> {
    Ok(template::render(template::EXT_PROC_HEALTH, &Values::new())?)
}

/// The rendered hot-restart files, with `envoy.hot_restart`; none without.
///
/// # Errors
/// An internal template error.
pub fn hot_restart_files(loaded: &Loaded) -> Result<Vec<File>, Error> {
    let Some(h) = &loaded.config.envoy.hot_restart else { return Ok(Vec::new()) };
    let path = |name: &str| h.dir.join(name).display().to_string();
    let start = Values::new()
        .set("ENVOY_BIN", h.envoy_bin.display().to_string())
        .set("CONFIG", path("envoy.yaml"))
        .set("BASE_ID", h.base_id)
        .set("DRAIN_TIME_S", h.drain_time_s)
        .set("PARENT_SHUTDOWN_TIME_S", h.parent_shutdown_time_s)
        .set("CONCURRENCY", concurrency(h));
    let unit = Values::new()
        .set("PYTHON", h.python.display().to_string())
        .set("RESTARTER", path(HOT_RESTARTER))
        .set("START_SCRIPT", path(START_ENVOY));
    Ok(vec![
        File {
            path: format!("standalone/{START_ENVOY}"),
            content: template::substitute(template::START_ENVOY, &start)?,
        },
        File {
            path: format!("standalone/{HOT_RESTARTER}"),
            content: template::substitute(template::HOT_RESTARTER, &Values::new())?,
        },
        File {
            path: format!("standalone/{ENVOY_UNIT}"),
            content: template::substitute(template::ENVOY_UNIT, &unit)?,
        },
    ])
}

/// `--concurrency`'s value: the configured one, else the host's processors, as Envoy counts by
/// default (`"$(nproc)"`, expanded by the shell inside its double quotes).
fn concurrency(h: &HotRestartSection) -> Value {
    match h.concurrency {
        Some(n) => Value::from(n),
        None => Value::String("$(nproc)".to_owned()),
    }
}

/// The name of the epoch's start script.
pub const START_ENVOY: &str = "start-envoy.sh";
/// The name of the hot-restart wrapper.
pub const HOT_RESTARTER: &str = "hot-restarter.py";
/// The name of the systemd unit.
pub const ENVOY_UNIT: &str = "llm-gateway-envoy.service";

/// Notes for the operator: how to run the replicas and the hot restart.
pub fn notes(loaded: &Loaded) -> Vec<String> {
    let mut notes = Vec::new();
    let n = loaded.config.sidecar.replicas;
    if n > 1 {
        notes.push(format!(
            "{n} sidecar replicas: start each with its own file (standalone/sidecar.yaml, standalone/sidecar-1.yaml, \
             ...); restart them one at a time, each once the one before is back (docs/operations.md, \
             \"Upgrading the sidecar\")"
        ));
    }
    if let Some(h) = &loaded.config.envoy.hot_restart {
        notes.push(format!(
            "hot restart: install standalone/ in {dir} and standalone/{ENVOY_UNIT} in /etc/systemd/system; \
             `systemctl reload llm-gateway-envoy` (SIGHUP to hot-restarter.py) starts the next epoch with \
             --restart-epoch N --base-id {} --drain-time-s {} --parent-shutdown-time-s {}",
            h.base_id,
            h.drain_time_s,
            h.parent_shutdown_time_s,
            dir = h.dir.display()
        ));
    }
    notes
}

#[cfg(test)]
mod tests {
    use super::sidecar_path;

    #[test]
    fn replica_files_keep_the_first_name() {
        assert_eq!(sidecar_path(0), "standalone/sidecar.yaml");
        assert_eq!(sidecar_path(2), "standalone/sidecar-2.yaml");
    }
}
