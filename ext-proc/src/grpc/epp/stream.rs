//! One ext_proc stream of the endpoint picker (EPP) role: the per-request state machine of the
//! Gateway API Inference Extension's endpoint-picker protocol, with no I/O.
//!
//! Envoy (Istio's or Envoy Gateway's InferencePool support) sends the request headers, then the
//! body in `FULL_DUPLEX_STREAMED` (or `BUFFERED`/`STREAMED`) mode, then the response. The picker
//! needs the whole body (the prompt's prefix), so it answers nothing until the body ends; then,
//! in the order full-duplex mode requires (headers, body, trailers):
//! - the request-headers response: `x-gateway-destination-endpoint` (the pick, then fallbacks)
//!   as a header mutation and the same value in dynamic metadata `envoy.lb`, plus the body's
//!   `content-length`;
//! - the request body, sent back whole as one `streamed_response` (full duplex) or left as is
//!   (`CONTINUE`, other modes);
//! - a trailers response if trailers came.
//!
//! Or an ImmediateResponse: 503 when no endpoint is eligible (of the subset hint's, when one came),
//! 429 when the pool is shed, 413 for a body over the limit. On the response side it reads the
//! served endpoint (`envoy.lb` / `x-gateway-destination-endpoint-served` in the metadata
//! context, the protocol's "Destination Endpoint Served") and passes every chunk back unchanged.

use std::net::SocketAddr;

use envoy_types::pb::envoy::config::core::v3::{HeaderValue, HeaderValueOption};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::body_mutation::Mutation;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as ProcRequest;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as ProcResponse;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, ProcessingRequest,
    ProcessingResponse, StreamedBodyResponse, TrailersResponse,
};
use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};

use crate::error::AdmissionError;
use gateway_contract::{
    H_DESTINATION_ENDPOINT, MD_DESTINATION_ENDPOINT, MD_DESTINATION_ENDPOINT_SERVED, MD_NAMESPACE_LB,
};

/// What the stream asks of the picker: one pick for a request.
pub trait Chooser {
    /// The endpoints (`ip:port`, the pick first, then fallbacks) for a request whose whole body is
    /// `body` (empty for a request without one), restricted to `subset` when the data plane sent a
    /// subset hint.
    ///
    /// # Errors
    /// [`AdmissionError::NoEligibleEndpoint`] (503) or [`AdmissionError::Overloaded`] (429).
    fn choose(&self, body: &[u8], subset: Option<&[SocketAddr]>) -> Result<Vec<String>, AdmissionError>;

    /// The data plane reports the endpoint that served the request.
    fn served(&self, endpoint: &str);
}

/// Where a stream is in the request's life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Waiting for the request headers.
    Start,
    /// Headers seen, collecting the body; nothing answered yet.
    Body,
    /// The request was answered (picked, or refused).
    Picked,
    /// An ImmediateResponse was sent: the stream is done.
    Refused,
}

/// One request's endpoint-picker stream (see the module doc).
#[derive(Debug)]
pub struct EppStream {
    phase: Phase,
    body: Vec<u8>,
    max_body_bytes: usize,
    subset: Option<Vec<SocketAddr>>,
    request_body_mode: BodySendMode,
    response_body_mode: BodySendMode,
    /// Trailers that arrived before the pick (answered after the body).
    pending_trailers: bool,
    /// A request body message arrived (one is answered, empty or not).
    saw_body: bool,
    picked: Option<String>,
}

impl EppStream {
    /// A stream that refuses bodies over `max_body_bytes` (413).
    pub fn new(max_body_bytes: usize) -> Self {
        Self {
            phase: Phase::Start,
            body: Vec::new(),
            max_body_bytes,
            subset: None,
            request_body_mode: BodySendMode::None,
            response_body_mode: BodySendMode::None,
            pending_trailers: false,
            saw_body: false,
            picked: None,
        }
    }

    /// The endpoint list answered, once picked.
    pub fn picked(&self) -> Option<&str> {
        self.picked.as_deref()
    }

