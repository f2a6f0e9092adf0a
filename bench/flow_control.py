"""Flow control against threshold shedding and no gateway (issue 13): one pool of simulated
replicas with a hard concurrency limit, the same offered load to each target, interleaved rounds,
medians.

The upstream: REPLICAS `vllm-sim` (fixed engine) with `--max-num-seqs` MAX_NUM_SEQS each: TTFT_MS
to the first token after a request leaves the sim's queue, then ITL_MS per token, OUTPUT_MIN to
OUTPUT_MAX output tokens (uniform; ignore_eos): each request holds a slot for SERVICE_S on
average, so the pool serves at most CAPACITY requests per second; beyond it the sims queue (FIFO,
like vLLM's scheduler at `--max-num-seqs`). The fixed engine does not slow down with a fuller
batch (the batched engine does); here the pool's limit is the slot count alone, the same for
every target. Where the feature cannot help: a request that arrives to a full pool waits for the
pool's next completion whatever the order (about SERVICE_S / SLOTS on average); fair queueing
makes it the next one, not an earlier one.

Targets (each with Envoy; the gateway ones with the wasm filter, the sidecar and redis-server):

    flow-control     the pool with `flow_control` and `max_in_flight` = the pool's slots: a request
                     that finds no room waits in the sidecar's queue (tiers, fair shares, budgets)
    flow-control-reserve
                     the same with `newcomer_reserve` NEWCOMER_RESERVE (fair scenario only): the queue
                     fills the pool to 95 %; a tenant with nothing queued, first in the fair order,
                     takes the rest at once instead of waiting for the next completion (it costs the
                     backlogged tenants up to that share of the pool)
    threshold        today's shedding as envoy/examples/gateway.yaml sets it: `max_queue_depth: 64`
                     (a count of requests waiting in vLLM), `tier_levels: {batch: BATCH_LEVEL}`
    threshold-tuned  the same with `max_queue_depth` = budget x CAPACITY: the count whose wait is the
                     tier's budget on this pool (what an operator who measured it would set)
    direct           bare Envoy (LEAST_REQUEST) in front of the sims: what clients get without the
                     gateway (requests queue in vLLM; the client gives up after TIMEOUT_S)

Scenarios (`--scenarios`):

    fair     two tenants of one tier, the heavy one offering 10x the light one's rate, together
             3x CAPACITY (Poisson, DURATION_S); the light tenant alone is the unloaded baseline
    small    fair on a pool of REPLICAS x SMALL_NUM_SEQS slots (the issue's CPU vLLM): the same count
             threshold (`max_queue_depth: 64`) is then several budgets of work; the goodput
             comparison where the example's threshold does not happen to fit the pool
    tiers    premium (0.2x CAPACITY) and batch (2.8x) under the same 3x overload; premium alone
             is the unloaded baseline
    burst    4x CAPACITY for 2 s, batch tier (budget BURST_BUDGET_S), nothing else
    memory   10,000 requests queued at once behind a pool held full: the sidecar's RSS and CPU per
             queued request (then SIGTERM answers them all)

Measures: TTFT per tenant, goodput (requests served with TTFT within max_queue_wait_ms + the
unloaded TTFT p99), Jain's index over the tenants' served tokens each divided by its max-min fair
share (the light tenant's demand, the rest of the capacity for the heavy one), 429s, timeouts,
the longest queue wait (the gateway's `x-gateway-queue-wait-ms`).

    .venv/bin/python bench/flow_control.py                  # all scenarios, 3 rounds (~35 min)
    .venv/bin/python bench/flow_control.py --quick          # smoke run; docs untouched
    .venv/bin/python bench/flow_control.py --scenarios fair --rounds 1 --no-docs

Results: target/bench-results/flow-control-<stamp>/ (summary.json, every gateway-bench report,
per-request JSONL and log) and, unless --quick/--no-docs, the section between the
`flow-control-benchmark` markers of docs/benchmarks.md with its chart
docs/benchmarks/flow-control.svg.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import random
import shlex
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from results_page import FLOW_BEGIN as BEGIN  # noqa: E402
from results_page import FLOW_END as END  # noqa: E402
from picker import cpu_seconds, display  # noqa: E402
from results_page import bar_chart_svg, fmt, md_table, ratio, replace_section  # noqa: E402
from stack import TARGET, Model, Pool, Stack, Tenant, new_api_key  # noqa: E402

BENCH_BIN = TARGET / "release" / "gateway-bench"
DOC = ROOT / "docs" / "benchmarks.md"
CHART = ROOT / "docs" / "benchmarks" / "flow-control.svg"
MODEL = "m"
POOL = "pool"
SEED = 11

# The upstream (see the module docs). A replica of a 7-8B model on one GPU with prompts of ~1-2k
# tokens: TTFT_MS of prefill, ITL_MS per output token, at most MAX_NUM_SEQS sequences; output
# lengths vary (uniform OUTPUT_MIN..OUTPUT_MAX) so that requests do not end in lockstep.
REPLICAS = 2
MAX_NUM_SEQS = 32
TTFT_MS = 250
ITL_MS = 15
OUTPUT_MIN, OUTPUT_MAX = 32, 96
INPUT_TOKENS = 64
SLOTS = REPLICAS * MAX_NUM_SEQS
# The `small` scenario's pool: the CPU vLLM (8 sequences at once) per replica, where the
# example's `max_queue_depth: 64` is several seconds of work, not one budget.
SMALL_NUM_SEQS = 8
SERVICE_S = (TTFT_MS + ((OUTPUT_MIN + OUTPUT_MAX) / 2 - 1) * ITL_MS) / 1000
CAPACITY = SLOTS / SERVICE_S  # requests/s


def num_seqs(scenario: str) -> int:
    """`--max-num-seqs` of each replica in `scenario`."""
    return SMALL_NUM_SEQS if scenario == "small" else MAX_NUM_SEQS


def slots(scenario: str) -> int:
    return REPLICAS * num_seqs(scenario)


def capacity(scenario: str) -> float:
    """Nominal requests/s of the pool in `scenario`."""
    return slots(scenario) / SERVICE_S

# The tiers' budgets (flow_control.tiers[].max_queue_wait_ms) and batch's share of the room.
BUDGET_S = {"premium": 1.0, "standard": 2.0, "batch": 2.0}
BURST_BUDGET_S = 10.0
BATCH_LEVEL = 0.75
# `flow_control.newcomer_reserve` of the `flow-control-reserve` target: 5 % of the room (3 of the 64
# slots) kept back from the queue for tenants with nothing queued.
NEWCOMER_RESERVE = 0.05
TIMEOUT_S = 30.0
# Arrivals per second of the memory scenario's requests (10,000 fill the queue in 20 s).
MEMORY_RATE = 500
# Today's shedding as envoy/examples/gateway.yaml configures it (a count of queued requests).
EXAMPLE_QUEUE_DEPTH = 64
VOCAB = ("time person year way day thing man world life hand part child eye woman place work week case "
         "point government company number group problem fact able bad best better big black certain clear").split()


@dataclass
class Settings:
    duration_s: float
    rounds: int
    memory_requests: int


FULL = Settings(duration_s=20.0, rounds=3, memory_requests=10_000)
QUICK = Settings(duration_s=5.0, rounds=1, memory_requests=500)


@dataclass
class Load:
    """One client: a tenant (its tier), Poisson at `rate` req/s, from `start_s` for `seconds`."""

    tenant: str
    tier: str
    rate: float
    seconds: float
    start_s: float = 0.0


def scenario_loads(scenario: str, s: Settings) -> tuple[list[Load], list[Load]]:
    """(the loaded run's clients, the unloaded baseline's)."""
    d = s.duration_s
    if scenario in ("fair", "small"):
        cap = capacity(scenario)
        light = Load("light", "standard", 3 * cap / 11, d)
        return [Load("heavy", "standard", 30 * cap / 11, d), light], [light]
    if scenario == "tiers":
        premium = Load("premium", "premium", 0.2 * CAPACITY, d)
        return [premium, Load("batch", "batch", 2.8 * CAPACITY, d)], [premium]
    if scenario == "burst":
        return [Load("burst", "batch", 4 * CAPACITY, 2.0)], []
    raise ValueError(scenario)


def sidecar_pool(target: str, scenario: str) -> dict | None:
    burst = scenario == "burst"
    if target.startswith("flow-control"):
        return {"scrape_interval_ms": 100, "max_in_flight": slots(scenario), "flow_control": {"max_queued": 20_000}}
    if target == "threshold":
        return {"scrape_interval_ms": 100, "max_queue_depth": EXAMPLE_QUEUE_DEPTH}
    if target == "threshold-tuned":
        budget = BURST_BUDGET_S if burst else BUDGET_S["standard"]
        return {"scrape_interval_ms": 100, "max_queue_depth": math.ceil(budget * capacity(scenario))}
    return None


def flow_config(burst: bool, reserve: float = 0.0) -> dict:
    budgets = {**BUDGET_S, **({"batch": BURST_BUDGET_S} if burst else {})}
    return {"tiers": [{"name": t, "max_queue_wait_ms": int(1000 * b),
                       **({"max_load": BATCH_LEVEL} if t == "batch" and not burst else {})}
                      for t, b in budgets.items()],
            **({"newcomer_reserve": reserve} if reserve else {})}


def start(workdir: Path, target: str, keys: dict[str, str], tiers: dict[str, str], scenario: str,
          exits: contextlib.ExitStack, replicas_args: list[str] | None = None) -> Stack:
    burst = scenario == "burst"
    sim = ["--max-num-seqs", str(num_seqs(scenario)), "--ttft-ms", str(TTFT_MS), "--itl-ms", str(ITL_MS),
           *(replicas_args or [])]
    pool = Pool(POOL, [MODEL], sim, replicas=REPLICAS, shedding=sidecar_pool(target, scenario))
    tenants = [Tenant(t, [keys[t]], {"requests_per_minute": 10_000_000, "tokens_per_minute": 10_000_000_000},
                      tier=tiers[t]) for t in keys]
    overrides: dict = {"metrics_listen": "127.0.0.1:0"}
    if target.startswith("flow-control"):
        overrides["flow_control"] = flow_config(burst, NEWCOMER_RESERVE if target == "flow-control-reserve" else 0.0)
    elif target.startswith("threshold") and not burst:
        overrides["shedding"] = {"tier_levels": {"batch": BATCH_LEVEL}}
    stack = Stack(workdir, [pool], [Model(MODEL, POOL)], tenants, envoy_concurrency=1,
                  profile="bare" if target == "direct" else "gateway", sidecar_overrides=overrides,
                  edge={"MAX_DOWNSTREAM_CONNECTIONS": 50_000})
    exits.enter_context(stack)
    return stack


def dataset(path: Path, n: int, seed: int) -> Path:
    """`n` chat requests of ~INPUT_TOKENS random words' tokens, max_tokens uniform in
    OUTPUT_MIN..OUTPUT_MAX (the sims run ignore_eos: exactly that many tokens)."""
    rng = random.Random(seed)
    words = max(1, round(INPUT_TOKENS * 4 / 6))  # the sim counts ceil(bytes / 4); ~6 bytes a word
    with open(path, "w") as f:
        for _ in range(n):
            content = " ".join(rng.choice(VOCAB) for _ in range(words))
            f.write(json.dumps({"messages": [{"role": "user", "content": content}],
                                "max_tokens": rng.randint(OUTPUT_MIN, OUTPUT_MAX)}) + "\n")
    return path


def bench_argv(stack: Stack, key: str, load: Load, out: Path, seed: int) -> list[str]:
    n = max(1, round(load.rate * load.seconds))
    data = dataset(out.with_suffix(".dataset.jsonl"), n, seed)
    return [str(BENCH_BIN), "--base-url", stack.base_url or "", "--api-key", key, "--model", MODEL,
            "--seed", str(seed), "--no-progress", "--dataset-path", str(data), "--dataset-order", "in-order",
            "--ignore-eos", "true", "--request-rate", f"{load.rate:.3f}",
            "--num-prompts", str(n), "--timeout-s", str(TIMEOUT_S), "--output-json", str(out),
            "--output-requests", str(out.with_suffix(".jsonl"))]


def run_clients(stack: Stack, keys: dict[str, str], loads: list[Load], work: Path) -> dict[str, list[dict]]:
    """Runs one gateway-bench per load at once; each tenant's per-request records."""
    procs = []
    with contextlib.ExitStack() as exits:
        for i, load in enumerate(loads):
            out = work / f"{load.tenant}.json"
            argv = bench_argv(stack, keys[load.tenant], load, out, SEED + i)
            log = exits.enter_context(open(out.with_suffix(".log"), "wb"))
            procs.append((load, argv, out, subprocess.Popen(
                ["sh", "-c", f"sleep {load.start_s} && exec {shlex.join(argv)}"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)))
        records = {}
        for load, argv, out, proc in procs:
            if proc.wait(timeout=load.start_s + load.seconds + TIMEOUT_S + 300) != 0:
                raise RuntimeError(f"gateway-bench exited {proc.returncode}: {shlex.join(argv)}\n"
                                   f"{out.with_suffix('.log').read_text()[-3000:]}")
            records[load.tenant] = [json.loads(line) for line in out.with_suffix(".jsonl").read_text().splitlines()]
    return records


def percentile(values: list[float], p: float) -> float | None:
    """Nearest-rank percentile."""
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, max(0, math.ceil(p / 100 * len(v)) - 1))]


