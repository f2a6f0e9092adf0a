//! `gatewayctl apply`: swaps the running standalone gateway's configuration with nothing
//! restarted. It renders the standalone target (every check included), refuses a sidecar change
//! that cannot reload (its listen address, its Redis, ...: the sidecar's own
//! [`gateway_ext_proc::config::reload`] rules), then renames the new files into
//! `envoy.live_config.dir` in the order that refuses no request:
//! - the sidecar's `sidecar.yaml` first when the new config adds a tenant (the sidecar must know
//!   it before the filter lets its keys through, or its requests get 403
//!   `tenant_not_configured`), waiting until the sidecar serves it;
//! - the filter's `filter.json` first otherwise (a removed tenant's keys stop at the filter before
//!   the sidecar forgets it).
//!
//! The sidecar serves a file once its `llm_gateway_config_info{sha256}` names the file's SHA-256
//! (`sidecar.metrics_listen`); without a metrics listener apply cannot see it and says so.

use std::collections::BTreeSet;
use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

use crate::config::{ConfigError, FieldError, Loaded, SidecarSection};
use crate::render::{render_inner, Error, Target, LIVE_DIR, LIVE_FILTER_FILE};

/// In which order apply writes the two files.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Order {
    /// The sidecar's config, then (once the sidecar serves it) the filter's.
    SidecarFirst,
    /// The filter's config, then the sidecar's.
    FilterFirst,
}

/// The order for a change of the sidecar's config from `running` (None: no live file yet) to
/// `next`: sidecar first when `next` has a tenant `running` lacks, or a named key
/// (`tenants[].api_keys`) it lacks, so that the key's first request draws on its own limits.
pub fn order(
    running: Option<&gateway_ext_proc::config::Config>,
    next: &gateway_ext_proc::config::Config,
) -> Order {
    let Some(running) = running else { return Order::SidecarFirst };
    let known = names(running);
    if names(next).iter().any(|n| !known.contains(n)) {
        Order::SidecarFirst
    } else {
        Order::FilterFirst
    }
}

/// Every tenant (`(id, "")`) and every key the sidecar knows by name (`(id, name)`).
fn names(config: &gateway_ext_proc::config::Config) -> BTreeSet<(&str, &str)> {
    let mut out = BTreeSet::new();
    for t in &config.tenants {
        out.insert((t.id.as_str(), ""));
        out.extend(t.api_keys.iter().map(|k| (t.id.as_str(), k.name.as_str())));
    }
    out
}

/// What [`apply`] did.
#[derive(Debug)]
pub struct Applied {
    /// The order it wrote the files in.
    pub order: Order,
    /// The filter's ECDS file.
    pub filter: PathBuf,
    /// The sidecar replicas' config files (`sidecar.yaml`, `sidecar-<k>.yaml`).
    pub sidecars: Vec<PathBuf>,
    /// Whether the sidecars' files changed.
    pub sidecar_changed: bool,
    /// How long the slowest replica took to serve its new file, when apply saw them all (with
    /// `sidecar.metrics_listen`).
    pub sidecar_took: Option<Duration>,
    /// What the operator should know (nothing confirmed, a first apply).
    pub notes: Vec<String>,
}

/// One replica's file: rendered, and as it is in the live directory.
struct Replica {
    path: PathBuf,
    rendered: String,
    running: Option<String>,
    /// Where its metrics are read (`sidecar.metrics_listen`'s port + k).
    metrics: Option<SocketAddr>,
}

impl Replica {
    fn changed(&self) -> bool {
        self.running.as_deref() != Some(self.rendered.as_str())
    }
}

/// Applies `loaded` to the running standalone gateway (see the module's doc), waiting at most
/// `wait` for each sidecar replica to serve its new file.
///
/// # Errors
/// No `envoy.live_config`; any error of the config, or a sidecar change that cannot reload
/// (nothing is written then); the directory cannot be written; a replica did not serve its new
/// file within `wait` when the sidecars had to go first (the filter's file is then not written).
pub fn apply(loaded: &Loaded, wait: Duration) -> Result<Applied, ConfigError> {
    apply_inner(loaded, wait).map_err(|e| e.in_file(&loaded.file))
}

