//! What the sidecar knows of a pool's load, with no I/O: the signals it reads from its
//! endpoints' vLLM `/metrics` (queue depth, KV-cache use: [`Scrape`], [`parse_vllm_metrics`]) and
//! its in-flight count over every sidecar replica, summed per pool ([`PoolSignals`]), and the
//! arithmetic around them (smoothing, the report lag, the in-flight bound).

use std::collections::VecDeque;
use std::sync::LazyLock;
use std::time::{Duration, Instant};

/// What is known about a pool right now.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PoolSignals {
    /// `vllm:num_requests_waiting`, summed over endpoints (None: never scraped).
    pub waiting: Option<f64>,
    /// `vllm:num_requests_running`, summed over endpoints.
    pub running: Option<f64>,
    /// `vllm:kv_cache_usage_perc` (0..1), the highest endpoint's.
    pub kv_cache_usage: Option<f64>,
    /// Requests admitted to the pool and not yet finished, over every sidecar replica
    /// ([`in_flight_view`]).
    pub in_flight: u64,
    /// Requests the pool finishes per second (from `vllm:request_success_total` between
    /// scrapes, smoothed); None until two scrapes.
    pub drain_per_s: Option<f64>,
}

/// Exponentially smoothed drain rate: `alpha` of the new sample (requests/s) and the rest of the
/// previous estimate.
pub fn smooth_rate(previous: Option<f64>, sample: f64, alpha: f64) -> f64 {
    match previous {
        Some(p) => alpha * sample + (1.0 - alpha) * p,
        None => sample,
    }
}

/// How late a request's end can reach the pool-wide in-flight count after vLLM finished it (the
/// access log's batching, the replicas' flushes) or a request admitted can reach vLLM: the
/// larger of 5 s and four scrape intervals. Bounds the self-correction of the count
/// ([`in_flight_bound`]).
pub fn report_lag(scrape_interval: Duration) -> Duration {
    (scrape_interval * 4).max(Duration::from_secs(5))
}

/// The shortest [`arrival_lag`].
pub const MIN_ARRIVAL_LAG: Duration = Duration::from_secs(20);

/// How long a request the gateway sent to a pool may take to appear in vLLM's
/// `vllm:num_requests_running` + `vllm:num_requests_waiting`: the larger of [`MIN_ARRIVAL_LAG`]
/// and the pool's [`report_lag`]. vLLM's API server parses and tokenizes a request before its
/// engine counts it; on the CPU engine beside the gateway on two cores (docs/benchmarks.md, "On a
/// real engine") 6 of the first 8 requests sent were not in vLLM's counts 5.3 s after, and a bound
/// that forgot them took them off the count: the pool then held 6 requests past `max_in_flight`
/// for the rest of the run. The self-correction ([`in_flight_bound`]) counts every request sent
/// within it, so it lowers a count only after a lull that long.
pub fn arrival_lag(report_lag: Duration) -> Duration {
    report_lag.max(MIN_ARRIVAL_LAG)
}

/// How much a counter grew over the last `window`: its newest sample minus the newest sample
/// taken at or before `now - window` (the oldest sample when none is that old). 0 with fewer
/// than two samples or when it went down (a restarted vLLM).
pub fn growth(samples: &VecDeque<(Instant, f64)>, now: Instant, window: Duration) -> f64 {
    let Some(&(_, newest)) = samples.back() else { return 0.0 };
    let start = now.checked_sub(window);
    let from = samples
        .iter()
        .rev()
        .find(|(at, _)| start.is_some_and(|s| *at <= s))
        .or_else(|| samples.front())
        .map_or(newest, |&(_, v)| v);
    (newest - from).max(0.0)
}

/// Upper bound on the requests the gateway has in flight to a pool, from what vLLM reports: the
/// requests running and waiting at the last scrape, plus those vLLM finished
/// (`vllm:request_success_total`) within the [`report_lag`], whose ends may not have reached the
/// count yet, and those the gateway admitted (every replica) within the [`arrival_lag`], which
/// may not have reached vLLM's counts yet. Rounded up.
pub fn in_flight_bound(running: f64, waiting: f64, finished_in_lag: f64, admitted_in_lag: f64) -> u64 {
    let sum = running.max(0.0) + waiting.max(0.0) + finished_in_lag.max(0.0) + admitted_in_lag.max(0.0);
    sum.ceil() as u64
}

