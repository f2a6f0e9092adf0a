//! The picker's scorers: each scores every eligible endpoint of a request in [0, 1], higher
//! better, and the picker adds them up with the pool's weights (`pools[].picker.*_weight`).
//! Scores relative to the other candidates (min-max normalized, as the Gateway API Inference
//! Extension's queue scorer) are 1 for all when the candidates do not differ.

/// What the scorers see of one eligible endpoint for one request.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Candidate {
    /// `vllm:num_requests_waiting` at the endpoint's last scrape.
    pub waiting: f64,
    /// `vllm:num_requests_running` at its last scrape.
    pub running: f64,
    /// `vllm:kv_cache_usage_perc` (0..1) at its last scrape.
    pub kv_cache_usage: f64,
    /// Requests this sidecar picked it for that have not ended yet.
    pub in_flight: u64,
    /// The request's leading prompt blocks it served recently (its longest matched prefix).
    pub prefix_blocks: usize,
    /// Its recent mean time to first token in seconds (from `vllm:time_to_first_token_seconds`,
    /// see [`crate::scheduling::picker::EndpointState::ttft`]); None before it reported any.
    pub ttft: Option<f64>,
}

impl Candidate {
    /// The load bounded-load affinity compares: waiting (vLLM's queue, from the last scrape)
    /// plus in flight (this sidecar's, live), in requests.
    pub fn load(&self) -> f64 {
        self.waiting.max(0.0) + self.in_flight as f64
    }

    /// The requests it holds, as prefix homes bound them ([`crate::scheduling::home`]): the
    /// larger of this sidecar's in flight (live) and vLLM's running + waiting (every client's, at
    /// the last scrape).
    pub fn occupancy(&self) -> f64 {
        (self.in_flight as f64).max(self.running.max(0.0) + self.waiting.max(0.0))
    }
}

/// A scorer plugin.
pub trait Scorer {
    /// Its name (for logs and tests).
    fn name(&self) -> &'static str;
    /// One score in [0, 1] per candidate (same order), for a request of `request_blocks` prompt
    /// blocks.
    fn score(&self, candidates: &[Candidate], request_blocks: usize) -> Vec<f64>;
}

/// 1 for the smallest value, 0 for the largest, linear between; 1 for all when they are equal
/// (or not finite).
fn inverse_min_max(values: impl Iterator<Item = f64> + Clone) -> Vec<f64> {
    let (min, max) =
        values.clone().fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| (lo.min(v), hi.max(v)));
    let span = max - min;
    values
        .map(|v| if span.is_finite() && span > 0.0 { ((max - v) / span).clamp(0.0, 1.0) } else { 1.0 })
        .collect()
}

/// The queue: `vllm:num_requests_waiting`, min-max normalized (the shortest queue scores 1).
#[derive(Debug, Clone, Copy, Default)]
pub struct QueueScorer;

impl Scorer for QueueScorer {
    fn name(&self) -> &'static str {
        "queue"
    }
    fn score(&self, candidates: &[Candidate], _: usize) -> Vec<f64> {
        inverse_min_max(candidates.iter().map(|c| c.waiting))
    }
}

/// The KV cache: `1 - vllm:kv_cache_usage_perc` (an empty cache scores 1, a full one 0).
#[derive(Debug, Clone, Copy, Default)]
pub struct KvCacheScorer;

impl Scorer for KvCacheScorer {
    fn name(&self) -> &'static str {
        "kv_cache"
    }
    fn score(&self, candidates: &[Candidate], _: usize) -> Vec<f64> {
        candidates
            .iter()
            .map(|c| if c.kv_cache_usage.is_finite() { 1.0 - c.kv_cache_usage.clamp(0.0, 1.0) } else { 0.0 })
            .collect()
    }
}

/// This sidecar's in-flight requests on the endpoint, min-max normalized: the one signal that
/// moves with every pick between two scrapes.
#[derive(Debug, Clone, Copy, Default)]
pub struct InFlightScorer;

impl Scorer for InFlightScorer {
    fn name(&self) -> &'static str {
        "in_flight"
    }
    fn score(&self, candidates: &[Candidate], _: usize) -> Vec<f64> {
        inverse_min_max(candidates.iter().map(|c| c.in_flight as f64))
    }
}

/// Latency: the request's expected wait on the endpoint, its recent mean TTFT × (load + 1)
/// (load = waiting + in flight, [`Candidate::load`]), min-max normalized (the shortest scores 1).
/// A replica that serves first tokens slower (a slower GPU, a noisy neighbour) is picked only when
/// the others are proportionally busier; one that reported no TTFT yet counts as the fastest (it
/// is not penalized for being new).
#[derive(Debug, Clone, Copy, Default)]
pub struct LatencyScorer;

impl Scorer for LatencyScorer {
    fn name(&self) -> &'static str {
        "latency"
    }
    fn score(&self, candidates: &[Candidate], _: usize) -> Vec<f64> {
        let fastest = candidates.iter().filter_map(|c| c.ttft).fold(f64::INFINITY, f64::min);
        if !fastest.is_finite() {
            return vec![1.0; candidates.len()];
        }
        inverse_min_max(candidates.iter().map(|c| c.ttft.unwrap_or(fastest) * (c.load() + 1.0)))
    }
}

