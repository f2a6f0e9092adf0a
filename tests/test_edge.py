"""The edge settings of envoy/bootstrap.yaml (real Envoy, wasm filter, sidecar, redis-server,
vllm-sim): what each one refuses, and that none of them cuts what a client may do.

The stack's Envoy runs with short timeouts and small limits (`edge=`), so that each refusal is
seen within seconds; gatewayctl renders the same settings from `envoy.edge`
(tests/test_deploy.py runs what it renders). What they protect under load is measured by
bench/edge_attack.py (docs/deploy.md, "Edge settings").
"""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from helpers import auth, chat_body, connect, post, start_slow_body, wait_for
from stack import Model, Pool, Stack, Tenant, new_api_key

KEY, OTHER_KEY = new_api_key(), new_api_key()
MAX_UPLOADS = 2
HEADERS_TIMEOUT_S, REQUEST_TIMEOUT_S = 1, 2
MAX_CONNECTIONS = 8


@pytest.fixture(scope="module")
def edge_stack(tmp_path_factory):
    # Streams last 30 tokens x 100 ms = 3 s, longer than the request timeout.
    pools = [Pool("pool_e", ["sim/e"], ["--itl-ms", "100", "--output-tokens", "30"])]
    models = [Model("e", "pool_e", served_model_name="sim/e")]
    edge = {
        "REQUEST_HEADERS_TIMEOUT": f"{HEADERS_TIMEOUT_S}s",
        "REQUEST_TIMEOUT": f"{REQUEST_TIMEOUT_S}s",
        "MAX_DOWNSTREAM_CONNECTIONS": MAX_CONNECTIONS,
    }
    tenants = [Tenant("edge", [KEY]), Tenant("other", [OTHER_KEY])]
    with Stack(tmp_path_factory.mktemp("edge"), pools, models, tenants, envoy_concurrency=1, edge=edge,
               filter_extra={"max_uploads_per_tenant": MAX_UPLOADS}) as s:
        yield s


