"""/v1/messages (the Anthropic Messages API): block conversion, refusals, job identity and
the event stream (no server), then end to end with the official anthropic client
(``slow``)."""

from __future__ import annotations

import json

import anthropic
import pytest
import requests
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter, ValidationError

from vllm.entrypoints.anthropic.protocol import (
    CountTokensRequest,
    MessagesRequest,
    anthropic_usage,
    chat_response_format,
    chat_tool_choice,
    chat_tools,
    content_blocks,
    stop_reason,
    template_kwargs,
    to_chat,
)
from vllm.entrypoints.anthropic.serving import _BlockEvents, _merge_system, as_anthropic
from vllm.entrypoints.openai.api_server import error_response
from vllm.exceptions import VLLMValidationError
from vllm_continuum import claude_code

from ..openai.test_tool_calling_e2e import MODEL, agent_server

EVENT = TypeAdapter(RawMessageStreamEvent)


def request(**kw) -> MessagesRequest:
    body = {"model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": "Hi"}]}
    return MessagesRequest.model_validate({**body, **kw})


def param_of(exc: pytest.ExceptionInfo) -> str | None:
    err = exc.value
    if isinstance(err, ValidationError):  # raised in a model validator
        err = err.errors()[0]["ctx"]["error"]
    return err.param


# -- blocks -> chat messages --------------------------------------------------------------
def test_a_tool_loop_becomes_chat_messages():
    conv = to_chat(
        request(
            system=[
                {"type": "text", "text": "x-anthropic-billing-header: cc_version=2; cch=ab12"},
                {
                    "type": "text",
                    "text": "You are an agent.",
                    "cache_control": {"type": "ephemeral"},
                },
            ],
            messages=[
                {"role": "user", "content": [{"type": "text", "text": "List files."}]},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "Use ls.", "signature": "sig"},
                        {"type": "text", "text": "Running ls."},
                        {
                            "type": "tool_use",
                            "id": "toolu_1",
                            "name": "bash",
                            "input": {"cmd": "ls"},
                        },
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_1",
                            "content": [{"type": "text", "text": "a.py"}],
                            "cache_control": {"type": "ephemeral", "ttl": "1h"},
                        },
                        {"type": "text", "text": "Now read it."},
                    ],
                },
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t2", "name": "cat", "input": {}}],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "t2",
                            "content": "no",
                            "is_error": True,
                        }
                    ],
                },
            ],
        )
    )
    # The billing header (a per-request hash) is dropped: the prompt's head stays cacheable.
    assert conv.messages == [
        {"role": "system", "content": "You are an agent."},
        {"role": "user", "content": "List files."},
        {
            "role": "assistant",
            "content": "Running ls.",
            "reasoning": "Use ls.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "bash", "arguments": '{"cmd": "ls"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "a.py"},
        {"role": "user", "content": "Now read it."},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "t2", "type": "function", "function": {"name": "cat", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "t2", "content": "no", "is_error": True},
    ]
    assert conv.cache_ttls == [300.0, 3600.0]  # 5 minutes unless given


def test_the_requests_own_cache_control_and_the_tools_are_breakpoints():
    tool = {"name": "f", "input_schema": {"type": "object"}, "cache_control": {"type": "ephemeral"}}
    conv = to_chat(request(tools=[tool], cache_control={"type": "ephemeral", "ttl": "1h"}))
    assert conv.cache_ttls == [300.0, 3600.0]


def test_inline_system_messages_are_kept_or_merged():
    conv = to_chat(
        request(
            system="S",
            messages=[
                {"role": "user", "content": "a"},
                {"role": "system", "content": [{"type": "text", "text": "reminder"}]},
                {"role": "user", "content": "b"},
            ],
        )
    )
    assert [m["role"] for m in conv.messages] == ["system", "user", "system", "user"]
    assert _merge_system(conv.messages) == [
        {"role": "system", "content": "S\n\nreminder"},
        {"role": "user", "content": "a"},
        {"role": "user", "content": "b"},
    ]


def test_image_blocks_become_image_parts_in_their_order():
    png = {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}
    conv = to_chat(
        request(
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "source": png},
                        {"type": "text", "text": "this, and"},
                        {"type": "image", "source": {"type": "url", "url": "https://x/y.jpg"}},
                        {"type": "text", "text": " that?"},
                    ],
                }
            ]
        )
    )
    assert conv.messages == [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
                {"type": "text", "text": "this, and"},
                {"type": "image_url", "image_url": {"url": "https://x/y.jpg"}},
                {"type": "text", "text": " that?"},
            ],
        }
    ]
    with pytest.raises(VLLMValidationError, match="source must be") as e:
        to_chat(request(messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "file", "file_id": "f"}}]}]))  # fmt: skip
    assert e.value.param == "messages"


