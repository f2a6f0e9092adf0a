"""Endpoint picking through the real Envoy (issue 12): the pool's cluster routes to the endpoint
named in dynamic metadata `envoy.lb` / `x-gateway-destination-endpoint` (envoy/pool_picker_lb.yaml,
envoy/picker_route.yaml), falling back to LEAST_REQUEST.

Part 1, Envoy alone (the `bare` profile, no filter, no sidecar): a header_to_metadata filter in
front of the router copies the test's own `x-test-pick` request header into that metadata, so the
test decides the pick as the sidecar would, and asserts which replica served from each vllm-sim's
request counter.

Part 2, the whole gateway (filter, sidecar with the picker, Envoy): the sidecar's pick is the
replica that served, a client's x-gateway-destination-endpoint changes nothing, a stopped replica
is never picked, and with the sidecar away admission fails closed.
"""

from __future__ import annotations

import http.server
import json
import threading

import httpx
import pytest

from helpers import chat_body, envoy_counter, wait_for
from stack import Model, Pool, Stack, Tenant, free_port, upstream_metric

PICK_HEADER = "x-test-pick"


class _MetadataFromHeader(Stack):
    """The bare stack, with the test's pick copied from `x-test-pick` into `envoy.lb` metadata
    (as the sidecar's ext_proc response writes it) and the served endpoint returned in
    `x-test-served` (from the policy's `selected_host_key`) and `x-test-upstream` (Envoy's
    %UPSTREAM_HOST%)."""

    def envoy_config(self) -> dict:
        bootstrap = super().envoy_config()
        hcm = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        hcm["http_filters"].insert(0, {
            "name": "envoy.filters.http.header_to_metadata",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config",
                "request_rules": [{
                    "header": PICK_HEADER,
                    "on_header_present": {"metadata_namespace": "envoy.lb",
                                          "key": "x-gateway-destination-endpoint", "type": "STRING"},
                    "remove": True,
                }],
            },
        })
        vhost = hcm["route_config"]["virtual_hosts"][0]
        vhost["response_headers_to_add"] = [
            {"header": {"key": "x-test-served",
                        "value": "%DYNAMIC_METADATA(envoy.lb:x-gateway-destination-endpoint-served)%"}},
            {"header": {"key": "x-test-upstream", "value": "%UPSTREAM_HOST%"}},
        ]
        return bootstrap


