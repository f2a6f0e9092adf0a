//! The ledger's writes on their way to Redis: a bounded in-memory buffer and one writer task.
//!
//! Three kinds of write ([`LedgerOp`]): a finished request's usage record with the settlement of
//! its reservation, the charge of a reservation whose usage never arrived ([`crate::metering::sweeper`]),
//! and the release of an admission given back before its request went upstream. They are queued
//! without waiting; the writer writes them in batches (concurrent commands on the multiplexed
//! connection, so they travel pipelined), each through one `lua/ledger_v1.lua` call (then, for a
//! record or a charge that landed, its event on the usage stream). A write that fails stays at the
//! head of the buffer and is retried with backoff until Redis returns, so an outage loses nothing
//! while the buffer has room (`metering.buffer_records`).
//!
//! Every write is applied once per request ([`crate::metering::ledger`]): a record closes its request's
//! open reservation, else is deduplicated by its id for [`IDEMPOTENCY_RETENTION`]; a charge and a
//! release act only on an open reservation. A record's event is appended to the stream only when
//! the record landed (or an earlier attempt may have landed it), so a second delivery appends
//! nothing. A record still unwritten [`RETRY_HORIZON`] after an attempt that may have landed is
//! given up, logged whole at error level and counted in
//! `llm_gateway_usage_records_unconfirmed_total`, rather than risk counting it twice. Past the
//! buffer's bound the oldest write is logged whole at error level and counted, never dropped
//! silently. Records of tenants the config does not list are dropped with a warning and counted
//! in `llm_gateway_usage_records_unknown_tenant_total` (no Redis key is ever made for them).

use std::collections::{HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::join_all;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tracing::{error, warn};

use crate::admission::admission_lease::LeaseUse;
use crate::admission::limits::BucketSpec;
use crate::metering::landed::Landed;
use crate::metering::meter::UsageRecord;
use crate::metrics::Metrics;
use crate::store::{
    Applied, LedgerReply, LedgerWrite, Store, StoreError, CLOCK_SKEW_MARGIN, IDEMPOTENCY_RETENTION,
};

/// How long after a write attempt that may have landed a record is still retried: the
/// idempotency retention less the clock-skew margin.
pub const RETRY_HORIZON: Duration = IDEMPOTENCY_RETENTION.saturating_sub(CLOCK_SKEW_MARGIN);

/// Writes taken from the buffer per round.
const BATCH: usize = 256;
/// Ledger writes of one tenant per script call (bounds the time one call holds Redis: about
/// 8 µs per write).
const LEDGER_BATCH: usize = 64;
/// Records per usage-stream append call.
const APPEND_BATCH: usize = 128;
/// How long the writer keeps flushing after shutdown before it logs what is left.
const SHUTDOWN_FLUSH: Duration = Duration::from_secs(5);

/// One write of the ledger.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LedgerOp {
    /// A finished request's usage, and what it moves in each of its TPM buckets in Redis (empty
    /// when its reservation was taken in the sidecar's memory: settled there).
    Record {
        /// The record.
        record: UsageRecord,
        /// Bucket and delta (tokens back; negative: charged more).
        settlements: Vec<(BucketSpec, i64)>,
        /// The request's part in the books of the admission lease it was admitted from.
        lease: Option<LeaseUse>,
    },
    /// A reservation recorded as charged: no usage arrived ([`crate::metering::ledger::charged_record`]).
    Charge {
        /// The record of the reservation.
        record: UsageRecord,
        /// Bucket and delta.
        settlements: Vec<(BucketSpec, i64)>,
    },
    /// An admission given back before its request went upstream: its reservation closed, its
    /// request and tokens returned to `buckets` (the request's plan).
    Release {
        /// The tenant.
        tenant: String,
        /// The request's record id.
        record_id: String,
        /// The request's buckets (costs unused: the stored reservation says what goes back).
        buckets: Vec<BucketSpec>,
    },
}

impl LedgerOp {
    fn record_id(&self) -> &str {
        match self {
            LedgerOp::Record { record, .. } | LedgerOp::Charge { record, .. } => &record.info.record_id,
            LedgerOp::Release { record_id, .. } => record_id,
        }
    }
}

