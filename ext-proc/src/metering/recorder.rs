//! The ledger's writes on their way to Redis: a bounded in-memory buffer and one writer task.
//!
//! Three kinds of write ([`LedgerOp`]): a finished request's usage record with the settlement of
//! its reservation, the charge of a reservation whose usage never arrived ([`crate::sweeper`]),
//! and the release of an admission given back before its request went upstream. They are queued
//! without waiting; the writer writes them in batches (concurrent commands on the multiplexed
//! connection, so they travel pipelined), each through one `lua/ledger_v1.lua` call (then, for a
//! record or a charge that landed, its event on the usage stream). A write that fails stays at the
//! head of the buffer and is retried with backoff until Redis returns, so an outage loses nothing
//! while the buffer has room (`metering.buffer_records`).
//!
//! Every write is applied once per request ([`crate::ledger`]): a record closes its request's
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

use crate::admission_lease::LeaseUse;
use crate::limits::BucketSpec;
use crate::meter::UsageRecord;
use crate::metrics::Metrics;
use crate::store::{Applied, Store, StoreError, CLOCK_SKEW_MARGIN, IDEMPOTENCY_RETENTION};

/// How long after a write attempt that may have landed a record is still retried: the
/// idempotency retention less the clock-skew margin.
pub const RETRY_HORIZON: Duration = IDEMPOTENCY_RETENTION.saturating_sub(CLOCK_SKEW_MARGIN);

/// Writes done concurrently per batch.
const BATCH: usize = 256;
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
    /// A reservation recorded as charged: no usage arrived ([`crate::ledger::charged_record`]).
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
}

/// A write waiting for Redis: the time of its first attempt that may have landed, and, for a
/// record or a charge, whether its ledger script landed (only the stream append is left).
struct Pending {
    op: LedgerOp,
    maybe_applied_at: Option<Instant>,
    applied: bool,
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
        let handle = tokio::spawn(writer(rx, store, capacity, Arc::clone(&metrics), closing));
        (Self { tx, tenants: Arc::new(tenants), metrics }, handle)
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
        let results = join_all(batch.iter_mut().map(|p| write(&store, &metrics, p))).await;
        let mut failed = VecDeque::new();
        let now = Instant::now();
        for (mut pending, result) in batch.into_iter().zip(results) {
            let Err(e) = result else { continue };
            if e.maybe_applied() && pending.maybe_applied_at.is_none() {
                pending.maybe_applied_at = Some(now);
            }
            // A charge or a release acts only on an open reservation: retried as long as it takes.
            let deduplicated_by_window = matches!(pending.op, LedgerOp::Record { .. }) && !pending.applied;
            if deduplicated_by_window && give_up(pending.maybe_applied_at, now) {
                error!(write = ?pending.op, error = %e,
                    "usage record given up: an earlier write may have landed and is past the idempotency retention");
                metrics.records_unconfirmed.inc();
            } else {
                warn!(error = %e, record_id = %pending.op.record_id(), "ledger write failed; kept for retry");
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

/// One attempt at a write: `Ok` when it is done (applied, or nothing to do), `Err` to retry
/// (`pending` keeps what landed).
async fn write(store: &Store, metrics: &Metrics, pending: &mut Pending) -> Result<(), StoreError> {
    let (record, settlements, charge, lease) = match &pending.op {
        LedgerOp::Record { record, settlements, lease } => (record, settlements, false, lease.as_ref()),
        LedgerOp::Charge { record, settlements } => (record, settlements, true, None),
        LedgerOp::Release { tenant, record_id, buckets } => {
            let started = std::time::Instant::now();
            let result = store.release(tenant, record_id, buckets).await;
            metrics.redis_call("release", started.elapsed(), result.is_ok());
            if result? {
                metrics.reservations_released.inc();
            }
            return Ok(());
        }
    };
    if !pending.applied {
        let started = std::time::Instant::now();
        let result = store.apply(record, settlements, charge, lease).await;
        metrics.redis_call(if charge { "charge" } else { "record" }, started.elapsed(), result.is_ok());
        match result? {
            Applied::Applied => pending.applied = true,
            // Landed by an earlier attempt whose answer was lost: its event may be missing.
            Applied::Duplicate if pending.maybe_applied_at.is_some() => pending.applied = true,
            Applied::Duplicate => {
                if !charge {
                    metrics.records_duplicate.inc();
                }
                return Ok(());
            }
            Applied::AfterCharge => {
                warn!(record = ?record, "usage arrived after its reservation was charged: not applied");
                metrics.records_after_charge.inc();
                return Ok(());
            }
        }
    }
    let started = std::time::Instant::now();
    let result = store.append(record).await;
    metrics.redis_call("append", started.elapsed(), result.is_ok());
    result?;
    if charge {
        metrics.records_charged.inc();
    } else {
        metrics.records_written.inc();
    }
    Ok(())
}

fn push(buffer: &mut VecDeque<Pending>, op: LedgerOp, capacity: usize, metrics: &Metrics) {
    if buffer.len() >= capacity {
        if let Some(oldest) = buffer.pop_front() {
            error!(write = ?oldest.op, "usage buffer full: ledger write dropped");
            metrics.records_dropped.inc();
        }
    }
    buffer.push_back(Pending { op, maybe_applied_at: None, applied: false });
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
        };
        let record = |tenant: &str| {
            let info = crate::meter::RequestInfo { tenant: tenant.to_owned(), ..Default::default() };
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
