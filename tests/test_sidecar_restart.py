"""A sidecar crash (SIGKILL, as when its container is restarted), through the real Envoy, Redis and
sidecar.

While no sidecar listens, admission fails closed (the admission ext_proc has
`failure_mode_allow: false`); once it is back, requests are admitted and metered again. A sidecar
stopped with SIGTERM serves the open streams for `shutdown_grace_ms` first, so the streams Envoy
still drains are metered (last test).

Requests admitted before the crash and ending while no sidecar listens: Envoy's gRPC access log
hands their entries to a new stream toward the absent sidecar and counts them delivered
(`access_logs.grpc_access_log.grpc_entries_flushed` and `logs_written`; `logs_dropped` and
`grpc_entries_flush_failed` stay 0). With `grpc_stream_retry_policy` (envoy/access_log_metering.yaml)
Envoy retries the connection with what it sent buffered, but that buffer is small: with 32 streams
ending during the outage it overflowed (Envoy's debug log: "retry or redirect buffer overflow") and
only 2 to 9 of the 32 were recorded. The usage journal (envoy/access_log_journal.yaml,
ext-proc/src/metering/journal/) closes that gap: Envoy also writes each entry to a local file, which the
restarted sidecar reads from its checkpoint in Redis, so every request is recorded, once (the
record ids make the entries the gRPC stream did deliver change nothing). See docs/deploy.md,
"Sidecar restarts".
"""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest
import redis
from helpers import auth, chat_body, envoy_counter, envoy_stats, post, wait_for
from sidecar_checks import landed_events
from stack import Model, Pool, Stack, Tenant, new_api_key

KEY = new_api_key()
# 30 tokens 100 ms apart: a stream of about 3 s.
SLOW = ["--ttft-ms", "50", "--itl-ms", "100", "--output-tokens", "30"]
# Streams in flight when the sidecar dies, in the known-gap test.
MANY_STREAMS = 32


@pytest.fixture
def stack(tmp_path):
    pools = [Pool("pool_r", ["model-r"], SLOW)]
    tenants = [Tenant("restart", [KEY], {"requests_per_minute": 1000})]
    with Stack(tmp_path, pools, [Model("model-r", "pool_r")], tenants) as s:
        yield s


def records(stack) -> int:
    client = redis.Redis(port=stack.redis_port, decode_responses=True)
    return sum(int(client.hget(k, "model-r:requests") or 0) for k in client.scan_iter("llmgw:usage:{restart}:*"))


def access_log_stats(stack) -> str:
    """Envoy's access-log counters and the sidecar cluster's connection and retry counters."""
    return envoy_stats(
        stack, "grpc_access_log|llm_gateway_ext_proc.(upstream_cx_connect_fail|upstream_rq_retry|retry_or_shadow)")


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


def outage_while_streams_end(stack, streams: int) -> None:
    """`streams` streams admitted, the sidecar killed, every stream ended, Envoy's access log
    failing to reach the sidecar for a while; then the sidecar back and one request through it."""
    # One request first, so that Envoy's access-log stream to the sidecar exists and breaks.
    assert post(stack, "/v1/chat/completions", chat_body("model-r", max_tokens=2), key=KEY).status_code == 200
    assert wait_for(lambda: records(stack) == 1), access_log_stats(stack)
    outs = [{} for _ in range(streams)]
    threads = [threading.Thread(target=stream_to_end, args=(stack, out)) for out in outs]
    for t in threads:
        t.start()
    assert wait_for(lambda: envoy_counter(stack, "cluster.pool_r.upstream_rq_active") == streams, timeout=10)
    stack.kill_sidecar()
    failed_connects = envoy_counter(stack, "cluster.llm_gateway_ext_proc.upstream_cx_connect_fail")
    for t in threads:
        t.join(timeout=30)
    assert outs == [{"status": 200, "lines": 32}] * streams, outs
    # Envoy has tried to deliver the entries and failed to connect, more than once.
    assert wait_for(lambda: envoy_counter(stack, "cluster.llm_gateway_ext_proc.upstream_cx_connect_fail")
                    >= failed_connects + 2, timeout=10), access_log_stats(stack)
    stack.restart_sidecar()
    assert wait_for(lambda: post(stack, "/v1/chat/completions", chat_body("model-r", max_tokens=2), key=KEY)
                    .status_code == 200), "no request admitted after the sidecar came back"


