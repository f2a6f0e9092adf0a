//! The pools' live state for shedding and endpoint picking: a task per pool reads each
//! endpoint's vLLM `/metrics` every `scrape_interval_ms` and flushes this replica's in-flight
//! counts to Redis; admission counts the requests it lets in, the access log (or metering stream)
//! the ones that end. The arithmetic is in [`crate::admission::shedding`]. A pool with `picker` also keeps
//! each endpoint's own scrape (waiting, running, KV use, when, whether it answered), in-flight
//! picks and served prefixes in a [`PoolPicker`] ([`crate::scheduling`]), which [`Pools::pick`]
//! asks.
//!
//! The in-flight count holds across sidecar replicas although a request's admission and its end
//! may reach different replicas: each replica counts what it sees (admitted +1 where admitted,
//! -1 where the end arrives) and, every scrape interval, writes its cumulative counts to the
//! pool's hash in Redis with one script call that returns the sum over replicas
//! (`lua/in_flight_flush_v1.lua`; no Redis call per request). Its count is that sum plus what it
//! counted since, and corrects itself against vLLM's metrics ([`crate::pools::signals::in_flight_bound`]):
//! requests that never end (an Envoy killed) are taken off. Without Redis for longer than the
//! report lag, a replica falls back to its own balance.

pub mod flow;
pub mod room;
pub mod scrape;
pub mod signals;

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tracing::{debug, info};

use crate::admission::shedding;
use crate::admission::{admission_lease, lease_headroom};
use crate::config::pools::{endpoint_addr, FlowControlConfig, PoolConfig};
use crate::flow_control::PoolFlow;
use crate::metrics::labels::{EndpointLabel, PoolBlocks, PoolEndpoint, PoolLabel, PoolReason, PoolTerm};
use crate::metrics::Metrics;
use crate::scheduling::picker::{Pick, PoolPicker};
use crate::store::{InFlightFlush, InFlightTotal, Store};
use room::SinceScrape;
use signals::{PoolSignals, Scrape};

/// Smoothing of the drain rate (weight of the newest sample).
const DRAIN_ALPHA: f64 = 0.3;

/// One replica's in-flight counts of a pool and what Redis last said of the pool (no I/O).
#[derive(Debug, Default)]
pub struct InFlight {
    /// Admitted minus finished requests this replica has seen since it started. Requests
    /// admitted from the filter's leases are reported in batches and may finish before they are
    /// reported, so a balance (and the total) can dip below 0 for a while.
    balance: i64,
    /// Requests this replica admitted since it started.
    admitted: u64,
    /// `(balance, admitted)` as of the last flush Redis acknowledged.
    flushed: (i64, u64),
    /// The pool-wide total at that flush, and when.
    total: Option<(i64, Instant)>,
    /// The pool-wide admitted sum at that flush.
    pool_admitted: Option<u64>,
    /// Pool-wide admitted sums, one per acknowledged flush.
    admitted_samples: VecDeque<(Instant, f64)>,
    /// The bound the count was last clamped to (None: no fresh metrics).
    bound: Option<u64>,
    /// The sidecar replicas that flushed the pool's counts within the report lag, at the last
    /// flush (None: never flushed).
    replicas: Option<u64>,
}

impl InFlight {
    /// Counts `delta` requests (+ admitted, - finished), `admitted` of them admissions.
    pub fn count(&mut self, delta: i64, admitted: u64) {
        self.balance = self.balance.saturating_add(delta);
        self.admitted = self.admitted.saturating_add(admitted);
    }

    /// What to flush now, with the bound from the pool's metrics when they are `fresh`:
    /// `(running, waiting, finished_in_lag)` scraped.
    pub fn to_flush(&self, fresh: Option<(f64, f64, f64)>, now: Instant, lag: Duration) -> InFlightFlush {
        let admitted_in_lag = signals::growth(&self.admitted_samples, now, signals::arrival_lag(lag));
        let bound = match (fresh, self.pool_admitted) {
            (Some((running, waiting, finished)), Some(seen)) => {
                Some((signals::in_flight_bound(running, waiting, finished, admitted_in_lag), seen))
            }
            // Before the first flush the admissions within the lag are unknown: no bound.
            _ => None,
        };
        InFlightFlush { balance: self.balance, admitted: self.admitted, bound, live_within: lag }
    }

