//! Token quotas per UTC day and calendar month, and the cost of a request, with no I/O (issue 14
//! item 5; docs/deploy.md, "Quotas and cost").
//!
//! **Counters.** One Redis integer per tenant (and tenant × model) and period:
//! `<prefix>:quota:{<tenant>}:day:<YYYY-MM-DD>`, `<prefix>:quota:{<tenant>}:month:<YYYY-MM>`, and
//! `<prefix>:quota:{<tenant>}:model:<model>:day:...` / `...:month:...` (the tenant's hash tag:
//! the same Redis Cluster slot as its buckets and reservations). The admission's take
//! (`lua/token_bucket_take_v3.lua`) refuses a request when a counter has reached its hard limit
//! and otherwise adds the request's reservation (prompt + max tokens) to every counter, in the
//! same call as the buckets; the usage record (`lua/ledger_v1.lua` `record`, or the sweeper's
//! `charge`) corrects them to the tokens used, a give-back (`release`) takes the reservation off.
//! So concurrent requests overshoot a hard limit by at most what is reserved in flight. Counters
//! expire [`DAY_MARGIN`] / [`MONTH_MARGIN`] after their period ends.
//!
//! **Clock.** Periods follow [`Clock`]: the system clock; in a build with the cargo feature
//! `test-clock` only (never a release build), shifted by the offset in the file named by
//! [`TEST_CLOCK_FILE_ENV`].
//!
//! **Cost.** Prices are USD per 1M tokens in multiples of 0.001, i.e. whole nano-dollars per
//! token, so a cost is an exact integer of nano-dollars ([`cost_nano_usd`]).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use crate::config::Config;

use crate::config::tenants::{Price, Quota};
use crate::error::AdmissionError;

/// Environment variable naming a file that holds a signed number of seconds added to the
/// sidecar's clock for quota periods, admission times and record dates (re-read at every use).
/// Read only by a build with the cargo feature `test-clock` (`make build` makes one,
/// `target/release/gateway-ext-proc-test-clock`, for `tests/test_quotas.py`); the release binary
/// ignores it.
pub const TEST_CLOCK_FILE_ENV: &str = "LLM_GATEWAY_TEST_CLOCK_OFFSET_FILE";

/// How long a daily counter outlives its day.
pub const DAY_MARGIN_SECS: u64 = 2 * 86_400;
/// How long a monthly counter outlives its month.
pub const MONTH_MARGIN_SECS: u64 = 7 * 86_400;
/// [`DAY_MARGIN_SECS`] as documented.
pub const DAY_MARGIN: std::time::Duration = std::time::Duration::from_secs(DAY_MARGIN_SECS);
/// [`MONTH_MARGIN_SECS`] as documented.
pub const MONTH_MARGIN: std::time::Duration = std::time::Duration::from_secs(MONTH_MARGIN_SECS);

/// The sidecar's clock for quotas: the system clock (plus a test offset, in a `test-clock`
/// build).
#[derive(Debug, Clone, Default)]
pub struct Clock {
    #[cfg(feature = "test-clock")]
    offset_file: Option<std::path::PathBuf>,
    fixed_ms: Option<u64>,
}

impl Clock {
    /// The system clock; in a `test-clock` build, shifted by [`TEST_CLOCK_FILE_ENV`]'s file when
    /// that is set.
    pub fn from_env() -> Self {
        Self {
            #[cfg(feature = "test-clock")]
            offset_file: std::env::var_os(TEST_CLOCK_FILE_ENV).map(std::path::PathBuf::from),
            fixed_ms: None,
        }
    }

    /// A clock that always reads `ms` (unit tests).
    pub fn fixed(ms: u64) -> Self {
        Self {
            #[cfg(feature = "test-clock")]
            offset_file: None,
            fixed_ms: Some(ms),
        }
    }

    /// The offset in seconds (0 without a test file, or one that does not parse).
    #[cfg(feature = "test-clock")]
    fn offset_secs(&self) -> i64 {
        let Some(path) = &self.offset_file else { return 0 };
        std::fs::read_to_string(path).ok().and_then(|s| s.trim().parse::<i64>().ok()).unwrap_or(0)
    }

    /// No offset outside a `test-clock` build.
    #[cfg(not(feature = "test-clock"))]
    fn offset_secs(&self) -> i64 {
        0
    }

    /// Unix milliseconds now.
    pub fn now_ms(&self) -> u64 {
        if let Some(ms) = self.fixed_ms {
            return ms;
        }
        let real = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        self.shift_ms(real)
    }

