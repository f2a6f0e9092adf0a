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
//! 4. **Prefix home** (`home_load_factor`; off by default, 0): the home of the
//!    request's longest homed prefix (the endpoint that prefix's first request went to,
//!    [`crate::scheduling::home`]) goes first while it is eligible and under its bounded-load
//!    capacity, whatever steps 2 and 3 (or the predicted TTFT) ranked; the ranking follows it.
//!    Homes keep the replicas' caches disjoint, as a static split of the prefixes between them
//!    does; without them a prefix that spilled once is held, and then asked for, on every
//!    endpoint.
//!    In a flow-controlled pool ([`crate::scheduling::slots`]) the home goes first only while it
//!    has a free slot.
//! 5. **Fallbacks**: the next `fallback_endpoints` of the ranking, for Envoy to try in order.
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
//! A request the pool's flow-control queue dispatched into a free slot it promised
//! ([`PoolPicker::promise`]) goes to that endpoint first, when it is still eligible.
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
use crate::scheduling::home::{within_capacity, Homes};
use crate::scheduling::slots::Slots;
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

/// Most prompt blocks a pool's homes remember (`prefix_lru_blocks` per endpoint, up to this).
pub const MAX_HOMES: usize = 10_000_000;

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
/// `config` (steps 2, 3 and 5 of the module doc); `tiebreak` rotates equal scores. `None` when there
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

/// When the first of `order` (candidate indices, best first) holds its `slots` or more: the best
/// ranked candidate with fewer, else the least loaded such one. None when the first has a free
/// slot or none has one.
fn with_free_slot(candidates: &[Candidate], order: &[usize], slots: u64) -> Option<usize> {
    let full = |i: &usize| candidates.get(*i).is_none_or(|c| c.in_flight >= slots);
    if !order.first().is_some_and(full) {
        return None;
    }
    order.iter().copied().find(|i| !full(i)).or_else(|| {
        (0..candidates.len())
            .filter(|i| !full(i))
            .min_by_key(|&i| candidates.get(i).map_or(u64::MAX, |c| c.in_flight))
    })
}

