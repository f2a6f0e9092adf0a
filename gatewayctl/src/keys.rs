//! API keys: `sk-` followed by 43 URL-safe base64 characters (32 random bytes from the OS's
//! CSPRNG), and the SHA-256 digest the gateway config stores instead of the key.

use base64::Engine as _;
use rand::TryRngCore as _;
use sha2::{Digest, Sha256};

/// A new API key.
///
/// # Errors
/// The operating system's random source failed.
pub fn new_key() -> Result<String, String> {
    let mut bytes = [0u8; 32];
    rand::rngs::OsRng.try_fill_bytes(&mut bytes).map_err(|e| format!("random source: {e}"))?;
    Ok(format!("sk-{}", base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)))
}

/// The lowercase hex SHA-256 digest of a key, as `tenants[].api_keys_sha256` holds it (the
/// filter hashes the key the client sends the same way).
pub fn digest(key: &str) -> String {
    hex::encode(Sha256::digest(key.as_bytes()))
}

/// Checks a key read from stdin: non-empty, visible ASCII, no spaces (what a client can send
/// in `Authorization: Bearer`).
///
/// # Errors
/// What is wrong with it (never the key itself).
pub fn check_key(key: &str) -> Result<(), String> {
    if key.is_empty() {
        return Err("the key read from stdin is empty".to_owned());
    }
    if !key.bytes().all(|b| (0x21..=0x7e).contains(&b)) {
        return Err("the key must be visible ASCII without spaces".to_owned());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_fresh_and_well_formed() {
        let a = new_key().unwrap();
        let b = new_key().unwrap();
        assert_ne!(a, b);
        assert!(a.starts_with("sk-"));
        assert_eq!(a.len(), 3 + 43);
        assert!(a[3..].bytes().all(|c| c.is_ascii_alphanumeric() || c == b'-' || c == b'_'));
        check_key(&a).unwrap();
    }

    #[test]
    fn digest_matches_sha256() {
        assert_eq!(digest("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    }

    #[test]
    fn bad_keys() {
        assert!(check_key("").is_err());
        assert!(check_key("sk x").is_err());
    }
}
