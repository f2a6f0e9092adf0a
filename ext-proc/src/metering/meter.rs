//! A usage record: one admitted request's identity (from its headers and admission's metadata)
//! joined with what [`gateway_meter`] measured of its response (in the wasm filter, handed over
//! through the gRPC access log; or in the sidecar's own ext_proc metering stream).

pub use gateway_meter::{EndReason, Meter, UnreadUsage, Usage, UsageSource};

/// What the request headers told the meter (set by the wasm filter and the admission step).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestInfo {
    /// Envoy's `x-request-id`.
    pub request_id: String,
    /// `x-gateway-tenant`.
    pub tenant: String,
    /// The name of the API key the request authenticated with (the facts'; never the key).
    pub api_key: Option<String>,
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
    /// The most prompt tokens the upstream can report
    /// ([`gateway_contract::RequestFacts::prompt_tokens_max`]; `None`: [`ABSOLUTE_MAX_TOKENS`]).
    pub prompt_tokens_max: Option<u64>,
    /// The most completion tokens the upstream can report
    /// ([`gateway_contract::RequestFacts::completion_tokens_max`]; `None`:
    /// [`ABSOLUTE_MAX_TOKENS`]).
    pub completion_tokens_max: Option<u64>,
    /// OpenTelemetry `gen_ai.operation.name` (the facts'; `None` from an older filter, or
    /// metered from headers).
    pub operation: Option<String>,
    /// The model name sent upstream, OpenTelemetry `gen_ai.response.model` (the facts').
    pub upstream_model: Option<String>,
}

impl RequestInfo {
    /// A request's identity from its headers' facts and the reservation admission made
    /// (`reserved_tokens`, `reserved_locally`: see [`crate::facts::reservation`]).
    pub fn new(
        facts: crate::facts::RequestFacts,
        (reserved_tokens, reserved_locally): (u64, bool),
        record_id: String,
    ) -> Self {
        Self {
            request_id: facts.request_id,
            tenant: facts.tenant.unwrap_or_default(),
            api_key: facts.api_key,
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
            prompt_tokens_max: facts.prompt_tokens_max,
            completion_tokens_max: facts.completion_tokens_max,
            operation: facts.operation,
            upstream_model: facts.upstream_model,
        }
    }

    /// The first count of `usage` past what the request could produce: `prompt_tokens` past
    /// [`RequestInfo::prompt_tokens_max`], `completion_tokens` past
    /// [`RequestInfo::completion_tokens_max`] (each at most [`ABSOLUTE_MAX_TOKENS`], its value
    /// when the facts had none), or `cached_tokens` past the prompt; `None` when every count is
    /// within its bound.
    pub fn out_of_bounds(&self, usage: &Usage) -> Option<OutOfBounds> {
        let bound = |max: Option<u64>| max.unwrap_or(ABSOLUTE_MAX_TOKENS).min(ABSOLUTE_MAX_TOKENS);
        if usage.prompt_tokens > bound(self.prompt_tokens_max) {
            Some(OutOfBounds::PromptTokens)
        } else if usage.completion_tokens > bound(self.completion_tokens_max) {
            Some(OutOfBounds::CompletionTokens)
        } else if usage.cached_tokens > usage.prompt_tokens {
            Some(OutOfBounds::CachedTokens)
        } else {
            None
        }
    }
}

/// The most tokens of one kind a usage record may count, whatever the facts say (and the bound
/// for facts that carry none: an older filter, `request_facts: headers`): 2^32, far past any
/// model's context, and small enough that the ledger's sums stay exact ([`MAX_LEDGER_COUNT`]).
pub const ABSOLUTE_MAX_TOKENS: u64 = 1 << 32;

/// The largest count the ledger takes: 2^53 - 1. Redis integers (`HINCRBY`) are signed 64 bits,
/// and `lua/ledger_v1.lua` sums a batch's increments in Lua numbers (doubles), exact up to 2^53;
/// it refuses any count past this bound rather than write a rounded one.
pub const MAX_LEDGER_COUNT: u64 = (1 << 53) - 1;