fn apply_inner(loaded: &Loaded, wait: Duration) -> Result<Applied, Error> {
    let live = loaded.config.envoy.live_config.as_ref().ok_or_else(|| {
        FieldError::new("envoy.live_config", "required by apply: the directory the running Envoy watches")
    })?;
    let output = render_inner(loaded, Target::Standalone)?;
    let filter_text = output
        .files
        .iter()
        .find(|f| f.path == LIVE_FILTER_FILE)
        .map(|f| f.content.clone())
        .ok_or_else(|| Error::Internal(format!("{LIVE_FILTER_FILE} not rendered")))?;
    let replicas = replicas(loaded, &output.files, &live.dir);
    let first = replicas.first().ok_or_else(|| Error::Internal("no sidecar config rendered".into()))?;
    let next = gateway_ext_proc::config::reload::Candidate::parse(
        &first.rendered,
        &first.path.display().to_string(),
    )
    .map_err(|e| Error::Internal(format!("the rendered sidecar config: {e}")))?;
    let mut running = None;
    for r in &replicas {
        if let Some(text) = &r.running {
            let candidate = gateway_ext_proc::config::reload::Candidate::parse(&r.rendered, "")
                .map_err(|e| Error::Internal(format!("the rendered sidecar config: {e}")))?;
            running = Some(running_sidecar(text, &r.path, &candidate)?);
        }
    }
    let order = order(running.as_ref(), &next.config);
    let io = |e: std::io::Error| Error::Internal(format!("{}: {e}", live.dir.display()));
    std::fs::create_dir_all(&live.dir).map_err(io)?;
    let mut notes = Vec::new();
    let mut sidecar_took = None;
    let mut swap_sidecars = |notes: &mut Vec<String>| -> Result<(), Error> {
        sidecar_took = swap_replicas(&replicas, &live.dir, wait, notes)?;
        Ok(())
    };
    if order == Order::SidecarFirst {
        swap_sidecars(&mut notes)?;
        swap_in(&live.dir, "filter.json", &filter_text).map_err(io)?;
    } else {
        swap_in(&live.dir, "filter.json", &filter_text).map_err(io)?;
        swap_sidecars(&mut notes)?;
    }
    Ok(Applied {
        order,
        filter: live.filter_path(),
        sidecar_changed: replicas.iter().any(Replica::changed),
        sidecars: replicas.into_iter().map(|r| r.path).collect(),
        sidecar_took,
        notes,
    })
}

/// The replicas' rendered files under [`LIVE_DIR`], in order, with what `dir` holds of each.
fn replicas(loaded: &Loaded, files: &[crate::render::File], dir: &Path) -> Vec<Replica> {
    let metrics = sidecar_metrics_addr(loaded);
    files
        .iter()
        .filter_map(|f| {
            let name = f.path.strip_prefix(LIVE_DIR)?;
            let k: u16 = match name {
                "sidecar.yaml" => 0,
                other => other.strip_prefix("sidecar-")?.strip_suffix(".yaml")?.parse().ok()?,
            };
            Some((k, (name, f)))
        })
        .collect::<std::collections::BTreeMap<_, _>>()
        .into_iter()
        .map(|(k, (name, f))| {
            let path = dir.join(name);
            Replica {
                running: std::fs::read_to_string(&path).ok(),
                path,
                rendered: f.content.clone(),
                metrics: metrics.map(|mut m| {
                    m.set_port(SidecarSection::replica_port(m.port(), k));
                    m
                }),
            }
        })
        .collect()
}

/// Renames each changed replica's new file in, then waits until every replica that was running
/// from its file serves the new one; returns the longest wait, when all were seen.
fn swap_replicas(
    replicas: &[Replica],
    dir: &Path,
    wait: Duration,
    notes: &mut Vec<String>,
) -> Result<Option<Duration>, Error> {
    let io = |e: std::io::Error| Error::Internal(format!("{}: {e}", dir.display()));
    let mut waiting = Vec::new();
    for r in replicas.iter().filter(|r| r.changed()) {
        let name = r.path.file_name().and_then(|n| n.to_str()).unwrap_or("sidecar.yaml");
        swap_in(dir, name, &r.rendered).map_err(io)?;
        match (&r.running, r.metrics) {
            (None, _) => notes.push(format!(
                "{} is new: start the replica with --config {0} so that it reloads what apply writes",
                r.path.display()
            )),
            (Some(_), None) => notes.push(format!(
                "sidecar.metrics_listen is not set: apply cannot see the replica of {} take its file (it \
                 checks it every 250 ms)",
                r.path.display()
            )),
            (Some(_), Some(addr)) => waiting.push((r, addr)),
        }
    }
    let mut longest = Duration::ZERO;
    for (r, addr) in &waiting {
        let took = wait_for_sidecar(*addr, &sha256(&r.rendered), wait).map_err(|why| {
            Error::Internal(format!(
                "the sidecar did not serve {} within {} ms ({why}); its log names what it refused",
                r.path.display(),
                wait.as_millis()
            ))
        })?;
        longest = longest.max(took);
    }
    Ok((!waiting.is_empty() && waiting.len() == replicas.iter().filter(|r| r.changed()).count())
        .then_some(longest))
}

