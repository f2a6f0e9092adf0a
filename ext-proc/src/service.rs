//! The tonic adapter: Envoy's `envoy.service.ext_proc.v3.ExternalProcessor` service. It reads
//! `ProcessingRequest`s, calls the decisions ([`crate::admission`], [`crate::admission::shedding`] through
//! [`Pools`], [`crate::metering::meter`]) and the [`Limiter`] and [`Recorder`], and builds
//! `ProcessingResponse`s. Nothing here decides anything itself.
//!
//! One service serves both ext_proc filters of the Envoy chain; the gRPC initial metadata
//! `x-gateway-ext-proc-role` (`admission` or `metering`, set in the filter's `grpc_service`)
//! tells them apart, falling back to `observability_mode` (metering) when absent.
//! - admission (blocking, request headers only): pool shedding, then the RPM/TPM token buckets;
//!   a 429 ImmediateResponse, or a CONTINUE whose dynamic metadata (namespace `llm_gateway`)
//!   carries the `x-ratelimit-*` values, which Envoy's route adds to the response, and the tokens
//!   reserved.
//! - metering (observability mode, request headers + response headers + streamed response body):
//!   feeds the [`Meter`], settles the reservation, queues the usage record once, then ends the
//!   RPC.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::config::core::v3::header_value_option::HeaderAppendAction;
use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, HeaderValueOption, Metadata};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::ProcessingMode;
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessor;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as ProcRequest;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as ProcResponse;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    CommonResponse, HeaderMutation, HeadersResponse, HttpHeaders, ImmediateResponse, ProcessingRequest,
    ProcessingResponse,
};
use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};
use tracing::{debug, error, warn, Instrument};

use crate::admission::admission_lease::LeaseUse;
use crate::admission::context::{ContextChecker, ContextError, Counted};
use crate::admission::limiter::{Limiter, Take};
use crate::admission::limits::{self, BucketKind, BucketSpec};
use crate::admission::quota::{self, QuotaTake};
use crate::admission::{self, Admitted, RequestFacts};
use crate::config::Config;
use crate::config::FactsSource;
use crate::error::AdmissionError;
use crate::flow_control::{self, Entered};
use crate::metering::ledger::{self, Reservation};
use crate::metering::meter::{EndReason, Meter, RequestInfo, UnusableUsage, UsageRecord};
use crate::metering::recorder::Recorder;
use crate::metrics::{
    CountOutcome, Decision, Finished, Metrics, ModelLabel, PoolTier, TenantTokens, TokenType, UsageReason,
};
use crate::pools::{PickOutcome, Pools};
use crate::scheduling::Pick;
use crate::store::Tracking;
use crate::telemetry;
use gateway_contract::{
    ATTRIBUTES_FILTER_NAME, ATTRIBUTE_REQUEST, CONTEXT_CHECK_EXACT, H_CONTEXT_CHECK, H_CONTEXT_MODEL,
    H_DESTINATION_ENDPOINT, H_MAX_TOKENS, H_MODEL, H_POOL, H_PROMPT_TOKENS, H_PROMPT_TOKENS_SOURCE,
    H_REQUEST_ID, H_REQUEST_NONCE, H_TENANT, H_TIER, MAX_PREFIX_HASHES, MD_DESTINATION_ENDPOINT,
    MD_DESTINATION_ENDPOINT_SUBSET, MD_NAMESPACE_LB, MD_NAMESPACE_SUBSET_HINT, MD_PICKED_ENDPOINT,
    MD_QUEUE_WAIT_MS,
};
use tracing_opentelemetry::OpenTelemetrySpanExt;

pub use gateway_contract::{
    MD_ADMITTED, MD_PROMPT_TOKENS, MD_QUOTA_WARNING, MD_RESERVED_LOCALLY, MD_RESERVED_TOKENS,
    METADATA_NAMESPACE,
};
/// gRPC initial-metadata key naming the role of an ext_proc filter.
pub const ROLE_METADATA_KEY: &str = "x-gateway-ext-proc-role";
/// The `details` of the sidecar's own replies (ImmediateResponse), which Envoy logs as the
/// response code details: the access log tells the sidecar's refusals from requests whose
/// admission answer never arrived.
pub const ADMISSION_REPLY_DETAILS: &str = "llm_gateway_admission";

/// What every stream of the service shares.
pub struct Shared {
    /// The sidecar's config.
    pub config: Config,
    /// Rate limits (Redis, breaker, local fallback).
    pub limiter: Limiter,
    /// Usage records' way to Redis.
    pub recorder: Recorder,
    /// Pool load for shedding.
    pub pools: Arc<Pools>,
    /// Prometheus metrics.
    pub metrics: Arc<Metrics>,
    /// Exact prompt-token counting for the context check (models with a tokenizer).
    pub context: Arc<ContextChecker>,
    pub(crate) ids: RecordIds,
    /// The lease reports this replica saw Redis record: their records skip the lease section.
    pub(crate) reported_leases: crate::admission::admission_lease::ReportedLeases,
    /// gRPC streams open now (ext_proc and access log): a shutdown serves on while there are.
    open_streams: AtomicUsize,
}

/// One open gRPC stream, counted in [`Shared::open_streams`] until dropped.
pub(crate) struct OpenStream(Arc<Shared>);

