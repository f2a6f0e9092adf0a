"""Scheduling on a real engine: the endpoint picker and flow control against vLLM itself.

The replicas are vLLM 0.32 for CPUs serving Gemma-3-270M (`../shared/real-vllm/setup.sh DIR`
installs both; this script finds DIR in --vllm-dir, $REAL_VLLM_DIR, or ../rv beside the
checkout), one core each (`VLLM_CPU_OMP_THREADS_BIND`), small KV caches
(`--num-gpu-blocks-override`), prefix caching on, and `VLLM_SERVER_DEV_MODE=1` so every run starts
with cold caches (`POST /reset_prefix_cache`). The client is the field's: `vllm bench serve`, a
fresh `--seed` per round, its JSON saved. Every arm is the full gateway (tests/stack.py: Envoy,
the wasm filter, the sidecar, redis-server, the bootstrap rendered from envoy/ as gatewayctl
renders it) in front of the same replicas; arms run interleaved, in a new order each round.

Workloads (`--workloads`, all by default):

    long-prefix     16 shared 1,024-token prefixes (vllm bench's `prefix_repetition`), 64-token
                    suffixes, 32 output tokens; 320 KV blocks a replica (6,490 tokens: the CPU
                    build's blocks are shared by Gemma-3's attention groups): the caches hold far
                    less than the working set
    long-prefix-big the same with 2,048 blocks a replica (every prefix fits on each)
    short-prefix    24 shared 256-token prefixes
    random          random 512-token prompts, no shared prefix (where affinity cannot help)
    quarter-cache   long-prefix with the second replica given a quarter of the first's blocks
                    (1,280 and 320)
    tenants         a light tenant (2 concurrent) beside a heavy one (16), random 256-token
                    prompts, 64 output tokens (heavy starts first; light joins once heavy
                    has completed a turn of the 8 slots, and heavy is stopped when light's
                    last request ends: both are measured in steady state, beside the other;
                    heavy's req/s counts its completions while light ran), on
                    `max_in_flight` = the replicas' slots: light
                    alone, no flow control, flow control with the default config, and with
                    `newcomer_reserve` 0.25 (`flow-control-reserve`); with --arms also
                    `flow-control-rX` (`newcomer_reserve` X) and `flow-control-oN`
                    (`max_in_flight` N more than each replica's slots, so N requests wait in
                    each engine's own queue)

Every picking workload runs at 16 concurrent requests (`--concurrency`), twice the replicas'
8 slots (2 x `--max-num-seqs 4`): a queue in front of the engines, where a scheduler has
something to choose. At 8 (every request in a slot, nothing waiting) no gateway arm can do
better than least-request's even split: the next request's prefix is independent of which slot
freed, so each replica serves every prefix.

Arms of the picking workloads:

    least-request   the pool without `picker` (Envoy's LEAST_REQUEST, full scan)
    least-request-q that, queued in the sidecar at the replicas' slots (`max_in_flight` = their
                    sum, and `flow_control`): what the queue alone brings
    picker          `picker: {}` (the defaults: ranked by predicted TTFT, fitted online), queued
                    at the slots as least-request-q is: a freed slot goes to a queued request
                    homed on its replica (the recommended deployment)
    ceiling         no gateway: each prefix group sent straight to one replica (two clients,
                    half the prefixes, half the concurrency each)

With --arms, more: `direct` (the ceiling's two clients straight to the replicas, each with all
the prefix groups: the ceiling without its split); `picker-weighted` (`picker: {scoring:
weighted}`: the fixed weights and bounded-load affinity, not queued), `picker-nohome`
(`home_load_factor: 0`), `picker-hX` (`home_load_factor: X`), `picker-fX` (weighted,
`affinity_load_factor: X`), all not queued; `picker-q` (queued, as `picker`), `picker-qhX`
(queued, `home_load_factor: X`); `picker-iN` (queued, the replicas scraped every N ms, not the default 500);
`picker-sN` (queued, `slot_overcommit: N`: N more a replica, for
requests of a prefix it holds and prompts no replica holds; `picker` has the default, 2); `least-request-oN`, `picker-oN` (queued as
-q and picker are, at N more than each replica's slots for every prompt: N requests wait in each
engine; `slot_overcommit: 0`). `ARM-fullscrape` is ARM with each replica's whole `/metrics` also
read every 500 ms (what the sidecar's scrapes cost before it asked vLLM for only the samples it
reads). `ARM-apifirst` (any workload) is ARM with each real replica's API server process at
niceness 0 while it runs, its engine processes left at --engine-nice (--nice-scope engine, arm by
arm, interleaved with the other arms).

--engine-nice N starts the engines at niceness N (default 10; 0 to share the cores evenly), so
the gateway, Redis and the client run first on the 2 cores they share with the engines here: on a
serving host the gateway never shares the engine's cores. Every arm, the ceiling included, runs
with the same niceness. --nice-scope says what is niced: `tree` (the default) the API server and
everything it starts; `engine` only the processes
vLLM's API server starts (its EngineCore and the worker that computes, every thread), the API
server itself at the gateway's priority, as a GPU host runs its HTTP, tokenizing and
detokenizing on other cores than the engine's compute (arm by arm, `flow-control-apifirst`
made the pool 0.97x `flow-control` in run 20261208-021654). The sim is one process: niced
whole either way.

    make bench-real                                   # everything, 2 rounds (~90 min)
    .venv/bin/python bench/real_engine.py --workloads long-prefix,random --rounds 2
    .venv/bin/python bench/real_engine.py --engine sim   # the same on vllm-sim (--profile cpu-gemma-270m)

Results: target/bench-results/real-engine-<stamp>/ (summary.json, every client's JSON and log,
each replica's log) and, unless --no-docs, the section between the `real-engine-benchmark`
markers of docs/benchmarks.md (with its chart). A sim run writes its medians beside the real
run's in summary.json and, with --compare REAL_SUMMARY, the "Simulator vs real engine" rows.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import random
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
import zlib
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from results_page import REAL_ENGINE_BEGIN as BEGIN  # noqa: E402
from results_page import REAL_ENGINE_END as END  # noqa: E402
from results_page import bar_chart_svg, fmt, md_table  # noqa: E402
from stack import TARGET, Model, Pool, Stack, Tenant, free_port, new_api_key  # noqa: E402

DOC = ROOT / "docs" / "benchmarks.md"
CHART = ROOT / "docs" / "benchmarks" / "real-engine-throughput.svg"
MODEL = "gemma-3-270m"
POOL = "pool"
SIM_BIN = TARGET / "release" / "vllm-sim"
# vLLM's start-up on one core (about 3 minutes here), and one client run's ceiling.
START_TIMEOUT_S = 900
RUN_TIMEOUT_S = 1800
# Each replica's `--max-num-seqs`: the engine's slots (flow control's `max_in_flight` is their sum).
MAX_NUM_SEQS = 4
# The client's concurrency on the picking workloads: twice the two replicas' slots.
PICKING_CONCURRENCY = 16
MAX_MODEL_LEN = 2048
# Sim tokens (4 bytes each) per Gemma token of these datasets (7.6 bytes on average, measured
# over vllm bench's random and prefix_repetition prompts with Gemma-3-270M's tokenizer).
SIM_TOKENS_PER_TOKEN = 7.6 / 4
# The sim's step costs under this benchmark's load (`vllm-sim` flags over the profile's, which
# are one replica alone): two replicas, their API servers, the gateway and the client share the
# machine's two cores. From the real run SIM_FIT_RUN (engines at niceness 10, 16 concurrent): the
# replicas' median inter-token latency was 44.8 ms with one request running (tenants, light
# alone, 2 runs) and 56.9 ms with four (the 20 picking and ceiling runs), against the profile's
# 38.5 and 48.8 ms alone. A least-squares line over those 22 runs gives 4.04 ms a decoding
# sequence and a step's fixed cost of 40.7 ms. A lone 256-token prompt's TTFT p50 was 352 ms
# (light alone), so (352 - 40.7) / 256 = 1.22 ms a Gemma token, 640 us a sim token (the
# profile's alone: 607). The fit before (run 20261207-150035, where this machine made half the
# requests a second: 68.0 ms fixed, 3.44 ms a sequence kept from the profile because one more
# running request cost nothing measurable then, 1,240 us a sim token) was within 20 % of that
# run on 20 of 22 rows (sim run 20261207-153806); the one before it (20261206-220728, the
# engines not niced, scraped every 200 ms) gave 96.3 ms and 1,350 us. Refit when the real
# engine's speed moves: the constants are this machine's on the day of the run.
SIM_FIT_RUN = "20261208-011706"
SIM_UNDER_LOAD = {"--step-base-ms": 40.7, "--decode-us-per-seq": 4040, "--prefill-us-per-token": 640}
# The sim's KV blocks over the real cache's tokens: the real replicas hit their prefix cache more
# than a sim holding the tokens the CPU build's log gives did (run 20261206-231344 against
# 220728, long shared prefixes: 47 % against 70 % of prompt tokens straight to each replica,
# 18 % against 31 % through least-request): Gemma-3's sliding-window layers keep only their
# window's blocks of a cached prefix. 1.5 is fitted to that gap, not measured.
SIM_CACHE_SCALE = 1.5
# Gemma tokens the CPU build's KV cache holds per `--num-gpu-blocks-override` block (its log:
# "CPU KV cache size: 41,527 tokens" with 2,048 blocks: 128-token blocks shared by Gemma-3's
# attention groups).
REAL_TOKENS_PER_OVERRIDE_BLOCK = 41_527 / 2048
# `flow_control.newcomer_reserve` of the tenants workload's `flow-control-reserve` arm (the
# default, of the `flow-control` arm, is 0).
NEWCOMER_RESERVE = 0.25


@dataclass
class Workload:
    """One workload: the client's dataset arguments and sizes, and the replicas' caches."""

    name: str
    dataset: list[str]
    num_prompts: int
    concurrency: int
    blocks: tuple[int, ...]
    groups: int = 0  # shared-prefix groups (the ceiling splits them between replicas)
    arms: tuple[str, ...] = ("least-request", "least-request-q", "picker", "ceiling")


def prefix_dataset(prefix_len: int, num_prefixes: int, suffix_len: int = 64, output_len: int = 32) -> list[str]:
    return ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(prefix_len),
            "--prefix-repetition-suffix-len", str(suffix_len), "--prefix-repetition-num-prefixes",
            str(num_prefixes), "--prefix-repetition-output-len", str(output_len)]


def random_dataset(input_len: int, output_len: int) -> list[str]:
    return ["--dataset-name", "random", "--random-input-len", str(input_len), "--random-output-len",
            str(output_len), "--random-range-ratio", "0.1"]


def workloads(quick: bool, prompts: int | None = None) -> dict[str, Workload]:
    n = prompts or (32 if quick else 128)
    small, big = (320, 320), (2048, 2048)
    return {
        "long-prefix": Workload("long-prefix", prefix_dataset(1024, 16), n, PICKING_CONCURRENCY, small, groups=16),
        "long-prefix-big": Workload("long-prefix-big", prefix_dataset(1024, 16), n, PICKING_CONCURRENCY, big, groups=16),
        "short-prefix": Workload("short-prefix", prefix_dataset(256, 24), n, PICKING_CONCURRENCY, small, groups=24),
        "random": Workload("random", random_dataset(512, 32), n, PICKING_CONCURRENCY, small,
                           arms=("least-request", "least-request-q", "picker")),
        # vLLM refuses a cache that cannot hold one max_model_len request (80 blocks cannot):
        # the quarter is of 1,280.
        "quarter-cache": Workload("quarter-cache", prefix_dataset(1024, 16), n, PICKING_CONCURRENCY, (1280, 320), groups=16),
        "tenants": Workload("tenants", random_dataset(256, 64), n, 16, small,
                            arms=("light-alone", "no-flow-control", "flow-control", "flow-control-reserve")),
    }


def vllm_dir(arg: str | None) -> Path:
    for cand in (arg, os.environ.get("REAL_VLLM_DIR"), str(ROOT.parent / "rv")):
        if cand and (Path(cand) / "v" / "bin" / "python").exists():
            return Path(cand)
    raise SystemExit("no real vLLM found: install one with `bash ../shared/real-vllm/setup.sh DIR` and pass "
                     "--vllm-dir DIR (or set REAL_VLLM_DIR)")


def http_json(url: str, body: dict | None = None, timeout: float = 10.0) -> dict | str:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method="POST" if data is not None or url.endswith("_cache") else "GET",
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        raw = r.read().decode()
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def metrics(url: str) -> dict[str, float]:
    """The replica's counters this benchmark reads (summed over label sets)."""
    names = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:request_success_total",
             "vllm:num_requests_running", "vllm:num_requests_waiting")
    out = dict.fromkeys(names, 0.0)
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("#"):
                continue
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in out:
                out[name] += float(line.rsplit(" ", 1)[1])
    return out


