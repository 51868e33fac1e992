"""The structural tag's "format" form (xgrammar's, which vLLM hands to xgrammar and its
examples send as ``response_format={"type": "structural_tag", "format": {...}}``),
compiled to the Lark of llguidance, the grammar engine here.

A format is a tree of nodes, each an object with a ``type``:

- ``const_string`` (``value``): that text.
- ``json_schema`` (``json_schema``, ``style`` "json"): JSON valid against the schema, made
  strict as every schema here (``json_lark``).
- ``regex`` (``pattern``): text the regular expression matches.
- ``any_text`` (``excludes``: strings it may not contain): free text. In a ``tag``, it
  runs to the tag's first ``end`` (one lexeme: a greedy lexer cannot split it wrongly).
- ``sequence`` / ``or`` (``elements``): each in turn / one of them.
- ``tag`` (``begin``, ``content``, ``end``: a string or a list of them): begin, the content,
  one of the ends. ``begin`` may be a ``token`` node (``{"type": "token", "token": id or
  "<name>"}``), matched as that special token.
- ``triggered_tags`` (``triggers``, ``tags``, ``at_least_one``, ``stop_after_first``,
  ``excludes``): free text in which a trigger opens the tag whose ``begin`` starts with
  it; then free text again, any number of times. ``at_least_one``: the output opens with a
  tag; ``stop_after_first``: it ends after the first.
- ``tags_with_separator`` (``tags``, ``separator``, ``at_least_one``,
  ``stop_after_first``): tags apart by the separator and nothing else; none at all
  unless ``at_least_one``, one only with ``stop_after_first``.
- ``optional``, ``star``, ``plus`` (``content``) and ``repeat`` (``content``, ``min``,
  ``max``; -1 for no bound): the content that many times.

xgrammar's other types (``grammar``: its EBNF dialect; the token-level ``token_*``,
``exclude_token``, ``any_tokens`` and ``dispatch``) and ``json_schema`` styles other than
"json" are refused, naming the type: this engine's grammars are Lark
(``structured_outputs.grammar``). Every error is a ``VLLMValidationError`` naming
``structured_outputs`` and the node's path (``format.tags[1].content``).
"""

from __future__ import annotations

import json
from typing import Any

from vllm.exceptions import VLLMValidationError

MAX_FORMAT_NODES = 4096
"""Most nodes in one format (each a rule or a few in the Lark)."""
MAX_FORMAT_DEPTH = 32
"""Deepest nesting of nodes (llguidance compiles rule chains recursively)."""

_KEYS = {
    "const_string": {"value"},
    "json_schema": {"json_schema", "style"},
    "regex": {"pattern"},
    "any_text": {"excludes"},
    "sequence": {"elements"},
    "or": {"elements"},
    "tag": {"begin", "content", "end"},
    "triggered_tags": {"triggers", "tags", "at_least_one", "stop_after_first", "excludes"},
    "tags_with_separator": {"tags", "separator", "at_least_one", "stop_after_first"},
    "optional": {"content"},
    "star": {"content"},
    "plus": {"content"},
    "repeat": {"content", "min", "max"},
}
_REFUSED = {
    "grammar": "its EBNF dialect is xgrammar's; give a Lark grammar as structured_outputs.grammar",
    "token_triggered_tags": "token-level dispatch is not supported",
    "exclude_token": "token-level formats are not supported",
    "any_tokens": "token-level formats are not supported",
    "dispatch": "not supported",
    "token_dispatch": "not supported",
}
_TEXT = "/(.|\\n)*/"


def _bad(path: str, why: str) -> VLLMValidationError:
    return VLLMValidationError(f"structural_tag {path} {why}", "structured_outputs")


def _regex_literal(text: str) -> str:
    from vllm.v1.structured_output.grammar import regex_literal

    return regex_literal(text)


def _lark_regex(pattern: str) -> str:
    """``pattern`` inside Lark's ``/.../``: its unescaped slashes escaped."""
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            out.append(pattern[i : i + 2])
            i += 2
            continue
        out.append("\\/" if c == "/" else c)
        i += 1
    return "/" + "".join(out) + "/"


def _excluding(excludes: list[str]) -> str:
    """A terminal body: any text holding none of ``excludes``."""
    if not excludes:
        return _TEXT
    banned = "|".join(_regex_literal(e) for e in excludes)
    return f"{_TEXT} & ~/(.|\\n)*({banned})(.|\\n)*/"


