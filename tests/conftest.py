"""Fixtures: one gateway stack per test session (real envoy, redis-server, sidecar, upstreams)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from stack import Model, Pool, Stack, Tenant, new_api_key  # noqa: E402

KEYS = {name: new_api_key() for name in ("acme", "tiny", "tokens", "restricted", "meter")}


@pytest.fixture(scope="session")
def keys() -> dict[str, str]:
    """API keys by tenant id (the stack's config holds only their SHA-256 digests)."""
    return KEYS


@pytest.fixture(scope="session")
def stack(tmp_path_factory) -> Stack:
    pools = [
        Pool("pool_alpha", ["sim/alpha"], ["--output-tokens", "8"]),
        Pool("pool_beta", ["sim/beta"], ["--output-tokens", "5"]),
        # 20 tokens 50 ms apart: a stream that takes about a second to finish.
        Pool("pool_slow", ["sim/slow"], ["--ttft-ms", "20", "--itl-ms", "50", "--output-tokens", "20"]),
        # Only the metering test uses it, so its counters are that test's alone.
        Pool("pool_meter", ["sim/metered"], ["--output-tokens", "7"]),
    ]
    models = [
        # max_token_bytes: the longest token of the (byte-level BPE) vocabulary, for the filter's
        # lower bound on prompt tokens when no tokenizer is configured.
        Model("alpha", "pool_alpha", 4096, served_model_name="sim/alpha", extra={"max_token_bytes": 128}),
        Model("beta", "pool_beta", 4096, served_model_name="sim/beta"),
        Model("slow", "pool_slow", 4096, served_model_name="sim/slow"),
        Model("metered", "pool_meter", 4096, served_model_name="sim/metered"),
    ]
    tenants = [
        Tenant("acme", [KEYS["acme"]], {"requests_per_minute": 100000, "tokens_per_minute": 100000000}),
        Tenant("tiny", [KEYS["tiny"]], {"requests_per_minute": 3}),
        Tenant("tokens", [KEYS["tokens"]], {"tokens_per_minute": 1000}),
        Tenant("restricted", [KEYS["restricted"]], {"requests_per_minute": 1000}, models=["beta"]),
        Tenant("meter", [KEYS["meter"]], {"requests_per_minute": 1000, "tokens_per_minute": 1000000}),
    ]
    with Stack(tmp_path_factory.mktemp("stack"), pools, models, tenants) as s:
        yield s


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """On failure, attach the logs of the stack the test used (Envoy's first)."""
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for value in getattr(item, "funcargs", {}).values():
            if isinstance(value, Stack):
                report.sections.append(("envoy log", value.envoy_log()))
                report.sections.append(("other logs", value.logs()))
