"""The sidecar as a Gateway API Inference Extension endpoint picker (EPP), through the real Envoy.

Istio and Envoy Gateway call an InferencePool's endpoint picker with an ext_proc filter they
configure themselves: request and response bodies FULL_DUPLEX_STREAMED, trailers sent, no
initial metadata, no filter-state attributes. The stack here adds such a filter (as those
control planes render it) in front of the guard, pointing at the sidecar's `endpoint_pickers[]`
listener for the pool; the pool's cluster routes by `envoy.lb` (envoy/pool_picker_lb.yaml). The
admission ext_proc still admits (and does not pick: the pool has an endpoint picker).

Asserted: the EPP's pick (envoy.lb, reported in `x-test-picked`) is the replica whose vllm-sim
counter moved, a repeated prompt stays on its replica, the body reaches vLLM whole after the
round trip through the picker (200 with the prompt's token count), a streamed response comes
back whole (echoed chunk by chunk in full-duplex mode), and with every replica gone the picker
answers 503 `no_eligible_endpoint`.
"""

from __future__ import annotations

import json

import httpx
import pytest

from helpers import chat_body, wait_for
from stack import Model, Pool, Stack, StackError, Tenant, free_port, upstream_metric

KEY = "sk-epp-test-key-0123456789abcdefghijklmnopqrstuvwxyz"
POOL = "pool_epp"
PROMPT = "You are a careful assistant who answers briefly. " * 30  # ~1,500 bytes: 23 blocks