@dataclass
class Replica:
    """One engine: a real vLLM on one core, or a vllm-sim with the CPU profile."""

    index: int
    blocks: int
    engine: str
    vllm: Path
    logdir: Path
    port: int = 0
    proc: subprocess.Popen | None = None
    # The engine's niceness (--engine-nice): above 0 the gateway beside it on the same cores is
    # scheduled first, as it is on a serving host where it never shares the engine's cores.
    nice: int = 0
    # --nice-scope: "tree" (the default) or "engine" (the real engine's compute processes only, once ready).
    nice_scope: str = "tree"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.port = free_port()
        log = open(self.logdir / f"replica-{self.index}-{self.blocks}.log", "wb")
        if self.engine == "real":
            env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_OMP_THREADS_BIND": str(self.index % 2),
                   "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_SERVER_DEV_MODE": "1"}
            argv = [str(self.vllm / "v" / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
                    "--model", str(self.vllm / "models" / "gemma3-270m-hf"), "--served-model-name", MODEL,
                    "--host", "127.0.0.1", "--port", str(self.port), "--max-model-len", str(MAX_MODEL_LEN),
                    "--max-num-seqs", str(MAX_NUM_SEQS), "--dtype", "float32", "--num-gpu-blocks-override",
                    str(self.blocks), "--enable-prefix-caching"]
        else:
            env = dict(os.environ)
            # The profile's blocks are the CPU build's (128 Gemma tokens); the cache holds what
            # `--num-gpu-blocks-override` gives the real replica (sim/src/config.rs, CPU_GEMMA_270M).
            sim_blocks = math.ceil(self.blocks * REAL_TOKENS_PER_OVERRIDE_BLOCK * SIM_CACHE_SCALE / 128)
            argv = [str(SIM_BIN), "--port", str(self.port), "--served-model-name", MODEL, "--engine", "batched",
                    "--profile", "cpu-gemma-270m", "--num-gpu-blocks", str(sim_blocks),
                    "--max-num-seqs", str(MAX_NUM_SEQS),
                    *(x for flag, v in SIM_UNDER_LOAD.items() for x in (flag, f"{v:g}")),
                    "--max-model-len", str(round(MAX_MODEL_LEN * SIM_TOKENS_PER_TOKEN))]
        if self.nice and (self.engine != "real" or self.nice_scope == "tree"):
            argv = ["nice", "-n", str(self.nice), *argv]
        self.proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"replica {self.index} exited; see {self.logdir}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        self.renice_engine()
                        return
            except OSError:
                pass
            time.sleep(1)
        raise RuntimeError(f"replica {self.index} not ready in {START_TIMEOUT_S} s")

    def reset_cache(self) -> None:
        """Empties the engine's prefix cache (`POST /reset_prefix_cache`, vLLM's dev-mode endpoint
        and the sim's): `{"success": false}` while a request still holds blocks, so it is retried
        until it says true (a run whose cache is not cold would carry the last arm's prefixes)."""
        deadline = time.monotonic() + 60
        while True:
            answer = http_json(self.url + "/reset_prefix_cache", timeout=30)
            if isinstance(answer, dict) and answer.get("success") is True:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"replica {self.index}: /reset_prefix_cache answered {answer!r} for 60 s")
            time.sleep(0.5)

    def renice_engine(self) -> None:
        """--nice-scope engine: every thread of every process the real replica's API server
        started (vLLM's EngineCore and its worker: the compute) at `nice`; the API server keeps
        the gateway's priority. Threads started later inherit their creator's niceness."""
        if not (self.nice and self.engine == "real" and self.nice_scope == "engine" and self.proc):
            return
        parents: dict[int, int] = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            with contextlib.suppress(OSError, ValueError, IndexError):
                parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        below, frontier = set(), {self.proc.pid}
        while frontier:
            frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - below
            below |= frontier
        if not below:
            raise RuntimeError(f"replica {self.index}: no engine process below the API server {self.proc.pid}")
        for pid in below:
            for task in Path(f"/proc/{pid}/task").glob("[0-9]*"):
                with contextlib.suppress(OSError):
                    os.setpriority(os.PRIO_PROCESS, int(task.name), self.nice)

    def api_server_priority(self, nice: int) -> None:
        """Every thread of the real replica's API server process (not the engine processes it
        started) at niceness `nice`: an `ARM-apifirst` arm runs it at 0, then puts it back."""
        if not (self.engine == "real" and self.proc):
            return
        for task in Path(f"/proc/{self.proc.pid}/task").glob("[0-9]*"):
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, int(task.name), nice)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def picker_config(arm: str) -> dict:
    """The pool's `picker` of a picker arm: `picker` (the defaults), `picker-weighted`,
    `picker-nohome` (`home_load_factor: 0`), `picker-hX` (`home_load_factor: X`), `picker-fX`
    (weighted, `affinity_load_factor: X`), `picker-sN` (`slot_overcommit: N`), `picker-oN`
    (`slot_overcommit: 0`: its N are for every prompt)."""
    if arm == "picker-weighted":
        return {"scoring": "weighted"}
    if arm == "picker-nohome":
        return {"home_load_factor": 0}
    if arm.startswith("picker-qh"):
        return {"home_load_factor": float(arm[len("picker-qh"):])}
    if arm.startswith("picker-h"):
        return {"home_load_factor": float(arm[len("picker-h"):])}
    if arm.startswith("picker-f"):
        return {"scoring": "weighted", "affinity_load_factor": float(arm[len("picker-f"):])}
    if m := re.fullmatch(r"picker-s(\d+)", arm):
        return {"slot_overcommit": int(m.group(1))}
    if re.fullmatch(r"picker-o\d+", arm):
        return {"slot_overcommit": 0}
    return {}


