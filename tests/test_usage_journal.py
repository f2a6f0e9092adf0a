"""The usage journal (ext-proc/src/metering/journal/, envoy/access_log_journal.yaml), through the real
Envoy, redis-server, sidecar and vllm-sim.

Envoy writes every access-log entry to a local file as well as to the gRPC access log; the sidecar
tails the file from a checkpoint in Redis and applies each entry through the same idempotent
ledger script. Checked here: the journal's lines carry what the gRPC entry carries (every record
the gRPC path made, the journal names alike); replaying the same entries twice (the checkpoint
wiped and the sidecar restarted, twice; the lines appended to the file a second time) changes
nothing: one record, one event and one settlement per request; and with two sidecars, one tails
at a time, and the other takes over from the checkpoint when the holder is killed.
"""

from __future__ import annotations

import json
import signal

import pytest
import redis
from helpers import chat_body, post, wait_for
from sidecar_checks import bucket, bucket_key, metric, sidecar_metrics, usage_events, usage_hash
from stack import Model, Pool, Stack, Tenant, new_api_key

KEY = new_api_key()
REQUESTS = 6
TENANT = "journal"
# A bucket that refills 1 token a minute: a second settlement would show.
LIMITS = {"requests_per_minute": 100000, "tokens_per_minute": 1, "token_burst": 1000000}
CHECKPOINT = "llmgw:journal-checkpoint:{%s}"
LEASE = "llmgw:journal-lease:{%s}"


@pytest.fixture
def stack(tmp_path):
    pools = [Pool("pool_j", ["model-j"], ["--output-tokens", "5"])]
    tenants = [Tenant(TENANT, [KEY], LIMITS)]
    with Stack(tmp_path, pools, [Model("model-j", "pool_j")], tenants,
               sidecar_overrides={"metrics_listen": "127.0.0.1:0"}) as s:
        yield s


def client(stack) -> redis.Redis:
    return redis.Redis(port=stack.redis_port, decode_responses=True)


def journal_lines(stack) -> list[dict]:
    text = stack.journal_path.read_text() if stack.journal_path.exists() else ""
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def checkpoint_offset(stack) -> int:
    return int(client(stack).hget(CHECKPOINT % stack.journal_path, "offset") or -1)


def settled(stack):
    """(requests, completion tokens, events, TPM bucket tokens) of the tenant."""
    c = client(stack)
    h = usage_hash(c, TENANT)
    raw = redis.Redis(port=stack.redis_port)
    return (h.get("model-j:requests", 0), h.get("model-j:completion_tokens", 0), len(usage_events(raw, TENANT)))


def tpm_tokens(stack) -> float:
    """The TPM bucket's tokens (it refills 1 a minute: a second settlement, 45 back per request
    reserved for 50 and using 5, would show)."""
    found = bucket(client(stack), bucket_key(TENANT, "tpm"))
    assert found, "no TPM bucket"
    return found[0]


def test_the_journal_replayed_twice_gives_one_record_each(stack):
    for _ in range(REQUESTS):
        assert post(stack, "/v1/chat/completions", chat_body("model-j", max_tokens=50), key=KEY).status_code == 200
    assert wait_for(lambda: settled(stack)[0] == REQUESTS, timeout=10), settled(stack)
    # Envoy flushes the journal about once a second; the sidecar has read it to its end.
    assert wait_for(lambda: len(journal_lines(stack)) == REQUESTS
                    and checkpoint_offset(stack) == stack.journal_path.stat().st_size, timeout=10), \
        (journal_lines(stack), checkpoint_offset(stack))
    lines = journal_lines(stack)
    facts = [json.loads(line["facts"]) for line in lines]
    # The same facts the gRPC entry carries: the filter's, admission's reservation, the usage.
    assert {f["tenant"] for f in facts} == {TENANT}
    assert all(line["metadata"]["admitted"] is True and line["metadata"]["reserved_tokens"] > 0 for line in lines)
    assert all(json.loads(line["usage"])["completion_tokens"] == 5 for line in lines)
    events = usage_events(redis.Redis(port=stack.redis_port), TENANT)
    assert sorted(e["record_id"] for e in events) == sorted(f"{f['request_id']}.{f['nonce']}" for f in facts)
    before = settled(stack)
    assert before == (REQUESTS, 5 * REQUESTS, REQUESTS), before
    tokens = tpm_tokens(stack)
    # Each record once, whichever delivery landed it first (the gRPC log usually, but both flush
    # about once a second, and on a busy machine the journal can win a race).
    text = sidecar_metrics(stack)
    assert metric(text, "llm_gateway_journal_lines_total") == REQUESTS
    # A line the gRPC path landed is not written again; one it had not (yet) goes to Redis.
    assert metric(text, "llm_gateway_journal_records_applied_total") \
        + metric(text, "llm_gateway_journal_lines_landed_total") <= REQUESTS, text

    for replay in range(2):
        # The checkpoint wiped and the sidecar restarted: it reads the whole journal again.
        stack.kill_sidecar()
        client(stack).delete(CHECKPOINT % stack.journal_path, LEASE % stack.journal_path)
        stack.restart_sidecar()
        assert wait_for(lambda: checkpoint_offset(stack) == stack.journal_path.stat().st_size, timeout=10), replay
        text = sidecar_metrics(stack)
        assert metric(text, "llm_gateway_journal_lines_total") == REQUESTS, text
        assert metric(text, "llm_gateway_journal_records_applied_total") == 0, text
        assert metric(text, "llm_gateway_journal_parse_errors_total") == 0, text
        # A restarted replica saw nothing land: every line went to Redis, which had them all.
        assert metric(text, "llm_gateway_journal_lines_landed_total") == 0, text
        assert settled(stack) == before, (replay, settled(stack), before)
        assert abs(tpm_tokens(stack) - tokens) < 2, (tpm_tokens(stack), tokens)

    # The same entries appended to the file again (a second copy of every line): read, applied
    # once each already, nothing changes.
    with stack.journal_path.open("a") as f:
        f.write("".join(json.dumps(line) + "\n" for line in lines))
    assert wait_for(lambda: metric(sidecar_metrics(stack), "llm_gateway_journal_lines_total") == 2 * REQUESTS,
                    timeout=10), sidecar_metrics(stack)
    assert wait_for(lambda: checkpoint_offset(stack) == stack.journal_path.stat().st_size, timeout=10)
    assert metric(sidecar_metrics(stack), "llm_gateway_journal_records_applied_total") == 0
    assert settled(stack) == before
    assert abs(tpm_tokens(stack) - tokens) < 2, (tpm_tokens(stack), tokens)


