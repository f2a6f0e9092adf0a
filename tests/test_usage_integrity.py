"""No upstream can corrupt the ledger, end to end (real Envoy, wasm filter, sidecar, redis-server,
and a stdlib upstream that lies: tests/lying_upstream.py).

- Usage past what the request could produce (`prompt_tokens` 2^63 - 1, which the ledger once
  summed in doubles and wrote as -2^63, taking the TPM bucket to -1.8e19 and the tenant's next
  request to a 429 for 11068046444166 s; 10^12 completion tokens) bills the request's
  reservation, counted in `llm_gateway_usage_out_of_bounds_total{reason}`: the record, the usage
  hash and the TPM bucket stay sane, and the tenant's next request is admitted.
- A second usage in one stream (1000/1000, then 1/1: the last one used to win, unbounded) bills
  the reservation, counted in `llm_gateway_usage_unreadable_total{reason="duplicate"}`.
- The filter asks the upstream for `accept-encoding: identity` when the client asked for a
  coding, so an honest upstream's usage is read; one that compresses all the same, one whose
  answer has no usage, and a Responses `background: true` answer (`usage: null`) bill the
  reservation (they used to bill the prompt estimate alone).
- SSE events ended by bare `\\r` (the format allows it): the usage is read and the injected usage
  chunk removed, so a client that did not ask for it never sees it.

Each tenant's TPM bucket refills 1 token a minute from a large burst, so its arithmetic is exact.
"""

from __future__ import annotations

import json

import httpx
import pytest
import redis

from helpers import auth, chat_body, post
from lying_upstream import LyingUpstream
from sidecar_checks import (
    SOURCE_RESERVATION,
    SOURCE_UPSTREAM,
    bucket,
    bucket_key,
    landed_events,
    metric,
    sidecar_metrics,
    usage_hash,
)
from stack import Model, Pool, Stack, Tenant, new_api_key

BIG = 1_000_000
MAX_TOKENS = 50
LIARS = ["huge", "completion", "twice", "gzip", "always-gzip", "no-usage", "cr", "background", "next"]
KEYS = {name: new_api_key() for name in LIARS}


@pytest.fixture(scope="module")
def liar_stack(tmp_path_factory):
    with LyingUpstream() as upstream:
        pools = [Pool("pool_liar", ["liar"], kind="external", urls=[upstream.url])]
        models = [Model(f"liar-{n}", "pool_liar", 4096, served_model_name=f"liar/{n}") for n in LIARS]
        limits = {"requests_per_minute": 1000, "tokens_per_minute": 1, "token_burst": BIG}
        tenants = [Tenant(f"ui-{n}", [KEYS[n]], limits) for n in LIARS]
        with Stack(tmp_path_factory.mktemp("usage-integrity"), pools, models, tenants,
                   sidecar_overrides={"metrics_listen": "127.0.0.1:0"}) as s:
            s.redis = redis.Redis(port=s.redis_port)
            s.upstream = upstream
            yield s


def billed_reservation(stack, name: str) -> dict:
    """The tenant's one usage record, which must bill its reservation."""
    [event] = landed_events(stack.redis, f"ui-{name}", 1)
    assert event["usage_source"] == SOURCE_RESERVATION, event
    assert event["prompt_tokens"] + event["completion_tokens"] == event["reserved_tokens"], event
    assert event["completion_tokens"] == MAX_TOKENS, event
    return event


def assert_books_sane(stack, name: str, event: dict) -> None:
    """The usage hash counts what the record billed, and the TPM bucket is where the reservation
    left it (within a token of refill)."""
    books = usage_hash(stack.redis, f"ui-{name}")
    assert books[f"liar-{name}:prompt_tokens"] == event["prompt_tokens"], books
    assert books[f"liar-{name}:completion_tokens"] == event["completion_tokens"], books
    assert all(v >= 0 for v in books.values()), books
    level, _ = bucket(stack.redis, bucket_key(f"ui-{name}", "tpm"))
    expected = BIG - event["reserved_tokens"]
    assert expected - 0.01 <= level <= expected + 2, (level, expected)


def counter(stack, name: str, reason: str) -> float:
    return metric(sidecar_metrics(stack), name, reason=reason)


@pytest.mark.parametrize(("name", "reason"), [("huge", "prompt_tokens"), ("completion", "completion_tokens")])
def test_usage_past_its_bounds_bills_the_reservation(liar_stack, name, reason):
    before = counter(liar_stack, "llm_gateway_usage_out_of_bounds_total", reason)
    r = post(liar_stack, "/v1/chat/completions", chat_body(f"liar-{name}", max_tokens=MAX_TOKENS), KEYS[name])
    assert r.status_code == 200, r.text
    event = billed_reservation(liar_stack, name)
    assert_books_sane(liar_stack, name, event)
    assert counter(liar_stack, "llm_gateway_usage_out_of_bounds_total", reason) == before + 1
    # The tenant's next request is admitted (the bucket was not driven to -1.8e19).
    r = post(liar_stack, "/v1/chat/completions", chat_body("liar-next", max_tokens=MAX_TOKENS), KEYS[name])
    assert r.status_code == 200, r.text


