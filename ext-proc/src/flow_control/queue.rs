//! One pool's flow-control queue, with no I/O and no clock of its own (the caller passes `now`):
//! requests wait by tier (a higher tier is always served first), and within a tier by tenant,
//! the tenant with the least attained service first ([`Fairness`], the virtual token counter).
//!
//! The queue is bounded twice: in requests (`max_queued`) and in the bytes of their bodies, which
//! Envoy holds while they wait (`max_queued_bytes`). Either is shared among the tenants with
//! requests queued by their weights (`flow_control.tenant_weights`, default 1): a tenant's share is
//! the bound times its weight over the weights of the queued tenants and itself. The queue is
//! work-conserving: a tenant alone may fill it; when a request finds no room, it takes the place
//! of the newest request of the lowest tier below its own (that tier's most-served tenant's
//! first), else, if its tenant is within its share with it, of the newest request of its tier of
//! the tenant most over its share; otherwise it is refused and nothing moves. So one tenant can
//! fill the queue only until the others come: it cannot keep another tenant of its tier out, nor
//! hold more of Envoy's memory than the byte bound.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use super::fairness::Fairness;

/// Why a request left the queue without being dispatched, or was not queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// Its predicted wait is over its tier's `max_queue_wait_ms` (refused before queueing).
    PredictedWait,
    /// The queue is full of requests of its tier or higher (refused before queueing), none of
    /// which can give way to it.
    Full,
    /// The bytes of the queued bodies would pass `max_queued_bytes` (refused before queueing),
    /// and no queued request can give way to it.
    Bytes,
    /// A request of a higher tier took its place in a full queue.
    Evicted,
    /// Its tier's `max_queue_wait_ms` ran out.
    Timeout,
    /// The sidecar is shutting down.
    ShuttingDown,
}

impl Refusal {
    /// The `reason` label of `llm_gateway_queue_dequeues_total` (`dispatched` for a dispatch).
    pub fn label(self) -> &'static str {
        match self {
            Refusal::PredictedWait => "predicted_wait",
            Refusal::Full => "full",
            Refusal::Bytes => "bytes",
            Refusal::Evicted => "evicted",
            Refusal::Timeout => "timeout",
            Refusal::ShuttingDown => "shutdown",
        }
    }
}

/// What [`FlowQueue::push`] answers: the new request's id and the requests it evicted, or the
/// refusal with the request handed back.
pub type Pushed<T> = Result<(u64, Vec<Entry<T>>), (Refusal, T)>;

/// A queued request.
#[derive(Debug)]
pub struct Entry<T> {
    /// The queue's id of the request (increasing in arrival order).
    pub id: u64,
    /// Its tier's index (0 is the highest priority).
    pub tier: usize,
    /// Its tenant.
    pub tenant: String,
    /// When it was queued.
    pub enqueued: Instant,
    /// Its prompt tokens (charged to the tenant's counter when it is dispatched).
    pub prompt_tokens: u64,
    /// Its body's bytes (what Envoy holds for it while it waits).
    pub bytes: u64,
    /// Its tenant had nothing queued in its tier when it arrived: it may use the newcomer
    /// reserve (`flow_control.newcomer_reserve`).
    pub newcomer: bool,
    /// What the caller keeps with it (the waiting stream's channel).
    pub item: T,
}

#[derive(Debug)]
struct Tier<T> {
    /// Each backlogged tenant's requests by id (arrival order). A tenant whose last request left
    /// is removed.
    tenants: HashMap<String, BTreeMap<u64, Entry<T>>>,
    len: usize,
}

impl<T> Default for Tier<T> {
    fn default() -> Self {
        Self { tenants: HashMap::new(), len: 0 }
    }
}

/// What one tenant has queued, over every tier.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Held {
    requests: usize,
    bytes: u64,
}

/// The bounds of a pool's queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    /// The most requests queued (`max_queued`).
    pub requests: usize,
    /// The most bytes of queued bodies (`max_queued_bytes`).
    pub bytes: u64,
}

