//! The filter's request/response sequence, written once for both hosts: the proxy-wasm module
//! ([`crate::wasm`]) and the Envoy dynamic module (`filter-native`) are bindings of [`Driver`].
//!
//! A binding makes one [`Host`] per Envoy callback (its host calls: headers, bodies, filter
//! state, the route cache, the clock, the log) and one [`Worker`] per stream (what a worker's
//! streams share: the admission leases and the upload slots), and maps each [`Step`] to its
//! host's status codes. The decisions themselves stay in [`crate::pipeline`], [`crate::sse`],
//! [`crate::lease`] and [`gateway_meter`].
//!
//! The sequence, per stream:
//! 1. request headers: client-sent `x-gateway-*` headers removed, the API key authenticated
//!    (and its validity window checked at the host's clock, [`Host::now_us`]); a
//!    tenant the sidecar said is over its RPM refused before its body (429); one of the tenant's
//!    upload slots taken; the body awaited ([`Step::Pause`]);
//! 2. request body (or trailers): `max_body_bytes` enforced while it arrives; once complete, the
//!    body decided ([`crate::pipeline::on_request_body_owned`]), rewritten if the plan edits it,
//!    admitted from a lease where one holds room, the request's facts published as filter state
//!    (which clients cannot write; without them the request fails 500), the routing headers set
//!    and the route re-picked;
//! 3. response headers and body: the lease's `x-ratelimit-*` headers added, the response metered
//!    and, where the filter asked for `stream_options.include_usage`, the injected usage chunk
//!    stripped; the usage published as filter state (`usage`) once the response ends;
//! 4. stream end (Envoy's access log or `onStreamComplete`): a response that did not end is
//!    metered with what was seen, so every admitted request is metered exactly once.

use std::sync::Arc;

use gateway_contract::{ADMISSION_LEASE, H_REQUEST_NONCE};
use gateway_meter::{Meter, Usage};

use crate::config::Config;
use crate::error::{GatewayError, LocalReply};
use crate::lease::{AdmissionFacts, LeaseAdmission};
use crate::pipeline::{
    check_body_size, meter_response_headers, on_request_body_owned, on_request_headers, request_nonce,
    response_needs_stripping, HeadersDecision, PendingRequest,
};
use crate::sse::{meter_chunk, ChunkOutput, UsageStripper};

/// Which header map a header call reads or writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeaderMap {
    /// The request's headers (as they leave for the upstream).
    Request,
    /// The response's headers (as they leave for the client).
    Response,
}

/// The filter state the filter publishes (each host names it: the wasm module's property
/// `llm_gateway.*` is Envoy's filter state `wasm.llm_gateway.*`, which the native module sets
/// directly; `gateway_contract` holds both names).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FilterState {
    /// The request's facts (JSON, [`gateway_contract::RequestFacts`]): the sidecar admits and
    /// meters by them.
    Request,
    /// `lease` when the request was admitted from a lease: Envoy's matcher skips the ext_proc
    /// admission on it.
    Admission,
    /// The response's usage (JSON, [`gateway_meter::Usage`]), for the metering access log.
    Usage,
    /// The tenant's id, once the API key is known (the request log).
    Tenant,
    /// The API key's name (never the key), once it is known (the request log).
    ApiKey,
    /// The canonical model name, once the body is decided (the request log).
    Model,
    /// Why the filter refused the request (`LocalReply::details`; the request log).
    Refusal,
}

/// A log line's level.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    /// Envoy's debug level (the native module does not log it).
    Debug,
    /// Envoy's warn level.
    Warn,
    /// Envoy's error level.
    Error,
}

/// What the binding tells Envoy after a callback.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Go on with the stream.
    Continue,
    /// Stop iteration and buffer: the request body is awaited.
    Pause,
    /// A local reply was sent: stop iteration, buffer nothing.
    Replied,
}

