//! `gateway-bench`: a load generator for OpenAI-compatible streaming
//! endpoints (vLLM pools behind Envoy), following the methodology of vLLM's
//! `bench serve`.
//!
//! * [`runner::run_point`] runs one benchmark point from a
//!   [`runner::PointConfig`]; [`runner::run_sweep`] runs every point of a
//!   [`config::BenchConfig`] and returns a [`report::SweepReport`].
//! * [`run_cli`] is the whole command-line tool (runtime, run, outputs).
//!
//! Modules: [`args`] (flags), [`config`] (resolved configuration),
//! [`workload`] (prompts), [`arrivals`] (Poisson / burst schedules),
//! [`client`] (hyper HTTP/1.1 client), [`sse`] (incremental SSE timing
//! parser), [`metrics`] (error classes, hdrhistogram aggregation),
//! [`capacity`] (knee, SLO, fleet sizing), [`report`] (table, JSON, CSV),
//! [`plot`] (SVG chart), [`progress`] (stderr progress line).

pub mod args;
pub mod arrivals;
pub mod capacity;
pub mod client;
pub mod config;
pub mod error;
pub mod metrics;
pub mod plot;
pub mod progress;
pub mod report;
pub mod runner;
pub mod sse;
pub mod workload;

pub use args::Cli;
pub use config::BenchConfig;
pub use error::BenchError;
pub use report::SweepReport;
pub use runner::{run_point, run_sweep, PointConfig, PointResult};

/// Builds the runtime (`--threads 1` = current-thread runtime, otherwise a
/// multi-thread runtime with that many workers).
pub fn build_runtime(threads: usize) -> Result<tokio::runtime::Runtime, BenchError> {
    let mut b = if threads <= 1 {
        tokio::runtime::Builder::new_current_thread()
    } else {
        let mut b = tokio::runtime::Builder::new_multi_thread();
        b.worker_threads(threads);
        b
    };
    b.enable_all().build().map_err(BenchError::Runtime)
}

/// Runs the tool for parsed flags: executes the sweep, prints the table to
/// stdout and writes the requested JSON / CSV / SVG files. Must not be
/// called from inside a Tokio runtime.
pub fn run_cli(cli: &Cli) -> Result<SweepReport, BenchError> {
    let cfg = cli.to_config()?;
    let rt = build_runtime(cfg.threads)?;
    let report = rt.block_on(run_sweep(&cfg, !cli.no_progress))?;
    drop(rt);
    let mut out = std::io::stdout().lock();
    report::write_table(&report, &mut out).map_err(|e| BenchError::io("<stdout>", e))?;
    if let Some(p) = &cli.output_json {
        report::write_json(&report, p)?;
    }
    if let Some(p) = &cli.output_csv {
        report::write_csv(&report, p)?;
    }
    if let Some(p) = &cli.output_requests {
        report::write_requests(&report, p)?;
    }
    if let Some(p) = &cli.plot {
        plot::write_svg(&report, p)?;
    }
    Ok(report)
}
