//! The ledger's writes (`lua/ledger_v1.lua`): a usage record or a charge, a give-back, batches of
//! them; and the usage stream's once-per-record appends.

use crate::admission::admission_lease::LeaseUse;
use crate::admission::limits::{BucketSpec, ReplyError};
use crate::metering::ledger::{self, CHARGED_RETENTION};
use crate::metering::meter::{EndReason, UsageRecord, UsageSource};
use crate::proto;
use crate::store::{
    finished_ms, seen_key, sent_key, unix_ms, usage_key, Applied, Call, LeaseCharge, LedgerReply,
    LedgerWrite, Store, StoreError,
};
use prost::Message;

impl Store {
    /// Applies one usage record to the ledger (`lua/ledger_v1.lua`, operation `record`, or
    /// `charge` when `charge`): adds its counts to the tenant's daily hash
    /// `<prefix>:usage:{<tenant>}:<YYYY-MM-DD>` (fields `<model>:requests`,
    /// `<model>:prompt_tokens`, `<model>:completion_tokens`, `<model>:cached_tokens`) and moves each
    /// bucket of `settlements` by its delta (tokens back; negative: charged more), all at once and
    /// once per request:
    /// - `record`: closes the request's open reservation (`<prefix>:reservations:{<tenant>}`, see
    ///   [`Store::take`]) if there is one, and is not applied ([`Applied::AfterCharge`]) when that
    ///   reservation was charged already; the record id joins the set
    ///   `<prefix>:usage-seen:{<tenant>}:<window start>` of its 10 s finish-time window (kept
    ///   [`crate::store::IDEMPOTENCY_RETENTION`] past the later of the window's end and now), and a record whose
    ///   id is there is not applied again ([`Applied::Duplicate`]).
    /// - `charge` (the sweeper's record of a reservation whose usage never arrived): applied only
    ///   while the reservation is open ([`Applied::Duplicate`] otherwise); it joins
    ///   `<prefix>:reservations-charged:{<tenant>}` for [`CHARGED_RETENTION`].
    ///
    /// Dated by `record.finished_at_unix_ms` (0: now).
    ///
    /// # Errors
    /// [`StoreError`] on timeout or Redis error ([`StoreError::maybe_applied`] says whether it may
    /// have been applied anyway).
    ///
    /// A `record` of a request admitted from an admission lease (`lease`) counts its reservation
    /// against the lease while the lease is open, or pays it again once the lease was reclaimed
    /// ([`crate::admission::admission_lease`]).
    pub async fn apply(
        &self,
        record: &UsageRecord,
        settlements: &[(BucketSpec, i64)],
        charge: bool,
        lease: Option<&LeaseUse>,
    ) -> Result<Applied, StoreError> {
        let call = self.record_call(record, settlements, charge, lease);
        let mut conn = self.conn();
        let reply: i64 = self.bounded(call.invocation(&self.ledger).invoke_async(&mut conn)).await?;
        Applied::of_reply(reply)
    }

