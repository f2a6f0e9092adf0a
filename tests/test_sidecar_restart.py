"""A sidecar crash (SIGKILL, as when its container is restarted), through the real Envoy, Redis and
sidecar.

While no sidecar listens, admission fails closed (the admission ext_proc has
`failure_mode_allow: false`); once it is back, requests are admitted and metered again. A known
gap, pinned here by a strict xfail: the usage record of a request that *ends* while no sidecar
listens is lost. Envoy's gRPC access log (Envoy's gRPC client, a STATIC cluster) hands the entry
to a new stream whose connection then fails, and counts it delivered
(`access_logs.grpc_access_log.grpc_entries_flushed` and `logs_written`; `grpc_entries_flush_failed`
and `logs_dropped` stay 0), so it is never retried. Its TPM reservation is never settled (the
bucket keeps prompt + max tokens charged until it refills) and no usage record bills it. An entry flushed within a few milliseconds of the sidecar's return can still
arrive (Envoy's connection attempt may still be pending), which is why the test waits for Envoy's
failed connection before restarting the sidecar. See docs/deploy.md, "Sidecar restarts".
"""

from __future__ import annotations

import threading
import urllib.request

import httpx
import pytest
import redis
from helpers import auth, chat_body, post, wait_for
from stack import Model, Pool, Stack, Tenant, new_api_key

KEY = new_api_key()
# 30 tokens 100 ms apart: a stream of about 3 s.
SLOW = ["--ttft-ms", "50", "--itl-ms", "100", "--output-tokens", "30"]


@pytest.fixture
def stack(tmp_path):
    pools = [Pool("pool_r", ["model-r"], SLOW)]
    tenants = [Tenant("restart", [KEY], {"requests_per_minute": 1000})]
    with Stack(tmp_path, pools, [Model("model-r", "pool_r")], tenants) as s:
        yield s


def records(stack) -> int:
    client = redis.Redis(port=stack.redis_port, decode_responses=True)
    return sum(int(client.hget(k, "model-r:requests") or 0) for k in client.scan_iter("llmgw:usage:{restart}:*"))


def envoy_counter(stack, name: str) -> int:
    """One Envoy stat (admin /stats, exact name), 0 when absent."""
    with urllib.request.urlopen(f"{stack.admin_url}/stats?filter=^{name}$", timeout=2) as r:
        text = r.read().decode().strip()
    return int(text.rsplit(": ", 1)[1]) if text else 0


def access_log_stats(stack) -> str:
    with urllib.request.urlopen(f"{stack.admin_url}/stats?filter=grpc_access_log", timeout=2) as r:
        return r.read().decode()


def stream_to_end(stack, out: dict) -> None:
    body = chat_body("model-r", "stream me", stream=True, max_tokens=30)
    with httpx.stream("POST", stack.base_url + "/v1/chat/completions", json=body, headers=auth(KEY),
                      timeout=30) as r:
        out["status"] = r.status_code
        out["lines"] = len([line for line in r.iter_lines() if line.startswith("data:")])


def test_admission_fails_closed_while_the_sidecar_is_away_and_recovers(stack):
    r = post(stack, "/v1/chat/completions", chat_body("model-r", max_tokens=2), key=KEY)
    assert r.status_code == 200, r.text
    assert wait_for(lambda: records(stack) == 1), access_log_stats(stack)
    stack.kill_sidecar()
    r = post(stack, "/v1/chat/completions", chat_body("model-r", max_tokens=2), key=KEY)
    assert r.status_code >= 500, r.text
    stack.restart_sidecar()
    # Envoy reconnects to the new sidecar on the next request (its connect failure is not cached).
    r = wait_for(lambda: (r := post(stack, "/v1/chat/completions", chat_body("model-r", max_tokens=2), key=KEY))
                 .status_code == 200 and r)
    assert r, "no request admitted after the sidecar came back"
    assert wait_for(lambda: records(stack) == 2), (records(stack), access_log_stats(stack))


@pytest.mark.xfail(strict=True, reason="known gap: Envoy's gRPC access log loses the entry of a request that ends "
                                       "while no sidecar listens (see the module docstring)")
def test_a_request_ending_while_the_sidecar_is_away_is_still_metered(stack):
    out: dict = {}
    streaming = threading.Thread(target=stream_to_end, args=(stack, out))
    streaming.start()
    # Admitted and streaming: the sidecar dies, and the stream ends before it is back.
    assert wait_for(lambda: envoy_counter(stack, "cluster.pool_r.upstream_rq_active") == 1, timeout=5)
    stack.kill_sidecar()
    failed_connects = envoy_counter(stack, "cluster.llm_gateway_ext_proc.upstream_cx_connect_fail")
    streaming.join(timeout=30)
    assert out == {"status": 200, "lines": 32}, out
    # Envoy has flushed the stream's entry (toward the absent sidecar) and failed to connect.
    assert wait_for(lambda: envoy_counter(stack, "access_logs.grpc_access_log.grpc_entries_flushed") >= 1
                    and envoy_counter(stack, "cluster.llm_gateway_ext_proc.upstream_cx_connect_fail")
                    > failed_connects, timeout=5), access_log_stats(stack)
    stack.restart_sidecar()
    # A request after the restart is recorded: the sidecar and Envoy's access log work again.
    assert post(stack, "/v1/chat/completions", chat_body("model-r", max_tokens=2), key=KEY).status_code == 200
    assert wait_for(lambda: records(stack) >= 1, timeout=5), access_log_stats(stack)
    # The stream that ended during the outage.
    assert wait_for(lambda: records(stack) == 2, timeout=3), (records(stack), access_log_stats(stack))
