"""Upgrades with no request lost, through gatewayctl's rendered standalone gateway: the real Envoy,
Redis, sidecars and a slow simulated vLLM.

1. Two sidecar replicas (`sidecar.replicas: 2`): with a request every 100 ms and long streams
   open, one replica gets SIGTERM, its replacement starts on its port, then the other gets
   SIGTERM. A draining replica reports NOT_SERVING to Envoy's gRPC health check and answers new
   admissions UNAVAILABLE, which the admission filter's retry policy retries on the other replica
   (ext-proc/src/grpc/health.rs, envoy/filters/ext_proc_admission.yaml): no request fails, every
   stream ends with [DONE], and the ledger holds one record per request served.
2. Envoy's hot restart (`envoy.hot_restart`): Envoy runs under the rendered hot-restarter.py and
   start-envoy.sh; with 20 streams open and requests flowing, SIGHUP (what `systemctl reload` sends)
   starts epoch 1, which takes the listener over while epoch 0 drains: every stream completes,
   no request fails, and every request is recorded. A SIGHUP with a config Envoy refuses starts
   no epoch, and epoch 1 serves on.

The sidecar test runs with admission leases off (`redis.lease_fraction: 0`: every request takes
the sidecar's admission, the path a sidecar upgrade can fail) and with gatewayctl's default leases
(the filter's lease calls go to the same replicas); the hot-restart test with leases off. The
measured counts are printed (`pytest -s`).
"""

from __future__ import annotations

import json
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import redis
import yaml
from helpers import auth, chat_body, envoy_counter, envoy_stats, wait_for
from stack import WASM_PATH, Model, Pool, Proc, Stack, Tenant, envoy_binary, free_port, free_port_run, new_api_key, sha256_hex
from test_deploy import gatewayctl

KEY = new_api_key()
TENANT = "upgrade"
MODEL = "model-u"
# 40 tokens 100 ms apart: a stream of about 4 s; a short request (2 tokens) about 150 ms.
SLOW = ["--ttft-ms", "50", "--itl-ms", "100", "--output-tokens", "40"]
STREAM_TOKENS = 40
GRACE_MS = 3000


def gateway_config(stack: Stack, sidecar_port: int, envoy: dict, replicas: int, leases: bool) -> dict:
    # Without `lease_fraction` gatewayctl's default leases: the filter admits most requests itself
    # from the leases the sidecar replicas grant (their gRPC calls on the same cluster).
    redis_section = {"url": f"redis://127.0.0.1:{stack.redis_port}/0", "failure_mode": "open",
                     **({} if leases else {"lease_fraction": 0})}
    return {
        "envoy": {"admin_port": 0, "listen": "127.0.0.1:0", **envoy},
        "filter": {"wasm_file": str(WASM_PATH)},
        "sidecar": {"listen": f"127.0.0.1:{sidecar_port}", "replicas": replicas, "shutdown_grace_ms": GRACE_MS,
                    "metering": {"journal_path": str(stack.journal_path)}},
        "redis": redis_section,
        "tenants": [{"id": TENANT, "api_keys_sha256": [sha256_hex(KEY)],
                     "limits": {"requests_per_minute": 100000, "tokens_per_minute": 100000000}}],
        "models": [{"name": MODEL, "pool": "pool_u", "max_model_len": 4096}],
        "pools": [{"name": "pool_u", "endpoints": [u.removeprefix("http://") for u in stack.pool("pool_u").urls]}],
    }


class Rendered:
    """gatewayctl's standalone files for a stack, rendered once the ports of Redis and the pool
    are known (when the stack starts its sidecar)."""

    def __init__(self, workdir: Path, sidecar_port: int, envoy: dict | None = None, replicas: int = 2,
                 leases: bool = False):
        self.workdir, self.sidecar_port, self.envoy, self.replicas = workdir, sidecar_port, envoy or {}, replicas
        self.leases = leases
        self.out = workdir / "out"

    def file(self, stack: Stack, name: str) -> dict:
        if not (self.out / "standalone" / name).exists():
            config = gateway_config(stack, self.sidecar_port, self.envoy, self.replicas, self.leases)
            path = self.workdir / "gateway.yaml"
            path.write_text(yaml.safe_dump(config, sort_keys=False))
            gatewayctl("render", "--config", str(path), "--out", str(self.out), "--target", "standalone")
        return yaml.safe_load((self.out / "standalone" / name).read_text())


