"""How the sidecar scrapes its pools' endpoints, end to end (real Envoy, sidecar, vllm-sim).

vLLM answers `/metrics/?name[]=...` (prometheus_client's mount) with only the named samples, and
the sidecar asks for the eight it reads; an endpoint that answers that path with something else
(here a stub that serves `/metrics` and nothing more, as a server other than vLLM's may) is
scraped at `/metrics` from then on, asked for the filtered path once.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from helpers import wait_for
from sidecar_checks import metric, sidecar_metrics
from stack import Model, Pool, Stack, Tenant, new_api_key


class PlainMetrics(BaseHTTPRequestHandler):
    """Serves `/metrics` (three waiting, one running) and 404 on every other path; counts the
    paths it was asked for."""

    paths: list[str] = []
    lock = threading.Lock()

    def do_GET(self):  # noqa: N802 (http.server's name)
        with PlainMetrics.lock:
            PlainMetrics.paths.append(self.path)
        body = b"vllm:num_requests_waiting 3\nvllm:num_requests_running 1\n" if self.path == "/metrics" else b"no"
        self.send_response(200 if self.path == "/metrics" else 404)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def scraped(tmp_path_factory):
    server = ThreadingHTTPServer(("127.0.0.1", 0), PlainMetrics)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    plain_url = f"http://127.0.0.1:{server.server_address[1]}"
    pools = [Pool("pool_sim", ["sim/scraped"], shedding={"max_queue_depth": 100, "scrape_interval_ms": 100}),
             Pool("pool_plain", ["plain"], kind="external", urls=[plain_url],
                  shedding={"max_queue_depth": 100, "scrape_interval_ms": 100})]
    models = [Model("scraped", "pool_sim", served_model_name="sim/scraped"), Model("plain", "pool_plain")]
    tenants = [Tenant("scrape-t", [new_api_key()], {"requests_per_minute": 1000})]
    try:
        with Stack(tmp_path_factory.mktemp("scrape"), pools, models, tenants,
                   sidecar_overrides={"metrics_listen": "127.0.0.1:0"}) as s:
            yield s, plain_url
    finally:
        server.shutdown()


def endpoint(url: str) -> str:
    return url.removeprefix("http://")


def series(text: str, name: str, **labels: str) -> list[str]:
    """The sample lines of `name` whose labels include `labels` (present, whatever the value)."""
    return [line for line in text.splitlines() if line.startswith(name + "{")
            and all(f'{k}="{v}"' in line for k, v in labels.items())]


def test_a_vllm_endpoint_is_asked_only_for_the_samples_the_sidecar_reads(scraped):
    stack, _ = scraped
    sim = endpoint(stack.pool("pool_sim").urls[0])
    assert wait_for(lambda: metric(sidecar_metrics(stack), "llm_gateway_endpoint_scrape_ok",
                                   pool="pool_sim", endpoint=sim) == 1, timeout=10), sidecar_metrics(stack)
    text = sidecar_metrics(stack)
    assert metric(text, "llm_gateway_endpoint_scrape_filtered", pool="pool_sim", endpoint=sim) == 1, text
    assert series(text, "llm_gateway_pool_requests_waiting", pool="pool_sim"), text


def test_an_endpoint_that_ignores_the_filter_is_scraped_whole_and_asked_once(scraped):
    stack, plain_url = scraped
    plain = endpoint(plain_url)

    def full_scrapes() -> int:
        with PlainMetrics.lock:
            return PlainMetrics.paths.count("/metrics")

    # Five scrapes of 100 ms apart at least: the filtered path was asked for once, at the first.
    assert wait_for(lambda: full_scrapes() >= 5, timeout=10), PlainMetrics.paths
    with PlainMetrics.lock:
        paths = list(PlainMetrics.paths)
    paths = [p for p in paths if p.startswith("/metrics")]  # (Envoy health-checks /health)
    filtered = [p for p in paths if p != "/metrics"]
    assert len(filtered) == 1 and filtered[0].startswith("/metrics/?name%5B%5D=vllm%3Anum_requests_waiting&"), paths
    assert paths.index(filtered[0]) == 0, paths
    text = sidecar_metrics(stack)
    assert metric(text, "llm_gateway_endpoint_scrape_ok", pool="pool_plain", endpoint=plain) == 1, text
    filtered_series = series(text, "llm_gateway_endpoint_scrape_filtered", pool="pool_plain", endpoint=plain)
    assert len(filtered_series) == 1 and filtered_series[0].endswith(" 0"), text
    # Its whole /metrics is read: three waiting.
    assert metric(text, "llm_gateway_pool_requests_waiting", pool="pool_plain") == 3, text
