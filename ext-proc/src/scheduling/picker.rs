//! The pick: which eligible endpoint of a pool serves a request, then its fallbacks.
//!
//! 1. **Eligible**: the endpoint's last scrape succeeded and is at most `stale_after_ms` old,
//!    and, when the request carries a subset hint (`envoy.lb.subset_hint`), it is in the subset.
//! 2. **Scores**: each scorer ([`super::scorers`]) scores every eligible endpoint in [0, 1]; the
//!    pool's weights (`prefix_weight`, `queue_weight`, `kv_cache_weight`, `in_flight_weight`)
//!    sum them. Endpoints are ranked by the sum, ties broken by a rotation that moves with every
//!    pick (so equal endpoints take turns).
//! 3. **Bounded-load affinity**: among the endpoints holding the request's longest matched prefix
//!    (at least one block), the best-ranked one, `a`, goes first when
//!    `load(a) + 1 <= affinity_load_factor x (min load + 1)`, where `load` = `waiting` (vLLM's
//!    queue at the last scrape) + `in_flight` (this sidecar's picks not yet ended) and the
//!    minimum is over the eligible endpoints; the `+ 1`s count the request being placed, so an
//!    idle pool does not turn every affinity down. Past the bound a popular prefix cannot pin one
//!    replica: the ranking of step 2 decides (in which the prefix still scores).
//! 4. **Fallbacks**: the next `fallback_endpoints` of the ranking, for Envoy to try in order.
//!
//! With `scoring: predicted_ttft` (the default), once the pool's TTFT model has its samples
//! ([`crate::scheduling::ttft_model`]), steps 2 and 3 are one: the endpoints are ranked by the
//! predicted TTFT of this request on each (its queue ahead and its uncached prompt), ties broken
//! by the rotation; affinity then wins exactly when the prefill it saves outweighs the queueing it
//! adds on this engine. Each pick keeps its features until the request's end brings its measured
//! TTFT, which the model fits.
//!
//! Each endpoint's prefix index is bounded by the engine's own cache when it reports one
//! (`vllm:cache_config_info`'s tokens: [`crate::pools::signals::Scrape::cache_tokens`], at the
//! pool's prompt bytes per token, [`PoolPicker::bytes_per_token`]), so the picker does not
//! believe an endpoint holds what its cache has evicted.
//!
//! After a pick the request's block hashes are recorded on the picked endpoint
//! ([`crate::scheduling::prefix_index::PrefixIndex`]) and its in-flight count goes up; the request's end (the access log, or
//! the metering stream) takes it down.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use super::prefix_index::PrefixIndex;
use super::scorers::{
    self, Candidate, InFlightScorer, KvCacheScorer, LatencyScorer, PrefixScorer, QueueScorer,
};
use crate::config::pools::{PickerConfig, PickerScoring};
use crate::pools::signals::Scrape;
use crate::scheduling::ttft_model::{Features, TtftModel};

/// Bytes of prompt text per token before the pool's own are measured, to turn an engine's cache
/// size in tokens into prompt blocks (English text with Llama- or Gemma-style tokenizers runs at
/// about 4). Each request's end then teaches the picker its pool's bytes per token
/// ([`PoolPicker::bytes_per_token`]): `vllm bench`'s random-token prompts run at 7.6 with
/// Gemma-3's tokenizer, so at 4 the picker would believe a replica holds half of what it does.
pub const BYTES_PER_TOKEN: usize = 4;

/// Weight of one request's sample in the pool's smoothed bytes per token.
const BYTES_PER_TOKEN_ALPHA: f64 = 0.05;

/// The range a pool's measured bytes per token is kept in.
const BYTES_PER_TOKEN_RANGE: (f64, f64) = (1.0, 32.0);

/// Prompt tokens below which a request teaches nothing of its pool's bytes per token (its
/// template and JSON would weigh too much).
const MIN_TOKENS_FOR_RATIO: u64 = 64;

/// Picks whose TTFT the picker awaits at most (the oldest are forgotten past it).
pub const MAX_PENDING: usize = 8_192;

/// The ranking of one request's candidates.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Choice {
    /// Indices into the candidates: the pick, then the fallbacks, best first.
    pub order: Vec<usize>,
    /// Whether bounded-load prefix affinity decided the pick (rather than the scores).
    pub affinity: bool,
}