    /// Whether the stream has ended with an ImmediateResponse (the adapter closes it).
    pub fn refused(&self) -> bool {
        self.phase == Phase::Refused
    }

    /// Consumes one message from Envoy; returns the responses to send, in order (possibly none).
    pub fn on_message(&mut self, req: ProcessingRequest, chooser: &dyn Chooser) -> Vec<ProcessingResponse> {
        if let Some(pc) = &req.protocol_config {
            self.request_body_mode =
                BodySendMode::try_from(pc.request_body_mode).unwrap_or(BodySendMode::None);
            self.response_body_mode =
                BodySendMode::try_from(pc.response_body_mode).unwrap_or(BodySendMode::None);
        }
        if self.phase == Phase::Refused {
            return Vec::new();
        }
        match req.request {
            Some(ProcRequest::RequestHeaders(h)) => {
                self.subset = crate::facts::subset_hint(req.metadata_context.as_ref());
                self.phase = Phase::Body;
                // No body will come (none sent, or a filter that sends none: `protocol_config`
                // absent or body mode NONE): pick from the headers alone, without prefix affinity.
                if h.end_of_stream || self.request_body_mode == BodySendMode::None {
                    return self.pick(chooser);
                }
                Vec::new()
            }
            Some(ProcRequest::RequestBody(b)) => {
                if self.phase != Phase::Body {
                    return vec![continue_body(true, b.body, b.end_of_stream, self.request_body_mode)];
                }
                if self.body.len().saturating_add(b.body.len()) > self.max_body_bytes {
                    return self.refuse(&AdmissionError::RequestTooLarge { max_bytes: self.max_body_bytes });
                }
                self.body.extend_from_slice(&b.body);
                self.saw_body = true;
                if b.end_of_stream {
                    return self.pick(chooser);
                }
                // A body mode that waits for an answer per chunk (STREAMED) gets an empty one:
                // the body is sent back whole after the pick.
                if self.request_body_mode == BodySendMode::Streamed {
                    return vec![body_response(true, Some(Mutation::ClearBody(true)))];
                }
                Vec::new()
            }
            Some(ProcRequest::RequestTrailers(_)) => {
                if self.phase == Phase::Body {
                    // The body ends with the trailers: pick now, then answer the trailers.
                    self.pending_trailers = true;
                    return self.pick(chooser);
                }
                vec![trailers_response(true)]
            }
            Some(ProcRequest::ResponseHeaders(_)) => {
                if let Some(served) = served_endpoint(req.metadata_context.as_ref()) {
                    chooser.served(&served);
                }
                vec![ProcessingResponse {
                    response: Some(ProcResponse::ResponseHeaders(HeadersResponse {
                        response: Some(CommonResponse::default()),
                    })),
                    ..Default::default()
                }]
            }
            Some(ProcRequest::ResponseBody(b)) => {
                vec![continue_body(false, b.body, b.end_of_stream, self.response_body_mode)]
            }
            Some(ProcRequest::ResponseTrailers(_)) => vec![trailers_response(false)],
            None => Vec::new(),
        }
    }

    fn refuse(&mut self, error: &AdmissionError) -> Vec<ProcessingResponse> {
        self.phase = Phase::Refused;
        vec![crate::grpc::protocol::immediate_response(error)]
    }

