//! Command line and embedding configuration.
//!
//! [`Cli`] is the `vllm-sim` binary's command line: where to listen and how many
//! runtime threads to use, plus the simulated engine, [`SimConfig`], which is also
//! what [`crate::serve`] takes when the simulator is embedded in a test.
//! Flag names follow `vllm serve` where vLLM has the same knob
//! (`--served-model-name`, `--max-model-len`, `--max-num-seqs`, `--seed`).

use std::time::Duration;

use clap::{Args, Parser, ValueEnum};

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

// Batched-engine defaults (`--engine batched`). They model Llama 3.1 8B Instruct in BF16 on one
// H100 SXM 80 GB under vLLM V1, derived from published figures, not measured here:
// * the model: 8.03 B parameters (16.06 GB of BF16 weights), 32 layers, 8 KV heads of 128
//   dimensions, so 2 x 32 x 8 x 128 x 2 bytes = 128 KiB of KV cache per token
//   (Meta's Llama 3.1 model card and `config.json`);
// * the GPU: 989 TFLOP/s dense BF16 and 3.35 TB/s HBM3 (NVIDIA's H100 SXM datasheet);
// * vLLM: 16-token blocks, `gpu_memory_utilization` 0.9, `max_num_batched_tokens` 8192 for the
//   OpenAI server on a GPU of 70 GB or more (vLLM V1's `EngineArgs` defaults).

/// Default of `--block-size`: tokens per KV-cache block (vLLM's default block size on CUDA).
pub const DEFAULT_BLOCK_SIZE: u32 = 16;
/// Default of `--num-gpu-blocks`: 80 GB x 0.9 (vLLM's `gpu_memory_utilization`) less the
/// 16.06 GB of weights and about 4 GB of activations and CUDA graphs leaves about 52 GB for the
/// KV cache, at 16 x 128 KiB = 2 MiB per block: 24,800 blocks (396,800 tokens).
pub const DEFAULT_NUM_GPU_BLOCKS: u32 = 24_800;
/// Largest accepted `--num-gpu-blocks` (2^24 blocks, 268 M tokens of 16: far above any GPU's,
/// and the engine keeps 24 bytes of state a block).
pub const MAX_NUM_GPU_BLOCKS: u32 = 1 << 24;
/// Default of `--max-num-batched-tokens`: vLLM V1's per-step token budget for the OpenAI server
/// on a GPU of 70 GB or more.
pub const DEFAULT_MAX_NUM_BATCHED_TOKENS: u32 = 8192;
/// Default of `--step-base-ms`: one forward pass reads every weight once: 16.06 GB at 3.35 TB/s
/// is 4.8 ms, rounded to 5 ms (the inter-token latency of a lone request).
pub const DEFAULT_STEP_BASE_MS: f64 = 5.0;
/// Default of `--prefill-us-per-token`: 2 x 8.03 GFLOP per prompt token at 40 % of the H100's
/// 989 TFLOP/s dense BF16 peak is 40 us per token (25,000 prompt tokens/s).
pub const DEFAULT_PREFILL_US_PER_TOKEN: f64 = 40.0;
/// Default of `--decode-us-per-seq`: each decoding sequence reads its KV cache every step; a
/// 1,000-token context is 1,000 x 128 KiB = 131 MB, 39 us at 3.35 TB/s, rounded to 40 us.
pub const DEFAULT_DECODE_US_PER_SEQ: f64 = 40.0;
/// Largest accepted `--step-base-ms` (one minute).
pub const MAX_STEP_BASE_MS: f64 = 60_000.0;
/// Largest accepted `--prefill-us-per-token` / `--decode-us-per-seq` (one second).
pub const MAX_STEP_COST_US: f64 = 1_000_000.0;
/// Largest accepted `--slowdown`.
pub const MAX_SLOWDOWN: f64 = 1000.0;

/// How the simulator paces tokens (`--engine`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub enum EngineKind {
    /// Every request gets its first token `--ttft-ms` after it leaves the `--max-num-seqs` queue
    /// and the next ones `--itl-ms` apart, whatever else runs.
    #[default]
    Fixed,
    /// A step-by-step model of vLLM V1's scheduler with a paged KV cache and prefix caching
    /// (the crate docs describe it); `--ttft-ms` and `--itl-ms` are ignored.
    Batched,
}

