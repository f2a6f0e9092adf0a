//! The pools' in-flight counts shared across replicas (`lua/in_flight_flush_v1.lua`).

use crate::admission::limits::ReplyError;
use crate::store::{in_flight_key, InFlightFlush, InFlightTotal, Store, StoreError, IN_FLIGHT_REPLICA_GONE};
use std::time::{SystemTime, UNIX_EPOCH};

impl Store {
    /// Flushes this replica's cumulative in-flight counts of `pool` to
    /// `<prefix>:in-flight:{<pool>}` (fields `b:<replica>`, `a:<replica>`, `t:<replica>`, `base`,
    /// `abase`) and returns the pool-wide total, corrected by the bound, and how many replicas
    /// flushed lately (`lua/in_flight_flush_v1.lua`). Idempotent: the counts are cumulative.
    ///
    /// # Errors
    /// [`StoreError`] on timeout, Redis error or a malformed reply.
    pub async fn flush_in_flight(
        &self,
        pool: &str,
        replica: &str,
        flush: &InFlightFlush,
    ) -> Result<InFlightTotal, StoreError> {
        let now_ms = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
        let (bound, seen) = match flush.bound {
            Some((bound, seen)) => {
                (i64::try_from(bound).unwrap_or(i64::MAX), i64::try_from(seen).unwrap_or(i64::MAX))
            }
            None => (-1, -1),
        };
        let mut inv = self.in_flight.key(in_flight_key(&self.prefix, pool));
        inv.arg(replica)
            .arg(flush.balance)
            .arg(flush.admitted)
            .arg(now_ms)
            .arg(IN_FLIGHT_REPLICA_GONE.as_millis() as u64)
            .arg(bound)
            .arg(seen)
            .arg(u64::try_from(flush.live_within.as_millis()).unwrap_or(u64::MAX));
        let mut conn = self.conn();
        let reply: Vec<i64> = self.bounded(inv.invoke_async(&mut conn)).await?;
        match reply[..] {
            [total, admitted, correction, replicas] => Ok(InFlightTotal {
                total,
                admitted: u64::try_from(admitted).unwrap_or(0),
                correction,
                replicas: u64::try_from(replicas).unwrap_or(1).max(1),
            }),
            _ => Err(StoreError::Reply(ReplyError(format!(
                "in-flight flush: {} values, expected 4",
                reply.len()
            )))),
        }
    }
}
