//! Flow control's side of the pools ([`Pools`]): a request let into its pool now, queued, or
//! refused ([`Pools::enter`], [`Entered`]), the queue pumped as the pool gets room, and a queued
//! request's place ([`Waiter`]), taken out of the queue when its stream goes away. The queue's
//! order and bounds are [`crate::flow_control`]'s.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use crate::flow_control::drain;
use crate::flow_control::queue::{Entry, FlowQueue, Refusal};
use crate::flow_control::{PoolFlow, Queued, Release, DISPATCH_SCAN, MAX_BYPASS};
use crate::metrics::labels::{PoolTier, QueueDequeue, QueueWait};
use crate::pools::{Pool, Pools};
use crate::scheduling::slots::most_free;

/// Where a request stands once [`Pools::enter`] has seen it.
#[derive(Debug)]
pub enum Entered {
    /// The pool has room and nothing waits: dispatched now (counted in flight).
    Now,
    /// Queued: await [`Waiter::wait`].
    Queued(Waiter),
    /// Refused (429 `overloaded` with this `Retry-After`).
    Refused(Refusal, u64),
}

/// A request arriving at a flow-controlled pool ([`Pools::enter_arrival`]).
#[derive(Debug, Clone, Copy)]
pub struct Arrival<'a> {
    /// Its tier's index in `flow_control.tiers`.
    pub tier: usize,
    /// Its tenant.
    pub tenant: &'a str,
    /// Its prompt tokens (charged to the tenant's counter when it is dispatched).
    pub prompt_tokens: u64,
    /// Its body's bytes (what Envoy holds while it waits).
    pub body_bytes: u64,
    /// Its tier's `max_queue_wait_ms`.
    pub budget: Duration,
    /// Its prompt's chained block hashes (may be empty).
    pub hashes: &'a [u64],
    /// Its `x-request-id` (may be empty: no slot is promised to it).
    pub request_id: &'a str,
}

/// A queued request's place. Dropping it before [`Waiter::wait`] returns takes the request out
/// of the queue (or its dispatch back off the in-flight count).
pub struct Waiter {
    pools: Arc<Pools>,
    pool: String,
    id: u64,
    tier: usize,
    rx: oneshot::Receiver<Release>,
    deadline: tokio::time::Instant,
    budget: Duration,
    done: bool,
}

impl std::fmt::Debug for Waiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Waiter")
            .field("pool", &self.pool)
            .field("id", &self.id)
            .field("tier", &self.tier)
            .finish()
    }
}

impl Waiter {
    /// The longest it can still wait (until its tier's budget runs out).
    pub fn remaining(&self) -> Duration {
        self.deadline.saturating_duration_since(tokio::time::Instant::now())
    }

    /// Waits for the request's dispatch or refusal, at most until its tier's budget runs out.
    ///
    /// # Errors
    /// The refusal and its `Retry-After` seconds.
    pub async fn wait(mut self) -> Result<Duration, (Refusal, u64)> {
        let release = match tokio::time::timeout_at(self.deadline, &mut self.rx).await {
            Ok(Ok(release)) => release,
            // The sender is dropped only with the pools (the sidecar stopping).
            Ok(Err(_)) => Release::Refused(Refusal::ShuttingDown, 1),
            Err(_) => match self.pools.timed_out(&self.pool, self.id, self.tier, self.budget) {
                Some(release) => release,
                // Dispatched or refused just now: the answer is in the channel.
                None => self.rx.try_recv().unwrap_or(Release::Refused(Refusal::ShuttingDown, 1)),
            },
        };
        self.done = true;
        match release {
            Release::Dispatched(waited) => Ok(waited),
            Release::Refused(refusal, retry_after) => Err((refusal, retry_after)),
        }
    }
}

impl Drop for Waiter {
    fn drop(&mut self) {
        if !self.done {
            self.pools.cancelled(&self.pool, self.id, self.tier, &mut self.rx);
        }
    }
}

impl Pools {
    /// Whether `pool` queues requests.
    pub fn flow_controlled(&self, pool: &str) -> bool {
        self.pool(pool).is_some_and(|p| p.flow.is_some())
    }

    /// Whether a request of `tier` would be let into `pool` at once: nothing queued and room
    /// for its tier (always, for a pool without flow control).
    pub fn room_now(&self, pool: &str, tier: usize) -> bool {
        let Some(p) = self.pool(pool) else { return true };
        let Some(flow) = p.flow.as_ref() else { return true };
        flow.queue.lock().map_or(true, |q| q.is_empty()) && p.has_room(flow.level(tier))
    }

