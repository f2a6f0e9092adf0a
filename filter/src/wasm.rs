//! The proxy-wasm binding (wasm32 only) of [`crate::driver`]: its [`Host`] is proxy-wasm's host
//! calls, its [`Worker`] the VM's leases and upload slots. No decisions live here.
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
//! (`wasm/root.rs`)
//! of each worker's VM holds the lease table, and on every tick sends the calls it asks for to the
//! sidecar (`dispatch_grpc_call`, `llm_gateway.v1.AdmissionLeases/Acquire`); HTTP contexts admit
//! from it and add the lease's `x-ratelimit-*` headers to the response.

use std::cell::{Cell, RefCell};
use std::rc::Rc;

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::{Action, BufferType, LogLevel, MapType};

use crate::driver::{Driver, FilterState, HeaderMap, Host, Level, Step, Worker};
use crate::error::LocalReply;
use crate::lease::{AdmissionFacts, LeaseAdmission, Leases};
use crate::pipeline::header;
use crate::uploads::UploadSlots;

mod probes;
mod root;
mod stats;

use gateway_contract::{
    PROPERTY_ADMISSION, PROPERTY_API_KEY, PROPERTY_MODEL, PROPERTY_REFUSAL, PROPERTY_REQUEST,
    PROPERTY_TENANT, PROPERTY_USAGE,
};

