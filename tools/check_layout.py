#!/usr/bin/env python3
"""The sidecar's layout rules, checked over its source (docs/architecture.md, "Layout").

Usage: python3 tools/check_layout.py [--report]

Rules, each a failure when broken:
  * no file in ext-proc/src over 800 lines; grpc/ext_proc.rs (the ext_proc adapter) under 500;
  * no function over 120 lines outside tests (`#[cfg(test)]` modules, tests.rs files);
  * no import circle between ext-proc's modules (one module per file; `crate::a::b::C` is an
    import of the file that holds module `a::b`, or of `a` when `b` is not a module);
  * the modules sit in LAYERS below, lowest first, and at most two imports run back up, from a
    file of a lower layer to a module of a higher one (ALLOWED_UP names them).
The filter's rules: filter/src/wasm.rs and filter-native/src/lib.rs each under 400 lines.

Imports are read from the text: every `crate::path` outside comments and tests, `use` lines
and inline paths alike, and `super::`/`self::` paths resolved against the file's module.
With --report the graph's edges and the longest functions are printed too.
"""

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "ext-proc" / "src"

MAX_FILE_LINES = 800
MAX_ADAPTER_LINES = 500
ADAPTER = "grpc/ext_proc.rs"
MAX_FN_LINES = 120
FILTER_BINDINGS = [ROOT / "filter" / "src" / "wasm.rs", ROOT / "filter-native" / "src" / "lib.rs"]
MAX_BINDING_LINES = 400

# Lowest first. A module may import from its own layer and the layers below it. The longest
# matching prefix names a module's layer.
LAYERS = [
    # Shapes every stage reads: config, the contract, metrics, the request's facts, errors.
    ["config", "proto", "metrics", "telemetry", "facts"],
    # Pure decisions, no I/O.
    [
        "error",
        "admission::decision",
        "admission::limits",
        "admission::local_limiter",
        "admission::lease",
        "admission::admission_lease",
        "admission::quota",
        "admission::shedding",
        "admission::lease_headroom",
        "admission::breaker",
        "admission::context",
        "flow_control::queue",
        "flow_control::fairness",
        "flow_control::drain",
        "flow_control",
        "scheduling::prefix_index",
        "scheduling::prompt",
        "scheduling::picker",
        "scheduling",
        "pools::signals",
        "pools::room",
        "metering::meter",
        "metering::access_log",
        "metering::ledger",
        "metering::journal",
        "metering::landed",
    ],
    # The Redis adapter.
    ["redis", "store"],
    # Stateful stages over Redis and the pools.
    [
        "admission::limiter",
        "pools",
        "metering::recorder",
        "metering::usage_report",
    ],
    # What one process holds.
    ["state"],
    # The stage order, the steps it runs, and the background tasks over the shared state.
    ["admission", "metering", "metering::journal::tail", "metering::sweeper"],
    # The gRPC adapter: tonic services.
    ["grpc"],
    # The process.
    ["lib", "main", "reload"],
]

# Imports that run back up, each with its reason. At most two.
ALLOWED_UP = {}


def module_of(path: Path) -> str:
    rel = path.relative_to(SRC).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "mod":
        parts.pop()
    if parts == ["lib"] or parts == ["main"]:
        return parts[0]
    return "::".join(parts)


def layer_of(module: str) -> int:
    best = None
    for i, layer in enumerate(LAYERS):
        for prefix in layer:
            if module == prefix or module.startswith(prefix + "::"):
                if best is None or len(prefix) > len(best[1]):
                    best = (i, prefix)
    if best is not None:
        return best[0]
    raise SystemExit(f"tools/check_layout.py: module {module} is in no layer of LAYERS")