    /// Before any quota is taken: `Some(retry_after_secs)` when a request of `tier` (an index
    /// into `flow_control.tiers`) and `tenant` would have to wait longer than `budget`, by the
    /// queue ahead of it and the pool's drain rate; None when it may go on (room now, a wait
    /// within the budget, or no drain rate yet to predict with).
    pub fn predict_refusal(&self, pool: &str, tier: usize, tenant: &str, budget: Duration) -> Option<u64> {
        let p = self.pool(pool)?;
        let flow = p.flow.as_ref()?;
        let q = flow.queue.lock().ok()?;
        let drain = flow.drain_rate();
        if q.is_empty() && p.has_room(flow.level(tier)) {
            return None;
        }
        let ahead = q.ahead(tier, tenant);
        let own = q.queued_of(tier, tenant);
        // A backlog its fair share drains within the budget is never refused, whatever a short
        // window measured of the tenant's own rate.
        if drain::within_fair_share(own, drain, q.share_of(tier, tenant), budget) {
            return None;
        }
        let wait = drain::predicted_wait_of(ahead, drain, own, flow.tenant_rate(tenant))?;
        if wait <= budget {
            return None;
        }
        drop(q);
        self.count_dequeue(pool, flow.tier_name(tier), Refusal::PredictedWait.label());
        Some(drain::retry_after_wait(wait, budget))
    }

    /// Admits a request of `tier` and `tenant` to `pool` now when the pool has room and nothing
    /// waits, else queues it (its body of `body_bytes` held by Envoy meanwhile) for at most
    /// `budget`. A pool that is not flow-controlled (or unknown) admits at once. Either way an
    /// admission is counted in the pool's in-flight requests when it happens ([`Pools::finished`]
    /// takes it off).
    pub fn enter(
        self: &Arc<Self>,
        pool: &str,
        tier: usize,
        tenant: &str,
        prompt_tokens: u64,
        body_bytes: u64,
        budget: Duration,
    ) -> Entered {
        self.enter_arrival(
            pool,
            Arrival { tier, tenant, prompt_tokens, body_bytes, budget, hashes: &[], request_id: "" },
        )
    }

    /// [`Pools::enter`] of an [`Arrival`], whose prompt hashes and request id let the queue
    /// dispatch it into a free slot holding its prefix ([`crate::scheduling::slots`]).
    pub fn enter_arrival(self: &Arc<Self>, pool: &str, arrival: Arrival<'_>) -> Entered {
        let Arrival { tier, tenant, prompt_tokens, body_bytes, budget, .. } = arrival;
        let Some(p) = self.pool(pool) else { return Entered::Now };
        let Some(flow) = p.flow.as_ref() else {
            self.admitted(pool);
            return Entered::Now;
        };
        let Ok(mut q) = flow.queue.lock() else {
            self.admitted(pool);
            return Entered::Now;
        };
        if q.is_empty() && p.has_room(flow.level(tier)) {
            // Counted under the queue's lock: no other request takes the same room.
            self.admitted(pool);
            return Entered::Now;
        }
        // Queued requests leave the newcomer reserve free: a request whose tenant has nothing
        // queued in its tier (not backlogged) takes it now.
        if flow.reserve > 0.0 && p.has_room(flow.level(tier)) && q.pass_newcomer(tier, tenant, prompt_tokens)
        {
            self.admitted(pool);
            self.count_dequeue(pool, flow.tier_name(tier), "reserve");
            return Entered::Now;
        }
        if flow.closed.load(Ordering::Relaxed) {
            return Entered::Refused(Refusal::ShuttingDown, 1);
        }
        let (tx, rx) = oneshot::channel();
        let now = Instant::now();
        let item = Queued { tx, hashes: arrival.hashes.to_vec(), request_id: arrival.request_id.to_owned() };
        let id = match q.push(tier, tenant, prompt_tokens, body_bytes, now, item) {
            Ok((id, evicted)) => {
                for e in evicted {
                    self.refuse(pool, flow, e, Refusal::Evicted, &q);
                }
                id
            }
            Err((refusal, _)) => {
                let retry = drain::retry_after_secs(q.ahead(tier, tenant), flow.drain_rate(), budget);
                drop(q);
                self.count_dequeue(pool, flow.tier_name(tier), refusal.label());
                return Entered::Refused(refusal, retry);
            }
        };
        self.pump_locked(pool, p, flow, &mut q);
        drop(q);
        // Dispatched by that pump (a higher tier than everything queued, with room): no wait.
        let mut rx = rx;
        match rx.try_recv() {
            Ok(Release::Dispatched(_)) => return Entered::Now,
            Ok(Release::Refused(refusal, retry_after)) => return Entered::Refused(refusal, retry_after),
            Err(_) => {}
        }
        Entered::Queued(Waiter {
            pools: Arc::clone(self),
            pool: pool.to_owned(),
            id,
            tier,
            rx,
            deadline: tokio::time::Instant::now() + budget,
            budget,
            done: false,
        })
    }

