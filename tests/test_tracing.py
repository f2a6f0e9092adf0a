"""Traces (issue 15 item 4), end to end: Envoy's OpenTelemetry tracer and the sidecar both export
to a real OTLP/gRPC receiver (the OpenTelemetry collector's TraceService, served here with grpcio
and the `opentelemetry-proto` messages), and one request's spans share one trace: the sidecar's
`admission` span is a child of Envoy's span for the ext_proc call, carries the GenAI attributes
and the tenant, and no span carries the API key.
"""

from __future__ import annotations

import json
import threading
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from helpers import chat_body, post, wait_for
from stack import Model, Pool, Stack, Tenant, free_port, new_api_key

KEY = new_api_key()


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Keeps every exported span as (service.name, span)."""

    def __init__(self):
        self.spans: list[tuple[str, object]] = []
        self.lock = threading.Lock()

    def Export(self, request, context):  # noqa: N802 (the gRPC method's name)
        with self.lock:
            for rs in request.resource_spans:
                service = next((a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), "")
                for ss in rs.scope_spans:
                    self.spans.extend((service, span) for span in ss.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def snapshot(self) -> list[tuple[str, object]]:
        with self.lock:
            return list(self.spans)


class RecordingUpstream(BaseHTTPRequestHandler):
    """A minimal OpenAI-compatible upstream that keeps every request's `traceparent` (what vLLM
    would continue its own spans from)."""

    traceparents: list[str | None] = []

    def do_GET(self):  # noqa: N802 (http.server's name)
        body = b"vllm:num_requests_waiting 0\nvllm:num_requests_running 0\n" if self.path == "/metrics" else b"ok"
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers.get("content-length", "0")))
        RecordingUpstream.traceparents.append(self.headers.get("traceparent"))
        body = json.dumps({"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "sim/echo",
                           "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                                        "finish_reason": "stop"}],
                           "usage": {"prompt_tokens": 9, "completion_tokens": 1, "total_tokens": 10}}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    receiver = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    upstream = ThreadingHTTPServer(("127.0.0.1", 0), RecordingUpstream)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    pools = [Pool("pool_t", ["sim/t"], ["--output-tokens", "3"]),
             Pool("pool_echo", ["sim/echo"], kind="external", urls=[f"http://127.0.0.1:{upstream.server_port}"])]
    models = [Model("traced", "pool_t", served_model_name="sim/t"),
              Model("echo", "pool_echo", served_model_name="sim/echo")]
    tenants = [Tenant("trace-tenant", [KEY], {"requests_per_minute": 1000, "tokens_per_minute": 1000000})]
    try:
        with Stack(tmp_path_factory.mktemp("trace"), pools, models, tenants, otlp_port=port) as stack:
            yield stack, receiver
    finally:
        server.stop(grace=None)
        upstream.shutdown()


def attributes(span) -> dict:
    out = {}
    for a in span.attributes:
        v = a.value
        out[a.key] = v.string_value if v.HasField("string_value") else v.int_value if v.HasField("int_value") \
            else v.bool_value if v.HasField("bool_value") else v.double_value
    return out


def test_one_request_is_one_trace_across_envoy_and_the_sidecar(traced):
    stack, receiver = traced
    r = post(stack, "/v1/chat/completions", chat_body("traced", "trace me", max_tokens=3), key=KEY)
    assert r.status_code == 200, r.text
    request_id = r.headers.get("x-request-id")

    def admission_span():
        for service, span in receiver.snapshot():
            if service == "llm-gateway-ext-proc" and span.name == "admission" and \
                    (request_id is None or attributes(span).get("request_id") == request_id):
                return span
        return None

    assert wait_for(lambda: admission_span() is not None, timeout=20), \
        [(s, sp.name) for s, sp in receiver.snapshot()]
    admission = admission_span()
    trace = admission.trace_id
    # Envoy's spans of the same trace (its export batches every few seconds).
    assert wait_for(lambda: any(s == "llm-gateway" and sp.trace_id == trace for s, sp in receiver.snapshot()),
                    timeout=20), [(s, sp.name, sp.trace_id.hex()) for s, sp in receiver.snapshot()]
    envoy = [sp for s, sp in receiver.snapshot() if s == "llm-gateway" and sp.trace_id == trace]
    assert admission.parent_span_id in {sp.span_id for sp in envoy}, \
        ("the admission is a child of one of Envoy's spans", [sp.name for sp in envoy])
    a = attributes(admission)
    assert a["gen_ai.request.model"] == "traced"
    assert isinstance(a["gen_ai.usage.input_tokens"], int) and a["gen_ai.usage.input_tokens"] > 0, a
    assert a["tenant"] == "trace-tenant"
    assert a["llm_gateway.outcome"] == "admitted"
    # Its child: the rate-limit decision's Redis call.
    children = [sp for s, sp in receiver.snapshot() if sp.trace_id == trace and sp.parent_span_id == admission.span_id]
    assert "rate_limit" in {sp.name for sp in children}, [sp.name for sp in children]
    # Never an API key, in any span of any service.
    for _, span in receiver.snapshot():
        assert KEY not in str(span), span.name


def test_the_upstream_gets_the_trace_context(traced):
    """vLLM (`--otlp-traces-endpoint`) continues the trace from the `traceparent` Envoy sends it:
    the upstream request carries one, in the same trace as the sidecar's admission span."""
    stack, receiver = traced
    RecordingUpstream.traceparents.clear()
    r = post(stack, "/v1/chat/completions", chat_body("echo", "trace the upstream", max_tokens=3), key=KEY)
    assert r.status_code == 200, r.text
    assert len(RecordingUpstream.traceparents) == 1, RecordingUpstream.traceparents
    traceparent = RecordingUpstream.traceparents[0]
    assert traceparent is not None, "Envoy sent the upstream no traceparent"
    version, trace_id, _span_id, _flags = traceparent.split("-")
    assert version == "00" and len(trace_id) == 32, traceparent
    assert wait_for(lambda: any(s == "llm-gateway-ext-proc" and sp.name == "admission" and sp.trace_id.hex() == trace_id
                                for s, sp in receiver.snapshot()), timeout=20), \
        ("the sidecar's admission span is in the upstream's trace", traceparent)