def test_a_second_usage_in_one_stream_bills_the_reservation(liar_stack):
    before = counter(liar_stack, "llm_gateway_usage_unreadable_total", "duplicate")
    body = chat_body("liar-twice", max_tokens=MAX_TOKENS, stream=True)
    with httpx.stream("POST", liar_stack.base_url + "/v1/chat/completions", json=body,
                      headers=auth(KEYS["twice"]), timeout=10) as r:
        assert r.status_code == 200
        text = r.read().decode()
    # The client did not ask for usage: both usage chunks are stripped.
    assert "usage" not in text and text.endswith("data: [DONE]\n\n"), text
    event = billed_reservation(liar_stack, "twice")
    assert_books_sane(liar_stack, "twice", event)
    assert counter(liar_stack, "llm_gateway_usage_unreadable_total", "duplicate") == before + 1


def test_the_upstream_is_asked_for_identity_and_a_coded_answer_bills_the_reservation(liar_stack):
    # The client asks for gzip; the filter asks the upstream for identity: the usage is read.
    r = post(liar_stack, "/v1/chat/completions", chat_body("liar-gzip", max_tokens=MAX_TOKENS), KEYS["gzip"],
             headers={"accept-encoding": "gzip, deflate, br"})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 30, r.text
    assert liar_stack.upstream.last_request("liar/gzip")["headers"]["accept-encoding"] == "identity"
    [event] = landed_events(liar_stack.redis, "ui-gzip", 1)
    assert (event["prompt_tokens"], event["completion_tokens"], event["usage_source"]) == (10, 30, SOURCE_UPSTREAM)
    # An upstream that compresses whatever it was asked: not read, billed the reservation.
    before = counter(liar_stack, "llm_gateway_usage_unreadable_total", "encoded")
    r = post(liar_stack, "/v1/chat/completions", chat_body("liar-always-gzip", max_tokens=MAX_TOKENS),
             KEYS["always-gzip"], headers={"accept-encoding": "gzip"})
    assert r.status_code == 200 and r.headers.get("content-encoding") == "gzip", r.headers
    assert r.json()["usage"]["completion_tokens"] == 30, "the client still gets its body"
    event = billed_reservation(liar_stack, "always-gzip")
    assert_books_sane(liar_stack, "always-gzip", event)
    assert counter(liar_stack, "llm_gateway_usage_unreadable_total", "encoded") == before + 1


def test_a_missing_usage_bills_the_reservation(liar_stack):
    before = counter(liar_stack, "llm_gateway_usage_unreadable_total", "missing")
    r = post(liar_stack, "/v1/chat/completions", chat_body("liar-no-usage", max_tokens=MAX_TOKENS), KEYS["no-usage"])
    assert r.status_code == 200 and "usage" not in r.json()
    event = billed_reservation(liar_stack, "no-usage")
    assert_books_sane(liar_stack, "no-usage", event)
    # A Responses background answer: `usage: null`.
    body = {"model": "liar-background", "input": "Hello there", "max_output_tokens": MAX_TOKENS, "background": True}
    r = post(liar_stack, "/v1/responses", body, KEYS["background"])
    assert r.status_code == 200 and r.json()["usage"] is None, r.text
    billed_reservation(liar_stack, "background")
    assert counter(liar_stack, "llm_gateway_usage_unreadable_total", "missing") == before + 2


def test_bare_carriage_returns_end_sse_lines(liar_stack):
    body = chat_body("liar-cr", max_tokens=MAX_TOKENS, stream=True)
    with httpx.stream("POST", liar_stack.base_url + "/v1/chat/completions", json=body,
                      headers=auth(KEYS["cr"]), timeout=10) as r:
        assert r.status_code == 200
        text = r.read().decode()
    assert "usage" not in text, f"the injected usage reached a client that did not ask for it: {text!r}"
    events = [e.removeprefix("data: ") for e in text.split("\r\r") if e]
    assert [json.loads(e)["choices"][0]["delta"]["content"] for e in events[:-1]] == ["a", "b"], events
    assert events[-1] == "[DONE]", events
    [event] = landed_events(liar_stack.redis, "ui-cr", 1)
    assert (event["prompt_tokens"], event["completion_tokens"], event["usage_source"]) == (7, 2, SOURCE_UPSTREAM)