class _EppStack(Stack):
    """The gateway stack plus an Inference-Extension-style ext_proc filter to the sidecar's
    endpoint-picker listener, and the pick and the served endpoint as response headers."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.epp_port = free_port()

    def sidecar_config(self) -> dict:
        config = super().sidecar_config()
        config["endpoint_pickers"] = [{"pool": POOL, "listen": f"127.0.0.1:{self.epp_port}"}]
        return config

    def envoy_config(self) -> dict:
        bootstrap = super().envoy_config()
        hcm = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        epp_filter = {
            "name": "epp.ext_proc",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
                "grpc_service": {"envoy_grpc": {"cluster_name": "epp"}, "timeout": "10s"},
                "failure_mode_allow": False,
                "processing_mode": {
                    "request_header_mode": "SEND", "response_header_mode": "SEND",
                    "request_body_mode": "FULL_DUPLEX_STREAMED", "response_body_mode": "FULL_DUPLEX_STREAMED",
                    "request_trailer_mode": "SEND", "response_trailer_mode": "SEND",
                },
                "message_timeout": "10s",
                "metadata_options": {"receiving_namespaces": {"untyped": ["envoy.lb"]}},
            },
        }
        names = [f["name"] for f in hcm["http_filters"]]
        hcm["http_filters"].insert(names.index("llm_gateway.guard"), epp_filter)
        bootstrap["static_resources"]["clusters"].append({
            "name": "epp",
            "type": "STATIC",
            "connect_timeout": "1s",
            "typed_extension_protocol_options": {
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                    "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                    "explicit_http_config": {"http2_protocol_options": {}},
                },
            },
            "load_assignment": {"cluster_name": "epp", "endpoints": [{"lb_endpoints": [{"endpoint": {
                "address": {"socket_address": {"address": "127.0.0.1", "port_value": self.epp_port}}}}]}]},
        })
        vhost = hcm["route_config"]["virtual_hosts"][0]
        vhost.setdefault("response_headers_to_add", []).extend([
            {"header": {"key": "x-test-picked",
                        "value": "%DYNAMIC_METADATA(envoy.lb:x-gateway-destination-endpoint)%"}},
            {"header": {"key": "x-test-served",
                        "value": "%DYNAMIC_METADATA(envoy.lb:x-gateway-destination-endpoint-served)%"}},
            # The admission's own pick (none: the pool has an endpoint picker).
            {"header": {"key": "x-test-admission-pick",
                        "value": "%DYNAMIC_METADATA(llm_gateway:picked_endpoint)%"}},
        ])
        return bootstrap


@pytest.fixture(scope="module")
def epp(tmp_path_factory):
    pool = Pool(POOL, ["sim/epp"], ["--output-tokens", "3"], replicas=3, picker={},
                shedding={"scrape_interval_ms": 100})
    models = [Model("epp", POOL, served_model_name="sim/epp")]
    tenants = [Tenant("epp", [KEY], {"requests_per_minute": 1_000_000})]
    # The picker's port is chosen free, then bound by the sidecar; on this shared machine another
    # process can take it in between ("Address already in use"): a new stack on a new port, at
    # most three times.
    for attempt in range(3):
        stack = _EppStack(tmp_path_factory.mktemp("epp"), [pool], models, tenants)
        try:
            stack.__enter__()
        except StackError as e:
            if "Address already in use" not in str(e) or attempt == 2:
                raise
            continue
        break
    try:
        yield stack
    finally:
        stack.close()


def counts(stack) -> list[float]:
    return [upstream_metric(u, "vllm_sim:requests_received_total") for u in stack.pool(POOL).urls]


def addr(url: str) -> str:
    return url.split("://", 1)[1]


def send(stack, content: str = PROMPT, **extra) -> httpx.Response:
    return httpx.post(stack.base_url + "/v1/chat/completions", json=chat_body("epp", content, max_tokens=3, **extra),
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=15)


def served(stack, content: str = PROMPT) -> tuple[httpx.Response, int]:
    before = counts(stack)
    r = send(stack, content)
    assert r.status_code == 200, (r.status_code, r.text, stack.envoy_log(), stack.logs())
    moved = [i for i, (a, b) in enumerate(zip(counts(stack), before)) if a != b]
    assert len(moved) == 1, (moved, r.headers)
    return r, moved[0]


def test_the_pickers_endpoint_serves_and_a_prompt_stays_on_it(epp):
    urls = [addr(u) for u in epp.pool(POOL).urls]
    # Wait until every replica was scraped (eligible), then pick.
    assert wait_for(lambda: send(epp, "warm up").status_code == 200, timeout=10), epp.logs()
    first, replica = served(epp)
    picked = first.headers.get("x-test-picked", "")
    assert picked.split(",")[0] == urls[replica], (picked, urls, replica)
    assert first.headers.get("x-test-served") == urls[replica]
    assert not first.headers.get("x-test-admission-pick"), "the admission must not pick this pool"
    # The body went through the picker and back whole: vLLM read the whole prompt.
    usage = first.json()["usage"]
    assert usage["prompt_tokens"] > len(PROMPT) // 4 - 1, usage
    for _ in range(5):
        _, again = served(epp)
        assert again == replica, "the same prompt prefix stays on its replica"


def test_a_streamed_response_comes_back_whole(epp):
    with httpx.stream("POST", epp.base_url + "/v1/chat/completions",
                      json=chat_body("epp", "stream me " * 20, max_tokens=3, stream=True),
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=15) as r:
        assert r.status_code == 200, r.read()
        text = "".join(r.iter_text())
    events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", text
    contents = [json.loads(e)["choices"][0]["delta"].get("content") for e in events[:-1] if json.loads(e)["choices"]]
    assert len([c for c in contents if c]) == 3, text


def test_no_eligible_endpoint_is_503(epp):
    """Run last in this module: it stops every replica."""
    for proc in [p for p in epp.procs if p.name.startswith(POOL)]:
        proc.stop()

    def refused():
        r = send(epp)
        return r if r.status_code == 503 and "no_eligible_endpoint" in r.text else None

    r = wait_for(refused, timeout=15)
    assert r is not None, (send(epp).text, epp.logs())
    assert r.json()["error"]["code"] == "no_eligible_endpoint", r.text
