//! Command-line flags (clap) and their conversion to [`BenchConfig`].

use crate::config::{BenchConfig, CapacitySpec, Endpoint, LoadSpec, SloSpec, Sweep};
use crate::error::BenchError;
use crate::workload::{DatasetOrder, WorkloadSpec, DEFAULT_OUTPUT_LEN};
use clap::Parser;
use std::path::PathBuf;

/// Load generator for OpenAI-compatible streaming endpoints (methodology of
/// vLLM's `bench serve`): fixed concurrency, Poisson or burst arrivals,
/// concurrency/rate sweeps; TTFT, ITL, TPOT and E2E percentiles;
/// table/JSON/CSV/SVG output and capacity planning.
#[derive(Debug, Clone, Parser)]
#[command(name = "gateway-bench", version, about, long_about = None)]
pub struct Cli {
    /// Target base URL, `http://host:port[/prefix]` (plain HTTP only).
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    pub base_url: String,
    /// API: `/v1/chat/completions` (or `chat`) or `/v1/completions` (or `completions`).
    #[arg(long, default_value = "/v1/chat/completions", value_parser = Endpoint::parse)]
    pub endpoint: Endpoint,
    /// Sent as `Authorization: Bearer <key>`.
    #[arg(long)]
    pub api_key: Option<String>,
    /// `model` field of every request.
    #[arg(long)]
    pub model: String,

    /// Maximum requests in flight (unbounded when omitted).
    #[arg(long)]
    pub max_concurrency: Option<u32>,
    /// Mean Poisson arrival rate in requests/s, or `inf` to send as fast as
    /// the concurrency cap allows.
    #[arg(long, default_value = "inf", value_parser = parse_rate)]
    pub request_rate: Rate,
    /// Gamma shape of inter-arrival times with a finite rate (1 = Poisson,
    /// <1 burstier, >1 more uniform).
    #[arg(long, default_value_t = 1.0)]
    pub burstiness: f64,
    /// Burst arrivals: requests released together every `--burst-interval-s`.
    #[arg(long, requires = "burst_interval_s")]
    pub burst_size: Option<u32>,
    /// Burst arrivals: seconds between bursts.
    #[arg(long, requires = "burst_size")]
    pub burst_interval_s: Option<f64>,
    /// Sweep: one point per concurrency cap, e.g. `1,4,16,64` (sorted ascending).
    #[arg(long, value_delimiter = ',', conflicts_with = "sweep_rate")]
    pub sweep_concurrency: Vec<u32>,
    /// Sweep: one point per request rate (req/s or `inf`), e.g. `5,10,20`
    /// (sorted ascending; `--max-concurrency` still caps each point).
    #[arg(long, value_delimiter = ',', value_parser = parse_rate)]
    pub sweep_rate: Vec<Rate>,
    /// Measured requests per point.
    #[arg(long, default_value_t = 1000)]
    pub num_prompts: u64,
    /// Stop sending new requests this many seconds into each point.
    #[arg(long)]
    pub duration_s: Option<f64>,
    /// Unmeasured warmup requests before each point.
    #[arg(long, default_value_t = 0)]
    pub warmup: u64,
    /// Seed for prompts, dataset sampling and arrivals.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Per-request timeout in seconds (class `timeout`).
    #[arg(long, default_value_t = 300.0)]
    pub timeout_s: f64,
    /// Runtime threads (1 = single-threaded runtime).
    #[arg(long, default_value_t = 1)]
    pub threads: usize,

