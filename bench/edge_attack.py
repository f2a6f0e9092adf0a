"""What the edge settings of envoy/bootstrap.yaml protect: slow clients against one gateway.

Starts the gateway (Envoy + wasm filter + sidecar + redis-server) in front of one paced `vllm-sim`
upstream, once per configuration, and measures normal traffic (`gateway-bench`, streamed chat at
a fixed concurrency) first unloaded, then while an attacker (a separate process) holds

  * `--slow-header-conns` connections that send their request headers one line every
    `--header-interval-s` and never finish them (slowloris), and
  * `--body-clients` connections that send valid headers announcing a `--body-bytes` body and
    then trickle it over `--attack-s` seconds (slow POST),

reconnecting 1 s after Envoy answers or closes one. Envoy's heap (admin `/memory`, tcmalloc's allocated
bytes) and resident memory (`/proc/<pid>/status` VmRSS) are sampled every 0.25 s.

Configurations (`--configs`):

    before      envoy/bootstrap.yaml without its edge settings (no overload manager, no request
                headers or request timeout, Envoy's default header and HTTP/2 limits)
    after       the edge settings as rendered by default (gatewayctl `envoy.edge` defaults)
    after-heap  the same with a heap limit of `--small-heap-mib` (default 256 MiB), to see the
                overload manager's actions act

    .venv/bin/python bench/edge_attack.py                      # all three, ~6 min
    .venv/bin/python bench/edge_attack.py --configs before,after --attack-s 60
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from stack import EDGE_DEFAULTS, TARGET, Model, Pool, Stack, Tenant, new_api_key  # noqa: E402

BENCH_BIN = TARGET / "release" / "gateway-bench"
MODEL = "m"
# An attacking connection that Envoy answered or closed is opened again after this.
RECONNECT_BACKOFF_S = 1.0
# The HTTP connection manager settings that envoy/bootstrap.yaml adds for the edge.
HCM_EDGE_KEYS = (
    "request_headers_timeout", "request_timeout", "max_request_headers_kb",
    "common_http_protocol_options", "http2_protocol_options", "normalize_path", "merge_slashes",
    "path_with_escaped_slashes_action",
)


# ------------------------------------------------------------------------------------ attacker

async def open_counted(port: int, stats: dict):
    """A connection to Envoy, counted in `stats`; None (after 1 s) when it cannot be opened."""
    try:
        conn = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        stats["connect_failed"] += 1
        await asyncio.sleep(1)
        return None
    stats["opened"] += 1
    return conn


async def slow_headers(port: int, interval_s: float, stop: float, stats: dict) -> None:
    """One slowloris connection at a time, reconnecting when Envoy closes it."""
    while time.monotonic() < stop:
        conn = await open_counted(port, stats)
        if conn is None:
            continue
        reader, writer = conn
        try:
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\n")
            await writer.drain()
            i = 0
            while time.monotonic() < stop:
                try:
                    # Any answer (408) or a close ends this connection.
                    await asyncio.wait_for(reader.read(4096), timeout=interval_s)
                    stats["closed_by_envoy"] += 1
                    break
                except asyncio.TimeoutError:
                    writer.write(f"x-slow-{i}: {'a' * 16}\r\n".encode())
                    await writer.drain()
                    i += 1
        except OSError:
            stats["closed_by_envoy"] += 1
        finally:
            writer.close()
        await asyncio.sleep(RECONNECT_BACKOFF_S)


async def slow_body(port: int, key: str, body_bytes: int, attack_s: float, stop: float, stats: dict) -> None:
    """One slow-POST connection at a time: valid headers, a body trickled over attack_s."""
    chunk = 4096
    delay = attack_s / (body_bytes / chunk)
    while time.monotonic() < stop:
        conn = await open_counted(port, stats)
        if conn is None:
            continue
        reader, writer = conn
        head = ('{"model": "%s", "max_tokens": 4, "messages": [{"role": "user", "content": "' % MODEL).encode()
        body = head + b"a" * (body_bytes - len(head) - 4) + b'"}]}'
        try:
            writer.write((f"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer {key}\r\n"
                          f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n").encode())
            sent = 0
            read = asyncio.ensure_future(reader.read(4096))
            while sent < len(body) and time.monotonic() < stop:
                writer.write(body[sent:sent + chunk])
                await writer.drain()
                sent += chunk
                done, _ = await asyncio.wait([read], timeout=delay)
                if done:
                    stats["closed_by_envoy"] += 1
                    break
            read.cancel()
        except OSError:
            stats["closed_by_envoy"] += 1
        finally:
            writer.close()
        await asyncio.sleep(RECONNECT_BACKOFF_S)


async def attack(port: int, key: str, args: argparse.Namespace) -> dict:
    stop = time.monotonic() + args.attack_s
    headers = {"opened": 0, "closed_by_envoy": 0, "connect_failed": 0}
    bodies = {"opened": 0, "closed_by_envoy": 0, "connect_failed": 0}
    tasks = [slow_headers(port, args.header_interval_s, stop, headers) for _ in range(args.slow_header_conns)]
    body_key = key if args.body_key == "valid" else "sk-not-a-tenant-key"
    tasks += [slow_body(port, body_key, args.body_bytes, args.attack_s, stop, bodies) for _ in range(args.body_clients)]
    await asyncio.gather(*tasks, return_exceptions=True)
    return {"slow_headers": headers, "slow_bodies": bodies}


# ------------------------------------------------------------------------------------ harness

class Sampler(threading.Thread):
    """Envoy's heap (tcmalloc allocated bytes) and RSS, sampled every 0.25 s; keeps the peaks."""

    def __init__(self, stack: Stack):
        super().__init__(daemon=True)
        self.stack, self.pid = stack, stack.envoy.popen.pid
        self.peak_heap = self.peak_rss = 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.25):
            try:
                with urllib.request.urlopen(self.stack.admin_url + "/memory", timeout=2) as r:
                    self.peak_heap = max(self.peak_heap, int(json.load(r)["allocated"]))
                status = Path(f"/proc/{self.pid}/status").read_text()
                rss_kb = int(next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1])
                self.peak_rss = max(self.peak_rss, rss_kb * 1024)
            except (OSError, ValueError, StopIteration):
                pass