def start_sidecar(stack: Stack, config: dict, name: str) -> Proc:
    """A sidecar process with `config` (its own file), once it listens."""
    path = stack.workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    proc = stack._spawn(name, [str(stack.sidecar_bin), "--config", str(path)], stdout_pipe=True)
    stack._read_banner(proc, "gateway-ext-proc listening on")
    return proc


def sidecar_health(stack: Stack) -> dict[int, str]:
    """Envoy's view of each sidecar replica: port → health flags ("healthy" when none)."""
    with urllib.request.urlopen(stack.admin_url + "/clusters?format=json", timeout=2) as r:
        clusters = json.load(r)["cluster_statuses"]
    (ext_proc,) = [c for c in clusters if c["name"] == "llm_gateway_ext_proc"]
    health = {}
    for host in ext_proc.get("host_statuses", []):
        port = host["address"]["socket_address"]["port_value"]
        flags = {k for k, v in host["health_status"].items() if v is True}
        health[port] = ",".join(sorted(flags)) or "healthy"
    return health


def records(stack: Stack) -> int:
    client = redis.Redis(port=stack.redis_port, decode_responses=True)
    return sum(int(client.hget(k, f"{MODEL}:requests") or 0) for k in client.scan_iter(f"llmgw:usage:{{{TENANT}}}:*"))


class Traffic:
    """A short request every 100 ms and a long stream every 400 ms, each on its own thread, until
    stopped; every outcome kept."""

    def __init__(self, base_url: str):
        self.base_url = base_url
        self.short: list[int | str] = []
        self.streams: list[tuple[int | str, int, bool]] = []  # status, data lines, [DONE] seen
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=64)
        self._loops = [threading.Thread(target=self._every, args=(0.1, self._short)),
                       threading.Thread(target=self._every, args=(0.4, self._stream))]

    def __enter__(self) -> Traffic:
        for loop in self._loops:
            loop.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _every(self, interval: float, send) -> None:
        while not self._stop.wait(interval):
            self._pool.submit(send)

    def _short(self) -> None:
        try:
            r = httpx.post(self.base_url + "/v1/chat/completions", json=chat_body(MODEL, max_tokens=2),
                           headers=auth(KEY), timeout=30)
            self.short.append(r.status_code if r.status_code == 200 else f"{r.status_code} {r.text[:200]!r}")
        except httpx.HTTPError as e:
            self.short.append(f"error {e!r}")

    def _stream(self) -> None:
        self.streams.append(stream_once(self.base_url))

    def stop(self) -> None:
        self._stop.set()
        for loop in self._loops:
            loop.join()
        self._pool.shutdown(wait=True)

    def failed(self) -> list:
        return [s for s in self.short if s != 200] + [s for s in self.streams if s != (200, STREAM_TOKENS + 2, True)]

    def sent(self) -> int:
        return len(self.short) + len(self.streams)


def stream_once(base_url: str) -> tuple[int | str, int, bool]:
    """One streamed request to its end: (status, data lines, whether [DONE] came)."""
    body = chat_body(MODEL, "stream me", stream=True, max_tokens=STREAM_TOKENS)
    try:
        with httpx.stream("POST", base_url + "/v1/chat/completions", json=body, headers=auth(KEY),
                          timeout=60) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data:")]
            return r.status_code, len(lines), bool(lines) and lines[-1] == "data: [DONE]"
    except httpx.HTTPError as e:
        return f"error {e!r}", 0, False


def sidecar_summary(stack: Stack) -> str:
    refused = []
    for proc in stack.procs:
        if proc.name.startswith("sidecar"):
            for line in proc.log.read_text(errors="replace").splitlines():
                if "admission streams refused while draining" in line:
                    refused.append(f"{proc.name}: refused {json.loads(line)['fields'].get('refused')}")
    return "; ".join(refused) or "no sidecar drained"


def failure_report(stack: Stack) -> str:
    return (f"{envoy_stats(stack, 'llm_gateway_ext_proc.(upstream_rq_retry|health_check|upstream_cx_connect_fail)')}"
            f"\n{stack.logs()}\n===== envoy\n{stack.envoy_log()}")


@pytest.fixture
def pool() -> list[Pool]:
    return [Pool("pool_u", ["model-u"], SLOW)]


