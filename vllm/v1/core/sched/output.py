"""What the scheduler hands the model runner each step (vLLM v1's ``SchedulerOutput``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from vllm.multimodal.inputs import MultiModalFeature
    from vllm.v1.core.sched.state_checkpoints import StateRestore


@dataclass
class NewRequestData:
    """A request the runner has no state for: first scheduling, or resumed after preemption.

    ``token_ids`` is every token known so far (prompt, then outputs already generated
    before a preemption); ``num_computed_tokens`` of them already have KV in
    ``block_ids`` (prefix-cache hit), so the runner computes from there. ``block_ids``
    holds a list per KV cache group (one for most models; a hybrid model's sliding groups
    hold block 0, the null block, where their window no longer reaches).
    """

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int
    lora_request: LoRARequest | None = None  # its adapter; None: the base model
    mm_features: list[MultiModalFeature] | None = None  # its images, by prompt position
    # --enable-prompt-embeds: (num_prompt_tokens, hidden) read in place of the embedding
    # lookup at prompt positions (token_ids holds placeholders there); None: token ids.
    prompt_embeds: torch.Tensor | None = None
    # A model with recurrent layers: the checkpoint slot (on the device or in the CPU tier)
    # of the recurrent states after its first num_computed_tokens (its prefix hit), copied
    # to its own before the forward (vllm/v1/core/sched/state_checkpoints.py); None: it
    # starts from nothing.
    state_restore: StateRestore | None = None


@dataclass
class CachedRequestData:
    """Requests the runner already holds; per-index lists.

    ``new_block_ids[i]`` are blocks appended to request i's block tables this step, a
    list per KV cache group (empty when none). ``num_computed_tokens[i]`` is the count
    before this step.
    """

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[tuple[list[int], ...]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class KVOffloadTransfers:
    """Block copies between the KV cache and the host-memory tier, run by the runner before
    the step's forward pass: every save first, then every load, each in list order.

    ``saves`` are (KV cache block id, tier block id): the KV cache block still holds the
    data it had at the end of the previous step (it may be overwritten by this step's
    loads or forward, hence saves first). ``loads`` are (tier block id, KV cache block id):
    the destination is a block allocated this step, read by this step's forward.
    """

    saves: list[tuple[int, int]] = field(default_factory=list)
    loads: list[tuple[int, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.saves or self.loads)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    # req_id -> tokens to compute this step (prefill chunk length, or 1 for a decode).
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests that finished or were aborted since the last step: the runner drops them.
    finished_req_ids: set[str] = field(default_factory=set)
    # Requests preempted this step: the runner drops their state (they come back as new).
    preempted_req_ids: set[str] = field(default_factory=set)
    # Copies to and from the CPU KV tier, run before the forward (even in an empty step).
    kv_transfers: KVOffloadTransfers | None = None
    # req_id -> draft tokens (speculative decoding): the request computes its last token
    # and these after it this step (num_scheduled_tokens counts them).
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # req_id -> the checkpoint slot its recurrent states are copied into after the forward
    # (its step ends on a block boundary: state_checkpoints.py).
    state_checkpoints: dict[str, int] = field(default_factory=dict)
    # (device checkpoint slot, host slot): evicted checkpoints copied to the CPU tier
    # before the forward (their device slots are rewritten after it).
    state_offloads: list[tuple[int, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0
