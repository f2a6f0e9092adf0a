//! The HTTP/1.1 server: accept loop, graceful shutdown, routing and the inference handler.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::header::{HeaderValue, CONTENT_TYPE};
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::time::Instant;

use crate::body::{SimBody, StreamParts, TokenStream};
use crate::config::{EngineKind, Pacing, SimConfig};
use crate::engine::{EngineConfig, EngineHandle, SeqSpec};
use crate::error::ApiError;
use crate::fault::{self, FaultInjector};
use crate::metrics::{Metrics, RequestTracker};
use crate::prompt;
use crate::queue::Queue;
use crate::request::{self, Endpoint, InferenceRequest};
use crate::response::{self, IdGen, ResponseMeta};
use crate::responses::ResponseEvents;
use crate::sse::{Events, SseEvents};
use crate::tokens::{self, Limits, OutputPlan};

/// Largest accepted request body, in bytes.
pub const MAX_BODY_BYTES: usize = 32 * 1024 * 1024;
/// How long shutdown waits for in-flight responses before dropping them.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

const JSON: &str = "application/json";
const EVENT_STREAM: &str = "text/event-stream; charset=utf-8";
const PROMETHEUS_TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Serves the simulator on `listener` until `shutdown` completes.
///
/// Accepted sockets get `TCP_NODELAY` and are served as HTTP/1.1 with keep-alive. When
/// `shutdown` resolves, the listener closes, queued requests fail (503, or a cut stream),
/// idle connections close, and in-flight responses get [`SHUTDOWN_GRACE`] to finish.
/// Fails at once with [`io::ErrorKind::InvalidInput`] when `config` is out of range.
pub async fn serve<F>(config: SimConfig, listener: TcpListener, shutdown: F) -> io::Result<()>
where
    F: Future<Output = ()>,
{
    let state = Arc::new(AppState::new(config)?);
    let engine_task = state.engine.clone().map(|engine| tokio::spawn(engine.run()));
    let graceful = GracefulShutdown::new();
    let builder = http1::Builder::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let (stream, _) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of descriptors or a connection reset before accept: back off briefly.
                    eprintln!("vllm-sim: accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        if let Err(e) = stream.set_nodelay(true) {
            eprintln!("vllm-sim: cannot set TCP_NODELAY: {e}");
        }
        let state = state.clone();
        let service = service_fn(move |req| route(state.clone(), req));
        let connection = graceful.watch(builder.serve_connection(TokioIo::new(stream), service));
        tokio::spawn(async move {
            // Client resets and injected mid-stream failures end connections with an error;
            // both are expected.
            let _ = connection.await;
        });
    }
    drop(listener);
    state.queue.close();
    if let Some(engine) = &state.engine {
        engine.close();
    }
    if tokio::time::timeout(SHUTDOWN_GRACE, graceful.shutdown()).await.is_err() {
        eprintln!("vllm-sim: responses still in flight after {SHUTDOWN_GRACE:?}; dropping them");
    }
    if let Some(task) = engine_task {
        task.abort();
    }
    Ok(())
}

/// Everything the handlers share.
struct AppState {
    served_names: Vec<String>,
    lora_names: Vec<String>,
    response_model: String,
    limits: Limits,
    pacing: Pacing,
    fail_after_chunks: Option<u64>,
    queue: Arc<Queue>,
    /// `--engine batched`: the engine that paces every request (the queue is then unused).
    engine: Option<Arc<EngineHandle>>,
    /// Batched engine with prefix caching: bytes per KV block of rendered prompt, else 0.
    prefix_block_bytes: usize,
    /// `--block-size`, in tokens.
    block_size: u64,
    metrics: Arc<Metrics>,
    faults: FaultInjector,
    ids: IdGen,
    models_body: Bytes,
}

/// A request that passed every check and will be generated.
struct Accepted<'a> {
    request: InferenceRequest<'a>,
    plan: OutputPlan,
}

