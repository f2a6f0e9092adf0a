"""Endpoint picking against Envoy's LEAST_REQUEST (issue 12): 4 simulated vLLM replicas behind one
pool, the same offered load to each target, interleaved rounds, medians.

The upstreams are `vllm-sim --engine batched` (sim/: vLLM V1's scheduler as steps, a KV cache of
`--num-gpu-blocks` blocks of 16 tokens with prefix caching, prefill time per uncached prompt
token, decode time per running sequence; its constants and their sources are in the sim's docs).
Every target of every round gets fresh replicas, so no target inherits another's prefix cache.

Targets (each the full gateway: Envoy + wasm filter + ext_proc sidecar + redis-server):

    least-request   the pool without `picker`: Envoy's LEAST_REQUEST picks the replica, scanning
                    every replica (the gateway's pools, envoy/pool_cluster.yaml: FULL_SCAN)
    lr-two-choices  (scenarios a, b, c) Envoy's stock LEAST_REQUEST: the less busy of two random
                    replicas (the default `choice_count` 2, which picks the busier of two replicas
                    25 % of the time)
    picker          the pool with `picker: {}` (defaults): the sidecar picks (queue, KV cache,
                    in-flight, prefix affinity) and Envoy's override-host policy honours it
    picker-leases   (scenario a) the picker with admission leases allowed (`picker:
                    {admission_leases: true}`, `redis.lease_fraction` 0.01): requests the filter
                    admits from a lease never reach the sidecar and fall back to LEAST_REQUEST

Scenarios (`--scenarios`, all by default):

    a       multi-turn chat with shared prefixes: GROUPS groups of conversations, each group
            sharing a ~2,000-token system prompt, 5 turns per conversation, the whole history
            resent every turn (written turn by turn, sent in that order at Poisson arrivals).
            The replicas' KV caches are sized so that each holds about a quarter of the groups'
            prefixes: affinity lets the 4 replicas hold all of them between them; without it each
            replica would need all of them. With caches large enough to hold every prefix,
            LEAST_REQUEST also hits once warm (scenario a-big-cache shows it).
    a-big-cache   scenario a with 4x larger KV caches (where affinity helps only while cold)
    b       random prompts of the same lengths, no shared prefix (where affinity cannot help)
    c       scenario b with one replica 3x slower (`--slowdown 3`); its share of requests reported
    d       scenario a through two gateways (two Envoys, two sidecars, two Redis) that share
            nothing but the replicas' /metrics; requests alternate between the gateways
    cost    the picker's own cost: paced fixed-time upstreams (TTFT 20 ms), short prompts,
            concurrency 16: added TTFT p50 and the sidecar's CPU per request, picker against none

    .venv/bin/python bench/picker.py                    # all scenarios, 3 rounds (~15 min)
    .venv/bin/python bench/picker.py --quick            # smoke run; docs untouched
    .venv/bin/python bench/picker.py --scenarios a,b --rounds 5 --no-docs

Results: target/bench-results/picker-<stamp>/ (summary.json, every gateway-bench report and log)
and, unless --quick/--no-docs, the section between the `picker-benchmark` markers of
docs/benchmarks.md with its chart docs/benchmarks/picker-ttft.svg.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import random
import re
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from results_page import PICKER_BEGIN as BEGIN  # noqa: E402
from results_page import PICKER_END as END  # noqa: E402
from results_page import bar_chart_svg, fmt, md_table, ratio  # noqa: E402
from stack import TARGET, Model, Pool, Stack, Tenant, new_api_key, upstream_metric  # noqa: E402

BENCH_BIN = TARGET / "release" / "gateway-bench"
DOC = ROOT / "docs" / "benchmarks.md"
CHART = ROOT / "docs" / "benchmarks" / "picker-ttft.svg"
MODEL = "m"
POOL = "pool"
REPLICAS = 4
# The picking pools' `picker` members (--picker; default: the sidecar's defaults).
PICKER: dict = {}
SEED = 7
# Words of the synthetic text (random common words, ~5.5 bytes each with the space: the sim counts
# ceil(bytes / 4) tokens, so a word is ~1.4 of its tokens).
VOCAB = ("time person year way day thing man world life hand part child eye woman place work week case "
         "point government company number group problem fact able bad best better big black certain clear "
         "different early easy economic federal free full good great hard high human important international "
         "large late little local long low major military national new old only other political possible "
         "public real recent right small social special strong sure true white whole young").split()


def words_for_tokens(tokens: int) -> int:
    """Words of VOCAB text that the sim counts as about `tokens` tokens."""
    mean_bytes = sum(len(w) + 1 for w in VOCAB) / len(VOCAB)
    return max(1, round(tokens * 4 / mean_bytes))


def text(rng: random.Random, tokens: int) -> str:
    return " ".join(rng.choice(VOCAB) for _ in range(words_for_tokens(tokens)))


@dataclass
class Workload:
    """A dataset of chat requests, in sending order."""

    name: str
    entries: list[dict]

    def write(self, path: Path, part: int = 0, parts: int = 1) -> Path:
        """Writes every `parts`-th entry (from `part`) as JSONL."""
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            for e in self.entries[part::parts]:
                f.write(json.dumps(e) + "\n")
        return path


def shared_prefix_workload(groups: int, conversations: int, turns: int, system_tokens: int, user_tokens: int,
                           reply_tokens: int, max_tokens: int, seed: int) -> Workload:
    """`groups` system prompts; `conversations` conversations per group, `turns` turns each, every
    turn resending the whole history (synthetic assistant replies); written turn-major."""
    rng = random.Random(seed)
    systems = [text(rng, system_tokens) for _ in range(groups)]
    histories = [[{"role": "system", "content": systems[g]}] for g in range(groups) for _ in range(conversations)]
    entries = []
    for _ in range(turns):
        order = list(range(len(histories)))
        rng.shuffle(order)
        for c in order:
            histories[c].append({"role": "user", "content": text(rng, user_tokens)})
            entries.append({"messages": list(histories[c]), "max_tokens": max_tokens})
            histories[c].append({"role": "assistant", "content": text(rng, reply_tokens)})
    return Workload("shared-prefix", entries)


def random_workload(like: Workload, seed: int) -> Workload:
    """Requests of the same prompt lengths as `like`, each a fresh random text (no shared prefix)."""
    rng = random.Random(seed)
    entries = []
    for e in like.entries:
        tokens = sum(len(m["content"]) for m in e["messages"]) // 4
        entries.append({"messages": [{"role": "user", "content": text(rng, tokens)}], "max_tokens": e["max_tokens"]})
    return Workload("random", entries)


@dataclass
class Settings:
    """One run's sizes (the full run and --quick)."""

    groups: int
    conversations: int
    turns: int
    system_tokens: int
    rate: float
    num_gpu_blocks: int
    cost_requests: int
    rounds: int


