//! What a config reload may change: the sections read per request (tenants, prices, pools,
//! shedding, flow control, models, context, the shutdown grace) reload; those bound to what the
//! process opened at start (its listeners, its Redis connection, the usage writer, the tracer)
//! do not, and a file that changes one of them is refused whole, the section named.
//!
//! Sections are compared as written (YAML values), so a section that only spells out its
//! defaults counts as changed.

use std::collections::BTreeSet;

use serde_yaml_ng::Value;

use crate::config::error::{invalid, ConfigError};
use crate::config::Config;

/// The top-level sections that do not reload, each with why.
pub const FIXED: [(&str, &str); 8] = [
    ("listen", "the gRPC listener is bound at start"),
    ("tls", "the gRPC listener's certificates are loaded at start"),
    ("redis", "the Redis connection and the limiter are set up at start"),
    ("metering", "the usage writer and the journal are started at start"),
    ("metrics_listen", "the metrics listener is bound at start"),
    ("request_facts", "where the request facts come from is fixed with Envoy's configuration"),
    ("endpoint_pickers", "the endpoint-picker listeners are bound at start"),
    ("tracing", "the OTLP exporter is set up at start"),
];

/// A config file read for a reload: the validated config and the file's sections as written.
#[derive(Debug, Clone)]
pub struct Candidate {
    /// The validated config (its files and secrets not read yet).
    pub config: Config,
    /// The file's top-level sections as written.
    pub sections: Value,
}

impl Candidate {
    /// Parses and validates `text` as [`Config::from_yaml`] does (`path` names the file in
    /// errors); reads no file ([`Config::read_secrets`] does).
    ///
    /// # Errors
    /// The [`ConfigError`] of the first field that does not validate.
    pub fn parse(text: &str, path: &str) -> Result<Self, ConfigError> {
        let sections: Value = serde_yaml_ng::from_str(text)
            .map_err(|e| ConfigError::Parse { path: path.to_owned(), message: e.to_string() })?;
        let config = Config::from_yaml(text).map_err(|e| match e {
            ConfigError::Parse { message, .. } => ConfigError::Parse { path: path.to_owned(), message },
            other => other,
        })?;
        Ok(Self { config, sections })
    }

    /// The sections `self` changes from `running`, by name (sorted).
    ///
    /// # Errors
    /// A section of [`FIXED`] that differs, named with why it cannot reload.
    pub fn changes(&self, running: &Value) -> Result<BTreeSet<String>, ConfigError> {
        let names: BTreeSet<String> =
            keys(running).chain(keys(&self.sections)).collect::<BTreeSet<_>>().into_iter().collect();
        let mut changed = BTreeSet::new();
        for name in names {
            if running.get(&name) == self.sections.get(&name) {
                continue;
            }
            if let Some((_, why)) = FIXED.iter().find(|(fixed, _)| *fixed == name) {
                return Err(invalid(
                    name,
                    format!("cannot change while the sidecar runs ({why}): restart it to apply this change"),
                ));
            }
            changed.insert(name);
        }
        Ok(changed)
    }
}

fn keys(v: &Value) -> impl Iterator<Item = String> + '_ {
    v.as_mapping().into_iter().flat_map(|m| m.keys().filter_map(|k| k.as_str().map(str::to_owned)))
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = "
listen: 127.0.0.1:50051
redis: {url: redis://127.0.0.1:6379}
tenants:
  - {id: acme, limits: {requests_per_minute: 60}}
";

    fn running() -> Value {
        Candidate::parse(BASE, "sidecar.yaml").unwrap().sections
    }

    #[test]
    fn a_limit_change_reloads_and_names_its_section() {
        let next = BASE.replace("requests_per_minute: 60", "requests_per_minute: 120");
        let c = Candidate::parse(&next, "sidecar.yaml").unwrap();
        assert_eq!(c.changes(&running()).unwrap(), BTreeSet::from(["tenants".to_owned()]));
        assert_eq!(c.config.tenants[0].limits.requests_per_minute, Some(120));
    }

    #[test]
    fn a_new_section_counts_as_changed() {
        let next = format!("{BASE}shutdown_grace_ms: 5000\n");
        let c = Candidate::parse(&next, "sidecar.yaml").unwrap();
        assert_eq!(c.changes(&running()).unwrap(), BTreeSet::from(["shutdown_grace_ms".to_owned()]));
    }

    #[test]
    fn the_same_file_changes_nothing() {
        let c = Candidate::parse(BASE, "sidecar.yaml").unwrap();
        assert!(c.changes(&running()).unwrap().is_empty());
    }

    #[test]
    fn a_listen_address_change_is_refused_with_the_reason() {
        let next = BASE.replace("50051", "50052");
        let c = Candidate::parse(&next, "sidecar.yaml").unwrap();
        let e = c.changes(&running()).unwrap_err().to_string();
        assert!(e.starts_with("listen: cannot change while the sidecar runs"), "{e}");
        assert!(e.contains("restart it"), "{e}");
    }

    #[test]
    fn a_redis_change_is_refused() {
        let next = BASE.replace("6379", "6380");
        let e = Candidate::parse(&next, "sidecar.yaml").unwrap().changes(&running()).unwrap_err();
        assert!(e.to_string().starts_with("redis: "), "{e}");
    }

    #[test]
    fn an_invalid_file_names_the_field() {
        let next = BASE.replace("requests_per_minute: 60", "requests_per_minute: 0");
        let e = Candidate::parse(&next, "sidecar.yaml").unwrap_err().to_string();
        assert!(e.contains("tenants[0].limits.requests_per_minute"), "{e}");
    }
}
