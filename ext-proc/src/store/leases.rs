//! The admission leases' books in the ledger (`lua/ledger_v1.lua`): a lease's take, its return,
//! report and reclaim, the charge of an orphaned lease; and the sweeper's claims.

use crate::admission::admission_lease::LeaseRecord;
use crate::admission::limits::{BucketSpec, ReplyError, TakeOutcome};
use crate::admission::quota::{QuotaOutcome, QuotaTake};
use crate::metering::ledger::{self, CHARGED_RETENTION};
use crate::store::{unix_ms, usage_key, Call, LeaseCharge, Opened, Store, StoreError};
use redis::Value;
use std::time::Duration;

impl Store {
    /// Records an admission lease's take: [`Store::take_with_quotas`] that also records the lease
    /// open (`record` under `lease_id` in [`ledger::leases_key`], indexed by Redis's time in
    /// [`ledger::lease_due_key`], both kept `keep` past the write) when the take admits.
    ///
    /// # Errors
    /// [`StoreError`] on timeout, Redis error or a malformed reply.
    pub async fn take_lease(
        &self,
        tenant: &str,
        lease_id: &str,
        record: &LeaseRecord,
        keep: Duration,
        plan: &[BucketSpec],
        quotas: Option<&QuotaTake<'_>>,
    ) -> Result<(TakeOutcome, Option<QuotaOutcome>), StoreError> {
        let opened = Opened {
            hash: ledger::leases_key(&self.prefix, tenant),
            index: ledger::lease_due_key(&self.prefix, tenant),
            id: lease_id,
            json: record.to_json(),
            keep,
        };
        let (outcome, _, quota) =
            self.take_opening(plan, &[], Some(opened), quotas.map(|q| (tenant, q))).await?;
        Ok((outcome, quota))
    }

    /// Gives an admission lease's rest back (`lua/ledger_v1.lua`, operation `lease_return`):
    /// `settlements` move their buckets only while the lease is open, and close it. Whether it was
    /// open (false: reclaimed already, or given back: nothing moved). Safe to retry.
    ///
    /// # Errors
    /// [`StoreError`] on timeout or Redis error.
    pub async fn lease_return(
        &self,
        tenant: &str,
        lease_id: &str,
        settlements: &[(BucketSpec, i64)],
    ) -> Result<bool, StoreError> {
        let mut inv = self.ledger.prepare_invoke();
        inv.key(ledger::leases_key(&self.prefix, tenant))
            .key(ledger::lease_due_key(&self.prefix, tenant))
            .key(ledger::lease_used_key(&self.prefix, tenant))
            .arg("lease_return")
            .arg(lease_id)
            .arg(settlements.len());
        for (bucket, delta) in settlements {
            inv.key(&bucket.key).arg(bucket.capacity).arg(bucket.rate_per_minute).arg(*delta);
        }
        let mut conn = self.conn();
        let reply: i64 = self.bounded(inv.invoke_async(&mut conn)).await?;
        Ok(reply == 1)
    }

    /// Records a filter's report on an admission lease it holds (`lua/ledger_v1.lua`, operation
    /// `lease_report`): `admitted` requests numbered 1 to `admitted` were admitted from it, and
    /// reserved `reserved` tokens together, `prompt` of them prompt estimates (all cumulative since
    /// the grant; `proto/llm_gateway/v1/lease.proto`, `report_*`). A reclaim of the lease then
    /// keeps those reservations charged, and charges those whose usage has not landed as usage
    /// ([`Store::lease_reclaim`]). Whether the lease was open (false: given back or reclaimed;
    /// nothing is written). A report older than the one recorded changes nothing. Safe to retry.
    ///
    /// # Errors
    /// [`StoreError`] on timeout or Redis error.
    pub async fn lease_report(
        &self,
        tenant: &str,
        lease_id: &str,
        admitted: u64,
        reserved: u64,
        prompt: u64,
    ) -> Result<bool, StoreError> {
        let mut inv = self.ledger.prepare_invoke();
        inv.key(ledger::leases_key(&self.prefix, tenant))
            .key(ledger::lease_used_key(&self.prefix, tenant))
            .arg("lease_report")
            .arg(lease_id)
            .arg(admitted)
            .arg(reserved)
            .arg(u64::try_from(ledger::KEEP_MARGIN.as_millis()).unwrap_or(u64::MAX))
            .arg(prompt.min(reserved));
        let mut conn = self.conn();
        let reply: i64 = self.bounded(inv.invoke_async(&mut conn)).await?;
        Ok(reply == 1)
    }

