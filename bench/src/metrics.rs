//! Per-request outcomes, error classes and per-point aggregation
//! (hdrhistogram, microsecond resolution, 3 significant digits).
//!
//! Latency metrics are aggregated over successful (`ok`) requests only, as
//! in vLLM's `bench serve`:
//! * **TTFT**: request send (including connection acquisition) → first
//!   content-token event;
//! * **ITL**: every gap between consecutive content-token events (events
//!   that arrive in the same read share a timestamp, giving a 0 gap);
//! * **TPOT**: `(e2e - ttft) / (output_tokens - 1)`, only when
//!   `output_tokens > 1`;
//! * **E2E**: request send → end of the response body.
//!
//! Output tokens come from the final `usage` chunk (`completion_tokens`);
//! when the server sends no usage the number of content events is used and
//! prompt tokens fall back to the prompt's word count.

use crate::error::BenchError;
use hdrhistogram::Histogram;
use serde::Serialize;
use std::collections::BTreeMap;
use std::time::Duration;

/// Outcome class of one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorClass {
    /// 2xx response streamed to `data: [DONE]`.
    Ok,
    /// HTTP 429 whose `error.code` is not an overload code (quota / rate limit).
    RateLimitedQuota,
    /// HTTP 429 whose `error.code` is `overloaded` or contains `overload`.
    RateLimitedOverload,
    /// Any other non-2xx status below 500 (including 1xx/3xx).
    Http4xx,
    /// HTTP 5xx.
    Http5xx,
    /// The per-request timeout (`--timeout-s`) expired.
    Timeout,
    /// Connecting or sending failed before response headers arrived.
    Connection,
    /// A 2xx stream ended (or broke) without `data: [DONE]`, or carried an
    /// in-band `{"error": ...}` event.
    StreamTruncated,
}

impl ErrorClass {
    /// All classes, in report order.
    pub const ALL: [ErrorClass; 8] = [
        ErrorClass::Ok,
        ErrorClass::RateLimitedQuota,
        ErrorClass::RateLimitedOverload,
        ErrorClass::Http4xx,
        ErrorClass::Http5xx,
        ErrorClass::Timeout,
        ErrorClass::Connection,
        ErrorClass::StreamTruncated,
    ];

    /// The snake_case name used in JSON/CSV.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorClass::Ok => "ok",
            ErrorClass::RateLimitedQuota => "rate_limited_quota",
            ErrorClass::RateLimitedOverload => "rate_limited_overload",
            ErrorClass::Http4xx => "http_4xx",
            ErrorClass::Http5xx => "http_5xx",
            ErrorClass::Timeout => "timeout",
            ErrorClass::Connection => "connection",
            ErrorClass::StreamTruncated => "stream_truncated",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// Classifies a non-2xx HTTP status (and for 429 its body).
///
/// 429 rule: the body is parsed as an OpenAI error
/// `{"error": {"code": ..., "type": ...}}`. If `error.code` is a string
/// equal to or containing `overload` (case-insensitive) the request is
/// [`ErrorClass::RateLimitedOverload`]; when `code` is absent or null,
/// `error.type` is checked the same way. Anything else (other codes,
/// numeric codes, unparseable body) is [`ErrorClass::RateLimitedQuota`].
pub fn classify_status(status: u16, body: &[u8]) -> ErrorClass {
    match status {
        200..=299 => ErrorClass::Ok,
        429 => {
            if is_overload_body(body) {
                ErrorClass::RateLimitedOverload
            } else {
                ErrorClass::RateLimitedQuota
            }
        }
        500..=599 => ErrorClass::Http5xx,
        _ => ErrorClass::Http4xx,
    }
}

fn is_overload_body(body: &[u8]) -> bool {
    #[derive(serde::Deserialize)]
    struct Body {
        error: Option<Inner>,
    }
    #[derive(serde::Deserialize)]
    struct Inner {
        #[serde(default)]
        code: Option<serde_json::Value>,
        #[serde(default, rename = "type")]
        kind: Option<serde_json::Value>,
    }
    let Ok(Body { error: Some(inner) }) = serde_json::from_slice::<Body>(body) else {
        return false;
    };
    let says_overload =
        |v: &serde_json::Value| v.as_str().is_some_and(|s| s.to_ascii_lowercase().contains("overload"));
    match inner.code {
        Some(serde_json::Value::Null) | None => inner.kind.as_ref().is_some_and(says_overload),
        Some(code) => says_overload(&code),
    }
}

/// Everything measured about one request.
#[derive(Debug, Clone)]
pub struct RequestOutcome {
    /// Outcome class.
    pub class: ErrorClass,
    /// HTTP status, when response headers arrived.
    pub status: Option<u16>,
    /// Send → first content token.
    pub ttft: Option<Duration>,
    /// Send → end of body (or failure).
    pub e2e: Duration,
    /// Inter-token gaps in microseconds, in arrival order.
    pub itl_us: Vec<u64>,
    /// Prompt tokens (usage, or the prompt's word count when absent).
    pub prompt_tokens: u64,
    /// Completion tokens (usage, or content events when absent).
    pub completion_tokens: u64,
    /// Whether the stream carried a `usage` object.
    pub usage_reported: bool,
    /// SSE events that could not be parsed.
    pub sse_parse_errors: u64,
    /// The gateway's `x-gateway-queue-wait-ms` response header: how long the request waited in
    /// its flow-control queue (None when absent).
    pub queue_wait_ms: Option<u64>,
}

impl RequestOutcome {
    /// An outcome with no timing data (failures before any token).
    pub fn failed(class: ErrorClass, status: Option<u16>, e2e: Duration) -> Self {
        Self {
            class,
            status,
            ttft: None,
            e2e,
            itl_us: Vec::new(),
            prompt_tokens: 0,
            completion_tokens: 0,
            usage_reported: false,
            sse_parse_errors: 0,
            queue_wait_ms: None,
        }
    }