/// The queue of one pool.
#[derive(Debug)]
pub struct FlowQueue<T> {
    tiers: Vec<Tier<T>>,
    /// Where each queued id is: (tier, tenant).
    index: HashMap<u64, (usize, String)>,
    len: usize,
    /// The bytes of the queued bodies.
    bytes: u64,
    /// What each tenant with requests queued holds (tenants are the configured ones: bounded).
    held: HashMap<String, Held>,
    bounds: Bounds,
    next_id: u64,
    fairness: Fairness,
}

impl<T> FlowQueue<T> {
    /// An empty queue of `tiers` tiers holding at most `bounds`.
    pub fn new(tiers: usize, bounds: Bounds, fairness: Fairness) -> Self {
        Self {
            tiers: (0..tiers).map(|_| Tier::default()).collect(),
            index: HashMap::new(),
            len: 0,
            bytes: 0,
            held: HashMap::new(),
            bounds,
            next_id: 0,
            fairness,
        }
    }

    /// The bytes of the queued bodies.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Requests and bytes `tenant` has queued, over every tier.
    pub fn held_by(&self, tenant: &str) -> (usize, u64) {
        self.held.get(tenant).map_or((0, 0), |h| (h.requests, h.bytes))
    }

    /// Requests queued.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no request is queued.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Requests queued in each tier, highest first.
    pub fn tier_lens(&self) -> impl Iterator<Item = usize> + '_ {
        self.tiers.iter().map(|t| t.len)
    }

    /// Requests of `tenant` queued in `tier`.
    pub fn queued_of(&self, tier: usize, tenant: &str) -> usize {
        self.tiers.get(tier).and_then(|t| t.tenants.get(tenant)).map_or(0, BTreeMap::len)
    }

    /// The tenants' counters (for tests and metrics).
    pub fn fairness(&self) -> &Fairness {
        &self.fairness
    }

    /// The tenants' counters, for charging output tokens when a request ends.
    pub fn fairness_mut(&mut self) -> &mut Fairness {
        &mut self.fairness
    }

    /// The share of the pool's dispatches a new request of `tenant` in `tier` can count on: its
    /// weight over the weights of the tenants with requests queued in the tier (itself
    /// included); 0 while a higher tier has requests queued (they go first).
    pub fn share_of(&self, tier: usize, tenant: &str) -> f64 {
        if self.tiers.iter().take(tier).any(|t| t.len > 0) {
            return 0.0;
        }
        let own = self.fairness.weight(tenant);
        let others: f64 = self.tiers.get(tier).map_or(0.0, |t| {
            t.tenants
                .iter()
                .filter(|(name, q)| name.as_str() != tenant && !q.is_empty())
                .map(|(name, _)| self.fairness.weight(name))
                .sum()
        });
        if own > 0.0 {
            own / (own + others)
        } else {
            0.0
        }
    }

    /// How many queued requests are expected to be dispatched before a new request of `tenant`
    /// in `tier`: every request of the higher tiers, the tenant's own, and of each other
    /// backlogged tenant of its tier as many as the fair order lets go first (its queued
    /// requests, at most the newcomer's position scaled by the two tenants' weights). An
    /// estimate: requests of higher tiers that arrive later go first too.
    pub fn ahead(&self, tier: usize, tenant: &str) -> usize {
        let higher: usize = self.tiers.iter().take(tier).map(|t| t.len).sum();
        let Some(t) = self.tiers.get(tier) else { return higher };
        let own = t.tenants.get(tenant).map_or(0, BTreeMap::len);
        let own_weight = self.fairness.weight(tenant);
        let others: usize = t
            .tenants
            .iter()
            .filter(|(name, _)| name.as_str() != tenant)
            .map(|(name, q)| {
                let share = ((own + 1) as f64 * self.fairness.weight(name) / own_weight).ceil();
                q.len().min(share as usize)
            })
            .sum();
        higher + own + others
    }

    /// Queues a request of `bytes` body bytes. When the queue has no room for it (in requests or
    /// bytes), the requests that give way to it (see the module's documentation) are evicted
    /// and returned (their streams are answered 429); when not enough can, the new request is
    /// refused ([`Refusal::Full`], or [`Refusal::Bytes`] when the bytes lack room), handed back,
    /// and nothing is evicted.
    ///
    /// # Errors
    /// The request itself, refused, when there is no room for it.
    pub fn push(
        &mut self,
        tier: usize,
        tenant: &str,
        prompt_tokens: u64,
        bytes: u64,
        now: Instant,
        item: T,
    ) -> Pushed<T> {
        if tier >= self.tiers.len() {
            return Err((Refusal::Full, item));
        }
        let victims = match self.make_room(tier, tenant, bytes) {
            Ok(victims) => victims,
            Err(refusal) => return Err((refusal, item)),
        };
        let evicted: Vec<Entry<T>> =
            victims.into_iter().filter_map(|(tier, tenant, id)| self.take(tier, &tenant, Some(id))).collect();
        let id = self.next_id;
        self.next_id += 1;
        let Some(t) = self.tiers.get_mut(tier) else { return Err((Refusal::Full, item)) };
        let newcomer = !t.tenants.contains_key(tenant);
        if newcomer {
            // The tenant becomes backlogged: its counter is lifted to the least counter of the
            // tier's backlogged tenants (or the last one served), so that idle time is no credit.
            let backlogged = t.tenants.keys().map(String::as_str);
            self.fairness.backlogged(tenant, backlogged);
        }
        let entry = Entry {
            id,
            tier,
            tenant: tenant.to_owned(),
            enqueued: now,
            prompt_tokens,
            bytes,
            newcomer,
            item,
        };
        t.tenants.entry(tenant.to_owned()).or_default().insert(id, entry);
        t.len += 1;
        self.len += 1;
        self.bytes = self.bytes.saturating_add(bytes);
        let held = self.held.entry(tenant.to_owned()).or_default();
        held.requests += 1;
        held.bytes = held.bytes.saturating_add(bytes);
        self.index.insert(id, (tier, tenant.to_owned()));
        Ok((id, evicted))
    }

    /// The requests (tier, tenant, id) to evict so that a request of `tenant` in `tier` with
    /// `bytes` fits: none when it fits now; else the newest of the lowest tier below `tier`
    /// first (that tier's most-served tenant's newest first), then, while `tenant` stays within
    /// its share with the request, the newest in `tier` of the tenant most over its share. The
    /// refusal when they do not make room (nothing is evicted then).
    fn make_room(&self, tier: usize, tenant: &str, bytes: u64) -> Result<Vec<(usize, String, u64)>, Refusal> {
        let fits = |len: usize, queued: u64| {
            len < self.bounds.requests && queued.saturating_add(bytes) <= self.bounds.bytes
        };
        // What lacks room: the requests, else the bytes.
        let refusal = if self.len < self.bounds.requests { Refusal::Bytes } else { Refusal::Full };
        if bytes > self.bounds.bytes {
            return Err(Refusal::Bytes);
        }
        let (mut len, mut queued) = (self.len, self.bytes);
        let mut victims = Vec::new();
        // Lower tiers first, lowest first: each tier's tenants from the most served, newest first.
        for lower in (tier + 1..self.tiers.len()).rev() {
            let Some(t) = self.tiers.get(lower) else { continue };
            let mut tenants: Vec<(&String, &BTreeMap<u64, Entry<T>>)> = t.tenants.iter().collect();
            tenants.sort_by(|(a, _), (b, _)| {
                self.fairness.counter(b).total_cmp(&self.fairness.counter(a)).then(b.cmp(a))
            });
            for (name, q) in tenants {
                for (id, entry) in q.iter().rev() {
                    if fits(len, queued) {
                        return Ok(victims);
                    }
                    victims.push((lower, name.clone(), *id));
                    len -= 1;
                    queued = queued.saturating_sub(entry.bytes);
                }
            }
        }
        if fits(len, queued) {
            return Ok(victims);
        }
        // Then, in its own tier, the tenants most over their shares give way to a tenant within
        // its own: the weights of the tenants queued (the victims' included) and its own.
        let mut held: HashMap<&str, Held> = self.held.iter().map(|(k, h)| (k.as_str(), *h)).collect();
        for (_, name, id) in &victims {
            if let (Some(h), Some(e)) = (held.get_mut(name.as_str()), self.entry(*id)) {
                h.requests -= 1;
                h.bytes = h.bytes.saturating_sub(e.bytes);
            }
        }
        let weights: f64 =
            self.held.keys().filter(|k| k.as_str() != tenant).map(|k| self.fairness.weight(k)).sum::<f64>()
                + self.fairness.weight(tenant);
        let share = |name: &str| {
            let part = self.fairness.weight(name) / weights;
            (self.bounds.requests as f64 * part, self.bounds.bytes as f64 * part)
        };
        let own = held.get(tenant).copied().unwrap_or_default();
        let (own_requests, own_bytes) = share(tenant);
        if (own.requests + 1) as f64 > own_requests.max(1.0)
            || own.bytes.saturating_add(bytes) as f64 > own_bytes
        {
            return Err(refusal);
        }
        let Some(t) = self.tiers.get(tier) else { return Err(refusal) };
        // Each tenant's entries in this tier, newest first, taken in turn from the most over.
        let mut newest: HashMap<&str, Vec<(u64, u64)>> = t
            .tenants
            .iter()
            .filter(|(name, _)| name.as_str() != tenant)
            .map(|(name, q)| (name.as_str(), q.iter().map(|(id, e)| (*id, e.bytes)).collect()))
            .collect();
        while !fits(len, queued) {
            let over = |name: &str, h: &Held| {
                let (requests, bytes) = share(name);
                (h.requests as f64 / requests.max(1.0)).max(h.bytes as f64 / bytes.max(1.0))
            };
            let victim = newest
                .iter()
                .filter(|(_, ids)| !ids.is_empty())
                .filter_map(|(name, _)| held.get(name).map(|h| (*name, over(name, h))))
                .filter(|(_, ratio)| *ratio > 1.0)
                .max_by(|(a, x), (b, y)| x.total_cmp(y).then(b.cmp(a)))
                .map(|(name, _)| name);
            let Some(name) = victim else { return Err(refusal) };
            let Some((id, entry_bytes)) = newest.get_mut(name).and_then(Vec::pop) else {
                return Err(refusal);
            };
            if let Some(h) = held.get_mut(name) {
                h.requests -= 1;
                h.bytes = h.bytes.saturating_sub(entry_bytes);
            }
            victims.push((tier, name.to_owned(), id));
            len -= 1;
            queued = queued.saturating_sub(entry_bytes);
        }
        Ok(victims)
    }

    /// The queued entry `id`.
    fn entry(&self, id: u64) -> Option<&Entry<T>> {
        let (tier, tenant) = self.index.get(&id)?;
        self.tiers.get(*tier)?.tenants.get(tenant)?.get(&id)
    }

    /// Takes the request to dispatch next: from the highest tier with requests, the oldest
    /// request of the backlogged tenant with the least counter (ties, as when a tenant was just
    /// lifted to the least counter: the one with fewer requests queued, then the oldest head),
    /// and charges its prompt tokens to that tenant.
    pub fn pop(&mut self) -> Option<Entry<T>> {
        self.pop_where(|_| true)
    }

    /// What [`FlowQueue::pop`] would take: its tier, and whether it is a newcomer's (it may use
    /// the newcomer reserve).
    pub fn peek(&self) -> Option<(usize, bool)> {
        self.head(|_| true).map(|(tier, _, head)| (tier, head.newcomer))
    }

    /// Takes the next newcomer's request of the highest tier with requests, in the fair order
    /// among the tenants whose oldest request is a newcomer's: the head itself may be held back
    /// by the newcomer reserve while they may use it. Charges its prompt tokens. None without
    /// one.
    pub fn pop_newcomer(&mut self) -> Option<Entry<T>> {
        self.pop_where(|head| head.newcomer)
    }

    /// Takes the oldest request of the tenant [`FlowQueue::head`] picks among those whose oldest
    /// request passes `eligible`, and charges its prompt tokens to that tenant.
    fn pop_where(&mut self, eligible: impl Fn(&Entry<T>) -> bool) -> Option<Entry<T>> {
        let (tier, tenant, _) = self.head(eligible)?;
        let tenant = tenant.to_owned();
        let entry = self.take(tier, &tenant, None)?;
        self.fairness.charge_prompt(&entry.tenant, entry.prompt_tokens);
        Some(entry)
    }

    /// The next request's tier, tenant and the request itself, among the highest tier's tenants
    /// whose oldest request passes `eligible`: the least counter, then fewer queued, then the
    /// oldest head.
    fn head(&self, eligible: impl Fn(&Entry<T>) -> bool) -> Option<(usize, &str, &Entry<T>)> {
        let tier = self.tiers.iter().position(|t| t.len > 0)?;
        let t = self.tiers.get(tier)?;
        t.tenants
            .iter()
            .filter_map(|(name, q)| q.values().next().filter(|e| eligible(e)).map(|e| (name, q.len(), e)))
            .min_by(|(a, a_len, a_head), (b, b_len, b_head)| {
                self.fairness
                    .counter(a)
                    .total_cmp(&self.fairness.counter(b))
                    .then(a_len.cmp(b_len))
                    .then(a_head.id.cmp(&b_head.id))
            })
            .map(|(name, _, head)| (tier, name.as_str(), head))
    }

    /// Lets a new request of `tenant` in `tier` past the queue into the newcomer reserve: when
    /// nothing is queued in a higher tier and nothing of its tenant in its tier (a tenant not
    /// backlogged; the backlogged ones are held below the reserve, so the room it takes is room
    /// they could not use). Its counter is lifted as [`FlowQueue::push`] lifts a newly backlogged
    /// tenant's and charged its prompt tokens, as a dispatch from the queue is; the answer is
    /// true. Otherwise nothing changes. The caller decides whether the pool has room for it.
    pub fn pass_newcomer(&mut self, tier: usize, tenant: &str, prompt_tokens: u64) -> bool {
        if self.tiers.iter().take(tier).any(|t| t.len > 0) {
            return false;
        }
        let Some(t) = self.tiers.get(tier) else { return false };
        if t.tenants.contains_key(tenant) {
            return false;
        }
        self.fairness.backlogged(tenant, t.tenants.keys().map(String::as_str));
        self.fairness.charge_prompt(tenant, prompt_tokens);
        true
    }

    /// Removes a queued request (its stream went away or its wait ran out); None when it is no
    /// longer queued (dispatched or evicted meanwhile).
    pub fn remove(&mut self, id: u64) -> Option<Entry<T>> {
        let (tier, tenant) = self.index.get(&id).cloned()?;
        self.take(tier, &tenant, Some(id))
    }

    /// Empties the queue (the sidecar is shutting down).
    pub fn drain(&mut self) -> Vec<Entry<T>> {
        let mut out = Vec::with_capacity(self.len);
        for t in &mut self.tiers {
            for (_, q) in t.tenants.drain() {
                out.extend(q.into_values());
            }
            t.len = 0;
        }
        self.index.clear();
        self.held.clear();
        self.len = 0;
        self.bytes = 0;
        out
    }

    /// When the oldest queued request was queued.
    pub fn oldest(&self) -> Option<Instant> {
        self.tiers
            .iter()
            .flat_map(|t| t.tenants.values())
            .filter_map(|q| q.values().next())
            .map(|e| e.enqueued)
            .min()
    }

    /// How long the oldest queued request has waited at `now`.
    pub fn oldest_wait(&self, now: Instant) -> Duration {
        self.oldest().map_or(Duration::ZERO, |at| now.saturating_duration_since(at))
    }

    /// Takes request `id` (or the tenant's oldest) out of `tier`.
    fn take(&mut self, tier: usize, tenant: &str, id: Option<u64>) -> Option<Entry<T>> {
        let t = self.tiers.get_mut(tier)?;
        let q = t.tenants.get_mut(tenant)?;
        let entry = match id {
            Some(id) => q.remove(&id)?,
            None => q.pop_first()?.1,
        };
        if q.is_empty() {
            t.tenants.remove(tenant);
            self.fairness.left(tenant);
        }
        t.len -= 1;
        self.len -= 1;
        self.bytes = self.bytes.saturating_sub(entry.bytes);
        if let Some(held) = self.held.get_mut(tenant) {
            held.requests = held.requests.saturating_sub(1);
            held.bytes = held.bytes.saturating_sub(entry.bytes);
            if held.requests == 0 {
                self.held.remove(tenant);
            }
        }
        self.index.remove(&entry.id);
        Some(entry)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn queue(max: usize) -> FlowQueue<&'static str> {
        FlowQueue::new(3, Bounds { requests: max, bytes: u64::MAX }, Fairness::new(BTreeMap::new(), 2.0))
    }

    fn order(q: &mut FlowQueue<&'static str>) -> Vec<&'static str> {
        std::iter::from_fn(|| q.pop().map(|e| e.item)).collect()
    }

    #[test]
    fn a_higher_tier_goes_first() {
        let now = Instant::now();
        let mut q = queue(10);
        q.push(2, "b", 10, 0, now, "batch").unwrap();
        q.push(1, "s", 10, 0, now, "standard").unwrap();
        q.push(0, "p", 10, 0, now, "premium").unwrap();
        q.push(2, "b", 10, 0, now, "batch2").unwrap();
        assert_eq!(order(&mut q), ["premium", "standard", "batch", "batch2"]);
        assert!(q.is_empty());
    }

    #[test]
    fn within_a_tier_the_least_served_tenant_goes_first() {
        let now = Instant::now();
        let mut q = queue(100);
        // Heavy queues 10 before light's one arrives: light waits for at most one of heavy's.
        let heavy: Vec<_> = (0..10).map(|_| q.push(1, "heavy", 100, 0, now, "h").unwrap().0).collect();
        assert_eq!(heavy.len(), 10);
        assert_eq!(q.pop().map(|e| e.item), Some("h"));
        q.push(1, "light", 100, 0, now, "l").unwrap();
        // Light's counter was lifted to heavy's (the least backlogged): equal, and light, with
        // fewer queued, goes first; then heavy (its counter now the lower).
        assert_eq!(q.pop().map(|e| e.item), Some("l"));
        assert_eq!(q.pop().map(|e| e.item), Some("h"));
        assert_eq!(q.len(), 8);
    }

    #[test]
    fn two_backlogged_tenants_share_by_tokens_and_weight() {
        let now = Instant::now();
        let weights = BTreeMap::from([("a".to_owned(), 2.0)]);
        let mut q =
            FlowQueue::new(1, Bounds { requests: 1000, bytes: u64::MAX }, Fairness::new(weights, 2.0));
        for _ in 0..300 {
            q.push(0, "a", 100, 0, now, "a").unwrap();
            q.push(0, "b", 100, 0, now, "b").unwrap();
        }
        let first: Vec<_> = (0..300).filter_map(|_| q.pop().map(|e| e.item)).collect();
        let a = first.iter().filter(|i| **i == "a").count();
        // Weight 2 against 1: two of a's for one of b's.
        assert!((199..=201).contains(&a), "{a}");
    }

    #[test]
    fn output_tokens_count_against_the_tenant() {
        let now = Instant::now();
        let mut q = queue(100);
        for _ in 0..4 {
            q.push(0, "long", 10, 0, now, "long").unwrap();
            q.push(0, "short", 10, 0, now, "short").unwrap();
        }
        assert_eq!(q.pop().map(|e| e.item), Some("long"));
        // The first long answer took 1,000 output tokens (weight 2): short goes until even.
        q.fairness_mut().charge_output("long", 1000);
        assert_eq!(order(&mut q), ["short", "short", "short", "short", "long", "long", "long"]);
    }

    #[test]
    fn a_full_queue_evicts_the_lowest_tier_or_refuses() {
        let now = Instant::now();
        let mut q = queue(2);
        q.push(2, "b", 1, 0, now, "b1").unwrap();
        q.push(2, "b", 1, 0, now, "b2").unwrap();
        let (_, evicted) = q.push(0, "p", 1, 0, now, "p").unwrap();
        assert_eq!(
            evicted.into_iter().map(|e| e.item).collect::<Vec<_>>(),
            ["b2"],
            "the newest of the lowest tier"
        );
        assert_eq!(q.push(2, "b", 1, 0, now, "b3").unwrap_err(), (Refusal::Full, "b3"));
        let (_, evicted) = q.push(1, "s", 1, 0, now, "s").unwrap();
        assert_eq!(evicted.into_iter().map(|e| e.item).collect::<Vec<_>>(), ["b1"]);
        assert_eq!(q.push(1, "s", 1, 0, now, "s2").unwrap_err().0, Refusal::Full, "nothing lower left");
        assert_eq!(q.len(), 2);
    }

    fn items(evicted: Vec<Entry<&'static str>>) -> Vec<&'static str> {
        evicted.into_iter().map(|e| e.item).collect()
    }

    /// One tenant fills the queue alone (it is work-conserving); another of its tier then takes
    /// the hog's newest places, up to its own share, and is served in the fair order; past its
    /// share it is refused, and nothing moves.
    #[test]
    fn one_tenant_cannot_keep_another_of_its_tier_out() {
        let now = Instant::now();
        let mut q = queue(4);
        for _ in 0..4 {
            q.push(1, "hog", 10, 0, now, "h").unwrap();
        }
        assert_eq!(q.push(1, "hog", 10, 0, now, "h5").unwrap_err().0, Refusal::Full);
        // Two tenants queued: a share of 2 each. The victim comes in twice, each time in place
        // of the hog's newest.
        let (_, evicted) = q.push(1, "victim", 10, 0, now, "v1").unwrap();
        assert_eq!(items(evicted), ["h"]);
        let (_, evicted) = q.push(1, "victim", 10, 0, now, "v2").unwrap();
        assert_eq!(items(evicted), ["h"]);
        assert_eq!((q.held_by("hog"), q.held_by("victim")), ((2, 0), (2, 0)));
        // Its third is past its share: refused, the queue as it was.
        assert_eq!(q.push(1, "victim", 10, 0, now, "v3").unwrap_err(), (Refusal::Full, "v3"));
        assert_eq!(q.len(), 4);
        // The fair order serves the victim as soon as the hog.
        assert_eq!(order(&mut q), ["h", "v1", "h", "v2"]);
        // A lower tier's tenant cannot push a higher tier's hog out.
        for _ in 0..4 {
            q.push(0, "hog", 10, 0, now, "p").unwrap();
        }
        assert_eq!(q.push(1, "victim", 10, 0, now, "v").unwrap_err().0, Refusal::Full);
    }

    /// Bodies' bytes are bounded the same way: one tenant fills the byte budget alone, another
    /// takes its share of it back (as many of the hog's newest as its body needs), a body past
    /// the budget is refused whatever is queued, and a tenant past its share is refused
    /// `bytes`, nothing moved.
    #[test]
    fn queued_bodies_are_bounded_in_bytes_per_tenant() {
        let now = Instant::now();
        let mut q: FlowQueue<&'static str> =
            FlowQueue::new(2, Bounds { requests: 100, bytes: 1000 }, Fairness::new(BTreeMap::new(), 2.0));
        for _ in 0..10 {
            q.push(0, "hog", 10, 100, now, "h").unwrap();
        }
        assert_eq!(q.bytes(), 1000);
        assert_eq!(q.push(0, "hog", 10, 1, now, "h").unwrap_err().0, Refusal::Bytes);
        assert_eq!(
            q.push(0, "any", 10, 1001, now, "big").unwrap_err().0,
            Refusal::Bytes,
            "larger than the budget"
        );
        // 250 bytes need three of the hog's 100-byte bodies to go.
        let (_, evicted) = q.push(0, "victim", 10, 250, now, "v").unwrap();
        assert_eq!(items(evicted), ["h", "h", "h"]);
        assert_eq!((q.held_by("hog"), q.held_by("victim"), q.bytes()), ((7, 700), (1, 250), 950));
        // Its share is 500 bytes: 300 more are past it.
        assert_eq!(q.push(0, "victim", 10, 300, now, "v2").unwrap_err(), (Refusal::Bytes, "v2"));
        assert_eq!(q.bytes(), 950);
        // Taking requests out gives their bytes back.
        while q.pop().is_some() {}
        assert_eq!((q.bytes(), q.held_by("hog"), q.held_by("victim")), (0, (0, 0), (0, 0)));
    }

    /// Shares follow the tenants' weights: 3 to 1 of a queue of 8 is 6 and 2.
    #[test]
    fn shares_follow_the_weights() {
        let now = Instant::now();
        let weights = BTreeMap::from([("big".to_owned(), 3.0)]);
        let mut q = FlowQueue::new(1, Bounds { requests: 8, bytes: u64::MAX }, Fairness::new(weights, 2.0));
        for _ in 0..8 {
            q.push(0, "small", 10, 0, now, "s").unwrap();
        }
        for _ in 0..6 {
            q.push(0, "big", 10, 0, now, "b").unwrap();
        }
        assert_eq!(q.push(0, "big", 10, 0, now, "b").unwrap_err().0, Refusal::Full);
        assert_eq!((q.held_by("big").0, q.held_by("small").0), (6, 2));
    }

    #[test]
    fn removed_requests_leave_no_trace() {
        let now = Instant::now();
        let mut q = queue(10);
        let (a, _) = q.push(1, "t", 1, 0, now, "a").unwrap();
        let (b, _) = q.push(1, "t", 1, 0, now, "b").unwrap();
        assert_eq!(q.remove(a).map(|e| e.item), Some("a"));
        assert!(q.remove(a).is_none(), "twice");
        assert_eq!(q.len(), 1);
        assert_eq!(q.pop().map(|e| e.id), Some(b));
        assert!(q.remove(b).is_none(), "dispatched");
        assert!(q.is_empty() && q.oldest().is_none());
    }

    #[test]
    fn the_estimate_of_requests_ahead_follows_the_order() {
        let now = Instant::now();
        let mut q = queue(100);
        q.push(0, "p", 1, 0, now, "p").unwrap();
        for _ in 0..20 {
            q.push(1, "heavy", 1, 0, now, "h").unwrap();
        }
        // A light tenant's request: the premium one, and one of heavy's (fair share).
        assert_eq!(q.ahead(1, "light"), 2);
        // Heavy's next one: everything queued.
        assert_eq!(q.ahead(1, "heavy"), 21);
        assert_eq!(q.ahead(2, "batch"), 21);
        assert_eq!(q.ahead(0, "p2"), 1);
    }

    #[test]
    fn newcomers_pass_the_queue_and_backlogged_tenants_do_not() {
        let now = Instant::now();
        let mut q = queue(100);
        for _ in 0..5 {
            q.push(1, "heavy", 100, 0, now, "h").unwrap();
        }
        assert_eq!(q.pop().map(|e| e.item), Some("h"));
        // Light has nothing queued: it passes, lifted to heavy's counter and charged its prompt.
        assert!(q.pass_newcomer(1, "light", 50));
        assert_eq!(q.fairness().counter("light"), q.fairness().counter("heavy") + 50.0);
        assert_eq!(q.len(), 4, "nothing queued or taken");
        // Heavy has requests queued: its new one waits its turn.
        assert!(!q.pass_newcomer(1, "heavy", 100));
        // A lower tier never passes a higher tier's queue; a higher tier with nothing queued does.
        assert!(!q.pass_newcomer(2, "batch", 1));
        assert!(q.pass_newcomer(0, "premium", 1));
        assert_eq!(q.len(), 4);
        // Light queues now, ahead of heavy's counter: heavy is the head, light the newcomer
        // that may go around it.
        q.push(1, "light", 50, 0, now, "l").unwrap();
        q.push(1, "light", 50, 0, now, "l2").unwrap();
        assert_eq!(q.peek(), Some((1, false)));
        assert_eq!(q.pop_newcomer().map(|e| e.item), Some("l"));
        assert!(q.pop_newcomer().is_none(), "light's second came while its first was queued");
        assert_eq!(q.len(), 5);
    }

    #[test]
    fn drain_empties_every_tier() {
        let now = Instant::now();
        let mut q = queue(10);
        q.push(0, "a", 1, 0, now, "a").unwrap();
        q.push(2, "b", 1, 0, now + Duration::from_secs(1), "b").unwrap();
        assert_eq!(q.oldest_wait(now + Duration::from_secs(3)), Duration::from_secs(3));
        assert_eq!(q.drain().len(), 2);
        assert!(q.is_empty());
        assert_eq!(q.tier_lens().sum::<usize>(), 0);
        assert!(q.pop().is_none());
    }
}
