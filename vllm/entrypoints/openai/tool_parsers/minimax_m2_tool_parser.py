"""MiniMax-M2's calls (vLLM's ``minimax_m2``; M2.1 and M2.5 write the same)::

    <minimax:tool_call>
    <invoke name="get_weather">
    <parameter name="location">San Francisco, CA</parameter>
    <parameter name="unit">celsius</parameter>
    </invoke>
    <invoke name="...">...</invoke>
    </minimax:tool_call>

A block holds one or more calls; the text outside the blocks is the content (vLLM keeps
only the text before the first block). An ``<invoke>`` outside a block is text, as in
vLLM, and so is text in a block that is no tag (skipped, as vLLM's regexes skip it).
Names (the function's, a parameter's) may be quoted or not and are stripped; a value is
stripped of surrounding whitespace, as vLLM strips it.

Values are text, typed by the tool's JSON schema (the request's ``tools``) as vLLM's
``minimax_m2`` types them (``minimax_value``): the schema's types (``type``, a list of
them, ``anyOf``/``oneOf``, ``enum`` values; vLLM's ``int``/``float``/``bool``/``str``
too) are tried in the order integer, number, boolean, object, array, string; a whole
number becomes an integer, a boolean is ``true``/``1``/``yes``/``on`` or
``false``/``0``/``no``/``off`` (any case), an object or array is JSON text. A value that
none of them takes is read as JSON if it is JSON, else kept as the string: ``"abc"`` for
an integer stays ``"abc"``, ``"3.5"`` becomes 3.5. ``null``/``none``/``nil`` become null.
A parameter the schema does not name, every parameter of a tool the request does not
have, and one whose schema gives no type, stays a string (the null words aside).

Where this differs from vLLM: a parameter typed string and not null keeps ``"none"`` as
a string (vLLM makes CSS's ``none`` null); an object or array type takes only a JSON
object or array, so ``"123"`` for ``object | string`` stays a string (vLLM: 123); a NaN
or infinite number is no number (vLLM fails on ``inf``); a key given twice keeps its
first value (vLLM its last), so that a streamed prefix stays a prefix.

A block that holds no call, a call without a name or with a parameter without one, and a
call cut inside its name or a value are content; a call cut after a whole parameter (a
stop string) holds, as in the other XML parsers here, and so does an invoke the model
left open at its block's end.

The markers are added tokens in MiniMax's vocabulary, possibly special, so these requests
keep special tokens in their text. Streamed, a call appears once its name is complete,
its ``arguments`` JSON grows a whole parameter at a time, ``}`` when the invoke closes;
each is a prefix of the final text.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from vllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    EMPTY,
    ExtractedToolCalls,
    ParsedToolCall,
    ToolParser,
    marker_lark,
    register_tool_parser,
    text_until,
)
from vllm.entrypoints.openai.tool_parsers.qwen3coder_tool_parser import (
    _types,
    keyed_parameters_lark,
)
from vllm.entrypoints.openai.tool_parsers.tagged_calls import (
    CallOpen,
    NotACall,
    scan_tagged_calls,
    schema_properties,
    section_tag,
    typed_arguments,
)

TOOL_OPEN, TOOL_CLOSE = "<minimax:tool_call>", "</minimax:tool_call>"
INVOKE_OPEN, INVOKE_CLOSE = "<invoke name=", "</invoke>"
PARAM_OPEN, PARAM_CLOSE = "<parameter name=", "</parameter>"


@register_tool_parser("minimax_m2")
class MinimaxM2ToolParser(ToolParser):
    """The reader of ``<invoke>`` blocks; a subclass with other markers (DeepSeek-V3.2's
    DSML, ``deepseek_v32_tool_parser.py``) names its own tags and reads its own
    parameters (``_param``) and values (``_parsed``)."""

    keeps_special_tokens = True
    tool_open, tool_close = TOOL_OPEN, TOOL_CLOSE
    invoke_open, invoke_close = INVOKE_OPEN, INVOKE_CLOSE
    param_open, param_close = PARAM_OPEN, PARAM_CLOSE

    def extract_tool_calls(self, text: str, final: bool) -> ExtractedToolCalls:
        return scan_tagged_calls(text, final, (self.tool_open,), self.tool_close, self._block)

    @classmethod
    def structural_tag(
        cls,
        schemas: Mapping[str, dict | None],
        special_tokens: Mapping[str, int] = EMPTY,
        single: bool = False,
    ) -> dict | None:
        """The block's open marker opens the calls: then one ``<invoke name="...">`` of
        one of the tools (``single``) or more, each with its parameters
        (``keyed_parameters_lark``: a held schema's properties in order, typed values as
        JSON) and ``</invoke>``, whitespace between them, and the block's close. The
        names are written quoted; a newline is allowed after each tag. Markers that are
        special tokens of the tokenizer are matched as the tokens."""
        param_open = marker_lark(cls.param_open, special_tokens)
        param_close = marker_lark(cls.param_close, special_tokens)
        value_rule, value = text_until("MM_VALUE", cls.param_close, special_tokens)
        value = f'{value} "\\n"?'
        invoke_open = marker_lark(cls.invoke_open, special_tokens)
        invoke_close = marker_lark(cls.invoke_close, special_tokens)

        def call(name: str, schema: dict | None) -> str:
            params = keyed_parameters_lark(
                schema,
                lambda key, text: f"{param_open} {json.dumps(cls.param_header(key, text))}",
                value,
                lambda expr: f'{expr} {param_close} "\\n"?',
                "mm_any*",
            )
            name_lark = json.dumps(f'"{name}">')
            return f'({invoke_open} {name_lark} "\\n"? {params} {invoke_close})'

        calls = [call(name, schema) for name, schema in schemas.items()]
        rules = (
            value_rule,
            "MM_HEADER: /[^<>\\n]+/",
            f'mm_any: {param_open} MM_HEADER ">" {value}',
        )
        return section_tag(cls.tool_open, cls.tool_close, calls, rules, special_tokens, single)

    @staticmethod
    def param_header(key: str, text: bool) -> str:
        """A parameter's header after ``param_open``, up to its value (``text``: the
        value is text, not JSON)."""
        return f'"{key}">'

    def _block(self, text: str, start: int, final: bool) -> tuple[list[ParsedToolCall], int]:
        """The calls of the block opening at ``start`` and where it ends. Raises
        ``CallOpen`` (with the block's calls so far) while the text may go on inside it,
        ``NotACall`` when it holds no call."""
        calls: list[ParsedToolCall] = []
        pos = start + len(self.tool_open)
        while True:
            at = _next_tag(text, pos, (self.tool_close, self.invoke_open))  # text between: skipped
            if at < 0 and not final:
                raise CallOpen(calls)
            if not calls and (at < 0 or text.startswith(self.tool_close, at)):
                raise NotACall  # an empty block, or one cut before its first call
            if at < 0:
                return calls, len(text)  # cut after a whole call (a stop string)
            if text.startswith(self.tool_close, at):
                return calls, at + len(self.tool_close)
            call, pos = self._invoke(text, at, final)
            if call is not None:
                calls.append(call)
            if pos is None:
                raise CallOpen(calls)

    def _invoke(self, text: str, pos: int, final: bool) -> tuple[ParsedToolCall | None, int | None]:
        """The call whose ``<invoke name=`` is at ``pos`` and where it ends (past its
        ``</invoke>``, or at the block's end where the model left it open); the end is None
        while the text may go on inside it (the call then None until its name is
        complete)."""
        name_end = text.find(">", pos + len(self.invoke_open))
        if name_end < 0:
            if final:
                raise NotACall
            return None, None
        name = _unquoted(text[pos + len(self.invoke_open) : name_end])
        params: list[tuple[str, Any]] = []
        pos = name_end + 1
        while True:
            at = _next_tag(text, pos, (self.invoke_close, self.param_open, self.tool_close))
            if at < 0:
                if final:  # cut after a whole parameter (a stop string): the call holds
                    return self._parsed(name, params, closed=True), len(text)
                return self._parsed(name, params, closed=False), None
            if text.startswith(self.invoke_close, at):
                return self._parsed(name, params, closed=True), at + len(self.invoke_close)
            if text.startswith(self.tool_close, at):
                return self._parsed(name, params, closed=True), at
            param, pos = self._param(text, at, final)
            if param is None:
                return self._parsed(name, params, closed=False), None
            params.append(param)

    def _param(self, text: str, pos: int, final: bool) -> tuple[tuple[str, Any] | None, int]:
        """The parameter opening at ``pos`` (its name and stripped value) and the position
        after it; None while its value is not complete."""
        key_end = text.find(">", pos + len(self.param_open))
        if key_end < 0:
            if final:
                raise NotACall
            return None, pos
        key = _unquoted(text[pos + len(self.param_open) : key_end])
        value_end = text.find(self.param_close, key_end + 1)
        if value_end < 0:
            if final:
                raise NotACall  # cut inside a value: it may be incomplete
            return None, pos
        return (key, text[key_end + 1 : value_end].strip()), value_end + len(self.param_close)

    def _parsed(self, name: str, params: list[tuple[str, Any]], closed: bool) -> ParsedToolCall:
        props = schema_properties(self.functions, name)
        arguments = typed_arguments(params, props, minimax_value, closed)
        return ParsedToolCall(name, arguments, closed)


def _next_tag(text: str, pos: int, tags: tuple[str, ...]) -> int:
    """Where the first of ``tags`` at or after ``pos`` is (-1: none yet). The text before
    it is skipped, as vLLM's reading skips what is not a tag it looks for."""
    found = [at for tag in tags if (at := text.find(tag, pos)) >= 0]
    return min(found, default=-1)


def _unquoted(raw: str) -> str:
    """A name as written after ``name=``: stripped, and out of its quotes. ``NotACall``
    when there is none, or it cannot be one (a newline, a tag inside)."""
    name = raw.strip()
    if len(name) >= 2 and name[0] == name[-1] and name[0] in "\"'":
        name = name[1:-1].strip()
    if not name or "\n" in name or "<" in name:
        raise NotACall
    return name


# -- values ---------------------------------------------------------------------------------
_NULL_WORDS = ("null", "none", "nil")
# The order vLLM tries a schema's types in; the names it takes besides JSON Schema's.
_ORDER = ("integer", "number", "boolean", "object", "array", "string")
_ALIASES = {
    "int": "integer",
    "float": "number",
    "bool": "boolean",
    "str": "string",
    "text": "string",
}
_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")
_FAILED = object()


def minimax_value(raw: str, schema: Any) -> Any:
    """``raw`` (a stripped value) as vLLM's ``minimax_m2`` types it by its parameter's
    ``schema`` (None: the schema does not name it); see the module's docstring."""
    declared = {_ALIASES.get(t.lower(), t.lower()) for t in _types(schema)}
    if raw.lower() in _NULL_WORDS and ("null" in declared or "string" not in declared):
        return None
    for kind in _ORDER:
        if kind not in (declared or {"string"}):
            continue
        if kind == "string":
            return raw
        value = _convert(raw, kind)
        if value is not _FAILED:
            return value
    value = _json(raw)
    return raw if value is _FAILED else value


def _convert(raw: str, kind: str) -> Any:
    if kind == "integer":
        try:
            return int(raw)
        except ValueError:
            return _FAILED
    if kind == "number":
        try:
            number = float(raw)
        except ValueError:
            return _FAILED
        if not math.isfinite(number):
            return _FAILED
        return int(number) if number.is_integer() else number
    if kind == "boolean":
        lowered = raw.lower()
        return True if lowered in _TRUE else False if lowered in _FALSE else _FAILED
    value = _json(raw)
    return value if isinstance(value, dict if kind == "object" else list) else _FAILED


def finite_number(text: str) -> float:
    number = float(text)
    if not math.isfinite(number):  # NaN, the infinities, 1e400: JSON cannot hold them
        raise ValueError(f"{text} is not a finite number")
    return number


def _json(raw: str) -> Any:
    """``raw`` as JSON, its numbers finite."""
    try:
        return json.loads(raw, parse_float=finite_number, parse_constant=finite_number)
    except (ValueError, RecursionError):  # RecursionError: nested past the stack
        return _FAILED