def test_a_tool_results_screenshot_becomes_an_image_part_of_the_tool_message():
    """A computer-use agent's turn: the tool's text and screenshot in one tool_result."""
    png = {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}
    call = {"type": "tool_use", "id": "t1", "name": "screenshot", "input": {}}
    result = {"type": "tool_result", "tool_use_id": "t1", "content": [
        {"type": "text", "text": "clicked"}, {"type": "image", "source": png},
        {"type": "text", "text": "done"}]}  # fmt: skip
    conv = to_chat(request(messages=[
        {"role": "user", "content": "click OK"},
        {"role": "assistant", "content": [call]},
        {"role": "user", "content": [result, {"type": "text", "text": "and now?"}]},
    ]))  # fmt: skip
    assert conv.messages[2:] == [
        {
            "role": "tool",
            "tool_call_id": "t1",
            "content": [
                {"type": "text", "text": "clicked"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
                {"type": "text", "text": "\ndone"},
            ],
        },
        {"role": "user", "content": "and now?"},
    ]
    # Its text is what the same result without the image would give the template.
    from vllm.entrypoints.openai.protocol import validate_messages

    message = validate_messages([conv.messages[2]])[0]
    assert message.content == "clicked\ndone"
    assert message.image_urls == ["data:image/png;base64,iVBORw0KGgo="]
    bad = {**result, "content": [{"type": "image", "source": {"type": "file", "file_id": "f"}}]}
    with pytest.raises(VLLMValidationError, match="source must be") as e:
        to_chat(request(messages=[{"role": "user", "content": [bad]}]))
    assert e.value.param == "messages"


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": [{"type": "image", "source": {"type": "base64"}}]}],
        [{"role": "user", "content": [{"type": "document", "source": {}}]}],
        [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": [{"type": "server_tool_use", "id": "s", "name": "w"}]},
        ],
        [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "first"},
                    {"type": "tool_result", "tool_use_id": "t", "content": "late"},
                ],
            }
        ],
        [
            {
                "role": "user",
                "content": [{"type": "text", "text": "x", "cache_control": {"type": "x"}}],
            }
        ],
        [{"role": "user", "content": "x", "name": "bob"}],
        [{"role": "tool", "content": "x"}],
        [
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "t", "name": "f", "input": 3}],
            }
        ],
    ],
)
def test_blocks_this_server_cannot_take_are_400s_naming_messages(messages):
    with pytest.raises(VLLMValidationError) as e:
        to_chat(request(messages=messages))
    assert e.value.param == "messages"


@pytest.mark.parametrize(
    "field, value, param",
    [
        ("container", "cntr_1", "container"),
        ("mcp_servers", [{"type": "url", "url": "http://x"}], "mcp_servers"),
        ("speed", "fast", "speed"),
        ("context_management", {"edits": [{"type": "compact_20260112"}]}, "context_management"),
        (
            "context_management",
            {"edits": [{"type": "clear_tool_uses_20250919", "keep": 3}]},
            "context_management",
        ),
        (
            "context_management",
            {"edits": [{"type": "clear_thinking_20251015", "keep": {"type": "all", "x": 1}}]},
            "context_management",
        ),
        ("thinking", {"type": "enabled", "budget_tokens": 512}, "thinking.budget_tokens"),
        ("thinking", {"type": "enabled", "budget_tokens": 2048}, "thinking.budget_tokens"),
        ("thinking", {"type": "sometimes"}, "thinking"),
        ("thinking", {"type": "disabled", "display": "omitted"}, "thinking"),
    ],
)
def test_unimplemented_or_bad_fields_are_refused_by_name(field, value, param):
    with pytest.raises((VLLMValidationError, ValidationError)) as e:
        request(**{field: value})  # max_tokens 16: no budget fits
    assert param_of(e) == param


def test_what_claude_code_sends_by_default_passes():
    r = request(
        service_tier="auto",
        speed="standard",
        context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        user_profile_id="u",
        thinking={"type": "adaptive", "display": "summarized"},
        metadata={"user_id": "x"},
        some_new_field=1,  # unknown: ignored (logged), as chat
    )
    assert r.thinking == {"type": "adaptive", "display": "summarized"}
    assert CountTokensRequest.model_validate({"model": MODEL, "messages": r.messages})


