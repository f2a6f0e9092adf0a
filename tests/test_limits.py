"""Rate limits and their reconciliation, end to end (real Envoy, sidecar, redis-server, vllm-sim).

- RPM and TPM 429s: status, OpenAI-shaped body, `Retry-After` computed from the bucket's refill,
  `x-ratelimit-limit|remaining|reset-requests|tokens`, per tenant and per tenant x model.
- Reconciliation: the TPM bucket in Redis (`llmgw:rl:{tenant}:tpm`, field `t`) ends at
  capacity - actual usage after a normal end, after a reservation smaller than the usage (debt),
  and after a client abort, where the record holds what the upstream actually streamed.

Buckets whose refill must not blur the arithmetic refill 1 token per minute with a large burst.
"""

from __future__ import annotations

import math
import signal
import time

import httpx
import pytest
import redis

from helpers import assert_openai_error, auth, chat_body, post, sse_events, wait_for
from sidecar_checks import (
    END_COMPLETED,
    END_INCOMPLETE,
    SOURCE_STREAMED_CHUNKS,
    SOURCE_UPSTREAM,
    bucket,
    bucket_key,
    content_chunks,
    landed_events,
    parse_reset,
    usage_events,
    usage_hash,
)
from stack import Model, Pool, Stack, Tenant, new_api_key, upstream_metric

RECEIVED = "vllm_sim:requests_received_total"
GENERATED = "vllm:generation_tokens_total"
BIG = 1_000_000

TENANTS = {
    "lim-rpm": ({"requests_per_minute": 2}, None),
    "lim-tpm": ({"tokens_per_minute": 60, "token_burst": 2000}, None),
    "lim-model": ({"requests_per_minute": 10},
                  {"other": {"requests_per_minute": 1}, "fast": {"tokens_per_minute": 60, "token_burst": 100}}),
    "rec-end": ({"tokens_per_minute": 1, "token_burst": BIG}, None),
    "rec-debt": ({"tokens_per_minute": 1, "token_burst": 50}, None),
    "rec-abort": ({"tokens_per_minute": 1, "token_burst": BIG}, None),
    "rec-both": ({"tokens_per_minute": 1, "token_burst": BIG}, {"fast": {"tokens_per_minute": 1, "token_burst": 1000}}),
}
KEYS = {t: new_api_key() for t in TENANTS}


@pytest.fixture(scope="module")
def limits_stack(tmp_path_factory):
    pools = [
        Pool("pool_fast", ["sim/fast"], ["--output-tokens", "8"]),
        Pool("pool_other", ["sim/other"], ["--output-tokens", "5"]),
        # 30 tokens 100 ms apart, for the abort test only (its token counter is that test's).
        Pool("pool_abort", ["sim/abort"], ["--ttft-ms", "20", "--itl-ms", "100", "--output-tokens", "30"]),
    ]
    models = [
        Model("fast", "pool_fast", served_model_name="sim/fast"),
        Model("other", "pool_other", served_model_name="sim/other"),
        Model("abortable", "pool_abort", served_model_name="sim/abort"),
    ]
    tenants = [Tenant(t, [KEYS[t]], limits, model_limits=ml) for t, (limits, ml) in TENANTS.items()]
    with Stack(tmp_path_factory.mktemp("limits"), pools, models, tenants) as s:
        s.redis = redis.Redis(port=s.redis_port)
        yield s


def received(stack, pool: str) -> float:
    return sum(upstream_metric(url, RECEIVED) for url in stack.pool(pool).urls)


def chat(stack, tenant: str, model: str = "fast", **extra) -> httpx.Response:
    return post(stack, "/v1/chat/completions", chat_body(model, **extra), key=KEYS[tenant])


def settled(stack, key: str, expected: float, tolerance: float = 2.0):
    """Waits until the bucket's level is within `tolerance` above `expected` (refill only adds)."""
    def check():
        b = bucket(stack.redis, key)
        return b if b and expected - 0.01 <= b[0] <= expected + tolerance else None
    return wait_for(check, timeout=10)


