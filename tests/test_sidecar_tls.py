"""mTLS between Envoy and the sidecar (issue 16, item 2): the sidecar's gRPC listener with `tls`
(its certificate, and the CA Envoy's client certificate must come from), Envoy's ext_proc cluster
with the transport socket of envoy/ext_proc_upstream_tls.yaml.

- Through Envoy over mTLS, requests are admitted and limited, and their usage records arrive in
  Redis (the gRPC access log rides the same cluster), with admission leases on (the filter's
  `dispatch_grpc_call` rides it too).
- Anyone else who reaches the port is refused on each of the three services (ext_proc, the access
  log service, the lease service): a client without a certificate, one with a certificate from
  another CA, and one speaking plaintext. The refusal is per connection (the TLS handshake fails
  before any HTTP/2 frame is read), so it is the same for every service; the test makes the call
  on each, and a client with a valid certificate, on the same code path, gets each answered.
"""

from __future__ import annotations

import socket
import ssl
import struct

import pytest
import redis

from helpers import assert_openai_error, chat_body, post, wait_for
from sidecar_checks import landed_events, metric, sidecar_metrics, usage_hash
from stack import Model, Pool, SidecarTls, Stack, Tenant, new_api_key
from tls_certs import make_ca

SERVER_NAME = "gateway-ext-proc.test"
KEYS = {"mt-a": new_api_key(), "mt-tiny": new_api_key()}
SERVICES = [
    "/envoy.service.ext_proc.v3.ExternalProcessor/Process",
    "/envoy.service.accesslog.v3.AccessLogService/StreamAccessLogs",
    "/llm_gateway.v1.AdmissionLeases/Acquire",
]


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ca = make_ca(d / "ca")
    other = make_ca(d / "other", "other-ca")
    server_cert, server_key = ca.issue("sidecar", server=True, dns=[SERVER_NAME])
    client_cert, client_key = ca.issue("envoy", server=False)
    rogue_cert, rogue_key = other.issue("rogue", server=False)
    return {
        "tls": SidecarTls(ca.cert, server_cert, server_key, client_cert, client_key, SERVER_NAME),
        "rogue": (rogue_cert, rogue_key),
    }


@pytest.fixture(scope="module")
def mtls_stack(tmp_path_factory, pki):
    pools = [Pool("pool_mt", ["sim/mt"], ["--output-tokens", "5"])]
    models = [Model("mt", "pool_mt", served_model_name="sim/mt")]
    tenants = [
        Tenant("mt-a", [KEYS["mt-a"]], {"requests_per_minute": 1000, "tokens_per_minute": 1_000_000}),
        Tenant("mt-tiny", [KEYS["mt-tiny"]], {"requests_per_minute": 2}),
    ]
    overrides = {"redis": {"lease_fraction": 0.2}, "metrics_listen": "127.0.0.1:0"}
    with Stack(tmp_path_factory.mktemp("mtls"), pools, models, tenants, sidecar_tls=pki["tls"],
               sidecar_overrides=overrides, admission_leases=True) as s:
        yield s


def test_requests_are_admitted_limited_and_metered_over_mtls(mtls_stack):
    stack = mtls_stack
    assert "tls" in stack.sidecar_config()
    client = redis.Redis(port=stack.redis_port, socket_timeout=2)
    for _ in range(3):
        r = post(stack, "/v1/chat/completions", chat_body("mt"), key=KEYS["mt-a"])
        assert r.status_code == 200, (r.text, stack.logs())
    # The tiny tenant's limit is enforced by the sidecar (over mTLS): 2 admitted, then 429.
    codes = [post(stack, "/v1/chat/completions", chat_body("mt"), key=KEYS["mt-tiny"]).status_code
             for _ in range(3)]
    assert codes[:2] == [200, 200], (codes, stack.logs())
    assert_openai_error(post(stack, "/v1/chat/completions", chat_body("mt"), key=KEYS["mt-tiny"]), 429)
    # Usage records arrive through the gRPC access log over mTLS.
    assert wait_for(lambda: usage_hash(client, "mt-a").get("mt:requests") == 3, timeout=30), (
        usage_hash(client, "mt-a"), stack.logs())
    events = landed_events(client, "mt-a", 3)
    assert len(events) == 3 and all(e["completion_tokens"] == 5 for e in events), events
    assert usage_hash(client, "mt-tiny").get("mt:requests") == 2
    # The filter's lease calls (dispatch_grpc_call on the same cluster) are granted over mTLS.
    assert wait_for(lambda: metric(sidecar_metrics(stack), "llm_gateway_admission_leases_total",
                                   outcome="granted") >= 1, timeout=30), sidecar_metrics(stack)


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def _literal(name: str, value: str) -> bytes:
    """HPACK literal header field without indexing, new name, no Huffman (lengths < 127)."""
    n, v = name.encode(), value.encode()
    return b"\x00" + bytes([len(n)]) + n + bytes([len(v)]) + v