class _Compiler:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.count = 0

    def name(self, kind: str) -> str:
        self.count += 1
        return f"fmt{self.count}_{kind}"

    def terminal(self, body: str) -> str:
        name = self.name("text").upper()
        self.lines.append(f"{name}: {body}")
        return name

    def node(self, fmt: Any, path: str, depth: int) -> str:
        """The Lark expression of ``fmt`` ("" for nothing)."""
        if depth > MAX_FORMAT_DEPTH:
            raise _bad(path, f"nests deeper than {MAX_FORMAT_DEPTH}")
        if self.count > MAX_FORMAT_NODES:
            raise _bad(path, f"has more than {MAX_FORMAT_NODES} nodes")
        if not isinstance(fmt, dict):
            raise _bad(path, "must be an object with a type")
        kind = fmt.get("type")
        if kind in _REFUSED:
            raise _bad(path, f'of type "{kind}": {_REFUSED[kind]}')
        if kind not in _KEYS:
            raise _bad(path, f"has an unknown type {json.dumps(kind)[:40]}")
        extra = set(fmt) - _KEYS[kind] - {"type"}
        if extra:
            raise _bad(path, f'of type "{kind}" has unknown keys {sorted(extra)}')
        self.count += 1
        return getattr(self, "_" + kind)(fmt, path, depth + 1)

    # -- leaves ----------------------------------------------------------------------
    def _const_string(self, fmt: dict, path: str, depth: int) -> str:
        value = fmt.get("value")
        if not isinstance(value, str):
            raise _bad(path, "value must be a string")
        return json.dumps(value) if value else ""

    def _json_schema(self, fmt: dict, path: str, depth: int) -> str:
        from vllm.v1.structured_output.grammar import json_lark

        style = fmt.get("style", "json")
        if style != "json":
            raise _bad(path, f'style {json.dumps(style)[:40]} is not supported (only "json")')
        schema = fmt.get("json_schema")
        if schema is True:
            schema = {}
        if not isinstance(schema, dict):
            raise _bad(path, "json_schema must be a JSON schema object")
        return json_lark(schema)

    def _regex(self, fmt: dict, path: str, depth: int) -> str:
        pattern = fmt.get("pattern")
        if not isinstance(pattern, str) or not pattern:
            raise _bad(path, "pattern must be a non-empty string")
        return self.terminal(_lark_regex(pattern))

    def _any_text(self, fmt: dict, path: str, depth: int, end: list[str] | None = None) -> str:
        excludes = self.strings(fmt.get("excludes", []), f"{path}.excludes")
        if not end:
            return self.terminal(_excluding(excludes))
        # Text up to the first of the tag's ends, the end included, as one lexeme.
        ends = "|".join(_regex_literal(e) for e in end)
        body = f"/(.|\\n)*({ends})/ & ~/(.|\\n)*({ends})(.|\\n)+/"
        if excludes:
            banned = "|".join(_regex_literal(e) for e in excludes)
            body += f" & ~/(.|\\n)*({banned})(.|\\n)*({ends})/"
        return self.terminal(body)

    # -- combinations ----------------------------------------------------------------
    def _sequence(self, fmt: dict, path: str, depth: int) -> str:
        parts = [self.node(e, f"{path}.elements[{i}]", depth)
                 for i, e in enumerate(self.nodes(fmt, "elements", path))]  # fmt: skip
        return " ".join(p for p in parts if p)

    def _or(self, fmt: dict, path: str, depth: int) -> str:
        parts = [self.node(e, f"{path}.elements[{i}]", depth)
                 for i, e in enumerate(self.nodes(fmt, "elements", path))]  # fmt: skip
        name = self.name("or")
        self.lines.append(f"{name}: " + " | ".join(p or '""' for p in parts))
        return name

    def _tag(self, fmt: dict, path: str, depth: int) -> str:
        begin = fmt.get("begin")
        if isinstance(begin, dict) and begin.get("type") == "token":
            opening = self.token(begin.get("token"), f"{path}.begin")
        elif isinstance(begin, str):
            opening = json.dumps(begin) if begin else ""
        else:
            raise _bad(path, "begin must be a string or a token")
        end = fmt.get("end")
        ends = [end] if isinstance(end, str) else end
        if not isinstance(ends, list) or not ends or not all(isinstance(e, str) for e in ends):
            raise _bad(path, "end must be a string or a non-empty list of strings")
        content = fmt.get("content")
        if isinstance(content, dict) and content.get("type") == "any_text" and all(ends):
            extra = set(content) - _KEYS["any_text"] - {"type"}
            if extra:
                raise _bad(
                    f"{path}.content", f'of type "any_text" has unknown keys {sorted(extra)}'
                )
            self.count += 1
            body = self._any_text(content, f"{path}.content", depth, end=ends)
            return " ".join(p for p in (opening, body) if p)
        body = self.node(content, f"{path}.content", depth)
        closing = "(" + " | ".join(json.dumps(e) for e in ends) + ")" if any(ends) else ""
        return " ".join(p for p in (opening, body, closing) if p)

    def _triggered_tags(self, fmt: dict, path: str, depth: int) -> str:
        triggers = self.strings(fmt.get("triggers"), f"{path}.triggers", non_empty=True)
        tags = self.nodes(fmt, "tags", path)
        text = self.terminal(_excluding(self.strings(fmt.get("excludes", []), f"{path}.excludes")))
        bare, triggered = [], []
        for i, tag in enumerate(tags):
            where = f"{path}.tags[{i}]"
            tag = {"type": "tag", **tag} if isinstance(tag, dict) else tag
            begin = tag.get("begin") if isinstance(tag, dict) else None
            if not isinstance(begin, str):
                raise _bad(where, "begin must be a string (a trigger opens it)")
            matching = [t for t in triggers if begin.startswith(t)]
            if len(matching) != 1:
                raise _bad(
                    where, f"begin {json.dumps(begin)[:60]} must start with exactly one trigger"
                )
            bare.append(self.node(tag, where, depth))
            trigger = matching[0]
            rest = self.node({**tag, "begin": begin[len(trigger) :]}, where, depth)
            name = self.name("tag")
            self.lines.append(f"{name}_trig[lazy]: {text} {json.dumps(trigger)}")
            self.lines.append(f"{name}: {name}_trig {rest}")
            triggered.append(name)
        first = "(" + " | ".join(bare) + ")"
        later = "(" + " | ".join(triggered) + ")"
        at_least_one, stop = (
            self.flag(fmt, "at_least_one", path),
            self.flag(fmt, "stop_after_first", path),
        )
        name = self.name("triggered")
        if at_least_one and stop:
            body = first
        elif at_least_one:
            body = f"{first} {later}* {text}"
        elif stop:
            body = f"{text} | {later}"
        else:
            body = f"{later}* {text}"
        self.lines.append(f"{name}: {body}")
        return name

    def _tags_with_separator(self, fmt: dict, path: str, depth: int) -> str:
        tags = [self.node({"type": "tag", **t} if isinstance(t, dict) else t,
                          f"{path}.tags[{i}]", depth)
                for i, t in enumerate(self.nodes(fmt, "tags", path))]  # fmt: skip
        separator = fmt.get("separator")
        if not isinstance(separator, str):
            raise _bad(path, "separator must be a string")
        one = self.name("tag")
        self.lines.append(f"{one}: " + " | ".join(tags))
        at_least_one, stop = (
            self.flag(fmt, "at_least_one", path),
            self.flag(fmt, "stop_after_first", path),
        )
        sep = f"{json.dumps(separator)} " if separator else ""
        body = one if stop else f"{one} ({sep}{one})*"
        return body if at_least_one else f"({body})?"

    def _optional(self, fmt: dict, path: str, depth: int) -> str:
        return f"({self.node(fmt.get('content'), f'{path}.content', depth) or chr(34) * 2})?"

    def _star(self, fmt: dict, path: str, depth: int) -> str:
        return f"({self.node(fmt.get('content'), f'{path}.content', depth) or chr(34) * 2})*"

    def _plus(self, fmt: dict, path: str, depth: int) -> str:
        return f"({self.node(fmt.get('content'), f'{path}.content', depth) or chr(34) * 2})+"

    def _repeat(self, fmt: dict, path: str, depth: int) -> str:
        low, high = fmt.get("min"), fmt.get("max")
        if not (isinstance(low, int) and isinstance(high, int) and 0 <= low <= 1024):
            raise _bad(path, "min and max must be whole numbers, 0 <= min <= 1024")
        if high != -1 and not low <= high <= 1024:
            raise _bad(path, "max must be -1 (no bound) or from min to 1024")
        item = f"({self.node(fmt.get('content'), f'{path}.content', depth) or chr(34) * 2})"
        if high == -1:
            return " ".join([item] * low + [f"{item}*"])
        return " ".join([item] * low + [f"{item}?"] * (high - low)) or '""'

    # -- checks ----------------------------------------------------------------------
    def nodes(self, fmt: dict, key: str, path: str) -> list:
        value = fmt.get(key)
        if not isinstance(value, list) or not value:
            raise _bad(path, f"{key} must be a non-empty list")
        return value

    @staticmethod
    def strings(value: Any, path: str, non_empty: bool = False) -> list[str]:
        if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
            raise _bad(path, "must be a list of non-empty strings")
        if non_empty and not value:
            raise _bad(path, "must not be empty")
        return value

    @staticmethod
    def flag(fmt: dict, key: str, path: str) -> bool:
        value = fmt.get(key, False)
        if not isinstance(value, bool):
            raise _bad(path, f"{key} must be a boolean")
        return value

    @staticmethod
    def token(token: Any, path: str) -> str:
        if isinstance(token, int) and not isinstance(token, bool) and token >= 0:
            return f"<[{token}]>"
        if isinstance(token, str) and token.startswith("<") and token.endswith(">"):
            return token
        raise _bad(path, 'token must be a token id or a special token\'s name "<...>"')


def format_grammar(value: dict) -> str:
    """The Lark text of a structural tag in the "format" form (``{"type":
    "structural_tag", "format": {...}}``); ``VLLMValidationError`` naming
    ``structured_outputs`` for what it cannot take."""
    extra = set(value) - {"type", "format"}
    if extra:
        raise _bad("", f'in the "format" form has unknown keys {sorted(extra)}')
    if value.get("type", "structural_tag") != "structural_tag":
        raise _bad("", 'type must be "structural_tag"')
    compiler = _Compiler()
    root = compiler.node(value["format"], "format", 0) or '""'
    return "\n".join(["%llguidance {}", f"start: {root}", *compiler.lines]) + "\n"
