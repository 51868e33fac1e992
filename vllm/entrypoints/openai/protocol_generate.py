"""Tokens in, tokens out: vLLM's ``POST /inference/v1/generate`` and the ``/render``
routes that produce its body (docs/serving.md, "Tokens in, tokens out").

A client (an RL trainer, a router, an agent framework that keeps its own token history)
sends the prompt as token ids and the sampling parameters as vLLM's ``SamplingParams``
fields; the server runs them as they are (no chat template, no generation-config
defaults but ``max_tokens``' context bound) and answers token ids, optionally the text.
``/v1/chat/completions/render`` and its siblings answer exactly such a body for a chat,
completion, Messages or Responses request, so a render then a generate runs what the
original request would have run. Strict types, as the OpenAI routes: a field or a
sampling parameter this server does not take is a 400 naming it.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictStr,
    Tag,
    field_validator,
    model_validator,
)

from vllm.entrypoints.openai.protocol import (
    AGENT_FIELDS,
    MAX_REQUEST_ID,
    RepetitionDetection,
    StreamOptions,
)
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import (
    RepetitionDetectionParams,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)

GENERATE_PATH = "/inference/v1/generate"
ABORT_PATH = "/inference/v1/abort_requests"
CHAT_DERENDER_PATH = "/v1/chat/completions/derender"
COMPLETION_DERENDER_PATH = "/v1/completions/derender"
# --enable-scale-out's routes (403 without it; chat's /render is always served).
SCALE_OUT_PATHS = (GENERATE_PATH, ABORT_PATH, "/v1/completions/render", "/v1/messages/render",
                   "/v1/responses/render", CHAT_DERENDER_PATH,
                   COMPLETION_DERENDER_PATH)  # fmt: skip


class StructuredOutputs(BaseModel):
    """``SamplingParams.structured_outputs`` (exactly one constraint)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: dict[str, Any] | str | None = None
    after_reasoning: str | None = None


class GenerateSamplingParams(BaseModel):
    """vLLM's ``SamplingParams`` as JSON: its fields a client sets (the rest the engine or
    the front end fills), each under its name here. Unset fields take its own defaults
    (``max_tokens`` unset: up to the model's context), not the model's generation config:
    a tokens client sends what it wants run. ``logit_bias`` keys are token ids as JSON
    strings. ``extra_args`` carries the agent metadata (``job_id``, ``is_last_step``) as
    on the other routes. A field vLLM has and this engine does not (``logits_processors``,
    ``output_kind``, ...) is a 400 naming it."""

    model_config = ConfigDict(extra="forbid", strict=True)

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = None
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True
    include_stop_str_in_output: bool = False
    stream_interval: int | None = Field(default=None, ge=1)
    extra_args: dict[str, Any] | None = None
    structured_outputs: StructuredOutputs | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] = "left"
    spaces_between_special_tokens: bool = True
    repetition_detection: RepetitionDetection | None = None
    # With a budget, the token sequences that end the reasoning (the first is forced): the
    # chat route derives them from --reasoning-parser, and /render sends them.
    thinking_token_budget: int | None = None
    thinking_end_token_ids: list[list[int]] | None = None

    def to_sampling_params(
        self, stream: bool, extra_args: dict[str, Any] | None = None
    ) -> SamplingParams:
        """The engine's params (``VLLMValidationError`` naming ``sampling_params.<field>``
        for a value out of range); ``extra_args`` in place of the field's."""
        values = {name: getattr(self, name) for name in type(self).model_fields}
        values["extra_args"] = extra_args
        values["thinking_end_token_ids"] = self.thinking_end_token_ids or []
        if self.logit_bias is not None:
            bias = {}
            for key, value in self.logit_bias.items():
                if not key.isdigit():
                    raise VLLMValidationError(
                        f"logit_bias keys must be token ids, got {key!r}",
                        "sampling_params.logit_bias",
                    )
                bias[int(key)] = min(100.0, max(-100.0, value))
            values["logit_bias"] = bias
        if self.structured_outputs is not None:
            fields = self.structured_outputs.model_dump(by_alias=True)
            values["structured_outputs"] = _named(StructuredOutputsParams, fields)
        if self.repetition_detection is not None:
            fields = self.repetition_detection.model_dump()
            values["repetition_detection"] = _named(RepetitionDetectionParams, fields)
        values["output_kind"] = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
        return _named(SamplingParams, values)

    @classmethod
    def from_sampling_params(cls, params: SamplingParams) -> dict[str, Any]:
        """What ``params`` would be sent as (the /render routes' ``sampling_params``):
        every field a client sets, defaults left out."""
        body: dict[str, Any] = {}
        defaults = SamplingParams()
        for name in cls.model_fields:  # SamplingParams' fields a client sets
            value = getattr(params, name)
            if value == getattr(defaults, name) and name != "max_tokens":
                continue
            if name == "logit_bias" and value is not None:
                value = {str(k): v for k, v in value.items()}
            elif name == "structured_outputs" and value is not None:
                value = {k: v for k, v in dataclasses.asdict(value).items() if v is not None}
            elif name == "repetition_detection" and value is not None:
                value = dataclasses.asdict(value)
            body[name] = value
        return body


