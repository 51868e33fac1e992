"""OpenAI-compatible request/response models (pydantic) and the mapping to SamplingParams."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, model_validator

from vllm.sampling_params import RequestOutputKind, SamplingParams

AGENT_FIELDS = {"job_id": str, "is_last_step": bool}


class RequestError(ValueError):
    """A bad request: becomes a 400 naming ``param``."""

    def __init__(
        self, message: str, param: str | None = None, status: int = 400, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.param = param
        self.status = status
        self.code = code


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by chat and completion requests (OpenAI + vLLM extras)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    user: str | None = None
    priority: int = 0
    # Agent metadata: top level (openai client extra_body), vllm_xargs, or nested extra_body.
    job_id: StrictStr | None = None
    is_last_step: StrictBool | None = None
    vllm_xargs: dict[str, Any] | None = None
    extra_body: dict[str, Any] | None = None  # emptied by _lift_extra_body

    @model_validator(mode="before")
    @classmethod
    def _lift_extra_body(cls, data: Any) -> Any:
        """A nested ``"extra_body": {...}`` (raw HTTP clients) means its fields, as the
        openai client would have merged them into the body; top-level fields win."""
        if isinstance(data, dict) and isinstance(data.get("extra_body"), dict):
            rest = {k: v for k, v in data.items() if k != "extra_body"}
            data = {**data["extra_body"], **rest}
        return data

    def agent_args(self) -> dict[str, Any]:
        """``SamplingParams.extra_args``: ``vllm_xargs`` plus job_id / is_last_step from
        the top level (which wins) or ``vllm_xargs``, type-checked (RequestError naming it)."""
        merged = {k: v for k, v in (self.vllm_xargs or {}).items() if k in AGENT_FIELDS}
        if self.job_id is not None:
            merged["job_id"] = self.job_id
        if self.is_last_step is not None:
            merged["is_last_step"] = self.is_last_step
        for name, typ in AGENT_FIELDS.items():
            value = merged.get(name)
            if value is not None and type(value) is not typ:
                raise RequestError(f"{name} must be a {typ.__name__}, got {value!r}", name)
        extra = {k: v for k, v in (self.vllm_xargs or {}).items() if k not in AGENT_FIELDS}
        return {**extra, **merged}

    def to_sampling_params(
        self, max_tokens: int, logprobs: int | None, stream: bool
    ) -> SamplingParams:
        defaults = SamplingParams()
        try:
            return SamplingParams(
                n=self.n,
                temperature=defaults.temperature if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=0 if self.top_k is None else self.top_k,
                min_p=0.0 if self.min_p is None else self.min_p,
                seed=self.seed,
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                repetition_penalty=self.repetition_penalty,
                stop=self.stop,
                stop_token_ids=self.stop_token_ids,
                ignore_eos=self.ignore_eos,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                logprobs=logprobs,
                skip_special_tokens=self.skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output,
                output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
                extra_args=self.agent_args() or None,
            )
        except ValueError as e:
            raise RequestError(str(e), str(e).split(" ", 1)[0]) from e


class ChatCompletionRequest(_SamplingFields):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    add_generation_prompt: bool = True
    chat_template: str | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: dict[str, int] | None = None


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now_s)
    owned_by: str = "vllm-continuum"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
