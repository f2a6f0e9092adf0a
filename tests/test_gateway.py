"""The gateway end to end: real envoy + wasm filter + ext_proc sidecar + redis-server + upstreams.

Each test asserts what a client sees (status, headers, body) and, where it matters, what the
upstream saw (its request counter) and what Redis holds.
"""

from __future__ import annotations

import datetime
import time

import httpx
import openai
import pytest
import redis

from helpers import assert_openai_error, auth, chat_body, envoy_stats, post, sse_events, wait_for
from stack import Model, Pool, Stack, Tenant, upstream_metric



def received(stack, pool: str) -> float:
    return stack.requests_received(pool)


# ------------------------------------------------------------------ authentication


def test_missing_api_key_is_401(stack):
    r = post(stack, "/v1/chat/completions", chat_body("alpha"))
    error = assert_openai_error(r, 401, code="invalid_api_key")
    assert error["type"] == "invalid_request_error"


def test_wrong_api_key_is_401_and_never_echoed(stack, keys):
    wrong = keys["acme"] + "x"
    r = post(stack, "/v1/chat/completions", chat_body("alpha"), key=wrong)
    assert_openai_error(r, 401, code="invalid_api_key")
    assert wrong not in r.text


def test_x_api_key_header_is_accepted(stack, keys):
    r = post(stack, "/v1/chat/completions", chat_body("alpha"), headers={"x-api-key": keys["acme"]})
    assert r.status_code == 200, r.text


def test_spoofed_gateway_headers_are_dropped(stack, keys):
    before_alpha, before_beta = received(stack, "pool_alpha"), received(stack, "pool_beta")
    # Without a key, a client-sent tenant header authenticates nobody.
    r = post(stack, "/v1/chat/completions", chat_body("alpha"), headers={"x-gateway-tenant": "acme"})
    assert_openai_error(r, 401)
    # A client-sent pool header does not steer routing: alpha still reaches alpha's pool.
    r = post(stack, "/v1/chat/completions", chat_body("alpha"), key=keys["acme"],
             headers={"x-gateway-pool": "pool_beta", "x-gateway-tenant": "tiny"})
    assert r.status_code == 200, r.text
    assert received(stack, "pool_alpha") == before_alpha + 1
    assert received(stack, "pool_beta") == before_beta


# ------------------------------------------------------------------ completions


def test_non_streaming_chat_completion(stack, keys):
    r = post(stack, "/v1/chat/completions", chat_body("alpha", max_tokens=6), key=keys["acme"])
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["choices"][0]["message"]["content"]
    assert body["usage"]["completion_tokens"] == 6
    assert body["usage"]["prompt_tokens"] > 0
    # OpenAI's rate-limit headers on an admitted response.
    assert r.headers["x-ratelimit-limit-requests"] == "100000"
    assert int(r.headers["x-ratelimit-remaining-requests"]) < 100000
    assert r.headers["x-ratelimit-limit-tokens"] == "100000000"
    assert "x-ratelimit-reset-tokens" in r.headers


def test_completions_endpoint(stack, keys):
    r = post(stack, "/v1/completions", {"model": "beta", "prompt": "Once upon a time", "max_tokens": 3},
             key=keys["acme"])
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"]
    assert r.json()["usage"]["completion_tokens"] == 3


def test_streaming_is_not_buffered(stack, keys):
    """The first chunk reaches the client while the upstream is still generating."""
    body = chat_body("slow", stream=True)
    started = time.monotonic()
    first_content_at = None
    events = []
    with httpx.stream("POST", stack.base_url + "/v1/chat/completions", json=body, headers=auth(keys["acme"]),
                      timeout=10) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            parsed = sse_events([line])
            if parsed and parsed[0] != "[DONE]" and parsed[0]["choices"] and \
                    parsed[0]["choices"][0]["delta"].get("content") and first_content_at is None:
                first_content_at = time.monotonic() - started
            events += parsed
    total = time.monotonic() - started
    # 20 tokens 50 ms apart: the upstream needs about a second for the whole stream.
    assert total >= 0.9, total
    assert first_content_at is not None and first_content_at < total - 0.5, (first_content_at, total)
    assert events[-1] == "[DONE]"
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    content_chunks = [e for e in events[:-1] if e["choices"] and e["choices"][0]["delta"].get("content")]
    assert len(content_chunks) == 20


