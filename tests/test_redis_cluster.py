"""The sidecar on a Redis Cluster (3 masters on loopback, `redis.cluster_urls`): rate limits and
usage records work across nodes, read back with redis-py's RedisCluster.

Each tenant's keys share its hash tag (`{tenant}`), so one script call touches one slot; the two
tenants here are picked so that their slots live on different nodes.
"""

from __future__ import annotations

import math
import time

import httpx
import pytest

from helpers import assert_openai_error, auth, chat_body, post, sse_events, wait_for
from redis.cluster import RedisCluster
from redis.crc import key_slot
from sidecar_checks import bucket, bucket_key, landed_events, usage_hash
from stack import Model, Pool, Stack, Tenant, new_api_key

BIG = 1_000_000


def _tenant_in(slots: range, prefix: str) -> str:
    """A tenant id whose hash tag falls in `slots` (redis-cli gives 3 masters 0-5460, 5461-10922,
    10923-16383)."""
    return next(t for t in (f"{prefix}{i}" for i in range(1000)) if key_slot(t.encode()) in slots)


RPM_TENANT = _tenant_in(range(5461), "cl-rpm-")
TPM_TENANT = _tenant_in(range(10923, 16384), "cl-tpm-")
KEYS = {RPM_TENANT: new_api_key(), TPM_TENANT: new_api_key()}


@pytest.fixture(scope="module")
def cluster_stack(tmp_path_factory):
    pools = [Pool("pool_cl", ["sim/cl"], ["--output-tokens", "4"])]
    models = [Model("cl", "pool_cl", served_model_name="sim/cl")]
    tenants = [
        Tenant(RPM_TENANT, [KEYS[RPM_TENANT]], {"requests_per_minute": 2}),
        Tenant(TPM_TENANT, [KEYS[TPM_TENANT]], {"tokens_per_minute": 1, "token_burst": BIG}),
    ]
    with Stack(tmp_path_factory.mktemp("cluster"), pools, models, tenants, redis_cluster_nodes=3) as s:
        s.cluster = RedisCluster(host="127.0.0.1", port=s.redis_cluster_ports[0])
        yield s
        s.cluster.close()


def test_limits_and_usage_through_a_redis_cluster(cluster_stack):
    stack = cluster_stack
    rc = stack.cluster
    assert len(rc.get_primaries()) == 3
    assert stack.sidecar_config()["redis"]["cluster_urls"], "the sidecar must be on the cluster"
    rpm_node = rc.get_node_from_key(bucket_key(RPM_TENANT, "rpm"))
    tpm_node = rc.get_node_from_key(bucket_key(TPM_TENANT, "tpm"))
    assert rpm_node.name != tpm_node.name

    t0 = time.monotonic()
    for remaining in ("1", "0"):
        r = post(stack, "/v1/chat/completions", chat_body("cl"), key=KEYS[RPM_TENANT])
        assert r.status_code == 200, r.text
        assert r.headers["x-ratelimit-remaining-requests"] == remaining
    r = post(stack, "/v1/chat/completions", chat_body("cl"), key=KEYS[RPM_TENANT])
    error = assert_openai_error(r, 429, code="rate_limit_exceeded")
    assert error["type"] == "requests"
    assert math.ceil(30 - (time.monotonic() - t0)) <= int(r.headers["retry-after"]) <= 30
    assert (r.headers["x-ratelimit-limit-requests"], r.headers["x-ratelimit-remaining-requests"]) == ("2", "0")
    state = bucket(rc, bucket_key(RPM_TENANT, "rpm"))
    assert state and state[0] < 0.1, state

    body = chat_body("cl", "metered on a cluster", stream=True, stream_options={"include_usage": True})
    with httpx.stream("POST", stack.base_url + "/v1/chat/completions", json=body, headers=auth(KEYS[TPM_TENANT]),
                      timeout=10) as resp:
        assert resp.status_code == 200
        events = sse_events(list(resp.iter_lines()))
    [usage] = [e["usage"] for e in events[:-1] if e.get("usage")]

    assert wait_for(lambda: usage_hash(rc, RPM_TENANT).get("cl:requests") == 2), usage_hash(rc, RPM_TENANT)
    assert wait_for(lambda: usage_hash(rc, TPM_TENANT).get("cl:requests") == 1), usage_hash(rc, TPM_TENANT)
    h = usage_hash(rc, TPM_TENANT)
    assert (h["cl:prompt_tokens"], h["cl:completion_tokens"]) == (usage["prompt_tokens"], usage["completion_tokens"])
    assert len(landed_events(rc, RPM_TENANT, 2)) == 2
    [event] = landed_events(rc, TPM_TENANT, 1)
    assert event["completion_tokens"] == usage["completion_tokens"]
    # Settled through the cluster: capacity less the usage.
    used = usage["total_tokens"]
    key = bucket_key(TPM_TENANT, "tpm")
    assert wait_for(lambda: (b := bucket(rc, key)) and BIG - used - 0.01 <= b[0] <= BIG - used + 2), bucket(rc, key)


def test_a_killed_node_loses_no_record(cluster_stack):
    """The node holding a tenant's keys crashes (SIGKILL) and comes back (its append-only file
    kept what it had stored): admission goes on from the sidecar's in-memory buckets (failure
    mode `open`), the records of the outage are held and written when the node is back, and the
    sidecar's cluster connection recovers (it is rebuilt after repeated failures)."""
    stack = cluster_stack
    port = stack.cluster.get_node_from_key(bucket_key(TPM_TENANT, "tpm")).port
    before = usage_hash(stack.cluster, TPM_TENANT).get("cl:requests", 0)
    stack.kill_cluster_node(port)
    try:
        for _ in range(3):
            r = post(stack, "/v1/chat/completions", chat_body("cl", "while a node is down"), key=KEYS[TPM_TENANT])
            assert r.status_code == 200, r.text
    finally:
        stack.restart_cluster_node(port)
    fresh = RedisCluster(host="127.0.0.1", port=stack.redis_cluster_ports[0])

    def recorded() -> int:
        try:
            return usage_hash(fresh, TPM_TENANT).get("cl:requests", 0)
        except Exception:  # noqa: BLE001 -- the client's view of the cluster is still settling
            return -1

    assert wait_for(lambda: recorded() == before + 3, timeout=30), (before, recorded(), stack.logs())
    # Admission is back on Redis: the bucket moves again.
    r = post(stack, "/v1/chat/completions", chat_body("cl"), key=KEYS[TPM_TENANT])
    assert r.status_code == 200, r.text
    assert wait_for(lambda: recorded() == before + 4, timeout=10), recorded()
    fresh.close()
