//! Model resolution, tenant permission and pool choice.
//!
//! A requested `model` resolves by exact name, alias or LoRA adapter name. The pool is the
//! model's `pool`, or for a weighted split (`pools`) the entry chosen by the SHA-256 of
//! `x-request-id`, so that Envoy's own retries of the request (Envoy keeps `x-request-id` across
//! them) land on the same pool. Envoy generates `x-request-id` and drops a client's
//! (`envoy/bootstrap.yaml`), so a client cannot pick the pool of a split.

use sha2::{Digest, Sha256};

use crate::config::{Config, Model, Target, Tenant, WeightedPool};
use crate::error::{truncate_for_echo, GatewayError};

/// Where a request goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route<'c> {
    /// The resolved model (the base model for a LoRA adapter).
    pub model: &'c Model,
    /// The resolved target.
    pub target: Target,
    /// Public name sent as `x-gateway-model`: the canonical model name, or the adapter name.
    pub public_name: &'c str,
    /// Envoy cluster sent as `x-gateway-pool`.
    pub pool: &'c str,
    /// The `model` value vLLM expects in the body: `served_model_name`, or the adapter name.
    pub body_model: &'c str,
}

/// Resolves `requested` for `tenant` and picks the pool.
///
/// # Errors
/// [`GatewayError::ModelNotFound`] (404) when no model, alias or adapter has that name;
/// [`GatewayError::ModelNotAllowed`] (403) when the tenant's `models` list excludes it.
pub fn route<'c>(
    cfg: &'c Config,
    tenant: &Tenant,
    requested: &str,
    request_id: Option<&[u8]>,
) -> Result<Route<'c>, GatewayError> {
    let target = cfg
        .resolve(requested)
        .ok_or_else(|| GatewayError::ModelNotFound { model: truncate_for_echo(requested) })?;
    let model =
        cfg.models.get(target.model).ok_or(GatewayError::Internal { what: "model index out of range" })?;
    if !tenant.allows(target) {
        return Err(GatewayError::ModelNotAllowed { model: truncate_for_echo(requested) });
    }
    let (public_name, body_model) = match target.adapter {
        None => (model.name.as_str(), model.served_model_name.as_str()),
        Some(i) => {
            let adapter = model
                .lora_adapters
                .get(i)
                .ok_or(GatewayError::Internal { what: "adapter index out of range" })?;
            (adapter.as_str(), adapter.as_str())
        }
    };
    let pool =
        pick_pool(&model.pools, request_id).ok_or(GatewayError::Internal { what: "model has no pool" })?;
    Ok(Route { model, target, public_name, pool, body_model })
}

/// Picks a pool: the only one, or by weight from the first 8 bytes of `SHA-256(request_id)`
/// (an absent id hashes as empty). `None` only when `pools` is empty or all weights are 0.
pub fn pick_pool<'p>(pools: &'p [WeightedPool], request_id: Option<&[u8]>) -> Option<&'p str> {
    if let [only] = pools {
        return Some(only.pool.as_str());
    }
    let total: u64 = pools.iter().map(|p| u64::from(p.weight)).sum();
    if total == 0 {
        return None;
    }
    let digest = Sha256::digest(request_id.unwrap_or_default());
    let mut first8 = [0u8; 8];
    for (dst, src) in first8.iter_mut().zip(digest.iter()) {
        *dst = *src;
    }
    let mut point = u64::from_be_bytes(first8) % total;
    for p in pools {
        let w = u64::from(p.weight);
        if point < w {
            return Some(p.pool.as_str());
        }
        point -= w;
    }
    None
}

