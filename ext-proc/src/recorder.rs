//! Usage records on their way to Redis: a bounded in-memory buffer and one writer task.
//!
//! Records are queued without waiting; the writer writes them in batches (concurrent commands
//! on the multiplexed connection, so they travel pipelined). A record whose write fails stays at
//! the head of the buffer and is retried with backoff until Redis returns, so an outage loses
//! nothing while the buffer has room (`metering.buffer_records`). Writes are idempotent per
//! record id for [`IDEMPOTENCY_RETENTION`] after an attempt that may have landed (a timeout, a
//! connection lost mid-command), so a retry after a write that did land counts nothing twice; a
//! record still unwritten [`RETRY_HORIZON`] after such an attempt is given up, logged whole at
//! error level and counted in `llm_gateway_usage_records_unconfirmed_total`, rather than risk
//! counting it twice. Past the buffer's bound the oldest record is logged whole at error level
//! and counted, never dropped silently. Records of tenants the config does not list are dropped
//! with a warning and counted in `llm_gateway_usage_records_unknown_tenant_total` (no Redis key is
//! ever made for them).

use std::collections::{HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::join_all;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tracing::{error, warn};

use crate::meter::UsageRecord;
use crate::metrics::Metrics;
use crate::store::{Store, CLOCK_SKEW_MARGIN, IDEMPOTENCY_RETENTION};

/// How long after a write attempt that may have landed a record is still retried: the
/// idempotency retention less the clock-skew margin.
pub const RETRY_HORIZON: Duration = IDEMPOTENCY_RETENTION.saturating_sub(CLOCK_SKEW_MARGIN);

/// Records written concurrently per batch.
const BATCH: usize = 256;
/// How long the writer keeps flushing after shutdown before it logs what is left.
const SHUTDOWN_FLUSH: Duration = Duration::from_secs(5);

/// The sending side; cheap to clone.
#[derive(Clone)]
pub struct Recorder {
    tx: mpsc::UnboundedSender<UsageRecord>,
    tenants: Arc<HashSet<String>>,
    metrics: Arc<Metrics>,
}

/// A record waiting for Redis, with the time of its first attempt that may have landed.
struct Pending {
    record: UsageRecord,
    maybe_applied_at: Option<Instant>,
}

/// Whether a record is given up rather than retried: an attempt that may have landed is older
/// than [`RETRY_HORIZON`], so Redis may no longer know it was applied.
pub fn give_up(maybe_applied_at: Option<Instant>, now: Instant) -> bool {
    maybe_applied_at.is_some_and(|at| now.saturating_duration_since(at) >= RETRY_HORIZON)
}

impl Recorder {
    /// Starts the writer task. It ends, after a last flush (at most 5 s while Redis is away),
    /// when every `Recorder` is dropped or `closing` turns true (at shutdown: later records are
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

    /// Queues a record (never blocks); drops, with a warning and a count, a record of a tenant the
    /// config does not list.
    pub fn record(&self, record: UsageRecord) {
        if !self.tenants.contains(&record.info.tenant) {
            warn!(tenant = %record.info.tenant, request_id = %record.info.request_id,
                "usage record of an unconfigured tenant dropped");
            self.metrics.records_unknown_tenant.inc();
            return;
        }
        if let Err(mpsc::error::SendError(record)) = self.tx.send(record) {
            error!(record = ?record, "usage record not written: recorder stopped");
        }
    }
}

async fn writer(
    mut rx: mpsc::UnboundedReceiver<UsageRecord>,
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
                // Shutdown: refuse new records; what is queued is still received and written.
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
        let results = join_all(buffer.iter().take(n).map(|p| async {
            let started = std::time::Instant::now();
            let result = store.record(&p.record).await;
            metrics.redis_call("record", started.elapsed(), result.is_ok());
            result
        }))
        .await;
        let mut failed = VecDeque::new();
        let now = Instant::now();
        for (mut pending, result) in buffer.drain(..n).zip(results) {
            match result {
                Ok(()) => {
                    metrics.records_written.inc();
                }
                Err(e) => {
                    if e.maybe_applied && pending.maybe_applied_at.is_none() {
                        pending.maybe_applied_at = Some(now);
                    }
                    if give_up(pending.maybe_applied_at, now) {
                        error!(record = ?pending.record, error = %e,
                            "usage record given up: an earlier write may have landed and is past the idempotency retention");
                        metrics.records_unconfirmed.inc();
                    } else {
                        warn!(error = %e, request_id = %pending.record.info.request_id, "usage record write failed; kept for retry");
                        failed.push_back(pending);
                    }
                }
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
    for Pending { record, .. } in buffer {
        error!(record = ?record, "usage record not written at shutdown");
        metrics.records_dropped.inc();
    }
}

fn push(buffer: &mut VecDeque<Pending>, record: UsageRecord, capacity: usize, metrics: &Metrics) {
    if buffer.len() >= capacity {
        if let Some(oldest) = buffer.pop_front() {
            error!(record = ?oldest.record, "usage buffer full: record dropped");
            metrics.records_dropped.inc();
        }
    }
    buffer.push_back(Pending { record, maybe_applied_at: None });
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
        recorder.record(record("mallory"));
        recorder.record(record(""));
        assert!(rx.try_recv().is_err(), "nothing queued for Redis");
        assert_eq!(metrics.records_unknown_tenant.get(), 2);
        recorder.record(record("acme"));
        assert_eq!(rx.try_recv().map(|r| r.info.tenant).ok().as_deref(), Some("acme"));
        assert_eq!(metrics.records_unknown_tenant.get(), 2);
    }
}
