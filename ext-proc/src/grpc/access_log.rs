//! The tonic adapter of Envoy's gRPC access log service (`envoy.service.accesslog.v3`,
//! `StreamAccessLogs`), the metering path: Envoy's `envoy.access_loggers.http_grpc` logger sends
//! one `HTTPAccessLogEntry` per finished HTTP stream (batched per worker, off the request path).
//! What an entry asks of the ledger is [`crate::metering::access_log`]'s reading; this service
//! hands a record to [`crate::metering::finish::finish`], a release to
//! [`crate::admission::pipeline::release`], and a finished pick back to the pool's picker.

use std::sync::Arc;

use envoy_types::pb::envoy::service::accesslog::v3::access_log_service_server::AccessLogService;
use envoy_types::pb::envoy::service::accesslog::v3::stream_access_logs_message::LogEntries;
use envoy_types::pb::envoy::service::accesslog::v3::{StreamAccessLogsMessage, StreamAccessLogsResponse};
use gateway_meter::UsageSource;
use tonic::{Request, Response, Status, Streaming};

use crate::facts::{picked_endpoint, queue_wait};
use crate::metering::access_log::{self, Entry};
use crate::scheduling::picker::Observed;
use crate::state::Live;

/// The access log service.
pub struct AccessLog {
    live: Arc<Live>,
}

impl AccessLog {
    /// A service over the live state. Envoy keeps one access-log stream open as long as it runs:
    /// each message is read under the generation serving when it arrives.
    pub fn new(live: Arc<Live>) -> Self {
        Self { live }
    }
}

#[tonic::async_trait]
impl AccessLogService for AccessLog {
    async fn stream_access_logs(
        &self,
        request: Request<Streaming<StreamAccessLogsMessage>>,
    ) -> Result<Response<StreamAccessLogsResponse>, Status> {
        let _open = self.live.current().stream_opened();
        let mut inbound = request.into_inner();
        while let Some(message) = inbound.message().await? {
            let Some(LogEntries::HttpLogs(logs)) = message.log_entries else { continue };
            let shared = self.live.current();
            for entry in logs.log_entry {
                match access_log::entry_of(&entry, || shared.ids.next()) {
                    Entry::Record(record) => {
                        let metadata = entry.common_properties.as_ref().and_then(|c| c.metadata.as_ref());
                        if let Some(endpoint) = picked_endpoint(metadata) {
                            // A request that streamed a first token teaches the pool's TTFT model
                            // and, with the upstream's usage, its bytes per token. Its TTFT counts
                            // from the filter's request headers: the wait in the pool's queue,
                            // before its pick, is not the endpoint's.
                            let measured = record.ttft_us > 0 && (200..300).contains(&record.status);
                            let observed = measured.then(|| Observed {
                                request_id: record.info.request_id.as_str(),
                                ttft_s: (record.ttft_us as f64 / 1e6 - queue_wait(metadata).as_secs_f64())
                                    .max(0.0),
                                prompt_tokens: match record.usage_source {
                                    UsageSource::Upstream => record.prompt_tokens,
                                    _ => 0,
                                },
                            });
                            shared.pools.pick_finished(&record.info.pool, &endpoint, observed);
                        }
                        crate::metering::finish::finish(&shared, *record);
                    }
                    Entry::Release { tenant, model, record_id } => {
                        crate::admission::pipeline::release(&shared, &tenant, &model, record_id);
                    }
                    Entry::Nothing => {}
                }
            }
        }
        Ok(Response::new(StreamAccessLogsResponse {}))
    }
}
