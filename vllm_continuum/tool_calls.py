"""Tool calls in agent outputs.

``ToolCallParser`` finds the tool call in a finished turn's text (```bash blocks, OpenAI
``tool_calls`` JSON, ``<tool_call>{json}</tool_call>``, Qwen3-Coder's
``<function=NAME><parameter=KEY>``, Mistral's ``[TOOL_CALLS]name[ARGS]{json}``; anything
inside ``<think>`` is ignored) and names
the tool the way the estimator and the predictors key on it (``normalize_tool_name``:
"cd x && git status" -> "git status").
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass

_THINK = re.compile(r"<think>.*?</think>", re.DOTALL)
# A block cut off by max_tokens has no closing fence: the end of the text closes it.
_FENCE = re.compile(r"```(?:bash|sh|shell|console|zsh)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_TOOL_TAG = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)
# Qwen3-Coder's XML calls: <function=NAME><parameter=KEY>value</parameter>...</function>.
_XML_FUNCTION = re.compile(r"<function=([^>\n<]+)>(.*?)(?:</function>|\Z)", re.DOTALL)
_XML_PARAM = re.compile(
    r"<parameter=([^>\n<]+)>\n?(.*?)\n?(?:</parameter>|(?=<parameter=)|\Z)", re.DOTALL
)
_JSON_CALL_TAGS = ("<|python_tag|>", "<|tool_call|>", "<tool_call>", "[TOOL_CALLS]")
# Mistral's calls from its v11 tokenizers on: [TOOL_CALLS]name[ARGS]{json}, repeated.
_MISTRAL_CALL = re.compile(
    r"\[TOOL_CALLS\]\s*([^\[\]\s]+)\s*(?:\[CALL_ID\][^\[]*)?\[ARGS\](.*?)(?=\[TOOL_CALLS\]|\Z)",
    re.DOTALL,
)
_ENV_ASSIGN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_PREFIXES = {"sudo", "time", "nohup", "env", "exec", "command", "builtin", "nice"}
# Tools whose first argument names what really runs ("git status", "pip install").
_SUBCOMMAND_TOOLS = {
    "git",
    "pip",
    "pip3",
    "npm",
    "yarn",
    "pnpm",
    "docker",
    "cargo",
    "go",
    "kubectl",
    "conda",
    "apt",
    "apt-get",
    "poetry",
    "uv",
    "make",
    "dotnet",
}
_PYTHONS = re.compile(r"^python(\d(\.\d+)?)?$")


@dataclass(frozen=True)
class ToolCall:
    name: str  # normalised tool name: "ls", "git status", "pytest"
    command: str  # the full command text (or JSON arguments)


def _segments(command: str) -> list[str]:
    """Shell words of the first line, split at &&, ||, ;, | (quotes respected)."""
    line = next((ln.strip() for ln in command.strip().splitlines() if ln.strip()), "")
    try:
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        return list(lexer)
    except ValueError:  # unbalanced quotes: fall back to plain splitting
        return line.split()


def normalize_tool_name(command: str) -> str | None:
    """First real command word: skips cd-chains, sudo, env assignments, timeouts."""
    words = _segments(command)
    i = 0
    while i < len(words):
        w = words[i]
        if w in (";", "&&", "||", "|", "&"):
            i += 1
        elif w == "cd" and i + 2 < len(words) and words[i + 2] in ("&&", ";", "||"):
            i += 2  # "cd dir && cmd": the tool is cmd
        elif w.rsplit("/", 1)[-1] in _PREFIXES or _ENV_ASSIGN.match(w):
            i += 1
        elif w == "timeout":
            i += 2 if i + 1 < len(words) and not words[i + 1].startswith("-") else 3
        else:
            break
    if i >= len(words) or words[i] in (";", "&&", "||", "|", "&"):
        return None
    tool = words[i].rsplit("/", 1)[-1]
    rest = [w for w in words[i + 1 :] if w not in (";", "&&", "||", "|", "&")]
    if _PYTHONS.match(tool) and len(rest) >= 2 and rest[0] == "-m":
        return rest[1]  # python -m pytest -> pytest
    if tool in _SUBCOMMAND_TOOLS and rest and not rest[0].startswith("-"):
        return f"{tool} {rest[0]}"
    return tool or None


class ToolCallParser:
    """Finds the (last) tool call in an agent turn's output text."""

    def parse(self, text: str | None) -> ToolCall | None:
        if not text:
            return None
        if "</think>" in text:  # thinking models: only what follows the thought counts
            text = _THINK.sub("", text)
            text = text.rsplit("</think>", 1)[-1]
        return (
            self._from_tool_calls_json(text)
            or self._from_mistral(text)
            or self._from_tool_tag(text)
            or self._from_xml_function(text)
            or self._from_fence(text)
        )

    def _from_mistral(self, text: str) -> ToolCall | None:
        calls = _MISTRAL_CALL.findall(text)
        if not calls:
            return None
        name, args = calls[-1]
        try:
            arguments = json.loads(args)
        except json.JSONDecodeError:
            arguments = {}
        return self._from_function({"name": name, "arguments": arguments})

    def _from_xml_function(self, text: str) -> ToolCall | None:
        functions = _XML_FUNCTION.findall(text)
        if not functions:
            return None
        name, body = functions[-1]
        args = {key.strip(): value for key, value in _XML_PARAM.findall(body)}
        return self._from_function({"name": name.strip(), "arguments": args})

    def _from_fence(self, text: str) -> ToolCall | None:
        blocks = [b.strip() for b in _FENCE.findall(text) if b.strip()]
        if not blocks:
            return None
        name = normalize_tool_name(blocks[-1])
        return ToolCall(name, blocks[-1]) if name else None

    def _from_tool_tag(self, text: str) -> ToolCall | None:
        calls = _TOOL_TAG.findall(text)
        return self._from_function(calls[-1]) if calls else None

    def _from_tool_calls_json(self, text: str) -> ToolCall | None:
        """A JSON call object, an OpenAI message with ``tool_calls``, or a list of calls
        (what guided decoding writes for tool_choice "required"), after a tag some models
        write first (Llama 3.1's ``<|python_tag|>``, Granite's ``<|tool_call|>`` or
        ``<tool_call>``)."""
        stripped = text.strip()
        for tag in _JSON_CALL_TAGS:
            if stripped.startswith(tag):
                stripped = stripped[len(tag) :].lstrip()
                break
        if not stripped.startswith(("{", "[")):
            return None
        try:
            obj = json.loads(stripped)
        except json.JSONDecodeError:
            return None
        if isinstance(obj, list):
            calls = [c for c in obj if isinstance(c, dict)]
            return self._from_function(calls[-1].get("function", calls[-1])) if calls else None
        calls = obj.get("tool_calls") if isinstance(obj, dict) else None
        if calls:
            return self._from_function(calls[-1].get("function", calls[-1]))
        return self._from_function(obj) if isinstance(obj, dict) and "name" in obj else None

    @staticmethod
    def _from_function(fn) -> ToolCall | None:
        if isinstance(fn, str):
            try:
                fn = json.loads(fn)
            except json.JSONDecodeError:
                return None
        if not isinstance(fn, dict) or not fn.get("name"):
            return None
        args = fn.get("arguments", fn.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                args = {"raw": args}
        command = args.get("command") or args.get("cmd") if isinstance(args, dict) else None
        if isinstance(command, list):
            command = " ".join(map(str, command))
        if isinstance(command, str) and command.strip():
            return ToolCall(normalize_tool_name(command) or fn["name"], command)
        return ToolCall(str(fn["name"]), json.dumps(args, sort_keys=True))
