"""Anthropic's cache diagnostics (``diagnostics.previous_message_id``): why this request's
prompt could not reuse the cached prefix of an earlier one.

A request that sends ``diagnostics`` (``{"previous_message_id": null}`` on a first turn)
opts in: its fingerprint is kept under its message id (``Fingerprints``, least recently
used out past a number of messages and of prompt tokens). The next request naming that id
gets ``diagnostics.cache_miss_reason``, compared in Anthropic's order:

- ``previous_message_not_found``: no fingerprint under that id (never opted in, evicted,
  or another server's);
- ``model_changed``, ``system_changed``, ``tools_changed``: that part differs (``system``
  without Claude Code's billing header, any part without its ``cache_control`` marks,
  which clients move from turn to turn);
- ``messages_changed``: the earlier request's messages are not the start of this one's
  (an entry was edited, removed or reordered rather than entries appended);
- ``unavailable``: all of those match, yet the prompts' tokens part before the earlier
  prompt's end (another prompt-affecting field changed: ``thinking``, ``tool_choice``, a
  chat template that rewrites earlier turns);
- none (``cache_miss_reason: null``): the earlier prompt is the start of this one, so the
  engine's prefix cache could serve all of it.

``cache_missed_input_tokens`` is the earlier prompt's tokens past the prefix the two
prompts share: what would have been read from the cache had it matched.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from vllm_continuum.claude_code import system_text

DEFAULT_MAX_MESSAGES = 1_000
DEFAULT_MAX_TOKENS = 4_000_000  # 16 MB of prompt token ids


def _digest(value: Any) -> str:
    text = json.dumps(_unmarked(value), sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


def _unmarked(value: Any) -> Any:
    """``value`` without ``cache_control`` keys, at any depth."""
    if isinstance(value, dict):
        return {k: _unmarked(v) for k, v in value.items() if k != "cache_control"}
    if isinstance(value, list):
        return [_unmarked(v) for v in value]
    return value


@dataclass
class Fingerprint:
    """What a later request is compared with: the model, digests of the system prompt,
    the tools and each message, and the prompt's token ids."""

    model: str
    system: str
    tools: str
    messages: list[str]
    prompt: array

    @classmethod
    def of(cls, request: Any, model: str, prompt_token_ids: list[int]) -> Fingerprint:
        """``model``: what the request runs on (the served model for any of its names, or
        the LoRA adapter), so two names of one model share a cache."""
        return cls(
            model=model,
            system=_digest(system_text(request.system)),
            tools=_digest(request.tools or []),
            messages=[_digest(m) for m in request.messages],
            prompt=array("i", prompt_token_ids),
        )

    def miss_reason(self, earlier: Fingerprint | None) -> dict[str, Any] | None:
        """Why this prompt cannot reuse all of ``earlier``'s (see the module doc)."""
        if earlier is None:
            return {"type": "previous_message_not_found"}
        missed = len(earlier.prompt) - _common_prefix(earlier.prompt, self.prompt)
        for kind, same in (
            ("model_changed", self.model == earlier.model),
            ("system_changed", self.system == earlier.system),
            ("tools_changed", self.tools == earlier.tools),
            ("messages_changed", self.messages[: len(earlier.messages)] == earlier.messages),
        ):
            if not same:
                return {"type": kind, "cache_missed_input_tokens": missed}
        return {"type": "unavailable"} if missed else None


def _common_prefix(a: array, b: array) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class Fingerprints:
    """Message id -> ``Fingerprint``, least recently used out past ``max_messages`` or
    ``max_tokens`` prompt tokens in all. Used from the event loop only."""

    def __init__(
        self, max_messages: int = DEFAULT_MAX_MESSAGES, max_tokens: int = DEFAULT_MAX_TOKENS
    ) -> None:
        self.max_messages = max_messages
        self.max_tokens = max_tokens
        self.tokens = 0
        self._entries: OrderedDict[str, Fingerprint] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, message_id: str) -> Fingerprint | None:
        entry = self._entries.get(message_id)
        if entry is not None:
            self._entries.move_to_end(message_id)
        return entry

    def put(self, message_id: str, entry: Fingerprint) -> None:
        if len(entry.prompt) > self.max_tokens:
            return  # larger than the whole store: kept nowhere
        self._entries[message_id] = entry
        self.tokens += len(entry.prompt)
        while len(self._entries) > self.max_messages or self.tokens > self.max_tokens:
            _, old = self._entries.popitem(last=False)
            self.tokens -= len(old.prompt)
