//! The proxy-wasm adapter (wasm32 only): moves headers, bodies and local replies between Envoy
//! and the pure functions of [`crate::pipeline`] and [`crate::sse`]. No decisions live here.
//!
//! Host calls go through `proxy_wasm::hostcalls` (byte variants) rather than the SDK trait
//! helpers, which `unwrap()` on host errors and on non-UTF-8 header values; a panic would kill
//! the VM of the whole Envoy worker. Host errors are logged and turned into a 500 local reply or
//! ignored where nothing better can be done.
//!
//! Envoy requirements: the wasm plugin must set `allow_on_headers_stop_iteration: true` (the
//! filter returns `Pause` from `on_http_request_headers` to buffer the body), and Envoy's buffer
//! limit (`per_connection_buffer_limit_bytes`) must be at least `max_body_bytes`.
//!
//! Metering: the response of every routed request is fed to a [`gateway_meter::Meter`]; its
//! [`gateway_meter::Usage`] (JSON) is set once, as the property `llm_gateway.usage` (Envoy filter
//! state `wasm.llm_gateway.usage`), when the response ends or, at the latest, when Envoy logs the
//! stream (client abort, reset). Envoy's gRPC access log carries it to the sidecar.
//!
//! Admission leases (`admission_leases` in the plugin config, [`crate::lease`]): the root context
//! of each worker's VM holds the lease table, and on every tick sends the calls it asks for to the
//! sidecar (`dispatch_grpc_call`, `llm_gateway.v1.AdmissionLeases/Acquire`); HTTP contexts admit
//! from it and add the lease's `x-ratelimit-*` headers to the response.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;
use std::time::Duration;

use prost::Message;

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType};

use crate::config::Config;
use crate::error::{GatewayError, LocalReply};
use crate::lease::{LeaseCall, Leases};
use crate::pipeline::{
    header, meter_response_headers, on_request_body_owned, on_request_headers, request_nonce,
    response_needs_stripping, HeadersDecision, PendingRequest,
};
use crate::proto::LeaseGrant;
use crate::sse::{meter_chunk, ChunkOutput, UsageStripper};
use crate::uploads::UploadSlots;
use gateway_meter::{Meter, Usage};

use gateway_contract::{
    ADMISSION_LEASE, H_REQUEST_NONCE, PROPERTY_ADMISSION, PROPERTY_REQUEST, PROPERTY_USAGE,
};

/// The sidecar's lease service and method (`proto/llm_gateway/v1/lease.proto`).
const LEASE_SERVICE: &str = "llm_gateway.v1.AdmissionLeases";
const LEASE_METHOD: &str = "Acquire";

/// Microseconds since the Unix epoch, from Envoy's clock (0 if unavailable).
fn now_us() -> u64 {
    hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

/// Sets a property (Envoy filter state `wasm.<name>`, which clients cannot write); logs a failure.
fn set_property(name: &str, value: &[u8]) -> bool {
    match hostcalls::set_property(vec![name], Some(value)) {
        Ok(()) => true,
        Err(status) => {
            log(LogLevel::Warn, &format!("gateway-filter: set_property {name} failed: {status:?}"));
            false
        }
    }
}

/// Hands the usage to Envoy's filter state, for the access log.
fn publish_usage(usage: &Usage) {
    match serde_json::to_vec(usage) {
        Ok(json) => {
            set_property(PROPERTY_USAGE, &json);
        }
        Err(e) => log(LogLevel::Warn, &format!("gateway-filter: cannot encode usage: {e}")),
    }
}

/// The module entry point (`_initialize`), in a private module so the exported symbol is not
/// part of the crate's documented API.
mod entry {
    use proxy_wasm::traits::RootContext;
    use proxy_wasm::types::LogLevel;

    proxy_wasm::main! {{
        proxy_wasm::set_log_level(LogLevel::Info);
        proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> {
            Box::new(super::GatewayRoot {
                config: None,
                leases: Default::default(),
                calls: Default::default(),
                uploads: Default::default(),
                debug: Default::default(),
            })
        });
    }}
}

fn log(level: LogLevel, message: &str) {
    let _ = hostcalls::log(level, message);
}

