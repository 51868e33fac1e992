"""Kimi-K2's calls (vLLM's ``kimi_k2``)::

    <|tool_calls_section_begin|>
    <|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}
    <|tool_call_end|>
    <|tool_calls_section_end|>

(one line from ``<|tool_call_begin|>`` to ``<|tool_call_end|>``, folded here).

The header is the call's id, which the response keeps as vLLM does (Kimi's template
wants it back): ``functions.get_weather:0``, ``NAME:IDX`` with the name the part before
the first ``:`` less its ``functions.`` prefix. A header without ``:IDX`` is not a call.
``arguments`` is the model's own JSON text (``{}`` when empty); ``<|tool_calls_section_end|>``
also ends a call left open. The text before the section is the content, and so is text
after it (vLLM drops that). The markers are special tokens, kept in these requests' text.
Streamed, a call appears once its header is complete and its arguments grow as written.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping

from vllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    marker_lark,
    register_tool_parser,
)
from vllm.entrypoints.openai.tool_parsers.tagged_calls import (
    CallOpen,
    NotACall,
    SectionedCallParser,
)

SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_end|>"
ARGS_BEGIN = "<|tool_call_argument_begin|>"
_ID = re.compile(r".+:\d+")


@register_tool_parser("kimi_k2")
class KimiK2ToolParser(SectionedCallParser):
    section_open, section_close = SECTION_BEGIN, SECTION_END
    call_open, call_close = CALL_BEGIN, CALL_END
    args_close = ((CALL_END, SECTION_END),)
    call_rules = ("KIMI_CALL_INDEX: /[0-9]+/",)

    @classmethod
    def call_lark(cls, name: str, arguments: str, special_tokens: Mapping[str, int]) -> str:
        header = json.dumps(f"functions.{name}:")  # then the call's index, any
        return f"{header} KIMI_CALL_INDEX {marker_lark(ARGS_BEGIN, special_tokens)} {arguments}"

    def read_header(self, text: str, pos: int, final: bool) -> tuple[str, str | None, int]:
        at = text.find(ARGS_BEGIN, pos)
        if at < 0:
            if final or CALL_END in text[pos:]:
                raise NotACall
            raise CallOpen(None)
        match = _ID.match(text[pos:at].strip())
        if match is None:
            raise NotACall
        call_id = match.group().strip()
        name = call_id.split(":")[0].removeprefix("functions.")
        if not name:
            raise NotACall
        return name, call_id, at + len(ARGS_BEGIN)
