//! Engine slots of a flow-controlled pool's endpoints, and the slots its queue promised, with
//! no I/O.
//!
//! A pool with both `picker` and a flow-control queue holds requests in the sidecar once its
//! `max_in_flight` are in flight. Each endpoint then has `ceil(max_in_flight / endpoints)` slots.
//! When one frees, the queue hands it to a queued request whose prompt's prefix that endpoint
//! holds ([`crate::flow_control::queue::FlowQueue::pop_matching`]), and promises the slot to
//! that request: its pick goes to the endpoint ([`Slots::take`]). A slot nobody's prefix matches
//! goes to the queue's next request, promised to the endpoint with the most free slots. So every
//! replica stays exactly full and, while the queue holds a request of a prefix an endpoint
//! holds, that endpoint serves it: what a static split of the prefixes between the replicas
//! gets (each client to its own replica), without clients knowing the replicas.
//!
//! Past its slots, each endpoint has `picker.slot_overcommit` more ([`Slots::spill_free`]) for
//! queued requests whose prefix it holds, and for those whose prompt no endpoint holds on an
//! endpoint that holds no prefix of the next queued requests: they wait in the engine's own
//! queue, which refills a freed engine slot
//! at once, where waiting in the gateway's costs a round trip per slot (on the CPU engine,
//! least-request behind the exact slots made 0.85x the throughput of least-request alone on
//! random prompts). An engine's queue takes its next free slot, so one whose prefixes requests
//! wait for gets none: overcommitted on every endpoint, the picker lost a tenth of its
//! throughput on long shared prefixes there.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

/// Promises whose pick has not come, at most (the oldest are forgotten past it: a stream that
/// went away between its dispatch and its pick).
pub const MAX_PROMISED: usize = 4096;

/// How long a promise holds its slot: a request whose pick has not come by then (its stream
/// ended between its dispatch and its pick, or it was refused there) gives the slot back.
pub const PROMISE_TTL: Duration = Duration::from_secs(2);

/// The slots of one pool's endpoints.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Slots {
    per_endpoint: u64,
    /// Slots past `per_endpoint` for prompts no endpoint holds.
    overcommit: u64,
    /// Endpoint index (config order) promised to each request id, and when.
    promised: HashMap<String, (usize, Instant)>,
    order: VecDeque<String>,
}

impl Slots {
    /// `max_in_flight` shared by `endpoints` endpoints: `ceil(max_in_flight / endpoints)` each
    /// (at least 1), and `overcommit` more each, waiting in the endpoint's own queue.
    pub fn new(max_in_flight: u64, endpoints: usize, overcommit: u64) -> Self {
        let n = u64::try_from(endpoints.max(1)).unwrap_or(u64::MAX);
        Self {
            per_endpoint: max_in_flight.div_ceil(n).max(1),
            overcommit,
            promised: HashMap::new(),
            order: VecDeque::new(),
        }
    }

    /// Slots of each endpoint.
    pub fn per_endpoint(&self) -> u64 {
        self.per_endpoint
    }

    /// Slots past [`Slots::per_endpoint`] of each endpoint, for prompts no endpoint holds.
    pub fn overcommit(&self) -> u64 {
        self.overcommit
    }

    /// Free slots of each endpoint at `now`: its slots less its `in_flight` and its promises
    /// younger than [`PROMISE_TTL`]; 0 for one not `eligible`.
    pub fn free(&self, in_flight: &[u64], eligible: &[bool], now: Instant) -> Vec<u64> {
        self.free_of(self.per_endpoint, in_flight, eligible, now)
    }

    /// [`Slots::free`] counting the overcommitted slots too: what a queued request may take on
    /// the endpoint holding its prefix, or, holding none, on one no queued request waits for.
    pub fn spill_free(&self, in_flight: &[u64], eligible: &[bool], now: Instant) -> Vec<u64> {
        self.free_of(self.per_endpoint.saturating_add(self.overcommit), in_flight, eligible, now)
    }