/// Root context: parses the plugin configuration once per (re)configuration, and keeps this VM's
/// admission leases.
struct GatewayRoot {
    config: Option<Rc<Config>>,
    /// This VM's admission leases, shared with its HTTP contexts.
    leases: Rc<RefCell<Leases>>,
    /// Lease calls in flight: gRPC call token -> the call.
    calls: HashMap<u32, LeaseCall>,
    /// Request bodies in progress per tenant in this VM, shared with its HTTP contexts.
    uploads: Rc<RefCell<UploadSlots>>,
    /// Whether Envoy logs this module at debug level, shared with its HTTP contexts.
    debug: Rc<DebugLevel>,
}

/// Whether Envoy logs this module at debug (or trace) level, read from Envoy again once every
/// [`LOG_LEVEL_EVERY`] requests of the VM: the read is a host call, and the answer only decides
/// whether a request's time in the VM is logged (a level changed at run time takes effect within
/// that many requests of each worker).
#[derive(Default)]
struct DebugLevel {
    /// Requests since the last read.
    requests: Cell<u32>,
    /// The last read's answer.
    debug: Cell<bool>,
}

/// Requests of a VM between two reads of the log level ([`DebugLevel`]).
const LOG_LEVEL_EVERY: u32 = 256;

impl DebugLevel {
    /// Whether this request is timed; reads the level on the VM's first request and every
    /// [`LOG_LEVEL_EVERY`]th after it.
    fn timed(&self) -> bool {
        let n = self.requests.get();
        if n == 0 {
            self.debug.set(matches!(hostcalls::get_log_level(), Ok(LogLevel::Trace | LogLevel::Debug)));
        }
        self.requests.set(if n + 1 >= LOG_LEVEL_EVERY { 0 } else { n + 1 });
        self.debug.get()
    }
}

/// One of a tenant's upload slots ([`crate::uploads`]), given back when dropped: when the body
/// is complete, or with the HTTP context when the stream ends first.
struct UploadSlot {
    slots: Rc<RefCell<UploadSlots>>,
    tenant: usize,
}

impl Drop for UploadSlot {
    fn drop(&mut self) {
        if let Ok(mut slots) = self.slots.try_borrow_mut() {
            slots.release(self.tenant);
        }
    }
}

impl Context for GatewayRoot {
    fn on_grpc_call_response(&mut self, token_id: u32, status_code: u32, response_size: usize) {
        let Some(key) = self.calls.remove(&token_id) else { return };
        let now = now_us();
        let Ok(mut leases) = self.leases.try_borrow_mut() else { return };
        if status_code != 0 {
            log(LogLevel::Debug, &format!("gateway-filter: lease call failed: grpc status {status_code}"));
            leases.on_failure(&key, now);
            return;
        }
        let grant = hostcalls::get_buffer(BufferType::GrpcReceiveBuffer, 0, response_size)
            .ok()
            .flatten()
            .and_then(|bytes| LeaseGrant::decode(bytes.as_slice()).ok());
        match grant {
            Some(grant) => leases.on_grant(&key, &grant, now),
            None => {
                log(LogLevel::Warn, "gateway-filter: unreadable lease grant");
                leases.on_failure(&key, now);
            }
        }
    }
}

impl GatewayRoot {
    /// Sends the lease calls the table asks for (renewals, give-backs, new leases, reports).
    fn lease_calls(&mut self) {
        let Some(settings) = self.config.as_ref().and_then(|c| c.admission_leases.clone()) else { return };
        let now = now_us();
        let Ok(mut leases) = self.leases.try_borrow_mut() else { return };
        // Renew a lease in use that would expire before the tick after next.
        let horizon_us = settings.refresh_ms.saturating_mul(2_000);
        for (key, request) in leases.due(now, horizon_us) {
            let message = request.encode_to_vec();
            match hostcalls::dispatch_grpc_call(
                &settings.cluster,
                LEASE_SERVICE,
                LEASE_METHOD,
                Vec::new(),
                Some(&message),
                Duration::from_millis(settings.timeout_ms),
            ) {
                Ok(token) => {
                    self.calls.insert(token, key);
                }
                Err(status) => {
                    log(LogLevel::Warn, &format!("gateway-filter: lease call not sent: {status:?}"));
                    leases.on_failure(&key, now);
                }
            }
        }
    }
}