def normal_traffic(stack: Stack, key: str, args: argparse.Namespace, out: Path, duration_s: float) -> dict:
    cmd = [str(BENCH_BIN), "--base-url", stack.base_url, "--api-key", key, "--model", MODEL,
           "--max-concurrency", str(args.concurrency), "--duration-s", str(duration_s),
           "--num-prompts", "100000", "--input-len", "64", "--output-len", "32", "--timeout-s", "30",
           "--output-json", str(out)]
    subprocess.run(cmd, check=True, capture_output=True)
    report = json.loads(out.read_text())
    point = report["points"][0] if "points" in report else report
    return point


def pick(point: dict, metric: str, stat: str) -> float | None:
    """A percentile in ms out of a gateway-bench point (`ttft_ms.p99_ms`)."""
    value = point.get(f"{metric}_ms", {}).get(f"{stat}_ms")
    return float(value) if value is not None else None


def strip_edge(bootstrap: dict) -> dict:
    bootstrap.pop("overload_manager", None)
    hcm = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    for k in HCM_EDGE_KEYS:
        hcm.pop(k, None)
    return bootstrap


class BeforeStack(Stack):
    """The gateway as it was before the edge settings (and before the filter's upload slots)."""

    def filter_config(self) -> dict:
        return {**super().filter_config(), "max_uploads_per_tenant": 1 << 31}

    def envoy_config(self) -> dict:
        return strip_edge(super().envoy_config())


