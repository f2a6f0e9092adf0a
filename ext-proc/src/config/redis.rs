//! `redis` (the connection, TLS, ACL user, breaker, failure modes, leases) and the sidecar's own
//! listener TLS (`tls`), with the files and secrets they name.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::config::error::{invalid, ConfigError};

/// mTLS of the sidecar's gRPC listener: its certificate, and the CA whose certificates clients
/// (Envoy) must present; a connection without one, or with one from another CA, fails its TLS
/// handshake before any gRPC call. PEM files, read once at start-up.
#[derive(Debug, Clone, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct ListenerTls {
    /// The server certificate chain (PEM, leaf first).
    pub cert_file: PathBuf,
    /// The server's private key (PEM: PKCS#8, PKCS#1 or SEC1).
    pub key_file: PathBuf,
    /// The CA certificate(s) (PEM) that sign the clients' certificates. Required: the listener
    /// never accepts a client without a certificate.
    pub client_ca_file: PathBuf,
    /// PEM bytes read at load time (see [`crate::config::Config::load`]).
    #[serde(skip)]
    pub pem: Option<ListenerPem>,
}

/// The PEM contents of [`ListenerTls`]'s files, checked at load.
#[derive(Clone)]
pub struct ListenerPem {
    /// Certificate chain.
    pub cert: Vec<u8>,
    /// Private key.
    pub key: Secret<Vec<u8>>,
    /// Client CA certificate(s).
    pub client_ca: Vec<u8>,
}

impl std::fmt::Debug for ListenerPem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ListenerPem").field("key", &self.key).finish_non_exhaustive()
    }
}

/// A secret (a Redis password, a private key): its `Debug` prints `<redacted>`, it has no
/// `Display`, and it is read only through [`Secret::expose`].
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Secret<T>(pub(super) T);

impl<T> Secret<T> {
    /// The secret value.
    pub fn expose(&self) -> &T {
        &self.0
    }
}

impl<T> std::fmt::Debug for Secret<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

/// TLS towards Redis (`rediss://` URLs): the CA that signs the Redis server certificates
/// (absent: the system's roots) and a client certificate for a Redis that requires one
/// (`tls-auth-clients yes`). PEM files, read once at start-up. The server's name (or IP) in the
/// URL must be in its certificate; there is no way to skip the check.
#[derive(Debug, Clone, Default, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct RedisTls {
    /// CA certificate(s) (PEM) trusted for the Redis servers, instead of the system's roots.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_file: Option<PathBuf>,
    /// Client certificate chain (PEM); with `key_file`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cert_file: Option<PathBuf>,
    /// Client private key (PEM); with `cert_file`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_file: Option<PathBuf>,
}

/// The PEM contents of [`RedisTls`]'s files and the password, read at load.
#[derive(Debug, Clone, Default)]
pub struct RedisSecrets {
    /// The password (`redis.password_file` or `redis.password_env`).
    pub password: Option<Secret<String>>,
    /// The CA certificate(s).
    pub ca: Option<Vec<u8>>,
    /// The client certificate chain and key.
    pub client: Option<(Vec<u8>, Secret<Vec<u8>>)>,
}