def grpc_call(port: int, path: str, context: ssl.SSLContext | None) -> str:
    """One gRPC call (an empty message) on `path` over HTTP/2: 'answered' when the server sends a
    HEADERS frame on the stream, else 'refused: <why>' (TLS handshake or connection failure)."""
    raw = socket.create_connection(("127.0.0.1", port), timeout=5)
    try:
        sock = context.wrap_socket(raw, server_hostname=SERVER_NAME) if context else raw
        headers = b"".join(_literal(k, v) for k, v in [
            (":method", "POST"), (":scheme", "https" if context else "http"), (":path", path),
            (":authority", SERVER_NAME), ("content-type", "application/grpc"), ("te", "trailers")])
        sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _frame(4, 0, 0, b"")
                     + _frame(1, 0x4, 1, headers) + _frame(0, 0x1, 1, b"\x00\x00\x00\x00\x00"))
        buffer = b""
        while True:
            data = sock.recv(65536)
            if not data:
                return "refused: connection closed"
            buffer += data
            while len(buffer) >= 9:
                length = int.from_bytes(buffer[:3], "big")
                if len(buffer) < 9 + length:
                    break
                kind, stream = buffer[3], int.from_bytes(buffer[5:9], "big") & 0x7FFFFFFF
                if kind == 4 and not buffer[4] & 1:
                    sock.sendall(_frame(4, 0x1, 0, b""))  # ACK the server's SETTINGS
                if kind == 1 and stream == 1:
                    return "answered"
                buffer = buffer[9 + length:]
    except (ssl.SSLError, ConnectionError, socket.timeout) as e:
        return f"refused: {e}"
    finally:
        raw.close()


def tls_context(ca, cert=None, key=None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(ca))
    context.set_alpn_protocols(["h2"])
    if cert:
        context.load_cert_chain(str(cert), str(key))
    return context


def test_clients_without_a_valid_certificate_are_refused_on_each_service(mtls_stack, pki):
    stack, tls = mtls_stack, pki["tls"]
    port = stack.ext_proc_port
    valid = tls_context(tls.ca, tls.client_cert, tls.client_key)
    clients = {
        "no certificate": tls_context(tls.ca),
        "certificate of another CA": tls_context(tls.ca, *pki["rogue"]),
        "plaintext": None,
    }
    for path in SERVICES:
        # The control: Envoy's certificate gets the call answered.
        assert grpc_call(port, path, valid) == "answered", (path, stack.logs())
        for name, context in clients.items():
            outcome = grpc_call(port, path, context)
            assert outcome.startswith("refused"), (path, name, outcome)
    # The sidecar is still serving Envoy.
    r = post(stack, "/v1/chat/completions", chat_body("mt"), key=KEYS["mt-a"])
    assert r.status_code == 200, (r.text, stack.logs())


def test_the_gateway_runs_over_mtls_from_gatewayctls_standalone_render(tmp_path, pki):
    """gatewayctl's standalone target with `sidecar.tls`: the sidecar config gets `tls`, the
    bootstrap's ext_proc cluster the transport socket; the rendered pair admits and meters."""
    import yaml  # noqa: PLC0415

    from stack import WASM_PATH, free_port, sha256_hex  # noqa: PLC0415
    from test_deploy import gatewayctl  # noqa: PLC0415

    tls, key, port = pki["tls"], new_api_key(), free_port()
    pools = [Pool("pool_r", ["sim/r"], ["--output-tokens", "3"])]
    out = tmp_path / "out"

    def gateway_config(stack: Stack) -> dict:
        return {
            "envoy": {"listen": "127.0.0.1:0", "admin_port": 0},
            "filter": {"wasm_file": str(WASM_PATH)},
            "sidecar": {"listen": f"127.0.0.1:{port}", "tls": {
                "server_name": tls.server_name, "cert_file": str(tls.server_cert),
                "key_file": str(tls.server_key), "client_ca_file": str(tls.ca),
                "envoy_cert_file": str(tls.client_cert), "envoy_key_file": str(tls.client_key),
                "ca_file": str(tls.ca)}},
            "redis": {"url": f"redis://127.0.0.1:{stack.redis_port}/0"},
            "tenants": [{"id": "mt-r", "api_keys_sha256": [sha256_hex(key)],
                         "limits": {"requests_per_minute": 1000}}],
            "models": [{"name": "r", "pool": "pool_r", "max_model_len": 4096, "served_model_name": "sim/r"}],
            "pools": [{"name": "pool_r", "endpoints": [u.removeprefix("http://") for u in stack.pool("pool_r").urls]}],
        }

    def rendered(name: str):
        def load(stack: Stack) -> dict:
            if not (out / "standalone" / name).exists():
                path = tmp_path / "gateway.yaml"
                path.write_text(yaml.safe_dump(gateway_config(stack), sort_keys=False))
                gatewayctl("render", "--config", str(path), "--out", str(out), "--target", "standalone")
            return yaml.safe_load((out / "standalone" / name).read_text())
        return load

    with Stack(tmp_path / "stack", pools, [Model("r", "pool_r", served_model_name="sim/r")],
               [Tenant("mt-r", [key], {"requests_per_minute": 1000})],
               sidecar_config_from=rendered("sidecar.yaml"), envoy_config_from=rendered("envoy.yaml")) as stack:
        sidecar = yaml.safe_load((out / "standalone" / "sidecar.yaml").read_text())
        assert sidecar["tls"]["client_ca_file"] == str(tls.ca)
        bootstrap = yaml.safe_load((out / "standalone" / "envoy.yaml").read_text())
        cluster = next(c for c in bootstrap["static_resources"]["clusters"] if c["name"] == "llm_gateway_ext_proc")
        assert cluster["transport_socket"]["typed_config"]["sni"] == SERVER_NAME
        r = post(stack, "/v1/chat/completions", chat_body("r"), key=key)
        assert r.status_code == 200, (r.text, stack.logs())
        client = redis.Redis(port=stack.redis_port, socket_timeout=2)
        assert wait_for(lambda: usage_hash(client, "mt-r").get("r:requests") == 1, timeout=30), stack.logs()
        # Without a client certificate the rendered sidecar refuses.
        assert grpc_call(stack.ext_proc_port, SERVICES[1], tls_context(tls.ca)).startswith("refused")
