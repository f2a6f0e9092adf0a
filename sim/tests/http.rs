//! End-to-end tests over real HTTP: the server runs in-process on an ephemeral port and a
//! small hyper client talks to it. Every wait is bounded by [`LIMIT`].

// A test crate: the helpers' panics are test failures (clippy.toml only covers `#[test]` bodies).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use std::future::Future;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::client::conn::http1::{self, SendRequest};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use vllm_sim::{EngineKind, SimConfig};

const LIMIT: Duration = Duration::from_secs(20);

async fn bounded<T>(what: &str, fut: impl Future<Output = T>) -> T {
    tokio::time::timeout(LIMIT, fut).await.unwrap_or_else(|_| panic!("timed out: {what}"))
}

/// A simulator served in-process.
struct Sim {
    addr: SocketAddr,
    stop: oneshot::Sender<()>,
    task: JoinHandle<std::io::Result<()>>,
}

impl Sim {
    async fn start(config: SimConfig) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(vllm_sim::serve(config, listener, async move {
            let _ = stopped.await;
        }));
        Self { addr, stop, task }
    }

    async fn shutdown(self) {
        self.stop.send(()).unwrap();
        bounded("shutdown", self.task).await.unwrap().unwrap();
    }

    async fn client(&self) -> Client {
        let stream = bounded("connect", TcpStream::connect(self.addr)).await.unwrap();
        let (sender, conn) = http1::handshake(TokioIo::new(stream)).await.unwrap();
        let conn = tokio::spawn(async move {
            let _ = conn.await;
        });
        Client { sender, conn }
    }

    /// One request on a fresh connection; the whole body.
    async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<Value>,
    ) -> (StatusCode, http::HeaderMap, Bytes) {
        let mut client = self.client().await;
        let response = client.send(method, path, body).await;
        let (parts, body) = response.into_parts();
        let bytes = bounded("body", body.collect()).await.unwrap().to_bytes();
        (parts.status, parts.headers, bytes)
    }

    async fn post(&self, path: &str, body: Value) -> (StatusCode, Value) {
        let (status, headers, bytes) = self.call(Method::POST, path, Some(body)).await;
        assert_eq!(headers["content-type"], "application/json");
        (status, serde_json::from_slice(&bytes).unwrap())
    }

    async fn metrics(&self) -> String {
        let (status, _, bytes) = self.call(Method::GET, "/metrics", None).await;
        assert_eq!(status, StatusCode::OK);
        String::from_utf8(bytes.to_vec()).unwrap()
    }

    /// Polls `/metrics` until `done` holds for it.
    async fn wait_metrics(&self, what: &str, done: impl Fn(&str) -> bool) -> String {
        bounded(what, async {
            loop {
                let text = self.metrics().await;
                if done(&text) {
                    return text;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
    }
}

/// One HTTP/1.1 connection.
struct Client {
    sender: SendRequest<Full<Bytes>>,
    conn: JoinHandle<()>,
}

impl Client {
    async fn send(&mut self, method: Method, path: &str, body: Option<Value>) -> http::Response<Incoming> {
        let body = body.map_or_else(Bytes::new, |b| Bytes::from(serde_json::to_vec(&b).unwrap()));
        let request = Request::builder()
            .method(method)
            .uri(path)
            .header("host", "sim")
            .header("content-type", "application/json")
            .body(Full::new(body))
            .unwrap();
        bounded("response head", self.sender.send_request(request)).await.unwrap()
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        // Closes the socket, as a client going away does.
        self.conn.abort();
    }
}

/// The value of the first sample named exactly `series` (name plus labels).
fn metric(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series).and_then(|r| r.strip_prefix(' ')))
        .unwrap_or_else(|| panic!("{series} missing in\n{text}"))
        .parse()
        .unwrap()
}

const RUNNING: &str = "vllm:num_requests_running{model_name=\"sim-model\"}";
const WAITING: &str = "vllm:num_requests_waiting{model_name=\"sim-model\"}";
const RECEIVED: &str = "vllm_sim:requests_received_total";

/// `data:` payloads of an SSE body, checking the framing.
fn sse_events(body: &[u8]) -> Vec<String> {
    let text = std::str::from_utf8(body).unwrap();
    assert!(text.ends_with("\n\n"), "{text:?}");
    text.split_terminator("\n\n")
        .map(|e| e.strip_prefix("data: ").unwrap_or_else(|| panic!("bad event {e:?}")).to_owned())
        .collect()
}

fn chat(extra: Value) -> Value {
    let mut body = json!({"model": "sim-model", "messages": [{"role": "user", "content": "Hello world!"}]});
    body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    body
}

/// "Hello world!" as one user message: 1 (role) + 3 (content) + 3 + 3.
const CHAT_PROMPT_TOKENS: u64 = 10;

#[tokio::test]
async fn non_streaming_chat_reports_usage_and_finish_reason() {
    let sim = Sim::start(SimConfig {
        served_model_names: vec!["sim-model".into(), "alias".into()],
        ..SimConfig::default()
    })
    .await;
    let (status, v) = sim.post("/v1/chat/completions", chat(json!({}))).await;
    assert_eq!(status, StatusCode::OK);
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], "sim-model");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(
        v["usage"],
        json!({"prompt_tokens": CHAT_PROMPT_TOKENS, "completion_tokens": 16, "total_tokens": CHAT_PROMPT_TOKENS + 16})
    );
    let words = v["choices"][0]["message"]["content"].as_str().unwrap().split_whitespace().count();
    assert_eq!(words, 16);

    let (status, v) =
        sim.post("/v1/chat/completions", chat(json!({"model": "alias", "max_tokens": 5}))).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(v["model"], "sim-model", "vLLM answers with the first served name");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 5);

    let (_, v) = sim.post("/v1/chat/completions", chat(json!({"max_tokens": 40, "ignore_eos": true}))).await;
    assert_eq!(v["usage"]["completion_tokens"], 40);
    sim.shutdown().await;
}