def test_tools_and_choices_become_chats():
    tools = [
        {
            "name": "bash",
            "description": "Run",
            "input_schema": {"properties": {"cmd": {"type": "string"}}},
            "eager_input_streaming": True,
            "cache_control": {"type": "ephemeral"},
        }
    ]
    assert chat_tools(tools) == [
        {
            "type": "function",
            "function": {
                "name": "bash",
                "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
                "description": "Run",
            },
        }
    ]
    for bad in (
        [{"type": "web_search_20250305", "name": "web_search"}],
        [{"type": "bash_20250124", "name": "bash"}],
        [{"name": "f", "input_schema": {}, "input_examples": [{"a": 1}]}],
        [{"name": "f", "input_schema": {}, "defer_loading": True}],
        [{"name": "f"}],
    ):
        with pytest.raises(VLLMValidationError) as e:
            chat_tools(bad)
        assert e.value.param == "tools"
    assert chat_tool_choice({"type": "any"}) == ("required", None)
    assert chat_tool_choice({"type": "auto", "disable_parallel_tool_use": True}) == ("auto", False)
    assert chat_tool_choice({"type": "tool", "name": "bash"}) == (
        {"type": "function", "function": {"name": "bash"}},
        None,
    )
    for bad in ({"type": "tool"}, {"type": "some"}, {"type": "auto", "name": "x"}):
        with pytest.raises(VLLMValidationError) as e:
            chat_tool_choice(bad)
        assert e.value.param == "tool_choice"


def test_output_format_and_thinking_switch():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert chat_response_format({"format": {"type": "json_schema", "schema": schema}}) == {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": schema},
    }
    for bad in ({"effort": "extreme"}, {"format": {"type": "json_schema"}}, {"verbosity": 1}):
        with pytest.raises(VLLMValidationError):
            chat_response_format(bad)
    assert chat_response_format({"effort": "high"}) is None
    assert template_kwargs({"type": "disabled"}, None, None) == {"enable_thinking": False}
    assert template_kwargs({"type": "adaptive"}, {"effort": "high"}, {"x": 1}) == {
        "x": 1,
        "enable_thinking": True,
        "reasoning_effort": "high",
    }
    # The request's own variables win.
    kept = {"enable_thinking": True, "reasoning_effort": "low"}
    assert template_kwargs({"type": "disabled"}, {"effort": "max"}, kept) == kept
    assert template_kwargs(None, None, None) is None


# -- chat output -> blocks ----------------------------------------------------------------
def test_a_chat_message_becomes_content_blocks():
    message = {
        "role": "assistant",
        "reasoning": "think",
        "content": "text",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": '{"a": '}},
        ],
    }
    blocks = content_blocks(message)
    assert blocks == [
        {"type": "thinking", "thinking": "think", "signature": ""},
        {"type": "text", "text": "text"},
        {"type": "tool_use", "id": "c1", "name": "f", "input": {"a": 1}},
        {"type": "text", "text": '{"a": '},  # not runnable: kept as text, not dropped
    ]
    body = {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": MODEL,
        "content": blocks,
        "stop_reason": "tool_use",
        "stop_sequence": None,
        "usage": anthropic_usage(40, 5, 16, 16),
    }
    assert Message.model_validate(body).usage.input_tokens == 8


def test_stop_reasons():
    assert stop_reason("length", None, True) == ("max_tokens", None)
    assert stop_reason("stop", None, True) == ("tool_use", None)
    assert stop_reason("stop", "END", False) == ("stop_sequence", "END")
    assert stop_reason("stop", 2, False) == ("end_turn", None)  # a stop token id
    assert stop_reason("stop", None, False) == ("end_turn", None)


