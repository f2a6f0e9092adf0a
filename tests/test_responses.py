"""The Responses API (`POST /v1/responses`, issue 15 item 5) through the real stack: envoy with the
wasm filter, the ext_proc sidecar, redis-server, and upstreams that speak it: our vllm-sim (vLLM's
shapes: events framed `event:` / `data:` with `type` last, `response.completed` carrying the usage,
no `[DONE]`) and PyPI `llmock` (its own framing: `type` first). xpyd-sim is checked for the route
and skipped, saying which version, when it has none.

What is asserted: authentication (401), routing by model to its pool, OpenAI-shaped 400s naming
the parameter, the context-length rule at its boundary (the Responses API's own: vLLM caps
`max_output_tokens` and refuses only a prompt that fills the context), the RPM and TPM limits
(the reservation is the prompt estimate plus `max_output_tokens`), and metering: one usage
record per request, equal to the usage the upstream reported (streamed: `response.completed`;
not streamed: the body's `usage`), or after a client abort the deltas that streamed; the TPM
bucket settled against it.
"""

from __future__ import annotations

import importlib.metadata
import json
import pathlib

import httpx
import openai
import pytest
import redis

from helpers import assert_openai_error, auth, post, wait_for
from sidecar_checks import (
    END_COMPLETED,
    END_INCOMPLETE,
    SOURCE_STREAMED_CHUNKS,
    SOURCE_UPSTREAM,
    assert_tpm_settled,
    landed_events,
    usage_hash,
)
from stack import Model, Pool, Stack, Tenant, new_api_key, upstream_metric

RECEIVED = "vllm_sim:requests_received_total"
GENERATED = "vllm:generation_tokens_total"
BIG = 1_000_000
TENANTS = {
    "r-main": {"requests_per_minute": 100_000, "tokens_per_minute": 1, "token_burst": BIG},
    "r-rpm": {"requests_per_minute": 2},
    "r-tpm": {"tokens_per_minute": 60, "token_burst": 2000},
    "r-meter": {"tokens_per_minute": 1, "token_burst": BIG},
    "r-abort": {"tokens_per_minute": 1, "token_burst": BIG},
    "r-mock": {"tokens_per_minute": 1, "token_burst": BIG},
    "r-sdk": {"requests_per_minute": 1000},
}
KEYS = {t: new_api_key() for t in TENANTS}
# rtiny: a 64-token context and 4-byte tokens, so the filter's lower bound on "user" + N bytes of
# input is ceil((4 + N) / 4): N = 249 fills the context, N = 248 does not.
TINY_LEN = 64


def pools_and_models(meter_only: bool = False):
    pools = [Pool("pool_ra", ["sim/ra"], ["--output-tokens", "6"])]
    models = [Model("ra", "pool_ra", served_model_name="sim/ra")]
    if meter_only:
        return pools, models
    pools += [
        Pool("pool_rb", ["sim/rb"], ["--output-tokens", "4"]),
        Pool("pool_rtiny", ["sim/rtiny"], ["--output-tokens", "5"], max_model_len=TINY_LEN),
        # 30 tokens 100 ms apart, for the abort test only (its token counter is that test's).
        Pool("pool_rslow", ["sim/rslow"], ["--ttft-ms", "20", "--itl-ms", "100", "--output-tokens", "30"]),
        Pool("pool_rmock", ["mock-model"], ["--response-style", "echo"], kind="llmock"),
    ]
    models += [
        Model("rb", "pool_rb", served_model_name="sim/rb"),
        Model("rtiny", "pool_rtiny", TINY_LEN, served_model_name="sim/rtiny", extra={"max_token_bytes": 4}),
        Model("rslow", "pool_rslow", served_model_name="sim/rslow"),
        Model("rmock", "pool_rmock", served_model_name="mock-model"),
    ]
    return pools, models


def tenants():
    return [Tenant(t, [KEYS[t]], limits) for t, limits in TENANTS.items()]


