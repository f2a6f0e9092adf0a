//! `gatewayctl` binary: `render`, `validate`, `hash-key`, `usage`.

use std::io::Read as _;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use gatewayctl::config::Loaded;
use gatewayctl::{keys, render, usage};

/// Renders the LLM gateway's Envoy, sidecar and Kubernetes / Istio / Envoy Gateway configuration
/// from one gateway config, and makes API keys.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Renders the files of a target into a directory (nothing is written if any fails).
    Render {
        /// The gateway config (YAML).
        #[arg(long)]
        config: PathBuf,
        /// Output directory (created if needed; files of the same name are replaced).
        #[arg(long)]
        out: PathBuf,
        /// What to render; `all` renders every target the config has the sections for.
        #[arg(long, value_enum, default_value = "all")]
        target: render::Target,
    },
    /// Checks a gateway config: parses it and renders every target it configures, in memory.
    Validate {
        /// The gateway config (YAML).
        #[arg(long)]
        config: PathBuf,
    },
    /// Swaps the running standalone Envoy's filter configuration (`envoy.live_config`): renders
    /// and validates the whole config, then renames the filter's new ECDS file into
    /// `envoy.live_config.dir`; Envoy applies it to every stream that starts after, with no
    /// restart. A config that does not validate changes nothing.
    Apply {
        /// The gateway config (YAML).
        #[arg(long)]
        config: PathBuf,
    },
    /// Makes a new API key and prints it once with its SHA-256 digest for
    /// `tenants[].api_keys_sha256`; with `--key`, reads a key from stdin and prints its digest.
    HashKey {
        /// Read the key from stdin instead of generating one.
        #[arg(long)]
        key: bool,
    },
    /// Reports a tenant's requests, tokens and cost per model and UTC day from the usage
    /// ledger's daily hashes in Redis (what the sidecars recorded).
    Usage {
        /// The Redis to read (`redis://` or `rediss://`, the sidecars' `redis.url`; of a Redis
        /// Cluster, the node holding the tenant's slot).
        #[arg(long)]
        redis_url: String,
        /// The sidecars' `redis.key_prefix`.
        #[arg(long, default_value = "llmgw")]
        key_prefix: String,
        /// The tenant.
        #[arg(long)]
        tenant: String,
        /// Only this model (its public name).
        #[arg(long)]
        model: Option<String>,
        /// First day, YYYY-MM-DD (UTC).
        #[arg(long)]
        from: String,
        /// Last day, YYYY-MM-DD (UTC), included.
        #[arg(long)]
        to: String,
        /// Output format.
        #[arg(long, value_enum, default_value = "table")]
        format: usage::Format,
    },
}

fn main() -> ExitCode {
    match run(Args::parse().command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("gatewayctl: {message}");
            ExitCode::from(2)
        }
    }
}

fn run(command: Command) -> Result<(), String> {
    match command {
        Command::Render { config, out, target } => {
            let loaded = Loaded::load(&config).map_err(|e| e.to_string())?;
            let output = render::render(&loaded, target).map_err(|e| e.to_string())?;
            render::write(&output.files, &out)?;
            for note in &output.notes {
                eprintln!("note: {note}");
            }
            for file in &output.files {
                println!("{}", out.join(&file.path).display());
            }
            Ok(())
        }
        Command::Apply { config } => {
            let loaded = Loaded::load(&config).map_err(|e| e.to_string())?;
            let path = render::apply(&loaded).map_err(|e| e.to_string())?;
            println!(
                "{}: the filter's configuration is now {} (Envoy applies it to new streams)",
                loaded.file,
                path.display()
            );
            eprintln!(
                "note: the sidecar's configuration (tenants, limits, quotas, pools) is not swapped: render it and \
                 restart the sidecar when it changed; add a tenant to the sidecar before its keys go live, \
                 remove it after"
            );
            Ok(())
        }
        Command::Validate { config } => {
            let loaded = Loaded::load(&config).map_err(|e| e.to_string())?;
            let output = render::render(&loaded, render::Target::All).map_err(|e| e.to_string())?;
            for note in &output.notes {
                eprintln!("note: {note}");
            }
            println!("{}: valid ({} files would be rendered)", loaded.file, output.files.len());
            Ok(())
        }
        Command::Usage { redis_url, key_prefix, tenant, model, from, to, format } => {
            let days = gateway_ext_proc::metering::usage_report::days(&from, &to)?;
            let rows = gateway_ext_proc::metering::usage_report::read(
                &redis_url,
                &key_prefix,
                &tenant,
                model.as_deref(),
                &days,
            )?;
            print!("{}", usage::format(&rows, format));
            Ok(())
        }
        Command::HashKey { key: from_stdin } => {
            if from_stdin {
                let mut key = String::new();
                std::io::stdin().read_to_string(&mut key).map_err(|e| format!("reading stdin: {e}"))?;
                let key = key.trim_end_matches(['\n', '\r']);
                keys::check_key(key)?;
                println!("sha256: {}", keys::digest(key));
            } else {
                let key = keys::new_key()?;
                println!("api_key: {key}");
                println!("sha256: {}", keys::digest(&key));
                eprintln!(
                    "The key is shown only this once: give it to the tenant. Put the sha256 in \
                     tenants[].api_keys_sha256 of the gateway config and re-render."
                );
            }
            Ok(())
        }
    }
}
