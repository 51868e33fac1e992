"""Qwen3-Coder's XML calls (vLLM's ``qwen3_coder`` / ``qwen3_xml``)::

    <tool_call>
    <function=run_bash>
    <parameter=command>
    ls -la
    </parameter>
    <parameter=timeout>
    30
    </parameter>
    </function>
    </tool_call>

Any number of calls; the text outside them is the content. A ``<function=...>`` block
without the ``<tool_call>`` wrapper is a call too, as in vLLM.

Parameter values are text: each is typed by its tool's JSON schema (the request's
``tools``), as vLLM does: an ``integer`` parameter's ``"30"`` becomes ``30``, an
``object`` one's JSON (or Python literal) text an object, a ``boolean`` one's
``true``/``false`` a bool; a value that does not convert, and every parameter the schema
does not type, stays a string. One leading and one trailing newline of a value are the
template's layout and are dropped.

Streamed, a call's ``arguments`` JSON grows a whole parameter at a time (a value is typed
only once it is complete): ``{``, ``{"command": "ls -la"``, ..., then ``}`` when the
function closes; each is a prefix of the final text.
"""

from __future__ import annotations

import ast
import json
import math
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from vllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    EMPTY,
    ExtractedToolCalls,
    ParsedToolCall,
    ToolParser,
    json_lark,
    marker_begin,
    marker_lark,
    marker_trigger,
    register_tool_parser,
    text_until,
)
from vllm.entrypoints.openai.tool_parsers.json_scan import skip_ws
from vllm.entrypoints.openai.tool_parsers.tagged_calls import (
    CallOpen,
    NotACall,
    could_become,
    scan_tagged_calls,
    schema_properties,
    typed_arguments,
)

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
FN_OPEN, FN_CLOSE = "<function=", "</function>"
PARAM_OPEN, PARAM_CLOSE = "<parameter=", "</parameter>"


