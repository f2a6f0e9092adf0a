//! Prometheus metrics under vLLM's names, rendered in the text exposition format 0.0.4.
//!
//! Every vLLM series carries the label `model_name` (the first served name):
//!
//! | metric | type | meaning here |
//! |---|---|---|
//! | `vllm:num_requests_running` | gauge | requests holding one of the `--max-num-seqs` slots |
//! | `vllm:num_requests_waiting` | gauge | requests queued for a slot |
//! | `vllm:kv_cache_usage_perc` | gauge | fixed engine: `running / max_num_seqs`; batched engine: KV blocks held by running requests / `--num-gpu-blocks` (cached blocks of finished requests are free, as in vLLM); 0..1 |
//! | `vllm:prefix_cache_queries_total` | counter | batched engine only: prompt tokens looked up in the prefix cache (vLLM V1) |
//! | `vllm:prefix_cache_hits_total` | counter | batched engine only: prompt tokens found there (vLLM V1) |
//! | `vllm:time_to_first_token_seconds` | histogram | arrival to first token (queueing included, as vLLM), vLLM's buckets |
//! | `vllm:prompt_tokens_total` | counter | prompt tokens of requests that produced a first token |
//! | `vllm:generation_tokens_total` | counter | output tokens actually sent (streams cut short count what was sent) |
//! | `vllm:request_success_total` | counter | finished requests by `finished_reason`: `stop`, `length`, `abort` (client gone or injected mid-stream failure) |
//!
//! plus the simulator's own `vllm_sim:requests_received_total` (no labels): every request
//! received on `/v1/chat/completions`, `/v1/completions` and `/v1/responses`, rejected ones included.
//!
//! `GET /metrics` serves them all; `GET /metrics/` only the samples named by the query's `name[]`
//! parameters ([`restrict_to_names`]), as vLLM's mount of prometheus_client's app does.

use std::fmt::{self, Write as _};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::engine::EngineSnapshot;
use crate::queue::QueueSnapshot;
use crate::tokens::FinishReason;

/// Upper bounds (seconds) of vLLM's `vllm:time_to_first_token_seconds` buckets.
pub const TTFT_BUCKETS: [f64; 22] = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
    80.0, 160.0, 640.0, 2560.0,
];

/// A histogram of durations with fixed upper bounds in seconds.
#[derive(Debug)]
struct Histogram {
    bounds_ns: Vec<u64>,
    /// Non-cumulative counts; the last slot is `+Inf`.
    counts: Vec<AtomicU64>,
    sum_ns: AtomicU64,
}

impl Histogram {
    fn new(bounds: &[f64]) -> Self {
        Self {
            bounds_ns: bounds.iter().map(|b| (b * 1e9).round() as u64).collect(),
            counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_ns: AtomicU64::new(0),
        }
    }

    fn observe(&self, value: Duration) {
        let ns = u64::try_from(value.as_nanos()).unwrap_or(u64::MAX);
        let slot = self.bounds_ns.partition_point(|&b| b < ns);
        if let Some(count) = self.counts.get(slot) {
            count.fetch_add(1, Ordering::Relaxed);
        }
        self.sum_ns.fetch_add(ns, Ordering::Relaxed);
    }
}

/// The server's counters and histograms; the gauges come from the queue when rendering.
#[derive(Debug)]
pub struct Metrics {
    model_label: String,
    max_num_seqs: u32,
    ttft: Histogram,
    prompt_tokens: AtomicU64,
    generation_tokens: AtomicU64,
    finished_stop: AtomicU64,
    finished_length: AtomicU64,
    finished_abort: AtomicU64,
    received: AtomicU64,
}

impl Metrics {
    /// Metrics labelled `model_name="<model_name>"`, with `kv_cache_usage_perc` relative to
    /// `max_num_seqs` slots.
    pub fn new(model_name: &str, max_num_seqs: u32) -> Self {
        Self {
            model_label: escape_label(model_name),
            max_num_seqs,
            ttft: Histogram::new(&TTFT_BUCKETS),
            prompt_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            finished_stop: AtomicU64::new(0),
            finished_length: AtomicU64::new(0),
            finished_abort: AtomicU64::new(0),
            received: AtomicU64::new(0),
        }
    }

    /// Counts one request received on an inference path (`vllm_sim:requests_received_total`).
    pub fn request_received(&self) {
        self.received.fetch_add(1, Ordering::Relaxed);
    }

