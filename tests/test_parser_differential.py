"""Differential test of the gateway's body parsing against the upstream's (issue 16, item 5).

The filter reads a body with serde_json (and, for a body over `full_parse_max_bytes`, its own
top-level scanner); vLLM reads it with Python's `json` and pydantic in lax mode, which coerces
`"100"`, `100.0`, `1e2` and `"true"`, keeps the last of duplicate keys, and takes `NaN`. A body they
read differently could reach a model its tenant may not use, or generate tokens the gateway did
not reserve. Here a corpus of tricky bodies goes through the real Envoy, filter and sidecar to
upstreams that parse as vLLM does (tests/vllm_schema_upstream.py), each body twice: as is (full
parse) and padded past `full_parse_max_bytes` (the large-body path). For every body either the
gateway refused it (an OpenAI-shaped 4xx that reached no upstream), or the upstream refused it
(pydantic or vLLM V1's own 400: nothing generated), or what the gateway decided is what the
upstream read:

* the pool that received it is the pool the filter chose (`x-gateway-pool`), one the tenant may
  use, and the model pydantic read is that pool's served name;
* the tokens the filter reserved (`x-gateway-max-tokens`) are pydantic's `max_tokens` (chat:
  `max_completion_tokens or max_tokens`) times the sequences (`n`, completions `max(n, best_of)`)
  times the prompts of a batch, when the client set a limit (at least vLLM's default otherwise);
* a stream pydantic reads as a stream carries `include_usage: true` (the gateway meters it), and
  the filter's `x-gateway-usage-injected` is set exactly when the client had not asked for usage;
  a non-stream is never injected;
* the prompt (`messages`, `prompt`) pydantic read is the one the client sent (`json.loads`).

The filter's decision is observed in the `x-gateway-*` request headers the upstream received:
the same values as the filter state the sidecar admits by (`ForwardPlan::facts`).
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest

from helpers import wait_for
from stack import Model, Pool, Stack, Tenant, free_port, new_api_key

UPSTREAM = Path(__file__).parent / "vllm_schema_upstream.py"
KEY = new_api_key()
FULL_PARSE_MAX_BYTES = 1024
# The served name pydantic must read in each pool's body.
SERVED = {"pool_a": {"Qwen/Qwen2.5-0.5B-Instruct", "sql-lora"}, "pool_b": {"llama"}, "pool_p": {"private"}}
ALLOWED_POOLS = {"pool_a", "pool_b"}  # the tenant may not use "private" (pool_p)

MSG = '[{"role":"user","content":"hi"}]'
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"

# (name, path, raw body). Tricky for one reader or the other; each is also sent padded.
CORPUS: list[tuple[str, str, str]] = [
    ("plain", CHAT, f'{{"model":"qwen","messages":{MSG},"max_tokens":5}}'),
    ("alias", CHAT, f'{{"model":"qwen-latest","messages":{MSG},"max_tokens":5}}'),
    ("lora", CHAT, f'{{"model":"sql-lora","messages":{MSG},"max_tokens":5}}'),
    ("escaped model", CHAT, f'{{"model":"qw\\u0065n","messages":{MSG},"max_tokens":5}}'),
    ("escaped llama", CHAT, f'{{"model":"\\u006clama","messages":{MSG},"max_completion_tokens":6}}'),
    ("private model", CHAT, f'{{"model":"private","messages":{MSG}}}'),
    ("dup model", CHAT, f'{{"model":"qwen","messages":{MSG},"model":"private"}}'),
    ("dup model escaped key", CHAT, f'{{"mod\\u0065l":"private","messages":{MSG},"model":"qwen"}}'),
    ("dup model escaped key 2", CHAT, f'{{"model":"qwen","messages":{MSG},"\\u006dodel":"private"}}'),
    ("dup max_tokens", CHAT, f'{{"model":"qwen","messages":{MSG},"max_tokens":5,"max_tokens":5000}}'),
    ("dup stream", CHAT, f'{{"model":"qwen","messages":{MSG},"stream":false,"stream":true}}'),
    ("dup messages", CHAT, f'{{"model":"qwen","messages":{MSG},"messages":[{{"role":"user","content":"{"x" * 50}"}}]}}'),
    ("model null", CHAT, f'{{"model":null,"messages":{MSG}}}'),
    ("model absent", CHAT, f'{{"messages":{MSG}}}'),
    ("model int", CHAT, f'{{"model":7,"messages":{MSG}}}'),
    ("model list", CHAT, f'{{"model":["qwen"],"messages":{MSG}}}'),
    ("max_tokens 100.0", CHAT, f'{{"model":"qwen","messages":{MSG},"max_tokens":100.0}}'),
    ("max_tokens 1e2", CHAT, f'{{"model":"qwen","messages":{MSG},"max_tokens":1e2}}'),
    ("max_tokens 1E+2", CHAT, f'{{"model":"qwen","messages":{MSG},"max_tokens":1E+2}}'),
    ("max_tokens string", CHAT, f'{{"model":"qwen","messages":{MSG},"max_tokens":"100"}}'),
    ("max_tokens string spaced", CHAT, f'{{"model":"qwen","messages":{MSG},"max_tokens":" 100 "}}'),
    ("max_tokens true", CHAT, f'{{"model":"qwen","messages":{MSG},"max_tokens":true}}'),
    ("max_tokens -0", CHAT, f'{{"model":"qwen","messages":{MSG},"max_tokens":-0}}'),
    ("max_tokens 0", CHAT, f'{{"model":"qwen","messages":{MSG},"max_tokens":0}}'),
    ("max_tokens 2^64", CHAT, f'{{"model":"qwen","messages":{MSG},"max_tokens":18446744073709551616}}'),
    ("max_tokens huge", CHAT, f'{{"model":"qwen","messages":{MSG},"max_tokens":1e400}}'),
    ("max_tokens null", CHAT, f'{{"model":"qwen","messages":{MSG},"max_tokens":null}}'),
    ("mct over mt", CHAT, f'{{"model":"qwen","messages":{MSG},"max_tokens":50,"max_completion_tokens":5}}'),
    ("mct null", CHAT, f'{{"model":"qwen","messages":{MSG},"max_completion_tokens":null,"max_tokens":7}}'),
    ("mct 1.0", CHAT, f'{{"model":"qwen","messages":{MSG},"max_completion_tokens":1.0,"max_tokens":7}}'),
    ("n 3", CHAT, f'{{"model":"qwen","messages":{MSG},"max_tokens":4,"n":3}}'),
    ("n null", CHAT, f'{{"model":"qwen","messages":{MSG},"max_tokens":4,"n":null}}'),
    ("n 2.0", CHAT, f'{{"model":"qwen","messages":{MSG},"max_tokens":4,"n":2.0}}'),
    ("n string", CHAT, f'{{"model":"qwen","messages":{MSG},"max_tokens":4,"n":"3"}}'),
    ("chat best_of", CHAT, f'{{"model":"qwen","messages":{MSG},"max_tokens":4,"best_of":3}}'),
    ("chat best_of 1", CHAT, f'{{"model":"qwen","messages":{MSG},"max_tokens":4,"n":2,"best_of":1}}'),
    ("stream", CHAT, f'{{"model":"qwen","messages":{MSG},"max_tokens":4,"stream":true}}'),
    ("stream string", CHAT, f'{{"model":"qwen","messages":{MSG},"stream":"true"}}'),
    ("stream 1", CHAT, f'{{"model":"qwen","messages":{MSG},"stream":1}}'),
    ("stream null", CHAT, f'{{"model":"qwen","messages":{MSG},"stream":null,"max_tokens":3}}'),
    ("stream usage", CHAT, f'{{"model":"qwen","messages":{MSG},"stream":true,"stream_options":{{"include_usage":true}}}}'),
    ("stream usage false", CHAT, f'{{"model":"qwen","messages":{MSG},"stream":true,"stream_options":{{"include_usage":false}}}}'),
    ("stream options empty", CHAT, f'{{"model":"qwen","messages":{MSG},"stream":true,"stream_options":{{}}}}'),
    ("stream options null", CHAT, f'{{"model":"qwen","messages":{MSG},"stream":true,"stream_options":null}}'),
    ("include_usage null", CHAT, f'{{"model":"qwen","messages":{MSG},"stream":true,"stream_options":{{"include_usage":null}}}}'),
    ("include_usage string", CHAT, f'{{"model":"qwen","messages":{MSG},"stream":true,"stream_options":{{"include_usage":"false"}}}}'),
    ("include_usage dup t,f", CHAT, f'{{"model":"qwen","messages":{MSG},"stream":true,"stream_options":{{"include_usage":true,"include_usage":false}}}}'),
    ("include_usage dup f,t", CHAT, f'{{"model":"qwen","messages":{MSG},"stream":true,"stream_options":{{"include_usage":false,"include_usage":true}}}}'),
    ("stream options extra", CHAT, f'{{"model":"qwen","messages":{MSG},"stream":true,"stream_options":{{"continuous_usage_stats":true}}}}'),
    ("stream options no stream", CHAT, f'{{"model":"qwen","messages":{MSG},"stream_options":{{"include_usage":true}}}}'),
    ("stream options list", CHAT, f'{{"model":"qwen","messages":{MSG},"stream":true,"stream_options":[]}}'),
    ("messages escapes", CHAT, '{"model":"qwen","messages":[{"role":"us\\u0065r","content":"\\ud83d\\ude00 \\"q\\" \\\\ \\/ é"}],"max_tokens":2}'),
    ("messages parts", CHAT, '{"model":"qwen","messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"image_url","image_url":{"url":"x"}}]}],"max_tokens":2}'),
    ("messages nested dup", CHAT, '{"model":"qwen","messages":[{"role":"user","content":"a","content":"bb"}],"max_tokens":2}'),
    ("messages object", CHAT, '{"model":"qwen","messages":{"role":"user","content":"a"}}'),
    ("messages empty", CHAT, '{"model":"qwen","messages":[]}'),
    ("lone surrogate", CHAT, '{"model":"qwen","messages":[{"role":"user","content":"\\ud800"}]}'),
    ("NaN", CHAT, f'{{"model":"qwen","messages":{MSG},"temperature":NaN}}'),
    ("Infinity", CHAT, f'{{"model":"qwen","messages":{MSG},"max_tokens":Infinity}}'),
    ("trailing garbage", CHAT, f'{{"model":"qwen","messages":{MSG}}}x'),
    ("trailing object", CHAT, f'{{"model":"qwen","messages":{MSG}}}{{"model":"private"}}'),
    ("whitespace", CHAT, f' \r\n\t{{ "model" :\t"qwen" ,\n"messages" : {MSG} , "max_tokens" : 3 }} \n'),
    ("deep nesting", CHAT, f'{{"model":"qwen","messages":{MSG},"x":{"[" * 200}{"]" * 200}}}'),
    ("comp plain", COMP, '{"model":"qwen","prompt":"hi","max_tokens":5}'),
    ("comp default max", COMP, '{"model":"llama","prompt":"hi"}'),
    ("comp batch", COMP, '{"model":"qwen","prompt":["a","b","c"],"max_tokens":5,"n":2}'),
    ("comp tokens", COMP, '{"model":"qwen","prompt":[1,2,3],"max_tokens":5}'),
    ("comp token batch", COMP, '{"model":"qwen","prompt":[[1,2],[3]],"max_tokens":4,"n":2,"best_of":3}'),
    ("comp best_of 1", COMP, '{"model":"qwen","prompt":"x","max_tokens":4,"best_of":1}'),
    ("comp float tokens", COMP, '{"model":"qwen","prompt":[1.0,2.0],"max_tokens":5}'),
    ("comp string tokens", COMP, '{"model":"qwen","prompt":["1","2"],"max_tokens":5}'),
    ("comp mixed", COMP, '{"model":"qwen","prompt":["a",1],"max_tokens":5}'),
    ("comp empty nested", COMP, '{"model":"qwen","prompt":[[]],"max_tokens":5}'),
    ("comp negative token", COMP, '{"model":"qwen","prompt":[-1],"max_tokens":5}'),
    ("comp mct ignored", COMP, '{"model":"qwen","prompt":"x","max_completion_tokens":5,"max_tokens":9}'),
    ("comp n float", COMP, '{"model":"qwen","prompt":"x","max_tokens":5,"n":2.0}'),
    ("comp n null", COMP, '{"model":"qwen","prompt":"x","max_tokens":5,"n":null}'),
    ("comp stream", COMP, '{"model":"qwen","prompt":"x","max_tokens":5,"stream":true}'),
    ("comp dup prompt", COMP, '{"model":"qwen","prompt":"x","prompt":["a","b","c","d"],"max_tokens":5}'),
]


def padded(body: str) -> str | None:
    """The body with a large unknown member first, past `full_parse_max_bytes`."""
    i = body.find("{")
    if i < 0:
        return None
    return body[: i + 1] + '"x_pad":"' + "p" * (2 * FULL_PARSE_MAX_BYTES) + '",' + body[i + 1:]


@pytest.fixture(scope="module")
def diff_stack(tmp_path_factory):
    procs, pools = [], []
    tmp = tmp_path_factory.mktemp("parser-diff-upstreams")
    try:
        for name, served in [("pool_a", "Qwen/Qwen2.5-0.5B-Instruct"), ("pool_b", "llama"), ("pool_p", "private")]:
            port = free_port()
            log = open(tmp / f"{name}.log", "wb")
            procs.append(subprocess.Popen([sys.executable, str(UPSTREAM), "--port", str(port), "--pool", name],
                                          stdout=log, stderr=subprocess.STDOUT))
            url = f"http://127.0.0.1:{port}"

            def up(url=url):
                try:
                    return httpx.get(url + "/health", timeout=1).status_code == 200
                except httpx.HTTPError:
                    return False
            assert wait_for(up, timeout=30), f"{name} upstream did not start"
            pools.append(Pool(name, [served], kind="external", urls=[url]))
        models = [
            Model("qwen", "pool_a", 100000, served_model_name="Qwen/Qwen2.5-0.5B-Instruct",
                  extra={"aliases": ["qwen-latest"], "lora_adapters": ["sql-lora"]}),
            Model("llama", "pool_b", 100000),
            Model("private", "pool_p", 100000),
        ]
        tenants = [Tenant("diff", [KEY], {"requests_per_minute": 100000, "tokens_per_minute": 10**12},
                          models=["qwen", "llama"])]
        with Stack(tmp_path_factory.mktemp("parser-diff"), pools, models, tenants,
                   filter_extra={"full_parse_max_bytes": FULL_PARSE_MAX_BYTES,
                                 # The upstream compares the filter's x-gateway-* headers.
                                 "upstream_headers": "all"}) as s:
            yield s
    finally:
        for p in procs:
            p.terminate()
            p.wait(timeout=10)


def records(stack) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for pool in stack.pools:
        for r in httpx.get(pool.urls[0] + "/_records", timeout=10).json():
            out.setdefault(r["diff_id"], []).append(r)
    return out


def expected_reservation(path: str, orig: dict, rec: dict) -> tuple[int, bool]:
    """(tokens vLLM may generate, whether the client set the limit) from pydantic's reading."""
    n = rec["n"] if rec["n"] is not None else 1
    prompts = 1
    if path == COMP:
        n = max(n, rec["best_of"] or n)
        p = rec["prompt"]
        if isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
            prompts = len(p)
    if path == CHAT:
        client_set = bool(orig.get("max_completion_tokens") or orig.get("max_tokens"))
        per_choice = rec["max_tokens"] or 1
    else:
        client_set = orig.get("max_tokens") is not None
        per_choice = rec["max_tokens"]
    return per_choice * n * prompts, client_set


