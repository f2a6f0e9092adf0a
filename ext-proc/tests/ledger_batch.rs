//! The ledger's batched writes in a real `redis-server` (`Store::ledger_batch`,
//! `Store::append_batch`: one script call for several writes of a tenant, one for several stream
//! events): a batch leaves the books exactly where the same writes one call each leave them, each
//! write keeps its own idempotency, a write that fails in the script fails alone, and the stream
//! gets each event once.
//!
//! Needs `redis-server` on the PATH (`make setup`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

mod common;

use std::collections::HashMap;
use std::time::{SystemTime, UNIX_EPOCH};

use common::Redis;
use gateway_ext_proc::admission::limits;
use gateway_ext_proc::admission::quota::{Clock, QuotaBook};
use gateway_ext_proc::config::Config;
use gateway_ext_proc::metering::ledger;
use gateway_ext_proc::metering::meter::{RequestInfo, UsageRecord};
use gateway_ext_proc::store::{self, Applied, LedgerReply, LedgerWrite, Store};

const STREAM: &str = "llmgw:usage-events";

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as u64
}

async fn setup(redis: &Redis) -> (Config, Store) {
    let yaml = format!(
        "listen: 127.0.0.1:0
redis: {{url: 'redis://127.0.0.1:{}'}}
tenants:
  - {{id: one, limits: {{tokens_per_minute: 1, token_burst: 100000}}}}
  - {{id: batched, limits: {{tokens_per_minute: 1, token_burst: 100000}}}}
prices:
  m: {{input: 1, output: 2}}
",
        redis.1
    );
    let config = Config::from_yaml(&yaml).unwrap();
    let store = Store::connect(&config.redis, STREAM.to_owned(), 1000)
        .await
        .unwrap()
        .with_quotas(QuotaBook::new(&config, Clock::default()));
    (config, store)
}

/// Request `i` of `tenant`: 10 + i prompt tokens, 5 completion tokens, 10 reserved (so each
/// settlement charges the TPM bucket more, and creates it).
fn record(tenant: &str, i: u64, at_ms: u64) -> UsageRecord {
    let info = RequestInfo {
        tenant: tenant.to_owned(),
        model: "m".to_owned(),
        request_id: format!("req-{i}"),
        record_id: format!("{tenant}-{i}"),
        reserved_tokens: 10,
        ..Default::default()
    };
    let mut r = UsageRecord::new(info, gateway_meter::Usage::unseen(1, 200), true);
    r.prompt_tokens = 10 + i;
    r.completion_tokens = 5;
    r.cached_tokens = 0;
    r.finished_at_unix_ms = at_ms;
    r
}

/// A record's write with no settlements and no lease.
fn plain(record: &UsageRecord) -> LedgerWrite<'_> {
    LedgerWrite::Record { record, settlements: &[], charge: false, lease: None }
}

async fn usage(
    conn: &mut redis::aio::MultiplexedConnection,
    tenant: &str,
    at_ms: u64,
) -> HashMap<String, i64> {
    redis::cmd("HGETALL")
        .arg(store::usage_key("llmgw", tenant, at_ms / 1000))
        .query_async(conn)
        .await
        .unwrap()
}

