//! The usage ledger's Redis memory per request: writes `N` usage records through the real
//! [`Store::apply`] and [`Store::append`] (the sidecar's own write path and Lua script) to a
//! running Redis and reads `INFO memory` `used_memory` before and after. The usage-event stream is bounded on its own
//! (`metering.stream_maxlen`) and is measured apart (`MEMORY USAGE` of the stream) and left out
//! of the ledger's figure.
//!
//! ```sh
//! redis-server --port 6390 --save '' --appendonly no &
//! cargo run --release -p gateway-ext-proc --example ledger_memory -- redis://127.0.0.1:6390/0 200000
//! ```
//!
//! Prints bytes per request (ledger only) and, for the time the ledger holds a record's id
//! (`store::IDEMPOTENCY_RETENTION` past its 10 s window), the memory of 1,000 req/s sustained. Flushes the database first: point it
//! at a Redis of its own.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use gateway_ext_proc::config::redis::RedisConfig;
use gateway_ext_proc::metering::meter::{EndReason, RequestInfo, UsageRecord, UsageSource};
use gateway_ext_proc::store::{Store, IDEMPOTENCY_RETENTION, IDEMPOTENCY_WINDOW_SECS};

fn used_memory(info: &str) -> u64 {
    info.lines().find_map(|l| l.strip_prefix("used_memory:")).and_then(|v| v.trim().parse().ok()).unwrap_or(0)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let url = args.next().unwrap_or_else(|| "redis://127.0.0.1:6390/0".to_owned());
    let n: u64 = args.next().map(|s| s.parse()).transpose()?.unwrap_or(100_000);
    let tenants: u64 = args.next().map(|s| s.parse()).transpose()?.unwrap_or(4);
    let config: RedisConfig = serde_yaml_ng::from_str(&format!("url: {url}\ncommand_timeout_ms: 2000"))?;
    let stream = "bench:usage-events".to_owned();
    let store = Store::connect(&config, stream.clone(), 1_000_000).await?;
    let client = redis::Client::open(url.as_str())?;
    let mut conn = client.get_multiplexed_async_connection().await?;
    let _: () = redis::cmd("FLUSHALL").query_async(&mut conn).await?;
    let before = used_memory(&redis::cmd("INFO").arg("memory").query_async::<String>(&mut conn).await?);
    let start_ms = SystemTime::now().duration_since(UNIX_EPOCH)?.as_millis() as u64;
    // Ids as the ledger makes them: a UUID-shaped x-request-id and the filter's 64-bit nonce.
    let seed = 0x9e37_79b9_7f4a_7c15_u64 ^ start_ms;
    let mut pending = Vec::new();
    for i in 0..n {
        let request_id = format!("{:08x}-0000-4000-8000-{:012x}", i, seed & 0xffff_ffff_ffff);
        let record_id =
            gateway_contract::record_id(&request_id, &format!("{:016x}", seed.wrapping_mul(i + 1)))
                .ok_or("record id")?;
        let record = UsageRecord {
            info: RequestInfo {
                request_id,
                tenant: format!("tenant-{}", i % tenants),
                api_key: None,
                model: "qwen2.5-0.5b-instruct".to_owned(),
                pool: "pool_qwen".to_owned(),
                prompt_tokens_estimate: 100,
                max_tokens: 200,
                reserved_tokens: 300,
                reserved_locally: false,
                tier: "standard".to_owned(),
                record_id,
                lease_id: None,
                lease_seq: None,
                prompt_tokens_max: None,
                completion_tokens_max: None,
                operation: None,
                upstream_model: None,
            },
            prompt_tokens: 100,
            completion_tokens: 200,
            cached_tokens: 0,
            ttft_us: 50_000,
            tpot_us: 20_000,
            duration_us: 4_000_000,
            status: 200,
            end_reason: EndReason::Completed,
            usage_source: UsageSource::Upstream,
            // 1,000 req/s of finish times: the windows the ledger keys by finish time fill as
            // they would at that rate.
            finished_at_unix_ms: start_ms + i,
            unreported: false,
            unusable: None,
        };
        let store = store.clone();
        pending.push(tokio::spawn(async move {
            store.apply(&record, &[], false, None).await?;
            store.append(&record).await
        }));
        if pending.len() >= 256 {
            for p in pending.drain(..) {
                p.await??;
            }
        }
    }
    for p in pending.drain(..) {
        p.await??;
    }
    let info: String = redis::cmd("INFO").arg("memory").query_async(&mut conn).await?;
    let after = used_memory(&info);
    let stream_bytes: u64 =
        redis::cmd("MEMORY").arg("USAGE").arg(&stream).arg("SAMPLES").arg(0).query_async(&mut conn).await?;
    let keys: u64 = redis::cmd("DBSIZE").query_async(&mut conn).await?;
    let ledger = after.saturating_sub(before).saturating_sub(stream_bytes);
    let per_request = ledger as f64 / n as f64;
    // A window's ids are kept the retention past the window's end: ids of up to
    // retention + window seconds are held at any time.
    let retention = IDEMPOTENCY_RETENTION + Duration::from_secs(IDEMPOTENCY_WINDOW_SECS);
    let per_1000 = per_request * 1000.0 * retention.as_secs_f64();
    println!(
        "records {n} tenants {tenants} keys {keys}: used_memory +{} B, stream {stream_bytes} B, ledger {ledger} B \
         = {per_request:.1} B/request; retention {} s -> {:.3} GB per 1,000 req/s sustained",
        after.saturating_sub(before),
        retention.as_secs(),
        per_1000 / 1e9
    );
    Ok(())
}
