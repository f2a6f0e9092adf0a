//! The admission's stages, in their order, written once ([`run`]): a request whose facts say a
//! lease admitted it passes; then flow control's pre-check (a predicted wait over the tier's
//! budget is refused before anything is taken), the admission proper (tenant, shedding, the
//! limits and quotas, the reservation: [`crate::admission::admit`]), the exact prompt count where
//! only it decides the context rule ([`crate::admission::context`]), the pool's room (flow
//! control's queue, [`crate::pools::Pools::enter`]) and the endpoint pick
//! ([`crate::scheduling`]). What a stage took is given back on any exit before the answer is sent
//! ([`Taken`], a drop guard), so no refusal path repeats it.
//!
//! The stages need three things from the Envoy stream they decide for, which the ext_proc adapter
//! gives them through [`Exchange`]: telling Envoy to wait longer for the answer, the request's
//! body (for the exact count), and noticing that the stream ended (a client gone while queued).

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tracing::{debug, Instrument};

use crate::admission::context::{ContextError, Counted};
use crate::admission::decision;
use crate::admission::decision::Admitted;
use crate::admission::limits::{self, BucketKind, BucketSpec};
use crate::error::AdmissionError;
use crate::facts::RequestFacts;
use crate::metering::ledger::Reservation;
use crate::metrics::labels::{CountOutcome, TenantLabel};
use crate::pools::flow::{Arrival, Entered};
use crate::pools::PickOutcome;
use crate::scheduling::picker::Pick;
use crate::state::Shared;
use gateway_contract::MAX_PREFIX_HASHES;

/// The stream ended (or could not be written to): nothing more can be answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gone;

/// What the stages need from the Envoy stream of the request they decide
/// (`crate::grpc::ext_proc` implements it over an ext_proc stream).
pub trait Exchange: Send {
    /// Tells Envoy to wait up to `budget` (+ [`crate::flow_control::MESSAGE_TIMEOUT_MARGIN`]) for the
    /// answer of the phase the request is in (ext_proc `override_message_timeout`; once per
    /// phase).
    fn extend_timeout(&mut self, budget: Duration) -> impl Future<Output = Result<(), Gone>> + Send;
    /// Asks Envoy for the request's whole body and waits for it (the answer then goes to the body
    /// phase); `Ok(None)` when the stream ended first.
    fn request_body(&mut self) -> impl Future<Output = Result<Option<Vec<u8>>, Gone>> + Send;
    /// Resolves when Envoy ends the stream (nothing else is sent on it while the request waits).
    fn ended(&mut self) -> impl Future<Output = ()> + Send;
}

/// What the stages decided.
#[derive(Debug)]
pub enum Verdict {
    /// The facts say a lease admitted the request (an Envoy without the matcher that skips the
    /// admission for such requests), while this sidecar grants leases: taking again would charge
    /// the tenant twice; it passes untouched.
    Leased,
    /// Admitted: what the answer carries.
    Admit(Box<Admission>),
    /// Refused: answered with the error's ImmediateResponse (what was taken is given back).
    Refuse(AdmissionError),
    /// The stream ended before an answer (what was taken is given back).
    Gone,
}

/// An admitted request: what its answer carries. What it took is given back when it is dropped,
/// unless [`Admission::sent`] says the answer reached Envoy.
#[derive(Debug)]
pub struct Admission {
    /// The admission (its `x-ratelimit-*` values, reservation, quota warning).
    pub admitted: Admitted,
    /// The exact prompt count, when the context rule needed it.
    pub exact: Option<Counted>,
    /// How long the request waited in its pool's queue, when it did.
    pub queue_wait: Option<Duration>,
    /// The endpoint the picker picked (a pool with `picker`).
    pub pick: Option<Pick>,
    taken: Taken,
}

impl Admission {
    /// The answer reached Envoy: the request goes upstream with what it took.
    pub fn sent(mut self) {
        self.taken.armed = false;
    }
}

/// What an admitted request took (its request and reservation from the buckets, a reservation the
/// ledger tracks): given back when dropped while armed ([`give_back`]), on every exit before its
/// answer is sent.
struct Taken {
    shared: Arc<Shared>,
    facts: RequestFacts,
    admitted: Admitted,
    armed: bool,
}

impl std::fmt::Debug for Taken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Taken").field("facts", &self.facts).field("armed", &self.armed).finish()
    }
}

impl Drop for Taken {
    fn drop(&mut self) {
        if self.armed {
            give_back(&self.shared, &self.facts, &self.admitted);
        }
    }
}