    /// TPOT = (e2e − ttft) / (output_tokens − 1), if defined.
    pub fn tpot(&self) -> Option<Duration> {
        let ttft = self.ttft?;
        if self.completion_tokens < 2 {
            return None;
        }
        let n = u32::try_from(self.completion_tokens - 1).ok()?;
        Some(self.e2e.saturating_sub(ttft) / n)
    }
}

/// Highest latency tracked by the histograms: 24 h in microseconds.
pub const MAX_TRACKED_US: u64 = 86_400_000_000;

/// A latency histogram in microseconds with an exact running sum.
#[derive(Debug, Clone)]
pub struct LatencyHistogram {
    hist: Histogram<u64>,
    sum_us: u128,
}

impl LatencyHistogram {
    /// Creates a histogram tracking 1 µs ..= 24 h with 3 significant digits
    /// (larger values are clamped to 24 h).
    pub fn new() -> Result<Self, BenchError> {
        let hist = Histogram::new_with_bounds(1, MAX_TRACKED_US, 3)
            .map_err(|e| BenchError::Histogram(e.to_string()))?;
        Ok(Self { hist, sum_us: 0 })
    }

    /// Records one value in microseconds.
    pub fn record_us(&mut self, us: u64) {
        self.hist.saturating_record(us);
        self.sum_us += u128::from(us);
    }

    /// Records one duration (microsecond resolution).
    pub fn record(&mut self, d: Duration) {
        self.record_us(u64::try_from(d.as_micros()).unwrap_or(u64::MAX));
    }

    /// Number of recorded values.
    pub fn count(&self) -> u64 {
        self.hist.len()
    }

    /// Value at quantile `q` (0..=1) in milliseconds, `None` when empty.
    pub fn quantile_ms(&self, q: f64) -> Option<f64> {
        (self.count() > 0).then(|| self.hist.value_at_quantile(q) as f64 / 1000.0)
    }

