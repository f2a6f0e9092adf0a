//! `tenants` (their limits and quotas) and `prices`.

use std::collections::BTreeMap;

use serde::Deserialize;

use crate::config::error::{invalid, ConfigError};

/// One tenant's limits.
#[derive(Debug, Clone, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct TenantConfig {
    /// Tenant id, as the filter sends it in `x-gateway-tenant`. Letters, digits, `.`, `_`, `-`.
    pub id: String,
    /// The tenant's limits across all models.
    pub limits: Limits,
    /// Further limits per model (public model name, `x-gateway-model`), applied on top of
    /// `limits`: a request draws on both.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub model_limits: BTreeMap<String, Limits>,
    /// The tenant's token quotas per UTC day and calendar month across all models (absent: none;
    /// docs/deploy.md, "Quotas and cost").
    #[serde(default, skip_serializing_if = "Quota::is_unset")]
    pub quota: Quota,
    /// Further quotas per model (public model name), on top of `quota`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub model_quotas: BTreeMap<String, Quota>,
    /// Further limits per API key (by the key's name, as the filter's facts carry it), on top of
    /// `limits` and `model_limits`: a request made with the key draws on these too.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub api_keys: Vec<ApiKeyLimits>,
}

/// One API key's own limits.
#[derive(Debug, Clone, Deserialize, serde::Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ApiKeyLimits {
    /// The key's name (letters, digits, `.`, `_`, `-`), unique within the tenant.
    pub name: String,
    /// The key's limits (default: none).
    #[serde(default)]
    pub limits: Limits,
}

impl TenantConfig {
    /// The limits of the API key named `name`, if it has its own.
    pub fn key_limits(&self, name: &str) -> Option<&Limits> {
        self.api_keys.iter().find(|k| k.name == name).map(|k| &k.limits)
    }
}

/// Token quotas (prompt plus completion tokens) per UTC day and per calendar month (UTC), each a
/// hard limit (429 `insufficient_quota` once used up) with an optional soft limit (the
/// `x-gateway-quota-warning` response header from there on). The default has none.
#[derive(Debug, Clone, Copy, Default, Deserialize, serde::Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Quota {
    /// Tokens per UTC day (hard limit). Absent: no daily quota.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_day: Option<u64>,
    /// Tokens per UTC day after which responses carry the warning header (below
    /// `tokens_per_day`). Absent: no warning.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub soft_tokens_per_day: Option<u64>,
    /// Tokens per calendar month, UTC (hard limit). Absent: no monthly quota.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_month: Option<u64>,
    /// Tokens per calendar month after which responses carry the warning header (below
    /// `tokens_per_month`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub soft_tokens_per_month: Option<u64>,
}

impl Quota {
    /// Whether no quota is set.
    pub fn is_empty(&self) -> bool {
        self.tokens_per_day.is_none() && self.tokens_per_month.is_none()
    }

    /// Whether no member is set, soft limits included (the default, which a written config
    /// leaves out).
    fn is_unset(&self) -> bool {
        *self == Self::default()
    }

    pub(super) fn validate(&self, field: &str) -> Result<(), ConfigError> {
        for (hard_name, hard, soft_name, soft) in [
            ("tokens_per_day", self.tokens_per_day, "soft_tokens_per_day", self.soft_tokens_per_day),
            ("tokens_per_month", self.tokens_per_month, "soft_tokens_per_month", self.soft_tokens_per_month),
        ] {
            match (hard, soft) {
                (Some(0), _) => {
                    return Err(invalid(
                        format!("{field}.{hard_name}"),
                        "must be > 0 (omit it for no quota)",
                    ));
                }
                (Some(h), _) if h > MAX_QUOTA_TOKENS => {
                    return Err(invalid(
                        format!("{field}.{hard_name}"),
                        format!("must be <= {MAX_QUOTA_TOKENS}"),
                    ));
                }
                (None, Some(_)) => {
                    return Err(invalid(format!("{field}.{soft_name}"), format!("needs {hard_name}")));
                }
                (Some(h), Some(s)) if s == 0 || s >= h => {
                    return Err(invalid(
                        format!("{field}.{soft_name}"),
                        format!("must be in 1..{hard_name} ({h})"),
                    ));
                }
                _ => {}
            }
        }
        if let (Some(day), Some(month)) = (self.tokens_per_day, self.tokens_per_month) {
            if day > month {
                return Err(invalid(
                    format!("{field}.tokens_per_day"),
                    format!("must not exceed tokens_per_month ({month})"),
                ));
            }
        }
        Ok(())
    }
}