/// Scrape intervals of `scrape_interval_ms` in the pool's arrival lag, rounded up (2..=10,000).
fn pick_intervals(scrape_interval_ms: u64) -> usize {
    let interval = Duration::from_millis(scrape_interval_ms.max(1));
    let lag = crate::pools::signals::arrival_lag(crate::pools::signals::report_lag(interval));
    let n = lag.as_millis().div_ceil(interval.as_millis().max(1));
    usize::try_from(n).unwrap_or(usize::MAX).clamp(2, 10_000)
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
    /// Picks in each scrape interval of the arrival lag
    /// ([`crate::pools::signals::arrival_lag`]), the current interval's first.
    picks: VecDeque<u64>,
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
    /// Whether the predicted TTFT ranked it (and no prefix home decided it).
    pub predicted: bool,
    /// Whether the request's prefix home decided it ([`crate::scheduling::home`]).
    pub home: bool,
    /// Whether the slot the pool's queue promised it decided it ([`crate::scheduling::slots`]).
    pub slot: bool,
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
    /// Scrape intervals whose picks an endpoint's count keeps ([`PoolPicker::scraped`]): the
    /// arrival lag's ([`crate::pools::signals::arrival_lag`]).
    pick_intervals: usize,
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
    /// Each prompt block's home endpoint (step 4); `None` with homes off (nothing kept or looked up).
    homes: Option<Homes>,
    /// The endpoints' slots in a flow-controlled pool ([`PoolPicker::set_slots`]); `None` otherwise.
    slots: Option<Slots>,
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
                picks: VecDeque::from([0]),
                prefixes: PrefixIndex::new(config.prefix_lru_blocks),
                ttft: None,
                ttft_seen: None,
            })
            .collect();
        let stale_after = Duration::from_millis(config.stale_after_ms(scrape_interval_ms));
        Self {
            config,
            stale_after,
            pick_intervals: pick_intervals(scrape_interval_ms),
            endpoints,
            picks: 0,
            model: TtftModel::new(),
            pending: HashMap::new(),
            pending_order: VecDeque::new(),
            bytes_per_token: BYTES_PER_TOKEN as f64,
            homes: (config.home_load_factor >= 1.0).then(|| {
                Homes::new(config.prefix_lru_blocks.saturating_mul(addrs.len()).clamp(1, MAX_HOMES))
            }),
            slots: None,
        }
    }

    /// The pool is flow-controlled at `max_in_flight`: its endpoints' slots are its share
    /// ([`Slots::new`]), and its queue dispatches by them ([`PoolPicker::free_slots`]).
    /// Its queue's dispatch prefers each prefix's home ([`PoolPicker::preferred`]), so prefix
    /// homes are kept whatever `home_load_factor` says (which then only rules step 4).
    /// Each endpoint has `picker.slot_overcommit` more slots, waiting in its own queue
    /// ([`PoolPicker::spill_slots`]).
    pub fn set_slots(&mut self, max_in_flight: u64) {
        self.slots = Some(Slots::new(max_in_flight, self.endpoints.len(), self.config.slot_overcommit));
        if self.homes.is_none() {
            let capacity = self.config.prefix_lru_blocks.saturating_mul(self.endpoints.len());
            self.homes = Some(Homes::new(capacity.clamp(1, MAX_HOMES)));
        }
    }

    /// Free slots of each endpoint (config order) at `now`: its slots less this sidecar's
    /// requests in flight on it and the slots promised on it; 0 for one not eligible. `None`
    /// without slots.
    pub fn free_slots(&self, now: Instant) -> Option<Vec<u64>> {
        let slots = self.slots.as_ref()?;
        let in_flight: Vec<u64> = self.endpoints.iter().map(|e| e.in_flight).collect();
        let eligible: Vec<bool> = self.endpoints.iter().map(|e| e.eligible(now, self.stale_after)).collect();
        Some(slots.free(&in_flight, &eligible, now))
    }

    /// [`PoolPicker::free_slots`] counting each endpoint's overcommitted slots
    /// ([`Slots::spill_free`]): where a queued request may wait in an engine's own queue (the
    /// endpoint holding its prefix, [`PoolPicker::holder`], or, for a prompt no endpoint holds,
    /// [`PoolPicker::holds_none`], one no queued request waits for). `None` without slots.
    pub fn spill_slots(&self, now: Instant) -> Option<Vec<u64>> {
        let slots = self.slots.as_ref()?;
        let in_flight: Vec<u64> = self.endpoints.iter().map(|e| e.in_flight).collect();
        let eligible: Vec<bool> = self.endpoints.iter().map(|e| e.eligible(now, self.stale_after)).collect();
        Some(slots.spill_free(&in_flight, &eligible, now))
    }

    /// Requests the pool may hold past its `max_in_flight` in its engines' own queues:
    /// `slot_overcommit x endpoints` (`None` without slots, or with none).
    pub fn spill_room(&self) -> Option<u64> {
        let slots = self.slots.as_ref()?;
        let n = u64::try_from(self.endpoints.len()).unwrap_or(u64::MAX);
        Some(slots.overcommit().saturating_mul(n)).filter(|&n| n > 0)
    }

    /// The endpoint believed to hold the prefix of a prompt hashing to `hashes`: the home of its
    /// longest homed prefix, else the first of those holding its longest matched prefix (at
    /// least one block); None when none holds any of it ([`PoolPicker::holds_none`]).
    pub fn holder(&self, hashes: &[u64]) -> Option<usize> {
        if let Some((home, _)) = self.homes.as_ref().and_then(|homes| homes.of(hashes)) {
            return Some(home);
        }
        let matched: Vec<usize> = self.endpoints.iter().map(|e| e.prefixes.matched(hashes)).collect();
        let longest = matched.iter().copied().max().filter(|&m| m > 0)?;
        matched.iter().position(|&m| m == longest)
    }

    /// Whether no endpoint holds any of a prompt hashing to `hashes`: no homed prefix and no
    /// endpoint that served its first block (true for a prompt without hashes).
    pub fn holds_none(&self, hashes: &[u64]) -> bool {
        self.homes.as_ref().and_then(|homes| homes.of(hashes)).is_none()
            && self.endpoints.iter().all(|e| e.prefixes.matched(hashes) == 0)
    }

    /// The endpoint with a free slot (`free`, from [`PoolPicker::free_slots`]) that holds the
    /// prefix of a prompt hashing to `hashes`: the home of its longest homed prefix when it has
    /// one, else, of the endpoints holding its longest matched prefix (at least one block), the
    /// one with the most free slots. None when that endpoint has no free slot, or none holds it.
    pub fn preferred(&self, hashes: &[u64], free: &[u64]) -> Option<usize> {
        let has_free = |i: usize| free.get(i).is_some_and(|&n| n > 0);
        if let Some((home, _)) = self.homes.as_ref().and_then(|homes| homes.of(hashes)) {
            return has_free(home).then_some(home);
        }
        let matched: Vec<usize> = self.endpoints.iter().map(|e| e.prefixes.matched(hashes)).collect();
        let longest = matched.iter().copied().max().filter(|&m| m > 0)?;
        (0..self.endpoints.len())
            .filter(|&i| matched.get(i) == Some(&longest) && has_free(i))
            .max_by_key(|&i| (free.get(i).copied().unwrap_or(0), std::cmp::Reverse(i)))
    }

    /// Promises endpoint `index`'s free slot to request `request_id`, which the pool's queue
    /// dispatched at `now`: its pick goes there.
    pub fn promise(&mut self, request_id: &str, index: usize, now: Instant) {
        if let Some(slots) = self.slots.as_mut() {
            slots.promise(request_id, index, now);
        }
    }

    /// Takes back the slot promised to `request_id` (its dispatch failed).
    pub fn unpromise(&mut self, request_id: &str) {
        if let Some(slots) = self.slots.as_mut() {
            slots.take(request_id);
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
    /// the arrival lag (on their way to it: [`crate::pools::signals::arrival_lag`]), so requests
    /// whose end never reaches this sidecar (an Envoy killed) are taken off after a lull.
    pub fn scraped(&mut self, index: usize, scrape: Option<Scrape>, now: Instant) {
        let keep = self.pick_intervals;
        let Some(e) = self.endpoints.get_mut(index) else { return };
        e.scrape_ok = scrape.is_some();
        if let Some(s) = scrape {
            let held = (s.running.max(0.0) + s.waiting.max(0.0)).ceil();
            let held = if held.is_finite() && held < u64::MAX as f64 { held as u64 } else { u64::MAX };
            let sent = e.picks.iter().fold(0u64, |sum, n| sum.saturating_add(*n));
            e.in_flight = e.in_flight.min(held.saturating_add(sent));
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
        e.picks.push_front(0);
        e.picks.truncate(keep);
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
                let (waiting, running, kv) = e
                    .scraped
                    .as_ref()
                    .map_or((0.0, 0.0, 0.0), |(s, _)| (s.waiting, s.running, s.kv_cache_usage));
                Candidate {
                    waiting,
                    running,
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
        let mut choice = match &predicted {
            Some(p) => choose_predicted(&candidates, p, &self.config, self.picks)?,
            None => choose(&candidates, &self.config, hashes.len(), self.picks)?,
        };
        // Step 4: the home of the request's longest homed prefix, when eligible and under capacity.
        let homed = self
            .homes
            .as_ref()
            .and_then(|homes| homes.of(hashes))
            .and_then(|(e, blocks)| Some((eligible.iter().position(|&i| i == e)?, blocks)));
        let per_slot = self.slots.as_ref().map(Slots::per_endpoint);
        let home = homed.map(|(h, _)| h).filter(|&h| {
            let occupancy: Vec<f64> = candidates.iter().map(Candidate::occupancy).collect();
            let slot_free = per_slot.is_none_or(|n| candidates.get(h).is_some_and(|c| c.in_flight < n));
            slot_free && within_capacity(&occupancy, h, self.config.home_load_factor)
        });
        // The slot the pool's queue promised it, when that endpoint is still a candidate.
        let slot = self
            .slots
            .as_mut()
            .and_then(|s| s.take(request_id))
            .and_then(|e| eligible.iter().position(|&i| i == e));
        // Not promised a slot (admitted while the pool had room): a full endpoint is passed over
        // for the best ranked one with a free slot, least loaded when the ranking has none, so
        // no engine queues while another has a free slot.
        let free_slot = match (slot.or(home), per_slot) {
            (None, Some(n)) => with_free_slot(&candidates, &choice.order, n),
            _ => None,
        };
        if let Some(first) = free_slot {
            choice.order.retain(|&i| i != first);
            choice.order.insert(0, first);
            choice.order.truncate(self.config.fallback_endpoints.saturating_add(1));
            choice.affinity = candidates.get(first).is_some_and(|c| c.prefix_blocks > 0);
        }
        if let Some(first) = slot.or(home) {
            choice.order.retain(|&i| i != first);
            choice.order.insert(0, first);
            choice.order.truncate(self.config.fallback_endpoints.saturating_add(1));
            choice.affinity = slot.is_none() || candidates.get(first).is_some_and(|c| c.prefix_blocks > 0);
        }
        self.picks = self.picks.wrapping_add(1);
        if let Some(x) = choice.order.first().and_then(|&c| features.get(c)) {
            self.remember(request_id, *x, hashes.len());
        }
        let prefix_blocks =
            choice.order.first().and_then(|&c| candidates.get(c)).map_or(0, |c| c.prefix_blocks);
        let picked: Vec<usize> = choice.order.iter().filter_map(|&c| eligible.get(c).copied()).collect();
        if let (Some(&i), Some(homes)) = (picked.first(), self.homes.as_mut()) {
            // A homed prefix keeps its home; the rest of the prompt (all of it when the home is
            // gone) lives where it went.
            homes.record(hashes, i, homed.map_or(0, |(_, blocks)| blocks));
        }
        if let Some(e) = picked.first().and_then(|&i| self.endpoints.get_mut(i)) {
            e.prefixes.record(hashes);
            e.in_flight = e.in_flight.saturating_add(1);
            if let Some(n) = e.picks.front_mut() {
                *n = n.saturating_add(1);
            }
        }
        let endpoints =
            picked.iter().filter_map(|&i| self.endpoints.get(i)).map(|e| e.label.clone()).collect();
        Some(Pick {
            endpoints,
            prefix_blocks,
            request_blocks: hashes.len(),
            affinity: choice.affinity,
            predicted: predicted.is_some() && home.is_none() && slot.is_none(),
            home: home.is_some() && slot.is_none(),
            slot: slot.is_some(),
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
mod tests;