    /// A system-clock time (e.g. Envoy's end of a request) on this clock.
    pub fn shift_ms(&self, real_ms: u64) -> u64 {
        let offset = self.offset_secs().saturating_mul(1000);
        u64::try_from(i128::from(real_ms) + i128::from(offset)).unwrap_or(0)
    }
}

/// A quota period.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Period {
    /// A UTC day.
    Day,
    /// A calendar month, UTC.
    Month,
}

impl Period {
    /// `day` or `month` (key part, header and error words).
    pub fn as_str(self) -> &'static str {
        match self {
            Period::Day => "day",
            Period::Month => "month",
        }
    }

    /// The one-letter kind the Lua scripts compare (`d`, `m`).
    pub fn letter(self) -> &'static str {
        match self {
            Period::Day => "d",
            Period::Month => "m",
        }
    }
}

/// Days since 1970-01-01 to (year, month, day), proleptic Gregorian (H. Hinnant's algorithm).
pub fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

/// (year, month, day) to days since 1970-01-01 (H. Hinnant's algorithm).
pub fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let m = i64::from(m);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// `YYYY-MM-DD` of a unix time (UTC).
pub fn day_label(unix_secs: u64) -> String {
    let (y, m, d) = civil_from_days((unix_secs / 86_400) as i64);
    format!("{y:04}-{m:02}-{d:02}")
}

/// `YYYY-MM` of a unix time (UTC).
pub fn month_label(unix_secs: u64) -> String {
    let (y, m, _) = civil_from_days((unix_secs / 86_400) as i64);
    format!("{y:04}-{m:02}")
}

/// Parses `YYYY-MM-DD` to days since 1970-01-01.
pub fn parse_day(s: &str) -> Option<i64> {
    let mut parts = s.split('-');
    let (y, m, d) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() || y.len() != 4 || m.len() != 2 || d.len() != 2 {
        return None;
    }
    let (y, m, d) = (y.parse::<i64>().ok()?, m.parse::<u32>().ok()?, d.parse::<u32>().ok()?);
    let days = days_from_civil(y, m, d);
    (civil_from_days(days) == (y, m, d)).then_some(days)
}

/// The period containing `unix_secs`: its label and its end (unix s, exclusive).
pub fn period_of(period: Period, unix_secs: u64) -> (String, u64) {
    let day = (unix_secs / 86_400) as i64;
    match period {
        Period::Day => (day_label(unix_secs), (day as u64 + 1) * 86_400),
        Period::Month => {
            let (y, m, _) = civil_from_days(day);
            let (ny, nm) = if m == 12 { (y + 1, 1) } else { (y, m + 1) };
            (month_label(unix_secs), days_from_civil(ny, nm, 1) as u64 * 86_400)
        }
    }
}

/// A quota counter's key: `<prefix>:quota:{<tenant>}:<day|month>:<label>`, or with
/// `:model:<model>` before the period for a tenant × model quota.
pub fn quota_key(prefix: &str, tenant: &str, model: Option<&str>, period: Period, label: &str) -> String {
    match model {
        None => format!("{prefix}:quota:{{{tenant}}}:{}:{label}", period.as_str()),
        Some(m) => format!("{prefix}:quota:{{{tenant}}}:model:{m}:{}:{label}", period.as_str()),
    }
}

/// One quota counter a request counts against.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuotaSpec {
    /// The counter's Redis key ([`quota_key`]).
    pub key: String,
    /// `None`: the tenant's quota; `Some(model)`: the tenant × model quota.
    pub model: Option<String>,
    /// Day or month.
    pub period: Period,
    /// The period's label (`YYYY-MM-DD`, `YYYY-MM`).
    pub label: String,
    /// The hard limit, tokens.
    pub hard: u64,
    /// The soft limit, tokens.
    pub soft: Option<u64>,
    /// When the period ends (unix s): the quota resets.
    pub reset_at_secs: u64,
    /// When the counter expires (unix s): the period's end plus its margin.
    pub expire_at_secs: u64,
}

impl QuotaSpec {
    /// `tenant` or `model:<name>`, as the warning header and the error name the scope.
    pub fn scope(&self) -> String {
        match &self.model {
            None => "tenant".to_owned(),
            Some(m) => format!("model:{m}"),
        }
    }
}