def newcomer_reserve(arm: str) -> float | None:
    """A flow-control arm's `newcomer_reserve`: NEWCOMER_RESERVE for `flow-control-reserve`, X
    for `flow-control-rX`, None (the default) otherwise."""
    if arm.endswith("-reserve"):
        return NEWCOMER_RESERVE
    m = re.fullmatch(r"flow-control-r(\d+(?:\.\d+)?)", arm)
    return float(m.group(1)) if m else None


# Envoy's request log is flushed this often (and past 1 KB) in the bench: by default it is
# written in 64 KB pieces, minutes apart at this machine's request rate.
REQUEST_LOG_FLUSH_MS = 250


def start_gateway(workdir: Path, arm: str, urls: list[str], keys: dict[str, str],
                  exits: contextlib.ExitStack) -> Stack:
    """The gateway of one arm in front of the running replicas."""
    pool = Pool(POOL, [MODEL], kind="external", urls=list(urls), max_model_len=MAX_MODEL_LEN)
    overrides: dict = {"metrics_listen": "127.0.0.1:0"}
    if arm.startswith("picker"):
        pool.shedding = {}
        pool.picker = picker_config(arm)
    over = re.fullmatch(r"(least-request|picker)-o(\d+)", arm)
    if over:
        # Queued in the sidecar past N more than the engines' slots a replica: N requests wait in
        # each engine's own queue, so a freed engine slot is refilled without a round trip.
        pool.shedding = {"max_in_flight": (MAX_NUM_SEQS + int(over.group(2))) * len(urls), "flow_control": {}}
        overrides["flow_control"] = {"tiers": [{"name": "standard", "max_queue_wait_ms": 60_000}]}
    elif (arm == "picker" or arm.startswith("picker-q") or re.fullmatch(r"picker-[si]\d+", arm)
          or arm == "least-request-q"):
        # Queued in the sidecar at the engines' slots: a freed slot goes to a request whose
        # prefix its replica holds.
        pool.shedding = {"max_in_flight": MAX_NUM_SEQS * len(urls), "flow_control": {}}
        overrides["flow_control"] = {"tiers": [{"name": "standard", "max_queue_wait_ms": 60_000}]}
    if m := re.fullmatch(r"picker-i(\d+)", arm):
        # The replicas scraped every N ms (the default, 500, in the other arms): vLLM's API server
        # renders its /metrics on the cores the engines run on.
        pool.shedding["scrape_interval_ms"] = int(m.group(1))
    if arm.startswith("flow-control"):
        # The pool's own `flow_control` makes it queue the tiers of the top-level section (without
        # it the pool only sheds at `max_in_flight`).
        # `flow-control-oN`: N more than each replica's slots, so N requests wait in each engine's
        # own queue (it refills a freed slot without a round trip through the gateway).
        fc_over = re.fullmatch(r"flow-control-o(\d+)", arm)
        per_replica = MAX_NUM_SEQS + (int(fc_over.group(1)) if fc_over else 0)
        pool.shedding = {"max_in_flight": per_replica * len(urls), "flow_control": {}}
        overrides["flow_control"] = {"tiers": [{"name": "standard", "max_queue_wait_ms": 60_000}],
                                     **({"newcomer_reserve": reserve} if (reserve := newcomer_reserve(arm)) else {})}
    tenants = [Tenant(t, [k], {"requests_per_minute": 10_000_000, "tokens_per_minute": 10_000_000_000})
               for t, k in keys.items()]
    # The request log (workdir/requests.log) records why any request failed (flags, details, upstream host).
    stack = Stack(workdir, [pool], [Model(MODEL, POOL, MAX_MODEL_LEN)], tenants, envoy_concurrency=1,
                  sidecar_overrides=overrides, request_log=True,
                  envoy_args=["--file-flush-interval-msec", str(REQUEST_LOG_FLUSH_MS), "--file-flush-min-size-kb", "1"])
    exits.enter_context(stack)
    return stack