/// Which count of an upstream's usage was past what the request could produce
/// ([`RequestInfo::out_of_bounds`]): the `reason` of `llm_gateway_usage_out_of_bounds_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutOfBounds {
    /// `prompt_tokens` past `max_model_len` per prompt.
    PromptTokens,
    /// `completion_tokens` past each sequence's cap times the sequences.
    CompletionTokens,
    /// `cached_tokens` past `prompt_tokens`.
    CachedTokens,
}

impl OutOfBounds {
    /// The counter's `reason` label.
    pub fn label(self) -> &'static str {
        match self {
            OutOfBounds::PromptTokens => "prompt_tokens",
            OutOfBounds::CompletionTokens => "completion_tokens",
            OutOfBounds::CachedTokens => "cached_tokens",
        }
    }
}

/// Why a record bills its reservation rather than the usage the upstream reported
/// ([`UsageRecord::unusable`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnusableUsage {
    /// A 2xx response's usage could not be read (coded, missing, given twice).
    Unread(UnreadUsage),
    /// A count past what the request could produce.
    OutOfBounds(OutOfBounds),
}

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
    /// request was older than the longest stream lifetime ([`crate::metering::ledger::charged_record`];
    /// the event's `END_REASON_UNREPORTED`).
    pub unreported: bool,
    /// Set when the upstream's usage could not be used and the record bills the reservation
    /// instead (counted and logged once, where the record is finished).
    pub unusable: Option<UnusableUsage>,
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
    ///
    /// So is a 2xx response whose usage could not be read ([`Usage::unread`]: coded, missing,
    /// given twice), and one with a count past what the request could produce
    /// ([`RequestInfo::out_of_bounds`]): the upstream did the work, and none of its numbers can be
    /// trusted; [`UsageRecord::unusable`] says why.
    pub fn new(info: RequestInfo, usage: Usage, reached_upstream: bool) -> Self {
        if usage.charges_reservation(reached_upstream) {
            return Self::reservation(info, usage, None);
        }
        if let (true, Some(unread)) = (usage.started(), usage.unread) {
            return Self::reservation(info, usage, Some(UnusableUsage::Unread(unread)));
        }
        if let Some(bound) = info.out_of_bounds(&usage) {
            return Self::reservation(info, usage, Some(UnusableUsage::OutOfBounds(bound)));
        }
        let prompt_tokens = match (usage.prompt_tokens_known(), usage.started()) {
            (true, _) => usage.prompt_tokens,
            (false, true) => info.prompt_tokens_estimate,
            (false, false) => 0,
        };
        Self::of(info, usage, prompt_tokens)
    }

    /// The request billed its reservation: the prompt count, and the rest of
    /// `max(reserved_tokens, prompt + max_tokens)` as completion tokens.
    fn reservation(info: RequestInfo, usage: Usage, unusable: Option<UnusableUsage>) -> Self {
        let prompt = info.prompt_tokens_estimate;
        let total = info.reserved_tokens.max(prompt.saturating_add(info.max_tokens));
        let charged = Usage {
            prompt_tokens: prompt,
            completion_tokens: total.saturating_sub(prompt),
            cached_tokens: 0,
            usage_source: UsageSource::Reservation,
            ..usage
        };
        Self { unusable, ..Self::of(info, charged, prompt) }
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
            unusable: None,
            info,
        }
    }

    /// Prompt plus completion tokens: what the tenant's TPM bucket is charged (saturating).
    pub fn total_tokens(&self) -> u64 {
        self.prompt_tokens.saturating_add(self.completion_tokens)
    }

    /// Whether the ledger takes every count of the record exactly (each at most
    /// [`MAX_LEDGER_COUNT`]). An upstream's counts past what the request could produce bill the
    /// reservation ([`UsageRecord::new`]), so only a reservation itself that large is refused,
    /// whole, before any of it is written.
    pub fn fits_ledger(&self) -> bool {
        [self.prompt_tokens, self.completion_tokens, self.cached_tokens, self.total_tokens()]
            .into_iter()
            .all(|n| n <= MAX_LEDGER_COUNT)
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

    /// A request of 42 estimated prompt tokens and 100 completion tokens at most, reserved 142,
    /// whose facts bound the usage at 4096 prompt and 100 completion tokens.
    fn bounded() -> RequestInfo {
        RequestInfo {
            prompt_tokens_estimate: 42,
            max_tokens: 100,
            reserved_tokens: 142,
            prompt_tokens_max: Some(4096),
            completion_tokens_max: Some(100),
            ..info()
        }
    }

    fn reported(prompt_tokens: u64, completion_tokens: u64, cached_tokens: u64) -> Usage {
        Usage {
            prompt_tokens,
            completion_tokens,
            cached_tokens,
            usage_source: UsageSource::Upstream,
            ..Usage::unseen(10, 200)
        }
    }

    /// An upstream's count past what the request could produce bills the reservation, whatever
    /// it said, each bound with its reason: the liar's `i64::MAX` prompt tokens included.
    #[test]
    fn usage_past_its_bounds_bills_the_reservation() {
        let cases = [
            (reported(i64::MAX as u64, 3, 0), Some(OutOfBounds::PromptTokens)),
            (reported(4097, 3, 0), Some(OutOfBounds::PromptTokens)),
            (reported(4096, 101, 0), Some(OutOfBounds::CompletionTokens)),
            (reported(10, u64::MAX, 0), Some(OutOfBounds::CompletionTokens)),
            (reported(10, 3, 11), Some(OutOfBounds::CachedTokens)),
            (reported(4096, 100, 4096), None),
        ];
        for (usage, bound) in cases {
            let r = UsageRecord::new(bounded(), usage, true);
            assert_eq!(r.unusable, bound.map(UnusableUsage::OutOfBounds), "{usage:?}");
            if bound.is_some() {
                assert_eq!(
                    (r.prompt_tokens, r.completion_tokens, r.cached_tokens, r.usage_source),
                    (42, 100, 0, UsageSource::Reservation),
                    "{usage:?}"
                );
                assert_eq!(r.total_tokens(), r.info.reserved_tokens, "settling gives nothing back");
            } else {
                assert_eq!((r.prompt_tokens, r.completion_tokens), (4096, 100));
            }
            assert!(r.fits_ledger());
        }
        // Counted chunks are bounded too.
        let counted = Usage { completion_tokens: 101, ..Usage::unseen(10, 200) };
        assert!(UsageRecord::new(bounded(), counted, true).unusable.is_some());
        // Facts without bounds (an older filter): only the absolute one.
        let unbounded = RequestInfo { prompt_tokens_max: None, completion_tokens_max: None, ..bounded() };
        assert_eq!(
            UsageRecord::new(unbounded.clone(), reported(ABSOLUTE_MAX_TOKENS, 5000, 0), true).unusable,
            None
        );
        assert!(UsageRecord::new(unbounded, reported(ABSOLUTE_MAX_TOKENS + 1, 0, 0), true)
            .unusable
            .is_some());
    }

    /// A 2xx whose usage could not be read bills the reservation, never the prompt estimate
    /// alone; an error's (nothing owed) stays as it is.
    #[test]
    fn unread_usage_bills_the_reservation() {
        for unread in [UnreadUsage::Encoded, UnreadUsage::Missing, UnreadUsage::Duplicate] {
            let usage = Usage { completion_tokens: 7, unread: Some(unread), ..Usage::unseen(10, 200) };
            let r = UsageRecord::new(bounded(), usage, true);
            assert_eq!(r.unusable, Some(UnusableUsage::Unread(unread)));
            assert_eq!(
                (r.prompt_tokens, r.completion_tokens, r.usage_source),
                (42, 100, UsageSource::Reservation)
            );
            let error = Usage { status: 502, ..usage };
            assert_eq!(UsageRecord::new(bounded(), error, true).unusable, None);
        }
    }

    #[test]
    fn the_ledger_takes_only_exact_counts() {
        let huge = RequestInfo { prompt_tokens_estimate: MAX_LEDGER_COUNT, max_tokens: 1, ..info() };
        let r = UsageRecord::new(huge, Usage { stream: Some(false), ..Usage::unseen(10, 0) }, true);
        assert!(!r.fits_ledger(), "{r:?}");
        assert!(UsageRecord::new(bounded(), reported(10, 3, 0), true).fits_ledger());
    }
}
