"""Upstream stream faults, end to end: what the client sees, and that each request is settled and
recorded exactly once with sensible counts.

- a mid-stream disconnect of our simulator (`vllm-sim --fail-after-chunks 3`);
- PyPI `llmock` (a fault-injecting OpenAI mock, driven through its /_llmock/scenario API):
  truncation (a clean end without finish reason, usage or [DONE]), a dropped connection, a stall
  the client sits through, a stall the client gives up on, and a malformed (half JSON) event.

llmock answers in its `echo` style, one chunk per word: "Hello! You said: <prompt>". With
`after_chunks: 3` a fault hits the fourth event: the role chunk and two content chunks went out.
"""

from __future__ import annotations

import json

import httpx
import pytest
import redis

from helpers import auth, chat_body, post, sse_events, wait_for
from sidecar_checks import (
    END_COMPLETED,
    END_INCOMPLETE,
    SOURCE_STREAMED_CHUNKS,
    SOURCE_UPSTREAM,
    assert_tpm_settled,
    content_chunks,
    landed_events,
    usage_hash,
)
from stack import FILTER_NATIVE, Model, Pool, Stack, Tenant, new_api_key, upstream_metric

BIG = 1_000_000
TENANTS = ["sf-cut", "sf-truncate", "sf-disconnect", "sf-stall", "sf-stall-abort", "sf-malformed"]
KEYS = {t: new_api_key() for t in TENANTS}
PROMPT = "one two three four five six seven eight"
# "Hello! ", "You ", "said: " and the eight words.
ECHO_CHUNKS = 11


@pytest.fixture(scope="module", params=["wasm", "native"])
def faults_stack(request, tmp_path_factory):
    """The gateway with the wasm filter, then with the same filter as a dynamic module
    (filter-native/, whose usage record on a fault comes from its stream-complete hook)."""
    pools = [
        # Drops the connection after 3 content chunks of every stream.
        Pool("pool_cut", ["sim/cut"], ["--ttft-ms", "10", "--itl-ms", "20", "--output-tokens", "10",
                                       "--fail-after-chunks", "3"]),
        Pool("pool_mock", ["mock-model"], ["--response-style", "echo", "--stream-chunk-delay-ms", "10"],
             kind="llmock"),
        Pool("pool_plain", ["sim/plain"], ["--output-tokens", "2"]),
    ]
    models = [
        Model("cut", "pool_cut", served_model_name="sim/cut"),
        Model("mock", "pool_mock", served_model_name="mock-model"),
        Model("plain", "pool_plain", served_model_name="sim/plain"),
    ]
    tenants = [Tenant(t, [KEYS[t]], {"tokens_per_minute": 1, "token_burst": BIG}) for t in TENANTS]
    native = FILTER_NATIVE if request.param == "native" else None
    with Stack(tmp_path_factory.mktemp("faults"), pools, models, tenants, native_module=native) as s:
        s.redis = redis.Redis(port=s.redis_port)
        yield s


def llmock_url(stack) -> str:
    return stack.pool("pool_mock").urls[0]


def queue_fault(stack, **fault) -> None:
    r = httpx.post(llmock_url(stack) + "/_llmock/scenario",
                   json={"behaviors": [{"type": "stream_fault", "after_chunks": 3, "times": 1, **fault}]})
    assert r.status_code == 201, r.text


def llmock_last_request(stack) -> dict:
    """llmock's journal entry of the last request it served (fault applied, chunks sent)."""
    r = httpx.get(llmock_url(stack) + "/_llmock/requests", timeout=10)
    assert httpx.get(llmock_url(stack) + "/_llmock/scenario").json()["pending"] == [], "fault not consumed"
    return r.json()["requests"][-1]


def stream(stack, tenant: str, model: str, read_timeout: float = 10, **extra):
    """Streams a chat completion; returns (status, raw `data:` payloads, the exception that ended
    the stream or None)."""
    body = chat_body(model, PROMPT, stream=True, max_tokens=40, **extra)
    payloads, error = [], None
    timeout = httpx.Timeout(10, read=read_timeout)
    with httpx.stream("POST", stack.base_url + "/v1/chat/completions", json=body, headers=auth(KEYS[tenant]),
                      timeout=timeout) as r:
        status = r.status_code
        try:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    payloads.append(line[len("data: "):])
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.ReadTimeout) as e:
            error = e
    return status, payloads, error