    /// Random workload: prompt length in words (≈ tokens).
    #[arg(long, default_value_t = 256)]
    pub input_len: u32,
    /// `max_tokens` per request (random default 128; overrides dataset values).
    #[arg(long)]
    pub output_len: Option<u32>,
    /// JSONL dataset: `{"prompt","max_tokens"}` or ShareGPT `{"conversations"}` lines.
    #[arg(long)]
    pub dataset_path: Option<PathBuf>,
    /// Order in which a point draws dataset entries: `shuffled` (seeded) or `in-order` (file
    /// order, e.g. multi-turn conversations written turn by turn).
    #[arg(long, value_enum, default_value_t = DatasetOrder::Shuffled, requires = "dataset_path")]
    pub dataset_order: DatasetOrder,
    /// Send `ignore_eos` (vLLM extension); default true for random prompts,
    /// false for datasets.
    #[arg(long)]
    pub ignore_eos: Option<bool>,
    /// Ask for `stream_options.include_usage` (`--include-usage false`: bodies without
    /// `stream_options`, as the OpenAI SDKs send by default; output tokens are then counted from
    /// the content events).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub include_usage: bool,

    /// Write the full JSON report here.
    #[arg(long)]
    pub output_json: Option<PathBuf>,
    /// Write one CSV row per point here.
    #[arg(long)]
    pub output_csv: Option<PathBuf>,
    /// Write every measured request here, one JSON object per line: point, sent_ms, status,
    /// class, ttft_ms, e2e_ms, prompt_tokens, completion_tokens, queue_wait_ms (the gateway's
    /// `x-gateway-queue-wait-ms`).
    #[arg(long)]
    pub output_requests: Option<PathBuf>,
    /// Write an SVG chart (throughput vs TTFT p99, knee marked) here.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Do not print the progress line on stderr.
    #[arg(long)]
    pub no_progress: bool,

    /// SLO on TTFT p99 in ms: report the highest sustained rate meeting it.
    #[arg(long)]
    pub slo_ttft_p99_ms: Option<f64>,
    /// Minimum success rate (0..=1) for a point to count as sustained.
    #[arg(long, default_value_t = 0.99)]
    pub slo_min_success_rate: f64,
    /// Requests per day to size the fleet for.
    #[arg(long)]
    pub daily_volume: Option<f64>,
    /// Capacity headroom multiplier (≥ 1; 1.3 = 30 % spare).
    #[arg(long, default_value_t = 1.0)]
    pub headroom: f64,
    /// Serving nodes behind the benchmarked endpoint.
    #[arg(long, default_value_t = 1)]
    pub nodes_under_test: u32,
}

/// A request rate in req/s; `None` = `inf`.
pub type Rate = Option<f64>;

/// Parses `inf` or a positive finite number of requests/s.
pub fn parse_rate(s: &str) -> Result<Rate, String> {
    let s = s.trim();
    if s.eq_ignore_ascii_case("inf") || s.eq_ignore_ascii_case("infinity") {
        return Ok(None);
    }
    match s.parse::<f64>() {
        Ok(v) if v.is_infinite() && v > 0.0 => Ok(None),
        Ok(v) if v.is_finite() && v > 0.0 => Ok(Some(v)),
        _ => Err(format!("expected a positive number or `inf`, got {s:?}")),
    }
}