# ------------------------------------------------------------------ RPM


def test_rpm_429_headers_and_body(limits_stack):
    stack = limits_stack
    t0 = time.monotonic()
    r1 = chat(stack, "lim-rpm")
    r2 = chat(stack, "lim-rpm")
    assert (r1.status_code, r2.status_code) == (200, 200), (r1.text, r2.text)
    assert (r1.headers["x-ratelimit-limit-requests"], r1.headers["x-ratelimit-remaining-requests"]) == ("2", "1")
    # A new bucket is full: after one request it lacks exactly one, which 2/min refills in 30 s.
    assert r1.headers["x-ratelimit-reset-requests"] == "30s"
    assert (r2.headers["x-ratelimit-limit-requests"], r2.headers["x-ratelimit-remaining-requests"]) == ("2", "0")
    assert 60 - (time.monotonic() - t0) - 0.01 <= parse_reset(r2.headers["x-ratelimit-reset-requests"]) <= 60
    assert "x-ratelimit-limit-tokens" not in r2.headers, "no TPM limit, no token headers"
    before_state = bucket(stack.redis, bucket_key("lim-rpm", "rpm"))
    before = received(stack, "pool_fast")

    r3 = chat(stack, "lim-rpm")
    elapsed = time.monotonic() - t0
    error = assert_openai_error(r3, 429, code="rate_limit_exceeded")
    assert error["type"] == "requests" and error["param"] is None
    # The bucket refills one request every 30 s from the first take: the wait is 30 s minus the
    # time since, rounded up to whole seconds (exactly 30 when the three took under a second).
    retry_after = r3.headers["retry-after"]
    assert retry_after.isdigit(), retry_after
    assert math.ceil(30 - elapsed) <= int(retry_after) <= 30, (retry_after, elapsed)
    assert f"Limit 2, Requested 1. Please try again in {retry_after}s." in error["message"], error
    assert r3.headers["x-ratelimit-limit-requests"] == "2"
    assert r3.headers["x-ratelimit-remaining-requests"] == "0"
    assert 60 - elapsed - 0.01 <= parse_reset(r3.headers["x-ratelimit-reset-requests"]) <= 60
    assert received(stack, "pool_fast") == before, "a refused request reached the upstream"
    # A refusal takes nothing: the bucket is as the second request left it.
    assert bucket(stack.redis, bucket_key("lim-rpm", "rpm")) == before_state
    assert before_state[0] < 0.1
    # Two records, none for the 429.
    assert wait_for(lambda: usage_hash(stack.redis, "lim-rpm").get("fast:requests") == 2)
    assert len(landed_events(stack.redis, "lim-rpm", 2)) == 2


# ------------------------------------------------------------------ TPM


