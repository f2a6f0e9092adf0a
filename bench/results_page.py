"""The results page of the benchmark suite: Markdown tables, SVG bar charts and docs/benchmarks.md.

`bench/overhead.py` runs the benchmarks and hands its summary (the dict also saved as
summary.json) to `render_page`; the page's prose is the template `bench/benchmarks.md.tmpl`.
"""

from __future__ import annotations

import shlex
import shutil
import string
from pathlib import Path

TEMPLATE = Path(__file__).resolve().parent / "benchmarks.md.tmpl"

# What each target of the interleaved scenarios is, for the page.
TARGET_TEXT = {
    "direct": "gateway-bench → vllm-sim, no Envoy (what Envoy itself costs, against `bare`)",
    "bare": "Envoy with the gateway's bootstrap but no filter and no sidecar",
    "filter": "Envoy + the wasm filter (auth, body validation, routing), configured as gatewayctl renders it (`upstream_headers: routing`: only `x-gateway-pool` is set upstream; the decision travels in filter state)",
    "gateway": "Envoy + filter + the ext_proc sidecar as gatewayctl renders them by default: with leases (`redis.lease_fraction: 0.01` and the filter's `admission_leases`): the filter admits most requests from admission leases without the ext_proc round trip (Envoy's matcher skips it), and the sidecar's own decisions use token leases; metering by the filter, delivered by Envoy's gRPC access log",
    "gateway-exact": "the gateway with leases off (`redis.lease_fraction: 0`): admission against Redis in the sidecar on every request (the default before issue 18)",
    "gateway-shed": "the gateway (with leases) whose pool the sidecar sheds by its load, as the example config's `pool_qwen` (`max_queue_depth: 64`, `max_kv_cache_usage: 0.95`, scraped every 500 ms): its admission leases cover at most half of the pool's headroom at a time (`ext-proc/src/admission/lease_headroom.rs`)",
    "gateway-no-metering": "diagnostic: `gateway-exact` without its metering access log (admission only; the filter still measures)",
    "filter-noop": "diagnostic: Envoy + a proxy-wasm filter that does nothing (`filter/examples/noop.rs`): the floor any proxy-wasm filter costs in Envoy's V8 runtime",
    "filter-floor": "diagnostic: Envoy + `filter/examples/host_floor.rs`, the wasm filter's host calls and body buffering with fixed values and no decisions (as `filter` is configured): the floor of the wasm filter's design, which no change inside the VM can remove",
    "filter-all-headers": "diagnostic: `filter` with the filter's own default `upstream_headers: all`: the header contract's informational `x-gateway-*` headers set upstream too (7 more header writes on the saturation request)",
    "filter-base": "diagnostic: Envoy + another build of the filter (`$FILTER_BASE_WASM`): a change to the filter measured side by side with the build it changes",
    "gateway-base": "diagnostic: the gateway with another build of the sidecar (`$SIDECAR_BASE_BIN`): a change to the sidecar measured side by side with the build it changes",
    "dynmod-noop": "diagnostic: Envoy + a native dynamic-module filter that does nothing (`bench/dynmod-noop`): the floor of a native filter",
    "filter-native-base": "diagnostic: `filter-native` with another build of the native module (`$FILTER_NATIVE_BASE_SO`): a change to the native filter measured side by side with the build it changes",
    "filter-native": "diagnostic: Envoy + the filter as a native dynamic module (`filter-native/`, the same decisions behind Envoy's C ABI)",
    "gateway-native": "diagnostic: `gateway-exact` with the filter as a native dynamic module (`filter-native/`) in the wasm filter's place",
    "gateway-native-leases": "diagnostic: the gateway (with leases) and the filter as a native dynamic module",
    "gateway-native-leases-base": "diagnostic: `gateway-native-leases` with another build of the sidecar (`$SIDECAR_BASE_BIN`)",
    "gateway-ext-proc-metering": "diagnostic: `gateway-exact` metered by an observability-mode ext_proc filter (every chunk to the sidecar) instead of the access log",
    "gateway-native-leases-journal": "diagnostic: `gateway-native-leases` with the usage journal (`sidecar.metering.journal_path`: Envoy's file access log, tailed by the sidecar), which the default rendering has not",
    "gateway-native-leases-no-grpc-log": "diagnostic: `gateway-native-leases` without the metering gRPC access log (no usage delivered: what the delivery costs)",
    "gateway-native-leases-no-guard": "diagnostic: `gateway-native-leases` without the RBAC guard",
    "gateway-native-leases-no-admission": "diagnostic: `gateway-native-leases` without the ext_proc admission and the guard",
    "gateway-native-leases-log-16k": "diagnostic: `gateway-native-leases` with the metering gRPC access log's `buffer_size_bytes` at 16 KiB (as rendered before; 64 KiB now)",
    "gateway-native-leases-log-256k": "diagnostic: `gateway-native-leases` with the metering gRPC access log's `buffer_size_bytes` at 256 KiB",
    "gateway-native-leases-matcher-skip": "diagnostic: `gateway-native-leases` with the ext_proc admission wrapped in the lease matcher directly (no composite filter)",
}


