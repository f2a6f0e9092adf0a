//! The usage journal: the metering path that survives the sidecar.
//!
//! Envoy's gRPC access log is fire-and-forget: what a sidecar received but had not written to
//! Redis when it died, and what Envoy's small retry buffer could not hold while no sidecar
//! listened, is lost. So the standalone bootstrap also writes every access-log entry, with the
//! same facts the gRPC entry carries, as one JSON line to a local file
//! (`envoy/access_log_journal.yaml`: Envoy's file access logger). The sidecar tails that file
//! from a checkpoint kept in Redis (the file's identity, device and inode, and a byte offset),
//! turns each complete line into the [`HttpAccessLogEntry`] the gRPC path would have received
//! ([`parse_line`]), and applies what it asks of the ledger ([`crate::metering::access_log`]'s reading of
//! an entry) through the same idempotent script (`lua/ledger_v1.lua`): a record, or the release
//! of an admission Envoy never received. The checkpoint moves only after Redis applied the
//! batch, so a sidecar that dies mid-batch replays it from the checkpoint, and the record ids
//! (the request's) make the replay, and every entry the gRPC path delivered too, change nothing.
//!
//! One replica tails a journal at a time: it holds a lease in Redis (`SET NX PX`, renewed every
//! poll), and the checkpoint is written only by the lease's holder (one script checks both), so
//! a replica that lost its lease (paused, cut off from Redis) cannot move it. When the holder
//! dies, another replica on the host takes the lease once it expires and goes on from the
//! checkpoint.
//!
//! Rotation: when the path names another file than the one being read (renamed away and Envoy's
//! logs reopened), the old file is read to its end through the open handle, then the new one from
//! offset 0; a file shorter than the offset (truncated) is read again from 0. A checkpoint naming
//! a file the path no longer names (rotated while no sidecar tailed) starts the path's file at 0.
//! Only complete lines are read: a partial last line waits for its newline.
//!
//! The gRPC access log stays the fast path (pool accounting, flow control, settlement within
//! milliseconds); the journal, flushed by Envoy about once a second, repairs what it lost. A line
//! whose write this replica's recorder saw land is not written again ([`crate::metering::landed`]). Lines
//! of requests that were not admitted (no facts, no reservation) are skipped.
//!
//! This module reads lines (no I/O); [`tail`] follows the file and writes to Redis.

pub mod tail;

use std::borrow::Cow;
use std::collections::HashMap;

use envoy_types::pb::envoy::config::core::v3::Metadata;
use envoy_types::pb::envoy::data::accesslog::v3::{
    AccessLogCommon, HttpAccessLogEntry, HttpRequestProperties, HttpResponseProperties,
};
use envoy_types::pb::google::protobuf::{self as pb, value::Kind, Any, ListValue, Struct};
use prost::Message;
use serde::Deserialize;

use gateway_contract::{FS_REQUEST, FS_USAGE, METADATA_NAMESPACE};

/// The Redis keys of a journal: its lease and its checkpoint (one hash tag, one cluster slot).
pub fn keys(prefix: &str, name: &str) -> (String, String) {
    let tag = name.replace(['{', '}'], "_");
    (format!("{prefix}:journal-lease:{{{tag}}}"), format!("{prefix}:journal-checkpoint:{{{tag}}}"))
}

/// Where the reading stands: the file (device, inode) and the offset of the first byte not yet
/// applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Checkpoint {
    /// `st_dev` of the file.
    pub dev: u64,
    /// `st_ino` of the file.
    pub ino: u64,
    /// Bytes applied.
    pub offset: u64,
}

/// The length of `buf`'s complete lines: up to and including its last newline (0: none).
pub fn complete_len(buf: &[u8]) -> usize {
    buf.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1)
}

