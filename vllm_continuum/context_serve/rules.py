"""Layer 1: commands that are fast on any machine, and command prefixes that are slow.

Matching is on normalised tool names (``vllm_continuum.tool_calls.normalize_tool_name``:
wrappers such as ``sudo``, ``timeout 30``, ``env X=1`` and ``python -m`` removed; tools
with subcommands keep the subcommand: "git status", "pip install"). A snippet with
several simple commands (pipelines, ``&&`` chains, several lines) is as slow as its
slowest part: one slow part makes it SLOW, all parts fast make it FAST, anything else is
for the next layer. A test runner pointed at one file, test id or selection ("pytest
tests/test_x.py::test_y", "pytest -k name") is not a suite: the rules leave it to the
learning layers, which keep its durations apart from the runner's suites. The table
extends from a JSON or YAML file (``{"fast": [...], "slow_prefixes": [...]}``); a user's
entry overrides a default one.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

from vllm_continuum.context_serve.shell import command_calls
from vllm_continuum.context_serve.types import ToolSpeed

DEFAULT_FAST = (
    # Reading and searching files, moving around: bounded by a file or a directory.
    "ls", "cat", "pwd", "echo", "printf", "head", "tail", "wc", "grep", "egrep", "fgrep",
    "rg", "sed", "awk", "find", "cd", "which", "type", "whoami", "date", "sort", "uniq",
    "cut", "tr", "tree", "file", "stat", "nl", "diff", "cmp", "basename", "dirname",
    "realpath", "readlink", "true", "false", "export", "source", ".", "[", "test", "set",
    "unset", "alias", "history", "clear", "less", "more", "xxd", "md5sum", "sha256sum",
    # Editing files.
    "touch", "mkdir", "rm", "cp", "mv", "ln", "chmod", "chown", "tee", "patch",
    # Local git plumbing (no network).
    "git status", "git diff", "git log", "git show", "git branch", "git add", "git rm",
    "git mv", "git checkout", "git switch", "git restore", "git stash", "git rev-parse",
    "git config", "git blame", "git grep", "git ls-files", "git reset", "git commit",
    "git apply", "git tag", "git remote",
    # Package metadata (no install).
    "pip list", "pip show", "pip freeze", "pip3 list", "pip3 show", "pip3 freeze",
    "npm ls", "npm view", "conda list", "conda info",
    # SWE-agent's file-viewer and editor tools.
    "open", "goto", "scroll_up", "scroll_down", "search_file", "search_dir", "find_file",
    "create", "edit", "submit", "str_replace_editor", "view",
)  # fmt: skip

DEFAULT_SLOW_PREFIXES = (
    # Test suites.
    "pytest", "tox", "nox", "nosetests", "runtests.py", "npm test", "yarn test",
    "go test", "cargo test", "mvn", "gradle", "gradlew", "ctest", "jest", "mocha",
    "make", "cmake", "ninja", "bazel", "cargo build", "cargo check", "cargo run",
    "go build", "go install", "go mod", "npm run", "yarn build", "tsc", "webpack",
    "docker build", "docker pull", "docker compose", "docker-compose",
    # Installs and network.
    "pip install", "pip3 install", "pip download", "npm install", "npm ci", "npm i",
    "yarn install", "yarn add", "pnpm install", "conda install", "conda create",
    "conda env", "apt-get install", "apt-get update", "apt install", "apt update",
    "brew install", "poetry install", "uv sync", "uv pip", "pipenv install",
    "git clone", "git fetch", "git pull", "git push", "wget",
    # Python scripts known to run suites or builds ("python setup.py install").
    "setup.py",
)  # fmt: skip


# Test runners that a target narrows from a suite (minutes) to one file or one test
# (seconds on most projects): a targeted run is not SLOW by rule, the learning layers
# decide it under its own name ("pytest <target>"), apart from the runner's whole suites.
TEST_RUNNERS = frozenset({"pytest", "py.test", "nosetests", "unittest", "jest", "mocha",
                          "vitest", "go test"})  # fmt: skip
_TEST_FILE_SUFFIXES = (".py", ".js", ".ts", ".jsx", ".tsx", ".mjs", "_test.go")
_SELECTOR_FLAGS = frozenset({"-k", "-run", "--run", "-t", "--testNamePattern", "--grep", "-g"})
TARGETED_SUFFIX = " <target>"


def is_targeted_test(name: str, words: Iterable[str]) -> bool:
    """Whether one simple command runs a test runner on a file, a test id or a selection
    ("pytest tests/test_x.py", "pytest a.py::test_y", "pytest -k name", "go test -run X")."""
    if name not in TEST_RUNNERS:
        return False
    for word in words:
        flag = word.split("=", 1)[0]
        if "::" in word or word.endswith(_TEST_FILE_SUFFIXES) or flag in _SELECTOR_FLAGS:
            return True
    return False


def learning_key(tool: str, command: str) -> str:
    """The name the learning layers keep a tool's durations under: a targeted test run
    learns apart from the same runner's whole suites."""
    for name, words in command_calls(command):
        if name == tool and is_targeted_test(name, words[1:]):
            return tool + TARGETED_SUFFIX
    return tool