def _named(kind: type, values: dict[str, Any]) -> Any:
    """``kind(**values)``, its ``VLLMValidationError`` naming ``sampling_params.<field>``."""
    try:
        return kind(**values)
    except VLLMValidationError as e:
        if e.param and not e.param.startswith("sampling_params"):
            e.param = f"sampling_params.{e.param}"
        raise


def generate_body(
    token_ids: list[int], params: SamplingParams, model: str, request: Any
) -> dict[str, Any]:
    """The /inference/v1/generate body that runs ``token_ids`` with ``params``: what the
    /render routes answer for ``request`` (a chat or completion request: its
    ``request_id``, ``stream``, ``stream_options``, ``cache_salt``, ``priority`` and
    ``return_token_ids`` carry over). Beam search is many engine requests a step: its
    body keeps ``use_beam_search``, which the tokens route refuses, naming it."""
    options = request.stream_options
    body: dict[str, Any] = {
        "token_ids": token_ids,
        "sampling_params": GenerateSamplingParams.from_sampling_params(params),
        "model": model,
        "stream": request.stream,
        "priority": request.priority,
    }
    optional = {
        "request_id": request.request_id,
        "stream_options": None if options is None else options.model_dump(),
        "cache_salt": request.cache_salt,
        "return_token_ids": request.return_token_ids or None,
        "use_beam_search": request.use_beam_search or None,
    }
    body.update({k: v for k, v in optional.items() if v is not None})
    return body


