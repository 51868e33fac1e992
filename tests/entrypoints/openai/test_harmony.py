"""gpt-oss's harmony output read as OpenAI's message (``harmony.py``, ``harmony_plan.py``):
the reader on whole outputs and on every prefix (character by character, token by token),
outputs that break the format, and the chat endpoints over a scripted engine whose
"model" writes fixed harmony tokens. No gpt-oss tokenizer can be downloaded here: the
embedded model's tokenizer with the harmony markers added as special tokens stands in."""

from __future__ import annotations

import asyncio
import json
import shutil
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response

from vllm.entrypoints.openai.harmony import MARKERS, read_harmony
from vllm.entrypoints.openai.harmony_plan import HarmonyPlan, plan_harmony, uses_harmony
from vllm.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from vllm.entrypoints.openai.protocol_responses import ResponsesRequest
from vllm.entrypoints.openai.serving_chat import OpenAIServingChat
from vllm.entrypoints.openai.serving_responses import OpenAIServingResponses
from vllm.entrypoints.openai.tool_calling import ToolCallingConfig
from vllm.entrypoints.openai.tool_parsers import get_tool_parser, tool_parser_names
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.reasoning import get_reasoning_parser, reasoning_parser_names
from vllm.sampling_params import RequestOutputKind

ANALYSIS = "<|channel|>analysis<|message|>The user wants the weather. I should call it.<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>It is 18 C and sunny in Paris.<|return|>"
CALL_JSON = (
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"location": "Paris"}<|call|>'
)
CALL_PLAIN = (  # no <|constrain|>: a bare content type
    '<|channel|>commentary to=functions.get_weather json<|message|>{"location": "SF"}<|call|>'
)
CALL_IN_HEADER = (  # the recipient before the channel, as the chat template writes it
    ' to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>{"location": '
    '"Oslo"}<|call|>'
)
PREAMBLE_TWO_CALLS = (
    "<|channel|>commentary<|message|>Checking both cities.<|end|>"
    '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"location": '
    '"Paris"}<|call|><|start|>assistant<|channel|>commentary to=functions.bash <|constrain|>json'
    '<|message|>{"command": "ls -la"}<|call|>'
)
REASONING_THEN_CALL = ANALYSIS + "<|start|>assistant" + CALL_IN_HEADER
CUT_IN_ANALYSIS = "<|channel|>analysis<|message|>Let me think about the wea"  # max_tokens
CUT_IN_CALL = (
    ANALYSIS + '<|start|>assistant<|channel|>commentary to=functions.bash<|message|>{"comm'
)
CUT_IN_HEADER = ANALYSIS + "<|start|>assistant<|channel|>fin"

THOUGHT = "The user wants the weather. I should call it."
ANSWER = "It is 18 C and sunny in Paris."

