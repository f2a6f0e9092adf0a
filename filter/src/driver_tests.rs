//! The driver's sequence against a fake host and worker: what each callback asks of Envoy.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::Arc;

use serde_json::json;

use super::*;
use crate::auth::hash_key;
use crate::uploads::UploadSlots;

/// What a fake Envoy holds for one stream, and what the driver did to it.
#[derive(Default)]
struct FakeHost {
    request_headers: Vec<(String, Vec<u8>)>,
    request_body: Vec<u8>,
    response_headers: Vec<(String, Vec<u8>)>,
    response_chunk: Vec<u8>,
    state: HashMap<&'static str, Vec<u8>>,
    replies: Vec<LocalReply>,
    route_cleared: u32,
    /// A host call that fails: "set_header", "set_filter_state".
    fail: Option<&'static str>,
}

impl FakeHost {
    fn header(map: &[(String, Vec<u8>)], name: &str) -> Option<Vec<u8>> {
        map.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone())
    }

    fn reply_status(&self) -> Option<u32> {
        self.replies.last().map(|r| r.status)
    }
}

impl Host for FakeHost {
    fn now_us(&mut self) -> u64 {
        1_700_000_000_000_000
    }
    fn request_headers(&mut self) -> Option<Vec<(String, Vec<u8>)>> {
        Some(self.request_headers.clone())
    }
    fn set_header(&mut self, map: HeaderMap, name: &str, value: &[u8]) -> bool {
        if self.fail == Some("set_header") {
            return false;
        }
        let m =
            if map == HeaderMap::Request { &mut self.request_headers } else { &mut self.response_headers };
        m.retain(|(k, _)| k != name);
        m.push((name.to_string(), value.to_vec()));
        true
    }
    fn remove_header(&mut self, map: HeaderMap, name: &str) -> bool {
        let m =
            if map == HeaderMap::Request { &mut self.request_headers } else { &mut self.response_headers };
        m.retain(|(k, _)| k != name);
        true
    }
    fn request_body(&mut self) -> Option<Vec<u8>> {
        Some(self.request_body.clone())
    }
    fn replace_request_body(&mut self, len: usize, body: &[u8]) -> bool {
        assert_eq!(len, self.request_body.len());
        self.request_body = body.to_vec();
        true
    }
    fn with_response_headers<R>(
        &mut self,
        f: impl FnOnce(Option<&[u8]>, Option<&[u8]>, Option<&[u8]>) -> R,
    ) -> R {
        let get = |n: &str| Self::header(&self.response_headers, n);
        let (s, t, c) = (get(":status"), get("content-type"), get("content-encoding"));
        f(s.as_deref(), t.as_deref(), c.as_deref())
    }
    fn with_response_chunk<R>(&mut self, f: impl FnOnce(&[u8]) -> R) -> Option<R> {
        Some(f(&self.response_chunk))
    }
    fn replace_response_chunk(&mut self, len: usize, chunk: &[u8]) -> bool {
        assert_eq!(len, self.response_chunk.len());
        self.response_chunk = chunk.to_vec();
        true
    }
    fn set_filter_state(&mut self, key: FilterState, value: &[u8]) -> bool {
        if self.fail == Some("set_filter_state") {
            return false;
        }
        let name = match key {
            FilterState::Request => "request",
            FilterState::Admission => "admission",
            FilterState::Usage => "usage",
            FilterState::Tenant => "tenant",
            FilterState::ApiKey => "api_key",
            FilterState::Model => "model",
            FilterState::Refusal => "refusal",
        };
        // Usage is set at most once per stream (metered exactly once).
        assert!(!(name == "usage" && self.state.contains_key("usage")), "usage published twice");
        self.state.insert(name, value.to_vec());
        true
    }
    fn clear_route_cache(&mut self) {
        self.route_cleared += 1;
    }
    fn send_reply(&mut self, reply: &LocalReply) {
        self.replies.push(reply.clone());
    }
    fn log(&mut self, _level: Level, _message: &str) {}
}

/// A worker with upload slots, an optional lease that admits everything, and a tenant over RPM.
#[derive(Clone, Default)]
struct FakeWorker {
    uploads: Rc<RefCell<UploadSlots>>,
    lease: bool,
    over_rpm: Option<u64>,
}

struct Slot(Rc<RefCell<UploadSlots>>, usize);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.borrow_mut().release(self.1);
    }
}