impl AppState {
    fn new(config: SimConfig) -> io::Result<Self> {
        let invalid = |e| io::Error::new(io::ErrorKind::InvalidInput, e);
        config.validate().map_err(invalid)?;
        let pacing = config.pacing().map_err(invalid)?;
        let response_model = config.response_model_name().to_owned();
        let now = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
        Ok(Self {
            limits: Limits {
                max_model_len: u64::from(config.max_model_len),
                output_tokens: u64::from(config.output_tokens),
            },
            pacing,
            fail_after_chunks: config.fail_after_chunks,
            queue: Queue::new(config.max_num_seqs),
            engine: (config.engine == EngineKind::Batched)
                .then(|| EngineHandle::new(EngineConfig::from_sim(&config))),
            prefix_block_bytes: if config.engine == EngineKind::Batched && config.enable_prefix_caching {
                (config.block_size as usize).saturating_mul(prompt::BYTES_PER_TOKEN)
            } else {
                0
            },
            block_size: u64::from(config.block_size),
            metrics: Arc::new(Metrics::new(&response_model, config.max_num_seqs)),
            faults: FaultInjector::new(config.seed, config.error_rate),
            ids: IdGen::new(fault::mix64(now ^ (u64::from(std::process::id()) << 32))),
            models_body: response::models_body(
                &config.served_model_names,
                config.max_model_len,
                response::unix_now(),
            ),
            served_names: config.served_model_names,
            lora_names: config.lora_modules,
            response_model,
        })
    }

    /// The `model` a response carries: the adapter's name for a LoRA request, else the first
    /// served name (vLLM's `model_name(lora_request)`).
    fn response_model_for(&self, requested: Option<&str>) -> &str {
        self.lora_names.iter().find(|n| Some(n.as_str()) == requested).unwrap_or(&self.response_model)
    }

    /// Parses and checks a request the way vLLM does: body, then `model`, then lengths;
    /// then draws the injected fault.
    fn accept<'a>(&self, endpoint: Endpoint, body: &'a [u8]) -> Result<Accepted<'a>, ApiError> {
        let request = request::parse(endpoint, body)?;
        if let Some(model) = &request.model {
            if !self.served_names.iter().chain(&self.lora_names).any(|n| n == model) {
                return Err(ApiError::model_not_found(model));
            }
        }
        let max_tokens = match (endpoint, request.max_tokens) {
            // vLLM's Responses API refuses only a prompt of max_model_len tokens or more and caps
            // `max_output_tokens` to what the context leaves (`_validate_generator_input`,
            // `ResponsesRequest.to_sampling_params`); a prompt that fills the context goes on
            // without a cap, to be refused as such.
            (Endpoint::Responses, Some(m)) => {
                let left = self.limits.max_model_len.checked_sub(request.prompt_tokens).filter(|l| *l > 0);
                left.map(|left| m.min(left))
            }
            (_, max_tokens) => max_tokens,
        };
        let plan = tokens::plan_output(
            tokens::LengthRequest {
                prompt_tokens: request.prompt_tokens,
                max_tokens,
                ignore_eos: request.ignore_eos,
            },
            self.limits,
        )
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
        let plan = OutputPlan { choices: request.n, ..plan };
        if self.faults.next_fails() {
            return Err(ApiError::internal("Simulated internal server error (vllm-sim --error-rate)."));
        }
        Ok(Accepted { request, plan })
    }
}