def test_block_events_follow_anthropics_types():
    blocks = _BlockEvents()
    events = []
    for delta in (
        {"reasoning": "Let me"},
        {"reasoning": " see."},
        {"content": "Calling."},
        {"tool_calls": [{"index": 0, "id": "c0", "function": {"name": "f", "arguments": '{"a"'}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]},
        {"tool_calls": [{"index": 1, "id": "c1", "function": {"name": "g", "arguments": ""}}]},
        {},
    ):
        events += blocks.delta(delta)
    events += blocks.close()
    parsed = []
    for e in events:
        kind, data = e.split("\n")[:2]
        payload = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {payload['type']}"
        parsed.append(EVENT.validate_python(payload))
    kinds = [(p.type, getattr(p, "index", None)) for p in parsed]
    assert kinds == [
        ("content_block_start", 0),
        ("content_block_delta", 0),
        ("content_block_delta", 0),
        ("content_block_stop", 0),
        ("content_block_start", 1),
        ("content_block_delta", 1),
        ("content_block_stop", 1),
        ("content_block_start", 2),
        ("content_block_delta", 2),
        ("content_block_delta", 2),
        ("content_block_stop", 2),
        ("content_block_start", 3),
        ("content_block_stop", 3),
    ]
    assert blocks.called
    args = "".join(
        p.delta.partial_json for p in parsed if p.type == "content_block_delta" and p.index == 2
    )
    assert json.loads(args) == {"a": 1}


def test_claude_code_sessions_and_their_conversations():
    sid = "54c1eb09-bc4c-4d2f-98eb-6d2ab2d5e2fe"
    json_form = {"user_id": json.dumps({"device_id": "d", "account_uuid": "", "session_id": sid})}
    legacy = {"user_id": f"user_{'ab' * 32}_account__session_{sid}"}
    assert claude_code.session_id({}, json_form) == sid
    assert claude_code.session_id({}, legacy) == sid
    assert claude_code.session_id({"x-claude-code-session-id": "h"}, legacy) == "h"
    for metadata in (None, {}, {"user_id": "alice"}, {"user_id": "{not json"}, {"user_id": 3}):
        assert claude_code.session_id({}, metadata) is None
    # One job per conversation: the billing header (new every request) does not count;
    # another system prompt (a subagent, a side request) is another job.
    main = [
        {"type": "text", "text": f"{claude_code.BILLING_HEADER}: cch=1;"},
        {"type": "text", "text": "A"},
    ]
    again = [
        {"type": "text", "text": f"{claude_code.BILLING_HEADER}: cch=2;"},
        {"type": "text", "text": "A"},
    ]
    job = claude_code.job_id({}, {"system": main, "metadata": json_form})
    assert job.startswith(f"{sid}/") and len(job) == len(sid) + 13
    assert claude_code.job_id({}, {"system": again, "metadata": json_form}) == job
    assert claude_code.job_id({}, {"system": "A", "metadata": json_form}) == job
    assert claude_code.job_id({}, {"system": "B", "metadata": json_form}) != job
    assert claude_code.job_id({}, {"system": "A"}) is None
    # Two subagents with one system prompt (Claude Code 2.1.139+ names each): two jobs.
    sub = [{"x-claude-code-agent-id": f"a{i}", "x-claude-code-session-id": sid} for i in (1, 2)]
    jobs = {claude_code.job_id(h, {"system": "A"}) for h in sub}
    assert len(jobs) == 2 and job not in jobs


def test_errors_are_reshaped():
    shaped = as_anthropic(error_response(404, "The model `x` does not exist.", "NotFoundError"))
    assert shaped.status_code == 404
    assert json.loads(shaped.body) == {
        "type": "error",
        "error": {"type": "not_found_error", "message": "The model `x` does not exist."},
    }
    assert json.loads(as_anthropic(error_response(500, "boom", "X")).body)["error"]["type"] == (
        "api_error"
    )


# -- end to end ---------------------------------------------------------------------------
WEATHER = {
    "name": "get_weather",
    "description": "Get the current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
    },
}
SYSTEM = "You are a weather assistant. Call get_weather to learn the weather of a city."
GREEDY = {"temperature": 0}  # extra_body: the 2.x anthropic client has no temperature argument
# Guided to one call: left to itself, the 135M model repeats calls until max_tokens.
ONE_CALL = {"type": "any", "disable_parallel_tool_use": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    out = tmp_path_factory.mktemp("messages")
    srv = agent_server(out)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.base, api_key="unused", max_retries=0)


def ask(client, text="What is the capital of France?", **kw):
    kw = {"max_tokens": 24, "extra_body": GREEDY, **kw}
    return client.messages.create(model=MODEL, messages=[{"role": "user", "content": text}], **kw)


def call_weather(client, city="Paris", **kw):
    messages = kw.pop("messages", [{"role": "user", "content": f"What is the weather in {city}?"}])
    return client.messages.create(
        model=MODEL,
        system=SYSTEM,
        messages=messages,
        tools=[WEATHER],
        tool_choice=kw.pop("tool_choice", ONE_CALL),
        max_tokens=kw.pop("max_tokens", 40),
        extra_body=GREEDY,
        **kw,
    )


def answer_call(client, question, first, call, result: str, **kw):
    """The turn after ``first`` called ``call``: its result, and no further call."""
    return call_weather(
        client,
        messages=[
            question,
            {
                "role": "assistant",
                "content": [b.model_dump(exclude_none=True) for b in first.content],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": call.id, "content": result}],
            },
        ],
        tool_choice={"type": "none"},
        **kw,
    )


@pytest.mark.slow
def test_a_text_answer_is_anthropics_message(server, client):
    msg = ask(client)
    assert msg.id.startswith("msg_") and msg.type == "message" and msg.role == "assistant"
    assert msg.model == MODEL and msg.stop_reason == "end_turn" and msg.stop_sequence is None
    (block,) = msg.content
    assert block.type == "text" and block.text
    u = msg.usage
    assert 0 < u.output_tokens <= 24
    prompt = u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens
    assert (
        client.messages.count_tokens(
            model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}]
        ).input_tokens
        == prompt
    )
    # The second time, the prompt's full blocks are read from the cache.
    again = ask(client).usage
    assert (
        again.cache_read_input_tokens == prompt // 16 * 16
        and again.cache_creation_input_tokens == 0
    )


@pytest.mark.slow
def test_max_tokens_and_stop_sequences(client):
    assert (
        ask(client, "Write a long story about a dragon.", max_tokens=8).stop_reason == "max_tokens"
    )
    text = ask(client).content[0].text
    word = text.split()[2]
    cut = ask(client, stop_sequences=[word])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == word
    assert word not in cut.content[0].text