# text -> (reasoning, content, [(name, arguments)])
CASES = {
    ANALYSIS + FINAL: (THOUGHT, ANSWER, []),
    (ANALYSIS + FINAL).removesuffix("<|return|>"): (THOUGHT, ANSWER, []),  # stop token left out
    "<|channel|>final<|message|>Just the answer.": (None, "Just the answer.", []),
    ANALYSIS + CALL_JSON: (THOUGHT, None, [("get_weather", '{"location": "Paris"}')]),
    CALL_PLAIN: (None, None, [("get_weather", '{"location": "SF"}')]),
    CALL_IN_HEADER: (None, None, [("get_weather", '{"location": "Oslo"}')]),
    REASONING_THEN_CALL: (THOUGHT, None, [("get_weather", '{"location": "Oslo"}')]),
    PREAMBLE_TWO_CALLS: (
        None,
        "Checking both cities.",
        [("get_weather", '{"location": "Paris"}'), ("bash", '{"command": "ls -la"}')],
    ),
    CUT_IN_ANALYSIS: ("Let me think about the wea", None, []),
    CUT_IN_CALL: (THOUGHT, None, [("bash", '{"comm')]),  # as vLLM: the call, cut
    CUT_IN_HEADER: (THOUGHT, None, []),
    # Two messages of a kind are joined by a newline, as vLLM joins them.
    "<|channel|>analysis<|message|>One.<|end|><|start|>assistant<|channel|>analysis<|message|>"
    "Two.<|end|><|start|>assistant<|channel|>final<|message|>Three.": ("One.\nTwo.", "Three.", []),
    # Not shown: a built-in tool's call, another role, an unknown channel.
    "<|channel|>analysis to=browser.search<|message|>{}<|call|>": ("{}", None, []),
    "<|channel|>commentary to=python<|message|>print(1)<|call|>": (None, None, []),
    "<|channel|>final<|message|>a<|end|><|start|>user<|message|>b<|end|>": (None, "a", []),
    "<|channel|>weird<|message|>x<|end|><|start|>assistant<|channel|>final<|message|>y": (
        None,
        "y",
        [],
    ),  # fmt: skip
    # A bare recipient is a function (vLLM's heuristic for chat completions).
    "<|channel|>commentary to=get_time<|message|><|call|>": (None, None, [("get_time", "{}")]),
}
GARBAGE = {
    "": (None, None, []),
    "Plain text, no harmony at all.": (None, "Plain text, no harmony at all.", []),
    '{"sum": 4}': (None, '{"sum": 4}', []),  # a guided output: plain JSON
    "a < b and <|chan is not a marker": (None, "a < b and <|chan is not a marker", []),
    "<|end|>stray<|return|>": (None, "stray", []),
    "<|channel|>analysis<|message|>a<|end|>junk between<|start|>assistant<|channel|>final"
    "<|message|>b": ("a", "junk betweenassistantfinalb", []),
    "<|channel|>final<|message|>x<|return|>more text": (None, "x\nmore text", []),
    "<|channel|>" + "x" * 300 + "<|message|>y": (None, "x" * 300 + "y", []),  # no header
    "<|channel|>analysis<|message|>a<|channel|>final<|message|>b": ("a", "b", []),  # no <|end|>
    "<|channel|>final<|message|>x<|endoftext|>y<|reserved_200013|>": (None, "xy", []),
    "<|message|><|message|><|constrain|>": (None, None, []),
}


SPECIAL = [*MARKERS, "<|endoftext|>", "<|reserved_200013|>"]


def read(text: str) -> tuple[str | None, str | None, list[tuple[str, str]]]:
    message, _ = HarmonyPlan(surface_calls=True, keep_special_tokens=True, reasoning=_gptoss()
                             ).message(text, "stop")  # fmt: skip
    calls = [
        (c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])
    ]
    return message.get("reasoning"), message["content"], calls


def _gptoss():
    return get_reasoning_parser("openai_gptoss")


@pytest.mark.parametrize("text, expected", list(CASES.items()) + list(GARBAGE.items()))
def test_whole_output(text, expected):
    assert read(text) == expected


def assemble(text: str, pieces: list[str], plan: HarmonyPlan | None = None):
    """Feed ``pieces`` as stream deltas; the fields as a client assembles them."""
    assert "".join(pieces) == text
    plan = plan or HarmonyPlan(surface_calls=True, keep_special_tokens=True, reasoning=_gptoss())
    streamer = plan.streamer()
    reasoning, content, found = "", "", {}
    for i, piece in enumerate(pieces):
        delta = streamer.delta(piece, final=i == len(pieces) - 1)
        for value in delta.values():  # no special token reaches the client
            assert not any(m in json.dumps(value) for m in SPECIAL), delta
        reasoning += delta.get("reasoning", "")
        content += delta.get("content", "")
        for d in delta.get("tool_calls", []):
            if "id" in d:
                assert d["index"] == len(found) and d["type"] == "function"
                assert d["id"].startswith("call_")
                found[d["index"]] = [d["function"]["name"], ""]
            found[d["index"]][1] += d["function"]["arguments"]
    return reasoning or None, content or None, [tuple(v) for v in found.values()]