    /// The sidecar replicas sharing the pool at the last flush: 1 before any (or without Redis).
    pub fn replicas(&self) -> u64 {
        self.replicas.unwrap_or(1).max(1)
    }

    /// Redis acknowledged `sent` with `reply` at `now`.
    pub fn flushed(&mut self, sent: &InFlightFlush, reply: &InFlightTotal, now: Instant, lag: Duration) {
        self.flushed = (sent.balance, sent.admitted);
        self.total = Some((reply.total, now));
        self.bound =
            sent.bound.map(|(bound, seen)| bound.saturating_add(reply.admitted.saturating_sub(seen)));
        self.pool_admitted = Some(reply.admitted);
        self.replicas = Some(reply.replicas);
        self.admitted_samples.push_back((now, reply.admitted as f64));
        // Keep one sample older than the arrival lag (the start of the window).
        let arrival = signals::arrival_lag(lag);
        while self.admitted_samples.len() > 2
            && self
                .admitted_samples
                .get(1)
                .is_some_and(|(at, _)| now.saturating_duration_since(*at) > arrival)
        {
            self.admitted_samples.pop_front();
        }
    }

    /// The metrics went stale: no bound until they are fresh again.
    pub fn unbounded(&mut self) {
        self.bound = None;
    }

    /// The count shedding uses at `now` ([`crate::pools::signals::in_flight_view`]): the pool-wide total
    /// while the last acknowledged flush is within `lag`, else this replica's own balance.
    pub fn view(&self, now: Instant, lag: Duration) -> u64 {
        let total = self.total.filter(|(_, at)| now.saturating_duration_since(*at) <= lag).map(|(t, _)| t);
        let unflushed = self.balance.saturating_sub(self.flushed.0);
        let unflushed_admitted = self.admitted.saturating_sub(self.flushed.1);
        let bound = if total.is_some() { self.bound } else { None };
        signals::in_flight_view(total, unflushed, self.balance, bound, unflushed_admitted)
    }
}

#[derive(Debug, Default)]
struct PoolState {
    signals: PoolSignals,
    in_flight: InFlight,
    last_finished: Option<(Instant, f64)>,
    /// `vllm:request_success_total` summed over the endpoints, per complete scrape.
    finished_samples: VecDeque<(Instant, f64)>,
    /// When the last complete scrape ended.
    scraped_at: Option<Instant>,
    /// This sidecar's admissions and the ends it saw since the last complete scrape (the room
    /// rule's estimate of vLLM's queue, [`room::has_room`]).
    since_scrape: SinceScrape,
    /// What this replica's admission leases of the pool may still admit ([`Pools::hold_lease`]).
    leased: lease_headroom::LeasedRequests,
}

impl PoolState {
    /// The pool's signals with the requests this replica's admission leases of it may still
    /// admit counted in flight: a leased slot is taken when it is granted
    /// ([`crate::admission::lease_headroom`]).
    fn signals_with_leases(&mut self) -> PoolSignals {
        let leased = self.leased.outstanding(Instant::now());
        PoolSignals { in_flight: self.signals.in_flight.saturating_add(leased), ..self.signals }
    }
}

pub(crate) struct Pool {
    config: PoolConfig,
    state: Mutex<PoolState>,
    /// The endpoint picker, for a pool with `picker`.
    picker: Option<Mutex<PoolPicker>>,
    /// The flow-control queue, for a pool with `flow_control` ([`crate::flow_control`]).
    pub(crate) flow: Option<PoolFlow>,
    /// Per endpoint (the config's order): true while it is scraped at `/metrics` because it
    /// answered [`signals::FILTERED_METRICS_PATH`] without vLLM's gauges ([`scrape::fetch_metrics`]).
    unfiltered: Vec<AtomicBool>,
}

