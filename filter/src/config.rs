//! Plugin configuration: the JSON string given as the Envoy wasm plugin `configuration`,
//! parsed strictly (unknown fields are errors) and validated once, in `on_configure`.
//!
//! Schema (units in the field docs of the `Raw*` types below):
//!
//! ```json
//! {
//!   "max_body_bytes": 4194304,
//!   "full_parse_max_bytes": 131072,
//!   "tenants": [
//!     {"id": "demo", "api_keys": [{"name": "ci-2026", "sha256": "<64 lowercase hex>",
//!      "expires_at": "2026-12-31T00:00:00Z"}], "tier": "standard", "models": ["qwen", "llama"]}
//!   ],
//!   "models": [
//!     {"name": "qwen", "pool": "pool_a", "served_model_name": "Qwen/Qwen2.5-0.5B-Instruct",
//!      "max_model_len": 4096, "max_token_bytes": 256, "aliases": ["qwen-latest"],
//!      "lora_adapters": ["sql-lora"]},
//!     {"name": "llama", "pools": [{"pool": "pool_b", "weight": 90}, {"pool": "pool_c", "weight": 10}],
//!      "max_model_len": 8192}
//!   ]
//! }
//! ```
//!
//! Every error is a [`ConfigError`] whose text starts with the path of the offending field, e.g.
//! `models[1].max_model_len: must be > 0`.

use std::collections::HashMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::auth::{parse_utc_timestamp, KeyWindow};

/// Default `max_body_bytes` when the field is absent: 4 MiB.
pub const DEFAULT_MAX_BODY_BYTES: u64 = 4 * 1024 * 1024;
/// Default `full_parse_max_bytes` when the field is absent: 128 KiB. A full parse took 2.0-2.2 ms
/// p50 in Envoy's V8 for a 256 KB escape-heavy chat body (`python bench/overhead.py --scenarios
/// vmtime`, before this threshold existed); 128 KiB keeps it near half that, not measured itself.
pub const DEFAULT_FULL_PARSE_MAX_BYTES: u64 = 128 * 1024;
/// Default `max_uploads_per_tenant`: request bodies of one tenant that one worker's VM buffers at
/// once. See [`crate::uploads`].
pub const DEFAULT_MAX_UPLOADS_PER_TENANT: u32 = 8;
/// Default `max_n`: the most sequences a request may ask vLLM to generate per prompt (`n`, and
/// on completions `best_of`): vLLM's own limit, `VLLM_MAX_N_SEQUENCES` (16384 in vLLM 0.32,
/// `vllm/envs.py`), which refuses more with a 400 of its own.
pub const DEFAULT_MAX_N: u64 = 16_384;
/// Default `tier` of a tenant when the field is absent.
pub const DEFAULT_TIER: &str = "standard";
/// Default `admission_leases.refresh_ms`: how often leases are renewed, in milliseconds.
pub const DEFAULT_LEASE_REFRESH_MS: u64 = 100;
/// Default `admission_leases.timeout_ms`: one lease call's timeout, in milliseconds.
pub const DEFAULT_LEASE_TIMEOUT_MS: u64 = 500;
/// Default `prefix_hashing.block_bytes`: bytes of prompt text per hashed block (the Gateway API
/// Inference Extension prefix-cache scorer's default block size, 64).
pub const DEFAULT_PREFIX_BLOCK_BYTES: u32 = 64;
/// Default `prefix_hashing.max_blocks`: leading blocks hashed per request (the Inference
/// Extension scorer's default, 256: the first 16 KiB of the prompt at 64-byte blocks).
pub const DEFAULT_PREFIX_MAX_BLOCKS: u32 = 256;
/// Largest `prefix_hashing.block_bytes` accepted.
pub const MAX_PREFIX_BLOCK_BYTES: u32 = 1 << 20;
/// Largest `prefix_hashing.max_blocks` accepted (the hashes travel in every request's facts:
/// 11 bytes of JSON per block).
pub const MAX_PREFIX_MAX_BLOCKS: u32 = gateway_contract::MAX_PREFIX_HASHES as u32;
/// Default `max_token_bytes` of a model when the field is absent: 1024 bytes.
///
/// Deliberately larger than the longest token of common byte-level BPE vocabularies (including
/// added/special tokens), so that the context check stays a true lower bound for any model that
/// does not declare its own value; a model that declares its real value gets a tighter check.
pub const DEFAULT_MAX_TOKEN_BYTES: u64 = 1024;
/// Longest identifier (tenant id, tier, model name, alias, adapter, pool) accepted, in bytes.
pub const MAX_IDENT_BYTES: usize = 256;

/// A configuration error: `path` names the field (`tenants[0].api_keys_sha256[1]`), `message`
/// says what is wrong. Displays as `"{path}: {message}"`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// Path of the offending field, e.g. `models[1].max_model_len`; `configuration` for the
    /// document as a whole.
    pub path: String,
    /// What is wrong with it.
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path, self.message)
    }
}

impl std::error::Error for ConfigError {}

fn err(path: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError { path: path.into(), message: message.into() }
}

// ---------------------------------------------------------------------------------------------
// Raw (wire) shapes
// ---------------------------------------------------------------------------------------------

/// The plugin configuration document as written.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    /// Largest accepted request body, in bytes. Optional, default [`DEFAULT_MAX_BODY_BYTES`];
    /// must be > 0. Envoy's buffer limit (`per_connection_buffer_limit_bytes`) must be at least
    /// this large or Envoy answers 413 itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_body_bytes: Option<u64>,
    /// Largest body parsed and validated in full in the VM, in bytes. Optional, default
    /// [`DEFAULT_FULL_PARSE_MAX_BYTES`]; must be > 0. A larger body is only scanned for its
    /// top-level members (so that no request holds an Envoy worker for long): its `messages` /
    /// `prompt` are validated and its context length checked by the sidecar (models with
    /// `exact_count`) or by vLLM. See `pipeline::on_request_body`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub full_parse_max_bytes: Option<u64>,
    /// Request bodies of one tenant that one Envoy worker buffers at once (from its request
    /// headers to the end of its body). Optional, default [`DEFAULT_MAX_UPLOADS_PER_TENANT`];
    /// must be > 0. Past it the tenant's next request is answered 429 at its headers: slow
    /// bodies cannot hold a worker's memory for one key. See [`crate::uploads`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_uploads_per_tenant: Option<u32>,
    /// The most sequences a request may ask for per prompt: OpenAI's `n` (choices), and on
    /// completions `best_of`. Optional, default [`DEFAULT_MAX_N`] (vLLM's
    /// `VLLM_MAX_N_SEQUENCES`); must be > 0. A request over it is answered 400 `invalid_value`
    /// naming the parameter, before any reservation (each sequence is reserved its
    /// `max_tokens`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_n: Option<u64>,
    /// Tenants and their API-key digests. Required, non-empty.
    pub tenants: Vec<RawTenant>,
    /// Served models. Required, non-empty.
    pub models: Vec<RawModel>,
    /// Admission leases from the sidecar (optional; absent: every request goes through the
    /// ext_proc admission). See [`crate::lease`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub admission_leases: Option<RawAdmissionLeases>,
    /// Prompt-prefix hashes for the sidecar's endpoint picker (optional; absent: none are
    /// computed, and the picker has no prefix affinity). See [`crate::prefix`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix_hashing: Option<RawPrefixHashing>,
    /// Which `x-gateway-*` headers the filter sets on a forwarded request (optional, default
    /// `"all"`, [`UpstreamHeaders`]): `"all"` (the whole header contract, filter/README.md) or
    /// `"routing"` (only `x-gateway-pool`, which Envoy's route needs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upstream_headers: Option<String>,
}