    /// The keys and arguments of [`Store::apply`]'s script call.
    fn record_call(
        &self,
        record: &UsageRecord,
        settlements: &[(BucketSpec, i64)],
        charge: bool,
        lease: Option<&LeaseUse>,
    ) -> Call {
        let now_ms = unix_ms();
        let finished_ms = finished_ms(record, now_ms);
        // The record's day on the quota clock (the system clock outside tests).
        let day_ms = self.book.load().clock.shift_ms(finished_ms);
        let info = &record.info;
        let tenant = &info.tenant;
        let mut call = Call::default();
        call.key(ledger::reservations_key(&self.prefix, tenant)).key(ledger::due_key(&self.prefix, tenant));
        if charge {
            call.key(ledger::charged_key(&self.prefix, tenant))
                .key(usage_key(&self.prefix, tenant, day_ms / 1000))
                .arg("charge")
                .arg(&info.record_id)
                .arg(CHARGED_RETENTION.as_millis() as u64);
        } else {
            let (seen, expire_at) = seen_key(&self.prefix, tenant, finished_ms / 1000, now_ms / 1000);
            call.key(ledger::charged_key(&self.prefix, tenant))
                .key(seen)
                .key(usage_key(&self.prefix, tenant, day_ms / 1000))
                .arg("record")
                .arg(&info.record_id)
                .arg(expire_at);
        }
        call.arg(&info.model)
            .arg(record.prompt_tokens)
            .arg(record.completion_tokens)
            .arg(record.cached_tokens)
            .arg(settlements.len());
        for (bucket, delta) in settlements {
            call.key(&bucket.key).arg(bucket.capacity).arg(bucket.rate_per_minute).arg(*delta);
        }
        // Its cost (summed in the daily hash) and its quota counters, of the periods of its end
        // on the quota clock.
        call.arg(self.cost_of(record));
        Self::quota_args(&mut call, &self.book.load().plan(&self.prefix, tenant, &info.model, day_ms));
        let leased = matches!((lease, charge), (Some(_), false));
        if let (Some(lease), false) = (lease, charge) {
            call.key(ledger::leases_key(&self.prefix, tenant))
                .key(ledger::lease_used_key(&self.prefix, tenant))
                .key(ledger::leases_reclaimed_key(&self.prefix, tenant))
                .key(ledger::leases_charged_key(&self.prefix, tenant))
                .arg(&lease.lease_id)
                .arg(lease.reserved)
                .arg(ledger::KEEP_MARGIN.as_millis() as u64)
                .arg(lease.if_reclaimed.len());
            for (bucket, delta) in &lease.if_reclaimed {
                call.key(&bucket.key).arg(bucket.capacity).arg(bucket.rate_per_minute).arg(*delta);
            }
            match lease.seq {
                Some(seq) => call.arg(seq),
                None => call.arg(""),
            };
            call.arg(lease.prompt);
        }
        // The key's usage is added under its name too (`api_key <name>` in the daily hash), after
        // the lease section or an empty lease id.
        if let Some(name) = info.api_key.as_deref().filter(|n| !n.is_empty()) {
            if !leased {
                call.arg("");
            }
            call.arg(name);
        }
        call
    }