    /// Summary statistics in milliseconds.
    pub fn summary(&self) -> LatencySummary {
        let count = self.count();
        let mean_ms = (count > 0).then(|| self.sum_us as f64 / count as f64 / 1000.0);
        LatencySummary {
            count,
            mean_ms,
            p50_ms: self.quantile_ms(0.50),
            p90_ms: self.quantile_ms(0.90),
            p99_ms: self.quantile_ms(0.99),
            max_ms: (count > 0).then(|| self.hist.max() as f64 / 1000.0),
        }
    }
}

/// Latency summary in milliseconds; every statistic is `null` when no value
/// was recorded. Percentiles are hdrhistogram values (≤ 0.1 % relative error).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, serde::Deserialize)]
pub struct LatencySummary {
    /// Number of samples.
    pub count: u64,
    /// Exact arithmetic mean (ms).
    pub mean_ms: Option<f64>,
    /// Median (ms).
    pub p50_ms: Option<f64>,
    /// 90th percentile (ms).
    pub p90_ms: Option<f64>,
    /// 99th percentile (ms).
    pub p99_ms: Option<f64>,
    /// Maximum (ms).
    pub max_ms: Option<f64>,
}

/// Count of requests per [`ErrorClass`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct ClassCounts {
    /// `ok`.
    pub ok: u64,
    /// `rate_limited_quota`.
    pub rate_limited_quota: u64,
    /// `rate_limited_overload`.
    pub rate_limited_overload: u64,
    /// `http_4xx`.
    pub http_4xx: u64,
    /// `http_5xx`.
    pub http_5xx: u64,
    /// `timeout`.
    pub timeout: u64,
    /// `connection`.
    pub connection: u64,
    /// `stream_truncated`.
    pub stream_truncated: u64,
}

impl ClassCounts {
    fn from_array(a: &[u64; 8]) -> Self {
        let [ok, rate_limited_quota, rate_limited_overload, http_4xx, http_5xx, timeout, connection, stream_truncated] =
            *a;
        Self {
            ok,
            rate_limited_quota,
            rate_limited_overload,
            http_4xx,
            http_5xx,
            timeout,
            connection,
            stream_truncated,
        }
    }

    /// Count for one class.
    pub fn get(&self, class: ErrorClass) -> u64 {
        match class {
            ErrorClass::Ok => self.ok,
            ErrorClass::RateLimitedQuota => self.rate_limited_quota,
            ErrorClass::RateLimitedOverload => self.rate_limited_overload,
            ErrorClass::Http4xx => self.http_4xx,
            ErrorClass::Http5xx => self.http_5xx,
            ErrorClass::Timeout => self.timeout,
            ErrorClass::Connection => self.connection,
            ErrorClass::StreamTruncated => self.stream_truncated,
        }
    }

    /// Sum over all classes (= requests sent).
    pub fn total(&self) -> u64 {
        ErrorClass::ALL.iter().map(|c| self.get(*c)).sum()
    }
}

/// Accumulates request outcomes of one benchmark point.
#[derive(Debug, Clone)]
pub struct Collector {
    classes: [u64; 8],
    status_codes: BTreeMap<u16, u64>,
    ttft: LatencyHistogram,
    itl: LatencyHistogram,
    tpot: LatencyHistogram,
    e2e: LatencyHistogram,
    prompt_tokens: u64,
    completion_tokens: u64,
    without_usage: u64,
    sse_parse_errors: u64,
}

impl Collector {
    /// Creates an empty collector.
    pub fn new() -> Result<Self, BenchError> {
        Ok(Self {
            classes: [0; 8],
            status_codes: BTreeMap::new(),
            ttft: LatencyHistogram::new()?,
            itl: LatencyHistogram::new()?,
            tpot: LatencyHistogram::new()?,
            e2e: LatencyHistogram::new()?,
            prompt_tokens: 0,
            completion_tokens: 0,
            without_usage: 0,
            sse_parse_errors: 0,
        })
    }

    /// Adds one request outcome.
    pub fn record(&mut self, o: &RequestOutcome) {
        if let Some(c) = self.classes.get_mut(o.class.index()) {
            *c += 1;
        }
        if let Some(s) = o.status {
            *self.status_codes.entry(s).or_insert(0) += 1;
        }
        self.sse_parse_errors += o.sse_parse_errors;
        if o.class != ErrorClass::Ok {
            return;
        }
        self.prompt_tokens += o.prompt_tokens;
        self.completion_tokens += o.completion_tokens;
        if !o.usage_reported {
            self.without_usage += 1;
        }
        if let Some(t) = o.ttft {
            self.ttft.record(t);
        }
        for &gap in &o.itl_us {
            self.itl.record_us(gap);
        }
        if let Some(t) = o.tpot() {
            self.tpot.record(t);
        }
        self.e2e.record(o.e2e);
    }

    /// Requests recorded so far.
    pub fn sent(&self) -> u64 {
        self.classes.iter().sum()
    }

