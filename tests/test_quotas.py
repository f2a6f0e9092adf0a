"""Daily token quotas and costs (issue 14 item 5) against the real stack: Envoy, the wasm filter,
the sidecar, redis-server and vllm-sim.

The sidecar's quota clock is moved with its test-only offset file
(`LLM_GATEWAY_TEST_CLOCK_OFFSET_FILE`, ext-proc/src/admission/quota.rs): the day rolls over when the test
writes one more day into it, without waiting for midnight. Checks that
- requests are admitted while the day's counter is under the hard limit, carry
  `x-gateway-quota-warning` exactly when the counter with their reservation reaches the soft limit,
  and the first request that finds the counter at the hard limit gets 429 `insufficient_quota`
  (type and code, not `rate_limit_exceeded`) with a Retry-After until the next UTC midnight;
- the counter is corrected to the tokens used once each record lands (reservation - usage);
- the next day (clock + 1 day) the quota is fresh: admitted again, no warning;
- every usage event's cost is tokens x price exactly, and the daily hash sums it per day;
- `gatewayctl usage` (table, JSON, CSV) agrees with the usage stream, per model and day.
"""

from __future__ import annotations

import csv
import datetime
import io
import json
import subprocess
from pathlib import Path

import pytest
import redis

from helpers import chat_body, post, wait_for
from sidecar_checks import usage_events
from stack import TARGET, Model, Pool, Stack, Tenant, new_api_key

KEY = new_api_key()
TENANT = "quota-tenant"
SOFT, HARD = 150, 300
OUTPUT_TOKENS = 20
# USD per 1M tokens; nano-dollars per token = price x 1000.
PRICES = {"m1": {"input": 0.15, "cached_input": 0.075, "output": 0.6}}
NANO = {"input": 150, "cached_input": 75, "output": 600}
GATEWAYCTL = TARGET / "release" / "gatewayctl"


class QuotaStack(Stack):
    def sidecar_config(self) -> dict:
        config = super().sidecar_config()
        for t in config["tenants"]:
            if t["id"] == TENANT:
                t["quota"] = {"tokens_per_day": HARD, "soft_tokens_per_day": SOFT,
                              "tokens_per_month": 1_000_000}
        config["prices"] = PRICES
        return config


@pytest.fixture(scope="module")
def clock_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("clock") / "offset"
    path.write_text("0\n")
    return path


@pytest.fixture(scope="module")
def stack(tmp_path_factory, clock_file):
    mp = pytest.MonkeyPatch()
    mp.setenv("LLM_GATEWAY_TEST_CLOCK_OFFSET_FILE", str(clock_file))
    pools = [Pool("pool_q", ["sim/q"], ["--output-tokens", str(OUTPUT_TOKENS)])]
    models = [Model("m1", "pool_q", served_model_name="sim/q")]
    # A TPM limit far away, so that each event carries its reservation (reserved_tokens).
    tenants = [Tenant(TENANT, [KEY], {"tokens_per_minute": 1_000_000_000})]
    try:
        with QuotaStack(tmp_path_factory.mktemp("quotas"), pools, models, tenants) as s:
            yield s
    finally:
        mp.undo()


def day_of(ms: int) -> str:
    return datetime.datetime.fromtimestamp(ms / 1000, datetime.UTC).strftime("%Y-%m-%d")


def counter(client, day: str) -> int:
    return int(client.get(f"llmgw:quota:{{{TENANT}}}:day:{day}") or 0)


def events_of(stack) -> list[dict]:
    return usage_events(redis.Redis(port=stack.redis_port), TENANT)


def landed(stack, n: int) -> list[dict]:
    """The tenant's events once n have landed (each record is applied with its counter update)."""
    assert wait_for(lambda: len(events_of(stack)) >= n, timeout=15), events_of(stack)
    events = events_of(stack)
    assert len(events) == n, events
    return events


