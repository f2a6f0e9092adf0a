//! Redis: token buckets (Lua scripts run by EVALSHA through `redis::Script`) and usage records
//! (per tenant × model × day hashes, and a Redis Stream of protobuf `UsageEvent`s). Works on a
//! single Redis and on Redis Cluster; every command is bounded by the configured timeout.

mod in_flight;
mod journal;
mod leases;
mod limits;
mod records;

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use redis::aio::{ConnectionLike, ConnectionManager};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, Pipeline, RedisFuture, Script, Value};

use crate::admission::admission_lease::LeaseUse;
use crate::admission::limits::{BucketSpec, ReplyError};
use crate::admission::quota::{self, QuotaBook};
use crate::config::redis::RedisConfig;
use crate::metering::ledger;
use crate::metering::meter::UsageRecord;
use arc_swap::ArcSwap;

/// `lua/token_bucket_take_v3.lua`: take a cost from every bucket or from none, plus leases.
const TAKE_LUA: &str = include_str!("../../lua/token_bucket_take_v3.lua");
/// `lua/token_bucket_settle_v1.lua`: settle a reservation against the real usage.
const SETTLE_LUA: &str = include_str!("../../lua/token_bucket_settle_v1.lua");
/// `lua/token_bucket_reconcile_v1.lua`: charge what was admitted while Redis could not decide.
const RECONCILE_LUA: &str = include_str!("../../lua/token_bucket_reconcile_v1.lua");
/// `lua/ledger_v1.lua`: the ledger's writes for one request (record, charge, release,
/// rereserve, claim), each applied once.
const LEDGER_LUA: &str = include_str!("../../lua/ledger_v1.lua");
/// `lua/in_flight_flush_v1.lua`: a replica's in-flight counts of a pool, and the pool's total.
const IN_FLIGHT_LUA: &str = include_str!("../../lua/in_flight_flush_v1.lua");

/// Appends usage events once per record id (see [`Store::append`], [`Store::append_batch`]):
/// KEYS[1] the stream, KEYS[1 + j] record j's sent-set; ARGV[1] the stream's MAXLEN, then per
/// record j from ARGV[2 + 4(j - 1)]: record id, the sent-set's expiry (unix s), event, tenant.
/// Returns {1 appended, or 0: appended before} per record. A sent-set's expiry is set once per
/// call for each value asked (a batch's records mostly share one set and one expiry).
const APPEND_ONCE_LUA: &str = r"
local out, expiry = {}, {}
for j = 1, #KEYS - 1 do
  local a = 2 + 4 * (j - 1)
  if redis.call('SADD', KEYS[1 + j], ARGV[a]) == 0 then
    out[j] = 0
  else
    if expiry[KEYS[1 + j]] ~= ARGV[a + 1] then
      redis.call('EXPIREAT', KEYS[1 + j], ARGV[a + 1])
      expiry[KEYS[1 + j]] = ARGV[a + 1]
    end
    redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[1], '*', 'event', ARGV[a + 2], 'tenant', ARGV[a + 3], 'record_id', ARGV[a])
    out[j] = 1
  end
end
return out
";

/// Takes or renews a usage journal's lease for `owner` (`crate::metering::journal`).
const JOURNAL_LEASE_LUA: &str = r"
local holder = redis.call('GET', KEYS[1])
if holder == false then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
elseif holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
";

/// Moves a usage journal's checkpoint, only while `owner` holds the lease, and renews the lease
/// (a long backlog is read batch after batch between two polls).
const JOURNAL_COMMIT_LUA: &str = r"
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
redis.call('HSET', KEYS[2], 'dev', ARGV[2], 'ino', ARGV[3], 'offset', ARGV[4])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
return 1
";

/// Gives a usage journal's lease up, if `owner` holds it.
const JOURNAL_RELEASE_LUA: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
";

