"""A request as the engine core sees it (vLLM v1's ``Request``), plus agent metadata."""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams
from vllm.v1.engine import FinishReason
from vllm.v1.outputs import PromptLogprobs, TokenLogprobs
from vllm_continuum.jobs import job_key

if TYPE_CHECKING:
    import torch

    from vllm.multimodal.inputs import MultiModalFeature


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after PREEMPTED is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()
    FINISHED_ERROR = enum.auto()  # failed inside a step (the model runner or the sampler)
    FINISHED_REPETITION = enum.auto()  # the output ended in a repeated n-gram (vLLM's)

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: RequestStatus) -> FinishReason | None:
        """The finish reason sent to the front end (``str()`` of it is OpenAI's)."""
        return _FINISHED_REASONS.get(status)


_FINISHED_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_IGNORED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
    RequestStatus.FINISHED_REPETITION: FinishReason.REPETITION,
}


class Request:
    """One generation request inside the engine core.

    ``block_hasher`` (see ``kv_cache_utils.get_request_block_hasher``) returns the
    hashes of the *new* full blocks of this request; it is called at creation and
    whenever output tokens are appended, so ``block_hashes`` always covers every full
    block of ``all_token_ids``.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None = None,
        arrival_time: float = 0.0,
        priority: int = 0,
        cache_salt: str | None = None,
        block_hasher: Callable[[Request], list[Any]] | None = None,
        lora_request: LoRARequest | None = None,
        mm_features: list[MultiModalFeature] | None = None,
        prompt_embeds: torch.Tensor | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        self.lora_request = lora_request  # its adapter (vllm.lora); None: the base model
        self.mm_features = mm_features  # its images (vllm.multimodal), by prompt position
        # --enable-prompt-embeds: the prompt's embeddings (its token ids are placeholders);
        # their bytes enter the prompt blocks' hashes (kv_cache_utils._extra_keys).
        self.prompt_embeds = prompt_embeds
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.max_tokens = sampling_params.max_tokens

        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self._output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        # --async-scheduling: tokens sampled by steps still on the device, which the
        # scheduler counts as this request's (their positions are scheduled) before it
        # knows them.
        self.num_output_placeholders = 0
        # Draft tokens a draft model proposed in the step that made this request's last
        # token (speculative decoding, method draft_model): the next step's drafts.
        self.spec_token_ids: list[int] = []
        # Prompt tokens served from the prefix cache at first scheduling (-1: not yet).
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        # Times (engine clock) for metrics: first scheduled, first token.
        self.scheduled_time: float | None = None
        self.first_token_time: float | None = None

        # Prompt logprobs (SamplingParams.prompt_logprobs): positions 1..n of the prompt
        # computed so far, and those not yet sent (they go out with the first token).
        self.num_prompt_logprobs = 0
        self._pending_prompt_logprobs: list[TokenLogprobs] = []

        # Agent metadata (read by the policies): from SamplingParams.extra_args.
        self.job_id: str | None = sampling_params.job_id
        self.is_last_step: bool = sampling_params.is_last_step

        self.block_hashes: list[Any] = []
        self._block_hasher = block_hasher
        if block_hasher is not None:
            self.block_hashes.extend(block_hasher(self))

    @property
    def job_key(self) -> str:
        """The job this request belongs to: its job_id, or itself when it has none."""
        return job_key(self.job_id, self.request_id)

    @property
    def named(self) -> bool:
        """Whether the client named this request's job (a ``job_id``)."""
        return self.job_id is not None

    @property
    def last_unless_tool_call(self) -> bool:
        """The job ends with this turn unless its output calls a tool."""
        return self.sampling_params.last_step_unless_tool_call

    @property
    def output_token_ids(self) -> list[int]:
        return self._output_token_ids

    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        """The tokens so far and those that steps still on the device sample."""
        return len(self._all_token_ids) + self.num_output_placeholders

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self._output_token_ids.extend(token_ids)
        self._all_token_ids.extend(token_ids)
        if self._block_hasher is not None:
            self.block_hashes.extend(self._block_hasher(self))

    @property
    def skip_reading_prefix_cache(self) -> bool:
        """As vLLM: a request that wants prompt logprobs needs the logits of every prompt
        position, so it computes its prompt instead of taking cached blocks, until all of
        them are computed (a recompute after preemption may then use the cache)."""
        return (
            self.sampling_params.prompt_logprobs is not None
            and self.num_prompt_logprobs < self.num_prompt_tokens - 1
        )

    def add_prompt_logprobs(self, chunk: PromptLogprobs) -> None:
        """Keep the entries of a prefill chunk that are new: a recompute after preemption
        computes positions already sent again, and those are dropped."""
        skip = self.num_prompt_logprobs + 1 - chunk.start
        if skip < 0:
            raise ValueError(
                f"{self.request_id}: prompt logprobs from position {chunk.start}, but only "
                f"{self.num_prompt_logprobs} computed (a prefix hit skipped some)"
            )
        new = chunk.entries[skip:]
        self._pending_prompt_logprobs.extend(new)
        self.num_prompt_logprobs += len(new)

    def take_prompt_logprobs(self) -> list[TokenLogprobs] | None:
        """The prompt logprobs not yet sent (None if there are none)."""
        if not self._pending_prompt_logprobs:
            return None
        taken, self._pending_prompt_logprobs = self._pending_prompt_logprobs, []
        return taken

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> FinishReason | None:
        return RequestStatus.get_finished_reason(self.status)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, job={self.job_id!r}, status={self.status.name}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens})"
        )