class GenerateRequest(BaseModel):
    """The body of ``POST /inference/v1/generate`` (vLLM's ``GenerateRequest``).

    ``request_id``: the response's ``request_id`` is ``generate-tokens-<it>`` (an
    ``X-Request-Id`` header wins), the id ``/inference/v1/abort_requests`` takes.
    ``output_mode``: ``tokens`` (token ids only) or ``text`` (with the text, and logprobs
    with token strings). ``return_token_ids``: the prompt's ids in the response (in a
    stream's first chunk). ``job_id`` / ``is_last_step``: the agent metadata, as on the
    other routes (also in ``sampling_params.extra_args``).

    ``kv_transfer_params``: disaggregated prefill (--kv-transfer-config), as on the other
    routes; a producer's answer is the response's ``kv_transfer_params``.

    Taken and refused (a 400 naming it) unless empty: the multimodal ``features`` and
    ``content_parts``, ``ec_transfer_params``, ``reasoning_ended`` and
    ``reasoning_parser_kwargs``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    request_id: StrictStr | None = Field(default=None, min_length=1, max_length=MAX_REQUEST_ID)
    token_ids: list[int] = Field(min_length=1)
    # /render's char offsets of each token in its source text: informational, not used.
    token_offsets: list[tuple[int, int]] | None = None
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    model: str | None = None
    output_mode: Literal["tokens", "text"] = "tokens"
    return_token_ids: bool | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: StrictStr | None = Field(default=None, min_length=1, max_length=1024)
    priority: int = 0
    job_id: StrictStr | None = None
    is_last_step: bool | None = None
    features: dict[str, Any] | None = None
    content_parts: list[dict[str, Any]] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    reasoning_ended: bool | None = None
    reasoning_parser_kwargs: dict[str, Any] | None = None

    @field_validator("token_ids")
    @classmethod
    def _non_negative(cls, ids: list[int]) -> list[int]:
        if any(t < 0 for t in ids):
            raise VLLMValidationError("token_ids must not contain negative values", "token_ids")
        return ids

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> GenerateRequest:
        refused = {
            "features": "multimodal inputs",
            "content_parts": "multimodal inputs",
            "ec_transfer_params": "encoder-cache transfer",
            "reasoning_ended": "the reasoning state",
            "reasoning_parser_kwargs": "the reasoning state",
        }
        for name, what in refused.items():
            if getattr(self, name):
                raise VLLMValidationError(
                    f"{name} is not supported yet ({what} on the tokens route)", name
                )
        if self.kv_transfer_params and self.sampling_params.n != 1:
            raise VLLMValidationError("kv_transfer_params needs n 1", "kv_transfer_params")
        if (self.kv_transfer_params or {}).get("do_remote_decode") is True and self.stream:
            raise VLLMValidationError(
                "kv_transfer_params.do_remote_decode needs stream false (the KV's location "
                "comes with the whole response)",
                "kv_transfer_params",
            )
        if self.output_mode == "text" and not self.sampling_params.detokenize:
            raise VLLMValidationError(
                "output_mode 'text' needs sampling_params.detokenize true", "output_mode"
            )
        # The agent metadata once, at the top level (which wins), as the headers expect.
        extra = self.sampling_params.extra_args or {}
        if self.job_id is None and isinstance(extra.get("job_id"), str):
            self.job_id = extra["job_id"]
        if self.is_last_step is None and isinstance(extra.get("is_last_step"), bool):
            self.is_last_step = extra["is_last_step"]
        return self

    def sampling(self) -> SamplingParams:
        """The engine's params, the agent metadata folded into ``extra_args`` (the top
        level wins over ``sampling_params.extra_args``)."""
        extra = dict(self.sampling_params.extra_args or {})
        for name in AGENT_FIELDS:
            if getattr(self, name) is not None:
                extra[name] = getattr(self, name)
        if self.kv_transfer_params:
            extra["kv_transfer_params"] = self.kv_transfer_params
        return self.sampling_params.to_sampling_params(self.stream, extra or None)


class AbortRequestsRequest(BaseModel):
    """``POST /inference/v1/abort_requests``: the ``request_id`` of each request to stop,
    as its response named it."""

    model_config = ConfigDict(extra="forbid", strict=True)

    request_ids: list[StrictStr] = Field(max_length=4096)


class AbortAllRequest(BaseModel):
    """Dev mode's ``POST /abort_requests`` (vLLM's RL route): as the tokens route's, but
    no ids (or an empty list) stops every request in flight."""

    model_config = ConfigDict(extra="forbid", strict=True)

    request_ids: list[StrictStr] | None = Field(default=None, max_length=4096)


class GeneratedChoice(BaseModel):
    """One choice of a tokens-mode /inference/v1/generate response, as /derender takes
    it back (its other fields are ignored)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    index: int = Field(ge=0)
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: dict[str, Any] | None = None


class GeneratedResponse(BaseModel):
    """A tokens-mode /inference/v1/generate response, as /derender takes it back."""

    model_config = ConfigDict(extra="ignore", strict=True)

    request_id: StrictStr
    output_mode: Literal["tokens"] = "tokens"
    choices: list[GeneratedChoice] = Field(min_length=1)
    prompt_token_ids: list[int] | None = None
    usage: dict[str, Any] | None = None


class DerenderChatRequest(BaseModel):
    """``POST /v1/chat/completions/derender`` (vLLM's): a generate response read back as
    the chat route reads its output (``chat_request``: the request /render was given; its
    tools, tool_choice, response_format and reasoning settings decide the parsing; none:
    the server's defaults). ``prompt_token_ids`` / ``prompt_tokens``: the prompt's ids
    (they seed the detokenization) and count (the usage), else the response's."""

    model_config = ConfigDict(extra="forbid", strict=True)

    stream: Literal[False] = False
    model: str | None = None
    generate_response: GeneratedResponse
    prompt_tokens: int | None = Field(default=None, ge=0)
    prompt_token_ids: list[int] | None = None
    chat_request: dict[str, Any] | None = None