/// What an admission's take records of its reservation ([`Store::take`]).
#[derive(Debug, Clone, Copy)]
pub struct Tracking<'a> {
    /// The tenant (the reservation keys' hash tag, the same as the plan's buckets').
    pub tenant: &'a str,
    /// The request's record id ([`gateway_contract::record_id`]).
    pub record_id: &'a str,
    /// What the ledger charges should the request's usage never arrive.
    pub reservation: &'a ledger::Reservation,
    /// How long the reservation keys live past their last write.
    pub keep: Duration,
}

/// What a take records open when it admits: a reservation or an admission lease (the keys of
/// `lua/token_bucket_take_v3.lua`'s reservation section).
struct Opened<'a> {
    hash: String,
    index: String,
    id: &'a str,
    json: String,
    keep: Duration,
}

/// How long after a write attempt that may have landed a retry of the same record is still
/// deduplicated: the set of applied ids of a record's window is kept this long past the later of
/// the window's end and the attempt. The recorder retries such a record for
/// [`IDEMPOTENCY_RETENTION`] minus [`CLOCK_SKEW_MARGIN`] at most
/// ([`crate::metering::recorder`]), then gives it up (logged whole and counted) rather than count it twice.
pub const IDEMPOTENCY_RETENTION: Duration = Duration::from_secs(600);
/// The part of [`IDEMPOTENCY_RETENTION`] the recorder leaves unused, for the clock difference
/// between the sidecar (which computes the expiry) and Redis (which applies it).
pub const CLOCK_SKEW_MARGIN: Duration = Duration::from_secs(60);
/// Width of the finish-time windows whose applied record ids share one set, in seconds.
pub const IDEMPOTENCY_WINDOW_SECS: u64 = 10;

/// Errors talking to Redis.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The command did not answer within `redis.command_timeout_ms`.
    #[error("redis command timed out after {0:?}")]
    Timeout(Duration),
    /// Redis answered with an error, or the connection failed.
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    /// A script answered with an unexpected shape.
    #[error(transparent)]
    Reply(#[from] ReplyError),
}

impl StoreError {
    /// Whether the command may have been applied although it failed: a timeout, or a connection
    /// lost after the command may have been sent. An error Redis answered, or a connection that
    /// was refused, applied nothing.
    pub fn maybe_applied(&self) -> bool {
        match self {
            StoreError::Timeout(_) => true,
            StoreError::Redis(e) => {
                !e.is_connection_refusal()
                    && (e.is_io_error()
                        || e.is_timeout()
                        || e.is_connection_dropped()
                        || e.is_unrecoverable_error())
            }
            StoreError::Reply(_) => false,
        }
    }
}

