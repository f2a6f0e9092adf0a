//! `gatewayctl usage`: requests, tokens and cost per tenant, model (or API key name, `--by
//! api-key`) and UTC day, read from the usage ledger's daily hashes in Redis
//! ([`gateway_ext_proc::metering::usage_report`], the sidecar's own key layout), as a table, JSON
//! or CSV. Costs are exact: nano-dollars, and USD with 9 decimals.

use gateway_ext_proc::admission::quota::format_usd;
use gateway_ext_proc::metering::usage_report::{Group, UsageRow};
use serde_json::json;

/// Output formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// Aligned columns with a total line.
    Table,
    /// A JSON array of rows (`cost_nano_usd` an integer, `cost_usd` a decimal string).
    Json,
    /// Comma-separated values with a header line.
    Csv,
}

/// What the rows break the usage down by.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum By {
    /// One row per model and day: every request.
    #[default]
    Model,
    /// One row per API key name and day: the requests made with a named key (`tenants[].api_keys`;
    /// a key listed in `api_keys_sha256` appears as `sha256:<12 hex>`). Never the key itself.
    ApiKey,
}

impl By {
    /// The report's grouping.
    pub fn group(self) -> Group {
        match self {
            By::Model => Group::Model,
            By::ApiKey => Group::ApiKey,
        }
    }

    /// The name of the column the rows are grouped by.
    fn column(self) -> &'static str {
        match self {
            By::Model => "model",
            By::ApiKey => "api_key",
        }
    }
}

const COLUMNS: [&str; 9] = [
    "day",
    "tenant",
    "model",
    "requests",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "cost_nano_usd",
    "cost_usd",
];

fn cells(r: &UsageRow) -> [String; 9] {
    [
        r.day.clone(),
        r.tenant.clone(),
        r.model.clone(),
        r.requests.to_string(),
        r.prompt_tokens.to_string(),
        r.cached_tokens.to_string(),
        r.completion_tokens.to_string(),
        r.cost_nano_usd.to_string(),
        format_usd(r.cost_nano_usd),
    ]
}

/// The rows in `format`, their third column named after `by`.
pub fn format(rows: &[UsageRow], format: Format, by: By) -> String {
    let mut columns = COLUMNS;
    columns[2] = by.column();
    match format {
        Format::Json => {
            let items: Vec<_> = rows
                .iter()
                .map(|r| {
                    let mut item = json!({
                        "day": r.day, "tenant": r.tenant, "requests": r.requests,
                        "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens,
                        "completion_tokens": r.completion_tokens, "cost_nano_usd": r.cost_nano_usd,
                        "cost_usd": format_usd(r.cost_nano_usd),
                    });
                    if let Some(object) = item.as_object_mut() {
                        object.insert(by.column().to_owned(), json!(r.model));
                    }
                    item
                })
                .collect();
            let mut out = serde_json::to_string_pretty(&items).unwrap_or_default();
            out.push('\n');
            out
        }
        Format::Csv => {
            let mut out = columns.join(",");
            out.push('\n');
            for r in rows {
                let line: Vec<String> = cells(r).into_iter().map(|c| csv_cell(&c)).collect();
                out.push_str(&line.join(","));
                out.push('\n');
            }
            out
        }
        Format::Table => {
            let mut lines: Vec<[String; 9]> = vec![columns.map(str::to_owned)];
            lines.extend(rows.iter().map(cells));
            let total = rows.iter().fold(UsageRow::default(), |mut t, r| {
                t.requests += r.requests;
                t.prompt_tokens += r.prompt_tokens;
                t.cached_tokens += r.cached_tokens;
                t.completion_tokens += r.completion_tokens;
                t.cost_nano_usd = t.cost_nano_usd.saturating_add(r.cost_nano_usd);
                t
            });
            let mut total = cells(&total);
            total[0] = "total".to_owned();
            lines.push(total);
            let widths: Vec<usize> = (0..COLUMNS.len())
                .map(|i| lines.iter().map(|l| l.get(i).map_or(0, String::len)).max().unwrap_or(0))
                .collect();
            let mut out = String::new();
            for line in &lines {
                let padded: Vec<String> = line
                    .iter()
                    .zip(&widths)
                    .enumerate()
                    .map(|(i, (c, w))| if i < 3 { format!("{c:<w$}") } else { format!("{c:>w$}") })
                    .collect();
                out.push_str(padded.join("  ").trim_end());
                out.push('\n');
            }
            out
        }
    }
}

/// A CSV cell, quoted when it holds a comma, a quote or a line break.
fn csv_cell(c: &str) -> String {
    if c.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", c.replace('"', "\"\""))
    } else {
        c.to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row() -> UsageRow {
        UsageRow {
            day: "2026-11-26".into(),
            tenant: "acme".into(),
            model: "m,1".into(),
            requests: 2,
            prompt_tokens: 20,
            cached_tokens: 4,
            completion_tokens: 8,
            cost_nano_usd: 1_500_000_001,
        }
    }

    #[test]
    fn formats_agree() {
        let rows = [row()];
        let csv = format(&rows, Format::Csv, By::Model);
        assert_eq!(
            csv,
            "day,tenant,model,requests,prompt_tokens,cached_tokens,completion_tokens,cost_nano_usd,cost_usd\n\
             2026-11-26,acme,\"m,1\",2,20,4,8,1500000001,1.500000001\n"
        );
        let v: serde_json::Value = serde_json::from_str(&format(&rows, Format::Json, By::Model)).unwrap();
        assert_eq!(v[0]["cost_nano_usd"], 1_500_000_001u64);
        assert_eq!(v[0]["cost_usd"], "1.500000001");
        let table = format(&rows, Format::Table, By::Model);
        assert_eq!(table.lines().count(), 3);
        assert!(table.lines().last().unwrap().starts_with("total"));
        // By key: the third column is the key's name.
        let by_key = format(&rows, Format::Csv, By::ApiKey);
        assert!(by_key.starts_with("day,tenant,api_key,requests,"), "{by_key}");
        let v: serde_json::Value = serde_json::from_str(&format(&rows, Format::Json, By::ApiKey)).unwrap();
        assert_eq!((v[0]["api_key"].as_str(), v[0].get("model")), (Some("m,1"), None));
    }
}
