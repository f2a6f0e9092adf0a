//! Quota counters in a real `redis-server` through the sidecar's store (issue 14 item 5): the
//! admission's take charges the reservation and refuses at the hard limit, the usage record
//! corrects the counter to the tokens used, a give-back takes the reservation off, the sweeper's
//! charge corrects it to what it charges, a lease is refused unless the lease fits, concurrent
//! admissions overshoot by at most what they reserved, and a request crossing midnight leaves
//! both days alone.
//!
//! Needs `redis-server` on the PATH (`make setup`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

mod common;

use common::Redis;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use gateway_ext_proc::admission::quota::{self, Clock, QuotaBook, QuotaTake};
use gateway_ext_proc::config::Config;
use gateway_ext_proc::metering::ledger::{self, Reservation};
use gateway_ext_proc::store::{Applied, Store, Tracking};

const HARD: u64 = 100;
const SOFT: u64 = 60;

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as u64
}

async fn setup(redis: &Redis) -> (Config, Store, redis::aio::MultiplexedConnection) {
    let yaml = format!(
        "listen: 127.0.0.1:0
redis: {{url: 'redis://127.0.0.1:{}'}}
tenants:
  - id: acme
    limits: {{}}
    quota: {{tokens_per_day: {HARD}, soft_tokens_per_day: {SOFT}}}
    model_quotas: {{big: {{tokens_per_month: 1000}}}}
prices:
  m: {{input: 1, output: 2}}
",
        redis.1
    );
    let config = Config::from_yaml(&yaml).unwrap();
    let store = Store::connect(&config.redis, "llmgw:usage-events".to_owned(), 1000)
        .await
        .unwrap()
        .with_quotas(QuotaBook::new(&config, Clock::default()));
    let conn = redis::Client::open(format!("redis://127.0.0.1:{}", redis.1))
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    (config, store, conn)
}

fn reservation(model: &str, prompt: u64, max_tokens: u64, at_ms: u64, charge: u64) -> Reservation {
    let facts = gateway_ext_proc::facts::RequestFacts {
        tenant: Some("acme".into()),
        model: model.into(),
        pool: "p".into(),
        prompt_tokens: prompt,
        max_tokens,
        request_id: "r".into(),
        tier: "standard".into(),
        ..Default::default()
    };
    Reservation::of(&facts, 0, at_ms).with_quota(charge, at_ms)
}

/// An admission of `charge` tokens recorded under `id`: (admitted, counters after).
async fn admit(store: &Store, model: &str, id: &str, charge: u64, at_ms: u64) -> (bool, Vec<u64>) {
    let specs = store.quotas().plan("llmgw", "acme", model, at_ms);
    let r = reservation(model, charge / 2, charge - charge / 2, at_ms, charge);
    let tracking =
        Tracking { tenant: "acme", record_id: id, reservation: &r, keep: Duration::from_secs(600) };
    let take = QuotaTake { specs: &specs, need: 0, charge };
    let (outcome, _, q) =
        store.take_with_quotas(&[], &[], Some(&tracking), Some(("acme", &take))).await.unwrap();
    let q = q.unwrap();
    assert!(outcome.denied.is_none());
    (q.denied.is_none(), q.used)
}

async fn counter(conn: &mut redis::aio::MultiplexedConnection, key: &str) -> i64 {
    redis::cmd("GET").arg(key).query_async::<Option<i64>>(conn).await.unwrap().unwrap_or(0)
}

