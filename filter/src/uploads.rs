//! Per-tenant upload slots: how many request bodies of one tenant this VM (one Envoy worker) is
//! receiving at once.
//!
//! The filter buffers every request body before it decides (the body names the model), so a
//! request holds Envoy memory from its headers until its last body byte. A client that sends its
//! body slowly holds that memory for as long as the listener's `request_timeout` allows, and
//! Envoy's buffers for a slow body cost several times its bytes (each read keeps its own 16 KiB
//! slice: `bench/edge_attack.py`). Unauthenticated clients never get that far (401 at the
//! headers); this bounds what one API key can hold: a request whose tenant already has
//! `max_uploads_per_tenant` bodies in progress in this worker is answered 429 `rate_limit_exceeded`
//! (`Retry-After: 1`) at its headers. A slot is taken after authentication, when the filter waits
//! for the body, and given back when the body is complete or the stream ends, whichever comes
//! first (the adapter holds it in a guard dropped with the HTTP context).

use std::collections::HashMap;

/// Bodies in progress per tenant (by the tenant's index in the configuration).
#[derive(Debug, Default)]
pub struct UploadSlots {
    in_progress: HashMap<usize, u32>,
}

impl UploadSlots {
    /// Takes a slot for `tenant` if it has fewer than `limit` in progress; `false` when full.
    pub fn try_acquire(&mut self, tenant: usize, limit: u32) -> bool {
        let n = self.in_progress.entry(tenant).or_insert(0);
        if *n >= limit {
            return false;
        }
        *n = n.saturating_add(1);
        true
    }

    /// Gives one of `tenant`'s slots back (no-op when it holds none).
    pub fn release(&mut self, tenant: usize) {
        if let Some(n) = self.in_progress.get_mut(&tenant) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.in_progress.remove(&tenant);
            }
        }
    }

    /// Bodies of `tenant` in progress.
    pub fn in_progress(&self, tenant: usize) -> u32 {
        self.in_progress.get(&tenant).copied().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tenant_gets_at_most_limit_slots_and_others_are_unaffected() {
        let mut s = UploadSlots::default();
        assert!(s.try_acquire(0, 2));
        assert!(s.try_acquire(0, 2));
        assert!(!s.try_acquire(0, 2));
        assert!(s.try_acquire(1, 2), "another tenant has its own slots");
        s.release(0);
        assert_eq!(s.in_progress(0), 1);
        assert!(s.try_acquire(0, 2));
        s.release(0);
        s.release(0);
        s.release(0); // more releases than slots: stays at zero
        assert_eq!(s.in_progress(0), 0);
        assert!(!s.in_progress.contains_key(&0), "an idle tenant leaves no entry");
    }
}