    /// The Prometheus text exposition of all metrics, with the queue gauges from `queue`
    /// (the fixed engine: KV-cache use is `running / max_num_seqs`, no prefix-cache counters).
    pub fn render(&self, queue: QueueSnapshot) -> String {
        let usage =
            if self.max_num_seqs == 0 { 0.0 } else { queue.running as f64 / f64::from(self.max_num_seqs) };
        self.render_gauges(queue.running, queue.waiting, usage, None)
    }

    /// The Prometheus text exposition of all metrics with the batched engine's gauges and
    /// prefix-cache counters.
    pub fn render_engine(&self, engine: EngineSnapshot) -> String {
        self.render_gauges(
            engine.running,
            engine.waiting,
            engine.kv_cache_usage,
            Some((engine.prefix_cache_queries, engine.prefix_cache_hits)),
        )
    }

    fn render_gauges(&self, running: u64, waiting: u64, usage: f64, prefix: Option<(u64, u64)>) -> String {
        let mut out = String::with_capacity(4096);
        // Writing into a String cannot fail.
        let _ = self.write_to(&mut out, running, waiting, usage, prefix);
        out
    }

    fn write_to(
        &self,
        out: &mut String,
        running: u64,
        waiting: u64,
        usage: f64,
        prefix: Option<(u64, u64)>,
    ) -> fmt::Result {
        let label = format!("model_name=\"{}\"", self.model_label);
        let header = |out: &mut String, name: &str, kind: &str, help: &str| {
            writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}")
        };
        header(out, "vllm:num_requests_running", "gauge", "Number of requests in model execution batches.")?;
        writeln!(out, "vllm:num_requests_running{{{label}}} {running}")?;
        header(out, "vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.")?;
        writeln!(out, "vllm:num_requests_waiting{{{label}}} {waiting}")?;
        header(out, "vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.")?;
        writeln!(out, "vllm:kv_cache_usage_perc{{{label}}} {usage:?}")?;
        if let Some((queries, hits)) = prefix {
            for (name, help, value) in [
                (
                    "vllm:prefix_cache_queries_total",
                    "Prefix cache queries, in terms of number of queried tokens.",
                    queries,
                ),
                (
                    "vllm:prefix_cache_hits_total",
                    "Prefix cache hits, in terms of number of cached tokens.",
                    hits,
                ),
            ] {
                header(out, name, "counter", help)?;
                writeln!(out, "{name}{{{label}}} {value}")?;
            }
        }

        let name = "vllm:time_to_first_token_seconds";
        header(out, name, "histogram", "Histogram of time to first token in seconds.")?;
        let mut cumulative = 0u64;
        let bounds = TTFT_BUCKETS.iter().map(|b| format!("{b:?}")).chain(["+Inf".to_owned()]);
        for (le, count) in bounds.zip(&self.ttft.counts) {
            cumulative += count.load(Ordering::Relaxed);
            writeln!(out, "{name}_bucket{{{label},le=\"{le}\"}} {cumulative}")?;
        }
        let sum = self.ttft.sum_ns.load(Ordering::Relaxed) as f64 / 1e9;
        writeln!(out, "{name}_sum{{{label}}} {sum:?}")?;
        writeln!(out, "{name}_count{{{label}}} {cumulative}")?;

        for (name, help, value) in [
            ("vllm:prompt_tokens_total", "Number of prefill tokens processed.", &self.prompt_tokens),
            (
                "vllm:generation_tokens_total",
                "Number of generation tokens processed.",
                &self.generation_tokens,
            ),
        ] {
            header(out, name, "counter", help)?;
            writeln!(out, "{name}{{{label}}} {}", value.load(Ordering::Relaxed))?;
        }
        let name = "vllm:request_success_total";
        header(out, name, "counter", "Count of successfully processed requests.")?;
        for (reason, value) in [
            ("stop", &self.finished_stop),
            ("length", &self.finished_length),
            ("abort", &self.finished_abort),
        ] {
            let value = value.load(Ordering::Relaxed);
            writeln!(out, "{name}{{finished_reason=\"{reason}\",{label}}} {value}")?;
        }
        let name = "vllm_sim:requests_received_total";
        header(
            out,
            name,
            "counter",
            "Requests received on the inference endpoints, rejected ones included.",
        )?;
        writeln!(out, "{name} {}", self.received.load(Ordering::Relaxed))
    }
}

