"""Strict tools under tool_choice "auto" in each format that has a structural tag here:
the grammar a request gets, fed the tokens of calls, allows the ones the tools' schemas
allow and stops a call at the first token that breaks its form; the tool parser reads
the allowed calls back. Markers that are special tokens in the model's tokenizer are
added to a copy of SmolLM2's, so both readings (token, text) are exercised."""

from __future__ import annotations

import copy

import pytest

from vllm.entrypoints.openai.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.tool_calling import (
    ToolCallingConfig,
    plan_tool_calls,
    special_tokens_of,
)
from vllm.entrypoints.openai.tool_parsers import get_tool_parser
from vllm.v1.structured_output.grammar import compile_grammar, new_matcher
from vllm.v1.structured_output.validator import build_ll_tokenizer

BASH = {
    "type": "function",
    "function": {
        "name": "bash",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {
                "command": {"type": "string"},
                "timeout": {"type": "integer"},
                "mode": {"enum": ["fast", "slow"]},
                "env": {
                    "type": "object",
                    "properties": {"HOME": {"type": "string"}},
                    "required": ["HOME"],
                },
            },
            "required": ["command"],
        },
    },
}
# Not strict: any arguments, but its name is held (the envelope).
NOTE = {"type": "function", "function": {"name": "note", "parameters": {"type": "object"}}}
FUNCTIONS = {t["function"]["name"]: t["function"] for t in (BASH, NOTE)}

DEEPSEEK = ["<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
            "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"]  # fmt: skip
KIMI = ["<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
        "<|tool_call_end|>", "<|tool_call_argument_begin|>"]  # fmt: skip


class Format:
    """One parser under one tokenizer (SmolLM2's, with ``special`` added as special
    tokens): the grammar of a strict request and what it lets through."""

    def __init__(self, base, parser: str, special: list[str] | None = None, **request):
        tokenizer = copy.deepcopy(base) if special else base
        if special:
            tokenizer.add_special_tokens({"additional_special_tokens": special})
        self.tokenizer = tokenizer
        self.parser = parser
        config = ToolCallingConfig(True, parser, special_tokens=special_tokens_of(tokenizer))
        body = {"messages": [{"role": "user", "content": "hi"}], "tools": [BASH, NOTE]}
        self.plan = plan_tool_calls(ChatCompletionRequest(**body, **request), config)
        self.grammar = compile_grammar(self.plan.structured_outputs)
        self.ll = build_ll_tokenizer(tokenizer, len(tokenizer), tokenizer.eos_token_id)

    def stop(self, text: str) -> tuple[int, int] | None:
        """The span of ``text`` of the first token the grammar forbids; None when every
        token is allowed and the output may end there."""
        matcher = new_matcher(self.ll, self.grammar)
        assert not matcher.is_error(), matcher.get_error()
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        for token, span in zip(encoded["input_ids"], encoded["offset_mapping"], strict=True):
            if not matcher.consume_token(token):
                return span
        assert matcher.is_accepting(), f"{text!r} may not end there"
        return None

    def stops_in(self, text: str, part: str) -> bool:
        """Whether the grammar stops ``text`` at a token inside its (last) ``part``."""
        span = self.stop(text)
        at = text.rindex(part)
        return span is not None and span[0] < at + len(part) and span[1] > at

    def calls(self, text: str) -> list[tuple[str, dict]]:
        import json

        parsed = get_tool_parser(self.parser, FUNCTIONS).extract(text, True)
        return [(c.name, json.loads(c.arguments)) for c in parsed.calls]


@pytest.fixture(scope="module")
def formats(tokenizer):
    return lambda *args, **kw: Format(tokenizer, *args, **kw)


def _qwen_call(name: str, params: list[tuple[str, str]], open_="<tool_call>") -> str:
    close = open_.replace("<", "</", 1)
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
    return f"{open_}\n<function={name}>\n{body}</function>\n{close}"


