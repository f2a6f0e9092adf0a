"""Day-2 operations under load: every change an operator makes to a running gateway, with no
request lost.

One gateway, rendered by gatewayctl and run as an operator would (tests/stack.py starts the
processes): Envoy under the rendered hot-restarter (`envoy.hot_restart`), the filter's live
configuration (`envoy.live_config`), two sidecar replicas (`sidecar.replicas: 2`) that reload
their files, redis-server, a simulated vLLM. For each change, 20 streams of 6 to 12 s (60 to 120
tokens, 100 ms apart) are open and a short request starts every 100 ms throughout; the change is
made about 1.5 s after the streams open:

    limit change         the tenant's requests_per_minute changed, `gatewayctl apply`
    tenant added         a new tenant and its key, `gatewayctl apply` (its key answered 200 at once)
    key added            `gatewayctl keys add`, `gatewayctl apply` (the new key answered 200)
    key revoked          `gatewayctl keys revoke`, `gatewayctl apply`, while the key is polled on an
                         open keep-alive connection: the time until it is refused
    sidecar upgrade      each replica in turn: SIGTERM, wait for its exit, a new process on its port
    filter upgrade       the filter module replaced by another build (a new file), `gatewayctl apply`
    Envoy hot restart    SIGHUP to the hot-restarter: the next epoch takes the listener

Every row reports the streams completed ([DONE] after every token), the short requests failed,
the usage records Redis holds against the requests served, and for the revocation the time to
refusal. Results: target/bench-results/day2-<stamp>.json and, unless --no-docs, the table between
the `day2-benchmark` markers of docs/operations.md.

    .venv/bin/python bench/day2.py            # every change (about 3 minutes)
    .venv/bin/python bench/day2.py --changes limit,envoy --no-docs
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import redis
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from helpers import auth, chat_body, wait_for  # noqa: E402
from stack import WASM_PATH, Model, Pool, Stack, Tenant, envoy_binary, free_port, new_api_key, sha256_hex  # noqa: E402
from test_upgrades import HotRestartStack, sidecar_health  # noqa: E402

GATEWAYCTL = ROOT / "target" / "release" / "gatewayctl"
DOCS = ROOT / "docs" / "operations.md"
BEGIN, END = "<!-- day2-benchmark:begin -->", "<!-- day2-benchmark:end -->"
MODEL, TENANT = "model-d", "main"
STREAMS = 20
SHORT_EVERY_S = 0.1
CHANGE_AFTER_S = 1.5
ITL_MS = 100
GRACE_MS = 15000
CHANGES = ["limit", "tenant", "key-added", "key-revoked", "sidecar", "filter", "envoy"]
LABELS = {"limit": "limit change", "tenant": "tenant added", "key-added": "key added",
          "key-revoked": "key revoked", "sidecar": "sidecar upgrade (2 replicas, one at a time)",
          "filter": "filter module upgrade", "envoy": "Envoy upgrade by hot restart"}


def gatewayctl(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run([str(GATEWAYCTL), *args], capture_output=True, text=True, timeout=60)
    if check and r.returncode != 0:
        raise RuntimeError(f"gatewayctl {' '.join(args)}: {r.stderr}")
    return r


class Gateway:
    """The rendered gateway's files and its gateway.yaml, as HotRestartStack expects them."""

    def __init__(self, workdir: Path, key: str):
        self.workdir, self.key = workdir, key
        self.out = workdir / "out"
        self.path = workdir / "gateway.yaml"
        self.sidecar_port, self.metrics_port = free_port(), free_port()
        self.admin_port, self.envoy_port = free_port(), free_port()
        free_port()  # the replicas take the next ports: keep them off the pool's
        self.wasm = workdir / "filter-v1.wasm"
        shutil.copy(WASM_PATH, self.wasm)

    def config(self, stack: Stack) -> dict:
        hot = {"dir": str(self.out / "standalone"), "envoy_bin": str(envoy_binary()),
               "base_id": random.randrange(1000, 60000), "drain_time_s": 15, "parent_shutdown_time_s": 30,
               "concurrency": 2}
        return {
            "envoy": {"listen": f"127.0.0.1:{self.envoy_port}", "admin_port": self.admin_port,
                      "live_config": {"dir": str(self.workdir)}, "hot_restart": hot},
            "filter": {"wasm_file": str(self.wasm)},
            "sidecar": {"listen": f"127.0.0.1:{self.sidecar_port}", "replicas": 2,
                        "metrics_listen": f"127.0.0.1:{self.metrics_port}", "shutdown_grace_ms": GRACE_MS},
            "redis": {"url": f"redis://127.0.0.1:{stack.redis_port}/0", "failure_mode": "open"},
            "tenants": [{"id": TENANT, "api_keys": [{"name": "primary", "sha256": sha256_hex(self.key)}],
                         "limits": {"requests_per_minute": 100000, "tokens_per_minute": 100000000}}],
            "models": [{"name": MODEL, "pool": "pool_d", "max_model_len": 4096}],
            "pools": [{"name": "pool_d", "endpoints": [u.removeprefix("http://") for u in stack.pool("pool_d").urls]}],
        }

    def file(self, stack: Stack, name: str) -> dict:
        if not (self.out / "standalone" / name).exists():
            self.path.write_text(yaml.safe_dump(self.config(stack), sort_keys=False))
            gatewayctl("render", "--config", str(self.path), "--out", str(self.out), "--target", "standalone")
            gatewayctl("apply", "--config", str(self.path))
        return yaml.safe_load((self.out / "standalone" / name).read_text())

    def edit(self, change) -> None:
        config = yaml.safe_load(self.path.read_text())
        change(config)
        self.path.write_text(yaml.safe_dump(config, sort_keys=False))

    def apply(self) -> str:
        return gatewayctl("apply", "--config", str(self.path)).stdout.strip()


