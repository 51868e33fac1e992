"""DeepSeek-V3 / R1-0528 (vLLM's ``deepseek_v3``) and DeepSeek-V3.1 (``deepseek_v31``)
calls, grouped between ``<｜tool▁calls▁begin｜>`` and ``<｜tool▁calls▁end｜>``::

    deepseek_v3:  <｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
                  ```json
                  {"city": "Paris"}
                  ```<｜tool▁call▁end｜>
    deepseek_v31: <｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>

(the bars are U+FF5C, the ``▁`` U+2581). Any number of calls; ``arguments`` is the
model's own JSON text of the object. V3's word before ``<｜tool▁sep｜>`` is the call's
type (``function``), on one line. The text before the calls is the content, and so is
text after them (vLLM drops it). A call that is not one (arguments that are not a JSON
object, cut off by max_tokens) stays content. Streamed, a call appears once its name is
complete, and its arguments grow as the model writes them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from vllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ParsedToolCall,
    marker_lark,
    register_tool_parser,
)
from vllm.entrypoints.openai.tool_parsers.json_scan import skip_ws
from vllm.entrypoints.openai.tool_parsers.tagged_calls import (
    CallOpen,
    NotACall,
    SectionedCallParser,
    could_become,
)

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
FENCE_OPEN, FENCE_CLOSE = "```json", "```"


def _before(text: str, pos: int, tag: str, final: bool, one_line: bool) -> int:
    """Where ``tag`` is, after ``pos``; ``CallOpen(None)`` while it may still come."""
    at = text.find(tag, pos)
    if at < 0:
        if final or (one_line and "\n" in text[pos:]):
            raise NotACall
        raise CallOpen(None)
    if one_line and "\n" in text[pos:at]:
        raise NotACall
    return at


def _name(raw: str) -> str:
    name = raw.strip()
    if not name or "<" in name or "\n" in name:
        raise NotACall
    return name


class _DeepSeekToolParser(SectionedCallParser):
    section_open, section_close = CALLS_BEGIN, CALLS_END
    call_open, call_close = CALL_BEGIN, CALL_END


@register_tool_parser("deepseek_v3")
class DeepSeekV3ToolParser(_DeepSeekToolParser):
    args_close = ((FENCE_CLOSE,), (CALL_END,))

    @classmethod
    def call_lark(cls, name: str, arguments: str, special_tokens: Mapping[str, int]) -> str:
        header = f'"function" {marker_lark(SEP, special_tokens)} ' + json.dumps(
            f"{name}\n{FENCE_OPEN}\n"
        )
        return f"{header} {arguments} {json.dumps(chr(10) + FENCE_CLOSE)}"

    def read_header(self, text: str, pos: int, final: bool) -> tuple[str, str | None, int]:
        sep = _before(text, pos, SEP, final, one_line=True)
        start = sep + len(SEP)
        line_end = _before(text, start, "\n", final, one_line=False)
        name = _name(text[start:line_end])
        fence = skip_ws(text, line_end)
        if not text.startswith(FENCE_OPEN, fence):
            if final or not could_become(text[fence:], FENCE_OPEN):
                raise NotACall
            raise CallOpen(ParsedToolCall(name, "", False))  # the name shows already
        return name, None, fence + len(FENCE_OPEN)


@register_tool_parser("deepseek_v31")
class DeepSeekV31ToolParser(_DeepSeekToolParser):
    args_close = ((CALL_END,),)

    @classmethod
    def call_lark(cls, name: str, arguments: str, special_tokens: Mapping[str, int]) -> str:
        return f"{json.dumps(name)} {marker_lark(SEP, special_tokens)} {arguments}"

    def read_header(self, text: str, pos: int, final: bool) -> tuple[str, str | None, int]:
        sep = _before(text, pos, SEP, final, one_line=True)
        return _name(text[pos:sep]), None, sep + len(SEP)