def test_qwen3_coder_xml_parameters_are_held_to_the_schema(formats):
    f = formats("qwen3_coder")
    good = _qwen_call(
        "bash", [("command", "ls -la </b>"), ("timeout", "30"), ("mode", "fast"),
                 ("env", '{"HOME": "/root"}')]
    )  # fmt: skip
    text = f"Let me look.\n{good}\nand {_qwen_call('note', [('anything', 'goes')])}"
    assert f.stop(text) is None
    assert f.calls(text) == [
        ("bash", {"command": "ls -la </b>", "timeout": 30, "mode": "fast",
                  "env": {"HOME": "/root"}}),
        ("note", {"anything": "goes"}),
    ]  # fmt: skip
    assert f.stop("No call needed.") is None  # the model still decides
    # Each breaks the schema where it breaks: a string for an integer, a value off the
    # enum, a name the schema does not have, a required one left out, a tool that does
    # not exist, an object missing its required key.
    for key, value, part in [
        ("timeout", "thirty", "thirty"),
        ("mode", "quick", "quick"),
        ("force", "yes", "force"),
        ("env", '{"PATH": "/"}', "PATH"),
    ]:
        assert f.stops_in(_qwen_call("bash", [("command", "ls"), (key, value)]), part), key
    assert f.stops_in(_qwen_call("bash", [("timeout", "3")]), "timeout")
    assert f.stops_in(_qwen_call("rm", [("command", "ls")]), "rm")


def test_qwen3_coder_with_one_call_and_seed_oss_with_special_markers(formats):
    one = formats("qwen3_coder", parallel_tool_calls=False)
    call = _qwen_call("bash", [("command", "ls")])
    assert one.stop(call) is None
    assert one.stop(f"{call}\n{call}")[1] == len(call) + 1  # the output ends after the call
    # Seed-OSS writes the same XML in markers that are special tokens of its tokenizer:
    # they are matched as the tokens.
    seed = formats("seed_oss", special=["<seed:tool_call>", "</seed:tool_call>"])
    assert "<seed:tool_call> " in seed.plan.structured_outputs.grammar
    call = _qwen_call("bash", [("command", "ls")], open_="<seed:tool_call>")
    assert seed.stop(f"Sure. {call} Done.") is None
    assert seed.calls(f"Sure. {call}") == [("bash", {"command": "ls"})]
    assert seed.stops_in(_qwen_call("bash", [("cmd", "ls")], open_="<seed:tool_call>"), "cmd")


def test_llama3_json_calls(formats):
    f = formats("llama3_json")
    two = ('{"name": "bash", "parameters": {"command": "ls", "timeout": 3}}; '
           '{"name": "note", "parameters": {"text": "x"}}')  # fmt: skip
    assert f.stop(two) is None
    assert f.calls(two) == [("bash", {"command": "ls", "timeout": 3}), ("note", {"text": "x"})]
    assert f.stops_in('{"name": "bash", "parameters": {"cmd": "ls"}}', "cmd")
    assert f.stops_in('{"name": "rm", "parameters": {}}', "rm")
    assert f.stop("The answer is 4.") is None


def test_mistral_v11_calls_with_its_special_tokens(formats):
    f = formats("mistral", special=["[TOOL_CALLS]", "[ARGS]"])
    two = 'Sure. [TOOL_CALLS]bash[ARGS]{"command": "ls"}[TOOL_CALLS]note[ARGS]{"a": 1}'
    assert f.stop(two) is None
    assert f.calls(two) == [("bash", {"command": "ls"}), ("note", {"a": 1})]
    assert f.stops_in('[TOOL_CALLS]bash[ARGS]{"cmd": "ls"}', "cmd")
    assert f.stops_in('[TOOL_CALLS]rm[ARGS]{"command": "ls"}', "rm")
    one = formats("mistral", special=["[TOOL_CALLS]", "[ARGS]"], parallel_tool_calls=False)
    assert one.stops_in(two, "[TOOL_CALLS]")  # the second call


@pytest.mark.parametrize("special", [True, False], ids=["tokens", "text"])
@pytest.mark.parametrize(
    "parser, markers, call",
    [
        ("deepseek_v31", DEEPSEEK,
         "<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{args}<｜tool▁call▁end｜>"),
        ("deepseek_v3", DEEPSEEK,
         "<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{args}\n```<｜tool▁call▁end｜>"),
        ("kimi_k2", KIMI,
         "<|tool_call_begin|>functions.{name}:{i}<|tool_call_argument_begin|>{args}<|tool_call_end|>"),
    ],
)  # fmt: skip
def test_sectioned_calls(formats, parser, markers, call, special):
    f = formats(parser, special=markers if special else None)
    opening, closing = markers[0], markers[1]

    def section(*calls: tuple[str, str]) -> str:
        inner = "\n".join(call.format(name=n, args=a, i=i) for i, (n, a) in enumerate(calls))
        return f"{opening}{inner}{closing}"

    two = "Checking. " + section(("bash", '{"command": "ls"}'), ("note", '{"x": [1]}'))
    assert f.stop(two) is None
    assert f.calls(two) == [("bash", {"command": "ls"}), ("note", {"x": [1]})]
    assert f.stops_in(section(("bash", '{"cmd": "ls"}')), "cmd")
    assert f.stops_in(section(("rm", "{}")), "rm")
    one = formats(parser, special=markers if special else None, parallel_tool_calls=False)
    assert one.stop(section(("bash", '{"command": "ls"}'))) is None
    assert one.stops_in(two, "\n" + call.split("{")[0])  # a second call in the section