#[derive(Clone)]
enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Single(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Single(c) => c.req_packed_commands(cmd, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(cmd, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}

/// Consecutive failed commands after which a Redis Cluster connection is rebuilt.
const CLUSTER_RECONNECT_AFTER_FAILURES: u32 = 8;
/// Least time between two rebuilds of a Redis Cluster connection.
const CLUSTER_RECONNECT_INTERVAL: Duration = Duration::from_secs(1);

/// A Redis Cluster connection that is rebuilt from its client when commands keep failing: after
/// a node crashes and comes back on the same address, redis-rs's cluster connection was seen to
/// time out every command to it for good (bench/over_admission.py --kill-node-at-s).
struct ClusterHandle {
    client: ClusterClient,
    failures: AtomicU32,
    rebuilding: AtomicBool,
}

/// The sidecar's Redis client. Cheap to clone (connections are multiplexed).
#[derive(Clone)]
pub struct Store {
    conn: Arc<RwLock<Conn>>,
    cluster: Option<Arc<ClusterHandle>>,
    take: Script,
    settle: Script,
    reconcile: Script,
    ledger: Script,
    in_flight: Script,
    /// The usage stream's append-once script (its SHA-1 computed once, not per record).
    append_once: Script,
    timeout: Duration,
    prefix: String,
    stream: String,
    stream_maxlen: u64,
    /// The quotas and prices, shared by every clone and swapped whole by a config reload
    /// ([`Store::set_quotas`]).
    book: Arc<ArcSwap<QuotaBook>>,
}

impl Store {
    /// Connects to the single Redis or the cluster named in the config.
    ///
    /// # Errors
    /// [`StoreError`] when the first connection fails.
    pub async fn connect(
        config: &RedisConfig,
        stream: String,
        stream_maxlen: u64,
    ) -> Result<Self, StoreError> {
        let timeout = Duration::from_millis(config.command_timeout_ms);
        let mut cluster = None;
        let conn = match &config.url {
            Some(url) => {
                let client = single_client(url, config)?;
                let cfg = redis::aio::ConnectionManagerConfig::new()
                    .set_response_timeout(Some(timeout))
                    .set_connection_timeout(Some(Duration::from_secs(2)));
                Conn::Single(ConnectionManager::new_with_config(client, cfg).await?)
            }
            None => {
                let mut builder = redis::cluster::ClusterClientBuilder::new(config.cluster_urls.clone())
                    .response_timeout(timeout)
                    .connection_timeout(Duration::from_secs(2));
                if let Some(username) = &config.username {
                    builder = builder.username(username);
                }
                if let Some(password) = &config.secrets.password {
                    builder = builder.password(password.expose());
                }
                if let Some(certs) = tls_certificates(config) {
                    builder = builder.certs(certs);
                }
                let client = builder.build()?;
                let conn = Conn::Cluster(client.get_async_connection().await?);
                cluster = Some(Arc::new(ClusterHandle {
                    client,
                    failures: AtomicU32::new(0),
                    rebuilding: AtomicBool::new(false),
                }));
                conn
            }
        };
        Ok(Self {
            conn: Arc::new(RwLock::new(conn)),
            cluster,
            take: Script::new(TAKE_LUA),
            settle: Script::new(SETTLE_LUA),
            reconcile: Script::new(RECONCILE_LUA),
            ledger: Script::new(LEDGER_LUA),
            in_flight: Script::new(IN_FLIGHT_LUA),
            append_once: Script::new(APPEND_ONCE_LUA),
            timeout,
            prefix: config.key_prefix.clone(),
            stream,
            stream_maxlen,
            book: Arc::new(ArcSwap::from_pointee(QuotaBook::default())),
        })
    }

    /// The same store, correcting the quota counters of `book` with every record, charge and
    /// give-back, and pricing every record with its prices ([`crate::admission::quota`]).
    #[must_use]
    pub fn with_quotas(mut self, book: Arc<QuotaBook>) -> Self {
        self.book = Arc::new(ArcSwap::new(book));
        self
    }

    /// Replaces the quotas and prices of this store and of every clone of it (a config reload):
    /// calls that start after it count and price by `book`.
    pub fn set_quotas(&self, book: Arc<QuotaBook>) {
        self.book.store(book);
    }

    /// The quotas and prices now.
    pub fn quotas(&self) -> Arc<QuotaBook> {
        self.book.load_full()
    }

    /// The key prefix (`redis.key_prefix`).
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The current connection (a cheap handle).
    fn conn(&self) -> Conn {
        match self.conn.read() {
            Ok(c) => c.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    async fn bounded<T>(
        &self,
        f: impl std::future::Future<Output = redis::RedisResult<T>>,
    ) -> Result<T, StoreError> {
        let result = match tokio::time::timeout(self.timeout, f).await {
            Ok(r) => r.map_err(StoreError::from),
            Err(_) => Err(StoreError::Timeout(self.timeout)),
        };
        if let Some(cluster) = &self.cluster {
            match &result {
                Ok(_) => cluster.failures.store(0, Ordering::Relaxed),
                Err(StoreError::Reply(_)) => {}
                Err(_) => {
                    let failures = cluster.failures.fetch_add(1, Ordering::Relaxed) + 1;
                    if failures >= CLUSTER_RECONNECT_AFTER_FAILURES {
                        self.rebuild_cluster_connection(cluster);
                    }
                }
            }
        }
        result
    }

    /// Builds a new cluster connection in the background and swaps it in (at most one at a time,
    /// and at most once per [`CLUSTER_RECONNECT_INTERVAL`]).
    fn rebuild_cluster_connection(&self, cluster: &Arc<ClusterHandle>) {
        if cluster.rebuilding.swap(true, Ordering::AcqRel) {
            return;
        }
        let cluster = Arc::clone(cluster);
        let slot = Arc::clone(&self.conn);
        tokio::spawn(async move {
            match cluster.client.get_async_connection().await {
                Ok(fresh) => {
                    if let Ok(mut conn) = slot.write() {
                        *conn = Conn::Cluster(fresh);
                    }
                    cluster.failures.store(0, Ordering::Relaxed);
                    tracing::warn!("redis cluster connection rebuilt after repeated failures");
                }
                Err(e) => tracing::warn!(error = %e, "redis cluster connection rebuild failed"),
            }
            tokio::time::sleep(CLUSTER_RECONNECT_INTERVAL).await;
            cluster.rebuilding.store(false, Ordering::Release);
        });
    }
}

/// The set of record ids appended to `stream` in a finish-time window, in the stream's cluster
/// slot (the stream's own hash tag, else the stream's name as the tag), and when it expires.
pub fn sent_key(stream: &str, finished_secs: u64, now_secs: u64) -> (String, u64) {
    let start = finished_secs - finished_secs % IDEMPOTENCY_WINDOW_SECS;
    let end = start.saturating_add(IDEMPOTENCY_WINDOW_SECS);
    let expire_at = end.max(now_secs).saturating_add(IDEMPOTENCY_RETENTION.as_secs());
    let tagged = stream.find('{').is_some_and(|open| stream[open + 1..].find('}').is_some_and(|len| len > 0));
    // Named after the stream (an ACL's `~prefix:*` covers both) and in its cluster slot: the
    // stream's own hash tag, or one made of its whole name (what an untagged key hashes).
    let key = if tagged || stream.contains(['{', '}']) {
        format!("{stream}:sent:{start}")
    } else {
        format!("{stream}:sent:{{{stream}}}:{start}")
    };
    (key, expire_at)
}

/// What [`Store::apply`] did with a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    /// Its counts and settlements landed now.
    Applied,
    /// Nothing: it was applied before (a retry, a second delivery), or, for a charge, the
    /// reservation is no longer open.
    Duplicate,
    /// Nothing: the request's reservation was charged before its usage arrived (the ledger
    /// billed the reservation).
    AfterCharge,
}

impl Applied {
    /// The meaning of `lua/ledger_v1.lua`'s reply to a `record` or a `charge`.
    fn of_reply(reply: i64) -> Result<Self, StoreError> {
        match reply {
            1 => Ok(Applied::Applied),
            0 => Ok(Applied::Duplicate),
            2 => Ok(Applied::AfterCharge),
            other => Err(StoreError::Reply(ReplyError(format!("ledger_v1.lua record: {other}")))),
        }
    }
}

/// What [`Store::lease_charge`] charged as usage for a reclaimed admission lease: its reported
/// requests whose usage never landed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LeaseCharge {
    /// The requests.
    pub requests: u64,
    /// Their reservations' tokens (prompt estimates plus max tokens).
    pub tokens: u64,
    /// The prompt estimates within `tokens` (charged as prompt tokens; the rest as completion
    /// tokens).
    pub prompt_tokens: u64,
}

/// One write of a [`Store::ledger_batch`].
#[derive(Debug, Clone, Copy)]
pub enum LedgerWrite<'a> {
    /// A record or a charge, as [`Store::apply`] takes it.
    Record {
        /// The record.
        record: &'a UsageRecord,
        /// Bucket and delta.
        settlements: &'a [(BucketSpec, i64)],
        /// A charge (the sweeper's), not a record.
        charge: bool,
        /// The request's part in its admission lease's books.
        lease: Option<&'a LeaseUse>,
    },
    /// A give-back, as [`Store::release`] takes it.
    Release {
        /// The tenant.
        tenant: &'a str,
        /// The request's record id.
        record_id: &'a str,
        /// The request's buckets.
        buckets: &'a [BucketSpec],
    },
}

/// What one write of a [`Store::ledger_batch`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LedgerReply {
    /// A record's or a charge's outcome.
    Record(Applied),
    /// A release's: whether the reservation was open (closed now).
    Released(bool),
    /// The write raised an error in the script; it may have landed in part.
    Failed,
}

