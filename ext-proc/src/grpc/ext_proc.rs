//! The tonic adapter of Envoy's `envoy.service.ext_proc.v3.ExternalProcessor` service: reads
//! `ProcessingRequest`s, hands the admission's to its stages ([`crate::admission::pipeline`]) and
//! the metering stream's to the meter ([`crate::metering::finish`]), and writes the
//! `ProcessingResponse`s ([`crate::grpc::protocol`]). Nothing here decides anything itself.
//!
//! One service serves both ext_proc filters of the Envoy chain; the gRPC initial metadata
//! `x-gateway-ext-proc-role` (`admission` or `metering`, set in the filter's `grpc_service`)
//! tells them apart, falling back to `observability_mode` (metering) when absent.
//! - admission (blocking, request headers only): a 429 ImmediateResponse, or a CONTINUE whose
//!   dynamic metadata (namespace `llm_gateway`) carries the `x-ratelimit-*` values, which Envoy's
//!   route adds to the response, and the tokens reserved.
//! - metering (observability mode, request headers + response headers + streamed response body):
//!   feeds the [`Meter`], then ends the RPC once the record is queued.

use std::sync::Arc;
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::config::core::v3::header_value_option::HeaderAppendAction;
use envoy_types::pb::envoy::config::core::v3::HeaderValueOption;
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::ProcessingMode;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessor;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as ProcRequest;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as ProcResponse;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    CommonResponse, HeaderMutation, ProcessingRequest, ProcessingResponse,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};
use tracing::debug;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::admission::pipeline::{self, Exchange, Gone, Verdict};
use crate::facts::{picked_endpoint, reservation, subset_hint};
use crate::flow_control;
use crate::grpc::health::Readiness;
use crate::grpc::protocol::{
    self, admission_metadata, continue_response, header, header_option, immediate_response, request_facts,
    ROLE_METADATA_KEY,
};
use crate::metering::finish::finish;
use crate::metering::meter::{Meter, RequestInfo, UsageRecord};
use crate::pools::Pools;
use crate::state::{Live, Shared};
use crate::telemetry;
use gateway_contract::H_DESTINATION_ENDPOINT;

/// The ext_proc service.
pub struct Gateway {
    live: Arc<Live>,
    readiness: Option<Readiness>,
}

impl Gateway {
    /// A service over the live state: each stream takes the generation serving when it opens and
    /// keeps it to its end (a request finishes under the config it was admitted by).
    pub fn new(live: Arc<Live>) -> Self {
        Self { live, readiness: None }
    }

    /// The service that refuses new admission streams once `readiness` drains, with
    /// `drain_refuses_admissions` (the metering streams are served on).
    pub fn with_readiness(self, readiness: Readiness) -> Self {
        Self { readiness: Some(readiness), ..self }
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
        let shared = self.live.current();
        if let Some(readiness) = self.readiness.as_ref().filter(|r| {
            r.draining() && role != Some(Role::Metering) && shared.config.drain_refuses_admissions
        }) {
            return Err(readiness.refuse());
        }
        // Envoy's span, when tracing is on: the admission becomes its child.
        let parent = shared.config.tracing.is_some().then(|| telemetry::parent_context(request.metadata()));
        let inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(4);
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

/// The admission's side of an ext_proc stream ([`Exchange`]): the message the answer goes to
/// (the request headers, or the body once the exact count asked for it).
struct EnvoyStream<'a> {
    inbound: &'a mut Streaming<ProcessingRequest>,
    tx: &'a Tx,
    answering: ProcessingRequest,
}

impl Exchange for EnvoyStream<'_> {
    async fn extend_timeout(&mut self, budget: Duration) -> Result<(), Gone> {
        let timeout = budget + flow_control::MESSAGE_TIMEOUT_MARGIN;
        let extend = ProcessingResponse {
            override_message_timeout: Some(protocol::proto_duration(timeout)),
            ..Default::default()
        };
        send(self.tx, extend).await.map_err(|_| Gone)
    }