# The full run: 16 groups x 4 conversations x 5 turns = 320 requests per run at 16 req/s (~20 s);
# 2,048 KV blocks per replica (32,768 tokens) hold about a quarter of the groups' system prompts
# (125 blocks each) besides the running requests.
FULL = Settings(groups=16, conversations=4, turns=5, system_tokens=2000, rate=16.0, num_gpu_blocks=2048,
                cost_requests=2000, rounds=3)
QUICK = Settings(groups=4, conversations=2, turns=3, system_tokens=2000, rate=16.0, num_gpu_blocks=2048,
                 cost_requests=200, rounds=1)


def sim_args(num_gpu_blocks: int) -> list[str]:
    """The batched engine with the sim's documented default speeds and the scenario's KV cache."""
    # --max-model-len comes from the stack (Pool.max_model_len).
    return ["--engine", "batched", "--num-gpu-blocks", str(num_gpu_blocks), "--max-num-seqs", "32"]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (/proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_gateway(workdir: Path, picker: bool, leases: bool, replica_args: list[list[str]],
                  urls: list[str] | None, key: str, exits: contextlib.ExitStack,
                  two_choices: bool = False) -> Stack:
    """One gateway (Envoy + filter + sidecar + Redis) in front of REPLICAS vllm-sims it starts, or of
    the running `urls`."""
    if urls:
        pool = Pool(POOL, [MODEL], kind="external", urls=list(urls), max_model_len=8192)
    else:
        pool = Pool(POOL, [MODEL], replicas=REPLICAS, replica_sim_args=replica_args, max_model_len=8192)
    # The picker's pool is scraped every 100 ms; the least-request pool needs no scrapes (no
    # shedding in either: every request is served).
    pool.shedding = {"scrape_interval_ms": 100} if picker else None
    # A picking pool takes no admission leases unless its picker allows them.
    pool.picker = ({**PICKER, "admission_leases": True} if leases else dict(PICKER)) if picker else None
    pool.lb_two_choices = two_choices
    tenants = [Tenant("bench", [key], {"requests_per_minute": 10_000_000, "tokens_per_minute": 10_000_000_000})]
    stack = Stack(workdir, [pool], [Model(MODEL, POOL, 8192)], tenants, envoy_concurrency=1,
                  admission_leases=leases,
                  sidecar_overrides={"redis": {"lease_fraction": 0.01}} if leases else None)
    exits.enter_context(stack)
    return stack


def run_argv(argv: list[str], out: Path, timeout_s: float) -> dict:
    log = out.with_suffix(".log")
    with open(log, "wb") as f:
        proc = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                              timeout=timeout_s, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"gateway-bench exited {proc.returncode}: {shlex.join(argv)}\n{log.read_text()[-3000:]}")
    return json.loads(out.read_text())