@register_tool_parser("qwen3_coder", "qwen3_xml")
class Qwen3CoderToolParser(ToolParser):
    # The wrapper of a call (Seed-OSS writes the same XML in ``<seed:tool_call>``).
    tool_open: ClassVar[str] = TOOL_OPEN
    tool_close: ClassVar[str] = TOOL_CLOSE

    def extract_tool_calls(self, text: str, final: bool) -> ExtractedToolCalls:
        starts = (self.tool_open, FN_OPEN)
        return scan_tagged_calls(text, final, starts, self.tool_close, self._call)

    @classmethod
    def structural_tag(
        cls,
        schemas: Mapping[str, dict | None],
        special_tokens: Mapping[str, int] = EMPTY,
        single: bool = False,
    ) -> dict | None:
        """The wrapper opens a call: then ``<function=`` one of the tools ``>``, its
        parameters, ``</function>`` and the wrapper's close, laid out as the Qwen3-Coder
        template writes them (a newline after each tag). A tool without a schema takes
        any parameters. A schema held takes its properties in the schema's order, each
        required one once and each other one at most once, and no other name (unless
        ``additionalProperties`` allows them, after the named ones); a value the parser
        reads as text (a string, or a type that includes string, or none) is any text up
        to ``</parameter>`` (one of its literals for an enum of strings), any other JSON
        valid against the property's schema. A marker that is a special token of the
        tokenizer is matched as the token, else as text; the arguments are not JSON, so
        the tag carries its own Lark (``structural_tag_grammar``'s ``lark``/``rules``)."""
        value_rule, value = text_until("XML_VALUE", PARAM_CLOSE, special_tokens)
        value = f'{value} "\\n"'
        close = marker_lark(cls.tool_close, special_tokens)

        def params(schema: dict | None) -> str:
            return keyed_parameters_lark(
                schema,
                lambda key, text: json.dumps(f"{PARAM_OPEN}{key}>\n"),
                value,
                lambda expr: f'{expr} "\\n{PARAM_CLOSE}\\n"',
                "xml_any*",
            )

        return {
            "triggers": [marker_trigger(cls.tool_open, special_tokens)],
            "rules": [
                value_rule,
                "XML_KEY: /[^<>\\n]+/",
                f'xml_any: "{PARAM_OPEN}" XML_KEY ">\\n" {value}',
            ],
            "structures": [
                {
                    "begin": marker_begin(cls.tool_open, special_tokens),
                    "lark": f'{_function(name)} {params(schema)} "{FN_CLOSE}\\n" {close}',
                    "end": "",
                }
                for name, schema in schemas.items()
            ],
        }

    def _call(self, text: str, start: int, final: bool) -> tuple[ParsedToolCall, int]:
        """The call starting at ``start`` and where it ends. Raises ``CallOpen`` (with the
        call so far, or None before its name is complete) when the text ends inside it and
        more may come, ``NotACall`` when it is not one."""
        wrapped = text.startswith(self.tool_open, start)
        pos = skip_ws(text, start + len(self.tool_open)) if wrapped else start
        if not text.startswith(FN_OPEN, pos):
            if could_become(text[pos:], FN_OPEN) and not final:
                raise CallOpen(None)
            raise NotACall
        name_end = text.find(">", pos + len(FN_OPEN))
        if name_end < 0:
            if final:
                raise NotACall
            raise CallOpen(None)
        name = text[pos + len(FN_OPEN) : name_end].strip()
        if not name or "\n" in name or "<" in name:
            raise NotACall
        params: list[tuple[str, str]] = []
        pos = name_end + 1
        while True:
            pos = skip_ws(text, pos)
            if text.startswith(FN_CLOSE, pos):
                end = pos + len(FN_CLOSE)
                break
            if text.startswith(PARAM_OPEN, pos):
                param, pos = self._param(text, pos, final)
                if param is None:
                    raise CallOpen(self._parsed(name, params, closed=False))
                params.append(param)
                continue
            if pos >= len(text) or could_become(text[pos:], FN_CLOSE, PARAM_OPEN):
                if final:  # cut at a parameter's end (a stop string): the call holds
                    return self._parsed(name, params, closed=True), len(text)
                raise CallOpen(self._parsed(name, params, closed=False))
            raise NotACall  # stray text inside the function
        if wrapped:
            after = skip_ws(text, end)
            if text.startswith(self.tool_close, after):
                end = after + len(self.tool_close)
            elif not final and could_become(text[after:], self.tool_close):
                raise CallOpen(self._parsed(name, params, closed=True))
        return self._parsed(name, params, closed=True), end

    @staticmethod
    def _param(text: str, pos: int, final: bool) -> tuple[tuple[str, str] | None, int]:
        """The parameter opening at ``pos`` and the position after it; None while its
        value is not complete. A value ends at ``</parameter>``, or at the next
        parameter or the function's end when the model left it open."""
        key_end = text.find(">", pos + len(PARAM_OPEN))
        if key_end < 0:
            if final:
                raise NotACall
            return None, pos
        key = text[pos + len(PARAM_OPEN) : key_end].strip()
        if not key or "\n" in key or "<" in key:
            raise NotACall
        start = key_end + 1
        ends = [
            (at, len(tag))
            for tag in (PARAM_CLOSE, PARAM_OPEN, FN_CLOSE)
            if (at := text.find(tag, start)) >= 0
        ]
        if not ends:
            if final:
                raise NotACall  # cut inside a value: it may be incomplete
            return None, pos
        at, size = min(ends)
        after = at + size if text.startswith(PARAM_CLOSE, at) else at
        value = text[start:at]
        if value.startswith("\n"):
            value = value[1:]
        if value.endswith("\n"):
            value = value[:-1]
        return (key, value), after

    def _parsed(self, name: str, params: list[tuple[str, str]], closed: bool) -> ParsedToolCall:
        """The call with its arguments as JSON text: each parameter typed by the tool's
        schema, the first of a repeated name kept."""
        props = schema_properties(self.functions, name)
        return ParsedToolCall(name, typed_arguments(params, props, typed_value, closed), closed)


