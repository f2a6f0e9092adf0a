//! One pool's flow-control queue, with no I/O and no clock of its own (the caller passes `now`):
//! requests wait by tier (a higher tier is always served first), and within a tier by tenant,
//! the tenant with the least attained service first ([`Fairness`], the virtual token counter).
//! The queue is bounded (`max_queued`): when full, a request of a higher tier takes the place of
//! the newest request of the lowest tier queued (from its most-served tenant); otherwise it is
//! refused.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use super::fairness::Fairness;

/// Why a request left the queue without being dispatched, or was not queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// Its predicted wait is over its tier's `max_queue_wait_ms` (refused before queueing).
    PredictedWait,
    /// The queue is full of requests of its tier or higher (refused before queueing).
    Full,
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
            Refusal::Evicted => "evicted",
            Refusal::Timeout => "timeout",
            Refusal::ShuttingDown => "shutdown",
        }
    }
}

/// What [`FlowQueue::push`] answers: the new request's id and the request it evicted, or the
/// refusal with the request handed back.
pub type Pushed<T> = Result<(u64, Option<Entry<T>>), (Refusal, T)>;

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

/// The queue of one pool.
#[derive(Debug)]
pub struct FlowQueue<T> {
    tiers: Vec<Tier<T>>,
    /// Where each queued id is: (tier, tenant).
    index: HashMap<u64, (usize, String)>,
    len: usize,
    max_queued: usize,
    next_id: u64,
    fairness: Fairness,
}

