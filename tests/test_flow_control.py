"""Flow control (issue 13), end to end: real Envoy, the sidecar, redis-server and vllm-sim.

The pool is one simulator; the sidecar lets one request of this gateway into it at a time
(`max_in_flight: 1`) and queues the others (`flow_control`), tiers premium > standard > batch >
brief, brief with a 1 s budget. A streamed request held open keeps the pool full while a test
queues requests behind it; closing it lets the queue drain one request at a time, so the order
in which the queued requests finish is the order the queue dispatched them in.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time

import httpx
import pytest
import redis

from helpers import assert_openai_error, auth, chat_body, post, wait_for
from sidecar_checks import bucket, bucket_key, metric, open_stream, sidecar_metrics, usage_events
from stack import Model, Pool, Stack, Tenant, new_api_key, upstream_metric

TENANTS = {
    "fc-holder": "premium", "fc-premium": "premium", "fc-standard": "standard", "fc-batch": "batch",
    "fc-brief": "brief", "fc-heavy": "standard", "fc-light": "standard", "fc-tpm": "standard",
}
KEYS = {t: new_api_key() for t in TENANTS}
TPM = 1_000_000
FLOW = {"tiers": [{"name": "premium", "max_queue_wait_ms": 30000},
                  {"name": "standard", "max_queue_wait_ms": 30000},
                  {"name": "batch", "max_queue_wait_ms": 30000},
                  {"name": "brief", "max_queue_wait_ms": 1000}]}


def flow_stack(workdir, max_in_flight: int = 1, **sidecar):
    pools = [Pool("pool_fc", ["sim/fc"],
                  ["--max-num-seqs", "4", "--ttft-ms", "20", "--itl-ms", "20", "--output-tokens", "3"],
                  shedding={"max_in_flight": max_in_flight, "scrape_interval_ms": 100,
                            "flow_control": {"max_queued": 32}})]
    models = [Model("fc", "pool_fc", served_model_name="sim/fc")]
    tenants = [Tenant(t, [KEYS[t]], {"requests_per_minute": 100000,
                                     **({"tokens_per_minute": TPM} if t == "fc-tpm" else {})}, tier=tier)
               for t, tier in TENANTS.items()]
    overrides = {"metrics_listen": "127.0.0.1:0", "flow_control": FLOW, **sidecar}
    return Stack(workdir, pools, models, tenants, sidecar_overrides=overrides)


@pytest.fixture(scope="module")
def fc(tmp_path_factory):
    with flow_stack(tmp_path_factory.mktemp("flow")) as s:
        yield s


def queued(stack, tier: str | None = None) -> float:
    labels = {"pool": "pool_fc", **({"tier": tier} if tier else {})}
    return metric(sidecar_metrics(stack), "llm_gateway_queue_requests", **labels)


def in_flight(stack) -> float:
    return metric(sidecar_metrics(stack), "llm_gateway_in_flight_requests", pool="pool_fc")


def received(stack) -> float:
    return upstream_metric(stack.pool("pool_fc").urls[0], "vllm_sim:requests_received_total")


@contextlib.contextmanager
def holding(stack, tenant: str = "fc-holder", idle: bool = True):
    """Keeps one of the pool's slots with a long stream until the block ends (the stream closed)."""
    # The previous test's requests have all ended (their access-log entries reached the sidecar).
    if idle:
        assert wait_for(lambda: in_flight(stack) == 0 and queued(stack) == 0, timeout=10), sidecar_metrics(stack)
    client, response = open_stream(stack.base_url, chat_body("fc", "hold", stream=True, max_tokens=2000,
                                                             ignore_eos=True), auth(KEYS[tenant]))
    try:
        assert response.status_code == 200, response.read()
        assert "x-gateway-queue-wait-ms" not in response.headers, "it did not wait"
        yield
    finally:
        response.close()
        client.close()


class Sent:
    """A request sent from a thread; `done` records when its answer arrived."""

    def __init__(self, stack, tenant: str, timeout: float = 60):
        self.tenant, self.response, self.error, self.done = tenant, None, None, None
        self.thread = threading.Thread(target=self._run, args=(stack, timeout), daemon=True)
        self.thread.start()

    def _run(self, stack, timeout: float) -> None:
        try:
            self.response = post(stack, "/v1/chat/completions", chat_body("fc", max_tokens=3),
                                 key=KEYS[self.tenant], timeout=timeout)
        except httpx.HTTPError as e:
            self.error = e
        self.done = time.monotonic()

    def result(self, timeout: float = 60) -> httpx.Response:
        self.thread.join(timeout)
        assert self.response is not None, f"{self.tenant}: {self.error!r}"
        return self.response


