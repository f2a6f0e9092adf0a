"""Usage through sidecar crashes: every served request recorded once (issue 14, "Usage survives
the sidecar").

Starts the real stack (redis-server, one vllm-sim, Envoy with the wasm filter, the gRPC access
log and the usage journal, the sidecar) and streams `--requests` chat completions through it
from `--concurrency` clients while sidecars are SIGKILLed (until `--requests` were served; a
refused request is sent again after 0.1 s):

  a) the only sidecar, killed `--kills` times (every `--kill-every-s`), started again after
     `--down-s` each time;
  b) two sidecars behind Envoy's ext_proc cluster (admission and access log go to both), the
     one holding the journal's lease killed once, `--kill-every-s` into the run, not restarted.

Requests that Envoy refuses while no sidecar answers (admission fails closed: 500) are not
served and not counted. Once the load is over, the ledger must hold one record per served
request: records (the tenant's daily `requests`) = served (200 and the stream's `[DONE]`), no
record id twice on the usage stream, and tokens recorded (prompt + completion) = the upstream's
(vllm-sim's `vllm:prompt_tokens_total` + `vllm:generation_tokens_total`).

    .venv/bin/python bench/ledger_faults.py                       # both scenarios, 1,500 requests each
    .venv/bin/python bench/ledger_faults.py --scenario a --requests 1500
    .venv/bin/python bench/ledger_faults.py --no-journal          # the gRPC access log alone, for comparison
    .venv/bin/python bench/ledger_faults.py --scenario none       # no fault: the journal's CPU cost

Scenario `none` kills nothing and reports the CPU seconds per 1,000 requests that Envoy, the
sidecar and Redis spent (from /proc), to compare the journal's cost with `--no-journal`.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import httpx  # noqa: E402
import redis  # noqa: E402
from sidecar_checks import usage_events, usage_hash  # noqa: E402
from stack import Model, Pool, Stack, Tenant, new_api_key, upstream_metric  # noqa: E402

TENANT = "faults"
MODEL = "model-f"
LEASE = "llmgw:journal-lease:{%s}"


class TwoSidecars(Stack):
    """A second sidecar (same config, same Redis, same journal) as a second endpoint of Envoy's
    ext_proc cluster: admission and the gRPC access log go to both."""

    second = None
    second_port: int | None = None

    def _start_sidecar(self, listen_port: int | None = None) -> None:
        super()._start_sidecar(listen_port)
        if self.second is None:
            self.second, self.second_port = self.start_second_sidecar()

    def envoy_config(self) -> dict:
        bootstrap = super().envoy_config()
        cluster = next(c for c in bootstrap["static_resources"]["clusters"] if c["name"] == "llm_gateway_ext_proc")
        endpoints = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
        second = copy.deepcopy(endpoints[0])
        second["endpoint"]["address"]["socket_address"]["port_value"] = self.second_port
        endpoints.append(second)
        # A dead replica leaves the rotation within a second (a deployment's health checks), so
        # the run's admissions go on through the survivor.
        cluster["common_lb_config"] = {"healthy_panic_threshold": {"value": 0}}
        cluster["health_checks"] = [{"timeout": "0.2s", "interval": "0.25s", "unhealthy_threshold": 1,
                                     "healthy_threshold": 1, "tcp_health_check": {}}]
        return bootstrap


async def drive(base_url: str, key: str, requests: int, concurrency: int, max_tokens: int, out: dict) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "count to twenty"}],
            "stream": True, "max_tokens": max_tokens}
    headers = {"authorization": f"Bearer {key}"}

    async def worker(client: httpx.AsyncClient) -> None:
        # Until `requests` streams were served; a refused request (no sidecar answered) is sent
        # again after a pause, as a client would.
        while out["served"] < requests:
            refused = out["refused"] + out["errors"]
            try:
                async with client.stream("POST", base_url + "/v1/chat/completions", json=body,
                                         headers=headers) as r:
                    done = False
                    async for line in r.aiter_lines():
                        if line.strip() == "data: [DONE]":
                            done = True
                    if r.status_code == 200 and done:
                        out["served"] += 1
                    else:
                        out["refused"] += 1
                        out.setdefault("statuses", {}).setdefault(r.status_code, 0)
                        out["statuses"][r.status_code] += 1
            except httpx.HTTPError as e:
                out["errors"] += 1
                out.setdefault("error_kinds", set()).add(type(e).__name__)
            if out["refused"] + out["errors"] > refused:
                await asyncio.sleep(0.1)

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def holder_of_lease(stack: Stack) -> int | None:
    value = redis.Redis(port=stack.redis_port, decode_responses=True).get(LEASE % stack.journal_path)
    return int(value.split("-")[0]) if value else None


def run(scenario: str, args: argparse.Namespace) -> dict:
    key = new_api_key()
    sim = ["--ttft-ms", "20", "--itl-ms", str(args.itl_ms), "--output-tokens", str(args.output_tokens),
           "--max-num-seqs", "1024"]
    pools = [Pool("pool_f", [MODEL], sim)]
    tenants = [Tenant(TENANT, [key], {"requests_per_minute": 1_000_000, "tokens_per_minute": 100_000_000})]
    workdir = Path(tempfile.mkdtemp(prefix=f"ledger-faults-{scenario}-"))
    cls = TwoSidecars if scenario == "b" else Stack
    stack = cls(workdir, pools, [Model(MODEL, "pool_f")], tenants, journal=not args.no_journal,
                sidecar_overrides={"metrics_listen": "127.0.0.1:0"})
    out = {"served": 0, "refused": 0, "errors": 0}
    kills: list[float] = []
    with stack:
        url = stack.pool("pool_f").urls[0]
        before = (upstream_metric(url, "vllm:prompt_tokens_total"), upstream_metric(url, "vllm:generation_tokens_total"))
        pids = {p.name: p.popen.pid for p in stack.procs if p.name in ("envoy", "sidecar", "redis")}
        cpu_before = {name: cpu_s(pid) for name, pid in pids.items()}
        started = time.monotonic()
        load = threading.Thread(target=lambda: asyncio.run(drive(
            stack.base_url, key, args.requests, args.concurrency, args.output_tokens, out)))
        load.start()

        def killer() -> None:
            n = {"a": args.kills, "b": 1, "none": 0}[scenario]
            for _ in range(n):
                time.sleep(args.kill_every_s)
                if not load.is_alive():
                    return
                if scenario == "a":
                    stack.kill_sidecar()
                    kills.append(time.monotonic() - started)
                    time.sleep(args.down_s)
                    stack.restart_sidecar()
                else:
                    # The replica holding the journal's lease (the first, if none holds it).
                    pid = holder_of_lease(stack)
                    victim = next((p for p in stack.procs if p.name.startswith("sidecar") and p.popen.pid == pid),
                                  next(p for p in stack.procs if p.name == "sidecar"))
                    victim.popen.send_signal(signal.SIGKILL)
                    victim.popen.wait(timeout=5)
                    kills.append(time.monotonic() - started)

        k = threading.Thread(target=killer)
        k.start()
        load.join()
        k.join()
        elapsed = time.monotonic() - started
        cpu = {}
        if scenario == "none":
            time.sleep(2)  # the journal's last flush and read
            cpu = {name: round((cpu_s(pid) - cpu_before[name]) / max(out["served"], 1) * 1000, 3)
                   for name, pid in pids.items()}
        client = redis.Redis(port=stack.redis_port, decode_responses=True)
        raw = redis.Redis(port=stack.redis_port)

        def recorded() -> tuple[int, int, int, int]:
            h = usage_hash(client, TENANT)
            events = usage_events(raw, TENANT)
            ids = [e["record_id"] for e in events]
            return (h.get(f"{MODEL}:requests", 0),
                    h.get(f"{MODEL}:prompt_tokens", 0) + h.get(f"{MODEL}:completion_tokens", 0),
                    len(ids), len(ids) - len(set(ids)))

        # The journal's lease may have to expire (scenario b) and Envoy flushes it every second.
        deadline = time.monotonic() + args.settle_s
        last = recorded()
        while time.monotonic() < deadline:
            time.sleep(1)
            now = recorded()
            if now == last and now[0] >= out["served"]:
                break
            last = now
        records, tokens, events, duplicates = recorded()
        upstream = (upstream_metric(url, "vllm:prompt_tokens_total") - before[0]
                    + upstream_metric(url, "vllm:generation_tokens_total") - before[1])
    return {"scenario": scenario, "journal": not args.no_journal, "requests": args.requests,
            "served": out["served"], "refused": out["refused"], "errors": out["errors"],
            "statuses": out.get("statuses", {}), "records": records, "events": events,
            "duplicates": duplicates, "tokens_recorded": tokens, "tokens_upstream": int(upstream),
            "kills_at_s": [round(t, 1) for t in kills], "cpu_s_per_1000": cpu, "elapsed_s": round(elapsed, 1), "workdir": str(workdir)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", choices=["a", "b", "both", "none"], default="both")
    p.add_argument("--requests", type=int, default=1500)
    p.add_argument("--concurrency", type=int, default=48)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--itl-ms", type=int, default=40)
    p.add_argument("--kills", type=int, default=3, help="scenario a: how many times the sidecar is killed")
    p.add_argument("--kill-every-s", type=float, default=5.0)
    p.add_argument("--down-s", type=float, default=2.0, help="scenario a: seconds without a sidecar each time")
    p.add_argument("--settle-s", type=float, default=30.0, help="most seconds to wait for the ledger after the load")
    p.add_argument("--no-journal", action="store_true", help="the gRPC access log alone (the old path)")
    args = p.parse_args()
    ok = True
    for scenario in (["a", "b"] if args.scenario == "both" else [args.scenario]):
        r = run(scenario, args)
        good = r["records"] == r["served"] and r["duplicates"] == 0 and r["tokens_recorded"] == r["tokens_upstream"]
        ok &= good
        print(f"scenario {scenario} ({'journal + gRPC access log' if r['journal'] else 'gRPC access log only'}): "
              f"{r['requests']} requests in {r['elapsed_s']} s, sidecar killed at {r['kills_at_s']} s")
        print(f"  served {r['served']}, refused {r['refused']} {r['statuses']}, client errors {r['errors']}")
        print(f"  records {r['records']}, usage events {r['events']}, duplicates {r['duplicates']}")
        print(f"  tokens recorded {r['tokens_recorded']}, upstream's {r['tokens_upstream']}")
        if r["cpu_s_per_1000"]:
            print(f"  CPU seconds per 1,000 requests: {r['cpu_s_per_1000']}")
        print(f"  {'OK' if good else 'MISMATCH'} (logs in {r['workdir']})", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
