"""Chat encodings written in Python rather than Jinja: the ``--tokenizer-mode`` values
whose model renders chat messages with code of its own (DeepSeek-V3.2's ``encoding``
module) instead of ``apply_chat_template``. The tokenizer itself stays HF's
AutoTokenizer; only the chat rendering changes.

Each is ``render(messages, tools, add_generation_prompt, continue_final_message,
template_kwargs) -> str``, called by ``Processor.apply_chat_template`` (the one seam the
server's chat routes and ``LLM.chat`` render through)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

ChatEncoding = Callable[
    [Sequence[Mapping[str, Any]], Sequence[Mapping[str, Any]] | None, bool, bool,
     Mapping[str, Any] | None],
    str,
]  # fmt: skip


def get_chat_encoding(tokenizer_mode: str | None) -> ChatEncoding | None:
    """The chat encoding ``tokenizer_mode`` renders with; None: the chat template."""
    if tokenizer_mode == "deepseek_v32":
        from vllm.transformers_utils.chat_encodings import deepseek_v32

        return deepseek_v32.render
    return None


# Architectures whose checkpoints ship no Jinja template and render chats with their own
# encoding: --tokenizer-mode auto picks it for them, as vLLM's does.
_ENCODING_OF_ARCHITECTURE = {"DeepseekV32ForCausalLM": "deepseek_v32"}


def auto_chat_encoding(architectures: Sequence[str]) -> str | None:
    """The encoding ``--tokenizer-mode auto`` renders chats with when no chat template is
    at hand (neither --chat-template nor the tokenizer's): the architecture's own where it
    has one; None: none (the chat requests then fail for want of a template)."""
    return next((_ENCODING_OF_ARCHITECTURE[a] for a in architectures
                 if a in _ENCODING_OF_ARCHITECTURE), None)  # fmt: skip


def images_refused(tokenizer_mode: str) -> str:
    """The 400's message for a chat with image parts under a chat encoding (text only)."""
    return (
        f"--tokenizer-mode {tokenizer_mode} renders text only (the model's chat encoding "
        "has no image parts): send the messages' content as text"
    )