/// The quota counters of a request of `tenant_id` for `model` at `now_secs`: the tenant's, then
/// the tenant × model's, day before month.
pub fn plan(
    prefix: &str,
    tenant_id: &str,
    quota: &Quota,
    model_quotas: &BTreeMap<String, Quota>,
    model: &str,
    now_secs: u64,
) -> Vec<QuotaSpec> {
    let mut scopes = vec![(None, quota)];
    if let Some(q) = model_quotas.get(model) {
        scopes.push((Some(model), q));
    }
    let mut out = Vec::new();
    for (scope, q) in scopes {
        for (period, hard, soft, margin) in [
            (Period::Day, q.tokens_per_day, q.soft_tokens_per_day, DAY_MARGIN_SECS),
            (Period::Month, q.tokens_per_month, q.soft_tokens_per_month, MONTH_MARGIN_SECS),
        ] {
            let Some(hard) = hard else { continue };
            let (label, end) = period_of(period, now_secs);
            out.push(QuotaSpec {
                key: quota_key(prefix, tenant_id, scope, period, &label),
                model: scope.map(str::to_owned),
                period,
                label,
                hard,
                soft,
                reset_at_secs: end,
                expire_at_secs: end + margin,
            });
        }
    }
    out
}

/// RFC 3339 UTC of a unix time in whole seconds, e.g. `2026-11-27T00:00:00Z`.
pub fn rfc3339(unix_secs: u64) -> String {
    let s = unix_secs % 86_400;
    format!("{}T{:02}:{:02}:{:02}Z", day_label(unix_secs), s / 3600, (s / 60) % 60, s % 60)
}

/// The quota counters of one take ([`crate::store::Store::take`]): each refuses when it is at
/// its hard limit or `need` would pass it, and, admitted, grows by `charge`.
#[derive(Debug, Clone, Copy)]
pub struct QuotaTake<'a> {
    /// The counters.
    pub specs: &'a [QuotaSpec],
    /// What must still fit under each hard limit (0 for a request: refused once used up; a
    /// lease's tokens for a lease).
    pub need: u64,
    /// What each counter is charged (the request's reservation; 0 for a lease).
    pub charge: u64,
}

/// What the counters of a take said.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuotaOutcome {
    /// Index (into the specs) of the counter that refused; `None` when none did.
    pub denied: Option<usize>,
    /// Each counter's value, after the charge when admitted.
    pub used: Vec<u64>,
}

/// The `x-gateway-quota-warning` value for the counters at or over their soft limit after the
/// take (`used[i]` is counter `i` with this request's reservation); `None` when none is.
pub fn warning(specs: &[QuotaSpec], used: &[u64]) -> Option<String> {
    let parts: Vec<String> = specs
        .iter()
        .zip(used)
        .filter_map(|(q, &u)| {
            let soft = q.soft?;
            (u >= soft).then(|| {
                format!(
                    "{}; scope={}; used={u}; soft={soft}; limit={}; reset={}",
                    q.period.as_str(),
                    q.scope(),
                    q.hard,
                    rfc3339(q.reset_at_secs)
                )
            })
        })
        .collect();
    (!parts.is_empty()).then(|| parts.join(", "))
}

/// The quota section of the take script's reply, after the buckets: `[denied (1-based; 0 when
/// admitted), used_1, ..., used_q]`; returns (index of the quota that refused, counters).
///
/// # Errors
/// A message when the reply does not have that shape.
pub fn read_reply(reply: &[i64], q: usize) -> Result<QuotaOutcome, String> {
    let Some((&head, used)) = reply.split_first().filter(|(_, used)| used.len() == q) else {
        return Err(format!("{} quota values for {q} quotas", reply.len()));
    };
    let denied = match head {
        0 => None,
        i if i >= 1 && (i as usize) <= q => Some(i as usize - 1),
        other => return Err(format!("quota denied index {other}")),
    };
    Ok(QuotaOutcome { denied, used: used.iter().map(|&u| u.max(0) as u64).collect() })
}

/// The admission's reading of its quota counters (`now_ms` on the quota clock): the warning
/// header's value, or 429 `insufficient_quota` naming the counter that refused, with a
/// `Retry-After` until its period ends.
///
/// # Errors
/// [`AdmissionError::QuotaExceeded`].
pub fn decide(
    specs: &[QuotaSpec],
    outcome: &QuotaOutcome,
    now_ms: u64,
) -> Result<Option<String>, AdmissionError> {
    if let Some(i) = outcome.denied {
        let (Some(spec), Some(&used)) = (specs.get(i), outcome.used.get(i)) else {
            return Err(AdmissionError::LimiterUnavailable);
        };
        return Err(AdmissionError::QuotaExceeded {
            period: spec.period.as_str(),
            scope: spec.scope(),
            limit: spec.hard,
            used,
            reset: rfc3339(spec.reset_at_secs),
            retry_after_secs: spec.reset_at_secs.saturating_sub(now_ms / 1000).max(1),
        });
    }
    Ok(warning(specs, &outcome.used))
}