def client(vllm: Path, base_url: str, key: str, w: Workload, dataset: list[str], num_prompts: int,
           concurrency: int, seed: int, out: Path, gate: Path | None = None) -> subprocess.Popen:
    """Starts one `vllm bench serve`, its JSON (per-request details) to `out`; with `gate`, it
    sends nothing before that file exists (GATED_CLIENT)."""
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "OPENAI_API_KEY": key, "HF_HUB_OFFLINE": "1"}
    argv = [str(vllm / "v" / "bin" / "vllm"), "bench", "serve", "--backend", "openai-chat", "--base-url", base_url,
            "--endpoint", "/v1/chat/completions", "--model", MODEL, "--tokenizer",
            str(vllm / "models" / "gemma3-270m-hf"), "--seed", str(seed), "--num-prompts", str(num_prompts),
            "--max-concurrency", str(concurrency), "--request-rate", "inf", "--ignore-eos", *dataset, "--save-result",
            "--save-detailed", "--result-dir", str(out.parent), "--result-filename", out.name,
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99"]
    if gate is not None:
        argv = [str(vllm / "v" / "bin" / "python"), "-c", GATED_CLIENT, str(gate), *argv[1:]]
    log = open(out.with_suffix(".log"), "wb")
    log.write((shlex.join(argv) + "\n").encode())
    log.flush()
    return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


# `vllm bench serve` that does everything before its first request (imports, the tokenizer, the
# prompts), says so (the file argv[1] + ".ready"), then waits for the file argv[1]. A client's
# start-up took 1 to 2.5 minutes of both cores here with the engines busy, and starved the gateway
# beside it: every ext_proc answer past its 500 ms (504) of run 20261208-011706 came while the
# light client prepared. The tenants' clients are started together, and let go when each is wanted.
GATED_CLIENT = """
import asyncio, os, sys
import vllm.benchmarks.serve as serve
from vllm.entrypoints.cli.main import main
gate = sys.argv.pop(1)
run = serve.benchmark
async def gated(*args, **kwargs):
    open(gate + ".ready", "w").close()
    while not os.path.exists(gate):
        await asyncio.sleep(0.05)
    return await run(*args, **kwargs)
serve.benchmark = gated
sys.argv[0] = "vllm"
sys.exit(main())
"""


def wait_ready_clients(gates: list[Path], procs: list[subprocess.Popen]) -> None:
    """Waits until every gated client is ready to send (GATED_CLIENT's `.ready` files)."""
    deadline = time.monotonic() + 600
    while not all(Path(f"{g}.ready").exists() for g in gates):
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("a gated vllm bench serve exited before it was ready")
        if time.monotonic() > deadline:
            raise RuntimeError("gated vllm bench serve clients not ready in 600 s")
        time.sleep(0.1)


def finish(proc: subprocess.Popen, out: Path) -> dict:
    try:
        proc.wait(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"vllm bench serve exited {proc.returncode}: {out.with_suffix('.log')}")
    return json.loads(out.read_text())


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))]


def figures(reports: list[dict]) -> dict:
    """One run's figures from one or more clients that ran at once (their requests merged)."""
    ttfts = [t * 1000 for r in reports for t, e in zip(r.get("ttfts", []), r.get("errors", [])) if not e]
    e2es = [t * 1000 for r in reports for t, e in zip(r.get("latencies", []), r.get("errors", [])) if not e]
    completed = sum(r["completed"] for r in reports)
    duration = max(r["duration"] for r in reports)
    errors = [e for r in reports for e in r.get("errors", []) if e]
    return {"completed": completed, "failed": sum(r.get("failed", 0) for r in reports),
            "req_per_s": completed / duration if duration else None,
            "ttft_p50_ms": pct(ttfts, 50), "ttft_p99_ms": pct(ttfts, 99), "e2e_p50_ms": pct(e2es, 50),
            "errors": sorted({e.strip()[:120] for e in errors})}


def replica_deltas(replicas: list[Replica], before: list[dict[str, float]]) -> dict:
    now = [metrics(r.url) for r in replicas]
    per = [{k: n[k] - b.get(k, 0.0) for k in n} for n, b in zip(now, before)]
    queries = sum(p["vllm:prefix_cache_queries_total"] for p in per)
    hits = sum(p["vllm:prefix_cache_hits_total"] for p in per)
    return {"requests": [p["vllm:request_success_total"] for p in per],
            "hit_rate": hits / queries if queries else None,
            "per_replica_hits": [p["vllm:prefix_cache_hits_total"] for p in per],
            "per_replica_queries": [p["vllm:prefix_cache_queries_total"] for p in per]}


def envoy_status_counts(stack: Stack) -> dict[str, int]:
    """Envoy's downstream responses by status class (the failures the client saw, by Envoy)."""
    with urllib.request.urlopen(stack.admin_url + "/stats?filter=downstream_rq_[1-5]xx&format=json", timeout=5) as r:
        stats = json.loads(r.read())["stats"]
    out: dict[str, int] = {}
    for s in stats:
        if s["name"].startswith("http.ingress") or s["name"].startswith("http.gateway"):
            cls = s["name"].rsplit("_", 1)[1]
            out[cls] = out.get(cls, 0) + int(s["value"])
    return out


# The light tenant's requests a run, at least (a quarter of --prompts past 128): its p99 is
# then not one request's.
LIGHT_PROMPTS_MIN = 32

# The heavy tenant's client is given this many times light's prompts and stopped when light
# ends: it never runs dry while light runs (light waited 8 s a request without flow control, heavy
# made 1.2 requests a second).
HEAVY_PROMPTS_PER_LIGHT = 16


def span(e: dict) -> tuple[float, float]:
    """A request log entry's (start, end) in epoch seconds (`start_time`, `duration_ms`)."""
    start = datetime.datetime.fromisoformat(e["start_time"].replace("Z", "+00:00")).timestamp()
    return start, start + float(e.get("duration_ms") or 0) / 1000


