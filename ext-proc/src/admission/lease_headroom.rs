//! How many requests the filter's admission leases may admit to a pool the sidecar sheds or
//! queues by its load, with no I/O.
//!
//! A request admitted from a lease never reaches the sidecar: it is not shed one by one, and the
//! pool's in-flight count sees it only with the filter's next report (a `refresh_ms` tick). A
//! lease for such a pool ([`crate::config::pools::PoolConfig::load_protected`]) therefore covers at
//! most half ([`lease_share`]) of what is left of this replica's part ([`replica_share`]) of
//! the pool's [`headroom`] (the requests it takes before its load reaches the level at which
//! the ext_proc admission would start shedding, or flow control's `leases_below_load`) once
//! this replica's other live leases of the pool are taken off ([`LeasedRequests::outstanding`]).
//! Each admitted request then counts in the pool's in-flight count from the filter's report on,
//! and leaves the lease's outstanding requests at the same call, so the sum of the two never
//! passes the level. The ext_proc admission's shedding and flow control's room rule count the
//! outstanding requests as in flight too (`crate::pools::Pools::check`, `has_room`): a leased
//! slot is taken when it is granted, whether or not the lease uses it before its TTL. A pool without
//! headroom, or whose signals bound nothing yet (never scraped; limited by KV alone and idle),
//! gets no lease (outcome `headroom`): its requests go through the ext_proc admission, which
//! sheds (or queues) them one by one.
//!
//! With several sidecar replicas sharing a pool, each leases only its equal part of the
//! headroom ([`replica_share`]; the replicas are counted from the pool's in-flight hash in
//! Redis, each flush), so that their leases together stay within it; an exact admission at one
//! replica sees another's leased requests once they are reported (a tick), not before. A pool
//! limited only by `max_kv_cache_usage` is leased only while requests run (the KV cache per
//! running request is what converts KV headroom into requests).

use std::collections::{HashMap, VecDeque};
use std::time::Instant;

use crate::config::pools::PoolConfig;
use crate::pools::room::SinceScrape;
use crate::pools::signals::PoolSignals;

/// The requests `pool` takes before its load reaches `level` (the lowest tier's shedding
/// level, or flow control's `leases_below_load`): the least over its configured limits of
/// - `max_in_flight`: `level × max_in_flight − in_flight`;
/// - `max_queue_depth`: `level × max_queue_depth − (waiting + dispatched − finished)`, vLLM's
///   `vllm:num_requests_waiting` at the last scrape plus this sidecar's dispatches since it,
///   less the ends it saw since (flow control's estimate, [`crate::flow_control::drain`]): every
///   request admitted since the scrape is counted as waiting;
/// - `max_kv_cache_usage`: `(level × max_kv_cache_usage − kv_cache_usage) / (kv_cache_usage /
///   running)` less the dispatches since the scrape: the KV cache a running request holds at the
///   last scrape, only while requests run and hold some;
///
/// each rounded up to whole requests where a fraction is left (a request is shed only once the
/// load reaches the level), and 0 at or past it. `None` when no limit bounds it now (none
/// configured, or their signals unknown: never scraped, or an idle pool limited by KV alone).
pub fn headroom(pool: &PoolConfig, s: &PoolSignals, since: SinceScrape, level: f64) -> Option<u64> {
    let pending = since.dispatched as f64 - since.finished as f64;
    let in_flight = pool.max_in_flight.map(|max| (level * max as f64 - s.in_flight as f64).ceil());
    let queue = (pool.max_queue_depth.zip(s.waiting))
        .map(|(max, waiting)| (level * max as f64 - (waiting + pending).max(0.0)).ceil());
    let kv = match (pool.max_kv_cache_usage, s.kv_cache_usage, s.running) {
        (Some(max), Some(kv), Some(running)) if kv > 0.0 && running >= 1.0 => {
            Some(((level * max - kv) / (kv / running)).floor() - pending.max(0.0))
        }
        _ => None,
    };
    [in_flight, queue, kv].into_iter().flatten().map(whole).min()
}

/// `requests` as whole requests: 0 when not above 0 (or not finite).
fn whole(requests: f64) -> u64 {
    if requests.is_finite() && requests > 0.0 {
        requests as u64
    } else {
        0
    }
}