/// The sending side; cheap to clone.
#[derive(Clone)]
pub struct Recorder {
    tx: mpsc::UnboundedSender<LedgerOp>,
    tenants: Arc<HashSet<String>>,
    metrics: Arc<Metrics>,
    landed: Arc<Landed>,
}

/// A write waiting for Redis: the time of its first attempt that may have landed, and, for a
/// record or a charge, whether its ledger script landed (only the stream append is left).
struct Pending {
    op: LedgerOp,
    maybe_applied_at: Option<Instant>,
    applied: bool,
    /// The ledger had the record from another delivery: only its event is asked for again.
    duplicate: bool,
}

/// Whether a record is given up rather than retried: an attempt that may have landed is older
/// than [`RETRY_HORIZON`], so Redis may no longer know it was applied.
pub fn give_up(maybe_applied_at: Option<Instant>, now: Instant) -> bool {
    maybe_applied_at.is_some_and(|at| now.saturating_duration_since(at) >= RETRY_HORIZON)
}

impl Recorder {
    /// Starts the writer task. It ends, after a last flush (at most 5 s while Redis is away),
    /// when every `Recorder` is dropped or `closing` turns true (at shutdown: later writes are
    /// refused and logged). Only records of `tenants` (the configured tenant ids) are written.
    pub fn start(
        store: Store,
        capacity: usize,
        metrics: Arc<Metrics>,
        closing: watch::Receiver<bool>,
        tenants: HashSet<String>,
    ) -> (Self, JoinHandle<()>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let landed = Arc::new(Landed::default());
        let handle =
            tokio::spawn(writer(rx, store, capacity, Arc::clone(&metrics), closing, Arc::clone(&landed)));
        (Self { tx, tenants: Arc::new(tenants), metrics, landed }, handle)
    }

    /// The same writer, also taking records of `tenants` (a config reload). The set only grows:
    /// a request admitted before its tenant was removed is still recorded when it ends.
    #[must_use]
    pub fn with_tenants(&self, tenants: impl IntoIterator<Item = String>) -> Self {
        let mut all = (*self.tenants).clone();
        all.extend(tenants);
        Self { tenants: Arc::new(all), ..self.clone() }
    }

    /// Whether the write of `record_id` (a record, a charge or a release) is known done in Redis
    /// by this replica's writer ([`Landed`]): the usage journal skips it.
    pub fn landed(&self, record_id: &str) -> bool {
        self.landed.contains(record_id)
    }

    /// Queues a finished request's record and its settlements (never blocks); drops, with a
    /// warning and a count, a record of a tenant the config does not list.
    pub fn record(&self, record: UsageRecord, settlements: Vec<(BucketSpec, i64)>, lease: Option<LeaseUse>) {
        if !self.tenants.contains(&record.info.tenant) {
            warn!(tenant = %record.info.tenant, request_id = %record.info.request_id,
                "usage record of an unconfigured tenant dropped");
            self.metrics.records_unknown_tenant.inc();
            return;
        }
        self.send(LedgerOp::Record { record, settlements, lease });
    }

    /// Queues the charge of a reservation whose usage never arrived.
    pub fn charge(&self, record: UsageRecord, settlements: Vec<(BucketSpec, i64)>) {
        self.send(LedgerOp::Charge { record, settlements });
    }

    /// Queues the release of an admission given back (its reservation closed, its request and
    /// tokens returned to `buckets`).
    pub fn release(&self, tenant: String, record_id: String, buckets: Vec<BucketSpec>) {
        self.send(LedgerOp::Release { tenant, record_id, buckets });
    }

    fn send(&self, op: LedgerOp) {
        if let Err(mpsc::error::SendError(op)) = self.tx.send(op) {
            error!(write = ?op, "ledger write not done: recorder stopped");
        }
    }
}

