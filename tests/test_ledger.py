"""Two sidecar replicas on one Redis, as Kubernetes runs them (real Envoy, redis-server, vllm-sim).

Envoy's ext_proc admission goes to sidecar A and its gRPC access log (the requests' ends) to
sidecar B, the worst split two replicas behind one Service can see. The pool sheds at
`max_in_flight`, so each replica's in-flight count must be the pool's, not its own admitted minus
finished (which only grows on A). Also checks the usage ledger's idempotency marks in Redis: one
set per tenant and 10 s window, kept for a bounded time, never one key per request; that every
record is named by its request (Envoy's x-request-id and the filter's nonce) and closes the
reservation its admission opened; and that when Envoy itself is SIGKILLed mid-stream, so that no
usage ever arrives, each lost request's reservation becomes one `reservation` record once the
(short, here) longest stream lifetime has passed, with both replicas sweeping.
"""

from __future__ import annotations

import copy
import threading
import time

import httpx
import pytest
import redis
import yaml

from helpers import auth, chat_body, envoy_counter, post, wait_for
from sidecar_checks import (END_COMPLETED, END_UNREPORTED, SOURCE_RESERVATION, SOURCE_UPSTREAM, landed_events, metric,
                            usage_events, usage_hash)
from stack import SIDECAR_BIN, Model, Pool, Stack, Tenant, new_api_key

MAX_IN_FLIGHT = 5
REQUESTS = 15
KEY = new_api_key()
LEDGER_KEY = new_api_key()
LEDGER_REQUESTS = 8
KILLED_KEY = new_api_key()
# Streams in flight when Envoy is killed.
KILLED_STREAMS = 3
# The sidecars' longest stream lifetime in this test (the default is 65 minutes).
RECORD_AFTER_S = 8  # long enough that a busy machine still sees the reservations open after the kill
# The ledger keeps a window's applied ids this long past the window's end (store.rs
# IDEMPOTENCY_RETENTION, 10 minutes) and windows are 10 s wide.
RETENTION_S = 600
WINDOW_S = 10