async fn bucket_level(conn: &mut redis::aio::MultiplexedConnection, key: &str) -> f64 {
    let level: Option<String> = redis::cmd("HGET").arg(key).arg("t").query_async(conn).await.unwrap();
    level.unwrap().parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_writes_what_one_call_each_writes_and_each_write_once() {
    let redis = Redis::start();
    let (config, store) = setup(&redis).await;
    let mut conn = redis.conn().await;
    let at = now_ms();
    let tenant_of = |id: &str| config.tenant(id).unwrap();
    let settle = |tenant: &str, r: &UsageRecord| {
        let buckets = limits::token_buckets("llmgw", tenant_of(tenant), "m");
        ledger::settlements(buckets, r.info.reserved_tokens, r.total_tokens())
    };

    // Four records of `one`, a call each; the same four of `batched` in one call.
    let ones: Vec<UsageRecord> = (0..4).map(|i| record("one", i, at)).collect();
    for r in &ones {
        assert_eq!(store.apply(r, &settle("one", r), false, None).await.unwrap(), Applied::Applied);
    }
    let batched: Vec<UsageRecord> = (0..4).map(|i| record("batched", i, at)).collect();
    let settlements: Vec<_> = batched.iter().map(|r| settle("batched", r)).collect();
    let writes: Vec<LedgerWrite<'_>> = batched
        .iter()
        .zip(&settlements)
        .map(|(record, settlements)| LedgerWrite::Record { record, settlements, charge: false, lease: None })
        .collect();
    let replies = store.ledger_batch(&writes).await.unwrap();
    assert_eq!(replies, vec![LedgerReply::Record(Applied::Applied); 4]);

    // The same books: daily counts and cost, and the TPM bucket (it refills 1 token a minute, so
    // a missing or doubled settlement shows).
    let (u1, u2) = (usage(&mut conn, "one", at).await, usage(&mut conn, "batched", at).await);
    assert_eq!(u1.get("m:requests"), Some(&4));
    assert_eq!(u1.get("m:prompt_tokens"), Some(&(10 + 11 + 12 + 13)));
    assert_eq!(u1, u2, "a batch leaves the usage hash where one call each leaves it");
    let key = |t: &str| limits::token_buckets("llmgw", tenant_of(t), "m")[0].key.clone();
    let (l1, l2) =
        (bucket_level(&mut conn, &key("one")).await, bucket_level(&mut conn, &key("batched")).await);
    assert!((l1 - l2).abs() < 1.0, "bucket levels: one call each {l1}, batched {l2}");
    // Four settlements, each charging 5 + i more than the 10 reserved.
    assert!((l2 - (100_000.0 - 26.0)).abs() < 1.0, "batched bucket level {l2}");

    // Each write is applied once: the batch again is all duplicates, nothing moves.
    let replies = store.ledger_batch(&writes).await.unwrap();
    assert_eq!(replies, vec![LedgerReply::Record(Applied::Duplicate); 4]);
    assert_eq!(usage(&mut conn, "batched", at).await, u2);

    // A write that fails in the script fails alone: a fifth record whose idempotency set is not
    // a set (WRONGTYPE), between two good ones, and a release of a reservation never opened.
    let (bad, _) = store::seen_key("llmgw", "batched", at / 1000 + 3600, at / 1000);
    let bad_record = record("batched", 5, at + 3_600_000);
    let _: () = redis::cmd("SET").arg(&bad).arg("not a set").query_async(&mut conn).await.unwrap();
    let good: Vec<UsageRecord> = [6, 7].iter().map(|&i| record("batched", i, at)).collect();
    let buckets = limits::plan("llmgw", tenant_of("batched"), "m", 0);
    let writes = vec![
        plain(&good[0]),
        plain(&bad_record),
        LedgerWrite::Release { tenant: "batched", record_id: "never-admitted", buckets: &buckets },
        plain(&good[1]),
    ];
    let replies = store.ledger_batch(&writes).await.unwrap();
    assert_eq!(
        replies,
        vec![
            LedgerReply::Record(Applied::Applied),
            LedgerReply::Failed,
            LedgerReply::Released(false),
            LedgerReply::Record(Applied::Applied),
        ]
    );
    assert_eq!(usage(&mut conn, "batched", at).await.get("m:requests"), Some(&6));

    // A write whose summed writes fail at the end of the call fails alone too: a record of a
    // day whose usage hash is not a hash (WRONGTYPE), between two good ones of today's.
    let yesterday = at - 86_400_000;
    let _: () = redis::cmd("SET")
        .arg(store::usage_key("llmgw", "batched", yesterday / 1000))
        .arg("not a hash")
        .query_async(&mut conn)
        .await
        .unwrap();
    let around: Vec<UsageRecord> = [8, 9].iter().map(|&i| record("batched", i, at)).collect();
    let old = record("batched", 10, yesterday);
    let writes = vec![plain(&around[0]), plain(&old), plain(&around[1])];
    let replies = store.ledger_batch(&writes).await.unwrap();
    assert_eq!(
        replies,
        vec![
            LedgerReply::Record(Applied::Applied),
            LedgerReply::Failed,
            LedgerReply::Record(Applied::Applied)
        ]
    );
    assert_eq!(usage(&mut conn, "batched", at).await.get("m:requests"), Some(&8));

    // The stream: one event per record, however often the batch is appended.
    let all: Vec<&UsageRecord> = batched.iter().chain(&good).collect();
    assert_eq!(store.append_batch(&all).await.unwrap(), vec![true; 6]);
    assert_eq!(store.append_batch(&all).await.unwrap(), vec![false; 6]);
    assert!(!store.append(&good[0]).await.unwrap());
    assert!(store.append(&ones[0]).await.unwrap());
    let len: u64 = redis::cmd("XLEN").arg(STREAM).query_async(&mut conn).await.unwrap();
    assert_eq!(len, 7);
    // The batch's sent-set expires (set once per call for the batch's shared expiry).
    let (sent, _) = store::sent_key(STREAM, at / 1000, at / 1000);
    let ttl: i64 = redis::cmd("TTL").arg(&sent).query_async(&mut conn).await.unwrap();
    assert!(ttl > 0, "{sent}: TTL {ttl}");
    assert!(store.ledger_batch(&[]).await.unwrap().is_empty());
    assert!(store.append_batch(&[]).await.unwrap().is_empty());
}

/// The ledger holds counts exactly or refuses them (issue 35, item 3): a record whose count
/// Lua's doubles cannot hold (an upstream's `i64::MAX`, which the double rounds to 2^63 and
/// `%d` then wrote as -2^63) is refused by the script, alone in its batch, and writes nothing;
/// the largest exact count (2^53 - 1) is written exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ledger_refuses_a_count_it_cannot_hold_exactly() {
    let redis = Redis::start();
    let (_config, store) = setup(&redis).await;
    let mut conn = redis.conn().await;
    let at = now_ms();
    let mut liar = record("one", 1, at);
    liar.prompt_tokens = i64::MAX as u64;
    // A model without a price: its cost (capped at the bound too) is not summed with it.
    let mut exact = record("one", 2, at);
    exact.info.model = "free".to_owned();
    exact.prompt_tokens = gateway_ext_proc::metering::meter::MAX_LEDGER_COUNT - 1000;
    let mut fine = record("one", 3, at);
    fine.info.model = "free".to_owned();
    let replies = store.ledger_batch(&[plain(&liar), plain(&exact), plain(&fine)]).await.unwrap();
    assert_eq!(
        replies,
        vec![
            LedgerReply::Failed,
            LedgerReply::Record(Applied::Applied),
            LedgerReply::Record(Applied::Applied)
        ]
    );
    let books = usage(&mut conn, "one", at).await;
    assert_eq!(books.get("free:requests"), Some(&2), "{books:?}");
    assert_eq!(books.get("m:requests"), None, "{books:?}");
    // Exact to the token: no rounding, no wrap to a negative count.
    let expected = (gateway_ext_proc::metering::meter::MAX_LEDGER_COUNT - 1000 + 13) as i64;
    assert_eq!(books.get("free:prompt_tokens"), Some(&expected), "{books:?}");
    // A sum past the bound is refused too (two exact counts whose sum is not).
    let mut again = record("one", 4, at);
    again.prompt_tokens = gateway_ext_proc::metering::meter::MAX_LEDGER_COUNT;
    let mut twice = record("one", 5, at);
    twice.prompt_tokens = gateway_ext_proc::metering::meter::MAX_LEDGER_COUNT;
    let replies = store.ledger_batch(&[plain(&again), plain(&twice)]).await.unwrap();
    assert!(replies.contains(&LedgerReply::Failed), "{replies:?}");
    let after = usage(&mut conn, "one", at).await;
    assert!(after.values().all(|v| *v >= 0), "no count went negative: {after:?}");
}
