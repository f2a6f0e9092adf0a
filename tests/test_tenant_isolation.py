"""No tenant can take the shared queue, Envoy's memory or a worker from the others (real Envoy,
wasm filter, sidecar, redis-server, vllm-sim).

- One tenant filling a flow-controlled pool's queue (its 8 places, while the pool is held full)
  leaves another tenant of the same tier its share: the other's requests take the hog's newest
  places (the hog's answered 429 `overloaded`), wait, and are served.
- One key's 80 bodies of 1 MB (four waves of 20) sent to a flow-controlled pool (Envoy's heap limit 96 MiB:
  unbounded, their queued bodies pass the overload manager's 0.98, and Envoy answers every
  tenant 503) are bounded by the pool's `max_queued_bytes` (4 MiB): the rest are refused 429,
  and a tenant on another pool is answered 200 throughout.
- A tenant the sidecar found over its requests-per-minute limit is refused at its request
  headers (429, `Retry-After`), before any body is sent: its bodies cost the worker nothing.
"""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

from helpers import auth, chat_body, connect, post, wait_for
from sidecar_checks import metric, open_stream, sidecar_metrics
from stack import Model, Pool, Stack, Tenant, new_api_key

TENANTS = ["iso-holder", "iso-hog", "iso-victim", "iso-other", "iso-rpm"]
KEYS = {t: new_api_key() for t in TENANTS}
FLOW = {"tiers": [{"name": "standard", "max_queue_wait_ms": 60000}]}
BIG_BODY = 1_000_000
HEAP = 96 << 20


@pytest.fixture(scope="module")
def iso(tmp_path_factory):
    sim = ["--max-num-seqs", "4", "--ttft-ms", "20", "--itl-ms", "20", "--output-tokens", "3"]
    pools = [
        # The queue of 8 places.
        Pool("pool_fc", ["sim/fc"], sim, shedding={"max_in_flight": 1, "scrape_interval_ms": 100,
                                                   "flow_control": {"max_queued": 8}}),
        # The default 1000 places, and 4 MiB of queued bodies.
        Pool("pool_big", ["sim/big"], sim, shedding={"max_in_flight": 1, "scrape_interval_ms": 100,
                                                     "flow_control": {"max_queued_bytes": 4 << 20}}),
        Pool("pool_other", ["sim/other"], sim),
    ]
    models = [Model("fc", "pool_fc", served_model_name="sim/fc"), Model("big", "pool_big", served_model_name="sim/big"),
              Model("other", "pool_other", served_model_name="sim/other")]
    limits = {t: {"requests_per_minute": 100000} for t in TENANTS}
    limits["iso-rpm"] = {"requests_per_minute": 3}
    tenants = [Tenant(t, [KEYS[t]], limits[t]) for t in TENANTS]
    overrides = {"metrics_listen": "127.0.0.1:0", "flow_control": FLOW,
                 "redis": {"lease_fraction": 0.01, "lease_ttl_ms": 2000}}
    with Stack(tmp_path_factory.mktemp("isolation"), pools, models, tenants, sidecar_overrides=overrides,
               admission_leases=True, edge={"MAX_HEAP_BYTES": HEAP}) as s:
        yield s


def queued(stack, pool: str) -> float:
    return metric(sidecar_metrics(stack), "llm_gateway_queue_requests", pool=pool)


def in_flight(stack, pool: str) -> float:
    return metric(sidecar_metrics(stack), "llm_gateway_in_flight_requests", pool=pool)


class Held:
    """A long stream that keeps a pool's one slot until closed."""

    def __init__(self, stack, model: str):
        assert wait_for(lambda: in_flight(stack, f"pool_{model}") == 0 and queued(stack, f"pool_{model}") == 0,
                        timeout=15), sidecar_metrics(stack)
        self.client, self.response = open_stream(
            stack.base_url, chat_body(model, "hold", stream=True, max_tokens=2000, ignore_eos=True),
            auth(KEYS["iso-holder"]), timeout=60)
        assert self.response.status_code == 200, self.response.read()

    def close(self) -> None:
        self.response.close()
        self.client.close()


def send_all(stack, tenant: str, bodies: list, timeout: float = 90) -> tuple[list, list[threading.Thread]]:
    """Sends each body from a thread of its own; the responses (or errors) land in the list."""
    results: list = [None] * len(bodies)

    def one(i: int, body) -> None:
        try:
            content = body if isinstance(body, bytes) else None
            results[i] = httpx.post(stack.base_url + "/v1/chat/completions", content=content,
                                    json=None if content else body,
                                    headers={**auth(KEYS[tenant]), "content-type": "application/json"},
                                    timeout=timeout)
        except httpx.HTTPError as e:
            results[i] = e

    threads = [threading.Thread(target=one, args=(i, b), daemon=True) for i, b in enumerate(bodies)]
    for t in threads:
        t.start()
    return results, threads


def code(r) -> str | None:
    try:
        return r.json()["error"]["code"]
    except Exception:  # noqa: BLE001 (an error body of any shape, or a transport error)
        return None


