//! Resolved benchmark configuration (what the CLI flags mean once
//! validated); serialized verbatim under `"config"` in the JSON report.

use crate::arrivals::ArrivalPattern;
use crate::error::BenchError;
use crate::workload::WorkloadSpec;
use serde::{Serialize, Serializer};
use std::time::Duration;

/// Which OpenAI-compatible API is driven.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Endpoint {
    /// `POST /v1/chat/completions` (`messages`, tokens in `choices[0].delta.content`).
    #[serde(rename = "/v1/chat/completions")]
    Chat,
    /// `POST /v1/completions` (`prompt`, tokens in `choices[0].text`).
    #[serde(rename = "/v1/completions")]
    Completions,
}

impl Endpoint {
    /// Request path appended to the base URL's path.
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Chat => "/v1/chat/completions",
            Endpoint::Completions => "/v1/completions",
        }
    }

    /// Parses `chat`, `completions`, or either full path.
    pub fn parse(s: &str) -> Result<Self, String> {
        match s.trim().trim_end_matches('/') {
            "chat" | "/v1/chat/completions" | "v1/chat/completions" => Ok(Endpoint::Chat),
            "completions" | "/v1/completions" | "v1/completions" => Ok(Endpoint::Completions),
            other => Err(format!("unknown endpoint {other:?}; use /v1/chat/completions or /v1/completions")),
        }
    }
}

/// Load shape of one benchmark point.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LoadSpec {
    /// Short label used in the table, CSV and chart (e.g. `c=16`, `r=10`);
    /// omitted from the JSON when empty (the base shape in `config.load`).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub label: String,
    /// Maximum requests in flight; `null` = unbounded.
    pub max_concurrency: Option<u32>,
    /// Mean Poisson arrival rate in requests/s; `null` = `inf` (no pacing).
    pub request_rate: Option<f64>,
    /// Gamma shape of inter-arrival gaps (1.0 = Poisson); only with a rate.
    pub burstiness: f64,
    /// Requests per burst, for the burst shape; `null` otherwise.
    pub burst_size: Option<u32>,
    /// Seconds between bursts, for the burst shape; `null` otherwise.
    pub burst_interval_s: Option<f64>,
}

impl LoadSpec {
    /// The arrival pattern for this point.
    pub fn arrival_pattern(&self) -> ArrivalPattern {
        match (self.burst_size, self.burst_interval_s, self.request_rate) {
            (Some(size), Some(secs), _) => ArrivalPattern::Burst {
                size,
                interval: Duration::try_from_secs_f64(secs).unwrap_or(Duration::MAX),
            },
            (_, _, Some(rate)) => ArrivalPattern::Poisson { rate, burstiness: self.burstiness },
            _ => ArrivalPattern::Unlimited,
        }
    }

    /// A descriptive label from the fields (used for single points).
    pub fn describe(&self) -> String {
        let c = self.max_concurrency.map_or("unbounded".to_string(), |c| c.to_string());
        match (self.burst_size, self.burst_interval_s, self.request_rate) {
            (Some(n), Some(t), _) => format!("burst={n}/{t}s c={c}"),
            (_, _, Some(r)) => format!("r={} c={c}", fmt_num(r)),
            _ => format!("c={c} r=inf"),
        }
    }
}

/// Formats a number without a trailing `.0`.
pub fn fmt_num(v: f64) -> String {
    if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{}", v as i64)
    } else {
        format!("{v}")
    }
}

/// Which parameter a sweep varies.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Sweep {
    /// A single point.
    None,
    /// One point per `max_concurrency` value (ascending).
    Concurrency {
        /// Concurrency caps.
        values: Vec<u32>,
    },
    /// One point per request rate (ascending; `null` = inf, last).
    Rate {
        /// Rates in requests/s.
        values: Vec<Option<f64>>,
    },
}

/// Latency SLO used for capacity planning.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct SloSpec {
    /// Maximum acceptable TTFT p99 in milliseconds.
    pub ttft_p99_ms: f64,
    /// Minimum success rate (0..=1) for a point to count as sustained.
    pub min_success_rate: f64,
}

/// Fleet-sizing inputs.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct CapacitySpec {
    /// Requests per day to serve.
    pub daily_volume: f64,
    /// Multiplier ≥ 1 applied to the average rate (1.3 = 30 % spare).
    pub headroom: f64,
    /// Serving nodes behind the benchmarked endpoint (per-node rate =
    /// measured rate / this).
    pub nodes_under_test: u32,
}