GLM = ["<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"]


def _glm_call(name: str, params: list[tuple[str, str]], nl: str) -> str:
    body = "".join(f"<arg_key>{k}</arg_key>{nl}<arg_value>{v}</arg_value>{nl}" for k, v in params)
    return f"<tool_call>{name}{nl}{body}</tool_call>"


@pytest.mark.parametrize("special", [True, False], ids=["tokens", "text"])
@pytest.mark.parametrize("nl", ["\n", ""], ids=["glm45", "glm47"])
def test_glm_key_value_calls(formats, special, nl):
    f = formats("glm47", special=GLM if special else None)
    good = _glm_call("bash", [("command", "ls -la"), ("timeout", "30"), ("mode", "slow")], nl)
    text = f"Sure.{good}{_glm_call('note', [('anything', '{x}')], nl)}"
    assert f.stop(text) is None
    assert f.calls(text) == [
        ("bash", {"command": "ls -la", "timeout": 30, "mode": "slow"}),
        ("note", {"anything": "{x}"}),
    ]
    assert f.stops_in(_glm_call("bash", [("command", "ls"), ("timeout", "soon")], nl), "soon")
    assert f.stops_in(_glm_call("bash", [("cmd", "ls")], nl), "cmd")
    assert f.stops_in(_glm_call("rm", [], nl), "rm")
    one = formats("glm47", special=GLM if special else None, parallel_tool_calls=False)
    call = _glm_call("bash", [("command", "ls")], nl)
    assert one.stop(call) is None and one.stops_in(call + call, "<tool_call>")


MINIMAX = ["<minimax:tool_call>", "</minimax:tool_call>"]


def _invokes(*calls, dsml: bool = False) -> str:
    p = "｜DSML｜" if dsml else ""
    out = []
    for name, params in calls:
        body = "".join(
            f'<{p}parameter name="{k}"'
            + (f' string="{"true" if isinstance(v, str) else "false"}"' if dsml else "")
            + f">{v}</{p}parameter>\n"
            for k, v in params
        )
        out.append(f'<{p}invoke name="{name}">\n{body}</{p}invoke>')
    block = "function_calls" if dsml else "minimax:tool_call"
    return f"<{p}{block}>\n" + "\n".join(out) + f"\n</{p}{block}>"


@pytest.mark.parametrize(
    "parser, special, dsml",
    [("minimax_m2", MINIMAX, False), ("minimax_m2", None, False), ("deepseek_v32", None, True)],
    ids=["minimax-tokens", "minimax-text", "deepseek_v32"],
)
def test_invoke_blocks(formats, parser, special, dsml):
    f = formats(parser, special=special)
    two = "Let me check. " + _invokes(
        ("bash", [("command", "ls -la"), ("timeout", 30)]), ("note", [("x", "y")]), dsml=dsml
    )
    assert f.stop(two) is None
    assert f.calls(two) == [("bash", {"command": "ls -la", "timeout": 30}), ("note", {"x": "y"})]
    bad = _invokes(("bash", [("command", "ls"), ("timeout", "later")]), dsml=dsml)
    # (DeepSeek-V3.2 says a value is a string before it: an integer's says false)
    assert f.stops_in(bad, 'string="true"' if dsml else "later")
    assert f.stops_in(_invokes(("bash", [("cmd", "ls")]), dsml=dsml), "cmd")
    assert f.stops_in(_invokes(("rm", []), dsml=dsml), "rm")
    one = formats(parser, special=special, parallel_tool_calls=False)
    assert one.stop(_invokes(("bash", [("command", "ls")]), dsml=dsml)) is None
    assert one.stop(two) is not None  # a second invoke in the block
