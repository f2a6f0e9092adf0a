//! Sweep analysis: knee detection, SLO-bound sustained rate, fleet sizing.
//!
//! **Knee rule.** Points are taken in sweep order (ascending offered load).
//! For each point `i ≥ 1` compare with point `i-1`:
//! throughput growth `g_x = x[i]/x[i-1] - 1` (completed req/s) and
//! TTFT-p99 growth `g_y = y[i]/y[i-1] - 1`. The knee is point `i-1` for the
//! first `i` where `g_x < 10 %` **and** `g_y > 50 %`: the last point before
//! extra load stops buying throughput and only buys latency. A point with no
//! successful request (no TTFT) after one with a TTFT counts as infinite
//! TTFT growth. Pairs whose previous throughput or TTFT p99 is 0 or missing
//! are skipped. No such pair → no knee.
//!
//! **SLO.** With `--slo-ttft-p99-ms X`, the sustained rate is the highest
//! completed-request throughput among points whose TTFT p99 ≤ X and whose
//! success rate ≥ `--slo-min-success-rate` (default 0.99).
//!
//! **Nodes.** `nodes = ceil(daily_volume / 86400 / per_node_rate × headroom)`
//! where `per_node_rate` = (SLO sustained rate if an SLO is given, else the
//! sweep's peak throughput) / `--nodes-under-test`.

use crate::config::{BenchConfig, SloSpec};
use crate::report::SweepReport;
use crate::runner::PointResult;
use serde::Serialize;

/// Knee: maximum relative throughput growth still considered "flat".
pub const KNEE_MAX_THROUGHPUT_GROWTH: f64 = 0.10;
/// Knee: minimum relative TTFT p99 growth considered a latency jump.
pub const KNEE_MIN_TTFT_GROWTH: f64 = 0.50;
/// Seconds per day.
pub const SECONDS_PER_DAY: f64 = 86_400.0;

/// The numbers of one point the analysis looks at.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample {
    /// Completed requests/s.
    pub throughput: f64,
    /// TTFT p99 in ms (`None` when no request succeeded).
    pub ttft_p99_ms: Option<f64>,
    /// completed / sent.
    pub success_rate: f64,
}

impl From<&PointResult> for Sample {
    fn from(p: &PointResult) -> Self {
        Self {
            throughput: p.stats.request_throughput,
            ttft_p99_ms: p.stats.ttft_ms.p99_ms,
            success_rate: p.stats.success_rate,
        }
    }
}

/// Index of the knee point (see the module docs), if any.
pub fn find_knee(samples: &[Sample]) -> Option<usize> {
    samples.windows(2).enumerate().find_map(|(i, w)| {
        let [prev, cur] = w else { return None };
        let prev_y = prev.ttft_p99_ms.filter(|&y| y > 0.0)?;
        if prev.throughput <= 0.0 {
            return None;
        }
        let gx = cur.throughput / prev.throughput - 1.0;
        let gy = cur.ttft_p99_ms.map_or(f64::INFINITY, |y| y / prev_y - 1.0);
        (gx < KNEE_MAX_THROUGHPUT_GROWTH && gy > KNEE_MIN_TTFT_GROWTH).then_some(i)
    })
}

/// Index of the highest-throughput point meeting the SLO, if any.
pub fn best_under_slo(samples: &[Sample], slo: SloSpec) -> Option<usize> {
    samples
        .iter()
        .enumerate()
        .filter(|(_, s)| {
            s.ttft_p99_ms.is_some_and(|y| y <= slo.ttft_p99_ms) && s.success_rate >= slo.min_success_rate
        })
        .max_by(|a, b| a.1.throughput.total_cmp(&b.1.throughput))
        .map(|(i, _)| i)
}

