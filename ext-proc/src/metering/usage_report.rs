//! Reads the usage ledger's daily hashes back (`gatewayctl usage`): requests, tokens and cost per
//! tenant, model (or API key name) and UTC day. The key layout is
//! [`crate::store::usage_key_of_day`]'s, the fields `lua/ledger_v1.lua`'s (`<model>:requests`,
//! `:prompt_tokens`, `:completion_tokens`, `:cached_tokens`, `:cost_nano_usd`, and the same of
//! `api_key <name>` for the requests of a named key).

use std::collections::BTreeMap;

use crate::admission::quota::{civil_from_days, parse_day};
use crate::store::usage_key_of_day;

/// The most days one report reads.
pub const MAX_DAYS: i64 = 1_000;

/// The prefix of a daily hash's fields that count a named API key's requests: `api_key <name>:`
/// (a space, which no model name holds).
pub const API_KEY_FIELD_PREFIX: &str = "api_key ";

/// What a report's rows break the usage down by.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Group {
    /// One row per model and day (every request).
    #[default]
    Model,
    /// One row per API key name and day (the requests made with a named key, recorded by a
    /// sidecar that names keys).
    ApiKey,
}

/// One tenant's usage of one model on one UTC day.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UsageRow {
    /// `YYYY-MM-DD`.
    pub day: String,
    /// The tenant.
    pub tenant: String,
    /// The public model name; the API key's name in a [`Group::ApiKey`] row.
    pub model: String,
    /// Requests recorded.
    pub requests: u64,
    /// Prompt tokens (cached ones included).
    pub prompt_tokens: u64,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: u64,
    /// Completion tokens.
    pub completion_tokens: u64,
    /// Cost in nano-dollars.
    pub cost_nano_usd: u64,
}

/// The days from `from` to `to` (`YYYY-MM-DD`, both included).
///
/// # Errors
/// A message naming the option (`--from`, `--to`) when a date does not parse, or the range is
/// empty or longer than [`MAX_DAYS`].
pub fn days(from: &str, to: &str) -> Result<Vec<String>, String> {
    let start = parse_day(from).ok_or_else(|| format!("--from: '{from}' is not a date YYYY-MM-DD"))?;
    let end = parse_day(to).ok_or_else(|| format!("--to: '{to}' is not a date YYYY-MM-DD"))?;
    if end < start {
        return Err(format!("--to: {to} is before --from {from}"));
    }
    if end - start >= MAX_DAYS {
        return Err(format!("--to: at most {MAX_DAYS} days per report"));
    }
    Ok((start..=end)
        .map(|d| {
            let (y, m, day) = civil_from_days(d);
            format!("{y:04}-{m:02}-{day:02}")
        })
        .collect())
}

/// The rows of one daily hash (its fields and values), by model or by API key (`group`); only
/// the model or key `only` when given.
pub fn rows_of_hash(
    tenant: &str,
    day: &str,
    fields: &[(String, i64)],
    group: Group,
    only: Option<&str>,
) -> Vec<UsageRow> {
    let mut by_model: BTreeMap<&str, UsageRow> = BTreeMap::new();
    for (field, value) in fields {
        let Some((m, metric)) = field.rsplit_once(':') else { continue };
        let m = match (group, m.strip_prefix(API_KEY_FIELD_PREFIX)) {
            (Group::Model, None) => m,
            (Group::ApiKey, Some(name)) => name,
            _ => continue,
        };
        if only.is_some_and(|want| want != m) {
            continue;
        }
        let row = by_model.entry(m).or_insert_with(|| UsageRow {
            day: day.to_owned(),
            tenant: tenant.to_owned(),
            model: m.to_owned(),
            ..Default::default()
        });
        let v = u64::try_from(*value).unwrap_or(0);
        match metric {
            "requests" => row.requests = v,
            "prompt_tokens" => row.prompt_tokens = v,
            "completion_tokens" => row.completion_tokens = v,
            "cached_tokens" => row.cached_tokens = v,
            "cost_nano_usd" => row.cost_nano_usd = v,
            _ => {}
        }
    }
    by_model.into_values().collect()
}

/// Reads the tenant's daily hashes of `days` from the Redis at `url` (`redis://` or `rediss://`,
/// credentials in the URL allowed here) under `prefix`: one row per model (or API key, `group`)
/// and day with usage; only the model or key `only` when given.
///
/// # Errors
/// A message when Redis cannot be reached or answers with an error.
pub fn read(
    url: &str,
    prefix: &str,
    tenant: &str,
    (group, only): (Group, Option<&str>),
    days: &[String],
) -> Result<Vec<UsageRow>, String> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("runtime: {e}"))?;
    runtime.block_on(async {
        let client = redis::Client::open(url).map_err(|e| format!("redis: {e}"))?;
        let mut conn = client.get_multiplexed_async_connection().await.map_err(|e| format!("redis: {e}"))?;
        let mut rows = Vec::new();
        for day in days {
            let fields: Vec<(String, i64)> = redis::cmd("HGETALL")
                .arg(usage_key_of_day(prefix, tenant, day))
                .query_async(&mut conn)
                .await
                .map_err(|e| format!("redis: {e}"))?;
            rows.extend(rows_of_hash(tenant, day, &fields, group, only));
        }
        Ok(rows)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn days_are_inclusive_and_checked() {
        assert_eq!(days("2024-02-28", "2024-03-01").unwrap(), ["2024-02-28", "2024-02-29", "2024-03-01"]);
        assert_eq!(days("2026-11-26", "2026-11-26").unwrap().len(), 1);
        assert!(days("2026-11-27", "2026-11-26").unwrap_err().contains("before"));
        assert!(days("2026-13-01", "2026-11-26").unwrap_err().starts_with("--from"));
        assert!(days("2020-01-01", "2026-01-01").is_err());
    }

    #[test]
    fn a_hash_becomes_one_row_per_model() {
        let fields: Vec<(String, i64)> = [
            ("m1:requests", 2),
            ("m1:prompt_tokens", 20),
            ("m1:completion_tokens", 8),
            ("m1:cached_tokens", 4),
            ("m1:cost_nano_usd", 12_345),
            ("org/m:2:requests", 1),
            ("api_key ci-2026:requests", 2),
            ("api_key ci-2026:prompt_tokens", 20),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
        let rows = rows_of_hash("acme", "2026-11-26", &fields, Group::Model, None);
        assert_eq!(rows.len(), 2);
        assert_eq!(
            rows[0],
            UsageRow {
                day: "2026-11-26".into(),
                tenant: "acme".into(),
                model: "m1".into(),
                requests: 2,
                prompt_tokens: 20,
                cached_tokens: 4,
                completion_tokens: 8,
                cost_nano_usd: 12_345,
            }
        );
        assert_eq!(rows[1].model, "org/m:2");
        assert_eq!(rows_of_hash("acme", "d", &fields, Group::Model, Some("org/m:2")).len(), 1);
        // The key's fields make its own rows, never a model's.
        let keys = rows_of_hash("acme", "d", &fields, Group::ApiKey, None);
        assert_eq!(keys.len(), 1);
        assert_eq!((keys[0].model.as_str(), keys[0].requests, keys[0].prompt_tokens), ("ci-2026", 2, 20));
        assert!(rows_of_hash("acme", "d", &fields, Group::ApiKey, Some("other")).is_empty());
    }
}