@pytest.mark.slow
def test_the_stream_assembles_the_non_streamed_message(client):
    want = ask(client)
    with client.messages.stream(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24,
        extra_body=GREEDY,
    ) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert final.content[0].text == want.content[0].text
    assert (
        final.stop_reason == want.stop_reason
        and final.usage.output_tokens == want.usage.output_tokens
    )


@pytest.mark.slow
def test_any_tool_choice_gives_tool_use_blocks_streamed_alike(client):
    msg = call_weather(client)
    assert msg.stop_reason == "tool_use"
    calls = [(b.name, b.input) for b in msg.content if b.type == "tool_use"]
    assert calls and all(name == "get_weather" and set(args) == {"city"} for name, args in calls)
    with client.messages.stream(
        model=MODEL,
        system=SYSTEM,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER],
        tool_choice=ONE_CALL,
        max_tokens=40,
        extra_body=GREEDY,
    ) as stream:
        final = stream.get_final_message()
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == calls
    assert final.stop_reason == "tool_use"


@pytest.mark.slow
def test_a_claude_code_session_is_one_job_pinned_between_turns(server, client):
    sid = "5f1d8a52-0c55-4a64-9a5e-0a7c2c0d3c11"
    metadata = {"user_id": json.dumps({"device_id": "d", "account_uuid": "", "session_id": sid})}
    before = server.metrics()
    question = {"role": "user", "content": "What is the weather in Oslo?"}
    first = call_weather(client, messages=[question], metadata=metadata)
    call = next(b for b in first.content if b.type == "tool_use")
    second = answer_call(client, question, first, call, "Rain", metadata=metadata, max_tokens=12)
    after = server.metrics()
    assert after["vllm:pin_hits_total"] - before["vllm:pin_hits_total"] == 1
    assert second.usage.cache_read_input_tokens > first.usage.input_tokens // 2
    log = (server.out_dir / "server.log").read_text()
    # The job: the session and a digest of the system prompt. Turn 1 called a tool and was
    # pinned; turn 2 answered in text and ended the job (no pin decision logged).
    job = f"{sid}/"
    assert log.count(f"job '{job}") and "func_call=get_weather -> pin" in log
    assert f"messages request {second.id}: job_id='{job}" in log


@pytest.mark.slow
def test_errors_are_anthropics(server, client):
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(
            model="no-such-model", max_tokens=4, messages=[{"role": "user", "content": "x"}]
        )
    assert e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as e:
        ask(client, max_tokens=0)
    assert e.value.body["type"] == "error" and "max_tokens" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="container"):
        ask(client, container="cntr_1")
    r = requests.post(
        server.base + "/v1/messages", data="{not json", headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    # A thinking budget needs --reasoning-parser (this server has none).
    with pytest.raises(anthropic.BadRequestError, match="--reasoning-parser"):
        ask(client, max_tokens=2048, thinking={"type": "enabled", "budget_tokens": 1024})
    # The prompt is over the context: a 400, and the server goes on.
    with pytest.raises(anthropic.BadRequestError, match="maximum context length"):
        ask(client, "word " * 9000)
    assert ask(client, max_tokens=2).stop_reason == "max_tokens"


@pytest.mark.slow
def test_a_request_shaped_as_claude_codes_streams(server):
    """The fields and headers Claude Code 2.1.328 sends with every turn (captured from the
    real CLI against a recording server; the texts here are our own)."""
    sid = "3960bc4c-2743-42f6-b94e-6150c2bacf35"
    user_id = json.dumps({"device_id": "0bf6", "account_uuid": "", "session_id": sid})
    body = {
        "model": MODEL,
        "max_tokens": 32000,  # more than the model's context: capped, as vLLM does
        "stream": True,
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.328; cch=1;"},
            {"type": "text", "text": "You are an agent.", "cache_control": {"type": "ephemeral"}},
        ],
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "<system-reminder>Be brief.</system-reminder>"},
                    {"type": "text", "text": "What is the capital of France?"},
                ],
            },
            {
                "role": "system",
                "content": [
                    {
                        "type": "text",
                        "text": "# Environment\nLinux",
                        "cache_control": {"type": "ephemeral"},
                    }
                ],
            },
        ],
        "tools": [WEATHER],
        "metadata": {"user_id": user_id},
        "thinking": {"type": "adaptive", "display": "omitted"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        "temperature": 0,
    }
    headers = {
        "x-api-key": "EMPTY",
        "anthropic-version": "2023-06-01",
        "anthropic-beta": "claude-code-20250219,context-management-2025-06-27,effort-2025-11-24",
        "X-Claude-Code-Session-Id": sid,
    }
    r = requests.post(
        server.base + "/v1/messages?beta=true", json=body, headers=headers, stream=True, timeout=120
    )
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = []
    for line in r.iter_lines():
        payload = json.loads(line[6:]) if line.startswith(b"data: ") else {"type": "ping"}
        if payload["type"] != "ping":  # the anthropic client's reader skips pings too
            events.append(EVENT.validate_python(payload))
        if events and events[-1].type == "content_block_delta":
            break  # the client leaves mid-answer (the model would write up to the context)
    r.close()
    assert [e.type for e in events[:2]] == ["message_start", "content_block_start"]
    assert events[0].message.usage.input_tokens > 0
    # The request is aborted in the engine and its blocks are freed or pinned: nothing runs.
    assert server.wait_metric("vllm:num_requests_running", 0.0) == 0.0
    log = (server.out_dir / "server.log").read_text()
    assert f"job_id='{sid}/" in log