/// `upstream_headers`: which of the header contract's `x-gateway-*` request headers a forwarded
/// request carries. The decision itself always travels in the filter state
/// `wasm.llm_gateway.request`, which is what the sidecar's admission (`request_facts:
/// filter_state`, its default) and the metering access log read; each header is one host call
/// into Envoy (about 0.8-0.9 us of Envoy CPU measured, filter/README.md).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum UpstreamHeaders {
    /// Every header of the contract: tenant, tier, model, pool, the prompt-token estimate and
    /// its source, max tokens, `x-gateway-usage-injected`, the context-check pair and
    /// `x-gateway-request-nonce`. Needed by a sidecar with `request_facts: headers` and by
    /// anything else that reads them (an upstream's logs, Envoy rate-limit descriptors).
    #[default]
    All,
    /// Only `x-gateway-pool` (and `content-length` of a rewritten body): what Envoy's route
    /// (`cluster_header: x-gateway-pool`) needs; gatewayctl's rendering (its sidecars read the
    /// filter state).
    Routing,
}

/// `prefix_hashing`: how the filter hashes the prompt's leading blocks into the facts.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawPrefixHashing {
    /// Bytes of prompt text per block. Optional, default [`DEFAULT_PREFIX_BLOCK_BYTES`]; in
    /// 1..=[`MAX_PREFIX_BLOCK_BYTES`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_bytes: Option<u32>,
    /// Most leading blocks hashed. Optional, default [`DEFAULT_PREFIX_MAX_BLOCKS`]; in
    /// 1..=[`MAX_PREFIX_MAX_BLOCKS`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_blocks: Option<u32>,
}

/// `admission_leases`: where the filter asks the sidecar for leases, and how often it looks.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawAdmissionLeases {
    /// The Envoy cluster of the sidecar's gRPC listener (the ext_proc cluster, e.g.
    /// `llm_gateway_ext_proc`). Required, non-empty.
    pub cluster: String,
    /// How often each worker's filter VM renews, gives back and asks for leases, in milliseconds.
    /// Optional, default [`DEFAULT_LEASE_REFRESH_MS`]; in 10..=10000.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refresh_ms: Option<u64>,
    /// Timeout of one lease call to the sidecar, in milliseconds. Optional, default
    /// [`DEFAULT_LEASE_TIMEOUT_MS`]; in 1..=60000.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
}

/// One tenant.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawTenant {
    /// Tenant id sent upstream as `x-gateway-tenant`. Required, unique, 1..=256 visible ASCII.
    pub id: String,
    /// SHA-256 digests of API keys without a name or a window, each exactly 64 lowercase hex
    /// characters; each is named `sha256:` and its first 12 hex characters
    /// ([`derived_key_name`]). Optional; must not be empty when present. A tenant needs at least
    /// one key here or in `api_keys`; a digest may belong to one key only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_keys_sha256: Option<Vec<String>>,
    /// The tenant's named API keys. Optional; must not be empty when present.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_keys: Option<Vec<RawApiKey>>,
    /// Rate-limit tier sent upstream as `x-gateway-tier`. Optional, default [`DEFAULT_TIER`];
    /// 1..=256 visible ASCII.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tier: Option<String>,
    /// Models the tenant may use, by model name, alias or LoRA adapter name. Optional: absent
    /// means every model. Listing a model allows it and all its LoRA adapters; listing an adapter
    /// allows only that adapter. Must not be empty when present.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub models: Option<Vec<String>>,
}

/// One named API key of a tenant.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawApiKey {
    /// The key's name, unique within its tenant: what usage records, metrics and the sidecar's
    /// per-key limits go by. Required; 1..=128 letters, digits, `.`, `_` or `-`.
    pub name: String,
    /// SHA-256 of the key, exactly 64 lowercase hex characters. Required.
    pub sha256: String,
    /// First moment the key is valid, RFC 3339 in UTC (`YYYY-MM-DDTHH:MM:SSZ`). Optional.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_before: Option<String>,
    /// Moment from which the key is refused, RFC 3339 in UTC (`YYYY-MM-DDTHH:MM:SSZ`); after
    /// `not_before`. Optional.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<String>,
    /// Whether the sidecar holds limits of this key's own (on top of the tenant's): its requests
    /// are then never admitted from an admission lease, which covers only the tenant's buckets.
    /// Optional, default false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub own_limits: Option<bool>,
}

/// Longest API key name accepted, in bytes.
pub const MAX_KEY_NAME_BYTES: usize = 128;

/// The name of a key listed by its digest alone (`api_keys_sha256`): `sha256:` and the digest's
/// first 12 hex characters.
pub fn derived_key_name(digest_hex: &str) -> String {
    format!("sha256:{}", digest_hex.get(..12).unwrap_or(digest_hex))
}

/// Whether `name` is a valid API key name: 1..=[`MAX_KEY_NAME_BYTES`] letters, digits, `.`, `_`
/// or `-`.
pub fn is_key_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_KEY_NAME_BYTES
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// One served model.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawModel {
    /// Public (canonical) model name, as clients send it in `model` and as `x-gateway-model`.
    /// Required, 1..=256 visible ASCII, unique across all names, aliases and adapters.
    pub name: String,
    /// Envoy cluster that serves the model (sent as `x-gateway-pool`). Exactly one of `pool` and
    /// `pools` is required.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<String>,
    /// Weighted split across clusters; the pool is picked deterministically from a hash of
    /// `x-request-id`. Exactly one of `pool` and `pools` is required.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pools: Option<Vec<RawWeightedPool>>,
    /// Model name the vLLM server expects in the body (vLLM `--served-model-name`). Optional,
    /// default `name`; must not be empty.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub served_model_name: Option<String>,
    /// The model's context window in tokens (vLLM `--max-model-len`). Required, > 0.
    pub max_model_len: u64,
    /// Length in bytes of the longest token (including added/special tokens) of the model's
    /// byte-level BPE vocabulary; the context check's lower bound is
    /// `ceil(prompt_bytes / max_token_bytes)`. Optional, default [`DEFAULT_MAX_TOKEN_BYTES`];
    /// must be > 0. Too small a value can reject requests vLLM would accept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_token_bytes: Option<u64>,
    /// Other names clients may use for the model. Optional; each unique across all names.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub aliases: Option<Vec<String>>,
    /// LoRA adapters loaded on the model's pool (vLLM `--lora-modules`). A request for an adapter
    /// routes to the base model's pool and keeps the adapter name in the body. Optional; each
    /// unique across all names.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora_adapters: Option<Vec<String>>,
    /// Bytes the chat template adds to the messages' roles and text, for the upper bound on
    /// prompt tokens (a prompt never has more tokens than bytes of its rendered text). Optional:
    /// absent, chat prompts have no upper bound and only an exact count can accept one near the
    /// limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template_overhead_bytes: Option<RawTemplateOverhead>,
    /// The tokenizer's Unicode normalization, `none` or `nfc` (NFC can lengthen non-ASCII text
    /// up to 3x, which the upper bound then allows for). Optional, default `none`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub normalization: Option<String>,
    /// Whether the sidecar counts this model's prompts exactly (its `models` lists the model's
    /// tokenizer): requests the bounds cannot decide then carry `x-gateway-context-check: exact`.
    /// Optional, default false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exact_count: Option<bool>,
}