impl Worker for FakeWorker {
    type Upload = Slot;
    fn try_upload(&self, tenant: usize, limit: u32) -> Option<Slot> {
        self.uploads.borrow_mut().try_acquire(tenant, limit).then(|| Slot(Rc::clone(&self.uploads), tenant))
    }
    fn try_admit(&self, facts: &AdmissionFacts, _now_us: u64) -> Option<LeaseAdmission> {
        self.lease.then(|| LeaseAdmission {
            reserved_tokens: facts.reserve_tokens,
            lease_id: "L1".into(),
            lease_seq: 3,
            response_headers: vec![("x-ratelimit-remaining-requests", "9".into())],
        })
    }
    fn tenant_over_rpm(&self, _tenant: &str, _now_us: u64) -> Option<u64> {
        self.over_rpm
    }
}

fn config(leases: bool) -> Arc<Config> {
    let mut v = json!({
        "max_body_bytes": 2000,
        "max_uploads_per_tenant": 1,
        "tenants": [{"id": "demo", "api_keys_sha256": [hex::encode(hash_key(b"sk-demo"))]}],
        "models": [{"name": "qwen", "pool": "pool_a", "max_model_len": 4096}]
    });
    if leases {
        v["admission_leases"] = json!({"cluster": "sidecar"});
    }
    Arc::new(Config::from_json(v.to_string().as_bytes()).unwrap())
}

fn host(key: &str, body: &str) -> FakeHost {
    let headers = [
        (":method", "POST"),
        (":path", "/v1/chat/completions"),
        ("authorization", &format!("Bearer {key}")),
        ("x-gateway-tenant", "forged"),
    ];
    FakeHost {
        request_headers: headers.iter().map(|(k, v)| (k.to_string(), v.as_bytes().to_vec())).collect(),
        request_body: body.as_bytes().to_vec(),
        ..FakeHost::default()
    }
}

const CHAT: &str = r#"{"model":"qwen","messages":[{"role":"user","content":"hi"}],"max_tokens":5}"#;

#[test]
fn an_admitted_request_publishes_its_facts_sets_its_route_and_is_metered_once() {
    let worker = FakeWorker::default();
    let mut d = Driver::new(Some(config(false)), worker.clone());
    let mut h = host("sk-demo", CHAT);
    assert_eq!(d.on_request_headers(&mut h, false), Step::Pause);
    assert!(FakeHost::header(&h.request_headers, "x-gateway-tenant").is_none(), "client's header removed");
    assert_eq!(worker.uploads.borrow().in_progress(0), 1);
    assert_eq!(d.on_request_body(&mut h, 10, false), Step::Pause);
    assert_eq!(d.on_request_body(&mut h, CHAT.len() as u64, true), Step::Continue);
    assert_eq!(worker.uploads.borrow().in_progress(0), 0, "the slot is given back with the body");
    assert!(h.replies.is_empty());
    assert_eq!(FakeHost::header(&h.request_headers, "x-gateway-pool").as_deref(), Some(&b"pool_a"[..]));
    let facts: serde_json::Value = serde_json::from_slice(&h.state["request"]).unwrap();
    assert_eq!(facts["tenant"], "demo");
    assert!(facts["nonce"].is_string());
    assert_eq!(
        (&h.state["tenant"][..], &h.state["model"][..]),
        (&b"demo"[..], &b"qwen"[..]),
        "for the request log"
    );
    assert!(!h.state.contains_key("refusal"));
    assert!(!h.state.contains_key("admission"));
    assert_eq!(h.route_cleared, 1);
    h.response_headers =
        vec![(":status".into(), b"200".to_vec()), ("content-type".into(), b"application/json".to_vec())];
    d.on_response_headers(&mut h, false);
    h.response_chunk = br#"{"usage":{"prompt_tokens":7,"completion_tokens":2,"total_tokens":9}}"#.to_vec();
    d.on_response_body(&mut h, true);
    let usage: serde_json::Value = serde_json::from_slice(&h.state["usage"]).unwrap();
    assert_eq!(usage["prompt_tokens"], 7);
    // The stream's end after a metered response publishes nothing more (FakeHost asserts it).
    d.on_stream_end(&mut h);
}

#[test]
fn a_stream_that_ends_before_its_response_is_metered_at_its_end() {
    let mut d = Driver::new(Some(config(false)), FakeWorker::default());
    let mut h = host("sk-demo", CHAT);
    d.on_request_headers(&mut h, false);
    d.on_request_body(&mut h, CHAT.len() as u64, true);
    assert!(!h.state.contains_key("usage"));
    d.on_stream_end(&mut h);
    assert!(h.state.contains_key("usage"));
}

