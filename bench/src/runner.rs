//! Running benchmark points and sweeps.
//!
//! One point: optional warmup (`warmup` requests at the point's concurrency
//! cap, no pacing, results discarded, connections kept), then `num_prompts`
//! measured requests sent on the arrival schedule behind the concurrency
//! cap. With `duration` set, no request is *sent* after `duration` from the
//! point's start; requests in flight are awaited (bounded by the per-request
//! timeout). The point's duration runs from the first measured send to the
//! last completion, as in vLLM's `bench serve`.

use crate::arrivals::ArrivalGenerator;
use crate::capacity;
use crate::client::{RequestContext, Target};
use crate::config::{BenchConfig, Endpoint, LoadSpec};
use crate::error::BenchError;
use crate::metrics::{Collector, ErrorClass, PointStats};
use crate::progress::{Counters, Reporter};
use crate::report::SweepReport;
use crate::workload::{PreparedRequest, Workload};
use serde::Serialize;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio::time::Instant;

/// Everything needed to run one benchmark point.
#[derive(Debug, Clone)]
pub struct PointConfig {
    /// Where to send requests.
    pub target: Target,
    /// API path.
    pub endpoint: Endpoint,
    /// Bearer token, if any.
    pub api_key: Option<String>,
    /// Load shape.
    pub load: LoadSpec,
    /// Prepared requests; warmup uses the first `warmup`, measured requests
    /// continue from there, cycling.
    pub requests: Arc<[PreparedRequest]>,
    /// Measured requests to send.
    pub num_prompts: u64,
    /// Unmeasured requests sent first.
    pub warmup: u64,
    /// Optional bound on the sending phase.
    pub duration: Option<Duration>,
    /// Per-request timeout.
    pub timeout: Duration,
    /// Arrival-schedule seed.
    pub seed: u64,
    /// Print a progress line on stderr.
    pub progress: bool,
}

/// Results of one point: its load shape and statistics (flattened in JSON).
#[derive(Debug, Clone, Serialize)]
pub struct PointResult {
    /// Load shape.
    #[serde(flatten)]
    pub load: LoadSpec,
    /// Measured statistics.
    #[serde(flatten)]
    pub stats: PointStats,
    /// Every measured request, in the order they ended (`--output-requests`; not in the JSON
    /// report).
    #[serde(skip)]
    pub requests: Vec<RequestRecord>,
}

/// One measured request, as `--output-requests` writes it (one JSON object per line).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RequestRecord {
    /// Index of the point in the sweep.
    pub point: usize,
    /// When it was sent, in milliseconds after the point's first measured send.
    pub sent_ms: f64,
    /// HTTP status (None when no response headers arrived).
    pub status: Option<u16>,
    /// Outcome class (`ok`, `rate_limited_overload`, `timeout`, ...).
    pub class: &'static str,
    /// Time to the first content token, in milliseconds (successful streams).
    pub ttft_ms: Option<f64>,
    /// Time to the end of the response (or the failure), in milliseconds.
    pub e2e_ms: f64,
    /// Prompt tokens (usage).
    pub prompt_tokens: u64,
    /// Completion tokens (usage, or content events).
    pub completion_tokens: u64,
    /// The gateway's `x-gateway-queue-wait-ms`, when present.
    pub queue_wait_ms: Option<u64>,
}

fn request_at(reqs: &[PreparedRequest], i: u64) -> Option<PreparedRequest> {
    let n = u64::try_from(reqs.len()).ok().filter(|&n| n > 0)?;
    reqs.get(usize::try_from(i % n).ok()?).cloned()
}

