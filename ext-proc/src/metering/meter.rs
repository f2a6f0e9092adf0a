//! A usage record: one admitted request's identity (from its headers and admission's metadata)
//! joined with what [`gateway_meter`] measured of its response (in the wasm filter, handed over
//! through the gRPC access log; or in the sidecar's own ext_proc metering stream).

pub use gateway_meter::{EndReason, Meter, Usage, UsageSource};

/// What the request headers told the meter (set by the wasm filter and the admission step).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestInfo {
    /// Envoy's `x-request-id`.
    pub request_id: String,
    /// `x-gateway-tenant`.
    pub tenant: String,
    /// `x-gateway-model` (public model name).
    pub model: String,
    /// `x-gateway-pool` (Envoy cluster of the vLLM pool).
    pub pool: String,
    /// `x-gateway-prompt-tokens`: the filter's prompt token count (exact or estimate).
    pub prompt_tokens_estimate: u64,
    /// The facts' `max_tokens`: the most completion tokens the request can produce over all its
    /// choices (0 when absent).
    pub max_tokens: u64,
    /// Tokens reserved at admission against the tenant's TPM bucket (0 when it has none).
    pub reserved_tokens: u64,
    /// Whether the reservation was taken in the sidecar's memory (Redis was unavailable).
    pub reserved_locally: bool,
    /// `x-gateway-tier`.
    pub tier: String,
    /// The usage record's id, the key that makes its write idempotent and that names its
    /// reservation in the ledger: derived from the request ([`gateway_contract::record_id`] of
    /// the facts' request id and nonce), so every delivery of its usage has the same one.
    pub record_id: String,
    /// The admission lease the filter admitted the request from, when it has an id
    /// ([`gateway_contract::RequestFacts::lease_id`]): the record counts its reservation against
    /// the lease (`lua/ledger_v1.lua`, the record's lease section).
    pub lease_id: Option<String>,
    /// The request's number among the lease's admissions
    /// ([`gateway_contract::RequestFacts::lease_seq`]): whether a reclaim of the lease kept its
    /// reservation charged.
    pub lease_seq: Option<u64>,
}

impl RequestInfo {
    /// A request's identity from its headers' facts and the reservation admission made
    /// (`reserved_tokens`, `reserved_locally`: see [`crate::service::reservation`]).
    pub fn new(
        facts: crate::admission::RequestFacts,
        (reserved_tokens, reserved_locally): (u64, bool),
        record_id: String,
    ) -> Self {
        Self {
            request_id: facts.request_id,
            tenant: facts.tenant.unwrap_or_default(),
            model: facts.model,
            pool: facts.pool,
            prompt_tokens_estimate: facts.prompt_tokens,
            max_tokens: facts.max_tokens,
            reserved_tokens,
            reserved_locally,
            tier: facts.tier,
            record_id,
            lease_id: facts.lease_id,
            lease_seq: facts.lease_seq,
        }
    }
}

/// The largest count Redis holds: `i64::MAX`.
pub const MAX_REDIS_COUNT: u64 = i64::MAX as u64;

/// One finished request's usage (becomes a `llm_gateway.v1.UsageEvent`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UsageRecord {
    /// The request's identity and reservation.
    pub info: RequestInfo,
    /// OpenAI `usage.prompt_tokens`.
    pub prompt_tokens: u64,
    /// OpenAI `usage.completion_tokens`.
    pub completion_tokens: u64,
    /// OpenAI `usage.prompt_tokens_details.cached_tokens`.
    pub cached_tokens: u64,
    /// Microseconds from the request headers to the first content chunk (0: none).
    pub ttft_us: u64,
    /// Mean microseconds between content chunks after the first (0: fewer than two).
    pub tpot_us: u64,
    /// Microseconds from the request headers to the end.
    pub duration_us: u64,
    /// Upstream HTTP status (0: no response headers arrived).
    pub status: u16,
    /// How it ended.
    pub end_reason: EndReason,
    /// Where the counts came from.
    pub usage_source: UsageSource,
    /// Unix time of the end, in milliseconds; stamped by the caller (the meter reads no clock
    /// but the monotonic instants it is given). 0 until then.
    pub finished_at_unix_ms: u64,
    /// No usage arrived: the ledger's record of the request's reservation, charged once the
    /// request was older than the longest stream lifetime ([`crate::ledger::charged_record`];
    /// the event's `END_REASON_UNREPORTED`).
    pub unreported: bool,
}

