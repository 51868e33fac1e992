"""Scanning JSON that may still be arriving (a stream cut at any character).

The parsers need the raw text of a call's ``arguments`` as it grows, so that streamed
argument deltas concatenate to exactly the string the non-streaming response carries.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

_WS = " \t\r\n"


class Malformed(ValueError):
    """The text cannot be (the start of) the JSON expected there."""


def skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


def scan_string(s: str, i: int) -> int | None:
    """End (exclusive) of the string literal opening at ``s[i] == '"'``; None if cut."""
    i += 1
    while i < len(s):
        if s[i] == "\\":
            i += 2
        elif s[i] == '"':
            return i + 1
        else:
            i += 1
    return None


def scan_value(s: str, i: int) -> int | None:
    """End of the JSON value starting at ``i`` (no leading whitespace); None if the text
    ends first. Only the nesting is checked here: ``json.loads`` judges the result."""
    if i >= len(s):
        return None
    if s[i] == '"':
        return scan_string(s, i)
    if s[i] not in "{[":
        j = i
        while j < len(s) and s[j] not in ",}]" + _WS:
            j += 1
        return j if j < len(s) else None  # a number may go on
    depth = 0
    while i < len(s):
        c = s[i]
        if c == '"':
            end = scan_string(s, i)
            if end is None:
                return None
            i = end
            continue
        if c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


@dataclass
class ObjectScan:
    """The members of an object seen so far: key -> (value start, value end or None while
    the value is cut off). ``end``: after the closing brace, None while open."""

    members: dict[str, tuple[int, int | None]] = field(default_factory=dict)
    end: int | None = None

    def raw(self, s: str, key: str) -> str | None:
        if key not in self.members:
            return None
        start, end = self.members[key]
        return s[start:end] if end is not None else s[start:]

    def complete(self, key: str) -> bool:
        return key in self.members and self.members[key][1] is not None


def scan_object(s: str, i: int) -> ObjectScan:
    """The object opening at ``s[i] == '{'``, as far as the text goes (``Malformed`` if
    what is there cannot start a JSON object)."""
    out = ObjectScan()
    i = skip_ws(s, i + 1)
    if i < len(s) and s[i] == "}":
        out.end = i + 1
        return out
    while i < len(s):
        if s[i] != '"':
            raise Malformed(f"expected a key at {i}")
        key_end = scan_string(s, i)
        if key_end is None:
            return out
        key = json.loads(s[i:key_end])
        i = skip_ws(s, key_end)
        if i >= len(s):
            return out
        if s[i] != ":":
            raise Malformed(f"expected ':' at {i}")
        start = skip_ws(s, i + 1)
        if start >= len(s):
            return out
        end = scan_value(s, start)
        out.members[key] = (start, end)
        if end is None:
            return out
        i = skip_ws(s, end)
        if i < len(s) and s[i] == "}":
            out.end = i + 1
            return out
        if i < len(s) and s[i] != ",":
            raise Malformed(f"expected ',' or '}}' at {i}")
        i = skip_ws(s, i + 1)
    return out
