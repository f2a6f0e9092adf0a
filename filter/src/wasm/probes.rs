//! Builds for tests and measurement only, never the release module: `test-panic` and
//! `host-call-probe` (filter/Cargo.toml's features).

#[cfg(any(feature = "test-panic", feature = "host-call-probe"))]
use proxy_wasm::hostcalls;
#[cfg(any(feature = "test-panic", feature = "host-call-probe"))]
use proxy_wasm::types::MapType;

/// Test-only build (feature `test-panic`): panics when the request carries
/// [`gateway_contract::H_TEST_PANIC`], which kills this worker's VM (what Envoy's wasm
/// `failure_policy` then does is tests/test_fail_closed.py's subject).
#[cfg(feature = "test-panic")]
#[allow(clippy::panic)]
pub(super) fn panic_on_marker() {
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
pub(super) fn probe_host_calls() {
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