@pytest.mark.parametrize("leases", [False, True], ids=["every-request-admitted", "admission-leases"])
def test_sidecar_replicas_restarted_one_at_a_time_lose_no_request(tmp_path, pool, leases):
    # Two replicas listen on consecutive ports.
    rendered = Rendered(tmp_path, free_port_run(2), leases=leases)
    with Stack(tmp_path, pool, [Model(MODEL, "pool_u")], [Tenant(TENANT, [KEY], {"requests_per_minute": 100000})],
               sidecar_config_from=lambda s: rendered.file(s, "sidecar.yaml"),
               envoy_config_from=lambda s: rendered.file(s, "envoy.yaml")) as stack:
        ports = [rendered.sidecar_port, rendered.sidecar_port + 1]
        replicas = [next(p for p in stack.procs if p.name == "sidecar"),
                    start_sidecar(stack, rendered.file(stack, "sidecar-1.yaml"), "sidecar-1")]
        both_healthy = lambda: sidecar_health(stack) == {ports[0]: "healthy", ports[1]: "healthy"}  # noqa: E731
        assert wait_for(both_healthy, timeout=15), (sidecar_health(stack), failure_report(stack))
        retries_before = envoy_counter(stack, "cluster.llm_gateway_ext_proc.upstream_rq_retry")
        with Traffic(stack.base_url) as traffic:
            assert wait_for(lambda: len(traffic.streams) + len(traffic.short) >= 10, timeout=10)
            for k, name in enumerate(["sidecar-0-new", "sidecar-1-new"]):
                started = time.monotonic()
                replicas[k].popen.send_signal(signal.SIGTERM)
                assert replicas[k].popen.wait(timeout=GRACE_MS / 1000 + 15) == 0, failure_report(stack)
                print(f"replica {k} drained and exited in {time.monotonic() - started:.1f} s")
                config = rendered.file(stack, "sidecar.yaml" if k == 0 else f"sidecar-{k}.yaml")
                replicas[k] = start_sidecar(stack, config, name)
                assert wait_for(both_healthy, timeout=15), (sidecar_health(stack), failure_report(stack))
            time.sleep(1)  # traffic on the two replacements for a second (the traffic is the assertion)
        failed, sent = traffic.failed(), traffic.sent()
        retries = envoy_counter(stack, "cluster.llm_gateway_ext_proc.upstream_rq_retry") - retries_before
        print(f"sidecar upgrade ({'admission leases' if leases else 'every request admitted'}): {sent} requests ({len(traffic.streams)} streams of {STREAM_TOKENS} tokens), "
              f"{len(failed)} failed, {retries} admissions retried on the other replica; {sidecar_summary(stack)}")
        assert not failed, (failed, failure_report(stack))
        assert wait_for(lambda: records(stack) == sent, timeout=20), (records(stack), sent, failure_report(stack))
        print(f"usage records: {records(stack)} of {sent} requests served")


class HotRestartStack(Stack):
    """The stack with Envoy run by gatewayctl's rendered hot-restarter.py and start-envoy.sh."""

    rendered: Rendered
    admin_port: int
    envoy_port: int

    def _start_envoy(self) -> None:
        standalone = self.rendered.out / "standalone"
        self.rendered.file(self, "envoy.yaml")
        self.envoy = self._spawn("envoy", [sys.executable, str(standalone / "hot-restarter.py"),
                                           str(standalone / "start-envoy.sh")])
        self.admin_url = f"http://127.0.0.1:{self.admin_port}"
        self.base_url = f"http://127.0.0.1:{self.envoy_port}"
        self._wait_http(self.envoy, self.admin_url + "/ready", expect=b"LIVE")

    def restart_epoch(self) -> int:
        """The epoch serving the admin port once LIVE; -1 while none does (the old epoch closes
        its admin listener before the new one binds it)."""
        try:
            with urllib.request.urlopen(self.admin_url + "/server_info", timeout=2) as r:
                info = json.load(r)
        except OSError:
            return -1
        return int(info["command_line_options"]["restart_epoch"]) if info["state"] == "LIVE" else -1