    /// Final statistics, given the point's wall-clock duration.
    pub fn finish(&self, duration: Duration) -> PointStats {
        let classes = ClassCounts::from_array(&self.classes);
        let sent = classes.total();
        let completed = classes.ok;
        let failed = sent - completed;
        let secs = duration.as_secs_f64();
        let per_s = |v: u64| if secs > 0.0 { v as f64 / secs } else { 0.0 };
        let frac = |v: u64| {
            if sent > 0 {
                v as f64 / sent as f64
            } else {
                0.0
            }
        };
        let limited = classes.rate_limited_quota + classes.rate_limited_overload;
        PointStats {
            duration_s: secs,
            sent,
            completed,
            failed,
            request_throughput: per_s(completed),
            output_throughput: per_s(self.completion_tokens),
            total_token_throughput: per_s(self.prompt_tokens + self.completion_tokens),
            success_rate: frac(completed),
            rate_limited_rate: frac(limited),
            rate_limited_quota_rate: frac(classes.rate_limited_quota),
            rate_limited_overload_rate: frac(classes.rate_limited_overload),
            total_prompt_tokens: self.prompt_tokens,
            total_completion_tokens: self.completion_tokens,
            requests_without_usage: self.without_usage,
            sse_parse_errors: self.sse_parse_errors,
            errors: classes,
            status_codes: self.status_codes.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
            ttft_ms: self.ttft.summary(),
            itl_ms: self.itl.summary(),
            tpot_ms: self.tpot.summary(),
            e2e_ms: self.e2e.summary(),
        }
    }
}

/// Aggregate results of one benchmark point. Rates are per second of
/// `duration_s`; fractions are of `sent`; token totals and latencies cover
/// successful requests only.
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
pub struct PointStats {
    /// Wall-clock seconds from the first measured send to the last completion.
    pub duration_s: f64,
    /// Measured requests dispatched (warmup excluded) = completed + failed.
    pub sent: u64,
    /// Requests with class `ok`.
    pub completed: u64,
    /// Requests with any other class.
    pub failed: u64,
    /// Completed requests per second.
    pub request_throughput: f64,
    /// Completion tokens per second.
    pub output_throughput: f64,
    /// Prompt + completion tokens per second.
    pub total_token_throughput: f64,
    /// completed / sent (0..=1).
    pub success_rate: f64,
    /// All 429s / sent.
    pub rate_limited_rate: f64,
    /// Quota 429s / sent.
    pub rate_limited_quota_rate: f64,
    /// Overload 429s / sent.
    pub rate_limited_overload_rate: f64,
    /// Prompt tokens of completed requests.
    pub total_prompt_tokens: u64,
    /// Completion tokens of completed requests.
    pub total_completion_tokens: u64,
    /// Completed requests whose stream had no `usage` chunk.
    pub requests_without_usage: u64,
    /// SSE events that were neither JSON nor `[DONE]`.
    pub sse_parse_errors: u64,
    /// Requests per outcome class.
    pub errors: ClassCounts,
    /// Requests per HTTP status code (string keys).
    pub status_codes: BTreeMap<String, u64>,
    /// Time to first token (ms).
    pub ttft_ms: LatencySummary,
    /// Inter-token latency (ms).
    pub itl_ms: LatencySummary,
    /// Time per output token (ms).
    pub tpot_ms: LatencySummary,
    /// End-to-end latency (ms).
    pub e2e_ms: LatencySummary,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_of_uniform_data() {
        let mut h = LatencyHistogram::new().unwrap();
        for ms in 1..=1000u64 {
            h.record(Duration::from_millis(ms));
        }
        let s = h.summary();
        assert_eq!(s.count, 1000);
        let close = |a: Option<f64>, b: f64| (a.unwrap() - b).abs() <= b * 0.001 + 1e-9;
        assert!(close(s.mean_ms, 500.5), "{s:?}");
        assert!(close(s.p50_ms, 500.0), "{s:?}");
        assert!(close(s.p90_ms, 900.0), "{s:?}");
        assert!(close(s.p99_ms, 990.0), "{s:?}");
        assert!(close(s.max_ms, 1000.0), "{s:?}");
        assert!(s.p50_ms <= s.p90_ms && s.p90_ms <= s.p99_ms);
    }

