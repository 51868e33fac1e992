"""--tokenizer-mode deepseek_v32: DeepSeek-V3.2's chat encoding (its Hub repo's Python
``encoding`` module, no Jinja template) rendering chats in place of the chat template:
the exact prompt text, its DSML tool calls read back by ``--tool-call-parser
deepseek_v32``, the config, and ``LLM.chat`` and the server's chat routes rendering
through it (a tiny random Llama with SmolLM2's tokenizer: the prompt's tokens are those of
the encoding's text, not the model's own template's)."""

from __future__ import annotations

import json
import shutil

import pytest
import requests

from tests.tiny_models import save_tiny_llama
from tests.utils import RemoteServer
from vllm import LLM, SamplingParams
from vllm.config import ModelConfig
from vllm.entrypoints.openai.protocol import validate_messages
from vllm.entrypoints.openai.tool_parsers import get_tool_parser
from vllm.exceptions import VLLMValidationError
from vllm.model_executor.model_loader import resolve_model
from vllm.transformers_utils.chat_encodings import get_chat_encoding
from vllm.transformers_utils.chat_encodings.deepseek_v32 import encode_messages, render

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
U, A, D = "<｜User｜>", "<｜Assistant｜>", "｜DSML｜"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        },
    },
}
# The tools system text, as DeepSeek's encoder writes it (the model was trained on it).
TOOLS_BLOCK = (
    "\n\n## Tools\n"
    "You have access to a set of tools you can use to answer the user's question.\n"
    f'You can invoke functions by writing a "<{D}function_calls>" block like the following '
    "as part of your reply to the user:\n"
    f"<{D}function_calls>\n"
    f'<{D}invoke name="$FUNCTION_NAME">\n'
    f'<{D}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE'
    f"</{D}parameter>\n...\n</{D}invoke>\n"
    f'<{D}invoke name="$FUNCTION_NAME2">\n...\n</{D}invoke>\n'
    f"</{D}function_calls>\n"
    "String and scalar parameters should be specified as is without any escaping or "
    'quotes, while lists and objects should use JSON format. The "string" attribute '
    'should be set to "true" for string type parameters and "false" for other types '
    "(numbers, booleans, arrays, objects).\n"
    "If the thinking_mode is enabled, then after function results you should strongly "
    "consider outputting a thinking block. Here is an example:\n"
    f"<{D}function_calls>\n...\n</{D}function_calls>\n"
    "<function_results>\n...\n</function_results>\n"
    "<think>...thinking about results</think>\n"
    "Here are the functions available in JSONSchema format:\n"
    "<functions>\n"
    '{"name": "get_weather", "description": "Weather of a city", "parameters": {"type": '
    '"object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}\n'
    "</functions>\n"
)
TWO_TURNS = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Name a river."},
]
ARGS = {"city": "杭州", "days": 3, "units": {"temp": "C"}}
CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}
CALL_DSML = (
    f"<{D}function_calls>\n"
    f'<{D}invoke name="get_weather">\n'
    f'<{D}parameter name="city" string="true">杭州</{D}parameter>\n'
    f'<{D}parameter name="days" string="false">3</{D}parameter>\n'
    f'<{D}parameter name="units" string="false">{{"temp": "C"}}</{D}parameter>\n'
    f"</{D}invoke>\n"
    f"</{D}function_calls>"
)


def as_server_gives(messages: list[dict]) -> list[dict]:
    """The messages as the server hands them to the seam (validated, tool call arguments
    parsed, reasoning under both names)."""
    return [m.for_template() for m in validate_messages(messages)]


# -- (a) a plain two-turn chat ----------------------------------------------------------


def test_two_turn_chat():
    assert encode_messages(TWO_TURNS) == (
        f"{BOS}You are terse.{U}Hi{A}</think>Hello.{EOS}{U}Name a river.{A}</think>"
    )
    # No system message: the BOS then the first user turn.
    assert encode_messages(TWO_TURNS[1:2]) == f"{BOS}{U}Hi{A}</think>"


def test_add_generation_prompt_false_leaves_the_reply_unopened():
    assert encode_messages(TWO_TURNS, add_generation_prompt=False) == (
        f"{BOS}You are terse.{U}Hi{A}</think>Hello.{EOS}{U}Name a river."
    )