@pytest.mark.parametrize("text, expected", list(CASES.items()) + list(GARBAGE.items()))
def test_streamed_by_characters_and_chunks_adds_up_to_the_whole(text, expected):
    assert assemble(text, list(text)) == expected
    chunks = [text[i : i + 7] for i in range(0, len(text), 7)] or [""]
    assert assemble(text, chunks) == expected


@pytest.fixture(scope="module")
def harmony_tokenizer(tmp_path_factory):
    """The embedded tokenizer with the harmony markers as special tokens."""
    from transformers import AutoTokenizer

    from vllm.config import DEFAULT_MODEL
    from vllm.model_executor.model_loader import resolve_model

    folder = tmp_path_factory.mktemp("harmony_tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{resolve_model(DEFAULT_MODEL)}/{name}", folder / name)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_special_tokens({"additional_special_tokens": list(MARKERS)})
    return tokenizer


def token_pieces(tokenizer, text: str) -> tuple[list[int], list[str]]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces, sent = [], ""
    for k in range(1, len(ids) + 1):
        now = tokenizer.decode(ids[:k], skip_special_tokens=False)
        pieces.append(now[len(sent) :])
        sent = now
    return ids, pieces


def test_each_marker_is_one_special_token(harmony_tokenizer):
    for marker in MARKERS:
        ids = harmony_tokenizer.encode(marker, add_special_tokens=False)
        assert len(ids) == 1 and harmony_tokenizer.decode(ids) == marker
        assert harmony_tokenizer.decode(ids, skip_special_tokens=True) == ""


@pytest.mark.parametrize("text, expected", list(CASES.items()) + list(GARBAGE.items())[:6])
def test_streamed_token_by_token_adds_up_to_the_whole(harmony_tokenizer, text, expected):
    ids, pieces = token_pieces(harmony_tokenizer, text)
    assert "".join(pieces) == text
    assert assemble(text, pieces or [""]) == expected


def test_readings_only_grow():
    for text in list(CASES) + list(GARBAGE):
        last = read_harmony(text, final=True)
        for k in range(len(text) + 1):
            now = read_harmony(text[:k], final=False)
            for field in ("reasoning", "content"):
                assert (getattr(last, field) or "").startswith(getattr(now, field) or ""), (
                    text[:k],
                    field,
                )
            assert len(now.calls) <= len(last.calls)
            for a, b in zip(now.calls, last.calls[: len(now.calls)], strict=True):
                assert a.function_name == b.function_name and b.text.startswith(a.text)


WORDS = [
    "analysis",
    "final",
    "commentary",
    " to=functions.f",
    " json",
    "assistant",
    "hi",
    " ",
    "\n",
]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(list(MARKERS) + WORDS + ["<|endoftext|>", "<", "|"]), max_size=24))
def test_any_sequence_is_read_without_error_or_visible_markers(parts):
    text = "".join(parts)
    plan = HarmonyPlan(surface_calls=True, keep_special_tokens=True, reasoning=_gptoss())
    message, _ = plan.message(text, "length")
    for key in ("reasoning", "content"):
        assert not any(m in (message.get(key) or "") for m in SPECIAL)
    streamed = assemble(text, parts or [""])
    calls = [
        (c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])
    ]
    assert streamed == (message.get("reasoning"), message["content"], calls)


def test_the_registered_parsers_read_harmony_alone():
    assert "openai" in tool_parser_names() and "openai_gptoss" in reasoning_parser_names()
    extracted = get_tool_parser("openai").extract(PREAMBLE_TWO_CALLS, final=True)
    assert extracted.content == "Checking both cities."
    assert [(c.name, c.arguments) for c in extracted.calls][1] == ("bash", '{"command": "ls -la"}')
    assert get_tool_parser("openai").keeps_special_tokens
    split = _gptoss().extract(ANALYSIS + FINAL, final=True)
    assert (split.reasoning, split.content, split.ended) == (THOUGHT, ANSWER, True)
    assert not _gptoss().extract(CUT_IN_ANALYSIS, final=False).ended
    assert _gptoss().end_of_reasoning is None  # a guided output's grammar: from the start


