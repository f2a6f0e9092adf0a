"""bench/real_engine.py's report, on made-up medians (no vLLM here: `make bench-real` runs the
benchmark itself): the headline rows docs/benchmarks.md keeps, with their first cells exactly as
written there, the simulator's comparison (its ±20 % count and the arms' ranking), and the step
costs the fit derives from its probes."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import real_engine  # noqa: E402


def arm(req_per_s, ttft_p50, ttft_p99=None, failed=0):
    return {"req_per_s": req_per_s, "ttft_p50_ms": ttft_p50, "ttft_p99_ms": ttft_p99 or 2 * ttft_p50,
            "e2e_p50_ms": None, "failed": failed, "hit_rate": 0.5, "requests_per_replica": [], "errors": []}


def tenant_arm(light, heavy=None, light_failed=0, heavy_failed=0):
    return {"light": {"req_per_s": light[0], "ttft_p50_ms": light[1], "ttft_p99_ms": light[2], "failed": light_failed},
            "heavy": ({"req_per_s": heavy, "ttft_p50_ms": 1.0, "ttft_p99_ms": 2.0, "failed": heavy_failed}
                      if heavy is not None else None)}


SUMMARY = {
    "long-prefix": {"least-request": arm(1.0, 1000), "picker": arm(1.2, 900, failed=1), "ceiling": arm(1.5, 500)},
    "short-prefix": {"least-request": arm(2.0, 800, 1000), "picker": arm(1.96, 800, 1100)},
    "random": {"least-request": arm(1.5, 700, 1000), "picker": arm(1.5, 700, 1000)},
    "tenants": {"light-alone": tenant_arm((0.5, 400, 1000)), "no-flow-control": tenant_arm((0.2, 4000, 9000), 1.0),
                "flow-control": tenant_arm((0.4, 500, 1500), 0.95, heavy_failed=2)},
}


def test_headline_rows_have_the_documented_first_cells_and_ratios():
    rows = real_engine.rows(SUMMARY)
    assert [r[0] for r in rows] == [
        "Real engine, long shared prefixes: picker vs least-request throughput",
        "Real engine, short prefixes and random prompts: picker vs least-request throughput",
        "Real engine, light beside heavy: light TTFT p50 vs alone",
    ]
    assert rows[0][1] == "1.20× (TTFT p50 0.90×, failed 1; ceiling 1.50×)"
    assert rows[1][1] == ("short-prefix 0.98× (TTFT p99 1.10×, failed 0); "
                          "random 1.00× (TTFT p99 1.00×, failed 0)")
    assert rows[2][1] == ("1.25× (p99 1.50×; heavy 0.95× of its throughput without flow control while light "
                          "ran; refused light 0, heavy 2)")
    # Where the run counted heavy's throughput while light ran, the row takes that one.
    beside = {**SUMMARY["tenants"]}
    beside["flow-control"] = tenant_arm((0.4, 500, 1500), 0.95, heavy_failed=2)
    beside["flow-control"]["heavy"]["beside_light_req_per_s"] = 0.8
    beside["no-flow-control"] = tenant_arm((0.2, 4000, 9000), 1.0)
    beside["no-flow-control"]["heavy"]["beside_light_req_per_s"] = 1.0
    assert "heavy 0.80× of its throughput" in real_engine.rows({**SUMMARY, "tenants": beside})[2][1]


def logged(tenant, start_s, duration_ms, code=200):
    stamp = f"2026-12-07T11:{int(start_s) // 60:02d}:{start_s % 60:06.3f}Z"
    return {"path": "/v1/chat/completions", "tenant": tenant, "start_time": stamp, "duration_ms": duration_ms,
            "response_code": code}


def test_heavy_is_counted_only_while_light_ran():
    # Light runs from 10 s to 30 s; heavy's requests ending at 5 s (before), 15 s and 25 s
    # (within), 40 s (after), a 503 within and one cut at 45 s when its client stopped
    # (code 0): 2 completions in 20 s, 4 of the pool's, 1 failure.
    entries = [logged("light", 10, 5_000), logged("light", 20, 10_000),
               logged("heavy", 0, 5_000), logged("heavy", 5, 10_000), logged("heavy", 15, 10_000),
               logged("heavy", 30, 10_000), logged("heavy", 12, 1_000, code=503), logged("heavy", 40, 5_000, code=0),
               {"path": "/metrics", "tenant": None, "start_time": "2026-12-07T11:00:12.000Z", "duration_ms": 0}]
    figures = real_engine.heavy_figures(entries)
    assert figures["beside_light_req_per_s"] == pytest.approx(0.1)
    assert figures["total_beside_light_req_per_s"] == pytest.approx(0.2)
    assert figures["failed"] == 1
    none = real_engine.heavy_figures([e for e in entries if e["tenant"] != "light"])
    assert none["beside_light_req_per_s"] is None and none["failed"] == 0


def test_the_simulator_is_compared_arm_by_arm_and_by_ranking():
    # Within 20 % everywhere but the ceiling's throughput, and long-prefix ranked otherwise.
    sim = {
        "long-prefix": {"least-request": arm(1.1, 1050), "picker": arm(1.05, 950), "ceiling": arm(2.0, 520)},
        "random": {"least-request": arm(1.4, 690), "picker": arm(1.45, 720)},
    }
    head, table = real_engine.comparison(SUMMARY, sim)
    assert head[0] == "Simulator vs real engine: throughput and TTFT p50"
    assert "worst throughput 1.33×" in head[1]
    assert "(9 of 10 within ±20 %)" in head[1]
    assert "arms ranked the same on 0 of 2 picking workloads" in head[1]
    assert "| long-prefix: ceiling | 1.50 | 2.00 | 1.33× |" in table
    # The same ranking counts (the real random arms tie: the first listed ranks first).
    sim["long-prefix"]["picker"] = arm(1.2, 950)
    assert "ranked the same on 1 of 2" in real_engine.comparison(SUMMARY, sim)[0][1]
    sim["random"]["least-request"] = arm(1.5, 700)
    assert "ranked the same on 2 of 2" in real_engine.comparison(SUMMARY, sim)[0][1]


def test_section_carries_the_rows_and_the_simulators():
    meta = {"replicas": 2, "rounds": 2, "stamp": "s1", "prompts": 64}
    sim = {"random": {"least-request": arm(1.5, 700), "picker": arm(1.5, 700)}}
    text = real_engine.section(SUMMARY, meta, sim, {"rounds": 1, "prompts": 64, "stamp": "s2"})
    assert text.startswith(real_engine.BEGIN) and text.endswith(real_engine.END)
    for cell in ("| Real engine, long shared prefixes: picker vs least-request throughput |",
                 "| Simulator vs real engine: throughput and TTFT p50 |", "### The simulator against it"):
        assert cell in text


def test_step_costs_from_the_fits_probes():
    medians = {"lone-short": {"ttft_ms": 121.0, "tpot_ms": 38.5}, "lone-long": {"ttft_ms": 1228.0, "tpot_ms": 37.0},
               "four-short": {"ttft_ms": 160.0, "tpot_ms": 48.8}}
    c = real_engine.step_costs(medians)
    assert c["decode_us_per_seq"] == pytest.approx(3433.3, abs=0.1)
    assert c["step_base_ms"] == pytest.approx(35.07, abs=0.01)
    assert c["prefill_us_per_token_real"] == pytest.approx(1153.1, abs=0.1)
    assert c["prefill_us_per_sim_token"] == pytest.approx(1153.1 / 1.9, abs=0.1)


def test_arm_suffixes_run_where_their_arm_runs():
    ws = real_engine.workloads(quick=True)
    tenants, random = ws["tenants"], ws["random"]
    assert real_engine.arm_fits(tenants, "flow-control-apifirst")
    assert real_engine.arm_fits(tenants, "flow-control-o1-apifirst")
    assert real_engine.arm_fits(tenants, "light-alone")
    assert not real_engine.arm_fits(tenants, "picker-apifirst")
    assert real_engine.arm_fits(random, "least-request-fullscrape-apifirst")
    assert not real_engine.arm_fits(random, "ceiling")
    assert not real_engine.arm_fits(random, "flow-control-apifirst")


def test_flow_control_arms_name_their_reserve():
    assert real_engine.newcomer_reserve("flow-control") is None
    assert real_engine.newcomer_reserve("flow-control-reserve") == real_engine.NEWCOMER_RESERVE
    assert real_engine.newcomer_reserve("flow-control-r0.125") == 0.125
    assert real_engine.arm_fits(real_engine.workloads(quick=True)["tenants"], "flow-control-r0.125")
