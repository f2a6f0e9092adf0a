//! The module's [`Host`] (one hook's calls through Envoy's C ABI) and [`Worker`] (what the
//! streams of one configuration on one worker thread share), for [`gateway_filter::driver`].

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

use gateway_contract::{FS_ADMISSION, FS_API_KEY, FS_MODEL, FS_REFUSAL, FS_REQUEST, FS_TENANT, FS_USAGE};
use gateway_filter::driver::{FilterState, HeaderMap, Host, Level, Worker};
use gateway_filter::error::LocalReply;
use gateway_filter::lease::{AdmissionFacts, LeaseAdmission};
use gateway_filter::uploads::UploadSlots;

use crate::abi::{self, BodyType, Filter, HeaderType};
use crate::leases::LeaseDriver;

thread_local! {
    /// Request bodies in progress per tenant on this worker thread, per configuration (by its
    /// address: tenants are indices into it, and an old and a new configuration live side by
    /// side while Envoy drains a listener), as the wasm module's are per worker VM.
    static UPLOADS: RefCell<HashMap<usize, UploadSlots>> = RefCell::new(HashMap::new());
}

/// Microseconds since the Unix epoch (0 if the clock is before it).
pub(crate) fn now_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

pub(crate) fn log_warn(message: &str) {
    abi::log_warn(&format!("gateway-filter-native: {message}"));
}

/// One of a tenant's upload slots, given back when dropped.
pub(crate) struct UploadSlot {
    /// The configuration's key in [`UPLOADS`].
    config: usize,
    tenant: usize,
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

/// What the streams of one configuration on one worker thread share ([`Worker`]).
pub(crate) struct NativeWorker {
    /// The configuration's key in [`UPLOADS`] (its address).
    pub(crate) config: usize,
    pub(crate) leases: Option<Arc<LeaseDriver>>,
    /// The configuration's `llm_gateway_filter_requests_total` counter (`Config::define_counter`).
    pub(crate) requests_counter: Option<usize>,
}

impl Worker for NativeWorker {
    type Upload = UploadSlot;

    /// A table that cannot be reached (never expected) admits.
    fn try_upload(&self, tenant: usize, limit: u32) -> Option<UploadSlot> {
        let acquired = UPLOADS
            .try_with(|tables| {
                tables
                    .try_borrow_mut()
                    .map_or(true, |mut t| t.entry(self.config).or_default().try_acquire(tenant, limit))
            })
            .unwrap_or(true);
        acquired.then_some(UploadSlot { config: self.config, tenant })
    }

    fn try_admit(&self, facts: &AdmissionFacts, now_us: u64) -> Option<LeaseAdmission> {
        self.leases.as_ref()?.try_admit(facts, now_us)
    }

    fn tenant_over_rpm(&self, tenant: &str, now_us: u64) -> Option<u64> {
        self.leases.as_ref()?.tenant_over_rpm(tenant, now_us)
    }
}

/// One hook's host calls ([`Host`]) through Envoy's C ABI. `body` is the request body the hook
/// read (Envoy's buffered body, or the one chunk received), for its replacement.
pub(crate) struct NativeHost {
    pub(crate) envoy: Filter,
    body: Option<BodyType>,
}

impl NativeHost {
    pub(crate) fn new(envoy: *mut c_void) -> Self {
        Self { envoy: Filter::new(envoy), body: None }
    }
}

fn header_type(map: HeaderMap) -> HeaderType {
    match map {
        HeaderMap::Request => HeaderType::Request,
        HeaderMap::Response => HeaderType::Response,
    }
}

impl Host for NativeHost {
    fn now_us(&mut self) -> u64 {
        now_us()
    }

    fn request_headers(&mut self) -> Option<Vec<(String, Vec<u8>)>> {
        self.envoy.headers(HeaderType::Request)
    }

    fn set_header(&mut self, map: HeaderMap, name: &str, value: &[u8]) -> bool {
        self.envoy.set_header(header_type(map), name, value)
    }

    fn remove_header(&mut self, map: HeaderMap, name: &str) -> bool {
        self.envoy.remove_header(header_type(map), name)
    }

    fn request_body(&mut self) -> Option<Vec<u8>> {
        let buffered = self.envoy.body_size(BodyType::BufferedRequest) > 0;
        let kind = if buffered { BodyType::BufferedRequest } else { BodyType::ReceivedRequest };
        self.body = Some(kind);
        Some(self.envoy.body_chunks(kind).concat())
    }

    fn replace_request_body(&mut self, len: usize, body: &[u8]) -> bool {
        self.body.is_some_and(|kind| self.envoy.replace_body(kind, len, body))
    }

    fn with_response_headers<R>(
        &mut self,
        f: impl FnOnce(Option<&[u8]>, Option<&[u8]>, Option<&[u8]>) -> R,
    ) -> R {
        let get = |name| self.envoy.header(HeaderType::Response, name);
        let (status, content_type, coding) = (get(":status"), get("content-type"), get("content-encoding"));
        f(status.as_deref(), content_type.as_deref(), coding.as_deref())
    }

    fn with_response_chunk<R>(&mut self, f: impl FnOnce(&[u8]) -> R) -> Option<R> {
        // In place when Envoy holds the chunk in one slice (the usual case); copied otherwise.
        Some(match self.envoy.body_chunks(BodyType::ReceivedResponse).as_slice() {
            [] => f(&[]),
            [one] => f(one),
            many => f(&many.concat()),
        })
    }

    fn replace_response_chunk(&mut self, len: usize, chunk: &[u8]) -> bool {
        self.envoy.replace_body(BodyType::ReceivedResponse, len, chunk)
    }

    fn set_filter_state(&mut self, key: FilterState, value: &[u8]) -> bool {
        let key = match key {
            FilterState::Request => FS_REQUEST,
            FilterState::Admission => FS_ADMISSION,
            FilterState::Usage => FS_USAGE,
            FilterState::Tenant => FS_TENANT,
            FilterState::ApiKey => FS_API_KEY,
            FilterState::Model => FS_MODEL,
            FilterState::Refusal => FS_REFUSAL,
        };
        self.envoy.set_filter_state(key, value)
    }

    fn clear_route_cache(&mut self) {
        self.envoy.clear_route_cache();
    }

    fn send_reply(&mut self, reply: &LocalReply) {
        let headers: Vec<(&str, &str)> = reply.headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
        self.envoy.send_response(reply.status, &headers, &reply.body, reply.details);
    }

    fn log(&mut self, level: Level, message: &str) {
        if level != Level::Debug {
            log_warn(message);
        }
    }
}