class Load:
    """20 long streams and a short request every 100 ms, until the streams end."""

    def __init__(self, base_url: str, key: str):
        self.base_url, self.key = base_url, key
        self.short: list[int | str] = []
        self.streams: list[tuple[int | str, bool]] = []
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=64)
        self._streams = ThreadPoolExecutor(max_workers=STREAMS)
        self._futures = []
        self._ticker = threading.Thread(target=self._every)

    def start(self) -> None:
        self._futures = [self._streams.submit(self._stream, random.randint(60, 120)) for _ in range(STREAMS)]
        self._ticker.start()

    def _every(self) -> None:
        while not self._stop.wait(SHORT_EVERY_S):
            self._pool.submit(self._short)

    def _short(self) -> None:
        try:
            r = httpx.post(self.base_url + "/v1/chat/completions", json=chat_body(MODEL, max_tokens=2),
                           headers=auth(self.key), timeout=30)
            self.short.append(r.status_code if r.status_code == 200 else f"{r.status_code} {r.text[:160]!r}")
        except httpx.HTTPError as e:
            self.short.append(f"error {e!r}")

    def _stream(self, tokens: int) -> tuple[int | str, bool]:
        body = chat_body(MODEL, "a long answer", stream=True, max_tokens=tokens)
        try:
            with httpx.stream("POST", self.base_url + "/v1/chat/completions", json=body, headers=auth(self.key),
                              timeout=60) as r:
                lines = [line for line in r.iter_lines() if line.startswith("data:")]
                # A chunk per token, then [DONE]: a stream cut short never ends with it.
                return r.status_code, len(lines) > tokens and lines[-1] == "data: [DONE]"
        except httpx.HTTPError as e:
            return f"error {e!r}", False

    def finish(self) -> None:
        self.streams = [f.result(timeout=90) for f in self._futures]
        time.sleep(0.5)
        self._stop.set()
        self._ticker.join()
        self._pool.shutdown(wait=True)
        self._streams.shutdown(wait=True)

    def served(self) -> int:
        return sum(1 for s in self.short if s == 200) + sum(1 for status, _ in self.streams if status == 200)


def records(stack: Stack) -> int:
    client = redis.Redis(port=stack.redis_port, decode_responses=True)
    return sum(int(client.hget(k, f"{MODEL}:requests") or 0) for k in client.scan_iter("llmgw:usage:{*}:*"))


def refusal_on_open_connection(base_url: str, key: str, result: dict, stop: threading.Event) -> None:
    """Polls `key` on one keep-alive connection every 20 ms: `result["refused_after_ms"]`, the
    time from `result["since"]` (when apply was started) to its first 401; its 200s in
    `result["served"]`."""
    with httpx.Client(base_url=base_url, timeout=10) as client:
        while not stop.is_set():
            r = client.post("/v1/chat/completions", json=chat_body(MODEL, max_tokens=1), headers=auth(key))
            since = result.get("since")
            if r.status_code == 200:
                result["served"] = result.get("served", 0) + 1
            elif r.status_code == 401 and since is not None:
                result["refused_after_ms"] = round(1000 * (time.monotonic() - since))
                return
            time.sleep(0.02)