@pytest.fixture(scope="module")
def rstack(tmp_path_factory):
    pools, models = pools_and_models()
    with Stack(tmp_path_factory.mktemp("responses"), pools, models, tenants()) as s:
        s.redis = redis.Redis(port=s.redis_port)
        yield s


@pytest.fixture(scope="module")
def ext_proc_rstack(tmp_path_factory):
    """Metered by the observability-mode ext_proc filter instead of the access log (how Envoy
    Gateway is rendered): the sidecar reads the response itself, its API from the `:path`."""
    pools, models = pools_and_models(meter_only=True)
    with Stack(tmp_path_factory.mktemp("responses-ext-proc"), pools, models, tenants(), metering="ext_proc") as s:
        s.redis = redis.Redis(port=s.redis_port)
        yield s


def body(model: str, text: str = "Hello there", **extra) -> dict:
    return {"model": model, "input": text, **extra}


def received(stack, pool: str) -> float:
    return sum(upstream_metric(url, RECEIVED) for url in stack.pool(pool).urls)


def typed_events(lines) -> list[tuple[str | None, dict | str]]:
    """(the `event:` name or None, the parsed `data:`) of each event of an SSE body's lines."""
    events, name = [], None
    for line in lines:
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            data = line[len("data: "):]
            events.append((name, data if data == "[DONE]" else json.loads(data)))
            name = None
    return events


def deltas(events) -> int:
    """Content delta events with a non-empty delta (what the meter counts without a usage)."""
    return sum(1 for _, e in events if isinstance(e, dict) and str(e.get("type", "")).endswith(".delta")
               and e.get("delta"))


def stream(stack, tenant: str, payload: dict):
    """Streams a Responses request to the end: (status, headers, typed events)."""
    with httpx.stream("POST", stack.base_url + "/v1/responses", json=payload, headers=auth(KEYS[tenant]),
                      timeout=30) as r:
        return r.status_code, r.headers, typed_events(list(r.iter_lines()))


def settled(stack, tenant: str) -> None:
    """The tenant's TPM bucket holds capacity minus what its records charged (refill: 1/min)."""
    assert_tpm_settled(stack.redis, tenant, BIG)


def once(stack, tenant: str, model: str, records: int) -> list[dict]:
    """Waits for `records` records of `model`, then makes sure no more come: a later request of the
    tenant (to rb, or ra) is recorded after them and the count has not moved."""
    assert wait_for(lambda: usage_hash(stack.redis, tenant).get(f"{model}:requests") == records, timeout=10), \
        usage_hash(stack.redis, tenant)
    later = "ra" if model != "ra" else ("rb" if "pool_rb" in [p.name for p in stack.pools] else None)
    if later:
        assert post(stack, "/v1/responses", body(later, max_output_tokens=1), key=KEYS[tenant]).status_code == 200
        assert wait_for(lambda: usage_hash(stack.redis, tenant).get(f"{later}:requests"))
    h = usage_hash(stack.redis, tenant)
    assert h[f"{model}:requests"] == records, h
    events = landed_events(stack.redis, tenant, records, model=model)
    assert len(events) == records, events
    assert h[f"{model}:prompt_tokens"] == sum(e["prompt_tokens"] for e in events), (h, events)
    assert h[f"{model}:completion_tokens"] == sum(e["completion_tokens"] for e in events), (h, events)
    return events


# ------------------------------------------------------------------ authentication and routing


def test_responses_without_a_valid_key_are_401(rstack):
    before = received(rstack, "pool_ra")
    r = post(rstack, "/v1/responses", body("ra"))
    assert_openai_error(r, 401, code="invalid_api_key")
    r = post(rstack, "/v1/responses", body("ra"), key=KEYS["r-main"] + "x")
    assert_openai_error(r, 401, code="invalid_api_key")
    assert received(rstack, "pool_ra") == before