/// Runs the stages for one request (its facts as the filter decided them; `context_model`: the
/// base model whose tokenizer counts it exactly, when the filter asked for the exact check;
/// `subset`: the endpoint-picker protocol's subset hint), recording the outcome on `span` and in
/// `llm_gateway_requests_total`.
pub async fn run(
    shared: &Arc<Shared>,
    mut facts: RequestFacts,
    context_model: Option<String>,
    subset: Option<&[SocketAddr]>,
    span: &tracing::Span,
    envoy: &mut impl Exchange,
) -> Verdict {
    if facts.leased_tokens.is_some() && shared.config.redis.lease_fraction > 0.0 {
        return Verdict::Leased;
    }
    // Only the filter's own state can say a lease admitted it, and only while leases are granted.
    facts.leased_tokens = None;
    facts.lease_id = None;
    facts.lease_seq = None;
    // The base model's tokenizer (for a LoRA adapter, the facts' model names the adapter).
    let exact = context_model.as_deref().is_some_and(|m| shared.context.knows(m));
    let context_model = context_model.unwrap_or_default();
    // A request its pool may make wait: refused at once when its predicted wait is over its
    // budget, else Envoy is told at once to wait as long as the budget (then neither the limits'
    // Redis call nor the queue can run into the admission filter's message_timeout, also when a
    // burst arrives at once).
    let mut extended = false;
    if let Some((tier, budget)) = shared.queued_tier(&facts) {
        let tenant = facts.tenant.as_deref().unwrap_or("");
        if let Some(retry_after_secs) = shared.pools.predict_refusal(&facts.pool, tier, tenant, budget) {
            let error = AdmissionError::Overloaded { pool: facts.pool.clone(), retry_after_secs };
            return refused(shared, span, &facts, error, "predicted wait over the tier's budget");
        }
        if !shared.pools.room_now(&facts.pool, tier) {
            if envoy.extend_timeout(budget).await.is_err() {
                return Verdict::Gone;
            }
            extended = true;
        }
    }
    // The cheap checks first (tenant, shedding, the limits with the filter's estimate): a tenant
    // over its limit, or a shed pool, never costs an exact count.
    let admitted = match crate::admission::admit::admit(shared, &facts).instrument(span.clone()).await {
        Ok(admitted) => admitted,
        Err(error) => return refused(shared, span, &facts, error, "refused"),
    };
    let mut taken = Taken { shared: Arc::clone(shared), facts, admitted, armed: true };
    let mut exact_count = None;
    if exact {
        match exact_context_stage(shared, &context_model, &mut taken, span, envoy).await {
            Ok(counted) => exact_count = counted,
            Err(verdict) => return verdict,
        }
        // The body is another processing phase: a new message_timeout (and override) applies.
        extended = false;
    }
    // Then the pool's room: a flow-controlled pool may hold the request in its queue (its
    // answer waits); counted in flight from here on.
    let queue_wait = match wait_for_room(shared, &taken.facts, envoy, extended).instrument(span.clone()).await
    {
        Ok(waited) => waited,
        Err(Some(error)) => return refused(shared, span, &taken.facts, error, "refused by the queue"),
        // The stream went away while queued: nothing to answer.
        Err(None) => return Verdict::Gone,
    };
    // Last, the endpoint (for a pool with `picker`): a refusal here takes the request back off
    // the pool's in-flight count, and gives the admission back.
    let pick = match pick_endpoint(shared, &taken.facts, subset) {
        Ok(pick) => pick,
        Err(error) => {
            shared.pools.finished(&taken.facts.pool);
            return refused(shared, span, &taken.facts, error, "refused");
        }
    };
    {
        let _e = span.enter();
        debug!(
            reserved_tokens = taken.admitted.reserved_tokens,
            endpoint = pick.as_ref().map(Pick::value),
            "admitted"
        );
    }
    let tenant = taken.facts.tenant.as_deref().unwrap_or("");
    record_outcome(shared, span, tenant, &taken.facts.model, "admitted");
    if taken.admitted.quota_warning.is_some() {
        let label = TenantLabel { tenant: shared.metrics.bounded(tenant) };
        shared.metrics.quota_warnings.get_or_create(&label).inc();
    }
    let admitted = taken.admitted.clone();
    Verdict::Admit(Box::new(Admission { admitted, exact: exact_count, queue_wait, pick, taken }))
}

