//! Command line and embedding configuration.
//!
//! [`Cli`] is the `vllm-sim` binary's command line: where to listen and how many
//! runtime threads to use, plus the simulated engine, [`SimConfig`], which is also
//! what [`crate::serve`] takes when the simulator is embedded in a test.
//! Flag names follow `vllm serve` where vLLM has the same knob
//! (`--served-model-name`, `--max-model-len`, `--max-num-seqs`, `--seed`).

use std::time::Duration;

use clap::{Args, Parser};

/// Default of `--served-model-name`.
pub const DEFAULT_MODEL_NAME: &str = "sim-model";
/// Default of `--max-model-len`, in tokens (prompt plus completion).
pub const DEFAULT_MAX_MODEL_LEN: u32 = 4096;
/// Default of `--output-tokens`: completion length, in tokens, when the request sets no `max_tokens`.
pub const DEFAULT_OUTPUT_TOKENS: u32 = 16;
/// Default of `--max-num-seqs`: requests generating at the same time.
pub const DEFAULT_MAX_NUM_SEQS: u32 = 256;
/// Largest accepted `--ttft-ms` / `--itl-ms`, in milliseconds (one hour).
pub const MAX_DELAY_MS: f64 = 3_600_000.0;

/// The `vllm-sim` command line.
#[derive(Debug, Clone, Parser)]
#[command(name = "vllm-sim", version, about = "vLLM-compatible OpenAI upstream simulator (no GPU, no model)")]
pub struct Cli {
    /// Address to bind (vLLM `--host`).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// TCP port to bind; 0 asks the OS for an ephemeral port (vLLM `--port`).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Tokio worker threads; 1 runs the whole server on one single-threaded runtime.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..))]
    pub workers: u16,
    /// The simulated engine.
    #[command(flatten)]
    pub sim: SimConfig,
}

/// The simulated engine: served names, context size, pacing, concurrency and fault injection.
///
/// Build it with [`SimConfig::default`] and struct update syntax when embedding;
/// [`crate::serve`] rejects values outside the documented ranges.
#[derive(Debug, Clone, Args)]
pub struct SimConfig {
    /// Model names accepted in the request's `model` field (vLLM `--served-model-name`, repeatable
    /// or space separated). Responses always name the first one, as vLLM does.
    #[arg(
        long = "served-model-name",
        value_name = "NAME",
        num_args = 1..,
        default_value = DEFAULT_MODEL_NAME,
        value_parser = clap::builder::NonEmptyStringValueParser::new()
    )]
    pub served_model_names: Vec<String>,
    /// Context window in tokens, prompt plus completion (vLLM `--max-model-len`); at least 1.
    #[arg(long, default_value_t = DEFAULT_MAX_MODEL_LEN, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_model_len: u32,
    /// Time to first token in milliseconds, counted from when the request leaves the queue;
    /// 0 to 3 600 000.
    #[arg(long, default_value_t = 0.0, value_parser = parse_delay_ms)]
    pub ttft_ms: f64,
    /// Inter-token latency in milliseconds between two streamed tokens; 0 to 3 600 000.
    #[arg(long, default_value_t = 0.0, value_parser = parse_delay_ms)]
    pub itl_ms: f64,
    /// Completion length in tokens when the request does not force one (`ignore_eos`) and
    /// `max_tokens` allows it: the point where the simulated model "emits EOS"; at least 1.
    #[arg(long, default_value_t = DEFAULT_OUTPUT_TOKENS, value_parser = clap::value_parser!(u32).range(1..))]
    pub output_tokens: u32,
    /// Requests running at once (vLLM `--max-num-seqs`); later ones wait in a FIFO queue; at least 1.
    #[arg(long, default_value_t = DEFAULT_MAX_NUM_SEQS, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_num_seqs: u32,
    /// Fraction (0 to 1) of valid inference requests answered 500 with vLLM's error body.
    #[arg(long, default_value_t = 0.0, value_parser = parse_fraction)]
    pub error_rate: f64,
    /// When set, every streamed response drops its TCP connection after this many content chunks
    /// (a mid-stream upstream failure); streams with fewer tokens end normally.
    #[arg(long, value_name = "N")]
    pub fail_after_chunks: Option<u64>,
    /// Seed of the injected-error sequence: the same seed and request order fail the same requests.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// LoRA adapters served on top of the base model (vLLM `--lora-modules name=path`; the path is
    /// ignored). A request naming one is served, and its response's `model` names the adapter,
    /// as vLLM answers.
    #[arg(long = "lora-modules", value_name = "NAME[=PATH]", num_args = 1.., value_parser = parse_lora)]
    pub lora_modules: Vec<String>,
}

fn parse_lora(value: &str) -> Result<String, String> {
    match value.split_once('=').map_or(value, |(name, _)| name) {
        "" => Err("empty LoRA adapter name".to_owned()),
        name => Ok(name.to_owned()),
    }
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            served_model_names: vec![DEFAULT_MODEL_NAME.to_owned()],
            max_model_len: DEFAULT_MAX_MODEL_LEN,
            ttft_ms: 0.0,
            itl_ms: 0.0,
            output_tokens: DEFAULT_OUTPUT_TOKENS,
            max_num_seqs: DEFAULT_MAX_NUM_SEQS,
            error_rate: 0.0,
            fail_after_chunks: None,
            seed: 0,
            lora_modules: Vec::new(),
        }
    }
}

