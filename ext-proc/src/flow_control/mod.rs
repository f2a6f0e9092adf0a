//! Flow control (issue 13): instead of refusing a request when its pool is saturated, the
//! admission holds it (its ext_proc answer is delayed) in the pool's bounded queue and releases it
//! when the pool has room ([`crate::pools::room`]). A higher tier goes first; within a tier, the tenant with
//! the least attained service ([`fairness`]). Each tier has a budget in time
//! (`flow_control.tiers[].max_queue_wait_ms`): a request whose predicted wait is already over it
//! is answered 429 `overloaded` with a `Retry-After` at once; one still queued when it runs out
//! gets the same 429. With `flow_control.newcomer_reserve`, queued requests fill the pool only to
//! that share below each tier's level; a request whose tenant had nothing queued in its tier when
//! it came takes the rest, at once ([`queue::FlowQueue::pass_newcomer`]) or around a head the
//! reserve holds back ([`queue::FlowQueue::pop_newcomer`]). The
//! queue's order and bounds are pure ([`queue`]); this module keeps one queue per flow-controlled
//! pool in [`crate::pools::Pools`], wakes waiting streams, and counts.
//!
//! A waiting stream holds a [`crate::pools::flow::Waiter`]: dropping it (Envoy closed the ext_proc stream because the
//! client went away) takes the request out of the queue at once, or, when it had just been
//! dispatched, takes its admission back off the pool's in-flight count. The requests' rate-limit
//! reservations are the admission's to give back ([`crate::admission::pipeline`]).

pub mod drain;
pub mod fairness;
pub mod queue;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use crate::config::pools::{FlowControlConfig, PoolFlowConfig};
use fairness::Fairness;
use queue::{Bounds, FlowQueue, Refusal};

/// How much longer than a queued request's remaining budget Envoy is told to wait for the
/// admission's answer (`override_message_timeout`): the time to answer once the budget runs out.
/// Envoy's admission filter needs `max_message_timeout` ≥ the largest `max_queue_wait_ms` plus
/// this, else it ignores the override and fails the request at its `message_timeout`.
pub const MESSAGE_TIMEOUT_MARGIN: Duration = Duration::from_secs(1);

/// What a queued request's stream is told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Release {
    /// Dispatched (counted in the pool's in-flight requests) after waiting this long.
    Dispatched(Duration),
    /// Refused, with the `Retry-After` seconds.
    Refused(Refusal, u64),
}

/// What the queue keeps with a request: its waiting stream's channel, and what a dispatch into
/// a free slot reads ([`crate::scheduling::slots`]): its prompt's block hashes and request id.
#[derive(Debug)]
pub(crate) struct Queued {
    pub(crate) tx: oneshot::Sender<Release>,
    pub(crate) hashes: Vec<u64>,
    pub(crate) request_id: String,
}

/// Requests of the head tenant a dispatch into a free slot looks through for one whose prefix
/// the slot's endpoint holds ([`queue::FlowQueue::pop_matching`]).
pub const DISPATCH_SCAN: usize = 32;

/// Younger requests of its tenant a queued request lets go first into the slots that hold their
/// prefixes, at most: past it, it goes next (a request whose prefix no endpoint holds waits at
/// most this many dispatches of its tenant longer than in arrival order).
pub const MAX_BYPASS: u32 = 8;

/// The queue of one flow-controlled pool.
pub(crate) struct PoolFlow {
    pub(crate) config: PoolFlowConfig,
    pub(crate) queue: Mutex<FlowQueue<Queued>>,
    /// The sidecar is shutting down: nothing is queued any more.
    pub(crate) closed: AtomicBool,
    /// Requests queued (as of the last change), read without the queue's lock.
    pub(crate) queued: AtomicUsize,
    /// The pool's drain rate while saturated ([`drain::DrainMeter`]).
    pub(crate) drain: Mutex<drain::DrainMeter>,
    /// Each tenant's dispatches per second while it had requests queued: its share of the
    /// pool when backlogged (tenants are the configured ones: bounded).
    pub(crate) tenant_drain: Mutex<HashMap<String, drain::DrainMeter>>,
    /// Tier names, highest first (metric labels).
    pub(crate) tiers: Vec<String>,
    /// Each tier's `max_load` (the share of the room it may fill).
    pub(crate) levels: Vec<f64>,
    /// `flow_control.newcomer_reserve`: the share of each tier's level that dispatches from the
    /// queue leave free for newcomers.
    pub(crate) reserve: f64,
}

impl PoolFlow {
    pub(crate) fn new(config: PoolFlowConfig, flow: &FlowControlConfig) -> Self {
        let fairness = Fairness::new(flow.tenant_weights.clone(), flow.output_token_weight);
        let tiers: Vec<String> = flow.tiers.iter().map(|t| t.name.clone()).collect();
        let levels = flow.tiers.iter().map(|t| t.max_load).collect();
        Self {
            queue: Mutex::new(FlowQueue::new(
                tiers.len(),
                Bounds { requests: config.max_queued, bytes: config.max_queued_bytes },
                fairness,
            )),
            config,
            closed: AtomicBool::new(false),
            queued: AtomicUsize::new(0),
            drain: Mutex::new(drain::DrainMeter::default()),
            tenant_drain: Mutex::new(HashMap::new()),
            tiers,
            levels,
            reserve: flow.newcomer_reserve,
        }
    }

    pub(crate) fn tier_name(&self, tier: usize) -> &str {
        self.tiers.get(tier).map_or("", String::as_str)
    }

    pub(crate) fn level(&self, tier: usize) -> f64 {
        self.levels.get(tier).copied().unwrap_or(1.0)
    }

    /// The level up to which a tier's queued requests are let in: its `max_load` less the
    /// newcomer reserve.
    pub(crate) fn queue_level(&self, tier: usize) -> f64 {
        self.level(tier) * (1.0 - self.reserve)
    }

    /// Requests per second the pool drains while saturated (None until measured).
    pub(crate) fn drain_rate(&self) -> Option<f64> {
        self.drain.lock().ok().and_then(|d| d.rate())
    }

    /// A tenant's request was dispatched from the queue at `now`; `backlogged`: the tenant still
    /// has requests queued.
    pub(crate) fn tenant_dispatched(&self, tenant: &str, now: Instant, backlogged: bool) {
        if let Ok(mut d) = self.tenant_drain.lock() {
            match d.get_mut(tenant) {
                Some(m) => m.finished(now, backlogged),
                None => d.entry(tenant.to_owned()).or_default().finished(now, backlogged),
            }
        }
    }

    /// The tenant's dispatches per second while backlogged (None until measured).
    pub(crate) fn tenant_rate(&self, tenant: &str) -> Option<f64> {
        self.tenant_drain.lock().ok().and_then(|d| d.get(tenant).and_then(drain::DrainMeter::rate))
    }

    /// A request of the pool ended (before the queue is pumped).
    pub(crate) fn finished(&self, now: Instant) {
        let backlogged = self.queued.load(Ordering::Relaxed) > 0;
        if let Ok(mut d) = self.drain.lock() {
            d.finished(now, backlogged);
        }
    }
}

/// The index and budget of a tier in `flow_control.tiers` (None: the tier is not queued).
pub fn tier_budget(flow: Option<&FlowControlConfig>, tier: &str) -> Option<(usize, Duration)> {
    let flow = flow?;
    flow.tiers
        .iter()
        .position(|t| t.name == tier)
        .and_then(|i| flow.tiers.get(i).map(|t| (i, Duration::from_millis(t.max_queue_wait_ms))))
}
