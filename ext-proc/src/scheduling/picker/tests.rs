//! The picker's unit tests (pure: scrapes and the clock are given).

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
    Candidate { waiting, running: 0.0, kv_cache_usage: 0.0, in_flight, prefix_blocks, ttft: None }
}

#[test]
fn an_endpoint_slow_to_first_tokens_is_avoided_at_equal_load_and_its_ttft_is_smoothed() {
    let mut p = PoolPicker::new(PickerConfig { fallback_endpoints: 0, ..config() }, &addrs(2), 500);
    let t0 = Instant::now();
    let ttft = |sum: f64, count: f64| Some(Scrape { ttft_sum: sum, ttft_count: count, ..Scrape::default() });
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
fn a_prefix_that_spilled_goes_home_again_when_its_home_has_room() {
    let t0 = Instant::now();
    // Load alone ranks (no prefix score, affinity only at equal load), so homes decide affinity.
    let cfg =
        PickerConfig { prefix_weight: 0.0, affinity_load_factor: 1.0, home_load_factor: 1.25, ..config() };
    let mut p = PoolPicker::new(cfg, &addrs(2), 500);
    p.scraped(0, scrape(0.0, 0.0, 0.0), t0);
    p.scraped(1, scrape(0.0, 0.0, 0.0), t0);
    let doc: Vec<u64> = (1..=32).collect();
    let ask = |p: &mut PoolPicker, tail: u64| {
        let mut hashes = doc.clone();
        hashes.push(1_000 + tail);
        p.pick(&hashes, None, t0, "").unwrap()
    };
    let first = ask(&mut p, 0);
    let home = first.primary().to_owned();
    assert!(!first.home, "a new prefix is ranked");
    // Five more while nothing ends: the home takes them while its occupancy + 1 is within
    // ceil(1.25 x (held + 1) / 2), else the ranking spills them to the other endpoint.
    let picks: Vec<Pick> = (1..6).map(|t| ask(&mut p, t)).collect();
    let at_home: Vec<bool> = picks.iter().map(|k| k.primary() == home).collect();
    // Occupancy of the home and of the other at each: 1/0 (cap 2), 2/0 (2), 2/1 (3), 3/1 (4), 4/1 (4).
    assert_eq!(at_home, vec![true, false, true, true, false]);
    assert!(picks.iter().all(|k| k.home == (k.primary() == home) && (k.affinity || !k.home)), "{picks:?}");
    assert!(picks.iter().filter(|k| k.home).all(|k| k.prefix_blocks == 32));
    let other = picks[1].primary().to_owned();
    assert_eq!(picks[1].endpoints, vec![other.clone(), home.clone()], "the home as the fallback");
    // Both hold the document now; the other is idle once its requests end, the home is not.
    p.finished(&other, None);
    p.finished(&other, None);
    let back = ask(&mut p, 9);
    assert_eq!((back.primary(), back.home), (other.as_str(), false), "the home at 4 of 5 is full");
    p.finished(&home, None);
    p.finished(&home, None);
    let back = ask(&mut p, 10);
    assert_eq!((back.primary(), back.home), (home.as_str(), true), "back home, though the other is idler");
    // With homes off (the default) the less busy holder wins.
    let mut off = PoolPicker::new(config(), &addrs(2), 500);
    off.scraped(0, scrape(0.0, 0.0, 0.0), t0);
    off.scraped(1, scrape(0.0, 0.0, 0.0), t0);
    let first = ask(&mut off, 0);
    assert!(!ask(&mut off, 1).home);
    off.endpoints.iter_mut().for_each(|e| e.prefixes.record(&doc));
    assert_ne!(ask(&mut off, 2).primary(), first.primary(), "homes off: the idler holder");
}

#[test]
fn a_scrape_bounds_in_flight_by_what_vllm_holds_plus_the_picks_of_the_arrival_lag() {
    let t0 = Instant::now();
    let mut p = PoolPicker::new(PickerConfig { fallback_endpoints: 0, ..config() }, &addrs(1), 500);
    p.scraped(0, scrape(0.0, 0.0, 0.0), t0);
    for _ in 0..5 {
        p.pick(&[], None, t0, "");
    }
    // vLLM holds 2: the 5 picks may still be on their way to it (its API server parsing them),
    // for the arrival lag: 20 s, forty 500 ms scrape intervals.
    for i in 0..40 {
        p.scraped(0, scrape(1.0, 1.0, 0.0), t0);
        assert_eq!(p.endpoints()[0].in_flight, 5, "scrape {i}");
    }
    // Their ends never came (lost access-log entries): past the arrival lag, bounded by vLLM's 2.
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
    p.finished(pick.primary(), Some(Observed { request_id: "never-picked", ttft_s: 1.0, prompt_tokens: 0 }));
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
        p.finished(pick.primary(), Some(Observed { request_id: &id, ttft_s: 0.5, prompt_tokens: tokens }));
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

#[test]
fn a_flow_controlled_pool_sends_a_promised_request_to_its_slot_and_prefers_the_prefix_holder() {
    let mut p = PoolPicker::new(PickerConfig { fallback_endpoints: 0, ..config() }, &addrs(2), 500);
    let t0 = Instant::now();
    assert_eq!(p.free_slots(t0), None, "no slots without flow control");
    p.set_slots(4);
    p.scraped(0, scrape(0.0, 0.0, 0.0), t0);
    p.scraped(1, scrape(0.0, 0.0, 0.0), t0);
    assert_eq!(p.free_slots(t0), Some(vec![2, 2]));
    // Endpoint 1 (port 2) served prefix [7, 8]; a request of it prefers endpoint 1.
    p.pick(&[7, 8], Some(&[SocketAddr::from(([10, 0, 0, 1], 2))]), t0, "").unwrap();
    let free = p.free_slots(t0).unwrap();
    assert_eq!(free, vec![2, 1]);
    assert_eq!(p.preferred(&[7, 8, 9], &free), Some(1));
    assert_eq!(p.preferred(&[5], &free), None, "no endpoint holds it");
    assert_eq!(p.preferred(&[7, 8], &[2, 0]), None, "its holder has no free slot");
    // A promise decides the pick over the ranking (which would take the idle endpoint 0).
    p.promise("r1", 1, t0);
    assert_eq!(p.free_slots(t0), Some(vec![2, 0]));
    let pick = p.pick(&[3], None, t0, "r1").unwrap();
    assert!(pick.slot && !pick.home);
    assert_eq!(pick.primary(), "10.0.0.1:2");
    assert_eq!(p.free_slots(t0), Some(vec![2, 0]), "the promise became an in-flight request");
    // Without a promise the ranking decides again (a prompt no endpoint holds: the idle one).
    assert_eq!(p.pick(&[4], None, t0, "r2").unwrap().primary(), "10.0.0.1:1");
}

#[test]
fn a_flow_controlled_pool_never_picks_a_full_endpoint_while_another_has_a_free_slot() {
    let t0 = Instant::now();
    let holder = || {
        let mut p = PoolPicker::new(PickerConfig { fallback_endpoints: 0, ..config() }, &addrs(2), 500);
        p.scraped(0, scrape(0.0, 0.0, 0.0), t0);
        p.scraped(1, scrape(0.0, 0.0, 0.0), t0);
        // Endpoint 0 (port 1) serves prefix [7, 8] twice.
        let only_0 = [SocketAddr::from(([10, 0, 0, 1], 1))];
        p.pick(&[7, 8], Some(&only_0), t0, "").unwrap();
        p.pick(&[7, 8], Some(&only_0), t0, "").unwrap();
        p
    };
    // Without slots the prefix's holder wins, busy as it is.
    assert_eq!(holder().pick(&[7, 8, 9], None, t0, "").unwrap().primary(), "10.0.0.1:1");
    // With two slots each, the holder is full: the request goes to the free slot.
    let mut p = holder();
    p.set_slots(4);
    assert_eq!(p.free_slots(t0), Some(vec![0, 2]));
    let pick = p.pick(&[7, 8, 9], None, t0, "").unwrap();
    assert_eq!(pick.primary(), "10.0.0.1:2");
    assert!(!pick.slot);
}
