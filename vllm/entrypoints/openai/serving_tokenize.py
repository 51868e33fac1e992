"""vLLM's ``POST /tokenize`` and ``POST /detokenize``: a prompt (text, or chat messages
rendered as ``/v1/chat/completions`` would render them) as the model's token ids, and back.

``/tokenize`` takes either ``prompt`` (``add_special_tokens`` defaults to true) or
``messages`` (with ``tools``, ``chat_template``, ``chat_template_kwargs`` and
``add_generation_prompt`` as on chat; ``add_special_tokens`` defaults to false: the
template writes them) and returns ``{"count", "max_model_len", "tokens", "token_strs"}``
(``token_strs`` only with ``return_token_strs``). ``/detokenize`` takes ``tokens`` and
returns ``{"prompt": text}``, special tokens kept. Fields outside these are a 400 naming
them; so is a token id outside the vocabulary.
"""

from __future__ import annotations

from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from vllm.entrypoints.openai.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.serving_chat import OpenAIServingChat
from vllm.exceptions import VLLMValidationError


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    prompt: str | None = Field(default=None, min_length=1)
    messages: list[Any] | None = None  # checked as a chat request's
    add_special_tokens: bool | None = None  # None: true for a prompt, false for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's, as on chat
    tools: list[dict[str, Any]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise VLLMValidationError("give either prompt or messages", "prompt")
        chat_only = ("tools", "chat_template", "chat_template_kwargs")
        if self.prompt is not None and self.continue_final_message:
            raise VLLMValidationError(
                "continue_final_message goes with messages, not prompt", "continue_final_message"
            )
        if self.prompt is not None and any(getattr(self, f) is not None for f in chat_only):
            field = next(f for f in chat_only if getattr(self, f) is not None)
            raise VLLMValidationError(f"{field} goes with messages, not prompt", field)
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    tokens: list[int]


class OpenAIServingTokenization:
    """The two routes over the chat serving's engine, model name and template checks."""

    def __init__(self, chat: OpenAIServingChat, max_model_len: int) -> None:
        self.chat = chat
        self.engine = chat.engine
        self.max_model_len = max_model_len

    async def tokenize(self, request: TokenizeRequest) -> dict[str, Any]:
        self.chat.check_model(request)
        if request.prompt is not None:
            special = True if request.add_special_tokens is None else request.add_special_tokens
            ids = await self.chat.in_thread(self.engine.tokenize, request.prompt, special)
        else:
            ids = await self._chat_tokens(request)
        strs = None
        if request.return_token_strs:
            strs = self.engine.tokenizer.convert_ids_to_tokens(ids)
        return {
            "count": len(ids),
            "max_model_len": self.max_model_len,
            "tokens": ids,
            "token_strs": strs,
        }

    async def _chat_tokens(self, request: TokenizeRequest) -> list[int]:
        fields = {
            "model": request.model,
            "messages": request.messages,
            "tools": request.tools,
            "chat_template": request.chat_template,
            "chat_template_kwargs": request.chat_template_kwargs,
            "add_generation_prompt": request.add_generation_prompt,
            "continue_final_message": request.continue_final_message,
        }
        try:
            chat = ChatCompletionRequest.model_validate(
                {k: v for k, v in fields.items() if v is not None}
            )
        except ValidationError as e:  # a 400 naming the field, as on chat
            raise RequestValidationError(e.errors()) from None
        return await self.chat.prompt_token_ids(chat, bool(request.add_special_tokens))

    def tokenizer_info(self) -> dict[str, Any]:
        """--enable-tokenizer-info-endpoint (vLLM's GET /tokenizer_info): the tokenizer's
        configuration as it was loaded (file paths left out; special tokens by their
        text), its class, and the chat template the server applies."""
        self.chat.require_tokenizer("GET /tokenizer_info", None)
        tokenizer = self.engine.tokenizer
        config = {
            k: v
            for k, v in (getattr(tokenizer, "init_kwargs", None) or {}).items()
            if k not in ("vocab_file", "merges_file", "tokenizer_file", "name_or_path")
        }
        info = _json_safe(config)
        info["tokenizer_class"] = type(tokenizer).__name__
        template = self.engine.chat_template
        if template:
            info["chat_template"] = template
        return info

    async def detokenize(self, request: DetokenizeRequest) -> dict[str, Any]:
        self.chat.check_model(request)
        vocab = self.engine.processor.vocab_size
        bad = [t for t in request.tokens if not 0 <= t < vocab]
        if bad:
            raise VLLMValidationError(
                f"tokens {bad[:8]} are outside the vocabulary [0, {vocab})", "tokens"
            )
        return {"prompt": await self.chat.in_thread(self.engine.decode, request.tokens)}


def _json_safe(value: Any) -> Any:
    """``value`` in JSON's types: an added token by its text, other objects as text."""
    if hasattr(value, "content"):  # tokenizers' AddedToken
        return value.content
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)