def test_a_request_ending_while_the_sidecar_is_away_is_metered_once_it_is_back(stack):
    # Envoy retries the access-log stream's connection (grpc_stream_retry_policy) with what it
    # sent buffered for the retry.
    outage_while_streams_end(stack, 1)
    assert wait_for(lambda: records(stack) == 3, timeout=10), (records(stack), access_log_stats(stack))
    client = redis.Redis(port=stack.redis_port, decode_responses=True)
    (key,) = client.scan_iter("llmgw:usage:{restart}:*")
    assert int(client.hget(key, "model-r:completion_tokens")) == 2 + 30 + 2


def test_many_requests_ending_while_the_sidecar_is_away_are_metered_once_it_is_back(stack):
    # More than Envoy's retry buffer holds: the journal gives the restarted sidecar the rest.
    outage_while_streams_end(stack, MANY_STREAMS)
    assert wait_for(lambda: records(stack) == 2 + MANY_STREAMS, timeout=10), (records(stack), access_log_stats(stack))
    client = redis.Redis(port=stack.redis_port, decode_responses=True)
    (key,) = client.scan_iter("llmgw:usage:{restart}:*")
    # Each once: 2 + 2 tokens of the two short requests and 30 of each stream, no more.
    assert int(client.hget(key, "model-r:completion_tokens")) == 2 + 2 + 30 * MANY_STREAMS
    events = landed_events(redis.Redis(port=stack.redis_port), "restart", 2 + MANY_STREAMS)
    ids = [e["record_id"] for e in events]
    assert len(ids) == len(set(ids)) == 2 + MANY_STREAMS, ids


def test_sigterm_lets_draining_streams_deliver_their_usage_then_exits(tmp_path):
    """A rollout: the sidecar gets SIGTERM while Envoy still drains a stream. It accepts no new
    connection, keeps Envoy's access-log stream open for `shutdown_grace_ms`, records the stream
    that ends meanwhile, and exits once the grace is over (Envoy never closes that stream)."""
    grace_s = 6
    pools = [Pool("pool_r", ["model-r"], SLOW)]
    tenants = [Tenant("restart", [KEY], {"requests_per_minute": 1000})]
    with Stack(tmp_path, pools, [Model("model-r", "pool_r")], tenants,
               sidecar_overrides={"shutdown_grace_ms": grace_s * 1000}) as stack:
        assert post(stack, "/v1/chat/completions", chat_body("model-r", max_tokens=2), key=KEY).status_code == 200
        assert wait_for(lambda: records(stack) == 1), access_log_stats(stack)
        out: dict = {}
        streaming = threading.Thread(target=stream_to_end, args=(stack, out))
        streaming.start()
        assert wait_for(lambda: envoy_counter(stack, "cluster.pool_r.upstream_rq_active") == 1, timeout=5)
        (sidecar,) = [p for p in stack.procs if p.name == "sidecar"]
        started = time.monotonic()
        sidecar.popen.send_signal(signal.SIGTERM)
        streaming.join(timeout=30)
        assert out == {"status": 200, "lines": 32}, out
        # The stream ended during the grace: its usage arrives on the still-open log stream.
        assert wait_for(lambda: records(stack) == 2, timeout=grace_s), (records(stack), access_log_stats(stack))
        assert sidecar.popen.wait(timeout=grace_s + 10) == 0
        took = time.monotonic() - started
        assert grace_s - 1 <= took <= grace_s + 10, took
        assert "grace period over" in sidecar.log.read_text()
        client = redis.Redis(port=stack.redis_port, decode_responses=True)
        (key,) = client.scan_iter("llmgw:usage:{restart}:*")
        assert int(client.hget(key, "model-r:completion_tokens")) == 2 + 30