def run_change(name: str, gw: Gateway, stack: HotRestartStack, replicas: list) -> dict:
    row: dict = {"change": name}
    revoked = new_api_key() if name == "key-revoked" else None
    if revoked:
        # A second key, live before the load starts, to be revoked under it; its first request's
        # record lands before the count starts.
        settled = records(stack)
        gw.edit(lambda c: c["tenants"][0]["api_keys"].append({"name": "doomed", "sha256": sha256_hex(revoked)}))
        gw.apply()
        assert wait_for(lambda: httpx.post(stack.base_url + "/v1/chat/completions", json=chat_body(MODEL, max_tokens=1),
                                           headers=auth(revoked), timeout=10).status_code == 200, timeout=15)
        wait_for(lambda: records(stack) > settled, timeout=15)
    before = records(stack)
    load = Load(stack.base_url, gw.key)
    load.start()
    time.sleep(CHANGE_AFTER_S)
    started = time.monotonic()
    row.update(make_change(name, gw, stack, replicas, revoked))
    row["change_took_ms"] = round(1000 * (time.monotonic() - started))
    load.finish()
    failed = [s for s in load.short if s != 200]
    row.update({
        "streams": len(load.streams), "streams_completed": sum(1 for s in load.streams if s == (200, True)),
        "short_sent": len(load.short), "short_failed": len(failed), "failures": failed[:5] + [
            s for s in load.streams if s != (200, True)][:5],
        "served": load.served() + row.pop("extra_served", 0),
    })
    wait_for(lambda: records(stack) - before >= row["served"], timeout=30)
    row["records"] = records(stack) - before
    return row


def make_change(name: str, gw: Gateway, stack: HotRestartStack, replicas: list, revoked: str | None) -> dict:
    if name == "limit":
        gw.edit(lambda c: c["tenants"][0]["limits"].update(requests_per_minute=90000))
        return {"apply": gw.apply()}
    if name == "tenant":
        key = new_api_key()
        gw.edit(lambda c: c["tenants"].append({"id": "newco", "api_keys": [{"name": "first", "sha256": sha256_hex(key)}],
                                               "limits": {"requests_per_minute": 1000}}))
        out = gw.apply()
        return {"apply": out, "new_key": poll_until_admitted(stack, key), "extra_served": 1}
    if name == "key-added":
        out = gatewayctl("keys", "add", "--config", str(gw.path), "--tenant", TENANT, "--name", "second").stdout
        key = next(w for w in out.split() if w.startswith("sk-"))
        applied = gw.apply()
        return {"apply": applied, "new_key": poll_until_admitted(stack, key), "extra_served": 1}
    if name == "key-revoked":
        result: dict = {}
        stop = threading.Event()
        poller = threading.Thread(target=refusal_on_open_connection, args=(stack.base_url, revoked, result, stop))
        poller.start()
        gatewayctl("keys", "revoke", "--config", str(gw.path), "--tenant", TENANT, "--name", "doomed")
        result["since"] = time.monotonic()
        out = gw.apply()
        poller.join(30)
        stop.set()
        poller.join()
        return {"apply": out, "refused_after_ms": result.get("refused_after_ms"), "extra_served": result.get("served", 0)}
    if name == "sidecar":
        return upgrade_sidecars(gw, stack, replicas)
    if name == "filter":
        new = gw.workdir / "filter-v2.wasm"
        shutil.copy(WASM_PATH, new)
        gw.edit(lambda c: c["filter"].update(wasm_file=str(new)))
        return {"apply": gw.apply()}
    if name == "envoy":
        epoch = stack.restart_epoch()
        stack.envoy.popen.send_signal(signal.SIGHUP)
        assert wait_for(lambda: stack.restart_epoch() == epoch + 1, timeout=30), stack.envoy_log()
        return {"epoch": epoch + 1}
    raise ValueError(name)


def poll_until_admitted(stack: Stack, key: str) -> list[int]:
    seen: list[int] = []

    def admitted() -> bool:
        seen.append(httpx.post(stack.base_url + "/v1/chat/completions", json=chat_body(MODEL, max_tokens=1),
                               headers=auth(key), timeout=10).status_code)
        return seen[-1] == 200
    wait_for(admitted, timeout=15, interval=0.02)
    return sorted(set(seen))