impl Pool {
    /// Whether the pool has room for one more request of a tier that may fill it up to `level`
    /// ([`room::has_room`]). The requests this replica's admission leases of the pool may still
    /// admit count as in flight ([`PoolState::signals_with_leases`]).
    pub(crate) fn has_room(&self, level: f64) -> bool {
        self.state.lock().map_or(true, |mut s| {
            room::has_room(&self.config, &s.signals_with_leases(), s.since_scrape, level)
        })
    }

    /// [`Pool::has_room`] with `extra` more requests allowed in flight than `max_in_flight`
    /// ([`room::has_room_beyond`]).
    pub(crate) fn has_room_beyond(&self, level: f64, extra: u64) -> bool {
        self.state.lock().map_or(true, |mut s| {
            room::has_room_beyond(&self.config, &s.signals_with_leases(), s.since_scrape, level, extra)
        })
    }

    /// The pool's signals now.
    /// Feeds the pool's picker a scrape of endpoint `index` (tests).
    #[cfg(test)]
    pub(crate) fn picker_scraped(&self, index: usize, scrape: Option<Scrape>, now: Instant) {
        if let Some(Ok(mut p)) = self.picker.as_ref().map(|p| p.lock()) {
            p.scraped(index, scrape, now);
        }
    }

    #[cfg(test)]
    pub(crate) fn signals(&self) -> PoolSignals {
        self.state.lock().map(|s| s.signals).unwrap_or_default()
    }

    /// The pool's load ratio ([`shedding::load`]).
    pub(crate) fn load(&self) -> f64 {
        self.state.lock().map_or(0.0, |s| shedding::load(&self.config, &s.signals))
    }
}

/// What [`Pools::pick`] answers for an admitted request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PickOutcome {
    /// The pool has no `picker` (or is not configured): Envoy's `LEAST_REQUEST` chooses.
    NotPicking,
    /// No endpoint (of the subset, when one was given) is eligible.
    NoneEligible,
    /// The pick, then its fallbacks.
    Picked(Pick),
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
    pub(crate) metrics: Arc<Metrics>,
    /// Where the replicas' in-flight counts meet (None: each replica counts alone).
    store: Option<Store>,
    /// This process's id among the replicas (random per process).
    replica: String,
}

impl Pools {
    /// The pools of the config; nothing runs until [`Pools::spawn_scrapers`]. With a `store`,
    /// in-flight counts are summed over the replicas sharing it. A pool with `flow_control` gets
    /// a queue with the tiers and weights of `flow` (validated at load: present whenever a pool
    /// has `flow_control`).
    pub fn new(
        configs: &[PoolConfig],
        flow: Option<&FlowControlConfig>,
        metrics: Arc<Metrics>,
        store: Option<Store>,
    ) -> Arc<Self> {
        let pools = configs
            .iter()
            .map(|c| {
                let picker = c.picker.map(|p| {
                    // Validated at load: every endpoint of a picking pool is http://ip:port.
                    let addrs: Vec<_> = c.endpoints.iter().filter_map(|u| endpoint_addr(u)).collect();
                    let mut picker = PoolPicker::new(p, &addrs, c.scrape_interval_ms);
                    // A queue holds what passes `max_in_flight`: it dispatches by the slots.
                    if let (Some(max), Some(_), Some(_)) = (c.max_in_flight, c.flow_control, flow) {
                        picker.set_slots(max);
                    }
                    Mutex::new(picker)
                });
                let flow = c.flow_control.zip(flow).map(|(pool, flow)| PoolFlow::new(pool, flow));
                (
                    c.name.clone(),
                    Pool {
                        config: c.clone(),
                        state: Mutex::new(PoolState::default()),
                        picker,
                        flow,
                        unfiltered: c.endpoints.iter().map(|_| AtomicBool::new(false)).collect(),
                    },
                )
            })
            .collect();
        let replica = format!(
            "{:016x}",
            RandomState::new().hash_one((std::process::id(), std::time::SystemTime::now()))
        );
        Arc::new(Self { pools, metrics, store, replica })
    }