/// One Envoy callback's host calls. Every call that can fail says so (`false` / `None`); the
/// host logs its own error detail, and the driver decides what the failure means.
pub trait Host {
    /// Microseconds since the Unix epoch (0 if the clock is unavailable).
    fn now_us(&mut self) -> u64;
    /// The request's headers, as Envoy holds them (`None`: they cannot be read).
    fn request_headers(&mut self) -> Option<Vec<(String, Vec<u8>)>>;
    /// Sets (replaces) one header.
    fn set_header(&mut self, map: HeaderMap, name: &str, value: &[u8]) -> bool;
    /// Removes one header.
    fn remove_header(&mut self, map: HeaderMap, name: &str) -> bool;
    /// The request body Envoy buffered so far, whole (`None`: it cannot be read).
    fn request_body(&mut self) -> Option<Vec<u8>>;
    /// Replaces the first `len` bytes of the buffered request body with `body`.
    fn replace_request_body(&mut self, len: usize, body: &[u8]) -> bool;
    /// Calls `f` with the response's `:status`, `content-type` and `content-encoding`.
    fn with_response_headers<R>(
        &mut self,
        f: impl FnOnce(Option<&[u8]>, Option<&[u8]>, Option<&[u8]>) -> R,
    ) -> R;
    /// Calls `f` with this callback's response chunk (`None`: it cannot be read).
    fn with_response_chunk<R>(&mut self, f: impl FnOnce(&[u8]) -> R) -> Option<R>;
    /// Replaces this callback's response chunk, `len` bytes, with `chunk`.
    fn replace_response_chunk(&mut self, len: usize, chunk: &[u8]) -> bool;
    /// Sets one of the filter's filter-state values.
    fn set_filter_state(&mut self, key: FilterState, value: &[u8]) -> bool;
    /// Makes Envoy pick the route again (after the routing headers were set).
    fn clear_route_cache(&mut self);
    /// Sends a local reply (status, headers, OpenAI-shaped JSON body).
    fn send_reply(&mut self, reply: &LocalReply);
    /// Writes one line to Envoy's log.
    fn log(&mut self, level: Level, message: &str);
}

/// What a worker's streams share: its admission leases ([`crate::lease`]) and its upload slots
/// ([`crate::uploads`]).
pub trait Worker {
    /// One of a tenant's upload slots, given back when dropped.
    type Upload;
    /// Takes one of `tenant`'s (index into the config's tenants) slots if it has fewer than
    /// `limit` bodies in progress.
    fn try_upload(&self, tenant: usize, limit: u32) -> Option<Self::Upload>;
    /// Admits the request from the worker's lease of its tenant and pool, if one holds room.
    fn try_admit(&self, facts: &AdmissionFacts, now_us: u64) -> Option<LeaseAdmission>;
    /// Seconds until `tenant`'s own RPM bucket refills, if the sidecar said it is empty.
    fn tenant_over_rpm(&self, tenant: &str, now_us: u64) -> Option<u64>;
}

/// One stream's state and its sequence (the module doc).
pub struct Driver<W: Worker> {
    /// `None`: the filter has no valid configuration, and every request gets 500.
    config: Option<Arc<Config>>,
    worker: W,
    /// Set between the request headers and the end of the request body.
    pending: Option<PendingRequest>,
    /// Whether `stream_options.include_usage` was injected into this request.
    usage_injected: bool,
    /// Set when the response is an SSE stream that must be stripped.
    stripper: Option<UsageStripper>,
    /// When the request headers arrived (microseconds since the Unix epoch).
    started_us: u64,
    /// Meters the response once the request is routed upstream.
    meter: Meter,
    /// `x-ratelimit-*` headers for the response of a request admitted from a lease.
    lease_response_headers: Option<Vec<(&'static str, String)>>,
    /// This request's upload slot, held while its body is being received.
    upload: Option<W::Upload>,
    /// The request's tenant (index into the config's tenants), once its API key is known.
    tenant: Option<usize>,
    /// How the filter ended the request, for its stats ([`Driver::stats`]).
    outcome: Outcome,
}

/// How the filter ended a request: the `outcome` and `reason` of its own stats
/// (`llm_gateway_filter_requests_total`, [`Outcome::labels`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The stream ended before the filter decided it (the client went away mid-body).
    Undecided,
    /// Refused with a local reply; the reason is [`GatewayError::details`] without its
    /// `llm_gateway_` prefix.
    Refused(&'static str),
    /// Answered locally without an error (`GET /v1/models`).
    Answered,
    /// Admitted from the worker's admission lease: no sidecar call.
    Leased,
    /// Sent on to the sidecar's admission (ext_proc).
    Forwarded,
}

impl Outcome {
    /// `(outcome, reason)`: `refused` with its reason (`invalid_api_key`, `model_not_allowed`,
    /// `invalid_json`, `context_length_exceeded`, ...), `answered` `models`, `leased`,
    /// `forwarded` or `undecided` with reason `none`.
    pub fn labels(self) -> (&'static str, &'static str) {
        match self {
            Outcome::Undecided => ("undecided", "none"),
            Outcome::Refused(reason) => ("refused", reason),
            Outcome::Answered => ("answered", "models"),
            Outcome::Leased => ("leased", "none"),
            Outcome::Forwarded => ("forwarded", "none"),
        }
    }
}

fn publish_usage(host: &mut impl Host, usage: Option<Usage>) {
    let Some(usage) = usage else { return };
    match serde_json::to_vec(&usage) {
        Ok(json) => {
            if !host.set_filter_state(FilterState::Usage, &json) {
                host.log(Level::Warn, "cannot set the usage filter state");
            }
        }
        Err(e) => host.log(Level::Warn, &format!("cannot encode usage: {e}")),
    }
}

impl<W: Worker> Driver<W> {
    /// A new stream's state, under `config` (`None`: not configured).
    pub fn new(config: Option<Arc<Config>>, worker: W) -> Self {
        Self {
            config,
            worker,
            pending: None,
            usage_injected: false,
            stripper: None,
            started_us: 0,
            meter: Meter::new(gateway_meter::MAX_USAGE_BYTES),
            lease_response_headers: None,
            upload: None,
            tenant: None,
            outcome: Outcome::Undecided,
        }
    }

