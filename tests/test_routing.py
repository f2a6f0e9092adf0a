"""Model routing through the real Envoy: aliases, LoRA adapters, weighted splits, fallback."""

from __future__ import annotations

import uuid

import httpx
import pytest

from helpers import auth, chat_body, post, sse_events
from stack import Fallback, Model, Pool, Stack, Tenant, free_port, new_api_key

KEY = new_api_key()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there: connect failures
    pools = [
        Pool("pool_base", ["org/base-7b"], ["--output-tokens", "3", "--lora-modules", "sql-lora=/adapters/sql"]),
        Pool("pool_w1", ["org/split"], ["--output-tokens", "1"]),
        Pool("pool_w2", ["org/split"], ["--output-tokens", "1"]),
        Pool("pool_failing", ["org/fb"], ["--output-tokens", "2", "--error-rate", "1"]),
        Pool("pool_dead", ["org/fb"], kind="external", urls=[dead]),
        Pool("pool_backup", ["org/fb"], ["--output-tokens", "2"]),
    ]
    models = [
        Model("base", "pool_base", 4096, served_model_name="org/base-7b",
              extra={"aliases": ["base-latest"], "lora_adapters": ["sql-lora"]}),
        Model("split", None, 4096, served_model_name="org/split",
              extra={"pools": [{"pool": "pool_w1", "weight": 70}, {"pool": "pool_w2", "weight": 30}]}),
        Model("fb-5xx", "chain_5xx", 4096, served_model_name="org/fb"),
        Model("fb-down", "chain_down", 4096, served_model_name="org/fb"),
    ]
    fallbacks = [Fallback("chain_5xx", ["pool_failing", "pool_backup"]),
                 Fallback("chain_down", ["pool_dead", "pool_backup"])]
    tenants = [Tenant("router", [KEY], {"requests_per_minute": 1000000})]
    with Stack(tmp_path_factory.mktemp("routing"), pools, models, tenants, fallbacks=fallbacks) as s:
        yield s


def received(stack, pool: str) -> float:
    return stack.requests_received(pool)


def test_alias_reaches_the_base_model(stack):
    before = received(stack, "pool_base")
    r = post(stack, "/v1/chat/completions", chat_body("base-latest"), key=KEY)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "org/base-7b"
    assert received(stack, "pool_base") == before + 1


def test_lora_adapter_routes_to_its_base_pool_and_keeps_its_name(stack):
    before = received(stack, "pool_base")
    r = post(stack, "/v1/chat/completions", chat_body("sql-lora"), key=KEY)
    assert r.status_code == 200, r.text
    # vLLM answers a LoRA request under the adapter's name: the body reached it unchanged.
    assert r.json()["model"] == "sql-lora"
    assert received(stack, "pool_base") == before + 1


def test_weighted_split_within_5_percent_by_envoys_request_id(stack):
    n = 2000
    before = {p: received(stack, p) for p in ("pool_w1", "pool_w2")}
    with httpx.Client(base_url=stack.base_url, headers=auth(KEY), timeout=10) as client:
        for _ in range(n):
            r = client.post("/v1/chat/completions", json=chat_body("split", max_tokens=1),
                            headers={"x-request-id": str(uuid.uuid4())})
            assert r.status_code == 200, r.text
        share = (received(stack, "pool_w1") - before["pool_w1"]) / n
        assert abs(share - 0.70) <= 0.05, share
        assert received(stack, "pool_w1") + received(stack, "pool_w2") == sum(before.values()) + n
        # The pool is picked by Envoy's x-request-id, never a client's (issue 17): 20 requests with
        # the same client id still spread over both pools (all 20 on one: p = 0.7^20 + 0.3^20).
        rid = str(uuid.uuid4())
        counts = {p: received(stack, p) for p in ("pool_w1", "pool_w2")}
        for _ in range(20):
            assert client.post("/v1/chat/completions", json=chat_body("split", max_tokens=1),
                               headers={"x-request-id": rid}).status_code == 200
        deltas = sorted(received(stack, p) - counts[p] for p in counts)
        assert sum(deltas) == 20 and deltas[0] > 0, deltas


@pytest.mark.parametrize("model,first", [("fb-5xx", "pool_failing"), ("fb-down", None)])
def test_fallback_to_the_next_pool(stack, model, first):
    backup = received(stack, "pool_backup")
    failing = received(stack, first) if first else None
    body = chat_body(model, stream=True)
    with httpx.stream("POST", stack.base_url + "/v1/chat/completions", json=body, headers=auth(KEY),
                      timeout=10) as r:
        assert r.status_code == 200, r.read()
        events = sse_events(list(r.iter_lines()))
    assert events[-1] == "[DONE]"
    assert received(stack, "pool_backup") == backup + 1
    if first:
        # The first pool was tried (and answered 500) before the fallback.
        assert received(stack, first) == failing + 1


def test_injected_usage_is_invisible_to_the_client(stack):
    """The filter makes vLLM send usage for metering; the client that did not ask sees none."""
    body = chat_body("base", stream=True)
    with httpx.stream("POST", stack.base_url + "/v1/chat/completions", json=body, headers=auth(KEY),
                      timeout=10) as r:
        raw = r.read()
    assert b"[DONE]" in raw
    assert b'"usage"' not in raw
    asked = chat_body("base", stream=True, stream_options={"include_usage": True})
    with httpx.stream("POST", stack.base_url + "/v1/chat/completions", json=asked, headers=auth(KEY),
                      timeout=10) as r:
        events = sse_events(list(r.iter_lines()))
    assert [e for e in events[:-1] if e.get("usage")], "a client that asked gets its usage chunk"
