//! The scheduler: at most `--max-num-seqs` requests run at once, the others wait in FIFO
//! order, as vLLM's continuous batching admits them.
//!
//! A request holds a [`Slot`] while it generates; dropping the slot (request finished,
//! client gone) admits the next waiter. The counts feed `vllm:num_requests_running` and
//! `vllm:num_requests_waiting`.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The queue was closed because the server is shutting down.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the server is shutting down")]
pub struct QueueClosed;

/// A boxed wait for a slot, for bodies that must store it.
pub type Admission = Pin<Box<dyn Future<Output = Result<Slot, QueueClosed>> + Send>>;

/// Gauge values at one instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct QueueSnapshot {
    /// Requests holding a slot (`vllm:num_requests_running`).
    pub running: u64,
    /// Requests waiting for one (`vllm:num_requests_waiting`).
    pub waiting: u64,
}

/// FIFO admission to `max_num_seqs` slots (tokio's semaphore queues waiters fairly).
#[derive(Debug)]
pub struct Queue {
    slots: Arc<Semaphore>,
    running: AtomicU64,
    waiting: AtomicU64,
}

/// The right to generate; frees the slot when dropped.
#[derive(Debug)]
pub struct Slot {
    queue: Arc<Queue>,
    _permit: OwnedSemaphorePermit,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.queue.running.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Counts a request as waiting for as long as it lives.
struct Waiting<'a>(&'a Queue);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.waiting.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Queue {
    /// A queue with `max_num_seqs` slots.
    pub fn new(max_num_seqs: u32) -> Arc<Self> {
        Arc::new(Self {
            slots: Arc::new(Semaphore::new((max_num_seqs as usize).min(Semaphore::MAX_PERMITS))),
            running: AtomicU64::new(0),
            waiting: AtomicU64::new(0),
        })
    }

    /// A slot right now if one is free and nobody waits for it.
    pub fn try_admit(self: &Arc<Self>) -> Option<Slot> {
        let permit = self.slots.clone().try_acquire_owned().ok()?;
        Some(self.running_slot(permit))
    }

    /// Waits (counted in `waiting`) for a slot; cancelling the future leaves the queue.
    pub async fn admit(self: Arc<Self>) -> Result<Slot, QueueClosed> {
        self.waiting.fetch_add(1, Ordering::Relaxed);
        let waiting = Waiting(&self);
        let permit = self.slots.clone().acquire_owned().await.map_err(|_| QueueClosed)?;
        drop(waiting);
        Ok(self.running_slot(permit))
    }

    /// [`Queue::try_admit`], else a boxed [`Queue::admit`].
    pub fn admission(self: &Arc<Self>) -> Result<Slot, Admission> {
        self.try_admit().ok_or_else(|| Box::pin(self.clone().admit()) as Admission)
    }

    /// Fails all current and future waiters with [`QueueClosed`]; running requests go on.
    pub fn close(&self) {
        self.slots.close();
    }

    /// The current gauge values.
    pub fn snapshot(&self) -> QueueSnapshot {
        QueueSnapshot {
            running: self.running.load(Ordering::Relaxed),
            waiting: self.waiting.load(Ordering::Relaxed),
        }
    }

    fn running_slot(self: &Arc<Self>, permit: OwnedSemaphorePermit) -> Slot {
        self.running.fetch_add(1, Ordering::Relaxed);
        Slot { queue: self.clone(), _permit: permit }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn waiters_are_admitted_in_order_as_slots_free() {
        let q = Queue::new(1);
        let first = q.try_admit().unwrap();
        assert!(q.try_admit().is_none());
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        for i in 0..3 {
            let (queue, tx) = (q.clone(), tx.clone());
            tokio::spawn(async move {
                let slot = queue.admit().await.unwrap();
                tx.send(i).unwrap();
                tokio::task::yield_now().await;
                drop(slot);
            });
            // Let each waiter enqueue before the next one.
            while q.snapshot().waiting < i + 1 {
                tokio::task::yield_now().await;
            }
        }
        assert_eq!(q.snapshot(), QueueSnapshot { running: 1, waiting: 3 });
        drop(first);
        let mut order = Vec::new();
        for _ in 0..3 {
            order.push(tokio::time::timeout(Duration::from_secs(5), rx.recv()).await.unwrap().unwrap());
        }
        assert_eq!(order, [0, 1, 2]);
        while q.snapshot().running > 0 {
            tokio::task::yield_now().await;
        }
        assert_eq!(q.snapshot(), QueueSnapshot::default());
    }

    #[tokio::test]
    async fn cancelled_and_closed_waits_leave_the_queue() {
        let q = Queue::new(1);
        let _held = q.try_admit().unwrap();
        let Err(mut admission) = q.admission() else { panic!("no slot expected") };
        assert!(futures::poll!(admission.as_mut()).is_pending());
        assert_eq!(q.snapshot().waiting, 1);
        drop(admission);
        assert_eq!(q.snapshot().waiting, 0);

        let waiter = tokio::spawn(q.clone().admit());
        while q.snapshot().waiting == 0 {
            tokio::task::yield_now().await;
        }
        q.close();
        assert_eq!(waiter.await.unwrap().unwrap_err(), QueueClosed);
        assert_eq!(q.snapshot(), QueueSnapshot { running: 1, waiting: 0 });
    }
}
