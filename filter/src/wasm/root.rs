//! The proxy-wasm root context: the plugin configuration, parsed once per (re)configuration, and
//! this VM's admission leases, whose calls to the sidecar it sends on every tick
//! (`dispatch_grpc_call`, `llm_gateway.v1.AdmissionLeases/Acquire`).

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use prost::Message;
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{BufferType, ContextType, LogLevel};

use crate::config::Config;
use crate::driver::Driver;
use crate::lease::{LeaseCall, Leases};
use crate::proto::LeaseGrant;
use crate::uploads::UploadSlots;
use crate::wasm::{log, now_us, DebugLevel, GatewayHttp, VmWorker};

/// The sidecar's lease service and method (`proto/llm_gateway/v1/lease.proto`).
const LEASE_SERVICE: &str = "llm_gateway.v1.AdmissionLeases";
const LEASE_METHOD: &str = "Acquire";

/// Root context: parses the plugin configuration once per (re)configuration, and keeps this VM's
/// admission leases.
pub(super) struct GatewayRoot {
    pub(super) config: Option<Arc<Config>>,
    /// This VM's admission leases, shared with its HTTP contexts.
    pub(super) leases: Rc<RefCell<Leases>>,
    /// Lease calls in flight: gRPC call token -> the call.
    pub(super) calls: HashMap<u32, LeaseCall>,
    /// Request bodies in progress per tenant in this VM, shared with its HTTP contexts.
    pub(super) uploads: Rc<RefCell<UploadSlots>>,
    /// Whether Envoy logs this module at debug level, shared with its HTTP contexts.
    pub(super) debug: Rc<DebugLevel>,
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
                self.config = Some(Arc::new(cfg));
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
        let worker = VmWorker { leases: Rc::clone(&self.leases), uploads: Rc::clone(&self.uploads) };
        Some(Box::new(GatewayHttp {
            driver: Driver::new(self.config.clone(), worker),
            headers_vm_us: None,
            debug: Rc::clone(&self.debug),
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}