#[test]
fn a_lease_admits_the_request_and_adds_its_headers_to_the_response() {
    let worker = FakeWorker { lease: true, ..FakeWorker::default() };
    let mut d = Driver::new(Some(config(true)), worker);
    let mut h = host("sk-demo", CHAT);
    d.on_request_headers(&mut h, false);
    assert_eq!(d.on_request_body(&mut h, CHAT.len() as u64, true), Step::Continue);
    assert_eq!(h.state["admission"], ADMISSION_LEASE.as_bytes());
    let facts: serde_json::Value = serde_json::from_slice(&h.state["request"]).unwrap();
    assert_eq!((facts["lease_id"].as_str(), facts["lease_seq"].as_u64()), (Some("L1"), Some(3)));
    assert!(facts["leased_tokens"].as_u64().is_some());
    h.response_headers = vec![(":status".into(), b"200".to_vec())];
    d.on_response_headers(&mut h, false);
    assert!(FakeHost::header(&h.response_headers, "x-ratelimit-remaining-requests").is_some());
}

#[test]
fn a_lease_is_not_asked_without_admission_leases_configured() {
    let worker = FakeWorker { lease: true, ..FakeWorker::default() };
    let mut d = Driver::new(Some(config(false)), worker);
    let mut h = host("sk-demo", CHAT);
    d.on_request_headers(&mut h, false);
    d.on_request_body(&mut h, CHAT.len() as u64, true);
    assert!(!h.state.contains_key("admission"));
}

/// Named keys around the fake host's clock (2023-11-14T22:13:20Z): one expired, one not valid
/// yet, one valid with limits of its own; leases configured.
fn keyed_config() -> Arc<Config> {
    let key = |name: &str, extra: serde_json::Value| {
        let mut k = json!({"name": name, "sha256": hex::encode(hash_key(format!("sk-{name}").as_bytes()))});
        for (f, v) in extra.as_object().unwrap() {
            k[f] = v.clone();
        }
        k
    };
    let v = json!({
        "tenants": [{"id": "demo", "api_keys": [
            key("old", json!({"expires_at": "2023-11-14T22:13:20Z"})),
            key("next", json!({"not_before": "2023-11-14T22:13:21Z"})),
            key("own", json!({"not_before": "2023-11-14T22:13:20Z", "own_limits": true})),
        ]}],
        "models": [{"name": "qwen", "pool": "pool_a", "max_model_len": 4096}],
        "admission_leases": {"cluster": "sidecar"}
    });
    Arc::new(Config::from_json(v.to_string().as_bytes()).unwrap())
}

#[test]
fn a_key_outside_its_window_is_refused_at_the_host_clock() {
    for (key, refusal, says) in [
        ("sk-old", &b"llm_gateway_api_key_expired"[..], "expired"),
        ("sk-next", &b"llm_gateway_api_key_not_yet_valid"[..], "not yet valid"),
    ] {
        let mut h = host(key, CHAT);
        let mut d = Driver::new(Some(keyed_config()), FakeWorker::default());
        assert_eq!(d.on_request_headers(&mut h, false), Step::Replied);
        assert_eq!(h.reply_status(), Some(401));
        assert_eq!(h.state["refusal"], refusal);
        let body = String::from_utf8(h.replies[0].body.clone()).unwrap();
        assert!(body.contains(says) && body.contains("invalid_api_key") && !body.contains(key), "{body}");
        assert!(!h.state.contains_key("request"));
    }
}

#[test]
fn a_key_name_goes_to_the_facts_and_the_request_log_and_own_limits_skip_the_lease() {
    let worker = FakeWorker { lease: true, ..FakeWorker::default() };
    let mut d = Driver::new(Some(keyed_config()), worker);
    let mut h = host("sk-own", CHAT);
    assert_eq!(d.on_request_headers(&mut h, false), Step::Pause);
    assert_eq!(d.on_request_body(&mut h, CHAT.len() as u64, true), Step::Continue);
    let facts: serde_json::Value = serde_json::from_slice(&h.state["request"]).unwrap();
    assert_eq!((facts["tenant"].as_str(), facts["api_key"].as_str()), (Some("demo"), Some("own")));
    assert_eq!(h.state["api_key"], b"own");
    assert!(!h.state.contains_key("admission"), "a key with its own limits is admitted by the sidecar");
    assert!(facts.get("leased_tokens").is_none());
}