class _Upstream(http.server.BaseHTTPRequestHandler):
    """An upstream that listens (so it is no connect failure), answers /health with
    `health_status` and every POST with `post_status` and a body naming it; counts the POSTs."""

    health_status = 200
    post_status = 200
    name = ""
    served = 0

    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(self.health_status if self.path == "/health" else 404)
        self.send_header("content-length", "0")
        self.end_headers()

    def do_POST(self):  # noqa: N802
        type(self).served += 1
        self.rfile.read(int(self.headers.get("content-length", "0")))
        body = json.dumps({"upstream": self.name}).encode()
        self.send_response(self.post_status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


class _Unhealthy(_Upstream):
    """Fails Envoy's health check (/health 503), answers inference requests 200."""

    health_status = 503
    name = "unhealthy"


class _Failing(_Upstream):
    """Passes the health check, answers every inference request 500: outlier detection
    (consecutive_5xx: 5) ejects it."""

    post_status = 500
    name = "failing"


@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    """One picking pool of three vllm-sim replicas."""
    pools = [Pool("pool_pick", ["sim/pick"], ["--output-tokens", "1"], replicas=3, picker={})]
    models = [Model("pick", "pool_pick", served_model_name="sim/pick")]
    with _MetadataFromHeader(tmp_path_factory.mktemp("pick-bare"), pools, models, [Tenant("t", ["k"])],
                             profile="bare") as s:
        yield s


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """One picking pool of six endpoints: four vllm-sims, an address nothing listens on (connect
    failures), and an upstream that listens but fails its health check. 4 of 6 healthy: above
    Envoy's 50 % panic threshold, so LEAST_REQUEST keeps to the healthy ones."""
    yield from _with_extra_endpoints(tmp_path_factory.mktemp("pick-mixed"), 4, [None, _Unhealthy])


@pytest.fixture(scope="module")
def ejecting(tmp_path_factory):
    """One picking pool of three vllm-sims and an upstream that answers 500 (ejected by outlier
    detection after 5)."""
    yield from _with_extra_endpoints(tmp_path_factory.mktemp("pick-ejecting"), 3, [_Failing])


def _with_extra_endpoints(workdir, sims: int, extra: list):
    """A bare picking stack whose pool has `sims` vllm-sims, then one endpoint per `extra`: None
    for an address nothing listens on, or an _Upstream handler class served on loopback."""
    servers = [http.server.ThreadingHTTPServer(("127.0.0.1", 0), h) for h in extra if h is not None]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    ports = iter(server.server_address[1] for server in servers)
    pool = Pool("pool_pick", ["sim/pick"], ["--output-tokens", "1"], replicas=sims, picker={})
    s = _MetadataFromHeader(workdir, [pool], [Model("pick", "pool_pick", served_model_name="sim/pick")],
                            [Tenant("t", ["k"])], profile="bare")
    try:
        pool.urls += [s._start_upstream(pool, i) for i in range(pool.replicas)]
        pool.urls += [f"http://127.0.0.1:{free_port() if h is None else next(ports)}" for h in extra]
        s._start_envoy()
        yield s
    finally:
        s.close()
        for server in servers:
            server.shutdown()


def addr(url: str) -> str:
    return url.removeprefix("http://")


def counts(stack) -> list[float]:
    """Requests each vllm-sim replica of pool_pick received (the `mixed` pool's other endpoints
    are no sims)."""
    pool = stack.pool("pool_pick")
    return [upstream_metric(u, "vllm_sim:requests_received_total") for u in pool.urls[:pool.replicas]]


def send(stack, pick: str | None, path: str = "/v1/chat/completions", cluster: str | None = None) -> httpx.Response:
    headers = {"content-type": "application/json"}
    if pick is not None:
        headers[PICK_HEADER] = pick
    if cluster is not None:
        headers["x-gateway-pool"] = cluster
    return httpx.post(stack.base_url + path, json=chat_body("sim/pick", max_tokens=1), headers=headers, timeout=10)


def sent_to(stack, pick: str | None, n: int = 1) -> list[float]:
    """Sends `n` requests with this pick; returns how many each sim replica received."""
    before = counts(stack)
    for _ in range(n):
        r = send(stack, pick)
        assert r.status_code == 200, (r.status_code, r.text, stack.envoy_log())
    return [a - b for a, b in zip(counts(stack), before)]


def test_the_picked_endpoint_serves(bare):
    urls = bare.pool("pool_pick").urls
    for i, url in enumerate(urls):
        got = sent_to(bare, addr(url), n=5)
        assert got == [5 if j == i else 0 for j in range(len(urls))], (i, got, bare.envoy_log())
    r = send(bare, addr(urls[1]))
    # The policy's selected_host_key reports the endpoint that served (envoy.lb metadata).
    assert r.headers["x-test-served"] == addr(urls[1]) == r.headers["x-test-upstream"], r.headers


def test_no_pick_is_least_request_over_every_replica(bare):
    got = sent_to(bare, None, n=30)
    # Sequential requests: LEAST_REQUEST's full scan finds every replica at 0 in flight and breaks the tie at random, so every replica
    # gets some (all 30 on at most two of three replicas: p < 3 * (2/3)^30 < 1e-5).
    assert sum(got) == 30 and all(c > 0 for c in got), got


def test_the_first_listed_endpoint_serves(bare):
    urls = bare.pool("pool_pick").urls
    got = sent_to(bare, f"{addr(urls[2])},{addr(urls[0])}", n=4)
    assert got == [0, 0, 4], got


def test_an_endpoint_outside_the_cluster_is_skipped(bare):
    urls = bare.pool("pool_pick").urls
    outside = f"127.0.0.1:{free_port()}"
    # Skipped without a connection attempt: the next listed endpoint serves.
    got = sent_to(bare, f"{outside},{addr(urls[1])}", n=3)
    assert got == [0, 3, 0], got
    # Only endpoints outside the cluster (or a value that is no address): LEAST_REQUEST, never a
    # connection to the named address (unlike an ORIGINAL_DST cluster).
    for pick in (outside, "not-an-address", ""):
        got = sent_to(bare, pick, n=6)
        assert sum(got) == 6, (pick, got)


def test_connect_failure_retries_the_next_listed_endpoint(mixed):
    urls = mixed.pool("pool_pick").urls
    dead = addr(urls[4])
    before = envoy_counter(mixed, "cluster.pool_pick.upstream_rq_retry")
    got = sent_to(mixed, f"{dead},{addr(urls[1])}", n=3)
    assert got == [0, 3, 0, 0], (got, mixed.envoy_log())
    assert envoy_counter(mixed, "cluster.pool_pick.upstream_rq_retry") - before == 3
    # Only the dead endpoint listed: the retry after its connect failure is LEAST_REQUEST's over
    # the healthy sims.
    got = sent_to(mixed, dead, n=6)
    assert sum(got) == 6, (got, mixed.envoy_log())
    assert envoy_counter(mixed, "cluster.pool_pick.upstream_rq_retry") - before == 9


def test_an_endpoint_failing_its_health_check_is_still_routed_to(mixed):
    """Envoy 1.40's override-host policy looks the named endpoint up in the cluster's host map
    without regard to its health: the sidecar must never name an unhealthy endpoint."""
    bad = addr(mixed.pool("pool_pick").urls[5])
    assert wait_for(lambda: "health_flags::/failed_active_hc" in _clusters(mixed, bad), timeout=15), \
        _clusters(mixed, bad)
    before = _Unhealthy.served
    r = send(mixed, bad)
    assert r.status_code == 200 and r.json() == {"upstream": "unhealthy"}, (r.status_code, r.text)
    assert _Unhealthy.served == before + 1
    # Without a pick, LEAST_REQUEST never sends it anything.
    before = _Unhealthy.served
    assert sum(sent_to(mixed, None, n=20)) == 20
    assert _Unhealthy.served == before


def test_an_ejected_endpoint_is_still_routed_to(ejecting):
    """The same for an endpoint outlier detection ejected (5 consecutive 5xx)."""
    failing = addr(ejecting.pool("pool_pick").urls[3])
    for _ in range(5):
        assert send(ejecting, failing).status_code == 500
    assert wait_for(lambda: "failed_outlier_check" in _clusters(ejecting, failing), timeout=10), \
        _clusters(ejecting, failing)
    before = _Failing.served
    r = send(ejecting, failing)
    assert r.status_code == 500 and r.json() == {"upstream": "failing"}, (r.status_code, r.text)
    assert _Failing.served == before + 1
    # Without a pick, LEAST_REQUEST sends it nothing while it is ejected.
    before = _Failing.served
    assert sum(sent_to(ejecting, None, n=20)) == 20
    assert _Failing.served == before


def _clusters(stack, host: str) -> str:
    with httpx.Client(timeout=2) as c:
        text = c.get(stack.admin_url + "/clusters").text
    return "\n".join(line for line in text.splitlines() if host in line)



# ------------------------------------------------------------------------------------------------
# Part 2, the whole gateway (filter, sidecar with the picker, Envoy): the sidecar's pick, read back
# from envoy.lb metadata in the response headers, is the replica whose vllm-sim counter moved.

GW_KEY = "sk-picker-test-key-0123456789abcdefghijklmnopqrstu"
PROMPT = "You are a careful assistant. " * 40  # 1,160 bytes: 18 blocks of 64 bytes to hash


class _PickReported(Stack):
    """The gateway stack, whose responses carry the sidecar's pick (`x-test-picked`) and the
    endpoint that served (`x-test-served`), both from envoy.lb metadata."""

    def envoy_config(self) -> dict:
        bootstrap = super().envoy_config()
        hcm = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        vhost = hcm["route_config"]["virtual_hosts"][0]
        vhost.setdefault("response_headers_to_add", []).extend([
            {"header": {"key": "x-test-picked",
                        "value": "%DYNAMIC_METADATA(envoy.lb:x-gateway-destination-endpoint)%"}},
            {"header": {"key": "x-test-served",
                        "value": "%DYNAMIC_METADATA(envoy.lb:x-gateway-destination-endpoint-served)%"}},
        ])
        return bootstrap


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    pool = Pool("pool_pick", ["sim/pick"], ["--output-tokens", "1"], replicas=3, picker={},
                shedding={"scrape_interval_ms": 100})
    models = [Model("pick", "pool_pick", served_model_name="sim/pick")]
    tenants = [Tenant("picker", [GW_KEY], {"requests_per_minute": 1000000})]
    with _PickReported(tmp_path_factory.mktemp("pick-gateway"), [pool], models, tenants) as s:
        yield s


def gw_send(stack, content: str = PROMPT, headers: dict | None = None) -> httpx.Response:
    h = {"Authorization": f"Bearer {GW_KEY}", **(headers or {})}
    return httpx.post(stack.base_url + "/v1/chat/completions",
                      json=chat_body("pick", content, max_tokens=1), headers=h, timeout=10)


def gw_served(stack, content: str = PROMPT, headers: dict | None = None) -> tuple[str, int]:
    """One request: (the sidecar's pick, the index of the replica whose counter moved)."""
    before = counts(stack)
    r = gw_send(stack, content, headers)
    assert r.status_code == 200, (r.status_code, r.text, stack.logs())
    moved = [i for i, (a, b) in enumerate(zip(counts(stack), before)) if a != b]
    assert len(moved) == 1, (moved, r.headers)
    return r.headers.get("x-test-picked", ""), moved[0]


def test_gateway_the_sidecars_pick_serves(gateway):
    urls = [addr(u) for u in gateway.pool("pool_pick").urls]
    # Wait for the sidecar's first scrapes: until then it sends requests without a pick.
    assert wait_for(lambda: gw_send(gateway).headers.get("x-test-picked"), timeout=15), gateway.logs()
    for i in range(12):
        picked, served = gw_served(gateway, f"{PROMPT} question {i}")
        # The pick, then fallback_endpoints (default 1) more: the first listed one serves.
        listed = picked.split(",")
        assert len(listed) == 2 and set(listed) <= set(urls), picked
        assert urls[served] == listed[0], (picked, urls, served)


def test_gateway_drops_a_client_sent_destination_header(gateway):
    urls = [addr(u) for u in gateway.pool("pool_pick").urls]
    # The same prompt again: prefix affinity keeps it on the endpoint that served it (idle sims,
    # so the bounded load never overrides it); a client naming another endpoint changes nothing.
    _, served = gw_served(gateway)
    spoofed = next(u for u in urls if u != urls[served])
    for _ in range(5):
        picked, s = gw_served(gateway, headers={"x-gateway-destination-endpoint": spoofed})
        assert s == served and urls[s] == picked.split(",")[0], (picked, urls, s, spoofed)


def test_gateway_never_picks_a_stopped_endpoint(gateway):
    urls = [addr(u) for u in gateway.pool("pool_pick").urls]
    dead = urls[0]
    proc = next(p for p in gateway.procs if p.name == "pool_pick-0")
    proc.stop()
    gateway.procs.remove(proc)
    gateway.pool("pool_pick").replicas = 0  # counts() cannot read the stopped sim any more

    def not_listed() -> bool:
        r = gw_send(gateway)
        return r.status_code == 200 and dead not in r.headers.get("x-test-picked", dead)

    # Once its scrapes fail (stale_after_ms), the picker excludes it from the pick and the list.
    assert wait_for(not_listed, timeout=15), gateway.logs()
    for i in range(20):
        r = gw_send(gateway, f"{PROMPT} after {i}")
        assert r.status_code == 200, (r.status_code, r.text)
        assert dead not in r.headers["x-test-picked"], r.headers["x-test-picked"]
        assert r.headers["x-test-served"] != dead


def test_gateway_with_the_sidecar_down_fails_closed(gateway):
    """The admission ext_proc fails closed (failure_mode_allow: false): with the sidecar away no
    request is admitted, picked or not (a pool never falls back to LEAST_REQUEST this way; only
    requests admitted from an admission lease skip the sidecar and get LEAST_REQUEST)."""
    gateway.kill_sidecar()
    r = gw_send(gateway)
    assert r.status_code >= 500, (r.status_code, r.text)