/// The engine the batched engine's defaults model (`--profile`): each profile gives the KV
/// cache's shape and the step costs ([`ProfileCosts`]), and says where its numbers come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub enum Profile {
    /// Llama 3.1 8B Instruct in BF16 on one H100 SXM 80 GB under vLLM V1, derived from published
    /// figures (the `DEFAULT_*` constants above), not measured here.
    #[default]
    #[value(name = "h100-llama-8b")]
    H100Llama8b,
    /// vLLM 0.32's CPU build serving Gemma-3-270M in float32 on one core of this project's
    /// 2-core benchmark machine (AVX2), `--max-num-seqs 4`: the constants of [`CPU_GEMMA_270M`],
    /// fitted to that engine's measured TTFTs and inter-token latencies (docs/benchmarks.md,
    /// "On a real engine").
    #[value(name = "cpu-gemma-270m")]
    CpuGemma270m,
}

/// A profile's constants: the batched engine's flags of the same names.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ProfileCosts {
    /// `--block-size`, tokens per KV-cache block.
    pub block_size: u32,
    /// `--num-gpu-blocks`, KV-cache blocks.
    pub num_gpu_blocks: u32,
    /// `--max-num-batched-tokens`, tokens one step may compute.
    pub max_num_batched_tokens: u32,
    /// `--step-base-ms`, milliseconds.
    pub step_base_ms: f64,
    /// `--prefill-us-per-token`, microseconds per uncached prompt token.
    pub prefill_us_per_token: f64,
    /// `--decode-us-per-seq`, microseconds per decoding sequence and step.
    pub decode_us_per_seq: f64,
}

/// [`Profile::H100Llama8b`]'s constants.
pub const H100_LLAMA_8B: ProfileCosts = ProfileCosts {
    block_size: DEFAULT_BLOCK_SIZE,
    num_gpu_blocks: DEFAULT_NUM_GPU_BLOCKS,
    max_num_batched_tokens: DEFAULT_MAX_NUM_BATCHED_TOKENS,
    step_base_ms: DEFAULT_STEP_BASE_MS,
    prefill_us_per_token: DEFAULT_PREFILL_US_PER_TOKEN,
    decode_us_per_seq: DEFAULT_DECODE_US_PER_SEQ,
};

/// Sim tokens per Gemma-3 token of `vllm bench serve`'s random and prefix-repetition prompts:
/// the sim counts 4 bytes a token, and those prompts' Gemma tokens average 7.6 bytes (measured
/// over 240 of them with Gemma-3-270M's tokenizer). [`CPU_GEMMA_270M`]'s lengths are scaled by it.
pub const CPU_GEMMA_SIM_TOKENS_PER_TOKEN: f64 = 7.6 / 4.0;

/// [`Profile::CpuGemma270m`]'s constants, in sim tokens ([`CPU_GEMMA_SIM_TOKENS_PER_TOKEN`] a
/// Gemma token). Measured on one replica (vLLM 0.32 CPU build, float32, one core of a 2-core
/// AVX2 machine, `--max-num-seqs 4`) with `bench/real_engine.py --fit` (medians of TTFT and
/// TPOT from `vllm bench serve`, cold cache, no gateway):
/// * `block_size`: the CPU build's KV blocks hold 128 tokens (its log: `kv cache group sizes
///   (128, ...)`), so 243 sim tokens; prefix hits come in whole blocks, as there;
/// * `num_gpu_blocks`: the benchmark's `--num-gpu-blocks-override 320` holds 6,490 Gemma tokens
///   (the log: 41,527 tokens for 2,048 blocks, Gemma-3's sliding-window layers sharing them),
///   which is 51 blocks of 128 tokens;
/// * `max_num_batched_tokens`: vLLM's CPU default for the OpenAI server, 2,048 tokens, scaled;
/// * `step_base_ms` 35.1 and `decode_us_per_seq` 3,440: a lone request's TPOT (38.5 ms) is base
///   + one decode, four decoding together (48.8 ms) base + four;
/// * `prefill_us_per_token` 607: a lone request's TTFT grows by 1.153 ms a Gemma token from 64
///   to 1,024 prompt tokens (121 to 1,228 ms), 0.607 ms a sim token.
///
/// The engine alone, not under load: in `bench/real_engine.py`'s workloads (16 concurrent) the
/// sim with these constants and `--slowdown 1.33` served 1.3–2.5× the real engine's requests/s
/// (1 of 30 figures within ±20 %). There the replicas' API servers, the gateway and the client
/// share the two cores: the real step took 80–120 ms whether one request ran or four. The
/// benchmark passes step costs fitted to that load over these (`SIM_UNDER_LOAD` there, with the
/// run it was fitted to, and 1.5× the KV blocks); with each replica's prefix cache emptied
/// before every run (`POST /reset_prefix_cache`, as the real replicas'), that put 20 of 22
/// figures within ±20 % (docs/benchmarks.md, "On a real engine"). Before the sim served that
/// route, a later arm found the prompts of an earlier one (the same seed) still cached.
pub const CPU_GEMMA_270M: ProfileCosts = ProfileCosts {
    block_size: 243,
    num_gpu_blocks: 51,
    max_num_batched_tokens: 3891,
    step_base_ms: 35.1,
    prefill_us_per_token: 607.0,
    decode_us_per_seq: 3440.0,
};