#[tokio::test]
async fn non_streaming_completion() {
    let sim = Sim::start(SimConfig::default()).await;
    let (status, v) = sim
        .post("/v1/completions", json!({"model": "sim-model", "prompt": "abcdefgh", "max_tokens": 3}))
        .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["choices"][0]["text"], "the quick brown ");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"], json!({"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}));
    sim.shutdown().await;
}

#[tokio::test]
async fn streaming_chat_event_order() {
    let sim = Sim::start(SimConfig { output_tokens: 4, ..SimConfig::default() }).await;
    let body = chat(json!({"stream": true, "stream_options": {"include_usage": true}}));
    let (status, headers, bytes) = sim.call(Method::POST, "/v1/chat/completions", Some(body)).await;
    assert_eq!(status, StatusCode::OK);
    assert!(headers["content-type"].to_str().unwrap().starts_with("text/event-stream"));
    assert!(headers.get("content-length").is_none());

    let events = sse_events(&bytes);
    assert_eq!(events.len(), 1 + 4 + 1 + 1, "{events:#?}");
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> =
        events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    let id = &chunks[0]["id"];
    for c in &chunks {
        assert_eq!(&c["id"], id);
        assert_eq!(c["object"], "chat.completion.chunk");
        assert_eq!(c["model"], "sim-model");
    }
    assert_eq!(chunks[0]["choices"][0]["delta"], json!({"role": "assistant", "content": ""}));
    assert_eq!(chunks[0]["usage"], Value::Null);
    for (i, c) in chunks[1..5].iter().enumerate() {
        assert!(c["choices"][0]["delta"]["content"].as_str().unwrap().ends_with(' '));
        let expected = if i == 3 { json!("stop") } else { Value::Null };
        assert_eq!(c["choices"][0]["finish_reason"], expected);
    }
    assert_eq!(chunks[5]["choices"], json!([]));
    assert_eq!(
        chunks[5]["usage"],
        json!({"prompt_tokens": CHAT_PROMPT_TOKENS, "completion_tokens": 4, "total_tokens": CHAT_PROMPT_TOKENS + 4})
    );
    sim.shutdown().await;
}

#[tokio::test]
async fn streaming_completion_without_usage() {
    let sim = Sim::start(SimConfig::default()).await;
    let body = json!({"model": "sim-model", "prompt": ["ab", "cd"], "max_tokens": 2, "stream": true});
    let (status, _, bytes) = sim.call(Method::POST, "/v1/completions", Some(body)).await;
    assert_eq!(status, StatusCode::OK);
    let events = sse_events(&bytes);
    assert_eq!(events.len(), 3, "{events:#?}");
    let first: Value = serde_json::from_str(&events[0]).unwrap();
    assert_eq!(first["object"], "text_completion");
    assert_eq!(first["choices"][0]["text"], "the ");
    assert!(first.get("usage").is_none());
    let last: Value = serde_json::from_str(&events[1]).unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    assert_eq!(events[2], "[DONE]");
    sim.shutdown().await;
}

