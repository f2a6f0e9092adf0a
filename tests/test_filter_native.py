"""The gateway filter as an Envoy dynamic module (filter-native/) in the wasm filter's place, in the full gateway: real envoy + the native module + ext_proc sidecar
+ redis-server + upstreams.

The module runs the wasm filter's own decisions (gateway-filter, gateway-meter) behind Envoy's C
ABI, so a client must see the same answers from it as from the wasm filter, and the sidecar must
admit and meter by the facts and usage it leaves in filter state (the keys the wasm module's
properties have). A wrong ABI declaration would crash Envoy, which these tests would see as
connection errors and the Envoy log on failure.
"""

from __future__ import annotations

import datetime
import json
import subprocess

import httpx
import pytest
import redis

from helpers import auth, chat_body, envoy_stats, post, sse_events, start_slow_body, wait_for
from stack import FILTER_NATIVE, Model, Pool, Stack, Tenant, envoy_binary, new_api_key, upstream_metric

KEYS = {name: new_api_key() for name in ("acme", "tiny", "restricted")}


def gateway(workdir, native: bool) -> Stack:
    """One gateway with the test's pools, models and tenants: the wasm filter, or the module."""
    pools = [Pool("pool_alpha", ["sim/alpha"], ["--output-tokens", "6"]),
             Pool("pool_beta", ["sim/beta"], ["--output-tokens", "5"])]
    models = [Model("alpha", "pool_alpha", 256, served_model_name="sim/alpha", extra={"max_token_bytes": 128}),
              Model("beta", "pool_beta", 4096, served_model_name="sim/beta")]
    tenants = [Tenant("acme", [KEYS["acme"]], {"requests_per_minute": 100000, "tokens_per_minute": 100000000}),
               Tenant("tiny", [KEYS["tiny"]], {"requests_per_minute": 2}),
               Tenant("restricted", [KEYS["restricted"]], {"requests_per_minute": 1000}, models=["beta"])]
    return Stack(workdir, pools, models, tenants, filter_extra={"max_body_bytes": 65536},
                 native_module=FILTER_NATIVE if native else None)


@pytest.fixture(scope="module")
def stacks(tmp_path_factory):
    """The wasm gateway and the native one, with the same configuration."""
    if not FILTER_NATIVE.exists():
        pytest.fail(f"{FILTER_NATIVE} is missing: `make build` builds it (cargo build --release -p "
                    "gateway-filter-native)")
    with gateway(tmp_path_factory.mktemp("wasm"), native=False) as wasm, \
            gateway(tmp_path_factory.mktemp("native"), native=True) as native:
        yield {"wasm": wasm, "native": native}


def usage_hash(stack, tenant: str) -> dict[str, int]:
    day = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    client = redis.Redis(port=stack.redis_port, decode_responses=True)
    return {k: int(v) for k, v in client.hgetall(f"llmgw:usage:{{{tenant}}}:{day}").items()}


# Requests the filter answers itself: (body, the key it is sent with, extra headers, status).
REFUSED = {
    "no API key": (chat_body("beta"), None, {}, 401),
    "a wrong API key": (chat_body("beta"), "sk-wrong", {}, 401),
    "an unknown model": (chat_body("nope"), "acme", {}, 404),
    "a model the tenant may not use": (chat_body("alpha"), "restricted", {}, 403),
    "invalid JSON": (b"{nope", "acme", {}, 400),
    "no messages": ({"model": "beta"}, "acme", {}, 400),
    # 40,000 bytes are at least 312 tokens of at most 128 bytes: over alpha's 256.
    "a prompt over max_model_len": (chat_body("alpha", "a" * 40000), "acme", {}, 400),
    "a body over max_body_bytes": (chat_body("beta", "x" * 70000), "acme", {}, 413),
    "a spoofed x-gateway-tenant only": (chat_body("beta"), None, {"x-gateway-tenant": "acme"}, 401),
}


@pytest.mark.parametrize("case", REFUSED)
def test_the_module_refuses_as_the_wasm_filter_does(stacks, case):
    body, key, headers, status = REFUSED[case]
    answers = []
    for name, stack in stacks.items():
        r = post(stack, "/v1/chat/completions", body, key=KEYS.get(key, key), headers=headers)
        assert r.status_code == status, (name, r.text, stack.envoy.log_tail())
        answers.append((r.status_code, r.headers.get("content-type"), r.content))
    assert answers[0] == answers[1], answers


def test_the_sidecar_admits_by_the_modules_facts(stacks):
    """The tenant's RPM is spent by the module's requests: the sidecar read the tenant from the
    filter state the module set (it never reads x-gateway-* request headers)."""
    stack = stacks["native"]
    remaining = []
    for _ in range(2):
        r = post(stack, "/v1/chat/completions", chat_body("beta"), key=KEYS["tiny"])
        assert r.status_code == 200, (r.text, stack.envoy.log_tail())
        remaining.append(int(r.headers["x-ratelimit-remaining-requests"]))
    assert remaining == [1, 0]
    r = post(stack, "/v1/chat/completions", chat_body("beta"), key=KEYS["tiny"])
    assert r.status_code == 429, r.text
    assert r.json()["error"]["code"] == "rate_limit_exceeded"


