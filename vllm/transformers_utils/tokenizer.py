"""Tokenizer loading (from the resolved model folder, with an optional chat template)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from vllm.model_executor.model_loader import resolve_model


@lru_cache(maxsize=4)
def get_tokenizer(model: str, tokenizer: str | None = None, chat_template: str | None = None):
    """A HF fast tokenizer; ``chat_template`` is a Jinja file path or template text."""
    from transformers import AutoTokenizer

    source = resolve_model(tokenizer or model)
    tok = AutoTokenizer.from_pretrained(source)
    if chat_template:
        path = Path(chat_template)
        tok.chat_template = path.read_text() if path.exists() else chat_template
    return tok
