"""Admission leases, end to end (real Envoy, wasm filter, sidecar, redis-server, vllm-sim).

With the filter's `admission_leases` and the sidecar's `redis.lease_fraction`, each Envoy worker's
filter VM takes a lease of requests and tokens from the tenant's Redis buckets through the sidecar
(proto/llm_gateway/v1/lease.proto) and admits the tenant's next requests itself: Envoy's matcher
(envoy/filters/admission_lease_matcher.yaml) skips the ext_proc admission for them, so they cost no
gRPC round trip. They are still metered (access log) and their reservations settled, leases never
over-admit and are given back, a tenant whose limit is too tight for a lease is decided request by
request, and a pool near shedding gets no leases.

Envoy runs one worker here, so that one VM holds the leases and the counts are exact. Every test
runs twice: with the wasm filter, and with the same filter as an Envoy dynamic module
(filter-native/, whose leases are one table per configuration, driven from Envoy's main thread).
"""

from __future__ import annotations

import contextlib
import time

import pytest
import redis

from helpers import assert_openai_error, auth, chat_body, envoy_counter, post, wait_for
from sidecar_checks import (END_UNREPORTED, SOURCE_RESERVATION, bucket, bucket_key, landed_events, metric,
                            open_stream, sidecar_metrics, usage_events, usage_hash)
from stack import FILTER_NATIVE, Model, Pool, Stack, Tenant, new_api_key, upstream_metric

pytestmark = pytest.mark.parametrize("native", [False, True], ids=["wasm", "native"])

EXT_PROC_STREAMS = "http.gateway.ext_proc.streams_started"
# The composite filter that makes the ext_proc admission for requests not admitted from a lease.
DELEGATED = "http.gateway.composite.filter_delegation_success"
DELEGATION_ERRORS = "http.gateway.composite.filter_delegation_error"


def leases(stack, outcome: str) -> float:
    return metric(sidecar_metrics(stack), "llm_gateway_admission_leases_total", outcome=outcome)


def leased_stack(tmp, tenants, lease_ttl_ms: int, pools=None, models=None, extra: dict | None = None,
                 native: bool = False) -> Stack:
    overrides = {"redis": {"lease_fraction": 0.01, "lease_ttl_ms": lease_ttl_ms}, "metrics_listen": "127.0.0.1:0"}
    overrides.update(extra or {})
    return Stack(tmp, pools or [Pool("pool_l", ["sim/l"], ["--output-tokens", "2"])],
                 models or [Model("l", "pool_l", served_model_name="sim/l")], tenants,
                 sidecar_overrides=overrides, admission_leases=True, envoy_concurrency=1,
                 native_module=FILTER_NATIVE if native else None)


def test_leased_requests_skip_the_ext_proc_admission_and_are_metered(tmp_path_factory, native):
    """The first request goes through the ext_proc admission and makes the filter ask for a lease;
    the next ones are admitted from the lease (no ext_proc stream), carry the lease's
    `x-ratelimit-*` headers, and each is recorded once."""
    key = new_api_key()
    # 1 % of a burst of 10,000 requests and 1,000,000 tokens: a lease of 100 requests and 10,000
    # tokens, held 30 s (no renewal during the test).
    tenant = Tenant("al-skip", [key], {"requests_per_minute": 600, "request_burst": 10_000,
                                       "tokens_per_minute": 600, "token_burst": 1_000_000})
    with leased_stack(tmp_path_factory.mktemp("al-skip"), [tenant], lease_ttl_ms=30_000, native=native) as s:
        first = post(s, "/v1/chat/completions", chat_body("l", max_tokens=10), key=key)
        assert first.status_code == 200, first.text
        assert envoy_counter(s, EXT_PROC_STREAMS) == 1
        assert wait_for(lambda: leases(s, "granted") == 1, timeout=10), sidecar_metrics(s)
        seen = []
        for _ in range(20):
            r = post(s, "/v1/chat/completions", chat_body("l", max_tokens=10), key=key)
            assert r.status_code == 200, r.text
            assert r.headers["x-ratelimit-limit-requests"] == "600"
            assert r.headers["x-ratelimit-limit-tokens"] == "600"
            seen.append(int(r.headers["x-ratelimit-remaining-requests"]))
            assert 0 < seen[-1] <= 10_000
            assert r.headers["x-ratelimit-reset-requests"].endswith("s")
        # No request after the first reached the sidecar's admission, nor had an ext_proc filter
        # made for it (the composite filter makes one only when the lease matcher does not skip).
        assert envoy_counter(s, EXT_PROC_STREAMS) == 1, s.envoy_log()
        assert (envoy_counter(s, DELEGATED), envoy_counter(s, DELEGATION_ERRORS)) == (1, 0)
        # The remaining count went down one by one while the lease admitted. (Not compared with
        # the first request's: the lease's take can land in Redis before that request's own, and
        # a leased count includes what the lease has not used yet.)
        assert seen == [seen[0] - i for i in range(20)], seen
        client = redis.Redis(port=s.redis_port)
        assert wait_for(lambda: usage_hash(client, "al-skip").get("l:requests") == 21, timeout=10), \
            usage_hash(client, "al-skip")
        assert usage_hash(client, "al-skip")["l:completion_tokens"] == 21 * 2
        assert metric(sidecar_metrics(s), "llm_gateway_requests_total", tenant="al-skip", outcome="admitted") == 1


