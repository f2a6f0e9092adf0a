//! Minimal HTTP/1.1 streaming client on hyper 1 with connection reuse.
//!
//! Each point owns a [`ConnPool`]: a LIFO stack of idle keep-alive
//! connections (`hyper::client::conn::http1`). A request takes an idle
//! connection or dials a new one (`TCP_NODELAY`), and returns it only after
//! the response body has been read to the end, so at most
//! `max_concurrency` connections exist. A request that fails on a *reused*
//! connection before it was written (server closed the idle connection) is
//! retried once on a fresh connection, like hyper-util's legacy client.
//!
//! Only `http://` is supported (TLS would be terminated by Envoy in front).

use crate::error::BenchError;
use crate::metrics::{classify_status, ErrorClass, RequestOutcome};
use crate::sse::SseParser;
use crate::workload::PreparedRequest;
use bytes::Bytes;
use http::header::{HeaderValue, AUTHORIZATION, CONTENT_TYPE, HOST};
use http::{Method, Request, Uri};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use std::sync::Mutex;
use std::time::{Duration, Instant};
use tokio::net::TcpStream;

/// Largest error body read to classify a non-2xx response (bytes).
const MAX_ERROR_BODY: usize = 64 * 1024;

/// Parsed `--base-url`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// Host name or IP literal (without brackets).
    pub host: String,
    /// TCP port (default 80).
    pub port: u16,
    /// `Host` header value (`host[:port]` as written in the URL).
    pub authority: String,
    /// Path prefix without trailing slash (often empty).
    pub path_prefix: String,
}

impl Target {
    /// Parses `http://host[:port][/prefix]`.
    pub fn parse(base_url: &str) -> Result<Self, BenchError> {
        let bad = |m: &str| BenchError::InvalidArgument(format!("--base-url {base_url:?}: {m}"));
        let uri: Uri = base_url.parse().map_err(|_| bad("not a URL"))?;
        match uri.scheme_str() {
            Some("http") => {}
            Some(_) => return Err(bad("only http:// is supported")),
            None => return Err(bad("missing http:// scheme")),
        }
        let auth = uri.authority().ok_or_else(|| bad("missing host"))?;
        let host = auth.host().trim_start_matches('[').trim_end_matches(']').to_string();
        if host.is_empty() {
            return Err(bad("missing host"));
        }
        Ok(Self {
            host,
            port: auth.port_u16().unwrap_or(80),
            authority: auth.as_str().to_string(),
            path_prefix: uri.path().trim_end_matches('/').to_string(),
        })
    }
}

type Sender = SendRequest<Full<Bytes>>;

/// Idle keep-alive connections to one target.
pub struct ConnPool {
    host: String,
    port: u16,
    idle: Mutex<Vec<Sender>>,
}

impl ConnPool {
    /// Creates an empty pool for `target`.
    pub fn new(target: &Target) -> Self {
        Self { host: target.host.clone(), port: target.port, idle: Mutex::new(Vec::new()) }
    }

    /// Number of idle connections (for tests/diagnostics).
    pub fn idle_len(&self) -> usize {
        self.idle.lock().map_or(0, |v| v.len())
    }

    fn pop_idle(&self) -> Option<Sender> {
        self.idle.lock().unwrap_or_else(|e| e.into_inner()).pop()
    }

    fn release(&self, s: Sender) {
        if !s.is_closed() {
            self.idle.lock().unwrap_or_else(|e| e.into_inner()).push(s);
        }
    }

    /// An idle ready connection (reused = true) or a new one.
    async fn acquire(&self) -> Result<(Sender, bool), ()> {
        while let Some(mut s) = self.pop_idle() {
            if s.is_closed() {
                continue;
            }
            if s.ready().await.is_ok() {
                return Ok((s, true));
            }
        }
        self.connect().await.map(|s| (s, false))
    }

    async fn connect(&self) -> Result<Sender, ()> {
        let stream = TcpStream::connect((self.host.as_str(), self.port)).await.map_err(|_| ())?;
        let _ = stream.set_nodelay(true);
        let (sender, conn) =
            hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.map_err(|_| ())?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok(sender)
    }
}

/// Everything needed to send requests of one point.
pub struct RequestContext {
    pool: ConnPool,
    uri: Uri,
    host: HeaderValue,
    auth: Option<HeaderValue>,
    timeout: Duration,
}

impl RequestContext {
    /// Builds the context for `target` + `path` with an optional bearer key.
    pub fn new(
        target: &Target,
        path: &str,
        api_key: Option<&str>,
        timeout: Duration,
    ) -> Result<Self, BenchError> {
        let bad = |m: String| BenchError::InvalidArgument(m);
        let uri: Uri = format!("{}{}", target.path_prefix, path)
            .parse()
            .map_err(|e| bad(format!("request path: {e}")))?;
        let host = HeaderValue::from_str(&target.authority).map_err(|e| bad(format!("host: {e}")))?;
        let auth = api_key
            .map(|k| HeaderValue::from_str(&format!("Bearer {k}")))
            .transpose()
            .map_err(|_| bad("--api-key contains invalid header characters".into()))?;
        Ok(Self { pool: ConnPool::new(target), uri, host, auth, timeout })
    }

    /// The connection pool (shared by all requests of the point).
    pub fn pool(&self) -> &ConnPool {
        &self.pool
    }

