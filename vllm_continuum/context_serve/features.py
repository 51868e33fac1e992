"""Features of a command's text for the XGBoost layer (cheap: string and regex work).

The order of ``FEATURE_NAMES`` is the column order of the model's input; a saved model
records it, and a model with other columns is refused when loaded.
"""

from __future__ import annotations

import re
from functools import lru_cache

import numpy as np

from vllm_continuum.context_serve.rules import DEFAULT_FAST, DEFAULT_SLOW_PREFIXES, is_targeted_test
from vllm_continuum.context_serve.shell import command_calls, logical_lines, simple_commands

_WORDS = {
    "network": re.compile(r"\b(curl|wget|ssh|scp|rsync|clone|fetch|pull|push|download|http)"),
    "build": re.compile(r"\b(make|cmake|build|compile|gcc|g\+\+|clang|cargo|mvn|gradle|tsc|ninja)"),
    "test": re.compile(r"\b(pytest|tests?\b|unittest|tox|nose|jest|mocha|spec)"),
    "install": re.compile(r"\b(install|pip|npm|yarn|conda|apt|brew|poetry|setup\.py)"),
    "python": re.compile(r"\bpython[\d.]*\b"),
    "wait": re.compile(r"\b(sleep|wait|timeout|watch)\b"),
    "docker": re.compile(r"\b(docker|podman|kubectl)\b"),
    "git": re.compile(r"\bgit\b"),
    "search": re.compile(r"\b(find|grep|rg|ag|locate)\b"),
    "loop": re.compile(r"\b(for|while|until|xargs)\b"),
}
_TIMEOUT = re.compile(r"\btimeout\s+(?:-\S+\s+)*(\d+(?:\.\d+)?)")
_REDIRECT = re.compile(r"\d*>>?|<(?!<)")
_FILE = re.compile(r"^[\w.*-]+\.\w{1,4}$")
_RECURSIVE = re.compile(r"\s(-[a-zA-Z]*[rR][a-zA-Z]*|--recursive)\b")
_FAST_FIRST = {entry.split(" ", 1)[0] for entry in DEFAULT_FAST}
_SLOW_FIRST = {entry.split(" ", 1)[0] for entry in DEFAULT_SLOW_PREFIXES}

FEATURE_NAMES = (
    "length",
    "num_lines",
    "num_words",
    "num_commands",
    "num_pipes",
    "num_and",
    "num_or",
    "num_semicolons",
    "num_redirects",
    "has_heredoc",
    "has_subshell",
    "num_paths",
    "has_recursive",
    "has_glob",
    "num_flags",
    "timeout_s",
    "has_sudo",
    "frac_fast_names",
    "has_slow_name",
    "has_targeted_test",
    *(f"kw_{k}" for k in _WORDS),
)


@lru_cache(maxsize=4096)
def command_features(command: str) -> tuple[float, ...]:
    """The feature vector of one command text, in ``FEATURE_NAMES`` order."""
    text = command[:20_000]
    lower = text.lower()
    words = text.split()
    calls = command_calls(text)
    names = [name for name, _ in calls]
    firsts = [n.split(" ", 1)[0] for n in names]
    timeout = _TIMEOUT.search(lower)
    values = [
        float(len(text)),
        float(len(logical_lines(text))),
        float(len(words)),
        float(len(simple_commands(text))),
        float(len(re.findall(r"(?<![|])\|(?![|])", text))),
        float(text.count("&&")),
        float(text.count("||")),
        float(text.count(";")),
        float(len(_REDIRECT.findall(text))),
        float("<<" in text),
        float("$(" in text or "`" in text),
        float(sum("/" in w or bool(_FILE.match(w)) for w in words)),
        float(bool(_RECURSIVE.search(text))),
        float("*" in text or "?" in text),
        float(sum(w.startswith("-") for w in words)),
        float(timeout.group(1)) if timeout else 0.0,
        float("sudo" in words),
        sum(f in _FAST_FIRST for f in firsts) / len(firsts) if firsts else 0.0,
        float(any(f in _SLOW_FIRST for f in firsts)),
        float(any(is_targeted_test(name, w[1:]) for name, w in calls)),
    ]
    values += [float(bool(rx.search(lower))) for rx in _WORDS.values()]
    return tuple(values)


def feature_matrix(commands: list[str]) -> np.ndarray:
    """(len(commands), len(FEATURE_NAMES)) float32 features."""
    return np.array([command_features(c) for c in commands], dtype=np.float32).reshape(
        len(commands), len(FEATURE_NAMES)
    )
