"""Pythonic calls (vLLM's ``pythonic``), as models trained to answer with a Python list
of calls write them (ToolACE-8B; Llama 3.2 1B/3B under a chat template that asks for this
format, as vLLM's example template does)::

    [get_weather(city="Tokyo", days=3), bash(command="ls -la")]

The whole output is a Python list of calls with keyword arguments whose values are
literals (strings, numbers, booleans, None, lists, dicts; JSON's ``true``, ``false``
and ``null`` too, as vLLM reads them); they become the calls' JSON arguments. Output
that is not such a list is content, whole.

Streamed, a call appears once its name is written (arguments empty) and gets all its
arguments when its closing parenthesis comes: a call's JSON is only known whole.
"""

from __future__ import annotations

import ast
import json
import re

from vllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ExtractedToolCalls,
    ParsedToolCall,
    ToolParser,
    register_tool_parser,
)

_NAME = re.compile(r"\s*([A-Za-z_][\w.]*)\s*\(")


class _NotCalls(ValueError):
    """The text is not a list of calls."""


def _elements(text: str, start: int) -> tuple[list[str], str | None, bool]:
    """The list opening at ``start`` split at its top level: its complete elements, the
    one still open (None if none), and whether the list closed (and nothing follows)."""
    elements, depth, quote, i = [], 0, "", start + 1
    begin = i
    while i < len(text):
        c = text[i]
        if quote:
            if c == "\\":
                i += 2
                continue
            if text.startswith(quote, i):
                i += len(quote)
                quote = ""
                continue
        elif c in "'\"":
            quote = c * 3 if text.startswith(c * 3, i) else c
            i += len(quote)
            continue
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            if depth == 0:
                if c != "]":
                    raise _NotCalls
                last = text[begin:i]
                if last.strip():
                    elements.append(last)
                if text[i + 1 :].strip():
                    raise _NotCalls  # text after the list
                return elements, None, True
            depth -= 1
        elif c == "," and depth == 0:
            elements.append(text[begin:i])
            begin = i + 1
        i += 1
    rest = text[begin:]
    return elements, rest if rest.strip() else None, False


# Names some models write for JSON's literals (vLLM reads them as these values too).
_JSON_NAMES = {"true": True, "false": False, "null": None}


class _JsonNames(ast.NodeTransformer):
    def visit_Name(self, node: ast.Name) -> ast.AST:
        if node.id in _JSON_NAMES:
            return ast.copy_location(ast.Constant(_JSON_NAMES[node.id]), node)
        return node


def parse_call(element: str) -> ParsedToolCall:
    """A complete call ``name(key=literal, ...)`` (literals as Python writes them, or
    JSON's ``true``/``false``/``null``); ``ValueError`` (``_NotCalls``) if it is not one."""
    try:
        node = ast.parse(element.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise _NotCalls from None
    if not isinstance(node, ast.Call) or node.args:
        raise _NotCalls
    name = _dotted(node.func)
    arguments = {}
    for keyword in node.keywords:
        if keyword.arg is None:  # **kwargs
            raise _NotCalls
        try:
            arguments[keyword.arg] = ast.literal_eval(_JsonNames().visit(keyword.value))
        except (ValueError, SyntaxError, TypeError, RecursionError, MemoryError):
            raise _NotCalls from None
    try:
        text = json.dumps(arguments, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):  # a set, bytes, a complex number
        raise _NotCalls from None
    return ParsedToolCall(name, text, True)


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    raise _NotCalls


@register_tool_parser("pythonic")
class PythonicToolParser(ToolParser):
    def extract_tool_calls(self, text: str, final: bool) -> ExtractedToolCalls:
        body = text.strip()
        if not body.startswith("["):
            return ExtractedToolCalls(text.strip() or (None if final else ""), [])
        try:
            elements, open_element, closed = _elements(body, 0)
            calls = [parse_call(e) for e in elements]
            if final:
                if not closed or not calls:
                    raise _NotCalls
                return ExtractedToolCalls(None, calls)
            if open_element is not None:
                match = _NAME.match(open_element)
                if match is not None:
                    calls.append(ParsedToolCall(match[1], "", False))
        except _NotCalls:
            if final:
                return ExtractedToolCalls(text.strip() or None, [])
            return ExtractedToolCalls("", [])  # held back until the output ends
        return ExtractedToolCalls("", calls)