def test_leases_are_given_back_and_only_the_usage_is_charged(tmp_path_factory, native):
    """Once the requests stop, the lease's rest goes back to Redis and each leased reservation is
    settled to the request's real usage: the buckets end where the requests alone put them."""
    key = new_api_key()
    # Refill of one request and one token per second: small next to what the test measures.
    tenant = Tenant("al-back", [key], {"requests_per_minute": 60, "request_burst": 10_000,
                                       "tokens_per_minute": 60, "token_burst": 1_000_000})
    with leased_stack(tmp_path_factory.mktemp("al-back"), [tenant], lease_ttl_ms=1000, native=native) as s:
        client = redis.Redis(port=s.redis_port)
        started = time.monotonic()
        for _ in range(12):
            r = post(s, "/v1/chat/completions", chat_body("l", max_tokens=50), key=key)
            assert r.status_code == 200, r.text
        assert wait_for(lambda: usage_hash(client, "al-back").get("l:requests") == 12, timeout=10)
        usage = usage_hash(client, "al-back")
        used = usage["l:prompt_tokens"] + usage["l:completion_tokens"]
        # Leased: 100 requests and 10,000 tokens, each reservation prompt + 50: far over the usage.
        assert leases(s, "granted") >= 1, sidecar_metrics(s)

        def back() -> bool:
            rpm, tpm = bucket(client, bucket_key("al-back", "rpm")), bucket(client, bucket_key("al-back", "tpm"))
            slack = time.monotonic() - started + 2  # the refill since the first request, and rounding
            return rpm is not None and tpm is not None and 10_000 - 12 - 1 <= rpm[0] <= 10_000 - 12 + slack \
                and 1_000_000 - used - 1 <= tpm[0] <= 1_000_000 - used + slack

        assert wait_for(back, timeout=15), (bucket(client, bucket_key("al-back", "rpm")),
                                            bucket(client, bucket_key("al-back", "tpm")), used, sidecar_metrics(s))
        assert leases(s, "given_back") >= 1