def test_each_model_reaches_its_own_pool(stack, keys):
    counts = {p: received(stack, p) for p in ("pool_alpha", "pool_beta")}
    for model, pool, other in (("alpha", "pool_alpha", "pool_beta"), ("beta", "pool_beta", "pool_alpha")):
        r = post(stack, "/v1/chat/completions", chat_body(model), key=keys["acme"])
        assert r.status_code == 200, r.text
        # The filter rewrote the public name to the pool's served model name.
        assert r.json()["model"] == f"sim/{model}"
        counts[pool] += 1
        assert received(stack, pool) == counts[pool]
        assert received(stack, other) == counts[other]


def test_unknown_model_is_404(stack, keys):
    r = post(stack, "/v1/chat/completions", chat_body("no-such-model"), key=keys["acme"])
    assert_openai_error(r, 404, code="model_not_found", param="model")


# ------------------------------------------------------------------ context length


def test_over_long_prompt_is_400_before_the_upstream(stack, keys):
    before = received(stack, "pool_alpha")
    # 1 MiB of text is at least 8,192 tokens with 128-byte tokens: over alpha's 4,096 context.
    r = post(stack, "/v1/chat/completions", chat_body("alpha", "a" * (1 << 20), max_tokens=16),
             key=keys["acme"], timeout=30)
    error = assert_openai_error(r, 400, code="context_length_exceeded")
    assert "4096" in error["message"]
    assert received(stack, "pool_alpha") == before


def test_body_over_the_limit_is_413(stack, keys):
    r = post(stack, "/v1/chat/completions", chat_body("alpha", "a" * (5 << 20)), key=keys["acme"], timeout=30)
    assert_openai_error(r, 413)


def test_invalid_json_is_400(stack, keys):
    r = post(stack, "/v1/chat/completions", b"{not json", key=keys["acme"])
    error = assert_openai_error(r, 400)
    assert error["type"] == "invalid_request_error"


# ------------------------------------------------------------------ rate limits


def test_429_with_retry_after_once_rpm_is_spent(stack, keys):
    remaining = []
    for _ in range(3):
        r = post(stack, "/v1/chat/completions", chat_body("alpha"), key=keys["tiny"])
        assert r.status_code == 200, r.text
        remaining.append(int(r.headers["x-ratelimit-remaining-requests"]))
    assert remaining == [2, 1, 0]
    before = received(stack, "pool_alpha")
    r = post(stack, "/v1/chat/completions", chat_body("alpha"), key=keys["tiny"])
    error = assert_openai_error(r, 429, code="rate_limit_exceeded")
    assert error["type"] == "requests"
    # 3 per minute refill one every 20 s.
    assert 1 <= int(r.headers["retry-after"]) <= 20
    assert r.headers["x-ratelimit-limit-requests"] == "3"
    assert r.headers["x-ratelimit-remaining-requests"] == "0"
    assert received(stack, "pool_alpha") == before


# ------------------------------------------------------------------ metering


def usage_hash(stack, tenant: str) -> dict[str, int]:
    day = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    client = redis.Redis(port=stack.redis_port, decode_responses=True)
    return {k: int(v) for k, v in client.hgetall(f"llmgw:usage:{{{tenant}}}:{day}").items()}


@pytest.fixture(scope="module")
def ext_proc_metered_stack(tmp_path_factory, keys):
    """The gateway metered by the observability-mode ext_proc filter instead of the access log
    (how Envoy Gateway is rendered), with the metering test's pool, model and tenant."""
    pools = [Pool("pool_meter", ["sim/metered"], ["--output-tokens", "7"])]
    models = [Model("metered", "pool_meter", 4096, served_model_name="sim/metered")]
    tenants = [Tenant("meter", [keys["meter"]], {"requests_per_minute": 1000, "tokens_per_minute": 1000000})]
    with Stack(tmp_path_factory.mktemp("ext-proc-metering"), pools, models, tenants, metering="ext_proc") as s:
        yield s