/// One journal line as Envoy's `json_format` writes it (`envoy/access_log_journal.yaml`).
/// Absent values come as `null` (or Envoy's `-`).
#[derive(Debug, Deserialize)]
struct Line {
    #[serde(default)]
    request_id: serde_json::Value,
    #[serde(default)]
    start: serde_json::Value,
    #[serde(default)]
    facts: serde_json::Value,
    #[serde(default)]
    usage: serde_json::Value,
    #[serde(default)]
    metadata: serde_json::Value,
    #[serde(default)]
    status: serde_json::Value,
    #[serde(default)]
    details: serde_json::Value,
    #[serde(default)]
    upstream_tx_us: serde_json::Value,
    #[serde(default)]
    downstream_tx_us: serde_json::Value,
}

/// A string value (`None`: null, empty or Envoy's `-`).
fn text(v: &serde_json::Value) -> Option<String> {
    match v {
        serde_json::Value::String(s) if !s.is_empty() && s != "-" => Some(s.clone()),
        serde_json::Value::Object(_) | serde_json::Value::Array(_) => Some(v.to_string()),
        _ => None,
    }
}

/// A non-negative integer value, as a number or a string of digits.
fn integer(v: &serde_json::Value) -> Option<u64> {
    match v {
        serde_json::Value::Number(n) => {
            n.as_u64().or_else(|| n.as_f64().filter(|f| *f >= 0.0).map(|f| f as u64))
        }
        serde_json::Value::String(s) => s.trim().parse().ok(),
        _ => None,
    }
}

/// Envoy's `%START_TIME(%s.%9f)%`: seconds and nanoseconds.
fn start_time(v: &serde_json::Value) -> Option<pb::Timestamp> {
    let s = text(v)?;
    let (secs, frac) = s.split_once('.').unwrap_or((s.as_str(), ""));
    let seconds: i64 = secs.parse().ok()?;
    let digits: String = frac.chars().take(9).collect();
    if !digits.chars().all(|c| c.is_ascii_digit()) {
        return None;
    }
    let nanos = if digits.is_empty() { 0 } else { format!("{digits:0<9}").parse().ok()? };
    Some(pb::Timestamp { seconds, nanos })
}

fn duration_of_us(us: u64) -> pb::Duration {
    pb::Duration {
        seconds: i64::try_from(us / 1_000_000).unwrap_or(i64::MAX),
        nanos: i32::try_from((us % 1_000_000) * 1000).unwrap_or(0),
    }
}

/// A filter state logged `PLAIN` (the property's bytes as a string), as the `Any` holding a
/// `google.protobuf.BytesValue` that the gRPC access log carries.
fn filter_state(v: &serde_json::Value) -> Option<Any> {
    let bytes = text(v)?.into_bytes();
    Some(Any {
        type_url: "type.googleapis.com/google.protobuf.BytesValue".into(),
        value: bytes.encode_to_vec(),
    })
}

/// A JSON value as a `google.protobuf.Value`.
fn proto_value(v: &serde_json::Value) -> pb::Value {
    let kind = match v {
        serde_json::Value::Null => Kind::NullValue(0),
        serde_json::Value::Bool(b) => Kind::BoolValue(*b),
        serde_json::Value::Number(n) => Kind::NumberValue(n.as_f64().unwrap_or(0.0)),
        serde_json::Value::String(s) => Kind::StringValue(s.clone()),
        serde_json::Value::Array(items) => {
            Kind::ListValue(ListValue { values: items.iter().map(proto_value).collect() })
        }
        serde_json::Value::Object(map) => Kind::StructValue(proto_struct(map)),
    };
    pb::Value { kind: Some(kind) }
}

fn proto_struct(map: &serde_json::Map<String, serde_json::Value>) -> Struct {
    Struct { fields: map.iter().map(|(k, v)| (k.clone(), proto_value(v))).collect() }
}