# ------------------------------------------------------------------------------ formatting


def fmt(value: float | None, digits: int = 2) -> str:
    """A number for tables and progress lines; `n/a` for None."""
    return "n/a" if value is None else f"{value:.{digits}f}"


def signed(value: float | None, unit: str = "", digits: int = 2) -> str:
    """`+1.23 ms` style difference."""
    return "n/a" if value is None else f"{value:+.{digits}f}{unit}"


def ratio(value: float | None, digits: int = 2) -> str:
    """`0.87×` style ratio."""
    return "n/a" if value is None else f"{value:.{digits}f}×"


# ------------------------------------------------------------------------------ the page


def md_table(header: list[str], rows: list[list[str]], numeric: bool = True) -> str:
    """A Markdown table: first column left-aligned, the others right-aligned if `numeric`."""
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join([":---"] + [("---:" if numeric else ":---")] * (len(header) - 1)) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def med(stat: dict | None, digits: int = 2) -> str:
    """The median of a spread, formatted."""
    return fmt(stat["median"] if stat else None, digits)


def rng(stat: dict | None, digits: int = 2) -> str:
    """`median (min–max)` of a spread."""
    if not stat or stat["median"] is None:
        return "n/a"
    return f"{stat['median']:.{digits}f} ({stat['min']:.{digits}f}–{stat['max']:.{digits}f})"