def point(report: dict) -> dict:
    p = report["points"][0]
    return {"ttft_p50_ms": p["ttft_ms"]["p50_ms"], "ttft_p99_ms": p["ttft_ms"]["p99_ms"],
            "e2e_p50_ms": p["e2e_ms"]["p50_ms"], "completed": p["completed"], "sent": p["sent"],
            "failed": p["failed"], "status_codes": p["status_codes"]}


def replica_figures(urls: list[str], before: dict[str, dict[str, float]]) -> dict:
    """Per replica: requests received, prefix-cache queries and hits (tokens) since `before`."""
    names = {"requests": "vllm_sim:requests_received_total", "queries": "vllm:prefix_cache_queries_total",
             "hits": "vllm:prefix_cache_hits_total"}
    now = {u: {k: upstream_metric(u, n) for k, n in names.items()} for u in urls}
    per = [{k: now[u][k] - before.get(u, {}).get(k, 0.0) for k in names} for u in urls]
    queries = sum(r["queries"] for r in per)
    return {"requests": [r["requests"] for r in per],
            "hit_rate": sum(r["hits"] for r in per) / queries if queries else None}


def snapshot(urls: list[str]) -> dict[str, dict[str, float]]:
    return {u: {"requests": upstream_metric(u, "vllm_sim:requests_received_total"),
                "queries": upstream_metric(u, "vllm:prefix_cache_queries_total"),
                "hits": upstream_metric(u, "vllm:prefix_cache_hits_total")} for u in urls}


