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

/// Fewest ends a drain-rate sample counts: an engine whose completions come in bursts (a batch
/// ends together) would otherwise measure a near-zero rate over a window between two bursts.
pub const MIN_DRAIN_ENDS: u64 = 8;

/// Whether a request of a tenant with `own` requests queued (`own + 1` with it) is within what
/// its fair share of the pool drains inside `budget`: the pool's drain rate (`drain_per_s`) times
/// its `share` (its weight over the weights of the tenants backlogged with it). Such a request is
/// never refused on a predicted wait: whatever a short window measured of its own rate, the fair
/// order gives it that share. False while the pool's rate is unknown.
pub fn within_fair_share(own: usize, drain_per_s: Option<f64>, share: f64, budget: Duration) -> bool {
    let Some(rate) = drain_per_s.filter(|r| r.is_finite() && *r > 0.0) else { return false };
    let share = if share.is_finite() { share.clamp(0.0, 1.0) } else { 0.0 };
    (own + 1) as f64 <= rate * share * budget.as_secs_f64()
}

/// Weight of the newest sample in the smoothed drain rate.
const DRAIN_ALPHA: f64 = 0.5;

/// The pool's drain rate while saturated: ends seen while the queue held requests, per second,
/// over windows of at least [`DRAIN_WINDOW`] and [`MIN_DRAIN_ENDS`] ends, exponentially smoothed
/// ([`DRAIN_ALPHA`]). An end with nothing queued discards the open window.
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
        if elapsed >= DRAIN_WINDOW && ends >= MIN_DRAIN_ENDS {
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
    fn bursty_completions_measure_their_true_rate() {
        // An engine that ends a batch of 4 together every 5 s: 0.8/s. A one-second window that
        // closed at the first end after it would measure 1 end over 5 s (0.2/s) between bursts
        // of a tenant served one request a batch.
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        let mut m = DrainMeter::default();
        for burst in 0..6u64 {
            for _ in 0..4 {
                m.finished(at(burst * 5_000), true);
            }
        }
        let rate = m.rate().unwrap();
        assert!((rate - 0.8).abs() < 0.15, "{rate}");
        // A tenant dispatched once every 5 s: no sample until 8 of its dispatches were seen.
        let mut t = DrainMeter::default();
        for i in 0..8u64 {
            t.finished(at(i * 5_000), true);
        }
        assert_eq!(t.rate(), None);
        t.finished(at(8 * 5_000), true);
        assert_eq!(t.rate(), Some(0.2));
    }

    #[test]
    fn a_backlog_within_the_fair_share_is_never_refused() {
        let budget = Duration::from_secs(60);
        // Two equal tenants backlogged on a pool draining 0.7/s: each drains 0.35/s, 21 in 60 s.
        assert!(within_fair_share(15, Some(0.7), 0.5, budget));
        assert!(within_fair_share(20, Some(0.7), 0.5, budget));
        assert!(!within_fair_share(21, Some(0.7), 0.5, budget));
        // Unknown rate: no such promise.
        assert!(!within_fair_share(0, None, 1.0, budget));
        assert!(!within_fair_share(0, Some(1.0), f64::NAN, budget));
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