/// Ranks `candidates` (already eligible) for a request of `request_blocks` prompt blocks under
/// `config` (steps 2 to 4 of the module doc); `tiebreak` rotates equal scores. `None` when there
/// are no candidates.
pub fn choose(
    candidates: &[Candidate],
    config: &PickerConfig,
    request_blocks: usize,
    tiebreak: usize,
) -> Option<Choice> {
    let n = candidates.len();
    if n == 0 {
        return None;
    }
    let scores = scorers::weighted(
        &[
            (&PrefixScorer, config.prefix_weight),
            (&QueueScorer, config.queue_weight),
            (&KvCacheScorer, config.kv_cache_weight),
            (&InFlightScorer, config.in_flight_weight),
            (&LatencyScorer, config.latency_weight),
        ],
        candidates,
        request_blocks,
    );
    let score = |i: usize| scores.get(i).copied().unwrap_or(0.0);
    let rotation = |i: usize| (i + n - tiebreak % n) % n;
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| score(b).total_cmp(&score(a)).then(rotation(a).cmp(&rotation(b))));
    let mut affinity = false;
    let longest = candidates.iter().map(|c| c.prefix_blocks).max().unwrap_or(0);
    if longest > 0 {
        let min_load = candidates.iter().map(Candidate::load).fold(f64::INFINITY, f64::min);
        let holder =
            order.iter().position(|&i| candidates.get(i).is_some_and(|c| c.prefix_blocks == longest));
        if let Some(at) = holder {
            let load = order.get(at).and_then(|&i| candidates.get(i)).map_or(f64::INFINITY, Candidate::load);
            if load + 1.0 <= config.affinity_load_factor * (min_load + 1.0) {
                let i = order.remove(at);
                order.insert(0, i);
                affinity = true;
            }
        }
    }
    order.truncate(config.fallback_endpoints.saturating_add(1));
    Some(Choice { order, affinity })
}

/// Ranks `candidates` by their `predicted` TTFT (same order), shortest first, ties broken by the
/// rotation `tiebreak`; the pick and `fallback_endpoints` next. `affinity`: the pick holds the
/// request's longest matched prefix (of at least one block). `None` without candidates.
pub fn choose_predicted(
    candidates: &[Candidate],
    predicted: &[f64],
    config: &PickerConfig,
    tiebreak: usize,
) -> Option<Choice> {
    let n = candidates.len();
    if n == 0 || predicted.len() != n {
        return None;
    }
    let at = |i: usize| predicted.get(i).copied().filter(|v| v.is_finite()).unwrap_or(f64::INFINITY);
    let rotation = |i: usize| (i + n - tiebreak % n) % n;
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| at(a).total_cmp(&at(b)).then(rotation(a).cmp(&rotation(b))));
    let longest = candidates.iter().map(|c| c.prefix_blocks).max().unwrap_or(0);
    let affinity = longest > 0
        && order.first().and_then(|&i| candidates.get(i)).is_some_and(|c| c.prefix_blocks == longest);
    order.truncate(config.fallback_endpoints.saturating_add(1));
    Some(Choice { order, affinity })
}

/// What the picker keeps of one endpoint.
#[derive(Debug)]
pub struct EndpointState {
    /// Its address, as picks name it.
    pub addr: SocketAddr,
    /// `addr` as text (`ip:port`, IPv6 `[addr]:port`).
    pub label: String,
    /// The last successful scrape: `vllm:num_requests_waiting`, `vllm:num_requests_running`,
    /// `vllm:kv_cache_usage_perc`, and when.
    pub scraped: Option<(Scrape, Instant)>,
    /// Whether the last scrape succeeded.
    pub scrape_ok: bool,
    /// This sidecar's picks of it that have not ended.
    pub in_flight: u64,
    /// Picks since the last scrape, and in the interval before it.
    picks: (u64, u64),
    /// The block hashes it served recently.
    pub prefixes: PrefixIndex,
    /// Its recent mean TTFT in seconds: the mean of `vllm:time_to_first_token_seconds` over each
    /// scrape interval with new first tokens (sum and count deltas), smoothed over intervals
    /// ([`TTFT_ALPHA`]); kept while no new first token comes.
    pub ttft: Option<f64>,
    /// The TTFT histogram's (sum, count) at the last scrape.
    ttft_seen: Option<(f64, f64)>,
}

/// Weight of the newest interval in an endpoint's smoothed mean TTFT.
pub const TTFT_ALPHA: f64 = 0.5;

impl EndpointState {
    /// Whether it may be picked at `now` (step 1 of the module doc, without the subset).
    pub fn eligible(&self, now: Instant, stale_after: Duration) -> bool {
        self.scrape_ok && self.scraped.is_some_and(|(_, at)| now.saturating_duration_since(at) <= stale_after)
    }
}

/// A pick to send to Envoy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pick {
    /// `ip:port` of the pick, then of the fallbacks.
    pub endpoints: Vec<String>,
    /// The request's prompt blocks the pick served recently.
    pub prefix_blocks: usize,
    /// The request's prompt blocks.
    pub request_blocks: usize,
    /// Whether bounded-load affinity decided it (or, ranked by predicted TTFT, whether the pick
    /// holds the longest matched prefix).
    pub affinity: bool,
    /// Whether the predicted TTFT ranked it.
    pub predicted: bool,
}

