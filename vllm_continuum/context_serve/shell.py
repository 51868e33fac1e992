"""The simple commands inside an agent's shell snippet, for the rule table and features.

A snippet may hold several lines, ``&&``/``||``/``;``/``|`` chains, loops and heredocs;
its speed is the speed of its slowest simple command. Heredoc bodies are data, not
commands, and are skipped; line continuations are joined. Word splitting reuses
``vllm_continuum.tool_calls`` so that names match the estimator's.
"""

from __future__ import annotations

import re
import shlex
from functools import lru_cache

from vllm_continuum.tool_calls import _segments, normalize_tool_name

_PYTHON = re.compile(r"^python(\d(\.\d+)?)?$")
_SEPARATORS = frozenset({";", "&&", "||", "|", "&", ";;", "|&", "&&&"})
_HEREDOC = re.compile(r"<<-?\s*(['\"]?)([A-Za-z_][A-Za-z0-9_]*)\1")
# Shell keywords that open a simple command which follows them ("do pytest" is pytest).
_LEADING_KEYWORDS = frozenset({"do", "then", "else", "elif", "if", "while", "until", "{", "(", "!"})
# Segments that are pure control flow ("for f in *.py", "done", "fi").
_CONTROL = frozenset({"for", "done", "fi", "esac", "case", "}", ")", "select", "function"})


def logical_lines(command: str) -> list[str]:
    """Lines of the snippet with continuations joined and heredoc bodies removed."""
    text = command.replace("\\\n", " ")
    lines: list[str] = []
    terminator: str | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if terminator is not None:
            if line == terminator:
                terminator = None
            continue
        if not line or line.startswith("#"):
            continue
        lines.append(line)
        match = _HEREDOC.search(line)
        if match:
            terminator = match.group(2)
    return lines


def shell_words(line: str) -> list[str]:
    """``_segments`` of one line with redirections re-joined: ``2>&1`` and ``&>file`` are
    words of their command, not a background ``&`` separator."""
    raw = _segments(line)
    words: list[str] = []
    i = 0
    while i < len(raw):
        word = raw[i]
        nxt = raw[i + 1] if i + 1 < len(raw) else ""
        if word == "&" and words and words[-1].endswith((">", "<")) and nxt:
            words[-1] += "&" + nxt  # 2>&1
            i += 2
        elif word == "&" and nxt.startswith(">"):
            words.append("&" + nxt)  # &>/dev/null
            i += 2
        else:
            words.append(word)
            i += 1
    return words


def simple_commands(command: str) -> list[list[str]]:
    """The words of each simple command, keywords stripped (control-only parts dropped)."""
    commands: list[list[str]] = []
    for line in logical_lines(command):
        current: list[str] = []
        for word in [*shell_words(line), ";"]:
            if word in _SEPARATORS:
                while current and current[0] in _LEADING_KEYWORDS:
                    current.pop(0)
                if current and current[0] not in _CONTROL:
                    commands.append(current)
                current = []
            else:
                current.append(word)
    return commands


@lru_cache(maxsize=4096)  # agents repeat commands; shlex is the cost of a verdict
def command_calls(command: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """(normalised tool name, words) of every simple command ("cd x && pytest" -> cd,
    pytest); a Python script stands for itself ("python tests/runtests.py" ->
    runtests.py), since "python" alone says nothing about the time."""
    calls = []
    for words in simple_commands(command):
        name = normalize_tool_name(shlex.join(words))
        if name and _PYTHON.match(name):
            name = _script(words) or name
        if name:
            calls.append((name, tuple(words)))
    return tuple(calls)


def command_names(command: str) -> tuple[str, ...]:
    """The normalised tool name of every simple command."""
    return tuple(name for name, _ in command_calls(command))


def _script(words: list[str]) -> str | None:
    start = next((i for i, w in enumerate(words) if _PYTHON.match(w.rsplit("/", 1)[-1])), None)
    if start is None:
        return None
    for word in words[start + 1 :]:
        if word.startswith("-"):
            return None  # python -c / -m ...: no script file
        return word.rsplit("/", 1)[-1] if word.endswith(".py") else None
    return None
