//! What a sidecar admits from its in-memory buckets while Redis is away is charged to Redis when
//! it answers again (issue 14, item 4), against a real `redis-server` that is killed and started
//! again empty, as a Redis Cluster node that crashed comes back: the bucket's level Redis last
//! answered is restored (an empty bucket would read as full and hand out a fresh burst) and every
//! local admission is charged once.
//!
//! Needs `redis-server` on the PATH (`make setup`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

mod common;

use common::{free_port, Redis};

use gateway_ext_proc::admission::limiter::{Limiter, Take};
use gateway_ext_proc::admission::limits::{self, BucketKind};
use gateway_ext_proc::admission::local_limiter::Hint;
use gateway_ext_proc::config::redis::FailureMode;
use gateway_ext_proc::config::Config;
use gateway_ext_proc::metrics::Metrics;
use gateway_ext_proc::store::Store;

/// Burst 10 requests and 10,000 tokens, refilled 1 a minute (nothing hides a missed charge).
fn config(port: u16) -> Config {
    Config::from_yaml(&format!(
        "listen: 127.0.0.1:0
redis: {{url: 'redis://127.0.0.1:{port}', local_share: 1, command_timeout_ms: 200, breaker: {{failure_threshold: 1000}}}}
tenants:
  - {{id: acme, limits: {{requests_per_minute: 1, request_burst: 10, tokens_per_minute: 1, token_burst: 10000}}}}
"
    ))
    .unwrap()
}

/// A sidecar's hint: `level` answered (plus the refill since) `age_ms` ago.
fn hint(level: u64, age_ms: u64) -> Option<Hint> {
    Some(Hint { level, age_ms })
}

/// A redis-server on a free port, a store on it, and acme's buckets for model `m`.
async fn store_on_redis() -> (Redis, Store, Vec<limits::BucketSpec>) {
    let port = free_port();
    let config = config(port);
    let redis = Redis::start_on(port);
    let store = Store::connect(&config.redis, "usage".into(), 1000).await.unwrap();
    let plan = limits::plan(store.prefix(), config.tenant("acme").unwrap(), "m", 100);
    (redis, store, plan)
}

fn requests_bucket(plan: &[limits::BucketSpec]) -> &limits::BucketSpec {
    plan.iter().find(|b| b.kind == BucketKind::Requests).unwrap()
}

fn remaining(take: &Take, plan: &[limits::BucketSpec], kind: BucketKind) -> u64 {
    let outcome = match take {
        Take::Redis(o) | Take::Local(o) => o,
        Take::Unavailable => panic!("open failure mode"),
    };
    assert_eq!(outcome.denied, None, "{outcome:?}");
    let i = plan.iter().position(|b| b.kind == kind).unwrap();
    outcome.states[i].remaining
}

#[tokio::test]
async fn local_admissions_are_charged_to_a_redis_that_came_back_empty() {
    let port = free_port();
    let config = config(port);
    let redis = Redis::start_on(port);
    let store = Store::connect(&config.redis, "usage".into(), 1000).await.unwrap();
    let limiter = Limiter::new(store, &config.redis, Metrics::new());
    let tenant = config.tenant("acme").unwrap();
    let plan = limits::plan(limiter.store().prefix(), tenant, "m", 100);

    // Redis decides the first one: 9 requests and 9,900 tokens left.
    let first = limiter.take(&plan, FailureMode::Open, None, None).await.0;
    assert!(matches!(first, Take::Redis(_)), "{first:?}");
    assert_eq!(remaining(&first, &plan, BucketKind::Requests), 9);

    // Redis crashes: three admissions from the local buckets (which start at Redis's last answer).
    drop(redis);
    for left in [8, 7, 6] {
        let take = limiter.take(&plan, FailureMode::Open, None, None).await.0;
        assert!(matches!(take, Take::Local(_)), "{take:?}");
        assert_eq!(remaining(&take, &plan, BucketKind::Requests), left);
    }
    // One of them ended while Redis was away and gave 60 of its 100 reserved tokens back.
    let tokens_bucket = plan.iter().find(|b| b.kind == BucketKind::Tokens).unwrap().clone();
    limiter.settle(&tokens_bucket, 60, true).await;

    // Redis comes back empty. Until the sidecar's connection is back, takes stay local (and owed).
    let _redis = Redis::start_on(port);
    let mut local_after = 0;
    let back = loop {
        let take = limiter.take(&plan, FailureMode::Open, None, None).await.0;
        match take {
            Take::Redis(_) => break take,
            Take::Local(_) => local_after += 1,
            Take::Unavailable => panic!("open failure mode"),
        }
        assert!(local_after < 100, "Redis never answered again");
    };
    // Without the reconciliation the empty bucket would answer 9 and 9,900 (a fresh burst).
    assert_eq!(remaining(&back, &plan, BucketKind::Requests), 9 - 3 - local_after - 1);
    assert_eq!(remaining(&back, &plan, BucketKind::Tokens), 9_900 - 300 + 60 - 100 * local_after - 100);

    // Settled once: a later take sees only its own cost.
    let next = limiter.take(&plan, FailureMode::Open, None, None).await.0;
    assert!(matches!(next, Take::Redis(_)), "{next:?}");
    assert_eq!(remaining(&next, &plan, BucketKind::Requests), 9 - 3 - local_after - 2);
}