/// Why a [`SimConfig`] cannot be served.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    /// `served_model_names` is empty or holds an empty name.
    #[error("at least one non-empty served model name is required")]
    NoModelName,
    /// A count that must be at least 1 (`max_model_len`, `output_tokens`, `max_num_seqs`) is 0.
    #[error("{0} must be at least 1")]
    Zero(&'static str),
    /// A delay is negative, not finite or above [`MAX_DELAY_MS`].
    #[error("{name} must be between 0 and {MAX_DELAY_MS} ms, got {value}")]
    Delay {
        /// The flag's field name.
        name: &'static str,
        /// The rejected value, in milliseconds.
        value: f64,
    },
    /// `error_rate` is outside 0..=1.
    #[error("error_rate must be between 0 and 1, got {0}")]
    ErrorRate(f64),
}

/// Token pacing derived from [`SimConfig::ttft_ms`] and [`SimConfig::itl_ms`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pacing {
    /// Delay from leaving the queue to the first token.
    pub ttft: Duration,
    /// Delay between two consecutive tokens.
    pub itl: Duration,
}

impl Pacing {
    /// When token `index` (0-based) is due, measured from when the request left the queue:
    /// `ttft + index * itl`, saturating.
    pub fn token_offset(&self, index: u64) -> Duration {
        let steps = u32::try_from(index).unwrap_or(u32::MAX);
        self.ttft.saturating_add(self.itl.saturating_mul(steps))
    }
}

impl SimConfig {
    /// Checks every field against its documented range.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.served_model_names.is_empty() || self.served_model_names.iter().any(String::is_empty) {
            return Err(ConfigError::NoModelName);
        }
        for (name, value) in [
            ("max_model_len", self.max_model_len),
            ("output_tokens", self.output_tokens),
            ("max_num_seqs", self.max_num_seqs),
        ] {
            if value == 0 {
                return Err(ConfigError::Zero(name));
            }
        }
        if !(0.0..=1.0).contains(&self.error_rate) {
            return Err(ConfigError::ErrorRate(self.error_rate));
        }
        self.pacing().map(drop)
    }

    /// The pacing as durations, or why a delay is out of range.
    pub fn pacing(&self) -> Result<Pacing, ConfigError> {
        Ok(Pacing { ttft: delay("ttft_ms", self.ttft_ms)?, itl: delay("itl_ms", self.itl_ms)? })
    }

    /// The name responses carry in their `model` field: the first served name.
    pub fn response_model_name(&self) -> &str {
        self.served_model_names.first().map_or(DEFAULT_MODEL_NAME, String::as_str)
    }
}

fn delay(name: &'static str, value: f64) -> Result<Duration, ConfigError> {
    if (0.0..=MAX_DELAY_MS).contains(&value) {
        Duration::try_from_secs_f64(value / 1000.0).map_err(|_| ConfigError::Delay { name, value })
    } else {
        Err(ConfigError::Delay { name, value })
    }
}

fn parse_delay_ms(text: &str) -> Result<f64, String> {
    let value: f64 = text.parse().map_err(|e| format!("{e}"))?;
    delay("delay", value).map(|_| value).map_err(|e| e.to_string())
}

fn parse_fraction(text: &str) -> Result<f64, String> {
    let value: f64 = text.parse().map_err(|e| format!("{e}"))?;
    if (0.0..=1.0).contains(&value) {
        Ok(value)
    } else {
        Err(ConfigError::ErrorRate(value).to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cli_defaults_match_sim_config_default() {
        let cli = Cli::parse_from(["vllm-sim"]);
        assert_eq!(cli.host, "127.0.0.1");
        assert_eq!(cli.port, 8000);
        assert_eq!(cli.workers, 1);
        let d = SimConfig::default();
        assert_eq!(cli.sim.served_model_names, d.served_model_names);
        assert_eq!(cli.sim.max_model_len, d.max_model_len);
        assert_eq!(cli.sim.output_tokens, d.output_tokens);
        assert_eq!(cli.sim.max_num_seqs, d.max_num_seqs);
        assert_eq!(cli.sim.fail_after_chunks, None);
        assert!(d.validate().is_ok());
    }

    #[test]
    fn served_model_name_repeats_and_takes_lists() {
        let cli = Cli::parse_from([
            "vllm-sim",
            "--served-model-name",
            "a",
            "b",
            "--served-model-name",
            "c",
            "--ttft-ms",
            "2.5",
        ]);
        assert_eq!(cli.sim.served_model_names, ["a", "b", "c"]);
        assert_eq!(cli.sim.response_model_name(), "a");
        let pacing = cli.sim.pacing().unwrap();
        assert_eq!(pacing.ttft, Duration::from_micros(2500));
        assert_eq!(pacing.token_offset(0), pacing.ttft);
    }

    #[test]
    fn out_of_range_values_are_rejected() {
        assert!(Cli::try_parse_from(["vllm-sim", "--error-rate", "1.5"]).is_err());
        assert!(Cli::try_parse_from(["vllm-sim", "--itl-ms", "-1"]).is_err());
        assert!(Cli::try_parse_from(["vllm-sim", "--max-num-seqs", "0"]).is_err());
        let bad = SimConfig { ttft_ms: f64::NAN, ..SimConfig::default() };
        assert!(matches!(bad.validate(), Err(ConfigError::Delay { .. })));
        let bad = SimConfig { served_model_names: vec![], ..SimConfig::default() };
        assert_eq!(bad.validate(), Err(ConfigError::NoModelName));
    }

    #[test]
    fn token_offsets_add_itl_per_token() {
        let pacing = Pacing { ttft: Duration::from_millis(10), itl: Duration::from_millis(2) };
        assert_eq!(pacing.token_offset(3), Duration::from_millis(16));
    }
}