def test_an_assistant_turns_reasoning_reaches_gpt_oss_template_as_thinking():
    turn = ChatMessage.model_validate({"role": "assistant", "content": "", "reasoning": "Hm."})
    assert turn.for_template()["thinking"] == "Hm."


# -- which model is harmony -------------------------------------------------------------
def test_gpt_oss_models_and_harmony_parser_names_use_harmony(tmp_path):
    import transformers

    transformers.GptOssConfig(num_hidden_layers=2).save_pretrained(tmp_path / "oss")
    transformers.LlamaConfig(num_hidden_layers=2).save_pretrained(tmp_path / "llama")
    none = ToolCallingConfig()
    assert uses_harmony(SimpleNamespace(model=str(tmp_path / "oss"), hf_overrides=None), none)
    llama = SimpleNamespace(model=str(tmp_path / "llama"), hf_overrides=None)
    assert not uses_harmony(llama, none)
    assert not uses_harmony(None, none)
    assert uses_harmony(llama, ToolCallingConfig(reasoning_parser="openai_gptoss"))
    assert uses_harmony(
        llama, ToolCallingConfig(enable_auto_tool_choice=True, tool_call_parser="openai")
    )


# -- the endpoints over a scripted engine ---------------------------------------------
class _ScriptedStream:
    engine_latency_s = None
    prompt_token_ids = [1, 2, 3]

    def __init__(self, outputs: list[RequestOutput]) -> None:
        self.outputs = outputs

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if not self.outputs:
            raise StopAsyncIteration
        return self.outputs.pop(0)

    async def aclose(self) -> None:
        pass

    def put(self, item) -> None:
        pass


STOP_TOKENS = ("<|return|>", "<|call|>")


