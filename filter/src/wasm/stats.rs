//! The filter's own Envoy stats in the wasm module: `llm_gateway_filter_requests_total`, one
//! counter per outcome, reason and tenant (proxy-wasm `define_metric`, defined on first use and
//! kept per VM). Envoy names a wasm metric `wasmcustom.<name>`; the name carries its labels as
//! `.outcome.<o>.reason.<r>.tenant.<t>`, which the standalone bootstrap's `stats_tags`
//! (envoy/bootstrap.yaml) extract, so that Prometheus reads
//! `llm_gateway_filter_requests_total{outcome,reason,tenant}` as from the native module.

use std::cell::RefCell;
use std::collections::HashMap;

use proxy_wasm::hostcalls;
use proxy_wasm::types::MetricType;

/// Most distinct counters a VM defines (the outcomes × reasons × configured tenants stay far
/// below); past it a request is not counted rather than growing Envoy's stats without bound.
const MAX_COUNTERS: usize = 10_000;

thread_local! {
    /// Counter ids by (outcome, reason), then tenant: a request's lookup allocates nothing.
    static COUNTERS: RefCell<Counters> = RefCell::new(Counters::default());
}

#[derive(Default)]
struct Counters {
    ids: HashMap<(&'static str, &'static str), HashMap<String, u32>>,
    defined: usize,
}

/// Counts one request's end under its labels ([`crate::driver::Driver::stats`]).
pub(crate) fn count(outcome: &'static str, reason: &'static str, tenant: &str) {
    let id = COUNTERS.with(|c| {
        let mut counters = c.try_borrow_mut().ok()?;
        if let Some(id) = counters.ids.get(&(outcome, reason)).and_then(|t| t.get(tenant)) {
            return Some(*id);
        }
        if counters.defined >= MAX_COUNTERS {
            return None;
        }
        let name =
            format!("llm_gateway_filter_requests_total.outcome.{outcome}.reason.{reason}.tenant.{tenant}");
        let id = hostcalls::define_metric(MetricType::Counter, &name).ok()?;
        counters.ids.entry((outcome, reason)).or_default().insert(tenant.to_owned(), id);
        counters.defined += 1;
        Some(id)
    });
    if let Some(id) = id {
        let _ = hostcalls::increment_metric(id, 1);
    }
}