/// The in-flight count shedding uses: the pool-wide total of every replica's admitted minus
/// finished requests at this replica's last flush (`None` when Redis was not reached within the
/// report lag: then this replica's own balance `local`), plus what this replica counted since
/// (`unflushed`), clamped to 0 and, with fresh metrics, to `bound` plus this replica's admissions
/// since the flush (`unflushed_admitted`).
pub fn in_flight_view(
    total: Option<i64>,
    unflushed: i64,
    local: i64,
    bound: Option<u64>,
    unflushed_admitted: u64,
) -> u64 {
    let count = match total {
        Some(total) => total.saturating_add(unflushed),
        None => local,
    };
    let count = u64::try_from(count).unwrap_or(0);
    match bound {
        Some(bound) => count.min(bound.saturating_add(unflushed_admitted)),
        None => count,
    }
}

/// Sums of the vLLM metrics this sidecar reads, from one endpoint's Prometheus text.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Scrape {
    /// `vllm:num_requests_waiting`.
    pub waiting: f64,
    /// `vllm:num_requests_running`.
    pub running: f64,
    /// `vllm:kv_cache_usage_perc`, or the older `vllm:gpu_cache_usage_perc` (0..1).
    pub kv_cache_usage: f64,
    /// `vllm:request_success_total` (a counter, summed over `finished_reason`).
    pub finished: f64,
    /// `vllm:time_to_first_token_seconds_sum` (the TTFT histogram's sum, seconds, a counter).
    pub ttft_sum: f64,
    /// `vllm:time_to_first_token_seconds_count` (requests that got a first token, a counter).
    pub ttft_count: f64,
    /// Tokens the engine's KV cache holds, from `vllm:cache_config_info`: its
    /// `kv_cache_size_tokens` where vLLM reports it (it counts what the blocks hold when several
    /// attention groups share them: on vLLM 0.32's CPU build, Gemma-3-270M's 320 blocks of 128
    /// tokens hold 6,488 tokens, not 40,960), else `num_gpu_blocks` × `block_size` (0 when
    /// neither is reported).
    pub cache_tokens: f64,
}

/// The samples [`parse_vllm_metrics`] reads, by their exposition names (a counter's `_total`, a
/// histogram's `_sum` and `_count`).
pub const VLLM_SAMPLES: [&str; 8] = [
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "vllm:request_success_total",
    "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
    "vllm:cache_config_info",
];

/// The path (with its query) that asks a vLLM endpoint for [`VLLM_SAMPLES`] only:
/// `/metrics/?name%5B%5D=vllm%3Anum_requests_waiting&...`.
///
/// vLLM serves its registry twice: `/metrics` (prometheus-fastapi-instrumentator's handler, the
/// whole registry whatever the query) and `/metrics/` (prometheus_client's `make_asgi_app`,
/// which answers only the samples named in `name[]` parameters). The whole registry of vLLM
/// 0.32's CPU build is 51 KB, 591 lines, and took 5.5 ms of the API server's CPU a scrape on an
/// idle replica; the filtered answer 2.6 KB, 23 lines, 0.7 ms. An endpoint that does not answer
/// this path with vLLM's gauges ([`is_vllm_metrics`]) is scraped at `/metrics`.
pub static FILTERED_METRICS_PATH: LazyLock<String> = LazyLock::new(|| {
    let query: Vec<String> =
        VLLM_SAMPLES.iter().map(|name| format!("name%5B%5D={}", name.replace(':', "%3A"))).collect();
    format!("/metrics/?{}", query.join("&"))
});

/// Whether a metrics answer carries vLLM's scheduler gauges (a `vllm:num_requests_running`
/// sample): false for a server that answered [`FILTERED_METRICS_PATH`] with something else.
pub fn is_vllm_metrics(text: &str) -> bool {
    text.lines().any(|line| {
        line.strip_prefix("vllm:num_requests_running").is_some_and(|rest| rest.starts_with(['{', ' ']))
    })
}

