//! A pool's model of a request's time to first token (TTFT) on each of its endpoints, fitted
//! online from the TTFTs the gateway measures, with no I/O.
//!
//! **The model.** `TTFT ≈ a + b × load + c × uncached`, where `load` is the requests ahead of
//! the request on the endpoint when it is picked (vLLM's `num_requests_waiting` at the last
//! scrape plus this sidecar's requests in flight on it) and `uncached` the request's prompt the
//! endpoint is not believed to hold, in KiB (its prompt blocks past the longest prefix the
//! endpoint served recently, times `block_bytes`). `a` is the engine's floor, `b` what one more
//! request ahead costs (on a CPU engine a batch of four is several times slower per request than
//! a batch of one; on a GPU batching is nearly free), `c` what a KiB of prefill costs. The picker
//! ranks endpoints by the predicted TTFT, so prefix affinity wins exactly when the prefill it
//! saves outweighs the queueing it adds, on the engine at hand.
//!
//! **The fit.** Recursive least squares with forgetting ([`FORGETTING`]), one sample per finished
//! request that streamed a first token (its TTFT as the filter measured it, its features as they
//! were at the pick), so the coefficients follow a change of the engine's speed within a few
//! hundred requests. Predictions use `b` and `c` no lower than 0 (more work never predicts a
//! shorter wait) and are made only once [`MIN_SAMPLES`] samples were fitted; before that the
//! picker ranks by its fixed weights.

/// Features of one request on one endpoint: `[1, load, uncached KiB]`.
pub type Features = [f64; 3];

/// Weight of the past in each update: a sample's weight halves after about
/// `ln 2 / (1 − FORGETTING)` ≈ 138 newer samples.
pub const FORGETTING: f64 = 0.995;

/// Samples before the model predicts.
pub const MIN_SAMPLES: u64 = 16;

/// The initial covariance's diagonal: a weak prior on coefficients of 0.
const PRIOR: f64 = 1e4;

/// The largest TTFT taken as a sample, seconds (a longer one is a stall, not the engine's speed).
pub const MAX_SAMPLE_S: f64 = 600.0;

/// The fitted model of one pool.
#[derive(Debug, Clone, PartialEq)]
pub struct TtftModel {
    theta: [f64; 3],
    p: [[f64; 3]; 3],
    samples: u64,
}

impl Default for TtftModel {
    fn default() -> Self {
        Self::new()
    }
}

impl TtftModel {
    /// No sample yet.
    pub fn new() -> Self {
        Self { theta: [0.0; 3], p: [[PRIOR, 0.0, 0.0], [0.0, PRIOR, 0.0], [0.0, 0.0, PRIOR]], samples: 0 }
    }

    /// The features of a request with `load` requests ahead of it and `uncached_bytes` of prompt
    /// the endpoint does not hold.
    pub fn features(load: f64, uncached_bytes: f64) -> Features {
        [1.0, load.max(0.0), uncached_bytes.max(0.0) / 1024.0]
    }

    /// Fits one measured TTFT (seconds) of a request picked with `x`. A TTFT that is not finite,
    /// not above 0 or above [`MAX_SAMPLE_S`] is ignored.
    pub fn observe(&mut self, x: Features, ttft_s: f64) {
        let sound = ttft_s.is_finite() && ttft_s > 0.0 && ttft_s <= MAX_SAMPLE_S;
        if !sound || x.iter().any(|v| !v.is_finite()) {
            return;
        }
        let px = mat_vec(&self.p, &x);
        let denominator = FORGETTING + dot(&x, &px);
        if !(denominator.is_finite() && denominator > 0.0) {
            return;
        }
        let gain = px.map(|v| v / denominator);
        let error = ttft_s - dot(&x, &self.theta);
        let mut theta = self.theta;
        for (t, g) in theta.iter_mut().zip(gain) {
            *t += g * error;
        }
        // P = (P − gain (x' P)) / λ, with x' P = (P x)' as P is symmetric.
        let mut p = self.p;
        for (row, g) in p.iter_mut().zip(gain) {
            for (cell, pxj) in row.iter_mut().zip(px) {
                *cell = (*cell - g * pxj) / FORGETTING;
            }
        }
        if theta.iter().chain(p.iter().flatten()).all(|v| v.is_finite()) {
            self.theta = theta;
            self.p = p;
            self.samples += 1;
        }
    }

