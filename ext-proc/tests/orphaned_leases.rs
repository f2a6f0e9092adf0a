//! Admission leases whose filter VM went away (issue 14, item 4), against a real `redis-server`
//! through the sidecar's store: a lease is recorded open with its take, a leased request's usage
//! counts its reservation against the open lease, a reclaim gives back what the lease took less
//! what its reported and its finished requests reserved, a request the filter reported keeps its
//! reservation charged through a reclaim, one it did not report and still in flight at the
//! reclaim pays its reservation again when its usage lands, one it reported whose usage never
//! lands is charged its reservation as usage (hash, quota, cost, one event) once the longest
//! stream lifetime has passed, and a give-back and a reclaim exclude each other, so the buckets
//! end where the requests' usage alone puts them.
//!
//! Needs `redis-server` on the PATH (`make setup`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

mod common;

use std::time::Duration;

use common::Redis;

use gateway_ext_proc::admission::admission_lease::{self, LeaseRecord, LeaseUse};
use gateway_ext_proc::admission::limits::{self, BucketKind, BucketSpec};
use gateway_ext_proc::admission::quota::{self, Clock, QuotaBook};
use gateway_ext_proc::config::Config;
use gateway_ext_proc::facts::RequestFacts;
use gateway_ext_proc::metering::ledger;
use gateway_ext_proc::metering::meter::UsageRecord;
use gateway_ext_proc::proto::{EndReason, UsageEvent};
use gateway_ext_proc::store::{Applied, LeaseCharge, LedgerReply, Store};
use prost::Message;

const REQUESTS: f64 = 1_000.0;
const TOKENS: f64 = 100_000.0;