def test_each_model_reaches_its_own_pool(rstack):
    counts = {p: received(rstack, p) for p in ("pool_ra", "pool_rb")}
    for model, pool, other in (("ra", "pool_ra", "pool_rb"), ("rb", "pool_rb", "pool_ra")):
        r = post(rstack, "/v1/responses", body(model, instructions="Be brief."), key=KEYS["r-main"])
        assert r.status_code == 200, r.text
        got = r.json()
        # The filter rewrote the public name to the pool's served model name.
        assert (got["object"], got["model"], got["status"]) == ("response", f"sim/{model}", "completed")
        assert got["output"][0]["content"][0]["text"]
        counts[pool] += 1
        assert received(rstack, pool) == counts[pool]
        assert received(rstack, other) == counts[other]
    r = post(rstack, "/v1/responses", body("no-such-model"), key=KEYS["r-main"])
    assert_openai_error(r, 404, code="model_not_found", param="model")


def test_invalid_bodies_are_400_naming_the_param(rstack):
    before = received(rstack, "pool_ra")
    cases = [
        ({"model": "ra"}, "missing_required_parameter", "input"),
        (body("ra", max_output_tokens="5"), "invalid_type", "max_output_tokens"),
        (body("ra", max_output_tokens=0), "invalid_value", "max_output_tokens"),
        ({"model": "ra", "input": [5]}, "invalid_type", "input[0]"),
        ({"model": "ra", "input": [{"type": "message", "content": "hi"}]}, "missing_required_parameter",
         "input[0].role"),
        ({"model": "ra", "input": [{"role": "user", "content": [{"type": "input_text", "text": 1}]}]},
         "invalid_type", "input[0].content[0].text"),
        (body("ra", instructions=["x"]), "invalid_type", "instructions"),
        (body("ra", stream="true"), "invalid_type", "stream"),
    ]
    for payload, code, param in cases:
        r = post(rstack, "/v1/responses", payload, key=KEYS["r-main"])
        assert_openai_error(r, 400, code=code, param=param)
    assert received(rstack, "pool_ra") == before
    r = httpx.get(rstack.base_url + "/v1/responses", headers=auth(KEYS["r-main"]), timeout=10)
    assert_openai_error(r, 405)


# ------------------------------------------------------------------ context length


def test_context_length_400_at_the_boundary(rstack):
    before = received(rstack, "pool_rtiny")
    # 249 bytes: the lower bound is the whole 64-token context. Refused by the filter.
    r = post(rstack, "/v1/responses", body("rtiny", "y" * 249), key=KEYS["r-main"])
    error = assert_openai_error(r, 400, code="context_length_exceeded", param="input")
    assert str(TINY_LEN) in error["message"]
    assert received(rstack, "pool_rtiny") == before
    # One byte less is not provably too long: it goes to the upstream, which counts the template's
    # tokens too and answers its own 400 (vLLM decides what bounds cannot).
    r = post(rstack, "/v1/responses", body("rtiny", "y" * 248), key=KEYS["r-main"])
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "BadRequestError", r.text
    assert received(rstack, "pool_rtiny") == before + 1
    # max_output_tokens beyond the context is capped by vLLM's Responses API, not refused (chat's
    # max_tokens would be).
    r = post(rstack, "/v1/responses", body("rtiny", "hi", max_output_tokens=1000), key=KEYS["r-main"])
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["output_tokens"] == 5
    assert received(rstack, "pool_rtiny") == before + 2


# ------------------------------------------------------------------ limits


def test_rpm_limit_applies(rstack):
    for _ in range(2):
        assert post(rstack, "/v1/responses", body("ra"), key=KEYS["r-rpm"]).status_code == 200
    before = received(rstack, "pool_ra")
    r = post(rstack, "/v1/responses", body("ra"), key=KEYS["r-rpm"])
    error = assert_openai_error(r, 429, code="rate_limit_exceeded")
    assert error["type"] == "requests"
    assert int(r.headers["retry-after"]) >= 1
    assert received(rstack, "pool_ra") == before