def tenant_figures(recs: list[dict], load: Load) -> dict:
    ok = [r for r in recs if r["class"] == "ok"]
    # Served per second of the span from the first send to the last answer.
    span_s = max([(r["sent_ms"] + r["e2e_ms"]) / 1000 for r in recs] + [load.seconds])
    ttft = [r["ttft_ms"] for r in ok if r["ttft_ms"] is not None]
    waits = [r["queue_wait_ms"] for r in recs if r.get("queue_wait_ms") is not None]
    return {
        "sent": len(recs), "served": len(ok),
        "overloaded": sum(r["class"] == "rate_limited_overload" for r in recs),
        "timeouts": sum(r["class"] == "timeout" for r in recs),
        "other_errors": sum(r["class"] not in ("ok", "rate_limited_overload", "timeout") for r in recs),
        "ttft_p50_ms": percentile(ttft, 50), "ttft_p99_ms": percentile(ttft, 99),
        "served_tokens": sum(r["prompt_tokens"] + r["completion_tokens"] for r in ok),
        "served_per_s": len(ok) / span_s,
        "span_s": span_s,
        "offered_per_s": load.rate,
        "max_queue_wait_ms": max(waits) if waits else None,
        "ttfts": ttft,
    }


def jain(values: list[float]) -> float | None:
    if not values or not any(values):
        return None
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values))


