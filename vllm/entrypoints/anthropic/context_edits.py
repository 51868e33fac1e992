"""Anthropic's context editing (``context_management.edits``), applied to a Messages
request's ``messages`` before they are rendered.

- ``clear_thinking_20251015``: the thinking blocks of all but the last ``keep`` assistant
  turns are removed (``keep``: ``{"type": "thinking_turns", "value": N}``, 1 when not
  given; ``"all"`` or ``{"type": "all"}`` keeps every one, and is what Claude Code sends).
- ``clear_tool_uses_20250919``: once ``trigger`` holds (``{"type": "input_tokens"}``:
  the prompt has more tokens, 100,000 when not given; ``{"type": "tool_uses"}``: the
  conversation has more tool uses), the results of the oldest tool uses are replaced by
  a placeholder, all but the last ``keep`` ones (3 when not given) and those of
  ``exclude_tools``; ``clear_tool_inputs`` (true, or a list of tool names) empties their
  inputs too. With ``clear_at_least``, nothing is cleared unless that many prompt tokens
  would be.

The edits run in the order given; what each cleared is reported in the response's
``context_management.applied_edits`` (an edit that cleared nothing is not listed). A
cleared context starts differently from the turns before it: the prefix cache cannot
serve what follows the first cleared block.
"""

from __future__ import annotations

import copy
from collections.abc import Awaitable, Callable
from typing import Any

from vllm.entrypoints.openai.protocol import loggable
from vllm.exceptions import VLLMValidationError

CLEARED_RESULT = "[tool result cleared]"
THINKING = "clear_thinking_20251015"
TOOL_USES = "clear_tool_uses_20250919"
DEFAULT_TRIGGER = {"type": "input_tokens", "value": 100_000}
DEFAULT_KEEP_USES = {"type": "tool_uses", "value": 3}
DEFAULT_KEEP_TURNS = {"type": "thinking_turns", "value": 1}
_EDIT_KEYS = {
    THINKING: {"type", "keep"},
    TOOL_USES: {"type", "trigger", "keep", "clear_at_least", "exclude_tools", "clear_tool_inputs"},
}


def _refuse(why: str, value: Any) -> VLLMValidationError:
    return VLLMValidationError(
        f"context_management: {why}, got {loggable(value)}", "context_management"
    )


def _count(value: Any, kinds: tuple[str, ...], what: str) -> tuple[str, int]:
    if (
        not isinstance(value, dict)
        or set(value) != {"type", "value"}
        or value["type"] not in kinds
        or not isinstance(value["value"], int)
        or isinstance(value["value"], bool)
        or value["value"] < 0
    ):
        raise _refuse(f"{what} must be {{'type': {' | '.join(kinds)}, 'value': <int >= 0>}}", value)
    return value["type"], value["value"]


def parse_edits(config: Any) -> list[dict[str, Any]]:
    """The edits of ``context_management`` with their defaults filled in;
    ``VLLMValidationError`` naming ``context_management`` for one this server cannot
    apply."""
    if config is None:
        return []
    if (
        not isinstance(config, dict)
        or set(config) - {"edits"}
        or not isinstance(config.get("edits", []), list)
    ):
        raise _refuse("must be {'edits': [...]}", config)
    edits = []
    for edit in config.get("edits", []):
        kind = edit.get("type") if isinstance(edit, dict) else None
        if kind not in _EDIT_KEYS or set(edit) - _EDIT_KEYS[kind]:
            raise _refuse(f"edits may be {THINKING} or {TOOL_USES} (with their keys)", edit)
        if kind == THINKING:
            keep = edit.get("keep", DEFAULT_KEEP_TURNS)
            turns = None  # all
            if keep not in ("all", {"type": "all"}):
                _, turns = _count(keep, ("thinking_turns",), "keep")
            edits.append({"type": kind, "keep_turns": turns})
            continue
        trigger = _count(
            edit.get("trigger", DEFAULT_TRIGGER), ("input_tokens", "tool_uses"), "trigger"
        )
        _, keep = _count(edit.get("keep", DEFAULT_KEEP_USES), ("tool_uses",), "keep")
        at_least = edit.get("clear_at_least")
        at_least = (
            0 if at_least is None else _count(at_least, ("input_tokens",), "clear_at_least")[1]
        )
        exclude = edit.get("exclude_tools") or []
        inputs = edit.get("clear_tool_inputs") or False
        if not _names(exclude) or not (isinstance(inputs, bool) or _names(inputs)):
            raise _refuse(
                "exclude_tools and clear_tool_inputs (if not a bool) are tool names", edit
            )
        edits.append(
            {
                "type": kind,
                "trigger": trigger,
                "keep": keep,
                "at_least": at_least,
                "exclude": set(exclude),
                "inputs": inputs,
            }
        )
    return edits


