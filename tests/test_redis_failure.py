"""Redis killed mid-test, under each failure mode, then back (real Envoy, sidecar, redis-server).

The module has its own stack (and redis-server), so stopping Redis disturbs no other test. Tier
`standard` fails open (in-memory buckets in the sidecar), tier `free` fails closed (503). Redis
restarts empty on the same port, as after a crash without persistence: what the sidecar buffered
while it was away must then appear there, once.
"""

from __future__ import annotations

import math
import time

import httpx
import pytest
import redis

from helpers import assert_openai_error, auth, chat_body, post, sse_events, wait_for
from sidecar_checks import bucket, bucket_key, landed_events, metric, sidecar_metrics, usage_events, usage_hash
from stack import Model, Pool, Stack, Tenant, new_api_key, upstream_metric

TENANTS = {
    "fo-open": ("standard", {"requests_per_minute": 1000, "tokens_per_minute": 1_000_000}),
    "fo-tiny": ("standard", {"requests_per_minute": 2}),
    "fo-closed": ("free", {"requests_per_minute": 1000}),
    "fo-neighbour": ("standard", {"requests_per_minute": 1000}),
    "fo-clock": ("standard", {"requests_per_minute": 1000}),
}
KEYS = {t: new_api_key() for t in TENANTS}


@pytest.fixture(scope="module")
def outage_stack(tmp_path_factory):
    pools = [Pool("pool_fo", ["sim/fo"], ["--output-tokens", "6"])]
    models = [Model("fo", "pool_fo", served_model_name="sim/fo")]
    tenants = [Tenant(t, [KEYS[t]], limits, tier=tier) for t, (tier, limits) in TENANTS.items()]
    overrides = {
        "metrics_listen": "127.0.0.1:0",
        "redis": {"failure_mode": "open", "tier_failure_modes": {"free": "closed"},
                  "breaker": {"failure_threshold": 3, "open_ms": 1000}},
    }
    with Stack(tmp_path_factory.mktemp("outage"), pools, models, tenants, sidecar_overrides=overrides) as s:
        yield s


def client(stack) -> redis.Redis:
    return redis.Redis(port=stack.redis_port, socket_timeout=2)


def chat(stack, tenant: str, **extra) -> httpx.Response:
    return post(stack, "/v1/chat/completions", chat_body("fo", **extra), key=KEYS[tenant])


def received(stack) -> float:
    return upstream_metric(stack.pool("pool_fo").urls[0], "vllm_sim:requests_received_total")


def nothing_buffered(stack) -> bool:
    """No record waits in the sidecar, and the usage journal (when on) has applied and
    checkpointed every line Envoy wrote: a Redis that comes back empty lost the records applied
    before, and a journal line not yet committed would be applied again to it."""
    m = sidecar_metrics(stack)
    if metric(m, "llm_gateway_usage_records_buffered") != 0:
        return False
    if not stack.journal:
        return True
    if metric(m, "llm_gateway_responses_total") == 0:
        return True  # nothing answered yet: the journal has no line to wait for
    written = stack.journal_path.stat().st_size if stack.journal_path.exists() else 0
    return written > 0 and metric(m, "llm_gateway_journal_lag_bytes") == 0 and \
        metric(m, "llm_gateway_journal_lines_total") >= 1