def upgrade_sidecars(gw: Gateway, stack: HotRestartStack, replicas: list) -> dict:
    ports = [gw.sidecar_port, gw.sidecar_port + 1]
    both = lambda: sidecar_health(stack) == {ports[0]: "healthy", ports[1]: "healthy"}  # noqa: E731
    took = []
    for k in range(2):
        started = time.monotonic()
        replicas[k].popen.send_signal(signal.SIGTERM)
        replicas[k].popen.wait(timeout=GRACE_MS / 1000 + 15)
        took.append(round(time.monotonic() - started, 1))
        replicas[k] = start_replica(stack, gw, k, f"sidecar-{k}-v2")
        assert wait_for(both, timeout=20), sidecar_health(stack)
    return {"drained_s": took}


def start_replica(stack: Stack, gw: Gateway, k: int, name: str):
    """Sidecar replica `k` on its live file (the one `gatewayctl apply` swaps), once it listens."""
    path = gw.workdir / ("sidecar.yaml" if k == 0 else f"sidecar-{k}.yaml")
    proc = stack._spawn(name, [str(stack.sidecar_bin), "--config", str(path)], stdout_pipe=True)
    stack._read_banner(proc, "gateway-ext-proc listening on")
    return proc


def markdown(rows: list[dict], stamp: str) -> str:
    lines = [f"Measured {stamp} on this machine (2 cores) with `.venv/bin/python bench/day2.py`: one run, "
             f"{STREAMS} streams of 6 to 12 s open and a short request every 100 ms through each change.", "",
             "| change | streams completed | new requests failed | usage records / requests served | revoked key refused on an open connection |",
             "|---|---|---|---|---|"]
    for r in rows:
        refused = f"{r['refused_after_ms']} ms" if r.get("refused_after_ms") is not None else ""
        lines.append(f"| {LABELS[r['change']]} | {r['streams_completed']}/{r['streams']} | "
                     f"{r['short_failed']} of {r['short_sent']} | {r['records']} / {r['served']} | {refused} |")
    return "\n".join(lines) + "\n"


def write_docs(text: str) -> None:
    doc = DOCS.read_text()
    start, end = doc.index(BEGIN) + len(BEGIN), doc.index(END)
    DOCS.write_text(doc[:start] + "\n" + text + doc[end:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--changes", default=",".join(CHANGES), help="comma-separated, of " + ", ".join(CHANGES))
    parser.add_argument("--no-docs", action="store_true", help="do not rewrite docs/operations.md")
    parser.add_argument("--quick", action="store_true", help="accepted for `make bench BENCH_ARGS=--quick`: the same run")
    args = parser.parse_args()
    changes = [c for c in args.changes.split(",") if c]
    unknown = set(changes) - set(CHANGES)
    if unknown:
        parser.error(f"unknown changes: {sorted(unknown)}")
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    workdir = Path(__import__("tempfile").mkdtemp(prefix="day2-"))
    key = new_api_key()
    gw = Gateway(workdir, key)
    pool = [Pool("pool_d", [MODEL], ["--ttft-ms", "50", "--itl-ms", str(ITL_MS), "--output-tokens", "120"])]
    stack = HotRestartStack(workdir, pool, [Model(MODEL, "pool_d")], [Tenant(TENANT, [key], {})],
                            sidecar_config_from=lambda s: gw.file(s, "sidecar.yaml"))
    stack.rendered, stack.admin_port, stack.envoy_port = gw, gw.admin_port, gw.envoy_port
    rows = []
    with stack:
        replicas = [next(p for p in stack.procs if p.name == "sidecar"), start_replica(stack, gw, 1, "sidecar-1")]
        ports = [gw.sidecar_port, gw.sidecar_port + 1]
        assert wait_for(lambda: sidecar_health(stack) == {ports[0]: "healthy", ports[1]: "healthy"}, timeout=20), \
            sidecar_health(stack)
        for name in changes:
            row = run_change(name, gw, stack, replicas)
            print(json.dumps(row), flush=True)
            rows.append(row)
    out = ROOT / "target" / "bench-results" / f"day2-{datetime.datetime.now(datetime.UTC):%Y%m%dT%H%M%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=2))
    text = markdown(rows, stamp)
    print(text)
    if not args.no_docs:
        write_docs(text)
    bad = [r for r in rows if r["streams_completed"] != r["streams"] or r["short_failed"] or r["records"] != r["served"]
           or (r["change"] == "key-revoked" and (r.get("refused_after_ms") or 10**9) > 1000)]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