impl Profile {
    /// The profile's constants.
    pub fn costs(self) -> ProfileCosts {
        match self {
            Self::H100Llama8b => H100_LLAMA_8B,
            Self::CpuGemma270m => CPU_GEMMA_270M,
        }
    }
}

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

impl Cli {
    /// Parses a command line (`args[0]` is the program name) and applies `--profile`: each
    /// profile constant whose flag was not given takes the profile's value.
    ///
    /// # Errors
    /// clap's error for an unknown flag or a value outside its range.
    pub fn try_parse_with_profile<I, T>(args: I) -> Result<Self, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        use clap::{CommandFactory as _, FromArgMatches as _};
        let matches = Self::command().try_get_matches_from(args)?;
        let mut cli = Self::from_arg_matches(&matches)?;
        let defaulted = |id: &str| {
            matches!(matches.value_source(id), None | Some(clap::parser::ValueSource::DefaultValue))
        };
        cli.sim.apply_profile(defaulted);
        Ok(cli)
    }
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
    /// Fixed engine: time to first token in milliseconds, counted from when the request leaves
    /// the queue; 0 to 3 600 000 (the batched engine ignores it).
    #[arg(long, default_value_t = 0.0, value_parser = parse_delay_ms)]
    pub ttft_ms: f64,
    /// Fixed engine: inter-token latency in milliseconds between two streamed tokens;
    /// 0 to 3 600 000 (the batched engine ignores it).
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
    /// Pacing model: `fixed` (`--ttft-ms`/`--itl-ms` per request, the default) or `batched`
    /// (vLLM V1's scheduler: steps, chunked prefill, a paged KV cache with prefix caching).
    #[arg(long, value_enum, default_value_t = EngineKind::Fixed)]
    pub engine: EngineKind,
    /// Batched engine: the engine whose costs the step-cost and cache-shape defaults model
    /// ([`Profile`]); a flag given on the command line overrides its profile's value.
    #[arg(long, value_enum, default_value_t = Profile::H100Llama8b)]
    pub profile: Profile,
    /// Batched engine: tokens per KV-cache block (vLLM `--block-size`); at least 1.
    #[arg(long, default_value_t = DEFAULT_BLOCK_SIZE, value_parser = clap::value_parser!(u32).range(1..))]
    pub block_size: u32,
    /// Batched engine: KV-cache blocks (vLLM `--num-gpu-blocks-override`); must hold
    /// `--max-model-len`. Default: Llama 3.1 8B in BF16 on one H100 80 GB: 80 GB x 0.9 less
    /// 16 GB of weights and ~4 GB of activations leaves ~52 GB, at 16 tokens x 128 KiB = 2 MiB a
    /// block (Meta's model card and `config.json`; vLLM's `gpu_memory_utilization` 0.9).
    #[arg(
        long,
        default_value_t = DEFAULT_NUM_GPU_BLOCKS,
        value_parser = clap::value_parser!(u32).range(1..=i64::from(MAX_NUM_GPU_BLOCKS))
    )]
    pub num_gpu_blocks: u32,
    /// Batched engine: tokens one step may compute, decode and prefill together
    /// (vLLM `--max-num-batched-tokens`); longer prompts are prefilled in chunks; at least 1.
    #[arg(long, default_value_t = DEFAULT_MAX_NUM_BATCHED_TOKENS, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_num_batched_tokens: u32,
    /// Batched engine: fixed cost of one step in milliseconds; 0 to 60 000. Default: reading
    /// Llama 3.1 8B's 16.06 GB of BF16 weights once at the H100 SXM's 3.35 TB/s (NVIDIA's
    /// datasheet) takes 4.8 ms.
    #[arg(long, default_value_t = DEFAULT_STEP_BASE_MS, value_parser = parse_step_base_ms)]
    pub step_base_ms: f64,
    /// Batched engine: cost of one uncached prompt token in microseconds; 0 to 1 000 000.
    /// Default: 2 x 8.03 GFLOP per token at 40 % of the H100 SXM's 989 TFLOP/s dense BF16 (NVIDIA's
    /// datasheet), i.e. 25,000 prompt tokens/s.
    #[arg(long, default_value_t = DEFAULT_PREFILL_US_PER_TOKEN, value_parser = parse_step_cost_us)]
    pub prefill_us_per_token: f64,
    /// Batched engine: cost of one decoding sequence per step in microseconds; 0 to 1 000 000.
    /// Default: reading a 1,000-token context's KV cache (128 KiB a token for Llama 3.1 8B) at
    /// 3.35 TB/s takes 39 us.
    #[arg(long, default_value_t = DEFAULT_DECODE_US_PER_SEQ, value_parser = parse_step_cost_us)]
    pub decode_us_per_seq: f64,
    /// Batched engine: multiplies every step time (3 = a replica three times slower);
    /// above 0, at most 1000.
    #[arg(long, default_value_t = 1.0, value_parser = parse_slowdown)]
    pub slowdown: f64,
    /// Batched engine: no prefix caching (vLLM `--no-enable-prefix-caching`): every prompt token
    /// is prefilled and the prefix-cache counters stay 0.
    #[arg(long = "no-enable-prefix-caching", action = clap::ArgAction::SetFalse)]
    pub enable_prefix_caching: bool,
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
            engine: EngineKind::Fixed,
            profile: Profile::H100Llama8b,
            block_size: DEFAULT_BLOCK_SIZE,
            num_gpu_blocks: DEFAULT_NUM_GPU_BLOCKS,
            max_num_batched_tokens: DEFAULT_MAX_NUM_BATCHED_TOKENS,
            step_base_ms: DEFAULT_STEP_BASE_MS,
            prefill_us_per_token: DEFAULT_PREFILL_US_PER_TOKEN,
            decode_us_per_seq: DEFAULT_DECODE_US_PER_SEQ,
            slowdown: 1.0,
            enable_prefix_caching: true,
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
    /// A batched-engine cost or `slowdown` is not finite or outside its range.
    #[error("{name} must be between {min} and {max}, got {value}")]
    Range {
        /// The flag's field name.
        name: &'static str,
        /// The rejected value.
        value: f64,
        /// The smallest accepted value.
        min: f64,
        /// The largest accepted value.
        max: f64,
    },
    /// `num_gpu_blocks` is above [`MAX_NUM_GPU_BLOCKS`].
    #[error("num_gpu_blocks must be at most {MAX_NUM_GPU_BLOCKS}, got {0}")]
    TooManyBlocks(u32),
    /// Batched engine: the KV cache cannot hold one request of `max_model_len` tokens (vLLM
    /// refuses to start in that case too).
    #[error(
        "num_gpu_blocks x block_size ({blocks} x {block_size}) must hold max_model_len ({max_model_len}) tokens"
    )]
    KvCacheTooSmall {
        /// `num_gpu_blocks`.
        blocks: u32,
        /// `block_size`.
        block_size: u32,
        /// `max_model_len`.
        max_model_len: u32,
    },
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
    /// The defaults with `profile`'s constants.
    pub fn with_profile(profile: Profile) -> Self {
        let mut config = Self { profile, ..Self::default() };
        config.apply_profile(|_| true);
        config
    }

    /// Sets each of [`ProfileCosts`]'s fields for which `defaulted(field name)` is true to
    /// [`SimConfig::profile`]'s value.
    pub fn apply_profile(&mut self, defaulted: impl Fn(&str) -> bool) {
        fn set<T>(defaulted: &impl Fn(&str) -> bool, name: &str, field: &mut T, value: T) {
            if defaulted(name) {
                *field = value;
            }
        }
        let c = self.profile.costs();
        set(&defaulted, "block_size", &mut self.block_size, c.block_size);
        set(&defaulted, "num_gpu_blocks", &mut self.num_gpu_blocks, c.num_gpu_blocks);
        set(&defaulted, "max_num_batched_tokens", &mut self.max_num_batched_tokens, c.max_num_batched_tokens);
        set(&defaulted, "step_base_ms", &mut self.step_base_ms, c.step_base_ms);
        set(&defaulted, "prefill_us_per_token", &mut self.prefill_us_per_token, c.prefill_us_per_token);
        set(&defaulted, "decode_us_per_seq", &mut self.decode_us_per_seq, c.decode_us_per_seq);
    }

    /// Checks every field against its documented range.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.served_model_names.is_empty() || self.served_model_names.iter().any(String::is_empty) {
            return Err(ConfigError::NoModelName);
        }
        for (name, value) in [
            ("max_model_len", self.max_model_len),
            ("output_tokens", self.output_tokens),
            ("max_num_seqs", self.max_num_seqs),
            ("block_size", self.block_size),
            ("num_gpu_blocks", self.num_gpu_blocks),
            ("max_num_batched_tokens", self.max_num_batched_tokens),
        ] {
            if value == 0 {
                return Err(ConfigError::Zero(name));
            }
        }
        if !(0.0..=1.0).contains(&self.error_rate) {
            return Err(ConfigError::ErrorRate(self.error_rate));
        }
        if self.num_gpu_blocks > MAX_NUM_GPU_BLOCKS {
            return Err(ConfigError::TooManyBlocks(self.num_gpu_blocks));
        }
        range("step_base_ms", self.step_base_ms, 0.0, MAX_STEP_BASE_MS)?;
        range("prefill_us_per_token", self.prefill_us_per_token, 0.0, MAX_STEP_COST_US)?;
        range("decode_us_per_seq", self.decode_us_per_seq, 0.0, MAX_STEP_COST_US)?;
        range("slowdown", self.slowdown, f64::MIN_POSITIVE, MAX_SLOWDOWN)?;
        let kv_tokens = u64::from(self.num_gpu_blocks).saturating_mul(u64::from(self.block_size));
        if self.engine == EngineKind::Batched && kv_tokens < u64::from(self.max_model_len) {
            return Err(ConfigError::KvCacheTooSmall {
                blocks: self.num_gpu_blocks,
                block_size: self.block_size,
                max_model_len: self.max_model_len,
            });
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

fn range(name: &'static str, value: f64, min: f64, max: f64) -> Result<f64, ConfigError> {
    if (min..=max).contains(&value) {
        Ok(value)
    } else {
        Err(ConfigError::Range { name, value, min, max })
    }
}

fn parse_in(text: &str, name: &'static str, min: f64, max: f64) -> Result<f64, String> {
    let value: f64 = text.parse().map_err(|e| format!("{e}"))?;
    range(name, value, min, max).map_err(|e| e.to_string())
}

fn parse_step_base_ms(text: &str) -> Result<f64, String> {
    parse_in(text, "step_base_ms", 0.0, MAX_STEP_BASE_MS)
}

fn parse_step_cost_us(text: &str) -> Result<f64, String> {
    parse_in(text, "cost", 0.0, MAX_STEP_COST_US)
}

fn parse_slowdown(text: &str) -> Result<f64, String> {
    parse_in(text, "slowdown", f64::MIN_POSITIVE, MAX_SLOWDOWN)
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
        assert_eq!(cli.sim.engine, EngineKind::Fixed);
        assert_eq!(cli.sim.block_size, d.block_size);
        assert_eq!(cli.sim.num_gpu_blocks, d.num_gpu_blocks);
        assert_eq!(cli.sim.max_num_batched_tokens, d.max_num_batched_tokens);
        assert_eq!(cli.sim.step_base_ms, d.step_base_ms);
        assert_eq!(cli.sim.prefill_us_per_token, d.prefill_us_per_token);
        assert_eq!(cli.sim.decode_us_per_seq, d.decode_us_per_seq);
        assert_eq!(cli.sim.slowdown, d.slowdown);
        assert!(cli.sim.enable_prefix_caching && d.enable_prefix_caching);
        assert!(d.validate().is_ok());
        let batched = SimConfig { engine: EngineKind::Batched, ..d };
        assert!(batched.validate().is_ok());
    }

    #[test]
    fn a_profile_sets_the_defaults_and_a_given_flag_wins() {
        let h100 = Cli::try_parse_with_profile(["vllm-sim"]).unwrap().sim;
        assert_eq!(h100.profile, Profile::H100Llama8b);
        assert_eq!(
            (h100.block_size, h100.step_base_ms, h100.prefill_us_per_token, h100.decode_us_per_seq),
            (
                DEFAULT_BLOCK_SIZE,
                DEFAULT_STEP_BASE_MS,
                DEFAULT_PREFILL_US_PER_TOKEN,
                DEFAULT_DECODE_US_PER_SEQ
            )
        );
        let cpu = Cli::try_parse_with_profile(["vllm-sim", "--profile", "cpu-gemma-270m"]).unwrap().sim;
        let c = CPU_GEMMA_270M;
        assert_eq!(
            (cpu.block_size, cpu.num_gpu_blocks, cpu.max_num_batched_tokens),
            (c.block_size, c.num_gpu_blocks, c.max_num_batched_tokens)
        );
        assert_eq!(
            (cpu.step_base_ms, cpu.prefill_us_per_token, cpu.decode_us_per_seq),
            (c.step_base_ms, c.prefill_us_per_token, c.decode_us_per_seq)
        );
        assert_eq!(SimConfig { engine: EngineKind::Batched, ..cpu.clone() }.validate(), Ok(()));
        assert_eq!(SimConfig::with_profile(Profile::CpuGemma270m).step_base_ms, c.step_base_ms);
        // A flag given on the command line is kept, even one equal to the other profile's value.
        let given = Cli::try_parse_with_profile([
            "vllm-sim",
            "--profile",
            "cpu-gemma-270m",
            "--num-gpu-blocks",
            "325",
            "--step-base-ms",
            "5",
        ])
        .unwrap()
        .sim;
        assert_eq!((given.num_gpu_blocks, given.step_base_ms), (325, 5.0));
        assert_eq!(given.decode_us_per_seq, c.decode_us_per_seq);
        assert!(Cli::try_parse_with_profile(["vllm-sim", "--profile", "a100"]).is_err());
    }

    #[test]
    fn batched_engine_flags_parse_and_are_checked() {
        let cli = Cli::parse_from([
            "vllm-sim",
            "--engine",
            "batched",
            "--block-size",
            "8",
            "--num-gpu-blocks",
            "600",
            "--max-num-batched-tokens",
            "512",
            "--step-base-ms",
            "2",
            "--prefill-us-per-token",
            "10",
            "--decode-us-per-seq",
            "20",
            "--slowdown",
            "3",
            "--no-enable-prefix-caching",
        ]);
        let s = &cli.sim;
        assert_eq!(s.engine, EngineKind::Batched);
        assert_eq!((s.block_size, s.num_gpu_blocks, s.max_num_batched_tokens), (8, 600, 512));
        assert_eq!((s.step_base_ms, s.prefill_us_per_token, s.decode_us_per_seq), (2.0, 10.0, 20.0));
        assert_eq!(s.slowdown, 3.0);
        assert!(!s.enable_prefix_caching);
        assert!(s.validate().is_ok());
        for bad in [
            ["--slowdown", "0"],
            ["--slowdown", "NaN"],
            ["--step-base-ms", "-1"],
            ["--decode-us-per-seq", "inf"],
            ["--engine", "fast"],
            ["--block-size", "0"],
            ["--num-gpu-blocks", "16777217"],
        ] {
            assert!(Cli::try_parse_from(["vllm-sim", bad[0], bad[1]]).is_err(), "{bad:?}");
        }
        // 600 blocks of 8 tokens hold 4800 >= 4096 tokens; 100 blocks do not.
        let small = SimConfig { num_gpu_blocks: 100, ..s.clone() };
        assert!(matches!(small.validate(), Err(ConfigError::KvCacheTooSmall { .. })));
        // The fixed engine ignores the KV-cache size.
        assert!(SimConfig { engine: EngineKind::Fixed, ..small }.validate().is_ok());
        let bad = SimConfig { num_gpu_blocks: u32::MAX, ..SimConfig::default() };
        assert_eq!(bad.validate(), Err(ConfigError::TooManyBlocks(u32::MAX)));
        let bad = SimConfig { slowdown: f64::INFINITY, ..SimConfig::default() };
        assert!(matches!(bad.validate(), Err(ConfigError::Range { name: "slowdown", .. })));
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