/// The models a tenant may use, for `GET /v1/models`: every allowed canonical model name and
/// LoRA adapter name, in configuration order (aliases are accepted in requests but not listed).
pub fn listed_models<'c>(cfg: &'c Config, tenant: &Tenant) -> Vec<&'c str> {
    let mut out = Vec::new();
    for (i, m) in cfg.models.iter().enumerate() {
        if tenant.allows(Target { model: i, adapter: None }) {
            out.push(m.name.as_str());
        }
        for (j, a) in m.lora_adapters.iter().enumerate() {
            if tenant.allows(Target { model: i, adapter: Some(j) }) {
                out.push(a.as_str());
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const D1: &str = "1111111111111111111111111111111111111111111111111111111111111111";
    const D2: &str = "2222222222222222222222222222222222222222222222222222222222222222";

    fn cfg() -> Config {
        let v = json!({
            "tenants": [
                {"id": "demo", "api_keys_sha256": [D1], "models": ["qwen"]},
                {"id": "lora-only", "api_keys_sha256": [D2], "models": ["sql-lora"]}
            ],
            "models": [
                {"name": "qwen", "pool": "pool_a", "served_model_name": "Qwen/Qwen2.5-0.5B-Instruct",
                 "max_model_len": 4096, "aliases": ["qwen-latest"], "lora_adapters": ["sql-lora"]},
                {"name": "llama", "pools": [{"pool": "pool_b", "weight": 90}, {"pool": "pool_c", "weight": 10}],
                 "max_model_len": 8192}
            ]
        });
        Config::from_json(v.to_string().as_bytes()).unwrap()
    }

    #[test]
    fn resolves_names_aliases_adapters() {
        let c = cfg();
        let t = &c.tenants[0];
        let r = route(&c, t, "qwen", None).unwrap();
        assert_eq!((r.public_name, r.pool, r.body_model), ("qwen", "pool_a", "Qwen/Qwen2.5-0.5B-Instruct"));
        let r = route(&c, t, "qwen-latest", None).unwrap();
        assert_eq!(r.public_name, "qwen");
        let r = route(&c, t, "sql-lora", None).unwrap();
        assert_eq!((r.public_name, r.pool, r.body_model), ("sql-lora", "pool_a", "sql-lora"));
    }

    #[test]
    fn not_found_and_not_allowed() {
        let c = cfg();
        let e = route(&c, &c.tenants[0], "gpt-5", None).unwrap_err();
        assert_eq!(e.to_string(), "The model `gpt-5` does not exist.");
        assert_eq!(e.parts(), (404, "invalid_request_error", "model_not_found", Some("model")));
        let e = route(&c, &c.tenants[0], "llama", None).unwrap_err();
        assert_eq!(e.to_string(), "You do not have access to the model `llama`.");
        assert_eq!(e.parts(), (403, "invalid_request_error", "model_not_allowed", Some("model")));
        // adapter-only tenant: adapter yes, base no
        assert!(route(&c, &c.tenants[1], "sql-lora", None).is_ok());
        assert!(route(&c, &c.tenants[1], "qwen", None).is_err());
        // served_model_name is not a public name
        assert!(route(&c, &c.tenants[0], "Qwen/Qwen2.5-0.5B-Instruct", None).is_err());
    }

    #[test]
    fn weighted_split_is_deterministic_and_weighted() {
        let c = cfg();
        let pools = &c.models[1].pools;
        let a = pick_pool(pools, Some(b"req-1"));
        for _ in 0..5 {
            assert_eq!(pick_pool(pools, Some(b"req-1")), a);
        }
        let mut b = 0;
        for i in 0..10_000 {
            if pick_pool(pools, Some(format!("id-{i}").as_bytes())) == Some("pool_b") {
                b += 1;
            }
        }
        assert!((8_700..=9_300).contains(&b), "pool_b chosen {b} times out of 10000");
        assert!(pick_pool(pools, None).is_some());
        let drained =
            vec![WeightedPool { pool: "x".into(), weight: 0 }, WeightedPool { pool: "y".into(), weight: 5 }];
        for i in 0..100 {
            assert_eq!(pick_pool(&drained, Some(format!("{i}").as_bytes())), Some("y"));
        }
        assert_eq!(pick_pool(&[], None), None);
    }

    #[test]
    fn model_listing() {
        let c = cfg();
        assert_eq!(listed_models(&c, &c.tenants[0]), vec!["qwen", "sql-lora"]);
        assert_eq!(listed_models(&c, &c.tenants[1]), vec!["sql-lora"]);
    }
}