/// Runs one benchmark point (must be called inside a Tokio runtime).
pub async fn run_point(cfg: &PointConfig) -> Result<PointResult, BenchError> {
    if cfg.requests.is_empty() {
        return Err(BenchError::InvalidArgument("no prepared requests".into()));
    }
    let ctx =
        Arc::new(RequestContext::new(&cfg.target, cfg.endpoint.path(), cfg.api_key.as_deref(), cfg.timeout)?);
    let closed = |_| BenchError::InvalidArgument("semaphore closed".into());

    if cfg.warmup > 0 {
        let cap = cfg.load.max_concurrency.map_or(cfg.warmup, u64::from).min(cfg.warmup);
        let sem = Arc::new(Semaphore::new(usize::try_from(cap).unwrap_or(1)));
        let mut set = JoinSet::new();
        for i in 0..cfg.warmup {
            let Some(req) = request_at(&cfg.requests, i) else {
                break;
            };
            let permit = sem.clone().acquire_owned().await.map_err(closed)?;
            let ctx = ctx.clone();
            set.spawn(async move {
                let _ = ctx.execute(&req).await;
                drop(permit);
            });
        }
        while set.join_next().await.is_some() {}
    }

    let collector = Arc::new(Mutex::new(Collector::new()?));
    let records = Arc::new(Mutex::new(Vec::new()));
    let counters = Arc::new(Counters::default());
    let reporter =
        cfg.progress.then(|| Reporter::start(cfg.load.label.clone(), cfg.num_prompts, counters.clone()));
    let sem =
        cfg.load.max_concurrency.map(|c| Arc::new(Semaphore::new(usize::try_from(c).unwrap_or(usize::MAX))));
    let mut arrivals =
        ArrivalGenerator::new(cfg.load.arrival_pattern(), cfg.seed).map_err(BenchError::InvalidArgument)?;

    let start = Instant::now();
    let deadline = cfg.duration.and_then(|d| start.checked_add(d));
    let mut set = JoinSet::new();
    for i in 0..cfg.num_prompts {
        let Some(at) = start.checked_add(arrivals.next_offset()) else {
            break;
        };
        if deadline.is_some_and(|d| at >= d) {
            break;
        }
        if at > Instant::now() {
            tokio::time::sleep_until(at).await;
        }
        let permit = match &sem {
            Some(s) => Some(s.clone().acquire_owned().await.map_err(closed)?),
            None => None,
        };
        if deadline.is_some_and(|d| Instant::now() >= d) {
            break;
        }
        let Some(req) = request_at(&cfg.requests, cfg.warmup + i) else {
            break;
        };
        counters.sent.fetch_add(1, Ordering::Relaxed);
        let (ctx, collector, counters, records) =
            (ctx.clone(), collector.clone(), counters.clone(), records.clone());
        let sent_ms = start.elapsed().as_secs_f64() * 1e3;
        set.spawn(async move {
            let outcome = ctx.execute(&req).await;
            drop(permit);
            let c = if outcome.class == ErrorClass::Ok { &counters.ok } else { &counters.failed };
            c.fetch_add(1, Ordering::Relaxed);
            collector.lock().unwrap_or_else(|e| e.into_inner()).record(&outcome);
            let record = RequestRecord {
                point: 0,
                sent_ms,
                status: outcome.status,
                class: outcome.class.as_str(),
                ttft_ms: outcome.ttft.map(|t| t.as_secs_f64() * 1e3),
                e2e_ms: outcome.e2e.as_secs_f64() * 1e3,
                prompt_tokens: outcome.prompt_tokens,
                completion_tokens: outcome.completion_tokens,
                queue_wait_ms: outcome.queue_wait_ms,
            };
            records.lock().unwrap_or_else(|e| e.into_inner()).push(record);
        });
        while set.try_join_next().is_some() {}
    }
    while set.join_next().await.is_some() {}
    let duration = start.elapsed();
    if let Some(r) = reporter {
        r.finish();
    }
    let stats = collector.lock().unwrap_or_else(|e| e.into_inner()).finish(duration);
    let requests = std::mem::take(&mut *records.lock().unwrap_or_else(|e| e.into_inner()));
    Ok(PointResult { load: cfg.load.clone(), stats, requests })
}

/// Runs every point of `cfg` in order and analyses the sweep (knee, SLO,
/// capacity). Must be called inside a Tokio runtime.
pub async fn run_sweep(cfg: &BenchConfig, progress: bool) -> Result<SweepReport, BenchError> {
    cfg.validate()?;
    let target = Target::parse(&cfg.base_url)?;
    let workload = Workload::load(&cfg.workload, cfg.endpoint, &cfg.model, cfg.include_usage)?;
    let points = cfg.points();
    let total = points.len();
    let mut results = Vec::with_capacity(total);
    for (i, load) in points.into_iter().enumerate() {
        let seed = cfg.seed.wrapping_add(i as u64);
        let requests = workload.requests_for_point(cfg.num_prompts.saturating_add(cfg.warmup), seed)?;
        let mut load = load;
        let label = load.label.clone();
        if progress {
            // Only the progress line carries the position in the sweep.
            load.label = format!("[{}/{total}] {label}", i + 1);
        }
        let pc = PointConfig {
            target: target.clone(),
            endpoint: cfg.endpoint,
            api_key: cfg.api_key.clone(),
            load,
            requests,
            num_prompts: cfg.num_prompts,
            warmup: cfg.warmup,
            duration: cfg.duration_s.and_then(|s| Duration::try_from_secs_f64(s).ok()),
            timeout: Duration::try_from_secs_f64(cfg.timeout_s).unwrap_or(Duration::MAX),
            seed,
            progress,
        };
        let mut r = run_point(&pc).await?;
        r.load.label = label;
        for record in &mut r.requests {
            record.point = i;
        }
        results.push(r);
    }
    Ok(capacity::build_report(cfg, results))
}
