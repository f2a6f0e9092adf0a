//! What the ledger's per-request Redis work costs (issue 14): one request's calls as the sidecar
//! makes them, timed through the real [`Store`] against a running Redis, with Redis's own time per
//! script call (`INFO commandstats`, `cmdstat_evalsha`'s `usec_per_call`):
//!
//! - `before`: the take without the reservation (`token_bucket_take_v3.lua` as v2 was), the
//!   record without a reservation to close, and the settlement of the TPM bucket as a call of its
//!   own (`token_bucket_settle_v1.lua`): three calls per request.
//! - `now`: the take recording the reservation, and the record closing it and settling the bucket
//!   in the same call: two calls per request.
//!
//! Then the Redis memory an open reservation holds (a request in flight): `N` takes that record
//! one, with no record to close them, `INFO memory` `used_memory` before and after (the buckets of
//! 4 tenants included).
//!
//! Requests run `CONCURRENCY` at a time (the sidecar's calls share one multiplexed connection).
//! The stream append (`XADD`) is the same in both and left out.
//!
//! ```sh
//! redis-server --port 6390 --save '' --appendonly no &
//! cargo run --release -p gateway-ext-proc --example ledger_cost -- redis://127.0.0.1:6390/0 20000
//! ```
//!
//! Flushes the database first: point it at a Redis of its own.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing, missing_docs)]

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use gateway_ext_proc::admission::limits::{BucketKind, BucketSpec};
use gateway_ext_proc::config::redis::RedisConfig;
use gateway_ext_proc::metering::ledger::Reservation;
use gateway_ext_proc::metering::meter::{EndReason, RequestInfo, UsageRecord, UsageSource};
use gateway_ext_proc::store::{Store, Tracking};

const CONCURRENCY: usize = 16;

/// `cmdstat_evalsha`'s calls and microseconds.
async fn evalsha_stats(conn: &mut redis::aio::MultiplexedConnection) -> (u64, u64) {
    let info: String = redis::cmd("INFO").arg("commandstats").query_async(conn).await.unwrap_or_default();
    let Some(line) = info.lines().find(|l| l.starts_with("cmdstat_evalsha:")) else { return (0, 0) };
    let field = |name: &str| {
        line.split([':', ','])
            .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('=')?.parse().ok())
            .unwrap_or(0)
    };
    (field("calls"), field("usec"))
}

fn record(tenant: &str, i: u64, start_ms: u64) -> UsageRecord {
    UsageRecord {
        info: RequestInfo {
            request_id: format!("{i:08x}-0000-4000-8000-000000000000"),
            tenant: tenant.to_owned(),
            api_key: None,
            model: "m".to_owned(),
            pool: "p".to_owned(),
            prompt_tokens_estimate: 100,
            max_tokens: 200,
            reserved_tokens: 300,
            reserved_locally: false,
            tier: "standard".to_owned(),
            record_id: format!("{i:08x}-0000-4000-8000-000000000000.{:016x}", i.wrapping_mul(0x9e37_79b9)),
            lease_id: None,
            lease_seq: None,
            prompt_tokens_max: None,
            completion_tokens_max: None,
            operation: None,
            upstream_model: None,
        },
        prompt_tokens: 100,
        completion_tokens: 150,
        cached_tokens: 0,
        ttft_us: 50_000,
        tpot_us: 20_000,
        duration_us: 4_000_000,
        status: 200,
        end_reason: EndReason::Completed,
        usage_source: UsageSource::Upstream,
        finished_at_unix_ms: start_ms + i,
        unreported: false,
        unusable: None,
    }
}