/// Bursts of 1,000 requests and 100,000 tokens refilled 1 a minute (nothing hides a miscount);
/// leases of 10 %: 100 requests and 10,000 tokens.
async fn setup(redis: &Redis) -> (Config, Store, redis::aio::MultiplexedConnection) {
    let config = Config::from_yaml(&format!(
        "listen: 127.0.0.1:0
redis: {{url: 'redis://127.0.0.1:{}', lease_fraction: 0.1}}
tenants:
  - id: acme
    limits: {{requests_per_minute: 1, request_burst: 1000, tokens_per_minute: 1, token_burst: 100000}}
    quota: {{tokens_per_day: 100000000}}
prices:
  m: {{input: 1, output: 2}}
",
        redis.1
    ))
    .unwrap();
    let store = Store::connect(&config.redis, "usage".into(), 1000)
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

fn plan(config: &Config, store: &Store) -> Vec<BucketSpec> {
    limits::plan(store.prefix(), config.tenant("acme").unwrap(), "m", 0)
}

/// Takes a lease named `id`; its size.
async fn take(config: &Config, store: &Store, id: &str) -> admission_lease::LeaseSize {
    let size = admission_lease::size(&plan(config, store), 0.1, 100).unwrap();
    assert_eq!((size.requests, size.tokens), (100, 10_000));
    let record = LeaseRecord::of(&size, "m");
    let (outcome, _) =
        store.take_lease("acme", id, &record, Duration::from_secs(600), &size.plan, None).await.unwrap();
    assert_eq!(outcome.denied, None);
    size
}

/// The usage record of a request admitted from lease `lease_id` that reserved 100 tokens and
/// used `used` (10 prompt, the rest completion), and what its write settles; not numbered (as
/// from a filter that does not report).
fn leased(
    config: &Config,
    store: &Store,
    id: &str,
    lease_id: &str,
    used: u64,
) -> (UsageRecord, Vec<(BucketSpec, i64)>, Option<LeaseUse>) {
    numbered(config, store, id, lease_id, used, None)
}

/// [`leased`], the request numbered `seq` among the lease's admissions.
fn numbered(
    config: &Config,
    store: &Store,
    id: &str,
    lease_id: &str,
    used: u64,
    seq: Option<u64>,
) -> (UsageRecord, Vec<(BucketSpec, i64)>, Option<LeaseUse>) {
    let facts = RequestFacts {
        tenant: Some("acme".into()),
        model: "m".into(),
        pool: "p".into(),
        prompt_tokens: 10,
        max_tokens: 90,
        request_id: id.into(),
        tier: "standard".into(),
        leased_tokens: Some(100),
        lease_id: Some(lease_id.into()),
        lease_seq: seq,
        ..Default::default()
    };
    let reservation = ledger::Reservation::of(&facts, 100, 0);
    let mut record = ledger::charged_record("acme", id, &reservation);
    record.info.lease_id = facts.lease_id.clone();
    record.info.lease_seq = seq;
    record.unreported = false;
    record.prompt_tokens = 10;
    record.completion_tokens = used - 10;
    record.finished_at_unix_ms = 0;
    let buckets = limits::token_buckets(store.prefix(), config.tenant("acme").unwrap(), "m");
    let settlements = ledger::settlements(buckets, 100, used);
    let lease = LeaseUse::of(record.info.lease_id.as_deref(), seq, &plan(config, store), 100, 10);
    (record, settlements, lease)
}

/// The (requests, tokens) buckets' levels now.
async fn levels(config: &Config, store: &Store, conn: &mut redis::aio::MultiplexedConnection) -> (f64, f64) {
    let mut out = (0.0, 0.0);
    for b in plan(config, store) {
        let t: Option<String> = redis::cmd("HGET").arg(&b.key).arg("t").query_async(conn).await.unwrap();
        let level = t.map_or(f64::NAN, |t| t.parse().unwrap());
        match b.kind {
            BucketKind::Requests => out.0 = level,
            BucketKind::Tokens => out.1 = level,
        }
    }
    out
}

/// `level` is `expected` within the refill a test can see (1 a minute) and rounding.
fn near(level: f64, expected: f64) -> bool {
    (level - expected).abs() < 1.0
}

#[tokio::test]
async fn a_reclaimed_lease_gives_back_what_its_requests_did_not_use() {
    let redis = Redis::start();
    let (config, store, mut conn) = setup(&redis).await;
    let size = take(&config, &store, "L1").await;
    let (r, t) = levels(&config, &store, &mut conn).await;
    assert!(near(r, REQUESTS - 100.0) && near(t, TOKENS - 10_000.0), "{r} {t}");

    // One request ends while the lease is open: settled (100 reserved, 30 used), counted.
    let (record, settlements, lease) = leased(&config, &store, "done.1", "L1", 30);
    assert_eq!(store.apply(&record, &settlements, false, lease.as_ref()).await.unwrap(), Applied::Applied);
    let used: Vec<Option<u64>> = redis::cmd("HMGET")
        .arg(ledger::lease_used_key("llmgw", "acme"))
        .arg("L1:r")
        .arg("L1:t")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(used, [Some(1), Some(100)]);

    // Not yet due (granted just now); due with age 0.
    let claimed = store.claim_leases("acme", Duration::from_secs(60), ledger::CLAIM, 10).await.unwrap();
    assert_eq!((claimed.open, claimed.due.len()), (1, 0));
    let claimed = store.claim_leases("acme", Duration::ZERO, ledger::CLAIM, 10).await.unwrap();
    assert_eq!(claimed.due, [("L1".to_owned(), Some(LeaseRecord::of(&size, "m")))]);

    // The VM went away: the reclaim gives back all but the finished request's reservation.
    let back = store.lease_reclaim("acme", "L1", &plan(&config, &store), Duration::from_secs(600)).await;
    assert_eq!(back.unwrap(), Some((99, 9_900)));
    let (r, t) = levels(&config, &store, &mut conn).await;
    assert!(near(r, REQUESTS - 1.0) && near(t, TOKENS - 30.0), "{r} {t}");
    // Once only: by another replica, or by the filter's give-back arriving late.
    let again = store.lease_reclaim("acme", "L1", &plan(&config, &store), Duration::from_secs(600)).await;
    assert_eq!(again.unwrap(), None);
    let late = admission_lease::give_back(&size.plan, 98, 9_800);
    assert!(!store.lease_return("acme", "L1", &late).await.unwrap());
    let (r, t) = levels(&config, &store, &mut conn).await;
    assert!(near(r, REQUESTS - 1.0) && near(t, TOKENS - 30.0), "{r} {t}");

    // A request in flight at the reclaim ends (100 reserved, 50 used): it costs its usage.
    let (record, settlements, lease) = leased(&config, &store, "late.1", "L1", 50);
    assert_eq!(store.apply(&record, &settlements, false, lease.as_ref()).await.unwrap(), Applied::Applied);
    let (r, t) = levels(&config, &store, &mut conn).await;
    assert!(near(r, REQUESTS - 2.0) && near(t, TOKENS - 80.0), "{r} {t}");
    // Delivered twice: applied once.
    assert_eq!(store.apply(&record, &settlements, false, lease.as_ref()).await.unwrap(), Applied::Duplicate);
    let (r, t) = levels(&config, &store, &mut conn).await;
    assert!(near(r, REQUESTS - 2.0) && near(t, TOKENS - 80.0), "{r} {t}");
    let claimed = store.claim_leases("acme", Duration::ZERO, ledger::CLAIM, 10).await.unwrap();
    assert_eq!((claimed.open, claimed.due.len()), (0, 0));
}

#[tokio::test]
async fn a_lease_given_back_is_not_reclaimed_and_its_late_requests_settle_as_usual() {
    let redis = Redis::start();
    let (config, store, mut conn) = setup(&redis).await;
    let size = take(&config, &store, "L2").await;
    let (record, settlements, lease) = leased(&config, &store, "done.2", "L2", 40);
    assert_eq!(store.apply(&record, &settlements, false, lease.as_ref()).await.unwrap(), Applied::Applied);
    // The filter admitted two (one still in flight) and gives back the rest: 98 and 9,800.
    let back = admission_lease::give_back(&size.plan, 98, 9_800);
    assert!(store.lease_return("acme", "L2", &back).await.unwrap());
    assert!(!store.lease_return("acme", "L2", &back).await.unwrap(), "a retry gives back nothing more");
    let reclaim = store.lease_reclaim("acme", "L2", &plan(&config, &store), Duration::from_secs(600)).await;
    assert_eq!(reclaim.unwrap(), None);
    let (record, settlements, lease) = leased(&config, &store, "late.2", "L2", 60);
    assert_eq!(store.apply(&record, &settlements, false, lease.as_ref()).await.unwrap(), Applied::Applied);
    let (r, t) = levels(&config, &store, &mut conn).await;
    assert!(near(r, REQUESTS - 2.0) && near(t, TOKENS - 100.0), "{r} {t}");
    let used: i64 = redis::cmd("EXISTS")
        .arg(ledger::lease_used_key("llmgw", "acme"))
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(used, 0, "a closed lease keeps no counts");
}

#[tokio::test]
async fn leased_records_in_one_batch_count_and_settle_as_one_call_each() {
    let redis = Redis::start();
    let (config, store, mut conn) = setup(&redis).await;
    take(&config, &store, "L3").await;
    take(&config, &store, "L4").await;
    // L4's VM went away before any of its requests ended: all it took goes back.
    let back = store.lease_reclaim("acme", "L4", &plan(&config, &store), Duration::from_secs(600)).await;
    assert_eq!(back.unwrap(), Some((100, 10_000)));
    let (r, t) = levels(&config, &store, &mut conn).await;
    assert!(near(r, REQUESTS - 100.0) && near(t, TOKENS - 10_000.0), "{r} {t}");

    // One batch: three requests of the open L3 and two of the reclaimed L4 (each 100 reserved),
    // interleaved, one of them twice.
    let writes: Vec<_> =
        [("b.1", "L3", 30), ("b.2", "L4", 50), ("b.3", "L3", 40), ("b.4", "L4", 60), ("b.5", "L3", 20)]
            .iter()
            .map(|&(id, lease, used)| {
                let mut write = leased(&config, &store, id, lease, used);
                // Two made with a named key: its name follows the record's lease section.
                if id == "b.1" || id == "b.2" {
                    write.0.info.api_key = Some("ci".into());
                }
                write
            })
            .collect();
    let mut batch = common::record_writes(&writes);
    batch.extend(common::record_writes(&writes[..1]));
    let replies = store.ledger_batch(&batch).await.unwrap();
    let mut expected = vec![LedgerReply::Record(Applied::Applied); 5];
    expected.push(LedgerReply::Record(Applied::Duplicate));
    assert_eq!(replies, expected);

    // L3 counts its three requests and their reservations, as three calls would.
    let used: Vec<Option<u64>> = redis::cmd("HMGET")
        .arg(ledger::lease_used_key("llmgw", "acme"))
        .arg("L3:r")
        .arg("L3:t")
        .arg("L4:r")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(used, [Some(3), Some(300), None]);
    // L3's requests gave back what they did not use (70 + 60 + 80) to the tokens bucket; L4's
    // paid their request and reservation again and then their usage (50 + 60).
    let (r, t) = levels(&config, &store, &mut conn).await;
    assert!(near(r, REQUESTS - 100.0 - 2.0), "{r}");
    assert!(near(t, TOKENS - 10_000.0 + 210.0 - 110.0), "{t}");
    // (A record finished at 0 is dated when it is written.)
    let day = usage_today(&mut conn).await;
    assert_eq!(day.get("m:requests"), Some(&5));
    assert_eq!(day.get("m:completion_tokens"), Some(&(20 + 40 + 30 + 50 + 10)));
    assert_eq!(
        (day.get("api_key ci:requests"), day.get("api_key ci:completion_tokens")),
        (Some(&2), Some(&(20 + 40)))
    );
}

/// Unix time now, in seconds.
fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs()
}

