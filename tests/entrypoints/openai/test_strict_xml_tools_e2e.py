"""Strict tools under tool_choice "auto" in Qwen3-Coder's XML, end to end: the real
server (``--tool-call-parser qwen3_coder``) and model, the official openai client. The
135M model is asked to repeat a call (it copies reliably); with a strict tool the grammar
holds what it copies to the schema once the call opens, and the parser types the values
back into JSON arguments."""

from __future__ import annotations

import json

import pytest

from ...utils import RemoteServer
from .test_tool_calling_e2e import MODEL, TEMPLATE

pytestmark = pytest.mark.slow
BASH = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a shell command",
        "parameters": {
            "type": "object",
            "properties": {
                "command": {"type": "string", "maxLength": 40},
                "timeout": {"type": "integer"},
            },
            "required": ["command"],
        },
    },
}
STRICT = {"type": "function", "function": {**BASH["function"], "strict": True}}


def _call(params: str) -> str:
    return f"<tool_call>\n<function=bash>\n{params}</function>\n</tool_call>"


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    out = tmp_path_factory.mktemp("xml_tools")
    srv = RemoteServer(
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "qwen3_coder",
        "--chat-template",
        TEMPLATE,
        log_path=str(out / "server.log"),
    )
    yield srv.client()
    srv.stop()


def _calls(
    client, text: str, tool: dict, prompt: str = "Repeat this text exactly:\n", **kw
) -> tuple[list[tuple[str, dict]], str]:
    resp = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt + text}],
        tools=[tool],
        temperature=0,
        max_tokens=80,
        **kw,
    )
    choice = resp.choices[0]
    calls = [(c.function.name, json.loads(c.function.arguments))
             for c in choice.message.tool_calls or []]  # fmt: skip
    return calls, choice.finish_reason


def test_a_strict_tools_xml_call_is_held_to_its_schema(client):
    bad = _call(
        "<parameter=command>\nls -la\n</parameter>\n"
        "<parameter=timeout>\nsoon\n</parameter>\n"
        "<parameter=force>\ntrue\n</parameter>\n"
    )
    loose, _ = _calls(client, bad, BASH)  # copied as written: the parser keeps strings
    assert loose == [("bash", {"command": "ls -la", "timeout": "soon", "force": "true"})]
    strict, finish = _calls(client, bad, STRICT)
    ((name, args),) = strict
    assert name == "bash" and finish == "tool_calls"
    assert set(args) <= {"command", "timeout"} and isinstance(args["command"], str), args
    assert isinstance(args.get("timeout", 0), int), args


def test_parallel_tool_calls_false_keeps_the_first_xml_call(client):
    # Two functions in one wrapper (the parser reads each as a call): the model copies
    # both; with the flag the grammar closes the wrapper after the first.
    two = (
        "<tool_call>\n<function=bash>\n<parameter=command>\ngit status\n</parameter>\n"
        "</function>\n<function=bash>\n<parameter=command>\nls -la\n</parameter>\n"
        "</function>\n</tool_call>"
    )
    prompt = "Copy the following two tool calls exactly:\n"
    both, _ = _calls(client, two, BASH, prompt=prompt)
    assert [a["command"] for _, a in both] == ["git status", "ls -la"]
    first, finish = _calls(client, two, BASH, prompt=prompt, parallel_tool_calls=False)
    assert first == [("bash", {"command": "git status"})] and finish == "tool_calls"
