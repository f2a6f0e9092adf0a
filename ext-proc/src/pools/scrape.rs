//! The HTTP adapter to each endpoint's vLLM metrics: one GET per endpoint and round, the filtered
//! path first ([`signals::FILTERED_METRICS_PATH`]), `/metrics` for an endpoint that ignores it.
//! What the text means is [`crate::pools::signals`]'s; when to scrape is [`crate::pools`]'.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use tracing::{debug, info};

use crate::pools::signals;

/// The client every scrape round of a process shares (plain HTTP, no body).
pub(crate) type MetricsClient = Client<HttpConnector, Empty<Bytes>>;

/// One endpoint's metrics text, and whether it came from [`signals::FILTERED_METRICS_PATH`];
/// None when the endpoint did not answer.
///
/// An endpoint is asked for the filtered path first. When it answers that with a non-2xx status
/// or without vLLM's gauges ([`signals::is_vllm_metrics`]: a server that is not vLLM's
/// prometheus_client), it is asked for `/metrics` at once, and then only for `/metrics` until
/// that fails (`unfiltered`, the endpoint's flag). An endpoint that does not answer at all (refused,
/// timed out) is not asked twice in a round.
pub(crate) async fn fetch_metrics(
    client: &MetricsClient,
    endpoint: &str,
    unfiltered: Option<&AtomicBool>,
    timeout: Duration,
) -> Option<(String, bool)> {
    let base = endpoint.trim_end_matches('/');
    if !unfiltered.is_some_and(|flag| flag.load(Ordering::Relaxed)) {
        match fetch(client, &format!("{base}{}", signals::FILTERED_METRICS_PATH.as_str()), timeout).await {
            Ok(text) if signals::is_vllm_metrics(&text) => return Some((text, true)),
            Ok(_) | Err(FetchFailure::Status) => {}
            Err(FetchFailure::NoAnswer) => return None,
        }
    }
    let text = fetch(client, &format!("{base}/metrics"), timeout).await.ok();
    if let Some(flag) = unfiltered {
        if text.is_some() && !flag.swap(true, Ordering::Relaxed) {
            info!(endpoint, "endpoint ignores the name[] filter of /metrics/: scraping its whole /metrics");
        }
        if text.is_none() {
            flag.store(false, Ordering::Relaxed);
        }
    }
    text.map(|text| (text, false))
}

/// Why [`fetch`] got no text.
enum FetchFailure {
    /// No answer: refused, reset, timed out, or a body that is not UTF-8.
    NoAnswer,
    /// An answer with a non-2xx status.
    Status,
}

async fn fetch(client: &MetricsClient, url: &str, timeout: Duration) -> Result<String, FetchFailure> {
    let uri: hyper::Uri = url.parse().map_err(|_| FetchFailure::NoAnswer)?;
    let work = async {
        let response = client.get(uri).await.map_err(|_| FetchFailure::NoAnswer)?;
        if !response.status().is_success() {
            return Err(FetchFailure::Status);
        }
        let body = response.into_body().collect().await.map_err(|_| FetchFailure::NoAnswer)?.to_bytes();
        String::from_utf8(body.to_vec()).map_err(|_| FetchFailure::NoAnswer)
    };
    match tokio::time::timeout(timeout, work).await {
        Ok(text) => text,
        Err(_) => {
            debug!(url, "scrape timed out");
            Err(FetchFailure::NoAnswer)
        }
    }
}