/// The tenant's usage hash of today (a record finished at 0 is dated when it is written).
async fn usage_today(conn: &mut redis::aio::MultiplexedConnection) -> std::collections::HashMap<String, i64> {
    redis::cmd("HGETALL")
        .arg(gateway_ext_proc::store::usage_key("llmgw", "acme", unix_now()))
        .query_async(conn)
        .await
        .unwrap()
}

/// LU's entries (field -> value).
async fn lease_used(
    conn: &mut redis::aio::MultiplexedConnection,
) -> std::collections::BTreeMap<String, String> {
    redis::cmd("HGETALL").arg(ledger::lease_used_key("llmgw", "acme")).query_async(conn).await.unwrap()
}

fn entries(pairs: &[(&str, &str)]) -> std::collections::BTreeMap<String, String> {
    pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
}

#[tokio::test]
async fn a_reclaim_keeps_what_the_filter_reported_charged_and_charges_what_never_landed_once() {
    let redis = Redis::start();
    let (config, store, mut conn) = setup(&redis).await;
    take(&config, &store, "L5").await;
    let apply = |id: &'static str, used: u64, seq: u64| {
        let (record, settlements, lease) = numbered(&config, &store, id, "L5", used, Some(seq));
        let store = &store;
        async move { store.apply(&record, &settlements, false, lease.as_ref()).await.unwrap() }
    };
    // Request 1 ends (30 used) before the filter reports it: kept under its number (reserved 100,
    // 10 of them its prompt estimate).
    assert_eq!(apply("n.1", 30, 1).await, Applied::Applied);
    assert_eq!(lease_used(&mut conn).await, entries(&[("L5:#1", "100:10")]));
    // The filter reports requests 1 to 3 (300 tokens reserved, 30 of prompt): the report covers
    // request 1, which joins the landed counts.
    assert!(store.lease_report("acme", "L5", 3, 300, 3 * 10).await.unwrap());
    let report = [("L5:a", "3"), ("L5:at", "300"), ("L5:ap", "30")];
    let landed_1 = [("L5:l", "1"), ("L5:lt", "100"), ("L5:lp", "10")];
    assert_eq!(lease_used(&mut conn).await, entries(&[&report[..], &landed_1[..]].concat()));
    // Request 4 ends (20 used): past the report, kept under its number.
    assert_eq!(apply("n.4", 20, 4).await, Applied::Applied);
    assert_eq!(lease_used(&mut conn).await.get("L5:#4").map(String::as_str), Some("100:10"));
    // A report older than the recorded one changes nothing.
    assert!(store.lease_report("acme", "L5", 2, 200, 2 * 10).await.unwrap());
    assert_eq!(lease_used(&mut conn).await.get("L5:a").map(String::as_str), Some("3"));

    // Envoy is killed: requests 2 and 3 (reported) and request 5 (not reported) are in flight.
    // The reclaim counts requests 1 to 3 and request 4: 4 requests and 400 tokens stay charged.
    let back = store.lease_reclaim("acme", "L5", &plan(&config, &store), Duration::from_secs(600)).await;
    assert_eq!(back.unwrap(), Some((96, 9_600)));
    let (r, t) = levels(&config, &store, &mut conn).await;
    // 30 + 20 used, requests 2 and 3's 100 each still reserved.
    assert!(near(r, REQUESTS - 4.0) && near(t, TOKENS - 250.0), "{r} {t}");
    let model = [("L5:m", "m")];
    assert_eq!(
        lease_used(&mut conn).await,
        entries(&[&report[..], &landed_1[..], &model[..]].concat()),
        "kept for the late records and the charge"
    );
    assert!(!store.lease_report("acme", "L5", 5, 500, 5 * 10).await.unwrap(), "no report after the reclaim");

    // Request 2's usage arrives (40 used): it settles against the reservation the reclaim kept,
    // and joins the landed counts, so the charge leaves it out.
    assert_eq!(apply("n.2", 40, 2).await, Applied::Applied);
    let (r, t) = levels(&config, &store, &mut conn).await;
    assert!(near(r, REQUESTS - 4.0) && near(t, TOKENS - 190.0), "{r} {t}");
    assert_eq!(lease_used(&mut conn).await.get("L5:lt").map(String::as_str), Some("200"));
    // Request 5's (10 used): the reclaim gave its reservation back, so it pays it again.
    assert_eq!(apply("n.5", 10, 5).await, Applied::Applied);
    let (r, t) = levels(&config, &store, &mut conn).await;
    assert!(near(r, REQUESTS - 5.0) && near(t, TOKENS - 200.0), "{r} {t}");

    // The longest stream lifetime after the reclaim (here: at once), request 3's usage has not
    // arrived: its reservation is charged as usage, once whoever asks.
    assert_eq!(store.lease_charges_due("acme", Duration::from_secs(600), 10).await.unwrap(), []);
    let due = store.lease_charges_due("acme", Duration::ZERO, 10).await.unwrap();
    assert_eq!(due, [("L5".to_owned(), "m".to_owned())]);
    let charge = store.lease_charge("acme", "L5", "m").await.unwrap();
    let expected = LeaseCharge { requests: 1, tokens: 100, prompt_tokens: 10 };
    assert_eq!(charge, Some(expected));
    assert_eq!(store.lease_charge("acme", "L5", "m").await.unwrap(), None, "charged once");
    assert_eq!(store.lease_charges_due("acme", Duration::ZERO, 10).await.unwrap(), []);
    assert_eq!(lease_used(&mut conn).await, entries(&[("L5:a", "3")]), "kept for the late records");
    // The usage hash: four records (prompt 10 each; completion 20 + 10 + 30 + 0) and the charge
    // (prompt 10, completion 90), priced 1 and 2 USD per 1M tokens (1,000 and 2,000 nano-dollars
    // each); the day's quota counter: 100 used and 100 charged.
    let day = usage_today(&mut conn).await;
    let get = |f: &str| day.get(f).copied();
    assert_eq!(
        (get("m:requests"), get("m:prompt_tokens"), get("m:completion_tokens")),
        (Some(5), Some(50), Some(150))
    );
    assert_eq!(get("m:cost_nano_usd"), Some(50 * 1_000 + 150 * 2_000));
    let now = unix_now();
    let quota_key = quota::quota_key("llmgw", "acme", None, quota::Period::Day, &quota::day_label(now));
    let used: Option<i64> = redis::cmd("GET").arg(&quota_key).query_async(&mut conn).await.unwrap();
    assert_eq!(used, Some(200));
    // Its usage event, once: one event for the lease's charged requests.
    assert!(store.append_lease_charge("acme", "L5", "m", &expected).await.unwrap());
    assert!(!store.append_lease_charge("acme", "L5", "m", &expected).await.unwrap());
    let events: Vec<(String, std::collections::HashMap<String, Vec<u8>>)> =
        redis::cmd("XRANGE").arg("usage").arg("-").arg("+").query_async(&mut conn).await.unwrap();
    assert_eq!(events.len(), 1);
    let event = UsageEvent::decode(events[0].1["event"].as_slice()).unwrap();
    assert_eq!(
        (event.record_id.as_str(), event.requests, event.prompt_tokens, event.completion_tokens),
        ("lease.L5", 1, 10, 90)
    );
    assert_eq!(event.end_reason, EndReason::Unreported as i32);
    assert_eq!(event.cost_nano_usd, 10 * 1_000 + 90 * 2_000);

    // Request 3's usage arrives after all (50 used): its reservation was charged, it is not
    // applied; nothing moves.
    assert_eq!(apply("n.3", 50, 3).await, Applied::AfterCharge);
    let (r, t) = levels(&config, &store, &mut conn).await;
    assert!(near(r, REQUESTS - 5.0) && near(t, TOKENS - 200.0), "{r} {t}");
    // Each once.
    assert_eq!(apply("n.2", 40, 2).await, Applied::AfterCharge);
    assert_eq!(apply("n.5", 10, 5).await, Applied::Duplicate);
    let (r, t) = levels(&config, &store, &mut conn).await;
    assert!(near(r, REQUESTS - 5.0) && near(t, TOKENS - 200.0), "{r} {t}");
    assert_eq!(usage_today(&mut conn).await.get("m:requests"), Some(&5));
}