/// Parses one journal line (without its newline) into the access-log entry the gRPC path would
/// have received for the same stream. `Ok(None)`: a blank line.
///
/// # Errors
/// Why the line is not a journal entry (not JSON, not an object).
pub fn parse_line(line: &[u8]) -> Result<Option<HttpAccessLogEntry>, String> {
    let Some(first) = line.iter().find(|b| !b.is_ascii_whitespace()) else { return Ok(None) };
    if *first != b'{' {
        return Err("not a JSON object".to_owned());
    }
    let line: Line = serde_json::from_slice(line).map_err(|e| e.to_string())?;
    let mut states = HashMap::new();
    if let Some(any) = filter_state(&line.facts) {
        states.insert(FS_REQUEST.to_owned(), any);
    }
    if let Some(any) = filter_state(&line.usage) {
        states.insert(FS_USAGE.to_owned(), any);
    }
    let metadata = match &line.metadata {
        serde_json::Value::Object(map) => Some(Metadata {
            filter_metadata: HashMap::from([(METADATA_NAMESPACE.to_owned(), proto_struct(map))]),
            ..Default::default()
        }),
        _ => None,
    };
    let status = integer(&line.status).and_then(|s| u32::try_from(s).ok()).filter(|s| *s > 0);
    Ok(Some(HttpAccessLogEntry {
        common_properties: Some(AccessLogCommon {
            start_time: start_time(&line.start),
            time_to_last_upstream_tx_byte: integer(&line.upstream_tx_us).map(duration_of_us),
            time_to_last_downstream_tx_byte: integer(&line.downstream_tx_us).map(duration_of_us),
            metadata,
            filter_state_objects: states,
            ..Default::default()
        }),
        request: Some(HttpRequestProperties {
            request_id: text(&line.request_id).unwrap_or_default(),
            ..Default::default()
        }),
        response: Some(HttpResponseProperties {
            response_code: status.map(|value| pb::UInt32Value { value }),
            response_code_details: text(&line.details).unwrap_or_default(),
            ..Default::default()
        }),
        ..Default::default()
    }))
}

/// The ids a line's record id is made of, read without building its access-log entry.
#[derive(Deserialize)]
struct LineIds<'a> {
    #[serde(default, borrow)]
    request_id: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    facts: Option<Cow<'a, str>>,
}

/// The facts' part of [`LineIds`] ([`gateway_contract::RequestFacts`]' fields of the same names).
#[derive(Deserialize)]
struct FactIds<'a> {
    #[serde(default, borrow)]
    request_id: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    nonce: Option<Cow<'a, str>>,
}