/// What a model's chat template adds, in bytes of rendered text (see the README's context
/// check section for how to measure it).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawTemplateOverhead {
    /// Most bytes the template writes around one message besides its role and text (ChatML:
    /// `<|im_start|>` + `\n` + `<|im_end|>` + `\n` = 24). Required.
    pub per_message: u64,
    /// Most bytes the template writes once per conversation: BOS, the generation prompt, and a
    /// default system prompt it adds when the request has none (Qwen2.5: 120, the generation
    /// prompt's 22 and the default system prompt's 98).
    /// Required.
    pub fixed: u64,
}

/// One entry of a weighted split.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawWeightedPool {
    /// Envoy cluster name. Required, 1..=256 visible ASCII, unique within the split.
    pub pool: String,
    /// Relative weight (0 drains the pool). Required; the weights of a split must sum to > 0.
    pub weight: u32,
}

// ---------------------------------------------------------------------------------------------
// Compiled shapes
// ---------------------------------------------------------------------------------------------

/// The validated, compiled configuration shared (via `Rc`) by every HTTP context.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// Largest accepted request body in bytes.
    pub max_body_bytes: u64,
    /// Largest body parsed in full, in bytes.
    pub full_parse_max_bytes: u64,
    /// Bodies of one tenant one worker buffers at once (> 0).
    pub max_uploads_per_tenant: u32,
    /// The most sequences per prompt (`n`, `best_of`) a request may ask for (> 0).
    pub max_n: u64,
    /// Tenants in configuration order.
    pub tenants: Vec<Tenant>,
    /// Models in configuration order.
    pub models: Vec<Model>,
    /// The API keys (named and by digest alone), in configuration order.
    pub api_keys: Vec<ApiKey>,
    /// Decoded API-key digests with the index of their key in [`Config::api_keys`].
    pub key_digests: Vec<([u8; 32], usize)>,
    /// Admission leases, when configured.
    pub admission_leases: Option<AdmissionLeases>,
    /// Prompt-prefix hashing, when configured.
    pub prefix_hashing: Option<PrefixHashing>,
    /// Which `x-gateway-*` headers a forwarded request carries.
    pub upstream_headers: UpstreamHeaders,
    lookup: HashMap<String, Target>,
}

/// The validated `admission_leases` section.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdmissionLeases {
    /// The sidecar's Envoy cluster (gRPC).
    pub cluster: String,
    /// Tick period of the filter's root context, in milliseconds.
    pub refresh_ms: u64,
    /// Timeout of one lease call, in milliseconds.
    pub timeout_ms: u64,
}

/// The validated `prefix_hashing` section.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefixHashing {
    /// Bytes of prompt text per block (> 0).
    pub block_bytes: u32,
    /// Most leading blocks hashed (> 0).
    pub max_blocks: u32,
}

/// What a public model identifier resolves to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Target {
    /// Index into [`Config::models`].
    pub model: usize,
    /// Index into that model's `lora_adapters` when the identifier names an adapter.
    pub adapter: Option<usize>,
}

/// A validated tenant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tenant {
    /// Tenant id.
    pub id: String,
    /// Tier.
    pub tier: String,
    /// `None`: every model. `Some`: the listed targets (a base-model target, `adapter: None`,
    /// also grants the model's adapters).
    pub allowed: Option<Vec<Target>>,
}

/// A validated API key (its digest is in [`Config::key_digests`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiKey {
    /// Its name ([`RawApiKey::name`], or [`derived_key_name`]).
    pub name: String,
    /// Index of its tenant in [`Config::tenants`].
    pub tenant: usize,
    /// When it may be used.
    pub window: KeyWindow,
    /// Whether the sidecar limits it on its own (never admitted from a lease).
    pub own_limits: bool,
}

/// A validated model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Model {
    /// Canonical public name.
    pub name: String,
    /// One entry for `pool`, the split for `pools`.
    pub pools: Vec<WeightedPool>,
    /// Name vLLM expects in the body.
    pub served_model_name: String,
    /// Context window in tokens.
    pub max_model_len: u64,
    /// Longest token of the vocabulary in bytes.
    pub max_token_bytes: u64,
    /// Aliases.
    pub aliases: Vec<String>,
    /// LoRA adapter names.
    pub lora_adapters: Vec<String>,
    /// Bytes the chat template adds (None: unknown, no upper bound for chat prompts).
    pub template_overhead: Option<TemplateOverhead>,
    /// Whether the tokenizer applies NFC (the upper bound allows 3x for non-ASCII bytes).
    pub nfc: bool,
    /// Whether the sidecar can count this model's prompts exactly.
    pub exact_count: bool,
}

/// A validated [`RawTemplateOverhead`], in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TemplateOverhead {
    /// Per message, besides role and text.
    pub per_message: u64,
    /// Once per conversation.
    pub fixed: u64,
}

/// A validated pool with its weight (1 for a single `pool`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WeightedPool {
    /// Envoy cluster name.
    pub pool: String,
    /// Relative weight.
    pub weight: u32,
}

impl Tenant {
    /// Whether the tenant may use `target`.
    pub fn allows(&self, target: Target) -> bool {
        match &self.allowed {
            None => true,
            Some(list) => {
                list.iter().any(|t| *t == target || (t.model == target.model && t.adapter.is_none()))
            }
        }
    }
}

