//! End-to-end tests against a tiny in-process OpenAI-compatible streaming
//! server (hyper, 127.0.0.1, port 0).

// Test helpers outside #[test] fns are not covered by clippy.toml's
// allow-*-in-tests settings.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use bytes::Bytes;
use clap::Parser;
use gateway_bench::client::Target;
use gateway_bench::config::{Endpoint, LoadSpec};
use gateway_bench::workload::{Workload, WorkloadSpec};
use gateway_bench::{run_cli, run_point, Cli, PointConfig};
use http_body_util::BodyExt;
use hyper::body::{Body, Frame};
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use serde_json::Value;
use std::collections::VecDeque;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

/// How the test server answers.
#[derive(Clone, Copy, PartialEq)]
enum Mode {
    /// Every request streams `tokens` tokens, usage and `[DONE]`.
    Ok,
    /// Request n (in arrival order) gets, by n % 5: 429 overloaded,
    /// 429 quota, 500, a stream without `[DONE]`, a normal stream.
    Mixed,
}

#[derive(Default)]
struct ServerStats {
    requests: AtomicU64,
    connections: AtomicU64,
    last_body: Mutex<Option<Value>>,
    last_auth: Mutex<Option<String>>,
}

/// Response body yielding pre-built frames, optionally `delay` apart.
struct SseBody {
    frames: VecDeque<Bytes>,
    delay: Duration,
    sleep: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl Body for SseBody {
    type Data = Bytes;
    type Error = Infallible;
    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if self.frames.is_empty() {
            return Poll::Ready(None);
        }
        if !self.delay.is_zero() {
            let delay = self.delay;
            let sleep = self.sleep.get_or_insert_with(|| Box::pin(tokio::time::sleep(delay)));
            if sleep.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            self.sleep = None;
        }
        Poll::Ready(self.frames.pop_front().map(|b| Ok(Frame::data(b))))
    }
}

fn chunk(chat: bool, text: &str, finish: Option<&str>) -> Bytes {
    let choice = if chat {
        serde_json::json!({"index": 0, "delta": {"content": text}, "logprobs": null, "finish_reason": finish})
    } else {
        serde_json::json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish})
    };
    let v = serde_json::json!({"id": "cmpl-test", "object": "chunk", "created": 0, "model": "test",
                               "choices": [choice], "usage": null});
    Bytes::from(format!("data: {v}\n\n"))
}

fn stream_frames(chat: bool, prompt_tokens: u64, tokens: u64, done: bool) -> VecDeque<Bytes> {
    let mut f = VecDeque::new();
    if chat {
        f.push_back(Bytes::from_static(
            b"data: {\"id\":\"cmpl-test\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n",
        ));
    }
    for i in 0..tokens {
        let finish = (i + 1 == tokens).then_some("length");
        f.push_back(chunk(chat, &format!("tok{i} "), finish));
    }
    if done {
        let usage = serde_json::json!({"id": "cmpl-test", "choices": [], "usage":
            {"prompt_tokens": prompt_tokens, "completion_tokens": tokens, "total_tokens": prompt_tokens + tokens}});
        f.push_back(Bytes::from(format!("data: {usage}\n\n")));
        f.push_back(Bytes::from_static(b"data: [DONE]\n\n"));
    }
    f
}

fn error_response(status: u16, code: &str) -> Response<SseBody> {
    let body = serde_json::json!({"error": {"message": "nope", "type": "error", "code": code}}).to_string();
    let mut r = Response::new(SseBody {
        frames: VecDeque::from([Bytes::from(body)]),
        delay: Duration::ZERO,
        sleep: None,
    });
    *r.status_mut() = hyper::StatusCode::from_u16(status).unwrap();
    r
}

