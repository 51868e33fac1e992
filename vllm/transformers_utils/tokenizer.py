"""Tokenizer loading (from the resolved model folder, with an optional chat template)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from vllm.model_executor.model_loader import resolve_model


@lru_cache(maxsize=4)
def get_tokenizer(
    model: str,
    tokenizer: str | None = None,
    chat_template: str | None = None,
    revision: str | None = None,
    download_dir: str | None = None,
    tokenizer_revision: str | None = None,
    token: str | None = None,
):
    """A HF fast tokenizer; ``chat_template`` is a Jinja file path or template text.
    Hub ids: the model's at ``revision``, a separate ``tokenizer``'s at
    ``tokenizer_revision``."""
    from transformers import AutoTokenizer

    if tokenizer is None:
        source = resolve_model(model, revision, download_dir, token)
    else:
        source = resolve_model(tokenizer, tokenizer_revision, download_dir, token)
    tok = AutoTokenizer.from_pretrained(source)
    if chat_template:
        path = Path(chat_template)
        tok.chat_template = path.read_text() if path.exists() else chat_template
    elif not getattr(tok, "chat_template", None):
        tok.chat_template = processor_chat_template(source)
    return tok


def processor_chat_template(folder: str) -> str | None:
    """The chat template a multimodal checkpoint keeps beside its processor rather than
    its tokenizer (llava-hf's ``chat_template.json``: ``{"chat_template": ...}``), or
    None."""
    import json

    path = Path(folder) / "chat_template.json"
    if not path.is_file():
        return None
    try:
        template = json.loads(path.read_text()).get("chat_template")
    except (ValueError, AttributeError):
        return None
    return template if isinstance(template, str) else None


NO_TOKENIZER = "no tokenizer is loaded (skip_tokenizer_init=True / --skip-tokenizer-init)"


def init_tokenizer_from_config(model_config):
    """``model_config``'s tokenizer, or None with ``skip_tokenizer_init`` (vLLM's): then
    nothing reads the model folder's tokenizer files, which need not exist."""
    if getattr(model_config, "skip_tokenizer_init", False):
        return None
    mc = model_config
    return get_tokenizer(
        mc.model, mc.tokenizer, mc.chat_template, mc.revision, mc.download_dir,
        mc.tokenizer_revision, mc.hf_token,
    )  # fmt: skip