/// The record id a line's record or release has ([`gateway_contract::record_id`] of the facts'
/// request id, else the line's, and the facts' nonce, as [`parse_line`] and
/// [`crate::metering::access_log::entry_of`] name it), read from the line's `request_id` and `facts` alone: the
/// journal skips a line whose write landed without building its entry. `None` where the line
/// has no such id (facts absent, not a string, or without a valid nonce): the line is read in
/// full.
pub fn line_record_id(line: &[u8]) -> Option<String> {
    let ids: LineIds<'_> = serde_json::from_slice(line).ok()?;
    let facts = ids.facts?;
    let facts: FactIds<'_> = serde_json::from_str(&facts).ok()?;
    let from_line = ids.request_id.filter(|id| !id.is_empty() && id != "-");
    let request_id = facts.request_id.or(from_line).unwrap_or_default();
    gateway_contract::record_id(&request_id, facts.nonce.as_deref()?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::JournalConfig;
    use crate::metering::access_log::{self, Entry};

    const LINE: &str = r#"{"v":1,"request_id":"rid-7","start":"1700000000.005000000","facts":"{\"v\":1,\"tenant\":\"acme\",\"tier\":\"standard\",\"model\":\"m\",\"pool\":\"p\",\"prompt_tokens\":12,\"max_tokens\":38,\"request_id\":\"rid-7\",\"nonce\":\"00000000000000ff\"}","usage":"{\"v\":1,\"status\":200,\"prompt_tokens\":10,\"completion_tokens\":3,\"cached_tokens\":0,\"ttft_us\":5,\"tpot_us\":1,\"duration_us\":9,\"end_reason\":\"completed\",\"usage_source\":\"upstream\"}","metadata":{"reserved_tokens":50,"admitted":true},"status":200,"details":"via_upstream","upstream_tx_us":"800","downstream_tx_us":1250000}"#;

    #[test]
    fn a_line_reads_as_the_grpc_entry_of_the_same_stream() {
        let entry = parse_line(LINE.as_bytes()).unwrap().unwrap();
        let Entry::Record(r) = access_log::entry_of(&entry, || panic!("named by the facts")) else {
            panic!("a record")
        };
        assert_eq!(r.info.record_id, "rid-7.00000000000000ff");
        assert_eq!((r.info.tenant.as_str(), r.info.model.as_str(), r.info.pool.as_str()), ("acme", "m", "p"));
        assert_eq!((r.prompt_tokens, r.completion_tokens, r.info.reserved_tokens), (10, 3, 50));
        // Dated as the gRPC path dates it: start + time to the last downstream byte.
        assert_eq!(r.finished_at_unix_ms, 1_700_000_001_255);
        assert_eq!(r.status, 200);
    }

    #[test]
    fn a_lines_record_id_reads_from_its_ids_alone_as_its_entry_names_it() {
        let named = |line: &str| match access_log::entry_of(
            &parse_line(line.as_bytes()).unwrap().unwrap(),
            String::new,
        ) {
            Entry::Record(r) => Some(r.info.record_id),
            Entry::Release { record_id, .. } => Some(record_id),
            Entry::Nothing => None,
        };
        assert_eq!(line_record_id(LINE.as_bytes()).as_deref(), Some("rid-7.00000000000000ff"));
        assert_eq!(line_record_id(LINE.as_bytes()), named(LINE));
        // The facts without a request id: the line's, as the entry takes it.
        let line = LINE.replace(r#"\"request_id\":\"rid-7\","#, "").replace(r#""rid-7""#, r#""rid-8""#);
        assert_eq!(line_record_id(line.as_bytes()).as_deref(), Some("rid-8.00000000000000ff"));
        assert_eq!(line_record_id(line.as_bytes()), named(&line));
        // Neither: `-`, as the entry names it.
        let none = line.replace(r#""request_id":"rid-8","#, "");
        assert_eq!(line_record_id(none.as_bytes()).as_deref(), Some("-.00000000000000ff"));
        assert_eq!(line_record_id(none.as_bytes()), named(&none));
        // An unanswered admission's release has the same id.
        let release = LINE
            .replace(r#","metadata":{"reserved_tokens":50,"admitted":true},"status":200"#, r#","status":0"#);
        assert!(matches!(
            access_log::entry_of(&parse_line(release.as_bytes()).unwrap().unwrap(), String::new),
            Entry::Release { .. }
        ));
        assert_eq!(line_record_id(release.as_bytes()), named(&release));
        // No id without a valid nonce, facts, or JSON: such a line is read in full.
        assert_eq!(line_record_id(LINE.replace("00000000000000ff", "ff").as_bytes()), None);
        assert_eq!(line_record_id(br#"{"request_id":"rid-7"}"#), None);
        assert_eq!(line_record_id(br#"{"facts":{"nonce":"00000000000000ff"}}"#), None);
        assert_eq!(line_record_id(b"not json"), None);
    }

    #[test]
    fn absent_values_are_absent() {
        let line = r#"{"request_id":"-","start":null,"facts":null,"usage":"-","metadata":null,"status":0,"details":"-","upstream_tx_us":null,"downstream_tx_us":"-"}"#;
        let entry = parse_line(line.as_bytes()).unwrap().unwrap();
        let common = entry.common_properties.as_ref().unwrap();
        assert!(common.filter_state_objects.is_empty());
        assert!(common.metadata.is_none() && common.start_time.is_none());
        assert!(
            common.time_to_last_upstream_tx_byte.is_none()
                && common.time_to_last_downstream_tx_byte.is_none()
        );
        assert!(entry.response.as_ref().unwrap().response_code.is_none());
        assert!(matches!(access_log::entry_of(&entry, String::new), Entry::Nothing));
        // Not admitted (no reservation in the metadata): nothing, as on the gRPC path.
        let refused =
            LINE.replace(r#""metadata":{"reserved_tokens":50,"admitted":true}"#, r#""metadata":null"#);
        let entry = parse_line(refused.as_bytes()).unwrap().unwrap();
        assert!(matches!(access_log::entry_of(&entry, String::new), Entry::Nothing));
    }

    #[test]
    fn an_unanswered_admission_reads_as_a_release() {
        let line = LINE
            .replace(r#""metadata":{"reserved_tokens":50,"admitted":true}"#, r#""metadata":null"#)
            .replace(
                r#""status":200,"details":"via_upstream""#,
                r#""status":500,"details":"ext_proc_error_gRPC_error_14""#,
            );
        let entry = parse_line(line.as_bytes()).unwrap().unwrap();
        assert!(matches!(
            access_log::entry_of(&entry, String::new),
            Entry::Release { record_id, .. } if record_id == "rid-7.00000000000000ff"
        ));
    }

    #[test]
    fn bad_lines_are_errors_and_blank_lines_nothing() {
        assert!(parse_line(b"{not json").is_err());
        assert!(parse_line(b"[1,2]").is_err());
        assert!(parse_line(b"   ").unwrap().is_none());
    }

    #[test]
    fn start_times_read_to_the_nanosecond() {
        let t = |s: &str| start_time(&serde_json::Value::String(s.into())).map(|t| (t.seconds, t.nanos));
        assert_eq!(t("1700000000.005000000"), Some((1_700_000_000, 5_000_000)));
        assert_eq!(t("1700000000.5"), Some((1_700_000_000, 500_000_000)));
        assert_eq!(t("1700000000"), Some((1_700_000_000, 0)));
        assert_eq!(t("x.5"), None);
        assert_eq!(t("1.5x"), None);
    }

    #[test]
    fn only_complete_lines_are_read() {
        assert_eq!(complete_len(b""), 0);
        assert_eq!(complete_len(b"{\"a\":1}"), 0);
        assert_eq!(complete_len(b"{}\n{\"a\""), 3);
        assert_eq!(complete_len(b"{}\n{}\n"), 6);
    }

    #[test]
    fn config_is_validated_and_named() {
        let ok = JournalConfig {
            path: "/var/log/envoy/usage.journal".into(),
            name: None,
            poll_interval_ms: 200,
            lease_ms: 3000,
            batch_lines: 512,
        };
        assert_eq!(ok.validate("metering.journal"), Ok(()));
        assert_eq!(ok.name(), "/var/log/envoy/usage.journal");
        let err = |c: JournalConfig| c.validate("metering.journal").unwrap_err().0;
        assert_eq!(err(JournalConfig { path: "rel/j".into(), ..ok.clone() }), "metering.journal.path");
        assert_eq!(
            err(JournalConfig { poll_interval_ms: 5, ..ok.clone() }),
            "metering.journal.poll_interval_ms"
        );
        assert_eq!(err(JournalConfig { lease_ms: 400, ..ok.clone() }), "metering.journal.lease_ms");
        assert_eq!(
            err(JournalConfig { lease_ms: 600, poll_interval_ms: 300, ..ok.clone() }),
            "metering.journal.lease_ms"
        );
        assert_eq!(err(JournalConfig { batch_lines: 0, ..ok.clone() }), "metering.journal.batch_lines");
        assert_eq!(err(JournalConfig { name: Some(String::new()), ..ok }), "metering.journal.name");
        let (lease, checkpoint) = keys("llmgw", "/x/{y}");
        assert_eq!(lease, "llmgw:journal-lease:{/x/_y_}");
        assert_eq!(checkpoint, "llmgw:journal-checkpoint:{/x/_y_}");
    }
}