    /// The worker this stream runs on.
    pub fn worker(&self) -> &W {
        &self.worker
    }

    /// The request's stats labels once its stream ended: [`Outcome::labels`] and the tenant id
    /// (`none` before its key is known).
    pub fn stats(&self) -> (&'static str, &'static str, &str) {
        let (outcome, reason) = self.outcome.labels();
        let tenant =
            self.tenant.and_then(|i| self.config.as_ref()?.tenants.get(i)).map_or("none", |t| t.id.as_str());
        (outcome, reason, tenant)
    }

    fn reply_internal(&mut self, host: &mut impl Host, what: &'static str) -> Step {
        self.reply(host, &GatewayError::Internal { what })
    }

    fn reply(&mut self, host: &mut impl Host, e: &GatewayError) -> Step {
        let (status, _, code, _) = e.parts();
        host.log(Level::Debug, &format!("local reply {status} {code}"));
        self.send(host, &e.to_reply())
    }

    /// Sends `reply`; a refusal's reason goes to the request log first (best effort: a reply
    /// without it is still sent) and to the filter's stats.
    fn send(&mut self, host: &mut impl Host, reply: &LocalReply) -> Step {
        if reply.status >= 400 {
            host.set_filter_state(FilterState::Refusal, reply.details.as_bytes());
            self.outcome =
                Outcome::Refused(reply.details.strip_prefix("llm_gateway_").unwrap_or(reply.details));
        } else {
            self.outcome = Outcome::Answered;
        }
        host.send_reply(reply);
        Step::Replied
    }

    /// Whether the request's body is awaited (between the headers and the decision).
    pub fn is_pending(&self) -> bool {
        self.pending.is_some()
    }

    /// The configuration's `max_body_bytes` (0 without one).
    pub fn max_body_bytes(&self) -> u64 {
        self.config.as_ref().map_or(0, |c| c.max_body_bytes)
    }