/// The largest quota: 10^15 tokens (Redis counters and Lua's doubles stay exact far beyond).
pub const MAX_QUOTA_TOKENS: u64 = 1_000_000_000_000_000;

/// A model's prices in USD per 1M tokens, each a multiple of 0.001 (so that a token's price is a
/// whole number of nano-dollars and every cost is exact: [`Price::nano_usd_per_token`]).
#[derive(Debug, Clone, Copy, Deserialize, serde::Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Price {
    /// Prompt tokens not served from the prefix cache.
    pub input: f64,
    /// Prompt tokens served from the prefix cache (`cached_tokens`; default: `input`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cached_input: Option<f64>,
    /// Completion tokens.
    pub output: f64,
}

/// The highest price accepted, USD per 1M tokens.
pub const MAX_PRICE_USD_PER_MILLION: f64 = 1_000_000.0;

/// USD per 1M tokens as nano-dollars per token (USD per 1M tokens × 1000), if it is exact.
fn nano_per_token(usd_per_million: f64) -> Option<u64> {
    if !(0.0..=MAX_PRICE_USD_PER_MILLION).contains(&usd_per_million) {
        return None;
    }
    let scaled = usd_per_million * 1000.0;
    let rounded = scaled.round();
    ((scaled - rounded).abs() <= 1e-6 * rounded.max(1.0)).then_some(rounded as u64)
}

impl Price {
    /// (input, cached input, output) in nano-dollars per token. Validated prices are exact.
    pub fn nano_usd_per_token(&self) -> (u64, u64, u64) {
        let input = nano_per_token(self.input).unwrap_or(0);
        let cached = self.cached_input.map_or(input, |c| nano_per_token(c).unwrap_or(0));
        (input, cached, nano_per_token(self.output).unwrap_or(0))
    }

    pub(super) fn validate(&self, field: &str) -> Result<(), ConfigError> {
        for (name, value) in
            [("input", Some(self.input)), ("cached_input", self.cached_input), ("output", Some(self.output))]
        {
            if let Some(v) = value {
                if nano_per_token(v).is_none() {
                    return Err(invalid(
                        format!("{field}.{name}"),
                        format!("must be USD per 1M tokens in 0..={MAX_PRICE_USD_PER_MILLION}, a multiple of 0.001"),
                    ));
                }
            }
        }
        Ok(())
    }
}

/// Requests-per-minute and tokens-per-minute limits; each is a token bucket that refills
/// continuously at the per-minute rate and holds at most its burst. The default has no limit.
#[derive(Debug, Clone, Copy, Default, Deserialize, serde::Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Limits {
    /// Requests per minute (RPM). Absent: no request limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requests_per_minute: Option<u64>,
    /// Bucket size for requests (default: `requests_per_minute`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_burst: Option<u64>,
    /// Tokens per minute (TPM), prompt plus completion tokens. Absent: no token limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_minute: Option<u64>,
    /// Bucket size for tokens (default: `tokens_per_minute`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_burst: Option<u64>,
}

impl Limits {
    pub(super) fn validate(&self, field: &str) -> Result<(), ConfigError> {
        check_pair(
            field,
            "requests_per_minute",
            self.requests_per_minute,
            "request_burst",
            self.request_burst,
        )?;
        check_pair(field, "tokens_per_minute", self.tokens_per_minute, "token_burst", self.token_burst)
    }
}

fn check_pair(
    field: &str,
    rate_name: &str,
    rate: Option<u64>,
    burst_name: &str,
    burst: Option<u64>,
) -> Result<(), ConfigError> {
    if rate == Some(0) {
        return Err(invalid(format!("{field}.{rate_name}"), "must be > 0 (omit it for no limit)"));
    }
    match (rate, burst) {
        (None, Some(_)) => Err(invalid(format!("{field}.{burst_name}"), format!("needs {rate_name}"))),
        (Some(_), Some(0)) => Err(invalid(format!("{field}.{burst_name}"), "must be > 0")),
        _ => Ok(()),
    }
}