impl Pick {
    /// The value of `x-gateway-destination-endpoint` and of the `envoy.lb` metadata:
    /// `ip:port[,ip:port...]`.
    pub fn value(&self) -> String {
        self.endpoints.join(",")
    }

    /// The picked endpoint.
    pub fn primary(&self) -> &str {
        self.endpoints.first().map_or("", String::as_str)
    }
}

/// What a picked request's end measured ([`PoolPicker::finished`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Observed<'a> {
    /// The request's id (`x-request-id`), as at its pick.
    pub request_id: &'a str,
    /// Its TTFT as the filter measured it, seconds.
    pub ttft_s: f64,
    /// Its usage's prompt tokens.
    pub prompt_tokens: u64,
}

/// One pool's picker: its config, and the state of each endpoint.
#[derive(Debug)]
pub struct PoolPicker {
    config: PickerConfig,
    stale_after: Duration,
    endpoints: Vec<EndpointState>,
    picks: usize,
    /// The pool's TTFT model.
    model: TtftModel,
    /// The features and prompt blocks of picks whose end has not come, by request id (at most
    /// [`MAX_PENDING`]).
    pending: HashMap<String, (Features, usize)>,
    pending_order: VecDeque<String>,
    /// The pool's prompt bytes per token, smoothed over the requests that ended.
    bytes_per_token: f64,
}

impl PoolPicker {
    /// A picker over the pool's endpoint addresses (the validated `ip:port` of its endpoint URLs,
    /// in config order), with nothing scraped yet.
    pub fn new(config: PickerConfig, addrs: &[SocketAddr], scrape_interval_ms: u64) -> Self {
        let endpoints = addrs
            .iter()
            .map(|addr| EndpointState {
                addr: *addr,
                label: addr.to_string(),
                scraped: None,
                scrape_ok: false,
                in_flight: 0,
                picks: (0, 0),
                prefixes: PrefixIndex::new(config.prefix_lru_blocks),
                ttft: None,
                ttft_seen: None,
            })
            .collect();
        let stale_after = Duration::from_millis(config.stale_after_ms(scrape_interval_ms));
        Self {
            config,
            stale_after,
            endpoints,
            picks: 0,
            model: TtftModel::new(),
            pending: HashMap::new(),
            pending_order: VecDeque::new(),
            bytes_per_token: BYTES_PER_TOKEN as f64,
        }
    }

    /// The pool's TTFT model.
    pub fn model(&self) -> &TtftModel {
        &self.model
    }

    /// The endpoints' state, in config order.
    pub fn endpoints(&self) -> &[EndpointState] {
        &self.endpoints
    }

    /// The scrape of endpoint `index` (config order) ended at `now`: `None` when it failed (the
    /// endpoint is then not eligible until a scrape succeeds). A successful scrape also bounds
    /// the endpoint's in-flight count by what vLLM holds (`running + waiting`) plus the picks of
    /// the last two scrape intervals (on their way to it), so requests whose end never reaches
    /// this sidecar (an Envoy killed) are taken off.
    pub fn scraped(&mut self, index: usize, scrape: Option<Scrape>, now: Instant) {
        let Some(e) = self.endpoints.get_mut(index) else { return };
        e.scrape_ok = scrape.is_some();
        if let Some(s) = scrape {
            let held = (s.running.max(0.0) + s.waiting.max(0.0)).ceil();
            let held = if held.is_finite() && held < u64::MAX as f64 { held as u64 } else { u64::MAX };
            e.in_flight = e.in_flight.min(held.saturating_add(e.picks.0).saturating_add(e.picks.1));
            if let Some((sum, count)) = e.ttft_seen {
                let (dsum, dcount) = (s.ttft_sum - sum, s.ttft_count - count);
                if dcount > 0.0 && dsum >= 0.0 && dsum.is_finite() {
                    let mean = dsum / dcount;
                    e.ttft = Some(e.ttft.map_or(mean, |old| old + TTFT_ALPHA * (mean - old)));
                }
            }
            // A counter that went down (the server restarted) starts over from this scrape.
            e.ttft_seen = Some((s.ttft_sum, s.ttft_count));
            if s.cache_tokens >= 1.0 && s.cache_tokens.is_finite() {
                let blocks =
                    (s.cache_tokens * self.bytes_per_token / self.config.block_bytes.max(1) as f64) as usize;
                e.prefixes.set_capacity(blocks.clamp(1, self.config.prefix_lru_blocks));
            }
            e.scraped = Some((s, now));
        }
        e.picks = (0, e.picks.0);
    }

