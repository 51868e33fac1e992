"""tool_choice / response_format -> the request's plan, and the 400s (no server)."""

from __future__ import annotations

import pytest

from vllm.entrypoints.openai.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.tool_calling import ToolCallingConfig, plan_tool_calls
from vllm.exceptions import VLLMValidationError
from vllm.v1.structured_output import validate_structured_outputs

AUTO = ToolCallingConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
BASH = {"type": "function", "function": {"name": "bash"}}


def plan(config=AUTO, **fields):
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    return plan_tool_calls(ChatCompletionRequest(**body), config)


def rejected(param: str, config=AUTO, **fields) -> str:
    with pytest.raises(VLLMValidationError) as e:
        plan(config, **fields)
    assert e.value.param == param
    return str(e.value)


def test_no_tools_is_plain_content():
    p = plan(ToolCallingConfig())
    assert p.parser is None and p.structured_outputs is None and p.template_tools is None


def test_auto_is_the_default_with_tools_and_needs_the_flags():
    p = plan(tools=[WEATHER])
    assert p.template_tools == [WEATHER] and p.structured_outputs is None
    assert type(p.parser).__name__ == "HermesToolParser"
    msg = rejected("tool_choice", ToolCallingConfig(), tools=[WEATHER])
    assert "--enable-auto-tool-choice" in msg and "--tool-call-parser" in msg


def test_none_renders_tools_but_reads_no_calls():
    p = plan(ToolCallingConfig(), tools=[WEATHER], tool_choice="none")
    assert p.template_tools == [WEATHER] and p.parser is None


def test_required_and_named_are_guided_by_a_valid_grammar():
    required = plan(ToolCallingConfig(), tools=[WEATHER, BASH], tool_choice="required")
    schema = required.structured_outputs.json
    assert schema["type"] == "array" and len(schema["items"]["anyOf"]) == 2
    named = plan(
        ToolCallingConfig(),
        tools=[WEATHER, BASH],
        tool_choice={"type": "function", "function": {"name": "bash"}},
    )
    assert named.forced_name == "bash"
    assert named.structured_outputs.json["properties"]["name"] == {"const": "bash"}
    single = plan(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    assert single.structured_outputs.json["maxItems"] == 1
    for p in (required, named, single):
        validate_structured_outputs(p.structured_outputs)


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"function": {"name": "get_weather"}}}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ({"tools": [{"type": "retrieval"}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]}, "tools"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": 1}}},
            "response_format",
        ),
        ({"structured_outputs": {"yaml": "x"}}, "structured_outputs"),
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "response_format",
        ),
    ],
)
def test_bad_requests_are_400s_naming_the_field(fields, param):
    rejected(param, **fields)


def test_response_format_is_never_ignored():
    assert plan(response_format={"type": "text"}).structured_outputs is None
    assert plan(response_format={"type": "json_object"}).structured_outputs.json_object
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    assert plan(response_format=fmt).structured_outputs.json == schema
    assert plan(structured_outputs={"choice": ["a", "b"]}).structured_outputs.choice == ["a", "b"]


def test_config_checks_the_flags():
    with pytest.raises(ValueError, match="--tool-call-parser"):
        ToolCallingConfig(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="tool_call_parser"):
        ToolCallingConfig(tool_call_parser="nope")
