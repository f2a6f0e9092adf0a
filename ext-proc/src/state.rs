//! What every stream and task of the sidecar shares: the config, the limiter, the recorder, the
//! pools, the metrics and the exact-count checker ([`Shared`]), built once by [`crate::run`].

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
    /// Rate limits (Redis, breaker, local fallback).
    pub limiter: Limiter,
    /// Usage records' way to Redis.
    pub recorder: Recorder,
    /// Pool load for shedding.
    pub pools: Arc<Pools>,
    /// Prometheus metrics.
    pub metrics: Arc<Metrics>,
    /// Exact prompt-token counting for the context check (models with a tokenizer).
    pub context: Arc<ContextChecker>,
    pub(crate) ids: RecordIds,
    /// The lease reports this replica saw Redis record: their records skip the lease section.
    pub(crate) reported_leases: crate::admission::admission_lease::ReportedLeases,
    /// gRPC streams open now (ext_proc and access log): a shutdown serves on while there are.
    open_streams: AtomicUsize,
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
        limiter: Limiter,
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
            ids: RecordIds::new(),
            reported_leases: crate::admission::admission_lease::ReportedLeases::new(),
            open_streams: AtomicUsize::new(0),
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