async fn handle(
    req: Request<hyper::body::Incoming>,
    mode: Mode,
    delay: Duration,
    stats: Arc<ServerStats>,
) -> Result<Response<SseBody>, Infallible> {
    let n = stats.requests.fetch_add(1, Ordering::Relaxed);
    let chat = req.uri().path() == "/v1/chat/completions";
    let auth = req.headers().get("authorization").and_then(|v| v.to_str().ok()).map(str::to_string);
    let body = req.into_body().collect().await.unwrap().to_bytes();
    let v: Value = serde_json::from_slice(&body).unwrap();
    let prompt = if chat { v["messages"][0]["content"].as_str() } else { v["prompt"].as_str() };
    let prompt_tokens = prompt.unwrap_or("").split_whitespace().count() as u64;
    let tokens = v["max_tokens"].as_u64().unwrap_or(4);
    *stats.last_body.lock().unwrap() = Some(v);
    *stats.last_auth.lock().unwrap() = auth;
    let frames = match (mode, n % 5) {
        (Mode::Mixed, 0) => return Ok(error_response(429, "overloaded")),
        (Mode::Mixed, 1) => return Ok(error_response(429, "tokens_per_minute_quota_exceeded")),
        (Mode::Mixed, 2) => return Ok(error_response(500, "internal")),
        (Mode::Mixed, 3) => stream_frames(chat, prompt_tokens, tokens, false),
        _ => stream_frames(chat, prompt_tokens, tokens, true),
    };
    let mut r = Response::new(SseBody { frames, delay, sleep: None });
    r.headers_mut().insert("content-type", "text/event-stream".parse().unwrap());
    Ok(r)
}