def overhead_tables(over: dict | None, sat: dict | None) -> tuple[str, str]:
    """The per-target table and the differences-against-bare table."""
    if not over:
        return "(not run)", "(not run)"
    header = ["target", "TTFT p50", "TTFT p99", "ITL p99", "E2E p50", "E2E p99", "req/s at saturation",
              "Envoy CPU s / 1k req", "sidecar CPU s / 1k req", "Envoy peak RSS", "sidecar peak RSS"]
    rows = []
    for name, t in over["targets"].items():
        s = (sat or {}).get("targets", {}).get(name)
        cpu = t["cpu_s_per_1k"]
        rss = {role: max(filter(None, [t["peak_rss_mb"].get(role),
                                       (s or {}).get("peak_rss_mb", {}).get(role)]), default=None)
               for role in ("envoy", "sidecar")}
        rows.append([f"`{name}`", med(t["ttft_p50_ms"]), med(t["ttft_p99_ms"]), med(t["itl_p99_ms"]),
                     med(t["e2e_p50_ms"]), med(t["e2e_p99_ms"]), med(s["request_throughput"] if s else None, 0),
                     med(cpu.get("envoy"), 3) if "envoy" in cpu else "—",
                     med(cpu.get("sidecar"), 3) if "sidecar" in cpu else "—",
                     f"{fmt(rss['envoy'], 1)} MiB" if rss["envoy"] else "—",
                     f"{fmt(rss['sidecar'], 1)} MiB" if rss["sidecar"] else "—"])
    table = md_table(header, rows)
    if not over.get("vs_bare"):
        return table, "(bare Envoy was not among the targets)"
    header = ["target − bare", "ΔTTFT p50", "ΔTTFT p99", "ΔITL p99", "ΔE2E p50", "ΔE2E p99",
              "throughput at saturation ÷ bare", "Envoy CPU / 1k ÷ bare (saturation)"]
    rows = []
    bare_sat = (sat or {}).get("targets", {}).get("bare")
    for name, d in over["vs_bare"].items():
        s = (sat or {}).get("vs_bare", {}).get(name) if sat and sat.get("vs_bare") else None
        t_sat = (sat or {}).get("targets", {}).get(name)
        cpu_ratio = "—"
        if bare_sat and t_sat and "envoy" in t_sat["cpu_s_per_1k"] and bare_sat["cpu_s_per_1k"].get("envoy"):
            base = bare_sat["cpu_s_per_1k"]["envoy"]["median"]
            if base:
                cpu_ratio = ratio(t_sat["cpu_s_per_1k"]["envoy"]["median"] / base)
        rows.append([f"`{name}`"] + [signed_range(d[k]) for k in
                                     ("ttft_p50_ms", "ttft_p99_ms", "itl_p99_ms", "e2e_p50_ms", "e2e_p99_ms")]
                    + [ratio_range(s["throughput_ratio"]) if s else "n/a", cpu_ratio])
    return table, md_table(header, rows)


def signed_range(stat: dict) -> str:
    """`+0.31 (−0.10…+0.52)`: median and range of per-round differences, in ms."""
    if stat["median"] is None:
        return "n/a"
    return f"{stat['median']:+.2f} ({stat['min']:+.2f}…{stat['max']:+.2f})"


def ratio_range(stat: dict) -> str:
    """`0.71× (0.69–0.74)`."""
    if stat["median"] is None:
        return "n/a"
    return f"{stat['median']:.2f}× ({stat['min']:.2f}–{stat['max']:.2f})"


def saturation_table(sat: dict | None) -> str:
    """Per-target saturation figures."""
    if not sat:
        return "(not run)"
    header = ["target", "req/s (min–max)", "E2E p50", "E2E p99", "Envoy CPU s / 1k", "sidecar CPU s / 1k",
              "redis CPU s / 1k", "failed / sent"]
    rows = []
    for name, t in sat["targets"].items():
        cpu = t["cpu_s_per_1k"]
        rows.append([f"`{name}`", rng(t["request_throughput"], 0), med(t["e2e_p50_ms"]), med(t["e2e_p99_ms"]),
                     med(cpu.get("envoy"), 3) if "envoy" in cpu else "—",
                     med(cpu.get("sidecar"), 3) if "sidecar" in cpu else "—",
                     med(cpu.get("redis"), 3) if "redis" in cpu else "—", f"{t['failed']} / {t['sent']}"])
    return md_table(header, rows)


def sweep_table(sw: dict | None) -> str:
    """The sweep's points."""
    if not sw:
        return "(not run)"
    knee = (sw.get("knee") or {}).get("label")
    rows = [[f"`{p['label']}`" + (" (knee)" if p["label"] == knee else ""), fmt(p["request_throughput"], 1),
             fmt(p["ttft_p50_ms"]), fmt(p["ttft_p99_ms"]), fmt(p["itl_p99_ms"]), fmt(p["e2e_p99_ms"]),
             f"{p['failed']} / {p['sent']}"] for p in sw["points"]]
    return md_table(["point", "req/s", "TTFT p50", "TTFT p99", "ITL p99", "E2E p99", "failed / sent"], rows)


