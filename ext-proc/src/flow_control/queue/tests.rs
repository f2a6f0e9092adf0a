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
    let mut q = FlowQueue::new(1, Bounds { requests: 1000, bytes: u64::MAX }, Fairness::new(weights, 2.0));
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

#[test]
fn pop_matching_takes_a_younger_match_of_the_same_tenant_and_bounds_the_bypass() {
    let mut q = queue(16);
    let now = Instant::now();
    for item in ["a1", "a2", "B3", "a4", "B5", "B6"] {
        q.push(1, "t", 10, 0, now, item).unwrap();
    }
    q.push(1, "u", 100, 0, now, "u1").unwrap();
    let upper = |e: &Entry<&'static str>| e.item.starts_with('B');
    // Fairness picks the tenant first: "u" (counters tie at 0, "u" has fewer queued), whatever
    // matches in "t".
    assert_eq!(q.pop_matching(8, 2, upper).map(|e| e.item), Some("u1"));
    // Within "t": the oldest match, passing over a1 and a2 (each counted once).
    assert_eq!(q.pop_matching(8, 2, upper).map(|e| e.item), Some("B3"));
    assert_eq!(q.pop_matching(8, 2, upper).map(|e| e.item), Some("B5"));
    // a1 was passed over twice: it goes next although B6 matches.
    assert_eq!(q.pop_matching(8, 2, upper).map(|e| e.item), Some("a1"));
    // a2 too (passed over twice); then the match again; then what is left, in order.
    assert_eq!(q.pop_matching(8, 2, upper).map(|e| e.item), Some("a2"));
    assert_eq!(q.pop_matching(8, 2, upper).map(|e| e.item), Some("B6"));
    assert_eq!(q.pop_matching(8, 2, upper).map(|e| e.item), Some("a4"));
    assert!(q.pop_matching(8, 2, upper).is_none());
    assert!(q.is_empty());
}

#[test]
fn pop_only_matching_takes_nothing_without_a_match_and_keeps_the_bypass_bound() {
    let mut q = queue(16);
    let now = Instant::now();
    for item in ["a1", "B2", "a3"] {
        q.push(0, "t", 10, 0, now, item).unwrap();
    }
    let upper = |e: &Entry<&'static str>| e.item.starts_with('B');
    assert_eq!(q.pop_only_matching(8, 1, upper).map(|e| e.item), Some("B2"));
    // Nothing matches: nothing is taken.
    assert!(q.pop_only_matching(8, 8, upper).is_none());
    // a1 was passed over once (the bound here): it holds the slot back from a3's match.
    let a3 = |e: &Entry<&'static str>| e.item == "a3";
    assert!(q.pop_only_matching(8, 1, a3).is_none());
    assert_eq!(q.pop().map(|e| e.item), Some("a1"));
    assert_eq!(q.pop_only_matching(8, 1, a3).map(|e| e.item), Some("a3"));
    assert!(q.is_empty());
}

#[test]
fn pop_matching_scans_no_further_than_asked() {
    let mut q = queue(16);
    let now = Instant::now();
    for item in ["a1", "a2", "B3"] {
        q.push(0, "t", 10, 0, now, item).unwrap();
    }
    let upper = |e: &Entry<&'static str>| e.item.starts_with('B');
    assert_eq!(q.pop_matching(2, 8, upper).map(|e| e.item), Some("a1"));
    assert_eq!(q.pop_matching(2, 8, upper).map(|e| e.item), Some("B3"));
}