def test_open_mode_keeps_serving_and_flushes_records_once(outage_stack):
    stack = outage_stack
    assert chat(stack, "fo-open").status_code == 200
    assert wait_for(lambda: usage_hash(client(stack), "fo-open").get("fo:requests") == 1)
    assert wait_for(lambda: nothing_buffered(stack))
    before = sidecar_metrics(stack)
    upstream_before = received(stack)

    stack.stop_redis()
    try:
        seen = {"prompt_tokens": 0, "completion_tokens": 0}
        for i in range(3):
            r = chat(stack, "fo-open", max_tokens=2 + i)
            assert r.status_code == 200, r.text
            for k in seen:
                seen[k] += r.json()["usage"][k]
        body = chat_body("fo", "stream while redis is away", stream=True, stream_options={"include_usage": True})
        with httpx.stream("POST", stack.base_url + "/v1/chat/completions", json=body,
                          headers=auth(KEYS["fo-open"]), timeout=10) as r:
            assert r.status_code == 200
            events = sse_events(list(r.iter_lines()))
        assert events[-1] == "[DONE]"
        usage = next(e["usage"] for e in events[:-1] if e.get("usage"))
        for k in seen:
            seen[k] += usage[k]
        # The in-memory buckets still limit: 2 per minute, then 429 with the refill's wait.
        t0 = time.monotonic()
        for expected_remaining in ("1", "0"):
            r = chat(stack, "fo-tiny")
            assert r.status_code == 200, r.text
            assert r.headers["x-ratelimit-remaining-requests"] == expected_remaining
            assert r.headers["x-ratelimit-limit-requests"] == "2"
        r = chat(stack, "fo-tiny")
        error = assert_openai_error(r, 429, code="rate_limit_exceeded")
        assert error["type"] == "requests"
        assert math.ceil(30 - (time.monotonic() - t0)) <= int(r.headers["retry-after"]) <= 30
        assert (r.headers["x-ratelimit-limit-requests"], r.headers["x-ratelimit-remaining-requests"]) == ("2", "0")
        assert received(stack) == upstream_before + 6

        during = sidecar_metrics(stack)
        delta = lambda name, **labels: metric(during, name, **labels) - metric(before, name, **labels)
        # Seven decisions made without Redis (6 admitted, 1 refused), each counted once.
        assert delta("llm_gateway_degraded_decisions_total") == 7, during
        assert delta("llm_gateway_limit_decisions_total", decision="admit", degraded="true") == 6
        assert delta("llm_gateway_limit_decisions_total", decision="deny", degraded="true") == 1
        assert delta("llm_gateway_limit_decisions_total", degraded="false") == 0
        assert delta("llm_gateway_degraded_decisions_total", reason="breaker_open") >= 1, \
            "the breaker should have opened after 3 failures"
        assert delta("llm_gateway_redis_errors_total", op="take") >= 1
        # The six usage records wait in the sidecar.
        assert wait_for(lambda: metric(sidecar_metrics(stack), "llm_gateway_usage_records_buffered") == 6), \
            sidecar_metrics(stack)
    finally:
        stack.restart_redis()

    # Redis is back, empty: the buffered records arrive, each once.
    c = client(stack)
    flushed = wait_for(lambda: (usage_hash(c, "fo-open").get("fo:requests"), usage_hash(c, "fo-tiny").get("fo:requests"))
                       == (4, 2), timeout=15)
    assert flushed, (usage_hash(c, "fo-open"), usage_hash(c, "fo-tiny"))
    h = usage_hash(c, "fo-open")
    assert (h["fo:prompt_tokens"], h["fo:completion_tokens"]) == (seen["prompt_tokens"], seen["completion_tokens"])
    # A record's usage event is appended by a call after its ledger write: wait for it too.
    events = landed_events(c, "fo-open", 4)
    assert len(events) == 4 and len({e["record_id"] for e in events}) == 4, events
    assert len(landed_events(c, "fo-tiny", 2)) == 2
    assert wait_for(lambda: nothing_buffered(stack))
    after = sidecar_metrics(stack)
    assert metric(after, "llm_gateway_usage_records_written_total") - \
        metric(during, "llm_gateway_usage_records_written_total") == 6
    assert metric(after, "llm_gateway_usage_records_dropped_total") == 0

    # Redis decides again once the breaker lets a probe through.
    # The outage's reconciliation (token_bucket_reconcile_v1.lua) may create the bucket before
    # any decision does: wait on the decision counter itself, then look at the bucket.
    def redis_decides():
        assert chat(stack, "fo-open").status_code == 200
        return metric(sidecar_metrics(stack), "llm_gateway_limit_decisions_total", degraded="false") > \
            metric(during, "llm_gateway_limit_decisions_total", degraded="false")
    assert wait_for(redis_decides, timeout=10, interval=0.1)
    assert bucket(c, bucket_key("fo-open", "rpm"))
    assert wait_for(lambda: usage_hash(c, "fo-tiny").get("fo:requests") == 2 and nothing_buffered(stack))
    assert len(usage_events(c, "fo-tiny")) == 2, "a record was written twice"