/// Starts the server on its own thread and runtime; returns its port.
fn start_server(mode: Mode, delay: Duration) -> (u16, Arc<ServerStats>) {
    let stats = Arc::new(ServerStats::default());
    let s = stats.clone();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            tx.send(listener.local_addr().unwrap().port()).unwrap();
            loop {
                let (stream, _) = listener.accept().await.unwrap();
                let _ = stream.set_nodelay(true);
                s.connections.fetch_add(1, Ordering::Relaxed);
                let s = s.clone();
                tokio::spawn(async move {
                    let svc = service_fn(move |req| handle(req, mode, delay, s.clone()));
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
    });
    (rx.recv().unwrap(), stats)
}

fn tmp(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("gateway-bench-it-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("not a number: {v}"))
}

#[test]
fn concurrency_sweep_writes_consistent_json_csv_and_svg() {
    let (port, stats) = start_server(Mode::Ok, Duration::from_micros(500));
    let (json, csv, svg) = (tmp("out.json"), tmp("out.csv"), tmp("out.svg"));
    let port_s = port.to_string();
    let base = format!("http://127.0.0.1:{port_s}");
    let cli = Cli::try_parse_from([
        "gateway-bench",
        "--base-url",
        &base,
        "--model",
        "test-model",
        "--api-key",
        "sk-test",
        "--sweep-concurrency",
        "4,1",
        "--num-prompts",
        "20",
        "--warmup",
        "2",
        "--seed",
        "7",
        "--input-len",
        "16",
        "--output-len",
        "8",
        "--timeout-s",
        "30",
        "--no-progress",
        "--slo-ttft-p99-ms",
        "10000",
        "--daily-volume",
        "1000000",
        "--headroom",
        "1.2",
        "--output-json",
        json.to_str().unwrap(),
        "--output-csv",
        csv.to_str().unwrap(),
        "--plot",
        svg.to_str().unwrap(),
    ])
    .unwrap();
    run_cli(&cli).unwrap();

    // The server saw every request (2 points × (20 + 2 warmup)), over reused connections.
    assert_eq!(stats.requests.load(Ordering::Relaxed), 44);
    let conns = stats.connections.load(Ordering::Relaxed);
    assert!((2..=5).contains(&conns), "connections: {conns}");
    let body = stats.last_body.lock().unwrap().clone().unwrap();
    assert_eq!(body["model"], "test-model");
    assert_eq!(body["stream"], true);
    assert_eq!(body["stream_options"]["include_usage"], true);
    assert_eq!(body["max_tokens"], 8);
    assert_eq!(body["ignore_eos"], true);
    assert_eq!(body["messages"][0]["role"], "user");
    assert_eq!(stats.last_auth.lock().unwrap().as_deref(), Some("Bearer sk-test"));

    let v: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(v["tool"], "gateway-bench");
    let cfg = &v["config"];
    for k in [
        "base_url",
        "endpoint",
        "model",
        "api_key",
        "workload",
        "num_prompts",
        "warmup",
        "seed",
        "duration_s",
        "timeout_s",
        "threads",
        "load",
        "sweep",
        "slo",
        "capacity",
    ] {
        assert!(cfg.get(k).is_some(), "config.{k} missing");
    }
    assert_eq!(cfg["api_key"], "<redacted>");
    assert_eq!(cfg["endpoint"], "/v1/chat/completions");
    assert_eq!(cfg["sweep"]["kind"], "concurrency");
    assert_eq!(cfg["sweep"]["values"], serde_json::json!([1, 4]));

    let points = v["points"].as_array().unwrap();
    assert_eq!(points.len(), 2);
    for (p, (label, conc)) in points.iter().zip([("c=1", 1), ("c=4", 4)]) {
        assert_eq!(p["label"], label);
        assert_eq!(p["max_concurrency"], conc);
        assert!(p["request_rate"].is_null());
        for k in [
            "burstiness",
            "burst_size",
            "burst_interval_s",
            "duration_s",
            "sent",
            "completed",
            "failed",
            "request_throughput",
            "output_throughput",
            "total_token_throughput",
            "success_rate",
            "rate_limited_rate",
            "rate_limited_quota_rate",
            "rate_limited_overload_rate",
            "total_prompt_tokens",
            "total_completion_tokens",
            "requests_without_usage",
            "sse_parse_errors",
            "errors",
            "status_codes",
            "ttft_ms",
            "itl_ms",
            "tpot_ms",
            "e2e_ms",
        ] {
            assert!(p.get(k).is_some(), "{label}: {k} missing");
        }
        let (sent, completed, failed) =
            (p["sent"].as_u64().unwrap(), p["completed"].as_u64().unwrap(), p["failed"].as_u64().unwrap());
        assert_eq!(completed + failed, sent);
        assert_eq!(sent, 20);
        assert_eq!(completed, 20, "{p}");
        let errors = p["errors"].as_object().unwrap();
        assert_eq!(errors.len(), 8);
        assert_eq!(errors.values().map(|e| e.as_u64().unwrap()).sum::<u64>(), sent);
        assert_eq!(p["status_codes"]["200"], 20);
        assert_eq!(p["total_completion_tokens"], 20 * 8);
        assert_eq!(p["total_prompt_tokens"], 20 * 16);
        assert_eq!(p["requests_without_usage"], 0);
        assert!(f(&p["duration_s"]) > 0.0);
        assert!(f(&p["request_throughput"]) > 0.0);
        assert!(f(&p["output_throughput"]) > 0.0);
        assert!(f(&p["total_token_throughput"]) > f(&p["output_throughput"]));
        let expect_rps = completed as f64 / f(&p["duration_s"]);
        assert!((f(&p["request_throughput"]) - expect_rps).abs() < 1e-6 * expect_rps);
        assert_eq!(f(&p["success_rate"]), 1.0);
        assert_eq!(f(&p["rate_limited_rate"]), 0.0);
        for (m, count) in [("ttft_ms", 20), ("itl_ms", 20 * 7), ("tpot_ms", 20), ("e2e_ms", 20)] {
            let s = &p[m];
            assert_eq!(s["count"], count, "{label} {m}");
            let (p50, p90, p99, max, mean) =
                (f(&s["p50_ms"]), f(&s["p90_ms"]), f(&s["p99_ms"]), f(&s["max_ms"]), f(&s["mean_ms"]));
            assert!(p50 <= p90 && p90 <= p99 && p99 <= max, "{label} {m}: {s}");
            assert!(mean > 0.0 && mean <= max, "{label} {m}: {s}");
        }
        // The server sleeps ≥ 0.5 ms before each of its 11 frames.
        assert!(f(&p["e2e_ms"]["p50_ms"]) >= f(&p["ttft_ms"]["p50_ms"]));
        assert!(f(&p["e2e_ms"]["p50_ms"]) >= 5.0, "{}", p["e2e_ms"]);
    }

    // SLO (generous) is met; capacity follows the formula.
    let slo = &v["slo"];
    assert_eq!(slo["met"], true);
    let rate = f(&slo["max_sustained_rate"]);
    let best = points.iter().map(|p| f(&p["request_throughput"])).fold(0.0, f64::max);
    assert_eq!(rate, best);
    let cap = &v["capacity"];
    assert_eq!(cap["rate_basis"], "slo");
    assert_eq!(f(&cap["per_node_rate"]), rate);
    let expect_nodes = (1_000_000.0 / 86_400.0 / rate * 1.2 - 1e-9).ceil() as u64;
    assert_eq!(cap["nodes"].as_u64().unwrap(), expect_nodes);
    assert!(v.get("knee").is_some());

    let csv_text = std::fs::read_to_string(&csv).unwrap();
    let lines: Vec<&str> = csv_text.lines().collect();
    assert_eq!(lines.len(), 3);
    assert!(lines[0].starts_with("label,max_concurrency,request_rate"));
    assert!(lines[1].starts_with("c=1,1,inf"));
    let svg_text = std::fs::read_to_string(&svg).unwrap();
    assert!(svg_text.contains("<svg") && svg_text.contains("TTFT p99"));
    std::fs::remove_dir_all(json.parent().unwrap()).unwrap();
}

fn point_config(port: u16, endpoint: Endpoint, n: u64, load: LoadSpec) -> PointConfig {
    let spec = WorkloadSpec::Random { input_len: 8, output_len: 6, ignore_eos: true };
    let w = Workload::load(&spec, endpoint, "test", true).unwrap();
    PointConfig {
        target: Target::parse(&format!("http://127.0.0.1:{port}")).unwrap(),
        endpoint,
        api_key: None,
        load,
        requests: w.requests_for_point(n, 3).unwrap(),
        num_prompts: n,
        warmup: 0,
        duration: None,
        timeout: Duration::from_secs(30),
        seed: 3,
        progress: false,
    }
}

fn load(max_concurrency: Option<u32>, request_rate: Option<f64>) -> LoadSpec {
    LoadSpec {
        label: "t".into(),
        max_concurrency,
        request_rate,
        burstiness: 1.0,
        burst_size: None,
        burst_interval_s: None,
    }
}

#[test]
fn error_classes_and_poisson_point_via_library() {
    let (port, stats) = start_server(Mode::Mixed, Duration::ZERO);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let cfg = point_config(port, Endpoint::Completions, 20, load(Some(2), Some(400.0)));
    let r = rt.block_on(run_point(&cfg)).unwrap();
    let s = &r.stats;
    assert_eq!(stats.requests.load(Ordering::Relaxed), 20);
    assert_eq!((s.sent, s.completed, s.failed), (20, 4, 16));
    assert_eq!(s.errors.rate_limited_overload, 4);
    assert_eq!(s.errors.rate_limited_quota, 4);
    assert_eq!(s.errors.http_5xx, 4);
    assert_eq!(s.errors.stream_truncated, 4);
    assert_eq!(s.status_codes.get("429"), Some(&8));
    assert_eq!(s.status_codes.get("200"), Some(&8));
    assert_eq!(s.rate_limited_rate, 0.4);
    assert_eq!(s.rate_limited_overload_rate, 0.2);
    assert_eq!(s.total_completion_tokens, 4 * 6);
    assert_eq!(s.ttft_ms.count, 4);
    // Error bodies are drained, so connections stay reusable.
    assert!(stats.connections.load(Ordering::Relaxed) <= 2);
    let prompt = stats.last_body.lock().unwrap().clone().unwrap();
    assert!(prompt["prompt"].is_string());
}

#[test]
fn unreachable_target_counts_connection_errors() {
    // Bind then drop a listener to get a port with nothing behind it.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let cfg = point_config(port, Endpoint::Chat, 5, load(Some(2), None));
    let r = rt.block_on(run_point(&cfg)).unwrap();
    assert_eq!((r.stats.sent, r.stats.failed, r.stats.errors.connection), (5, 5, 5));
    assert_eq!(r.stats.ttft_ms.p99_ms, None);
}

/// Throughput of the load generator itself on one runtime thread against a
/// zero-delay local server (16 output tokens). Run with
/// `cargo test -p gateway-bench --release --test sweep -- --ignored --nocapture`.
#[test]
#[ignore]
fn generator_throughput_single_thread() {
    let (port, _stats) = start_server(Mode::Ok, Duration::ZERO);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let n = 50_000;
    let mut cfg = point_config(port, Endpoint::Chat, n, load(Some(64), None));
    let spec = WorkloadSpec::Random { input_len: 16, output_len: 16, ignore_eos: true };
    cfg.requests =
        Workload::load(&spec, Endpoint::Chat, "test", true).unwrap().requests_for_point(n, 1).unwrap();
    cfg.warmup = 1000;
    let r = rt.block_on(run_point(&cfg)).unwrap();
    println!(
        "sent {} completed {} in {:.2}s = {:.0} req/s, {:.0} output tok/s, ttft p50 {:?} ms",
        r.stats.sent,
        r.stats.completed,
        r.stats.duration_s,
        r.stats.request_throughput,
        r.stats.output_throughput,
        r.stats.ttft_ms.p50_ms
    );
    assert_eq!(r.stats.completed, n);
}