def test_continue_final_message_leaves_the_assistant_turn_open():
    msgs = [*TWO_TURNS[:2], {"role": "assistant", "content": "Hel"}]
    text = encode_messages(msgs, add_generation_prompt=False, continue_final_message=True)
    assert text == f"{BOS}You are terse.{U}Hi{A}</think>Hel"
    thinking = [*TWO_TURNS[:2], {"role": "assistant", "content": "", "reasoning": "Greet"}]
    text = encode_messages(thinking, thinking=True, continue_final_message=True)
    assert text == f"{BOS}You are terse.{U}Hi{A}<think>Greet"


# -- (b) thinking on and off ------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "opener"),
    [
        (None, "</think>"),
        ({"thinking": False}, "</think>"),
        ({"thinking": True}, "<think>"),
        ({"enable_thinking": True}, "<think>"),  # as reasoning_effort sets it
    ],
)
def test_thinking_opens_only_the_last_user_turn(kwargs, opener):
    text = render(TWO_TURNS, None, True, False, kwargs)
    # Earlier user turns always close thinking; only the reply to the last one opens it.
    assert text == f"{BOS}You are terse.{U}Hi{A}</think>Hello.{EOS}{U}Name a river.{A}{opener}"


# -- (c) tools, a call, its result, a follow-up -----------------------------------------


def tool_conversation() -> list[dict]:
    call = {**CALL, "function": {**CALL["function"], "arguments": json.dumps(ARGS)}}
    return [
        {"role": "user", "content": "Weather in 杭州 for 3 days?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "assistant", "content": "Sunny."},
        {"role": "user", "content": "Thanks!"},
    ]


def test_tools_call_result_and_follow_up():
    text = render(as_server_gives(tool_conversation()), [WEATHER], True, False, None)
    assert text == (
        f"{BOS}{TOOLS_BLOCK}"
        f"{U}Weather in 杭州 for 3 days?{A}</think>"
        f"Let me look.\n\n{CALL_DSML}{EOS}"
        "\n\n<function_results>\n<result>sunny</result>\n</function_results>\n\n</think>"
        f"Sunny.{EOS}"
        f"{U}Thanks!{A}</think>"
    )
    # A system message follows the tools' own (vLLM's placement).
    with_system = [{"role": "system", "content": "Be brief."}, *tool_conversation()[:1]]
    text = encode_messages(as_server_gives(with_system), [WEATHER])
    assert text == f"{BOS}{TOOLS_BLOCK}Be brief.{U}Weather in 杭州 for 3 days?{A}</think>"


def test_rendered_calls_read_back_through_the_deepseek_v32_parser():
    args = {"city": " Paris ", "days": 1.5, "flags": [True, None]}
    second = {
        "id": "c2",
        "type": "function",
        "function": {"name": "get_weather", "arguments": args},
    }
    msgs = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [CALL, second]},
    ]
    text = encode_messages(as_server_gives(msgs))
    reply = text.split(f"{A}</think>", 1)[1]
    assert reply.endswith(EOS)
    functions = {"get_weather": WEATHER["function"]}
    out = get_tool_parser("deepseek_v32", functions).extract(reply.removesuffix(EOS), True)
    assert out.content.strip() == "Checking."
    calls = [(c.name, json.loads(c.arguments)) for c in out.calls]
    assert calls == [("get_weather", ARGS), ("get_weather", args)]


def test_several_results_form_one_block_and_thinking_reopens_after_them():
    other = {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": {}}}
    msgs = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "", "reasoning": "need both", "tool_calls": [CALL, other]},
        {"role": "tool", "content": "sunny"},
        {"role": "tool", "content": "noon"},
    ]
    text = encode_messages(as_server_gives(msgs), thinking=True)
    assert text == (
        f"{BOS}{U}q{A}<think>need both</think>\n\n{CALL_DSML[: -len(f'</{D}function_calls>')]}"
        f'<{D}invoke name="get_time">\n\n</{D}invoke>\n</{D}function_calls>{EOS}'
        "\n\n<function_results>\n<result>sunny</result>\n<result>noon</result>"
        "\n</function_results>\n\n<think>"
    )


# -- (d) earlier turns' reasoning -------------------------------------------------------


