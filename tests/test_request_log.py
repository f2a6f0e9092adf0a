"""The request log (envoy/access_log_requests.yaml): every request Envoy answers is one JSON line that
says why it failed (response flags and details, the filter's refusal), where it went (upstream host)
and whose it was (tenant and model from the filter's filter state), and never carries a key."""

from __future__ import annotations

import pytest

from helpers import chat_body, post, wait_for
from stack import Model, Pool, Stack, Tenant, free_port, new_api_key

KEY = new_api_key()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    # `down` points at a port nothing listens on: Envoy's connection to it fails.
    pools = [Pool("pool_up", ["sim/up"], ["--output-tokens", "3"]),
             Pool("pool_down", ["sim/down"], kind="external", urls=[f"http://127.0.0.1:{free_port()}"])]
    models = [Model("up", "pool_up", 4096, served_model_name="sim/up"),
              Model("down", "pool_down", 4096, served_model_name="sim/down")]
    s = Stack(tmp_path_factory.mktemp("request-log"), pools, models,
              [Tenant("acme", [KEY], {"requests_per_minute": 100000})], request_log=True)
    with s:
        yield s


def entry_of(stack, match) -> dict:
    """The newest request-log entry for which `match(entry)` holds (Envoy writes an entry at the
    stream's end, just after the response: polled)."""
    found = wait_for(lambda: [e for e in stack.requests_logged() if match(e)], timeout=30)
    assert found, f"no matching request-log entry in:\n{stack.request_log_path.read_text()}\n{stack.envoy_log()}"
    return found[-1]


def test_an_upstream_that_refuses_connections_is_logged_with_its_cause(stack):
    r = post(stack, "/v1/chat/completions", chat_body("down"), key=KEY)
    assert r.status_code == 503, r.text
    e = entry_of(stack, lambda e: e.get("model") == "down")
    assert e["response_code"] == 503, e
    assert "UF" in e["response_flags"], e
    assert e["response_code_details"].startswith("upstream_reset_before_response_started"), e
    assert e["upstream_cluster"] == "pool_down", e
    assert e["upstream_host"].startswith("127.0.0.1:"), e
    assert e["upstream_transport_failure_reason"], e
    assert e["tenant"] == "acme", e


def test_a_served_request_is_logged_as_from_the_upstream(stack):
    r = post(stack, "/v1/chat/completions", chat_body("up"), key=KEY)
    assert r.status_code == 200, r.text
    e = entry_of(stack, lambda e: e.get("model") == "up")
    assert (e["response_code"], e["response_code_details"], e["response_flags"]) == (200, "via_upstream", "-"), e
    assert (e["tenant"], e["refusal"]) == ("acme", None), e
    assert e["upstream_cluster"] == "pool_up", e
    assert e["request_id"], e  # Envoy's x-request-id, which the usage record carries too


def test_the_filters_refusals_say_why_and_no_key_is_logged(stack):
    wrong = new_api_key()
    assert post(stack, "/v1/chat/completions", chat_body("up"), key=wrong).status_code == 401
    assert post(stack, "/v1/chat/completions", chat_body("up")).status_code == 401
    assert post(stack, "/v1/chat/completions", b'{"model": "up", "messages": ', key=KEY).status_code == 400
    for refusal in ("llm_gateway_invalid_api_key", "llm_gateway_missing_api_key", "llm_gateway_invalid_json"):
        e = entry_of(stack, lambda e, r=refusal: e.get("refusal") == r)
        assert e["response_code"] in (400, 401), e
        assert e["tenant"] == ("acme" if refusal == "llm_gateway_invalid_json" else None), e
    text = stack.request_log_path.read_text()
    assert KEY not in text and wrong not in text, "a key reached the request log"
