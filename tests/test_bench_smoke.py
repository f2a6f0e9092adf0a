"""Smoke test of the benchmark orchestrator, bench/overhead.py.

A `--quick` run against the upstream directly and bare Envoy; the test checks that its summary is
complete and self-consistent, and no timing: benchmark figures are never test assertions.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LATENCIES = ("ttft_p50_ms", "ttft_p99_ms", "itl_p99_ms", "e2e_p50_ms", "e2e_p99_ms")


def test_quick_run_summary_is_complete_and_consistent(tmp_path):
    """Every round's counts add up, every aggregate lies within its rounds, the page renders."""
    results = tmp_path / "results"
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "overhead.py"), "--quick", "--rounds", "2",
         "--targets", "direct,bare", "--scenarios", "overhead,saturation",
         "--results", str(results), "--no-write-docs"],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads((results / "summary.json").read_text())
    assert set(summary["results"]) == {"overhead", "saturation"}

    for name in ("overhead", "saturation"):
        scenario = summary["results"][name]
        assert scenario["rounds"] == 2
        for target, rows in scenario["per_round"].items():
            assert len(rows) == 2, target
            for row in rows:
                assert row["sent"] > 0
                assert row["completed"] + row["failed"] == row["sent"], row
                assert sum(row["errors"].values()) == row["sent"], row
                assert row["errors"]["ok"] == row["completed"] == row["sent"], row  # nothing may fail here
                assert row["request_throughput"] > 0
                for key in LATENCIES:
                    assert row[key] is not None and row[key] >= 0, (target, key)
                assert row["ttft_p50_ms"] <= row["ttft_p99_ms"] and row["e2e_p50_ms"] <= row["e2e_p99_ms"]
            assert {row["round"] for row in rows} == {0, 1}
            summary_row = scenario["targets"][target]
            assert summary_row["sent"] == sum(r["sent"] for r in rows)
            for key in ("request_throughput", *LATENCIES):
                stat = summary_row[key]
                assert stat["min"] <= stat["median"] <= stat["max"], (target, key, stat)
        # CPU is charged to Envoy for bare and to nothing for direct; bare has a peak RSS.
        assert set(scenario["targets"]["bare"]["cpu_s_per_1k"]) == {"envoy"}
        assert scenario["targets"]["direct"]["cpu_s_per_1k"] == {}
        assert scenario["targets"]["bare"]["peak_rss_mb"]["envoy"] > 0
        # The order rotates: each target runs first in one of the two rounds.
        firsts = {row["position"] for row in scenario["per_round"]["direct"]}
        assert firsts == {0, 1}
        diff = scenario["vs_bare"]["direct"]
        assert set(diff) >= {*LATENCIES, "throughput_ratio"}
        assert diff["throughput_ratio"]["median"] > 0

    checks = {c["target"]: c["status"] for c in summary["checks"]}
    assert checks["gateway-bench: streamed requests/s on one thread"] == "not run"
    assert all(status in ("pass", "miss", "pending", "reported", "not run") for status in checks.values())
    page = (results / "benchmarks.md").read_text()
    assert "| `bare` |" in page and "## Targets" in page


def test_picker_quick_run_is_complete_and_consistent(tmp_path):
    """bench/picker.py --quick on scenario a: every target's run sent its whole workload, nothing
    failed, the replicas' request counters add up to what was sent, the hit rates are rates, and
    the ratios are computed against least-request (no timing asserted)."""
    results = tmp_path / "picker"
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "picker.py"), "--quick", "--scenarios", "a", "--no-docs",
         "--results", str(results)],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads((results / "summary.json").read_text())
    rows = summary["results"]["a"]
    assert set(rows) == {"least-request", "picker", "picker-leases", "lr-two-choices"}
    sent = {len(r) for r in rows.values()}
    assert sent == {1}, rows
    for target, (row,) in rows.items():
        assert row["sent"] > 0 and row["failed"] == 0 and row["completed"] == row["sent"], (target, row)
        assert sum(row["requests"]) == row["sent"], (target, row)  # every request reached a replica once
        assert 0.0 <= row["hit_rate"] <= 1.0, (target, row)
        assert row["ttft_p50_ms"] <= row["ttft_p99_ms"]
    a = summary["summary"]["a"]
    assert a["picker"]["ttft_p50_ms_ratio"] > 0 and "ttft_p50_ms_ratio" not in a["least-request"]
    assert (results / "picker.md").read_text().count("picker-benchmark:") == 2


def test_flow_control_quick_run_is_complete_and_consistent(tmp_path):
    """bench/flow_control.py --quick on the burst and memory scenarios: every request of every
    target is accounted for (served, 429 or timed out), flow control queued the whole burst (its
    budget holds it) and reported the waits, and SIGTERM answered every queued request (no timing
    asserted)."""
    results = tmp_path / "flow"
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "flow_control.py"), "--quick", "--scenarios", "burst,memory",
         "--no-docs", "--results", str(results)],
        capture_output=True, text=True, timeout=600, check=False,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads((results / "summary.json").read_text())
    runs = summary["results"]["burst"]
    assert set(runs) == {"flow-control", "threshold", "threshold-tuned", "direct"}
    for target, (row,) in runs.items():
        burst = row["tenants"]["burst"]
        assert burst["sent"] > 0, target
        accounted = burst["served"] + burst["overloaded"] + burst["timeouts"] + burst["other_errors"]
        assert accounted == burst["sent"], (target, burst)
    flow = runs["flow-control"][0]["tenants"]["burst"]
    assert flow["served"] == flow["sent"] and flow["max_queue_wait_ms"] > 0, flow
    assert "max_queue_wait_ms" not in runs["direct"][0]["tenants"]["burst"] or \
        runs["direct"][0]["tenants"]["burst"]["max_queue_wait_ms"] is None
    memory = summary["summary"]["memory"]
    assert memory["queued"] > 0 and memory["answered_429"] == memory["requests"], memory
    assert (results / "flow-control.md").read_text().count("flow-control-benchmark:") == 2