def test_reasoning_is_kept_only_after_the_last_user_turn_in_thinking_mode():
    msgs = [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "A1", "reasoning": "old thoughts"},
        {"role": "user", "content": "second"},
        {"role": "assistant", "content": "", "reasoning_content": "now", "tool_calls": [CALL]},
        {"role": "tool", "content": "sunny"},
        {"role": "assistant", "content": "Sunny.", "reasoning": "done"},
    ]
    msgs = as_server_gives(msgs)
    text = encode_messages(msgs, thinking=True)
    assert "old thoughts" not in text  # an earlier turn's: dropped
    assert text == (
        f"{BOS}{U}first{A}</think>A1{EOS}{U}second{A}<think>now</think>\n\n{CALL_DSML}{EOS}"
        "\n\n<function_results>\n<result>sunny</result>\n</function_results>\n\n<think>"
        f"done</think>Sunny.{EOS}"
    )
    # Without thinking no reasoning is written at all.
    chat = encode_messages(msgs)
    assert "now" not in chat and "done" not in chat and "<think>" not in chat


# -- what the encoding cannot express ---------------------------------------------------


@pytest.mark.parametrize(
    ("messages", "kwargs", "param", "needle"),
    [
        ([{"role": "user", "content": [{"type": "image"}]}], None, "messages", "text only"),
        ([{"role": "tool", "content": "x"}], None, "messages", "must follow an assistant"),
        ([{"role": "critic", "content": "x"}], None, "messages", "not 'critic'"),
        ([{"role": "user", "content": "x"}], {"documents": [{}]}, "documents", "documents"),
    ],
)
def test_what_the_encoding_cannot_express_is_refused(messages, kwargs, param, needle):
    with pytest.raises(VLLMValidationError, match=needle) as e:
        render(messages, None, True, False, kwargs)
    assert e.value.param == param


# -- config -----------------------------------------------------------------------------


def test_config_accepts_deepseek_v32_and_still_refuses_the_others():
    assert ModelConfig(tokenizer_mode="deepseek_v32").tokenizer_mode == "deepseek_v32"
    assert get_chat_encoding("deepseek_v32") is render
    assert get_chat_encoding("auto") is None and get_chat_encoding("hf") is None
    for mode in ("slow", "mistral", "custom"):
        with pytest.raises(ValueError, match=f"'{mode}'"):
            ModelConfig(tokenizer_mode=mode)
    with pytest.raises(ValueError, match="must be auto, hf or deepseek_v32"):
        ModelConfig(tokenizer_mode="deepseek_v4")


def test_chat_template_flag_is_ignored_with_a_warning(caplog):
    with caplog.at_level("WARNING", logger="vllm.config"):
        ModelConfig(tokenizer_mode="deepseek_v32", chat_template="{{ messages }}")
    assert "--chat-template is ignored with --tokenizer-mode deepseek_v32" in caplog.text


# -- end to end: the server's chat routes render with the encoding ----------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama with SmolLM2's tokenizer (and its Jinja template, which the
    mode must not use): the model folder and its tokenizer."""
    from transformers import AutoTokenizer

    model = tmp_path_factory.mktemp("dsv32") / "model"
    save_tiny_llama(model, vocab_size=49152, max_position_embeddings=2048)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(f"{resolve_model('SmolLM2-135M-Instruct')}/{name}", model / name)
    return model, AutoTokenizer.from_pretrained(str(model))


@pytest.mark.slow
def test_llm_chat_renders_with_the_encoding(tiny):
    model, tokenizer = tiny
    llm = LLM(str(model), tokenizer_mode="deepseek_v32", max_model_len=512,
              num_gpu_blocks_override=64)  # fmt: skip
    try:
        greedy = SamplingParams(max_tokens=1, temperature=0)
        out = llm.chat(TWO_TURNS, greedy, chat_template_kwargs={"thinking": True})[0]
        expected = f"{BOS}You are terse.{U}Hi{A}</think>Hello.{EOS}{U}Name a river.{A}<think>"
        assert out.prompt == expected
        assert out.prompt_token_ids == tokenizer(expected, add_special_tokens=False).input_ids
        msgs = [*TWO_TURNS[:2], {"role": "assistant", "content": "Hel"}]
        out = llm.chat(msgs, greedy, add_generation_prompt=False, continue_final_message=True)
        assert out[0].prompt == f"{BOS}You are terse.{U}Hi{A}</think>Hel"
        image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
        with pytest.raises(VLLMValidationError, match="deepseek_v32 renders text only"):
            llm.chat([{"role": "user", "content": [{"type": "text", "text": "a"}, image]}])
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def served(tiny, tmp_path_factory):
    """The tiny model served with --tokenizer-mode deepseek_v32 and DeepSeek's parsers."""
    model, tokenizer = tiny
    path = tmp_path_factory.mktemp("dsv32_server")
    server = RemoteServer(
        "--model", str(model), "--served-model-name", "tiny", "--max-model-len", "2048",
        "--tokenizer-mode", "deepseek_v32", "--enable-auto-tool-choice",
        "--tool-call-parser", "deepseek_v32", "--reasoning-parser", "deepseek_v3",
        "--trust-request-chat-template",
        log_path=str(path / "server.log"),
    )  # fmt: skip
    try:
        yield server, tokenizer
    finally:
        server.stop()