impl RootContext for GatewayRoot {
    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        let raw = match hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX) {
            Ok(bytes) => bytes.unwrap_or_default(),
            Err(status) => {
                log(
                    LogLevel::Error,
                    &format!("gateway-filter: cannot read plugin configuration: {status:?}"),
                );
                return false;
            }
        };
        match Config::from_json(&raw) {
            Ok(cfg) => {
                log(
                    LogLevel::Info,
                    &format!(
                        "gateway-filter: configured {} tenants, {} models",
                        cfg.tenants.len(),
                        cfg.models.len()
                    ),
                );
                let tick = cfg
                    .admission_leases
                    .as_ref()
                    .map_or(Duration::ZERO, |l| Duration::from_millis(l.refresh_ms));
                if let Err(status) = hostcalls::set_tick_period(tick) {
                    log(LogLevel::Warn, &format!("gateway-filter: set_tick_period failed: {status:?}"));
                }
                self.config = Some(Rc::new(cfg));
                true
            }
            Err(e) => {
                log(LogLevel::Error, &format!("gateway-filter: invalid plugin configuration: {e}"));
                false
            }
        }
    }

    fn on_tick(&mut self) {
        self.lease_calls();
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        // Must never return None (the SDK panics). Without a configuration the context fails
        // closed with a 500 on every request.
        Some(Box::new(GatewayHttp {
            config: self.config.clone(),
            pending: None,
            usage_injected: false,
            stripper: None,
            started_us: 0,
            meter: Meter::new(gateway_meter::MAX_USAGE_BYTES),
            headers_vm_us: None,
            leases: Rc::clone(&self.leases),
            lease_response_headers: None,
            uploads: Rc::clone(&self.uploads),
            upload: None,
            debug: Rc::clone(&self.debug),
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

/// Per-request context.
struct GatewayHttp {
    config: Option<Rc<Config>>,
    /// Set between the request headers and the end of the request body.
    pending: Option<PendingRequest>,
    /// Whether `stream_options.include_usage` was injected into this request.
    usage_injected: bool,
    /// Set when the response is an SSE stream that must be stripped.
    stripper: Option<UsageStripper>,
    /// When the request headers arrived (microseconds since the Unix epoch).
    started_us: u64,
    /// Meters the response once the request is routed upstream.
    meter: Meter,
    /// At debug level: microseconds the request-headers phase spent in the VM.
    headers_vm_us: Option<u128>,
    /// The VM's admission leases.
    leases: Rc<RefCell<Leases>>,
    /// `x-ratelimit-*` headers for the response of a request admitted from a lease.
    lease_response_headers: Option<Vec<(&'static str, String)>>,
    /// The VM's upload slots.
    uploads: Rc<RefCell<UploadSlots>>,
    /// This request's upload slot, held while its body is being received.
    upload: Option<UploadSlot>,
    /// The VM's log level.
    debug: Rc<DebugLevel>,
}

impl GatewayHttp {
    fn finish_metering(&mut self, usage: Option<Usage>) {
        if let Some(usage) = usage {
            publish_usage(&usage);
        }
    }
}

impl Context for GatewayHttp {}

fn request_headers() -> Result<Vec<(String, Vec<u8>)>, GatewayError> {
    hostcalls::get_map_bytes(MapType::HttpRequestHeaders)
        .map_err(|_| GatewayError::Internal { what: "cannot read request headers" })
}

fn send_reply(reply: &LocalReply) -> Action {
    let headers: Vec<(&str, &str)> = reply.headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
    if let Err(status) = hostcalls::send_http_response(reply.status, headers, Some(&reply.body)) {
        log(LogLevel::Error, &format!("gateway-filter: send_http_response failed: {status:?}"));
    }
    Action::Pause
}

fn send_error(e: &GatewayError) -> Action {
    let (status, _, code, _) = e.parts();
    log(LogLevel::Debug, &format!("gateway-filter: local reply {status} {code}"));
    send_reply(&e.to_reply())
}

impl GatewayHttp {
    /// Runs the body phase on the complete body (given away: a rewrite edits it in place) and
    /// applies the plan.
    fn finish_request(
        &mut self,
        cfg: &Config,
        pending: &PendingRequest,
        body: Vec<u8>,
        body_in_buffer: bool,
    ) -> Action {
        let body_len = body.len();
        let plan = match on_request_body_owned(cfg, pending, body) {
            Ok(plan) => plan,
            Err(e) => return send_error(&e),
        };
        if let Some(new_body) = &plan.new_body {
            if body_in_buffer {
                if let Err(status) = hostcalls::set_buffer(BufferType::HttpRequestBody, 0, body_len, new_body)
                {
                    log(LogLevel::Error, &format!("gateway-filter: set request body failed: {status:?}"));
                    return send_error(&GatewayError::Internal { what: "cannot rewrite request body" });
                }
            }
        }
        let mut facts = plan.facts;
        // Names the request's usage record with its request id (gateway_contract::record_id).
        let nonce = request_nonce(self.started_us);
        facts.nonce = Some(nonce.clone());
        if let (Some(lease_facts), true) = (&plan.admission, cfg.admission_leases.is_some()) {
            let admitted =
                self.leases.try_borrow_mut().ok().and_then(|mut l| l.try_admit(lease_facts, now_us()));
            if let Some(admission) = admitted {
                facts.leased_tokens = Some(admission.reserved_tokens);
                facts.lease_seq = (!admission.lease_id.is_empty()).then_some(admission.lease_seq);
                facts.lease_id = (!admission.lease_id.is_empty()).then_some(admission.lease_id);
                self.lease_response_headers = Some(admission.response_headers);
            }
        }
        // The decision goes to the sidecar as filter state, which no client can write: without it
        // the request is neither admitted nor metered, so a failure here fails the request.
        let published = facts.to_json().is_ok_and(|json| set_property(PROPERTY_REQUEST, &json));
        if !published {
            return send_error(&GatewayError::Internal { what: "cannot record the request's facts" });
        }
        if facts.leased_tokens.is_some() {
            // Envoy's matcher skips the ext_proc admission on this filter state. Should it fail,
            // the admission still sees `leased_tokens` in the facts and does not charge again.
            set_property(PROPERTY_ADMISSION, ADMISSION_LEASE.as_bytes());
        }
        let nonce_header = plan.nonce_header.then_some((H_REQUEST_NONCE, nonce.as_str()));
        for (name, value) in plan.set_headers.iter().map(|(n, v)| (*n, v.as_str())).chain(nonce_header) {
            if let Err(status) =
                hostcalls::set_map_value_bytes(MapType::HttpRequestHeaders, name, Some(value.as_bytes()))
            {
                log(LogLevel::Error, &format!("gateway-filter: set header {name} failed: {status:?}"));
                return send_error(&GatewayError::Internal { what: "cannot set request headers" });
            }
        }
        self.usage_injected = plan.usage_injected;
        self.meter.set_stream(plan.stream);
        self.meter.set_api(plan.api);
        self.meter.start(self.started_us);
        // Envoy picked a route before these headers existed; make it re-pick with x-gateway-pool.
        if let Err(status) = hostcalls::call_foreign_function("clear_route_cache", None) {
            log(LogLevel::Warn, &format!("gateway-filter: clear_route_cache failed: {status:?}"));
        }
        Action::Continue
    }

    fn take_body_and_finish(&mut self, body_size: usize) -> Action {
        self.upload = None;
        let (Some(cfg), Some(pending)) = (self.config.clone(), self.pending.take()) else {
            return Action::Continue;
        };
        // At debug level, the time this request spends in the VM is logged: the body phase
        // (reading it, deciding, writing headers and body) and the headers phase (auth):
        // `gateway-filter: body of N bytes decided in U us (headers H us)`.
        // Timed when the headers phase was (debug level): one log-level host call per request.
        let timed = self.headers_vm_us.is_some();
        let start = if timed { hostcalls::get_current_time().ok() } else { None };
        let body = match hostcalls::get_buffer(BufferType::HttpRequestBody, 0, body_size) {
            Ok(b) => b.unwrap_or_default(),
            Err(_) => return send_error(&GatewayError::Internal { what: "cannot read request body" }),
        };
        let body_len = body.len();
        let action = self.finish_request(&cfg, &pending, body, true);
        if let Some(start) = start {
            let us = hostcalls::get_current_time()
                .ok()
                .and_then(|end| end.duration_since(start).ok())
                .map_or(0, |d| d.as_micros());
            let headers_us = self.headers_vm_us.unwrap_or(0);
            log(
                LogLevel::Debug,
                &format!(
                    "gateway-filter: body of {body_len} bytes decided in {us} us (headers {headers_us} us)"
                ),
            );
        }
        action
    }

    /// The request-headers phase: strip `x-gateway-*`, authenticate, then wait for the body.
    fn request_headers_phase(&mut self, end_of_stream: bool) -> Action {
        let Some(cfg) = self.config.clone() else {
            return send_error(&GatewayError::Internal { what: "filter not configured" });
        };
        let headers = match request_headers() {
            Ok(h) => h,
            Err(e) => return send_error(&e),
        };
        let outcome = on_request_headers(&cfg, &headers);
        for name in &outcome.remove {
            if hostcalls::remove_map_value(MapType::HttpRequestHeaders, name).is_err() {
                return send_error(&GatewayError::Internal { what: "cannot remove request headers" });
            }
        }
        match outcome.decision {
            HeadersDecision::Reply(reply) => send_reply(&reply),
            HeadersDecision::AwaitBody(pending) if end_of_stream => {
                // No body at all: validate the empty body now (it fails as invalid JSON).
                self.finish_request(&cfg, &pending, Vec::new(), false)
            }
            HeadersDecision::AwaitBody(pending) => {
                // A tenant the sidecar said is over its requests-per-minute limit costs no body.
                let tenant = cfg.tenants.get(pending.tenant).map_or("", |t| t.id.as_str());
                let over = self
                    .leases
                    .try_borrow_mut()
                    .ok()
                    .and_then(|mut l| l.tenant_over_rpm(tenant, self.started_us));
                if let Some(retry_after_secs) = over {
                    return send_error(&GatewayError::TenantOverRequestLimit { retry_after_secs });
                }
                let limit = cfg.max_uploads_per_tenant;
                // A borrow that fails (never expected: one request at a time per VM) admits.
                let acquired =
                    self.uploads.try_borrow_mut().map_or(true, |mut s| s.try_acquire(pending.tenant, limit));
                if !acquired {
                    return send_error(&GatewayError::TooManyUploads { limit });
                }
                self.upload = Some(UploadSlot { slots: Rc::clone(&self.uploads), tenant: pending.tenant });
                self.pending = Some(pending);
                Action::Pause
            }
        }
    }
}

/// Test-only build (feature `test-panic`): panics when the request carries
/// [`gateway_contract::H_TEST_PANIC`], which kills this worker's VM (what Envoy's wasm
/// `failure_policy` then does is tests/test_fail_closed.py's subject).
#[cfg(feature = "test-panic")]
#[allow(clippy::panic)]
fn panic_on_marker() {
    if let Ok(Some(_)) =
        hostcalls::get_map_value_bytes(MapType::HttpRequestHeaders, gateway_contract::H_TEST_PANIC)
    {
        panic!("{} (test-only build)", gateway_contract::H_TEST_PANIC);
    }
}

/// Measurement-only build (feature `host-call-probe`): [`PROBE_CALLS`] extra host calls per
/// request, of the kind `GATEWAY_FILTER_PROBE` named at build time (`time`, `get-header`,
/// `get-headers`: the whole request header map, `set-header`, `log-level`), so that the module's Envoy CPU
/// per request over the release module's, divided by [`PROBE_CALLS`], is what one call costs.
#[cfg(feature = "host-call-probe")]
fn probe_host_calls() {
    for _ in 0..std::hint::black_box(PROBE_CALLS) {
        match option_env!("GATEWAY_FILTER_PROBE") {
            Some("time") => {
                let _ = hostcalls::get_current_time();
            }
            Some("get-header") => {
                let _ = hostcalls::get_map_value_bytes(MapType::HttpRequestHeaders, ":path");
            }
            Some("set-header") => {
                let _ = hostcalls::set_map_value_bytes(MapType::HttpRequestHeaders, "x-probe", Some(b"1"));
            }
            Some("log-level") => {
                let _ = hostcalls::get_log_level();
            }
            Some("get-headers") => {
                let _ = hostcalls::get_map_bytes(MapType::HttpRequestHeaders);
            }
            _ => {}
        }
    }
}

/// Extra host calls per request of the `host-call-probe` build.
#[cfg(feature = "host-call-probe")]
const PROBE_CALLS: u32 = 20;

impl HttpContext for GatewayHttp {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        #[cfg(feature = "test-panic")]
        panic_on_marker();
        #[cfg(feature = "host-call-probe")]
        probe_host_calls();
        self.started_us = now_us();
        if !self.debug.timed() {
            return self.request_headers_phase(end_of_stream);
        }
        let start = hostcalls::get_current_time().ok();
        let action = self.request_headers_phase(end_of_stream);
        self.headers_vm_us = start
            .and_then(|s| hostcalls::get_current_time().ok()?.duration_since(s).ok())
            .map(|d| d.as_micros());
        action
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let Some(cfg) = self.config.clone() else {
            return Action::Continue;
        };
        if self.pending.is_none() {
            return Action::Continue;
        }
        if let Err(e) = crate::pipeline::check_body_size(&cfg, body_size as u64) {
            self.pending = None;
            self.upload = None;
            return send_error(&e);
        }
        if !end_of_stream {
            return Action::Pause;
        }
        self.take_body_and_finish(body_size)
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        // A request with trailers never sees end_of_stream on its body: finish here with
        // whatever was buffered.
        if self.pending.is_none() {
            return Action::Continue;
        }
        let limit = self.config.as_ref().map_or(0, |c| c.max_body_bytes);
        let read = usize::try_from(limit.saturating_add(1)).unwrap_or(usize::MAX);
        self.take_body_and_finish(read)
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        for (name, value) in self.lease_response_headers.take().unwrap_or_default() {
            let _ =
                hostcalls::set_map_value_bytes(MapType::HttpResponseHeaders, name, Some(value.as_bytes()));
        }
        if !self.usage_injected && !self.meter.is_active() {
            return Action::Continue;
        }
        // The whole map in one host call, not `:status` and `content-type` in two: a call that
        // returns bytes costs Envoy a call back into the VM to allocate them (filter/README.md).
        let headers = hostcalls::get_map_bytes(MapType::HttpResponseHeaders).unwrap_or_default();
        let status = header(&headers, ":status");
        let content_type = header(&headers, "content-type");
        let content_encoding = header(&headers, "content-encoding");
        if self.meter.is_active() {
            // A clock read is a host call: only for a response that ends with its headers.
            let now = if end_of_stream { now_us() } else { 0 };
            let usage = meter_response_headers(
                &mut self.meter,
                status,
                content_type,
                content_encoding,
                end_of_stream,
                now,
            );
            self.finish_metering(usage);
        }
        if self.usage_injected && response_needs_stripping(status, content_type, content_encoding) {
            // The body shrinks, so its length is no longer known.
            let _ = hostcalls::remove_map_value(MapType::HttpResponseHeaders, "content-length");
            self.stripper = Some(UsageStripper::default());
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if self.stripper.is_none() && !self.meter.is_active() {
            return Action::Continue;
        }
        if self.stripper.is_none() && !self.meter.needs_body() {
            // A JSON body whose usage is read: its later bytes are not copied into the VM.
            if end_of_stream {
                let usage = self.meter.on_response_body(&[], true, Some(now_us()));
                self.finish_metering(usage);
            }
            return Action::Continue;
        }
        // An empty chunk (often the end of the stream) is not asked for: one host call less.
        let read = if body_size == 0 {
            Ok(None)
        } else {
            hostcalls::get_buffer(BufferType::HttpResponseBody, 0, body_size)
        };
        let chunk = match read {
            Ok(b) => b.unwrap_or_default(),
            Err(_) => {
                // Cannot read: stop stripping and let the stream through untouched; the meter
                // ends at the log with what it saw.
                self.stripper = None;
                return Action::Continue;
            }
        };
        // A clock read is a host call: only for TTFT (until the first content) and the end.
        let now = (self.meter.is_active() && (end_of_stream || self.meter.needs_clock())).then(now_us);
        let (output, usage) =
            meter_chunk(&mut self.meter, self.stripper.as_mut(), &chunk, end_of_stream, now);
        self.finish_metering(usage);
        if let ChunkOutput::Replace(out) = output {
            if let Err(status) = hostcalls::set_buffer(BufferType::HttpResponseBody, 0, body_size, &out) {
                log(LogLevel::Warn, &format!("gateway-filter: set response body failed: {status:?}"));
            }
        }
        Action::Continue
    }

    fn on_log(&mut self) {
        // The stream ended before its response did (client abort, upstream reset, timeout). A
        // response already metered needs no clock read (a host call).
        if !self.meter.is_active() {
            return;
        }
        let usage = self.meter.on_stream_end(now_us());
        self.finish_metering(usage);
    }
}
