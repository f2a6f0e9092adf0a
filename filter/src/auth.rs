//! API-key authentication.
//!
//! The key comes from `Authorization: Bearer <key>` (the OpenAI API's scheme; `Bearer` matched
//! case-insensitively) or, when that header is absent or not Bearer, from `x-api-key: <key>`.
//! The key is hashed with SHA-256 and the digest is compared in constant time against every
//! configured digest, without early exit, so the time taken does not depend on which digest (if
//! any) matched. Keys are never logged nor echoed.

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

/// Index of the tenant owning `digest`, scanning all of `digests` with constant-time comparisons
/// and no early exit.
pub fn find_tenant(digests: &[([u8; 32], usize)], digest: &[u8; 32]) -> Option<usize> {
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
/// its digest matches none of `digests`.
pub fn authenticate(
    digests: &[([u8; 32], usize)],
    authorization: Option<&[u8]>,
    x_api_key: Option<&[u8]>,
) -> Result<usize, GatewayError> {
    let key = extract_api_key(authorization, x_api_key).ok_or(GatewayError::MissingApiKey)?;
    find_tenant(digests, &hash_key(key)).ok_or(GatewayError::InvalidApiKey)
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
        assert_eq!(find_tenant(&many, &hash_key(b"k99")), Some(99));
        assert_eq!(find_tenant(&many, &hash_key(b"k0")), Some(0));
        many.push((hash_key(b"last"), 7));
        assert_eq!(find_tenant(&many, &hash_key(b"last")), Some(7));
        assert_eq!(find_tenant(&many, &hash_key(b"none")), None);
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