/// Escapes a Prometheus label value (`\`, `"` and newlines).
fn escape_label(value: &str) -> String {
    value.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

/// The metric side of one admitted-for-generation request.
///
/// Dropped before [`RequestTracker::finish`] (client gone, injected failure, shutdown),
/// it counts as `finished_reason="abort"`.
#[derive(Debug)]
pub struct RequestTracker {
    metrics: Arc<Metrics>,
    arrival: Instant,
    prompt_tokens: u64,
    first_token_seen: bool,
    finished: bool,
}

impl RequestTracker {
    /// Tracks a request that arrived at `arrival` with `prompt_tokens` prompt tokens.
    pub fn new(metrics: Arc<Metrics>, arrival: Instant, prompt_tokens: u64) -> Self {
        Self { metrics, arrival, prompt_tokens, first_token_seen: false, finished: false }
    }

    /// Records `n` output tokens as sent; the first call also records the time to first token
    /// and the prompt tokens (prefill done).
    pub fn tokens_sent(&mut self, n: u64) {
        if !self.first_token_seen {
            self.first_token_seen = true;
            self.metrics.ttft.observe(self.arrival.elapsed());
            self.metrics.prompt_tokens.fetch_add(self.prompt_tokens, Ordering::Relaxed);
        }
        self.metrics.generation_tokens.fetch_add(n, Ordering::Relaxed);
    }

    /// Records the request as finished with `reason`.
    pub fn finish(&mut self, reason: FinishReason) {
        self.finished = true;
        let counter = match reason {
            FinishReason::Stop => &self.metrics.finished_stop,
            FinishReason::Length => &self.metrics.finished_length,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

impl Drop for RequestTracker {
    fn drop(&mut self) {
        if !self.finished {
            self.metrics.finished_abort.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// The exposition `text` with only the samples named by the `name[]` parameters of `query` (a
/// URL query string, percent-encoded or not), and the `# HELP`/`# TYPE` lines of their families:
/// prometheus_client's `restricted_registry`, which vLLM's `/metrics/` answers with. A query
/// without `name[]` keeps everything. A sample's name is the text before its `{` or space
/// (`vllm:request_success_total`, `vllm:time_to_first_token_seconds_sum`).
pub fn restrict_to_names(text: &str, query: &str) -> String {
    let names: Vec<String> = form_urlencoded::parse(query.as_bytes())
        .filter(|(key, _)| key == "name[]")
        .map(|(_, value)| value.into_owned())
        .collect();
    if names.is_empty() {
        return text.to_owned();
    }
    let kept = |name: &str| names.iter().any(|n| n == name);
    let family_kept = |family: &str| {
        names.iter().any(|n| {
            n.strip_prefix(family).is_some_and(|rest| {
                matches!(rest, "" | "_total" | "_sum" | "_count" | "_bucket" | "_created")
            })
        })
    };
    let mut out = String::new();
    for line in text.lines() {
        let keep = match line.strip_prefix("# HELP ").or_else(|| line.strip_prefix("# TYPE ")) {
            Some(rest) => family_kept(rest.split(' ').next().unwrap_or_default()),
            None => kept(line.split(['{', ' ']).next().unwrap_or_default()),
        };
        if keep {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn value(text: &str, series: &str) -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(series).and_then(|rest| rest.strip_prefix(' ')))
            .unwrap_or_else(|| panic!("{series} missing in\n{text}"))
            .parse()
            .unwrap()
    }

    #[test]
    fn metrics_slash_keeps_only_the_named_samples_and_their_families_headers() {
        let text = "# HELP vllm:num_requests_running r\n# TYPE vllm:num_requests_running gauge\n\
vllm:num_requests_running{model_name=\"m\"} 2\n# HELP vllm:num_requests_waiting w\n\
vllm:num_requests_waiting{model_name=\"m\"} 1\n# TYPE vllm:request_success counter\n\
vllm:request_success_total{finished_reason=\"stop\",model_name=\"m\"} 5\n\
# TYPE vllm:time_to_first_token_seconds histogram\n\
vllm:time_to_first_token_seconds_bucket{le=\"0.1\",model_name=\"m\"} 1\n\
vllm:time_to_first_token_seconds_sum{model_name=\"m\"} 0.5\nvllm_sim:requests_received_total 9\n";
        let query = "name%5B%5D=vllm%3Anum_requests_running&name[]=vllm:request_success_total\
&name%5B%5D=vllm%3Atime_to_first_token_seconds_sum&other=x";
        assert_eq!(
            restrict_to_names(text, query),
            "# HELP vllm:num_requests_running r\n# TYPE vllm:num_requests_running gauge\n\
vllm:num_requests_running{model_name=\"m\"} 2\n# TYPE vllm:request_success counter\n\
vllm:request_success_total{finished_reason=\"stop\",model_name=\"m\"} 5\n\
# TYPE vllm:time_to_first_token_seconds histogram\n\
vllm:time_to_first_token_seconds_sum{model_name=\"m\"} 0.5\n"
        );
        assert_eq!(restrict_to_names(text, ""), text);
        assert_eq!(restrict_to_names(text, "other=x"), text);
        assert_eq!(restrict_to_names(text, "name[]=vllm:nothing"), "");
    }

    #[test]
    fn render_has_vllm_names_and_counts() {
        let metrics = Arc::new(Metrics::new("m\"x", 4));
        metrics.request_received();
        let mut t = RequestTracker::new(metrics.clone(), Instant::now(), 10);
        t.tokens_sent(1);
        t.tokens_sent(2);
        t.finish(FinishReason::Length);
        drop(t);
        let mut aborted = RequestTracker::new(metrics.clone(), Instant::now(), 5);
        aborted.tokens_sent(1);
        drop(aborted);
        drop(RequestTracker::new(metrics.clone(), Instant::now(), 7));

        let text = metrics.render(QueueSnapshot { running: 1, waiting: 2 });
        let l = "model_name=\"m\\\"x\"";
        assert_eq!(value(&text, &format!("vllm:num_requests_running{{{l}}}")), 1.0);
        assert_eq!(value(&text, &format!("vllm:num_requests_waiting{{{l}}}")), 2.0);
        assert_eq!(value(&text, &format!("vllm:kv_cache_usage_perc{{{l}}}")), 0.25);
        assert_eq!(value(&text, &format!("vllm:prompt_tokens_total{{{l}}}")), 15.0);
        assert_eq!(value(&text, &format!("vllm:generation_tokens_total{{{l}}}")), 4.0);
        assert_eq!(
            value(&text, &format!("vllm:request_success_total{{finished_reason=\"length\",{l}}}")),
            1.0
        );
        assert_eq!(value(&text, &format!("vllm:request_success_total{{finished_reason=\"stop\",{l}}}")), 0.0);
        assert_eq!(
            value(&text, &format!("vllm:request_success_total{{finished_reason=\"abort\",{l}}}")),
            2.0
        );
        assert_eq!(value(&text, &format!("vllm:time_to_first_token_seconds_count{{{l}}}")), 2.0);
        assert_eq!(value(&text, &format!("vllm:time_to_first_token_seconds_bucket{{{l},le=\"+Inf\"}}")), 2.0);
        assert_eq!(
            value(&text, &format!("vllm:time_to_first_token_seconds_bucket{{{l},le=\"2560.0\"}}")),
            2.0
        );
        assert_eq!(value(&text, "vllm_sim:requests_received_total"), 1.0);
        assert!(text.contains("# TYPE vllm:time_to_first_token_seconds histogram"));
        assert!(text.contains("# TYPE vllm:prompt_tokens_total counter"));
        assert!(!text.contains("prefix_cache"), "the fixed engine has no prefix cache");
    }

    #[test]
    fn engine_render_has_kv_use_and_prefix_counters() {
        let metrics = Metrics::new("m", 4);
        let text = metrics.render_engine(EngineSnapshot {
            running: 3,
            waiting: 1,
            kv_cache_usage: 0.125,
            prefix_cache_queries: 100,
            prefix_cache_hits: 64,
        });
        let l = "model_name=\"m\"";
        assert_eq!(value(&text, &format!("vllm:num_requests_running{{{l}}}")), 3.0);
        assert_eq!(value(&text, &format!("vllm:num_requests_waiting{{{l}}}")), 1.0);
        assert_eq!(value(&text, &format!("vllm:kv_cache_usage_perc{{{l}}}")), 0.125);
        assert_eq!(value(&text, &format!("vllm:prefix_cache_queries_total{{{l}}}")), 100.0);
        assert_eq!(value(&text, &format!("vllm:prefix_cache_hits_total{{{l}}}")), 64.0);
        assert!(text.contains("# TYPE vllm:prefix_cache_hits_total counter"));
    }

    #[test]
    fn histogram_buckets_are_cumulative_with_inclusive_bounds() {
        let h = Histogram::new(&[0.001, 0.01]);
        h.observe(Duration::from_millis(1));
        h.observe(Duration::from_millis(5));
        h.observe(Duration::from_secs(1));
        let counts: Vec<u64> = h.counts.iter().map(|c| c.load(Ordering::Relaxed)).collect();
        assert_eq!(counts, [1, 1, 1]);
        assert_eq!(h.sum_ns.load(Ordering::Relaxed), 1_006_000_000);
    }
}
