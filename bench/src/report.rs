//! Outputs: terminal table, JSON report, CSV (one row per point).
//!
//! JSON layout (`--output-json`):
//! ```text
//! { "tool": "gateway-bench", "version": "0.1.0",
//!   "config":   BenchConfig (flags after validation; api_key redacted),
//!   "points":   [ { label, max_concurrency, request_rate (null = inf), burstiness,
//!                   burst_size, burst_interval_s,
//!                   duration_s, sent, completed, failed,
//!                   request_throughput, output_throughput, total_token_throughput,
//!                   success_rate, rate_limited_rate, rate_limited_quota_rate,
//!                   rate_limited_overload_rate, total_prompt_tokens,
//!                   total_completion_tokens, requests_without_usage, sse_parse_errors,
//!                   errors: {ok, rate_limited_quota, rate_limited_overload, http_4xx,
//!                            http_5xx, timeout, connection, stream_truncated},
//!                   status_codes: {"200": n, ...},
//!                   ttft_ms|itl_ms|tpot_ms|e2e_ms: {count, mean_ms, p50_ms, p90_ms,
//!                                                   p99_ms, max_ms} } ],
//!   "knee":     null | {index, label, request_throughput, ttft_p99_ms},
//!   "slo":      null | {ttft_p99_ms, min_success_rate, met, index, label,
//!                       max_sustained_rate, ttft_p99_at_rate_ms},
//!   "capacity": null | {daily_volume, average_rate, headroom, rate_basis,
//!                       measured_rate, nodes_under_test, per_node_rate, nodes} }
//! ```

use crate::capacity::{CapacityReport, KneeReport, SloReport};
use crate::config::{fmt_num, BenchConfig};
use crate::error::BenchError;
use crate::metrics::{ErrorClass, LatencySummary};
use crate::runner::PointResult;
use serde::Serialize;
use std::io::Write;
use std::path::Path;

/// The complete result of a run.
#[derive(Debug, Clone, Serialize)]
pub struct SweepReport {
    /// Always `gateway-bench`.
    pub tool: &'static str,
    /// Crate version.
    pub version: &'static str,
    /// Resolved configuration.
    pub config: BenchConfig,
    /// One entry per point, in sweep order.
    pub points: Vec<PointResult>,
    /// Knee of the throughput/TTFT curve, if detected.
    pub knee: Option<KneeReport>,
    /// SLO evaluation, if `--slo-ttft-p99-ms` was given.
    pub slo: Option<SloReport>,
    /// Fleet sizing, if `--daily-volume` was given.
    pub capacity: Option<CapacityReport>,
}

fn ms(v: Option<f64>) -> String {
    v.map_or_else(|| "-".to_string(), |v| format!("{v:.1}"))
}