    /// Reclaims an orphaned admission lease (`lua/ledger_v1.lua`, operation `lease_reclaim`):
    /// closes it, remembers it reclaimed, and gives each of `buckets` (the plan of its tenant and
    /// model) what the lease took less what its requests reserved: those the filter reported
    /// ([`Store::lease_report`]) and those whose usage landed. `retention` is the longest stream
    /// lifetime: the lease's reported requests whose usage has not landed by then are charged as
    /// usage ([`Store::lease_charge`]); what the charge reads is kept `retention` plus
    /// [`ledger::KEEP_MARGIN`] (a charge due at `retention` may come a few sweeps later).
    /// The requests and tokens given back; `None` when it was not open (given back, or reclaimed
    /// by another replica).
    ///
    /// # Errors
    /// [`StoreError`] on timeout, Redis error or a malformed reply.
    pub async fn lease_reclaim(
        &self,
        tenant: &str,
        lease_id: &str,
        buckets: &[BucketSpec],
        retention: Duration,
    ) -> Result<Option<(u64, u64)>, StoreError> {
        let mut inv = self.ledger.prepare_invoke();
        inv.key(ledger::leases_key(&self.prefix, tenant))
            .key(ledger::lease_due_key(&self.prefix, tenant))
            .key(ledger::lease_used_key(&self.prefix, tenant))
            .key(ledger::leases_reclaimed_key(&self.prefix, tenant))
            .arg("lease_reclaim")
            .arg(lease_id)
            .arg(u64::try_from(retention.saturating_add(ledger::KEEP_MARGIN).as_millis()).unwrap_or(u64::MAX))
            .arg(buckets.len());
        for b in buckets {
            inv.key(&b.key).arg(b.kind.as_str()).arg(b.capacity).arg(b.rate_per_minute);
        }
        let mut conn = self.conn();
        let reply: Vec<i64> = self.bounded(inv.invoke_async(&mut conn)).await?;
        match reply.as_slice() {
            [1, requests, tokens] => {
                Ok(Some((u64::try_from(*requests).unwrap_or(0), u64::try_from(*tokens).unwrap_or(0))))
            }
            [0, ..] => Ok(None),
            other => Err(StoreError::Reply(ReplyError(format!("ledger_v1.lua lease_reclaim: {other:?}")))),
        }
    }

    /// The leases of `tenant` reclaimed more than `age` ago (the longest stream lifetime), at most
    /// `most` (`lua/ledger_v1.lua`, operation `lease_charges_due`): (lease id, model) each, for
    /// [`Store::lease_charge`].
    ///
    /// # Errors
    /// [`StoreError`] on timeout, Redis error or a malformed reply.
    pub async fn lease_charges_due(
        &self,
        tenant: &str,
        age: Duration,
        most: usize,
    ) -> Result<Vec<(String, String)>, StoreError> {
        let mut inv = self.ledger.prepare_invoke();
        inv.key(ledger::leases_reclaimed_key(&self.prefix, tenant))
            .key(ledger::lease_used_key(&self.prefix, tenant))
            .arg("lease_charges_due")
            .arg(u64::try_from(age.as_millis()).unwrap_or(u64::MAX))
            .arg(most);
        let mut conn = self.conn();
        let reply: Vec<String> = self.bounded(inv.invoke_async(&mut conn)).await?;
        let mut out = Vec::with_capacity(reply.len() / 2);
        let mut items = reply.into_iter();
        while let (Some(id), Some(model)) = (items.next(), items.next()) {
            out.push((id, model));
        }
        Ok(out)
    }

