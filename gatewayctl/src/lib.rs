//! `gatewayctl`: the gateway's deployment tool.
//!
//! One gateway config (YAML, [`config`]) is the source of truth; [`render`] turns it into the
//! Envoy bootstrap, the wasm filter's plugin config and the sidecar's config for a standalone
//! Envoy, and into Kubernetes, Istio and Envoy Gateway manifests. Every filter and sidecar config
//! is accepted by that component's own parser before it is written, so a config the components
//! would refuse is caught at render time. [`keys`] makes API keys and their digests; [`key_edit`] adds,
//! revokes and lists a tenant's keys in the config file, keeping its comments.
//!
//! ```no_run
//! # fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use gatewayctl::{config::Loaded, render};
//! let loaded = Loaded::load("gateway.yaml".as_ref())?;
//! let output = render::render(&loaded, render::Target::All)?;
//! render::write(&output.files, "out".as_ref())?;
//! # Ok(()) }
//! ```

pub mod apply;
pub mod config;
pub mod key_edit;
pub mod keys;
pub mod render;
pub mod template;
pub mod tree;
pub mod usage;
