"""Small HTTP helpers shared by the integration tests."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request

import httpx


def chat_body(model: str, content: str = "Hello there", **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": content}], **extra}


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def post(stack, path: str, body, key: str | None = None, headers: dict | None = None, timeout: float = 10) -> httpx.Response:
    h = dict(headers or {})
    if key:
        h.update(auth(key))
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    h.setdefault("content-type", "application/json")
    return httpx.post(stack.base_url + path, content=content, headers=h, timeout=timeout)


def assert_openai_error(response: httpx.Response, status: int, code: str | None = None, param: str | None = None) -> dict:
    """Asserts an OpenAI-shaped error: {"error": {"message", "type", "param", "code"}}."""
    assert response.status_code == status, (response.status_code, response.text)
    assert response.headers["content-type"].startswith("application/json"), response.headers
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    if code is not None:
        assert error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error
    return error


def sse_events(lines) -> list[dict | str]:
    """Parses `data:` events of an SSE body (already split in lines)."""
    events = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.05):
    """Polls `predicate` until it returns a truthy value or the deadline passes."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    return last


def envoy_stats(stack, pattern: str) -> str:
    """Envoy's stats whose names match the regex `pattern` (admin /stats), for failure messages."""
    with urllib.request.urlopen(f"{stack.admin_url}/stats?filter={pattern}", timeout=2) as r:
        return r.read().decode()


def envoy_counter(stack, name: str) -> int:
    """One Envoy stat (admin /stats, exact name), 0 when absent."""
    text = envoy_stats(stack, f"^{name}$").strip()
    return int(text.rsplit(": ", 1)[1]) if text else 0


def connect(stack) -> socket.socket:
    """A raw TCP connection to the stack's listener."""
    port = int(stack.base_url.rsplit(":", 1)[1])
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def start_slow_body(stack, key: str, model: str) -> socket.socket:
    """A chat request whose headers are complete and whose body (100,000 bytes declared) has only
    begun: it holds one of the tenant's upload slots until the connection closes."""
    conn = connect(stack)
    conn.sendall((
        "POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer " + key +
        "\r\ncontent-type: application/json\r\ncontent-length: 100000\r\n\r\n{\"model\": \"" + model + "\", "
    ).encode())
    return conn


def stream_in_background(base_url: str, body: dict, headers: dict, timeout: float = 20):
    """Sends a streamed chat request on a thread; returns (thread, events, first_chunk): the SSE
    events as they arrive (`sse_events`), and an Event set once the first line came."""
    events: list = []
    first_chunk = threading.Event()

    def stream():
        with httpx.stream("POST", base_url + "/v1/chat/completions", json=body, headers=headers,
                          timeout=timeout) as r:
            for line in r.iter_lines():
                events.extend(sse_events([line]))
                first_chunk.set()

    thread = threading.Thread(target=stream)
    thread.start()
    return thread, events, first_chunk
