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
    /// Times a younger request of its tenant was dispatched before it by
    /// [`FlowQueue::pop_matching`] (at most its `max_bypass`).
    pub bypassed: u32,
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
            bypassed: 0,
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

    /// The first `scan` requests of the tenant [`FlowQueue::pop`] would serve, oldest first:
    /// those [`FlowQueue::pop_matching`] looks at.
    pub fn head_window(&self, scan: usize) -> impl Iterator<Item = &Entry<T>> + '_ {
        let tenant =
            self.head(|_| true).and_then(|(tier, tenant, _)| self.tiers.get(tier)?.tenants.get(tenant));
        tenant.into_iter().flat_map(|q| q.values()).take(scan.max(1))
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

    /// Takes what [`FlowQueue::pop`] would, or, within the same tenant and tier, the oldest of
    /// that tenant's first `scan` requests that `matches` (in the picker's use: its prompt's
    /// prefix is held by an endpoint with a free slot), so a freed slot goes to a request whose
    /// prefix it holds. Fairness between tenants is untouched (the tenant is the one `pop` would
    /// serve), and no request waits for more than `max_bypass` younger ones of its tenant: every
    /// request passed over counts one, and one passed over `max_bypass` times goes next. Charges
    /// the prompt tokens as `pop` does. None when nothing is queued.
    pub fn pop_matching(
        &mut self,
        scan: usize,
        max_bypass: u32,
        matches: impl FnMut(&Entry<T>) -> bool,
    ) -> Option<Entry<T>> {
        self.pop_matching_or(scan, max_bypass, matches, true)
    }

    /// [`FlowQueue::pop_matching`]'s match only: None when none of the tenant's first `scan`
    /// requests matches (or one passed over `max_bypass` times comes first), so nothing is
    /// taken (in the picker's use: an overcommitted slot, only for a request of its endpoint's
    /// prefix or a prompt no endpoint holds).
    pub fn pop_only_matching(
        &mut self,
        scan: usize,
        max_bypass: u32,
        matches: impl FnMut(&Entry<T>) -> bool,
    ) -> Option<Entry<T>> {
        self.pop_matching_or(scan, max_bypass, matches, false)
    }

    fn pop_matching_or(
        &mut self,
        scan: usize,
        max_bypass: u32,
        mut matches: impl FnMut(&Entry<T>) -> bool,
        or_head: bool,
    ) -> Option<Entry<T>> {
        let (tier, tenant, _) = self.head(|_| true)?;
        let tenant = tenant.to_owned();
        let q = self.tiers.get_mut(tier)?.tenants.get_mut(&tenant)?;
        let mut chosen = None;
        for e in q.values().take(scan.max(1)) {
            if e.bypassed >= max_bypass {
                break;
            }
            if matches(e) {
                chosen = Some(e.id);
                break;
            }
        }
        if let Some(id) = chosen {
            for e in q.range_mut(..id).map(|(_, e)| e) {
                e.bypassed = e.bypassed.saturating_add(1);
            }
        } else if !or_head {
            return None;
        }
        let entry = self.take(tier, &tenant, chosen)?;
        self.fairness.charge_prompt(&entry.tenant, entry.prompt_tokens);
        Some(entry)
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
mod tests;