/// `ceil(daily_volume / 86400 / per_node_rate × headroom)`; `None` when
/// `per_node_rate` is not positive. A 1e-9 tolerance keeps exact ratios
/// (e.g. 10.000000000001) from rounding up.
pub fn nodes_needed(daily_volume: f64, per_node_rate: f64, headroom: f64) -> Option<u64> {
    if !(per_node_rate > 0.0 && per_node_rate.is_finite()) {
        return None;
    }
    let x = daily_volume / SECONDS_PER_DAY / per_node_rate * headroom;
    Some((x - 1e-9).ceil().max(0.0) as u64)
}

/// The detected knee.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct KneeReport {
    /// Index into `points`.
    pub index: usize,
    /// Label of the knee point.
    pub label: String,
    /// Its completed requests/s.
    pub request_throughput: f64,
    /// Its TTFT p99 (ms).
    pub ttft_p99_ms: Option<f64>,
}

/// SLO evaluation.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SloReport {
    /// TTFT p99 bound (ms).
    pub ttft_p99_ms: f64,
    /// Minimum success rate required.
    pub min_success_rate: f64,
    /// Whether any point met the SLO.
    pub met: bool,
    /// Index of the best point meeting it.
    pub index: Option<usize>,
    /// Its label.
    pub label: Option<String>,
    /// Highest sustained completed requests/s meeting the SLO.
    pub max_sustained_rate: Option<f64>,
    /// TTFT p99 (ms) at that point.
    pub ttft_p99_at_rate_ms: Option<f64>,
}

/// Fleet sizing.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CapacityReport {
    /// Requests per day.
    pub daily_volume: f64,
    /// daily_volume / 86400 (req/s).
    pub average_rate: f64,
    /// Headroom multiplier.
    pub headroom: f64,
    /// `slo` (SLO sustained rate) or `peak_throughput` (sweep maximum).
    pub rate_basis: &'static str,
    /// Measured rate of the benchmarked endpoint (req/s), if any.
    pub measured_rate: Option<f64>,
    /// Nodes behind the benchmarked endpoint.
    pub nodes_under_test: u32,
    /// measured_rate / nodes_under_test (req/s).
    pub per_node_rate: Option<f64>,
    /// Nodes required; `null` when no usable rate was measured.
    pub nodes: Option<u64>,
}