async fn route(state: Arc<AppState>, req: Request<Incoming>) -> Result<Response<SimBody>, Infallible> {
    let response = match (req.method(), req.uri().path()) {
        (&Method::POST, "/v1/chat/completions") => inference(&state, Endpoint::Chat, req).await,
        (&Method::POST, "/v1/completions") => inference(&state, Endpoint::Completions, req).await,
        (&Method::POST, "/v1/responses") => inference(&state, Endpoint::Responses, req).await,
        (&Method::GET, "/v1/models") => with_type(StatusCode::OK, JSON, state.models_body.clone()),
        (&Method::GET, "/health") => Response::new(SimBody::Full(None)),
        // vLLM's dev-mode endpoint (`VLLM_SERVER_DEV_MODE=1`, vllm/entrypoints/serve/dev/cache):
        // `{"success": bool}`, false while requests hold blocks. The plain engine has no cache.
        (&Method::POST, "/reset_prefix_cache") => {
            let success = state.engine.as_ref().is_none_or(|engine| engine.reset_prefix_cache());
            with_type(StatusCode::OK, JSON, Bytes::from(format!("{{\"success\":{success}}}")))
        }
        // `/metrics/`: vLLM mounts prometheus_client's app there too, which answers only the
        // samples the query's `name[]` parameters name (all of them without one).
        (&Method::GET, path @ ("/metrics" | "/metrics/")) => {
            let text = match &state.engine {
                Some(engine) => state.metrics.render_engine(engine.snapshot()),
                None => state.metrics.render(state.queue.snapshot()),
            };
            let text = match path {
                "/metrics/" => {
                    crate::metrics::restrict_to_names(&text, req.uri().query().unwrap_or_default())
                }
                _ => text,
            };
            with_type(StatusCode::OK, PROMETHEUS_TEXT, Bytes::from(text))
        }
        (
            _,
            "/v1/chat/completions"
            | "/v1/completions"
            | "/v1/responses"
            | "/v1/models"
            | "/health"
            | "/metrics"
            | "/metrics/"
            | "/reset_prefix_cache",
        ) => detail(StatusCode::METHOD_NOT_ALLOWED, "Method Not Allowed"),
        _ => detail(StatusCode::NOT_FOUND, "Not Found"),
    };
    Ok(response)
}

async fn inference(state: &Arc<AppState>, endpoint: Endpoint, req: Request<Incoming>) -> Response<SimBody> {
    let arrival = Instant::now();
    state.metrics.request_received();
    let body = match Limited::new(req.into_body(), MAX_BODY_BYTES).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(e) => {
            return error_response(&ApiError::bad_request(format!("Could not read the request body: {e}")))
        }
    };
    let Accepted { request, plan } = match state.accept(endpoint, &body) {
        Ok(accepted) => accepted,
        Err(e) => return error_response(&e),
    };
    let meta = ResponseMeta {
        endpoint,
        id: state.ids.next(endpoint),
        created: response::unix_now(),
        model: state.response_model_for(request.model.as_deref()),
        instructions: request.instructions.as_deref(),
        max_output_tokens: request.max_tokens.filter(|_| endpoint == Endpoint::Responses),
    };
    let events = |meta: &ResponseMeta<'_>, plan: &OutputPlan| match endpoint {
        Endpoint::Responses => Events::Responses(ResponseEvents::new(meta, plan)),
        _ => Events::Chunks(SseEvents::new(meta, plan, request.include_usage)),
    };
    let tracker = RequestTracker::new(state.metrics.clone(), arrival, plan.prompt_tokens);
    if let Some(engine) = &state.engine {
        let block_hashes = if state.prefix_block_bytes == 0 {
            Vec::new()
        } else {
            let max_blocks = plan.prompt_tokens / state.block_size.max(1);
            let max_blocks = usize::try_from(max_blocks).unwrap_or(usize::MAX);
            prompt::block_hashes(endpoint, &body, state.prefix_block_bytes, max_blocks)
        };
        let spec = SeqSpec {
            prompt_tokens: plan.prompt_tokens,
            block_hashes,
            output_tokens: plan.completion_tokens,
            choices: plan.choices,
        };
        let Ok(generation) = engine.submit(spec) else {
            return error_response(&ApiError::shutting_down());
        };
        if request.stream {
            let stream = TokenStream::batched(
                generation,
                StreamParts {
                    events: events(&meta, &plan),
                    pacing: state.pacing,
                    tracker,
                    finish_reason: plan.finish_reason,
                    fail_after_chunks: state.fail_after_chunks,
                },
            );
            let mut response = Response::new(SimBody::Stream(Box::new(stream)));
            response.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static(EVENT_STREAM));
            return response;
        }
        return generate_batched(generation, &meta, &plan, request.logprobs, tracker).await;
    }
    if request.stream {
        let stream = TokenStream::new(
            state.queue.admission(),
            StreamParts {
                events: events(&meta, &plan),
                pacing: state.pacing,
                tracker,
                finish_reason: plan.finish_reason,
                fail_after_chunks: state.fail_after_chunks,
            },
        );
        let mut response = Response::new(SimBody::Stream(Box::new(stream)));
        response.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static(EVENT_STREAM));
        response
    } else {
        generate(state, &meta, &plan, request.logprobs, tracker).await
    }
}

