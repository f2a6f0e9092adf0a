//! API-key authentication.
//!
//! The key comes from `Authorization: Bearer <key>` (the OpenAI API's scheme; `Bearer` matched
//! case-insensitively) or, when that header is absent or not Bearer, from `x-api-key: <key>`.
//! The key is hashed with SHA-256 and the digest is compared in constant time against every
//! configured digest, without early exit, so the time taken does not depend on which digest (if
//! any) matched. Keys are never logged nor echoed.
//!
//! A key found is then checked against its validity window ([`KeyWindow`], the config's
//! `not_before` and `expires_at`) at the host's current time: outside it the request is refused
//! as a wrong key would be (401 `invalid_api_key`), saying whether it expired or is not valid yet.

use sha2::{Digest, Sha256};
use subtle::{Choice, ConditionallySelectable, ConstantTimeEq};

use crate::error::GatewayError;

/// Extracts the API key: `Authorization: Bearer <key>` first, then `x-api-key: <key>`.
/// Surrounding spaces/tabs are trimmed; an empty key counts as absent.
pub fn extract_api_key<'a>(authorization: Option<&'a [u8]>, x_api_key: Option<&'a [u8]>) -> Option<&'a [u8]> {
    let bearer = authorization.and_then(|v| {
        let v = trim(v);
        let scheme = v.get(..7)?;
        if scheme.eq_ignore_ascii_case(b"bearer ") {
            Some(trim(v.get(7..)?))
        } else {
            None
        }
    });
    bearer.filter(|k| !k.is_empty()).or_else(|| x_api_key.map(trim).filter(|k| !k.is_empty()))
}

fn trim(mut v: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = v {
        v = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = v {
        v = rest;
    }
    v
}

/// SHA-256 of the key bytes.
pub fn hash_key(key: &[u8]) -> [u8; 32] {
    Sha256::digest(key).into()
}

/// The index paired with `digest` in `digests` (the config's key index), scanning all of them
/// with constant-time comparisons and no early exit.
pub fn find_key(digests: &[([u8; 32], usize)], digest: &[u8; 32]) -> Option<usize> {
    let mut found = Choice::from(0u8);
    let mut tenant: u64 = 0;
    for (candidate, idx) in digests {
        let eq = candidate.ct_eq(digest);
        tenant = u64::conditional_select(&tenant, &(*idx as u64), eq);
        found |= eq;
    }
    if bool::from(found) {
        usize::try_from(tenant).ok()
    } else {
        None
    }
}

/// Authenticates a request from its `authorization` and `x-api-key` header values.
///
/// # Errors
/// [`GatewayError::MissingApiKey`] when no key is present, [`GatewayError::InvalidApiKey`] when
/// its digest matches none of `digests`. The index returned is the one paired with the digest.
pub fn authenticate(
    digests: &[([u8; 32], usize)],
    authorization: Option<&[u8]>,
    x_api_key: Option<&[u8]>,
) -> Result<usize, GatewayError> {
    let key = extract_api_key(authorization, x_api_key).ok_or(GatewayError::MissingApiKey)?;
    find_key(digests, &hash_key(key)).ok_or(GatewayError::InvalidApiKey)
}

/// When a key may be used: from `not_before` (included) to `expires_at` (excluded), each in
/// seconds since the Unix epoch; `None` leaves that side open.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KeyWindow {
    /// The first second the key is valid (`None`: from the start).
    pub not_before: Option<u64>,
    /// The first second the key is no longer valid (`None`: never expires).
    pub expires_at: Option<u64>,
}

impl KeyWindow {
    /// Whether a key with this window may be used at `now_s` (seconds since the Unix epoch).
    ///
    /// # Errors
    /// [`GatewayError::ApiKeyNotYetValid`] before `not_before`, [`GatewayError::ApiKeyExpired`]
    /// from `expires_at` on.
    pub fn check(&self, now_s: u64) -> Result<(), GatewayError> {
        if self.not_before.is_some_and(|t| now_s < t) {
            return Err(GatewayError::ApiKeyNotYetValid);
        }
        if self.expires_at.is_some_and(|t| now_s >= t) {
            return Err(GatewayError::ApiKeyExpired);
        }
        Ok(())
    }
}