#[tokio::test]
async fn metrics_use_vllm_names() {
    let sim = Sim::start(SimConfig::default()).await;
    let body = chat(json!({"stream": true, "max_tokens": 3}));
    sim.call(Method::POST, "/v1/chat/completions", Some(body)).await;
    sim.post("/v1/chat/completions", chat(json!({"max_tokens": 2}))).await;
    let text = sim.metrics().await;
    for name in [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:time_to_first_token_seconds_sum",
        "vllm:time_to_first_token_seconds_count",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:request_success_total",
    ] {
        assert!(text.contains(&format!("{name}{{")), "{name} missing in\n{text}");
    }
    let l = "model_name=\"sim-model\"";
    assert_eq!(metric(&text, RECEIVED), 2.0);
    assert_eq!(metric(&text, &format!("vllm:prompt_tokens_total{{{l}}}")), 20.0);
    assert_eq!(metric(&text, &format!("vllm:generation_tokens_total{{{l}}}")), 5.0);
    assert_eq!(metric(&text, &format!("vllm:request_success_total{{finished_reason=\"length\",{l}}}")), 2.0);
    assert_eq!(metric(&text, &format!("vllm:time_to_first_token_seconds_count{{{l}}}")), 2.0);
    assert_eq!(metric(&text, RUNNING), 0.0);
    let (status, headers, _) = sim.call(Method::GET, "/metrics", None).await;
    assert_eq!(status, StatusCode::OK);
    assert!(headers["content-type"].to_str().unwrap().starts_with("text/plain; version=0.0.4"));
    // `/metrics/` (vLLM's prometheus_client mount) answers only the samples `name[]` names.
    let (status, headers, bytes) = sim
        .call(
            Method::GET,
            "/metrics/?name%5B%5D=vllm%3Anum_requests_running&name%5B%5D=vllm%3Arequest_success_total",
            None,
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    assert!(headers["content-type"].to_str().unwrap().starts_with("text/plain; version=0.0.4"));
    let filtered = String::from_utf8(bytes.to_vec()).unwrap();
    let samples: Vec<&str> = filtered.lines().filter(|l| !l.starts_with('#')).collect();
    assert_eq!(
        samples,
        [
            format!("{RUNNING} 0"),
            format!("vllm:request_success_total{{finished_reason=\"stop\",{l}}} 0"),
            format!("vllm:request_success_total{{finished_reason=\"length\",{l}}} 2"),
            format!("vllm:request_success_total{{finished_reason=\"abort\",{l}}} 0"),
        ],
        "{filtered}"
    );
    sim.shutdown().await;
}

#[tokio::test]
async fn queue_holds_requests_beyond_max_num_seqs_and_frees_slots_of_gone_clients() {
    let sim = Sim::start(SimConfig {
        max_num_seqs: 1,
        // Long enough that nothing finishes during the test.
        ttft_ms: 60_000.0,
        ..SimConfig::default()
    })
    .await;
    let body = chat(json!({"stream": true}));
    let mut first = sim.client().await;
    let first_response = first.send(Method::POST, "/v1/chat/completions", Some(body.clone())).await;
    assert_eq!(first_response.status(), StatusCode::OK);
    let mut second = sim.client().await;
    let second_response = second.send(Method::POST, "/v1/chat/completions", Some(body)).await;
    assert_eq!(second_response.status(), StatusCode::OK);

    let text = sim
        .wait_metrics("one running, one waiting", |t| metric(t, RUNNING) == 1.0 && metric(t, WAITING) == 1.0)
        .await;
    assert_eq!(metric(&text, "vllm:kv_cache_usage_perc{model_name=\"sim-model\"}"), 1.0);

    // A non-streamed request queues too, and leaves the queue when its client goes away.
    let mut third = sim.client().await;
    let third_task =
        tokio::spawn(
            async move { third.send(Method::POST, "/v1/chat/completions", Some(chat(json!({})))).await },
        );
    sim.wait_metrics("two waiting", |t| metric(t, WAITING) == 2.0).await;
    third_task.abort();
    sim.wait_metrics("third left the queue", |t| metric(t, WAITING) == 1.0).await;

    // The running client goes away: its slot passes to the waiting request.
    drop(first_response);
    drop(first);
    let abort = "vllm:request_success_total{finished_reason=\"abort\",model_name=\"sim-model\"}";
    sim.wait_metrics("second admitted", |t| {
        metric(t, RUNNING) == 1.0 && metric(t, WAITING) == 0.0 && metric(t, abort) == 2.0
    })
    .await;
    drop(second_response);
    drop(second);
    let text = sim.wait_metrics("all gone", |t| metric(t, RUNNING) == 0.0).await;
    assert_eq!(metric(&text, abort), 3.0);
    assert_eq!(metric(&text, "vllm:generation_tokens_total{model_name=\"sim-model\"}"), 0.0);
    sim.shutdown().await;
}

#[tokio::test]
async fn unknown_model_is_404_with_vllm_body() {
    let sim = Sim::start(SimConfig::default()).await;
    let (status, v) = sim.post("/v1/chat/completions", chat(json!({"model": "gpt-4o"}))).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(v["error"]["message"], "The model `gpt-4o` does not exist.");
    assert_eq!(v["error"]["type"], "NotFoundError");
    assert_eq!(v["error"]["code"], 404);
    assert_eq!(metric(&sim.metrics().await, RECEIVED), 1.0);
    sim.shutdown().await;
}

#[tokio::test]
async fn over_long_prompt_is_400_with_vllm_message() {
    let sim = Sim::start(SimConfig { max_model_len: 64, ..SimConfig::default() }).await;
    // 200 bytes: 50 tokens, plus 1 + 3 + 3 for the chat template = 57.
    let long = "x".repeat(200);
    let body =
        json!({"model": "sim-model", "messages": [{"role": "user", "content": long}], "max_tokens": 10});
    let (status, v) = sim.post("/v1/chat/completions", body).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(
        v["error"],
        json!({
            "message": "This model's maximum context length is 64 tokens. However, you requested 67 tokens \
                        (57 in the messages, 10 in the completion). Please reduce the length of the messages \
                        or completion.",
            "type": "BadRequestError",
            "param": null,
            "code": 400
        })
    );
    let (status, v) = sim.post("/v1/completions", json!({"prompt": "y".repeat(256)})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(v["error"]["message"].as_str().unwrap().contains("you requested 64 tokens in the messages"));

    let (status, headers, bytes) = sim.call(Method::POST, "/v1/chat/completions", None).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(headers["content-type"], "application/json");
    let v: Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(v["error"]["type"], "BadRequestError");

    let text = sim.metrics().await;
    assert_eq!(metric(&text, RECEIVED), 3.0);
    assert_eq!(metric(&text, "vllm:prompt_tokens_total{model_name=\"sim-model\"}"), 0.0);
    sim.shutdown().await;
}

#[tokio::test]
async fn fail_after_chunks_drops_the_connection_mid_stream() {
    let sim = Sim::start(SimConfig { fail_after_chunks: Some(2), ..SimConfig::default() }).await;
    let mut client = sim.client().await;
    let response =
        client.send(Method::POST, "/v1/chat/completions", Some(chat(json!({"stream": true})))).await;
    assert_eq!(response.status(), StatusCode::OK);
    let mut body = response.into_body();
    let mut received = Vec::new();
    let error = bounded("cut stream", async {
        loop {
            match body.frame().await {
                Some(Ok(frame)) => received.extend_from_slice(frame.data_ref().unwrap()),
                Some(Err(e)) => return e,
                None => panic!("stream ended cleanly"),
            }
        }
    })
    .await;
    // The server closed the connection (FIN) in the middle of the chunked body.
    let cause = std::error::Error::source(&error)
        .and_then(|s| s.downcast_ref::<std::io::Error>())
        .unwrap_or_else(|| panic!("{error:?}"));
    assert_eq!(cause.kind(), std::io::ErrorKind::UnexpectedEof, "{error:?}");
    let events = sse_events(&received);
    assert_eq!(events.len(), 3, "role + 2 content chunks: {events:#?}");
    assert!(!events.iter().any(|e| e == "[DONE]"));
    let text = sim
        .wait_metrics("abort counted", |t| {
            metric(t, "vllm:request_success_total{finished_reason=\"abort\",model_name=\"sim-model\"}") == 1.0
        })
        .await;
    assert_eq!(metric(&text, "vllm:generation_tokens_total{model_name=\"sim-model\"}"), 2.0);
    assert_eq!(metric(&text, RUNNING), 0.0);
    sim.shutdown().await;
}

#[tokio::test]
async fn error_rate_one_answers_500() {
    let sim = Sim::start(SimConfig { error_rate: 1.0, ..SimConfig::default() }).await;
    let (status, v) = sim.post("/v1/chat/completions", chat(json!({"stream": true}))).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(v["error"]["type"], "InternalServerError");
    assert_eq!(v["error"]["code"], 500);
    sim.shutdown().await;
}

#[tokio::test]
async fn ttft_and_itl_pace_the_tokens() {
    let sim =
        Sim::start(SimConfig { ttft_ms: 60.0, itl_ms: 20.0, output_tokens: 3, ..SimConfig::default() }).await;
    let started = Instant::now();
    let mut client = sim.client().await;
    let response =
        client.send(Method::POST, "/v1/completions", Some(json!({"prompt": "hi", "stream": true}))).await;
    let mut body = response.into_body();
    let mut arrivals = Vec::new();
    bounded("paced stream", async {
        while let Some(frame) = body.frame().await {
            let data = frame.unwrap().into_data().unwrap();
            arrivals.push((started.elapsed(), String::from_utf8(data.to_vec()).unwrap()));
        }
    })
    .await;
    let arrival = |word: &str| {
        arrivals
            .iter()
            .find(|(_, text)| text.contains(&format!("\"text\":\"{word}\"")))
            .unwrap_or_else(|| panic!("{word} missing: {arrivals:?}"))
            .0
    };
    assert!(arrival("the ") >= Duration::from_millis(60), "{arrivals:?}");
    assert!(arrival("brown ") >= Duration::from_millis(100), "{arrivals:?}");
    assert!(arrivals.last().unwrap().1.ends_with("data: [DONE]\n\n"));

    let started = Instant::now();
    let (status, _) = sim.post("/v1/completions", json!({"prompt": "hi"})).await;
    assert_eq!(status, StatusCode::OK);
    assert!(started.elapsed() >= Duration::from_millis(100));
    sim.shutdown().await;
}

#[tokio::test]
async fn models_health_and_unknown_routes() {
    let sim = Sim::start(SimConfig {
        served_model_names: vec!["a".into(), "b".into()],
        max_model_len: 1024,
        ..SimConfig::default()
    })
    .await;
    let (status, _, bytes) = sim.call(Method::GET, "/v1/models", None).await;
    assert_eq!(status, StatusCode::OK);
    let v: Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(v["object"], "list");
    let ids: Vec<_> = v["data"].as_array().unwrap().iter().map(|m| m["id"].clone()).collect();
    assert_eq!(ids, [json!("a"), json!("b")]);
    assert_eq!(v["data"][0]["owned_by"], "vllm");
    assert_eq!(v["data"][0]["max_model_len"], 1024);

    let (status, _, bytes) = sim.call(Method::GET, "/health", None).await;
    assert_eq!((status, bytes.len()), (StatusCode::OK, 0));
    let (status, _, _) = sim.call(Method::GET, "/nope", None).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (status, _, _) = sim.call(Method::GET, "/v1/chat/completions", None).await;
    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);
    sim.shutdown().await;
}

#[tokio::test]
async fn keep_alive_serves_many_requests_on_one_connection() {
    let sim = Sim::start(SimConfig::default()).await;
    let mut client = sim.client().await;
    for _ in 0..3 {
        let response =
            client.send(Method::POST, "/v1/chat/completions", Some(chat(json!({"stream": true})))).await;
        let bytes = bounded("body", response.into_body().collect()).await.unwrap().to_bytes();
        assert_eq!(sse_events(&bytes).last().unwrap(), "[DONE]");
    }
    drop(client);
    sim.shutdown().await;
}

#[tokio::test]
async fn invalid_config_is_rejected() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let config = SimConfig { max_num_seqs: 0, ..SimConfig::default() };
    let err = bounded("serve", vllm_sim::serve(config, listener, std::future::pending())).await.unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput);
}

