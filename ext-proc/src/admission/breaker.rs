//! A circuit breaker for Redis, with no I/O and an injected clock: after `failure_threshold`
//! consecutive failures it opens for `open_for`, so a dead Redis costs requests no wait (each
//! decision is made degraded at once); then one probe is let through (half-open), and a success
//! closes it again.

use std::time::{Duration, Instant};

/// The breaker's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BreakerState {
    /// Calls go to Redis; `failures` counts consecutive failures.
    Closed {
        /// Consecutive failures so far.
        failures: u32,
    },
    /// Calls are refused until `until`.
    Open {
        /// When a probe may go through.
        until: Instant,
    },
    /// One probe is in flight; others are refused until it settles.
    HalfOpen,
}

/// Circuit breaker: ask [`Breaker::allow`] before a call, report its result with
/// [`Breaker::record`].
#[derive(Debug, Clone)]
pub struct Breaker {
    state: BreakerState,
    failure_threshold: u32,
    open_for: Duration,
}

impl Breaker {
    /// A closed breaker that opens after `failure_threshold` consecutive failures (at least 1)
    /// for `open_for`.
    pub fn new(failure_threshold: u32, open_for: Duration) -> Self {
        Self {
            state: BreakerState::Closed { failures: 0 },
            failure_threshold: failure_threshold.max(1),
            open_for,
        }
    }

    /// Whether a call may go to Redis now. In the open state, the first call after the cool-down
    /// is let through as the half-open probe.
    pub fn allow(&mut self, now: Instant) -> bool {
        match self.state {
            BreakerState::Closed { .. } => true,
            BreakerState::Open { until } if now >= until => {
                self.state = BreakerState::HalfOpen;
                true
            }
            BreakerState::Open { .. } | BreakerState::HalfOpen => false,
        }
    }

    /// Reports the outcome of an allowed call.
    pub fn record(&mut self, success: bool, now: Instant) {
        self.state = match (self.state, success) {
            (_, true) => BreakerState::Closed { failures: 0 },
            (BreakerState::Closed { failures }, false) if failures + 1 < self.failure_threshold => {
                BreakerState::Closed { failures: failures + 1 }
            }
            (_, false) => BreakerState::Open { until: now + self.open_for },
        };
    }

    /// The current state.
    pub fn state(&self) -> BreakerState {
        self.state
    }

    /// Whether calls are being refused (open or probing).
    pub fn is_open(&self) -> bool {
        !matches!(self.state, BreakerState::Closed { .. })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_after_consecutive_failures_and_recovers_after_a_probe() {
        let t0 = Instant::now();
        let mut b = Breaker::new(3, Duration::from_secs(2));
        for _ in 0..2 {
            assert!(b.allow(t0));
            b.record(false, t0);
        }
        assert!(!b.is_open());
        assert!(b.allow(t0));
        b.record(false, t0);
        assert!(b.is_open());
        assert!(!b.allow(t0 + Duration::from_secs(1)), "no call while open");
        assert!(b.allow(t0 + Duration::from_secs(2)), "the probe");
        assert!(!b.allow(t0 + Duration::from_secs(2)), "one probe at a time");
        b.record(true, t0 + Duration::from_secs(2));
        assert_eq!(b.state(), BreakerState::Closed { failures: 0 });
    }

    #[test]
    fn a_failed_probe_reopens() {
        let t0 = Instant::now();
        let mut b = Breaker::new(1, Duration::from_millis(100));
        b.record(false, t0);
        assert!(b.allow(t0 + Duration::from_millis(100)));
        b.record(false, t0 + Duration::from_millis(100));
        assert_eq!(b.state(), BreakerState::Open { until: t0 + Duration::from_millis(200) });
    }

    #[test]
    fn a_success_resets_the_count() {
        let t0 = Instant::now();
        let mut b = Breaker::new(2, Duration::from_secs(1));
        b.record(false, t0);
        b.record(true, t0);
        b.record(false, t0);
        assert!(!b.is_open());
    }
}