    /// Dispatches queued requests of `pool` while it has room.
    pub fn pump(&self, pool: &str) {
        let Some(p) = self.pool(pool) else { return };
        let Some(flow) = p.flow.as_ref() else { return };
        let Ok(mut q) = flow.queue.lock() else { return };
        self.pump_locked(pool, p, flow, &mut q);
    }

    fn pump_locked(&self, name: &str, p: &Pool, flow: &PoolFlow, q: &mut FlowQueue<Queued>) {
        let now = Instant::now();
        // With the pool's picker keeping its endpoints' slots, a freed slot goes to a request
        // whose prefix its endpoint holds, and is promised to it (crate::scheduling::slots).
        let mut picker = if q.is_empty() { None } else { p.picker.as_ref().and_then(|m| m.lock().ok()) };
        let mut free = picker.as_ref().and_then(|pk| pk.free_slots(now));
        // The endpoints' overcommitted slots, for prompts no endpoint holds.
        let spill_room = picker.as_ref().and_then(|pk| pk.spill_room());
        let mut spill = spill_room.and(picker.as_ref()).and_then(|pk| pk.spill_slots(now));
        while let Some((tier, newcomer)) = q.peek() {
            // Requests of backlogged tenants fill the pool up to the tier's level less the
            // newcomer reserve; a newcomer's request up to the level, around a head held back
            // by the reserve. Without room nothing goes: a higher tier's queued request holds
            // back every lower tier's.
            // With overcommitted slots the pool holds up to `max_in_flight` plus them, and a
            // request goes to a slot while an endpoint has one free (its own count, which the
            // overcommitted requests on it take too): an endpoint with a free slot is never left
            // idle behind requests overcommitted elsewhere.
            let room = |level: f64, f: Option<&Vec<u64>>| match (spill_room, f) {
                (Some(extra), Some(f)) => f.iter().any(|&n| n > 0) && p.has_room_beyond(level, extra),
                _ => p.has_room(level),
            };
            // The endpoint an overcommitted slot went to (None: a slot of its own, or none).
            let mut spilled_to = None;
            let entry = if room(flow.queue_level(tier), free.as_ref())
                || (newcomer && room(flow.level(tier), free.as_ref()))
            {
                match (picker.as_ref(), free.as_ref()) {
                    (Some(pk), Some(f)) => q.pop_matching(DISPATCH_SCAN, MAX_BYPASS, |e| {
                        pk.preferred(&e.item.hashes, f).is_some()
                    }),
                    _ => q.pop(),
                }
            } else if flow.reserve > 0.0 && room(flow.level(tier), free.as_ref()) {
                q.pop_newcomer()
            } else if let (Some(pk), Some(extra), Some(sp)) = (picker.as_ref(), spill_room, spill.as_ref()) {
                // Past the slots, an overcommitted one goes to a request waiting for its prefix's
                // endpoint (it waits in that engine's queue, which gives it the engine's next
                // free slot, as this queue would), or to a prompt no endpoint holds, only on an
                // endpoint no request of the window holds a prefix on: the engine's next free
                // slot goes to what waits in its own queue first, and that one is the queue's to
                // give to a request whose prefix the engine holds.
                let mut unheld = sp.clone();
                for i in q.head_window(DISPATCH_SCAN).filter_map(|e| pk.holder(&e.item.hashes)) {
                    if let Some(n) = unheld.get_mut(i) {
                        *n = 0;
                    }
                }
                if p.has_room_beyond(flow.queue_level(tier), extra) {
                    // The endpoint of the request matched last (the one taken, if any).
                    q.pop_only_matching(DISPATCH_SCAN, MAX_BYPASS, |e| {
                        spilled_to = match pk.holder(&e.item.hashes) {
                            Some(i) => sp.get(i).is_some_and(|&n| n > 0).then_some(i),
                            None => most_free(&unheld),
                        };
                        spilled_to.is_some()
                    })
                } else {
                    None
                }
            } else {
                None
            };
            let Some(entry) = entry else { break };
            if let (Some(pk), Some(f)) = (picker.as_mut(), free.as_mut()) {
                let slot =
                    spilled_to.or_else(|| pk.preferred(&entry.item.hashes, f).or_else(|| most_free(f)));
                if let Some(slot) = slot {
                    pk.promise(&entry.item.request_id, slot, now);
                    for v in [Some(&mut *f), spill.as_mut()].into_iter().flatten() {
                        if let Some(n) = v.get_mut(slot) {
                            *n = n.saturating_sub(1);
                        }
                    }
                }
            }
            flow.tenant_dispatched(&entry.tenant, now, q.queued_of(entry.tier, &entry.tenant) > 0);
            let waited = now.saturating_duration_since(entry.enqueued);
            self.admitted(name);
            let tier = flow.tier_name(entry.tier).to_owned();
            let request_id = entry.item.request_id.clone();
            if entry.item.tx.send(Release::Dispatched(waited)).is_err() {
                if let (Some(pk), Some(f)) = (picker.as_mut(), free.as_mut()) {
                    pk.unpromise(&request_id);
                    *f = pk.free_slots(now).unwrap_or_default();
                    if let Some(sp) = spill.as_mut() {
                        *sp = pk.spill_slots(now).unwrap_or_default();
                    }
                }
                // Its stream is gone (the waiter is being dropped): not in flight after all
                // (the queue's lock is held: no pump from here, the loop goes on).
                self.adjust(name, -1, 0);
                self.count_dequeue(name, &tier, "cancelled");
                continue;
            }
            self.count_dequeue(name, &tier, "dispatched");
            let labels = QueueWait {
                pool: self.metrics.bounded(name),
                tier: self.metrics.bounded(&tier),
                tenant: self.metrics.bounded(&entry.tenant),
            };
            self.metrics.queue_wait.get_or_create(&labels).observe(waited.as_secs_f64());
        }
        self.publish_queue(name, flow, q);
    }

