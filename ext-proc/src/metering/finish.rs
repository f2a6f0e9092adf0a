//! The end of a metered request: its metrics, its settlement and its record on the way to the
//! ledger ([`finish`]), whichever way its usage arrived (the access log, the usage journal, the
//! ext_proc metering stream).

use std::sync::Arc;

use tracing::{debug, error, warn, Instrument};

use crate::admission::admission_lease::LeaseUse;
use crate::admission::limits;
use crate::metering::ledger;
use crate::metering::meter::{EndReason, UnusableUsage, UsageRecord};
use crate::metrics::labels::{
    Finished, GenAi, GenAiOutcome, GenAiTokens, TenantApiKey, TenantModel, TenantTokens, UsageReason,
    PROVIDER,
};
use crate::metrics::Metrics;
use crate::state::Shared;

/// Counts the metrics, settles the reservation (off the stream's path) and queues the record.
pub(crate) fn finish(shared: &Arc<Shared>, record: UsageRecord) {
    let span =
        tracing::info_span!("metering", request_id = %record.info.request_id, tenant = %record.info.tenant);
    let _e = span.enter();
    // Debug, not info: the usage stream holds each request's record (`UsageEvent`), and this
    // line, formatted as JSON and written on every request, cost about a tenth of the sidecar's
    // CPU at saturation (perf, bench/overhead.py's gateway-native-leases).
    debug!(
        model = %record.info.model,
        status = record.status,
        prompt_tokens = record.prompt_tokens,
        completion_tokens = record.completion_tokens,
        end_reason = ?record.end_reason,
        usage_source = ?record.usage_source,
        ttft_us = record.ttft_us,
        duration_us = record.duration_us,
        "usage"
    );
    shared.pools.charge_output(&record.info.pool, &record.info.tenant, record.completion_tokens);
    shared.pools.finished(&record.info.pool);
    if let Some(unusable) = record.unusable {
        count_unusable(&shared.metrics, &record, unusable);
    }
    if !record.fits_ledger() {
        // Counts no Redis integer holds (an upstream's bug): refused before any of it is
        // written; the reservation stays charged, nothing is refunded, and a reservation the
        // ledger tracks is charged once it is older than `record_after_ms`.
        error!(?record, "usage counts past what Redis holds: record refused");
        shared.metrics.records_refused.inc();
        return;
    }
    observe(&shared.metrics, &record, shared.limiter.store().cost_of(&record));
    let mut record = record;
    // The end of the request, not of its (possibly delayed) write, dates the record: Envoy's
    // time when the access log gave it, else now.
    if record.finished_at_unix_ms == 0 {
        record.finished_at_unix_ms = unix_ms();
    }
    let prefix = shared.limiter.store().prefix();
    let tenant = shared.config.tenant(&record.info.tenant);
    let api_key = record.info.api_key.as_deref();
    let buckets = tenant
        .map(|t| limits::token_buckets_for_key(prefix, t, &record.info.model, api_key))
        .unwrap_or_default();
    let settlements = ledger::settlements(buckets, record.info.reserved_tokens, record.total_tokens());
    let lease = tenant.and_then(|t| LeaseUse::of_record(prefix, t, &record.info, &shared.reported_leases));
    if record.info.reserved_locally {
        // Taken in this sidecar's memory (Redis was away): settled there, at once.
        let local = Arc::clone(shared);
        tokio::spawn(
            async move {
                for (bucket, delta) in &settlements {
                    local.limiter.settle(bucket, *delta, true).await;
                }
            }
            .instrument(span.clone()),
        );
        shared.recorder.record(record, Vec::new(), lease);
    } else {
        // Settled in Redis with the record, in one call, once per request (lua/ledger_v1.lua).
        shared.recorder.record(record, settlements, lease);
    }
}

/// Counts and logs a record billed at its reservation because its upstream's usage could not be
/// used ([`UsageRecord::unusable`]).
fn count_unusable(metrics: &Metrics, record: &UsageRecord, unusable: UnusableUsage) {
    let (family, reason) = match unusable {
        UnusableUsage::OutOfBounds(bound) => (&metrics.usage_out_of_bounds, bound.label()),
        UnusableUsage::Unread(unread) => (&metrics.usage_unreadable, unread.label()),
    };
    family.get_or_create(&UsageReason { reason }).inc();
    warn!(
        request_id = %record.info.request_id,
        tenant = %record.info.tenant,
        model = %record.info.model,
        reason,
        status = record.status,
        billed_tokens = record.total_tokens(),
        "upstream usage not usable: billed at the reservation"
    );
}

/// Unix milliseconds now (the sidecar's clock).
fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Per-request metrics of a finished request (`cost_nano_usd`: its cost at the model's price).
fn observe(metrics: &Metrics, r: &UsageRecord, cost_nano_usd: u64) {
    let model = metrics.bounded(&r.info.model);
    let tenant = metrics.bounded(&r.info.tenant);
    let status = match r.status {
        0 => "none".to_owned(),
        s => format!("{}xx", s / 100),
    };
    let end_reason = match r.end_reason {
        EndReason::Completed => "completed",
        EndReason::Incomplete => "incomplete",
    };
    let finished =
        Finished { tenant: tenant.clone(), model: model.clone(), status, end_reason: end_reason.to_owned() };
    metrics.responses.get_or_create(&finished).inc();
    if let Some(api_key) = &r.info.api_key {
        let key = TenantApiKey { tenant: tenant.clone(), api_key: metrics.bounded(api_key) };
        metrics.api_key_requests.get_or_create(&key).inc();
    }
    let gen_ai = GenAi {
        gen_ai_operation_name: r
            .info
            .operation
            .as_deref()
            .map_or_else(|| "unknown".to_owned(), |o| metrics.bounded(o)),
        gen_ai_provider_name: PROVIDER,
        gen_ai_request_model: model.clone(),
        gen_ai_response_model: r
            .info
            .upstream_model
            .as_deref()
            .map_or_else(|| model.clone(), |m| metrics.bounded(m)),
    };
    if r.ttft_us > 0 {
        metrics.ttft.get_or_create(&gen_ai).observe(r.ttft_us as f64 / 1e6);
    }
    if r.tpot_us > 0 {
        metrics.itl.get_or_create(&gen_ai).observe(r.tpot_us as f64 / 1e6);
    }
    let error_type = match (r.status, r.end_reason) {
        (0, _) => "no_response".to_owned(),
        (200..=299, EndReason::Completed) => String::new(),
        (200..=299, EndReason::Incomplete) => "incomplete".to_owned(),
        (s, _) => s.to_string(),
    };
    metrics
        .duration
        .get_or_create(&GenAiOutcome { gen_ai: gen_ai.clone(), error_type })
        .observe(r.duration_us as f64 / 1e6);
    for (token_type, n) in [("input", r.prompt_tokens), ("output", r.completion_tokens)] {
        let usage = GenAiTokens { gen_ai: gen_ai.clone(), gen_ai_token_type: token_type };
        metrics.token_usage.get_or_create(&usage).observe(n as f64);
        let tokens =
            TenantTokens { tenant: tenant.clone(), model: model.clone(), token_type: token_type.to_owned() };
        metrics.tokens.get_or_create(&tokens).inc_by(n);
    }
    if cost_nano_usd > 0 {
        metrics.cost_usd.get_or_create(&TenantModel { tenant, model }).inc_by(cost_nano_usd as f64 / 1e9);
    }
}
