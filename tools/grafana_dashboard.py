"""Builds the gateway's Grafana dashboard, deploy/grafana/llm-gateway.json, with the Grafana
Foundation SDK (its types come from Grafana 11.6's dashboard schema, so what it builds loads there).

    .venv/bin/python tools/grafana_dashboard.py          # rewrites deploy/grafana/llm-gateway.json
    .venv/bin/python tools/grafana_dashboard.py --check  # exit 1 if the file is not what this builds

One row per stage of a request's path: traffic and errors, latency, tokens and cost, rate limits
and quotas, shedding and flow control, the endpoint picker, Redis, the usage ledger. Every query
reads the sidecar's metrics (job `llm-gateway-sidecar`) or Envoy's (`llm-gateway-envoy`), summed
over replicas. `PANELS` lists each panel's queries; tests/test_observability.py evaluates them
against a real Prometheus scraping the stack.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from grafana_foundation_sdk.builders import dashboard, prometheus, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import DataSourceRef, VariableOption, VariableRefresh

OUT = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "llm-gateway.json"
DS = DataSourceRef(type_val="prometheus", uid="${datasource}")
T = '{tenant=~"$tenant"}'
TM = '{tenant=~"$tenant", model=~"$model"}'
M = '{gen_ai_request_model=~"$model"}'
R = "[$__rate_interval]"
# The filter's own counter: the wasm module's (Envoy strips its `wasmcustom.` namespace) and the
# native module's (Envoy keeps `dynamicmodulescustom`) read under both names.
FILTER_REQUESTS = "llm_gateway_filter_requests_total|envoy_dynamicmodulescustom_llm_gateway_filter_requests_total"



def quantiles(histogram: str, by: str, selector: str) -> list[tuple[str, str]]:
    """The p50 and p99 queries of a histogram, one series per `by`."""
    return [(f"{name} {{{{{by}}}}}",
             f"histogram_quantile({q}, sum by (le, {by}) (rate({histogram}_bucket{selector}{R})))")
            for name, q in (("p50", "0.5"), ("p99", "0.99"))]


# (row, [(panel title, unit, [(legend, PromQL), ...]), ...])
PANELS: list[tuple[str, list[tuple[str, str, list[tuple[str, str]]]]]] = [
    ("Traffic and errors", [
        ("Requests by admission outcome", "reqps", [
            ("{{outcome}}", f"sum by (outcome) (rate(llm_gateway_requests_total{TM}{R}))")]),
        ("Requests by tenant", "reqps", [
            ("{{tenant}}", f"sum by (tenant) (rate(llm_gateway_requests_total{TM}{R}))")]),
        ("Metered responses by status and end", "reqps", [
            ("{{status}} {{end_reason}}", f"sum by (status, end_reason) (rate(llm_gateway_responses_total{TM}{R}))")]),
        ("Envoy responses by class", "reqps", [
            ("{{envoy_response_code_class}}xx",
             f'sum by (envoy_response_code_class) (rate(envoy_http_downstream_rq_xx{{envoy_http_conn_manager_prefix="gateway"}}{R}))')]),
        ("Filter: requests by outcome and reason", "reqps", [
            ("{{outcome}} {{reason}}",
             f'sum by (outcome, reason) (rate({{__name__=~"{FILTER_REQUESTS}", tenant=~"$tenant"}}{R}))')]),
        ("Admission (ext_proc) failures", "reqps", [
            ("streams failed", f"sum(rate(envoy_http_ext_proc_streams_failed{R}))"),
            ("message timeouts", f"sum(rate(envoy_http_ext_proc_message_timeouts{R}))")]),
    ]),
    ("Latency", [
        ("Time to first token", "s", quantiles("gen_ai_server_time_to_first_token_seconds", "gen_ai_request_model", M)),
        ("Time per output token (ITL)", "s",
         quantiles("gen_ai_server_time_per_output_token_seconds", "gen_ai_request_model", M)),
        ("End-to-end request duration", "s",
         quantiles("gen_ai_server_request_duration_seconds", "gen_ai_request_model", M)),
        ("Failed requests by error type", "reqps", [
            ("{{error_type}}", f'sum by (error_type) (rate(gen_ai_server_request_duration_seconds_count{{gen_ai_request_model=~"$model", error_type!=""}}{R}))'),
            ("all", f"sum(rate(gen_ai_server_request_duration_seconds_count{M}{R}))")]),
    ]),
    ("Tokens and cost", [
        ("Tokens by tenant and type", "short", [
            ("{{tenant}} {{token_type}}", f"sum by (tenant, token_type) (rate(llm_gateway_tokens_total{TM}{R}))")]),
        ("Tokens per request", "short", quantiles("gen_ai_client_token_usage", "gen_ai_token_type", M)),
        ("Cost by tenant and model (USD per hour)", "currencyUSD", [
            ("{{tenant}} {{model}}", f"sum by (tenant, model) (rate(llm_gateway_cost_usd_total{TM}{R})) * 3600")]),
    ]),
    ("Rate limits and quotas", [
        ("Rate-limit decisions", "reqps", [
            ("{{decision}} (degraded {{degraded}})", f"sum by (decision, degraded) (rate(llm_gateway_limit_decisions_total{R}))")]),
        ("Refusals by tenant", "reqps", [
            ("{{tenant}} {{outcome}}",
             f'sum by (tenant, outcome) (rate(llm_gateway_requests_total{{tenant=~"$tenant", outcome=~"rate_limited_.*|insufficient_quota"}}{R}))')]),
        ("Quota warnings (past a soft limit)", "reqps", [
            ("{{tenant}}", f"sum by (tenant) (rate(llm_gateway_quota_warnings_total{T}{R}))")]),
    ]),
    ("Shedding and flow control", [
        ("Shed (429 overloaded) by pool and tier", "reqps", [
            ("{{pool}} {{tier}}", f"sum by (pool, tier) (rate(llm_gateway_shed_total{R}))")]),
        ("Queued requests", "short", [
            ("{{pool}} {{tier}}", "sum by (pool, tier) (llm_gateway_queue_requests)")]),
        ("Queue wait", "s", [
            ("p99 {{pool}} {{tier}}", f"histogram_quantile(0.99, sum by (le, pool, tier) (rate(llm_gateway_queue_wait_seconds_bucket{R})))")]),
        ("Dequeues by reason", "reqps", [
            ("{{pool}} {{reason}}", f"sum by (pool, reason) (rate(llm_gateway_queue_dequeues_total{R}))")]),
        ("Pool load and in flight", "short", [
            ("load {{pool}}", "max by (pool) (llm_gateway_pool_load)"),
            ("in flight {{pool}}", "max by (pool) (llm_gateway_in_flight_requests)")]),
    ]),
    ("Endpoint picker", [
        ("Picks by endpoint and reason", "reqps", [
            ("{{endpoint}} {{by}}", f"sum by (pool, endpoint, by) (rate(llm_gateway_picker_picks_total{R}))")]),
        ("Prefix cache hits (blocks hit / requested)", "percentunit", [
            ("{{pool}}", f'sum by (pool) (rate(llm_gateway_picker_prefix_blocks_total{{kind="hit"}}{R})) / sum by (pool) (rate(llm_gateway_picker_prefix_blocks_total{{kind="requested"}}{R}))')]),
        ("In flight per endpoint", "short", [
            ("{{endpoint}}", "sum by (pool, endpoint) (llm_gateway_picker_in_flight_requests)")]),
        ("Endpoint metrics age", "s", [
            ("{{endpoint}}", "max by (pool, endpoint) (time() - llm_gateway_endpoint_last_scrape_timestamp_seconds)")]),
    ]),
    ("Redis", [
        ("Command latency p99", "s", [
            ("{{op}}", f"histogram_quantile(0.99, sum by (le, op) (rate(llm_gateway_redis_command_duration_seconds_bucket{R})))")]),
        ("Errors and timeouts, degraded decisions", "ops", [
            ("errors {{op}}", f"sum by (op) (rate(llm_gateway_redis_errors_total{R}))"),
            ("degraded {{reason}}", f"sum by (reason) (rate(llm_gateway_degraded_decisions_total{R}))"),
            ("commands", f"sum(rate(llm_gateway_redis_command_duration_seconds_count{R}))")]),
    ]),
    ("Configuration", [
        ("Config generation per sidecar (+1 per applied reload)", "short", [
            ("{{instance}}", "max by (instance) (llm_gateway_config_generation)")]),
    ]),
    ("Usage ledger", [
        ("Records written and lost", "ops", [
            ("written", f"sum(rate(llm_gateway_usage_records_written_total{R}))"),
            ("dropped", f"sum(rate(llm_gateway_usage_records_dropped_total{R}))"),
            ("refused", f"sum(rate(llm_gateway_usage_records_refused_total{R}))"),
            ("unconfirmed", f"sum(rate(llm_gateway_usage_records_unconfirmed_total{R}))")]),
        ("Records waiting, reservations open", "short", [
            ("buffered", "sum(llm_gateway_usage_records_buffered)"),
            ("reservations open", "max(llm_gateway_reservations_open)")]),
        ("Usage journal", "bytes", [
            ("lag", "max(llm_gateway_journal_lag_bytes)"),
            ("lines read/s", f"sum(rate(llm_gateway_journal_lines_total{R}))")]),
    ]),
]


def build() -> dict:
    """The dashboard, as Grafana's JSON model."""
    d = (dashboard.Dashboard("LLM gateway")
         .uid("llm-gateway")
         .tags(["llm-gateway", "envoy", "vllm"])
         .description("Tenants, limits, routing and metering of the LLM gateway (its sidecar's and Envoy's metrics).")
         .refresh("30s")
         .time("now-1h", "now")
         .timezone("browser")
         .with_variable(dashboard.DatasourceVariable("datasource").label("Data source").type("prometheus"))
         .with_variable(dashboard.QueryVariable("tenant").label("Tenant").datasource(DS)
                        .query("label_values(llm_gateway_requests_total, tenant)")
                        .multi(True).include_all(True).all_value(".*")
                        .current(VariableOption(text="All", value="$__all"))
                        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED))
         .with_variable(dashboard.QueryVariable("model").label("Model").datasource(DS)
                        .query("label_values(llm_gateway_requests_total, model)")
                        .multi(True).include_all(True).all_value(".*")
                        .current(VariableOption(text="All", value="$__all"))
                        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)))
    for row, panels in PANELS:
        d = d.with_row(dashboard.Row(row))
        for title, unit, queries in panels:
            p = timeseries.Panel().title(title).unit(unit).datasource(DS).height(8).span(8)
            for i, (legend, expr) in enumerate(queries):
                p = p.with_target(prometheus.Dataquery().expr(expr).legend_format(legend)
                                  .ref_id(chr(ord("A") + i)).datasource(DS))
            d = d.with_panel(p)
    return json.loads(json.dumps(d.build(), cls=JSONEncoder))


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 if the file differs from what this builds")
    args = parser.parse_args()
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is not what tools/grafana_dashboard.py builds: run it", file=sys.stderr)
            return 1
        return 0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