    /// A waiter's budget ran out: takes it out of the queue (None when it was dispatched or
    /// refused meanwhile).
    fn timed_out(&self, pool: &str, id: u64, tier: usize, budget: Duration) -> Option<Release> {
        let p = self.pool(pool)?;
        let flow = p.flow.as_ref()?;
        let mut q = flow.queue.lock().ok()?;
        q.remove(id)?;
        let retry = drain::retry_after_secs(q.ahead(tier, ""), flow.drain_rate(), budget);
        self.publish_queue(pool, flow, &q);
        drop(q);
        self.count_dequeue(pool, flow.tier_name(tier), Refusal::Timeout.label());
        Some(Release::Refused(Refusal::Timeout, retry))
    }

    /// A waiter was dropped before its answer (its stream went away): out of the queue, or, when
    /// it was dispatched meanwhile, off the in-flight count.
    fn cancelled(&self, pool: &str, id: u64, tier: usize, rx: &mut oneshot::Receiver<Release>) {
        let Some(p) = self.pool(pool) else { return };
        let Some(flow) = p.flow.as_ref() else { return };
        let removed = match flow.queue.lock() {
            Ok(mut q) => {
                let removed = q.remove(id).is_some();
                if removed {
                    self.publish_queue(pool, flow, &q);
                }
                removed
            }
            Err(_) => false,
        };
        if removed {
            self.count_dequeue(pool, flow.tier_name(tier), "cancelled");
        } else if let Ok(Release::Dispatched(_)) = rx.try_recv() {
            self.finished(pool);
        }
    }

    /// Answers every queued request 429 (`Retry-After: 1`) and queues nothing more: the sidecar
    /// is shutting down.
    pub fn close_queues(&self) {
        for (name, p) in self.iter() {
            let Some(flow) = p.flow.as_ref() else { continue };
            flow.closed.store(true, Ordering::Relaxed);
            let Ok(mut q) = flow.queue.lock() else { continue };
            for entry in q.drain() {
                self.refuse(name, flow, entry, Refusal::ShuttingDown, &q);
            }
            self.publish_queue(name, flow, &q);
        }
    }

    /// Charges a finished request's completion tokens to its tenant's fair share.
    pub fn charge_output(&self, pool: &str, tenant: &str, completion_tokens: u64) {
        let Some(flow) = self.pool(pool).and_then(|p| p.flow.as_ref()) else { return };
        if let Ok(mut q) = flow.queue.lock() {
            q.fairness_mut().charge_output(tenant, completion_tokens);
        }
    }

    /// Whether `pool`'s queue holds requests or its load is at its `leases_below_load`: the
    /// filter's admission leases then stop, so that the pool's requests go through the queue.
    pub fn near_saturation(&self, pool: &str) -> bool {
        let Some(p) = self.pool(pool) else { return false };
        let Some(flow) = p.flow.as_ref() else { return false };
        let queued = flow.queue.lock().map_or(true, |q| !q.is_empty());
        queued || p.load() >= flow.config.leases_below_load
    }