/// A request's cost in nano-dollars: uncached prompt tokens at the input price, cached ones at the
/// cached-input price, completion tokens at the output price; exact, in 128-bit integers, and
/// capped at the ledger's largest count ([`crate::metering::meter::MAX_LEDGER_COUNT`], about 9 million
/// USD: far past what a request's bounded usage costs at any accepted price), so that it fits
/// both Redis's i64 and the ledger's exact sums.
pub fn cost_nano_usd(price: &Price, prompt: u64, cached: u64, completion: u64) -> u64 {
    let (input, cached_price, output) = price.nano_usd_per_token();
    let cached = cached.min(prompt);
    let total = u128::from(prompt - cached) * u128::from(input)
        + u128::from(cached) * u128::from(cached_price)
        + u128::from(completion) * u128::from(output);
    u64::try_from(total).unwrap_or(u64::MAX).min(crate::metering::meter::MAX_LEDGER_COUNT)
}

/// Nano-dollars as a decimal USD string with 9 decimals, e.g. `0.000123000`.
pub fn format_usd(nano: u64) -> String {
    format!("{}.{:09}", nano / 1_000_000_000, nano % 1_000_000_000)
}

/// What the sidecar knows of quotas and prices, shared with the store (which corrects counters
/// and prices records) and the admission.
#[derive(Debug, Clone, Default)]
pub struct QuotaBook {
    tenants: HashMap<String, (Quota, BTreeMap<String, Quota>)>,
    prices: BTreeMap<String, Price>,
    /// The clock the periods follow.
    pub clock: Clock,
}

impl QuotaBook {
    /// The quotas and prices of a config, on `clock`.
    pub fn new(config: &Config, clock: Clock) -> Arc<Self> {
        let tenants = config
            .tenants
            .iter()
            .filter(|t| !t.quota.is_empty() || t.model_quotas.values().any(|q| !q.is_empty()))
            .map(|t| (t.id.clone(), (t.quota, t.model_quotas.clone())))
            .collect();
        Arc::new(Self { tenants, prices: config.prices.clone(), clock })
    }

    /// The counters a request of `tenant` for `model` counts against at `now_ms` (see [`plan`]).
    pub fn plan(&self, prefix: &str, tenant: &str, model: &str, now_ms: u64) -> Vec<QuotaSpec> {
        match self.tenants.get(tenant) {
            Some((q, per_model)) => plan(prefix, tenant, q, per_model, model, now_ms / 1000),
            None => Vec::new(),
        }
    }

    /// Every counter of `tenant` at `now_ms`, of every model (a give-back does not know the
    /// request's model: the script applies only the tenant's and the reservation's model's).
    pub fn plan_all_models(&self, prefix: &str, tenant: &str, now_ms: u64) -> Vec<QuotaSpec> {
        let Some((q, per_model)) = self.tenants.get(tenant) else { return Vec::new() };
        let mut out = plan(prefix, tenant, q, &BTreeMap::new(), "", now_ms / 1000);
        for model in per_model.keys() {
            out.extend(
                plan(prefix, tenant, &Quota::default(), per_model, model, now_ms / 1000)
                    .into_iter()
                    .filter(|s| s.model.is_some()),
            );
        }
        out
    }