async fn writer(
    mut rx: mpsc::UnboundedReceiver<LedgerOp>,
    store: Store,
    capacity: usize,
    metrics: Arc<Metrics>,
    mut closing: watch::Receiver<bool>,
    landed: Arc<Landed>,
) {
    let mut buffer: VecDeque<Pending> = VecDeque::new();
    let mut closed = false;
    let mut backoff = Duration::from_millis(50);
    let mut open = true;
    let mut deadline: Option<tokio::time::Instant> = None;
    loop {
        if !closed && *closing.borrow() {
            closed = true;
            rx.close();
        }
        if buffer.is_empty() && open {
            tokio::select! {
                r = rx.recv() => match r {
                    Some(r) => push(&mut buffer, r, capacity, &metrics),
                    None => open = false,
                },
                // Shutdown: refuse new writes; what is queued is still received and written.
                _ = closing.wait_for(|closing| *closing), if !closed => {
                    closed = true;
                    rx.close();
                }
            }
        }
        while let Ok(r) = rx.try_recv() {
            push(&mut buffer, r, capacity, &metrics);
        }
        if !open && deadline.is_none() {
            deadline = Some(tokio::time::Instant::now() + SHUTDOWN_FLUSH);
        }
        if buffer.is_empty() {
            if open {
                continue;
            }
            break;
        }
        let n = buffer.len().min(BATCH);
        let mut batch: Vec<Pending> = buffer.drain(..n).collect();
        let outcomes = write_batch(&store, &metrics, &mut batch).await;
        let mut failed = VecDeque::new();
        let now = Instant::now();
        for (mut pending, outcome) in batch.into_iter().zip(outcomes) {
            let Outcome::Retry { error, maybe_applied } = outcome else {
                landed.insert(pending.op.record_id());
                continue;
            };
            if maybe_applied && pending.maybe_applied_at.is_none() {
                pending.maybe_applied_at = Some(now);
            }
            // A charge or a release acts only on an open reservation: retried as long as it takes.
            let deduplicated_by_window = matches!(pending.op, LedgerOp::Record { .. }) && !pending.applied;
            if deduplicated_by_window && give_up(pending.maybe_applied_at, now) {
                error!(write = ?pending.op, %error,
                    "usage record given up: an earlier write may have landed and is past the idempotency retention");
                metrics.records_unconfirmed.inc();
            } else {
                warn!(%error, record_id = %pending.op.record_id(), "ledger write failed; kept for retry");
                failed.push_back(pending);
            }
        }
        let any_failed = !failed.is_empty();
        while let Some(r) = failed.pop_back() {
            buffer.push_front(r);
        }
        metrics.records_buffered.set(i64::try_from(buffer.len()).unwrap_or(i64::MAX));
        if let Some(d) = deadline {
            if tokio::time::Instant::now() >= d {
                break;
            }
        }
        if any_failed {
            // Keep draining the channel while waiting, so senders never see a backlog.
            let sleep = tokio::time::sleep(backoff);
            tokio::pin!(sleep);
            loop {
                tokio::select! {
                    _ = &mut sleep => break,
                    r = rx.recv(), if open => match r {
                        Some(r) => push(&mut buffer, r, capacity, &metrics),
                        None => open = false,
                    },
                }
            }
            backoff = (backoff * 2).min(Duration::from_secs(2));
        } else {
            backoff = Duration::from_millis(50);
        }
    }
    for Pending { op, .. } in buffer {
        error!(write = ?op, "ledger write not done at shutdown");
        metrics.records_dropped.inc();
    }
}

/// How one write's attempt in a batch ended.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Outcome {
    /// Done: applied, or nothing to do.
    Done,
    /// To retry (the write's [`Pending`] keeps what landed).
    Retry {
        /// What failed.
        error: String,
        /// The attempt may have landed (a timeout, a lost connection, a script error part way).
        maybe_applied: bool,
    },
}

impl Outcome {
    fn of_error(error: &StoreError) -> Self {
        Outcome::Retry { error: error.to_string(), maybe_applied: error.maybe_applied() }
    }
}