// ---- `--engine batched` (issue 12, item 5): the prefix cache, queueing and KV use over real HTTP.

const KV_USAGE: &str = "vllm:kv_cache_usage_perc{model_name=\"sim-model\"}";
const HITS: &str = "vllm:prefix_cache_hits_total{model_name=\"sim-model\"}";
const QUERIES: &str = "vllm:prefix_cache_queries_total{model_name=\"sim-model\"}";
const ABORTED: &str = "vllm:request_success_total{finished_reason=\"abort\",model_name=\"sim-model\"}";

fn batched(config: SimConfig) -> SimConfig {
    SimConfig { engine: EngineKind::Batched, ..config }
}

/// A chat body whose system prompt is `bytes` long (about `bytes / 4` tokens).
fn long_chat(bytes: usize, extra: Value) -> Value {
    let system: String = (0..bytes).map(|i| char::from(b'a' + (i % 26) as u8)).collect();
    let mut body = json!({"model": "sim-model", "messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": "What is the answer?"},
    ]});
    body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    body
}

/// Time from sending a streamed request to its first content chunk, and the whole body.
async fn ttft(sim: &Sim, body: Value) -> (Duration, Vec<String>) {
    let started = Instant::now();
    let mut client = sim.client().await;
    let response = client.send(Method::POST, "/v1/chat/completions", Some(body)).await;
    assert_eq!(response.status(), StatusCode::OK);
    let mut body = response.into_body();
    let mut received = Vec::new();
    let mut first = None;
    bounded("stream", async {
        while let Some(frame) = body.frame().await {
            received.extend_from_slice(frame.unwrap().data_ref().unwrap());
            if first.is_none() && std::str::from_utf8(&received).unwrap().contains("\"content\":\"the \"") {
                first = Some(started.elapsed());
            }
        }
    })
    .await;
    (first.expect("no content chunk"), sse_events(&received))
}