def test_tpm_reserves_the_prompt_and_max_output_tokens(rstack):
    r = post(rstack, "/v1/responses", body("ra", max_output_tokens=100), key=KEYS["r-tpm"])
    assert r.status_code == 200, r.text
    # The reservation: the prompt estimate ("user" + "Hello there": 15 bytes, 4 tokens) plus
    # max_output_tokens, from a full 2000 bucket.
    assert 2000 - int(r.headers["x-ratelimit-remaining-tokens"]) == 4 + 100, r.headers
    before = received(rstack, "pool_ra")
    r = post(rstack, "/v1/responses", body("ra", max_output_tokens=1999), key=KEYS["r-tpm"])
    error = assert_openai_error(r, 429, code="rate_limit_exceeded")
    assert error["type"] == "tokens"
    assert received(rstack, "pool_ra") == before


# ------------------------------------------------------------------ metering


@pytest.mark.parametrize("metering", ["access_log", "ext_proc"])
def test_responses_are_metered_once_with_the_upstreams_usage(request, metering):
    stack = request.getfixturevalue("rstack" if metering == "access_log" else "ext_proc_rstack")
    # Streamed: the usage is response.completed's.
    status, headers, events = stream(stack, "r-meter", body("ra", "meter me", instructions="Be brief.",
                                                           stream=True, max_output_tokens=50))
    assert status == 200
    assert headers["content-type"].startswith("text/event-stream")
    names = [n for n, _ in events]
    assert names[0] == "response.created" and names[-1] == "response.completed", names
    assert all(isinstance(e, dict) and e["type"] == n for n, e in events), events
    # The stream passed untouched: every event, in order, nothing injected or stripped.
    assert [e["sequence_number"] for _, e in events] == list(range(len(events)))
    streamed = events[-1][1]["response"]["usage"]
    assert streamed["output_tokens"] == deltas(events) == 6, (streamed, events)
    # Not streamed: the body's usage.
    r = post(stack, "/v1/responses", body("ra", "and me", max_output_tokens=3), key=KEYS["r-meter"])
    assert r.status_code == 200, r.text
    whole = r.json()["usage"]
    assert whole["output_tokens"] == 3

    records = once(stack, "r-meter", "ra", 2)
    by_kind = sorted(records, key=lambda e: e["completion_tokens"])
    for event, usage in zip(by_kind, (whole, streamed)):
        assert (event["prompt_tokens"], event["completion_tokens"], event["cached_tokens"]) == \
            (usage["input_tokens"], usage["output_tokens"], usage["input_tokens_details"]["cached_tokens"]), \
            (event, usage)
        assert (event["status"], event["end_reason"], event["usage_source"]) == \
            (200, END_COMPLETED, SOURCE_UPSTREAM), event
        assert 0 < event["ttft_us"] <= event["duration_us"], event
    h = usage_hash(stack.redis, "r-meter")
    assert h["ra:prompt_tokens"] == whole["input_tokens"] + streamed["input_tokens"], h
    assert h["ra:completion_tokens"] == whole["output_tokens"] + streamed["output_tokens"], h
    settled(stack, "r-meter")


def test_a_client_abort_is_metered_once_from_the_deltas(rstack):
    stack = rstack
    url = stack.pool("pool_rslow").urls[0]
    generated_before = upstream_metric(url, GENERATED)
    payload = body("rslow", "abort me", stream=True, max_output_tokens=30)
    seen = []
    with httpx.stream("POST", stack.base_url + "/v1/responses", json=payload, headers=auth(KEYS["r-abort"]),
                      timeout=10) as r:
        assert r.status_code == 200
        reserved = BIG - int(r.headers["x-ratelimit-remaining-tokens"])
        lines = []
        for line in r.iter_lines():
            lines.append(line)
            seen = typed_events(lines)
            if deltas(seen) == 3:
                break
    # Leaving the block closed the connection mid-stream (about 2.7 s of it left).
    assert "response.completed" not in [n for n, _ in seen]

    [event] = once(stack, "r-abort", "rslow", 1)
    generated = upstream_metric(url, GENERATED) - generated_before
    assert 3 <= generated < 30, generated
    assert event["completion_tokens"] == generated, (event, generated)
    assert (event["status"], event["end_reason"], event["usage_source"]) == \
        (200, END_INCOMPLETE, SOURCE_STREAMED_CHUNKS), event
    assert event["reserved_tokens"] == reserved
    # No usage arrived: the prompt is the filter's estimate, the reservation less max_output_tokens.
    assert event["prompt_tokens"] == reserved - 30 > 0, event
    assert 0 < event["ttft_us"] < event["duration_us"] < 5_000_000, event
    settled(stack, "r-abort")