def test_tpm_429_retry_after_from_the_refill(limits_stack):
    stack = limits_stack
    key = bucket_key("lim-tpm", "tpm")
    t0 = time.monotonic()
    r1 = chat(stack, "lim-tpm", max_tokens=1000)
    assert r1.status_code == 200, r1.text
    # Reserved at admission: the prompt estimate plus max_tokens, from a full 2000 bucket.
    reserved = 2000 - int(r1.headers["x-ratelimit-remaining-tokens"])
    assert 1000 < reserved <= 1000 + len("Hello there") + 64, reserved
    assert r1.headers["x-ratelimit-limit-tokens"] == "60"
    assert "x-ratelimit-limit-requests" not in r1.headers
    used = r1.json()["usage"]["total_tokens"]
    assert used < reserved - 900
    # Settled: the unused part of the reservation went back.
    level, _ = settled(stack, key, 2000 - used, tolerance=time.monotonic() - t0 + 1) or (None, None)
    assert level is not None, (bucket(stack.redis, key), 2000 - used)
    before = received(stack, "pool_fast")
    state = bucket(stack.redis, key)

    # prompt + 1999 is over the burst: the reservation is capped at it, 2000, and does not fit.
    r2 = chat(stack, "lim-tpm", max_tokens=1999)
    elapsed = time.monotonic() - t0
    error = assert_openai_error(r2, 429, code="rate_limit_exceeded")
    assert error["type"] == "tokens"
    assert "Limit 60, Requested 2000." in error["message"], error
    remaining = int(r2.headers["x-ratelimit-remaining-tokens"])
    assert 2000 - used <= remaining <= 2000 - used + elapsed + 1, (remaining, used, elapsed)
    # 60 tokens/min is 1 token/s: the wait is the missing tokens in seconds, rounded up. With the
    # level in [remaining, remaining + 1), that is exactly 2000 - remaining.
    assert r2.headers["retry-after"] == str(2000 - remaining), (r2.headers["retry-after"], remaining)
    assert f"Please try again in {2000 - remaining}s." in error["message"]
    assert 2000 - remaining - 1 <= parse_reset(r2.headers["x-ratelimit-reset-tokens"]) <= 2000 - remaining
    assert r2.headers["x-ratelimit-limit-tokens"] == "60"
    assert received(stack, "pool_fast") == before
    assert bucket(stack.redis, key) == state, "a refusal must not take tokens"


def test_tenant_x_model_limits(limits_stack):
    stack = limits_stack
    t0 = time.monotonic()
    fast_before, other_before = received(stack, "pool_fast"), received(stack, "pool_other")
    # `other`: 1 RPM for this tenant and model, on top of the tenant's 10 RPM.
    r = chat(stack, "lim-model", "other")
    assert r.status_code == 200, r.text
    # The tightest bucket of each kind is reported: the model's.
    assert (r.headers["x-ratelimit-limit-requests"], r.headers["x-ratelimit-remaining-requests"]) == ("1", "0")
    assert r.headers["x-ratelimit-reset-requests"] == "1m0s"
    assert "x-ratelimit-limit-tokens" not in r.headers

    r = chat(stack, "lim-model", "other")
    error = assert_openai_error(r, 429, code="rate_limit_exceeded")
    assert error["type"] == "requests"
    assert "Limit 1, Requested 1." in error["message"]
    # 1 per minute, taken just now: a minute, less the time since, rounded up.
    assert math.ceil(60 - (time.monotonic() - t0)) <= int(r.headers["retry-after"]) <= 60
    assert (r.headers["x-ratelimit-limit-requests"], r.headers["x-ratelimit-remaining-requests"]) == ("1", "0")

    # `fast` has no request limit of its own: the tenant's bucket reports 8 left, so the refused
    # request took nothing from it (all or nothing across the buckets). Its token bucket (60/min,
    # burst 100) caps the reservation at 100 and is then empty.
    r = chat(stack, "lim-model", "fast", max_tokens=500)
    assert r.status_code == 200, r.text
    assert (r.headers["x-ratelimit-limit-requests"], r.headers["x-ratelimit-remaining-requests"]) == ("10", "8")
    assert (r.headers["x-ratelimit-limit-tokens"], r.headers["x-ratelimit-remaining-tokens"]) == ("60", "0")

    r = chat(stack, "lim-model", "fast", max_tokens=500)
    error = assert_openai_error(r, 429, code="rate_limit_exceeded")
    assert error["type"] == "tokens"
    assert "Limit 60, Requested 100." in error["message"]
    remaining = int(r.headers["x-ratelimit-remaining-tokens"])
    assert r.headers["retry-after"] == str(100 - remaining)
    assert r.headers["x-ratelimit-limit-tokens"] == "60"

    assert received(stack, "pool_other") == other_before + 1
    assert received(stack, "pool_fast") == fast_before + 1
    keys = sorted(k.decode() for k in stack.redis.scan_iter("llmgw:rl:{lim-model}:*"))
    assert keys == ["llmgw:rl:{lim-model}:m:fast:tpm", "llmgw:rl:{lim-model}:m:other:rpm",
                    "llmgw:rl:{lim-model}:rpm"], keys
    assert bucket(stack.redis, bucket_key("lim-model", "rpm", "other"))[0] < 0.1
    assert 8 <= bucket(stack.redis, bucket_key("lim-model", "rpm"))[0] < 9