def test_the_module_meters_exactly_and_strips_the_usage_it_asked_for(stacks):
    stack = stacks["native"]
    url = stack.pool("pool_beta").urls[0]
    prompt_before = upstream_metric(url, "vllm:prompt_tokens_total")
    generated_before = upstream_metric(url, "vllm:generation_tokens_total")
    r = post(stack, "/v1/chat/completions", chat_body("beta", "count me"), key=KEYS["acme"])
    assert r.status_code == 200, r.text
    asked = chat_body("beta", "stream me please", stream=True, stream_options={"include_usage": True})
    with httpx.stream("POST", stack.base_url + "/v1/chat/completions", json=asked, headers=auth(KEYS["acme"]),
                      timeout=10) as r:
        events = sse_events(list(r.iter_lines()))
    assert len([e for e in events if e != "[DONE]" and e.get("usage")]) == 1
    # Not asked for: the module injects stream_options and strips the usage again.
    plain = chat_body("beta", "and me", stream=True, max_tokens=4)
    with httpx.stream("POST", stack.base_url + "/v1/chat/completions", json=plain, headers=auth(KEYS["acme"]),
                      timeout=10) as r:
        assert r.status_code == 200
        assert "content-length" not in r.headers
        events = sse_events(list(r.iter_lines()))
    assert events[-1] == "[DONE]"
    assert all("usage" not in e for e in events if e != "[DONE]"), events
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1] if e["choices"])

    expected = {
        "beta:requests": 3,
        "beta:prompt_tokens": int(upstream_metric(url, "vllm:prompt_tokens_total") - prompt_before),
        "beta:completion_tokens": int(upstream_metric(url, "vllm:generation_tokens_total") - generated_before),
    }
    recorded = wait_for(lambda: (h := usage_hash(stack, "acme")) and h.get("beta:requests") == 3 and h)
    assert recorded, (usage_hash(stack, "acme"), envoy_stats(stack, "access_log"), stack.envoy.log_tail())
    assert {k: recorded.get(k) for k in expected} == expected


def test_an_invalid_configuration_is_refused_at_load_naming_the_field(tmp_path):
    """Envoy does not start with a configuration the module refuses, and its log names the field
    (as the wasm filter's does): the module answers `config_new` with null."""
    stack = gateway(tmp_path, native=True)
    stack.filter_config_override = {**stack.filter_config(), "tenants": [{"id": "acme", "tierx": "gold"}]}
    bootstrap = tmp_path / "envoy.json"
    bootstrap.write_text(json.dumps(stack.envoy_config()))
    result = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(bootstrap), "--log-level", "warn"],
                            capture_output=True, text=True, timeout=60, check=False)
    log = result.stdout + result.stderr
    assert result.returncode != 0, log
    assert "gateway-filter-native: invalid filter configuration: tenants[0].tierx: unknown field `tierx`" in log, log


def test_a_tenant_holds_at_most_its_upload_slots_per_worker(tmp_path):
    """max_uploads_per_tenant (2, one Envoy worker): with two bodies of a tenant still arriving,
    its next request is answered 429 with Retry-After, another tenant is served, and a slot comes
    back when a slow body's connection goes away (the module's per-thread table, per
    configuration)."""
    key, other = new_api_key(), new_api_key()
    tenants = [Tenant("slow", [key]), Tenant("other", [other])]
    with Stack(tmp_path, [Pool("pool_u", ["sim/u"], ["--output-tokens", "2"])], [Model("u", "pool_u", served_model_name="sim/u")],
               tenants, profile="filter", envoy_concurrency=1, filter_extra={"max_uploads_per_tenant": 2},
               native_module=FILTER_NATIVE) as s:
        slow = [start_slow_body(s, key, "u") for _ in range(2)]
        try:
            def refused():
                r = post(s, "/v1/chat/completions", chat_body("u"), key=key)
                return r if r.status_code == 429 else None
            r = wait_for(refused, timeout=30)
            assert r is not None, s.envoy.log_tail()
            assert r.headers.get("retry-after") == "1", r.headers
            assert r.json()["error"]["code"] == "rate_limit_exceeded", r.text
            assert post(s, "/v1/chat/completions", chat_body("u"), key=other).status_code == 200
        finally:
            slow[0].close()
        assert wait_for(lambda: post(s, "/v1/chat/completions", chat_body("u"), key=key).status_code == 200,
                        timeout=30)
        for conn in slow[1:]:
            conn.close()