def test_closed_mode_refuses_with_503_until_redis_returns(outage_stack):
    stack = outage_stack
    assert chat(stack, "fo-closed").status_code == 200
    assert wait_for(lambda: usage_hash(client(stack), "fo-closed").get("fo:requests") == 1)
    assert wait_for(lambda: nothing_buffered(stack))
    before = sidecar_metrics(stack)

    stack.stop_redis()
    try:
        upstream_before = received(stack)
        for _ in range(3):
            r = chat(stack, "fo-closed")
            error = assert_openai_error(r, 503, code="rate_limiter_unavailable")
            assert error["type"] == "server_error"
            assert r.headers["retry-after"] == "1"
            assert "x-ratelimit-limit-requests" not in r.headers
        # Another tier, failing open, is still served while Redis is away.
        r = chat(stack, "fo-neighbour")
        assert r.status_code == 200, r.text
        assert received(stack) == upstream_before + 1, "a refused request reached the upstream"
        during = sidecar_metrics(stack)
        assert metric(during, "llm_gateway_requests_total", tenant="fo-closed", outcome="limiter_unavailable") - \
            metric(before, "llm_gateway_requests_total", tenant="fo-closed", outcome="limiter_unavailable") == 3
        assert metric(during, "llm_gateway_degraded_decisions_total") - \
            metric(before, "llm_gateway_degraded_decisions_total") == 4
        assert metric(during, "llm_gateway_limit_decisions_total", decision="admit", degraded="true") - \
            metric(before, "llm_gateway_limit_decisions_total", decision="admit", degraded="true") == 1
    finally:
        stack.restart_redis()

    c = client(stack)
    deadline = time.monotonic() + 10
    while True:
        r = chat(stack, "fo-closed")
        if r.status_code == 200:
            break
        assert_openai_error(r, 503, code="rate_limiter_unavailable")
        assert time.monotonic() < deadline, "still 503 ten seconds after redis returned"
        time.sleep(0.05)  # poll interval
    # Decided by Redis: the bucket is in the new instance.
    level = bucket(c, bucket_key("fo-closed", "rpm"))
    assert level and 998 <= level[0] < 1000, level
    # Metered: the 200 is recorded, none of the 503s (the neighbour's record was buffered).
    assert wait_for(lambda: usage_hash(c, "fo-closed").get("fo:requests") == 1 and
                    usage_hash(c, "fo-neighbour").get("fo:requests") == 1 and nothing_buffered(stack))
    assert len(landed_events(c, "fo-closed", 1)) == 1


def test_a_buffered_record_keeps_its_end_time(outage_stack):
    stack = outage_stack
    assert wait_for(lambda: nothing_buffered(stack))
    stack.stop_redis()
    try:
        r = chat(stack, "fo-clock")
        assert r.status_code == 200, r.text
        answered_ms = time.time() * 1000
        assert wait_for(lambda: metric(sidecar_metrics(stack), "llm_gateway_usage_records_buffered") == 1)
    finally:
        restarted_ms = time.time() * 1000
        stack.restart_redis()
    c = client(stack)
    assert wait_for(lambda: usage_hash(c, "fo-clock").get("fo:requests") == 1, timeout=15)
    [event] = landed_events(c, "fo-clock", 1)
    # The request ended before the client had its answer, and before Redis came back.
    assert event["finished_at_unix_ms"] <= answered_ms, (event["finished_at_unix_ms"], answered_ms, restarted_ms)
