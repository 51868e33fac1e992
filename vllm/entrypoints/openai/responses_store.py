"""Stored responses of ``/v1/responses`` (``store: true``): in the API server's memory,
bounded in number and in bytes, least recently used first out.

Each entry keeps its own input items and its response (whose ``output`` holds the output
items) and the id of the response before it: a ``previous_response_id`` chain is walked
back to its first response (``chain``), and walking it counts as a use of every response
on it, so the chain an agent is extending stays while idle ones are evicted. A chain
whose earlier response was evicted or deleted cannot be continued (the caller's 400).
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_MAX_RESPONSES = 1_000
DEFAULT_MAX_BYTES = 64 * 1024 * 1024


@dataclass
class StoredResponse:
    """``response``: the response object as returned; ``input_items``: its normalized
    input (instructions excluded, as OpenAI: they do not carry over); ``job_id``: the
    Continuum job of its chain; ``nbytes``: its JSON size, what the byte bound counts."""

    response: dict[str, Any]
    input_items: list[dict[str, Any]]
    job_id: str
    nbytes: int = 0

    @property
    def id(self) -> str:
        return self.response["id"]

    @property
    def previous_id(self) -> str | None:
        return self.response.get("previous_response_id")


class ResponseStore:
    """An LRU of ``StoredResponse`` by id. Invariants: ``len(self) <= max_responses`` and
    ``self.nbytes == sum of the entries' nbytes <= max_bytes``. Not thread-safe: used
    from the event loop only."""

    def __init__(
        self, max_responses: int = DEFAULT_MAX_RESPONSES, max_bytes: int = DEFAULT_MAX_BYTES
    ) -> None:
        if max_responses < 1 or max_bytes < 1:
            raise ValueError(f"bounds must be positive, got {max_responses}, {max_bytes}")
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, entry: StoredResponse) -> bool:
        """Store ``entry`` (most recent), evicting the least recently used ones past the
        bounds; False (nothing stored) if it alone is over ``max_bytes``."""
        entry.nbytes = len(json.dumps([entry.response, entry.input_items], ensure_ascii=False))
        if entry.nbytes > self.max_bytes:
            logger.warning(
                "Response %s not stored: %d bytes, over the store's %d",
                entry.id,
                entry.nbytes,
                self.max_bytes,
            )
            return False
        self.delete(entry.id)
        self._entries[entry.id] = entry
        self.nbytes += entry.nbytes
        while len(self._entries) > self.max_responses or self.nbytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.nbytes -= old.nbytes
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        """The entry (now the most recently used), or None."""
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.nbytes -= entry.nbytes
        return entry is not None

    def chain(self, response_id: str) -> list[StoredResponse] | None:
        """The responses from the first of ``response_id``'s chain to it, each marked as
        used; None if it or any response before it is not stored."""
        chain: list[StoredResponse] = []
        seen: set[str] = set()
        next_id: str | None = response_id
        while next_id is not None:
            entry = self.get(next_id)
            if entry is None or next_id in seen:
                return None
            seen.add(next_id)
            chain.append(entry)
            next_id = entry.previous_id
        # Walked from the tip: the first response is now the most recently used (any
        # eviction on the chain breaks it; the tip is the one a client may re-fetch).
        chain.reverse()
        return chain