    /// Picks an endpoint for request `request_id` whose prompt hashes to `hashes` (chained block
    /// hashes, may be empty), among `subset` when given (the subset hint), at `now`; records the
    /// hashes on it, counts it in flight, and keeps its features until [`Self::finished`] brings
    /// its TTFT (an empty id keeps nothing). `None` when no endpoint is eligible.
    pub fn pick(
        &mut self,
        hashes: &[u64],
        subset: Option<&[SocketAddr]>,
        now: Instant,
        request_id: &str,
    ) -> Option<Pick> {
        let eligible: Vec<usize> = (0..self.endpoints.len())
            .filter(|&i| {
                self.endpoints.get(i).is_some_and(|e| {
                    e.eligible(now, self.stale_after) && subset.is_none_or(|s| s.contains(&e.addr))
                })
            })
            .collect();
        let candidates: Vec<Candidate> = eligible
            .iter()
            .filter_map(|&i| self.endpoints.get(i))
            .map(|e| {
                let (waiting, kv) =
                    e.scraped.as_ref().map_or((0.0, 0.0), |(s, _)| (s.waiting, s.kv_cache_usage));
                Candidate {
                    waiting,
                    kv_cache_usage: kv,
                    in_flight: e.in_flight,
                    prefix_blocks: e.prefixes.matched(hashes),
                    ttft: e.ttft,
                }
            })
            .collect();
        let block_bytes = self.config.block_bytes as f64;
        let features: Vec<Features> = candidates
            .iter()
            .map(|c| {
                let uncached = hashes.len().saturating_sub(c.prefix_blocks) as f64 * block_bytes;
                TtftModel::features(c.load(), uncached)
            })
            .collect();
        let predicted: Option<Vec<f64>> = match self.config.scoring {
            PickerScoring::PredictedTtft => features.iter().map(|x| self.model.predict(*x)).collect(),
            PickerScoring::Weighted => None,
        };
        let choice = match &predicted {
            Some(p) => choose_predicted(&candidates, p, &self.config, self.picks)?,
            None => choose(&candidates, &self.config, hashes.len(), self.picks)?,
        };
        self.picks = self.picks.wrapping_add(1);
        if let Some(x) = choice.order.first().and_then(|&c| features.get(c)) {
            self.remember(request_id, *x, hashes.len());
        }
        let prefix_blocks =
            choice.order.first().and_then(|&c| candidates.get(c)).map_or(0, |c| c.prefix_blocks);
        let picked: Vec<usize> = choice.order.iter().filter_map(|&c| eligible.get(c).copied()).collect();
        if let Some(e) = picked.first().and_then(|&i| self.endpoints.get_mut(i)) {
            e.prefixes.record(hashes);
            e.in_flight = e.in_flight.saturating_add(1);
            e.picks.0 = e.picks.0.saturating_add(1);
        }
        let endpoints =
            picked.iter().filter_map(|&i| self.endpoints.get(i)).map(|e| e.label.clone()).collect();
        Some(Pick {
            endpoints,
            prefix_blocks,
            request_blocks: hashes.len(),
            affinity: choice.affinity,
            predicted: predicted.is_some(),
        })
    }

    /// Keeps a pick's features and prompt blocks for its end, forgetting the oldest past
    /// [`MAX_PENDING`].
    fn remember(&mut self, request_id: &str, x: Features, blocks: usize) {
        if request_id.is_empty() {
            return;
        }
        if self.pending.insert(request_id.to_owned(), (x, blocks)).is_none() {
            self.pending_order.push_back(request_id.to_owned());
        }
        while self.pending_order.len() > MAX_PENDING {
            if let Some(old) = self.pending_order.pop_front() {
                self.pending.remove(&old);
            }
        }
    }

    /// A request picked for `label` (`ip:port`) ended; `observed`: what its end measured (a
    /// request that streamed a first token): its TTFT, which the TTFT model fits with the
    /// features of its pick, and its prompt tokens, which with the prompt blocks it was picked
    /// with teach the pool's bytes per token. Returns the endpoint's in-flight count (None: not an
    /// endpoint of the pool).
    pub fn finished(&mut self, label: &str, observed: Option<Observed<'_>>) -> Option<u64> {
        if let Some(o) = observed {
            if let Some((x, blocks)) = self.pending.remove(o.request_id) {
                self.pending_order.retain(|id| id != o.request_id);
                self.model.observe(x, o.ttft_s);
                // The hashed blocks cover the prompt's bytes but its last partial block.
                if o.prompt_tokens >= MIN_TOKENS_FOR_RATIO && blocks >= 2 {
                    let sample = (blocks * self.config.block_bytes) as f64 / o.prompt_tokens as f64;
                    let (lo, hi) = BYTES_PER_TOKEN_RANGE;
                    self.bytes_per_token = (self.bytes_per_token
                        + BYTES_PER_TOKEN_ALPHA * (sample - self.bytes_per_token))
                        .clamp(lo, hi);
                }
            }
        }
        let e = self.endpoints.iter_mut().find(|e| e.label == label)?;
        e.in_flight = e.in_flight.saturating_sub(1);
        Some(e.in_flight)
    }

