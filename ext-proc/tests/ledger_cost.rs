//! What a batch of leased usage records costs Redis (`lua/ledger_v1.lua`, `batch`), as Redis
//! itself counts it (`INFO commandstats`: microseconds inside each command, the script's own
//! `redis.call`s included in `EVALSHA`'s). A probe, not a timed test: it asserts only that every
//! write landed, and prints the microseconds per record. Run it with
//! `BATCH=14 cargo test --release -p gateway-ext-proc --test ledger_cost -- --ignored --nocapture`
//! (`BATCH`: writes per call, default 14, about what the recorder sends at saturation; `ROUNDS`:
//! calls, default 300; `LEASE`: the records' lease section: `unnumbered` (the default: as from a
//! filter that does not number its admissions), `past` (numbered past the lease's last report:
//! each is kept under its number), `covered` (numbered within a report Redis recorded, the section
//! sent all the same), `reported` (numbered within a report Redis recorded, the section without
//! reclaim charges: what the sidecar sends for a record within a report it saw recorded,
//! `admission_lease::ReportedLeases`), `none` (no section: what it sent for those before the
//! lease's charge counted landed requests)).
//!
//! Needs `redis-server` on the PATH (`make setup`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

mod common;

use std::time::Duration;

use common::Redis;
use gateway_ext_proc::admission::admission_lease::{self, LeaseRecord, LeaseUse};
use gateway_ext_proc::admission::limits;
use gateway_ext_proc::config::Config;
use gateway_ext_proc::facts::RequestFacts;
use gateway_ext_proc::metering::ledger;
use gateway_ext_proc::store::{Applied, LedgerReply, Store};

fn env(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

#[tokio::test]
#[ignore = "a probe of Redis's cost: run by hand with --ignored --nocapture"]
async fn leased_records_cost_per_record_in_a_batch() {
    let redis = Redis::start();
    let config = Config::from_yaml(&format!(
        "listen: 127.0.0.1:0
redis: {{url: 'redis://127.0.0.1:{}', lease_fraction: 0.1}}
tenants:
  - {{id: acme, limits: {{requests_per_minute: 1000000, tokens_per_minute: 100000000}}}}
",
        redis.1
    ))
    .unwrap();
    let store = Store::connect(&config.redis, "usage".into(), 1000).await.unwrap();
    let mut conn = redis.conn().await;
    let tenant = config.tenant("acme").unwrap();
    let plan = limits::plan(store.prefix(), tenant, "m", 0);
    let size = admission_lease::size(&plan, 0.1, 100).unwrap();
    let (outcome, _) = store
        .take_lease("acme", "L", &LeaseRecord::of(&size, "m"), Duration::from_secs(600), &size.plan, None)
        .await
        .unwrap();
    assert_eq!(outcome.denied, None);

    let (per_call, calls) = (env("BATCH", 14), env("ROUNDS", 300));
    let mode = std::env::var("LEASE").unwrap_or_else(|_| "unnumbered".into());
    assert!(["unnumbered", "past", "covered", "reported", "none"].contains(&mode.as_str()), "LEASE={mode}");
    if ["covered", "reported", "none"].contains(&mode.as_str()) {
        assert!(store.lease_report("acme", "L", u64::from(u32::MAX), 0, 0).await.unwrap());
    }
    let _: () = redis::cmd("CONFIG").arg("RESETSTAT").query_async(&mut conn).await.unwrap();
    for call in 0..calls {
        let writes: Vec<_> = (0..per_call)
            .map(|i| {
                let facts = RequestFacts {
                    tenant: Some("acme".into()),
                    model: "m".into(),
                    prompt_tokens: 10,
                    max_tokens: 90,
                    request_id: format!("r.{call}.{i}"),
                    leased_tokens: Some(100),
                    lease_id: Some("L".into()),
                    ..Default::default()
                };
                let mut record = ledger::charged_record(
                    "acme",
                    &facts.request_id,
                    &ledger::Reservation::of(&facts, 100, 0),
                );
                record.info.lease_id = facts.lease_id.clone();
                let seq = (mode != "unnumbered").then_some((call * per_call + i + 1) as u64);
                record.info.lease_seq = seq;
                record.unreported = false;
                (record.prompt_tokens, record.completion_tokens, record.finished_at_unix_ms) = (10, 20, 0);
                let settlements =
                    ledger::settlements(limits::token_buckets(store.prefix(), tenant, "m"), 100, 30);
                let charges: &[_] = if mode == "reported" { &[] } else { &plan };
                let lease =
                    (mode != "none").then(|| LeaseUse::of(Some("L"), seq, charges, 100, 10)).flatten();
                (record, settlements, lease)
            })
            .collect();
        let batch = common::record_writes(&writes);
        let replies = store.ledger_batch(&batch).await.unwrap();
        assert!(replies.iter().all(|r| *r == LedgerReply::Record(Applied::Applied)), "{replies:?}");
    }
    let records = (per_call * calls) as f64;
    let info: String = redis::cmd("INFO").arg("commandstats").query_async(&mut conn).await.unwrap();
    println!("{calls} calls of {per_call} leased records (lease section: {mode}); inside Redis, per record:");
    for line in info.lines().filter(|l| l.starts_with("cmdstat_")) {
        let field = |name: &str| -> f64 {
            line.split(&format!("{name}=")).nth(1).and_then(|v| v.split(',').next()).unwrap().parse().unwrap()
        };
        println!(
            "  {:28} {:6.2} calls {:7.2} µs",
            line.split(':').next().unwrap(),
            field("calls") / records,
            field("usec") / records
        );
    }
}
