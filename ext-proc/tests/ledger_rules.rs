//! The ledger's rules as Rust states them ([`ledger::quota_delta`]) against what
//! `lua/ledger_v1.lua` does in a real `redis-server`: for each case, an admission that charged
//! the quota counters, then its record or its give-back, and every counter's move compared with
//! the rule's.
//!
//! Needs `redis-server` on the PATH (`make setup`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

mod common;

use common::Redis;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use gateway_ext_proc::admission::quota::{Clock, QuotaBook, QuotaTake};
use gateway_ext_proc::config::Config;
use gateway_ext_proc::metering::ledger::{self, Reservation};
use gateway_ext_proc::store::{Applied, Store, Tracking};

async fn setup(redis: &Redis) -> (Store, redis::aio::MultiplexedConnection) {
    let yaml = format!(
        "listen: 127.0.0.1:0
redis: {{url: 'redis://127.0.0.1:{}'}}
tenants:
  - id: acme
    limits: {{}}
    quota: {{tokens_per_day: 1000000, tokens_per_month: 1000000}}
    model_quotas: {{big: {{tokens_per_day: 1000000}}}}
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
    (store, conn)
}

async fn counters(conn: &mut redis::aio::MultiplexedConnection, keys: &[String]) -> Vec<i64> {
    let mut out = Vec::new();
    for key in keys {
        out.push(redis::cmd("GET").arg(key).query_async::<Option<i64>>(conn).await.unwrap().unwrap_or(0));
    }
    out
}

/// One case: a request of `model` admitted at `admitted_ms` with `charge` tokens charged to its
/// quota counters, whose record (`used` tokens, ending at `ended_ms`) lands, or which is given
/// back (`used` None).
struct Case {
    model: &'static str,
    charge: u64,
    admitted_ms: u64,
    ended_ms: u64,
    used: Option<u64>,
}

#[tokio::test]
async fn every_counter_moves_as_the_rust_rule_says() {
    let redis = Redis::start();
    let (store, mut conn) = setup(&redis).await;
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as u64;
    let day = 86_400_000;
    let cases = [
        Case { model: "m", charge: 40, admitted_ms: now, ended_ms: now, used: Some(15) },
        Case { model: "m", charge: 40, admitted_ms: now, ended_ms: now, used: Some(55) },
        Case { model: "m", charge: 40, admitted_ms: now, ended_ms: now, used: None },
        Case { model: "big", charge: 30, admitted_ms: now, ended_ms: now, used: Some(10) },
        Case { model: "big", charge: 30, admitted_ms: now, ended_ms: now, used: None },
        // Admitted yesterday, ended today: yesterday's counter keeps the charge, today's is left
        // alone (and the month's moves when both days are in one month).
        Case { model: "m", charge: 20, admitted_ms: now - day, ended_ms: now, used: Some(7) },
        Case { model: "big", charge: 20, admitted_ms: now - day, ended_ms: now, used: Some(7) },
    ];
    for (i, case) in cases.iter().enumerate() {
        let id = format!("case.{i}");
        let admitted_specs = store.quotas().plan("llmgw", "acme", case.model, case.admitted_ms);
        let facts = gateway_ext_proc::facts::RequestFacts {
            tenant: Some("acme".into()),
            model: case.model.into(),
            pool: "p".into(),
            prompt_tokens: case.charge / 2,
            max_tokens: case.charge - case.charge / 2,
            request_id: id.clone(),
            tier: "standard".into(),
            ..Default::default()
        };
        let r = Reservation::of(&facts, 0, case.admitted_ms).with_quota(case.charge, case.admitted_ms);
        let tracking =
            Tracking { tenant: "acme", record_id: &id, reservation: &r, keep: Duration::from_secs(600) };
        let take = QuotaTake { specs: &admitted_specs, need: 0, charge: case.charge };
        let (outcome, _, quota) =
            store.take_with_quotas(&[], &[], Some(&tracking), Some(("acme", &take))).await.unwrap();
        assert!(outcome.denied.is_none() && quota.unwrap().denied.is_none(), "case {i} admitted");

        // Every counter either write can touch: the admission's periods and the end's.
        let mut specs = store.quotas().plan_all_models("llmgw", "acme", case.admitted_ms);
        specs.extend(store.quotas().plan_all_models("llmgw", "acme", case.ended_ms));
        specs.sort_by(|a, b| a.key.cmp(&b.key));
        specs.dedup_by(|a, b| a.key == b.key);
        let keys: Vec<String> = specs.iter().map(|s| s.key.clone()).collect();
        let before = counters(&mut conn, &keys).await;

        let (used, ended_specs) = match case.used {
            Some(used) => {
                let mut record = ledger::charged_record("acme", &id, &r);
                record.prompt_tokens = used;
                record.completion_tokens = 0;
                record.unreported = false;
                record.finished_at_unix_ms = case.ended_ms;
                assert_eq!(
                    store.apply(&record, &[], false, None).await.unwrap(),
                    Applied::Applied,
                    "case {i}"
                );
                (used, store.quotas().plan("llmgw", "acme", case.model, case.ended_ms))
            }
            None => {
                assert!(store.release("acme", &id, &[]).await.unwrap(), "case {i} given back");
                (0, store.quotas().plan_all_models("llmgw", "acme", now))
            }
        };
        let after = counters(&mut conn, &keys).await;
        for (j, spec) in specs.iter().enumerate() {
            // The write names the counters of its own periods (the record's end, or now for a
            // give-back); the rule says how each of those moves, and no other counter moves.
            let named = ended_specs.iter().any(|s| s.key == spec.key);
            let expected = if named { ledger::quota_delta(spec, case.model, used, Some(&r)) } else { 0 };
            assert_eq!(after[j] - before[j], expected, "case {i}: counter {}", spec.key);
        }
    }
}
