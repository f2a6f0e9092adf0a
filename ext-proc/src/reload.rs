//! The live config: the sidecar re-reads its config file when it changes (checked every
//! [`POLL`]) or at SIGHUP, validates it whole ([`Candidate`]), and swaps in a new generation of the
//! shared state ([`Live::swap`]): streams that open after the swap take the new config, streams
//! open before it finish under the one they started with. A file that does not validate, or that
//! changes a section which cannot reload ([`crate::config::reload::FIXED`]), is refused: the error
//! names the field, `llm_gateway_config_reloads_total{result="refused"}` counts it, and the
//! running config stays.
//!
//! What a new generation rebuilds: the context checker (its tokenizers) when `models` or
//! `context` changed; the pools (their scrapers, picker state and flow-control queues) when
//! `pools` or `flow_control` changed, the old ones serving their queued and in-flight requests
//! until those end; the quotas and prices (shared by every clone of the store) when `tenants` or
//! `prices` changed. The limiter, the usage writer, the metrics and the Redis connection belong
//! to the process and carry over.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use sha2::{Digest, Sha256};
use tokio::sync::watch;
use tracing::{error, info};

use crate::admission::context::ContextChecker;
use crate::admission::quota::QuotaBook;
use crate::config::error::ConfigError;
use crate::config::reload::Candidate;
use crate::config::Config;
use crate::metrics::labels::ReloadResult;
use crate::pools::Pools;
use crate::state::{Live, Shared};

/// How often the config file is checked for a change (a Kubernetes ConfigMap's mounted file is
/// replaced by a symlink swap; `gatewayctl apply` renames a new file in).
pub const POLL: Duration = Duration::from_millis(250);

/// The file being watched and what the running generation was read from.
pub struct Watched {
    path: PathBuf,
    /// The bytes last read (applied or refused): a refused file is not tried again until it
    /// changes.
    seen: Vec<u8>,
    /// The running config's sections as written.
    running: serde_yaml_ng::Value,
    /// The running file's SHA-256, lowercase hex.
    sha256: String,
}

impl Watched {
    /// Watches `path`, whose bytes `text` the running `config` was loaded from.
    ///
    /// # Errors
    /// `text` does not parse (it validated at start, so only if it changed in between).
    pub fn new(path: PathBuf, text: Vec<u8>) -> Result<Self, ConfigError> {
        let display = path.display().to_string();
        let running = serde_yaml_ng::from_slice(&text)
            .map_err(|e| ConfigError::Parse { path: display, message: e.to_string() })?;
        let sha256 = sha256_hex(&text);
        Ok(Self { path, seen: text, running, sha256 })
    }

    /// The running file's SHA-256, lowercase hex.
    pub fn sha256(&self) -> &str {
        &self.sha256
    }
}

fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// Watches the file until `stop` turns true: every [`POLL`], and at once at SIGHUP.
pub async fn run(live: Arc<Live>, mut watched: Watched, mut stop: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(POLL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    #[cfg(unix)]
    let mut hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).ok();
    loop {
        #[cfg(unix)]
        let hangup = async {
            match hup.as_mut() {
                Some(h) => {
                    h.recv().await;
                }
                None => std::future::pending::<()>().await,
            }
        };
        #[cfg(not(unix))]
        let hangup = std::future::pending::<()>();
        let forced = tokio::select! {
            _ = tick.tick() => false,
            () = hangup => true,
            _ = stop.wait_for(|stopping| *stopping) => return,
        };
        check(&live, &mut watched, forced).await;
    }
}

/// Reads the file; when it changed (or `forced`), tries to apply it.
async fn check(live: &Live, watched: &mut Watched, forced: bool) {
    let path = watched.path.clone();
    let read = tokio::task::spawn_blocking(move || std::fs::read(path)).await;
    let text = match read.unwrap_or_else(|e| Err(std::io::Error::other(e))) {
        Ok(t) => t,
        Err(e) => {
            if forced {
                error!(path = %watched.path.display(), error = %e, "config reload: cannot read the file");
            }
            return;
        }
    };
    if text == watched.seen && !forced {
        return;
    }
    watched.seen.clone_from(&text);
    let current = live.current();
    match next_generation(&current, watched, &text).await {
        Ok(None) => {
            // The same config written otherwise: it is the file serving now.
            let sha256 = sha256_hex(&text);
            current.metrics.config_serving(Some(&watched.sha256), &sha256, live.generation());
            info!(path = %watched.path.display(), %sha256, "config reload: nothing changed");
            watched.sha256 = sha256;
        }
        Ok(Some((next, changed))) => {
            let sha256 = sha256_hex(&text);
            let generation = live.swap(Arc::new(next));
            current.metrics.config_serving(Some(&watched.sha256), &sha256, generation);
            current.metrics.config_reloads.get_or_create(&ReloadResult { result: "applied" }).inc();
            info!(path = %watched.path.display(), generation, changed = ?changed, %sha256, "config reload: applied");
            watched.sha256 = sha256;
        }
        Err(e) => {
            current.metrics.config_reloads.get_or_create(&ReloadResult { result: "refused" }).inc();
            error!(path = %watched.path.display(), error = %e, "config reload: refused, the running config is kept");
        }
    }
}

/// The generation `text` makes of `current`, with the sections it changed; None when it changes
/// none. Updates `watched.running` only when it returns a generation.
async fn next_generation(
    current: &Shared,
    watched: &mut Watched,
    text: &[u8],
) -> Result<Option<(Shared, Vec<String>)>, ConfigError> {
    let path = watched.path.display().to_string();
    let text = std::str::from_utf8(text)
        .map_err(|e| ConfigError::Parse { path: path.clone(), message: format!("not UTF-8: {e}") })?;
    let mut candidate = Candidate::parse(text, &path)?;
    let changed = candidate.changes(&watched.running)?;
    if changed.is_empty() {
        return Ok(None);
    }
    candidate.config.read_secrets()?;
    let touched = |names: &[&str]| names.iter().any(|n| changed.contains(*n));
    let config = candidate.config;
    let context = if touched(&["models", "context"]) {
        build_context(&config).await?
    } else {
        Arc::clone(&current.context)
    };
    let pools = if touched(&["pools", "flow_control"]) {
        let store = current.limiter.store().clone();
        let pools = Pools::new(
            &config.pools,
            config.flow_control.as_ref(),
            Arc::clone(&current.metrics),
            Some(store),
        );
        pools.spawn_scrapers();
        pools
    } else {
        Arc::clone(&current.pools)
    };
    if touched(&["tenants", "prices"]) {
        let store = current.limiter.store();
        store.set_quotas(QuotaBook::new(&config, store.quotas().clock.clone()));
    }
    let recorder = current.recorder.with_tenants(config.tenants.iter().map(|t| t.id.clone()));
    watched.running = candidate.sections;
    let next = current.next(config, recorder, pools, context);
    Ok(Some((next, changed.into_iter().collect())))
}

/// The context checker of `config`, its tokenizers loaded off the runtime's threads.
async fn build_context(config: &Config) -> Result<Arc<ContextChecker>, ConfigError> {
    let models = config.models.clone();
    let per_tenant = config.context.max_counts_per_tenant;
    let built =
        tokio::task::spawn_blocking(move || ContextChecker::from_config(&models)).await.map_err(|e| {
            crate::config::error::invalid("models", format!("loading the tokenizers failed: {e}"))
        })??;
    Ok(Arc::new(built.with_counts_per_tenant(per_tenant)))
}