/// One request's calls; `now`: the ledger's, else the calls before it.
async fn request(store: &Store, plan: &[BucketSpec], r: &UsageRecord, now: bool) {
    let tpm = &plan[1];
    let reservation = Reservation {
        v: 1,
        reserved: 300,
        prompt: 100,
        max_tokens: 200,
        model: r.info.model.clone(),
        pool: r.info.pool.clone(),
        tier: r.info.tier.clone(),
        request_id: r.info.request_id.clone(),
        at_ms: r.finished_at_unix_ms,
        quota: 0,
        qday: String::new(),
        qmonth: String::new(),
        api_key: None,
    };
    let tracking = Tracking {
        tenant: &r.info.tenant,
        record_id: &r.info.record_id,
        reservation: &reservation,
        keep: Duration::from_secs(3900 + 86_400),
    };
    let settlement = (BucketSpec { cost: 0, ..tpm.clone() }, 300 - 250);
    if now {
        store.take(plan, &[], Some(&tracking)).await.unwrap();
        store.apply(r, &[settlement], false, None).await.unwrap();
    } else {
        store.take(plan, &[], None).await.unwrap();
        store.apply(r, &[], false, None).await.unwrap();
        store.settle(&settlement.0, settlement.1).await.unwrap();
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let url = args.next().unwrap_or_else(|| "redis://127.0.0.1:6390/0".to_owned());
    let n: u64 = args.next().map(|s| s.parse()).transpose()?.unwrap_or(20_000);
    let config: RedisConfig = serde_yaml_ng::from_str(&format!("url: {url}\ncommand_timeout_ms: 2000"))?;
    let store = Store::connect(&config, "bench:usage-events".to_owned(), 1_000_000).await?;
    let client = redis::Client::open(url.as_str())?;
    let mut conn = client.get_multiplexed_async_connection().await?;
    let start_ms = SystemTime::now().duration_since(UNIX_EPOCH)?.as_millis() as u64;
    for round in 0..2 {
        for now in [false, true] {
            let _: () = redis::cmd("FLUSHALL").query_async(&mut conn).await?;
            let _: () = redis::cmd("CONFIG").arg("RESETSTAT").query_async(&mut conn).await?;
            let tenant = if now { "now" } else { "before" };
            let bucket = |kind, key: &str, cost| BucketSpec {
                kind,
                key: format!("llmgw:rl:{{{tenant}}}:{key}"),
                capacity: 1_000_000_000,
                rate_per_minute: 1_000_000_000,
                cost,
            };
            let plan = [bucket(BucketKind::Requests, "rpm", 1), bucket(BucketKind::Tokens, "tpm", 300)];
            let started = Instant::now();
            let mut i = 0;
            while i < n {
                let batch: Vec<_> =
                    (i..(i + CONCURRENCY as u64).min(n)).map(|j| record(tenant, j, start_ms)).collect();
                futures::future::join_all(batch.iter().map(|r| request(&store, &plan, r, now))).await;
                i += CONCURRENCY as u64;
            }
            let elapsed = started.elapsed();
            let (calls, usec) = evalsha_stats(&mut conn).await;
            let open: u64 = redis::cmd("HLEN")
                .arg(format!("llmgw:reservations:{{{tenant}}}"))
                .query_async(&mut conn)
                .await?;
            println!(
                "round {round} {tenant:>6}: {n} requests in {:.2} s ({:.0} req/s), {:.2} script calls/request, \
                 Redis {:.1} us of scripts/request ({:.1} us/call), {open} reservations left open",
                elapsed.as_secs_f64(),
                n as f64 / elapsed.as_secs_f64(),
                calls as f64 / n as f64,
                usec as f64 / n as f64,
                usec as f64 / calls.max(1) as f64,
            );
        }
    }
    // Redis memory of open reservations (requests in flight): takes that record one, no records.
    let _: () = redis::cmd("FLUSHALL").query_async(&mut conn).await?;
    let info: String = redis::cmd("INFO").arg("memory").query_async(&mut conn).await?;
    let before = used_memory(&info);
    let tenants = 4;
    let store = &store;
    let mut i = 0;
    while i < n {
        let batch: Vec<_> = (i..(i + CONCURRENCY as u64).min(n))
            .map(|j| record(&format!("t{}", j % tenants), j, start_ms))
            .collect();
        futures::future::join_all(batch.iter().map(|r| async move {
            let bucket = |kind, key: &str, cost| BucketSpec {
                kind,
                key: format!("llmgw:rl:{{{}}}:{key}", r.info.tenant),
                capacity: 1_000_000_000,
                rate_per_minute: 1_000_000_000,
                cost,
            };
            let plan = [bucket(BucketKind::Requests, "rpm", 1), bucket(BucketKind::Tokens, "tpm", 300)];
            let reservation = Reservation {
                v: 1,
                reserved: 300,
                prompt: 100,
                max_tokens: 200,
                model: r.info.model.clone(),
                pool: r.info.pool.clone(),
                tier: r.info.tier.clone(),
                request_id: r.info.request_id.clone(),
                at_ms: r.finished_at_unix_ms,
                quota: 0,
                qday: String::new(),
                qmonth: String::new(),
                api_key: None,
            };
            let tracking = Tracking {
                tenant: &r.info.tenant,
                record_id: &r.info.record_id,
                reservation: &reservation,
                keep: Duration::from_secs(3900 + 86_400),
            };
            store.take(&plan, &[], Some(&tracking)).await.unwrap();
        }))
        .await;
        i += CONCURRENCY as u64;
    }
    let info: String = redis::cmd("INFO").arg("memory").query_async(&mut conn).await?;
    let after = used_memory(&info);
    println!(
        "open reservations: {n} of {tenants} tenants: used_memory +{} B = {:.1} B per request in flight",
        after.saturating_sub(before),
        after.saturating_sub(before) as f64 / n as f64
    );
    Ok(())
}

fn used_memory(info: &str) -> u64 {
    info.lines().find_map(|l| l.strip_prefix("used_memory:")).and_then(|v| v.trim().parse().ok()).unwrap_or(0)
}
