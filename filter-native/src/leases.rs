//! Admission leases in the native module (the filter's `admission_leases`): the same pure table
//! as the wasm module's (`gateway_filter::lease::Leases`) and the same calls to the sidecar's
//! `llm_gateway.v1.AdmissionLeases/Acquire`, driven by Envoy's config-level scheduler and HTTP
//! callouts instead of a root context's tick and `dispatch_grpc_call`.
//!
//! One table per filter configuration, shared by every worker (behind a mutex), where the wasm
//! module has one per worker VM: a tenant's requests on every worker draw on the same lease, so
//! an Envoy holds fewer leases (the sidecar grants per call, not per caller).
//!
//! Ticks: a thread started with the first stream commits a tick to the configuration's scheduler
//! every `refresh_ms`, and Envoy runs it on its main thread ([`LeaseDriver::tick`]), which sends
//! the calls the table asks for. Not from `config_new`: Envoy's scheduler needs the configuration
//! to exist. The thread stops, and the scheduler is deleted, when the configuration is destroyed.
//!
//! A call is one gRPC request over Envoy's HTTP/2 async client to `admission_leases.cluster`:
//! the five-byte gRPC frame around the `LeaseRequest`, `content-type: application/grpc`. Its
//! answer ([`LeaseDriver::on_done`]) is a grant when `:status` is 200, a `grpc-status` header (a
//! trailers-only answer) if any is 0, and the body is one whole frame of a `LeaseGrant`; anything
//! else is a failure (the table backs off). Envoy's callout answer carries no trailers, so a
//! non-zero `grpc-status` in trailers after a body is not seen; the sidecar's errors are
//! trailers-only (no body), which fail the body check.

use std::collections::HashMap;
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::Duration;

use gateway_filter::config::AdmissionLeases;
use gateway_filter::lease::{AdmissionFacts, LeaseAdmission, LeaseCall, Leases};
use gateway_filter::proto::LeaseGrant;
use prost::Message;

use crate::abi::{CalloutResponse, Config as EnvoyConfig, Scheduler, CALLOUT_SUCCESS};
use crate::host::{log_warn, now_us};

/// The sidecar's lease method (`proto/llm_gateway/v1/lease.proto`), as a gRPC `:path`.
const LEASE_PATH: &str = "/llm_gateway.v1.AdmissionLeases/Acquire";
/// The scheduler event of a tick (the only one).
pub const TICK_EVENT: u64 = 1;

/// One configuration's leases and the calls in flight for them.
pub struct LeaseDriver {
    settings: AdmissionLeases,
    envoy: EnvoyConfig,
    table: Mutex<Leases>,
    calls: Mutex<Calls>,
    ticker: OnceLock<Option<Ticker>>,
}

/// Calls in flight, by callout id (main thread only; a mutex because the driver is shared).
#[derive(Default)]
struct Calls {
    in_flight: HashMap<u64, LeaseCall>,
    /// Answers that arrived before `http_callout` returned their id: Envoy may fail a callout
    /// inline (no healthy host), calling the done hook from inside the call.
    early: HashMap<u64, Option<LeaseGrant>>,
}

/// The thread that commits ticks; stopped and joined when dropped, before its scheduler is
/// deleted (the scheduler is dropped after this struct's `Drop`).
struct Ticker {
    stop: Option<mpsc::Sender<()>>,
    thread: Option<JoinHandle<()>>,
    _scheduler: Arc<Scheduler>,
}