/// Runs a non-streamed request: queue, `ttft`, `itl` per further token, then the whole body.
async fn generate(
    state: &AppState,
    meta: &ResponseMeta<'_>,
    plan: &OutputPlan,
    logprobs: Option<u32>,
    mut tracker: RequestTracker,
) -> Response<SimBody> {
    let slot = match state.queue.clone().admit().await {
        Ok(slot) => slot,
        Err(_) => return error_response(&ApiError::shutting_down()),
    };
    let started = Instant::now();
    sleep_until_offset(started, state.pacing.token_offset(0)).await;
    // Every choice generates its tokens side by side: n tokens per step.
    tracker.tokens_sent(plan.choices);
    let rest = plan.completion_tokens.saturating_sub(1);
    if rest > 0 {
        sleep_until_offset(started, state.pacing.token_offset(rest)).await;
        tracker.tokens_sent(rest.saturating_mul(plan.choices));
    }
    tracker.finish(plan.finish_reason);
    drop(slot);
    with_type(StatusCode::OK, JSON, response::completion_body(meta, plan, logprobs))
}

/// Runs a non-streamed request on the batched engine: its tokens as the steps generate them,
/// then the whole body.
async fn generate_batched(
    mut generation: crate::engine::Generation,
    meta: &ResponseMeta<'_>,
    plan: &OutputPlan,
    logprobs: Option<u32>,
    mut tracker: RequestTracker,
) -> Response<SimBody> {
    let mut sent = 0u64;
    while sent < plan.completion_tokens {
        match generation.tokens(sent.saturating_add(1)).await {
            Ok(generated) => {
                let new = generated.min(plan.completion_tokens).saturating_sub(sent);
                // Every choice generates its tokens side by side: n tokens per step.
                tracker.tokens_sent(new.saturating_mul(plan.choices));
                sent = sent.saturating_add(new);
            }
            Err(_) => return error_response(&ApiError::shutting_down()),
        }
    }
    tracker.finish(plan.finish_reason);
    drop(generation);
    with_type(StatusCode::OK, JSON, response::completion_body(meta, plan, logprobs))
}

async fn sleep_until_offset(start: Instant, offset: Duration) {
    if !offset.is_zero() {
        if let Some(deadline) = start.checked_add(offset) {
            tokio::time::sleep_until(deadline).await;
        } else {
            std::future::pending::<()>().await;
        }
    }
}

fn with_type(status: StatusCode, content_type: &'static str, body: Bytes) -> Response<SimBody> {
    let mut response = Response::new(SimBody::full(body));
    *response.status_mut() = status;
    response.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}

fn error_response(error: &ApiError) -> Response<SimBody> {
    with_type(error.status, JSON, error.to_body())
}

/// FastAPI's answer for unknown routes and methods: `{"detail": "..."}`.
fn detail(status: StatusCode, text: &'static str) -> Response<SimBody> {
    let body = Bytes::from(format!("{{\"detail\":\"{text}\"}}"));
    with_type(status, JSON, body)
}