/// The running sidecar file, checked against `next`: a change of a section that cannot reload is
/// refused before anything is written.
fn running_sidecar(
    text: &str,
    path: &Path,
    next: &gateway_ext_proc::config::reload::Candidate,
) -> Result<gateway_ext_proc::config::Config, Error> {
    let display = path.display().to_string();
    let sections: serde_yaml_ng::Value =
        serde_yaml_ng::from_str(text).map_err(|e| Error::Internal(format!("{display}: {e}")))?;
    next.changes(&sections)
        .map_err(|e| FieldError::new(format!("sidecar ({display})"), format!("{e}; nothing was applied")))?;
    gateway_ext_proc::config::Config::from_yaml(text).map_err(|e| Error::Internal(format!("{display}: {e}")))
}

/// Writes `content` to `dir/name` by renaming a new file over it, so that a reader never sees a
/// partial file.
fn swap_in(dir: &Path, name: &str, content: &str) -> std::io::Result<()> {
    let tmp = dir.join(format!(".{name}.tmp"));
    std::fs::write(&tmp, content)?;
    std::fs::rename(&tmp, dir.join(name))
}

fn sha256(text: &str) -> String {
    hex::encode(Sha256::digest(text.as_bytes()))
}

/// Where apply reads the sidecar's metrics: `sidecar.metrics_listen`, an unspecified address as
/// loopback.
fn sidecar_metrics_addr(loaded: &Loaded) -> Option<SocketAddr> {
    let mut addr = loaded.config.sidecar.metrics_listen?;
    if addr.ip().is_unspecified() {
        addr.set_ip(if addr.is_ipv4() {
            std::net::Ipv4Addr::LOCALHOST.into()
        } else {
            std::net::Ipv6Addr::LOCALHOST.into()
        });
    }
    Some(addr)
}

/// Polls the sidecar's `/metrics` until `llm_gateway_config_info` names `sha256`; returns how
/// long that took.
fn wait_for_sidecar(addr: SocketAddr, sha256: &str, wait: Duration) -> Result<Duration, String> {
    let start = Instant::now();
    let needle = format!("llm_gateway_config_info{{sha256=\"{sha256}\"}} 1");
    loop {
        let last = match scrape(addr) {
            Ok(body) if body.contains(&needle) => return Ok(start.elapsed()),
            Ok(_) => "it still serves another file".to_owned(),
            Err(e) => format!("{addr}: {e}"),
        };
        if start.elapsed() >= wait {
            return Err(last);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// One plain HTTP/1.0 GET of `/metrics` on loopback.
fn scrape(addr: SocketAddr) -> std::io::Result<String> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(1))?;
    stream.set_read_timeout(Some(Duration::from_secs(2)))?;
    stream.write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")?;
    let mut body = String::new();
    stream.read_to_string(&mut body)?;
    Ok(body)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sidecar(tenants: &[&str]) -> gateway_ext_proc::config::Config {
        let mut text =
            String::from("listen: 127.0.0.1:50051\nredis: {url: redis://127.0.0.1:6379}\ntenants:\n");
        for t in tenants {
            text.push_str(&format!("  - {{id: {t}, limits: {{requests_per_minute: 60}}}}\n"));
        }
        gateway_ext_proc::config::Config::from_yaml(&text).unwrap()
    }

    #[test]
    fn a_new_tenant_goes_to_the_sidecar_first() {
        assert_eq!(order(Some(&sidecar(&["a"])), &sidecar(&["a", "b"])), Order::SidecarFirst);
    }

    #[test]
    fn a_removal_or_a_limit_change_goes_to_the_filter_first() {
        assert_eq!(order(Some(&sidecar(&["a", "b"])), &sidecar(&["a"])), Order::FilterFirst);
        assert_eq!(order(Some(&sidecar(&["a"])), &sidecar(&["a"])), Order::FilterFirst);
    }

    #[test]
    fn a_tenant_added_and_another_removed_goes_to_the_sidecar_first() {
        assert_eq!(order(Some(&sidecar(&["a", "b"])), &sidecar(&["a", "c"])), Order::SidecarFirst);
    }

    #[test]
    fn a_key_with_limits_of_its_own_goes_to_the_sidecar_first() {
        let with_key = |keys: &str| {
            gateway_ext_proc::config::Config::from_yaml(&format!(
                "listen: 127.0.0.1:50051\nredis: {{url: redis://127.0.0.1:6379}}\ntenants:\n  - id: a\n    \
                 limits: {{requests_per_minute: 60}}\n    api_keys: [{keys}]\n"
            ))
            .unwrap()
        };
        let old = with_key("{name: k1, limits: {requests_per_minute: 5}}");
        let new = with_key(
            "{name: k1, limits: {requests_per_minute: 5}}, {name: k2, limits: {requests_per_minute: 5}}",
        );
        assert_eq!(order(Some(&old), &new), Order::SidecarFirst);
        assert_eq!(order(Some(&new), &old), Order::FilterFirst);
    }

    #[test]
    fn no_running_file_goes_to_the_sidecar_first() {
        assert_eq!(order(None, &sidecar(&["a"])), Order::SidecarFirst);
    }
}