def test_queued_requests_go_by_tier_and_say_how_long_they_waited(fc):
    with holding(fc):
        sent = []
        for n, tenant in enumerate(["fc-batch", "fc-standard", "fc-premium"], start=1):
            sent.append(Sent(fc, tenant))
            assert wait_for(lambda: queued(fc) == n, timeout=10), sidecar_metrics(fc)
        time.sleep(0.2)  # the queued requests' wait, reported below, spans at least this
        assert all(s.done is None for s in sent), "answered while the pool was full"
    for s in sent:
        r = s.result()
        assert r.status_code == 200, r.text
        assert int(r.headers["x-gateway-queue-wait-ms"]) >= 200, dict(r.headers)
    order = [s.tenant for s in sorted(sent, key=lambda s: s.done)]
    assert order == ["fc-premium", "fc-standard", "fc-batch"], order
    text = sidecar_metrics(fc)
    assert metric(text, "llm_gateway_queue_dequeues_total", pool="pool_fc", reason="dispatched") >= 3, text
    assert metric(text, "llm_gateway_queue_wait_seconds_count", tier="batch", tenant="fc-batch") >= 1, text
    assert queued(fc) == 0


def test_a_light_tenant_waits_behind_its_share_not_behind_a_heavy_backlog(fc):
    with holding(fc):
        sent = []
        for n in range(1, 7):
            sent.append(Sent(fc, "fc-heavy"))
            assert wait_for(lambda: queued(fc, "standard") == n, timeout=10), sidecar_metrics(fc)
        for n in range(7, 9):
            sent.append(Sent(fc, "fc-light"))
            assert wait_for(lambda: queued(fc, "standard") == n, timeout=10), sidecar_metrics(fc)
    for s in sent:
        assert s.result().status_code == 200
    order = [s.tenant for s in sorted(sent, key=lambda s: s.done)]
    # First come, first served would put the light tenant's two last; fair sharing lets each
    # of them go after at most one more of the heavy tenant's.
    light = [i for i, t in enumerate(order) if t == "fc-light"]
    assert max(light) <= 3, order


def test_a_request_whose_budget_runs_out_gets_429_with_retry_after(fc):
    with holding(fc):
        before = received(fc)
        started = time.monotonic()
        r = post(fc, "/v1/chat/completions", chat_body("fc", max_tokens=3), key=KEYS["fc-brief"], timeout=30)
        waited = time.monotonic() - started
        error = assert_openai_error(r, 429, code="overloaded")
        assert error["type"] == "server_overloaded"
        assert 1 <= int(r.headers["retry-after"]) <= 30
        assert 0.9 <= waited < 10, waited
        assert received(fc) == before, "a refused request reached the upstream"
    text = sidecar_metrics(fc)
    assert metric(text, "llm_gateway_queue_dequeues_total", tier="brief", reason="timeout") == 1, text
    assert metric(text, "llm_gateway_requests_total", tenant="fc-brief", outcome="overloaded") == 1


def test_a_client_that_leaves_the_queue_frees_its_place_and_its_reservation(fc):
    client = redis.Redis(port=fc.redis_port)
    tpm = bucket_key("fc-tpm", "tpm")
    with holding(fc):
        before = received(fc)
        leaving = Sent(fc, "fc-tpm", timeout=1.5)
        assert wait_for(lambda: queued(fc) == 1, timeout=10), sidecar_metrics(fc)
        held = bucket(client, tpm)
        assert held is not None and held[0] < TPM, "the reservation is taken while queued"
        leaving.thread.join(10)
        assert isinstance(leaving.error, httpx.TimeoutException), leaving.error
        assert wait_for(lambda: queued(fc) == 0, timeout=10), sidecar_metrics(fc)
        assert wait_for(lambda: bucket(client, tpm)[0] == TPM, timeout=10), bucket(client, tpm)
        text = sidecar_metrics(fc)
        assert metric(text, "llm_gateway_queue_dequeues_total", pool="pool_fc", reason="cancelled") >= 1, text
    # Its place is not dispatched when the pool frees up, and nothing is recorded for it.
    assert wait_for(lambda: in_flight(fc) == 0, timeout=10), sidecar_metrics(fc)
    assert received(fc) == before
    assert usage_events(client, "fc-tpm") == []
    r = post(fc, "/v1/chat/completions", chat_body("fc", max_tokens=3), key=KEYS["fc-tpm"])
    assert r.status_code == 200 and "x-gateway-queue-wait-ms" not in r.headers, r.headers


def test_sigterm_answers_every_queued_request(tmp_path):
    with flow_stack(tmp_path, shutdown_grace_ms=30000) as stack:
        with holding(stack):
            sent = [Sent(stack, "fc-standard") for _ in range(3)]
            assert wait_for(lambda: queued(stack) == 3, timeout=10), sidecar_metrics(stack)
            sidecar = next(p for p in stack.procs if p.name == "sidecar")
            started = time.monotonic()
            sidecar.popen.send_signal(signal.SIGTERM)
            for s in sent:
                r = s.result(timeout=20)
                assert_openai_error(r, 429, code="overloaded")
                assert r.headers["retry-after"] == "1"
            # Answered at once, long before the grace period (30 s) would end the streams.
            assert max(s.done for s in sent) - started < 10
            assert sidecar.alive(), "still serving the held stream"