def wait_completions(replicas: list[Replica], before: list[dict[str, float]], proc: subprocess.Popen,
                     what: str, n: int) -> None:
    """Waits until the replicas have completed `n` requests since `before` (their
    `vllm:request_success_total`): the engines have then turned over each slot once."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while time.monotonic() < deadline:
        done = sum(metrics(r.url).get("vllm:request_success_total", 0.0) - b.get("vllm:request_success_total", 0.0)
                   for r, b in zip(replicas, before))
        if done >= n:
            return
        if proc.poll() is not None:
            raise RuntimeError(f"the {what} client exited before {n} completions")
        time.sleep(0.5)
    raise RuntimeError(f"{what}: {n} completions not reached in {RUN_TIMEOUT_S} s")


def wait_logged(stack: Stack, tenant: str, n: int) -> None:
    """Waits until Envoy's request log holds `n` chat completions of `tenant` (the log is
    flushed every REQUEST_LOG_FLUSH_MS; its entries are in order of their ends, so every request
    that ended before those is in it too). Gives up after 30 s."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if sum(1 for e in stack.requests_logged()
               if e.get("tenant") == tenant and e.get("path") == "/v1/chat/completions") >= n:
            return
        time.sleep(0.2)
    raise RuntimeError(f"the request log holds fewer than {n} requests of {tenant} after 30 s")


def stop_client(proc: subprocess.Popen) -> None:
    """Stops a `vllm bench serve` still sending (SIGINT, then SIGKILL after 30 s)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def light_window(chat: list[dict]) -> tuple[float, float] | None:
    """From light's first request's start to its last request's end (request log entries)."""
    light = [span(e) for e in chat if e.get("tenant") == "light"]
    return (min(a for a, _ in light), max(b for _, b in light)) if light else None


def heavy_figures(entries: list[dict]) -> dict:
    """The heavy tenant beside light, from Envoy's request log (`tenant`, `start_time`,
    `duration_ms`, `response_code`): `beside_light_req_per_s`, its successful requests that
    ended in light's window over that window; `total_beside_light_req_per_s`, light's and
    heavy's together (the pool's throughput while both ran); `failed`, heavy's requests answered
    4xx or 5xx before light ended (the ones cut when heavy's client is stopped are not failures)."""
    chat = [e for e in entries if e.get("path") == "/v1/chat/completions"]
    window = light_window(chat)
    if not window or window[1] <= window[0]:
        return {"beside_light_req_per_s": None, "total_beside_light_req_per_s": None, "failed": 0}
    t0, t1 = window

    def ok_in_window(e: dict) -> bool:
        return 200 <= int(e.get("response_code") or 0) < 300 and t0 <= span(e)[1] <= t1

    heavy = sum(1 for e in chat if e.get("tenant") == "heavy" and ok_in_window(e))
    both = sum(1 for e in chat if ok_in_window(e))
    failed = sum(1 for e in chat if e.get("tenant") == "heavy" and int(e.get("response_code") or 0) >= 400
                 and span(e)[1] <= t1)
    return {"beside_light_req_per_s": heavy / (t1 - t0), "total_beside_light_req_per_s": both / (t1 - t0),
            "failed": failed}


def failure_causes(stack: Stack) -> dict[str, int]:
    """The failed requests' causes from the request log: `"<code> <flags> <details>"` -> count."""
    out: dict[str, int] = {}
    for e in stack.requests_logged():
        if not 200 <= int(e.get("response_code") or 0) < 300:
            cause = f"{e.get('response_code')} {e.get('response_flags')} {e.get('response_code_details')}"
            out[cause] = out.get(cause, 0) + 1
    return out