/// A refusal: logged, counted, recorded on the span (what was taken goes back as its guard drops).
fn refused(
    shared: &Shared,
    span: &tracing::Span,
    facts: &RequestFacts,
    error: AdmissionError,
    why: &str,
) -> Verdict {
    {
        let _e = span.enter();
        debug!(reason = %error, "{why}");
    }
    record_outcome(shared, span, facts.tenant.as_deref().unwrap_or(""), &facts.model, outcome_label(&error));
    Verdict::Refuse(error)
}

/// The exact count stage: the body, counted; the reservation moved to the count when it fits
/// (`Ok(Some)`), the request left to vLLM when the count could not decide (`Ok(None)`); a
/// refusal (the context exceeded) or the stream's end as the verdict to return.
async fn exact_context_stage(
    shared: &Arc<Shared>,
    context_model: &str,
    taken: &mut Taken,
    span: &tracing::Span,
    envoy: &mut impl Exchange,
) -> Result<Option<Counted>, Verdict> {
    let tenant = taken.facts.tenant.clone().unwrap_or_default();
    let counted = exact_context(context_model, &tenant, envoy, shared)
        .instrument(tracing::info_span!(parent: span, "exact_count"))
        .await;
    // The stream ended during the count: the request never goes upstream.
    let Ok(Some(outcome)) = counted else { return Err(Verdict::Gone) };
    let label = match &outcome {
        Ok(_) => "fits",
        Err(ContextError::Exceeded { .. }) => "exceeded",
        Err(ContextError::Undecided(_)) => "undecided",
    };
    shared.metrics.exact_counts.get_or_create(&CountOutcome { outcome: label }).inc();
    match outcome {
        Ok(counted) => {
            {
                let _e = span.enter();
                debug!(prompt_tokens = counted.prompt_tokens, "exact context check passed");
            }
            let estimated = taken.facts.reserve_tokens();
            taken.facts.prompt_tokens = counted.prompt_tokens;
            span.record(
                "gen_ai.usage.input_tokens",
                i64::try_from(counted.prompt_tokens).unwrap_or(i64::MAX),
            );
            taken.facts.max_tokens = counted.max_tokens;
            if taken.admitted.reserved_tokens > 0 {
                taken.admitted.reserved_tokens = taken.facts.reserve_tokens();
            }
            rereserve(shared, &taken.facts, &taken.admitted, estimated).instrument(span.clone()).await;
            Ok(Some(counted))
        }
        Err(ContextError::Exceeded { param, prompt_tokens, max_tokens, max_model_len }) => {
            let error =
                AdmissionError::ContextLengthExceeded { param, prompt_tokens, max_tokens, max_model_len };
            Err(refused(shared, span, &taken.facts, error, "refused"))
        }
        Err(ContextError::Undecided(why)) => {
            let _e = span.enter();
            debug!(%why, "no exact count; vLLM decides");
            Ok(None)
        }
    }
}

/// The request's prompt block hashes (the filter's `prefix_hashes` fact; empty without it).
fn prompt_hashes(facts: &RequestFacts) -> Vec<u64> {
    facts
        .prefix_hashes
        .as_deref()
        .and_then(|h| gateway_contract::decode_prefix_hashes(h, MAX_PREFIX_HASHES))
        .unwrap_or_default()
}

/// The endpoint of an admitted request of a pool with `picker` ([`Pools::pick`]), from the
/// facts' prefix hashes and the subset hint; `Ok(None)` for a pool without a picker, and for no
/// eligible endpoint without a subset hint (sent without a pick: Envoy's `LEAST_REQUEST`
/// chooses). No eligible endpoint in a subset hint: [`AdmissionError::NoEligibleEndpoint`].
fn pick_endpoint(
    shared: &Shared,
    facts: &RequestFacts,
    subset: Option<&[std::net::SocketAddr]>,
) -> Result<Option<Pick>, AdmissionError> {
    let hashes = prompt_hashes(facts);
    if shared.config.pool_has_endpoint_picker(&facts.pool) {
        // Its InferencePool's endpoint-picker call picks (crate::grpc::epp).
        return Ok(None);
    }
    match shared.pools.pick(&facts.pool, &hashes, subset, &facts.request_id) {
        PickOutcome::NotPicking => Ok(None),
        PickOutcome::Picked(pick) => Ok(Some(pick)),
        PickOutcome::NoneEligible if subset.is_some() => {
            Err(AdmissionError::NoEligibleEndpoint { pool: facts.pool.clone() })
        }
        PickOutcome::NoneEligible => Ok(None),
    }
}

