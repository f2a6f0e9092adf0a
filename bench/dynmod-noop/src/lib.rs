//! An Envoy dynamic-module HTTP filter that does nothing (Envoy 1.40's
//! `envoy.extensions.filters.http.dynamic_modules`): every event hook returns at once, with
//! `Continue` where it returns a status. It is the benchmark's `dynmod-noop` target
//! (bench/overhead.py), the floor of a native filter beside `filter-noop`, the floor of a
//! proxy-wasm one: what issue 18's item 3 asks to measure before any bindings are written.
//!
//! The hooks follow the C ABI of `source/extensions/dynamic_modules/abi.h`: Envoy resolves them by
//! name when it loads `libdynmod_noop.so`. A hook here takes no parameters: under the C calling
//! convention the callee may ignore what the caller passes. A `*_new` hook returns a non-null
//! pointer (Envoy treats null as a failure), which nothing dereferences; every status is 0
//! (`Continue`). `envoy_dynamic_module_on_program_init` returns the ABI version string; Envoy
//! 1.40.0 accepts `1.40.0` with a warning that it is deprecated, which does not change the cost
//! measured.

use std::ffi::c_void;

/// The ABI version this module declares (NUL-terminated).
static ABI_VERSION: &[u8] = b"1.40.0\0";

/// What every `*_new` hook returns: a non-null address nothing reads.
static OBJECT: u8 = 0;

fn object() -> *const c_void {
    std::ptr::addr_of!(OBJECT).cast()
}

macro_rules! hooks {
    (new: $($new:ident),*; status: $($status:ident),*; unit: $($unit:ident),* $(,)?) => {
        $(#[no_mangle] pub extern "C" fn $new() -> *const c_void { object() })*
        $(#[no_mangle] pub extern "C" fn $status() -> u32 { 0 })*
        $(#[no_mangle] pub extern "C" fn $unit() {})*
    };
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_program_init() -> *const u8 {
    ABI_VERSION.as_ptr()
}

hooks! {
    new:
        envoy_dynamic_module_on_http_filter_config_new,
        envoy_dynamic_module_on_http_filter_per_route_config_new,
        envoy_dynamic_module_on_http_filter_new;
    status:
        envoy_dynamic_module_on_http_filter_request_headers,
        envoy_dynamic_module_on_http_filter_request_body,
        envoy_dynamic_module_on_http_filter_request_trailers,
        envoy_dynamic_module_on_http_filter_response_headers,
        envoy_dynamic_module_on_http_filter_response_body,
        envoy_dynamic_module_on_http_filter_response_trailers,
        envoy_dynamic_module_on_http_filter_local_reply;
    unit:
        envoy_dynamic_module_on_http_filter_config_destroy,
        envoy_dynamic_module_on_http_filter_per_route_config_destroy,
        envoy_dynamic_module_on_http_filter_destroy,
        envoy_dynamic_module_on_http_filter_stream_complete,
        envoy_dynamic_module_on_http_filter_scheduled,
        envoy_dynamic_module_on_http_filter_config_scheduled,
        envoy_dynamic_module_on_http_filter_http_callout_done,
        envoy_dynamic_module_on_http_filter_config_http_callout_done,
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