def run_config(name: str, args: argparse.Namespace, workdir: Path) -> dict:
    # Normal traffic is one tenant's, the attack another's (its key, or none that authenticates).
    key, attacker_key = new_api_key(), new_api_key()
    pools = [Pool("pool_e", [MODEL], ["--ttft-ms", "20", "--itl-ms", "5", "--output-tokens", "32"])]
    models = [Model(MODEL, "pool_e")]
    edge = dict(EDGE_DEFAULTS)
    if name == "after-heap":
        edge["MAX_HEAP_BYTES"] = args.small_heap_mib << 20
    kind = BeforeStack if name == "before" else Stack
    tenants = [Tenant("normal", [key]), Tenant("attacker", [attacker_key])]
    stack = kind(workdir / name, pools, models, tenants, edge=edge)
    with stack:
        port = int(stack.base_url.rsplit(":", 1)[1])
        normal_traffic(stack, key, args, workdir / f"{name}-warmup.json", 5)
        unloaded = normal_traffic(stack, key, args, workdir / f"{name}-unloaded.json", args.normal_s)
        sampler = Sampler(stack)
        sampler.start()
        attacker = subprocess.Popen(
            [sys.executable, __file__, "--attacker", str(port), attacker_key, json.dumps(vars(args))],
            stdout=subprocess.PIPE, text=True)
        time.sleep(args.ramp_s)  # the attack builds up before normal traffic is measured
        loaded = normal_traffic(stack, key, args, workdir / f"{name}-loaded.json", args.normal_s)
        attack_stats = json.loads(attacker.communicate()[0] or "{}")
        sampler.done.set()
        sampler.join()
        overload = {}
        with urllib.request.urlopen(stack.admin_url + "/stats?filter=overload|downstream_rq_overload|"
                                    "rq_timeout|headers_timeout|global_cx_overflow", timeout=5) as r:
            for line in r.read().decode().splitlines():
                k, _, v = line.partition(": ")
                if v.strip().isdigit() and int(v) > 0:
                    overload[k] = int(v)
        alive = stack.envoy.alive()
    return {"config": name, "unloaded": unloaded, "loaded": loaded, "peak_heap": sampler.peak_heap,
            "peak_rss": sampler.peak_rss, "attack": attack_stats, "envoy_stats": overload,
            "envoy_alive": alive, "heap_limit": edge["MAX_HEAP_BYTES"] if name != "before" else None}


def row(r: dict) -> str:
    def ms(point, stat):
        v = pick(point, "ttft", stat)
        return f"{v:.1f}" if v is not None else "?"
    un99, lo99 = pick(r["unloaded"], "ttft", "p99"), pick(r["loaded"], "ttft", "p99")
    ratio = f"{lo99 / un99:.2f}×" if un99 and lo99 else "?"
    errors = f"{r['loaded'].get('failed', '?')} of {r['loaded'].get('sent', '?')}"
    limit = f"{r['heap_limit'] >> 20} MiB" if r["heap_limit"] else "none"
    return (f"| {r['config']} | {limit} | {r['peak_heap'] / 2**20:.0f} MiB | {r['peak_rss'] / 2**20:.0f} MiB "
            f"| {ms(r['unloaded'], 'p50')} / {ms(r['unloaded'], 'p99')} | {ms(r['loaded'], 'p50')} / "
            f"{ms(r['loaded'], 'p99')} | {ratio} | {errors} "
            f"| {r['attack'].get('slow_headers', {}).get('closed_by_envoy', '?')} "
            f"| {r['attack'].get('slow_bodies', {}).get('closed_by_envoy', '?')} |")


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--attacker":
        port, key, args = int(sys.argv[2]), sys.argv[3], argparse.Namespace(**json.loads(sys.argv[4]))
        print(json.dumps(asyncio.run(attack(port, key, args))))
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="before,after,after-heap")
    p.add_argument("--slow-header-conns", type=int, default=2000)
    p.add_argument("--header-interval-s", type=float, default=5.0)
    p.add_argument("--body-clients", type=int, default=200)
    p.add_argument("--body-bytes", type=int, default=4 << 20)
    p.add_argument("--attack-s", type=float, default=90.0, help="how long the attack lasts (and each slow body)")
    p.add_argument("--ramp-s", type=float, default=30.0, help="attack time before normal traffic is measured")
    p.add_argument("--normal-s", type=float, default=40.0, help="seconds of normal traffic per measurement")
    p.add_argument("--concurrency", type=int, default=8, help="normal traffic's concurrency")
    p.add_argument("--small-heap-mib", type=int, default=256)
    p.add_argument("--body-key", choices=["valid", "invalid"], default="valid",
                   help="the slow bodies' API key: a tenant's (valid) or none that authenticates")
    args = p.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="edge-attack-"))
    results = [run_config(c, args, workdir) for c in args.configs.split(",")]
    (workdir / "results.json").write_text(json.dumps(results, indent=1))
    print(f"raw reports: {workdir}")
    print("| config | heap limit | peak heap | peak RSS | TTFT p50 / p99 unloaded (ms) | TTFT p50 / p99 "
          "under attack (ms) | p99 ratio | normal-traffic errors | slowloris conns closed | slow-body conns closed |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(row(r))
        print(f"<!-- {r['config']}: envoy alive={r['envoy_alive']} stats={json.dumps(r['envoy_stats'])} -->")
    return 0


if __name__ == "__main__":
    sys.exit(main())