/// Redis connection settings.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RedisConfig {
    /// Single-instance URL: `redis://host:6379/0`, or `rediss://host:6380/0` for TLS. Exactly one
    /// of `url` and `cluster_urls` must be set. Credentials never go in a URL (refused: a URL
    /// with `user@`, `user:password@` or a `pass=` parameter); set `username` and
    /// `password_file` / `password_env`.
    #[serde(default)]
    pub url: Option<String>,
    /// Seed node URLs of a Redis Cluster (all `redis://` or all `rediss://`).
    #[serde(default)]
    pub cluster_urls: Vec<String>,
    /// Redis ACL user to authenticate as (`AUTH <username> <password>`); needs a password.
    /// Absent: `AUTH <password>` (the `default` user, `requirepass`) when a password is set.
    #[serde(default)]
    pub username: Option<String>,
    /// File holding the Redis password (one trailing newline is ignored), e.g. a mounted
    /// Kubernetes Secret. At most one of `password_file` and `password_env`.
    #[serde(default)]
    pub password_file: Option<PathBuf>,
    /// Environment variable holding the Redis password.
    #[serde(default)]
    pub password_env: Option<String>,
    /// TLS settings for `rediss://` URLs (absent with `rediss://`: the system's roots, no
    /// client certificate).
    #[serde(default)]
    pub tls: Option<RedisTls>,
    /// The password and PEM contents, read at load ([`crate::config::Config::load`]); never printed.
    #[serde(skip)]
    pub secrets: RedisSecrets,
    /// Timeout of one Redis command, in milliseconds (default 25).
    #[serde(default = "default_command_timeout_ms")]
    pub command_timeout_ms: u64,
    /// Prefix of every key the sidecar writes (default `llmgw`).
    #[serde(default = "default_key_prefix")]
    pub key_prefix: String,
    /// What admission does when Redis cannot decide (error, timeout, open breaker): `open`
    /// applies approximate limits from in-memory buckets in this sidecar, `closed` answers 503
    /// `rate_limiter_unavailable`. Default `open`; per tier in `tier_failure_modes`.
    #[serde(default)]
    pub failure_mode: FailureMode,
    /// Failure mode per tenant tier (`x-gateway-tier`), overriding `failure_mode`.
    #[serde(default)]
    pub tier_failure_modes: BTreeMap<String, FailureMode>,
    /// Circuit breaker in front of Redis.
    #[serde(default)]
    pub breaker: BreakerConfig,
    /// With failure mode `open`, the share of each limit (burst and rate) this sidecar's
    /// in-memory buckets allow, in (0, 1] (default 1). With N sidecars, 1/N keeps the tenant near
    /// its limit while Redis is away instead of up to N times it.
    #[serde(default = "default_local_share")]
    pub local_share: f64,
    /// Token leases (default 0: none): a sidecar takes up to this fraction of a bucket's capacity
    /// from Redis with a request, and admits the next requests of that bucket from it without a
    /// Redis round trip. In [0, 0.5]. Never over-admits; under-admits by at most the leases the
    /// other sidecars hold, and `x-ratelimit-remaining-*` of a leased admission is approximate.
    /// Buckets whose lease would not cover two requests are not leased.
    #[serde(default)]
    pub lease_fraction: f64,
    /// How long a lease admits after its last grant before its unused tokens go back to Redis,
    /// in milliseconds (default 1000).
    #[serde(default = "default_lease_ttl_ms")]
    pub lease_ttl_ms: u64,
}

fn default_lease_ttl_ms() -> u64 {
    1000
}

fn default_local_share() -> f64 {
    1.0
}

impl RedisConfig {
    /// The failure mode of a tier.
    pub fn failure_mode(&self, tier: &str) -> FailureMode {
        self.tier_failure_modes.get(tier).copied().unwrap_or(self.failure_mode)
    }
}

/// Circuit breaker settings: after `failure_threshold` consecutive Redis failures, decisions are
/// made degraded at once for `open_ms`, then one probe goes to Redis.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BreakerConfig {
    /// Consecutive failures that open the breaker (default 3).
    #[serde(default = "default_failure_threshold")]
    pub failure_threshold: u32,
    /// How long it stays open, in milliseconds (default 1000).
    #[serde(default = "default_open_ms")]
    pub open_ms: u64,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        Self { failure_threshold: default_failure_threshold(), open_ms: default_open_ms() }
    }
}

fn default_failure_threshold() -> u32 {
    3
}

fn default_open_ms() -> u64 {
    1000
}

/// Admission's behaviour when the limiter cannot decide.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureMode {
    /// Admit the request (limits are not enforced while Redis is away).
    #[default]
    Open,
    /// Refuse the request with 503.
    Closed,
}

fn default_command_timeout_ms() -> u64 {
    25
}

fn default_key_prefix() -> String {
    "llmgw".to_owned()
}