#[tokio::test]
async fn a_bucket_that_survived_is_charged_the_debt_only() {
    let (_redis, store, plan) = store_on_redis().await;
    let requests = requests_bucket(&plan);
    // Level 4 in Redis (other sidecars took 6); this sidecar last saw 9: Redis's level stands.
    store.reconcile(requests, 6, None).await.unwrap();
    assert_eq!(store.reconcile(requests, 2, hint(9, 0)).await.unwrap(), 2);
    // A hint below Redis's level lowers it (a node that came back empty reads full).
    assert_eq!(store.reconcile(requests, 0, hint(1, 0)).await.unwrap(), 1);
    // A debt may take the level below zero: the next requests wait for it.
    assert_eq!(store.reconcile(requests, 3, None).await.unwrap(), -2);
    // Given back: never above the capacity.
    assert_eq!(store.reconcile(requests, -100, None).await.unwrap(), 10);
}

#[tokio::test]
async fn two_sidecars_rebuild_a_lost_bucket_from_the_outage_refill() {
    let (_redis, store, plan) = store_on_redis().await;
    let requests = requests_bucket(&plan);
    // The bucket was at 0 when its node died; 35 requests refilled during the outage (above the
    // capacity of 10: the local buckets admitted them as they came), 17 admitted by one sidecar
    // and 18 by the other. One bucket over the whole span would be at 0 now.
    // Both last heard from Redis before the outage (35 minutes at 1 a minute).
    let outage_ms = 35 * 60_000;
    assert_eq!(
        store.reconcile(requests, 17, hint(35, outage_ms)).await.unwrap(),
        10,
        "18 left, capped at 10"
    );
    assert_eq!(
        store.reconcile(requests, 18, hint(35, outage_ms)).await.unwrap(),
        0,
        "the cut 8 counted, not lost"
    );
    // Without the first one's excess the second would have left it at -8 (refusing 8 the limit
    // allows); with min(capacity, hint) for a lost bucket, at -25.
}

/// A partial outage: sidecar A's Redis calls time out now and then while sidecar B keeps taking
/// from the same bucket in Redis. A's debt is charged against what B left; nothing A saw earlier
/// (its hint) nor what an earlier reconciliation cut at capacity may refill the bucket.
#[tokio::test]
async fn a_partial_outage_charges_the_debt_against_what_the_other_sidecar_left() {
    let (_redis, store, plan) = store_on_redis().await;
    let requests = requests_bucket(&plan);
    let level = |o: &limits::TakeOutcome| {
        o.states[plan.iter().position(|b| b.kind == BucketKind::Requests).unwrap()].remaining
    };

    // Earlier, B came back from a timeout after the bucket had sat idle long enough to expire: its
    // hint (9 seen 5 minutes ago, + 5 refilled) rebuilt it, 3 above the capacity cut.
    assert_eq!(store.reconcile(requests, 1, hint(14, 5 * 60_000)).await.unwrap(), 10);
    // A takes from Redis (its hint: 9), then its calls time out: it admits 4 from its local bucket.
    let (a, _) = store.take(&plan, &[], None).await.unwrap();
    let a_seen = std::time::Instant::now();
    assert_eq!(level(&a), 9);
    let a_debt = 4;
    // Meanwhile B drains the bucket from Redis.
    for left in (0..9).rev() {
        let (b, _) = store.take(&plan, &[], None).await.unwrap();
        assert_eq!((b.denied, level(&b)), (None, left));
    }
    assert_eq!(store.take(&plan, &[], None).await.unwrap().0.denied, Some(0), "B is refused");
    // A answers again: its 4 are owed on top of what B took (0 - 4), however its hint or the cut
    // 3 read.
    let a_hint = hint(9, a_seen.elapsed().as_millis() as u64);
    assert_eq!(store.reconcile(requests, a_debt, a_hint).await.unwrap(), -4);
    // Charged once: B's next take waits for them.
    assert_eq!(store.take(&plan, &[], None).await.unwrap().0.denied, Some(0));
}

/// Every sidecar local through one outage while the bucket survived (Redis was out of reach, not
/// lost): the refill Redis dropped at its capacity meanwhile is what the local buckets used, so it
/// is credited against their debts, the first sidecar's unused part to the second.
#[tokio::test]
async fn two_sidecars_cut_off_from_a_surviving_bucket_are_credited_the_refill_it_dropped() {
    let (redis, store, plan) = store_on_redis().await;
    let requests = requests_bucket(&plan);
    // The bucket was written at 0 41 minutes ago; both sidecars last heard 1 (the refill of the
    // first minute) 40 minutes ago, then admitted 17 and 18 locally. One bucket over the whole
    // span: 1 + 40 - 35 = 6.
    let mut conn = redis.conn().await;
    let (s, us): (u64, u64) = redis::cmd("TIME").query_async(&mut conn).await.unwrap();
    let written = s * 1_000_000 + us - 41 * 60_000_000;
    let _: () = redis::cmd("HSET")
        .arg(&requests.key)
        .arg("t")
        .arg("0")
        .arg("ts")
        .arg(written.to_string())
        .query_async(&mut conn)
        .await
        .unwrap();
    let away_ms = 40 * 60_000;
    assert_eq!(store.reconcile(requests, 17, hint(41, away_ms)).await.unwrap(), 10, "14 left over");
    // A third sidecar, answered after that reconciliation, had a timeout meanwhile: none of that
    // refill is its to use (its 2 are charged in full), and it stays for the second one.
    assert_eq!(store.reconcile(requests, 2, hint(10, 0)).await.unwrap(), 8);
    assert_eq!(store.reconcile(requests, 18, hint(41, away_ms)).await.unwrap(), 4, "1 + 40 - 17 - 2 - 18");
}
