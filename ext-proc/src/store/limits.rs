//! The token buckets: the admission's take (with its quota counters and the ledger's open
//! reservation), settlements, reconciliation and re-reservation (`lua/token_bucket_*.lua`,
//! `lua/ledger_v1.lua`).

use crate::admission::limits::{BucketSpec, ReplyError, TakeOutcome};
use crate::admission::local_limiter::Hint;
use crate::admission::quota::{self, QuotaOutcome, QuotaSpec, QuotaTake};
use crate::metering::ledger;
use crate::store::{Call, Opened, Store, StoreError, Tracking};

impl Store {
    /// Atomically takes each bucket's cost from every bucket, or from none; when admitted, also
    /// up to `leases[i]` more tokens from bucket `i` (missing entries: 0), and, with `tracking`,
    /// records the admission's reservation as open (`lua/token_bucket_take_v3.lua`: the
    /// reservation's JSON under its record id in `<prefix>:reservations:{<tenant>}`, indexed by
    /// Redis's time in `<prefix>:reservations-due:{<tenant>}`, both kept `tracking.keep` past their
    /// last write), in the same call. Returns the outcome and the lease tokens granted per bucket.
    ///
    /// # Errors
    /// [`StoreError`] on timeout, Redis error or a malformed reply.
    pub async fn take(
        &self,
        plan: &[BucketSpec],
        leases: &[u64],
        tracking: Option<&Tracking<'_>>,
    ) -> Result<(TakeOutcome, Vec<u64>), StoreError> {
        let (outcome, granted, _) = self.take_with_quotas(plan, leases, tracking, None).await?;
        Ok((outcome, granted))
    }