    /// A record's cost in nano-dollars (0 for a model without a price).
    pub fn cost(&self, model: &str, prompt: u64, cached: u64, completion: u64) -> u64 {
        self.prices.get(model).map_or(0, |p| cost_nano_usd(p, prompt, cached, completion))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 2026-11-26T00:00:00Z.
    const NOV_26: u64 = 1_795_651_200;

    #[test]
    fn periods_roll_over_at_utc_midnight_and_month_ends() {
        let noon = NOV_26;
        assert_eq!(rfc3339(noon), "2026-11-26T00:00:00Z");
        assert_eq!(period_of(Period::Day, noon + 86_399), ("2026-11-26".to_owned(), noon + 86_400));
        assert_eq!(period_of(Period::Day, noon + 86_400).0, "2026-11-27");
        let (m, end) = period_of(Period::Month, noon);
        assert_eq!((m.as_str(), rfc3339(end).as_str()), ("2026-11", "2026-12-01T00:00:00Z"));
        let dec = days_from_civil(2026, 12, 31) as u64 * 86_400;
        assert_eq!(rfc3339(period_of(Period::Month, dec).1), "2027-01-01T00:00:00Z");
        let feb = days_from_civil(2024, 2, 29) as u64 * 86_400;
        assert_eq!(rfc3339(period_of(Period::Month, feb).1), "2024-03-01T00:00:00Z");
        assert_eq!(parse_day("2024-02-29"), Some(days_from_civil(2024, 2, 29)));
        assert_eq!(parse_day("2023-02-29"), None);
        assert_eq!(parse_day("2023-2-01"), None);
    }

    #[test]
    fn plan_keys_and_expiry() {
        let q = Quota { tokens_per_day: Some(100), soft_tokens_per_day: Some(80), ..Default::default() };
        let mut per_model = BTreeMap::new();
        per_model.insert("big".to_owned(), Quota { tokens_per_month: Some(1000), ..Default::default() });
        let now = NOV_26 + 10;
        let p = plan("p", "acme", &q, &per_model, "big", now);
        let keys: Vec<_> = p.iter().map(|s| s.key.as_str()).collect();
        assert_eq!(keys, ["p:quota:{acme}:day:2026-11-26", "p:quota:{acme}:model:big:month:2026-11"]);
        assert_eq!(p[0].expire_at_secs, NOV_26 + 86_400 + DAY_MARGIN_SECS);
        assert_eq!(plan("p", "acme", &q, &per_model, "small", now).len(), 1);
    }

    #[test]
    fn warning_names_each_quota_over_its_soft_limit() {
        let q = Quota {
            tokens_per_day: Some(100),
            soft_tokens_per_day: Some(80),
            tokens_per_month: Some(1000),
            soft_tokens_per_month: Some(900),
        };
        let p = plan("p", "t", &q, &BTreeMap::new(), "m", NOV_26);
        assert_eq!(warning(&p, &[79, 100]), None);
        assert_eq!(
            warning(&p, &[80, 100]).unwrap(),
            "day; scope=tenant; used=80; soft=80; limit=100; reset=2026-11-27T00:00:00Z"
        );
        assert_eq!(warning(&p, &[90, 950]).unwrap().matches("scope=").count(), 2);
    }

    #[test]
    fn replies_are_read_strictly() {
        assert_eq!(read_reply(&[0, 5, 7], 2), Ok(QuotaOutcome { denied: None, used: vec![5, 7] }));
        assert_eq!(read_reply(&[2, 5, 7], 2).unwrap().denied, Some(1));
        assert!(read_reply(&[3, 5, 7], 2).is_err());
        assert!(read_reply(&[0, 5], 2).is_err());
    }

    #[test]
    fn cost_is_exact_in_nano_dollars() {
        let p = Price { input: 0.15, cached_input: Some(0.075), output: 0.6 };
        assert_eq!(p.nano_usd_per_token(), (150, 75, 600));
        // 1000 prompt of which 400 cached, 500 completion: 600*150 + 400*75 + 500*600.
        assert_eq!(cost_nano_usd(&p, 1000, 400, 500), 90_000 + 30_000 + 300_000);
        assert_eq!(format_usd(420_000), "0.000420000");
        assert_eq!(format_usd(1_500_000_000), "1.500000000");
        let no_cached = Price { input: 2.5, cached_input: None, output: 10.0 };
        assert_eq!(cost_nano_usd(&no_cached, 10, 20, 1), 10 * 2500 + 10_000, "cached is capped at prompt");
        assert_eq!(
            cost_nano_usd(&no_cached, u64::MAX, 0, u64::MAX),
            crate::metering::meter::MAX_LEDGER_COUNT
        );
        assert!(i64::try_from(cost_nano_usd(&no_cached, u64::MAX, 0, u64::MAX)).is_ok(), "fits Redis");
    }

    #[test]
    #[cfg(not(feature = "test-clock"))]
    fn a_release_build_has_no_test_clock() {
        // Whatever the environment says: the offset is read only in a `test-clock` build.
        assert_eq!(Clock::from_env().shift_ms(1_000), 1_000);
        assert_eq!(Clock::fixed(5).now_ms(), 5);
    }

    #[test]
    #[cfg(feature = "test-clock")]
    fn the_test_clock_shifts_time() {
        let dir = std::env::temp_dir().join(format!("quota-clock-{}", std::process::id()));
        std::fs::write(&dir, "86400\n").unwrap();
        let c = Clock { offset_file: Some(dir.clone()), fixed_ms: None };
        assert_eq!(c.shift_ms(1_000), 86_401_000);
        std::fs::write(&dir, "-1").unwrap();
        assert_eq!(c.shift_ms(1_000), 0);
        std::fs::remove_file(&dir).unwrap();
        assert_eq!(c.shift_ms(1_000), 1_000, "no file: no offset");
        assert_eq!(Clock::fixed(5).now_ms(), 5);
    }
}