def _names(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(n, str) for n in value)


def needs_work(edits: list[dict[str, Any]]) -> bool:
    """Whether any edit may change something (Claude Code's keep-all asks for nothing)."""
    return any(e["type"] == TOOL_USES or e["keep_turns"] is not None for e in edits)


async def apply_edits(
    messages: list[dict[str, Any]],
    edits: list[dict[str, Any]],
    count_tokens: Callable[[list[dict[str, Any]]], Awaitable[int]],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], int]:
    """The edited messages (a copy; ``messages`` is left as it is), the applied edits'
    reports, and the prompt's tokens with the edited messages. ``count_tokens(messages)``:
    the prompt's tokens with these messages."""
    tokens = await count_tokens(messages)
    applied = []
    for edit in edits:
        if edit["type"] == THINKING:
            if edit["keep_turns"] is None:
                continue
            edited, cleared = _clear_thinking(messages, edit["keep_turns"])
            report = {"type": THINKING, "cleared_thinking_turns": cleared}
        else:
            kind, limit = edit["trigger"]
            uses = len(_tool_uses(messages))
            if (tokens if kind == "input_tokens" else uses) <= limit:
                continue
            edited, cleared = _clear_tool_uses(messages, edit)
            report = {"type": TOOL_USES, "cleared_tool_uses": cleared}
        if not cleared:
            continue
        after = await count_tokens(edited)
        if edit["type"] == TOOL_USES and tokens - after < edit["at_least"]:
            continue  # it would not clear enough: Anthropic leaves the context as it is
        report["cleared_input_tokens"] = tokens - after
        messages, tokens = edited, after
        applied.append(report)
    return messages, applied, tokens


def _assistant_turns(messages: list[dict[str, Any]]) -> list[int]:
    return [i for i, m in enumerate(messages) if m.get("role") == "assistant"]


def _clear_thinking(messages: list[dict[str, Any]], keep: int) -> tuple[list[dict], int]:
    turns = _assistant_turns(messages)
    older = turns[: max(len(turns) - keep, 0)]
    out, cleared = copy.deepcopy(messages), 0
    for i in older:
        content = out[i].get("content")
        if not isinstance(content, list):
            continue
        kept = [b for b in content if b.get("type") not in ("thinking", "redacted_thinking")]
        if len(kept) < len(content):
            out[i]["content"] = kept or [{"type": "text", "text": ""}]
            cleared += 1
    return out, cleared


def _tool_uses(messages: list[dict[str, Any]]) -> list[tuple[int, int, dict]]:
    """(message index, block index, block) of each tool_use block, oldest first."""
    return [
        (i, j, b)
        for i, m in enumerate(messages)
        if m.get("role") == "assistant" and isinstance(m.get("content"), list)
        for j, b in enumerate(m["content"])
        if isinstance(b, dict) and b.get("type") == "tool_use"
    ]


def _clear_tool_uses(messages: list[dict[str, Any]], edit: dict[str, Any]) -> tuple[list, int]:
    uses = _tool_uses(messages)
    older = uses[: max(len(uses) - edit["keep"], 0)]
    targets = {b.get("id"): (i, j, b.get("name")) for i, j, b in older}
    targets = {k: v for k, v in targets.items() if v[2] not in edit["exclude"]}
    out, cleared = copy.deepcopy(messages), set()
    for message in out:
        content = message.get("content")
        if message.get("role") != "user" or not isinstance(content, list):
            continue
        for block in content:
            if isinstance(block, dict) and block.get("type") == "tool_result":
                if block.get("tool_use_id") in targets and block.get("content") != CLEARED_RESULT:
                    block["content"] = CLEARED_RESULT
                    cleared.add(block["tool_use_id"])
    inputs = edit["inputs"]
    for call_id, (i, j, name) in targets.items():
        if inputs is True or (isinstance(inputs, list) and name in inputs):
            block = out[i]["content"][j]
            if block.get("input"):
                block["input"] = {}
                cleared.add(call_id)
    return out, len(cleared)