def parsed(payloads: list[str]) -> list:
    return sse_events("data: " + p for p in payloads)


def the_record(stack, tenant: str, model: str) -> dict:
    """Waits for the tenant's one record, then makes sure it stays one: a later request of the
    tenant is recorded after it, and there is still exactly one record of `model`."""
    assert wait_for(lambda: usage_hash(stack.redis, tenant).get(f"{model}:requests"), timeout=10), \
        usage_hash(stack.redis, tenant)
    assert post(stack, "/v1/chat/completions", chat_body("plain", max_tokens=1), key=KEYS[tenant]).status_code == 200
    assert wait_for(lambda: usage_hash(stack.redis, tenant).get("plain:requests") == 1)
    h = usage_hash(stack.redis, tenant)
    assert h[f"{model}:requests"] == 1, h
    events = landed_events(stack.redis, tenant, 1, model=model)
    assert len(events) == 1, events
    [event] = events
    assert (h[f"{model}:prompt_tokens"], h[f"{model}:completion_tokens"]) == \
        (event["prompt_tokens"], event["completion_tokens"]), (h, event)
    assert event["status"] == 200, event
    return event


def assert_settled(stack, tenant: str) -> None:
    """The tenant's TPM bucket holds capacity minus what its records charged (refill: 1/min)."""
    assert_tpm_settled(stack.redis, tenant, BIG)


def estimate_only(event: dict) -> None:
    """No usage arrived: the prompt is the filter's estimate, the reservation less max_tokens."""
    assert event["usage_source"] == SOURCE_STREAMED_CHUNKS, event
    assert event["prompt_tokens"] == event["reserved_tokens"] - 40 > 0, event


# ------------------------------------------------------------------ vllm-sim


def test_upstream_disconnect_mid_stream(faults_stack):
    stack = faults_stack
    url = stack.pool("pool_cut").urls[0]
    generated_before = upstream_metric(url, "vllm:generation_tokens_total")
    status, payloads, error = stream(stack, "sf-cut", "cut")
    assert status == 200
    assert isinstance(error, httpx.RemoteProtocolError), f"the stream ended cleanly: {payloads}"
    assert "[DONE]" not in payloads
    assert content_chunks(parsed(payloads)) == 3
    event = the_record(stack, "sf-cut", "cut")
    generated = upstream_metric(url, "vllm:generation_tokens_total") - generated_before
    assert generated == 3
    assert event["completion_tokens"] == generated
    assert event["end_reason"] == END_INCOMPLETE, event
    estimate_only(event)
    assert_settled(stack, "sf-cut")


# ------------------------------------------------------------------ llmock


def test_truncated_stream(faults_stack):
    stack = faults_stack
    queue_fault(stack, kind="truncate")
    status, payloads, error = stream(stack, "sf-truncate", "mock")
    assert (status, error) == (200, None), error
    events = parsed(payloads)
    # Ends cleanly but early: no finish reason, no usage, no [DONE].
    assert "[DONE]" not in payloads
    assert content_chunks(events) == 2
    assert all(c.get("finish_reason") is None for e in events for c in e["choices"])
    upstream = llmock_last_request(stack)
    assert (upstream["fault"], upstream["chunks_sent"]) == ("stream:truncate@3", 3), upstream
    event = the_record(stack, "sf-truncate", "mock")
    assert event["completion_tokens"] == upstream["chunks_sent"] - 1 == 2, event
    # The HTTP response ended cleanly but without `data: [DONE]`: the record calls it incomplete,
    # with counts from the chunks, not from a usage the upstream never sent.
    assert event["end_reason"] == END_INCOMPLETE, event
    estimate_only(event)
    assert_settled(stack, "sf-truncate")


