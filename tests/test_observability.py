"""The gateway on a dashboard: the Prometheus rules (promtool's check and unit tests), the Grafana
dashboard (built with the Grafana Foundation SDK's schema types), and every dashboard panel's
PromQL evaluated by a real Prometheus (Debian's, installed by `make setup`) that scrapes the stack
(sidecar and Envoy) while traffic exercises every row: served requests on a picking pool, a 429
over RPM, a quota warning and refusal, a queued request and a shed one, with prices and the usage
journal on."""

from __future__ import annotations

import contextlib
import json
import math
import re
import shutil
import subprocess
import sys
import threading
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from helpers import chat_body, post, wait_for
from sidecar_checks import metric, open_stream, sidecar_metrics
from stack import Model, Pool, Stack, Tenant, free_port, new_api_key

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "deploy" / "prometheus" / "rules.yaml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "rules_test.yaml"
DASHBOARD = ROOT / "deploy" / "grafana" / "llm-gateway.json"
OPERATIONS = ROOT / "docs" / "operations.md"
sys.path.insert(0, str(ROOT / "tools"))

import grafana_dashboard  # noqa: E402


def tool(name: str) -> str:
    path = shutil.which(name)
    assert path, f"{name} is not installed: `make setup` installs Debian's prometheus package"
    return path