@dataclass(frozen=True)
class RuleTable:
    """Fast tool names and slow name prefixes (a one- or two-word prefix of a name)."""

    fast: frozenset[str]
    slow_prefixes: frozenset[str]

    @classmethod
    def default(cls) -> RuleTable:
        return cls(frozenset(DEFAULT_FAST), frozenset(DEFAULT_SLOW_PREFIXES))

    def extended(self, fast: Iterable[str] = (), slow_prefixes: Iterable[str] = ()) -> RuleTable:
        """This table plus the given entries; each new entry wins over the other set."""
        fast, slow = frozenset(map(_norm, fast)), frozenset(map(_norm, slow_prefixes))
        return RuleTable((self.fast - slow) | fast, (self.slow_prefixes - fast) | slow)

    @classmethod
    def from_file(cls, path: str) -> RuleTable:
        """The default table extended by a JSON or YAML file; ValueError on a bad file."""
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
            data = _parse(path, text)
        except (OSError, ValueError) as exc:
            raise ValueError(f"context_serve rules: cannot read {path!r}: {exc}") from None
        if not isinstance(data, dict) or set(data) - {"fast", "slow_prefixes"}:
            raise ValueError(
                f"context_serve rules: {path!r} must be a mapping with keys 'fast' and "
                f"'slow_prefixes' (lists of commands)"
            )
        lists = [data.get("fast") or [], data.get("slow_prefixes") or []]
        if not all(isinstance(v, list) and all(isinstance(x, str) for x in v) for v in lists):
            raise ValueError(f"context_serve rules: {path!r}: 'fast' and 'slow_prefixes' "
                             "must be lists of strings")  # fmt: skip
        return cls.default().extended(*lists)

    def classify_name(self, name: str) -> ToolSpeed | None:
        """SLOW, FAST, or None (unknown) for one normalised tool name."""
        if name in self.slow_prefixes or name.split(" ", 1)[0] in self.slow_prefixes:
            return ToolSpeed.SLOW
        return ToolSpeed.FAST if name in self.fast else None

    def classify(self, name: str, command: str) -> ToolSpeed | None:
        """The verdict on a tool call: its shell snippet's slowest part decides.

        ``command`` that is not a shell snippet (JSON arguments of a function call) is
        judged by the tool ``name`` alone."""
        if command.lstrip().startswith("{"):
            return self.classify_name(name)
        verdicts = [
            None if is_targeted_test(name, words[1:]) else self.classify_name(name)
            for name, words in command_calls(command)
        ]
        if not verdicts:
            return None
        if ToolSpeed.SLOW in verdicts:
            return ToolSpeed.SLOW
        return ToolSpeed.FAST if all(v == ToolSpeed.FAST for v in verdicts) else None


def _norm(entry: str) -> str:
    return " ".join(entry.split())


def _parse(path: str, text: str):
    if path.endswith((".yaml", ".yml")):
        import yaml

        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ValueError(str(exc).splitlines()[0]) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(str(exc)) from None
