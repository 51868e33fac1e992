"""The scan shared by the parsers of tag-delimited calls (Qwen3-Coder's XML, GLM's
``<tool_call>name<arg_key>...``): content between calls, each call read by the parser's own
reader, and the streaming rules of ``ToolParser.extract_tool_calls``."""

from __future__ import annotations

from collections.abc import Callable

from vllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ExtractedToolCalls,
    ParsedToolCall,
    held_back,
)


class CallOpen(Exception):
    """The call goes on past the end of the text (streaming: wait for more); ``args[0]``:
    the call so far, or None before its name is complete."""


class NotACall(Exception):
    """The text at a call's start is not one (the user sees it as content)."""


def could_become(text: str, *tags: str) -> bool:
    """Whether ``text`` (the rest of the output) may still become one of ``tags``."""
    return any(tag.startswith(text) for tag in tags)


def scan_tagged_calls(
    text: str,
    final: bool,
    starts: tuple[str, ...],
    close: str,
    read_call: Callable[[str, int, bool], tuple[ParsedToolCall, int]],
) -> ExtractedToolCalls:
    """The calls in ``text`` and the content around them. A call begins at one of
    ``starts``; ``read_call(text, at, final)`` reads the one beginning at ``at`` and returns
    it with where it ends, or raises ``CallOpen`` (the text ends inside it: nothing after it
    is read yet) or ``NotACall`` (streaming, everything from there waits for the end of the
    output; at the end, the text up to ``close`` is content). Not ``final``, a possible
    start of a call at the end is held back."""
    content: list[str] = []
    calls: list[ParsedToolCall] = []
    i = 0
    while True:
        found = [j for j in (text.find(tag, i) for tag in starts) if j >= 0]
        if not found:
            tail = text[i:]
            content.append(tail if final else tail[: len(tail) - held_back(tail, *starts)])
            break
        j = min(found)
        content.append(text[i:j])
        try:
            call, end = read_call(text, j, final)
        except CallOpen as partial:
            if partial.args and partial.args[0] is not None:
                calls.append(partial.args[0])
            break  # everything after waits for the call to close
        except NotACall:
            if not final:
                break  # held back until the output ends (content only grows)
            end = text.find(close, j)
            end = len(text) if end < 0 else end + len(close)
            content.append(text[j:end])
            i = end
            continue
        calls.append(call)
        i = end
    joined = "".join(content).strip()
    return ExtractedToolCalls(joined or (None if final else ""), calls)