def sidecar_section(res: dict) -> str:
    """Limit decisions per second and memory with many streams open."""
    out = []
    lim = res.get("limits")
    if lim:
        cpu = lim["cpu_s_per_1k"]
        side = cpu.get("sidecar", {}).get("median")
        out.append(md_table(
            ["measure", "value"],
            [["refused requests/s (every request a 429 from the sidecar; median of runs, min–max)",
              rng(lim["refused_per_s"], 0)],
             ["share of requests answered 429", f"{100 * lim['refused_share']:.2f} %"],
             ["sidecar CPU s per 1,000 decisions", med(cpu.get("sidecar"), 3)],
             ["redis CPU s per 1,000 decisions", med(cpu.get("redis"), 3)],
             ["Envoy CPU s per 1,000 decisions", med(cpu.get("envoy"), 3)],
             ["decisions per sidecar CPU-second (1,000 ÷ the CPU above)",
              fmt(1000.0 / side, 0) if side else "n/a"]]))
    else:
        out.append("Limit decisions: (not run)")
    st = res.get("streams")
    if st:
        p = st["point"]
        out.append("")
        out.append(md_table(
            ["with streams open", "sidecar", "Envoy", "redis"],
            [["RSS idle, before the load", *[mem(st["idle_rss_mb"].get(r)) for r in ("sidecar", "envoy", "redis")]],
             [f"RSS at the most streams open ({st['open_streams_max']:.0f})",
              *[mem(st["rss_at_most_open_mb"].get(r)) for r in ("sidecar", "envoy", "redis")]],
             ["peak RSS (the larger of VmHWM and the sampled VmRSS)",
              *[mem(st["peak_rss_mb"].get(r)) for r in ("sidecar", "envoy", "redis")]]]))
        out.append("")
        out.append(f"{p['completed']:,} of {p['sent']:,} streams completed, {p['failed']} failed "
                   f"(TTFT p99 {fmt(p['ttft_p99_ms'])} ms, E2E p50 {fmt(p['e2e_p50_ms'], 0)} ms).")
    else:
        out.append("\nStreams: (not run)")
    return "\n".join(out)


def mem(mb: float | None) -> str:
    """MiB, one decimal."""
    return "n/a" if mb is None else f"{mb:.1f} MiB"


def overload_section(ov: dict | None) -> str:
    """Points of the overload scenario per variant, and the pending variants."""
    if not ov:
        return "(not run)"
    rows = []
    for name, points in ov["points"].items():
        for p in points:
            e = p["errors"]
            rows.append([f"`{name}`", f"{p['factor']:g}× ({p['offered_rate']:.1f}/s)", str(p["sent"]),
                         str(p["completed"]), str(e["rate_limited_quota"] + e["rate_limited_overload"]),
                         str(e["timeout"]), str(p["failed"] - e["rate_limited_quota"] - e["rate_limited_overload"]
                                                - e["timeout"]),
                         fmt(p["ttft_p50_ms"], 1), fmt(p["ttft_p99_ms"], 1), fmt(p["request_throughput"], 1),
                         "—" if p.get("leased") is None else str(p["leased"])])
    out = [md_table(["variant", "offered load", "sent", "served", "429", "timeouts", "other failures",
                     "TTFT p50 (served)", "TTFT p99 (served)", "served req/s",
                     "admitted from a lease (sent − ext_proc streams)"], rows)]
    for name, why in ov["pending"].items():
        out.append(f"\n**`{name}`: pending.** {why}")
    return "\n".join(out)


def targets_table(checks: list[dict]) -> str:
    """The issue's targets with pass / miss."""
    badge = {"pass": "**pass**", "miss": "**miss**", "pending": "pending", "reported": "reported",
             "not run": "not run"}
    rows = [[c["target"], c["measured"], c["threshold"], badge[c["status"]] + (f" ({c['note']})" if c["note"] else "")]
            for c in checks]
    return md_table(["target", "measured", "threshold", "result"], rows, numeric=False)