/// This replica's share of `room` requests of headroom, with `replicas` sidecar replicas
/// sharing the pool (those that flushed its in-flight counts within the report lag,
/// `lua/in_flight_flush_v1.lua`): an equal part, rounded down, so that the leases of every
/// replica together stay within the headroom.
pub fn replica_share(room: u64, replicas: u64) -> u64 {
    room / replicas.max(1)
}

/// The most requests one lease takes of `free` requests of headroom: half of them, rounded up
/// (one of one), so that the workers asking next and the ext_proc admission find the rest.
pub fn lease_share(free: u64) -> u64 {
    free.div_ceil(2)
}

/// What one grant of a lease may still admit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Grant {
    /// After this, the lease admits no more (its TTL and half of it again: the filter starts
    /// its TTL when the grant arrives, and gives the rest back on its next tick).
    until: Instant,
    /// Requests it may still admit.
    left: u64,
}

/// The requests this replica's live admission leases of one load-protected pool may still
/// admit: per (tenant, model), the grants in order. A call for (tenant, model) counts the
/// requests it reports admitted and the requests it gives back against the oldest grants of
/// the key first: each Envoy worker holds at most one lease per key, so the key's total is
/// exact whichever worker's lease admitted them, and a grant whose give-back went to another
/// replica (or never came) is forgotten at its `until`.
#[derive(Debug, Default)]
pub struct LeasedRequests {
    keys: HashMap<(String, String), VecDeque<Grant>>,
}

impl LeasedRequests {
    /// Nothing leased.
    pub fn new() -> Self {
        Self::default()
    }

    /// A lease of `requests` requests of (`tenant`, `model`) was granted (or is being taken:
    /// [`LeasedRequests::used`] takes it back when it is not); it admits until `until` at the
    /// latest.
    pub fn granted(&mut self, tenant: &str, model: &str, requests: u64, until: Instant) {
        if requests == 0 {
            return;
        }
        self.keys
            .entry((tenant.to_owned(), model.to_owned()))
            .or_default()
            .push_back(Grant { until, left: requests });
    }

    /// `requests` requests of (`tenant`, `model`)'s leases were admitted (they count in the
    /// pool's in-flight count from now on) or given back: taken off its oldest grants.
    pub fn used(&mut self, tenant: &str, model: &str, requests: u64) {
        let key = (tenant.to_owned(), model.to_owned());
        let Some(grants) = self.keys.get_mut(&key) else { return };
        let mut rest = requests;
        while rest > 0 {
            let Some(first) = grants.front_mut() else { break };
            let take = first.left.min(rest);
            first.left -= take;
            rest -= take;
            if first.left == 0 {
                grants.pop_front();
            }
        }
        if grants.is_empty() {
            self.keys.remove(&key);
        }
    }