#[tokio::test]
async fn reports_drop_the_entries_they_cover_and_a_give_back_drops_the_rest() {
    let redis = Redis::start();
    let (config, store, mut conn) = setup(&redis).await;
    let size = take(&config, &store, "L6").await;
    take(&config, &store, "L7").await;
    let apply = |id: &'static str, lease: &'static str, seq: Option<u64>| {
        let (record, settlements, lease) = numbered(&config, &store, id, lease, 50, seq);
        let store = &store;
        async move { store.apply(&record, &settlements, false, lease.as_ref()).await.unwrap() }
    };
    assert_eq!(apply("o.1", "L7", None).await, Applied::Applied);
    assert_eq!(apply("o.2", "L6", Some(1)).await, Applied::Applied);
    assert_eq!(apply("o.3", "L6", Some(2)).await, Applied::Applied);
    let l7 = [("L7:r", "1"), ("L7:t", "100")];
    let with_l7 = |more: &[(&'static str, &'static str)]| entries(&[&l7[..], more].concat());
    assert_eq!(lease_used(&mut conn).await, with_l7(&[("L6:#1", "100:10"), ("L6:#2", "100:10")]));
    // Fewer covered than LU holds: named one by one, and counted landed.
    assert!(store.lease_report("acme", "L6", 2, 200, 2 * 10).await.unwrap());
    let report_2 = [("L6:a", "2"), ("L6:at", "200"), ("L6:ap", "20")];
    let landed_2 = [("L6:l", "2"), ("L6:lt", "200"), ("L6:lp", "20")];
    assert_eq!(lease_used(&mut conn).await, with_l7(&[&report_2[..], &landed_2[..]].concat()));
    // More covered than LU holds: found among LU's entries.
    assert_eq!(apply("o.4", "L6", Some(11)).await, Applied::Applied);
    assert_eq!(apply("o.5", "L6", Some(31)).await, Applied::Applied);
    assert!(store.lease_report("acme", "L6", 20, 2_000, 20 * 10).await.unwrap());
    assert_eq!(
        lease_used(&mut conn).await,
        with_l7(&[
            ("L6:a", "20"),
            ("L6:at", "2000"),
            ("L6:ap", "200"),
            ("L6:l", "3"),
            ("L6:lt", "300"),
            ("L6:lp", "30"),
            ("L6:#31", "100:10")
        ])
    );
    // The filter gives L6 back: all of its entries go, L7's stay.
    let back = admission_lease::give_back(&size.plan, 60, 6_000);
    assert!(store.lease_return("acme", "L6", &back).await.unwrap());
    assert_eq!(lease_used(&mut conn).await, with_l7(&[]));
    assert!(!store.lease_report("acme", "L6", 40, 4_000, 40 * 10).await.unwrap(), "given back: no report");
    assert_eq!(lease_used(&mut conn).await, with_l7(&[]));
}

