"""Plain JSON calls: the whole output is a call object, several joined by ``;``, or a
list of them (Llama 3's JSON format, and what guided decoding produces for
``tool_choice`` "required" / a named function)."""

from __future__ import annotations

import json
from collections.abc import Mapping

from vllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ANY_OBJECT,
    EMPTY,
    ExtractedToolCalls,
    ParsedToolCall,
    ToolParser,
    call_at,
    is_valid_call,
    register_tool_parser,
)
from vllm.entrypoints.openai.tool_parsers.json_scan import Malformed, skip_ws

PYTHON_TAG = "<|python_tag|>"  # Llama 3.1 may open its calls with it


@register_tool_parser("json", "llama3_json", "llama4_json")
class JsonToolParser(ToolParser):
    """Output that does not start with ``{`` or ``[`` is content; output that does but is
    not a valid list of calls is content too (returned whole at the end). ``PREFIXES``:
    tags a model may write before its calls."""

    PREFIXES: tuple[str, ...] = (PYTHON_TAG,)

    def extract_tool_calls(self, text: str, final: bool) -> ExtractedToolCalls:
        start = skip_ws(text, 0)
        for prefix in self.PREFIXES:
            if text.startswith(prefix, start):
                start = skip_ws(text, start + len(prefix))
                break
        if start >= len(text) or text[start] not in "[{":
            if not final and any(p.startswith(text[start:]) for p in self.PREFIXES):
                return ExtractedToolCalls("", [])  # maybe the tag, maybe a call
            content = text.strip()
            return ExtractedToolCalls(content or (None if final else ""), [])
        try:
            calls, end = self._calls(text, start, final)
        except ValueError:  # Malformed, or a key json cannot decode
            calls, end = [], None
        if not final:
            return ExtractedToolCalls("", calls)
        if end is None or text[end:].strip() or not calls:
            return ExtractedToolCalls(text.strip() or None, [])
        return ExtractedToolCalls(None, calls)

    @classmethod
    def structural_tag(
        cls,
        schemas: Mapping[str, dict | None],
        special_tokens: Mapping[str, int] = EMPTY,
        single: bool = False,
    ) -> dict | None:
        """``{"name"`` opens a call: then one of the tools and ``"parameters":`` with
        arguments valid against its schema, as Llama 3's JSON template asks
        (``{"name": function name, "parameters": dictionary of argument name and its
        value}``). Several calls are joined by ``; `` in the free text between them."""
        return {
            "triggers": ['{"name"'],
            "structures": [
                {
                    "begin": f'{{"name": {json.dumps(name)}, "parameters": ',
                    "schema": ANY_OBJECT if schema is None else schema,
                    "end": "}",
                }
                for name, schema in schemas.items()
            ],
        }

    @staticmethod
    def _calls(text: str, i: int, final: bool) -> tuple[list[ParsedToolCall], int | None]:
        """The calls from ``i`` and the end of the last one (None if the text is cut)."""
        in_list = text[i] == "["
        if in_list:
            i = skip_ws(text, i + 1)
            if i < len(text) and text[i] == "]":
                return [], i + 1
        calls = []
        while i < len(text):
            if text[i] != "{":
                raise Malformed(f"expected a call object at {i}")
            call, end = call_at(text, i)
            calls.append(call)
            if end is None:
                return calls, None
            if final and not is_valid_call(text[i:end]):
                raise Malformed(f"invalid call at {i}")
            i = skip_ws(text, end)
            if i >= len(text):
                return calls, None if in_list else end
            if in_list and text[i] == "]":
                return calls, i + 1
            if text[i] not in ("," if in_list else ",;"):
                raise Malformed(f"unexpected {text[i]!r} at {i}")
            i = skip_ws(text, i + 1)
        return calls, None


@register_tool_parser("granite")
class GraniteToolParser(JsonToolParser):
    """IBM Granite 3.x: a JSON list of calls after ``<|tool_call|>`` (3.0) or
    ``<tool_call>`` (3.1 and later); the tag is optional (a special token the
    detokenizer may have dropped)."""

    PREFIXES = ("<|tool_call|>", "<tool_call>")

    # None: its calls are a JSON list, not Llama's one object a call.
    structural_tag = ToolParser.__dict__["structural_tag"]
