"""`n` (and completions `best_of`) through the real Envoy, sidecar, redis-server and vllm-sim
(issue 17, item 4): a request with n choices reserves prompt + n x max_tokens (for each prompt
of a completions batch) from the tenant's TPM bucket at admission, and settles to the real usage (vLLM sums `completion_tokens` over the
choices); an invalid `n` or `best_of` is the filter's 400 and reaches no upstream.

The buckets refill 1 token per minute with a large burst, so the arithmetic is not blurred.
"""

from __future__ import annotations

import httpx
import pytest
import redis

from helpers import assert_openai_error, auth, chat_body, post, sse_events, wait_for
from sidecar_checks import SOURCE_UPSTREAM, bucket, bucket_key, landed_events, usage_hash
from stack import Model, Pool, Stack, Tenant, new_api_key, upstream_metric

BIG = 1_000_000
OUTPUT_TOKENS = 8  # vllm-sim --output-tokens: each choice stops after 8 tokens
TENANTS = ["n-one", "n-three", "n-stream", "n-comp", "n-batch", "n-bad"]
KEYS = {t: new_api_key() for t in TENANTS}
RECEIVED = "vllm_sim:requests_received_total"


@pytest.fixture(scope="module")
def n_stack(tmp_path_factory):
    pools = [Pool("pool_n", ["sim/n"], ["--output-tokens", str(OUTPUT_TOKENS)])]
    models = [Model("nmodel", "pool_n", served_model_name="sim/n")]
    tenants = [Tenant(t, [KEYS[t]], {"tokens_per_minute": 1, "token_burst": BIG}) for t in TENANTS]
    with Stack(tmp_path_factory.mktemp("choices"), pools, models, tenants) as s:
        s.redis = redis.Redis(port=s.redis_port)
        yield s


def reserved(response: httpx.Response) -> int:
    """What the admission took from a full bucket of BIG tokens."""
    return BIG - int(response.headers["x-ratelimit-remaining-tokens"])


def settled_to(stack, tenant: str, expected: float):
    """Waits until the tenant's TPM bucket is within refill of `expected` (refill only adds)."""
    key = bucket_key(tenant, "tpm")

    def check():
        b = bucket(stack.redis, key)
        return b if b and expected - 0.01 <= b[0] <= expected + 2 else None
    return wait_for(check, timeout=30)


def received(stack) -> float:
    return sum(upstream_metric(url, RECEIVED) for url in stack.pool("pool_n").urls)


def test_n_choices_reserve_n_times_and_settle_to_the_usage(n_stack):
    stack = n_stack
    body = chat_body("nmodel", "how many choices?", max_tokens=20)
    one = post(stack, "/v1/chat/completions", body, key=KEYS["n-one"])
    assert one.status_code == 200, one.text
    prompt_estimate = reserved(one) - 20
    assert prompt_estimate > 0

    three = post(stack, "/v1/chat/completions", {**body, "n": 3}, key=KEYS["n-three"])
    assert three.status_code == 200, three.text
    # Admission took the prompt once and max_tokens for each of the 3 choices.
    assert reserved(three) == prompt_estimate + 3 * 20, (reserved(three), prompt_estimate)
    out = three.json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    usage = out["usage"]
    assert usage["completion_tokens"] == 3 * OUTPUT_TOKENS, usage
    assert settled_to(stack, "n-three", BIG - usage["total_tokens"]), \
        (bucket(stack.redis, bucket_key("n-three", "tpm")), usage)
    assert wait_for(lambda: usage_hash(stack.redis, "n-three").get("nmodel:requests") == 1)
    h = usage_hash(stack.redis, "n-three")
    assert h["nmodel:completion_tokens"] == 3 * OUTPUT_TOKENS, h
    [event] = landed_events(stack.redis, "n-three", 1)
    assert (event["reserved_tokens"], event["usage_source"]) == (prompt_estimate + 60, SOURCE_UPSTREAM), event