def display_command(argv: list[str]) -> str:
    """A recorded gateway-bench command, with ephemeral URLs, keys and paths made generic."""
    out = []
    skip_next = None
    for i, a in enumerate(argv):
        if skip_next is not None:
            out.append(skip_next)
            skip_next = None
            continue
        if i == 0:
            out.append("target/release/gateway-bench")
        elif a == "--base-url":
            out.append(a)
            skip_next = "$TARGET_URL"
        elif a == "--api-key":
            out.append(a)
            skip_next = "$API_KEY"
        elif a in ("--output-json", "--plot"):
            out.append(a)
            skip_next = Path(argv[i + 1]).name
        else:
            out.append(a)
    return shlex.join(out).replace("'$TARGET_URL'", "$TARGET_URL").replace("'$API_KEY'", "$API_KEY")


def commands_section(summary: dict) -> str:
    """The exact gateway-bench command of each scenario (one target's; the others differ by URL)."""
    res = summary["results"]
    lines = []

    def add(title: str, argv: list[str] | None, sim: dict | None) -> None:
        if not argv:
            return
        lines.append(f"# {title}")
        if sim:
            lines.append(f"target/release/vllm-sim --port 0 --served-model-name {summary['model']} "
                         f"--ttft-ms {sim['ttft_ms']:g} --itl-ms {sim['itl_ms']:g} "
                         f"--max-num-seqs {sim['max_num_seqs']}")
        lines.append(display_command(argv))
        lines.append("")

    for key, title in (("overhead", "overhead (every target, each round)"),
                       ("saturation", "saturation (every target, each round)")):
        if key in res:
            first = next(iter(res[key]["targets"].values()))
            add(title, first["command"], res[key]["sim"])
    if "sweep" in res:
        add("sweep (full gateway)", res["sweep"]["command"], res["sweep"]["sim"])
    if "limits" in res:
        add("limit decisions (tenant limited to 1 request/minute)", res["limits"]["command"], None)
    if "streams" in res:
        add("streams (full gateway)", res["streams"]["command"], res["streams"]["sim"])
    if "overload" in res:
        for name, argv in res["overload"]["commands"].items():
            add(f"overload, {name} (highest offered load)", argv, res["overload"]["sim"])
    if "tool" in res:
        add("the load generator alone (against the simulator directly)", res["tool"]["command"], None)
    return "```sh\n" + "\n".join(lines).rstrip() + "\n```"