# ------------------------------------------------------------------ reconciliation


def test_reservation_settles_to_actual_usage(limits_stack):
    stack = limits_stack
    key = bucket_key("rec-end", "tpm")
    body = chat_body("fast", "settle me", stream=True, max_tokens=50, stream_options={"include_usage": True})
    with httpx.stream("POST", stack.base_url + "/v1/chat/completions", json=body, headers=auth(KEYS["rec-end"]),
                      timeout=10) as r:
        assert r.status_code == 200
        reserved1 = BIG - int(r.headers["x-ratelimit-remaining-tokens"])
        events = sse_events(list(r.iter_lines()))
    assert events[-1] == "[DONE]"
    usage1 = next(e["usage"] for e in events[:-1] if e.get("usage"))
    r = chat(stack, "rec-end", "fast", max_tokens=20)
    assert r.status_code == 200, r.text
    usage2 = r.json()["usage"]
    assert reserved1 > usage1["total_tokens"] + 30, "the reservation holds max_tokens, above the usage"

    used = usage1["total_tokens"] + usage2["total_tokens"]
    assert settled(stack, key, BIG - used), (bucket(stack.redis, key), BIG - used)
    assert wait_for(lambda: usage_hash(stack.redis, "rec-end").get("fast:requests") == 2)
    h = usage_hash(stack.redis, "rec-end")
    assert h["fast:prompt_tokens"] == usage1["prompt_tokens"] + usage2["prompt_tokens"]
    assert h["fast:completion_tokens"] == usage1["completion_tokens"] + usage2["completion_tokens"]
    events = landed_events(stack.redis, "rec-end", 2)
    assert len(events) == 2 and len({e["record_id"] for e in events}) == 2
    first = next(e for e in events if e["reserved_tokens"] == reserved1)
    assert (first["completion_tokens"], first["prompt_tokens"]) == (usage1["completion_tokens"], usage1["prompt_tokens"])
    for e in events:
        assert (e["status"], e["end_reason"], e["usage_source"]) == (200, END_COMPLETED, SOURCE_UPSTREAM), e
        assert (e["tenant"], e["model"], e["pool"], e["tier"]) == ("rec-end", "fast", "pool_fast", "standard"), e
    # Settled once: the level stays put (a second settle would move it by the same delta again).
    assert settled(stack, key, BIG - used)


def test_usage_above_the_capped_reservation_is_charged(limits_stack):
    """A reservation is capped at the burst; what the request used beyond it is charged when it
    ends, leaving the bucket in debt, which delays the next request accordingly."""
    stack = limits_stack
    key = bucket_key("rec-debt", "tpm")
    r = chat(stack, "rec-debt", "fast", content="x" * 400, max_tokens=100)
    assert r.status_code == 200, r.text
    assert r.headers["x-ratelimit-remaining-tokens"] == "0", "capped at the burst of 50"
    used = r.json()["usage"]["total_tokens"]
    assert used > 100
    state = settled(stack, key, 50 - used)
    assert state, (bucket(stack.redis, key), 50 - used)
    level = state[0]
    assert level < 0

    r = chat(stack, "rec-debt", "fast", max_tokens=10)
    error = assert_openai_error(r, 429, code="rate_limit_exceeded")
    assert error["type"] == "tokens"
    assert r.headers["x-ratelimit-remaining-tokens"] == "0"
    cost = int(error["message"].split("Requested ")[1].split(".")[0])
    # 1 token per minute: each missing token is 60 s.
    expected = math.ceil((cost - level) * 60)
    assert expected - 2 <= int(r.headers["retry-after"]) <= expected, (r.headers["retry-after"], expected)