def test_a_stream_that_waits_sends_pings_then_its_message(monkeypatch):
    """A request held in the queue (behind another job's turn, or in a long prefill)
    keeps its connection busy with Anthropic's ping events."""
    import asyncio
    from types import SimpleNamespace

    from vllm.entrypoints.anthropic import serving as serving_module
    from vllm.entrypoints.openai.tool_calling import ToolPlan
    from vllm.outputs import CompletionOutput, RequestOutput

    monkeypatch.setattr(serving_module, "PING_INTERVAL_S", 0.05)

    class SlowStream:
        prompt_token_ids = [1] * 40
        closed = False

        def __aiter__(self):
            return self

        async def __anext__(self):
            if getattr(self, "sent", False):
                raise StopAsyncIteration
            await asyncio.sleep(0.22)  # about four intervals in the queue
            self.sent = True
            out = CompletionOutput(0, "Paris.", [5, 6], finish_reason="stop")
            return RequestOutput("r", None, self.prompt_token_ids, [out], True, 32)

        async def aclose(self):
            self.closed = True

    from vllm.entrypoints.openai.cli_args import FrontendArgs

    chat = SimpleNamespace(
        cache_writes=lambda prompt, cached: 0, timing=lambda *a: {}, args=FrontendArgs()
    )
    serving = serving_module.AnthropicServingMessages(chat)
    stream = SlowStream()

    async def collect():
        gen = serving._stream("msg_1", MODEL, None, None, ToolPlan(), stream, None)
        return [e async for e in gen]

    events = [json.loads(e.split("\n")[1][6:]) for e in asyncio.run(collect())]
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message_start" and kinds[1] == "ping"
    assert 2 <= kinds.count("ping") <= 6
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert events[-2]["usage"]["cache_read_input_tokens"] == 32 and stream.closed
    for e in events:
        if e["type"] != "ping":  # the SDK's reader skips pings before its event types
            EVENT.validate_python(e)


@pytest.mark.slow
def test_a_side_request_of_the_session_leaves_the_main_conversations_pin(server, client):
    """Claude Code sends short side requests (title generation, ...) in the same session,
    with their own system prompt, while a tool runs. Each conversation is its own job, so
    the side request neither takes nor ends the main conversation's pin."""
    sid = "0b7e1d0a-5d0f-4b1e-8c47-6f3b2f9d1a20"
    headers = {"X-Claude-Code-Session-Id": sid}
    question = {"role": "user", "content": "What is the weather in Bergen?"}
    before = server.metrics()
    first = call_weather(client, messages=[question], extra_headers=headers)
    call = next(b for b in first.content if b.type == "tool_use")
    pinned = server.wait_metric("vllm:num_pinned_requests", 1.0)
    assert pinned == 1.0
    side = client.messages.create(
        model=MODEL,
        system="Write a 3-word title for this conversation.",
        messages=[{"role": "user", "content": "What is the weather in Bergen?"}],
        max_tokens=6,
        extra_headers=headers,
        extra_body=GREEDY,
    )
    assert side.content
    second = answer_call(client, question, first, call, "Snow", extra_headers=headers, max_tokens=8)
    after = server.metrics()
    assert after["vllm:pin_hits_total"] - before["vllm:pin_hits_total"] == 1
    assert second.usage.cache_read_input_tokens >= first.usage.input_tokens // 2
    log = (server.out_dir / "server.log").read_text()
    jobs = {
        line.split("job_id=")[1].split()[0]
        for line in log.splitlines()
        if sid in line and "messages request" in line
    }
    assert len(jobs) == 2  # the main conversation and the side request


