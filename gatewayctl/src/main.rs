//! `gatewayctl` binary: `render`, `validate`, `apply`, `hash-key`, `keys`, `usage`.

use std::io::Read as _;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use gatewayctl::config::Loaded;
use gatewayctl::{apply, key_edit, keys, render, usage};

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
    /// Swaps the running standalone gateway's configuration (`envoy.live_config`) with nothing
    /// restarted: renders and validates the whole config, then renames the filter's new ECDS
    /// file (`filter.json`) and the sidecar's config (`sidecar.yaml`) into
    /// `envoy.live_config.dir`, the sidecar's first when a tenant is added (waiting until it
    /// serves it), the filter's first otherwise. Streams that start after use the new
    /// configuration; streams in flight finish under theirs. A config that does not validate, or
    /// a sidecar change that cannot reload (its listen address, its Redis), changes nothing.
    Apply {
        /// The gateway config (YAML).
        #[arg(long)]
        config: PathBuf,
        /// How long to wait for the sidecar to serve its new config, in milliseconds.
        #[arg(long, default_value_t = 10_000)]
        wait_ms: u64,
    },
    /// Makes a new API key and prints it once with its SHA-256 digest for
    /// `tenants[].api_keys_sha256`; with `--key`, reads a key from stdin and prints its digest.
    HashKey {
        /// Read the key from stdin instead of generating one.
        #[arg(long)]
        key: bool,
    },
    /// Adds, revokes and lists a tenant's API keys in the gateway config file (its comments and
    /// layout kept); `gatewayctl apply` then makes the change live.
    Keys {
        #[command(subcommand)]
        action: KeysAction,
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
        /// Rows per model, or per API key name (`api-key`: the requests made with named keys).
        #[arg(long, value_enum, default_value = "model")]
        by: usage::By,
        /// With `--by api-key`: only this key (its name).
        #[arg(long)]
        api_key: Option<String>,
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

#[derive(Debug, Subcommand)]
enum KeysAction {
    /// Makes a new key, adds `{name, sha256, not_before, expires_at}` to the tenant's `api_keys`
    /// in the config file (validated, then replaced by rename), and prints the key once.
    Add {
        #[command(flatten)]
        at: KeysTarget,
        /// The key's name (letters, digits, `.`, `_`, `-`), new in the tenant.
        #[arg(long)]
        name: String,
        /// When the key starts to be accepted (RFC 3339 UTC, `2026-07-01T00:00:00Z`).
        #[arg(long)]
        not_before: Option<String>,
        /// When the key stops being accepted (RFC 3339 UTC).
        #[arg(long)]
        expires_at: Option<String>,
    },
    /// Removes the tenant's key `--name` from the config file (never its last key).
    Revoke {
        #[command(flatten)]
        at: KeysTarget,
        /// The key's name (`sha256:<12 hex>` for a key listed in `api_keys_sha256`).
        #[arg(long)]
        name: String,
    },
    /// Lists the tenant's keys: names, validity windows, state now, digest prefixes (never keys).
    List {
        #[command(flatten)]
        at: KeysTarget,
    },
}

/// The config file and tenant every `gatewayctl keys` action works on.
#[derive(Debug, clap::Args)]
struct KeysTarget {
    /// The gateway config (YAML); `add` and `revoke` edit it in place.
    #[arg(long)]
    config: PathBuf,
    /// The tenant's id.
    #[arg(long)]
    tenant: String,
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
        Command::Apply { config, wait_ms } => {
            let loaded = Loaded::load(&config).map_err(|e| e.to_string())?;
            let applied = apply::apply(&loaded, std::time::Duration::from_millis(wait_ms))
                .map_err(|e| e.to_string())?;
            let first = match applied.order {
                apply::Order::SidecarFirst => "sidecar first",
                apply::Order::FilterFirst => "filter first",
            };
            let sidecar = match (applied.sidecar_changed, applied.sidecar_took) {
                (false, _) => "unchanged".to_owned(),
                (true, Some(took)) => format!("served after {} ms", took.as_millis()),
                (true, None) => "written".to_owned(),
            };
            let files: Vec<String> = applied.sidecars.iter().map(|p| p.display().to_string()).collect();
            println!(
                "{}: applied ({first}): filter {} (Envoy applies it to new streams); sidecar {} ({sidecar})",
                loaded.file,
                applied.filter.display(),
                files.join(", ")
            );
            for note in &applied.notes {
                eprintln!("note: {note}");
            }
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
        Command::Usage { redis_url, key_prefix, tenant, model, by, api_key, from, to, format } => {
            let days = gateway_ext_proc::metering::usage_report::days(&from, &to)?;
            let only = match (by, model, api_key) {
                (usage::By::Model, model, None) => model,
                (usage::By::ApiKey, None, key) => key,
                (usage::By::Model, _, Some(_)) => return Err("--api-key needs --by api-key".to_owned()),
                (usage::By::ApiKey, Some(_), _) => {
                    return Err(
                        "--model cannot be combined with --by api-key (keys are counted across models)"
                            .to_owned(),
                    )
                }
            };
            let rows = gateway_ext_proc::metering::usage_report::read(
                &redis_url,
                &key_prefix,
                &tenant,
                (by.group(), only.as_deref()),
                &days,
            )?;
            print!("{}", usage::format(&rows, format, by));
            Ok(())
        }
        Command::Keys { action } => run_keys(action),
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
                     tenants[].api_keys_sha256 of the gateway config and re-render (or let \
                     `gatewayctl keys add` make a named key and edit the config)."
                );
            }
            Ok(())
        }
    }
}

fn run_keys(action: KeysAction) -> Result<(), String> {
    match action {
        KeysAction::Add { at: KeysTarget { config, tenant }, name, not_before, expires_at } => {
            let text = read(&config)?;
            let key = keys::new_key()?;
            let new = key_edit::NewKey { name: name.clone(), not_before, expires_at };
            let edited =
                key_edit::add(&text, &config.display().to_string(), &tenant, &new, &keys::digest(&key))?;
            key_edit::write_atomically(&config, &edited)?;
            println!("{key}");
            eprintln!(
                "{}: key '{name}' added to tenant '{tenant}'. The key is shown only this once: give it to the \
                 tenant. Run `gatewayctl apply --config {}` to make it live.",
                config.display(),
                config.display()
            );
            Ok(())
        }
        KeysAction::Revoke { at: KeysTarget { config, tenant }, name } => {
            let text = read(&config)?;
            let edited = key_edit::revoke(&text, &config.display().to_string(), &tenant, &name)?;
            key_edit::write_atomically(&config, &edited)?;
            eprintln!(
                "{}: key '{name}' of tenant '{tenant}' removed. Run `gatewayctl apply --config {}` to refuse it \
                 on every connection.",
                config.display(),
                config.display()
            );
            Ok(())
        }
        KeysAction::List { at: KeysTarget { config, tenant } } => {
            let loaded = Loaded::load(&config).map_err(|e| e.to_string())?;
            let now_s =
                std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
            print!("{}", key_edit::format_rows(&key_edit::list(&loaded, &tenant, now_s)?));
            Ok(())
        }
    }
}

fn read(path: &std::path::Path) -> Result<String, String> {
    std::fs::read_to_string(path).map_err(|e| format!("{}: cannot read: {e}", path.display()))
}