def test_client_abort_records_what_the_upstream_streamed(limits_stack):
    stack = limits_stack
    key = bucket_key("rec-abort", "tpm")
    url = stack.pool("pool_abort").urls[0]
    generated_before = upstream_metric(url, GENERATED)
    body = chat_body("abortable", "abort me", stream=True, max_tokens=30)
    seen = []
    with httpx.stream("POST", stack.base_url + "/v1/chat/completions", json=body,
                      headers=auth(KEYS["rec-abort"]), timeout=10) as r:
        assert r.status_code == 200
        reserved = BIG - int(r.headers["x-ratelimit-remaining-tokens"])
        for line in r.iter_lines():
            seen += sse_events([line])
            if content_chunks(seen) == 3:
                break
    # Leaving the block closed the connection mid-stream (about 2.7 s of it left).
    assert "[DONE]" not in seen

    recorded = wait_for(lambda: usage_hash(stack.redis, "rec-abort").get("abortable:requests"), timeout=10)
    assert recorded == 1, usage_hash(stack.redis, "rec-abort")
    generated = upstream_metric(url, GENERATED) - generated_before
    assert 3 <= generated < 30, generated
    h = usage_hash(stack.redis, "rec-abort")
    assert h["abortable:completion_tokens"] == generated, (h, generated)
    [event] = landed_events(stack.redis, "rec-abort", 1)
    assert (event["status"], event["end_reason"], event["usage_source"]) == \
        (200, END_INCOMPLETE, SOURCE_STREAMED_CHUNKS), event
    assert event["completion_tokens"] == generated
    assert event["reserved_tokens"] == reserved
    # No usage arrived: the prompt is the filter's estimate, the reservation less max_tokens.
    assert event["prompt_tokens"] == reserved - 30 == h["abortable:prompt_tokens"], (event, h)
    # The end is when Envoy closes the metering stream, up to its deferred_close_timeout (1 s)
    # after the reset.
    assert 0 < event["ttft_us"] < event["duration_us"] < 5_000_000, event
    # Settled against what was used: capacity - (prompt + completion).
    used = event["prompt_tokens"] + event["completion_tokens"]
    assert settled(stack, key, BIG - used), (bucket(stack.redis, key), BIG - used)

    # Once: a later request of the tenant is recorded after it, and the abort is still one record.
    assert chat(stack, "rec-abort", "fast", max_tokens=2).status_code == 200
    assert wait_for(lambda: usage_hash(stack.redis, "rec-abort").get("fast:requests") == 1)
    assert usage_hash(stack.redis, "rec-abort")["abortable:requests"] == 1
    assert len(landed_events(stack.redis, "rec-abort", 2)) == 2


def test_each_token_bucket_is_settled_against_its_own_reservation(limits_stack):
    """A request draws on the tenant's TPM bucket and its tenant x model TPM bucket: each must end
    at its capacity less the usage."""
    stack = limits_stack
    r = chat(stack, "rec-both", "fast", max_tokens=100)
    assert r.status_code == 200, r.text
    used = r.json()["usage"]["total_tokens"]
    # Both full buckets took the same reservation, prompt estimate + 100 (under both bursts); the
    # headers report the tighter, the model's.
    reserved = 1000 - int(r.headers["x-ratelimit-remaining-tokens"])
    assert 100 < reserved < 200, reserved
    for key, capacity in ((bucket_key("rec-both", "tpm", "fast"), 1000), (bucket_key("rec-both", "tpm"), BIG)):
        # Settled: the level moved off where the reservation left it.
        state = wait_for(lambda key=key, capacity=capacity:
                         (b := bucket(stack.redis, key)) and b[0] != capacity - reserved and b)
        assert state, (key, bucket(stack.redis, key))
        assert capacity - used - 0.01 <= state[0] <= capacity - used + 0.5, (key, state, capacity - used)
    assert wait_for(lambda: usage_hash(stack.redis, "rec-both").get("fast:requests") == 1)
    [event] = landed_events(stack.redis, "rec-both", 1)
    assert event["reserved_tokens"] == reserved, event