/// Microseconds since the Unix epoch, from Envoy's clock (0 if unavailable).
fn now_us() -> u64 {
    hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

/// The module entry point (`_initialize`), in a private module so the exported symbol is not
/// part of the crate's documented API.
mod entry {
    use proxy_wasm::traits::RootContext;
    use proxy_wasm::types::LogLevel;

    proxy_wasm::main! {{
        proxy_wasm::set_log_level(LogLevel::Info);
        proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> {
            Box::new(super::root::GatewayRoot {
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

/// Per-request context: the [`Driver`] and the debug-level timing of its phases.
struct GatewayHttp {
    driver: Driver<VmWorker>,
    /// At debug level: microseconds the request-headers phase spent in the VM.
    headers_vm_us: Option<u128>,
    /// The VM's log level.
    debug: Rc<DebugLevel>,
}

impl Context for GatewayHttp {}

/// What the streams of one worker's VM share ([`Worker`]).
struct VmWorker {
    leases: Rc<RefCell<Leases>>,
    uploads: Rc<RefCell<UploadSlots>>,
}

impl Worker for VmWorker {
    type Upload = UploadSlot;

    fn try_upload(&self, tenant: usize, limit: u32) -> Option<UploadSlot> {
        // A borrow that fails (never expected: one request at a time per VM) admits.
        let acquired = self.uploads.try_borrow_mut().map_or(true, |mut s| s.try_acquire(tenant, limit));
        acquired.then(|| UploadSlot { slots: Rc::clone(&self.uploads), tenant })
    }

    fn try_admit(&self, facts: &AdmissionFacts, now_us: u64) -> Option<LeaseAdmission> {
        self.leases.try_borrow_mut().ok()?.try_admit(facts, now_us)
    }

    fn tenant_over_rpm(&self, tenant: &str, now_us: u64) -> Option<u64> {
        self.leases.try_borrow_mut().ok()?.tenant_over_rpm(tenant, now_us)
    }
}

/// One callback's host calls ([`Host`]) through `proxy_wasm::hostcalls`: `body_size` is the
/// callback's body size (Envoy's buffered request body, or this response chunk).
struct WasmHost {
    body_size: usize,
}

/// `true` on success; a failure is logged with the host's status.
fn ok<T>(result: Result<T, proxy_wasm::types::Status>, what: &str) -> bool {
    match result {
        Ok(_) => true,
        Err(status) => {
            log(LogLevel::Warn, &format!("gateway-filter: {what} failed: {status:?}"));
            false
        }
    }
}

fn map_type(map: HeaderMap) -> MapType {
    match map {
        HeaderMap::Request => MapType::HttpRequestHeaders,
        HeaderMap::Response => MapType::HttpResponseHeaders,
    }
}

impl Host for WasmHost {
    fn now_us(&mut self) -> u64 {
        now_us()
    }

    fn request_headers(&mut self) -> Option<Vec<(String, Vec<u8>)>> {
        hostcalls::get_map_bytes(MapType::HttpRequestHeaders).ok()
    }

    fn set_header(&mut self, map: HeaderMap, name: &str, value: &[u8]) -> bool {
        ok(hostcalls::set_map_value_bytes(map_type(map), name, Some(value)), "set header")
    }

    fn remove_header(&mut self, map: HeaderMap, name: &str) -> bool {
        ok(hostcalls::remove_map_value(map_type(map), name), "remove header")
    }

    fn request_body(&mut self) -> Option<Vec<u8>> {
        let body = hostcalls::get_buffer(BufferType::HttpRequestBody, 0, self.body_size).ok()?;
        Some(body.unwrap_or_default())
    }

    fn replace_request_body(&mut self, len: usize, body: &[u8]) -> bool {
        ok(hostcalls::set_buffer(BufferType::HttpRequestBody, 0, len, body), "set request body")
    }

    fn with_response_headers<R>(
        &mut self,
        f: impl FnOnce(Option<&[u8]>, Option<&[u8]>, Option<&[u8]>) -> R,
    ) -> R {
        // The whole map in one host call, not three: a call that returns bytes costs Envoy a
        // call back into the VM to allocate them (filter/README.md).
        let headers = hostcalls::get_map_bytes(MapType::HttpResponseHeaders).unwrap_or_default();
        f(header(&headers, ":status"), header(&headers, "content-type"), header(&headers, "content-encoding"))
    }

    fn with_response_chunk<R>(&mut self, f: impl FnOnce(&[u8]) -> R) -> Option<R> {
        // An empty chunk (often the end of the stream) is not asked for: one host call less.
        if self.body_size == 0 {
            return Some(f(&[]));
        }
        let chunk = hostcalls::get_buffer(BufferType::HttpResponseBody, 0, self.body_size).ok()?;
        Some(f(&chunk.unwrap_or_default()))
    }

    fn replace_response_chunk(&mut self, len: usize, chunk: &[u8]) -> bool {
        ok(hostcalls::set_buffer(BufferType::HttpResponseBody, 0, len, chunk), "set response body")
    }

    fn set_filter_state(&mut self, key: FilterState, value: &[u8]) -> bool {
        let name = match key {
            FilterState::Request => PROPERTY_REQUEST,
            FilterState::Admission => PROPERTY_ADMISSION,
            FilterState::Usage => PROPERTY_USAGE,
            FilterState::Tenant => PROPERTY_TENANT,
            FilterState::ApiKey => PROPERTY_API_KEY,
            FilterState::Model => PROPERTY_MODEL,
            FilterState::Refusal => PROPERTY_REFUSAL,
        };
        ok(hostcalls::set_property(vec![name], Some(value)), "set_property")
    }

    fn clear_route_cache(&mut self) {
        ok(hostcalls::call_foreign_function("clear_route_cache", None), "clear_route_cache");
    }

    fn send_reply(&mut self, reply: &LocalReply) {
        let headers: Vec<(&str, &str)> = reply.headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
        ok(hostcalls::send_http_response(reply.status, headers, Some(&reply.body)), "send_http_response");
    }

    fn log(&mut self, level: Level, message: &str) {
        let level = match level {
            Level::Debug => LogLevel::Debug,
            Level::Warn => LogLevel::Warn,
            Level::Error => LogLevel::Error,
        };
        log(level, &format!("gateway-filter: {message}"));
    }
}

/// The [`Step`] as proxy-wasm's action: a local reply stops iteration too.
fn action(step: Step) -> Action {
    match step {
        Step::Continue => Action::Continue,
        Step::Pause | Step::Replied => Action::Pause,
    }
}

/// Microseconds since `start` (0 if the clock cannot say).
fn since_us(start: Option<std::time::SystemTime>) -> u128 {
    start
        .and_then(|s| hostcalls::get_current_time().ok()?.duration_since(s).ok())
        .map_or(0, |d| d.as_micros())
}

impl GatewayHttp {
    /// Decides the buffered body (`body_size` bytes read); at debug level, logs the time this
    /// request spent in the VM: `gateway-filter: body of N bytes decided in U us (headers H us)`.
    fn take_body_and_finish(&mut self, body_size: usize, trailers: bool) -> Action {
        let mut host = WasmHost { body_size };
        let start = self.headers_vm_us.and_then(|_| hostcalls::get_current_time().ok());
        let step = if trailers {
            self.driver.on_request_trailers(&mut host)
        } else {
            self.driver.on_request_body(&mut host, body_size as u64, true)
        };
        if let (Some(headers_us), true) = (self.headers_vm_us, start.is_some()) {
            let us = since_us(start);
            log(
                LogLevel::Debug,
                &format!(
                    "gateway-filter: body of {body_size} bytes decided in {us} us (headers {headers_us} us)"
                ),
            );
        }
        action(step)
    }
}

impl HttpContext for GatewayHttp {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        #[cfg(feature = "test-panic")]
        probes::panic_on_marker();
        #[cfg(feature = "host-call-probe")]
        probes::probe_host_calls();
        let mut host = WasmHost { body_size: 0 };
        if !self.debug.timed() {
            return action(self.driver.on_request_headers(&mut host, end_of_stream));
        }
        let start = hostcalls::get_current_time().ok();
        let step = self.driver.on_request_headers(&mut host, end_of_stream);
        self.headers_vm_us = Some(since_us(start));
        action(step)
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if !end_of_stream || !self.driver.is_pending() {
            return action(self.driver.on_request_body(&mut WasmHost { body_size }, body_size as u64, false));
        }
        self.take_body_and_finish(body_size, false)
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        if !self.driver.is_pending() {
            return Action::Continue;
        }
        // Whatever was buffered, up to one byte past the limit.
        let read = usize::try_from(self.driver.max_body_bytes().saturating_add(1)).unwrap_or(usize::MAX);
        self.take_body_and_finish(read, true)
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        self.driver.on_response_headers(&mut WasmHost { body_size: 0 }, end_of_stream);
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        self.driver.on_response_body(&mut WasmHost { body_size }, end_of_stream);
        Action::Continue
    }

    fn on_log(&mut self) {
        // The stream ended before its response did (client abort, upstream reset, timeout).
        self.driver.on_stream_end(&mut WasmHost { body_size: 0 });
        let (outcome, reason, tenant) = self.driver.stats();
        stats::count(outcome, reason, tenant);
    }
}
