"""Custom logits processors (vLLM's ``--logits-processors``, ``LLM(logits_processors=...)``).

A processor is a ``LogitsProcessor`` subclass, named by its fully qualified class name
(``package.module:Class``; ``package.module.Class`` is taken too) or given as the class
(``LLM`` only). Each is built once in the engine with ``(vllm_config, device,
is_pin_memory)``, follows the batch through ``update_state`` and changes the logits in
``apply``: after a grammar's mask, before this engine's own processing (allowed tokens,
``min_tokens``, ``logit_bias``, penalties, temperature, top-k/p/min-p), as in vLLM.
Logprobs are those of the logits before the processors, vLLM's default
(``raw_logprobs``). A request's own arguments for a
processor travel in ``SamplingParams.extra_args`` (``vllm_xargs`` over HTTP); the class's
``validate_params`` can refuse them (a 400). Not with speculative decoding or a pooling
model, as in vLLM.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from vllm.sampling_params import SamplingParams
from vllm.v1.sample.logits_processor.builtin import process_dict_updates
from vllm.v1.sample.logits_processor.interface import (
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# A per-request processor: (output ids, logits row) -> logits row, or
# (prompt ids, output ids, logits row) -> logits row.
RequestLogitsProcessor = Callable[..., torch.Tensor]

__all__ = [
    "AdapterLogitsProcessor",
    "BatchUpdate",
    "LogitsProcessor",
    "MoveDirectionality",
    "RequestLogitsProcessor",
    "load_logits_processors",
    "process_dict_updates",
    "validate_logits_processors_parameters",
]


class AdapterLogitsProcessor(LogitsProcessor):
    """A batch processor made of per-request ones: subclass it, implement
    ``is_argmax_invariant`` and ``new_req_logits_processor(params)`` (a callable for the
    request, or None to leave it alone)."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool):
        self.req_info: dict[int, partial[torch.Tensor]] = {}

    def new_req_logits_processor(self, params: SamplingParams) -> RequestLogitsProcessor | None:
        raise NotImplementedError

    def _new_state(
        self, params: SamplingParams, prompt_ids: list[int] | None, output_ids: list[int]
    ) -> partial[torch.Tensor] | None:
        fn = self.new_req_logits_processor(params)
        if fn is None:
            return None
        if len(inspect.signature(fn).parameters) == 3:
            return partial(fn, prompt_ids, output_ids)
        return partial(fn, output_ids)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.req_info, batch_update, self._new_state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, fn in self.req_info.items():
            logits[row] = fn(logits[row])
        return logits


def _load_one(spec: str | type, where: str) -> type[LogitsProcessor]:
    if isinstance(spec, str):
        module_name, sep, attr = spec.partition(":")
        if not sep:
            module_name, _, attr = spec.rpartition(".")
        if not module_name or not attr:
            raise ValueError(f"{where}: {spec!r} is not a class name (package.module:Class)")
        try:
            cls = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"{where}: cannot load {spec!r}: {e}") from None
    else:
        cls = spec
    if not (isinstance(cls, type) and issubclass(cls, LogitsProcessor)):
        raise ValueError(
            f"{where}: {spec!r} is not a LogitsProcessor subclass "
            "(vllm.v1.sample.logits_processor.LogitsProcessor)"
        )
    return cls


def load_logits_processors(
    specs: Sequence[str | type] | None, where: str = "logits_processors"
) -> list[type[LogitsProcessor]]:
    """The classes named by ``specs`` (class names or classes); ``ValueError`` naming
    ``where`` for one that does not load or is not a ``LogitsProcessor``."""
    return [_load_one(spec, where) for spec in specs or ()]


def validate_logits_processors_parameters(
    classes: Sequence[type[LogitsProcessor]], params: SamplingParams
) -> None:
    """Each processor's ``validate_params`` on a request (its ``ValueError`` a 400)."""
    from vllm.exceptions import VLLMValidationError

    for cls in classes:
        try:
            cls.validate_params(params)
        except VLLMValidationError:
            raise
        except ValueError as e:
            raise VLLMValidationError(str(e), "vllm_xargs") from e


def build_logits_processors(
    specs: Sequence[Any], vllm_config: VllmConfig, device: torch.device
) -> list[LogitsProcessor]:
    """One instance of each configured processor, for the model runner."""
    pin = device.type == "cuda"
    return [cls(vllm_config, device, pin) for cls in load_logits_processors(specs)]