    /// Whether it predicts ([`MIN_SAMPLES`] fitted).
    pub fn ready(&self) -> bool {
        self.samples >= MIN_SAMPLES
    }

    /// Samples fitted.
    pub fn samples(&self) -> u64 {
        self.samples
    }

    /// `(a, b, c)`: seconds, seconds per request ahead, seconds per uncached KiB.
    pub fn coefficients(&self) -> (f64, f64, f64) {
        (self.theta[0], self.theta[1], self.theta[2])
    }

    /// The predicted TTFT in seconds of a request with features `x`; None before [`Self::ready`].
    pub fn predict(&self, x: Features) -> Option<f64> {
        if !self.ready() {
            return None;
        }
        let (a, b, c) = self.coefficients();
        Some(a + b.max(0.0) * x[1] + c.max(0.0) * x[2])
    }
}

fn dot(a: &[f64; 3], b: &[f64; 3]) -> f64 {
    a[0] * b[0] + a[1] * b[1] + a[2] * b[2]
}

fn mat_vec(m: &[[f64; 3]; 3], v: &[f64; 3]) -> [f64; 3] {
    [dot(&m[0], v), dot(&m[1], v), dot(&m[2], v)]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small deterministic generator (no dependency): the next value in [0, 1).
    fn lcg(state: &mut u64) -> f64 {
        *state = state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        (*state >> 11) as f64 / (1u64 << 53) as f64
    }

    #[test]
    fn it_recovers_an_engines_coefficients_and_follows_a_change() {
        let mut m = TtftModel::new();
        let mut seed = 7;
        // A CPU-like engine: 0.2 s floor, 0.6 s per request ahead, 0.15 s per uncached KiB.
        let engine = |load: f64, kib: f64| 0.2 + 0.6 * load + 0.15 * kib;
        for i in 0..400 {
            let load = (lcg(&mut seed) * 6.0).floor();
            let bytes = lcg(&mut seed) * 8192.0;
            let x = TtftModel::features(load, bytes);
            let noise = 1.0 + 0.05 * (lcg(&mut seed) - 0.5);
            assert_eq!(m.ready(), i >= MIN_SAMPLES as usize);
            m.observe(x, engine(load, bytes / 1024.0) * noise);
        }
        let (a, b, c) = m.coefficients();
        assert!((a - 0.2).abs() < 0.1 && (b - 0.6).abs() < 0.05 && (c - 0.15).abs() < 0.02, "{a} {b} {c}");
        // The engine gets batching for free (a GPU): the queue's cost falls, the fit follows.
        let gpu = |load: f64, kib: f64| 0.05 + 0.02 * load + 0.15 * kib;
        for _ in 0..1500 {
            let load = (lcg(&mut seed) * 6.0).floor();
            let bytes = lcg(&mut seed) * 8192.0;
            m.observe(TtftModel::features(load, bytes), gpu(load, bytes / 1024.0));
        }
        let (_, b, c) = m.coefficients();
        assert!(b < 0.05 && (c - 0.15).abs() < 0.02, "{b} {c}");
    }

    #[test]
    fn predictions_wait_for_samples_and_never_reward_more_work() {
        let mut m = TtftModel::new();
        let x = TtftModel::features(2.0, 2048.0);
        assert_eq!(m.predict(x), None);
        // Samples where more load came with shorter TTFTs (noise): the slope is not used below 0.
        for i in 0..40 {
            let load = f64::from(i % 4);
            m.observe(TtftModel::features(load, 0.0), 1.0 - 0.1 * load);
        }
        let idle = m.predict(TtftModel::features(0.0, 0.0)).unwrap();
        let busy = m.predict(TtftModel::features(3.0, 0.0)).unwrap();
        assert!(busy >= idle, "{busy} {idle}");
        // Bad samples change nothing.
        let before = m.clone();
        for bad in [f64::NAN, 0.0, -1.0, f64::INFINITY, 601.0] {
            m.observe(x, bad);
        }
        m.observe([1.0, f64::NAN, 0.0], 1.0);
        assert_eq!(m, before);
    }
}