/// Reads an RFC 3339 time in UTC of the one form the gateway config takes,
/// `YYYY-MM-DDTHH:MM:SSZ` (e.g. `2026-07-01T00:00:00Z`), as seconds since the Unix epoch; `None`
/// for any other text, a date that does not exist, or a time before 1970.
pub fn parse_utc_timestamp(s: &str) -> Option<u64> {
    let b = s.as_bytes();
    let separators = [(4, b'-'), (7, b'-'), (10, b'T'), (13, b':'), (16, b':'), (19, b'Z')];
    if b.len() != 20 || separators.iter().any(|&(i, c)| b.get(i) != Some(&c)) {
        return None;
    }
    let num = |from: usize, to: usize| -> Option<u64> {
        let digits = b.get(from..to)?;
        digits
            .iter()
            .all(u8::is_ascii_digit)
            .then(|| digits.iter().fold(0, |n, d| n * 10 + u64::from(d - b'0')))
    };
    let (year, month, day) = (num(0, 4)?, num(5, 7)?, num(8, 10)?);
    let (hour, minute, second) = (num(11, 13)?, num(14, 16)?, num(17, 19)?);
    if year < 1970 || !(1..=12).contains(&month) || day == 0 || day > days_in_month(year, month) {
        return None;
    }
    if hour > 23 || minute > 59 || second > 59 {
        return None;
    }
    let days = days_from_civil(year, month, day);
    Some(days * 86_400 + hour * 3600 + minute * 60 + second)
}

/// Writes seconds since the Unix epoch as `YYYY-MM-DDTHH:MM:SSZ` ([`parse_utc_timestamp`]'s form).
pub fn format_utc_timestamp(t: u64) -> String {
    let (days, rest) = (t / 86_400, t % 86_400);
    let (year, month, day) = civil_from_days(days);
    format!("{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z", rest / 3600, rest % 3600 / 60, rest % 60)
}

fn is_leap(year: u64) -> bool {
    year.is_multiple_of(4) && (!year.is_multiple_of(100) || year.is_multiple_of(400))
}