    /// What the live leases may still admit at `now`; grants past their `until` are forgotten.
    pub fn outstanding(&mut self, now: Instant) -> u64 {
        self.keys.retain(|_, grants| {
            grants.retain(|g| now < g.until);
            !grants.is_empty()
        });
        self.keys.values().flatten().map(|g| g.left).fold(0, u64::saturating_add)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn pool(yaml: &str) -> PoolConfig {
        serde_yaml_ng::from_str(&format!("{{name: p, {yaml}}}")).unwrap()
    }

    fn signals(in_flight: u64, waiting: Option<f64>, running: Option<f64>, kv: Option<f64>) -> PoolSignals {
        PoolSignals { in_flight, waiting, running, kv_cache_usage: kv, drain_per_s: None }
    }

    #[test]
    fn headroom_is_the_least_room_before_the_level_over_the_limits() {
        let p = pool("max_in_flight: 8");
        let idle = SinceScrape::default();
        assert_eq!(headroom(&p, &signals(0, None, None, None), idle, 1.0), Some(8));
        assert_eq!(headroom(&p, &signals(5, None, None, None), idle, 1.0), Some(3));
        assert_eq!(headroom(&p, &signals(8, None, None, None), idle, 1.0), Some(0));
        assert_eq!(headroom(&p, &signals(12, None, None, None), idle, 1.0), Some(0), "past it");
        // Shed at 0.5: 4 of 8; a fraction left still admits one (load 0.4 < 0.45).
        assert_eq!(headroom(&p, &signals(2, None, None, None), idle, 0.5), Some(2));
        assert_eq!(headroom(&p, &signals(3, None, None, None), idle, 0.45), Some(1));

        let q = pool("max_queue_depth: 10, max_in_flight: 100");
        let s = signals(0, Some(4.0), Some(8.0), None);
        assert_eq!(headroom(&q, &s, idle, 1.0), Some(6));
        let since = SinceScrape { dispatched: 5, finished: 2 };
        assert_eq!(headroom(&q, &s, since, 1.0), Some(3), "dispatches since the scrape count as waiting");
        let ended = SinceScrape { dispatched: 0, finished: 9 };
        assert_eq!(headroom(&q, &s, ended, 1.0), Some(10), "never below an empty queue");
        assert_eq!(
            headroom(&q, &signals(98, Some(0.0), None, None), idle, 1.0),
            Some(2),
            "in flight is tighter"
        );
        assert_eq!(headroom(&q, &signals(0, None, None, None), idle, 1.0), Some(100), "queue never scraped");
    }

    #[test]
    fn kv_headroom_is_counted_in_the_cache_a_running_request_holds() {
        let p = pool("max_kv_cache_usage: 0.9");
        let idle = SinceScrape::default();
        // 4 running hold 0.4: 0.1 each; 0.9 - 0.4 leaves 5.
        assert_eq!(headroom(&p, &signals(0, None, Some(4.0), Some(0.4)), idle, 1.0), Some(5));
        let since = SinceScrape { dispatched: 3, finished: 0 };
        assert_eq!(headroom(&p, &signals(0, None, Some(4.0), Some(0.4)), since, 1.0), Some(2));
        assert_eq!(headroom(&p, &signals(0, None, Some(4.0), Some(0.95)), idle, 1.0), Some(0));
        assert_eq!(headroom(&p, &signals(0, None, Some(0.0), Some(0.0)), idle, 1.0), None, "idle: unknown");
        assert_eq!(headroom(&p, &signals(0, None, None, None), idle, 1.0), None, "never scraped");
        assert_eq!(headroom(&pool("endpoints: []"), &signals(3, Some(3.0), None, None), idle, 1.0), None);
    }

    #[test]
    fn leased_requests_count_grants_until_used_given_back_or_past() {
        let t0 = Instant::now();
        let ttl = Duration::from_secs(1);
        let mut l = LeasedRequests::new();
        l.granted("a", "m", 4, t0 + ttl);
        l.granted("a", "m", 4, t0 + ttl * 2);
        l.granted("b", "m", 3, t0 + ttl);
        assert_eq!(l.outstanding(t0), 11);
        // Two workers' leases of one key: five admitted through either come off the oldest first.
        l.used("a", "m", 5);
        assert_eq!(l.outstanding(t0), 6);
        // The first grant is gone; the second's rest (3) outlives the first's `until`.
        assert_eq!(l.outstanding(t0 + ttl), 3);
        l.used("a", "m", 10);
        assert_eq!(l.outstanding(t0 + ttl), 0, "given back, and never below 0");
        l.used("nobody", "m", 1);
        l.granted("a", "m", 0, t0 + ttl);
        assert_eq!(l.outstanding(t0), 0, "nothing granted, nothing counted");
        assert!(l.keys.is_empty(), "emptied keys are forgotten");
    }

    #[test]
    fn replicas_share_the_headroom_equally() {
        assert_eq!(replica_share(8, 1), 8);
        assert_eq!(replica_share(8, 2), 4);
        assert_eq!(replica_share(8, 3), 2, "rounded down: together within the headroom");
        assert_eq!(replica_share(2, 3), 0);
        assert_eq!(replica_share(8, 0), 8, "no count yet: this replica alone");
    }

    #[test]
    fn a_lease_takes_half_of_the_headroom_left() {
        assert_eq!(lease_share(8), 4);
        assert_eq!(lease_share(5), 3);
        assert_eq!(lease_share(3), 2);
        assert_eq!(lease_share(2), 1);
        assert_eq!(lease_share(1), 1, "a lease of one request is made on a tick, off the request's path");
        assert_eq!(lease_share(0), 0);
    }
}