    /// A `mode_override` to `BUFFERED` in the answer to the request headers (the admission
    /// filter needs `allow_mode_override: true`), then the body message, which the verdict will
    /// answer (by its kind only: the body itself goes to the count).
    async fn request_body(&mut self) -> Result<Option<Vec<u8>>, Gone> {
        let mut response = continue_response(&None, None);
        response.mode_override =
            Some(ProcessingMode { request_body_mode: BodySendMode::Buffered as i32, ..Default::default() });
        send(self.tx, response).await.map_err(|_| Gone)?;
        let mut message = loop {
            match self.inbound.message().await.map_err(|_| Gone)? {
                None => return Ok(None),
                Some(m) if matches!(m.request, Some(ProcRequest::RequestBody(_))) => break m,
                // Nothing else is sent before the body in this mode; answer it unchanged.
                Some(m) => send(self.tx, continue_response(&m.request, None)).await.map_err(|_| Gone)?,
            }
        };
        let body = match &mut message.request {
            Some(ProcRequest::RequestBody(b)) => std::mem::take(&mut b.body),
            _ => Vec::new(),
        };
        self.answering = message;
        Ok(Some(body))
    }

    async fn ended(&mut self) {
        while let Ok(Some(_)) = self.inbound.message().await {}
    }
}

/// Admission: answers the request headers, then ends the RPC (nothing else is sent to it) --
/// unless the filter asks for the exact context check (`x-gateway-context-check: exact`) of a
/// model with a tokenizer here: then the headers are answered with a `mode_override` for the
/// buffered body, and the body is answered with the decision.
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
    let (facts, context_model) = request_facts(shared.config.request_facts, &first, headers);
    // The endpoint-picker protocol's subset hint, sent with the request headers.
    let subset = subset_hint(first.metadata_context.as_ref());
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
    let mut envoy = EnvoyStream { inbound: &mut inbound, tx, answering: first.clone() };
    let verdict = pipeline::run(shared, facts, context_model, subset.as_deref(), &span, &mut envoy).await;
    let answering = envoy.answering;
    match verdict {
        Verdict::Leased => send(tx, continue_response(&first.request, None)).await,
        Verdict::Refuse(error) => send(tx, immediate_response(&error)).await,
        Verdict::Gone => Ok(()),
        Verdict::Admit(admission) => {
            let counted = admission.exact.as_ref().map(|c| c.prompt_tokens);
            let mut metadata = admission_metadata(&admission.admitted, counted);
            if let Some(waited) = admission.queue_wait {
                protocol::add_queue_wait(&mut metadata, waited);
            }
            let mut set_headers: Vec<HeaderValueOption> =
                admission.exact.as_ref().map(protocol::exact_count_headers).unwrap_or_default();
            if let Some(pick) = &admission.pick {
                protocol::add_pick(&mut metadata, pick);
                // Replaces any value already there (the filter removes client-sent x-gateway-* headers).
                set_headers.push(HeaderValueOption {
                    append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
                    ..header_option(H_DESTINATION_ENDPOINT, &pick.value())
                });
            }
            let mut response = continue_response(&answering.request, Some(metadata));
            let common = CommonResponse {
                header_mutation: Some(HeaderMutation { set_headers, remove_headers: Vec::new() }),
                ..Default::default()
            };
            match &mut response.response {
                Some(ProcResponse::RequestBody(body)) => body.response = Some(common),
                Some(ProcResponse::RequestHeaders(headers)) if admission.pick.is_some() => {
                    headers.response = Some(common)
                }
                _ => {}
            }
            let sent = send(tx, response).await;
            if sent.is_ok() {
                admission.sent();
            }
            // Envoy closed the stream before the answer: the request never goes upstream, and
            // dropping the admission gives back what it took.
            sent
        }
    }
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

/// Counts a picked request's end on its endpoint when dropped (the metering stream ends in many
/// places).
struct PickedGuard<'a> {
    pools: &'a Pools,
    pool: String,
    endpoint: String,
}

impl Drop for PickedGuard<'_> {
    fn drop(&mut self) {
        self.pools.pick_finished(&self.pool, &self.endpoint, None);
    }
}

/// Microseconds since the first call: the meter's clock on the sidecar's side.
fn monotonic_us() -> u64 {
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    let start = START.get_or_init(Instant::now);
    u64::try_from(start.elapsed().as_micros()).unwrap_or(u64::MAX)
}

async fn send(tx: &Tx, response: ProcessingResponse) -> Result<(), Status> {
    tx.send(Ok(response)).await.map_err(|_| Status::cancelled("envoy closed the stream"))
}
