"""Two sidecar replicas on one Redis, as Kubernetes runs them (real Envoy, redis-server, vllm-sim).

Envoy's ext_proc admission goes to sidecar A and its gRPC access log (the requests' ends) to
sidecar B, the worst split two replicas behind one Service can see. The pool sheds at
`max_in_flight`, so each replica's in-flight count must be the pool's, not its own admitted minus
finished (which only grows on A). Also checks the usage ledger's idempotency marks in Redis: one
set per tenant and 10 s window, kept for a bounded time, never one key per request.
"""

from __future__ import annotations

import copy
import time

import pytest
import redis
import yaml

from helpers import chat_body, post, wait_for
from sidecar_checks import metric, usage_hash
from stack import SIDECAR_BIN, Model, Pool, Stack, Tenant, new_api_key

MAX_IN_FLIGHT = 5
REQUESTS = 15
KEY = new_api_key()
LEDGER_KEY = new_api_key()
LEDGER_REQUESTS = 8
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
    # And still no shedding on the next request.
    r = post(two, "/v1/chat/completions", chat_body("two", max_tokens=4), key=KEY)
    assert r.status_code == 200, r.text


def test_a_count_that_never_ends_is_corrected_to_vllms_metrics(two):
    """Seven admissions whose ends will never come (a replica that died holding them, or an Envoy
    killed mid-request) sit in the pool's count; the pool is idle, so vLLM's metrics bound the
    count to 0 once the report lag has passed, and the replicas take the seven off."""
    a, b = two.sidecar_metrics_url, two.sidecar_b_metrics_url
    client = redis.Redis(port=two.redis_port, decode_responses=True)
    key = "llmgw:in-flight:{pool_two}"
    client.hset(key, mapping={"b:ghost": 7, "a:ghost": 7, "t:ghost": int(time.time() * 1000)})
    assert wait_for(lambda: in_flight(a) == 7 and in_flight(b) == 7, timeout=30), (scrape(a), scrape(b))
    # The report lag is 5 s (four 100 ms scrape intervals are less).
    assert wait_for(lambda: in_flight(a) == 0 and in_flight(b) == 0, timeout=30), (scrape(a), scrape(b))
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