def test_a_lease_whose_vm_went_away_is_reclaimed_within_a_ttl(tmp_path_factory, native):
    """Envoy is killed holding a lease (its VM gone, the lease never given back) while a leased
    stream is in flight: a sidecar sweep reclaims the lease after 1.5 TTL, not before its expiry,
    and the buckets end where the finished requests' usage puts them, plus the reservation of the
    stream that never finished, which the filter had reported (issue 14 item 4, issue 18). The
    longest stream lifetime after the reclaim, that reservation is charged as usage too: the usage
    hash, one usage event, the metric; the buckets do not move again."""
    key = new_api_key()
    # Long enough that a busy machine still kills Envoy before the lease's expiry (the records of
    # the five requests and two reports must land first).
    ttl_ms = 20_000
    # Refilled 1 a minute, so that the one request and the tokens the killed stream keeps charged
    # stand out of the refill.
    tenant = Tenant("al-orphan", [key], {"requests_per_minute": 1, "request_burst": 10_000,
                                         "tokens_per_minute": 1, "token_burst": 1_000_000})
    # 200 ms between tokens: the short requests (2 tokens) end at once, the stream (50) runs 10 s,
    # still in flight when Envoy is killed on a busy machine.
    pools = [Pool("pool_l", ["sim/l"], ["--output-tokens", "60", "--itl-ms", "200"])]
    # The longest stream lifetime, after which the reclaimed lease's unfinished reported stream is
    # charged: 5 s (the first request, admitted exactly, ends long before).
    record_after_ms = 5_000
    extra = {"metering": {"reservations": {"record_after_ms": record_after_ms, "sweep_interval_ms": 200}}}
    with leased_stack(tmp_path_factory.mktemp("al-orphan"), [tenant], lease_ttl_ms=ttl_ms, pools=pools,
                      native=native, extra=extra) as s:
        client = redis.Redis(port=s.redis_port, decode_responses=True)
        first = post(s, "/v1/chat/completions", chat_body("l", max_tokens=2), key=key)
        assert first.status_code == 200, first.text
        assert wait_for(lambda: leases(s, "granted") == 1, timeout=10), sidecar_metrics(s)
        granted_at = time.monotonic()
        for _ in range(4):
            r = post(s, "/v1/chat/completions", chat_body("l", max_tokens=2), key=key)
            assert r.status_code == 200, r.text
        assert envoy_counter(s, EXT_PROC_STREAMS) == 1, "the four were leased"
        assert wait_for(lambda: usage_hash(client, "al-orphan").get("l:requests") == 5, timeout=10)
        usage = usage_hash(client, "al-orphan")
        used = usage["l:prompt_tokens"] + usage["l:completion_tokens"]
        [lease_id] = client.hkeys("llmgw:leases:{al-orphan}")
        lease_used = "llmgw:leases-used:{al-orphan}"
        # The filter reports its four admissions on its next tick.
        assert wait_for(lambda: client.hget(lease_used, f"{lease_id}:a") == "4", timeout=15), \
            client.hgetall(lease_used)
        reserved_4 = int(client.hget(lease_used, f"{lease_id}:at"))
        prompt_4 = int(client.hget(lease_used, f"{lease_id}:ap"))
        stream_client, stream = open_stream(s.base_url, chat_body("l", max_tokens=50, stream=True), auth(key))
        try:
            assert stream.status_code == 200
            assert envoy_counter(s, EXT_PROC_STREAMS) == 1, "the stream was leased"
            assert wait_for(lambda: client.hget(lease_used, f"{lease_id}:a") == "5", timeout=8), \
                client.hgetall(lease_used)
            stream_reserved = int(client.hget(lease_used, f"{lease_id}:at")) - reserved_4
            stream_prompt = int(client.hget(lease_used, f"{lease_id}:ap")) - prompt_4
            assert stream_reserved >= 50, stream_reserved
            assert 0 < stream_prompt == stream_reserved - 50, (stream_prompt, stream_reserved)
            # The VM holds the lease (100 requests, 10,000 tokens) and goes away with Envoy,
            # the stream with it: its usage never arrives.
            s.envoy.popen.kill()
            s.envoy.popen.wait(timeout=5)
        finally:
            stream.close()
            stream_client.close()
        killed_at = time.monotonic()
        assert killed_at - granted_at < ttl_ms / 1000, "killed before the lease's expiry"
        rpm_key, tpm_key = bucket_key("al-orphan", "rpm"), bucket_key("al-orphan", "tpm")
        held = bucket(client, rpm_key)
        assert held is not None and held[0] <= 10_000 - 100, held
        charged = (6, used + stream_reserved)

        def back() -> bool:
            rpm, tpm = bucket(client, rpm_key), bucket(client, tpm_key)
            slack = (time.monotonic() - granted_at) / 60 + 1  # refill since the grant, and rounding
            return rpm is not None and tpm is not None \
                and 10_000 - charged[0] - 1 <= rpm[0] <= 10_000 - charged[0] + slack \
                and 1_000_000 - charged[1] - 1 <= tpm[0] <= 1_000_000 - charged[1] + slack

        # Reclaimed 1.5 TTL after the grant by a sweep every half TTL: by 2 TTL (plus the calls).
        assert wait_for(back, timeout=2 * ttl_ms / 1000 + 5), (bucket(client, rpm_key), bucket(client, tpm_key),
                                                               charged, sidecar_metrics(s))
        assert time.monotonic() - granted_at >= 1.5 * ttl_ms / 1000 - 0.5, "not reclaimed before 1.5 TTL"
        assert metric(sidecar_metrics(s), "llm_gateway_admission_leases_reclaimed_total") == 1
        assert client.hlen("llmgw:leases:{al-orphan}") == 0
        reclaimed, charged_set = "llmgw:leases-reclaimed:{al-orphan}", "llmgw:leases-charged:{al-orphan}"
        assert client.zcard(reclaimed) + client.zcard(charged_set) == 1
        assert leases(s, "reported") >= 2, sidecar_metrics(s)

        # The stream's usage never arrives: record_after_ms after the reclaim (and within the next
        # sweep, every half TTL), its reservation is charged as usage: its prompt estimate as prompt
        # tokens, its max_tokens as completion tokens.
        assert wait_for(lambda: usage_hash(client, "al-orphan").get("l:requests") == 6,
                        timeout=record_after_ms / 1000 + ttl_ms / 2000 + 15), \
            (usage_hash(client, "al-orphan"), sidecar_metrics(s))
        after = usage_hash(client, "al-orphan")
        assert after["l:prompt_tokens"] == usage["l:prompt_tokens"] + stream_prompt
        assert after["l:completion_tokens"] == usage["l:completion_tokens"] + 50
        raw = redis.Redis(port=s.redis_port)
        [event] = landed_events(raw, "al-orphan", 1, record_id=f"lease.{lease_id}")
        assert (event["requests"], event["prompt_tokens"], event["completion_tokens"], event["reserved_tokens"],
                event["end_reason"], event["usage_source"], event["model"]) == \
            (1, stream_prompt, 50, stream_reserved, END_UNREPORTED, SOURCE_RESERVATION, "l")
        assert metric(sidecar_metrics(s), "llm_gateway_admission_lease_requests_charged_total") == 1
        assert (client.zcard(reclaimed), client.zcard(charged_set)) == (0, 1)
        assert client.hgetall(lease_used) == {f"{lease_id}:a": "5"}, "kept for a late record"
        assert back(), "the charge moves no bucket"
        assert len(usage_events(raw, "al-orphan")) == 6, "five records and the lease's charge"