/// One `lua/ledger_v1.lua` (or append) call's keys and arguments, built before the invocation so
/// several of them can travel as one `batch`.
#[derive(Debug, Default)]
struct Call {
    keys: Vec<Vec<u8>>,
    args: Vec<Vec<u8>>,
}

impl Call {
    fn key<T: redis::ToRedisArgs>(&mut self, key: T) -> &mut Self {
        self.keys.extend(key.to_redis_args());
        self
    }

    fn arg<T: redis::ToRedisArgs>(&mut self, arg: T) -> &mut Self {
        self.args.extend(arg.to_redis_args());
        self
    }

    fn invocation<'a>(&self, script: &'a Script) -> redis::ScriptInvocation<'a> {
        let mut inv = script.prepare_invoke();
        for key in &self.keys {
            inv.key(key);
        }
        for arg in &self.args {
            inv.arg(arg);
        }
        inv
    }
}

/// Unix milliseconds now.
fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// A record's date: its end (a record written after an outage keeps its own day), or `now_ms`.
fn finished_ms(record: &UsageRecord, now_ms: u64) -> u64 {
    match record.finished_at_unix_ms {
        0 => now_ms,
        ms => ms,
    }
}

/// A single Redis's client: the URL (`redis://` or `rediss://`, no credentials in it: the
/// config refuses them), with `redis.username` and the password, and for `rediss://` the
/// configured CA and client certificate. The password lives only in the client's connection
/// info, whose `Debug` redacts it.
fn single_client(url: &str, config: &RedisConfig) -> redis::RedisResult<redis::Client> {
    use redis::IntoConnectionInfo;
    let info = url.into_connection_info()?;
    let mut settings = info.redis_settings().clone();
    if let Some(username) = &config.username {
        settings = settings.set_username(username);
    }
    if let Some(password) = &config.secrets.password {
        settings = settings.set_password(password.expose());
    }
    let info = info.set_redis_settings(settings);
    match tls_certificates(config) {
        Some(certs) => redis::Client::build_with_tls(info, certs),
        None => redis::Client::open(info),
    }
}