impl<T> FlowQueue<T> {
    /// An empty queue of `tiers` tiers holding at most `max_queued` requests.
    pub fn new(tiers: usize, max_queued: usize, fairness: Fairness) -> Self {
        Self {
            tiers: (0..tiers).map(|_| Tier::default()).collect(),
            index: HashMap::new(),
            len: 0,
            max_queued,
            next_id: 0,
            fairness,
        }
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

    /// Queues a request. When the queue is full, a request of a lower tier is evicted and
    /// returned (its stream is answered 429); with none, the new request is refused
    /// ([`Refusal::Full`]) and handed back.
    ///
    /// # Errors
    /// The request itself, refused, when there is no room for it.
    pub fn push(
        &mut self,
        tier: usize,
        tenant: &str,
        prompt_tokens: u64,
        now: Instant,
        item: T,
    ) -> Pushed<T> {
        if tier >= self.tiers.len() {
            return Err((Refusal::Full, item));
        }
        let mut evicted = None;
        if self.len >= self.max_queued {
            match self.evict_below(tier) {
                Some(e) => evicted = Some(e),
                None => return Err((Refusal::Full, item)),
            }
        }
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
        let entry =
            Entry { id, tier, tenant: tenant.to_owned(), enqueued: now, prompt_tokens, newcomer, item };
        t.tenants.entry(tenant.to_owned()).or_default().insert(id, entry);
        t.len += 1;
        self.len += 1;
        self.index.insert(id, (tier, tenant.to_owned()));
        Ok((id, evicted))
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
        self.len = 0;
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

    /// Evicts the newest request of the lowest tier below `tier` that has requests, from its
    /// most-served tenant.
    fn evict_below(&mut self, tier: usize) -> Option<Entry<T>> {
        let lowest = self.tiers.iter().rposition(|t| t.len > 0).filter(|&l| l > tier)?;
        let t = self.tiers.get(lowest)?;
        let (tenant, id) = t
            .tenants
            .iter()
            .filter_map(|(name, q)| q.keys().next_back().map(|id| (name, *id)))
            .max_by(|(a, a_id), (b, b_id)| {
                self.fairness.counter(a).total_cmp(&self.fairness.counter(b)).then(a_id.cmp(b_id))
            })
            .map(|(name, id)| (name.clone(), id))?;
        self.take(lowest, &tenant, Some(id))
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
        self.index.remove(&entry.id);
        Some(entry)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn queue(max: usize) -> FlowQueue<&'static str> {
        FlowQueue::new(3, max, Fairness::new(BTreeMap::new(), 2.0))
    }

    fn order(q: &mut FlowQueue<&'static str>) -> Vec<&'static str> {
        std::iter::from_fn(|| q.pop().map(|e| e.item)).collect()
    }

    #[test]
    fn a_higher_tier_goes_first() {
        let now = Instant::now();
        let mut q = queue(10);
        q.push(2, "b", 10, now, "batch").unwrap();
        q.push(1, "s", 10, now, "standard").unwrap();
        q.push(0, "p", 10, now, "premium").unwrap();
        q.push(2, "b", 10, now, "batch2").unwrap();
        assert_eq!(order(&mut q), ["premium", "standard", "batch", "batch2"]);
        assert!(q.is_empty());
    }

    #[test]
    fn within_a_tier_the_least_served_tenant_goes_first() {
        let now = Instant::now();
        let mut q = queue(100);
        // Heavy queues 10 before light's one arrives: light waits for at most one of heavy's.
        let heavy: Vec<_> = (0..10).map(|_| q.push(1, "heavy", 100, now, "h").unwrap().0).collect();
        assert_eq!(heavy.len(), 10);
        assert_eq!(q.pop().map(|e| e.item), Some("h"));
        q.push(1, "light", 100, now, "l").unwrap();
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
        let mut q = FlowQueue::new(1, 1000, Fairness::new(weights, 2.0));
        for _ in 0..300 {
            q.push(0, "a", 100, now, "a").unwrap();
            q.push(0, "b", 100, now, "b").unwrap();
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
            q.push(0, "long", 10, now, "long").unwrap();
            q.push(0, "short", 10, now, "short").unwrap();
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
        q.push(2, "b", 1, now, "b1").unwrap();
        q.push(2, "b", 1, now, "b2").unwrap();
        let (_, evicted) = q.push(0, "p", 1, now, "p").unwrap();
        assert_eq!(evicted.map(|e| e.item), Some("b2"), "the newest of the lowest tier");
        assert_eq!(q.push(2, "b", 1, now, "b3").unwrap_err(), (Refusal::Full, "b3"));
        let (_, evicted) = q.push(1, "s", 1, now, "s").unwrap();
        assert_eq!(evicted.map(|e| e.item), Some("b1"));
        assert_eq!(q.push(1, "s", 1, now, "s2").unwrap_err().0, Refusal::Full, "nothing lower left");
        assert_eq!(q.len(), 2);
    }

    #[test]
    fn removed_requests_leave_no_trace() {
        let now = Instant::now();
        let mut q = queue(10);
        let (a, _) = q.push(1, "t", 1, now, "a").unwrap();
        let (b, _) = q.push(1, "t", 1, now, "b").unwrap();
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
        q.push(0, "p", 1, now, "p").unwrap();
        for _ in 0..20 {
            q.push(1, "heavy", 1, now, "h").unwrap();
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
            q.push(1, "heavy", 100, now, "h").unwrap();
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
        q.push(1, "light", 50, now, "l").unwrap();
        q.push(1, "light", 50, now, "l2").unwrap();
        assert_eq!(q.peek(), Some((1, false)));
        assert_eq!(q.pop_newcomer().map(|e| e.item), Some("l"));
        assert!(q.pop_newcomer().is_none(), "light's second came while its first was queued");
        assert_eq!(q.len(), 5);
    }

    #[test]
    fn drain_empties_every_tier() {
        let now = Instant::now();
        let mut q = queue(10);
        q.push(0, "a", 1, now, "a").unwrap();
        q.push(2, "b", 1, now + Duration::from_secs(1), "b").unwrap();
        assert_eq!(q.oldest_wait(now + Duration::from_secs(3)), Duration::from_secs(3));
        assert_eq!(q.drain().len(), 2);
        assert!(q.is_empty());
        assert_eq!(q.tier_lens().sum::<usize>(), 0);
        assert!(q.pop().is_none());
    }
}
