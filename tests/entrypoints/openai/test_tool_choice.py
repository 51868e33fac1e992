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
    with pytest.raises(ValueError, match="tool_strict_level"):
        ToolCallingConfig(tool_strict_level="always")
    # A level above "auto" with a format that has no structural tag here cannot be kept:
    # refused at start, naming the flag (Mistral's tag depends on the tokenizer: taken).
    with pytest.raises(ValueError, match="--tool-strict-level function .*'pythonic' has none"):
        ToolCallingConfig(True, "pythonic", tool_strict_level="function")
    with pytest.raises(ValueError, match="'granite' has none"):
        ToolCallingConfig(True, "granite", tool_strict_level="parameter")
    for parser in ("hermes", "mistral", "qwen3_coder", "kimi_k2", "deepseek_v32"):
        ToolCallingConfig(True, parser, tool_strict_level="parameter")
    ToolCallingConfig(True, "pythonic")  # the default level asks nothing of the format


STRICT_WEATHER = {"type": "function", "function": {**WEATHER["function"], "strict": True}}


def _tag(p) -> dict:
    tag = p.structured_outputs.structural_tag
    return {s["begin"].split('"name": ')[1].split('"')[1]: s["schema"] for s in tag["structures"]}


def test_auto_holds_a_strict_tools_calls_to_their_schema():
    # Without strict tools "auto" stays free, as before.
    assert plan(tools=[WEATHER, BASH]).structured_outputs is None
    p = plan(tools=[STRICT_WEATHER, BASH])
    tag = p.structured_outputs.structural_tag
    # SmolLM2's <tool_call> is text: the trigger is matched as text, not as a token.
    assert tag["triggers"] == ["<tool_call"]
    assert tag["structures"][0]["begin"] == '<tool_call>\n{"name": "get_weather", "arguments": '
    assert tag["structures"][0]["end"] == "}\n</tool_call>"
    schemas = _tag(p)  # every call names a tool; only the strict one's arguments are held
    assert schemas["get_weather"] == WEATHER["function"]["parameters"]
    assert schemas["bash"] == {"type": "object", "additionalProperties": True}
    validate_structured_outputs(p.structured_outputs)
    # A response_format's grammar holds the whole output then (calls are not constrained).
    fmt = plan(tools=[STRICT_WEATHER], response_format={"type": "json_object"})
    assert fmt.structured_outputs.json_object and fmt.structured_outputs.structural_tag is None


def test_the_strict_tag_compiles_with_a_tokenizer_whose_marker_is_text(tokenizer):
    from vllm.entrypoints.openai.tool_calling import special_tokens_of
    from vllm.v1.structured_output.validator import build_ll_tokenizer

    config = ToolCallingConfig(True, "hermes", special_tokens=special_tokens_of(tokenizer))
    assert "<tool_call>" not in config.special_tokens  # SmolLM2: text
    ll = build_ll_tokenizer(tokenizer, len(tokenizer), tokenizer.eos_token_id)
    # (a trigger written "<tool_call>" would be read as a special token SmolLM2 lacks)
    validate_structured_outputs(plan(config, tools=[STRICT_WEATHER]).structured_outputs, ll)


def test_the_strict_level_and_the_tokenizers_special_tokens():
    function = ToolCallingConfig(True, "hermes", tool_strict_level="function")
    assert _tag(plan(function, tools=[WEATHER, BASH])) == {
        "get_weather": {"type": "object", "additionalProperties": True},
        "bash": {"type": "object", "additionalProperties": True},
    }
    parameter = ToolCallingConfig(True, "hermes", tool_strict_level="parameter")
    assert (
        _tag(plan(parameter, tools=[WEATHER]))["get_weather"] == (WEATHER["function"]["parameters"])
    )
    # A tokenizer whose <tool_call> is a special token: the trigger is the token.
    special = ToolCallingConfig(True, "hermes", special_tokens={"<tool_call>": 151657})
    tag = plan(special, tools=[STRICT_WEATHER]).structured_outputs.structural_tag
    assert tag["triggers"] == ["<tool_call>"]
    # A format without a structural tag here stays free, as in vLLM (Mistral's JSON list
    # of the tokenizers without the [ARGS] token).
    mistral = ToolCallingConfig(True, "mistral")
    assert plan(mistral, tools=[STRICT_WEATHER]).structured_outputs is None
    # parallel_tool_calls false: the envelope is held (as vLLM, even without strict tools)
    # and the output ends after one call.
    single = plan(tools=[WEATHER, BASH], parallel_tool_calls=False).structured_outputs
    assert single.grammar.splitlines()[1] == "start: tag_end | tag_0 | tag_1"
    validate_structured_outputs(single)
    # More tools than one structural tag holds: the calls stay free, the request is served.
    many = [{"type": "function", "function": {"name": f"t{i}", "strict": True}}
            for i in range(65)]  # fmt: skip
    assert plan(tools=many).structured_outputs is None
    bad = {"type": "function", "function": {"name": "f", "strict": "yes"}}
    assert "strict must be a boolean" in rejected("tools", tools=[bad])


def test_the_tool_strict_level_flag_reaches_the_config():
    from vllm.entrypoints.cli.main import make_parser

    args = make_parser().parse_args(["serve", "--tool-strict-level", "parameter"])
    assert ToolCallingConfig.from_args(args).tool_strict_level == "parameter"
    default = make_parser().parse_args(["serve"])
    assert ToolCallingConfig.from_args(default).tool_strict_level == "auto"
    with pytest.raises(SystemExit):
        make_parser().parse_args(["serve", "--tool-strict-level", "always"])