/// Writes the human-readable table and analysis lines.
pub fn write_table(r: &SweepReport, out: &mut impl Write) -> std::io::Result<()> {
    writeln!(
        out,
        "{:<22} {:>7} {:>7} {:>6} {:>9} {:>10} {:>7} {:>6} {:>15} {:>15} {:>15} {:>15}",
        "point",
        "sent",
        "ok",
        "fail",
        "req/s",
        "out tok/s",
        "ok %",
        "429 %",
        "TTFT p50/p99",
        "ITL p50/p99",
        "TPOT p50/p99",
        "E2E p50/p99"
    )?;
    for (i, p) in r.points.iter().enumerate() {
        let s = &p.stats;
        let pair = |l: &LatencySummary| format!("{}/{}", ms(l.p50_ms), ms(l.p99_ms));
        let knee = if r.knee.as_ref().is_some_and(|k| k.index == i) { " *" } else { "" };
        writeln!(
            out,
            "{:<22} {:>7} {:>7} {:>6} {:>9.2} {:>10.1} {:>7.2} {:>6.2} {:>15} {:>15} {:>15} {:>15}{knee}",
            p.load.label,
            s.sent,
            s.completed,
            s.failed,
            s.request_throughput,
            s.output_throughput,
            s.success_rate * 100.0,
            s.rate_limited_rate * 100.0,
            pair(&s.ttft_ms),
            pair(&s.itl_ms),
            pair(&s.tpot_ms),
            pair(&s.e2e_ms),
        )?;
    }
    writeln!(out, "(latencies in ms; 429 % = quota + overload; * = knee)")?;
    for p in &r.points {
        let e = &p.stats.errors;
        if e.total() > e.ok {
            let parts: Vec<String> = ErrorClass::ALL
                .iter()
                .filter(|c| **c != ErrorClass::Ok && e.get(**c) > 0)
                .map(|c| format!("{}={}", c.as_str(), e.get(*c)))
                .collect();
            let statuses: Vec<String> = p
                .stats
                .status_codes
                .iter()
                .filter(|(code, _)| !code.starts_with('2'))
                .map(|(code, n)| format!("{code}:{n}"))
                .collect();
            let statuses = if statuses.is_empty() {
                String::new()
            } else {
                format!(" (HTTP status {})", statuses.join(" "))
            };
            writeln!(out, "errors {}: {}{statuses}", p.load.label, parts.join(" "))?;
        }
    }
    match &r.knee {
        Some(k) => writeln!(
            out,
            "knee: {} ({:.2} req/s, TTFT p99 {} ms)",
            k.label,
            k.request_throughput,
            ms(k.ttft_p99_ms)
        )?,
        None if r.points.len() > 1 => writeln!(out, "knee: none detected")?,
        None => {}
    }
    if let Some(s) = &r.slo {
        match (s.max_sustained_rate, &s.label) {
            (Some(rate), Some(label)) => writeln!(
                out,
                "SLO TTFT p99 <= {} ms: max sustained {rate:.2} req/s at {label} (p99 {} ms)",
                fmt_num(s.ttft_p99_ms),
                ms(s.ttft_p99_at_rate_ms)
            )?,
            _ => writeln!(out, "SLO TTFT p99 <= {} ms: no point meets it", fmt_num(s.ttft_p99_ms))?,
        }
    }
    if let Some(c) = &r.capacity {
        match (c.nodes, c.per_node_rate) {
            (Some(n), Some(rate)) => writeln!(
                out,
                "capacity: {} req/day = {:.2} req/s avg; {rate:.2} req/s per node ({}), headroom x{} -> {n} node(s)",
                fmt_num(c.daily_volume),
                c.average_rate,
                c.rate_basis,
                fmt_num(c.headroom)
            )?,
            _ => writeln!(out, "capacity: no usable per-node rate measured")?,
        }
    }
    Ok(())
}

/// Writes the JSON report (pretty-printed).
pub fn write_json(r: &SweepReport, path: &Path) -> Result<(), BenchError> {
    let mut bytes = serde_json::to_vec_pretty(r)?;
    bytes.push(b'\n');
    std::fs::write(path, bytes).map_err(|e| BenchError::io(path, e))
}

fn opt<T: ToString>(v: Option<T>) -> String {
    v.map_or_else(String::new, |v| v.to_string())
}

