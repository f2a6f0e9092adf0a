//! What every stream and task of the sidecar shares: the config, the limiter, the recorder, the
//! pools, the metrics and the exact-count checker ([`Shared`]), built by [`crate::run`] and
//! rebuilt by each config reload ([`crate::reload`]); [`Live`] holds the generation that new
//! streams take. A stream keeps the generation it started with to its end, so an in-flight
//! request finishes under the config it was admitted by.

use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::admission::context::ContextChecker;
use crate::admission::limiter::Limiter;
use crate::config::Config;
use crate::metering::ledger;
use crate::metering::recorder::Recorder;
use crate::metrics::Metrics;
use crate::pools::Pools;

/// What every stream of the service shares.
pub struct Shared {
    /// The sidecar's config.
    pub config: Config,
    /// Rate limits (Redis, breaker, local fallback, admission leases): one per process, kept
    /// across reloads (the `redis` section does not reload).
    pub limiter: Arc<Limiter>,
    /// Usage records' way to Redis.
    pub recorder: Recorder,
    /// Pool load for shedding.
    pub pools: Arc<Pools>,
    /// Prometheus metrics.
    pub metrics: Arc<Metrics>,
    /// Exact prompt-token counting for the context check (models with a tokenizer).
    pub context: Arc<ContextChecker>,
    pub(crate) ids: Arc<RecordIds>,
    /// The lease reports this replica saw Redis record: their records skip the lease section.
    pub(crate) reported_leases: Arc<crate::admission::admission_lease::ReportedLeases>,
    /// gRPC streams open now (ext_proc and access log), of every generation: a shutdown serves
    /// on while there are.
    open_streams: Arc<AtomicUsize>,
}

/// One open gRPC stream, counted in [`Shared::open_streams`] until dropped.
pub(crate) struct OpenStream(Arc<Shared>);

impl Drop for OpenStream {
    fn drop(&mut self) {
        self.0.open_streams.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Shared {
    /// Bundles the parts.
    pub fn new(
        config: Config,
        limiter: Arc<Limiter>,
        recorder: Recorder,
        pools: Arc<Pools>,
        metrics: Arc<Metrics>,
        context: Arc<ContextChecker>,
    ) -> Self {
        Self {
            config,
            limiter,
            recorder,
            pools,
            metrics,
            context,
            ids: Arc::new(RecordIds::new()),
            reported_leases: Arc::new(crate::admission::admission_lease::ReportedLeases::new()),
            open_streams: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// The next generation: `config` with the parts given, and this one's limiter, metrics,
    /// record ids, lease reports and open-stream count (which belong to the process).
    pub fn next(
        &self,
        config: Config,
        recorder: Recorder,
        pools: Arc<Pools>,
        context: Arc<ContextChecker>,
    ) -> Self {
        Self {
            config,
            limiter: Arc::clone(&self.limiter),
            recorder,
            pools,
            metrics: Arc::clone(&self.metrics),
            context,
            ids: Arc::clone(&self.ids),
            reported_leases: Arc::clone(&self.reported_leases),
            open_streams: Arc::clone(&self.open_streams),
        }
    }

    /// Counts a gRPC stream as open until the returned guard is dropped.
    pub(crate) fn stream_opened(self: &Arc<Self>) -> OpenStream {
        self.open_streams.fetch_add(1, Ordering::Relaxed);
        OpenStream(Arc::clone(self))
    }

    /// gRPC streams open now (Envoy's access-log stream stays open while Envoy runs).
    pub fn open_streams(&self) -> usize {
        self.open_streams.load(Ordering::Relaxed)
    }

    /// How long a tenant's reservation keys live past their last write: the age at which an open
    /// reservation is charged, plus [`ledger::KEEP_MARGIN`].
    pub(crate) fn reservation_keep(&self) -> Duration {
        Duration::from_millis(self.config.metering.reservations.record_after_ms) + ledger::KEEP_MARGIN
    }
}

/// The generation of [`Shared`] that new streams and each background pass take: swapped whole by
/// a config reload ([`crate::reload`]), while the streams that took an older one keep it.
pub struct Live {
    current: arc_swap::ArcSwap<Shared>,
    /// The number of the generation serving now: 1 at start, one more per applied reload.
    generation: AtomicU64,
}

impl Live {
    /// Live state starting at `shared` (generation 1).
    pub fn new(shared: Arc<Shared>) -> Arc<Self> {
        Arc::new(Self { current: arc_swap::ArcSwap::new(shared), generation: AtomicU64::new(1) })
    }

    /// The generation serving now: a stream takes it once and keeps it.
    pub fn current(&self) -> Arc<Shared> {
        self.current.load_full()
    }

    /// Makes `next` the generation new streams take; returns its number.
    pub fn swap(&self, next: Arc<Shared>) -> u64 {
        self.current.store(next);
        self.generation.fetch_add(1, Ordering::AcqRel) + 1
    }

    /// The number of the generation serving now.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }
}

/// Usage-record ids for requests whose facts carry no nonce (an older filter): a random
/// per-process prefix and a counter. Requests with one are named by
/// [`gateway_contract::record_id`].
pub(crate) struct RecordIds {
    prefix: u64,
    next: AtomicU64,
}

impl RecordIds {
    fn new() -> Self {
        let prefix = RandomState::new().hash_one((std::process::id(), std::time::SystemTime::now()));
        Self { prefix, next: AtomicU64::new(0) }
    }

    pub(crate) fn next(&self) -> String {
        format!("{:016x}-{:x}", self.prefix, self.next.fetch_add(1, Ordering::Relaxed))
    }
}

impl Shared {
    /// The request's tier in `flow_control.tiers` (index and budget) when its pool queues: None
    /// for a pool without `flow_control` or a tier not listed (shed as before).
    pub(crate) fn queued_tier(&self, facts: &crate::facts::RequestFacts) -> Option<(usize, Duration)> {
        crate::flow_control::tier_budget(self.config.flow_control.as_ref(), &facts.tier)
            .filter(|_| self.pools.flow_controlled(&facts.pool))
    }
}