impl RedisConfig {
    /// Checks the URLs, credentials and TLS settings (no file is read here).
    pub(super) fn validate_connection(&self) -> Result<(), ConfigError> {
        let mut schemes = Vec::new();
        if let Some(url) = &self.url {
            schemes.push(check_redis_url("redis.url", url)?);
        }
        for (i, url) in self.cluster_urls.iter().enumerate() {
            schemes.push(check_redis_url(&format!("redis.cluster_urls[{i}]"), url)?);
        }
        let tls = schemes.first().copied().unwrap_or(false);
        if schemes.iter().any(|s| *s != tls) {
            return Err(invalid("redis.cluster_urls", "mixes redis:// and rediss:// URLs"));
        }
        if let Some(t) = &self.tls {
            if !tls {
                return Err(invalid("redis.tls", "needs rediss:// URLs"));
            }
            if t.cert_file.is_some() != t.key_file.is_some() {
                return Err(invalid("redis.tls", "set both cert_file and key_file, or neither"));
            }
        }
        if self.password_file.is_some() && self.password_env.is_some() {
            return Err(invalid("redis", "set at most one of password_file and password_env"));
        }
        if let Some(user) = &self.username {
            if user.is_empty() || user.contains(char::is_whitespace) {
                return Err(invalid("redis.username", "must be non-empty, without spaces"));
            }
            if self.password_file.is_none() && self.password_env.is_none() {
                return Err(invalid("redis.username", "needs redis.password_file or redis.password_env"));
            }
        }
        if matches!(&self.password_env, Some(v) if v.is_empty()) {
            return Err(invalid("redis.password_env", "must name a variable"));
        }
        Ok(())
    }

    /// Whether the URLs are `rediss://`.
    pub fn uses_tls(&self) -> bool {
        self.url.iter().chain(&self.cluster_urls).any(|u| u.starts_with("rediss://"))
    }
}

/// What a PEM file must hold.
#[derive(Clone, Copy)]
pub(super) enum PemKind {
    /// One or more certificates.
    Certificates,
    /// One private key.
    PrivateKey,
}

/// Reads a PEM file and checks it holds what `kind` says (errors name `field` and the path).
pub(super) fn read_pem(field: &str, path: &Path, kind: PemKind) -> Result<Vec<u8>, ConfigError> {
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::{CertificateDer, PrivateKeyDer};
    let bytes = std::fs::read(path).map_err(|e| invalid(field, format!("{}: {e}", path.display())))?;
    let bad = |what: &str| invalid(field, format!("{}: {what}", path.display()));
    match kind {
        PemKind::Certificates => {
            let certs = CertificateDer::pem_slice_iter(&bytes)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| bad(&format!("not PEM certificates ({e})")))?;
            if certs.is_empty() {
                return Err(bad("no PEM certificate in it"));
            }
        }
        PemKind::PrivateKey => {
            // The key's parse error is not printed: it could quote key material.
            PrivateKeyDer::from_pem_slice(&bytes).map_err(|_| bad("no PEM private key in it"))?;
        }
    }
    Ok(bytes)
}

/// Checks a Redis URL without printing it: a scheme the sidecar supports, no credentials in it,
/// no `#insecure` (which would skip the server certificate check).
fn check_redis_url(field: &str, url: &str) -> Result<bool, ConfigError> {
    let (scheme, rest) =
        url.split_once("://").ok_or_else(|| invalid(field, "not a URL (redis://... or rediss://...)"))?;
    let tls = match scheme {
        "redis" => false,
        "rediss" => true,
        _ => return Err(invalid(field, "the scheme must be redis:// or rediss://")),
    };
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    if authority.contains('@') || rest.contains("pass=") || rest.contains("user=") {
        return Err(invalid(
            field,
            "must not carry credentials; set redis.username and redis.password_file or redis.password_env",
        ));
    }
    if rest.contains('#') {
        return Err(invalid(field, "a #fragment (e.g. #insecure) is not supported"));
    }
    Ok(tls)
}

pub(super) fn valid_key_part(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b':'))
}