class DerenderCompletionRequest(BaseModel):
    """``POST /v1/completions/derender`` (vLLM's): one generate response per prompt of
    the completion request /render was given, read back as the completions route reads
    its outputs (choice ``i * n + j``: prompt ``i``'s choice ``j``)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    stream: Literal[False] = False
    model: str | None = None
    generate_responses: list[GeneratedResponse] = Field(min_length=1, max_length=4096)
    prompt_tokens: list[int] | None = None
    prompt_token_ids: list[list[int] | None] | None = None
    completion_request: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _parallel(self) -> DerenderCompletionRequest:
        for name in ("prompt_tokens", "prompt_token_ids"):
            value = getattr(self, name)
            if value is not None and len(value) != len(self.generate_responses):
                raise VLLMValidationError(
                    f"{name} must have one entry per generate response "
                    f"({len(self.generate_responses)}), got {len(value)}",
                    name,
                )
        return self


MAX_DERENDER_TOKENS = 1 << 20  # a stream state's output tokens (a context's worth, and more)


class DerenderStreamState(BaseModel):
    """What a streaming /derender call hands back for the next one (the client carries it;
    the server keeps nothing): the sequence's output token ids so far and how they came
    in chunks (replayed through the detokenizer and the output parser each call: their
    state is not serialisable), and whether its first chunk went out."""

    model_config = ConfigDict(extra="forbid", strict=True)

    output_token_ids: list[int] = Field(default_factory=list, max_length=MAX_DERENDER_TOKENS)
    output_chunk_lens: list[int] = Field(default_factory=list, max_length=MAX_DERENDER_TOKENS)
    started: bool = False

    @model_validator(mode="after")
    def _lens_add_up(self) -> DerenderStreamState:
        if any(n <= 0 for n in self.output_chunk_lens) or sum(self.output_chunk_lens) != len(
            self.output_token_ids
        ):
            raise VLLMValidationError(
                "stream_state.output_chunk_lens must be positive and add up to "
                "len(output_token_ids)",
                "stream_state",
            )
        return self

    def chunks(self) -> list[list[int]]:
        """The output token ids in the chunks they came in."""
        out, start = [], 0
        for n in self.output_chunk_lens:
            out.append(self.output_token_ids[start : start + n])
            start += n
        return out

    def after(self, token_ids: list[int]) -> DerenderStreamState:
        """The state once ``token_ids`` (one more chunk) went out."""
        lens = self.output_chunk_lens + ([len(token_ids)] if token_ids else [])
        return DerenderStreamState(
            output_token_ids=self.output_token_ids + token_ids, output_chunk_lens=lens,
            started=True,
        )  # fmt: skip


class GeneratedChunk(BaseModel):
    """One SSE chunk of a tokens-mode /inference/v1/generate stream, as a streaming
    /derender takes it back: one choice (a state is one sequence's), or none (the usage
    chunk)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    request_id: StrictStr
    output_mode: Literal["tokens"] = "tokens"
    choices: list[GeneratedChoice] = Field(default_factory=list, max_length=1)
    prompt_token_ids: list[int] | None = None
    usage: dict[str, Any] | None = None


class _DerenderChunk(BaseModel):
    """A streaming /derender call: one generate chunk and the ``stream_state`` the last
    call answered (none: the first); answers ``{"chunk", "stream_state"}``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    stream: Literal[True]
    model: str | None = None
    generate_chunk: GeneratedChunk
    stream_state: DerenderStreamState | None = None
    prompt_tokens: int | None = Field(default=None, ge=0)
    prompt_token_ids: list[int] | None = None


class DerenderChatStreamRequest(_DerenderChunk):
    """``POST /v1/chat/completions/derender`` a chunk at a time (its ``chunk`` a
    chat.completion.chunk)."""

    chat_request: dict[str, Any] | None = None


class DerenderCompletionStreamRequest(_DerenderChunk):
    """``POST /v1/completions/derender`` a chunk at a time (its ``chunk`` a
    text_completion chunk)."""

    completion_request: dict[str, Any] | None = None


def _streams(value: Any) -> str:
    """The /derender body's kind: ``stream: true`` is a chunk's, anything else a whole
    response's (validated as such)."""
    stream = value.get("stream") if isinstance(value, dict) else getattr(value, "stream", None)
    return "chunk" if stream is True else "whole"


DerenderChatBody = Annotated[
    Annotated[DerenderChatRequest, Tag("whole")]
    | Annotated[DerenderChatStreamRequest, Tag("chunk")],
    Discriminator(_streams),
]
DerenderCompletionBody = Annotated[
    Annotated[DerenderCompletionRequest, Tag("whole")]
    | Annotated[DerenderCompletionStreamRequest, Tag("chunk")],
    Discriminator(_streams),
]
