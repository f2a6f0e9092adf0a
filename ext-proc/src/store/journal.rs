//! The usage journal's lease and checkpoint ([`crate::metering::journal`]).

use crate::store::{Store, StoreError, JOURNAL_COMMIT_LUA, JOURNAL_LEASE_LUA, JOURNAL_RELEASE_LUA};
use redis::Script;
use std::time::Duration;

impl Store {
    /// Takes the journal lease `key` for `owner`, or renews it when `owner` holds it, for `ttl`.
    /// Whether `owner` holds it now.
    ///
    /// # Errors
    /// [`StoreError`] on timeout or Redis error.
    pub async fn journal_lease(&self, key: &str, owner: &str, ttl: Duration) -> Result<bool, StoreError> {
        let script = Script::new(JOURNAL_LEASE_LUA);
        let mut inv = script.prepare_invoke();
        inv.key(key).arg(owner).arg(ttl.as_millis() as u64);
        let mut conn = self.conn();
        let reply: i64 = self.bounded(inv.invoke_async(&mut conn)).await?;
        Ok(reply == 1)
    }

    /// Gives the journal lease `key` up if `owner` holds it.
    ///
    /// # Errors
    /// [`StoreError`] on timeout or Redis error.
    pub async fn journal_release(&self, key: &str, owner: &str) -> Result<(), StoreError> {
        let script = Script::new(JOURNAL_RELEASE_LUA);
        let mut inv = script.prepare_invoke();
        inv.key(key).arg(owner);
        let mut conn = self.conn();
        let _: i64 = self.bounded(inv.invoke_async(&mut conn)).await?;
        Ok(())
    }

    /// A journal's checkpoint (`None`: none yet, or unreadable).
    ///
    /// # Errors
    /// [`StoreError`] on timeout or Redis error.
    pub async fn journal_checkpoint(
        &self,
        key: &str,
    ) -> Result<Option<crate::metering::journal::Checkpoint>, StoreError> {
        let mut cmd = redis::cmd("HMGET");
        cmd.arg(key).arg("dev").arg("ino").arg("offset");
        let mut conn = self.conn();
        let reply: Vec<Option<u64>> = self.bounded(cmd.query_async(&mut conn)).await?;
        Ok(match reply.as_slice() {
            [Some(dev), Some(ino), Some(offset)] => {
                Some(crate::metering::journal::Checkpoint { dev: *dev, ino: *ino, offset: *offset })
            }
            _ => None,
        })
    }

    /// Writes a journal's checkpoint if `owner` holds its lease, renewing the lease for `ttl`;
    /// whether it did.
    ///
    /// # Errors
    /// [`StoreError`] on timeout or Redis error.
    pub async fn journal_commit(
        &self,
        lease_key: &str,
        checkpoint_key: &str,
        owner: &str,
        at: crate::metering::journal::Checkpoint,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        let script = Script::new(JOURNAL_COMMIT_LUA);
        let mut inv = script.prepare_invoke();
        inv.key(lease_key)
            .key(checkpoint_key)
            .arg(owner)
            .arg(at.dev)
            .arg(at.ino)
            .arg(at.offset)
            .arg(ttl.as_millis() as u64);
        let mut conn = self.conn();
        let reply: i64 = self.bounded(inv.invoke_async(&mut conn)).await?;
        Ok(reply == 1)
    }
}