def test_the_journal_alone_records_what_the_grpc_path_never_delivered(tmp_path):
    """Envoy's gRPC access log pointed at a port nothing listens on: every record comes from the
    journal, once, with its settlement."""
    pools = [Pool("pool_j", ["model-j"], ["--output-tokens", "5"])]
    tenants = [Tenant(TENANT, [KEY], LIMITS)]

    class NoGrpcLog(Stack):
        def envoy_config(self) -> dict:
            bootstrap = super().envoy_config()
            hcm = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
            hcm["access_log"] = [log for log in hcm["access_log"] if log["name"] != "envoy.access_loggers.http_grpc"]
            return bootstrap

    with NoGrpcLog(tmp_path, pools, [Model("model-j", "pool_j")], tenants,
                   sidecar_overrides={"metrics_listen": "127.0.0.1:0"}) as s:
        for _ in range(REQUESTS):
            assert post(s, "/v1/chat/completions", chat_body("model-j", max_tokens=50), key=KEY).status_code == 200
        assert wait_for(lambda: settled(s) == (REQUESTS, 5 * REQUESTS, REQUESTS), timeout=10), settled(s)
        assert metric(sidecar_metrics(s), "llm_gateway_journal_records_applied_total") == REQUESTS
        assert metric(sidecar_metrics(s), "llm_gateway_usage_records_written_total") == 0


class TwoTailers(Stack):
    """A second sidecar (same config, same Redis, same journal) that Envoy does not call."""

    second = None

    def _start_sidecar(self, listen_port: int | None = None) -> None:
        super()._start_sidecar(listen_port)
        if self.second is None:
            self.second, _ = self.start_second_sidecar()


def test_one_replica_tails_and_another_takes_over_when_it_dies(tmp_path):
    pools = [Pool("pool_j", ["model-j"], ["--output-tokens", "5"])]
    tenants = [Tenant(TENANT, [KEY], LIMITS)]
    with TwoTailers(tmp_path, pools, [Model("model-j", "pool_j")], tenants,
                    sidecar_overrides={"metering": {"journal": {"lease_ms": 1000, "poll_interval_ms": 100}}}) as s:
        c = client(s)
        assert wait_for(lambda: c.get(LEASE % s.journal_path) is not None, timeout=10)
        holder_pid = int(c.get(LEASE % s.journal_path).split("-")[0])
        (first,) = [p for p in s.procs if p.name == "sidecar"]
        assert holder_pid in (first.popen.pid, s.second.popen.pid)
        for _ in range(REQUESTS):
            assert post(s, "/v1/chat/completions", chat_body("model-j", max_tokens=50), key=KEY).status_code == 200
        assert wait_for(lambda: checkpoint_offset(s) == s.journal_path.stat().st_size > 0, timeout=10)
        # The holder dies; the other replica takes the lease once it expires.
        holder = first if holder_pid == first.popen.pid else s.second
        holder.popen.send_signal(signal.SIGKILL)
        holder.popen.wait(timeout=5)
        s.procs.remove(holder)
        other = s.second if holder is first else first
        assert wait_for(lambda: c.get(LEASE % s.journal_path) is not None
                        and int(c.get(LEASE % s.journal_path).split("-")[0]) == other.popen.pid, timeout=10)
        if holder is first:
            s.restart_sidecar()  # Envoy's admission needs its sidecar back
        for _ in range(REQUESTS):
            assert post(s, "/v1/chat/completions", chat_body("model-j", max_tokens=50), key=KEY).status_code == 200
        assert wait_for(lambda: checkpoint_offset(s) == s.journal_path.stat().st_size, timeout=10)
        assert wait_for(lambda: settled(s) == (2 * REQUESTS, 10 * REQUESTS, 2 * REQUESTS), timeout=10), settled(s)