/// Moves each bucket of an admitted request's plan by `delta(bucket)` (positive gives back), off
/// the stream's path, where the admission took it (Redis or this sidecar's memory).
fn settle_plan(
    shared: &Arc<Shared>,
    facts: &RequestFacts,
    admitted: &Admitted,
    delta: impl Fn(&BucketSpec) -> i64,
) {
    let Some(tenant) = facts.tenant.as_deref().and_then(|t| shared.config.tenant(t)) else { return };
    let prefix = shared.limiter.store().prefix();
    let moves: Vec<_> = limits::plan_for_key(prefix, tenant, &facts.model, facts.api_key.as_deref(), 0)
        .into_iter()
        .map(|b| {
            let d = delta(&b);
            (b, d)
        })
        .filter(|(_, d)| *d != 0)
        .collect();
    if moves.is_empty() {
        return;
    }
    let shared = Arc::clone(shared);
    let locally = admitted.reserved_locally;
    tokio::spawn(async move {
        for (bucket, d) in &moves {
            shared.limiter.settle(bucket, *d, locally).await;
        }
    });
}

/// A request admitted but refused (or gone) before it went upstream: its request and its token
/// reservation go back to the buckets they were taken from. A reservation the ledger tracks is
/// closed with them, once ([`crate::metering::recorder::LedgerOp::Release`]).
fn give_back(shared: &Arc<Shared>, facts: &RequestFacts, admitted: &Admitted) {
    if admitted.tracked_at_ms.is_some() {
        let tenant = facts.tenant.as_deref().and_then(|t| shared.config.tenant(t));
        if let (Some(tenant), Some(record_id)) = (tenant, facts.record_id()) {
            let prefix = shared.limiter.store().prefix();
            let buckets = limits::plan_for_key(prefix, tenant, &facts.model, facts.api_key.as_deref(), 0);
            shared.recorder.release(tenant.id.clone(), record_id, buckets);
            return;
        }
    }
    settle_plan(shared, facts, admitted, |b| match b.kind {
        BucketKind::Requests => 1,
        BucketKind::Tokens => decision::settlement(b, admitted.reserved_tokens, 0),
    });
}

/// Releases the reservation of a request of `tenant` for `model` whose admission answer Envoy
/// never received, should the ledger hold it open (the access log's [`crate::metering::recorder::LedgerOp::Release`]).
pub(crate) fn release(shared: &Shared, tenant: &str, model: &str, record_id: String) {
    if let Some(config) = shared.config.tenant(tenant) {
        let buckets = limits::plan(shared.limiter.store().prefix(), config, model, 0);
        shared.recorder.release(config.id.clone(), record_id, buckets);
    }
}

/// After the exact count: each token bucket's reservation moves from the filter's estimate
/// (`estimated`, prompt + max tokens) to the exact one (`admitted.reserved_tokens`). A reservation
/// the ledger tracks moves there with its buckets, in one call that is waited for (a later
/// give-back returns what it then holds).
async fn rereserve(shared: &Arc<Shared>, facts: &RequestFacts, admitted: &Admitted, estimated: u64) {
    let tenant = facts.tenant.as_deref().and_then(|t| shared.config.tenant(t));
    if let (Some(at_ms), Some(tenant), Some(record_id)) = (admitted.tracked_at_ms, tenant, facts.record_id())
    {
        let (quota_charge, quota_ms) = admitted.quota;
        let reservation =
            Reservation::of(facts, admitted.reserved_tokens, at_ms).with_quota(quota_charge, quota_ms);
        let prefix = shared.limiter.store().prefix();
        let buckets = limits::token_buckets_for_key(prefix, tenant, &facts.model, facts.api_key.as_deref());
        let result = shared
            .metrics
            .timed_redis(
                "rereserve",
                shared.limiter.store().rereserve(&tenant.id, &record_id, &reservation, &buckets),
            )
            .await;
        match result {
            Ok(_) => return,
            Err(error) if error.maybe_applied() => {
                tracing::warn!(%error, "reservation move may not have landed");
                return;
            }
            // Nothing moved: the buckets move on their own below.
            Err(error) => tracing::warn!(%error, "reservation move failed"),
        }
    }
    if admitted.reserved_tokens == 0 {
        return;
    }
    settle_plan(shared, facts, admitted, |b| match b.kind {
        BucketKind::Requests => 0,
        BucketKind::Tokens => decision::rereservation(b, estimated, admitted.reserved_tokens),
    });
}