def test_leased_streams_join_the_pools_in_flight_count_within_a_tick(tmp_path_factory, native):
    """The filter's report on its next tick carries the requests admitted from its lease, so the
    pool's in-flight count (what shedding and flow control read) counts leased streams within a
    tick, not at the lease's renewal (30 s here), and their ends take them off again."""
    key = new_api_key()
    tenant = Tenant("al-inflight", [key], {"requests_per_minute": 600, "request_burst": 10_000,
                                           "tokens_per_minute": 600, "token_burst": 1_000_000})
    # A pool the sidecar tracks (shedding far away; leased because it says so), scraped every
    # 100 ms; 400 ms between tokens.
    pools = [Pool("pool_l", ["sim/l"], ["--output-tokens", "60", "--itl-ms", "400"],
                  shedding={"max_queue_depth": 1000, "scrape_interval_ms": 100, "admission_leases": True})]
    with leased_stack(tmp_path_factory.mktemp("al-inflight"), [tenant], lease_ttl_ms=30_000, pools=pools,
                      native=native) as s:
        def in_flight() -> float:
            return metric(sidecar_metrics(s), "llm_gateway_in_flight_requests", pool="pool_l")

        first = post(s, "/v1/chat/completions", chat_body("l", max_tokens=2), key=key)
        assert first.status_code == 200, first.text
        assert wait_for(lambda: leases(s, "granted") == 1, timeout=10), sidecar_metrics(s)
        assert wait_for(lambda: in_flight() == 0, timeout=5), in_flight()
        streams = []
        try:
            for _ in range(3):
                streams.append(open_stream(s.base_url, chat_body("l", max_tokens=50, stream=True), auth(key)))
                assert streams[-1][1].status_code == 200
            assert envoy_counter(s, EXT_PROC_STREAMS) == 1, "the three were leased"
            # Three 20 s streams: counted before they end, and before the lease renews (30 s).
            assert wait_for(lambda: in_flight() == 3, timeout=15), (in_flight(), sidecar_metrics(s))
            assert leases(s, "granted") == 1, "no lease call since the grant: the report carried them"
        finally:
            for client, response in streams:
                response.close()
                client.close()
        assert wait_for(lambda: in_flight() == 0, timeout=10), in_flight()