    /// The pool's prompt bytes per token: [`BYTES_PER_TOKEN`] until requests end, then what
    /// they measured (prompt blocks × `block_bytes` over the usage's prompt tokens, smoothed).
    pub fn bytes_per_token(&self) -> f64 {
        self.bytes_per_token
    }

    /// The pool's fitted TTFT model.
    pub fn ttft_model(&self) -> &TtftModel {
        &self.model
    }

    /// The in-flight count of the endpoint `label`.
    pub fn in_flight(&self, label: &str) -> Option<u64> {
        self.endpoints.iter().find(|e| e.label == label).map(|e| e.in_flight)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> PickerConfig {
        crate::config::Config::from_yaml(
            "listen: 127.0.0.1:0\nredis: {url: 'redis://x'}\ntenants: []\npools:\n  - {name: p, endpoints: ['http://10.0.0.1:1'], picker: {}}\n",
        )
        .unwrap()
        .pools[0]
        .picker
        .unwrap()
    }

    fn c(waiting: f64, in_flight: u64, prefix_blocks: usize) -> Candidate {
        Candidate { waiting, kv_cache_usage: 0.0, in_flight, prefix_blocks, ttft: None }
    }

    #[test]
    fn an_endpoint_slow_to_first_tokens_is_avoided_at_equal_load_and_its_ttft_is_smoothed() {
        let mut p = PoolPicker::new(PickerConfig { fallback_endpoints: 0, ..config() }, &addrs(2), 500);
        let t0 = Instant::now();
        let ttft =
            |sum: f64, count: f64| Some(Scrape { ttft_sum: sum, ttft_count: count, ..Scrape::default() });
        p.scraped(0, ttft(0.0, 0.0), t0);
        p.scraped(1, ttft(0.0, 0.0), t0);
        // Interval 1: endpoint 0 served 4 first tokens in 0.4 s, endpoint 1 in 1.2 s (3x slower).
        p.scraped(0, ttft(0.4, 4.0), t0);
        p.scraped(1, ttft(1.2, 4.0), t0);
        assert_eq!(p.endpoints()[1].ttft, Some(0.3));
        for _ in 0..3 {
            let pick = p.pick(&[], None, t0, "").unwrap();
            assert_eq!(pick.primary(), "10.0.0.1:1", "the fast endpoint, while loads allow");
            p.finished(pick.primary(), None);
        }
        // Interval 2 (no new first token on 1 keeps its mean; 0 smooths toward 0.3 s).
        p.scraped(0, ttft(1.6, 8.0), t0);
        p.scraped(1, ttft(1.2, 4.0), t0);
        assert_eq!(p.endpoints()[0].ttft, Some(0.2));
        assert_eq!(p.endpoints()[1].ttft, Some(0.3));
        // A restarted server (counters down) starts over without a bogus sample.
        p.scraped(1, ttft(0.1, 1.0), t0);
        assert_eq!(p.endpoints()[1].ttft, Some(0.3));
    }

    fn scrape(waiting: f64, running: f64, kv: f64) -> Option<Scrape> {
        Some(Scrape { waiting, running, kv_cache_usage: kv, ..Scrape::default() })
    }

    fn addrs(n: u16) -> Vec<SocketAddr> {
        (1..=n).map(|p| SocketAddr::from(([10, 0, 0, 1], p))).collect()
    }

    #[test]
    fn scores_rank_and_fallbacks_follow() {
        let cfg = PickerConfig { fallback_endpoints: 2, ..config() };
        let cs = [c(4.0, 0, 0), c(0.0, 0, 0), c(2.0, 0, 0), c(8.0, 0, 0)];
        let choice = choose(&cs, &cfg, 0, 0).unwrap();
        assert_eq!(choice, Choice { order: vec![1, 2, 0], affinity: false });
        let cfg = PickerConfig { fallback_endpoints: 0, ..cfg };
        assert_eq!(choose(&cs, &cfg, 0, 0).unwrap().order, vec![1]);
        assert_eq!(choose(&[], &cfg, 0, 0), None);
    }

    #[test]
    fn equal_endpoints_take_turns() {
        let cs = [c(0.0, 0, 0), c(0.0, 0, 0), c(0.0, 0, 0)];
        let firsts: Vec<usize> = (0..3).map(|t| choose(&cs, &config(), 0, t).unwrap().order[0]).collect();
        assert_eq!(firsts, vec![0, 1, 2]);
    }

    #[test]
    fn the_longest_prefix_wins_within_the_load_bound() {
        // Endpoint 2 holds 6 of 8 blocks but is busier than endpoint 0: affinity holds while
        // load + 1 <= 2 x (min load + 1).
        let cfg = config();
        let cs = [c(0.0, 1, 0), c(0.0, 2, 3), c(1.0, 2, 6)];
        let choice = choose(&cs, &cfg, 8, 0).unwrap();
        assert_eq!((choice.order[0], choice.affinity), (2, true), "3 + 1 <= 2 x (1 + 1)");
        // One more in flight on it: 4 + 1 > 4, the bound breaks and the scores decide.
        let cs = [c(0.0, 1, 0), c(0.0, 2, 3), c(1.0, 3, 6)];
        let choice = choose(&cs, &cfg, 8, 0).unwrap();
        assert!(!choice.affinity);
        assert_ne!(choice.order[0], 2);
        // A larger factor keeps it.
        let loose = PickerConfig { affinity_load_factor: 3.0, ..cfg };
        assert_eq!(choose(&cs, &loose, 8, 0).unwrap().order[0], 2);
        // An idle pool: a holder with one request in flight still wins (1 + 1 <= 2 x 1).
        let cs = [c(0.0, 0, 0), c(0.0, 1, 4)];
        assert_eq!(choose(&cs, &cfg, 8, 0).unwrap(), Choice { order: vec![1, 0], affinity: true });
    }

    #[test]
    fn without_prefix_affinity_load_decides() {
        // Factor 1 and a busy holder: the prefix score (weight 3 x 0.5) does not outweigh the
        // queue and in-flight scores (2 + 2) of the idle endpoint.
        let cfg = PickerConfig { affinity_load_factor: 1.0, ..config() };
        let cs = [c(0.0, 0, 0), c(3.0, 3, 4)];
        assert_eq!(choose(&cs, &cfg, 8, 0).unwrap(), Choice { order: vec![0, 1], affinity: false });
    }

    #[test]
    fn stale_or_failed_endpoints_are_not_eligible() {
        let t0 = Instant::now();
        let mut p = PoolPicker::new(config(), &addrs(3), 500);
        assert_eq!(p.pick(&[], None, t0, ""), None, "nothing scraped yet");
        p.scraped(0, scrape(9.0, 0.0, 0.9), t0);
        p.scraped(1, scrape(0.0, 0.0, 0.0), t0);
        p.scraped(2, scrape(0.0, 0.0, 0.0), t0);
        p.scraped(2, None, t0 + Duration::from_millis(10));
        // 1 is the best; 2 failed its last scrape.
        let pick = p.pick(&[], None, t0 + Duration::from_millis(100), "").unwrap();
        assert_eq!(pick.endpoints, vec!["10.0.0.1:2", "10.0.0.1:1"]);
        // Past stale_after_ms (default 2 s at a 500 ms interval) since their scrape: none.
        assert_eq!(p.pick(&[], None, t0 + Duration::from_millis(2_001), ""), None);
        p.scraped(0, scrape(9.0, 0.0, 0.9), t0 + Duration::from_millis(2_000));
        let pick = p.pick(&[], None, t0 + Duration::from_millis(2_001), "").unwrap();
        assert_eq!(pick.endpoints, vec!["10.0.0.1:1"], "only the fresh one, though loaded");
    }

    #[test]
    fn the_subset_restricts_the_pick() {
        let t0 = Instant::now();
        let mut p = PoolPicker::new(config(), &addrs(3), 500);
        for i in 0..3 {
            p.scraped(i, scrape(if i == 1 { 0.0 } else { 5.0 }, 0.0, 0.0), t0);
        }
        assert_eq!(p.pick(&[], None, t0, "").unwrap().primary(), "10.0.0.1:2");
        let subset = [SocketAddr::from(([10, 0, 0, 1], 3)), SocketAddr::from(([10, 0, 0, 9], 9))];
        let pick = p.pick(&[], Some(&subset), t0, "").unwrap();
        assert_eq!(pick.endpoints, vec!["10.0.0.1:3"], "only the subset, not even as a fallback");
        assert_eq!(p.pick(&[], Some(&[]), t0, ""), None, "an empty subset: nothing eligible");
        assert_eq!(p.pick(&[], Some(&subset[1..]), t0, ""), None, "a subset of unknown endpoints");
    }

    #[test]
    fn a_pick_records_the_prefix_and_counts_in_flight_until_finished() {
        let t0 = Instant::now();
        let mut p = PoolPicker::new(PickerConfig { fallback_endpoints: 0, ..config() }, &addrs(2), 500);
        p.scraped(0, scrape(0.0, 0.0, 0.0), t0);
        p.scraped(1, scrape(0.0, 0.0, 0.0), t0);
        let first = p.pick(&[11, 12, 13], None, t0, "").unwrap();
        assert_eq!((first.prefix_blocks, first.request_blocks, first.affinity), (0, 3, false));
        // The same conversation again (a longer prompt): the same endpoint, by affinity.
        let again = p.pick(&[11, 12, 13, 14], None, t0, "").unwrap();
        assert_eq!((again.primary(), again.prefix_blocks, again.affinity), (first.primary(), 3, true));
        let e = p.endpoints().iter().find(|e| e.label == first.primary()).unwrap();
        assert_eq!((e.in_flight, e.prefixes.len()), (2, 4));
        // Another prompt goes to the other, idle endpoint.
        let other = p.pick(&[21, 22], None, t0, "").unwrap();
        assert_ne!(other.primary(), first.primary());
        p.finished(first.primary(), None);
        p.finished(first.primary(), None);
        p.finished(first.primary(), None);
        p.finished("10.9.9.9:1", None);
        let in_flight: Vec<u64> = p.endpoints().iter().map(|e| e.in_flight).collect();
        assert!(in_flight.contains(&0) && in_flight.contains(&1), "{in_flight:?}: never below 0");
    }

    #[test]
    fn a_scrape_bounds_in_flight_by_what_vllm_holds_plus_recent_picks() {
        let t0 = Instant::now();
        let mut p = PoolPicker::new(PickerConfig { fallback_endpoints: 0, ..config() }, &addrs(1), 500);
        p.scraped(0, scrape(0.0, 0.0, 0.0), t0);
        for _ in 0..5 {
            p.pick(&[], None, t0, "");
        }
        // vLLM holds 2: the 5 picks of this interval may still be on their way.
        p.scraped(0, scrape(1.0, 1.0, 0.0), t0);
        assert_eq!(p.endpoints()[0].in_flight, 5);
        // Next interval: still within the two-interval window.
        p.scraped(0, scrape(1.0, 1.0, 0.0), t0);
        assert_eq!(p.endpoints()[0].in_flight, 5);
        // Their ends never came (lost access-log entries): past the window, bounded by vLLM's 2.
        p.scraped(0, scrape(1.0, 1.0, 0.0), t0);
        assert_eq!(p.endpoints()[0].in_flight, 2);
    }

    /// A model fitted to an engine whose TTFT is `a + b x load + c x uncached KiB`.
    fn fitted(a: f64, b: f64, c: f64) -> TtftModel {
        let mut m = TtftModel::new();
        for i in 0..200u32 {
            let load = f64::from(i % 5);
            let bytes = f64::from((i * 37) % 97) * 64.0;
            m.observe(TtftModel::features(load, bytes), a + b * load + c * bytes / 1024.0);
        }
        m
    }

    /// Two endpoints: 0 idle and cold, 1 holding the request's 64-block (4 KiB) prompt with three
    /// requests in flight.
    fn busy_holder(model: TtftModel) -> (PoolPicker, Vec<u64>, Instant) {
        let t0 = Instant::now();
        let mut p = PoolPicker::new(PickerConfig { fallback_endpoints: 0, ..config() }, &addrs(2), 500);
        p.scraped(0, scrape(0.0, 0.0, 0.0), t0);
        p.scraped(1, scrape(0.0, 0.0, 0.0), t0);
        let hashes: Vec<u64> = (1..=64).collect();
        p.endpoints[1].prefixes.record(&hashes);
        p.endpoints[1].in_flight = 3;
        p.model = model;
        (p, hashes, t0)
    }

    #[test]
    fn predicted_ttft_trades_saved_prefill_against_queueing_as_the_engine_does() {
        // A CPU engine: a request ahead costs 0.6 s, 4 KiB of prefill 1.6 s. Queueing behind 3
        // (1.8 s) costs more than the prefill saved: the idle endpoint.
        let (mut p, hashes, t0) = busy_holder(fitted(0.2, 0.6, 0.4));
        let pick = p.pick(&hashes, None, t0, "r1").unwrap();
        assert_eq!((pick.primary(), pick.predicted, pick.affinity), ("10.0.0.1:1", true, false));
        // A GPU-like engine: batching nearly free (0.02 s per request ahead): the holder.
        let (mut p, hashes, t0) = busy_holder(fitted(0.05, 0.02, 0.4));
        let pick = p.pick(&hashes, None, t0, "r2").unwrap();
        assert_eq!((pick.primary(), pick.predicted, pick.affinity), ("10.0.0.1:2", true, true));
        // Fixed weights when asked for, or before the model has its samples.
        let (mut p, hashes, t0) = busy_holder(TtftModel::new());
        assert!(!p.pick(&hashes, None, t0, "r3").unwrap().predicted);
        let (mut p, hashes, t0) = busy_holder(fitted(0.2, 0.6, 0.4));
        p.config.scoring = PickerScoring::Weighted;
        assert!(!p.pick(&hashes, None, t0, "r4").unwrap().predicted);
    }

    #[test]
    fn a_picks_measured_ttft_is_fitted_once_with_the_features_of_its_pick() {
        let t0 = Instant::now();
        let mut p = PoolPicker::new(PickerConfig { fallback_endpoints: 0, ..config() }, &addrs(1), 500);
        p.scraped(0, scrape(0.0, 0.0, 0.0), t0);
        for i in 0..MIN_SAMPLES_FOR_TEST {
            let id = format!("r{i}");
            let pick = p.pick(&[], None, t0, &id).unwrap();
            p.finished(pick.primary(), Some(Observed { request_id: &id, ttft_s: 0.5, prompt_tokens: 0 }));
            // Its end again (a second delivery): nothing more is fitted.
            p.finished(pick.primary(), Some(Observed { request_id: &id, ttft_s: 9.0, prompt_tokens: 0 }));
        }
        assert_eq!(p.model().samples(), MIN_SAMPLES_FOR_TEST as u64);
        assert!((p.model().predict(TtftModel::features(0.0, 0.0)).unwrap() - 0.5).abs() < 0.01);
        // An end without a TTFT, or of an unknown request, fits nothing; the pending set is bounded.
        let pick = p.pick(&[], None, t0, "x").unwrap();
        p.finished(pick.primary(), None);
        p.finished(
            pick.primary(),
            Some(Observed { request_id: "never-picked", ttft_s: 1.0, prompt_tokens: 0 }),
        );
        assert_eq!(p.model().samples(), MIN_SAMPLES_FOR_TEST as u64);
        for i in 0..MAX_PENDING + 10 {
            p.pick(&[], None, t0, &format!("p{i}"));
        }
        assert_eq!((p.pending.len(), p.pending_order.len()), (MAX_PENDING, MAX_PENDING));
    }

    const MIN_SAMPLES_FOR_TEST: usize = crate::scheduling::ttft_model::MIN_SAMPLES as usize;

    #[test]
    fn the_prefix_index_is_bounded_by_the_engines_cache() {
        let t0 = Instant::now();
        let mut p = PoolPicker::new(PickerConfig { fallback_endpoints: 0, ..config() }, &addrs(1), 500);
        // 320 blocks of 16 tokens at 4 bytes a token: 320 prompt blocks of 64 bytes.
        let cache = Some(Scrape { cache_tokens: 5120.0, ..Scrape::default() });
        p.scraped(0, cache, t0);
        let hashes: Vec<u64> = (1..=1000).collect();
        p.pick(&hashes, None, t0, "");
        assert_eq!(p.endpoints()[0].prefixes.len(), 320);
    }

    #[test]
    fn the_pools_bytes_per_token_is_learned_from_ends_and_sizes_the_index() {
        let t0 = Instant::now();
        let mut p = PoolPicker::new(PickerConfig { fallback_endpoints: 0, ..config() }, &addrs(1), 500);
        assert_eq!(p.bytes_per_token(), BYTES_PER_TOKEN as f64);
        let block = p.config.block_bytes;
        p.scraped(0, Some(Scrape::default()), t0);
        // Prompts of 100 blocks that the usage counts at 8 bytes a token.
        let hashes: Vec<u64> = (1..=100).collect();
        let tokens = (100 * block / 8) as u64;
        for i in 0..200 {
            let id = format!("r{i}");
            let pick = p.pick(&hashes, None, t0, &id).unwrap();
            p.finished(
                pick.primary(),
                Some(Observed { request_id: &id, ttft_s: 0.5, prompt_tokens: tokens }),
            );
        }
        assert!((p.bytes_per_token() - 8.0).abs() < 0.1, "{}", p.bytes_per_token());
        // The engine's 5,120 tokens then hold 5,120 x 8 bytes of prompt.
        p.scraped(0, Some(Scrape { cache_tokens: 5120.0, ..Scrape::default() }), t0);
        let many: Vec<u64> = (1000..=100_000).collect();
        p.pick(&many, None, t0, "");
        let expected = (5120.0 * p.bytes_per_token() / block as f64) as usize;
        assert_eq!(p.endpoints()[0].prefixes.len(), expected.min(p.config.prefix_lru_blocks));
        // Short prompts, unknown requests and prompts of one block teach nothing.
        let before = p.bytes_per_token();
        let pick = p.pick(&hashes, None, t0, "short").unwrap();
        p.finished(pick.primary(), Some(Observed { request_id: "short", ttft_s: 0.5, prompt_tokens: 10 }));
        let pick = p.pick(&[7], None, t0, "one").unwrap();
        p.finished(pick.primary(), Some(Observed { request_id: "one", ttft_s: 0.5, prompt_tokens: 1000 }));
        p.finished("10.0.0.1:1", Some(Observed { request_id: "never", ttft_s: 0.5, prompt_tokens: 1000 }));
        assert_eq!(p.bytes_per_token(), before);
    }
}
