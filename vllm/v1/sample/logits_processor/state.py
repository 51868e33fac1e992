"""The persistent batch that custom logits processors see, kept by the model runner.

Our runner lays out each step's rows anew, so this keeps what vLLM's input batch gives its
processors: a row per scheduled request, stable from step to step, and each step's changes
as one ``BatchUpdate``, built as vLLM's builder does (a removed row is taken by an added
request first, lowest row first; rows left empty are filled by moving the last rows down,
so the batch stays ``[0, batch_size)``; ``removed`` never names a row an added request
took).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm.v1.sample.logits_processor.interface import BatchUpdate, MoveDirectionality


class PersistentBatch:
    def __init__(self) -> None:
        self.rows: list[str | None] = []  # row -> request id
        self.index: dict[str, int] = {}  # request id -> row

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    def update(self, scheduled: Sequence[Any]) -> BatchUpdate | None:
        """The step's batch: ``scheduled`` (states with ``req_id``, ``sampling_params``,
        ``token_ids``, ``num_prompt_tokens``, ``output_token_ids``), in any order. What
        changed since the last step, or None."""
        wanted = {s.req_id for s in scheduled}
        removed = [i for i, r in enumerate(self.rows) if r is not None and r not in wanted]
        for i in removed:
            del self.index[self.rows[i]]
            self.rows[i] = None
        holes = sorted(removed)
        added = []
        for s in scheduled:
            if s.req_id in self.index:
                continue
            if holes:
                row = holes.pop(0)
                removed.remove(row)  # taken: an added request replaces it
            else:
                row = len(self.rows)
                self.rows.append(None)
            self.rows[row], self.index[s.req_id] = s.req_id, row
            prompt = s.token_ids[: s.num_prompt_tokens]
            added.append((row, s.sampling_params, prompt, s.output_token_ids))
        moved = []
        for hole in holes:  # ascending: fill each with the last row beyond it
            while self.rows and self.rows[-1] is None:
                self.rows.pop()
            last = len(self.rows) - 1
            if hole >= last:
                break
            req_id = self.rows.pop()
            self.rows[hole], self.index[req_id] = req_id, hole
            moved.append((last, hole, MoveDirectionality.UNIDIRECTIONAL))
        while self.rows and self.rows[-1] is None:
            self.rows.pop()
        if not (removed or added or moved):
            return None
        return BatchUpdate(len(self.rows), sorted(removed, reverse=True), added, moved)