def test_a_tight_limit_gets_no_lease_and_stays_exact(tmp_path_factory, native):
    """5 requests per minute: 1 % is no lease, so every request is decided by the ext_proc
    admission and the sixth is refused, also when the client claims a leased admission."""
    key = new_api_key()
    tenant = Tenant("al-tight", [key], {"requests_per_minute": 5})
    with leased_stack(tmp_path_factory.mktemp("al-tight"), [tenant], lease_ttl_ms=1000, native=native) as s:
        for i in range(5):
            r = post(s, "/v1/chat/completions", chat_body("l", max_tokens=2), key=key)
            assert r.status_code == 200, (i, r.text)
            assert r.headers["x-ratelimit-remaining-requests"] == str(4 - i)
            if i == 0:
                assert wait_for(lambda: leases(s, "too_tight") >= 1, timeout=10), sidecar_metrics(s)
        spoofed = {"x-gateway-admission": "lease", "x-gateway-reserved-tokens": "0"}
        r = post(s, "/v1/chat/completions", chat_body("l", max_tokens=2), key=key, headers=spoofed)
        assert_openai_error(r, 429, code="rate_limit_exceeded")
        assert envoy_counter(s, EXT_PROC_STREAMS) == 6
        # Each ran the ext_proc admission made by the composite filter for it.
        assert (envoy_counter(s, DELEGATED), envoy_counter(s, DELEGATION_ERRORS)) == (6, 0)
        assert leases(s, "granted") == 0


def test_a_pool_near_shedding_gets_no_lease(tmp_path_factory, native):
    """While the pool's queue is at the lowest tier's shedding level, no lease is granted for it:
    a batch request goes to the ext_proc admission and is shed, and stays shed."""
    keys = {"al-filler": new_api_key(), "al-batch": new_api_key()}
    tenants = [Tenant("al-filler", [keys["al-filler"]], {"requests_per_minute": 10_000}, tier="premium"),
               Tenant("al-batch", [keys["al-batch"]], {"requests_per_minute": 10_000}, tier="batch")]
    pools = [Pool("pool_shed", ["sim/shed"],
                  ["--max-num-seqs", "1", "--ttft-ms", "20", "--itl-ms", "100", "--output-tokens", "50"],
                  shedding={"max_queue_depth": 4, "scrape_interval_ms": 100, "admission_leases": True})]
    models = [Model("shed", "pool_shed", served_model_name="sim/shed")]
    extra = {"shedding": {"tier_levels": {"batch": 0.5}}}
    with leased_stack(tmp_path_factory.mktemp("al-shed"), tenants, lease_ttl_ms=1000, pools=pools,
                      models=models, extra=extra, native=native) as s:
        sim = s.pool("pool_shed").urls[0]
        body = chat_body("shed", "hold the queue", stream=True, max_tokens=50)
        with contextlib.ExitStack() as held:
            # One running, two waiting: the pool's load is 0.5, batch's shedding level.
            for _ in range(3):
                client, response = open_stream(s.base_url, body, auth(keys["al-filler"]))
                held.callback(client.close)
                held.callback(response.close)
                assert response.status_code == 200
            assert wait_for(lambda: upstream_metric(sim, "vllm:num_requests_waiting") == 2 and metric(
                sidecar_metrics(s), "llm_gateway_pool_requests_waiting", pool="pool_shed") == 2, timeout=10)
            refused = leases(s, "shedding")
            for _ in range(2):
                r = post(s, "/v1/chat/completions", chat_body("shed", max_tokens=2), key=keys["al-batch"])
                assert_openai_error(r, 429, code="overloaded")
                # The miss asked for a lease for the batch tenant: refused while the pool is loaded.
                assert wait_for(lambda: leases(s, "shedding") > refused, timeout=10), sidecar_metrics(s)
                refused = leases(s, "shedding")
        assert metric(sidecar_metrics(s), "llm_gateway_shed_total", pool="pool_shed", tier="batch") == 2


