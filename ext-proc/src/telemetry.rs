//! OpenTelemetry traces of the admission (`tracing` in the config): the sidecar's `tracing` spans
//! (`admission` and its children `rate_limit`, `exact_count`, `queue`) bridged by
//! `tracing-opentelemetry` and exported over OTLP/gRPC in batches, off the request path. Envoy's
//! ext_proc call carries its span's W3C trace context (`traceparent` in the gRPC metadata), which
//! [`parent_context`] reads, so the admission is a child of Envoy's request span and the whole
//! request is one trace (Envoy's spans, the sidecar's, and vLLM's, which gets the same
//! `traceparent` from Envoy).

use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider, Tracer};
use opentelemetry_sdk::Resource;

use crate::config::TracingConfig;

/// Why the exporter could not be built.
#[derive(Debug, thiserror::Error)]
#[error("tracing.otlp_endpoint: {0}")]
pub struct TelemetryError(String);

/// The tracer provider; [`Telemetry::shutdown`] exports what is buffered.
pub struct Telemetry {
    provider: SdkTracerProvider,
}

impl Telemetry {
    /// Builds the OTLP/gRPC exporter and a provider that samples by the parent's decision, else
    /// `sampling_ratio` of the traces that start here. Needs a Tokio runtime (the exporter's
    /// channel); connects lazily.
    ///
    /// # Errors
    /// [`TelemetryError`] when the endpoint is not a usable URI.
    pub fn new(config: &TracingConfig) -> Result<Self, TelemetryError> {
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_endpoint(config.otlp_endpoint.clone())
            .build()
            .map_err(|e| TelemetryError(e.to_string()))?;
        let sampler = Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(config.sampling_ratio)));
        let provider = SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_sampler(sampler)
            .with_resource(Resource::builder().with_service_name(config.service_name.clone()).build())
            .build();
        Ok(Self { provider })
    }

    /// The tracer the `tracing-opentelemetry` layer writes to.
    pub fn tracer(&self) -> Tracer {
        self.provider.tracer("gateway-ext-proc")
    }

    /// Exports the buffered spans and stops the exporter.
    pub fn shutdown(&self) {
        if let Err(e) = self.provider.shutdown() {
            tracing::warn!(error = %e, "tracing: exporter shutdown");
        }
    }
}

/// The trace context (W3C `traceparent`, `tracestate`) of a gRPC call's metadata, or an empty
/// context when it carries none.
pub fn parent_context(metadata: &tonic::metadata::MetadataMap) -> opentelemetry::Context {
    TraceContextPropagator::new().extract(&MetadataExtractor(metadata))
}

struct MetadataExtractor<'a>(&'a tonic::metadata::MetadataMap);

impl Extractor for MetadataExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0
            .keys()
            .filter_map(|k| match k {
                tonic::metadata::KeyRef::Ascii(k) => Some(k.as_str()),
                tonic::metadata::KeyRef::Binary(_) => None,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use opentelemetry::trace::TraceContextExt;

    use super::*;

    #[test]
    fn reads_envoys_traceparent_from_the_grpc_metadata() {
        let mut m = tonic::metadata::MetadataMap::new();
        m.insert("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".parse().unwrap());
        let cx = parent_context(&m);
        let span = cx.span();
        let sc = span.span_context();
        assert!(sc.is_valid() && sc.is_sampled() && sc.is_remote());
        assert_eq!(sc.trace_id().to_string(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(sc.span_id().to_string(), "00f067aa0ba902b7");
        assert!(!parent_context(&tonic::metadata::MetadataMap::new()).span().span_context().is_valid());
    }
}