/// The `outcome` label of a refusal.
fn outcome_label(error: &AdmissionError) -> &'static str {
    match error {
        AdmissionError::RateLimited { kind: BucketKind::Requests, .. } => "rate_limited_requests",
        AdmissionError::RateLimited { kind: BucketKind::Tokens, .. } => "rate_limited_tokens",
        AdmissionError::Overloaded { .. } => "overloaded",
        AdmissionError::QuotaExceeded { .. } => "insufficient_quota",
        AdmissionError::LimiterUnavailable => "limiter_unavailable",
        AdmissionError::TenantNotConfigured => "tenant_not_configured",
        AdmissionError::MissingTenant => "missing_tenant",
        AdmissionError::ContextLengthExceeded { .. } => "context_length_exceeded",
        AdmissionError::NoEligibleEndpoint { .. } => "no_eligible_endpoint",
        AdmissionError::RequestTooLarge { .. } => "request_too_large",
    }
}

/// Counts an admission outcome (`llm_gateway_requests_total`) and records it on the request's
/// `admission` span (`llm_gateway.outcome`).
fn record_outcome(shared: &Shared, span: &tracing::Span, tenant: &str, model: &str, outcome: &str) {
    span.record("llm_gateway.outcome", outcome);
    shared.metrics.request(tenant, model, outcome);
}

/// The exact context check: the request's whole body from Envoy ([`Exchange::request_body`]),
/// counted on a blocking thread (never on the async workers, one count per CPU at a time) within
/// `context.count_timeout_ms`. `None` when the stream ended first.
async fn exact_context(
    model: &str,
    tenant: &str,
    envoy: &mut impl Exchange,
    shared: &Shared,
) -> Result<Option<Result<Counted, ContextError>>, Gone> {
    let Some(body) = envoy.request_body().await? else { return Ok(None) };
    let limit = std::time::Duration::from_millis(shared.config.context.count_timeout_ms);
    Ok(Some(shared.context.check_blocking(tenant, model, body, limit).await))
}

/// Counts the request in its pool's in-flight requests, at once, or once a flow-controlled pool
/// has room for it ([`Pools::enter`]): `Ok(Some(waited))` when it was queued. While it waits,
/// Envoy is told to wait as long (`override_message_timeout`, unless `extended` already in this
/// state), and a stream that ends (the client went away) takes it out of the queue: `Err(None)`.
/// `Err(Some(429))` when the queue refuses it. The caller gives the admission back on an error.
async fn wait_for_room(
    shared: &Arc<Shared>,
    facts: &RequestFacts,
    envoy: &mut impl Exchange,
    extended: bool,
) -> Result<Option<Duration>, Option<AdmissionError>> {
    let Some((tier, budget)) = shared.queued_tier(facts) else {
        shared.pools.admitted(&facts.pool);
        return Ok(None);
    };
    let tenant = facts.tenant.as_deref().unwrap_or("");
    let overloaded =
        |retry_after_secs| Some(AdmissionError::Overloaded { pool: facts.pool.clone(), retry_after_secs });
    let body_bytes = facts.body_bytes.unwrap_or(0);
    let hashes = prompt_hashes(facts);
    let arrival = Arrival {
        tier,
        tenant,
        prompt_tokens: facts.prompt_tokens,
        body_bytes,
        budget,
        hashes: &hashes,
        request_id: &facts.request_id,
    };
    let waiter = match shared.pools.enter_arrival(&facts.pool, arrival) {
        Entered::Now => return Ok(None),
        Entered::Refused(_, retry_after_secs) => return Err(overloaded(retry_after_secs)),
        Entered::Queued(waiter) => waiter,
    };
    debug!(pool = %facts.pool, "queued");
    if !extended && envoy.extend_timeout(waiter.remaining()).await.is_err() {
        return Err(None);
    }
    let queued = tracing::info_span!("queue", llm_gateway.queue_wait_ms = tracing::field::Empty);
    let wait = async {
        let released = waiter.wait().await;
        if let Ok(waited) = &released {
            let ms = i64::try_from(waited.as_millis()).unwrap_or(i64::MAX);
            tracing::Span::current().record("llm_gateway.queue_wait_ms", ms);
        }
        released
    };
    tokio::select! {
        released = wait.instrument(queued) => match released {
            Ok(waited) => Ok(Some(waited)),
            Err((_, retry_after_secs)) => Err(overloaded(retry_after_secs)),
        },
        () = envoy.ended() => Err(None),
    }
}