    pub(crate) fn pool(&self, name: &str) -> Option<&Pool> {
        self.pools.get(name)
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (&String, &Pool)> {
        self.pools.iter()
    }

    /// Whether a request of a tier with shedding level `level` is shed from `pool` now; the
    /// requests this replica's admission leases of the pool may still admit count as in flight
    /// ([`Pools::hold_lease`]).
    pub fn check(&self, pool: &str, level: f64) -> Option<Shed> {
        let p = self.pools.get(pool)?;
        let signals = p.state.lock().ok()?.signals_with_leases();
        let load = shedding::load(&p.config, &signals);
        shedding::should_shed(load, level)
            .then(|| Shed { load, retry_after_secs: shedding::retry_after_secs(&p.config, &signals, level) })
    }

    /// Caps one more admission lease of `pool` (of `tenant`'s `model`) under the pool's lock: at
    /// half of what this replica's part of the headroom before `level` leaves beside its live
    /// leases of the pool ([`lease_headroom::headroom`], [`lease_headroom::replica_share`],
    /// [`lease_headroom::lease_share`], [`admission_lease::cap_requests`]). Its requests then
    /// count among the pool's leases until `until` (or until [`Pools::lease_used`] takes them
    /// off). `None`, for no lease, when nothing is left, for a pool not configured, and while no
    /// limit of the pool bounds its headroom (its signals unknown: then its requests are decided
    /// one by one).
    pub fn hold_lease(
        &self,
        pool: &str,
        level: f64,
        (tenant, model): (&str, &str),
        until: Instant,
        size: admission_lease::LeaseSize,
    ) -> Option<admission_lease::LeaseSize> {
        let p = self.pools.get(pool)?;
        let mut s = p.state.lock().ok()?;
        let leased = s.leased.outstanding(Instant::now());
        let room = lease_headroom::headroom(&p.config, &s.signals, s.since_scrape, level)?;
        let free = lease_headroom::replica_share(room, s.in_flight.replicas()).saturating_sub(leased);
        let size = admission_lease::cap_requests(size, lease_headroom::lease_share(free))?;
        s.leased.granted(tenant, model, size.requests, until);
        Some(size)
    }

    /// `requests` requests of `tenant`'s `model` admitted from (and reported), or given back to,
    /// this replica's leases of `pool` ([`Pools::hold_lease`]).
    pub fn lease_used(&self, pool: &str, tenant: &str, model: &str, requests: u64) {
        let Some(p) = self.pools.get(pool) else { return };
        if let Ok(mut s) = p.state.lock() {
            s.leased.used(tenant, model, requests);
        }
    }

    /// Picks the endpoint of `pool` for an admitted request whose prompt hashes to `hashes`,
    /// among `subset` when the request carries a subset hint, and counts it in the picker's
    /// metrics.
    pub fn pick(
        &self,
        pool: &str,
        hashes: &[u64],
        subset: Option<&[std::net::SocketAddr]>,
        request_id: &str,
    ) -> PickOutcome {
        let Some(picker) = self.pools.get(pool).and_then(|p| p.picker.as_ref()) else {
            return PickOutcome::NotPicking;
        };
        let started = Instant::now();
        let (pick, in_flight) = match picker.lock() {
            Ok(mut p) => {
                let pick = p.pick(hashes, subset, started, request_id);
                let in_flight = pick.as_ref().and_then(|pick| p.in_flight(pick.primary()));
                (pick, in_flight)
            }
            Err(_) => (None, None),
        };
        let label = PoolLabel { pool: pool.to_owned() };
        self.metrics.pick_duration.get_or_create(&label).observe(started.elapsed().as_secs_f64());
        match pick {
            Some(pick) => {
                let by = match (pick.predicted, pick.affinity) {
                    _ if pick.slot => "slot",
                    _ if pick.home => "home",
                    (true, true) => "predicted_affinity",
                    (true, false) => "predicted",
                    (false, true) => "affinity",
                    (false, false) => "score",
                };
                let labels = PoolEndpoint { pool: pool.to_owned(), endpoint: pick.primary().to_owned(), by };
                self.metrics.picks.get_or_create(&labels).inc();
                if let Some(n) = in_flight {
                    self.set_in_flight(pool, pick.primary(), n);
                }
                for (kind, n) in [("requested", pick.request_blocks), ("hit", pick.prefix_blocks)] {
                    let labels = PoolBlocks { pool: pool.to_owned(), kind };
                    self.metrics.pick_prefix_blocks.get_or_create(&labels).inc_by(n as u64);
                }
                PickOutcome::Picked(pick)
            }
            None => {
                let reason = if subset.is_some() { "subset_none_eligible" } else { "none_eligible" };
                self.metrics.no_pick.get_or_create(&PoolReason { pool: pool.to_owned(), reason }).inc();
                PickOutcome::NoneEligible
            }
        }
    }

    /// A request picked for `endpoint` (`ip:port`) of `pool` ended; `observed`: what its end
    /// measured (TTFT, prompt tokens), for the pool's TTFT model and bytes per token.
    pub fn pick_finished(
        &self,
        pool: &str,
        endpoint: &str,
        observed: Option<crate::scheduling::picker::Observed<'_>>,
    ) {
        let Some(Ok(mut p)) = self.pools.get(pool).and_then(|p| p.picker.as_ref()).map(|p| p.lock()) else {
            return;
        };
        let in_flight = p.finished(endpoint, observed);
        let model = observed
            .is_some()
            .then(|| (p.ttft_model().coefficients(), p.ttft_model().samples(), p.bytes_per_token()));
        drop(p);
        if let Some(n) = in_flight {
            self.set_in_flight(pool, endpoint, n);
        }
        if let Some(((a, b, c), samples, bytes_per_token)) = model {
            for (term, v) in [
                ("floor_seconds", a),
                ("per_request_ahead_seconds", b),
                ("per_uncached_kib_seconds", c),
                ("samples", samples as f64),
                ("prompt_bytes_per_token", bytes_per_token),
            ] {
                self.metrics.pick_ttft_model.get_or_create(&PoolTerm { pool: pool.to_owned(), term }).set(v);
            }
        }
    }

    fn set_in_flight(&self, pool: &str, endpoint: &str, n: u64) {
        let labels = EndpointLabel { pool: pool.to_owned(), endpoint: endpoint.to_owned() };
        self.metrics.pick_in_flight.get_or_create(&labels).set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    /// Counts a request admitted to `pool`.
    pub fn admitted(&self, pool: &str) {
        self.adjust(pool, 1, 1);
    }

    /// Counts `n` requests admitted to `pool` (from a lease, reported afterwards).
    pub fn admitted_many(&self, pool: &str, n: u64) {
        self.adjust(pool, i64::try_from(n).unwrap_or(i64::MAX), n);
    }

    /// Counts a request to `pool` finished (whichever replica admitted it), and dispatches what
    /// its queue holds while there is room.
    pub fn finished(&self, pool: &str) {
        self.adjust(pool, -1, 0);
        if let Some(flow) = self.pools.get(pool).and_then(|p| p.flow.as_ref()) {
            flow.finished(Instant::now());
        }
        self.pump(pool);
    }

    /// Counts `delta` requests in flight, `admitted` of them admissions (never dispatches: the
    /// queue's lock may be held).
    pub(crate) fn adjust(&self, pool: &str, delta: i64, admitted: u64) {
        let Some(p) = self.pools.get(pool) else { return };
        if let Ok(mut s) = p.state.lock() {
            s.in_flight.count(delta, admitted);
            if delta < 0 {
                s.since_scrape.finished = s.since_scrape.finished.saturating_add(delta.unsigned_abs());
            } else {
                s.since_scrape.dispatched = s.since_scrape.dispatched.saturating_add(delta.unsigned_abs());
            }
            self.publish(pool, &p.config, &mut s, Instant::now());
        }
    }

    /// Sets the pool's in-flight signal and gauge from its counts.
    fn publish(&self, pool: &str, config: &PoolConfig, s: &mut PoolState, now: Instant) {
        s.signals.in_flight = s.in_flight.view(now, lag(config));
        self.metrics
            .in_flight
            .get_or_create(&PoolLabel { pool: pool.to_owned() })
            .set(i64::try_from(s.signals.in_flight).unwrap_or(i64::MAX));
    }

    /// Starts one task per pool: every `scrape_interval_ms` it scrapes the pool's endpoints (if
    /// any) and flushes this replica's in-flight counts (with a store), until these pools are
    /// dropped.
    pub fn spawn_scrapers(self: &Arc<Self>) {
        let client: scrape::MetricsClient = Client::builder(TokioExecutor::new()).build_http();
        for (name, pool) in &self.pools {
            if pool.config.endpoints.is_empty() && self.store.is_none() {
                continue;
            }
            // A config reload that changes the pools retires these: the task ends once the
            // last request of the old generation is done with them.
            let weak = Arc::downgrade(self);
            let name = name.clone();
            let client = client.clone();
            let interval = Duration::from_millis(pool.config.scrape_interval_ms);
            let scraped = !pool.config.endpoints.is_empty();
            tokio::spawn(async move {
                let mut ticker = tokio::time::interval(interval);
                ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    ticker.tick().await;
                    let Some(pools) = weak.upgrade() else { break };
                    if scraped {
                        pools.scrape(&name, &client, interval.min(Duration::from_secs(1))).await;
                    }
                    pools.flush(&name).await;
                }
            });
        }
    }

    /// Flushes this replica's in-flight counts of a pool and takes the pool-wide total.
    async fn flush(&self, name: &str) {
        let (Some(store), Some(pool)) = (&self.store, self.pools.get(name)) else { return };
        let lag = lag(&pool.config);
        let interval = Duration::from_millis(pool.config.scrape_interval_ms);
        let sent = {
            let Ok(mut s) = pool.state.lock() else { return };
            let now = Instant::now();
            // Metrics are fresh when the last scrape was complete and at most 3 intervals old.
            let fresh = match (s.scraped_at, s.signals.running, s.signals.waiting) {
                (Some(at), Some(running), Some(waiting))
                    if now.saturating_duration_since(at) <= interval * 3 =>
                {
                    Some((running, waiting, signals::growth(&s.finished_samples, now, lag)))
                }
                _ => None,
            };
            if fresh.is_none() {
                s.in_flight.unbounded();
            }
            s.in_flight.to_flush(fresh, now, lag)
        };
        let result =
            self.metrics.timed_redis("in_flight", store.flush_in_flight(name, &self.replica, &sent)).await;
        let Ok(mut s) = pool.state.lock() else { return };
        let now = Instant::now();
        match result {
            Ok(reply) => {
                s.in_flight.flushed(&sent, &reply, now, lag);
                self.metrics
                    .pool_sidecar_replicas
                    .get_or_create(&PoolLabel { pool: name.to_owned() })
                    .set(i64::try_from(reply.replicas).unwrap_or(i64::MAX));
                if reply.correction != 0 {
                    info!(
                        pool = name,
                        correction = reply.correction,
                        total = reply.total,
                        "in-flight count corrected to vLLM's bound"
                    );
                    self.metrics
                        .in_flight_corrections
                        .get_or_create(&PoolLabel { pool: name.to_owned() })
                        .inc_by(reply.correction.unsigned_abs());
                }
            }
            Err(e) => debug!(pool = name, error = %e, "in-flight flush failed"),
        }
        self.publish(name, &pool.config, &mut s, now);
        drop(s);
        self.pump(name);
    }

    /// `llm_gateway_endpoint_scrape_ok`, `llm_gateway_endpoint_scrape_filtered` and
    /// `llm_gateway_endpoint_last_scrape_timestamp_seconds` of one endpoint's scrape (`filtered`:
    /// answered at [`signals::FILTERED_METRICS_PATH`]).
    fn count_scrape(&self, pool: &str, endpoint: &str, ok: bool, filtered: bool) {
        let endpoint =
            endpoint.trim_start_matches("http://").trim_start_matches("https://").trim_end_matches('/');
        let label =
            EndpointLabel { pool: self.metrics.bounded(pool), endpoint: self.metrics.bounded(endpoint) };
        self.metrics.endpoint_scrape_ok.get_or_create(&label).set(i64::from(ok));
        if ok {
            self.metrics.endpoint_scrape_filtered.get_or_create(&label).set(i64::from(filtered));
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64());
            self.metrics.endpoint_last_scrape.get_or_create(&label).set(now);
        }
    }

