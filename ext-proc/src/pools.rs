//! The pools' live state for shedding: a scraper task per pool reads each endpoint's vLLM
//! `/metrics` every `scrape_interval_ms`, and admission counts the requests it lets in. The
//! arithmetic is in [`crate::shedding`].

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tracing::debug;

use crate::config::PoolConfig;
use crate::metrics::{Metrics, PoolLabel};
use crate::shedding::{self, PoolSignals, Scrape};

/// Smoothing of the drain rate (weight of the newest sample).
const DRAIN_ALPHA: f64 = 0.3;

#[derive(Debug, Default)]
struct PoolState {
    signals: PoolSignals,
    /// Admitted minus finished. Requests admitted from the filter's leases are reported in
    /// batches and may finish before they are reported, so this can dip below 0 for a while;
    /// `signals.in_flight` is its positive part.
    balance: i64,
    last_finished: Option<(Instant, f64)>,
}

struct Pool {
    config: PoolConfig,
    state: Mutex<PoolState>,
}

/// A shed decision.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Shed {
    /// The pool's load ratio.
    pub load: f64,
    /// `Retry-After` in whole seconds.
    pub retry_after_secs: u64,
}

/// Every configured pool.
pub struct Pools {
    pools: HashMap<String, Pool>,
    metrics: Arc<Metrics>,
}

impl Pools {
    /// The pools of the config; nothing runs until [`Pools::spawn_scrapers`].
    pub fn new(configs: &[PoolConfig], metrics: Arc<Metrics>) -> Arc<Self> {
        let pools = configs
            .iter()
            .map(|c| (c.name.clone(), Pool { config: c.clone(), state: Mutex::new(PoolState::default()) }))
            .collect();
        Arc::new(Self { pools, metrics })
    }

    /// Whether a request of a tier with shedding level `level` is shed from `pool` now.
    pub fn check(&self, pool: &str, level: f64) -> Option<Shed> {
        let p = self.pools.get(pool)?;
        let signals = p.state.lock().ok()?.signals;
        let load = shedding::load(&p.config, &signals);
        shedding::should_shed(load, level)
            .then(|| Shed { load, retry_after_secs: shedding::retry_after_secs(&p.config, &signals, level) })
    }

    /// Counts a request admitted to `pool`.
    pub fn admitted(&self, pool: &str) {
        self.adjust(pool, 1);
    }

    /// Counts `n` requests admitted to `pool` (from a lease, reported afterwards).
    pub fn admitted_many(&self, pool: &str, n: u64) {
        self.adjust(pool, i64::try_from(n).unwrap_or(i64::MAX));
    }

    /// Counts a request to `pool` finished.
    pub fn finished(&self, pool: &str) {
        self.adjust(pool, -1);
    }

    fn adjust(&self, pool: &str, delta: i64) {
        let Some(p) = self.pools.get(pool) else { return };
        if let Ok(mut s) = p.state.lock() {
            s.balance = s.balance.saturating_add(delta);
            s.signals.in_flight = u64::try_from(s.balance).unwrap_or(0);
            self.metrics
                .in_flight
                .get_or_create(&PoolLabel { pool: pool.to_owned() })
                .set(i64::try_from(s.signals.in_flight).unwrap_or(i64::MAX));
        }
    }

    /// Starts one scraper task per pool that has endpoints.
    pub fn spawn_scrapers(self: &Arc<Self>) {
        let client: Client<_, Empty<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
        for (name, pool) in &self.pools {
            if pool.config.endpoints.is_empty() {
                continue;
            }
            let pools = Arc::clone(self);
            let name = name.clone();
            let client = client.clone();
            let interval = Duration::from_millis(pool.config.scrape_interval_ms);
            tokio::spawn(async move {
                let mut ticker = tokio::time::interval(interval);
                ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    ticker.tick().await;
                    pools.scrape(&name, &client, interval.min(Duration::from_secs(1))).await;
                }
            });
        }
    }

    async fn scrape(
        &self,
        name: &str,
        client: &Client<hyper_util::client::legacy::connect::HttpConnector, Empty<Bytes>>,
        timeout: Duration,
    ) {
        let Some(pool) = self.pools.get(name) else { return };
        let mut total = Scrape::default();
        let mut complete = true;
        for endpoint in &pool.config.endpoints {
            match fetch(client, &format!("{}/metrics", endpoint.trim_end_matches('/')), timeout).await {
                Some(text) => {
                    let s = shedding::parse_vllm_metrics(&text);
                    total.waiting += s.waiting;
                    total.running += s.running;
                    total.kv_cache_usage = total.kv_cache_usage.max(s.kv_cache_usage);
                    total.finished += s.finished;
                }
                None => complete = false,
            }
        }
        let now = Instant::now();
        let Ok(mut state) = pool.state.lock() else { return };
        if !complete {
            // An endpoint did not answer: its queue is unknown, so the pool's is too.
            state.signals.waiting = None;
            state.signals.running = None;
            state.signals.kv_cache_usage = None;
            state.last_finished = None;
            return;
        }
        if let Some((at, finished)) = state.last_finished {
            let secs = now.saturating_duration_since(at).as_secs_f64();
            if secs > 0.0 && total.finished >= finished {
                let sample = (total.finished - finished) / secs;
                state.signals.drain_per_s =
                    Some(shedding::smooth_rate(state.signals.drain_per_s, sample, DRAIN_ALPHA));
            }
        }
        state.last_finished = Some((now, total.finished));
        state.signals.waiting = Some(total.waiting);
        state.signals.running = Some(total.running);
        state.signals.kv_cache_usage = Some(total.kv_cache_usage);
        let label = PoolLabel { pool: name.to_owned() };
        self.metrics.pool_waiting.get_or_create(&label).set(total.waiting);
        self.metrics.pool_kv_cache.get_or_create(&label).set(total.kv_cache_usage);
        self.metrics.pool_load.get_or_create(&label).set(shedding::load(&pool.config, &state.signals));
    }
}

async fn fetch(
    client: &Client<hyper_util::client::legacy::connect::HttpConnector, Empty<Bytes>>,
    url: &str,
    timeout: Duration,
) -> Option<String> {
    let uri: hyper::Uri = url.parse().ok()?;
    let work = async {
        let response = client.get(uri).await.ok()?;
        if !response.status().is_success() {
            return None;
        }
        let body = response.into_body().collect().await.ok()?.to_bytes();
        String::from_utf8(body.to_vec()).ok()
    };
    match tokio::time::timeout(timeout, work).await {
        Ok(text) => text,
        Err(_) => {
            debug!(url, "scrape timed out");
            None
        }
    }
}