/// The CA and client certificate of `redis.tls` (None: no `tls` block; `rediss://` then
/// verifies against the system's roots).
fn tls_certificates(config: &RedisConfig) -> Option<redis::TlsCertificates> {
    config.tls.as_ref()?;
    let secrets = &config.secrets;
    Some(redis::TlsCertificates {
        client_tls: secrets.client.as_ref().map(|(cert, key)| redis::ClientTlsConfig {
            client_cert: cert.clone(),
            client_key: key.expose().clone(),
        }),
        root_cert: secrets.ca.clone(),
    })
}

/// The hash of a pool's in-flight counts: `<prefix>:in-flight:{<pool>}` (one key per pool, its
/// own hash tag).
pub fn in_flight_key(prefix: &str, pool: &str) -> String {
    format!("{prefix}:in-flight:{{{pool}}}")
}

/// The set of record ids applied in a tenant's finish-time window
/// (`<prefix>:usage-seen:{<tenant>}:<window start, unix s>`) and the unix time (s) it expires:
/// [`IDEMPOTENCY_RETENTION`] after the later of the window's end and `now_secs`.
pub fn seen_key(prefix: &str, tenant: &str, finished_secs: u64, now_secs: u64) -> (String, u64) {
    let start = finished_secs - finished_secs % IDEMPOTENCY_WINDOW_SECS;
    let end = start.saturating_add(IDEMPOTENCY_WINDOW_SECS);
    let expire_at = end.max(now_secs).saturating_add(IDEMPOTENCY_RETENTION.as_secs());
    (format!("{prefix}:usage-seen:{{{tenant}}}:{start}"), expire_at)
}