@pytest.mark.slow
def test_models_in_each_clients_shape(server, client):
    page = client.models.list()
    (info,) = page.data
    assert info.id == MODEL and info.type == "model" and info.max_input_tokens == 8192
    assert client.models.retrieve(MODEL).max_tokens == 8192
    with pytest.raises(anthropic.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.body["error"]["type"] == "not_found_error"
    # Without anthropic-version: OpenAI's shapes, on the same routes.
    openai_client = server.client()
    assert openai_client.models.retrieve(MODEL).id == MODEL
    assert [m.id for m in openai_client.models.list()] == [MODEL]
    r = requests.get(server.base + "/v1/models/no-such-model")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


# -- cache diagnostics --------------------------------------------------------------------
def _fingerprint(prompt, model=MODEL, **kw):
    from vllm.entrypoints.anthropic.diagnostics import Fingerprint

    return Fingerprint.of(request(**kw), model, prompt)


def test_cache_miss_reasons_in_anthropics_order():
    user = {"role": "user", "content": "a"}
    reply = {"role": "assistant", "content": "b"}
    earlier = _fingerprint([1, 2, 3, 4], system="S", messages=[user])
    # Appended: the earlier prompt is this one's start (cache_control marks moved, and the
    # billing header changed: neither counts).
    marked = {"role": "user", "content": [{"type": "text", "text": "a"}]}
    same = _fingerprint(
        [1, 2, 3, 4, 5, 6],
        system=[
            {"type": "text", "text": "x-anthropic-billing-header: cch=9;"},
            {"type": "text", "text": "S", "cache_control": {"type": "ephemeral"}},
        ],
        messages=[user, reply, {"role": "user", "content": "c"}],
    )
    assert same.miss_reason(earlier) is None
    assert (
        _fingerprint([1, 2], system="S", messages=[marked]).miss_reason(
            _fingerprint([1, 2], system="S", messages=[marked | {"cache_control": None}])
        )
        is None
    )
    assert same.miss_reason(None) == {"type": "previous_message_not_found"}
    cases = {
        "model_changed": _fingerprint([1, 2, 9], "other", system="S", messages=[user, reply]),
        "system_changed": _fingerprint([1, 9], system="T", messages=[user, reply]),
        "tools_changed": _fingerprint(
            [1, 2, 3, 9],
            system="S",
            messages=[user, reply],
            tools=[{"name": "f", "input_schema": {}}],
        ),
        "messages_changed": _fingerprint([1, 2, 3, 4], system="S", messages=[reply]),
    }
    # What would have been read: the earlier prompt past the prefix both share.
    missed = {"model_changed": 2, "system_changed": 3, "tools_changed": 1, "messages_changed": 0}
    for kind, fp in cases.items():
        assert fp.miss_reason(earlier) == {"type": kind, "cache_missed_input_tokens": missed[kind]}
    # Everything alike, the tokens not (a template that rewrites an earlier turn).
    rewritten = _fingerprint([1, 2, 7, 4, 5], system="S", messages=[user, reply])
    assert rewritten.miss_reason(earlier) == {"type": "unavailable"}


def test_fingerprints_are_bounded_in_number_and_tokens():
    from vllm.entrypoints.anthropic.diagnostics import Fingerprints

    store = Fingerprints(max_messages=3, max_tokens=10)
    for i in range(4):
        store.put(f"m{i}", _fingerprint([1, 2]))
    assert len(store) == 3 and store.get("m0") is None and store.tokens == 6
    store.get("m1")  # used: the least recently used is now m2
    store.put("m4", _fingerprint(list(range(6))))
    assert store.get("m2") is None and store.get("m1") is not None and store.tokens <= 10
    store.put("huge", _fingerprint(list(range(11))))
    assert store.get("huge") is None


@pytest.mark.parametrize("value", [{"previous_message_id": 3}, {"x": 1}])
def test_bad_diagnostics_are_refused(value):
    with pytest.raises(ValidationError) as e:
        request(diagnostics=value)
    assert param_of(e) == "diagnostics"


@pytest.mark.slow
def test_cache_diagnostics_end_to_end(client):
    question = {"role": "user", "content": "What is the capital of Norway?"}
    kw = {"max_tokens": 8, "extra_body": GREEDY, "system": "You answer in one word."}
    first = client.messages.create(
        model=MODEL, messages=[question], diagnostics={"previous_message_id": None}, **kw
    )
    assert first.diagnostics.cache_miss_reason is None
    turn = [question, {"role": "assistant", "content": first.content[0].text}]
    turn.append({"role": "user", "content": "And of Sweden?"})
    second = client.messages.create(
        model=MODEL, messages=turn, diagnostics={"previous_message_id": first.id}, **kw
    )
    assert second.diagnostics.cache_miss_reason is None
    assert second.usage.cache_read_input_tokens > 0
    changed = client.messages.create(
        model=MODEL,
        messages=turn,
        diagnostics={"previous_message_id": second.id},
        **{**kw, "system": "You answer in French."},
    )
    reason = changed.diagnostics.cache_miss_reason
    assert reason.type == "system_changed" and reason.cache_missed_input_tokens > 0
    with client.messages.stream(
        model=MODEL, messages=turn, diagnostics={"previous_message_id": "msg_unknown"}, **kw
    ) as stream:
        final = stream.get_final_message()
    assert final.diagnostics.cache_miss_reason.type == "previous_message_not_found"


# -- context editing ----------------------------------------------------------------------
def _tool_loop(n: int, with_thinking: bool = False) -> list[dict]:
    """A conversation of ``n`` tool uses (bash, then read), each answered, then a question."""
    messages = [{"role": "user", "content": "Look around."}]
    for i in range(n):
        name = "read" if i % 2 else "bash"
        blocks = [{"type": "thinking", "thinking": f"step {i}", "signature": ""}] * with_thinking
        blocks.append({"type": "tool_use", "id": f"t{i}", "name": name, "input": {"arg": f"a{i}"}})
        messages.append({"role": "assistant", "content": blocks})
        result = {"type": "tool_result", "tool_use_id": f"t{i}", "content": f"output {i} " * 20}
        messages.append({"role": "user", "content": [result]})
    return messages


def _apply(messages, config, tokens=None):
    import asyncio

    from vllm.entrypoints.anthropic.context_edits import apply_edits, parse_edits

    async def count(msgs):  # a stand-in tokenizer: a token per 4 characters
        return len(json.dumps(msgs)) // 4

    edited, applied, _ = asyncio.run(apply_edits(messages, parse_edits(config), count))
    return edited, applied


def test_clear_tool_uses_keeps_the_last_ones_and_the_excluded_tools():
    messages = _tool_loop(5)
    edit = {
        "type": "clear_tool_uses_20250919",
        "trigger": {"type": "tool_uses", "value": 4},
        "keep": {"type": "tool_uses", "value": 2},
        "exclude_tools": ["read"],
        "clear_tool_inputs": True,
    }
    edited, applied = _apply(messages, {"edits": [edit]})
    results = [b["content"] for m in edited[2::2] for b in m["content"]]
    # t0 and t2 (bash, older than the last two) are cleared; t1 is a read (excluded).
    assert results[0] == results[2] == "[tool result cleared]"
    assert results[1].startswith("output 1") and results[3].startswith("output 3")
    assert [m["content"][0]["input"] for m in edited[1::2]] == [
        {},
        {"arg": "a1"},
        {},
        {"arg": "a3"},
        {"arg": "a4"},
    ]
    (report,) = applied
    assert report["type"] == "clear_tool_uses_20250919" and report["cleared_tool_uses"] == 2
    assert report["cleared_input_tokens"] > 0
    assert messages == _tool_loop(5)  # the request's own messages are left as they are
    # Below the trigger, or unable to clear clear_at_least tokens: nothing changes.
    assert (
        _apply(messages, {"edits": [{**edit, "trigger": {"type": "tool_uses", "value": 5}}]})[1]
        == []
    )
    tight = {**edit, "clear_at_least": {"type": "input_tokens", "value": 10**6}}
    assert _apply(messages, {"edits": [tight]}) == (messages, [])
    # The default trigger is 100k input tokens.
    assert _apply(messages, {"edits": [{"type": "clear_tool_uses_20250919"}]})[1] == []


def test_clear_thinking_keeps_the_last_turns():
    messages = _tool_loop(3, with_thinking=True)
    edited, applied = _apply(messages, {"edits": [{"type": "clear_thinking_20251015"}]})
    kinds = [[b["type"] for b in m["content"]] for m in edited[1::2]]
    assert kinds == [["tool_use"], ["tool_use"], ["thinking", "tool_use"]]  # keep 1 by default
    assert applied[0]["cleared_thinking_turns"] == 2
    keep_all = {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}
    assert _apply(messages, keep_all) == (messages, [])


@pytest.mark.slow
def test_context_editing_end_to_end(client):
    edit = {
        "type": "clear_tool_uses_20250919",
        "trigger": {"type": "tool_uses", "value": 2},
        "keep": {"type": "tool_uses", "value": 1},
    }
    messages = _tool_loop(4)
    tools = [
        {"name": n, "input_schema": {"type": "object", "properties": {"arg": {"type": "string"}}}}
        for n in ("bash", "read")
    ]
    kw = {"model": MODEL, "messages": messages, "tools": tools}
    extra = {"context_management": {"edits": [edit]}}
    count = client.messages.count_tokens(**kw, extra_body=extra)
    plain = client.messages.count_tokens(**kw)
    assert count.input_tokens < plain.input_tokens
    assert count.model_dump()["context_management"]["original_input_tokens"] == plain.input_tokens
    msg = client.messages.create(**kw, max_tokens=4, extra_body={**extra, **GREEDY})
    (report,) = msg.model_dump()["context_management"]["applied_edits"]
    assert report["cleared_tool_uses"] == 3
    assert report["cleared_input_tokens"] == plain.input_tokens - count.input_tokens
    with client.messages.stream(**kw, max_tokens=4, extra_body={**extra, **GREEDY}) as stream:
        events = [e for e in stream if e.type == "message_delta"]
    assert events[-1].model_dump()["context_management"]["applied_edits"] == [report]
