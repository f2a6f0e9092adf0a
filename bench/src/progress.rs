//! A plain progress line on stderr: rewritten in place (`\r`) every 250 ms
//! when stderr is a terminal, otherwise one line every 5 s.

use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// Live counters of one point, updated by request tasks.
#[derive(Debug, Default)]
pub struct Counters {
    /// Measured requests dispatched.
    pub sent: AtomicU64,
    /// Requests finished with class `ok`.
    pub ok: AtomicU64,
    /// Requests finished with any other class.
    pub failed: AtomicU64,
}

impl Counters {
    fn line(&self, label: &str, total: u64, elapsed: Duration) -> String {
        let sent = self.sent.load(Ordering::Relaxed);
        let ok = self.ok.load(Ordering::Relaxed);
        let failed = self.failed.load(Ordering::Relaxed);
        let secs = elapsed.as_secs_f64();
        let rate = if secs > 0.0 { ok as f64 / secs } else { 0.0 };
        format!(
            "{label}: sent {sent}/{total} ok {ok} failed {failed} in-flight {} | {rate:.1} req/s | {secs:.1}s",
            sent.saturating_sub(ok + failed)
        )
    }
}

/// A running progress reporter; [`Reporter::finish`] prints the final line.
pub struct Reporter {
    task: JoinHandle<()>,
    label: String,
    total: u64,
    counters: Arc<Counters>,
    start: Instant,
    tty: bool,
}

impl Reporter {
    /// Starts reporting `counters` for a point of `total` requests.
    pub fn start(label: String, total: u64, counters: Arc<Counters>) -> Self {
        let tty = std::io::stderr().is_terminal();
        let start = Instant::now();
        let period = if tty { Duration::from_millis(250) } else { Duration::from_secs(5) };
        let (l, c) = (label.clone(), counters.clone());
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval_at(start + period, period);
            loop {
                tick.tick().await;
                let line = c.line(&l, total, start.elapsed());
                let mut err = std::io::stderr().lock();
                let _ = if tty { write!(err, "\r\x1b[2K{line}") } else { writeln!(err, "{line}") };
                let _ = err.flush();
            }
        });
        Self { task, label, total, counters, start, tty }
    }

    /// Stops the reporter and prints the final state on its own line.
    pub fn finish(self) {
        self.task.abort();
        let line = self.counters.line(&self.label, self.total, self.start.elapsed());
        let mut err = std::io::stderr().lock();
        let _ = if self.tty { writeln!(err, "\r\x1b[2K{line}") } else { writeln!(err, "{line}") };
    }
}
