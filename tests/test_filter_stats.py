"""The filter's own Envoy stats, from the wasm module and the native one alike: every request's end
counted in `llm_gateway_filter_requests_total{outcome,reason,tenant}` (the native module's reads
`envoy_dynamicmodulescustom_llm_gateway_filter_requests_total` in Prometheus), so a 401 or a 403
shows with its reason and tenant, not only in Envoy's `downstream_rq_4xx`."""

from __future__ import annotations

import re
import urllib.request

import pytest

from helpers import chat_body, post, wait_for
from stack import FILTER_NATIVE, Model, Pool, Stack, Tenant, new_api_key

KEY, LIMITED = new_api_key(), new_api_key()
SAMPLE = re.compile(r'^(?:envoy_dynamicmodulescustom_)?llm_gateway_filter_requests_total\{([^}]*)\} (\S+)$')


@pytest.fixture(scope="module", params=["wasm", "native"])
def stack(request, tmp_path_factory):
    if request.param == "native" and not FILTER_NATIVE.exists():
        pytest.fail(f"{FILTER_NATIVE} is missing: `make build` builds it")
    pools = [Pool("pool_a", ["sim/a"], ["--output-tokens", "2"])]
    models = [Model("small", "pool_a", 64, served_model_name="sim/a"),
              Model("other", "pool_a", 4096, served_model_name="sim/a")]
    tenants = [Tenant("acme", [KEY], {"requests_per_minute": 100000}),
               Tenant("only-small", [LIMITED], {"requests_per_minute": 100000}, models=["small"])]
    with Stack(tmp_path_factory.mktemp(f"filter-stats-{request.param}"), pools, models, tenants,
               native_module=FILTER_NATIVE if request.param == "native" else None) as s:
        yield s


def counts(stack) -> dict[tuple[str, str, str], float]:
    with urllib.request.urlopen(stack.admin_url + "/stats/prometheus", timeout=2) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        m = SAMPLE.match(line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
            out[(labels["outcome"], labels["reason"], labels["tenant"])] = float(m.group(2))
    return out


def test_each_outcome_is_counted_with_its_reason_and_tenant(stack):
    sends = [
        (chat_body("small", max_tokens=2), KEY, 200),
        (chat_body("small", max_tokens=2), None, 401),
        (chat_body("small", max_tokens=2), new_api_key(), 401),
        (chat_body("nope", max_tokens=2), KEY, 404),
        (chat_body("other", max_tokens=2), LIMITED, 403),
        (chat_body("small", max_tokens=100000), KEY, 400),
        (b'{"model": "small", "messages": ', KEY, 400),
    ]
    before = counts(stack)
    for body, key, status in sends:
        r = post(stack, "/v1/chat/completions", body, key=key)
        assert r.status_code == status, (status, r.text)
    want = {
        ("forwarded", "none", "acme"): 1,
        ("refused", "missing_api_key", "none"): 1,
        ("refused", "invalid_api_key", "none"): 1,
        ("refused", "model_not_found", "acme"): 1,
        ("refused", "model_not_allowed", "only-small"): 1,
        ("refused", "max_tokens_too_large", "acme"): 1,
        ("refused", "invalid_json", "acme"): 1,
    }

    def grew():
        now = counts(stack)
        return {k: now.get(k, 0) - before.get(k, 0) for k in want}

    assert wait_for(lambda: grew() == want, timeout=30), f"{grew()} != {want}\n{stack.envoy_log()}"
