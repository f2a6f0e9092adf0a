//! Redis: token buckets (Lua scripts run by EVALSHA through `redis::Script`) and usage records
//! (per tenant × model × day hashes, and a Redis Stream of protobuf `UsageEvent`s). Works on a
//! single Redis and on Redis Cluster; every command is bounded by the configured timeout.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use prost::Message;
use redis::aio::{ConnectionLike, ConnectionManager};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, Pipeline, RedisFuture, Script, Value};

use crate::admission::admission_lease::{LeaseRecord, LeaseUse};
use crate::admission::limits::{BucketSpec, ReplyError, TakeOutcome};
use crate::admission::local_limiter::Hint;
use crate::admission::quota::{self, QuotaBook, QuotaOutcome, QuotaSpec, QuotaTake};
use crate::config::redis::RedisConfig;
use crate::metering::ledger::{self, CHARGED_RETENTION};
use crate::metering::meter::{EndReason, UsageRecord, UsageSource};
use crate::proto;

/// `lua/token_bucket_take_v3.lua`: take a cost from every bucket or from none, plus leases.
const TAKE_LUA: &str = include_str!("../lua/token_bucket_take_v3.lua");
/// `lua/token_bucket_settle_v1.lua`: settle a reservation against the real usage.
const SETTLE_LUA: &str = include_str!("../lua/token_bucket_settle_v1.lua");
/// `lua/token_bucket_reconcile_v1.lua`: charge what was admitted while Redis could not decide.
const RECONCILE_LUA: &str = include_str!("../lua/token_bucket_reconcile_v1.lua");
/// `lua/ledger_v1.lua`: the ledger's writes for one request (record, charge, release,
/// rereserve, claim), each applied once.
const LEDGER_LUA: &str = include_str!("../lua/ledger_v1.lua");
/// `lua/in_flight_flush_v1.lua`: a replica's in-flight counts of a pool, and the pool's total.
const IN_FLIGHT_LUA: &str = include_str!("../lua/in_flight_flush_v1.lua");

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
    book: Arc<QuotaBook>,
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
            book: Arc::default(),
        })
    }

    /// The same store, correcting the quota counters of `book` with every record, charge and
    /// give-back, and pricing every record with its prices ([`crate::admission::quota`]).
    #[must_use]
    pub fn with_quotas(mut self, book: Arc<QuotaBook>) -> Self {
        self.book = book;
        self
    }

    /// The quotas and prices.
    pub fn quotas(&self) -> &QuotaBook {
        &self.book
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

    /// Atomically takes each bucket's cost from every bucket, or from none; when admitted, also
    /// up to `leases[i]` more tokens from bucket `i` (missing entries: 0), and, with `tracking`,
    /// records the admission's reservation as open (`lua/token_bucket_take_v3.lua`: the
    /// reservation's JSON under its record id in `<prefix>:reservations:{<tenant>}`, indexed by
    /// Redis's time in `<prefix>:reservations-due:{<tenant>}`, both kept `tracking.keep` past their
    /// last write), in the same call. Returns the outcome and the lease tokens granted per bucket.
    ///
    /// # Errors
    /// [`StoreError`] on timeout, Redis error or a malformed reply.
    pub async fn take(
        &self,
        plan: &[BucketSpec],
        leases: &[u64],
        tracking: Option<&Tracking<'_>>,
    ) -> Result<(TakeOutcome, Vec<u64>), StoreError> {
        let (outcome, granted, _) = self.take_with_quotas(plan, leases, tracking, None).await?;
        Ok((outcome, granted))
    }

    /// [`Store::take`], and with `quotas` (the tenant's key in `tenant`), the quota counters in
    /// the same call (`lua/token_bucket_take_v3.lua`'s quota section): a counter at its hard limit
    /// refuses the take (the buckets deny first), an admitted take charges each counter.
    ///
    /// # Errors
    /// [`StoreError`] on timeout, Redis error or a malformed reply.
    pub async fn take_with_quotas(
        &self,
        plan: &[BucketSpec],
        leases: &[u64],
        tracking: Option<&Tracking<'_>>,
        quotas: Option<(&str, &QuotaTake<'_>)>,
    ) -> Result<(TakeOutcome, Vec<u64>, Option<QuotaOutcome>), StoreError> {
        let opened = tracking.map(|t| Opened {
            hash: ledger::reservations_key(&self.prefix, t.tenant),
            index: ledger::due_key(&self.prefix, t.tenant),
            id: t.record_id,
            json: t.reservation.to_json(),
            keep: t.keep,
        });
        self.take_opening(plan, leases, opened, quotas).await
    }

    /// The take of [`Store::take_with_quotas`], recording `opened` (a reservation or a lease)
    /// when it admits.
    async fn take_opening(
        &self,
        plan: &[BucketSpec],
        leases: &[u64],
        opened: Option<Opened<'_>>,
        quotas: Option<(&str, &QuotaTake<'_>)>,
    ) -> Result<(TakeOutcome, Vec<u64>, Option<QuotaOutcome>), StoreError> {
        let mut inv = self.take.prepare_invoke();
        inv.arg(plan.len());
        for (i, b) in plan.iter().enumerate() {
            let lease = leases.get(i).copied().unwrap_or(0);
            inv.key(&b.key).arg(b.capacity).arg(b.rate_per_minute).arg(b.cost).arg(lease);
        }
        let quotas = quotas.filter(|(_, q)| !q.specs.is_empty());
        if let Some(o) = opened {
            inv.key(o.hash)
                .key(o.index)
                .arg(o.id)
                .arg(o.json)
                .arg(u64::try_from(o.keep.as_millis()).unwrap_or(u64::MAX));
        } else if let Some((tenant, _)) = quotas {
            // The quota section follows the reservation's: its keys and arguments are given,
            // with no record id (nothing recorded).
            inv.key(ledger::reservations_key(&self.prefix, tenant))
                .key(ledger::due_key(&self.prefix, tenant))
                .arg("")
                .arg("")
                .arg(0);
        }
        if let Some((_, q)) = quotas {
            inv.arg(q.specs.len());
            for spec in q.specs {
                inv.key(&spec.key).arg(spec.hard).arg(q.need).arg(q.charge).arg(spec.expire_at_secs);
            }
        }
        let mut conn = self.conn();
        let reply: Vec<i64> = self.bounded(inv.invoke_async(&mut conn)).await?;
        let split = (2 + 4 * plan.len()).min(reply.len());
        let (buckets, rest) = reply.split_at(split);
        let quota = match quotas {
            Some((_, q)) => Some(quota::read_reply(rest, q.specs.len()).map_err(ReplyError)?),
            None if rest.is_empty() => None,
            None => {
                return Err(StoreError::Reply(ReplyError(format!(
                    "{} values after the buckets",
                    rest.len()
                ))));
            }
        };
        // A take the buckets would admit but a quota refused: the reply's header is `[0, 0]`
        // (refused by no bucket); its bucket states are read as an admission's (nothing was
        // taken; the caller refuses on the quota).
        let (outcome, granted) = match (&quota, buckets) {
            (Some(QuotaOutcome { denied: Some(_), .. }), [0, 0, states @ ..]) => {
                let mut patched = vec![1, 0];
                patched.extend_from_slice(states);
                TakeOutcome::from_reply(&patched, plan.len())?
            }
            _ => TakeOutcome::from_reply(buckets, plan.len())?,
        };
        Ok((outcome, granted, quota))
    }

    /// The quota section of a ledger call: ARGV `q`, then per counter its period letter, label,
    /// model scope and expiry; KEYS the counters.
    fn quota_args(call: &mut Call, specs: &[QuotaSpec]) {
        call.arg(specs.len());
        for spec in specs {
            call.key(&spec.key)
                .arg(spec.period.letter())
                .arg(&spec.label)
                .arg(spec.model.as_deref().unwrap_or(""))
                .arg(spec.expire_at_secs);
        }
    }

    /// Settles a reservation: `delta` tokens back into the bucket (negative: charge more).
    ///
    /// # Errors
    /// [`StoreError`] on timeout or Redis error.
    pub async fn settle(&self, bucket: &BucketSpec, delta: i64) -> Result<i64, StoreError> {
        let mut conn = self.conn();
        let mut inv = self.settle.key(&bucket.key);
        inv.arg(bucket.capacity).arg(bucket.rate_per_minute).arg(delta);
        self.bounded(inv.invoke_async(&mut conn)).await
    }

    /// Charges a bucket with what this sidecar admitted while Redis could not decide
    /// (`lua/token_bucket_reconcile_v1.lua`): `debt` tokens taken (negative: given back) from
    /// Redis's level now, credited only with refill Redis dropped at its capacity since `hint`'s
    /// answer (what Redis last answered this sidecar; other sidecars may have taken since, so it
    /// only lowers the result). A bucket that is missing (its node came back empty) is rebuilt
    /// from the hint. Returns the level.
    ///
    /// # Errors
    /// [`StoreError`] on timeout or Redis error (then nothing was charged, or all of it).
    pub async fn reconcile(
        &self,
        bucket: &BucketSpec,
        debt: i64,
        hint: Option<Hint>,
    ) -> Result<i64, StoreError> {
        let mut conn = self.conn();
        let mut inv = self.reconcile.key(&bucket.key);
        inv.arg(bucket.capacity)
            .arg(bucket.rate_per_minute)
            .arg(debt)
            .arg(hint.map_or_else(String::new, |h| h.level.to_string()))
            .arg(hint.map_or_else(String::new, |h| h.age_ms.to_string()));
        self.bounded(inv.invoke_async(&mut conn)).await
    }

    /// Applies one usage record to the ledger (`lua/ledger_v1.lua`, operation `record`, or
    /// `charge` when `charge`): adds its counts to the tenant's daily hash
    /// `<prefix>:usage:{<tenant>}:<YYYY-MM-DD>` (fields `<model>:requests`,
    /// `<model>:prompt_tokens`, `<model>:completion_tokens`, `<model>:cached_tokens`) and moves each
    /// bucket of `settlements` by its delta (tokens back; negative: charged more), all at once and
    /// once per request:
    /// - `record`: closes the request's open reservation (`<prefix>:reservations:{<tenant>}`, see
    ///   [`Store::take`]) if there is one, and is not applied ([`Applied::AfterCharge`]) when that
    ///   reservation was charged already; the record id joins the set
    ///   `<prefix>:usage-seen:{<tenant>}:<window start>` of its 10 s finish-time window (kept
    ///   [`IDEMPOTENCY_RETENTION`] past the later of the window's end and now), and a record whose
    ///   id is there is not applied again ([`Applied::Duplicate`]).
    /// - `charge` (the sweeper's record of a reservation whose usage never arrived): applied only
    ///   while the reservation is open ([`Applied::Duplicate`] otherwise); it joins
    ///   `<prefix>:reservations-charged:{<tenant>}` for [`CHARGED_RETENTION`].
    ///
    /// Dated by `record.finished_at_unix_ms` (0: now).
    ///
    /// # Errors
    /// [`StoreError`] on timeout or Redis error ([`StoreError::maybe_applied`] says whether it may
    /// have been applied anyway).
    ///
    /// A `record` of a request admitted from an admission lease (`lease`) counts its reservation
    /// against the lease while the lease is open, or pays it again once the lease was reclaimed
    /// ([`crate::admission::admission_lease`]).
    pub async fn apply(
        &self,
        record: &UsageRecord,
        settlements: &[(BucketSpec, i64)],
        charge: bool,
        lease: Option<&LeaseUse>,
    ) -> Result<Applied, StoreError> {
        let call = self.record_call(record, settlements, charge, lease);
        let mut conn = self.conn();
        let reply: i64 = self.bounded(call.invocation(&self.ledger).invoke_async(&mut conn)).await?;
        Applied::of_reply(reply)
    }

    /// The keys and arguments of [`Store::apply`]'s script call.
    fn record_call(
        &self,
        record: &UsageRecord,
        settlements: &[(BucketSpec, i64)],
        charge: bool,
        lease: Option<&LeaseUse>,
    ) -> Call {
        let now_ms = unix_ms();
        let finished_ms = finished_ms(record, now_ms);
        // The record's day on the quota clock (the system clock outside tests).
        let day_ms = self.book.clock.shift_ms(finished_ms);
        let info = &record.info;
        let tenant = &info.tenant;
        let mut call = Call::default();
        call.key(ledger::reservations_key(&self.prefix, tenant)).key(ledger::due_key(&self.prefix, tenant));
        if charge {
            call.key(ledger::charged_key(&self.prefix, tenant))
                .key(usage_key(&self.prefix, tenant, day_ms / 1000))
                .arg("charge")
                .arg(&info.record_id)
                .arg(CHARGED_RETENTION.as_millis() as u64);
        } else {
            let (seen, expire_at) = seen_key(&self.prefix, tenant, finished_ms / 1000, now_ms / 1000);
            call.key(ledger::charged_key(&self.prefix, tenant))
                .key(seen)
                .key(usage_key(&self.prefix, tenant, day_ms / 1000))
                .arg("record")
                .arg(&info.record_id)
                .arg(expire_at);
        }
        call.arg(&info.model)
            .arg(record.prompt_tokens)
            .arg(record.completion_tokens)
            .arg(record.cached_tokens)
            .arg(settlements.len());
        for (bucket, delta) in settlements {
            call.key(&bucket.key).arg(bucket.capacity).arg(bucket.rate_per_minute).arg(*delta);
        }
        // Its cost (summed in the daily hash) and its quota counters, of the periods of its end
        // on the quota clock.
        call.arg(self.cost_of(record));
        Self::quota_args(&mut call, &self.book.plan(&self.prefix, tenant, &info.model, day_ms));
        if let (Some(lease), false) = (lease, charge) {
            call.key(ledger::leases_key(&self.prefix, tenant))
                .key(ledger::lease_used_key(&self.prefix, tenant))
                .key(ledger::leases_reclaimed_key(&self.prefix, tenant))
                .key(ledger::leases_charged_key(&self.prefix, tenant))
                .arg(&lease.lease_id)
                .arg(lease.reserved)
                .arg(ledger::KEEP_MARGIN.as_millis() as u64)
                .arg(lease.if_reclaimed.len());
            for (bucket, delta) in &lease.if_reclaimed {
                call.key(&bucket.key).arg(bucket.capacity).arg(bucket.rate_per_minute).arg(*delta);
            }
            match lease.seq {
                Some(seq) => call.arg(seq),
                None => call.arg(""),
            };
            call.arg(lease.prompt);
        }
        call
    }

    /// Several ledger writes of one tenant in one script call (`lua/ledger_v1.lua`, operation
    /// `batch`): each applied as [`Store::apply`] or [`Store::release`] would apply it alone, in
    /// order. One reply per write, in order: [`LedgerReply::Record`] for a record or a charge,
    /// [`LedgerReply::Released`] for a release, [`LedgerReply::Failed`] for a write that raised an
    /// error in the script (its writes up to the error stay: retry it as one that may have
    /// landed).
    ///
    /// Every write must be of the same tenant (their keys share its cluster slot); an empty batch
    /// is no call.
    ///
    /// # Errors
    /// [`StoreError`] on timeout or Redis error for the whole call
    /// ([`StoreError::maybe_applied`] says whether any of it may have landed).
    pub async fn ledger_batch(&self, writes: &[LedgerWrite<'_>]) -> Result<Vec<LedgerReply>, StoreError> {
        if writes.is_empty() {
            return Ok(Vec::new());
        }
        let mut batch = Call::default();
        batch.arg("batch").arg(writes.len());
        for write in writes {
            let call = match write {
                LedgerWrite::Record { record, settlements, charge, lease } => {
                    self.record_call(record, settlements, *charge, *lease)
                }
                LedgerWrite::Release { tenant, record_id, buckets } => {
                    self.release_call(tenant, record_id, buckets)
                }
            };
            batch.arg(call.keys.len()).arg(call.args.len());
            batch.keys.extend(call.keys);
            batch.args.extend(call.args);
        }
        let mut conn = self.conn();
        let replies: Vec<i64> = self.bounded(batch.invocation(&self.ledger).invoke_async(&mut conn)).await?;
        if replies.len() != writes.len() {
            return Err(StoreError::Reply(ReplyError(format!(
                "ledger_v1.lua batch: {} replies to {} writes",
                replies.len(),
                writes.len()
            ))));
        }
        Ok(writes
            .iter()
            .zip(replies)
            .map(|(write, reply)| match (write, reply) {
                (_, -1) => LedgerReply::Failed,
                (LedgerWrite::Release { .. }, reply) => LedgerReply::Released(reply == 1),
                (LedgerWrite::Record { .. }, reply) => match Applied::of_reply(reply) {
                    Ok(applied) => LedgerReply::Record(applied),
                    Err(_) => LedgerReply::Failed,
                },
            })
            .collect())
    }

    /// A record's cost in nano-dollars at its model's price (0 without one).
    pub fn cost_of(&self, record: &UsageRecord) -> u64 {
        self.book.cost(
            &record.info.model,
            record.prompt_tokens,
            record.cached_tokens,
            record.completion_tokens,
        )
    }

    /// Appends a record's protobuf `UsageEvent` to the usage stream (fields `event`, `tenant`,
    /// `record_id`; `XADD ... MAXLEN ~ metering.stream_maxlen`), once per record id: the id joins
    /// the set of ids appended in its 10 s finish-time window ([`sent_key`], in the stream's
    /// cluster slot, kept [`IDEMPOTENCY_RETENTION`] past the window) in the same script, so a
    /// retry after a failure that landed, or a second party (the gRPC access log and the usage
    /// journal) appending after an uncertain write, appends nothing more. Whether it appended.
    ///
    /// # Errors
    /// [`StoreError`] on timeout or Redis error.
    pub async fn append(&self, record: &UsageRecord) -> Result<bool, StoreError> {
        let appended = self.append_batch(&[record]).await?;
        Ok(appended.first().copied().unwrap_or(false))
    }

    /// [`Store::append`] of several records in one script call (they all go to the one stream,
    /// in its cluster slot). Whether each appended, in order; an empty batch is no call.
    ///
    /// # Errors
    /// [`StoreError`] on timeout or Redis error (a retry appends each record once still).
    pub async fn append_batch(&self, records: &[&UsageRecord]) -> Result<Vec<bool>, StoreError> {
        if records.is_empty() {
            return Ok(Vec::new());
        }
        let now_ms = unix_ms();
        let events: Vec<(u64, proto::UsageEvent)> = records
            .iter()
            .map(|record| {
                let finished = finished_ms(record, now_ms);
                let mut event = to_event(record, self.book.clock.shift_ms(finished));
                event.cost_nano_usd = self.cost_of(record);
                (finished, event)
            })
            .collect();
        self.append_events(now_ms, &events).await
    }

    /// Appends `events` (each with its end, unix ms, which picks its window of appended ids) in
    /// one `append_once` call, each once per `record_id` ([`Store::append`]). Whether each
    /// appended, in order.
    async fn append_events(
        &self,
        now_ms: u64,
        events: &[(u64, proto::UsageEvent)],
    ) -> Result<Vec<bool>, StoreError> {
        let mut call = Call::default();
        call.key(&self.stream).arg(self.stream_maxlen);
        for (finished, event) in events {
            let (sent, expire_at) = sent_key(&self.stream, finished / 1000, now_ms / 1000);
            call.key(sent).arg(&event.record_id).arg(expire_at).arg(event.encode_to_vec()).arg(&event.tenant);
        }
        let mut conn = self.conn();
        let appended: Vec<i64> =
            self.bounded(call.invocation(&self.append_once).invoke_async(&mut conn)).await?;
        if appended.len() != events.len() {
            return Err(StoreError::Reply(ReplyError(format!(
                "usage stream append: {} replies to {} records",
                appended.len(),
                events.len()
            ))));
        }
        Ok(appended.into_iter().map(|a| a == 1).collect())
    }

    /// Appends the usage event of a reclaimed admission lease's charge ([`Store::lease_charge`]),
    /// once per lease as [`Store::append`] appends a
    /// record's: `record_id` `lease.<lease_id>`, `requests` the charged requests, their prompt
    /// estimates as prompt tokens and the rest as completion tokens, END_REASON_UNREPORTED,
    /// USAGE_SOURCE_RESERVATION, dated now (`proto/llm_gateway/v1/usage.proto`). Whether it
    /// appended (false: appended before, or nothing was charged).
    ///
    /// # Errors
    /// [`StoreError`] on timeout or Redis error.
    pub async fn append_lease_charge(
        &self,
        tenant: &str,
        lease_id: &str,
        model: &str,
        charge: &LeaseCharge,
    ) -> Result<bool, StoreError> {
        if charge.requests == 0 {
            return Ok(false);
        }
        let now_ms = unix_ms();
        let prompt_tokens = charge.prompt_tokens.min(charge.tokens);
        let completion_tokens = charge.tokens - prompt_tokens;
        let event = proto::UsageEvent {
            tenant: tenant.to_owned(),
            model: model.to_owned(),
            prompt_tokens,
            completion_tokens,
            end_reason: proto::EndReason::Unreported as i32,
            usage_source: proto::UsageSource::Reservation as i32,
            reserved_tokens: charge.tokens,
            finished_at_unix_ms: self.book.clock.shift_ms(now_ms),
            record_id: format!("lease.{lease_id}"),
            cost_nano_usd: self.book.cost(model, prompt_tokens, 0, completion_tokens),
            requests: charge.requests,
            ..Default::default()
        };
        let appended = self.append_events(now_ms, &[(now_ms, event)]).await?;
        Ok(appended.first() == Some(&true))
    }

    /// Gives an admission back (`lua/ledger_v1.lua`, operation `release`): if the request's
    /// reservation is open, closes it and returns one request to each requests bucket of
    /// `buckets` and the reservation's tokens (at most each one's capacity) to each tokens
    /// bucket. Whether it was open (false: already closed, given back or charged: nothing
    /// moved). Safe to retry.
    ///
    /// # Errors
    /// [`StoreError`] on timeout or Redis error.
    pub async fn release(
        &self,
        tenant: &str,
        record_id: &str,
        buckets: &[BucketSpec],
    ) -> Result<bool, StoreError> {
        let call = self.release_call(tenant, record_id, buckets);
        let mut conn = self.conn();
        let reply: i64 = self.bounded(call.invocation(&self.ledger).invoke_async(&mut conn)).await?;
        Ok(reply == 1)
    }

    /// The keys and arguments of [`Store::release`]'s script call.
    fn release_call(&self, tenant: &str, record_id: &str, buckets: &[BucketSpec]) -> Call {
        let mut call = Call::default();
        call.key(ledger::reservations_key(&self.prefix, tenant))
            .key(ledger::due_key(&self.prefix, tenant))
            .arg("release")
            .arg(record_id)
            .arg(buckets.len());
        for b in buckets {
            call.key(&b.key).arg(b.kind.as_str()).arg(b.capacity).arg(b.rate_per_minute);
        }
        let now_ms = self.book.clock.now_ms();
        Self::quota_args(&mut call, &self.book.plan_all_models(&self.prefix, tenant, now_ms));
        call
    }

    /// Moves an open reservation to `reservation` (`lua/ledger_v1.lua`, operation `rereserve`:
    /// after the exact prompt count): each tokens bucket of `buckets` by its share of the
    /// difference. Whether it was open (false: nothing moved). A retry moves nothing more.
    ///
    /// # Errors
    /// [`StoreError`] on timeout or Redis error.
    pub async fn rereserve(
        &self,
        tenant: &str,
        record_id: &str,
        reservation: &ledger::Reservation,
        buckets: &[BucketSpec],
    ) -> Result<bool, StoreError> {
        let mut inv = self.ledger.prepare_invoke();
        inv.key(ledger::reservations_key(&self.prefix, tenant))
            .arg("rereserve")
            .arg(record_id)
            .arg(reservation.to_json())
            .arg(buckets.len());
        for b in buckets {
            inv.key(&b.key).arg(b.capacity).arg(b.rate_per_minute);
        }
        let mut conn = self.conn();
        let reply: i64 = self.bounded(inv.invoke_async(&mut conn)).await?;
        Ok(reply == 1)
    }

    /// Records an admission lease's take: [`Store::take_with_quotas`] that also records the lease
    /// open (`record` under `lease_id` in [`ledger::leases_key`], indexed by Redis's time in
    /// [`ledger::lease_due_key`], both kept `keep` past the write) when the take admits.
    ///
    /// # Errors
    /// [`StoreError`] on timeout, Redis error or a malformed reply.
    pub async fn take_lease(
        &self,
        tenant: &str,
        lease_id: &str,
        record: &LeaseRecord,
        keep: Duration,
        plan: &[BucketSpec],
        quotas: Option<&QuotaTake<'_>>,
    ) -> Result<(TakeOutcome, Option<QuotaOutcome>), StoreError> {
        let opened = Opened {
            hash: ledger::leases_key(&self.prefix, tenant),
            index: ledger::lease_due_key(&self.prefix, tenant),
            id: lease_id,
            json: record.to_json(),
            keep,
        };
        let (outcome, _, quota) =
            self.take_opening(plan, &[], Some(opened), quotas.map(|q| (tenant, q))).await?;
        Ok((outcome, quota))
    }

    /// Gives an admission lease's rest back (`lua/ledger_v1.lua`, operation `lease_return`):
    /// `settlements` move their buckets only while the lease is open, and close it. Whether it was
    /// open (false: reclaimed already, or given back: nothing moved). Safe to retry.
    ///
    /// # Errors
    /// [`StoreError`] on timeout or Redis error.
    pub async fn lease_return(
        &self,
        tenant: &str,
        lease_id: &str,
        settlements: &[(BucketSpec, i64)],
    ) -> Result<bool, StoreError> {
        let mut inv = self.ledger.prepare_invoke();
        inv.key(ledger::leases_key(&self.prefix, tenant))
            .key(ledger::lease_due_key(&self.prefix, tenant))
            .key(ledger::lease_used_key(&self.prefix, tenant))
            .arg("lease_return")
            .arg(lease_id)
            .arg(settlements.len());
        for (bucket, delta) in settlements {
            inv.key(&bucket.key).arg(bucket.capacity).arg(bucket.rate_per_minute).arg(*delta);
        }
        let mut conn = self.conn();
        let reply: i64 = self.bounded(inv.invoke_async(&mut conn)).await?;
        Ok(reply == 1)
    }

    /// Records a filter's report on an admission lease it holds (`lua/ledger_v1.lua`, operation
    /// `lease_report`): `admitted` requests numbered 1 to `admitted` were admitted from it, and
    /// reserved `reserved` tokens together, `prompt` of them prompt estimates (all cumulative since
    /// the grant; `proto/llm_gateway/v1/lease.proto`, `report_*`). A reclaim of the lease then
    /// keeps those reservations charged, and charges those whose usage has not landed as usage
    /// ([`Store::lease_reclaim`]). Whether the lease was open (false: given back or reclaimed;
    /// nothing is written). A report older than the one recorded changes nothing. Safe to retry.
    ///
    /// # Errors
    /// [`StoreError`] on timeout or Redis error.
    pub async fn lease_report(
        &self,
        tenant: &str,
        lease_id: &str,
        admitted: u64,
        reserved: u64,
        prompt: u64,
    ) -> Result<bool, StoreError> {
        let mut inv = self.ledger.prepare_invoke();
        inv.key(ledger::leases_key(&self.prefix, tenant))
            .key(ledger::lease_used_key(&self.prefix, tenant))
            .arg("lease_report")
            .arg(lease_id)
            .arg(admitted)
            .arg(reserved)
            .arg(u64::try_from(ledger::KEEP_MARGIN.as_millis()).unwrap_or(u64::MAX))
            .arg(prompt.min(reserved));
        let mut conn = self.conn();
        let reply: i64 = self.bounded(inv.invoke_async(&mut conn)).await?;
        Ok(reply == 1)
    }

    /// Reclaims an orphaned admission lease (`lua/ledger_v1.lua`, operation `lease_reclaim`):
    /// closes it, remembers it reclaimed, and gives each of `buckets` (the plan of its tenant and
    /// model) what the lease took less what its requests reserved: those the filter reported
    /// ([`Store::lease_report`]) and those whose usage landed. `retention` is the longest stream
    /// lifetime: the lease's reported requests whose usage has not landed by then are charged as
    /// usage ([`Store::lease_charge`]); what the charge reads is kept `retention` plus
    /// [`ledger::KEEP_MARGIN`] (a charge due at `retention` may come a few sweeps later).
    /// The requests and tokens given back; `None` when it was not open (given back, or reclaimed
    /// by another replica).
    ///
    /// # Errors
    /// [`StoreError`] on timeout, Redis error or a malformed reply.
    pub async fn lease_reclaim(
        &self,
        tenant: &str,
        lease_id: &str,
        buckets: &[BucketSpec],
        retention: Duration,
    ) -> Result<Option<(u64, u64)>, StoreError> {
        let mut inv = self.ledger.prepare_invoke();
        inv.key(ledger::leases_key(&self.prefix, tenant))
            .key(ledger::lease_due_key(&self.prefix, tenant))
            .key(ledger::lease_used_key(&self.prefix, tenant))
            .key(ledger::leases_reclaimed_key(&self.prefix, tenant))
            .arg("lease_reclaim")
            .arg(lease_id)
            .arg(u64::try_from(retention.saturating_add(ledger::KEEP_MARGIN).as_millis()).unwrap_or(u64::MAX))
            .arg(buckets.len());
        for b in buckets {
            inv.key(&b.key).arg(b.kind.as_str()).arg(b.capacity).arg(b.rate_per_minute);
        }
        let mut conn = self.conn();
        let reply: Vec<i64> = self.bounded(inv.invoke_async(&mut conn)).await?;
        match reply.as_slice() {
            [1, requests, tokens] => {
                Ok(Some((u64::try_from(*requests).unwrap_or(0), u64::try_from(*tokens).unwrap_or(0))))
            }
            [0, ..] => Ok(None),
            other => Err(StoreError::Reply(ReplyError(format!("ledger_v1.lua lease_reclaim: {other:?}")))),
        }
    }

    /// The leases of `tenant` reclaimed more than `age` ago (the longest stream lifetime), at most
    /// `most` (`lua/ledger_v1.lua`, operation `lease_charges_due`): (lease id, model) each, for
    /// [`Store::lease_charge`].
    ///
    /// # Errors
    /// [`StoreError`] on timeout, Redis error or a malformed reply.
    pub async fn lease_charges_due(
        &self,
        tenant: &str,
        age: Duration,
        most: usize,
    ) -> Result<Vec<(String, String)>, StoreError> {
        let mut inv = self.ledger.prepare_invoke();
        inv.key(ledger::leases_reclaimed_key(&self.prefix, tenant))
            .key(ledger::lease_used_key(&self.prefix, tenant))
            .arg("lease_charges_due")
            .arg(u64::try_from(age.as_millis()).unwrap_or(u64::MAX))
            .arg(most);
        let mut conn = self.conn();
        let reply: Vec<String> = self.bounded(inv.invoke_async(&mut conn)).await?;
        let mut out = Vec::with_capacity(reply.len() / 2);
        let mut items = reply.into_iter();
        while let (Some(id), Some(model)) = (items.next(), items.next()) {
            out.push((id, model));
        }
        Ok(out)
    }

    /// Charges a reclaimed lease's reported requests whose usage never landed their reservations
    /// as usage (`lua/ledger_v1.lua`, operation `lease_charge`), once: the tenant's usage hash of
    /// today (on the quota clock) gains them under `model` (their prompt estimates as prompt
    /// tokens, the rest of their reservations as completion tokens, their cost at the model's
    /// prices), and so do the quota counters of the tenant and model; their usage, should it
    /// still arrive, is not applied ([`Applied::AfterCharge`]), for [`CHARGED_RETENTION`]. What it
    /// charged; `None` when the lease was not waiting for its charge (charged by another replica).
    ///
    /// # Errors
    /// [`StoreError`] on timeout, Redis error or a malformed reply.
    pub async fn lease_charge(
        &self,
        tenant: &str,
        lease_id: &str,
        model: &str,
    ) -> Result<Option<LeaseCharge>, StoreError> {
        let day_ms = self.book.clock.shift_ms(unix_ms());
        let mut call = Call::default();
        call.key(ledger::leases_reclaimed_key(&self.prefix, tenant))
            .key(ledger::lease_used_key(&self.prefix, tenant))
            .key(ledger::leases_charged_key(&self.prefix, tenant))
            .key(usage_key(&self.prefix, tenant, day_ms / 1000))
            .arg("lease_charge")
            .arg(lease_id)
            .arg(u64::try_from(CHARGED_RETENTION.as_millis()).unwrap_or(u64::MAX))
            // Prices per token: the cost of one prompt token and of one completion token.
            .arg(self.book.cost(model, 1, 0, 0))
            .arg(self.book.cost(model, 0, 0, 1));
        Self::quota_args(&mut call, &self.book.plan(&self.prefix, tenant, model, day_ms));
        let mut conn = self.conn();
        let reply: Vec<i64> = self.bounded(call.invocation(&self.ledger).invoke_async(&mut conn)).await?;
        let n = |v: i64| u64::try_from(v).unwrap_or(0);
        match reply.as_slice() {
            [1, requests, tokens, prompt] => Ok(Some(LeaseCharge {
                requests: n(*requests),
                tokens: n(*tokens),
                prompt_tokens: n(*prompt),
            })),
            [0, ..] => Ok(None),
            other => Err(StoreError::Reply(ReplyError(format!("ledger_v1.lua lease_charge: {other:?}")))),
        }
    }

    /// A tenant's open admission leases granted more than `age` ago (Redis's clock), at most
    /// `most`, each due again `claim` later (`lua/ledger_v1.lua`, operation `claim`, on the lease
    /// keys); and how many are open. Unreadable records are returned as `None`.
    ///
    /// # Errors
    /// [`StoreError`] on timeout, Redis error or a malformed reply.
    pub async fn claim_leases(
        &self,
        tenant: &str,
        age: Duration,
        claim: Duration,
        most: usize,
    ) -> Result<ledger::Claimed<LeaseRecord>, StoreError> {
        let keys = [ledger::leases_key(&self.prefix, tenant), ledger::lease_due_key(&self.prefix, tenant)];
        let reply = self.claim_from(keys, age, claim, most).await?;
        ledger::read_claim_with(&reply, LeaseRecord::from_json).map_err(StoreError::Reply)
    }

    /// The `claim` operation of `lua/ledger_v1.lua` on a hash of open entries and its index.
    async fn claim_from(
        &self,
        [hash, index]: [String; 2],
        age: Duration,
        claim: Duration,
        most: usize,
    ) -> Result<Vec<Value>, StoreError> {
        let mut inv = self.ledger.prepare_invoke();
        inv.key(hash)
            .key(index)
            .arg("claim")
            .arg(age.as_millis() as u64)
            .arg(claim.as_millis() as u64)
            .arg(most);
        let mut conn = self.conn();
        self.bounded(inv.invoke_async(&mut conn)).await
    }

    /// A tenant's open reservations taken more than `age` ago (Redis's clock), at most `most`
    /// of them (`lua/ledger_v1.lua`, operation `claim`), each due again `claim` later; and how
    /// many are open. Reservations whose JSON does not parse are returned as `None`.
    ///
    /// # Errors
    /// [`StoreError`] on timeout, Redis error or a malformed reply.
    pub async fn claim(
        &self,
        tenant: &str,
        age: Duration,
        claim: Duration,
        most: usize,
    ) -> Result<ledger::Claimed, StoreError> {
        let keys = [ledger::reservations_key(&self.prefix, tenant), ledger::due_key(&self.prefix, tenant)];
        let reply = self.claim_from(keys, age, claim, most).await?;
        ledger::read_claim(&reply).map_err(StoreError::Reply)
    }
}

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

impl Store {
    /// Takes the journal lease `key` for `owner`, or renews it when `owner` holds it, for `ttl`.
    /// Whether `owner` holds it now.
    ///
    /// # Errors
    /// [`StoreError`] on timeout or Redis error.
    pub async fn journal_lease(&self, key: &str, owner: &str, ttl: Duration) -> Result<bool, StoreError> {
        let script = Script::new(JOURNAL_LEASE_LUA);
        let mut inv = script.prepare_invoke();
        inv.key(key).arg(owner).arg(ttl.as_millis() as u64);
        let mut conn = self.conn();
        let reply: i64 = self.bounded(inv.invoke_async(&mut conn)).await?;
        Ok(reply == 1)
    }

    /// Gives the journal lease `key` up if `owner` holds it.
    ///
    /// # Errors
    /// [`StoreError`] on timeout or Redis error.
    pub async fn journal_release(&self, key: &str, owner: &str) -> Result<(), StoreError> {
        let script = Script::new(JOURNAL_RELEASE_LUA);
        let mut inv = script.prepare_invoke();
        inv.key(key).arg(owner);
        let mut conn = self.conn();
        let _: i64 = self.bounded(inv.invoke_async(&mut conn)).await?;
        Ok(())
    }

    /// A journal's checkpoint (`None`: none yet, or unreadable).
    ///
    /// # Errors
    /// [`StoreError`] on timeout or Redis error.
    pub async fn journal_checkpoint(
        &self,
        key: &str,
    ) -> Result<Option<crate::metering::journal::Checkpoint>, StoreError> {
        let mut cmd = redis::cmd("HMGET");
        cmd.arg(key).arg("dev").arg("ino").arg("offset");
        let mut conn = self.conn();
        let reply: Vec<Option<u64>> = self.bounded(cmd.query_async(&mut conn)).await?;
        Ok(match reply.as_slice() {
            [Some(dev), Some(ino), Some(offset)] => {
                Some(crate::metering::journal::Checkpoint { dev: *dev, ino: *ino, offset: *offset })
            }
            _ => None,
        })
    }

    /// Writes a journal's checkpoint if `owner` holds its lease, renewing the lease for `ttl`;
    /// whether it did.
    ///
    /// # Errors
    /// [`StoreError`] on timeout or Redis error.
    pub async fn journal_commit(
        &self,
        lease_key: &str,
        checkpoint_key: &str,
        owner: &str,
        at: crate::metering::journal::Checkpoint,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        let script = Script::new(JOURNAL_COMMIT_LUA);
        let mut inv = script.prepare_invoke();
        inv.key(lease_key)
            .key(checkpoint_key)
            .arg(owner)
            .arg(at.dev)
            .arg(at.ino)
            .arg(at.offset)
            .arg(ttl.as_millis() as u64);
        let mut conn = self.conn();
        let reply: i64 = self.bounded(inv.invoke_async(&mut conn)).await?;
        Ok(reply == 1)
    }
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

impl Store {
    /// Flushes this replica's cumulative in-flight counts of `pool` to
    /// `<prefix>:in-flight:{<pool>}` (fields `b:<replica>`, `a:<replica>`, `t:<replica>`, `base`,
    /// `abase`) and returns the pool-wide total, corrected by the bound, and how many replicas
    /// flushed lately (`lua/in_flight_flush_v1.lua`). Idempotent: the counts are cumulative.
    ///
    /// # Errors
    /// [`StoreError`] on timeout, Redis error or a malformed reply.
    pub async fn flush_in_flight(
        &self,
        pool: &str,
        replica: &str,
        flush: &InFlightFlush,
    ) -> Result<InFlightTotal, StoreError> {
        let now_ms = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
        let (bound, seen) = match flush.bound {
            Some((bound, seen)) => {
                (i64::try_from(bound).unwrap_or(i64::MAX), i64::try_from(seen).unwrap_or(i64::MAX))
            }
            None => (-1, -1),
        };
        let mut inv = self.in_flight.key(in_flight_key(&self.prefix, pool));
        inv.arg(replica)
            .arg(flush.balance)
            .arg(flush.admitted)
            .arg(now_ms)
            .arg(IN_FLIGHT_REPLICA_GONE.as_millis() as u64)
            .arg(bound)
            .arg(seen)
            .arg(u64::try_from(flush.live_within.as_millis()).unwrap_or(u64::MAX));
        let mut conn = self.conn();
        let reply: Vec<i64> = self.bounded(inv.invoke_async(&mut conn)).await?;
        match reply[..] {
            [total, admitted, correction, replicas] => Ok(InFlightTotal {
                total,
                admitted: u64::try_from(admitted).unwrap_or(0),
                correction,
                replicas: u64::try_from(replicas).unwrap_or(1).max(1),
            }),
            _ => Err(StoreError::Reply(ReplyError(format!(
                "in-flight flush: {} values, expected 4",
                reply.len()
            )))),
        }
    }
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

fn to_event(r: &UsageRecord, finished_at_unix_ms: u64) -> proto::UsageEvent {
    proto::UsageEvent {
        request_id: r.info.request_id.clone(),
        tenant: r.info.tenant.clone(),
        model: r.info.model.clone(),
        pool: r.info.pool.clone(),
        prompt_tokens: r.prompt_tokens,
        completion_tokens: r.completion_tokens,
        cached_tokens: r.cached_tokens,
        ttft_us: r.ttft_us,
        duration_us: r.duration_us,
        status: u32::from(r.status),
        end_reason: match (r.unreported, r.end_reason) {
            (true, _) => proto::EndReason::Unreported,
            (false, EndReason::Completed) => proto::EndReason::Completed,
            (false, EndReason::Incomplete) => proto::EndReason::Incomplete,
        } as i32,
        usage_source: match r.usage_source {
            UsageSource::Upstream => proto::UsageSource::Upstream,
            UsageSource::StreamedChunks => proto::UsageSource::StreamedChunks,
            UsageSource::Reservation => proto::UsageSource::Reservation,
        } as i32,
        reserved_tokens: r.info.reserved_tokens,
        finished_at_unix_ms,
        record_id: r.info.record_id.clone(),
        tier: r.info.tier.clone(),
        cost_nano_usd: 0,
        requests: 0,
    }
}

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