def bar_chart_svg(title: str, unit: str, categories: list[str], series: dict[str, list[float | None]],
                  refs: list[tuple[float, str]] | None = None, signed_values: bool = False) -> str:
    """A small grouped horizontal bar chart as standalone SVG (no dependencies).

    `series` maps a legend name to one value per category; `refs` are dashed reference lines.
    """
    colors = ["#4878d0", "#ee854a", "#6acc64", "#d65f5f", "#956cb4"]
    width, label_w, bar_h, gap = 760, 150, 14, 10
    names = list(series)
    group_h = bar_h * len(names) + gap
    top, legend_h = 40 + 14 * max(len(refs or []) - 1, 0), 24
    height = top + group_h * len(categories) + legend_h + 30
    values = [v for vs in series.values() for v in vs if v is not None] + [r for r, _ in refs or []]
    lo, hi = min(values + [0.0]), max(values + [0.0])
    if hi - lo < 1e-9:
        hi = lo + 1.0
    pad = (hi - lo) * 0.15
    lo, hi = (lo - pad if lo < 0 else 0.0), hi + pad
    plot_w = width - label_w - 20

    def x(v: float) -> float:
        return label_w + (v - lo) / (hi - lo) * plot_w

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="sans-serif" font-size="11">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{width / 2}" y="20" text-anchor="middle" font-size="14">{esc(title)}</text>']
    y0 = top
    for i, cat in enumerate(categories):
        gy = y0 + i * group_h
        out.append(f'<text x="{label_w - 8}" y="{gy + group_h / 2}" text-anchor="end">{esc(cat)}</text>')
        for j, name in enumerate(names):
            v = series[name][i]
            if v is None:
                continue
            by = gy + j * bar_h
            x1, x2 = sorted((x(0.0), x(v)))
            out.append(f'<rect x="{x1:.1f}" y="{by}" width="{max(x2 - x1, 0.5):.1f}" height="{bar_h - 2}" '
                       f'fill="{colors[j % len(colors)]}"/>')
            anchor, tx = ("start", x2 + 3) if v >= 0 else ("end", x1 - 3)
            text = f"{v:+.2f}" if signed_values else f"{v:.2f}"
            out.append(f'<text x="{tx:.1f}" y="{by + bar_h - 4}" text-anchor="{anchor}">{text}{esc(unit)}</text>')
    y_end = y0 + group_h * len(categories)
    out.append(f'<line x1="{x(0):.1f}" y1="{top - 5}" x2="{x(0):.1f}" y2="{y_end}" stroke="black"/>')
    for k, (value, label) in enumerate(refs or []):
        label_y = top - 8 - 14 * k  # one line per reference, so that close ones do not overlap
        out.append(f'<line x1="{x(value):.1f}" y1="{label_y + 3}" x2="{x(value):.1f}" y2="{y_end}" stroke="#c00" '
                   f'stroke-dasharray="4,3"/>')
        out.append(f'<text x="{x(value) + 3:.1f}" y="{label_y}" fill="#c00">{esc(label)}</text>')
    lx = label_w
    for j, name in enumerate(names):
        out.append(f'<rect x="{lx}" y="{y_end + 14}" width="12" height="12" fill="{colors[j % len(colors)]}"/>')
        out.append(f'<text x="{lx + 16}" y="{y_end + 24}">{esc(name)}</text>')
        lx += 30 + 7 * len(name)
    out.append("</svg>")
    return "\n".join(out) + "\n"


