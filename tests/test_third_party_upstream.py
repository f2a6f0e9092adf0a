"""The gateway in front of a third-party vLLM-compatible simulator (PyPI `xpyd-sim`), so that
nothing silently depends on our own simulator's quirks."""

from __future__ import annotations

import httpx
import pytest

from helpers import auth, chat_body, post, sse_events, wait_for
from stack import Model, Pool, Stack, Tenant, new_api_key
from test_gateway import usage_hash


@pytest.fixture(scope="module")
def xpyd_stack(tmp_path_factory):
    key = new_api_key()
    pools = [Pool("pool_xpyd", ["xpyd-model"], kind="xpyd-sim", max_model_len=4096)]
    models = [Model("xpyd", "pool_xpyd", 4096, served_model_name="xpyd-model")]
    tenants = [Tenant("third", [key], {"requests_per_minute": 1000, "tokens_per_minute": 1000000})]
    with Stack(tmp_path_factory.mktemp("xpyd"), pools, models, tenants) as s:
        s.key = key
        yield s


def test_stream_and_usage_through_xpyd_sim(xpyd_stack):
    stack = xpyd_stack
    r = post(stack, "/v1/chat/completions", chat_body("xpyd", max_tokens=5), key=stack.key, timeout=30)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]

    body = chat_body("xpyd", "stream please", stream=True, max_tokens=5, stream_options={"include_usage": True})
    with httpx.stream("POST", stack.base_url + "/v1/chat/completions", json=body, headers=auth(stack.key),
                      timeout=30) as resp:
        assert resp.status_code == 200
        events = sse_events(list(resp.iter_lines()))
    assert events[-1] == "[DONE]"
    stream_usage = [e["usage"] for e in events[:-1] if e.get("usage")]
    assert len(stream_usage) == 1

    expected_prompt = usage["prompt_tokens"] + stream_usage[0]["prompt_tokens"]
    expected_completion = usage["completion_tokens"] + stream_usage[0]["completion_tokens"]
    recorded = wait_for(lambda: (h := usage_hash(stack, "third")) and h.get("xpyd:requests") == 2 and h)
    assert recorded, usage_hash(stack, "third")
    assert recorded["xpyd:prompt_tokens"] == expected_prompt
    assert recorded["xpyd:completion_tokens"] == expected_completion