def test_the_gateway_routes_and_reserves_what_the_upstream_reads(diff_stack):
    stack = diff_stack
    sent = []
    for name, path, body in CORPUS:
        for variant, raw in [("full", body), ("large", padded(body))]:
            if raw is None:
                continue
            diff_id = uuid.uuid4().hex
            r = httpx.post(stack.base_url + path, content=raw.encode(),
                           headers={"authorization": f"Bearer {KEY}", "content-type": "application/json",
                                    "x-diff-id": diff_id}, timeout=30)
            sent.append((f"{name} [{variant}]", path, raw, diff_id, r))
    seen = records(stack)
    failures, outcomes = [], {"gateway refused": 0, "upstream refused": [], "agreed": 0}
    for label, path, raw, diff_id, r in sent:
        recs = seen.get(diff_id, [])
        if not recs:
            # Refused by the gateway: an OpenAI-shaped error, and no upstream saw it.
            try:
                error = r.json().get("error") or {}
            except ValueError:
                error = {}
            ok = 400 <= r.status_code < 500 and {"message", "type", "code"} <= set(error)
            if not ok:
                failures.append(f"{label}: no upstream record and no gateway error: {r.status_code} {r.text[:200]}")
            outcomes["gateway refused"] += 1
            continue
        if len(recs) != 1:
            failures.append(f"{label}: reached {len(recs)} upstreams")
            continue
        rec = recs[0]
        g = rec["gateway"]
        if g.get("x-gateway-pool") != rec["pool"]:
            failures.append(f"{label}: filter chose {g.get('x-gateway-pool')}, {rec['pool']} received it")
        if rec["pool"] not in ALLOWED_POOLS:
            failures.append(f"{label}: reached {rec['pool']}, which the tenant may not use")
        if "refused" in rec:
            outcomes["upstream refused"].append(f"{label}: {rec['refused'][:120]}")
            continue
        outcomes["agreed"] += 1
        orig = json.loads(raw)  # Python's reading of what the client sent (last duplicate wins)
        if rec["model"] not in SERVED[rec["pool"]]:
            failures.append(f"{label}: pydantic read model {rec['model']!r} in {rec['pool']}")
        reserve = int(g.get("x-gateway-max-tokens", "-1"))
        vllm, client_set = expected_reservation(path, orig, rec)
        if (client_set and reserve != vllm) or reserve < vllm:
            failures.append(f"{label}: reserved {reserve}, vLLM may generate {vllm} (pydantic read {rec})")
        injected = g.get("x-gateway-usage-injected") == "1"
        asked = isinstance(orig.get("stream_options"), dict) and orig["stream_options"].get("include_usage") is True
        if rec["stream"]:
            if rec["include_usage"] is not True or injected == asked:
                failures.append(f"{label}: stream read with include_usage {rec['include_usage']}, injected {injected}")
        elif injected:
            failures.append(f"{label}: usage injected into a request pydantic reads as no stream")
        want_prompt = orig.get("messages") if path == CHAT else orig.get("prompt")
        if rec["prompt"] != want_prompt:
            failures.append(f"{label}: pydantic read prompt {rec['prompt']!r}, the client sent {want_prompt!r}")
    summary = (f"{len(sent)} bodies: {outcomes['gateway refused']} refused by the gateway, "
               f"{len(outcomes['upstream refused'])} refused by the upstream, {outcomes['agreed']} read alike")
    print(summary)
    for line in outcomes["upstream refused"]:
        print("  upstream refused:", line)
    assert not failures, "\n".join([summary, *failures, "--- envoy log ---", stack.envoy_log()[-3000:]])
    # The corpus exercises every outcome.
    assert outcomes["agreed"] >= 40 and outcomes["gateway refused"] >= 40, summary