/// Parses the metrics text of a vLLM endpoint (label sets summed; the KV-cache usage is the
/// highest value). Unknown lines are ignored.
pub fn parse_vllm_metrics(text: &str) -> Scrape {
    let mut s = Scrape::default();
    for line in text.lines() {
        if line.starts_with('#') {
            continue;
        }
        let Some((name_labels, value)) = line.rsplit_once(' ') else { continue };
        let Ok(value) = value.trim().parse::<f64>() else { continue };
        let name = name_labels.split('{').next().unwrap_or_default().trim();
        match name {
            "vllm:num_requests_waiting" => s.waiting += value,
            "vllm:num_requests_running" => s.running += value,
            "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc" => {
                s.kv_cache_usage = s.kv_cache_usage.max(value)
            }
            "vllm:request_success_total" => s.finished += value,
            "vllm:time_to_first_token_seconds_sum" => s.ttft_sum += value,
            "vllm:time_to_first_token_seconds_count" => s.ttft_count += value,
            "vllm:cache_config_info" => {
                let label = |key: &str| label_value(name_labels, key).and_then(|v| v.parse::<f64>().ok());
                let tokens = label("kv_cache_size_tokens")
                    .or_else(|| Some(label("num_gpu_blocks")? * label("block_size")?));
                if let Some(tokens) = tokens {
                    s.cache_tokens = s.cache_tokens.max(tokens);
                }
            }
            _ => {}
        }
    }
    s
}

