"""An upstream that lies about usage, for the integration tests of the ledger's trust in its
upstreams (stdlib only: `http.server` on an ephemeral loopback port).

It answers `POST /v1/chat/completions` and `POST /v1/responses` by the served model name in the
body (what the filter rewrote `model` to), each a way an upstream's usage can be wrong or
unreadable:

| model | answer |
|---|---|
| `liar/huge` | JSON, `usage.prompt_tokens` 2^63 - 1 |
| `liar/completion` | JSON, `usage.completion_tokens` 10^12 |
| `liar/twice` | SSE: one content chunk, a final usage chunk of 1000/1000, then another of 1/1 |
| `liar/gzip` | JSON {10, 30}, gzip-coded when the request's `accept-encoding` allows gzip |
| `liar/always-gzip` | JSON {10, 30}, gzip-coded whatever the request asked |
| `liar/no-usage` | JSON without `usage` |
| `liar/cr` | SSE with bare `\\r` line ends, `"usage":null` in content chunks and a final usage chunk of {7, 2}, as vLLM sends it when asked |
| `liar/background` (`/v1/responses`) | a Responses `background: true` answer: `status: queued`, `usage: null` |
| anything else | JSON with `usage` {10, 30} |

`requests` keeps each request's path, headers (lower-case names) and JSON body, in arrival order.
"""

from __future__ import annotations

import gzip
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

HONEST_USAGE = {"prompt_tokens": 10, "completion_tokens": 30, "total_tokens": 40}


def _completion(model: str, usage: dict | None) -> dict:
    body = {"id": "chatcmpl-liar", "object": "chat.completion", "created": 1, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}]}
    if usage is not None:
        body["usage"] = usage
    return body


def _chunk(model: str, content: str | None, usage="null") -> str:
    choices = [] if content is None else [{"index": 0, "delta": {"content": content}, "finish_reason": None}]
    head = json.dumps({"id": "chatcmpl-liar", "object": "chat.completion.chunk", "created": 1, "model": model,
                       "choices": choices})
    return head[:-1] + f',"usage":{usage}}}'


class LyingUpstream:
    """The upstream, started on entry (`url`), stopped on exit."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        self._lock = threading.Lock()
        upstream = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                length = int(self.headers.get("content-length") or 0)
                raw = self.rfile.read(length)
                try:
                    body = json.loads(raw or b"{}")
                except ValueError:
                    body = {}
                with upstream._lock:
                    upstream.requests.append({"path": self.path,
                                              "headers": {k.lower(): v for k, v in self.headers.items()},
                                              "body": body})
                upstream._answer(self, body)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> "LyingUpstream":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def last_request(self, model: str) -> dict:
        with self._lock:
            return next(r for r in reversed(self.requests) if r["body"].get("model") == model)

    def _answer(self, h: BaseHTTPRequestHandler, body: dict) -> None:
        model = body.get("model", "")
        accepts_gzip = "gzip" in (h.headers.get("accept-encoding") or "")
        if model == "liar/huge":
            self._json(h, _completion(model, {"prompt_tokens": 2**63 - 1, "completion_tokens": 3,
                                              "total_tokens": 2**63 + 2}))
        elif model == "liar/completion":
            self._json(h, _completion(model, {"prompt_tokens": 10, "completion_tokens": 10**12,
                                              "total_tokens": 10**12 + 10}))
        elif model == "liar/twice":
            self._sse(h, [_chunk(model, "hi"),
                          _chunk(model, None, '{"prompt_tokens":1000,"completion_tokens":1000,"total_tokens":2000}'),
                          _chunk(model, None, '{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}'),
                          "[DONE]"], "\n")
        elif model in ("liar/gzip", "liar/always-gzip"):
            coded = model == "liar/always-gzip" or accepts_gzip
            self._json(h, _completion(model, HONEST_USAGE), coding="gzip" if coded else None)
        elif model == "liar/no-usage":
            self._json(h, _completion(model, None))
        elif model == "liar/cr":
            self._sse(h, [_chunk(model, "a"), _chunk(model, "b"),
                          _chunk(model, None, '{"prompt_tokens":7,"completion_tokens":2,"total_tokens":9}'),
                          "[DONE]"], "\r")
        elif model == "liar/background":
            self._json(h, {"id": "resp_liar", "object": "response", "created_at": 1, "model": model,
                           "status": "queued", "background": True, "output": [], "usage": None})
        else:
            self._json(h, _completion(model, HONEST_USAGE))

    @staticmethod
    def _json(h: BaseHTTPRequestHandler, obj: dict, coding: str | None = None) -> None:
        data = json.dumps(obj).encode()
        if coding == "gzip":
            data = gzip.compress(data)
        h.send_response(200)
        h.send_header("content-type", "application/json")
        if coding:
            h.send_header("content-encoding", coding)
        h.send_header("content-length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    @staticmethod
    def _sse(h: BaseHTTPRequestHandler, events: list[str], eol: str) -> None:
        data = "".join(f"data: {e}{eol}{eol}" for e in events).encode()
        h.send_response(200)
        h.send_header("content-type", "text/event-stream")
        h.send_header("content-length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)