def sidecar_metrics(stack: Stack, path: Path) -> dict:
    """Saves the sidecar's /metrics to `path`; returns the picker's fitted TTFT model
    (`llm_gateway_picker_ttft_model`, term -> value), empty without one."""
    if not stack.sidecar_metrics_url:
        return {}
    with urllib.request.urlopen(stack.sidecar_metrics_url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    path.write_text(text)
    model = {}
    for line in text.splitlines():
        if line.startswith("llm_gateway_picker_ttft_model{"):
            term = line.split('term="', 1)[1].split('"', 1)[0]
            model[term] = float(line.rsplit(" ", 1)[1])
    return model


FULL_SCRAPE_SUFFIX = "-fullscrape"
FULL_SCRAPE_INTERVAL_S = 0.5


@contextlib.contextmanager
def full_scraper(urls: list[str]):
    """While the block runs, each replica's whole `/metrics` is read every 500 ms (a thread): an
    `ARM-fullscrape` arm is ARM plus what the sidecar's scrapes cost the engines before it asked
    vLLM for the eight samples it reads (`/metrics/?name[]=...`)."""
    import threading

    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(FULL_SCRAPE_INTERVAL_S):
            for url in urls:
                with contextlib.suppress(OSError):
                    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
                        r.read()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


API_FIRST_SUFFIX = "-apifirst"


@contextlib.contextmanager
def api_servers_first(replicas: list[Replica]):
    """While the block runs, each real replica's API server (HTTP, tokenizing, detokenizing) is at
    niceness 0, its engine processes at their --engine-nice: an `ARM-apifirst` arm is ARM on a host
    whose API server is not queued behind the engine's compute for the CPU. Put back after."""
    for r in replicas:
        r.api_server_priority(0)
    try:
        yield
    finally:
        for r in replicas:
            r.api_server_priority(r.nice if r.nice_scope == "tree" else 0)


def arm_fits(w: Workload, arm: str) -> bool:
    """Whether --arms' `arm` runs on workload `w` (its suffixes -apifirst and -fullscrape aside)."""
    base = arm.removesuffix(API_FIRST_SUFFIX).removesuffix(FULL_SCRAPE_SUFFIX)
    if w.name == "tenants":
        return base in w.arms or re.fullmatch(r"flow-control-[or]\d+(\.\d+)?", base) is not None
    return base in w.arms or base.startswith(("picker", "least-request")) or base == "direct"


def one_run(w: Workload, arm: str, replicas: list[Replica], vllm: Path, raw: Path, round_no: int) -> dict:
    """One arm of one workload in one round, from cold caches."""
    seed = 1000 + 17 * round_no + zlib.crc32(w.name.encode()) % 97
    for r in replicas:
        r.reset_cache()
    before = [metrics(r.url) for r in replicas]
    tag = f"{w.name}-{arm}-r{round_no}"
    result: dict = {"arm": arm, "round": round_no, "seed": seed}
    with contextlib.ExitStack() as exits:
        if arm.endswith(API_FIRST_SUFFIX):
            arm = arm.removesuffix(API_FIRST_SUFFIX)
            exits.enter_context(api_servers_first(replicas))
        if arm.endswith(FULL_SCRAPE_SUFFIX):
            arm = arm.removesuffix(FULL_SCRAPE_SUFFIX)
            exits.enter_context(full_scraper([r.url for r in replicas]))
        if arm in ("ceiling", "direct"):
            # `direct`: the same two clients, each with all the prefix groups (no split).
            half = w.groups if arm == "direct" else max(1, w.groups // len(replicas))
            procs = []
            for i, r in enumerate(replicas):
                dataset = [a if a != str(w.groups) else str(half) for a in w.dataset]
                out = raw / f"{tag}-{i}.json"
                procs.append((client(vllm, r.url, "none", w, dataset, w.num_prompts // len(replicas),
                                     max(1, w.concurrency // len(replicas)), seed + i, out), out))
            reports = [finish(p, o) for p, o in procs]
        elif w.name == "tenants":
            keys = {"light": new_api_key(), "heavy": new_api_key()}
            stack = start_gateway(raw / tag, arm, [r.url for r in replicas], keys, exits)
            light_n = max(LIGHT_PROMPTS_MIN, w.num_prompts // 4)
            out_l, out_h = raw / f"{tag}-light.json", raw / f"{tag}-heavy.json"
            gate_l, gate_h = raw / f"{tag}-light.go", raw / f"{tag}-heavy.go"
            p_l = client(vllm, stack.base_url, keys["light"], w, w.dataset, light_n, 2, seed, out_l, gate_l)
            exits.callback(stop_client, p_l)
            p_h = None
            if arm != "light-alone":
                # Heavy first, until a full turn of the engines' slots has completed (steady state),
                # then light beside it; heavy is stopped when light's last request ends, so every
                # figure of both is beside the other (`heavy_figures`). Both clients have done
                # their imports before either sends.
                p_h = client(vllm, stack.base_url, keys["heavy"], w, w.dataset, HEAVY_PROMPTS_PER_LIGHT * light_n,
                             16, seed + 1, out_h, gate_h)
                exits.callback(stop_client, p_h)
                wait_ready_clients([gate_l, gate_h], [p_l, p_h])
                gate_h.touch()
                wait_completions(replicas, before, p_h, "heavy", MAX_NUM_SEQS * len(replicas))
            wait_ready_clients([gate_l], [p_l])
            gate_l.touch()
            light = finish(p_l, out_l)
            result["light"] = figures([light])
            result["heavy"] = None
            if p_h:
                stop_client(p_h)
                wait_logged(stack, "light", light["completed"] + light.get("failed", 0))
                result["heavy"] = heavy_figures(stack.requests_logged())
            result["envoy_status"] = envoy_status_counts(stack)
            result["failure_causes"] = failure_causes(stack)
            sidecar_metrics(stack, raw / f"{tag}-sidecar-metrics.txt")
            reports = [light]
        else:
            key = new_api_key()
            stack = start_gateway(raw / tag, arm, [r.url for r in replicas], {"bench": key}, exits)
            out = raw / f"{tag}.json"
            reports = [finish(client(vllm, stack.base_url, key, w, w.dataset, w.num_prompts, w.concurrency, seed, out),
                              out)]
            result["envoy_status"] = envoy_status_counts(stack)
            result["failure_causes"] = failure_causes(stack)
            result["ttft_model"] = sidecar_metrics(stack, raw / f"{tag}-sidecar-metrics.txt")
    result.update(figures(reports))
    result["replicas"] = replica_deltas(replicas, before)
    return result


def median_of(rows: list[dict], key: str, sub: str | None = None) -> float | None:
    vals = [(r[sub] or {}).get(key) if sub else r.get(key) for r in rows]
    vals = [v for v in vals if v is not None]
    return statistics.median(vals) if vals else None


def summarize(results: dict[str, dict[str, list[dict]]]) -> dict:
    out: dict = {}
    for wname, arms in results.items():
        out[wname] = {}
        for arm, rows in arms.items():
            s = {k: median_of(rows, k) for k in ("req_per_s", "ttft_p50_ms", "ttft_p99_ms", "e2e_p50_ms")}
            s["failed"] = sum(r.get("failed", 0) for r in rows)
            s["hit_rate"] = median_of([r["replicas"] for r in rows], "hit_rate")
            s["requests_per_replica"] = [r["replicas"]["requests"] for r in rows]
            s["errors"] = sorted({e for r in rows for e in r.get("errors", [])})
            s["ttft_model"] = [r["ttft_model"] for r in rows if r.get("ttft_model")]
            if wname == "tenants":
                for t in ("light", "heavy"):
                    s[t] = {k: median_of(rows, k, t)
                            for k in ("req_per_s", "ttft_p50_ms", "ttft_p99_ms", "beside_light_req_per_s",
                                      "total_beside_light_req_per_s")}
                    s[t]["failed"] = sum((r.get(t) or {}).get("failed", 0) for r in rows)
            out[wname][arm] = s
    return out


def heavy_rate(arm: dict) -> float | None:
    """The heavy tenant's req/s while light ran (runs before that measure: over its own run)."""
    h = arm.get("heavy") or {}
    return h.get("beside_light_req_per_s") or h.get("req_per_s")


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}×" if a is not None and b else "–"


def rows(summary: dict) -> list[list[str]]:
    """The headline rows of the issue's table, from one run's medians."""
    out = []
    lp = summary.get("long-prefix", {})
    if lp.get("picker") and lp.get("least-request"):
        p, lr, c = lp["picker"], lp["least-request"], lp.get("ceiling")
        out.append(["Real engine, long shared prefixes: picker vs least-request throughput",
                    f"{ratio(p['req_per_s'], lr['req_per_s'])} (TTFT p50 {ratio(p['ttft_p50_ms'], lr['ttft_p50_ms'])}, "
                    f"failed {p['failed']}; ceiling {ratio(c['req_per_s'], lr['req_per_s']) if c else '–'})"])
    parts = []
    for name in ("short-prefix", "random"):
        s = summary.get(name, {})
        if s.get("picker") and s.get("least-request"):
            parts.append(f"{name} {ratio(s['picker']['req_per_s'], s['least-request']['req_per_s'])} (TTFT p99 "
                         f"{ratio(s['picker']['ttft_p99_ms'], s['least-request']['ttft_p99_ms'])}, failed "
                         f"{s['picker']['failed']})")
    if parts:
        out.append(["Real engine, short prefixes and random prompts: picker vs least-request throughput",
                    "; ".join(parts)])
    t = summary.get("tenants", {})
    if t.get("flow-control") and t.get("light-alone"):
        fc, alone, none = t["flow-control"], t["light-alone"], t.get("no-flow-control")
        out.append(["Real engine, light beside heavy: light TTFT p50 vs alone",
                    f"{ratio(fc['light']['ttft_p50_ms'], alone['light']['ttft_p50_ms'])} (p99 "
                    f"{ratio(fc['light']['ttft_p99_ms'], alone['light']['ttft_p99_ms'])}; heavy "
                    f"{ratio(heavy_rate(fc), heavy_rate(none)) if none else '–'} of its "
                    f"throughput without flow control while light ran; refused light {fc['light']['failed']}, heavy "
                    f"{fc['heavy']['failed']})"])
    return out


def table(summary: dict) -> str:
    lines = []
    for wname, arms in summary.items():
        base = arms.get("least-request") or arms.get("light-alone") or {}
        body = []
        for arm, s in arms.items():
            if wname == "tenants":
                body.append([arm, fmt(s["light"]["ttft_p50_ms"], 0), fmt(s["light"]["ttft_p99_ms"], 0),
                             fmt(s["light"]["req_per_s"], 2), fmt(heavy_rate(s), 2) if s.get("heavy") else "–",
                             fmt((s.get("heavy") or {}).get("total_beside_light_req_per_s"), 2),
                             str(s["light"]["failed"] + (s["heavy"]["failed"] if s.get("heavy") else 0))])
            else:
                hit = f"{100 * s['hit_rate']:.0f} %" if s.get("hit_rate") is not None else "–"
                body.append([arm, f"{fmt(s['req_per_s'], 2)} ({ratio(s['req_per_s'], base.get('req_per_s'))})",
                             fmt(s["ttft_p50_ms"], 0), fmt(s["ttft_p99_ms"], 0), fmt(s["e2e_p50_ms"], 0), hit,
                             str(s["failed"])])
        header = (["arm", "light TTFT p50 ms", "light p99 ms", "light req/s", "heavy req/s while light ran",
                   "pool req/s while light ran", "failed"]
                  if wname == "tenants" else ["arm", "req/s", "TTFT p50 ms", "TTFT p99 ms", "E2E p50 ms",
                                               "prefix-cache hits", "failed"])
        note = ("Heavy (16 concurrent) starts first; light (2 concurrent, 32 requests or a quarter of the run's "
                "prompts, whichever is more) joins once heavy has completed a turn of the engines' 8 slots, and "
                "heavy is stopped when light's last request ends, so both run beside the other in steady state; "
                "heavy's req/s and the pool's (light and heavy together) count completions while light ran "
                "(Envoy's request log).\n\n"
                if wname == "tenants" else "")
        lines.append(f"**{wname}**\n\n{note}" + md_table(header, body))
    return "\n\n".join(lines)


def arm_order(arms: dict) -> list[str]:
    """The picking arms, fastest first (the tenants workload has no such order)."""
    picking = {a: v["req_per_s"] for a, v in arms.items() if v.get("req_per_s") is not None}
    return sorted(picking, key=lambda a: -picking[a])


def comparison(real: dict, sim: dict) -> tuple[list[str], str]:
    """The headline row and the table of the simulator against the real engine, workload by
    workload and arm by arm (the same arms, concurrency and prompts)."""
    body, tput, ttft, same_order, workloads_n = [], [], [], 0, 0
    for wname, arms in real.items():
        if wname not in sim:
            continue
        for arm, r in arms.items():
            sv = sim[wname].get(arm)
            if not sv:
                continue
            if wname == "tenants":
                r, sv = r["light"], sv["light"]
            rt, st = r.get("req_per_s"), sv.get("req_per_s")
            rp, sp = r.get("ttft_p50_ms"), sv.get("ttft_p50_ms")
            if rt and st:
                tput.append(st / rt)
            if rp and sp:
                ttft.append(sp / rp)
            label = f"{wname}: {arm}" + (" (light tenant)" if wname == "tenants" else "")
            body.append([label, fmt(rt, 2), fmt(st, 2), ratio(st, rt), fmt(rp, 0), fmt(sp, 0), ratio(sp, rp)])
        if wname != "tenants":
            workloads_n += 1
            same_order += arm_order(arms) == arm_order({a: v for a, v in sim[wname].items() if a in arms})
    worst = lambda xs: max(xs, key=lambda x: abs(x - 1)) if xs else None  # noqa: E731
    within = sum(abs(x - 1) <= 0.2 for x in tput + ttft)
    head = ["Simulator vs real engine: throughput and TTFT p50",
            f"worst throughput {worst(tput):.2f}×, worst TTFT p50 {worst(ttft):.2f}× "
            f"({within} of {len(tput) + len(ttft)} within ±20 %); arms ranked the same on "
            f"{same_order} of {workloads_n} picking workloads" if tput and ttft else "–"]
    table = md_table(["workload: arm", "real req/s", "sim req/s", "sim/real", "real TTFT p50 ms",
                      "sim TTFT p50 ms", "sim/real"], body)
    return head, table


def nice_text(meta: dict) -> str:
    """The docs' words for the run's `--engine-nice` (absent in runs before it was recorded: 0)."""
    n = meta.get("engine_nice") or 0
    if not n:
        return "the engines and the gateway sharing the 2 cores evenly; "
    if meta.get("nice_scope") == "engine" and meta.get("engine") == "real":
        return (f"vLLM's engine processes (its EngineCore and worker, the compute) at niceness {n}, so that Envoy, "
                f"the sidecar, Redis, the client and vLLM's API server go first on the 2 cores they share with the "
                f"engines here (on a serving host they never share the engine's compute); ")
    return (f"the engines at niceness {n}, so that Envoy, the sidecar, Redis and the client go first on the 2 "
            f"cores they share with the engines here (on a serving host they never share the engine's cores); ")


def section(summary: dict, meta: dict, sim: dict | None = None, sim_meta: dict | None = None) -> str:
    head_rows = rows(summary)
    sim_text = ""
    if sim is not None:
        head, sim_table = comparison(summary, sim)
        head_rows.append(head)
        flags = " ".join(f"{flag} {v:g}" for flag, v in SIM_UNDER_LOAD.items())
        sim_text = (f"\n\n### The simulator against it\n\n`vllm-sim --engine batched --profile cpu-gemma-270m "
                    f"{flags}` (sim/src/config.rs, `CPU_GEMMA_270M`, one replica alone, fitted with "
                    f"`bench/real_engine.py --fit`; the flags: its step costs under this benchmark's load, "
                    f"`SIM_UNDER_LOAD`, fitted to the real replicas' inter-token latencies and a lone prompt's TTFT in "
                    f"run {SIM_FIT_RUN}; its KV blocks {SIM_CACHE_SCALE:g}x the real cache's tokens, "
                    f"`SIM_CACHE_SCALE`; its prefix cache emptied before every run, as the real replicas' are) in place of each "
                    f"replica, the same gateways, client, prompts and arms; medians of {sim_meta['rounds']} round(s) "
                    f"of {sim_meta['prompts']} prompts (run of {sim_meta['stamp']}).\n\n{sim_table}")
    headline = md_table(["Measure", "Result"], head_rows)
    return (f"{BEGIN}\n## On a real engine\n\nvLLM 0.32 (CPU build, Gemma-3-270M, float32), {meta['replicas']} replicas "
            f"with one core each, `--max-num-seqs {MAX_NUM_SEQS}`, prefix caching on, caches reset before every "
            f"run; {nice_text(meta)}`vllm bench serve` as the client ({meta.get('prompts', 128)} prompts a run, `--ignore-eos`, "
            f"{meta.get('concurrency') or PICKING_CONCURRENCY} concurrent on the picking workloads: twice the "
            f"replicas' slots; arms in `bench/real_engine.py`'s docstring); "
            f"medians of {meta['rounds']} interleaved rounds (run of {meta['stamp']}).\n\n{headline}\n\n{table(summary)}\n\n"
            f"![throughput by arm](benchmarks/real-engine-throughput.svg){sim_text}\n\n"
            f"Reproduce: `make bench-real` (`bench/real_engine.py`; the raw results in "
            f"`target/bench-results/real-engine-*`); the simulator's rows: `bench/real_engine.py --engine sim "
            f"--compare target/bench-results/real-engine-real-STAMP/summary.json`.\n{END}")


def publish(summary: dict, meta: dict, write_docs: bool, sim: dict | None = None,
            sim_meta: dict | None = None) -> None:
    if not write_docs:
        return
    text = DOC.read_text()
    new = section(summary, meta, sim, sim_meta)
    if BEGIN in text and END in text:
        text = text[: text.index(BEGIN)] + new + text[text.index(END) + len(END):]
    else:
        text = text.rstrip("\n") + "\n\n" + new + "\n"
    DOC.write_text(text)
    names = [w for w in summary if w != "tenants"]
    arms = ["least-request", "least-request-q", "picker", "ceiling"]
    series = {a: [(summary[w].get(a) or {}).get("req_per_s") for w in names] for a in arms}
    CHART.parent.mkdir(parents=True, exist_ok=True)
    CHART.write_text(bar_chart_svg("Real engine: throughput by workload and arm", "requests/s", names, series))


# The fit's probes (`--fit`): one replica, cold cache each, straight to the engine (no gateway):
# (name, concurrency, prompts, input tokens, output tokens).
FIT_PROBES = [("lone-short", 1, 8, 64, 64), ("lone-long", 1, 6, 1024, 8), ("four-short", 4, 16, 64, 64)]


def step_costs(medians: dict[str, dict]) -> dict:
    """The step costs FIT_PROBES' medians imply (milliseconds, and microseconds per decoding
    sequence and per prompt token: real tokens, and sim tokens)."""
    decode_ms = (medians["four-short"]["tpot_ms"] - medians["lone-short"]["tpot_ms"]) / 3
    base_ms = medians["lone-short"]["tpot_ms"] - decode_ms
    prefill_ms = (medians["lone-long"]["ttft_ms"] - medians["lone-short"]["ttft_ms"]) / (1024 - 64)
    return {"step_base_ms": base_ms, "decode_us_per_seq": decode_ms * 1000,
            "prefill_us_per_token_real": prefill_ms * 1000,
            "prefill_us_per_sim_token": prefill_ms * 1000 / SIM_TOKENS_PER_TOKEN}


def fit(vllm: Path, raw: Path, engine: str) -> dict:
    """The step costs of one replica, from its measured TTFT and TPOT medians: a lone request's
    TPOT is step_base + decode, four decoding together give step_base + 4 x decode, and the lone
    TTFT's growth from 64 to 1,024 prompt tokens is the prefill per token (real tokens)."""
    replica = Replica(0, 2048, engine, vllm, raw)
    medians: dict[str, dict] = {}
    try:
        replica.start()
        replica.wait_ready()
        for name, conc, n, inp, out in FIT_PROBES:
            replica.reset_cache()
            w = Workload(name, random_dataset(inp, out), n, conc, (2048,))
            path = raw / f"fit-{name}.json"
            report = finish(client(vllm, replica.url, "none", w, w.dataset, n, conc, 4242, path), path)
            medians[name] = {"ttft_ms": report["median_ttft_ms"], "tpot_ms": report["median_tpot_ms"],
                             "itl_ms": report["median_itl_ms"]}
            print(f"fit {name}: {medians[name]}", flush=True)
        log = (raw / "replica-0-2048.log").read_text(errors="replace")
    finally:
        replica.stop()
    out = {"engine": engine, "medians": medians, **step_costs(medians)}
    out["log_kv_cache_tokens"] = next((line.split("size: ", 1)[1] for line in log.splitlines()
                                       if "KV cache size:" in line), None)
    (raw / "fit.json").write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-dir")
    ap.add_argument("--engine", choices=("real", "sim"), default="real")
    ap.add_argument("--workloads", default="long-prefix,short-prefix,random,long-prefix-big,quarter-cache,tenants")
    ap.add_argument("--arms", help="only these arms (comma-separated)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--engine-nice", type=int, default=10,
                    help="the engines' niceness (0-19; default 10): the gateway, Redis and the client first on "
                    "the shared cores, as on a serving host where they never share the engine's cores")
    ap.add_argument("--nice-scope", choices=("engine", "tree"), default="tree",
                    help="what --engine-nice nices on the real engine: the API server and all it starts (tree, "
                    "default), or its compute processes only (engine)")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="32 prompts a run, 1 round; docs untouched")
    ap.add_argument("--no-docs", action="store_true")
    ap.add_argument("--prompts", type=int, help="prompts a run (default 128; --quick 32)")
    ap.add_argument("--concurrency", type=int, help="the client's concurrency on the picking workloads (default "
                    f"{PICKING_CONCURRENCY}; the tenants workload keeps 2 and 16)")
    ap.add_argument("--fit", action="store_true", help="only measure one replica's step costs (FIT_PROBES)")
    ap.add_argument("--compare", type=Path, help="with --engine sim: the real run's summary.json; writes the "
                    "section with the simulator's rows beside it")
    args = ap.parse_args(argv)
    vllm = vllm_dir(args.vllm_dir)
    if args.fit:
        raw = TARGET / "bench-results" / f"real-engine-fit-{args.engine}-{datetime.datetime.now():%Y%m%d-%H%M%S}"
        raw.mkdir(parents=True, exist_ok=True)
        fit(vllm, raw, args.engine)
        return 0
    all_w = workloads(args.quick, args.prompts)
    chosen = [all_w[n] for n in args.workloads.split(",")]
    if args.concurrency:
        for w in chosen:
            if w.name != "tenants":
                w.concurrency = args.concurrency
    rounds = 1 if args.quick else args.rounds
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    raw = TARGET / "bench-results" / f"real-engine-{args.engine}-{stamp}"
    raw.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, list[dict]]] = {w.name: {} for w in chosen}
    by_blocks: dict[tuple[int, ...], list[Workload]] = {}
    for w in chosen:
        by_blocks.setdefault(w.blocks[: args.replicas] if len(w.blocks) >= args.replicas else w.blocks, []).append(w)
    rng = random.Random(stamp)
    for blocks, ws in by_blocks.items():
        replicas = [Replica(i, blocks[i % len(blocks)], args.engine, vllm, raw, nice=args.engine_nice,
                            nice_scope=args.nice_scope)
                    for i in range(args.replicas)]
        try:
            for r in replicas:
                r.start()
            for r in replicas:
                r.wait_ready()
            for round_no in range(rounds):
                for w in ws:
                    arms = [a for a in (args.arms.split(",") if args.arms else w.arms) if arm_fits(w, a)]
                    rng.shuffle(arms)
                    for arm in arms:
                        print(f"[{datetime.datetime.now():%H:%M:%S}] {w.name} {arm} round {round_no}", flush=True)
                        row = one_run(w, arm, replicas, vllm, raw, round_no)
                        results[w.name].setdefault(arm, []).append(row)
                        (raw / "results.json").write_text(json.dumps(results, indent=1))
        finally:
            for r in replicas:
                r.stop()
    summary = summarize(results)
    meta = {"stamp": stamp, "rounds": rounds, "replicas": args.replicas, "engine": args.engine,
            "engine_nice": args.engine_nice, "nice_scope": args.nice_scope,
            "prompts": chosen[0].num_prompts if chosen else None,
            "concurrency": chosen[0].concurrency if chosen else None}
    (raw / "summary.json").write_text(json.dumps({"meta": meta, "summary": summary}, indent=1))
    print(json.dumps(summary, indent=1))
    for row in rows(summary):
        print(" | ".join(row))
    if args.compare:
        real = json.loads(args.compare.read_text())
        head, table_text = comparison(real["summary"], summary)
        print(" | ".join(head) + "\n" + table_text)
        publish(real["summary"], real["meta"], not args.no_docs, summary, meta)
    else:
        publish(summary, meta, args.engine == "real" and not (args.quick or args.no_docs))
    print(f"results: {raw}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