impl Config {
    /// Parses and validates the plugin configuration bytes.
    ///
    /// # Errors
    /// A [`ConfigError`] naming the first offending field: JSON syntax and type errors and
    /// unknown fields (with their path, via `serde_path_to_error`), then the semantic checks
    /// documented on the `Raw*` fields.
    pub fn from_json(bytes: &[u8]) -> Result<Config, ConfigError> {
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Err(err("configuration", "must not be empty"));
        }
        let de = &mut serde_json::Deserializer::from_slice(bytes);
        let raw: RawConfig = serde_path_to_error::deserialize(de).map_err(|e| {
            let path = e.path().to_string();
            let path = if path == "." || path == "?" { "configuration".to_string() } else { path };
            let inner = e.into_inner();
            let mut message = inner.to_string();
            // Data errors are located by the path; syntax errors keep "at line L column C".
            if inner.classify() == serde_json::error::Category::Data {
                let suffix = format!(" at line {} column {}", inner.line(), inner.column());
                if let Some(stripped) = message.strip_suffix(&suffix) {
                    message = stripped.to_string();
                }
            }
            err(path, message)
        })?;
        Config::from_raw(raw)
    }

    /// Validates an already deserialized [`RawConfig`]. Errors as for [`Config::from_json`].
    pub fn from_raw(raw: RawConfig) -> Result<Config, ConfigError> {
        let max_body_bytes = raw.max_body_bytes.unwrap_or(DEFAULT_MAX_BODY_BYTES);
        let full_parse_max_bytes = raw.full_parse_max_bytes.unwrap_or(DEFAULT_FULL_PARSE_MAX_BYTES);
        if full_parse_max_bytes == 0 {
            return Err(err("full_parse_max_bytes", "must be > 0"));
        }
        if max_body_bytes == 0 {
            return Err(err("max_body_bytes", "must be > 0"));
        }
        let max_uploads_per_tenant = raw.max_uploads_per_tenant.unwrap_or(DEFAULT_MAX_UPLOADS_PER_TENANT);
        if max_uploads_per_tenant == 0 {
            return Err(err("max_uploads_per_tenant", "must be > 0"));
        }
        let max_n = raw.max_n.unwrap_or(DEFAULT_MAX_N);
        if max_n == 0 {
            return Err(err("max_n", "must be > 0"));
        }
        if raw.models.is_empty() {
            return Err(err("models", "must not be empty"));
        }
        if raw.tenants.is_empty() {
            return Err(err("tenants", "must not be empty"));
        }

        let mut models = Vec::with_capacity(raw.models.len());
        // identifier -> (target, path where first defined)
        let mut names: HashMap<String, (Target, String)> = HashMap::new();
        for (i, m) in raw.models.into_iter().enumerate() {
            let at = format!("models[{i}]");
            check_ident(&format!("{at}.name"), &m.name)?;
            claim(&mut names, &m.name, Target { model: i, adapter: None }, format!("{at}.name"))?;

            let pools = match (m.pool, m.pools) {
                (Some(_), Some(_)) | (None, None) => {
                    return Err(err(at, "exactly one of `pool` and `pools` must be set"));
                }
                (Some(p), None) => {
                    check_ident(&format!("{at}.pool"), &p)?;
                    vec![WeightedPool { pool: p, weight: 1 }]
                }
                (None, Some(list)) => compile_pools(&at, list)?,
            };
            let served_model_name = match m.served_model_name {
                Some(s) if s.is_empty() => {
                    return Err(err(format!("{at}.served_model_name"), "must not be empty"));
                }
                Some(s) => s,
                None => m.name.clone(),
            };
            if m.max_model_len == 0 {
                return Err(err(format!("{at}.max_model_len"), "must be > 0"));
            }
            let max_token_bytes = m.max_token_bytes.unwrap_or(DEFAULT_MAX_TOKEN_BYTES);
            if max_token_bytes == 0 {
                return Err(err(format!("{at}.max_token_bytes"), "must be > 0"));
            }
            let aliases = m.aliases.unwrap_or_default();
            for (j, a) in aliases.iter().enumerate() {
                let p = format!("{at}.aliases[{j}]");
                check_ident(&p, a)?;
                claim(&mut names, a, Target { model: i, adapter: None }, p)?;
            }
            let lora_adapters = m.lora_adapters.unwrap_or_default();
            for (j, a) in lora_adapters.iter().enumerate() {
                let p = format!("{at}.lora_adapters[{j}]");
                check_ident(&p, a)?;
                claim(&mut names, a, Target { model: i, adapter: Some(j) }, p)?;
            }
            let nfc = match m.normalization.as_deref() {
                None | Some("none") => false,
                Some("nfc") => true,
                Some(_) => return Err(err(format!("{at}.normalization"), "must be \"none\" or \"nfc\"")),
            };
            models.push(Model {
                name: m.name,
                pools,
                served_model_name,
                max_model_len: m.max_model_len,
                max_token_bytes,
                aliases,
                lora_adapters,
                template_overhead: m
                    .template_overhead_bytes
                    .map(|t| TemplateOverhead { per_message: t.per_message, fixed: t.fixed }),
                nfc,
                exact_count: m.exact_count.unwrap_or(false),
            });
        }

        let mut tenants = Vec::with_capacity(raw.tenants.len());
        let mut key_digests = Vec::new();
        let mut api_keys = Vec::new();
        let mut tenant_ids: HashMap<String, usize> = HashMap::new();
        let mut digest_paths: HashMap<[u8; 32], String> = HashMap::new();
        for (i, t) in raw.tenants.into_iter().enumerate() {
            let at = format!("tenants[{i}]");
            check_ident(&format!("{at}.id"), &t.id)?;
            if let Some(first) = tenant_ids.get(&t.id) {
                return Err(err(
                    format!("{at}.id"),
                    format!("duplicate tenant id \"{}\" (first defined at tenants[{first}].id)", t.id),
                ));
            }
            tenant_ids.insert(t.id.clone(), i);
            let mut keys =
                TenantKeys { tenant: i, at: &at, digest_paths: &mut digest_paths, names: Vec::new() };
            for (digest, key) in keys.compile(t.api_keys_sha256, t.api_keys)? {
                key_digests.push((digest, api_keys.len()));
                api_keys.push(key);
            }
            let tier = match t.tier {
                Some(tier) => {
                    check_ident(&format!("{at}.tier"), &tier)?;
                    tier
                }
                None => DEFAULT_TIER.to_string(),
            };
            let allowed = match t.models {
                None => None,
                Some(list) if list.is_empty() => {
                    return Err(err(
                        format!("{at}.models"),
                        "must not be empty (omit the field to allow every model)",
                    ));
                }
                Some(list) => {
                    let mut targets: Vec<Target> = Vec::with_capacity(list.len());
                    for (j, name) in list.iter().enumerate() {
                        let p = format!("{at}.models[{j}]");
                        let target = names
                            .get(name)
                            .map(|(t, _)| *t)
                            .ok_or_else(|| err(&p, format!("unknown model \"{name}\"")))?;
                        if targets.contains(&target) {
                            return Err(err(p, format!("duplicate entry \"{name}\"")));
                        }
                        targets.push(target);
                    }
                    Some(targets)
                }
            };
            tenants.push(Tenant { id: t.id, tier, allowed });
        }

        let upstream_headers = match raw.upstream_headers.as_deref() {
            None | Some("all") => UpstreamHeaders::All,
            Some("routing") => UpstreamHeaders::Routing,
            Some(_) => return Err(err("upstream_headers", "must be \"all\" or \"routing\"")),
        };
        let lookup = names.into_iter().map(|(k, (t, _))| (k, t)).collect();
        let admission_leases = raw.admission_leases.map(compile_leases).transpose()?;
        let prefix_hashing = raw.prefix_hashing.map(compile_prefix_hashing).transpose()?;
        Ok(Config {
            max_body_bytes,
            full_parse_max_bytes,
            max_uploads_per_tenant,
            max_n,
            tenants,
            models,
            api_keys,
            key_digests,
            admission_leases,
            prefix_hashing,
            upstream_headers,
            lookup,
        })
    }

    /// Resolves a public model identifier (name, alias or LoRA adapter; exact, case-sensitive).
    pub fn resolve(&self, name: &str) -> Option<Target> {
        self.lookup.get(name).copied()
    }
}

/// One tenant's keys being compiled: the digests seen so far in the whole config (path of
/// each) and the names seen in this tenant.
struct TenantKeys<'a> {
    tenant: usize,
    at: &'a str,
    digest_paths: &'a mut HashMap<[u8; 32], String>,
    names: Vec<String>,
}