def one_run(scenario: str, target: str, workload: Workload, s: Settings, raw: Path, round_no: int) -> dict:
    """One target, one round, fresh replicas: the workload sent once; figures from the client and
    the replicas."""
    key = new_api_key()
    blocks = s.num_gpu_blocks * (4 if scenario == "a-big-cache" else 1)
    replica_args = [sim_args(blocks) for _ in range(REPLICAS)]
    if scenario == "c":
        replica_args[0] = [*replica_args[0], "--slowdown", "3"]
    work = raw / scenario / f"r{round_no}-{target}"
    with contextlib.ExitStack() as exits:
        picking = target not in ("least-request", "lr-two-choices")
        first = start_gateway(work / "gw0", picking, target == "picker-leases", replica_args,
                              None, key, exits, two_choices=target == "lr-two-choices")
        urls = list(first.pool(POOL).urls)
        gateways = [first]
        if scenario == "d":
            gateways.append(start_gateway(work / "gw1", picking, False, replica_args, urls, key, exits))
        before = snapshot(urls)
        parts = len(gateways)
        procs = []
        for i, gw in enumerate(gateways):
            dataset = workload.write(work / f"dataset{i}.jsonl", i, parts)
            out = work / f"bench{i}.json"
            argv = [str(BENCH_BIN), "--base-url", gw.base_url or "", "--api-key", key, "--model", MODEL,
                    "--seed", str(SEED + i), "--no-progress", "--dataset-path", str(dataset), "--dataset-order",
                    "in-order", "--ignore-eos", "true", "--num-prompts", str(len(workload.entries[i::parts])),
                    "--request-rate", str(s.rate / parts), "--output-json", str(out)]
            log = open(out.with_suffix(".log"), "wb")  # noqa: SIM115
            exits.callback(log.close)
            procs.append((subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL),
                          out, argv))
        reports = []
        for proc, out, argv in procs:
            if proc.wait(timeout=900) != 0:
                raise RuntimeError(f"gateway-bench exited {proc.returncode}: {shlex.join(argv)}\n"
                                   f"{out.with_suffix('.log').read_text()[-3000:]}")
            reports.append(json.loads(out.read_text()))
        figures = replica_figures(urls, before)
    row = point(reports[0]) if parts == 1 else merged_points(reports)
    row.update(figures)
    row["command"] = display(procs[0][2], key)
    return row


def display(argv: list[str], key: str) -> str:
    """A command as run, with the API key, the ephemeral port and the absolute paths masked."""
    text = shlex.join(argv).replace(key, "$API_KEY").replace(str(ROOT) + "/", "")
    return re.sub(r"http://127\.0\.0\.1:\d+", "$TARGET_URL", text)


def merged_points(reports: list[dict]) -> dict:
    """Several clients' reports as one row: each percentile the mean of the clients' (gateway-bench
    reports no per-request samples; each client sends half of the requests at half the rate)."""
    rows = [point(r) for r in reports]
    out = {k: statistics.mean([r[k] for r in rows]) for k in ("ttft_p50_ms", "ttft_p99_ms", "e2e_p50_ms")}
    out.update({k: sum(r[k] for r in rows) for k in ("completed", "sent", "failed")})
    out["status_codes"] = {}
    for r in rows:
        for code, n in r["status_codes"].items():
            out["status_codes"][code] = out["status_codes"].get(code, 0) + n
    out["merged_from"] = len(rows)
    return out


def cost_run(target: str, s: Settings, raw: Path, round_no: int) -> dict:
    """The picker's own cost: fixed-pace replicas, short random prompts, concurrency 16."""
    key = new_api_key()
    work = raw / "cost" / f"r{round_no}-{target}"
    fixed = ["--ttft-ms", "20", "--itl-ms", "5", "--output-tokens", "16", "--max-num-seqs", "256"]
    with contextlib.ExitStack() as exits:
        gw = start_gateway(work, target == "picker", False, [fixed] * REPLICAS, None, key, exits)
        sidecar = next(p for p in gw.procs if p.name == "sidecar")
        cpu_before = cpu_seconds(sidecar.popen.pid)
        out = work / "bench.json"
        argv = [str(BENCH_BIN), "--base-url", gw.base_url or "", "--api-key", key, "--model", MODEL, "--seed",
                str(SEED), "--no-progress", "--input-len", "64", "--output-len", "16", "--max-concurrency", "16",
                "--num-prompts", str(s.cost_requests), "--warmup", "50", "--output-json", str(out)]
        report = run_argv(argv, out, 600)
        cpu = cpu_seconds(sidecar.popen.pid) - cpu_before
    row = point(report)
    row["sidecar_cpu_ms_per_request"] = 1000 * cpu / max(1, row["completed"] + 50)
    row["command"] = display(argv, key)
    return row