def test_soft_then_hard_then_the_day_rolls_over(stack, clock_file):
    client = redis.Redis(port=stack.redis_port, decode_responses=True)
    today = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    seen = 0
    outcomes = []
    for i in range(30):
        before = counter(client, today)
        events_before = seen
        r = post(stack, "/v1/chat/completions", chat_body("m1", f"request {i}", max_tokens=OUTPUT_TOKENS), key=KEY)
        if before >= HARD:
            assert r.status_code == 429, (i, before, r.status_code, r.text)
            error = r.json()["error"]
            assert (error["type"], error["code"]) == ("insufficient_quota", "insufficient_quota"), error
            midnight = datetime.datetime.fromisoformat(today).replace(tzinfo=datetime.UTC) + datetime.timedelta(days=1)
            left = (midnight - datetime.datetime.now(datetime.UTC)).total_seconds()
            assert abs(int(r.headers["retry-after"]) - left) <= 5, (r.headers, left)
            assert "x-gateway-quota-warning" not in r.headers
            # A refusal charges nothing.
            assert counter(client, today) == before
            outcomes.append("hard")
            break
        assert r.status_code == 200, (i, before, r.status_code, r.text)
        seen += 1
        event = landed(stack, seen)[-1]
        reservation = event["reserved_tokens"]
        assert reservation > 0, event
        warning = r.headers.get("x-gateway-quota-warning")
        if before + reservation >= SOFT:
            assert warning is not None, (i, before, reservation, dict(r.headers))
            parts = dict(p.strip().split("=", 1) for p in warning.split(";")[1:])
            assert warning.startswith("day;"), warning
            assert parts["scope"] == "tenant" and int(parts["used"]) == before + reservation, warning
            assert (int(parts["soft"]), int(parts["limit"])) == (SOFT, HARD), warning
            assert parts["reset"] == (datetime.date.fromisoformat(today) + datetime.timedelta(days=1)).isoformat() + "T00:00:00Z"
            outcomes.append("soft")
        else:
            assert warning is None, (i, before, reservation, warning)
            outcomes.append("ok")
        # Once the record landed the counter holds the tokens used, not the reservation.
        used = event["prompt_tokens"] + event["completion_tokens"]
        assert wait_for(lambda: counter(client, today) == before + used, timeout=5), \
            (counter(client, today), before, used, event)
        assert events_before + 1 == seen
    assert outcomes[0] == "ok" and "soft" in outcomes and outcomes[-1] == "hard", outcomes
    first_soft = outcomes.index("soft")
    assert all(o == "soft" for o in outcomes[first_soft:-1]), outcomes
    # The counter expires two days after its day (quota.rs DAY_MARGIN).
    ttl = client.ttl(f"llmgw:quota:{{{TENANT}}}:day:{today}")
    assert 86_400 < ttl <= 3 * 86_400, ttl

    # Tomorrow, on the sidecar's clock: a fresh daily quota.
    clock_file.write_text("86400\n")
    tomorrow = (datetime.date.fromisoformat(today) + datetime.timedelta(days=1)).isoformat()
    r = post(stack, "/v1/chat/completions", chat_body("m1", "a new day", max_tokens=OUTPUT_TOKENS), key=KEY)
    assert r.status_code == 200, r.text
    assert "x-gateway-quota-warning" not in r.headers, dict(r.headers)
    seen += 1
    event = landed(stack, seen)[-1]
    assert day_of(event["finished_at_unix_ms"]) == tomorrow, event
    assert counter(client, tomorrow) == event["prompt_tokens"] + event["completion_tokens"]
    # Yesterday's stays as it was, and refuses no more (its day is over).
    assert counter(client, today) >= HARD
    month = client.get(f"llmgw:quota:{{{TENANT}}}:month:{tomorrow[:7]}")
    assert month is not None


def test_cost_is_tokens_times_price_and_gatewayctl_usage_agrees(stack):
    client = redis.Redis(port=stack.redis_port, decode_responses=True)
    events = events_of(stack)
    assert len(events) >= 3, events
    per_day: dict[tuple[str, str], dict[str, int]] = {}
    for e in events:
        uncached = e["prompt_tokens"] - e["cached_tokens"]
        expected = uncached * NANO["input"] + e["cached_tokens"] * NANO["cached_input"] + e["completion_tokens"] * NANO["output"]
        assert e["cost_nano_usd"] == expected, e
        row = per_day.setdefault((day_of(e["finished_at_unix_ms"]), e["model"]), {
            "requests": 0, "prompt_tokens": 0, "cached_tokens": 0, "completion_tokens": 0, "cost_nano_usd": 0})
        row["requests"] += 1
        for k in ("prompt_tokens", "cached_tokens", "completion_tokens", "cost_nano_usd"):
            row[k] += e[k]
    assert len({day for day, _ in per_day}) == 2, per_day
    for (day, model), row in per_day.items():
        h = client.hgetall(f"llmgw:usage:{{{TENANT}}}:{day}")
        assert int(h[f"{model}:cost_nano_usd"]) == row["cost_nano_usd"], (h, row)
        assert int(h[f"{model}:requests"]) == row["requests"], (h, row)

    days = sorted({day for day, _ in per_day})
    base = [str(GATEWAYCTL), "usage", "--redis-url", f"redis://127.0.0.1:{stack.redis_port}/0",
            "--tenant", TENANT, "--from", days[0], "--to", days[-1]]
    out = subprocess.run([*base, "--format", "json"], capture_output=True, text=True, check=True).stdout
    rows = json.loads(out)
    got = {(r["day"], r["model"]): {k: r[k] for k in ("requests", "prompt_tokens", "cached_tokens",
                                                      "completion_tokens", "cost_nano_usd")} for r in rows}
    assert got == per_day, (got, per_day)
    for r in rows:
        assert r["tenant"] == TENANT
        nano = r["cost_nano_usd"]
        assert r["cost_usd"] == f"{nano // 10**9}.{nano % 10**9:09d}", r
    out = subprocess.run([*base, "--format", "csv", "--model", "m1"], capture_output=True, text=True, check=True).stdout
    csv_rows = list(csv.DictReader(io.StringIO(out)))
    assert {(r["day"], r["model"]): int(r["cost_nano_usd"]) for r in csv_rows} == \
        {k: v["cost_nano_usd"] for k, v in per_day.items()}
    table = subprocess.run(base, capture_output=True, text=True, check=True).stdout
    total = table.strip().splitlines()[-1].split()
    assert total[0] == "total" and int(total[-2]) == sum(v["cost_nano_usd"] for v in per_day.values()), table
    # An empty range or a bad date is refused with a message naming the option.
    bad = subprocess.run([*base[:-4], "--from", "2026-02-30", "--to", days[-1]], capture_output=True, text=True)
    assert bad.returncode == 2 and "--from" in bad.stderr, bad.stderr
