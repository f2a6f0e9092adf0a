//! The config's validation, once at load: every error names its field. The sections are checked
//! in the order below, so a config with two errors reports the same one every time.

use std::collections::HashSet;

use crate::config::error::{invalid, ConfigError};
use crate::config::pools::{endpoint_addr, PoolConfig};
use crate::config::redis::valid_key_part;
use crate::config::Config;

impl Config {
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        self.validate_redis()?;
        self.validate_tenants()?;
        self.validate_prices()?;
        self.validate_metering()?;
        self.validate_breaker()?;
        self.validate_pools()?;
        self.validate_endpoint_pickers()?;
        self.validate_models()?;
        self.validate_rest()
    }

    fn validate_redis(&self) -> Result<(), ConfigError> {
        match (&self.redis.url, self.redis.cluster_urls.is_empty()) {
            (Some(_), false) => return Err(invalid("redis", "set either url or cluster_urls, not both")),
            (None, true) => return Err(invalid("redis", "one of url or cluster_urls is required")),
            _ => {}
        }
        self.redis.validate_connection()?;
        if self.redis.command_timeout_ms == 0 {
            return Err(invalid("redis.command_timeout_ms", "must be > 0"));
        }
        if !(self.redis.local_share > 0.0 && self.redis.local_share <= 1.0) {
            return Err(invalid("redis.local_share", "must be in (0, 1]"));
        }
        if !(0.0..=0.5).contains(&self.redis.lease_fraction) {
            return Err(invalid("redis.lease_fraction", "must be in [0, 0.5]"));
        }
        if self.redis.lease_ttl_ms == 0 {
            return Err(invalid("redis.lease_ttl_ms", "must be > 0"));
        }
        if !valid_key_part(&self.redis.key_prefix) {
            return Err(invalid(
                "redis.key_prefix",
                "must be non-empty letters, digits, '.', '_', '-' or ':'",
            ));
        }
        Ok(())
    }

    fn validate_tenants(&self) -> Result<(), ConfigError> {
        let mut ids = HashSet::new();
        for (i, tenant) in self.tenants.iter().enumerate() {
            let field = format!("tenants[{i}]");
            if !valid_key_part(&tenant.id) || tenant.id.contains(':') {
                return Err(invalid(
                    format!("{field}.id"),
                    "must be non-empty letters, digits, '.', '_' or '-'",
                ));
            }
            if !ids.insert(tenant.id.as_str()) {
                return Err(invalid(format!("{field}.id"), format!("duplicate tenant '{}'", tenant.id)));
            }
            tenant.limits.validate(&format!("{field}.limits"))?;
            for (model, limits) in &tenant.model_limits {
                if model.is_empty() || model.contains(['{', '}']) {
                    return Err(invalid(
                        format!("{field}.model_limits"),
                        format!("invalid model name '{model}'"),
                    ));
                }
                limits.validate(&format!("{field}.model_limits.{model}"))?;
            }
            validate_key_limits(&field, &tenant.api_keys)?;
            tenant.quota.validate(&format!("{field}.quota"))?;
            for (model, quota) in &tenant.model_quotas {
                if model.is_empty() || model.contains(['{', '}']) {
                    return Err(invalid(
                        format!("{field}.model_quotas"),
                        format!("invalid model name '{model}'"),
                    ));
                }
                quota.validate(&format!("{field}.model_quotas.{model}"))?;
            }
        }
        Ok(())
    }

    fn validate_prices(&self) -> Result<(), ConfigError> {
        for (model, price) in &self.prices {
            if model.is_empty() {
                return Err(invalid("prices", "invalid model name ''"));
            }
            price.validate(&format!("prices.{model}"))?;
        }
        Ok(())
    }

    fn validate_metering(&self) -> Result<(), ConfigError> {
        if self.metering.max_json_body_bytes == 0 {
            return Err(invalid("metering.max_json_body_bytes", "must be > 0"));
        }
        if self.metering.buffer_records == 0 {
            return Err(invalid("metering.buffer_records", "must be > 0"));
        }
        let reservations = &self.metering.reservations;
        if !(1_000..=604_800_000).contains(&reservations.record_after_ms) {
            return Err(invalid("metering.reservations.record_after_ms", "must be in 1000..=604800000"));
        }
        if !(100..=600_000).contains(&reservations.sweep_interval_ms) {
            return Err(invalid("metering.reservations.sweep_interval_ms", "must be in 100..=600000"));
        }
        if !(1..=10_000).contains(&reservations.sweep_batch) {
            return Err(invalid("metering.reservations.sweep_batch", "must be in 1..=10000"));
        }
        if let Some(journal) = &self.metering.journal {
            journal.validate("metering.journal").map_err(|(field, message)| invalid(&field, message))?;
        }
        Ok(())
    }

    fn validate_breaker(&self) -> Result<(), ConfigError> {
        if self.redis.breaker.failure_threshold == 0 {
            return Err(invalid("redis.breaker.failure_threshold", "must be > 0"));
        }
        if self.redis.breaker.open_ms == 0 {
            return Err(invalid("redis.breaker.open_ms", "must be > 0"));
        }
        Ok(())
    }

    fn validate_pools(&self) -> Result<(), ConfigError> {
        let mut pools = HashSet::new();
        for (i, pool) in self.pools.iter().enumerate() {
            let field = format!("pools[{i}].name");
            if pool.name.is_empty() {
                return Err(invalid(field, "must be non-empty"));
            }
            if !pools.insert(pool.name.as_str()) {
                return Err(invalid(field, format!("duplicate pool '{}'", pool.name)));
            }
            self.validate_pool(&format!("pools[{i}]"), pool)?;
        }
        Ok(())
    }

    /// One `pools[i]` entry (its name is already known unique).
    fn validate_pool(&self, field: &str, pool: &PoolConfig) -> Result<(), ConfigError> {
        for (j, url) in pool.endpoints.iter().enumerate() {
            if !url.starts_with("http://") {
                return Err(invalid(format!("{field}.endpoints[{j}]"), "must be an http:// URL"));
            }
        }
        if pool.scrape_interval_ms == 0 {
            return Err(invalid(format!("{field}.scrape_interval_ms"), "must be > 0"));
        }
        if pool.max_queue_depth == Some(0) {
            return Err(invalid(format!("{field}.max_queue_depth"), "must be > 0"));
        }
        if pool.max_in_flight == Some(0) {
            return Err(invalid(format!("{field}.max_in_flight"), "must be > 0"));
        }
        if let Some(kv) = pool.max_kv_cache_usage {
            if !(kv > 0.0 && kv <= 1.0) {
                return Err(invalid(format!("{field}.max_kv_cache_usage"), "must be in (0, 1]"));
            }
        }
        if let Some(flow) = &pool.flow_control {
            let field = format!("{field}.flow_control");
            if self.flow_control.is_none() {
                return Err(invalid(field, "needs the top-level flow_control (its tiers)"));
            }
            if !(1..=1_000_000).contains(&flow.max_queued) {
                return Err(invalid(format!("{field}.max_queued"), "must be in 1..=1000000"));
            }
            if !((1 << 20)..=(64 << 30)).contains(&flow.max_queued_bytes) {
                return Err(invalid(
                    format!("{field}.max_queued_bytes"),
                    "must be in 1048576..=68719476736 (1 MiB to 64 GiB)",
                ));
            }
            if !(flow.leases_below_load > 0.0 && flow.leases_below_load <= 1.0) {
                return Err(invalid(format!("{field}.leases_below_load"), "must be in (0, 1]"));
            }
            if pool.max_in_flight.is_none()
                && pool.max_queue_depth.is_none()
                && pool.max_kv_cache_usage.is_none()
            {
                return Err(invalid(
                    field,
                    "needs the pool's max_in_flight, max_queue_depth or max_kv_cache_usage (when it has room)",
                ));
            }
        }
        if let Some(picker) = &pool.picker {
            picker.validate(&format!("{field}.picker"), pool.scrape_interval_ms)?;
            if pool.endpoints.is_empty() {
                return Err(invalid(format!("{field}.endpoints"), "needed by picker"));
            }
            for (j, url) in pool.endpoints.iter().enumerate() {
                if endpoint_addr(url).is_none() {
                    return Err(invalid(
                        format!("{field}.endpoints[{j}]"),
                        "the picker needs http://ip:port (an IP address and a port, no path)",
                    ));
                }
            }
            return Ok(());
        }
        let scraped = pool.max_queue_depth.is_some() || pool.max_kv_cache_usage.is_some();
        if scraped && pool.endpoints.is_empty() {
            return Err(invalid(
                format!("{field}.endpoints"),
                "needed to scrape max_queue_depth / max_kv_cache_usage",
            ));
        }
        if !scraped && pool.max_in_flight.is_none() {
            return Err(invalid(
                field,
                "set at least one of max_queue_depth, max_kv_cache_usage, max_in_flight",
            ));
        }
        Ok(())
    }

    fn validate_endpoint_pickers(&self) -> Result<(), ConfigError> {
        let mut picker_pools = HashSet::new();
        for (i, epp) in self.endpoint_pickers.iter().enumerate() {
            let field = format!("endpoint_pickers[{i}]");
            if !self.pools.iter().any(|p| p.name == epp.pool && p.picker.is_some()) {
                return Err(invalid(format!("{field}.pool"), "must name a pools[] entry that has a picker"));
            }
            if !picker_pools.insert(epp.pool.as_str()) {
                return Err(invalid(format!("{field}.pool"), "has another endpoint picker"));
            }
            if epp.listen.port() != 0 && epp.listen == self.listen {
                return Err(invalid(format!("{field}.listen"), "is the sidecar's own listen address"));
            }
            if epp.max_body_bytes == 0 {
                return Err(invalid(format!("{field}.max_body_bytes"), "must be > 0"));
            }
            if !(1..=4096).contains(&epp.block_bytes) {
                return Err(invalid(format!("{field}.block_bytes"), "must be in 1..=4096"));
            }
            if !(1..=4096).contains(&epp.max_blocks) {
                return Err(invalid(format!("{field}.max_blocks"), "must be in 1..=4096"));
            }
        }
        Ok(())
    }

    fn validate_models(&self) -> Result<(), ConfigError> {
        let mut models = HashSet::new();
        for (i, model) in self.models.iter().enumerate() {
            let field = format!("models[{i}]");
            if model.name.is_empty() {
                return Err(invalid(format!("{field}.name"), "must be non-empty"));
            }
            if !models.insert(model.name.as_str()) {
                return Err(invalid(format!("{field}.name"), format!("duplicate model '{}'", model.name)));
            }
            if model.max_model_len == 0 {
                return Err(invalid(format!("{field}.max_model_len"), "must be > 0"));
            }
            let spec = model.tokenizer.validate().and_then(|()| match &model.chat_template {
                Some(t) => t.validate(),
                None => Ok(()),
            });
            spec.map_err(|e| invalid(format!("{field}.{}", e.field), e.message))?;
        }
        Ok(())
    }

    /// The listener, context counting, shedding, flow control and tracing.
    fn validate_rest(&self) -> Result<(), ConfigError> {
        if !(1..=600_000).contains(&self.shutdown_grace_ms) {
            return Err(invalid("shutdown_grace_ms", "must be in 1..=600000"));
        }
        if self.context.count_timeout_ms == 0 {
            return Err(invalid("context.count_timeout_ms", "must be > 0"));
        }
        if self.context.max_counts_per_tenant == 0 {
            return Err(invalid("context.max_counts_per_tenant", "must be > 0"));
        }
        if self.context.max_body_bytes == 0 {
            return Err(invalid("context.max_body_bytes", "must be > 0"));
        }
        for (tier, level) in &self.shedding.tier_levels {
            if !(*level > 0.0 && *level <= 1.0) {
                return Err(invalid(format!("shedding.tier_levels.{tier}"), "must be in (0, 1]"));
            }
        }
        if let Some(flow) = &self.flow_control {
            flow.validate(|t| self.tenant(t).is_some())?;
        }
        if let Some(t) = &self.tracing {
            let scheme = t.otlp_endpoint.split_once("://").map(|(scheme, _)| scheme);
            if !matches!(scheme, Some("http" | "https")) || t.otlp_endpoint.ends_with("://") {
                return Err(invalid(
                    "tracing.otlp_endpoint",
                    "must be http://host:port or https://host:port",
                ));
            }
            if !(0.0..=1.0).contains(&t.sampling_ratio) {
                return Err(invalid("tracing.sampling_ratio", "must be in 0..=1"));
            }
            if t.service_name.is_empty() {
                return Err(invalid("tracing.service_name", "must be non-empty"));
            }
        }
        Ok(())
    }
}

/// A tenant's `api_keys` (`field` is the tenant's path): names valid and unique, limits valid.
fn validate_key_limits(field: &str, keys: &[super::tenants::ApiKeyLimits]) -> Result<(), ConfigError> {
    let mut names = HashSet::new();
    for (j, key) in keys.iter().enumerate() {
        let at = format!("{field}.api_keys[{j}]");
        if !valid_key_part(&key.name) || key.name.contains(':') {
            return Err(invalid(format!("{at}.name"), "must be non-empty letters, digits, '.', '_' or '-'"));
        }
        if !names.insert(key.name.as_str()) {
            return Err(invalid(format!("{at}.name"), format!("duplicate key '{}'", key.name)));
        }
        key.limits.validate(&format!("{at}.limits"))?;
    }
    Ok(())
}