/// The value of label `key` in a metric's `name{k="v",...}` (None when absent).
fn label_value<'a>(name_labels: &'a str, key: &str) -> Option<&'a str> {
    let labels = name_labels.split_once('{')?.1.strip_suffix('}')?;
    labels.split(',').find_map(|pair| {
        let (k, v) = pair.split_once('=')?;
        (k.trim() == key).then(|| v.trim().trim_matches('"'))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_engines_cache_size_is_read_from_its_cache_config() {
        let text = "vllm:cache_config_info{block_size=\"16\",cache_dtype=\"auto\",engine=\"0\",num_gpu_blocks=\"320\",num_gpu_blocks_override=\"320\"} 1.0\n";
        assert_eq!(parse_vllm_metrics(text).cache_tokens, 5120.0);
        let unknown = "vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"None\"} 1.0\n";
        assert_eq!(parse_vllm_metrics(unknown).cache_tokens, 0.0);
        // vLLM 0.32's CPU build serving Gemma-3 (its attention groups share the 128-token blocks):
        // the tokens it reports win over blocks x block size.
        let hybrid = "vllm:cache_config_info{block_size=\"128\",engine=\"0\",kv_cache_size_tokens=\"6488\",num_gpu_blocks=\"320\"} 1.0\n";
        assert_eq!(parse_vllm_metrics(hybrid).cache_tokens, 6488.0);
        let none = "vllm:cache_config_info{block_size=\"128\",kv_cache_size_tokens=\"None\",num_gpu_blocks=\"320\"} 1.0\n";
        assert_eq!(parse_vllm_metrics(none).cache_tokens, 40960.0);
    }

    #[test]
    fn the_filtered_path_names_every_sample_the_parser_reads() {
        let path = FILTERED_METRICS_PATH.as_str();
        assert!(path.starts_with("/metrics/?name%5B%5D=vllm%3Anum_requests_waiting&name%5B%5D="), "{path}");
        assert_eq!(path.matches("name%5B%5D=").count(), VLLM_SAMPLES.len());
        assert!(!path.contains(':') && !path.contains('['), "{path}");
        // Every name of the list is one the parser reads: a text of each at 1 sets every field.
        let text: String = VLLM_SAMPLES
            .iter()
            .map(|name| match *name {
                "vllm:cache_config_info" => format!("{name}{{kv_cache_size_tokens=\"1\"}} 1\n"),
                _ => format!("{name}{{model_name=\"m\"}} 1\n"),
            })
            .collect();
        let s = parse_vllm_metrics(&text);
        assert_eq!(
            (s.waiting, s.running, s.kv_cache_usage, s.finished, s.ttft_sum, s.ttft_count, s.cache_tokens),
            (1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0)
        );
    }

    #[test]
    fn only_an_answer_with_the_running_gauge_is_vllm_metrics() {
        assert!(is_vllm_metrics(
            "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine=\"0\"} 2.0\n"
        ));
        assert!(is_vllm_metrics("vllm:num_requests_running 0\n"));
        assert!(!is_vllm_metrics("ok"));
        assert!(!is_vllm_metrics("# HELP vllm:num_requests_running x\nvllm:num_requests_running_other 1\n"));
        assert!(!is_vllm_metrics("<html>Not Found</html>"));
    }

    #[test]
    fn parses_vllm_metrics_text() {
        let text = "# HELP vllm:num_requests_waiting x\n# TYPE vllm:num_requests_waiting gauge\n\
vllm:num_requests_waiting{model_name=\"m\"} 3.0\nvllm:num_requests_running{model_name=\"m\"} 8\n\
vllm:kv_cache_usage_perc{model_name=\"m\"} 0.42\nvllm:request_success_total{finished_reason=\"stop\",model_name=\"m\"} 10\n\
vllm:request_success_total{finished_reason=\"length\",model_name=\"m\"} 5\nvllm:other 1\ngarbage\n";
        let s = parse_vllm_metrics(text);
        assert_eq!(
            s,
            Scrape { waiting: 3.0, running: 8.0, kv_cache_usage: 0.42, finished: 15.0, ..Scrape::default() }
        );
        let h = parse_vllm_metrics(
            "vllm:time_to_first_token_seconds_sum{model_name=\"m\"} 1.5\nvllm:time_to_first_token_seconds_count{model_name=\"m\"} 6\nvllm:time_to_first_token_seconds_bucket{le=\"0.1\"} 2\n",
        );
        assert_eq!((h.ttft_sum, h.ttft_count), (1.5, 6.0));
    }

    #[test]
    fn in_flight_is_the_pool_wide_total_plus_what_is_not_flushed() {
        // Replica A admitted 5 whose ends reached replica B: the total is 0 once both flushed,
        // whatever each replica's own balance (A +5, B -5).
        assert_eq!(in_flight_view(Some(0), 0, 5, None, 0), 0);
        assert_eq!(in_flight_view(Some(0), 0, -5, None, 0), 0);
        // Admitted here since the last flush: counted at once.
        assert_eq!(in_flight_view(Some(3), 2, 7, None, 2), 5);
        // Below 0 (leased admissions reported after they ended): 0.
        assert_eq!(in_flight_view(Some(-4), 1, 0, None, 0), 0);
        // Redis not reached lately: the replica's own balance.
        assert_eq!(in_flight_view(None, 2, 7, None, 0), 7);
        // Fresh metrics cap it: vLLM's bound plus the admissions not yet flushed.
        assert_eq!(in_flight_view(Some(40), 1, 0, Some(10), 1), 11);
        assert_eq!(in_flight_view(Some(i64::MAX), i64::MAX, 0, Some(u64::MAX), u64::MAX), i64::MAX as u64);
    }

    #[test]
    fn the_bound_counts_what_vllm_holds_and_what_may_not_have_been_reported() {
        assert_eq!(in_flight_bound(3.0, 2.0, 0.0, 0.0), 5);
        assert_eq!(in_flight_bound(0.0, 0.0, 0.0, 0.0), 0, "idle");
        assert_eq!(in_flight_bound(1.0, 0.0, 2.5, 4.0), 8);
        assert_eq!(in_flight_bound(-1.0, f64::NAN, 0.0, 0.0), 0);
        assert_eq!(report_lag(Duration::from_millis(100)), Duration::from_secs(5));
        assert_eq!(report_lag(Duration::from_secs(2)), Duration::from_secs(8));
        assert_eq!(arrival_lag(Duration::from_secs(5)), Duration::from_secs(20));
        assert_eq!(arrival_lag(Duration::from_secs(40)), Duration::from_secs(40));
    }

    #[test]
    fn growth_over_a_window() {
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        let samples: VecDeque<_> =
            [(at(0), 10.0), (at(1000), 12.0), (at(2000), 15.0), (at(3000), 15.0)].into_iter().collect();
        assert_eq!(growth(&samples, at(3000), Duration::from_millis(1000)), 0.0);
        assert_eq!(growth(&samples, at(3000), Duration::from_millis(1500)), 3.0);
        assert_eq!(growth(&samples, at(3000), Duration::from_secs(60)), 5.0, "from the oldest");
        assert_eq!(growth(&VecDeque::new(), at(0), Duration::from_secs(1)), 0.0);
        let reset: VecDeque<_> = [(at(0), 50.0), (at(1000), 2.0)].into_iter().collect();
        assert_eq!(growth(&reset, at(1000), Duration::from_secs(5)), 0.0, "a restarted vLLM");
    }

    #[test]
    fn smoothing() {
        assert_eq!(smooth_rate(None, 10.0, 0.3), 10.0);
        assert!((smooth_rate(Some(10.0), 20.0, 0.5) - 15.0).abs() < 1e-9);
    }
}