def test_one_tenant_filling_the_queue_leaves_another_its_share(iso):
    held = Held(iso, "fc")
    try:
        hog, hog_threads = send_all(iso, "iso-hog", [chat_body("fc", max_tokens=3)] * 12)
        # 8 queued, the 4 others refused at once: the queue is full.
        assert wait_for(lambda: queued(iso, "pool_fc") == 8 and sum(r is not None for r in hog) >= 4,
                        timeout=20), (queued(iso, "pool_fc"), hog)
        full = [r for r in hog if r is not None]
        assert all(r.status_code == 429 and code(r) == "overloaded" for r in full), [(r.status_code, r.text) for r in full]
        victim, victim_threads = send_all(iso, "iso-victim", [chat_body("fc", max_tokens=3)] * 2)
        # Each of the victim's takes the place of one of the hog's (answered 429 at once).
        assert wait_for(lambda: sum(r is not None for r in hog) >= 6, timeout=20), hog
        assert queued(iso, "pool_fc") == 8
        assert all(r is None for r in victim), "the victim's requests wait their turn"
    finally:
        held.close()
    for t in victim_threads + hog_threads:
        t.join(90)
    assert [r.status_code for r in victim] == [200, 200], [getattr(r, "text", r) for r in victim]
    statuses = sorted(r.status_code for r in hog)
    assert statuses == [200] * 6 + [429] * 6, statuses
    text = sidecar_metrics(iso)
    assert metric(text, "llm_gateway_queue_dequeues_total", pool="pool_fc", reason="evicted") == 2


def big_body(model: str) -> bytes:
    """A tiny chat request carrying 1 MB of a member the filter does not read."""
    pad = "x" * (BIG_BODY - 200)
    return (f'{{"model":"{model}","messages":[{{"role":"user","content":"hi"}}],"max_tokens":1,'
            f'"junk":"{pad}"}}').encode()


def test_one_keys_big_bodies_cannot_take_envoys_memory(iso):
    held = Held(iso, "big")
    victims: list[int] = []
    stop = threading.Event()

    def victim() -> None:
        while not stop.is_set():
            r = post(iso, "/v1/chat/completions", chat_body("other", max_tokens=2), KEYS["iso-other"], timeout=30)
            victims.append(r.status_code)
            time.sleep(0.05)

    watcher = threading.Thread(target=victim, daemon=True)
    watcher.start()
    try:
        # Four waves of 20 bodies, each sent once the one before is answered but for the queued:
        # the bodies a wave leaves queued stay, so unbounded they add up past the heap limit, and
        # no wave asks 2 cores to parse more than 20 MB at once (80 at once can keep Envoy's
        # workers past the ext_proc and lease timeouts of 0.5 s: 504s that are not the point here).
        waves: list[list] = []
        threads: list[threading.Thread] = []

        def answered() -> list:
            return [r for answers in waves for r in answers if r is not None]

        for wave in range(4):
            answers, sent = send_all(iso, "iso-hog", [big_body("big")] * 20)
            waves.append(answers)
            threads += sent
            # The bodies that found no room in 4 MiB are refused; four are queued.
            assert wait_for(lambda: len(answered()) >= 20 * (wave + 1) - 4, timeout=120), \
                [getattr(r, "status_code", r) for r in answered()]
        hog = [r for answers in waves for r in answers]
        refused = [r for r in hog if r is not None]
        assert all(isinstance(r, httpx.Response) and r.status_code == 429 for r in refused), \
            [(getattr(r, "status_code", repr(r)), getattr(r, "text", "")[:200], dict(getattr(r, "headers", {}))) for r in refused if getattr(r, "status_code", 0) != 429][:3]
        assert queued(iso, "pool_big") <= 4
        text = sidecar_metrics(iso)
        assert metric(text, "llm_gateway_queue_dequeues_total", pool="pool_big", reason="bytes") > 0, text
    finally:
        held.close()
        stop.set()
        watcher.join(30)
    for t in threads:
        t.join(60)
    assert victims and set(victims) == {200}, victims


def headers_answered(stack, key: str) -> bytes:
    """Sends a chat request's headers announcing a 4 MB body, and none of it: what Envoy answers
    within 2 s (b"" when it waits for the body)."""
    conn = connect(stack)
    try:
        conn.sendall((f"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer {key}\r\n"
                      "content-type: application/json\r\ncontent-length: 4000000\r\n\r\n").encode())
        conn.settimeout(2)
        try:
            return conn.recv(4096)
        except socket.timeout:
            return b""
    finally:
        conn.close()


def test_a_tenant_over_its_requests_limit_costs_no_body(iso):
    key = KEYS["iso-rpm"]
    statuses = [post(iso, "/v1/chat/completions", chat_body("other", max_tokens=2), key).status_code
                for _ in range(4)]
    assert statuses[:3] == [200] * 3 and statuses[3] == 429, statuses
    # The next lease call tells the filter the tenant's RPM bucket is empty: its requests are then
    # answered at their headers, the body never awaited.
    answer = wait_for(lambda: headers_answered(iso, key), timeout=15)
    assert answer.startswith(b"HTTP/1.1 429"), answer
    head = answer.decode(errors="replace").lower()
    assert "retry-after:" in head and "rate_limit_exceeded" in head, head
    # Another tenant is not affected: its headers wait for its body.
    assert headers_answered(iso, KEYS["iso-other"]) == b""