    /// [`Store::take`], and with `quotas` (the tenant's key in `tenant`), the quota counters in
    /// the same call (`lua/token_bucket_take_v3.lua`'s quota section): a counter at its hard limit
    /// refuses the take (the buckets deny first), an admitted take charges each counter.
    ///
    /// # Errors
    /// [`StoreError`] on timeout, Redis error or a malformed reply.
    pub async fn take_with_quotas(
        &self,
        plan: &[BucketSpec],
        leases: &[u64],
        tracking: Option<&Tracking<'_>>,
        quotas: Option<(&str, &QuotaTake<'_>)>,
    ) -> Result<(TakeOutcome, Vec<u64>, Option<QuotaOutcome>), StoreError> {
        let opened = tracking.map(|t| Opened {
            hash: ledger::reservations_key(&self.prefix, t.tenant),
            index: ledger::due_key(&self.prefix, t.tenant),
            id: t.record_id,
            json: t.reservation.to_json(),
            keep: t.keep,
        });
        self.take_opening(plan, leases, opened, quotas).await
    }

    /// The take of [`Store::take_with_quotas`], recording `opened` (a reservation or a lease)
    /// when it admits.
    pub(super) async fn take_opening(
        &self,
        plan: &[BucketSpec],
        leases: &[u64],
        opened: Option<Opened<'_>>,
        quotas: Option<(&str, &QuotaTake<'_>)>,
    ) -> Result<(TakeOutcome, Vec<u64>, Option<QuotaOutcome>), StoreError> {
        let mut inv = self.take.prepare_invoke();
        inv.arg(plan.len());
        for (i, b) in plan.iter().enumerate() {
            let lease = leases.get(i).copied().unwrap_or(0);
            inv.key(&b.key).arg(b.capacity).arg(b.rate_per_minute).arg(b.cost).arg(lease);
        }
        let quotas = quotas.filter(|(_, q)| !q.specs.is_empty());
        if let Some(o) = opened {
            inv.key(o.hash)
                .key(o.index)
                .arg(o.id)
                .arg(o.json)
                .arg(u64::try_from(o.keep.as_millis()).unwrap_or(u64::MAX));
        } else if let Some((tenant, _)) = quotas {
            // The quota section follows the reservation's: its keys and arguments are given,
            // with no record id (nothing recorded).
            inv.key(ledger::reservations_key(&self.prefix, tenant))
                .key(ledger::due_key(&self.prefix, tenant))
                .arg("")
                .arg("")
                .arg(0);
        }
        if let Some((_, q)) = quotas {
            inv.arg(q.specs.len());
            for spec in q.specs {
                inv.key(&spec.key).arg(spec.hard).arg(q.need).arg(q.charge).arg(spec.expire_at_secs);
            }
        }
        let mut conn = self.conn();
        let reply: Vec<i64> = self.bounded(inv.invoke_async(&mut conn)).await?;
        let split = (2 + 4 * plan.len()).min(reply.len());
        let (buckets, rest) = reply.split_at(split);
        let quota = match quotas {
            Some((_, q)) => Some(quota::read_reply(rest, q.specs.len()).map_err(ReplyError)?),
            None if rest.is_empty() => None,
            None => {
                return Err(StoreError::Reply(ReplyError(format!(
                    "{} values after the buckets",
                    rest.len()
                ))));
            }
        };
        // A take the buckets would admit but a quota refused: the reply's header is `[0, 0]`
        // (refused by no bucket); its bucket states are read as an admission's (nothing was
        // taken; the caller refuses on the quota).
        let (outcome, granted) = match (&quota, buckets) {
            (Some(QuotaOutcome { denied: Some(_), .. }), [0, 0, states @ ..]) => {
                let mut patched = vec![1, 0];
                patched.extend_from_slice(states);
                TakeOutcome::from_reply(&patched, plan.len())?
            }
            _ => TakeOutcome::from_reply(buckets, plan.len())?,
        };
        Ok((outcome, granted, quota))
    }

    /// The quota section of a ledger call: ARGV `q`, then per counter its period letter, label,
    /// model scope and expiry; KEYS the counters.
    pub(super) fn quota_args(call: &mut Call, specs: &[QuotaSpec]) {
        call.arg(specs.len());
        for spec in specs {
            call.key(&spec.key)
                .arg(spec.period.letter())
                .arg(&spec.label)
                .arg(spec.model.as_deref().unwrap_or(""))
                .arg(spec.expire_at_secs);
        }
    }

    /// Settles a reservation: `delta` tokens back into the bucket (negative: charge more).
    ///
    /// # Errors
    /// [`StoreError`] on timeout or Redis error.
    pub async fn settle(&self, bucket: &BucketSpec, delta: i64) -> Result<i64, StoreError> {
        let mut conn = self.conn();
        let mut inv = self.settle.key(&bucket.key);
        inv.arg(bucket.capacity).arg(bucket.rate_per_minute).arg(delta);
        self.bounded(inv.invoke_async(&mut conn)).await
    }

    /// Charges a bucket with what this sidecar admitted while Redis could not decide
    /// (`lua/token_bucket_reconcile_v1.lua`): `debt` tokens taken (negative: given back) from
    /// Redis's level now, credited only with refill Redis dropped at its capacity since `hint`'s
    /// answer (what Redis last answered this sidecar; other sidecars may have taken since, so it
    /// only lowers the result). A bucket that is missing (its node came back empty) is rebuilt
    /// from the hint. Returns the level.
    ///
    /// # Errors
    /// [`StoreError`] on timeout or Redis error (then nothing was charged, or all of it).
    pub async fn reconcile(
        &self,
        bucket: &BucketSpec,
        debt: i64,
        hint: Option<Hint>,
    ) -> Result<i64, StoreError> {
        let mut conn = self.conn();
        let mut inv = self.reconcile.key(&bucket.key);
        inv.arg(bucket.capacity)
            .arg(bucket.rate_per_minute)
            .arg(debt)
            .arg(hint.map_or_else(String::new, |h| h.level.to_string()))
            .arg(hint.map_or_else(String::new, |h| h.age_ms.to_string()));
        self.bounded(inv.invoke_async(&mut conn)).await
    }

    /// Moves an open reservation to `reservation` (`lua/ledger_v1.lua`, operation `rereserve`:
    /// after the exact prompt count): each tokens bucket of `buckets` by its share of the
    /// difference. Whether it was open (false: nothing moved). A retry moves nothing more.
    ///
    /// # Errors
    /// [`StoreError`] on timeout or Redis error.
    pub async fn rereserve(
        &self,
        tenant: &str,
        record_id: &str,
        reservation: &ledger::Reservation,
        buckets: &[BucketSpec],
    ) -> Result<bool, StoreError> {
        let mut inv = self.ledger.prepare_invoke();
        inv.key(ledger::reservations_key(&self.prefix, tenant))
            .arg("rereserve")
            .arg(record_id)
            .arg(reservation.to_json())
            .arg(buckets.len());
        for b in buckets {
            inv.key(&b.key).arg(b.capacity).arg(b.rate_per_minute);
        }
        let mut conn = self.conn();
        let reply: i64 = self.bounded(inv.invoke_async(&mut conn)).await?;
        Ok(reply == 1)
    }
}