def esc(text: str) -> str:
    """XML-escapes text for SVG."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def write_charts(summary: dict, results: Path) -> list[str]:
    """Writes the charts into results/charts/; returns their file names."""
    charts = results / "charts"
    charts.mkdir(parents=True, exist_ok=True)
    names = []
    res = summary["results"]
    over = res.get("overhead")
    if over and over.get("vs_bare"):
        cats = ["TTFT p50", "TTFT p99", "ITL p99", "E2E p50", "E2E p99"]
        keys = ["ttft_p50_ms", "ttft_p99_ms", "itl_p99_ms", "e2e_p50_ms", "e2e_p99_ms"]
        series = {n: [d[k]["median"] for k in keys] for n, d in over["vs_bare"].items()}
        load = over["load"]
        (charts / "overhead-latency.svg").write_text(bar_chart_svg(
            f"Added latency vs bare Envoy (median of paired rounds, c={load['concurrency']})", " ms", cats, series,
            [(1.0, "TTFT p50 target +1 ms")] if "gateway" in series else None, signed_values=True))
        names.append("overhead-latency.svg")
    sat = res.get("saturation")
    if sat and sat.get("vs_bare"):
        series = {"throughput ÷ bare": [d["throughput_ratio"]["median"] for d in sat["vs_bare"].values()]}
        (charts / "overhead-throughput.svg").write_text(bar_chart_svg(
            f"Throughput at saturation relative to bare Envoy (c={sat['load']['concurrency']})", "×",
            list(sat["vs_bare"]), series, [(0.6, "gateway ≥ 0.6×"), (0.85, "filter ≥ 0.85×")]))
        names.append("overhead-throughput.svg")
    sw = res.get("sweep")
    if sw and Path(sw["chart"]).exists():
        shutil.copyfile(sw["chart"], charts / "gateway-sweep.svg")
        names.append("gateway-sweep.svg")
    return names


# The endpoint-picking section comes from bench/picker.py (`make bench` runs it after this page is
# written); a page rewritten by bench/overhead.py keeps the section the last picker run wrote.
PICKER_BEGIN, PICKER_END = "<!-- picker-benchmark:begin -->", "<!-- picker-benchmark:end -->"
PICKER_PLACEHOLDER = (f"{PICKER_BEGIN}\n## Endpoint picking (issue 12)\n\nNot run yet: "
                      f"`.venv/bin/python bench/picker.py` writes this section.\n{PICKER_END}")


# Likewise the flow-control section, from bench/flow_control.py.
FLOW_BEGIN, FLOW_END = "<!-- flow-control-benchmark:begin -->", "<!-- flow-control-benchmark:end -->"
FLOW_PLACEHOLDER = (f"{FLOW_BEGIN}\n## Flow control (issue 13)\n\nNot run yet: "
                    f"`.venv/bin/python bench/flow_control.py` writes this section.\n{FLOW_END}")


# Likewise the real-engine section, from bench/real_engine.py (`make bench-real`).
REAL_ENGINE_BEGIN, REAL_ENGINE_END = "<!-- real-engine-benchmark:begin -->", "<!-- real-engine-benchmark:end -->"
REAL_ENGINE_PLACEHOLDER = (f"{REAL_ENGINE_BEGIN}\n## On a real engine\n\nNot run yet: `make bench-real` "
                           f"(bench/real_engine.py) writes this section.\n{REAL_ENGINE_END}")


def kept_section(page: str, begin: str = PICKER_BEGIN, end: str = PICKER_END) -> str | None:
    """The section between `begin` and `end` of an existing docs/benchmarks.md, markers included
    (None if absent)."""
    if begin in page and end in page:
        return page[page.index(begin): page.index(end) + len(end)]
    return None


def picker_section(page: str) -> str | None:
    """The picker section of an existing docs/benchmarks.md, markers included (None if absent)."""
    return kept_section(page)


def replace_section(page: str, text: str, begin: str, end: str) -> str:
    """`page` with its section between `begin` and `end` replaced by `text` (appended if absent)."""
    if begin in page and end in page:
        return page[: page.index(begin)] + text + page[page.index(end) + len(end):]
    return page.rstrip() + "\n\n" + text + "\n"


def render_page(summary: dict, charts: list[str]) -> str:
    """docs/benchmarks.md from bench/benchmarks.md.tmpl and the run's summary."""
    res = summary["results"]
    m = summary["machine"]
    n = summary["noise"]
    over_table, delta_table = overhead_tables(res.get("overhead"), res.get("saturation"))
    plan = summary["plan"]
    tool_res = res.get("tool")

    def chart(name: str, alt: str) -> str:
        return f"![{alt}](benchmarks/{name})" if name in charts else f"({alt}: not run)"

    ov = res.get("overload")
    service_s = ov["sim"]["ttft_ms"] / 1000 + (ov["output_len"] - 1) * ov["sim"]["itl_ms"] / 1000 if ov else 0.0
    values = {
        "picker_section": summary.get("picker_section") or PICKER_PLACEHOLDER,
        "flow_section": summary.get("flow_section") or FLOW_PLACEHOLDER,
        "real_engine_section": summary.get("real_engine_section") or REAL_ENGINE_PLACEHOLDER,
        "generated": summary["finished_at"],
        "command": summary["command"],
        "nproc": str(m["nproc"]),
        "noise": (f"During this run other processes used {n['foreign_cpu_s']:.0f} CPU-seconds, "
                  f"{100 * n['foreign_share_of_machine']:.0f} % of the machine's {m['nproc']} cores over the "
                  f"{n['wall_s'] / 60:.1f} minutes of the run (load average {n['loadavg_start'][0]:.2f} at the start, "
                  f"{n['loadavg_end'][0]:.2f} at the end)."),
        "note": note(summary),
        "targets_table": targets_table(summary["checks"]),
        "rounds": str(plan["rounds"]),
        "target_list": "\n".join(f"- `{t}`: {TARGET_TEXT[t]};" for t in summary["targets"]).rstrip(";") + ".",
        "overhead_load": load_text(res.get("overhead")),
        "saturation_load": load_text(res.get("saturation")),
        "overhead_table": over_table,
        "delta_table": delta_table,
        "latency_chart": chart("overhead-latency.svg", "added latency against bare Envoy"),
        "throughput_chart": chart("overhead-throughput.svg", "throughput relative to bare Envoy"),
        "saturation_table": saturation_table(res.get("saturation")),
        "sweep_text": (f"Concurrency {plan['sweep']}, up to {plan['sweep_load']['num_prompts']} requests or "
                       f"{plan['sweep_duration_s']:g} s of sending per point, same paced upstream and request "
                       "as the overhead table"),
        "sweep_chart": chart("gateway-sweep.svg", "full gateway: throughput against TTFT p99"),
        "sweep_table": sweep_table(res.get("sweep")),
        "sidecar_section": sidecar_section(res),
        "overload_text": (
            f"vllm-sim with `--max-num-seqs {ov['sim']['max_num_seqs']}`, TTFT {ov['sim']['ttft_ms']:g} ms, "
            f"ITL {ov['sim']['itl_ms']:g} ms, {ov['output_len']} tokens per request: capacity "
            f"{ov['sim']['max_num_seqs']} ÷ {service_s:.3f} s"
            f" = {ov['capacity_rps']:.1f} req/s. Poisson arrivals at multiples of that for {ov['duration_s']:g} s per "
            f"point, at most 2,048 in flight, {ov['timeout_s']:g} s client timeout; the lowest load is the "
            "unloaded reference" if ov else "(not run)"),
        "overload_section": overload_section(ov),
        "tool_text": (
            f"{tool_res['point']['request_throughput']:,.0f} streamed requests/s "
            f"({tool_res['point']['failed']} failed) "
            f"with the generator at {100 * tool_res['bench_cpu_share']:.0f} % of one core (CPU time ÷ wall time, "
            f"warm-up included), `--threads 1`, concurrency {tool_res['load']['concurrency']}, "
            f"{tool_res['load']['output_len']} output tokens, against vllm-sim directly."
            if tool_res else "(not run)"),
        "cpu_model": m["cpu_model"],
        "mem": f"{m['mem_gib']:.1f} GiB" if m["mem_gib"] else "?",
        "kernel": m["kernel"],
        "envoy": m["envoy"],
        "rustc": m["rustc"],
        "redis": m["redis"],
        "python": m["python"],
        "tools": f"{m['gateway_bench']}, {m['vllm_sim']}, {m['gateway_ext_proc']}",
        "commit": m["commit"],
        "binaries": "; ".join(f"`{k}` {v}" for k, v in summary["binaries_built"].items()),
        "envoy_concurrency": str(summary["envoy_concurrency"]),
        "commands": commands_section(summary),
        "wall": f"{n['wall_s'] / 60:.1f}",
    }
    return string.Template(TEMPLATE.read_text()).substitute(values)


def note(summary: dict) -> str:
    """The run's note (`--note`), as a quote."""
    out = ""
    if summary.get("note"):
        out += f"\n> **Note on this run:** {summary['note']}\n"
    return out


def load_text(scenario: dict | None) -> str:
    """One line describing a scenario's workload."""
    if not scenario:
        return "(not run)"
    load, sim = scenario["load"], scenario["sim"]
    count = (f"sending for {load['duration_s']:g} s" if load.get("duration_s")
             else f"{load['num_prompts']} measured requests")
    return (f"concurrency {load['concurrency']}, {count} after "
            f"{load['warmup']} warm-up requests per round, prompts of {load['input_len']} words, "
            f"{load['output_len']} streamed tokens; vllm-sim TTFT {sim['ttft_ms']:g} ms, ITL {sim['itl_ms']:g} ms")
