"""Helpers for processors that keep per-request state by row (vLLM's names)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from vllm.sampling_params import SamplingParams
from vllm.v1.sample.logits_processor.interface import BatchUpdate, MoveDirectionality

T = TypeVar("T")


def process_dict_updates(
    req_entries: dict[int, T],
    batch_update: BatchUpdate | None,
    new_state: Callable[[SamplingParams, list[int] | None, list[int]], T | None],
) -> bool:
    """Keep ``req_entries`` (row -> state) in step with the batch: removed rows dropped,
    each added request's ``new_state(params, prompt ids, output ids)`` stored (None: the
    processor skips it), moved rows followed. Whether anything changed."""
    if batch_update is None:
        return False
    changed = False
    for index in batch_update.removed:
        changed |= req_entries.pop(index, None) is not None
    for index, params, prompt_ids, output_ids in batch_update.added:
        state = new_state(params, prompt_ids, output_ids)
        if state is not None:
            req_entries[index] = state
            changed = True
        else:
            changed |= req_entries.pop(index, None) is not None
    for a, b, direction in batch_update.moved:
        a_state = req_entries.pop(a, None)
        b_state = req_entries.pop(b, None)
        if a_state is not None:
            req_entries[b] = a_state
            changed = True
        if direction == MoveDirectionality.SWAP and b_state is not None:
            req_entries[a] = b_state
            changed = True
    return changed
