//! `gateway-ext-proc` binary: loads the YAML config (and reloads it when it changes or at
//! SIGHUP), logs JSON lines, serves until SIGINT/SIGTERM.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use gateway_ext_proc::config::error::ConfigError;
use gateway_ext_proc::config::Config;
use gateway_ext_proc::reload::Watched;
use gateway_ext_proc::telemetry::Telemetry;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

/// The static (musl) build's allocator: with musl's malloc the sidecar spent 1.3x to 1.8x the CPU
/// per request of the glibc build, with mimalloc about the same (docs/deploy.md, "Images"); glibc
/// builds keep the system allocator.
#[cfg(target_env = "musl")]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Envoy ext_proc sidecar of the LLM gateway: per-tenant RPM/TPM limits in Redis and token
/// metering from streamed responses.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// Path of the sidecar's YAML config. The sidecar reloads it when it changes (checked every
    /// 250 ms) or at SIGHUP; a file that does not validate is refused and the running config kept.
    #[arg(long)]
    config: PathBuf,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    // The bytes the running config is read from: the reload compares the file with them.
    let loaded = std::fs::read(&args.config)
        .map_err(|source| ConfigError::Read { path: args.config.display().to_string(), source });
    let loaded = loaded.and_then(|text| {
        let config = Config::load(&args.config)?;
        Ok((config, Watched::new(args.config.clone(), text)?))
    });
    let (config, watched) = match loaded {
        Ok(c) => c,
        Err(e) => {
            eprintln!("gateway-ext-proc: invalid config: {e}");
            return ExitCode::from(2);
        }
    };
    // With `tracing`, the spans also go to the OTLP collector (gateway_ext_proc::telemetry).
    let telemetry = match config.tracing.as_ref().map(Telemetry::new).transpose() {
        Ok(t) => t,
        Err(e) => {
            eprintln!("gateway-ext-proc: invalid config: {e}");
            return ExitCode::from(2);
        }
    };
    let otel = telemetry.as_ref().map(|t| tracing_opentelemetry::layer().with_tracer(t.tracer()));
    tracing_subscriber::registry()
        .with(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with(
            tracing_subscriber::fmt::layer()
                .json()
                .with_current_span(true)
                .with_span_list(false)
                .with_writer(std::io::stderr),
        )
        .with(otel)
        .init();
    let result = gateway_ext_proc::run_watching(config, Some(watched), shutdown_signal()).await;
    if let Some(t) = &telemetry {
        t.shutdown();
    }
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %e, "stopped");
            eprintln!("gateway-ext-proc: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(s) => s,
            Err(_) => {
                let _ = ctrl_c.await;
                return;
            }
        };
        tokio::select! {
            _ = ctrl_c => {},
            _ = term.recv() => {},
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}