class TwoSidecars(Stack):
    """A stack with a second sidecar (same config, same Redis) that receives Envoy's access log."""

    sidecar_b_port: int | None = None
    sidecar_b_metrics_url: str | None = None

    def _start_sidecar(self, listen_port: int | None = None) -> None:
        super()._start_sidecar(listen_port)
        path = self.workdir / "sidecar-b.yaml"
        path.write_text(yaml.safe_dump(self.sidecar_config(), sort_keys=False))
        proc = self._spawn("sidecar-b", [str(SIDECAR_BIN), "--config", str(path)], stdout_pipe=True)
        before: list[str] = []
        addr = self._read_banner(proc, "gateway-ext-proc listening on", others=before)
        self.sidecar_b_port = int(addr.rsplit(":", 1)[1])
        prefix = "gateway-ext-proc metrics on"
        self.sidecar_b_metrics_url = next("http://" + line[len(prefix):].strip()
                                          for line in before if line.startswith(prefix))

    def envoy_config(self) -> dict:
        bootstrap = super().envoy_config()
        clusters = bootstrap["static_resources"]["clusters"]
        a = next(c for c in clusters if c["name"] == "llm_gateway_ext_proc")
        b = copy.deepcopy(a)
        b["name"] = b["load_assignment"]["cluster_name"] = "llm_gateway_access_log"
        address = b["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
        address["socket_address"]["port_value"] = self.sidecar_b_port
        clusters.append(b)
        hcm = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        logs = [log for log in hcm.get("access_log", []) if log["name"] == "envoy.access_loggers.http_grpc"]
        assert logs, "no gRPC access log to point at sidecar B"
        for log in logs:
            log["typed_config"]["common_config"]["grpc_service"]["envoy_grpc"]["cluster_name"] = b["name"]
        return bootstrap


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    pools = [Pool("pool_two", ["sim/two"], ["--ttft-ms", "30", "--itl-ms", "30", "--output-tokens", "4"],
                  shedding={"max_in_flight": MAX_IN_FLIGHT, "scrape_interval_ms": 100}),
             Pool("pool_ledger", ["sim/ledger"], ["--output-tokens", "2"])]
    models = [Model("two", "pool_two", served_model_name="sim/two"),
              Model("ledger", "pool_ledger", served_model_name="sim/ledger")]
    tenants = [Tenant("two-tenant", [KEY], {"requests_per_minute": 100000}),
               Tenant("ledger-tenant", [LEDGER_KEY], {"requests_per_minute": 100000})]
    with TwoSidecars(tmp_path_factory.mktemp("two"), pools, models, tenants,
                     sidecar_overrides={"metrics_listen": "127.0.0.1:0"}) as s:
        yield s


def scrape(url: str) -> str:
    import urllib.request  # noqa: PLC0415

    with urllib.request.urlopen(url + "/metrics", timeout=2) as r:
        return r.read().decode()


def in_flight(url: str) -> float:
    return metric(scrape(url), "llm_gateway_in_flight_requests", pool="pool_two")


def test_in_flight_holds_when_admission_and_end_reach_different_sidecars(two):
    a, b = two.sidecar_metrics_url, two.sidecar_b_metrics_url
    for i in range(REQUESTS):
        r = post(two, "/v1/chat/completions", chat_body("two", max_tokens=4), key=KEY)
        assert r.status_code == 200, (i, r.status_code, r.text, scrape(a), scrape(b))
    # Both replicas see the pool empty again within a few flushes.
    assert wait_for(lambda: in_flight(a) == 0 and in_flight(b) == 0, timeout=30), (scrape(a), scrape(b))
    text_a, text_b = scrape(a), scrape(b)
    assert metric(text_a, "llm_gateway_requests_total", outcome="admitted") == REQUESTS, text_a
    assert metric(text_a, "llm_gateway_shed_total") == 0, text_a
    # The ends reached B only: what A admitted, B saw finish.
    assert metric(text_b, "llm_gateway_responses_total", tenant="two-tenant") == REQUESTS, text_b
    assert metric(text_a, "llm_gateway_responses_total") == 0, text_a
    # The pool's count in Redis: one hash, both replicas' cumulative counts summing to 0.
    client = redis.Redis(port=two.redis_port, decode_responses=True)
    counts = client.hgetall("llmgw:in-flight:{pool_two}")
    balances = {k: int(v) for k, v in counts.items() if k.startswith("b:")}
    assert sorted(balances.values()) == [-REQUESTS, REQUESTS], counts
    assert sum(balances.values()) + int(counts.get("base", 0)) == 0, counts
    # Each replica counts the two that flush the pool (each leases half of a shed pool's headroom).
    for url in (a, b):
        assert metric(scrape(url), "llm_gateway_pool_sidecar_replicas", pool="pool_two") == 2, scrape(url)
    # And still no shedding on the next request.
    r = post(two, "/v1/chat/completions", chat_body("two", max_tokens=4), key=KEY)
    assert r.status_code == 200, r.text


def test_a_count_that_never_ends_is_corrected_to_vllms_metrics(two):
    """Seven admissions whose ends will never come (a replica that died holding them, or an Envoy
    killed mid-request) sit in the pool's count; the pool is idle, so vLLM's metrics bound the
    count to 0 once the arrival lag has passed, and the replicas take the seven off."""
    a, b = two.sidecar_metrics_url, two.sidecar_b_metrics_url
    client = redis.Redis(port=two.redis_port, decode_responses=True)
    key = "llmgw:in-flight:{pool_two}"
    client.hset(key, mapping={"b:ghost": 7, "a:ghost": 7, "t:ghost": int(time.time() * 1000)})
    assert wait_for(lambda: in_flight(a) == 7 and in_flight(b) == 7, timeout=30), (scrape(a), scrape(b))
    # The bound counts every request sent within the arrival lag, 20 s (the report lag, 5 s, is
    # less), and the tests before this one sent some just now.
    assert wait_for(lambda: in_flight(a) == 0 and in_flight(b) == 0, timeout=60), (scrape(a), scrape(b))
    corrected = sum(metric(scrape(u), "llm_gateway_in_flight_corrections_total", pool="pool_two") for u in (a, b))
    assert corrected == 7, (scrape(a), scrape(b))
    counts = client.hgetall(key)
    assert sum(int(v) for k, v in counts.items() if k.startswith("b:") or k == "base") == 0, counts
    r = post(two, "/v1/chat/completions", chat_body("two", max_tokens=4), key=KEY)
    assert r.status_code == 200, r.text


def test_the_ledger_marks_records_in_bounded_window_sets(two):
    for _ in range(LEDGER_REQUESTS):
        r = post(two, "/v1/chat/completions", chat_body("ledger", max_tokens=2), key=LEDGER_KEY)
        assert r.status_code == 200, r.text
    client = redis.Redis(port=two.redis_port, decode_responses=True)
    assert wait_for(lambda: usage_hash(client, "ledger-tenant").get("ledger:requests") == LEDGER_REQUESTS,
                    timeout=10), usage_hash(client, "ledger-tenant")
    keys = sorted(client.scan_iter("llmgw:usage-seen:{ledger-tenant}:*"))
    # One set per 10 s window the requests finished in (they took a few seconds): never one key
    # per request.
    assert 1 <= len(keys) <= 3, keys
    assert all(client.type(k) == "set" for k in keys), keys
    assert sum(client.scard(k) for k in keys) == LEDGER_REQUESTS
    now = time.time()
    for k in keys:
        window = int(k.rsplit(":", 1)[1])
        assert window % WINDOW_S == 0, k
        # Expires the retention past its window's end (or past the write, if later), never later.
        expire_at = client.expiretime(k)
        assert window + WINDOW_S + RETENTION_S <= expire_at <= now + WINDOW_S + RETENTION_S + 5, (k, expire_at)


def test_records_are_named_by_their_request_and_close_their_reservation(two):
    client = redis.Redis(port=two.redis_port, decode_responses=True)
    raw = redis.Redis(port=two.redis_port)  # the events are protobuf bytes
    before = len(usage_events(raw, "ledger-tenant"))
    r = post(two, "/v1/chat/completions", chat_body("ledger", max_tokens=2), key=LEDGER_KEY)
    assert r.status_code == 200, r.text
    assert wait_for(lambda: len(usage_events(raw, "ledger-tenant")) == before + 1, timeout=10)
    event = usage_events(raw, "ledger-tenant")[-1]
    # `<x-request-id>.<nonce>`: Envoy's UUID as the filter saw it, and the filter's 64-bit nonce.
    request_id, nonce = event["record_id"].rsplit(".", 1)
    assert request_id == event["request_id"] and len(request_id) == 36, event
    assert len(nonce) == 16 and all(c in "0123456789abcdef" for c in nonce), event
    assert (event["end_reason"], event["usage_source"]) == (END_COMPLETED, SOURCE_UPSTREAM), event
    # The admission (sidecar A) opened the reservation, the record (through sidecar B) closed it.
    assert wait_for(lambda: client.hlen("llmgw:reservations:{ledger-tenant}") == 0), \
        client.hgetall("llmgw:reservations:{ledger-tenant}")
    assert client.zcard("llmgw:reservations-due:{ledger-tenant}") == 0


@pytest.fixture
def killed(tmp_path):
    # 60 tokens 100 ms apart: streams of about 6 s, still running when Envoy dies.
    pools = [Pool("pool_killed", ["sim/killed"], ["--ttft-ms", "50", "--itl-ms", "100", "--output-tokens", "60"])]
    models = [Model("killed", "pool_killed", served_model_name="sim/killed")]
    tenants = [Tenant("killed-tenant", [KILLED_KEY], {"requests_per_minute": 100000, "tokens_per_minute": 10000000})]
    overrides = {"metrics_listen": "127.0.0.1:0",
                 "metering": {"reservations": {"record_after_ms": RECORD_AFTER_S * 1000, "sweep_interval_ms": 200}}}
    with TwoSidecars(tmp_path, pools, models, tenants, sidecar_overrides=overrides) as s:
        yield s


def stream(stack, out: dict) -> None:
    body = chat_body("killed", "stream me", stream=True, max_tokens=60)
    try:
        with httpx.stream("POST", stack.base_url + "/v1/chat/completions", json=body, headers=auth(KILLED_KEY),
                          timeout=30) as r:
            out["status"] = r.status_code
            for _ in r.iter_lines():
                pass
    except httpx.HTTPError as e:
        out["error"] = type(e).__name__


def test_envoy_killed_mid_stream_leaves_one_reservation_record_per_lost_request(killed):
    client = redis.Redis(port=killed.redis_port, decode_responses=True)
    raw = redis.Redis(port=killed.redis_port)  # the events are protobuf bytes
    charged = lambda: sum(metric(scrape(u), "llm_gateway_usage_records_from_reservation_total")  # noqa: E731
                          for u in (killed.sidecar_metrics_url, killed.sidecar_b_metrics_url))
    # One request that ends: recorded from its usage, its reservation closed.
    r = post(killed, "/v1/chat/completions", chat_body("killed", max_tokens=3), key=KILLED_KEY)
    assert r.status_code == 200, r.text
    assert wait_for(lambda: usage_hash(client, "killed-tenant").get("killed:requests") == 1, timeout=10)
    assert wait_for(lambda: client.hlen("llmgw:reservations:{killed-tenant}") == 0)

    outs = [{} for _ in range(KILLED_STREAMS)]
    threads = [threading.Thread(target=stream, args=(killed, out)) for out in outs]
    # No admission is earlier than this (the charge's lower bound); admitted_at, taken once all
    # are upstream, is later than every admission (the upper bound).
    sent_at = time.monotonic()
    for t in threads:
        t.start()
    assert wait_for(lambda: envoy_counter(killed, "cluster.pool_killed.upstream_rq_active") == KILLED_STREAMS,
                    timeout=10)
    admitted_at = time.monotonic()
    assert client.hlen("llmgw:reservations:{killed-tenant}") == KILLED_STREAMS
    # Envoy dies mid-stream: no access-log entry of these requests will ever be sent.
    killed.envoy.popen.kill()
    killed.envoy.popen.wait(timeout=5)
    for t in threads:
        t.join(timeout=30)
    assert all("error" in out for out in outs), outs

    # Nothing is charged before the longest stream lifetime has passed.
    assert time.monotonic() - admitted_at < RECORD_AFTER_S - 2, "too slow to see the reservations still open"
    assert charged() == 0
    assert client.hlen("llmgw:reservations:{killed-tenant}") == KILLED_STREAMS
    # Then each lost request is charged once, whichever replica's sweep took it.
    assert wait_for(lambda: charged() >= KILLED_STREAMS, timeout=RECORD_AFTER_S + 10), \
        (charged(), client.hgetall("llmgw:reservations:{killed-tenant}"))
    assert time.monotonic() - sent_at >= RECORD_AFTER_S
    time.sleep(1)  # a few more sweeps of both replicas (every 200 ms): nothing more is charged
    assert charged() == KILLED_STREAMS
    assert client.hlen("llmgw:reservations:{killed-tenant}") == 0
    assert client.zcard("llmgw:reservations-due:{killed-tenant}") == 0
    h = usage_hash(client, "killed-tenant")
    assert h.get("killed:requests") == 1 + KILLED_STREAMS, h
    events = landed_events(raw, "killed-tenant", 1 + KILLED_STREAMS)
    lost = [e for e in events if e["end_reason"] == END_UNREPORTED]
    assert len(events) == 1 + KILLED_STREAMS and len(lost) == KILLED_STREAMS, events
    assert len({e["record_id"] for e in lost}) == KILLED_STREAMS, lost
    for e in lost:
        # The reservation: the prompt's estimate plus the completion cap, nothing settled back.
        assert e["usage_source"] == SOURCE_RESERVATION and e["status"] == 0, e
        assert e["completion_tokens"] == 60 and e["prompt_tokens"] + 60 == e["reserved_tokens"], e
    assert h["killed:completion_tokens"] == 3 + KILLED_STREAMS * 60, h