/// Assembles the report: points plus knee, SLO and capacity analysis.
pub fn build_report(cfg: &BenchConfig, points: Vec<PointResult>) -> SweepReport {
    let samples: Vec<Sample> = points.iter().map(Sample::from).collect();
    let knee = find_knee(&samples).and_then(|i| {
        let p = points.get(i)?;
        Some(KneeReport {
            index: i,
            label: p.load.label.clone(),
            request_throughput: p.stats.request_throughput,
            ttft_p99_ms: p.stats.ttft_ms.p99_ms,
        })
    });
    let slo = cfg.slo.map(|spec| {
        let best = best_under_slo(&samples, spec).and_then(|i| points.get(i).map(|p| (i, p)));
        SloReport {
            ttft_p99_ms: spec.ttft_p99_ms,
            min_success_rate: spec.min_success_rate,
            met: best.is_some(),
            index: best.map(|(i, _)| i),
            label: best.map(|(_, p)| p.load.label.clone()),
            max_sustained_rate: best.map(|(_, p)| p.stats.request_throughput),
            ttft_p99_at_rate_ms: best.and_then(|(_, p)| p.stats.ttft_ms.p99_ms),
        }
    });
    let capacity = cfg.capacity.map(|c| {
        let (basis, measured) = match &slo {
            Some(s) => ("slo", s.max_sustained_rate),
            None => (
                "peak_throughput",
                samples.iter().map(|s| s.throughput).filter(|t| *t > 0.0).max_by(f64::total_cmp),
            ),
        };
        let per_node = measured.map(|r| r / f64::from(c.nodes_under_test));
        CapacityReport {
            daily_volume: c.daily_volume,
            average_rate: c.daily_volume / SECONDS_PER_DAY,
            headroom: c.headroom,
            rate_basis: basis,
            measured_rate: measured,
            nodes_under_test: c.nodes_under_test,
            per_node_rate: per_node,
            nodes: per_node.and_then(|r| nodes_needed(c.daily_volume, r, c.headroom)),
        }
    });
    SweepReport {
        tool: "gateway-bench",
        version: env!("CARGO_PKG_VERSION"),
        config: cfg.clone(),
        points,
        knee,
        slo,
        capacity,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(throughput: f64, p99: f64) -> Sample {
        Sample { throughput, ttft_p99_ms: Some(p99), success_rate: 1.0 }
    }

    #[test]
    fn knee_at_last_point_before_saturation() {
        // Throughput scales, then flattens while TTFT p99 explodes.
        let pts = [s(10.0, 50.0), s(39.0, 55.0), s(120.0, 70.0), s(128.0, 400.0), s(129.0, 2000.0)];
        assert_eq!(find_knee(&pts), Some(2));
    }

    #[test]
    fn no_knee_when_scaling_or_latency_flat() {
        assert_eq!(find_knee(&[s(10.0, 50.0), s(20.0, 60.0), s(40.0, 80.0)]), None);
        // Flat throughput but latency only +20 %.
        assert_eq!(find_knee(&[s(10.0, 50.0), s(10.5, 60.0)]), None);
        // Latency doubles but throughput still +50 %.
        assert_eq!(find_knee(&[s(10.0, 50.0), s(15.0, 100.0)]), None);
        assert_eq!(find_knee(&[s(10.0, 50.0)]), None);
        assert_eq!(find_knee(&[]), None);
    }

    #[test]
    fn knee_boundaries_and_missing_ttft() {
        // Exactly +10 % throughput is not "< 10 %".
        assert_eq!(find_knee(&[s(100.0, 10.0), s(110.0, 100.0)]), None);
        assert_eq!(find_knee(&[s(100.0, 10.0), s(109.0, 100.0)]), Some(0));
        // Exactly +50 % TTFT is not "> 50 %".
        assert_eq!(find_knee(&[s(100.0, 10.0), s(100.0, 15.0)]), None);
        // All failures at the next point: infinite TTFT growth.
        let dead = Sample { throughput: 0.0, ttft_p99_ms: None, success_rate: 0.0 };
        assert_eq!(find_knee(&[s(10.0, 50.0), s(20.0, 55.0), dead]), Some(1));
        // Previous point without data is skipped.
        assert_eq!(find_knee(&[dead, s(20.0, 55.0)]), None);
    }

    #[test]
    fn slo_picks_highest_rate_meeting_bound_and_success() {
        let mut pts = vec![s(10.0, 100.0), s(40.0, 180.0), s(60.0, 250.0), s(30.0, 150.0)];
        let slo = SloSpec { ttft_p99_ms: 200.0, min_success_rate: 0.99 };
        assert_eq!(best_under_slo(&pts, slo), Some(1));
        pts[1].success_rate = 0.5; // heavy 429s: not sustained
        assert_eq!(best_under_slo(&pts, slo), Some(3));
        assert_eq!(best_under_slo(&pts, SloSpec { ttft_p99_ms: 50.0, min_success_rate: 0.0 }), None);
    }

    #[test]
    fn capacity_arithmetic() {
        // 8.64 M req/day = 100 req/s; 10 req/s per node → 10 nodes; ×1.25 → 12.5 → 13.
        assert_eq!(nodes_needed(8_640_000.0, 10.0, 1.0), Some(10));
        assert_eq!(nodes_needed(8_640_000.0, 10.0, 1.25), Some(13));
        assert_eq!(nodes_needed(8_640_000.0, 10.0, 1.2), Some(12));
        assert_eq!(nodes_needed(1.0, 10.0, 1.0), Some(1));
        assert_eq!(nodes_needed(1_000_000.0, 3.0, 1.5), Some(6)); // 11.57/3×1.5 = 5.79
        assert_eq!(nodes_needed(1.0, 0.0, 1.0), None);
    }
}
