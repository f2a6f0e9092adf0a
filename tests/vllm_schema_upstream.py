"""A vLLM-shaped upstream for the differential parser test (tests/test_parser_differential.py):
FastAPI + pydantic v2 (lax mode, as vLLM's OpenAI server), with the request models reduced to the
fields the gateway reads.

The models follow `vllm/entrypoints/openai/protocol.py` of vLLM at commit 0052bed3 (the v0.10
line; `OpenAIBaseModel` with `extra="allow"`, `StreamOptions` with `include_usage` defaulting to
true, `ChatCompletionRequest`, `CompletionRequest`): the types and defaults of the fields the
gateway reads, and the `stream_options`-needs-`stream` validator. Chat takes `max_completion_tokens
or max_tokens`, as vLLM's serving code does; `best_of` > 1 is refused, as vLLM V1's engine
(`vLLM V1 does not yet support best_of`). `messages` is modelled loosely (each an object with a string `role` and an optional string
or list `content`, other keys allowed), where vLLM uses OpenAI's TypedDicts. The body is parsed as
FastAPI does (`json.loads` of the bytes, then validation of the Python value), and validation
errors are vLLM's 400.

Each request is recorded (`GET /_records`): the `x-diff-id` header the test sent, the pool this
process serves, the `x-gateway-*` headers the filter set, and what pydantic read (model, max tokens,
n, best_of, stream, include_usage, the prompt or messages), or the validation error.

Run: `python tests/vllm_schema_upstream.py --port PORT --pool NAME`.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any, Optional, Union

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, model_validator


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(OpenAIBaseModel):
    include_usage: Optional[bool] = True
    continuous_usage_stats: Optional[bool] = False


class Message(OpenAIBaseModel):
    role: str
    content: Optional[Union[str, list[dict[str, Any]]]] = None


def _stream_options_need_stream(data: Any) -> Any:
    if isinstance(data, dict) and data.get("stream_options") and not data.get("stream"):
        raise ValueError("Stream options can only be defined when `stream=True`.")
    return data


class ChatCompletionRequest(OpenAIBaseModel):
    messages: list[Message]
    model: Optional[str] = None
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    n: Optional[int] = 1
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    best_of: Optional[int] = None  # a vLLM extra parameter of chat too

    @model_validator(mode="before")
    @classmethod
    def check_stream_options(cls, data: Any) -> Any:
        return _stream_options_need_stream(data)


class CompletionRequest(OpenAIBaseModel):
    model: Optional[str] = None
    prompt: Optional[Union[list[int], list[list[int]], str, list[str]]] = None
    best_of: Optional[int] = None
    max_tokens: Optional[int] = 16
    n: int = 1
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None

    @model_validator(mode="before")
    @classmethod
    def check_stream_options(cls, data: Any) -> Any:
        return _stream_options_need_stream(data)


def build_app(pool: str) -> FastAPI:
    app = FastAPI()
    records: list[dict] = []

    def gateway_headers(request: Request) -> dict:
        return {k: v for k, v in request.headers.items() if k.startswith("x-gateway-")}

    @app.exception_handler(RequestValidationError)
    async def refused(request: Request, exc: RequestValidationError):
        records.append({"diff_id": request.headers.get("x-diff-id"), "pool": pool,
                        "gateway": gateway_headers(request), "refused": str(exc.errors())[:500]})
        return JSONResponse({"error": {"message": "validation", "type": "BadRequestError", "param": None,
                                       "code": 400}}, status_code=400)

    def record(request: Request, req: BaseModel, max_tokens, best_of, prompt) -> None:
        so = req.stream_options
        records.append({
            "diff_id": request.headers.get("x-diff-id"), "pool": pool, "gateway": gateway_headers(request),
            "model": req.model, "max_tokens": max_tokens, "n": req.n, "best_of": best_of,
            "stream": req.stream, "include_usage": None if so is None else so.include_usage,
            "prompt": prompt,
        })

    def reply(req, kind: str):
        usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
        if not req.stream:
            choice = ({"index": 0, "message": {"role": "assistant", "content": "x"}, "finish_reason": "length"}
                      if kind == "chat" else {"index": 0, "text": "x", "finish_reason": "length"})
            return JSONResponse({"id": "d", "object": kind, "created": int(time.time()), "model": req.model,
                                 "choices": [choice], "usage": usage})

        def events():
            delta = ({"index": 0, "delta": {"content": "x"}, "finish_reason": "length"} if kind == "chat"
                     else {"index": 0, "text": "x", "finish_reason": "length"})
            yield f"data: {json.dumps({'id': 'd', 'model': req.model, 'choices': [delta]})}\n\n"
            if req.stream_options and req.stream_options.include_usage:
                yield f"data: {json.dumps({'id': 'd', 'model': req.model, 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    def v1_refuses(req, request: Request):
        if req.best_of is not None and req.best_of > 1:
            records.append({"diff_id": request.headers.get("x-diff-id"), "pool": pool,
                            "gateway": gateway_headers(request), "refused": "best_of > 1 (vLLM V1)"})
            return JSONResponse({"error": {"message": "vLLM V1 does not yet support best_of.",
                                           "type": "BadRequestError", "param": None, "code": 400}}, status_code=400)
        return None

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request):
        if (r := v1_refuses(req, request)) is not None:
            return r
        # vLLM: `max_tokens = self.max_completion_tokens or self.max_tokens`.
        record(request, req, req.max_completion_tokens or req.max_tokens, req.best_of,
               [m.model_dump(exclude_unset=True) for m in req.messages])
        return reply(req, "chat")

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        if (r := v1_refuses(req, request)) is not None:
            return r
        record(request, req, req.max_tokens, req.best_of, req.prompt)
        return reply(req, "text_completion")

    @app.get("/_records")
    async def get_records():
        # ASCII JSON: a prompt may hold a lone surrogate (`\ud800`), which Python's `json` takes.
        return Response(json.dumps(records, ensure_ascii=True), media_type="application/json")

    @app.get("/health")
    async def health():
        return {}

    return app


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--pool", required=True)
    a = ap.parse_args()
    uvicorn.run(build_app(a.pool), host="127.0.0.1", port=a.port, log_level="warning")


if __name__ == "__main__":
    main()