def strip_code(text: str) -> str:
    """The text with comments, string and char literals blanked (line breaks kept)."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == "r" and re.match(r'r(#*)"', text[i:]) and not (i and (text[i - 1].isalnum() or text[i - 1] == "_")):
            m = re.match(r'r(#*)"', text[i:])
            close = '"' + m.group(1)
            j = text.find(close, i + len(m.group(0)))
            j = n if j < 0 else j + len(close)
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            j += 1
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == "'":
            m = re.match(r"'(\\.[^']*|[^'\\])'", text[i:])
            if m:
                out.append(" " * len(m.group(0)))
                i += len(m.group(0))
            else:
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def test_spans(code: str):
    """Line ranges (1-based, inclusive) of `#[cfg(test)]` items."""
    spans = []
    for m in re.finditer(r"#\[cfg\(test\)\]", code):
        start = code.count("\n", 0, m.start()) + 1
        brace = code.find("{", m.end())
        semi = code.find(";", m.end())
        if semi != -1 and (brace == -1 or semi < brace):
            spans.append((start, code.count("\n", 0, semi) + 1))
            continue
        end = match_brace(code, brace)
        spans.append((start, code.count("\n", 0, end) + 1))
    return spans


def match_brace(code: str, open_at: int) -> int:
    depth = 0
    for j in range(open_at, len(code)):
        if code[j] == "{":
            depth += 1
        elif code[j] == "}":
            depth -= 1
            if depth == 0:
                return j
    return len(code) - 1


def in_spans(line: int, spans) -> bool:
    return any(a <= line <= b for a, b in spans)


def functions(code: str, spans):
    """(name, first line, lines) of each fn with a body, outside test spans."""
    for m in re.finditer(r"\bfn\s+([A-Za-z_][A-Za-z0-9_]*)", code):
        line = code.count("\n", 0, m.start()) + 1
        if in_spans(line, spans):
            continue
        # The body's `{`: the first one at bracket depth 0 after the signature, unless a `;` ends
        # a declaration first.
        depth = 0
        j = m.end()
        while j < len(code):
            c = code[j]
            if c in "(<[":
                depth += 1
            elif c in ")>]":
                depth -= 1
            elif c == ";" and depth <= 0:
                j = -1
                break
            elif c == "{" and depth <= 0:
                break
            j += 1
        if j < 0 or j >= len(code):
            continue
        end = match_brace(code, j)
        yield m.group(1), line, code.count("\n", m.start(), end) + 1


def resolve(path: str, modules: set) -> str:
    """The longest module prefix of `a::b::c`."""
    parts = path.split("::")
    for k in range(len(parts), 0, -1):
        cand = "::".join(parts[:k])
        if cand in modules:
            return cand
    return parts[0]


def imports(module: str, code: str, spans, modules: set):
    found = {}
    for m in re.finditer(r"\b(crate|super|self)((?:::[A-Za-z_][A-Za-z0-9_]*)+)", code):
        line = code.count("\n", 0, m.start()) + 1
        if in_spans(line, spans):
            continue
        head, rest = m.group(1), m.group(2)[2:]
        if head == "crate":
            full = rest
        else:
            base = module.split("::") if module not in ("lib", "main") else []
            segs = rest.split("::")
            if head == "super":
                up = 1
                while segs and segs[0] == "super":
                    up += 1
                    segs = segs[1:]
                base = base[: max(len(base) - up, 0)]
            full = "::".join(base + segs)
        # `use crate::a::{b, c::D}`: the group's members.
        after = code[m.end() : m.end() + 2]
        targets = [full]
        if after == "::" and code[m.end() + 2 : m.end() + 3] == "{":
            close = match_brace(code, m.end() + 2)
            group = code[m.end() + 3 : close]
            targets = []
            for member in split_group(group):
                member = member.strip()
                if member and member != "self":
                    targets.append(full + "::" + re.split(r"\s+as\s+", member)[0].split("::{")[0])
                elif member == "self":
                    targets.append(full)
        for t in targets:
            target = resolve(t, modules)
            if target != module:
                found.setdefault(target, line)
    return found


def split_group(group: str):
    depth, cur = 0, ""
    for c in group:
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
        if c == "," and depth == 0:
            yield cur
            cur = ""
        else:
            cur += c
    yield cur


def main() -> int:
    report = "--report" in sys.argv
    failures = []
    files = sorted(SRC.rglob("*.rs"))
    modules = {}
    for f in files:
        mod = module_of(f)
        modules[mod] = f
    # `pub mod proto { include!(...) }` in lib.rs is a module without a file.
    modules.setdefault("proto", SRC / "lib.rs")
    names = set(modules)

    graph = {}
    longest = []
    for mod, f in modules.items():
        if f == SRC / "lib.rs" and mod != "lib":
            continue
        text = f.read_text()
        lines = text.count("\n")
        rel = f.relative_to(SRC).as_posix()
        is_tests = f.name == "tests.rs"
        if lines > MAX_FILE_LINES:
            failures.append(f"ext-proc/src/{rel}: {lines} lines (at most {MAX_FILE_LINES})")
        if rel == ADAPTER and lines >= MAX_ADAPTER_LINES:
            failures.append(f"ext-proc/src/{rel}: {lines} lines (under {MAX_ADAPTER_LINES})")
        if is_tests:
            continue
        code = strip_code(text)
        spans = test_spans(code)
        for name, line, n in functions(code, spans):
            longest.append((n, f"ext-proc/src/{rel}:{line} {name}"))
            if n > MAX_FN_LINES:
                failures.append(f"ext-proc/src/{rel}:{line}: fn {name} is {n} lines (at most {MAX_FN_LINES})")
        graph[mod] = imports(mod, code, spans, names)

    # Circles: strongly connected components of more than one module.
    for comp in sccs(graph):
        if len(comp) > 1:
            failures.append("import circle: " + " -> ".join(sorted(comp)))

    ups = []
    for mod, targets in graph.items():
        for target, line in targets.items():
            if target in ("lib", "main") or target not in names:
                continue
            if is_ancestor(target, mod):
                continue  # a child reading its parent's shared items is not an upward import
            if layer_of(target) > layer_of(mod):
                ups.append((mod, target, line))
    for mod, target, line in ups:
        if (mod, target) not in ALLOWED_UP:
            failures.append(
                f"ext-proc/src/{modules[mod].relative_to(SRC).as_posix()}:{line}: {mod} (layer "
                f"{layer_of(mod)}) imports {target} (layer {layer_of(target)})"
            )
    if len(ALLOWED_UP) > 2:
        failures.append(f"ALLOWED_UP names {len(ALLOWED_UP)} upward imports (at most 2)")

    for f in FILTER_BINDINGS:
        n = f.read_text().count("\n")
        if n >= MAX_BINDING_LINES:
            failures.append(f"{f.relative_to(ROOT)}: {n} lines (under {MAX_BINDING_LINES})")

    if report:
        for mod in sorted(graph):
            print(f"{mod} [{layer_of(mod)}] -> {', '.join(sorted(graph[mod]))}")
        print("longest functions:")
        for n, where in sorted(longest, reverse=True)[:10]:
            print(f"  {n:4} {where}")
        print(f"upward imports: {len(ups)}")
    for line in failures:
        print(line)
    if failures:
        print(f"{len(failures)} layout rule(s) broken (tools/check_layout.py)")
        return 1
    print(f"layout ok: {len(modules)} modules, {sum(len(t) for t in graph.values())} imports, {len(ups)} upward")
    return 0


def is_ancestor(a: str, b: str) -> bool:
    return b.startswith(a + "::")


def sccs(graph):
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]
    sys.setrecursionlimit(10000)

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, {}):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(comp)

    for v in graph:
        if v not in index:
            visit(v)
    return out


if __name__ == "__main__":
    sys.exit(main())