/// The acceptance check for the sim: a repeated long prompt is mostly served from the
/// prefix cache, so its time to first token is far lower, and the hit counter grows.
#[tokio::test]
async fn a_repeated_long_prompt_hits_the_prefix_cache_and_gets_a_lower_ttft() {
    // 2,000 prompt tokens at 200 us: a cold prefill of about 400 ms; a warm one computes 1 block.
    let sim = Sim::start(batched(SimConfig { prefill_us_per_token: 200.0, ..SimConfig::default() })).await;
    let body = long_chat(8000, json!({"stream": true, "max_tokens": 4}));
    let (cold, events) = ttft(&sim, body.clone()).await;
    assert_eq!(events.len(), 1 + 4 + 1, "{events:#?}");
    let text = sim.metrics().await;
    let prompt_tokens = metric(&text, "vllm:prompt_tokens_total{model_name=\"sim-model\"}");
    assert!(prompt_tokens > 2000.0, "{prompt_tokens}");
    assert_eq!(metric(&text, QUERIES), prompt_tokens);
    assert_eq!(metric(&text, HITS), 0.0);
    assert_eq!(metric(&text, KV_USAGE), 0.0, "finished requests hold no blocks");

    let (warm, _) = ttft(&sim, body).await;
    let text = sim.metrics().await;
    assert_eq!(metric(&text, QUERIES), 2.0 * prompt_tokens);
    // Every full 16-token block of the rendered prompt but the one with the last token.
    let hits = metric(&text, HITS);
    assert!(hits >= 1900.0 && hits < prompt_tokens, "{hits} of {prompt_tokens}");
    assert!(cold >= Duration::from_millis(400), "cold {cold:?}");
    assert!(warm * 2 < cold, "warm {warm:?} vs cold {cold:?}");

    // `POST /reset_prefix_cache` (vLLM's dev-mode endpoint) empties the idle cache: the same
    // prompt again finds no block; the counters go on.
    let (status, _, bytes) = sim.call(Method::POST, "/reset_prefix_cache", None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(serde_json::from_slice::<Value>(&bytes).unwrap(), json!({"success": true}));
    let body = long_chat(8000, json!({"stream": true, "max_tokens": 4}));
    let (after_reset, _) = ttft(&sim, body).await;
    let text = sim.metrics().await;
    assert_eq!(metric(&text, QUERIES), 3.0 * prompt_tokens);
    assert_eq!(metric(&text, HITS), hits, "no hit after the reset");
    assert!(after_reset >= Duration::from_millis(400), "after the reset {after_reset:?}");
    let (status, _, _) = sim.call(Method::GET, "/reset_prefix_cache", None).await;
    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);

    // Without prefix caching the repeat is as slow as the first.
    let sim2 = Sim::start(batched(SimConfig {
        prefill_us_per_token: 200.0,
        enable_prefix_caching: false,
        ..SimConfig::default()
    }))
    .await;
    let body = long_chat(8000, json!({"stream": true, "max_tokens": 4}));
    let _ = ttft(&sim2, body.clone()).await;
    let (uncached, _) = ttft(&sim2, body).await;
    assert!(uncached >= Duration::from_millis(400), "{uncached:?}");
    assert_eq!(metric(&sim2.metrics().await, HITS), 0.0);
    sim2.shutdown().await;
    sim.shutdown().await;
}