/// The daily usage hash of a tenant: `<prefix>:usage:{<tenant>}:<YYYY-MM-DD>` (UTC).
pub fn usage_key(prefix: &str, tenant: &str, unix_secs: u64) -> String {
    usage_key_of_day(prefix, tenant, &quota::day_label(unix_secs))
}

/// The daily usage hash of a tenant for a `YYYY-MM-DD` day (`gatewayctl usage` reads it).
pub fn usage_key_of_day(prefix: &str, tenant: &str, day: &str) -> String {
    format!("{prefix}:usage:{{{tenant}}}:{day}")
}

/// One replica's flush of a pool's in-flight counts (`lua/in_flight_flush_v1.lua`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InFlightFlush {
    /// The replica's admitted minus finished requests of the pool since it started.
    pub balance: i64,
    /// The replica's admitted requests of the pool since it started.
    pub admitted: u64,
    /// Upper bound on the pool's in-flight requests from vLLM's metrics, with the pool-wide
    /// admitted sum it was computed at (see [`crate::pools::signals::in_flight_bound`]); None: no
    /// fresh metrics, no correction.
    pub bound: Option<(u64, u64)>,
    /// Count the replicas that flushed within this long ([`InFlightTotal::replicas`]).
    pub live_within: Duration,
}

/// What Redis answered to an [`InFlightFlush`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InFlightTotal {
    /// The pool's in-flight requests over every replica (after any correction; may be below 0
    /// while leased admissions are reported after they finish).
    pub total: i64,
    /// Requests admitted to the pool over every replica, ever.
    pub admitted: u64,
    /// What the bound took off the total (negative: a total below 0 raised to 0 at idle).
    pub correction: i64,
    /// The sidecar replicas that flushed the pool's counts within [`InFlightFlush::live_within`],
    /// this one included (at least 1).
    pub replicas: u64,
}

/// Replicas that have not flushed a pool's counts for this long are folded into the pool's
/// base (their process is gone); their counts stay in the sum.
pub const IN_FLIGHT_REPLICA_GONE: Duration = Duration::from_secs(3600);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn appended_id_sets_share_the_streams_name_and_slot() {
        // Untagged: the stream's name as the tag (an untagged key hashes its whole name), and the
        // stream's name first, so an ACL's `~llmgw:*` covers it.
        assert_eq!(
            sent_key("llmgw:usage-events", 25, 25).0,
            "llmgw:usage-events:sent:{llmgw:usage-events}:20"
        );
        assert_eq!(sent_key("{usage}:events", 25, 25).0, "{usage}:events:sent:20");
    }

    #[test]
    fn daily_key_is_utc_date_with_tenant_hash_tag() {
        assert_eq!(usage_key("p", "acme", 0), "p:usage:{acme}:1970-01-01");
        // 2026-11-22T12:00:00Z
        assert_eq!(usage_key("p", "acme", 1_795_348_800), "p:usage:{acme}:2026-11-22");
        // 2024-02-29 (leap day)
        assert_eq!(usage_key("p", "t", 1_709_164_800), "p:usage:{t}:2024-02-29");
    }

    #[test]
    fn seen_sets_are_per_tenant_window_and_outlive_the_retention() {
        let retention = IDEMPOTENCY_RETENTION.as_secs();
        // Written at once: kept the retention past the window's end.
        assert_eq!(
            seen_key("p", "acme", 1_005, 1_005),
            ("p:usage-seen:{acme}:1000".to_owned(), 1_010 + retention)
        );
        assert_eq!(seen_key("p", "acme", 1_009, 1_011).0, "p:usage-seen:{acme}:1000");
        assert_eq!(seen_key("p", "acme", 1_010, 1_010).0, "p:usage-seen:{acme}:1010");
        // Written late (after an outage): kept the retention past the write, never expired at once.
        assert_eq!(seen_key("p", "t", 1_005, 9_000).1, 9_000 + retention);
        assert!(IDEMPOTENCY_RETENTION > CLOCK_SKEW_MARGIN);
    }
}