def fair_shares(demands: dict[str, float], capacity: float) -> dict[str, float]:
    """Max-min fair shares of `capacity` (water-filling over the tenants' demands)."""
    shares, left, open_ = {}, capacity, dict(demands)
    while open_:
        each = left / len(open_)
        small = {t: d for t, d in open_.items() if d <= each}
        if not small:
            shares.update({t: each for t in open_})
            break
        for t, d in small.items():
            shares[t] = d
            left -= d
            del open_[t]
    return shares


def sidecar_rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def sidecar_metric(stack: Stack, name: str, **labels: str) -> float:
    from sidecar_checks import metric
    with urllib.request.urlopen(stack.sidecar_metrics_url + "/metrics", timeout=5) as r:
        return metric(r.read().decode(), name, **labels)


def one_run(scenario: str, target: str, s: Settings, raw: Path, round_no: int) -> dict:
    loads, baseline = scenario_loads(scenario, s)
    burst = scenario == "burst"
    keys = {load.tenant: new_api_key() for load in loads}
    tiers = {load.tenant: load.tier for load in loads}
    work = raw / scenario / f"r{round_no}-{target}"
    work.mkdir(parents=True, exist_ok=True)
    clients = baseline if target == "unloaded" else loads
    with contextlib.ExitStack() as exits:
        stack = start(work, "flow-control" if target == "unloaded" else target, keys, tiers, scenario, exits)
        records = run_clients(stack, keys, clients, work)
    by_tenant = {load.tenant: tenant_figures(records[load.tenant], load) for load in clients}
    first = clients[0]
    argv = bench_argv(stack, keys[first.tenant], first, work / f"{first.tenant}.json", SEED)
    return {"tenants": by_tenant, "command": display(argv, keys[first.tenant])}


