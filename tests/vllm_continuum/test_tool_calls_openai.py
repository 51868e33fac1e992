"""The policy's tool name from the outputs that OpenAI tool calling produces."""

from __future__ import annotations

import pytest

from vllm_continuum.tool_calls import ToolCallParser


@pytest.mark.parametrize(
    "text, name",
    [
        # hermes (tool_choice "auto" with --tool-call-parser hermes)
        (
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
            "get_weather",
        ),
        (
            '<tool_call>\n{"name": "bash", "arguments": {"command": "cd src && git status"}}'
            "\n</tool_call>",
            "git status",
        ),
        # guided decoding: a named function, and "required" (a list; the last call counts)
        ('{"name": "get_weather", "arguments": {"city": "Paris"}}', "get_weather"),
        (
            '[{"name": "get_weather", "arguments": {"city": "Rome"}}, '
            '{"name": "bash", "arguments": {"command": "pytest -x"}}]',
            "pytest",
        ),
        # llama3_json
        ('{"name": "search", "parameters": {"query": "vllm"}}', "search"),
    ],
)
def test_tool_name_from_tool_calling_outputs(text, name):
    call = ToolCallParser().parse(text)
    assert call is not None and call.name == name


def test_a_list_that_is_not_calls_is_no_call():
    assert ToolCallParser().parse("[1, 2, 3]") is None
