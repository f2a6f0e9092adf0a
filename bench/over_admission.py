"""Over-admission of the rate limits with several gateway replicas sharing one Redis.

Starts one redis-server and one shared `vllm-sim` upstream, then N gateway replicas (each an
Envoy with the wasm filter and its own ext_proc sidecar) that all use that Redis, and drives one
tenant through all of them at once with `gateway-bench` (one load generator per replica, for a
fixed duration). The tenant's buckets allow at most `burst + rate × elapsed` requests (and
tokens) in the run; what was admitted beyond that, as a percentage, is the over-admission
(target ≤ 1%). Admitted requests are counted twice, from the clients' 200s and from the usage
records in Redis; tokens from the usage records (prompt + completion, what the TPM bucket is
finally charged after reconciliation), which must also equal what the upstream reports.

    .venv/bin/python bench/over_admission.py                 # 2 replicas, 20 s
    .venv/bin/python bench/over_admission.py --replicas 2 --duration-s 20 --rpm 3000 --tpm 120000
    .venv/bin/python bench/over_admission.py --redis-cluster-nodes 3   # on a 3-node Redis Cluster
    # ... and the node holding the tenant's keys killed 5 s into the run, back 5 s later
    .venv/bin/python bench/over_admission.py --redis-cluster-nodes 3 --kill-node-at-s 5 --node-down-s 5
    # ... with the filters admitting from admission leases (and the sidecars from token leases)
    .venv/bin/python bench/over_admission.py --lease-fraction 0.01 --admission-leases --rpm 30000 --request-burst 2000

With a node killed, the sidecars' `redis.failure_mode` (here `open`, the default) applies while its
slots are down: each sidecar admits from its own in-memory buckets (approximate limits: with N
replicas up to N times the rate during the outage), and usage records are held in memory and
written when the node is back, so the recorded totals must still equal the clients' and the
upstream's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import redis  # noqa: E402

from stack import SIM_BIN, TARGET, Model, Pool, Stack, Tenant, new_api_key, upstream_metric  # noqa: E402

BENCH_BIN = TARGET / "release" / "gateway-bench"
TENANT = "hot"
MODEL = "m"


def start_upstream(workdir: Path, output_tokens: int) -> tuple[subprocess.Popen, str]:
    log = open(workdir / "upstream.log", "ab")  # noqa: SIM115
    proc = subprocess.Popen(
        [str(SIM_BIN), "--port", "0", "--served-model-name", "sim/m", "--output-tokens", str(output_tokens),
         "--max-num-seqs", "1024", "--workers", "1"],
        stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().decode().strip()
    prefix = "vllm-sim listening on"
    if not line.startswith(prefix):
        proc.kill()
        raise RuntimeError(f"vllm-sim did not start: {line!r}")
    return proc, line[len(prefix):].strip()


def run(args: argparse.Namespace) -> dict:
    key = new_api_key()
    limits = {"requests_per_minute": args.rpm, "request_burst": args.request_burst,
              "tokens_per_minute": args.tpm, "token_burst": args.token_burst}
    tenants = [Tenant(TENANT, [key], limits)]
    models = [Model(MODEL, "pool", 4096, served_model_name="sim/m")]
    workdir = Path(tempfile.mkdtemp(prefix="over-admission-"))
    upstream, url = start_upstream(workdir, args.output_tokens)
    stacks: list[Stack] = []
    try:
        for i in range(args.replicas):
            pools = [Pool("pool", ["sim/m"], kind="external", urls=[url])]
            redis_port = stacks[0].redis_port if stacks else None
            stack = Stack(workdir / f"replica{i}", pools, models, tenants, redis_port=redis_port,
                          sidecar_overrides={"redis": {"local_share": round(1 / args.replicas, 6),
                                                       "lease_fraction": args.lease_fraction}},
                          envoy_concurrency=1, redis_cluster_nodes=0 if stacks else args.redis_cluster_nodes,
                          admission_leases=args.admission_leases)
            if stacks:
                # Later replicas share the first one's Redis (or Redis Cluster).
                stack.redis_cluster_ports = stacks[0].redis_cluster_ports
            stacks.append(stack)
            stack.start()
        if args.redis_cluster_nodes:
            client = redis.RedisCluster(host="127.0.0.1", port=stacks[0].redis_port, decode_responses=True)
        else:
            client = redis.Redis(port=stacks[0].redis_port, decode_responses=True)
        generated_before = upstream_metric(url, "vllm:generation_tokens_total")
        prompt_before = upstream_metric(url, "vllm:prompt_tokens_total")
        benches = []
        outage: dict[str, float | int] = {}
        killer = None
        if args.kill_node_at_s is not None:
            if not args.redis_cluster_nodes:
                raise RuntimeError("--kill-node-at-s needs --redis-cluster-nodes")
            plain = redis.Redis(port=stacks[0].redis_cluster_ports[0])
            slot = int(plain.execute_command("CLUSTER", "KEYSLOT", f"{{{TENANT}}}"))
            owner = next((int(r[2][1]) for r in plain.execute_command("CLUSTER", "SLOTS")
                          if int(r[0]) <= slot <= int(r[1])), None)
            if owner is None:
                raise RuntimeError(f"no node owns slot {slot}")

            def kill_and_restart() -> None:
                time.sleep(args.kill_node_at_s)
                outage["killed_at_s"] = round(time.monotonic() - started, 2)
                stacks[0].kill_cluster_node(owner)
                time.sleep(args.node_down_s)
                outage["restarted_at_s"] = round(time.monotonic() - started, 2)
                stacks[0].restart_cluster_node(owner)
                outage["cluster_ok_at_s"] = round(time.monotonic() - started, 2)
                outage["node_port"] = owner

            killer = threading.Thread(target=kill_and_restart, daemon=True)
        started = time.monotonic()
        if killer:
            killer.start()
        for i, stack in enumerate(stacks):
            out = workdir / f"bench{i}.json"
            argv = [str(BENCH_BIN), "--base-url", stack.base_url, "--api-key", key, "--model", MODEL,
                    "--max-concurrency", str(args.concurrency), "--num-prompts", "1000000",
                    "--duration-s", str(args.duration_s), "--input-len", "32", "--output-len",
                    str(args.output_tokens), "--seed", str(i), "--no-progress", "--output-json", str(out)]
            benches.append((subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE), out))
        reports = []
        for proc, out in benches:
            _, err = proc.communicate(timeout=args.duration_s + 120)
            if proc.returncode != 0:
                raise RuntimeError(f"gateway-bench failed: {err.decode()[-2000:]}")
            reports.append(json.loads(out.read_text()))
        if killer:
            killer.join(timeout=60)
        elapsed = time.monotonic() - started

        day = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
        usage_key = f"llmgw:usage:{{{TENANT}}}:{day}"
        sent = sum(p["sent"] for r in reports for p in r["points"])
        admitted_clients = sum(p["status_codes"].get("200", 0) for r in reports for p in r["points"])
        rejected = sum(p["status_codes"].get("429", 0) for r in reports for p in r["points"])

        def recorded() -> dict[str, int]:
            return {k: int(v) for k, v in client.hgetall(usage_key).items()}

        deadline = time.monotonic() + 30
        usage = recorded()
        while usage.get(f"{MODEL}:requests", 0) < admitted_clients and time.monotonic() < deadline:
            time.sleep(0.1)  # poll interval while the sidecars flush their records
            usage = recorded()
        admitted = usage.get(f"{MODEL}:requests", 0)
        tokens = usage.get(f"{MODEL}:prompt_tokens", 0) + usage.get(f"{MODEL}:completion_tokens", 0)
        upstream_tokens = (upstream_metric(url, "vllm:generation_tokens_total") - generated_before
                           + upstream_metric(url, "vllm:prompt_tokens_total") - prompt_before)
        allowed_requests = args.request_burst + args.rpm * elapsed / 60
        allowed_tokens = args.token_burst + args.tpm * elapsed / 60
        return {
            "replicas": args.replicas,
            "redis": f"cluster of {args.redis_cluster_nodes}" if args.redis_cluster_nodes else "single",
            "duration_s": round(elapsed, 2),
            "concurrency_per_replica": args.concurrency,
            "limits": limits,
            "lease_fraction": args.lease_fraction,
            "admission_leases": args.admission_leases,
            "sent": sent,
            "admitted_by_clients": admitted_clients,
            "rejected_429": rejected,
            "admitted_recorded": admitted,
            "allowed_requests": round(allowed_requests, 1),
            "request_over_admission_pct": round(max(0.0, admitted - allowed_requests) / allowed_requests * 100, 3),
            "tokens_recorded": tokens,
            "tokens_upstream": int(upstream_tokens),
            "allowed_tokens": round(allowed_tokens, 1),
            "token_over_admission_pct": round(max(0.0, tokens - allowed_tokens) / allowed_tokens * 100, 3),
            **({"node_killed": outage} if outage else {}),
        }
    finally:
        for stack in stacks:
            stack.close()
        upstream.terminate()
        upstream.wait(timeout=10)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--redis-cluster-nodes", type=int, default=0, help="0: one redis-server")
    parser.add_argument("--duration-s", type=float, default=20)
    parser.add_argument("--concurrency", type=int, default=16, help="clients per replica")
    parser.add_argument("--rpm", type=int, default=3000)
    parser.add_argument("--request-burst", type=int, default=100)
    parser.add_argument("--tpm", type=int, default=400000)
    parser.add_argument("--token-burst", type=int, default=20000)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--json", type=Path, help="also write the result here")
    parser.add_argument("--kill-node-at-s", type=float, default=None,
                        help="kill the cluster node holding the tenant's keys this many seconds into the run")
    parser.add_argument("--node-down-s", type=float, default=5.0, help="seconds until it is started again")
    parser.add_argument("--lease-fraction", type=float, default=0.0,
                        help="the sidecars' redis.lease_fraction (token leases; 0: none)")
    parser.add_argument("--admission-leases", action="store_true",
                        help="the filters admit from admission leases (needs --lease-fraction > 0)")
    args = parser.parse_args()
    result = run(args)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
