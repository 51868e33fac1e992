"""Mistral's calls (Mistral-Small, Devstral, Magistral, Ministral, Mixtral-Instruct v0.3):
content, then ``[TOOL_CALLS]`` and the calls, in one of two forms:

    [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]        tokenizers before v11
    [TOOL_CALLS]f[ARGS]{...}[TOOL_CALLS]g[ARGS]{...}             v11 and later

``[TOOL_CALLS]`` and ``[ARGS]`` are special tokens, so requests read by this parser keep
special tokens in their text (``keeps_special_tokens``, as vLLM sets
``skip_special_tokens=False`` for them). Mistral's chat templates accept only 9-character
alphanumeric call ids in the history sent back, so this parser's calls get such ids
(``new_call_id``). With ``[CALL_ID]id`` between a name and ``[ARGS]`` (a model writing
its own ids), the id is skipped.
"""

from __future__ import annotations

import json
import random
import string
from collections.abc import Mapping

from vllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ANY_OBJECT,
    EMPTY,
    ExtractedToolCalls,
    ParsedToolCall,
    ToolParser,
    held_back,
    json_lark,
    marker_lark,
    marker_trigger,
    register_tool_parser,
)
from vllm.entrypoints.openai.tool_parsers.json_scan import Malformed, scan_object, skip_ws
from vllm.entrypoints.openai.tool_parsers.json_tool_parser import JsonToolParser

BOT, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_ID_CHARS = string.ascii_letters + string.digits
_rng = random.SystemRandom()


@register_tool_parser("mistral")
class MistralToolParser(ToolParser):
    keeps_special_tokens = True

    @staticmethod
    def new_call_id() -> str:
        return "".join(_rng.choice(_ID_CHARS) for _ in range(9))

    @classmethod
    def structural_tag(
        cls,
        schemas: Mapping[str, dict | None],
        special_tokens: Mapping[str, int] = EMPTY,
        single: bool = False,
    ) -> dict | None:
        """The v11 form (a tokenizer with the ``[ARGS]`` token): ``[TOOL_CALLS]`` opens a
        call, then one of the tools' names, ``[ARGS]`` and arguments valid against its
        schema; the markers are matched as the tokens they are. Older tokenizers' JSON
        list has no tag here (``tool_choice`` "auto" stays unconstrained with them)."""
        if ARGS not in special_tokens:
            return None
        trigger = marker_trigger(BOT, special_tokens)
        args = marker_lark(ARGS, special_tokens)
        return {
            "triggers": [trigger],
            "structures": [
                {
                    "begin": trigger,
                    "lark": f"{json.dumps(name)} {args} {json_lark(schema or ANY_OBJECT)}",
                    "end": "",
                }
                for name, schema in schemas.items()
            ],
        }

    def extract_tool_calls(self, text: str, final: bool) -> ExtractedToolCalls:
        start = text.find(BOT)
        if start < 0:
            content = text if final else text[: len(text) - held_back(text, BOT)]
            content = content.strip()
            return ExtractedToolCalls(content or (None if final else ""), [])
        content = text[:start].strip()
        body = text[start + len(BOT) :]
        try:
            if body.lstrip().startswith("["):  # the JSON list of the older tokenizers
                calls, end = JsonToolParser._calls(body, skip_ws(body, 0), final)
                complete = end is not None and not body[end:].strip()
            else:
                calls, complete = self._named_calls(body, final)
        except (Malformed, ValueError):
            calls, complete = [], False
        if final and (not complete or not calls):
            return ExtractedToolCalls(text.strip() or None, [])  # not calls after all
        return ExtractedToolCalls(content or (None if final else ""), calls)

    @staticmethod
    def _named_calls(body: str, final: bool) -> tuple[list[ParsedToolCall], bool]:
        """``name[ARGS]{...}`` segments split by ``[TOOL_CALLS]``: the calls, and whether
        the text holds them all whole (``final``: each arguments a JSON object)."""
        calls = []
        for segment in body.split(BOT):
            name, sep, rest = segment.partition(ARGS)
            name = name.partition(CALL_ID)[0].strip()
            if not sep:  # the name so far; no arguments yet
                if final:
                    return calls, False
                break
            i = skip_ws(rest, 0)
            if i >= len(rest):
                calls.append(ParsedToolCall(name, "", False))
                break
            if rest[i] != "{":
                raise Malformed("arguments must be a JSON object")
            scan = scan_object(rest, i)
            if scan.end is None:
                calls.append(ParsedToolCall(name, rest[i:], False))
                if final:
                    return calls, False
                break
            args = rest[i : scan.end]
            if rest[scan.end :].strip():
                raise Malformed("text after the arguments")
            if final:
                json.loads(args)  # ValueError: not JSON after all
            calls.append(ParsedToolCall(name, args, True))
        return calls, all(c.complete and c.name for c in calls)