def post(server, route: str, body: dict) -> requests.Response:
    return requests.post(f"{server.base}/{route}", json={"model": "tiny", **body}, timeout=60)


@pytest.mark.slow
def test_server_renders_and_generates_with_the_encoding(served):
    server, tokenizer = served
    msgs = tool_conversation()
    kwargs = {"thinking": True}
    body = {"messages": msgs, "tools": [WEATHER], "chat_template_kwargs": kwargs}
    expected = render(as_server_gives(msgs), [WEATHER], True, False, kwargs)
    assert expected.endswith(f"{U}Thanks!{A}<think>")
    ids = tokenizer(expected, add_special_tokens=False).input_ids
    rendered = post(server, "v1/chat/completions/render", body)
    assert rendered.status_code == 200, rendered.text
    assert rendered.json()["token_ids"] == ids
    gen = {**body, "max_tokens": 2, "temperature": 0}
    done = post(server, "v1/chat/completions", gen)
    assert done.status_code == 200, done.text
    assert done.json()["usage"]["prompt_tokens"] == len(ids)
    streamed = post(server, "v1/chat/completions",
                    {**gen, "stream": True, "stream_options": {"include_usage": True}})  # fmt: skip
    assert streamed.status_code == 200, streamed.text
    usage = [json.loads(line[6:]) for line in streamed.text.splitlines()
             if line.startswith("data: {")][-1]["usage"]  # fmt: skip
    assert usage["prompt_tokens"] == len(ids)


@pytest.mark.slow
def test_server_refuses_images_and_a_request_template(served):
    server, _ = served
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    msgs = [{"role": "user", "content": [{"type": "text", "text": "what?"}, image]}]
    r = post(server, "v1/chat/completions", {"messages": msgs, "max_tokens": 1})
    assert r.status_code == 400
    assert "--tokenizer-mode deepseek_v32 renders text only" in r.json()["error"]["message"]
    r = post(server, "v1/chat/completions/render",
             {"messages": TWO_TURNS, "chat_template": "{{ 1 }}"})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"
    assert "cannot be used with --tokenizer-mode deepseek_v32" in r.json()["error"]["message"]


@pytest.mark.parametrize("template", [False, True])
def test_auto_mode_picks_the_encoding_for_v32_without_a_template(template, tmp_path):
    """--tokenizer-mode auto on a DeepSeek-V3.2 checkpoint (no Jinja template shipped)
    renders with its encoding, as vLLM's auto does; with a template at hand, the template."""
    import transformers
    from transformers import AutoTokenizer

    from tests.model_executor.test_deepseek_dsa import TINY
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.processor import Processor

    arch = ["DeepseekV32ForCausalLM"]  # as a released config.json names it
    transformers.DeepseekV32Config(**TINY, architectures=arch).save_pretrained(tmp_path)
    names = ["tokenizer.json", "tokenizer_config.json"] + ["chat_template.jinja"] * template
    for name in names:
        shutil.copy(f"{resolve_model('SmolLM2-135M-Instruct')}/{name}", tmp_path / name)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    assert bool(tokenizer.chat_template) == template
    config = EngineArgs(model=str(tmp_path), max_model_len=64).create_engine_config()
    processor = Processor(config, tokenizer, 2)
    assert processor.chat_encoding_mode == ("auto" if template else "deepseek_v32")
    assert (processor.chat_encoding is None) == template
