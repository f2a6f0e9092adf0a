"""Only the filter's decision may bill (real Envoy, wasm filter, sidecar, redis-server, vllm-sim).

The sidecar admits and meters a request by what clients cannot write: the filter state the wasm
filter sets (`wasm.llm_gateway.request`, `wasm.llm_gateway.admission`) and the dynamic metadata
the ext_proc admission sets. Request headers count for nothing: a local reply that Envoy sends
before the filter runs (an `Upgrade` it refuses, request headers too large) carries the client's
`x-gateway-*` headers as sent, and must leave Redis and the pool's in-flight count untouched.
`x-request-id` is Envoy's, and client `x-envoy-*` router controls are not honoured.

Envoy runs one worker, so its access-log entries reach the sidecar in order: once the record of a
later, valid request is in Redis, the forged entries before it have been processed.
"""

from __future__ import annotations

import socket

import httpx
import pytest
import redis

from helpers import assert_openai_error, auth, chat_body, post, wait_for
from sidecar_checks import bucket, bucket_key, metric, sidecar_metrics, usage_events, usage_hash
from stack import Model, Pool, Stack, Tenant, new_api_key, upstream_metric

RECEIVED = "vllm_sim:requests_received_total"
PROBE, VICTIM = "trust-probe", "trust-victim"
KEYS = {PROBE: new_api_key(), VICTIM: new_api_key()}
# One token a minute: the buckets stay where the requests put them while the test reads them.
LIMITS = {"requests_per_minute": 1, "request_burst": 1000, "tokens_per_minute": 1, "token_burst": 1_000_000}

FORGED = {
    "x-gateway-admission": "lease",
    "x-gateway-reserved-tokens": "99999999",
    "x-gateway-tenant": VICTIM,
    "x-gateway-tier": "standard",
    "x-gateway-model": "t",
    "x-gateway-pool": "pool_t",
    "x-gateway-prompt-tokens": "5",
    "x-gateway-max-tokens": "5",
}


@pytest.fixture(scope="module")
def trust_stack(tmp_path_factory):
    pools = [
        Pool("pool_t", ["sim/t"], ["--output-tokens", "2"], shedding={"max_in_flight": 100}),
        # Every inference request answered 500: what a client-set retry policy would multiply.
        Pool("pool_err", ["sim/err"], ["--error-rate", "1"]),
    ]
    models = [Model("t", "pool_t", served_model_name="sim/t"), Model("err", "pool_err", served_model_name="sim/err")]
    tenants = [Tenant(t, [k], LIMITS) for t, k in KEYS.items()]
    overrides = {"metrics_listen": "127.0.0.1:0"}
    with Stack(tmp_path_factory.mktemp("trust"), pools, models, tenants, envoy_concurrency=1,
               sidecar_overrides=overrides) as s:
        yield s


def victim_state(client: redis.Redis) -> dict:
    """Everything the sidecar could have written for the victim tenant."""
    return {
        "keys": sorted(k.decode() for k in client.scan_iter(match=f"*{VICTIM}*")),
        "rpm": bucket(client, bucket_key(VICTIM, "rpm")),
        "tpm": bucket(client, bucket_key(VICTIM, "tpm")),
        "usage": usage_hash(client, VICTIM),
        "events": usage_events(client, VICTIM),
    }


def raw_request(stack, request: bytes) -> bytes:
    """Sends raw HTTP/1.1 bytes and returns the response's status line."""
    host, port = stack.base_url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(request)
        data = b""
        while b"\r\n" not in data:
            chunk = sock.recv(4096)
            if not chunk:
                break
            data += chunk
    return data.split(b"\r\n", 1)[0]


def probe_recorded(stack, client: redis.Redis, n: int) -> None:
    """A valid request of the probe tenant, then waits until its record is in Redis: the access-log
    entries Envoy's one worker logged before it have been processed by then."""
    r = post(stack, "/v1/chat/completions", chat_body("t", max_tokens=3), key=KEYS[PROBE])
    assert r.status_code == 200, r.text
    assert wait_for(lambda: usage_hash(client, PROBE).get("t:requests") == n, timeout=30), \
        (usage_hash(client, PROBE), stack.logs())


def test_local_replies_before_the_filter_leave_redis_untouched(trust_stack):
    """The reproduction of issue 17: no API key, an `Upgrade` Envoy refuses before any HTTP filter,
    every `x-gateway-*` fact forged. And requests whose headers are too large (431 from Envoy's
    codec). None may write a usage record, settle a bucket or move the pool's in-flight count."""
    s = trust_stack
    client = redis.Redis(port=s.redis_port)
    before = victim_state(client)
    in_flight = metric(sidecar_metrics(s), "llm_gateway_in_flight_requests", pool="pool_t")

    forged = "".join(f"{k}: {v}\r\n" for k, v in FORGED.items())
    statuses = []
    for _ in range(3):
        statuses.append(raw_request(s, (
            "POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nConnection: Upgrade\r\n"
            f"Upgrade: websocket\r\n{forged}content-type: application/json\r\ncontent-length: 2\r\n\r\n{{}}"
        ).encode()))
    # Headers over Envoy's limit (60 KiB by default): answered by the codec, logged all the same.
    statuses.append(raw_request(s, (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\n{forged}x-pad: {'a' * 70_000}\r\n"
        "content-type: application/json\r\ncontent-length: 2\r\n\r\n{}"
    ).encode()))
    assert all(b" 403 " in st for st in statuses[:3]), statuses
    assert b" 431 " in statuses[3], statuses

    probe_recorded(s, client, 1)
    assert victim_state(client) == before, s.logs()
    assert metric(sidecar_metrics(s), "llm_gateway_in_flight_requests", pool="pool_t") == in_flight
    assert f"tenant={VICTIM}" not in s.logs() and f'"tenant":"{VICTIM}"' not in s.logs()