def _function(name: str) -> str:
    """The Lark of a call's function line, after its wrapper's open."""
    return json.dumps(f"\n{FN_OPEN}{name}>\n")


def keyed_parameters_lark(
    schema: dict | None,
    opening: Callable[[str, bool], str],
    text_value: str,
    closed: Callable[[str], str],
    any_params: str,
) -> str:
    """The Lark expression of a call's parameters written as tagged key/value pairs
    (Qwen3-Coder's, GLM's, MiniMax-M2's, DeepSeek-V3.2's): ``any_params`` for no schema
    or one not of an object; else the schema's properties in its order, each required one
    once and each other one at most once, no other name (``any_params`` after them where
    ``additionalProperties`` allows more). ``opening(key, text)``: a parameter's tags
    before its value (``text``: the value is text). A value the parsers keep as text (a
    string, a type list with string, no type) is ``text_value``, which closes it; one of
    an enum of strings, one of its literals; any other, JSON valid against its schema,
    which the parsers type back (``typed_value``). ``closed(expr)``: ``expr`` and the
    parameter's close."""
    props = schema.get("properties", {}) if isinstance(schema, dict) else None
    if not isinstance(props, dict) or schema.get("type", "object") != "object":
        return any_params
    required = set(schema.get("required") or ())
    defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
    items = []
    for key, prop in props.items():
        types = _types(prop)
        enum = prop.get("enum") if isinstance(prop, dict) else None
        if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
            value = closed("(" + " | ".join(json.dumps(v) for v in enum) + ")")
            item = f"{opening(key, True)} {value}"
        elif not types or "string" in types or not isinstance(prop, dict):
            item = f"{opening(key, True)} {text_value}"
        else:
            item = f"{opening(key, False)} {closed(json_lark({**prop, **defs}))}"
        items.append(f"({item})" if key in required else f"({item})?")
    if schema.get("additionalProperties") not in (None, False):
        items.append(any_params)
    return " ".join(items)


def _types(schema: Any) -> set[str]:
    """The JSON types a schema allows (``type``, a list of them, ``anyOf``/``oneOf``
    members, ``enum`` values); empty: any (the value stays a string)."""
    if not isinstance(schema, dict):
        return set()
    kind = schema.get("type")
    types = {kind} if isinstance(kind, str) else set(kind) if isinstance(kind, list) else set()
    for key in ("anyOf", "oneOf"):
        for member in schema.get(key) or []:
            types |= _types(member)
    names = {bool: "boolean", int: "integer", float: "number", str: "string", type(None): "null"}
    for value in schema.get("enum") or []:
        types.add(names.get(type(value), "string"))
    return {t for t in types if isinstance(t, str)}


def typed_value(raw: str, schema: Any) -> Any:
    """``raw`` converted to the first non-string type of ``schema`` it parses as
    (null, boolean, integer, number, object, array), else the string itself."""
    types = _types(schema)
    text = raw.strip()
    for kind in ("null", "boolean", "integer", "number", "object", "array"):
        if kind not in types:
            continue
        converted = _convert(text, kind)
        if converted is not _FAILED:
            return converted
    return raw


_FAILED = object()


def _convert(text: str, kind: str) -> Any:
    lowered = text.lower()
    if kind == "null":
        return None if lowered in ("null", "none") else _FAILED
    if kind == "boolean":
        return {"true": True, "false": False}.get(lowered, _FAILED)
    if kind in ("integer", "number"):
        try:
            return int(text)
        except ValueError:
            pass
        if kind == "integer":
            return _FAILED
        try:
            number = float(text)
        except ValueError:
            return _FAILED
        if not math.isfinite(number):
            return _FAILED
        return int(number) if number.is_integer() else number
    wanted = dict if kind == "object" else list
    for parse in (json.loads, ast.literal_eval):  # JSON, else a Python literal
        try:
            value = parse(text)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
        if isinstance(value, wanted):
            try:
                json.dumps(value)  # a Python literal may hold what JSON cannot
            except (TypeError, ValueError, RecursionError):
                return _FAILED
            return value
    return _FAILED