    fn refuse(
        &self,
        pool: &str,
        flow: &PoolFlow,
        entry: Entry<Queued>,
        refusal: Refusal,
        q: &FlowQueue<Queued>,
    ) {
        let retry = match refusal {
            Refusal::ShuttingDown => 1,
            _ => drain::retry_after_secs(q.len(), flow.drain_rate(), Duration::ZERO),
        };
        let _ = entry.item.tx.send(Release::Refused(refusal, retry));
        self.count_dequeue(pool, flow.tier_name(entry.tier), refusal.label());
    }

    fn count_dequeue(&self, pool: &str, tier: &str, reason: &'static str) {
        let labels =
            QueueDequeue { pool: self.metrics.bounded(pool), tier: self.metrics.bounded(tier), reason };
        self.metrics.queue_dequeues.get_or_create(&labels).inc();
    }

    fn publish_queue(&self, pool: &str, flow: &PoolFlow, q: &FlowQueue<Queued>) {
        flow.queued.store(q.len(), Ordering::Relaxed);
        for (tier, len) in flow.tiers.iter().zip(q.tier_lens()) {
            let labels = PoolTier { pool: self.metrics.bounded(pool), tier: self.metrics.bounded(tier) };
            self.metrics.queue_length.get_or_create(&labels).set(i64::try_from(len).unwrap_or(i64::MAX));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::config::pools::{FlowControlConfig, PoolConfig, PoolFlowConfig, QueueTierConfig};
    use crate::metrics::Metrics;

    const LONG: Duration = Duration::from_secs(30);

    fn pools(max_in_flight: u64, max_queued: usize) -> Arc<Pools> {
        pools_with(max_in_flight, max_queued, 1.0)
    }

    fn pools_with(max_in_flight: u64, max_queued: usize, batch_load: f64) -> Arc<Pools> {
        pools_reserving(max_in_flight, max_queued, batch_load, 0.0)
    }

    fn pools_reserving(max_in_flight: u64, max_queued: usize, batch_load: f64, reserve: f64) -> Arc<Pools> {
        let pool = PoolConfig {
            name: "p".into(),
            endpoints: vec![],
            scrape_interval_ms: 100,
            max_queue_depth: None,
            max_kv_cache_usage: None,
            max_in_flight: Some(max_in_flight),
            picker: None,
            flow_control: Some(PoolFlowConfig {
                max_queued,
                max_queued_bytes: crate::config::pools::DEFAULT_MAX_QUEUED_BYTES,
                leases_below_load: 0.8,
            }),
            admission_leases: None,
        };
        let tier =
            |name: &str, max_load| QueueTierConfig { name: name.into(), max_queue_wait_ms: 1000, max_load };
        let flow = FlowControlConfig {
            tiers: vec![tier("premium", 1.0), tier("batch", batch_load)],
            output_token_weight: 2.0,
            tenant_weights: BTreeMap::new(),
            newcomer_reserve: reserve,
        };
        Pools::new(&[pool], Some(&flow), Metrics::new(), None)
    }

    fn queued(e: Entered) -> Waiter {
        match e {
            Entered::Queued(w) => w,
            other => panic!("not queued: {other:?}"),
        }
    }

    fn in_flight(p: &Pools) -> u64 {
        p.pool("p").map_or(u64::MAX, |p| p.signals().in_flight)
    }

    #[tokio::test]
    async fn a_request_waits_for_room_and_a_higher_tier_goes_first() {
        let p = pools(1, 10);
        assert!(matches!(p.enter("p", 0, "a", 10, 0, LONG), Entered::Now));
        assert!(p.near_saturation("p"), "at its max_in_flight: no leases");
        let batch = queued(p.enter("p", 1, "b", 10, 0, LONG));
        let premium = queued(p.enter("p", 0, "a", 10, 0, LONG));
        assert_eq!(in_flight(&p), 1);
        let (batch, premium) = (tokio::spawn(batch.wait()), tokio::spawn(premium.wait()));
        p.finished("p");
        let waited = premium.await.unwrap().unwrap();
        assert!(waited > Duration::ZERO);
        assert!(!batch.is_finished());
        assert_eq!(in_flight(&p), 1, "the premium request took the room");
        p.finished("p");
        assert!(batch.await.unwrap().is_ok());
        p.finished("p");
        assert_eq!(in_flight(&p), 0);
        assert!(!p.near_saturation("p"));
    }

    #[tokio::test]
    async fn a_tier_with_a_max_load_leaves_the_rest_of_the_room_to_higher_tiers() {
        let p = pools_with(4, 10, 0.5);
        assert!(matches!(p.enter("p", 1, "b", 10, 0, LONG), Entered::Now));
        assert!(matches!(p.enter("p", 1, "b", 10, 0, LONG), Entered::Now));
        let batch = queued(p.enter("p", 1, "b", 10, 0, LONG));
        // Premium takes the room batch may not, even with batch queued.
        assert!(matches!(p.enter("p", 0, "a", 10, 0, LONG), Entered::Now));
        assert_eq!(in_flight(&p), 3);
        let batch = tokio::spawn(batch.wait());
        p.finished("p");
        p.finished("p");
        assert!(batch.await.unwrap().is_ok(), "under half again: batch goes");
        assert_eq!(in_flight(&p), 2);
    }

    #[tokio::test]
    async fn the_newcomer_reserve_lets_a_light_tenant_past_a_backlogged_one() {
        // 8 slots, a quarter reserved: the queue fills the pool to 6. With nothing queued every
        // tenant is a newcomer: heavy fills all 8.
        let p = pools_reserving(8, 100, 1.0, 0.25);
        for _ in 0..8 {
            assert!(matches!(p.enter("p", 0, "heavy", 10, 0, LONG), Entered::Now));
        }
        let heavy: Vec<_> = (0..4).map(|_| queued(p.enter("p", 0, "heavy", 10, 0, LONG))).collect();
        let heavy: Vec<_> = heavy.into_iter().map(|w| tokio::spawn(w.wait())).collect();
        // Three ends: the pool is at 5, below the queue's 6: one of heavy's goes.
        for _ in 0..3 {
            p.finished("p");
        }
        assert_eq!(in_flight(&p), 6);
        // Light, with nothing queued and the least counter, takes the reserve at once, twice.
        assert!(matches!(p.enter("p", 0, "light", 10, 0, LONG), Entered::Now));
        assert_eq!(in_flight(&p), 7);
        assert!(matches!(p.enter("p", 0, "other", 10, 0, LONG), Entered::Now));
        assert_eq!(in_flight(&p), 8);
        // The pool is full: light2's two requests wait. The first is a newcomer's (light2 had
        // nothing queued); the second came while it was queued.
        let light = tokio::spawn(queued(p.enter("p", 0, "light2", 10, 0, LONG)).wait());
        let light_again = tokio::spawn(queued(p.enter("p", 0, "light2", 10, 0, LONG)).wait());
        // Heavy's answers were long: light2 is ahead of it in the fair order.
        p.charge_output("p", "heavy", 100);
        // An end: the newcomer's request takes the reserve.
        p.finished("p");
        assert!(light.await.unwrap().is_ok());
        assert_eq!(in_flight(&p), 8);
        // The second is held below the reserve, as heavy's are: two ends leave the pool at 6.
        p.finished("p");
        p.finished("p");
        assert_eq!(in_flight(&p), 6, "the reserve is kept free");
        assert!(!light_again.is_finished());
        p.finished("p");
        assert!(light_again.await.unwrap().is_ok(), "below the queue's level, in the fair order");
        assert_eq!(in_flight(&p), 6);
        assert_eq!(heavy.iter().filter(|h| h.is_finished()).count(), 1);
        p.finished("p");
        assert_eq!(in_flight(&p), 6, "then heavy's");
        tokio::task::yield_now().await;
        assert_eq!(heavy.iter().filter(|h| h.is_finished()).count(), 2);
    }

    #[tokio::test]
    async fn the_budget_runs_out_with_a_429() {
        let p = pools(1, 10);
        assert!(matches!(p.enter("p", 0, "a", 10, 0, LONG), Entered::Now));
        let w = queued(p.enter("p", 1, "b", 10, 0, Duration::from_millis(50)));
        let started = Instant::now();
        let (refusal, retry_after) = w.wait().await.unwrap_err();
        assert_eq!(refusal, Refusal::Timeout);
        assert!(started.elapsed() >= Duration::from_millis(50));
        assert!((1..=30).contains(&retry_after));
        // Nothing left queued: the next end dispatches nobody.
        p.finished("p");
        assert_eq!(in_flight(&p), 0);
    }

    #[tokio::test]
    async fn a_dropped_waiter_leaves_no_trace() {
        let p = pools(1, 10);
        assert!(matches!(p.enter("p", 0, "a", 10, 0, LONG), Entered::Now));
        let w = queued(p.enter("p", 0, "a", 10, 0, LONG));
        drop(w);
        p.finished("p");
        assert_eq!(in_flight(&p), 0, "the dropped request was not dispatched");
        // Dropped after its dispatch was sent but before it was read: taken back off.
        assert!(matches!(p.enter("p", 0, "a", 10, 0, LONG), Entered::Now));
        let w = queued(p.enter("p", 0, "a", 10, 0, LONG));
        p.finished("p");
        assert_eq!(in_flight(&p), 1);
        drop(w);
        assert_eq!(in_flight(&p), 0);
    }

    #[tokio::test]
    async fn a_full_queue_evicts_a_lower_tier_and_shutdown_answers_everyone() {
        let p = pools(1, 1);
        assert!(matches!(p.enter("p", 0, "a", 10, 0, LONG), Entered::Now));
        let batch = queued(p.enter("p", 1, "b", 10, 0, LONG));
        let premium = queued(p.enter("p", 0, "a", 10, 0, LONG));
        assert_eq!(batch.wait().await.unwrap_err().0, Refusal::Evicted);
        assert!(matches!(p.enter("p", 1, "b", 10, 0, LONG), Entered::Refused(Refusal::Full, _)));
        p.close_queues();
        assert_eq!(premium.wait().await.unwrap_err(), (Refusal::ShuttingDown, 1));
        assert!(matches!(p.enter("p", 0, "a", 10, 0, LONG), Entered::Refused(Refusal::ShuttingDown, 1)));
    }

    #[tokio::test]
    async fn no_prediction_until_a_drain_rate_is_measured() {
        let p = pools(1, 100);
        assert!(matches!(p.enter("p", 0, "a", 10, 0, LONG), Entered::Now));
        let waiters: Vec<_> = (0..50).map(|_| queued(p.enter("p", 0, "a", 10, 0, LONG))).collect();
        assert_eq!(p.predict_refusal("p", 0, "a", Duration::from_millis(1)), None, "rate unknown");
        let flow = p.pool("p").and_then(|p| p.flow.as_ref()).unwrap();
        let t0 = Instant::now();
        for i in 0..=10 {
            flow.finished(t0 + Duration::from_millis(i * 100));
        }
        // 10/s, 50 queued ahead: about 5 s, over a 1 s budget; within a 10 s one.
        let retry = p.predict_refusal("p", 0, "a", Duration::from_secs(1)).unwrap();
        assert!((3..=5).contains(&retry), "{retry}");
        assert_eq!(p.predict_refusal("p", 0, "a", Duration::from_secs(10)), None);
        // A new tenant of the tier is ahead of all but one of the backlogged tenant's requests.
        assert_eq!(p.predict_refusal("p", 0, "new", Duration::from_secs(1)), None);
        drop(waiters);
    }

    /// Two endpoints of one slot each (max_in_flight 2) and `overcommit` more, both scraped.
    fn slot_pools(overcommit: u64) -> Arc<Pools> {
        let config = crate::config::Config::from_yaml(&format!(
            "listen: 127.0.0.1:0\nredis: {{url: 'redis://x'}}\ntenants: []\n\
             flow_control: {{tiers: [{{name: standard, max_queue_wait_ms: 30000}}]}}\n\
             pools:\n  - {{name: p, endpoints: ['http://10.0.0.1:1', 'http://10.0.0.1:2'], max_in_flight: 2, \
             flow_control: {{}}, picker: {{fallback_endpoints: 0, slot_overcommit: {overcommit}}}}}\n",
        ))
        .unwrap();
        let p = Pools::new(&config.pools, config.flow_control.as_ref(), Metrics::new(), None);
        let now = Instant::now();
        for i in 0..2 {
            p.pool("p").unwrap().picker_scraped(i, Some(crate::pools::signals::Scrape::default()), now);
        }
        p
    }

    /// Tenant t's request `id` of a prompt hashing to `hashes`, to tier 0.
    fn arrive(hashes: &'static [u64], id: &'static str) -> Arrival<'static> {
        Arrival {
            tier: 0,
            tenant: "t",
            prompt_tokens: 10,
            body_bytes: 0,
            budget: LONG,
            hashes,
            request_id: id,
        }
    }

    /// The pick of request `id` in pool p.
    fn picked(p: &Pools, hashes: &[u64], id: &str) -> crate::pools::Pick {
        match p.pick("p", hashes, None, id) {
            crate::pools::PickOutcome::Picked(pick) => pick,
            other => panic!("no pick: {other:?}"),
        }
    }

    #[tokio::test]
    async fn a_freed_slot_goes_to_a_queued_request_whose_prefix_its_endpoint_holds() {
        // Two endpoints, one slot each (max_in_flight 2), queued in the sidecar past it.
        let p = slot_pools(0);
        assert!(matches!(p.enter_arrival("p", arrive(&[1], "r0")), Entered::Now));
        let a = picked(&p, &[1], "r0").primary().to_owned();
        assert!(matches!(p.enter_arrival("p", arrive(&[2], "r1")), Entered::Now));
        let b = picked(&p, &[2], "r1").primary().to_owned();
        assert_ne!(a, b, "one request on each endpoint");
        // Queued: first a prompt no endpoint holds, then one of b's prefix.
        let cold = tokio::spawn(queued(p.enter_arrival("p", arrive(&[9], "r2"))).wait());
        let warm = tokio::spawn(queued(p.enter_arrival("p", arrive(&[2, 3], "r3"))).wait());
        tokio::task::yield_now().await;
        // b's request ends: its slot goes to r3, past the older r2, and r3's pick goes to b.
        p.pick_finished("p", &b, None);
        p.finished("p");
        assert!(warm.await.unwrap().is_ok());
        let pick = picked(&p, &[2, 3], "r3");
        assert!(pick.slot);
        assert_eq!(pick.primary(), b);
        assert!(!cold.is_finished());
        // a's ends: r2 takes its slot (the most free).
        p.pick_finished("p", &a, None);
        p.finished("p");
        assert!(cold.await.unwrap().is_ok());
        assert_eq!(picked(&p, &[9], "r2").primary(), a);
    }

    #[tokio::test]
    async fn an_overcommitted_slot_goes_to_a_request_of_its_prefix_or_a_prompt_no_endpoint_holds() {
        // Two endpoints, one slot each and one overcommitted each.
        let p = slot_pools(1);
        assert!(matches!(p.enter_arrival("p", arrive(&[1], "r0")), Entered::Now));
        let a = picked(&p, &[1], "r0").primary().to_owned();
        assert!(matches!(p.enter_arrival("p", arrive(&[2], "r1")), Entered::Now));
        let b = picked(&p, &[2], "r1").primary().to_owned();
        assert_ne!(a, b, "one request on each endpoint");
        // A prompt of b's prefix takes b's overcommitted slot at once (it waits in b's engine
        // queue for b's next free slot); the next one of b's prefix waits in the sidecar.
        assert!(matches!(p.enter_arrival("p", arrive(&[2, 3], "r2")), Entered::Now));
        let homed = picked(&p, &[2, 3], "r2");
        assert!(homed.slot);
        assert_eq!(homed.primary(), b);
        let warm = tokio::spawn(queued(p.enter_arrival("p", arrive(&[2, 4], "r3"))).wait());
        tokio::task::yield_now().await;
        // A prompt no endpoint holds takes a's overcommitted slot at once: b's next free slot
        // is for the queued request of b's prefix.
        assert!(matches!(p.enter_arrival("p", arrive(&[9], "r4")), Entered::Now));
        let spilled = picked(&p, &[9], "r4");
        assert!(spilled.slot);
        assert_eq!(spilled.primary(), a);
        // The pool holds max_in_flight plus the overcommitted slots: the next cold prompt waits.
        let cold = tokio::spawn(queued(p.enter_arrival("p", arrive(&[8], "r5"))).wait());
        tokio::task::yield_now().await;
        assert!(!warm.is_finished() && !cold.is_finished());
        // b's first request ends: b's overcommitted slot goes to r3 (b holds its prefix); the
        // cold prompt stays queued (b's slots are for its prefix's requests, a is full).
        p.pick_finished("p", &b, None);
        p.finished("p");
        assert!(warm.await.unwrap().is_ok());
        assert_eq!(picked(&p, &[2, 4], "r3").primary(), b);
        assert!(!cold.is_finished());
        // a's first request ends: the cold prompt takes a's overcommitted slot.
        p.pick_finished("p", &a, None);
        p.finished("p");
        assert!(cold.await.unwrap().is_ok());
        assert_eq!(picked(&p, &[8], "r5").primary(), a);
        // A request of b's prefix waits while b is full, also for a's overcommitted slot (a
        // holds none of it); once a's own slot is free it takes that one (an endpoint with a
        // free slot is never left idle behind requests overcommitted elsewhere).
        let again = tokio::spawn(queued(p.enter_arrival("p", arrive(&[2, 5], "r6"))).wait());
        tokio::task::yield_now().await;
        p.pick_finished("p", &a, None);
        p.finished("p");
        tokio::task::yield_now().await;
        assert!(!again.is_finished());
        p.pick_finished("p", &a, None);
        p.finished("p");
        assert!(again.await.unwrap().is_ok());
        assert_eq!(picked(&p, &[2, 5], "r6").primary(), a);
    }
}