#[tokio::test]
async fn a_lease_reclaimed_by_an_older_sidecar_is_charged_nothing() {
    let redis = Redis::start();
    let (config, store, mut conn) = setup(&redis).await;
    take(&config, &store, "L8").await;
    assert!(store.lease_report("acme", "L8", 2, 200, 20).await.unwrap());
    // Due for its charge at once (a longest stream lifetime of 0), yet kept for the sweeps that
    // come later: a day and more.
    let back = store.lease_reclaim("acme", "L8", &plan(&config, &store), Duration::ZERO).await;
    assert_eq!(back.unwrap(), Some((98, 9_800)));
    for key in [ledger::leases_reclaimed_key("llmgw", "acme"), ledger::lease_used_key("llmgw", "acme")] {
        let ttl: i64 = redis::cmd("PTTL").arg(&key).query_async(&mut conn).await.unwrap();
        assert!(ttl > ledger::KEEP_MARGIN.as_millis() as i64 - 60_000, "{key}: {ttl} ms");
    }
    // An older sidecar's reclaim kept neither the model nor the landed counts: the requests it
    // reported cannot be told landed or not, so none is charged (as that sidecar charged none).
    let _: () = redis::cmd("HDEL")
        .arg(ledger::lease_used_key("llmgw", "acme"))
        .arg("L8:m")
        .arg("L8:l")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(
        store.lease_charges_due("acme", Duration::ZERO, 10).await.unwrap(),
        [("L8".to_owned(), String::new())]
    );
    assert_eq!(store.lease_charge("acme", "L8", "").await.unwrap(), Some(LeaseCharge::default()));
    assert_eq!(store.lease_charges_due("acme", Duration::ZERO, 10).await.unwrap(), []);
    let day = usage_today(&mut conn).await;
    assert!(day.is_empty(), "{day:?}");
}
