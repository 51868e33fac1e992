"""vLLM v1's custom logits processor interface (``--logits-processors``), so that a
processor written for vLLM runs here unchanged.

A processor sees the batch as vLLM's persistent batch: every request scheduled in the step
holds one row index in ``[0, batch_size)``, stable from step to step. Before each forward
pass ``update_state`` receives what changed (``BatchUpdate``: removed rows, added requests
with their parameters, prompt ids and a live reference to their output ids, rows moved),
or None when nothing did; ``apply`` then gets the step's logits, one row per request, and
returns them (it may change them in place).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum, auto
from typing import TYPE_CHECKING

import torch

from vllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from vllm.config import VllmConfig


class MoveDirectionality(Enum):
    UNIDIRECTIONAL = auto()  # the request at i1 now sits at i2 (i1 is left empty)
    SWAP = auto()  # the requests at i1 and i2 trade places


RemovedRequest = int
# (row, params, prompt token ids, output token ids: the request's own list, which grows)
AddedRequest = tuple[int, SamplingParams, list[int] | None, list[int]]
MovedRequest = tuple[int, int, MoveDirectionality]


@dataclass(frozen=True)
class BatchUpdate:
    """How the batch changed since the previous step. Apply in this order: ``removed``,
    then ``added`` (an added request may take a removed one's row), then ``moved``."""

    batch_size: int
    removed: Sequence[RemovedRequest]
    added: Sequence[AddedRequest]
    moved: Sequence[MovedRequest]


class LogitsProcessor(ABC):
    @classmethod
    def validate_params(cls, sampling_params: SamplingParams):
        """Refuse a request's parameters (``ValueError``: the request is a 400)."""
        return None

    @abstractmethod
    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool):
        raise NotImplementedError

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The batch's logits (batch_size, vocab), processed; may change them in place."""
        raise NotImplementedError

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """Whether greedy sampling's choice never changes under this processor."""
        raise NotImplementedError

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Called before each forward pass; None: the batch is as it was."""
        raise NotImplementedError