impl TenantKeys<'_> {
    /// The tenant's keys, `api_keys_sha256` first, each with its decoded digest.
    fn compile(
        &mut self,
        by_digest: Option<Vec<String>>,
        named: Option<Vec<RawApiKey>>,
    ) -> Result<Vec<([u8; 32], ApiKey)>, ConfigError> {
        let at = self.at;
        if by_digest.is_none() && named.is_none() {
            return Err(err(
                format!("{at}.api_keys"),
                "a tenant needs at least one key (api_keys, or api_keys_sha256)",
            ));
        }
        let mut out = Vec::new();
        if let Some(list) = by_digest {
            if list.is_empty() {
                return Err(err(format!("{at}.api_keys_sha256"), "must not be empty"));
            }
            for (j, d) in list.iter().enumerate() {
                let path = format!("{at}.api_keys_sha256[{j}]");
                let digest = self.digest(&path, d)?;
                let key = self.key(&path, derived_key_name(d), KeyWindow::default(), false)?;
                out.push((digest, key));
            }
        }
        if let Some(list) = named {
            if list.is_empty() {
                return Err(err(format!("{at}.api_keys"), "must not be empty"));
            }
            for (j, k) in list.into_iter().enumerate() {
                let path = format!("{at}.api_keys[{j}]");
                if !is_key_name(&k.name) {
                    return Err(err(
                        format!("{path}.name"),
                        format!("must be 1 to {MAX_KEY_NAME_BYTES} letters, digits, '.', '_' or '-'"),
                    ));
                }
                let digest = self.digest(&format!("{path}.sha256"), &k.sha256)?;
                let window = compile_window(&path, k.not_before.as_deref(), k.expires_at.as_deref())?;
                let key = self.key(&format!("{path}.name"), k.name, window, k.own_limits.unwrap_or(false))?;
                out.push((digest, key));
            }
        }
        Ok(out)
    }

    fn digest(&mut self, path: &str, hex: &str) -> Result<[u8; 32], ConfigError> {
        let digest = decode_digest(hex).ok_or_else(|| {
            err(path, "must be exactly 64 lowercase hex characters (the SHA-256 of the key)")
        })?;
        if let Some(first) = self.digest_paths.get(&digest) {
            return Err(err(path, format!("duplicate digest (also at {first})")));
        }
        self.digest_paths.insert(digest, path.to_string());
        Ok(digest)
    }

    fn key(
        &mut self,
        path: &str,
        name: String,
        window: KeyWindow,
        own_limits: bool,
    ) -> Result<ApiKey, ConfigError> {
        if self.names.contains(&name) {
            return Err(err(path, format!("duplicate key name \"{name}\" in the tenant")));
        }
        self.names.push(name.clone());
        Ok(ApiKey { name, tenant: self.tenant, window, own_limits })
    }
}

/// A key's window from its `not_before` and `expires_at` (`at` is the key's path).
fn compile_window(
    at: &str,
    not_before: Option<&str>,
    expires_at: Option<&str>,
) -> Result<KeyWindow, ConfigError> {
    let read = |field: &str, value: Option<&str>| -> Result<Option<u64>, ConfigError> {
        value
            .map(|v| {
                parse_utc_timestamp(v).ok_or_else(|| {
                    err(format!("{at}.{field}"), "must be an RFC 3339 time in UTC, YYYY-MM-DDTHH:MM:SSZ")
                })
            })
            .transpose()
    };
    let window = KeyWindow {
        not_before: read("not_before", not_before)?,
        expires_at: read("expires_at", expires_at)?,
    };
    if let (Some(from), Some(to)) = (window.not_before, window.expires_at) {
        if to <= from {
            return Err(err(format!("{at}.expires_at"), "must be after not_before"));
        }
    }
    Ok(window)
}

fn compile_prefix_hashing(raw: RawPrefixHashing) -> Result<PrefixHashing, ConfigError> {
    let block_bytes = raw.block_bytes.unwrap_or(DEFAULT_PREFIX_BLOCK_BYTES);
    if !(1..=MAX_PREFIX_BLOCK_BYTES).contains(&block_bytes) {
        return Err(err("prefix_hashing.block_bytes", format!("must be in 1..={MAX_PREFIX_BLOCK_BYTES}")));
    }
    let max_blocks = raw.max_blocks.unwrap_or(DEFAULT_PREFIX_MAX_BLOCKS);
    if !(1..=MAX_PREFIX_MAX_BLOCKS).contains(&max_blocks) {
        return Err(err("prefix_hashing.max_blocks", format!("must be in 1..={MAX_PREFIX_MAX_BLOCKS}")));
    }
    Ok(PrefixHashing { block_bytes, max_blocks })
}

fn compile_leases(raw: RawAdmissionLeases) -> Result<AdmissionLeases, ConfigError> {
    if raw.cluster.trim().is_empty() {
        return Err(err("admission_leases.cluster", "must not be empty"));
    }
    let refresh_ms = raw.refresh_ms.unwrap_or(DEFAULT_LEASE_REFRESH_MS);
    if !(10..=10_000).contains(&refresh_ms) {
        return Err(err("admission_leases.refresh_ms", "must be in 10..=10000"));
    }
    let timeout_ms = raw.timeout_ms.unwrap_or(DEFAULT_LEASE_TIMEOUT_MS);
    if !(1..=60_000).contains(&timeout_ms) {
        return Err(err("admission_leases.timeout_ms", "must be in 1..=60000"));
    }
    Ok(AdmissionLeases { cluster: raw.cluster, refresh_ms, timeout_ms })
}

fn compile_pools(at: &str, list: Vec<RawWeightedPool>) -> Result<Vec<WeightedPool>, ConfigError> {
    if list.is_empty() {
        return Err(err(format!("{at}.pools"), "must not be empty"));
    }
    let mut out: Vec<WeightedPool> = Vec::with_capacity(list.len());
    let mut total: u64 = 0;
    for (j, p) in list.into_iter().enumerate() {
        let path = format!("{at}.pools[{j}].pool");
        check_ident(&path, &p.pool)?;
        if out.iter().any(|q| q.pool == p.pool) {
            return Err(err(path, format!("duplicate pool \"{}\"", p.pool)));
        }
        total += u64::from(p.weight);
        out.push(WeightedPool { pool: p.pool, weight: p.weight });
    }
    if total == 0 {
        return Err(err(format!("{at}.pools"), "weights must sum to > 0"));
    }
    Ok(out)
}

fn claim(
    names: &mut HashMap<String, (Target, String)>,
    name: &str,
    target: Target,
    path: String,
) -> Result<(), ConfigError> {
    if let Some((_, first)) = names.get(name) {
        return Err(err(
            path,
            format!("duplicate model name, alias or adapter \"{name}\" (first defined at {first})"),
        ));
    }
    names.insert(name.to_string(), (target, path));
    Ok(())
}

/// Identifiers travel in request headers and Envoy cluster names: 1..=256 bytes of visible ASCII
/// (0x21..=0x7E, so no spaces or control characters).
fn check_ident(path: &str, s: &str) -> Result<(), ConfigError> {
    if s.is_empty() || s.len() > MAX_IDENT_BYTES || !s.bytes().all(|b| (0x21..=0x7e).contains(&b)) {
        return Err(err(
            path,
            format!("must be 1 to {MAX_IDENT_BYTES} visible ASCII characters (no spaces)"),
        ));
    }
    Ok(())
}