# ------------------------------------------------------------------ third-party upstreams


def test_llmock_responses_are_metered_with_its_usage(rstack):
    """llmock frames its events differently (`type` first, its own token counts)."""
    stack = rstack
    status, _, events = stream(stack, "r-mock", body("rmock", "one two three four", stream=True))
    assert status == 200
    assert events[-1][0] == "response.completed", events
    streamed = events[-1][1]["response"]["usage"]
    assert streamed["output_tokens"] > 0 and deltas(events) > 0
    r = post(stack, "/v1/responses", body("rmock", "five six"), key=KEYS["r-mock"])
    assert r.status_code == 200, r.text
    whole = r.json()["usage"]
    records = once(stack, "r-mock", "rmock", 2)
    got = sorted((e["prompt_tokens"], e["completion_tokens"]) for e in records)
    want = sorted((u["input_tokens"], u["output_tokens"]) for u in (streamed, whole))
    assert got == want, (records, streamed, whole)
    assert all(e["usage_source"] == SOURCE_UPSTREAM and e["end_reason"] == END_COMPLETED for e in records), records
    settled(stack, "r-mock")


def xpyd_sim_route() -> tuple[bool, str]:
    """Whether the installed xpyd-sim declares a `/v1/responses` route, and its version."""
    import xpyd_sim  # noqa: PLC0415

    version = importlib.metadata.version("xpyd-sim")
    sources = pathlib.Path(xpyd_sim.__file__).parent.rglob("*.py")
    return any('"/v1/responses"' in p.read_text() for p in sources), version


def test_xpyd_sim_responses(tmp_path_factory):
    serves, version = xpyd_sim_route()
    if not serves:
        pytest.skip(f"xpyd-sim {version} serves no POST /v1/responses (no such route in the package); "
                    f"llmock {importlib.metadata.version('llmock')} does and is tested above")
    key = new_api_key()
    pools = [Pool("pool_xpyd", ["xpyd-model"], kind="xpyd-sim", max_model_len=4096)]
    models = [Model("xpyd", "pool_xpyd", 4096, served_model_name="xpyd-model")]
    tenant = [Tenant("r-xpyd", [key], {"requests_per_minute": 1000, "tokens_per_minute": 1_000_000})]
    with Stack(tmp_path_factory.mktemp("xpyd-responses"), pools, models, tenant) as s:
        r = post(s, "/v1/responses", body("xpyd"), key=key, timeout=30)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        client = redis.Redis(port=s.redis_port)
        assert wait_for(lambda: usage_hash(client, "r-xpyd").get("xpyd:requests") == 1)
        h = usage_hash(client, "r-xpyd")
        assert (h["xpyd:prompt_tokens"], h["xpyd:completion_tokens"]) == (usage["input_tokens"], usage["output_tokens"])


# ------------------------------------------------------------------ a real client


def test_the_openai_sdk_uses_the_responses_api_through_the_gateway(rstack):
    client = openai.OpenAI(base_url=rstack.base_url + "/v1", api_key=KEYS["r-sdk"], max_retries=0)
    response = client.responses.create(model="ra", input="Hello", instructions="Be brief.", max_output_tokens=4)
    assert response.output_text == "the quick brown fox "
    assert (response.usage.output_tokens, response.status) == (4, "completed")
    kinds, text = [], ""
    with client.responses.create(model="ra", input="Hello", stream=True) as events:
        for event in events:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                text += event.delta
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed", kinds
    assert text == "the quick brown fox jumps over "