def read_until_closed(conn: socket.socket, timeout: float = 10) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and the seconds it took."""
    conn.settimeout(timeout)
    start, out = time.monotonic(), b""
    while True:
        try:
            chunk = conn.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        out += chunk
    return out, time.monotonic() - start


def received(s: Stack) -> float:
    return s.requests_received("pool_e")


def test_slow_headers_are_answered_408_and_closed(edge_stack):
    """A client that never finishes its headers is answered 408 once request_headers_timeout has
    run out, and the connection is closed; the upstream never sees it."""
    s = edge_stack
    before = received(s)
    conn = connect(s)
    conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer ")
    out, took = read_until_closed(conn)
    assert out.startswith(b"HTTP/1.1 408 "), (out, s.envoy_log())
    assert HEADERS_TIMEOUT_S * 0.8 <= took < REQUEST_TIMEOUT_S + 5, took
    assert received(s) == before


def test_a_trickled_body_is_answered_408_and_never_admitted(edge_stack):
    """Headers on time, then a body that never completes: 408 after request_timeout, and neither
    the upstream nor the admission saw it."""
    s = edge_stack
    before = received(s)
    conn = connect(s)
    conn.sendall((
        "POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer " + KEY +
        "\r\ncontent-type: application/json\r\ncontent-length: 4194304\r\n\r\n{\"model\": \"e\", "
    ).encode())
    out, took = read_until_closed(conn)
    assert out.startswith(b"HTTP/1.1 408 "), (out, s.envoy_log())
    assert REQUEST_TIMEOUT_S * 0.8 <= took < REQUEST_TIMEOUT_S + 5, took
    assert received(s) == before


def test_a_stream_longer_than_the_request_timeout_is_not_cut(edge_stack):
    """request_timeout covers receiving the request only: a streamed completion that lasts past it
    (3 s against 2 s) ends normally: every token, the finish reason and [DONE]."""
    s = edge_stack
    start = time.monotonic()
    lines = []
    with httpx.stream("POST", s.base_url + "/v1/chat/completions", headers=auth(KEY), timeout=20,
                      json=chat_body("e", stream=True)) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line]
    assert time.monotonic() - start > REQUEST_TIMEOUT_S
    assert lines[-1] == "data: [DONE]", lines[-3:]
    assert '"finish_reason":"stop"' in lines[-2], lines[-2]
    assert sum('"content":' in line for line in lines) >= 30, lines


@pytest.mark.parametrize("request_line, extra, status", [
    # A header with an underscore could be read as its dash twin further on.
    ("GET /v1/models HTTP/1.1", "x_api_key: k\r\n", 400),
    # An escaped slash or backslash is refused, never decoded into a path.
    ("GET /v1%2Fmodels HTTP/1.1", "", 400),
    ("GET /v1%5Cmodels HTTP/1.1", "", 400),
    # Dot segments are normalized before the filter sees the path...
    ("GET /v1/../v1/./models HTTP/1.1", "", 200),
    # ...and `//` is kept as sent: the filter matches paths exactly.
    ("GET //v1/models HTTP/1.1", "", 404),
])
def test_paths_and_header_names(edge_stack, request_line, extra, status):
    s = edge_stack
    conn = connect(s)
    conn.sendall(f"{request_line}\r\nHost: gw\r\nAuthorization: Bearer {KEY}\r\n{extra}"
                 "Connection: close\r\n\r\n".encode())
    out, _ = read_until_closed(conn)
    assert out.startswith(f"HTTP/1.1 {status} ".encode()), (out[:300], s.envoy_log())


def test_connections_past_the_global_limit_are_closed(edge_stack):
    """The overload manager's global downstream connection limit: with MAX_CONNECTIONS open,
    the next connection is closed at once, and once they close a request goes through again."""
    s = edge_stack
    held = []
    try:
        for _ in range(MAX_CONNECTIONS):
            c = connect(s)
            # A request each, so that every connection is surely accepted before the next.
            c.sendall(f"GET /v1/models HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer {KEY}\r\n\r\n".encode())
            c.settimeout(10)
            assert c.recv(65536).startswith(b"HTTP/1.1 200 ")
            held.append(c)
        extra = connect(s)
        extra.sendall(f"GET /v1/models HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer {KEY}\r\n\r\n".encode())
        out, _ = read_until_closed(extra)
        assert out == b"", (out[:200], s.envoy_log())
    finally:
        for c in held:
            c.close()
    assert wait_for(lambda: httpx.get(s.base_url + "/v1/models", headers=auth(KEY), timeout=5).status_code == 200,
                    timeout=30)


def test_one_key_cannot_hold_more_than_its_upload_slots(edge_stack):
    """The filter's max_uploads_per_tenant (2 here, one Envoy worker): with two slow bodies of a
    tenant in progress its next request is answered 429 at once, with Retry-After; another tenant
    is not affected; once a slow body's connection goes away the tenant is served again."""
    s = edge_stack
    slow = [start_slow_body(s, KEY, "e") for _ in range(MAX_UPLOADS)]
    try:
        # The slots are taken when Envoy has run the filter on each one's headers.
        def refused():
            r = post(s, "/v1/chat/completions", chat_body("e"), KEY)
            return r if r.status_code == 429 else None
        r = wait_for(refused, timeout=30)
        assert r is not None, s.envoy_log()
        assert r.headers.get("retry-after") == "1", r.headers
        assert r.json()["error"]["code"] == "rate_limit_exceeded", r.text
        assert post(s, "/v1/chat/completions", chat_body("e"), OTHER_KEY).status_code == 200
    finally:
        slow[0].close()
    assert wait_for(lambda: post(s, "/v1/chat/completions", chat_body("e"), KEY).status_code == 200, timeout=30)
    for c in slow[1:]:
        c.close()