    /// Several ledger writes of one tenant in one script call (`lua/ledger_v1.lua`, operation
    /// `batch`): each applied as [`Store::apply`] or [`Store::release`] would apply it alone, in
    /// order. One reply per write, in order: [`LedgerReply::Record`] for a record or a charge,
    /// [`LedgerReply::Released`] for a release, [`LedgerReply::Failed`] for a write that raised an
    /// error in the script (its writes up to the error stay: retry it as one that may have
    /// landed).
    ///
    /// Every write must be of the same tenant (their keys share its cluster slot); an empty batch
    /// is no call.
    ///
    /// # Errors
    /// [`StoreError`] on timeout or Redis error for the whole call
    /// ([`StoreError::maybe_applied`] says whether any of it may have landed).
    pub async fn ledger_batch(&self, writes: &[LedgerWrite<'_>]) -> Result<Vec<LedgerReply>, StoreError> {
        if writes.is_empty() {
            return Ok(Vec::new());
        }
        let mut batch = Call::default();
        batch.arg("batch").arg(writes.len());
        for write in writes {
            let call = match write {
                LedgerWrite::Record { record, settlements, charge, lease } => {
                    self.record_call(record, settlements, *charge, *lease)
                }
                LedgerWrite::Release { tenant, record_id, buckets } => {
                    self.release_call(tenant, record_id, buckets)
                }
            };
            batch.arg(call.keys.len()).arg(call.args.len());
            batch.keys.extend(call.keys);
            batch.args.extend(call.args);
        }
        let mut conn = self.conn();
        let replies: Vec<i64> = self.bounded(batch.invocation(&self.ledger).invoke_async(&mut conn)).await?;
        if replies.len() != writes.len() {
            return Err(StoreError::Reply(ReplyError(format!(
                "ledger_v1.lua batch: {} replies to {} writes",
                replies.len(),
                writes.len()
            ))));
        }
        Ok(writes
            .iter()
            .zip(replies)
            .map(|(write, reply)| match (write, reply) {
                (_, -1) => LedgerReply::Failed,
                (LedgerWrite::Release { .. }, reply) => LedgerReply::Released(reply == 1),
                (LedgerWrite::Record { .. }, reply) => match Applied::of_reply(reply) {
                    Ok(applied) => LedgerReply::Record(applied),
                    Err(_) => LedgerReply::Failed,
                },
            })
            .collect())
    }

    /// A record's cost in nano-dollars at its model's price (0 without one).
    pub fn cost_of(&self, record: &UsageRecord) -> u64 {
        self.book.load().cost(
            &record.info.model,
            record.prompt_tokens,
            record.cached_tokens,
            record.completion_tokens,
        )
    }

    /// Appends a record's protobuf `UsageEvent` to the usage stream (fields `event`, `tenant`,
    /// `record_id`; `XADD ... MAXLEN ~ metering.stream_maxlen`), once per record id: the id joins
    /// the set of ids appended in its 10 s finish-time window ([`sent_key`], in the stream's
    /// cluster slot, kept [`crate::store::IDEMPOTENCY_RETENTION`] past the window) in the same script, so a
    /// retry after a failure that landed, or a second party (the gRPC access log and the usage
    /// journal) appending after an uncertain write, appends nothing more. Whether it appended.
    ///
    /// # Errors
    /// [`StoreError`] on timeout or Redis error.
    pub async fn append(&self, record: &UsageRecord) -> Result<bool, StoreError> {
        let appended = self.append_batch(&[record]).await?;
        Ok(appended.first().copied().unwrap_or(false))
    }

    /// [`Store::append`] of several records in one script call (they all go to the one stream,
    /// in its cluster slot). Whether each appended, in order; an empty batch is no call.
    ///
    /// # Errors
    /// [`StoreError`] on timeout or Redis error (a retry appends each record once still).
    pub async fn append_batch(&self, records: &[&UsageRecord]) -> Result<Vec<bool>, StoreError> {
        if records.is_empty() {
            return Ok(Vec::new());
        }
        let now_ms = unix_ms();
        let events: Vec<(u64, proto::UsageEvent)> = records
            .iter()
            .map(|record| {
                let finished = finished_ms(record, now_ms);
                let mut event = to_event(record, self.book.load().clock.shift_ms(finished));
                event.cost_nano_usd = self.cost_of(record);
                (finished, event)
            })
            .collect();
        self.append_events(now_ms, &events).await
    }

    /// Appends `events` (each with its end, unix ms, which picks its window of appended ids) in
    /// one `append_once` call, each once per `record_id` ([`Store::append`]). Whether each
    /// appended, in order.
    async fn append_events(
        &self,
        now_ms: u64,
        events: &[(u64, proto::UsageEvent)],
    ) -> Result<Vec<bool>, StoreError> {
        let mut call = Call::default();
        call.key(&self.stream).arg(self.stream_maxlen);
        for (finished, event) in events {
            let (sent, expire_at) = sent_key(&self.stream, finished / 1000, now_ms / 1000);
            call.key(sent).arg(&event.record_id).arg(expire_at).arg(event.encode_to_vec()).arg(&event.tenant);
        }
        let mut conn = self.conn();
        let appended: Vec<i64> =
            self.bounded(call.invocation(&self.append_once).invoke_async(&mut conn)).await?;
        if appended.len() != events.len() {
            return Err(StoreError::Reply(ReplyError(format!(
                "usage stream append: {} replies to {} records",
                appended.len(),
                events.len()
            ))));
        }
        Ok(appended.into_iter().map(|a| a == 1).collect())
    }

    /// Appends the usage event of a reclaimed admission lease's charge ([`Store::lease_charge`]),
    /// once per lease as [`Store::append`] appends a
    /// record's: `record_id` `lease.<lease_id>`, `requests` the charged requests, their prompt
    /// estimates as prompt tokens and the rest as completion tokens, END_REASON_UNREPORTED,
    /// USAGE_SOURCE_RESERVATION, dated now (`proto/llm_gateway/v1/usage.proto`). Whether it
    /// appended (false: appended before, or nothing was charged).
    ///
    /// # Errors
    /// [`StoreError`] on timeout or Redis error.
    pub async fn append_lease_charge(
        &self,
        tenant: &str,
        lease_id: &str,
        model: &str,
        charge: &LeaseCharge,
    ) -> Result<bool, StoreError> {
        if charge.requests == 0 {
            return Ok(false);
        }
        let now_ms = unix_ms();
        let prompt_tokens = charge.prompt_tokens.min(charge.tokens);
        let completion_tokens = charge.tokens - prompt_tokens;
        let event = proto::UsageEvent {
            tenant: tenant.to_owned(),
            model: model.to_owned(),
            prompt_tokens,
            completion_tokens,
            end_reason: proto::EndReason::Unreported as i32,
            usage_source: proto::UsageSource::Reservation as i32,
            reserved_tokens: charge.tokens,
            finished_at_unix_ms: self.book.load().clock.shift_ms(now_ms),
            record_id: format!("lease.{lease_id}"),
            cost_nano_usd: self.book.load().cost(model, prompt_tokens, 0, completion_tokens),
            requests: charge.requests,
            ..Default::default()
        };
        let appended = self.append_events(now_ms, &[(now_ms, event)]).await?;
        Ok(appended.first() == Some(&true))
    }

    /// Gives an admission back (`lua/ledger_v1.lua`, operation `release`): if the request's
    /// reservation is open, closes it and returns one request to each requests bucket of
    /// `buckets` and the reservation's tokens (at most each one's capacity) to each tokens
    /// bucket. Whether it was open (false: already closed, given back or charged: nothing
    /// moved). Safe to retry.
    ///
    /// # Errors
    /// [`StoreError`] on timeout or Redis error.
    pub async fn release(
        &self,
        tenant: &str,
        record_id: &str,
        buckets: &[BucketSpec],
    ) -> Result<bool, StoreError> {
        let call = self.release_call(tenant, record_id, buckets);
        let mut conn = self.conn();
        let reply: i64 = self.bounded(call.invocation(&self.ledger).invoke_async(&mut conn)).await?;
        Ok(reply == 1)
    }

    /// The keys and arguments of [`Store::release`]'s script call.
    fn release_call(&self, tenant: &str, record_id: &str, buckets: &[BucketSpec]) -> Call {
        let mut call = Call::default();
        call.key(ledger::reservations_key(&self.prefix, tenant))
            .key(ledger::due_key(&self.prefix, tenant))
            .arg("release")
            .arg(record_id)
            .arg(buckets.len());
        for b in buckets {
            call.key(&b.key).arg(b.kind.as_str()).arg(b.capacity).arg(b.rate_per_minute);
        }
        let now_ms = self.book.load().clock.now_ms();
        Self::quota_args(&mut call, &self.book.load().plan_all_models(&self.prefix, tenant, now_ms));
        call
    }
}

fn to_event(r: &UsageRecord, finished_at_unix_ms: u64) -> proto::UsageEvent {
    proto::UsageEvent {
        request_id: r.info.request_id.clone(),
        tenant: r.info.tenant.clone(),
        model: r.info.model.clone(),
        pool: r.info.pool.clone(),
        prompt_tokens: r.prompt_tokens,
        completion_tokens: r.completion_tokens,
        cached_tokens: r.cached_tokens,
        ttft_us: r.ttft_us,
        duration_us: r.duration_us,
        status: u32::from(r.status),
        end_reason: match (r.unreported, r.end_reason) {
            (true, _) => proto::EndReason::Unreported,
            (false, EndReason::Completed) => proto::EndReason::Completed,
            (false, EndReason::Incomplete) => proto::EndReason::Incomplete,
        } as i32,
        usage_source: match r.usage_source {
            UsageSource::Upstream => proto::UsageSource::Upstream,
            UsageSource::StreamedChunks => proto::UsageSource::StreamedChunks,
            UsageSource::Reservation => proto::UsageSource::Reservation,
        } as i32,
        reserved_tokens: r.info.reserved_tokens,
        finished_at_unix_ms,
        record_id: r.info.record_id.clone(),
        tier: r.info.tier.clone(),
        cost_nano_usd: 0,
        requests: 0,
        api_key: r.info.api_key.clone().unwrap_or_default(),
    }
}