    fn free_of(&self, slots: u64, in_flight: &[u64], eligible: &[bool], now: Instant) -> Vec<u64> {
        let mut free: Vec<u64> = in_flight
            .iter()
            .zip(eligible)
            .map(|(n, ok)| if *ok { slots.saturating_sub(*n) } else { 0 })
            .collect();
        for &(i, at) in self.promised.values() {
            if now.saturating_duration_since(at) >= PROMISE_TTL {
                continue;
            }
            if let Some(f) = free.get_mut(i) {
                *f = f.saturating_sub(1);
            }
        }
        free
    }

    /// Promises endpoint `index` to request `request_id` at `now` (an empty id promises
    /// nothing), forgetting the promises past [`PROMISE_TTL`].
    pub fn promise(&mut self, request_id: &str, index: usize, now: Instant) {
        if request_id.is_empty() {
            return;
        }
        while let Some(old) = self.order.front() {
            let expired = self
                .promised
                .get(old)
                .is_none_or(|(_, at)| now.saturating_duration_since(*at) >= PROMISE_TTL);
            if !expired {
                break;
            }
            if let Some(old) = self.order.pop_front() {
                self.promised.remove(&old);
            }
        }
        if self.promised.insert(request_id.to_owned(), (index, now)).is_none() {
            self.order.push_back(request_id.to_owned());
        }
        while self.order.len() > MAX_PROMISED {
            if let Some(old) = self.order.pop_front() {
                self.promised.remove(&old);
            }
        }
    }

    /// The endpoint promised to `request_id`, taken (its pick has come, or its dispatch failed),
    /// whatever its age.
    pub fn take(&mut self, request_id: &str) -> Option<usize> {
        let (index, _) = self.promised.remove(request_id)?;
        if let Some(at) = self.order.iter().position(|id| id == request_id) {
            self.order.remove(at);
        }
        Some(index)
    }
}

/// The endpoint with the most free slots (the first on ties), None when none has one.
pub fn most_free(free: &[u64]) -> Option<usize> {
    let (i, n) = free.iter().enumerate().max_by(|(a, x), (b, y)| x.cmp(y).then(b.cmp(a)))?;
    (*n > 0).then_some(i)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_the_pools_share_and_promises_take_them() {
        let now = Instant::now();
        let mut s = Slots::new(8, 3, 1);
        assert_eq!((s.per_endpoint(), s.overcommit()), (3, 1));
        assert_eq!(s.free(&[1, 3, 0], &[true, true, false], now), vec![2, 0, 0]);
        assert_eq!(s.spill_free(&[1, 3, 4], &[true, true, true], now), vec![3, 1, 0]);
        s.promise("r1", 0, now);
        s.promise("r2", 0, now);
        s.promise("", 0, now);
        assert_eq!(s.free(&[1, 3, 0], &[true, true, true], now), vec![0, 0, 3]);
        assert_eq!(s.take("r1"), Some(0));
        assert_eq!(s.take("r1"), None);
        assert_eq!(s.free(&[1, 3, 0], &[true, true, true], now), vec![1, 0, 3]);
        // A promise whose pick never came gives its slot back after PROMISE_TTL.
        let later = now + PROMISE_TTL;
        assert_eq!(s.free(&[1, 3, 0], &[true, true, true], later), vec![2, 0, 3]);
        s.promise("r3", 2, later);
        assert_eq!(s.take("r2"), None);
        assert_eq!(s.take("r3"), Some(2));
    }

    #[test]
    fn promises_are_bounded() {
        let now = Instant::now();
        let mut s = Slots::new(4, 1, 0);
        for i in 0..=MAX_PROMISED {
            s.promise(&format!("r{i}"), 0, now);
        }
        assert_eq!(s.take("r0"), None);
        assert_eq!(s.take(&format!("r{MAX_PROMISED}")), Some(0));
    }

    #[test]
    fn most_free_prefers_the_emptiest_then_the_first() {
        assert_eq!(most_free(&[1, 3, 3]), Some(1));
        assert_eq!(most_free(&[0, 0]), None);
        assert_eq!(most_free(&[]), None);
    }
}
