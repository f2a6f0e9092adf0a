"""Non-streaming responses are billed, end to end (real Envoy, wasm filter, sidecar, redis-server,
vllm-sim):

- a JSON response far larger than any buffer (chat `logprobs` with 20 `top_logprobs` per token, over
  4 MiB) is recorded with the upstream's `usage`, through the access log and through the ext_proc
  metering stream alike (the meter scans the body for its top-level `usage`, holding none of it);
- a non-streaming request whose client leaves before the response headers (the upstream has the
  request and is generating) is charged its reservation, marked `usage_source` reservation: its TPM
  bucket stays where the reservation left it;
- a request that never reached the upstream is charged nothing: one refused with a 429 leaves no
  record, and one admitted but abandoned while Envoy waited for an upstream connection (the pool's
  only connection busy) is recorded with 0 tokens and its reservation given back.

Buckets refill 1 token per minute with a large burst, so their arithmetic is exact.
"""

from __future__ import annotations

import threading

import httpx
import pytest
import redis

from helpers import auth, chat_body, post, wait_for
from sidecar_checks import (
    END_COMPLETED,
    END_INCOMPLETE,
    SOURCE_STREAMED_CHUNKS,
    SOURCE_UPSTREAM,
    bucket,
    bucket_key,
    usage_events,
)
from stack import Model, Pool, Stack, Tenant, new_api_key, upstream_metric

BIG = 1_000_000
SOURCE_RESERVATION = 3
TENANTS = ["jm-big", "jm-gone", "jm-holder", "jm-unsent", "jm-refused"]
KEYS = {t: new_api_key() for t in TENANTS}
CONTEXT = 65536
# Tokens of the large response: about 1 KiB of logprobs JSON each.
BIG_TOKENS = 5000


class SingleConnectionStack(Stack):
    """The stack, with the `pool_single` cluster limited to one upstream connection (Envoy's
    circuit breaker): a second request waits in Envoy's pending queue, not yet sent upstream.
    One Envoy worker: each worker's pool may open one connection past the breaker."""

    def envoy_config(self) -> dict:
        config = super().envoy_config()
        for cluster in config["static_resources"]["clusters"]:
            if cluster["name"] == "pool_single":
                cluster["circuit_breakers"]["thresholds"][0]["max_connections"] = 1
        return config


def pools() -> list[Pool]:
    return [
        Pool("pool_big", ["sim/big"], ["--output-tokens", "4"], max_model_len=CONTEXT),
        # A non-streamed response's headers come with its body, after the tokens: 3 s here.
        Pool("pool_wait", ["sim/wait"], ["--ttft-ms", "3000", "--output-tokens", "4"]),
        Pool("pool_single", ["sim/single"], ["--ttft-ms", "3000", "--output-tokens", "4"]),
    ]


def models() -> list[Model]:
    return [
        Model("big", "pool_big", CONTEXT, served_model_name="sim/big"),
        Model("wait", "pool_wait", served_model_name="sim/wait"),
        Model("single", "pool_single", served_model_name="sim/single"),
    ]


def tenants() -> list[Tenant]:
    limited = [Tenant(t, [KEYS[t]], {"tokens_per_minute": 1, "token_burst": BIG}) for t in TENANTS[:-1]]
    refused = {"requests_per_minute": 1, "tokens_per_minute": 1, "token_burst": BIG}
    return limited + [Tenant("jm-refused", [KEYS["jm-refused"]], refused)]


@pytest.fixture(scope="module")
def json_stack(tmp_path_factory):
    with SingleConnectionStack(tmp_path_factory.mktemp("json-metering"), pools(), models(), tenants(),
                               envoy_concurrency=1) as s:
        s.redis = redis.Redis(port=s.redis_port)
        yield s


@pytest.fixture(scope="module")
def json_ext_proc_stack(tmp_path_factory):
    with Stack(tmp_path_factory.mktemp("json-metering-ext-proc"), pools()[:2], models()[:2], tenants()[:2],
               metering="ext_proc") as s:
        s.redis = redis.Redis(port=s.redis_port)
        yield s


def one_event(stack, tenant: str) -> dict:
    assert wait_for(lambda: usage_events(stack.redis, tenant), timeout=30), f"no usage record for {tenant}"
    events = usage_events(stack.redis, tenant)
    assert len(events) == 1, events
    return events[0]


def tpm(stack, tenant: str) -> float | None:
    b = bucket(stack.redis, bucket_key(tenant, "tpm"))
    return b[0] if b else None


def settles_at(stack, tenant: str, expected: float) -> None:
    """The tenant's TPM bucket ends at `expected` (refill: 1 token a minute)."""
    assert wait_for(lambda: (t := tpm(stack, tenant)) is not None and expected - 0.01 <= t <= expected + 2,
                    timeout=10), (tpm(stack, tenant), expected)


