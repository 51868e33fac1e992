"""Cohere Command's calls (vLLM's ``cohere_command3``: Command R7B / Command A, and
``cohere_command4``: the later models that write ``<|START_TEXT|>``)::

    <|START_THINKING|>I will look it up.<|END_THINKING|>
    <|START_ACTION|>[
        {"tool_call_id": "0", "tool_name": "get_weather", "parameters": {"city": "Paris"}}
    ]<|END_ACTION|>

An action block holds a JSON list of calls (``tool_name``, ``parameters``; the model's
``tool_call_id`` is not kept: calls get the server's ids). Text outside the blocks is the
content, without the answer's markers (``<|START_RESPONSE|>`` / ``<|END_RESPONSE|>``,
``<|START_TEXT|>`` / ``<|END_TEXT|>`` for ``cohere_command4``) nor the thinking markers
(``--reasoning-parser cohere_command3`` splits the thinking off). vLLM parses with
Cohere's ``cohere_melody`` library; this reading is ours, without its citations (the
``<co>...</co: ...>`` markup stays in the text). A block that is not a valid list of
calls is content, markers and all.

The markers are special tokens, so requests read by this parser keep special tokens in
their text. Streamed, a call shows once its name is complete and its arguments grow with
the text, as for the ``json`` parser.
"""

from __future__ import annotations

from typing import ClassVar

from vllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ExtractedToolCalls,
    ParsedToolCall,
    ToolParser,
    call_at,
    held_back,
    is_valid_call,
    register_tool_parser,
)
from vllm.entrypoints.openai.tool_parsers.json_scan import Malformed, skip_ws

ACTION_OPEN, ACTION_CLOSE = "<|START_ACTION|>", "<|END_ACTION|>"
THINKING_TAGS = ("<|START_THINKING|>", "<|END_THINKING|>")
KEYS = {"name_key": "tool_name", "args_key": "parameters"}


class _Open(Exception):
    """The block goes on past the end of the text; args[0]: its calls so far."""


@register_tool_parser("cohere_command3")
class CohereCommand3ToolParser(ToolParser):
    keeps_special_tokens = True
    # The markers around the answer, dropped from the content.
    text_tags: ClassVar[tuple[str, ...]] = ("<|START_RESPONSE|>", "<|END_RESPONSE|>")

    def plain_content(self, text: str) -> str:
        """An answer without calls, its markers dropped (as streamed)."""
        if ACTION_OPEN in text:  # a block that is not calls: the text as written
            return text
        for marker in (*self.text_tags, *THINKING_TAGS):
            text = text.replace(marker, "")
        return text.strip()

    def extract_tool_calls(self, text: str, final: bool) -> ExtractedToolCalls:
        markers = (*self.text_tags, *THINKING_TAGS)
        content: list[str] = []
        calls: list[ParsedToolCall] = []
        i = 0
        while True:
            j = text.find(ACTION_OPEN, i)
            if j < 0:
                tail = text[i:]
                if not final:
                    tail = tail[: len(tail) - held_back(tail, ACTION_OPEN, *markers)]
                content.append(tail)
                break
            content.append(text[i:j])
            try:
                found, end = self._block(text, j + len(ACTION_OPEN), final)
            except _Open as partial:
                calls.extend(partial.args[0])
                break  # everything after waits for the block to close
            except ValueError:  # Malformed, a key json cannot decode, an invalid call
                if not final:
                    break  # held back until the output ends (content only grows)
                close = text.find(ACTION_CLOSE, j)
                end = len(text) if close < 0 else close + len(ACTION_CLOSE)
                content.append(text[j:end])
                i = end
                continue
            calls.extend(found)
            i = end
        joined = "".join(content)
        for marker in markers:
            joined = joined.replace(marker, "")
        joined = joined.strip()
        return ExtractedToolCalls(joined or (None if final else ""), calls)

    @staticmethod
    def _block(text: str, pos: int, final: bool) -> tuple[list[ParsedToolCall], int]:
        """The calls of the list at ``pos`` (after the block's opening marker) and the end
        of the block. ``_Open`` while it may go on; ``ValueError`` if it is not calls."""
        pos = skip_ws(text, pos)
        calls: list[ParsedToolCall] = []
        if pos >= len(text):
            if final:
                raise Malformed("an empty action block")
            raise _Open(calls)
        if text[pos] != "[":
            raise Malformed("an action block holds a list")
        pos = skip_ws(text, pos + 1)
        while pos < len(text) and text[pos] != "]":
            if text[pos] != "{":
                raise Malformed(f"expected a call object at {pos}")
            call, end = call_at(text, pos, **KEYS)
            calls.append(call)
            if end is None:
                break
            if final and not is_valid_call(text[pos:end], **KEYS):
                raise Malformed(f"invalid call at {pos}")
            pos = skip_ws(text, end)
            if pos < len(text) and text[pos] == ",":
                pos = skip_ws(text, pos + 1)
            elif pos < len(text) and text[pos] != "]":
                raise Malformed(f"unexpected {text[pos]!r} at {pos}")
        if pos >= len(text) or text[pos] != "]":
            if final:
                raise Malformed("the list is cut off")
            raise _Open(calls)
        if not calls:
            raise Malformed("an action block without calls")
        after = skip_ws(text, pos + 1)
        if text.startswith(ACTION_CLOSE, after):
            return calls, after + len(ACTION_CLOSE)
        if final and after >= len(text):  # the block's end marker cut off: the list holds
            return calls, after
        if not final and ACTION_CLOSE.startswith(text[after:]):
            raise _Open(calls)
        raise Malformed("text after the list in an action block")


@register_tool_parser("cohere_command4")
class CohereCommand4ToolParser(CohereCommand3ToolParser):
    text_tags = ("<|START_TEXT|>", "<|END_TEXT|>")