def scripted_engine(tokenizer, text: str, model_config=None, finish: str = "stop"):
    """An engine whose every request outputs the tokens of ``text``, detokenized as the
    engine does: with the request's ``skip_special_tokens``, the stop token's text left
    out; one final output, or one delta per token when streaming."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    stopped = finish == "stop" and any(text.endswith(t) for t in STOP_TOKENS)
    seen: dict = {}

    async def add_request(prompt, params, request_id, **kw):
        seen["params"] = params

        def decode(k: int) -> str:
            shown = ids[: min(k, len(ids) - 1)] if stopped and k == len(ids) else ids[:k]
            return tokenizer.decode(shown, skip_special_tokens=params.skip_special_tokens)

        def out(piece, token_ids, done):
            c = CompletionOutput(0, piece, token_ids, finish_reason=finish if done else None)
            return RequestOutput(request_id, prompt, [1, 2, 3], [c], done)

        if params.output_kind != RequestOutputKind.DELTA:
            return _ScriptedStream([out(decode(len(ids)), ids, True)])
        outputs, sent = [], ""
        for k in range(1, len(ids) + 1):
            now = decode(k)
            outputs.append(out(now[len(sent) :], ids[k - 1 : k], k == len(ids)))
            sent = now
        return _ScriptedStream(outputs)

    engine = SimpleNamespace(
        add_request=add_request,
        apply_chat_template=lambda messages, *args: "<|start|>user<|message|>hi<|end|>",
        chat_template="{{ messages }} {{ tools }}",
        decode=lambda ids, skip=False: tokenizer.decode(ids, skip_special_tokens=skip),
        config=SimpleNamespace(
            cache_config=SimpleNamespace(block_size=16, enable_prefix_caching=False),
            model_config=model_config,
        ),
    )
    return engine, seen


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"location": {"type": "string"}}},
    },
}


@pytest.fixture(scope="module")
def oss_model(tmp_path_factory):
    import transformers

    folder = tmp_path_factory.mktemp("oss")
    transformers.GptOssConfig(num_hidden_layers=2).save_pretrained(folder)
    return SimpleNamespace(model=str(folder), hf_overrides=None)


def serve(tokenizer, model, text: str, body: dict, finish="stop", config=None):
    engine, seen = scripted_engine(tokenizer, text, model, finish)
    serving = OpenAIServingChat(engine, "m")
    serving.tool_config = config or ToolCallingConfig()  # no parser flag: the model type
    request = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "Weather in Paris?"}], **body}
    )

    async def run():
        response = await serving.create_chat_completion(request)
        if not request.stream:
            return json.loads(response.body)
        events = [e async for e in response.body_iterator]
        return [json.loads(e[6:]) for e in events if e != "data: [DONE]\n\n"]

    return asyncio.run(run()), seen


@pytest.mark.parametrize("stream", [False, True])
def test_chat_reasoning_and_answer(harmony_tokenizer, oss_model, stream):
    body = {"stream": stream, "stream_options": {"include_usage": True}} if stream else {}
    out, seen = serve(harmony_tokenizer, oss_model, ANALYSIS + FINAL, body)
    assert seen["params"].skip_special_tokens is False  # though the request did not ask
    if stream:
        chunks = [ChatCompletionChunk.model_validate(e) for e in out]  # the openai types
        deltas = [e["choices"][0]["delta"] for e in out if e["choices"]]
        reasoning = "".join(d.get("reasoning", "") for d in deltas)
        content = "".join(d.get("content") or "" for d in deltas)
        assert (reasoning, content) == (THOUGHT, ANSWER)
        assert chunks[-2].choices[0].finish_reason == "stop"
        usage = out[-1]["usage"]
    else:
        message = ChatCompletion.model_validate(out).choices[0].message
        assert (message.content, message.reasoning, message.tool_calls) == (ANSWER, THOUGHT, None)
        assert out["choices"][0]["finish_reason"] == "stop"
        usage = out["usage"]
    thought = len(harmony_tokenizer.encode(THOUGHT, add_special_tokens=False))
    assert usage["completion_tokens_details"] == {"reasoning_tokens": thought}


@pytest.mark.parametrize("stream", [False, True])
def test_chat_tool_calls(harmony_tokenizer, oss_model, stream):
    text = ANALYSIS + CALL_JSON[: -len("<|call|>")] + "<|call|>"
    out, _ = serve(harmony_tokenizer, oss_model, text, {"tools": [WEATHER], "stream": stream})
    if stream:
        deltas = [e["choices"][0]["delta"] for e in out]
        pieces = [p for d in deltas for p in d.get("tool_calls", [])]
        assert pieces[0]["function"]["name"] == "get_weather" and pieces[0]["id"].startswith(
            "call_"
        )
        args = "".join(p["function"]["arguments"] for p in pieces)
        assert json.loads(args) == {"location": "Paris"}
        assert not "".join(d.get("content") or "" for d in deltas)
        assert out[-1]["choices"][0]["finish_reason"] == "tool_calls"
    else:
        choice = out["choices"][0]
        call = choice["message"]["tool_calls"][0]
        assert call["function"] == {"name": "get_weather", "arguments": '{"location": "Paris"}'}
        assert choice["message"]["content"] is None and choice["finish_reason"] == "tool_calls"
        assert choice["message"]["reasoning"] == THOUGHT


def test_chat_skip_special_tokens_false_and_include_reasoning_false(harmony_tokenizer, oss_model):
    body = {"skip_special_tokens": False, "include_reasoning": False}
    out, _ = serve(harmony_tokenizer, oss_model, ANALYSIS + FINAL, body)
    assert out["choices"][0]["message"] == {"role": "assistant", "content": ANSWER}
    out, _ = serve(harmony_tokenizer, oss_model, ANALYSIS + FINAL, {"separate_reasoning": False})
    assert out["choices"][0]["message"]["content"] == THOUGHT + "\n" + ANSWER


def test_chat_cut_by_max_tokens_and_tool_choice_none(harmony_tokenizer, oss_model):
    out, _ = serve(harmony_tokenizer, oss_model, CUT_IN_ANALYSIS, {"max_tokens": 9}, "length")
    choice = out["choices"][0]
    assert choice["message"]["reasoning"] == "Let me think about the wea"
    assert choice["message"]["content"] is None and choice["finish_reason"] == "length"
    # tool_choice "none": a call the model writes anyway is dropped, as vLLM does.
    body = {"tools": [WEATHER], "tool_choice": "none"}
    out, _ = serve(harmony_tokenizer, oss_model, PREAMBLE_TWO_CALLS, body)
    choice = out["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "Checking both cities."}
    assert choice["finish_reason"] == "stop"


def test_chat_required_tool_choice_is_guided_plain_json(harmony_tokenizer, oss_model):
    text = '[{"name": "get_weather", "arguments": {"location": "Paris"}}]'
    body = {"tools": [WEATHER], "tool_choice": "required"}
    out, seen = serve(harmony_tokenizer, oss_model, text, body)
    assert seen["params"].structured_outputs.after_reasoning is None
    assert out["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"


def test_a_model_that_is_not_harmony_keeps_its_text(harmony_tokenizer, tmp_path):
    import transformers

    transformers.LlamaConfig(num_hidden_layers=2).save_pretrained(tmp_path)
    llama = SimpleNamespace(model=str(tmp_path), hf_overrides=None)
    out, seen = serve(harmony_tokenizer, llama, ANALYSIS + FINAL, {})
    assert seen["params"].skip_special_tokens is True
    assert (
        out["choices"][0]["message"]["content"] == "analysis" + THOUGHT + "assistantfinal" + ANSWER
    )


def test_responses_output_reasoning_then_the_call(harmony_tokenizer, oss_model):
    engine, _ = scripted_engine(harmony_tokenizer, REASONING_THEN_CALL, oss_model)
    serving = OpenAIServingResponses(OpenAIServingChat(engine, "m"))
    serving.chat.tool_config = ToolCallingConfig()
    tool = {
        "type": "function",
        "name": "get_weather",
        "parameters": WEATHER["function"]["parameters"],
    }
    body = {"input": "Weather in Oslo?", "tools": [tool]}
    request = ResponsesRequest.model_validate(body)
    response = json.loads(asyncio.run(serving.create_response(request)).body)
    parsed = Response.model_validate(response)
    kinds = [item.type for item in parsed.output]
    assert kinds == ["reasoning", "function_call"]
    assert parsed.output[0].content[0].text == THOUGHT
    assert (parsed.output[1].name, json.loads(parsed.output[1].arguments)) == (
        "get_weather",
        {"location": "Oslo"},
    )


def test_plan_harmony_checks_like_every_chat_request():
    from vllm.exceptions import VLLMValidationError

    bad = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"}
    )
    with pytest.raises(VLLMValidationError, match="needs tools"):
        plan_harmony(bad, ToolCallingConfig())


def test_responses_stream_reasoning_then_the_call(harmony_tokenizer, oss_model):
    engine, _ = scripted_engine(harmony_tokenizer, REASONING_THEN_CALL, oss_model)
    serving = OpenAIServingResponses(OpenAIServingChat(engine, "m"))
    serving.chat.tool_config = ToolCallingConfig()
    tool = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}
    request = ResponsesRequest.model_validate(
        {"input": "Weather in Oslo?", "tools": [tool], "stream": True}
    )

    async def run():
        response = await serving.create_response(request)
        return [json.loads(e.split("data: ", 1)[1]) async for e in response.body_iterator]

    events = asyncio.run(run())
    thought = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    args = "".join(
        e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"
    )
    assert thought == THOUGHT and json.loads(args) == {"location": "Oslo"}
    done = Response.model_validate(events[-1]["response"])
    assert [item.type for item in done.output] == ["reasoning", "function_call"]
    assert not any("<|" in json.dumps(e) for e in events)