    fn pick(&mut self, chooser: &dyn Chooser) -> Vec<ProcessingResponse> {
        let endpoints = match chooser.choose(&self.body, self.subset.as_deref()) {
            Ok(e) if !e.is_empty() => e,
            Ok(_) => return self.refuse(&AdmissionError::NoEligibleEndpoint { pool: String::new() }),
            Err(e) => return self.refuse(&e),
        };
        let value = endpoints.join(",");
        self.phase = Phase::Picked;
        self.picked = Some(value.clone());
        let body = std::mem::take(&mut self.body);
        let mut set_headers = vec![header(H_DESTINATION_ENDPOINT, &value)];
        let full_duplex = self.request_body_mode == BodySendMode::FullDuplexStreamed;
        if full_duplex && !body.is_empty() {
            // The body goes back as a streamed mutation: its length must be stated again.
            set_headers.push(header("content-length", &body.len().to_string()));
        }
        let mut out = vec![ProcessingResponse {
            response: Some(ProcResponse::RequestHeaders(HeadersResponse {
                response: Some(CommonResponse {
                    header_mutation: Some(HeaderMutation { set_headers, ..Default::default() }),
                    ..Default::default()
                }),
            })),
            dynamic_metadata: Some(lb_metadata(&value)),
            ..Default::default()
        }];
        match self.request_body_mode {
            BodySendMode::FullDuplexStreamed if self.saw_body => {
                out.push(body_response(
                    true,
                    Some(Mutation::StreamedResponse(StreamedBodyResponse {
                        body,
                        end_of_stream: !self.pending_trailers,
                        ..Default::default()
                    })),
                ));
            }
            BodySendMode::FullDuplexStreamed => {}
            // Streamed chunks were cleared as they came; the whole body replaces the last one.
            BodySendMode::Streamed if !body.is_empty() => {
                out.push(body_response(true, Some(Mutation::Body(body))));
            }
            // Buffered modes: one body message, answered unchanged.
            BodySendMode::Buffered | BodySendMode::BufferedPartial if self.saw_body => {
                out.push(body_response(true, None));
            }
            _ => {}
        }
        if self.pending_trailers {
            out.push(trailers_response(true));
        }
        out
    }
}

