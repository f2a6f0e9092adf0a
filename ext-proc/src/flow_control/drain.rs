//! A pool's drain rate while its queue held requests ([`DrainMeter`]), and the waits and
//! `Retry-After`s flow control predicts from it, with no I/O and an injected clock.

use std::time::{Duration, Instant};

/// The expected wait of a request with `ahead` requests to be dispatched before it, at the
/// pool's drain rate (requests/s); None while the rate is unknown or zero.
pub fn predicted_wait(ahead: usize, drain_per_s: Option<f64>) -> Option<Duration> {
    let rate = drain_per_s.filter(|r| r.is_finite() && *r > 0.0)?;
    Some(Duration::from_secs_f64(((ahead + 1) as f64 / rate).min(86_400.0)))
}

/// The expected wait of a new request of a tenant with `own` requests queued, `ahead` of it in
/// the fair order ([`crate::flow_control::queue::FlowQueue::ahead`]): the longer of `ahead` at
/// the pool's drain rate and, for a tenant already backlogged, its own queue at the rate it was
/// served while backlogged (`tenant_per_s`): a backlogged tenant gets its share, not the pool's
/// rate, as tenants under their share keep going ahead of it. None while neither is known.
pub fn predicted_wait_of(
    ahead: usize,
    drain_per_s: Option<f64>,
    own: usize,
    tenant_per_s: Option<f64>,
) -> Option<Duration> {
    let by_pool = predicted_wait(ahead, drain_per_s);
    let by_tenant = if own > 0 { predicted_wait(own, tenant_per_s) } else { None };
    match (by_pool, by_tenant) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, b) => a.or(b),
    }
}

/// `Retry-After` in whole seconds (1..=30) for a request refused by the queue: the time until the
/// requests now ahead of it have drained to what its tier's `budget` can wait for; 1 while the
/// drain rate is unknown.
pub fn retry_after_secs(ahead: usize, drain_per_s: Option<f64>, budget: Duration) -> u64 {
    let Some(wait) = predicted_wait(ahead, drain_per_s) else { return 1 };
    retry_after_wait(wait, budget)
}

/// `Retry-After` in whole seconds (1..=30) for a request predicted to wait `wait` against its
/// tier's `budget`: the time until the wait would fit.
pub fn retry_after_wait(wait: Duration, budget: Duration) -> u64 {
    (wait.saturating_sub(budget).as_secs_f64().ceil() as u64).clamp(1, 30)
}

/// Shortest span of saturation a drain-rate sample covers.
const DRAIN_WINDOW: Duration = Duration::from_secs(1);

/// Weight of the newest sample in the smoothed drain rate.
const DRAIN_ALPHA: f64 = 0.5;

/// The pool's drain rate while saturated: ends seen while the queue held requests, per second,
/// over windows of at least [`DRAIN_WINDOW`], exponentially smoothed ([`DRAIN_ALPHA`]).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct DrainMeter {
    /// When the current window started, and the ends counted in it.
    window: Option<(Instant, u64)>,
    rate: Option<f64>,
}

impl DrainMeter {
    /// A request of the pool ended at `now`, with requests queued (`backlogged`) or not. An end
    /// with nothing queued closes the window without a sample: the pool was not saturated.
    pub fn finished(&mut self, now: Instant, backlogged: bool) {
        if !backlogged {
            self.window = None;
            return;
        }
        let Some((start, ends)) = self.window else {
            self.window = Some((now, 0));
            return;
        };
        let ends = ends + 1;
        let elapsed = now.saturating_duration_since(start);
        if elapsed >= DRAIN_WINDOW {
            let sample = ends as f64 / elapsed.as_secs_f64();
            self.rate = Some(crate::pools::signals::smooth_rate(self.rate, sample, DRAIN_ALPHA));
            self.window = Some((now, 0));
        } else {
            self.window = Some((start, ends));
        }
    }

    /// Requests per second, None until a first window was measured.
    pub fn rate(&self) -> Option<f64> {
        self.rate
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_backlogged_tenant_waits_at_its_own_rate() {
        let s = Duration::from_secs;
        // 40 queued ahead at 50/s: 0.82 s by the pool. But the tenant is served 10/s while
        // backlogged, and 40 of its own are queued: 4.1 s.
        assert_eq!(predicted_wait_of(40, Some(50.0), 40, Some(10.0)), Some(Duration::from_millis(4100)));
        // Not backlogged, or its rate unknown: the pool's estimate.
        assert_eq!(predicted_wait_of(49, Some(50.0), 0, Some(10.0)), Some(s(1)));
        assert_eq!(predicted_wait_of(49, Some(50.0), 3, None), Some(s(1)));
        // The tenant's own rate alone, before the pool's is measured.
        assert_eq!(predicted_wait_of(9, None, 9, Some(10.0)), Some(s(1)));
        assert_eq!(predicted_wait_of(9, None, 0, None), None);
        assert_eq!(retry_after_wait(Duration::from_millis(4100), s(2)), 3);
    }

    #[test]
    fn the_drain_rate_is_measured_while_saturated_only() {
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        let mut m = DrainMeter::default();
        // Ends with nothing queued: no sample.
        for i in 0..20 {
            m.finished(at(i * 10), false);
        }
        assert_eq!(m.rate(), None);
        // One end every 100 ms while backlogged: 10/s once a second has passed.
        for i in 0..=10 {
            m.finished(at(1000 + i * 100), true);
        }
        assert_eq!(m.rate(), Some(10.0));
        // Idle for an hour: the rate is kept.
        m.finished(at(3_600_000), false);
        assert_eq!(m.rate(), Some(10.0));
        // Saturated again at 20/s: smoothed toward it.
        for i in 0..=20 {
            m.finished(at(3_700_000 + i * 50), true);
        }
        assert_eq!(m.rate(), Some(15.0));
    }

    #[test]
    fn waits_from_the_drain_rate() {
        assert_eq!(predicted_wait(9, Some(10.0)), Some(Duration::from_secs(1)));
        assert_eq!(predicted_wait(9, None), None);
        assert_eq!(predicted_wait(9, Some(0.0)), None);
        assert_eq!(retry_after_secs(39, Some(10.0), Duration::from_secs(1)), 3);
        assert_eq!(retry_after_secs(5, Some(10.0), Duration::from_secs(1)), 1);
        assert_eq!(retry_after_secs(100_000, Some(1.0), Duration::ZERO), 30);
        assert_eq!(retry_after_secs(3, None, Duration::ZERO), 1);
    }
}