@pytest.mark.parametrize("metering", ["access_log", "ext_proc"])
def test_usage_recorded_in_redis_equals_upstreams(request, metering, keys):
    stack = request.getfixturevalue("stack" if metering == "access_log" else "ext_proc_metered_stack")
    url = stack.pool("pool_meter").urls[0]
    prompt_before = upstream_metric(url, "vllm:prompt_tokens_total")
    generated_before = upstream_metric(url, "vllm:generation_tokens_total")
    seen = {"prompt_tokens": 0, "completion_tokens": 0}
    # Non-streaming.
    r = post(stack, "/v1/chat/completions", chat_body("metered", "count me"), key=keys["meter"])
    assert r.status_code == 200, r.text
    for k in seen:
        seen[k] += r.json()["usage"][k]
    # Streaming with usage asked for by the client.
    body = chat_body("metered", "stream me please", stream=True, stream_options={"include_usage": True})
    with httpx.stream("POST", stack.base_url + "/v1/chat/completions", json=body, headers=auth(keys["meter"]),
                      timeout=10) as r:
        events = sse_events(list(r.iter_lines()))
    usage = [e["usage"] for e in events if e != "[DONE]" and e.get("usage")]
    assert len(usage) == 1
    for k in seen:
        seen[k] += usage[0][k]
    # Streaming without usage: the gateway still meters it exactly.
    body = chat_body("metered", "and me", stream=True, max_tokens=4)
    with httpx.stream("POST", stack.base_url + "/v1/chat/completions", json=body, headers=auth(keys["meter"]),
                      timeout=10) as r:
        assert r.status_code == 200
        list(r.iter_lines())
    upstream_prompt = upstream_metric(url, "vllm:prompt_tokens_total") - prompt_before
    upstream_generated = upstream_metric(url, "vllm:generation_tokens_total") - generated_before
    assert upstream_generated == seen["completion_tokens"] + 4

    expected = {
        "metered:requests": 3,
        "metered:prompt_tokens": int(upstream_prompt),
        "metered:completion_tokens": int(upstream_generated),
    }
    recorded = wait_for(lambda: (h := usage_hash(stack, "meter")) and h.get("metered:requests") == 3 and h)
    # On a failure, say where records went: Envoy's gRPC access-log counters and the sidecar's
    # usage events of the tenant.
    assert recorded, (usage_hash(stack, "meter"), envoy_stats(stack, "access_log"))
    assert {k: recorded.get(k) for k in expected} == expected, (
        envoy_stats(stack, "access_log"), redis.Redis(port=stack.redis_port).xrange("llmgw:usage-events"))

    client = redis.Redis(port=stack.redis_port)
    events = [fields for _, fields in client.xrange("llmgw:usage-events") if fields[b"tenant"] == b"meter"]
    assert len(events) == 3


def test_rejected_requests_are_not_metered(stack, keys):
    post(stack, "/v1/chat/completions", chat_body("no-such-model"), key=keys["restricted"])
    r = post(stack, "/v1/chat/completions", chat_body("alpha"), key=keys["restricted"])
    assert_openai_error(r, 403, param="model")
    r = post(stack, "/v1/chat/completions", chat_body("beta"), key=keys["restricted"])
    assert r.status_code == 200
    recorded = wait_for(lambda: usage_hash(stack, "restricted").get("beta:requests"))
    assert recorded == 1
    assert usage_hash(stack, "restricted").get("alpha:requests") is None


# ------------------------------------------------------------------ the official SDK


def test_openai_sdk_streams_through_the_gateway(stack, keys):
    client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key=keys["acme"], max_retries=0, timeout=10)
    stream = client.chat.completions.create(
        model="beta", messages=[{"role": "user", "content": "Say hi"}], stream=True,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip()
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    # No usage chunk reaches a client that did not ask for one.
    assert all(c.usage is None for c in chunks)

    completion = client.chat.completions.create(model="alpha", messages=[{"role": "user", "content": "Hi"}])
    assert completion.usage.completion_tokens > 0

    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=stack.base_url + "/v1", api_key="sk-wrong", max_retries=0).models.list()