def test_streamed_n_choices_are_metered_whole(n_stack):
    """A stream of 3 choices: the usage the filter injected (and strips) sums them, the bucket
    settles to it, and the client sees every choice's chunks."""
    stack = n_stack
    body = chat_body("nmodel", "stream three", max_tokens=10, n=3, stream=True)
    with httpx.stream("POST", stack.base_url + "/v1/chat/completions", json=body,
                      headers=auth(KEYS["n-stream"]), timeout=10) as r:
        assert r.status_code == 200, r.read()
        taken = reserved(r)
        events = sse_events(list(r.iter_lines()))
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"] and e["choices"][0].get("delta", {}).get("content")]
    assert sorted({c["choices"][0]["index"] for c in chunks}) == [0, 1, 2]
    assert len(chunks) == 3 * OUTPUT_TOKENS
    assert not any(e.get("usage") for e in events[:-1]), "the injected usage chunk is stripped"
    assert wait_for(lambda: usage_hash(stack.redis, "n-stream").get("nmodel:requests") == 1)
    [event] = landed_events(stack.redis, "n-stream", 1)
    assert event["completion_tokens"] == 3 * OUTPUT_TOKENS, event
    assert event["usage_source"] == SOURCE_UPSTREAM, event
    # The filter's estimate of "user" + "stream three" (16 bytes) is 4 tokens; 3 choices of 10.
    assert event["reserved_tokens"] == taken == 4 + 3 * 10, (event, taken)
    used = event["prompt_tokens"] + event["completion_tokens"]
    assert settled_to(stack, "n-stream", BIG - used), bucket(stack.redis, bucket_key("n-stream", "tpm"))


def test_completions_best_of_reserves_its_sequences(n_stack):
    stack = n_stack
    body = {"model": "nmodel", "prompt": "one two three", "max_tokens": 5, "n": 2, "best_of": 4}
    r = post(stack, "/v1/completions", body, key=KEYS["n-comp"])
    assert r.status_code == 200, r.text
    # The filter's estimate of a 13-byte prompt is ceil(13 / 4) = 4 tokens; best_of = 4 sequences.
    assert reserved(r) == 4 + 4 * 5, reserved(r)


def test_a_completions_batch_reserves_for_every_prompt(n_stack):
    """vLLM generates n choices for each prompt of a batch."""
    stack = n_stack
    body = {"model": "nmodel", "prompt": ["ab", "cd", "ef"], "max_tokens": 5, "n": 2}
    r = post(stack, "/v1/completions", body, key=KEYS["n-batch"])
    assert r.status_code == 200, r.text
    # Each 2-byte prompt is estimated at 1 token; 3 prompts x 2 choices x 5 tokens.
    assert reserved(r) == 3 + 3 * 2 * 5, reserved(r)


@pytest.mark.parametrize("extra, param, code", [
    ({"n": 0}, "n", "invalid_value"),
    ({"n": -1}, "n", "invalid_value"),
    ({"n": "3"}, "n", "invalid_type"),
    ({"n": 1.5}, "n", "invalid_type"),
])
def test_invalid_n_is_the_filters_400(n_stack, extra, param, code):
    stack = n_stack
    before = received(stack)
    r = post(stack, "/v1/chat/completions", chat_body("nmodel", "bad n", **extra), key=KEYS["n-bad"])
    assert_openai_error(r, 400, code=code, param=param)
    assert received(stack) == before, "an invalid request reached the upstream"


def test_best_of_below_n_is_the_filters_400(n_stack):
    stack = n_stack
    body = {"model": "nmodel", "prompt": "x", "n": 3, "best_of": 2}
    error = assert_openai_error(post(stack, "/v1/completions", body, key=KEYS["n-bad"]), 400,
                                code="invalid_value", param="best_of")
    assert "best_of must be greater than or equal to n" in error["message"], error
    assert bucket(stack.redis, bucket_key("n-bad", "tpm")) is None, "a refused request took tokens"
