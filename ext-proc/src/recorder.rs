//! Usage records on their way to Redis: a bounded in-memory buffer and one writer task.
//!
//! Records are queued without waiting; the writer writes them in batches (concurrent commands
//! on the multiplexed connection, so they travel pipelined). A record whose write fails stays at
//! the head of the buffer and is retried with backoff until Redis returns, so an outage loses
//! nothing while the buffer has room (`metering.buffer_records`). Writes are idempotent per
//! record id, so a retry after a write that did land counts nothing twice. Past the bound the
//! oldest record is logged whole at error level and counted, never dropped silently.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use futures::future::join_all;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tracing::{error, warn};

use crate::meter::UsageRecord;
use crate::metrics::Metrics;
use crate::store::Store;

/// Records written concurrently per batch.
const BATCH: usize = 256;
/// How long the writer keeps flushing after shutdown before it logs what is left.
const SHUTDOWN_FLUSH: Duration = Duration::from_secs(5);

/// The sending side; cheap to clone.
#[derive(Clone)]
pub struct Recorder {
    tx: mpsc::UnboundedSender<UsageRecord>,
}

impl Recorder {
    /// Starts the writer task. It ends, after a last flush (at most 5 s while Redis is away),
    /// when every `Recorder` is dropped or `closing` turns true (at shutdown: later records are
    /// refused and logged).
    pub fn start(
        store: Store,
        capacity: usize,
        metrics: Arc<Metrics>,
        closing: watch::Receiver<bool>,
    ) -> (Self, JoinHandle<()>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let handle = tokio::spawn(writer(rx, store, capacity, metrics, closing));
        (Self { tx }, handle)
    }

    /// Queues a record (never blocks).
    pub fn record(&self, record: UsageRecord) {
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
    let mut buffer: VecDeque<UsageRecord> = VecDeque::new();
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
        let results = join_all(buffer.iter().take(n).map(|r| async {
            let started = std::time::Instant::now();
            let result = store.record(r).await;
            metrics.redis_call("record", started.elapsed(), result.is_ok());
            result
        }))
        .await;
        let mut failed = VecDeque::new();
        for (record, result) in buffer.drain(..n).zip(results) {
            match result {
                Ok(()) => {
                    metrics.records_written.inc();
                }
                Err(e) => {
                    warn!(error = %e, request_id = %record.info.request_id, "usage record write failed; kept for retry");
                    failed.push_back(record);
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
    for record in buffer {
        error!(record = ?record, "usage record not written at shutdown");
        metrics.records_dropped.inc();
    }
}

fn push(buffer: &mut VecDeque<UsageRecord>, record: UsageRecord, capacity: usize, metrics: &Metrics) {
    if buffer.len() >= capacity {
        if let Some(oldest) = buffer.pop_front() {
            error!(record = ?oldest, "usage buffer full: record dropped");
            metrics.records_dropped.inc();
        }
    }
    buffer.push_back(record);
    metrics.records_buffered.set(i64::try_from(buffer.len()).unwrap_or(i64::MAX));
}
