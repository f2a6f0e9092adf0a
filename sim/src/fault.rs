//! Deterministic fault injection for `--error-rate` and `--seed`.
//!
//! The `k`-th valid inference request (0-based, in arrival order) fails when
//! `mix64(seed + k * 0x9E37_79B9_7F4A_7C15)`, read as a fraction of 2^64, is below the rate:
//! the same seed and the same request order fail the same requests.

use std::sync::atomic::{AtomicU64, Ordering};

/// SplitMix64's output function: a bijective 64-bit mixer.
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Decides which requests get an injected 500.
#[derive(Debug)]
pub struct FaultInjector {
    seed: u64,
    rate: f64,
    next: AtomicU64,
}

impl FaultInjector {
    /// Fails the fraction `rate` (0..=1) of requests, in the order fixed by `seed`.
    pub fn new(seed: u64, rate: f64) -> Self {
        Self { seed, rate, next: AtomicU64::new(0) }
    }

    /// Whether the next request fails; each call consumes one position of the sequence
    /// (none when the rate is 0).
    pub fn next_fails(&self) -> bool {
        if self.rate <= 0.0 {
            return false;
        }
        let k = self.next.fetch_add(1, Ordering::Relaxed);
        let draw = mix64(self.seed.wrapping_add(k.wrapping_mul(0x9E37_79B9_7F4A_7C15)));
        // The top 53 bits as a uniform fraction in [0, 1).
        ((draw >> 11) as f64) / ((1u64 << 53) as f64) < self.rate
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pattern(seed: u64, rate: f64, n: usize) -> Vec<bool> {
        let f = FaultInjector::new(seed, rate);
        (0..n).map(|_| f.next_fails()).collect()
    }

    #[test]
    fn same_seed_same_failures() {
        assert_eq!(pattern(42, 0.3, 200), pattern(42, 0.3, 200));
        assert_ne!(pattern(42, 0.3, 200), pattern(43, 0.3, 200));
    }

    #[test]
    fn rate_bounds_and_proportion() {
        assert!(pattern(1, 0.0, 100).iter().all(|f| !f));
        assert!(pattern(1, 1.0, 100).iter().all(|f| *f));
        let failed = pattern(9, 0.25, 10_000).iter().filter(|f| **f).count();
        assert!((2_200..2_800).contains(&failed), "{failed}");
    }
}