/// Full configuration of a run (one or more points).
#[derive(Debug, Clone, Serialize)]
pub struct BenchConfig {
    /// `http://host:port[/prefix]`.
    pub base_url: String,
    /// API driven.
    pub endpoint: Endpoint,
    /// `model` field of every request.
    pub model: String,
    /// Bearer token; serialized only as `"<redacted>"` or `null`.
    #[serde(serialize_with = "redact")]
    pub api_key: Option<String>,
    /// Prompt source.
    pub workload: WorkloadSpec,
    /// Whether request bodies ask for `stream_options.include_usage` (output tokens then come from
    /// the usage chunk; else from the content events).
    pub include_usage: bool,
    /// Measured requests per point.
    pub num_prompts: u64,
    /// Unmeasured warmup requests before each point.
    pub warmup: u64,
    /// RNG seed (prompts, sampling, arrivals).
    pub seed: u64,
    /// Optional bound on each point's sending phase, seconds.
    pub duration_s: Option<f64>,
    /// Per-request timeout, seconds.
    pub timeout_s: f64,
    /// Runtime worker threads (1 = current-thread runtime).
    pub threads: usize,
    /// Base load shape (sweeps override one field of it).
    pub load: LoadSpec,
    /// Sweep definition.
    pub sweep: Sweep,
    /// Latency SLO, if requested.
    pub slo: Option<SloSpec>,
    /// Fleet sizing, if requested.
    pub capacity: Option<CapacitySpec>,
}

fn redact<S: Serializer>(key: &Option<String>, s: S) -> Result<S::Ok, S::Error> {
    match key {
        Some(_) => s.serialize_str("<redacted>"),
        None => s.serialize_none(),
    }
}

impl BenchConfig {
    /// The load shape of every point, in sweep order.
    pub fn points(&self) -> Vec<LoadSpec> {
        match &self.sweep {
            Sweep::None => {
                let mut p = self.load.clone();
                p.label = p.describe();
                vec![p]
            }
            Sweep::Concurrency { values } => values
                .iter()
                .map(|&c| LoadSpec { label: format!("c={c}"), max_concurrency: Some(c), ..self.load.clone() })
                .collect(),
            Sweep::Rate { values } => values
                .iter()
                .map(|&r| LoadSpec {
                    label: r.map_or("r=inf".to_string(), |r| format!("r={}", fmt_num(r))),
                    request_rate: r,
                    ..self.load.clone()
                })
                .collect(),
        }
    }

    /// Checks value ranges and incompatible combinations.
    pub fn validate(&self) -> Result<(), BenchError> {
        let bad = |m: String| Err(BenchError::InvalidArgument(m));
        if self.num_prompts == 0 {
            return bad("--num-prompts must be ≥ 1".into());
        }
        if self.threads == 0 {
            return bad("--threads must be ≥ 1".into());
        }
        if !(self.timeout_s.is_finite() && self.timeout_s > 0.0) {
            return bad("--timeout-s must be > 0".into());
        }
        if let Some(d) = self.duration_s {
            if !(d.is_finite() && d > 0.0) {
                return bad("--duration-s must be > 0".into());
            }
        }
        crate::client::Target::parse(&self.base_url)?;
        if self.model.is_empty() {
            return bad("--model must not be empty".into());
        }
        match (self.load.burst_size, self.load.burst_interval_s) {
            (Some(_), None) | (None, Some(_)) => {
                return bad("--burst-size and --burst-interval-s go together".into())
            }
            (Some(_), Some(_)) => {
                if self.load.request_rate.is_some() || matches!(self.sweep, Sweep::Rate { .. }) {
                    return bad("burst arrivals exclude --request-rate / --sweep-rate".into());
                }
            }
            (None, None) => {}
        }
        for p in self.points() {
            if p.max_concurrency == Some(0) {
                return bad("concurrency must be ≥ 1".into());
            }
            crate::arrivals::ArrivalGenerator::new(p.arrival_pattern(), 0)
                .map_err(BenchError::InvalidArgument)?;
        }
        if let Some(slo) = self.slo {
            if !(slo.ttft_p99_ms > 0.0 && (0.0..=1.0).contains(&slo.min_success_rate)) {
                return bad("--slo-ttft-p99-ms must be > 0, --slo-min-success-rate in 0..=1".into());
            }
        }
        if let Some(c) = self.capacity {
            if !(c.daily_volume > 0.0 && c.daily_volume.is_finite()) {
                return bad("--daily-volume must be > 0".into());
            }
            if !(c.headroom >= 1.0 && c.headroom.is_finite()) {
                return bad("--headroom must be ≥ 1".into());
            }
            if c.nodes_under_test == 0 {
                return bad("--nodes-under-test must be ≥ 1".into());
            }
        }
        Ok(())
    }
}