def test_dropped_connection(faults_stack):
    stack = faults_stack
    queue_fault(stack, kind="disconnect")
    status, payloads, error = stream(stack, "sf-disconnect", "mock")
    assert status == 200
    assert isinstance(error, httpx.RemoteProtocolError), f"the stream ended cleanly: {payloads}"
    assert content_chunks(parsed(payloads)) == 2
    upstream = llmock_last_request(stack)
    assert upstream["fault"] == "stream:disconnect@3", upstream
    event = the_record(stack, "sf-disconnect", "mock")
    assert event["completion_tokens"] == 2
    assert event["end_reason"] == END_INCOMPLETE, event
    estimate_only(event)
    assert_settled(stack, "sf-disconnect")


def test_stall_the_client_sits_through(faults_stack):
    stack = faults_stack
    queue_fault(stack, kind="stall", stall_seconds=1.0)
    status, payloads, error = stream(stack, "sf-stall", "mock", stream_options={"include_usage": True})
    assert (status, error) == (200, None), error
    events = parsed(payloads)
    assert events[-1] == "[DONE]"
    assert content_chunks(events) == ECHO_CHUNKS
    usage = [e["usage"] for e in events[:-1] if e.get("usage")]
    assert len(usage) == 1
    upstream = llmock_last_request(stack)
    assert upstream["fault"] == "stream:stall@3" and upstream["stall_waited"] >= 0.95, upstream
    event = the_record(stack, "sf-stall", "mock")
    assert (event["prompt_tokens"], event["completion_tokens"]) == \
        (usage[0]["prompt_tokens"], usage[0]["completion_tokens"]), (event, usage)
    assert (event["end_reason"], event["usage_source"]) == (END_COMPLETED, SOURCE_UPSTREAM), event
    # The first content came before the stall, the end after it.
    assert 0 < event["ttft_us"] < 950_000 <= event["duration_us"], event
    assert_settled(stack, "sf-stall")


def test_stall_the_client_gives_up_on(faults_stack):
    stack = faults_stack
    queue_fault(stack, kind="stall", stall_seconds=30.0)
    status, payloads, error = stream(stack, "sf-stall-abort", "mock", read_timeout=0.5)
    assert status == 200
    assert isinstance(error, httpx.ReadTimeout), error
    assert content_chunks(parsed(payloads)) == 2
    # Recorded when the client left, not when the upstream would have carried on.
    event = the_record(stack, "sf-stall-abort", "mock")
    assert event["completion_tokens"] == 2
    assert event["end_reason"] == END_INCOMPLETE, event
    assert event["duration_us"] < 5_000_000, event
    estimate_only(event)
    upstream = llmock_last_request(stack)
    assert upstream["fault"] == "stream:stall@3" and upstream["chunks_sent"] == 3, upstream
    assert_settled(stack, "sf-stall-abort")


def test_malformed_event(faults_stack):
    stack = faults_stack
    queue_fault(stack, kind="malformed")
    status, payloads, error = stream(stack, "sf-malformed", "mock", stream_options={"include_usage": True})
    assert (status, error) == (200, None), error
    # The half event reaches the client as the upstream sent it; the rest of the stream follows.
    bad = []
    for p in payloads[:-1]:
        try:
            json.loads(p)
        except ValueError:
            bad.append(p)
    assert len(bad) == 1 and bad[0].startswith("{") and payloads[3] == bad[0], payloads
    assert payloads[-1] == "[DONE]"
    good = parsed([p for p in payloads if p not in bad])
    assert content_chunks(good) == ECHO_CHUNKS - 1
    usage = [e["usage"] for e in good[:-1] if e.get("usage")]
    assert len(usage) == 1
    assert llmock_last_request(stack)["fault"] == "stream:malformed@3"
    event = the_record(stack, "sf-malformed", "mock")
    # The usage chunk came after the bad one: the upstream's counts are recorded.
    assert (event["prompt_tokens"], event["completion_tokens"]) == \
        (usage[0]["prompt_tokens"], usage[0]["completion_tokens"]), (event, usage)
    assert (event["end_reason"], event["usage_source"]) == (END_COMPLETED, SOURCE_UPSTREAM), event
    assert_settled(stack, "sf-malformed")