    /// The request-headers phase (step 1).
    pub fn on_request_headers(&mut self, host: &mut impl Host, end_of_stream: bool) -> Step {
        self.started_us = host.now_us();
        let Some(cfg) = self.config.clone() else {
            return self.reply_internal(host, "filter not configured");
        };
        let Some(headers) = host.request_headers() else {
            return self.reply_internal(host, "cannot read request headers");
        };
        let outcome = on_request_headers(&cfg, &headers, self.started_us / 1_000_000);
        for name in &outcome.remove {
            if !host.remove_header(HeaderMap::Request, name) {
                return self.reply_internal(host, "cannot remove request headers");
            }
        }
        let pending = match outcome.decision {
            HeadersDecision::Reply(r) => return self.send(host, &r),
            HeadersDecision::AwaitBody(pending) => pending,
        };
        self.tenant = Some(pending.tenant);
        let tenant = cfg.tenants.get(pending.tenant).map_or("", |t| t.id.as_str());
        // For the request log only (best effort): the sidecar reads the tenant from the facts.
        host.set_filter_state(FilterState::Tenant, tenant.as_bytes());
        if let Some(key) = cfg.api_keys.get(pending.api_key) {
            host.set_filter_state(FilterState::ApiKey, key.name.as_bytes());
        }
        if end_of_stream {
            // No body at all: the empty body is decided now (it fails as invalid JSON).
            return self.finish_request(host, &cfg, &pending, Vec::new(), false);
        }
        // A tenant the sidecar said is over its requests-per-minute limit costs no body.
        if let Some(retry_after_secs) = self.worker.tenant_over_rpm(tenant, self.started_us) {
            return self.reply(host, &GatewayError::TenantOverRequestLimit { retry_after_secs });
        }
        let limit = cfg.max_uploads_per_tenant;
        let Some(slot) = self.worker.try_upload(pending.tenant, limit) else {
            return self.reply(host, &GatewayError::TooManyUploads { limit });
        };
        self.upload = Some(slot);
        self.pending = Some(pending);
        Step::Pause
    }

    /// A request-body callback (step 2): `buffered` is the body's size so far, in bytes.
    pub fn on_request_body(&mut self, host: &mut impl Host, buffered: u64, end_of_stream: bool) -> Step {
        let Some(cfg) = self.config.clone() else { return Step::Continue };
        if self.pending.is_none() {
            return Step::Continue;
        }
        if let Err(e) = check_body_size(&cfg, buffered) {
            self.pending = None;
            self.upload = None;
            return self.reply(host, &e);
        }
        if !end_of_stream {
            return Step::Pause;
        }
        self.take_body_and_finish(host)
    }

    /// The request's trailers: a request with trailers never sees `end_of_stream` on its body,
    /// so it is decided here with what was buffered.
    pub fn on_request_trailers(&mut self, host: &mut impl Host) -> Step {
        if self.pending.is_none() {
            return Step::Continue;
        }
        self.take_body_and_finish(host)
    }

    fn take_body_and_finish(&mut self, host: &mut impl Host) -> Step {
        self.upload = None;
        let (Some(cfg), Some(pending)) = (self.config.clone(), self.pending.take()) else {
            return Step::Continue;
        };
        let Some(body) = host.request_body() else {
            return self.reply_internal(host, "cannot read request body");
        };
        self.finish_request(host, &cfg, &pending, body, true)
    }

    /// Decides the complete body (given away: a rewrite edits it in place) and applies the plan.
    fn finish_request(
        &mut self,
        host: &mut impl Host,
        cfg: &Config,
        pending: &PendingRequest,
        body: Vec<u8>,
        body_in_buffer: bool,
    ) -> Step {
        let body_len = body.len();
        let plan = match on_request_body_owned(cfg, pending, body) {
            Ok(plan) => plan,
            Err(e) => return self.reply(host, &e),
        };
        if let (Some(new_body), true) = (&plan.new_body, body_in_buffer) {
            if !host.replace_request_body(body_len, new_body) {
                return self.reply_internal(host, "cannot rewrite request body");
            }
        }
        let mut facts = plan.facts;
        // Names the request's usage record with its request id (gateway_contract::record_id).
        let nonce = request_nonce(self.started_us);
        facts.nonce = Some(nonce.clone());
        if let (Some(lease_facts), true) = (&plan.admission, cfg.admission_leases.is_some()) {
            if let Some(admission) = self.worker.try_admit(lease_facts, host.now_us()) {
                facts.leased_tokens = Some(admission.reserved_tokens);
                facts.lease_seq = (!admission.lease_id.is_empty()).then_some(admission.lease_seq);
                facts.lease_id = (!admission.lease_id.is_empty()).then_some(admission.lease_id);
                self.lease_response_headers = Some(admission.response_headers);
            }
        }
        // The decision goes to the sidecar as filter state, which no client can write: without it
        // the request is neither admitted nor metered, so a failure here fails the request.
        let published = facts.to_json().is_ok_and(|json| host.set_filter_state(FilterState::Request, &json));
        if !published {
            return self.reply_internal(host, "cannot record the request's facts");
        }
        host.set_filter_state(FilterState::Model, facts.model.as_bytes());
        self.outcome = if facts.leased_tokens.is_some() { Outcome::Leased } else { Outcome::Forwarded };
        if facts.leased_tokens.is_some() {
            // Envoy's matcher skips the ext_proc admission on this filter state. Should it fail,
            // the admission still sees `leased_tokens` in the facts and does not charge again.
            host.set_filter_state(FilterState::Admission, ADMISSION_LEASE.as_bytes());
        }
        let nonce_header = plan.nonce_header.then_some((H_REQUEST_NONCE, nonce.as_str()));
        for (name, value) in plan.set_headers.iter().map(|(n, v)| (*n, v.as_str())).chain(nonce_header) {
            if !host.set_header(HeaderMap::Request, name, value.as_bytes()) {
                return self.reply_internal(host, "cannot set request headers");
            }
        }
        self.usage_injected = plan.usage_injected;
        self.meter.set_stream(plan.stream);
        self.meter.set_api(plan.api);
        self.meter.start(self.started_us);
        // Envoy picked a route before these headers existed; make it re-pick with x-gateway-pool.
        host.clear_route_cache();
        Step::Continue
    }

