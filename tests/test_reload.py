"""Reloading the filter's configuration without restarting Envoy (filesystem-watched LDS)."""

from __future__ import annotations

import copy
import json
import urllib.request

import pytest

from helpers import assert_openai_error, auth, chat_body, post, stream_in_background, wait_for
from stack import Model, Pool, Stack, Tenant, new_api_key

KEY, LATER_KEY = new_api_key(), new_api_key()


def lds_stat(stack, name: str) -> int:
    with urllib.request.urlopen(stack.admin_url + "/stats?format=json&filter=^listener_manager\\.lds\\.", timeout=2) as r:
        stats = {s["name"]: s.get("value", 0) for s in json.load(r)["stats"] if "name" in s}
    return int(stats.get(f"listener_manager.lds.{name}", 0))


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    pools = [Pool("pool_slow", ["sim/slow"], ["--ttft-ms", "10", "--itl-ms", "40", "--output-tokens", "40"])]
    models = [Model("slow", "pool_slow", 4096, served_model_name="sim/slow")]
    tenants = [Tenant("main", [KEY], {"requests_per_minute": 100000}),
               Tenant("later", [LATER_KEY], {"requests_per_minute": 100000})]
    s = Stack(tmp_path_factory.mktemp("reload"), pools, models, tenants, dynamic_listeners=True)
    full = s.filter_config()
    # The sidecar knows both tenants; the filter starts without the second one's key.
    s.filter_config_override = {**full, "tenants": [t for t in full["tenants"] if t["id"] != "later"]}
    s.full_filter_config = full
    with s:
        yield s


def test_reload_applies_a_new_key_and_in_flight_streams_finish(stack):
    assert_openai_error(post(stack, "/v1/chat/completions", chat_body("slow"), key=LATER_KEY), 401)
    updates = lds_stat(stack, "update_success")
    thread, events, first_chunk = stream_in_background(stack.base_url, chat_body("slow", stream=True), auth(KEY))
    assert first_chunk.wait(10)
    stack.reload(stack.full_filter_config)
    assert wait_for(lambda: lds_stat(stack, "update_success") > updates), "Envoy did not apply the new listener"
    # New connections get the new config...
    r = wait_for(lambda: (x := post(stack, "/v1/chat/completions", chat_body("slow"), key=LATER_KEY)).status_code == 200 and x)
    assert r, "the new key was not accepted after the reload"
    # ...while the stream that started before the reload runs to its end on the old one.
    thread.join(20)
    assert not thread.is_alive()
    assert events[-1] == "[DONE]"
    content = [e for e in events[:-1] if e["choices"] and e["choices"][0]["delta"].get("content")]
    assert len(content) == 40


def test_a_bad_config_is_rejected_naming_the_field_and_the_old_one_keeps_serving(stack):
    rejected = lds_stat(stack, "update_rejected")
    bad = copy.deepcopy(stack.full_filter_config)
    bad["models"][0]["max_model_len"] = 0
    stack.reload(bad)
    assert wait_for(lambda: lds_stat(stack, "update_rejected") > rejected), "Envoy did not reject the config"
    assert wait_for(lambda: "models[0].max_model_len: must be > 0" in stack.envoy_log()), stack.envoy_log()
    for key in (KEY, LATER_KEY):
        r = post(stack, "/v1/chat/completions", chat_body("slow", max_tokens=2), key=key)
        assert r.status_code == 200, r.text