impl UsageRecord {
    /// Joins a request's identity with its measured usage. When the upstream reported no usage,
    /// the prompt tokens are the request's own count (`x-gateway-prompt-tokens`) if a 2xx
    /// response had started, else 0.
    ///
    /// A request that reached the upstream (`reached_upstream`: the access log's
    /// `time_to_last_upstream_tx_byte`, Envoy sent the whole request) and ended before any
    /// response headers while not streaming ([`Usage::charges_reservation`]) is charged its
    /// reservation instead, marked [`UsageSource::Reservation`]: the prompt count plus the rest of
    /// `max(reserved_tokens, prompt + max_tokens)` as completion tokens (the reservation when the
    /// tenant has a TPM bucket, so settling it gives nothing back).
    pub fn new(info: RequestInfo, usage: Usage, reached_upstream: bool) -> Self {
        if usage.charges_reservation(reached_upstream) {
            let prompt = info.prompt_tokens_estimate;
            let total = info.reserved_tokens.max(prompt.saturating_add(info.max_tokens));
            let charged = Usage {
                prompt_tokens: prompt,
                completion_tokens: total.saturating_sub(prompt),
                cached_tokens: 0,
                usage_source: UsageSource::Reservation,
                ..usage
            };
            return Self::of(info, charged, prompt);
        }
        let prompt_tokens = match (usage.prompt_tokens_known(), usage.started()) {
            (true, _) => usage.prompt_tokens,
            (false, true) => info.prompt_tokens_estimate,
            (false, false) => 0,
        };
        Self::of(info, usage, prompt_tokens)
    }

    fn of(info: RequestInfo, usage: Usage, prompt_tokens: u64) -> Self {
        Self {
            prompt_tokens,
            completion_tokens: usage.completion_tokens,
            cached_tokens: usage.cached_tokens,
            ttft_us: usage.ttft_us,
            tpot_us: usage.tpot_us,
            duration_us: usage.duration_us,
            status: usage.status,
            end_reason: usage.end_reason,
            usage_source: usage.usage_source,
            finished_at_unix_ms: 0,
            unreported: false,
            info,
        }
    }

    /// Prompt plus completion tokens: what the tenant's TPM bucket is charged (saturating).
    pub fn total_tokens(&self) -> u64 {
        self.prompt_tokens.saturating_add(self.completion_tokens)
    }

    /// Whether Redis can hold every count of the record: its integers (`HINCRBY`) are signed 64
    /// bits. The upstream's numbers arrive as JSON `u64`s; a record past this is refused whole,
    /// before any of it is written.
    pub fn fits_redis(&self) -> bool {
        [self.prompt_tokens, self.completion_tokens, self.cached_tokens, self.total_tokens()]
            .into_iter()
            .all(|n| n <= MAX_REDIS_COUNT)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info() -> RequestInfo {
        RequestInfo { prompt_tokens_estimate: 42, ..Default::default() }
    }

    #[test]
    fn the_request_count_stands_in_for_missing_usage_only_once_started() {
        let usage = |status| Usage { status, completion_tokens: 2, ..Usage::unseen(10, status) };
        assert_eq!(UsageRecord::new(info(), usage(200), true).total_tokens(), 44);
        assert_eq!(UsageRecord::new(info(), usage(503), true).total_tokens(), 2);
        let reported = Usage { prompt_tokens: 7, usage_source: UsageSource::Upstream, ..usage(200) };
        assert_eq!(UsageRecord::new(info(), reported, true).prompt_tokens, 7);
    }

    #[test]
    fn a_non_stream_gone_before_its_headers_is_charged_its_reservation_once_sent_upstream() {
        let info =
            RequestInfo { prompt_tokens_estimate: 42, max_tokens: 100, reserved_tokens: 142, ..info() };
        let aborted = |stream| Usage { stream, ..Usage::unseen(10, 0) };
        let r = UsageRecord::new(info.clone(), aborted(Some(false)), true);
        assert_eq!(
            (r.prompt_tokens, r.completion_tokens, r.usage_source),
            (42, 100, UsageSource::Reservation)
        );
        assert_eq!((r.status, r.end_reason), (0, EndReason::Incomplete));
        // Settling it gives nothing back: the bucket stays where the reservation left it.
        assert_eq!(r.total_tokens(), r.info.reserved_tokens);
        // No TPM bucket (nothing reserved): still charged prompt + cap.
        let unlimited = RequestInfo { reserved_tokens: 0, ..info.clone() };
        assert_eq!(UsageRecord::new(unlimited, aborted(None), true).total_tokens(), 142);
        // Never sent upstream, or a stream: nothing.
        let unsent = UsageRecord::new(info.clone(), aborted(Some(false)), false);
        assert_eq!((unsent.total_tokens(), unsent.usage_source), (0, UsageSource::StreamedChunks));
        assert_eq!(UsageRecord::new(info, aborted(Some(true)), true).total_tokens(), 0);
    }

    #[test]
    fn upstream_numbers_cannot_wrap_or_overflow_redis() {
        let usage = |prompt_tokens, completion_tokens| Usage {
            prompt_tokens,
            completion_tokens,
            usage_source: UsageSource::Upstream,
            ..Usage::unseen(10, 200)
        };
        let huge = UsageRecord::new(info(), usage(u64::MAX, u64::MAX), true);
        assert_eq!(huge.total_tokens(), u64::MAX);
        assert!(!huge.fits_redis());
        let at_limit = UsageRecord::new(info(), usage(MAX_REDIS_COUNT, 0), true);
        assert!(at_limit.fits_redis());
        // Each count fits, their sum does not: refused too.
        assert!(!UsageRecord::new(info(), usage(MAX_REDIS_COUNT, 1), true).fits_redis());
        assert!(UsageRecord::new(info(), usage(10, 3), true).fits_redis());
    }
}