/// One attempt at each write of `batch`, in two rounds of script calls sent concurrently (they
/// travel pipelined on the multiplexed connection):
/// 1. the ledger: one `batch` call of `lua/ledger_v1.lua` per tenant and [`LEDGER_BATCH`] writes
///    (a tenant's keys share one cluster slot), for every release and every record or charge whose
///    script has not landed yet;
/// 2. the usage stream: one append call per [`APPEND_BATCH`] records or charges whose ledger
///    write landed now or before, and records the ledger had from another delivery (whose event
///    that delivery may not have appended).
///
/// One outcome per write, in order. Measured on the leased gateway at saturation (`INFO
/// commandstats`): before, three `EVALSHA` per record at 19.3 µs each inside Redis; batched, about
/// 14 writes per ledger call. The script sums a call's increments and expiries per key and settles
/// its buckets in memory, so a leased record in a batch of 14 costs Redis about 18–21 µs against
/// 26 µs when each write issued its own commands (`tests/ledger_cost.rs`, the same probe on both
/// scripts).
async fn write_batch(store: &Store, metrics: &Metrics, batch: &mut [Pending]) -> Vec<Outcome> {
    let mut outcomes: Vec<Option<Outcome>> = vec![None; batch.len()];
    // 1. The ledger, by tenant.
    let mut by_tenant: Vec<(&str, Vec<usize>)> = Vec::new();
    for (i, pending) in batch.iter().enumerate() {
        let tenant = match &pending.op {
            LedgerOp::Record { record, .. } | LedgerOp::Charge { record, .. } if !pending.applied => {
                record.info.tenant.as_str()
            }
            LedgerOp::Release { tenant, .. } => tenant.as_str(),
            LedgerOp::Record { .. } | LedgerOp::Charge { .. } => continue,
        };
        match by_tenant.iter_mut().find(|(t, _)| *t == tenant) {
            Some((_, members)) => members.push(i),
            None => by_tenant.push((tenant, vec![i])),
        }
    }
    let chunks: Vec<Vec<usize>> = by_tenant
        .iter()
        .flat_map(|(_, members)| members.chunks(LEDGER_BATCH))
        .map(<[usize]>::to_vec)
        .collect();
    drop(by_tenant);
    let calls = chunks.iter().map(|members| {
        let writes: Vec<LedgerWrite<'_>> = members
            .iter()
            .filter_map(|&i| batch.get(i))
            .map(|pending| match &pending.op {
                LedgerOp::Record { record, settlements, lease } => {
                    LedgerWrite::Record { record, settlements, charge: false, lease: lease.as_ref() }
                }
                LedgerOp::Charge { record, settlements } => {
                    LedgerWrite::Record { record, settlements, charge: true, lease: None }
                }
                LedgerOp::Release { tenant, record_id, buckets } => {
                    LedgerWrite::Release { tenant, record_id, buckets }
                }
            })
            .collect();
        async move { metrics.timed_redis("ledger", store.ledger_batch(&writes)).await }
    });
    let results = join_all(calls).await;
    for (members, result) in chunks.iter().zip(results) {
        for (k, &i) in members.iter().enumerate() {
            let (Some(pending), Some(outcome)) = (batch.get_mut(i), outcomes.get_mut(i)) else { continue };
            let reply = match &result {
                Ok(replies) => replies.get(k).copied().unwrap_or(LedgerReply::Failed),
                Err(error) => {
                    *outcome = Some(Outcome::of_error(error));
                    continue;
                }
            };
            *outcome = ledger_outcome(metrics, pending, reply);
        }
    }
    // 2. The usage stream, for what the ledger applied.
    let to_append: Vec<usize> = (0..batch.len())
        .filter(|&i| outcomes.get(i).is_some_and(Option::is_none) && batch.get(i).is_some_and(|p| p.applied))
        .collect();
    let chunks: Vec<&[usize]> = to_append.chunks(APPEND_BATCH).collect();
    let calls = chunks.iter().map(|members| {
        let records: Vec<&UsageRecord> = members
            .iter()
            .filter_map(|&i| match batch.get(i).map(|p| &p.op) {
                Some(LedgerOp::Record { record, .. } | LedgerOp::Charge { record, .. }) => Some(record),
                _ => None,
            })
            .collect();
        async move { metrics.timed_redis("append", store.append_batch(&records)).await }
    });
    let results = join_all(calls).await;
    for (members, result) in chunks.iter().zip(results) {
        for &i in *members {
            let (Some(pending), Some(outcome)) = (batch.get(i), outcomes.get_mut(i)) else { continue };
            *outcome = Some(match &result {
                Ok(_) => {
                    if matches!(pending.op, LedgerOp::Charge { .. }) {
                        metrics.records_charged.inc();
                    } else if !pending.duplicate {
                        metrics.records_written.inc();
                    }
                    Outcome::Done
                }
                Err(error) => Outcome::of_error(error),
            });
        }
    }
    outcomes.into_iter().map(|o| o.unwrap_or(Outcome::Done)).collect()
}