    /// The response headers (step 3).
    pub fn on_response_headers(&mut self, host: &mut impl Host, end_of_stream: bool) {
        for (name, value) in self.lease_response_headers.take().unwrap_or_default() {
            host.set_header(HeaderMap::Response, name, value.as_bytes());
        }
        if !self.usage_injected && !self.meter.is_active() {
            return;
        }
        // A clock read is a host call: only for a response that ends with its headers.
        let now = if end_of_stream && self.meter.is_active() { host.now_us() } else { 0 };
        let (meter, injected) = (&mut self.meter, self.usage_injected);
        let (usage, strip) = host.with_response_headers(|status, content_type, coding| {
            let usage = meter
                .is_active()
                .then(|| meter_response_headers(meter, status, content_type, coding, end_of_stream, now));
            (usage.flatten(), injected && response_needs_stripping(status, content_type, coding))
        });
        publish_usage(host, usage);
        if strip {
            // The body shrinks, so its length is no longer known.
            host.remove_header(HeaderMap::Response, "content-length");
            self.stripper = Some(UsageStripper::default());
        }
    }

    /// A response-body callback (step 3).
    pub fn on_response_body(&mut self, host: &mut impl Host, end_of_stream: bool) {
        if self.stripper.is_none() && !self.meter.is_active() {
            return;
        }
        if self.stripper.is_none() && !self.meter.needs_body() {
            // A JSON body whose usage is read: its later bytes are not copied.
            if end_of_stream {
                let now = host.now_us();
                let usage = self.meter.on_response_body(&[], true, Some(now));
                publish_usage(host, usage);
            }
            return;
        }
        // A clock read is a host call: only for TTFT (until the first content) and the end.
        let now =
            (self.meter.is_active() && (end_of_stream || self.meter.needs_clock())).then(|| host.now_us());
        let (meter, stripper) = (&mut self.meter, self.stripper.as_mut());
        let read = host.with_response_chunk(|chunk| {
            let (output, usage) = meter_chunk(meter, stripper, chunk, end_of_stream, now);
            (chunk.len(), output, usage)
        });
        let Some((len, output, usage)) = read else {
            // Cannot read: stop stripping and let the stream through untouched; the meter ends
            // at the stream's end with what it saw.
            self.stripper = None;
            return;
        };
        publish_usage(host, usage);
        if let ChunkOutput::Replace(out) = output {
            if !host.replace_response_chunk(len, &out) {
                host.log(Level::Warn, "cannot rewrite a response chunk");
            }
        }
    }

    /// The stream ended (step 4): a response that did not end (client abort, upstream reset,
    /// timeout) is metered with what was seen. A response already metered reads no clock.
    pub fn on_stream_end(&mut self, host: &mut impl Host) {
        if !self.meter.is_active() {
            return;
        }
        let now = host.now_us();
        let usage = self.meter.on_stream_end(now);
        publish_usage(host, usage);
    }
}

#[cfg(test)]
#[path = "driver_tests.rs"]
mod tests;