#[test]
fn refusals_reply_and_read_no_body() {
    // Unconfigured: 500 at the headers.
    let mut h = host("sk-demo", CHAT);
    assert_eq!(Driver::new(None, FakeWorker::default()).on_request_headers(&mut h, false), Step::Replied);
    assert_eq!(h.reply_status(), Some(500));
    // A wrong key: 401.
    let mut h = host("sk-wrong", CHAT);
    assert_eq!(
        Driver::new(Some(config(false)), FakeWorker::default()).on_request_headers(&mut h, false),
        Step::Replied
    );
    assert_eq!(h.reply_status(), Some(401));
    assert_eq!(h.state["refusal"], b"llm_gateway_invalid_api_key", "the request log says why");
    assert!(!h.state.contains_key("tenant"), "no tenant for a key that matches none");
    // A tenant over its RPM: 429 at the headers, no slot taken.
    let worker = FakeWorker { over_rpm: Some(12), ..FakeWorker::default() };
    let mut h = host("sk-demo", CHAT);
    assert_eq!(
        Driver::new(Some(config(false)), worker.clone()).on_request_headers(&mut h, false),
        Step::Replied
    );
    assert_eq!(h.reply_status(), Some(429));
    assert_eq!(h.state["refusal"], b"llm_gateway_tenant_over_rpm");
    assert_eq!(h.state["tenant"], b"demo");
    assert_eq!(worker.uploads.borrow().in_progress(0), 0);
    // A second upload of the tenant while the first is in progress (max_uploads_per_tenant 1).
    let worker = FakeWorker::default();
    let mut first = Driver::new(Some(config(false)), worker.clone());
    first.on_request_headers(&mut host("sk-demo", CHAT), false);
    let mut h = host("sk-demo", CHAT);
    assert_eq!(
        Driver::new(Some(config(false)), worker.clone()).on_request_headers(&mut h, false),
        Step::Replied
    );
    assert_eq!(h.reply_status(), Some(429));
    drop(first);
    assert_eq!(worker.uploads.borrow().in_progress(0), 0, "a stream dropped mid-body gives its slot back");
}

#[test]
fn a_body_over_the_limit_is_refused_while_it_arrives() {
    let worker = FakeWorker::default();
    let mut d = Driver::new(Some(config(false)), worker.clone());
    let mut h = host("sk-demo", CHAT);
    d.on_request_headers(&mut h, false);
    assert_eq!(d.on_request_body(&mut h, 2001, false), Step::Replied);
    assert_eq!(h.reply_status(), Some(413));
    assert_eq!(worker.uploads.borrow().in_progress(0), 0);
    assert!(!d.is_pending());
    assert_eq!(d.on_request_body(&mut h, 3000, true), Step::Continue, "nothing more is decided");
}

#[test]
fn no_body_at_all_is_decided_at_the_headers() {
    let mut d = Driver::new(Some(config(false)), FakeWorker::default());
    let mut h = host("sk-demo", "");
    assert_eq!(d.on_request_headers(&mut h, true), Step::Replied);
    assert_eq!(h.reply_status(), Some(400));
}

#[test]
fn trailers_decide_the_buffered_body() {
    let mut d = Driver::new(Some(config(false)), FakeWorker::default());
    let mut h = host("sk-demo", CHAT);
    d.on_request_headers(&mut h, false);
    assert_eq!(d.on_request_body(&mut h, CHAT.len() as u64, false), Step::Pause);
    assert_eq!(d.on_request_trailers(&mut h), Step::Continue);
    assert!(h.state.contains_key("request"));
    assert_eq!(d.on_request_trailers(&mut h), Step::Continue);
}

#[test]
fn host_failures_fail_the_request_closed() {
    for fail in ["set_filter_state", "set_header"] {
        let mut d = Driver::new(Some(config(false)), FakeWorker::default());
        let mut h = host("sk-demo", CHAT);
        d.on_request_headers(&mut h, false);
        h.fail = Some(fail);
        assert_eq!(d.on_request_body(&mut h, CHAT.len() as u64, true), Step::Replied, "{fail}");
        assert_eq!(h.reply_status(), Some(500), "{fail}");
        assert_eq!(h.route_cleared, 0, "{fail}");
    }
}

#[test]
fn an_injected_usage_chunk_is_stripped_from_a_stream() {
    let body = r#"{"model":"qwen","messages":[{"role":"user","content":"hi"}],"stream":true}"#;
    let mut d = Driver::new(Some(config(false)), FakeWorker::default());
    let mut h = host("sk-demo", body);
    d.on_request_headers(&mut h, false);
    d.on_request_body(&mut h, body.len() as u64, true);
    assert!(String::from_utf8_lossy(&h.request_body).contains("include_usage"), "usage asked for");
    h.response_headers = vec![
        (":status".into(), b"200".to_vec()),
        ("content-type".into(), b"text/event-stream".to_vec()),
        ("content-length".into(), b"999".to_vec()),
    ];
    d.on_response_headers(&mut h, false);
    assert!(FakeHost::header(&h.response_headers, "content-length").is_none());
    h.response_chunk = concat!(
        "data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}]}\n\n",
        "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":1,\"total_tokens\":4}}\n\n",
        "data: [DONE]\n\n"
    )
    .as_bytes()
    .to_vec();
    d.on_response_body(&mut h, true);
    let out = String::from_utf8_lossy(&h.response_chunk);
    assert!(!out.contains("usage") && out.contains("[DONE]"), "{out}");
    let usage: serde_json::Value = serde_json::from_slice(&h.state["usage"]).unwrap();
    assert_eq!(usage["completion_tokens"], 1);
}