SCENARIO_TARGETS = {
    "a": ["least-request", "picker", "picker-leases", "lr-two-choices"],
    "a-big-cache": ["least-request", "picker"],
    "b": ["least-request", "picker", "lr-two-choices"],
    "c": ["least-request", "picker", "lr-two-choices"],
    "d": ["least-request", "picker"],
    "cost": ["least-request", "picker"],
}


def median_of(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def summarize(results: dict[str, dict[str, list[dict]]]) -> dict:
    """Per scenario and target: medians over rounds; ratios picker / least-request (median of
    per-round ratios)."""
    out: dict = {}
    for scenario, targets in results.items():
        sc: dict = {}
        base = targets.get("least-request", [])
        for name, rows in targets.items():
            t = {k: median_of(rows, k) for k in ("ttft_p50_ms", "ttft_p99_ms", "e2e_p50_ms", "hit_rate",
                                                  "sidecar_cpu_ms_per_request")}
            t["failed"] = sum(r["failed"] for r in rows)
            t["sent"] = sum(r["sent"] for r in rows)
            if rows and rows[0].get("requests"):
                totals = [sum(r["requests"]) or 1 for r in rows]
                t["slow_replica_share"] = statistics.median(r["requests"][0] / n for r, n in zip(rows, totals))
            if name != "least-request" and base:
                for k in ("ttft_p50_ms", "ttft_p99_ms"):
                    pairs = [(a[k], b[k]) for a, b in zip(rows, base) if a.get(k) and b.get(k)]
                    t[f"{k}_ratio"] = statistics.median(a / b for a, b in pairs) if pairs else None
            two = targets.get("lr-two-choices", [])
            if name == "picker" and two:
                for k in ("ttft_p50_ms", "ttft_p99_ms"):
                    pairs = [(a[k], b[k]) for a, b in zip(rows, two) if a.get(k) and b.get(k)]
                    t[f"{k}_ratio_two_choices"] = statistics.median(a / b for a, b in pairs) if pairs else None
                pairs = [(a["ttft_p50_ms"], b["ttft_p50_ms"]) for a, b in zip(rows, base)]
                t["ttft_p50_diff_ms"] = statistics.median(a - b for a, b in pairs) if pairs else None
            t["command"] = rows[0]["command"] if rows else None
            sc[name] = t
        out[scenario] = sc
    return out


TARGETS_TEXT = {
    "a": ("shared prefixes", "TTFT p50 and p99 ≤ 0.5×"),
    "a-big-cache": ("shared prefixes, caches hold every prefix", "(no target: affinity helps only while cold)"),
    "b": ("random prompts", "TTFT p99 ≤ 1.05×"),
    "c": ("random prompts, one replica 3× slower", "TTFT p99 ≤ 0.7×"),
    "d": ("shared prefixes, two gateways", "gain of (a) held at ≥ 80 %"),
    "cost": ("picker's own cost, paced upstream", "added TTFT p50 ≤ 0.1 ms"),
}


def section(summary: dict) -> str:
    """The markdown section for docs/benchmarks.md."""
    s = summary["summary"]
    rows = []
    for scenario, targets in s.items():
        what, goal = TARGETS_TEXT[scenario]
        for name, t in targets.items():
            rows.append([
                f"({scenario}) {what}" if name == "least-request" else "", name,
                fmt(t["ttft_p50_ms"], 1), fmt(t["ttft_p99_ms"], 1),
                ratio(t.get("ttft_p50_ms_ratio")), ratio(t.get("ttft_p99_ms_ratio")),
                "" if t.get("hit_rate") is None else f"{100 * t['hit_rate']:.0f} %",
                "" if t.get("slow_replica_share") is None or scenario != "c" else f"{100 * t['slow_replica_share']:.0f} %",
                f"{t['failed']}/{t['sent']}",
                goal if name == "least-request" else "",
            ])
    table = md_table(["scenario", "target", "TTFT p50 ms", "TTFT p99 ms", "p50 ÷ LR", "p99 ÷ LR",
                      "prefix hit rate", "slow replica's share", "failed/sent", "target"], rows)
    cost = s.get("cost", {})
    cost_text = ""
    if cost.get("picker"):
        cost_text = (f"\n\nThe picker's own cost (scenario cost): TTFT p50 {fmt(cost['picker'].get('ttft_p50_diff_ms'), 3)} ms "
                     f"against the gateway without picking (median of per-round differences); the sidecar's CPU "
                     f"{fmt(cost['picker'].get('sidecar_cpu_ms_per_request'), 3)} ms per request against "
                     f"{fmt(cost['least-request'].get('sidecar_cpu_ms_per_request'), 3)} ms.")
    two = [f"({sc}) p50 {ratio(t['picker'].get('ttft_p50_ms_ratio_two_choices'))}, "
           f"p99 {ratio(t['picker'].get('ttft_p99_ms_ratio_two_choices'))}"
           for sc, t in s.items() if t.get("picker", {}).get("ttft_p50_ms_ratio_two_choices") is not None]
    two_text = ("\n\nThe picker against Envoy's stock LEAST_REQUEST (two random choices, `lr-two-choices`), "
                "medians of per-round ratios: " + "; ".join(two) + ".") if two else ""
    gains = ""
    a, d = s.get("a", {}).get("picker"), s.get("d", {}).get("picker")
    if a and d and a.get("ttft_p50_ms_ratio") and d.get("ttft_p50_ms_ratio"):
        ga, gd = 1 - a["ttft_p50_ms_ratio"], 1 - d["ttft_p50_ms_ratio"]
        gains = (f"\n\nGain held with two gateways (d against a, TTFT p50): {100 * gd / ga:.0f} % "
                 f"({100 * gd:.0f} % against {100 * ga:.0f} % fewer milliseconds)." if ga > 0 else "")
    commands = "\n".join(f"- ({sc}) `{t['least-request']['command']}`" for sc, t in s.items() if t.get("least-request"))
    st = summary["settings"]
    return f"""{BEGIN}
## Endpoint picking (issue 12)

Run {summary['finished_at']}, {st['rounds']} interleaved rounds (fresh replicas for every target and
round), medians; ratios are medians of per-round ratios against `least-request` (LR: the gateway's pools,
LEAST_REQUEST scanning every replica; `lr-two-choices` is Envoy's stock two random choices). 4 replicas of
`vllm-sim --engine batched` (KV cache of {st['num_gpu_blocks']} blocks of 16 tokens each, prefix caching,
`--max-num-seqs 32`), {st['groups']} groups × {st['conversations']} conversations × {st['turns']} turns,
system prompts of ~{st['system_tokens']} tokens, Poisson arrivals at {st['rate']:g} req/s, 64 output tokens.
`picker-leases` is the picker with admission leases allowed (`picker: {{admission_leases: true}}`):
leased requests skip the sidecar and go to Envoy's LEAST_REQUEST. Without it (the default) a
picking pool gets no leases, so every request is picked.

![TTFT by scenario and target](benchmarks/picker-ttft.svg)

{table}{two_text}{cost_text}{gains}

Reproduce: `.venv/bin/python bench/picker.py` (all scenarios; `--scenarios a,b` for some). Each
scenario's first command, as run (`$TARGET_URL` is the gateway's ephemeral address, `$API_KEY` a
key generated for the run; the dataset is written by the script):

{commands}
{END}"""


def write_chart(summary: dict, path: Path) -> None:
    s = summary["summary"]
    cats = [sc for sc in s if sc != "cost"]
    names = sorted({n for sc in cats for n in s[sc]}, key=["least-request", "lr-two-choices", "picker", "picker-leases"].index)
    series = {f"{n} p99": [s[sc].get(n, {}).get("ttft_p99_ms") for sc in cats] for n in names}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(bar_chart_svg("TTFT p99 by scenario (median of rounds)", " ms", cats, series))


def publish(summary: dict, results: Path, write_docs: bool) -> None:
    text_ = section(summary)
    (results / "picker.md").write_text(text_ + "\n")
    write_chart(summary, results / "picker-ttft.svg")
    print(text_)
    if write_docs:
        doc = DOC.read_text()
        if BEGIN in doc and END in doc:
            doc = doc[: doc.index(BEGIN)] + text_ + doc[doc.index(END) + len(END):]
        else:
            doc = doc.rstrip() + "\n\n" + text_ + "\n"
        DOC.write_text(doc)
        write_chart(summary, CHART)
        print(f"wrote {DOC.relative_to(ROOT)} and {CHART.relative_to(ROOT)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small smoke run; docs untouched")
    parser.add_argument("--scenarios", default=",".join(SCENARIO_TARGETS))
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--rate", type=float, default=None, help="Poisson arrival rate, req/s")
    parser.add_argument("--num-gpu-blocks", type=int, default=None)
    parser.add_argument("--no-docs", action="store_true", help="leave docs/ alone")
    parser.add_argument("--picker", type=json.loads, default={},
                        help='JSON members of the picking pools\' picker, e.g. \'{"latency_weight": 2}\'')
    parser.add_argument("--results", type=Path, default=None,
                        help="directory for summary.json and the raw reports (default target/bench-results/picker-<stamp>)")
    args = parser.parse_args(argv)
    PICKER.update(args.picker)
    s = QUICK if args.quick else FULL
    s = Settings(**{**s.__dict__, **{k: v for k, v in (("rounds", args.rounds), ("rate", args.rate),
                                                        ("num_gpu_blocks", args.num_gpu_blocks)) if v}})
    scenarios = [x for x in args.scenarios.split(",") if x]
    unknown = set(scenarios) - set(SCENARIO_TARGETS)
    if unknown:
        parser.error(f"unknown scenarios {sorted(unknown)}")
    if not BENCH_BIN.exists():
        parser.error(f"{BENCH_BIN} missing: make build")
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    raw = args.results or TARGET / "bench-results" / f"picker-{stamp}"
    raw.mkdir(parents=True, exist_ok=True)
    shared = shared_prefix_workload(s.groups, s.conversations, s.turns, s.system_tokens, user_tokens=60,
                                    reply_tokens=100, max_tokens=64, seed=SEED)
    rand = random_workload(shared, SEED + 1)
    results: dict[str, dict[str, list[dict]]] = {}
    started = time.monotonic()
    for scenario in scenarios:
        targets = SCENARIO_TARGETS[scenario]
        results[scenario] = {t: [] for t in targets}
        for r in range(s.rounds):
            order = targets[r % len(targets):] + targets[: r % len(targets)]
            for target in order:
                t0 = time.monotonic()
                if scenario == "cost":
                    row = cost_run(target, s, raw, r)
                else:
                    workload = rand if scenario in ("b", "c") else shared
                    row = one_run(scenario, target, workload, s, raw, r)
                results[scenario][target].append(row)
                print(f"[{scenario} r{r} {target}] TTFT p50 {row['ttft_p50_ms']:.1f} ms p99 {row['ttft_p99_ms']:.1f} ms "
                      f"hit rate {row.get('hit_rate')} requests {row.get('requests')} failed {row['failed']} "
                      f"({time.monotonic() - t0:.0f} s)", flush=True)
    summary = {"finished_at": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
               "wall_s": time.monotonic() - started, "settings": s.__dict__, "results": results,
               "summary": summarize(results)}
    (raw / "summary.json").write_text(json.dumps(summary, indent=2))
    publish(summary, raw, write_docs=not (args.quick or args.no_docs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