fn decode_digest(s: &str) -> Option<[u8; 32]> {
    if s.len() != 64 || !s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
        return None;
    }
    let mut out = [0u8; 32];
    hex::decode_to_slice(s, &mut out).ok()?;
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    const D1: &str = "1111111111111111111111111111111111111111111111111111111111111111";
    const D2: &str = "2222222222222222222222222222222222222222222222222222222222222222";

    fn base() -> Value {
        json!({
            "max_body_bytes": 4194304,
            "tenants": [
                {"id": "demo", "api_keys_sha256": [D1], "tier": "standard", "models": ["qwen", "llama"]},
                {"id": "other", "api_keys_sha256": [D2]}
            ],
            "models": [
                {"name": "qwen", "pool": "pool_a", "served_model_name": "Qwen/Qwen2.5-0.5B-Instruct",
                 "max_model_len": 4096, "max_token_bytes": 256, "aliases": ["qwen-latest"],
                 "lora_adapters": ["sql-lora"]},
                {"name": "llama", "pools": [{"pool": "pool_b", "weight": 90}, {"pool": "pool_c", "weight": 10}],
                 "max_model_len": 8192}
            ]
        })
    }

    fn load(v: &Value) -> Result<Config, String> {
        Config::from_json(v.to_string().as_bytes()).map_err(|e| e.to_string())
    }

    fn expect_err(v: Value, msg: &str) {
        assert_eq!(load(&v).unwrap_err(), msg);
    }

    const D3: &str = "3333333333333333333333333333333333333333333333333333333333333333";

    #[test]
    fn named_keys_compile_with_their_tenant_window_and_limits() {
        let mut v = base();
        v["tenants"][1]["api_keys"] = json!([
            {"name": "ci-2026", "sha256": D3, "not_before": "2026-01-01T00:00:00Z",
             "expires_at": "2026-07-01T00:00:00Z", "own_limits": true}
        ]);
        let c = load(&v).unwrap();
        let names: Vec<(&str, usize)> = c.api_keys.iter().map(|k| (k.name.as_str(), k.tenant)).collect();
        assert_eq!(names, [("sha256:111111111111", 0), ("sha256:222222222222", 1), ("ci-2026", 1)]);
        assert_eq!(
            c.api_keys[2].window,
            KeyWindow { not_before: Some(1_767_225_600), expires_at: Some(1_782_864_000) }
        );
        assert!(c.api_keys[2].own_limits && !c.api_keys[0].own_limits);
        let by_digest: Vec<usize> = c.key_digests.iter().map(|(_, k)| *k).collect();
        assert_eq!(by_digest, [0, 1, 2]);
        // A tenant may hold named keys only.
        v["tenants"][1].as_object_mut().unwrap().remove("api_keys_sha256");
        assert_eq!(load(&v).unwrap().api_keys.len(), 2);
    }

    #[test]
    fn err_named_keys() {
        let key = |extra: Value| {
            let mut k = json!({"name": "k1", "sha256": D3});
            for (f, x) in extra.as_object().unwrap() {
                k[f] = x.clone();
            }
            let mut v = base();
            v["tenants"][0]["api_keys"] = json!([k]);
            v
        };
        expect_err(
            key(json!({"name": "a b"})),
            "tenants[0].api_keys[0].name: must be 1 to 128 letters, digits, '.', '_' or '-'",
        );
        expect_err(key(json!({"sha256": "abc"})), "tenants[0].api_keys[0].sha256: must be exactly 64 lowercase hex characters (the SHA-256 of the key)");
        expect_err(
            key(json!({"sha256": D2})),
            "tenants[1].api_keys_sha256[0]: duplicate digest (also at tenants[0].api_keys[0].sha256)",
        );
        expect_err(
            key(json!({"expires_at": "2026-07-01"})),
            "tenants[0].api_keys[0].expires_at: must be an RFC 3339 time in UTC, YYYY-MM-DDTHH:MM:SSZ",
        );
        expect_err(
            key(json!({"not_before": "2026-07-01T00:00:00+02:00"})),
            "tenants[0].api_keys[0].not_before: must be an RFC 3339 time in UTC, YYYY-MM-DDTHH:MM:SSZ",
        );
        expect_err(
            key(json!({"not_before": "2026-07-01T00:00:00Z", "expires_at": "2026-07-01T00:00:00Z"})),
            "tenants[0].api_keys[0].expires_at: must be after not_before",
        );
        expect_err(key(json!({"expires": "2026-07-01T00:00:00Z"})), "tenants[0].api_keys[0].expires: unknown field `expires`, expected one of `name`, `sha256`, `not_before`, `expires_at`, `own_limits`");
        let mut v = key(json!({}));
        v["tenants"][0]["api_keys"] =
            json!([{"name": "k1", "sha256": D3}, {"name": "k1", "sha256": D3.replace('3', "4")}]);
        expect_err(v.clone(), "tenants[0].api_keys[1].name: duplicate key name \"k1\" in the tenant");
        // The same name in two tenants is two keys.
        v["tenants"][0]["api_keys"] = json!([{"name": "k1", "sha256": D3}]);
        v["tenants"][1]["api_keys"] = json!([{"name": "k1", "sha256": D3.replace('3', "4")}]);
        assert!(load(&v).is_ok());
        v["tenants"][1]["api_keys"] = json!([]);
        expect_err(v.clone(), "tenants[1].api_keys: must not be empty");
        v["tenants"][1].as_object_mut().unwrap().remove("api_keys");
        v["tenants"][1].as_object_mut().unwrap().remove("api_keys_sha256");
        expect_err(v, "tenants[1].api_keys: a tenant needs at least one key (api_keys, or api_keys_sha256)");
    }

    #[test]
    fn valid_config_compiles_with_defaults() {
        let c = load(&base()).unwrap();
        assert_eq!(c.max_body_bytes, 4194304);
        assert_eq!(c.tenants[1].tier, "standard");
        assert_eq!(c.tenants[1].allowed, None);
        assert_eq!(c.models[1].served_model_name, "llama");
        assert_eq!(c.models[1].max_token_bytes, DEFAULT_MAX_TOKEN_BYTES);
        assert_eq!(c.models[0].pools, vec![WeightedPool { pool: "pool_a".into(), weight: 1 }]);
        assert_eq!(c.resolve("qwen-latest"), Some(Target { model: 0, adapter: None }));
        assert_eq!(c.resolve("sql-lora"), Some(Target { model: 0, adapter: Some(0) }));
        assert_eq!(c.resolve("llama"), Some(Target { model: 1, adapter: None }));
        assert_eq!(c.resolve("Qwen/Qwen2.5-0.5B-Instruct"), None);
        assert_eq!(c.key_digests.len(), 2);
        assert_eq!(c.key_digests[1].1, 1);

        let mut v = base();
        v.as_object_mut().unwrap().remove("max_body_bytes");
        assert_eq!(load(&v).unwrap().max_body_bytes, DEFAULT_MAX_BODY_BYTES);
    }

    #[test]
    fn tenant_permissions() {
        let mut v = base();
        v["tenants"][1]["models"] = json!(["sql-lora"]);
        let c = load(&v).unwrap();
        let qwen = Target { model: 0, adapter: None };
        let lora = Target { model: 0, adapter: Some(0) };
        let llama = Target { model: 1, adapter: None };
        assert!(c.tenants[0].allows(qwen) && c.tenants[0].allows(lora) && c.tenants[0].allows(llama));
        assert!(!c.tenants[1].allows(qwen) && c.tenants[1].allows(lora) && !c.tenants[1].allows(llama));
    }

    // One fixture per configuration error, asserted by exact message.

    #[test]
    fn err_empty_configuration() {
        assert_eq!(Config::from_json(b"").unwrap_err().to_string(), "configuration: must not be empty");
        assert_eq!(Config::from_json(b" \n").unwrap_err().to_string(), "configuration: must not be empty");
    }

    #[test]
    fn err_not_json() {
        assert_eq!(
            Config::from_json(b"{nope").unwrap_err().to_string(),
            "configuration: key must be a string at line 1 column 2"
        );
    }

    #[test]
    fn err_unknown_top_level_field() {
        let mut v = base();
        v["max_body"] = json!(1);
        expect_err(
            v,
            "max_body: unknown field `max_body`, expected one of `max_body_bytes`, `full_parse_max_bytes`, `max_uploads_per_tenant`, `max_n`, `tenants`, `models`, `admission_leases`, `prefix_hashing`, `upstream_headers`",
        );
    }

    #[test]
    fn max_n_default_and_zero() {
        assert_eq!(Config::from_json(base().to_string().as_bytes()).unwrap().max_n, DEFAULT_MAX_N);
        let mut v = base();
        v["max_n"] = json!(0);
        expect_err(v, "max_n: must be > 0");
    }

    #[test]
    fn max_uploads_per_tenant_default_and_zero() {
        assert_eq!(Config::from_json(base().to_string().as_bytes()).unwrap().max_uploads_per_tenant, 8);
        let mut v = base();
        v["max_uploads_per_tenant"] = json!(0);
        expect_err(v, "max_uploads_per_tenant: must be > 0");
    }

    #[test]
    fn prefix_hashing_defaults_and_errors() {
        assert_eq!(load(&base()).unwrap().prefix_hashing, None);
        let mut v = base();
        v["prefix_hashing"] = json!({});
        assert_eq!(
            load(&v).unwrap().prefix_hashing,
            Some(PrefixHashing { block_bytes: 64, max_blocks: 256 })
        );
        v["prefix_hashing"] = json!({"block_bytes": 16, "max_blocks": 8});
        assert_eq!(load(&v).unwrap().prefix_hashing, Some(PrefixHashing { block_bytes: 16, max_blocks: 8 }));
        v["prefix_hashing"] = json!({"block_bytes": 0});
        expect_err(v.clone(), "prefix_hashing.block_bytes: must be in 1..=1048576");
        v["prefix_hashing"] = json!({"max_blocks": 4097});
        expect_err(v.clone(), "prefix_hashing.max_blocks: must be in 1..=4096");
        v["prefix_hashing"] = json!({"block_byte": 4});
        let e = load(&v).unwrap_err().to_string();
        assert!(e.starts_with("prefix_hashing.block_byte: unknown field"), "{e}");
    }

    #[test]
    fn admission_leases_defaults_and_errors() {
        let mut v = base();
        v["admission_leases"] = json!({"cluster": "llm_gateway_ext_proc"});
        let c = load(&v).unwrap();
        assert_eq!(
            c.admission_leases,
            Some(AdmissionLeases {
                cluster: "llm_gateway_ext_proc".into(),
                refresh_ms: DEFAULT_LEASE_REFRESH_MS,
                timeout_ms: DEFAULT_LEASE_TIMEOUT_MS
            })
        );
        assert_eq!(load(&base()).unwrap().admission_leases, None);
        v["admission_leases"] = json!({"cluster": " "});
        expect_err(v.clone(), "admission_leases.cluster: must not be empty");
        v["admission_leases"] = json!({"cluster": "c", "refresh_ms": 5});
        expect_err(v.clone(), "admission_leases.refresh_ms: must be in 10..=10000");
        v["admission_leases"] = json!({"cluster": "c", "timeout_ms": 0});
        expect_err(v.clone(), "admission_leases.timeout_ms: must be in 1..=60000");
        v["admission_leases"] = json!({"cluster": "c", "ttl_ms": 5});
        expect_err(
            v,
            "admission_leases.ttl_ms: unknown field `ttl_ms`, expected one of `cluster`, `refresh_ms`, `timeout_ms`",
        );
    }

    #[test]
    fn err_unknown_tenant_field() {
        let mut v = base();
        v["tenants"][0]["tierx"] = json!("gold");
        expect_err(
            v,
            "tenants[0].tierx: unknown field `tierx`, expected one of `id`, `api_keys_sha256`, `api_keys`, `tier`, `models`",
        );
    }

    #[test]
    fn err_unknown_model_field() {
        let mut v = base();
        v["models"][1]["max_len"] = json!(1);
        assert!(load(&v)
            .unwrap_err()
            .starts_with("models[1].max_len: unknown field `max_len`, expected one of"));
    }

    #[test]
    fn err_unknown_pool_field() {
        let mut v = base();
        v["models"][1]["pools"][0]["w"] = json!(1);
        expect_err(v, "models[1].pools[0].w: unknown field `w`, expected `pool` or `weight`");
    }

    #[test]
    fn err_missing_tenants() {
        let mut v = base();
        v.as_object_mut().unwrap().remove("tenants");
        expect_err(v, "configuration: missing field `tenants`");
    }

    #[test]
    fn err_missing_max_model_len() {
        let mut v = base();
        v["models"][1].as_object_mut().unwrap().remove("max_model_len");
        expect_err(v, "models[1]: missing field `max_model_len`");
    }

    #[test]
    fn err_wrong_type() {
        let mut v = base();
        v["models"][0]["max_model_len"] = json!("4096");
        expect_err(v, "models[0].max_model_len: invalid type: string \"4096\", expected u64");
    }

    #[test]
    fn err_negative_max_model_len() {
        let mut v = base();
        v["models"][1]["max_model_len"] = json!(-1);
        expect_err(v, "models[1].max_model_len: invalid value: integer `-1`, expected u64");
    }

    #[test]
    fn err_max_body_bytes_zero() {
        let mut v = base();
        v["max_body_bytes"] = json!(0);
        expect_err(v, "max_body_bytes: must be > 0");
    }

    #[test]
    fn err_tenants_empty() {
        let mut v = base();
        v["tenants"] = json!([]);
        expect_err(v, "tenants: must not be empty");
    }

    #[test]
    fn err_models_empty() {
        let mut v = base();
        v["models"] = json!([]);
        expect_err(v, "models: must not be empty");
    }

    #[test]
    fn err_model_name_empty() {
        let mut v = base();
        v["models"][1]["name"] = json!("");
        expect_err(v, "models[1].name: must be 1 to 256 visible ASCII characters (no spaces)");
    }

    #[test]
    fn err_model_name_with_space() {
        let mut v = base();
        v["models"][0]["name"] = json!("qwen 2");
        expect_err(v, "models[0].name: must be 1 to 256 visible ASCII characters (no spaces)");
    }

    #[test]
    fn err_duplicate_model_name() {
        let mut v = base();
        v["models"][1]["name"] = json!("qwen");
        expect_err(
            v,
            "models[1].name: duplicate model name, alias or adapter \"qwen\" (first defined at models[0].name)",
        );
    }

    #[test]
    fn err_alias_clashes_with_name() {
        let mut v = base();
        v["models"][1]["aliases"] = json!(["qwen-latest"]);
        expect_err(
            v,
            "models[1].aliases[0]: duplicate model name, alias or adapter \"qwen-latest\" (first defined at models[0].aliases[0])",
        );
    }

    #[test]
    fn err_alias_invalid() {
        let mut v = base();
        v["models"][0]["aliases"] = json!(["ok", ""]);
        expect_err(v, "models[0].aliases[1]: must be 1 to 256 visible ASCII characters (no spaces)");
    }

    #[test]
    fn err_adapter_clashes_with_model() {
        let mut v = base();
        v["models"][0]["lora_adapters"] = json!(["llama"]);
        // models[0] is processed first, so the later model name is the duplicate.
        expect_err(
            v,
            "models[1].name: duplicate model name, alias or adapter \"llama\" (first defined at models[0].lora_adapters[0])",
        );
    }

    #[test]
    fn err_pool_and_pools() {
        let mut v = base();
        v["models"][1]["pool"] = json!("x");
        expect_err(v, "models[1]: exactly one of `pool` and `pools` must be set");
    }

    #[test]
    fn err_no_pool() {
        let mut v = base();
        v["models"][0].as_object_mut().unwrap().remove("pool");
        expect_err(v, "models[0]: exactly one of `pool` and `pools` must be set");
    }

    #[test]
    fn err_pool_empty() {
        let mut v = base();
        v["models"][0]["pool"] = json!("");
        expect_err(v, "models[0].pool: must be 1 to 256 visible ASCII characters (no spaces)");
    }

    #[test]
    fn err_pools_empty() {
        let mut v = base();
        v["models"][1]["pools"] = json!([]);
        expect_err(v, "models[1].pools: must not be empty");
    }

    #[test]
    fn err_pools_duplicate() {
        let mut v = base();
        v["models"][1]["pools"][1]["pool"] = json!("pool_b");
        expect_err(v, "models[1].pools[1].pool: duplicate pool \"pool_b\"");
    }

    #[test]
    fn err_pools_zero_weight() {
        let mut v = base();
        v["models"][1]["pools"] = json!([{"pool": "a", "weight": 0}, {"pool": "b", "weight": 0}]);
        expect_err(v, "models[1].pools: weights must sum to > 0");
    }

    #[test]
    fn err_served_model_name_empty() {
        let mut v = base();
        v["models"][0]["served_model_name"] = json!("");
        expect_err(v, "models[0].served_model_name: must not be empty");
    }

    #[test]
    fn err_max_model_len_zero() {
        let mut v = base();
        v["models"][1]["max_model_len"] = json!(0);
        expect_err(v, "models[1].max_model_len: must be > 0");
    }

    #[test]
    fn context_bound_fields() {
        let mut v = base();
        v["models"][0]["template_overhead_bytes"] = json!({"per_message": 24, "fixed": 109});
        v["models"][0]["normalization"] = json!("nfc");
        v["models"][0]["exact_count"] = json!(true);
        let c = load(&v).unwrap();
        assert_eq!(c.models[0].template_overhead, Some(TemplateOverhead { per_message: 24, fixed: 109 }));
        assert!(c.models[0].nfc && c.models[0].exact_count);
        assert_eq!(c.models[1].template_overhead, None);
        assert!(!c.models[1].nfc && !c.models[1].exact_count);
    }

    #[test]
    fn upstream_headers_default_values_and_error() {
        assert_eq!(
            Config::from_json(base().to_string().as_bytes()).unwrap().upstream_headers,
            UpstreamHeaders::All
        );
        let mut v = base();
        v["upstream_headers"] = json!("routing");
        assert_eq!(
            Config::from_json(v.to_string().as_bytes()).unwrap().upstream_headers,
            UpstreamHeaders::Routing
        );
        v["upstream_headers"] = json!("pool");
        expect_err(v.clone(), "upstream_headers: must be \"all\" or \"routing\"");
        v["upstream_headers"] = json!(true);
        expect_err(v, "upstream_headers: invalid type: boolean `true`, expected a string");
    }

    #[test]
    fn err_normalization_unknown() {
        let mut v = base();
        v["models"][1]["normalization"] = json!("NFKC");
        expect_err(v, "models[1].normalization: must be \"none\" or \"nfc\"");
    }

    #[test]
    fn err_template_overhead_missing_field() {
        let mut v = base();
        v["models"][0]["template_overhead_bytes"] = json!({"per_message": 24});
        expect_err(v, "models[0].template_overhead_bytes: missing field `fixed`");
    }

    #[test]
    fn err_template_overhead_unknown_field() {
        let mut v = base();
        v["models"][0]["template_overhead_bytes"] = json!({"per_message": 24, "fixed": 1, "per_turn": 2});
        expect_err(
            v,
            "models[0].template_overhead_bytes.per_turn: unknown field `per_turn`, expected `per_message` or `fixed`",
        );
    }

    #[test]
    fn err_exact_count_type() {
        let mut v = base();
        v["models"][0]["exact_count"] = json!("yes");
        expect_err(v, "models[0].exact_count: invalid type: string \"yes\", expected a boolean");
    }

    #[test]
    fn err_max_token_bytes_zero() {
        let mut v = base();
        v["models"][0]["max_token_bytes"] = json!(0);
        expect_err(v, "models[0].max_token_bytes: must be > 0");
    }

    #[test]
    fn err_tenant_id_empty() {
        let mut v = base();
        v["tenants"][0]["id"] = json!("");
        expect_err(v, "tenants[0].id: must be 1 to 256 visible ASCII characters (no spaces)");
    }

    #[test]
    fn err_duplicate_tenant_id() {
        let mut v = base();
        v["tenants"][1]["id"] = json!("demo");
        expect_err(v, "tenants[1].id: duplicate tenant id \"demo\" (first defined at tenants[0].id)");
    }

    #[test]
    fn err_no_keys() {
        let mut v = base();
        v["tenants"][1]["api_keys_sha256"] = json!([]);
        expect_err(v, "tenants[1].api_keys_sha256: must not be empty");
    }

    #[test]
    fn err_digest_short() {
        let mut v = base();
        v["tenants"][0]["api_keys_sha256"] = json!(["abc"]);
        expect_err(
            v,
            "tenants[0].api_keys_sha256[0]: must be exactly 64 lowercase hex characters (the SHA-256 of the key)",
        );
    }

    #[test]
    fn err_digest_uppercase() {
        let mut v = base();
        v["tenants"][0]["api_keys_sha256"] = json!([D1, D1.replace('1', "A")]);
        expect_err(
            v,
            "tenants[0].api_keys_sha256[1]: must be exactly 64 lowercase hex characters (the SHA-256 of the key)",
        );
    }

    #[test]
    fn err_digest_non_hex() {
        let mut v = base();
        v["tenants"][0]["api_keys_sha256"] = json!([D1.replace('1', "g")]);
        expect_err(
            v,
            "tenants[0].api_keys_sha256[0]: must be exactly 64 lowercase hex characters (the SHA-256 of the key)",
        );
    }

    #[test]
    fn err_digest_shared_between_tenants() {
        let mut v = base();
        v["tenants"][1]["api_keys_sha256"] = json!([D1]);
        expect_err(
            v,
            "tenants[1].api_keys_sha256[0]: duplicate digest (also at tenants[0].api_keys_sha256[0])",
        );
    }

    #[test]
    fn err_digest_repeated_in_tenant() {
        let mut v = base();
        v["tenants"][0]["api_keys_sha256"] = json!([D1, D1]);
        expect_err(
            v,
            "tenants[0].api_keys_sha256[1]: duplicate digest (also at tenants[0].api_keys_sha256[0])",
        );
    }

    #[test]
    fn err_tier_invalid() {
        let mut v = base();
        v["tenants"][0]["tier"] = json!("gold tier");
        expect_err(v, "tenants[0].tier: must be 1 to 256 visible ASCII characters (no spaces)");
    }

    #[test]
    fn err_tenant_models_empty() {
        let mut v = base();
        v["tenants"][0]["models"] = json!([]);
        expect_err(v, "tenants[0].models: must not be empty (omit the field to allow every model)");
    }

    #[test]
    fn err_tenant_unknown_model() {
        let mut v = base();
        v["tenants"][0]["models"] = json!(["qwen", "mistral"]);
        expect_err(v, "tenants[0].models[1]: unknown model \"mistral\"");
    }

    #[test]
    fn err_tenant_duplicate_model_via_alias() {
        let mut v = base();
        v["tenants"][0]["models"] = json!(["qwen", "qwen-latest"]);
        expect_err(v, "tenants[0].models[1]: duplicate entry \"qwen-latest\"");
    }
}