    /// Charges a reclaimed lease's reported requests whose usage never landed their reservations
    /// as usage (`lua/ledger_v1.lua`, operation `lease_charge`), once: the tenant's usage hash of
    /// today (on the quota clock) gains them under `model` (their prompt estimates as prompt
    /// tokens, the rest of their reservations as completion tokens, their cost at the model's
    /// prices), and so do the quota counters of the tenant and model; their usage, should it
    /// still arrive, is not applied ([`crate::store::Applied::AfterCharge`]), for [`CHARGED_RETENTION`]. What it
    /// charged; `None` when the lease was not waiting for its charge (charged by another replica).
    ///
    /// # Errors
    /// [`StoreError`] on timeout, Redis error or a malformed reply.
    pub async fn lease_charge(
        &self,
        tenant: &str,
        lease_id: &str,
        model: &str,
    ) -> Result<Option<LeaseCharge>, StoreError> {
        let day_ms = self.book.load().clock.shift_ms(unix_ms());
        let mut call = Call::default();
        call.key(ledger::leases_reclaimed_key(&self.prefix, tenant))
            .key(ledger::lease_used_key(&self.prefix, tenant))
            .key(ledger::leases_charged_key(&self.prefix, tenant))
            .key(usage_key(&self.prefix, tenant, day_ms / 1000))
            .arg("lease_charge")
            .arg(lease_id)
            .arg(u64::try_from(CHARGED_RETENTION.as_millis()).unwrap_or(u64::MAX))
            // Prices per token: the cost of one prompt token and of one completion token.
            .arg(self.book.load().cost(model, 1, 0, 0))
            .arg(self.book.load().cost(model, 0, 0, 1));
        Self::quota_args(&mut call, &self.book.load().plan(&self.prefix, tenant, model, day_ms));
        let mut conn = self.conn();
        let reply: Vec<i64> = self.bounded(call.invocation(&self.ledger).invoke_async(&mut conn)).await?;
        let n = |v: i64| u64::try_from(v).unwrap_or(0);
        match reply.as_slice() {
            [1, requests, tokens, prompt] => Ok(Some(LeaseCharge {
                requests: n(*requests),
                tokens: n(*tokens),
                prompt_tokens: n(*prompt),
            })),
            [0, ..] => Ok(None),
            other => Err(StoreError::Reply(ReplyError(format!("ledger_v1.lua lease_charge: {other:?}")))),
        }
    }

    /// A tenant's open admission leases granted more than `age` ago (Redis's clock), at most
    /// `most`, each due again `claim` later (`lua/ledger_v1.lua`, operation `claim`, on the lease
    /// keys); and how many are open. Unreadable records are returned as `None`.
    ///
    /// # Errors
    /// [`StoreError`] on timeout, Redis error or a malformed reply.
    pub async fn claim_leases(
        &self,
        tenant: &str,
        age: Duration,
        claim: Duration,
        most: usize,
    ) -> Result<ledger::Claimed<LeaseRecord>, StoreError> {
        let keys = [ledger::leases_key(&self.prefix, tenant), ledger::lease_due_key(&self.prefix, tenant)];
        let reply = self.claim_from(keys, age, claim, most).await?;
        ledger::read_claim_with(&reply, LeaseRecord::from_json).map_err(StoreError::Reply)
    }

    /// The `claim` operation of `lua/ledger_v1.lua` on a hash of open entries and its index.
    async fn claim_from(
        &self,
        [hash, index]: [String; 2],
        age: Duration,
        claim: Duration,
        most: usize,
    ) -> Result<Vec<Value>, StoreError> {
        let mut inv = self.ledger.prepare_invoke();
        inv.key(hash)
            .key(index)
            .arg("claim")
            .arg(age.as_millis() as u64)
            .arg(claim.as_millis() as u64)
            .arg(most);
        let mut conn = self.conn();
        self.bounded(inv.invoke_async(&mut conn)).await
    }

    /// A tenant's open reservations taken more than `age` ago (Redis's clock), at most `most`
    /// of them (`lua/ledger_v1.lua`, operation `claim`), each due again `claim` later; and how
    /// many are open. Reservations whose JSON does not parse are returned as `None`.
    ///
    /// # Errors
    /// [`StoreError`] on timeout, Redis error or a malformed reply.
    pub async fn claim(
        &self,
        tenant: &str,
        age: Duration,
        claim: Duration,
        most: usize,
    ) -> Result<ledger::Claimed, StoreError> {
        let keys = [ledger::reservations_key(&self.prefix, tenant), ledger::due_key(&self.prefix, tenant)];
        let reply = self.claim_from(keys, age, claim, most).await?;
        ledger::read_claim(&reply).map_err(StoreError::Reply)
    }
}