def test_the_newcomer_reserve_lets_a_light_tenant_in_past_a_backlogged_one(tmp_path):
    # Two slots, half of them kept back from the queue: queued requests of a backlogged tenant
    # go only while nothing else is in flight.
    flow = {**FLOW, "newcomer_reserve": 0.5}
    with flow_stack(tmp_path, max_in_flight=2, flow_control=flow) as stack:
        with holding(stack):
            with holding(stack, "fc-heavy", idle=False):
                assert wait_for(lambda: in_flight(stack) == 2, timeout=10), sidecar_metrics(stack)
                heavy = []
                for n in (1, 2):
                    heavy.append(Sent(stack, "fc-heavy"))
                    assert wait_for(lambda: queued(stack) == n, timeout=10), sidecar_metrics(stack)
            # Heavy's long stream closed: its first queued request (heavy had none queued when it
            # came) goes; the second is held below the reserve while the holder runs.
            first = heavy[0].result()
            assert first.status_code == 200 and "x-gateway-queue-wait-ms" in first.headers, first.headers
            assert wait_for(lambda: in_flight(stack) == 1, timeout=10), sidecar_metrics(stack)
            assert queued(stack) == 1 and heavy[1].done is None, sidecar_metrics(stack)
            # Light, with nothing queued, takes the reserve at once.
            light = post(stack, "/v1/chat/completions", chat_body("fc", max_tokens=3), key=KEYS["fc-light"])
            assert light.status_code == 200, light.text
            assert "x-gateway-queue-wait-ms" not in light.headers, "it did not wait"
            assert queued(stack) == 1 and heavy[1].done is None, "heavy's is still held"
            text = sidecar_metrics(stack)
            assert metric(text, "llm_gateway_queue_dequeues_total", pool="pool_fc", reason="reserve") == 1, text
        # The holder closed: heavy's second goes.
        second = heavy[1].result()
        assert second.status_code == 200 and int(second.headers["x-gateway-queue-wait-ms"]) > 0, second.headers


def test_bursty_completions_never_starve_a_backlogged_tenant(tmp_path):
    """An engine whose batch ends together (vllm-sim's batched engine, equal requests): a heavy
    tenant kept 12 requests deep beside a light one on 4 slots with a newcomer reserve, a 20 s
    budget, for 30 s. The heavy tenant's backlog drains within its fair share of the budget, so no
    request of either is refused on a predicted wait. Before the fair-share rule and the 8-end
    windows, 413 of heavy's 416 requests were refused: short windows between two bursts measured
    its rate near zero, and each refusal lowered it further."""
    pools = [Pool("pool_burst", ["sim/burst"],
                  ["--engine", "batched", "--max-num-seqs", "4", "--slowdown", "100", "--output-tokens", "8"],
                  shedding={"max_in_flight": 4, "scrape_interval_ms": 100, "flow_control": {"max_queued": 64}})]
    models = [Model("burst", "pool_burst", served_model_name="sim/burst")]
    keys = {"heavy": new_api_key(), "light": new_api_key()}
    tenants = [Tenant(t, [k], {"requests_per_minute": 100000}) for t, k in keys.items()]
    flow = {"tiers": [{"name": "standard", "max_queue_wait_ms": 20000}], "newcomer_reserve": 0.25}
    overrides = {"metrics_listen": "127.0.0.1:0", "flow_control": flow}
    statuses: dict[str, list[int]] = {"heavy": [], "light": []}
    stop = time.monotonic() + 30

    def loop(tenant: str) -> None:
        while time.monotonic() < stop:
            r = post(stack, "/v1/chat/completions", chat_body("burst", "same prompt", max_tokens=8),
                     key=keys[tenant], timeout=60)
            statuses[tenant].append(r.status_code)
            if r.status_code == 429:
                time.sleep(0.05)

    with Stack(tmp_path, pools, models, tenants, sidecar_overrides=overrides) as stack:
        threads = [threading.Thread(target=loop, args=("heavy",), daemon=True) for _ in range(12)]
        threads += [threading.Thread(target=loop, args=("light",), daemon=True) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        text = sidecar_metrics(stack)
        refused = metric(text, "llm_gateway_queue_dequeues_total", pool="pool_burst", reason="predicted_wait")
        assert refused == 0, (refused, {t: s.count(429) for t, s in statuses.items()}, text)
        # Both served; the light tenant never refused. (A heavy request may still outwait the 20 s
        # budget in its queue: a timeout, not a prediction.)
        assert statuses["heavy"].count(200) >= 20, statuses
        assert statuses["light"] and set(statuses["light"]) == {200}, statuses