fn days_in_month(year: u64, month: u64) -> u64 {
    match month {
        2 if is_leap(year) => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// Days since 1970-01-01 of a date from 1970 on (Howard Hinnant's `days_from_civil`).
fn days_from_civil(year: u64, month: u64, day: u64) -> u64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y / 400;
    let yoe = y % 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    (era * 146_097 + doe).saturating_sub(719_468)
}

/// The date of a day count since 1970-01-01 (the inverse of [`days_from_civil`]).
fn civil_from_days(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z % 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn digests() -> Vec<([u8; 32], usize)> {
        vec![(hash_key(b"sk-one"), 0), (hash_key(b"sk-two"), 1), (hash_key(b"sk-three"), 1)]
    }

    #[test]
    fn bearer() {
        assert_eq!(authenticate(&digests(), Some(b"Bearer sk-one"), None), Ok(0));
        assert_eq!(authenticate(&digests(), Some(b"bearer  sk-two "), None), Ok(1));
        assert_eq!(authenticate(&digests(), Some(b"BEARER sk-three"), None), Ok(1));
    }

    #[test]
    fn x_api_key() {
        assert_eq!(authenticate(&digests(), None, Some(b"sk-two")), Ok(1));
        // Non-Bearer Authorization falls back to x-api-key.
        assert_eq!(authenticate(&digests(), Some(b"Basic Zm9vOmJhcg=="), Some(b"sk-one")), Ok(0));
        // Bearer wins over x-api-key.
        assert_eq!(authenticate(&digests(), Some(b"Bearer sk-one"), Some(b"sk-two")), Ok(0));
        // An empty bearer falls back too.
        assert_eq!(authenticate(&digests(), Some(b"Bearer "), Some(b"sk-two")), Ok(1));
    }

    #[test]
    fn wrong_key() {
        assert_eq!(authenticate(&digests(), Some(b"Bearer sk-nope"), None), Err(GatewayError::InvalidApiKey));
        assert_eq!(authenticate(&digests(), None, Some(b"sk-one ")), Ok(0));
        assert_eq!(authenticate(&digests(), None, Some(b"SK-ONE")), Err(GatewayError::InvalidApiKey));
        assert_eq!(authenticate(&[], None, Some(b"sk-one")), Err(GatewayError::InvalidApiKey));
    }

    #[test]
    fn missing_key() {
        assert_eq!(authenticate(&digests(), None, None), Err(GatewayError::MissingApiKey));
        assert_eq!(authenticate(&digests(), Some(b"Bearer"), None), Err(GatewayError::MissingApiKey));
        assert_eq!(authenticate(&digests(), Some(b"Basic abc"), None), Err(GatewayError::MissingApiKey));
        assert_eq!(authenticate(&digests(), None, Some(b"  ")), Err(GatewayError::MissingApiKey));
    }

    #[test]
    fn constant_time_scan_finds_last_entry() {
        // The match at the end of a long list is found, and a match at the start still scans the
        // rest (the result does not depend on position).
        let mut many: Vec<([u8; 32], usize)> =
            (0..100).map(|i| (hash_key(format!("k{i}").as_bytes()), i)).collect();
        assert_eq!(find_key(&many, &hash_key(b"k99")), Some(99));
        assert_eq!(find_key(&many, &hash_key(b"k0")), Some(0));
        many.push((hash_key(b"last"), 7));
        assert_eq!(find_key(&many, &hash_key(b"last")), Some(7));
        assert_eq!(find_key(&many, &hash_key(b"none")), None);
    }

    #[test]
    fn timestamps_read_only_utc_rfc3339_seconds() {
        assert_eq!(parse_utc_timestamp("1970-01-01T00:00:00Z"), Some(0));
        assert_eq!(parse_utc_timestamp("2026-07-01T00:00:00Z"), Some(1_782_864_000));
        assert_eq!(parse_utc_timestamp("2024-02-29T23:59:59Z"), Some(1_709_251_199));
        for bad in [
            "2023-02-29T00:00:00Z",
            "2026-13-01T00:00:00Z",
            "2026-07-01 00:00:00Z",
            "2026-07-01T00:00:00+00:00",
            "2026-07-01T24:00:00Z",
            "2026-07-01T00:00:00.5Z",
            "1969-12-31T23:59:59Z",
            "+026-07-01T00:00:00Z",
            "",
        ] {
            assert_eq!(parse_utc_timestamp(bad), None, "{bad}");
        }
        for t in [0, 1_709_251_199, 1_782_864_000, 4_102_444_800] {
            assert_eq!(parse_utc_timestamp(&format_utc_timestamp(t)), Some(t));
        }
    }

    #[test]
    fn a_key_is_valid_only_inside_its_window() {
        let w = KeyWindow { not_before: Some(100), expires_at: Some(200) };
        assert_eq!(w.check(99), Err(GatewayError::ApiKeyNotYetValid));
        assert_eq!(w.check(100), Ok(()));
        assert_eq!(w.check(199), Ok(()));
        assert_eq!(w.check(200), Err(GatewayError::ApiKeyExpired));
        assert_eq!(KeyWindow::default().check(0), Ok(()));
        assert_eq!(
            KeyWindow { not_before: None, expires_at: Some(1) }.check(u64::MAX),
            Err(GatewayError::ApiKeyExpired)
        );
        let expired = GatewayError::ApiKeyExpired.to_reply();
        assert_eq!(expired.status, 401);
        let body: serde_json::Value = serde_json::from_slice(&expired.body).unwrap();
        assert_eq!(body["error"]["code"], "invalid_api_key");
        assert!(body["error"]["message"].as_str().unwrap().contains("expired"));
        let early: serde_json::Value =
            serde_json::from_slice(&GatewayError::ApiKeyNotYetValid.to_reply().body).unwrap();
        assert!(early["error"]["message"].as_str().unwrap().contains("not yet valid"));
    }

    #[test]
    fn error_message_never_contains_key() {
        let e = authenticate(&digests(), Some(b"Bearer sk-secret-value"), None).unwrap_err();
        let reply = e.to_reply();
        let body = String::from_utf8(reply.body).unwrap();
        assert!(!body.contains("sk-secret-value"));
        assert!(body.contains("Incorrect API key provided."));
    }
}