impl Drop for OpenStream {
    fn drop(&mut self) {
        self.0.open_streams.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Shared {
    /// Bundles the parts.
    pub fn new(
        config: Config,
        limiter: Limiter,
        recorder: Recorder,
        pools: Arc<Pools>,
        metrics: Arc<Metrics>,
        context: Arc<ContextChecker>,
    ) -> Self {
        Self {
            config,
            limiter,
            recorder,
            pools,
            metrics,
            context,
            ids: RecordIds::new(),
            reported_leases: crate::admission::admission_lease::ReportedLeases::new(),
            open_streams: AtomicUsize::new(0),
        }
    }

    /// Counts a gRPC stream as open until the returned guard is dropped.
    pub(crate) fn stream_opened(self: &Arc<Self>) -> OpenStream {
        self.open_streams.fetch_add(1, Ordering::Relaxed);
        OpenStream(Arc::clone(self))
    }

    /// gRPC streams open now (Envoy's access-log stream stays open while Envoy runs).
    pub fn open_streams(&self) -> usize {
        self.open_streams.load(Ordering::Relaxed)
    }

    /// How long a tenant's reservation keys live past their last write: the age at which an open
    /// reservation is charged, plus [`ledger::KEEP_MARGIN`].
    pub(crate) fn reservation_keep(&self) -> Duration {
        Duration::from_millis(self.config.metering.reservations.record_after_ms) + ledger::KEEP_MARGIN
    }
}

/// Usage-record ids for requests whose facts carry no nonce (an older filter): a random
/// per-process prefix and a counter. Requests with one are named by
/// [`gateway_contract::record_id`].
pub(crate) struct RecordIds {
    prefix: u64,
    next: AtomicU64,
}

impl RecordIds {
    fn new() -> Self {
        let prefix = RandomState::new().hash_one((std::process::id(), std::time::SystemTime::now()));
        Self { prefix, next: AtomicU64::new(0) }
    }

    pub(crate) fn next(&self) -> String {
        format!("{:016x}-{:x}", self.prefix, self.next.fetch_add(1, Ordering::Relaxed))
    }
}

/// The ext_proc service.
pub struct Gateway {
    shared: Arc<Shared>,
}

impl Gateway {
    /// A service over the shared state.
    pub fn new(shared: Arc<Shared>) -> Self {
        Self { shared }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Admission,
    Metering,
}

#[tonic::async_trait]
impl ExternalProcessor for Gateway {
    type ProcessStream = ReceiverStream<Result<ProcessingResponse, Status>>;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let role = match request.metadata().get(ROLE_METADATA_KEY).map(|v| v.to_str()) {
            Some(Ok("admission")) => Some(Role::Admission),
            Some(Ok("metering")) => Some(Role::Metering),
            Some(_) => {
                return Err(Status::invalid_argument(format!(
                    "{ROLE_METADATA_KEY}: expected admission or metering"
                )))
            }
            None => None,
        };
        // Envoy's span, when tracing is on: the admission becomes its child.
        let parent =
            self.shared.config.tracing.is_some().then(|| telemetry::parent_context(request.metadata()));
        let inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(4);
        let shared = Arc::clone(&self.shared);
        let open = shared.stream_opened();
        tokio::spawn(async move {
            let _open = open;
            if let Err(status) = serve_stream(role, inbound, &tx, shared, parent).await {
                // Envoy resets the gRPC stream at the end of every HTTP stream; that is normal.
                debug!(code = ?status.code(), "ext_proc stream ended: {}", status.message());
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

type Tx = mpsc::Sender<Result<ProcessingResponse, Status>>;

async fn serve_stream(
    role: Option<Role>,
    mut inbound: Streaming<ProcessingRequest>,
    tx: &Tx,
    shared: Arc<Shared>,
    parent: Option<opentelemetry::Context>,
) -> Result<(), Status> {
    let Some(first) = inbound.message().await? else { return Ok(()) };
    let role = role.unwrap_or(if first.observability_mode { Role::Metering } else { Role::Admission });
    match role {
        Role::Admission => admission_stream(first, inbound, tx, &shared, parent).await,
        Role::Metering => metering_stream(first, inbound, &shared).await,
    }
}

/// Admission: answers the request headers, then ends the RPC (nothing else is sent to it) --
/// unless the filter asks for the exact context check (`x-gateway-context-check: exact`) of a
/// model with a tokenizer here: then the headers are answered with a `mode_override` for the
/// buffered body, and the body is answered with the decision (see [`exact_context`]).
async fn admission_stream(
    first: ProcessingRequest,
    mut inbound: Streaming<ProcessingRequest>,
    tx: &Tx,
    shared: &Arc<Shared>,
    parent: Option<opentelemetry::Context>,
) -> Result<(), Status> {
    let Some(ProcRequest::RequestHeaders(headers)) = &first.request else {
        // Misconfigured processing mode: let the request through untouched.
        return send(tx, continue_response(&first.request, None)).await;
    };
    let (mut facts, context_model) = request_facts(shared.config.request_facts, &first, headers);
    if facts.leased_tokens.is_some() && shared.config.redis.lease_fraction > 0.0 {
        // Admitted by the filter from a lease (an Envoy without the matcher that skips this
        // filter for such requests): taking again would charge the tenant twice. Only the
        // filter's own state can say so, and only while this sidecar grants leases.
        return send(tx, continue_response(&first.request, None)).await;
    }
    facts.leased_tokens = None;
    facts.lease_id = None;
    facts.lease_seq = None;
    // The endpoint-picker protocol's subset hint, sent with the request headers.
    let subset = subset_hint(first.metadata_context.as_ref());
    // The base model's tokenizer (for a LoRA adapter, the facts' model names the adapter).
    let exact = context_model.as_deref().is_some_and(|m| shared.context.knows(m));
    let context_model = context_model.unwrap_or_default();
    // Attributes of the OpenTelemetry GenAI semantic conventions, and the tenant.
    let span = tracing::info_span!(
        "admission",
        request_id = %facts.request_id,
        tenant = facts.tenant.as_deref().unwrap_or(""),
        gen_ai.request.model = %facts.model,
        // OpenTelemetry attributes are i64 (a u64 field would be exported as a string).
        gen_ai.usage.input_tokens = i64::try_from(facts.prompt_tokens).unwrap_or(i64::MAX),
        llm_gateway.pool = %facts.pool,
        llm_gateway.outcome = tracing::field::Empty,
        otel.kind = "server",
    );
    if let Some(parent) = parent {
        let _ = span.set_parent(parent);
    }
    // A request its pool may make wait: refused at once when its predicted wait is over its
    // budget, else Envoy is told at once to wait as long as the budget (then neither the limits'
    // Redis call nor the queue can run into the admission filter's message_timeout, also when a
    // burst arrives at once).
    let mut extended = false;
    if let Some((tier, budget)) = queued_tier(shared, &facts) {
        let tenant = facts.tenant.as_deref().unwrap_or("");
        if let Some(retry_after_secs) = shared.pools.predict_refusal(&facts.pool, tier, tenant, budget) {
            let error = AdmissionError::Overloaded { pool: facts.pool.clone(), retry_after_secs };
            let _e = span.enter();
            debug!(reason = %error, "predicted wait over the tier's budget");
            record_outcome(shared, &span, tenant, &facts.model, outcome_label(&error));
            return send(tx, immediate_response(&error)).await;
        }
        if !shared.pools.room_now(&facts.pool, tier) {
            extend_message_timeout(tx, budget).await?;
            extended = true;
        }
    }
    // The cheap checks first (tenant, shedding, the limits with the filter's estimate): a tenant
    // over its limit, or a shed pool, never costs an exact count.
    let decision = admit(shared, &facts).instrument(span.clone()).await;
    let mut admitted = match decision {
        Ok(admitted) => admitted,
        Err(error) => {
            let _e = span.enter();
            debug!(reason = %error, "refused");
            record_outcome(
                shared,
                &span,
                facts.tenant.as_deref().unwrap_or(""),
                &facts.model,
                outcome_label(&error),
            );
            return send(tx, immediate_response(&error)).await;
        }
    };
    let mut first = first;
    let mut exact_headers = Vec::new();
    if exact {
        let tenant = facts.tenant.clone().unwrap_or_default();
        let counted = exact_context(&context_model, &tenant, &mut inbound, tx, shared)
            .instrument(tracing::info_span!(parent: &span, "exact_count"))
            .await;
        let Ok(Some((body, outcome))) = counted else {
            // The stream ended during the count: the request never goes upstream.
            give_back(shared, &facts, &admitted);
            return counted.map(|_| ());
        };
        first = body;
        // The body is another processing state: a new message_timeout (and override) applies.
        extended = false;
        let _e = span.enter();
        let label = match &outcome {
            Ok(_) => "fits",
            Err(ContextError::Exceeded { .. }) => "exceeded",
            Err(ContextError::Undecided(_)) => "undecided",
        };
        shared.metrics.exact_counts.get_or_create(&CountOutcome { outcome: label }).inc();
        match outcome {
            Ok(counted) => {
                debug!(prompt_tokens = counted.prompt_tokens, "exact context check passed");
                let estimated = facts.reserve_tokens();
                facts.prompt_tokens = counted.prompt_tokens;
                span.record(
                    "gen_ai.usage.input_tokens",
                    i64::try_from(counted.prompt_tokens).unwrap_or(i64::MAX),
                );
                facts.max_tokens = counted.max_tokens;
                if admitted.reserved_tokens > 0 {
                    admitted.reserved_tokens = facts.reserve_tokens();
                }
                rereserve(shared, &facts, &admitted, estimated).await;
                exact_headers = exact_count_headers(&counted);
            }
            Err(ContextError::Exceeded { param, prompt_tokens, max_tokens, max_model_len }) => {
                let error =
                    AdmissionError::ContextLengthExceeded { param, prompt_tokens, max_tokens, max_model_len };
                debug!(reason = %error, "refused");
                give_back(shared, &facts, &admitted);
                record_outcome(shared, &span, &tenant, &facts.model, outcome_label(&error));
                return send(tx, immediate_response(&error)).await;
            }
            Err(ContextError::Undecided(why)) => debug!(%why, "no exact count; vLLM decides"),
        }
    }
    // Then the pool's room: a flow-controlled pool may hold the request in its queue (its
    // answer waits); counted in flight from here on.
    let queue_wait =
        match wait_for_room(shared, &facts, &mut inbound, tx, extended).instrument(span.clone()).await {
            Ok(waited) => waited,
            Err(refusal) => {
                give_back(shared, &facts, &admitted);
                return match refusal {
                    Some(error) => {
                        let _e = span.enter();
                        debug!(reason = %error, "refused by the queue");
                        record_outcome(
                            shared,
                            &span,
                            facts.tenant.as_deref().unwrap_or(""),
                            &facts.model,
                            outcome_label(&error),
                        );
                        send(tx, immediate_response(&error)).await
                    }
                    // The stream went away while queued: nothing to answer.
                    None => Ok(()),
                };
            }
        };
    let _e = span.enter();
    // Last, the endpoint (for a pool with `picker`): a refusal here gives the admission back.
    let pick = match pick_endpoint(shared, &facts, subset.as_deref()) {
        Ok(pick) => pick,
        Err(error) => {
            debug!(reason = %error, "refused");
            shared.pools.finished(&facts.pool);
            give_back(shared, &facts, &admitted);
            record_outcome(
                shared,
                &span,
                facts.tenant.as_deref().unwrap_or(""),
                &facts.model,
                outcome_label(&error),
            );
            return send(tx, immediate_response(&error)).await;
        }
    };
    debug!(reserved_tokens = admitted.reserved_tokens, endpoint = pick.as_ref().map(Pick::value), "admitted");
    record_outcome(shared, &span, facts.tenant.as_deref().unwrap_or(""), &facts.model, "admitted");
    let counted = (!exact_headers.is_empty()).then_some(facts.prompt_tokens);
    let mut metadata = admission_metadata(&admitted, counted);
    if let Some(waited) = queue_wait {
        add_queue_wait(&mut metadata, waited);
    }
    let mut set_headers = exact_headers;
    if let Some(pick) = &pick {
        add_pick(&mut metadata, pick);
        // Replaces any value already there (the filter removes client-sent x-gateway-* headers).
        set_headers.push(HeaderValueOption {
            append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
            ..header_option(H_DESTINATION_ENDPOINT, &pick.value())
        });
    }
    let mut response = continue_response(&first.request, Some(metadata));
    let common = CommonResponse {
        header_mutation: Some(HeaderMutation { set_headers, remove_headers: Vec::new() }),
        ..Default::default()
    };
    match &mut response.response {
        Some(ProcResponse::RequestBody(body)) => body.response = Some(common),
        Some(ProcResponse::RequestHeaders(headers)) if pick.is_some() => headers.response = Some(common),
        _ => {}
    }
    let sent = send(tx, response).await;
    if sent.is_err() {
        // Envoy closed the stream before the answer: the request never goes upstream.
        give_back(shared, &facts, &admitted);
    }
    sent
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
    let hashes = facts
        .prefix_hashes
        .as_deref()
        .and_then(|h| gateway_contract::decode_prefix_hashes(h, MAX_PREFIX_HASHES))
        .unwrap_or_default();
    if shared.config.pool_has_endpoint_picker(&facts.pool) {
        // Its InferencePool's endpoint-picker call picks (crate::epp).
        return Ok(None);
    }
    match shared.pools.pick(&facts.pool, &hashes, subset) {
        PickOutcome::NotPicking => Ok(None),
        PickOutcome::Picked(pick) => Ok(Some(pick)),
        PickOutcome::NoneEligible if subset.is_some() => {
            Err(AdmissionError::NoEligibleEndpoint { pool: facts.pool.clone() })
        }
        PickOutcome::NoneEligible => Ok(None),
    }
}

/// The endpoint-picker protocol's subset hint in an ext_proc request's `metadata_context`:
/// `filter_metadata["envoy.lb.subset_hint"]["x-gateway-destination-endpoint-subset"]`, a list of
/// `ip:port` strings (a comma-separated string is read too). `None` when the key is absent; the
/// addresses that parse otherwise (none, for an empty list or a value of another kind).
pub(crate) fn subset_hint(metadata: Option<&Metadata>) -> Option<Vec<std::net::SocketAddr>> {
    let value = metadata?
        .filter_metadata
        .get(MD_NAMESPACE_SUBSET_HINT)?
        .fields
        .get(MD_DESTINATION_ENDPOINT_SUBSET)?;
    let mut addrs = Vec::new();
    let mut add =
        |s: &str| addrs.extend(s.split(',').filter_map(|a| a.trim().parse::<std::net::SocketAddr>().ok()));
    match &value.kind {
        Some(Kind::ListValue(list)) => {
            for v in &list.values {
                if let Some(Kind::StringValue(s)) = &v.kind {
                    add(s);
                }
            }
        }
        Some(Kind::StringValue(s)) => add(s),
        _ => {}
    }
    Some(addrs)
}

/// Adds a pick to the admission's dynamic metadata: `envoy.lb: {x-gateway-destination-endpoint:
/// "ip:port[,ip:port...]"}` (the same value as the header, for Envoy's override-host policy),
/// and `llm_gateway.picked_endpoint: "ip:port"` (the pick, which the access log hands back).
fn add_pick(metadata: &mut Struct, pick: &Pick) {
    let text = |s: String| Value { kind: Some(Kind::StringValue(s)) };
    if let Some(Value { kind: Some(Kind::StructValue(inner)) }) = metadata.fields.get_mut(METADATA_NAMESPACE)
    {
        inner.fields.insert(MD_PICKED_ENDPOINT.to_owned(), text(pick.primary().to_owned()));
    }
    let lb = Struct { fields: HashMap::from([(MD_DESTINATION_ENDPOINT.to_owned(), text(pick.value()))]) };
    metadata.fields.insert(MD_NAMESPACE_LB.to_owned(), Value { kind: Some(Kind::StructValue(lb)) });
}

/// The endpoint the picker picked for a request, from the forwarded `llm_gateway` metadata
/// (`picked_endpoint`); None when it was not picked.
pub(crate) fn picked_endpoint(metadata: Option<&Metadata>) -> Option<String> {
    let value = metadata?.filter_metadata.get(METADATA_NAMESPACE)?.fields.get(MD_PICKED_ENDPOINT)?;
    match &value.kind {
        Some(Kind::StringValue(s)) if !s.is_empty() => Some(s.clone()),
        _ => None,
    }
}

/// Counts a picked request's end on its endpoint when dropped (the metering stream ends in many
/// places).
struct PickedGuard<'a> {
    pools: &'a Pools,
    pool: String,
    endpoint: String,
}

impl Drop for PickedGuard<'_> {
    fn drop(&mut self) {
        self.pools.pick_finished(&self.pool, &self.endpoint);
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
    let moves: Vec<_> = limits::plan(shared.limiter.store().prefix(), tenant, &facts.model, 0)
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
            let buckets = limits::plan(shared.limiter.store().prefix(), tenant, &facts.model, 0);
            shared.recorder.release(tenant.id.clone(), record_id, buckets);
            return;
        }
    }
    settle_plan(shared, facts, admitted, |b| match b.kind {
        BucketKind::Requests => 1,
        BucketKind::Tokens => admission::settlement(b, admitted.reserved_tokens, 0),
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
        let buckets = limits::token_buckets(shared.limiter.store().prefix(), tenant, &facts.model);
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
        BucketKind::Tokens => admission::rereservation(b, estimated, admitted.reserved_tokens),
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

/// The exact context check: asks Envoy for the whole request body (a `mode_override` to
/// `BUFFERED` in the answer to the request headers; the admission filter needs
/// `allow_mode_override: true`), then counts it on a blocking thread (never on the async
/// workers, one count per CPU at a time) within `context.count_timeout_ms`. Returns the body message, which the caller
/// answers, and the outcome; `None` when the stream ended first.
async fn exact_context(
    model: &str,
    tenant: &str,
    inbound: &mut Streaming<ProcessingRequest>,
    tx: &Tx,
    shared: &Shared,
) -> Result<Option<(ProcessingRequest, Result<Counted, ContextError>)>, Status> {
    let mut response = continue_response(&None, None);
    response.mode_override =
        Some(ProcessingMode { request_body_mode: BodySendMode::Buffered as i32, ..Default::default() });
    send(tx, response).await?;
    let mut message = loop {
        match inbound.message().await? {
            None => return Ok(None),
            Some(m) if matches!(m.request, Some(ProcRequest::RequestBody(_))) => break m,
            // Nothing else is sent before the body in this mode; answer it unchanged.
            Some(m) => send(tx, continue_response(&m.request, None)).await?,
        }
    };
    // The caller answers the message by its kind only: the body itself moves to the count.
    let body = match &mut message.request {
        Some(ProcRequest::RequestBody(b)) => std::mem::take(&mut b.body),
        _ => Vec::new(),
    };
    let limit = std::time::Duration::from_millis(shared.config.context.count_timeout_ms);
    let outcome = shared.context.check_blocking(tenant, model, body, limit).await;
    Ok(Some((message, outcome)))
}

/// Request headers carrying the exact count toward the metering filter and the upstream.
fn exact_count_headers(counted: &Counted) -> Vec<HeaderValueOption> {
    vec![
        header_option(H_PROMPT_TOKENS, &counted.prompt_tokens.to_string()),
        header_option(H_PROMPT_TOKENS_SOURCE, "exact"),
        header_option(H_MAX_TOKENS, &counted.max_tokens.to_string()),
    ]
}

/// Counts an admission outcome (`llm_gateway_requests_total`) and records it on the request's
/// `admission` span (`llm_gateway.outcome`).
fn record_outcome(shared: &Shared, span: &tracing::Span, tenant: &str, model: &str, outcome: &str) {
    span.record("llm_gateway.outcome", outcome);
    shared.metrics.request(tenant, model, outcome);
}

/// The request's tier in `flow_control.tiers` (index and budget) when its pool queues: None
/// for a pool without `flow_control` or a tier not listed (shed as before).
fn queued_tier(shared: &Shared, facts: &RequestFacts) -> Option<(usize, Duration)> {
    flow_control::tier_budget(shared.config.flow_control.as_ref(), &facts.tier)
        .filter(|_| shared.pools.flow_controlled(&facts.pool))
}

/// Tells Envoy to wait for this processing state's answer up to `budget` +
/// [`flow_control::MESSAGE_TIMEOUT_MARGIN`] (`override_message_timeout`; once per state).
async fn extend_message_timeout(tx: &Tx, budget: Duration) -> Result<(), Status> {
    let timeout = budget + flow_control::MESSAGE_TIMEOUT_MARGIN;
    send(
        tx,
        ProcessingResponse { override_message_timeout: Some(proto_duration(timeout)), ..Default::default() },
    )
    .await
}

/// Counts the request in its pool's in-flight requests, at once, or once a flow-controlled pool
/// has room for it ([`Pools::enter`]): `Ok(Some(waited))` when it was queued. While it waits,
/// Envoy is told to wait as long (`override_message_timeout`, unless `extended` already in this
/// state), and a stream that ends (the client went away) takes it out of the queue: `Err(None)`.
/// `Err(Some(429))` when the queue refuses it. The caller gives the admission back on an error.
async fn wait_for_room(
    shared: &Arc<Shared>,
    facts: &RequestFacts,
    inbound: &mut Streaming<ProcessingRequest>,
    tx: &Tx,
    extended: bool,
) -> Result<Option<Duration>, Option<AdmissionError>> {
    let Some((tier, budget)) = queued_tier(shared, facts) else {
        shared.pools.admitted(&facts.pool);
        return Ok(None);
    };
    let tenant = facts.tenant.as_deref().unwrap_or("");
    let overloaded =
        |retry_after_secs| Some(AdmissionError::Overloaded { pool: facts.pool.clone(), retry_after_secs });
    let body_bytes = facts.body_bytes.unwrap_or(0);
    let waiter = match shared.pools.enter(&facts.pool, tier, tenant, facts.prompt_tokens, body_bytes, budget)
    {
        Entered::Now => return Ok(None),
        Entered::Refused(_, retry_after_secs) => return Err(overloaded(retry_after_secs)),
        Entered::Queued(waiter) => waiter,
    };
    debug!(pool = %facts.pool, "queued");
    if !extended && extend_message_timeout(tx, waiter.remaining()).await.is_err() {
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
        () = stream_ended(inbound) => Err(None),
    }
}

/// Resolves when Envoy ends the ext_proc stream (nothing else is sent on it while the request
/// headers wait for their answer).
async fn stream_ended(inbound: &mut Streaming<ProcessingRequest>) {
    while let Ok(Some(_)) = inbound.message().await {}
}

fn proto_duration(d: Duration) -> envoy_types::pb::google::protobuf::Duration {
    envoy_types::pb::google::protobuf::Duration {
        seconds: i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        nanos: i32::try_from(d.subsec_nanos()).unwrap_or(0),
    }
}

/// Adds `llm_gateway.queue_wait_ms` (the route's `x-gateway-queue-wait-ms` response header).
fn add_queue_wait(metadata: &mut Struct, waited: Duration) {
    if let Some(Value { kind: Some(Kind::StructValue(inner)) }) = metadata.fields.get_mut(METADATA_NAMESPACE)
    {
        let ms = u64::try_from(waited.as_millis()).unwrap_or(u64::MAX);
        inner
            .fields
            .insert(MD_QUEUE_WAIT_MS.to_owned(), Value { kind: Some(Kind::StringValue(ms.to_string())) });
    }
}

async fn admit(shared: &Shared, facts: &RequestFacts) -> Result<Admitted, AdmissionError> {
    let config = &shared.config;
    let tenant = facts.tenant.as_deref().ok_or(AdmissionError::MissingTenant)?;
    let tenant_config = config.tenant(tenant).ok_or(AdmissionError::TenantNotConfigured)?;
    // Shed before taking quota: a request the pool cannot serve soon costs the tenant nothing.
    // A tier that queues in a flow-controlled pool is not shed: its predicted wait was checked
    // before (admission_stream).
    let shed = match queued_tier(shared, facts) {
        Some(_) => None,
        None => shared.pools.check(&facts.pool, config.shedding.level(&facts.tier)),
    };
    if let Some(shed) = shed {
        let labels =
            PoolTier { pool: shared.metrics.bounded(&facts.pool), tier: shared.metrics.bounded(&facts.tier) };
        shared.metrics.shed.get_or_create(&labels).inc();
        debug!(load = shed.load, pool = %facts.pool, "shed");
        return Err(AdmissionError::Overloaded {
            pool: facts.pool.clone(),
            retry_after_secs: shed.retry_after_secs,
        });
    }
    let plan =
        limits::plan(shared.limiter.store().prefix(), tenant_config, &facts.model, facts.reserve_tokens());
    // The reservation the ledger keeps open until the request's usage lands (crate::metering::ledger):
    // recorded by the same Redis call that takes the buckets.
    let at_ms = unix_ms();
    let reserved = if plan.iter().any(|b| b.kind == BucketKind::Tokens) { facts.reserve_tokens() } else { 0 };
    let record_id = facts.record_id();
    // The tenant's quota counters (crate::admission::quota), checked and charged in the same call; charged
    // only with a tracked reservation (the record corrects what the reservation charged).
    let store = shared.limiter.store();
    let quota_ms = store.quotas().clock.shift_ms(at_ms);
    let quota_specs = store.quotas().plan(store.prefix(), tenant, &facts.model, quota_ms);
    let quota_charge =
        if record_id.is_some() && !quota_specs.is_empty() { facts.reserve_tokens().max(1) } else { 0 };
    let reservation = Reservation::of(facts, reserved, at_ms).with_quota(quota_charge, quota_ms);
    let tracking = record_id.as_deref().map(|record_id| Tracking {
        tenant,
        record_id,
        reservation: &reservation,
        keep: shared.reservation_keep(),
    });
    if plan.is_empty() && quota_specs.is_empty() {
        // No limit to take: the reservation alone is recorded (one Redis call).
        let tracked = match &tracking {
            Some(t) => shared.limiter.track(t).await,
            None => false,
        };
        return Ok(Admitted {
            ratelimit_headers: Vec::new(),
            reserved_tokens: 0,
            reserved_locally: false,
            tracked_at_ms: tracked.then_some(at_ms),
            quota: (0, 0),
            quota_warning: None,
        });
    }
    let quota_take = QuotaTake { specs: &quota_specs, need: 0, charge: quota_charge };
    let quotas = (!quota_specs.is_empty()).then_some((tenant, &quota_take));
    let mode = config.redis.failure_mode(&facts.tier);
    let (take, tracked, quota) = shared
        .limiter
        .take(&plan, mode, tracking.as_ref(), quotas)
        .instrument(tracing::info_span!("rate_limit", db.system = "redis", otel.kind = "client"))
        .await;
    let (outcome, degraded) = match take {
        Take::Redis(outcome) => (outcome, false),
        Take::Local(outcome) => (outcome, true),
        Take::Unavailable => return Err(AdmissionError::LimiterUnavailable),
    };
    let decision = admission::decide(&plan, &outcome, facts.reserve_tokens())
        .and_then(|admitted| match &quota {
            Some(q) => quota::decide(&quota_specs, q, quota_ms).map(|warning| Admitted {
                quota: (if tracked { quota_charge } else { 0 }, quota_ms),
                quota_warning: warning,
                ..admitted
            }),
            None => Ok(admitted),
        })
        .map(|admitted| Admitted {
            reserved_locally: degraded,
            tracked_at_ms: tracked.then_some(at_ms),
            ..admitted
        });
    let labels = Decision {
        decision: if decision.is_ok() { "admit" } else { "deny" }.to_owned(),
        degraded: degraded.to_string(),
    };
    shared.metrics.limit_decisions.get_or_create(&labels).inc();
    decision
}

/// Whether a request seen by the ext_proc metering stream reached the upstream. That stream knows
/// less than the access log (no upstream timing, no request body, so no `stream` flag either): it
/// sees request headers only once every filter before the router let the request through, after
/// which the router either sends it upstream or answers a local reply (which the meter sees as
/// response headers). So an admitted request that ends with no response headers is taken as sent:
/// a non-streaming one, or one whose `stream` flag it cannot know, is charged its reservation
/// ([`gateway_meter::Usage::charges_reservation`]), including the rare client that leaves while
/// Envoy still waits for an upstream connection.
const METERED_REACHED_UPSTREAM: bool = true;

/// Metering: observability mode, so nothing is ever answered; the RPC ends when the response
/// does (so Envoy need not hold it for `deferred_close_timeout`).
async fn metering_stream(
    first: ProcessingRequest,
    mut inbound: Streaming<ProcessingRequest>,
    shared: &Arc<Shared>,
) -> Result<(), Status> {
    let mut meter = Meter::new(gateway_meter::MAX_USAGE_BYTES);
    let mut info = None;
    let mut _picked = None;
    let mut next = Some(first);
    loop {
        let message = match next.take() {
            Some(m) => m,
            None => match inbound.message().await {
                Ok(Some(m)) => m,
                // The HTTP stream ended (or was reset) before the response did.
                Ok(None) | Err(_) => break,
            },
        };
        let now = monotonic_us();
        let usage = match message.request {
            Some(ProcRequest::RequestHeaders(ref h)) => {
                let (facts, _) = request_facts(shared.config.request_facts, &message, h);
                if facts.tenant.is_none() {
                    // Not decided by the filter: never metered.
                    return Ok(());
                }
                let reserved = match facts.leased_tokens {
                    Some(tokens) => (tokens, false),
                    None => reservation(message.metadata_context.as_ref()),
                };
                if let Some(endpoint) = picked_endpoint(message.metadata_context.as_ref()) {
                    _picked = Some(PickedGuard { pools: &shared.pools, pool: facts.pool.clone(), endpoint });
                }
                // The Responses API's usage and stream events have shapes of their own.
                meter.set_api(gateway_meter::Api::for_path(&header(h, ":path").unwrap_or_default()));
                meter.start(now);
                let record_id = facts.record_id().unwrap_or_else(|| shared.ids.next());
                info = Some(RequestInfo::new(facts, reserved, record_id));
                None
            }
            Some(ProcRequest::ResponseHeaders(h)) => {
                if !meter.is_active() {
                    // A local reply (401, 429, ...): never metered.
                    return Ok(());
                }
                let status = header(&h, ":status").and_then(|s| s.parse().ok()).unwrap_or(0);
                let content_type = header(&h, "content-type").unwrap_or_default();
                if let Some(coding) = header(&h, "content-encoding") {
                    meter.mark_encoded(coding.as_bytes());
                }
                meter.on_response_headers(status, &content_type, h.end_of_stream, now)
            }
            Some(ProcRequest::ResponseBody(b)) => meter.on_response_body(&b.body, b.end_of_stream, Some(now)),
            Some(ProcRequest::ResponseTrailers(_)) => meter.on_stream_end(now),
            _ => None,
        };
        if let Some(usage) = usage {
            if let Some(info) = info.take() {
                finish(shared, UsageRecord::new(info, usage, METERED_REACHED_UPSTREAM));
            }
            return Ok(());
        }
    }
    if let (Some(usage), Some(info)) = (meter.on_stream_end(monotonic_us()), info) {
        finish(shared, UsageRecord::new(info, usage, METERED_REACHED_UPSTREAM));
    }
    Ok(())
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

/// Microseconds since the first call: the meter's clock on the sidecar's side.
fn monotonic_us() -> u64 {
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    let start = START.get_or_init(Instant::now);
    u64::try_from(start.elapsed().as_micros()).unwrap_or(u64::MAX)
}

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
    observe(&shared.metrics, &record);
    let mut record = record;
    // The end of the request, not of its (possibly delayed) write, dates the record: Envoy's
    // time when the access log gave it, else now.
    if record.finished_at_unix_ms == 0 {
        record.finished_at_unix_ms = unix_ms();
    }
    let prefix = shared.limiter.store().prefix();
    let tenant = shared.config.tenant(&record.info.tenant);
    let buckets = tenant.map(|t| limits::token_buckets(prefix, t, &record.info.model)).unwrap_or_default();
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

/// Unix milliseconds now (the sidecar's clock).
fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Per-request metrics of a finished request.
fn observe(metrics: &Metrics, r: &UsageRecord) {
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
    let label = ModelLabel { model: model.clone() };
    if r.ttft_us > 0 {
        metrics.ttft.get_or_create(&label).observe(r.ttft_us as f64 / 1e6);
    }
    if r.tpot_us > 0 {
        metrics.itl.get_or_create(&label).observe(r.tpot_us as f64 / 1e6);
    }
    metrics.duration.get_or_create(&label).observe(r.duration_us as f64 / 1e6);
    for (token_type, n) in [("input", r.prompt_tokens), ("output", r.completion_tokens)] {
        let usage = TokenType { model: model.clone(), token_type: token_type.to_owned() };
        metrics.token_usage.get_or_create(&usage).observe(n as f64);
        let tokens =
            TenantTokens { tenant: tenant.clone(), model: model.clone(), token_type: token_type.to_owned() };
        metrics.tokens.get_or_create(&tokens).inc_by(n);
    }
}

async fn send(tx: &Tx, response: ProcessingResponse) -> Result<(), Status> {
    tx.send(Ok(response)).await.map_err(|_| Status::cancelled("envoy closed the stream"))
}

/// A CONTINUE answer to whatever phase the request was, with optional dynamic metadata.
fn continue_response(request: &Option<ProcRequest>, metadata: Option<Struct>) -> ProcessingResponse {
    let headers = HeadersResponse { response: Some(CommonResponse::default()) };
    let response = match request {
        Some(ProcRequest::ResponseHeaders(_)) => ProcResponse::ResponseHeaders(headers),
        Some(ProcRequest::RequestBody(_)) => ProcResponse::RequestBody(Default::default()),
        Some(ProcRequest::ResponseBody(_)) => ProcResponse::ResponseBody(Default::default()),
        Some(ProcRequest::RequestTrailers(_)) => ProcResponse::RequestTrailers(Default::default()),
        Some(ProcRequest::ResponseTrailers(_)) => ProcResponse::ResponseTrailers(Default::default()),
        Some(ProcRequest::RequestHeaders(_)) | None => ProcResponse::RequestHeaders(headers),
    };
    ProcessingResponse { response: Some(response), dynamic_metadata: metadata, ..Default::default() }
}

pub(crate) fn immediate_response(error: &AdmissionError) -> ProcessingResponse {
    let reply = error.to_reply();
    let mut set_headers = vec![header_option("content-type", "application/json")];
    set_headers.extend(reply.headers.iter().map(|(k, v)| header_option(k, v)));
    ProcessingResponse {
        response: Some(ProcResponse::ImmediateResponse(ImmediateResponse {
            status: Some(HttpStatus { code: i32::from(reply.status) }),
            headers: Some(HeaderMutation { set_headers, remove_headers: Vec::new() }),
            body: reply.body,
            grpc_status: None,
            details: ADMISSION_REPLY_DETAILS.to_owned(),
        })),
        ..Default::default()
    }
}

fn header_option(key: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: key.to_owned(),
            value: String::new(),
            raw_value: value.as_bytes().to_vec(),
        }),
        ..Default::default()
    }
}

/// `{"llm_gateway": {"admitted": true, "x-ratelimit-...": "...", "reserved_tokens": N,
/// "reserved_locally": B}}`,
/// and `"prompt_tokens": N` when the admission counted the prompt exactly (the access log's
/// record then prefers it to the filter's estimate).
fn admission_metadata(admitted: &Admitted, exact_prompt_tokens: Option<u64>) -> Struct {
    let mut fields: HashMap<String, Value> = admitted
        .ratelimit_headers
        .iter()
        .map(|(k, v)| (k.clone(), Value { kind: Some(Kind::StringValue(v.clone())) }))
        .collect();
    // The marker Envoy's RBAC guard requires of a request admitted here (envoy/filters/guard.yaml).
    fields.insert(MD_ADMITTED.to_owned(), Value { kind: Some(Kind::BoolValue(true)) });
    fields.insert(
        MD_RESERVED_TOKENS.to_owned(),
        Value { kind: Some(Kind::NumberValue(admitted.reserved_tokens as f64)) },
    );
    fields.insert(
        MD_RESERVED_LOCALLY.to_owned(),
        Value { kind: Some(Kind::BoolValue(admitted.reserved_locally)) },
    );
    if let Some(n) = exact_prompt_tokens {
        fields.insert(MD_PROMPT_TOKENS.to_owned(), Value { kind: Some(Kind::NumberValue(n as f64)) });
    }
    if let Some(warning) = &admitted.quota_warning {
        fields.insert(MD_QUOTA_WARNING.to_owned(), Value { kind: Some(Kind::StringValue(warning.clone())) });
    }
    let inner = Value { kind: Some(Kind::StructValue(Struct { fields })) };
    Struct { fields: HashMap::from([(METADATA_NAMESPACE.to_owned(), inner)]) }
}

/// The reservation admission made, from the forwarded `llm_gateway` metadata: (tokens, whether
/// in this sidecar's memory). None forwarded: (0, false).
pub(crate) fn reservation(metadata: Option<&Metadata>) -> (u64, bool) {
    let fields = metadata.and_then(|m| m.filter_metadata.get(METADATA_NAMESPACE)).map(|s| &s.fields);
    let tokens = fields.and_then(|f| metadata_number(f.get(MD_RESERVED_TOKENS)?)).unwrap_or(0);
    let locally = fields
        .and_then(|f| f.get(MD_RESERVED_LOCALLY))
        .is_some_and(|v| matches!(v.kind, Some(Kind::BoolValue(true))));
    (tokens, locally)
}

/// A whole, non-negative number the admission wrote to the metadata (None: another kind, or not
/// a count: negative, fractional, not finite or above 2^53).
pub(crate) fn metadata_number(value: &Value) -> Option<u64> {
    match value.kind {
        Some(Kind::NumberValue(n)) if (0.0..=9_007_199_254_740_992.0).contains(&n) && n.fract() == 0.0 => {
            Some(n as u64)
        }
        _ => None,
    }
}

/// A header's value; Envoy sends values in `raw_value` (bytes) with `value` empty.
fn header(headers: &HttpHeaders, name: &str) -> Option<String> {
    find_header(headers.headers.as_ref()?, name)
}

fn find_header(map: &HeaderMap, name: &str) -> Option<String> {
    map.headers.iter().find(|h| h.key.eq_ignore_ascii_case(name)).map(|h| {
        if h.raw_value.is_empty() {
            h.value.clone()
        } else {
            String::from_utf8_lossy(&h.raw_value).into_owned()
        }
    })
}

/// A request's facts and, when the filter asks for the exact context check, the base model to
/// count with. From the filter's state (ext_proc `request_attributes`), or with
/// `request_facts: headers` (Envoy Gateway) from the `x-gateway-*` headers. No facts: a
/// request the filter never decided (tenant `None`), which is neither admitted nor metered.
fn request_facts(
    source: FactsSource,
    message: &ProcessingRequest,
    headers: &HttpHeaders,
) -> (RequestFacts, Option<String>) {
    let request_id = header(headers, H_REQUEST_ID).unwrap_or_default();
    match source {
        FactsSource::FilterState => match filter_facts(message) {
            Some(facts) => {
                let context_model = facts.context_model.clone();
                (RequestFacts::from_filter(facts, request_id), context_model)
            }
            None => (RequestFacts { request_id, ..Default::default() }, None),
        },
        FactsSource::Headers => {
            let facts = facts_from_headers(|name| header(headers, name));
            let exact = header(headers, H_CONTEXT_CHECK).as_deref() == Some(CONTEXT_CHECK_EXACT);
            let context_model =
                exact.then(|| header(headers, H_CONTEXT_MODEL).unwrap_or_else(|| facts.model.clone()));
            (facts, context_model)
        }
    }
}

/// The filter's [`gateway_contract::RequestFacts`] from the attributes Envoy's ext_proc filter
/// sends (`request_attributes: ["filter_state['wasm.llm_gateway.request']"]`): the CEL value of
/// a wasm property is its bytes, which Envoy sends as a string value.
fn filter_facts(message: &ProcessingRequest) -> Option<gateway_contract::RequestFacts> {
    let value = message.attributes.get(ATTRIBUTES_FILTER_NAME)?.fields.get(ATTRIBUTE_REQUEST)?;
    match &value.kind {
        Some(Kind::StringValue(json)) => gateway_contract::RequestFacts::from_json(json.as_bytes()),
        _ => None,
    }
}

/// The request's facts from its `x-gateway-*` headers and `x-request-id`, read through
/// `header` (lower-case names). Only for `request_facts: headers`, where the wasm filter runs
/// first and removes client-sent `x-gateway-*` headers (Envoy Gateway, whose ext_proc cannot
/// be sent filter state); leases are never claimed this way.
pub(crate) fn facts_from_headers(header: impl Fn(&str) -> Option<String>) -> RequestFacts {
    let number = |name| header(name).and_then(|v| v.trim().parse().ok()).unwrap_or(0);
    RequestFacts {
        tenant: header(H_TENANT).filter(|t| !t.is_empty()),
        model: header(H_MODEL).unwrap_or_default(),
        pool: header(H_POOL).unwrap_or_default(),
        prompt_tokens: number(H_PROMPT_TOKENS),
        max_tokens: number(H_MAX_TOKENS),
        request_id: header(H_REQUEST_ID).unwrap_or_default(),
        tier: header(H_TIER).unwrap_or_default(),
        leased_tokens: None,
        lease_id: None,
        lease_seq: None,
        prefix_hashes: None,
        nonce: header(H_REQUEST_NONCE),
        prompt_tokens_max: None,
        completion_tokens_max: None,
        body_bytes: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HttpHeaders {
        HttpHeaders {
            headers: Some(HeaderMap {
                headers: pairs
                    .iter()
                    .map(|(k, v)| HeaderValue {
                        key: (*k).into(),
                        value: String::new(),
                        raw_value: v.as_bytes().to_vec(),
                    })
                    .collect(),
            }),
            ..Default::default()
        }
    }

    /// Request headers a forger sends, and a request-headers message with the filter's facts
    /// (when given) in its attributes, as Envoy's ext_proc filter sends them.
    fn message(facts: Option<&str>) -> (ProcessingRequest, HttpHeaders) {
        let h = headers(&[
            ("x-gateway-tenant", "forged"),
            ("x-gateway-prompt-tokens", "12"),
            ("x-gateway-max-tokens", "30"),
            ("x-gateway-context-check", "exact"),
            ("x-request-id", "abc"),
        ]);
        let mut m = ProcessingRequest::default();
        if let Some(facts) = facts {
            let value = Value { kind: Some(Kind::StringValue(facts.to_owned())) };
            let fields = HashMap::from([(ATTRIBUTE_REQUEST.to_owned(), value)]);
            m.attributes.insert(ATTRIBUTES_FILTER_NAME.to_owned(), Struct { fields });
        }
        (m, h)
    }

    #[test]
    fn facts_come_from_the_filter_state_not_the_headers() {
        let facts = r#"{"v":1,"tenant":"acme","tier":"t","model":"m","pool":"p","prompt_tokens":5,"max_tokens":7,"context_model":"base"}"#;
        let (m, h) = message(Some(facts));
        let (f, context_model) = request_facts(FactsSource::FilterState, &m, &h);
        assert_eq!(f.tenant.as_deref(), Some("acme"));
        assert_eq!(f.reserve_tokens(), 12);
        assert_eq!(f.request_id, "abc", "Envoy's request id, from the headers");
        assert_eq!(context_model.as_deref(), Some("base"));
        // No facts: the headers count for nothing.
        let (m, h) = message(None);
        let (f, context_model) = request_facts(FactsSource::FilterState, &m, &h);
        assert_eq!((f.tenant.clone(), f.reserve_tokens(), context_model), (None, 0, None));
    }

    #[test]
    fn envoy_gateway_reads_the_headers_and_never_a_lease() {
        let (m, mut h) = message(None);
        if let Some(map) = h.headers.as_mut() {
            map.headers.push(HeaderValue {
                key: "x-gateway-admission".into(),
                value: String::new(),
                raw_value: b"lease".to_vec(),
            });
        }
        let (f, context_model) = request_facts(FactsSource::Headers, &m, &h);
        assert_eq!(f.tenant.as_deref(), Some("forged"));
        assert_eq!((f.reserve_tokens(), f.leased_tokens), (42, None));
        assert_eq!(context_model.as_deref(), Some(""), "exact check asked, model from the headers");
    }

    #[test]
    fn the_record_id_comes_from_the_facts_request_id_and_nonce() {
        // The filter state's request id (as the filter saw it) wins over the header's.
        let facts = r#"{"v":1,"tenant":"acme","tier":"t","model":"m","pool":"p","prompt_tokens":5,"max_tokens":7,"request_id":"seen","nonce":"0123456789abcdef"}"#;
        let (m, h) = message(Some(facts));
        let (f, _) = request_facts(FactsSource::FilterState, &m, &h);
        assert_eq!(f.request_id, "seen");
        assert_eq!(f.record_id().as_deref(), Some("seen.0123456789abcdef"));
        // Facts of an older filter: the header's request id, and no record id of the request.
        let (m, h) = message(Some(
            r#"{"v":1,"tenant":"acme","tier":"t","model":"m","pool":"p","prompt_tokens":5,"max_tokens":7}"#,
        ));
        let (f, _) = request_facts(FactsSource::FilterState, &m, &h);
        assert_eq!((f.request_id.as_str(), f.record_id()), ("abc", None));
        // From the headers (request_facts: headers): the filter's nonce header.
        let (m, mut h) = message(None);
        if let Some(map) = h.headers.as_mut() {
            map.headers.push(HeaderValue {
                key: H_REQUEST_NONCE.into(),
                value: String::new(),
                raw_value: b"fedcba9876543210".to_vec(),
            });
        }
        let (f, _) = request_facts(FactsSource::Headers, &m, &h);
        assert_eq!(f.record_id().as_deref(), Some("abc.fedcba9876543210"));
    }

    #[test]
    fn metadata_round_trip() {
        let s = admission_metadata(
            &Admitted {
                ratelimit_headers: vec![],
                reserved_tokens: 77,
                reserved_locally: true,
                tracked_at_ms: None,
                quota: (0, 0),
                quota_warning: None,
            },
            None,
        );
        let m = Metadata {
            filter_metadata: s
                .fields
                .into_iter()
                .filter_map(|(k, v)| match v.kind {
                    Some(Kind::StructValue(s)) => Some((k, s)),
                    _ => None,
                })
                .collect(),
            ..Default::default()
        };
        let admitted = m.filter_metadata[METADATA_NAMESPACE].fields.get(MD_ADMITTED);
        assert!(matches!(admitted.and_then(|v| v.kind.as_ref()), Some(Kind::BoolValue(true))));
        assert_eq!(reservation(Some(&m)), (77, true));
        assert_eq!(reservation(None), (0, false));
    }

    fn metadata_of(namespace: &str, key: &str, value: Kind) -> Metadata {
        let fields = HashMap::from([(key.to_owned(), Value { kind: Some(value) })]);
        Metadata {
            filter_metadata: HashMap::from([(namespace.to_owned(), Struct { fields })]),
            ..Default::default()
        }
    }

    #[test]
    fn the_subset_hint_is_read_from_the_metadata_context() {
        use envoy_types::pb::google::protobuf::ListValue;
        let list = |items: &[&str]| {
            Kind::ListValue(ListValue {
                values: items
                    .iter()
                    .map(|s| Value { kind: Some(Kind::StringValue((*s).to_owned())) })
                    .collect(),
            })
        };
        let hint = |kind| {
            subset_hint(Some(&metadata_of(MD_NAMESPACE_SUBSET_HINT, MD_DESTINATION_ENDPOINT_SUBSET, kind)))
        };
        let a: std::net::SocketAddr = "10.0.0.1:8000".parse().unwrap();
        let b: std::net::SocketAddr = "[::1]:9".parse().unwrap();
        assert_eq!(hint(list(&["10.0.0.1:8000", "[::1]:9", "vllm:1"])), Some(vec![a, b]), "names dropped");
        assert_eq!(hint(Kind::StringValue("10.0.0.1:8000, [::1]:9".into())), Some(vec![a, b]));
        assert_eq!(hint(list(&[])), Some(vec![]), "present and empty: nothing eligible");
        assert_eq!(hint(Kind::NumberValue(1.0)), Some(vec![]));
        assert_eq!(subset_hint(None), None);
        let other_key = metadata_of(MD_NAMESPACE_SUBSET_HINT, "other", list(&["10.0.0.1:8000"]));
        assert_eq!(subset_hint(Some(&other_key)), None);
    }

    #[test]
    fn a_pick_goes_in_both_namespaces_and_comes_back_from_the_access_log() {
        let mut s = admission_metadata(
            &Admitted {
                ratelimit_headers: vec![],
                reserved_tokens: 1,
                reserved_locally: false,
                tracked_at_ms: None,
                quota: (0, 0),
                quota_warning: None,
            },
            None,
        );
        let pick = Pick {
            endpoints: vec!["10.0.0.1:1".into(), "10.0.0.2:1".into()],
            prefix_blocks: 0,
            request_blocks: 0,
            affinity: false,
        };
        add_pick(&mut s, &pick);
        let m = Metadata {
            filter_metadata: s
                .fields
                .into_iter()
                .filter_map(|(k, v)| match v.kind {
                    Some(Kind::StructValue(s)) => Some((k, s)),
                    _ => None,
                })
                .collect(),
            ..Default::default()
        };
        let lb = m.filter_metadata[MD_NAMESPACE_LB].fields.get(MD_DESTINATION_ENDPOINT);
        assert!(
            matches!(lb.and_then(|v| v.kind.as_ref()), Some(Kind::StringValue(v)) if v == "10.0.0.1:1,10.0.0.2:1")
        );
        assert_eq!(picked_endpoint(Some(&m)).as_deref(), Some("10.0.0.1:1"));
        assert_eq!(reservation(Some(&m)), (1, false), "the admission's metadata is kept");
        assert_eq!(picked_endpoint(None), None);
    }

    #[test]
    fn immediate_response_sets_status_and_headers() {
        let r = immediate_response(&AdmissionError::LimiterUnavailable);
        let Some(ProcResponse::ImmediateResponse(i)) = r.response else { panic!() };
        assert_eq!(i.status.unwrap().code, 503);
        assert!(i
            .headers
            .unwrap()
            .set_headers
            .iter()
            .any(|h| h.header.as_ref().unwrap().key == "retry-after"));
    }
}