#[tokio::test]
async fn counters_follow_reservations_usage_give_backs_and_charges() {
    let redis = Redis::start();
    let (_config, store, mut conn) = setup(&redis).await;
    let t = now_ms();
    let day = quota::quota_key("llmgw", "acme", None, quota::Period::Day, &quota::day_label(t / 1000));

    // Admitted: the reservation is charged; under the soft limit, no warning.
    let (ok, used) = admit(&store, "m", "a.1", 40, t).await;
    assert!(ok);
    assert_eq!(used, [40]);
    let specs = store.quotas().plan("llmgw", "acme", "m", t);
    let q = quota::QuotaOutcome { denied: None, used: used.clone() };
    assert_eq!(quota::decide(&specs, &q, t).unwrap(), None);
    // Its usage (12 + 3 tokens) lands: the counter holds what was used.
    let r = reservation("m", 20, 20, t, 40);
    let mut record = ledger::charged_record("acme", "a.1", &r);
    record.prompt_tokens = 12;
    record.completion_tokens = 3;
    record.unreported = false;
    record.finished_at_unix_ms = t;
    assert_eq!(store.apply(&record, &[], false, None).await.unwrap(), Applied::Applied);
    assert_eq!(counter(&mut conn, &day).await, 15);
    // Applied once: a second delivery changes nothing.
    assert_eq!(store.apply(&record, &[], false, None).await.unwrap(), Applied::Duplicate);
    assert_eq!(counter(&mut conn, &day).await, 15);
    // Its cost, exact: 12 x 1000 + 3 x 2000 nano-dollars, in the daily hash.
    let hash = gateway_ext_proc::store::usage_key("llmgw", "acme", t / 1000);
    let cost: i64 =
        redis::cmd("HGET").arg(&hash).arg("m:cost_nano_usd").query_async(&mut conn).await.unwrap();
    assert_eq!(cost, 18_000);

    // Another admission crosses the soft limit: the warning; then it is given back.
    let (ok, used) = admit(&store, "m", "a.2", 50, t).await;
    assert!(ok);
    let q = quota::QuotaOutcome { denied: None, used };
    let warning = quota::decide(&specs, &q, t).unwrap().unwrap();
    assert!(warning.starts_with("day; scope=tenant; used=65; soft=60; limit=100; reset="), "{warning}");
    assert_eq!(counter(&mut conn, &day).await, 65);
    assert!(store.release("acme", "a.2", &[]).await.unwrap());
    assert_eq!(counter(&mut conn, &day).await, 15);

    // A lost request is charged by the sweeper: the counter moves to what it charges.
    let (ok, _) = admit(&store, "m", "a.3", 30, t).await;
    assert!(ok);
    assert_eq!(counter(&mut conn, &day).await, 45);
    let lost = reservation("m", 15, 15, t, 30);
    let charged = ledger::charged_record("acme", "a.3", &lost);
    let charged_tokens = charged.prompt_tokens + charged.completion_tokens;
    assert_eq!(store.apply(&charged, &[], true, None).await.unwrap(), Applied::Applied);
    assert_eq!(counter(&mut conn, &day).await, 15 + charged_tokens as i64);

    // Up to the hard limit: admitted while any quota is left, refused once used up.
    let mut n = 0;
    loop {
        let (ok, used) = admit(&store, "m", &format!("b.{n}"), 20, t).await;
        if !ok {
            assert!(used[0] >= HARD, "{used:?}");
            let q = quota::QuotaOutcome { denied: Some(0), used };
            match quota::decide(&specs, &q, t).unwrap_err() {
                gateway_ext_proc::error::AdmissionError::QuotaExceeded {
                    period, retry_after_secs, ..
                } => {
                    assert_eq!(period, "day");
                    let midnight = (t / 1000 / 86_400 + 1) * 86_400;
                    assert_eq!(retry_after_secs, (midnight - t / 1000).max(1));
                }
                other => panic!("{other:?}"),
            }
            break;
        }
        n += 1;
        assert!(n < 10);
    }
    let before = counter(&mut conn, &day).await;
    // A refusal charged nothing; the keys expire after the day plus its margin.
    let (ok, _) = admit(&store, "m", "c.1", 20, t).await;
    assert!(!ok);
    assert_eq!(counter(&mut conn, &day).await, before);
    let ttl: i64 = redis::cmd("TTL").arg(&day).query_async(&mut conn).await.unwrap();
    assert!(ttl > 2 * 86_400 - 60 && ttl <= 3 * 86_400, "{ttl}");

    // No lease while the lease's tokens do not fit; a lease charges nothing.
    let specs = store.quotas().plan("llmgw", "acme", "m", t);
    let take = QuotaTake { specs: &specs, need: 1, charge: 0 };
    let (_, _, q) = store.take_with_quotas(&[], &[], None, Some(("acme", &take))).await.unwrap();
    assert!(q.unwrap().denied.is_some());
    assert_eq!(counter(&mut conn, &day).await, before);
}

#[tokio::test]
async fn model_quotas_concurrency_and_midnight() {
    let redis = Redis::start();
    let (_config, store, mut conn) = setup(&redis).await;
    let t = now_ms();
    let month =
        quota::quota_key("llmgw", "acme", Some("big"), quota::Period::Month, &quota::month_label(t / 1000));
    let store = Arc::new(store);
    // 20 concurrent admissions of 100 tokens against the model's 1000 a month: each is admitted
    // only while the counter is under the limit, so the overshoot is at most one reservation.
    let tasks: Vec<_> = (0..20)
        .map(|i| {
            let store = Arc::clone(&store);
            tokio::spawn(async move { admit(&store, "big", &format!("big.{i}"), 100, t).await.0 })
        })
        .collect();
    let mut admitted = 0;
    for task in tasks {
        admitted += u64::from(task.await.unwrap());
    }
    // The tenant's day (100) refuses first: one admission of 100 fills it.
    let day = quota::quota_key("llmgw", "acme", None, quota::Period::Day, &quota::day_label(t / 1000));
    assert_eq!(admitted, 1);
    assert_eq!(counter(&mut conn, &day).await, 100);
    assert_eq!(counter(&mut conn, &month).await, 100);

    // The admitted request ends after midnight (on the sidecar's clock): the days are left alone
    // (its reservation stays counted on the admission's day, the next day is not charged), and
    // the model's month is corrected to the usage when the month is the same.
    let ids: Vec<String> =
        redis::cmd("HKEYS").arg("llmgw:reservations:{acme}").query_async(&mut conn).await.unwrap();
    assert_eq!(ids.len(), 1, "{ids:?}");
    let r = reservation("big", 50, 50, t, 100);
    let mut record = ledger::charged_record("acme", &ids[0], &r);
    record.prompt_tokens = 10;
    record.completion_tokens = 10;
    record.unreported = false;
    let tomorrow = t + 86_400_000;
    record.finished_at_unix_ms = tomorrow;
    assert_eq!(store.apply(&record, &[], false, None).await.unwrap(), Applied::Applied);
    let next_day =
        quota::quota_key("llmgw", "acme", None, quota::Period::Day, &quota::day_label(tomorrow / 1000));
    assert_eq!(counter(&mut conn, &next_day).await, 0);
    assert_eq!(counter(&mut conn, &day).await, 100);
    let same_month = quota::month_label(t / 1000) == quota::month_label(tomorrow / 1000);
    assert_eq!(counter(&mut conn, &month).await, if same_month { 20 } else { 100 });
    // A record without an open reservation (a leased admission) adds its tokens to its day.
    let mut leased = record.clone();
    leased.info.record_id = "leased.1".into();
    assert_eq!(store.apply(&leased, &[], false, None).await.unwrap(), Applied::Applied);
    assert_eq!(counter(&mut conn, &next_day).await, 20);
}