# ------------------------------------------------------------------ leases


def test_leases_admit_without_redis_and_give_back_what_is_unused(tmp_path_factory):
    """With `redis.lease_fraction`, the first request takes its cost plus a lease from the bucket
    and the next ones are admitted from the lease (the bucket in Redis does not move); when the
    lease expires, its unused tokens go back to Redis."""
    key = new_api_key()
    tenant = Tenant("leased", [key], {"requests_per_minute": 600, "request_burst": 1000})
    # A TTL that outlasts the 20 requests even on a slow machine.
    overrides = {"redis": {"lease_fraction": 0.1, "lease_ttl_ms": 3000}}
    with Stack(tmp_path_factory.mktemp("leases"), [Pool("pool_l", ["sim/l"], ["--output-tokens", "2"])],
               [Model("l", "pool_l", served_model_name="sim/l")], [tenant], sidecar_overrides=overrides) as s:
        client = redis.Redis(port=s.redis_port)
        rpm = bucket_key("leased", "rpm")
        started = time.monotonic()
        for i in range(20):
            r = post(s, "/v1/chat/completions", chat_body("l"), key=key)
            assert r.status_code == 200, r.text
            if i == 0:
                # Cost 1 and a lease of 100 (10 % of the burst of 1,000) left Redis at once.
                level = bucket(client, rpm)[0]
                assert 899 <= level < 901, level
        # Nineteen more admitted from the lease: Redis's bucket only refilled meanwhile (10/s),
        # where without leases it would stand near 980.
        elapsed = time.monotonic() - started
        assert bucket(client, rpm)[0] <= 901 + 10 * elapsed, (bucket(client, rpm), elapsed)
        assert int(r.headers["x-ratelimit-remaining-requests"]) >= 899 + 80
        # After the TTL the 80 unused tokens are back: 1,000 less the 20 requests (plus refill).
        assert wait_for(lambda: (b := bucket(client, rpm)) and b[0] >= 980, timeout=10), bucket(client, rpm)


def test_leases_are_given_back_when_the_sidecar_stops(tmp_path_factory):
    """A sidecar stopped with SIGTERM gives its leases back to Redis before it exits, not when
    they would have expired (here 60 s later)."""
    key = new_api_key()
    tenant = Tenant("leased-stop", [key], {"requests_per_minute": 600, "request_burst": 1000})
    overrides = {"redis": {"lease_fraction": 0.1, "lease_ttl_ms": 60000}, "shutdown_grace_ms": 300}
    with Stack(tmp_path_factory.mktemp("leases-stop"), [Pool("pool_l", ["sim/l"], ["--output-tokens", "2"])],
               [Model("l", "pool_l", served_model_name="sim/l")], [tenant], sidecar_overrides=overrides) as s:
        client = redis.Redis(port=s.redis_port)
        rpm = bucket_key("leased-stop", "rpm")
        assert post(s, "/v1/chat/completions", chat_body("l"), key=key).status_code == 200
        # Cost 1 and a lease of 100 left Redis.
        assert 899 <= bucket(client, rpm)[0] < 901, bucket(client, rpm)
        (sidecar,) = [p for p in s.procs if p.name == "sidecar"]
        sidecar.popen.send_signal(signal.SIGTERM)
        assert sidecar.popen.wait(timeout=10) == 0
        # The 100 leased tokens are back (refill at 10/s adds at most a few meanwhile; the bucket
        # holds at most its burst of 1,000).
        assert bucket(client, rpm)[0] >= 990, bucket(client, rpm)