/// CSV column names, in order.
pub fn csv_header() -> Vec<String> {
    let mut h: Vec<String> = [
        "label",
        "max_concurrency",
        "request_rate",
        "burstiness",
        "burst_size",
        "burst_interval_s",
        "duration_s",
        "sent",
        "completed",
        "failed",
        "request_throughput",
        "output_throughput",
        "total_token_throughput",
        "success_rate",
        "rate_limited_rate",
        "rate_limited_quota_rate",
        "rate_limited_overload_rate",
        "total_prompt_tokens",
        "total_completion_tokens",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    h.extend(ErrorClass::ALL.iter().map(|c| format!("errors_{}", c.as_str())));
    for m in ["ttft", "itl", "tpot", "e2e"] {
        for s in ["count", "mean_ms", "p50_ms", "p90_ms", "p99_ms", "max_ms"] {
            h.push(format!("{m}_{s}"));
        }
    }
    h.push("is_knee".into());
    h
}

/// Writes every measured request as one JSON object per line ([`crate::runner::RequestRecord`]).
pub fn write_requests(r: &SweepReport, path: &Path) -> Result<(), BenchError> {
    let file = std::fs::File::create(path).map_err(|e| BenchError::io(path, e))?;
    let mut out = std::io::BufWriter::new(file);
    for record in r.points.iter().flat_map(|p| &p.requests) {
        serde_json::to_writer(&mut out, record).map_err(|e| BenchError::io(path, e.into()))?;
        out.write_all(b"\n").map_err(|e| BenchError::io(path, e))?;
    }
    out.flush().map_err(|e| BenchError::io(path, e))
}

/// CSV cells of one point (matching [`csv_header`]; empty = null).
pub fn csv_row(r: &SweepReport, i: usize, p: &PointResult) -> Vec<String> {
    let s = &p.stats;
    let l = &p.load;
    let mut row = vec![
        l.label.clone(),
        opt(l.max_concurrency),
        l.request_rate.map_or_else(|| "inf".to_string(), |r| r.to_string()),
        l.burstiness.to_string(),
        opt(l.burst_size),
        opt(l.burst_interval_s),
        s.duration_s.to_string(),
        s.sent.to_string(),
        s.completed.to_string(),
        s.failed.to_string(),
        s.request_throughput.to_string(),
        s.output_throughput.to_string(),
        s.total_token_throughput.to_string(),
        s.success_rate.to_string(),
        s.rate_limited_rate.to_string(),
        s.rate_limited_quota_rate.to_string(),
        s.rate_limited_overload_rate.to_string(),
        s.total_prompt_tokens.to_string(),
        s.total_completion_tokens.to_string(),
    ];
    row.extend(ErrorClass::ALL.iter().map(|c| s.errors.get(*c).to_string()));
    for m in [&s.ttft_ms, &s.itl_ms, &s.tpot_ms, &s.e2e_ms] {
        row.push(m.count.to_string());
        for v in [m.mean_ms, m.p50_ms, m.p90_ms, m.p99_ms, m.max_ms] {
            row.push(opt(v));
        }
    }
    row.push(r.knee.as_ref().is_some_and(|k| k.index == i).to_string());
    row
}

/// Writes one CSV row per point.
pub fn write_csv(r: &SweepReport, path: &Path) -> Result<(), BenchError> {
    let mut w = csv::Writer::from_path(path)?;
    w.write_record(csv_header())?;
    for (i, p) in r.points.iter().enumerate() {
        w.write_record(csv_row(r, i, p))?;
    }
    w.flush().map_err(|e| BenchError::io(path, e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args::Cli;
    use crate::capacity::build_report;
    use crate::metrics::{Collector, RequestOutcome};
    use clap::Parser;
    use std::time::Duration;

    fn point(label: &str, ttft_ms: u64, n: u64) -> PointResult {
        let mut c = Collector::new().unwrap();
        for _ in 0..n {
            c.record(&RequestOutcome {
                class: ErrorClass::Ok,
                status: Some(200),
                ttft: Some(Duration::from_millis(ttft_ms)),
                e2e: Duration::from_millis(ttft_ms + 100),
                itl_us: vec![10_000; 10],
                prompt_tokens: 5,
                completion_tokens: 11,
                usage_reported: true,
                sse_parse_errors: 0,
                queue_wait_ms: None,
            });
        }
        c.record(&RequestOutcome::failed(ErrorClass::RateLimitedQuota, Some(429), Duration::ZERO));
        let cfg = Cli::try_parse_from(["b", "--model", "m"]).unwrap().to_config().unwrap();
        let mut load = cfg.points().remove(0);
        load.label = label.into();
        PointResult { load, stats: c.finish(Duration::from_secs(1)), requests: Vec::new() }
    }

    #[test]
    fn table_csv_and_json_agree() {
        let cli = Cli::try_parse_from([
            "b",
            "--model",
            "m",
            "--sweep-concurrency",
            "1,2,4",
            "--slo-ttft-p99-ms",
            "100",
            "--slo-min-success-rate",
            "0.5",
            "--daily-volume",
            "864000",
        ])
        .unwrap();
        let cfg = cli.to_config().unwrap();
        // 10 → 20 req/s scales; 20 → 21 req/s with TTFT 50 → 400 ms: knee at index 1.
        let pts = vec![point("c=1", 40, 10), point("c=2", 50, 20), point("c=4", 400, 21)];
        let r = build_report(&cfg, pts);
        assert_eq!(r.knee.as_ref().map(|k| k.index), Some(1));
        let slo = r.slo.as_ref().unwrap();
        assert_eq!(slo.label.as_deref(), Some("c=2"));
        let cap = r.capacity.as_ref().unwrap();
        assert_eq!(cap.nodes, Some(1)); // 10 req/s avg over 20 req/s per node

        let mut table = Vec::new();
        write_table(&r, &mut table).unwrap();
        let table = String::from_utf8(table).unwrap();
        assert!(table.contains("knee: c=2"), "{table}");
        assert!(table.contains("rate_limited_quota=1 (HTTP status 429:1)"), "{table}");
        assert!(table.contains("max sustained 20.00 req/s at c=2"), "{table}");

        let header = csv_header();
        for (i, p) in r.points.iter().enumerate() {
            let row = csv_row(&r, i, p);
            assert_eq!(row.len(), header.len());
            assert_eq!(row.last().unwrap(), if i == 1 { "true" } else { "false" });
        }
        let v = serde_json::to_value(&r).unwrap();
        assert_eq!(v["points"][1]["sent"], 21);
        assert_eq!(v["points"][1]["errors"]["rate_limited_quota"], 1);
        assert_eq!(v["knee"]["label"], "c=2");
        assert_eq!(v["capacity"]["rate_basis"], "slo");
        assert!(v["config"]["load"].get("label").is_none());
    }
}