/// What a write's ledger reply leaves to do: `None` when its event is still to be appended (the
/// record or charge landed, now or by an earlier attempt), else its outcome.
fn ledger_outcome(metrics: &Metrics, pending: &mut Pending, reply: LedgerReply) -> Option<Outcome> {
    let charge = matches!(pending.op, LedgerOp::Charge { .. });
    match reply {
        LedgerReply::Failed => Some(Outcome::Retry {
            error: "lua/ledger_v1.lua raised an error on this write".to_owned(),
            maybe_applied: true,
        }),
        LedgerReply::Released(released) => {
            if released {
                metrics.reservations_released.inc();
            }
            Some(Outcome::Done)
        }
        LedgerReply::Record(Applied::Applied) => {
            pending.applied = true;
            None
        }
        // Landed by an earlier attempt whose answer was lost: its event may be missing.
        LedgerReply::Record(Applied::Duplicate) if pending.maybe_applied_at.is_some() => {
            pending.applied = true;
            None
        }
        // Applied by another delivery (a second sink, the usage journal, another replica), which
        // may have gone away between its ledger write and its event: the event is asked for again
        // (appended once per record id, so never twice).
        LedgerReply::Record(Applied::Duplicate) if !charge => {
            metrics.records_duplicate.inc();
            pending.applied = true;
            pending.duplicate = true;
            None
        }
        // A charge of a reservation no longer open: nothing of it is written.
        LedgerReply::Record(Applied::Duplicate) => Some(Outcome::Done),
        LedgerReply::Record(Applied::AfterCharge) => {
            if let LedgerOp::Record { record, .. } = &pending.op {
                warn!(record = ?record, "usage arrived after its reservation was charged: not applied");
            }
            metrics.records_after_charge.inc();
            Some(Outcome::Done)
        }
    }
}

fn push(buffer: &mut VecDeque<Pending>, op: LedgerOp, capacity: usize, metrics: &Metrics) {
    if buffer.len() >= capacity {
        if let Some(oldest) = buffer.pop_front() {
            error!(write = ?oldest.op, "usage buffer full: ledger write dropped");
            metrics.records_dropped.inc();
        }
    }
    buffer.push_back(Pending { op, maybe_applied_at: None, applied: false, duplicate: false });
    metrics.records_buffered.set(i64::try_from(buffer.len()).unwrap_or(i64::MAX));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_is_given_up_only_past_the_horizon_of_an_attempt_that_may_have_landed() {
        let t0 = Instant::now();
        assert!(!give_up(None, t0 + Duration::from_secs(86_400)), "never landed: retried for ever");
        assert!(!give_up(Some(t0), t0 + RETRY_HORIZON - Duration::from_millis(1)));
        assert!(give_up(Some(t0), t0 + RETRY_HORIZON));
        // The horizon leaves the margin inside the retention Redis keeps the applied ids for.
        assert_eq!(RETRY_HORIZON + CLOCK_SKEW_MARGIN, IDEMPOTENCY_RETENTION);
    }

    #[test]
    fn records_of_unconfigured_tenants_are_dropped_and_counted() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let metrics = Metrics::new();
        let recorder = Recorder {
            tx,
            tenants: Arc::new(HashSet::from(["acme".to_owned()])),
            metrics: Arc::clone(&metrics),
            landed: Arc::default(),
        };
        let record = |tenant: &str| {
            let info =
                crate::metering::meter::RequestInfo { tenant: tenant.to_owned(), ..Default::default() };
            UsageRecord::new(info, gateway_meter::Usage::unseen(1, 200), true)
        };
        recorder.record(record("mallory"), Vec::new(), None);
        recorder.record(record(""), Vec::new(), None);
        assert!(rx.try_recv().is_err(), "nothing queued for Redis");
        assert_eq!(metrics.records_unknown_tenant.get(), 2);
        recorder.record(record("acme"), Vec::new(), None);
        let queued = rx.try_recv().ok();
        assert!(
            matches!(&queued, Some(LedgerOp::Record { record, .. }) if record.info.tenant == "acme"),
            "{queued:?}"
        );
        assert_eq!(metrics.records_unknown_tenant.get(), 2);
    }
}
