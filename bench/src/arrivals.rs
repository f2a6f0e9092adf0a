//! Request arrival schedules.
//!
//! The generator yields the *scheduled send time* of each request as an
//! offset from the start of the point. The runner sleeps until that instant
//! (never sleeping when it is already late, so the long-run rate stays exact
//! despite timer granularity) and then waits for a concurrency permit, so
//! requests queue FIFO behind the concurrency cap exactly as in vLLM's
//! `bench serve`.

use rand::rngs::StdRng;
use rand::SeedableRng;
use rand_distr::{Distribution, Exp, Gamma};
use std::time::Duration;

/// How requests arrive.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ArrivalPattern {
    /// Send as fast as the concurrency cap allows (`--request-rate inf`).
    Unlimited,
    /// Random arrivals with mean `rate` requests/s. `burstiness` is the
    /// gamma shape factor of the inter-arrival times (1.0 = Poisson process,
    /// i.e. exponential gaps; < 1 burstier, > 1 more regular), with the mean
    /// gap kept at `1 / rate` s.
    Poisson {
        /// Mean arrival rate (requests/s, > 0, finite).
        rate: f64,
        /// Gamma shape (> 0); 1.0 = Poisson.
        burstiness: f64,
    },
    /// `size` requests released at once every `interval`.
    Burst {
        /// Requests per burst (≥ 1).
        size: u32,
        /// Time between bursts.
        interval: Duration,
    },
}

enum Gaps {
    None,
    Exp(Exp<f64>),
    Gamma(Gamma<f64>),
}

/// Deterministic (seeded) generator of scheduled send offsets.
pub struct ArrivalGenerator {
    pattern: ArrivalPattern,
    gaps: Gaps,
    rng: StdRng,
    /// Scheduled offset of the next request, seconds.
    next_s: f64,
    issued: u64,
}

impl ArrivalGenerator {
    /// Creates a generator; `Err` with a message for invalid parameters.
    pub fn new(pattern: ArrivalPattern, seed: u64) -> Result<Self, String> {
        let gaps = match pattern {
            ArrivalPattern::Unlimited => Gaps::None,
            ArrivalPattern::Poisson { rate, burstiness } => {
                if !(rate.is_finite() && rate > 0.0) {
                    return Err(format!("request rate must be > 0 and finite, got {rate}"));
                }
                if !(burstiness.is_finite() && burstiness > 0.0) {
                    return Err(format!("burstiness must be > 0, got {burstiness}"));
                }
                if burstiness == 1.0 {
                    Gaps::Exp(Exp::new(rate).map_err(|e| e.to_string())?)
                } else {
                    let scale = 1.0 / (rate * burstiness);
                    Gaps::Gamma(Gamma::new(burstiness, scale).map_err(|e| e.to_string())?)
                }
            }
            ArrivalPattern::Burst { size, interval } => {
                if size == 0 || interval.is_zero() {
                    return Err("burst size and interval must be > 0".into());
                }
                Gaps::None
            }
        };
        Ok(Self { pattern, gaps, rng: StdRng::seed_from_u64(seed), next_s: 0.0, issued: 0 })
    }

    /// Scheduled send offset of the next request from the start of the point.
    /// The first request of a Poisson schedule is sent at offset 0.
    pub fn next_offset(&mut self) -> Duration {
        let i = self.issued;
        self.issued += 1;
        if let ArrivalPattern::Burst { size, interval } = self.pattern {
            let burst = i / u64::from(size);
            return interval.saturating_mul(u32::try_from(burst).unwrap_or(u32::MAX));
        }
        let gap_s = match &self.gaps {
            Gaps::Exp(d) => d.sample(&mut self.rng),
            Gaps::Gamma(d) => d.sample(&mut self.rng),
            Gaps::None => return Duration::ZERO,
        };
        let at = self.next_s;
        self.next_s += gap_s;
        Duration::try_from_secs_f64(at).unwrap_or(Duration::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poisson_mean_rate_within_5_percent() {
        for rate in [5.0, 100.0, 5000.0] {
            let mut g = ArrivalGenerator::new(ArrivalPattern::Poisson { rate, burstiness: 1.0 }, 42).unwrap();
            let mut last = Duration::ZERO;
            let mut prev = Duration::ZERO;
            // 10,001 offsets = 10,000 gaps.
            for _ in 0..=10_000 {
                last = g.next_offset();
                assert!(last >= prev, "offsets must be non-decreasing");
                prev = last;
            }
            let measured = 10_000.0 / last.as_secs_f64();
            assert!((measured - rate).abs() / rate < 0.05, "rate {rate}: measured {measured}");
        }
    }

    #[test]
    fn poisson_is_seeded_and_gamma_keeps_mean() {
        let p = ArrivalPattern::Poisson { rate: 50.0, burstiness: 1.0 };
        let a: Vec<_> = {
            let mut g = ArrivalGenerator::new(p, 7).unwrap();
            (0..100).map(|_| g.next_offset()).collect()
        };
        let b: Vec<_> = {
            let mut g = ArrivalGenerator::new(p, 7).unwrap();
            (0..100).map(|_| g.next_offset()).collect()
        };
        assert_eq!(a, b);
        let mut g =
            ArrivalGenerator::new(ArrivalPattern::Poisson { rate: 50.0, burstiness: 0.5 }, 1).unwrap();
        let mut last = Duration::ZERO;
        for _ in 0..=10_000 {
            last = g.next_offset();
        }
        let measured = 10_000.0 / last.as_secs_f64();
        assert!((measured - 50.0).abs() / 50.0 < 0.05, "{measured}");
    }

    #[test]
    fn bursts_and_unlimited() {
        let mut g =
            ArrivalGenerator::new(ArrivalPattern::Burst { size: 3, interval: Duration::from_millis(500) }, 0)
                .unwrap();
        let offs: Vec<u128> = (0..7).map(|_| g.next_offset().as_millis()).collect();
        assert_eq!(offs, vec![0, 0, 0, 500, 500, 500, 1000]);
        let mut u = ArrivalGenerator::new(ArrivalPattern::Unlimited, 0).unwrap();
        assert!((0..10).all(|_| u.next_offset().is_zero()));
    }

    #[test]
    fn rejects_bad_parameters() {
        assert!(ArrivalGenerator::new(ArrivalPattern::Poisson { rate: 0.0, burstiness: 1.0 }, 0).is_err());
        assert!(ArrivalGenerator::new(ArrivalPattern::Poisson { rate: f64::INFINITY, burstiness: 1.0 }, 0)
            .is_err());
        assert!(ArrivalGenerator::new(ArrivalPattern::Poisson { rate: 1.0, burstiness: 0.0 }, 0).is_err());
        assert!(ArrivalGenerator::new(
            ArrivalPattern::Burst { size: 0, interval: Duration::from_secs(1) },
            0
        )
        .is_err());
    }
}