impl Drop for Ticker {
    fn drop(&mut self) {
        // Closing the channel wakes the thread at once.
        self.stop.take();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl LeaseDriver {
    /// A driver for `settings`, calling through the configuration `envoy`.
    pub fn new(settings: AdmissionLeases, envoy: EnvoyConfig) -> Self {
        Self {
            settings,
            envoy,
            table: Mutex::new(Leases::new()),
            calls: Mutex::new(Calls::default()),
            ticker: OnceLock::new(),
        }
    }

    /// Admits a routed request from its lease ([`Leases::try_admit`]); `None`: the ext_proc
    /// admission decides (and the key is wanted at the next tick). Starts the ticks on first use.
    pub fn try_admit(&self, facts: &AdmissionFacts, now: u64) -> Option<LeaseAdmission> {
        self.ticker.get_or_init(|| self.start_ticker());
        self.table.lock().ok()?.try_admit(facts, now)
    }

    /// Whether the sidecar said `tenant` is over its requests-per-minute limit
    /// ([`Leases::tenant_over_rpm`]): the `Retry-After` seconds.
    pub fn tenant_over_rpm(&self, tenant: &str, now: u64) -> Option<u64> {
        self.table.lock().ok()?.tenant_over_rpm(tenant, now)
    }

    fn start_ticker(&self) -> Option<Ticker> {
        let scheduler = Arc::new(self.envoy.scheduler());
        let (stop, stopped) = mpsc::channel::<()>();
        let period = Duration::from_millis(self.settings.refresh_ms.max(1));
        let ticks = Arc::clone(&scheduler);
        let thread = std::thread::Builder::new().name("llm-gw-leases".into()).spawn(move || {
            while let Err(mpsc::RecvTimeoutError::Timeout) = stopped.recv_timeout(period) {
                ticks.commit(TICK_EVENT);
            }
        });
        match thread {
            Ok(thread) => Some(Ticker { stop: Some(stop), thread: Some(thread), _scheduler: scheduler }),
            Err(e) => {
                log_warn(&format!("cannot start the admission lease ticks: {e}"));
                None
            }
        }
    }

    /// A tick, on Envoy's main thread: sends the calls the table asks for (renewals,
    /// give-backs, new leases, reports), as the wasm module's `lease_calls`.
    pub fn tick(&self) {
        let now = now_us();
        // Renew a lease in use that would expire before the tick after next.
        let horizon_us = self.settings.refresh_ms.saturating_mul(2_000);
        let due = match self.table.lock() {
            Ok(mut table) => table.due(now, horizon_us),
            Err(_) => return,
        };
        let cluster = self.settings.cluster.as_str();
        let headers: [(&str, &[u8]); 5] = [
            (":method", b"POST"),
            (":path", LEASE_PATH.as_bytes()),
            (":authority", cluster.as_bytes()),
            ("content-type", b"application/grpc"),
            ("te", b"trailers"),
        ];
        for (key, request) in due {
            let body = grpc_frame(&request.encode_to_vec());
            // No lock held: Envoy may call the done hook from inside this call.
            match self.envoy.http_callout(cluster, &headers, &body, self.settings.timeout_ms) {
                Some(id) => {
                    let early = self.calls.lock().ok().and_then(|mut calls| {
                        let early = calls.early.remove(&id);
                        if early.is_none() {
                            calls.in_flight.insert(id, key.clone());
                        }
                        early
                    });
                    if let Some(outcome) = early {
                        self.apply(&key, outcome);
                    }
                }
                None => {
                    if let Ok(mut table) = self.table.lock() {
                        table.on_failure(&key, now);
                    }
                }
            }
        }
    }

    /// A call's answer, on Envoy's main thread.
    pub fn on_done(&self, callout_id: u64, result: u32, response: &CalloutResponse) {
        let outcome = if result == CALLOUT_SUCCESS { decode_grant(response) } else { None };
        let Ok(mut calls) = self.calls.lock() else { return };
        match calls.in_flight.remove(&callout_id) {
            Some(key) => {
                drop(calls);
                self.apply(&key, outcome);
            }
            None => {
                calls.early.insert(callout_id, outcome);
            }
        }
    }

    fn apply(&self, call: &LeaseCall, outcome: Option<LeaseGrant>) {
        let now = now_us();
        let Ok(mut table) = self.table.lock() else { return };
        match outcome {
            Some(grant) => table.on_grant(call, &grant, now),
            None => table.on_failure(call, now),
        }
    }
}

/// `message` in one gRPC length-prefixed frame (uncompressed).
fn grpc_frame(message: &[u8]) -> Vec<u8> {
    let mut frame = Vec::with_capacity(message.len().saturating_add(5));
    frame.push(0);
    frame.extend_from_slice(&u32::try_from(message.len()).unwrap_or(u32::MAX).to_be_bytes());
    frame.extend_from_slice(message);
    frame
}

/// The grant in a callout's answer (module doc: what counts as one).
fn decode_grant(response: &CalloutResponse) -> Option<LeaseGrant> {
    let header = |name: &str| response.headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_slice());
    if header(":status") != Some(b"200") || header("grpc-status").is_some_and(|s| s != b"0") {
        return None;
    }
    let (prefix, message) = response.body.split_first_chunk::<5>()?;
    let [compressed, len @ ..] = prefix;
    let len = usize::try_from(u32::from_be_bytes(*len)).ok()?;
    if *compressed != 0 || len != message.len() {
        return None;
    }
    match LeaseGrant::decode(message) {
        Ok(grant) => Some(grant),
        Err(e) => {
            log_warn(&format!("unreadable lease grant: {e}"));
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(headers: &[(&str, &[u8])], body: Vec<u8>) -> CalloutResponse {
        CalloutResponse {
            headers: headers.iter().map(|(k, v)| ((*k).to_owned(), v.to_vec())).collect(),
            body,
        }
    }

    #[test]
    fn a_whole_frame_of_a_grant_with_status_200_is_a_grant() {
        let grant = LeaseGrant { requests: 7, ttl_ms: 500, lease_id: "l1".into(), ..Default::default() };
        let body = grpc_frame(&grant.encode_to_vec());
        assert_eq!(decode_grant(&answer(&[(":status", b"200")], body.clone())), Some(grant.clone()));
        assert_eq!(
            decode_grant(&answer(&[(":status", b"200"), ("grpc-status", b"0")], body.clone())),
            Some(grant)
        );
        // Anything else fails.
        assert_eq!(decode_grant(&answer(&[(":status", b"503")], body.clone())), None);
        assert_eq!(decode_grant(&answer(&[(":status", b"200"), ("grpc-status", b"14")], Vec::new())), None);
        assert_eq!(decode_grant(&answer(&[(":status", b"200")], body[..body.len() - 1].to_vec())), None);
        let mut compressed = body;
        compressed[0] = 1;
        assert_eq!(decode_grant(&answer(&[(":status", b"200")], compressed)), None);
        assert_eq!(decode_grant(&answer(&[(":status", b"200")], Vec::new())), None);
        // A whole frame that is no LeaseGrant (a field of the wrong wire type): logged, failed.
        assert_eq!(decode_grant(&answer(&[(":status", b"200")], grpc_frame(&[0x0a, 0x05]))), None);
    }

    /// The one Envoy callback these tests reach (an unreadable grant is logged): Envoy is not
    /// there to provide it.
    #[no_mangle]
    extern "C" fn envoy_dynamic_module_callback_log(_level: u32, _message: crate::abi::ModuleBuffer) {}
}