@pytest.mark.parametrize("metering", ["access_log", "ext_proc"])
def test_a_json_response_over_4_mib_is_metered_from_its_usage(request, metering):
    stack = request.getfixturevalue("json_stack" if metering == "access_log" else "json_ext_proc_stack")
    url = stack.pool("pool_big").urls[0]
    generated_before = upstream_metric(url, "vllm:generation_tokens_total")
    body = chat_body("big", "tell me everything", max_tokens=BIG_TOKENS, ignore_eos=True, logprobs=True,
                     top_logprobs=20)
    r = post(stack, "/v1/chat/completions", body, key=KEYS["jm-big"], timeout=60)
    assert r.status_code == 200, r.text[:500]
    assert len(r.content) > 4 << 20, len(r.content)
    usage = r.json()["usage"]
    assert usage["completion_tokens"] == BIG_TOKENS == len(r.json()["choices"][0]["logprobs"]["content"])
    assert upstream_metric(url, "vllm:generation_tokens_total") - generated_before == BIG_TOKENS
    event = one_event(stack, "jm-big")
    assert (event["prompt_tokens"], event["completion_tokens"]) == \
        (usage["prompt_tokens"], usage["completion_tokens"]), event
    assert (event["status"], event["end_reason"], event["usage_source"]) == \
        (200, END_COMPLETED, SOURCE_UPSTREAM), event
    settles_at(stack, "jm-big", BIG - usage["prompt_tokens"] - usage["completion_tokens"])


@pytest.mark.parametrize("metering", ["access_log", "ext_proc"])
def test_a_client_gone_before_a_non_streamed_responses_headers_is_charged_its_reservation(request, metering):
    stack = request.getfixturevalue("json_stack" if metering == "access_log" else "json_ext_proc_stack")
    url = stack.pool("pool_wait").urls[0]
    received_before = upstream_metric(url, "vllm_sim:requests_received_total")
    body = chat_body("wait", "think hard", max_tokens=100)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(stack.base_url + "/v1/chat/completions", json=body, headers=auth(KEYS["jm-gone"]),
                   timeout=httpx.Timeout(10, read=0.5))
    # The upstream had the request (and generated it: vLLM's work, which nothing reports).
    assert upstream_metric(url, "vllm_sim:requests_received_total") - received_before == 1
    event = one_event(stack, "jm-gone")
    assert (event["status"], event["end_reason"], event["usage_source"]) == \
        (0, END_INCOMPLETE, SOURCE_RESERVATION), event
    assert event["reserved_tokens"] > 100, event
    assert event["prompt_tokens"] + event["completion_tokens"] == event["reserved_tokens"], event
    assert event["completion_tokens"] == 100, event
    # Not refunded: the bucket stays where the reservation left it.
    settles_at(stack, "jm-gone", BIG - event["reserved_tokens"])


def test_requests_that_never_reached_the_upstream_are_charged_nothing(json_stack):
    stack = json_stack
    url = stack.pool("pool_single").urls[0]
    received_before = upstream_metric(url, "vllm_sim:requests_received_total")
    # Holds the pool's only upstream connection for 3 s.
    with httpx.Client(timeout=15) as holder_client:
        holder = holder_client.build_request("POST", stack.base_url + "/v1/chat/completions",
                                             json=chat_body("single", "hold", max_tokens=4),
                                             headers=auth(KEYS["jm-holder"]))
        done = {}
        t = threading.Thread(target=lambda: done.setdefault("r", holder_client.send(holder)))
        t.start()
        assert wait_for(lambda: upstream_metric(url, "vllm_sim:requests_received_total") - received_before == 1)
        # Admitted (its reservation taken), then left while Envoy waits for a connection.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(stack.base_url + "/v1/chat/completions", json=chat_body("single", "wait", max_tokens=100),
                       headers=auth(KEYS["jm-unsent"]), timeout=httpx.Timeout(10, read=0.5))
        t.join(15)
    assert done["r"].status_code == 200
    assert upstream_metric(url, "vllm_sim:requests_received_total") - received_before == 1, "the second was sent"
    event = one_event(stack, "jm-unsent")
    assert (event["status"], event["usage_source"]) == (0, SOURCE_STREAMED_CHUNKS), event
    assert event["prompt_tokens"] + event["completion_tokens"] == 0, event
    assert event["reserved_tokens"] > 100, event
    settles_at(stack, "jm-unsent", BIG)

    # Refused (429, its minute's one request spent): no record, its TPM bucket untouched.
    r = post(stack, "/v1/chat/completions", chat_body("single", "fits", max_tokens=4), key=KEYS["jm-refused"])
    assert r.status_code == 200, r.text
    first = one_event(stack, "jm-refused")
    settles_at(stack, "jm-refused", BIG - first["prompt_tokens"] - first["completion_tokens"])
    r = post(stack, "/v1/chat/completions", chat_body("wait", "too much", max_tokens=100), key=KEYS["jm-refused"])
    assert r.status_code == 429, r.text
    # A later request's record is in: the refused one would have been too.
    r = post(stack, "/v1/chat/completions", chat_body("single", "after", max_tokens=4), key=KEYS["jm-holder"])
    assert r.status_code == 200, r.text
    assert wait_for(lambda: len(usage_events(stack.redis, "jm-holder")) == 2)
    assert usage_events(stack.redis, "jm-refused") == [first]
    settles_at(stack, "jm-refused", BIG - first["prompt_tokens"] - first["completion_tokens"])