impl Cli {
    /// Validates the flags and resolves them into a [`BenchConfig`].
    pub fn to_config(&self) -> Result<BenchConfig, BenchError> {
        let workload = match &self.dataset_path {
            Some(path) => WorkloadSpec::Dataset {
                path: path.clone(),
                output_len: self.output_len,
                ignore_eos: self.ignore_eos.unwrap_or(false),
                order: self.dataset_order,
            },
            None => WorkloadSpec::Random {
                input_len: self.input_len,
                output_len: self.output_len.unwrap_or(DEFAULT_OUTPUT_LEN),
                ignore_eos: self.ignore_eos.unwrap_or(true),
            },
        };
        let sweep = if !self.sweep_concurrency.is_empty() {
            let mut v = self.sweep_concurrency.clone();
            v.sort_unstable();
            v.dedup();
            Sweep::Concurrency { values: v }
        } else if !self.sweep_rate.is_empty() {
            let mut v = self.sweep_rate.clone();
            v.sort_by(|a, b| a.unwrap_or(f64::INFINITY).total_cmp(&b.unwrap_or(f64::INFINITY)));
            v.dedup();
            Sweep::Rate { values: v }
        } else {
            Sweep::None
        };
        let cfg = BenchConfig {
            base_url: self.base_url.clone(),
            endpoint: self.endpoint,
            model: self.model.clone(),
            api_key: self.api_key.clone(),
            workload,
            include_usage: self.include_usage,
            num_prompts: self.num_prompts,
            warmup: self.warmup,
            seed: self.seed,
            duration_s: self.duration_s,
            timeout_s: self.timeout_s,
            threads: self.threads,
            load: LoadSpec {
                label: String::new(),
                max_concurrency: self.max_concurrency,
                request_rate: self.request_rate,
                burstiness: self.burstiness,
                burst_size: self.burst_size,
                burst_interval_s: self.burst_interval_s,
            },
            sweep,
            slo: self
                .slo_ttft_p99_ms
                .map(|ttft_p99_ms| SloSpec { ttft_p99_ms, min_success_rate: self.slo_min_success_rate }),
            capacity: self.daily_volume.map(|daily_volume| CapacitySpec {
                daily_volume,
                headroom: self.headroom,
                nodes_under_test: self.nodes_under_test,
            }),
        };
        cfg.validate()?;
        Ok(cfg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cli(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(["gateway-bench", "--model", "m"].iter().chain(args))
    }

    #[test]
    fn defaults_and_sweeps() {
        let c = cli(&[]).unwrap().to_config().unwrap();
        assert_eq!(c.points().len(), 1);
        assert_eq!(c.points()[0].label, "c=unbounded r=inf");
        let c = cli(&["--sweep-concurrency", "16,1,4"]).unwrap().to_config().unwrap();
        let labels: Vec<_> = c.points().into_iter().map(|p| p.label).collect();
        assert_eq!(labels, ["c=1", "c=4", "c=16"]);
        let c = cli(&["--sweep-rate", "inf,10,2.5", "--max-concurrency", "8"]).unwrap().to_config().unwrap();
        let pts = c.points();
        assert_eq!(pts.iter().map(|p| p.request_rate).collect::<Vec<_>>(), [Some(2.5), Some(10.0), None]);
        assert!(pts.iter().all(|p| p.max_concurrency == Some(8)));
        assert_eq!(pts[2].label, "r=inf");
    }

    #[test]
    fn rejects_bad_combinations() {
        assert!(cli(&["--sweep-rate", "1", "--sweep-concurrency", "2"]).is_err());
        assert!(cli(&["--request-rate", "0"]).is_err());
        assert!(cli(&["--burst-size", "4"]).is_err());
        let burst_and_rate =
            cli(&["--burst-size", "4", "--burst-interval-s", "1", "--request-rate", "5"]).unwrap();
        assert!(burst_and_rate.to_config().is_err());
        assert!(cli(&["--max-concurrency", "0"]).unwrap().to_config().is_err());
        assert!(cli(&["--headroom", "0.5", "--daily-volume", "100"]).unwrap().to_config().is_err());
        assert!(cli(&["--base-url", "https://x"]).unwrap().to_config().is_err());
        assert!(parse_rate("inf").unwrap().is_none());
        assert_eq!(parse_rate("12.5").unwrap(), Some(12.5));
        assert!(parse_rate("-1").is_err());
    }

    #[test]
    fn workload_defaults() {
        let c = cli(&[]).unwrap().to_config().unwrap();
        assert_eq!(c.workload, WorkloadSpec::Random { input_len: 256, output_len: 128, ignore_eos: true });
        let c = cli(&["--dataset-path", "x.jsonl"]).unwrap().to_config().unwrap();
        assert_eq!(
            c.workload,
            WorkloadSpec::Dataset {
                path: "x.jsonl".into(),
                output_len: None,
                ignore_eos: false,
                order: DatasetOrder::Shuffled
            }
        );
    }
}
