//! `vllm-sim` binary: parse flags, bind, announce the address, serve until SIGTERM/SIGINT.

use std::io::{self, Write as _};
use std::process::ExitCode;

use tokio::net::TcpListener;
use tokio::signal::unix::{signal, SignalKind};
use vllm_sim::Cli;

fn main() -> ExitCode {
    let cli = match Cli::try_parse_with_profile(std::env::args_os()) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    let runtime = if cli.workers == 1 {
        tokio::runtime::Builder::new_current_thread().enable_all().build()
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(usize::from(cli.workers))
            .enable_all()
            .build()
    };
    let result = runtime.and_then(|rt| rt.block_on(run(cli)));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("vllm-sim: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> io::Result<()> {
    let mut terminate = signal(SignalKind::terminate())?;
    let mut interrupt = signal(SignalKind::interrupt())?;
    let listener = TcpListener::bind((cli.host.as_str(), cli.port)).await?;
    let addr = listener.local_addr()?;
    let mut stdout = io::stdout().lock();
    writeln!(stdout, "vllm-sim listening on http://{addr}")?;
    stdout.flush()?;
    drop(stdout);
    let shutdown = async move {
        tokio::select! {
            _ = terminate.recv() => {}
            _ = interrupt.recv() => {}
        }
    };
    vllm_sim::serve(cli.sim, listener, shutdown).await
}
