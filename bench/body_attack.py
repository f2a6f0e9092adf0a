"""What one tenant's large bodies cost another tenant: a victim's latency while attackers send
4 MiB bodies through the same gateway.

Starts the gateway (Envoy with 2 workers + wasm filter + sidecar + redis-server) in front of one
`vllm-sim`, then measures a victim tenant's non-streamed chat requests (one at a time, `--victim-s`
seconds), first with no attack, then while `--attackers` processes of another tenant (processes,
so that they take no interpreter time from the victim's client) each send, one after the other, a
4 MiB body of the attacker's shape:

    members     a one-word chat request padded with small top-level members (`"k1":0,`), which
                the filter refuses 400 too_many_members after walking it
    over-rpm    a valid 4 MiB chat request (one 4 MiB member the filter does not read) of a
                tenant already over its requests-per-minute limit, which the filter refuses 429
                at its headers once the sidecar has told it (admission leases on)

Prints one JSON line per scenario and a Markdown table (victim p50 / p99 / max and requests over
100 ms, unloaded and under attack, and the p99 ratio).

    .venv/bin/python bench/body_attack.py                   # both scenarios, ~2 min
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from stack import Model, Pool, Stack, Tenant, new_api_key  # noqa: E402

MODEL = "m"
VICTIM, ATTACKER = new_api_key(), new_api_key()
BODY_BYTES = 4 * 1024 * 1024 - 64


def members_body() -> bytes:
    head = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})[:-1]
    parts, total, i = [head], len(head), 0
    while total < BODY_BYTES - 16:
        member = f',"k{i}":0'
        parts.append(member)
        total += len(member)
        i += 1
    return ("".join(parts) + "}").encode()


def junk_body() -> bytes:
    pad = "x" * (BODY_BYTES - 120)
    return (f'{{"model":"{MODEL}","messages":[{{"role":"user","content":"hi"}}],"max_tokens":1,'
            f'"junk":"{pad}"}}').encode()


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def victim(base_url: str, seconds: float) -> list[float]:
    """Latencies (ms) of the victim's requests, one at a time, for `seconds`."""
    out = []
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
    with httpx.Client(timeout=30) as c:
        stop = time.monotonic() + seconds
        while time.monotonic() < stop:
            t = time.monotonic()
            r = c.post(base_url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {VICTIM}"})
            if r.status_code != 200:
                raise SystemExit(f"victim: {r.status_code} {r.text[:200]}")
            out.append((time.monotonic() - t) * 1000)
    return out


def attack(base_url: str, key: str, scenario: str, rate: float, stop, results) -> None:
    """One attacker process: sends its body until `stop` is set (at most `rate` a second; 0: as
    fast as it is answered), then puts its answers' counts."""
    body = members_body() if scenario == "members" else junk_body()
    counts: dict = {}
    next_at = time.monotonic()
    with httpx.Client(timeout=60) as c:
        while not stop.is_set():
            if rate > 0:
                next_at += 1 / rate
                time.sleep(max(0.0, next_at - time.monotonic()))
            try:
                r = c.post(base_url + "/v1/chat/completions", content=body,
                           headers={"authorization": f"Bearer {key}", "content-type": "application/json"})
                counts[str(r.status_code)] = counts.get(str(r.status_code), 0) + 1
            except httpx.HTTPError:
                counts["error"] = counts.get("error", 0) + 1
    results.put(counts)


def summary(lat: list[float]) -> dict:
    return {"requests": len(lat), "p50_ms": round(percentile(lat, 0.5), 2), "p99_ms": round(percentile(lat, 0.99), 2),
            "max_ms": round(max(lat), 2), "over_100ms": sum(1 for x in lat if x > 100)}


def run(scenario: str, args: argparse.Namespace, workdir: Path) -> dict:
    attacker_limits = {"requests_per_minute": 2, "request_burst": 2} if scenario == "over-rpm" else {}
    tenants = [Tenant("victim", [VICTIM]), Tenant("attacker", [ATTACKER], attacker_limits)]
    overrides = {"redis": {"lease_fraction": 0.01, "lease_ttl_ms": 2000}}
    pools = [Pool("p", ["sim/m"], ["--output-tokens", "4", "--ttft-ms", "5", "--itl-ms", "2"])]
    with Stack(workdir / scenario, pools, [Model(MODEL, "p", 4096, served_model_name="sim/m")], tenants,
               sidecar_overrides=overrides, admission_leases=True) as s:
        assert s.base_url
        victim(s.base_url, 2)  # warm up
        unloaded = victim(s.base_url, args.victim_s)
        mp = multiprocessing.get_context("spawn")
        stop, results = mp.Event(), mp.Queue()
        procs = [mp.Process(target=attack, args=(s.base_url, ATTACKER, scenario, args.attack_rate, stop, results))
                 for _ in range(args.attackers)]
        for p in procs:
            p.start()
        time.sleep(2)  # the attack under way (and, over-rpm, the tenant's limit reached)
        loaded = victim(s.base_url, args.victim_s)
        stop.set()
        counts: dict = {}
        for _ in procs:
            for k, v in results.get(timeout=120).items():
                counts[k] = counts.get(k, 0) + v
        for p in procs:
            p.join(60)
    result = {"scenario": scenario, "attackers": args.attackers, "attack_rate": args.attack_rate,
              "unloaded": summary(unloaded),
              "attacked": summary(loaded), "attacker_answers": {str(k): v for k, v in counts.items()}}
    result["p99_ratio"] = round(result["attacked"]["p99_ms"] / result["unloaded"]["p99_ms"], 2)
    print(json.dumps(result), flush=True)
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenarios", default="members,over-rpm")
    p.add_argument("--attackers", type=int, default=3)
    p.add_argument("--attack-rate", type=float, default=0,
                   help="requests a second per attacker (0: each as soon as the last is answered)")
    p.add_argument("--victim-s", type=float, default=20)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="body-attack-") as tmp:
        results = [run(s, args, Path(tmp)) for s in args.scenarios.split(",")]
    print("| scenario | attack | victim p50 / p99 / max, unloaded | under attack | p99 ratio | victim requests over 100 ms | attacker's answers |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        u, a = r["unloaded"], r["attacked"]
        rate = f"{r['attackers']} × {r['attack_rate']:g}/s" if r["attack_rate"] else f"{r['attackers']} closed-loop"
        print(f"| {r['scenario']} | {rate} | {u['p50_ms']} / {u['p99_ms']} / {u['max_ms']} ms | {a['p50_ms']} / {a['p99_ms']} / "
              f"{a['max_ms']} ms | {r['p99_ratio']}× | {a['over_100ms']} of {a['requests']} | "
              f"{', '.join(f'{k}: {v}' for k, v in sorted(r['attacker_answers'].items()))} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
