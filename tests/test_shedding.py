"""Load shedding in front of a vLLM pool, end to end (real Envoy, sidecar, vllm-sim).

The pool is one simulator that runs one request at a time (`--max-num-seqs 1`), so streams held
open fill its queue. The sidecar scrapes its `vllm:num_requests_waiting` every 100 ms with
`max_queue_depth: 4`, and sheds tier `batch` from half of it (`tier_levels: {batch: 0.5}`); tiers
not listed are shed only at the hard ceiling, a full queue.
"""

from __future__ import annotations

import contextlib

import pytest

from helpers import assert_openai_error, auth, chat_body, post, wait_for
from sidecar_checks import metric, open_stream, sidecar_metrics
from stack import Model, Pool, Stack, Tenant, new_api_key, upstream_metric

TENANTS = {"sh-filler": "premium", "sh-batch": "batch", "sh-standard": "standard"}
KEYS = {t: new_api_key() for t in TENANTS}


@pytest.fixture(scope="module")
def shed_stack(tmp_path_factory):
    pools = [Pool("pool_shed", ["sim/shed"],
                  ["--max-num-seqs", "1", "--ttft-ms", "20", "--itl-ms", "100", "--output-tokens", "50"],
                  shedding={"max_queue_depth": 4, "scrape_interval_ms": 100})]
    models = [Model("shed", "pool_shed", served_model_name="sim/shed")]
    tenants = [Tenant(t, [KEYS[t]], {"requests_per_minute": 10000}, tier=tier) for t, tier in TENANTS.items()]
    overrides = {"metrics_listen": "127.0.0.1:0", "shedding": {"tier_levels": {"batch": 0.5}}}
    with Stack(tmp_path_factory.mktemp("shed"), pools, models, tenants, sidecar_overrides=overrides) as s:
        yield s


def sim_gauge(stack, name: str) -> float:
    return upstream_metric(stack.pool("pool_shed").urls[0], name)


def queue_is(stack, waiting: int) -> bool:
    """The simulator's queue and the sidecar's last scrape of it both hold `waiting` requests."""
    return sim_gauge(stack, "vllm:num_requests_waiting") == waiting and \
        metric(sidecar_metrics(stack), "llm_gateway_pool_requests_waiting", pool="pool_shed") == waiting


def received(stack) -> float:
    return sim_gauge(stack, "vllm_sim:requests_received_total")


def shed(stack, tenant: str) -> None:
    before = received(stack)
    r = post(stack, "/v1/chat/completions", chat_body("shed", max_tokens=2), key=KEYS[tenant])
    error = assert_openai_error(r, 429, code="overloaded")
    assert error["type"] == "server_overloaded"
    assert "not your rate limit" in error["message"]
    retry_after = r.headers["retry-after"]
    assert retry_after.isdigit() and 1 <= int(retry_after) <= 30, retry_after
    assert f"retry in {retry_after}s" in error["message"]
    assert "x-ratelimit-limit-requests" not in r.headers, "shed before the rate limit"
    assert received(stack) == before, "a shed request reached the upstream"


def test_lower_tiers_are_shed_first_and_admitted_again_when_the_queue_drains(shed_stack):
    stack = shed_stack
    body = chat_body("shed", "hold the queue", stream=True, max_tokens=50)
    with contextlib.ExitStack() as held:
        def hold(tenant: str) -> None:
            client, response = open_stream(stack.base_url, body, auth(KEYS[tenant]))
            held.callback(client.close)
            held.callback(response.close)
            assert response.status_code == 200

        # One running, two waiting: half of max_queue_depth.
        for _ in range(3):
            hold("sh-filler")
        assert wait_for(lambda: queue_is(stack, 2), timeout=10), sidecar_metrics(stack)
        shed(stack, "sh-batch")
        # A tier without a level is admitted below the ceiling (it queues; then it gives up).
        client, response = open_stream(stack.base_url, body, auth(KEYS["sh-standard"]))
        try:
            assert response.status_code == 200
            assert wait_for(lambda: sim_gauge(stack, "vllm:num_requests_waiting") == 3, timeout=10)
        finally:
            response.close()
            client.close()
        assert wait_for(lambda: queue_is(stack, 2), timeout=10)

        # A full queue: every tier is shed.
        for _ in range(2):
            hold("sh-filler")
        assert wait_for(lambda: queue_is(stack, 4), timeout=10), sidecar_metrics(stack)
        shed(stack, "sh-standard")
        shed(stack, "sh-batch")
        text = sidecar_metrics(stack)
        assert metric(text, "llm_gateway_shed_total", pool="pool_shed", tier="batch") == 2, text
        assert metric(text, "llm_gateway_shed_total", pool="pool_shed", tier="standard") == 1, text
        assert metric(text, "llm_gateway_shed_total", tier="premium") == 0
        assert metric(text, "llm_gateway_pool_load", pool="pool_shed") == 1.0
        assert metric(text, "llm_gateway_requests_total", tenant="sh-batch", outcome="overloaded") == 2
    # Every held stream closed: the queue drains, and batch is served again.
    assert wait_for(lambda: queue_is(stack, 0) and sim_gauge(stack, "vllm:num_requests_running") == 0,
                    timeout=10), sidecar_metrics(stack)
    r = post(stack, "/v1/chat/completions", chat_body("shed", max_tokens=2), key=KEYS["sh-batch"])
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2