    async fn scrape(&self, name: &str, client: &scrape::MetricsClient, timeout: Duration) {
        let Some(pool) = self.pools.get(name) else { return };
        let mut total = Scrape::default();
        let mut complete = true;
        for (index, endpoint) in pool.config.endpoints.iter().enumerate() {
            let answer = scrape::fetch_metrics(client, endpoint, pool.unfiltered.get(index), timeout).await;
            let filtered = answer.as_ref().is_some_and(|(_, filtered)| *filtered);
            let scrape = answer.map(|(text, _)| signals::parse_vllm_metrics(&text));
            if let Some(Ok(mut picker)) = pool.picker.as_ref().map(|p| p.lock()) {
                picker.scraped(index, scrape, Instant::now());
            }
            self.count_scrape(name, endpoint, scrape.is_some(), filtered);
            match scrape {
                Some(s) => {
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
            state.finished_samples.clear();
            state.scraped_at = None;
            return;
        }
        state.scraped_at = Some(now);
        state.since_scrape = SinceScrape::default();
        state.finished_samples.push_back((now, total.finished));
        let lag = lag(&pool.config);
        while state.finished_samples.len() > 2
            && state.finished_samples.get(1).is_some_and(|(at, _)| now.saturating_duration_since(*at) > lag)
        {
            state.finished_samples.pop_front();
        }
        if let Some((at, finished)) = state.last_finished {
            let secs = now.saturating_duration_since(at).as_secs_f64();
            if secs > 0.0 && total.finished >= finished {
                let sample = (total.finished - finished) / secs;
                state.signals.drain_per_s =
                    Some(signals::smooth_rate(state.signals.drain_per_s, sample, DRAIN_ALPHA));
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
        drop(state);
        self.pump(name);
    }
}

/// The pool's [`shedding::report_lag`].
fn lag(config: &PoolConfig) -> Duration {
    signals::report_lag(Duration::from_millis(config.scrape_interval_ms))
}

#[cfg(test)]
mod tests {
    use super::*;

    const LAG: Duration = Duration::from_secs(5);

    /// What `lua/in_flight_flush_v1.lua` answers for replicas' cumulative balances and admitted
    /// counts (no correction).
    fn redis_sum(replicas: &[&InFlightFlush]) -> InFlightTotal {
        InFlightTotal {
            total: replicas.iter().map(|r| r.balance).sum(),
            admitted: replicas.iter().map(|r| r.admitted).sum(),
            correction: 0,
            replicas: replicas.len() as u64,
        }
    }

    #[test]
    fn admissions_and_ends_seen_by_different_replicas_sum_to_zero() {
        let t0 = Instant::now();
        let (mut a, mut b) = (InFlight::default(), InFlight::default());
        // Ten requests admitted through A, each ending on B.
        for _ in 0..10 {
            a.count(1, 1);
            b.count(-1, 0);
        }
        // Before any flush each replica has only its own count (today's per-process balance).
        assert_eq!(a.view(t0, LAG), 10);
        assert_eq!(b.view(t0, LAG), 0);
        assert_eq!(a.replicas(), 1, "before a flush: alone");
        let (fa, fb) = (a.to_flush(None, t0, LAG), b.to_flush(None, t0, LAG));
        assert_eq!(fa.live_within, LAG, "replicas that flushed within the lag are counted");
        let sum = redis_sum(&[&fa, &fb]);
        a.flushed(&fa, &sum, t0, LAG);
        b.flushed(&fb, &sum, t0, LAG);
        assert_eq!((a.view(t0, LAG), b.view(t0, LAG)), (0, 0));
        assert_eq!((a.replicas(), b.replicas()), (2, 2));
        // A new admission on A counts at once on A, and on B after both flush again.
        a.count(1, 1);
        assert_eq!((a.view(t0, LAG), b.view(t0, LAG)), (1, 0));
        let t1 = t0 + Duration::from_millis(500);
        let (fa, fb) = (a.to_flush(None, t1, LAG), b.to_flush(None, t1, LAG));
        let sum = redis_sum(&[&fa, &fb]);
        a.flushed(&fa, &sum, t1, LAG);
        b.flushed(&fb, &sum, t1, LAG);
        assert_eq!((a.view(t1, LAG), b.view(t1, LAG)), (1, 1));
        // A flush that is retried sends the same cumulative counts: nothing counted twice.
        assert_eq!(a.to_flush(None, t1, LAG), fa);
    }

    #[test]
    fn without_redis_for_longer_than_the_lag_a_replica_counts_alone() {
        let t0 = Instant::now();
        let mut a = InFlight::default();
        a.count(3, 3);
        let f = a.to_flush(None, t0, LAG);
        a.flushed(&f, &InFlightTotal { total: 1, admitted: 9, correction: 0, replicas: 1 }, t0, LAG);
        a.count(1, 1);
        assert_eq!(a.view(t0 + LAG, LAG), 2, "the last total plus what came since");
        assert_eq!(a.view(t0 + LAG + Duration::from_millis(1), LAG), 4, "the own balance");
    }

    #[test]
    fn the_bound_is_sent_once_the_pool_wide_admissions_are_known_and_caps_the_view() {
        let t0 = Instant::now();
        let mut a = InFlight::default();
        let metrics = Some((2.0, 1.0, 0.0));
        a.count(50, 50);
        assert_eq!(a.to_flush(metrics, t0, LAG).bound, None, "admissions within the lag unknown");
        let f = a.to_flush(None, t0, LAG);
        a.flushed(&f, &InFlightTotal { total: 50, admitted: 50, correction: 0, replicas: 1 }, t0, LAG);
        let t1 = t0 + Duration::from_secs(10);
        let f = a.to_flush(metrics, t1, LAG);
        // vLLM holds 3, nothing admitted within the lag: at most 3 in flight, as of 50 admitted.
        assert_eq!(f.bound, Some((3, 50)));
        // Redis lowered the total to the bound plus 2 admitted meanwhile by another replica.
        a.flushed(&f, &InFlightTotal { total: 5, admitted: 52, correction: 45, replicas: 2 }, t1, LAG);
        assert_eq!(a.view(t1, LAG), 5);
        a.count(1, 1);
        assert_eq!(a.view(t1, LAG), 6, "own admissions since the flush are above the bound");
        a.unbounded();
        assert_eq!(a.view(t1, LAG), 6);
    }

    #[test]
    fn requests_sent_within_the_arrival_lag_stay_in_the_bound() {
        // Eight sent at t0 that vLLM has not counted yet (its API server still parsing them).
        let t0 = Instant::now();
        let mut a = InFlight::default();
        let f = a.to_flush(None, t0, LAG);
        a.flushed(&f, &InFlightTotal { total: 0, admitted: 0, correction: 0, replicas: 1 }, t0, LAG);
        a.count(8, 8);
        let t1 = t0 + Duration::from_millis(100);
        let f = a.to_flush(None, t1, LAG);
        a.flushed(&f, &InFlightTotal { total: 8, admitted: 8, correction: 0, replicas: 1 }, t1, LAG);
        let vllm_sees_two = Some((2.0, 0.0, 0.0));
        // Past the report lag, within the arrival lag: the eight are still in the bound.
        let t2 = t1 + LAG + Duration::from_secs(1);
        assert_eq!(a.to_flush(vllm_sees_two, t2, LAG).bound, Some((10, 8)));
        // Past the arrival lag with vLLM still at two: they never arrived, and the bound says so.
        let t3 = t1 + signals::arrival_lag(LAG) + Duration::from_secs(1);
        let f = a.to_flush(vllm_sees_two, t3, LAG);
        a.flushed(&f, &InFlightTotal { total: 8, admitted: 8, correction: 0, replicas: 1 }, t3, LAG);
        assert_eq!(a.to_flush(vllm_sees_two, t3 + Duration::from_millis(100), LAG).bound, Some((2, 8)));
    }
}