/// Prefix affinity: the share of the request's prompt blocks the endpoint served recently
/// (0 for every endpoint when the request has no blocks).
#[derive(Debug, Clone, Copy, Default)]
pub struct PrefixScorer;

impl Scorer for PrefixScorer {
    fn name(&self) -> &'static str {
        "prefix"
    }
    fn score(&self, candidates: &[Candidate], request_blocks: usize) -> Vec<f64> {
        candidates
            .iter()
            .map(|c| {
                if request_blocks == 0 {
                    0.0
                } else {
                    (c.prefix_blocks.min(request_blocks) as f64) / request_blocks as f64
                }
            })
            .collect()
    }
}

/// The weighted sum of the scorers' scores, per candidate.
pub fn weighted(scorers: &[(&dyn Scorer, f64)], candidates: &[Candidate], request_blocks: usize) -> Vec<f64> {
    let mut total = vec![0.0; candidates.len()];
    for (scorer, weight) in scorers {
        if *weight == 0.0 {
            continue;
        }
        for (t, s) in total.iter_mut().zip(scorer.score(candidates, request_blocks)) {
            *t += weight * s;
        }
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(waiting: f64, kv: f64, in_flight: u64, prefix_blocks: usize) -> Candidate {
        Candidate { waiting, running: 0.0, kv_cache_usage: kv, in_flight, prefix_blocks, ttft: None }
    }

    #[test]
    fn latency_scores_the_fastest_first_token_highest_and_unknown_as_fastest() {
        let t = |ttft: Option<f64>| Candidate { ttft, ..c(0.0, 0.0, 0, 0) };
        assert_eq!(LatencyScorer.score(&[t(Some(0.1)), t(Some(0.5)), t(Some(0.3))], 0), vec![1.0, 0.0, 0.5]);
        // Expected wait: 0.1 s x 4 (3 in flight) > 0.3 s x 1 (idle): the slow idle one wins.
        let busy = Candidate { in_flight: 3, ..t(Some(0.1)) };
        assert_eq!(LatencyScorer.score(&[busy, t(Some(0.3))], 0), vec![0.0, 1.0]);
        assert_eq!(LatencyScorer.score(&[t(None), t(Some(0.5)), t(Some(0.1))], 0), vec![1.0, 0.0, 1.0]);
        assert_eq!(LatencyScorer.score(&[t(None), t(None)], 0), vec![1.0, 1.0]);
    }

    #[test]
    fn queue_scores_the_shortest_queue_highest_and_equal_queues_alike() {
        let s = QueueScorer.score(&[c(0.0, 0.0, 0, 0), c(4.0, 0.0, 0, 0), c(2.0, 0.0, 0, 0)], 0);
        assert_eq!(s, vec![1.0, 0.0, 0.5]);
        assert_eq!(QueueScorer.score(&[c(3.0, 0.0, 0, 0), c(3.0, 0.0, 0, 0)], 0), vec![1.0, 1.0]);
        assert_eq!(QueueScorer.score(&[], 0), Vec::<f64>::new());
    }

    #[test]
    fn kv_cache_scores_free_cache() {
        let s = KvCacheScorer
            .score(&[c(0.0, 0.0, 0, 0), c(0.0, 0.75, 0, 0), c(0.0, 1.5, 0, 0), c(0.0, f64::NAN, 0, 0)], 0);
        assert_eq!(s, vec![1.0, 0.25, 0.0, 0.0]);
    }

    #[test]
    fn in_flight_scores_the_least_busy_highest() {
        let s = InFlightScorer.score(&[c(0.0, 0.0, 5, 0), c(0.0, 0.0, 1, 0), c(0.0, 0.0, 3, 0)], 0);
        assert_eq!(s, vec![0.0, 1.0, 0.5]);
    }

    #[test]
    fn prefix_scores_the_matched_share() {
        let s = PrefixScorer.score(&[c(0.0, 0.0, 0, 0), c(0.0, 0.0, 0, 2), c(0.0, 0.0, 0, 8)], 8);
        assert_eq!(s, vec![0.0, 0.25, 1.0]);
        assert_eq!(PrefixScorer.score(&[c(0.0, 0.0, 0, 3)], 0), vec![0.0], "no blocks, no affinity");
    }

    #[test]
    fn weights_scale_and_zero_weights_drop_a_scorer() {
        let cs = [c(0.0, 0.5, 0, 0), c(2.0, 0.0, 0, 0)];
        let both = weighted(&[(&QueueScorer, 2.0), (&KvCacheScorer, 1.0)], &cs, 0);
        assert_eq!(both, vec![2.0 + 0.5, 0.0 + 1.0]);
        let kv_only = weighted(&[(&QueueScorer, 0.0), (&KvCacheScorer, 1.0)], &cs, 0);
        assert_eq!(kv_only, vec![0.5, 1.0]);
        assert_eq!(c(2.0, 0.0, 3, 0).load(), 5.0);
    }
}