#[tokio::test]
async fn batched_responses_keep_their_shapes() {
    let sim = Sim::start(batched(SimConfig { output_tokens: 4, ..SimConfig::default() })).await;
    let (status, v) = sim.post("/v1/chat/completions", chat(json!({"n": 2}))).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(v["choices"].as_array().unwrap().len(), 2);
    assert_eq!(v["choices"][1]["message"]["content"], "the quick brown fox ");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(
        v["usage"],
        json!({"prompt_tokens": CHAT_PROMPT_TOKENS, "completion_tokens": 8, "total_tokens": CHAT_PROMPT_TOKENS + 8})
    );
    let (_, v) = sim.post("/v1/chat/completions", chat(json!({"max_tokens": 40, "ignore_eos": true}))).await;
    assert_eq!(v["usage"]["completion_tokens"], 40);
    assert_eq!(v["choices"][0]["finish_reason"], "length");

    let body = json!({"model": "sim-model", "prompt": [1, 2, 3], "max_tokens": 2, "stream": true,
        "stream_options": {"include_usage": true}});
    let (status, _, bytes) = sim.call(Method::POST, "/v1/completions", Some(body)).await;
    assert_eq!(status, StatusCode::OK);
    let events = sse_events(&bytes);
    assert_eq!(events.len(), 2 + 1 + 1, "{events:#?}");
    let last: Value = serde_json::from_str(&events[1]).unwrap();
    assert_eq!(last["choices"][0]["text"], "quick ");
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    let usage: Value = serde_json::from_str(&events[2]).unwrap();
    assert_eq!(usage["usage"], json!({"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}));

    // Errors are answered before the engine.
    let (status, _) = sim.post("/v1/chat/completions", chat(json!({"max_tokens": 5000}))).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let text = sim.metrics().await;
    assert_eq!(metric(&text, "vllm:generation_tokens_total{model_name=\"sim-model\"}"), 8.0 + 40.0 + 2.0);
    assert_eq!(metric(&text, "vllm:time_to_first_token_seconds_count{model_name=\"sim-model\"}"), 3.0);
    assert_eq!(metric(&text, RECEIVED), 4.0);
    sim.shutdown().await;
}

/// Queueing at `--max-num-seqs`, KV use while running, and a client going away: its blocks are
/// freed (the waiting request runs) and what it filled stays cached.
#[tokio::test]
async fn queueing_kv_use_and_gone_clients() {
    let sim = Sim::start(batched(SimConfig {
        max_num_seqs: 1,
        num_gpu_blocks: 1000,
        // Long steps: nothing finishes during the test.
        step_base_ms: 1000.0,
        ..SimConfig::default()
    }))
    .await;
    let body = long_chat(4000, json!({"stream": true, "max_tokens": 1000, "ignore_eos": true}));
    let mut first = sim.client().await;
    let first_response = first.send(Method::POST, "/v1/chat/completions", Some(body.clone())).await;
    assert_eq!(first_response.status(), StatusCode::OK);
    let mut second = sim.client().await;
    let second_response =
        second.send(Method::POST, "/v1/chat/completions", Some(chat(json!({"stream": true})))).await;
    let text = sim
        .wait_metrics("one running, one waiting, blocks in use", |t| {
            metric(t, RUNNING) == 1.0 && metric(t, WAITING) == 1.0 && metric(t, KV_USAGE) > 0.0
        })
        .await;
    // About 1,000 prompt tokens: 63 blocks of 16 out of 1000 (the completion's are reserved, not used).
    let usage = metric(&text, KV_USAGE);
    assert!((0.06..0.07).contains(&usage), "{usage}");

    drop(first_response);
    drop(first);
    sim.wait_metrics("second admitted", |t| {
        metric(t, RUNNING) == 1.0 && metric(t, WAITING) == 0.0 && metric(t, ABORTED) == 1.0
    })
    .await;
    drop(second_response);
    drop(second);
    let text = sim.wait_metrics("all gone", |t| metric(t, RUNNING) == 0.0 && metric(t, ABORTED) == 2.0).await;
    assert_eq!(metric(&text, KV_USAGE), 0.0);
    sim.shutdown().await;
}

#[tokio::test]
async fn fail_after_chunks_cuts_batched_streams_and_frees_the_request() {
    let sim = Sim::start(batched(SimConfig { fail_after_chunks: Some(2), ..SimConfig::default() })).await;
    let mut client = sim.client().await;
    let response =
        client.send(Method::POST, "/v1/chat/completions", Some(chat(json!({"stream": true})))).await;
    let mut body = response.into_body();
    let mut received = Vec::new();
    bounded("cut stream", async {
        loop {
            match body.frame().await {
                Some(Ok(frame)) => received.extend_from_slice(frame.data_ref().unwrap()),
                Some(Err(_)) => return,
                None => panic!("stream ended cleanly"),
            }
        }
    })
    .await;
    assert_eq!(sse_events(&received).len(), 3, "role + 2 content chunks");
    let text = sim.wait_metrics("abort counted", |t| metric(t, ABORTED) == 1.0).await;
    assert_eq!(metric(&text, RUNNING), 0.0);
    assert_eq!(metric(&text, KV_USAGE), 0.0);
    sim.shutdown().await;
}

#[tokio::test]
async fn shutdown_fails_waiting_requests() {
    let sim =
        Sim::start(batched(SimConfig { max_num_seqs: 1, step_base_ms: 200.0, ..SimConfig::default() })).await;
    let mut first = sim.client().await;
    let running = tokio::spawn(async move {
        first.send(Method::POST, "/v1/chat/completions", Some(chat(json!({"max_tokens": 2})))).await.status()
    });
    sim.wait_metrics("running", |t| metric(t, RUNNING) == 1.0).await;
    let mut second = sim.client().await;
    let waiting = tokio::spawn(async move {
        second.send(Method::POST, "/v1/chat/completions", Some(chat(json!({})))).await.status()
    });
    sim.wait_metrics("waiting", |t| metric(t, WAITING) == 1.0).await;
    sim.shutdown().await;
    assert_eq!(bounded("waiting answered", waiting).await.unwrap(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(bounded("running answered", running).await.unwrap(), StatusCode::OK);
}

// ---- `POST /v1/responses` (issue 15, item 5): vLLM's Responses API shapes, on both engines.

/// `(event name, data)` of each event of a Responses API stream, checking the framing.
fn typed_events(body: &[u8]) -> Vec<(String, Value)> {
    let text = std::str::from_utf8(body).unwrap();
    assert!(text.ends_with("\n\n") && !text.contains("[DONE]"), "{text:?}");
    text.split_terminator("\n\n")
        .map(|e| {
            let (name, data) = e.split_once('\n').unwrap_or_else(|| panic!("bad event {e:?}"));
            let name = name.strip_prefix("event: ").unwrap().to_owned();
            let data: Value = serde_json::from_str(data.strip_prefix("data: ").unwrap()).unwrap();
            assert_eq!(data["type"], name.as_str());
            (name, data)
        })
        .collect()
}

fn responses(extra: Value) -> Value {
    let mut body = json!({"model": "sim-model", "input": "Hello world!", "instructions": "Be brief."});
    body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    body
}

/// "Be brief." as a system message (2 + 3 + 3) and "Hello world!" as a user message (1 + 3 + 3),
/// plus the generation prompt.
const RESPONSES_PROMPT_TOKENS: u64 = 8 + 7 + 3;

#[tokio::test]
async fn responses_api_shapes_on_both_engines() {
    for engine in [EngineKind::Fixed, EngineKind::Batched] {
        let sim = Sim::start(SimConfig { output_tokens: 4, engine, ..SimConfig::default() }).await;
        let (status, v) = sim.post("/v1/responses", responses(json!({}))).await;
        assert_eq!(status, StatusCode::OK, "{v}");
        assert_eq!((v["object"].as_str(), v["status"].as_str()), (Some("response"), Some("completed")));
        assert!(v["id"].as_str().unwrap().starts_with("resp_"));
        assert_eq!(v["instructions"], "Be brief.");
        assert_eq!(v["output"][0]["content"][0]["text"], "the quick brown fox ");
        let usage = json!({"input_tokens": RESPONSES_PROMPT_TOKENS, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": 4, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": RESPONSES_PROMPT_TOKENS + 4});
        assert_eq!(v["usage"], usage);

        let (status, headers, bytes) = sim
            .call(
                Method::POST,
                "/v1/responses",
                Some(responses(json!({"stream": true, "max_output_tokens": 3}))),
            )
            .await;
        assert_eq!(status, StatusCode::OK);
        assert!(headers["content-type"].to_str().unwrap().starts_with("text/event-stream"));
        let events = typed_events(&bytes);
        let names: Vec<&str> = events.iter().map(|e| e.0.as_str()).collect();
        assert_eq!(names.first(), Some(&"response.created"));
        assert_eq!(names.iter().filter(|n| **n == "response.output_text.delta").count(), 3);
        let (last, completed) = events.last().unwrap();
        assert_eq!(last, "response.completed");
        assert_eq!(completed["response"]["usage"]["input_tokens"], RESPONSES_PROMPT_TOKENS);
        assert_eq!(completed["response"]["usage"]["output_tokens"], 3);
        assert_eq!(completed["response"]["max_output_tokens"], 3);
        assert_eq!(completed["response"]["output"][0]["content"][0]["text"], "the quick brown ");
        for (i, (_, e)) in events.iter().enumerate() {
            assert_eq!(e["sequence_number"], i);
        }
        let text = sim.metrics().await;
        assert_eq!(metric(&text, "vllm:generation_tokens_total{model_name=\"sim-model\"}"), 4.0 + 3.0);
        assert_eq!(metric(&text, RECEIVED), 2.0);
        sim.shutdown().await;
    }
}

/// vLLM's rule for the Responses API: a prompt that fills the context is refused; a
/// `max_output_tokens` beyond what the context leaves is capped, not refused.
#[tokio::test]
async fn responses_api_context_rule() {
    let sim = Sim::start(SimConfig { max_model_len: 40, output_tokens: 1000, ..SimConfig::default() }).await;
    // 18 prompt tokens: 22 left.
    let (status, v) =
        sim.post("/v1/responses", responses(json!({"max_output_tokens": 30, "ignore_eos": true}))).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["usage"]["output_tokens"], 40 - RESPONSES_PROMPT_TOKENS);
    // The same on chat is refused.
    let (status, _) =
        sim.post("/v1/chat/completions", chat(json!({"max_tokens": 40 - CHAT_PROMPT_TOKENS + 1}))).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    // The user role (1), its template (3) and the generation prompt (3) with 33 tokens of text:
    // 40, the whole context.
    let fill = "abcd".repeat(33);
    let (status, v) =
        sim.post("/v1/responses", json!({"model": "sim-model", "input": fill, "max_output_tokens": 1})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
    assert_eq!(v["error"]["type"], "BadRequestError");
    let (status, _) =
        sim.post("/v1/responses", json!({"model": "sim-model", "input": "abcd".repeat(32)})).await;
    assert_eq!(status, StatusCode::OK);
    let (status, _) = sim.post("/v1/responses", responses(json!({"max_output_tokens": 0}))).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let (status, _) = sim.post("/v1/responses", json!({"model": "sim-model"})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let (status, _, _) = sim.call(Method::GET, "/v1/responses", None).await;
    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);
    sim.shutdown().await;
}

#[tokio::test]
async fn responses_api_streams_are_cut_by_fail_after_chunks() {
    let sim = Sim::start(SimConfig { fail_after_chunks: Some(2), ..SimConfig::default() }).await;
    let mut client = sim.client().await;
    let response = client.send(Method::POST, "/v1/responses", Some(responses(json!({"stream": true})))).await;
    assert_eq!(response.status(), StatusCode::OK);
    let mut body = response.into_body();
    let mut received = Vec::new();
    bounded("cut stream", async {
        loop {
            match body.frame().await {
                Some(Ok(frame)) => received.extend_from_slice(frame.data_ref().unwrap()),
                Some(Err(_)) => return,
                None => panic!("stream ended cleanly"),
            }
        }
    })
    .await;
    let events = typed_events(&received);
    let names: Vec<&str> = events.iter().map(|e| e.0.as_str()).collect();
    assert_eq!(
        names,
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.delta"
        ]
    );
    sim.shutdown().await;
}