def test_envoy_hot_restart_keeps_every_stream_and_request(tmp_path, pool):
    admin_port, envoy_port = free_port(), free_port()
    hot = {"dir": str(tmp_path / "out" / "standalone"), "envoy_bin": str(envoy_binary()),
           # A base id of its own: the shared memory and domain sockets of the epochs.
           "base_id": random.randrange(1000, 60000), "drain_time_s": 2, "parent_shutdown_time_s": 15,
           "concurrency": 2}
    envoy = {"listen": f"127.0.0.1:{envoy_port}", "admin_port": admin_port, "hot_restart": hot}
    rendered = Rendered(tmp_path, free_port(), envoy, replicas=1)
    stack = HotRestartStack(tmp_path, pool, [Model(MODEL, "pool_u")], [Tenant(TENANT, [KEY], {})],
                            sidecar_config_from=lambda s: rendered.file(s, "sidecar.yaml"))
    stack.rendered, stack.admin_port, stack.envoy_port = rendered, admin_port, envoy_port
    with stack:
        assert stack.restart_epoch() == 0
        streams: list = []
        with ThreadPoolExecutor(max_workers=20) as open_streams, Traffic(stack.base_url) as traffic:
            futures = [open_streams.submit(stream_once, stack.base_url) for _ in range(20)]
            assert wait_for(lambda: envoy_counter(stack, "cluster.pool_u.upstream_rq_active") >= 20, timeout=10), \
                failure_report(stack)
            stack.envoy.popen.send_signal(signal.SIGHUP)  # what `systemctl reload llm-gateway-envoy` sends
            assert wait_for(lambda: stack.restart_epoch() == 1, timeout=20), failure_report(stack)
            streams = [f.result(timeout=60) for f in futures]
            time.sleep(1)  # requests on epoch 1 for a second (the traffic is the assertion)
        failed = traffic.failed() + [s for s in streams if s != (200, STREAM_TOKENS + 2, True)]
        sent = traffic.sent() + len(streams)
        print(f"envoy hot restart: {len(streams)} streams open across it, {sum(s[2] for s in streams)} completed; "
              f"{sent} requests in all, {len(failed)} failed")
        assert not failed, (failed, failure_report(stack))
        assert wait_for(lambda: records(stack) == sent, timeout=20), (records(stack), sent, failure_report(stack))
        print(f"usage records: {records(stack)} of {sent} requests served")
        assert "epoch 1 started" in stack.envoy.log.read_text()
        # A config Envoy refuses starts no epoch (checked with --mode validate first): epoch 1 serves on.
        envoy_yaml = rendered.out / "standalone" / "envoy.yaml"
        envoy_yaml.write_text(envoy_yaml.read_text() + "\nnot_a_bootstrap_field: 1\n")
        stack.envoy.popen.send_signal(signal.SIGHUP)
        assert wait_for(lambda: "epoch 2 not started" in stack.envoy.log.read_text(), timeout=60), \
            failure_report(stack)
        assert stack.restart_epoch() == 1
        r = httpx.post(stack.base_url + "/v1/chat/completions", json=chat_body(MODEL, max_tokens=2),
                       headers=auth(KEY), timeout=30)
        assert r.status_code == 200, (r.text, failure_report(stack))


def test_rendered_systemd_unit_verifies(tmp_path):
    """The rendered unit as systemd reads it (`systemd-analyze verify`: its syntax, and that the
    quoted ExecStart names an executable)."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("no systemd-analyze")
    out = tmp_path / "out"
    hot = {"dir": str(out / "standalone"), "envoy_bin": str(envoy_binary()), "python": sys.executable}
    config = {
        "envoy": {"listen": "127.0.0.1:18080", "admin_port": 18901, "hot_restart": hot},
        "filter": {"wasm_file": str(WASM_PATH)},
        "redis": {"url": "redis://127.0.0.1:6379/0"},
        "tenants": [{"id": TENANT, "api_keys_sha256": [sha256_hex(KEY)]}],
        "models": [{"name": MODEL, "pool": "pool_u", "max_model_len": 4096}],
        "pools": [{"name": "pool_u", "endpoints": ["127.0.0.1:8001"]}],
    }
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    result = gatewayctl("render", "--config", str(path), "--out", str(out), "--target", "standalone")
    assert "systemctl reload llm-gateway-envoy" in result.stderr, result.stderr
    unit = out / "standalone" / "llm-gateway-envoy.service"
    verified = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert verified.returncode == 0, verified.stderr