    fn build(&self, body: Bytes) -> Result<Request<Full<Bytes>>, http::Error> {
        let mut b = Request::builder()
            .method(Method::POST)
            .uri(self.uri.clone())
            .header(HOST, self.host.clone())
            .header(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        if let Some(a) = &self.auth {
            b = b.header(AUTHORIZATION, a.clone());
        }
        b.body(Full::new(body))
    }

    /// Sends one streaming request and measures it. Never fails: every
    /// problem becomes an [`ErrorClass`] in the outcome.
    pub async fn execute(&self, req: &PreparedRequest) -> RequestOutcome {
        let start = Instant::now();
        match tokio::time::timeout(self.timeout, self.execute_inner(req, start)).await {
            Ok(o) => o,
            Err(_) => RequestOutcome::failed(ErrorClass::Timeout, None, start.elapsed()),
        }
    }

    async fn execute_inner(&self, req: &PreparedRequest, start: Instant) -> RequestOutcome {
        let fail = |class, status| RequestOutcome::failed(class, status, start.elapsed());
        let Ok((mut sender, mut reused)) = self.pool.acquire().await else {
            return fail(ErrorClass::Connection, None);
        };
        let resp = loop {
            let Ok(request) = self.build(req.body.clone()) else {
                return fail(ErrorClass::Connection, None);
            };
            match sender.send_request(request).await {
                Ok(r) => break r,
                Err(e) if reused && (e.is_canceled() || e.is_closed()) => {
                    reused = false;
                    match self.pool.connect().await {
                        Ok(s) => sender = s,
                        Err(()) => return fail(ErrorClass::Connection, None),
                    }
                }
                Err(_) => return fail(ErrorClass::Connection, None),
            }
        };
        let status = resp.status().as_u16();
        let queue_wait_ms = resp
            .headers()
            .get(gateway_contract::H_QUEUE_WAIT_MS)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok());
        let mut body = resp.into_body();

        if !resp_is_success(status) {
            let mut buf = Vec::new();
            let mut complete = false;
            loop {
                match body.frame().await {
                    None => {
                        complete = true;
                        break;
                    }
                    Some(Err(_)) => break,
                    Some(Ok(f)) => {
                        if let Some(d) = f.data_ref() {
                            let room = MAX_ERROR_BODY.saturating_sub(buf.len());
                            buf.extend_from_slice(d.get(..room.min(d.len())).unwrap_or_default());
                            if buf.len() >= MAX_ERROR_BODY {
                                break;
                            }
                        }
                    }
                }
            }
            if complete {
                self.pool.release(sender);
            }
            return RequestOutcome { queue_wait_ms, ..fail(classify_status(status, &buf), Some(status)) };
        }

        let mut parser = SseParser::new();
        let mut itl_us = Vec::with_capacity(usize::try_from(req.max_tokens).unwrap_or(0).min(16_384));
        let mut ttft = None;
        let mut last = start;
        let mut body_ok = true;
        let mut on_tokens = |n: u32, now: Instant, ttft: &mut Option<Duration>, itl_us: &mut Vec<u64>| {
            for _ in 0..n {
                if ttft.is_none() {
                    *ttft = Some(now.duration_since(start));
                } else {
                    itl_us.push(u64::try_from(now.duration_since(last).as_micros()).unwrap_or(u64::MAX));
                }
                last = now;
            }
        };
        loop {
            match body.frame().await {
                Some(Ok(frame)) => {
                    if let Some(data) = frame.data_ref() {
                        let n = parser.feed(data);
                        if n > 0 {
                            on_tokens(n, Instant::now(), &mut ttft, &mut itl_us);
                        }
                    }
                }
                Some(Err(_)) => {
                    body_ok = false;
                    break;
                }
                None => break,
            }
        }
        let end = Instant::now();
        let n = parser.finish();
        if n > 0 {
            on_tokens(n, end, &mut ttft, &mut itl_us);
        }
        if body_ok {
            self.pool.release(sender);
        }
        let class = if body_ok && parser.done() && !parser.error_event() {
            ErrorClass::Ok
        } else {
            ErrorClass::StreamTruncated
        };
        let usage = parser.usage();
        RequestOutcome {
            class,
            status: Some(status),
            ttft,
            e2e: end.duration_since(start),
            itl_us,
            prompt_tokens: usage.and_then(|u| u.prompt_tokens).unwrap_or(req.prompt_words),
            completion_tokens: usage.and_then(|u| u.completion_tokens).unwrap_or(parser.content_events()),
            usage_reported: usage.is_some(),
            sse_parse_errors: parser.parse_errors(),
            queue_wait_ms,
        }
    }
}

fn resp_is_success(status: u16) -> bool {
    (200..300).contains(&status)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_base_urls() {
        let t = Target::parse("http://127.0.0.1:8080").unwrap();
        assert_eq!(
            (t.host.as_str(), t.port, t.authority.as_str(), t.path_prefix.as_str()),
            ("127.0.0.1", 8080, "127.0.0.1:8080", "")
        );
        let t = Target::parse("http://gw.local/openai/").unwrap();
        assert_eq!((t.host.as_str(), t.port, t.path_prefix.as_str()), ("gw.local", 80, "/openai"));
        let t = Target::parse("http://[::1]:9000").unwrap();
        assert_eq!((t.host.as_str(), t.port), ("::1", 9000));
        assert!(Target::parse("https://x").is_err());
        assert!(Target::parse("127.0.0.1:80").is_err());
    }
}