fn header(key: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: key.to_owned(),
            raw_value: value.as_bytes().to_vec(),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn string_value(s: &str) -> Value {
    Value { kind: Some(Kind::StringValue(s.to_owned())) }
}

/// `envoy.lb: {x-gateway-destination-endpoint: value}` as an ext_proc response's dynamic metadata.
pub fn lb_metadata(value: &str) -> Struct {
    let inner = Struct { fields: [(MD_DESTINATION_ENDPOINT.to_owned(), string_value(value))].into() };
    Struct { fields: [(MD_NAMESPACE_LB.to_owned(), Value { kind: Some(Kind::StructValue(inner)) })].into() }
}

fn body_response(request: bool, mutation: Option<Mutation>) -> ProcessingResponse {
    let common = CommonResponse {
        body_mutation: mutation.map(|m| BodyMutation { mutation: Some(m) }),
        ..Default::default()
    };
    let body = BodyResponse { response: Some(common) };
    ProcessingResponse {
        response: Some(if request {
            ProcResponse::RequestBody(body)
        } else {
            ProcResponse::ResponseBody(body)
        }),
        ..Default::default()
    }
}

/// A body chunk passed on unchanged: echoed as a streamed mutation in full-duplex mode (where
/// what the processor does not send back is dropped), else a plain CONTINUE.
fn continue_body(
    request: bool,
    chunk: Vec<u8>,
    end_of_stream: bool,
    mode: BodySendMode,
) -> ProcessingResponse {
    if mode == BodySendMode::FullDuplexStreamed {
        body_response(
            request,
            Some(Mutation::StreamedResponse(StreamedBodyResponse {
                body: chunk,
                end_of_stream,
                ..Default::default()
            })),
        )
    } else {
        body_response(request, None)
    }
}

fn trailers_response(request: bool) -> ProcessingResponse {
    let t = TrailersResponse::default();
    ProcessingResponse {
        response: Some(if request {
            ProcResponse::RequestTrailers(t)
        } else {
            ProcResponse::ResponseTrailers(t)
        }),
        ..Default::default()
    }
}

type MetadataContext = envoy_types::pb::envoy::config::core::v3::Metadata;

/// The served endpoint from `envoy.lb` / `x-gateway-destination-endpoint-served`.
pub fn served_endpoint(md: Option<&MetadataContext>) -> Option<String> {
    let ns = md?.filter_metadata.get(MD_NAMESPACE_LB)?;
    match &ns.fields.get(MD_DESTINATION_ENDPOINT_SERVED)?.kind {
        Some(Kind::StringValue(s)) if !s.is_empty() => Some(s.clone()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::envoy::config::core::v3::Metadata;
    use envoy_types::pb::envoy::service::ext_proc::v3::{
        HttpBody, HttpHeaders, HttpTrailers, ProtocolConfiguration,
    };
    use envoy_types::pb::google::protobuf::ListValue;
    use gateway_contract::{MD_DESTINATION_ENDPOINT_SUBSET, MD_NAMESPACE_SUBSET_HINT};
    use std::cell::RefCell;

    /// A body the fake chooser was asked about, and the subset.
    type Seen = (Vec<u8>, Option<Vec<SocketAddr>>);

    struct Fake {
        answer: Result<Vec<String>, AdmissionError>,
        seen: RefCell<Vec<Seen>>,
        served: RefCell<Vec<String>>,
    }

    impl Fake {
        fn new(answer: Result<Vec<String>, AdmissionError>) -> Self {
            Self { answer, seen: RefCell::default(), served: RefCell::default() }
        }
    }

    impl Chooser for Fake {
        fn choose(&self, body: &[u8], subset: Option<&[SocketAddr]>) -> Result<Vec<String>, AdmissionError> {
            self.seen.borrow_mut().push((body.to_vec(), subset.map(<[SocketAddr]>::to_vec)));
            self.answer.clone()
        }
        fn served(&self, endpoint: &str) {
            self.served.borrow_mut().push(endpoint.to_owned());
        }
    }

    fn headers(eos: bool, md: Option<Metadata>, mode: BodySendMode) -> ProcessingRequest {
        ProcessingRequest {
            request: Some(ProcRequest::RequestHeaders(HttpHeaders {
                end_of_stream: eos,
                ..Default::default()
            })),
            metadata_context: md,
            protocol_config: Some(ProtocolConfiguration {
                request_body_mode: mode as i32,
                response_body_mode: mode as i32,
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn body(chunk: &[u8], eos: bool) -> ProcessingRequest {
        ProcessingRequest {
            request: Some(ProcRequest::RequestBody(HttpBody {
                body: chunk.to_vec(),
                end_of_stream: eos,
                ..Default::default()
            })),
            ..Default::default()
        }
    }

    fn set_header<'a>(r: &'a ProcessingResponse, key: &str) -> Option<&'a [u8]> {
        let Some(ProcResponse::RequestHeaders(h)) = &r.response else { return None };
        h.response.as_ref()?.header_mutation.as_ref()?.set_headers.iter().find_map(|o| {
            let h = o.header.as_ref()?;
            (h.key == key).then_some(h.raw_value.as_slice())
        })
    }

    fn md(ns: &str, key: &str, value: Value) -> Metadata {
        Metadata {
            filter_metadata: [(ns.to_owned(), Struct { fields: [(key.to_owned(), value)].into() })].into(),
            ..Default::default()
        }
    }

    #[test]
    fn full_duplex_waits_for_the_body_then_answers_headers_then_the_whole_body() {
        let fake = Fake::new(Ok(vec!["10.0.0.2:8000".into(), "10.0.0.3:8000".into()]));
        let mut s = EppStream::new(1 << 20);
        assert!(s.on_message(headers(false, None, BodySendMode::FullDuplexStreamed), &fake).is_empty());
        assert!(s.on_message(body(b"{\"model\":", false), &fake).is_empty());
        let out = s.on_message(body(b"\"m\"}", true), &fake);
        assert_eq!(out.len(), 2);
        assert_eq!(set_header(&out[0], H_DESTINATION_ENDPOINT), Some(&b"10.0.0.2:8000,10.0.0.3:8000"[..]));
        assert_eq!(set_header(&out[0], "content-length"), Some(&b"13"[..]));
        let md = out[0].dynamic_metadata.as_ref().unwrap();
        let Some(Kind::StructValue(lb)) = &md.fields[MD_NAMESPACE_LB].kind else { panic!() };
        assert_eq!(lb.fields[MD_DESTINATION_ENDPOINT], string_value("10.0.0.2:8000,10.0.0.3:8000"));
        let Some(ProcResponse::RequestBody(b)) = &out[1].response else { panic!("{:?}", out[1]) };
        let Some(Mutation::StreamedResponse(sr)) =
            b.response.as_ref().unwrap().body_mutation.as_ref().unwrap().mutation.as_ref()
        else {
            panic!()
        };
        assert_eq!((sr.body.as_slice(), sr.end_of_stream), (&b"{\"model\":\"m\"}"[..], true));
        assert_eq!(fake.seen.borrow()[0].0, b"{\"model\":\"m\"}");
        assert_eq!(s.picked(), Some("10.0.0.2:8000,10.0.0.3:8000"));
    }

    #[test]
    fn a_request_without_body_is_picked_at_its_headers() {
        let fake = Fake::new(Ok(vec!["10.0.0.2:8000".into()]));
        let mut s = EppStream::new(16);
        let out = s.on_message(headers(true, None, BodySendMode::FullDuplexStreamed), &fake);
        assert_eq!(out.len(), 1, "no body to send back");
        assert_eq!(set_header(&out[0], H_DESTINATION_ENDPOINT), Some(&b"10.0.0.2:8000"[..]));
        assert_eq!(set_header(&out[0], "content-length"), None);
    }

    #[test]
    fn subset_hint_is_passed_and_refusals_are_immediate_responses() {
        let hint = Value {
            kind: Some(Kind::ListValue(ListValue {
                values: vec![string_value("10.0.0.9:8000"), string_value(" ")],
            })),
        };
        let fake = Fake::new(Err(AdmissionError::NoEligibleEndpoint { pool: "p".into() }));
        let mut s = EppStream::new(1 << 10);
        s.on_message(
            headers(
                false,
                Some(md(MD_NAMESPACE_SUBSET_HINT, MD_DESTINATION_ENDPOINT_SUBSET, hint)),
                BodySendMode::Buffered,
            ),
            &fake,
        );
        let out = s.on_message(body(b"{}", true), &fake);
        assert_eq!(fake.seen.borrow()[0].1, Some(vec!["10.0.0.9:8000".parse().unwrap()]));
        let Some(ProcResponse::ImmediateResponse(r)) = &out[0].response else { panic!("{out:?}") };
        assert_eq!(r.status.as_ref().unwrap().code, 503);
        assert!(s.refused());
        assert!(s.on_message(body(b"late", true), &fake).is_empty(), "nothing after a refusal");
        // 429 when shed.
        let fake = Fake::new(Err(AdmissionError::Overloaded { pool: "p".into(), retry_after_secs: 2 }));
        let mut s = EppStream::new(1 << 10);
        let out = s.on_message(headers(true, None, BodySendMode::FullDuplexStreamed), &fake);
        let Some(ProcResponse::ImmediateResponse(r)) = &out[0].response else { panic!() };
        assert_eq!(r.status.as_ref().unwrap().code, 429);
    }

    #[test]
    fn a_filter_that_sends_no_body_is_answered_at_the_headers() {
        let fake = Fake::new(Ok(vec!["10.0.0.2:8000".into()]));
        let mut s = EppStream::new(16);
        let out = s.on_message(headers(false, None, BodySendMode::None), &fake);
        assert_eq!(out.len(), 1);
        assert_eq!(set_header(&out[0], H_DESTINATION_ENDPOINT), Some(&b"10.0.0.2:8000"[..]));
        assert_eq!(fake.seen.borrow()[0].0, b"");
    }

    #[test]
    fn an_oversized_body_gets_413_without_a_pick() {
        let fake = Fake::new(Ok(vec!["10.0.0.2:8000".into()]));
        let mut s = EppStream::new(4);
        s.on_message(headers(false, None, BodySendMode::FullDuplexStreamed), &fake);
        assert!(s.on_message(body(b"abc", false), &fake).is_empty());
        let out = s.on_message(body(b"de", false), &fake);
        let Some(ProcResponse::ImmediateResponse(r)) = &out[0].response else { panic!() };
        assert_eq!(r.status.as_ref().unwrap().code, 413);
        assert!(fake.seen.borrow().is_empty());
    }

    #[test]
    fn trailers_end_the_body_and_are_answered_after_it() {
        let fake = Fake::new(Ok(vec!["10.0.0.2:8000".into()]));
        let mut s = EppStream::new(1 << 10);
        s.on_message(headers(false, None, BodySendMode::FullDuplexStreamed), &fake);
        s.on_message(body(b"{}", false), &fake);
        let t = ProcessingRequest {
            request: Some(ProcRequest::RequestTrailers(HttpTrailers::default())),
            ..Default::default()
        };
        let out = s.on_message(t, &fake);
        assert_eq!(out.len(), 3);
        assert!(matches!(out[0].response, Some(ProcResponse::RequestHeaders(_))));
        let Some(ProcResponse::RequestBody(b)) = &out[1].response else { panic!() };
        let Some(Mutation::StreamedResponse(sr)) =
            b.response.as_ref().unwrap().body_mutation.as_ref().unwrap().mutation.as_ref()
        else {
            panic!()
        };
        assert!(!sr.end_of_stream, "the trailers end the stream");
        assert!(matches!(out[2].response, Some(ProcResponse::RequestTrailers(_))));
    }

    #[test]
    fn streamed_mode_clears_chunks_then_sends_the_body_whole() {
        let fake = Fake::new(Ok(vec!["10.0.0.2:8000".into()]));
        let mut s = EppStream::new(1 << 10);
        s.on_message(headers(false, None, BodySendMode::Streamed), &fake);
        let out = s.on_message(body(b"{\"a\":", false), &fake);
        let Some(ProcResponse::RequestBody(b)) = &out[0].response else { panic!() };
        assert!(matches!(
            b.response.as_ref().unwrap().body_mutation.as_ref().unwrap().mutation,
            Some(Mutation::ClearBody(true))
        ));
        let out = s.on_message(body(b"1}", true), &fake);
        let Some(ProcResponse::RequestBody(b)) = &out[1].response else { panic!() };
        let Some(Mutation::Body(whole)) =
            &b.response.as_ref().unwrap().body_mutation.as_ref().unwrap().mutation
        else {
            panic!()
        };
        assert_eq!(whole, b"{\"a\":1}");
    }

    #[test]
    fn response_side_reads_the_served_endpoint_and_echoes_chunks() {
        let fake = Fake::new(Ok(vec!["10.0.0.2:8000".into()]));
        let mut s = EppStream::new(1 << 10);
        s.on_message(headers(true, None, BodySendMode::FullDuplexStreamed), &fake);
        let rh = ProcessingRequest {
            request: Some(ProcRequest::ResponseHeaders(HttpHeaders::default())),
            metadata_context: Some(md(
                MD_NAMESPACE_LB,
                MD_DESTINATION_ENDPOINT_SERVED,
                string_value("10.0.0.2:8000"),
            )),
            ..Default::default()
        };
        assert_eq!(s.on_message(rh, &fake).len(), 1);
        assert_eq!(*fake.served.borrow(), vec!["10.0.0.2:8000".to_owned()]);
        let rb = ProcessingRequest {
            request: Some(ProcRequest::ResponseBody(HttpBody {
                body: b"data: x\n\n".to_vec(),
                end_of_stream: true,
                ..Default::default()
            })),
            ..Default::default()
        };
        let out = s.on_message(rb, &fake);
        let Some(ProcResponse::ResponseBody(b)) = &out[0].response else { panic!() };
        let Some(Mutation::StreamedResponse(sr)) =
            b.response.as_ref().unwrap().body_mutation.as_ref().unwrap().mutation.as_ref()
        else {
            panic!()
        };
        assert_eq!((sr.body.as_slice(), sr.end_of_stream), (&b"data: x\n\n"[..], true));
    }
}