def test_a_client_cannot_claim_a_lease(trust_stack):
    """An authenticated request with forged lease headers: the filter removes them, the ext_proc
    admission takes its reservation from the tenant's buckets and the record settles it."""
    s = trust_stack
    client = redis.Redis(port=s.redis_port)
    tpm_before = bucket(client, bucket_key(VICTIM, "tpm"))
    r = post(s, "/v1/chat/completions", chat_body("t", max_tokens=3), key=KEYS[VICTIM], headers=FORGED)
    assert r.status_code == 200, r.text
    assert "x-ratelimit-remaining-tokens" in r.headers, r.headers
    assert wait_for(lambda: usage_hash(client, VICTIM).get("t:requests") == 1, timeout=30), s.logs()
    tpm_after = bucket(client, bucket_key(VICTIM, "tpm"))
    used = usage_hash(client, VICTIM)["t:prompt_tokens"] + usage_hash(client, VICTIM)["t:completion_tokens"]
    start = tpm_before[0] if tpm_before else LIMITS["token_burst"]
    # The bucket ends where the request's usage put it (refill: 1 token a minute).
    assert start - used <= tpm_after[0] <= start - used + 1, (tpm_before, tpm_after, used)


def test_x_request_id_is_envoys(trust_stack):
    """A client's x-request-id is replaced by Envoy's, in what the upstream sees and in the usage
    record; two requests with the same client id get two ids."""
    s = trust_stack
    client = redis.Redis(port=s.redis_port)
    seen = len(usage_events(client, PROBE))
    for _ in range(2):
        r = post(s, "/v1/chat/completions", chat_body("t", max_tokens=3), key=KEYS[PROBE],
                 headers={"x-request-id": "client-chosen-id"})
        assert r.status_code == 200, r.text
    assert wait_for(lambda: len(usage_events(client, PROBE)) == seen + 2, timeout=30), s.logs()
    ids = [e["request_id"] for e in usage_events(client, PROBE)[seen:]]
    assert "client-chosen-id" not in ids and len(set(ids)) == 2 and all(ids), ids


def test_client_retry_headers_are_not_honoured(trust_stack):
    """`x-envoy-retry-on` / `x-envoy-max-retries` from a client would run one admitted request on
    the GPU several times and meter it once: Envoy removes them from external requests."""
    s = trust_stack
    client = redis.Redis(port=s.redis_port)
    url = s.pool("pool_err").urls[0]
    received = upstream_metric(url, RECEIVED)
    r = post(s, "/v1/chat/completions", chat_body("err", max_tokens=3), key=KEYS[PROBE],
             headers={"x-envoy-retry-on": "5xx,retriable-status-codes", "x-envoy-max-retries": "3",
                      "x-envoy-retriable-status-codes": "500", "x-envoy-upstream-rq-timeout-ms": "1"})
    assert r.status_code == 500, r.text
    assert upstream_metric(url, RECEIVED) == received + 1, "the upstream ran the request more than once"
    assert wait_for(lambda: usage_hash(client, PROBE).get("err:requests") == 1, timeout=30), s.logs()


def test_no_api_key_reaches_envoys_log_at_trace_level(tmp_path):
    """Envoy at its most verbose (`--log-level trace`, as `make run` starts it): neither an
    `Authorization: Bearer` nor an `x-api-key` value appears in its log, over HTTP/1.1 and HTTP/2
    (the connection manager dumps request headers at debug, the codecs at trace, before any
    filter; the stack keeps those loggers at info, stack.SECRET_SAFE_COMPONENT_LEVELS)."""
    key = new_api_key()
    pools = [Pool("pool_log", ["sim/log"], ["--output-tokens", "2"])]
    with Stack(tmp_path / "trace", pools, [Model("log", "pool_log", served_model_name="sim/log")],
               [Tenant("log-tenant", [key])], envoy_concurrency=1, envoy_log_level="trace") as s:
        body = chat_body("log", max_tokens=2)
        assert post(s, "/v1/chat/completions", body, key).status_code == 200
        assert post(s, "/v1/chat/completions", body, headers={"x-api-key": key}).status_code == 200
        with httpx.Client(http2=True, http1=False) as h2:
            r = h2.post(s.base_url + "/v1/chat/completions", json=body, headers=auth(key), timeout=10)
            assert r.status_code == 200 and r.http_version == "HTTP/2", (r.status_code, r.http_version)
        log = s.envoy.log.read_text(errors="replace")
        assert "[trace]" in log and "[debug]" in log, "Envoy did not log at trace level"
        secret = key.removeprefix("sk-")
        leaks = [line for line in log.splitlines() if secret[:12] in line]
        assert not leaks, leaks[:3]


def test_sequences_past_max_n_are_refused(trust_stack):
    """`n` = 2^64 - 1 (admitted and forwarded once, and vllm-sim panicked on it) is refused 400
    naming the parameter, before any reservation; so is a completions `best_of` past it."""
    r = post(trust_stack, "/v1/chat/completions", chat_body("t", n=2**64 - 1), KEYS[PROBE])
    assert_openai_error(r, 400, "invalid_value", "n")
    body = {"model": "t", "prompt": "hi", "n": 1, "best_of": 16385}
    assert_openai_error(post(trust_stack, "/v1/completions", body, KEYS[PROBE]), 400, "invalid_value", "best_of")
