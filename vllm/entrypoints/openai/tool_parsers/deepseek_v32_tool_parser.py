"""DeepSeek-V3.2's calls in its DSML markup (vLLM's ``deepseek_v32``)::

    <｜DSML｜function_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜function_calls>

(the bars are U+FF5C). The blocks and the calls in them read as MiniMax-M2's
``<invoke>`` blocks do (``minimax_m2_tool_parser.py``: several calls a block, text
outside the blocks is the content, a call cut after a whole parameter holds). What
differs is a parameter's value: the model says itself whether it is a string.
``string="true"``: the text between the tags, verbatim. ``string="false"`` (numbers,
booleans, arrays, objects), or no ``string`` attribute: the text as JSON, and the text
itself when it is not JSON, as vLLM reads it. So unlike the schema-typed formats, the
request's tool schemas play no part.

The markers are DSML tokens of DeepSeek's vocabulary, so these requests keep special
tokens in their text. Streamed, a call appears once its name is complete and its
``arguments`` JSON grows a whole parameter at a time, ``}`` when the invoke closes.
"""

from __future__ import annotations

import json
import re
from typing import Any

from vllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ParsedToolCall,
    register_tool_parser,
)
from vllm.entrypoints.openai.tool_parsers.minimax_m2_tool_parser import (
    MinimaxM2ToolParser,
    finite_number,
)
from vllm.entrypoints.openai.tool_parsers.tagged_calls import NotACall, typed_arguments

DSML = "｜DSML｜"
# name="city" string="true": the name, and the string attribute when the model wrote one
_HEADER = re.compile(r'\s*"([^"<>\n]+)"(?:\s+string="([^"]*)")?\s*')


@register_tool_parser("deepseek_v32")
class DeepSeekV32ToolParser(MinimaxM2ToolParser):
    tool_open, tool_close = f"<{DSML}function_calls>", f"</{DSML}function_calls>"
    invoke_open, invoke_close = f"<{DSML}invoke name=", f"</{DSML}invoke>"
    param_open, param_close = f"<{DSML}parameter name=", f"</{DSML}parameter>"

    @staticmethod
    def param_header(key: str, text: bool) -> str:
        # V3.2 says whether the value is a string: text values are, JSON ones are not.
        return f'"{key}" string="{"true" if text else "false"}">'

    def _param(self, text: str, pos: int, final: bool) -> tuple[tuple[str, Any] | None, int]:
        """The parameter opening at ``pos`` as ``(name, (value, is_string))`` and the
        position after it; None while its value is not complete."""
        header_end = text.find(">", pos + len(self.param_open))
        if header_end < 0:
            if final:
                raise NotACall
            return None, pos
        header = _HEADER.fullmatch(text, pos + len(self.param_open), header_end)
        if header is None:
            raise NotACall  # no quoted name, or an attribute that is no string flag
        value_end = text.find(self.param_close, header_end + 1)
        if value_end < 0:
            if final:
                raise NotACall  # cut inside a value: it may be incomplete
            return None, pos
        value = text[header_end + 1 : value_end]
        is_string = header.group(2) == "true"
        return (header.group(1).strip(), (value, is_string)), value_end + len(self.param_close)

    def _parsed(self, name: str, params: list[tuple[str, Any]], closed: bool) -> ParsedToolCall:
        return ParsedToolCall(name, typed_arguments(params, {}, dsml_value, closed), closed)


def dsml_value(raw: tuple[str, bool], schema: Any = None) -> Any:
    """A DSML parameter's value: its text when the model marked it a string, else the
    text as JSON (its numbers finite: JSON cannot hold NaN), or the text when it is not
    JSON."""
    value, is_string = raw
    if is_string:
        return value
    try:
        return json.loads(value, parse_float=finite_number, parse_constant=finite_number)
    except (ValueError, RecursionError):  # RecursionError: nested past the stack
        return value