def alerts() -> list[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [r["alert"] for g in groups for r in g["rules"] if "alert" in r]


def test_the_rules_pass_promtools_check_and_unit_tests():
    check = subprocess.run([tool("promtool"), "check", "rules", str(RULES)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    unit = subprocess.run([tool("promtool"), "test", "rules", str(RULE_TESTS)], capture_output=True, text=True,
                          cwd=RULE_TESTS.parent)
    assert unit.returncode == 0, unit.stdout + unit.stderr
    assert "SUCCESS" in unit.stdout


def test_every_alert_fires_in_a_unit_test_and_has_a_runbook_line():
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    fired = {c["alertname"] for t in tests for c in t.get("alert_rule_test", []) if c.get("exp_alerts")}
    quiet = {c["alertname"] for t in tests for c in t.get("alert_rule_test", []) if not c.get("exp_alerts")}
    runbook = OPERATIONS.read_text()
    for alert in alerts():
        assert alert in fired, f"{alert}: no unit test where it fires"
        assert alert in quiet or alert in {"LLMGatewayShedding", "LLMGatewayQueueRefusals", "LLMGatewayQuotaExhausted"}, \
            f"{alert}: no unit test where it stays quiet"
        assert f"### {alert}" in runbook, f"{alert}: no runbook section in docs/operations.md"


def test_the_dashboard_is_what_the_sdk_builds_and_loads_as_grafana_json():
    from grafana_foundation_sdk.models.dashboard import Dashboard

    assert DASHBOARD.read_text() == grafana_dashboard.render(), "run tools/grafana_dashboard.py"
    data = json.loads(DASHBOARD.read_text())
    loaded = Dashboard.from_json(data)
    assert loaded.title == "LLM gateway" and loaded.uid == "llm-gateway"
    rows = [p["title"] for p in data["panels"] if p["type"] == "row"]
    assert rows == [row for row, _ in grafana_dashboard.PANELS]
    graphs = [p for p in data["panels"] if p["type"] == "timeseries"]
    assert len(graphs) == sum(len(panels) for _, panels in grafana_dashboard.PANELS)
    for p in graphs:
        assert p["targets"] and all(t["expr"] and t["datasource"]["type"] == "prometheus" for t in p["targets"]), p


# ------------------------------------------------------------------ a real Prometheus

KEYS = {t: new_api_key() for t in ("obs-main", "obs-limited", "obs-quota", "obs-batch")}
QUOTA_HARD = 60


class ObservedStack(Stack):
    """The stack with prices, and a small daily token quota (a soft limit at 1) for obs-quota."""

    def sidecar_config(self) -> dict:
        config = super().sidecar_config()
        for t in config["tenants"]:
            if t["id"] == "obs-quota":
                t["quota"] = {"tokens_per_day": QUOTA_HARD, "soft_tokens_per_day": 1}
        config["prices"] = {"pick": {"input": 0.15, "output": 0.6}, "fc": {"input": 1.0, "output": 2.0}}
        return config


class Prometheus(contextlib.AbstractContextManager):
    """`prometheus` scraping the stack's sidecar and Envoy every second, with the rules loaded."""

    def __init__(self, workdir: Path, stack: Stack):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        sidecar = urllib.parse.urlparse(stack.sidecar_metrics_url).netloc
        admin = urllib.parse.urlparse(stack.admin_url).netloc
        # The rules as shipped, evaluated every second instead of every 30 s.
        rules = yaml.safe_load(RULES.read_text())
        for group in rules["groups"]:
            group["interval"] = "1s"
        (workdir / "rules.yaml").write_text(yaml.safe_dump(rules))
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(workdir / "rules.yaml")],
            "scrape_configs": [
                {"job_name": "llm-gateway-sidecar", "static_configs": [{"targets": [sidecar]}]},
                {"job_name": "llm-gateway-envoy", "metrics_path": "/stats/prometheus",
                 "static_configs": [{"targets": [admin]}]},
            ],
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = workdir / "prometheus.log"
        self.proc = subprocess.Popen(
            [tool("prometheus"), f"--config.file={workdir / 'prometheus.yml'}",
             f"--storage.tsdb.path={workdir / 'tsdb'}", f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log.open("w"), stderr=subprocess.STDOUT)

    def __enter__(self):
        ready = wait_for(lambda: self._get("/-/ready") is not None, timeout=30)
        assert ready, f"prometheus not ready:\n{self.log.read_text()[-3000:]}"
        return self

    def __exit__(self, *exc):
        self.proc.terminate()
        self.proc.wait(10)

    def _get(self, path: str):
        try:
            with urllib.request.urlopen(self.url + path, timeout=5) as r:
                return r.read()
        except OSError:
            return None

    def query(self, expr: str) -> list[dict]:
        body = self._get("/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
        assert body is not None, f"query failed: {expr}\n{self.log.read_text()[-2000:]}"
        answer = json.loads(body)
        assert answer["status"] == "success", (expr, answer)
        return answer["data"]["result"]

    def caught_up(self, stack: Stack, above: float) -> float:
        """The metered requests Prometheus's last scrape holds, when they are the sidecar's count
        now and more than `above` (0: not yet)."""
        def total(result: list[dict]) -> float:
            return sum(float(s["value"][1]) for s in result)

        metered = metric(sidecar_metrics(stack), "gen_ai_server_request_duration_seconds_count")
        scraped = total(self.query("gen_ai_server_request_duration_seconds_count"))
        return scraped if scraped == metered and scraped > above else 0

    def scraped(self) -> bool:
        up = self.query("up")
        return len(up) == 2 and all(s["value"][1] == "1" for s in up)


def finite(result: list[dict]) -> bool:
    return any(math.isfinite(float(s["value"][1])) for s in result)


@pytest.fixture(scope="module")
def observed(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("observability")
    pools = [Pool("pool_pick", ["sim/pick"], ["--output-tokens", "4", "--ttft-ms", "5", "--itl-ms", "5"],
                  replicas=2, picker={}),
             # A stream of 40 tokens 50 ms apart holds pool_fc's one slot for two seconds.
             Pool("pool_fc", ["sim/fc"], ["--output-tokens", "40", "--ttft-ms", "20", "--itl-ms", "50"],
                  shedding={"max_in_flight": 1, "scrape_interval_ms": 100, "flow_control": {"max_queued": 8}})]
    models = [Model("pick", "pool_pick", served_model_name="sim/pick"),
              Model("fc", "pool_fc", served_model_name="sim/fc")]
    tenants = [Tenant("obs-main", [KEYS["obs-main"]], {"requests_per_minute": 100000}, tier="premium"),
               Tenant("obs-limited", [KEYS["obs-limited"]], {"requests_per_minute": 1, "request_burst": 1}),
               Tenant("obs-quota", [KEYS["obs-quota"]], {"requests_per_minute": 100000}),
               Tenant("obs-batch", [KEYS["obs-batch"]], {"requests_per_minute": 100000}, tier="batch")]
    overrides = {"metrics_listen": "127.0.0.1:0",
                 "flow_control": {"tiers": [{"name": "premium", "max_queue_wait_ms": 30000}]}}
    with ObservedStack(workdir / "stack", pools, models, tenants, sidecar_overrides=overrides) as stack:
        with Prometheus(workdir, stack) as prom:
            assert wait_for(prom.scraped, timeout=20), f"targets not up: {prom.query('up')}"
            # Twice, scrapes apart: a histogram's quantile needs its counts to grow between two
            # scrapes of a series that exists already.
            drive(stack, first=True)
            first = wait_for(lambda: prom.caught_up(stack, above=0), timeout=60)
            assert first, "Prometheus did not scrape the first round"
            drive(stack, first=False)
            assert wait_for(lambda: prom.caught_up(stack, above=first), timeout=60), \
                "Prometheus did not scrape the second round"
            yield stack, prom


def drive(stack, first: bool) -> None:
    """Traffic for every row of the dashboard (the quota is spent in the first round)."""
    for i in range(6):
        r = post(stack, "/v1/chat/completions", chat_body("pick", f"shared prefix {i % 2} " * 40, max_tokens=4),
                 key=KEYS["obs-main"])
        assert r.status_code == 200, r.text
    statuses = [post(stack, "/v1/chat/completions", chat_body("pick", max_tokens=2), key=KEYS["obs-limited"]).status_code
                for _ in range(3)]
    assert 429 in statuses, statuses
    quota = []
    for _ in range(10 if first else 0):
        quota.append(post(stack, "/v1/chat/completions", chat_body("pick", max_tokens=8), key=KEYS["obs-quota"]))
        if quota[-1].status_code == 429:
            break
    if first:
        assert quota[0].headers.get("x-gateway-quota-warning"), dict(quota[0].headers)
        assert quota[-1].status_code == 429 and quota[-1].json()["error"]["code"] == "insufficient_quota", \
            [r.status_code for r in quota]
    # pool_fc admits one request at a time: a held stream fills it, a premium request queues,
    # a batch request (a tier flow control does not queue) is shed.
    body = chat_body("fc", max_tokens=40, stream=True)
    def dispatched() -> float:
        return metric(sidecar_metrics(stack), "llm_gateway_queue_dequeues_total", pool="pool_fc", reason="dispatched")

    dispatched_before = dispatched()
    client, held = open_stream(stack.base_url, body, {"authorization": f"Bearer {KEYS['obs-main']}"})
    try:
        assert held.status_code == 200
        shed = post(stack, "/v1/chat/completions", chat_body("fc", max_tokens=3), key=KEYS["obs-batch"])
        assert shed.status_code == 429 and shed.json()["error"]["code"] == "overloaded", shed.text
        queued: list = []
        t = threading.Thread(target=lambda: queued.append(
            post(stack, "/v1/chat/completions", chat_body("fc", max_tokens=3), key=KEYS["obs-main"], timeout=30)))
        t.start()  # it waits in pool_fc's queue until the held stream ends
    finally:
        held.read()
        held.close()
        client.close()
    t.join(60)
    assert queued and queued[0].status_code == 200, queued and queued[0].text
    assert dispatched() > dispatched_before, "the premium request was not queued"


def panel_queries() -> list[tuple[str, str, list[str]]]:
    """(row, panel, [PromQL]) of every panel, Grafana's variables replaced as it would: `$__rate_interval`
    by 1m, the tenant and model selectors by All."""
    out = []
    for row, panels in grafana_dashboard.PANELS:
        for title, _, queries in panels:
            exprs = [q.replace("$__rate_interval", "1m").replace('"$tenant"', '".*"').replace('"$model"', '".*"')
                     for _, q in queries]
            assert not any("$" in e for e in exprs), exprs
            out.append((row, title, exprs))
    return out


@pytest.mark.parametrize("row,panel,exprs", panel_queries(), ids=[f"{r}/{p}" for r, p, _ in panel_queries()])
def test_every_dashboard_panel_returns_data(observed, row, panel, exprs):
    _, prom = observed
    results = {e: prom.query(e) for e in exprs}
    assert any(finite(r) for r in results.values()), f"{row} / {panel}: no finite sample in\n" + \
        "\n".join(f"{e}\n  -> {r}" for e, r in results.items())


def test_the_recording_rules_sum_over_replicas_and_see_the_traffic(observed):
    stack, prom = observed

    def recorded():
        got = prom.query('tenant_model_outcome:llm_gateway_requests:rate5m{outcome="insufficient_quota"}')
        return got if finite(got) else None

    got = wait_for(recorded, timeout=30)
    assert got and {s["metric"]["tenant"] for s in got} == {"obs-quota"}, got
    assert "instance" not in got[0]["metric"], "the recording rule keeps a replica's label"
    limited = prom.query('sum(tenant_model_outcome:llm_gateway_requests:rate5m{outcome="rate_limited_requests"})')
    assert finite(limited) and float(limited[0]["value"][1]) > 0, limited
    cost = prom.query("sum(llm_gateway_cost_usd_total)")
    assert finite(cost) and float(cost[0]["value"][1]) > 0, cost


def test_the_gen_ai_metrics_carry_the_conventions_labels(observed):
    _, prom = observed
    got = prom.query('gen_ai_server_request_duration_seconds_count{gen_ai_request_model="pick"}')
    assert got, "no duration series for model pick"
    labels = got[0]["metric"]
    assert (labels["gen_ai_operation_name"], labels["gen_ai_provider_name"], labels["gen_ai_response_model"]) == \
        ("chat", "vllm", "sim/pick"), labels
    tokens = prom.query("sum by (gen_ai_token_type) (gen_ai_client_token_usage_count)")
    assert {s["metric"]["gen_ai_token_type"] for s in tokens} == {"input", "output"}, tokens
    assert not re.search(r"\bmodel\b", " ".join(got[0]["metric"])), "a bare `model` label on a gen_ai_ metric"


def test_the_rendered_prometheus_rule_passes_promtool(tmp_path):
    """gatewayctl's PrometheusRule (kubernetes target) holds rule groups promtool accepts."""
    gatewayctl = ROOT / "target" / "release" / "gatewayctl"
    assert gatewayctl.exists(), "make build builds gatewayctl"
    out = tmp_path / "out"
    r = subprocess.run([str(gatewayctl), "render", "--config", str(ROOT / "envoy/examples/gateway.yaml"),
                        "--out", str(out), "--target", "all"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    rule = yaml.safe_load((out / "kubernetes/monitoring/prometheusrule.yaml").read_text())
    assert rule["kind"] == "PrometheusRule"
    (tmp_path / "groups.yaml").write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    check = subprocess.run([tool("promtool"), "check", "rules", str(tmp_path / "groups.yaml")],
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"SUCCESS: {sum(len(g['rules']) for g in rule['spec']['groups'])} rules found" in check.stdout