def test_a_shed_pool_is_leased_only_within_its_headroom(tmp_path_factory, native):
    """A pool the sidecar sheds by its load (`max_in_flight: 4`) is leased by default, but a lease
    covers at most half of the pool's headroom beside the other leases of it, and the requests a
    lease may still admit count as in flight for the ext_proc admission's shedding: six streams
    held open get four 200s and two 429s `overloaded`, whichever of them the leases admitted, and
    vLLM never holds more than four (the tenant's limit alone would lease 100 requests)."""
    key = new_api_key()
    tenant = Tenant("al-headroom", [key], {"requests_per_minute": 10_000, "tokens_per_minute": 1_000_000})
    pools = [Pool("pool_l", ["sim/l"], ["--output-tokens", "60", "--itl-ms", "400"],
                  shedding={"max_in_flight": 4, "scrape_interval_ms": 100})]
    with leased_stack(tmp_path_factory.mktemp("al-headroom"), [tenant], lease_ttl_ms=30_000, pools=pools,
                      native=native) as s:
        sim = s.pool("pool_l").urls[0]

        def in_flight() -> float:
            return metric(sidecar_metrics(s), "llm_gateway_in_flight_requests", pool="pool_l")

        first = post(s, "/v1/chat/completions", chat_body("l", max_tokens=1), key=key)
        assert first.status_code == 200, first.text
        assert wait_for(lambda: leases(s, "granted") >= 1, timeout=10), sidecar_metrics(s)
        assert wait_for(lambda: in_flight() == 0, timeout=10), in_flight()
        statuses = []
        with contextlib.ExitStack() as held:
            for _ in range(6):
                client, response = open_stream(s.base_url, chat_body("l", max_tokens=50, stream=True), auth(key))
                held.callback(client.close)
                held.callback(response.close)
                statuses.append(response.status_code)
                if response.status_code != 200:
                    response.read()
                    assert_openai_error(response, 429, code="overloaded")
            assert sorted(statuses) == [200] * 4 + [429] * 2, statuses
            assert envoy_counter(s, EXT_PROC_STREAMS) < 7, "a lease admitted some of them"
            assert wait_for(lambda: upstream_metric(sim, "vllm:num_requests_running")
                            + upstream_metric(sim, "vllm:num_requests_waiting") == 4, timeout=10)
            assert wait_for(lambda: in_flight() == 4, timeout=10), in_flight()
        assert metric(sidecar_metrics(s), "llm_gateway_shed_total", pool="pool_l", tier="standard") == 2


def test_a_shed_pool_that_says_no_is_not_leased(tmp_path_factory, native):
    """A pool the sidecar sheds by its load with `admission_leases: false` gets no lease however
    large the tenant's limit: each of its requests is decided by the ext_proc admission."""
    key = new_api_key()
    tenant = Tenant("al-protected", [key], {"requests_per_minute": 10_000, "tokens_per_minute": 1_000_000})
    pools = [Pool("pool_l", ["sim/l"], ["--output-tokens", "2"],
                  shedding={"max_queue_depth": 1000, "scrape_interval_ms": 100, "admission_leases": False})]
    with leased_stack(tmp_path_factory.mktemp("al-protected"), [tenant], lease_ttl_ms=1000, pools=pools,
                      native=native) as s:
        first = post(s, "/v1/chat/completions", chat_body("l", max_tokens=2), key=key)
        assert first.status_code == 200, first.text
        assert wait_for(lambda: leases(s, "load_protected") >= 1, timeout=10), sidecar_metrics(s)
        for _ in range(5):
            r = post(s, "/v1/chat/completions", chat_body("l", max_tokens=2), key=key)
            assert r.status_code == 200, r.text
        assert envoy_counter(s, EXT_PROC_STREAMS) == 6, "every request took the ext_proc admission"
        assert leases(s, "granted") == 0