def memory_run(s: Settings, raw: Path) -> dict:
    """`s.memory_requests` requests queued at once behind a pool held full by one long stream: the
    sidecar's RSS and CPU per queued request; then SIGTERM answers every queued request."""
    work = raw / "memory"
    work.mkdir(parents=True, exist_ok=True)
    keys = {"holder": new_api_key(), "queued": new_api_key()}
    tiers = {"holder": "premium", "queued": "standard"}
    with contextlib.ExitStack() as exits:
        sim = ["--max-num-seqs", "1", "--ttft-ms", "10", "--itl-ms", "1000", "--output-tokens", "100000"]
        pool = Pool(POOL, [MODEL], sim, replicas=1,
                    shedding={"scrape_interval_ms": 100, "max_in_flight": 1,
                              "flow_control": {"max_queued": s.memory_requests + 100}})
        tenants = [Tenant(t, [keys[t]], {"requests_per_minute": 10_000_000}, tier=tiers[t]) for t in keys]
        flow = {"tiers": [{"name": "premium", "max_queue_wait_ms": 600_000},
                          {"name": "standard", "max_queue_wait_ms": 600_000}]}
        stack = Stack(work, [pool], [Model(MODEL, POOL)], tenants, envoy_concurrency=1,
                      sidecar_overrides={"metrics_listen": "127.0.0.1:0", "flow_control": flow,
                                         "shutdown_grace_ms": 60_000},
                      edge={"MAX_DOWNSTREAM_CONNECTIONS": 50_000})
        exits.enter_context(stack)
        sidecar = next(p for p in stack.procs if p.name == "sidecar")
        holder = subprocess.Popen([str(BENCH_BIN), "--base-url", stack.base_url or "", "--api-key", keys["holder"],
                                   "--model", MODEL, "--no-progress", "--input-len", "16", "--output-len", "3000",
                                   "--ignore-eos", "true", "--num-prompts", "1", "--timeout-s", "900"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        exits.callback(holder.kill)
        deadline = time.monotonic() + 30
        while sidecar_metric(stack, "llm_gateway_in_flight_requests", pool=POOL) < 1:
            if time.monotonic() > deadline:
                raise RuntimeError("the holding request was not admitted")
            time.sleep(0.1)
        rss_idle = sidecar_rss_kb(sidecar.popen.pid)
        cpu_before = cpu_seconds(sidecar.popen.pid)
        out = work / "queued.json"
        argv = [str(BENCH_BIN), "--base-url", stack.base_url or "", "--api-key", keys["queued"], "--model", MODEL,
                "--no-progress", "--input-len", str(INPUT_TOKENS), "--output-len", "1", "--max-concurrency",
                str(s.memory_requests), "--num-prompts", str(s.memory_requests), "--timeout-s", "900",
                "--request-rate", str(MEMORY_RATE),
                "--threads", "2", "--output-json", str(out), "--output-requests", str(out.with_suffix(".jsonl"))]
        log = exits.enter_context(open(out.with_suffix(".log"), "wb"))
        client = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        started = time.monotonic()
        queued = 0.0
        while time.monotonic() - started < 600:
            queued = sidecar_metric(stack, "llm_gateway_queue_requests", pool=POOL)
            if queued >= s.memory_requests or client.poll() is not None:
                break
            time.sleep(0.5)
        queue_fill_s = time.monotonic() - started
        time.sleep(1.0)
        rss_queued = sidecar_rss_kb(sidecar.popen.pid)
        cpu_queued = cpu_seconds(sidecar.popen.pid) - cpu_before
        sidecar.popen.send_signal(signal.SIGTERM)
        answered_at = time.monotonic()
        client.wait(timeout=600)
        answer_s = time.monotonic() - answered_at
        recs = [json.loads(line) for line in out.with_suffix(".jsonl").read_text().splitlines()]
    return {
        "queued": queued, "queue_fill_s": queue_fill_s,
        "rss_idle_mb": rss_idle / 1024, "rss_queued_mb": rss_queued / 1024,
        "rss_per_queued_kb": (rss_queued - rss_idle) / max(1.0, queued),
        "cpu_ms_per_queued": 1000 * cpu_queued / max(1.0, queued),
        "answered_429": sum(r["class"] == "rate_limited_overload" for r in recs), "requests": len(recs),
        "sigterm_to_all_answered_s": answer_s,
        "command": display(argv, keys["queued"]),
    }


SCENARIO_TARGETS = {
    "fair": ["flow-control", "flow-control-reserve", "threshold", "threshold-tuned", "direct", "unloaded"],
    "tiers": ["flow-control", "threshold", "threshold-tuned", "direct", "unloaded"],
    "burst": ["flow-control", "threshold", "threshold-tuned", "direct"],
    "small": ["flow-control", "threshold", "threshold-tuned", "direct", "unloaded"],
}


def median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(scenario: str, runs: dict[str, list[dict]], s: Settings) -> dict:
    """Per target: the medians over rounds of each tenant's figures, goodput, fairness."""
    loads, _ = scenario_loads(scenario, s)
    out: dict = {}
    unloaded = runs.get("unloaded", [])
    for target, rows in runs.items():
        t: dict = {"tenants": {}}
        for load in loads:
            per = [r["tenants"][load.tenant] for r in rows if load.tenant in r["tenants"]]
            if not per:
                continue
            fig = {k: median([p[k] for p in per]) for k in per[0] if k != "ttfts"}
            fig["timeouts"] = sum(p["timeouts"] for p in per)
            fig["other_errors"] = sum(p["other_errors"] for p in per)
            fig["max_queue_wait_ms"] = max((p["max_queue_wait_ms"] or 0) for p in per)
            # Goodput: served within the tier's budget plus the unloaded TTFT p99 (of the round).
            budget = (BURST_BUDGET_S if scenario == "burst" else BUDGET_S[load.tier]) * 1000
            good, fraction = [], []
            for i, p in enumerate(per):
                base = [u["tenants"][load.tenant]["ttft_p99_ms"] for u in unloaded if load.tenant in u["tenants"]]
                # Without a baseline run (burst): the sims' own TTFT and 10 % for the way there.
                slo = budget + (base[min(i, len(base) - 1)] if base else 1.1 * TTFT_MS)
                n = sum(x <= slo for x in p["ttfts"])
                good.append(n / p["span_s"])
                fraction.append(n / max(1, p["sent"]))
            fig["goodput_per_s"] = median(good)
            fig["good_fraction"] = median(fraction)
            t["tenants"][load.tenant] = fig
        tenants = t["tenants"]
        t["goodput_per_s"] = sum(f["goodput_per_s"] or 0 for f in tenants.values())
        t["served_per_s"] = sum(f["served_per_s"] or 0 for f in tenants.values())
        t["command"] = rows[0]["command"] if rows else None
        out[target] = t
    # The pool's capacity as measured: what it served through bare Envoy, saturated, in this run.
    cap = out.get("direct", {}).get("served_per_s") or capacity(scenario)
    for target, t in out.items():
        tenants = t["tenants"]
        if scenario in ("fair", "small") and target != "unloaded" and len(tenants) == 2:
            shares = fair_shares({n: f["offered_per_s"] for n, f in tenants.items()}, cap)
            t["jain_fair_share"] = jain([tenants[n]["served_per_s"] / shares[n] for n in tenants])
            t["heavy_vs_left"] = tenants["heavy"]["served_per_s"] / (cap - tenants["light"]["offered_per_s"])
            t["capacity_measured"] = cap
    base = out.get("unloaded", {}).get("tenants", {})
    for target, t in out.items():
        for name, fig in t["tenants"].items():
            if name in base and base[name].get("ttft_p99_ms") and fig.get("ttft_p99_ms"):
                fig["ttft_p99_vs_unloaded"] = fig["ttft_p99_ms"] / base[name]["ttft_p99_ms"]
    for flow in ("flow-control", "flow-control-reserve"):
        fc = out.get(flow, {}).get("goodput_per_s")
        for target in ("threshold", "threshold-tuned", "direct"):
            if fc and target in out and out[target].get("goodput_per_s"):
                out[flow][f"goodput_vs_{target}"] = fc / out[target]["goodput_per_s"]
    return out


def goodput_ratios(f: dict) -> str:
    """A flow-control target's goodput against the others, as the section words it."""
    return (f"{ratio(f.get('goodput_vs_threshold'))} threshold, {ratio(f.get('goodput_vs_threshold-tuned'))} "
            f"threshold-tuned, {ratio(f.get('goodput_vs_direct'))} direct")


def section(summary: dict) -> str:
    s = summary["summary"]
    rows = []
    what = {"fair": "two tenants, heavy 10× light, 3× capacity", "tiers": "premium 0.2× + batch 2.8× capacity",
            "burst": "4× capacity for 2 s (batch)",
            "small": f"as fair, on {REPLICAS} × {SMALL_NUM_SEQS} slots"}
    for scenario, targets in s.items():
        if scenario == "memory":
            continue
        first = True
        for target, t in targets.items():
            for name, f in t["tenants"].items():
                rows.append([
                    f"{scenario}: {what[scenario]}" if first else "", target if name == next(iter(t["tenants"])) else "",
                    name, fmt(f["offered_per_s"], 1), fmt(f["served_per_s"], 1), fmt(f.get("overloaded"), 0),
                    str(f["timeouts"]), fmt(f.get("ttft_p50_ms"), 0), fmt(f.get("ttft_p99_ms"), 0),
                    ratio(f.get("ttft_p99_vs_unloaded")), fmt(f.get("goodput_per_s"), 1),
                    fmt(f.get("max_queue_wait_ms"), 0),
                ])
                first = False
    table = md_table(["scenario", "target", "tenant", "offered/s", "served/s", "429 (median)", "timeouts",
                      "TTFT p50 ms", "TTFT p99 ms", "p99 ÷ unloaded", "goodput/s", "max queue wait ms"], rows)
    lines = []
    fair = s.get("fair", {})
    if fair.get("flow-control"):
        f = fair["flow-control"]
        lines.append(f"- fair: Jain's index over served ÷ max-min fair share: flow control "
                     f"{fmt(f.get('jain_fair_share'), 3)}, threshold {fmt(fair.get('threshold', {}).get('jain_fair_share'), 3)}, "
                     f"threshold-tuned {fmt(fair.get('threshold-tuned', {}).get('jain_fair_share'), 3)}, "
                     f"direct {fmt(fair.get('direct', {}).get('jain_fair_share'), 3)}; the heavy tenant's served rate ÷ the "
                     f"capacity the light one leaves (capacity measured by `direct`: {fmt(f.get('capacity_measured'), 1)}/s): "
                     f"{ratio(f.get('heavy_vs_left'))}; goodput (requests/s within "
                     f"{BUDGET_S['standard']:g} s + unloaded TTFT p99): {fmt(f.get('goodput_per_s'), 1)}, "
                     f"{goodput_ratios(f)}.")
    if fair.get("flow-control-reserve"):
        f = fair["flow-control-reserve"]
        light = f["tenants"].get("light", {})
        lines.append(f"- fair, `flow-control-reserve` (`newcomer_reserve: {NEWCOMER_RESERVE:g}`): the light tenant's TTFT p99 "
                     f"{ratio(light.get('ttft_p99_vs_unloaded'))} unloaded (without the reserve "
                     f"{ratio(fair.get('flow-control', {}).get('tenants', {}).get('light', {}).get('ttft_p99_vs_unloaded'))}); "
                     f"Jain {fmt(f.get('jain_fair_share'), 3)}; heavy ÷ the capacity left {ratio(f.get('heavy_vs_left'))}; "
                     f"goodput {fmt(f.get('goodput_per_s'), 1)}/s, {goodput_ratios(f)}.")
    tiers = s.get("tiers", {})
    if tiers.get("flow-control"):
        p = tiers["flow-control"]["tenants"].get("premium", {})
        lines.append(f"- tiers: premium's TTFT p99 {ratio(p.get('ttft_p99_vs_unloaded'))} its unloaded p99 with flow "
                     f"control, {ratio(tiers.get('threshold', {}).get('tenants', {}).get('premium', {}).get('ttft_p99_vs_unloaded'))} "
                     f"with threshold shedding, {ratio(tiers.get('threshold-tuned', {}).get('tenants', {}).get('premium', {}).get('ttft_p99_vs_unloaded'))} "
                     f"threshold-tuned, {ratio(tiers.get('direct', {}).get('tenants', {}).get('premium', {}).get('ttft_p99_vs_unloaded'))} direct.")
    small = s.get("small", {})
    if small.get("flow-control"):
        f = small["flow-control"]
        light = f["tenants"].get("light", {})
        lines.append(f"- small ({REPLICAS} × {SMALL_NUM_SEQS} slots, capacity {capacity('small'):.0f}/s nominal, where the example's "
                     f"`max_queue_depth: {EXAMPLE_QUEUE_DEPTH}` is about {EXAMPLE_QUEUE_DEPTH / capacity('small'):.1f} s of work): goodput "
                     f"{fmt(f.get('goodput_per_s'), 1)}/s with flow control, {goodput_ratios(f)}; "
                     f"the light tenant's TTFT p99 {ratio(light.get('ttft_p99_vs_unloaded'))} unloaded; Jain "
                     f"{fmt(f.get('jain_fair_share'), 3)}.")
    burst = s.get("burst", {})
    if burst.get("flow-control"):
        def within(t: str) -> str:
            f = burst.get(t, {}).get("tenants", {}).get("burst", {})
            return f"{100 * (f.get('good_fraction') or 0):.0f} %"
        lines.append(f"- burst: served within the batch budget ({BURST_BUDGET_S:g} s) + unloaded TTFT: flow control "
                     f"{within('flow-control')}, threshold {within('threshold')}, threshold-tuned {within('threshold-tuned')}, "
                     f"direct {within('direct')} of the burst.")
    mem = s.get("memory")
    if mem:
        lines.append(f"- memory: {mem['queued']:.0f} requests queued: the sidecar's RSS {mem['rss_idle_mb']:.1f} MB idle, "
                     f"{mem['rss_queued_mb']:.1f} MB with them ({mem['rss_per_queued_kb']:.2f} KB per queued request); "
                     f"its CPU {mem['cpu_ms_per_queued']:.3f} ms per queued request (admission, queueing, the stream); "
                     f"SIGTERM answered all {mem['answered_429']} of {mem['requests']} with 429 in "
                     f"{mem['sigterm_to_all_answered_s']:.1f} s. Command: `{mem['command']}`")
    st = summary["settings"]
    commands = "\n".join(f"- {sc}: `{t.get('flow-control', {}).get('command')}`" for sc, t in s.items() if sc != "memory")
    reused = "".join(f" ({sc}: run {at})" for sc, at in summary.get("reused", {}).items())
    return f"""{BEGIN}
## Flow control (issue 13)

Run {summary['finished_at']}{reused}, {st['rounds']} interleaved rounds (fresh stacks for every target and round),
medians. Upstream: {REPLICAS} × `vllm-sim --max-num-seqs {MAX_NUM_SEQS} --ttft-ms {TTFT_MS} --itl-ms {ITL_MS}`,
{OUTPUT_MIN}–{OUTPUT_MAX} output tokens (uniform): {SLOTS} slots of {SERVICE_S * 1000:.0f} ms on average,
capacity {CAPACITY:.0f} requests/s.
Poisson arrivals for {st['duration_s']:g} s per client. `flow-control`: `max_in_flight: {SLOTS}`, budgets
premium {BUDGET_S['premium']:g} s, standard {BUDGET_S['standard']:g} s, batch {BUDGET_S['batch']:g} s
(`max_load: {BATCH_LEVEL}`; {BURST_BUDGET_S:g} s in the burst scenario). `threshold`: today's shedding
as the example config sets it, `max_queue_depth: {EXAMPLE_QUEUE_DEPTH}`, with `tier_levels: {{batch: {BATCH_LEVEL}}}`;
`threshold-tuned`: `max_queue_depth` = budget × capacity (the vLLM queue that waits the same
budget on this pool). `direct`: bare Envoy, requests queue in vLLM, clients give up
after {TIMEOUT_S:g} s. `unloaded`: the tenant alone through flow control.

![TTFT p99 by target](benchmarks/flow-control.svg)

{table}

{chr(10).join(lines)}

Reproduce: `.venv/bin/python bench/flow_control.py`; each scenario's first client, as run:

{commands}
{END}"""


def write_chart(summary: dict, path: Path) -> None:
    s = summary["summary"]
    cats, series = [], {}
    for scenario, targets in s.items():
        if scenario == "memory":
            continue
        for tenant in next(iter(targets.values()))["tenants"]:
            cats.append(f"{scenario}/{tenant}")
            for target in SCENARIO_TARGETS[scenario]:
                series.setdefault(target, [])
        for tenant in next(iter(targets.values()))["tenants"]:
            for target in series:
                series[target].append(targets.get(target, {}).get("tenants", {}).get(tenant, {}).get("ttft_p99_ms"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(bar_chart_svg("TTFT p99 of served requests (median of rounds)", " ms", cats, series))


def main(argv: list[str] | None = None) -> int:
    global NEWCOMER_RESERVE
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small smoke run; docs untouched")
    parser.add_argument("--scenarios", default="fair,small,tiers,burst,memory")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--no-docs", action="store_true", help="leave docs/ alone")
    parser.add_argument("--targets", default=None,
                        help="comma-separated subset of each scenario's targets (implies --no-docs)")
    parser.add_argument("--newcomer-reserve", type=float, default=None,
                        help=f"newcomer_reserve of flow-control-reserve (default {NEWCOMER_RESERVE}; implies --no-docs)")
    parser.add_argument("--results", type=Path, default=None)
    parser.add_argument("--reuse", type=Path, default=None,
                        help="a previous run's results directory: its scenarios not in --scenarios are kept")
    args = parser.parse_args(argv)
    s = QUICK if args.quick else FULL
    if args.targets or args.newcomer_reserve is not None:
        args.no_docs = True
    if args.newcomer_reserve is not None:
        NEWCOMER_RESERVE = args.newcomer_reserve
    if args.rounds:
        s = Settings(**{**s.__dict__, "rounds": args.rounds})
    scenarios = [x for x in args.scenarios.split(",") if x]
    unknown = set(scenarios) - set(SCENARIO_TARGETS) - {"memory"}
    if unknown:
        parser.error(f"unknown scenarios {sorted(unknown)}")
    if not BENCH_BIN.exists():
        parser.error(f"{BENCH_BIN} missing: make build")
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    raw = args.results or TARGET / "bench-results" / f"flow-control-{stamp}"
    raw.mkdir(parents=True, exist_ok=True)
    results: dict = {}
    started = time.monotonic()
    for scenario in scenarios:
        if scenario == "memory":
            continue
        targets = [t for t in SCENARIO_TARGETS[scenario] if not args.targets or t in args.targets.split(",")]
        runs: dict[str, list[dict]] = {t: [] for t in targets}
        for r in range(s.rounds):
            order = targets[r % len(targets):] + targets[: r % len(targets)]
            for target in order:
                t0 = time.monotonic()
                row = one_run(scenario, target, s, raw, r)
                runs[target].append(row)
                brief = {n: (f["served"], f["overloaded"], f["timeouts"], f["ttft_p99_ms"]) for n, f in row["tenants"].items()}
                print(f"[{scenario} r{r} {target}] (served, 429, timeouts, TTFT p99 ms) {brief} "
                      f"({time.monotonic() - t0:.0f} s)", flush=True)
        results[scenario] = runs
    summary_by = {sc: summarize(sc, runs, s) for sc, runs in results.items()}
    if "memory" in scenarios:
        summary_by["memory"] = memory_run(s, raw)
        print(f"[memory] {summary_by['memory']}", flush=True)
    reused: dict[str, str] = {}
    if args.reuse:
        previous = json.loads((args.reuse / "summary.json").read_text())
        for sc in ["fair", "small", "tiers", "burst", "memory"]:
            if sc not in summary_by and sc in previous["summary"]:
                summary_by[sc] = previous["summary"][sc]
                reused[sc] = previous.get("reused", {}).get(sc, previous["finished_at"])
                if sc in previous.get("results", {}):
                    results[sc] = previous["results"][sc]
        summary_by = {sc: summary_by[sc] for sc in ["fair", "small", "tiers", "burst", "memory"] if sc in summary_by}
    summary = {"finished_at": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
               "wall_s": time.monotonic() - started, "settings": s.__dict__, "summary": summary_by, "reused": reused,
               "results": results}
    (raw / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    text = section(summary)
    (raw / "flow-control.md").write_text(text + "\n")
    write_chart(summary, raw / "flow-control.svg")
    print(text)
    if not (args.quick or args.no_docs):
        DOC.write_text(replace_section(DOC.read_text(), text, BEGIN, END))
        write_chart(summary, CHART)
        print(f"wrote {DOC.relative_to(ROOT)} and {CHART.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
