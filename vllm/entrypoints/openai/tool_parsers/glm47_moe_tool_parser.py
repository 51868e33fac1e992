"""GLM-4.5 / 4.6 / 4.7's calls (vLLM's ``glm45`` and ``glm47``, one reading)::

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    <arg_key>days</arg_key>
    <arg_value>3</arg_value>
    </tool_call>

GLM-4.7 writes the same without the newlines. The name runs from ``<tool_call>`` to the
first ``<arg_key>`` (or ``</tool_call>``: a call without arguments) and is stripped; keys
are stripped, values kept verbatim. Any number of calls; the text outside them is the
content.

Values are text, typed by the tool's JSON schema as for Qwen3-Coder (``typed_value``):
an ``integer`` parameter's ``"3"`` becomes ``3``, an ``object`` one's JSON an object; a
value that does not convert, and every parameter the schema does not type, stays a
string. A key given twice keeps its first value.

When the request has tools, a call to a name that is none of them is not a call (vLLM
drops it; here the text stays content). Text that breaks the format (stray text between
arguments, a key without a value, a call cut inside its name or a value) is content too;
a call cut after a whole value (a stop string) holds.

The markers are special tokens in GLM's tokenizer, so requests read by this parser keep
special tokens in their text, as vLLM does. Streamed, a call appears once its name is
complete, and its ``arguments`` JSON grows a whole parameter at a time, ``}`` when the
call closes; each is a prefix of the final text.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from vllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    EMPTY,
    ExtractedToolCalls,
    ParsedToolCall,
    ToolParser,
    marker_begin,
    marker_lark,
    marker_trigger,
    register_tool_parser,
    text_until,
)
from vllm.entrypoints.openai.tool_parsers.json_scan import skip_ws
from vllm.entrypoints.openai.tool_parsers.qwen3coder_tool_parser import (
    keyed_parameters_lark,
    typed_value,
)
from vllm.entrypoints.openai.tool_parsers.tagged_calls import (
    CallOpen,
    NotACall,
    could_become,
    scan_tagged_calls,
    schema_properties,
    typed_arguments,
)

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
KEY_OPEN, KEY_CLOSE = "<arg_key>", "</arg_key>"
VALUE_OPEN, VALUE_CLOSE = "<arg_value>", "</arg_value>"


@register_tool_parser("glm45", "glm47")
class Glm47MoeToolParser(ToolParser):
    keeps_special_tokens = True

    def extract_tool_calls(self, text: str, final: bool) -> ExtractedToolCalls:
        return scan_tagged_calls(text, final, (TOOL_OPEN,), TOOL_CLOSE, self._call)

    @classmethod
    def structural_tag(
        cls,
        schemas: Mapping[str, dict | None],
        special_tokens: Mapping[str, int] = EMPTY,
        single: bool = False,
    ) -> dict | None:
        """``<tool_call>`` opens a call: then one of the tools' names, its
        ``<arg_key>``/``<arg_value>`` pairs (``keyed_parameters_lark``: a held schema's
        properties in order, typed values as JSON) and ``</tool_call>``; a newline is
        allowed after the name, a key and a value (GLM-4.5 writes them, 4.7 does not).
        The markers are matched as tokens where the tokenizer has them as special ones
        (GLM's does)."""
        key_open, key_close = (marker_lark(m, special_tokens) for m in (KEY_OPEN, KEY_CLOSE))
        value_open = marker_lark(VALUE_OPEN, special_tokens)
        value_close = marker_lark(VALUE_CLOSE, special_tokens)
        value_rule, value = text_until("GLM_VALUE", VALUE_CLOSE, special_tokens)
        value = f'{value} "\\n"?'
        close = marker_lark(TOOL_CLOSE, special_tokens)

        def params(schema: dict | None) -> str:
            return keyed_parameters_lark(
                schema,
                lambda key, text: f'{key_open} {json.dumps(key)} {key_close} "\\n"? {value_open}',
                value,
                lambda expr: f'{expr} {value_close} "\\n"?',
                "glm_any*",
            )

        return {
            "triggers": [marker_trigger(TOOL_OPEN, special_tokens)],
            "rules": [
                value_rule,
                "GLM_KEY: /[^<>\\n]+/",
                f'glm_any: {key_open} GLM_KEY {key_close} "\\n"? {value_open} {value}',
            ],
            "structures": [
                {
                    "begin": marker_begin(TOOL_OPEN, special_tokens),
                    "lark": f'{json.dumps(name)} "\\n"? {params(schema)} {close}',
                    "end": "",
                }
                for name, schema in schemas.items()
            ],
        }

    def _call(self, text: str, start: int, final: bool) -> tuple[ParsedToolCall, int]:
        """The call whose ``<tool_call>`` is at ``start`` and where it ends (after its
        closing tag). Raises ``CallOpen`` while the text may go on inside it, ``NotACall``."""
        pos = start + len(TOOL_OPEN)
        ends = [at for tag in (KEY_OPEN, TOOL_CLOSE) if (at := text.find(tag, pos)) >= 0]
        if not ends:
            if final:
                raise NotACall
            raise CallOpen(None)
        name = text[pos : min(ends)].strip()
        if not name or "<" in name or (self.functions and name not in self.functions):
            raise NotACall
        pos = min(ends)
        args: list[tuple[str, str]] = []
        while not text.startswith(TOOL_CLOSE, pos):
            if pos >= len(text) and final:  # cut after a whole value (a stop string)
                return self._parsed(name, args, closed=True), pos
            arg, pos = self._arg(text, pos, final)
            if arg is None:
                raise CallOpen(self._parsed(name, args, closed=False))
            args.append(arg)
            pos = skip_ws(text, pos)
        return self._parsed(name, args, closed=True), pos + len(TOOL_CLOSE)

    @staticmethod
    def _arg(text: str, pos: int, final: bool) -> tuple[tuple[str, str] | None, int]:
        """The ``<arg_key>K</arg_key><arg_value>V</arg_value>`` pair at ``pos`` and the
        position after it; (None, pos) while the text may still complete it (not
        ``final``). ``NotACall`` if it breaks the format."""
        rest = text[pos:]
        if not final and could_become(rest, KEY_OPEN, TOOL_CLOSE):
            return None, pos
        if not rest.startswith(KEY_OPEN):
            raise NotACall  # stray text inside the call
        key_end = text.find(KEY_CLOSE, pos)
        if key_end < 0:
            if final:
                raise NotACall
            return None, pos
        key = text[pos + len(KEY_OPEN) : key_end].strip()
        if not key or "<" in key:
            raise NotACall
        value_at = skip_ws(text, key_end + len(KEY_CLOSE))
        if not text.startswith(VALUE_OPEN, value_at):
            if final or not could_become(text[value_at:], VALUE_OPEN):
                raise NotACall  # a key without a value
            return None, pos
        value_end = text.find(VALUE_CLOSE, value_at)
        if value_end < 0:
            if final:
                raise NotACall  # cut inside a value: it may be incomplete
            return None, pos
        value = text[value_at + len(VALUE_OPEN) : value_end]
        return (key, value), value_end + len(VALUE_CLOSE)

    def _parsed(self, name: str, args: list[tuple[str, str]], closed: bool) -> ParsedToolCall:
        props = schema_properties(self.functions, name)
        return ParsedToolCall(name, typed_arguments(args, props, typed_value, closed), closed)