    #[test]
    fn percentiles_microsecond_resolution_and_empty() {
        let mut h = LatencyHistogram::new().unwrap();
        for _ in 0..99 {
            h.record_us(250);
        }
        h.record_us(40_000);
        let s = h.summary();
        assert_eq!(s.p50_ms, Some(0.25));
        assert_eq!(s.p99_ms, Some(0.25));
        assert!((s.max_ms.unwrap() - 40.0).abs() < 0.05);
        let empty = LatencyHistogram::new().unwrap().summary();
        assert_eq!(empty.count, 0);
        assert_eq!(empty.p99_ms, None);
        assert_eq!(empty.mean_ms, None);
    }

    #[test]
    fn classify_429_bodies() {
        let c = |b: &str| classify_status(429, b.as_bytes());
        assert_eq!(c(r#"{"error":{"code":"overloaded","message":"busy"}}"#), ErrorClass::RateLimitedOverload);
        assert_eq!(c(r#"{"error":{"code":"upstream_overload"}}"#), ErrorClass::RateLimitedOverload);
        assert_eq!(c(r#"{"error":{"code":"OVERLOADED"}}"#), ErrorClass::RateLimitedOverload);
        assert_eq!(
            c(r#"{"error":{"code":null,"type":"overloaded_error"}}"#),
            ErrorClass::RateLimitedOverload
        );
        assert_eq!(c(r#"{"error":{"code":"rate_limit_exceeded"}}"#), ErrorClass::RateLimitedQuota);
        assert_eq!(
            c(r#"{"error":{"code":"tokens_quota_exceeded","type":"overloaded"}}"#),
            ErrorClass::RateLimitedQuota
        );
        assert_eq!(c(r#"{"error":{"code":429}}"#), ErrorClass::RateLimitedQuota);
        assert_eq!(c(r#"{"error":{"message":"slow down"}}"#), ErrorClass::RateLimitedQuota);
        assert_eq!(c("too many requests"), ErrorClass::RateLimitedQuota);
        assert_eq!(c(""), ErrorClass::RateLimitedQuota);
        assert_eq!(classify_status(400, b""), ErrorClass::Http4xx);
        assert_eq!(classify_status(404, b""), ErrorClass::Http4xx);
        assert_eq!(classify_status(302, b""), ErrorClass::Http4xx);
        assert_eq!(classify_status(503, br#"{"error":{"code":"overloaded"}}"#), ErrorClass::Http5xx);
        assert_eq!(classify_status(200, b""), ErrorClass::Ok);
    }

    #[test]
    fn collector_accounting_and_tpot() {
        let mut c = Collector::new().unwrap();
        let ok = RequestOutcome {
            class: ErrorClass::Ok,
            status: Some(200),
            ttft: Some(Duration::from_millis(100)),
            e2e: Duration::from_millis(1000),
            itl_us: vec![100_000; 9],
            prompt_tokens: 10,
            completion_tokens: 10,
            usage_reported: true,
            sse_parse_errors: 0,
            queue_wait_ms: None,
        };
        assert_eq!(ok.tpot(), Some(Duration::from_millis(100)));
        c.record(&ok);
        c.record(&ok);
        c.record(&RequestOutcome::failed(
            ErrorClass::RateLimitedOverload,
            Some(429),
            Duration::from_millis(1),
        ));
        c.record(&RequestOutcome::failed(ErrorClass::Timeout, None, Duration::from_secs(5)));
        let s = c.finish(Duration::from_secs(2));
        assert_eq!((s.sent, s.completed, s.failed), (4, 2, 2));
        assert_eq!(s.errors.total(), 4);
        assert_eq!(s.request_throughput, 1.0);
        assert_eq!(s.output_throughput, 10.0);
        assert_eq!(s.total_token_throughput, 20.0);
        assert_eq!(s.success_rate, 0.5);
        assert_eq!(s.rate_limited_rate, 0.25);
        assert_eq!(s.rate_limited_overload_rate, 0.25);
        assert_eq!(s.rate_limited_quota_rate, 0.0);
        assert_eq!(s.status_codes.get("200"), Some(&2));
        assert_eq!(s.status_codes.get("429"), Some(&1));
        assert_eq!(s.itl_ms.count, 18);
        assert_eq!(s.tpot_ms.count, 2);
        assert_eq!(s.e2e_ms.count, 2);
        assert!((s.tpot_ms.p50_ms.unwrap() - 100.0).abs() < 0.1);
    }
}
